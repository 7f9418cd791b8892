"""Direct averaging (swarm.peer.direct): every member of a stage gets the same mean gradient, bit for
bit, whether it fetched every mate's whole sum or took part in a reduce-scatter; the server side
(swarm.peer.partials) refuses shards that are no shard and reduced shards of another agreement.

The members here are real executors and the real request handler (`partial_chunks`), in one
process: the "channel" hands each serialized request straight to the handler of the peer at that
address (the gRPC path itself is exercised by tests/integration/test_exact_mode.py)."""

import asyncio

import pytest
import torch

from swarm.core.errors import RequestInvalid, StateError
from swarm.peer import direct, partials
from swarm.peer.agreement import Agreement
from swarm.peer.executor import StageExecutor
from swarm.peer.executor.accumulators import flat_range, shard_bounds
from swarm.training.averaging import AveragingFailed
from swarm.training.config import OptimConfig
from swarm.training.models import build_stage
from swarm.wire.protocol import pb

GPT = {"kind": "gpt", "vocab_size": 64, "seq_len": 8, "d_model": 16, "n_layers": 2, "n_heads": 2, "d_ff": 32}


class LoopbackStub:
    def __init__(self, executor: StageExecutor) -> None:
        self.executor = executor

    def get_partial_gradient(self, request: pb.PartialRequest, timeout: float):
        return partials.partial_chunks(self.executor, pb.PartialRequest.FromString(request.SerializeToString()))


class LoopbackClients:
    """Address -> the handler of the executor serving there."""

    def __init__(self, executors: dict[str, StageExecutor]) -> None:
        self.executors = executors

    def get(self, address: str) -> LoopbackStub:
        return LoopbackStub(self.executors[address])


@pytest.fixture
def stage():
    """Four stage-mates with the same parameters, each holding a different number of samples (one none)."""
    executors = []
    for _ in range(4):
        torch.manual_seed(0)
        executors.append(StageExecutor(build_stage(GPT, 1, 2), OptimConfig()))
    torch.manual_seed(1)
    for i, ex in enumerate(executors):
        for j in range(i):  # member i holds i microbatches of 2 samples: 0, 2, 4, 6
            h, y = torch.randn(2, 8, 16) * (1 + 10 * j), torch.randint(0, 64, (2, 8))
            ex.backward(h, None, y, f"c{i}-{j}", 0, digest=7).result(timeout=30)
    yield executors
    for ex in executors:
        ex.averaging_step = None
        ex.stop()


def _average(executors: list[StageExecutor], ids: list[str], sharded: bool, shard_min_bytes: int = 0) -> list:
    frozen = [ex.call(ex.take_accumulated).result(timeout=30) for ex in executors]
    samples = {p: f.samples for p, f in zip(ids, frozen, strict=True)}
    agreement = Agreement(0, sorted((p, 0) for p in ids), {}, sum(samples.values()), samples_by_member=samples)
    clients = LoopbackClients({f"addr-{p}": ex for p, ex in zip(ids, executors, strict=True)})
    addresses = {p: f"addr-{p}" for p in ids}
    for ex in executors:
        ex.averaging_step = 0

    async def member(ex: StageExecutor, own, peer_id: str):
        publish = ex.keep_reduced if sharded else None
        avg = await direct.average_direct(
            own, peer_id, agreement, addresses, samples, clients, "run", 1, ex.params, 10.0, publish, shard_min_bytes
        )
        assert avg.sharded == (sharded and 4 * sum(p.numel() for p in ex.params) >= shard_min_bytes)
        return avg.mean

    async def everyone():
        return await asyncio.gather(*(member(*m) for m in zip(executors, frozen, ids, strict=True)))

    means = asyncio.run(everyone())
    for ex in executors:
        ex.call(ex.unfreeze).result(timeout=30)
    return means


def test_a_reduce_scatter_gives_every_member_the_same_mean_as_whole_sums_bit_for_bit(stage):
    ids = ["peer-b", "peer-d", "peer-a", "peer-c"]
    whole = _average(stage, ids, sharded=False)
    sharded = _average(stage, ids, sharded=True)
    assert all(ex.reduced_shard is not None and ex.reduced_shard.count == 4 for ex in stage)
    assert sorted(ex.reduced_shard.index for ex in stage) == [0, 1, 2, 3]
    for mean in whole + sharded:
        assert all(torch.equal(a, b) for a, b in zip(mean, whole[0], strict=True))
    # and it is the mean: 12 samples' summed gradients over 12
    total = [sum(ex.acc.pending(0).grads[k] for ex in stage[1:]) for k in range(len(stage[0].params))]
    assert all(torch.allclose(m, t / 12, rtol=1e-5, atol=1e-7) for m, t in zip(whole[0], total, strict=True))


