"""Safetensors files in and out, one tensor at a time.

Reading goes through `safetensors.safe_open` (the format's own library): it memory-maps
a file and copies out only the tensor asked for. A file is opened for each tensor and
closed again, so the pages of the mapping leave the process instead of piling up to the
whole model.

Writing is the format written directly (an 8-byte little-endian header length, a JSON
header of {name: {dtype, shape, data_offsets}}, the tensors' bytes): the library's
`save_file` takes a dict of every tensor of a file at once, and a file can be the whole
model. The header is known from the shapes before any data, so each tensor is written
at its offset as it is produced and freed. Files are split as `save_pretrained` splits
them: `model.safetensors` below `max_shard_size`, else `model-0000i-of-0000n.safetensors`
and `model.safetensors.index.json` mapping every tensor to its file.
"""
from __future__ import annotations

import contextlib
import json
import os
import struct
from collections.abc import Callable, Iterable

import ml_dtypes
import numpy as np

SINGLE = "model.safetensors"
INDEX = "model.safetensors.index.json"
ST_DTYPES = {"F32": np.dtype(np.float32), "BF16": np.dtype(ml_dtypes.bfloat16),
             "F16": np.dtype(np.float16)}
NP_TO_ST = {v: k for k, v in ST_DTYPES.items()}
UNITS = {"KB": 10**3, "MB": 10**6, "GB": 10**9, "KIB": 2**10, "MIB": 2**20, "GIB": 2**30}


class HFError(ValueError):
    """A Hugging Face directory or file that cannot be used: one line, exit code 2."""


def parse_size(text: str) -> int:
    """`5GB`, `500MB`, `2GiB` or a byte count -> bytes (as `save_pretrained` reads it)."""
    t = text.strip().upper()
    for unit, scale in sorted(UNITS.items(), key=lambda u: -len(u[0])):
        if t.endswith(unit):
            return int(float(t[: -len(unit)]) * scale)
    return int(t)


class Reader:
    """The tensors of a Hugging Face model directory: `model.safetensors`, or the files a
    `model.safetensors.index.json` names. `shape(name)` reads headers only; `get(name)`
    copies one tensor out (f32 numpy)."""

    def __init__(self, directory: str):
        from safetensors import safe_open

        self._open = safe_open
        self.directory = directory
        index = os.path.join(directory, INDEX)
        if os.path.exists(index):
            try:
                with open(index) as f:
                    weight_map = json.load(f)["weight_map"]
            except (OSError, ValueError, KeyError) as e:
                raise HFError(f"{index}: not a safetensors index ({e})") from None
        elif os.path.exists(os.path.join(directory, SINGLE)):
            weight_map = None
        else:
            raise HFError(f"{directory} has neither {SINGLE} nor {INDEX}")
        self.files: dict[str, str] = {}
        self._shapes: dict[str, tuple] = {}
        for file in sorted(set(weight_map.values())) if weight_map else [SINGLE]:
            path = os.path.join(directory, file)
            for name, shape in self._header(path).items():
                self.files[name], self._shapes[name] = path, shape
        if weight_map:
            missing = sorted(n for n in weight_map if n not in self.files)
            if missing:
                raise HFError(f"{index} names {missing[0]} in {weight_map[missing[0]]}, "
                              f"which does not hold it")

    def _header(self, path: str) -> dict[str, tuple]:
        """{name: shape} of one file, after checking the file holds every byte its header
        promises (a truncated download fails here, not halfway through the import)."""
        try:
            size = os.path.getsize(path)
            with open(path, "rb") as f:
                (n,) = struct.unpack("<Q", f.read(8))
                header = json.loads(f.read(n))
        except FileNotFoundError:
            raise HFError(f"missing safetensors file {path}") from None
        except (OSError, ValueError, struct.error) as e:
            raise HFError(f"{path}: not a safetensors file ({type(e).__name__})") from None
        header.pop("__metadata__", None)
        end = max((v["data_offsets"][1] for v in header.values()), default=0)
        if 8 + n + end > size:
            raise HFError(f"{path} is truncated: {size} bytes, its header needs {8 + n + end}")
        return {name: tuple(v["shape"]) for name, v in header.items()}

    def names(self) -> list[str]:
        return sorted(self.files)

    def shape(self, name: str) -> tuple | None:
        return self._shapes.get(name)

    def get(self, name: str) -> np.ndarray:
        """Tensor `name` as f32 numpy (bf16 and f16 widened exactly). The file is mapped
        for this one copy and unmapped again."""
        with self._open(self.files[name], framework="np") as f:
            return _f32(f.get_tensor(name))


