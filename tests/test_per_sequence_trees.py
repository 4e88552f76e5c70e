"""Trees per sequence through the whole step: a test drafter proposes a random valid tree for every
sequence at every step (different sizes, padded to a common T), and speculative decoding must still
emit exactly the plain greedy tokens, on the real model and on every backend.

The drafter is an oracle with noise: it knows the plain greedy continuation, puts it on one random
branch of each tree (cut off at a random depth, sometimes corrupted) and random tokens elsewhere, so
long paths are accepted, rejected part-way and tied. It also writes the right next token into padded
nodes, which must never be accepted.
"""
from __future__ import annotations

import random

import pytest
import torch

import hydra_kernels as hk
from hydra_kernels.chat import chat_prompt_ids
from hydra_kernels.drafters import Drafter, Proposal
from hydra_kernels.generate import generate
from hydra_kernels.tree import TreeBatch
from helpers import DEV
from test_llama_vs_transformers import make_hf


class OracleTreeDrafter(Drafter):
    kinds = ("test-oracle-trees",)

    def __init__(self, prompts, continuations, max_nodes=9, max_depth=4, seed=0):
        super().__init__()
        self.prompts, self.continuations = prompts, continuations
        self.max_nodes, self.max_depth, self.seed = max_nodes, max_depth, seed
        self.sizes_seen: set[tuple[int, ...]] = set()
        self.max_accepted = 0

    @property
    def kind(self):
        return "test-oracle-trees"

    def check_model(self, model):
        pass

    def resolve_tree(self, tree, device_type):
        assert tree is None
        return hk.tree.chain(self.max_depth) if self.max_nodes == self.max_depth + 1 else _bound(self.max_nodes, self.max_depth)

    def start(self, model, batch_size, max_seq_len, tree, backends):
        return {"done": [0] * batch_size, "rng": random.Random(self.seed), "V": model.config.vocab_size}

    def after_prefill(self, state, hidden, lengths):
        state["done"] = [1] * len(state["done"])  # the first token came from the prefill

    def after_step(self, state, accepted_hidden, accepted_tokens, accept_lengths):
        for b, n in enumerate(accept_lengths.tolist()):
            state["done"][b] += n
            self.max_accepted = max(self.max_accepted, n)

    def propose(self, state, root, seqlens):
        rng, V = state["rng"], state["V"]
        B = root.shape[0]
        parent_lists, token_lists = [], []
        for b in range(B):
            T = rng.randint(1, self.max_nodes)
            parents, depth = [-1], [0]
            for i in range(1, T):
                cands = [j for j in range(i) if depth[j] < self.max_depth]
                p = rng.choice(cands)
                parents.append(p)
                depth.append(depth[p] + 1)
            # the oracle branch: a random leaf-ward walk from the root, each node holding the true token
            truth = self.continuations[b][state["done"][b]:]
            toks = [int(root[b])] + [rng.randrange(V) for _ in range(T - 1)]
            node, d = 0, 0
            while True:
                kids = [j for j in range(T) if parents[j] == node]
                if not kids or d >= len(truth) or rng.random() < 0.15:
                    break
                node, d = rng.choice(kids), d + 1
                toks[node] = truth[d - 1] if rng.random() > 0.1 else rng.randrange(V)
            parent_lists.append(parents)
            token_lists.append(toks)
        tree = TreeBatch.from_parent_lists(parent_lists, device=root.device)
        Tpad = tree.num_nodes
        tokens = torch.empty(B, Tpad, dtype=torch.long)
        for b, toks in enumerate(token_lists):
            truth = self.continuations[b][state["done"][b]:] + [0] * Tpad
            tokens[b] = torch.tensor(toks + [truth[0]] * (Tpad - len(toks)))  # padded: the right next token
        self.sizes_seen.add(tuple(len(t) for t in token_lists))
        return Proposal(tokens.to(root.device), tree)


def _bound(nodes, depth):
    """A static tree with `nodes` nodes and depth `depth`: the bound on every proposal (KV rows)."""
    choices = [[0] * d for d in range(1, depth + 1)]
    r = 1
    while len(choices) + 1 < nodes:
        choices.append([r])
        r += 1
    return hk.Tree(choices)


