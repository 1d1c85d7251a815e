"""Hugging Face weights in and out, checked against `transformers` (code this project did
not write): logits, loss and the grad of every tensor, on `single` and on sharded layouts;
export -> transformers loads it; greedy decoding; bad input.

Tolerance: 1e-4 relative to the largest magnitude of each compared tensor. Both sides are
f32; they differ in summation order (torch's matmuls and softmax vs XLA's, psum trees on
sharded layouts), which moves results by ~1e-6 relative; 1e-4 leaves room for that and
is far below what a mapping error moves (a swapped norm, a wrong transpose, unscaled
RoPE change the logits by O(1)).
"""
from __future__ import annotations

import dataclasses
import json
import os

import hf_models
import jax
import numpy as np
import pytest

from engine.config import ParallelConfig, TrainConfig
from engine.hf import convert, weights
from engine.parallel.layout import Layout
from engine.run import checkpoint
from engine.run.decode import Decoder, Sampling
from engine.run.step import Trainer

RTOL = 1e-4
B, L = 4, 16
FAMILIES = list(hf_models.families())


def assert_close(got, want, what=""):
    err, bound = float(np.max(np.abs(got - want))), RTOL * float(np.max(np.abs(want)))
    assert err <= bound, f"{what}: error {err:.2e} > {bound:.2e}"


@pytest.fixture(scope="module")
def made(tmp_path_factory):
    """{family: (HF dir, checkpoint dir)} made on first use: save_pretrained, then
    `engine.convert from-hf` (params padded to a multiple of 8)."""
    cache = {}

    def get(name):
        if name not in cache:
            root = tmp_path_factory.mktemp(name)
            hf_dir = hf_models.save(name, str(root / "hf"))
            ck_dir = str(root / "ck")
            convert.import_hf(hf_dir, ck_dir, vocab_multiple=8)
            cache[name] = hf_dir, ck_dir
        return cache[name]

    return get


def tokens(seed=0):
    return np.random.default_rng(seed).integers(0, hf_models.VOCAB, (B, L + 1)).astype(np.int32)


def model_of(ck_dir):
    ckpt = checkpoint.latest(ck_dir)
    cfg = dataclasses.replace(convert.checkpoint_config(ckpt.meta), dtype="f32",
                              attention="reference")
    return ckpt, cfg


def ours_loss_and_grads(ck_dir, layout, parallel=ParallelConfig()):
    """shardwise's loss and grads {HF name: array} on `layout`."""
    ckpt, cfg = model_of(ck_dir)
    lay = Layout.parse(layout)
    trainer = Trainer(cfg, TrainConfig(batch=B, seq=L), lay, lay.mesh(), parallel)
    params, _ = checkpoint.restore(ckpt, trainer)
    loss, grads, _ = trainer.loss_and_grads(params, trainer.put_batch(tokens()))
    flat = {jax.tree_util.keystr(p): np.asarray(g)
            for p, g in jax.tree_util.tree_flatten_with_path(grads)[0]}
    by_key = {convert.key_path(p): p for p in weights.BY_PARAM}
    hf = {name: make() for key, g in flat.items()
          for name, make in weights.export_param(by_key[key], g, cfg)}
    return float(loss), hf


def ours_logits(ck_dir, layout, lengths, ckpt=None):
    """shardwise's logits [B, V] of token lengths[b] - 1 of row b (one prefill)."""
    found, cfg = model_of(ck_dir)
    ckpt = ckpt or found
    lay = Layout.parse(layout)
    mesh = lay.mesh()
    decoder = Decoder(cfg, lay, mesh, B, L, Sampling())
    trainer = Trainer(cfg, TrainConfig(batch=B, seq=L), lay, mesh)
    params = checkpoint.restore_params(ckpt, trainer)
    _, _, logits_BV = decoder.prefill(params, tokens()[:, :L], np.asarray(lengths, np.int32), 0)
    return np.asarray(logits_BV)[:, :hf_models.VOCAB], np.asarray(logits_BV)


def check_loss_and_grads(made, family, layout, parallel=ParallelConfig()):
    hf_dir, ck_dir = made(family)
    want_loss, want = hf_models.loss_and_grads(hf_dir, tokens())
    loss, got = ours_loss_and_grads(ck_dir, layout, parallel)
    assert abs(loss - want_loss) <= RTOL * abs(want_loss), (loss, want_loss)
    assert sorted(got) == sorted(want)
    for name in want:
        assert_close(got[name], want[name], f"{family} {layout} grad {name}")


@pytest.mark.parametrize("family", FAMILIES)
def test_loss_and_grads_match_transformers_on_single(made, family):
    check_loss_and_grads(made, family, "single")


LENGTHS = [16, 11, 7, 3]


@pytest.mark.parametrize("family,layout", [
    ("llama2", "single"), ("llama31", "fsdp2xtp2"), ("llama32-tied", "tp4"),
    ("mixtral", "ep2xtp2")])
def test_logits_match_transformers(made, family, layout):
    """Prefill logits of rows of different lengths; tp4 > the 2 kv heads, and shards the
    tied, padded (1008) vocab over tp."""
    hf_dir, ck_dir = made(family)
    want_BLV = hf_models.logits(hf_dir, tokens()[:, :L])
    want = np.stack([want_BLV[b, n - 1] for b, n in enumerate(LENGTHS)])
    got, padded = ours_logits(ck_dir, layout, LENGTHS)
    assert_close(got, want, f"{family} {layout} logits")
    assert np.all(np.isneginf(padded[:, hf_models.VOCAB:])), "padding ids must not be sampled"


