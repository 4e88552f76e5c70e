"""Decode speed of two checkouts of hydra_kernels, interleaved in one run (before / after a change).

Each round runs checkout A, then B (then A, B, ...), each in a fresh process importing that checkout's
package (PYTHONPATH; its compiled extension must be built in place): a warm-up, then for every prompt
plain decoding and the shipped Hydra heads' speculative decoding (the same kind in both checkouts, its whole tree every
step: the same work in both, where the default budget, the adaptive one, is steered by measured times), batch 1, EOS
ignored. Prints tokens/s
per checkout and mode (median over rounds of the summed tokens / summed decode time) and the ratio
B / A; the outputs of both checkouts must be identical token for token.

    python benchmarks/bench_checkouts.py --a /path/to/old/checkout --b . [--rounds 3] [--prompts 8]
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

WORKER = r"""
import json, sys, time, torch
torch.set_grad_enabled(False)
import hydra_kernels as hk
from hydra_kernels.chat import chat_prompt_ids
from hydra_kernels.budget import whole_tree_budget
from hydra_kernels.generate import generate
from hydra_kernels.training.data import mtbench_questions
n_prompts, n_new = int(sys.argv[1]), int(sys.argv[2])
model, tok = hk.load_model(device="cpu")
drafter = hk.load_drafter(model=model, kind="hydra")  # one drafter in every checkout (the default changed)
whole = whole_tree_budget(drafter, None, "cpu")  # a fixed budget: the same steps in both checkouts
prompts = [chat_prompt_ids(tok, q["turns"][0]) for q in mtbench_questions()[:n_prompts]]
generate(model, [prompts[0]], max_new_tokens=8, eos_token_id=[])  # warm-up both paths
generate(model, [prompts[0]], drafter=drafter, budget=whole, max_new_tokens=8, eos_token_id=[])
res = {"plain": [0, 0.0], "spec": [0, 0.0], "steps": 0, "seqs": {"plain": [], "spec": []}}
for p in prompts:
    for mode in ("plain", "spec"):
        spec = dict(drafter=drafter, budget=whole) if mode == "spec" else {}
        out = generate(model, [p], max_new_tokens=n_new, eos_token_id=[], **spec)
        res[mode][0] += sum(map(sum, out.accept_lengths))
        res[mode][1] += out.decode_s
        res["seqs"][mode].append(out.sequences[0])
        if mode == "spec":
            res["steps"] += out.num_steps
print("RESULT " + json.dumps(res))
"""


def run(checkout: Path, prompts: int, new_tokens: int) -> dict:
    env = {**os.environ, "PYTHONPATH": str(checkout)}
    out = subprocess.run([sys.executable, "-c", WORKER, str(prompts), str(new_tokens)], env=env, cwd=checkout,
                         capture_output=True, text=True, check=True)
    line = next(x for x in out.stdout.splitlines() if x.startswith("RESULT "))
    return json.loads(line[len("RESULT "):])


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--a", required=True, help="checkout A (e.g. a git worktree of the commit before)")
    ap.add_argument("--b", default=".", help="checkout B (default: this one)")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--prompts", type=int, default=8, help="MT-Bench prompts per run")
    ap.add_argument("--new-tokens", type=int, default=128)
    args = ap.parse_args(argv)
    from tqdm.auto import tqdm

    ck = {"A": Path(args.a).resolve(), "B": Path(args.b).resolve()}
    tps = {(c, m): [] for c in ck for m in ("plain", "spec")}
    seqs, steps = {}, {}
    for _ in tqdm(range(args.rounds), desc="rounds"):
        for c, path in ck.items():
            r = run(path, args.prompts, args.new_tokens)
            for m in ("plain", "spec"):
                tps[(c, m)].append(r[m][0] / r[m][1])
            seqs[c], steps[c] = r["seqs"], r["steps"]
    print(f"\n{args.prompts} MT-Bench prompts x {args.new_tokens} tokens, batch 1, {args.rounds} rounds; A = {ck['A']}, B = {ck['B']}")
    print(f"{'mode':<6} {'A tok/s':>9} {'B tok/s':>9} {'B / A':>6}   per-round A | B")
    for m in ("plain", "spec"):
        a, b = statistics.median(tps[("A", m)]), statistics.median(tps[("B", m)])
        rounds = " ".join(f"{x:.1f}" for x in tps[("A", m)]) + " | " + " ".join(f"{x:.1f}" for x in tps[("B", m)])
        print(f"{m:<6} {a:>9.1f} {b:>9.1f} {b / a:>6.3f}   {rounds}")
    same = seqs["A"] == seqs["B"]
    print(f"speculative steps A {steps['A']} B {steps['B']}; outputs identical across checkouts: {same}; "
          f"speculative == plain: A {seqs['A']['spec'] == seqs['A']['plain']}, B {seqs['B']['spec'] == seqs['B']['plain']}")
    if not same:
        raise SystemExit("the two checkouts decode different tokens")
    return {"tokens_per_s": {f"{c} {m}": v for (c, m), v in tps.items()}, "steps": steps, "identical": same}


if __name__ == "__main__":
    main()
