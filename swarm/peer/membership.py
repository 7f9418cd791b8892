"""A peer's place in the swarm: which stage it serves, and entering, leaving and moving between stages. A stage's parts
(module, executor, averager, step coordinator, checkpoint writer) form a `StageRuntime`, built on entering the stage
and torn down on leaving it: a move is a leave and an enter, not a mutation of the peer in place.

Entering a stage: announce "joining", build the stage, get its current state (an up-to-date live mate's over gRPC, else
the newest checkpoint, else a fresh seeded initialization), measure throughput, catch up if it moved on, then serve.
"""

from __future__ import annotations

import asyncio
import logging
import random
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from swarm.cluster.view import PeerStatus, SwarmView
from swarm.core.errors import StateError
from swarm.core.log import set_context
from swarm.core.states import PeerState, SyncMode
from swarm.dht.node import SwarmDHT
from swarm.dht.records import PeerEntry
from swarm.peer.checkpoints import CheckpointWriter, stage_meta
from swarm.peer.config import PeerConfig
from swarm.peer.executor import StageExecutor
from swarm.peer.ledger import StageLedger
from swarm.peer.records import EventLog, PeerRecords
from swarm.peer.serving import ServingState
from swarm.peer.state_transfer import download_state
from swarm.peer.stepping import StepCoordinator
from swarm.peer.throughput import measure_throughput
from swarm.policy.rebalance import join_stage
from swarm.training.averaging import AveragingFailed, StageAverager
from swarm.training.config import RunConfig
from swarm.training.models import BuiltStage, build_stage
from swarm.training.state import CheckpointStore, validate
from swarm.wire.pool import ClientPool

logger = logging.getLogger(__name__)

MATES_ANSWER_WAIT_S = 30.0  # on entering: how long to wait for listed mates to answer Info
NO_STATE_RETRY_S = 5.0  # a peer of a stage with no state looks for a source this often
STATE_SOURCES_TRIED = 3  # mates tried per state download round
EVENTS_WAIT_S = 3.0  # a move waits this long at most for its event to be on the DHT before going online
PROGRESS_POLLS = 4  # live peers of other stages asked for their step by a peer that finds no mate


@dataclass
class StageRuntime:
    """One stage's parts on this peer."""

    stage: int
    built: BuiltStage
    executor: StageExecutor
    checkpoints: CheckpointWriter | None = None
    averager: StageAverager | None = None
    stepper: StepCoordinator | None = None

    async def stop(self) -> None:
        """Stop the compute thread (after its current batch) and the averager, off the event loop."""
        loop = asyncio.get_running_loop()
        await loop.run_in_executor(None, self.executor.stop)
        if self.averager is not None:
            averager, self.averager = self.averager, None
            await loop.run_in_executor(None, averager.shutdown)


