"""gRPC statuses follow error types: a request's own fault is not retried elsewhere, a peer's
transient state is (a stopped executor once became INVALID_ARGUMENT by matching its message)."""

import grpc
import pytest

from swarm.core.errors import (
    ExecutorStopped,
    NonFiniteResult,
    NotServing,
    Overloaded,
    RequestInvalid,
    StepNotReady,
    WrongTarget,
)
from swarm.peer.partials import PartialUnavailable
from swarm.peer.server import status_of
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
        (KeyError("a bug"), grpc.StatusCode.INTERNAL),
        (RuntimeError("shutting down"), grpc.StatusCode.INTERNAL),  # a message decides nothing
    ],
)
def test_status_of_error_type(error, code):
    got, details = status_of(error)
    assert got == code
    assert details
