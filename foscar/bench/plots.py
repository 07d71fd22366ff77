"""Plots of the decode benchmark's records (``bench_decode.json``), in the style of the paper's figures:

- :func:`speedup_by_shape` (Fig. 8/9): speedup over FlashInfer BF16 per (batch, context), one panel per
  bit width, one bar group per batch, each kernel a bar;
- :func:`speedup_by_axes` (Fig. 13): the four K/V axis combinations side by side per shape;
- :func:`speedup_by_heads` (Fig. 15): speedup against the number of KV heads (records of several
  ``--heads`` runs).

``foscar bench plot bench_decode.json [...] --out DIR`` draws whichever the records allow. matplotlib is
needed (``pip install 'foscar[bench]'``); without it nothing is drawn and the caller says so.
"""
from __future__ import annotations

import json
from pathlib import Path


def pyplot():
    """matplotlib's pyplot on the file-only Agg backend, or ``None`` where matplotlib is not installed (every
    plot of :mod:`foscar.bench` then draws nothing and says so)."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        return plt
    except ImportError:
        return None


def save(fig, path) -> bool:
    """Lay out, write and close ``fig``."""
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    import matplotlib.pyplot as plt
    plt.close(fig)
    return True


def _len_label(n: int) -> str:
    return f"{n // 1024}K" if n % 1024 == 0 else str(n)


#: The fields every plot reads from a record.
RECORD_FIELDS = ("kernel", "bits", "B", "L")


def load_records(paths) -> list[dict]:
    """The records of every JSON file given (``{"records": [...]}`` as ``bench_decode.json`` writes, or the
    list alone). A file that cannot be read or is not such a document raises ``ValueError`` naming it."""
    records = []
    for p in paths:
        try:
            doc = json.loads(Path(p).read_text())
        except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
            raise ValueError(f"{str(p)!r}: cannot be read as JSON ({e})") from None
        recs = doc.get("records") if isinstance(doc, dict) else doc
        if not isinstance(recs, list) or not all(isinstance(r, dict) and all(f in r for f in RECORD_FIELDS)
                                                 for r in recs):
            raise ValueError(f"{str(p)!r}: expected a bench_decode.json ({{\"records\": [...]}}, each record with "
                             f"{', '.join(RECORD_FIELDS)})")
        records += recs
    return records


def _grouped_bars(ax, groups: list, ticklabels: list[str], series: list[tuple[str, dict]]) -> None:
    """One bar per series in each group (``series``: ``(label, {group: value})``), the 1x line, labels."""
    width = 0.8 / len(series)
    for i, (label, values) in enumerate(series):
        xs = [j + (i - (len(series) - 1) / 2) * width for j in range(len(groups))]
        ax.bar(xs, [values.get(g, 0) for g in groups], width, label=label)
    ax.axhline(1.0, color="k", lw=0.8)
    ax.set_xticks(range(len(groups)))
    ax.set_xticklabels(ticklabels, fontsize=7)
    ax.legend(fontsize=7)


def speedup_by_shape(records: list[dict], path, kernels=("foscar_folded", "foscar_reconstruct", "foscar_cute"),
                     title: str = "") -> bool:
    """Fig. 8/9: speedup over FlashInfer BF16 (tensor cores) per shape, token-wise K and V."""
    plt = pyplot()
    rows = [r for r in records if r.get("speedup_vs_baseline") and r.get("k_axis", "token") == "token"
            and r.get("v_axis", "token") == "token" and r["kernel"] in kernels]
    if plt is None or not rows:
        return False
    bits = sorted({r["bits"] for r in rows})
    shapes = sorted({(r["B"], r["L"]) for r in rows})
    present = [k for k in kernels if any(r["kernel"] == k for r in rows)]
    fig, axes = plt.subplots(len(bits), 1, figsize=(max(6.4, 0.55 * len(shapes) * len(present)), 3.2 * len(bits)),
                             squeeze=False)
    for ax, b in zip(axes[:, 0], bits):
        series = [(k, {(r["B"], r["L"]): r["speedup_vs_baseline"] for r in rows if r["bits"] == b and r["kernel"] == k})
                  for k in present]
        _grouped_bars(ax, shapes, [f"B={s[0]}\nL={_len_label(s[1])}" for s in shapes], series)
        ax.set_ylabel(f"INT{b}: x FlashInfer BF16")
    axes[0, 0].set_title(title or "Decode speedup over FlashInfer BF16 (token-wise K and V)")
    return save(fig, path)


def speedup_by_axes(records: list[dict], path, kernel: str = "foscar_folded", title: str = "") -> bool:
    """Fig. 13: speedup over FlashInfer BF16 of the four K/V axis combinations, per shape and bit width."""
    plt = pyplot()
    rows = [r for r in records if r["kernel"] == kernel and r.get("speedup_vs_baseline")]
    combos = sorted({(r["k_axis"], r["v_axis"]) for r in rows})
    if plt is None or len(combos) < 2:
        return False
    groups = sorted({(r["bits"], r["B"], r["L"]) for r in rows})
    fig, ax = plt.subplots(figsize=(max(6.4, 0.9 * len(groups)), 3.6))
    series = [(f"K {c[0]}-wise / V {c[1]}-wise",
               {(r["bits"], r["B"], r["L"]): r["speedup_vs_baseline"] for r in rows if (r["k_axis"], r["v_axis"]) == c})
              for c in combos]
    _grouped_bars(ax, groups, [f"INT{g[0]}\nB={g[1]} L={_len_label(g[2])}" for g in groups], series)
    ax.set_ylabel("x FlashInfer BF16")
    ax.set_title(title or "Axis combinations (paper Fig. 13)")
    return save(fig, path)


def speedup_by_heads(records: list[dict], path, kernel: str = "foscar_folded", title: str = "") -> bool:
    """Fig. 15: speedup over FlashInfer BF16 against the number of KV heads, one line per (bits, B, L)."""
    plt = pyplot()
    rows = [r for r in records if r["kernel"] == kernel and r.get("speedup_vs_baseline") and "Hkv" in r
            and r.get("k_axis", "token") == "token" and r.get("v_axis", "token") == "token"]
    if plt is None or len({r["Hkv"] for r in rows}) < 2:
        return False
    fig, ax = plt.subplots(figsize=(6.4, 4.0))
    for key in sorted({(r["bits"], r["B"], r["L"]) for r in rows}):
        pts = sorted((r["Hkv"], r["speedup_vs_baseline"]) for r in rows if (r["bits"], r["B"], r["L"]) == key)
        ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o",
                label=f"INT{key[0]}, B={key[1]}, L={_len_label(key[2])}")
    ax.axhline(1.0, color="k", lw=0.8)
    ax.set_xscale("log", base=2)
    ax.set_xlabel("KV heads (query heads fixed: GQA ratio = Hq / Hkv)")
    ax.set_ylabel("x FlashInfer BF16")
    ax.set_title(title or "Head-ratio sweep (paper Fig. 15)")
    ax.legend(fontsize=7)
    return save(fig, path)
