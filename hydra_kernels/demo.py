"""`make demo`: stream a chat answer from the embedded default with the shipped drafter measured fastest at
batch 1 (default.json's batch_1 kind where it has one, else its default kind: now the combined drafter), then time
it against plain greedy decoding of the same prompt, interleaved over a few rounds (the outputs are checked equal);
where the CPU runs the int8 dot kernel, plain decoding on int8 activations too (the faster, opt-in arithmetic:
another model)."""
from __future__ import annotations

import io
import statistics
import sys

import torch

PROMPT = "Explain in a short paragraph why the sky is blue."
ROUNDS = 3  # timed runs of each path (timed_rounds)


def main() -> None:
    import hydra_kernels as hk

    from .chat import TextStreamer, chat_prompt_ids
    from .drafters.registry import default_kind
    from .generate import generate

    torch.set_grad_enabled(False)
    prompt = " ".join(sys.argv[1:]) or PROMPT
    print("loading SmolLM2-135M-Instruct (first run converts the GGUF once) ...", flush=True)
    model, tok = hk.load_model()
    ids = chat_prompt_ids(tok, prompt)
    try:
        drafter = hk.load_drafter(model=model, kind=default_kind(batch_1=True))  # one prompt: batch 1's fastest
    except FileNotFoundError as e:
        drafter = None
        print(f"(no shipped heads: {e})")
    print(f"\n> {prompt}\n", flush=True)
    n = 200
    if drafter is not None:
        bound = drafter.resolve_tree(None, model.device.type)  # the tree (or dynamic tree) used by default here
        dynamic = getattr(bound, "dynamic", None)
        tree_desc = f"dynamic {dynamic.total_tokens}-node trees" if dynamic else f"{bound.num_nodes}-node tree"
        if drafter.kind == "combined":  # its bound holds both parts side by side
            tree_desc = (f"n-gram chains of up to {drafter.ngram.config.num_tokens} tokens beside the "
                         f"{bound.heads_tree.num_nodes}-node {drafter.heads.kind} tree, "
                         f"{drafter.node_budget or bound.num_nodes} nodes a step at most")
        # one short run of each path first, so neither timing below includes one-time costs (first-call
        # dispatch, buffers, packing the draft heads for the CPU kernel)
        generate(model, [ids], drafter=drafter, max_new_tokens=8)
        generate(model, [ids], max_new_tokens=8)
        out = generate(model, [ids], drafter=drafter, max_new_tokens=n, streamer=TextStreamer(tok))
        print(f"\n\nspeculative ({drafter.kind} drafter, {tree_desc}): "
              f"{len(out.sequences[0])} tokens, {out.mean_accepted_tokens:.2f} tokens/step")
        if out.step_nodes and max(out.step_nodes) <= 1:  # the step budget chose plain steps throughout
            print("(every step was a plain step: no draft of this answer was expected to pay for its cost on this "
                  "machine, so both paths decode the same way and the speedup below is timing noise; the drafter "
                  "drafts where its guesses are likely accepted: text the answer copies, longer answers and contexts)")
        elif out.step_nodes:
            drafted = sum(n > 1 for n in out.step_nodes)
            print(f"({drafted} of {len(out.step_nodes)} steps verified a draft; the others were plain steps, where no "
                  "draft was expected to pay for its cost)")
        print(f"timing it against plain greedy decoding of the same prompt, {ROUNDS} rounds each, interleaved ...",
              flush=True)
        spec_tps, plain_tps, same = timed_rounds(model, [ids], drafter, n, tok, out.sequences, ROUNDS)
        print(f"speculative {spec_tps:.1f} tokens/s, plain greedy {plain_tps:.1f} tokens/s (medians): speedup "
              f"{spec_tps / plain_tps:.2f}x; outputs {'identical' if same else 'DIFFERENT (please report this)'} "
              f"({model.dtype}, {model.device}, {torch.get_num_threads()} threads)")
    else:
        out = generate(model, [ids], max_new_tokens=n, streamer=TextStreamer(tok))
        print(f"\n\nplain greedy decoding: {len(out.sequences[0])} tokens, {out.tokens_per_second:.1f} tokens/s")
    int8_plain(ids, out.sequences[0], n, tok)


def timed_rounds(model, prompts: list[list[int]], drafter, n: int, tok, sequences, rounds: int
                 ) -> tuple[float, float, bool]:
    """Speculative and plain greedy decoding of `prompts`, `rounds` runs each, interleaved (the order alternating) ->
    (speculative tokens/s, plain tokens/s: the medians; whether every output equals `sequences`). Why rounds: one run
    of a ~1 s answer varies by +-10% on a shared 2-core VM (Xeon AMX VM, 2026-11-30, this prompt: one run's speedup
    read 0.83-0.95x in three demos, 6 interleaved rounds of ab_adaptive.py's 0.97x in total). Both paths pay a
    streamer's work (decoding the text so far at every step), not printed: the answer shown was streamed, and the
    timings compare the same work."""
    from .chat import TextStreamer
    from .generate import generate

    spec, plain, same = [], [], True
    for r in range(rounds):
        for speculative in ((True, False) if r % 2 else (False, True)):
            o = generate(model, prompts, drafter=drafter if speculative else None, max_new_tokens=n,
                         streamer=TextStreamer(tok, out=io.StringIO()))
            (spec if speculative else plain).append(o.tokens_per_second)
            same = same and o.sequences == sequences
    return statistics.median(spec), statistics.median(plain), same


def int8_plain(ids: list[int], exact: list[int], n: int, tok) -> None:
    """Plain greedy decoding of the prompt on int8 activations (hk.load_model(activations="int8")), where this CPU runs
    it: its speed, and how many of its first tokens are the exact model's (`exact`)."""
    import hydra_kernels as hk

    from .chat import TextStreamer
    from .generate import generate
    from .ops.int8_dot_linear import int8_dot_linear_available

    if not int8_dot_linear_available():
        return
    model, _ = hk.load_model(activations="int8")
    generate(model, [ids], max_new_tokens=8)
    out = generate(model, [ids], max_new_tokens=n, streamer=TextStreamer(tok, out=io.StringIO()))
    same = next((i for i, (a, b) in enumerate(zip(out.sequences[0], exact)) if a != b), min(len(exact), n))
    print(f"plain greedy on int8 activations (hk.load_model(activations='int8'), llama.cpp's arithmetic; another model, "
          f"its first {same} tokens the same here): {out.tokens_per_second:.1f} tokens/s")


if __name__ == "__main__":
    main()
