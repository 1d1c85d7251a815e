"""Cost model: the memory bytes the ledger charges single ops and a scan (reshapes,
slices, stacking, XLA:CPU's bf16 upcast) against the compiled module, and their pricing
out of cache."""
from __future__ import annotations

import dataclasses

import pytest

from engine.cost import calibration, hardware
from engine.parallel.layout import Layout


def _scan_example():
    """A scan over N stacked weights [N, D, D] whose body stacks two outputs: tanh(c @ w)
    (also the carry, so XLA cannot fuse its producer into the stacking) and c @ w (a
    dot's product), and a third, 2 * c, whose elementwise producer XLA writes straight
    into the stacked buffer."""
    import jax.numpy as jnp
    from jax import lax

    def f(x_BD, w_NDD):
        def body(c_BD, w_DD):
            y_BD = c_BD @ w_DD
            h_BD = jnp.tanh(y_BD)
            return h_BD, (h_BD, y_BD, 2.0 * c_BD)

        return lax.scan(body, x_BD, w_NDD)

    return f, jnp.ones((16, 32), jnp.float32), jnp.ones((4, 32, 32), jnp.float32)


def test_a_reshape_or_name_of_a_value_in_memory_does_not_hide_its_read():
    """A matmul's product reaches memory; an elementwise op reading it through a reshape
    (a bitcast) or a remat name (`checkpoint_name`) still reads it: the loop-fusion
    bytes of `tanh` are its input's and its output's whatever stands between."""
    import jax
    import jax.numpy as jnp
    from jax.ad_checkpoint import checkpoint_name

    from engine.cost.ledger import ledger

    a, b = jnp.ones((16, 32), jnp.float32), jnp.ones((32, 64), jnp.float32)
    ways = {"direct": lambda a, b: jnp.tanh(a @ b),
            "reshape": lambda a, b: jnp.tanh((a @ b).reshape(16, 8, 8)),
            "name": lambda a, b: jnp.tanh(checkpoint_name(a @ b, "y"))}
    for way, f in ways.items():
        rows = ledger(jax.make_jaxpr(f)(a, b), Layout.parse("single"))
        [moved] = [r.bytes for r in rows if r.primitive == "tanh"]
        assert moved == 2 * 16 * 64 * 4, way


def test_static_and_dynamic_slice_of_one_row_move_the_same_bytes():
    """Taking row 0 of a [N, B, D] buffer reads that row and writes it, whether the index
    is static (`slice`) or traced (`dynamic_slice`): 2x the row's bytes each, not the
    whole buffer's; the squeeze between the slice and the dot does not hide the write."""
    import jax
    import jax.numpy as jnp
    from jax import lax

    from engine.cost.ledger import ledger

    x = jnp.ones((4, 16, 32), jnp.float32)
    row_bytes = x[0].nbytes

    def static(x):
        return x[0] @ jnp.ones((32, 32))  # the slice feeds a dot: it reaches memory

    def dynamic(x, i):
        return lax.dynamic_index_in_dim(x, i, keepdims=False) @ jnp.ones((32, 32))

    rows_s = ledger(jax.make_jaxpr(static)(x), Layout.parse("single"))
    rows_d = ledger(jax.make_jaxpr(dynamic)(x, 0), Layout.parse("single"))
    [s] = [r.bytes for r in rows_s if r.primitive == "slice"]
    [d] = [r.bytes for r in rows_d if r.primitive == "dynamic_slice"]
    assert s == 2 * row_bytes
    assert d == s + 3 * 4  # and its three int32 start indices