def run_oracle(model, prompts, n, backend, seed=0, batch_sizes=None):
    plain = generate(model, prompts, max_new_tokens=n, eos_token_id=[], backend=backend).sequences
    d = OracleTreeDrafter(prompts, plain, seed=seed)
    out = generate(model, prompts, drafter=d, max_new_tokens=n, eos_token_id=[], backend=backend)
    return plain, out, d


@pytest.fixture(scope="module")
def tiny():
    return hk.Llama.from_hf(make_hf("gqa3-tied", seed=5)).to(DEV)


@pytest.mark.backends("reference", "native", "triton")
def test_random_per_sequence_trees_are_lossless_tiny_model(tiny, backend):
    prompts = [[1, 2, 3, 4], [5, 6, 7, 8, 9, 10, 11], [12], [40, 41, 40, 41, 40]]
    # the Triton interpreter is slow: one seed, 16 tokens (30 took 89 s of a CI run, 2026-11-30)
    for seed in range(1 if backend == "triton" else 2):
        plain, out, d = run_oracle(tiny, prompts, 16 if backend == "triton" else 30, backend, seed)
        assert out.sequences == plain, f"seed {seed}"
        assert len(d.sizes_seen) > 1 and any(len(set(s)) > 1 for s in d.sizes_seen)  # ragged trees happened
        assert d.max_accepted >= 3  # long paths were accepted


@pytest.mark.backends("reference", "auto")
def test_random_per_sequence_trees_are_lossless_real_model(smollm2, backend):
    model, tok = smollm2
    texts = ["What is the capital of France?", "Write a haiku about the sea.", "List three prime numbers."]
    prompts = [chat_prompt_ids(tok, t) for t in texts]
    plain, out, d = run_oracle(model, prompts, 40, backend, seed=1)
    assert out.sequences == plain
    assert out.mean_accepted_tokens > 1.5 and d.max_accepted >= 3


def _padded(parent_lists):
    B, T = len(parent_lists), max(map(len, parent_lists))
    parents = torch.full((B, T), -1)
    valid = torch.zeros(B, T, dtype=torch.bool)
    for b, p in enumerate(parent_lists):
        parents[b, : len(p)] = torch.tensor(p)
        valid[b, : len(p)] = True
    return parents, valid


def test_tree_batch_from_parent_lists_equals_the_constructor():
    """The host-built TreeBatch (from_parent_lists, Python lists) has the constructor's buffers exactly:
    random trees of mixed sizes per batch (T = 1 alone, chains, bushes), padding included."""
    rng = random.Random(7)
    shapes = [[[-1]], [[-1], [-1, 0, 1, 2]], [[-1, 0, 0, 0]]]
    for _ in range(300):
        shapes.append([[-1] + [rng.randrange(i) for i in range(1, rng.randint(1, rng.choice([2, 5, 12, 20])))]
                       for _ in range(rng.randint(1, 5))])
    # past tree.HOST_BUILD_MAX mask entries the constructor builds it: both paths
    shapes.append([[-1] + [rng.randrange(i) for i in range(1, 20)] for _ in range(16)])
    assert len(shapes[-1]) * 20 * 20 > hk.tree.HOST_BUILD_MAX >= max(len(s) * max(map(len, s)) ** 2 for s in shapes[:3])
    for parent_lists in shapes:
        ref, got = TreeBatch(*_padded(parent_lists)), TreeBatch.from_parent_lists(parent_lists)
        for name in ("parents", "depths", "mask", "valid", "paths"):
            a, b = getattr(ref, name), getattr(got, name)
            assert a.dtype == b.dtype and torch.equal(a, b), (name, parent_lists)
        assert (ref.num_nodes, ref.depth, ref.max_children) == (got.num_nodes, got.depth, got.max_children)


@pytest.mark.parametrize("bad", [[[0, 0]], [[-1, 1]], [[-1, 0], [-1, 2]], [[]], []])
def test_tree_batch_from_parent_lists_refuses_bad_lists(bad):
    with pytest.raises(ValueError):
        TreeBatch.from_parent_lists(bad)
