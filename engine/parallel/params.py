"""The param table: every param's shape and storage sharding, in one place.

The table drives init, the optimizer state's sharding, the FSDP gathers inside the
scan, the gradient reductions and (later) checkpoints and the cost model. Roles in a
spec are names from the role registry (layers/roles.py) and resolve against the layout:
`fsdp`/`tp` become that mesh axis (or None when the layout lacks it); `tp_kv` is `tp`
when tp divides the kv heads and None (replicated) when tp > kv heads, as Megatron does
for GQA.

The activation table beside it says how the step's and the decoder's activations are
sharded, by what each dim is split as (the registry's `shards` words): `batch` over
every batch role, `heads` over the heads role, `sequence` over cp (each cp rank's
load-balanced chunks, layers/context.py) and then over tp under a sequence-sharding
tp_comm (the residual stream between blocks). Tokens are replicated over cp: each rank
cuts its chunks inside the step.
"""
from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding, PartitionSpec as P

from collectives.ring import TP_COMMS
from engine.parallel.layout import Layout
from layers import roles
from layers.config import ModelConfig

# name: (shape letters, storage spec by role, init). Block params are stacked over N and
# sharded over pp: stage s holds layers [s·N/pp, (s+1)·N/pp), in order.
PARAM_TABLE: dict[str, tuple[str, tuple, str]] = {
    "embed":            ("VD",   ("tp", "fsdp"),                 "normal"),
    "blocks/attn_norm": ("ND",   ("pp", None),                   "ones"),
    "blocks/wq":        ("NDHK", ("pp", "fsdp", "tp", None),     "normal"),
    "blocks/wk":        ("NDGK", ("pp", "fsdp", "tp_kv", None),  "normal"),
    "blocks/wv":        ("NDGK", ("pp", "fsdp", "tp_kv", None),  "normal"),
    "blocks/wo":        ("NHKD", ("pp", "tp", None, "fsdp"),     "normal_out"),
    "blocks/mlp_norm":  ("ND",   ("pp", None),                   "ones"),
    "blocks/wg":        ("NDF",  ("pp", "fsdp", "tp"),           "normal"),
    "blocks/wu":        ("NDF",  ("pp", "fsdp", "tp"),           "normal"),
    "blocks/wd":        ("NDF",  ("pp", "fsdp", "tp"),           "normal_out"),
    "final_norm":       ("D",    (None,),                        "ones"),
    "unembed":          ("DV",   ("fsdp", "tp"),                 "normal"),
    # mixture of experts (layers/moe.py), in place of wg / wu / wd when experts > 0
    "blocks/router":    ("NDE",  ("pp", None, None),             "normal"),
    "blocks/we_g":      ("NEDF", ("pp", "ep", "fsdp", "tp"),     "normal"),
    "blocks/we_u":      ("NEDF", ("pp", "ep", "fsdp", "tp"),     "normal"),
    "blocks/we_d":      ("NEFD", ("pp", "ep", "tp", "fsdp"),     "normal_out"),
    "blocks/ws_g":      ("NDI",  ("pp", "fsdp", "tp"),           "normal"),  # shared experts
    "blocks/ws_u":      ("NDI",  ("pp", "fsdp", "tp"),           "normal"),
    "blocks/ws_d":      ("NDI",  ("pp", "fsdp", "tp"),           "normal_out"),
}
DENSE_MLP = ("blocks/wg", "blocks/wu", "blocks/wd")
ROUTED = ("blocks/router", "blocks/we_g", "blocks/we_u", "blocks/we_d")
SHARED = ("blocks/ws_g", "blocks/ws_u", "blocks/ws_d")
INIT_STD = 0.02  # GPT-2's; outputs into the residual stream scale by 1/sqrt(2N)
DERIVED_ROLES = {"tp_kv": "tp"}  # spec entry -> the registry role it derives from
PARAMS_ROLE = roles.roles_sharding("params")[0]  # the axis params are sharded over (fsdp)


# name: (shape letters, what each dim is sharded as). Global shapes; L+1 for the tokens
# (inputs and targets), C cache slots, G' = max(G, tp) cached kv heads.
ACTIVATION_TABLE: dict[str, tuple[str, tuple]] = {
    "tokens":   ("BL",    ("batch", None)),
    "residual": ("BLD",   ("batch", "sequence", None)),
    "cache":    ("NBCGK", (None, "batch", None, "heads", None)),
    "rows":     ("B",     ("batch",)),
    "logits":   ("BV",    ("batch", None)),
}


def activation_spec(name: str, layout: Layout, tp_comm: str = "allreduce") -> P:
    """The PartitionSpec of activation `name` under `layout` (and `tp_comm`, for the
    residual stream): an entry is the tuple of the layout's axes that shard that dim."""
    def axes(what):
        if what is None:
            return None
        if what == "sequence":  # cp's chunks (outer), then tp's pieces of them
            names = tuple(r for r in roles.roles_sharding("sequence") if layout.degree(r) > 1)
            if TP_COMMS[tp_comm].shards_sequence and layout.degree("tp") > 1:
                names += ("tp",)
            return names[0] if len(names) == 1 else (names or None)
        names = tuple(r for r in roles.roles_sharding(what) if layout.degree(r) > 1)
        if what == "batch":
            return names or None
        return names[0] if len(names) == 1 else (names or None)

    return P(*(axes(w) for w in ACTIVATION_TABLE[name][1]))


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
    return dict(V=cfg.padded_vocab, D=cfg.d_model, N=cfg.n_layers, H=cfg.n_heads, G=cfg.n_kv_heads,
                K=cfg.head_dim, F=cfg.mlp_dim, E=cfg.experts,
                I=cfg.shared_experts * cfg.mlp_dim)


