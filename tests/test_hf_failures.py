"""Bad input to `engine.convert` and `engine.train --init-from-hf`: one line on stderr,
exit code 2, no traceback; and the model features behind the converter against their
definitions (llama3 RoPE scaling, vocab padding kept out of the loss)."""
from __future__ import annotations

import json
import os
import shutil

import hf_models
import jax.numpy as jnp
import numpy as np
import pytest

from engine.cli.convert import main as convert_main
from engine.cli.train import main as train_main
from engine.hf import convert


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory):
    return hf_models.save("llama2", str(tmp_path_factory.mktemp("hf") / "llama2"))


def copy(hf_dir, tmp_path):
    out = str(tmp_path / "copy")
    shutil.copytree(hf_dir, out)
    return out


def edit_config(directory, **fields):
    path = os.path.join(directory, "config.json")
    with open(path) as f:
        cfg = json.load(f)
    cfg.update(fields)
    with open(path, "w") as f:
        json.dump(cfg, f)


def refused(capsys, main, argv, *words):
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("error: "), err
    assert "Traceback" not in err
    for w in words:
        assert w in err, err


def test_no_config(capsys, tmp_path):
    os.makedirs(tmp_path / "empty")
    refused(capsys, convert_main, ["from-hf", str(tmp_path / "empty"), "--checkpoint-dir",
                                   str(tmp_path / "ck")], "no config.json")


def test_unsupported_architecture(capsys, hf_dir, tmp_path):
    d = copy(hf_dir, tmp_path)
    edit_config(d, architectures=["GPT2LMHeadModel"])
    refused(capsys, convert_main, ["from-hf", d, "--checkpoint-dir", str(tmp_path / "ck")],
            "GPT2LMHeadModel", "LlamaForCausalLM", "MistralForCausalLM", "MixtralForCausalLM")


def test_truncated_shard(capsys, hf_dir, tmp_path):
    d = copy(hf_dir, tmp_path)
    path = os.path.join(d, "model.safetensors")
    with open(path, "r+b") as f:
        f.truncate(os.path.getsize(path) - 100)
    refused(capsys, convert_main, ["from-hf", d, "--checkpoint-dir", str(tmp_path / "ck")],
            "truncated")


def test_missing_shard(capsys, hf_dir, tmp_path):
    d = copy(hf_dir, tmp_path)
    os.rename(os.path.join(d, "model.safetensors"),
              os.path.join(d, "model-00001-of-00002.safetensors"))
    with open(os.path.join(d, "model.safetensors.index.json"), "w") as f:
        json.dump({"weight_map": {"lm_head.weight": "model-00002-of-00002.safetensors",
                                  "model.norm.weight": "model-00001-of-00002.safetensors"}}, f)
    refused(capsys, convert_main, ["from-hf", d, "--checkpoint-dir", str(tmp_path / "ck")],
            "missing safetensors file", "model-00002-of-00002")


def test_shape_disagrees_with_config(capsys, hf_dir, tmp_path):
    d = copy(hf_dir, tmp_path)
    edit_config(d, intermediate_size=128)
    refused(capsys, convert_main, ["from-hf", d, "--checkpoint-dir", str(tmp_path / "ck")],
            "gate_proj", "[96, 64]", "[128, 64]")


def test_attention_bias_refused(capsys, hf_dir, tmp_path):
    d = copy(hf_dir, tmp_path)
    edit_config(d, attention_bias=True)
    refused(capsys, convert_main, ["from-hf", d, "--checkpoint-dir", str(tmp_path / "ck")],
            "attention_bias")


def test_init_from_hf_flags_disagree(capsys, hf_dir):
    refused(capsys, train_main, ["--init-from-hf", hf_dir, "--d-model", "128", "--heads", "4"],
            "--d-model 128 (config: 64)")


def test_sliding_window_shorter_than_seq(capsys, hf_dir, tmp_path):
    d = copy(hf_dir, tmp_path)
    edit_config(d, architectures=["MistralForCausalLM"], sliding_window=8)
    refused(capsys, train_main, ["--init-from-hf", d, "--seq", "16"], "sliding_window=8")


def test_export_into_nonempty_dir(capsys, hf_dir, tmp_path):
    ck, out = str(tmp_path / "ck"), tmp_path / "out"
    assert convert_main(["from-hf", hf_dir, "--checkpoint-dir", ck]) == 0
    os.makedirs(out)
    (out / "keep.txt").write_text("mine")
    refused(capsys, convert_main, ["to-hf", "--checkpoint-dir", ck, "--out", str(out)],
            "not empty", "--force")
    assert convert_main(["to-hf", "--checkpoint-dir", ck, "--out", str(out), "--force"]) == 0
    assert (out / "keep.txt").read_text() == "mine"


def test_import_streams_one_param_at_a_time(hf_dir, tmp_path, monkeypatch):
    """The importer never asks for a second param before the first is written."""
    from engine.run import checkpoint_stream

    alive = []
    real = checkpoint_stream.pieces.layout

    def spy(found, start=0):
        alive.append(start)
        return real(found, start)

    monkeypatch.setattr(checkpoint_stream.pieces, "layout", spy)
    produced = []
    real_import = convert.weights.import_param

    def counting(param, *a, **k):
        produced.append(param)
        assert len(produced) == len(alive) + 1, "a param made before the last was written"
        return real_import(param, *a, **k)

    monkeypatch.setattr(convert.weights, "import_param", counting)
    convert.import_hf(hf_dir, str(tmp_path / "ck"))
    assert len(produced) == len(alive) > 5


def test_llama3_frequencies_match_transformers():
    """layers/rope.py's scaled frequencies against transformers' own llama3 init."""
    import transformers
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    from layers.rope import Rope, frequencies

    cfg = transformers.LlamaConfig(**hf_models.families()["llama31"][2])
    want, _ = ROPE_INIT_FUNCTIONS["llama3"](cfg, "cpu")
    r = hf_models.LLAMA3_ROPE
    got = frequencies(16, Rope(r["rope_theta"], r["factor"], r["low_freq_factor"],
                               r["high_freq_factor"], r["original_max_position_embeddings"]))
    np.testing.assert_allclose(np.asarray(got), want.numpy(), rtol=1e-6)
    assert not np.allclose(np.asarray(got), np.asarray(frequencies(16, r["rope_theta"])))


def test_padding_ids_are_out_of_the_loss():
    """Cross-entropy over a padded unembedding equals it over the real columns alone,
    whatever the padding columns hold."""
    from layers.axes import Axes
    from layers.vocab import cross_entropy

    rng = np.random.default_rng(0)
    h = jnp.asarray(rng.normal(size=(2, 5, 8)), jnp.float32)
    w = rng.normal(size=(8, 13)).astype(np.float32)
    t = jnp.asarray(rng.integers(0, 13, (2, 5)))
    padded = np.concatenate([w, 50 * np.ones((8, 3), np.float32)], axis=1)
    want = cross_entropy(h, jnp.asarray(w), t, Axes(), jnp.float32)
    got = cross_entropy(h, jnp.asarray(padded), t, Axes(), jnp.float32, n_valid=13)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-6)
    unmasked = cross_entropy(h, jnp.asarray(padded), t, Axes(), jnp.float32)
    assert not np.allclose(np.asarray(unmasked), np.asarray(want))
