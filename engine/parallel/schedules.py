"""Pipeline schedules as static tick tables: which forward and which backward each stage
runs at each tick (engine/parallel/pipeline.py runs them).

A tick gives every stage a forward slot and a backward slot, run in that order, then the
stage shifts (x to the next stage, the input cotangent to the previous one). A unit is
item i = m·V + v: microbatch m through the device's chunk v (the model's chunk v·pp + s;
V = 1 but for the circular schedule). Units wait for their input: a forward for the
previous chunk's forward at an earlier tick, a backward for the next chunk's backward at
an earlier tick, or on the model's last chunk for its own forward (at an earlier tick, or
under a fused schedule at the same tick, whose forward slot runs first).

- gpipe (not fused): one unit per tick, forwards first: every forward, then every
  backward. (M + p − 1)·(F + B), M microbatches stashed per stage.
- 1f1b (fused): a stage runs its next ready forward *and* its next ready backward in
  the same tick, so after p − 1 warm-up ticks of forwards every tick is one forward and
  one backward (the last stage's backward follows its own forward in the tick) and the
  step is (p − 1)·F + M·(F + B) + (p − 1)·B = (M + p − 1)·(F + B), GPipe's time. A
  microbatch's round trip from stage s is 2(p − 1 − s) ticks, so stage s holds at most
  2(p − s) − 1 stashed (the forward slot writes before the backward slot frees): in a
  lock-step tick each hop costs a whole tick, where Megatron's asynchronous stages hop
  in half a tick and stash p (Little's law: one microbatch per tick times the round
  trip). min(M, 2p − 1) against GPipe's M.
- interleaved (fused, circular, --pp-virtual V): the model cut into pp·V chunks, device
  s runs chunks s, s + pp, ...; forwards in groups of pp microbatches chunk by chunk
  (Megatron's interleaved order), backwards the reverse, each tick one forward and one
  backward chunk as 1F1B: (V·M + p − 1)·(F + B)/V when pp divides M; stage 0 then
  holds min(V·M, (V + 1)·p − 1) units at once (Megatron's interleaved warm-up
  2(p − 1) + (V − 1)·p, plus the one a tick's forward writes before its backward frees).
- zb1 (fused, split: Qi et al. 2023's ZB-H1 in lock-step ticks): each backward split
  into B, the input gradient (what the previous stage waits for), and W, the weight
  gradient (engine/parallel/backward_split.py). The forwards and the Bs run as 1F1B's
  (a ready forward and a ready B each tick, the last stage's B after its own forward),
  and a third slot runs a W. A W is off the critical path, so stage s defers its Ws
  while it holds at most s of them: stage s's first s Bs run in the ticks where stage 0
  still only runs forwards, and deferring their Ws keeps those ticks F + B long instead
  of F + B + W; in the steady state every stage runs F, B and W; after its last B stage
  s runs its s deferred Ws in the s ticks until stage 0's last B, where it would idle.
  1F1B's ticks and stash, (M + p − 1)·(F + B + W) − (p − 1)·W; with F = B = W idle
  2(p − 1)/(3M + 2(p − 1)) against 1F1B's (p − 1)/(M + p − 1). The W slots hold what W
  reads of B (the layers' output cotangents; under remat full also the activations B
  recomputed) from B's tick to W's, up to s + 1 on stage s; the stash slot is held to
  W's tick, and W reads the activations the stash keeps from it. One unit per tick (ZB-H1's
  own grain, 3M + p − 1 ticks) idles less in the lock-step model only while F, B and W
  cost the same and a tick costs nothing of its own; on this CPU a tick's shifts and
  dispatch cost about a unit's share and a ZeRO-3 forward carries its layers' fsdp
  gathers (1.3-1.8x a B), and the one-unit table idled above 1F1B
  (bench/results/2026-11-29-pipeline-schedules-cpu.md).

A stage holds a unit's stash from its forward to its backward (a split plan's to its
W) in a slot the table gives (`Plan.stash_slot_PI`, `_colour`): as many slots as the
stage ever holds units at once, where unit i in slot i % K took up to 1.8x as many on
interleaved tables (bench/results/2026-11-29-stash-slots-cpu.md).
"""
from __future__ import annotations

