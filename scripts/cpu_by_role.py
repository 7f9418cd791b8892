"""Where a local swarm's CPU goes, by process role: run a command (by default a `swarm local` run), sample
the CPU time of every process under it twice a second, and print each role's total when it ends.

Roles: the `swarm` subcommand of a process (peer, trainer, coordinator, local), its forked children in
order of creation (a peer's child 0 is its hivemind DHT process, child 1 its averager), and the p2pd
daemons by the role that started them. A process's last sample is its total, so a process that lives
less than half a second may be missed.

    .venv/bin/python scripts/cpu_by_role.py                      # 3 stages x 2 peers, 150 steps
    .venv/bin/python scripts/cpu_by_role.py -- swarm local --stages 2 --steps 50
"""

from __future__ import annotations

import argparse
import collections
import json
import re
import subprocess
import sys
import time

import psutil

TINY_GPT = {"kind": "gpt", "vocab_size": 256, "seq_len": 32, "d_model": 32, "n_layers": 3, "n_heads": 2, "d_ff": 64}
DEFAULT = [
    "swarm", "local", "--stages", "3", "--peers-per-stage", "2", "--steps", "150",
    "--model", json.dumps(TINY_GPT), "--global-batch", "16", "--microbatch", "4",
]  # fmt: skip


def role_of(proc: psutil.Process, known: dict[int, str]) -> str:
    cmd = " ".join(proc.cmdline())
    if "p2pd" in cmd:
        return f"p2pd of {known.get(proc.ppid(), '?')}"
    match = re.search(r"swarm\.cli (\w+)|/swarm (\w+)", cmd)
    if not match:
        return proc.name()
    role = match.group(1) or match.group(2)
    parent = known.get(proc.ppid())
    if parent is not None and parent.split()[0] == role:  # a fork of a swarm process (same command line)
        siblings = sorted(
            (c for c in psutil.Process(proc.ppid()).children() if c.cmdline() == proc.cmdline()),
            key=lambda c: c.create_time(),
        )
        return f"{role} child {[c.pid for c in siblings].index(proc.pid)}"
    return role


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("command", nargs="*", help="the command to run (after --); default: a small swarm local")
    args = parser.parse_args()
    argv = args.command or DEFAULT
    if argv[0] == "swarm":
        argv = [sys.executable, "-m", "swarm.cli", *argv[1:]]
    started = time.monotonic()
    proc = subprocess.Popen(argv, stdout=subprocess.DEVNULL)
    root = psutil.Process(proc.pid)
    roles: dict[int, str] = {}
    cpu: dict[int, float] = {}
    while proc.poll() is None:
        try:
            procs = [root, *root.children(recursive=True)]
        except psutil.Error:
            break
        for p in procs:
            try:
                if p.pid not in roles:
                    roles[p.pid] = role_of(p, roles)
                times = p.cpu_times()
                cpu[p.pid] = times.user + times.system
            except (psutil.Error, ValueError):
                continue
        time.sleep(0.5)
    wall = time.monotonic() - started
    totals: collections.Counter[str] = collections.Counter()
    counts: collections.Counter[str] = collections.Counter()
    for pid, seconds in cpu.items():
        totals[roles[pid]] += seconds
        counts[roles[pid]] += 1
    total = sum(totals.values())
    print(f"wall {wall:.1f} s, CPU {total:.1f} s ({total / wall:.2f} cores busy on average); exit {proc.returncode}")
    for role, seconds in totals.most_common():
        print(f"  {role:<26} {counts[role]:3d} process(es) {seconds:8.1f} CPU-s  {100 * seconds / total:5.1f}%")
    return proc.returncode or 0


if __name__ == "__main__":
    sys.exit(main())
