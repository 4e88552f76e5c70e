"""Shared output of the benchmark scripts: a CSV of the rows and, when matplotlib is there, a plot."""
from __future__ import annotations

import csv
from pathlib import Path
from typing import Callable


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
