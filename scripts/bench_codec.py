#!/usr/bin/env python
"""Codec benchmark: bytes on the wire per microbatch in both directions, encode + decode throughput,
and (unless --quick or --no-runs) the validation loss of the default local run per codec.

    python scripts/bench_codec.py [--quick] [--no-runs] [--json]

JSON keys: int8_GBps, fp16_GBps, bf16_GBps, int8_bytes_ratio, fp16_bytes_ratio, bytes_per_microbatch,
val_loss_by_codec (+ settings).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from local_runs import swarm_local_json  # noqa: E402  (scripts/, the script's own folder)

from swarm.training.config import DEFAULT_MODEL  # noqa: E402
from swarm.wire.protocol import pb  # noqa: E402
from swarm.wire.tensors import WireTensor  # noqa: E402

CODECS = {"none": pb.CODEC_NONE, "fp16": pb.CODEC_FP16, "bf16": pb.CODEC_BF16, "int8": pb.CODEC_INT8_BLOCK}


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def throughput(x: torch.Tensor, codec_id: int, repeats: int) -> float:
    """GB/s of fp32 data through encode + decode (median of `repeats`)."""
    times = []
    for i in range(repeats + 1):
        start = time.perf_counter()
        WireTensor.encode(x, codec_id, [x.shape[0]]).decode()
        if i:
            times.append(time.perf_counter() - start)
    return x.numel() * 4 / statistics.median(times) / 1e9


def microbatch_bytes(microbatch: int) -> dict:
    """Bytes of one microbatch's stage-to-stage traffic for the default GPT: the activation forward and
    its gradient backward, per codec."""
    d, t = DEFAULT_MODEL["d_model"], DEFAULT_MODEL["seq_len"]
    act = torch.randn(microbatch, t, d)
    grad = torch.randn(microbatch, t, d) * 1e-3
    out = {}
    for name, codec_id in CODECS.items():
        forward = WireTensor.encode(act, codec_id).nbytes
        backward = WireTensor.encode(grad, codec_id).nbytes
        out[name] = {"forward": forward, "backward": backward, "total": forward + backward}
    return out


RUN_ARGS = ["--sync", "exact", "--global-batch", "64", "--microbatch", "16"]


def val_loss_runs(codecs: list[str], steps: int) -> dict:
    """The default local swarm, once per codec; its reported validation loss. In exact mode: the same
    samples reach the same parameters in every run, so the codec is the only difference (async runs
    differ from one another by several percent at this length, whatever the codec)."""
    results = {}
    for name in codecs:
        log(f"swarm local --steps {steps} --codec {name} {' '.join(RUN_ARGS)} ...")
        summary = swarm_local_json(["--steps", str(steps), "--codec", name, *RUN_ARGS], timeout=900)
        results[name] = {k: summary[k] for k in ("val_loss", "loss_last", "samples_per_s", "wall_s")}
    return results


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="small tensors, no training runs (for the test suite)")
    parser.add_argument("--no-runs", action="store_true", help="skip the per-codec training runs")
    parser.add_argument("--steps", type=int, default=30, help="steps of each per-codec training run (default 30)")
    parser.add_argument("--codecs", default="none,int8", help="codecs of the training runs (default none,int8)")
    parser.add_argument("--json", action="store_true", help="print one JSON object as the last stdout line")
    parser.add_argument("--threads", type=int, default=1, help="torch threads (1, as a peer of `swarm local` uses)")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)

    size = (1 << 18) if args.quick else (4 << 20)  # floats: 1 MiB or 16 MiB
    repeats = 3 if args.quick else 15
    x = torch.randn(size // 1024, 1024)
    log(f"encode + decode throughput on {x.numel() * 4 >> 20} MiB fp32 ...")
    speeds = {name: throughput(x, codec_id, repeats) for name, codec_id in CODECS.items()}
    sizes = microbatch_bytes(8)
    ratio = {name: sizes[name]["total"] / sizes["none"]["total"] for name in CODECS}
    runs = {} if args.quick or args.no_runs else val_loss_runs(args.codecs.split(","), args.steps)

    print(f"{'codec':<6}{'encode+decode GB/s':>20}{'bytes/microbatch (fwd+bwd)':>30}{'vs fp32':>10}")
    for name in CODECS:
        print(f"{name:<6}{speeds[name]:>20.2f}{sizes[name]['total']:>30,}{ratio[name]:>10.3f}")
    if runs:
        print(f"\nvalidation loss of `swarm local --steps {args.steps} {' '.join(RUN_ARGS)}` per codec:")
        for name, r in runs.items():
            rel = (r["val_loss"] / runs["none"]["val_loss"] - 1) * 100
            print(f"  {name:<5} val_loss {r['val_loss']:.4f} ({rel:+.2f}% vs none)  {r['samples_per_s']:.1f} samples/s")
    out = {
        "int8_GBps": speeds["int8"],
        "fp16_GBps": speeds["fp16"],
        "bf16_GBps": speeds["bf16"],
        "none_GBps": speeds["none"],
        "int8_bytes_ratio": ratio["int8"],
        "fp16_bytes_ratio": ratio["fp16"],
        "bytes_per_microbatch": sizes,
        "val_loss_by_codec": runs,
        "tensor_mib": x.numel() * 4 >> 20,
        "machine": f"{platform.machine()} {os.cpu_count()} cpus, torch {torch.__version__}",
        "torch_threads": torch.get_num_threads(),
    }
    if args.json:
        print(json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
