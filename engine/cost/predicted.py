"""The cost model's step time beside the measured one in every step's record, for a run
with the cost model on (`--layout auto`, `--profile-steps`): `predicted_step_s`, this
step priced on the hardware profile of the run's devices as `--profile-steps` prices it
(the ledger of the traced step through `engine.cost.pipeline.predict_step`, with the page
faults of the compiled step's temporaries), and `step_time_ratio`, measured over
predicted. The TensorBoard and W&B hooks log both (`train/predicted_step_s`,
`train/step_time_ratio`), and the metrics file holds them."""
from __future__ import annotations


def predict_run_step(cfg, tcfg, layout, parallel, step_fn, hw):
    """The `Prediction` of one step of this run: its ledger (engine/cost/cache.py) priced
    on `hw`, plus the page faults of the temporaries the compiled `step_fn` maps anew
    each step (engine/run/host.py)."""
    from engine.cost import cache, memory
    from engine.cost.pipeline import predict_step
    from engine.run.host import mapped_each_step

    rows, _ = cache.step_ledger(cfg, tcfg, layout, parallel)
    mapped = mapped_each_step(memory.measure(step_fn)["temp"])
    return predict_step(rows, hw, layout, parallel, mapped)[0]


class StepPrediction:
    """A loop hook (after `loop.Rates`): `begin` prices the step once on `hw` (the
    profile of the run's devices) and says so; each record gets predicted_step_s and
    step_time_ratio."""

    def __init__(self, cfg, layout, parallel, hw, say):
        self.cfg, self.layout, self.parallel, self.hw, self.say = cfg, layout, parallel, hw, say
        self.step_s = None

    def begin(self, session):
        pred = predict_run_step(self.cfg, session.tcfg, self.layout, self.parallel,
                                session.step_fn, self.hw)
        self.step_s = pred.step_s
        self.say(f"cost model: predicted step {self.step_s:.4g} s on the {self.hw.name} "
                 f"profile, {self.hw.source}")

    def __call__(self, record, session):
        record.update(predicted_step_s=self.step_s,
                      step_time_ratio=record["step_time_s"] / self.step_s)
