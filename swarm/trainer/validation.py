"""Validation: the loss of the current model on held-out samples, forward through every stage
(eval mode, nothing accumulated)."""

from __future__ import annotations

from swarm.trainer.router import Router
from swarm.training.config import RunConfig
from swarm.training.data import Dataset, val_indices
from swarm.wire import codec
from swarm.wire.protocol import pb
from swarm.wire.tensors import WireTensor


async def validation_loss(
    router: Router, run: RunConfig, dataset: Dataset, samples: int, wire_codec: int, trainer_id: str
) -> float:
    indices = val_indices(dataset, samples)
    total, count = 0.0, 0
    for start in range(0, len(indices), run.microbatch):
        part = indices[start : start + run.microbatch]
        x, y = dataset.val(part)
        cur = WireTensor.encode(x, wire_codec)
        for k in range(run.num_stages):
            req = pb.ForwardRequest(
                request_id=f"{trainer_id}:val:{start}:{k}",
                run_id=run.run_id,
                stage=k,
                reply_codec=wire_codec,
                validation=True,
            )
            if k == run.num_stages - 1:
                req.targets.CopyFrom(codec.to_proto(codec.encode(y, pb.CODEC_NONE)))
            response, output, _ = await router.call(k, req, {"input": cur}, len(part), "forward")
            if k < run.num_stages - 1:
                cur = output
            else:
                total += float(response.loss) * len(part)
                count += len(part)
    return total / max(1, count)
