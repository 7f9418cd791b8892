"""Reading a stage's ledger from one of its peers (GetLedger): trainers release the gradients they
hold once it shows them applied, and `swarm ledger` checks it against what the trainers assigned."""

from __future__ import annotations

from swarm.core.errors import StateError
from swarm.policy.ledger import LedgerEntry
from swarm.wire.blob import receive_blob
from swarm.wire.client import StageClient
from swarm.wire.protocol import pb

DEFAULT_LEDGER_STEPS = 256
MAX_LEDGER_BYTES = 256 << 20


async def fetch_ledger(
    client: StageClient,
    run_id: str,
    stage: int,
    from_step: int,
    timeout_s: float,
    max_steps: int = DEFAULT_LEDGER_STEPS,
) -> list[LedgerEntry]:
    request = pb.LedgerRequest(run_id=run_id, stage=stage, from_step=from_step, max_steps=max_steps)
    _, data = await receive_blob(client.get_ledger(request, timeout=timeout_s), MAX_LEDGER_BYTES, "ledger")
    entries = []
    for line in bytes(data).decode().splitlines():
        try:
            entries.append(LedgerEntry.from_json(line))
        except (ValueError, KeyError, TypeError, IndexError) as e:
            raise StateError(f"malformed ledger entry from stage {stage}: {e}") from None
    return entries
