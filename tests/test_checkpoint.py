"""Checkpoints: exact round trip per layout, re-sharding on load, bitwise resume, atomic
files, and bad checkpoints refused with one line and exit code 2.

Model: H=8 heads over G=2 kv heads so tp8 (kv replicated) and tp2 (kv sharded) both fit.
Compiles are the cost here (a train step ~10 s on this machine, a forward ~3 s, and
`Trainer.init` ~10 s), so states are built on the host and placed with `restore`, one
layout compiles the train step, and the other layouts compile only a forward loss."""
import dataclasses
import functools
import os
import zlib

import jax
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

from engine.cli.train import main
from engine.config import TrainConfig, model_config
from engine.parallel.layout import Layout
from engine.parallel.params import fsdp_dims, param_shapes
from engine.run import checkpoint, pieces
from engine.run.data import synthetic_tokens
from engine.run.step import Trainer
from layers import model

CFG = model_config("tiny", n_heads=8, n_kv_heads=2, head_dim=8, dtype="f32")
TCFG = TrainConfig(batch=8, seq=16, steps=3, warmup=1, lr=1e-2)
LOADED_IN = ["single", "dp8", "fsdp8", "fsdp2xtp4"]
# The same params in another layout: only the order of f32 sums changes (psum trees,
# split matmuls); 1e-5 relative is ~100 ulps, as in test_step.py.
RTOL = 1e-5


def meta(cfg=CFG, layout="single") -> dict:
    return dict(rng=dict(seed=TCFG.seed), model=dataclasses.asdict(cfg), layout=layout,
                train=dataclasses.asdict(TCFG), data=dict(source="synthetic", dtype="uint16"))


@functools.lru_cache(maxsize=None)
def trainer(layout: str, cfg=CFG) -> Trainer:
    lay = Layout.parse(layout)
    return Trainer(cfg, TCFG, lay, lay.mesh())


def host_state(t: Trainer, seed: int) -> checkpoint.Checkpoint:
    """A state like `Trainer.init`'s, built in numpy: weights N(0, 0.02), norm scales 1,
    Adam moments random (so a mix-up of mu and nu shows), step counts `seed`."""
    rng = np.random.default_rng(seed)
    shapes = param_shapes(t.cfg)

    def flat(tree, leaf):
        return {jax.tree_util.keystr(p): leaf(jax.tree_util.keystr(p), x)
                for p, x in jax.tree_util.tree_flatten_with_path(tree)[0]}

    def param(key, x):
        if "norm" in key:
            return np.ones(x.shape, np.float32)
        return (0.02 * rng.standard_normal(x.shape)).astype(np.float32)

    def opt(key, x):
        if x.dtype == np.int32:
            return np.full(x.shape, seed, np.int32)
        return (1e-3 * np.abs(rng.standard_normal(x.shape))).astype(np.float32)

    return checkpoint.Checkpoint("<host>", 0, meta(t.cfg), flat(shapes, param),
                                 flat(jax.eval_shape(t.tx.init, shapes), opt))


def batch(t: Trainer, step: int):
    return t.put_batch(synthetic_tokens(TCFG.seed, step, TCFG.batch, TCFG.seq, CFG.vocab))


@functools.lru_cache(maxsize=None)
def forward_loss(t: Trainer):
    """Loss only, under t's layout (a forward compiles ~4x faster than the train step)."""
    return jax.jit(jax.shard_map(
        lambda params, tokens: model.loss(params, tokens[:, :-1], tokens[:, 1:], fsdp_dims(),
                                          t.cfg, t.axes),
        mesh=t.mesh, in_specs=(t.specs, t.batch_spec), out_specs=P()))


def flat_host(tree) -> dict:
    return {jax.tree_util.keystr(p): np.asarray(x)
            for p, x in jax.tree_util.tree_flatten_with_path(tree)[0]}


def assert_same(got: dict, want: dict):
    assert got.keys() == want.keys()
    for k in want:
        assert got[k].dtype == want[k].dtype and np.array_equal(got[k], want[k]), k


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """Three train steps under fsdp4xtp2 with a checkpoint after the first, and that
    checkpoint re-saved from tp8. -> dict(paths {layout: path}, losses [3], final params)"""
    t, directory = trainer("fsdp4xtp2"), str(tmp_path_factory.mktemp("run"))
    params, opt_state = checkpoint.restore(host_state(t, 0), t)
    losses = []
    for step in range(TCFG.steps):
        params, opt_state, m = t.train_step(params, opt_state, batch(t, step))
        losses.append(float(m["loss"]))
        if step == 0:
            path = checkpoint.save(directory, 1, params, opt_state, meta(layout="fsdp4xtp2"), 2)
    tp8 = checkpoint.restore(checkpoint.read(path), trainer("tp8"))
    tp8_path = checkpoint.save(str(tmp_path_factory.mktemp("tp8")), 1, *tp8,
                               meta(layout="tp8"), 2)
    return dict(paths={"fsdp4xtp2": path, "tp8": tp8_path}, losses=losses,
                final=flat_host(params))


