"""Adaptive rebalancing on real processes: peers move to where the swarm needs them."""

import itertools
import signal
import time

import pytest

from tests.integration.helpers import TrainingProgress, run_args, wait_for

FAST_REBALANCE = ["--rebalance-period", "3", "--move-cooldown", "6"]


def layout(st: dict) -> list[int]:
    return [sum(p["state"] == "online" for p in stage["peers"]) for stage in st["stages"]]


def best_layout_throughput(st: dict) -> float:
    """The best swarm throughput these online peers could reach by moving. The test's peers are
    identical processes on one machine, so a stage's rate per peer is a property of the stage (its
    peers' mean measured throughput; the tiny model's stages differ by 2x in practice, which its
    FLOP estimate does not capture): the best layout is the best count of peers per stage."""
    rates, total = [], 0
    for stage in st["stages"]:
        online = [p["throughput"] for p in stage["peers"] if p["state"] == "online"]
        rates.append(sum(online) / len(online))
        total += len(online)
    layouts = (c for c in itertools.product(range(1, total + 1), repeat=len(rates)) if sum(c) == total)
    return max(min(n * r for n, r in zip(c, rates, strict=True)) for c in layouts)


def near_best(st: dict, fraction: float = 0.75) -> bool:
    """Every stage served, and the slowest stage within `fraction` of the best layout's."""
    if min(layout(st)) < 1:
        return False
    achieved = min(stage["throughput"] for stage in st["stages"])
    return achieved >= fraction * best_layout_throughput(st)


class status_when:  # noqa: N801 - used like a function, as a wait_for condition
    """A wait_for condition: the status, if it satisfies `predicate`. It keeps the last status it saw,
    so a timeout can say what the swarm looked like (`last_seen`)."""

    def __init__(self, read, predicate) -> None:
        self.read, self.predicate = read, predicate
        self.last: dict | None = None

    def __call__(self) -> dict | None:
        self.last = self.read()
        return self.last if self.predicate(self.last) else None

    def last_seen(self) -> str:
        if self.last is None:
            return "no status"
        peers = [
            [(p["id"][-6:], p["state"], round(p["throughput"], 1)) for p in stage["peers"]]
            for stage in self.last["stages"]
        ]
        moves = [(e["src"], e["dst"]) for e in self.last["events"] if e["event"] == "move"]
        return f"layout {layout(self.last)}, peers {peers}, moves {moves}"


def wait_for_status(read, predicate, timeout: float, what: str) -> dict:
    """wait_for on the swarm's status (`read()`: a StatusReader); a timeout says what it was last."""
    check = status_when(read, predicate)
    try:
        return wait_for(check, timeout, what)
    except TimeoutError as e:
        raise TimeoutError(f"{e}; last seen: {check.last_seen()}") from None


