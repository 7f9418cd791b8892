"""Training states and checkpoints (swarm.training.state): what `validate` refuses (StateError, never
another error), that an accepted state loads and trains, and that a damaged checkpoint is refused.
The inputs are those the fuzzer found (docs/FUZZING.md)."""

import time

import pytest
import torch

from swarm.core.errors import StateError
from swarm.core.states import PeerState
from swarm.peer.executor import StageExecutor
from swarm.training.config import OptimConfig
from swarm.training.models import build_stage
from swarm.training.state import (
    CheckpointStore,
    checkpoint_bytes,
    checkpoint_meta,
    read_checkpoint,
    serialize,
    stamp,
    validate,
)

GPT = {"kind": "gpt", "vocab_size": 64, "seq_len": 8, "d_model": 16, "n_layers": 2, "n_heads": 2, "d_ff": 32}
META = checkpoint_meta("run", 1, 2, GPT)


@pytest.fixture(scope="module")
def trained():
    """A stage executor two updates in, and its state stamped as a checkpoint."""
    torch.manual_seed(0)
    ex = StageExecutor(build_stage(GPT, 1, 2), OptimConfig())
    for i in range(2):
        _train(ex, f"t0/{i}/0")
    yield ex, stamp(ex.call(ex.state_dict).result(timeout=30), META, GPT)
    ex.stop()


def _train(ex: StageExecutor, cid: str) -> None:
    h, y = torch.randn(2, 8, 16), torch.randint(0, 64, (2, 8))
    ex.backward(h, None, y, cid, ex.step).result(timeout=30)
    ex.call(ex.local_step).result(timeout=30)


def _with_moment(state: dict, value) -> dict:
    per_param = dict(state["optimizer"]["state"])
    per_param[0] = {**per_param[0], "exp_avg": value}
    return {**state, "optimizer": {**state["optimizer"], "state": per_param}}


def _nested(value, depth: int):
    for _ in range(depth):
        value = [value]
    return value


@pytest.mark.parametrize(
    "edit",
    [
        lambda s: {**s, "meta": [1, 2]},  # was AttributeError
        lambda s: {**s, "meta": {**s["meta"], "stage": torch.tensor([1, 1])}},
        lambda s: {**s, "step": 1 << 70},  # validated, then Info could not carry it
        lambda s: {**s, "model": torch.zeros(2)},
        lambda s: _with_moment(s, torch.randn(3)),  # another shape: the next update raised
        lambda s: _with_moment(s, s["optimizer"]["state"][0]["exp_avg"].double()),
        lambda s: _with_moment(s, _nested(s["optimizer"]["state"][0]["exp_avg"], 600)),  # was RecursionError
        lambda s: _with_moment(s, torch.zeros(1).expand(1 << 34)),  # 2^34 elements, one stored
        lambda s: _with_moment(s, 3),
        lambda s: {**s, "optimizer": {**s["optimizer"], "state": {99: {}}}},
        lambda s: {**s, "optimizer": []},
    ],
)
def test_states_that_would_break_the_peer_are_refused(trained, edit):
    module = trained[0].module
    started = time.monotonic()
    with pytest.raises(StateError):
        validate(edit(trained[1]), module, META)
    assert time.monotonic() - started < 2.0  # the huge view is refused by its shape, not summed


def test_a_negative_second_moment_is_refused(trained):
    state = trained[1]
    per_param = dict(state["optimizer"]["state"])
    per_param[0] = {**per_param[0], "exp_avg_sq": -per_param[0]["exp_avg_sq"] - 1}
    with pytest.raises(StateError, match="negative"):
        validate({**state, "optimizer": {**state["optimizer"], "state": per_param}}, trained[0].module)


@pytest.mark.parametrize(
    "edit",
    [
        lambda s: {**s, "optimizer": {**s["optimizer"], "param_groups": []}},  # load_state_dict raised
        lambda s: {**s, "optimizer": {**s["optimizer"], "param_groups": [None]}},
        lambda s: _with_moment(s, torch.zeros(1).expand_as(s["optimizer"]["state"][0]["exp_avg"])),  # one float
        lambda s: {**s, "ledger": ['{"stage":1,"step":0,"contributions":[]}']},  # half-loaded the state
    ],
)
def test_accepted_states_load_and_train(trained, edit):
    ex, state = trained
    edited = edit(state)
    validate(edited, ex.module, META)
    try:
        ex.call(lambda: ex.load_state_dict(edited)).result(timeout=30)
        assert ex.step == state["step"]
        _train(ex, f"fuzz/{ex.step}/0")
        assert ex.step == state["step"] + 1 and all(torch.isfinite(p).all() for p in ex.params)
    finally:
        ex.call(lambda: ex.load_state_dict(state)).result(timeout=30)


def test_a_damaged_checkpoint_is_refused(trained, tmp_path, caplog):
    module, state = trained[0].module, trained[1]
    raw = checkpoint_bytes(state)
    assert read_checkpoint(raw)["step"] == state["step"]
    flipped = bytearray(raw)
    flipped[len(raw) // 3] ^= 1  # a bit of a tensor's bytes: torch.load checks no CRC and loads it
    with pytest.raises(StateError, match="checksum"):
        read_checkpoint(bytes(flipped))
    with pytest.raises(StateError, match="checksum"):
        read_checkpoint(serialize(state))  # no checksum line
    store = CheckpointStore(tmp_path, 1)
    store.save({**state, "step": 2})
    store.save({**state, "step": 4})
    (store.dir / "step00000004.pt").write_bytes(bytes(flipped))
    found = store.load_latest(module, META)
    assert found is not None and found[1].step == 2 and "checksum mismatch" in caplog.text


def test_a_writer_that_caught_up_by_download_still_writes_the_checkpoint_it_passed(trained, tmp_path):
    """Checkpoints every 2 steps: a writer at step 1 that downloads its mates' state at step 3 skipped
    update 2; it writes the state it downloaded (it once wrote nothing, and a stage killed later was
    restored from far behind)."""
    from swarm.peer.checkpoints import CheckpointWriter
    from swarm.training.config import RunConfig

    ex, _ = trained
    run = RunConfig(run_id="run", num_stages=2, model=GPT)
    store = CheckpointStore(tmp_path, stage=1)
    writer = CheckpointWriter(store, ex, run, 1, every=2, peer_id="a", live_mates=lambda: [])
    writer._last_step = 1
    assert writer.after_step(1) is None  # no multiple of 2 passed
    thread = writer.after_step(3)  # 1 -> 3 passed 2
    assert thread is not None
    thread.join(timeout=30)
    assert [c.step for c in store.list()] == [ex.step]
    assert writer.after_step(3) is None and writer.after_step(3) is None  # nothing new passed
    busy_mate = type("Mate", (), {"peer_id": "0", "record_state": PeerState.ONLINE})()
    other = CheckpointWriter(store, ex, run, 1, every=2, peer_id="b", live_mates=lambda: [busy_mate])
    assert other.after_step(4) is None  # a mate with a smaller id writes them
