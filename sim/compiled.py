"""torch.compile where it can run: one place that decides whether a hot function is compiled."""

from __future__ import annotations

import functools
import os
import platform
import shutil
import subprocess
import sysconfig
import warnings
from typing import Callable

import torch


# Checks that inductor writes into the Python wrapper of each compiled graph and runs at every call:
# the sizes and strides of the graph's inputs (which dynamo's guards have already checked on the way
# in) and of the outputs of the ATen kernels it falls back to, and their alignment. They check
# inductor's own layout assumptions, not this project's code: without them a wrong assumption would
# give wrong numbers instead of an error. Each is a few microseconds, but the simulator step has ~50
# inputs and a quad_hover run makes ~10k compiled calls: without them it passed 0.3-0.9 s sooner
# (seed 0, 2 runs each, ad-hoc A/B of `python -m policies.train task=quad_hover`) with bit-identical
# parameters. Only for the functions compiled here; an environment variable that sets one keeps
# the user's choice.
_LAYOUT_ASSERTS = {"size_asserts": "TORCHINDUCTOR_SIZE_ASSERTS", "alignment_asserts": "TORCHINDUCTOR_ALIGNMENT_ASSERTS"}


def compile_if(fn: Callable, enabled: bool, dynamic: bool | None = None,
               device: str | torch.device = "cpu") -> Callable:
    """``torch.compile(fn)`` when ``enabled`` and a C++ compiler and Python's C headers are installed
    (inductor builds CPU kernels with them), and for a CUDA ``device`` Triton (its GPU kernels); otherwise
    ``fn`` itself, with a warning if compiling was asked for."""
    if not enabled:
        return fn
    if torch.device(device).type == "cuda":
        from torch.utils._triton import has_triton

        if not has_triton():
            warnings.warn("torch.compile builds CUDA kernels with Triton and this PyTorch has none: running "
                          "eagerly (install the CUDA build's triton, or set task.compile=false algo.compile=false "
                          "to silence this)", stacklevel=2)
            return fn
    if shutil.which("g++") is None and shutil.which("c++") is None:
        warnings.warn("torch.compile needs a C++ compiler (g++) and none is installed: running eagerly "
                      "(install g++, or set task.compile=false algo.compile=false to silence this)", stacklevel=2)
        return fn
    if not _python_headers():
        warnings.warn(f"torch.compile builds its CPU kernels against Python's C headers and there is no "
                      f"Python.h in {sysconfig.get_paths()['include']}: running eagerly (on Debian: apt-get "
                      "install python3-dev, as install.sh does)", stacklevel=2)
        return fn
    _use_project_kernel_cache()
    import torch._inductor.config as inductor

    if inductor.cpp.vec_isa_ok is None and _gxx_builds_every_x86_vector_isa():
        # Unless TORCHINDUCTOR_VEC_ISA_OK says otherwise, inductor proves in every new process that
        # the compiler can build and load a kernel for each vector instruction set the CPU reports:
        # it builds a probe and loads it in a fresh Python subprocess per set, ~0.85 s of each start
        # here (2 cores). Where the compiler is known to build them all, trust the CPU's list.
        inductor.cpp.vec_isa_ok = True
    options = {name: False for name, env in _LAYOUT_ASSERTS.items() if env not in os.environ}
    if dynamic:
        # With a dynamic batch size, inductor decides whether a loop runs on all cores from the size
        # it compiles for first (on 2 threads, at least 1024 elements) and caches that kernel on disk
        # for every later size and process: a step first compiled for a few environments (a test, an
        # evaluation) stayed single-threaded at 16384. With dynamic threads every loop is an OpenMP
        # region sized at each call (by torch's thread count, so threads= holds too). The results do
        # not depend on the thread count as long as a graph reduces only within an environment, as
        # the simulator's do; a reduction across environments would be split by thread.
        options["cpp.dynamic_threads"] = True
    return torch.compile(fn, dynamic=dynamic, options=options)


def kernel_cache_dir() -> str:
    """The project's inductor kernel cache: $XDG_CACHE_HOME/robolearn/torchinductor (~/.cache/...;
    a relative XDG_CACHE_HOME is ignored, as the XDG base directory specification says)."""
    base = os.environ.get("XDG_CACHE_HOME", "")
    if not os.path.isabs(base):
        base = os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "robolearn", "torchinductor")


def _use_project_kernel_cache() -> None:
    """Point inductor's kernel cache at :func:`kernel_cache_dir` unless TORCHINDUCTOR_CACHE_DIR names
    another: inductor's default is in /tmp, which Debian empties at every boot, and install.sh compiles
    the quadrotor training's kernels once into the project's, so a new machine's first training run
    loads them. Inductor writes its default into the variable the first time it looks (any import of
    torch._dynamo does), so that value counts as unset. Where the directory cannot be made or written
    (no writable home), inductor's default stays."""
    from torch._inductor.runtime.cache_dir_utils import default_cache_dir  # light: no dynamo import

    current = os.environ.get("TORCHINDUCTOR_CACHE_DIR")
    if current is not None and os.path.abspath(current) != os.path.abspath(default_cache_dir()):
        return  # the user's choice
    path = kernel_cache_dir()
    try:
        os.makedirs(path, exist_ok=True)
    except OSError:
        return
    if os.access(path, os.W_OK | os.X_OK):
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = path


def _python_headers() -> bool:
    """Whether this Python's C headers are installed: inductor's kernels include Python.h."""
    return os.path.isfile(os.path.join(sysconfig.get_paths()["include"], "Python.h"))


@functools.cache  # one g++ call per process, not one per compiled function
def _gxx_builds_every_x86_vector_isa() -> bool:
    """An x86-64 CPU and g++ >= 11 as inductor's compiler (no CXX override): g++ 11 added the AMX
    flags, the newest set inductor uses (AVX2 and AVX-512 came years before)."""
    if platform.machine() not in ("x86_64", "AMD64") or os.environ.get("CXX"):
        return False
    try:
        version = subprocess.run(["g++", "-dumpversion"], capture_output=True, text=True, timeout=10).stdout
        return int(version.split(".")[0]) >= 11
    except (OSError, ValueError, subprocess.TimeoutExpired):
        return False
