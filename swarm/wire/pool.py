"""One client (a gRPC channel, and a lane connection when the peer offers one) per peer address,
shared by every call of a process."""

from __future__ import annotations

import logging

from swarm.wire.auth import MemberCredentials
from swarm.wire.client import DEFAULT_STREAM_THRESHOLD, StageClient
from swarm.wire.options import MiB

logger = logging.getLogger(__name__)


class ClientPool:
    def __init__(
        self, max_message_bytes: int = 256 * MiB, stream_threshold: int = DEFAULT_STREAM_THRESHOLD, lane: bool = True
    ) -> None:
        self.max_message_bytes = max_message_bytes
        self.stream_threshold = stream_threshold
        self.lane = lane  # Forward/Backward over a peer's lane when it offers one (swarm.wire.lane)
        self.credentials: MemberCredentials | None = None  # set once before the first call: a private swarm
        self._clients: dict[str, StageClient] = {}

    def get(self, address: str) -> StageClient:
        client = self._clients.get(address)
        if client is None:
            client = self._clients[address] = StageClient(
                address, self.max_message_bytes, self.stream_threshold, self.credentials
            )
            client.use_lane = client.use_lane and self.lane
        return client

    async def close(self) -> None:
        clients, self._clients = list(self._clients.values()), {}
        for client in clients:
            try:
                await client.close()
            except Exception as e:  # noqa: BLE001 - closing anyway
                logger.debug("closing the channel to %s failed: %s", client.address, e)
