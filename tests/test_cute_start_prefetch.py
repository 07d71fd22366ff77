"""Prefetches as a v1 CTA starts (``foscar.cute.config.START_PREFETCH``, ``Sm90Config.start_prefetch``): the
sequence's length, the TMA descriptors and the page-table line of the split's first page (guessed from the table's
capacity), so that neither the ring's initialisation and Q's staging nor a short split's first copies wait for
them. CPU: a ``prefetch.tensormap`` for each of the four descriptors and the two lines' prefetches before the ring's
barriers are initialised, the length read past the prologue's barrier, and the kernel's MMAs, copies, barriers and
global accesses as they were. GPU (sm_90): decodes with it against the float64 oracle."""
import os
import re
from collections import Counter

import pytest

os.environ.setdefault("CUTE_DSL_ARCH", "sm_90a")  # compile for Hopper without a GPU
pytest.importorskip("cutlass", reason="needs nvidia-cutlass-dsl (pip install -e '.[test]')")

import foscar  # noqa: E402
from _cases import HOPPER  # noqa: E402
from _helpers import cute_switches  # noqa: E402
from foscar.cute.compile import compile_stage1  # noqa: E402
from foscar.cute.config import config_for  # noqa: E402


def _ptx(monkeypatch, on: bool, bits: int) -> str:
    fmt = foscar.KVFormat(bits=bits, head_dim=128, group_size=128)
    with cute_switches(monkeypatch, START_PREFETCH=on):
        cfg = config_for(fmt, 4, 64, "e4m3", 2)
        assert cfg.start_prefetch is on
        return compile_stage1(cfg, keep_ptx=True, warp_specialized=True, ctas_per_sm=2).__ptx__


@pytest.mark.parametrize("bits", (2, 4))  # Q staged by the first consumer (INT2) and by the producer (INT4)
def test_the_descriptors_and_the_first_page_line_are_prefetched_first(monkeypatch, bits):
    on, off = _ptx(monkeypatch, True, bits), _ptx(monkeypatch, False, bits)
    assert "prefetch." not in off
    assert on.count("prefetch.tensormap") == 4 and on.count("prefetch.global.L1") == 2  # the length's, the page's
    assert on.rindex("prefetch.") < on.index("mbarrier.init")
    # the length read past the prologue's last CTA barrier (the stage-1 kernel's first global load without it)
    length = re.compile(r"^\s*ld\.global\.b32\b", re.M)
    assert length.search(off).start() < off.index("bar.sync")
    assert length.search(on).start() > on.index("bar.sync")
    # the kernel's work as it was: its MMAs, copies, barriers and global accesses; with Q staged by the first
    # consumer (INT2) the consumers read the length themselves, once Q is staged
    work = re.compile(r"^\s*((?:wgmma|cp\.async|mbarrier|bar|ld\.global|st\.global|red|atom)\.\S*)", re.M)
    more, fewer = Counter(work.findall(on)) - Counter(work.findall(off)), Counter(work.findall(off)) - Counter(
        work.findall(on))
    assert not fewer and more == (Counter({"ld.global.b32": 1}) if bits == 2 else Counter())


@pytest.mark.gpu
@pytest.mark.skipif(not HOPPER, reason="needs an sm_90 GPU (H100/H200)")
@pytest.mark.parametrize("bits", (2, 4))
@pytest.mark.parametrize("lens,num_splits,fmt_kw,launch", [
    ([8192, 700, 1], 16, {}, {"warp_specialized": True, "k_operand": "e4m3", "tiles_per_pass": 2}),
    ([3000, 5], 3, {"sink": 4, "recent": 100}, {"warp_specialized": True, "tiles_per_pass": 1}),
    ([4100, 260], None, {"k_axis": "channel"}, {"warp_specialized": True})])
def test_prefetched_descriptors_against_the_oracle_gpu(monkeypatch, bits, lens, num_splits, fmt_kw, launch):
    from _cases import cute_against_the_oracle
    fmt = foscar.KVFormat(bits=bits, **{"head_dim": 128, "group_size": 128, **fmt_kw})
    with cute_switches(monkeypatch, START_PREFETCH=True):
        cute_against_the_oracle(fmt, lens, 4, "descriptors prefetched: error", num_splits=num_splits, **launch)
