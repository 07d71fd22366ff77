"""The decode benchmark's report, from its records (lists of dicts; pure apart from :func:`write_outputs`):
derived rates and speedups (:func:`annotate`), the bars (:func:`evaluate_bars`), the Markdown tables,
the failures that make a run exit 1, and the JSON, Markdown and CSV files."""
from __future__ import annotations

import json
import math
import os
from pathlib import Path

from .common import to_csv
from .grid import AXIS_COMBOS, HEAD_DIM, HKV, HQ, KI, PAPER_SHAPES, TOKEN, bytes_read, fmt_len

BASELINE = "flashinfer_tc"
READ_BARS = {4: 0.40, 2: 0.25}  # fraction of the read ceiling, B in {8, 64}, L >= 32K
GEOMEAN_BARS = {4: 1.4, 2: 1.6}  # geomean speedup over FlashInfer BF16 (tensor cores), paper grid
FOLD_VS_RECON_BAR = (8, 128 * KI, 2, 1.1)  # B, L, bits, min reconstruct_us / folded_us


def geomean(values: list[float]) -> float | None:
    if not values:
        return None
    if any(v <= 0 or not math.isfinite(v) for v in values):
        raise ValueError(f"geomean of non-positive or non-finite values: {values}")
    return math.exp(sum(math.log(v) for v in values) / len(values))


def annotate(records: list[dict], ceiling_tbps: float | None) -> None:
    """Add bytes, TB/s, fraction of the read ceiling and speedup over the baseline to timed records (the
    bytes from each record's ``Hq``, ``Hkv`` and ``D``, the defaults where a record has none)."""
    base = {(r["B"], r["L"]): r["median_us"] for r in records if r["kernel"] == BASELINE and r["status"] == "ok"}
    kbase = {(r["B"], r["L"]): r.get("kernel_us") for r in records if r["kernel"] == BASELINE and r["status"] == "ok"}
    for r in records:
        kb, kus = kbase.get((r["B"], r["L"])), r.get("kernel_us")
        r["kernel_speedup_vs_baseline"] = kb / kus if kb and kus else None
        r["bytes"] = bytes_read(r["B"], r["L"], r["bits"], r.get("Hq", HQ), r.get("Hkv", HKV), r.get("D", HEAD_DIM))
        us = r.get("median_us")
        timed = us is not None
        r["tbps"] = r["bytes"] / (us * 1e-6) / 1e12 if timed else None
        r["ceiling_frac"] = r["tbps"] / ceiling_tbps if timed and ceiling_tbps else None
        b = base.get((r["B"], r["L"]))
        r["speedup_vs_baseline"] = b / us if timed and b else None


def _select(records, kernel, bits=None, shapes=None, axes=(TOKEN, TOKEN)):
    return [r for r in records if r["kernel"] == kernel and r["status"] == "ok"
            and (bits is None or r["bits"] == bits)
            and (r["bits"] == 16 or (r["k_axis"], r["v_axis"]) == axes)
            and (shapes is None or (r["B"], r["L"]) in shapes)]


def geomean_speedup(records: list[dict], kernel: str, bits: int | None,
                    key: str = "speedup_vs_baseline") -> tuple[float | None, int]:
    """Geomean speedup over the baseline across the paper shapes measured; (value, shapes counted).
    ``key="kernel_speedup_vs_baseline"``: by profiled kernel time instead of event time."""
    rows = [r for r in _select(records, kernel, bits, PAPER_SHAPES) if r.get(key)]
    return geomean([r[key] for r in rows]), len(rows)


def _bar(name, target, value, ok, have, expected, worst=""):
    verdict = "n/a" if have == 0 else ("PASS" if ok else "FAIL")
    return {"bar": name, "target": target, "value": value, "verdict": verdict,
            "shapes": f"{have}/{expected}", "complete": have == expected, "detail": worst}


