"""Checks of a run config on the machine that will run it (`swarm local`), before any process starts: the
model builds, the dataset loads, and a sample of it fits the first stage's input and the last stage's
targets. A mistake found here costs a second, not a trainer failing a minute into the run."""

from __future__ import annotations

from swarm.core.errors import ConfigError, RequestInvalid
from swarm.training.config import RunConfig
from swarm.training.data import load_dataset
from swarm.training.models import build_stage


def check_run(run: RunConfig) -> None:
    """ConfigError with the fix when this run cannot train here."""
    try:
        first = build_stage(run.model, 0, run.num_stages)
        last = first if run.num_stages == 1 else build_stage(run.model, run.num_stages - 1, run.num_stages)
    except ConfigError:
        raise
    except Exception as e:  # noqa: BLE001 - a user's model code may raise anything
        raise ConfigError(f"the model does not build into {run.num_stages} stages: {_one_line(e)}") from None
    try:
        dataset = load_dataset(run.data, run.model)
    except ConfigError:
        raise
    except (OSError, ValueError, RuntimeError, TypeError) as e:
        raise ConfigError(f"the dataset cannot be loaded: {_one_line(e)}") from None
    inputs, targets = dataset.train([0])
    try:
        first.schema.input.check(inputs, "the dataset's inputs", max_batch=1)
        last.schema.targets.check(targets, "the dataset's targets", max_batch=1)
    except RequestInvalid as e:
        raise ConfigError(
            f"{e}, for stage 0's input and the last stage's targets: make the model's declared input/targets "
            "match the dataset (see examples/ and README.md, 'Your own model')"
        ) from None


def _one_line(e: BaseException) -> str:
    text = " ".join(str(e).split())
    return text or type(e).__name__