import dataclasses
import functools

import numpy as np

NONE = -1  # no unit in a slot of the tables


@dataclasses.dataclass(frozen=True)
class Schedule:
    """A pipeline schedule as a rule for each stage at each tick (module doc).

    fused:    a tick runs a ready forward and a ready backward (1F1B), else one unit,
              forwards first (GPipe).
    circular: the stage's layers are cut into `virtual` chunks and device s runs chunks
              s, s + pp, ... (the model passes round the ring `virtual` times)."""

    name: str
    fused: bool
    doc: str
    circular: bool = False
    split: bool = False


SCHEDULES: dict[str, Schedule] = {s.name: s for s in (
    Schedule("gpipe", fused=False,
             doc="every forward, then every backward: M microbatches stashed per stage"),
    Schedule("1f1b", fused=True,
             doc="a forward and a backward per tick in the steady state: GPipe's "
                 "(M+p-1)(F+B), at most min(M, 2p-1) microbatches stashed"),
    Schedule("interleaved", fused=True, circular=True,
             doc="--pp-virtual V chunks per device, circular (device s runs chunks s, "
                 "s+pp, ...), fused 1F1B ticks of one chunk each: bubble "
                 "(pp-1)/(V·M+pp-1)"),
    Schedule("zb1", fused=True, split=True,
             doc="ZB-H1 in 1F1B's ticks: each backward split into B (input grad) and W "
                 "(weight grad), stage s deferring up to s Ws into its cool-down: "
                 "bubble 2(pp-1)/(3M+2(pp-1)) with F = B = W"),
)}


