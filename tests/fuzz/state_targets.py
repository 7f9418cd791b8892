"""Fuzz targets of training states (swarm/training/state.py): `deserialize` and `validate` on random
bytes and on crafted states (fields replaced, tensors of other shapes and dtypes, NaN, huge
zero-stride views, deep nesting, odd meta and ledger lines); `read_checkpoint` and `validate` on
truncated and bit-flipped real checkpoint files (the state in torch's zip format, as
`CheckpointStore` writes it, and in its legacy one, which `deserialize` also reads, each behind the
checkpoint's sha256 line); and `CheckpointStore.load_latest` on a folder of good and corrupt
checkpoints.

Contract: deserialize, read_checkpoint and validate raise only StateError, within the deadline; a state they accept
loads into a real `StageExecutor` (parameters, optimizer, ledger), trains one more step and can be
reported on the wire (Info's int64 step); a corrupted checkpoint that is accepted holds the original
values. load_latest returns the newest good checkpoint (or None), skipping the others with a warning.
"""

from __future__ import annotations

import functools
import hashlib
import io
import logging
import random
import sys
import tempfile
from pathlib import Path

import torch
from hypothesis import strategies as st

from swarm.core.errors import StateError
from swarm.peer.executor import StageExecutor
from swarm.training.config import OptimConfig
from swarm.training.models import build_stage
from swarm.training.state import (
    CHECKPOINT_MAGIC,
    CheckpointStore,
    checkpoint_bytes,
    checkpoint_meta,
    deserialize,
    read_checkpoint,
    serialize,
    stamp,
    validate,
)
from tests.fuzz import strategies as fs
from tests.fuzz.harness import Target
from tests.fuzz.wire_targets import expect

SPEC = {"kind": "gpt", "vocab_size": 64, "seq_len": 8, "d_model": 16, "n_layers": 2, "n_heads": 2, "d_ff": 32}
RUN = "fuzz-run"
STAGE, NUM_STAGES = 1, 2
HUGE_VIEW = 1 << 34  # elements of a zero-stride view a few bytes of checkpoint can declare (drawn rarely)


class StateFixture:
    """A real stage's state after two updates (with optimizer state and ledger), stamped as a
    checkpoint, serialized in both formats (`zip`, `legacy`: the checkpoint files, with the sha256
    line), and an executor to load accepted states into."""

    def __init__(self) -> None:
        torch.manual_seed(0)
        self.executor = StageExecutor(build_stage(SPEC, STAGE, NUM_STAGES), OptimConfig())
        for i in range(2):
            self._train_step(f"t0/{i}/0")
        self.meta = checkpoint_meta(RUN, STAGE, NUM_STAGES, SPEC)
        self.state = stamp(self.executor.call(self.executor.state_dict).result(timeout=60), self.meta, SPEC)
        self.zip = checkpoint_bytes(self.state)
        legacy = io.BytesIO()
        torch.save(self.state, legacy, _use_new_zipfile_serialization=False)
        digest = hashlib.sha256(legacy.getvalue()).hexdigest().encode()
        self.legacy = CHECKPOINT_MAGIC + digest + b"\n" + legacy.getvalue()
        self.module = build_stage(SPEC, STAGE, NUM_STAGES).module
        self._checkpoints: dict[int, bytes] = {}

    def _train_step(self, cid: str) -> None:
        ex = self.executor
        h, y = torch.randn(2, SPEC["seq_len"], SPEC["d_model"]), torch.randint(0, SPEC["vocab_size"], (2, 8))
        ex.backward(h, None, y, cid, ex.step).result(timeout=60)
        ex.call(ex.local_step).result(timeout=60)

    def load_and_train(self, state: dict) -> None:
        """What a peer does with an accepted state: load it, train on, report its step."""
        ex = self.executor
        try:
            ex.call(lambda: ex.load_state_dict(state)).result(timeout=60)
            self._train_step(f"fuzz/{ex.step}/0")
            fits = -(1 << 63) <= ex.step < 1 << 63
            expect(fits, f"an accepted state's step does not fit Info's int64\nstep {ex.step}")
        finally:
            ex.call(lambda: ex.load_state_dict(self.state)).result(timeout=60)

    def checkpoint_bytes(self, step: int) -> bytes:
        if step not in self._checkpoints:
            self._checkpoints[step] = checkpoint_bytes({**self.state, "step": step})
        return self._checkpoints[step]


@functools.cache
def fixture() -> StateFixture:
    return StateFixture()


# ---- crafted states ----


