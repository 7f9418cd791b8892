"""The swarm on the hivemind DHT: record schemas (`records`), a node with deadline-bound typed
accessors (`node`), and a background announcer that keeps a record alive (`announcer`)."""
