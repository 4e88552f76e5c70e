"""python/gpu_carry.py: what travels to a lent GPU beside the carried model (git's view, the heads left
out), the model's split into two calls, and the joining there that refuses a missing or corrupt part."""
import gzip
import hashlib
import json
import os
import re
import shutil
import subprocess

import pytest

from helpers import load_script


@pytest.fixture(scope="module")
def carry():
    return load_script("python/gpu_carry.py")


def _carried(carry, tmp_path, blob: bytes, sizes):
    """A carry folder as pack writes it, without the model: the blob in parts, its manifest."""
    at = 0
    for k, n in enumerate(sizes):
        (tmp_path / f"part{k}").mkdir()
        (tmp_path / f"part{k}" / carry.PART_NAME.format(k)).write_bytes(blob[at: at + n])
        at += n
    (tmp_path / "rest").mkdir()
    (tmp_path / "rest" / "manifest.json").write_text(json.dumps(
        {"size": len(blob), "sha256": hashlib.sha256(blob).hexdigest(), "parts": list(sizes)}))
    return tmp_path


def test_unpack_joins_the_parts_and_checks_them(carry, tmp_path, capsys):
    blob = bytes(range(256)) * 1000 + b"tail"
    d = _carried(carry, tmp_path, blob, [150_001, len(blob) - 150_001])
    carry.main(["unpack", "--dir", str(d)])
    assert (d / "model.gguf").read_bytes() == blob and "sha256 checked" in capsys.readouterr().out


def test_unpack_refuses_a_corrupt_or_missing_part_and_writes_nothing(carry, tmp_path):
    blob = bytes(range(256)) * 400
    d = _carried(carry, tmp_path, blob, [40_000, len(blob) - 40_000])
    part = d / "part1" / carry.PART_NAME.format(1)
    data = bytearray(part.read_bytes())
    data[7] ^= 1
    part.write_bytes(bytes(data))
    with pytest.raises(SystemExit, match="sha256"):
        carry.main(["unpack", "--dir", str(d)])
    part.write_bytes(bytes(data[:-1]))  # cut short: named before any hashing
    with pytest.raises(SystemExit, match=r"part1.*missing or not .* bytes.*call 2"):
        carry.main(["unpack", "--dir", str(d)])
    manifest = json.loads((d / "rest" / "manifest.json").read_text())
    (d / "rest" / "manifest.json").write_text(json.dumps({**manifest, "size": len(blob) + 1}))
    with pytest.raises(SystemExit, match="parts of .* bytes for a .*-byte file"):
        carry.main(["unpack", "--dir", str(d)])
    (d / "rest" / "manifest.json").unlink()
    with pytest.raises(SystemExit, match="manifest.json is missing"):
        carry.main(["unpack", "--dir", str(d)])
    assert sorted(p.name for p in d.iterdir()) == ["part0", "part1", "rest"]  # nothing joined was left behind


def test_split_fills_the_first_call_and_names_the_bytes_over(carry):
    mib = 1 << 20
    first, second = carry.split_sizes(98 * mib, 6 * mib, 14 * mib, limit=64 * mib)
    assert first == 64 * mib - 6 * mib - carry.MARGIN and first + second == 98 * mib
    with pytest.raises(ValueError, match=r"does not fit in two calls beside .* bytes over"):
        carry.split_sizes(98 * mib, 20 * mib, 14 * mib, limit=64 * mib)


def test_what_travels_is_gits_view_less_the_hidden_heads(carry, tmp_path):
    git = lambda *a: subprocess.run(["git", "-C", str(tmp_path), *a], check=True, capture_output=True)  # noqa: E731
    git("init", "-q")
    (tmp_path / ".gitignore").write_text("ignored/\n")
    for name, size in [("tracked.py", 100), ("heads/w.bin", 5000), ("new.txt", 30), ("ignored/big", 9000)]:
        (tmp_path / name).parent.mkdir(exist_ok=True)
        (tmp_path / name).write_bytes(b"x" * size)
    git("add", ".gitignore", "tracked.py", "heads/w.bin")
    gitignore = len((tmp_path / ".gitignore").read_bytes())
    assert carry.travelling_bytes(tmp_path, leave_out="heads") == 100 + 30 + gitignore
    assert carry.travelling_bytes(tmp_path, leave_out="nothing") == 5000 + 100 + 30 + gitignore


