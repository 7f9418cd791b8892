"""Verifying another trainer's accusation (a mixin of swarm.trainer.honesty.Honesty): the same request
sent to the accused and to two of its mates, answers compared at one step.

The accused takes no part in its stage's updates (it follows them by downloading a mate's state), so
it is at a step of its mates only from a download to their next update. A verification waits for the
accused's step to change (the Info long poll) and probes the three at that step at once; answers are
kept by the step they were computed at, so answers of one step taken in different rounds still
count. Answers of different steps prove nothing.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass

import torch

from swarm.dht.records import Accusation
from swarm.wire.tensors import WireTensor

logger = logging.getLogger(__name__)

VERIFY_PROBES = 2  # agreeing answers from the accused that reject an accusation
VERIFY_WAIT_S = 3.0  # how long a verification waits for the accused's next step (downloads: <= 1/s)
VERIFY_STEPS_KEPT = 8  # steps whose verification answers are kept, waiting for the accused's or the mates'
CHECK_TIMEOUT_S = 30.0


def relative_error(a: torch.Tensor, b: torch.Tensor) -> float:
    """||a - b|| / max(||a||, ||b||): 0 for equal answers, about 1.4 for unrelated ones."""
    if a.shape != b.shape:
        return float("inf")
    a, b = a.double(), b.double()
    scale = max(float(a.norm()), float(b.norm()), 1e-12)
    return float((a - b).norm()) / scale


def answer(kind: str, response, output: WireTensor | None) -> torch.Tensor | None:
    """What is compared: the output (forward) or input gradient (backward), with the loss of a last
    stage's backward appended."""
    parts = []
    if output is not None:
        parts.append(output.decode().float().reshape(-1))
    if kind == "backward" and response is not None and response.loss:
        parts.append(torch.tensor([float(response.loss)]))
    return torch.cat(parts) if parts else None


@dataclass
class Probe:
    """A request this trainer sent to a stage, kept to verify others' accusations with."""

    kind: str
    request: object
    tensors: dict[str, WireTensor]
    samples: int


class AccusationVerifier:
    """Needs of its host: view, clients, probes, rng, tolerance, stats, mine, verified, _agreeing,
    _answers, _publish_soon, _banned, _published, _check_request."""

    async def verify(self, peer_id: str, accusation: Accusation) -> bool:
        """Send a remembered request of the accused's stage to it and to two mates, each at its own
        step, and keep the answers by step: ban it if, at one step, it disagrees with two mates that
        agree; reject the accusation if it agrees VERIFY_PROBES times. The accused takes no part in its
        stage's updates (it follows them by downloading a mate's state), so it is at a step of its
        mates only from a download to their next update: answers of the same step (computed at the
        same parameters) are collected over several rounds, not required at one instant (that left a
        fast stage's liar unverified for a whole run). Answers of different steps prove nothing.
        False when there was nothing to probe with (no remembered request, the accused gone, too few
        mates)."""
        probe = self.probes.get(accusation.stage)
        accused = self.view.peers.get(peer_id)
        if probe is None or accused is None or not self.view.is_live(accused) or not accused.last_info_ok:
            return False  # nothing to verify with yet, or it is gone (no work goes to it either way)
        peers = self.view.stage_peers(accusation.stage)
        mates = [m for m in peers if m.peer_id not in self.view.accused and m.last_info_ok]
        if len(mates) < 2:
            return False  # too few mates to judge: later
        # the moment the accused's step changes (a download: it is at its mates' step then), probe
        # the three at that step (the Info long poll returns then; a mate may have moved on anyway)
        step = await self._next_step_of(accused)
        chosen = [accused, *self.rng.sample(mates, 2)]
        answers = await asyncio.gather(*(self._probe(p.load.address, probe, step) for p in chosen))
        by_step = self._answers.setdefault((peer_id, id(probe)), {})
        for p, got in zip(chosen, answers, strict=True):
            if got is not None:
                by_step.setdefault(got[1], {})[p.peer_id] = got[0]
        for step in sorted(by_step):
            if peer_id in by_step[step] and len(by_step[step]) >= 3:
                self._judge(peer_id, accusation, by_step.pop(step))
                break
        for step in sorted(by_step)[:-VERIFY_STEPS_KEPT]:
            del by_step[step]
        return True

    def _judge(self, peer_id: str, accusation: Accusation, at_step: dict[str, torch.Tensor]) -> None:
        """The accused's answer against two mates' answers of the same step."""
        if peer_id in self.verified:
            return  # judged already (by the periodic task, or the settling before leaving)
        theirs = at_step.pop(peer_id)
        (first_id, first), (second_id, second) = sorted(at_step.items())[:2]
        errors = [relative_error(theirs, first), relative_error(theirs, second)]
        mates_agree = relative_error(first, second) <= self.tolerance
        if mates_agree and min(errors) > self.tolerance:
            self.stats.accusations_confirmed += 1
            confirmed = accusation.copy(update={"error": min(min(errors), 1e6), "time": time.time()})
            confirmed.witnesses = [first_id, second_id]
            self._banned(peer_id, "confirmed", confirmed)
            self.mine.append(confirmed)
            self._publish_soon = True
            self._published(peer_id, accusation.stage)
        elif max(errors) <= self.tolerance:
            self._agreeing[peer_id] += 1
            if self._agreeing[peer_id] >= VERIFY_PROBES:
                self.verified.add(peer_id)
                self.stats.accusations_rejected += 1
                logger.warning(
                    "could not confirm the accusation of peer %s (stage %d): its answers agree with its mates' "
                    "(a false accusation, or it lies only sometimes); it still gets no work",
                    peer_id[-6:], accusation.stage,
                )  # fmt: skip

    async def _next_step_of(self, peer) -> int:
        """The peer's step once it changes next (its step as it is now, not as this view last saw it,
        plus one; within VERIFY_WAIT_S, else its step then): the moment after a download."""
        client = self.clients.get(peer.load.address)
        try:
            now = int((await client.info(CHECK_TIMEOUT_S)).step)
            return int((await client.info(CHECK_TIMEOUT_S, now + 1, VERIFY_WAIT_S)).step)
        except Exception:  # noqa: BLE001 - its step as last seen
            return peer.step

    async def _probe(self, address: str, probe: Probe, step: int | None = None) -> tuple[torch.Tensor, int] | None:
        """The reference answer of the peer at `address` to `probe` (for `step`, if given: the
        request's step, which a peer admits only when it is near its own), and the update count of
        the parameters it was computed at."""
        request = self._check_request(probe.kind, probe.request)
        if step is not None:
            request.step = step
        try:
            response, output = await self.clients.get(address).call(probe.kind, request, probe.tensors, CHECK_TIMEOUT_S)
        except Exception as e:  # noqa: BLE001 - try again later
            logger.info("verifying an accusation: %s did not answer (%s)", address, e)
            return None
        got = answer(probe.kind, response, output)
        return None if got is None else (got, int(response.params_step))
