"""The param table: every param's shape and storage sharding, in one place.

The table drives init, the optimizer state's sharding, the FSDP gathers inside the
scan, the gradient reductions and (later) checkpoints and the cost model. Roles in a
spec resolve against the layout: `fsdp`/`tp` become that mesh axis (or None when the
layout lacks it); `tp_kv` is `tp` when tp divides the kv heads and None (replicated)
when tp > kv heads, as Megatron does for GQA.
"""
from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding, PartitionSpec as P

from engine.layout import Layout
from layers.config import ModelConfig

# name: (shape letters, storage spec by role, init). Block params are stacked over N.
PARAM_TABLE: dict[str, tuple[str, tuple, str]] = {
    "embed":            ("VD",   ("tp", "fsdp"),                 "normal"),
    "blocks/attn_norm": ("ND",   (None, None),                   "ones"),
    "blocks/wq":        ("NDHK", (None, "fsdp", "tp", None),     "normal"),
    "blocks/wk":        ("NDGK", (None, "fsdp", "tp_kv", None),  "normal"),
    "blocks/wv":        ("NDGK", (None, "fsdp", "tp_kv", None),  "normal"),
    "blocks/wo":        ("NHKD", (None, "tp", None, "fsdp"),     "normal_out"),
    "blocks/mlp_norm":  ("ND",   (None, None),                   "ones"),
    "blocks/wg":        ("NDF",  (None, "fsdp", "tp"),           "normal"),
    "blocks/wu":        ("NDF",  (None, "fsdp", "tp"),           "normal"),
    "blocks/wd":        ("NFD",  (None, "tp", "fsdp"),           "normal_out"),
    "final_norm":       ("D",    (None,),                        "ones"),
    "unembed":          ("DV",   ("fsdp", "tp"),                 "normal"),
}
INIT_STD = 0.02  # GPT-2's; outputs into the residual stream scale by 1/sqrt(2N)


def _nest(flat: dict) -> dict:
    """{"blocks/wq": x} -> {"blocks": {"wq": x}}."""
    tree: dict = {}
    for path, value in flat.items():
        *outer, leaf = path.split("/")
        node = tree
        for key in outer:
            node = node.setdefault(key, {})
        node[leaf] = value
    return tree


def _dims(cfg: ModelConfig) -> dict[str, int]:
    return dict(V=cfg.vocab, D=cfg.d_model, N=cfg.n_layers, H=cfg.n_heads, G=cfg.n_kv_heads,
                K=cfg.head_dim, F=cfg.mlp_dim)


def _resolve(role, cfg: ModelConfig, layout: Layout):
    axes = layout.role_axes()
    if role == "tp_kv":
        return axes.tp if layout.degree("tp") <= cfg.n_kv_heads else None
    return None if role is None else getattr(axes, role)


def param_shapes(cfg: ModelConfig) -> dict:
    """Global shapes: {name: ShapeDtypeStruct} (f32), nested like the params."""
    dims = _dims(cfg)
    return _nest({name: jax.ShapeDtypeStruct(tuple(dims[c] for c in letters), jnp.float32)
                  for name, (letters, _, _) in PARAM_TABLE.items()})


def param_specs(cfg: ModelConfig, layout: Layout) -> dict:
    """The table's PartitionSpec of every param under `layout` (sharded over fsdp where
    the table says), nested like the params. This is how ZeRO-3 stores params and how
    every ZeRO level shards the optimizer state (and ZeRO-2 its grads); `fsdp_dims`
    names the same dims. `storage_specs` is how params are kept between steps."""
    return _nest({name: P(*(_resolve(r, cfg, layout) for r in roles))
                  for name, (_, roles, _) in PARAM_TABLE.items()})


def storage_specs(cfg: ModelConfig, layout: Layout) -> dict:
    """How params are stored between steps under `cfg.zero`: `param_specs` for ZeRO-3;
    ZeRO-1 and ZeRO-2 keep every param whole on each fsdp device (the fsdp entry
    dropped), so their forward gathers nothing."""
    specs = param_specs(cfg, layout)
    fsdp = layout.role_axes().fsdp
    if cfg.zero == 3 or fsdp is None:
        return specs
    return jax.tree.map(lambda spec: P(*(None if e == fsdp else e for e in spec)), specs,
                        is_leaf=lambda x: isinstance(x, P))


def fsdp_dims() -> dict:
    """The dim of each param sharded over fsdp (None if replicated), in per-layer
    coordinates (block params lose their leading N)."""
    dims = {}
    for name, (_, roles, _) in PARAM_TABLE.items():
        dim = roles.index("fsdp") if "fsdp" in roles else None
        dims[name] = dim - 1 if dim is not None and name.startswith("blocks/") else dim
    return _nest(dims)


def param_count(cfg: ModelConfig, include_embed: bool = True) -> int:
    dims = _dims(cfg)
    return sum(math.prod(dims[c] for c in letters) for name, (letters, _, _) in PARAM_TABLE.items()
               if include_embed or name != "embed")


def _init_leaf(key, shape, kind: str, n_layers: int):
    if kind == "ones":
        return jnp.ones(shape, jnp.float32)
    std = INIT_STD / math.sqrt(2 * n_layers) if kind == "normal_out" else INIT_STD
    return std * jax.random.normal(key, shape, jnp.float32)


def init_params(cfg: ModelConfig, layout: Layout, mesh, seed: int) -> dict:
    """Params from `seed`, stored as `storage_specs` says.

    Layout-invariant: each param's key is folded from its name's place in the table, and
    jax's partitionable threefry makes every element a function of (key, global index)
    only, so with `out_shardings` each device generates just its own shard and the global
    values are bit-identical under every layout."""
    shapes = param_shapes(cfg)
    specs = storage_specs(cfg, layout)
    names = list(PARAM_TABLE)

    def init():
        root = jax.random.key(seed)
        flat = {name: _init_leaf(jax.random.fold_in(root, i), _lookup(shapes, name).shape,
                                 PARAM_TABLE[name][2], cfg.n_layers)
                for i, name in enumerate(names)}
        return _nest(flat)

    shardings = jax.tree.map(lambda s: NamedSharding(mesh, s), specs)
    with jax.threefry_partitionable(True):
        return jax.jit(init, out_shardings=shardings)()


def _lookup(tree: dict, name: str):
    for key in name.split("/"):
        tree = tree[key]
    return tree
