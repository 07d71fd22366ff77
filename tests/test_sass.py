"""The compiled folded kernel (sm_90, Triton's bundled ptxas; no GPU needed): the register cap the
launcher applies never makes ptxas spill. Compiled by ``benchmarks/sass_stats.py`` in a subprocess,
out of the interpreter that conftest turns on for CPU-only machines."""
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from foscar.format import KVFormat
from foscar.triton.launch import max_registers

ROOT = Path(__file__).resolve().parents[1]
CASES = [(4, "token", "token", 128, 128, 1, 4), (2, "token", "token", 128, 128, 1, 4),
         (4, "token", "channel", 128, 128, 1, 4), (2, "channel", "channel", 128, 128, 1, 4),
         (4, "token", "token", 64, 64, 1, 4), (2, "token", "token", 128, 128, 2, 4), (2, "token", "token", 128, 128, 1, 8)]


def compiled_resources(bits, k_axis, v_axis, group, head_dim, cap, prefetch=1, gqa=4):
    env = dict(os.environ, TRITON_INTERPRET="0", PYTHONPATH=str(ROOT))
    cmd = [sys.executable, str(ROOT / "benchmarks" / "sass_stats.py"), "--bits", str(bits), "--k-axis", k_axis,
           "--v-axis", v_axis, "--group-size", str(group), "--head-dim", str(head_dim), "--max-registers", str(cap),
           "--prefetch", str(prefetch), "--gqa", str(gqa)]
    out = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300, check=False)
    assert out.returncode == 0, out.stderr[-2000:]
    regs, stack = re.search(r"(\d+) registers, (\d+) stack bytes", out.stdout).groups()
    return int(regs), int(stack)


@pytest.mark.parametrize("bits,k_axis,v_axis,group,head_dim,prefetch,gqa", [  # three with FOSCAR_SLOW=1 only
    pytest.param(*c, marks=[pytest.mark.slow] if i in (2, 4, 5) else []) for i, c in enumerate(CASES)])
def test_register_cap_does_not_spill(bits, k_axis, v_axis, group, head_dim, prefetch, gqa):
    fmt = KVFormat(bits=bits, head_dim=head_dim, group_size=group, k_axis=k_axis, v_axis=v_axis)
    cap = max_registers(fmt, prefetch, gqa)
    assert cap == 128
    regs, stack = compiled_resources(bits, k_axis, v_axis, group, head_dim, cap, prefetch, gqa)
    assert regs <= cap and stack == 0, (regs, stack)


@pytest.mark.parametrize("k_axis,v_axis,group,head_dim", [("channel", "token", 128, 128), ("token", "token", 64, 128),
                                                          ("token", "token", 128, 256)])
def test_no_cap_where_it_would_spill(k_axis, v_axis, group, head_dim):
    """Measured: 40, 24 and 240 stack bytes under a 128-register cap; INT4 with two tiles in flight, 96."""
    fmt = KVFormat(bits=4, head_dim=head_dim, group_size=group, k_axis=k_axis, v_axis=v_axis)
    assert max_registers(fmt) is None
    assert max_registers(KVFormat(bits=4, head_dim=128, group_size=128), prefetch=2) is None
    for bits, gqa in ((4, 8), (4, 16), (2, 16), (4, 32), (2, 32)):  # measured: 16-592 stack bytes under the cap
        assert max_registers(KVFormat(bits=bits, head_dim=128, group_size=128), gqa=gqa) is None
