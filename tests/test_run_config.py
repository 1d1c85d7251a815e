"""`--config run.toml` and the optimizer flags: a file plus overrides resolves as
docs/run_config.md says, bad files are one line and exit 2, and each learning-rate
schedule follows its formula. No compile."""
import math
import tomllib

import optax
import pytest

from engine.cli import config_file
from engine.cli.args import UsageError, parse
from engine.cli.train import main
from engine.config import LR_SCHEDULES, TrainConfig
from engine.run import optim

TOML = """
model = "tiny"
layout = "fsdp2"
resume = true

[training]
steps = 40
lr = 1e-3
lr_schedule = "warmup-stable-decay"
adam-eps = 1e-6
weight-decay = 0.05

[checkpoints]
checkpoint-dir = "ck"
async-save = false
"""


@pytest.fixture
def config(tmp_path):
    path = tmp_path / "run.toml"
    path.write_text(TOML)
    return str(path)


def test_a_file_plus_flags_resolves_with_the_flags_winning(config):
    cfg, tcfg, _, layout, args = parse(["--config", config, "--steps", "50"])
    assert cfg.d_model == 64 and str(layout) == "fsdp2"  # from the file
    assert tcfg.steps == 50 and tcfg.lr == 1e-3  # --steps given: it wins; lr from file...
    _, tcfg, _, _, args = parse(["--lr", "2e-3", f"--config={config}"])
    assert tcfg.lr == 2e-3  # ...and a flag wins wherever it stands
    assert tcfg.schedule == "warmup-stable-decay" and tcfg.eps == 1e-6
    assert tcfg.weight_decay == 0.05 and tcfg.b1 == TrainConfig().b1  # default kept
    assert args.resume is True and args.async_save is False and args.checkpoint_dir == "ck"
    assert args.config == config


def test_the_resolved_settings_are_a_config_file_of_the_same_run(config, tmp_path):
    *_, args = parse(["--config", config, "--seq", "32"])
    settings = config_file.resolved(args)
    assert settings["seq"] == 32 and settings["lr-schedule"] == "warmup-stable-decay"
    again = tmp_path / "again.toml"
    again.write_text(config_file.to_toml(settings))
    assert tomllib.loads(again.read_text()) == settings
    *_, args2 = parse(["--config", str(again)])
    assert config_file.resolved(args2) == settings


@pytest.mark.parametrize("text,words", [
    ("stepz = 3", ["unknown setting 'stepz'"]),
    ("steps = 'many'", ["--steps", "invalid int value"]),
    ("resume = 1", ["resume = 1", "want true or false"]),
    ("steps = 3\n[t]\nsteps = 4", ["t.steps is set twice"]),
    ("steps = [3]", ["want a string or number"]),
    ("lr-schedule = 'cosin'", ["--lr-schedule", "invalid choice"]),
    ("adam-b2 = 1.0", ["adam_b2=1.0 must be in [0, 1)"]),
    ("steps = ", ["not TOML"]),
])
def test_bad_config_files_are_one_line_and_exit_2(text, words, tmp_path, one_line_error):
    path = tmp_path / "bad.toml"
    path.write_text(text)
    one_line_error(main, ["--config", str(path)], *words, table="compiled")


def test_a_missing_config_file_is_one_line(tmp_path, one_line_error):
    one_line_error(main, ["--config", str(tmp_path / "none.toml")], "No such file",
                   table="compiled")
    with pytest.raises(UsageError, match="expected one argument"):
        parse(["--config"])


def lr(name: str, count: int, **kw) -> float:
    tcfg = TrainConfig(lr=1.0, warmup=4, steps=21, min_lr_ratio=0.1, schedule=name, **kw)
    return float(optim.schedule(tcfg)(count))


@pytest.mark.parametrize("name", list(LR_SCHEDULES))
def test_every_schedule_warms_up_the_same_way(name):
    assert [lr(name, c) for c in range(4)] == pytest.approx([0.25, 0.5, 0.75, 1.0])


def test_each_schedule_follows_its_formula():
    """warmup 4 (peak at count 3), last step at count 20: decay spans counts 3..20."""
    for c in (3, 8, 14, 20):
        frac = (c - 3) / 17
        assert lr("linear", c) == pytest.approx(1 - 0.9 * frac)
        assert lr("cosine", c) == pytest.approx(0.1 + 0.45 * (1 + math.cos(math.pi * frac)))
        assert lr("constant", c) == 1.0
    # warmup-stable-decay: 0.25 x 21 steps ~ 5 decay counts, ending at count 20
    wsd = [lr("warmup-stable-decay", c, decay_fraction=0.25) for c in range(21)]
    assert wsd[3:16] == [1.0] * 13
    assert wsd[15:] == pytest.approx([1 - 0.9 * i / 5 for i in range(6)])


def test_cosine_is_the_schedule_it_always_was():
    tcfg = TrainConfig(lr=3e-3, warmup=10, steps=50, min_lr_ratio=0.1)
    old = optax.warmup_cosine_decay_schedule(init_value=3e-4, peak_value=3e-3,
                                             warmup_steps=9, decay_steps=49, end_value=3e-4)
    assert [float(optim.schedule(tcfg)(c)) for c in range(60)] == [float(old(c))
                                                                    for c in range(60)]


def test_adam_settings_reach_the_optimizer():
    """One AdamW update of a scalar: -lr * (m / (sqrt(v) + eps) + wd * p)."""
    import jax.numpy as jnp

    tcfg = TrainConfig(lr=0.5, warmup=1, steps=2, b1=0.5, b2=0.75, eps=0.25, weight_decay=0.2,
                       schedule="constant")
    tx = optim.make_optimizer(tcfg)
    params = {"w": jnp.float32(2.0)}
    updates, _ = tx.update({"w": jnp.float32(3.0)}, tx.init(params), params)
    m, v = 3.0, 9.0  # bias-corrected moments after one step
    assert float(updates["w"]) == pytest.approx(-0.5 * (m / (math.sqrt(v) + 0.25) + 0.2 * 2.0))
