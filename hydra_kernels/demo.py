"""`make demo`: stream a chat answer from the embedded default and print the decoding figures."""
from __future__ import annotations

import sys

import torch

PROMPT = "Explain in a short paragraph why the sky is blue."


def main() -> None:
    import hydra_kernels as hk

    from .chat import TextStreamer, chat_prompt_ids
    from .generate import generate

    torch.set_grad_enabled(False)
    prompt = " ".join(sys.argv[1:]) or PROMPT
    print("loading SmolLM2-135M-Instruct (first run converts the GGUF once) ...", flush=True)
    model, tok = hk.load_model()
    ids = chat_prompt_ids(tok, prompt)
    print(f"\n> {prompt}\n", flush=True)
    out = generate(model, [ids], max_new_tokens=200, streamer=TextStreamer(tok))
    print(f"\n\nplain greedy decoding: {len(out.sequences[0])} tokens, {out.tokens_per_second:.1f} tokens/s, "
          f"{out.mean_accepted_tokens:.2f} tokens/step ({model.dtype}, {model.device}, "
          f"{torch.get_num_threads()} threads)")
    print("speculative decoding: no drafter is shipped yet, so there is no speedup to show; "
          "see the README's status table")


if __name__ == "__main__":
    main()
