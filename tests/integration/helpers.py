"""Shared pieces of the integration tests: small fast run configs and process bookkeeping."""

from __future__ import annotations

import asyncio
import json
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
    from swarm.training.state import download

    async def go():
        client = StageClient(address)
        try:
            return await download(client, run_id, stage, timeout, 1 << 30)
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