def evaluate_bars(records: list[dict]) -> list[dict]:
    """The bars, over foscar_folded with token-wise K and V (partial grids say k/n shapes)."""
    bars = []
    for bits, target in sorted(READ_BARS.items(), reverse=True):
        shapes = [(b, n) for b, n in PAPER_SHAPES if b in (8, 64) and n >= 32 * KI]
        rows = [r for r in _select(records, "foscar_folded", bits, shapes) if r.get("ceiling_frac") is not None]
        worst = min(rows, key=lambda r: r["ceiling_frac"], default=None)
        value = worst["ceiling_frac"] if worst else None
        bars.append(_bar(f"INT{bits} read fraction, B in {{8, 64}}, L >= 32K (min)", f">= {target:.0%}", value,
                         worst is not None and value >= target, len(rows), len(shapes),
                         f"worst B={worst['B']} L={fmt_len(worst['L'])}" if worst else ""))
    for bits, target in sorted(GEOMEAN_BARS.items(), reverse=True):
        g, n = geomean_speedup(records, "foscar_folded", bits)
        bars.append(_bar(f"INT{bits} geomean speedup over FlashInfer BF16 (paper grid)", f">= {target}x", g,
                         g is not None and g >= target, n, len(PAPER_SHAPES)))
    b, n, bits, target = FOLD_VS_RECON_BAR
    fold = _select(records, "foscar_folded", bits, [(b, n)])
    recon = _select(records, "foscar_reconstruct", bits, [(b, n)])
    ratio = recon[0]["median_us"] / fold[0]["median_us"] if fold and recon else None
    bars.append(_bar(f"INT{bits} folded vs reconstruct, B={b} L={fmt_len(n)}", f">= {target}x", ratio,
                     ratio is not None and ratio >= target, int(ratio is not None), 1))
    return bars


def _num(x, spec=".1f", suffix=""):
    return "-" if x is None else f"{x:{spec}}{suffix}"


def time_cell(rec: dict | None) -> str:
    """A time cell: µs, then the profiled kernel time in parentheses if measured, '!' when the output
    failed its check; else the status word."""
    if rec is None:
        return "-"
    if rec.get("median_us") is None:
        return rec["status"].split(":")[0]
    kernel = f" ({rec['kernel_us']:.1f})" if rec.get("kernel_us") is not None else ""
    return f"{rec['median_us']:.1f}{kernel}" + ("" if rec["status"] == "ok" else "!")


PIVOT_BF16 = (("flashinfer_tc", "FI-tc µs"), ("flashinfer", "FI µs"), ("cudnn_sdpa", "cuDNN µs"),
              ("foscar_bf16", "fo-bf16 µs"), ("flashinfer_fp8", "FI-fp8 µs"), ("flashinfer_nvfp4", "FI-nvfp4 µs"))


def other_lowbit_kernels(records: list[dict]) -> list[str]:
    """The low-bit kernels measured besides the folded Triton kernel and the reconstruction, in run order."""
    return [k for k in dict.fromkeys(r["kernel"] for r in records if r["bits"] != 16)
            if k not in ("foscar_folded", "foscar_reconstruct")]


def render_pivot(records: list[dict], skipped: list[dict]) -> str:
    """One row per (B, L, bits, axes): folded and reconstruct, every other low-bit kernel measured (µs, ×
    FI-tc), then the BF16 kernels of that shape."""
    index = {(r["B"], r["L"], r["bits"], r["k_axis"], r["v_axis"], r["kernel"]): r for r in records}
    rows = sorted({(r["B"], r["L"], r["bits"], r["k_axis"], r["v_axis"]) for r in records if r["bits"] != 16},
                  key=lambda k: (k[0], k[1], k[2], AXIS_COMBOS.index((k[3], k[4]))))
    others = other_lowbit_kernels(records)
    head = ["B", "L", "bits", "K/V", "folded µs", "% ceil", "× FI-tc", "recon µs", "recon/folded"]
    head += [f"{k.removeprefix('foscar_')} µs (× FI-tc)" for k in others]
    head += [label for _, label in PIVOT_BF16]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for b, n, bits, ka, va in rows:
        fold = index.get((b, n, bits, ka, va, "foscar_folded"))
        recon = index.get((b, n, bits, ka, va, "foscar_reconstruct"))
        ratio = (recon["median_us"] / fold["median_us"] if fold and recon and fold.get("median_us")
                 and recon.get("median_us") else None)
        cells = [str(b), fmt_len(n), f"INT{bits}", f"{ka[:3]}/{va[:3]}", time_cell(fold),
                 _num(fold and fold.get("ceiling_frac"), ".0%"),
                 _num(fold and fold.get("speedup_vs_baseline"), ".2f", "x"),
                 time_cell(recon), _num(ratio, ".2f", "x")]
        for k in others:
            rec = index.get((b, n, bits, ka, va, k))
            cells.append(f"{time_cell(rec)} ({_num(rec and rec.get('speedup_vs_baseline'), '.2f', 'x')})")
        cells += [time_cell(index.get((b, n, 16, None, None, k))) for k, _ in PIVOT_BF16]
        lines.append("| " + " | ".join(cells) + " |")
    for s in skipped:
        lines.append(f"| {s['B']} | {fmt_len(s['L'])} | skipped: {s['reason']} |")
    return "\n".join(lines)