def test_hidden_heads_stay_on_disk_do_not_travel_and_come_back(carry, tmp_path):
    git = lambda *a: subprocess.run(["git", "-C", str(tmp_path), *a], check=True, capture_output=True)  # noqa: E731
    git("init", "-q")
    heads = tmp_path / carry.HEADS
    heads.mkdir(parents=True)
    (heads / "w.bin").write_bytes(b"h" * 4000)
    (tmp_path / "code.py").write_bytes(b"c" * 50)
    git("add", ".")
    git("-c", "user.name=t", "-c", "user.email=t@t", "commit", "-q", "-m", "heads")
    exclude = (tmp_path / ".git" / "info" / "exclude").read_text()
    carry.hide_heads(tmp_path)
    assert carry.travelling_bytes(tmp_path, leave_out="nothing") == 50 and (heads / "w.bin").is_file()
    carry.restore_heads(tmp_path)
    assert carry.travelling_bytes(tmp_path, leave_out="nothing") == 4050
    assert (tmp_path / ".git" / "info" / "exclude").read_text() == exclude
    assert carry.git("status", "--short", root=tmp_path) == ""  # index and exclude as before


def test_pack_writes_what_unpack_and_the_printed_calls_read(carry, tmp_path, monkeypatch, capsys):
    """pack (a small stand-in for the GGUF; the real tokenizer, answers and ShareGPT replies): the carried
    folders, the manifest unpack checks, every path the printed calls name, and the refusals."""
    blob = bytes(range(256)) * 12_000  # 3 MB: all of it fits in the first call
    gguf = tmp_path / "m.gguf"
    gguf.write_bytes(blob)
    monkeypatch.setattr(carry, "embedded_model", lambda: (gguf, hashlib.sha256(blob).hexdigest()))
    answers = tmp_path / "self.json.gz"  # gzipped, as the committed answers are
    answers.write_bytes(gzip.compress(json.dumps({"prompt_lengths": [3, 2], "sequences": [[1, 2, 3, 4, 5], [7, 8, 9, 10]]}).encode()))
    d = carry.ROOT / "gpu_carry" / f"test-{os.getpid()}"
    try:
        args = ["pack", "--self-data", str(answers), "--sharegpt", "3", "--vocab-seqs", "4", "--draft-vocab", "256", "--dir", str(d)]
        carry.main(args)
        printed = capsys.readouterr().out
        assert (d / "part0" / carry.PART_NAME.format(0)).read_bytes() == blob
        assert (d / "part1" / carry.PART_NAME.format(1)).read_bytes() == b""
        replies = json.loads(gzip.decompress((d / "rest" / "sharegpt-replies.json.gz").read_bytes()))
        assert len(replies["sequences"]) == 3 and len(json.loads((d / "rest" / "draft_vocab.json").read_text())) == 256
        assert (d / "rest" / "site" / "gguf" / "__init__.py").is_file() and list((d / "rest" / "site").glob("gguf-*.dist-info"))
        carry.main(["unpack", "--dir", str(d)])
        assert (d / "model.gguf").read_bytes() == blob
        named = re.findall(r"gpu_carry/[\w./-]+", printed)
        assert len(named) >= 8 and all((carry.ROOT / n.rstrip("'.")).exists() for n in named), named
        (d / "rest" / "manifest.json").unlink()  # not pack's folder any more: never cleared
        with pytest.raises(SystemExit, match="holds files pack did not write"):
            carry.main(args)
        with pytest.raises(SystemExit, match="outside the repository"):
            carry.main(args[:-1] + [str(tmp_path / "carry")])
        assert carry.read_answers(d / "rest" / "self-data.json.gz")["sequences"][1] == [7, 8, 9, 10]
        bad = tmp_path / "bad.json"
        bad.write_text(json.dumps({"sequences": [[1, 2]]}))
        with pytest.raises(SystemExit, match="not python/self_data.py's JSON"):
            carry.main(["pack", "--self-data", str(bad)] + args[3:])
        monkeypatch.setattr(carry, "embedded_model", lambda: (gguf, "0" * 64))
        with pytest.raises(SystemExit, match="not the embedded model"):
            carry.main(args)
    finally:
        shutil.rmtree(d, ignore_errors=True)


def test_the_committed_answers_are_self_data_json(carry):
    """python/data's 2048 self-generated answers (pack's default): the shape self_data.py writes, every
    sequence longer than its prompt, token ids inside the embedded model's vocabulary."""
    answers = carry.read_answers(carry.DEFAULT_ANSWERS)
    lengths, seqs = answers["prompt_lengths"], answers["sequences"]
    assert len(seqs) == 2048 and all(len(s) > n > 0 for n, s in zip(lengths, seqs))
    assert sum(len(s) for s in seqs) > 500_000 and max(max(s) for s in seqs) < 49152 and min(min(s) for s in seqs) >= 0
