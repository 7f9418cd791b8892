"""The fault-injection plan of `swarm peer --debug-fail-*`."""

import argparse

import pytest

from swarm.core.debug import FaultPlan, add_debug_args, fault_plan_from_args


def parse(*argv: str) -> FaultPlan | None:
    parser = argparse.ArgumentParser()
    add_debug_args(parser)
    return fault_plan_from_args(parser.parse_args(list(argv)))


def test_no_plan_without_a_step():
    assert parse() is None
    assert parse("--debug-fail-in-request") is None


def test_the_plan_fires_from_its_step_on_in_the_step_loop_a_request_or_a_mates_fetch():
    plan = parse("--debug-fail-at-step", "5", "--debug-fail-mode", "stop")
    assert (plan.fail_at_step, plan.fail_mode, plan.in_request) == (5, "stop", False)
    assert not plan.due(4) and plan.due(5) and plan.due(9)
    assert plan.at_step_loop
    in_request = parse("--debug-fail-at-step", "5", "--debug-fail-mode", "leave", "--debug-fail-in-request")
    assert in_request.in_request and not in_request.at_step_loop
    in_fetch = parse("--debug-fail-at-step", "5", "--debug-fail-in-mate-fetch")
    assert in_fetch.in_mate_fetch and not in_fetch.in_request and not in_fetch.at_step_loop


def test_an_unknown_mode_is_refused():
    with pytest.raises(ValueError, match="--debug-fail-mode must be one of"):
        FaultPlan(3, "explode")
