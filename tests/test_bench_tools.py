"""CPU tests of the benchmark scripts and tools that the GPU sessions run: compare_kernels, the GPU scripts'
options, ptxas_info, run_with's switches, sass_stats_cute's tile loop and rare paths."""
import os
import re
import subprocess
import sys

import pytest

import foscar


# ---- the benchmark scripts and the SASS / ptxas tools ------------------------------------------
def test_compare_kernels_table():
    """benchmarks/compare_kernels.py: each kernel's time beside the base kernel's, the ratio base / kernel,
    ``-`` where a kernel did not run, and the ratios per bit width for the range and geomean."""
    sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "benchmarks"))
    import compare_kernels
    rec = lambda kernel, us, status="ok": {"B": 8, "L": 8192, "Hq": 32, "Hkv": 8, "bits": 4, "k_axis": "token",  # noqa: E731
                                           "v_axis": "token", "kernel": kernel, "median_us": us, "ceiling_frac": 0.5,
                                           "status": status}
    lines, ratios = compare_kernels.table([rec("foscar_folded", 30.0), rec("foscar_cute_ws", 20.0),
                                           rec("foscar_cute", 1.0, "FAIL: x")],
                                          ["foscar_folded", "foscar_cute", "foscar_cute_ws"])
    assert lines[2] == "| 4 | tok/tok | INT4 | 8 | 8K | 30.0 (50%) | - | 20.0 (50%), 1.50x |"
    assert dict(ratios) == {("foscar_cute_ws", 4): [1.5]}


def test_compare_kernels_labels_two_runs_of_one_kernel(tmp_path):
    """``compare_kernels.py --labels``: two record files of one kernel (two checkouts) side by side, each file's
    kernel named ``KERNEL@LABEL``; a label count other than the files' is refused, naming the option."""
    import json
    path = os.path.join(os.path.dirname(__file__), "..", "benchmarks", "compare_kernels.py")
    files = []
    for name, us in (("base", 30.0), ("new", 24.0)):
        rec = {"B": 8, "L": 131072, "Hq": 32, "Hkv": 8, "bits": 2, "k_axis": "channel", "v_axis": "token",
               "kernel": "foscar_auto", "median_us": us, "ceiling_frac": 0.5, "status": "ok"}
        f = tmp_path / f"{name}.json"
        f.write_text(json.dumps({"records": [rec]}))
        files.append(str(f))
    run = [sys.executable, path, *files, "--kernels", "foscar_auto@base", "foscar_auto@new"]
    res = subprocess.run(run + ["--labels", "base", "new"], capture_output=True, text=True, timeout=60)
    assert res.returncode == 0, res.stderr
    assert "| 4 | cha/tok | INT2 | 8 | 128K | 30.0 (50%) | 24.0 (50%), 1.25x |" in res.stdout
    assert "foscar_auto@new INT2: 1.25-1.25x, geomean 1.25x over 1 shapes" in res.stdout
    res = subprocess.run(run + ["--labels", "base"], capture_output=True, text=True, timeout=60)
    assert res.returncode == 2 and "--labels: expected one label per record file (2), got 1" in res.stderr


@pytest.mark.parametrize("script,words", [("first_call.py", ("--shapes", "cold")),
                                          ("cluster_smoke.py", ("--timeout", "TIMEOUT")),
                                          ("cluster_placement.py", ("--splits", "--ctas", "--compile-only"))])
def test_the_gpu_scripts_parse_their_options(script, words):
    """``benchmarks/first_call.py``, ``cluster_smoke.py`` and ``cluster_placement.py`` (run on an sm_90 GPU) at least
    parse and document their options here."""
    import subprocess
    import sys
    from pathlib import Path
    path = Path(__file__).resolve().parents[1] / "benchmarks" / script
    res = subprocess.run([sys.executable, str(path), "--help"], capture_output=True, text=True, timeout=60)
    assert res.returncode == 0 and all(w in res.stdout for w in words)


