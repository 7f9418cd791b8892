"""The trainer: streams microbatches from its data shard through the stages.

One microbatch: forward through stages 0..S-2 (the trainer relays each stage's encoded output to the
next stage unchanged), then Backward on the last stage with the targets (loss and input gradient in
one call), then Backward on stages S-2..0 with the stage input kept from the forward pass.

Every call goes to the peer with the lowest expected finish time (swarm.policy.wiring). A failed call bans
the peer and retries on another; a deadline miss does the same. Each stage's Backward is held as a
record until the peer that accumulated it has applied that update; if the peer dies first, the record
is replayed on a stage-mate, so no sample's gradient is silently lost.
"""

from __future__ import annotations

import asyncio
import collections
import itertools
import json
import logging
import math
import random
import sys
import time
import uuid
from dataclasses import dataclass, field

import grpc
import torch

from swarm.training.config import RunConfig
from swarm.training.data import DataConfig, ShardSampler, load_dataset, val_indices
from swarm.dht.node import SwarmDHT
from swarm.core.log import set_context
from swarm.policy.pacing import StepPacer
from swarm.peer.daemon import fetch_run_config
from swarm.core.procs import PROGRESS_PREFIX, SUMMARY_PREFIX
from swarm.cluster.view import ClientPool, SwarmView
from swarm.wire import codec
from swarm.wire.codec import codec_from_name
from swarm.wire.protocol import pb
from swarm.wire.tensors import WireTensor
from swarm.policy.wiring import PeerLoad, Wiring

logger = logging.getLogger(__name__)


@dataclass
class TrainerConfig:
    run_id: str
    initial_peers: list[str] = field(default_factory=list)
    steps: int = 60
    trainer_index: int = 0
    num_trainers: int | None = None  # default: the run config's
    max_in_flight: int = 8
    max_retries: int = 8
    min_deadline: float = 5.0  # seconds every call gets at least
    deadline_factor: float = 4.0  # times the expected finish time at the chosen peer
    stage_wait_timeout: float = 180.0
    join_timeout: float = 60.0
    val_every: int = 20  # global steps; 0 disables periodic validation
    val_samples: int = 64
    seed: int = 0
    threads: int = 0
    json_progress: bool = False
    progress_bar: bool = True
    sample_log: str | None = None
    host: str = "127.0.0.1"


class StageUnavailable(RuntimeError):
    pass


class MicrobatchFailed(RuntimeError):
    pass


class MicrobatchRejected(RuntimeError):
    """A peer refused the request as invalid: retrying elsewhere would not help."""


@dataclass
class Microbatch:
    mb_id: int
    indices: list[int]
    inputs: torch.Tensor
    targets: torch.Tensor
    step_tag: int
    done: bool = False
    held: set[int] = field(default_factory=set)  # stages whose gradient is not yet applied

    @property
    def samples(self) -> int:
        return len(self.indices)


@dataclass
class HeldBackward:
    """A stage's Backward, kept until the peer that accumulated it has applied that update."""

    mb: Microbatch
    stage: int
    peer_id: str
    accumulated_step: int
    request: pb.BackwardRequest
    tensors: dict[str, WireTensor]
    replays: int = 0


@dataclass
class Stats:
    microbatches_started: int = 0
    microbatches_completed: int = 0
    microbatches_requeued: int = 0
    microbatches_rejected: int = 0
    microbatches_cancelled: int = 0  # in flight when the target step was reached
    samples: int = 0
    retries: int = 0
    failed_calls: int = 0
    replays: int = 0
    failed_peers: set[str] = field(default_factory=set)
    losses_by_step: dict[int, list[tuple[float, int]]] = field(default_factory=lambda: collections.defaultdict(list))
    val_losses: list[tuple[int, float]] = field(default_factory=list)


