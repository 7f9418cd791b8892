"""The coordinator dashboard's web side: a state document in, a live read-only web app out.

`source` defines what feeds it (`StateSource`), `app` the Starlette app (page, JSON API, Prometheus
metrics), `server` how it is served (a background thread or the current event loop), `live` a live
swarm's dashboard, `config` its settings, and `synthetic` a generator of realistic documents for tests,
demos and benchmarks. Nothing is imported here: `swarm`'s command-line parser reads `config` without
loading the web stack.
"""
