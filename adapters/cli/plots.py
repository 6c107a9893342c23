"""The commands' figures, drawn from results already measured (matplotlib, Agg backend).

- `plot_kept`: kept positions of one layer/head over time (eval's plots section and
  `generate --kept-map`);
- `plot_ppl`: perplexity against budget (eval ppl);
- `plot_frontier`: perplexity against KV bytes, log x, with the Pareto frontier (eval frontier);
- `plot_budgets`: the per-layer budgets of each allocation policy (eval ppl, with plots).
"""

from pathlib import Path
from typing import Dict, List, Sequence


def _pyplot():
    try:
        import matplotlib
    except ImportError:  # pragma: no cover - the bench extra installs it
        raise SystemExit("plots need matplotlib: pip install matplotlib (or the project's [bench] extra)")
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _save(fig, path: Path) -> None:
    import matplotlib.pyplot as plt

    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def plot_kept(maps: Dict[str, List[List[int]]], path: Path) -> None:
    """One panel per title: row i is black where a position was kept after decode step i."""
    import numpy as np

    plt = _pyplot()
    fig, axes = plt.subplots(1, len(maps), figsize=(5.5 * len(maps), 4.5), sharey=True, squeeze=False)
    width = max((max(r) for rows in maps.values() for r in rows if r), default=0) + 1  # one position axis
    for ax, (title, rows) in zip(axes[0], maps.items()):
        img = np.zeros((len(rows), width))
        for i, r in enumerate(rows):
            img[i, r] = 1
        ax.imshow(img, aspect="auto", origin="lower", cmap="Greys", interpolation="nearest")
        ax.set_xlabel("token position (black: kept)")
        ax.set_title(title, fontsize=9)
    axes[0][0].set_ylabel("decode step")
    _save(fig, path)


def plot_ppl(rows: List[dict], full_ppl: float, path: Path) -> None:
    """Perplexity against budget, one line per cache name (ablations left out)."""
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(6.5, 4.2))
    names = dict.fromkeys(r["name"] for r in rows if r["budget"] and not r["family"].startswith("ablation"))
    for name in names:
        pts = sorted((r["budget"], r["ppl"]) for r in rows if r["name"] == name)
        ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=name)
    ax.axhline(full_ppl, color="k", ls="--", lw=1, label="full KVCache")
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("budget (tokens kept per layer)")
    ax.set_ylabel("streaming perplexity")
    ax.set_title("Perplexity vs budget (lower is better)")
    ax.legend(fontsize=8)
    _save(fig, path)


def pareto(points: Sequence[tuple]) -> List[int]:
    """Indices of the (bytes, ppl) points no other point beats on both axes, by bytes.

    >>> pareto([(1.0, 10.0), (0.5, 12.0), (0.5, 11.0), (0.25, 20.0), (0.6, 13.0)])
    [3, 2, 0]
    """
    order = sorted(range(len(points)), key=lambda i: (points[i][0], points[i][1]))
    front, best = [], float("inf")
    for i in order:
        if points[i][1] < best:
            front.append(i)
            best = points[i][1]
    return front


def plot_frontier(rows: List[dict], path: Path) -> None:
    """Perplexity against total KV bytes (fraction of a float16 full cache, log x), one
    marker series per family, the Pareto frontier as a dashed line."""
    plt = _pyplot()
    from matplotlib.ticker import PercentFormatter

    fig, ax = plt.subplots(figsize=(7.5, 4.8))
    families = dict.fromkeys(r["family"] for r in rows)
    markers = dict(zip(families, "os^vDP*Xh<>"))
    for family in families:
        pts = sorted((r for r in rows if r["family"] == family), key=lambda r: r["bytes"])
        ax.plot([r["bytes"] for r in pts], [r["ppl"] for r in pts], marker=markers[family], lw=0.8,
                label=family)
        for r in pts:
            if r.get("budget"):
                ax.annotate(str(r["budget"]), (r["bytes"], r["ppl"]), fontsize=6,
                            xytext=(3, 3), textcoords="offset points")
    front = [rows[i] for i in pareto([(r["bytes"], r["ppl"]) for r in rows])]
    ax.plot([r["bytes"] for r in front], [r["ppl"] for r in front], "k--", lw=1, label="Pareto frontier")
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.xaxis.set_major_formatter(PercentFormatter(1.0, decimals=0))
    ax.set_xlabel("KV bytes, fraction of a float16 full cache (log)")
    ax.set_ylabel("streaming perplexity")
    ax.set_title("Perplexity vs KV memory (lower left is better)")
    ax.legend(fontsize=7)
    _save(fig, path)


def plot_budgets(budgets: Dict[str, List[int]], path: Path) -> None:
    """Per-layer budgets of each allocation policy (one line each)."""
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(6.5, 4.2))
    for name, b in budgets.items():
        ax.plot(range(len(b)), b, marker=".", label=name)
    ax.set_xlabel("layer")
    ax.set_ylabel("budget (tokens kept per KV head)")
    ax.set_yscale("log", base=2)
    ax.set_title("Per-layer budgets at equal bytes")
    ax.legend(fontsize=7)
    _save(fig, path)
