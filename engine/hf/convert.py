"""Hugging Face model directory <-> shardwise checkpoint, one tensor at a time.

Import: config.json -> ModelConfig (engine/hf/families.py); each param of the table is
assembled from its HF tensors (engine/hf/weights.py) read one by one from the mapped
safetensors files and streamed into a step-0 checkpoint with a fresh optimizer
(engine/run/checkpoint_stream.py). At any moment the process holds one param and one
HF tensor. The HF config and tokenizer files travel with the checkpoint (its manifest's
`hf` entry, `CK/tokenizer/`), so an export writes the architecture it came from.

Export: the checkpoint's params are read one array at a time and each HF tensor behind
it is written at its offset in the safetensors files (engine/hf/io.py).
"""
from __future__ import annotations

import dataclasses
import os
import shutil

import numpy as np

from engine.config import TrainConfig
from engine.hf import families, io, weights
from engine.hf.io import HFError
from engine.parallel.params import table
from layers.config import ModelConfig

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")
TOKENIZER_DIR = "tokenizer"
EXPORT_DTYPES = {"f32": np.dtype(np.float32), "bf16": io.ST_DTYPES["BF16"]}


def key_path(param: str) -> str:
    """`blocks/wq` -> `['blocks']['wq']` (the checkpoint's key paths)."""
    return "".join(f"['{part}']" for part in param.split("/"))


def load(hf_dir: str, vocab_multiple: int = 1, **numerics) -> tuple[ModelConfig, dict,
                                                                     io.Reader]:
    """(ModelConfig, config.json, a Reader whose tensors were checked against the config
    by name and shape) of an HF directory."""
    hf = families.read_config(hf_dir)
    cfg = families.model_config(hf, vocab_multiple, **numerics)
    reader = io.Reader(hf_dir)
    for name, shape in weights.hf_tensors(cfg):
        got = reader.shape(name)
        if got is None:
            raise HFError(f"{hf_dir}: tensor {name} is missing")
        if tuple(got) != tuple(shape):
            raise HFError(f"{hf_dir}: tensor {name} is {list(got)}, config.json says "
                          f"{list(shape)}")
    return cfg, hf, reader


def param_arrays(cfg: ModelConfig, reader: io.Reader):
    """[(key path, global shape, f32)] of the model and `produce(key)` filling one."""
    from engine.parallel.params import _lookup, param_shapes

    shapes = param_shapes(cfg)
    names = {key_path(p): p for p in table(cfg)}
    arrays = [(k, _lookup(shapes, names[k]).shape, np.dtype(np.float32)) for k in sorted(names)]

    def produce(key):
        param = names[key]
        return weights.import_param(param, _lookup(shapes, param).shape, cfg, reader.get)

    return arrays, produce


def import_hf(hf_dir: str, ckpt_dir: str, vocab_multiple: int = 1) -> str:
    """Write `ckpt_dir`/step_00000000.ckpt from an HF directory; returns its path."""
    from engine.run import checkpoint, checkpoint_stream

    cfg, hf, reader = load(hf_dir, vocab_multiple)
    if checkpoint.list_checkpoints(ckpt_dir):
        raise HFError(f"{ckpt_dir} already holds checkpoints; choose an empty directory")
    checkpoint.check_writable(ckpt_dir)
    arrays, produce = param_arrays(cfg, reader)
    meta = dict(rng=dict(seed=0), model=dataclasses.asdict(cfg),
                train=dataclasses.asdict(TrainConfig()), layout="single",
                data=dict(source=None), hf=dict(config=hf, source=os.path.abspath(hf_dir)))
    path = checkpoint_stream.save_params(ckpt_dir, 0, arrays, produce, meta)
    copy_tokenizer(hf_dir, os.path.join(ckpt_dir, TOKENIZER_DIR))
    return path


