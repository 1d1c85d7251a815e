"""Synthetic data: a learnable next-token task whose batch is a pure function of (seed, step)."""
import numpy as np


def synthetic_tokens(seed: int, step: int, batch: int, seq: int, vocab: int) -> np.ndarray:
    """[batch, seq + 1] int32 arithmetic progressions mod vocab.

    Each sequence starts at a random token and steps by a random stride in 1..4, so the
    next token is one of 4 successors of the current one (a bigram model reaches ln 4 ~
    1.39 nats) and is exactly determined by the last two (attention can reach ~0)."""
    rng = np.random.default_rng([seed, step])
    start_B1 = rng.integers(0, vocab, (batch, 1))
    stride_B1 = rng.integers(1, 5, (batch, 1))
    return ((start_B1 + stride_B1 * np.arange(seq + 1)) % vocab).astype(np.int32)
