"""The named scopes (`jax.named_scope`) the step opens, which the cost model reads back,
and the names of the values the remat policies save (`SAVED_BY_DOTS`, `SAVED_BY_ALTERNATE`).

The ledger (from the jaxpr's name stacks), the trace attribution (from HLO `op_name`
metadata) and the pricing group rows by these names; layers/ and engine/run/step.py open
them. A row's scope is the first of SCOPES on its name stack, else "other".
"""
from __future__ import annotations

EMBED = "embed"  # the token embedding and its fsdp gather
GATHER_PARAMS = "gather_params"  # a layer's fsdp weight gathers (bwd: grad reduce-scatters)
ATTENTION = "attention"  # the attention half of a block
MLP = "mlp"  # the MLP half of a block
LOSS = "loss"  # final norm, unembedding and cross-entropy
REDUCE_GRADS = "reduce_grads"  # grad reductions after the backward
OPTIMIZER = "optimizer"  # the optimizer update
LOGITS = "logits"  # decoding: final norm and the last token's logits

# The pipeline's tick (engine/parallel/pipeline.py): its body, the unit each branch of its switch
# runs, and the parts only the first / last stage runs (conds on the stage index).
# Not in SCOPES (a row keeps its layer scope); the ledger records them in `Row.pp`.
PP_TICK = "pp_tick"
PP_FORWARD = "pp_forward"
PP_BACKWARD = "pp_backward"
PP_WEIGHT = "pp_weight"  # a split schedule's weight-gradient unit (zb1)
PP_FIRST = "pp_first_stage"
PP_LAST = "pp_last_stage"
PP_SCOPES = (PP_TICK, PP_FORWARD, PP_BACKWARD, PP_WEIGHT, PP_FIRST, PP_LAST)

# The values remat `dots` saves for the backward (`jax.ad_checkpoint.checkpoint_name`,
# named where they are made; layers/block.py `REMAT_POLICIES`): the column-parallel
# projections' outputs, the router's logits, and the attention's output after its tp
# collective, from which the backward rebuilds x + attn (the MLP norm's input) without
# running that collective again. The row-parallel matmuls' own outputs (partial sums
# over tp) are not saved.
Q, K, V, GATE, UP = "q", "k", "v", "gate", "up"
ATTN_OUT, ROUTER_LOGITS = "attn_out", "router_logits"
SAVED_BY_DOTS = (Q, K, V, GATE, UP, ATTN_OUT, ROUTER_LOGITS)

# The values remat `alternate` saves (layers/block.py `REMAT_POLICIES`): every second
# projection in forward order (q, v, gate: wk, wo and wu run again in the backward), the
# attention kernel's output o (before wo), and, only where the out projection's partial
# sums cross tp, their reduced sum, so that no tp collective of the forward runs again.
CONTEXT = "context"  # the attention kernel's output o [B, L, H_tp, K]
ATTN_OUT_TP = "attn_out_tp"  # the out projection summed over tp (named only when tp > 1)
SAVED_BY_ALTERNATE = (Q, V, CONTEXT, GATE, ATTN_OUT_TP)

# Outermost first: the order a name stack is searched in.
SCOPES = (EMBED, GATHER_PARAMS, ATTENTION, MLP, LOSS, REDUCE_GRADS, OPTIMIZER)
# Scopes inside the scanned blocks (run once per layer).
BLOCK_SCOPES = (GATHER_PARAMS, ATTENTION, MLP)
# Scopes after the backward: their rows are phase "update".
UPDATE_SCOPES = (REDUCE_GRADS, OPTIMIZER)


def scope_of(names) -> str:
    """The first of `names` (a name stack, outermost first) that is a scope, else "other"."""
    return next((n for n in names if n in SCOPES), "other")