class Trainer:
    def __init__(self, cfg: TrainerConfig) -> None:
        self.cfg = cfg
        self.t_start = time.monotonic()
        self.target = cfg.steps
        self.rng = random.Random(cfg.seed * 7919 + cfg.trainer_index)
        self.wiring = Wiring(self.rng)
        self.stats = Stats()
        self.clients = ClientPool()
        self.trainer_id = f"t{cfg.trainer_index}-{uuid.uuid4().hex[:8]}"
        self.held: list[HeldBackward] = []
        self.in_flight = 0
        self.progress = asyncio.Event()
        self._mb_ids = itertools.count()
        self._retry: collections.deque[Microbatch] = collections.deque()
        self._sample_log = None
        self.dht: SwarmDHT | None = None
        self.view: SwarmView | None = None
        self._bar = None

    # ---- setup ----

    async def setup(self) -> None:
        cfg = self.cfg
        loop = asyncio.get_running_loop()
        if cfg.threads:
            torch.set_num_threads(cfg.threads)
        self.dht = SwarmDHT(
            cfg.run_id, cfg.initial_peers, host=cfg.host, client_mode=True
        )  # main thread: see swarm.dht.node
        set_context(peer=self.trainer_id)
        self.run: RunConfig = await loop.run_in_executor(None, fetch_run_config, self.dht, cfg.join_timeout)
        run = self.run
        self.num_trainers = cfg.num_trainers or run.num_trainers
        if not 0 <= cfg.trainer_index < self.num_trainers:
            raise ValueError(f"--trainer-index {cfg.trainer_index} outside 0..{self.num_trainers - 1}")
        # samples per step from this trainer: the global batch split as evenly as possible
        base, extra = divmod(run.global_batch, self.num_trainers)
        self.share = base + (1 if cfg.trainer_index < extra else 0)
        if self.share < 1:
            raise ValueError(
                f"global batch {run.global_batch} is smaller than the number of trainers {self.num_trainers}"
            )
        exact = run.sync == "exact"
        self.pacer = StepPacer(
            self.share, 0.0 if exact else float(run.max_staleness), 0.0 if exact else float(run.ahead_after)
        )
        self.codec = codec_from_name(run.codec)
        data_cfg = run.data if isinstance(run.data, DataConfig) else DataConfig(**run.data)
        self.dataset = await loop.run_in_executor(None, load_dataset, data_cfg, run.model)
        self.sampler = iter(ShardSampler(self.dataset.num_train, cfg.trainer_index, self.num_trainers, data_cfg.seed))
        if cfg.sample_log:
            path = cfg.sample_log.replace("{trainer}", str(cfg.trainer_index))
            self._sample_log = open(path, "a")  # noqa: SIM115 - closed in close()
        self.view = SwarmView(self.dht, run.num_stages, self.clients, info_period=0.1)
        self.view.start()
        self._replayer = asyncio.create_task(self._replay_loop())

    async def close(self) -> None:
        if getattr(self, "_replayer", None) is not None:
            self._replayer.cancel()
        if self.view is not None:
            await self.view.stop()
        await self.clients.close()
        if self.dht is not None:
            await asyncio.get_running_loop().run_in_executor(None, self.dht.shutdown)
        if self._sample_log is not None:
            self._sample_log.close()
        if self._bar is not None:
            self._bar.close()

    async def wait_for_stages(self) -> int:
        """Wait until every stage has a live peer; returns the global step."""
        deadline = time.monotonic() + self.cfg.stage_wait_timeout
        last_log = 0.0
        while True:
            step = self.view.global_step()
            if step is not None and all(self.view.stage_loads(k) for k in range(self.run.num_stages)):
                return step
            if time.monotonic() > deadline:
                raise StageUnavailable(
                    f"stages {self.view.missing_stages()} have no live peer after {self.cfg.stage_wait_timeout:.0f} s"
                )
            if time.monotonic() - last_log > 10:
                logger.info("waiting for peers of stages %s", self.view.missing_stages())
                last_log = time.monotonic()
            await self.view.wait_changed(1.0)

    # ---- calls ----

    async def _call(
        self,
        stage: int,
        request,
        tensors: dict[str, WireTensor],
        samples: int,
        kind: str,
        exclude: set[str] | None = None,
        retry_limit: int | None = -1,
    ) -> tuple[object, WireTensor | None, PeerLoad]:
        """Send to the best peer of `stage`; on failure ban it and retry elsewhere.

        Retries are capped at `retry_limit` (default: --max-retries; None: no cap, for calls that must
        not give up because part of the microbatch's gradient is already accumulated). Waiting for a
        usable peer is capped by --stage-wait-timeout either way.
        """
        if retry_limit == -1:
            retry_limit = self.cfg.max_retries
        exact_step = self.run.sync == "exact" and not getattr(request, "validation", False)
        min_step = int(request.step) if exact_step else None
        exclude = set(exclude or ())
        attempts = 0
        wait_deadline = None
        while True:
            now = time.monotonic()
            loads = self.view.stage_loads(stage, min_step)
            peer = self.wiring.choose(loads, samples, now, exclude)
            if peer is None and exclude:
                exclude.clear()  # every candidate was tried: give the unbanned ones another go
                peer = self.wiring.choose(loads, samples, now)
            if peer is None:
                wait_deadline = wait_deadline or now + self.cfg.stage_wait_timeout
                if now > wait_deadline:
                    raise StageUnavailable(
                        f"stage {stage} has had no usable peer for {self.cfg.stage_wait_timeout:.0f} s"
                    )
                await self.view.wait_changed(0.5)
                continue
            wait_deadline = None
            timeout = self.cfg.min_deadline + self.cfg.deadline_factor * peer.expected_finish(samples)
            client = self.clients.get(peer.address)
            alone = peer.in_flight == 0  # only then does the call's time measure the peer, not our queue
            peer.in_flight += samples
            started = time.monotonic()
            try:
                response, output = await client.call(kind, request, tensors, timeout)
            except grpc.aio.AioRpcError as e:
                code = e.code()
                if code in (grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.RESOURCE_EXHAUSTED):
                    raise MicrobatchRejected(
                        f"stage {stage} peer {peer.peer_id[-6:]} rejected the request: {e.details()}"
                    ) from None
                self.stats.failed_calls += 1
                exclude.add(peer.peer_id)
                if code == grpc.StatusCode.FAILED_PRECONDITION:
                    logger.info("stage %d peer %s: %s; choosing another", stage, peer.peer_id[-6:], e.details())
                    peer.online = False
                    status = self.view.peers.get(peer.peer_id)
                    if status is not None:
                        status.record_state = "offline"
                else:
                    ban = self.wiring.on_failure(peer, time.monotonic())
                    self.stats.failed_peers.add(peer.peer_id)
                    logger.warning(
                        "stage %d peer %s failed (%s: %s); banned for %.0f s, retrying on another peer",
                        stage,
                        peer.peer_id[-6:],
                        code.name,
                        (e.details() or "")[:120],
                        ban,
                    )
                attempts += 1
                self.stats.retries += 1
                if retry_limit is not None and attempts > retry_limit:
                    raise MicrobatchFailed(f"stage {stage}: {attempts} attempts failed") from None
                continue
            finally:
                peer.in_flight -= samples
            self.wiring.on_success(peer)
            elapsed = time.monotonic() - started
            if alone and elapsed > 0:
                # end-to-end throughput, network included; with the peer's own figure the wiring uses
                # the slower of the two (a fast GPU behind a slow link is a slow peer)
                # a forward call is about a third of a training round's work, a backward two thirds
                # (the last stage's backward runs the whole round); peers report whole rounds
                share = 1.0 / 3.0 if kind == "forward" else (1.0 if stage == self.run.num_stages - 1 else 2.0 / 3.0)
                rate = samples * share / elapsed
                peer.e2e_throughput = rate if peer.e2e_throughput is None else 0.8 * peer.e2e_throughput + 0.2 * rate
            return response, output, peer

    def _request_id(self, mb: Microbatch, stage: int, kind: str) -> str:
        return f"{self.trainer_id}:{mb.mb_id}:{stage}:{kind}"

    async def _process(self, mb: Microbatch) -> None:
        run = self.run
        S = run.num_stages
        # Stage inputs travel as received, encoded: the trainer relays them without decoding.
        inputs: list[WireTensor | None] = [WireTensor.encode(mb.inputs, self.codec)]
        targets = codec.to_proto(codec.encode(mb.targets, pb.CODEC_NONE))
        for k in range(S - 1):
            req = pb.ForwardRequest(
                request_id=self._request_id(mb, k, "f"),
                run_id=run.run_id,
                stage=k,
                step=mb.step_tag,
                reply_codec=self.codec,
            )
            _, output, _ = await self._call(k, req, {"input": inputs[k]}, mb.samples, "forward")
            inputs.append(output)
        grad: WireTensor | None = None
        for k in reversed(range(S)):
            req = pb.BackwardRequest(
                request_id=self._request_id(mb, k, "b"),
                run_id=run.run_id,
                stage=k,
                step=mb.step_tag,
                reply_codec=self.codec,
                num_samples=mb.samples,
            )
            tensors = {"input": inputs[k]}
            if k == S - 1:
                req.targets.CopyFrom(targets)
            else:
                tensors["grad_output"] = grad
            # no retry cap: later stages already hold this microbatch's gradient
            msg, grad_input, peer = await self._call(k, req, tensors, mb.samples, "backward", retry_limit=None)
            if k == S - 1:
                self.stats.losses_by_step[int(msg.peer_step)].append((float(msg.loss), mb.samples))
            self._hold(mb, k, peer.peer_id, int(msg.accumulated_step), req, tensors)
            grad = grad_input
            inputs[k] = None  # the held record keeps what a replay needs
        mb.done = True

    def _hold(
        self,
        mb: Microbatch,
        stage: int,
        peer_id: str,
        accumulated_step: int,
        request: pb.BackwardRequest,
        tensors: dict[str, WireTensor],
    ) -> None:
        mb.held.add(stage)
        self.held.append(HeldBackward(mb, stage, peer_id, accumulated_step, request, tensors))

    # ---- holding and replaying gradients ----

    def _release_applied(self) -> None:
        keep = []
        for rec in self.held:
            status = self.view.peers.get(rec.peer_id)
            if status is not None and status.stage == rec.stage and status.step > rec.accumulated_step:
                rec.mb.held.discard(rec.stage)
            else:
                keep.append(rec)
        if len(keep) != len(self.held):
            self.held = keep
            self.progress.set()

    def _lost(self, rec: HeldBackward) -> bool:
        status = self.view.peers.get(rec.peer_id)
        # gone, unreachable, or moved to another stage before applying this gradient
        return status is None or status.stage != rec.stage or not self.view.is_live(status)

    async def _replay(self, rec: HeldBackward) -> None:
        rec.replays += 1
        rec.request.request_id = f"{rec.request.request_id}:r{rec.replays}"
        try:
            response, _, peer = await self._call(
                rec.stage, rec.request, rec.tensors, rec.mb.samples, "backward", exclude={rec.peer_id}
            )
        except (StageUnavailable, MicrobatchFailed, MicrobatchRejected) as e:
            logger.warning("replay of microbatch %d on stage %d failed: %s", rec.mb.mb_id, rec.stage, e)
            rec.replays -= 1
            return
        rec.peer_id = peer.peer_id
        rec.accumulated_step = int(response.accumulated_step)
        self.stats.replays += 1
        logger.info("replayed microbatch %d's gradient on stage %d peer %s", rec.mb.mb_id, rec.stage, peer.peer_id[-6:])

    async def _replay_loop(self) -> None:
        replaying: set[int] = set()
        while True:
            await asyncio.sleep(0.2)
            self._release_applied()
            for rec in list(self.held):
                if id(rec) in replaying or not self._lost(rec):
                    continue
                replaying.add(id(rec))
                task = asyncio.create_task(self._replay(rec))
                task.add_done_callback(lambda _t, key=id(rec): replaying.discard(key))

    # ---- step pacing ----

    def _next_microbatch(self, global_step: int | None) -> Microbatch | None:
        """The next microbatch to start (a retry first), or None while the staleness bound holds the
        trainer back (swarm.policy.pacing)."""
        if self._retry:
            return self._retry.popleft()
        taken = self.pacer.take(global_step or 0, self.run.microbatch, self.target)
        if taken is None:
            return None
        tag, n = taken
        indices = [next(self.sampler) for _ in range(n)]
        x, y = self.dataset.train(indices)
        mb = Microbatch(next(self._mb_ids), indices, x, y, tag)
        if self._sample_log is not None:
            self._sample_log.write(json.dumps({"mb": mb.mb_id, "step": mb.step_tag, "indices": indices}) + "\n")
            self._sample_log.flush()
        return mb

    async def _run_microbatch(self, mb: Microbatch) -> bool:
        try:
            try:
                await self._process(mb)
            except asyncio.CancelledError:
                self.stats.microbatches_cancelled += 1
                raise
            self.stats.microbatches_completed += 1
            self.stats.samples += mb.samples
            self.pacer.done(mb.step_tag, mb.samples)
            return True
        except MicrobatchRejected as e:
            self.stats.microbatches_rejected += 1
            self.pacer.done(mb.step_tag, mb.samples)  # given up: waiting for it would stall the pacing
            logger.error("microbatch %d dropped: %s", mb.mb_id, e)
            if self.run.sync == "exact":
                raise
            return False
        except MicrobatchFailed as e:
            # failed before any gradient was accumulated: run the same samples again, same step
            self.stats.microbatches_requeued += 1
            logger.warning("microbatch %d failed (%s); its samples are queued again", mb.mb_id, e)
            self._retry.append(Microbatch(next(self._mb_ids), mb.indices, mb.inputs, mb.targets, mb.step_tag))
            return False
        finally:
            self.in_flight -= 1
            if not mb.done:
                self.held = [r for r in self.held if r.mb is not mb]
            self.progress.set()

    async def _wait_progress(self, timeout: float) -> None:
        """Until a microbatch finishes, a gradient is applied, or the view changes."""
        self.progress.clear()
        self.view.changed.clear()
        waiters = [asyncio.ensure_future(self.progress.wait()), asyncio.ensure_future(self.view.changed.wait())]
        try:
            await asyncio.wait(waiters, timeout=timeout, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for w in waiters:
                w.cancel()

    async def _train(self, target: int) -> None:
        tasks: set[asyncio.Task] = set()
        try:
            while True:
                step = self.view.global_step()
                self._report(step)
                if step is not None and step >= target:
                    break
                if self.in_flight < self.cfg.max_in_flight:
                    mb = self._next_microbatch(step)
                    if mb is not None:
                        self.in_flight += 1
                        self.stats.microbatches_started += 1
                        task = asyncio.create_task(self._run_microbatch(mb))
                        tasks.add(task)
                        task.add_done_callback(tasks.discard)
                        continue
                await self._wait_progress(0.5)
                for task in [t for t in tasks if t.done() and not t.cancelled() and t.exception()]:
                    raise task.exception()
        finally:
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

    # ---- validation and reporting ----

    async def validate(self) -> float:
        run = self.run
        indices = val_indices(self.dataset, self.cfg.val_samples)
        total, count = 0.0, 0
        for start in range(0, len(indices), run.microbatch):
            part = indices[start : start + run.microbatch]
            x, y = self.dataset.val(part)
            cur = WireTensor.encode(x, self.codec)
            for k in range(run.num_stages):
                req = pb.ForwardRequest(
                    request_id=f"{self.trainer_id}:val:{start}:{k}",
                    run_id=run.run_id,
                    stage=k,
                    reply_codec=self.codec,
                    validation=True,
                )
                if k == run.num_stages - 1:
                    req.targets.CopyFrom(codec.to_proto(codec.encode(y, pb.CODEC_NONE)))
                response, output, _ = await self._call(k, req, {"input": cur}, len(part), "forward")
                if k < run.num_stages - 1:
                    cur = output
                else:
                    total += float(response.loss) * len(part)
                    count += len(part)
        return total / max(1, count)

    def _report(self, step: int | None) -> None:
        if step is None or step == getattr(self, "_last_reported", None):
            return
        self._last_reported = step
        set_context(step=step)
        elapsed = max(1e-9, time.monotonic() - self.t_start)
        losses = self.stats.losses_by_step.get(step - 1) or []
        loss = sum(v * n for v, n in losses) / max(1, sum(n for _, n in losses)) if losses else None
        line = {
            "event": "progress",
            "trainer": self.cfg.trainer_index,
            "step": step,
            "target": self.target,
            "loss": loss,
            "samples": self.stats.samples,
            "samples_per_s": self.stats.samples / elapsed,
            "retries": self.stats.retries,
        }
        if self.cfg.json_progress:
            print(PROGRESS_PREFIX + json.dumps(line), flush=True)
        if self._bar is not None:
            self._bar.n = min(step, self.target)
            self._bar.set_postfix(
                loss=f"{loss:.3f}" if loss is not None else "-",
                sps=f"{line['samples_per_s']:.1f}",
                retries=self.stats.retries,
            )
            self._bar.refresh()
        if (
            self.cfg.val_every
            and self.cfg.trainer_index == 0
            and step
            and step % self.cfg.val_every == 0
            and step < self.target
        ):
            self._val_task = asyncio.create_task(self._periodic_validation(step))

    async def _periodic_validation(self, step: int) -> None:
        try:
            loss = await self.validate()
            self.stats.val_losses.append((step, loss))
            logger.info("validation loss at step %d: %.4f", step, loss)
        except Exception as e:  # noqa: BLE001 - validation must not stop training
            logger.warning("validation at step %d failed: %s", step, e)

    def _mean_loss(self, step: int | None) -> float | None:
        if step is None:
            return None
        vals = self.stats.losses_by_step.get(step) or []
        return sum(v * n for v, n in vals) / sum(n for _, n in vals) if vals else None

    def summary(self, wall_s: float, train_s: float, val_loss: float | None) -> dict:
        steps_seen = sorted(self.stats.losses_by_step)
        return {
            "steps": self.view.global_step() if self.view else 0,
            "samples": self.stats.samples,
            "loss_first": self._mean_loss(steps_seen[0] if steps_seen else None),
            "loss_last": self._mean_loss(steps_seen[-1] if steps_seen else None),
            "val_loss": val_loss,
            "samples_per_s": self.stats.samples / max(1e-9, train_s),
            "wall_s": wall_s,
            "peer_failures": len(self.stats.failed_peers),
            "retries": self.stats.retries,
            "failed_calls": self.stats.failed_calls,
            "replays": self.stats.replays,
            "microbatches_started": self.stats.microbatches_started,
            "microbatches_completed": self.stats.microbatches_completed,
            "microbatches_requeued": self.stats.microbatches_requeued,
            "microbatches_rejected": self.stats.microbatches_rejected,
            "microbatches_cancelled": self.stats.microbatches_cancelled,
            "failed_peer_ids": sorted(self.stats.failed_peers),
            "val_losses": self.stats.val_losses,
            "trainer_index": self.cfg.trainer_index,
            "first_step": steps_seen[0] if steps_seen else None,
        }

    async def train(self) -> dict:
        t0 = time.monotonic()
        await self.setup()
        try:
            start_step = await self.wait_for_stages()
            self.target = self.cfg.steps
            if start_step >= self.target:
                logger.info("the swarm is already at step %d >= %d", start_step, self.target)
            if self.cfg.progress_bar and sys.stderr.isatty():
                from tqdm import tqdm

                self._bar = tqdm(
                    total=self.target,
                    initial=start_step,
                    desc=f"trainer {self.cfg.trainer_index}",
                    unit="step",
                    file=sys.stderr,
                )
            self.t_start = time.monotonic()
            logger.info("training from step %d to %d (%s mode)", start_step, self.target, self.run.sync)
            self.pacer.restart(start_step)
            await self._train(self.target)
            train_s = time.monotonic() - self.t_start
            val_loss = None
            if self.cfg.trainer_index == 0 and self.cfg.val_samples > 0:
                val_loss = await self.validate()
                logger.info("final validation loss %.4f", val_loss)
            summary = self.summary(time.monotonic() - t0, train_s, val_loss)
            return summary
        finally:
            await self.close()


async def run_trainer(cfg: TrainerConfig) -> dict:
    trainer = Trainer(cfg)
    summary = await trainer.train()
    print(SUMMARY_PREFIX + json.dumps(summary), flush=True)
    if not math.isfinite(summary["samples_per_s"]):
        summary["samples_per_s"] = 0.0
    return summary