@dataclasses.dataclass(frozen=True)
class Plan:
    """A schedule unrolled for pp devices, V chunks each, and M microbatches.

    forward_TP, backward_TP: [T, pp] int32, the item m·V + v whose forward / backward
    the device runs at tick t, NONE for none. recv_x_TP, recv_ct_TP: [T, pp] the slot
    where the activation / cotangent arriving at the end of the tick is kept, NONE for
    none. stash_slot_PI: [pp, M·V] int32, the stash slot device s keeps item i in, from
    its forward to its backward (under a split plan to its W, which reads it too), None
    without a backward; stash_slots: the most items a device holds at once, its slots
    (`_colour`). x_slots, ct_slots, w_slots: buffer sizes such that item i in slot
    i % slots never meets another item still held there. weight_TP: [T, pp] the item
    whose weight gradient W the device runs at tick t under a split schedule (its
    backward_TP then runs B alone), None otherwise; w_slots: the slots of what W reads
    of B."""

    forward_TP: np.ndarray
    backward_TP: np.ndarray
    stash_slots: int
    x_slots: int
    ct_slots: int
    recv_x_TP: np.ndarray
    recv_ct_TP: np.ndarray
    virtual: int = 1
    uniform: bool = False
    weight_TP: np.ndarray | None = None
    w_slots: int = 0
    stash_slot_PI: np.ndarray | None = None

    @property
    def split(self) -> bool:
        return self.weight_TP is not None

    @property
    def ticks(self) -> int:
        return self.forward_TP.shape[0]

    @property
    def units(self) -> int:
        """Units of each kind a device runs: M·V."""
        return int((self.forward_TP[:, 0] != NONE).sum())

    @property
    def any_forward_T(self) -> np.ndarray:
        """[T] bool: some stage runs a forward in tick t (a uniform plan runs it on all)."""
        return (self.forward_TP != NONE).any(axis=1)

    @property
    def any_backward_T(self) -> np.ndarray:
        return (self.backward_TP != NONE).any(axis=1)

    @property
    def any_weight_T(self) -> np.ndarray:
        if not self.split:
            return np.zeros(self.ticks, bool)
        return (self.weight_TP != NONE).any(axis=1)

    @property
    def send_x_T(self) -> np.ndarray:
        """[T] bool: some stage sends its forward's output on in tick t (the tick's
        activation shift runs; on the other ticks it is skipped)."""
        return (self.recv_x_TP != NONE).any(axis=1)

    @property
    def send_ct_T(self) -> np.ndarray:
        """[T] bool: some stage sends its input cotangent back in tick t."""
        return (self.recv_ct_TP != NONE).any(axis=1)

    @property
    def head_slots(self) -> int:
        """Slots the head's residuals take (engine/parallel/pipeline.py `run`): the last
        stage's last-chunk items hold theirs from their forward's tick to their backward's
        (a tick runs its forward slot first), microbatch m in slot m % K: the fewest K
        for which no forward overwrites a slot whose microbatch has not yet run its
        backward (1F1B's last stage runs both of a microbatch in one tick: 1; GPipe's: M)."""
        V = self.virtual

        def ticks(items_T):
            return {int(i) // V: t for t, i in enumerate(items_T)
                    if i != NONE and i % V == V - 1}

        f_tick, b_tick = ticks(self.forward_TP[:, -1]), ticks(self.backward_TP[:, -1])
        M = len(f_tick)
        return next(K for K in range(1, M + 1)
                    if all(f_tick[m + K] > b_tick[m] for m in range(M - K)))

    def work_TP(self, forward_P, backward_P, weight_P=0.0) -> np.ndarray:
        """[T, pp] each stage's busy time in each tick, a forward costing forward_P[s],
        a backward backward_P[s] (under a split plan its B) and a W weight_P[s] on
        stage s."""
        work = ((self.forward_TP != NONE) * np.asarray(forward_P)[None, :]
                + (self.backward_TP != NONE) * np.asarray(backward_P)[None, :])
        if self.split:
            work = work + (self.weight_TP != NONE) * np.asarray(weight_P)[None, :]
        return work

    def lockstep_T(self, forward_P, backward_P, weight_P=0.0) -> np.ndarray:
        """[T] each tick's length when every stage waits for the slowest: the max over
        stages of their work, or under a uniform plan (every stage runs each kind of
        unit the tick holds) the slowest of each kind summed."""
        if self.uniform:
            return (self.any_forward_T * np.max(forward_P)
                    + self.any_backward_T * np.max(backward_P)
                    + self.any_weight_T * np.max(weight_P))
        return self.work_TP(forward_P, backward_P, weight_P).max(axis=1)

    def bubble(self, forward: float = 1.0, backward: float = 1.0,
               weight: float | None = None) -> float:
        """Fraction of the stages' time idle in lock-step ticks, a forward unit costing
        `forward` and a backward `backward` on every stage; under a split plan the
        backward is B + W, `weight` of it W (half by default)."""
        pp = self.forward_TP.shape[1]
        if self.split:
            weight = backward / 2 if weight is None else weight
            backward = backward - weight
        f, b, w = np.full(pp, forward), np.full(pp, backward), np.full(pp, weight or 0.0)
        total = pp * self.lockstep_T(f, b, w).sum()
        return float(1 - self.work_TP(f, b, w).sum() / total) if total else 0.0


def _slots(intervals: list[tuple[int, int, int, int]]) -> int:
    """The fewest slots K such that a device's items (s, i, written at time a, read at
    time b) sharing slot i % K are never held at the same time."""
    for k in range(1, len(intervals) + 1):
        held: dict[tuple, list] = {}
        for s, m, a, b in intervals:
            if any(a < b2 and a2 < b for a2, b2 in held.get((s, m % k), [])):
                break
            held.setdefault((s, m % k), []).append((a, b))
        else:
            return k
    return max(len(intervals), 1)


