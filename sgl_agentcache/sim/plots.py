"""PNG plots of a replay-suite report (matplotlib, headless): what ``make demo`` and ``make bench`` draw.

- ``recompute_<pressure>_host<h>.png``: recomputed prefill tokens as a ratio to stock (no host tier),
  system x workload, at one device pressure and one host tier size (mean over seeds, 95% interval);
- ``host_sweep.png``: the same ratio against the host tier's size, ours and the HiCache baseline;
- ``resume_cdf_<pressure>.png``: CDFs of resume latency (the returning call after a tool) per workload,
  at the largest main host level, first seed;
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


def _host_tag(h: float) -> str:
    return f"{h:g}x".replace(".", "p")


def plot_all(report: dict, out_dir: Path) -> list[Path]:
    config = report["config"]
    files = []
    cells = {(s["pressure"], s["host_ratio"]) for s in report["summary"] if s["policy"] != "stock"}
    for pressure in config["pressures"]:
        for host in config["hosts"]:
            if (pressure, host) in cells:  # host 0 runs at the sweep pressure only
                files.append(_recompute_heatmap(report, pressure, host,
                                                out_dir / f"recompute_{pressure}_host{_host_tag(host)}.png"))
        files.append(_resume_cdfs(report, pressure, out_dir / f"resume_cdf_{pressure}.png"))
    sweep = _host_sweep(report, out_dir / "host_sweep.png")
    memory = _memory_by_class(report, out_dir / "memory_by_class.png")
    return files + [p for p in (sweep, memory) if p is not None]


def _recompute_heatmap(report: dict, pressure: str, host: float, path: Path) -> Path:
    plt = _plt()
    workloads = list(report["config"]["workloads"])
    cell = {(s["workload"], s["policy"]): s for s in report["summary"]
            if s["pressure"] == pressure and s["host_ratio"] == host}
    policies = [p for p in report["config"]["policies"] if any((w, p) in cell for w in workloads)]
    grid = [[cell[(w, p)]["recompute_vs_stock"] if (w, p) in cell else float("nan") for w in workloads]
            for p in policies]
    fig, ax = plt.subplots(figsize=(2.0 + 1.45 * len(workloads), 1.4 + 0.5 * len(policies)))
    image = ax.imshow(grid, cmap="RdYlGn_r", vmin=0.0, vmax=1.5, aspect="auto")
    ax.set_xticks(range(len(workloads)), workloads, rotation=30, ha="right")
    ax.set_yticks(range(len(policies)), policies)
    ax.set_xlabel("workload")
    ax.set_ylabel("system")
    for i, p in enumerate(policies):
        for j, w in enumerate(workloads):
            s = cell.get((w, p))
            if s is None:
                continue
            lo, hi = s["recompute_ci95"]
            text = f"{s['recompute_vs_stock']:.2f}" + (f"\n±{(hi - lo) / 2:.2f}" if hi == hi else "")
            ax.text(j, i, text, ha="center", va="center", fontsize=7)
    ax.set_title(f"recompute / stock's ({pressure} pool, host tier {host:g}x pool)\n"
                 "mean ± 95% CI over seeds; lower is better", fontsize=9)
    bar = fig.colorbar(image, ax=ax, fraction=0.03)
    bar.set_label("recompute / stock (no host)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def _host_sweep(report: dict, path: Path) -> Path | None:
    plt = _plt()
    config = report["config"]
    pressure = config["sweep_pressure"]
    points = [s for s in report["summary"] if s["pressure"] == pressure and s["policy"] in config["sweep_policies"]]
    if not points:
        return None
    workloads = list(config["workloads"])
    cols = min(4, len(workloads))
    rows = (len(workloads) + cols - 1) // cols
    fig, axes = plt.subplots(rows, cols, figsize=(3.6 * cols, 2.9 * rows), squeeze=False)
    for ax, workload in zip(axes.flat, workloads):
        for policy in config["sweep_policies"]:
            mine = sorted((s for s in points if s["workload"] == workload and s["policy"] == policy),
                          key=lambda s: s["host_ratio"])
            if not mine:
                continue
            xs = [s["host_ratio"] for s in mine]
            ys = [s["recompute_vs_stock"] for s in mine]
            err = [[max(y - s["recompute_ci95"][0], 0) if s["recompute_ci95"][0] == s["recompute_ci95"][0] else 0
                    for y, s in zip(ys, mine)],
                   [max(s["recompute_ci95"][1] - y, 0) if s["recompute_ci95"][1] == s["recompute_ci95"][1] else 0
                    for y, s in zip(ys, mine)]]
            ax.errorbar(xs, ys, yerr=err, marker="o", capsize=3, label=policy)
        ax.axhline(1.0, color="grey", linewidth=0.8, linestyle="--")
        ax.set_xscale("symlog", linthresh=0.25)
        ax.set_title(workload, fontsize=9)
        ax.set_xlabel("host tier (x device pool)")
        ax.set_ylabel("recompute / stock")
        ax.grid(alpha=0.3)
    for ax in list(axes.flat)[len(workloads):]:
        ax.axis("off")
    axes.flat[0].legend(fontsize=7)
    fig.suptitle(f"host tier size sweep ({pressure} device pool; mean ± 95% CI; stock has no host tier)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def _resume_cdfs(report: dict, pressure: str, path: Path) -> Path:
    plt = _plt()
    config = report["config"]
    workloads = list(config["workloads"])
    host = max(config["hosts"])
    cols = min(4, len(workloads))
    rows = (len(workloads) + cols - 1) // cols
    fig, axes = plt.subplots(rows, cols, figsize=(3.8 * cols, 3.0 * rows), squeeze=False)
    colours = plt.get_cmap("tab10")
    policies = list(config["policies"])
    for ax, workload in zip(axes.flat, workloads):
        for run in report["runs"]:
            if run["workload"] != workload or run["pressure"] != pressure or run["host_ratio"] != host:
                continue  # stock runs once per pressure and is listed in every cell: the host cell's copy
            lat = sorted(max(x, 1e-4) for x in run["resume_latencies_s"])
            if lat:
                i = policies.index(run["policy"]) if run["policy"] in policies else len(policies)
                ax.step(lat, [(k + 1) / len(lat) for k in range(len(lat))], where="post", label=run["policy"],
                        color=colours(i % 10), linestyle="-" if i < 5 else "--",
                        linewidth=2.2 if run["policy"] in ("agentcache", "stock") else 1.0)
        ax.set_xscale("log")
        ax.set_title(workload, fontsize=9)
        ax.set_xlabel("resume latency (s)")
        ax.set_ylabel("fraction of resumes")
        ax.grid(alpha=0.3)
    for ax in list(axes.flat)[len(workloads):]:
        ax.axis("off")
    handles, labels = axes.flat[0].get_legend_handles_labels()
    fig.legend(handles, labels, loc="lower center", ncol=min(len(labels), 8) or 1, fontsize=7)
    fig.suptitle(f"resume latency CDF after tool calls ({pressure} pool, host tier {host:g}x; first seed)")
    fig.tight_layout(rect=(0, 0.06, 1, 1))
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def sorted_timeline(timeline: list) -> list:
    """Samples in time order (the final sample is taken at the trace's last arrival, which can come
    before the last call's end)."""
    return sorted(timeline, key=lambda sample: sample[0])


def _memory_by_class(report: dict, path: Path) -> Path | None:
    plt = _plt()
    config = report["config"]
    workload = "branch_heavy" if "branch_heavy" in config["workloads"] else config["workloads"][0]
    pressure = config["pressures"][0]
    host = max(config["hosts"])
    picked = [r for r in report["runs"] if r["workload"] == workload and r["pressure"] == pressure
              and ((r["policy"] == "stock") or (r["policy"] == "agentcache" and r["host_ratio"] == host))]
    picked = sorted({r["policy"]: r for r in picked}.values(), key=lambda r: r["policy"] != "stock")
    if not picked:
        return None
    fig, axes = plt.subplots(1, len(picked), figsize=(6 * len(picked), 3.4), squeeze=False, sharey=True)
    for ax, run in zip(axes.flat, picked):
        timeline = sorted_timeline(run["timeline"])
        times = [t for t, _ in timeline]
        classes = sorted({c for _, counts in timeline for c in counts})
        ax.stackplot(times, [[counts.get(c, 0) for _, counts in timeline] for c in classes], labels=classes)
        ax.set_title(f"{run['policy']}: resident KV tokens by class ({workload}, {pressure})", fontsize=9)
        ax.set_xlabel("trace time (s)")
        ax.set_ylabel("device-resident tokens")
        ax.legend(fontsize=7, loc="upper left")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
