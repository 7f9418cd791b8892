"""Typed errors, by whose fault and what the caller should do. The gRPC server maps these types
(never their messages) to status codes (swarm.peer.statuses.status_of): a request's own fault is not
worth retrying elsewhere, a peer's transient state is."""

from __future__ import annotations


class SwarmError(Exception):
    """Base of the errors below."""


class RequestInvalid(SwarmError, ValueError):
    """The request itself is wrong (shape, dtype, NaN, malformed bytes): INVALID_ARGUMENT.
    Sending it to another peer would fail the same way."""


class RequestTooLarge(RequestInvalid):
    """The request exceeds a size limit: RESOURCE_EXHAUSTED."""


class NonFiniteResult(RequestInvalid):
    """The stage produced NaN or infinity for this request; nothing was accumulated."""


class WrongTarget(SwarmError):
    """The request is for another run or stage than this peer serves (it moved): FAILED_PRECONDITION."""


class NotServing(SwarmError):
    """The peer cannot take this request now (joining, moving, shutting down): UNAVAILABLE.
    Another peer of the stage can."""


class ExecutorStopped(NotServing):
    """The stage's compute thread was stopped: the peer is leaving the stage or shutting down."""


class StepNotReady(NotServing):
    """The request is for a step this peer has not reached: further ahead than it takes (it is behind
    its stage: it just entered it, or was paused), or, in exact mode, not reached within the wait."""


class StepClosed(SwarmError):
    """A backward for an update this peer has frozen (its stage is agreeing on it and averaging):
    ABORTED. The trainer retries soon; the update may be unfrozen, or the request turn out to be a
    duplicate."""


class StageBehind(SwarmError):
    """A request for a step further ahead than this peer and every mate it knows of take: the stage is
    behind the run (restored from an older checkpoint after all its peers died, say) and catches up
    as the trainers replay the gradients it lost: ABORTED, the trainer tries again in a moment, for a
    bounded time. (Refused as invalid, the microbatch was dropped and the step never completed.)"""


class LateContribution(RequestInvalid):
    """A backward for an update this stage already applied without it (it cannot be applied exactly
    once any more): INVALID_ARGUMENT, and the ledger shows it lost."""


class InputNotKept(SwarmError):
    """A backward sent without its input (BackwardRequest.kept_token) to a peer that no longer holds the
    forward's activations it names (evicted, aged out, the parameters changed, or another token):
    NOT_FOUND. The trainer sends it again with the input, no ban. Nothing of that part was computed or
    accumulated; a streamed request's earlier parts may have been, and the resend finds them held (on this
    peer, or through the stage's agreement on a mate) as any repeated contribution is."""


class Overloaded(SwarmError):
    """The peer's queue or a per-client bound is full: RESOURCE_EXHAUSTED, retry later or elsewhere."""


class StateError(SwarmError, ValueError):
    """A training state (download, checkpoint, mate's partial sum) that cannot be used."""


class ConfigError(SwarmError, ValueError):
    """A setting or run configuration that cannot work; the message names the fix."""
