"""Scalar affine operations per stored value: folding against per-value reconstruction (paper Fig. 14).

Reconstruction applies ``x = s q + z`` to every value it reads: 2 operations (a multiply and an add)
per stored value, whatever the GQA ratio. Folding applies the scale and the offset once per group and
query head instead (paper Sec. 4.1-4.2):

- token-wise K (acc-fold): each group-local partial is scaled and gets its offset term, per token,
  channel group and query head: 2 per (token, group, head), ``2 N / g`` per stored value;
- channel-wise K (operand-fold): ``Q' = Q s'`` and the offset correction per channel, head and token
  group: ``2 N / g`` per stored value;
- token-wise V (operand-fold): ``P' = P s'`` and the correction ``P mid`` per token, group and head:
  ``2 N / g``; channel-wise V (acc-fold): the partial scaled and corrected per channel, head and token
  group: ``2 N / g``.

``N`` is the number of query heads the kernel computes per KV head: the GQA ratio ``G`` in the paper's
count (``2 G / g``), and for the kernels the MMA's N, padded: ``max(8, next power of two of G)`` for the
Triton and CuTe kernels (``S^T = K Q^T`` with heads along N). :func:`ops_per_value` reads it from the
kernel's actual configuration.
"""
from __future__ import annotations

RECONSTRUCT_OPS = 2.0  # one multiply and one add per stored value


def computed_heads(G: int, kernel: str) -> int:
    """Query heads per KV head the kernel computes: ``G`` for the paper's count; the padded MMA N for
    the kernels (what the Triton launcher passes as ``BLOCK_H``)."""
    if kernel == "paper":
        return G
    if kernel in ("triton", "cute"):
        return max(8, 1 << max(0, G - 1).bit_length())
    raise ValueError(f"kernel {kernel!r}: expected 'paper', 'triton' or 'cute'")


def ops_per_value(G: int, group_size: int, kernel: str = "triton") -> dict:
    """``{"fold": ..., "reconstruct": ...}``: scalar affine operations per stored value (K and V alike)."""
    n = computed_heads(G, kernel)
    return {"fold": 2.0 * n / group_size, "reconstruct": RECONSTRUCT_OPS, "heads_computed": n}


def table(gqa=(1, 2, 4, 8, 16, 32), groups=(32, 64, 128), kernels=("paper", "triton")) -> list[dict]:
    return [{"gqa": G, "group_size": g, "kernel": k, **ops_per_value(G, g, k)}
            for k in kernels for g in groups for G in gqa]


def render_markdown(rows: list[dict]) -> str:
    groups = sorted({r["group_size"] for r in rows})
    lines = ["| count | GQA | " + " | ".join(f"fold, g = {g}" for g in groups) + " | reconstruct |",
             "|---|---|" + "---|" * (len(groups) + 1)]
    for k in dict.fromkeys(r["kernel"] for r in rows):
        for G in sorted({r["gqa"] for r in rows}):
            cells = [next(r for r in rows if r["kernel"] == k and r["gqa"] == G and r["group_size"] == g) for g in groups]
            lines.append(f"| {k} | {G} | " + " | ".join(f"{c['fold']:.3g}" for c in cells) + f" | {RECONSTRUCT_OPS:g} |")
    return "\n".join(lines)


def plot(rows: list[dict], path) -> bool:
    """Operations per stored value against the GQA ratio, one line per group size and count, the
    reconstruction's 2 as a reference line. ``False`` without matplotlib."""
    from .plots import pyplot, save
    plt = pyplot()
    if plt is None:
        return False
    fig, ax = plt.subplots(figsize=(6.4, 4.2))
    for k, style in (("paper", "-"), ("triton", "--")):
        for g in sorted({r["group_size"] for r in rows}):
            rs = [r for r in rows if r["kernel"] == k and r["group_size"] == g]
            if rs:
                ax.plot([r["gqa"] for r in rs], [r["fold"] for r in rs], style, marker="o",
                        label=f"fold, g={g} ({'2G/g' if k == 'paper' else 'kernel, N padded to 8'})")
    ax.axhline(RECONSTRUCT_OPS, color="k", lw=1, label="reconstruction (2 per value)")
    ax.set_xscale("log", base=2)
    ax.set_yscale("log", base=2)
    ax.set_xlabel("GQA ratio (query heads per KV head)")
    ax.set_ylabel("scalar affine ops per stored value")
    ax.legend(fontsize=7)
    return save(fig, path)
