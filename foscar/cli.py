"""The ``foscar`` command line.

Subcommands:

``foscar demo``
    Quantize the paper's synthetic stress input (Sec. 6.2, :func:`foscar.synthetic.stress_inputs`)
    to INT2 and INT4, decode it on the best backend available, and print a table of bytes read per
    token, output errors and times (``--json PATH`` also writes the numbers).

Backends (:func:`_select_backend`): what ``foscar.decode(backend="auto")`` picks: the Triton kernels on a
CUDA GPU, the PyTorch reference (:func:`foscar.decode_folded`) on the CPU.
"""
from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from .errors import FoscarError
from .format import AXES, SUPPORTED_BITS, KVFormat
from .quantize import QUANTIZERS
from .bench.accuracy import error_rows
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
def _int_at_least(minimum: int):
    """An argparse type: an integer >= ``minimum``."""
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected an integer >= {minimum}, got {text!r}") from None
        if value < minimum:
            raise argparse.ArgumentTypeError(f"expected an integer >= {minimum}, got {value}")
        return value
    return parse


_positive_int = _int_at_least(1)
_nonnegative_int = _int_at_least(0)


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
    p.add_argument("--group-size", type=_positive_int, default=128, help="values per (s, z) group (default: 128)")
    p.add_argument("--quantizer", choices=QUANTIZERS, default="minmax",
                   help="range of each group: min-max, MSE-clipped or quantile-clipped (default: minmax)")
    p.add_argument("--sink", type=_nonnegative_int, default=0, help="leading tokens kept in BF16 (default: 0)")
    p.add_argument("--recent", type=_nonnegative_int, default=0, help="trailing tokens kept in BF16 (default: 0)")
    p.add_argument("--page-size", type=_positive_int, default=None,
                   help="tokens per page of a paged cache (default: a contiguous cache)")
    p.add_argument("--batch", type=_positive_int, default=1, help="sequences (default: 1)")
    p.add_argument("--seq-len", type=_positive_int, default=4096, help="tokens per sequence (default: 4096)")
    p.add_argument("--qo-heads", type=_positive_int, default=32, help="query heads (default: 32)")
    p.add_argument("--kv-heads", type=_positive_int, default=8, help="KV heads (default: 8)")
    p.add_argument("--head-dim", type=_positive_int, default=128, help="head dimension (default: 128)")
    p.add_argument("--seed", type=int, default=0, help="seed of the synthetic input (default: 0)")
    p.add_argument("--threads", type=_nonnegative_int, default=1,
                   help="torch CPU threads, 0 for torch's default (default: 1: the reference decode is a loop of "
                        "small ops, which more threads slow down, by up to 100x on a busy CPU)")
    p.add_argument("--json", metavar="PATH", default=None, help="also write the numbers to PATH as JSON")
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
    backend = _select_backend()
    bits_list = list(dict.fromkeys(args.bits))  # de-duplicated, in the given order
    D = args.head_dim
    q, k, v = stress_inputs(args.batch, args.qo_heads, args.kv_heads, args.seq_len, D, seed=args.seed,
                            dtype=torch.bfloat16, device=backend.device)
    formats = [KVFormat(b, D, args.group_size, args.k_axis, args.v_axis, sink=args.sink, recent=args.recent)
               for b in bits_list]  # validate every format before the slow part

    named = [(f"INT{fmt.bits} {args.quantizer}", fmt, args.quantizer) for fmt in formats]
    rows = error_rows(q, k, v, named, backend.decode, backend.name, page_size=args.page_size)
    for row in rows:
        row.pop("name")

    config = {"batch": args.batch, "seq_len": args.seq_len, "num_qo_heads": args.qo_heads,
              "num_kv_heads": args.kv_heads, "head_dim": D, "seed": args.seed, "input_dtype": "bfloat16",
              "k_axis": args.k_axis, "v_axis": args.v_axis, "group_size": args.group_size,
              "quantizer": args.quantizer, "sink": args.sink, "recent": args.recent, "page_size": args.page_size,
              "threads": torch.get_num_threads()}
    _print_demo(backend, config, rows)
    if args.json:
        doc = {"command": "demo", "backend": backend.name, "backend_description": backend.description,
               "device": str(backend.device), "config": config, "results": rows}
        with open(args.json, "w") as f:
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
    print("B/tok/head: HBM bytes per quantized token per KV head, K and V (codes + FP32 s', z'); ratio = BF16 / that.")
    print("err unquant: relative L2 error of the output vs exact (float64) attention over the unquantized cache.")
    print("err dequant: vs exact attention over the dequantized cache (decode_exact): the kernel's arithmetic error "
          "(BF16 operands, FP32 accumulation).")
    print("bf16 err deq: BF16 attention (q, k, v, P in BF16, FP32 accumulation) over the dequantized cache, vs the "
          "same oracle.")
    print("Times are wall-clock of one call (the first includes compilation); benchmarks/bench_decode.py times "
          "kernels properly.")


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
    p = sub.add_parser("info", help="the GPU, versions, and which decode backends run here (and why not)")
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
    try:
        return args.func(args)
    except FoscarError as e:  # a bad combination of options, named by the library
        print(f"{PROG} {args.command}: error: {e}", file=sys.stderr)
        return 2
    except OSError as e:  # e.g. --json PATH not writable
        print(f"{PROG} {args.command}: error: {e}", file=sys.stderr)
        return 1


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
