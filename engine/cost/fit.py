"""Will a step fit: the predicted peak bytes per device against the memory it must fit in.

The peak is the hand memory model's (engine/cost/memory.py): on an accelerator profile
with the target's flash attention (`platform` "accelerator" on a GPU, "tpu" on a TPU:
the profile's `memory_platform`), on the CPU as XLA:CPU runs the step
(`platform="cpu"`). The capacity is the chip's HBM (`Hardware.hbm_capacity`); a shared
host's devices all live in its RAM, so there each device gets the host's available
memory divided by the device count.
"""
from __future__ import annotations


def predicted(cfg, tcfg, parallel, layout, hw, trainer=None):
    """The memory model's prediction (`memory.MemoryPrediction`) of the step on `hw`;
    None when it does not cover the configuration (`memory.Unsupported`)."""
    from engine.cost import memory

    platform = "cpu" if hw.shared_host else hw.memory_platform
    try:
        return memory.predict(cfg, tcfg, layout, platform=platform, trainer=trainer,
                              parallel=parallel)
    except memory.Unsupported:
        return None


def peak_bytes(cfg, tcfg, parallel, layout, hw, trainer=None) -> int | None:
    """Predicted peak bytes per device of the step on `hw`; None when the memory model
    does not cover the configuration."""
    pred = predicted(cfg, tcfg, parallel, layout, hw, trainer)
    return None if pred is None else pred.peak


def mapped_bytes(pred, hw) -> int:
    """Bytes of each device's step temporaries mapped anew every step, whose page faults
    the step pays (`price.fault_seconds`), predicted before anything is compiled: on a
    shared host, the memory prediction `pred`'s temporaries (`MemoryPrediction.temp`,
    its peak less the step's arguments; XLA:CPU's `temp_size_in_bytes`) through
    engine/run/host.py `mapped_each_step`; 0 elsewhere or when `pred` is None.
    Read against the compiled steps of `small` on this host (bf16): fsdp8 remat none with
    prefetch 71.8 MiB predicted, 65.6 compiled (mapped: over a thread's 64 MiB heap);
    remat full 17.9 and 19.4; single 140.8 and 144.8; tp8 62.9 and 57.3 (both under the
    heap, so not mapped, as in the step)."""
    if pred is None or not hw.shared_host:
        return 0
    from engine.run import host

    return host.mapped_each_step(pred.temp)


def capacity(hw, n_devices: int, hbm_bytes: float | None = None) -> float | None:
    """Bytes one device may use: `hbm_bytes` when given, else the chip's HBM, else on a
    shared host its available RAM over `n_devices`; None when unknown."""
    if hbm_bytes:
        return float(hbm_bytes)
    if hw.hbm_capacity:
        return float(hw.hbm_capacity)
    if hw.shared_host:
        from engine.parallel.validate import available_host_memory

        return available_host_memory() / max(1, n_devices)
    return None


def memory_fit(cfg, tcfg, parallel, layout, hw):
    """(predicted peak bytes per device, fits in hw.hbm_capacity) for an accelerator
    (flash attention); (None, None) when not modelled or on a shared host."""
    if hw.shared_host:
        return None, None
    peak = peak_bytes(cfg, tcfg, parallel, layout, hw)
    if peak is None:
        return None, None
    return peak, (peak <= hw.hbm_capacity) if hw.hbm_capacity else None
