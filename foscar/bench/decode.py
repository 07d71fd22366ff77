"""Decode benchmark (``foscar bench speed``): foscar's kernels against FlashInfer BF16 and cuDNN SDPA, in one run.

Times, per shape (Hq=32, Hkv=8 or ``--heads``; D=128 or ``--head-dim`` 64 or 256; g = min(128, D); page 64), with
the L2 flushed (512 MiB written) before each call and CUDA events around the call alone (median of ``--iters``
after ``--warmup``):

- ``foscar_folded``       backend "triton" of foscar.backends: launch(q, cache, {kernel="folded", out=out})
                          (quantized cache; its availability is the backend's status)
- ``foscar_reconstruct``  foscar.triton.decode(q, cache, out=out, kernel="reconstruct") (quantized cache;
                          the per-value reconstruction baseline)
- ``foscar_bf16``         foscar.triton.decode_bf16(q, k, v, block_table, seq_lens, out=out) (k, v: HND views)
- ``flashinfer_tc``       FlashInfer BatchDecodeWithPagedKVCacheWrapper, NHD, use_tensor_cores=True (baseline)
- ``flashinfer``          the same, use_tensor_cores=False
- ``cudnn_sdpa``          torch SDPA under sdpa_kernel(SDPBackend.CUDNN_ATTENTION)
- ``flashinfer_fp8``      FlashInfer FP8 (e4m3) KV, tensor cores (a low-bit peer; opt-in with --kernels)
- ``flashinfer_nvfp4``    FlashInfer NVFP4 KV, fa2 backend: INT4's bytes (a low-bit peer; opt-in, timing only)
- ``foscar_cute``         backend "cute": the CuTe DSL sm_90a kernel v0, BF16 K operands (opt-in; its tuned split
                          count where one is tuned for that variant)
- ``foscar_cute_ws``      its v1: TMA producer and two consumer warpgroups, BF16 K operands (opt-in; likewise)
- ``foscar_cute_e4m3``    v1 with E4M3 K operands and Q as two E4M3 terms (opt-in; token-wise K, GQA <= 4)
- ``foscar_cute_pair``    that with two KV tiles per softmax pass (opt-in; token-wise K and V, GQA <= 4)
- ``foscar_cute_e4m3x3``  v1 with E4M3 K operands and Q as three E4M3 terms, one tile a pass (opt-in; token-wise
                          K, up to 16 query rows)
- ``foscar_cute_e4m3d4``  the same with Q as four integer digits (every k32 step's sum exact in the FP8
                          accumulation): the accuracy option (opt-in; token-wise K, up to 4 query rows)
- ``foscar_auto``         foscar.decode(q, cache, out=out): the backend, variant and launch the library picks
                          (``backend="auto"``, the autotune cache; opt-in)
- ``fa4``                 FlashAttention-4 (flash_attn.cute) over an unpaged copy of the BF16 cache (opt-in;
                          needs cutlass-dsl, flash-attn-4 and quack: with the cutlass-dsl bundle they
                          exceed one command's carry next to FlashInfer, so they run in a command of
                          their own, with foscar_folded and cudnn_sdpa to tie the runs together)

and the streaming-read ceiling (a Triton kernel that reads ``--ceiling-gib`` GiB in 16-byte loads;
``torch.sum`` alongside). Every kernel's output is poisoned with NaN before its first call and
checked against a float64 reference on one (sequence, KV head) slice of the timed shape before it is
timed (:mod:`foscar.bench.measure`, the driver ``foscar tune`` and the launch sweeps share); a wrong
output is reported and never timed. ``--check`` first holds the foscar kernels to
``foscar.decode_exact`` on small ragged caches (error at most 1.5x that of BF16 attention on the same
dequantized cache). A kernel that is not there is reported as ``missing: <reason>``, never dropped; a
wrong output, a failed check or a kernel error exits 1.
A call that waits for the GPU inside (host sync) is noted: its event time then includes a launch gap;
``--kernel-time`` adds each call's profiled GPU kernel time, which leaves such gaps out.

Outputs: a compact Markdown table on stdout (printed last), ``<out>/bench_decode.md`` (with a
per-kernel table) and ``<out>/bench_decode.json`` (rewritten after every shape).

On the CPU machine (once), fetch the baseline wheels into the git-ignored ``.gpu/`` and put the two
the baselines need, FlashInfer and apache-tvm-ffi, in a folder of their own (flash-attn-4 and quack
are for FA4 only; torch-c-dlpack-ext is optional for tvm-ffi). With this checkout that is about
62.6 MiB, under the 64 MiB one device command carries::

    bash ../shared/device/fetch-baseline-wheels.sh .gpu/wheels
    mkdir -p .gpu/fi && ln -f .gpu/wheels/flashinfer_python-*.whl .gpu/wheels/apache_tvm_ffi-*.whl .gpu/fi/

On the GPU machine, one command, sending ``.gpu/fi`` along (carry)::

    set -o pipefail; python3 -m pip install -q --no-index --no-deps --no-compile .gpu/fi/*.whl && \\
    FLASHINFER_WORKSPACE_BASE=/tmp/fi PYTHONUNBUFFERED=1 \\
    python3 benchmarks/bench_decode.py --grid paper --check --kernel-time --out $OUT 2>&1 | tee $OUT/bench_decode.log

Other runs: ``--grid axes`` (the four K/V axis combinations), ``--grid quick`` (a smoke run),
``--shapes 8:128K,64:32K``, ``--bits 2``, ``--kernels foscar_folded flashinfer_tc``, ``--heads 16:8``,
``--head-dim 256`` (every kernel, format, byte count, memory estimate and reference at that head dim),
``--cuda-graph`` (time graph replays; fails for a call that synchronizes with the host).
"""

