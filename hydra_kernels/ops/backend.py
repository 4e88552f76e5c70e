"""Backend selection for the public ops: "reference" | "triton" | "native" | "auto".

Each op registers one implementation per backend it has. "auto" (overridable with the environment
variable HYDRA_KERNELS_BACKEND) picks, for the tensors' device, the first available of the op's
preferred order: native and triton on CUDA, native then reference on the CPU. A backend may cover
only some device types for an op (e.g. native tree_attention is a CPU kernel; Triton runs it on CUDA).
"""
from __future__ import annotations

import os
import warnings
from dataclasses import dataclass
from typing import Callable, Mapping

import torch

BACKENDS = ("reference", "triton", "native")
_IMPLS: dict[str, dict[str, Callable]] = {}
_DEVICES: dict[tuple[str, str], frozenset[str]] = {}  # (op, backend) -> device types it covers (absent: all)
# (op, backend) -> that implementation's size limits, e.g. {"accepted_rows": 32}: one kernel's bound,
# checked by the op before dispatch and by BackendPlan.check_tree before any work
_LIMITS: dict[tuple[str, str], Mapping[str, int]] = {}
# (op, backend) -> the tree mask's conversion into the form that implementation reads (absent: the bool mask)
_MASK_FORMS: dict[tuple[str, str], Callable] = {}


def register(op: str, backend: str, fn: Callable, devices: tuple[str, ...] | None = None,
             limits: Mapping[str, int] | None = None, mask_form: Callable | None = None) -> None:
    """fn implements `op` for `backend`; devices: the device types it covers (None: every one); limits:
    its size limits by name (None: none); mask_form: for an op taking a tree mask whose kernel reads
    another form of it (Triton tree_attention: bit-packed words), the conversion of the bool mask (see
    kernel_mask); None: the kernel reads the bool mask."""
    if backend not in BACKENDS:
        raise ValueError(f"unknown backend {backend!r}")
    _IMPLS.setdefault(op, {})[backend] = fn
    if devices is not None:
        _DEVICES[(op, backend)] = frozenset(devices)
    if limits is not None:
        _LIMITS[(op, backend)] = dict(limits)
    if mask_form is not None:
        _MASK_FORMS[(op, backend)] = mask_form


def kernel_mask(op: str, backend: str, tree_mask):
    """tree_mask (bool) in the form `op`'s concrete `backend` implementation reads, for a caller that runs
    that implementation on many layers with one mask (AttentionSite: once per step, not once per layer).
    The bool mask itself where the implementation reads it as is."""
    form = _MASK_FORMS.get((op, backend))
    return tree_mask if form is None else form(tree_mask)


def limit(op: str, backend: str, name: str) -> int | None:
    """The `name` limit of `op`'s concrete `backend` implementation, or None when it has none."""
    return _LIMITS.get((op, backend), {}).get(name)


def has_impl(op: str, backend: str, device: torch.device | None = None) -> bool:
    """Does `op` have a `backend` implementation (for `device`'s type, when given)?"""
    if backend not in _IMPLS.get(op, {}):
        return False
    covered = _DEVICES.get((op, backend))
    return device is None or covered is None or device.type in covered


# the compiled extension's interface these sources call (csrc/hydra_kernels.h HK_ABI_VERSION; raised with it)
NATIVE_ABI = 2
_NATIVE: list[bool] = []  # native_available's answer, once found


def native_available() -> bool:
    """hydra_kernels._C imports and was built from sources of this interface (NATIVE_ABI). A build from older sources
    (pulled, not rebuilt: its ops' schemas may differ, e.g. hydra_head_topk gained an output) is not used: a warning
    says once to rebuild, and the portable paths run, slower, where it would have failed inside generate()."""
    if not _NATIVE:
        _NATIVE.append(_check_native())
    return _NATIVE[0]


def _check_native() -> bool:
    try:
        import hydra_kernels._C
    except ImportError:
        return False
    try:
        built = int(torch.ops.hydra_kernels.abi_version())
    except Exception:  # built before the extension reported its interface (no such op), or any failure to say
        built = None
    if built != NATIVE_ABI:
        warnings.warn(f"hydra_kernels: the compiled extension {hydra_kernels._C.__file__} was built from other sources "
                      f"(interface {built}, these sources need {NATIVE_ABI}); it is not used, and the portable paths "
                      f"run instead (slower). Rebuild it: pip install -e . (or python setup.py build_ext --inplace)",
                      RuntimeWarning, stacklevel=3)
        return False
    return True


def triton_available(device: torch.device) -> bool:
    """Triton kernels run on CUDA, or on the CPU under the interpreter (TRITON_INTERPRET=1)."""
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    if device.type == "cuda":
        return True
    return os.environ.get("TRITON_INTERPRET") == "1"


def _usable(backend: str, device: torch.device) -> bool:
    if backend == "reference":
        return True
    if backend == "triton":
        return triton_available(device)
    return native_available()


def resolve(op: str, backend: str, device: torch.device) -> Callable:
    """The implementation of `op` for `backend` on `device`, or a ValueError saying what to change."""
    return _IMPLS.get(op, {})[resolved_name(op, backend, device)]


