"""``foscar bench``: ``speed`` (the decode benchmark against the BF16 baselines, GPU), ``accuracy`` (the
synthetic stress study, any device), ``ops`` (affine operations per stored value) and ``plot`` (the
speed records as the paper's figures). Each writes JSON and
Markdown under ``--out`` and, with matplotlib installed, a plot; a missing plotting library is reported,
not skipped silently."""
from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from pathlib import Path

import torch

from ..progress import Progress

USAGE = "foscar bench {speed,accuracy,ops,plot} [options]   (foscar bench MODE --help)"


def _write(out: Path, stem: str, doc, md: str, draw, rows: list[dict] | None = None) -> int:
    """``<out>/<stem>.json``, ``.md``, ``.csv`` (``rows``, when given) and (``draw(path)``, when matplotlib
    is there) ``.png``; the table and what was written (or which plot is missing, and why) on stdout."""
    from .common import to_csv
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{stem}.json").write_text(json.dumps(doc, indent=1) + "\n")
    (out / f"{stem}.md").write_text(md + "\n")
    written = [out / f"{stem}.json", out / f"{stem}.md"]
    if rows:
        (out / f"{stem}.csv").write_text(to_csv(rows, list(dict.fromkeys(k for r in rows for k in r))))
        written.append(out / f"{stem}.csv")
    drew = draw(out / f"{stem}.png")
    print(md)
    print("\nwrote " + ", ".join(map(str, written))
          + (f", {out / f'{stem}.png'}" if drew else "; plot missing: matplotlib is not installed"))
    return 0


def _accuracy(argv: list[str], prog: str) -> int:
    from . import accuracy as acc
    p = argparse.ArgumentParser(prog=f"{prog} accuracy", description=acc.__doc__.splitlines()[0])
    p.add_argument("--lengths", type=int, nargs="+", default=[1024, 4096, 16384])
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    p.add_argument("--backend", default="auto", help="the decode backend of foscar.decode (default: auto)")
    p.add_argument("--heads", default="32:8", help="Hq:Hkv")
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--group-size", type=int, default=128)
    p.add_argument("--out", type=Path, default=Path("."))
    a = p.parse_args(argv)
    import foscar
    hq, hkv = (int(x) for x in a.heads.split(":"))
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")

    def decode(q, cache):
        out = torch.empty(q.shape, dtype=torch.float32, device=q.device)
        foscar.decode(q, cache, out=out, backend=a.backend)
        return out
    bar = Progress(len(a.lengths) * len(a.seeds))
    records = acc.study(a.lengths, a.seeds, decode=decode, backend=a.backend, device=device, q_heads=hq,
                        kv_heads=hkv, head_dim=a.head_dim, group_size=a.group_size, progress=bar.step)
    summ = acc.summary(records)
    return _write(a.out, "accuracy", {"command": f"{prog} accuracy " + " ".join(argv), "device": str(device),
                                      "records": records}, acc.render_markdown(summ), lambda p: acc.plot(summ, p),
                  rows=records)


def _ops(argv: list[str], prog: str) -> int:
    from . import ops
    p = argparse.ArgumentParser(prog=f"{prog} ops", description=ops.__doc__.splitlines()[0])
    p.add_argument("--out", type=Path, default=Path("."))
    a = p.parse_args(argv)
    rows = ops.table()
    return _write(a.out, "ops", rows, ops.render_markdown(rows), lambda p: ops.plot(rows, p), rows=rows)


def _plot(argv: list[str], prog: str) -> int:
    from . import plots
    p = argparse.ArgumentParser(prog=f"{prog} plot", description=plots.__doc__.splitlines()[0])
    p.add_argument("json", type=Path, nargs="+", help="bench_decode.json files (records of one or more runs)")
    p.add_argument("--out", type=Path, default=Path("."))
    p.add_argument("--name", default="bench", help="file name stem of the plots")
    a = p.parse_args(argv)
    records = plots.load_records(a.json)
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
    if not argv or argv[0] in ("-h", "--help") or argv[0] not in MODES:
        print(f"usage: {USAGE}\n\n{__doc__}", file=sys.stderr if argv[:1] not in (["-h"], ["--help"]) else sys.stdout)
        return 0 if argv[:1] in (["-h"], ["--help"]) else 2
    return MODES[argv[0]](argv[1:], prog)


if __name__ == "__main__":
    sys.exit(main(prog="python -m foscar.bench.cli"))