from __future__ import annotations

import argparse
import os
import sys

import torch

from ..format import SUPPORTED_HEAD_DIMS
from .common import (L2_FLUSHES, as_graph, cache_to, int_in, make_block_table, one_head_cache, parse_heads,
                     positive_float, random_cache, rel_l2, writable_dir)
from .ceiling import measure_read_ceiling, read_kernel, read_rates, xor_reduce
from .grid import (AXES_SHAPES, AXIS_COMBOS, BF16_BYTES_PER_TOKEN, CHANNEL, FLUSH_BYTES, GIB, GQA, GRIDS, GROUP,
                   HEAD_DIM, HKV, HQ, KI, LENGTH_QUANTUM, MIB, PAGE, PAPER_SHAPES, QUICK_SHAPES, SM_SCALE, TOKEN, Case,
                   bf16_bytes_per_token, build_grid, bytes_read, fmt_len, group_by_shape, group_for, kv_bytes_per_token,
                   parse_length, parse_shapes, peak_bytes, plan_shapes, sm_scale)
from .inputs import (Bf16Inputs, QuantInputs, SliceRef, bf16_slice_reference, make_bf16_inputs, make_random_cache,
                     quant_slice_reference, slice_reference)
from .kernels import KERNELS, AutoKernel, BackendKernel, Baseline, KernelMissing, Runner
from .measure import (SLICE_FACTOR, NotHeld, SliceCheck, check_output, kernel_time_fn, measure, slice_check,
                      syncs_with_host)
from .report import (BASELINE, CSV_COLUMNS, annotate, evaluate_bars, failures, geomean, geomean_speedup,
                     problem_lines, records_csv, render_checks, render_markdown, render_pivot, render_records,
                     render_summary, write_outputs)
from .speed import CHECK_FACTOR, CHECK_LENS, Target, device_meta, log, run, run_exact_check, run_shape

SHAPE_FACTOR = SLICE_FACTOR  # --shape-factor's default: the slice check's factor

