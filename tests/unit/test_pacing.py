"""The staleness bound: how many samples of later steps a trainer starts while a step is pending."""

import pytest

from swarm.policy.pacing import StepPacer


def _drain(pacer: StepPacer, global_step: int, microbatch: int = 8, target: int = 100) -> list[tuple[int, int]]:
    taken = []
    while (t := pacer.take(global_step, microbatch, target)) is not None:
        taken.append((t[0], t[2]))
    return taken


def test_exact_mode_starts_nothing_ahead():
    pacer = StepPacer(share=32, staleness=0)
    assert _drain(pacer, 0) == [(0, 8)] * 4
    assert _drain(pacer, 0) == []  # step 0 not applied yet
    assert _drain(pacer, 1) == [(1, 8)] * 4


@pytest.mark.parametrize(("staleness", "ahead"), [(1, 4), (0.5, 2), (0.25, 1), (0.2, 0), (2, 8)])
def test_fractional_bound_counts_samples_of_later_steps(staleness, ahead):
    pacer = StepPacer(share=32, staleness=staleness)
    taken = _drain(pacer, 0)
    assert taken[:4] == [(0, 8)] * 4
    assert len(taken) - 4 == ahead  # microbatches of steps 1.. started while step 0 is pending
    assert pacer.started_ahead(0) == 8 * ahead
    # once step 0 is applied, the window slides by one step
    more = _drain(pacer, 1)
    assert pacer.started_ahead(1) == 8 * ahead
    assert all(tag >= 1 for tag, _ in more)


def test_uneven_share_and_target():
    pacer = StepPacer(share=12, staleness=0.5)  # microbatches of 8 then 4
    assert _drain(pacer, 0, target=2) == [(0, 8), (0, 4)]  # 8 more samples of step 1 would exceed 6
    assert _drain(pacer, 1, target=2) == [(1, 8), (1, 4)]
    assert _drain(pacer, 2, target=2) == []  # every step before the target is fed


def test_restarts_at_the_global_step_when_the_swarm_moved_on_or_back():
    pacer = StepPacer(share=16, staleness=1)
    _drain(pacer, 0)
    assert pacer.take(5, 8, 100) == (5, 0, 8)  # steps 2-4 went by without this trainer
    assert pacer.take(2, 8, 100) == (2, 0, 8)  # a stage restored an older checkpoint: 5 > 2 + 1 + 1


def test_run_ahead_waits_until_half_of_the_pending_step_is_done():
    pacer = StepPacer(share=32, staleness=1, ahead_after=0.5)
    assert _drain(pacer, 0) == [(0, 8)] * 4  # step 0 itself is never held back
    pacer.done(0, 8)
    assert _drain(pacer, 0) == []  # a quarter of step 0 done: the look-ahead would guess from too little
    pacer.done(0, 8)
    assert _drain(pacer, 0) == [(1, 8)] * 4  # half done: all of step 1 may start
    assert _drain(pacer, 1) == []  # step 1 pending, none of it done
    pacer.done(1, 16)
    assert _drain(pacer, 1) == [(2, 8)] * 4


def test_bad_pacing_is_refused():
    with pytest.raises(ValueError):
        StepPacer(share=32, staleness=1, ahead_after=1.5)
    with pytest.raises(ValueError):
        StepPacer(share=0, staleness=1)


def test_offsets_name_each_microbatch_of_a_step():
    """(tag, offset) names a microbatch: its contribution id and its samples follow from them."""
    pacer = StepPacer(share=20, staleness=0)
    assert [pacer.take(0, 8, 100) for _ in range(3)] == [(0, 0, 8), (0, 8, 8), (0, 16, 4)]
