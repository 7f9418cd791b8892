"""The trainer's feed: when the swarm's step goes back, a step fed again skips what still runs."""

import torch

from swarm.policy.pacing import StepPacer
from swarm.trainer.feed import MicrobatchFeed
from swarm.training.data import ShardSampler


class Samples:
    num_train = 1000

    def train(self, indices):
        return torch.tensor(indices), torch.tensor(indices)


def _feed(share: int = 8, microbatch: int = 4) -> MicrobatchFeed:
    dataset = Samples()
    sampler = ShardSampler(dataset.num_train, 0, 1, seed=0)
    return MicrobatchFeed("t0", StepPacer(share, staleness=0), sampler, dataset, microbatch, steps=100)


def test_a_step_fed_again_skips_the_microbatches_still_running():
    feed = _feed()
    step5 = [feed.next(5), feed.next(5)]
    assert [mb.cid for mb in step5] == ["t0/5/0", "t0/5/4"] and feed.next(5) is None  # exact: nothing ahead
    for mb in step5:
        feed.finished(mb)
    step6 = [feed.next(6), feed.next(6)]
    assert [mb.cid for mb in step6] == ["t0/6/0", "t0/6/4"]
    # the only peer of a stage that had applied update 5 died: the swarm's step goes back to 5
    again = [feed.next(5), feed.next(5)]
    assert [mb.cid for mb in again] == ["t0/5/0", "t0/5/4"]  # finished: fed again (the trainer replays
    # or repeats them as checks where it holds their records: swarm.trainer.loop)
    assert feed.next(5) is None  # step 6's microbatches still run: not fed a second time
    assert torch.equal(again[0].inputs, step5[0].inputs)  # the same samples


def test_a_microbatch_queued_again_comes_first_and_keeps_running():
    feed = _feed()
    mb = feed.next(0)
    feed.again(mb)
    retried = feed.next(0)
    assert retried.cid == mb.cid and retried is not mb and mb.cid in feed.running
    feed.finished(retried)
    assert mb.cid not in feed.running


def test_a_contribution_completed_again_after_its_step_was_fed_again_counts_once():
    """The trainer counts a microbatch's samples when it completes; when the step was fed again, a
    repeat of a completed contribution is not counted a second time, and the memory of completed
    steps stays bounded."""
    from swarm.trainer.feed import COMPLETED_STEPS_KEPT

    feed = _feed()
    step5 = [feed.next(5), feed.next(5)]
    assert feed.first_completion(step5[0])
    for mb in step5:
        feed.finished(mb)
    step6 = [feed.next(6), feed.next(6)]  # the swarm's step goes back to 5 with step 6 begun: 5 is fed again
    repeat = feed.next(5)
    assert repeat.cid == step5[0].cid and not feed.first_completion(repeat)  # counted before
    assert feed.first_completion(feed.next(5))  # the other one had not completed: counted now
    for mb in step6:
        feed.finished(mb)
    for step in range(7, 7 + 2 * COMPLETED_STEPS_KEPT):
        for _ in range(2):
            mb = feed.next(step)
            assert feed.first_completion(mb)
            feed.finished(mb)
    assert len(feed.completed) <= COMPLETED_STEPS_KEPT
