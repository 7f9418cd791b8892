"""The `swarm` command: the roles of a swarm (`roles`: coordinator, peer, trainer), a local swarm and
the tools that look at one (`tools`: local, status, export), the simulator (swarm.sim.cli)."""

from __future__ import annotations

import argparse
import faulthandler
import signal
import sys

from swarm.core.errors import ConfigError

EPILOG = """\
A local demo:       swarm local
Several terminals:  swarm coordinator --run-id demo          (prints the --initial-peers to use)
                    swarm peer --run-id demo --initial-peers /ip4/127.0.0.1/tcp/PORT/p2p/ID
                    swarm trainer --run-id demo --initial-peers ... --steps 100
"""


def make_parser() -> argparse.ArgumentParser:
    # imported here: the roles pull in torch and hivemind, which `swarm sim` does without (see main)
    from swarm.cli.compose import add_compose_parser
    from swarm.cli.roles import add_coordinator_parser, add_peer_parser, add_trainer_parser
    from swarm.cli.tools import (
        add_chaos_parser,
        add_dashboard_parser,
        add_export_parser,
        add_ledger_parser,
        add_local_parser,
        add_status_parser,
    )

    parser = argparse.ArgumentParser(
        prog="swarm",
        description="SWARM-parallel training on a swarm of unreliable machines.",
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--log-level", default=None, help="DEBUG, INFO (default), WARNING")
    sub = parser.add_subparsers(dest="command", required=True)
    add_coordinator_parser(sub)
    add_peer_parser(sub)
    add_trainer_parser(sub)
    add_local_parser(sub)
    add_status_parser(sub)
    add_ledger_parser(sub)
    add_chaos_parser(sub)
    add_dashboard_parser(sub)
    add_export_parser(sub)
    add_compose_parser(sub)
    from swarm.sim.cli import add_sim_parser  # the simulator imports no torch or hivemind at all

    add_sim_parser(sub)
    return parser


def make_sim_parser() -> argparse.ArgumentParser:
    """`swarm sim` alone: the simulator imports neither torch nor hivemind, so its start-up takes a
    fraction of a second instead of the seconds the roles' imports take."""
    from swarm.sim.cli import add_sim_parser

    parser = argparse.ArgumentParser(prog="swarm")
    add_sim_parser(parser.add_subparsers(dest="command", required=True))
    return parser


def main(argv: list[str] | None = None) -> int:
    """Run one subcommand. A user's mistake (ConfigError, from wherever it is found) ends here: one line on
    stderr that names the problem and the fix, exit code 2, no traceback; every command stops what it
    started before the error reaches this point."""
    argv = sys.argv[1:] if argv is None else list(argv)
    parser = make_sim_parser() if argv[:1] == ["sim"] else make_parser()
    args = parser.parse_args(argv)
    # `kill -USR1 PID` writes every thread's stack to the process's stderr (its log file under
    # `swarm local`): for a process that seems stuck, without stopping it
    try:
        faulthandler.register(signal.SIGUSR1, all_threads=True)
    except (OSError, ValueError):  # stderr without a file descriptor (main() called in-process)
        pass
    try:
        return args.func(args) or 0
    except ConfigError as e:
        print(f"swarm {args.command}: error: {e}", file=sys.stderr, flush=True)
        return 2
