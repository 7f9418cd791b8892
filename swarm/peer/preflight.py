"""What a peer checks before it starts anything: the device, its ports, the folders it writes, its
identity file and that --initial-peers answer. Each problem is a ConfigError naming the fix
(`swarm peer` prints it as one line and exits with code 2)."""

from __future__ import annotations

import os

import torch

from swarm.core.errors import ConfigError
from swarm.core.preflight import check_port_free, check_reachable, check_writable_dir, parse_maddrs
from swarm.peer.config import PeerConfig


def resolve_device(name: str) -> torch.device:
    """The torch device of --device (auto: CUDA when present, else CPU), or a ConfigError with the fix."""
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        device = torch.device(name)
    except RuntimeError:
        raise ConfigError(f"--device {name!r} is not a device: use auto, cpu, cuda or cuda:N") from None
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise ConfigError(
                f"--device {name} requested but CUDA is not available here (torch {torch.__version__}, "
                f"CUDA build: {torch.version.cuda or 'no'}): use --device cpu or auto, or install a CUDA build of torch"
            )
        count = torch.cuda.device_count()
        if device.index is not None and device.index >= count:
            raise ConfigError(f"--device {name}: this machine has {count} CUDA device(s) (cuda:0..cuda:{count - 1})")
    elif device.type != "cpu":
        raise ConfigError(f"--device {name}: only cpu and cuda devices are supported")
    return device


def check_identity_path(path: str) -> None:
    if os.path.isdir(path):
        raise ConfigError(f"--identity-path {path} is a folder: give a file path (created on first start)")
    if os.path.exists(path):
        if not os.access(path, os.R_OK):
            raise ConfigError(f"--identity-path {path} is not readable by this user: fix its owner or permissions")
        return
    check_writable_dir(os.path.dirname(os.path.abspath(path)), "--identity-path's folder")


def check_announce(cfg: PeerConfig) -> None:
    if cfg.host in ("0.0.0.0", "::") and not cfg.announce_host:
        raise ConfigError(
            f"--host {cfg.host} listens on every interface, but others need one address to reach this peer at: "
            "add --announce-host IP (this machine's public IP, or its LAN IP in a private swarm)"
        )


def check_settings(cfg: PeerConfig, reachable: bool = True) -> None:
    """Every check that needs no DHT: raises the first problem found."""
    resolve_device(cfg.device)
    targets = parse_maddrs(cfg.initial_peers)
    check_announce(cfg)
    check_port_free(cfg.host, cfg.port, "--port")
    check_port_free(cfg.host, cfg.dht_port, "--dht-port")
    if cfg.checkpoint_dir:
        check_writable_dir(cfg.checkpoint_dir, "--checkpoint-dir")
    if cfg.ledger_dir:
        check_writable_dir(cfg.ledger_dir, "--ledger-dir")
    if cfg.identity_path:
        check_identity_path(cfg.identity_path)
    if reachable:
        check_reachable(targets)


def announced_targets(cfg: PeerConfig, grpc_port: int, dht_maddrs: list[str]) -> list[str]:
    """The "host:port" addresses others must reach: the gRPC server and the DHT node, as announced."""
    host = cfg.announce_host or cfg.host
    targets = [f"{host}:{grpc_port}"]
    for maddr in dht_maddrs:
        parts = maddr.split("/")
        if len(parts) > 4 and parts[1] in ("ip4", "ip6") and parts[3] == "tcp":
            targets.append(f"{parts[2]}:{parts[4]}")
            break
    return targets


def reachability_problems(dht, cfg: PeerConfig, targets: list[str]) -> list[str]:
    """Ask the DHT nodes of --initial-peers, in turn, to dial `targets` back; one line per problem, each with
    the fix. [] when all are reachable, or when no node answered (nothing known)."""
    for target in parse_maddrs(cfg.initial_peers):
        try:
            answer = dht.dialback(target.peer_id, targets)
        except Exception:  # noqa: BLE001 - an older node without the service, or gone: ask the next
            continue
        lines = []
        for addr, why in answer.get("results", {}).items():
            if why is not None:
                lines.append(
                    f"{addr} is not reachable from {target.host} ({why}): others cannot connect to this peer; "
                    "open or forward its TCP ports (--port, --dht-port) to this machine and announce the address "
                    "others reach it at with --announce-host (peers/README.md, 'Reachability')"
                )
        return lines
    return []
