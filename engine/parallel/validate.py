"""Every rule a (model, training, parallel config, layout) must satisfy, in one place.

`problems` returns each as a short phrase; `check` raises them as one `ConfigError`
line. `Trainer`, `Decoder` and every tool call these; the CLIs print the line and exit
2. Allowed values come from their registries: `collectives.ring.TP_COMMS`,
`engine.parallel.zero.ZERO_LEVELS`, `layers.block.REMAT_POLICIES`, the attention kernel table.
`decoder_problems` adds the KV cache's size against the memory it must fit in.
"""
from __future__ import annotations

import math
import os

import numpy as np

from collectives.ring import COMMS, TP_COMMS
from engine.config import GRAD_REDUCES, ConfigError, ParallelConfig, TrainConfig
from engine.parallel.pipeline import SCHEDULES
from engine.parallel.zero import ZERO
from layers import roles
from layers.block import REMAT_MODES
from layers.config import DTYPES, ModelConfig
from layers.kernels import KERNELS
from layers.kernels.context import CP_COMMS, CP_KERNELS

ATTENTIONS = ("auto", *KERNELS)


def config_problems(cfg: ModelConfig, tcfg: TrainConfig,
                    parallel: ParallelConfig = ParallelConfig()) -> list[str]:
    """Everything wrong with the model, training and parallel settings on their own."""
    problems = []
    for name in ("d_model", "n_layers", "n_heads", "n_kv_heads", "head_dim", "mlp_dim", "vocab"):
        if getattr(cfg, name) < 1:
            problems.append(f"{name}={getattr(cfg, name)} must be >= 1")
    for name in ("batch", "seq", "steps"):
        if getattr(tcfg, name) < 1:
            problems.append(f"{name}={getattr(tcfg, name)} must be >= 1")
    if 0 < cfg.sliding_window < tcfg.seq:
        problems.append(f"sliding_window={cfg.sliding_window} is shorter than seq={tcfg.seq}: "
                        f"sliding-window attention is not implemented (use seq <= "
                        f"{cfg.sliding_window})")
    if cfg.head_dim % 2:
        problems.append(f"head_dim={cfg.head_dim} must be even (RoPE rotates pairs)")
    if cfg.n_kv_heads >= 1 and cfg.n_heads % cfg.n_kv_heads:
        problems.append(f"heads={cfg.n_heads} not divisible by kv_heads={cfg.n_kv_heads}")
    # each setting named by a registry: its value must be one of the registry's names
    for name, value, allowed in (
            ("dtype", cfg.dtype, sorted(DTYPES)), ("remat", cfg.remat, list(REMAT_MODES)),
            ("attention", cfg.attention, list(ATTENTIONS)),
            ("tp_comm", parallel.tp_comm, list(COMMS)),
            ("cp_comm", parallel.cp_comm, list(CP_COMMS)),
            ("pp_schedule", parallel.pp_schedule, list(SCHEDULES)),
            ("grad_reduce", parallel.grad_reduce, list(GRAD_REDUCES)),
            ("zero", parallel.zero, list(ZERO))):
        if value not in allowed:
            problems.append(f"{name}={value!r} not one of {allowed}")
    if parallel.prefetch and parallel.zero != 3:
        problems.append(f"--prefetch needs --zero 3 (zero {parallel.zero} keeps params "
                        f"replicated)")
    problems.extend(moe_problems(cfg, parallel))
    if not tcfg.lr > 0 or tcfg.lr > 10:
        problems.append(f"lr={tcfg.lr} must be in (0, 10]")
    if tcfg.warmup < 0:
        problems.append(f"warmup={tcfg.warmup} must be >= 0")
    return problems


