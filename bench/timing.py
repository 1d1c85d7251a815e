"""Timing a compiled train step, shared by the bench scripts."""
import statistics
import time

import jax


def timed_step(step, params, opt_state, tokens) -> tuple:
    """(params, opt_state, metrics, wall-clock seconds) of one call of a compiled step."""
    t0 = time.perf_counter()
    params, opt_state, metrics = step(params, opt_state, tokens)
    jax.block_until_ready(metrics)
    return params, opt_state, metrics, time.perf_counter() - t0


def time_steps(step, params, opt_state, tokens, steps: int):
    """Median wall-clock seconds of `steps` calls of a compiled train step, after one
    untimed warm-up call. Returns (median_s, params, opt_state, metrics of the warm-up)."""
    params, opt_state, first, _ = timed_step(step, params, opt_state, tokens)
    times = []
    for _ in range(steps):
        params, opt_state, _, seconds = timed_step(step, params, opt_state, tokens)
        times.append(seconds)
    return statistics.median(times), params, opt_state, first


def round_robin(held: list, rounds: int, steps: int = 1, say=None) -> list[list[float]]:
    """Step seconds of several compiled steps timed in turn: `rounds` passes over
    `held`, each timing `steps` calls of one step before the next. `held` is a list of
    [step, params, opt_state, tokens], each already run once (compiled and warm); their
    params and opt_state are updated in place. Interleaving puts a slow spell on shared
    cores on every step alike. Returns each one's `rounds` x `steps` seconds; `say` gets
    a line after every pass."""
    times = [[] for _ in held]
    for r in range(rounds):
        for i, h in enumerate(held):
            for _ in range(steps):
                h[1], h[2], _, seconds = timed_step(*h)
                times[i].append(seconds)
        if say:
            say(f"  round {r + 1}/{rounds}: " + ", ".join(f"{min(t):.4g}" for t in times)
                + " s fastest so far")
    return times


def paired_ratio(a: list[float], b: list[float]) -> float:
    """How much slower program a runs than program b, with the machine's drift taken
    out: the median over their calls of a's seconds / b's seconds in the same place of
    `round_robin`'s output (the k-th call of each ran in the same pass, so a slow spell
    of the shared cores that lasts a pass falls on both)."""
    return statistics.median(x / y for x, y in zip(a, b))


def split_half_noise(times: list[list[float]]) -> float:
    """How far two measurements of one program disagree in this run: the largest, over
    the programs, of |fastest of the even-numbered calls - fastest of the odd-numbered| /
    the smaller of the two (0 with fewer than 2 calls each). Interleaved calls make the
    halves two measurements taken side by side."""
    def gap(t):
        a, b = min(t[0::2]), min(t[1::2])
        return abs(a - b) / min(a, b)
    return max((gap(t) for t in times if len(t) > 1), default=0.0)


def compiled_step(trainer):
    """(compiled train step, params, opt_state, tokens, compile seconds): the trainer's
    params from its seed and synthetic batch 0, placed on its mesh."""
    from engine.cli.args import host_memory_or_exit
    from engine.run.data import synthetic_tokens

    cfg, tcfg = trainer.cfg, trainer.tcfg
    host_memory_or_exit(cfg)  # the bench scripts' last stop before params are built
    params, opt_state = trainer.init(tcfg.seed)
    tokens = trainer.put_batch(synthetic_tokens(tcfg.seed, 0, tcfg.batch, tcfg.seq, cfg.vocab))
    t0 = time.perf_counter()
    step = trainer.train_step.lower(params, opt_state, tokens).compile()
    return step, params, opt_state, tokens, time.perf_counter() - t0
