"""Our CPU decoding beside what a CPU user would pick instead, on the same GGUF, the same prompts, the same
thread count, interleaved (issue 44): llama.cpp's plain greedy decoding and its prompt-lookup decoding
(llama-cpp-python), transformers' generate, and ours: plain and with the default drafter (combined: its default
budget, the adaptive one; combined-table: its CPU budget table, budget="auto"), on the quantized weights (the default), on them with int8 activations (the -int8 decoders: load_model(activations="int8"), llama.cpp's
arithmetic) and, for reference, on the fp32 copy.

Per decoder and prompt: end-to-end tokens/s (prefill included: what a user waits for), decode-only tokens/s
(the same run minus a 1-token run's time, i.e. minus prefill), the tokens produced. Medians over prompts and
--rounds rounds (every decoder once per prompt per round, in the same order). Each decoder's greedy tokens
are compared with our fp32 plain decoding's (the median first divergence of those that differ is reported:
llama.cpp rounds activations to 8 bits, so near-ties flip); ours are identical to it, except the -int8 decoders,
which round activations as llama.cpp does; same_as_own_plain: our speculative tokens against plain decoding of the
same model (fp32 or int8 activations): lossless is all of them. --rss: peak resident memory of a fresh process that loads the model (and our
default drafter) and decodes one prompt, per decoder. --prefill N: prefill tokens/s on N-token prompts.
--long N: N more prompts of --long-context tokens (held-out ShareGPT conversations followed by MT-Bench's first
question, as bench_scaling.py's long contexts), where the default drafter's CPU table drafts (batch 1: 4 nodes from
2k tokens on); with --mtbench 0 --editing 0 they are the only prompts.

llama.cpp is optional: `pip install ".[peers]"` builds llama-cpp-python from source (~20 minutes on 2 cores;
CMAKE_ARGS="-DGGML_NATIVE=ON" for this CPU's instructions; where that build dies with "Illegal instruction" in its AMX
path, pyproject.toml's flags without AMX); without it its rows are skipped and the script says so. transformers runs on the fp32 copy (it cannot run GGUF blocks).

    python benchmarks/bench_cpu_peers.py [--mtbench 8] [--editing 4] [--new-tokens 128] [--rounds 2]
        [--threads 2] [--decoders plain combined combined-table plain-int8 combined-int8 combined-table-int8
                    llama.cpp llama.cpp-lookup transformers plain-fp32]
        [--rss] [--prefill 2048] [--long 4 --long-context 2048] [--gguf another.gguf] [--out benchmarks/results]

--gguf: another GGUF of the embedded model (SmolLM2-135M-Instruct, e.g. requantized to Q4_K_M: the default drafter's
heads fit it) instead of the embedded Q4_1 file; both sides read the same file.
"""
from __future__ import annotations

import argparse
import json
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch
from report import print_table, write_results

import hydra_kernels as hk
from hydra_kernels.generate import generate

LLAMA_CPP_CONTEXT = 4096  # the llama.cpp peer's n_ctx
ALL_DECODERS = ["plain", "combined", "combined-table", "plain-int8", "combined-int8", "combined-table-int8",
                "llama.cpp", "llama.cpp-lookup", "transformers", "plain-fp32"]
# the default drafter's decoders -> generate()'s budget: its default (the adaptive budget on the CPU, greedy) and its
# CPU budget table (the default before, issue 45)
COMBINED_BUDGETS = {"combined": None, "combined-table": "auto"}


def have_llama_cpp() -> bool:
    try:
        import llama_cpp  # noqa: F401
    except ImportError:
        return False
    return True


class Ours:
    """generate() on a model (quantized or fp32), plain or with a drafter (and its budget)."""

    def __init__(self, model, drafter=None, budget=None):
        self.model, self.drafter, self.budget = model, drafter, budget

    def run(self, ids: list[int], n: int) -> list[int]:
        return generate(self.model, [ids], drafter=self.drafter, max_new_tokens=n, budget=self.budget).sequences[0]


