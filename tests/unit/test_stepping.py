"""Catching up with a mate's update: a peer's held gradients are in it (nothing to do) or are
dropped for the trainers to replay (its accumulator epoch changes); never carried into a later
update, never counted twice."""

import pytest
import torch

from swarm.peer.executor import StageExecutor
from swarm.policy.ledger import Held
from swarm.training.config import OptimConfig
from swarm.training.models import build_stage
from swarm.training.state import deserialize, serialize

GPT = {"kind": "gpt", "vocab_size": 64, "seq_len": 8, "d_model": 16, "n_layers": 2, "n_heads": 2, "d_ff": 32}


@pytest.fixture
def mates():
    torch.manual_seed(0)
    a = StageExecutor(build_stage(GPT, 1, 2), OptimConfig())
    b = StageExecutor(build_stage(GPT, 1, 2), OptimConfig())
    b.module.load_state_dict(a.module.state_dict())
    yield a, b
    a.stop()
    b.stop()


def _accumulate(ex: StageExecutor, n: int, cid: str, tag: int = 0) -> None:
    h, y = torch.randn(n, 8, 16), torch.randint(0, 64, (n, 8))
    ex.backward(h, None, y, cid, tag, digest=7).result(timeout=30)


def _download(behind: StageExecutor, ahead: StageExecutor) -> int:
    state = deserialize(serialize(ahead.call(ahead.state_dict).result(timeout=30)))
    return behind.call(lambda: behind.load_state_dict(state)).result(timeout=30)


@pytest.mark.parametrize("b_in_mates_update", [True, False])
def test_catch_up_counts_own_gradient_once(mates, b_in_mates_update):
    a, b = mates
    _accumulate(a, 4, "t0/0/0")
    _accumulate(b, 4, "t0/0/4")
    _accumulate(b, 4, "t0/1/0", tag=1)  # run ahead: for the next update
    frozen_a = a.call(a.take_accumulated).result(timeout=30)
    b.call(b.take_accumulated).result(timeout=30)  # b froze update 0 too, then missed the round
    union = {"t0/0/0": Held(4, 7)}
    if b_in_mates_update:
        union["t0/0/4"] = Held(4, 7)  # the mates' round completed with b's gradient
    mean = [g / 4 for g in frozen_a.grads]
    a.call(lambda: a.apply_mean_gradient(mean, 0, [("a", 0), ("b", 0)], union)).result(timeout=30)

    epoch = b.acc.epoch
    dropped = _download(b, a)

    assert b.step == 1 and all(torch.equal(p, q) for p, q in zip(a.params, b.params, strict=True))
    assert b.ledger.get(0).contributions.keys() == union.keys()  # the ledger came with the state
    if b_in_mates_update:
        # its gradient is in the update: kept out of the next one, and its run-ahead gradient stays
        assert dropped == 0 and b.acc.epoch == epoch and b.samples_accumulated == 4
        assert b.counters.contributions_included == 1
    else:
        # not in it: everything unapplied is dropped and the trainers replay it (the epoch says so)
        assert dropped == 8 and b.acc.epoch == epoch + 1 and b.samples_accumulated == 0
        assert b.acc.holder_of("t0/0/4") is None  # a replay of it accumulates again
    assert b.acc.holder_of("t0/0/0") is not None  # applied: a repeat adds nothing


class _Mates:
    """The peer's side the step coordinator talks to (swarm.peer.membership): no live mates; the
    events it reports are kept."""

    def __init__(self, peer_id: str) -> None:
        self.peer_id, self.stage, self.events = peer_id, 1, []
        self.view_reads_wanted = 0

    def live_mates(self):
        return []

    async def sync_from_mates(self, preferred=None) -> bool:
        return False

    async def refresh_view(self) -> None:
        return None

    def is_accused(self) -> bool:
        return False

    async def refresh_accusations(self) -> None:
        return None

    def want_view_read(self) -> None:
        self.view_reads_wanted += 1

    def event(self, kind: str, **fields) -> None:
        self.events.append((kind, fields))

    def start_averager(self):
        self.events.append(("averager_restarted", {}))
        return "a new averager"


