"""bench/tpu_compile.py's parts that need no libtpu: the slice table, XLA:TPU's
out-of-memory message, the live-range report, the one-line refusal without libtpu, and
the cost comparison's two sides (XLA's cost report read off an XLA:CPU compile)."""
import pytest

from bench import tpu_compile as T


def test_every_published_tpu_run_has_a_slice_of_its_chip_count():
    """Every run on one TPU slice (no DCN data-parallel axis), not only those the table
    already knows: a v4 / v5p slice's sides are each at most 4 or a multiple of 4."""
    from bench.published import HELD_OUT, RUNS

    tpu = [r for r in RUNS + HELD_OUT if r.hardware in T.PREFIX and not r.layout.startswith("dp")]
    assert any(r.chips == 192 for r in tpu), "v4-384's 192 chips are a published run"
    for r in tpu:
        assert T.one_slice(r), r.name
        t = T.topology(r.hardware, r.chips)
        dims = [int(x) for x in t["topology_name"].split(":")[1].split("x")]
        n = 1
        for d in dims:
            n *= d
        assert n == r.chips, (r.name, t)
        assert len(dims) == (2 if r.hardware == "v5e" else 3)
        if r.hardware != "v5e":
            assert dims == sorted(dims) and all(d <= 4 or d % 4 == 0 for d in dims), t


def test_slices_wrap_as_the_tpu_pages_say():
    assert T.topology("v4", 64)["wrap"] == (True, True, True)  # 4x4x4: a full torus
    assert T.topology("v4", 32)["wrap"] == (False, False, False)  # 2x4x4
    assert T.topology("v5p", 64)["topology_name"] == "v5:4x4x4"
    assert T.topology("v4", 192)["topology_name"] == "v4:4x4x12"  # v4-384
    assert T.topology("v5e", 256)["wrap"] == (True, True, False)
    assert T.topology("v5e", 256)["chip_config_name"] == "default"
    assert T.topology("v4", 8)["chip_config_name"] == "megacore"
    with pytest.raises(ValueError, match="no v4 slice of 6 chips"):
        T.topology("v4", 6)
    with pytest.raises(ValueError, match="no TPU topology"):
        T.topology("h100", 8)


def test_out_of_hbm_reads_both_figures_of_xla_tpus_refusal():
    msg = ("RESOURCE_EXHAUSTED: Ran out of memory on HBM, the total memory required for "
           "HLO temporaries (16.66G) exceeds available HBM (15.75G).")
    need, have = T.out_of_hbm(msg)
    assert need == pytest.approx(16.66 * 2**30) and have == pytest.approx(15.75 * 2**30)
    assert T.out_of_hbm("INTERNAL: something else") is None


def test_live_at_peak_reads_the_peak_section_largest_first(tmp_path):
    (tmp_path / "module_0000.jit__train_step.cl_1.after_optimizations-live-range.txt").write_text(
        "HloLiveRange (max 9):\n  BufferLiveRange:\n    a{}:0-3\n"
        "  Live ranges at 5 (peak):\n"
        "    small{}: 10 bytes (cumulative: 10 bytes)\n"
        "    big{1}: 300 bytes (cumulative: 310 bytes)\n"
        "    mid{}: 20 bytes (cumulative: 330 bytes)\n")
    assert T.live_at_peak(tmp_path, 2) == [("big{1}", 300), ("mid{}", 20)]
    assert T.live_at_peak(tmp_path / "missing", 2) == []


def test_live_peak_bytes_is_the_peak_sections_running_total(tmp_path):
    """The last cumulative figure of the peak section (what is live at once), not the
    largest buffer, not a later section's figures."""
    assert T.live_peak_bytes(tmp_path) is None
    (tmp_path / "module_0000.jit__train_step.cl_1.after_optimizations-live-range.txt").write_text(
        "HloLiveRange (max 9):\n  BufferLiveRange:\n    a{}:0-3 (cumulative: 7 bytes)\n"
        "  Live ranges at 5 (peak):\n"
        "    big{1}: 300 bytes (cumulative: 300 bytes)\n"
        "    mid{}: 20 bytes (cumulative: 320 bytes)\n"
        "    small{}: 10 bytes (cumulative: 330 bytes)\n"
        "  Stack trace breakdown for peak usage: 330 bytes\n"
        "    main (100.0%, total: 330 bytes) (cumulative: 999 bytes)\n")
    assert T.live_peak_bytes(tmp_path) == 330


