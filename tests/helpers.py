"""Shared test helpers: random trees, tolerance rules, mismatch reports."""
from __future__ import annotations

import torch

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


def assert_close_rel(actual: torch.Tensor, expected: torch.Tensor, rtol: float, what: str = "") -> None:
    """max |actual - expected| <= rtol * max |expected|, with the worst index in the message."""
    diff = (actual.double() - expected.double()).abs()
    scale = expected.double().abs().max().clamp_min(1e-30)
    worst = diff.max()
    if not worst <= rtol * scale:
        idx = tuple(int(i) for i in torch.unravel_index(diff.argmax(), diff.shape))
        raise AssertionError(
            f"{what}: max |diff| {worst:.3e} > {rtol:.1e} * max |ref| {scale:.3e} at {idx}: "
            f"got {actual[idx].item():.6g}, expected {expected[idx].item():.6g}"
        )
