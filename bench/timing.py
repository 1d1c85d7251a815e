"""Timing a compiled train step, shared by the bench scripts."""
import statistics
import time

import jax


def time_steps(step, params, opt_state, tokens, steps: int):
    """Median wall-clock seconds of `steps` calls of a compiled train step, after one
    untimed warm-up call. Returns (median_s, params, opt_state, metrics of the warm-up)."""
    params, opt_state, first = step(params, opt_state, tokens)
    jax.block_until_ready(first)
    times = []
    for _ in range(steps):
        t0 = time.perf_counter()
        params, opt_state, metrics = step(params, opt_state, tokens)
        jax.block_until_ready(metrics)
        times.append(time.perf_counter() - t0)
    return statistics.median(times), params, opt_state, first


def compiled_step(trainer):
    """(compiled train step, params, opt_state, tokens, compile seconds): the trainer's
    params from its seed and synthetic batch 0, placed on its mesh."""
    from engine.data import synthetic_tokens

    cfg, tcfg = trainer.cfg, trainer.tcfg
    params, opt_state = trainer.init(tcfg.seed)
    tokens = trainer.put_batch(synthetic_tokens(tcfg.seed, 0, tcfg.batch, tcfg.seq, cfg.vocab))
    t0 = time.perf_counter()
    step = trainer.train_step.lower(params, opt_state, tokens).compile()
    return step, params, opt_state, tokens, time.perf_counter() - t0
