#!/usr/bin/env python
"""Swarm against torch.distributed.pipelining: the same GPT, split the same way, the same processes.

Why: SWARM pays for fault tolerance (gRPC, a DHT, per-call routing, re-computed forwards, step
agreement between peers); this script measures what that costs in throughput against PyTorch's own
pipeline schedules (ScheduleGPipe and Schedule1F1B over gloo) on the same cores, and what a second
peer per stage buys back.

Both sides: S stage processes with `--threads` torch threads each, stage k built by
swarm.training.models.build_stage(spec, k, S), global batch B in microbatches of size b, the swarm's
AdamW (swarm.training.optim.build_optimizer) with per-stage gradient clipping, fp32 activations and
gradients (swarm codec "none"). Samples/s are measured over a timed window after warm-up steps: on
the torch side between barriers, on the swarm side from the times at which the trainer reported each
new global step (`steps * B / seconds`); the trainer's own summary figure (which includes its first
steps) is reported beside it.

    .venv/bin/python scripts/bench_pipeline.py            # default GPT, 3 stages (about 4 minutes on 2 cores)
    .venv/bin/python scripts/bench_pipeline.py --quick --json
    .venv/bin/python scripts/bench_pipeline.py --rounds 3 --json   # medians of 3 side-by-side rounds

This machine's speed drifts by 10-30% within an hour, so one torch window and one swarm window
minutes apart give a ratio that moves by about 0.1 between runs. `--rounds N` repeats torch and
the swarm's one-peer-per-stage runs N times, alternating which side goes first (ABBA), and reports
the median of the rounds' ratios beside every round's figures.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import platform
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from datetime import timedelta
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from torch import nn  # noqa: E402

TINY_GPT = {"kind": "gpt", "vocab_size": 256, "seq_len": 32, "d_model": 32, "n_layers": 3, "n_heads": 2, "d_ff": 64}
SCHEDULES = ("gpipe", "1f1b")


@dataclass
class BenchConfig:
    model: dict
    stages: int
    global_batch: int
    microbatch: int
    threads: int
    device: str
    torch_warmup: int
    torch_steps: int
    swarm_warmup: int
    swarm_steps: int
    sync_modes: list[str]
    lr: float = 3e-3
    clip_norm: float = 1.0
    seed: int = 0
    log_dir: str | None = None
    quick: bool = False
    stall_s: float = 120.0
    rounds: int = 1

    @property
    def microbatches(self) -> int:
        return self.global_batch // self.microbatch


@dataclass
class Result:
    """One row of the table."""

    name: str
    samples_per_s: float
    step_s: float
    steps: int
    note: str = ""
    extra: dict = field(default_factory=dict)


def log(msg: str) -> None:
    print(f"[bench_pipeline {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


# ---------------------------------------------------------------------------------------------------
# torch.distributed.pipelining side
# ---------------------------------------------------------------------------------------------------


class TorchStage(nn.Module):
    """A swarm stage for torch's pipeline: computes on `device`, exchanges CPU tensors.

    gloo sends CPU tensors only, so on CUDA the stage moves its input in and its output out (as a
    swarm peer does around gRPC). The last stage returns logits: torch's schedule calls loss_fn itself.
    """

    def __init__(self, inner: nn.Module, device: torch.device, is_last: bool) -> None:
        super().__init__()
        self.inner, self.device, self.is_last = inner, device, is_last

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.inner(x.to(self.device))  # the last swarm stage without targets returns logits
        return out if self.is_last else out.to("cpu")


def lm_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Mean token cross-entropy: with equal-length samples, the mean over samples of swarm's per-sample loss."""
    return F.cross_entropy(logits.flatten(0, 1).float(), targets.to(logits.device).flatten())


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _torch_worker(rank: int, cfg: BenchConfig, schedules: list[str], port: int, out_path: str) -> None:
    """One pipeline rank. For each schedule: a fresh stage (same seeded initialization), warm-up steps,
    then a timed window between barriers. One process start serves every schedule (starts are slow)."""
    import torch.distributed as dist

    torch.set_num_threads(cfg.threads)
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=cfg.stages, timeout=timedelta(seconds=300)
    )
    try:
        for name in schedules:
            result = _torch_measure(rank, cfg, name)
            Path(f"{out_path}.{name}.{rank}").write_text(json.dumps(result))
    finally:
        dist.destroy_process_group()


