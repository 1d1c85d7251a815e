"""Force 8 host CPU devices before jax is imported anywhere in the test session, and
compile with LLVM at -O0.

The tests check values, gradients, collectives and memory, never speed, and XLA's HLO
passes (fusion, collective placement, buffer assignment) run the same at any backend
optimization level; -O0 only skips LLVM's code optimization, which is most of XLA:CPU's
compile time: `python -m pytest -m "not slow" tests/test_step.py tests/test_cost.py` took
167 s against 344 s at the default level, back to back on this 2-core machine.
Subprocesses the tests start inherit the flag unless they set XLA_FLAGS themselves."""
import os

flags = os.environ.get("XLA_FLAGS", "")
if "xla_force_host_platform_device_count" not in flags:
    flags = f"{flags} --xla_force_host_platform_device_count=8"
if "xla_backend_optimization_level" not in flags:
    flags = f"{flags} --xla_backend_optimization_level=0"
os.environ["XLA_FLAGS"] = flags.strip()

import jax  # noqa: E402

assert len(jax.devices()) >= 8, "tests need 8 devices; XLA_FLAGS was set too late"


import pytest  # noqa: E402


@pytest.fixture(scope="module")
def own_ledger_cache(tmp_path_factory):
    """The planner's ledger cache in a directory of the requesting module, not the
    user's (tests/test_plan.py, tests/test_plan_cli.py)."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("SHARDWISE_LEDGER_CACHE", str(tmp_path_factory.mktemp("ledgers")))
        yield


@pytest.fixture
def one_line_error(capsys):
    """check(main, argv, *words, table=word): main(argv) exits 2 with one stderr line
    that starts "error: " and names every one of `words`, no traceback, and prints
    nothing containing `table` (the report's header word) on stdout."""
    def check(main, argv, *words, table):
        try:
            code = main(argv)
        except SystemExit as e:
            code = e.code
        out, err = capsys.readouterr()
        assert code == 2, (out, err)
        assert err.startswith("error: ") and err.count("\n") == 1, err
        assert "Traceback" not in err and table not in out
        for w in words:
            assert w in err, err
    return check