def _coordinator(ex: StageExecutor, peer_id: str, averager=None):
    from swarm.peer.stepping import StepCoordinator

    return StepCoordinator(ex, averager, _Mates(peer_id), None, "run", 12)


def test_a_duplicate_is_dropped_by_the_larger_id_and_reported(mates):
    import asyncio

    from swarm.peer.agreement import agree

    a, b = mates
    _accumulate(a, 4, "t0/0/0")
    _accumulate(a, 4, "t0/0/4")
    _accumulate(b, 4, "t0/0/4")  # retried on b after a's deadline, while a still accumulated it
    _accumulate(b, 4, "t0/0/8")
    for ex in (a, b):
        ex.call(ex.take_accumulated).result(timeout=30)
    lists = {"a": a.call(lambda: a.contributions(0)).result(), "b": b.call(lambda: b.contributions(0)).result()}
    agreement = agree(0, lists)
    coord_a, coord_b = _coordinator(a, "a"), _coordinator(b, "b")
    assert not asyncio.run(coord_a._settle(agreement)) and not asyncio.run(coord_b._settle(agreement))
    assert a.samples_accumulated == 8 and a.acc.frozen is None and a.acc.epoch == 0  # a keeps both, unfrozen
    assert b.samples_accumulated == 0 and b.acc.epoch == 1  # b dropped everything: the trainers replay
    assert b.acc.holder_of("t0/0/4").peer_id == "a"  # a replay of the duplicate is told where it is
    assert b.acc.holder_of("t0/0/8") is None  # the other one is accumulated again when replayed
    assert coord_b.mates.events == [("duplicate_dropped", {"step": 0, "duplicates": 1, "samples": 8})]
    assert coord_a.mates.events == []


def test_a_failed_all_reduce_applies_nothing_and_is_reported(mates):
    import asyncio

    from swarm.peer.agreement import agree
    from swarm.training.averaging import AveragingFailed

    class Failing:
        alive = True

        def average(self, *args):
            raise AveragingFailed("averaging for step 0 was incomplete (a member did not take part)")

    a, _ = mates
    _accumulate(a, 4, "t0/0/0")
    frozen = a.call(a.take_accumulated).result(timeout=30)
    lists = {"a": a.call(lambda: a.contributions(0)).result(), "m": a.call(lambda: a.contributions(0)).result()}
    agreement = agree(0, {"a": lists["a"], "m": type(lists["m"])(0, True, 0, {}, 0)})
    coord = _coordinator(a, "a", Failing())
    assert asyncio.run(coord._average(frozen, agreement)) is None
    assert a.step == 0 and coord.failed_rounds == 1  # never its own gradient alone: the stage tries again
    assert coord.mates.events == [("averaging_failed", {"step": 0, "members": 2})]


def test_a_dead_averager_process_is_replaced(mates):
    import asyncio

    from swarm.peer.agreement import agree
    from swarm.training.averaging import AveragingFailed

    class Dead:
        alive = False

        def average(self, *args):
            raise AveragingFailed("averaging for step 0: this peer's averager process is not running")

    a, _ = mates
    _accumulate(a, 4, "t0/0/0")
    frozen = a.call(a.take_accumulated).result(timeout=30)
    own = a.call(lambda: a.contributions(0)).result()
    agreement = agree(0, {"a": own, "m": type(own)(0, True, 0, {}, 0)})
    coord = _coordinator(a, "a", Dead())
    assert asyncio.run(coord._average(frozen, agreement)) is None
    assert coord.averager == "a new averager"  # the next round runs with a new process
    assert [k for k, _ in coord.mates.events] == ["averaging_failed", "averager_restarted"]


