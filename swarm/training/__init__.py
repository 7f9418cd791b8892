"""What training is made of, shared by peers and trainers: models split into stages, data, the
optimizer and its state, checkpoints, gradient averaging, the run config."""

from swarm.core.lazy import defer_hivemind_extras

defer_hivemind_extras()  # before averaging imports hivemind
