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


async def state_stream(executor: StageExecutor) -> AsyncIterator[bytes]:
    """GetState's messages: a consistent snapshot of `executor`'s state."""
    state = await asyncio.wrap_future(executor.call(executor.state_dict))
    data = await asyncio.get_running_loop().run_in_executor(None, serialize, state)
    async for chunk in blob_chunks(data, step=state["step"]):
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
