"""Instruction counts of the CuTe DSL stage-1 kernels, compiled for sm_90a on any machine (no GPU).

    python benchmarks/sass_stats_cute.py --bits 2 [--k-axis token --v-axis token --gqa 4] [--v0] [--ctas 2] \
        [--k-operand e4m3] [--q-len 2] [--scheme nvfp4|mxfp4]

Compiles the kernel (``foscar.cute.compile.compile_stage1``, keeping the cubin CuTe DSL builds),
disassembles it with Triton's bundled cuobjdump and takes the consumer warpgroup's
KV-tile loop (:func:`tile_loop`).
Prints that loop's SASS instructions per thread per tile, by class (operand construction, tensor-core
MMA, softmax, shared and global memory, synchronisation, other), per packed byte of the tile, and the
most frequent opcodes: the instruction mix that bounds an issue-limited kernel (ncu's "Issue Slots
Busy").
"""
import argparse
import os
import re
import subprocess
import sys
import tempfile
from collections import Counter
from pathlib import Path

import triton

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
os.environ.setdefault("CUTE_DSL_ARCH", "sm_90a")

#: Opcode classes (by the opcode's first field).
CLASSES = {
    "tensor-core MMA": ("HGMMA", "QGMMA", "IGMMA", "WARPGROUP", "WARPSYNC"),
    "softmax and scaling": ("MUFU", "FMNMX", "FADD", "FMUL", "FFMA", "FSEL", "FSETP", "SHFL", "FCHK", "F2F", "F2FP"),
    "operand construction": ("LOP3", "SHF", "PRMT", "HADD2", "HFMA2", "HMUL2", "IMAD", "IADD3", "LEA", "SEL",
                             "MOV", "I2F", "F2I"),
    "shared memory": ("LDS", "STS", "LDSM", "STSM"),
    "global memory": ("LDG", "STG", "UBLKCP", "UTMALDG", "UTMASTG"),
    "synchronisation": ("SYNCS", "BAR", "DEPBAR", "MEMBAR", "ARRIVES", "UCGABAR_ARV", "UCGABAR_WAIT"),
}
BIN = Path(triton.__file__).parent / "backends" / "nvidia" / "bin"


def classify(op: str) -> str:
    head = op.split(".")[0]
    for name, heads in CLASSES.items():
        if head in heads:
            return name
    return "other (branches, predicates, uniform datapath)"


def sass_of(cubin: bytes) -> str:
    with tempfile.TemporaryDirectory() as d:
        path = Path(d, "k.cubin")
        path.write_bytes(cubin)
        return subprocess.run([str(BIN / "cuobjdump"), "-sass", str(path)], capture_output=True, text=True,
                              check=True).stdout


def tile_loop(sass: str) -> list[str]:
    """The opcodes of the tile loop: the innermost backward-branch span that holds a whole pass's tensor-core
    MMAs (the longer spans around it are the split loop and the pipeline; v1 compiles the tile loop twice, once
    per branch of the correction fold, the same instructions)."""
    return [op for _, op in _loop(sass)]


def _loop(sass: str) -> list[tuple[int, str]]:
    """``(address, opcode)`` of :func:`tile_loop`'s instructions."""
    ins = [(int(a, 16), op) for a, op in re.findall(r"/\*([0-9a-f]{4,})\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_.]*)", sass)]
    back = [(int(t, 16), int(a, 16)) for a, t in
            re.findall(r"/\*([0-9a-f]{4,})\*/\s+(?:@!?U?P\w+\s+)?BRA\s+0x([0-9a-f]+)", sass) if int(t, 16) < int(a, 16)]
    spans = [[(a, op) for a, op in ins if lo <= a <= hi] for lo, hi in back]
    mmas = [sum("GMMA" in op for _, op in ops) for ops in spans]
    if not any(mmas):
        raise SystemExit("no loop with tensor-core MMAs found in the SASS")
    # the loop holds at least half of the most any span holds (the spans around both consumers' loops); a branch
    # back into the middle of the loop's body (a rare path laid out after it) spans part of its MMAs, starting
    # inside the loop and ending past it, where loops nest
    nested = [not any(lo2 < lo <= hi2 < hi for lo2, hi2 in back) for lo, hi in back]
    most = max(n for n, ok in zip(mmas, nested) if ok)  # of the loops proper (three consumers: three such loops)
    return min((ops for ops, n, ok in zip(spans, mmas, nested) if 2 * n >= most and ok), key=len)


