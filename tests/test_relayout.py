"""The copies XLA:CPU adds to lay a dot's operands out as its dot library takes them
([batch, M, K] x [batch, K, N]): which operands need one (`ledger.relayout_order`), one
copy row per operand and order in the ledger, their price on the CPU only, and the
in-run rate they are priced at (engine/cost/microbench.py `relayout_bandwidth`); and the
casts it adds around a bf16 collective, which it runs in f32 (`Row.widen`)."""
import dataclasses
import math

import jax
import jax.numpy as jnp
import pytest

from engine.config import ParallelConfig, TrainConfig, model_config
from engine.cost import calibration, hardware
from engine.cost.ledger import ledger, relayout_order, step_ledger
from engine.cost.microbench import flat_mesh, relayout_bandwidth, typical_relayout
from engine.cost.price import predict
from engine.parallel.layout import Layout

CFG = model_config("tiny", dtype="bf16", remat="full", n_heads=8, n_kv_heads=2, head_dim=8)
TCFG = TrainConfig(batch=8, seq=32)


def test_relayout_order_is_the_dot_librarys_operand_order():
    """XLA:CPU's dot library takes [batch, free, contracting] x [batch, contracting,
    free]: an operand in another order needs a copy into it, one in that order (or
    differing only by dimensions of size 1) none."""
    plain = (((1,), (0,)), ((), ()))  # [M, K] x [K, N]
    assert relayout_order((8, 4), plain, 0) is None and relayout_order((4, 6), plain, 1) is None
    grad = (((0, 1), (0, 1)), ((), ()))  # BLD,BLF->DF: a weight grad
    assert relayout_order((2, 3, 8), grad, 0) == (2, 0, 1)  # x^T: [D, B, L]
    assert relayout_order((2, 3, 6), grad, 1) is None
    rhs_t = (((1,), (1,)), ((), ()))  # [M, K] x [N, K]
    assert relayout_order((6, 4), rhs_t, 1) == (1, 0)
    assert relayout_order((1, 4), rhs_t, 1) is None  # N = 1: a bitcast
    batched = (((2,), (1,)), ((0,), (0,)))
    assert relayout_order((5, 8, 4), batched, 0) is None
    assert relayout_order((5, 4, 6), batched, 1) is None


def test_a_dot_operand_laid_out_anew_is_one_copy_however_many_dots_read_it():
    """The ledger adds a copy row (read + write of the operand) for each operand and
    layout a dot needs laid out anew, once however many dots read it that way; a second
    layout of the same operand is a second copy; canonical operands have none."""
    def f(x, a, b, w):
        ga = jnp.einsum("bld,blf->df", x, a)   # x^T
        gb = jnp.einsum("bld,blf->df", x, b)   # x^T again: the same copy
        y = jnp.einsum("bld,df->blf", x, w)    # x as it is: no copy
        z = jnp.einsum("bld,fd->blf", x, w.T)  # w.T [F, D] laid out [D, F]: a copy
        return ga, gb, y, z

    args = [jax.ShapeDtypeStruct(s, jnp.float32)
            for s in ((2, 3, 8), (2, 3, 6), (2, 3, 6), (8, 6))]
    rows = [r for r in ledger(jax.make_jaxpr(f)(*args), Layout.parse("single")) if r.relayout]
    assert sorted((r.shape, r.bytes) for r in rows) == [
        ((8, 2, 3), 2.0 * 2 * 3 * 8 * 4), ((8, 6), 2.0 * 6 * 8 * 4)]
    assert all(r.kind == "memory" and r.count == 1 for r in rows)


def test_relayout_copies_are_priced_on_the_cpu_only():
    """On the CPU a relayout row costs its bytes at `relayout_bw` (times the devices
    sharing the host, as a calibrated profile's rates are the host's); an accelerator's
    dot kernels read transposed operands in place, so there the rows cost nothing."""
    lay = Layout.parse("fsdp4xtp2")
    rows = step_ledger(CFG, TCFG, lay)
    copies = [r for r in rows if r.relayout]
    assert copies
    cpu = dataclasses.replace(calibration.cpu_defaults(), relayout_bw=1e9)
    pred = predict(rows, cpu, lay.mesh_axes())
    priced = sum(p.seconds for p in pred.rows if p.row.relayout)
    assert priced == pytest.approx(8 * sum(r.bytes * r.count for r in copies) / 1e9)
    slower = predict(rows, dataclasses.replace(cpu, relayout_bw=5e8), lay.mesh_axes())
    assert slower.compute_s == pytest.approx(pred.compute_s + priced)
    bare = [r for r in rows if not r.relayout]
    for name in ("h100", "v5e"):
        hw = hardware.get(name)
        assert predict(rows, hw, lay.mesh_axes()).step_s == predict(
            bare, hw, lay.mesh_axes()).step_s


