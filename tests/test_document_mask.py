"""Document masking of packed sequences: every attention kernel with segment ids equals
the dense reference with them, and a packed row of three documents gives, per token,
the loss and gradients of the three documents run as separate rows (single and cp, tp,
pp layouts).

f32 throughout. Kernels: online softmax reorders the reference's sums (as in
test_flash.py, errors ~1e-6 of the largest entry), so 1e-5 relative to max|reference|.
Packed vs separate rows: the same math on the same tokens, except that without
`document_positions` a document's RoPE angles are its separate row's plus a constant
offset (relative positions agree; cos/sin of the larger angles round differently, ~1e-7
relative), and sharded runs reorder sums as in test_step.py: 1e-5 relative.
"""
import dataclasses
import functools
import json
import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding
from test_tp_comm import random_params

from engine.cli import train as train_cli
from engine.cli.args import UsageError
from engine.cli.models import with_documents
from engine.config import ParallelConfig, TrainConfig, model_config
from engine.parallel.layout import Layout
from engine.parallel.params import fsdp_dims
from engine.run.data import Corpus
from engine.run.step import Trainer
from layers import documents, model, vocab
from layers.axes import Axes
from layers.kernels import (
    BlockSizes,
    blocked_attention,
    chunked_attention,
    pallas_attention,
    reference_attention,
)
from layers.kernels.shared import SegmentIds

TOL = 1e-5
FAST_COMPILE = {"xla_backend_optimization_level": 0}


def close(got, want, tol=TOL, what=""):
    err = float(np.max(np.abs(np.asarray(got, np.float32) - np.asarray(want, np.float32))))
    bound = tol * float(np.max(np.abs(np.asarray(want, np.float32))))
    assert err <= bound, f"{what}: error {err:.2e} > {bound:.2e}"


def ids_of(doc_lengths_B, L):
    """Segment ids [B, L] of rows packed with documents of the given lengths (the last
    one runs to the end of the row)."""
    rows = []
    for lengths in doc_lengths_B:
        ends = np.cumsum(lengths)
        rows.append(np.searchsorted(ends, np.arange(L), side="right"))
    return jnp.asarray(np.array(rows), jnp.int32)


# row 0: three documents, one crossing every tile edge; row 1: one short document first
SEG_LENGTHS = [[5, 19, 9], [3, 40]]


def qkv(B, L, H, G, K, seed=0):
    ks = jax.random.split(jax.random.PRNGKey(seed), 4)
    q = jax.random.normal(ks[0], (B, L, H, K), jnp.float32)
    k = jax.random.normal(ks[1], (B, L, G, K), jnp.float32)
    v = jax.random.normal(ks[2], (B, L, G, K), jnp.float32)
    do = jax.random.normal(ks[3], (B, L, H, K), jnp.float32)
    return q, k, v, do


def value_and_grads(attend, q, k, v, do):
    o, vjp = jax.vjp(attend, q, k, v)
    return (o, *vjp(do))


KERNEL_CASES = {
    "chunked": lambda q, k, v, seg: chunked_attention(q, k, v, segment_ids=seg,
                                                      blocks=BlockSizes(block_q=8)),
    "blocked": lambda q, k, v, seg: blocked_attention(q, k, v, segment_ids=seg,
                                                      blocks=BlockSizes(block_k=8)),
    "pallas": lambda q, k, v, seg: pallas_attention(q, k, v, segment_ids=seg, interpret=True,
                                                    blocks=BlockSizes(block_q=8, block_k=8)),
}


@pytest.mark.parametrize("kernel", sorted(KERNEL_CASES))
def test_kernel_with_segments_matches_reference(kernel):
    """Output and dQ, dK, dV with segment ids equal the dense reference's; L = 33 is not
    a multiple of the tiles (padded keys and queries), tiles of 8 so whole tiles lie
    before a document's start (the skipped ones)."""
    B, L, H, G, K = 2, 33, 4, 2, 8
    q, k, v, do = qkv(B, L, H, G, K)
    ids = ids_of(SEG_LENGTHS, L)
    seg = SegmentIds(ids, ids)
    want = value_and_grads(lambda q, k, v: reference_attention(q, k, v, segment_ids=seg),
                           q, k, v, do)
    attend = KERNEL_CASES[kernel]
    got = jax.jit(lambda q, k, v, do: value_and_grads(
        lambda q, k, v: attend(q, k, v, seg), q, k, v, do)).lower(q, k, v, do).compile(
            FAST_COMPILE)(q, k, v, do)
    for name, g, w in zip(("o", "dq", "dk", "dv"), got, want):
        close(g, w, what=f"{kernel} {name}")
    # the mask matters here: without it the reference differs by far more than TOL
    plain = reference_attention(q, k, v)
    assert float(jnp.max(jnp.abs(plain - want[0]))) > 100 * TOL * float(jnp.max(jnp.abs(want[0])))