def test_without_libtpu_the_tool_says_so_in_one_line(capsys, monkeypatch):
    monkeypatch.setattr(T, "libtpu_installed", lambda: False)
    monkeypatch.setenv("JAX_PLATFORMS", "cpu")  # main sets it only where unset
    assert T.main(["--only", "22B"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: libtpu is not installed") and "\n" not in err
    assert T.main(["--only", "no such run"]) == 2


def test_next_dump_keeps_each_steps_dump_only_when_asked(tmp_path):
    dump = tmp_path / "dump"
    dump.mkdir()
    (dump / "a.txt").write_text("step 0")
    T.next_dump(dump, None, 0)
    assert dump.is_dir() and not any(dump.iterdir())
    (dump / "a.txt").write_text("step 1")
    T.next_dump(dump, str(tmp_path / "kept"), 1)
    assert (tmp_path / "kept" / "step1" / "a.txt").read_text() == "step 1"
    assert dump.is_dir() and not any(dump.iterdir())
    (dump / "b.txt").write_text("again")
    T.next_dump(dump, str(tmp_path / "kept"), 1)  # a rerun replaces the old step's files
    assert sorted(p.name for p in (tmp_path / "kept" / "step1").iterdir()) == ["b.txt"]
    assert T.build_parser().parse_args(["--dump", "d"]).dump == "d"


def test_assigned_bytes_reads_the_buffer_assignment_total(tmp_path):
    assert T.assigned_bytes(tmp_path) is None
    (tmp_path / "module_0000.jit__train_step.cl_1.after_optimizations-buffer-assignment.txt"
     ).write_text("BufferAssignment:\nallocation 0: size 512\n")
    assert T.assigned_bytes(tmp_path) is None
    (tmp_path / "module_0000.jit__train_step.cl_1.after_optimizations-buffer-assignment"
                "-values.txt").write_text("\nTotal bytes used: 4096 (4KiB)\n\nUsed values:\n")
    assert T.assigned_bytes(tmp_path) == 4096


def test_a_configuration_without_a_slice_or_with_only_is_refused_in_one_line(capsys):
    assert T.main(["--hardware", "v4", "--layout", "dp6", "--model", "tiny",
                   "--batch", "12"]) == 2
    assert capsys.readouterr().err.strip() == (
        "error: no v4 slice of 6 chips here (known: 4, 8, 16, 32, 64, 128, 192, 256, 512, 1024, "
        "2048)")
    assert T.main(["--hardware", "v5e", "--only", "22B"]) == 2
    assert "give one" in capsys.readouterr().err
    # the parallel flags a configuration needs are there
    args = T.build_parser().parse_args(["--hardware", "v5e", "--layout", "fsdp4", "--prefetch",
                                        "--zero", "3", "--tp-comm", "ring"])
    assert args.prefetch and args.zero == 3 and args.tp_comm == "ring"


def test_xla_cost_reads_the_flops_and_counts_the_loops():
    import jax
    import jax.numpy as jnp

    x = jnp.ones((64, 32), jnp.float32)
    w = jnp.ones((32, 16), jnp.float32)
    dot = T.xla_cost(jax.jit(lambda x, w: x @ w).lower(x, w).compile())
    assert dot["flops"] == 2 * 64 * 32 * 16 and dot["loops"] == 0 and dot["bytes"] > 0
    looped = jax.jit(lambda x, w: jax.lax.fori_loop(0, 3, lambda i, y: y @ w[:16, :16] * 0.5,
                                                     x @ w))
    assert T.xla_cost(looped.lower(x, w).compile())["loops"] == 1


def test_ledger_cost_counts_the_attention_the_compile_runs():
    from engine.config import ParallelConfig, TrainConfig, model_config
    from engine.cost import calibration
    from engine.cost.ledger import step_ledger
    from engine.cost.price import priced_rows
    from engine.parallel.layout import Layout

    cfg = model_config("tiny", dtype="bf16", remat="full", attention="blocked")
    tcfg, layout, parallel = TrainConfig(seq=256, batch=8), Layout.parse("fsdp4"), ParallelConfig()
    cost = T.ledger_cost(cfg, tcfg, parallel, layout, "v5e")
    rows = step_ledger(cfg, tcfg, layout, parallel, False)
    # the jnp key-block scan's rows, as the CPU profile prices what runs; no kernel rows,
    # and none of the copies XLA:CPU adds to lay out dot operands (XLA:TPU's layout
    # assignment picks the dots' operand layouts itself) or the casts it adds around bf16
    # collectives (XLA:TPU runs them in bf16)
    on_cpu = [r for r in priced_rows(rows, calibration.cpu_defaults()) if r.kind != "collective"]
    assert any(r.kernel == "blocked" for r in on_cpu) and any(r.relayout for r in on_cpu)
    assert any(r.widen for r in on_cpu)
    on_cpu = [r for r in on_cpu if not (r.relayout or r.widen)]
    assert cost["flops"] == sum(r.flops * r.count for r in on_cpu)
    assert cost["bytes"] == sum(r.bytes * r.count for r in on_cpu)
    assert 0 < cost["fused_bytes"] < cost["bytes"]