__all__ = [
    # the command line
    "DESCRIPTION", "PROG", "build_parser", "main", "parse_args",
    # the problem and grids (foscar.bench.grid)
    "AXES_SHAPES", "AXIS_COMBOS", "BF16_BYTES_PER_TOKEN", "CHANNEL", "FLUSH_BYTES", "GIB", "GQA", "GRIDS", "GROUP",
    "HEAD_DIM", "HKV", "HQ", "KI", "LENGTH_QUANTUM", "MIB", "PAGE", "PAPER_SHAPES", "QUICK_SHAPES", "SM_SCALE",
    "TOKEN", "Case", "bf16_bytes_per_token", "build_grid", "bytes_read", "fmt_len", "group_by_shape", "group_for",
    "kv_bytes_per_token", "parse_length", "parse_shapes", "peak_bytes", "plan_shapes", "sm_scale",
    # inputs and references (foscar.bench.inputs, foscar.bench.common)
    "Bf16Inputs", "QuantInputs", "SliceRef", "bf16_slice_reference", "make_bf16_inputs", "make_random_cache",
    "quant_slice_reference", "slice_reference", "as_graph", "cache_to", "make_block_table", "one_head_cache",
    "random_cache", "rel_l2",
    # the kernel table (foscar.bench.kernels)
    "KERNELS", "AutoKernel", "BackendKernel", "Baseline", "KernelMissing", "Runner",
    # the driver (foscar.bench.measure) and the run (foscar.bench.speed, foscar.bench.ceiling)
    "SHAPE_FACTOR", "SLICE_FACTOR", "NotHeld", "SliceCheck", "check_output", "kernel_time_fn", "measure",
    "slice_check", "syncs_with_host", "CHECK_FACTOR", "CHECK_LENS", "Target", "device_meta", "log", "run",
    "run_exact_check", "run_shape", "measure_read_ceiling", "read_kernel", "read_rates", "xor_reduce",
    # the report (foscar.bench.report)
    "BASELINE", "CSV_COLUMNS", "annotate", "evaluate_bars", "failures", "geomean", "geomean_speedup",
    "problem_lines", "records_csv", "render_checks", "render_markdown", "render_pivot", "render_records",
    "render_summary", "write_outputs",
]


DESCRIPTION = (
    "Time foscar's decode kernels over INT2 and INT4 KV caches against FlashInfer BF16 and cuDNN SDPA on this GPU, "
    "per shape of a grid (--grid) or of --shapes: the L2 flushed before each call, CUDA events around it, the "
    "median of --iters calls after --warmup, and the streaming-read ceiling. Every kernel's output is checked "
    "against a float64 reference on one slice of the timed shape before it is timed (a wrong output is never "
    "timed); a kernel that is not installed is reported as "
    "missing, and a wrong output, a failed --check or a kernel error exits with status 1. It writes "
    "bench_decode.json, .md and .csv under --out and prints a Markdown table. It needs a CUDA GPU.")
PROG = "python3 -m foscar.bench.decode"


