"""Original EAGLE checkpoints (github.com/SafeAILab/EAGLE) as EagleDrafters.

A checkpoint is a directory: config.json (a Llama config with num_hidden_layers 1, plus EAGLE's keys)
and the draft model's state dict in pytorch_model.bin (read first, as EAGLE's ea_model does) or
model.safetensors. Which version it is shows in the weights' names.

EAGLE-1/2 (eagle/model/cnets1.py, `Model`): fc.weight [H, 2H] and fc.bias [H] (config "bias", default
true), layers.0.self_attn.{q,k,v,o}_proj.weight (q/k/v biases when the config has "qkv_bias" true),
layers.0.mlp.{gate,up,down}_proj.weight, layers.0.post_attention_layernorm.weight; layer 0 has no
input_layernorm and the model no final norm. The draft ranks tokens with the base model's LM head.

EAGLE-3 (eagle/model/cnets.py, `Model`): fc.weight [H, 3H] (never a bias), midlayer.self_attn.
{q,k,v}_proj.weight [*, 2H] and o_proj.weight, midlayer.mlp.*, midlayer.{input_layernorm,hidden_norm,
post_attention_layernorm}.weight, norm.weight, lm_head.weight [draft_vocab_size, H], and the buffers
d2t [draft_vocab_size] (target id = draft index + d2t[index]) and t2d [vocab_size] (bool: in the draft
vocabulary), both unused (and optional) when draft_vocab_size == vocab_size. Its features are the
base model's residual streams entering layers 2, L // 2 and L - 3 (no final norm; in layer order), as
EAGLE-3's modified LlamaModel collects them (eagle/model/modeling_llama_kv.py).

Both: head_dim = hidden_size // num_attention_heads whatever the config says, no o_proj or MLP
biases, the config's rope_theta (default 10000) and rope_scaling (EAGLE's config class takes only
{"type": "linear" | "dynamic", "factor": f}; "dynamic" is not supported here), rms_norm_eps (default
1e-6). Both may hold embed_tokens.weight: in EAGLE's training a frozen copy of the base model's
embeddings; the base model's embeddings are used, the stored tensor is only shape-checked. Keys ending
in rotary_emb.inv_freq (older checkpoints) are ignored; any other missing, unexpected or mis-shaped
tensor is a ValueError naming it.
"""
from __future__ import annotations

from pathlib import Path

import torch

from ..model.config import LlamaConfig
from .checkpoint import read_weights

WEIGHT_FILES = ("pytorch_model.bin", "model.safetensors")


def recognizes(cfg_dict: dict) -> bool:
    """A one-layer Llama config.json that is not ours: EAGLE's draft model configuration."""
    archs = cfg_dict.get("architectures") or []
    llama = cfg_dict.get("model_type") == "llama" or any(str(a).startswith("Llama") for a in archs)
    return ("format" not in cfg_dict and llama and cfg_dict.get("num_hidden_layers") == 1
            and "hidden_size" in cfg_dict and "vocab_size" in cfg_dict)


