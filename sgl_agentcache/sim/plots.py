"""PNG plots of a replay-suite report (matplotlib, headless): what ``make demo`` and ``make bench`` draw.

- ``recompute_<pressure>.png``: recomputed prefill tokens as a ratio to stock, policy x workload;
- ``resume_cdf_<pressure>.png``: CDFs of resume latency (the returning call after a tool) per workload;
- ``memory_by_class.png``: device-resident tokens by lifecycle class over time, ours vs stock, on the
  workload where the classes differ most (branch-heavy).
"""

from __future__ import annotations

from pathlib import Path


def _plt():
    import matplotlib

    matplotlib.use("Agg")  # headless: never needs a display
    import matplotlib.pyplot as plt

    return plt


def plot_all(report: dict, out_dir: Path) -> list[Path]:
    files = []
    for pressure in report["config"]["pressures"]:
        files.append(_recompute_heatmap(report, pressure, out_dir / f"recompute_{pressure}.png"))
        files.append(_resume_cdfs(report, pressure, out_dir / f"resume_cdf_{pressure}.png"))
    memory = _memory_by_class(report, out_dir / "memory_by_class.png")
    return files + ([memory] if memory else [])


def _recompute_heatmap(report: dict, pressure: str, path: Path) -> Path:
    plt = _plt()
    workloads = list(report["config"]["workloads"])
    policies = list(report["config"]["policies"])
    cell = {(s["workload"], s["policy"]): s["recompute_vs_stock"] for s in report["summary"]
            if s["pressure"] == pressure}
    grid = [[cell.get((w, p), float("nan")) for w in workloads] for p in policies]
    fig, ax = plt.subplots(figsize=(1.6 + 1.3 * len(workloads), 1.2 + 0.45 * len(policies)))
    image = ax.imshow(grid, cmap="RdYlGn_r", vmin=0.0, vmax=1.5, aspect="auto")
    ax.set_xticks(range(len(workloads)), workloads, rotation=30, ha="right")
    ax.set_yticks(range(len(policies)), policies)
    for i, row in enumerate(grid):
        for j, value in enumerate(row):
            ax.text(j, i, f"{value:.2f}", ha="center", va="center", fontsize=8)
    ax.set_title(f"recomputed prefill tokens vs stock ({pressure} pool; lower is better)")
    fig.colorbar(image, ax=ax, fraction=0.03)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def _resume_cdfs(report: dict, pressure: str, path: Path) -> Path:
    plt = _plt()
    workloads = list(report["config"]["workloads"])
    cols = min(3, len(workloads))
    rows = (len(workloads) + cols - 1) // cols
    fig, axes = plt.subplots(rows, cols, figsize=(4.2 * cols, 3.2 * rows), squeeze=False)
    for ax, workload in zip(axes.flat, workloads):
        for run in report["runs"]:
            if run["workload"] != workload or run["pressure"] != pressure or run["seed"] != report["config"]["seeds"][0]:
                continue
            lat = sorted(max(x, 1e-4) for x in run["resume_latencies_s"])
            if lat:
                ax.step(lat, [(i + 1) / len(lat) for i in range(len(lat))], where="post", label=run["policy"],
                        linewidth=2.2 if run["policy"] in ("agentcache", "stock") else 1.0)
        ax.set_xscale("log")
        ax.set_title(workload)
        ax.set_xlabel("resume latency (s)")
        ax.grid(alpha=0.3)
    for ax in list(axes.flat)[len(workloads):]:
        ax.axis("off")
    axes.flat[0].legend(fontsize=7)
    fig.suptitle(f"resume latency CDF after tool calls ({pressure} pool)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def _memory_by_class(report: dict, path: Path) -> Path | None:
    plt = _plt()
    workload = "branch_heavy" if "branch_heavy" in report["config"]["workloads"] else report["config"]["workloads"][0]
    pressure = report["config"]["pressures"][0]
    picked = [r for r in report["runs"] if r["workload"] == workload and r["pressure"] == pressure
              and r["policy"] in ("stock", "agentcache") and r["seed"] == report["config"]["seeds"][0]]
    if not picked:
        return None
    fig, axes = plt.subplots(1, len(picked), figsize=(6 * len(picked), 3.4), squeeze=False, sharey=True)
    for ax, run in zip(axes.flat, picked):
        times = [t for t, _ in run["timeline"]]
        classes = sorted({c for _, counts in run["timeline"] for c in counts})
        ax.stackplot(times, [[counts.get(c, 0) for _, counts in run["timeline"]] for c in classes], labels=classes)
        ax.set_title(f"{run['policy']}: resident KV tokens by class ({workload}, {pressure})")
        ax.set_xlabel("trace time (s)")
        ax.legend(fontsize=7, loc="upper left")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
