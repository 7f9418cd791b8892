"""Shared pieces of the integration tests: small fast run configs and process bookkeeping."""

from __future__ import annotations

import asyncio
import json
import threading
import time

import psutil

from swarm.core.procs import group_alive
from swarm.wire.client import StageClient

TINY_GPT = {"kind": "gpt", "vocab_size": 256, "seq_len": 32, "d_model": 32, "n_layers": 3, "n_heads": 2, "d_ff": 64}


def run_args(model: dict | None = None, **overrides) -> list[str]:
    """Arguments for `swarm local` / the coordinator describing a small, fast run."""
    args = {
        "--model": json.dumps(model or TINY_GPT),
        "--global-batch": "16",
        "--microbatch": "4",
        "--lr": "3e-3",
        "--max-bytes": None,
    }
    args.pop("--max-bytes")
    for key, value in overrides.items():
        args["--" + key.replace("_", "-")] = str(value)
    out: list[str] = []
    for key, value in args.items():
        out += [key, value]
    return out


class TrainingProgress:
    """The trainers' progress lines, as a `ManagedProcess` line handler: the steps seen (with when),
    and a wait for a step that ends at a deadline."""

    def __init__(self) -> None:
        self.steps: list[tuple[float, int]] = []
        self.lock = threading.Condition()

    def __call__(self, proc, line, payload) -> None:
        if payload and payload.get("event") == "progress":
            with self.lock:
                self.steps.append((time.monotonic(), payload["step"]))
                self.lock.notify_all()

    def latest(self) -> int:
        with self.lock:
            return max((s for _, s in self.steps), default=0)

    def wait_step(self, n: int, timeout: float) -> int:
        with self.lock:
            if not self.lock.wait_for(lambda: max((s for _, s in self.steps), default=0) >= n, timeout):
                raise TimeoutError(f"training did not reach step {n} in {timeout} s")
            return max(s for _, s in self.steps)


def start_training(swarm, steps: int, trainer_args: list[str] = ()) -> TrainingProgress:
    """Start the swarm's trainers for `steps` steps; their progress is watched."""
    swarm.opts.steps = steps
    swarm.opts.trainer_args = list(trainer_args)
    progress = TrainingProgress()
    swarm.start_trainers(on_line=progress)
    return progress


def assert_all_reaped(pgids: list[int], pids: list[int] = (), timeout: float = 15.0) -> None:
    deadline = time.monotonic() + timeout
    while True:
        alive_groups = [g for g in pgids if group_alive(g)]
        alive_pids = [p for p in pids if psutil.pid_exists(p) and psutil.Process(p).status() != psutil.STATUS_ZOMBIE]
        if not alive_groups and not alive_pids:
            return
        if time.monotonic() > deadline:
            raise AssertionError(f"processes left alive: groups {alive_groups}, pids {alive_pids}")
        time.sleep(0.2)


def info(address: str, timeout: float = 5.0):
    async def go():
        client = StageClient(address)
        try:
            return await client.info(timeout)
        finally:
            await client.close()

    return asyncio.run(go())


def wait_for(predicate, timeout: float, what: str, interval: float = 0.2):
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise TimeoutError(f"timed out after {timeout:.0f} s waiting for {what}")
        time.sleep(interval)


def fetch_state(address: str, run_id: str, stage: int, timeout: float = 60.0) -> dict:
    """A peer's full training state, over the wire contract's GetState."""
    from swarm.peer.state_transfer import download_state

    async def go():
        client = StageClient(address)
        try:
            return await download_state(client, run_id, stage, timeout, 1 << 30)
        finally:
            await client.close()

    return asyncio.run(go())


def write_tokens(path, n: int = 60_000, vocab: int = 256, seed: int = 0):
    """A learnable token file: a noisy repeating pattern (uint16, nanoGPT style)."""
    import numpy as np

    rng = np.random.default_rng(seed)
    pattern = rng.integers(0, vocab, size=97)
    tokens = pattern[np.arange(n) % 97].copy()
    noise = rng.random(n) < 0.1
    tokens[noise] = rng.integers(0, vocab, size=int(noise.sum()))
    tokens.astype(np.uint16).tofile(path)
    return tokens.astype(np.int64)


def ledger_report(swarm, sample_logs: str | None = None):
    """The ledger check of a live local swarm (swarm.ledger), against the trainers' sample logs."""
    from swarm.ledger import check_run, collect, read_sample_logs

    run, entries = asyncio.run(collect(swarm.run_id, swarm.initial_peers, swarm.run_key, swarm.invite))
    return check_run(run, entries, read_sample_logs([sample_logs]) if sample_logs else None)


def assert_ledger_exact(swarm, sample_logs: str | None = None):
    """Every sample the trainers assigned entered every stage exactly once, in its step's update."""
    from swarm.policy.ledger import format_report

    report = ledger_report(swarm, sample_logs)
    assert report.ok and report.checked > 0, format_report(report)
    return report
