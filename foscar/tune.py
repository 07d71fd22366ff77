"""``foscar tune`` (also ``python -m foscar.tune``): autotune the decode kernels on this GPU and write the
per-GPU config file the launchers read (:mod:`foscar.autotune`).

For every case (a shape from ``--shapes`` or a ``--preset``, times the formats of ``--bits``,
``--k-axis``, ``--v-axis`` and the step lengths of ``--q-len``: 1 a decode, more a step of speculative
verification, its tokens causal among themselves), on a random packed cache of that size:

1. every candidate launch config is run once into a NaN-poisoned output, and the output checked
   (:func:`foscar.bench.measure.measure`, the driver the decode benchmark and the launch sweeps share):
   every value finite, and on one (sequence, KV head) slice an error against the float64 oracle (a step's
   tokens each under its causal limit) within 3x BF16 attention's on the same slice. A candidate that fails is
   reported and never timed;
2. the others are timed as CUDA-graph replays, the L2 flushed before each, CUDA events, median of
   ``--iters`` after ``--warmup``; the heuristic config is one of the candidates;
3. the fastest is recorded with its time and the heuristic's.

Progress goes to stderr, a table to stdout, and the entries are merged atomically into
``<out>/<GPU>.json`` (``--out``, default ``$FOSCAR_TUNING_DIR`` or the user cache folder).
``--dry-run`` lists the cases and candidates without a GPU.
"""
from __future__ import annotations

import argparse
import itertools
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from . import autotune, backends
from .progress import Progress
from .bench.common import (L2_FLUSH_BYTES, first_line, int_in, library_option, make_block_table, parse_heads,
                           parse_tokens, random_cache, writable_dir)
from .bench.measure import SLICE_FACTOR, measure, slice_check, time_run
from .errors import FoscarError
from .format import AXES, SUPPORTED_BITS, SUPPORTED_HEAD_DIMS, KVFormat

KI = 1024
PRESETS = {
    "paper": tuple([(b, n * KI) for b in (1, 8) for n in (8, 32, 128, 512)] + [(64, n * KI) for n in (8, 16, 32, 64, 128)]),
    "quick": ((1, 8 * KI), (8, 32 * KI)),
}
CHECK_FACTOR = SLICE_FACTOR  # a candidate's slice error may be at most this times BF16 attention's
DEVICE = "cuda"
MAX_Q_LEN = 8  # the longest step tuned: speculative verification of up to 8 draft tokens


@dataclass(frozen=True)
class Case:
    batch: int
    seq_len: int
    fmt: KVFormat
    q_heads: int
    kv_heads: int
    page: int
    q_len: int = 1  # query tokens per sequence: a step of speculative verification where more than 1

    def label(self) -> str:
        f = self.fmt
        n = self.seq_len
        length = f"{n // KI}K" if n % KI == 0 else str(n)
        step = f" q_len={self.q_len}" if self.q_len > 1 else ""
        return (f"B={self.batch} L={length} INT{f.bits} {f.k_axis[:3]}/{f.v_axis[:3]} g={f.group_size} "
                f"D={f.head_dim} {self.q_heads}/{self.kv_heads}{step}")


def parse_shape(text: str) -> tuple[int, int]:
    """An argparse type: ``"B:L"``, ``L`` in tokens, possibly ending in K or M (``"8:128K"``)."""
    try:
        b, n = text.split(":")
        shape = (int(b), parse_tokens(n))
    except ValueError:
        raise argparse.ArgumentTypeError(f"shape {text!r}: expected B:L, e.g. 8:128K") from None
    if shape[0] < 1 or shape[1] < 1:
        raise argparse.ArgumentTypeError(f"shape {text!r}: B and L must be >= 1")
    return shape


DESCRIPTION = ("Autotune the decode kernels on this GPU and write the per-GPU config file that foscar.decode "
               "reads. Every candidate launch config is checked against the float64 oracle before it is timed, "
               "and the fastest per shape family is merged into <out>/<GPU>.json. --dry-run lists the cases and "
               "candidates without a GPU.")
#: The option each library argument name comes from (for the library's messages about a format).
LIBRARY_OPTIONS = {"group_size": "--group-size", "head_dim": "--head-dim", "page_size": "--page-size"}


