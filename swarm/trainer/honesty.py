"""Catching peers that lie about their results.

A trainer spot-checks a random fraction (--spot-check) of the forward outputs and input gradients it
receives: it sends the same request to another peer of the stage (a backward as `check_only`: the
input gradient only, nothing accumulated) as a reference request (at the peer's applied parameters,
no async look-ahead: honest mates predict the pending update from different gradients) and compares
the answers of one parameter step within a tolerance that allows for the codec; a first answer that
was computed at predicted parameters is judged by its peer's reference answer.
On a mismatch a third peer decides: the peer that disagrees with the two others is the liar. The
trainer bans it at once (its answer is replaced by the majority's; the gradients it held are
replayed on its mates) and publishes a signed accusation with the evidence (digests of the input
and of both answers, the witnesses). Peers leave an accused mate out of their stage's updates;
every other trainer stops sending it work as soon as it reads the accusation, and verifies it by
recomputation (the same input sent to the accused and to two mates) before it bans it too. An
accusation it cannot confirm is counted and reported, not acted on by that trainer.

With only two peers in a stage a mismatch cannot be attributed: it is counted ("disputed") and
reported. A lie smaller than the tolerance is not detected; the tolerance bounds its effect.
"""

from __future__ import annotations

import asyncio
import collections
import hashlib
import logging
import random
import time
from dataclasses import dataclass, field

import torch

from swarm.cluster.view import SwarmView
from swarm.dht.node import SwarmDHT
from swarm.dht.records import Accusation, AccusationRecord
from swarm.policy.wiring import PeerLoad
from swarm.trainer.router import MicrobatchFailed, MicrobatchRejected, Router, StageUnavailable
from swarm.trainer.verification import AccusationVerifier, Probe, answer, relative_error
from swarm.wire.pool import ClientPool
from swarm.wire.protocol import pb
from swarm.wire.tensors import WireTensor

logger = logging.getLogger(__name__)

# relative L2 difference two honest answers may show: float nondeterminism, the reply codec's
# rounding (both answers are encoded), and in async mode answers of neighbouring steps (answers are
# asked again until they are of one step, at most STEP_ROUNDS times)
CODEC_TOLERANCE = {pb.CODEC_NONE: 1e-3, pb.CODEC_FP16: 5e-3, pb.CODEC_BF16: 3e-2, pb.CODEC_INT8_BLOCK: 6e-2}
ASYNC_TOLERANCE = 0.1
ACCUSATION_TTL_S = 600.0
REPUBLISH_S = 60.0
VERIFY_PERIOD_S = 0.25  # how often a trainer tries to verify the accusations it has not judged yet
# A trainer reads the accusations (one DHT key) when an Info answer names a peer accused that it does
# not know (swarm.cluster.accusations), besides the view's periodic read: it stops sending a liar work
# once it reads one, and a 2 s periodic read alone let a fast stage's liar spoil 3.8% of validation loss.
SETTLE_S = 10.0  # how long a trainer that is done goes on judging the accusations it has read
# a mismatch between answers computed at different steps is asked again, at once, up to this many
# times this far apart: a peer catching up with its mates (a failed all-reduce, a download) takes ~1 s
STEP_ROUNDS = 6
STEP_ROUND_WAIT_S = 0.3


def default_tolerance(codec_id: int, exact: bool) -> float:
    return CODEC_TOLERANCE.get(codec_id, 0.1) + (0.0 if exact else ASYNC_TOLERANCE)


def digest(t: torch.Tensor | None) -> str:
    if t is None:
        return ""
    return hashlib.sha256(t.detach().contiguous().cpu().numpy().tobytes()).hexdigest()[:32]


