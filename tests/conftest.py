import os

import pytest


@pytest.fixture(scope="session", autouse=True)
def _isolated_cache(tmp_path_factory):
    """Throughput benchmarks cached per test session, not in the user's ~/.cache."""
    os.environ["SWARM_CACHE_DIR"] = str(tmp_path_factory.mktemp("swarm-cache"))
    yield
