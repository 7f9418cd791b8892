"""Fuzz target of every RPC handler of a real in-process `StageService` (tests/fuzz/service.py).

Cases: per handler, requests built near the stage's schema (right or wrong run, stage, step, batch,
sequence length, dtype, codec, NaN, token ids out of range, targets and output gradients that do or
do not match), headers that lie (tests/fuzz/strategies.py), streamed requests (over gRPC and in a lane
frame) whose chunk list is cut, repeated, reordered or padded, byte mutations of all of these, and plain random bytes.

Contract: the handler answers, or aborts with INVALID_ARGUMENT, RESOURCE_EXHAUSTED,
FAILED_PRECONDITION, UNAVAILABLE or ABORTED; never INTERNAL, never an exception, never past
`CALL_TIMEOUT_S`. An answer parses and holds what it says (a state that validates, a partial sum that
decodes, at most the ledger entries asked for). Afterwards nothing is left in flight, no gradient
buffer was taken for an update more than `MAX_AHEAD` steps past the peer's, and (every
`PROBE_EVERY` cases) each stage still answers a valid Forward.
"""

from __future__ import annotations

import contextlib
import logging
import random
from collections.abc import Iterator

import torch
from hypothesis import strategies as st

from swarm.cluster.ledger import DEFAULT_LEDGER_STEPS
from swarm.core.checks import all_finite
from swarm.peer.agreement import MAX_LEDGER_STEPS
from swarm.peer.partials import decode_partial
from swarm.policy.ledger import LedgerEntry
from swarm.training.state import deserialize, validate
from swarm.wire import codec, stream
from swarm.wire.blob import receive_blob
from swarm.wire.protocol import pb
from swarm.wire.tensors import WireTensor
from tests.fuzz import strategies as fs
from tests.fuzz.harness import ContractViolation, Target, signature_of
from tests.fuzz.service import (
    ALLOWED_CODES,
    BIDI,
    LANE,
    LEDGER_STEPS,
    LIMITS,
    RUN_ID,
    SPEC,
    STAGES,
    Aborted,
    fuzz_service,
)
from tests.fuzz.wire_targets import expect

MAX_AHEAD = 8  # a request may open a gradient buffer for at most this many updates past the peer's
PROBE_EVERY = 16
_cases_run = [0]


class _LastError(logging.Handler):
    """Keeps the exception the server logged for an INTERNAL status (its traceback names the bug)."""

    error: BaseException | None = None

    def emit(self, record: logging.LogRecord) -> None:
        if record.exc_info:
            self.error = record.exc_info[1]


LAST_ERROR = _LastError()


@contextlib.contextmanager
def _server_errors_kept() -> Iterator[None]:
    """The server's logged errors go to LAST_ERROR only (thousands of tracebacks would bury a run)."""
    log = logging.getLogger("swarm.peer.server")
    propagate, log.propagate = log.propagate, False
    log.addHandler(LAST_ERROR)
    try:
        yield
    finally:
        log.removeHandler(LAST_ERROR)
        log.propagate = propagate


# ---- requests ----


def mostly(good: st.SearchStrategy, bad: st.SearchStrategy, odds: int = 8) -> st.SearchStrategy:
    """`good` `odds` times out of odds + 1, else `bad` (a request wrong in one way at a time)."""
    return st.sampled_from(range(odds + 1)).flatmap(lambda i: good if i < odds else bad)  # one_of dedupes


def rarely(draw, n: int) -> bool:
    """True once in `n` draws: not for hypothesis's simplest choice, which it tries most."""
    return draw(st.sampled_from(range(n))) == n - 1


RUN_IDS = mostly(st.just(RUN_ID), st.text(max_size=12))
STEPS = mostly(st.integers(0, 2), st.integers(*fs.INT64), odds=4)
REPLY_CODECS = mostly(st.sampled_from(fs.CODEC_IDS), st.integers(4, fs.INT32[1]))
NO_MUTATION = st.just([])
MUTATIONS = mostly(NO_MUTATION, st.lists(fs._mutation, min_size=1, max_size=3), odds=3)
CONTRIBUTION_IDS = st.one_of(
    st.just(""), st.builds("t{}/{}/{}".format, st.integers(0, 3), st.integers(0, 3), st.integers(0, 8)), st.text()
)


def stage_ids(k: int) -> st.SearchStrategy[int]:
    return mostly(st.just(k), st.integers(*fs.INT32))


def _role_dtype_shape(role: str, k: int, b: int, t: int) -> tuple[torch.dtype, list[int]]:
    if role == "targets" or (role == "input" and k == 0):
        return torch.int64, [b, t]
    return torch.float32, [b, t, SPEC["d_model"]]


