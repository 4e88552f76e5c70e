"""Shared test helpers: the test device, random trees (static and padded per-sequence batches), tolerance
rules, mismatch reports, the repo's scripts as modules."""
from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import SimpleNamespace

import torch

ROOT = Path(__file__).resolve().parents[1]

# The device op tests run on: the GPU tier where there is one, else the CPU tier (Triton interpreted).
DEV = "cuda" if torch.cuda.is_available() else "cpu"

# Tolerances by dtype (STYLE.md): fp32 runs must agree to ~1e-4 of the output's scale; half
# precisions to a few units of their epsilon (2^-8 for bf16, 2^-11 for fp16) times the scale.
RTOL = {torch.float32: 1e-4, torch.bfloat16: 2e-2, torch.float16: 4e-3}


def random_parents(T: int, gen: torch.Generator) -> list[int]:
    """Parents of a random tree with T nodes in BFS-compatible order (parent index < own index)."""
    return [-1] + [int(torch.randint(0, i, (1,), generator=gen)) for i in range(1, T)]


def tree_from_parents(parents: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """(ancestor-or-self mask bool [T, T], depths int64 [T]) of a parent list."""
    T = len(parents)
    mask = torch.zeros(T, T, dtype=torch.bool)
    depths = torch.zeros(T, dtype=torch.long)
    for i in range(T):
        j = i
        while j >= 0:
            mask[i, j] = True
            j = parents[j]
        depths[i] = int(mask[i].sum()) - 1
    return mask, depths


def random_tree(gen: torch.Generator, num_nodes: int, depth: int = 4):
    """A random static hk.Tree of num_nodes nodes, root included (Medusa-format choices)."""
    from hydra_kernels.tree import Tree
    from test_tree import random_choices

    return Tree(random_choices(gen, n=num_nodes - 1, depth=depth)) if num_nodes > 1 else Tree([])


def pad_trees(trees, T: int | None = None) -> SimpleNamespace:
    """The per-sequence form of one tree per sequence, padded to a common T (default: the largest) as the
    ops take it: parents [B, T] and depths [B, T] (padding: -1 and 0), ancestor-or-self mask [B, T, T] (a
    padded node sees only itself), leaf paths [B, P, D+1] (-1 padded; missing leaves are [0, -1, ...]),
    plus `sizes` (each tree's own node count) and `valid` bool [B, T]."""
    B = len(trees)
    T = T or max(t.num_nodes for t in trees)
    P = max(t.paths.shape[0] for t in trees)
    D1 = max(t.paths.shape[1] for t in trees)
    parents = torch.full((B, T), -1, dtype=torch.long)
    depths = torch.zeros(B, T, dtype=torch.long)
    mask = torch.eye(T, dtype=torch.bool).repeat(B, 1, 1)
    paths = torch.full((B, P, D1), -1, dtype=torch.long)
    paths[:, :, 0] = 0
    valid = torch.zeros(B, T, dtype=torch.bool)
    for b, t in enumerate(trees):
        n = t.num_nodes
        parents[b, :n], depths[b, :n], mask[b, :n, :n], valid[b, :n] = t.parents, t.depths, t.mask, True
        paths[b, : t.paths.shape[0], : t.paths.shape[1]] = t.paths
    return SimpleNamespace(parents=parents, depths=depths, mask=mask, paths=paths, valid=valid,
                           sizes=[t.num_nodes for t in trees])


def random_tree_batch(gen: torch.Generator, sizes: list[int], depth: int = 4):
    """(one random static tree per sequence of the given node counts, their padded per-sequence form)."""
    trees = [random_tree(gen, n, depth) for n in sizes]
    return trees, pad_trees(trees)


def planted(gen: torch.Generator, B: int, parents: torch.Tensor, V: int, p_accept: float = 0.6):
    """(target [B, T], tokens [B, T]): random target tokens; each node copies its parent's target with
    probability p_accept, so paths of several lengths are accepted. parents [T] or [B, T] (-1: root,
    padding)."""
    parents = parents.expand(B, -1)
    T = parents.shape[1]
    target = torch.randint(0, V, (B, T), generator=gen)
    tokens = torch.randint(0, V, (B, T), generator=gen)
    for i in range(1, T):
        hit = (torch.rand(B, generator=gen) < p_accept) & (parents[:, i] >= 0)
        tokens[:, i] = torch.where(hit, target.gather(1, parents[:, i : i + 1].clamp(min=0))[:, 0], tokens[:, i])
    return target, tokens


def assert_close_rel(actual: torch.Tensor, expected: torch.Tensor, rtol: float, what: str = "") -> None:
    """max |actual - expected| <= rtol * max |expected|, with the worst index in the message."""
    actual, expected = actual.cpu(), expected.cpu()
    diff = (actual.double() - expected.double()).abs()
    scale = expected.double().abs().max().clamp_min(1e-30)
    worst = diff.max()
    if not worst <= rtol * scale:
        idx = tuple(int(i) for i in torch.unravel_index(diff.argmax(), diff.shape))
        raise AssertionError(
            f"{what}: max |diff| {worst:.3e} > {rtol:.1e} * max |ref| {scale:.3e} at {idx}: "
            f"got {actual[idx].item():.6g}, expected {expected[idx].item():.6g}"
        )


def assert_same_verification(got, expected, what: str = "") -> None:
    """Two Verification results are equal field by field (on any devices)."""
    for name, x, y in zip(got._fields, got, expected):
        assert torch.equal(x.cpu(), y.cpu()), f"{what}: {name} differs: got {x.tolist()}, expected {y.tolist()}"


POISON_INT = -7777  # what poison_allocations fills integer buffers with (floats: NaN)


def poison_allocations(monkeypatch) -> None:
    """From now on in the test, torch.empty returns tensors filled with garbage (NaN; POISON_INT for
    integer dtypes), so an output element a kernel launcher allocates and the kernel never writes shows."""
    real = torch.empty

    def empty(*size, **kwargs):
        t = real(*size, **kwargs)
        return t.fill_(float("nan") if t.dtype.is_floating_point else POISON_INT)

    monkeypatch.setattr(torch, "empty", empty)


def load_script(relpath: str):
    """A script of the repo that is not a package module (python/*.py, benchmarks/*.py) as a module, loaded
    afresh and registered in sys.modules under its file name (a dataclass in it looks its module up there)."""
    path = ROOT / relpath
    spec = importlib.util.spec_from_file_location(path.stem, path)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[path.stem] = mod
    spec.loader.exec_module(mod)
    return mod