def _torch_measure(rank: int, cfg: BenchConfig, schedule_name: str) -> dict:
    import torch.distributed as dist
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe

    from swarm.training.config import OptimConfig
    from swarm.training.models import build_stage
    from swarm.training.optim import build_optimizer

    S, B, b = cfg.stages, cfg.global_batch, cfg.microbatch
    device = torch.device(cfg.device)
    built = build_stage(cfg.model, rank, S)
    module = TorchStage(built.module.to(device), device, built.schema.is_last)
    T, d, V = cfg.model["seq_len"], cfg.model["d_model"], cfg.model["vocab_size"]
    meta = torch.device("meta")
    # static shapes (no inference round); requires_grad marks what gets a gradient sent back
    example_in = (
        torch.empty(b, T, dtype=torch.int64, device=meta)
        if rank == 0
        else torch.empty(b, T, d, dtype=torch.float32, device=meta, requires_grad=True)
    )
    out_dim = V if built.schema.is_last else d
    example_out = torch.empty(b, T, out_dim, dtype=torch.float32, device=meta, requires_grad=True)
    stage = PipelineStage(module, rank, S, torch.device("cpu"), input_args=example_in, output_args=example_out)
    cls = ScheduleGPipe if schedule_name == "gpipe" else Schedule1F1B
    schedule = cls(stage, n_microbatches=cfg.microbatches, loss_fn=lm_loss)  # scale_grads: mean over B
    params = [p for p in module.parameters() if p.requires_grad]
    # the swarm's own optimizer (fused AdamW where torch has the kernel), with the same settings
    optimizer = build_optimizer(module, OptimConfig(lr=cfg.lr, beta1=0.9, beta2=0.95, eps=1e-8, weight_decay=0.0))
    gen = torch.Generator().manual_seed(cfg.seed)
    tokens = torch.randint(0, V, (B, T + 1), generator=gen)  # every rank draws the same batch
    x, y = tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()
    losses_seen: list[float] = []

    def train_step() -> None:
        optimizer.zero_grad(set_to_none=True)
        losses: list[torch.Tensor] = []
        if rank == 0:
            schedule.step(x)
        elif rank == S - 1:
            schedule.step(target=y, losses=losses)
        else:
            schedule.step()
        torch.nn.utils.clip_grad_norm_(params, cfg.clip_norm)  # per stage, as a swarm peer clips
        optimizer.step()
        if losses:
            losses_seen.append(float(torch.stack([v.detach().float().cpu() for v in losses]).mean()))

    for _ in range(cfg.torch_warmup):
        train_step()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    dist.barrier()
    t0, cpu0 = time.perf_counter(), time.process_time()
    for _ in range(cfg.torch_steps):
        train_step()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    dist.barrier()
    result = {"elapsed_s": time.perf_counter() - t0, "cpu_s": time.process_time() - cpu0}
    if rank == S - 1:
        result.update(loss_first=losses_seen[0], loss_last=losses_seen[-1])
    return result


def run_torch(cfg: BenchConfig, schedules: list[str]) -> list[Result]:
    """S spawned processes, one stage each, gloo on loopback; every child is ended on the way out."""
    import torch.multiprocessing as mp

    log(
        f"torch {', '.join(schedules)}: {cfg.stages} processes, {cfg.torch_warmup} warm-up + "
        f"{cfg.torch_steps} timed steps each"
    )
    threads = str(cfg.threads)
    env = {"OMP_NUM_THREADS": threads, "MKL_NUM_THREADS": threads}
    if sys.platform.startswith("linux"):
        env["GLOO_SOCKET_IFNAME"] = os.environ.get("GLOO_SOCKET_IFNAME", "lo")
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)  # spawned children inherit it; restored below
    with tempfile.TemporaryDirectory(prefix="bench-torch-") as tmp:
        out_path = os.path.join(tmp, "result")
        ctx = None
        try:
            ctx = mp.start_processes(
                _torch_worker,
                args=(cfg, schedules, _free_port(), out_path),
                nprocs=cfg.stages,
                join=False,
                start_method="spawn",
            )
            while not ctx.join(timeout=1.0):
                pass
            measured = {
                name: [json.loads(Path(f"{out_path}.{name}.{r}").read_text()) for r in range(cfg.stages)]
                for name in schedules
            }
        finally:
            for key, value in saved.items():
                if value is None:
                    os.environ.pop(key, None)
                else:
                    os.environ[key] = value
            if ctx is not None:
                _end_processes(ctx.processes)
    results = []
    for name, ranks in measured.items():
        label = {"gpipe": "torch GPipe", "1f1b": "torch 1F1B"}[name]
        elapsed = max(r["elapsed_s"] for r in ranks)
        samples_per_s = cfg.torch_steps * cfg.global_batch / elapsed
        cpu_per_step = {"stages": round(sum(r["cpu_s"] for r in ranks) / cfg.torch_steps, 4)}
        log(
            f"{label}: {samples_per_s:.1f} samples/s ({elapsed / cfg.torch_steps:.3f} s/step; "
            f"CPU s/step {cpu_per_step})"
        )
        extra = {"loss_first": ranks[-1]["loss_first"], "loss_last": ranks[-1]["loss_last"]}
        results.append(
            Result(
                label,
                samples_per_s,
                elapsed / cfg.torch_steps,
                cfg.torch_steps,
                extra=extra | {"cpu_s_per_step": cpu_per_step},
            )
        )
    return results


