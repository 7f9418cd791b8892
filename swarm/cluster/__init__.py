"""The shared, live view of a swarm that peers, trainers and tools read: who serves which stage,
how fast and at which step (`view`: DHT records merged with Info polls), and joining a run
(`runconfig`: the coordinator's published config)."""
