"""How far int8 activations move the model: the embedded GGUF loaded exact (fp32 activations) and with
activations="int8" (ops/int8_dot_linear.py), both teacher-forced over the same text: MT-Bench first turns followed by
the exact model's own greedy answer. Per answer position: whether both models' next-token argmax agree, KL(exact ||
int8) of the next-token distributions, and each model's negative log-likelihood of the exact model's token.

    python benchmarks/bench_int8_agreement.py [--prompts 16] [--new-tokens 128] [--out DIR]

What it shows: int8 activations make another model (its greedy tokens part from the exact model's within ~25 tokens
on MT-Bench, as llama.cpp's do: bench_cpu_peers.py); this says by how much, position by position. One row per prompt,
and a last row over all positions.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
from report import print_table, write_results

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import hydra_kernels as hk  # noqa: E402
from hydra_kernels.chat import chat_prompt_ids  # noqa: E402
from hydra_kernels.generate import generate  # noqa: E402
from hydra_kernels.training import mtbench_questions  # noqa: E402


def next_token_logprobs(model, ids: list[int], first: int) -> torch.Tensor:
    """log-softmax of the model's next-token logits after each position in [first - 1, len(ids) - 1) -> [n, V]."""
    seq = torch.tensor([ids])
    cache = model.new_kv_cache(1, len(ids) + 1)
    h = model.prefill(seq, torch.tensor([len(ids)], dtype=torch.int32), cache, all_hidden=True)
    return model.output(h[0, first - 1:-1]).log_softmax(-1)


def main(argv=None) -> list[dict]:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--prompts", type=int, default=16, help="MT-Bench first turns")
    ap.add_argument("--new-tokens", type=int, default=128, help="the exact model's greedy answer's length")
    ap.add_argument("--out", default=None, help="write int8_agreement.csv there")
    args = ap.parse_args(argv)
    if args.prompts < 1 or args.new_tokens < 1:
        ap.error("--prompts and --new-tokens must be >= 1")
    torch.set_grad_enabled(False)
    exact, tok = hk.load_model()
    int8, _ = hk.load_model(activations="int8")
    rows, agree, kls, nll = [], [], [], {"exact": [], "int8": []}
    for i, q in enumerate(mtbench_questions()[:args.prompts]):
        prompt = chat_prompt_ids(tok, q["turns"][0])
        answer = generate(exact, [prompt], max_new_tokens=args.new_tokens).sequences[0]
        ids, target = prompt + answer, torch.tensor(answer)
        a, b = (next_token_logprobs(m, ids, len(prompt)) for m in (exact, int8))
        agree.append(a.argmax(-1) == b.argmax(-1))
        kls.append((a.exp() * (a - b)).sum(-1))
        for name, lp in (("exact", a), ("int8", b)):
            nll[name].append(-lp.gather(1, target[:, None])[:, 0])
        rows.append(dict(prompt=i, positions=len(answer), top1_agreement=round(agree[-1].float().mean().item(), 4),
                         kl_mean=round(kls[-1].mean().item(), 5), nll_exact=round(nll["exact"][-1].mean().item(), 4),
                         nll_int8=round(nll["int8"][-1].mean().item(), 4)))
    kl = torch.cat(kls)
    rows.append(dict(prompt="all", positions=kl.numel(), top1_agreement=round(torch.cat(agree).float().mean().item(), 4),
                     kl_mean=round(kl.mean().item(), 5), kl_median=round(kl.median().item(), 5),
                     kl_p99=round(kl.quantile(0.99).item(), 4), nll_exact=round(torch.cat(nll["exact"]).mean().item(), 4),
                     nll_int8=round(torch.cat(nll["int8"]).mean().item(), 4)))
    print(f"the embedded GGUF, exact vs int8 activations, teacher-forced on {args.prompts} MT-Bench prompts + the exact "
          f"model's {args.new_tokens}-token greedy answers")
    print_table(rows[-1:], list(rows[-1]))
    if args.out:
        write_results(rows, args.out, "int8_agreement")
    return rows


if __name__ == "__main__":
    main()
