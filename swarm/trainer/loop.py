"""The trainer: streams microbatches from its data shard through the stages.

One microbatch: forward through stages 0..S-2 (the trainer relays each stage's encoded output to the
next stage unchanged), then Backward on the last stage with the targets (loss and input gradient in
one call), then Backward on stages S-2..0 with the stage input kept from the forward pass (left out
when the backward goes to the forward's peer and that peer keeps the forward's activations). Calls go
through the router (swarm.trainer.router), Backward records are held until applied
(swarm.trainer.replay), and the pacer (swarm.policy.pacing) says which step each microbatch is for.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import logging
import math
import random
import signal
import sys
import time

import torch

from swarm.cluster.authority import secure
from swarm.cluster.fallbacks import fallback_totals
from swarm.cluster.runconfig import fetch_signed_config
from swarm.cluster.view import SwarmView
from swarm.core.errors import ConfigError
from swarm.core.log import set_context
from swarm.core.procs import SUMMARY_PREFIX
from swarm.dht.announcer import Announcer
from swarm.dht.node import SwarmDHT
from swarm.policy.pacing import StepPacer
from swarm.policy.wiring import Wiring
from swarm.trainer.config import TrainerConfig
from swarm.trainer.feed import MicrobatchFeed
from swarm.trainer.honesty import SETTLE_S, Honesty, default_tolerance
from swarm.trainer.microbatch import MAX_REJECTIONS, Microbatch
from swarm.trainer.replay import SETTLE_S as HELD_SETTLE_S
from swarm.trainer.replay import Replayer
from swarm.trainer.report import Reporter, Stats
from swarm.trainer.router import NO_RETRY_CAP, MicrobatchFailed, MicrobatchRejected, Router, StageUnavailable
from swarm.trainer.validation import validation_loss
from swarm.training.config import RunConfig
from swarm.training.data import DataConfig, ShardSampler, load_dataset
from swarm.wire import codec
from swarm.wire.codec import codec_from_name
from swarm.wire.pool import ClientPool
from swarm.wire.protocol import pb
from swarm.wire.tensors import WireTensor

logger = logging.getLogger(__name__)

PROGRESS_WAIT_S = 0.5
METRICS_PERIOD_S = 3.0  # a trainer's DHT record (for dashboards) is refreshed this often
METRICS_TTL_S = 15.0
# after SIGTERM/SIGINT the final validation gets this long: a stop must end well inside a process
# supervisor's grace period (ManagedProcess waits 15 s) even when every peer is already gone
STOPPED_VALIDATION_S = 5.0


class Trainer:
    def __init__(self, cfg: TrainerConfig) -> None:
        self.cfg = cfg
        self.rng = random.Random(cfg.seed * 7919 + cfg.trainer_index)
        self.stats = Stats()
        self.reporter = Reporter(self.stats, cfg.trainer_index, cfg.steps, cfg.json_progress)
        self.clients = ClientPool(stream_threshold=cfg.stream_threshold_kb << 10, lane=cfg.lane)
        # stable across restarts: a restarted trainer's microbatches have the same contribution ids
        self.trainer_id = f"t{cfg.trainer_index}"
        self.in_flight = 0
        self.progress = asyncio.Event()
        self.stop_requested = asyncio.Event()  # SIGTERM/SIGINT: stop training, report, exit
        self._calls = itertools.count()  # forward request ids
        self._sample_log = None
        self._background: list[asyncio.Task] = []
        self.dht: SwarmDHT | None = None
        self.view: SwarmView | None = None
        self.run: RunConfig | None = None
        self.metrics: Announcer | None = None
        self.keeper = None  # a private swarm's certificate keeper

    # ---- setup ----

    async def setup(self) -> None:
        cfg = self.cfg
        loop = asyncio.get_running_loop()
        t0 = time.monotonic()
        if cfg.threads:
            torch.set_num_threads(cfg.threads)
        self.dht = SwarmDHT(cfg.run_id, cfg.initial_peers, host=cfg.host, client_mode=True)  # main thread
        t_dht = time.monotonic()
        set_context(peer=self.trainer_id)
        signed = await loop.run_in_executor(
            None, fetch_signed_config, self.dht, cfg.join_timeout_s, cfg.run_key, cfg.allow_model
        )
        run = self.run = signed.run
        self.keeper = await loop.run_in_executor(None, secure, self.dht, signed, cfg.invite, "trainer")
        if self.keeper is not None:  # a private swarm: every call carries this member's certificate
            self.clients.credentials = self.keeper.credentials
        num_trainers = cfg.num_trainers or run.num_trainers
        if not 0 <= cfg.trainer_index < num_trainers:
            raise ConfigError(f"--trainer-index {cfg.trainer_index} outside 0..{num_trainers - 1}")
        share = run.trainer_share(cfg.trainer_index, num_trainers)
        if share < 1:
            raise ConfigError(f"global batch {run.global_batch} is smaller than the number of trainers {num_trainers}")
        staleness, ahead_after = (0.0, 0.0) if run.exact else (float(run.max_staleness), float(run.ahead_after))
        self.pacer = StepPacer(share, staleness, ahead_after)
        self.codec = codec_from_name(run.codec)
        data_cfg = run.data if isinstance(run.data, DataConfig) else DataConfig(**run.data)
        t_config = time.monotonic()
        self.dataset = await loop.run_in_executor(None, load_dataset, data_cfg, run.model)
        t_data = time.monotonic()
        sampler = ShardSampler(self.dataset.num_train, cfg.trainer_index, num_trainers, data_cfg.seed)
        if cfg.sample_log:
            self._sample_log = open(cfg.sample_log.replace("{trainer}", str(cfg.trainer_index)), "a")  # noqa: SIM115
        self.feed = MicrobatchFeed(
            self.trainer_id, self.pacer, sampler, self.dataset, run.microbatch, cfg.steps, self._sample_log
        )
        self.view = SwarmView(self.dht, run.num_stages, self.clients)
        self.view.start(read_hinted_accusations=True)
        self.router = Router(cfg, self.view, self.clients, Wiring(self.rng), self.stats, run.num_stages)
        self.replayer = Replayer(self.view, self.router, self.clients, run.run_id, self.stats, self.progress)
        self._background.append(asyncio.create_task(self.replayer.run()))
        tolerance = cfg.spot_check_tolerance or default_tolerance(self.codec, run.exact)
        self.honesty = Honesty(
            self.view, self.router, self.clients, self.dht, self.trainer_id, cfg.spot_check, tolerance,
            self.stats.calls_by_peer, seed=cfg.seed * 31 + cfg.trainer_index,
        )  # fmt: skip
        self._background.append(asyncio.create_task(self.honesty.run()))
        self.metrics = Announcer(self._publish_metrics, METRICS_PERIOD_S, METRICS_TTL_S, name="trainer-metrics").start()
        logger.info(
            "set up in %.1f s (DHT %.1f s, run config %.1f s, data %.1f s)",
            time.monotonic() - t0, t_dht - t0, t_config - t_dht, t_data - t_config,
        )  # fmt: skip

    def _publish_metrics(self, ttl: float) -> bool:
        """Refresh this trainer's DHT record (the dashboard reads it); runs on the announcer's thread."""
        record = self.reporter.record(self.trainer_id, self.in_flight, dict(self.stats.failures_by_peer))
        return self.dht.publish_trainer(record, ttl)

    async def close(self) -> None:
        _ = [task.cancel() for task in self._background]
        if self.metrics is not None:
            await asyncio.get_running_loop().run_in_executor(None, self.metrics.stop)
        if self.view is not None:
            await self.view.stop()
        await self.clients.close()
        if self.dht is not None:
            await asyncio.get_running_loop().run_in_executor(None, self.dht.shutdown)
        if self._sample_log is not None:
            self._sample_log.close()
        if self.keeper is not None:
            self.keeper.stop()
        self.reporter.close()

    async def wait_for_stages(self) -> int:
        """Wait until every stage has a live peer; returns the global step."""
        deadline = time.monotonic() + self.cfg.stage_wait_s
        last_log = 0.0
        while True:
            step = self.view.global_step()
            if step is not None and all(self.view.stage_loads(k) for k in range(self.run.num_stages)):
                return step
            if time.monotonic() > deadline:
                missing = self.view.missing_stages()
                raise StageUnavailable(f"stages {missing} have no live peer after {self.cfg.stage_wait_s:.0f} s")
            if time.monotonic() - last_log > 10:
                logger.info("waiting for peers of stages %s", self.view.missing_stages())
                last_log = time.monotonic()
            await self.view.wait_changed(1.0)

    # ---- one microbatch ----

    def _request_id(self, mb: Microbatch, stage: int, kind: str) -> str:
        return f"{mb.cid}:{stage}:{kind}:{next(self._calls)}"

    async def _forward(self, mb: Microbatch) -> tuple[list[WireTensor | None], list[tuple[str, str, int]]]:
        """Stage inputs 0..S-1, as they travel (encoded: the trainer relays them without decoding),
        and each forward's (request id, peer id, kept token): the backward names it and prefers that
        peer, which may still hold the forward's activations (a token says it keeps them)."""
        run = self.run
        inputs: list[WireTensor | None] = [WireTensor.encode(mb.inputs, self.codec)]
        forwards: list[tuple[str, str, int]] = []
        for k in range(run.num_stages - 1):
            req = pb.ForwardRequest(
                request_id=self._request_id(mb, k, "f"), run_id=run.run_id, stage=k, step=mb.step_tag,
                reply_codec=self.codec,
            )  # fmt: skip
            min_step = mb.step_tag if run.exact else None
            tensors = {"input": inputs[k]}
            answered = await self.router.call(k, req, tensors, mb.samples, "forward", min_step=min_step)
            self.honesty.remember(k, "forward", req, tensors, mb.samples)
            if self.honesty.should_check():
                answered = await self.honesty.check(k, "forward", req, tensors, mb.samples, answered)
            inputs.append(answered[1])
            forwards.append((req.request_id, answered[2].peer_id, int(answered[0].kept_token)))
        return inputs, forwards

    async def _process(self, mb: Microbatch) -> None:
        run = self.run
        inputs, forwards = await self._forward(mb)
        targets = codec.to_proto(codec.encode(mb.targets, pb.CODEC_NONE))
        grad: WireTensor | None = None
        for k in reversed(range(run.num_stages)):
            req = pb.BackwardRequest(
                request_id=self._request_id(mb, k, "b"), run_id=run.run_id, stage=k, step=mb.step_tag,
                reply_codec=self.codec, num_samples=mb.samples, contribution_id=mb.cid, samples_digest=mb.digest,
            )  # fmt: skip
            tensors = {"input": inputs[k]}
            prefer, kept, token = None, None, 0
            if k == run.num_stages - 1:
                req.targets.CopyFrom(targets)
            else:
                tensors["grad_output"] = grad
                req.forward_id, prefer, token = forwards[k]
            # a step fed again (the swarm's step went back) repeats a contribution whose record is held:
            # the record is replayed there; this run's (at other parameters) gives the input gradient only
            req.check_only = self.replayer.holds(mb.cid, k)
            if token and not req.check_only:  # a check recomputes: it needs the input
                kept = (prefer, token)
            # no retry cap: later stages already hold this microbatch's gradient
            msg, grad, peer = answered = await self.router.call(
                k, req, tensors, mb.samples, "backward", retry_limit=NO_RETRY_CAP,
                min_step=mb.step_tag if run.exact else None, prefer=prefer, kept=kept,
            )  # fmt: skip
            if req.check_only:
                continue
            if k == run.num_stages - 1:
                self.honesty.remember(k, "backward", req, tensors, mb.samples)
            if k > 0 and self.honesty.should_check():
                # the majority's input gradient goes on; a caught liar's held gradient is replayed
                _, grad, _ = await self.honesty.check(k, "backward", req, tensors, mb.samples, answered)
            if k == run.num_stages - 1:
                self.stats.losses_by_step[int(msg.peer_step)].append((float(msg.loss), mb.samples))
            self.replayer.hold(mb, k, msg, peer.peer_id, req, tensors)
            inputs[k] = None  # the held record keeps what a replay needs
        mb.done = True

    async def _run_microbatch(self, mb: Microbatch) -> bool:
        again = False  # queued to run again
        try:
            try:
                await self._process(mb)
            except asyncio.CancelledError:
                self.stats.microbatches_cancelled += 1
                raise
            if self.feed.first_completion(mb):  # a step fed again repeats what completed: counted once
                self.stats.microbatches_completed += 1
                self.stats.samples += mb.samples
            self.pacer.done(mb.step_tag, mb.samples)
            return True
        except MicrobatchRejected as e:
            self.stats.microbatches_rejected += 1
            if not self.run.exact and mb.rejections < MAX_REJECTIONS:  # dropped, its step could never complete
                logger.warning("microbatch %s rejected (%s); it is queued again", mb.cid, e)
                self.feed.again(mb, rejected=True)
                again = True
                return False
            self.pacer.done(mb.step_tag, mb.samples)  # given up: waiting for it would stall the pacing
            logger.error("microbatch %s dropped: %s", mb.cid, e)
            if self.run.exact:
                raise
            return False
        except MicrobatchFailed as e:
            # failed before any gradient was accumulated: run the same samples again, same step
            self.stats.microbatches_requeued += 1
            logger.warning("microbatch %s failed (%s); it is queued again", mb.cid, e)
            self.feed.again(mb)
            again = True
            return False
        finally:
            self.in_flight -= 1
            if not again:
                self.feed.finished(mb)
            if not mb.done:
                self.replayer.forget(mb)
            self.progress.set()

    # ---- the training loop ----

    async def _wait_progress(self, timeout_s: float) -> None:
        """Until a microbatch finishes, a gradient is applied, or the view changes."""
        self.progress.clear()
        self.view.changed.clear()
        waiters = [asyncio.ensure_future(self.progress.wait()), asyncio.ensure_future(self.view.changed.wait())]
        try:
            await asyncio.wait(waiters, timeout=timeout_s, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for w in waiters:
                w.cancel()

    def _on_step(self, step: int | None) -> None:
        if not self.reporter.progress(step, self.honesty.stats.progress()):
            return
        cfg = self.cfg
        if cfg.val_every and cfg.trainer_index == 0 and step and step % cfg.val_every == 0 and step < cfg.steps:
            self._background.append(asyncio.create_task(self._periodic_validation(step)))

    async def _train(self, target: int) -> None:
        tasks: set[asyncio.Task] = set()
        idle_since: float | None = None  # nothing in flight and the pacing holds the next microbatch back
        try:
            while True:
                step = self.view.global_step()
                self._on_step(step)
                if (step is not None and step >= target) or self.stop_requested.is_set():
                    break
                if self.in_flight < self.cfg.max_in_flight:
                    mb = self.feed.next(step)
                    if mb is not None:
                        self.stats.idle_s += 0.0 if idle_since is None else time.monotonic() - idle_since
                        idle_since = None
                        self.in_flight += 1
                        self.stats.microbatches_started += 1
                        task = asyncio.create_task(self._run_microbatch(mb))
                        tasks.add(task)
                        task.add_done_callback(tasks.discard)
                        continue
                # nothing in flight, held back by the pacing: learn of the next step the moment it is applied
                idle_since = (idle_since or time.monotonic()) if self.in_flight == 0 else idle_since
                idle = self.in_flight == 0 and step is not None
                if not (idle and await self.view.wait_for_step(step + 1, PROGRESS_WAIT_S)):
                    await self._wait_progress(PROGRESS_WAIT_S)
                for task in [t for t in tasks if t.done() and not t.cancelled() and t.exception()]:
                    raise task.exception()
        finally:
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

    async def validate(self) -> float:
        args = (self.router, self.run, self.dataset, self.cfg.val_samples, self.codec, self.trainer_id)
        return await validation_loss(*args)

    async def _final_validation(self) -> float | None:
        """The final validation loss (trainer 0). After a stop request it is bounded by
        STOPPED_VALIDATION_S and may be left out (None): the stop comes first."""
        if self.cfg.trainer_index != 0 or self.cfg.val_samples <= 0:
            return None
        if not self.stop_requested.is_set():
            val_loss = await self.validate()
        else:
            try:
                val_loss = await asyncio.wait_for(self.validate(), STOPPED_VALIDATION_S)
            except (TimeoutError, MicrobatchFailed, StageUnavailable) as e:
                why = e if str(e) else f"no answer within {STOPPED_VALIDATION_S:.0f} s"
                logger.warning("stopping: final validation left out (%s)", why)
                return None
        logger.info("final validation loss %.4f", val_loss)
        return val_loss

    async def _periodic_validation(self, step: int) -> None:
        try:
            loss = await self.validate()
            self.stats.val_losses.append((step, loss))
            logger.info("validation loss at step %d: %.4f", step, loss)
        except Exception as e:  # noqa: BLE001 - validation must not stop training
            logger.warning("validation at step %d failed: %s", step, e)

    async def train(self) -> dict:
        t0 = time.monotonic()
        try:
            await self.setup()  # inside: a failed setup (wrong run id...) still stops the DHT node it started
            start_step = await self.wait_for_stages()
            if start_step >= self.cfg.steps:
                logger.info("the swarm is already at step %d >= %d", start_step, self.cfg.steps)
            if self.cfg.progress_bar and sys.stderr.isatty():
                self.reporter.open_bar(start_step, sys.stderr)
            self.reporter.t_start = time.monotonic()
            logger.info("training from step %d to %d (%s mode)", start_step, self.cfg.steps, self.run.sync)
            self.pacer.restart(start_step)
            await self._train(self.cfg.steps)
            train_s = time.monotonic() - self.reporter.t_start
            await self.replayer.settle(HELD_SETTLE_S, self.stop_requested)
            val_loss = await self._final_validation()
            await self.honesty.settle(0.0 if self.stop_requested.is_set() else SETTLE_S)  # unjudged accusations
            summary = self.reporter.summary(self.view.global_step() or 0, time.monotonic() - t0, train_s, val_loss)
            summary["stopped_early"] = self.stop_requested.is_set()
            summary["stage_fallbacks"] = fallback_totals(self.view.peers.values())
            summary.update(self.honesty.stats.summary())
            return summary
        finally:
            await self.close()


async def run_trainer(cfg: TrainerConfig) -> dict:
    """Train, print the summary line; SIGTERM or SIGINT stop training early, with a summary."""
    trainer = Trainer(cfg)
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, trainer.stop_requested.set)
    summary = await trainer.train()
    print(SUMMARY_PREFIX + json.dumps(summary), flush=True)
    if not math.isfinite(summary["samples_per_s"]):
        summary["samples_per_s"] = 0.0
    return summary
