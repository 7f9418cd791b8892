import fcntl
import os

import pytest


@pytest.fixture(scope="session", autouse=True)
def _isolated_cache(tmp_path_factory):
    """Throughput benchmarks cached per test session, not in the user's ~/.cache."""
    os.environ["SWARM_CACHE_DIR"] = str(tmp_path_factory.mktemp("swarm-cache"))
    yield


@pytest.hookimpl(hookwrapper=True, tryfirst=True)
def pytest_runtest_protocol(item):
    """Under pytest-xdist (scripts/test.sh runs 2 workers), a test marked `alone` runs while no other test
    does: it asserts something that another swarm on the same cores would blur (a share of work decided
    by measured speeds). Every other test holds a shared lock, an `alone` one the exclusive lock; a
    turnstile lock keeps a waiting `alone` test from being overtaken. Taken before pytest-timeout's timer
    starts (this wrapper runs first), so the wait does not count against the test's timeout."""
    if not os.environ.get("PYTEST_XDIST_WORKER"):
        yield
        return
    root = item.config._tmp_path_factory.getbasetemp().parent  # the run's, above each worker's popen-gwN
    exclusive = item.get_closest_marker("alone") is not None
    with open(root / "alone.turnstile", "a") as turnstile, open(root / "alone.lock", "a") as lock:
        fcntl.flock(turnstile, fcntl.LOCK_EX)
        fcntl.flock(lock, fcntl.LOCK_EX if exclusive else fcntl.LOCK_SH)
        fcntl.flock(turnstile, fcntl.LOCK_UN)
        try:
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)
