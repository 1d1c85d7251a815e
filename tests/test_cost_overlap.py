"""Which collectives the accelerator overlap model (engine/cost/price.py `hideable`) lets
run under the layers' compute, read off a traced fsdp x tp step."""
from engine.cli.args import build_parser, parse_or_exit
from engine.cost import hardware
from engine.cost.ledger import step_ledger
from engine.cost.price import collective_seconds, predict

ARGS = ["--model", "tiny", "--layers", "2", "--d-model", "256", "--heads", "4",
        "--kv-heads", "2", "--head-dim", "64", "--mlp-dim", "512", "--vocab", "4096",
        "--seq", "1024", "--batch", "16", "--layout", "fsdp2xtp2", "--tp-comm", "sequence",
        "--activations", "bf16"]


def test_the_unembedding_grad_reduces_under_the_layers_backward_the_embedding_grad_does_not():
    """The unembedding's grad (scope loss, backward, reduce-scattered over fsdp) is made
    before any layer's backward and read only by the update: it hides under the layers'
    compute (its exposed part is the H100's slowdown share of its time). The loss's
    sequence-parallel reduce-scatter over tp feeds the layers' backward and the
    embedding's grad is made last: both stay exposed, whole."""
    cfg, tcfg, parallel, layout, _ = parse_or_exit(ARGS, build_parser())
    hw = hardware.get("h100")
    mesh = layout.mesh_axes()
    pred = predict(step_ledger(cfg, tcfg, layout, parallel), hw, mesh)
    rs = {(p.row.scope, p.row.axes): p for p in pred.rows
          if p.row.primitive == "reduce_scatter" and p.row.phase == "bwd"
          and p.row.scope in ("loss", "embed")}
    unembed, sequence, embed = rs["loss", ("fsdp",)], rs["loss", ("tp",)], rs["embed", ("fsdp",)]
    share = hw.overlap_slowdown / (1 + hw.overlap_slowdown)
    assert unembed.seconds == collective_seconds(unembed.row, hw, mesh) * unembed.row.count
    assert abs(unembed.exposed - share * unembed.seconds) <= 1e-12
    assert sequence.exposed == sequence.seconds > 0 and embed.exposed == embed.seconds > 0
