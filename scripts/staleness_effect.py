#!/usr/bin/env python
"""What a one-step gradient delay costs by itself, in plain single-process training (no swarm).

Async mode lets trainers run up to --max-staleness steps ahead: a microbatch meant for update t+1
goes forward through parameters that have not yet received update t, so its gradient is one step
stale when applied. This script trains the unsplit default GPT on the default data with the same
optimizer, schedule, clipping and global batch as `swarm local`, once with fresh gradients and once
with every gradient (or a given fraction of each batch) taken at the previous step's parameters,
and prints both validation losses. It separates the cost of staleness itself from anything the swarm
adds.

    .venv/bin/python scripts/staleness_effect.py [--steps 150] [--global-batch 32] [--stale-fraction 1.0] [--json]
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

from swarm.config import RunConfig  # noqa: E402
from swarm.data import ShardSampler, load_dataset, val_indices  # noqa: E402
from swarm.models import GPT, GPTConfig  # noqa: E402
from swarm.optim import apply_update, build_optimizer  # noqa: E402


def batch_loss(model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    logits = model(x)
    return F.cross_entropy(logits.flatten(0, 1), y.flatten())


def train(run: RunConfig, dataset, steps: int, stale_fraction: float, val_idx: list[int]) -> float:
    """Train `steps` updates; `stale_fraction` of each global batch is evaluated at the previous
    step's parameters (as async mode's run-ahead microbatches are). Returns the validation loss."""
    torch.manual_seed(0)
    spec = {k: v for k, v in run.model.items() if k != "kind"}
    model = GPT(GPTConfig(**spec))
    previous = copy.deepcopy(model)  # the parameters before the last update
    optimizer = build_optimizer(model, run.optim)
    sampler = iter(ShardSampler(dataset.num_train, 0, 1, run.data.seed))
    B = run.global_batch
    n_stale = round(B * stale_fraction)
    for step in range(steps):
        x, y = dataset.train([next(sampler) for _ in range(B)])
        grads = [torch.zeros_like(p) for p in model.parameters()]
        for net, rows, weight in ((previous, slice(0, n_stale), n_stale), (model, slice(n_stale, B), B - n_stale)):
            if weight == 0:
                continue
            net.zero_grad()
            (batch_loss(net, x[rows], y[rows]) * weight / B).backward()
            for g, p in zip(grads, net.parameters(), strict=True):
                g.add_(p.grad)
        previous.load_state_dict(model.state_dict())
        for p, g in zip(model.parameters(), grads, strict=True):
            p.grad = g
        apply_update(optimizer, run.optim, step)
    model.eval()
    with torch.no_grad():
        x, y = dataset.val(val_idx)
        return float(batch_loss(model, x, y))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=150)
    parser.add_argument("--global-batch", type=int, default=32)
    parser.add_argument("--stale-fraction", type=float, default=1.0, help="share of each batch one step stale")
    parser.add_argument("--val-samples", type=int, default=256)
    parser.add_argument("--json", action="store_true", help="print one JSON object as the last stdout line")
    args = parser.parse_args()
    torch.set_num_threads(2)
    run = RunConfig(run_id="staleness", global_batch=args.global_batch)
    dataset = load_dataset(run.data, run.model)
    val_idx = val_indices(dataset, args.val_samples)
    started = time.perf_counter()
    fresh = train(run, dataset, args.steps, 0.0, val_idx)
    stale = train(run, dataset, args.steps, args.stale_fraction, val_idx)
    out = {
        "steps": args.steps,
        "global_batch": args.global_batch,
        "stale_fraction": args.stale_fraction,
        "val_loss_fresh": fresh,
        "val_loss_stale": stale,
        "stale_rel": stale / fresh - 1,
        "wall_s": time.perf_counter() - started,
    }
    print(f"{args.steps} steps of {args.global_batch} samples, single process, default GPT and optimizer:")
    print(f"  fresh gradients              val loss {fresh:.4f}")
    share = f"{100 * args.stale_fraction:.0f}% of each batch 1 step stale"
    print(f"  {share:<29}val loss {stale:.4f} ({100 * out['stale_rel']:+.1f}%)")
    if args.json:
        print(json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