def _end_processes(procs: list) -> None:
    for p in procs:
        if p.is_alive():
            p.terminate()
    deadline = time.monotonic() + 10
    for p in procs:
        p.join(timeout=max(0.1, deadline - time.monotonic()))
        if p.is_alive():
            p.kill()
            p.join(timeout=5)


# ---------------------------------------------------------------------------------------------------
# swarm side
# ---------------------------------------------------------------------------------------------------


CpuSnapshot = dict[int, tuple[str, float]]  # pid -> (role, CPU seconds so far)


def cpu_snapshot(roles: dict[str, list[int]]) -> CpuSnapshot:
    """CPU seconds (user + system) of each process and its descendants (hivemind's p2pd), by role."""
    import psutil

    snap: CpuSnapshot = {}
    for role, pids in roles.items():
        for pid in pids:
            try:
                root = psutil.Process(pid)
                for proc in [root, *root.children(recursive=True)]:
                    t = proc.cpu_times()
                    snap[proc.pid] = (role, t.user + t.system)
            except psutil.Error:
                continue
    return snap


def cpu_between(a: CpuSnapshot, b: CpuSnapshot) -> dict[str, float]:
    """CPU seconds by role spent between two snapshots, over the processes present in both."""
    out: dict[str, float] = {}
    for pid, (role, cpu) in b.items():
        if pid in a:
            out[role] = out.get(role, 0.0) + max(0.0, cpu - a[pid][1])
    return out


class StepClock:
    """When this process first saw each global step in a trainer's progress lines, with a CPU snapshot of
    the swarm's processes at that moment."""

    def __init__(self, total: int, label: str, roles) -> None:
        self.total, self.label, self.roles = total, label, roles
        self.times: dict[int, float] = {}
        self.cpu: dict[int, CpuSnapshot] = {}
        self._lock = threading.Lock()
        self._last_print = 0.0

    def __call__(self, proc, line: str, payload: dict | None) -> None:
        if payload is None or payload.get("event") != "progress":
            return
        now = time.monotonic()
        step = int(payload["step"])
        with self._lock:
            if step in self.times:
                return
            self.times[step] = now
        snap = cpu_snapshot(self.roles())
        with self._lock:
            self.cpu[step] = snap
        if now - self._last_print > 5.0 or step >= self.total:
            self._last_print = now
            log(f"{self.label}: step {step}/{self.total}")

    def window(self, not_before: float, start: int) -> tuple[int, int, float, dict[str, float]]:
        """(first step, last step, seconds, CPU seconds by role) of the timed window: from the first step
        >= `start` seen at or after `not_before` (every peer ready) to the last step seen."""
        with self._lock:
            seen = sorted((s, t) for s, t in self.times.items() if t >= not_before)
            cpu = dict(self.cpu)
        if len(seen) < 2:
            raise RuntimeError(f"{self.label}: too few steps seen to time ({len(seen)})")
        first = next(((s, t) for s, t in seen if s >= start), None)
        last = seen[-1]
        if first is None or last[0] - first[0] < 1:
            first = seen[0]  # too few steps after warm-up: time everything seen
        roles = cpu_between(cpu.get(first[0], {}), cpu.get(last[0], {}))
        return first[0], last[0], last[1] - first[1], roles


def _swarm_options(cfg: BenchConfig, sync: str, peers_per_stage: int, steps: int, log_dir: Path):
    from swarm.local import LocalOptions

    run_args = [
        "--model",
        json.dumps(cfg.model),
        "--global-batch",
        str(cfg.global_batch),
        "--microbatch",
        str(cfg.microbatch),
        "--codec",
        "none",
        "--sync",
        sync,
        "--lr",
        str(cfg.lr),
        "--clip-norm",
        str(cfg.clip_norm),
        "--seed",
        str(cfg.seed),
    ]
    return LocalOptions(
        stages=cfg.stages,
        peers_per_stage=peers_per_stage,
        trainers=1,
        steps=steps,
        log_dir=str(log_dir),
        threads=cfg.threads,
        run_args=run_args,
        # a fixed layout (no moves) on the device the torch side uses (peers default to CUDA when present)
        peer_args=["--device", cfg.device, "--no-rebalance"],
        # no validation passes inside the timed window, and none at the end
        trainer_args=["--val-every", "0", "--val-samples", "0"],
    )


