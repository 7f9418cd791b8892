"""A short run of every fuzz target (tests/fuzz, docs/FUZZING.md): its corpus (inputs that broke a
contract once, and other tricky ones) and a few dozen generated cases, under the same contracts,
deadlines, memory bounds and address-space limit as `scripts/fuzz.py`'s long runs. A failure lists
each broken contract with its input and traceback."""

import pytest

from tests.fuzz.harness import address_space_limit, run_target
from tests.fuzz.targets import TARGETS

CASES = 30  # per target, after its corpus (a drawn case and the cases derived from it all count)


@pytest.mark.timeout(180)
@pytest.mark.parametrize("name", list(TARGETS))
def test_fuzz_target_keeps_its_contract(name):
    target = TARGETS[name]
    with address_space_limit():
        result = run_target(target, len(target.corpus()) + CASES, seed=0)
    assert result.cases >= CASES
    if result.violations:
        pytest.fail(result.report(), pytrace=False)
    answered = set(result.outcomes) - {"violation"}
    assert len(answered) >= 2, f"{name}: every case ended the same way ({answered}): the cases reach too little"
