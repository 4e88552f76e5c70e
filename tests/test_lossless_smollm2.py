"""Lossless: greedy speculative decoding emits exactly the plain greedy tokens, with the real SmolLM2
(fp32), on 10 MT-Bench first-turn prompts x 128 new tokens (64 for untrained heads), for every drafter kind briefly
trained, untrained Hydra++ heads, and the shipped heads.

The "briefly trained" heads are fitted on the plain greedy continuations of these same prompts, on
purpose: this is a correctness test, and heads that know the answer accept long paths (checked
below), which exercises multi-token commits, EOS inside accepted paths and the exact length budget.
Held-out acceptance is measured by the training recipes, not here.
"""
import os

import pytest
import torch

import hydra_kernels as hk
from hydra_kernels.budget import whole_tree_budget
from hydra_kernels.chat import chat_prompt_ids
from hydra_kernels.generate import generate
from hydra_kernels.training import compute_hidden_states, mtbench_questions, train_drafter

N_NEW = 128
KINDS = ["medusa", "hydra", "hydra++"]
SMALL_TREE = [[0], [1], [0, 0], [0, 1], [1, 0], [0, 0, 0], [0, 0, 0, 0]]  # 8 nodes, depth 4
TINY_TREE = [[0], [1], [0, 0]]  # untrained heads are rarely accepted: keep their (costly) runs small


@pytest.fixture(scope="module")
def prompts(smollm2):
    _, tok = smollm2
    return [chat_prompt_ids(tok, q["turns"][0]) for q in mtbench_questions()[:10]]


@pytest.fixture(scope="module")
def plain(smollm2, prompts):
    """The definition: plain greedy decoding, one prompt at a time."""
    model, _ = smollm2
    return [generate(model, [p], max_new_tokens=N_NEW).sequences[0] for p in prompts]


@pytest.fixture(scope="module")
def trained(smollm2, prompts, plain):
    model, _ = smollm2
    # a 4096-token draft vocabulary holding every token of these sequences (as the shipped heads rank
    # a 16k one): 12x less LM-head work per training step than the whole 49k vocabulary (CI time)
    seen = {t for p, s in zip(prompts, plain) for t in p + s}
    vocab = sorted(seen) + [t for t in range(model.config.vocab_size) if t not in seen][: 4096 - len(seen)]
    out = {}
    data = compute_hidden_states(model, [p + s for p, s in zip(prompts, plain)], progress=False)  # once, for all kinds
    for kind in KINDS:
        torch.manual_seed(0)
        d = hk.new_drafter(model, kind=kind, num_heads=4, num_layers=1, draft_vocab=vocab)
        train_drafter(model, d, data, steps=60, lr=1e-2, positions_per_step=64,
                      distill_weight=0.0, progress=False)  # next-token CE on these outputs: cheap, and enough here
        out[kind] = d
    return out


def first_diff(a, b):
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


# Untrained heads: almost every draft is rejected. One kind is enough here (the trained tests below
# run every kind through the same code, with rejections at most steps too); hydra++ has the most state
# (its prefix layer's KV buffer). CI time: each real-model run costs ~25 s.
@pytest.mark.parametrize("kind", ["hydra++"])
def test_untrained_drafter_is_lossless(smollm2, prompts, plain, kind):
    model, _ = smollm2
    torch.manual_seed(1)
    d = hk.new_drafter(model, kind=kind, num_heads=4, num_layers=1)
    n = N_NEW // 2  # ~1 token per step here: half the budget already gives 64 rejecting steps (CI time)
    out = generate(model, prompts, drafter=d, tree=TINY_TREE, max_new_tokens=n)  # ragged batch of 10
    for b, (got, ref) in enumerate(zip(out.sequences, plain)):
        assert got == ref[:n], f"prompt {b}: first difference at token {first_diff(got, ref)}"
    assert out.mean_accepted_tokens >= 1.0