def copy_tokenizer(src: str, dst: str) -> list[str]:
    """Copy the tokenizer files `src` has into `dst` (created if any); the names copied."""
    found = [f for f in TOKENIZER_FILES if os.path.isfile(os.path.join(src, f))]
    if found:
        os.makedirs(dst, exist_ok=True)
    for f in found:
        shutil.copyfile(os.path.join(src, f), os.path.join(dst, f))
    return found


def checkpoint_config(meta: dict) -> ModelConfig:
    """The ModelConfig a checkpoint's manifest records (fields it lacks: defaults)."""
    fields = {f.name for f in dataclasses.fields(ModelConfig)}
    return ModelConfig(**{k: v for k, v in meta.get("model", {}).items() if k in fields})


def prepare_out(out: str, force: bool) -> None:
    """Create `out`; refuse a directory that exists and is not empty, unless `force`."""
    if os.path.exists(out) and not os.path.isdir(out):
        raise HFError(f"--out {out} is a file")
    if os.path.isdir(out) and os.listdir(out) and not force:
        raise HFError(f"--out {out} exists and is not empty (pass --force to write into it)")
    os.makedirs(out, exist_ok=True)


def export_hf(ckpt_path: str, out: str, dtype: str = "f32", max_shard_size: int = 50 * 10**9,
              force: bool = False) -> list[str]:
    """Write checkpoint `ckpt_path` as an HF directory `out`; returns the files written."""
    import json

    from engine.run import checkpoint_stream

    meta = checkpoint_stream.read_meta(ckpt_path)
    cfg = checkpoint_config(meta)
    config = families.hf_config(cfg, (meta.get("hf") or {}).get("config"))
    prepare_out(out, force)
    config["dtype"] = {"f32": "float32", "bf16": "bfloat16"}[dtype]
    config.pop("torch_dtype", None)
    st_dtype = EXPORT_DTYPES[dtype]
    tensors = [(name, shape, st_dtype) for name, shape in weights.hf_tensors(cfg)]
    names = {key_path(p): p for p in table(cfg)}

    def produce():
        for key, array in checkpoint_stream.iter_params(ckpt_path):
            if key not in names:
                raise HFError(f"checkpoint {ckpt_path} holds {key}, which its model lacks")
            yield from weights.export_param(names[key], array, cfg)

    written = io.write(out, tensors, produce(), max_shard_size)
    with open(os.path.join(out, "config.json"), "w") as f:
        json.dump(config, f, indent=2)
    tok = os.path.join(os.path.dirname(ckpt_path), TOKENIZER_DIR)
    return ["config.json", *written, *copy_tokenizer(tok, out)]




def init_params(hf_dir: str, trainer) -> tuple:
    """(params, a fresh optimizer state) of `trainer`'s model from an HF directory, each
    param assembled on the host and placed as the trainer's layout stores it before the
    next is read (`engine.train --init-from-hf`)."""
    import jax
    from jax.sharding import NamedSharding

    from engine.parallel.params import param_shapes

    cfg = trainer.cfg
    _, _, reader = load(hf_dir, cfg.vocab_multiple, dtype=cfg.dtype,
                        activations=cfg.activations, remat=cfg.remat, attention=cfg.attention)
    leaves, treedef = jax.tree_util.tree_flatten_with_path(param_shapes(cfg))
    names = {key_path(p): p for p in table(cfg)}
    out = []
    for (path, want), spec in zip(leaves, treedef.flatten_up_to(trainer.specs)):
        key = jax.tree_util.keystr(path)
        x = weights.import_param(names[key], want.shape, cfg, reader.get)
        if trainer.layer_order is not None and key.startswith("['blocks']"):
            x = x[trainer.layer_order]
        out.append(jax.make_array_from_callback(x.shape, NamedSharding(trainer.mesh, spec),
                                                lambda index, x=x: x[index]))
        del x
    params = jax.tree.unflatten(treedef, out)
    return params, trainer.init_opt(params)