def test_scan_charges_its_stacking_and_slicing():
    """The rows XLA adds to a scan, against the scan's own inputs and outputs: per
    iteration one slice of each stacked input a dot reads (read + written out) and one
    slice of each stacked output not made by a fusible op alone (update read, slice
    written), and each stacked output's buffer zero-filled once; on a fusion profile
    they move nothing. The compiled XLA:CPU loop holds as many dynamic-update-slice
    fusions as the ledger's update rows, and a dynamic-slice for the dot's operand."""
    import jax

    from engine.cost import hlo
    from engine.cost.ledger import ledger
    from engine.cost.price import moved_bytes

    f, x, w = _scan_example()
    rows = ledger(jax.make_jaxpr(f)(x, w), Layout.parse("single"))
    n = w.shape[0]
    _, ys = jax.eval_shape(f, x, w)
    slices = [y.size // n * y.dtype.itemsize for y in ys]

    def charged(primitive):
        return sorted(r.bytes for r in rows if r.primitive == primitive
                      for _ in range(r.count))

    # h and y are stacked by a dynamic-update-slice; 2c is written by its own multiply
    assert charged("dynamic_update_slice") == sorted(2 * b for b in slices[:2] for _ in range(n))
    assert charged("broadcast_in_dim") == sorted(b * n for b in slices)
    assert charged("dynamic_slice") == [2 * w[0].nbytes] * n
    added = [r for r in rows if r.primitive in ("dynamic_update_slice", "dynamic_slice")
             or (r.primitive == "broadcast_in_dim" and r.count == 1)]
    assert all((r.scope, r.phase) == ("other", "fwd") for r in added)
    assert all(moved_bytes(r, hardware.get("h100")) == 0 for r in added)

    module = hlo.parse(jax.jit(f).lower(x, w).compile().as_text())
    loop = [c for c, m in module.multiplicity.items() if m == n and any(
        i.opcode == "fusion" for i in module.computations[c])]
    fused_ops = lambda i: {j.opcode for j in module.computations.get(i.callee, [])}
    body = [i for c in loop for i in module.computations[c] if i.opcode == "fusion"]
    updates = [i for i in body if "dynamic-update-slice" in fused_ops(i)]
    assert len(updates) == len(ys) == 3
    # the multiply of 2c is inside its update's fusion; the others only stack
    assert sum("multiply" in fused_ops(i) for i in updates) == 1
    assert sum("dynamic-slice" in fused_ops(i) and "dynamic-update-slice" not in fused_ops(i)
               for i in body) == 1



def test_a_bf16_stacked_input_is_charged_as_the_host_compiler_lowers_it():
    """jax 0.10's XLA:CPU converts a scan's bf16 stacked input to f32 whole before the
    loop and each iteration slices the f32 stack back to bf16 for the dot: the ledger
    then charges the whole-stack convert (read the stack, write it twice as wide) and a
    slice reading f32 and writing bf16, and the compiled module holds both. jax 0.12's
    slices the bf16 stack as it is: the ledger charges neither, and the module holds no
    widened stack. An f32 stacked input gets neither on both."""
    import jax
    import jax.numpy as jnp
    from jax import lax

    from engine.cost import hlo
    from engine.cost.ledger import ledger
    from engine.cost.scan_rows import cpu_upcasts_bf16_stacks

    def f(c_BD, w_NDD):
        def body(c_BD, w_DD):
            return jnp.tanh(jnp.dot(c_BD, w_DD, preferred_element_type=jnp.float32)
                            ).astype(c_BD.dtype), None

        return lax.scan(body, c_BD, w_NDD)[0]

    for dtype in (jnp.bfloat16, jnp.float32):
        c, w = jnp.ones((16, 32), dtype), jnp.ones((4, 32, 32), dtype)
        rows = ledger(jax.make_jaxpr(f)(c, w), Layout.parse("single"))
        converts = [r for r in rows if r.primitive == "convert_element_type" and r.scan_stack]
        [piece] = [r for r in rows if r.primitive == "dynamic_slice"]
        module = hlo.parse(jax.jit(f).lower(c, w).compile().as_text())
        entry = module.computations[module.entry]
        widened = [i for i in entry if i.opcode == "fusion" and i.result.startswith("f32[4,32,32]")]
        if dtype == jnp.bfloat16 and widened:
            assert cpu_upcasts_bf16_stacks()
            assert [(r.bytes, r.count) for r in converts] == [(3 * w.nbytes, 1)]
            assert (piece.bytes, piece.count) == (3 * w[0].nbytes, 4)
            assert len(widened) == 1
        else:
            assert dtype == jnp.float32 or not cpu_upcasts_bf16_stacks()
            assert converts == []
            assert (piece.bytes, piece.count) == (2 * w[0].nbytes, 4)


def test_a_bf16_stack_the_body_indexes_is_charged_as_the_host_compiler_lowers_it():
    """A bf16 stack a scan's body indexes itself (a loop-invariant operand reaching a
    `dynamic_slice` through a jit call, as the prefetching layer scan's backward reads
    its residuals) is upcast whole to f32 before the loop by the host compilers that
    upcast stacked inputs, for a dot and for a multiply alike: the ledger charges one
    whole-stack convert exactly where the compiled module holds the widened stack, and
    none for an f32 stack or a bf16 operand the body does not slice."""
    import jax
    import jax.numpy as jnp
    from jax import lax

    from engine.cost import hlo
    from engine.cost.ledger import ledger
    from engine.cost.scan_rows import cpu_upcasts_bf16_stacks

    def scan_of(consume):
        def f(c_BD, w_NXD, v_BD):
            def body(c_BD, i):
                w = lax.dynamic_index_in_dim(w_NXD, i, keepdims=False)
                return (consume(c_BD, w) + v_BD).astype(c_BD.dtype), None

            return lax.scan(body, c_BD, jnp.arange(4))[0]
        return f

    dot = lambda c, w: jnp.dot(c, w, preferred_element_type=jnp.float32)
    for consume, stack in ((dot, (4, 32, 32)), (lambda c, w: c * w, (4, 16, 32))):
        for dtype in (jnp.bfloat16, jnp.float32):
            c, w, v = jnp.ones((16, 32), dtype), jnp.ones(stack, dtype), jnp.ones((16, 32), dtype)
            f = scan_of(consume)
            rows = ledger(jax.make_jaxpr(f)(c, w, v), Layout.parse("single"))
            converts = [r for r in rows if r.primitive == "convert_element_type" and r.scan_stack]
            module = hlo.parse(jax.jit(f).lower(c, w, v).compile().as_text())
            widened = [i for i in module.computations[module.entry]
                       if i.result.startswith(f"f32[{','.join(map(str, stack))}]")]
            if dtype == jnp.bfloat16 and cpu_upcasts_bf16_stacks():
                assert len(widened) == 1
                assert [(r.bytes, r.count, r.shape) for r in converts] == [(3 * w.nbytes, 1, stack)]
            else:
                assert converts == []
                assert dtype == jnp.float32 or widened == []


def test_a_scans_stacked_traffic_is_priced_out_of_cache():
    """The rows a scan adds for its stacked inputs and outputs are `scan_stack` rows
    (written an iteration loop before they are read) and the body's own rows are not.
    The stack's share of a row's bytes: half of a slice or update (the slot in the stack;
    the slice written out or the update read is the loop's), all of a zero-fill. A
    profile with `cold_hbm` prices that share at it, the rest and every other row as
    before, one without it (the accelerators', an older calibration file) at `hbm`. An
    eager framework's layer loop stacks nothing: an unfused accelerator moves none of
    them."""
    import jax

    from engine.cost.ledger import ledger
    from engine.cost.price import compute_seconds, moved_bytes

    f, x, w = _scan_example()
    rows = ledger(jax.make_jaxpr(f)(x, w), Layout.parse("single"))
    stacked = {"dynamic_update_slice", "dynamic_slice", "broadcast_in_dim"}
    cold = [r for r in rows if r.scan_stack]
    assert cold and {r.primitive for r in cold} <= stacked
    assert all(r.scope == "other" and r.kind == "memory" for r in cold)
    assert any(not r.scan_stack and r.kind == "memory" for r in rows)
    share = {"dynamic_update_slice": 0.5, "dynamic_slice": 0.5, "broadcast_in_dim": 1.0}
    assert {r.primitive for r in cold} == set(share)
    assert all(r.scan_stack == share[r.primitive] for r in cold)
    hw = dataclasses.replace(calibration.cpu_defaults(), cold_hbm=0.0)  # no hbm_cold
    assert all(p.cold_hbm == 0 for p in hardware.PROFILES.values())
    slow = dataclasses.replace(hw, cold_hbm=hw.hbm / 4)
    for r in rows:
        before, after = compute_seconds(r, hw, 1)[0], compute_seconds(r, slow, 1)[0]
        if r.scan_stack:  # the stack's share 4x as long, the rest as before
            assert before > 0 and after == pytest.approx(
                before * (1 - r.scan_stack) + 4 * before * r.scan_stack, rel=1e-12)
        else:
            assert after == before
    eager = dataclasses.replace(hardware.get("h100"), fusion=False)
    assert all(moved_bytes(r, eager) == 0 and moved_bytes(r, hw) == r.bytes > 0 for r in cold)
    assert all(moved_bytes(r, eager) == r.bytes for r in rows
               if not (r.scan_stack or r.loop_copy))


def test_a_body_indexing_its_own_stacks_is_charged_as_a_scans_stacking():
    """A scan body that reads layer i's row of a stack it closes over and writes its
    output into a carried [N, ...] buffer (as the prefetching layer scans do) moves what
    a scan of the same stacked input and output moves: its slice and its update are
    `scan_stack` rows of the bytes the scan's own slice and update rows carry (index
    scalars aside). A row of an array the body computes, and the same slice outside a
    loop, are not."""
    import jax
    import jax.numpy as jnp
    from jax import lax

    from engine.cost.ledger import ledger

    def scanned(x_BD, w_NDD):
        def body(c_BD, w_DD):
            h_BD = jnp.tanh(c_BD @ w_DD)
            return h_BD, h_BD
        return lax.scan(body, x_BD, w_NDD)

    def indexed(x_BD, w_NDD):
        def body(carry, i):
            c_BD, h_NBD = carry
            w_DD = lax.dynamic_index_in_dim(w_NDD, i, keepdims=False)
            h_BD = jnp.tanh(c_BD @ w_DD)
            row_1D = lax.dynamic_slice_in_dim(h_BD, i % 2, 1)  # a row the body made
            h_NBD = lax.dynamic_update_index_in_dim(h_NBD, h_BD * row_1D.sum(), i, 0)
            return (h_BD, h_NBD), None
        first_DD = lax.dynamic_index_in_dim(w_NDD, x_BD.shape[0] % 3, keepdims=False)
        h_NBD = jnp.zeros((w_NDD.shape[0], *x_BD.shape)) + first_DD.sum()
        return lax.scan(body, (x_BD, h_NBD), jnp.arange(w_NDD.shape[0]))[0]

    x, w = jnp.ones((16, 32)), jnp.ones((4, 32, 32))
    mine = ledger(jax.make_jaxpr(indexed)(x, w), Layout.parse("single"))
    theirs = ledger(jax.make_jaxpr(scanned)(x, w), Layout.parse("single"))

    def stacked(rows, primitive, shape):
        return [r for r in rows if r.primitive == primitive and r.scan_stack
                and r.count == 4 and r.shape[-2:] == shape]

    for primitive, shape in (("dynamic_slice", (32, 32)), ("dynamic_update_slice", (16, 32))):
        (a,), (b,) = stacked(mine, primitive, shape), stacked(theirs, primitive, shape)
        assert a.bytes == pytest.approx(b.bytes, abs=16), primitive  # 4-byte indices
        assert a.scan_stack == pytest.approx(b.scan_stack, abs=5e-3) and b.scan_stack == 0.5
    slices = [r for r in mine if r.primitive == "dynamic_slice" and r.count in (1, 4)
              and r.shape in ((1, 32), (1, 32, 32))]
    assert {(r.shape, r.count, round(r.scan_stack, 2)) for r in slices} == {
        ((1, 32), 4, 0), ((1, 32, 32), 4, 0.5), ((1, 32, 32), 1, 0)}


def _body_copies(f, *args) -> list[tuple]:
    """Shapes of the `copy` instructions inside the while bodies of `f`'s compiled module
    on this host (not the s32[] loop counter's)."""
    import re

    import jax

    from engine.cost import hlo

    module = hlo.parse(jax.jit(f).lower(*args).compile().as_text())
    bodies = set(re.findall(r"body=%?([\w.\-]+)", "\n".join(
        ins.attributes for ins in module.instructions() if ins.opcode == "while")))
    return sorted(tuple(int(d) for d in m.group(1).split(",") if d)
                  for name in bodies for ins in module.computations.get(name, [])
                  if ins.opcode == "copy" and (m := re.match(r"f32\[([0-9,]+)\]", ins.result)))


def test_a_carry_the_body_still_reads_after_replacing_it_is_copied_every_iteration():
    """A carried w replaced by a value made from the scanned input (prefetch's next
    layer's weights) or updated while a matmul reads the old one: XLA:CPU copies it in
    the loop body, and the ledger charges one copy of it per iteration (read and
    written: `Row.loop_copy`). The carried x -> tanh(x @ w) reads its old value only on
    the way to the new one: no copy, no row. The rows are priced in cache on the CPU and
    move nothing on an eager or a fusion profile."""
    import jax
    import jax.numpy as jnp
    from jax import lax

    from engine.cost.ledger import ledger
    from engine.cost.price import moved_bytes

    def scan_of(new_w):
        def f(x, w0, ws):
            def body(carry, w_next):
                x, w = carry
                return (jnp.tanh(x @ w), new_w(w, w_next)), None
            return lax.scan(body, (x, w0), ws)[0][0]
        return f

    args = (jnp.ones((64, 128)), jnp.ones((128, 128)), jnp.ones((6, 128, 128)))
    cases = {"fresh": (scan_of(lambda w, w_next: jnp.sin(w_next)), 1),
             "updated": (scan_of(lambda w, w_next: w + jnp.sin(w_next)), 1),
             "carried through": (scan_of(lambda w, w_next: w), 0)}
    for name, (f, want) in cases.items():
        rows = [r for r in ledger(jax.make_jaxpr(f)(*args), Layout.parse("single"))
                if r.loop_copy]
        assert len(rows) == want, name
        copied = set(_body_copies(f, *args))
        assert {r.shape for r in rows} <= copied, name  # the compiler copies what is charged
        assert (64, 128) not in copied, name  # and not x
        for r in rows:
            assert (r.primitive, r.bytes, r.count) == ("copy", 2 * 128 * 128 * 4, 6)
            assert not r.scan_stack
            assert moved_bytes(r, calibration.cpu_defaults()) == r.bytes
            assert moved_bytes(r, dataclasses.replace(hardware.get("h100"), fusion=False)) == 0
            assert moved_bytes(r, hardware.get("v5e")) == 0

