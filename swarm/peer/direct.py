"""Direct averaging for small stages: the members of an agreed update exchange their frozen
gradient sums over gRPC and compute the mean themselves, instead of hivemind's all-reduce.

For a stage of a few peers, hivemind's all-reduce (a separate averager process, p2pd, libp2p
streams, part-by-part reduction) cost 170 ms per update on the default model where the bytes take
a few milliseconds to move (scripts/bench_pipeline.py, update timeline). Here, once the stage has
agreed on update t (swarm.peer.agreement: its members, their accumulator epochs and the
contributions each holds), the members sum every member's frozen sum in the order of their peer
ids: the same additions in the same order for every element, so every member gets the same mean,
bit for bit. Each fetched sum is checked to be the one agreed (step, epoch, samples).

- Two members: each fetches the other's whole sum (float32, `GetPartialGradient` with `frozen`) and
  sums both.
- Three or more: a reduce-scatter, then an all-gather. The flat parameter vector is cut into one
  shard per member (`shard_bounds`); member i fetches shard i of every mate's frozen sum, sums them
  (its own included, in peer-id order) and keeps the result (`ReducedShard`, `reduced`), then
  fetches every mate's reduced shard. Each member receives 2 (n - 1) / n sums instead of n - 1
  (1.5 against 3 for four members: scripts/bench_overload.py) and adds n shards instead of n sums;
  the elements are the same additions in the same order as above, so the mean is the same bit for
  bit. A reduced shard is asked for by the agreement's digest, so a retried round never takes a
  shard reduced over other members.

Past `--averaging-direct-max` peers hivemind's all-reduce takes over.

A member may apply the update before a slower mate has fetched its sum or shard: the executor keeps
the last applied frozen sum (`frozen_gradient`) and its latest reduced shard. Any failure (a mate
gone, a sum not the agreed one) fails the round like an incomplete all-reduce: nothing is applied,
the stage tries again.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from swarm.peer.agreement import Agreement
from swarm.peer.executor import Accumulated
from swarm.peer.executor.accumulators import ReducedShard, flat_range, shard_bounds
from swarm.peer.partials import decode_flat
from swarm.training.averaging import AveragedGradient, AveragingFailed
from swarm.wire.blob import receive_blob
from swarm.wire.pool import ClientPool
from swarm.wire.protocol import pb

SHARDED_MIN_MEMBERS = 3  # from this many members on, a reduce-scatter (two receive the same bytes either way)
# (and from --averaging-shard-min-mb of gradient on: below it, the extra round trip costs more than the
# bytes saved. 3x4 overload run, default GPT, 1.6 MB per stage: 111 ms per update sharded, 72 ms whole)


def agreement_digest(agreement: Agreement, expected_samples: dict[str, int]) -> bytes:
    """Names what a reduced shard was reduced over: the update, its members, their epochs and sums."""
    text = json.dumps([agreement.step, agreement.members, sorted(expected_samples.items())])
    return hashlib.sha256(text.encode()).digest()[:16]


@dataclass
class DirectRound:
    """One member's direct averaging of an agreed update: what every fetch needs."""

    own_id: str
    agreement: Agreement
    addresses: dict[str, str]
    expected_samples: dict[str, int]
    clients: ClientPool
    run_id: str
    stage: int
    timeout_s: float

    @property
    def step(self) -> int:
        return self.agreement.step

    def request(self, **fields) -> pb.PartialRequest:
        return pb.PartialRequest(run_id=self.run_id, stage=self.stage, step=self.step, **fields)

    async def fetch(self, peer_id: str, request: pb.PartialRequest, numel: int, shard: list | None) -> tuple:
        """(flat float32 values or None for no samples, samples, header) of what a mate streams;
        AveragingFailed on any failure."""
        try:
            stream = self.clients.get(self.addresses[peer_id]).get_partial_gradient(request, timeout=self.timeout_s)
            header, data = await receive_blob(stream, 4 * numel + (1 << 20), "frozen gradient")
            values, samples = decode_flat(header, data, self.step, numel, "float32", shard)
        except Exception as e:  # noqa: BLE001 - any failure fails the round
            raise AveragingFailed(f"direct averaging for step {self.step}: {peer_id[-6:]}: {e}") from None
        return values, samples, header

    async def fetch_frozen(self, peer_id: str, numel: int, shard: tuple[int, int] | None) -> tuple:
        """(values, how long the mate held the request before it began averaging itself: a
        straggler's wait, not the transfer's) of a mate's frozen sum or one shard of it, checked to
        be the agreed one."""
        fields = {} if shard is None else {"shard_index": shard[0], "shard_count": shard[1]}
        values, samples, header = await self.fetch(
            peer_id, self.request(frozen=True, **fields), numel, None if shard is None else list(shard)
        )
        epoch, agreed = header.get("epoch"), dict(self.agreement.members)[peer_id]
        if epoch != agreed or samples != self.expected_samples.get(peer_id):
            raise AveragingFailed(
                f"direct averaging for step {self.step}: {peer_id[-6:]} sent epoch {epoch!r} with {samples} "
                f"samples; the stage agreed on epoch {agreed} with {self.expected_samples.get(peer_id)}"
            )
        waited = header.get("waited_ms", 0.0)
        waited_s = float(waited) / 1000 if isinstance(waited, int | float) and 0 <= waited < 1e7 else 0.0
        return values, waited_s


