"""The run-peer daemon: joins the DHT, takes a stage, serves Forward/Backward over gRPC, accumulates
gradients and steps when its stage has accumulated a global batch.

Step rule: every `poll_interval` the peer asks its stage-mates (Info over gRPC) how many samples
they hold for the update it is accumulating. When the stage's total reaches the global batch, or a
mate has already applied that update, the peer applies it (see `StepCoordinator`).
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import random
import signal
import sys
import time
from dataclasses import dataclass, field

import torch

from swarm import __version__
from swarm.config import RunConfig
from swarm.dht import Announcer, PeerRecord, SwarmDHT
from swarm.executor import StageExecutor
from swarm.log import set_context
from swarm.models import build_stage
from swarm.procs import READY_PREFIX
from swarm.server import Limits, ServingState, StageService, start_server
from swarm.throughput import measure_throughput
from swarm.view import ClientPool, SwarmView
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
    partial_step_timeout: float = 30.0
    join_timeout: float = 60.0
    drain_timeout: float = 10.0
    max_message_mb: int = 256
    use_benchmark_cache: bool = True
    fail_at_step: int | None = None  # fault injection: act at this step (torchft-style hook)
    fail_mode: str = "kill"  # kill (SIGKILL self), stop (SIGSTOP self), exit (os._exit(3))

    def __post_init__(self) -> None:
        if self.stage != "auto" and not str(self.stage).isdigit():
            raise ValueError(f"--stage must be a stage index or 'auto', got {self.stage!r}")
        if self.fail_mode not in ("kill", "stop", "exit"):
            raise ValueError(f"--fail-mode must be kill, stop or exit, got {self.fail_mode!r}")


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    device = torch.device(name)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError("--device cuda requested but CUDA is not available")
    return device


def fetch_run_config(dht: SwarmDHT, timeout: float) -> RunConfig:
    """Wait for the coordinator's run config record, with a deadline."""
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


def choose_stage_by_throughput(totals: dict[int, float], rng: random.Random) -> int:
    """The stage with the least total throughput; ties broken at random."""
    least = min(totals.values())
    return rng.choice([k for k, v in totals.items() if v <= least * (1 + 1e-9)])


class StepCoordinator:
    """Decides when this peer applies the update it is accumulating, and applies it.

    Trainers tag every microbatch with the step it is meant for and send exactly the global batch per
    step, so the stage's count for a step is exact: the update is applied when the stage-mates
    together hold the global batch. Two fallbacks keep the run going: a mate that has already
    applied the update (this peer fell behind), and a stage total stuck below the global batch for
    `partial_step_timeout` seconds (a trainer died mid-step).
    """

    def __init__(self, peer: Peer, partial_step_timeout: float) -> None:
        self.peer = peer
        self.partial_step_timeout = partial_step_timeout
        self.steps_applied = 0
        self._last_total: tuple[int, int] = (-1, -1)
        self._last_change = time.monotonic()

    def decide(self, mates: list, executor: StageExecutor, global_batch: int) -> str | None:
        """Why to step now ("full", "behind", "partial"), or None to keep accumulating."""
        acc_step = executor.accumulating_step
        total = executor.samples_accumulated + sum(
            m.samples_accumulated for m in mates if m.accumulating_step == acc_step
        )
        if total >= global_batch:
            return "full"
        if any(m.step > executor.step for m in mates):
            return "behind"
        now = time.monotonic()
        if (acc_step, total) != self._last_total:
            self._last_total, self._last_change = (acc_step, total), now
        elif total > 0 and now - self._last_change > self.partial_step_timeout:
            logger.warning(
                "stage holds %d of %d samples for step %d and none came for %.0f s: stepping with what it has",
                total,
                global_batch,
                acc_step,
                self.partial_step_timeout,
            )
            return "partial"
        return None

    async def apply(self, reason: str) -> None:
        executor = self.peer.executor
        samples, norm = await asyncio.wrap_future(executor.call(executor.local_step))
        self.steps_applied += 1
        set_context(step=executor.step)
        logger.info(
            "applied update %d from %d local samples (%s; grad norm %.3f)", executor.step - 1, samples, reason, norm
        )


