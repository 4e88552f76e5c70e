"""Resident memory (RSS) of a fresh process after hk.load_model() and after one generate (plain and with
the shipped drafter): `python benchmarks/mem_load_model.py` (about 30 s on the 2-core dev CPU). Memory,
not timing: the figure does not depend on other load."""
from __future__ import annotations

import argparse
import json


def rss_mb() -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    raise RuntimeError("no VmRSS in /proc/self/status (Linux only)")


def main() -> dict:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--max-new-tokens", type=int, default=32)
    a = ap.parse_args()
    import torch

    import hydra_kernels as hk
    from hydra_kernels.generate import generate

    out = {"import_mb": rss_mb()}
    model, tok = hk.load_model(device="cpu")
    out["load_model_mb"] = rss_mb()
    ids = [tok.encode("Explain what a KV cache is in two sentences.")]
    generate(model, ids, max_new_tokens=a.max_new_tokens)
    out["after_plain_generate_mb"] = rss_mb()
    drafter = hk.load_drafter(model=model)
    generate(model, ids, drafter=drafter, max_new_tokens=a.max_new_tokens)
    out["after_speculative_generate_mb"] = rss_mb()
    from hydra_kernels.model.packed_linear import Linear

    params = sum(p.numel() * p.element_size() for p in model.parameters() if not p.is_meta)
    panels = sum(m.weight_bytes() for m in model.modules() if isinstance(m, Linear) and m.packed_on)
    out["model_parameters_mb"] = params / 2**20  # stored as parameters (released ones are meta: not counted)
    out["packed_panels_mb"] = panels / 2**20
    print(json.dumps({k: round(v, 1) for k, v in out.items()}, indent=1))
    return out


if __name__ == "__main__":
    main()