def test_the_averager_process_starts_on_the_first_round_too_large_for_direct_averaging(mates):
    """Stages of at most --averaging-direct-max peers never fork a hivemind averager; the first round
    with more members starts one (here direct_max is 0: every round of 2 or more)."""
    import asyncio

    from swarm.peer.agreement import agree
    from swarm.training.averaging import AveragedGradient

    class Working:
        alive = True

        def average(self, grads, samples, step, mates):
            return AveragedGradient([g / samples for g in grads], ("a", *mates), 0.01)

    class StartingMates(_Mates):
        def start_averager(self):
            self.events.append(("averager_started", {}))
            return Working()

    from swarm.peer.stepping import StepCoordinator

    a, _ = mates
    _accumulate(a, 4, "t0/0/0")
    frozen = a.call(a.take_accumulated).result(timeout=30)
    own = a.call(lambda: a.contributions(0)).result()
    agreement = agree(0, {"a": own, "m": type(own)(0, True, 0, {}, 0)})
    coord = StepCoordinator(a, None, StartingMates("a"), None, "run", 12)
    mean = asyncio.run(coord._average(frozen, agreement))
    assert mean is not None and isinstance(coord.averager, Working)
    assert coord.mates.events == [("averager_started", {})]
    asyncio.run(coord._average(frozen, agreement))  # the next round reuses it
    assert coord.mates.events == [("averager_started", {})]


def test_the_update_timeline_counts_waiting_for_mates_apart_from_agreeing():
    from swarm.peer.timeline import UpdateTimeline

    tl = UpdateTimeline()
    tl.record(start=0.0, frozen=0.01, agreed=0.10, averaged=0.15, applied=0.16, waited=0.07)
    tl.record(start=1.0, frozen=1.01, agreed=1.03, averaged=1.08, applied=1.10)
    d = tl.as_dict()
    assert d["updates"] == 2 and d["intervals"] == 1 and abs(d["interval_s"] - 0.94) < 1e-9
    assert abs(d["wait_mates_s"] - 0.07) < 1e-9 and abs(d["agree_s"] - 0.04) < 1e-9
    assert abs(d["allreduce_s"] - 0.10) < 1e-9


def test_a_straggler_mate_counts_as_waiting_not_as_averaging():
    from swarm.peer.timeline import UpdateTimeline

    tl = UpdateTimeline()
    tl.record(start=0.0, frozen=0.01, agreed=0.05, averaged=0.15, applied=0.16, waited=0.02, straggler=0.06)
    d = tl.as_dict()
    assert abs(d["wait_mates_s"] - 0.08) < 1e-9 and abs(d["agree_s"] - 0.02) < 1e-9
    assert abs(d["allreduce_s"] - 0.04) < 1e-9


def test_a_directly_averaged_sum_stays_fetchable_until_it_is_applied(mates, monkeypatch):
    """A mate that fetches this peer's frozen sum after this peer finished averaging but before its
    apply must still get it (a race seen under load: the round then failed on the mate's side)."""
    import asyncio

    import swarm.peer.stepping as stepping
    from swarm.peer.agreement import agree
    from swarm.training.averaging import AveragedGradient

    a, _ = mates
    _accumulate(a, 4, "t0/0/0")
    seen_at_apply = []

    async def averaged(own, own_id, agreement, *args, **kwargs):
        return AveragedGradient([g / agreement.samples for g in own.grads], ("a", "m"), 0.01)

    apply = a.apply_mean_gradient

    def apply_and_look(*args):
        seen_at_apply.append(a.frozen_gradient(0))  # what a mate's fetch gets in the meantime
        return apply(*args)

    monkeypatch.setattr(stepping, "average_direct", averaged)
    monkeypatch.setattr(a, "apply_mean_gradient", apply_and_look)

    coord = stepping.StepCoordinator(a, None, _Mates("a"), None, "run", 4, direct_max=4)

    async def agreed(frozen):
        own = a.contributions(0)
        return agree(0, {"a": own, "m": type(own)(0, True, 0, {}, 0)})

    monkeypatch.setattr(coord, "_agree", agreed)
    asyncio.run(coord.run_update(stepping.UpdateReason.FULL))
    assert a.step == 1
    assert seen_at_apply[0] is not None and seen_at_apply[0][0].samples == 4
    assert a.averaging_step is None  # reset after the apply
    assert a.frozen_gradient(0)[0].samples == 4  # and fetchable after it, as the update just applied


