"""Checkpoint writes that fail part-way (disk full) leave nothing behind and say how much
space a save needs; a missing shard file is named; a --checkpoint-dir that is a file is
refused as such. No compile: states are built on the host."""
import errno
import os

import pytest
from test_checkpoint import host_state, meta, run_main, trainer

from engine.run import checkpoint, pieces


@pytest.fixture
def state():
    return host_state(trainer("single"), 0)


def test_disk_full_save_removes_its_temp_file_and_says_what_it_needs(state, tmp_path,
                                                                     monkeypatch):
    d = str(tmp_path)
    checkpoint.save(d, 1, state.params, state.opt_state, meta(), keep=2)
    before = sorted(os.listdir(d))
    real_fsync = os.fsync

    def full(fd):  # the data reached the page cache, but the disk has no room for it
        if os.path.basename(os.readlink(f"/proc/self/fd/{fd}")).startswith("."):
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        return real_fsync(fd)

    monkeypatch.setattr(os, "fsync", full)
    with pytest.raises(checkpoint.CheckpointError) as e:
        checkpoint.save(d, 2, state.params, state.opt_state, meta(), keep=2)
    monkeypatch.setattr(os, "fsync", real_fsync)
    size = os.path.getsize(os.path.join(d, before[0]))
    assert f"step_00000002.ckpt needs {size / 2**20:.1f} MiB" in str(e.value)
    assert "free" in str(e.value) and "\n" not in str(e.value)
    assert sorted(os.listdir(d)) == before  # no hidden partial file keeps the disk full
    assert checkpoint.latest(d).step == 1


def test_probe_file_is_removed_when_the_probe_write_fails(tmp_path, monkeypatch):
    def full(fd):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(os, "fsync", full)
    with pytest.raises(checkpoint.CheckpointError, match="No space left on device"):
        checkpoint.check_writable(str(tmp_path))
    assert os.listdir(tmp_path) == []


def rewrite_header(path: str, header: dict) -> None:
    """Replace the header of a format-4 file, keeping its pieces' bytes."""
    data_end = os.path.getsize(path) - len(pieces.tail(pieces.read_header(path)[0])[0])
    data = open(path, "rb").read()[:data_end]
    open(path, "wb").write(data + pieces.tail(header)[0])


def test_missing_shard_file_is_named(state, tmp_path):
    path = checkpoint.save(str(tmp_path), 1, state.params, state.opt_state, meta(), keep=1)
    record = pieces.read_header(path)[0]
    shard = os.path.basename(checkpoint.shard_path(path, 1, 2))
    record["shards"] = [{"file": shard, "size": 10, "crc32": 0}]
    rewrite_header(path, record)
    with pytest.raises(checkpoint.CheckpointError) as e:
        checkpoint.read(path)
    assert f"shard file {os.path.join(str(tmp_path), shard)}: No such file" in str(e.value)


def test_checkpoint_dir_that_is_a_file_is_refused_as_such(tmp_path, capsys):
    (tmp_path / "ck").write_text("a regular file")
    code, out, err = run_main(capsys, "--checkpoint-dir", str(tmp_path / "ck"))
    assert code == 2 and out == "" and err.count("\n") == 1
    assert "is a file, not a directory" in err


def test_params_only_read_ignores_a_corrupt_optimizer_state(state, tmp_path):
    """Generation reads only the params: a damaged optimizer state must not stop it."""
    path = checkpoint.save(str(tmp_path), 1, state.params, state.opt_state, meta(), keep=1)
    clean = checkpoint.read(path)
    piece = next(iter(pieces.read_header(path)[0]["pieces"]["opt_state"].values()))[0]
    data = bytearray(open(path, "rb").read())
    data[piece["offset"]] ^= 0xFF
    open(path, "wb").write(bytes(data))
    with pytest.raises(checkpoint.CheckpointError, match="checksum mismatch"):
        checkpoint.read(path)
    ckpt = checkpoint.latest(str(tmp_path), parts=("params",))
    assert ckpt.opt_state is None and ckpt.params.keys() == clean.params.keys()
    for key, x in clean.params.items():
        assert (ckpt.params[key] == x).all(), key


def test_a_save_leaves_the_files_of_later_steps_alone(state, tmp_path):
    """Another process may already be writing the next save (its shard file, its
    temporary file) when process 0 prunes after this one."""
    later = [tmp_path / "step_00000005.ckpt.shard-00001-of-00002",
             tmp_path / ".step_00000005.ckpt.shard-00001-of-00002.tmp-999999"]
    earlier = tmp_path / ".step_00000003.ckpt.tmp-999999"  # a killed writer's
    for f in [*later, earlier]:
        f.write_bytes(b"partial")
    checkpoint.save(str(tmp_path), 4, state.params, state.opt_state, meta(), keep=2)
    assert all(f.exists() for f in later) and not earlier.exists()