def _swarm_roles(swarm) -> dict[str, list[int]]:
    return {
        "peers": [p.pid for p in swarm.peers if p.alive()],
        "trainer": [p.pid for p in swarm.trainers if p.alive()],
        "coordinator": [swarm.coordinator.pid] if swarm.coordinator is not None else [],
    }


def _wait_trainer(trainer, clock: StepClock, stall_s: float) -> dict:
    """The trainer's summary; fails fast when it exits badly or makes no step for `stall_s` seconds."""
    seen, since = 0, time.monotonic()
    while True:
        try:
            code = trainer.wait(timeout=1.0)
            break
        except subprocess.TimeoutExpired:
            now = time.monotonic()
            if len(clock.times) != seen:
                seen, since = len(clock.times), now
            elif now - since > stall_s:
                raise RuntimeError(
                    f"{trainer.name} made no step for {stall_s:.0f} s; log {trainer.log_path}:\n{trainer.log_tail()}"
                ) from None
    trainer._reader.join(timeout=5)
    if code != 0 or trainer.summary is None:
        raise RuntimeError(f"{trainer.name} exited with code {code}; log {trainer.log_path}:\n{trainer.log_tail()}")
    return trainer.summary


def run_swarm(
    cfg: BenchConfig,
    sync: str,
    phases: list[int],
    log_root: Path,
    while_starting: Callable[[], None] | None = None,
) -> list[Result]:
    """One local swarm: the first phase with phases[0] peers per stage, each later phase after adding
    peers up to phases[i] per stage (and a new trainer). `while_starting` runs while the first peers
    start up. Every process is stopped on the way out."""
    from swarm.local import LocalSwarm

    S, B = cfg.stages, cfg.global_batch
    per_phase = cfg.swarm_warmup + cfg.swarm_steps
    log_dir = log_root / f"swarm-{sync}-{'-'.join(map(str, phases))}x-{int(time.time())}"
    opts = _swarm_options(cfg, sync, phases[0], per_phase, log_dir)
    results: list[Result] = []
    with LocalSwarm(opts) as swarm:
        log(f"swarm {sync}: starting a coordinator, {S}x{phases[0]} peers, 1 trainer (logs {log_dir})")
        swarm.start_coordinator()
        peers = [swarm.start_peer(k, wait=False) for k in range(S) for _ in range(phases[0])]
        if while_starting is not None:
            while_starting()
        target = per_phase
        for index, per_stage in enumerate(phases):
            if index:
                added = [
                    swarm.start_peer(k, wait=False) for k in range(S) for _ in range(per_stage - phases[index - 1])
                ]
                log(f"swarm {sync}: adding {len(added)} peers for {per_stage} per stage")
                peers += added
            label = f"swarm {sync} {per_stage}/stage"
            clock = StepClock(target, label, lambda: _swarm_roles(swarm))
            swarm.opts.steps = target
            overlap = index == 0 and per_stage == 1  # the trainer cannot start before every stage is up
            if overlap:
                trainer = swarm.start_trainers(on_line=clock)[-1]
            for p in peers:
                p.wait_ready(opts.startup_timeout_s)
            ready_at = time.monotonic()
            if not overlap:
                swarm.trainers = [t for t in swarm.trainers if t.alive()]  # earlier trainers are reaped
                trainer = swarm.start_trainers(on_line=clock)[-1]
            summary = _wait_trainer(trainer, clock, cfg.stall_s)
            trainer.stop()  # reaps its process group (the DHT daemon) now
            first, last, seconds, cpu = clock.window(ready_at, target - cfg.swarm_steps)
            processes = len(clock.cpu.get(last, {}))  # peers, trainer, coordinator, their DHT and p2pd processes
            steps = last - first
            sps = steps * B / seconds
            cpu_per_step = {role: round(v / steps, 4) for role, v in sorted(cpu.items())}
            log(
                f"{label}: {sps:.1f} samples/s over steps {first}..{last} ({seconds / steps:.3f} s/step; "
                f"CPU s/step {cpu_per_step})"
            )
            results.append(
                Result(
                    label,
                    sps,
                    seconds / steps,
                    steps,
                    extra={
                        "sync": sync,
                        "peers_per_stage": per_stage,
                        "summary_samples_per_s": summary["samples_per_s"],
                        "loss_first": summary["loss_first"],
                        "loss_last": summary["loss_last"],
                        "retries": summary["retries"],
                        # the trainer's time with nothing in flight, waiting for the swarm's next step
                        "trainer_idle_share": round(
                            summary.get("idle_s", 0.0) * summary["samples_per_s"] / max(1, summary["samples"]), 4
                        ),
                        "cpu_s_per_step": cpu_per_step,
                        "processes": processes,
                        # per kind and stage, the trainer's mean send-to-answer time and the peers'
                        # compute time (the rest: queueing behind the step's other microbatches, transfers)
                        "call_ms": summary.get("call_ms", {}),
                    },
                )
            )
            target = int(summary["steps"]) + per_phase
    # every peer has stopped: their counters (last stdout line) say how often a backward found its
    # forward's activations kept (for the whole swarm: all its phases)
    counters = [p.counters for p in swarm.peers if p.counters]
    hits = sum(c.get("activation_hits", 0) for c in counters)
    misses = sum(c.get("activation_misses", 0) for c in counters)
    timeline = update_timeline(counters)
    for r in results:
        r.extra["activation_hits"], r.extra["activation_misses"] = hits, misses
        r.extra["activation_hit_rate"] = round(hits / (hits + misses), 4) if hits + misses else None
        r.extra["update_timeline"] = timeline
    return results


