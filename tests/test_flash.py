"""Flash attention kernels (blocked jnp and Pallas) against a dense reference.

`AttentionSuite` holds the whole kernel suite: output and dQ/dK/dV in f32 and bf16,
causal and not, GQA ratios 1/2/4, several tile sizes, lengths that are not a
multiple of the tile (both modules zero-pad and mask), and rows with no visible
key. `TestBlockedAttention` runs it on `blocked_attention`; `TestPallasAttention`
(INTERPRET = False, skipped on CPU) and `TestPallasAttentionInterpret`
(INTERPRET = True) run it on `pallas_attention`, in the style of jax's Pallas tests.
Shapes are small: compiling dominates (about 1-2 s per shape in interpret mode).
"""

import dataclasses
import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from reference_model import dense_attention

from layers.kernels import (
    BlockSizes,
    blocked,
    blocked_attention,
    chunked_attention,
    pallas,
    pallas_attention,
    reference_attention,
)

# f32: online softmax reorders the dense reference's sums; measured errors are
# <= 1.2e-6 of the largest entry (about 10 f32 epsilons), so 1e-5 relative to
# max|reference| leaves an 8x margin.
F32_TOL = 1e-5
# bf16: both sides see the same bf16 inputs and the reference runs in f32, but the
# kernels round P and dS to bf16 before their matmuls (as FlashAttention does on
# GPU) and round their outputs to bf16; one bf16 rounding alone is 2^-9 = 2e-3
# relative. Measured errors are 2e-3 to 4.3e-3 of max|reference|: 1.5e-2 keeps a
# 3.5x margin while still catching a wrong mask or scale (errors of order 1).
BF16_TOL = 1.5e-2

# XLA's CPU backend without LLVM optimisation compiles 2-3x faster and dominates
# this file's runtime; it changes speed, not the f32/bf16 rounding under test.
FAST_COMPILE = {"xla_backend_optimization_level": 0}


@dataclasses.dataclass(frozen=True)
class Case:
    causal: bool
    L: int
    S: int
    H: int
    G: int
    block_q: int
    block_k: int
    B: int = 1
    K: int = 32

    def __str__(self):
        mask = "causal" if self.causal else "full"
        sizes = f"B{self.B}-L{self.L}-S{self.S}-H{self.H}-G{self.G}"
        return f"{mask}-{sizes}-q{self.block_q}-k{self.block_k}"

    @property
    def blocks(self) -> BlockSizes:
        return BlockSizes(block_q=self.block_q, block_k=self.block_k)


F32_CASES = [
    Case(causal=True, L=64, S=64, H=2, G=2, block_q=32, block_k=32, B=2),  # GQA 1
    Case(causal=True, L=128, S=128, H=4, G=2, block_q=64, block_k=32),  # GQA 2
    Case(causal=True, L=64, S=64, H=4, G=1, block_q=16, block_k=32),  # GQA 4
    Case(causal=False, L=64, S=64, H=4, G=1, block_q=32, block_k=16),
    Case(causal=False, L=48, S=96, H=4, G=2, block_q=16, block_k=32),  # L != S
]
# Lengths that are not a multiple of the tile: both modules pad and mask.
RAGGED_CASES = [
    Case(causal=True, L=100, S=100, H=4, G=2, block_q=32, block_k=32),
    Case(causal=False, L=72, S=40, H=2, G=2, block_q=32, block_k=16),
]
BF16_CASES = [
    Case(causal=True, L=128, S=128, H=4, G=2, block_q=32, block_k=64),
    Case(causal=False, L=96, S=80, H=4, G=1, block_q=64, block_k=32),
]


def make_inputs(case: Case, dtype, scale: float = 1.0, seed: int = 0):
    """q_BLHK, k_BSGK, v_BSGK and a cotangent do_BLHK as numpy arrays in `dtype`
    (drawn on the host: eager jax.random would compile per shape)."""
    rng = np.random.default_rng(seed)
    shape_q = (case.B, case.L, case.H, case.K)
    shape_kv = (case.B, case.S, case.G, case.K)
    draw = lambda shape, std: (std * rng.standard_normal(shape, np.float32)).astype(dtype)
    return draw(shape_q, scale), draw(shape_kv, scale), draw(shape_kv, 1.0), draw(shape_q, 1.0)


