"""A stage's state between peers: what GetState streams (a snapshot taken between batches on the
compute thread, serialized off the event loop, sent as a checksummed blob) and how a joining or
catching-up peer downloads and checks it."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

from swarm.core.errors import StateError
from swarm.peer.executor import StageExecutor
from swarm.training.state import deserialize, serialize
from swarm.wire.blob import blob_chunks, receive_blob
from swarm.wire.client import StageClient
from swarm.wire.protocol import pb


class StateSnapshots:
    """GetState's messages: a consistent snapshot of the stage's state, taken between batches and
    serialized off the event loop once per step (a flood of GetState costs one serialization, and
    one cached copy)."""

    def __init__(self) -> None:
        self._cached: tuple[int, int, bytes] | None = None  # (executor id, step, serialized state)
        self._lock = asyncio.Lock()

    async def stream(self, executor: StageExecutor) -> AsyncIterator[bytes]:
        async with self._lock:
            cached = self._cached
            if cached is None or cached[0] != id(executor) or cached[1] != executor.step:
                state = await asyncio.wrap_future(executor.call(executor.state_dict))
                data = await asyncio.get_running_loop().run_in_executor(None, serialize, state)
                cached = self._cached = (id(executor), int(state["step"]), data)
        async for chunk in blob_chunks(cached[2], step=cached[1]):
            yield chunk


async def download_state(client: StageClient, run_id: str, stage: int, timeout_s: float, max_bytes: int) -> dict:
    """Fetch a stage's state from one peer and check it arrived whole (size and sha256)."""
    stream = client.get_state(pb.StateRequest(run_id=run_id, stage=stage), timeout=timeout_s)
    header, data = await receive_blob(stream, max_bytes)
    if "sha256" not in header:
        raise StateError("state header has no checksum")
    state = deserialize(bytes(data))
    if state["step"] != header.get("step"):
        raise StateError(f"state step {state['step']} differs from its header's {header.get('step')}")
    return state
