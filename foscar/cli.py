"""The ``foscar`` command line.

Subcommands:

``foscar demo``
    Quantize the paper's synthetic stress input (Sec. 6.2, :func:`foscar.synthetic.stress_inputs`)
    to INT2 and INT4, decode it on the best backend available, and print a table of the bytes the cache
    holds per token, output errors and times (``--json PATH`` also writes the numbers).
``foscar info``
    The GPU, the versions, and which decode backends run here.
``foscar tune``, ``foscar bench``
    Handed to :mod:`foscar.tune` and :mod:`foscar.bench.cli`, whose parsers check their options the same way.

A bad option is refused before any work starts, with exit status 2 and a one-line error on stderr naming
the option: argparse's (after its usage line), or, for a combination only the library can judge, the
library's message. An output path (``--json``, ``--out``) is checked for writing while the options are
parsed. Errors while running are one line too, never a traceback.

Backends (:func:`_select_backend`): what ``foscar.decode(backend="auto")`` picks: the Triton kernels on a
CUDA GPU, the PyTorch reference (:func:`foscar.decode_folded`) on the CPU.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from .format import AXES, SUPPORTED_BITS, SUPPORTED_HEAD_DIMS, KVFormat
from .quantize import QUANTIZERS
from .bench.accuracy import error_rows
from .bench.common import int_in, parse_seed, run_reporting, writable_file
from .synthetic import stress_inputs

PROG = "foscar"


# --------------------------------------------------------------------------------------------
# Backends
# --------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Backend:
    name: str
    description: str
    device: torch.device
    decode: Callable  # decode(q, cache) -> out [B, Hq, D] float32
    note: str = ""


def _decode_with(backend: str) -> Callable:
    """``decode(q, cache) -> out [B, Hq, D] float32`` through :func:`foscar.decode` on ``backend``."""
    def decode(q: torch.Tensor, cache) -> torch.Tensor:
        from .api import decode as foscar_decode
        out = foscar_decode(q, cache, backend=backend,
                            out=torch.empty(q.shape, dtype=torch.float32, device=q.device))
        if q.device.type == "cuda":
            torch.cuda.synchronize()
        return out
    return decode


def _select_backend() -> Backend:
    """The demo's device (a CUDA GPU if there is one) and the backend ``foscar.decode(backend="auto")``
    picks there for the demo's default format (:func:`foscar.select_backend`'s rule: one home)."""
    import os

    from .api import ENV, _fmt_values, _select
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    name = _select(str(device), _fmt_values(KVFormat(bits=4, head_dim=128, group_size=128)), 4, 64, "auto",
                   os.environ.get(ENV, "auto"))
    where = torch.cuda.get_device_name(0) if device.type == "cuda" else "CPU"
    return Backend(name, f"{name} (folded, {where})", device, _decode_with(name))


# --------------------------------------------------------------------------------------------
# Helpers
# --------------------------------------------------------------------------------------------
_positive_int = int_in(1)
_nonnegative_int = int_in(0)
#: The most torch threads ``--threads`` takes: a huge count aborts the process in the OpenMP runtime, with no
#: Python error.
MAX_THREADS = 4 * (os.cpu_count() or 1)

#: The option of ``foscar demo`` each library argument name comes from (for the library's messages).
DEMO_OPTIONS = {"bits": "--bits", "group_size": "--group-size", "head_dim": "--head-dim", "sink": "--sink",
                "recent": "--recent", "page_size": "--page-size", "num_qo_heads": "--qo-heads",
                "num_kv_heads": "--kv-heads", "seq_len": "--seq-len", "batch": "--batch", "seed": "--seed",
                "quantizer": "--quantizer", "k_axis": "--k-axis", "v_axis": "--v-axis"}


# --------------------------------------------------------------------------------------------
# foscar demo
# --------------------------------------------------------------------------------------------
def _add_demo(sub) -> None:
    p = sub.add_parser(
        "demo", help="quantize the synthetic stress input to INT2/INT4 and report bytes, errors and times",
        description="Build the paper's synthetic stress input (Sec. 6.2: eight amplified K channels, a per-token "
                    "K scale ramp, unit-std logits) in BF16, quantize it, decode it on the best backend "
                    "available and compare with exact attention.")
    p.add_argument("--bits", type=int, nargs="+", choices=SUPPORTED_BITS, default=[2, 4],
                   help="code widths to run (default: 2 4)")
    p.add_argument("--k-axis", choices=AXES, default="token", help="K quantization axis (default: token)")
    p.add_argument("--v-axis", choices=AXES, default="token", help="V quantization axis (default: token)")
    p.add_argument("--group-size", type=_positive_int, default=128,
                   help="values per (s, z) group: 32, 64, 128 or the head dim (token-wise), up to 256 tokens "
                        "(channel-wise) (default: 128)")
    p.add_argument("--quantizer", choices=QUANTIZERS, default="minmax",
                   help="range of each group: min-max, MSE-clipped or quantile-clipped (default: minmax)")
    p.add_argument("--sink", type=_nonnegative_int, default=0, help="leading tokens kept in BF16 (default: 0)")
    p.add_argument("--recent", type=_nonnegative_int, default=0, help="trailing tokens kept in BF16 (default: 0)")
    p.add_argument("--page-size", type=_positive_int, default=None,
                   help="tokens per page of a paged cache (default: a contiguous cache)")
    p.add_argument("--batch", type=_positive_int, default=1, help="sequences (default: 1)")
    p.add_argument("--seq-len", type=int_in(2), default=4096, help="tokens per sequence, at least 2 (default: 4096)")
    p.add_argument("--qo-heads", type=_positive_int, default=32, help="query heads (default: 32)")
    p.add_argument("--kv-heads", type=_positive_int, default=8, help="KV heads (default: 8)")
    p.add_argument("--head-dim", type=int, choices=SUPPORTED_HEAD_DIMS, default=128,
                   help="head dimension (default: 128)")
    p.add_argument("--seed", type=parse_seed, default=0, help="seed of the synthetic input (default: 0)")
    p.add_argument("--threads", type=int_in(0, MAX_THREADS), default=1,
                   help=f"torch CPU threads, 0 for torch's default, at most {MAX_THREADS} (4x the CPUs) (default: 1: "
                        "the reference decode is a loop of small ops, which more threads slow down, by up to 100x on "
                        "a busy CPU)")
    p.add_argument("--json", metavar="PATH", type=writable_file, default=None,
                   help="also write the numbers to PATH as JSON (its folder must exist)")
    p.set_defaults(func=_demo)


def _demo(args: argparse.Namespace) -> int:
    threads = torch.get_num_threads()
    if args.threads:
        torch.set_num_threads(args.threads)
    try:
        return _run_demo(args)
    finally:
        torch.set_num_threads(threads)  # main() may be called in-process (tests): leave torch as it was


def _run_demo(args: argparse.Namespace) -> int:
    bits_list = list(dict.fromkeys(args.bits))  # de-duplicated, in the given order
    D = args.head_dim
    formats = [KVFormat(b, D, args.group_size, args.k_axis, args.v_axis, sink=args.sink, recent=args.recent)
               for b in bits_list]  # every format, and the page size for each, checked before any work
    if args.page_size is not None:
        for fmt in formats:
            fmt.check_page_size(args.page_size)
    backend = _select_backend()
    q, k, v = stress_inputs(args.batch, args.qo_heads, args.kv_heads, args.seq_len, D, seed=args.seed,
                            dtype=torch.bfloat16, device=backend.device)
    n_sink, n_quant, n_recent = formats[0].split_length(args.seq_len)  # the same for every width

    named = [(f"INT{fmt.bits} {args.quantizer}", fmt, args.quantizer) for fmt in formats]
    rows = error_rows(q, k, v, named, backend.decode, backend.name, page_size=args.page_size)
    for row in rows:
        row.pop("name")

    config = {"batch": args.batch, "seq_len": args.seq_len, "num_qo_heads": args.qo_heads,
              "num_kv_heads": args.kv_heads, "head_dim": D, "seed": args.seed, "input_dtype": "bfloat16",
              "k_axis": args.k_axis, "v_axis": args.v_axis, "group_size": args.group_size,
              "quantizer": args.quantizer, "sink": args.sink, "recent": args.recent, "page_size": args.page_size,
              "threads": torch.get_num_threads(), "quantized_tokens": n_quant, "window_tokens": n_sink + n_recent}
    _print_demo(backend, config, rows)
    if args.json:
        doc = {"command": "demo", "backend": backend.name, "backend_description": backend.description,
               "device": str(backend.device), "config": config, "results": rows}
        with open(args.json, "w") as f:  # checked for writing while the options were parsed
            json.dump(doc, f, indent=2)
            f.write("\n")
        print(f"wrote {args.json}")
    return 0


def _print_demo(backend: Backend, config: dict, rows: list[dict]) -> None:
    c = config
    print(f"backend: {backend.description}")
    if backend.note:
        print(f"note: {backend.note}")
    print(f"input:   synthetic stress (paper Sec. 6.2), BF16, batch {c['batch']}, {c['seq_len']} tokens, "
          f"{c['num_qo_heads']} query / {c['num_kv_heads']} KV heads, head dim {c['head_dim']}, seed {c['seed']}")
    paging = "contiguous" if c["page_size"] is None else f"pages of {c['page_size']}"
    print(f"cache:   K {c['k_axis']}-wise, V {c['v_axis']}-wise, g={c['group_size']}, quantizer {c['quantizer']}, "
          f"sink {c['sink']}, recent {c['recent']}, {paging}; {c['threads']} CPU thread(s)")
    if c["window_tokens"]:
        print(f"windows: {c['window_tokens']} of the {c['seq_len']} tokens of each sequence stay BF16"
              + (f", {c['quantized_tokens']} are quantized" if c["quantized_tokens"] else ": nothing is quantized"))
    print()
    cols = [("format", 6, "{}"), ("backend", 16, "{}"), ("B/tok/head", 10, "{:.1f}"), ("BF16 B", 6, "{:.0f}"),
            ("ratio", 6, "{:.2f}x"), ("err unquant", 11, "{:.3e}"), ("err dequant", 11, "{:.3e}"),
            ("bf16 err deq", 12, "{:.3e}"), ("quant ms", 9, "{:.1f}"), ("decode ms", 9, "{:.1f}")]
    keys = ["format", "backend", "bytes_per_token", "bf16_bytes_per_token", "compression", "err_vs_unquantized",
            "err_vs_dequantized", "bf16_err_vs_dequantized", "quantize_ms", "decode_ms"]
    print("  ".join(f"{name:>{w}}" if i > 1 else f"{name:<{w}}" for i, (name, w, _) in enumerate(cols)))
    print("  ".join("-" * w for _, w, _ in cols))
    for row in rows:
        cells = []
        for i, ((_, w, fmt), key) in enumerate(zip(cols, keys)):
            val = row[key]
            text = "-" if val is None else fmt.format(val)
            cells.append(f"{text:>{w}}" if i > 1 else f"{text:<{w}}")
        print("  ".join(cells))
    print()
    print("B/tok/head: bytes the cache holds per token per KV head, K and V: a quantized token its codes + FP32 "
          "s', z', a BF16 window token 2 per value; ratio = BF16 / that.")
    print("err unquant: relative L2 error of the output vs exact (float64) attention over the unquantized cache.")
    print("err dequant: vs exact attention over the dequantized cache (decode_exact): the kernel's arithmetic error "
          "(BF16 operands, FP32 accumulation).")
    print("bf16 err deq: BF16 attention (q, k, v, P in BF16, FP32 accumulation) over the dequantized cache, vs the "
          "same oracle.")
    print("Times are wall-clock of one call (the first includes compilation); on a CUDA GPU, `foscar bench speed` "
          "times the kernels properly.")


# --------------------------------------------------------------------------------------------
# foscar info
# --------------------------------------------------------------------------------------------
def _version(module: str) -> str:
    from importlib import metadata
    for dist in {"cutlass": ("nvidia-cutlass-dsl",)}.get(module, (module,)):
        try:
            return metadata.version(dist)
        except metadata.PackageNotFoundError:
            pass
    return "not installed"


def _info(args: argparse.Namespace) -> int:
    from . import __version__, backend_status
    print(f"foscar {__version__}; python {sys.version.split()[0]}; torch {torch.__version__}; "
          f"triton {_version('triton')}; nvidia-cutlass-dsl {_version('cutlass')}; "
          f"apache-tvm-ffi {_version('apache-tvm-ffi')}")
    if torch.cuda.is_available():
        dev = torch.cuda.current_device()
        cap = torch.cuda.get_device_capability(dev)
        print(f"GPU: {torch.cuda.get_device_name(dev)} (sm_{cap[0]}{cap[1]}), CUDA {torch.version.cuda}")
    else:
        print("GPU: none (CUDA not available)")
    from .api import AUTO_ORDER
    print(f"backends (foscar.decode(..., backend='auto') takes the first usable of {', '.join(AUTO_ORDER)}; "
          "cute for token-wise K, the reference on the CPU only):")
    for s in backend_status():
        print(f"  {s.name:10s} {'usable' if s.usable else 'unavailable':12s} {s.why}")
    from .autotune import shipped_folder, tuning_report
    if torch.cuda.is_available():
        for line in tuning_report(torch.cuda.get_device_name(torch.cuda.current_device())).lines():
            print(line)
    else:
        names = sorted(f.name for f in shipped_folder().iterdir() if f.name.endswith(".json"))
        print(f"tuned configs shipped (package data): {', '.join(names) or 'none'}; none applies without a GPU")
    return 0


def _add_tune(sub) -> None:
    """Listed here for ``foscar --help``; :func:`main` hands ``foscar tune ...`` to :mod:`foscar.tune`."""
    sub.add_parser("tune", help="autotune the decode kernels on this GPU; write the per-GPU config file "
                                "(foscar tune --help)", add_help=False)


def _add_bench(sub) -> None:
    """Listed for ``foscar --help``; :func:`main` hands ``foscar bench ...`` to :mod:`foscar.bench.cli`."""
    sub.add_parser("bench", help="benchmarks: speed (GPU, against BF16 baselines), accuracy (stress input), "
                                 "ops (affine operations per value); foscar bench MODE --help", add_help=False)


def _add_info(sub) -> None:
    p = sub.add_parser("info", help="the GPU, versions, and which decode backends run here (and why not)",
                       description="Print the versions of foscar, Python, torch, Triton, nvidia-cutlass-dsl and "
                                   "apache-tvm-ffi, the GPU, which decode backends can run here (and why the "
                                   "others cannot), and which tuning file and tuned configs apply.")
    p.set_defaults(func=_info)


# --------------------------------------------------------------------------------------------
# Entry point
# --------------------------------------------------------------------------------------------
def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog=PROG, description="FOSCAR: decode attention over 2-/4-bit KV caches.")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    _add_demo(sub)
    _add_info(sub)
    _add_tune(sub)
    _add_bench(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Console entry point (``foscar``); returns the exit status."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["tune"]:  # its own parser (also python -m foscar.tune)
        from .tune import main as tune_main
        return tune_main(argv[1:], prog=f"{PROG} tune")
    if argv[:1] == ["bench"]:  # its modes have their own parsers
        from .bench.cli import main as bench_main
        return bench_main(argv[1:], prog=f"{PROG} bench")
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command is None:
        parser.print_help(sys.stderr)
        return 2
    return run_reporting(lambda: args.func(args), f"{PROG} {args.command}: error:", options=DEMO_OPTIONS,
                         oom_hint="smaller --seq-len, --batch or heads?")

if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