def eagle3_feature_layers(num_layers: int) -> list[int]:
    """The base layers whose inputs EAGLE-3 reads: 2, L // 2 and L - 3, in layer order."""
    layers = sorted({2, num_layers // 2, num_layers - 3})
    if len(layers) != 3 or layers[0] < 0:
        raise ValueError(f"EAGLE-3 reads the inputs of base layers 2, L // 2 and L - 3; for a base model of "
                         f"{num_layers} layers these are not three distinct layers")
    return layers


def eagle3_config_layers(cfg_dict: dict, num_layers: int) -> list[int]:
    """The base layers an EAGLE-3 checkpoint reads: its config's eagle_config.eagle_aux_hidden_state_layer_ids
    where given (as vLLM and SpecForge write it; each id is a layer whose input is read, concatenated in
    layer order as the base model's forward meets them), else EAGLE-3's default (eagle3_feature_layers)."""
    ids = (cfg_dict.get("eagle_config") or {}).get("eagle_aux_hidden_state_layer_ids")
    if ids is None:
        return eagle3_feature_layers(num_layers)
    if (not isinstance(ids, list) or not ids or not all(isinstance(i, int) and 0 <= i < num_layers for i in ids)
            or len(set(ids)) != len(ids)):
        raise ValueError(f"eagle_config.eagle_aux_hidden_state_layer_ids {ids!r}: expected distinct layer ids in "
                         f"[0, {num_layers}) of this base model; fix the checkpoint's config.json")
    return sorted(ids)


def load_state_dict(path: Path) -> dict[str, torch.Tensor]:
    return read_weights(path, WEIGHT_FILES, "an EAGLE config.json")[0]


def layer_config(cfg_dict: dict) -> LlamaConfig:
    """The draft layer's configuration as EAGLE's code reads config.json."""
    if cfg_dict.get("hidden_act", "silu") != "silu":
        raise ValueError(f"EAGLE draft hidden_act {cfg_dict['hidden_act']!r} is not supported (only 'silu')")
    H, n = cfg_dict["hidden_size"], cfg_dict["num_attention_heads"]
    if H % n:
        raise ValueError(f"EAGLE's layer needs hidden_size ({H}) divisible by num_attention_heads ({n})")
    rope = cfg_dict.get("rope_scaling")
    if rope is not None:
        kind = rope.get("type", rope.get("rope_type"))
        if kind != "linear":
            raise NotImplementedError(f"EAGLE draft rope_scaling {rope!r}: only {{'type': 'linear', 'factor': f}} "
                                      "is supported (EAGLE's own code also takes 'dynamic', which we do not)")
        rope = {"rope_type": "linear", "factor": float(rope["factor"])}
    d = {k: v for k, v in cfg_dict.items() if k not in ("rope_parameters",)}
    d.update(model_type="llama", num_hidden_layers=1, head_dim=H // n, rope_scaling=rope,
             attention_bias=bool(cfg_dict.get("qkv_bias", False)), mlp_bias=False)
    return LlamaConfig.from_hf_dict(d)


def _layer_keys(prefix: str, c: LlamaConfig, in_dim: int) -> dict[str, list[tuple[str, tuple]]]:
    """Our decoder-block parameter -> the original tensors (name, shape) concatenated along dim 0 to make it."""
    H, I = c.hidden_size, c.intermediate_size
    q, kv = c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim
    a, m = prefix + "self_attn.", prefix + "mlp."
    keys = {
        "block.attention.wqkv.weight": [(a + "q_proj.weight", (q, in_dim)), (a + "k_proj.weight", (kv, in_dim)),
                                        (a + "v_proj.weight", (kv, in_dim))],
        "block.attention.wo.weight": [(a + "o_proj.weight", (H, q))],
        "block.feed_forward.w13.weight": [(m + "gate_proj.weight", (I, H)), (m + "up_proj.weight", (I, H))],
        "block.feed_forward.w2.weight": [(m + "down_proj.weight", (H, I))],
        "block.ffn_norm.weight": [(prefix + "post_attention_layernorm.weight", (H,))],
    }
    if c.attention_bias:  # EAGLE-1's qkv_bias: q/k/v only (our o bias stays zero)
        keys["block.attention.wqkv.bias"] = [(a + "q_proj.bias", (q,)), (a + "k_proj.bias", (kv,)),
                                             (a + "v_proj.bias", (kv,))]
    return keys


def check_keys(sd: dict[str, torch.Tensor], required: dict[str, tuple], optional: dict[str, tuple]) -> None:
    """ValueError naming every missing, unexpected or mis-shaped tensor."""
    missing = [k for k in required if k not in sd]
    unexpected = [k for k in sd if k not in required and k not in optional and not k.endswith("rotary_emb.inv_freq")]
    shapes = {**required, **optional}
    bad = [f"{k} {tuple(sd[k].shape)} (expected {shapes[k]})" for k in sd
           if k in shapes and tuple(sd[k].shape) != shapes[k]]
    problems = ([f"missing {missing}"] if missing else []) + ([f"unexpected {unexpected}"] if unexpected else []) \
        + ([f"mis-shaped {bad}"] if bad else [])
    if problems:
        raise ValueError("not a complete EAGLE checkpoint for this config: " + "; ".join(problems))


def load_original(cls, path: Path, cfg_dict: dict, model=None):
    """An EagleDrafter (class `cls`) from an original EAGLE-1 or EAGLE-3 checkpoint directory."""
    if model is None:
        raise ValueError("an original EAGLE checkpoint drafts with the base model's token embeddings (EAGLE-1: "
                         "and its LM head; EAGLE-3: and its layers): pass it, hk.load_drafter(path, model=model)")
    c = layer_config(cfg_dict)
    mc = model.config
    V, H = c.vocab_size, c.hidden_size
    if (V, H) != (mc.vocab_size, mc.hidden_size):
        raise ValueError(f"EAGLE checkpoint for vocab {V} / hidden {H}, the model has {mc.vocab_size} / "
                         f"{mc.hidden_size}: it was trained for another model")
    sd = load_state_dict(path)
    eagle3 = any(k.startswith("midlayer.") for k in sd)
    optional = {"embed_tokens.weight": (V, H)}
    if eagle3:
        if cfg_dict.get("target_hidden_size", H) != H:
            raise NotImplementedError(f"EAGLE-3 target_hidden_size {cfg_dict['target_hidden_size']} != hidden_size "
                                      f"{H} (a draft narrower than the base model) is not supported")
        Vd = int(cfg_dict.get("draft_vocab_size", V))
        feature_layers = eagle3_config_layers(cfg_dict, mc.num_layers)
        keys = _layer_keys("midlayer.", c, 2 * H)
        keys.update({"fc.weight": [("fc.weight", (H, len(feature_layers) * H))],
                     "block.attention_norm.weight": [("midlayer.input_layernorm.weight", (H,))],
                     "hidden_norm.weight": [("midlayer.hidden_norm.weight", (H,))],
                     "logit_norm.weight": [("norm.weight", (H,))],
                     "lm_head.weight": [("lm_head.weight", (Vd, H))]})
        mapping = {"d2t": (Vd,), "t2d": (V,)}
        if Vd < V:
            required_extra, optional_extra = mapping, {}
        else:
            required_extra, optional_extra = {}, mapping
    else:
        Vd, feature_layers = None, None
        keys = _layer_keys("layers.0.", c, H)
        fc_bias = bool(cfg_dict.get("bias", True))
        keys["fc.weight"] = [("fc.weight", (H, 2 * H))]
        if fc_bias:
            keys["fc.bias"] = [("fc.bias", (H,))]
        required_extra, optional_extra = {}, {}
    required = {name: shape for parts in keys.values() for name, shape in parts}
    check_keys(sd, {**required, **required_extra}, {**optional, **optional_extra})

    cfg = cls.config_class(hidden_size=H, vocab_size=V, base_config=c.to_hf_dict(include_extra=False),
                           fc_bias=False if eagle3 else fc_bias,
                           draft_vocab_size=Vd if eagle3 and Vd < V else None, feature_layers=feature_layers)
    drafter = cls(cfg)
    own = drafter.layer.state_dict()
    state = {ours: torch.cat([sd[name] for name, _ in parts]) if len(parts) > 1 else sd[parts[0][0]]
             for ours, parts in keys.items()}
    if c.attention_bias:
        state["block.attention.wo.bias"] = torch.zeros_like(own["block.attention.wo.bias"])
    drafter.layer.load_state_dict({k: v.to(own[k].dtype) for k, v in state.items()})  # strict: ours complete
    if cfg.draft_vocab_size is not None:
        drafter.draft_vocab.copy_(_draft_to_target(sd["d2t"], sd["t2d"], V))
    return drafter


def _draft_to_target(d2t: torch.Tensor, t2d: torch.Tensor, V: int) -> torch.Tensor:
    """EAGLE-3's d2t offsets -> the target id of each draft index, checked against t2d."""
    ids = torch.arange(d2t.numel()) + d2t.long()
    if ids.min() < 0 or ids.max() >= V:
        raise ValueError(f"EAGLE-3 d2t maps draft indices outside the vocabulary [0, {V})")
    marked = t2d.bool()
    if ids.unique().numel() != ids.numel() or int(marked.sum()) != ids.numel() or not bool(marked[ids].all()):
        raise ValueError("EAGLE-3 d2t and t2d disagree: d2t must map the draft indices to distinct token ids, "
                         "exactly those t2d marks")
    return ids
