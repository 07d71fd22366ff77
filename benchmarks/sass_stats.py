"""Instruction counts of the Triton stage-1 decode kernel, compiled for sm_90 on any machine (no GPU).

    python benchmarks/sass_stats.py --bits 4 --k-axis token --v-axis token

Compiles ``foscar.triton.decode.fold_decode_stage1`` with Triton's bundled ptxas, disassembles the
cubin with its cuobjdump, finds the KV-tile loop (the backward branch) and prints its SASS
instruction mix per thread per tile: the cost model of ``docs/triton-perf.md``.
"""
import argparse
import os
import re
import subprocess
import tempfile
from collections import Counter

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from foscar.format import KVFormat
from foscar.triton.decode import fold_decode_stage1
from foscar.triton.launch import stage1_constexprs

POINTERS = {"Q": "*bf16", "KC": "*i32", "VC": "*i32", "KP": "*fp32", "VP": "*fp32", "BT": "*i32", "SEQ": "*i32",
            "OP": "*fp32", "LP": "*fp32", "O": "*bf16", "LSE": "*fp32", "SEM": "*i32", "ROT": "*fp32"}
STRIDES = ("stride_qb", "stride_qh", "stride_cp", "stride_ch", "stride_kpp", "stride_kph", "stride_vpp", "stride_vph",
           "stride_btb", "stride_opb", "stride_oph", "stride_ops", "stride_lpb", "stride_lph", "stride_ob", "stride_oh",
           "stride_lb", "stride_lh")


def compile_stage1(fmt: KVFormat, *, block_n=64, page=64, G=4, num_warps=4, num_stages=1, fold=True,
                   max_registers=None, prefetch=1, fused_combine=True, q_len=1, lazy=False):
    constexprs = dict(stage1_constexprs(fmt, G, block_n=block_n, page=page, fold=fold, prefetch=prefetch,
                                        fused_combine=fused_combine, step=q_len, lazy=lazy))
    signature = dict(POINTERS, qk_scale="fp32", **{s: "i32" for s in STRIDES}, **{k: "constexpr" for k in constexprs})
    src = ASTSource(fn=fold_decode_stage1, signature=signature, constexprs=constexprs)
    options = {"num_warps": num_warps, "num_stages": num_stages}
    if max_registers:
        options["maxnreg"] = max_registers
    return triton.compile(src, target=GPUTarget("cuda", 90, 32), options=options)


FP4_POINTERS = {"Q": "*bf16", "KC": "*i32", "VC": "*i32", "KS": "*u8", "VS": "*u8", "BT": "*i32", "SEQ": "*i32",
                "TS": "*fp32", "OP": "*fp32", "LP": "*fp32", "O": "*bf16", "LSE": "*fp32", "SEM": "*i32"}


def compile_stage1_fp4(fmt: KVFormat, *, block_n=64, page=64, G=4, num_warps=4, num_stages=1, fused_combine=True,
                       q_len=1, max_registers=None):
    """The FP4 block formats' stage 1 (:func:`foscar.triton.decode_fp4.fp4_decode_stage1`), compiled as the
    launcher compiles it."""
    from foscar.triton.decode_fp4 import fp4_decode_stage1
    from foscar.triton.launch_fp4 import stage1_constexprs_fp4
    constexprs = dict(stage1_constexprs_fp4(fmt, G, block_n=block_n, page=page, fused_combine=fused_combine,
                                            step=q_len))
    signature = dict(FP4_POINTERS, qk_scale="fp32", **{s: "i32" for s in STRIDES},
                     **{k: "constexpr" for k in constexprs})
    src = ASTSource(fn=fp4_decode_stage1, signature=signature, constexprs=constexprs)
    options = {"num_warps": num_warps, "num_stages": num_stages}
    if max_registers:
        options["maxnreg"] = max_registers
    return triton.compile(src, target=GPUTarget("cuda", 90, 32), options=options)


def _cuobjdump(kernel, flag: str) -> str:
    bindir = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin")
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(kernel.asm["cubin"])
        f.flush()
        return subprocess.run([os.path.join(bindir, "cuobjdump"), flag, f.name], capture_output=True, text=True,
                              check=True).stdout


def resources(kernel) -> dict:
    """Registers per thread and stack bytes per thread (non-zero: ptxas spilled) of the compiled kernel."""
    usage = _cuobjdump(kernel, "-res-usage")
    return {"registers": int(re.findall(r"REG:(\d+)", usage)[0]), "stack": int(re.findall(r"STACK:(\d+)", usage)[0])}


def loop_mix(kernel) -> tuple[int, Counter]:
    sass = _cuobjdump(kernel, "-sass")
    ins = [(int(a, 16), op) for a, op in re.findall(r"/\*([0-9a-f]{4,})\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_.]*)", sass)]
    lo, hi = _loop_span(sass)
    loop = [op for a, op in ins if lo <= a <= hi]
    return len(ins), Counter(loop)


