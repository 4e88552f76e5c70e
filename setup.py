"""Builds the optional compiled extension hydra_kernels._C from csrc/ (C++ ops always, CUDA ops when
torch has CUDA and nvcc is found). With no sources in csrc/ this is a pure-Python package.

Environment: HYDRA_KERNELS_NO_EXTENSION=1 (pure Python, no extension), HYDRA_KERNELS_SKIP_CUDA_BUILD=1 /
HYDRA_KERNELS_FORCE_CUDA_BUILD=1, HYDRA_KERNELS_SKIP_RAISE_CHECK=1 (the built extension is run once to check
that a failing input check raises rather than crashes; see CRASHED), TORCH_CUDA_ARCH_LIST (default "8.0;9.0+PTX": sm_80 and sm_90 code, and
PTX that newer GPUs compile at load), MAX_JOBS (default: from cores and RAM), HYDRA_KERNELS_QUICK_BUILD=1 (-O0:
compiles ~3x faster, for checking packaging or iterating on csrc/; its kernels are several times slower, never time
them). Build against the installed torch: pip install --no-build-isolation . (pip's default build isolation has no torch: setup.py says so).
An sdist (python -m build --sdist) needs no torch: it carries csrc/ (MANIFEST.in), and installing it with
pip install --no-build-isolation hydra_kernels-*.tar.gz builds the extension against the torch installed there.
"""
import glob
import os
import sys

from setuptools import setup

HERE = os.path.dirname(os.path.abspath(__file__))


