"""The stash's slots of the pipeline's tick tables (engine/parallel/schedules.py
`Plan.stash_slot_PI`): as many as a stage holds at once, none shared by two items held
at the same time, every item read from the slot its forward wrote."""
import pytest

from engine.parallel import pipeline

NONE = pipeline.NONE


def held_at_once(p) -> int:
    """The most items any stage holds at once, counted off the tables alone: walking
    the ticks, a forward's item is held from its tick (the forward slot runs first),
    then dropped at its backward, under a split plan at its W (which reads it too)."""
    pp, release = p.forward_TP.shape[1], (p.weight_TP if p.split else p.backward_TP)
    most = 0
    for s in range(pp):
        held = set()
        for t in range(p.ticks):
            if p.forward_TP[t, s] != NONE:
                held.add(int(p.forward_TP[t, s]))
            most = max(most, len(held))
            held.discard(int(release[t, s]))
    return most


def run_the_stash(p) -> None:
    """Each stage's stash as the units use it, tick by tick: the forward writes its item
    into a slot no held item is in, the backward (B and then W under a split plan) reads
    its item back from it, the last read frees it."""
    pp = p.forward_TP.shape[1]
    for s in range(pp):
        slots = [None] * p.stash_slots
        for t in range(p.ticks):
            i = int(p.forward_TP[t, s])
            if i != NONE:
                k = p.stash_slot_PI[s, i]
                assert 0 <= k < p.stash_slots and slots[k] is None, (s, t, i, k, slots)
                slots[k] = i
            reads = [(p.backward_TP[t, s], not p.split)]
            if p.split:
                reads.append((p.weight_TP[t, s], True))
            for i, last in reads:
                if i != NONE:
                    k = p.stash_slot_PI[s, int(i)]
                    assert slots[k] == i, (s, t, int(i), k, slots)
                    if last:
                        slots[k] = None
        assert slots == [None] * p.stash_slots  # every item read and freed


CASES = [(name, pp, m, 1) for name in ("gpipe", "1f1b", "zb1")
         for pp, m in [(2, 1), (2, 3), (4, 4), (4, 6), (4, 8), (8, 16)]]
CASES += [("interleaved", pp, m, v) for pp, m, v in [
    (2, 2, 2), (2, 3, 2), (2, 8, 4), (4, 4, 2), (4, 6, 2), (4, 8, 2), (4, 16, 2),
    (4, 8, 3), (8, 16, 4), (8, 8, 8), (16, 16, 8), (16, 32, 8)]]


@pytest.mark.parametrize("uniform", [False, True])
@pytest.mark.parametrize("name, pp, m, v", CASES)
def test_stash_slots_are_as_many_as_a_stage_holds_at_once(name, pp, m, v, uniform):
    """K is the most items a stage holds at once (interleaved pp 4, M 8, V 2: 11, where
    item i in slot i % K needs 15; pp 16, M 32, V 8: 143 where it needs 255), no two
    items held at once share a slot, and each is read from the slot it was written to."""
    p = pipeline.plan(pipeline.SCHEDULES[name], pp, m, virtual=v, uniform=uniform)
    assert p.stash_slot_PI.shape == (pp, m * v)
    assert p.stash_slots == held_at_once(p)
    run_the_stash(p)


def test_a_forward_only_plan_has_no_stash():
    p = pipeline.plan(pipeline.SCHEDULES["interleaved"], 4, 8, backward=False, virtual=2)
    assert p.stash_slots == 0 and p.stash_slot_PI is None
