"""Side by side, from ``foscar.bench.decode`` records: each shape's time per kernel against a base kernel
(default the Triton folded kernel), as a Markdown table, with the range and geomean of each ratio:

    python benchmarks/compare_kernels.py docs/bench/h200/cute-axes.json \
        --kernels foscar_folded foscar_cute foscar_cute_ws

A ratio is base time / kernel time (above 1: the kernel is faster). Rows are keyed by batch, length,
heads, bits and K/V axes; a kernel missing from a row (or failed there) shows ``-``. Two runs of one kernel (two
checkouts, the same grid) side by side: ``--labels`` names each file's run, its kernels then ``KERNEL@LABEL``:

    python benchmarks/compare_kernels.py base/bench_decode.json new/bench_decode.json --labels base new \
        --kernels foscar_auto@base foscar_auto@new
"""
import argparse
import json
from collections import defaultdict
from pathlib import Path

from foscar.bench.decode import fmt_len, geomean

NAMES = {"foscar_folded": "Triton", "foscar_cute": "CuTe v0", "foscar_cute_ws": "CuTe v1", "foscar_auto": "auto"}


def _cell(r: dict) -> str:
    return f"{r['median_us']:.1f} ({100 * r['ceiling_frac']:.0f}%)"


def table(records: list[dict], kernels: list[str]) -> tuple[list[str], dict]:
    rows = defaultdict(dict)
    for r in records:
        if r.get("status") == "ok" and r["kernel"] in kernels:
            key = (r["Hq"] // r["Hkv"], r["k_axis"], r["v_axis"], r["bits"], r["B"], r["L"])
            rows[key][r["kernel"]] = r
    base, others = kernels[0], kernels[1:]
    head = ["GQA", "K/V", "bits", "B", "L", f"{NAMES.get(base, base)} µs (% ceil)"]
    head += [f"{NAMES.get(k, k)} µs (% ceil), speedup" for k in others]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    ratios = defaultdict(list)
    for key in sorted(rows):
        gqa, ka, va, bits, B, L = key
        got = rows[key]
        cells = [str(gqa), f"{ka[:3]}/{va[:3]}", f"INT{bits}", str(B), fmt_len(L),
                 _cell(got[base]) if base in got else "-"]
        for k in others:
            if k in got and base in got:
                ratio = got[base]["median_us"] / got[k]["median_us"]
                ratios[(k, bits)].append(ratio)
                cells.append(f"{_cell(got[k])}, {ratio:.2f}x")
            else:
                cells.append("-")
        lines.append("| " + " | ".join(cells) + " |")
    return lines, ratios


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("records", nargs="+", help="bench_decode.json files")
    p.add_argument("--kernels", nargs="+", default=["foscar_folded", "foscar_cute", "foscar_cute_ws"],
                   help="the base kernel first, then the kernels compared with it")
    p.add_argument("--labels", nargs="+", help="one per record file: its kernels become KERNEL@LABEL")
    a = p.parse_args()
    if a.labels is not None and len(a.labels) != len(a.records):
        p.error(f"--labels: expected one label per record file ({len(a.records)}), got {len(a.labels)}")
    records = []
    for i, path in enumerate(a.records):
        for r in json.loads(Path(path).read_text())["records"]:
            records.append({**r, "kernel": f"{r['kernel']}@{a.labels[i]}"} if a.labels else r)
    lines, ratios = table(records, a.kernels)
    print("\n".join(lines))
    print()
    for (k, bits), rs in sorted(ratios.items()):
        print(f"{NAMES.get(k, k)} INT{bits}: {min(rs):.2f}-{max(rs):.2f}x, geomean {geomean(rs):.2f}x "
              f"over {len(rs)} shapes")


if __name__ == "__main__":
    main()
