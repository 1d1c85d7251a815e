"""What a layer sees of the parallel layout: the mesh axes it may talk over, by role, and
how it moves bytes over them. A static (hashable) dataclass, built by
`engine.parallel.layout.Layout.role_axes` from the role registry (layers/roles.py)."""
from __future__ import annotations

import dataclasses
from typing import Mapping

import collectives
from collectives.ring import ALLREDUCE, TpComm
from layers.roles import data_roles, roles_sharding


@dataclasses.dataclass(frozen=True)
class GatherWeights:
    """How a layer's weights are made whole (ZeRO-3): every weight the param table
    shards over fsdp is cast to the compute dtype and all-gathered over fsdp, all in one
    collective (`collectives.gather_many`; its backward is one reduce-scatter, in the
    compute dtype, or in the params' f32 when grad_reduce is "f32"). Weights not sharded
    over fsdp (norm scales) pass through in f32. pack: the gather's 2-byte packing
    (`collectives.widens_2byte` of the mesh)."""

    pack: bool = True

    def __call__(self, p: dict, fsdp_dims: Mapping[str, int | None], axis: str | None,
                 dtype, grad_reduce: str = "compute") -> dict:
        out = dict(p)
        sharded = [name for name in p if fsdp_dims[name] is not None]
        wholes = collectives.gather_many([p[name] for name in sharded], axis,
                                         [fsdp_dims[name] for name in sharded], self.pack,
                                         cast=dtype, keep_grad_dtype=grad_reduce == "f32")
        out.update(zip(sharded, wholes))
        return out


GATHER = GatherWeights()


@dataclasses.dataclass(frozen=True)
class Axes:
    """Axis names by role; `None` when the layout has no such axis (or it has size 1).

    dp:   params replicated, batch sharded.
    fsdp: params, grads, optimizer state and batch sharded (ZeRO).
    tp:   heads, MLP hidden and vocab sharded (Megatron).
    cp:   the sequence sharded in load-balanced causal chunks (layers/context.py).
    pp:   the stacked layers sharded in contiguous stages (engine/parallel/pipeline.py).
    ep:   experts sharded, batch sharded (layers/moe.py: tokens to their experts by
          all-to-all).

    tp_comm:  how activations move over tp (`collectives.ring.TpComm`: allreduce,
              sequence or ring).
    cp_comm:  how attention reaches the keys of the other cp ranks
              (`layers.kernels.context.CP_COMMS`: allgather).
    weights:  how a layer's weights are made whole (`GatherWeights` for ZeRO-3; ZeRO-2's
              `engine.parallel.zero.ResidentWeights`).
    prefetch: gather layer i+1's weights before layer i's compute (layers/block.py).
    grad_reduce: the dtype fsdp reduce-scatters weight grads in: "compute" (the dtype
              the weights were gathered in) or "f32" (the params', as PyTorch FSDP's
              mixed precision does by default: reduce_dtype float32).
    """

    dp: str | None = None
    fsdp: str | None = None
    tp: str | None = None
    cp: str | None = None
    pp: str | None = None
    ep: str | None = None
    dp_size: int = 1
    fsdp_size: int = 1
    tp_size: int = 1
    cp_size: int = 1
    pp_size: int = 1
    ep_size: int = 1
    tp_comm: TpComm = ALLREDUCE
    cp_comm: str = "allgather"
    weights: object = GATHER
    prefetch: bool = False
    grad_reduce: str = "compute"

    @property
    def batch(self) -> tuple[str, ...]:
        """Axes the batch is sharded over, outermost first (the registry's batch roles)."""
        return tuple(a for a in (getattr(self, r) for r in roles_sharding("batch"))
                     if a is not None)

    @property
    def batch_size(self) -> int:
        size = 1
        for r in roles_sharding("batch"):
            size *= getattr(self, f"{r}_size")
        return size

    @property
    def data(self) -> tuple[str, ...]:
        """Axes along which devices see different tokens (the registry's data roles: the
        batch axes and cp): the loss is summed over these."""
        return tuple(a for a in (getattr(self, r) for r in data_roles()) if a is not None)

    @property
    def data_size(self) -> int:
        size = 1
        for r in data_roles():
            size *= getattr(self, f"{r}_size")
        return size

    @property
    def seq_tp(self) -> str | None:
        """The axis the residual stream's sequence is sharded over between blocks: tp
        under a sequence-sharding tp_comm (sequence, ring), else None (replicated)."""
        return self.tp if self.tp_comm.shards_sequence else None

    def gather_weights(self, p: dict, fsdp_dims: Mapping[str, int | None], dtype) -> dict:
        """One layer's weights, whole, as `weights` makes them."""
        return self.weights(p, fsdp_dims, self.fsdp, dtype, self.grad_reduce)

