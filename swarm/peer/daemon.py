"""The run-peer daemon: joins the DHT, takes a stage, serves Forward/Backward over gRPC, accumulates
gradients, and applies updates together with its stage-mates.

The peer is a composition of parts, each in its own module: the gRPC service (`server`), its
stage's parts and moving between stages (`membership`), its DHT record and events (`records`),
updates (`stepping`), rebalancing (`placement`), the look-ahead's mates' sums (`partials`). This
module starts them in order and stops them in the reverse order (`shutdown`).
"""

from __future__ import annotations

import asyncio
import json
import logging
import math
import os
import signal
import time

import torch

from swarm.cluster.authority import secure
from swarm.cluster.runconfig import SignedConfig, fetch_signed_config
from swarm.cluster.view import SwarmView
from swarm.core.auth import Verifier
from swarm.core.debug import FaultPlan, LiePlan, cpu_profile
from swarm.core.errors import ConfigError
from swarm.core.log import set_context
from swarm.core.procs import COUNTERS_PREFIX, READY_PREFIX
from swarm.core.states import PeerState, SyncMode
from swarm.core.version import __version__
from swarm.dht.node import SwarmDHT
from swarm.peer.config import PeerConfig
from swarm.peer.faults import PeerFaults
from swarm.peer.lane import LaneService
from swarm.peer.membership import Membership
from swarm.peer.partials import MatePartials
from swarm.peer.placement import PlacementLoop
from swarm.peer.preflight import announced_targets, reachability_problems, resolve_device
from swarm.peer.records import EventLog, PeerRecords
from swarm.peer.server import StageService, start_server
from swarm.peer.serving import Limits, ServingState
from swarm.training.models import stage_costs
from swarm.wire.codec import codec_from_name
from swarm.wire.pool import ClientPool

logger = logging.getLogger(__name__)

CONFIG_CHECK_S = 30.0  # how often a peer checks that the run config record is still there
CONFIG_TTL_S = 120.0
SERVER_GRACE_S = 1.0
MATES_REPOLL_S = 0.05  # a mate's freeze makes this peer re-read its mates at most this often