def output_and_grads(attend, q_BLHK, k_BSGK, v_BSGK, do_BLHK):
    """(o, dq, dk, dv) of `attend` for cotangent do, under one jit."""

    def run(q, k, v, do):
        o, vjp = jax.vjp(attend, q, k, v)
        return (o, *vjp(do))

    args = (q_BLHK, k_BSGK, v_BSGK, do_BLHK)
    return jax.jit(run).lower(*args).compile(FAST_COMPILE)(*args)


@functools.cache
def reference_output_and_grads(case: Case, dtype, scale: float = 1.0):
    """Dense f32 reference (o, dq, dk, dv) on the f32 upcast of make_inputs(case,
    dtype, scale); cached so every kernel class shares one compile per case."""
    inputs = [x.astype(np.float32) for x in make_inputs(case, dtype, scale)]
    reference = lambda q, k, v: dense_attention(q, k, v, causal=case.causal)
    return output_and_grads(reference, *inputs)


def relative_error(a, b) -> float:
    """max|a - b| / max|b| in f32."""
    a, b = np.asarray(a, np.float32), np.asarray(b, np.float32)
    return float(np.max(np.abs(a - b)) / np.max(np.abs(b)))


def assert_close(got, want, tol: float):
    for name, a, b in zip(("o", "dq", "dk", "dv"), got, want):
        assert a.shape == b.shape, (name, a.shape, b.shape)
        assert np.all(np.isfinite(np.asarray(a, np.float32))), f"{name} not finite"
        err = relative_error(a, b)
        assert err <= tol, f"{name}: max|a-b|/max|b| = {err:.2e} > {tol:.0e}"


class AttentionSuite:
    """The kernel suite. Subclasses define `attend(q, k, v, *, causal, blocks)` and
    `attend_with_kv_len(q, k, v, kv_len)` (non-causal; keys >= kv_len masked)."""

    def check_against_reference(self, case: Case, dtype, tol: float):
        inputs = make_inputs(case, dtype)
        attend = lambda q, k, v: self.attend(q, k, v, causal=case.causal, blocks=case.blocks)
        got = output_and_grads(attend, *inputs)
        assert_close(got, reference_output_and_grads(case, dtype), tol)
        if dtype == jnp.float32:
            engine_attend = lambda q, k, v: reference_attention(q, k, v, causal=case.causal)
            assert_close(got, output_and_grads(engine_attend, *inputs), tol)

    @pytest.mark.parametrize("case", F32_CASES, ids=str)
    def test_f32_matches_reference(self, case):
        self.check_against_reference(case, jnp.float32, F32_TOL)

    @pytest.mark.parametrize("case", RAGGED_CASES, ids=str)
    def test_length_not_multiple_of_block_is_padded(self, case):
        self.check_against_reference(case, jnp.float32, F32_TOL)

    @pytest.mark.parametrize("case", BF16_CASES, ids=str)
    def test_bf16_matches_reference(self, case):
        self.check_against_reference(case, jnp.bfloat16, BF16_TOL)

    def test_large_logits_in_masked_tiles_stay_finite(self):
        # Inputs scaled by 6 give scores of std ~36 and max ~150, past exp's f32
        # overflow at 88: a masked entry that leaked into the running max or sum,
        # or a missing max subtraction, would give inf or NaN. block_q < block_k
        # puts rows that see no key of a tile on both sides of the diagonal.
        case = Case(causal=True, L=64, S=64, H=2, G=1, block_q=16, block_k=32)
        inputs = make_inputs(case, jnp.float32, scale=6.0)
        attend = lambda q, k, v: self.attend(q, k, v, causal=True, blocks=case.blocks)
        got = output_and_grads(attend, *inputs)
        assert_close(got, reference_output_and_grads(case, jnp.float32, 6.0), F32_TOL)

    @pytest.mark.parametrize("kv_len", [0, 5])
    def test_fully_masked_rows_stay_finite(self, kv_len):
        # No public input hides every key from a row (causal row i sees key i and
        # padding never fills a tile), so this goes through the private plan with
        # only kv_len valid keys. kv_len = 0 masks every row: o and all grads are 0.
        # kv_len = 5 masks the whole second key tile and must equal attention over
        # the first 5 keys, with zero dK/dV for the masked keys.
        case = Case(causal=False, L=32, S=32, H=2, G=1, block_q=16, block_k=16)
        q, k, v, do = make_inputs(case, jnp.float32)
        attend = lambda q, k, v: self.attend_with_kv_len(q, k, v, kv_len)
        got = output_and_grads(attend, q, k, v, do)
        for x in got:
            assert np.all(np.isfinite(np.asarray(x)))
        if kv_len == 0:
            for x in got:
                np.testing.assert_array_equal(np.asarray(x), 0.0)
            return
        reference = lambda q, k, v: dense_attention(q, k, v, causal=False)
        o, dq, dk, dv = output_and_grads(reference, q, k[:, :kv_len], v[:, :kv_len], do)
        pad = lambda x: np.pad(x, ((0, 0), (0, case.S - kv_len), (0, 0), (0, 0)))
        assert_close(got, (o, dq, pad(dk), pad(dv)), F32_TOL)

    def test_bad_shapes_raise(self):
        q = np.zeros((1, 32, 3, 16))
        k = np.zeros((1, 32, 2, 16))
        with pytest.raises(ValueError, match="multiple of kv heads"):
            self.attend(q, k, k, causal=True, blocks=BlockSizes(16, 16))
        q = np.zeros((1, 32, 2, 16))
        k = np.zeros((1, 48, 2, 16))
        with pytest.raises(ValueError, match="L == S"):
            self.attend(q, k, k, causal=True, blocks=BlockSizes(16, 16))


