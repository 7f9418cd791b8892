import pytest

from swarm.local import LocalOptions, LocalSwarm
from tests.integration.helpers import StatusReader, assert_all_reaped


@pytest.fixture
def make_swarm(tmp_path):
    """Build LocalSwarms whose every process (and process group: p2pd too) is reaped at teardown."""
    swarms: list[LocalSwarm] = []

    def make(**kwargs) -> LocalSwarm:
        kwargs.setdefault("log_dir", str(tmp_path / f"swarm{len(swarms)}"))
        swarm = LocalSwarm(LocalOptions(**kwargs))
        swarms.append(swarm)
        return swarm

    yield make
    pgids = []
    for swarm in swarms:
        pgids += [p.pgid for p in swarm.all_processes()]
        swarm.stop()
    assert_all_reaped(pgids)


@pytest.fixture
def read_status():
    """StatusReaders of LocalSwarms (`read_status(swarm)()` is the swarm's status), closed at teardown
    before the swarms stop."""
    readers: list[StatusReader] = []

    def make(swarm) -> StatusReader:
        readers.append(StatusReader(swarm))
        return readers[-1]

    yield make
    for reader in readers:
        reader.close()