@pytest.mark.slow
@pytest.mark.alone  # moves follow the peers' measured speeds
@pytest.mark.timeout(420)
def test_peers_move_off_a_crowded_stage_and_recover_after_a_kill(make_swarm, read_status, tmp_path):
    # checkpoints every step: if the victim's mate moves away in the instant of the kill, the stage
    # is restored from its newest checkpoint (without one it would have "no state" and wait)
    checkpoints = ["--checkpoint-dir", str(tmp_path / "ckpt"), "--checkpoint-every", "1"]
    swarm = make_swarm(
        stages=3,
        stage_layout=[3, 1, 1],
        steps=100_000,
        run_args=run_args(),
        peer_args=FAST_REBALANCE + checkpoints,
        trainer_args=["--max-in-flight", "4"],
    )
    swarm.start()
    read = read_status(swarm)
    progress = TrainingProgress()
    swarm.start_trainers(on_line=progress)
    wait_for(lambda: progress.latest() >= 2, 120, "training to start")
    t0 = time.monotonic()
    # all 5 peers placed: a peer in the middle of its move serves no stage ([2, 1, 1] is not a move done).
    # Not "at most 2 per stage": where stage 2 (head and loss) measures ~3.5x slower per peer than
    # stage 0, as on CI, [1, 1, 3] is the best layout and two peers rightly move there (CI once timed
    # out on a former `max(layout) <= 2`, last seen [1, 1, 3] after moves (0, 2), (0, 2)).
    moved = lambda s: sum(layout(s)) == 5 and layout(s)[0] <= 2 and min(layout(s)) >= 1  # noqa: E731
    st = wait_for_status(read, moved, 60, "a move off stage 0")
    print("moved within", round(time.monotonic() - t0, 1), "s; layout", layout(st))
    moves = [e for e in st["events"] if e["event"] == "move"]
    assert moves and moves[0]["src"] == 0
    # A hang detector, not a speed target (that one is measured in docs/BENCHMARKS.md: 0.8-1.7 s):
    # under the full suite's load on 2 cores an entering peer may wait for a slow mate's Info.
    print("move seconds:", [m["seconds"] for m in moves])
    assert all(m["seconds"] < 60 for m in moves), moves

    # SIGKILL one peer of a stage that holds 2 or more, from a fresh status
    st = wait_for_status(read, lambda s: max(layout(s)) >= 2, 60, "a stage of 2 or more peers")
    chosen_at = time.time()
    crowded = next(stage for stage in st["stages"] if layout({"stages": [stage]})[0] >= 2)
    victim_id = next(p["id"] for p in crowded["peers"] if p["state"] == "online")
    step_before_kill = progress.latest()
    victim = next(p for p in swarm.peers if p.ready["peer_id"] == victim_id)
    victim.send_signal(signal.SIGKILL)
    victim.wait(timeout=10)

    def recovered(s: dict) -> bool:
        counts = layout(s)
        return sum(counts) == 4 and min(counts) >= 1 and near_best(s)

    st = wait_for_status(read, recovered, 60, "the 4 remaining peers to form a near-best assignment")
    print("after the kill: layout", layout(st))
    wait_for(lambda: progress.latest() >= step_before_kill + 5, 120, "training to go on after the kill")
    with progress.lock:
        steps = [s for _, s in progress.steps]
    # Peers here move every 10-20 s (their measured rates are coupled through the shared cores). If
    # the victim's mate moved away in the instant between the status and the kill, the stage lost
    # both its peers and was restored from its newest checkpoint: the step may go back by one.
    mate_left = [
        e for e in st["events"] if e["event"] == "move" and e["src"] == crowded["index"] and e["time"] > chosen_at - 5
    ]
    if not mate_left:
        assert steps == sorted(steps), "the global step never goes back"
    else:
        print("the victim's mate moved away at the kill; the stage was restored:", mate_left)
    for trainer in swarm.trainers:
        assert trainer.alive()


@pytest.mark.slow
@pytest.mark.alone  # placement follows the peers' measured speeds
@pytest.mark.timeout(300)
def test_auto_placed_peers_spread_over_the_stages(make_swarm, read_status):
    swarm = make_swarm(stages=3, run_args=run_args(), peer_args=FAST_REBALANCE)
    swarm.start_coordinator()
    read = read_status(swarm)
    peers = [swarm.start_peer("auto", wait=False) for _ in range(6)]
    for p in peers:
        p.wait_ready(120)

    def spread(s: dict) -> bool:
        # the stages' costs differ (embedding, head and loss), and the peers' benchmarks, run on 2
        # shared cores, differ more: the best spread of 6 equal peers is not always 2,2,2, and where
        # the stages' rates differ by ~4x it holds 4 peers on one stage (tests/unit/test_rebalance.py
        # shows such rates; a former "at most 3 per stage" here was wrong for them, and CI once timed
        # out on it: a timeout now prints the last status). So: every stage served and near the
        # best assignment's throughput by the peers' own measurements
        counts = layout(s)
        return sum(counts) == 6 and min(counts) >= 1 and near_best(s)

    st = wait_for_status(read, spread, 60, "the auto-placed peers to spread over the stages")
    print("layout", layout(st), "stage throughputs", [round(stage["throughput"]) for stage in st["stages"]])


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_an_empty_stage_is_filled_within_seconds_not_after_the_cooldown(make_swarm, read_status):
    """Peers started together (`--stage auto`, compose's replicas) can leave a stage empty; the swarm is
    stalled then, so a peer of a stage that holds two moves there at once, not after the default 60 s
    cooldown and 15 s period (kept here: no FAST_REBALANCE)."""
    swarm = make_swarm(stages=3, run_args=run_args())
    swarm.start_coordinator()
    read = read_status(swarm)
    for proc in [swarm.start_peer(stage, wait=False) for stage in (0, 0, 2)]:
        proc.wait_ready(120)
    t0 = time.monotonic()
    st = wait_for_status(read, lambda s: layout(s) == [1, 1, 1], 30, "a peer to move into the empty stage 1")
    print("filled within", round(time.monotonic() - t0, 1), "s")
    assert [(e["src"], e["dst"]) for e in st["events"] if e["event"] == "move"] == [(0, 1)]