class LlamaCpp:
    """llama.cpp through llama-cpp-python: greedy (top_k = 1), the KV cache reset before each prompt."""

    def __init__(self, gguf: Path, threads: int, lookup: bool):
        from llama_cpp import Llama

        draft = None
        if lookup:
            from llama_cpp.llama_speculative import LlamaPromptLookupDecoding

            draft = LlamaPromptLookupDecoding(num_pred_tokens=10)
        self.llm = Llama(str(gguf), n_ctx=LLAMA_CPP_CONTEXT, n_threads=threads, n_threads_batch=threads, n_batch=512,
                         verbose=False, draft_model=draft, logits_all=lookup)

    def run(self, ids: list[int], n: int) -> list[int]:
        # every run pays its prefill on an empty cache: reset() only rewinds the token count, and the last
        # run's KV cells would stay visible to attention (wrong tokens, and slower steps) without the clear
        self.llm.reset()
        self.llm._ctx.kv_cache_clear()
        out = []
        for tok in self.llm.generate(ids, top_k=1, top_p=1.0, temp=0.0, reset=True):
            if tok == self.llm.token_eos() or len(out) == n:
                break
            out.append(int(tok))
        return out


class Transformers:
    """transformers' generate on the fp32 copy of the GGUF (greedy, its default cache)."""

    def __init__(self, model_dir: Path, threads: int):
        from transformers import AutoModelForCausalLM

        self.m = AutoModelForCausalLM.from_pretrained(str(model_dir), torch_dtype=torch.float32).eval()

    def run(self, ids: list[int], n: int) -> list[int]:
        out = self.m.generate(torch.tensor([ids]), max_new_tokens=n, do_sample=False)
        return out[0, len(ids):].tolist()


def first_divergence(a: list[int], b: list[int]) -> int | None:
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def build(name: str, gguf: Path, threads: int, quantized, fp32, model_dir: Path, int8=None):
    if name.endswith("-int8"):  # the same decoders on int8 activations (load_model(activations="int8"))
        name, quantized = name[:-len("-int8")], int8
    if name == "plain":
        return Ours(quantized)
    if name in COMBINED_BUDGETS:
        return Ours(quantized, hk.load_drafter(model=quantized), budget=COMBINED_BUDGETS[name])
    if name == "plain-fp32":
        return Ours(fp32)
    if name.startswith("llama.cpp"):
        return LlamaCpp(gguf, threads, lookup=name.endswith("lookup"))
    return Transformers(model_dir, threads)


def timed(dec, ids: list[int], n: int) -> tuple[float, float, list[int]]:
    """(end-to-end seconds, decode-only seconds, tokens): decode-only subtracts a 1-token run (its prefill)."""
    t0 = time.perf_counter()
    dec.run(ids, 1)
    t1 = time.perf_counter()
    toks = dec.run(ids, n)
    t2 = time.perf_counter()
    return t2 - t1, max(t2 - t1 - (t1 - t0), 1e-9), toks


def rss_probe(decoder: str, threads: int, gguf: Path | None) -> None:
    """In a fresh process: load what `decoder` needs, decode one prompt, print the peak RSS in MB as JSON."""
    torch.set_num_threads(threads)
    torch.set_grad_enabled(False)
    from hydra_kernels.chat import chat_prompt_ids

    model, tok = hk.load_model(gguf, weights="fp32" if decoder == "plain-fp32" else None,
                               activations="int8" if decoder.endswith("-int8") else "fp32")
    name = decoder.removesuffix("-int8")
    dec = Ours(model, hk.load_drafter(model=model) if name in COMBINED_BUDGETS else None,
               budget=COMBINED_BUDGETS.get(name))
    dec.run(chat_prompt_ids(tok, "Explain how a hash map works."), 64)
    print(json.dumps({"decoder": decoder, "peak_rss_mb": peak_rss_mb()}))


def peak_rss_mb() -> float:
    """This process's peak resident memory (VmHWM: of this program; ru_maxrss would also count the parent
    that forked it, since Linux keeps it across exec)."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


# llama.cpp's probe imports nothing of ours (no torch): what a llama.cpp user's process holds
_LLAMA_CPP_PROBE = """
import json, sys
from pathlib import Path
from llama_cpp import Llama
from llama_cpp.llama_speculative import LlamaPromptLookupDecoding
gguf, threads, lookup = sys.argv[1], int(sys.argv[2]), sys.argv[3] == "1"
llm = Llama(gguf, n_ctx=4096, n_threads=threads, n_threads_batch=threads, verbose=False,
            draft_model=LlamaPromptLookupDecoding(num_pred_tokens=10) if lookup else None)
ids = llm.tokenize(b"Explain how a hash map works.")
for i, t in enumerate(llm.generate(ids, top_k=1, temp=0.0)):
    if i == 64:
        break
