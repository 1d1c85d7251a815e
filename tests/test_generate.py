"""Decoding with the sharded KV cache (engine/run/decode.py, layers/cache.py) and the
`python -m engine.generate` CLI.

One model, trained in-process for a few seconds on the synthetic task (arithmetic
progressions), serves every test: its logits are confident, so greedy tokens do not sit
on near-ties that f32 reordering across layouts could flip.
Model: H=8 heads over G=2 kv heads, so tp=2 shards the cache's kv heads and tp=4, 8
cache one (repeated) kv head per rank."""
import dataclasses
import os
import subprocess
import sys

import jax
import numpy as np
import pytest
import reference_model as ref
from jax.sharding import NamedSharding
from subprocess_env import cli_env

from engine.cli.generate import generate
from engine.config import TrainConfig, model_config
from engine.parallel.layout import Layout
from engine.parallel.params import param_specs
from engine.run import checkpoint
from engine.run.data import synthetic_tokens
from engine.run.decode import Decoder, Sampling
from engine.run.step import Trainer

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CFG = model_config("tiny", n_heads=8, n_kv_heads=2, head_dim=8, dtype="f32", remat="none")
TCFG = TrainConfig(batch=16, seq=32, steps=300, lr=1e-2, warmup=10)
LAYOUTS = ["single", "dp8", "fsdp8", "tp8", "fsdp4xtp2", "fsdp2xtp4", "dp2xfsdp2xtp2"]
B, NEW = 8, 8
LENGTHS = [8, 3, 5, 8, 4, 6, 7, 2]  # right-padded to 8: padding must not change any row
# f32 on both sides; the sharded programs sum in another order (tp psums, split
# matmuls): 1e-5 relative to each step's largest logit is ~100 ulps.
RTOL = 1e-5


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """(host params, checkpoint dir) of a model trained 300 steps on progressions."""
    lay = Layout.parse("single")
    trainer = Trainer(CFG, TCFG, lay, lay.mesh())
    params, opt_state = trainer.init(TCFG.seed)
    for step in range(TCFG.steps):
        tokens = synthetic_tokens(TCFG.seed, step, TCFG.batch, TCFG.seq, CFG.vocab)
        params, opt_state, _ = trainer.train_step(params, opt_state, trainer.put_batch(tokens))
    directory = str(tmp_path_factory.mktemp("ck"))
    meta = dict(rng=dict(seed=TCFG.seed), model=dataclasses.asdict(CFG),
                train=dataclasses.asdict(TCFG), layout="single",
                data=dict(source="synthetic", dtype="uint16"))
    checkpoint.save(directory, TCFG.steps, params, opt_state, meta, keep=1)
    return jax.tree.map(np.asarray, params), directory


def place(params, layout: Layout, mesh):
    return jax.tree.map(lambda x, s: jax.device_put(x, NamedSharding(mesh, s)), params,
                        param_specs(CFG, layout))


def prompts():
    """B progressions (strides 1..4), row b cut to LENGTHS[b] tokens."""
    rows = synthetic_tokens(7, 0, B, max(LENGTHS) + NEW, CFG.vocab)
    return [row[:n].tolist() for row, n in zip(rows, LENGTHS)], rows


def ref_logits(params, tokens_BL):
    """The plain model (tests/reference_model.py) on whole sequences: [B, L, V]."""
    return ref.logits(params, tokens_BL, CFG.n_layers, CFG.rope_theta, CFG.norm_eps)


def decode(layout_name, params, sampling=Sampling(), seed=0):
    """Greedy (by default) prefill + NEW-1 steps -> (tokens [B, NEW], logits [NEW, B, V])."""
    lay = Layout.parse(layout_name)
    mesh = lay.mesh()
    decoder = Decoder(CFG, lay, mesh, B, max(LENGTHS) + NEW, sampling)
    params = place(params, lay, mesh)
    prompt_rows, _ = prompts()
    tokens_BL = np.zeros((B, max(LENGTHS)), np.int32)
    for b, row in enumerate(prompt_rows):
        tokens_BL[b, :len(row)] = row
    lengths_B = np.array(LENGTHS, np.int32)
    cache, next_B, logits_BV = decoder.prefill(params, tokens_BL, lengths_B, seed)
    tokens, logits = [np.asarray(next_B)], [np.asarray(logits_BV)]
    for t in range(1, NEW):
        cache, next_B, logits_BV = decoder.step(params, cache, next_B, lengths_B + t - 1, t, seed)
        tokens.append(np.asarray(next_B))
        logits.append(np.asarray(logits_BV))
    return np.stack(tokens, axis=1), np.stack(logits)


