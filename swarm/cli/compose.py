"""`swarm compose-up`: a Compose file (docker/compose.yaml) run for real without Docker, each container a
process on its own host of a network lab (swarm.netlab.compose)."""

from __future__ import annotations

import argparse
import json
import sys

from swarm.core.errors import ConfigError
from swarm.core.log import setup_logging


def add_compose_parser(sub) -> None:
    p = sub.add_parser(
        "compose-up",
        help="run a Compose file's services as processes in network namespaces (no Docker; root)",
        description="Like `docker compose up --exit-code-from SERVICE`: every replica of every service runs its "
        "command on its own host of a network lab (own address, `hostname -i` works, shaped link), with the "
        "service's environment and its named volumes as folders under --workdir; ends when SERVICE exits, "
        "stops everything and exits with SERVICE's exit code. The repo's code stands for the image.",
    )
    p.add_argument("-f", "--file", default="docker/compose.yaml", help="the Compose file (default docker/compose.yaml)")
    p.add_argument("--exit-code-from", default="trainer", help="the service whose exit ends the run (default trainer)")
    p.add_argument("--netns", default="lan", metavar="PROFILE", help="network profile of the lab (default lan)")
    p.add_argument("--workdir", help="logs and volumes (default runs/compose-TIME)")
    p.add_argument("--env", action="append", default=[], metavar="KEY=VALUE", help="set a variable (repeatable)")
    p.add_argument("--timeout", type=float, default=3600.0, help="longest run, in seconds")
    p.set_defaults(func=cmd_compose_up)


def cmd_compose_up(args: argparse.Namespace) -> int:
    from swarm.netlab import NetLabError, check_available
    from swarm.netlab.compose import compose_up

    setup_logging("compose", args.log_level)
    try:
        env = dict(item.split("=", 1) for item in args.env)
    except ValueError:
        raise ConfigError(f"--env takes KEY=VALUE, got {args.env}") from None
    try:
        check_available()
        result = compose_up(args.file, args.exit_code_from, args.workdir, args.netns, env, args.timeout)
    except NetLabError as e:
        raise ConfigError(str(e)) from None
    except TimeoutError as e:  # everything was stopped and removed on the way out
        print(f"swarm compose-up: {e} (--timeout {args.timeout:.0f}); every container was stopped", file=sys.stderr)
        return 1
    summaries = {n: p.summary for n, p in result.containers.items() if p.summary is not None}
    out = {"exit_code": result.exit_code, "exited": result.exited, "lab": result.lab, "summaries": summaries}
    print(json.dumps(out))
    if result.exit_code:
        proc = result.containers[result.exited]
        print(f"{result.exited} exited with code {result.exit_code}; log {proc.log_path}:", file=sys.stderr)
        print(proc.log_tail(20), file=sys.stderr)
    return result.exit_code