@pytest.mark.parametrize("kernel", ["chunked", "blocked"])
def test_kernel_with_offsets_and_segments_matches_reference(kernel):
    """What a cp rank's all-gather path asks of its local kernel: a query chunk at a
    traced global offset against the key prefix, with both sides' ids."""
    B, L, H, G, K = 2, 32, 4, 2, 8
    q, k, v, do = qkv(B, L, H, G, K, seed=2)
    ids = ids_of(SEG_LENGTHS, L)
    c = 8
    q, do = q[:, 2 * c:3 * c], do[:, 2 * c:3 * c]
    seg = SegmentIds(ids[:, 2 * c:3 * c], ids)
    blocks = BlockSizes(block_q=4, block_k=4)
    kernels = {"chunked": chunked_attention, "blocked": blocked_attention}

    def run(attend, q, k, v, do, offset, **kw):
        return value_and_grads(lambda q, k, v: attend(q, k, v, q_offset=offset, segment_ids=seg,
                                                      **kw), q, k, v, do)

    want = run(reference_attention, q, k, v, do, 2 * c)
    got = jax.jit(lambda q, k, v, do, offset: run(kernels[kernel], q, k, v, do, offset,
                                                  blocks=blocks))(q, k, v, do, jnp.int32(2 * c))
    for name, g, w in zip(("o", "dq", "dk", "dv"), got, want):
        close(g, w, what=f"{kernel} {name}")


def test_reference_segments_equal_separate_rows():
    """The reference with segment ids: each document's outputs are those of the
    document attended alone (a plain causal call on its slice)."""
    B, L, H, G, K = 1, 24, 4, 2, 8
    q, k, v, _ = qkv(B, L, H, G, K, seed=1)
    lengths = [7, 10, 7]
    ids = ids_of([lengths], L)
    o = reference_attention(q, k, v, segment_ids=SegmentIds(ids, ids))
    start = 0
    for n in lengths:
        sl = slice(start, start + n)
        close(o[:, sl], reference_attention(q[:, sl], k[:, sl], v[:, sl]), what=f"doc at {start}")
        start += n


# -- the model: a packed row against its documents as separate rows -----------------------


EOS = 3
CFG = model_config("tiny", n_heads=8, n_kv_heads=2, head_dim=8, dtype="f32", remat="none")
SEQ = 16
# two packed windows of L + 1 = 17 tokens: three documents (each ending in EOS) and one
# more target token; the second row's last document is cut by the window's end
DOC_LENGTHS = [[5, 7, 4], [3, 9, 5]]


def packed_rows(seed=0):
    """tokens [B, L+1] and, per row, the start and length of each document's inputs."""
    rng = np.random.default_rng(seed)
    rows, spans = [], []
    for lengths in DOC_LENGTHS:
        row, span = [], []
        for n in lengths:
            span.append((len(row), n))
            row += list(rng.integers(EOS + 1, CFG.vocab, size=n - 1)) + [EOS]
        rows.append((row + list(rng.integers(EOS + 1, CFG.vocab, size=SEQ + 1)))[:SEQ + 1])
        spans.append([(s, min(n, SEQ - s)) for s, n in span if s < SEQ])
    return np.array(rows, np.int32), spans


def separate_rows(tokens, spans):
    """Each document's inputs and its targets as a row of its own, padded after the
    document: [D, L+1], and the weight of each position [D, L] (1 on the document)."""
    rows, weights = [], []
    for b, row_spans in enumerate(spans):
        for s, n in row_spans:
            rows.append(np.pad(tokens[b, s:s + n + 1], (0, SEQ + 1 - (n + 1)),
                               constant_values=EOS + 1))
            weights.append(np.arange(SEQ) < n)
    return np.array(rows, np.int32), np.array(weights, np.float32)