def test_cluster_placement_counts_sms_rounds_and_a_clusters_spread():
    """``benchmarks/cluster_placement.py``'s summary of the CTAs' records: two KV heads of four CTAs; head 0's on
    SMs 0 and 1 two at once, head 1's on four SMs a spin later (a second round)."""
    sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "benchmarks"))
    try:
        import cluster_placement
    finally:
        sys.path.pop(0)
    import torch
    spin = 1000
    rec = torch.tensor([[[0, 0, 0, spin], [0, 1, 10, spin + 10], [1, 2, 5, spin + 5], [1, 3, 5, spin + 5]],
                        [[2, 0, spin + 50, 2 * spin], [3, 1, spin + 50, 2 * spin], [4, 2, spin + 60, 2 * spin],
                         [5, 3, spin + 60, 2 * spin]]])
    f = cluster_placement.summarize(rec, spin)
    assert f["sms"] == 6 and f["most_an_sm"] == 2 and f["cluster_sms"] == (2, 4) and f["late_ctas"] == 4
    assert f["span_us"] == pytest.approx(2 * spin / 1e3)
    assert cluster_placement.shared_bytes(1) > cluster_placement.SM_SHARED_BYTES // 2
    assert cluster_placement.SM_SHARED_BYTES // 3 < cluster_placement.shared_bytes(2) <= cluster_placement.SM_SHARED_BYTES // 2


def test_ptxas_reports_a_cute_kernels_registers_spills_and_injected_waits():
    """``benchmarks/ptxas_info.py`` (CPU: the kernel's PTX through Triton's bundled ptxas): the shipped INT2 kernel of
    two tiles a pass at two CTAs an SM spills nothing under its launch bound."""
    pytest.importorskip("cutlass", reason="needs nvidia-cutlass-dsl")
    from pathlib import Path
    root = Path(__file__).resolve().parents[1]
    env = dict(os.environ, TRITON_INTERPRET="0", PYTHONPATH=str(root), CUTE_DSL_ARCH="sm_90a")
    res = subprocess.run([sys.executable, str(root / "benchmarks" / "ptxas_info.py"), "--bits", "2", "--k-operand",
                          "e4m3", "--tiles-per-pass", "2"], capture_output=True, text=True, timeout=300, env=env)
    assert res.returncode == 0, res.stderr[-2000:]
    m = re.search(r"registers (\d+) .* spill stores (\d+) B, loads (\d+) B; injected wgmma\.wait_group: (\d+)",
                  res.stdout)
    assert m and int(m.group(1)) <= 80 and m.group(2) == m.group(3) == "0", res.stdout


def test_run_with_takes_every_kernel_switch_and_refuses_others():
    """``benchmarks/run_with.py`` reads its switches from ``foscar.cute.config.SWITCHES``: each is a module
    constant of a kind the words can set, and a word naming anything else is refused."""
    sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "benchmarks"))
    try:
        import run_with
    finally:
        sys.path.pop(0)
    from foscar.cute import config
    assert set(run_with.SWITCHES) == set(config.SWITCHES)
    assert all(kind in (bool, int, tuple, dict) for kind in run_with.SWITCHES.values())
    words = {bool: "1", int: "3", tuple: "2,4", dict: "2:q_first"}
    chosen = run_with.settings([f"{name}={words[kind]}" for name, kind in run_with.SWITCHES.items()])
    assert chosen["QK_PROMOTE_BITS"] == (2, 4) and chosen["PROLOGUE_BY_BITS"] == {2: "q_first"}
    assert chosen["P_COLUMN_MAJOR_COLS"] == (2, 4) and chosen["MASK_BRANCH"] is True and chosen["V_PRODUCT_BIT"] == 3
    for bad in ("STAGES=8", "MASK_BRANCH=2", "QK_PROMOTE_BITS=a", "V_PRODUCT_BIT=x"):
        with pytest.raises(SystemExit, match="run_with: expected NAME=VALUE"):
            run_with.settings([bad])


def test_sass_tile_loop_finds_each_consumers_loop():
    """``benchmarks/sass_stats_cute.py``'s ``tile_loop``: of the backward-branch spans holding MMAs, the innermost whole
    loop, also where three consumers' loops sit under longer spans (rare paths laid out after them branching back)."""
    sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "benchmarks"))
    try:
        from sass_stats_cute import tile_loop
    finally:
        sys.path.pop(0)
    lines, addr = [], 0

    def emit(op):
        nonlocal addr
        lines.append(f"        /*{addr:04x}*/                   {op} ;")
        addr += 16
        return addr - 16
    loops = []
    for _ in range(3):  # three consumers' loops: 2 MMAs and 3 other instructions each
        start = emit("FADD R0, R0, R1")
        emit("HGMMA.64x8x16.F32 R8, R24, gdesc[UR4], R8")
        emit("HGMMA.64x8x16.F32 R8, R28, gdesc[UR4], R8")
        emit("FMUL R2, R2, R3")
        emit(f"@P0 BRA 0x{start:x}")
        loops.append(start)
    for start in loops:  # rare paths after the loops, branching back into them: spans holding several loops
        emit("MOV R4, R5")
        emit(f"BRA 0x{start + 16:x}")
    body = tile_loop("\n".join(lines))
    assert body == ["FADD", "HGMMA.64", "HGMMA.64", "FMUL", "BRA"]


