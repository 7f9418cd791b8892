"""gRPC statuses follow error types: a request's own fault is not retried elsewhere, a peer's
transient state is (a stopped executor once became INVALID_ARGUMENT by matching its message)."""

import grpc
import pytest

from swarm.core.errors import (
    ExecutorStopped,
    InputNotKept,
    NonFiniteResult,
    NotServing,
    Overloaded,
    RequestInvalid,
    StageBehind,
    StepNotReady,
    WrongTarget,
)
from swarm.peer.partials import PartialUnavailable
from swarm.peer.statuses import status_of
from swarm.wire.codec import MessageTooLarge, WireError


@pytest.mark.parametrize(
    ("error", "code"),
    [
        (RequestInvalid("bad shape"), grpc.StatusCode.INVALID_ARGUMENT),
        (WireError("malformed"), grpc.StatusCode.INVALID_ARGUMENT),
        (NonFiniteResult("nan"), grpc.StatusCode.INVALID_ARGUMENT),
        (MessageTooLarge("too big"), grpc.StatusCode.RESOURCE_EXHAUSTED),
        (Overloaded("queue full"), grpc.StatusCode.RESOURCE_EXHAUSTED),
        (WrongTarget("other stage"), grpc.StatusCode.FAILED_PRECONDITION),
        (PartialUnavailable("not pending"), grpc.StatusCode.FAILED_PRECONDITION),
        (NotServing("joining"), grpc.StatusCode.UNAVAILABLE),
        (ExecutorStopped("stage executor is stopped"), grpc.StatusCode.UNAVAILABLE),
        (StepNotReady("behind"), grpc.StatusCode.UNAVAILABLE),
        (StageBehind("the stage is behind the run"), grpc.StatusCode.ABORTED),
        (InputNotKept("the kept forward was evicted"), grpc.StatusCode.NOT_FOUND),
        (KeyError("a bug"), grpc.StatusCode.INTERNAL),
        (RuntimeError("shutting down"), grpc.StatusCode.INTERNAL),  # a message decides nothing
    ],
)
def test_status_of_error_type(error, code):
    got, details = status_of(error)
    assert got == code
    assert details


@pytest.mark.parametrize(
    ("step", "mates_step", "error"),
    [
        (7, 5, None),  # within this peer's bound (5 + 2)
        (8, 5, StageBehind),  # ahead of the whole stage: it is behind the run (restored from a checkpoint)
        (60, 59, StepNotReady),  # this peer is behind its stage (it just entered it): a mate takes it
        (-1, 59, RequestInvalid),
    ],
)
def test_a_step_too_far_ahead_goes_to_a_mate_or_waits_for_the_stage(step, mates_step, error):
    """A peer at step 5 (it moved in and downloaded a state a moment ago, or its stage was restored
    from an older checkpoint) whose mates are at `mates_step`: a request it cannot take is refused as
    a peer's transient state (retried on a mate) when the stage takes it, and as "the stage is
    behind, try again soon" when no mate does. Refused as invalid, a trainer dropped such a
    microbatch and the stage waited for its samples for ever (after a whole stage was restored from
    a checkpoint three steps back)."""
    import asyncio
    from types import SimpleNamespace

    from swarm.peer.server import StageService
    from swarm.peer.serving import Limits, ServingState
    from swarm.wire.protocol import pb

    serving = ServingState("run", "peer", "0")
    serving.mates_step = mates_step
    service = StageService(serving, Limits(max_steps_ahead=2))
    msg = pb.ForwardRequest(run_id="run", stage=0, step=step, reply_codec=pb.CODEC_NONE)

    async def no_parts():
        return
        yield

    async def first():
        parts = service.compute("forward", msg, SimpleNamespace(step=5), None, None, no_parts(), {})
        return [p async for p in parts]

    if error is None:
        assert asyncio.run(first()) == []
    else:
        with pytest.raises(error) as caught:
            asyncio.run(first())
        assert type(caught.value) is error
