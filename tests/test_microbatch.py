"""`--microbatches M`: the step accumulates the grads of M microbatches and equals M=1
in loss, grads and grad norm (f32, tolerances as in test_step.py); a batch the
microbatches do not divide is refused in one line."""
import pytest
from test_step import CFG, RTOL, TCFG, assert_tree_close, tokens, trainer
from test_tp_comm import compiled_loss_and_grads, random_params

from engine.config import ConfigError, ParallelConfig, TrainConfig
from engine.parallel import validate
from engine.parallel.layout import Layout
from engine.run.data import synthetic_tokens
from engine.run.step import Trainer


@pytest.fixture(scope="module")
def init():
    return random_params(CFG, TCFG.seed)


def loss_and_grads(layout, init, microbatches, **parallel):
    t = trainer(layout, CFG, ParallelConfig(microbatches=microbatches, **parallel))
    return compiled_loss_and_grads(t, init, t.put_batch(tokens()))


@pytest.mark.parametrize("layout, microbatches, parallel", [
    ("single", 4, {}),
    ("fsdp4xtp2", 2, {}),
    pytest.param("fsdp4xtp2", 2, {"zero": 1}, marks=pytest.mark.slow),
    pytest.param("dp2xfsdp2xtp2", 2, {"zero": 2}, marks=pytest.mark.slow),
])
def test_microbatches_match_one_microbatch(layout, microbatches, parallel, init):
    loss, grads, gnorm, _ = loss_and_grads(layout, init, microbatches, **parallel)
    want_loss, want_grads, want_gnorm, _ = loss_and_grads("single", init, 1)
    assert abs(loss - want_loss) <= RTOL * abs(want_loss), (loss, want_loss)
    assert abs(gnorm - want_gnorm) <= RTOL * want_gnorm
    assert_tree_close(grads, want_grads, what=f"{layout} M={microbatches} grads ")


@pytest.mark.slow
def test_fsdp8_with_microbatches_of_a_larger_batch(init):
    """fsdp8 with 2 rows per device, split in 2, against single unsplit."""
    tcfg = TrainConfig(batch=16, seq=TCFG.seq)
    got, want = [], []
    for layout, m, out in (("fsdp8", 2, got), ("single", 1, want)):
        lay = Layout.parse(layout)
        t = Trainer(CFG, tcfg, lay, lay.mesh(), ParallelConfig(microbatches=m))
        batch = t.put_batch(synthetic_tokens(tcfg.seed, 0, tcfg.batch, tcfg.seq, CFG.vocab))
        out.extend(compiled_loss_and_grads(t, init, batch))
    assert abs(got[0] - want[0]) <= RTOL * abs(want[0])
    assert_tree_close(got[1], want[1], what="fsdp8 M=2 grads ")


@pytest.mark.parametrize("layout, microbatches, message", [
    ("fsdp4xtp2", 4, "--microbatches 4 does not divide the per-device batch 8/4=2"),
    ("single", 3, "--microbatches 3 does not divide the per-device batch 8/1=8"),
    ("single", 0, "microbatches=0 must be >= 1"),
])
def test_bad_microbatches_refused_in_one_line(layout, microbatches, message):
    with pytest.raises(ConfigError) as e:
        validate.check(CFG, TCFG, ParallelConfig(microbatches=microbatches),
                       Layout.parse(layout))
    assert message in str(e.value) and "\n" not in str(e.value)