class Peer:
    def __init__(self, cfg: PeerConfig, faults: FaultPlan | None = None, lie: LiePlan | None = None) -> None:
        self.cfg = cfg
        keep = lambda task: self._tasks.append(task)  # noqa: E731 - _tasks is replaced at start
        self.faults = None if faults is None else PeerFaults(faults, lambda: self.membership, keep)
        self.lie = lie  # debug: a dishonest peer (tests of lying-peer detection)
        self.device = resolve_device(cfg.device)
        self.clients = ClientPool(cfg.max_message_bytes)
        self.stop_event = asyncio.Event()
        self.dht: SwarmDHT | None = None
        self.serving: ServingState | None = None
        self.server = None
        self.lane: LaneService | None = None
        self.view: SwarmView | None = None
        self.records: PeerRecords | None = None
        self.events: EventLog | None = None
        self.membership: Membership | None = None
        self.partials: MatePartials | None = None
        self._tasks: list[asyncio.Task] = []
        self.keeper = None  # a private swarm's certificate keeper

    async def _join_run(self) -> tuple[SignedConfig, Verifier | None]:
        """The run's signed config; in a private swarm, admission (a certificate every call carries) and the
        verifier of incoming calls."""
        cfg = self.cfg
        loop = asyncio.get_running_loop()
        signed = await loop.run_in_executor(
            None, fetch_signed_config, self.dht, cfg.join_timeout_s, cfg.run_key, cfg.allow_model
        )
        run = signed.run
        if cfg.stage != "auto" and not 0 <= int(cfg.stage) < run.num_stages:
            raise ConfigError(
                f"--stage {cfg.stage} is out of range: run {run.run_id!r} has {run.num_stages} stages "
                f"(0..{run.num_stages - 1}); use one of those or --stage auto"
            )
        self.keeper = await loop.run_in_executor(None, secure, self.dht, signed, cfg.invite, "peer")
        if self.keeper is not None:  # a private swarm: every call carries this member's certificate
            self.clients.credentials = self.keeper.credentials
        return signed, Verifier(run.run_id, signed.key) if run.private else None

    async def start(self) -> None:
        t0 = time.monotonic()
        cfg = self.cfg
        if cfg.threads:
            torch.set_num_threads(cfg.threads)
        # on the main thread, which outlives the DHT process (see swarm.dht.node._DyingDHT)
        self.dht = SwarmDHT(
            cfg.run_id, cfg.initial_peers, host=cfg.host, port=cfg.dht_port, announce_host=cfg.announce_host,
            identity_path=cfg.identity_path,
        )  # fmt: skip
        set_context(peer=self.dht.peer_id[-6:])
        signed, verifier = await self._join_run()
        run = signed.run
        self.serving = ServingState(run.run_id, self.dht.peer_id, __version__)
        self.serving.lie = self.lie
        if self.faults is not None:  # debug: injected faults (swarm.peer.faults)
            self.serving.before_compute = self.faults.before_compute if self.faults.plan.in_request else None
            self.serving.before_mate_fetch = self.faults.before_mate_fetch if self.faults.plan.in_mate_fetch else None
        self.serving.codec = codec_from_name(run.codec)
        self.serving.exact = run.exact
        limits = self._limits(run)
        service = StageService(self.serving, limits)
        server_tls = self.keeper.server_tls if self.keeper is not None else None
        self.server, port = await start_server(service, cfg.host, cfg.port, limits, verifier, server_tls)
        await self._start_lane(service, private=verifier is not None or server_tls is not None)
        self.view = SwarmView(self.dht, run.num_stages, self.clients, exclude_peer=self.dht.peer_id)
        self.records = PeerRecords(self.dht, self.serving, self.device.type, cfg.announce_period_s, cfg.record_ttl_s)
        self.records.address = f"{cfg.announce_host or cfg.host}:{port}"
        self.events = EventLog(self.dht, cfg.events_ttl_s)
        m = self.membership = Membership(
            cfg, run, self.dht, self.view, self.clients, self.serving, self.records, self.events, self.device
        )
        await m.enter(await m.pick_stage())
        seconds = time.monotonic() - t0
        logger.info("joined stage %d in %.2f s", m.stage, seconds)
        throughput = round(self.serving.throughput, 2)
        self.events.add(
            "join", publish=False, stage=m.stage, step=m.step, throughput=throughput, seconds=round(seconds, 2)
        )
        await m.publish_events()  # before the first record that says online
        self.records.start()
        self.view.info_listeners.append(self._note_mates_step)
        self._wake_steps_on_progress()
        self.view.start(poll_stages={m.stage}, watch=True)
        self._tasks = [
            asyncio.create_task(self._step_loop()),
            asyncio.create_task(self._config_keeper(signed.to_text())),
        ]
        if run.sync == SyncMode.ASYNC and run.predict_params:
            self.partials = MatePartials(m, self.clients, run.run_id, max_bytes=cfg.max_state_bytes)
            self.view.info_listeners.append(self.partials.poll)  # fetch as soon as a mate's count grows
            self.serving.on_run_ahead = self._mates_for_prediction
            self._tasks.append(asyncio.create_task(self.partials.run()))
        if cfg.rebalance:
            costs = stage_costs(run.model, run.num_stages)
            placement = PlacementLoop(m, run.num_stages, costs, cfg.rebalance_period_s, cfg.rebalance_threshold)
            self._tasks.append(asyncio.create_task(placement.run()))
        self._print_ready()
        self._tasks.append(asyncio.create_task(self._check_reachable(port)))

    async def _start_lane(self, service: StageService, private: bool) -> None:
        """The lane (swarm.wire.lane) of an open swarm: trainers learn its port from Info."""
        if private or self.cfg.lane_port < 0:
            return
        self.lane = LaneService(service)
        self.serving.lane_port = await self.lane.start(self.cfg.host, self.cfg.lane_port)

    def _limits(self, run) -> Limits:
        ahead = 1 if run.exact else math.ceil(run.max_staleness) + 1  # a request's step, at most this far ahead
        return Limits(
            max_message_bytes=self.cfg.max_message_bytes,
            max_batch=run.max_batch,
            max_steps_ahead=ahead,
            stream_read_timeout_s=self.cfg.stream_read_timeout_s,
        )

    def _note_mates_step(self) -> None:
        """After each round of Info polls: how far the stage is (swarm.peer.server tells a request
        for a step this peer has not reached from one no peer of the stage takes). Every mate it has
        heard from counts, live or not: right after a pause (SIGSTOP, a cut link) no mate looks live
        yet, and a request for the stage's current step was refused as invalid, its microbatch lost."""
        m = self.membership
        mates = m.view.stage_peers(m.stage, live_only=False)
        self.serving.mates_step = max((mate.step for mate in mates if mate.last_info_ok), default=0)

    def _print_ready(self) -> None:
        m = self.membership
        ready = {
            "role": "peer",
            "peer_id": self.dht.peer_id,
            "stage": m.stage,
            "step": m.step,
            "address": self.records.address,
            "dht_maddrs": self.dht.visible_maddrs(),
            "throughput": self.serving.throughput,
            "pid": os.getpid(),
        }
        print(READY_PREFIX + json.dumps(ready), flush=True)
        logger.info(
            "serving stage %d from step %d at %s (%.1f samples/s)",
            m.stage, m.step, self.records.address, self.serving.throughput,
        )  # fmt: skip

    async def _check_reachable(self, grpc_port: int) -> None:
        """Tell the operator at start when others cannot connect to this peer (behind NAT, closed ports)."""
        targets = announced_targets(self.cfg, grpc_port, self.dht.visible_maddrs())
        loop = asyncio.get_running_loop()
        for line in await loop.run_in_executor(None, reachability_problems, self.dht, self.cfg, targets):
            logger.warning("%s", line)
            self.events.add("unreachable", detail=line[:200])

    def _wake_steps_on_progress(self) -> None:
        """The step decision runs when something it reads may have changed: a backward accumulated
        here, a round of the mates' Info answers; else every step_poll_s (stall reports, faults)."""
        self.step_wake = asyncio.Event()
        self.serving.on_accumulated = self.step_wake.set
        self.view.info_listeners.append(self.step_wake.set)  # a round of Info polls sets it
        self._mates_poll: asyncio.Task | None = None
        self._mates_poll_at = 0.0
        self._run_ahead_step = -1
        self.serving.on_mate_froze = self._repoll_mates  # the stage may hold its batch now

        def accused(peer_ids: list[str]) -> None:  # an Info poller names accused peers
            stepper = None if self.membership.runtime is None else self.membership.runtime.stepper
            if stepper is not None:
                stepper.accusations.hint(peer_ids)

        self.serving.on_accused = accused
        self.serving.accused_hint = self.view.accused_hint

    def _repoll_mates(self) -> bool:
        """Re-read the mates' Info now: at most one such round in flight, and one per MATES_REPOLL_S;
        True if one started."""
        now = time.monotonic()
        if (self._mates_poll is None or self._mates_poll.done()) and now - self._mates_poll_at > MATES_REPOLL_S:
            self._mates_poll_at = now
            self._mates_poll = asyncio.create_task(self.view.poll_info({self.membership.stage}))
            return True
        return False

    def _mates_for_prediction(self) -> None:
        """A request for a step past this peer's came in: it is computed at the parameters the pending
        update is expected to give, from the gradients the stage holds for it. Re-read the mates' counts
        now (once per pending update), so that their partial sums are fetched for the run-ahead
        microbatches that follow, not a poll period later (swarm.peer.partials)."""
        ex = self.serving.executor
        if ex is not None and ex.step != self._run_ahead_step and self._repoll_mates():
            self._run_ahead_step = ex.step

    async def _step_loop(self) -> None:
        """Apply the stage's pending update when it is due (swarm.peer.stepping decides)."""
        m = self.membership
        while not self.stop_event.is_set():
            try:
                async with asyncio.timeout(self.cfg.step_poll_s):
                    await self.step_wake.wait()
            except TimeoutError:
                pass
            self.step_wake.clear()
            if self.faults is not None:
                await self.faults.at_step_loop(m.step)
                if self.faults.compute_stopped:
                    continue  # the leave fault stopped the compute: no update until it has moved
            executor = m.executor
            if executor is not None and executor.throughput_ema:
                self.serving.throughput = 0.8 * self.serving.throughput + 0.2 * executor.throughput_ema
            try:
                async with m.lock:  # a move holds it: the runtime read below is the current one
                    stepper = m.runtime.stepper
                    reason = stepper.decide()
                    if reason is not None:
                        await stepper.run_update(reason)
            except Exception:  # noqa: BLE001 - a failed update must not kill the peer
                logger.exception("update failed")

    async def _config_keeper(self, text: str) -> None:
        """Re-publish the run config if its record disappears (the coordinator died): new peers can
        still join."""
        loop = asyncio.get_running_loop()
        while not self.stop_event.is_set():
            await asyncio.sleep(CONFIG_CHECK_S * self.membership.rng.uniform(1.0, 1.33))
            try:
                if not await loop.run_in_executor(None, self.dht.get_config_records):
                    await loop.run_in_executor(None, self.dht.publish_config, text, CONFIG_TTL_S)
                    logger.info("the run config record was gone; re-published it")
            except Exception as e:  # noqa: BLE001
                logger.debug("config keeper: %s", e)

    def counters(self) -> dict:
        """What this peer did, for its shutdown line (tests and benchmarks parse it)."""
        m = self.membership
        ex = None if m is None else m.executor
        out: dict = {"peer_id": None if self.dht is None else self.dht.peer_id, "stage": None if m is None else m.stage}
        if ex is not None:
            out.update(step=ex.step, **ex.counters_dict())
        out["earlier_stages"] = {} if m is None else m.earlier_stages  # what it did before it moved
        out["partials_fetched"] = 0 if self.partials is None else self.partials.fetches
        stepper = None if m is None or m.runtime is None else m.runtime.stepper
        out["slow_accusation_reads"] = 0 if stepper is None else stepper.accusations.slow_reads
        out["accusation_reads"] = 0 if stepper is None else stepper.accusations.reads
        out["update_timeline"] = {} if stepper is None else stepper.timeline.as_dict()
        out["lane_calls"] = 0 if self.lane is None or self.lane.server is None else self.lane.server.calls
        return out

    async def shutdown(self) -> None:
        """Drain, checkpoint, announce offline explicitly, then stop every part, in this order:
        1. publish a "leave" event and say "draining" (trainers stop sending new work);
        2. wait for the requests in flight (up to the drain timeout);
        3. cancel the background tasks (updates, rebalancing, mates' sums, config keeper);
        4. write a last checkpoint if this peer writes its stage's (queued before the executor stops);
        5. stop the view's polls, then the lane and the gRPC server;
        6. stop the announcer and store the explicit offline record;
        7. stop the stage's executor and averager, close the channels, stop the DHT last (every
           step above may still use it)."""
        m = self.membership
        counters = self.counters()
        print(COUNTERS_PREFIX + json.dumps(counters), flush=True)
        if self.serving is not None:  # quiet when the start failed: the error is the one line to read
            logger.info("shutting down: %s", json.dumps(counters))
        loop = asyncio.get_running_loop()
        if m is not None and m.runtime is not None:
            self.events.add("leave", publish=False, stage=m.stage)
            await loop.run_in_executor(None, self.events.publish)
            self.serving.state = PeerState.DRAINING
            self.records.refresh_now()
            await m.drain()
        for task in self._tasks:
            task.cancel()
        if m is not None and m.runtime is not None and m.runtime.checkpoints is not None:
            await m.runtime.checkpoints.write_final()
        if self.view is not None:
            await self.view.stop()
        if self.lane is not None:
            await self.lane.stop()
        if self.server is not None:
            await self.server.stop(grace=SERVER_GRACE_S)
        if self.records is not None:
            await loop.run_in_executor(None, self.records.stop)
        if m is not None and m.runtime is not None:
            await m.runtime.stop()
        await self.clients.close()
        if self.keeper is not None:
            self.keeper.stop()
        if self.events is not None:
            self.events.close()
        if self.dht is not None:
            await loop.run_in_executor(None, self.dht.shutdown)
        if self.serving is not None:
            logger.info("stopped")


async def run_peer(
    cfg: PeerConfig, faults: FaultPlan | None = None, profile_dir: str | None = None, lie: LiePlan | None = None
) -> int:
    peer = Peer(cfg, faults, lie)
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, peer.stop_event.set)
    try:
        start = asyncio.create_task(peer.start())
        stop_wait = asyncio.create_task(peer.stop_event.wait())
        done, _ = await asyncio.wait({start, stop_wait}, return_when=asyncio.FIRST_COMPLETED)
        if start in done:
            start.result()  # raise a start-up error here
            with cpu_profile(profile_dir, "peer"):
                await stop_wait
        else:
            start.cancel()
        return 0
    finally:
        await peer.shutdown()