def test_a_round_short_of_the_batch_fails_at_once_instead_of_waiting_for_mates_to_freeze(mates, monkeypatch):
    """A mate that dropped what it held is not frozen and holds nothing: waiting for it to freeze
    cannot make the round ready. With the batch all held, an unfrozen mate is still waited for."""
    import asyncio
    from types import SimpleNamespace

    import swarm.peer.stepping as stepping
    from swarm.peer.executor.updates import HeldSnapshot
    from swarm.policy.ledger import Held

    monkeypatch.setattr(stepping, "AGREE_WAIT_S", 0.3)
    a, _ = mates
    _accumulate(a, 4, "t0/0/0")
    frozen = a.call(a.take_accumulated).result(timeout=30)
    coord = stepping.StepCoordinator(a, None, _Mates("a"), None, "run", 8)
    calls = []

    def mate_holding(held: dict):
        async def lists(step):
            calls.append(step)
            return [SimpleNamespace(peer_id="m")], [HeldSnapshot(0, False, 0, held, 0, 0.0, frozenset())]

        return lists

    monkeypatch.setattr(coord, "_mates_lists", mate_holding({}))  # 4 of 8 samples in the whole stage
    agreement = asyncio.run(coord._agree(frozen))
    assert agreement.samples == 4 and agreement.not_frozen == ["m"] and len(calls) == 1

    calls.clear()
    monkeypatch.setattr(coord, "_mates_lists", mate_holding({"t0/0/4": Held(4, 7)}))  # the batch is held
    agreement = asyncio.run(coord._agree(frozen))
    assert agreement.samples == 8 and agreement.not_frozen == ["m"] and len(calls) > 1  # waited for m


def test_a_peer_behind_whose_state_download_failed_waits_before_asking_again(mates, monkeypatch):
    """A mate ahead that refuses the download (it serves a host's state at most once a second)
    made the step loop ask again every 50 ms, each with a warning; now the next try waits
    BEHIND_RETRY_S, then the peer asks again."""
    import asyncio

    from swarm.peer import stepping
    from swarm.peer.stepping import UpdateReason

    a, _ = mates
    coord = _coordinator(a, "a")
    ahead = type("Mate", (), {"step": 3, "samples_accumulated": 0})()
    calls = []

    async def refused(preferred=None) -> bool:
        calls.append(preferred)
        return False

    coord.mates.live_mates = lambda: [ahead]
    coord.mates.sync_from_mates = refused
    clock = [100.0]
    monkeypatch.setattr(stepping.time, "monotonic", lambda: clock[0])
    assert coord.decide() == UpdateReason.BEHIND
    asyncio.run(coord.run_update(UpdateReason.BEHIND))
    assert len(calls) == 1
    clock[0] += stepping.BEHIND_RETRY_S / 2
    assert coord.decide() is None  # not again yet
    clock[0] += stepping.BEHIND_RETRY_S / 2
    assert coord.decide() == UpdateReason.BEHIND


def test_a_stage_short_of_its_batch_asks_for_a_dht_read_after_a_second(mates, monkeypatch):
    """A mate that joined may hold the rest of the batch while this peer's view has not discovered it
    (views read the DHT less often while it changes nothing): a stall asks for a read."""
    from swarm.peer import stepping

    clock = [100.0]
    monkeypatch.setattr(stepping.time, "monotonic", lambda: clock[0])
    coord = _coordinator(mates[0], "a")
    coord._watch_stall(0, 8)  # 8 of 12 samples: new count, no read yet
    clock[0] += stepping.STALL_READ_S / 2
    coord._watch_stall(0, 8)
    assert coord.mates.view_reads_wanted == 0  # not stalled long enough
    clock[0] += stepping.STALL_READ_S
    coord._watch_stall(0, 8)
    assert coord.mates.view_reads_wanted == 1
    clock[0] += stepping.STALL_READ_S
    coord._watch_stall(0, 8)
    assert coord.mates.view_reads_wanted == 1  # once per stall: the periodic reads go on
    coord._watch_stall(0, 12)  # the rest came: no read asked for the new count
    assert coord.mates.view_reads_wanted == 1
    coord._watch_stall(1, 0)
    clock[0] += 10 * stepping.STALL_READ_S
    coord._watch_stall(1, 0)  # nothing held at all: nothing a new mate could complete
    assert coord.mates.view_reads_wanted == 1