def update_timeline(counters: list[dict]) -> dict:
    """Where the stages' step time went (swarm.peer.stepping.UpdateTimeline), over every peer: ms per
    update of freezing, waiting for mates still taking samples, agreeing, the all-reduce and applying,
    the mean interval between updates, and the share of it the update took (the rest: compute and
    waiting for samples). `averaging_share`: agreeing + the all-reduce + the rounds that failed and
    were tried again (`failed_ms`: per update, whatever they spent: a round that found a mate not
    frozen yet, a duplicate to drop, a failed transfer); `wait_share`: the stragglers."""
    parts = ("freeze_s", "wait_mates_s", "agree_s", "allreduce_s", "apply_s")
    lines = [c.get("update_timeline") or {} for c in counters]
    updates = sum(t.get("updates", 0) for t in lines)
    intervals = sum(t.get("intervals", 0) for t in lines)
    if not updates or not intervals:
        return {}
    out = {p.removesuffix("_s") + "_ms": round(1000 * sum(t.get(p, 0.0) for t in lines) / updates, 2) for p in parts}
    out["interval_ms"] = round(1000 * sum(t.get("interval_s", 0.0) for t in lines) / intervals, 2)
    failed_s = sum(t.get("failed_round_s", 0.0) for t in lines)
    out["failed_ms"] = round(1000 * failed_s / updates, 2)
    spent = sum(out[p.removesuffix("_s") + "_ms"] for p in parts) + out["failed_ms"]
    out["update_share"] = round(spent / out["interval_ms"], 4)
    averaging = out["agree_ms"] + out["allreduce_ms"] + out["failed_ms"]
    out["averaging_share"] = round(averaging / out["interval_ms"], 4)
    out["wait_share"] = round(out["wait_mates_ms"] / out["interval_ms"], 4)
    out["failed_round_s"] = round(failed_s, 3)
    return out


# ---------------------------------------------------------------------------------------------------
# driver
# ---------------------------------------------------------------------------------------------------


def parse_model(text: str) -> dict:
    from swarm.training.config import model_spec_from_text

    model = dict(TINY_GPT) if text == "tiny" else model_spec_from_text(text)
    if model.get("kind") != "gpt":
        raise SystemExit("bench_pipeline compares GPT pipelines: --model must be a gpt spec")
    from swarm.training.models import GPTConfig

    full = {**GPTConfig().to_dict(), **{k: v for k, v in model.items() if k != "kind"}}
    return {"kind": "gpt", **full}