@pytest.fixture(scope="module")
def single(trained):
    return decode("single", trained[0])


@pytest.mark.parametrize("layout", LAYOUTS)
def test_cached_logits_equal_full_sequence_rerun(layout, trained, single):
    params = trained[0]
    tokens_BN, logits_NBV = single if layout == "single" else decode(layout, params)
    prompt_rows, _ = prompts()
    full_BL = np.zeros((B, max(LENGTHS) + NEW), np.int32)
    for b, row in enumerate(prompt_rows):
        full_BL[b, :LENGTHS[b] + NEW] = row + tokens_BN[b].tolist()
    want_BLV = np.asarray(jax.jit(ref_logits)(params, full_BL))
    for t in range(NEW):
        want_BV = want_BLV[np.arange(B), np.array(LENGTHS) - 1 + t]
        err = float(np.max(np.abs(logits_NBV[t] - want_BV)))
        assert err <= RTOL * float(np.max(np.abs(want_BV))), f"token {t}: error {err:.2e}"
    np.testing.assert_array_equal(tokens_BN, single[0], err_msg="greedy differs from single")


def test_trained_model_continues_progressions(single):
    _, rows = prompts()
    for b, n in enumerate(LENGTHS):
        if n >= 3:  # two tokens fix the stride; three let the model see it twice
            np.testing.assert_array_equal(single[0][b], rows[b, n:n + NEW], err_msg=f"row {b}")


def test_sampling_is_reproducible_and_layout_invariant(trained):
    params, hot = trained[0], Sampling(temperature=1.5, top_k=4)
    lay = Layout.parse("single")
    decoder = Decoder(CFG, lay, lay.mesh(), B, max(LENGTHS) + NEW, hot)
    placed = place(params, lay, lay.mesh())
    prompt_rows, _ = prompts()
    first = generate(decoder, placed, prompt_rows, NEW, seed=1)
    again = generate(decoder, placed, prompt_rows, NEW, seed=1)
    other = generate(decoder, placed, prompt_rows, NEW, seed=2)
    assert first.tokens == again.tokens and other.tokens != first.tokens
    sharded, _ = decode("fsdp2xtp4", params, hot, seed=1)
    np.testing.assert_array_equal(sharded, np.array(first.tokens))


def run_cli(*args, timeout=300):
    env = cli_env()  # the CLI must force devices
    return subprocess.run([sys.executable, "-m", "engine.generate", *args], cwd=ROOT, env=env,
                          capture_output=True, timeout=timeout)


def test_cli_greedy_with_stop(trained):
    r = run_cli("--checkpoint-dir", trained[1], "--prompt", "ACEGIKMO", "--prompt", "abcdefgh",
                "--prompt", "ADGJ", "--temperature", "0", "--max-new-tokens", "8",
                "--stop", "lm", "--layout", "fsdp2xtp4")
    out = r.stdout.decode()
    assert r.returncode == 0, r.stderr.decode()
    assert "=== 1: 8 prompt bytes + 8 new (max tokens) ===\nACEGIKMOQSUWY[]_\n" in out
    assert "=== 2: 8 prompt bytes + 5 new (stop) ===\nabcdefghijk\n" in out
    assert "=== 3: 4 prompt bytes + 8 new (max tokens) ===\nADGJMPSVY\\_b\n" in out
    assert "prefill: 20 tokens in" in out and "| decode: " in out and "tok/s" in out


