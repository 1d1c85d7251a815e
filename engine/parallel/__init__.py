"""How a layout shards the model: the layout grammar and mesh (`layout`), every rule of a
run (`validate`), the param and activation tables (`params`), the ZeRO levels as
weight-gather and update strategies (`zero`), the grad reductions (`grads`) and the
pipeline schedules (`pipeline`). Imports `layers` and `collectives`, nothing above."""
