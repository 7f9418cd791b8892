"""The run-peer daemon: joins the DHT, takes a stage, serves Forward/Backward over gRPC, accumulates
gradients, and applies updates together with its stage-mates (swarm.peer.stepping).

On joining a stage the peer first gets the stage's current state: from an up-to-date live mate over
gRPC (GetState), else from the newest checkpoint of that stage, else a fresh seeded initialization;
only then does it announce itself online.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import cProfile
import json
import logging
import os
import random
import signal
import sys
import threading
import time
from dataclasses import dataclass, field

import torch

from swarm import __version__
from swarm.training.averaging import AveragingConfig, StageAverager
from swarm.training.config import RunConfig
from swarm.dht.node import Announcer, PeerRecord, SwarmDHT
from swarm.peer.executor import StageExecutor
from swarm.core.log import set_context
from swarm.training.models import build_stage
from swarm.peer.partials import MatePartials
from swarm.peer.placement import PlacementLoop
from swarm.core.procs import READY_PREFIX
from swarm.policy.rebalance import join_stage
from swarm.peer.server import Limits, ServingState, StageService, start_server
from swarm.training.state import CheckpointStore, StateError, checkpoint_meta, download, serialize, stamp, state_chunks, validate
from swarm.peer.stepping import StepCoordinator
from swarm.peer.throughput import measure_throughput
from swarm.cluster.view import ClientPool, SwarmView
from swarm.wire.codec import codec_from_name

logger = logging.getLogger(__name__)


@dataclass
class PeerConfig:
    run_id: str
    initial_peers: list[str] = field(default_factory=list)
    stage: str = "auto"  # an index, or "auto": the stage with the least total throughput
    host: str = "127.0.0.1"
    port: int = 0
    announce_host: str | None = None
    dht_port: int = 0
    device: str = "auto"
    threads: int = 0  # torch intra-op threads; 0 keeps torch's default
    announce_period: float = 2.0
    record_ttl: float = 8.0
    poll_interval: float = 0.05
    mates_poll_interval: float = 0.1
    partial_step_timeout: float = 30.0
    join_timeout: float = 60.0
    drain_timeout: float = 10.0
    state_timeout: float = 120.0
    max_message_mb: int = 256
    use_benchmark_cache: bool = True
    checkpoint_dir: str | None = None
    checkpoint_every: int = 50
    checkpoint_keep: int = 3
    averaging: AveragingConfig = field(default_factory=AveragingConfig)
    fail_at_step: int | None = None  # fault injection: act at this step (torchft-style hook)
    fail_mode: str = "kill"  # kill (SIGKILL self), stop (SIGSTOP self), exit (os._exit(3))
    rebalance: bool = True
    rebalance_period: float = 15.0  # seconds between checks, with +-30% jitter
    rebalance_threshold: float = 0.1  # a move must raise the bottleneck by this x the mean peer throughput
    move_cooldown: float = 60.0  # seconds after joining or moving before this peer moves (again)
    events_ttl: float = 600.0

    def __post_init__(self) -> None:
        if self.stage != "auto" and not str(self.stage).isdigit():
            raise ValueError(f"--stage must be a stage index or 'auto', got {self.stage!r}")
        if self.fail_mode not in ("kill", "stop", "exit"):
            raise ValueError(f"--fail-mode must be kill, stop or exit, got {self.fail_mode!r}")
        if self.checkpoint_every < 1:
            raise ValueError("--checkpoint-every must be >= 1")


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    device = torch.device(name)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError("--device cuda requested but CUDA is not available")
    return device


def fetch_run_config(dht: SwarmDHT, timeout: float) -> RunConfig:
    """Wait for the run config record, with a deadline."""
    deadline = time.monotonic() + timeout
    delay = 0.2
    while True:
        text = dht.get_config_json()
        if text is not None:
            return RunConfig.from_json(text)
        if time.monotonic() > deadline:
            raise TimeoutError(
                f"no run config for run {dht.run_id!r} on the DHT after {timeout:.0f} s: is the coordinator up, "
                "and are --initial-peers and --run-id right?"
            )
        time.sleep(delay)
        delay = min(2.0, delay * 1.5)


class Peer:
    def __init__(self, cfg: PeerConfig) -> None:
        self.cfg = cfg
        self.rng = random.Random()
        self.dht: SwarmDHT | None = None
        self.run: RunConfig | None = None
        self.executor: StageExecutor | None = None
        self.averager: StageAverager | None = None
        self.stepper: StepCoordinator | None = None
        self.checkpoints: CheckpointStore | None = None
        self.serving: ServingState | None = None
        self.announcer: Announcer | None = None
        self.view: SwarmView | None = None
        self.clients = ClientPool(cfg.max_message_mb << 20)
        self.stop_event = asyncio.Event()
        self.address = ""
        self.device = resolve_device(cfg.device)
        self.stage = -1
        self._tasks: list[asyncio.Task] = []
        self._checkpoint_lock = threading.Lock()
        self.stage_lock = asyncio.Lock()  # held by each update, and by a move for its whole length
        self.events: collections.deque[str] = collections.deque(maxlen=16)
        self.last_placement = time.monotonic()  # when this peer last joined or moved
        self.partials: MatePartials | None = None  # async look-ahead: mates' gradient sums

    # ---- records ----

    def record(self, state: str | None = None) -> PeerRecord:
        s = self.serving
        ex = self.executor
        return PeerRecord(
            peer_id=self.dht.peer_id,
            state=state or s.state,
            address=self.address,
            throughput=float(s.throughput),
            queue=0 if ex is None else ex.queue_length,
            step=0 if ex is None else ex.step,
            version=__version__,
            device=self.device.type,
        )

    def _publish(self, ttl: float) -> bool:
        return self.dht.announce_peer(self.stage, self.record(), ttl)

    def _publish_offline(self) -> None:
        self.dht.announce_peer(self.stage, self.record("offline"), self.cfg.record_ttl)

    async def _refresh_view(self) -> None:
        await self.view.refresh_dht()
        await self.view.poll_info({self.stage})

    def live_mates(self) -> list:
        return [] if self.view is None else self.view.stage_peers(self.stage)

    # ---- lifecycle ----

    async def start(self) -> None:
        cfg = self.cfg
        loop = asyncio.get_running_loop()
        if cfg.threads:
            torch.set_num_threads(cfg.threads)
        # on the main thread, which outlives the DHT process (see swarm.dht._DyingDHT)
        self.dht = SwarmDHT(
            cfg.run_id, cfg.initial_peers, host=cfg.host, port=cfg.dht_port, announce_host=cfg.announce_host
        )
        set_context(peer=self.dht.peer_id[-6:])
        self.run = await loop.run_in_executor(None, fetch_run_config, self.dht, cfg.join_timeout)
        run = self.run
        self.serving = ServingState(run.run_id, self.dht.peer_id, __version__)
        self.serving.codec = codec_from_name(run.codec)
        self.serving.exact = run.sync == "exact"
        self.serving.state_provider = self._state_stream
        limits = Limits(max_message_bytes=cfg.max_message_mb << 20, max_batch=run.max_batch)
        self.server, port = await start_server(StageService(self.serving, limits), cfg.host, cfg.port, limits)
        self.address = f"{cfg.announce_host or cfg.host}:{port}"
        self.view = SwarmView(
            self.dht,
            run.num_stages,
            self.clients,
            exclude_peer=self.dht.peer_id,
            dead_after=3.0,
            info_period=cfg.mates_poll_interval,
        )
        await self.enter_stage(await self._pick_stage())
        self.announcer = Announcer(self._publish, cfg.announce_period, cfg.record_ttl, name="peer-announcer").start()
        self.view.start(poll_stages={self.stage})
        self._tasks = [asyncio.create_task(self._step_loop()), asyncio.create_task(self._config_keeper())]
        if run.sync == "async" and run.predict_params:
            self.partials = MatePartials(
                lambda: self.executor,
                self.live_mates,
                self.clients,
                run.run_id,
                lambda: self.stage,
                max_bytes=cfg.max_message_mb << 22,
            )
            self.view.info_listeners.append(self.partials.poll)  # fetch as soon as a mate's count grows
            self._tasks.append(asyncio.create_task(self.partials.run()))
        if cfg.rebalance:
            self._tasks.append(asyncio.create_task(PlacementLoop(self).run()))
        self.event("join", stage=self.stage, step=self.executor.step, throughput=round(self.serving.throughput, 2))
        ready = {
            "role": "peer",
            "peer_id": self.dht.peer_id,
            "stage": self.stage,
            "step": self.executor.step,
            "address": self.address,
            "dht_maddrs": self.dht.visible_maddrs(),
            "throughput": self.serving.throughput,
            "pid": os.getpid(),
        }
        print(READY_PREFIX + json.dumps(ready), flush=True)
        logger.info(
            "serving stage %d from step %d at %s (%.1f samples/s)",
            self.stage,
            self.executor.step,
            self.address,
            self.serving.throughput,
        )

    async def _pick_stage(self) -> int:
        run = self.run
        if self.cfg.stage != "auto":
            stage = int(self.cfg.stage)
            if not 0 <= stage < run.num_stages:
                raise ValueError(f"--stage {stage} outside 0..{run.num_stages - 1} for run {run.run_id}")
            return stage
        loop = asyncio.get_running_loop()
        await asyncio.sleep(self.rng.uniform(0, 0.5))  # de-synchronize peers started together
        records = await loop.run_in_executor(None, self.dht.get_all_stages, run.num_stages)
        totals = [
            sum(e.record.throughput for e in records[k] if e.record.state in ("online", "joining"))
            for k in range(run.num_stages)
        ]
        return join_stage(totals, self.rng)

    async def enter_stage(self, stage: int) -> None:
        """Build the stage, get its current state, measure throughput; the peer is then ready to serve."""
        run, cfg = self.run, self.cfg
        loop = asyncio.get_running_loop()
        self.stage = stage
        set_context(stage=stage, step=0)
        self.serving.state = "joining"
        built = await loop.run_in_executor(None, build_stage, run.model, stage, run.num_stages)
        self.executor = StageExecutor(
            built,
            run.optim,
            self.device,
            max_batch_samples=max(run.max_batch, run.microbatch),
            predict_params=run.sync == "async" and run.predict_params,
            prior_samples=max(1, run.global_batch // 4),
        )
        self.serving.stage, self.serving.schema, self.serving.executor = stage, built.schema, self.executor
        self.serving.throughput = 0.0
        # announce "joining" at once so that auto-placed peers see each other
        await loop.run_in_executor(None, self.dht.announce_peer, stage, self.record("joining"), cfg.record_ttl)
        if cfg.checkpoint_dir:
            self.checkpoints = CheckpointStore(cfg.checkpoint_dir, stage, keep=cfg.checkpoint_keep)
        await self.view.refresh_dht()
        await self.view.poll_info({stage})
        await self._initial_state()
        # one averager per process, created on this (main) thread: see swarm.training.averaging
        self.averager = StageAverager(self.dht.dht, run.run_id, stage, self.executor.params, cfg.averaging)
        self.stepper = StepCoordinator(
            self.executor,
            self.averager,
            self.dht.peer_id,
            self.live_mates,
            self.sync_from_mates,
            run.global_batch,
            cfg.partial_step_timeout,
            after_update=self._after_update,
            refresh_view=self._refresh_view,
        )
        self.serving.throughput = await loop.run_in_executor(
            None, measure_throughput, self.executor, built.schema, run.model, run.microbatch, cfg.use_benchmark_cache
        )
        await self.view.poll_info({stage})
        if any(m.step > self.executor.step for m in self.live_mates()):
            await self.sync_from_mates()  # the stage moved on while this peer was getting ready
        self.serving.state = "online"
        set_context(step=self.executor.step)

    def _meta(self) -> dict:
        run = self.run
        meta = checkpoint_meta(run.run_id, self.stage, run.num_stages, run.model)
        meta.pop("run_id")  # a checkpoint may seed a new run of the same model and split
        return meta

    async def _reachable_mates(self, timeout: float) -> list:
        """The stage's online mates that answer Info. A mate listed in the DHT but not yet polled
        (its step unknown) is waited for, up to `timeout`: starting from the seeded initialization
        next to an up-to-date mate that merely answered slowly would throw the stage back to step 0
        once that mate leaves. A mate that fails three polls in a row counts as gone."""
        deadline = time.monotonic() + timeout
        while True:
            listed = [m for m in self.view.stage_peers(self.stage, live_only=False) if m.record_state == "online"]
            answered = [m for m in listed if m.last_info_ok and self.view.is_live(m)]
            pending = [m for m in listed if m not in answered and m.info_failures < 3]
            if not pending or time.monotonic() > deadline:
                return answered
            await asyncio.sleep(0.25)
            await self.view.poll_info({self.stage})

    async def _initial_state(self) -> None:
        mates = await self._reachable_mates(min(30.0, self.cfg.state_timeout))
        if mates and max(m.step for m in mates) > 0:
            deadline = time.monotonic() + self.cfg.state_timeout
            while time.monotonic() < deadline:
                if await self.sync_from_mates():
                    return
                await asyncio.sleep(1.0)
                await self.view.poll_info({self.stage})
            logger.warning("could not download the stage's state from any mate")
        if not mates and self.checkpoints is not None:
            loop = asyncio.get_running_loop()
            found = await loop.run_in_executor(None, self.checkpoints.load_latest, self.executor.module, self._meta())
            if found is not None:
                state, ckpt = found
                await asyncio.wrap_future(self.executor.call(lambda: self.executor.load_state_dict(state)))
                logger.info("restored stage %d from checkpoint %s (step %d)", self.stage, ckpt.path, ckpt.step)
                return
        logger.info("stage %d starts from its seeded initialization", self.stage)

    async def sync_from_mates(self, preferred=None) -> bool:
        """Download the state of `preferred`, else of the most advanced live mate (trying up to three);
        True on success."""
        run = self.run
        mates = sorted(
            (m for m in self.live_mates() if m.record_state in ("online", "draining")), key=lambda m: -m.step
        )
        if preferred is not None:
            mates = [preferred] + [m for m in mates if m.peer_id != preferred.peer_id]
        for mate in mates[:3]:
            started = time.monotonic()
            try:
                state = await download(
                    self.clients.get(mate.load.address),
                    run.run_id,
                    self.stage,
                    self.cfg.state_timeout,
                    self.cfg.max_message_mb << 22,
                )
                validate(state, self.executor.module)
            except (StateError, Exception) as e:  # noqa: BLE001 - try the next mate
                logger.warning("state download from %s failed: %s", mate.peer_id[-6:], e)
                continue
            await asyncio.wrap_future(self.executor.call(lambda s=state: self.executor.load_state_dict(s)))
            set_context(step=self.executor.step)
            logger.info(
                "downloaded stage %d state at step %d from %s in %.2f s",
                self.stage,
                state["step"],
                mate.peer_id[-6:],
                time.monotonic() - started,
            )
            return True
        return False

    async def _state_stream(self):
        """GetState: a consistent snapshot taken between batches on the compute thread."""
        ex = self.executor
        state = await asyncio.wrap_future(ex.call(ex.state_dict))
        data = await asyncio.get_running_loop().run_in_executor(None, serialize, state)
        async for chunk in state_chunks(data, state["step"]):
            yield chunk

    # ---- updates and checkpoints ----

    def _is_checkpoint_writer(self) -> bool:
        """One writer per stage without coordination: the live online peer with the smallest id."""
        ids = [m.peer_id for m in self.live_mates() if m.record_state == "online"] + [self.dht.peer_id]
        return min(ids) == self.dht.peer_id

    def _after_update(self, step: int) -> None:
        self.announcer.refresh_now()
        if self.checkpoints is not None and step % self.cfg.checkpoint_every == 0 and self._is_checkpoint_writer():
            self._write_checkpoint_async()

    def _write_checkpoint_async(self) -> threading.Thread:
        ex = self.executor
        future = ex.call(ex.state_dict)
        store, meta, spec = self.checkpoints, self._meta(), self.run.model

        def write() -> None:
            state = future.result()
            with self._checkpoint_lock:
                path = store.save(stamp(state, meta, spec))
            logger.info("checkpoint of stage %d at step %d written to %s", meta["stage"], state["step"], path)

        thread = threading.Thread(target=write, name="checkpoint-writer", daemon=False)
        thread.start()
        return thread

    async def _step_loop(self) -> None:
        while not self.stop_event.is_set():
            await asyncio.sleep(self.cfg.poll_interval)
            executor = self.executor
            if self.cfg.fail_at_step is not None and executor.step >= self.cfg.fail_at_step:
                self._inject_fault()
            if executor.throughput_ema:
                self.serving.throughput = 0.8 * self.serving.throughput + 0.2 * executor.throughput_ema
            try:
                async with self.stage_lock:
                    reason = self.stepper.decide()
                    if reason is not None:
                        await self.stepper.run_update(reason)
            except Exception:  # noqa: BLE001 - a failed update must not kill the peer
                logger.exception("update failed")

    # ---- moving between stages ----

    def event(self, kind: str, **fields) -> None:
        """Log an event and publish this peer's recent events on the DHT (for status and dashboards)."""
        record = {"time": round(time.time(), 3), "event": kind, "peer": self.dht.peer_id[-12:], **fields}
        text = json.dumps(record, separators=(",", ":"))[:400]
        self.events.append(text)
        logger.info("event %s", text)
        events, ttl = list(self.events), self.cfg.events_ttl
        threading.Thread(target=self._publish_events, args=(events, ttl), daemon=True).start()

    def _publish_events(self, events: list[str], ttl: float) -> None:
        try:
            self.dht.publish_events(events, ttl)
        except Exception as e:  # noqa: BLE001 - events are best effort
            logger.debug("publishing events failed: %s", e)

    async def leave_stage(self) -> None:
        """Stop serving the current stage: drain, let pending gradients go out, free its resources."""
        loop = asyncio.get_running_loop()
        old = self.stage
        self.serving.state = "draining"
        await loop.run_in_executor(None, self.dht.announce_peer, old, self.record("draining"), self.cfg.record_ttl)
        deadline = time.monotonic() + self.cfg.drain_timeout
        while self.serving.in_flight > 0 and time.monotonic() < deadline:
            await asyncio.sleep(0.02)
        # gradients this peer holds but has not applied go back to the trainers, which replay them on
        # a stage-mate once this peer's record says offline
        await loop.run_in_executor(None, self.dht.announce_peer, old, self.record("offline"), self.cfg.record_ttl)
        self.executor.stop()
        if self.averager is not None:
            averager, self.averager = self.averager, None
            await loop.run_in_executor(None, averager.shutdown)

    async def move_to(self, dst: int, reason: str, before: float, after: float) -> None:
        """Drain, load the new stage's state, announce it: the peer serves `dst`."""
        started = time.monotonic()
        src = self.stage
        logger.info("moving from stage %d to stage %d: %s", src, dst, reason)
        async with self.stage_lock:
            loop = asyncio.get_running_loop()
            # count at the destination at once, so that other peers plan with this move in mind
            await loop.run_in_executor(None, self.dht.announce_peer, dst, self.record("joining"), self.cfg.record_ttl)
            await self.leave_stage()
            self.view.poll_stages = {dst}
            await self.enter_stage(dst)
            self.announcer.refresh_now()
        self.last_placement = time.monotonic()
        seconds = time.monotonic() - started
        self.event(
            "move",
            src=src,
            dst=dst,
            reason=reason,
            before=round(before, 2),
            after=round(after, 2),
            seconds=round(seconds, 2),
            step=self.executor.step,
        )
        logger.info("moved from stage %d to stage %d in %.2f s", src, dst, seconds)

    async def _config_keeper(self) -> None:
        """Re-publish the run config if its record disappears (the coordinator died): new peers can
        still join."""
        text = self.run.to_json()
        loop = asyncio.get_running_loop()
        while not self.stop_event.is_set():
            await asyncio.sleep(30.0 + self.rng.uniform(0, 10.0))
            try:
                if await loop.run_in_executor(None, self.dht.get_config_json) is None:
                    await loop.run_in_executor(None, self.dht.publish_config, text, 120.0)
                    logger.info("the run config record was gone; re-published it")
            except Exception as e:  # noqa: BLE001
                logger.debug("config keeper: %s", e)

    def _inject_fault(self) -> None:
        mode = self.cfg.fail_mode
        logger.warning("fault injection: %s at step %d", mode, self.executor.step)
        sys.stderr.flush()
        if mode == "kill":
            os.kill(os.getpid(), signal.SIGKILL)
        elif mode == "stop":
            self.cfg.fail_at_step = None
            os.kill(os.getpid(), signal.SIGSTOP)
        else:
            os._exit(3)

    async def shutdown(self) -> None:
        """Drain in-flight work, save a last checkpoint, announce offline explicitly, stop everything."""
        ex = self.executor
        if ex is not None:
            logger.info(
                "shutting down at step %d: %d samples back-propagated, %d of them at predicted parameters, "
                "%d discarded, %d averaging rounds; %d partial gradients fetched from mates, %d predictions "
                "used them (for %d samples)",
                ex.step,
                ex.samples_processed,
                ex.predicted_samples,
                ex.samples_discarded,
                ex.averaging_rounds,
                0 if self.partials is None else self.partials.fetches,
                ex.predictions_with_mates,
                ex.predicted_with_mates_samples,
            )
        else:
            logger.info("shutting down")
        if self.dht is not None and self.executor is not None:
            self.events.append(json.dumps({"time": round(time.time(), 3), "event": "leave", "stage": self.stage}))
            await asyncio.get_running_loop().run_in_executor(None, self._publish_events, list(self.events), 600.0)
        if self.serving is not None:
            self.serving.state = "draining"
        if self.announcer is not None:
            self.announcer.refresh_now()
        deadline = time.monotonic() + self.cfg.drain_timeout
        while self.serving is not None and self.serving.in_flight > 0 and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        for task in self._tasks:
            task.cancel()
        loop = asyncio.get_running_loop()
        if self.checkpoints is not None and self.executor is not None and self._is_checkpoint_writer():
            last = self.checkpoints.list()
            if not last or last[-1].step < self.executor.step:
                writer = self._write_checkpoint_async()
                await loop.run_in_executor(None, writer.join, 60.0)
        if self.view is not None:
            await self.view.stop()
        if getattr(self, "server", None) is not None:
            await self.server.stop(grace=1.0)
        if self.announcer is not None:
            await loop.run_in_executor(None, lambda: self.announcer.stop(final=self._publish_offline))
        if self.executor is not None:
            self.executor.stop()  # after pending checkpoint snapshots ran (they are queued first)
        if self.averager is not None:
            self.averager.shutdown()
        await self.clients.close()
        if self.dht is not None:
            await loop.run_in_executor(None, self.dht.shutdown)
        logger.info("stopped")


@contextlib.contextmanager
def _event_loop_profile():
    """With SWARM_PROFILE_DIR set (scripts/bench_overheads.py), profile the CPU time of this thread,
    the event loop (parsing, validation, codecs, gRPC), while the peer serves."""
    profile_dir = os.environ.get("SWARM_PROFILE_DIR")
    if not profile_dir:
        yield
        return
    profiler = cProfile.Profile(time.thread_time)
    profiler.enable()
    try:
        yield
    finally:
        profiler.disable()
        profiler.dump_stats(os.path.join(profile_dir, f"peer-{os.getpid()}.prof"))


async def run_peer(cfg: PeerConfig) -> int:
    peer = Peer(cfg)
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, peer.stop_event.set)
    try:
        start = asyncio.create_task(peer.start())
        stop_wait = asyncio.create_task(peer.stop_event.wait())
        done, _ = await asyncio.wait({start, stop_wait}, return_when=asyncio.FIRST_COMPLETED)
        if start in done:
            start.result()  # raise a start-up error here
            with _event_loop_profile():
                await stop_wait
        else:
            start.cancel()
        return 0
    finally:
        await peer.shutdown()