def build_parser(prog: str = PROG) -> argparse.ArgumentParser:
    """The options, each checked by its argparse type while the arguments are parsed."""
    p = argparse.ArgumentParser(prog=prog, description=DESCRIPTION,
                                epilog="Kernels: " + ", ".join(KERNELS) + f". Baseline for speedups: {BASELINE}.")
    p.add_argument("--grid", choices=sorted(GRIDS), default="paper",
                   help="paper: 13 shapes, token-wise K/V; axes: B {1,8} x L {32K,128K} x 4 K/V axis combinations; "
                        "quick: 2 small shapes (default: paper)")
    p.add_argument("--shapes", type=parse_shapes, default=None, metavar="B:L,...",
                   help=f"B:L,B:L (L may end in K or M, a multiple of {LENGTH_QUANTUM}); replaces the grid's shapes, "
                        "keeps its axis combinations")
    p.add_argument("--bits", type=int, nargs="+", choices=(2, 4), default=[2, 4],
                   help="code widths of the quantized kernels (default: 2 4)")
    defaults = [k for k, s in KERNELS.items() if s.default]
    p.add_argument("--kernels", nargs="+", choices=list(KERNELS), default=defaults, metavar="KERNEL",
                   help=f"kernels to time, of those listed below (default: {' '.join(defaults)})")
    p.add_argument("--iters", type=int_in(5, want="an integer >= 5 (the median of >= 5 timed calls)"), default=5,
                   help="timed calls per kernel, at least 5 (the median; default: 5)")
    p.add_argument("--warmup", type=int_in(1), default=5,
                   help="untimed calls per kernel first, at least 1 (default: 5)")
    p.add_argument("--flush", choices=L2_FLUSHES, default=None,
                   help="how the L2 is flushed before each call: the 512 MiB buffer written (its write-back then "
                        "falls in the timed call) or read (the L2 cold and clean) (default: $FOSCAR_L2_FLUSH, else "
                        "write)")
    p.add_argument("--out", type=writable_dir, default=os.environ.get("OUT") or "/tmp", metavar="DIR",
                   help="folder of the output files, made if missing (default: $OUT, else /tmp)")
    p.add_argument("--max-gb", type=positive_float, default=None,
                   help="skip (and report) shapes needing more device memory (default: free memory - 4 GB)")
    p.add_argument("--check", action="store_true",
                   help="first hold foscar kernels to decode_exact on small ragged caches (exit 1 on failure)")
    p.add_argument("--num-splits", type=int_in(1), default=None,
                   help="passed to foscar.triton.decode, at least 1 (default: its own)")
    p.add_argument("--heads", type=parse_heads, default="32:8", metavar="HQ:HKV",
                   help="query and KV heads, Hq a positive multiple of Hkv (default: 32:8); the head-ratio sweep "
                        "(paper Fig. 15) runs one --heads per invocation and `foscar bench plot` joins them")
    p.add_argument("--head-dim", type=int, choices=SUPPORTED_HEAD_DIMS, default=HEAD_DIM,
                   help=f"head dimension D of q, K and V (default: {HEAD_DIM}); the (s, z) groups are min({GROUP}, D) "
                        f"channels (token-wise) or tokens (channel-wise): {GROUP} for D 128 and 256, 64 for D 64")
    p.add_argument("--cuda-graph", action="store_true", help="time CUDA-graph replays of each call")
    p.add_argument("--kernel-time", action="store_true",
                   help="also sum each call's GPU kernel times with the profiler (leaves out host gaps)")
    p.add_argument("--page-order", choices=("shuffled", "identity"), default="shuffled",
                   help="pages of each sequence in its own pool range, shuffled (default) or in order")
    p.add_argument("--ceiling-gib", type=positive_float, default=8.0,
                   help="GiB of the buffer read to measure the read ceiling (default: 8)")
    p.add_argument("--shape-factor", type=positive_float, default=SHAPE_FACTOR,
                   help=f"per-shape slice check: error at most this x BF16 attention's (default: {SHAPE_FACTOR:g})")
    p.add_argument("--seed", type=int_in(-2 ** 63, 2 ** 63 - 1, "an integer in [-2**63, 2**63)"), default=0,
                   help="seed of the random inputs; shape i draws from seed + i (default: 0)")
    return p


def parse_args(argv=None, prog: str = PROG) -> argparse.Namespace:
    args = build_parser(prog).parse_args(argv)
    if args.flush:  # one home for the mode: every timer of the run reads it (foscar.bench.common.flush_l2)
        os.environ["FOSCAR_L2_FLUSH"] = args.flush
    args.bits = tuple(sorted(set(args.bits)))
    args.kernels = list(dict.fromkeys(args.kernels))
    return args


def main(argv: list[str] | None = None, prog: str = PROG, target: Target | None = None) -> int:
    """Run the benchmark; ``prog`` is how it was invoked (its usage and error lines, and recorded with the
    arguments in the JSON); ``target``: where it runs (default: the CUDA device, :class:`Target`)."""
    argv = sys.argv[1:] if argv is None else list(argv)
    args = parse_args(argv, prog)
    if not torch.cuda.is_available():
        log(f"{prog}: error: needs a CUDA GPU (no CUDA device here): it times GPU kernels")
        return 1
    return run(args, argv, prog, target or Target())


if __name__ == "__main__":
    sys.exit(main())
