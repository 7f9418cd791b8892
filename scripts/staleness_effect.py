#!/usr/bin/env python
"""What running ahead costs by itself, in plain single-process training (no swarm), and what the
async look-ahead (`predict_params`) wins back.

Async mode lets trainers start microbatches of update t+1 before update t is applied. Computed at
the current parameters, their gradients are one update stale when applied ("stale"). With look-ahead,
a peer computes them at the parameters update t is expected to give: the optimizer step on the mean
of the gradients it holds for update t so far ("predicted", swarm.optim.predicted_params).

This script trains the unsplit default GPT on the default data with the same optimizer, schedule
(cosine over --steps, as `swarm local` sets it), clipping and global batch as `swarm local`, three
times: every gradient fresh; the first --run-ahead share of each batch stale; the same share at
predicted parameters, estimated as a peer does from the first --known share of the previous batch
(swarm.optim.expected_mean_gradient). It prints the
three validation losses, separating the cost of staleness from anything the swarm adds.

    .venv/bin/python scripts/staleness_effect.py [--steps 150] [--run-ahead 0.5] [--known 0.5] [--json]
"""

from __future__ import annotations

import argparse
import copy
import json
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from swarm.training.config import OptimConfig, RunConfig  # noqa: E402
from swarm.training.data import ShardSampler, load_dataset, val_indices  # noqa: E402
from swarm.training.models import GPT, GPTConfig  # noqa: E402
from swarm.training.optim import apply_update, build_optimizer, expected_mean_gradient, predicted_params  # noqa: E402

MODES = ("fresh", "stale", "predicted")


def summed_grads(net: torch.nn.Module, x: torch.Tensor, y: torch.Tensor) -> list[torch.Tensor]:
    """Gradient of the loss summed over the samples (the swarm's accumulator convention)."""
    net.zero_grad()
    logits = net(x)
    (F.cross_entropy(logits.flatten(0, 1), y.flatten()) * x.shape[0]).backward()
    return [p.grad.clone() for p in net.parameters() if p.requires_grad]


def train(
    run: RunConfig, dataset, steps: int, mode: str, ahead: float, known: float, val_idx: list[int], sync_first: int = 0
) -> float:
    """`steps` updates of `run.global_batch` samples; returns the validation loss."""
    spec = {k: v for k, v in run.model.items() if k != "kind"}
    model = GPT(GPTConfig(**spec))
    shadow = copy.deepcopy(model)  # holds predicted parameters
    optimizer = build_optimizer(model, run.optim)
    sampler = iter(ShardSampler(dataset.num_train, 0, 1, run.data.seed))
    B = run.global_batch
    n_ahead = 0 if mode == "fresh" else round(B * ahead)
    n_known = max(1, round(B * known))
    cuts = sorted({0, min(n_known, B), n_ahead, B})
    chunks = list(zip(cuts, cuts[1:], strict=False))  # row ranges, so the known part is a sum of chunks
    batch = dataset.train([next(sampler) for _ in range(B)])
    carried: dict[tuple[int, int], list[torch.Tensor]] = {}  # run-ahead rows, computed last step
    for step in range(steps):
        (x, y), batch = batch, dataset.train([next(sampler) for _ in range(B)])
        parts = {c: carried.get(c) or summed_grads(model, x[c[0] : c[1]], y[c[0] : c[1]]) for c in chunks}
        carried = {}
        if n_ahead and sync_first <= step + 1 < steps:
            net = model
            if mode == "predicted":
                known_sum = [sum(gs) for gs in zip(*(parts[c] for c in chunks if c[1] <= n_known), strict=True)]
                # the estimate a peer makes (swarm/peer.py: prior of a quarter batch)
                mean = expected_mean_gradient(optimizer, known_sum, n_known, max(1, B // 4))
                with torch.no_grad():
                    values = predicted_params(optimizer, run.optim, step, mean)
                    for p, v in zip([p for p in shadow.parameters() if p.requires_grad], values, strict=True):
                        p.copy_(v)
                net = shadow
            xn, yn = batch
            carried = {c: summed_grads(net, xn[c[0] : c[1]], yn[c[0] : c[1]]) for c in chunks if c[1] <= n_ahead}
        total = [sum(gs) / B for gs in zip(*parts.values(), strict=True)]
        for p, g in zip([p for p in model.parameters() if p.requires_grad], total, strict=True):
            p.grad = g
        apply_update(optimizer, run.optim, step)
    model.eval()
    with torch.no_grad():
        x, y = dataset.val(val_idx)
        return float(F.cross_entropy(model(x).flatten(0, 1), y.flatten()))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=150)
    parser.add_argument("--global-batch", type=int, default=32)
    parser.add_argument("--run-ahead", type=float, default=0.5, help="share of each batch started a step early")
    parser.add_argument("--known", type=float, default=0.5, help="share of a batch's gradient known at that time")
    parser.add_argument("--lr", type=float, default=OptimConfig.lr, help="peak learning rate")
    parser.add_argument("--sync-first", type=int, default=0, help="steps at the start that nothing runs ahead of")
    parser.add_argument("--modes", default=",".join(MODES), help=f"comma-separated subset of {','.join(MODES)}")
    parser.add_argument("--val-samples", type=int, default=256)
    parser.add_argument("--json", action="store_true", help="print one JSON object as the last stdout line")
    args = parser.parse_args()
    modes = args.modes.split(",")
    if not set(modes) <= set(MODES) or not 0 <= args.run_ahead <= 1 or not 0 < args.known <= 1:
        parser.error("bad --modes, --run-ahead (0..1) or --known (0..1]")
    torch.set_num_threads(2)
    optim = OptimConfig(lr=args.lr, total_steps=args.steps)
    run = RunConfig(run_id="staleness", global_batch=args.global_batch, optim=optim)
    dataset = load_dataset(run.data, run.model)
    val_idx = val_indices(dataset, args.val_samples)
    started = time.perf_counter()
    print(
        f"{args.steps} steps of {args.global_batch} samples, single process, default GPT and optimizer; "
        f"{100 * args.run_ahead:.0f}% of each batch run ahead, {100 * args.known:.0f}% of a gradient known:"
    )
    losses: dict[str, float] = {}
    for mode in modes:
        losses[mode] = train(run, dataset, args.steps, mode, args.run_ahead, args.known, val_idx, args.sync_first)
        rel = f" ({100 * (losses[mode] / losses['fresh'] - 1):+.1f}%)" if "fresh" in losses else ""
        print(f"  {mode:<10} val loss {losses[mode]:.4f}{rel}", flush=True)
    out = {
        "steps": args.steps,
        "global_batch": args.global_batch,
        "run_ahead": args.run_ahead,
        "known": args.known,
        "sync_first": args.sync_first,
        "lr": args.lr,
        "val_loss": losses,
        "rel_to_fresh": {m: v / losses["fresh"] - 1 for m, v in losses.items()} if "fresh" in losses else {},
        "wall_s": time.perf_counter() - started,
    }
    if args.json:
        print(json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
