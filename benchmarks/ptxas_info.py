"""What ptxas says of a CuTe DSL stage-1 kernel, on any machine (no GPU): registers, spill bytes, and the
``wgmma.wait_group`` waits it injects (C7517: a product that was meant to stay in flight waits).

    python benchmarks/ptxas_info.py --bits 2 --k-operand e4m3 --tiles-per-pass 2 [--gqa 4] [--ctas 2]
    python benchmarks/run_with.py CHANNEL_K_E4M3=1 -- benchmarks/ptxas_info.py --bits 2 --k-axis channel ...

Compiles the kernel's PTX (``foscar.cute.compile.compile_stage1(..., keep_ptx=True)``) and assembles it with
Triton's bundled ``ptxas-blackwell`` for ``sm_90a`` with ``-v``. cutlass-dsl 4.8.1 writes PTX ISA 9.4 and that
ptxas (CUDA 13.3) reads up to 9.3: the version line is lowered, which these kernels allow (they use no 9.4
instruction). The cubin CuTe DSL builds itself comes from its own ptxas: counts can differ by a few registers.
"""
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

import triton

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))
os.environ.setdefault("CUTE_DSL_ARCH", "sm_90a")

PTXAS = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "ptxas-blackwell"


def ptxas_report(ptx: str) -> str:
    """``ptxas -v`` of ``ptx`` for sm_90a, its messages as text. The PTX's ISA version is lowered to the newest this
    ptxas reads (9.3 for CUDA 13.3's; an older Triton's ptxas names its own in its refusal, and is asked again)."""
    version = "9.3"
    for _ in range(2):
        src_text = re.sub(r"^\.version \d+\.\d+", f".version {version}", ptx, count=1, flags=re.M)
        with tempfile.TemporaryDirectory() as d:
            src = Path(d, "k.ptx")
            src.write_text(src_text)
            run = subprocess.run([str(PTXAS), "-arch=sm_90a", "-v", "-O3", str(src), "-o", str(Path(d, "k.cubin"))],
                                 capture_output=True, text=True)
        older = re.search(r"Unsupported \.version [\d.]+; current version is '([\d.]+)'", run.stderr)
        if not (run.returncode and older):
            break
        version = older.group(1)
    if run.returncode:
        raise SystemExit(f"ptxas failed: {run.stderr.strip()[:500]}")
    return run.stderr + run.stdout


def main() -> int:
    from sass_stats_cute import kernel_config, kernel_parser

    from foscar.cute.compile import compile_stage1
    a = kernel_parser(__doc__.splitlines()[0]).parse_args()
    if a.v0:
        raise SystemExit("ptxas_info: v1 kernels only (--v0 is sass_stats_cute.py's)")
    text = ptxas_report(compile_stage1(kernel_config(a), keep_ptx=True, warp_specialized=True,
                                       ctas_per_sm=a.ctas).__ptx__)
    regs = re.search(r"Used (\d+) registers", text)
    spills = re.search(r"(\d+) bytes spill stores, (\d+) bytes spill loads", text)
    waits = re.findall(r"\(C7517\) wgmma\.wait_group is injected in around line (\d+)", text)
    serial = re.search(r"wgmma\.mma_async instructions are serialized (due to [^']*)", text)
    print(f"registers {regs.group(1) if regs else '?'} (the launch bound; consumers take setmaxnreg's), spill stores "
          f"{spills.group(1) if spills else '?'} B, loads {spills.group(2) if spills else '?'} B; injected "
          f"wgmma.wait_group: {len(waits)}" + (f" (PTX lines {', '.join(waits)})" if waits else "")
          + f"; every wgmma serialized: {serial.group(1).strip() if serial else 'no'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
