"""nn.Linear with a CPU fast path for small M (decode steps and tree verification).

After `pack_cpu()`, fp32 CPU inference with at most MAX_PACKED_ROWS rows runs the native
`hydra_kernels::packed_linear` kernel (csrc/packed_linear_cpu.cpp): the weight is kept a second time
in contiguous column panels that stream from DRAM, and each output is an in-order FMA chain over K, so
a row's result does not depend on how many rows share the call (a token gives the same logits in a
1-token step and inside a tree). Larger M (prefill, training) and every other case take F.linear.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

# Above this many rows MKL's blocked sgemm is as fast (the weights are reused enough to be compute-bound).
MAX_PACKED_ROWS = 32


def packed_linear_available() -> bool:
    """The native kernel is built and has its AVX-512 path on this CPU (elsewhere: F.linear)."""
    try:
        import hydra_kernels._C  # noqa: F401

        return bool(torch.ops.hydra_kernels.packed_linear_is_fast())
    except (ImportError, AttributeError, RuntimeError):
        return False


class Linear(nn.Linear):
    """nn.Linear (same parameters and state_dict) whose small-M fp32 CPU inference can use packed weights."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self._packed: torch.Tensor | None = None
        self._packed_key = None

    def _key(self):
        w = self.weight
        return (w.data_ptr(), w._version, tuple(w.shape), w.dtype, w.device)

    def pack_cpu(self) -> None:
        """Pack the weight for the native small-M kernel (fp32 CPU weights only; a no-op otherwise)."""
        w = self.weight
        if w.device.type != "cpu" or w.dtype != torch.float32 or w.is_meta:
            self._packed = None
            return
        with torch.no_grad():
            self._packed = torch.ops.hydra_kernels.pack_linear_weight(w.detach())
        self._packed_key = self._key()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if (self._packed is not None and x.dtype == torch.float32 and x.device.type == "cpu"
                and not torch.is_grad_enabled() and 0 < x.numel() <= MAX_PACKED_ROWS * x.shape[-1]):
            if self._packed_key != self._key():  # weights changed since packing (e.g. load_state_dict)
                self.pack_cpu()
            return torch.ops.hydra_kernels.packed_linear(x, self._packed, self.out_features, self.bias)
        return F.linear(x, self.weight, self.bias)