def _max_jobs() -> str:
    cores = os.cpu_count() or 1
    try:  # nvcc / cc1plus on torch headers take ~2 GB each
        ram_gb = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30
    except (ValueError, OSError):
        ram_gb = 8
    return str(max(1, min(cores, int(ram_gb // 2))))


# What pip's default build isolation meets: a fresh environment without torch (and we never let pip pull
# one into it: the default torch wheel on Linux is a multi-GB CUDA build, maybe not the user's).
NO_TORCH = """
hydra-kernels: torch is not importable in this build environment.
The compiled extension (hydra_kernels._C) is built against the torch you run, so build without pip's
build isolation, after installing torch (https://pytorch.org/get-started/locally/):

    pip install torch            # the build you want (CPU or CUDA), first
    pip install --no-build-isolation .

Or install pure Python (no extension: the "reference" and "triton" backends still work):

    HYDRA_KERNELS_NO_EXTENSION=1 pip install .
"""


# Commands that only package sources or write metadata: they compile nothing, so they must not need torch
# (python -m build --sdist runs them in an isolated environment without it; pip runs egg_info / dist_info
# before it builds, so the isolated `pip install .` stops at bdist_wheel with NO_TORCH).
SOURCE_ONLY = {"sdist", "egg_info", "dist_info"}


def _sources_only() -> bool:
    """Does this setup.py run only SOURCE_ONLY commands? (the first word not an option is the command;
    `setup.py sdist bdist_wheel` also builds, so every known command word is looked at)"""
    words = [a for a in sys.argv[1:] if not a.startswith("-")]
    builds = {"build", "build_ext", "bdist_wheel", "bdist", "bdist_egg", "install", "develop", "editable_wheel"}
    return bool(words) and words[0] in SOURCE_ONLY and not builds & set(words)


def extensions():
    cpp = sorted(glob.glob(os.path.join("csrc", "**", "*.cpp"), recursive=True))
    cu = sorted(glob.glob(os.path.join("csrc", "**", "*.cu"), recursive=True))
    if not cpp and not cu:
        return [], {}
    if os.environ.get("HYDRA_KERNELS_NO_EXTENSION") == "1" or _sources_only():
        return [], {}
    try:
        import torch
    except ModuleNotFoundError:
        sys.exit(NO_TORCH)
    from torch.utils.cpp_extension import CUDA_HOME, BuildExtension, CppExtension, CUDAExtension

    os.environ.setdefault("MAX_JOBS", _max_jobs())
    skip = os.environ.get("HYDRA_KERNELS_SKIP_CUDA_BUILD") == "1"
    force = os.environ.get("HYDRA_KERNELS_FORCE_CUDA_BUILD") == "1"
    with_cuda = bool(cu) and not skip and (force or (torch.version.cuda is not None and CUDA_HOME is not None))
    cuda_cpp = [f for f in cpp if os.path.basename(f).startswith("cuda_")]  # CUDA-side C++ (needs CUDA headers)
    if not with_cuda:
        cpp = [f for f in cpp if f not in cuda_cpp]
    # torch 2.13 headers use C++20 features. No fp contraction: a loop written as a product then a sum must round
    # both (decode_stack_cpu.cpp repeats the module path's ATen ops bit for bit); where a kernel wants an fma it
    # says so (_mm512_fmadd_ps, std::fma).
    # -g0 overrides the -g in Python's own CFLAGS: debug info made tree_attention_cpu.cpp take 68 s instead of 47 (its
    # kernel templates; 2-core Xeon VM, 2026-11-30) and its object 20x larger, for symbols no user reads.
    opt = "-O0" if os.environ.get("HYDRA_KERNELS_QUICK_BUILD") == "1" else "-O3"
    cxx = [opt, "-g0", "-std=c++20", "-ffp-contract=off"]
    link = []
    if sys.platform.startswith("linux"):
        # at::parallel_for is inline OpenMP in the headers: without -fopenmp our CPU kernels run on one
        # thread. The extension then needs libgomp.so.1, which resolves to the copy torch already loaded.
        cxx.append("-fopenmp")
        link.append("-fopenmp")
    if with_cuda:
        # sm_80 and sm_90 cubins, plus sm_90 PTX so newer GPUs (sm_100, sm_120) JIT-compile it at load
        os.environ.setdefault("TORCH_CUDA_ARCH_LIST", "8.0;9.0+PTX")
        ext = CUDAExtension("hydra_kernels._C", cpp + cu, define_macros=[("HYDRA_KERNELS_WITH_CUDA", None)],
                            extra_compile_args={"cxx": cxx, "nvcc": [opt, "-std=c++17", "--use_fast_math"]},
                            extra_link_args=link)
    else:
        ext = CppExtension("hydra_kernels._C", cpp, extra_compile_args={"cxx": cxx}, extra_link_args=link)
    return [ext], {"build_ext": _checked_build_ext(BuildExtension.with_options(use_ninja=True))}


# Run in a fresh interpreter on the built extension: one of its input checks must raise a Python error.
RAISE_CHECK = """
import importlib.machinery, importlib.util, sys, torch
spec = importlib.util.spec_from_file_location("_C", sys.argv[1])
spec.loader.exec_module(importlib.util.module_from_spec(spec))
try:
    torch.ops.hydra_kernels.commit_kv(torch.zeros(1, 2, 1, 4, 1, 8), torch.zeros(1, dtype=torch.long),
                                      torch.zeros(2, 1, dtype=torch.long), torch.zeros(1, dtype=torch.long))
except RuntimeError as e:
    sys.exit(0 if "accept_indices" in str(e) else 3)
sys.exit(4)
"""

CRASHED = """
hydra-kernels: the extension just built ({path}) crashes when one of its input checks raises an error
(signal {signal}): a bad argument would kill the Python process instead of raising. It was removed.
This happens when the C++ compiler's standard library is not the one torch runs with (seen with CXX
pointing at a second GCC in /opt/gcc: its inlined iostream code met the system libstdc++). Build with the
compiler torch was built with (`python -c "import torch; print(torch.__config__.show())"` names it), e.g.

    CC=gcc CXX=g++ pip install --no-build-isolation .

(HYDRA_KERNELS_SKIP_RAISE_CHECK=1 skips this check.)
"""

NOT_RAISING = """
hydra-kernels: the extension just built ({path}) failed its check run (exit {rc}; the output above says
why: 1 is usually an import error, e.g. an undefined symbol from a torch other than the one built against;
3 / 4: commit_kv's input check did not raise as expected). It was removed.
(HYDRA_KERNELS_SKIP_RAISE_CHECK=1 skips this check.)
"""


def _checked_build_ext(base):
    """build_ext that refuses an extension which crashes when it raises (the check runs the built file)."""

    class CheckedBuildExt(base):
        def run(self):
            super().run()
            if os.environ.get("HYDRA_KERNELS_SKIP_RAISE_CHECK") == "1":
                return
            import subprocess

            for ext in self.extensions:
                path = self.get_ext_fullpath(ext.name)
                rc = subprocess.run([sys.executable, "-c", RAISE_CHECK, path]).returncode
                if rc != 0:  # never leave it where `import hydra_kernels` would load it (--inplace, pip -e)
                    os.remove(path)
                    sys.exit(CRASHED.format(path=path, signal=-rc) if rc < 0 else NOT_RAISING.format(path=path, rc=rc))

    return CheckedBuildExt


ext_modules, cmdclass = extensions()
setup(ext_modules=ext_modules, cmdclass=cmdclass)
