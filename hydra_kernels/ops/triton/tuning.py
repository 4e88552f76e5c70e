"""Launch configurations of the Triton kernels: one short list per kernel, the hand-picked choice first.

Each op file decides its kernel's list (`_configs(...)`, from the dtype and the launcher's shape-fixed
tiles; the weight-streaming GEMM-shaped kernels build theirs with `k_configs`); `launch` runs it:
  - under the interpreter (the CPU test tier), or with one config, or with `config` forced (tests run
    every config this way): that one config, so a test runs the kernel once;
  - on a GPU: triton.autotune over the list, keyed on the kernel's shape arguments (`key`, plus the
    dtypes of its tensors, which Triton adds), so each new shape times its configs once per process.
Only what does not change the grid or a buffer's size is tuned (the reduction step, warps, pipeline
stages); tile sizes that size the grid or the partial buffers stay with the launcher.
benchmarks/triton_aot.py compiles every config of every list (none may spill or overflow shared memory).
"""
from __future__ import annotations

import functools
from dataclasses import dataclass

import triton

from .common import interpreted, k_step


@dataclass(frozen=True)
class KernelConfig:
    meta: tuple  # ((constexpr name, value), ...): the tuned constexprs
    num_warps: int = 4
    num_stages: int = 3

    def kwargs(self) -> dict:
        return dict(self.meta, num_warps=self.num_warps, num_stages=self.num_stages)


def cfg(num_warps: int = 4, num_stages: int = 3, **meta) -> KernelConfig:
    return KernelConfig(tuple(sorted(meta.items())), num_warps, num_stages)


def k_configs(step: str, dtype, num_warps: int, *, longer_warps: int | None = 8,
              deeper: bool = True) -> list[KernelConfig]:
    """The config list of a weight-streaming GEMM-shaped kernel (the LM-head tiles, the head blocks), the
    hand-picked one first: reduction step `step` (its constexpr name) = common.k_step at `num_warps`; then
    (unless longer_warps is None) twice the step at `longer_warps` (more weight bytes in flight per loop
    trip); then (if deeper) the hand-picked step with a 4th pipeline stage. At decode sizes these kernels
    are bound by streaming the weight, so what is worth timing is how many of its bytes are in flight, not
    the tile shape. A kernel leaves out the variants that kept a stack frame (benchmarks/triton_aot.py)."""
    k = k_step(dtype)
    out = [cfg(num_warps=num_warps, **{step: k})]
    if longer_warps:
        out.append(cfg(num_warps=longer_warps, **{step: 2 * k}))
    if deeper:
        out.append(cfg(num_warps=num_warps, num_stages=4, **{step: k}))
    return out


@functools.cache
def _autotuned(kernel, configs: tuple, key: tuple):
    # no reset_to_zero / restore_value: every kernel writes its outputs without reading them (no atomics),
    # so timing a config several times leaves the same result
    return triton.autotune([triton.Config(dict(c.meta), num_warps=c.num_warps, num_stages=c.num_stages)
                            for c in configs], key=list(key))(kernel)


def launch(kernel, grid, args: tuple, kwargs: dict, configs: list, key: list, config: KernelConfig | None = None):
    """kernel[grid](*args, **kwargs) with `config` if given, else configs[0] (interpreter / one config), else
    the config triton.autotune picks among `configs` for this `key` (names of kernel arguments)."""
    if config is None and (interpreted() or len(configs) == 1):
        config = configs[0]
    if config is not None:
        return kernel[grid](*args, **kwargs, **config.kwargs())
    return _autotuned(kernel, tuple(configs), tuple(key))[grid](*args, **kwargs)
