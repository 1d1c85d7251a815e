"""The layout grammar and its up-front validation (pure Python, no devices)."""
import math

import pytest

from engine.config import model_config
from engine.layout import Layout, LayoutError

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
    ("pp2xtp4", ["unknown axis 'pp'"]),
    ("tp2xtp4", ["axis 'tp' repeated"]),
    ("fsdp0", ["fsdp size 0 < 1"]),
    ("fsdp", ["cannot read 'fsdp'"]),
    ("", ["cannot read ''"]),
    ("pp2xfsdp0xfsdp2", ["unknown axis 'pp'", "fsdp size 0 < 1", "axis 'fsdp' repeated"]),
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
    for phrase in ["dp=1 fsdp=3 tp=4", "batch=16 not divisible by dp*fsdp=3",
                   "d_model=256 not divisible by fsdp=3", "heads=6 not divisible by tp=4",
                   "mlp_dim=770 not divisible by tp=4", "vocab=250 not divisible by tp=4"]:
        assert phrase in msg
    assert "\n" not in msg


def test_tp_above_kv_heads_is_allowed_when_it_is_a_multiple():
    Layout.parse("tp8").check(SMALL, batch=16)  # G=4 < tp=8: kv heads replicated
    with pytest.raises(LayoutError, match="kv_heads=4 and tp=6"):
        Layout.parse("tp6").check(model_config("small", n_heads=12, mlp_dim=768, vocab=258), 12)