def _colour(intervals: list[tuple[int, int, int, int]], pp: int,
            n_items: int) -> tuple[int, np.ndarray]:
    """(K, slot_PI [pp, n_items] int32): each device's items (s, i, written at time a,
    last read at time b), in order of their writes, take the lowest slot of device s
    free at a (free again from its item's last read: b <= a). A new slot opens only
    where every open one holds an item at a, so K, the most slots any device opens, is
    the most items it holds at once (interval colouring: greedy in start order is
    optimal)."""
    slot_PI = np.zeros((pp, n_items), np.int32)
    free_from: list[list[int]] = [[] for _ in range(pp)]  # per device: when each slot frees
    for s, i, a, b in sorted(intervals, key=lambda r: r[2]):
        frees = free_from[s]
        k = next((k for k, f in enumerate(frees) if f <= a), len(frees))
        if k == len(frees):
            frees.append(b)  # every open slot holds an item at a: open one more
        else:
            frees[k] = b
        slot_PI[s, i] = k
    return max(map(len, free_from)), slot_PI


def _orders(pp: int, M: int, V: int) -> tuple[list, list]:
    """(forward order, backward order) of one device's units (m, v): microbatches in
    groups of pp, each group through chunk 0, 1, ... forward and back down backward."""
    groups = [range(g, min(g + pp, M)) for g in range(0, M, pp)]
    fwd = [(m, v) for grp in groups for v in range(V) for m in grp]
    bwd = [(m, v) for grp in groups for v in reversed(range(V)) for m in grp]
    return fwd, bwd


# times within tick t: the forward slot, the backward slot, the shifts' arrival, the
# weight-gradient slot
def _f(t): return 5 * t + 1  # noqa: E704
def _b(t): return 5 * t + 2  # noqa: E704
def _arrive(t): return 5 * t + 3  # noqa: E704
def _w(t): return 5 * t + 4  # noqa: E704


@functools.lru_cache(maxsize=4096)
def plan(schedule: Schedule, pp: int, microbatches: int, backward: bool = True,
         virtual: int = 1, uniform: bool = False) -> Plan:
    """Simulate `schedule` tick by tick (module doc). Forward only when not `backward`
    (evaluation: every schedule runs its forwards in its order, one per tick).
    `uniform`: every device runs the same program each tick (engine/parallel/pipeline.py).
    Built once per set of arguments: a Plan is read, never changed."""
    ticks = _ticks(schedule, pp, microbatches, virtual, backward)
    if schedule.split and backward:
        return _split_plan(*ticks, pp, uniform)
    return _finish(*ticks, pp, virtual, backward, uniform)