def _tensor_value(kind: str, seed: int, like: object) -> torch.Tensor | object:
    gen = torch.Generator().manual_seed(seed)
    like = like if isinstance(like, torch.Tensor) else torch.zeros(1)
    if kind == "nan":
        return torch.full_like(like, float("nan"))
    if kind == "dtype":
        return like.to(torch.float64)
    if kind == "shape":
        return torch.randn(like.numel() + 1, generator=gen)
    if kind == "empty":
        return torch.empty(0)
    if kind == "view":
        return torch.zeros(1).expand(HUGE_VIEW if seed % 64 == 0 else 1 << 16)
    if kind == "nested":
        value: object = like
        for _ in range((10, 100, 600)[seed % 3]):
            value = [value]
        return value
    return seed  # "scalar": not a tensor at all


LEDGER_LINES = st.one_of(st.text(max_size=40), fs.deep_json(), fs.JSON_VALUES.map(fs.json_text))
TENSOR_EDITS = ("nan", "dtype", "shape", "empty", "view", "nested", "scalar")
EDITS = st.one_of(
    st.tuples(st.just("step"), fs.PYTHON_VALUES),
    st.tuples(st.just("meta"), fs.PYTHON_VALUES),
    st.tuples(st.just("meta_field"), fs.PYTHON_VALUES),
    st.tuples(st.just("ledger"), st.lists(LEDGER_LINES)),
    st.tuples(st.just("drop"), st.sampled_from(("step", "model", "optimizer", "meta", "ledger"))),
    st.tuples(st.just("model"), st.sampled_from(TENSOR_EDITS), st.integers(0, 1 << 16)),
    st.tuples(st.just("optimizer"), st.sampled_from(TENSOR_EDITS), st.integers(0, 1 << 16)),
    st.tuples(st.just("param_groups"), fs.PYTHON_VALUES),
)


def _apply_edit(state: dict, edit: tuple) -> None:
    kind, value = edit[0], edit[1]
    if kind in ("step", "meta", "ledger"):
        state[kind] = value
    elif kind == "meta_field" and isinstance(state.get("meta"), dict):
        state["meta"] = {**state["meta"], "run_id": value}
    elif kind == "drop":
        state.pop(value, None)
    elif kind == "model" and isinstance(state.get("model"), dict):
        name = sorted(state["model"])[edit[2] % len(state["model"])]
        state["model"] = {**state["model"], name: _tensor_value(value, edit[2], state["model"][name])}
    elif kind == "optimizer" and isinstance(state.get("optimizer"), dict):
        per_param = dict(state["optimizer"]["state"])
        index = sorted(per_param)[edit[2] % len(per_param)]
        per_param[index] = {**per_param[index], "exp_avg": _tensor_value(value, edit[2], per_param[index]["exp_avg"])}
        state["optimizer"] = {**state["optimizer"], "state": per_param}
    elif kind == "param_groups" and isinstance(state.get("optimizer"), dict):
        state["optimizer"] = {**state["optimizer"], "param_groups": value}


def _bytes_of(case: tuple) -> bytes | None:
    fx = fixture()
    if case[0] == "bytes":
        return case[1]
    if case[0] == "mutated":
        return fs.apply_mutations(fx.zip if case[1] == "zip" else fx.legacy, case[2])
    state = dict(fx.state)
    for edit in case[1]:
        _apply_edit(state, edit)
    limit = sys.getrecursionlimit()
    sys.setrecursionlimit(20_000)  # a crafted pickle nests as deep as it likes: torch.save must keep up
    try:
        return serialize(state)
    except Exception:  # noqa: BLE001 - torch cannot save this one: nothing to load
        return None
    finally:
        sys.setrecursionlimit(limit)


def _same_as_fixture(state: dict) -> bool:
    fx = fixture()
    if state.get("step") != fx.state["step"] or set(state["model"]) != set(fx.state["model"]):
        return False
    return all(torch.equal(state["model"][k], v) for k, v in fx.state["model"].items())


def check_state(case: tuple) -> str:
    data = _bytes_of(case)
    if data is None:
        return "unserializable"
    fx = fixture()
    try:
        state = read_checkpoint(data) if case[0] == "mutated" else deserialize(data)
        validate(state, fx.module, fx.meta)
    except StateError:
        return "refused"
    if case[0] == "mutated":
        expect(_same_as_fixture(state), f"a corrupted {case[1]} checkpoint was accepted with other values")
    fx.load_and_train(state)
    return "accepted"


def state_cases() -> st.SearchStrategy:
    prefixes = st.sampled_from((b"", b"PK\x03\x04", b"\x80\x02", b"\x80\x02\x8a\x0al\xfc\x9cF\xf9 j\xa8P\x19."))
    random_bytes = st.tuples(st.just("bytes"), st.tuples(prefixes, st.binary(max_size=600)).map(b"".join))
    ops = st.lists(fs._mutation, min_size=1, max_size=4)
    mutated = st.tuples(st.just("mutated"), st.sampled_from(("zip", "legacy")), ops)
    crafted = st.tuples(st.just("crafted"), st.lists(EDITS, min_size=1, max_size=3))
    return st.one_of(random_bytes, mutated, crafted)


