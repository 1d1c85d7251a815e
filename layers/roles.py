"""The role registry: every mesh axis a layout may name, what it shards, which axes its
grads are reduced over, and what its size must divide. Imports no jax (the CLI
validates before jax loads).

A role is one axis of the device mesh. Its name is the layout token (`fsdp4`) and the
mesh axis name; `shards` says what is split over it:

    batch     the global batch (each device sees B / degree sequences)
    params    params, grads and optimizer state (the param table's `fsdp` entries)
    heads     attention heads, MLP hidden and vocab (the param table's `tp` entries)
    sequence  the sequence inside a block (context parallelism)
    layers    the stacked layers (pipeline stages)
    experts   the experts of a mixture-of-experts MLP

Everything below (`Layout.parse/check`, `Layout.role_axes`, the param specs, the grad
reductions, `engine.parallel.validate`) reads this table; adding a parallelism adds a `Role`
here and its fields to `layers.axes.Axes`.
"""
from __future__ import annotations

import dataclasses

SHARDABLE = ("batch", "params", "heads", "sequence", "layers", "experts")


@dataclasses.dataclass(frozen=True)
class Role:
    """One mesh axis kind.

    name:    layout token and mesh axis name.
    shards:  what is split over the axis (a subset of SHARDABLE).
    data:    True for a data axis: devices along it see different tokens with the same
             params, so a grad of a param stored replicated over it is summed over it
             and the loss is averaged over it.
    divides: model dims the axis size must divide ("batch" is the global batch). Roles
             naming the same dim divide it jointly (batch by dp*fsdp*ep).
    doc:     one line for `--help` and the docs.
    """

    name: str
    shards: tuple[str, ...]
    data: bool
    divides: tuple[str, ...]
    doc: str


ROLES: dict[str, Role] = {r.name: r for r in (
    Role("dp", ("batch",), data=True, divides=("batch",),
         doc="params replicated, batch sharded"),
    Role("fsdp", ("batch", "params"), data=True, divides=("batch", "d_model"),
         doc="params, grads, optimizer state and batch sharded (ZeRO)"),
    Role("tp", ("heads",), data=False, divides=("heads", "mlp_dim", "vocab"),
         doc="heads, MLP hidden and vocab sharded (Megatron)"),
    # cp's rule is seq divisible by 2*cp (load-balanced chunks): engine/parallel/validate.py
    Role("cp", ("sequence",), data=True, divides=(),
         doc="sequence sharded in load-balanced causal chunks (context parallel)"),
    # the schedule's rules (microbatches >= pp for 1f1b): engine/parallel/validate.py
    Role("pp", ("layers",), data=False, divides=("layers",),
         doc="stacked layers sharded in contiguous stages (pipeline parallel)"),
    # a data axis for everything but the experts, which are sharded over it
    Role("ep", ("batch", "experts"), data=True, divides=("batch", "experts"),
         doc="experts sharded, batch sharded; tokens reach their experts by all-to-all"),
)}

# Model dims a role may have to divide, as `ModelConfig` field names (and "batch"; the
# vocab as the params hold it, rounded up to `vocab_multiple`).
DIM_FIELDS = {"batch": "batch", "d_model": "d_model", "heads": "n_heads",
              "mlp_dim": "mlp_dim", "vocab": "padded_vocab", "layers": "n_layers",
              "experts": "experts"}


def roles_sharding(what: str) -> tuple[str, ...]:
    """Names of the roles that shard `what` (one of SHARDABLE), in registry order."""
    return tuple(name for name, r in ROLES.items() if what in r.shards)


def data_roles() -> tuple[str, ...]:
    """Names of the data roles: a replicated param's grad is summed over these."""
    return tuple(name for name, r in ROLES.items() if r.data)


def divisibility_problems(degrees: dict[str, int], dims: dict[str, int]) -> list[str]:
    """`what=n not divisible by a*b=d` for every dim some roles must divide and do not.
    degrees: role -> axis size; dims: dim name (DIM_FIELDS keys) -> value."""
    problems = []
    for dim in DIM_FIELDS:
        roles = [name for name, r in ROLES.items() if dim in r.divides]
        if not roles:
            continue
        d = 1
        for name in roles:
            d *= degrees.get(name, 1)
        if dims[dim] % d:
            problems.append(f"{dim}={dims[dim]} not divisible by {'*'.join(roles)}={d}")
    return problems


def kv_heads_problems(degrees: dict[str, int], kv_heads: int) -> list[str]:
    """The GQA rule for the heads axis: tp and the kv heads, one divides the other (tp >
    G replicates each kv head over the ranks whose query heads read it)."""
    problems = []
    for name in roles_sharding("heads"):
        d = degrees.get(name, 1)
        if kv_heads % d and d % kv_heads:
            problems.append(f"kv_heads={kv_heads} and {name}={d}: one must divide the other")
    return problems
