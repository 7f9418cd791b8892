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


def check_settings(cfg: PeerConfig, reachable: bool = True) -> None:
    """Every check that needs no DHT: raises the first problem found."""
    resolve_device(cfg.device)
    targets = parse_maddrs(cfg.initial_peers)
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