def layout_problems(cfg: ModelConfig, tcfg: TrainConfig, parallel: ParallelConfig,
                    layout) -> list[str]:
    """What the layout's axis sizes do not divide (one phrase naming every factor), and
    the sequence rule of a sequence-sharding tp_comm."""
    problems = []
    if divides := layout.problems(cfg, tcfg.batch):
        problems.append(f"{layout.describe()} does not fit: " + "; ".join(divides))
    tp = layout.degree("tp")
    comm = TP_COMMS.get(parallel.tp_comm)
    if comm is not None and comm.shards_sequence and tcfg.seq % tp:
        problems.append(f"--tp-comm {parallel.tp_comm} shards the sequence over tp: "
                        f"seq={tcfg.seq} not divisible by tp={tp}")
    problems.extend(cp_problems(cfg, tcfg, parallel, layout))
    problems.extend(microbatch_problems(tcfg, parallel, layout))
    problems.extend(pp_problems(parallel, layout, cfg))
    if layout.degree("ep") > 1 and not cfg.moe:
        problems.append(f"ep={layout.degree('ep')} shards experts: the model has none "
                        f"(set --experts)")
    if cfg.moe and cfg.capacity_factor > 0 and layout.degree("cp") > 1:
        problems.append("--capacity-factor counts a sequence's tokens per expert: not "
                        "with cp (each rank holds part of a sequence)")
    return problems


def moe_problems(cfg: ModelConfig, parallel: ParallelConfig) -> list[str]:
    """The mixture-of-experts settings (layers/moe.py)."""
    problems = []
    for name in ("experts", "shared_experts", "capacity_factor", "aux_loss_coef",
                 "z_loss_coef"):
        if getattr(cfg, name) < 0:
            problems.append(f"{name}={getattr(cfg, name)} must be >= 0")
    if cfg.moe and not 1 <= cfg.top_k <= cfg.experts:
        problems.append(f"top_k={cfg.top_k} must be in [1, experts={cfg.experts}]")
    if cfg.moe and parallel.tp_comm != "allreduce":
        problems.append(f"--tp-comm {parallel.tp_comm} shards the sequence over tp: experts "
                        f"route whole tokens, use --tp-comm allreduce")
    return problems


def pp_problems(parallel: ParallelConfig, layout, cfg) -> list[str]:
    """1F1B runs one forward ahead per stage: fewer microbatches than stages would leave
    it GPipe with a longer name. The interleaved schedule cuts each device's layers into
    `pp_virtual` equal chunks."""
    pp, m, v = layout.degree("pp"), parallel.microbatches, parallel.pp_virtual
    if pp > 1 and parallel.pp_schedule == "1f1b" and m < pp:
        return [f"--pp-schedule 1f1b needs microbatches >= pp: --microbatches {m} < pp={pp}"]
    if v < 1:
        return [f"pp_virtual={v} must be >= 1"]
    if v > 1 and parallel.pp_schedule != "interleaved":
        return [f"--pp-virtual {v} needs --pp-schedule interleaved"]
    if parallel.pp_schedule == "interleaved" and pp > 1 and cfg.n_layers % (pp * v):
        return [f"layers={cfg.n_layers} not divisible by pp x pp_virtual = {pp} x {v}"]
    return []


