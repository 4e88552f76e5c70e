"""Shared output of the benchmark scripts: a CSV of the rows and, when matplotlib is there, a plot."""
from __future__ import annotations

import csv
from pathlib import Path
from typing import Callable

import torch


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
        w = csv.DictWriter(f, fieldnames=list(rows[0]))
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