def rare_paths(sass: str) -> dict:
    """Instructions of the tile loop's blocks that a full tile on the common path skips, by kind: ``"rescale"`` (the
    lazy rescale's rare branches, each the span its branch skips right after its ``BAR.RED`` vote,
    :func:`foscar.cute.lazy.lazy_softmax`), ``"masks"`` (the scores' masks in a branch, ``Sm90Config.mask_branch``:
    a block of ``-inf`` selects and their compares, taken by the tiles that reach a limit), ``"fold"`` (the offset
    corrections' fold after the PV product, taken once in :data:`~foscar.cute.config.CORRECTION_TILES` tiles) and
    ``"waits"`` (an mbarrier wait's retry)."""
    lines = [(int(a, 16), line) for a, line in re.findall(r"/\*([0-9a-f]{4,})\*/\s+([^;]*;)", sass)]
    span = [a for a, _ in _loop(sass)]
    lo, hi = span[0], span[-1]
    lines = [(a, line) for a, line in lines if lo <= a <= hi]
    last_wait = max((a for a, line in lines if "WARPGROUP.DEPBAR" in line), default=hi)
    branch = re.compile(r"@!?U?P\w+\s+BRA\s+0x([0-9a-f]+)")
    votes = [i for i, (_, line) in enumerate(lines) if "BAR.RED" in line]
    lazy = {next((j for j in range(v + 1, min(v + 32, len(lines))) if branch.match(lines[j][1])), -1) for v in votes}
    out = {"rescale": 0, "masks": 0, "fold": 0, "waits": 0}
    covered = -1  # the end of the last block counted: branches inside it are its own
    for i, (a, line) in enumerate(lines):
        m = branch.match(line)
        if not m or a < covered or not a < int(m.group(1), 16) <= hi:
            continue
        covered = int(m.group(1), 16)
        block = [x for b, x in lines if a < b < covered]
        heads = {re.sub(r"^@!?U?P\w+\s+", "", x).split()[0].split(".")[0] for x in block}
        if i in lazy:  # the lazy rescale's branch, the first after its vote
            out["rescale"] += len(block)
        elif len(block) <= 8 and any("SYNCS.PHASECHK" in x for x in block):  # a retry, not a path around one
            out["waits"] += len(block)
        elif heads <= {"FSEL", "ISETP", "VIADD", "IADD3", "IMAD", "LEA", "MOV"} and any("-INF" in x for x in block):
            out["masks"] += len(block)
        elif a > last_wait and not out["fold"]:  # the first branch past the PV product's wait
            out["fold"] = len(block)
        else:
            covered = -1  # a branch of the common path: the blocks inside it are looked at too
    return out


def kernel_parser(description: str) -> argparse.ArgumentParser:
    """The options that name a stage-1 kernel (the format, the rows, the variant): this script's and
    ``ptxas_info.py``'s; :func:`kernel_config` reads them."""
    p = argparse.ArgumentParser(description=description)
    p.add_argument("--bits", type=int, default=2, choices=(2, 4))
    p.add_argument("--k-axis", default="token")
    p.add_argument("--v-axis", default="token")
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--group-size", type=int, default=128)
    p.add_argument("--gqa", type=int, default=4)
    p.add_argument("--v0", action="store_true", help="v0 (one warpgroup) instead of v1")
    p.add_argument("--ctas", type=int, default=2, help="v1: CTAs per SM (1 or 2)")
    p.add_argument("--k-operand", default="bf16", choices=("bf16", "e4m3", "e4m3x3", "e4m3d4"),
                   help="the K operands (foscar.cute.config.K_OPERANDS)")
    p.add_argument("--tiles-per-pass", type=int, default=1, choices=(1, 2),
                   help="v1: KV tiles per softmax pass (Sm90Config.tiles_per_pass); counts are per tile")
    p.add_argument("--q-len", type=int, default=1, help="query tokens per sequence (Sm90Config.step): gqa * q_len "
                   "query rows, the wgmma N 8, 16 or 32")
    p.add_argument("--scheme", default="affine", choices=("affine", "nvfp4", "mxfp4"),
                   help="the cache's codes: affine (--bits), or the NVFP4 block format (INT4 words)")
    p.add_argument("--sink", type=int, default=0, help="the format's BF16 sink (KVFormat.sink)")
    p.add_argument("--recent", type=int, default=0, help="the format's BF16 recent window (KVFormat.recent)")
    p.add_argument("--tail", type=int, default=0, help="a part of a longer step: its tokens end this many before "
                   "the sequence's (Sm90Config.tail)")
    p.add_argument("--stages", type=int, default=None, help="v1's stages per consumer (Sm90Config.stages; unset: "
                   "config_for's default)")
    return p


