"""One row of the plan: an equation of the traced step, per device (`Row`)."""
from __future__ import annotations

import dataclasses
import functools


@dataclasses.dataclass(frozen=True)
class Row:
    """One equation of the step, per device. `flops` and `bytes` are per execution;
    the step runs it `count` times (scan trip counts multiplied in).

    kind: "matmul" (dot_general), "memory" (elementwise, reductions, data movement),
    "collective", or "attention" (the flash kernel an accelerator runs in place of the
    jnp key-block scan, whose own rows carry `kernel="blocked"`; engine/cost/price.py
    prices one or the other). bytes: read + written for compute rows, under a loop-fusion model
    (`fusion.loop_fusion_bytes`: a chain of elementwise ops reads its inputs and writes
    its outputs once, as XLA's loop fusion does); for collectives the buffer
    each device holds before reducing / after gathering (all-gather: output, others:
    input), the `bytes` of the ring formulas.
    """

    scope: str
    phase: str
    kind: str
    primitive: str
    dtype: str
    shape: tuple
    flops: float
    bytes: float
    count: int
    axes: tuple = ()
    axis_size: int = 1
    # matmuls: (lhs shape, rhs shape, lhs dtype, rhs dtype, dimension_numbers, result
    # dtype), enough to re-run the same dot_general alone (engine/cost/microbench.py)
    dot: tuple | None = None
    # the accelerator fusion model (engine/cost/fusion.py): this row's share of its
    # fusion group's traffic, and the group's id (-1: not a compute row of a group)
    fused_bytes: float = -1.0
    fusion: int = -1
    # the same without epilogue fusion (a matmul is a library call writing its product:
    # GPU), and that group's id
    lib_bytes: float = -1.0
    lib_fusion: int = -1
    # "blocked": the row is inside the jnp flash kernel's key-block scan, which an
    # accelerator replaces by its own attention kernel (a `kind="attention"` row)
    kernel: str = ""
    # the pipeline scopes (layers.scopes.PP_SCOPES) on the row's name stack, outermost
    # first: which tick unit of engine/parallel/pipeline.py runs it (engine/cost/pipeline.py)
    pp: tuple = ()
    # the row is traffic XLA adds to lower a `lax.scan` to a loop (`scan_copy_rows`:
    # the slices of its stacked inputs, the updates of its stacked outputs, their
    # zero-fills and upcasts), or the same traffic written in the body
    # (`stack_slot_bytes`: a row of a stack from outside the body read or written, as the
    # prefetching layer scans index their stacked weights and fill their carried
    # grads). Its value is the share of the row's bytes that are the stack's own (a
    # slice's read from the stack, an update's write into it, a zero-fill or upcast of
    # the whole stack), the rest the loop's working set (the slice written out, the
    # update read); 0 for any other row. Two consequences in pricing
    # (engine/cost/price.py): the stack's share is written an iteration loop before it
    # is read, so out of a host's caches (`Hardware.cold_hbm`); and an eager
    # framework's layer loop, which stacks and slices nothing, does not move the row
    scan_stack: float = 0.0
    # the row is a copy XLA adds to a loop body to keep a carried value it overwrites
    # (`scan_rows.carry_copy_rows`): an in-cache copy on the CPU; an eager framework's
    # layer loop carries nothing, so it does not move it there
    loop_copy: bool = False
    # the row is a copy XLA:CPU adds to lay a dot's operand out as its dot library takes
    # it, [batch, M, K] x [batch, K, N] (`ledger.relayout_order`), once per operand
    # and layout however many dots read it: priced where the profile has a rate for
    # such copies (`Hardware.relayout_bw`), dropped elsewhere (a GPU's or TPU's dot
    # kernels read a transposed operand in place)
    relayout: bool = False
    # the row is XLA:CPU's cast of a bf16 collective's operand to f32 and of its result
    # back (`ledger.widen_bytes`: it runs the `ledger.WIDENED_KINDS` in f32, each cast a
    # fusion of its own): priced only on a profile that widens them
    # (`Hardware.bf16_collectives_in_f32`), dropped elsewhere
    widen: bool = False

    def replace(self, **changes) -> Row:
        """`dataclasses.replace(self, **changes)` without its per-field loop (the walk
        makes one per compute row, pipeline pricing one per row of a pp ledger); the
        same Row."""
        new = object.__new__(Row)
        new.__dict__.update(self.__dict__, **changes)
        return new

    @property
    def total_flops(self) -> float:
        return self.flops * self.count

    @property
    def total_bytes(self) -> float:
        return self.bytes * self.count


@functools.cache
def dtype_name(dtype) -> str:
    """str(dtype), looked up: numpy formats a dtype's name anew each time."""
    return str(dtype)
