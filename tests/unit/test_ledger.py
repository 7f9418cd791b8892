"""The ledger's model and check, the stage-mates' agreement on an update, and the accumulators'
exactly-once rules (duplicates, frozen and applied updates, dropping for replay)."""

import asyncio
from types import SimpleNamespace

import pytest
import torch

from swarm.cluster.ledger import DEFAULT_LEDGER_STEPS
from swarm.core.errors import LateContribution, StepClosed
from swarm.peer.agreement import MAX_LEDGER_STEPS, agree, ledger_chunks
from swarm.peer.executor.accumulators import Accumulators, Holder
from swarm.peer.executor.updates import HeldSnapshot
from swarm.peer.ledger import StageLedger
from swarm.policy.ledger import (
    Assignment,
    Held,
    LedgerEntry,
    check,
    contribution_id,
    merge_parts,
    planned,
    samples_digest,
    step_of,
)
from swarm.training.data import ShardSampler
from swarm.wire.blob import receive_blob
from swarm.wire.protocol import pb


def test_digest_is_order_independent_and_tells_sets_apart():
    assert samples_digest([3, 1, 2]) == samples_digest([1, 2, 3])
    assert samples_digest([1, 2, 3]) != samples_digest([1, 2, 4])
    assert samples_digest([1, 1]) != samples_digest([1])


def test_parts_merge_into_their_contribution():
    merged = merge_parts({"t0/3/8#0": Held(2, 99), "t0/3/8#1": Held(2, 99), "t1/3/0": Held(4, 5)})
    assert merged == {"t0/3/8": Held(4, 99), "t1/3/0": Held(4, 5)}
    assert step_of("t0/3/8#1") == 3 and contribution_id("t2", 7, 16) == "t2/7/16"


def test_entry_round_trips_through_json():
    e = LedgerEntry(1, 4, {"t0/4/0": Held(8, 12345678901234567890)}, [("peerA", 2)], 1.5)
    assert LedgerEntry.from_json(e.to_json()) == e


@pytest.mark.parametrize(
    "line",
    [
        # found by the fuzzer (docs/FUZZING.md): AttributeError, OverflowError and RecursionError
        # escaped from_json, past every reader's except (a state download then half-loaded)
        '{"stage":0,"step":0,"contributions":[]}',
        '{"stage":1e999,"step":0,"contributions":{}}',
        "[" * 100_000,
        "[1, 2]",
        '{"stage":0,"step":0,"contributions":{"c":"12"}}',
        '{"stage":0,"step":0,"contributions":{},"members":{"p":1}}',
    ],
)
def test_malformed_entries_raise_what_the_readers_catch(line):
    with pytest.raises((ValueError, KeyError, TypeError, IndexError)):
        LedgerEntry.from_json(line)
    ledger = StageLedger(0)
    ledger.load_state([line, _entry(0, 3, "t0/3/0").to_json()])
    assert [e.step for e in ledger.entries()] == [3]


def test_get_ledger_caps_a_negative_max_steps():
    # found by the fuzzer: max_steps=-2 sliced steps[:-2], every entry but two instead of at most 4096
    ledger = StageLedger(0)
    for step in range(MAX_LEDGER_STEPS + 10):
        ledger.record(_entry(0, step))
    executor = SimpleNamespace(ledger=ledger, built=SimpleNamespace(stage=0))

    async def lines(max_steps):
        request = pb.LedgerRequest(run_id="r", stage=0, from_step=0, max_steps=max_steps)
        _, data = await receive_blob(ledger_chunks(executor, request), 1 << 28, "ledger")
        return bytes(data).decode().splitlines()

    for max_steps, want in ((-2, DEFAULT_LEDGER_STEPS), (0, DEFAULT_LEDGER_STEPS), (5, 5), (1 << 30, MAX_LEDGER_STEPS)):
        assert len(asyncio.run(lines(max_steps))) == want


def _entry(stage, step, *cids):
    return LedgerEntry(stage, step, {c: Held(4, 0) for c in cids})


def _plan(steps):
    return [Assignment(contribution_id("t0", s, o), s, 4, 0) for s in range(steps) for o in (0, 4)]


def test_check_passes_an_exact_ledger_and_names_lost_duplicated_misplaced():
    good = [_entry(k, s, f"t0/{s}/0", f"t0/{s}/4") for k in range(2) for s in range(3)]
    report = check(good, _plan(3), 2)
    assert report.ok and report.through_step == 3 and report.checked == 6
    bad = [
        _entry(0, 0, "t0/0/0", "t0/0/4"),
        _entry(0, 1, "t0/1/0", "t0/0/4"),  # t0/0/4 twice; t0/1/4 lost
        _entry(1, 0, "t0/0/0"),
        _entry(1, 1, "t0/1/0", "t0/1/4", "t0/0/4"),  # t0/0/4 misplaced into step 1
    ]
    report = check(bad, _plan(2), 2)
    assert not report.ok
    assert report.lost == [(0, 1, "t0/1/4")]
    assert report.duplicated == [(0, 1, "t0/0/4")]
    assert report.misplaced == [(1, 1, "t0/0/4")]