class Membership:
    def __init__(
        self,
        cfg: PeerConfig,
        run: RunConfig,
        dht: SwarmDHT,
        view: SwarmView,
        clients: ClientPool,
        serving: ServingState,
        records: PeerRecords,
        events: EventLog,
        device: torch.device,
    ) -> None:
        self.cfg, self.run, self.dht, self.view, self.clients = cfg, run, dht, view, clients
        self.serving, self.records, self.events, self.device = serving, records, events, device
        self.runtime: StageRuntime | None = None
        self.lock = asyncio.Lock()  # held by each update, and by a move for its whole length
        self.last_placement = time.monotonic()  # when this peer last joined or moved
        self.rng = random.Random()
        self.fallbacks: dict[str, int] = {}  # kind -> count: what this peer did that is not the normal path
        self.earlier_stages: dict[int, dict[str, int]] = {}  # stage -> work counters, once it left it

    # ---- what collaborators read ----

    @property
    def peer_id(self) -> str:
        return self.dht.peer_id

    @property
    def stage(self) -> int:
        return -1 if self.runtime is None else self.runtime.stage

    @property
    def executor(self) -> StageExecutor | None:
        return None if self.runtime is None else self.runtime.executor

    @property
    def step(self) -> int:
        return 0 if self.runtime is None else self.runtime.executor.step

    def is_accused(self) -> bool:
        """A trainer caught this peer lying: its mates leave it out of their updates."""
        return self.peer_id in self.view.accused

    def live_mates(self) -> list[PeerStatus]:
        """Live stage-mates, less those a trainer caught lying (they take no part in updates)."""
        return [m for m in self.view.stage_peers(self.stage) if m.peer_id not in self.view.accused]

    def event(self, kind: str, **fields: object) -> None:
        """An event of this peer's stage (a fallback, a stall): logged, counted and published."""
        self.fallbacks[kind] = self.fallbacks.get(kind, 0) + 1
        self.serving.fallbacks = dict(self.fallbacks)
        self.events.add(kind, stage=self.stage, **fields)

    def start_averager(self) -> StageAverager | None:
        """The stage's hivemind averager process, started on its first need (a round of more than
        --averaging-direct-max members: smaller stages never fork one), or a new one when the old one
        died; on the event loop's (main) thread, as every averager (swarm.training.averaging)."""
        rt = self.runtime
        if rt is None:
            return None
        old, rt.averager = rt.averager, None
        if old is not None:
            old.shutdown()
        rt.averager = StageAverager(self.dht.dht, self.run.run_id, rt.stage, rt.executor.params, self.cfg.averaging)
        if old is not None:
            self.event("averager_restarted")
        logger.log(logging.WARNING if old else logging.INFO, "started an averager process (the old one: %s)", old)
        return rt.averager

    def _ledger_path(self, stage: int) -> Path | None:
        if not self.cfg.ledger_dir:
            return None
        Path(self.cfg.ledger_dir).mkdir(parents=True, exist_ok=True)
        return Path(self.cfg.ledger_dir) / f"stage{stage}-{self.peer_id[-12:]}.jsonl"

    def may_move(self, urgent: bool = False) -> bool:
        """Online, and not just joined or moved (`urgent`: a stage is empty, the swarm is stalled)."""
        cooling = not urgent and time.monotonic() - self.last_placement < self.cfg.move_cooldown_s
        return self.serving.state == PeerState.ONLINE and not cooling

    def read_records(self) -> dict[int, list[PeerEntry]]:
        """Every stage's DHT records (blocking, within the DHT deadline)."""
        return self.dht.get_all_stages(self.run.num_stages)

    async def refresh_accusations(self) -> None:
        await self.view.refresh_accusations()

    async def refresh_view(self) -> None:
        await self.view.refresh_dht()
        await self.view.poll_info({self.stage})

    def want_view_read(self) -> None:
        self.view.dht_reads.want()

    # ---- choosing, entering and leaving a stage ----

    async def pick_stage(self) -> int:
        run = self.run
        if self.cfg.stage != "auto":
            stage = int(self.cfg.stage)
            if not 0 <= stage < run.num_stages:
                raise ValueError(f"--stage {stage} outside 0..{run.num_stages - 1} for run {run.run_id}")
            return stage
        await asyncio.sleep(self.rng.uniform(0, 0.5))  # de-synchronize peers started together
        records = await asyncio.get_running_loop().run_in_executor(None, self.read_records)
        serving = (PeerState.ONLINE, PeerState.JOINING)
        totals = [
            sum(e.record.throughput for e in records[k] if e.record.state in serving) for k in range(run.num_stages)
        ]
        return join_stage(totals, self.rng)

    async def enter(self, stage: int) -> None:
        """Build the stage, get its current state, measure throughput; the peer then serves it."""
        await self._prepare(stage)
        self._go_online()

    def _go_online(self) -> None:
        self.serving.state = PeerState.ONLINE
        set_context(step=self.step)

    async def _prepare(self, stage: int) -> None:
        """Everything entering `stage` takes but going online: the peer is `joining` meanwhile."""
        run, cfg = self.run, self.cfg
        loop = asyncio.get_running_loop()
        set_context(stage=stage, step=0)
        self.serving.state = PeerState.JOINING
        built = await loop.run_in_executor(None, build_stage, run.model, stage, run.num_stages)
        executor = StageExecutor(
            built,
            run.optim,
            self.device,
            max_batch_samples=run.microbatch,  # microbatches one at a time (swarm.peer.executor.thread)
            predict_params=run.sync == SyncMode.ASYNC and run.predict_params,
            prior_samples=max(1, run.global_batch // 4),
            ledger=StageLedger(stage, self._ledger_path(stage)),
            activation_budget_bytes=cfg.activation_cache_mb << 20,
        )
        executor.lie = self.serving.lie
        rt = self.runtime = StageRuntime(stage, built, executor)
        self.serving.stage, self.serving.schema, self.serving.executor = stage, built.schema, executor
        self.serving.throughput = 0.0
        # announce "joining" at once so that auto-placed peers see each other
        await loop.run_in_executor(None, self.records.announce, stage, PeerState.JOINING)
        if cfg.checkpoint_dir:
            store = CheckpointStore(cfg.checkpoint_dir, stage, keep=cfg.checkpoint_keep)
            written = lambda step, path: self.events.add("checkpoint", stage=stage, step=step)  # noqa: E731
            rt.checkpoints = CheckpointWriter(
                store, executor, run, stage, cfg.checkpoint_every, self.peer_id, self.live_mates, written
            )
        await self.refresh_view()
        await self._initial_state(rt)
        # the averager (on this main thread) now if the stage is too large for direct averaging, else on need
        if len(self.live_mates()) + 1 > cfg.averaging.direct_max_members:
            try:
                rt.averager = StageAverager(self.dht.dht, run.run_id, stage, executor.params, cfg.averaging)
            except AveragingFailed as e:
                logger.warning("%s; the stage's first round tries again", e)
        rt.stepper = StepCoordinator(
            executor, rt.averager, self, self.clients, run.run_id, run.global_batch, self._after_update,
            cfg.stall_report_s, direct_max=cfg.averaging.direct_max_members,
            direct_timeout_s=cfg.averaging.allreduce_timeout_s, shard_min_bytes=cfg.averaging.shard_min_bytes,
        )  # fmt: skip
        self.serving.throughput = await loop.run_in_executor(
            None, measure_throughput, executor, built.schema, run.model, run.microbatch, cfg.use_benchmark_cache
        )
        await self.view.poll_info({stage})
        if any(m.step > executor.step for m in self.live_mates()):
            await self.sync_from_mates()  # the stage moved on while this peer was getting ready

    def _after_update(self, step: int) -> None:
        # no record store for a new step: the periodic refresh carries it, Info the live step (ARCHITECTURE)
        self.serving.notify_step()
        if self.runtime is not None and self.runtime.checkpoints is not None:
            self.runtime.checkpoints.after_step(step)

    async def leave(self) -> None:
        """Stop serving the current stage: drain, let pending gradients go out, free its resources.
        Gradients this peer holds but has not applied go back to the trainers, which replay them on a
        stage-mate once this peer's record says offline."""
        loop = asyncio.get_running_loop()
        rt = self.runtime
        self.serving.state = PeerState.DRAINING
        await loop.run_in_executor(None, self.records.announce, rt.stage, PeerState.DRAINING)
        await self.drain()
        await loop.run_in_executor(None, self.records.announce, rt.stage, PeerState.OFFLINE)
        await rt.stop()
        done = self.earlier_stages.setdefault(rt.stage, {})
        done.update({k: done.get(k, 0) + v for k, v in rt.executor.work_counters().items()})

    async def drain(self) -> None:
        """Wait (up to the drain timeout) for the requests in flight to finish."""
        deadline = time.monotonic() + self.cfg.drain_timeout_s
        while self.serving.in_flight > 0 and time.monotonic() < deadline:
            await asyncio.sleep(0.02)

    async def move_to(self, dst: int, reason: str, before: float, after: float) -> None:
        """Drain, load the new stage's state, announce it: the peer serves `dst`."""
        started, src = time.monotonic(), self.stage
        logger.info("moving from stage %d to stage %d: %s", src, dst, reason)
        async with self.lock:
            loop = asyncio.get_running_loop()
            # count at the destination at once, so that other peers plan with this move in mind
            await loop.run_in_executor(None, self.records.announce, dst, PeerState.JOINING)
            await self.leave()
            self.view.poll_stages = {dst}
            await self._prepare(dst)
            seconds = time.monotonic() - started
            rounded = {"before": round(before, 2), "after": round(after, 2), "seconds": round(seconds, 2)}
            self.events.add("move", publish=False, src=src, dst=dst, reason=reason, step=self.step, **rounded)
            await self.publish_events()  # before the record says online: whoever sees the layout sees the move
            self._go_online()
            self.records.refresh_now()
        self.last_placement = time.monotonic()
        logger.info("moved from stage %d to stage %d in %.2f s", src, dst, seconds)

    async def publish_events(self) -> None:
        """Store this peer's events now, waiting at most EVENTS_WAIT_S (the event log's worker ends a slow one)."""
        pending = asyncio.get_running_loop().run_in_executor(None, self.events.publish)
        try:
            await asyncio.wait_for(asyncio.shield(pending), EVENTS_WAIT_S)
        except TimeoutError:
            logger.info("the events are not on the DHT yet (slow store): going online all the same")

    # ---- the stage's state ----

    async def _reachable_mates(self, timeout_s: float) -> list[PeerStatus]:
        """The stage's online mates that answer Info. A mate listed in the DHT but not yet polled (its step unknown)
        is waited for, up to `timeout_s`: starting from the seeded initialization next to an up-to-date mate that
        merely answered slowly would throw the stage back to step 0 once that mate leaves. A mate that fails three
        polls in a row counts as gone."""
        deadline = time.monotonic() + timeout_s
        while True:
            listed = [
                m for m in self.view.stage_peers(self.stage, live_only=False) if m.record_state == PeerState.ONLINE
            ]
            answered = [m for m in listed if m.last_info_ok and self.view.is_live(m)]
            pending = [m for m in listed if m not in answered and m.info_failures < 3]
            if not pending or time.monotonic() > deadline:
                return answered
            await asyncio.sleep(0.25)
            await self.view.poll_info({self.stage})

    async def _initial_state(self, rt: StageRuntime) -> None:
        mates = await self._reachable_mates(min(MATES_ANSWER_WAIT_S, self.cfg.state_timeout_s))
        if mates and max(m.step for m in mates) > 0:
            deadline = time.monotonic() + self.cfg.state_timeout_s
            while time.monotonic() < deadline:
                if await self.sync_from_mates():
                    return
                await asyncio.sleep(1.0)
                await self.view.poll_info({rt.stage})
            logger.warning("could not download the stage's state from any mate")
        if not mates and await self._restore_checkpoint(rt):
            return
        if not mates and await self._run_has_progressed():
            if not self.cfg.allow_reinit:
                return await self._wait_for_state(rt)
            logger.warning("stage %d has no state left anywhere: starting it again from its initialization", rt.stage)
            self.event("reinit")
            return
        logger.info("stage %d starts from its seeded initialization", rt.stage)

    async def _restore_checkpoint(self, rt: StageRuntime) -> bool:
        if rt.checkpoints is None:
            return False
        loop = asyncio.get_running_loop()
        meta = stage_meta(self.run, rt.stage)
        found = await loop.run_in_executor(None, rt.checkpoints.load_latest, rt.executor.module, meta)
        if found is None:
            return False
        state, ckpt = found
        await asyncio.wrap_future(rt.executor.call(lambda: rt.executor.load_state_dict(state)))
        logger.info("restored stage %d from checkpoint %s (step %d)", rt.stage, ckpt.path, ckpt.step)
        return True

    async def _run_has_progressed(self) -> bool:
        """Some stage has applied updates: a stage starting from scratch now would not be the run's. A
        record's step is up to a refresh (5 s) old, so a few live peers of the other stages are asked too."""
        records = await asyncio.get_running_loop().run_in_executor(None, self.read_records)
        if any(e.record.step > 0 for entries in records.values() for e in entries):
            return True
        return await self.view.some_peer_past(0, set(records) - {self.stage}, PROGRESS_POLLS)

    async def _wait_for_state(self, rt: StageRuntime) -> None:
        """No live mate and no checkpoint, but the run has progressed: the stage has "no state". Wait
        for a peer with the stage's state or a checkpoint (never re-initialize silently)."""
        note = f"no state: stage {rt.stage} lost every peer and checkpoint; waiting for a peer with its state"
        logger.error("%s (or restart peers with --allow-reinit to start the stage again from scratch)", note)
        self.serving.note = note
        self.event("no_state")
        while True:
            await asyncio.sleep(NO_STATE_RETRY_S)
            await self.refresh_view()
            mates = await self._reachable_mates(0.0)
            if (mates and await self.sync_from_mates()) or await self._restore_checkpoint(rt):
                break
        self.serving.note = ""
        logger.info("stage %d has its state again (step %d)", rt.stage, rt.executor.step)

    async def sync_from_mates(self, preferred: PeerStatus | None = None) -> bool:
        """Download the state of `preferred`, else of the most advanced live mate (trying up to three);
        True on success."""
        rt = self.runtime
        serving = (PeerState.ONLINE, PeerState.DRAINING)
        mates = sorted((m for m in self.live_mates() if m.record_state in serving), key=lambda m: -m.step)
        if preferred is not None:
            mates = [preferred] + [m for m in mates if m.peer_id != preferred.peer_id]
        for mate in mates[:STATE_SOURCES_TRIED]:
            started = time.monotonic()
            client = self.clients.get(mate.load.address)
            try:
                state = await download_state(
                    client, self.run.run_id, rt.stage, self.cfg.state_timeout_s, self.cfg.max_state_bytes
                )
                validate(state, rt.executor.module)
            except (StateError, Exception) as e:  # noqa: BLE001 - try the next mate
                logger.warning("state download from %s failed: %s", mate.peer_id[-6:], e)
                continue
            dropped = await asyncio.wrap_future(rt.executor.call(lambda s=state: rt.executor.load_state_dict(s)))
            if dropped:
                self.event("dropped_for_replay", samples=dropped, step=rt.executor.step)
            set_context(step=rt.executor.step)
            self._after_update(rt.executor.step)  # Info long polls, the record, a checkpoint if due
            logger.info(
                "downloaded stage %d state at step %d from %s in %.2f s",
                rt.stage, state["step"], mate.peer_id[-6:], time.monotonic() - started,
            )  # fmt: skip
            return True
        return False
