"""A request for a step past the peer's (async: computed at predicted parameters) tells the peer, so
that it re-reads its mates' counts and fetches their partial sums for the run-ahead microbatches
that follow (swarm.peer.daemon, swarm.peer.partials)."""

import asyncio

import pytest

from tests.unit.stage_service import Context, backward_request, last_stage


@pytest.mark.timeout(60)
def test_a_request_for_a_later_step_tells_the_peer_a_prediction_is_wanted():
    service, executor = last_stage(predict_params=True)
    serving = service.serving
    told: list[int] = []
    serving.on_run_ahead = lambda: told.append(executor.step)

    async def go():
        await service.backward(backward_request(2, 0, "t0/0/0"), Context())  # for the peer's own step: nothing
        assert told == []
        await service.backward(backward_request(2, 1, "t0/1/0"), Context())  # one step ahead: told, at step 0
        assert told == [0]

    try:
        asyncio.run(go())
    finally:
        executor.stop()
