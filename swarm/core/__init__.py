"""Shared leaves: peer states and update reasons, typed errors, settings (with their defaults, help
text and units), logging, process helpers, tensor checks and debug hooks. Imports nothing else of
swarm: every other package may import it."""