class Peer:
    def __init__(self, cfg: PeerConfig) -> None:
        self.cfg = cfg
        self.rng = random.Random()
        self.dht: SwarmDHT | None = None
        self.run: RunConfig | None = None
        self.executor: StageExecutor | None = None
        self.serving: ServingState | None = None
        self.announcer: Announcer | None = None
        self.view: SwarmView | None = None
        self.clients = ClientPool(cfg.max_message_mb << 20)
        self.stop_event = asyncio.Event()
        self.address = ""
        self.device = resolve_device(cfg.device)
        self.stage = -1

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
        limits = Limits(max_message_bytes=cfg.max_message_mb << 20, max_batch=run.max_batch)
        service = StageService(self.serving, limits)
        self.server, port = await start_server(service, cfg.host, cfg.port, limits)
        self.address = f"{cfg.announce_host or cfg.host}:{port}"
        self.stage = await self._pick_stage()
        await self._load_stage(self.stage)
        self.serving.state = "online"
        self.announcer = Announcer(self._publish, cfg.announce_period, cfg.record_ttl, name="peer-announcer").start()
        self.view = SwarmView(self.dht, run.num_stages, self.clients, exclude_peer=self.dht.peer_id, dead_after=3.0)
        self.view.start(poll_stages={self.stage})
        self.coordinator = StepCoordinator(self, cfg.partial_step_timeout)
        self._step_task = asyncio.create_task(self._step_loop())
        ready = {
            "role": "peer",
            "peer_id": self.dht.peer_id,
            "stage": self.stage,
            "address": self.address,
            "dht_maddrs": self.dht.visible_maddrs(),
            "throughput": self.serving.throughput,
            "pid": os.getpid(),
        }
        print(READY_PREFIX + json.dumps(ready), flush=True)
        logger.info("serving stage %d at %s (%.1f samples/s)", self.stage, self.address, self.serving.throughput)

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
        totals = {
            k: sum(e.record.throughput for e in v if e.record.state in ("online", "joining"))
            for k, v in records.items()
        }
        return choose_stage_by_throughput(totals, self.rng)

    async def _load_stage(self, stage: int) -> None:
        run = self.run
        loop = asyncio.get_running_loop()
        self.stage = stage
        set_context(stage=stage, step=0)
        built = await loop.run_in_executor(None, build_stage, run.model, stage, run.num_stages)
        self.executor = StageExecutor(
            built, run.optim, self.device, max_batch_samples=max(run.max_batch, run.microbatch)
        )
        self.serving.stage, self.serving.schema, self.serving.executor = stage, built.schema, self.executor
        # announce "joining" at once so that auto-placed peers see each other
        self.serving.throughput = 0.0
        await loop.run_in_executor(None, self.dht.announce_peer, stage, self.record("joining"), self.cfg.record_ttl)
        self.serving.throughput = await loop.run_in_executor(
            None,
            measure_throughput,
            self.executor,
            built.schema,
            run.model,
            run.microbatch,
            self.cfg.use_benchmark_cache,
        )

    async def _step_loop(self) -> None:
        run = self.run
        while not self.stop_event.is_set():
            await asyncio.sleep(self.cfg.poll_interval)
            executor = self.executor
            if self.cfg.fail_at_step is not None and executor.step >= self.cfg.fail_at_step:
                self._inject_fault()
            if executor.throughput_ema:
                self.serving.throughput = 0.8 * self.serving.throughput + 0.2 * executor.throughput_ema
            mates = self.view.stage_peers(self.stage)
            try:
                reason = self.coordinator.decide(mates, executor, run.global_batch)
                if reason is not None:
                    await self.coordinator.apply(reason)
                    self.announcer.refresh_now()
            except Exception:  # noqa: BLE001 - a failed step must not kill the peer
                logger.exception("step failed")

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
        """Drain in-flight work, announce offline explicitly, stop everything."""
        logger.info("shutting down")
        if self.serving is not None:
            self.serving.state = "draining"
        if self.announcer is not None:
            self.announcer.refresh_now()
        deadline = time.monotonic() + self.cfg.drain_timeout
        while self.serving is not None and self.serving.in_flight > 0 and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        if getattr(self, "_step_task", None) is not None:
            self._step_task.cancel()
        if self.view is not None:
            await self.view.stop()
        if getattr(self, "server", None) is not None:
            await self.server.stop(grace=1.0)
        loop = asyncio.get_running_loop()
        if self.announcer is not None:
            await loop.run_in_executor(None, lambda: self.announcer.stop(final=self._publish_offline))
        if self.executor is not None:
            self.executor.stop()
        await self.clients.close()
        if self.dht is not None:
            await loop.run_in_executor(None, self.dht.shutdown)
        logger.info("stopped")


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
            await stop_wait
        else:
            start.cancel()
        return 0
    finally:
        await peer.shutdown()