@st.composite
def stage_tensors(draw, role: str, k: int, b: int, t: int) -> torch.Tensor:
    """A tensor for `role` at stage k: usually of the schema's dtype and shape, else a little off."""
    dtype, shape = _role_dtype_shape(role, k, b, t)
    if rarely(draw, 10):  # off: another batch, length, width or dtype
        shape = [
            draw(st.sampled_from((0, 1, 16, 17))) if i == 0 or draw(st.booleans()) else d for i, d in enumerate(shape)
        ]
        shape = shape if draw(st.booleans()) else shape + [2]
        return draw(fs.torch_tensors(fs.ALL_DTYPES, shape))
    if dtype == torch.int64 and not rarely(draw, 4):
        return torch.randint(
            0, SPEC["vocab_size"], shape, generator=torch.Generator().manual_seed(draw(st.integers(0, 99)))
        )
    return draw(fs.torch_tensors((dtype,), shape))


@st.composite
def wire_tensors(draw, role: str, k: int, b: int, t: int) -> pb.Tensor:
    if rarely(draw, 10):
        return draw(fs.tensor_messages())
    block = draw(st.sampled_from((8, 256)))
    return fs.encode_proto(draw(stage_tensors(role, k, b, t)), draw(st.sampled_from(fs.CODEC_IDS)), block)


@st.composite
def compute_requests(draw, k: int, kind: str, with_tensors: bool = True):
    """A Forward or Backward request for stage k (tensors with data unless `with_tensors` is off)."""
    cls = pb.ForwardRequest if kind.startswith("forward") else pb.BackwardRequest
    b, t = draw(st.integers(1, 4)), draw(st.integers(1, SPEC["seq_len"]))
    msg = cls(request_id=draw(st.text(max_size=8)), run_id=draw(RUN_IDS), stage=draw(stage_ids(k)), step=draw(STEPS))
    msg.reply_codec = draw(REPLY_CODECS)
    roles = ["input"] * (not rarely(draw, 20))
    roles += ["targets"] * (k == STAGES - 1 and not rarely(draw, 20))
    if kind.startswith("backward"):
        roles += ["grad_output"] * (k < STAGES - 1 and not rarely(draw, 20))
        msg.num_samples = draw(mostly(st.just(b), st.integers(*fs.INT32)))
        msg.contribution_id = draw(CONTRIBUTION_IDS)
        msg.samples_digest = draw(st.integers(0, (1 << 64) - 1))
    else:
        msg.validation = draw(st.booleans())
    tensors = {}
    for role in roles:
        if with_tensors or role == "targets":
            getattr(msg, role).CopyFrom(draw(wire_tensors(role, k, b, t)))
        else:
            tensors[role] = draw(stage_tensors(role, k, b, t))
    return (msg, tensors, b) if not with_tensors else msg.SerializeToString()


@st.composite
def stream_requests(draw, k: int, kind: str) -> list[bytes]:
    """The chunks of a streamed request (as swarm.wire.stream sends them, in random parts), then
    perhaps cut, repeated, reordered or padded."""
    msg, tensors, b = draw(compute_requests(k, kind, with_tensors=False))
    counts = draw(st.lists(st.integers(1, 4), min_size=1, max_size=4))
    counts = counts if sum(counts) == b or rarely(draw, 6) else [b]
    codec_id = draw(st.sampled_from(fs.CODEC_IDS))
    wires = {}
    for role, tensor in tensors.items():
        if tensor.dim() and tensor.shape[0] == sum(counts) and not rarely(draw, 10):
            wires[role] = WireTensor.encode(tensor, codec_id, counts)
        else:
            getattr(msg, role).CopyFrom(draw(fs.tensor_messages()))
            getattr(msg, role).ClearField("data")
    if "input" in wires and not rarely(draw, 10):
        return draw(fs.mutated_chunks(_stream_messages(msg, wires, counts)))
    header = pb.Chunk(header=msg.SerializeToString(), parts=draw(st.lists(st.integers(*fs.INT32), max_size=4)))
    payload = [header.SerializeToString()] + [draw(st.binary(max_size=64)) for _ in range(draw(st.integers(0, 4)))]
    return draw(fs.mutated_chunks(payload))


def _stream_messages(msg, wires: dict[str, WireTensor], counts: list[int]) -> list[bytes]:
    """As swarm.wire.stream.request_messages sends them, but in the parts `wires` hold (`counts`)."""
    names = [n for n in stream.STREAMED_FIELDS[type(msg)] if n in wires]
    for name in names:
        field, wire = getattr(msg, name), wires[name]
        field.dtype, field.codec, field.block_size = wire.dtype, wire.codec, wire.block_size
        field.shape[:] = wire.shape
    out = [pb.Chunk(header=msg.SerializeToString(), parts=counts).SerializeToString()]
    for i in range(len(counts)):
        for name in names:
            part = wires[name].parts[i]
            out.append(bytes(part.data))
            if wires[name].codec == pb.CODEC_INT8_BLOCK:
                out.append(bytes(part.scales))
    return out