@dataclass
class HonestyStats:
    spot_checks: int = 0
    mismatches: int = 0
    disputed: int = 0  # a mismatch that could not be attributed (no third peer, or three answers)
    accusations_confirmed: int = 0  # others' accusations this trainer verified
    accusations_rejected: int = 0
    banned: dict[str, dict] = field(default_factory=dict)  # peer id -> how, when, after how many calls
    max_agreeing_error: float = 0.0  # the largest difference seen between answers within the tolerance
    # peer id -> mismatched checks it answered in (either side): bounded by the peers of the run
    mismatches_by_peer: collections.Counter[str] = field(default_factory=collections.Counter)

    def progress(self) -> dict:
        """The figures of a progress line: what the checks found so far."""
        return {
            "spot_checks": self.spot_checks,
            "spot_check_mismatches": self.mismatches,
            "spot_checks_disputed": self.disputed,
            "liars_banned": len(self.banned),
        }

    def summary(self) -> dict:
        return {
            **self.progress(),
            "accusations_confirmed": self.accusations_confirmed,
            "accusations_rejected": self.accusations_rejected,
            "liars_banned": self.banned,
            "spot_check_max_agreeing_error": self.max_agreeing_error,
            "spot_check_mismatches_by_peer": dict(self.mismatches_by_peer),
        }