def test_sass_rare_paths_are_told_apart():
    """``sass_stats_cute.rare_paths``: of the tile loop's forward branches, the lazy rescale's (after its vote), the
    masks' (``-inf`` selects only), the correction fold's (the first past the PV product's wait) and an mbarrier
    wait's retry are the blocks a full tile skips; any other branch's block is the common path's."""
    sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "benchmarks"))
    try:
        from sass_stats_cute import rare_paths, tile_loop
    finally:
        sys.path.pop(0)
    ops = []

    def block(*body):  # a forward branch over body
        at = len(ops)
        ops.append(None)
        ops.extend(body)
        ops[at] = f"@!P0 BRA 0x{16 * len(ops):x}"
    ops.append("FADD R0, R0, R1")
    block("SYNCS.PHASECHK.TRANS64 P0, [R5], R4", "NANOSLEEP 0x10")
    ops.append("HGMMA.64x8x16.F32 R8, R24, gdesc[UR4], R8")
    ops.append("WARPGROUP.DEPBAR.LE gsb0, 0x0")
    block("ISETP.GE.AND P2, PT, R9, R10, PT", "FSEL R24, R24, -INF , !P2", "FSEL R25, R25, -INF , !P2")
    block("FMUL R3, R3, R4")  # a branch of the common path
    ops.append("BAR.RED.OR.DEFER_BLOCKING 0x1, 0x80, P0")
    block("SHFL.BFLY PT, R8, R24, 0x4, 0x1f", "FMNMX R1, R1, R8, !PT", "FMUL R2, R2, R1")
    ops.append("HGMMA.64x8x16.F32 R8, R28, gdesc[UR4], R8")
    ops.append("WARPGROUP.DEPBAR.LE gsb0, 0x0")
    block("SHFL.BFLY PT, R8, R24, 0x4, 0x1f", "FFMA R1, R8, R2, R1", "FADD R3, R3, R1", "FADD R4, R4, R1")
    ops.append("@P1 BRA 0x0")
    sass = "\n".join(f"        /*{16 * i:04x}*/                   {op} ;" for i, op in enumerate(ops))
    assert len(tile_loop(sass)) == len(ops)
    assert rare_paths(sass) == {"rescale": 3, "masks": 3, "fold": 4, "waits": 2}


def test_run_with_forgets_the_variants_chosen_under_other_switches():
    """``run_with.apply`` clears every cache the switches decide (``clear_switch_caches``): a sweep that sets a
    switch after the shipped ones were used (``sweep_switches.py``'s variants, one process) gets the kernel variant
    the new switches choose, not the one chosen before (channel-wise K on E4M3 terms, two tiles a pass)."""
    sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "benchmarks"))
    try:
        import run_with
    finally:
        sys.path.pop(0)
    from foscar.cute import config
    from foscar.cute.launch import default_variant
    fmt = foscar.KVFormat(bits=2, head_dim=128, group_size=128, k_axis="channel")
    shipped = {name: getattr(config, name) for name in run_with.SWITCHES}
    try:
        run_with.apply({"CHANNEL_K_E4M3": False}, shipped)
        assert default_variant(fmt, 4, 64)[0] == "bf16"
        run_with.apply({"CHANNEL_K_E4M3": True}, shipped)
        assert default_variant(fmt, 4, 64) == ("e4m3", 2)
    finally:
        run_with.apply({}, shipped)
    assert default_variant(fmt, 4, 64) == (("e4m3", 2) if config.CHANNEL_K_E4M3 else ("bf16", 1))



def test_f16_magnitude_probe_is_scale_invariant_under_ieee_sums():
    """``benchmarks/f16_magnitude_probe.py`` (the tensor core's FP16 PV chain at V^T's magnitudes, run on a GPU):
    under the Triton interpreter's IEEE FP32 sums every ``shl`` gives the same error, at FP32's rounding, and so does
    P' carrying ``2^(4 - shl)``, so a GPU's difference between them is the tensor core's."""
    if os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("the CPU check runs the kernel under TRITON_INTERPRET=1")
    sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "benchmarks"))
    import f16_magnitude_probe as probe
    runs = [probe.measure(bits, 256, shl, seed=1, device="cpu", product_bit=b) for bits in (2, 4)
            for shl, b in ((0, 0), (10 - bits, 0), (0, 4))]
    assert runs[0] == runs[1] == runs[2] and runs[3] == runs[4] == runs[5]
    assert all(r["max"] < 1e-6 and r["norm"] < 1e-6 for r in runs)
