"""Run in a fresh venv by tests/test_install_paths.py: import the installed package and decode with a
tiny random Llama, plain and speculative (an untrained Hydra drafter over a small tree). Greedy
speculative decoding is lossless, so both must emit the same tokens. Prints one JSON line."""
import json
import sys

import torch

import hydra_kernels as hk
from hydra_kernels.generate import generate
from hydra_kernels.ops.backend import native_available, plan_backends

torch.manual_seed(0)
cfg = hk.LlamaConfig(vocab_size=97, hidden_size=64, intermediate_size=128, num_layers=2, num_heads=4,
                     num_kv_heads=2, tie_word_embeddings=True)
model = hk.Llama(cfg).eval()
with torch.no_grad():  # default inits give one repeated token: spread the logits so tokens vary
    for p in model.parameters():
        p.normal_(0.0, 0.5)
drafter = hk.new_drafter(model, kind="hydra", num_heads=2, num_layers=1)
prompt = [[3, 14, 15, 92, 65, 35]]
plain = generate(model, prompt, max_new_tokens=12, eos_token_id=[])
spec = generate(model, prompt, drafter=drafter, tree=[[0], [1], [0, 0]], max_new_tokens=12, eos_token_id=[])
plan = plan_backends("auto", torch.device("cpu"))
print(json.dumps({"file": hk.__file__, "native": native_available(), "tree_attention": plan["tree_attention"],
                  "plain": plain.sequences[0], "speculative": spec.sequences[0], "steps": spec.num_steps}))
sys.exit(0 if plain.sequences == spec.sequences and len(plain.sequences[0]) == 12 else 1)
