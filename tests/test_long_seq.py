"""Predicted MFU against sequence length follows a published series outside the
published-runs table: llm-foundry's MPT-7b on 8 H100 (scripts/train/benchmarking/
README.md, "H100 80GB BF16"), priced with the attention kernel that run called (the
first FlashAttention's Triton port: `attention_rates.FLASH_ATTENTION_TRITON`, its published
speed per length) and the row conventions of bench/published.py.

Tolerance: each point within 10 MFU points, the bar every row of the published table
meets (bench/published.py; with Hopper matmuls at the sustained clock the series runs 3.1
to 6.3 under: `python bench/long_seq.py`), and the drop from 4k to 32k tokens of the same
sign and within half of its published size either way (the trend this test is for); no
constant is fitted to these rows."""
import dataclasses
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench import published, published_runs  # noqa: E402
from bench.long_seq import MPT_7B_H100  # noqa: E402


@pytest.mark.slow
def test_mpt_7b_mfu_falls_with_sequence_length_as_published():
    base = published_runs._mpt("7b", "h100", 8, 6, False, 10643, 46.44)
    points = []
    for seq, micro, ac, tps, mfu in MPT_7B_H100[1:]:  # 4k to 32k, all checkpointed
        run = dataclasses.replace(base, seq=seq, batch=micro * 8, throughput=tps,
                                  remat="full" if ac else "none", source_mfu=mfu)
        e = published.evaluate(run, engine=False)
        assert abs(e["error"]) <= 0.10, (seq, e["predicted_mfu"], e["published_mfu"])
        points.append((e["predicted_mfu"], e["published_mfu"]))
    (p4, q4), _, (p32, q32) = points
    assert p32 < p4 and q32 < q4
    assert 0.5 <= (p4 - p32) / (q4 - q32) <= 1.5
