"""`swarm peer --check`: everything a peer needs on this box, checked without joining the run, then exit.

In order: the device and its free memory; the ports and folders; the --initial-peers (a TCP connection); the
DHT (a node started with a deadline, then stopped); the run config on it; the stage's memory need against
what is free; the stage's throughput (a short benchmark); and whether others can reach this box (the DHT node
of the first --initial-peers that answers dials the announced gRPC and DHT addresses back). Each check prints
one line: "ok" with what it found, or "problem" with the fix. Exit code 0 when all are ok, 2 otherwise.
"""

from __future__ import annotations

import socket
import sys
import time
from collections.abc import Callable
from concurrent.futures import Future

import psutil
import torch

from swarm.cluster.runconfig import fetch_run_config
from swarm.core.errors import ConfigError
from swarm.core.preflight import check_port_free, check_reachable, check_writable_dir, parse_maddrs
from swarm.dht.node import SwarmDHT
from swarm.peer.config import PeerConfig
from swarm.peer.preflight import (
    announced_targets,
    check_announce,
    check_identity_path,
    reachability_problems,
    resolve_device,
)
from swarm.peer.throughput import benchmark
from swarm.training.config import RunConfig
from swarm.training.models import build_stage

CHECK_DHT_TIMEOUT_S = 20.0
# parameters, their gradient and AdamW's two moments in float32, and as much again for activations and buffers
BYTES_PER_PARAMETER = 4 * 4 * 2


class _Bench:
    """What benchmark() needs of an executor: the module, its parameters, the device, a call on this thread."""

    def __init__(self, module: torch.nn.Module, device: torch.device) -> None:
        self.module, self.device = module.to(device), device
        self.params = [p for p in module.parameters() if p.requires_grad]

    def call(self, fn: Callable[[], float]) -> Future:
        future: Future = Future()
        future.set_result(fn())
        return future


class Checks:
    def __init__(self, cfg: PeerConfig) -> None:
        self.cfg = cfg
        self.problems = 0
        self.device: torch.device | None = None
        self.dht: SwarmDHT | None = None
        self.run: RunConfig | None = None

    def report(self, name: str, check: Callable[[], str]) -> bool:
        try:
            print(f"ok       {name}: {check()}", flush=True)
            return True
        except ConfigError as e:
            self.problems += 1
            print(f"problem  {name}: {e}", file=sys.stderr, flush=True)
            return False

    def device_memory(self) -> str:
        self.device = resolve_device(self.cfg.device)
        return f"{self.device}, {self.free_bytes() / 2**30:.1f} GiB free"

    def free_bytes(self) -> int:
        if self.device is not None and self.device.type == "cuda":
            return torch.cuda.mem_get_info(self.device)[0]
        return psutil.virtual_memory().available

    def ports_and_folders(self) -> str:
        cfg = self.cfg
        check_announce(cfg)
        check_port_free(cfg.host, cfg.port, "--port")
        check_port_free(cfg.host, cfg.dht_port, "--dht-port")
        for path, flag in ((cfg.checkpoint_dir, "--checkpoint-dir"), (cfg.ledger_dir, "--ledger-dir")):
            if path:
                check_writable_dir(path, flag)
        if cfg.identity_path:
            check_identity_path(cfg.identity_path)
        return f"ports {cfg.port or 'any'} and {cfg.dht_port or 'any'} free on {cfg.host}; folders writable"

    def initial_peers(self) -> str:
        check_reachable(parse_maddrs(self.cfg.initial_peers))
        return f"{len(self.cfg.initial_peers)} given, answering"

    def dht_node(self) -> str:
        cfg = self.cfg
        start = time.monotonic()
        self.dht = SwarmDHT(cfg.run_id, cfg.initial_peers, host=cfg.host, port=cfg.dht_port,
                            announce_host=cfg.announce_host, start_timeout=CHECK_DHT_TIMEOUT_S,
                            identity_path=cfg.identity_path)  # fmt: skip
        return f"joined in {time.monotonic() - start:.1f} s as {self.dht.peer_id}"

    def run_config(self) -> str:
        self.run = fetch_run_config(
            self.dht, min(self.cfg.join_timeout_s, CHECK_DHT_TIMEOUT_S), self.cfg.run_key, self.cfg.allow_model
        )
        run, stage = self.run, self.cfg.stage
        if stage != "auto" and not 0 <= int(stage) < run.num_stages:
            raise ConfigError(f"--stage {stage} is out of range: run {run.run_id!r} has stages 0..{run.num_stages - 1}")
        return f"run {run.run_id!r}: {run.num_stages} stages, model {run.model.get('kind')}, codec {run.codec}"

    def stages_to_check(self) -> list[int]:
        return list(range(self.run.num_stages)) if self.cfg.stage == "auto" else [int(self.cfg.stage)]

    def memory_and_throughput(self) -> str:
        parts = []
        for stage in self.stages_to_check():
            try:
                built = build_stage(self.run.model, stage, self.run.num_stages)
            except (ValueError, ImportError) as e:
                raise ConfigError(f"stage {stage} does not build here ({e}): install the model's module") from None
            need = sum(p.numel() for p in built.module.parameters()) * BYTES_PER_PARAMETER
            if need > self.free_bytes():
                raise ConfigError(
                    f"stage {stage} needs about {need / 2**30:.1f} GiB, {self.free_bytes() / 2**30:.1f} GiB is free on "
                    f"{self.device}: free memory, use another --device, or serve a smaller --stage"
                )
            rate = benchmark(_Bench(built.module, self.device), built.schema, self.run.microbatch, seconds=0.5)
            parts.append(f"stage {stage}: ~{need / 2**20:.0f} MiB, {rate:.1f} samples/s")
        return "; ".join(parts)

    def reachable(self) -> str:
        cfg = self.cfg
        with socket.create_server((cfg.host, cfg.port)) as server:  # the gRPC port, as the peer will open it
            targets = announced_targets(cfg, server.getsockname()[1], self.dht.visible_maddrs())
            lines = reachability_problems(self.dht, cfg, targets)
        if lines:
            raise ConfigError(" | ".join(lines))
        return f"{', '.join(targets)} reachable from the swarm"


def run_check(cfg: PeerConfig) -> int:
    checks = Checks(cfg)
    try:
        for name, check in (("device", checks.device_memory), ("ports", checks.ports_and_folders),
                            ("initial peers", checks.initial_peers)):  # fmt: skip
            checks.report(name, check)
        if checks.problems == 0 and checks.report("DHT", checks.dht_node) and checks.report("run", checks.run_config):
            checks.report("stage", checks.memory_and_throughput)
            checks.report("reachability", checks.reachable)
    finally:
        if checks.dht is not None:
            checks.dht.shutdown()
    verdict = "all checks passed" if checks.problems == 0 else f"{checks.problems} problem(s): fix them, run again"
    print(verdict, file=sys.stdout if checks.problems == 0 else sys.stderr, flush=True)
    return 0 if checks.problems == 0 else 2
