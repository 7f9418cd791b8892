"""A lying peer, on real processes: one of stage 0's three peers adds noise (half its answer's RMS)
to every forward output from update LIE_FROM on (`swarm peer --debug-lie outputs`). Two trainers
spot-check a quarter of the answers (--spot-check 0.25).

Stated bounds: the first trainer to catch it has sent it at most CALLS_BOUND calls (at a check rate
of 0.25 and a third of stage 0's calls going to it, missing it that long has odds below 1e-4);
every trainer bans it (the other one by verifying the accusation); every update of its stage
agreed after the accusation was published leaves it out; the final validation loss is within 2%
of an honest run of the same swarm, seeds and samples (exact mode: both runs see the same batches).
"""

import asyncio

import pytest

from swarm.ledger import check_run, collect
from tests.integration.helpers import run_args

STEPS = 14
LIE_FROM = 2
CALLS_BOUND = 40


def options(**extra):
    return dict(
        stages=2, stage_layout=[3, 1], trainers=2, steps=STEPS,
        run_args=run_args(codec="none", sync="exact", seed=0), peer_args=["--no-rebalance"],
        trainer_args=["--spot-check", "0.25", "--val-samples", "64", "--val-every", "0"], **extra,
    )  # fmt: skip


def train(make_swarm, liar: bool):
    swarm = make_swarm(**options())
    swarm.start_coordinator()
    procs = [swarm.start_peer(0, wait=False), swarm.start_peer(0, wait=False), swarm.start_peer(1, wait=False)]
    lie = ["--debug-lie", "outputs", "--debug-lie-from-step", str(LIE_FROM)] if liar else []
    procs.append(swarm.start_peer(0, extra=lie, wait=False))
    for p in procs:
        p.wait_ready(swarm.opts.startup_timeout_s)
    liar_id = procs[-1].ready["peer_id"] if liar else None
    swarm.start_trainers()
    summaries = swarm.wait_trainers(timeout=900)
    run, entries = asyncio.run(collect(swarm.run_id, swarm.initial_peers, swarm.run_key))
    return summaries, check_run(run, entries), entries, liar_id


@pytest.mark.timeout(1500)
def test_a_lying_peer_is_banned_by_every_trainer_and_left_out_of_updates(make_swarm):
    honest, _, _, _ = train(make_swarm, liar=False)
    assert all(s["liars_banned"] == {} and s["spot_check_mismatches"] == 0 for s in honest), honest
    assert all(s["spot_checks"] > 0 for s in honest)  # the checks ran and found honest answers equal

    lying, report, entries, liar = train(make_swarm, liar=True)
    assert report.ok, report  # every sample entered every stage exactly once, liar or not
    bans = [s["liars_banned"].get(liar) for s in lying]
    assert all(bans), f"not banned by every trainer: {[s['liars_banned'] for s in lying]}"
    assert all(set(s["liars_banned"]) == {liar} for s in lying)  # no honest peer banned
    first = min(bans, key=lambda b: b["time"])
    assert first["how"] == "caught" and first["calls_before"] <= CALLS_BOUND, bans
    assert all(b["stage"] == 0 for b in bans)

    # every update of stage 0 agreed after the (first) accusation was out leaves the liar out
    after = [e for e in entries if e.stage == 0 and e.step > first["stage_step"]]
    assert [e for e in entries if e.stage == 0 and liar in {p for p, _ in e.members}], "it was a member before"

    assert after, "the run went on after the ban"
    assert not [e.step for e in after if liar in {p for p, _ in e.members}]

    val_honest, val_lying = honest[0]["val_loss"], lying[0]["val_loss"]
    print(f"bans {bans}; checks {[s['spot_checks'] for s in lying]}; val honest {val_honest:.4f} lying {val_lying:.4f}")
    assert abs(val_lying - val_honest) <= 0.02 * val_honest, (val_honest, val_lying)