def make_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        description=(
            "Throughput of swarm (1 and 2 peers per stage) against torch.distributed.pipelining "
            "(ScheduleGPipe, Schedule1F1B over gloo) for the same GPT, split, processes and microbatches."
        ),
        epilog="Progress goes to stderr; the table (or with --json, one JSON object as the last line) to stdout.",
    )
    p.add_argument("--quick", action="store_true", help="tiny model and few steps: checks that everything runs")
    p.add_argument("--json", action="store_true", help="print one JSON object as the last stdout line")
    p.add_argument("--model", help="gpt (default), gpt-small, tiny, or a JSON GPT spec (default: tiny with --quick)")
    p.add_argument("--stages", type=int, default=3, help="pipeline stages S (default 3)")
    p.add_argument("--global-batch", type=int, help="samples per optimizer step B (default 32; 16 with --quick)")
    p.add_argument("--microbatch", type=int, help="samples per microbatch; B/microbatch microbatches (default B/4)")
    p.add_argument("--threads", type=int, default=1, help="torch threads per process, both sides (default 1)")
    p.add_argument("--device", default="cpu", help="cpu (default) or cuda[:N], for the stages of both sides")
    p.add_argument(
        "--steps", type=int, help="timed steps per measurement (default 40; 10 torch / 8 swarm with --quick)"
    )
    p.add_argument(
        "--warmup", type=int, help="untimed steps before each window (default 3 torch / 5 swarm; 2 with --quick)"
    )
    p.add_argument(
        "--sync",
        help="swarm sync modes for 1 peer/stage, comma-separated; the best one is used for the ratio "
        "and for 2 peers/stage (default exact,async; exact with --quick)",
    )
    p.add_argument(
        "--rounds",
        type=int,
        default=1,
        help="repeat torch and the swarm's 1-peer/stage runs this many times, alternating which side goes "
        "first; the figures are the medians of the rounds' (default 1; not with --quick)",
    )
    p.add_argument("--skip-torch", action="store_true", help="swarm side only (ratio is then absent)")
    p.add_argument("--skip-swarm", action="store_true", help="torch side only")
    p.add_argument("--log-dir", help="swarm process logs go under this folder (default: a temporary folder)")
    p.add_argument(
        "--stall-timeout", type=float, default=120.0, help="fail when a swarm trainer makes no step for this long (s)"
    )
    return p


