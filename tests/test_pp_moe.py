"""Pipelines with experts: every stage adds its layers' share of the router losses
(load balancing, z-loss: means over the model's layers of per-layer terms) to the
microbatch's loss, and the backward feeds their cotangent into the stage's pullback.

The oracle is `single` with the same microbatches: the router losses are taken per
microbatch (over the microbatch's global tokens) and averaged over the microbatches, as
the un-pipelined step's gradient accumulation does (engine/run/step.py); `single` is fed
the rows in the order that makes its microbatches the layout's (`microbatch_rows`). Loss, grads and
grad norm match in f32 to test_step.RTOL (sharded runs reorder sums). Aux coefficients
are raised so that the router terms move the loss and the router's grads far past it."""
import dataclasses
import math

import jax
import numpy as np
import pytest
from test_pp import assert_matches, loss_and_grads, tokens, trainer
from test_step import RTOL, TCFG
from test_tp_comm import compiled_loss_and_grads, random_params

from engine.config import ConfigError, ParallelConfig, model_config
from engine.parallel import validate
from engine.parallel.layout import Layout
from layers import roles

# 4 layers: pp2 with 2 chunks per device; coefficients large enough that dropping the
# router losses moves the loss by ~1e-2 relative (RTOL is 1e-5)
MOE_CFG = model_config("moe-tiny", n_layers=4, n_heads=8, n_kv_heads=2, head_dim=8,
                       dtype="f32", experts=8, top_k=2, aux_loss_coef=0.1, z_loss_coef=0.01)
CAPPED = dataclasses.replace(MOE_CFG, capacity_factor=1.0)


@pytest.fixture(scope="module")
def init():
    return random_params(MOE_CFG, TCFG.seed)


def batch_shards(layout: str) -> int:
    lay = Layout.parse(layout)
    return math.prod(lay.degree(r) for r in roles.roles_sharding("batch"))


def microbatch_rows(batch: int, shards: int, m: int) -> np.ndarray:
    """The global rows in the order of the microbatches a layout with `shards` batch
    shards cuts: each shard's local rows [batch/shards] are cut into m microbatches, so
    microbatch j holds rows j·b .. (j+1)·b - 1 of every shard (b = batch/(shards·m))."""
    local, b = batch // shards, batch // (shards * m)
    return np.asarray([k * local + j * b + r for j in range(m) for k in range(shards)
                       for r in range(b)])


_singles = {}


def single(init, cfg, layout, m):
    """`single` with M microbatches holding the rows the layout's microbatches hold (the
    router losses are taken per microbatch: not linear in its rows, unlike the
    cross-entropy)."""
    key = (cfg.capacity_factor, cfg.remat, batch_shards(layout), m)
    if key not in _singles:
        rows = microbatch_rows(TCFG.batch, batch_shards(layout), m)
        t = trainer("single", cfg=cfg, microbatches=m)
        _singles[key] = compiled_loss_and_grads(t, init, t.put_batch(tokens()[rows]))
    return _singles[key]


CASES = [  # (layout, cfg, parallel); the default suite keeps the first two
    ("pp2xep4", MOE_CFG, dict(pp_schedule="1f1b", microbatches=2)),
    ("pp2xfsdp2xep2", CAPPED, dict(pp_schedule="gpipe", microbatches=2)),
    ("pp2xep4", CAPPED, dict(pp_schedule="interleaved", pp_virtual=2, microbatches=2)),
    ("pp4xep2", dataclasses.replace(MOE_CFG, remat="none"),
     dict(pp_schedule="1f1b", microbatches=4)),
    ("pp2xep4", MOE_CFG, dict(pp_schedule="gpipe", microbatches=2)),
    ("pp4xep2", CAPPED, dict(pp_schedule="1f1b", microbatches=4)),
    ("pp2xfsdp2xep2", MOE_CFG, dict(pp_schedule="interleaved", pp_virtual=2,
                                    microbatches=2)),
    ("pp2xfsdp4", CAPPED, dict(pp_schedule="1f1b", microbatches=2)),
    ("pp2xtp2xep2", MOE_CFG, dict(pp_schedule="1f1b", microbatches=2)),
    ("pp2xep4", dataclasses.replace(CAPPED, remat="dots"),
     dict(pp_schedule="interleaved", pp_virtual=2, microbatches=2)),
    ("pp4xfsdp2", dataclasses.replace(MOE_CFG, remat="none"),
     dict(pp_schedule="gpipe", microbatches=2)),
]


# the first case by default (pp over ep, 1f1b); with fsdp, capacity, other schedules
# and remat policies with -m slow
@pytest.mark.parametrize("layout, cfg, parallel", [
    case if i < 1 else pytest.param(*case, marks=pytest.mark.slow)
    for i, case in enumerate(CASES)])
def test_pp_with_experts_matches_single(layout, cfg, parallel, init):
    """pp alone, pp x ep, pp x fsdp x ep, pp x tp x ep; gpipe, 1f1b and interleaved;
    dropless and with a capacity; remat full, none and dots."""
    want = single(init, cfg, layout, parallel["microbatches"])
    got = loss_and_grads(layout, init, cfg=cfg, **parallel)
    assert_matches(got, want, f"{layout} {parallel} c={cfg.capacity_factor}")
    if "ep" in layout:
        assert "all-to-all" in got[3], got[3]


def test_pp_with_experts_accepted():
    """The refusal of pp with experts is gone (pp alone and with ep)."""
    for layout in ("pp2xep4", "pp2xfsdp4", "pp2xfsdp2xep2"):
        validate.check(MOE_CFG, TCFG, ParallelConfig(microbatches=2), Layout.parse(layout))
    with pytest.raises(ConfigError):  # the layout's other checks still run
        validate.check(MOE_CFG, TCFG, ParallelConfig(microbatches=2, pp_virtual=2),
                       Layout.parse("pp2xep4"))


def test_pp_with_experts_evaluation_loss_is_the_cross_entropy(init):
    """Evaluation (a forward-only plan) reports the cross-entropy without the router
    losses, as the un-pipelined `Trainer.loss` does."""
    got, want = (float(t.loss(place(t, init), t.put_batch(tokens())))
                 for t in (trainer("pp2xep4", cfg=MOE_CFG, microbatches=2),
                           trainer("single", cfg=MOE_CFG)))
    assert abs(got - want) <= RTOL * abs(want), (got, want)


def place(t, init):
    return jax.device_put(init, jax.tree.map(
        lambda s: jax.sharding.NamedSharding(t.mesh, s), t.specs))
