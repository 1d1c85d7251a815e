"""Layouts, param table, init, the step under shard_map, optimizer, data and the CLI.

Importing `engine` does not import jax, so `engine.train` can force host devices first."""