def _blob_request(k: int, method: str) -> st.SearchStrategy[bytes]:
    if method == "get_state":
        request = st.builds(pb.StateRequest, run_id=RUN_IDS, stage=stage_ids(k))
    elif method in ("get_partial_gradient", "get_contributions"):
        cls = pb.PartialRequest if method == "get_partial_gradient" else pb.ContributionsRequest
        request = st.builds(cls, run_id=RUN_IDS, stage=stage_ids(k), step=STEPS)
    else:
        steps = st.one_of(st.integers(0, 14), st.integers(*fs.INT64))
        limits = st.one_of(st.integers(-3, 20), st.integers(*fs.INT32))
        request = st.builds(pb.LedgerRequest, run_id=RUN_IDS, stage=stage_ids(k), from_step=steps, max_steps=limits)
    return st.tuples(request.map(lambda m: m.SerializeToString()), MUTATIONS).map(lambda t: fs.apply_mutations(*t))


def payloads(k: int, method: str) -> st.SearchStrategy:
    if method in BIDI or method in LANE:
        return mostly(stream_requests(k, method), st.lists(st.binary(max_size=64), max_size=5))
    if method == "info":
        return st.binary(max_size=32)
    if method in ("forward", "backward"):
        built = st.tuples(compute_requests(k, method), MUTATIONS).map(lambda t: fs.apply_mutations(*t))
        return mostly(built, st.binary(max_size=200))
    return mostly(_blob_request(k, method), st.binary(max_size=40))


def handler_cases() -> st.SearchStrategy:
    methods = ("info", "forward", "backward", "forward_stream", "backward_stream", "forward_lane", "backward_lane")
    methods += ("get_state", "get_partial_gradient", "get_contributions", "get_ledger")
    return st.tuples(st.integers(0, STAGES - 1), st.sampled_from(methods)).flatmap(
        lambda km: payloads(*km).map(lambda p: (km[0], km[1], p))
    )


# ---- the contract ----


def _blob(out: list[bytes]) -> tuple[dict, bytes]:
    async def chunks():
        for chunk in out:
            yield chunk

    header, data = fuzz_service().loop.run_until_complete(receive_blob(chunks(), 1 << 26, "answer"))
    return header, bytes(data)


def _check_blob_answer(k: int, method: str, payload: bytes, out: list[bytes]) -> None:
    executor = fuzz_service().stages[k].executor
    header, data = _blob(out)
    if method == "get_state":
        validate(deserialize(data), executor.module)
    elif method == "get_partial_gradient":
        decode_partial(header, data, executor.params, pb.PartialRequest.FromString(payload).step)
    else:
        request = pb.LedgerRequest.FromString(payload)
        entries = [LedgerEntry.from_json(line) for line in data.decode().splitlines()]
        asked = min(MAX_LEDGER_STEPS, request.max_steps) if request.max_steps > 0 else DEFAULT_LEDGER_STEPS
        held = sum(1 for step in range(LEDGER_STEPS) if step >= request.from_step)
        expect(
            len(entries) == min(asked, held),
            f"GetLedger answered another number of entries than asked (at most {MAX_LEDGER_STEPS})\n"
            f"{len(entries)} entries for max_steps={request.max_steps}, from_step={request.from_step}; "
            f"{held} held from there",
        )
        expect(all(e.step >= request.from_step for e in entries), "GetLedger answered entries before from_step")


def _check_answer(k: int, method: str, payload, out: list[bytes], context) -> None:
    if method == "info":
        expect(pb.InfoResponse.FromString(out[0]).stage == k, "Info answered another stage")
    elif method in ("forward", "backward"):
        cls = pb.ForwardResponse if method == "forward" else pb.BackwardResponse
        response = cls.FromString(out[0])
        field = response.output if method == "forward" else response.grad_input
        if field.data:
            codec.decode(field, LIMITS.max_numel)
    elif method in BIDI or method in LANE:
        expect(context.trailing is not None and stream.RESPONSE_KEY in context.trailing, "stream answered, no trailer")
        cls = pb.ForwardResponse if method.startswith("forward") else pb.BackwardResponse
        _, wire = stream.assemble_response(cls, out, context.trailing)
        if wire is not None:
            wire.decode(LIMITS.max_numel)
    elif method == "get_contributions":
        pb.ContributionsResponse.FromString(out[0])
    else:
        _check_blob_answer(k, method, payload, out)


def _check_aborted(method: str, error: Aborted) -> str:
    if error.code in ALLOWED_CODES:
        return error.code.name
    logged, LAST_ERROR.error = LAST_ERROR.error, None
    cause = signature_of(logged) if logged is not None else "no logged error"
    raise ContractViolation(f"{method} answered {error.code.name} ({cause})\n{error.details[:500]}") from logged


