"""Sending a trainer's calls: to the best peer of a stage (swarm.policy.wiring), with a deadline, and
on failure to another one.

What a peer's gRPC status means to the trainer:
- INVALID_ARGUMENT, RESOURCE_EXHAUSTED: the request itself was refused; another peer would refuse
  it too (`MicrobatchRejected`); but a RESOURCE_EXHAUSTED marked retryable (the peer is past one of
  its bounds: queue, streams, requests per client) is tried again in a moment, no ban.
- FAILED_PRECONDITION: the peer serves another stage or run now (it moved): choose another, no ban.
- NOT_FOUND, to a backward sent without its input (`kept`): the peer no longer holds the forward's
  activations: the same call again, with the input, no ban.
- ABORTED: the stage is agreeing on (and averaging) the update this backward is for, or the whole
  stage is behind the request's step (restored from an older checkpoint; it catches up with the
  replays): try again in a moment (the update may be unfrozen, or the request turn out to be a
  duplicate), no ban; for up to the stage wait, then the call fails (and the microbatch runs again).
- anything else (UNAVAILABLE: down, leaving its stage, shutting down; DEADLINE_EXCEEDED): ban the
  peer with a growing back-off and retry on another one.
"""

from __future__ import annotations

import asyncio
import logging
import time

import grpc

from swarm.cluster.view import SwarmView
from swarm.core.states import PeerState
from swarm.policy.wiring import PeerLoad, Wiring
from swarm.trainer.config import TrainerConfig
from swarm.trainer.report import Stats
from swarm.wire.pool import ClientPool
from swarm.wire.tensors import WireTensor, sample_bytes, split_samples

logger = logging.getLogger(__name__)

REJECTED = frozenset({grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.RESOURCE_EXHAUSTED})
MOVED = frozenset({grpc.StatusCode.FAILED_PRECONDITION})
RETRY_SOON = frozenset({grpc.StatusCode.ABORTED})  # the stage is averaging that update: try again shortly
RETRY_SOON_S = 0.1
RETRY_KEY = "swarm-retry"  # the peer marks an overload retryable (swarm.peer.statuses.RETRY_KEY)
NO_RETRY_CAP = None


class StageUnavailable(RuntimeError):
    """A stage has had no usable peer for the stage wait."""


class MicrobatchFailed(RuntimeError):
    """A call failed on every peer tried, up to the retry cap."""


class MicrobatchRejected(RuntimeError):
    """A peer refused the request as invalid: retrying elsewhere would not help."""


def _overloaded(e: grpc.aio.AioRpcError) -> bool:
    """RESOURCE_EXHAUSTED from a peer past one of its bounds (swarm.peer.admission): retry later."""
    try:
        metadata = e.trailing_metadata() or ()
    except Exception:  # noqa: BLE001 - no metadata: not marked retryable
        return False
    return e.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and any(k == RETRY_KEY for k, _ in metadata)


def _input_left_out(request, tensors: dict[str, WireTensor], token: int) -> tuple[object, dict[str, WireTensor]]:
    """A backward's copy that names the kept forward's token instead of carrying the input."""
    copy = type(request)()
    copy.CopyFrom(request)
    copy.ClearField("input")  # a unary gRPC send fills the request's tensors in place
    copy.kept_token = token
    return copy, {name: t for name, t in tensors.items() if name != "input"}


def _same_parts(tensors: dict[str, WireTensor], threshold: int) -> bool:
    """Whether a backward without its input goes in the parts its forward went in (unary both, or
    streamed in the same split): the peer keeps a forward's activations by part."""
    x, g = tensors.get("input"), tensors.get("grad_output")
    if x is None or g is None or (x.nbytes >= threshold) != (g.nbytes >= threshold):
        return False
    split = lambda t: split_samples(t.samples, sample_bytes(t.dtype, t.shape, t.codec))  # noqa: E731
    return x.nbytes < threshold or split(x) == split(g)


def work_share(kind: str, stage: int, num_stages: int) -> float:
    """The share of a training round's work a call does: a forward about a third, a backward two
    thirds (it recomputes the forward), the last stage's backward the whole round."""
    if kind == "forward":
        return 1.0 / 3.0
    return 1.0 if stage == num_stages - 1 else 2.0 / 3.0


