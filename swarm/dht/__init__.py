"""The swarm on the hivemind DHT: record schemas (`records`), a node with deadline-bound typed
accessors (`node`), and a background announcer that keeps a record alive (`announcer`)."""

from swarm.core.lazy import defer_hivemind_extras

defer_hivemind_extras()  # before anything here imports hivemind
