"""Restore by pieces: a format-4 checkpoint opened lazily reads, for each region a device
needs, only the pieces that overlap it, and places exactly the values a whole-array read
places (bitwise: the same bytes, no arithmetic). No compile: states are built on the host."""
import math
import os

import jax
import numpy as np
import pytest
from test_checkpoint import assert_same, flat_host, host_state, meta, trainer

from engine.run import checkpoint, pieces


@pytest.fixture(scope="module")
def fsdp8_checkpoint(tmp_path_factory):
    """A checkpoint written under fsdp8 (8 pieces per sharded array) and its state."""
    t = trainer("fsdp8")
    state = host_state(t, 3)
    path = checkpoint.save(str(tmp_path_factory.mktemp("fsdp8")), 1,
                           *checkpoint.restore(state, t), meta(layout="fsdp8"), 1)
    return path, state


def counting(monkeypatch) -> list:
    """The (key, offset) of every piece read from disk from now on."""
    seen, real = [], pieces.PieceFile.chunks

    def chunks(self, key, piece, dtype):
        seen.append((key, piece["offset"]))
        return real(self, key, piece, dtype)

    monkeypatch.setattr(pieces.PieceFile, "chunks", chunks)
    return seen


def test_a_region_reads_only_the_pieces_that_overlap_it(fsdp8_checkpoint, monkeypatch):
    path, state = fsdp8_checkpoint
    ckpt = checkpoint.open_checkpoint(path)
    key = "['embed']"
    x, want = ckpt.params[key], state.params[key]
    spans = [p["index"] for _, p in x.pieces]
    assert len(spans) == 8  # one piece per fsdp8 device
    dim = next(d for d in range(x.ndim) if spans[0][d] != spans[1][d])  # the fsdp dim
    seen = counting(monkeypatch)
    a, b = spans[2][dim]  # exactly one piece
    one = (slice(None),) * dim + (slice(a, b),)
    np.testing.assert_array_equal(x[one], want[one])
    assert len(seen) == 1
    seen.clear()
    two = (slice(None),) * dim + (slice(a + 1, b + 1),)  # straddles two pieces
    np.testing.assert_array_equal(x[two], want[two])
    assert len(seen) == 2


def test_rows_taken_in_another_order_stay_unread_until_indexed(fsdp8_checkpoint, monkeypatch):
    path, state = fsdp8_checkpoint
    key = "['blocks']['wq']"
    x, want = checkpoint.open_checkpoint(path).params[key], state.params[key]
    order = np.arange(x.shape[0])[::-1]
    seen = counting(monkeypatch)
    y = x[order]
    assert seen == [] and y.shape == want.shape
    np.testing.assert_array_equal(y[1:, 2:5], want[order][1:, 2:5])


@pytest.mark.parametrize("target", ["fsdp2xtp4", "tp8", "single"])
def test_restore_by_pieces_places_what_a_whole_read_places(fsdp8_checkpoint, target):
    path, state = fsdp8_checkpoint
    params, opt_state = checkpoint.restore(checkpoint.open_checkpoint(path), trainer(target))
    assert_same(flat_host(params), state.params)
    assert_same(flat_host(opt_state), state.opt_state)


def test_restore_of_a_damaged_piece_is_one_line(fsdp8_checkpoint, tmp_path):
    path, _ = fsdp8_checkpoint
    copy = tmp_path / os.path.basename(path)
    data = bytearray(open(path, "rb").read())
    piece = checkpoint.open_checkpoint(path).opt_state["[0].mu['embed']"].pieces[5][1]
    data[piece["offset"] + 1] ^= 0xFF
    copy.write_bytes(bytes(data))
    ckpt = checkpoint.open_checkpoint(str(copy))  # headers are fine: found on restore
    with pytest.raises(checkpoint.CheckpointError) as e:
        checkpoint.restore(ckpt, trainer("fsdp8"))
    assert "mu['embed']: checksum mismatch" in str(e.value) and "\n" not in str(e.value)
    assert jax.process_count() == 1


@pytest.mark.parametrize("key, rows_a_chunk", [("['embed']", 3), ("['blocks']['wu']", 0)])
def test_regions_read_each_piece_once_in_chunks_and_rows_in_any_order(
        fsdp8_checkpoint, monkeypatch, key, rows_a_chunk):
    """Several regions (one asked twice, as replicas ask) of rows taken in another order,
    read in chunks smaller than a piece: 3 rows a chunk, or less than a row (then a row a
    chunk). Each piece that overlaps any region is read once; every region equals
    numpy's slice of the whole array."""
    path, state = fsdp8_checkpoint
    x, want = checkpoint.open_checkpoint(path).params[key], state.params[key]
    span = x.pieces[0][1]["index"]
    row = x.dtype.itemsize * math.prod(stop - start for start, stop in span[1:])
    monkeypatch.setattr(pieces, "CHUNK", max(1, rows_a_chunk * row))
    order = np.arange(x.shape[0])[::-1]
    half = [[0, x.shape[0]], [0, x.shape[1] // 2]] + [[0, n] for n in x.shape[2:]]
    regions = [half, [[1, x.shape[0]]] + [[1, n - 1] for n in x.shape[1:]], half]
    seen = counting(monkeypatch)
    got = x[order].regions(regions)
    for region, y in zip(regions, got, strict=True):
        np.testing.assert_array_equal(y, want[order][tuple(slice(*r) for r in region)])
    assert len(seen) == len(set(seen)) == len(x.pieces)


def test_restored_device_buffers_are_the_host_arrays_read_not_copies(
        fsdp8_checkpoint, monkeypatch):
    """The arrays the pieces are read into become the device buffers (jax's CPU client
    takes an aligned host array without copying it): a restore holds the state once."""
    path, _ = fsdp8_checkpoint
    read, real = [], pieces.Stored.regions

    def regions(self, wanted):
        out = real(self, wanted)
        read.extend(out)
        return out

    monkeypatch.setattr(pieces.Stored, "regions", regions)
    params, opt_state = checkpoint.restore(checkpoint.open_checkpoint(path),
                                           trainer("fsdp2xtp4"))
    host = {y.ctypes.data for y in read}
    devices = [s.data.unsafe_buffer_pointer() for x in jax.tree.leaves((params, opt_state))
               for s in x.addressable_shards]
    assert jax.default_backend() == "cpu" and len(devices) > len(jax.tree.leaves(params))
    assert set(devices) <= host


def test_restore_by_pieces_into_a_circular_pipeline_takes_its_layer_order(tmp_path):
    """A circular schedule stores its blocks in another order (`Trainer.layer_order`):
    restored by pieces from a checkpoint of the model's order, its state unstored is the
    saved state, bit for bit."""
    import dataclasses

    from test_checkpoint import CFG, TCFG

    from engine.config import ParallelConfig
    from engine.parallel.layout import Layout
    from engine.run.step import Trainer

    cfg = dataclasses.replace(CFG, n_layers=8)
    plain, lay = trainer("fsdp8", cfg), Layout.parse("pp2xfsdp4")
    inter = Trainer(cfg, TCFG, lay, lay.mesh(), ParallelConfig(
        microbatches=2, pp_schedule="interleaved", pp_virtual=2))
    assert inter.layer_order is not None
    state = host_state(plain, 5)
    path = checkpoint.save(str(tmp_path), 1, *checkpoint.restore(state, plain),
                           meta(cfg, layout="fsdp8"), 1)
    params, opt_state = checkpoint.restore(checkpoint.open_checkpoint(path), inter)
    assert_same(flat_host(inter.unstore(params)), state.params)
    assert_same(flat_host(inter.unstore(opt_state)), state.opt_state)
