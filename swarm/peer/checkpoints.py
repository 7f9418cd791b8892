"""Checkpoints of a stage: one peer per stage writes them (the live online peer with the smallest id,
chosen without coordination), atomically, in a thread off the event loop, whenever its step passes a
multiple of `every` (a writer that caught up by download writes the state it downloaded) and once
more at shutdown; a stage that lost all its peers is restored from the newest."""

from __future__ import annotations

import asyncio
import logging
import threading
from collections.abc import Callable

from swarm.core.states import PeerState
from swarm.peer.executor import StageExecutor
from swarm.training.config import RunConfig
from swarm.training.state import CheckpointStore, checkpoint_meta, stamp

logger = logging.getLogger(__name__)

FINAL_WRITE_TIMEOUT_S = 60.0


def stage_meta(run: RunConfig, stage: int) -> dict:
    """What a checkpoint must match to be loaded: stage, split and model (not the run id: a
    checkpoint may seed a new run of the same model and split)."""
    meta = checkpoint_meta(run.run_id, stage, run.num_stages, run.model)
    meta.pop("run_id")
    return meta


class CheckpointWriter:
    _lock = threading.Lock()  # one write at a time in this process

    def __init__(
        self,
        store: CheckpointStore,
        executor: StageExecutor,
        run: RunConfig,
        stage: int,
        every: int,
        peer_id: str,
        live_mates: Callable[[], list],
        on_written: Callable[[int, str], None] | None = None,
    ) -> None:
        self.store, self.executor, self.every = store, executor, every
        self.meta, self.spec = stage_meta(run, stage), run.model
        self.peer_id, self.live_mates = peer_id, live_mates
        self.on_written = on_written  # (step, path): e.g. an event for status and dashboards
        self._last_step = executor.step  # of the last update or state load seen

    def is_writer(self) -> bool:
        ids = [m.peer_id for m in self.live_mates() if m.record_state == PeerState.ONLINE] + [self.peer_id]
        return min(ids) == self.peer_id

    def after_step(self, step: int) -> threading.Thread | None:
        """After an update or a state download: write when the step passed a multiple of `every`. A
        writer that caught up by download (it skipped the multiple) writes the downloaded state; with
        "only on an update landing on the multiple", a lagging writer wrote none, and a whole stage
        killed after that was restored from far behind."""
        last, self._last_step = self._last_step, step
        if step // self.every > last // self.every and self.is_writer():
            return self.write_async()
        return None

    def load_latest(self, module, meta: dict):
        """The newest loadable checkpoint (state, checkpoint) or None; its step counts as seen."""
        found = self.store.load_latest(module, meta)
        if found is not None:
            self._last_step = found[1].step
        return found

    def write_async(self) -> threading.Thread:
        ex = self.executor
        future = ex.call(ex.state_dict)  # a snapshot between batches
        store, meta, spec = self.store, self.meta, self.spec

        def write() -> None:
            state = future.result()
            with self._lock:
                path = store.save(stamp(state, meta, spec))
            logger.info("checkpoint of stage %d at step %d written to %s", meta["stage"], state["step"], path)
            if self.on_written is not None:
                self.on_written(int(state["step"]), str(path))

        thread = threading.Thread(target=write, name="checkpoint-writer", daemon=False)
        thread.start()
        return thread

    async def write_final(self) -> None:
        """At shutdown: a last checkpoint if this peer writes them and its step is newer."""
        if not self.is_writer():
            return
        last = self.store.list()
        if not last or last[-1].step < self.executor.step:
            writer = self.write_async()
            await asyncio.get_running_loop().run_in_executor(None, writer.join, FINAL_WRITE_TIMEOUT_S)