def test_cli_generates_from_a_checkpoint_a_pp_layout_saved(trained, tmp_path):
    """The trained params as a pp2xfsdp4 trainer holds them (blocks sharded over the
    stages), saved as that layout's checkpoint: decoding it on tp2 continues the
    progression as the single-layout checkpoint does (test_cli_greedy_with_stop)."""
    from engine.config import ParallelConfig

    lay = Layout.parse("pp2xfsdp4")
    t = Trainer(CFG, TCFG, lay, lay.mesh(), ParallelConfig(microbatches=2))
    shard = lambda specs: jax.tree.map(lambda s: NamedSharding(t.mesh, s), specs)  # noqa: E731
    params = jax.device_put(t.store(jax.device_put(trained[0], shard(t.specs))), shard(t.specs))
    opt_state = jax.jit(t.tx.init, out_shardings=shard(t.opt_specs))(params)
    assert "pp" in str(params["blocks"]["wq"].sharding.spec)
    meta = dict(rng=dict(seed=TCFG.seed), model=dataclasses.asdict(CFG),
                train=dataclasses.asdict(TCFG), layout="pp2xfsdp4",
                data=dict(source="synthetic", dtype="uint16"))
    checkpoint.save(str(tmp_path), TCFG.steps, t.unstore(params), opt_state, meta, keep=1)
    r = run_cli("--checkpoint-dir", str(tmp_path), "--prompt", "ACEGIKMO", "--temperature",
                "0", "--max-new-tokens", "8", "--layout", "tp2")
    assert r.returncode == 0, r.stderr.decode()
    out = r.stdout.decode()
    assert "trained under pp2xfsdp4" in out and "\nACEGIKMOQSUWY[]_\n" in out, out


@pytest.fixture(scope="module")
def small_vocab_checkpoint(tmp_path_factory):
    cfg = dataclasses.replace(CFG, vocab=128)
    lay = Layout.parse("single")
    params, opt_state = Trainer(cfg, TCFG, lay, lay.mesh()).init(0)
    directory = str(tmp_path_factory.mktemp("v128"))
    checkpoint.save(directory, 1, params, opt_state, dict(model=dataclasses.asdict(cfg)), 1)
    return directory


def bad_cases(trained, small_vocab, tmp_path):
    latin1 = tmp_path / "latin1.txt"
    latin1.write_bytes("caf\u00e9\n".encode("latin-1"))
    return {
        "no checkpoint": (["--checkpoint-dir", str(tmp_path), "--prompt", "a"],
                          f"no checkpoint in {tmp_path}"),
        "prompt longer than cache": (
            ["--checkpoint-dir", trained, "--prompt", "x" * 20, "--cache-len", "16"],
            "prompt 1 is 20 bytes; with max_new_tokens=200 it needs 220 cache slots, "
            "more than cache_len=16"),
        "non-UTF-8 prompts file": (["--checkpoint-dir", trained, "--prompts-file", str(latin1)],
                                   "is not UTF-8 text (byte 3: b'\\xe9')"),
        "non-byte prompt": (["--checkpoint-dir", trained, "--prompt", b"\xff"],
                            "--prompt number 1 is not valid UTF-8 text"),
        "vocab < 256": (["--checkpoint-dir", small_vocab, "--prompt", "a"],
                        "has vocab=128; tokenizer bytes (256 tokens, no EOS) needs vocab >= 256"),
        "layout": (["--checkpoint-dir", trained, "--prompt", "a", "--layout", "tp16"],
                   "heads=8 not divisible by tp=16"),
        "numbers": (["--checkpoint-dir", trained, "--prompt", "a", "--max-new-tokens", "0",
                     "--temperature", "-1", "--top-k", "0"],
                    "max_new_tokens=0 must be >= 1; temperature=-1.0 must be >= 0 (0 is "
                    "greedy); top_k=0 must be >= 1"),
        "no prompt": (["--checkpoint-dir", trained], "no prompt: pass --prompt"),
    }


@pytest.mark.parametrize("case", ["no checkpoint", "prompt longer than cache",
                                  "non-UTF-8 prompts file", "non-byte prompt", "vocab < 256",
                                  "layout", "numbers", "no prompt"])
def test_bad_input_is_one_line_exit_2(case, trained, small_vocab_checkpoint, tmp_path):
    args, phrase = bad_cases(trained[1], small_vocab_checkpoint, tmp_path)[case]
    r = run_cli(*args, timeout=120)
    stderr = r.stderr.decode()
    assert r.returncode == 2, stderr
    assert phrase in stderr
    assert stderr.count("\n") == 1 and "Traceback" not in stderr
    assert r.stdout == b""


def test_cli_takes_a_checkpoint_file(trained, capsys):
    """--checkpoint-dir naming a checkpoint file generates from that checkpoint, as the
    directory holding it does (test_cli_greedy_with_stop)."""
    from engine.cli.generate import main

    ((_, path),) = checkpoint.list_checkpoints(trained[1])
    assert main(["--checkpoint-dir", path, "--prompt", "ACEGIKMO", "--temperature", "0",
                 "--max-new-tokens", "8"]) == 0
    out = capsys.readouterr().out
    assert f"checkpoint {path} (step 300" in out and "ACEGIKMOQSUWY[]_" in out