def build_config(args: argparse.Namespace) -> BenchConfig:
    quick = args.quick
    model = parse_model(args.model or ("tiny" if quick else "gpt"))
    B = args.global_batch or (16 if quick else 32)
    b = args.microbatch or max(1, B // 4)
    if B % b:
        raise SystemExit(f"--global-batch {B} must be a multiple of --microbatch {b}")
    if B // b < args.stages:
        raise SystemExit(f"Schedule1F1B needs at least as many microbatches ({B // b}) as stages ({args.stages})")
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        raise SystemExit("--device cuda: CUDA is not available here")
    modes = [m.strip() for m in (args.sync or ("exact" if quick else "exact,async")).split(",")]
    if not modes or any(m not in ("exact", "async") for m in modes):
        raise SystemExit("--sync must list exact and/or async")
    if args.rounds < 1 or (quick and args.rounds > 1):
        raise SystemExit("--rounds must be at least 1 (and 1 with --quick)")
    return BenchConfig(
        model=model,
        stages=args.stages,
        global_batch=B,
        microbatch=b,
        threads=args.threads,
        device=args.device,
        torch_warmup=args.warmup if args.warmup is not None else (2 if quick else 3),
        torch_steps=args.steps or (10 if quick else 40),
        swarm_warmup=args.warmup if args.warmup is not None else (2 if quick else 5),
        swarm_steps=args.steps or (8 if quick else 40),
        sync_modes=modes,
        log_dir=args.log_dir,
        quick=quick,
        stall_s=args.stall_timeout,
        rounds=args.rounds,
    )


def _round_figures(torch_rows: list[Result], ones: list[Result]) -> dict:
    """One round's samples/s and ratios (the ratio of each sync mode to the faster torch schedule)."""
    out = {f"torch_{n}_samples_per_s": r.samples_per_s for n, r in zip(SCHEDULES, torch_rows, strict=False)}
    out |= {f"swarm_{r.extra['sync']}_samples_per_s": r.samples_per_s for r in ones}
    best = max((r.samples_per_s for r in torch_rows), default=0.0)
    if best > 0:
        out |= {f"ratio_{r.extra['sync']}_vs_torch_best": r.samples_per_s / best for r in ones}
    return out


def _median_figures(rounds: list[dict]) -> dict:
    """Every figure's median over the rounds (with one round: that round's figures)."""
    return {key: statistics.median(r[key] for r in rounds) for key in rounds[0]}


def run_all(cfg: BenchConfig, skip_torch: bool, skip_swarm: bool, log_root: Path) -> tuple[list[Result], dict]:
    torch_rows: list[Result] = []
    figures: dict = {}

    def torch_side() -> list[Result]:
        rows = run_torch(cfg, list(SCHEDULES))
        torch_rows.extend(rows)
        return rows

    if skip_swarm:
        figures |= _median_figures([_round_figures(torch_side(), []) for _ in range(cfg.rounds)])
        figures["processes"] = {"torch": cfg.stages}
        return torch_rows, figures
    ones: list[Result] = []
    rounds: list[dict] = []
    if cfg.quick:
        # Process start-up is the slow part on a small machine: one swarm, grown from 1 to 2 peers per
        # stage, whose first peers start while the torch side runs. Quick figures only show it all works.
        rs = run_swarm(cfg, cfg.sync_modes[0], [1, 2], log_root, None if skip_torch else torch_side)
        ones.append(rs[0])
        two = rs[1]
        for mode in cfg.sync_modes[1:]:
            ones += run_swarm(cfg, mode, [1], log_root)
        rounds.append(_round_figures(torch_rows, ones))
    else:
        for index in range(cfg.rounds):
            torch_first = index % 2 == 0  # ABBA: drift of the machine's speed cancels out of the medians
            if cfg.rounds > 1:
                log(f"round {index + 1} of {cfg.rounds} ({'torch' if torch_first else 'the swarm'} first)")
            round_torch = torch_side() if torch_first and not skip_torch else []
            round_ones = [r for mode in cfg.sync_modes for r in run_swarm(cfg, mode, [1], log_root)]
            if not torch_first and not skip_torch:
                round_torch = torch_side()
            for r in round_torch + round_ones:
                r.extra["round"] = index + 1
                if cfg.rounds > 1:
                    r.name += f" #{index + 1}"
            ones += round_ones
            rounds.append(_round_figures(round_torch, round_ones))
    figures |= _median_figures(rounds)
    if cfg.rounds > 1:
        figures["rounds"] = rounds
    modes = [m for m in cfg.sync_modes if f"swarm_{m}_samples_per_s" in figures]
    best_mode = max(modes, key=lambda m: figures[f"swarm_{m}_samples_per_s"])
    for r in ones:
        if r.extra["sync"] == best_mode and (cfg.rounds == 1 or r.extra.get("round") == cfg.rounds):
            r.note = "best: used for the ratio" if cfg.rounds == 1 else "best mode (ratios: medians of the rounds)"
    if not cfg.quick:
        two = run_swarm(cfg, best_mode, [2], log_root)[0]
    swarm_rows = ones + [two]
    figures["swarm_samples_per_s"] = figures[f"swarm_{best_mode}_samples_per_s"]
    figures["swarm_sync"] = best_mode
    figures["swarm_2x_samples_per_s"] = two.samples_per_s
    figures["swarm_2x_sync"] = two.extra["sync"]
    last = {r.extra["sync"]: r for r in ones} | {"2x": two}  # the timeline and hit rates of each mode's last run
    figures["update_timeline"] = {
        f"{r.extra['sync']}_{r.extra['peers_per_stage']}x": r.extra["update_timeline"] for r in last.values()
    }
    figures["activation_hit_rate"] = {
        f"{r.extra['sync']}_{r.extra['peers_per_stage']}x": r.extra["activation_hit_rate"] for r in last.values()
    }
    torch_best = max((figures.get(f"torch_{n}_samples_per_s", 0.0) for n in SCHEDULES), default=0.0)
    if f"ratio_{best_mode}_vs_torch_best" in figures and torch_best > 0:
        # like for like: exact mode (a synchronous step, as GPipe and 1F1B take) is the headline; async
        # overlaps step boundaries, which torch's schedules do not
        figures["ratio_vs_torch_best"] = figures[f"ratio_{best_mode}_vs_torch_best"]
        figures["ratio_2x_vs_torch_best"] = figures["swarm_2x_samples_per_s"] / torch_best
    figures["processes"] = {"torch": cfg.stages} | {
        f"swarm_{r.extra['sync']}_{r.extra['peers_per_stage']}x": r.extra["processes"] for r in last.values()
    }
    return torch_rows + swarm_rows, figures


def machine() -> dict:
    return {
        "platform": platform.platform(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "cpu_count": os.cpu_count(),
        "cuda": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
    }


def print_table(cfg: BenchConfig, rows: list[Result], figures: dict, wall_s: float, out=sys.stdout) -> None:
    m = cfg.model
    print(
        f"model: gpt d_model={m['d_model']} n_layers={m['n_layers']} seq_len={m['seq_len']}; {cfg.stages} stages; "
        f"global batch {cfg.global_batch} = {cfg.microbatches} x {cfg.microbatch}; {cfg.threads} thread(s)/process; "
        f"device {cfg.device}; {os.cpu_count()} CPUs",
        file=out,
    )
    print(
        f"{'run':<24} {'samples/s':>10} {'s/step':>8} {'CPU s/step':>10} {'steps':>6} {'vs torch best':>14}  note",
        file=out,
    )
    torch_best = max((figures.get(f"torch_{n}_samples_per_s", 0.0) for n in SCHEDULES), default=0.0)
    rounds = figures.get("rounds") or []
    for r in rows:
        best = torch_best  # a round's rows against that round's torch
        if rounds and "round" in r.extra:
            best = max(rounds[r.extra["round"] - 1].get(f"torch_{n}_samples_per_s", 0.0) for n in SCHEDULES)
        rel = f"{r.samples_per_s / best:.2f}" if best else "-"
        note = r.note
        if "summary_samples_per_s" in r.extra:
            note = (note + "; " if note else "") + f"trainer summary {r.extra['summary_samples_per_s']:.1f} samples/s"
        tl = r.extra.get("update_timeline") or {}
        if tl:
            note = (note + "; " if note else "") + (
                f"update {tl['update_share']:.0%} of a step, averaging {tl['averaging_share']:.1%} (all-reduce "
                f"{tl['allreduce_ms']:.0f} ms, agree {tl['agree_ms']:.0f} ms, failed rounds {tl['failed_ms']:.0f} ms, "
                f"waiting for mates {tl['wait_mates_ms']:.0f} ms of {tl['interval_ms']:.0f} ms)"
            )
        if "trainer_idle_share" in r.extra:
            note = (note + "; " if note else "") + f"trainer idle {r.extra['trainer_idle_share']:.0%}"
        if r.extra.get("activation_hit_rate") is not None:
            note = (note + "; " if note else "") + f"activation hits {r.extra['activation_hit_rate']:.0%}"
        cpu = r.extra.get("cpu_s_per_step", {})
        if len(cpu) > 1:
            note = (note + "; " if note else "") + "CPU " + ", ".join(f"{k} {v:.3f}" for k, v in cpu.items())
        total = f"{sum(cpu.values()):.3f}" if cpu else "-"
        print(
            f"{r.name:<24} {r.samples_per_s:>10.1f} {r.step_s:>8.3f} {total:>10} {r.steps:>6} {rel:>14}  {note}",
            file=out,
        )
    targets = {"exact": 0.9, "async": 1.0}
    for mode, target in targets.items():
        if f"ratio_{mode}_vs_torch_best" in figures:
            ratio = figures[f"ratio_{mode}_vs_torch_best"]
            each = ""
            if rounds:
                each = "; median of rounds " + " / ".join(f"{x[f'ratio_{mode}_vs_torch_best']:.3f}" for x in rounds)
            print(f"ratio_{mode}_vs_torch_best = {ratio:.3f} (1 peer/stage; target >= {target}{each})", file=out)
    if "ratio_2x_vs_torch_best" in figures:
        ratio = figures["ratio_2x_vs_torch_best"]
        print(f"2 peers/stage ({figures['swarm_2x_sync']}): {ratio:.3f} of torch's best", file=out)
    if "processes" in figures:
        print("processes: " + ", ".join(f"{k} {v}" for k, v in figures["processes"].items()), file=out)
    print(f"wall time {wall_s:.1f} s", file=out)


def _interrupt(signum: int, frame) -> None:
    raise KeyboardInterrupt


def main(argv: list[str] | None = None) -> int:
    args = make_parser().parse_args(argv)
    cfg = build_config(args)
    t0 = time.monotonic()
    # SIGTERM as Ctrl-C: the context managers then stop every process this script started
    signal.signal(signal.SIGTERM, _interrupt)
    with contextlib.ExitStack() as stack:
        if cfg.log_dir:
            log_root = Path(cfg.log_dir)
            log_root.mkdir(parents=True, exist_ok=True)
        else:
            log_root = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="bench-pipeline-")))
        try:
            rows, figures = run_all(cfg, args.skip_torch, args.skip_swarm, log_root)
        except KeyboardInterrupt:
            print("\ninterrupted: every process this benchmark started was stopped", file=sys.stderr)
            return 130
    wall_s = time.monotonic() - t0
    print_table(cfg, rows, figures, wall_s)
    if args.json:
        record = {
            **figures,
            "config": {
                "model": cfg.model,
                "stages": cfg.stages,
                "global_batch": cfg.global_batch,
                "microbatch": cfg.microbatch,
                "microbatches": cfg.microbatches,
                "threads": cfg.threads,
                "device": cfg.device,
                "torch_steps": cfg.torch_steps,
                "torch_warmup": cfg.torch_warmup,
                "swarm_steps": cfg.swarm_steps,
                "swarm_warmup": cfg.swarm_warmup,
                "sync_modes": cfg.sync_modes,
                "codec": "none",
                "quick": cfg.quick,
            },
            "machine": machine(),
            "rows": [asdict(r) for r in rows],
            "wall_s": wall_s,
        }
        bad = [k for k, v in figures.items() if isinstance(v, float) and not math.isfinite(v)]
        if bad:
            print(f"warning: non-finite figures {bad}", file=sys.stderr)
        print(json.dumps(record), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