@functools.partial(jax.jit, static_argnums=2)
def token_losses(params, tokens_BL, cfg):
    """Per-token cross-entropy [B, L] of the model on one device (no mesh axes), with the
    documents of `cfg` masked."""
    axes, dims = Axes(), fsdp_dims()
    inputs_BL, targets_BL = tokens_BL[:, :-1], tokens_BL[:, 1:]
    docs = documents.documents(inputs_BL, cfg, axes)
    x_BLD = model.embed(params, inputs_BL, dims, cfg, axes)
    x_BLD, _ = model.blocks(params, x_BLD, dims, cfg, axes, docs)
    h_BLD, unembed_DV = model.head(params, x_BLD, dims, cfg, axes)
    return vocab.cross_entropy(h_BLD, unembed_DV, targets_BL, axes, cfg.compute_dtype,
                               axes.tp_comm)


def weighted_loss(params, tokens_BL, weights_BL, cfg, n_tokens):
    return jnp.sum(token_losses(params, tokens_BL, cfg) * weights_BL) / n_tokens


@functools.partial(jax.jit, static_argnums=(3, 4))
def loss_and_grads(params, tokens_BL, weights_BL, cfg, n_tokens):
    """The weighted mean loss of the per-token losses, and its grads."""
    return jax.value_and_grad(weighted_loss)(params, tokens_BL, weights_BL, cfg, n_tokens)


@pytest.fixture(scope="module")
def init():
    return random_params(CFG, 0)


@pytest.fixture(scope="module")
def separate(init):
    """The documents run as separate rows, no document mask: (per-token losses, loss
    and grads of the packed batch's mean as those rows see it)."""
    tokens, spans = packed_rows()
    rows, weights = separate_rows(tokens, spans)
    losses = np.asarray(token_losses(init, jnp.asarray(rows), CFG))
    n = tokens.shape[0] * SEQ
    loss, grads = loss_and_grads(init, jnp.asarray(rows), jnp.asarray(weights), CFG, n)
    return losses, float(loss), jax.tree.map(np.asarray, grads)


def masked_cfg(positions=False, attention="reference"):
    return dataclasses.replace(CFG, document_eos=EOS, document_positions=positions,
                               attention=attention)


@pytest.mark.parametrize("positions", [False, True])
def test_packed_row_equals_separate_rows_per_token(positions, init, separate):
    """Per token, the packed windows' losses (document mask on) are the separate rows'
    losses, and the grads of the mean are theirs; with the mask off they are not."""
    tokens, spans = packed_rows()
    cfg = masked_cfg(positions)
    losses = np.asarray(token_losses(init, jnp.asarray(tokens), cfg))
    sep_losses, sep_loss, sep_grads = separate
    d = 0
    for b, row_spans in enumerate(spans):
        for s, n in row_spans:
            close(losses[b, s:s + n], sep_losses[d, :n], what=f"row {b} document at {s}")
            d += 1
    loss, grads = loss_and_grads(init, jnp.asarray(tokens), jnp.ones((len(tokens), SEQ)), cfg,
                                 len(tokens) * SEQ)
    assert abs(float(loss) - sep_loss) <= TOL * abs(sep_loss)
    for (path, g), w in zip(jax.tree_util.tree_flatten_with_path(grads)[0],
                            jax.tree.leaves(sep_grads)):
        close(g, w, what=jax.tree_util.keystr(path))
    # dropping the mask changes every document but each row's first
    unmasked = np.asarray(token_losses(init, jnp.asarray(tokens), CFG))
    assert float(np.max(np.abs(unmasked - losses))) > 100 * TOL * float(np.max(np.abs(losses)))


def test_document_ids_and_positions():
    inputs = jnp.array([[7, EOS, 8, 9, EOS, EOS, 5]])
    assert documents.document_ids(inputs, EOS).tolist() == [[0, 0, 1, 1, 1, 2, 3]]
    assert documents.document_positions(inputs, EOS).tolist() == [[0, 1, 0, 1, 2, 0, 0]]


def trainer_loss_and_grads(layout, cfg, init, tokens, parallel=ParallelConfig()):
    lay = Layout.parse(layout)
    tcfg = TrainConfig(batch=len(tokens), seq=SEQ, steps=1, warmup=1)
    t = Trainer(cfg, tcfg, lay, lay.mesh(), parallel)
    params = jax.device_put(init, jax.tree.map(lambda s: NamedSharding(t.mesh, s), t.specs))
    batch = t.put_batch(tokens)
    loss, grads, _ = t.loss_and_grads.lower(params, batch).compile(FAST_COMPILE)(params, batch)
    return float(loss), jax.tree.map(np.asarray, grads)


