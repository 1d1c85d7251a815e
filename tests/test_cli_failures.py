"""The training and generation CLIs on input and events a user meets: the learning-rate
schedule's first step, output paths checked before compiling, --help text, rates and
data messages, Ctrl-C. In-process `main` where no compile is needed; a subprocess only
where a signal must be sent."""
import os
import re
import signal
import subprocess
import sys

import jax.numpy as jnp
import numpy as np
import optax
import pytest
from subprocess_env import cli_env

from engine.cli.train import main
from engine.config import TrainConfig
from engine.run.optim import make_optimizer, schedule

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CLI = ["--model", "tiny", "--layout", "single", "--steps", "2", "--batch", "2", "--seq", "8"]


def run_main(capsys, *args):
    code = main([*CLI, *args])
    out, err = capsys.readouterr()
    return code, out, err


# -- learning-rate schedule ---------------------------------------------------------------
@pytest.mark.parametrize("warmup", [0, 1, 4])
def test_first_step_trains_and_warmup_reaches_the_peak(warmup):
    tcfg = TrainConfig(lr=2e-3, warmup=warmup, steps=20)
    lr_at = schedule(tcfg)  # at update count = step - 1
    lrs = np.array([float(lr_at(c)) for c in range(tcfg.steps)])
    w = max(warmup, 1)
    np.testing.assert_allclose(lrs[:w], tcfg.lr * np.arange(1, w + 1) / w, rtol=1e-6)
    assert np.all(np.diff(lrs[w - 1:]) < 0)  # cosine decay after the peak
    np.testing.assert_allclose(lrs[-1], tcfg.lr * tcfg.min_lr_ratio, rtol=1e-6)


def test_first_optimizer_update_moves_the_params():
    tcfg = TrainConfig(lr=1e-2, warmup=10, steps=20, weight_decay=0.0)
    tx = make_optimizer(tcfg)
    params = {"w": jnp.ones((3,))}
    updates, _ = tx.update({"w": jnp.ones((3,))}, tx.init(params), params)
    # Adam's first update is lr * g / |g| = lr per element: lr / warmup at step 1
    np.testing.assert_allclose(optax.apply_updates(params, updates)["w"],
                               1 - tcfg.lr / tcfg.warmup, rtol=1e-5)


# -- data ----------------------------------------------------------------------------------
def test_random_uint32_bin_points_at_the_dtype_not_a_huge_vocab(tmp_path, capsys):
    path = tmp_path / "random.bin"
    np.random.default_rng(0).integers(0, 2**32, 4096, dtype=np.uint32).tofile(path)
    code, out, err = run_main(capsys, "--data", str(path), "--data-dtype", "uint32")
    assert code == 2 and out == "" and err.count("\n") == 1
    assert "beyond any vocab the engine accepts (limit 16,777,216)" in err
    assert "--data-dtype" in err and "need --vocab" not in err


# -- output paths, checked before compiling ------------------------------------------------
@pytest.mark.parametrize("where,phrase", [
    ("missing/m.jsonl", "No such file or directory"),
    ("adir", "Is a directory"),
])
def test_unwritable_metrics_file_is_one_line_before_compiling(where, phrase, tmp_path, capsys):
    (tmp_path / "adir").mkdir()
    path = tmp_path / where
    code, out, err = run_main(capsys, "--metrics-file", str(path))
    assert code == 2 and err.count("\n") == 1 and "Traceback" not in err
    assert f"--metrics-file {path}: cannot write it ({phrase})" in err
    assert "compiled" not in out


def test_read_only_metrics_file_is_refused(tmp_path, capsys, monkeypatch):
    """A read-only file (as root, which writes anyway, the open is made to fail as it
    would for a user)."""
    path = tmp_path / "m.jsonl"
    path.write_text("")
    path.chmod(0o444)
    real_open = open

    def deny(file, *a, **k):
        if str(file) == str(path) and os.geteuid() == 0:
            raise PermissionError(13, "Permission denied", str(file))
        return real_open(file, *a, **k)

    monkeypatch.setattr("builtins.open", deny)
    code, out, err = run_main(capsys, "--metrics-file", str(path))
    assert code == 2 and err.count("\n") == 1
    assert "cannot write it (Permission denied)" in err and "compiled" not in out


def test_checked_metrics_file_is_not_left_behind(tmp_path):
    from engine.cli.args import check_output_file

    check_output_file(str(tmp_path / "m.jsonl"), "--metrics-file")
    assert os.listdir(tmp_path) == []