def derive_state(case: tuple, rng: random.Random) -> tuple | None:
    if case[0] == "bytes":
        return ("bytes", fs.derive_bytes(case[1], rng))
    if case[0] == "mutated":
        return ("mutated", case[1], case[2] + fs.random_mutations(rng))
    return None


def state_corpus() -> list:
    return [
        ("crafted", [("optimizer", "view", 1)]),  # exp_avg a zero-stride view (64 Ki elements, one stored)
        ("crafted", [("optimizer", "nested", 2)]),  # 600 nested lists
        ("crafted", [("optimizer", "shape", 1)]),  # exp_avg of another shape
        ("crafted", [("meta", [1, 2])]),  # meta that is not a dict
        ("crafted", [("step", 1 << 70)]),  # a step no int64 holds
        ("crafted", [("ledger", ['{"stage":1,"step":0,"contributions":[]}'])]),
        ("crafted", [("param_groups", [])]),  # param_groups the optimizer cannot load
        ("mutated", "zip", [("flip", 16162, 248, 1)]),  # one bit of a parameter's bytes
        ("mutated", "legacy", [("set", 31099, 111, 38)]),
    ]


# ---- checkpoint folders ----

FILE_KINDS = ("good", "garbage", "truncated", "nan", "wrong_meta", "directory", "empty", "misnamed")


def _write(folder: Path, step: int, kind: str) -> None:
    fx = fixture()
    path = folder / f"step{step:08d}.pt"
    if kind == "good":
        path.write_bytes(fx.checkpoint_bytes(step))
    elif kind == "garbage":
        path.write_bytes(fs.random_bytes(200 + step, step))
    elif kind == "truncated":
        path.write_bytes(fx.checkpoint_bytes(step)[: 100 + 37 * step])
    elif kind == "nan":
        model = {k: torch.full_like(v, float("nan")) for k, v in fx.state["model"].items()}
        path.write_bytes(checkpoint_bytes({**fx.state, "step": step, "model": model}))
    elif kind == "wrong_meta":
        path.write_bytes(checkpoint_bytes({**fx.state, "step": step, "meta": {**fx.meta, "run_id": "other"}}))
    elif kind == "directory":
        path.mkdir()
    elif kind == "empty":
        path.write_bytes(b"")
    else:
        (folder / f"step{step:07d}.pt").write_bytes(fx.checkpoint_bytes(step))


class _Warnings(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.count = 0

    def emit(self, record: logging.LogRecord) -> None:
        self.count += 1


def check_checkpoints(case: tuple) -> str:
    files = dict(case[1])  # step -> kind, the last written wins
    fx = fixture()
    log, warnings = logging.getLogger("swarm.training.state"), _Warnings()
    with tempfile.TemporaryDirectory() as root:
        store = CheckpointStore(root, STAGE)
        store.dir.mkdir(parents=True)
        for step, kind in files.items():
            _write(store.dir, step, kind)
        level, propagate = log.level, log.propagate
        log.addHandler(warnings)
        log.setLevel(logging.WARNING)
        log.propagate = False
        try:
            found = store.load_latest(fx.module, fx.meta)
        finally:
            log.removeHandler(warnings)
            log.setLevel(level)
            log.propagate = propagate
    good = [s for s, k in files.items() if k == "good"]
    want = max(good) if good else None
    got = None if found is None else found[1].step
    expect(got == want, f"load_latest did not return the newest good checkpoint\nit returned {got}, want {want}")
    if found is not None:
        expect(found[0]["step"] == want and _same_model(found[0]), "load_latest returned another state")
    skipped = [s for s, k in files.items() if k != "misnamed" and s > (want if want is not None else -1)]
    silent = f"load_latest skipped a checkpoint silently\n{skipped}: {warnings.count} warnings"
    expect(warnings.count >= len(skipped), silent)
    return "found" if found else "none"


def _same_model(state: dict) -> bool:
    return all(torch.equal(state["model"][k], v) for k, v in fixture().state["model"].items())


def checkpoint_cases() -> st.SearchStrategy:
    specs = st.lists(st.tuples(st.integers(0, 30), st.sampled_from(FILE_KINDS)), max_size=6)
    return st.tuples(st.just("folder"), specs)


def checkpoint_corpus() -> list:
    return [("folder", []), ("folder", [(3, "good"), (5, "garbage"), (7, "directory"), (9, "wrong_meta")])]


TARGETS = (
    Target(
        "state", state_cases, check_state, weight=6, corpus=state_corpus, setup=fixture, fanout=2, derive=derive_state
    ),
    Target("checkpoints", checkpoint_cases, check_checkpoints, weight=1, corpus=checkpoint_corpus, setup=fixture),
)