def _mean(flat: torch.Tensor, samples: int, params: list[torch.Tensor]) -> list[torch.Tensor]:
    flat.div_(max(1, samples))
    parts = flat.split([p.numel() for p in params])
    return [g.view(p.shape).to(p.dtype) for g, p in zip(parts, params, strict=True)]


async def _reduce(
    own: Accumulated, rnd: DirectRound, order: list[str], lo: int, hi: int, shard: tuple[int, int] | None
) -> tuple[torch.Tensor, list]:
    """(elements [lo, hi) of the stage-wide sum, the mates' straggler waits): that range of every
    mate's frozen sum (`shard`, or the whole sum), fetched and added to this peer's in peer-id order,
    the same additions in the same order on every member and in either path: bit for bit the same."""
    mates = [p for p in order if p != rnd.own_id]
    fetched = await asyncio.gather(*(rnd.fetch_frozen(p, hi - lo, shard) for p in mates))
    parts = dict(zip(mates, (values for values, _ in fetched), strict=True))
    parts[rnd.own_id] = None if not own.grads else flat_range(own.grads, lo, hi)
    total = torch.zeros(hi - lo, dtype=torch.float32)
    for peer_id in order:
        if parts[peer_id] is not None:
            total.add_(parts[peer_id])
    return total, [w for _, w in fetched]


async def _sharded(
    own: Accumulated, rnd: DirectRound, order: list[str], numel: int, publish: Callable[[ReducedShard], None]
) -> tuple[torch.Tensor, list]:
    """The same sum by reduce-scatter: this member reduces its shard of every member's frozen sum,
    publishes it for its mates, and gathers theirs."""
    count, index = len(order), order.index(rnd.own_id)
    bounds = shard_bounds(numel, count)
    reduced, waits = await _reduce(own, rnd, order, *bounds[index], (index, count))
    digest = agreement_digest(rnd.agreement, rnd.expected_samples)
    publish(ReducedShard(rnd.step, digest, index, count, rnd.agreement.samples, reduced))

    async def gather_shard(peer_id: str) -> torch.Tensor:
        j = order.index(peer_id)
        request = rnd.request(reduced=True, shard_index=j, shard_count=count, agreement=digest)
        values, samples, _ = await rnd.fetch(peer_id, request, bounds[j][1] - bounds[j][0], [j, count])
        if values is None or samples != rnd.agreement.samples:
            raise AveragingFailed(f"direct averaging for step {rnd.step}: {peer_id[-6:]}'s shard of {samples} samples")
        return values

    mates = [p for p in order if p != rnd.own_id]
    shards = dict(zip(mates, await asyncio.gather(*(gather_shard(p) for p in mates)), strict=True))
    shards[rnd.own_id] = reduced
    return torch.cat([shards[p] for p in order]), waits


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
    publish: Callable[[ReducedShard], None] | None = None,
    shard_min_bytes: int = 0,
) -> AveragedGradient:
    """The mean gradient of the agreed update over every member's frozen sum; AveragingFailed
    unless every mate's sum is the agreed one. `publish` keeps this member's reduced shard where
    its mates fetch it (the executor's `reduced_shard`): without it, or for a gradient of fewer
    than `shard_min_bytes` in float32, no reduce-scatter."""
    start = time.monotonic()
    order = sorted(dict(agreement.members))
    missing = [p[-6:] for p in order if p != own_id and p not in addresses]
    if missing:
        raise AveragingFailed(f"direct averaging for step {agreement.step}: no address for {', '.join(missing)}")
    if own.samples != expected_samples.get(own_id):
        raise AveragingFailed(f"direct averaging for step {agreement.step}: this peer's sum is not the agreed one")
    rnd = DirectRound(own_id, agreement, addresses, expected_samples, clients, run_id, stage, timeout_s)
    numel = sum(p.numel() for p in params)
    sharded = publish is not None and len(order) >= SHARDED_MIN_MEMBERS and 4 * numel >= shard_min_bytes
    if sharded:
        total, waits = await _sharded(own, rnd, order, numel, publish)
    else:
        total, waits = await _reduce(own, rnd, order, 0, numel, None)
    mean = _mean(total, agreement.samples, params)
    return AveragedGradient(mean, tuple(order), time.monotonic() - start, max(waits, default=0.0), sharded)
