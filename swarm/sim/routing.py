"""Routing in the simulator: which peer of a stage takes a hop, for each policy under test.

`ours` is swarm.policy.wiring.Wiring.choose: the eligible peer with the lowest expected finish time,
(reported queue + in flight + task) / throughput, ties broken at random. Calling it costs a Python
loop over the stage's peers per hop, which made a 10,000-peer run cost 18 CPU-minutes. So each
trainer's view of a stage also keeps its peers' loads in arrays (numpy, one slot per peer, updated
in O(1) whenever a queue or an in-flight count changes) and computes the same expected finish times
for all of them at once, with the same float64 arithmetic: (queue + in flight) + task, divided by
the effective throughput. Ineligible peers (offline, banned, excluded) get +inf. The argmin is
Wiring.choose's pick when no other peer lies within four times Wiring's tie tolerance of it (then
Wiring's sequential scan, in any order, ends with that peer alone); otherwise the router calls
Wiring.choose itself, with the same random generator, on the view's list of peers in the order a
real view lists them. `check` compares every fast pick with Wiring.choose (tests run whole
simulations with it).

`uniform` and `weighted` pick a random eligible peer (Wiring.eligible's rule) by rejection sampling.
"""

from __future__ import annotations

import bisect
import itertools
import math
import random

import numpy as np

from swarm.policy.wiring import PeerLoad, Wiring

RANDOM_PICK_TRIES = 16
UNIQUE_MARGIN = 4.0  # x Wiring's tie tolerance (relative) and 1e-12 (absolute)
INF = math.inf


class SimLoad(PeerLoad):
    """A PeerLoad that is equal only to itself (views are searched by identity, not field by field),
    with its effective throughput cached as `eff` (in the simulator it never changes: no end-to-end
    measurement, a fixed reported throughput) and its place in its trainer's view of its stage."""

    __eq__ = object.__eq__
    __hash__ = object.__hash__


def sim_load(peer_id: str, throughput: float) -> PeerLoad:
    load = SimLoad(peer_id, 0, peer_id, throughput=throughput)
    load.eff = load.effective_throughput
    load.view = None  # the StageView listing it, if any
    load.slot = -1
    return load


class StageView:
    """One trainer's view of one stage: its peers, as a list in the order a real view lists them,
    and as arrays by slot: queue + in flight (+inf for a slot not in use or a peer not online) and
    effective throughput."""

    __slots__ = ("stage", "loads", "q", "eff", "buf", "free", "by_slot", "bans", "cum")

    def __init__(self, stage: int) -> None:
        self.stage = stage
        self.loads: list[PeerLoad] = []
        self.by_slot: list[PeerLoad | None] = []
        self.q = np.zeros(0)
        self.eff = np.ones(0)
        self.buf = np.zeros(0)
        self.free: list[int] = []
        self.bans: dict[int, PeerLoad] = {}  # slots of peers banned at some point, checked at each pick
        self.cum: list[float] | None = None  # cumulative throughputs (weighted policy), None when stale

    def _grow(self) -> None:
        n = len(self.by_slot)
        size = max(8, 2 * n)
        self.q = np.concatenate([self.q, np.full(size - n, INF)])
        self.eff = np.concatenate([self.eff, np.ones(size - n)])
        self.buf = np.zeros(size)
        self.by_slot.extend([None] * (size - n))
        self.free.extend(range(size - 1, n - 1, -1))

    def add(self, load: PeerLoad) -> None:
        if not self.free:
            self._grow()
        slot = self.free.pop()
        self.loads.append(load)
        self.by_slot[slot] = load
        self.q[slot] = load.reported_queue + load.in_flight if load.online else INF
        self.eff[slot] = load.eff
        load.view, load.slot = self, slot
        self.cum = None

    def remove(self, load: PeerLoad) -> None:
        slot = load.slot
        self.loads.remove(load)
        self.by_slot[slot] = None
        self.q[slot] = INF
        self.bans.pop(slot, None)
        self.free.append(slot)
        load.view, load.slot = None, -1
        self.cum = None


def touch(load: PeerLoad) -> None:
    """The load's queue or in-flight work changed: update its slot."""
    view = load.view
    if view is not None and load.online:
        view.q[load.slot] = load.reported_queue + load.in_flight


