"""A peer's compute throughput for its stage: a short benchmark at start (cached per device, model and
stage), then an exponential moving average of real work (kept by the executor)."""

from __future__ import annotations

import hashlib
import json
import logging
import os
import time
from pathlib import Path

import torch

from swarm.peer.executor import StageExecutor
from swarm.training.models import StageSchema, TensorSchema

logger = logging.getLogger(__name__)


def cache_path() -> Path:
    root = os.environ.get("SWARM_CACHE_DIR") or os.path.join(os.path.expanduser("~"), ".cache", "swarm")
    return Path(root) / "throughput.json"


def cache_key(device: torch.device, model_spec: dict, stage: int, num_stages: int, microbatch: int) -> str:
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else f"cpu{torch.get_num_threads()}"
    spec = json.dumps(model_spec, sort_keys=True)
    digest = hashlib.sha256(f"{name}|{spec}|{stage}/{num_stages}|{microbatch}".encode()).hexdigest()[:16]
    return f"{name}:{digest}"


def sample_tensor(schema: TensorSchema, batch: int, gen: torch.Generator) -> torch.Tensor:
    dims = []
    for i, d in enumerate(schema.dims):
        limit = schema.max_dims[i] if i < len(schema.max_dims) else None
        dims.append(d if d is not None else (limit or 16))
    shape = (batch, *dims)
    if schema.dtype.is_floating_point:
        return torch.randn(shape, generator=gen).to(schema.dtype)
    lo, hi = schema.value_range or (0, 2)
    return torch.randint(lo, hi, shape, generator=gen).to(schema.dtype)


def sample_output_grad(executor: StageExecutor, x: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        out = executor.module(x.to(executor.device))
    return torch.randn_like(out)


def benchmark(executor: StageExecutor, schema: StageSchema, microbatch: int, seconds: float = 1.0) -> float:
    """Samples/s of a full training round (forward + stateless backward) of this stage. Runs on the
    executor's thread and accumulates nothing."""

    def run() -> float:
        gen = torch.Generator().manual_seed(0)
        x = sample_tensor(schema.input, microbatch, gen).to(executor.device)
        targets = sample_tensor(schema.targets, microbatch, gen).to(executor.device) if schema.is_last else None
        grad = None if schema.is_last else sample_output_grad(executor, x)
        module = executor.module
        done, start = 0, time.perf_counter()
        while True:
            xi = x.detach().requires_grad_(x.dtype.is_floating_point)
            with torch.no_grad():  # the forward pass the trainer asks for
                module(xi, targets) if schema.is_last else module(xi)
            out = module(xi, targets) if schema.is_last else module(xi)  # recomputed in backward
            if schema.is_last:
                torch.autograd.grad(out.sum(), executor.params, allow_unused=True)
            else:
                torch.autograd.grad(out, executor.params, grad_outputs=grad, allow_unused=True)
            if executor.device.type == "cuda":
                torch.cuda.synchronize(executor.device)
            done += microbatch
            elapsed = time.perf_counter() - start
            if elapsed >= seconds or done >= 64 * microbatch:
                return done / elapsed

    return executor.call(run).result()


def measure_throughput(
    executor: StageExecutor, schema: StageSchema, model_spec: dict, microbatch: int, use_cache: bool = True
) -> float:
    key = cache_key(executor.device, model_spec, executor.built.stage, executor.built.num_stages, microbatch)
    path = cache_path()
    cache: dict = {}
    if use_cache and path.exists():
        try:
            cache = json.loads(path.read_text())
        except (OSError, ValueError):
            cache = {}
        if key in cache:
            return float(cache[key])
    value = benchmark(executor, schema, microbatch)
    if use_cache:
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            cache[key] = value
            tmp = path.with_suffix(f".{os.getpid()}.tmp")
            tmp.write_text(json.dumps(cache, indent=1))
            tmp.replace(path)
        except OSError as e:
            logger.warning("cannot cache the throughput benchmark at %s: %s", path, e)
    return value
