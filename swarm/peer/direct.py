"""Direct averaging for small stages: each peer fetches its mates' frozen gradient sums over gRPC
and computes the mean itself, instead of hivemind's all-reduce.

For a stage of a few peers, hivemind's all-reduce (a separate averager process, p2pd, libp2p
streams, part-by-part reduction) cost 170 ms per update on the default model where the bytes take
a few milliseconds to move (scripts/bench_pipeline.py, update timeline). Here, once the stage has
agreed on update t (swarm.peer.agreement: its members, their accumulator epochs and the
contributions each holds), every member fetches every other member's frozen sum (float32,
`GetPartialGradient` with `frozen`), checks it is the one agreed (step, epoch, samples), and sums all
of them in the order of their peer ids, its own included: the same additions in the same order on
every member, so every member gets the same mean, bit for bit. Traffic is n - 1 sums per peer, so
past `--averaging-direct-max` peers the all-reduce (n-independent per peer) takes over.

A member may apply the update before a slower mate has fetched its sum: the executor keeps the
last applied frozen sum for that (`frozen_gradient`). Any failure (a mate gone, a sum not the agreed
one) fails the round like an incomplete all-reduce: nothing is applied, the stage tries again.
"""

from __future__ import annotations

import asyncio
import time

import torch

from swarm.core.errors import StateError
from swarm.peer.agreement import Agreement
from swarm.peer.executor import Accumulated
from swarm.peer.partials import decode_partial
from swarm.training.averaging import AveragedGradient, AveragingFailed
from swarm.wire.blob import receive_blob
from swarm.wire.pool import ClientPool
from swarm.wire.protocol import pb


async def fetch_frozen(
    clients: ClientPool, address: str, run_id: str, stage: int, step: int, params: list[torch.Tensor], timeout_s: float
) -> tuple[Accumulated, int, float]:
    """A mate's frozen sum for update `step`, its accumulator epoch, and how long the mate held the
    request until it began averaging the update itself (seconds: a straggler's, not the transfer's)."""
    request = pb.PartialRequest(run_id=run_id, stage=stage, step=step, frozen=True)
    stream = clients.get(address).get_partial_gradient(request, timeout=timeout_s)
    max_bytes = 4 * sum(p.numel() for p in params) + (1 << 20)
    header, data = await receive_blob(stream, max_bytes, "frozen gradient")
    epoch = header.get("epoch")
    if not isinstance(epoch, int):
        raise StateError(f"frozen gradient without an accumulator epoch: {epoch!r}")
    waited = header.get("waited_ms", 0.0)
    waited_s = float(waited) / 1000 if isinstance(waited, int | float) and 0 <= waited < 1e7 else 0.0
    return decode_partial(header, data, params, step, dtype="float32"), epoch, waited_s


async def average_direct(
    own: Accumulated,
    own_id: str,
    agreement: Agreement,
    addresses: dict[str, str],
    expected_samples: dict[str, int],
    clients: ClientPool,
    run_id: str,
    stage: int,
    params: list[torch.Tensor],
    timeout_s: float,
) -> AveragedGradient:
    """The mean gradient of the agreed update over every member's frozen sum; AveragingFailed
    unless every mate's sum is the agreed one."""
    start = time.monotonic()
    epochs = dict(agreement.members)
    mates = [p for p in epochs if p != own_id]
    missing = [p[-6:] for p in mates if p not in addresses]
    if missing:
        raise AveragingFailed(f"direct averaging for step {agreement.step}: no address for {', '.join(missing)}")

    waits: list[float] = []

    async def one(peer_id: str) -> Accumulated:
        try:
            acc, epoch, waited_s = await fetch_frozen(
                clients, addresses[peer_id], run_id, stage, agreement.step, params, timeout_s
            )
        except Exception as e:  # noqa: BLE001 - any failure fails the round
            raise AveragingFailed(f"direct averaging for step {agreement.step}: {peer_id[-6:]}: {e}") from None
        if epoch != epochs[peer_id] or acc.samples != expected_samples.get(peer_id):
            raise AveragingFailed(
                f"direct averaging for step {agreement.step}: {peer_id[-6:]} sent epoch {epoch} with "
                f"{acc.samples} samples; the stage agreed on epoch {epochs[peer_id]} with "
                f"{expected_samples.get(peer_id)}"
            )
        waits.append(waited_s)
        return acc

    fetched = dict(zip(mates, await asyncio.gather(*(one(p) for p in mates)), strict=True))
    if own.samples != expected_samples.get(own_id):
        raise AveragingFailed(f"direct averaging for step {agreement.step}: this peer's sum is not the agreed one")
    sums = {own_id: [g.detach().to("cpu", torch.float32) for g in own.grads]}
    sums.update({p: a.grads for p, a in fetched.items()})  # float32 views of what arrived, shaped as params
    total = [torch.zeros(p.shape, dtype=torch.float32) for p in params]
    for peer_id in sorted(sums):  # the same order on every member: the same sum, bit for bit
        for buf, g in zip(total, sums[peer_id] or (), strict=False):
            buf.add_(g)
    mean = [buf.div_(max(1, agreement.samples)).to(p.dtype) for buf, p in zip(total, params, strict=True)]
    return AveragedGradient(mean, tuple(sorted(epochs)), time.monotonic() - start, max(waits, default=0.0))