class Honesty(AccusationVerifier):
    def __init__(
        self,
        view: SwarmView,
        router: Router,
        clients: ClientPool,
        dht: SwarmDHT,
        trainer_id: str,
        rate: float,
        tolerance: float,
        calls_by_peer,
        seed: int = 0,
    ) -> None:
        self.view, self.router, self.clients, self.dht = view, router, clients, dht
        self.trainer_id, self.rate, self.tolerance = trainer_id, rate, tolerance
        self.calls_by_peer = calls_by_peer  # successful calls per peer (the trainer's Stats)
        self.rng = random.Random(seed)
        self.stats = HonestyStats()
        self.mine: list[Accusation] = []
        self.verified: set[str] = set()  # accused peers this trainer has judged (banned or rejected)
        self.probes: dict[int, Probe] = {}
        self._agreeing: collections.Counter[str] = collections.Counter()  # probes the accused passed
        # verification answers: (accused, probe) -> step -> peer id -> answer (swarm: `verify`)
        self._answers: dict[tuple[str, int], dict[int, dict[str, torch.Tensor]]] = {}
        self._publish_soon = False
        self._checks = 0

    # ---- spot checks ----

    def should_check(self) -> bool:
        return self.rate > 0 and self.rng.random() < self.rate

    def remember(self, stage: int, kind: str, request, tensors: dict[str, WireTensor], samples: int) -> None:
        self.probes[stage] = Probe(kind, request, tensors, samples)

    def _check_request(self, kind: str, request):
        self._checks += 1
        copy = type(request)()
        copy.CopyFrom(request)
        copy.request_id = f"{request.request_id}:check{self._checks}"
        copy.reference = True  # at the applied parameters: an async look-ahead differs between honest mates
        if kind == "backward":
            copy.check_only = True
            copy.contribution_id = ""
        return copy

    async def _other(self, stage: int, kind: str, request, tensors, samples: int, exclude: set[str]):
        """The same request answered by another peer of the stage, chosen at random (not the one the
        wiring prefers: under light load it sends nearly all work to the fastest peer, and checks
        must cover every peer of the stage); None when there is none."""
        eligible = self.router.wiring.eligible(self.view.stage_loads(stage), time.monotonic(), exclude)
        others = {p.peer_id for p in eligible}
        if not others:
            return None  # no other usable peer: asking anyway made the only one compute it twice
        others.discard(self.rng.choice(sorted(others)))  # the one asked: every other eligible peer is left out
        try:
            response, output, peer = await self.router.call(
                stage, self._check_request(kind, request), tensors, samples, kind, exclude=exclude | others,
                retry_limit=1,
            )  # fmt: skip
        except (StageUnavailable, MicrobatchFailed, MicrobatchRejected) as e:
            logger.info("spot check on stage %d found no other peer to answer: %s", stage, e)
            return None
        if peer.peer_id in exclude:
            return None  # the stage has no other usable peer
        return response, output, peer

    async def check(self, stage: int, kind: str, request, tensors, samples: int, first: tuple):
        """Spot-check `first` (response, output, peer) on a stage-mate; returns the answer to use
        (the majority's when the first peer is caught)."""
        response, output, peer = first
        mine = answer(kind, response, output)
        if mine is None:
            return first
        second = await self._other(stage, kind, request, tensors, samples, {peer.peer_id})
        if second is None:
            return first
        mine_at = (mine, int(response.params_step))
        if response.predicted:
            # an async look-ahead answer: each honest peer predicts from the gradients it holds, so the
            # first peer is judged by its reference answer (at its applied parameters) instead
            mine_at = await self._probe(peer.address, Probe(kind, request, tensors, samples))
            if mine_at is None:
                return first
            mine = mine_at[0]
        self.stats.spot_checks += 1
        theirs = answer(kind, second[0], second[1])
        pair = [mine_at, (theirs, int(second[0].params_step))]
        if theirs is not None and not self._agree(mine, theirs):
            # in async mode a peer that applied an update a moment before its mate answers with
            # other parameters: the two are asked again until they answer at one step
            (mine, _), (theirs, _) = pair = await self._at_one_step(kind, request, tensors, [peer, second[2]], pair)
        if theirs is not None and self._agree(mine, theirs):
            return first
        error = relative_error(mine, theirs) if theirs is not None else float("inf")
        self.stats.mismatches += 1
        self.stats.mismatches_by_peer.update([peer.peer_id, second[2].peer_id])
        third = await self._other(stage, kind, request, tensors, samples, {peer.peer_id, second[2].peer_id})
        verdict = None if third is None else answer(kind, third[0], third[1])
        if verdict is None:
            self._disputed(stage, kind, peer, second[2], error, "no third peer to decide")
            return first
        if theirs is not None:
            trio = await self._at_one_step(
                kind, request, tensors, [peer, second[2], third[2]], [*pair, (verdict, int(third[0].params_step))]
            )
            (mine, _), (theirs, _), (verdict, _) = trio
        first_ok = relative_error(mine, verdict) <= self.tolerance
        second_ok = theirs is not None and relative_error(theirs, verdict) <= self.tolerance
        evidence = (request, tensors)
        if second_ok and not first_ok:
            await self.ban(stage, kind, peer, mine, verdict, error, [second[2].peer_id, third[2].peer_id], evidence)
            return second[0], second[1], second[2]
        if first_ok and not second_ok:
            liar = second[2]
            await self.ban(stage, kind, liar, theirs, verdict, error, [peer.peer_id, third[2].peer_id], evidence)
            return first
        self._disputed(stage, kind, peer, second[2], error, "three different answers")
        return first

    def _agree(self, a: torch.Tensor, b: torch.Tensor) -> bool:
        error = relative_error(a, b)
        if error <= self.tolerance:
            self.stats.max_agreeing_error = max(self.stats.max_agreeing_error, error)
            return True
        return False

    async def _at_one_step(self, kind: str, request, tensors, peers: list[PeerLoad], answers: list[tuple]) -> list:
        """`answers` ((answer, the step it was computed at), one per peer) if they are of one step;
        else the peers' answers to the request asked again, at once, until they are (at most
        STEP_ROUNDS times), or the last ones: a peer cannot escape a check by claiming another step."""
        probe = Probe(kind, request, tensors, 0)
        for _ in range(STEP_ROUNDS):
            if len({step for _, step in answers}) <= 1:
                break
            await asyncio.sleep(STEP_ROUND_WAIT_S)
            again = await asyncio.gather(*(self._probe(p.address, probe) for p in peers))
            if any(a is None for a in again):
                break
            answers = list(again)
        return answers

    def _disputed(self, stage: int, kind: str, a: PeerLoad, b: PeerLoad, error: float, why: str) -> None:
        self.stats.disputed += 1
        logger.warning(
            "spot check: peers %s and %s of stage %d gave %s answers %.3g apart (tolerance %.3g); %s",
            a.peer_id[-6:], b.peer_id[-6:], stage, kind, error, self.tolerance, why,
        )  # fmt: skip

    # ---- bans and accusations ----

    async def ban(self, stage: int, kind: str, liar: PeerLoad, lie, truth, error: float, witnesses, evidence) -> None:
        if liar.peer_id in self.stats.banned:
            return
        request, tensors = evidence
        inputs = tensors.get("input")
        accusation = Accusation(
            accused=liar.peer_id, stage=stage, step=int(request.step), kind=kind,
            input_digest=digest(inputs.decode() if inputs is not None else None),
            accused_digest=digest(lie), majority_digest=digest(truth), error=min(error, 1e6),
            witnesses=[w for w in witnesses][:4], time=time.time(),
        )  # fmt: skip
        self._banned(liar.peer_id, "caught", accusation)
        self.mine.append(accusation)
        await self.publish()
        self._published(liar.peer_id, stage)
        await self.view.poll_info({stage})  # its polls name the accused: the stage reads of it now

    def _published(self, peer_id: str, stage: int) -> None:
        """When the accusation was out, and the stage's step then: every update the stage agrees on
        from then (from update `stage_step` + 1 at the latest) leaves the accused out."""
        self.stats.banned[peer_id].update(published=time.time(), stage_step=self.view.stage_step(stage))

    def _banned(self, peer_id: str, how: str, accusation: Accusation) -> None:
        if peer_id in self.stats.banned:
            return
        self.verified.add(peer_id)
        self.view.accused.setdefault(peer_id, accusation)  # no more work for it from this trainer
        self.stats.banned[peer_id] = {
            "how": how, "stage": accusation.stage, "time": time.time(), "calls_before": self.calls_by_peer[peer_id],
        }  # fmt: skip
        logger.warning(
            "banned peer %s of stage %d (%s): its %s answer is %.3g from its mates' (tolerance %.3g)",
            peer_id[-6:], accusation.stage, how, accusation.kind, accusation.error, self.tolerance,
        )  # fmt: skip

    async def publish(self) -> None:
        if not self.mine:
            return
        record = AccusationRecord(trainer_id=self.trainer_id, accusations=self.mine[-16:])
        loop = asyncio.get_running_loop()
        try:
            await loop.run_in_executor(None, self.dht.publish_accusations, record, ACCUSATION_TTL_S)
        except Exception as e:  # noqa: BLE001 - republished periodically
            logger.warning("publishing accusations failed: %s", e)

    # ---- verifying others' accusations ----

    async def run(self) -> None:
        last_publish = time.monotonic()
        while True:
            await asyncio.sleep(VERIFY_PERIOD_S)
            for peer_id, accusation in list(self.view.accused.items()):
                if peer_id not in self.verified:
                    try:
                        await self.verify(peer_id, accusation)
                    except Exception:  # noqa: BLE001 - verification must not stop training
                        logger.exception("verifying the accusation of %s failed", peer_id[-6:])
            if self._publish_soon:  # a confirmed accusation goes out at once
                self._publish_soon = False
                last_publish = time.monotonic()
                await self.publish()
            if time.monotonic() - last_publish > REPUBLISH_S:
                last_publish = time.monotonic()
                await self.publish()

    async def settle(self, timeout_s: float = SETTLE_S) -> None:
        """Before the trainer leaves: judge the accusations it read but has not judged yet, for at
        most `timeout_s`, and publish what it confirmed. An accusation read a moment before the last
        step (a fast run) was otherwise never verified: no work went to the accused, but this
        trainer neither banned it nor said so to the others."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            tried = False
            for peer_id, accusation in [(p, a) for p, a in self.view.accused.items() if p not in self.verified]:
                try:
                    left = deadline - time.monotonic()
                    tried = await asyncio.wait_for(self.verify(peer_id, accusation), max(left, 0.01)) or tried
                except TimeoutError:
                    break
                except Exception:  # noqa: BLE001 - leaving must not fail on a verification
                    logger.exception("verifying the accusation of %s before leaving failed", peer_id[-6:])
            if not tried:
                break  # nothing pending, or nothing to probe with
        if self._publish_soon:
            self._publish_soon = False
            await self.publish()