def _f32(x: np.ndarray) -> np.ndarray:
    return x if x.dtype == np.float32 else x.astype(np.float32)


def plan_files(tensors: list[tuple[str, tuple, np.dtype]], max_bytes: int) -> dict[str, list]:
    """{file name: [(name, shape, dtype), ...]}: tensors in order, a new file whenever the
    next tensor would take the current one past `max_bytes` (`save_pretrained`'s rule)."""
    groups: list[list] = [[]]
    size = 0
    for t in tensors:
        n = int(np.prod(t[1], dtype=np.int64)) * np.dtype(t[2]).itemsize
        if groups[-1] and size + n > max_bytes:
            groups.append([])
            size = 0
        groups[-1].append(t)
        size += n
    if len(groups) == 1:
        return {SINGLE: groups[0]}
    k = len(groups)
    return {f"model-{i + 1:05d}-of-{k:05d}.safetensors": g for i, g in enumerate(groups)}


def write(directory: str, tensors: list[tuple[str, tuple, np.dtype]],
          produce: Iterable[tuple[str, Callable[[], np.ndarray]]], max_bytes: int) -> list[str]:
    """Write the safetensors files of `tensors` [(name, shape, dtype)] into `directory`;
    `produce` yields (name, make) in any order, `make()` giving that tensor's array (cast
    to its dtype here). Returns the files written (and the index, when there are several)."""
    files = plan_files(tensors, max_bytes)
    with contextlib.ExitStack() as stack:
        handles, where = _open_files(directory, files, stack)
        for name, make in produce:
            file, pos, shape, dtype = where.pop(name)
            x = np.ascontiguousarray(make(), dtype=dtype)
            if x.shape != tuple(shape):
                raise ValueError(f"{name}: made {x.shape}, planned {tuple(shape)}")
            handles[file].seek(pos)
            handles[file].write(memoryview(x.reshape(-1).view(np.uint8)))
            del x
        if where:
            raise ValueError(f"tensors never produced: {sorted(where)[:3]}")
    out = list(files)
    if len(files) > 1:
        total = sum(int(np.prod(s, dtype=np.int64)) * np.dtype(d).itemsize
                    for group in files.values() for _, s, d in group)
        index = {"metadata": {"total_size": total},
                 "weight_map": {name: file for file, g in files.items() for name, _, _ in g}}
        with open(os.path.join(directory, INDEX), "w") as f:
            json.dump(index, f, indent=2)
        out.append(INDEX)
    return out


def _open_files(directory: str, files: dict, stack: contextlib.ExitStack):
    """Each file created with its header and its full size; ({file: handle},
    {tensor name: (file, byte offset, shape, dtype)})."""
    where: dict[str, tuple] = {}
    handles = {}
    for file, group in files.items():
        header, offset = {}, 0
        for name, shape, dtype in group:
            n = int(np.prod(shape, dtype=np.int64)) * np.dtype(dtype).itemsize
            header[name] = {"dtype": NP_TO_ST[np.dtype(dtype)], "shape": list(shape),
                            "data_offsets": [offset, offset + n]}
            offset += n
        header["__metadata__"] = {"format": "pt"}
        blob = json.dumps(header, separators=(",", ":")).encode()
        blob += b" " * (-len(blob) % 8)  # the data starts 8-byte aligned
        f = stack.enter_context(open(os.path.join(directory, file), "wb"))
        f.write(struct.pack("<Q", len(blob)) + blob)
        f.truncate(8 + len(blob) + offset)
        handles[file] = f
        base = 8 + len(blob)
        for name, shape, dtype in group:
            where[name] = (file, base + header[name]["data_offsets"][0], shape, dtype)
    return handles, where