@pytest.mark.parametrize("kind", KINDS)
def test_trained_drafter_is_lossless_and_accepts(smollm2, prompts, plain, trained, kind):
    model, _ = smollm2
    out = generate(model, prompts, drafter=trained[kind], tree=SMALL_TREE, max_new_tokens=N_NEW)
    for b, (got, ref) in enumerate(zip(out.sequences, plain)):
        assert got == ref, f"prompt {b}: first difference at token {first_diff(got, ref)}"
    assert out.mean_accepted_tokens > 1.5, "trained heads should accept multi-token paths here"
    assert max(max(a) for a in out.accept_lengths) == 5  # a full depth-4 path + the next root


def test_ragged_batch_of_three_with_default_tree(smollm2, prompts, plain, trained):
    model, _ = smollm2
    idx = [0, 3, 7]
    assert len({len(prompts[i]) for i in idx}) == 3
    out = generate(model, [prompts[i] for i in idx], drafter=trained["hydra"], max_new_tokens=N_NEW)
    for b, i in enumerate(idx):
        assert out.sequences[b] == plain[i]
        assert sum(out.accept_lengths[b]) + 1 == len(plain[i])  # the prefill emits the first token


@pytest.mark.requires("triton")
def test_triton_backend_equals_reference_on_smollm2(smollm2, prompts, plain, trained):
    """backend="triton": tree attention, greedy verify and commit_kv all as Triton kernels (under the
    interpreter on the CPU tier), token for token the plain greedy output; a ragged batch of 2.
    The trained Hydra heads' 4096-token draft vocabulary keeps their LM head small enough for the
    interpreter; 8 tokens (3-4 steps x 30 layers of interpreted kernels) keep CI time down (12 took 108-142 s of a
    CI run, 2026-11-29)."""
    model, _ = smollm2
    n = 8
    idx = [1, 4]
    out = generate(model, [prompts[i] for i in idx], drafter=trained["hydra"], tree=SMALL_TREE, max_new_tokens=n,
                   backend="triton")
    for b, i in enumerate(idx):
        assert out.sequences[b] == plain[i][:n], f"prompt {i}: first difference at {first_diff(out.sequences[b], plain[i])}"
    assert out.mean_accepted_tokens > 1.5



def test_shipped_heads_are_lossless_with_their_cpu_tree(smollm2, prompts, plain):
    """The heads inside the package (python/train_heads.py + eval_heads.py + ship_heads.py) with the
    tree searched for the CPU: what hk.load_drafter(kind=...) gives a user (the CLI and `make demo` take the
    batch-1 kind: the next test)."""
    model, _ = smollm2
    shipped = hk.drafters.shipped_drafters()
    assert shipped, "no heads shipped in hydra_kernels/heads/"
    for kind in shipped:
        d = hk.load_drafter(model=model, kind=kind)
        if hasattr(d, "trees"):  # head drafters: a searched tree (an MLPSpeculator builds its own every step)
            assert "cpu" in d.trees, f"shipped {kind} heads have no CPU tree"
        assert "cpu" in d.budget_tables, f"shipped {kind} drafter has no CPU budget table"
        # the odd prompts at the default budget (64 tokens), the even ones below with the whole tree (128): each prompt
        # once (both runs over all 10, 128 tokens, took 173 s of a CI run, 2026-11-30)
        n = N_NEW // 2
        out = generate(model, prompts[1::2], drafter=d, max_new_tokens=n)  # tree=None: the shipped CPU tree
        for b, (got, ref) in enumerate(zip(out.sequences, plain[1::2])):
            assert got == ref[:n], f"{kind}, prompt {2 * b + 1}: first difference at token {first_diff(got, ref)}"
        # trained heads clearly accept: untrained ones give 1.00-1.02 here; the shipped 3-node CPU trees (depth 1
        # for medusa, 2 for hydra) gave 1.35 / 1.44 on MT-Bench's 80 first turns; medusa 1.30 on these prompts;
        # the shipped mlp_speculator (8 candidates) 1.59 on MT-Bench
        # the default budget (the adaptive one, the shipped budget_cpu.json its bound) may run plain steps at this
        # batch size: the acceptance check pins the full CPU tree, on every other prompt (a batch of 5: the same steps as all 10,
        # half the rows; the MLPSpeculator's 25-node tree at batch 10 took 43 s of CI's time alone, 2026-11-29)
        full = generate(model, prompts[::2], drafter=d, max_new_tokens=N_NEW,
                        budget=whole_tree_budget(d, None, "cpu"))
        assert full.sequences == plain[::2]
        assert full.mean_accepted_tokens > 1.2, f"shipped {kind} heads accept {full.mean_accepted_tokens:.2f} tokens/step"