def microbatch_problems(tcfg: TrainConfig, parallel: ParallelConfig, layout) -> list[str]:
    """The per-device batch (the global batch over the batch roles) splits into
    `microbatches` equal microbatches."""
    rows = math.prod(layout.degree(r) for r in roles.roles_sharding("batch"))
    m = parallel.microbatches
    if m < 1:
        return [f"microbatches={m} must be >= 1"]
    if tcfg.batch % rows == 0 and (tcfg.batch // rows) % m:
        return [f"--microbatches {m} does not divide the per-device batch {tcfg.batch}/"
                f"{rows}={tcfg.batch // rows}"]
    return []


def cp_problems(cfg: ModelConfig, tcfg: TrainConfig, parallel: ParallelConfig,
                layout) -> list[str]:
    """cp cuts each sequence into 2*cp load-balanced chunks (layers/context.py), and a
    sequence-sharding tp_comm splits a rank's 2 chunks over tp; the chunks' queries
    need a kernel taking global offsets."""
    cp, tp = layout.degree("cp"), layout.degree("tp")
    if cp == 1:
        return []
    problems = []
    if tcfg.seq % (2 * cp):
        problems.append(f"cp={cp} cuts the sequence into 2*cp={2 * cp} chunks: "
                        f"seq={tcfg.seq} not divisible by {2 * cp}")
    comm = TP_COMMS.get(parallel.tp_comm)
    if (comm is not None and comm.shards_sequence and not tcfg.seq % (2 * cp)
            and (tcfg.seq // cp) % tp):
        problems.append(f"--tp-comm {parallel.tp_comm} shards a cp rank's seq/cp="
                        f"{tcfg.seq // cp} tokens over tp: not divisible by tp={tp}")
    kernel = "reference" if cfg.attention == "auto" else cfg.attention
    if kernel not in CP_KERNELS:
        problems.append(f"attention={cfg.attention!r} takes no global offsets under cp "
                        f"(use one of {list(CP_KERNELS)} or auto)")
    return problems


def problems(cfg: ModelConfig, tcfg: TrainConfig, parallel: ParallelConfig, layout) -> list[str]:
    """Every problem of the four together (an empty list: they run)."""
    found = config_problems(cfg, tcfg, parallel)
    if found:  # the layout rules assume sane numbers
        return found
    return layout_problems(cfg, tcfg, parallel, layout)


def check(cfg: ModelConfig, tcfg: TrainConfig, parallel: ParallelConfig, layout) -> None:
    """Raise ConfigError (one line) naming every problem."""
    if found := problems(cfg, tcfg, parallel, layout):
        raise ConfigError("; ".join(found))


def cache_bytes_per_device(cfg: ModelConfig, layout, batch: int, cache_len: int) -> int:
    """Bytes of one device's KV cache (keys and values, every layer, compute dtype): the
    global cache [N, B, C, G', K] (G' = max(G, tp)) with B sharded over the batch axes and
    G' over tp, as engine/run/decode.py places it."""
    tp = math.prod(layout.degree(r) for r in roles.roles_sharding("heads"))
    rows = math.prod(layout.degree(r) for r in roles.roles_sharding("batch"))
    kv_heads = max(cfg.n_kv_heads, tp)
    return (2 * cfg.n_layers * (batch // rows) * cache_len * (kv_heads // tp) * cfg.head_dim
            * np.dtype(DTYPES[cfg.dtype]).itemsize)


def available_host_memory() -> int:
    """Bytes the kernel can still hand out (/proc/meminfo MemAvailable; physical memory
    where that file does not exist)."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


def decoder_problems(cfg: ModelConfig, layout, batch: int, cache_len: int,
                     memory: int | None, devices_per_memory: int = 1) -> list[str]:
    """`problems` for decoding `batch` rows into a cache of `cache_len` slots (decoding
    keeps activations replicated over tp: tp_comm allreduce), then whether the cache fits:
    `devices_per_memory` devices' caches must fit in `memory` bytes (all of this host's
    devices in its RAM on CPU; one device in its own memory on an accelerator; None: not
    checked). Positions are int32, so cache_len < 2**31."""
    if layout.degree("pp") > 1:
        return [f"decoding runs every layer on each device: use a layout without pp (a pp "
                f"checkpoint loads on any layout), not {layout}"]
    if layout.degree("cp") > 1:
        return [f"decoding keeps each row's whole sequence on one device: use a layout "
                f"without cp (a cp checkpoint loads on any layout), not {layout}"]
    found = problems(cfg, TrainConfig(batch=batch, seq=cache_len), ParallelConfig(), layout)
    if found:
        return found
    if cache_len >= 2**31:
        return [f"cache_len={cache_len:,} must be < 2**31 (positions are int32)"]
    per_device = cache_bytes_per_device(cfg, layout, batch, cache_len)
    need = per_device * devices_per_memory
    if memory is not None and need > memory:
        where = (f" x {devices_per_memory} devices = {need / 2**30:,.1f} GiB"
                 if devices_per_memory > 1 else "")
        found.append(f"a KV cache of {cache_len:,} slots for {batch} row(s) needs "
                     f"{per_device / 2**30:,.1f} GiB per device{where}, more than the "
                     f"{memory / 2**30:,.1f} GiB available: lower the cache length "
                     f"(prompt + new tokens)")
    return found
