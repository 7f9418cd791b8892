"""--sync exact equals single-process training of the unsplit model on the same global batches.

The oracle below is plain torch: the unsplit model, AdamW, the warmup+cosine schedule and per-stage
clipping written out here, fed the samples the trainers logged for each step.
"""

import json
import math

import pytest
import torch
import torch.nn.functional as F

from swarm.training.models import GPT, GPTConfig
from tests.integration.helpers import TINY_GPT, fetch_state, write_tokens

STEPS, B, MB, LR, WARMUP, CLIP, WD = 5, 16, 4, 1e-2, 2, 0.5, 0.01
STAGE_PREFIXES = [("tok_emb", "pos_emb", "blocks.0."), ("blocks.1.",), ("blocks.2.", "ln_f", "head")]


def lr_at(step: int) -> float:
    if step < WARMUP:
        return LR * (step + 1) / WARMUP
    progress = min(1.0, (step - WARMUP) / max(1, STEPS - WARMUP))
    return LR * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress)))


def oracle(tokens: torch.Tensor, batches: dict[int, list[int]]) -> dict[str, torch.Tensor]:
    model = GPT(GPTConfig(**{k: v for k, v in TINY_GPT.items() if k != "kind"}))
    opt = torch.optim.AdamW(model.parameters(), lr=LR, betas=(0.9, 0.95), eps=1e-8, weight_decay=WD)
    L = TINY_GPT["seq_len"]
    groups = [[p for n, p in model.named_parameters() if n.startswith(prefixes)] for prefixes in STAGE_PREFIXES]
    assert sum(len(g) for g in groups) == len(list(model.parameters()))
    for step in range(STEPS):
        idx = batches[step]
        assert len(idx) == B
        rows = torch.stack([tokens[i * L : i * L + L + 1] for i in idx])
        x, y = rows[:, :-1], rows[:, 1:]
        logits = model(x)
        loss = F.cross_entropy(logits.flatten(0, 1), y.flatten(), reduction="none").view(B, L).mean(1).mean()
        opt.zero_grad()
        loss.backward()
        for group in groups:  # each stage clips its own averaged gradient
            torch.nn.utils.clip_grad_norm_(group, CLIP)
        for g in opt.param_groups:
            g["lr"] = lr_at(step)
        opt.step()
    return {k: v.detach() for k, v in model.state_dict().items()}


@pytest.mark.timeout(400)
def test_exact_mode_equals_single_process_training(make_swarm, tmp_path):
    tokens = torch.from_numpy(write_tokens(tmp_path / "train.bin"))
    run = [
        "--model",
        json.dumps(TINY_GPT),
        "--dataset",
        "tokens",
        "--data-path",
        str(tmp_path / "train.bin"),
        "--codec",
        "none",
        "--sync",
        "exact",
        "--global-batch",
        str(B),
        "--microbatch",
        str(MB),
        "--lr",
        str(LR),
        "--warmup-steps",
        str(WARMUP),
        "--total-steps",
        str(STEPS),
        "--clip-norm",
        str(CLIP),
        "--weight-decay",
        str(WD),
    ]
    log = str(tmp_path / "samples-{trainer}.jsonl")
    swarm = make_swarm(stages=3, peers_per_stage=2, trainers=2, steps=STEPS, run_args=run)
    swarm.start()
    swarm.opts.trainer_args = ["--sample-log", log, "--val-samples", "0"]
    swarm.start_trainers()
    summaries = swarm.wait_trainers(timeout=300)
    assert all(s["steps"] == STEPS for s in summaries)
    batches: dict[int, list[int]] = {}
    for j in range(2):
        with open(log.replace("{trainer}", str(j))) as f:
            for line in f:
                rec = json.loads(line)
                batches.setdefault(rec["step"], []).extend(rec["indices"])
    assert sorted(batches) == list(range(STEPS))
    expected = oracle(tokens, batches)
    compared, errors = 0, []
    for peer in swarm.peers:
        state = fetch_state(peer.ready["address"], swarm.run_id, peer.ready["stage"])
        assert state["step"] == STEPS
        for name, value in state["model"].items():
            ref = expected[name]
            rel = ((value - ref).norm() / ref.norm().clamp_min(1e-12)).item()
            worst = ((value - ref).abs().max() / ref.abs().max().clamp_min(1e-12)).item()
            errors.append((rel, worst, peer.name, name))
            compared += 1
    errors.sort(reverse=True)
    print("largest relative errors (norm, max):", errors[:2])
    for rel, worst, peer_name, name in errors:
        assert rel <= 1e-4 and worst <= 1e-4, f"peer {peer_name} {name}: relative error {rel:.3g}, max {worst:.3g}"
    assert compared == 2 * len(expected)
    init = GPT(GPTConfig(**{k: v for k, v in TINY_GPT.items() if k != "kind"})).state_dict()
    moved = sum(not torch.allclose(init[k], expected[k]) for k in expected)
    assert moved >= len(expected) // 2
