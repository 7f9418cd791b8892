"""A lying peer, on real processes: one of stage 0's three peers adds noise (half its answer's RMS)
to every forward output from update LIE_FROM on (`swarm peer --debug-lie outputs`). Two trainers
spot-check a quarter of the answers (--spot-check 0.25). Peers do not rebalance: a stage of two
peers cannot tell which one lies (docs/SECURITY.md), so the liar stays in stage 0, with two mates.

One swarm: honest until update LIE_FROM, then lying. Stated bounds:
- honest answers never mismatch: no mismatch and no ban before the lie starts (the trainers' progress
  lines at step LIE_FROM), every mismatch of the run has the liar on one side, and every trainer
  found answers equal;
- the first trainer to catch it has sent it at most CALLS_BOUND calls (at a check rate of 0.25 and a
  third of stage 0's calls going to it, missing it that long has odds below 1e-4);
- every trainer bans it (the other one by verifying the accusation), and no honest peer;
- every update of its stage agreed after the accusation was published leaves it out (its mates read
  the accusations when a trainer's Info poll names it), and the ledger shows every sample in every
  stage exactly once;
- the final validation loss is within 2% of honest training on the same samples (exact mode: an
  honest swarm equals single-process training, test_exact_mode.py; computed here in-process).
"""

import asyncio
import threading

import pytest

from swarm.ledger import check_run, collect, read_sample_logs
from tests.integration.helpers import logged_batches, run_args, single_process_val_loss

STEPS = 20
LIE_FROM = 2
CALLS_BOUND = 40
VAL_SAMPLES = 64


class ProgressLines:
    """Each trainer's progress lines (their spot-check figures), by trainer index and step."""

    def __init__(self) -> None:
        self.lines: dict[tuple[int, int], dict] = {}
        self.lock = threading.Lock()

    def __call__(self, proc, line, payload) -> None:
        if payload and payload.get("event") == "progress":
            with self.lock:
                self.lines.setdefault((payload["trainer"], payload["step"]), payload)

    def at(self, trainer: int, step: int) -> dict | None:
        with self.lock:
            return self.lines.get((trainer, step))


@pytest.mark.timeout(600)
def test_a_lying_peer_is_banned_by_every_trainer_and_left_out_of_updates(make_swarm, tmp_path):
    logs = str(tmp_path / "samples-{trainer}.jsonl")
    checks = ["--spot-check", "0.25", "--val-samples", str(VAL_SAMPLES), "--val-every", "0"]
    swarm = make_swarm(
        stages=2, stage_layout=[3, 1], trainers=2, steps=STEPS,
        run_args=run_args(codec="none", sync="exact", seed=0), peer_args=["--no-rebalance"],
        trainer_args=[*checks, "--sample-log", logs],
    )  # fmt: skip
    swarm.start_coordinator()
    procs = [swarm.start_peer(0, wait=False), swarm.start_peer(0, wait=False), swarm.start_peer(1, wait=False)]
    procs.append(
        swarm.start_peer(0, extra=["--debug-lie", "outputs", "--debug-lie-from-step", str(LIE_FROM)], wait=False)
    )
    for p in procs:
        p.wait_ready(swarm.opts.startup_timeout_s)
    liar = procs[-1].ready["peer_id"]
    progress = ProgressLines()
    swarm.start_trainers(on_line=progress)
    summaries = swarm.wait_trainers(timeout=400)
    run, entries = asyncio.run(collect(swarm.run_id, swarm.initial_peers, swarm.run_key))
    report = check_run(run, entries, read_sample_logs([logs.replace("{trainer}", "*")]))

    # honest answers: the progress lines when the global step reached LIE_FROM (every check of the
    # earlier steps' microbatches done, none of step LIE_FROM's started: the liar still honest)
    before = [progress.at(t, LIE_FROM) for t in range(2)]
    assert all(b is not None for b in before), before
    assert all(b["spot_check_mismatches"] == 0 and b["liars_banned"] == 0 for b in before), before
    # ... and over the whole run: every mismatch had the liar on one side; every trainer found equal answers
    for s in summaries:
        assert s["spot_check_mismatches_by_peer"].get(liar, 0) == s["spot_check_mismatches"], s
        assert s["spot_checks"] > s["spot_check_mismatches"], s

    assert report.ok and report.checked > 0, report  # every sample entered every stage exactly once
    bans = [s["liars_banned"].get(liar) for s in summaries]
    assert all(bans), f"not banned by every trainer: {[s['liars_banned'] for s in summaries]}"
    assert all(set(s["liars_banned"]) == {liar} for s in summaries)  # no honest peer banned
    first = min(bans, key=lambda b: b["time"])
    assert first["how"] == "caught" and first["calls_before"] <= CALLS_BOUND, bans
    assert all(b["stage"] == 0 for b in bans)

    # every update of stage 0 agreed after the (first) accusation was out leaves the liar out
    after = [e for e in entries if e.stage == 0 and e.step > first["stage_step"]]
    assert [e for e in entries if e.stage == 0 and liar in {p for p, _ in e.members}], "it was a member before"
    assert after, "the run went on after the ban"
    assert not [e.step for e in after if liar in {p for p, _ in e.members}]
    # ... because its mates were told at once: the accusing trainer's Info polls named the accused, and
    # each honest mate read the accusations then (they read none before updates: swarm.cluster.accusations)
    swarm.stop()
    mates = [p.counters for p in procs[:2]]
    assert all(c is not None and c["accusation_reads"] >= 1 for c in mates), mates

    honest = single_process_val_loss(run, logged_batches(logs.replace("{trainer}", "*")), VAL_SAMPLES)
    lying = summaries[0]["val_loss"]
    checks = [(s["spot_checks"], s["spot_check_mismatches"]) for s in summaries]
    print(f"bans {bans}; checks (all, mismatched) {checks}; val honest {honest:.4f} lying {lying:.4f}")
    assert abs(lying - honest) <= 0.02 * honest, (honest, lying)
