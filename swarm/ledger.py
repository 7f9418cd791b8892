"""`swarm ledger`: check that every sample entered every stage's parameters exactly once.

It reads each stage's ledger from its live peers (GetLedger; every peer of a stage carries the
stage's ledger with its state) and, with --ledger-dir, the peers' own ledger files (dead peers'
included); it compares them with what the trainers assigned: their sample logs (--sample-log of
`swarm trainer`; sample indices checked by digest), or else the run's plan (every trainer's share of
every step, split into microbatches: contribution ids and sample counts checked). It prints lost,
duplicated and misplaced contributions by stage and step; exit code 1 when any.
"""

from __future__ import annotations

import asyncio
import glob
import json
import logging
from pathlib import Path

from swarm.cluster.authority import join_run
from swarm.cluster.ledger import fetch_ledger
from swarm.cluster.view import SwarmView
from swarm.core.errors import ConfigError
from swarm.dht.node import SwarmDHT
from swarm.policy.ledger import Assignment, LedgerEntry, LedgerReport, check, planned, samples_digest
from swarm.training.config import RunConfig
from swarm.wire.pool import ClientPool

logger = logging.getLogger(__name__)

PAGE_STEPS = 4096
FETCH_TIMEOUT_S = 30.0
CONFIG_TIMEOUT_S = 30.0


async def _stage_entries(view: SwarmView, clients: ClientPool, run_id: str, stage: int) -> list[LedgerEntry]:
    """Every live peer's entries of `stage` (they should agree; the check says if not)."""
    entries: list[LedgerEntry] = []
    for peer in view.stage_peers(stage):
        client, from_step = clients.get(peer.load.address), 0
        try:
            while True:
                page = await fetch_ledger(client, run_id, stage, from_step, FETCH_TIMEOUT_S, PAGE_STEPS)
                entries += page
                if len(page) < PAGE_STEPS:
                    break
                from_step = page[-1].step + 1
        except Exception as e:  # noqa: BLE001 - another peer of the stage may answer
            logger.warning("ledger of stage %d from peer %s: %s", stage, peer.peer_id[-6:], e)
    return entries


async def collect(
    run_id: str, initial_peers: list[str], run_key: str | None = None, invite: str | None = None
) -> tuple[RunConfig, list[LedgerEntry]]:
    """The run config and every live peer's ledger entries."""
    dht = SwarmDHT(run_id, initial_peers, client_mode=True)
    clients = ClientPool()
    loop = asyncio.get_running_loop()
    try:
        signed, keeper = await loop.run_in_executor(
            None, join_run, dht, CONFIG_TIMEOUT_S, run_key, invite, "observer", clients
        )
        run = signed.run
        view = SwarmView(dht, run.num_stages, clients)
        await view.refresh_dht()
        await view.poll_info(None)
        entries = []
        for stage in range(run.num_stages):
            entries += await _stage_entries(view, clients, run_id, stage)
        return run, entries
    finally:
        await clients.close()
        await loop.run_in_executor(None, dht.shutdown)


def read_ledger_dir(folder: str | Path) -> list[LedgerEntry]:
    """The entries peers appended to their --ledger-dir files."""
    entries = []
    for path in sorted(Path(folder).glob("*.jsonl")):
        for line in path.read_text().splitlines():
            if line.strip():
                entries.append(LedgerEntry.from_json(line))
    return entries


def read_sample_logs(patterns: list[str]) -> list[Assignment]:
    """What the trainers assigned, from their sample logs (a restarted trainer logs the
    contributions it runs again once more: the same ids with the same samples)."""
    found: dict[str, Assignment] = {}
    paths = sorted({p for pattern in patterns for p in glob.glob(pattern)})
    if not paths:
        raise ConfigError(f"no sample log matches {patterns}")
    for path in paths:
        for line in Path(path).read_text().splitlines():
            rec = json.loads(line)
            indices = [int(i) for i in rec["indices"]]
            found[rec["cid"]] = Assignment(rec["cid"], int(rec["step"]), len(indices), samples_digest(indices))
    return list(found.values())


def plan_of(run: RunConfig, steps: int) -> list[Assignment]:
    shares = [run.trainer_share(i) for i in range(run.num_trainers)]
    return planned(shares, run.microbatch, steps)


def check_run(run: RunConfig, entries: list[LedgerEntry], assignments: list[Assignment] | None = None) -> LedgerReport:
    """The ledger check of a run: against the trainers' logs if given, else against the plan."""
    if assignments is None:
        through = min((max((e.step for e in entries if e.stage == k), default=-1) + 1) for k in range(run.num_stages))
        assignments = plan_of(run, through)
    return check(entries, assignments, run.num_stages)