def _check_sums_finite(executor) -> None:
    """Every gradient sum the peer holds is finite (each request's gradient is checked; their sum
    must be too: an update applies it)."""
    steps = range(executor.step, executor.step + MAX_AHEAD + 1)
    held = [(s, executor.acc.get(s)) for s in steps]
    bad = [s for s, acc in held if acc is not None and acc.grads and not all(all_finite(g) for g in acc.grads)]
    if bad:
        executor.call(executor.acc.drop_unapplied).result(timeout=30)
        raise ContractViolation(f"a gradient sum the peer holds became NaN or infinite\nupdates {bad}")


def _check_peer(k: int) -> None:
    """Nothing left in flight; no gradient buffer far ahead; every PROBE_EVERY cases, a probe."""
    service = fuzz_service()
    stage = service.stages[k]
    expect(stage.serving.in_flight == 0, f"a request is still counted in flight\n{stage.serving.in_flight}")
    executor = stage.executor
    far = sorted(s for s in getattr(executor.acc, "_open", {}) if s > executor.step + MAX_AHEAD)
    if far:
        executor.call(executor.acc.drop_unapplied).result(timeout=30)
        raise ContractViolation(
            f"a request opened a gradient buffer over {MAX_AHEAD} updates ahead of the peer\n"
            f"updates {far[:5]} while the peer is at update {executor.step}: each holds a copy of the stage's gradient"
        )
    _check_sums_finite(executor)
    _cases_run[0] += 1
    if _cases_run[0] % PROBE_EVERY == 0:
        try:
            service.probe()
        except Exception as e:  # noqa: BLE001 - any failure of a valid request is the finding
            raise ContractViolation(f"the peer no longer answers a valid Forward\n{type(e).__name__}: {e}") from e


def check_handler(case: tuple) -> str:
    k, method, payload = case
    LAST_ERROR.error = None
    try:
        with _server_errors_kept():
            out, context = fuzz_service().call(k, method, payload)
    except Aborted as e:
        outcome = _check_aborted(method, e)
    else:
        _check_answer(k, method, payload, out, context)
        outcome = "OK"
    _check_peer(k)
    return f"{method} {outcome}"


def derive_handler(case: tuple, rng: random.Random) -> tuple:
    k, method, payload = case
    if isinstance(payload, bytes):
        return (k, method, fs.derive_bytes(payload, rng))
    chunks = list(payload)
    if chunks:
        i = rng.randrange(len(chunks))
        chunks[i] = fs.derive_bytes(chunks[i], rng)
    return (k, method, chunks)


def handler_corpus() -> list:
    cases = []
    negative = pb.ForwardRequest(run_id=RUN_ID, stage=1, input=pb.Tensor(dtype="float32", shape=[1, -1, 16]))
    cases.append((1, "forward_stream", [pb.Chunk(header=negative.SerializeToString(), parts=[1]).SerializeToString()]))
    ahead = pb.BackwardRequest(request_id="far", run_id=RUN_ID, stage=2, step=1 << 40, contribution_id="t0/9/0")
    ahead.input.CopyFrom(codec.tensor_to_proto(torch.zeros(1, 2, SPEC["d_model"])))
    ahead.targets.CopyFrom(codec.tensor_to_proto(torch.zeros(1, 2, dtype=torch.int64)))
    cases.append((2, "backward", ahead.SerializeToString()))
    ledger = pb.LedgerRequest(run_id=RUN_ID, stage=0, from_step=0, max_steps=-2)
    cases.append((0, "get_ledger", ledger.SerializeToString()))
    return cases + _overflowing_backwards()


def _overflowing_backwards() -> list:
    """Backwards whose gradients are each finite (1e36 per output-gradient value) but whose sum is
    not, after about forty of them."""
    tokens = codec.tensor_to_proto(torch.arange(SPEC["seq_len"]).view(1, -1))
    grad = codec.tensor_to_proto(torch.full((1, SPEC["seq_len"], SPEC["d_model"]), 1e36))
    cases = []
    for i in range(48):
        request = pb.BackwardRequest(request_id=f"big{i}", run_id=RUN_ID, stage=0, contribution_id=f"t9/0/{i}")
        request.input.CopyFrom(tokens)
        request.grad_output.CopyFrom(grad)
        cases.append((0, "backward", request.SerializeToString()))
    return cases


TARGETS = (
    Target(
        "handlers",
        handler_cases,
        check_handler,
        weight=6,
        deadline_s=8.0,
        corpus=handler_corpus,
        setup=fuzz_service,
        fanout=2,
        derive=derive_handler,
    ),
)
