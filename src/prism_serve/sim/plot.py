"""PNG plots of sweep results in the layout of the Prism paper's Figure 7 (TTFT and TPOT attainment
against the swept axis, one line per policy, a dotted vertical line where a policy first reaches the
target; on the device-count axis, hollow triangles where a baseline keeps a smaller count's
assignment) and Figure 12b (GPUs needed for the target attainment, per policy). Every figure is
titled as simulated."""

from __future__ import annotations

from pathlib import Path

__all__ = ["plot_gpus_needed", "plot_sweep"]

_XLABEL = {"rate": "rate scale", "slo": "SLO scale", "gpus": "number of GPUs"}


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def plot_sweep(rows: list[dict], path: str | Path, *, title: str, target: float = 0.99) -> None:
    plt = _pyplot()
    axis = rows[0]["axis"]
    fig, axes = plt.subplots(1, 2, figsize=(8, 3.2), sharey=True)
    policies = list(dict.fromkeys(r["policy"] for r in rows))
    for metric, ax in zip(("ttft_attainment", "tpot_attainment"), axes, strict=True):
        for p in policies:
            pts = sorted((r["value"], r[metric]) for r in rows if r["policy"] == p)
            xs = [x for x, _ in pts]
            line = ax.plot(xs, [100 * y for _, y in pts], marker="o", ms=3, label=p)[0]
            # a baseline's count that keeps a smaller count's assignment (sim/sweep.py keep_fewer):
            # what it runs there, apart from its own placement's point
            kept = sorted((r["value"], r["kept"][metric]) for r in rows if r["policy"] == p and "kept" in r)
            if kept:
                ax.plot(
                    [x for x, _ in kept], [100 * y for _, y in kept], ls="none", marker="^", ms=5,
                    fillstyle="none", color=line.get_color(), label=f"{p}, keeping fewer devices' assignment",
                )  # fmt: skip
            reached = [x for x, y in pts if y >= target]
            if reached:
                ax.axvline(reached[0], ls=":", color=line.get_color(), lw=1)
        ax.set_xlabel(_XLABEL.get(axis, axis))
        ax.set_title(metric.split("_")[0].upper() + " attainment (%)", fontsize=9)
        ax.grid(alpha=0.3)
    axes[0].set_ylim(0, 102)
    axes[1].legend(fontsize=7, loc="lower right")
    fig.suptitle(f"{title} [simulated]", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=80)
    plt.close(fig)


def plot_gpus_needed(needed: dict[str, int | None], max_gpus: int, path: str | Path, *, title: str) -> None:
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(4.5, 3))
    names = list(needed)
    heights = [needed[n] if needed[n] is not None else max_gpus + 1 for n in names]
    bars = ax.bar(names, heights, color=["C0" if needed[n] is not None else "0.6" for n in names])
    for b, n in zip(bars, names, strict=True):
        text = str(needed[n]) if needed[n] is not None else f"{max_gpus}+"
        ax.annotate(
            text, (b.get_x() + b.get_width() / 2, b.get_height()), ha="center", va="bottom", fontsize=8
        )
    ax.set_ylabel("GPUs for the target")
    ax.tick_params(axis="x", labelsize=7)
    ax.set_title(f"{title} [simulated]", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=80)
    plt.close(fig)