def kernel_config(a: argparse.Namespace):
    """The ``Sm90Config`` of :func:`kernel_parser`'s options (an FP4 scheme sets ``a``'s bits, group and axes)."""
    import foscar
    from foscar.cute.config import config_for
    if a.scheme == "affine":
        fmt = foscar.KVFormat(bits=a.bits, head_dim=a.head_dim, group_size=a.group_size, k_axis=a.k_axis,
                              v_axis=a.v_axis, sink=a.sink, recent=a.recent)
    else:
        fmt = foscar.KVFormat.fp4(a.scheme, a.head_dim, sink=a.sink, recent=a.recent)
        a.bits, a.group_size, a.k_axis, a.v_axis = 4, fmt.group_size, fmt.k_axis, fmt.v_axis
    return config_for(fmt, a.gqa, 64, a.k_operand, a.tiles_per_pass, a.q_len, a.stages, a.tail)


def kernel_sass(a: argparse.Namespace) -> tuple:
    """``(cfg, sass)``: the kernel :func:`kernel_parser`'s options name, compiled for sm_90a and disassembled, and its
    config as v1 runs it at ``a.ctas`` CTAs an SM (the switches of ``foscar.cute.config`` as they are set now)."""
    from foscar.cute.compile import compile_stage1
    cfg = kernel_config(a)
    cubin = compile_stage1(cfg, keep_cubin=True, warp_specialized=not a.v0, ctas_per_sm=a.ctas).__cubin__
    if not a.v0:  # as v1 runs it at these CTAs an SM
        from foscar.cute.config import as_run
        cfg = as_run(cfg, a.ctas)
    return cfg, sass_of(cubin)


def full_tile(sass: str, per: int) -> float:
    """The instructions of a full tile on the tile loop's common path: no rescale, no mask, no wait retried, the
    correction fold once in ``CORRECTION_TILES`` tiles (``per``: tiles a pass)."""
    from foscar.cute.config import CORRECTION_TILES
    paths = rare_paths(sass)
    return (len(tile_loop(sass)) - sum(paths.values()) + paths["fold"] * per / CORRECTION_TILES) / per


def local_memory(sass: str) -> int:
    """The kernel's local-memory loads and stores: register spills."""
    return len(re.findall(r"\b(?:LDL|STL)\b", sass))


def main() -> int:
    from foscar.cute.config import CORRECTION_TILES, TILE
    p = kernel_parser(__doc__.splitlines()[0])
    p.add_argument("--top", type=int, default=20, help="opcodes listed")
    a = p.parse_args()
    cfg, sass = kernel_sass(a)
    loop = tile_loop(sass)
    per = cfg.p_tiles  # the loop's body is one pass: two tiles with two a pass or overlapped
    packed = 2 * TILE * a.head_dim * a.bits // 8  # K and V codes of one tile and KV head
    by_class = Counter(classify(op) for op in loop)
    spills = local_memory(sass)
    paths = rare_paths(sass)
    rare = paths["rescale"]
    codes = f"INT{a.bits}" if a.scheme == "affine" else a.scheme.upper()
    print(f"{'v0' if a.v0 else f'v1 ({a.ctas} CTA/SM)'} {a.k_operand.upper()} K operands, {codes} K {a.k_axis} "
          f"V {a.v_axis} D {a.head_dim} "
          f"g {a.group_size} GQA {a.gqa}, q_len {a.q_len} (N {cfg.cols}), {per} tile(s) per pass"
          f"{' (overlapped)' if cfg.overlap else ''}: {len(loop) / per:g} SASS instructions per "
          f"thread per 64-token tile, {len(loop) * 4 / per / packed:.3f} warp instructions per packed byte "
          f"({packed} bytes); {spills} local-memory instructions (spills) in the kernel")
    if rare:
        print(f"of which {rare / per:g} per tile are the lazy rescale's branch, rarely taken: "
              f"{(len(loop) - rare) / per:g} per tile when it is not")
    full = full_tile(sass, per)
    print(f"a full tile on the common path (no rescale, no mask, the correction fold once in {CORRECTION_TILES} "
          f"tiles, no wait retried): {full:g} per tile; skipped blocks {paths}")
    print()
    print("| class | per thread per tile | share |\n|---|---|---|")
    for name, n in by_class.most_common():
        print(f"| {name} | {n / per:g} | {100 * n / len(loop):.0f}% |")
    print("\n| opcode | per tile |\n|---|---|")
    for op, n in Counter(loop).most_common(a.top):
        print(f"| {op} | {n / per:g} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
