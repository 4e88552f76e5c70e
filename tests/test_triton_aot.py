"""Every Triton kernel compiled ahead of time for sm_90 (H100) and sm_80 (A100) through its real launcher
(benchmarks/triton_aot.py): no compile error, shared memory within the device, no spill in any dtype,
commit_kv's loads and stores separated by a barrier. Runs in a subprocess (this process runs Triton in
the interpreter); compiled results are cached by kernel source, so a rerun of unchanged kernels is quick."""
import csv
import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="needs triton")


def _aot():
    spec = importlib.util.spec_from_file_location("triton_aot", ROOT / "benchmarks" / "triton_aot.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules["triton_aot"] = mod  # its dataclasses look their module up there
    spec.loader.exec_module(mod)
    return mod


def test_every_triton_kernel_file_has_compile_specs():
    aot = _aot()
    files = aot.kernel_files()
    assert files == sorted(aot.SPECS), f"ops/triton files without a compile spec: {set(files) ^ set(aot.SPECS)}"
    for op in files:
        assert aot.declared_kernels(op), f"ops/triton/{op}.py declares no `_*_kernel`"


def test_barrier_check_sees_loads_before_stores():
    aot = _aot()
    racy = "ld.global.b32 %r1, [%rd1];\nst.global.b32 [%rd2], %r1;\n"
    fenced = "ld.global.b32 %r1, [%rd1];\nbar.sync 0;\nst.global.b32 [%rd2], %r1;\n"
    late_load = fenced + "ld.global.b32 %r2, [%rd3];\n"
    assert not aot._barrier_between_loads_and_stores(racy)
    assert aot._barrier_between_loads_and_stores(fenced)
    assert not aot._barrier_between_loads_and_stores(late_load)


def test_every_kernel_compiles_for_sm90_and_sm80(tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    r = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "triton_aot.py"), "--out", str(tmp_path)],
                       capture_output=True, text=True, env=env, cwd=ROOT)
    assert r.returncode == 0, (r.stdout + r.stderr)[-6000:]
    with open(tmp_path / "triton_aot.csv") as f:
        rows = list(csv.DictReader(f))
    aot = _aot()
    for op in aot.kernel_files():
        for kernel in aot.declared_kernels(op):
            for arch in ("90", "80"):
                got = [x for x in rows if x["kernel"] == kernel and x["arch"] == arch]
                assert got and all(x["registers"] for x in got), f"{kernel} sm_{arch} not compiled"
    groups = {(x["kernel"], x["model"], x["dtype"], x["arch"]) for x in rows}
    assert (tmp_path / "triton_aot.md").read_text().count("\n| _") == len(groups)  # one line per group
    assert not [x for x in rows if x["fails"]]