hwm = [l for l in Path("/proc/self/status").read_text().splitlines() if l.startswith("VmHWM:")][0]
print(json.dumps({"peak_rss_mb": int(hwm.split()[1]) / 1024}))
"""


def peak_rss(decoder: str, threads: int, gguf: Path, embedded: bool) -> float:
    """Peak RSS (MB) of a fresh process that loads what `decoder` needs and decodes 64 tokens of one prompt."""
    if decoder.startswith("llama.cpp"):
        argv = ["-c", _LLAMA_CPP_PROBE, str(gguf), str(threads), str(int(decoder.endswith("lookup")))]
    else:
        argv = [__file__, "--rss-probe", decoder, "--threads", str(threads)] + ([] if embedded else ["--gguf", str(gguf)])
    out = subprocess.run([sys.executable, *argv], capture_output=True, text=True, check=True).stdout
    return json.loads(out.strip().splitlines()[-1])["peak_rss_mb"]


def main(argv=None) -> list[dict]:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--mtbench", type=int, default=8, help="MT-Bench first turns")
    ap.add_argument("--editing", type=int, default=4, help="ShareGPT editing prompts (bench_ngram.py's rule)")
    ap.add_argument("--long", type=int, default=0, help="prompts of --long-context tokens (ShareGPT + a question)")
    ap.add_argument("--long-context", type=int, default=2048, help="the --long prompts' length in tokens")
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--decoders", nargs="+", default=ALL_DECODERS, choices=ALL_DECODERS)
    ap.add_argument("--rss", action="store_true", help="peak RSS of a fresh process per decoder")
    ap.add_argument("--prefill", type=int, default=0, help="also time prefill of this many tokens (e.g. 2048)")
    ap.add_argument("--gguf", type=Path, default=None, help="another GGUF of the embedded model (default: the embedded "
                    "Q4_1 file)")
    ap.add_argument("--out", default=None, help="write cpu_peers.csv (+ .png) there")
    ap.add_argument("--rss-probe", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if min(args.mtbench, args.editing, args.long) < 0 or args.mtbench + args.editing + args.long == 0 \
            or args.new_tokens < 2 or args.rounds < 1 or args.threads < 1 or args.long_context < 64:
        ap.error("need --mtbench + --editing + --long >= 1 prompts, --long-context >= 64, --new-tokens >= 2, "
                 "--rounds >= 1, --threads >= 1")
    if (args.long and any(d.startswith("llama.cpp") for d in args.decoders)
            and args.long_context + args.new_tokens > LLAMA_CPP_CONTEXT):
        ap.error(f"--long-context + --new-tokens must fit llama.cpp's {LLAMA_CPP_CONTEXT}-token context here, got "
                 f"{args.long_context} + {args.new_tokens} (or leave the llama.cpp decoders out)")
    if args.gguf is not None and not args.gguf.is_file():
        ap.error(f"--gguf {args.gguf}: no such file")
    if args.rss_probe:
        return rss_probe(args.rss_probe, args.threads, args.gguf)
    decoders = list(args.decoders)
    if not have_llama_cpp():
        skipped = [d for d in decoders if d.startswith("llama.cpp")]
        if skipped:
            print(f"llama-cpp-python is not installed: skipping {skipped} (pip install '.[peers]', ~20 min build)")
        decoders = [d for d in decoders if d not in skipped]
    torch.set_num_threads(args.threads)
    torch.set_grad_enabled(False)
    from bench_ngram import editing_prompts

    from hydra_kernels.chat import chat_prompt_ids
    from hydra_kernels.model.gguf_convert import convert_gguf_cached
    from hydra_kernels.model.pretrained import EMBEDDED_SHA256, embedded_gguf_path
    from hydra_kernels.training.data import long_context_prompts, mtbench_questions

    embedded = args.gguf is None
    gguf = embedded_gguf_path() if embedded else args.gguf
    fp32, _ = hk.load_model(None if embedded else gguf, weights="fp32")  # the reference tokens
    model_dir = convert_gguf_cached(gguf, sha256=EMBEDDED_SHA256 if embedded else None)  # its fp32 entry (transformers)
    quantized, tok = hk.load_model(None if embedded else gguf)
    questions = [q["turns"][0] for q in mtbench_questions()]
    prompts = [chat_prompt_ids(tok, q) for q in questions[:args.mtbench]]
    prompts += editing_prompts(tok, args.editing)
    if args.long:
        prompts += long_context_prompts(tok, args.long, args.long_context, questions[0])
    int8 = hk.load_model(None if embedded else gguf, activations="int8")[0] if any(
        d.endswith("-int8") for d in decoders) else None
    runners = {name: build(name, gguf, args.threads, quantized, fp32, model_dir, int8) for name in decoders}
    reference = Ours(fp32)
    want = [reference.run(p, args.new_tokens) for p in prompts]  # fp32 plain greedy: the reference tokens
    # each of our decoders' own model's plain greedy tokens: what its speculative decoding must emit (lossless)
    own = {"fp32": want, "int8": [Ours(int8).run(p, args.new_tokens) for p in prompts] if int8 is not None else None}
    for dec in runners.values():
        dec.run(prompts[0], 8)  # warm-up
    e2e, dec_only, diverged = {k: [] for k in runners}, {k: [] for k in runners}, {k: [] for k in runners}
    lossless = {k: [] for k in runners}
    from tqdm.auto import tqdm

    with tqdm(total=args.rounds * len(prompts) * len(runners), desc="decoding") as bar:
        for _ in range(args.rounds):
            for i, p in enumerate(prompts):
                for name, dec in runners.items():
                    t_e2e, t_dec, toks = timed(dec, p, args.new_tokens)
                    e2e[name].append(len(toks) / t_e2e)
                    dec_only[name].append((len(toks) - 1) / t_dec)
                    diverged[name].append(first_divergence(toks, want[i]))
                    if isinstance(dec, Ours):
                        lossless[name].append(toks == own["int8" if name.endswith("-int8") else "fp32"][i])
                    bar.update()
    base = statistics.median(e2e["plain"]) if "plain" in e2e else None
    rows = []
    for name in runners:
        d = diverged[name][:len(prompts)]  # the first round's (greedy: every round's tokens are the same)
        rows.append(dict(decoder=name, e2e_tok_s=round(statistics.median(e2e[name]), 1),
                         decode_tok_s=round(statistics.median(dec_only[name]), 1),
                         vs_our_plain=round(statistics.median(e2e[name]) / base, 3) if base else "",
                         same_as_fp32=f"{sum(x is None for x in d)}/{len(d)}",
                         # ours: the tokens of plain greedy decoding on the same model (fp32 or int8 activations)
                         same_as_own_plain=f"{sum(lossless[name])}/{len(lossless[name])}" if lossless[name] else "",
                         # where the others' tokens first differ (median over those that differ)
                         median_divergence=statistics.median([x for x in d if x is not None]) if any(
                             x is not None for x in d) else ""))
    if args.rss:
        for r in rows:
            r["peak_rss_mb"] = round(peak_rss(r["decoder"], args.threads, gguf, embedded)) \
                if r["decoder"] != "transformers" else ""
    if args.prefill:
        long = long_context_prompts(tok, 1, args.prefill, "Summarise the conversations above.")[0]
        for r in rows:
            if r["decoder"] in ("plain", "plain-int8", "plain-fp32") or r["decoder"] == "llama.cpp":
                dec = runners[r["decoder"]]
                dec.run(long, 1)  # warm-up at this length
                t = min(_time(dec.run, long, 1) for _ in range(2))
                r[f"prefill_{len(long)}_tok_s"] = round(len(long) / t, 1)
    long_note = f", {args.long} of {args.long_context} tokens" if args.long else ""
    print(f"\n{gguf.name}: {len(prompts)} prompts ({args.mtbench} MT-Bench, {args.editing} editing{long_note}), {args.new_tokens} new tokens "
          f"at most, {args.rounds} rounds interleaved, {args.threads} threads, greedy; vs_our_plain: end to end")
    print_table(rows, list(rows[0]))
    if args.out:
        write_results(rows, args.out, "cpu_peers", plot=lambda ax: _plot(ax, rows, gguf.name))
    return rows


def _time(fn, *a) -> float:
    t = time.perf_counter()
    fn(*a)
    return time.perf_counter() - t


def _plot(ax, rows: list[dict], gguf_name: str) -> None:
    names = [r["decoder"] for r in rows]
    ax.barh(names, [r["e2e_tok_s"] for r in rows], label="end to end")
    ax.barh(names, [r["decode_tok_s"] for r in rows], alpha=0.4, label="decode only")
    ax.set_xlabel("tokens/s (median)")
    ax.legend()
    ax.set_title(f"{gguf_name}, CPU, greedy")


if __name__ == "__main__":
    main()