def table(cfg: ModelConfig) -> dict[str, tuple[str, tuple, str]]:
    """The rows of PARAM_TABLE the model has: the dense MLP's, or the router and experts
    (and the shared experts') with experts > 0; no `unembed` with tied embeddings (the
    head reads `embed` transposed: vocab-parallel over tp either way). Rows keep their
    place in the table, which seeds their init. V is `cfg.padded_vocab`."""
    absent = set(ROUTED + SHARED) if not cfg.moe else set(DENSE_MLP) | (
        set() if cfg.shared_experts else set(SHARED))
    if cfg.tie_embed:
        absent.add("unembed")
    return {name: row for name, row in PARAM_TABLE.items() if name not in absent}


def _resolve(role, cfg: ModelConfig, layout: Layout):
    """The mesh axis of a spec entry under `layout` (None: replicated)."""
    if role is None:
        return None
    if role == "tp_kv":
        return _resolve("tp", cfg, layout) if layout.degree("tp") <= cfg.n_kv_heads else None
    return role if layout.degree(role) > 1 else None


def param_shapes(cfg: ModelConfig) -> dict:
    """Global shapes: {name: ShapeDtypeStruct} (f32), nested like the params."""
    dims = _dims(cfg)
    return _nest({name: jax.ShapeDtypeStruct(tuple(dims[c] for c in letters), jnp.float32)
                  for name, (letters, _, _) in table(cfg).items()})


def param_specs(cfg: ModelConfig, layout: Layout) -> dict:
    """The table's PartitionSpec of every param under `layout` (sharded over fsdp where
    the table says), nested like the params. This is how ZeRO-3 stores params and how
    every ZeRO level shards the optimizer state (and ZeRO-2 its grads); `fsdp_dims`
    names the same dims. `storage_specs` is how params are kept between steps."""
    return _nest({name: P(*(_resolve(r, cfg, layout) for r in spec))
                  for name, (_, spec, _) in table(cfg).items()})


def storage_specs(cfg: ModelConfig, layout: Layout, zero: int = 3) -> dict:
    """How params are stored between steps under ZeRO level `zero` (engine/parallel/zero.py):
    `param_specs` for ZeRO-3; ZeRO-1 and ZeRO-2 keep every param whole on each fsdp
    device (the fsdp entry dropped), so their forward gathers nothing."""
    from engine.parallel import zero as zero_levels

    fsdp = _resolve(PARAMS_ROLE, cfg, layout)
    return zero_levels.level(zero, fsdp).storage_specs(param_specs(cfg, layout), fsdp)


def fsdp_dims() -> dict:
    """The dim of each param sharded over fsdp (None if replicated), in per-layer
    coordinates (block params lose their leading N)."""
    dims = {}
    for name, (_, spec, _) in PARAM_TABLE.items():
        dim = spec.index(PARAMS_ROLE) if PARAMS_ROLE in spec else None
        dims[name] = dim - 1 if dim is not None and name.startswith("blocks/") else dim
    return _nest(dims)


def param_count(cfg: ModelConfig, include_embed: bool = True, active: bool = False) -> int:
    """Params in the model; `active`: those one token's forward uses (top_k of the E
    experts, the router, the shared experts)."""
    dims = _dims(cfg)
    routed = dict(dims, E=cfg.top_k) if active else dims  # an expert row's share
    return sum(math.prod((routed if "E" in letters and name != "blocks/router" else dims)[c]
                         for c in letters)
               for name, (letters, _, _) in table(cfg).items()
               if include_embed or name != "embed")


def _init_leaf(key, shape, kind: str, n_layers: int):
    if kind == "ones":
        return jnp.ones(shape, jnp.float32)
    std = INIT_STD / math.sqrt(2 * n_layers) if kind == "normal_out" else INIT_STD
    return std * jax.random.normal(key, shape, jnp.float32)


def init_params(cfg: ModelConfig, layout: Layout, mesh, seed: int, zero: int = 3) -> dict:
    """Params from `seed`, stored as `storage_specs` says for ZeRO level `zero`.

    Layout-invariant: each param's key is folded from its name's place in the table, and
    jax's partitionable threefry makes every element a function of (key, global index)
    only, so with `out_shardings` each device generates just its own shard and the global
    values are bit-identical under every layout."""
    shapes = param_shapes(cfg)
    specs = storage_specs(cfg, layout, zero)
    present = table(cfg)

    def init():
        root = jax.random.key(seed)
        flat = {name: _init_leaf(jax.random.fold_in(root, i), _lookup(shapes, name).shape,
                                 PARAM_TABLE[name][2], cfg.n_layers)
                for i, name in enumerate(PARAM_TABLE) if name in present}
        return _nest(flat)

    shardings = jax.tree.map(lambda s: NamedSharding(mesh, s), specs)
    with jax.threefry_partitionable(True):
        return jax.jit(init, out_shardings=shardings)()


def _lookup(tree: dict, name: str):
    for key in name.split("/"):
        tree = tree[key]
    return tree
