"""HF checkpoints: directories (config.json + *.safetensors, sharded too) read into a Llama and written
back, readable by transformers. Parameter names: model/hf_names.py; transformers objects: Llama.from_hf."""
from __future__ import annotations

import json
import os
from pathlib import Path

import torch

from .config import LlamaConfig
from .hf_names import ours_to_hf
from .llama import Llama


def read_json(file: Path) -> dict:
    """A JSON object from `file`, or a ValueError naming the file (a corrupt checkpoint)."""
    try:
        d = json.loads(file.read_text())
    except (ValueError, UnicodeDecodeError) as e:  # JSONDecodeError is a ValueError
        raise ValueError(f"{file} is not valid JSON ({e}); the checkpoint is corrupt") from e
    if not isinstance(d, dict):
        raise ValueError(f"{file} holds a JSON {type(d).__name__}, not an object; the checkpoint is corrupt")
    return d


def read_safetensors_dir(path: Path) -> dict[str, torch.Tensor]:
    """All tensors of model.safetensors, or of the shards listed in model.safetensors.index.json. A file
    that safetensors cannot read, or a weight holding NaN / inf, is a ValueError naming the file."""
    from safetensors.torch import load_file

    from .gguf_convert import check_finite

    index = path / "model.safetensors.index.json"
    if index.exists():
        try:
            files = sorted(set(read_json(index)["weight_map"].values()))
        except (KeyError, AttributeError, TypeError) as e:
            raise ValueError(f"{index} has no weight_map of tensor -> file names; the checkpoint is corrupt") from e
    else:
        files = sorted(f.name for f in path.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors weights in {path} (only safetensors checkpoints are read)")
    sd = {}
    for f in files:
        try:
            part = load_file(str(path / f))
        except FileNotFoundError:
            raise
        except Exception as e:  # safetensors' own error type (SafetensorError) is not exported stably
            raise ValueError(f"{path / f} is not a readable safetensors file ({e}); the checkpoint is corrupt "
                             "or truncated") from e
        # safetensors' tensors are views of one mmap of the file: a single one kept as is (a 2 KB norm
        # weight) held the whole file's pages resident (513 MB for SmolLM2). Own copies let it go.
        part = {name: w.clone() for name, w in part.items()}
        for name, w in part.items():
            if w.is_floating_point():
                check_finite(name, w, path / f)  # once, at load (corrupt bytes would decode as garbage)
        sd.update(part)
    return sd


def load_hf_dir(path: str | os.PathLike, *, dtype=None, device=None) -> Llama:
    """A Llama from an HF directory (config.json + model.safetensors, or shards with their index)."""
    path = Path(path)
    cfg_file = path / "config.json"
    if not cfg_file.exists():
        raise FileNotFoundError(f"{path} has no config.json: expected an HF model directory or a .gguf file")
    cfg = LlamaConfig.from_hf_dict(read_json(cfg_file))
    return Llama.from_hf_state_dict(cfg, read_safetensors_dir(path), dtype=dtype, device=device)


def save_hf_dir(model: Llama, path: str | os.PathLike) -> None:
    """Write config.json + model.safetensors readable by load_hf_dir and by transformers."""
    from safetensors.torch import save_file

    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(model.config.to_hf_dict(), indent=2))
    save_file(ours_to_hf(model.config, model.state_dict()), str(path / "model.safetensors"), metadata={"format": "pt"})
