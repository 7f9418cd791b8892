"""Gradient averaging among the peers of one stage, with hivemind's DecentralizedAverager.

Each peer puts the mean gradient of its own samples into the averager and calls a step weighted by
its number of samples; the all-reduce leaves every member with the sample-weighted mean, i.e. the
mean gradient over all the stage's samples: exactly what one process would compute on the whole
global batch. A peer with no samples joins with weight 0 and receives the others' mean.

One averager per peer process (one hivemind identity per process); it is rebuilt when the peer
moves to another stage, since the averaged tensors have that stage's shapes.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

import torch
from hivemind.averaging import DecentralizedAverager

from swarm.dht import die_with_parent

logger = logging.getLogger(__name__)


class AveragingFailed(RuntimeError):
    pass


class _StageAverager(DecentralizedAverager):
    """DecentralizedAverager that dies with its peer and whose group size can follow the stage."""

    def run(self) -> None:
        die_with_parent()  # a SIGKILLed peer must not leave its averager serving
        super().run()

    async def _set_target_group_size(self, size: int) -> None:
        # Runs in the averager's process (dispatched through its pipe like hivemind's own methods).
        # A target equal to the number of live stage peers lets the group start the moment it is
        # full instead of waiting out the whole matchmaking window.
        self._matchmaking.target_group_size = size
        self._matchmaking.potential_leaders.target_group_size = size

    def set_target_group_size(self, size: int) -> None:
        self._outer_pipe.send(("_set_target_group_size", [], dict(size=size)))


@dataclass(frozen=True)
class AveragingConfig:
    matchmaking_time: float = 0.5  # how long a group leader waits for followers
    request_timeout: float = 0.25
    step_timeout: float = 10.0  # to find a group
    allreduce_timeout: float = 60.0  # once the group is formed
    # A member silent for this long is excluded and its part of the average is lost (hivemind then
    # returns a partial average; the stage's fingerprint check repairs the divergence). Generous,
    # because a loaded machine can pause a process for seconds.
    next_chunk_timeout: float = 15.0


@dataclass
class AveragedGradient:
    mean: list[torch.Tensor]
    samples: int  # samples the group's gradient covers
    group_size: int
    seconds: float


class StageAverager:
    def __init__(self, dht, run_id: str, stage: int, params: list[torch.Tensor], cfg: AveragingConfig) -> None:
        self.cfg = cfg
        self.prefix = f"{run_id}_stage{stage}_grads"
        self._target = 0
        self.averager = _StageAverager(
            [torch.zeros_like(p, device="cpu") for p in params],
            dht,
            prefix=self.prefix,
            start=True,
            target_group_size=None,
            min_group_size=2,
            min_matchmaking_time=cfg.matchmaking_time,
            request_timeout=cfg.request_timeout,
            allreduce_timeout=cfg.allreduce_timeout,
            next_chunk_timeout=cfg.next_chunk_timeout,
            allow_state_sharing=False,  # state travels over our gRPC GetState, not hivemind's RPC
        )

    def average(self, grads_sum: list[torch.Tensor], samples: int, step: int, group_size: int) -> AveragedGradient:
        """All-reduce this peer's gradient (the gradient of the summed loss over `samples`) with its
        stage-mates'. Blocking; raises AveragingFailed when no consistent group forms in time."""
        start = time.monotonic()
        if group_size != self._target:
            self.averager.set_target_group_size(group_size)
            self._target = group_size
        with self.averager.get_tensors() as tensors:
            for buf, g in zip(tensors, grads_sum, strict=True):
                buf.copy_(g.detach().cpu()).div_(max(1, samples))
        try:
            gathered = self.averager.step(
                gather={"step": int(step), "samples": int(samples)},
                weight=float(samples),
                timeout=self.cfg.step_timeout,
                allow_retries=True,
            )
        except Exception as e:  # noqa: BLE001 - hivemind raises several kinds; all mean "no average"
            raise AveragingFailed(f"averaging for step {step} failed: {e!r}") from None
        if not gathered:
            raise AveragingFailed(f"averaging for step {step} found no group")
        steps = {int(g["step"]) for g in gathered.values()}
        if steps != {step}:
            raise AveragingFailed(f"averaging group mixed steps {sorted(steps)} (this peer: {step})")
        total = sum(int(g["samples"]) for g in gathered.values())
        if total <= 0:
            raise AveragingFailed(f"averaging group for step {step} holds no samples")
        with self.averager.get_tensors() as tensors:
            mean = [t.detach().clone() for t in tensors]
        if not all(torch.isfinite(t).all() for t in mean):
            raise AveragingFailed(f"averaged gradient for step {step} is not finite")
        return AveragedGradient(mean, total, len(gathered), time.monotonic() - start)

    def shutdown(self) -> None:
        try:
            self.averager.shutdown()
        except Exception:  # noqa: BLE001
            logger.debug("averager shutdown raised", exc_info=True)


def local_mean(grads_sum: list[torch.Tensor], samples: int) -> list[torch.Tensor]:
    return [g / max(1, samples) for g in grads_sum]
