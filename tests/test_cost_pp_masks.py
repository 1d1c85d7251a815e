"""The blocked attention kernel's mask machinery under a pipeline (pp x cp): where the
ledger puts it and what an accelerator's flash kernel is priced for.

Under `jax.vjp` JAX splits the key-block scan's known part (per key block the causal
mask, whether any query sees the block, the constant fills of the masked scores) off
into a scan of its own and hoists it out of the layer scan; the compiled step builds
its stacks [J, B, G, R, L, T] once per forward unit, in the forward slot's branch of the
tick (slow test below, the compiled HLO), with the name stack the values had inside the
layer scan: without the unit's scope."""
import re

import pytest

from engine.cli.args import build_parser, parse_or_exit
from engine.cost import hardware, pipeline as cp
from engine.cost.ledger import step_ledger
from engine.cost.price import priced_rows
from layers import scopes

# 4 layers over 2 stages, 512 tokens over cp 2: 256 queries a device in two chunks of
# 128 (load-balanced causal cp) against 512 gathered keys, 4 key blocks of 128
ARGS = ["--model", "tiny", "--layers", "4", "--seq", "512", "--batch", "4",
        "--layout", "cp2xpp2", "--attention", "blocked", "--remat", "full",
        "--microbatches", "2"]


@pytest.fixture(scope="module")
def traced():
    cfg, tcfg, parallel, layout, _ = parse_or_exit(ARGS, build_parser())
    return step_ledger(cfg, tcfg, layout, parallel)


def _mask_rows(rows):
    """The rows of the split-off mask scans: the key-block scans' memory rows that run
    outside the layer scan (the key-block scans inside it run once per layer)."""
    return [r for r in rows if r.kernel == "blocked" and r.kind == "memory"
            and r.phase == "fwd" and r.primitive == "dynamic_update_slice"]


def test_every_row_of_the_tick_but_its_shifts_and_buffer_writes_runs_in_a_unit(traced):
    """The hoisted rows (masks, RoPE tables, cp positions) run in the forward slot's
    branch: they are the forward unit's, priced once per forward, not once per tick
    outside every unit."""
    once = cp._once([r for r in traced if scopes.PP_TICK in r.pp])
    own = [r for r in once if cp.unit_of(r) is None]
    assert {r.scope for r in own} == {"other"}
    masks = _mask_rows(once)
    assert masks and {cp.unit_of(r) for r in masks} == {cp.FORWARD}


def test_the_mask_stacks_are_the_flash_kernels_own_on_an_accelerator(traced):
    """A flash kernel forms the masks in registers: on H100 nothing of the mask scans is
    priced, and the forward's kernel row moves what the backward's recompute of the
    same forward kernel moves (q, k, v, o, lse), not the stacked fills of the masked
    scores [J, B, G, R, L, T] f32 it would read as scanned operands."""
    h100 = hardware.get("h100")
    on_h100 = priced_rows(traced, h100)
    assert not [r for r in on_h100 if r.scope == "attention" and r.kind == "memory"
                and len(r.shape) >= 5 and r.shape[-1] == 128 and r.shape[-2] == 128]
    kernels = {(r.phase, r.shape): r for r in traced if r.kind == "attention"}
    for (phase, shape), row in kernels.items():
        if phase == "fwd":
            again = kernels[("recompute", shape)]
            assert row.bytes == pytest.approx(again.bytes, rel=0.05)
            assert row.flops == again.flops


@pytest.mark.slow
def test_the_compiled_step_builds_the_mask_stacks_once_per_forward_unit(traced):
    """The compiled step (XLA:CPU, 4 devices) writes the stacked masks [J, B, G, R, L, T]
    in the tick's slot branch, outside the layer loop (once per forward unit, not per
    layer: XLA does not hoist them out of the tick loop, the branch's predicate
    varies by tick) and reads them in the forward's key-block loops only; the ledger
    counts the mask scans' updates once per unit: J key blocks per attention call."""
    from engine.cost.memory import compile_step
    from engine.run.step import Trainer

    cfg, tcfg, parallel, layout, _ = parse_or_exit(ARGS, build_parser())
    text = compile_step(Trainer(cfg, tcfg, layout, layout.mesh(), parallel)).as_text()
    J, B, G, R, L, T = 4, 4 // 2, cfg.n_kv_heads, cfg.n_heads // cfg.n_kv_heads, 128, 128
    stack = rf"pred\[{J},{B},{G},{R},{L},{T}\]"
    writes = re.findall(stack + r"\{[^}]*\} fusion\(.*op_name=\"([^\"]*)\"", text)
    assert writes
    for name in writes:
        assert "pp_tick/cond/branch" in name and "jvp()/while" not in name
    readers = re.findall(r"= \(.*" + stack + r".*\) while\(.*op_name=\"([^\"]*)\"", text)
    assert any("pp_forward/jvp()/while/body" in n for n in readers)
    assert not any("pp_backward" in n for n in readers)
    # a device's two query chunks see the first half of the keys and all of them: J / 2
    # and J updates of each stack a forward unit (per layer would be twice that)
    per_unit = cp._once([r for r in traced if scopes.PP_TICK in r.pp])
    assert {r.count for r in _mask_rows(per_unit)} == {J // 2, J}
