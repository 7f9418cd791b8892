"""Pieces every `swarm` subcommand shares: joining a run (--run-id, --initial-peers), the event
loop, and turning a user's mistake into one clear line."""

from __future__ import annotations

import argparse
import time

from swarm.core.errors import ConfigError
from swarm.core.keys import check_fingerprint
from swarm.core.preflight import parse_maddrs

INITIAL_PEERS_FILE_WAIT_S = 120.0


def check_run_key(text: str) -> str:
    try:
        return check_fingerprint(text)
    except ConfigError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def install_uvloop() -> None:
    try:
        import uvloop

        uvloop.install()
    except ImportError:  # pragma: no cover - uvloop is a dependency
        pass


def add_join_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--run-id", required=True, help="the run to join")
    p.add_argument(
        "--initial-peers", nargs="+", metavar="MULTIADDR", help="DHT multiaddrs (the coordinator prints them)"
    )
    p.add_argument(
        "--run-key",
        metavar="FINGERPRINT",
        type=check_run_key,
        help="the fingerprint of the run's key (the coordinator prints it): only a config it signed is accepted",
    )
    p.add_argument(
        "--invite",
        metavar="FILE",
        help="a private swarm's invitation (its coordinator's --invite-file): this process asks to be admitted",
    )
    p.add_argument(
        "--initial-peers-file",
        metavar="PATH",
        help="read the multiaddrs from this file (the coordinator's --maddrs-file), waiting for it to appear",
    )


def initial_peers(args: argparse.Namespace, timeout_s: float = INITIAL_PEERS_FILE_WAIT_S) -> list[str]:
    """--initial-peers (several multiaddrs in one argument, separated by spaces, are split: a systemd
    unit's `${VAR}` passes them so), or the lines of --initial-peers-file once it exists; each one is
    checked to be a multiaddr with a peer id (ConfigError with the fix otherwise)."""
    if args.initial_peers:
        peers = [m for text in args.initial_peers for m in text.split()]
        parse_maddrs(peers)
        return peers
    path = getattr(args, "initial_peers_file", None)
    if not path:
        raise ConfigError(
            "give --initial-peers MULTIADDR... (the coordinator prints them) or --initial-peers-file PATH"
        )
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            with open(path) as f:
                peers = [m for line in f if not line.lstrip().startswith("#") for m in line.split()]
            if peers:
                parse_maddrs(peers, "--initial-peers-file")
                return peers
        except FileNotFoundError:
            pass
        if time.monotonic() > deadline:
            raise ConfigError(
                f"--initial-peers-file {path} did not appear (or stayed empty) within {timeout_s:.0f} s: "
                "start the coordinator with --maddrs-file pointing there, or give --initial-peers"
            )
        time.sleep(0.5)