# -- Ctrl-C --------------------------------------------------------------------------------
def interrupt_after(module, args, line_start, timeout=300):
    """Run `python -m module args`, send SIGINT once a stdout line starts with
    `line_start`; (exit code, stdout, stderr)."""
    env = cli_env()
    proc = subprocess.Popen([sys.executable, "-m", module, *args], cwd=ROOT, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    lines = []
    for raw in proc.stdout:
        lines.append(raw)
        if raw.startswith(line_start.encode()):
            proc.send_signal(signal.SIGINT)
            break
    out, err = proc.communicate(timeout=timeout)
    return proc.returncode, b"".join(lines) + out, err.decode()


@pytest.mark.slow  # a subprocess compiling for tens of seconds; racy on a loaded host
def test_ctrl_c_while_compiling_is_one_line_exit_130():
    code, out, err = interrupt_after("engine.train", CLI, "layout ")
    assert code == 130, (out, err)
    assert err.count("\n") == 1 and "Traceback" not in err, (out, err)
    # the loop reports its own interruption; before it, setup and the compile
    assert err == ("interrupted after step 0\n" if b"compiled the step" in out
                   else "interrupted before training started\n"), (out, err)


# -- --help --------------------------------------------------------------------------------
DOUBLED = re.compile(r"\(default: [^)]*\) \(default:")


def help_text(module_main, capsys) -> str:
    with pytest.raises(SystemExit) as e:
        module_main(["--help"])
    assert e.value.code == 0
    return " ".join(capsys.readouterr().out.split())  # unwrapped


def test_train_help_shows_defaults_once(capsys):
    text = help_text(main, capsys)
    for shown in ("preset dimensions (engine/config.py; default small, or the resumed "
                  "checkpoint's model when it was imported from Hugging Face)",
                  "optimizer steps in the run (default: 50)",
                  "init and batch order are functions of the seed (default: 0)"):
        assert shown in text
    assert "(default: None)" not in text and "(default: False)" not in text
    assert "(default: spec sheet" in text and not DOUBLED.search(text)
    assert "issue" not in text.lower()


def test_generate_help_shows_defaults_once(capsys):
    from engine.cli.generate import main as generate_main

    text = help_text(generate_main, capsys)
    assert "new tokens per prompt at most (default: 200)" in text
    assert "(default: None)" not in text and not DOUBLED.search(text)
    assert "(default: longest prompt + max new tokens)" in text
    assert "issue" not in text.lower()


# -- rates ---------------------------------------------------------------------------------
def test_slow_rates_keep_their_digits():
    import types

    from engine.cli.generate import rate
    from engine.run.loop import Log

    lines = []
    rates = types.SimpleNamespace(tokens=16, flops=1e9, peak=1e12)
    log = Log(every=1, steps=1, rates=rates, say=lines.append)
    log(dict(step=1, loss=1.0, grad_norm=1.0, lr=1e-3, step_time_s=64.0), None)
    assert "| 0.25 tok/s |" in lines[0]
    assert rate(3, 4.0) == "3 tokens in 4.000 s (0.75 tok/s)"
    assert rate(12345, 1.0) == "12345 tokens in 1.000 s (12,345 tok/s)"


# -- the KV cache against memory -----------------------------------------------------------
@pytest.fixture(scope="module")
def tiny_checkpoint(tmp_path_factory):
    """A checkpoint of the tiny preset, built on the host (no compile)."""
    import jax
    from test_checkpoint import host_state, meta, trainer

    from engine.config import model_config
    from engine.parallel.params import param_shapes
    from engine.run import checkpoint

    cfg = model_config("tiny")
    state = host_state(trainer("single", cfg), 0)  # flat: {keystr: array}
    paths, treedef = jax.tree_util.tree_flatten_with_path(param_shapes(cfg))
    params = treedef.unflatten([state.params[jax.tree_util.keystr(p)] for p, _ in paths])
    d = str(tmp_path_factory.mktemp("tiny"))
    checkpoint.save(d, 1, params, state.opt_state, meta(cfg), 1)
    return d


def run_generate(capsys, *args):
    from engine.cli.generate import main as generate_main

    code = generate_main(list(args))
    out, err = capsys.readouterr()
    return code, out, err


@pytest.mark.parametrize("args,phrase", [
    (["--max-new-tokens", "1000000000"],
     "a KV cache of 1,000,000,002 slots for 1 row(s) needs 238.4 GiB per device"),
    (["--cache-len", "1000000000"], "a KV cache of 1,000,000,000 slots"),
    (["--cache-len", "3000000000"], "cache_len=3,000,000,000 must be < 2**31"),
    (["--cache-len", "1e8"], "argument --cache-len: invalid int value: '1e8'"),
    (["--max-new-tokens", "2.5"], "argument --max-new-tokens: invalid int value: '2.5'"),
])
def test_cache_that_cannot_fit_is_refused_up_front(args, phrase, tiny_checkpoint, capsys,
                                                   monkeypatch):
    from engine.parallel import validate

    monkeypatch.setattr(validate, "available_host_memory", lambda: 64 * 2**30)
    code, out, err = run_generate(capsys, "--checkpoint-dir", tiny_checkpoint, "--prompt", "hi",
                                  *args)
    assert code == 2 and out == "" and err.count("\n") == 1, err
    assert phrase in err


def test_cache_bytes_follow_the_layout():
    from engine.config import model_config
    from engine.parallel.layout import Layout
    from engine.parallel.validate import cache_bytes_per_device, decoder_problems

    cfg = model_config("tiny", n_heads=8, n_kv_heads=2, head_dim=8, dtype="f32")
    B, C = 4, 1000
    # fsdp2xtp4: rows over fsdp (2 each), G' = max(2, 4) = 4 heads over tp (1 each)
    per_device = 2 * cfg.n_layers * (B // 2) * C * 1 * cfg.head_dim * 4
    assert cache_bytes_per_device(cfg, Layout.parse("fsdp2xtp4"), B, C) == per_device
    # single: all rows, both kv heads, one device
    single = 2 * cfg.n_layers * B * C * 2 * cfg.head_dim * 4
    assert cache_bytes_per_device(cfg, Layout.parse("single"), B, C) == single
    layout = Layout.parse("fsdp2xtp4")
    assert decoder_problems(cfg, layout, B, C, memory=8 * per_device, devices_per_memory=8) == []
    found = decoder_problems(cfg, layout, B, C, memory=8 * per_device - 1, devices_per_memory=8)
    assert len(found) == 1 and "x 8 devices" in found[0]
    assert decoder_problems(cfg, layout, B, C, memory=None, devices_per_memory=8) == []


def test_decoder_refuses_a_cache_that_cannot_fit(monkeypatch):
    """The rule lives in the library: building a Decoder checks it too."""
    from engine.config import ConfigError, model_config
    from engine.parallel import validate
    from engine.parallel.layout import Layout
    from engine.run.decode import Decoder, Sampling

    monkeypatch.setattr(validate, "available_host_memory", lambda: 2**30)
    layout = Layout.parse("single")
    with pytest.raises(ConfigError, match="a KV cache of 10,000,000 slots"):
        Decoder(model_config("tiny"), layout, layout.mesh(), 1, 10**7, Sampling())


# -- generation: streaming and Ctrl-C ------------------------------------------------------
def test_stream_holds_back_a_possible_stop_and_split_utf8():
    from engine.cli.generate import Stop, Stream
    from engine.text.tokenizer import ByteTokenizer

    written = []
    stream = Stream(Stop(ByteTokenizer(), "\n\n"), written.append)
    text = "héllo\n\n".encode()
    reasons = [""] * (len(text) - 1) + ["stop"]
    for token, reason in zip(text, reasons):
        stream(0, token, reason)
    assert "".join(written) == "héllo"
    assert "\ufffd" not in "".join(written)  # é's two bytes were never split
    assert written[0] == "h" and len(written) >= 4  # written as decoded, not at the end
    interrupted = []
    stream = Stream(Stop(ByteTokenizer(), "xyz"), interrupted.append)
    for token in b"abcxy":
        stream(0, token, "")
    assert "".join(interrupted) == "abc"  # "xy" may begin the stop
    stream.close()
    assert "".join(interrupted) == "abcxy"


def interrupting_step(after: int):
    """A Decoder.step that raises KeyboardInterrupt (as Ctrl-C would) on call `after`."""
    from engine.run.decode import Decoder

    real, calls = Decoder.step, []

    def step(self, *a, **k):
        calls.append(1)
        if len(calls) == after:
            raise KeyboardInterrupt
        return real(self, *a, **k)

    return step


@pytest.mark.parametrize("prompts", [["hi"], ["hi", "hello"]])
def test_interrupted_generation_keeps_its_text(prompts, tiny_checkpoint, capsys,
                                               monkeypatch):
    """One prompt streams; several print every row's text so far; exit 130, one line."""
    from engine.run.decode import Decoder

    monkeypatch.setattr(Decoder, "step", interrupting_step(after=4))
    args = [a for p in prompts for a in ("--prompt", p)]
    code, out, err = run_generate(capsys, "--checkpoint-dir", tiny_checkpoint, *args,
                                  "--max-new-tokens", "50", "--temperature", "0")
    assert code == 130, err
    assert err == "interrupted after 4 new token(s)\n"  # prefill's token and 3 steps
    if len(prompts) == 1:
        assert "=== 1: 2 prompt bytes ===\nhi" in out and "=== 1: 4 new (interrupted) ===" in out
    else:
        assert "=== 1: 2 prompt bytes + 4 new (interrupted) ===\nhi" in out
        assert "=== 2: 5 prompt bytes + 4 new (interrupted) ===\nhello" in out


def test_ctrl_c_while_generate_compiles_is_one_line(tiny_checkpoint, capsys, monkeypatch):
    from engine.run.decode import Decoder

    def compile(self, *a, **k):
        raise KeyboardInterrupt

    monkeypatch.setattr(Decoder, "compile", compile)
    code, out, err = run_generate(capsys, "--checkpoint-dir", tiny_checkpoint, "--prompt", "hi")
    assert code == 130 and err == "interrupted before generating\n"