class Router:
    def __init__(
        self, cfg: TrainerConfig, view: SwarmView, clients: ClientPool, wiring: Wiring, stats: Stats, num_stages: int
    ) -> None:
        self.cfg, self.view, self.clients, self.wiring, self.stats = cfg, view, clients, wiring, stats
        self.num_stages = num_stages

    async def _choose(
        self, stage: int, samples: int, min_step: int | None, exclude: set[str], prefer: str | None = None
    ) -> PeerLoad:
        """The best usable peer of `stage`, waiting (up to the stage wait) while there is none."""
        wait_deadline = None
        while True:
            now = time.monotonic()
            loads = self.view.stage_loads(stage, min_step)
            peer = self.wiring.choose(loads, samples, now, exclude, prefer=prefer)
            if peer is None and exclude:
                exclude.clear()  # every candidate was tried: give the unbanned ones another go
                peer = self.wiring.choose(loads, samples, now)
            if peer is not None:
                return peer
            wait_deadline = wait_deadline or now + self.cfg.stage_wait_s
            if now > wait_deadline:
                raise StageUnavailable(f"stage {stage} has had no usable peer for {self.cfg.stage_wait_s:.0f} s")
            await self.view.wait_changed(0.5)

    def _on_error(self, stage: int, peer: PeerLoad, e: grpc.aio.AioRpcError) -> bool:
        """Account for a failed call; True if it should be retried without counting it as a failure."""
        code = e.code()
        self.stats.failed_calls_by_code[code.name] += 1
        if code in RETRY_SOON or _overloaded(e):
            return True
        if code in REJECTED:
            raise MicrobatchRejected(f"stage {stage} peer {peer.peer_id[-6:]} rejected the request: {e.details()}")
        self.stats.failed_calls += 1
        if code in MOVED:
            logger.info("stage %d peer %s: %s; choosing another", stage, peer.peer_id[-6:], e.details())
            peer.online = False
            status = self.view.peers.get(peer.peer_id)
            if status is not None:
                status.record_state = PeerState.OFFLINE
            return False
        ban = self.wiring.on_failure(peer, time.monotonic())
        self.stats.failed_peers.add(peer.peer_id)
        self.stats.failures_by_peer[peer.peer_id] += 1
        logger.warning(
            "stage %d peer %s failed (%s: %s); banned for %.0f s, retrying on another peer",
            stage, peer.peer_id[-6:], code.name, (e.details() or "")[:120], ban,
        )  # fmt: skip
        return False

    def _measure(self, peer: PeerLoad, kind: str, stage: int, samples: int, elapsed: float) -> None:
        """End-to-end throughput, network included (only from calls made when nothing else of this
        trainer was in flight there); the wiring uses the slower of it and the peer's own figure,
        since a fast GPU behind a slow link is a slow peer. Peers report whole training rounds."""
        rate = samples * work_share(kind, stage, self.num_stages) / elapsed
        peer.e2e_throughput = rate if peer.e2e_throughput is None else 0.8 * peer.e2e_throughput + 0.2 * rate

    async def call(
        self,
        stage: int,
        request,
        tensors: dict[str, WireTensor],
        samples: int,
        kind: str,
        exclude: set[str] | None = None,
        retry_limit: int | None = -1,
        min_step: int | None = None,
        prefer: str | None = None,
        kept: tuple[str, int] | None = None,
    ) -> tuple[object, WireTensor | None, PeerLoad]:
        """Send to the best peer of `stage`; on failure ban it and retry elsewhere.

        Retries are capped at `retry_limit` (default: --max-retries; NO_RETRY_CAP for calls that must
        not give up because part of the microbatch's gradient is already accumulated). Waiting for a
        usable peer is capped by the stage wait either way. `min_step`: prefer peers that have
        applied step min_step - 1 (exact mode). `prefer`: the peer that ran this microbatch's forward
        (it may hold its activations), taken unless clearly more loaded than the best one. `kept`: (peer,
        token) when that peer said it keeps them: a backward sent to it leaves the input out.
        """
        retry_limit = self.cfg.max_retries if retry_limit == -1 else retry_limit
        if not (self.cfg.leave_out_kept_inputs and _same_parts(tensors, self.clients.stream_threshold)):
            kept = None
        exclude = set(exclude or ())
        attempts = 0
        soon_deadline = None
        while True:
            peer = await self._choose(stage, samples, min_step, exclude, prefer)
            timeout = self.cfg.min_deadline_s + self.cfg.deadline_factor * peer.expected_finish(samples)
            alone = peer.in_flight == 0  # only then does the call's time measure the peer, not our queue
            peer.in_flight += samples
            started = time.monotonic()
            left_out = kept is not None and kept[0] == peer.peer_id
            try:
                sent = _input_left_out(request, tensors, kept[1]) if left_out else (request, tensors)
                response, output = await self.clients.get(peer.address).call(kind, *sent, timeout)
            except grpc.aio.AioRpcError as e:
                if left_out and e.code() == grpc.StatusCode.NOT_FOUND:
                    kept = None  # that peer no longer holds the forward's activations: send the input
                    self.stats.inputs_resent += 1
                    continue
                if self._on_error(stage, peer, e):
                    soon_deadline = await self._not_yet(stage, e, retry_limit, soon_deadline)
                    continue
                exclude.add(peer.peer_id)
                attempts += 1
                self.stats.retries += 1
                if retry_limit is not None and attempts > retry_limit:
                    raise MicrobatchFailed(f"stage {stage}: {attempts} attempts failed") from None
                continue
            finally:
                peer.in_flight -= samples
            self.stats.inputs_left_out += left_out
            self._answered(peer, kind, stage, samples, response, time.monotonic() - started, alone)
            return response, output, peer

    async def _not_yet(
        self, stage: int, e: grpc.aio.AioRpcError, retry_limit: int | None, soon_deadline: float | None
    ) -> float:
        """ "Not yet" (the stage is averaging, overloaded or behind the run) is retried without a ban, for
        up to the stage wait when the call may give up; returns that deadline."""
        soon_deadline = soon_deadline or time.monotonic() + self.cfg.stage_wait_s
        if retry_limit is not None and time.monotonic() > soon_deadline:
            raise MicrobatchFailed(
                f"stage {stage} answered 'not yet' for {self.cfg.stage_wait_s:.0f} s: {e.details()}"
            ) from None
        await asyncio.sleep(RETRY_SOON_S)
        return soon_deadline

    def _answered(self, peer: PeerLoad, kind: str, stage: int, samples: int, response, elapsed: float, alone: bool):
        """Account for an answered call (`alone`: nothing else of this trainer was in flight there)."""
        self.wiring.on_success(peer)
        self.stats.calls_by_peer[peer.peer_id] += 1
        at_peer = float(getattr(response, "peer_s", 0.0))
        self.stats.count_call(kind, stage, elapsed, float(getattr(response, "compute_s", 0.0)), at_peer)
        if alone and elapsed > 0:
            self._measure(peer, kind, stage, samples, elapsed)


__all__ = ["MicrobatchFailed", "MicrobatchRejected", "NO_RETRY_CAP", "Router", "StageUnavailable"]
