"""The install paths a user tries, each into a fresh venv that then imports the package and decodes
(tests/install_generate_check.py: a tiny random Llama, plain and speculative greedy, same tokens), offline
with only this machine's local package sources:

- `pip install .` (pip's default build isolation: no torch in the build environment) stops at once and
  says what to do, never a bare ModuleNotFoundError, never a torch pulled into the build;
- `HYDRA_KERNELS_NO_EXTENSION=1 pip install .` installs pure Python (a py3-none-any wheel, no _C);
- `python -m build --sdist` (isolated, no torch needed) makes an sdist with csrc/ and the shipped heads;
  `pip install --no-build-isolation <sdist>` builds the extension from it against the installed torch.

`pip install --no-build-isolation .` from the checkout is not a test of its own: it runs the sdist install's
build (the same setup.py and sources, built into a wheel against the installed torch), and `make setup`, which
every CI run starts with, installs the checkout that way (editable) before the suite imports it. A separate
test built the extension a third time (~2 CPU-minutes of CI, 2026-11-29).

Installing torch (~190 MB wheel) and the dependencies once per venv would cost ~30 s each, so one base
venv per module holds torch, the package's dependencies and the build tools (this test run's own, linked in: `base`),
and each fresh venv sees it through a .pth line (the nested-venv equivalent of --system-site-packages): pip there
installs only the package, into the fresh venv's own site-packages, resolving the declared dependencies against the
base.
The venvs run outside the checkout with PYTHONPATH unset, so only the installed copy can be imported.
"""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import sysconfig
import tarfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
MIRROR = Path("/opt/pypi/simple")  # the local package index of this machine
WHEELS = Path("/opt/wheels")  # where the CPU torch wheel lies (pip's find-links here, as `make setup` uses)
CHECK = ROOT / "tests" / "install_generate_check.py"
SITE = Path("lib") / f"python{sys.version_info.major}.{sys.version_info.minor}" / "site-packages"
pytestmark = pytest.mark.skipif(
    not (MIRROR / "setuptools").exists() or not any(WHEELS.glob("torch-*.whl")),
    reason=f"needs this machine's local package sources: the index {MIRROR} and the torch wheel in {WHEELS}")


def _env(venv: Path | None = None, base: Path | None = None, **extra) -> dict[str, str]:
    """A user's shell: offline pip on the local sources only, none of this test run's settings."""
    drop = ("PIP_", "PYTHON", "VIRTUAL_ENV", "TRITON_", "HYDRA_KERNELS_")
    env = {k: v for k, v in os.environ.items() if not k.startswith(drop)}
    env.update(PIP_INDEX_URL=MIRROR.as_uri(), PIP_FIND_LINKS=str(WHEELS), PIP_NO_CACHE_DIR="1",
               PIP_DISABLE_PIP_VERSION_CHECK="1", PIP_CONFIG_FILE=os.devnull, **extra)
    # the venv's own scripts first, then the base's (ninja, which torch's extension builder runs)
    env["PATH"] = os.pathsep.join([str(v / "bin") for v in (venv, base) if v is not None] + [env.get("PATH", "")])
    return env


def _run(cmd, cwd: Path, env: dict[str, str], timeout: int = 300) -> subprocess.CompletedProcess:
    return subprocess.run([str(c) for c in cmd], cwd=cwd, env=env, capture_output=True, text=True,
                          timeout=timeout)


def _ok(r: subprocess.CompletedProcess) -> str:
    out = r.stdout + r.stderr
    assert r.returncode == 0, f"{' '.join(map(str, r.args))} failed:\n{out[-4000:]}"
    return out


@pytest.fixture(scope="module")
def project(tmp_path_factory):
    """The project's sources in a scratch directory (pip builds in tree: keep the checkout clean)."""
    dst = tmp_path_factory.mktemp("src")
    for name in ("pyproject.toml", "setup.py", "README.md", "MANIFEST.in"):
        shutil.copy(ROOT / name, dst / name)
    shutil.copytree(ROOT / "csrc", dst / "csrc")
    shutil.copytree(ROOT / "hydra_kernels", dst / "hydra_kernels",
                    ignore=shutil.ignore_patterns("_C*.so", "__pycache__", "*.pyc"))
    return dst


# this test run's installed distributions that are the package itself: its dist-info, the editable install's finder
OWN_ENTRIES = ("hydra_kernels", "__editable__", "__pycache__")


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    """A venv with torch, the package's declared dependencies and the build tools, not the package.

    This test run's own installed distributions are linked into it, the package's own entries (OWN_ENTRIES) left out:
    installing torch and the dependencies again from the local sources took ~64 s of each CI run (2026-11-30). pip then
    adds the `build` frontend (not a test dependency); what it needs is satisfied here or new, so pip replaces none of
    the linked distributions (an uninstall through a link would delete this run's own files)."""
    venv = tmp_path_factory.mktemp("base") / "venv"
    _ok(_run([sys.executable, "-m", "venv", "--without-pip", venv], venv.parent, _env()))
    ours = Path(sysconfig.get_paths()["purelib"])  # this interpreter's site-packages
    for entry in ours.iterdir():
        if not entry.name.startswith(OWN_ENTRIES):
            (venv / SITE / entry.name).symlink_to(entry)
    ninja = Path(sysconfig.get_paths()["scripts"]) / "ninja"  # the binary torch's extension builder runs
    if ninja.exists():
        (venv / "bin" / "ninja").symlink_to(ninja)
    for need in ("torch", "triton", "transformers", "gguf", "safetensors", "tqdm", "numpy", "setuptools", "wheel",
                 "ninja", "pip"):  # the declared dependencies and the build tools, linked
        assert (venv / SITE / need).exists(), f"this test run has no {need} to link into the base venv"
    out = _ok(_run([venv / "bin" / "python", "-m", "pip", "install", "build"], venv.parent, _env()))
    assert "Uninstalling" not in out, out[-3000:]
    assert not list((venv / SITE).glob("hydra_kernels*")), "the base venv must not hold the package"
    return venv