def _ticks(schedule: Schedule, pp: int, M: int, V: int, backward: bool):
    """(fwd_tick, bwd_tick, fwd_rows, bwd_rows): the tick of each (microbatch, chunk)'s
    forward and backward, and each tick's row of items per stage (module doc)."""
    C = pp * V
    order_f, order_b = _orders(pp, M, V)
    fwd_tick: dict = {}
    bwd_tick: dict = {}
    next_f, next_b = [0] * pp, [0] * pp
    fwd_rows, bwd_rows = [], []
    t = 0
    while any(n < M * V for n in (next_b if backward else next_f)):
        f_row, b_row = [NONE] * pp, [NONE] * pp
        for s in range(pp):
            if next_f[s] < M * V:
                m, v = order_f[next_f[s]]
                c = v * pp + s
                if c == 0 or fwd_tick.get((m, c - 1), t) < t:
                    f_row[s] = m * V + v
            if not backward or next_b[s] >= next_f[s] + (f_row[s] != NONE):
                continue
            if f_row[s] != NONE and not schedule.fused:
                continue  # GPipe: one unit per tick, forwards first
            m, v = order_b[next_b[s]]
            c = v * pp + s
            same_tick = schedule.fused and f_row[s] == m * V + v
            if (fwd_tick.get((m, c), t) < t or same_tick if c == C - 1
                    else bwd_tick.get((m, c + 1), t) < t):
                b_row[s] = m * V + v
        for s in range(pp):
            if f_row[s] != NONE:
                fwd_tick[(f_row[s] // V, f_row[s] % V * pp + s)] = t
                next_f[s] += 1
            if b_row[s] != NONE:
                bwd_tick[(b_row[s] // V, b_row[s] % V * pp + s)] = t
                next_b[s] += 1
        fwd_rows.append(f_row)
        bwd_rows.append(b_row)
        t += 1
    return fwd_tick, bwd_tick, fwd_rows, bwd_rows


def _finish(fwd_tick, bwd_tick, fwd_rows, bwd_rows, pp, V, backward, uniform,
            w_tick=None, w_rows=None) -> Plan:
    """The Plan of the ticks the simulation gave each unit: tables, buffer slots."""
    t, C = len(fwd_rows), pp * V
    item = lambda m, c: m * V + c // pp  # noqa: E731  (the buffers' index of (m, chunk c))
    # a stash slot is read by the backward, under a split plan by its B and then its W
    stash = [(c % pp, item(m, c), _f(fwd_tick[m, c]),
              _b(bwd_tick[m, c]) if w_tick is None else _w(w_tick[m, c]))
             for (m, c) in bwd_tick]
    xs = [(c % pp, item(m, c), _arrive(fwd_tick[m, c - 1]), _f(fwd_tick[m, c]))
          for (m, c) in fwd_tick if c > 0]
    cts = [(c % pp, item(m, c), _arrive(bwd_tick[m, c + 1]), _b(bwd_tick[m, c]))
           for (m, c) in bwd_tick if c < C - 1]
    x_slots = _slots(xs)
    ct_slots = _slots(cts) if backward else 0
    recv_x, recv_ct = np.full((t, pp), NONE, np.int32), np.full((t, pp), NONE, np.int32)
    for (m, c), a in fwd_tick.items():  # sent to the device of chunk c + 1
        if c < C - 1:
            recv_x[a, (c + 1) % pp] = item(m, c + 1) % x_slots
    for (m, c), a in bwd_tick.items():  # sent to the device of chunk c - 1
        if c > 0:
            recv_ct[a, (c - 1) % pp] = item(m, c - 1) % ct_slots
    weight_TP, w_slots = None, 0
    if w_tick is not None:
        weight_TP = np.asarray(w_rows, np.int32)
        w_slots = _slots([(c % pp, item(m, c), _b(bwd_tick[m, c]), _w(w_tick[m, c]))
                          for (m, c) in w_tick])
    stash_slots, stash_slot_PI = _colour(stash, pp, len(fwd_tick) // pp) if backward else (
        0, None)
    return Plan(np.asarray(fwd_rows, np.int32), np.asarray(bwd_rows, np.int32),
                stash_slots, x_slots, ct_slots, recv_x, recv_ct, V, uniform, weight_TP,
                w_slots, stash_slot_PI)


def _split_plan(fwd_tick, bwd_tick, fwd_rows, bwd_rows, pp: int, uniform: bool) -> Plan:
    """zb1's table (module doc) from its fused ticks (`_ticks`, V = 1): each B's W in a
    third slot, stage s running its oldest deferred W where it would hold more than s
    of them, or has no other unit."""
    w_tick, w_rows = {}, []
    pending: list[list] = [[] for _ in range(pp)]  # B done, W not yet
    t = 0
    while t < len(fwd_rows) or any(pending):
        if t == len(fwd_rows):
            fwd_rows.append([NONE] * pp)
            bwd_rows.append([NONE] * pp)
        w_row = [NONE] * pp
        for s in range(pp):
            f, b = fwd_rows[t][s], bwd_rows[t][s]
            if b != NONE:
                pending[s].append(b)
            if pending[s] and (len(pending[s]) > s or f == b == NONE):
                w_row[s] = pending[s].pop(0)
                w_tick[(w_row[s], s)] = t
        w_rows.append(w_row)
        t += 1
    return _finish(fwd_tick, bwd_tick, fwd_rows, bwd_rows, pp, 1, True, uniform,
                   w_tick, w_rows)


def storage_order(n_layers: int, pp: int, virtual: int) -> np.ndarray:
    """The model's layer kept at each row of the stacked blocks as a circular schedule
    stores them: device s (rows [s·N/pp, (s+1)·N/pp) of the pp-sharded stack) holds its
    chunks s, s + pp, ..., each N/(pp·V) consecutive layers. Identity for V = 1."""
    n = n_layers // (pp * virtual)
    return np.asarray([(v * pp + s) * n + j for s in range(pp) for v in range(virtual)
                       for j in range(n)])
