"""A peer whose address refuses connections is dead at once; one that does not answer (paused, cut
off) keeps the liveness window. Real gRPC Info polls against a closed port and a silent listener."""

import asyncio
import socket
import time

from swarm.cluster.view import REFUSALS_DEAD, PeerStatus, SwarmView
from swarm.core.states import PeerState
from swarm.policy.wiring import PeerLoad
from swarm.wire.pool import ClientPool


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]  # closed again: connections to it are refused


def _poll(address: str, polls: int) -> tuple[PeerStatus, bool]:
    async def go():
        clients = ClientPool()
        view = SwarmView(None, 1, clients, info_timeout_s=0.3)
        status = PeerStatus(PeerLoad("peer-a", 0, address), record_state=PeerState.ONLINE)
        status.last_info_ok = time.monotonic()  # it answered a moment ago
        view.peers[status.peer_id] = status
        try:
            for _ in range(polls):
                await view._poll_one(status)
            return status, view.is_live(status)
        finally:
            await clients.close()

    return asyncio.run(go())


def test_a_refusing_address_is_dead_after_two_polls_not_four_seconds():
    status, live = _poll(f"127.0.0.1:{_closed_port()}", 1)
    assert status.refusals == 1 and live  # one refusal could be a race with a restart
    status, live = _poll(f"127.0.0.1:{_closed_port()}", REFUSALS_DEAD)
    assert status.refusals == REFUSALS_DEAD and not live


def test_a_silent_listener_keeps_the_liveness_window():
    with socket.create_server(("127.0.0.1", 0)) as server:  # takes connections, never answers
        status, live = _poll(f"127.0.0.1:{server.getsockname()[1]}", 3)
    assert status.info_failures == 3 and status.refusals == 0 and live