def case(family, layout, slow=False, **parallel):
    marks = [pytest.mark.slow] if slow else []
    name = "-".join([family, layout, *(f"{k}{v}" for k, v in parallel.items())])
    return pytest.param(family, layout, ParallelConfig(**parallel), marks=marks, id=name)


# fsdp x tp, pp, cp and the tied embedding under ZeRO-2 by default; the rest slow
SWEEP = [case("llama2", "fsdp2xtp2"),
         case("llama32-tied", "pp2", microbatches=2),
         case("mistral", "cp2"),
         case("llama32-tied", "fsdp2xtp2", zero=2),
         case("llama31", "tp4", slow=True),
         case("llama32-tied", "fsdp2xtp4", slow=True),
         case("mixtral", "ep4", slow=True),
         case("mixtral", "fsdp2xep2", slow=True),
         case("llama32-tied", "fsdp4", slow=True, zero=1)]


@pytest.mark.parametrize("family,layout,parallel", SWEEP)
def test_loss_and_grads_match_transformers_sharded(made, family, layout, parallel):
    check_loss_and_grads(made, family, layout, parallel)


def test_round_trip_train_export_load(made, tmp_path, capsys):
    """Import, 3 training steps on fsdp4xtp2 (engine.train), export (engine.convert):
    transformers loads the export, and its logits are the trained checkpoint's; the
    source's tokenizer file travels along."""
    from engine.cli.convert import main as convert_main
    from engine.cli.train import main as train_main

    hf_dir, _ = made("llama32-tied")
    with open(os.path.join(hf_dir, "tokenizer.json"), "w") as f:
        f.write('{"version": "1.0", "model": {"type": "BPE"}}')
    ck = str(tmp_path / "ck")
    assert convert_main(["from-hf", hf_dir, "--checkpoint-dir", ck]) == 0
    assert train_main(["--resume", "--checkpoint-dir", ck, "--layout", "fsdp4xtp2",
                       "--steps", "3", "--batch", "8", "--seq", "16", "--dtype", "f32",
                       "--lr", "1e-2", "--warmup", "1", "--log-every", "3"]) == 0
    # an imported model has no schedule of its own: the run's --steps is its horizon
    assert "horizon" not in capsys.readouterr().out
    out = str(tmp_path / "out")
    assert convert_main(["to-hf", "--checkpoint-dir", ck, "--out", out, "--dtype", "f32",
                         "--max-shard-size", "200KB"]) == 0
    assert os.path.exists(os.path.join(out, "model.safetensors.index.json"))
    with open(os.path.join(out, "tokenizer.json")) as f:
        assert '"BPE"' in f.read()
    assert not os.path.exists(os.path.join(out, "tokenizer_config.json"))
    trained = checkpoint.latest(ck)
    assert trained.step == 3
    got, _ = ours_logits(ck, "single", LENGTHS, trained)
    want_BLV = hf_models.logits(out, tokens()[:, :L])
    assert_close(got, np.stack([want_BLV[b, n - 1] for b, n in enumerate(LENGTHS)]),
                 "exported logits")
    before = hf_models.logits(hf_dir, tokens()[:, :L])
    assert np.max(np.abs(before - want_BLV)) > 1e-3, "training changed nothing"


@pytest.mark.parametrize("family", ["llama31", "mixtral"])
def test_greedy_decoding_matches_transformers_generate(made, family):
    hf_dir, ck_dir = made(family)
    prompt, new = tokens()[:, :5], 6
    want = hf_models.generate(hf_dir, prompt, new)
    ckpt, cfg = model_of(ck_dir)
    lay = Layout.parse("tp2")
    mesh = lay.mesh()
    decoder = Decoder(cfg, lay, mesh, B, 5 + new, Sampling())
    params = checkpoint.restore_params(ckpt, Trainer(cfg, TrainConfig(batch=B, seq=L), lay,
                                                     mesh))
    lengths = np.full(B, 5, np.int32)
    cache, next_B, _ = decoder.prefill(params, prompt, lengths, 0)
    got = [np.asarray(next_B)]
    for t in range(1, new):
        cache, next_B, _ = decoder.step(params, cache, next_B, lengths + t - 1, t, 0)
        got.append(np.asarray(next_B))
    np.testing.assert_array_equal(np.stack(got, axis=1), want)


def test_native_model_exports_as_llama(tmp_path):
    """A model shardwise initialised and trained exports as LlamaForCausalLM, and
    transformers' logits of the export are shardwise's."""
    from engine.cli.convert import main as convert_main
    from engine.cli.train import main as train_main

    ck, out = str(tmp_path / "ck"), str(tmp_path / "out")
    assert train_main(["--model", "tiny", "--vocab", "1001", "--steps", "2", "--batch", "4",
                       "--seq", "16", "--dtype", "f32", "--checkpoint-dir", ck,
                       "--log-every", "2"]) == 0
    assert convert_main(["to-hf", "--checkpoint-dir", ck, "--out", out, "--dtype", "f32"]) == 0
    with open(os.path.join(out, "config.json")) as f:
        assert json.load(f)["architectures"] == ["LlamaForCausalLM"]
    got, _ = ours_logits(ck, "single", LENGTHS)
    want_BLV = hf_models.logits(out, tokens()[:, :L])
    assert_close(got, np.stack([want_BLV[b, n - 1] for b, n in enumerate(LENGTHS)]),
                 "native export logits")
