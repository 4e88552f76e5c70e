"""Recipe: store trained heads in bf16 (what is shipped and what the evaluation measures).

    .venv/bin/python python/ship_heads.py --src runs/heads --dst runs/ship            # all kinds, bf16
    .venv/bin/python python/ship_heads.py --src runs/ship --package hydra++ medusa    # into the package
    .venv/bin/python python/ship_heads.py --src runs/eagle --kinds eagle --draft-vocab 8192  # fewer LM-head rows
    .venv/bin/python python/ship_heads.py --default hydra --measured "1.21x plain, batch 1 (results README, date)"
    .venv/bin/python python/ship_heads.py --default combined --heads hydra --measured "..."

--package copies the named kinds (with their tree_cpu.json / budget_cpu.json) into
hydra_kernels/heads/smollm2-135m-instruct/, replacing those kinds and keeping the others, and refuses more
than 64 MB in total (Amphista's three decoder blocks alone are 25.5 MB in bf16: a draft vocabulary cannot
shrink them). --draft-vocab N keeps the first N (most frequent) ids of each drafter's draft
vocabulary (drafters/fit.draft_vocab_prefix: for drafters that rank with the base model's LM head). Any
drafter kind in our format ships this way (e.g. --kinds mlp_speculator). --default KIND names the shipped
kind hk.load_drafter() returns (the fastest measured; --measured says by which measurement), in default.json;
a composed kind (--default combined) names the shipped heads it is built over (--heads hydra).
"""
from __future__ import annotations

import argparse
import json
import shutil
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import hydra_kernels as hk  # noqa: E402
from hydra_kernels.drafters import SHIPPED_DIR, SHIPPED_MODEL  # noqa: E402
from hydra_kernels.drafters.registry import (COMPOSED, DEFAULT_FILE, check_default_entry,  # noqa: E402
                                             composed_tables_dir, shipped_drafters)
from hydra_kernels.drafters.fit import draft_vocab_prefix  # noqa: E402

LIMIT_MB = 64


def write_default(ap, kind: str, measured: str | None, heads: str | None) -> None:
    """default.json := kind (shipped, or COMPOSED over the shipped static-tree kind `heads`, which needs its
    budget table searched: python/search_budget.py --kind KIND) and its measurement, checked as the registry
    checks it (check_default_entry); the old batch_1 entry stays only where it was measured over the same
    heads and names another kind than the new default."""
    shipped = shipped_drafters()
    if not measured:
        ap.error("--default needs --measured: the figure, machine, date and command that make it the fastest")
    f = SHIPPED_DIR / SHIPPED_MODEL / DEFAULT_FILE
    old = json.loads(f.read_text()) if f.exists() else {}
    old_heads = old.get("heads", old.get("kind"))
    entry = {"kind": kind, "measured": measured}
    if kind in COMPOSED:
        entry["heads"] = heads or old_heads
    elif heads is not None:
        ap.error(f"--heads goes with a composed --default {COMPOSED}, not {kind!r}")
    try:
        _, _, new_heads = check_default_entry(entry, shipped)
    except ValueError as e:
        ap.error(f"--default {kind!r}: {e}; package the kind first (--package), or name shipped --heads")
    if kind in COMPOSED and not list(composed_tables_dir(kind, new_heads).glob("budget_*.json")):
        ap.error(f"--default {kind!r} over {new_heads!r} has no budget table (it would draft at every batch size): "
                 f"python/search_budget.py --kind {kind} first")
    if "batch_1" in old:  # the batch-1 choice was measured over the old heads (a combined drafter's)
        if old_heads == new_heads and old["batch_1"].get("kind") != kind:
            entry["batch_1"] = old["batch_1"]
        else:
            print(f"dropped default.json's batch_1 entry ({old['batch_1'].get('kind')!r}): it was measured over "
                  f"{old_heads!r} or names the new default; measure again (benchmarks/bench_drafters.py) if it differs")
    f.write_text(json.dumps(entry, indent=1) + "\n")
    print(f"load_drafter() now returns {kind!r}" + (f" over {new_heads!r}" if kind in COMPOSED else ""))


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--src", default="runs/heads")
    ap.add_argument("--dst", default="runs/ship")
    ap.add_argument("--kinds", nargs="+", default=["medusa", "hydra", "hydra++"])
    ap.add_argument("--package", nargs="*", default=None, help="kinds to copy into the package")
    ap.add_argument("--draft-vocab", type=int, default=None, help="keep this many ids of the draft vocabulary")
    ap.add_argument("--default", default=None,
                    help="the kind hk.load_drafter() returns (default.json): shipped, or composed over --heads")
    ap.add_argument("--measured", default=None, help="with --default: the measurement that makes it the fastest")
    ap.add_argument("--heads", default=None,
                    help="with a composed --default (combined): the shipped static-tree kind it is built over "
                         "(default: default.json's current heads)")
    args = ap.parse_args(argv)
    if args.default is not None:
        write_default(ap, args.default, args.measured, args.heads)
        return
    if args.heads is not None or args.measured is not None:
        ap.error("--heads and --measured go with --default")
    src = Path(args.src)
    if args.package is None:
        for kind in args.kinds:
            d = hk.load_drafter(src / kind)
            if args.draft_vocab is not None:
                d = draft_vocab_prefix(d, args.draft_vocab)
            d.save(Path(args.dst) / kind, dtype=torch.bfloat16)
            mb = (Path(args.dst) / kind / "model.safetensors").stat().st_size / 2**20
            print(f"{kind}: {sum(p.numel() for p in d.parameters()) / 1e6:.2f} M parameters, {mb:.1f} MB in bf16")
        return
    root = SHIPPED_DIR / SHIPPED_MODEL
    files = lambda d: [f for f in d.iterdir() if f.suffix in (".json", ".safetensors")]  # noqa: E731
    kept = [d for d in (root.iterdir() if root.exists() else []) if d.is_dir() and d.name not in args.package]
    total = sum(f.stat().st_size for d in [src / k for k in args.package] + kept for f in files(d))
    if total > LIMIT_MB * 2**20:
        raise SystemExit(f"{total / 2**20:.1f} MB > {LIMIT_MB} MB with the shipped {[d.name for d in kept]}: ship fewer kinds")
    for kind in args.package:  # replaces these kinds; the other shipped kinds stay
        if (root / kind).exists():
            shutil.rmtree(root / kind)
        (root / kind).mkdir(parents=True)
        for f in files(src / kind):
            shutil.copy(f, root / kind / f.name)
    print(f"packaged {args.package} beside {[d.name for d in kept]} ({total / 2**20:.1f} MB in all) into {root}")

if __name__ == "__main__":
    main()
