"""State download for joining peers, checkpoints that survive a whole stage's death, export."""

import json
import signal

import pytest
import torch
import torch.nn.functional as F

from swarm.training.models import GPT, GPTConfig
from tests.integration.helpers import (
    TINY_GPT,
    TrainingProgress,
    fetch_state,
    info,
    run_args,
    wait_for,
    write_tokens,
)


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_joining_peer_downloads_state_and_matches_its_mates(make_swarm):
    # hivemind's all-reduce (a stage this small averages directly by default: swarm.peer.direct)
    swarm = make_swarm(
        stages=2, stage_layout=[2, 1], steps=100_000, run_args=run_args(codec="none"),
        peer_args=["--averaging-direct-max", "0"],
    )  # fmt: skip
    swarm.start()
    progress = TrainingProgress()
    swarm.start_trainers(on_line=progress)
    progress.wait_step(6, timeout=120)
    newcomer = swarm.start_peer(0)
    assert newcomer.ready["step"] >= 6, "the newcomer must start from the stage's current step, not 0"
    # training goes on with the newcomer in the stage, until it has stepped together with its mates
    wait_for(lambda: info(newcomer.ready["address"]).averaging_rounds >= 1, 120, "the newcomer to average")
    progress.wait_step(newcomer.ready["step"] + 2, timeout=120)
    for trainer in swarm.trainers:
        trainer.stop()
    assert "downloaded stage 0 state" in newcomer.log_tail(400)
    stage0 = [p for p in swarm.peers if p.ready["stage"] == 0]

    def states_at_one_step():
        # a step still under way (e.g. a partial step over the samples held when the trainers
        # stopped) may land between two downloads: compare states taken at the same step
        states = [fetch_state(p.ready["address"], swarm.run_id, 0) for p in stage0]
        return states if len({s["step"] for s in states}) == 1 else None

    states = wait_for(states_at_one_step, 60, "the stage's peers to hold the same step")
    # equal up to float rounding: hivemind hands each member (average - own input), which each adds
    # back to its own input; a missed or partial update would differ by ~lr, i.e. 1e-3
    for name, ref in states[0]["model"].items():
        for other in states[1:]:
            assert torch.allclose(other["model"][name], ref, rtol=1e-5, atol=1e-7), name


@pytest.mark.slow
@pytest.mark.timeout(400)
def test_whole_stage_killed_then_restored_from_checkpoint(make_swarm, tmp_path):
    ckpt = tmp_path / "ckpt"
    swarm = make_swarm(
        stages=3,
        stage_layout=[1, 2, 1],
        steps=16,
        run_args=run_args(),
        peer_args=["--checkpoint-dir", str(ckpt), "--checkpoint-every", "2"],
    )
    swarm.start()
    progress = TrainingProgress()
    swarm.start_trainers(on_line=progress)
    progress.wait_step(6, timeout=120)
    stage1 = [p for p in swarm.peers if p.ready["stage"] == 1]
    for p in stage1:
        p.send_signal(signal.SIGKILL)
    for p in stage1:
        p.wait(timeout=10)
    saved = sorted(int(f.name[4:12]) for f in (ckpt / "stage1").glob("step*.pt"))
    assert saved and saved[-1] >= 4
    newcomer = swarm.start_peer(1)
    assert newcomer.ready["step"] == saved[-1], "the new peer continues from the newest checkpoint's step"
    assert "restored stage 1 from checkpoint" in newcomer.log_tail(200)
    [summary] = swarm.wait_trainers(timeout=300)
    assert summary["steps"] >= 16
    assert info(newcomer.ready["address"]).step >= 16
    assert summary["peer_failures"] >= 1


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_export_loads_into_unsplit_model_with_the_reported_val_loss(make_swarm, tmp_path):
    tokens = torch.from_numpy(write_tokens(tmp_path / "train.bin"))
    ckpt = tmp_path / "ckpt"
    run = run_args(codec="none", dataset="tokens", data_path=str(tmp_path / "train.bin"))
    swarm = make_swarm(
        stages=3,
        peers_per_stage=1,
        steps=8,
        run_args=run,
        peer_args=["--checkpoint-dir", str(ckpt), "--checkpoint-every", "4"],
        trainer_args=["--val-samples", "32", "--val-every", "0"],
    )
    swarm.start()
    swarm.start_trainers()
    [summary] = swarm.wait_trainers(timeout=240)
    wait_for(lambda: all((ckpt / f"stage{k}" / "step00000008.pt").exists() for k in range(3)), 30, "checkpoints")
    out = tmp_path / "model.pt"
    import subprocess
    import sys

    proc = subprocess.run(
        [sys.executable, "-m", "swarm.cli", "export", "--checkpoint-dir", str(ckpt), "--out", str(out)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr
    meta = json.loads(proc.stdout.strip().splitlines()[-1])
    assert meta["step"] == 8 and meta["num_stages"] == 3
    model = GPT(GPTConfig(**{k: v for k, v in TINY_GPT.items() if k != "kind"}))
    model.load_state_dict(torch.load(out, weights_only=True))  # an ordinary state_dict
    model.eval()
    # the validation samples the trainer used: evenly spread windows of the validation tail
    L = TINY_GPT["seq_len"]
    val = tokens[int(len(tokens) * 0.95) :]
    num_val = (len(val) - 1) // L
    idx = torch.linspace(0, num_val - 1, 32).round().long().tolist()
    rows = torch.stack([val[i * L : i * L + L + 1] for i in idx])
    with torch.no_grad():
        logits = model(rows[:, :-1])
        loss = F.cross_entropy(logits.flatten(0, 1), rows[:, 1:].flatten()).item()
    assert abs(loss - summary["val_loss"]) < 1e-4, (loss, summary["val_loss"])
