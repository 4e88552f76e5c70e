"""ops/triton/tuning.py, the one place that decides a Triton launch's config: under the interpreter (this
tier) the hand-picked config, the first of the list, runs alone; a forced `config` wins everywhere; on a
GPU (interpreted() false) a list of several configs goes through triton.autotune, built once per kernel,
list and key, with exactly the listed configs. Each kernel's configs against ops/reference.py: the
`*_every_launch_config_*` tests of each op's file (they force every config through `config=`)."""
import pytest
import torch

pytest.importorskip("triton")

from hydra_kernels.ops.triton import tuning  # noqa: E402
from hydra_kernels.ops.triton.common import k_step  # noqa: E402


class Recorder:
    """Stands in for a jit kernel: kernel[grid](*args, **kwargs) records the call instead of launching."""

    def __init__(self):
        self.calls = []

    def __getitem__(self, grid):
        return lambda *args, **kwargs: self.calls.append((grid, args, kwargs))


CONFIGS = [tuning.cfg(BLOCK_K=64), tuning.cfg(num_warps=8, BLOCK_K=128), tuning.cfg(num_stages=4, BLOCK_K=64)]


def test_interpreter_runs_the_hand_picked_config_and_a_forced_one_wins():
    k = Recorder()
    tuning.launch(k, (3, 1), (1, 2), dict(HAS_B=True), CONFIGS, key=["R", "H"])
    assert k.calls == [((3, 1), (1, 2), dict(HAS_B=True, BLOCK_K=64, num_warps=4, num_stages=3))]
    tuning.launch(k, (3, 1), (1, 2), dict(HAS_B=True), CONFIGS, key=["R", "H"], config=CONFIGS[1])
    assert k.calls[-1][2] == dict(HAS_B=True, BLOCK_K=128, num_warps=8, num_stages=3)


def test_on_a_gpu_several_configs_are_autotuned_and_one_config_is_not(monkeypatch):
    monkeypatch.setattr(tuning, "interpreted", lambda: False)
    seen = []
    tuned = Recorder()
    monkeypatch.setattr(tuning, "_autotuned", lambda kernel, configs, key: seen.append((kernel, configs, key)) or tuned)
    k = Recorder()
    tuning.launch(k, (2,), (7,), dict(IEEE=False), CONFIGS, key=["N", "V"])
    assert seen == [(k, tuple(CONFIGS), ("N", "V"))] and not k.calls
    assert tuned.calls == [((2,), (7,), dict(IEEE=False))]  # the autotuner adds the config's values
    tuning.launch(k, (2,), (7,), dict(IEEE=False), CONFIGS[:1], key=["N", "V"])  # nothing to choose from
    assert len(seen) == 1 and k.calls[-1][2] == dict(IEEE=False, BLOCK_K=64, num_warps=4, num_stages=3)
    tuning.launch(k, (2,), (7,), dict(IEEE=False), CONFIGS, key=["N", "V"], config=CONFIGS[2])  # forced
    assert len(seen) == 1 and k.calls[-1][2] == dict(IEEE=False, BLOCK_K=64, num_warps=4, num_stages=4)


def test_the_autotuner_holds_exactly_the_listed_configs_once_per_kernel_list_and_key():
    from hydra_kernels.ops.triton.resblock import _resblock_kernel

    a = tuning._autotuned(_resblock_kernel, tuple(CONFIGS), ("R", "H"))
    assert tuning._autotuned(_resblock_kernel, tuple(CONFIGS), ("R", "H")) is a  # built once
    assert [(c.kwargs, c.num_warps, c.num_stages) for c in a.configs] == [
        ({"BLOCK_K": 64}, 4, 3), ({"BLOCK_K": 128}, 8, 3), ({"BLOCK_K": 64}, 4, 4)]
    assert list(a.keys) == ["R", "H"]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_k_configs_start_with_the_hand_picked_step(dtype):
    s = k_step(dtype)
    full = tuning.k_configs("BLOCK_H", dtype, 4)
    assert full == [tuning.cfg(BLOCK_H=s), tuning.cfg(num_warps=8, BLOCK_H=2 * s), tuning.cfg(num_stages=4, BLOCK_H=s)]
    assert tuning.k_configs("BLOCK_H", dtype, 8, longer_warps=None, deeper=False) == [tuning.cfg(num_warps=8, BLOCK_H=s)]