def set_online(load: PeerLoad, online: bool) -> None:
    load.online = online
    if load.view is not None:
        load.view.q[load.slot] = load.reported_queue + load.in_flight if online else INF


class Router:
    def __init__(self, policy: str, wiring: Wiring, rng: random.Random, views: list[list[StageView]]) -> None:
        self.policy, self.wiring, self.rng, self.views = policy, wiring, rng, views
        self.ours = policy == "ours"
        self.check = False
        self.fallbacks = 0  # picks that went to Wiring.choose (near-ties, nothing eligible)

    def add(self, trainer: int, load: PeerLoad) -> None:
        self.views[trainer][load.stage].add(load)

    def remove(self, load: PeerLoad) -> None:
        """Drop the load from its view (if its trainer had listed it at all)."""
        if load.view is not None:
            load.view.remove(load)

    def banned(self, load: PeerLoad) -> None:
        """Wiring.on_failure banned the load: picks mask it until its ban is over."""
        if load.view is not None:
            load.view.bans[load.slot] = load

    # ---- picks ----

    def pick(self, trainer: int, stage: int, work: float, now: float, exclude: frozenset[str]) -> PeerLoad | None:
        view = self.views[trainer][stage]
        if not self.ours:
            return self._pick_random(view, now, exclude)
        chosen = self._argmin(view, work, now, exclude) if view.loads else None
        if chosen is None:
            self.fallbacks += 1
            return self.wiring.choose(view.loads, work, now, exclude)
        chosen.assigned += 1
        if self.check:
            self._verify(view, work, now, exclude, chosen)
        return chosen

    def _argmin(self, view: StageView, work: float, now: float, exclude: frozenset[str]) -> PeerLoad | None:
        """The eligible peer with the lowest expected finish time if it is Wiring.choose's unique pick,
        else None."""
        buf = view.buf
        np.add(view.q, work, out=buf)
        np.divide(buf, view.eff, out=buf)
        if view.bans:
            for slot, load in list(view.bans.items()):
                if load.banned_until > now:
                    buf[slot] = INF
                else:
                    del view.bans[slot]
        for pid in exclude:
            for load in view.loads:  # a retry: rare, and the view is short of the peers it tried
                if load.peer_id == pid:
                    buf[load.slot] = INF
        slot = int(buf.argmin())
        best = float(buf[slot])
        if best == INF:
            return None
        buf[slot] = INF
        if buf[buf.argmin()] <= best * (1 + UNIQUE_MARGIN * self.wiring.tie_tolerance) + UNIQUE_MARGIN * 1e-12:
            return None  # a near-tie: let Wiring.choose decide
        return view.by_slot[slot]

    def _verify(self, view: StageView, work: float, now: float, exclude: frozenset[str], chosen: PeerLoad) -> None:
        expected = Wiring(random.Random(0), self.wiring.ban, self.wiring.tie_tolerance).choose(
            view.loads, work, now, exclude
        )
        if expected is not chosen:
            raise AssertionError(f"fast routing picked {chosen.peer_id}, Wiring.choose {expected and expected.peer_id}")
        expected.assigned -= 1

    def _pick_random(self, view: StageView, now: float, exclude: frozenset[str]) -> PeerLoad | None:
        """uniform / weighted: a random eligible peer (Wiring.eligible's rule), by rejection sampling
        from the whole view, which is exact and O(log n) instead of O(n) per hop."""
        loads, rng, weighted = view.loads, self.rng, self.policy == "weighted"
        if weighted and view.cum is None:
            view.cum = list(itertools.accumulate(p.throughput for p in loads))
        for _ in range(RANDOM_PICK_TRIES if loads else 0):
            if weighted:
                p = loads[min(len(loads) - 1, bisect.bisect(view.cum, rng.random() * view.cum[-1]))]
            else:
                p = loads[rng.randrange(len(loads))]
            if p.online and p.banned_until <= now and p.peer_id not in exclude:
                return p
        eligible = self.wiring.eligible(loads, now, exclude)  # most of the view is ineligible: do it the slow way
        if not eligible:
            return None
        if not weighted:
            return rng.choice(eligible)
        return rng.choices(eligible, weights=[p.throughput for p in eligible])[0]