class TestBlockedAttention(AttentionSuite):
    def attend(self, q_BLHK, k_BSGK, v_BSGK, *, causal, blocks):
        return blocked_attention(q_BLHK, k_BSGK, v_BSGK, causal=causal, blocks=blocks)

    def attend_with_kv_len(self, q_BLHK, k_BSGK, v_BSGK, kv_len):
        B, L, H, K = q_BLHK.shape
        G = k_BSGK.shape[2]
        plan = blocked._Plan(causal=False, block_k=16, kv_len=kv_len, scale=K**-0.5)
        q_BLGRK = q_BLHK.reshape(B, L, G, H // G, K)
        return blocked._flash(plan)(q_BLGRK, k_BSGK, v_BSGK).reshape(B, L, H, K)

    def test_memory_grows_linearly_with_length(self):
        # fwd+bwd temp memory must stay below one dense [H, L, L] f32 score matrix
        # (32 MiB here; measured 11 MiB, mostly [H, L, block_k] blocks and dQ).
        case = Case(causal=True, L=2048, S=2048, H=2, G=1, block_q=128, block_k=128, K=16)
        q, k, v, do = make_inputs(case, jnp.float32)
        attend = lambda q, k, v: blocked_attention(q, k, v, causal=True, blocks=case.blocks)
        run = lambda q, k, v, do: jax.vjp(attend, q, k, v)[1](do)
        memory = jax.jit(run).lower(q, k, v, do).compile().memory_analysis()
        assert memory.temp_size_in_bytes < case.H * case.L**2 * 4


class TestChunkedAttention(AttentionSuite):
    def attend(self, q_BLHK, k_BSGK, v_BSGK, *, causal, blocks):
        return chunked_attention(q_BLHK, k_BSGK, v_BSGK, causal=causal, blocks=blocks)

    def attend_with_kv_len(self, q_BLHK, k_BSGK, v_BSGK, kv_len):
        return chunked_attention(q_BLHK, k_BSGK, v_BSGK, causal=False, kv_len=kv_len)

    def test_key_grads_are_summed_in_place_not_padded(self):
        # each causal chunk reads a key prefix; its dk, dv are added into the prefix of
        # one f32 sum inside the custom_vjp, not padded to the whole length and added
        # per chunk (a strided relayout per element on XLA:CPU), and laid out once
        q = jnp.zeros((2, 64, 4, 8), jnp.bfloat16)
        k = jnp.zeros((2, 64, 2, 8), jnp.bfloat16)
        loss = lambda q, k, v: chunked_attention(
            q, k, v, blocks=BlockSizes(block_q=16)).astype(jnp.float32).sum()
        text = str(jax.make_jaxpr(jax.grad(loss, argnums=(1, 2)))(q, k, k))
        assert re.findall(r"= (pad|scatter-add)\[", text) == ["scatter-add"] * (2 * 3)


class TestPallasAttention(AttentionSuite):
    INTERPRET = False

    @pytest.fixture(autouse=True)
    def _skip_compiled_on_cpu(self):
        if not self.INTERPRET and jax.default_backend() == "cpu":
            pytest.skip("compiled Pallas kernels need a GPU; see the Interpret subclass")

    def attend(self, q_BLHK, k_BSGK, v_BSGK, *, causal, blocks):
        return pallas_attention(
            q_BLHK, k_BSGK, v_BSGK, causal=causal, blocks=blocks, interpret=self.INTERPRET
        )

    def attend_with_kv_len(self, q_BLHK, k_BSGK, v_BSGK, kv_len):
        plan = pallas._Plan(
            causal=False,
            block_q=16,
            block_k=16,
            kv_len=kv_len,
            scale=q_BLHK.shape[-1] ** -0.5,
            interpret=self.INTERPRET,
        )
        heads_major = lambda x: x.transpose(0, 2, 1, 3)
        o_BHLK = pallas._flash(plan)(*map(heads_major, (q_BLHK, k_BSGK, v_BSGK)))
        return heads_major(o_BHLK)

    def test_block_must_be_power_of_two(self):
        q = np.zeros((1, 64, 2, 16))
        with pytest.raises(ValueError, match="power of two"):
            self.attend(q, q, q, causal=True, blocks=BlockSizes(block_q=48, block_k=32))

    def test_interpret_defaults_to_cpu_backend(self, monkeypatch):
        plans = []
        build = pallas._flash
        monkeypatch.setattr(pallas, "_flash", lambda plan: plans.append(plan) or build(plan))
        q = np.zeros((1, 32, 2, 16))
        jax.make_jaxpr(lambda q: pallas_attention(q, q, q))(q)
        assert [plan.interpret for plan in plans] == [jax.default_backend() == "cpu"]


class TestPallasAttentionInterpret(TestPallasAttention):
    INTERPRET = True


# chunked by default (the CPU's kernel below 1024 tokens); blocked is also checked in a
# step by test_cp's local-kernel cases
@pytest.mark.parametrize("attention", ["chunked", pytest.param("blocked", marks=pytest.mark.slow),
                                       pytest.param("pallas", marks=pytest.mark.slow)])
def test_inside_the_full_step_matches_reference_attention(attention):
    """Loss and grads of the whole step under fsdp4xtp2 (heads sharded over tp, Pallas
    run in its nested check_vma=False region) equal those with the dense reference."""
    from engine.config import TrainConfig, model_config
    from engine.parallel.layout import Layout
    from engine.run.data import synthetic_tokens
    from engine.run.step import Trainer

    layout = Layout.parse("fsdp4xtp2")
    results = {}
    for name in ("reference", attention):
        cfg = model_config("tiny", n_heads=8, n_kv_heads=2, head_dim=8, dtype="f32", attention=name)
        trainer = Trainer(cfg, TrainConfig(batch=8, seq=32), layout, layout.mesh())
        params, _ = trainer.init(0)
        tokens = trainer.put_batch(synthetic_tokens(0, 0, 8, 32, cfg.vocab))
        loss, grads, _ = trainer.loss_and_grads(params, tokens)
        results[name] = (float(loss), jax.tree.map(np.asarray, grads))
    (loss, grads), (ref_loss, ref_grads) = results[attention], results["reference"]
    assert abs(loss - ref_loss) <= F32_TOL * ref_loss
    for got, want in zip(jax.tree.leaves(grads), jax.tree.leaves(ref_grads)):
        assert relative_error(got, want) <= F32_TOL