def test_relayout_bandwidth_is_measured_on_the_steps_typical_copy():
    """The in-run rate of the operand copies is a transpose of the byte-weighted median
    copy's size, flattened to two dimensions; without copies a [4096, 512] bf16 one."""
    rows = step_ledger(CFG, TCFG, Layout.parse("fsdp4xtp2"))
    (m, n), dtype = typical_relayout(rows)
    copies = [r for r in rows if r.relayout]
    assert any(math.prod(r.shape) == m * n and r.shape[-1] == n and r.dtype == dtype
               for r in copies)
    assert typical_relayout([]) == ((4096, 512), "bfloat16")
    assert relayout_bandwidth(flat_mesh(jax.devices()[:2]), (m, n), dtype) > 0


def test_a_bf16_collective_is_cast_to_f32_and_back_on_the_cpu_only(monkeypatch):
    """fsdp4 with bf16 grads: the layer's grad reduce-scatter is bf16 in the jaxpr. The
    ledger adds one `widen` row beside each bf16 collective, in its scope, phase and
    count: the input cast (3 bytes an element: bf16 read, f32 written) and the result's
    (3 bytes an element of the 1/n shard); f32 collectives get none, nor do bf16
    collective-permutes (the tp ring's), which XLA:CPU runs in bf16. The CPU profile
    prices those rows at its memory rate; h100, whose collectives run in bf16, drops them.
    The in-run timing runs the f32 op, the one the compiled step shows: a
    reduce-scatter of f32 operands, as many elements (`group_collective_seconds`)."""
    from engine.cost import microbench_comm
    from engine.cost.ledger import widen_bytes
    from engine.cost.price import collective_key, priced_rows

    lay = Layout.parse("fsdp4")
    rows = step_ledger(CFG, TCFG, lay, pack=True)
    bf16 = [r for r in rows if r.kind == "collective" and r.bytes and r.dtype == "bfloat16"]
    casts = [r for r in rows if r.widen]
    assert bf16 and len(casts) == len(bf16)
    for c, r in zip(casts, bf16):
        assert (c.scope, c.phase, c.count, c.kind) == (r.scope, r.phase, r.count, "memory")
        assert c.bytes == widen_bytes("reduce-scatter" if r.primitive == "reduce_scatter"
                                      else "all-gather", r.bytes, 4)
    rs = next(r for r in bf16 if r.primitive == "reduce_scatter")
    assert widen_bytes("reduce-scatter", rs.bytes, 4) == 1.5 * rs.bytes * (1 + 1 / 4)
    assert not any(r.widen for r in rows if r.kind == "collective")
    cpu, h100 = calibration.cpu_defaults(), hardware.get("h100")
    assert set(casts) <= set(priced_rows(rows, cpu))
    assert not set(casts) & set(priced_rows(rows, h100))
    assert sum(p.seconds for p in predict(rows, cpu, lay.mesh_axes()).rows
               if p.row.widen) > 0

    # collective-permute and all-to-all keep bf16 on XLA:CPU (the audit's rule): no casts
    ring = step_ledger(dataclasses.replace(CFG, activations="bf16"), TCFG,
                       Layout.parse("tp2"), ParallelConfig(tp_comm="ring"), True)
    assert any(r.primitive == "ppermute" and r.dtype == "bfloat16" and r.bytes for r in ring)
    assert not any(r.widen for r in ring)

    ran = []
    monkeypatch.setattr(microbench_comm, "collective_run", lambda kind, mesh, axes, elems, dt,
                        reps: ran.append((kind, elems, dt)) or 1.0)
    timed = microbench_comm.group_collective_seconds([rs], jax.devices()[:4], reps=1)
    assert set(timed) == {collective_key(rs)}
    assert ran == [("reduce-scatter", rs.bytes // 2 // 4 * 4, jnp.float32)]