def _fresh_venv(base: Path, where: Path) -> Path:
    """A new venv without pip whose interpreter also sees the base's site-packages (after its own)."""
    venv = where / "venv"
    _ok(_run([sys.executable, "-m", "venv", "--without-pip", venv], where, _env()))
    (venv / SITE / "_base_venv.pth").write_text(f"{base / SITE}\n")
    return venv


def _pip_install(venv: Path, base: Path, target, *args, **env):
    """`pip install [args] target` in the fresh venv (its pip is the base's, installing into the venv)."""
    return _run([venv / "bin" / "python", "-m", "pip", "install", *args, target], venv.parent,
                _env(venv, base, **env))


def _generate(venv: Path, base: Path) -> dict:
    """Run the decoding check in the venv, outside the checkout; its JSON line."""
    out = _ok(_run([venv / "bin" / "python", CHECK], venv.parent, _env(venv, base), timeout=120))
    result = json.loads(out.strip().splitlines()[-1])
    assert Path(result["file"]).is_relative_to(venv / SITE), f"imported {result['file']}, not the installed copy"
    assert result["plain"] == result["speculative"] and len(result["plain"]) == 12, result
    return result


def _installed(venv: Path) -> Path:
    return venv / SITE / "hydra_kernels"


def test_isolated_build_without_torch_says_what_to_do(project, base, tmp_path):
    venv = _fresh_venv(base, tmp_path)
    r = _pip_install(venv, base, project)  # pip's default: build isolation
    assert r.returncode != 0
    err = r.stdout + r.stderr
    assert "pip install --no-build-isolation ." in err and "HYDRA_KERNELS_NO_EXTENSION=1" in err, err[-3000:]
    assert "Downloading torch" not in err and "Collecting torch" not in err
    assert not _installed(venv).exists()


def test_pure_python_install_imports_and_generates(project, base, tmp_path):
    venv = _fresh_venv(base, tmp_path)
    _ok(_pip_install(venv, base, project, HYDRA_KERNELS_NO_EXTENSION="1"))
    pkg = _installed(venv)
    assert not list(pkg.glob("_C*.so"))
    (info,) = (venv / SITE).glob("hydra_kernels-*.dist-info")
    assert "Tag: py3-none-any" in (info / "WHEEL").read_text()
    assert list(pkg.glob("heads/*/*/model.safetensors")), "the shipped heads are package data"
    heads = ROOT / "hydra_kernels" / "heads"  # every shipped file, the composed drafter's table too
    missing = {str(p.relative_to(heads)) for p in heads.rglob("*") if p.is_file() and p.suffix in (".json", ".safetensors")
               and not (pkg / "heads" / p.relative_to(heads)).is_file()}
    assert not missing, f"shipped files not installed as package data: {sorted(missing)}"
    result = _generate(venv, base)
    assert not result["native"] and result["tree_attention"] == "reference", result


def test_sdist_carries_the_sources_and_installs_with_the_extension(project, base, tmp_path):
    dist = tmp_path / "dist"
    # python -m build's default: an isolated environment (setuptools, wheel, ninja from the index; no torch)
    _ok(_run([base / "bin" / "python", "-m", "build", "--sdist", "--outdir", dist, project], tmp_path,
             _env(base)))
    (sdist,) = dist.glob("hydra_kernels-*.tar.gz")
    with tarfile.open(sdist) as tf:
        names = {n.split("/", 1)[1] for n in tf.getnames() if "/" in n}
    want = {str(p.relative_to(ROOT)) for p in (ROOT / "csrc").iterdir() if p.suffix in (".cpp", ".cu", ".h")}
    want |= {str(p.relative_to(ROOT)) for p in (ROOT / "hydra_kernels" / "heads").rglob("*") if p.is_file()}
    want |= {"setup.py", "pyproject.toml", "MANIFEST.in", "hydra_kernels/ops/triton/tree_attention.py"}
    assert not want - names, f"missing from the sdist: {sorted(want - names)}"
    assert not [n for n in names if n.endswith(".so") or n.startswith("build/")], sorted(names)

    venv = _fresh_venv(base, tmp_path)
    # a quick (-O0) build: what this test checks is the sdist's sources and the build from them; the -O3 build of the
    # same setup.py and sources is `make setup`'s, which every CI run starts with (-O3 here took ~170 CPU-s more)
    _ok(_pip_install(venv, base, sdist, "--no-build-isolation", HYDRA_KERNELS_QUICK_BUILD="1"))
    assert list(_installed(venv).glob("_C*.so")), "the sdist install built no extension"
    result = _generate(venv, base)
    assert result["native"] and result["tree_attention"] == "native", result
