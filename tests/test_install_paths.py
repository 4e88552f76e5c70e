"""The install paths a user tries, in a fresh venv with only the local package mirror (no network, no torch):
`pip install .` with pip's default build isolation stops at once with what to do (install torch, then
--no-build-isolation; never a bare ModuleNotFoundError, never a torch pulled into the build), and
HYDRA_KERNELS_NO_EXTENSION=1 installs the package as pure Python. (The --no-build-isolation path with the
extension is what `make setup` runs.)"""
import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
MIRROR = Path("/opt/pypi/simple")  # the local package index of this machine (setuptools, wheel, ninja)
pytestmark = pytest.mark.skipif(not (MIRROR / "setuptools").exists(), reason="needs the local package mirror")


@pytest.fixture(scope="module")
def project(tmp_path_factory):
    """The project's sources in a scratch directory (pip builds in tree: keep the checkout clean)."""
    dst = tmp_path_factory.mktemp("src")
    for name in ("pyproject.toml", "setup.py", "README.md"):
        shutil.copy(ROOT / name, dst / name)
    shutil.copytree(ROOT / "csrc", dst / "csrc")
    shutil.copytree(ROOT / "hydra_kernels", dst / "hydra_kernels",
                    ignore=shutil.ignore_patterns("_C*.so", "__pycache__", "heads"))
    return dst


def _pip_wheel(project, out, **env):
    """pip wheel --no-deps of the project with build isolation, offline: only the local mirror."""
    full = {k: v for k, v in os.environ.items() if not k.startswith("PIP_")}
    full.update(PIP_INDEX_URL=MIRROR.as_uri(), PIP_NO_CACHE_DIR="1", PIP_DISABLE_PIP_VERSION_CHECK="1",
                PIP_CONFIG_FILE=os.devnull, **env)
    return subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "-w", str(out), str(project)],
                          capture_output=True, text=True, env=full, timeout=120)


def test_isolated_build_without_torch_says_what_to_do(project, tmp_path):
    r = _pip_wheel(project, tmp_path)
    assert r.returncode != 0
    err = r.stdout + r.stderr
    assert "pip install --no-build-isolation ." in err and "HYDRA_KERNELS_NO_EXTENSION=1" in err, err[-3000:]
    assert "Downloading torch" not in err and "Collecting torch" not in err


def test_pure_python_install_builds_a_wheel(project, tmp_path):
    r = _pip_wheel(project, tmp_path, HYDRA_KERNELS_NO_EXTENSION="1")
    assert r.returncode == 0, (r.stdout + r.stderr)[-3000:]
    (wheel,) = tmp_path.glob("hydra_kernels-*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    assert "hydra_kernels/__init__.py" in names and "hydra_kernels/ops/triton/commit_kv.py" in names
    assert not [n for n in names if n.endswith(".so")] and "-py3-none-any" in wheel.name
