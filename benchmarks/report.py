"""Shared by the benchmark scripts: a CSV of the rows and, when matplotlib is there, a plot; timing; naming a
drafter on the command line."""
from __future__ import annotations

import csv
from pathlib import Path
from typing import Callable

import torch


def drafter_by_name(name: str, model):
    """A drafter named on a command line: a directory (any format hk.load_drafter reads), else a shipped or
    composed kind (hk.load_drafter(kind=name), which names the shipped kinds when it is neither)."""
    import hydra_kernels as hk

    return hk.load_drafter(name, model=model) if Path(name).is_dir() else hk.load_drafter(model=model, kind=name)


def time_us(fn, device, reps: int = 200, warmup: int = 10) -> float:
    """Median microseconds of fn() (CUDA: events around each call, after a synchronize)."""
    import time

    device = torch.device(device)
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(reps):
        if device.type == "cuda":
            torch.cuda.synchronize()
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            fn()
            b.record()
            torch.cuda.synchronize()
            times.append(a.elapsed_time(b) * 1e3)
        else:
            t = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t) * 1e6)
    return sorted(times)[len(times) // 2]


def capture_graph(fn, calls: int = 1, warmup: int = 1):
    """(a CUDA graph of `calls` back-to-back calls of fn, the captured last call's output), after `warmup`
    eager calls on a side stream (autotuning, compiles and allocator pools settle off the capture)."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(warmup):
            fn()
    torch.cuda.current_stream().wait_stream(side)
    graph, out = torch.cuda.CUDAGraph(), None
    with torch.cuda.graph(graph):
        for _ in range(calls):
            out = fn()
    return graph, out


def graph_us(fn, device, calls: int = 20, reps: int = 20) -> float:
    """Median microseconds per call of fn replayed from one CUDA graph of `calls` back-to-back calls: the
    GPU's time without the host's per-launch overhead (eager timings of a small kernel mostly measure Python
    and the launch path; a serving engine replays captured steps). NaN off CUDA, or where fn cannot be
    captured (the reason is printed)."""
    device = torch.device(device)
    if device.type != "cuda":
        return float("nan")
    try:
        graph, _ = capture_graph(fn, calls, warmup=3)
    except Exception as e:  # noqa: BLE001 - reported, the eager time still stands
        print(f"graph capture failed: {type(e).__name__}: {e}"[:200])
        return float("nan")
    return time_us(graph.replay, device, reps=reps, warmup=2) / calls


def plotted_fraction(row: dict) -> float:
    """The fraction of copy bandwidth a plot shows for a row: the CUDA-graph time's where there is one (the
    GPU's own time), else the eager time's (the CPU)."""
    g = row.get("graph_frac_copy_bw", float("nan"))
    return g if g == g else row["frac_copy_bw"]


def copy_bandwidth_gbs(device, nbytes: int = 1 << 30) -> float:
    """The memory ceiling measured here: device-to-device copy of nbytes, (read + write) / time."""
    device = torch.device(device)
    if device.type == "cpu":
        nbytes = min(nbytes, 1 << 28)
    src = torch.empty(nbytes // 4, dtype=torch.float32, device=device).fill_(1.0)
    dst = torch.empty_like(src)
    us = time_us(lambda: dst.copy_(src), device, reps=20, warmup=3)
    return 2 * nbytes / (us * 1e-6) / 1e9


def print_table(rows: list[dict], cols: list[str]) -> None:
    """Rows as an aligned text table (floats with 3 significant digits)."""
    fmt = lambda v: f"{v:.3g}" if isinstance(v, float) else str(v)
    cells = [[fmt(r.get(c, "")) for c in cols] for r in rows]
    widths = [max(len(c), *(len(x[i]) for x in cells)) for i, c in enumerate(cols)]
    print("  ".join(c.rjust(w) for c, w in zip(cols, widths)))
    for x in cells:
        print("  ".join(v.rjust(w) for v, w in zip(x, widths)))


def write_results(rows: list[dict], out_dir: str | Path, name: str, plot: Callable | None = None) -> None:
    """Write out_dir/name.csv; call plot(ax) and save out_dir/name.png if matplotlib is installed."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    with open(out_dir / f"{name}.csv", "w", newline="") as f:
        # every row's columns, first seen first (a row may carry one the first lacks: a search's "invalid")
        w = csv.DictWriter(f, fieldnames=list(dict.fromkeys(k for r in rows for k in r)))
        w.writeheader()
        w.writerows(rows)
    if plot is None:
        print(f"wrote {out_dir / name}.csv")
        return
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print(f"wrote {out_dir / name}.csv (matplotlib not installed: no plot)")
        return
    fig, ax = plt.subplots(figsize=(6, 3.5))
    plot(ax)
    fig.tight_layout()
    fig.savefig(out_dir / f"{name}.png", dpi=120)
    plt.close(fig)
    print(f"wrote {out_dir / name}.csv and {out_dir / name}.png")


def running_mean(values: list[float], k: int = 25) -> list[float]:
    """Mean over a sliding window of k (one training step's figures are noisy); shorter lists as they are."""
    ys = torch.tensor(values, dtype=torch.float64)
    return torch.nn.functional.avg_pool1d(ys[None, None], k, 1)[0, 0].tolist() if len(ys) > k else ys.tolist()


def plot_training(ax, rows: list[dict], acc_cols: list[str], acc_labels: list[str], title: str) -> None:
    """A training run's curves: the loss on the left axis, top-1 agreement with the base model (0..1) on
    the right one, each a running mean over 25 steps."""
    ax.plot(running_mean([r["loss"] for r in rows]), color="k", label="loss")
    ax.set_xlabel("step")
    ax.set_ylabel("loss")
    ax2 = ax.twinx()
    for col, label in zip(acc_cols, acc_labels):
        ax2.plot(running_mean([r.get(col, float("nan")) for r in rows]), label=label)
    ax2.set_ylabel("top-1 agreement with the base model")
    ax2.set_ylim(0, 1)
    ax.set_title(title)
    ax.legend(loc="upper left")
    ax2.legend(loc="upper right")


def plot_ratio_by_batch(ax, rows: list[dict], series: dict[str, Callable[[dict], float]], ylabel: str) -> None:
    """Per context (rows' "context"), each series' ratio to plain decoding against the batch size (log 2),
    with the plain line at 1: the scaling benchmark's and the budget search's plots."""
    for C in dict.fromkeys(r["context"] for r in rows):
        rs = [r for r in rows if r["context"] == C]
        for name, ratio in series.items():
            ax.plot([r["batch"] for r in rs], [ratio(r) for r in rs], marker="o", label=f"{name}, context {C}")
    ax.axhline(1.0, color="k", linewidth=0.8)
    ax.set_xscale("log", base=2)
    ax.set_xlabel("batch size")
    ax.set_ylabel(ylabel)
    ax.legend(fontsize=6)