def build_parser(prog: str = "foscar tune") -> argparse.ArgumentParser:
    """The options, each checked by its argparse type while the arguments are parsed; :func:`checked_cases`
    checks the formats they make together."""
    p = argparse.ArgumentParser(prog=prog, description=DESCRIPTION)
    p.add_argument("--preset", choices=sorted(PRESETS), default="paper",
                   help="the shapes: paper, the paper's 13; quick, 2 (default: paper)")
    p.add_argument("--shapes", type=parse_shape, nargs="+", metavar="B:L",
                   help="shapes instead of the preset, L in tokens, possibly ending in K or M, e.g. 8:128K")
    p.add_argument("--bits", type=int, nargs="+", choices=SUPPORTED_BITS, default=[2, 4],
                   help="code widths to tune (default: 2 4)")
    p.add_argument("--k-axis", nargs="+", choices=AXES, default=["token"],
                   help="K quantization axes to tune (default: token)")
    p.add_argument("--v-axis", nargs="+", choices=AXES, default=["token"],
                   help="V quantization axes to tune (default: token)")
    p.add_argument("--group-size", type=int_in(1), default=128,
                   help="values per (s, z) group: 32, 64, 128 or the head dim (token-wise), up to 256 tokens "
                        "(channel-wise) (default: 128)")
    p.add_argument("--head-dim", type=int, choices=SUPPORTED_HEAD_DIMS, default=128,
                   help="head dimension (default: 128)")
    p.add_argument("--heads", type=parse_heads, default="32:8", metavar="HQ:HKV",
                   help="query and KV heads, Hq a positive multiple of Hkv (default: 32:8)")
    p.add_argument("--page-size", type=int_in(1), default=64, help="tokens per page of the paged cache (default: 64)")
    p.add_argument("--q-len", type=int_in(1, MAX_Q_LEN), nargs="+", default=[1], metavar="T",
                   help=f"query tokens per sequence, 1 to {MAX_Q_LEN}: 1 a decode, more a step of speculative "
                        "verification (entries keyed by it, read by foscar.decode and foscar.plan for steps of that "
                        "length) (default: 1)"),
    p.add_argument("--backend", choices=backends.TUNABLE, default="triton",
                   help="the kernels to tune (cute: the CuTe DSL Hopper kernels, v0 and v1; needs foscar[cute]) "
                        "(default: triton)")
    p.add_argument("--iters", type=int_in(1), default=10, help="timed replays per candidate, the median (default: 10)")
    p.add_argument("--warmup", type=int_in(0), default=3, help="untimed replays per candidate first (default: 3)")
    p.add_argument("--out", type=writable_dir, default=None, metavar="DIR",
                   help="folder of the per-GPU file, made if missing (default: $FOSCAR_TUNING_DIR, else the user "
                        "cache folder)")
    p.add_argument("--dry-run", action="store_true", help="list cases and candidates; needs no GPU")
    return p