def test_a_gradient_below_the_size_threshold_is_averaged_whole(stage):
    """Below --averaging-shard-min-mb the extra round trip costs more than the bytes saved: whole sums."""
    big = 4 * sum(p.numel() for p in stage[0].params) + 1
    means = _average(stage, ["a", "b", "c", "d"], sharded=True, shard_min_bytes=big)
    assert all(ex.reduced_shard is None for ex in stage)
    assert all(torch.equal(a, b) for m in means for a, b in zip(m, means[0], strict=True))


def test_shards_cover_the_flat_vector_once():
    for numel, count in [(10, 3), (7, 4), (1000, 1), (3, 3)]:
        bounds = shard_bounds(numel, count)
        assert bounds[0][0] == 0 and bounds[-1][1] == numel
        assert all(a[1] == b[0] for a, b in zip(bounds, bounds[1:], strict=False))
    grads = [torch.arange(6.0).view(2, 3), torch.arange(6.0, 10.0)]
    assert flat_range(grads, 4, 8).tolist() == [4.0, 5.0, 6.0, 7.0]


def test_a_request_for_no_shard_is_refused(stage):
    async def ask(**fields):
        request = pb.PartialRequest(step=0, frozen=True, **fields)
        return [chunk async for chunk in partials.partial_chunks(stage[1], request)]

    for fields in [{"shard_index": 3, "shard_count": 3}, {"shard_index": 1}, {"shard_count": 5000}]:
        with pytest.raises(RequestInvalid):
            asyncio.run(ask(**fields))


def test_a_reduced_shard_of_another_agreement_is_never_handed_out(stage, monkeypatch):
    """A retried round (other members) asks by its own digest: the shard reduced for the first one
    is refused after the wait, not mistaken for it."""
    monkeypatch.setattr(partials, "REDUCED_WAIT_S", 0.1)
    ids = ["a", "b", "c", "d"]
    _average(stage, ids, sharded=True)
    held = stage[1].reduced_shard

    async def ask(agreement: bytes, index: int):
        request = pb.PartialRequest(step=0, reduced=True, shard_index=index, shard_count=4, agreement=agreement)
        return [chunk async for chunk in partials.partial_chunks(stage[1], request)]

    assert asyncio.run(ask(held.agreement, held.index))  # the agreed one is served
    with pytest.raises(partials.PartialUnavailable):
        asyncio.run(ask(b"another agreement", held.index))
    with pytest.raises(partials.PartialUnavailable):
        asyncio.run(ask(held.agreement, (held.index + 1) % 4))


def test_a_mate_answering_with_the_wrong_shard_fails_the_round():
    with pytest.raises(StateError, match="shard"):
        partials.decode_flat(
            {"step": 0, "samples": 2, "dtype": "float32", "shard": [1, 3]}, b"\0" * 8, 0, 2, "float32", [0, 3]
        )
    with pytest.raises(StateError, match="shard"):  # an old peer that ignores the shard fields sends the whole sum
        partials.decode_flat({"step": 0, "samples": 2, "dtype": "float32"}, b"\0" * 8, 0, 2, "float32", [0, 3])


def test_a_member_that_is_gone_fails_the_round_for_its_mates(stage):
    frozen = [ex.call(ex.take_accumulated).result(timeout=30) for ex in stage]
    samples = {p: f.samples for p, f in zip("abcd", frozen, strict=True)}
    agreement = Agreement(0, [(p, 0) for p in "abcd"], {}, 12, samples_by_member=samples)
    clients = LoopbackClients({f"addr-{p}": ex for p, ex in zip("abc", stage[:3], strict=True)})  # d is gone
    stage[0].averaging_step = 0
    addresses = {p: f"addr-{p}" for p in "abcd"}
    with pytest.raises(AveragingFailed, match="direct averaging for step 0"):
        asyncio.run(
            direct.average_direct(
                frozen[0],
                "a",
                agreement,
                addresses,
                samples,
                clients,
                "run",
                1,
                stage[0].params,
                1.0,
                publish=lambda shard: setattr(stage[0], "reduced_shard", shard),
            )  # fmt: skip
        )