def _auto_name(op: str, device: torch.device) -> str:
    """The fastest available implementation of `op` on `device`: native, then Triton (CUDA), then reference."""
    order = ("native", "triton", "reference") if device.type == "cuda" else ("native", "reference")
    for name in order:
        if has_impl(op, name, device) and _usable(name, device):
            return name
    raise ValueError(f"no implementation of {op} usable on {device}")


def resolved_name(op: str, backend: str, device: torch.device) -> str:
    """Which backend `resolve` picks for `op` ("auto" made concrete), or a ValueError."""
    impls = _IMPLS.get(op, {})
    if backend == "auto":
        backend = os.environ.get("HYDRA_KERNELS_BACKEND", "auto")
    if backend == "auto":
        return _auto_name(op, device)
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {('auto',) + BACKENDS}, got {backend!r}")
    if backend not in impls:
        have = sorted(impls)
        raise ValueError(f"{op} has no {backend!r} implementation yet; available: {have} (or 'auto')")
    if not has_impl(op, backend, device):
        have = sorted(b for b in impls if has_impl(op, b, device))
        raise ValueError(f"{op} has no {backend!r} kernel for {device.type} tensors; available there: {have} (or 'auto')")
    check_usable(backend, device)
    return backend


@dataclass(frozen=True)
class BackendPlan:
    """Which implementation every op uses for one run on one device, decided once (plan_backends) at
    the top of generate() and handed down: nothing below looks at the backend string again.

    ops: op name -> a concrete backend ("reference" | "triton" | "native") that implements it there.
    packed_linear: fp32 CPU linears of at most MAX_PACKED_ROWS rows (the base model's projections and
    LM head, the draft heads) run the native packed kernel (model/packed_linear.py); False: F.linear.
    """

    requested: str
    device_type: str
    ops: Mapping[str, str]
    packed_linear: bool

    def __getitem__(self, op: str) -> str:
        return self.ops[op]

    @property
    def fused_lm_head_statistics(self) -> bool:
        """lm_head_sample_stats is a kernel that never writes the [.., V] logits (Triton), so typical
        acceptance runs from its statistics; otherwise from the logits (ops.typical_verify)."""
        return self.ops.get("lm_head_sample_stats") == "triton"

    @property
    def fused_residual_sampling(self) -> bool:
        """lm_head_residual_sample is a kernel that never writes the [.., V] logits (Triton), so rejection
        sampling (temperature only) runs from its lse and residual samples (ops.rejection_accept);
        otherwise from the logits (ops.rejection_verify)."""
        return self.ops.get("lm_head_residual_sample") == "triton"

    def check_tree(self, tree) -> None:
        """A ValueError, before any work, when a chosen kernel cannot run steps over `tree` (a Tree, or
        the bound of a drafter's per-step trees): a step commits up to tree.depth + 1 rows."""
        rows = limit("commit_kv", self.ops["commit_kv"], "accepted_rows")
        if rows is not None and tree.depth + 1 > rows:
            raise ValueError(
                f"the tree is {tree.depth} deep, so a step may commit {tree.depth + 1} rows, but the "
                f"{self.ops['commit_kv']} commit_kv commits at most {rows}; use a tree of depth <= {rows - 1} "
                f"or backend='reference'")


def plan_backends(backend: str, device: torch.device, *, packed_weights: bool = False) -> BackendPlan:
    """Resolve `backend` for every registered op on `device` (a ValueError, before any work, when it
    cannot run there). An op without an implementation of the requested backend (e.g. "native" has no
    lm_head_topk) takes the "auto" choice for it. packed_weights: the model holds packed CPU weights
    (Llama.use_packed_cpu_weights); they are used with "auto" and "native"."""
    check_usable(backend, device)
    requested = os.environ.get("HYDRA_KERNELS_BACKEND", "auto") if backend == "auto" else backend
    if requested != backend:
        try:
            check_usable(requested, device)
        except ValueError as e:
            raise ValueError(f"environment variable HYDRA_KERNELS_BACKEND={requested!r}: {e}") from None
    chosen = {}
    for op in sorted(_IMPLS):
        use_requested = requested != "auto" and has_impl(op, requested, device)
        chosen[op] = resolved_name(op, requested, device) if use_requested else _auto_name(op, device)
    packed = packed_weights and device.type == "cpu" and requested in ("auto", "native")
    return BackendPlan(requested, device.type, chosen, packed)


def check_usable(backend: str, device: torch.device) -> None:
    """A clear error, before any work, when `backend` cannot run on `device`."""
    if backend == "auto":
        return
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {('auto',) + BACKENDS}, got {backend!r}")
    if not _usable(backend, device):
        why = {
            "triton": "Triton kernels need a CUDA device, or TRITON_INTERPRET=1 on the CPU",
            "native": "the compiled extension hydra_kernels._C is not built (pip install . builds it)",
        }[backend]
        raise ValueError(f"backend {backend!r} is not usable on {device}: {why}")