LAYOUT_CASES = [
    ("single", {}, "reference"),
    ("cp2", dict(cp_comm="allgather"), "reference"),
    ("cp2", dict(cp_comm="ring"), "reference"),
    ("tp2", {}, "reference"),
    ("pp2", dict(microbatches=2), "reference"),
]
SLOW_CASES = [
    ("cp4", dict(cp_comm="allgather"), "blocked"),
    ("cp4", dict(cp_comm="allgather"), "chunked"),
    ("cp4", dict(cp_comm="ring"), "blocked"),
    ("cp2xtp2xpp2", dict(cp_comm="ring", tp_comm="sequence", microbatches=2), "reference"),
    ("fsdp2xcp2", dict(cp_comm="allgather", prefetch=True), "reference"),
    ("single", {}, "pallas"),
    ("single", {}, "blocked"),
]


def check_layout(layout, parallel, attention, positions, init, separate):
    tokens, _ = packed_rows()
    loss, grads = trainer_loss_and_grads(layout, masked_cfg(positions, attention), init, tokens,
                                         ParallelConfig(**parallel))
    _, sep_loss, sep_grads = separate
    assert abs(loss - sep_loss) <= TOL * abs(sep_loss)
    for (path, g), w in zip(jax.tree_util.tree_flatten_with_path(grads)[0],
                            jax.tree.leaves(sep_grads)):
        close(g, w, what=f"{layout} {parallel} {jax.tree_util.keystr(path)}")


@pytest.mark.parametrize("layout,parallel,attention", LAYOUT_CASES)
def test_layouts_match_separate_rows(layout, parallel, attention, init, separate):
    """The step's loss and grads of the packed batch with the document mask, under each
    layout, are those of the documents run as separate rows."""
    check_layout(layout, parallel, attention, False, init, separate)


@pytest.mark.slow
@pytest.mark.parametrize("positions", [False, True])
@pytest.mark.parametrize("layout,parallel,attention", SLOW_CASES + LAYOUT_CASES[1:])
def test_layouts_and_kernels_match_separate_rows(layout, parallel, attention, positions, init,
                                                 separate):
    check_layout(layout, parallel, attention, positions, init, separate)


# -- the training CLI -------------------------------------------------------------------


CLI = ["--model", "tiny", "--layout", "single", "--steps", "2", "--batch", "2", "--seq", "16",
       "--log-every", "1"]


def flags(mask="auto", positions=False, data="x.bin"):
    return types.SimpleNamespace(document_mask=mask, document_positions=positions, data=data)


@pytest.mark.parametrize("mask,eos,want", [("auto", EOS, EOS), ("auto", None, None),
                                           ("on", EOS, EOS), ("off", EOS, None)])
def test_document_mask_flag_resolves_against_the_data(mask, eos, want):
    assert with_documents(CFG, flags(mask), eos).document_eos == want


@pytest.mark.parametrize("mask,positions,eos", [("on", False, None), ("auto", True, None),
                                                ("on", False, CFG.vocab)])
def test_document_mask_without_an_eos_is_refused(mask, positions, eos):
    with pytest.raises(UsageError):
        with_documents(CFG, flags(mask, positions), eos)


@pytest.mark.parametrize("argv,words", [
    (["--document-mask", "on"], ["--document-mask on", "end-of-document"]),
    (["--document-mask", "off", "--document-positions"], ["--document-positions"]),
])
def test_document_flags_refused_in_one_line(argv, words, one_line_error):
    one_line_error(train_cli.main, [*CLI, *argv], *words, table="step")


def test_training_cli_masks_documents_of_data_with_an_eos(tmp_path, monkeypatch, capsys):
    """`--document-mask auto` on data with an EOS id trains with the mask (said on
    stdout); the first step's loss differs from the run with the mask off."""
    rng = np.random.default_rng(0)
    stream = rng.integers(EOS + 1, CFG.vocab, size=4000).astype(np.uint16)
    stream[rng.integers(0, 4000, size=400)] = EOS  # documents of ~10 tokens
    data = Corpus("packed", stream[:3000], stream[3000:], eos_id=EOS)  # as prepared data
    monkeypatch.setattr(train_cli, "load_data", lambda *a, **k: data)
    losses = {}
    for mask in ("auto", "off"):
        metrics = tmp_path / f"{mask}.jsonl"
        code = train_cli.main([*CLI, "--document-mask", mask, "--metrics-file", str(metrics)])
        out = capsys.readouterr().out
        assert code == 0
        assert ("end-of-document id 3" in out) == (mask == "auto"), out
        losses[mask] = json.loads(metrics.read_text().splitlines()[0])["loss"]
    assert losses["auto"] != losses["off"]