def cases(args) -> list[Case]:
    shapes = args.shapes or PRESETS[args.preset]
    hq, hkv = args.heads
    out = []
    for (b, n), bits, ka, va, t in itertools.product(shapes, args.bits, args.k_axis, args.v_axis, args.q_len):
        fmt = KVFormat(bits=bits, head_dim=args.head_dim, group_size=args.group_size, k_axis=ka, v_axis=va)
        quantum = max(args.page_size, args.group_size if "channel" in (ka, va) else 1)
        length = max(-(-n // quantum) * quantum, quantum * -(-t // quantum))  # whole pages and groups; >= q_len
        out.append(Case(b, length, fmt, hq, hkv, args.page_size, t))
    return out


def candidates(case: Case, device: torch.device, backend: str = "triton") -> list[dict]:
    """The launch configs ``backend`` lists for ``case`` (:meth:`foscar.backends.Backend.candidates`); the
    first is the launcher's own choice (the heuristic)."""
    return backends.get(backend).candidates(case, device)


# --------------------------------------------------------------------------------------------
# Running (module-level hooks, so tests can stand in for the GPU)
# --------------------------------------------------------------------------------------------
def _decode(q, cache, config, backend, out):
    """One decode with launch ``config`` into ``out`` (``backend``'s ``launch``); returns the output."""
    return backends.get(backend).launch(q, cache, {**config, "out": out})


def _time(run, *, iters, warmup, flush, cuda_graph) -> dict:
    """The timer :func:`foscar.bench.measure.measure` calls (:func:`foscar.bench.measure.time_run`)."""
    return time_run(run, iters=iters, warmup=warmup, flush=flush, cuda_graph=cuda_graph)


def tune_case(case: Case, args, flush, progress) -> dict:
    """Every candidate of ``case`` through :func:`foscar.bench.measure.measure`: run once into a NaN-poisoned
    output, held to the slice check (every output finite; the last sequence's last KV head within
    :data:`CHECK_FACTOR` x BF16 attention's error against the float64 oracle), and only then timed as
    CUDA-graph replays. The fastest that passed, and the heuristic's time (the first candidate)."""
    table = make_block_table(case.batch, case.seq_len // case.page, "shuffled", 0).to(DEVICE)
    cache = random_cache(case.fmt, table, case.seq_len, kv_heads=case.kv_heads, page=case.page)
    step = (case.q_len,) if case.q_len > 1 else ()
    q = torch.randn(case.batch, *step, case.q_heads, case.fmt.head_dim, dtype=torch.bfloat16, device=DEVICE)
    check = slice_check(q, cache, CHECK_FACTOR)
    results = []
    cands = candidates(case, torch.device(DEVICE), args.backend)
    for i, cfg in enumerate(cands):
        out = torch.full_like(q, float("nan"))
        got = measure(lambda cfg=cfg, out=out: _decode(q, cache, cfg, args.backend, out), check, iters=args.iters,
                      warmup=args.warmup, flush=flush, cuda_graph=True, timer=_time)
        status = got["status"]
        if status == "ok":
            us = got["median_us"]
            results.append({"config": cfg, "us": us, "err": got["err"]})
            progress(f"  [{i + 1}/{len(cands)}] {cfg}: {us:.1f} us")
        elif status.startswith("wrong"):
            progress(f"  {cfg}: wrong output ({status.removeprefix('wrong: ')}); not timed")
            results.append({"config": cfg, "us": None, "err": got.get("err")})
        else:  # a config that does not compile, launch or capture is reported, not fatal
            why = status.split(": ", 2)[-1]
            progress(f"  {cfg}: failed ({why[:160]}); not timed")
            results.append({"config": cfg, "us": None, "err": got.get("err"), "error": why})
    timed = [r for r in results if r["us"] is not None]
    if not timed:
        raise FoscarError(f"{case.label()}: no candidate passed its check")
    return {"case": case, "best": min(timed, key=lambda r: r["us"]), "results": results,
            "heuristic_us": results[0]["us"]}  # the first candidate is the launcher's own choice (None: it failed)


def checked_cases(parser: argparse.ArgumentParser, args) -> list[Case]:
    """:func:`cases`, each format and its page size checked, and each step one the backend tunes; a bad one is
    refused by ``parser`` (exit 2), naming the option."""
    try:
        todo = cases(args)
        for case in todo:
            case.fmt.check_page_size(args.page_size)
            if case.q_len > 1:
                why = backends.get(args.backend).tunes_step(case.fmt, case.q_heads // case.kv_heads, case.q_len)
                if why:
                    parser.error(f"argument --q-len: {case.q_len} with --backend {args.backend} at {case.label()}: "
                                 f"{why}")
    except FoscarError as e:
        option = library_option(e, LIBRARY_OPTIONS)
        parser.error(f"argument {option}: {first_line(e)}" if option else first_line(e))
    return todo


def main(argv: Sequence[str] | None = None, prog: str = "foscar tune") -> int:
    """``prog`` is how it was invoked (its usage and error lines). A bad option, or a run that ends in a
    library error, is one line on stderr and exit status 2."""
    parser = build_parser(prog)
    args = parser.parse_args(argv)
    todo = checked_cases(parser, args)
    try:
        return _run(args, todo, prog)
    except FoscarError as e:
        print(f"{prog}: error: {first_line(e)}", file=sys.stderr)
        return 2


def _run(args, todo: list[Case], prog: str) -> int:
    """The dry run's listing, or each case tuned and the entries merged into the per-GPU file."""
    if args.dry_run:
        print("(split counts follow the present GPU's SM count; 4 SMs are assumed without a GPU)")
        for case in todo:
            print(case.label())
            for cfg in candidates(case, torch.device(DEVICE if torch.cuda.is_available() else "cpu"), args.backend):
                print(f"  {cfg}")
        return 0
    if DEVICE == "cuda" and not torch.cuda.is_available():
        print(f"{prog}: error: needs a CUDA GPU (none here); --dry-run lists what it would tune", file=sys.stderr)
        return 2
    gpu = torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"
    out_dir = args.out or autotune.user_dir()
    flush = torch.empty(L2_FLUSH_BYTES if DEVICE == "cuda" else 1, dtype=torch.uint8, device=DEVICE)
    rows, entries = [], []
    t0 = time.perf_counter()
    bar = Progress(len(todo))
    for i, case in enumerate(todo):
        print(f"[{i + 1}/{len(todo)}] {case.label()} ({time.perf_counter() - t0:.0f} s)", file=sys.stderr, flush=True)
        rec = tune_case(case, args, flush, lambda msg: print(msg, file=sys.stderr, flush=True))
        bar.step(f"{case.label()}: best {rec['best']['us']:.1f} us")
        best, heur = rec["best"], rec["heuristic_us"]
        key = autotune.make_key(args.backend, gpu, case.fmt, case.q_heads // case.kv_heads, case.page, case.batch,
                                case.seq_len, case.q_len)
        entries.append((key, best["config"], {"us": best["us"], "heuristic_us": heur,
                                              "candidates": len(rec["results"])}))
        rows.append((case.label(), best["config"], best["us"], heur))
    path = autotune.write_entries(out_dir, gpu, entries)
    print("| case | best config | best µs | heuristic µs | gain |")
    print("|---|---|---|---|---|")
    for label, cfg, us, heur in rows:
        gain = f"{heur / us:.2f}x" if heur else "-"
        print(f"| {label} | {cfg} | {us:.1f} | {heur:.1f} | {gain} |" if heur else f"| {label} | {cfg} | {us:.1f} | - | - |")
    print(f"\nwrote {len(entries)} entries to {path}")
    return 0


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main(prog="python -m foscar.tune"))
