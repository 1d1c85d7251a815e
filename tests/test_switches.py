"""Every combination of the overlap and memory switches equals `single`:
--tp-comm x --zero x --prefetch.

test_tp_comm.py covers each tp_comm alone (zero 3) and test_zero.py each ZeRO level alone
(tp_comm allreduce); here they are crossed on the layouts that have both fsdp and tp
(tp8 has no fsdp axis, so only tp_comm applies to it: test_tp_comm.py). Three crossings
run in the default suite, the rest are marked slow. Loss, every grad and the grad norm
must agree to test_step.py's RTOL (1e-5 relative to each tensor's largest magnitude).
"""
import pytest

from engine.config import ParallelConfig
from test_step import RTOL, assert_tree_close
from test_tp_comm import init, loss_and_grads, single  # noqa: F401 (fixtures)

LEVELS = [(1, False), (2, False), (3, True)]  # (zero, prefetch); zero 3 alone: test_tp_comm
FAST = {("ring", 2, False, "fsdp2xtp4"), ("sequence", 3, True, "fsdp4xtp2"),
        ("allreduce", 1, False, "fsdp2xtp4")}
CASES = [(tp_comm, zero, prefetch, layout)
         for layout in ("fsdp4xtp2", "fsdp2xtp4")
         for tp_comm in ("allreduce", "sequence", "ring")
         for zero, prefetch in LEVELS
         # allreduce x each level on fsdp4xtp2 is test_zero.py's
         if not (tp_comm == "allreduce" and layout == "fsdp4xtp2")]


@pytest.mark.parametrize("tp_comm,zero,prefetch,layout", [
    pytest.param(*case, marks=() if case in FAST else pytest.mark.slow,
                 id="-".join(map(str, case))) for case in CASES])
def test_switches_match_single(tp_comm, zero, prefetch, layout, init, single):
    parallel = ParallelConfig(tp_comm=tp_comm, zero=zero, prefetch=prefetch)
    loss, grads, gnorm, ops = loss_and_grads(layout, init, parallel)
    want_loss, want_grads, want_gnorm, _ = single
    assert abs(loss - want_loss) <= RTOL * abs(want_loss)
    assert abs(gnorm - want_gnorm) <= RTOL * want_gnorm
    assert_tree_close(grads, want_grads, what=f"{tp_comm} zero {zero} {layout} grads ")
    assert ("collective-permute" in ops) == (tp_comm == "ring"), ops