@pytest.mark.parametrize("layout", ["single", "dp8", "fsdp8", "tp8", "fsdp4xtp2", "fsdp2xtp4"])
def test_round_trip_is_exact_and_shards_as_the_table_says(layout, tmp_path):
    t = trainer(layout)
    state = host_state(t, 7)
    params, opt_state = checkpoint.restore(state, t)
    specs = jax.tree.leaves((t.specs, t.opt_specs), is_leaf=lambda x: isinstance(x, P))
    for x, spec in zip(jax.tree.leaves((params, opt_state)), specs, strict=True):
        assert x.sharding == NamedSharding(t.mesh, spec)
    path = checkpoint.save(str(tmp_path), 5, params, opt_state, meta(layout=layout), 1)
    ckpt = checkpoint.read(path)
    assert ckpt.step == 5 and ckpt.meta["layout"] == layout
    assert ckpt.meta["versions"]["jax"] == jax.__version__
    assert ckpt.meta["model"] == dataclasses.asdict(CFG)
    assert_same(ckpt.params, state.params)
    assert_same(ckpt.opt_state, state.opt_state)


def old_piece(x: np.ndarray) -> dict:
    """A whole array as formats 1 to 3 stored a piece: msgpack bins inside the file."""
    data = np.ascontiguousarray(x).tobytes()
    return {"index": [[0, n] for n in x.shape], "crc32": zlib.crc32(data), "chunks": [data]}


def test_a_format_2_checkpoint_reads_its_down_projections_turned_around(tmp_path):
    """Format 2 stored wd (and its Adam moments) [N, F, D]; read gives the [N, D, F] the
    params are now, and leaves every other array as it was stored."""
    import msgpack

    rng = np.random.default_rng(0)
    wd_NDF, wq = rng.standard_normal((2, 3, 5)).astype(np.float32), np.ones((2, 3), np.float32)
    params = {"blocks": {"wd": wd_NDF, "wq": wq}}
    opt = {"mu": {"blocks": {"wd": 2 * wd_NDF, "wq": wq}}}
    path = checkpoint.save(str(tmp_path), 1, params, opt, meta(), 1)
    assert_same(checkpoint.read(path).params, {"['blocks']['wd']": wd_NDF,
                                               "['blocks']['wq']": wq})
    record = pieces.read_header(path)[0]
    record["format"] = checkpoint.FORMAT_2
    for part, key, x in (("params", "['blocks']['wd']", wd_NDF),
                         ("opt_state", "['mu']['blocks']['wd']", 2 * wd_NDF),
                         ("params", "['blocks']['wq']", wq),
                         ("opt_state", "['mu']['blocks']['wq']", wq)):
        stored = np.swapaxes(x, -1, -2) if key.endswith("['wd']") else x
        record["arrays"][part][key]["shape"] = list(stored.shape)
        record["pieces"][part][key] = [old_piece(stored)]
    with open(path, "wb") as f:
        f.write(msgpack.packb(record))
    old = checkpoint.read(path)
    assert_same(old.params, {"['blocks']['wd']": wd_NDF, "['blocks']['wq']": wq})
    assert_same(old.opt_state, {"['mu']['blocks']['wd']": 2 * wd_NDF,
                                "['mu']['blocks']['wq']": wq})


def test_bf16_arrays_round_trip_through_ml_dtypes(tmp_path):
    x = (np.arange(12, dtype=np.float32) / 7).astype(jax.numpy.bfloat16).reshape(3, 4)
    path = checkpoint.save(str(tmp_path), 1, {"w": x}, {}, meta(), 1)
    got = checkpoint.read(path).params["['w']"]
    assert got.dtype == x.dtype and np.array_equal(got, x)


def test_resume_equals_uninterrupted_bit_for_bit(run):
    t = trainer("fsdp4xtp2")
    params, opt_state = checkpoint.restore(checkpoint.read(run["paths"]["fsdp4xtp2"]), t)
    losses = []
    for step in (1, 2):
        params, opt_state, m = t.train_step(params, opt_state, batch(t, step))
        losses.append(float(m["loss"]))
    assert losses == run["losses"][1:]
    assert_same(flat_host(params), run["final"])


@pytest.mark.parametrize("source", ["fsdp4xtp2", "tp8"])
@pytest.mark.parametrize("target", LOADED_IN)
def test_reshard_on_load(source, target, run):
    """Written under `source`, loaded under `target`: identical values, and the next
    step's loss equals the uninterrupted run's within f32 reordering error."""
    t = trainer(target)
    ckpt = checkpoint.read(run["paths"][source])
    assert ckpt.meta["layout"] == source
    params, opt_state = checkpoint.restore(ckpt, t)
    assert_same(flat_host(params), ckpt.params)
    assert_same(flat_host(opt_state), ckpt.opt_state)
    loss = float(forward_loss(t)(params, batch(t, 1)))
    assert abs(loss - run["losses"][1]) <= RTOL * abs(run["losses"][1])