def test_batch_1_default_is_lossless_one_prompt_at_a_time(smollm2, prompts, plain):
    """What the CLI and `make demo` decode with: default.json's batch_1 kind (the combined drafter composed of
    the n-gram drafter and the shipped heads), one prompt at a time, as they run it, at its default budget (the adaptive
    one on the CPU). A composed kind ships a CPU budget table searched over those heads (python/search_budget.py
    --kind combined): what budget="auto" runs, and what makes the adaptive budget its default."""
    from hydra_kernels.budget import tree_key
    from hydra_kernels.drafters.registry import COMPOSED, default_kind

    model, _ = smollm2
    d = hk.load_drafter(model=model, kind=default_kind(batch_1=True))
    if d.kind in COMPOSED:
        table = d.budget_tables.get("cpu")
        assert table is not None and table.tree == tree_key(d.resolve_tree(None, "cpu")), \
            f"the composed {d.kind} drafter has no CPU budget table searched over its heads"
    # its default budget (budget=None: the adaptive one), which may run plain steps where no draft pays, on the odd
    # prompts, and the table's largest budget every step on the even ones, so the drafting itself is shown lossless
    # with power: each prompt once (both budgets over all 10 took 58 s of a CI run, 2026-11-30)
    largest = max(max(row) for row in table.nodes) if d.kind in COMPOSED else None
    for budget, some in ((None, slice(1, None, 2)), (largest, slice(0, None, 2))):
        steps = tokens = 0
        for p, ref in zip(prompts[some], plain[some]):
            out = generate(model, [p], drafter=d, max_new_tokens=N_NEW, budget=budget)
            assert out.sequences[0] == ref, f"{d.kind}: first difference at token {first_diff(out.sequences[0], ref)}"
            steps, tokens = steps + out.num_steps, tokens + len(ref) - 1
    assert tokens / steps > 1.2, f"the batch-1 default at {largest} nodes drafts {tokens / steps:.2f} tokens/step"


def test_cpu_verify_step_is_bit_identical_to_single_token_steps(smollm2, prompts):
    """Exact by construction on the CPU default path (packed linears + the fp32 native tree attention):
    a 7-token chain verified in one step gives bit-for-bit the hidden states and greedy tokens of 7
    single-token decoding steps, so greedy tree verification can never disagree with plain decoding."""
    from hydra_kernels.model.packed_linear import packed_linear_available

    model, _ = smollm2
    if model.device.type != "cpu" or not packed_linear_available():
        pytest.skip("the bit-identity holds on the packed CPU path (AVX-512 with the built extension)")
    assert model.has_packed_weights, "load_model should pack CPU fp32 weights by default"
    p = prompts[0]
    chain = torch.tensor([p[-7:]])  # 7 real tokens, fed after the rest of the prompt
    prefix = torch.tensor([p[:-7]])
    L = prefix.shape[1]
    with torch.inference_mode():
        hs = []
        for T in (7, 1):
            cache = model.new_kv_cache(1, L + 16)
            model.prefill(prefix, torch.tensor([L], dtype=torch.int32), cache)
            if T == 7:
                hs.append(model.step(chain, cache, kv_len=L + 7)[0])
            else:
                rows = []
                for t in range(7):
                    rows.append(model.step(chain[:, t:t + 1], cache, kv_len=L + t + 1)[0, 0])
                    cache.advance(1)
                hs.append(torch.stack(rows))
        tree_h, step_h = hs
        assert torch.equal(tree_h, step_h), f"max |diff| {(tree_h - step_h).abs().max().item():.3g}"
        assert torch.equal(model.greedy_tokens(tree_h), torch.stack([model.greedy_tokens(h[None])[0] for h in step_h]))
