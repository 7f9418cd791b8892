"""Shared pieces of the integration tests: small fast run configs and process bookkeeping."""

from __future__ import annotations

import asyncio
import glob
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
    """A peer's full training state, over the wire contract's GetState. A peer answers
    RESOURCE_EXHAUSTED to a second GetState from one host within `state_call_interval_s` (1 s):
    like any client, this one comes back after that interval, until `timeout`."""
    import grpc

    from swarm.peer.state_transfer import download_state

    async def go():
        client = StageClient(address)
        deadline = time.monotonic() + timeout
        try:
            while True:
                try:
                    return await download_state(client, run_id, stage, max(1.0, deadline - time.monotonic()), 1 << 30)
                except grpc.aio.AioRpcError as e:
                    if e.code() != grpc.StatusCode.RESOURCE_EXHAUSTED or time.monotonic() > deadline:
                        raise
                    await asyncio.sleep(1.0)
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


def logged_batches(pattern: str) -> dict[int, list[int]]:
    """Each step's samples, from the trainers' sample logs (a contribution logged twice, by a
    restarted trainer, counts once)."""
    seen: dict[str, tuple[int, list[int]]] = {}
    for path in sorted(glob.glob(pattern)):
        with open(path) as f:
            for line in f:
                rec = json.loads(line)
                seen[rec["cid"]] = (rec["step"], rec["indices"])
    batches: dict[int, list[int]] = {}
    for step, indices in seen.values():
        batches.setdefault(step, []).extend(indices)
    return batches


def single_process_val_loss(run, batches: dict[int, list[int]], val_samples: int) -> float:
    """The validation loss after training `run`'s model in one process on `batches` (step -> its
    samples) with the project's own stage modules and optimizer: what an honest swarm in exact mode
    reaches (equal within float error: test_exact_mode.py checks the swarm against plain torch)."""
    import torch

    from swarm.training.data import DataConfig, load_dataset, val_indices
    from swarm.training.models import build_stage
    from swarm.training.optim import apply_update, build_optimizer

    stages = [build_stage(run.model, k, run.num_stages).module for k in range(run.num_stages)]
    optimizers = [build_optimizer(module, run.optim) for module in stages]
    dataset = load_dataset(run.data if isinstance(run.data, DataConfig) else DataConfig(**run.data), run.model)

    def losses(x, y):  # one loss per sample, as the last stage reports them
        for module in stages[:-1]:
            x = module(x)
        return stages[-1](x, y)

    for step in sorted(batches):
        x, y = dataset.train(batches[step])
        for opt in optimizers:
            opt.zero_grad()
        losses(x, y).mean().backward()  # the stages average per-sample gradients over the global batch
        for opt in optimizers:
            apply_update(opt, run.optim, step)  # the step's learning rate, each stage's own clipping
    with torch.no_grad():
        x, y = dataset.val(val_indices(dataset, val_samples))
        return float(losses(x, y).mean())


class StatusReader:
    """`swarm status` of a LocalSwarm, read as often as a test asks over one DHT client node (in this
    process, on an event loop of its own thread): a new `swarm status` process per look costs a core's
    worth of start-up on a 2-core machine, which slows the very swarm the test watches."""

    def __init__(self, swarm, timeout_s: float = 60.0) -> None:
        from swarm.status import StatusObserver

        self.timeout_s = timeout_s
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()
        opened = StatusObserver.open(swarm.run_id, swarm.join_addresses(), swarm.run_key, swarm.invite)
        try:
            self.observer = self._run(opened)
        except BaseException:
            self._stop_loop()  # no thread left running for a reader that never opened
            raise

    def _run(self, coro):
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(self.timeout_s)

    def __call__(self) -> dict:
        return self._run(self.observer.read())

    def close(self) -> None:
        try:
            self._run(self.observer.close())
        finally:
            self._stop_loop()

    def _stop_loop(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(timeout=10)