def test_checkpoints_of_both_writers_hold_the_same_values(run):
    a, b = (checkpoint.read(run["paths"][k]) for k in ("fsdp4xtp2", "tp8"))
    assert_same(a.params, b.params)
    assert_same(a.opt_state, b.opt_state)


def test_keep_prunes_and_a_killed_writers_temp_file_is_ignored(tmp_path):
    state = host_state(trainer("single"), 0)
    d = str(tmp_path)
    for step in (1, 2, 3):
        checkpoint.save(d, step, state.params, state.opt_state, meta(), keep=2)
    assert [s for s, _ in checkpoint.list_checkpoints(d)] == [2, 3]
    stale = tmp_path / ".step_00000004.ckpt.tmp-999999"
    stale.write_bytes(b"\x85partial")
    assert checkpoint.latest(d).step == 3
    checkpoint.save(d, 4, state.params, state.opt_state, meta(), keep=2)
    assert not stale.exists()
    assert sorted(os.listdir(d)) == ["step_00000003.ckpt", "step_00000004.ckpt"]


# -- bad checkpoints through the CLI (in-process main: same code path, no compile) -------
CLI = ["--model", "tiny", "--layout", "single", "--steps", "2", "--batch", "2", "--seq", "8"]


@pytest.fixture(scope="module")
def cli_checkpoint(tmp_path_factory):
    """A valid checkpoint of the model the CLI flags above describe."""
    cfg = model_config("tiny")
    t = trainer("single", cfg)
    d = tmp_path_factory.mktemp("cli_ckpt")
    return checkpoint.save(str(d), 1, *checkpoint.restore(host_state(t, 0), t), meta(cfg), 1)


def run_main(capsys, *args):
    code = main([*CLI, *args])
    out, err = capsys.readouterr()
    return code, out, err


def copy_to(tmp_path, src: str, nbytes=None) -> str:
    d = tmp_path / "ck"
    d.mkdir()
    data = open(src, "rb").read()
    (d / os.path.basename(src)).write_bytes(data if nbytes is None else data[:nbytes])
    return str(d)


@pytest.mark.parametrize("damage,phrase", [
    (lambda n: n // 2, "is unreadable or truncated"),
    (lambda n: 10, "is unreadable or truncated"),
])
def test_truncated_checkpoint_is_refused(damage, phrase, cli_checkpoint, tmp_path, capsys):
    d = copy_to(tmp_path, cli_checkpoint, damage(os.path.getsize(cli_checkpoint)))
    code, out, err = run_main(capsys, "--checkpoint-dir", d, "--resume")
    assert code == 2 and phrase in err and err.count("\n") == 1 and out == ""
    # nothing deleted (the lock file is the refused run's, engine/run/lock.py)
    assert sorted(set(os.listdir(d)) - {".lock"}) == [os.path.basename(cli_checkpoint)]


def test_corrupted_checkpoint_is_refused(cli_checkpoint, tmp_path, capsys):
    d = copy_to(tmp_path, cli_checkpoint)
    path = os.path.join(d, os.path.basename(cli_checkpoint))
    data = bytearray(open(path, "rb").read())
    data[len(data) // 2] ^= 0xFF  # inside an array's bytes: only the checksum can tell
    open(path, "wb").write(bytes(data))
    code, _, err = run_main(capsys, "--checkpoint-dir", d, "--resume")
    assert code == 2 and "unreadable or truncated" in err and err.count("\n") == 1


def test_checkpoint_of_another_model_shape_is_refused(cli_checkpoint, tmp_path, capsys):
    d = copy_to(tmp_path, cli_checkpoint)
    code, out, err = run_main(capsys, "--checkpoint-dir", d, "--resume", "--d-model", "128",
                              "--layers", "3")
    assert code == 2 and err.count("\n") == 1 and out == ""
    assert "holds a different model: d_model=64 (flags give 128), n_layers=2 (flags give 3)" in err


def test_existing_checkpoints_need_resume(cli_checkpoint, tmp_path, capsys):
    d = copy_to(tmp_path, cli_checkpoint)
    code, _, err = run_main(capsys, "--checkpoint-dir", d)
    assert code == 2 and "already holds checkpoints up to step 1; pass --resume" in err


def test_unwritable_checkpoint_dir_is_refused(tmp_path, capsys):
    (tmp_path / "file").write_text("not a directory")
    code, out, err = run_main(capsys, "--checkpoint-dir", str(tmp_path / "file" / "ck"))
    assert code == 2 and "cannot write checkpoints to" in err and err.count("\n") == 1
    assert out == ""