def render_records(records: list[dict]) -> str:
    head = ["B", "L", "bits", "K/V", "kernel", "status", "median µs", "min µs", "kernel µs", "TB/s", "% ceil",
            "× FI-tc", "slice err", "err / BF16-attn err", "host sync"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in records:
        axes = "-" if r["bits"] == 16 else f"{r['k_axis'][:3]}/{r['v_axis'][:3]}"
        cells = [str(r["B"]), fmt_len(r["L"]), "BF16" if r["bits"] == 16 else f"INT{r['bits']}", axes, r["kernel"],
                 r["status"], _num(r.get("median_us")), _num(r.get("min_us")), _num(r.get("kernel_us")),
                 _num(r.get("tbps"), ".2f"), _num(r.get("ceiling_frac"), ".0%"),
                 _num(r.get("speedup_vs_baseline"), ".2f", "x"), _num(r.get("err"), ".2e"),
                 _num(r.get("err_ratio"), ".2f"), {True: "yes", False: "no"}.get(r.get("host_sync"), "-")]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def render_checks(checks: list[dict]) -> str:
    head = ["bits", "K/V", "kernel", "status", "err vs exact", "BF16-attn err", "ratio (<= 1.5)"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for c in checks:
        lines.append("| " + " | ".join([f"INT{c['bits']}", f"{c['k_axis'][:3]}/{c['v_axis'][:3]}", c["kernel"],
                                        c["status"], _num(c.get("err"), ".2e"), _num(c.get("bf16_err"), ".2e"),
                                        _num(c.get("ratio"), ".2f")]) + " |")
    return "\n".join(lines)


def render_summary(result: dict) -> str:
    records = result["records"]
    lines = []
    cl = result.get("ceiling") or {}
    lines.append(f"Read ceiling: {_num(cl.get('tbps'), '.2f', ' TB/s')} ({cl.get('source', 'not measured')}); "
                 f"GPU {result['meta'].get('gpu', '?')}; timing: {result['meta'].get('timing', '?')}."
                 + (f" Problem: {problem_text(result['meta']['problem'])}." if result["meta"].get("problem") else ""))
    geo = []
    for kernel in ["foscar_folded", "foscar_reconstruct"] + other_lowbit_kernels(records):
        for bits in sorted({r["bits"] for r in records if r["bits"] != 16}):
            g, n = geomean_speedup(records, kernel, bits)
            geo.append(f"{kernel} INT{bits} {_num(g, '.2f', 'x')} ({n}/{len(PAPER_SHAPES)})")
    for kernel, _ in PIVOT_BF16[1:]:
        g, n = geomean_speedup(records, kernel, None)
        geo.append(f"{kernel} {_num(g, '.2f', 'x')} ({n}/{len(PAPER_SHAPES)})")
    lines.append("Geomean speedup over FlashInfer BF16 (tensor cores), paper shapes: " + "; ".join(geo) + ".")
    if any(r.get("kernel_us") is not None for r in records):
        kgeo = []
        for bits in sorted({r["bits"] for r in records if r["bits"] != 16}):
            g, n = geomean_speedup(records, "foscar_folded", bits, "kernel_speedup_vs_baseline")
            kgeo.append(f"foscar_folded INT{bits} {_num(g, '.2f', 'x')} ({n}/{len(PAPER_SHAPES)})")
        lines.append("The same by profiled kernel time (no host gaps; not what the bars use): "
                     + "; ".join(kgeo) + ".")
    lines.append("")
    lines.append("| bar | target | value | verdict | shapes | note |")
    lines.append("|---|---|---|---|---|---|")
    for b in result["bars"]:
        v = b["value"]
        value = "-" if v is None else (f"{v:.0%}" if "fraction" in b["bar"] else f"{v:.2f}x")
        lines.append(f"| {b['bar']} | {b['target']} | {value} | {b['verdict']} | {b['shapes']} | {b['detail']} |")
    problems = problem_lines(result)
    if problems:
        lines.append("")
        lines += problems
    return "\n".join(lines)


def problem_text(problem: dict) -> str:
    """The run's problem (``meta["problem"]``) as ``Hq 32, Hkv 8, D 128, g 128, page 64``."""
    return ", ".join(f"{k} {v}" for k, v in problem.items())


def problem_lines(result: dict) -> list[str]:
    """Everything that was not measured or not right, one line each (missing kernels once per reason)."""
    out, seen = [], set()
    for r in result["records"] + result.get("checks", []):
        status = r["status"]
        if status in ("ok", "pass"):
            continue
        where = f"B={r['B']} L={fmt_len(r['L'])} " if "B" in r else "check "
        where += "" if r["bits"] == 16 else f"INT{r['bits']} {r['k_axis'][:3]}/{r['v_axis'][:3]} "
        if status.startswith("missing"):
            if (r["kernel"], status) in seen:
                continue
            seen.add((r["kernel"], status))
            where = ""
        out.append(f"- {r['kernel']}: {where}{status}")
    for kernel in sorted({r["kernel"] for r in result["records"] if r.get("host_sync")}):
        out.append(f"- note: {kernel} waits for the GPU inside the call (host sync): its event times include a "
                   "launch gap, its profiled kernel times (--kernel-time) do not")
    for kernel, why in dict.fromkeys((r["kernel"], r["kernel_time_error"]) for r in result["records"]
                                     if r.get("kernel_time_error")):
        out.append(f"- note: {kernel}: no profiled kernel time: {why}")
    for s in result.get("skipped", []):
        out.append(f"- skipped B={s['B']} L={fmt_len(s['L'])}: {s['reason']}")
    for f in result.get("fatal", []):
        out.append(f"- FATAL: {f}")
    return out


def render_markdown(result: dict, detailed: bool = False) -> str:
    parts = ["## foscar decode benchmark", ""]
    if result.get("checks"):
        parts += ["### --check (small ragged caches vs decode_exact)", "", render_checks(result["checks"]), ""]
    parts += ["### Times (µs, median; (x) = profiled GPU kernel time; ! = output failed its check)", "",
              render_pivot(result["records"], result["skipped"]), "", render_summary(result)]
    if detailed:
        parts += ["", "### Every record", "", render_records(result["records"]), "",
                  f"Command: `{result['meta'].get('command', '')}`"]
    return "\n".join(parts) + "\n"


def failures(result: dict) -> list[str]:
    """What makes the run exit 1: wrong outputs, kernel errors, failed checks, a lost CUDA context."""
    bad = [f"{r['kernel']}: {r['status']}" for r in result["records"] + result.get("checks", [])
           if r["status"].startswith(("wrong", "error", "FAIL", "not run"))]
    return bad + list(result.get("fatal", []))


CSV_COLUMNS = ("B", "L", "Hq", "Hkv", "D", "bits", "k_axis", "v_axis", "kernel", "status", "median_us", "min_us",
               "tbps", "ceiling_frac", "speedup_vs_baseline", "err", "bf16_err", "err_ratio", "first_call_s",
               "host_sync", "timing")


def records_csv(records: list[dict]) -> str:
    """One row per record (its scalar fields, :data:`CSV_COLUMNS`), for spreadsheets and pandas."""
    return to_csv(records, CSV_COLUMNS)


def write_outputs(result: dict, out_dir: Path) -> None:
    """Annotate the records, evaluate the bars and failures, and (re)write ``bench_decode.json``, ``.md``
    and ``.csv`` under ``out_dir``, each atomically."""
    out_dir.mkdir(parents=True, exist_ok=True)
    annotate(result["records"], (result.get("ceiling") or {}).get("tbps"))
    result["bars"] = evaluate_bars(result["records"])
    result["failures"] = failures(result)
    for name, text in (("bench_decode.json", json.dumps(result, indent=1, default=str)),
                       ("bench_decode.md", render_markdown(result, detailed=True)),
                       ("bench_decode.csv", records_csv(result["records"]))):
        tmp = out_dir / (name + ".tmp")
        tmp.write_text(text)
        os.replace(tmp, out_dir / name)