def _loop_span(sass: str) -> tuple[int, int]:
    """The KV-tile loop: the first backward branch's span."""
    back = [(int(a, 16), int(t, 16)) for a, t in re.findall(r"/\*([0-9a-f]{4,})\*/\s+@!?U?P\w+\s+BRA\s+0x([0-9a-f]+)", sass)
            if int(t, 16) < int(a, 16)]
    return (back[0][1], back[0][0]) if back else (0, 1 << 30)


def full_tile(kernel, fold_every: int = 8) -> tuple[float, dict]:
    """The instructions of a full tile on the common path, and the blocks it skips: the loop less the blocks of
    its forward branches that a full tile does not take, the lazy rescale's (its maxima's ``FMNMX``) and the
    masks' (``-inf`` selects and their compares), with the correction fold (the loop's last forward branch) taken
    once in ``fold_every`` tiles."""
    sass = _cuobjdump(kernel, "-sass")
    lo, hi = _loop_span(sass)
    lines = [(int(a, 16), t) for a, t in re.findall(r"/\*([0-9a-f]{4,})\*/\s+([^;]*;)", sass) if lo <= int(a, 16) <= hi]
    blocks = []
    for a, t in lines:
        m = re.match(r"@!?U?P\w+\s+BRA\s+0x([0-9a-f]+)", t)
        if m and a < int(m.group(1), 16) <= hi:
            blocks.append([x for b, x in lines if a < b < int(m.group(1), 16)])
    skipped = {"rescale": 0, "masks": 0, "fold": 0}
    for i, block in enumerate(blocks):
        heads = {re.sub(r"^@!?U?P\w+\s+", "", x).split()[0].split(".")[0] for x in block}
        if i == len(blocks) - 1:
            skipped["fold"] = len(block)
        elif "FMNMX" in heads:
            skipped["rescale"] += len(block)
        elif heads <= {"FSEL", "ISETP", "IADD3", "IMAD", "VIADD", "LEA"} and any("-INF" in x for x in block):
            skipped["masks"] += len(block)
    return len(lines) - sum(skipped.values()) + skipped["fold"] / fold_every, skipped


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--bits", type=int, default=4, choices=(2, 4))
    p.add_argument("--k-axis", default="token")
    p.add_argument("--v-axis", default="token")
    p.add_argument("--group-size", type=int, default=128)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--block-n", type=int, default=64)
    p.add_argument("--num-warps", type=int, default=4)
    p.add_argument("--reconstruct", action="store_true", help="the per-value reconstruction kernel instead")
    p.add_argument("--max-registers", type=int, default=None, help="ptxas register cap (maxnreg)")
    p.add_argument("--prefetch", type=int, default=1, choices=(1, 2), help="KV tiles in flight")
    p.add_argument("--gqa", type=int, default=4, help="query heads per KV head")
    p.add_argument("--separate-combine", action="store_true", help="without the split merge in the epilogue")
    p.add_argument("--rotation", action="store_true", help="a rotated cache (the query rotated as it is loaded)")
    p.add_argument("--q-len", type=int, default=1, help="tokens of a decode step, rows of each program")
    p.add_argument("--scheme", choices=("affine", "nvfp4", "mxfp4"), default="affine",
                   help="an FP4 block format: its kernel (the format's other options are its own)")
    p.add_argument("--lazy", action="store_true", help="the lazy rescale (foscar.triton.decode's lazy_rescale)")
    p.add_argument("--launcher-cap", action="store_true",
                   help="the register cap the launcher would set (foscar.triton.launch.max_registers)")
    a = p.parse_args()
    fmt = KVFormat(bits=a.bits, head_dim=a.head_dim, group_size=a.group_size, k_axis=a.k_axis, v_axis=a.v_axis,
                   rotation="hadamard" if a.rotation else None)
    cap = a.max_registers
    if a.launcher_cap:
        from foscar.triton.launch import max_registers
        cap = max_registers(fmt, a.prefetch, a.gqa * a.q_len)
    if a.scheme != "affine":
        k = compile_stage1_fp4(KVFormat.fp4(a.scheme, a.head_dim), block_n=a.block_n, G=a.gqa, num_warps=a.num_warps,
                               fused_combine=not a.separate_combine, q_len=a.q_len, max_registers=cap)
    else:
        k = compile_stage1(fmt, block_n=a.block_n, G=a.gqa, num_warps=a.num_warps, fold=not a.reconstruct,
                           max_registers=cap, prefetch=a.prefetch, fused_combine=not a.separate_combine,
                           q_len=a.q_len, lazy=a.lazy)
    total, mix = loop_mix(k)
    res = resources(k)
    full, skipped = full_tile(k)
    print(f"kernel: {total} SASS instructions, {res['registers']} registers, {res['stack']} stack bytes; "
          f"KV-tile loop: {sum(mix.values())} per thread per tile; a full tile on the common path (no rescale, no "
          f"mask, the correction fold once in 8 tiles): {full:g} (skipped blocks {skipped})")
    for op, n in mix.most_common(25):
        print(f"  {op:28s} {n}")


if __name__ == "__main__":
    main()
