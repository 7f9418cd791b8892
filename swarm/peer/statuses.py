"""What a peer answers for each typed error (swarm.core.errors), over gRPC and over the lane: the
status code goes by the error's type, never its message; a retryable overload says so."""

from __future__ import annotations

import logging

import grpc

from swarm.core.errors import (
    InputNotKept,
    NotServing,
    Overloaded,
    RequestInvalid,
    RequestTooLarge,
    StageBehind,
    StepClosed,
    WrongTarget,
)

logger = logging.getLogger(__name__)

STATUS_OF_ERROR: dict[type[BaseException], grpc.StatusCode] = {
    RequestTooLarge: grpc.StatusCode.RESOURCE_EXHAUSTED,
    Overloaded: grpc.StatusCode.RESOURCE_EXHAUSTED,
    RequestInvalid: grpc.StatusCode.INVALID_ARGUMENT,
    WrongTarget: grpc.StatusCode.FAILED_PRECONDITION,
    NotServing: grpc.StatusCode.UNAVAILABLE,
    StepClosed: grpc.StatusCode.ABORTED,
    StageBehind: grpc.StatusCode.ABORTED,
    InputNotKept: grpc.StatusCode.NOT_FOUND,
}
RETRY_KEY = "swarm-retry"  # trailing metadata of a RESOURCE_EXHAUSTED that is worth retrying (Overloaded)


def status_of(e: BaseException) -> tuple[grpc.StatusCode, str]:
    """The gRPC status of an error, by its type (the most specific class that has one)."""
    for cls in type(e).__mro__:
        code = STATUS_OF_ERROR.get(cls)
        if code is not None:
            return code, str(e)
    logger.error("unexpected error serving a request", exc_info=e)
    return grpc.StatusCode.INTERNAL, f"internal error: {type(e).__name__}: {e}"


async def abort(context, e: BaseException):
    """Answer with the status of `e` (a retryable overload says so in the trailing metadata)."""
    code, details = status_of(e)
    metadata = ((RETRY_KEY, "1"),) if isinstance(e, Overloaded) else ()
    await context.abort(code, details, trailing_metadata=metadata)
