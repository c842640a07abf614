"""torch.compile where it can run: one place that decides whether a hot function is compiled."""

from __future__ import annotations

import shutil
import warnings
from typing import Callable

import torch


def compile_if(fn: Callable, enabled: bool, dynamic: bool | None = None) -> Callable:
    """``torch.compile(fn)`` when ``enabled`` and a C++ compiler is on the PATH (inductor builds CPU
    kernels with it); otherwise ``fn`` itself, with a warning if compiling was asked for."""
    if not enabled:
        return fn
    if shutil.which("g++") is None and shutil.which("c++") is None:
        warnings.warn("torch.compile needs a C++ compiler (g++) and none is installed: running eagerly "
                      "(install g++, or set task.compile=false algo.compile=false to silence this)", stacklevel=2)
        return fn
    import torch._inductor.config as inductor

    if inductor.cpp.vec_isa_ok is None:  # unless TORCHINDUCTOR_VEC_ISA_OK says otherwise
        # Inductor otherwise proves, in every new process, that g++ can build and load a kernel for
        # each vector instruction set the CPU reports (AVX2, AVX-512, ...): it builds a probe and
        # loads it in a fresh Python subprocess per set, ~0.85 s of each start here (2 cores). Any g++
        # of the last decade builds them all, so trust the CPU's list.
        inductor.cpp.vec_isa_ok = True
    return torch.compile(fn, dynamic=dynamic)
