"""The environment for a CLI the tests run in a fresh process: no device count in
XLA_FLAGS (the CLI must force its own devices, as for a user), the test session's
compile level kept (tests/conftest.py)."""
import os

FAST_COMPILE = "--xla_backend_optimization_level=0"


def cli_env(**extra) -> dict:
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    return {**env, "XLA_FLAGS": FAST_COMPILE, **extra}