def test_check_flags_peers_that_disagree_and_steps_nobody_recorded():
    entries = [_entry(0, 0, "t0/0/0", "t0/0/4"), _entry(0, 0, "t0/0/0"), _entry(0, 2, "t0/2/0", "t0/2/4")]
    report = check(entries, _plan(3), 1)
    assert report.inconsistent == [(0, 0)] and report.missing_steps == [(0, 1)]


def test_plan_splits_each_share_into_microbatches():
    plan = planned([10, 6], microbatch=4, steps=1)
    assert [(a.cid, a.samples) for a in plan] == [
        ("t0/0/0", 4),
        ("t0/0/4", 4),
        ("t0/0/8", 2),
        ("t1/0/0", 4),
        ("t1/0/4", 2),
    ]


def _snap(frozen=True, epoch=0, **held):
    return HeldSnapshot(5, frozen, epoch, {c.replace("_", "/"): Held(n, 0) for c, n in held.items()}, 5)


def test_agreement_ready_only_with_every_sample_once():
    ready = agree(5, {"a": _snap(t0_5_0=4), "b": _snap(t0_5_4=4)})
    assert ready.ready(8) and ready.samples == 8 and ready.members == [("a", 0), ("b", 0)]
    assert not agree(5, {"a": _snap(t0_5_0=4)}).ready(8)  # a mate's samples missing
    assert not agree(5, {"a": _snap(t0_5_0=4), "b": _snap(False, t0_5_4=4)}).ready(8)  # b still open


def test_a_duplicate_is_kept_by_the_smallest_id_and_dropped_by_the_others():
    a = agree(5, {"a": _snap(t0_5_0=4, t0_5_4=4), "b": _snap(epoch=3, t0_5_4=4, t0_5_8=4)})
    assert not a.ready(12) and a.duplicates == {"t0/5/4": ["a", "b"]}
    assert a.must_drop("a") is None
    assert {c: (h.peer_id, h.epoch) for c, h in a.must_drop("b").items()} == {"t0/5/4": ("a", 0)}


@pytest.fixture
def acc():
    return Accumulators([torch.zeros(3)])


def test_accumulators_take_a_contribution_once(acc):
    acc.add(0, [torch.ones(3)], {"t0/0/0": Held(2, 1)})
    assert acc.holder_of("t0/0/0") == Holder("", 0) and acc.holder_of("t0/0/4") is None
    assert acc.samples_for(0) == 2


def test_frozen_update_refuses_new_requests_until_unfrozen(acc):
    acc.add(0, [torch.ones(3)], {"t0/0/0": Held(2, 1)})
    acc.freeze()
    with pytest.raises(StepClosed):
        acc.target_step(0)
    assert acc.target_step(1) == 1  # the next update takes requests
    acc.unfreeze()
    assert acc.target_step(0) == 0 and acc.samples_for(0) == 2


def test_applied_update_recognizes_repeats_and_refuses_late_ones(acc):
    frozen = acc.freeze()
    acc.mark_applied(0, {"t0/0/0": Held(2, 1), "t1/0/0": Held(2, 1)})  # a mate's contribution too
    acc.on_step_changed(1, drop_stale=False)
    assert acc.holder_of("t1/0/0") is not None  # a replay of the mate's contribution adds nothing
    with pytest.raises(LateContribution):
        acc.target_step(0)
    assert frozen.step == 0


def test_dropping_changes_the_epoch_and_remembers_where_duplicates_are(acc):
    acc.add(0, [torch.ones(3)], {"t0/0/0": Held(2, 1), "t0/0/2": Held(2, 1)})
    acc.freeze()
    dropped = acc.drop_unapplied({"t0/0/0": Holder("a", 4)})
    assert dropped == 4 and acc.epoch == 1 and acc.accumulating_step == 0 and acc.samples_for(0) == 0
    hint = acc.holder_of("t0/0/0")  # a replay is told where it is (a hint that expires)
    assert (hint.peer_id, hint.epoch) == ("a", 4)
    assert acc.holder_of("t0/0/2") is None  # a replay accumulates again


def test_sampler_positions_are_deterministic_across_epochs():
    sampler = ShardSampler(num_items=10, index=1, count=3, seed=0)
    stream = [i for _, i in zip(range(9), iter(sampler), strict=False)]
    assert sampler.take(0, 9) == stream
    assert sampler.take(4, 3) == stream[4:7]  # across the epoch boundary (3 samples per epoch)
