"""The layout grammar and its up-front validation (pure Python, no devices)."""
import math

import pytest

from engine.config import model_config
from engine.parallel.layout import AXIS_ROLES, Layout, LayoutError

SMALL = model_config("small")


@pytest.mark.parametrize("text,axes", [
    ("single", ()), ("dp8", (("dp", 8),)), ("fsdp4xtp2", (("fsdp", 4), ("tp", 2))),
    ("dp2xfsdp2xtp2", (("dp", 2), ("fsdp", 2), ("tp", 2))), ("tp1", (("tp", 1),)),
])
def test_parse(text, axes):
    layout = Layout.parse(text)
    assert layout.axes == axes and str(layout) == text
    assert layout.size == math.prod(s for _, s in axes)


def test_role_axes_drop_size_one_axes():
    a = Layout.parse("dp1xfsdp4xtp2").role_axes()
    assert (a.dp, a.fsdp, a.tp, a.batch, a.batch_size) == (None, "fsdp", "tp", ("fsdp",), 4)


@pytest.mark.parametrize("text,phrases", [
    ("qq2xtp4", ["unknown axis 'qq'"]),
    ("tp2xtp4", ["axis 'tp' repeated"]),
    ("fsdp0", ["fsdp size 0 < 1"]),
    ("fsdp", ["cannot read 'fsdp'"]),
    ("", ["cannot read ''"]),
    ("qq2xfsdp0xfsdp2", ["unknown axis 'qq'", "fsdp size 0 < 1", "axis 'fsdp' repeated"]),
])
def test_parse_errors_name_every_problem(text, phrases):
    with pytest.raises(LayoutError) as e:
        Layout.parse(text)
    msg = str(e.value)
    assert "\n" not in msg
    for phrase in phrases:
        assert phrase in msg


def test_check_names_every_factor():
    cfg = model_config("small", n_heads=6, mlp_dim=770, vocab=250)
    with pytest.raises(LayoutError) as e:
        Layout.parse("fsdp3xtp4").check(cfg, batch=16)
    msg = str(e.value)
    for phrase in ["dp=1 fsdp=3 tp=4", "batch=16 not divisible by dp*fsdp*ep=3",
                   "d_model=256 not divisible by fsdp=3", "heads=6 not divisible by tp=4",
                   "mlp_dim=770 not divisible by tp=4", "vocab=250 not divisible by tp=4"]:
        assert phrase in msg
    assert "\n" not in msg


def test_tp_above_kv_heads_is_allowed_when_it_is_a_multiple():
    Layout.parse("tp8").check(SMALL, batch=16)  # G=4 < tp=8: kv heads replicated
    with pytest.raises(LayoutError, match="kv_heads=4 and tp=6"):
        Layout.parse("tp6").check(model_config("small", n_heads=12, mlp_dim=768, vocab=258), 12)


def test_the_roles_come_from_the_registry():
    from engine.parallel.params import ACTIVATION_TABLE, DERIVED_ROLES, PARAM_TABLE
    from layers import roles

    assert AXIS_ROLES == tuple(roles.ROLES)
    for role in roles.ROLES.values():
        assert set(role.shards) <= set(roles.SHARDABLE), role
        assert set(role.divides) <= set(roles.DIM_FIELDS), role
    for name, (letters, spec, _) in PARAM_TABLE.items():
        assert len(letters) == len(spec), name
        assert all(r is None or r in roles.ROLES or r in DERIVED_ROLES for r in spec), name
    for name, (letters, spec) in ACTIVATION_TABLE.items():
        assert len(letters) == len(spec), name
        assert all(w is None or w in roles.SHARDABLE for w in spec), name
    import dataclasses

    from layers.axes import Axes

    fields = {f.name for f in dataclasses.fields(Axes)}
    assert all({r, f"{r}_size"} <= fields for r in roles.ROLES)  # a role is two Axes fields
    a = Layout.parse("dp2xfsdp2xtp2").role_axes()
    assert (a.batch, a.batch_size) == (("dp", "fsdp"), 4)
    assert roles.data_roles() == ("dp", "fsdp", "cp", "ep")  # cp, ep: data axes for all but attention, experts


@pytest.mark.parametrize("layout,tp_comm,spec", [
    ("dp2xfsdp2xtp2", "allreduce", (("dp", "fsdp"), None, None)),
    ("dp2xfsdp2xtp2", "sequence", (("dp", "fsdp"), "tp", None)),
    ("fsdp4xtp2", "ring", (("fsdp",), "tp", None)),
    ("tp1", "ring", (None, None, None)),
    ("single", "allreduce", (None, None, None)),
])
def test_residual_stream_spec(layout, tp_comm, spec):
    from jax.sharding import PartitionSpec as P

    from engine.parallel.params import activation_spec

    assert activation_spec("residual", Layout.parse(layout), tp_comm) == P(*spec)


def test_allowed_values_come_from_their_registries():
    from collectives.ring import TP_COMMS
    from engine.parallel import validate, zero
    from layers import block
    from layers.kernels import KERNELS

    assert validate.ATTENTIONS == ("auto", *KERNELS)
    assert block.REMAT_MODES == ("none", *block.REMAT_POLICIES)
    assert set(block.REMAT) < set(block.REMAT_MODES)
    assert zero.ZERO == tuple(zero.ZERO_LEVELS) == (1, 2, 3)
    assert tuple(TP_COMMS) == ("allreduce", "sequence", "ring")


@pytest.mark.parametrize("parallel,seq,phrases", [
    (dict(tp_comm="sequence"), 15,
     ["--tp-comm sequence shards the sequence over tp: seq=15 not divisible by tp=2"]),
    (dict(tp_comm="ring"), 15, ["--tp-comm ring shards the sequence over tp: seq=15"]),
    (dict(zero=4, tp_comm="bus"), 16,
     ["zero=4 not one of [1, 2, 3]", "tp_comm='bus' not one of ['allreduce', 'sequence', 'ring']"]),
    (dict(zero=2, prefetch=True), 16, ["--prefetch needs --zero 3"]),
    (dict(grad_reduce="bf16"), 16, ["grad_reduce='bf16' not one of ['compute', 'f32']"]),
])
def test_trainer_refuses_bad_settings_at_construction(parallel, seq, phrases):
    """Refused in one line before anything is traced (no devices used: an abstract
    mesh); `tp_comm sequence` with seq 15 on tp2 used to fail inside the first step."""
    from engine.config import ConfigError, ParallelConfig, TrainConfig
    from engine.run.step import Trainer

    layout = Layout.parse("fsdp4xtp2")
    with pytest.raises(ConfigError) as e:
        Trainer(SMALL, TrainConfig(batch=16, seq=seq), layout, layout.abstract_mesh(),
                ParallelConfig(**parallel))
    assert "\n" not in str(e.value)
    for phrase in phrases:
        assert phrase in str(e.value)


def test_validate_returns_every_problem():
    from engine.config import ParallelConfig, TrainConfig
    from engine.parallel import validate

    cfg = model_config("small", n_heads=6, n_kv_heads=2, mlp_dim=770, vocab=250)
    found = validate.problems(cfg, TrainConfig(batch=16, seq=15),
                              ParallelConfig(tp_comm="sequence"), Layout.parse("fsdp3xtp4"))
    assert len(found) == 2
    assert "batch=16 not divisible by dp*fsdp*ep=3" in found[0] and "vocab=250" in found[0]
    assert "seq=15 not divisible by tp=4" in found[1]
    assert validate.problems(SMALL, TrainConfig(), ParallelConfig(), Layout.parse("fsdp4xtp2")) == []
