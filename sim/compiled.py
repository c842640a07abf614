"""torch.compile where it can run: one place that decides whether a hot function is compiled."""

from __future__ import annotations

import functools
import glob
import hashlib
import importlib
import inspect
import os
import platform
import shutil
import subprocess
import sys
import sysconfig
import uuid
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


# Dynamo keeps a function's compiled variants on its code object, shared by every object of the process
# that calls it: each environment configuration (latency slots, a batch of one, the tracking subclass,
# noise on or off) is one more. Past torch's default limit of 8 it runs the function eagerly from then on,
# with only a logged warning: slower, and with results that differ in the last bits from a fresh process's
# (a run trained in a process that had stepped 8 other configurations no longer matched the same run in a
# new one). 64 is well above what one process of this project makes (the whole test suite in one process:
# 11 variants of the environment's _observe, 8 of _transition; TORCH_LOGS=recompiles, 2026-12-02); a
# variant costs its kernels' memory, and a call checks the guards of the variants tried before its own.
RECOMPILE_LIMIT = 64


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
    return torch.compile(fn, dynamic=dynamic, options=_options(dynamic), recompile_limit=RECOMPILE_LIMIT)


# Set to 1 (install.sh's warm-up run does) to save the graphs of the methods compiled by compile_method
# that no saved graph fits yet, for later processes to load.
SAVE_GRAPHS_ENV = "ROBOLEARN_SAVE_GRAPHS"
# Guards that a saved graph cannot keep (torch 2.13 does not serialize them): the identity of functions,
# modules and builtins the traced code calls. Instead each graph's traced sources are checked at load
# (_stale_source), and the directory is named by the hash of the method's package's sources (_graph_dir),
# so that an edit starts a new directory rather than leaving stale graphs to be refused in every process.
# Kept: the types, shapes, dtypes and constants of what the method reads, and the global state (grad mode).
# Not seen, then: a module-level function replaced at run time, and hooks on the owner's modules (a saved graph
# is not used where any module has one when the graphs load: _has_hooks).
_UNSAVED_GUARDS = ("ID_MATCH", "FUNCTION_MATCH", "CLASS_MATCH", "MODULE_MATCH", "CLOSURE_MATCH", "BUILTIN_MATCH",
                   "DICT_VERSION", "NN_MODULE", "WEAKREF_ALIVE")


def compile_method(owner: object, name: str, enabled: bool, dynamic: bool | None = None,
                   device: str | torch.device = "cpu") -> Callable:
    """``compile_if(owner.<name>, ...)``, and on a CPU a graph of it saved on this machine where one fits.

    Every process traces a compiled function again with Dynamo before its first call (~2.5 s for the
    quadrotor's step here) even when inductor's kernels come from the disk cache. A graph saved by
    ``torch.compile(...).aot_compile`` (torch 2.13, experimental) is loaded instead, with the same
    kernels (bit-identical results). Graphs are saved only where ``SAVE_GRAPHS_ENV`` is 1; without a
    saved graph whose guards pass, the method is compiled as ``compile_if`` does."""
    bound = getattr(owner, name)
    compiled = compile_if(bound, enabled, dynamic, device)
    if compiled is bound or torch.device(device).type != "cpu":
        return compiled
    return _SavedGraph(owner, getattr(type(owner), name), compiled, dynamic)


class _SavedGraph:
    """Calls ``method(owner, *args)`` through the first saved graph whose guards pass (the saved graphs
    are loaded at the first call), else through ``fallback`` (torch.compile of the bound method)."""

    def __init__(self, owner: object, method: Callable, fallback: Callable, dynamic: bool | None):
        self.owner, self.method, self.fallback, self.dynamic = owner, method, fallback, dynamic
        self.directory = _graph_dir(method, dynamic)  # (the sources hashed now, as close to their import as can be)
        self.graphs: list | None = None  # loaded at the first call
        self.unsaveable = False  # saving failed once: not tried again

    def __call__(self, *args):
        saved_args = tuple(_unmarked(a) for a in args)
        if self.graphs is None:
            self.graphs = [] if _has_hooks(self.owner) else _load_graphs(self.directory, self.method)
        for graph in self.graphs:
            if graph.guard_check(self.owner, *saved_args):
                return graph(self.owner, *saved_args)
        if os.environ.get(SAVE_GRAPHS_ENV) == "1" and not self.unsaveable:
            try:
                graph = self._save(saved_args)
            except Exception as e:  # noqa: BLE001 (experimental: a graph that cannot be saved is compiled as usual)
                self.unsaveable = True
                warnings.warn(f"could not save the compiled graph of {self.method.__qualname__} ({type(e).__name__}: "
                              f"{e}): compiling it as usual", stacklevel=2)
            else:
                self.graphs.append(graph)
                return graph(self.owner, *saved_args)
        return self.fallback(*args)

    def _save(self, args: tuple):
        """A graph traced and compiled for these arguments, saved for later processes."""
        # The saved guards describe the owner by pickling it (tensors as shapes); a torch.Generator does
        # not unpickle, and a loaded saved graph's guard manager does not pickle: the owner's own saved-graph
        # callers and objects holding some (the environment a trainer holds) are set aside while tracing.
        # (A method that reads one of them fails to trace without it: then it is compiled as usual.)
        aside = {k: v for k, v in vars(self.owner).items() if _set_aside(v)}
        for k in aside:
            setattr(self.owner, k, None)
        try:
            options = {**_options(self.dynamic), "guard_filter_fn": _saved_guards}
            graph = torch.compile(self.method, dynamic=self.dynamic, fullgraph=True,
                                  options=options).aot_compile(((self.owner, *args), {}))
        finally:
            for k, v in aside.items():
                setattr(self.owner, k, v)
        graph.disable_guard_check()
        if not graph.guard_check(self.owner, *args):  # it would never be used, and saved again at every call
            raise RuntimeError("the saved guards refuse the arguments it was traced for")
        os.makedirs(self.directory, exist_ok=True)
        path = os.path.join(self.directory, f"{uuid.uuid4().hex}.graph")
        graph.save_compiled_function(path)
        try:  # a file a later process could not load (something in the guards' pickle that does not unpickle)
            _read_graph(path, self.method)
        except Exception:
            os.unlink(path)
            raise
        return graph


def _has_hooks(owner: object) -> bool:
    """Whether a hook would change what the owner's modules compute (global module hooks, or hooks on a
    module the owner holds): saved graphs do not guard on them."""
    from torch.nn.modules import module as nn_module

    kinds = ("_forward_hooks", "_forward_pre_hooks", "_backward_hooks", "_backward_pre_hooks")
    if any(getattr(nn_module, f"_global{kind}") for kind in kinds):
        return True
    modules = [m for v in vars(owner).values() if isinstance(v, torch.nn.Module) for m in v.modules()]
    return any(getattr(m, kind, None) for m in modules for kind in kinds)


def _set_aside(value: object) -> bool:
    """Whether an attribute of a saved graph's owner is left out of the trace (see _SavedGraph._save)."""
    if isinstance(value, (torch.Generator, _SavedGraph)):
        return True
    return any(isinstance(v, _SavedGraph) for v in getattr(value, "__dict__", {}).values())


@functools.cache  # per process: every environment of a run (training, each evaluation) shares them
def _load_graphs(directory: str, method: Callable) -> list:
    """The graphs saved in ``directory`` whose traced sources are the current ones (any that cannot be loaded
    or are stale is skipped with a warning)."""
    graphs = []
    for path in sorted(glob.glob(os.path.join(directory, "*.graph"))):
        try:
            graph = _read_graph(path, method)
            stale = _stale_source(graph)
        except Exception as e:  # noqa: BLE001 (an experimental format: any failure means "compile instead")
            stale = f"{type(e).__name__}: {e}"
        if stale is not None:
            warnings.warn(f"ignoring the saved compiled graph {path} ({stale}): compiling instead", stacklevel=3)
            continue
        graph.disable_guard_check()  # _SavedGraph checks them itself, once per call
        graphs.append(graph)
    return graphs


def _read_graph(path: str, method: Callable):
    """The graph saved in ``path`` for ``method``, its globals those of the method's module."""
    with open(path, "rb") as f:
        return torch.compiler.load_compiled_function(f, f_globals=sys.modules[method.__module__].__dict__)


def _stale_source(graph) -> str | None:
    """Which source the graph traced differs from the current one (Dynamo keeps each inlined function's
    lines and their SHA-256; the directory's key covers only the method's own top-level package), or None."""
    for src in graph.source_info().inlined_sources:
        lines = inspect.getsourcelines(importlib.import_module(src.module))[0][src.firstlineno - 1:src.lastlineno - 1]
        if hashlib.sha256("".join(lines).encode()).hexdigest() != src.checksum:
            return f"{src.module} changed since it was traced (lines {src.firstlineno}-{src.lastlineno})"
    return None


def _unmarked(x):
    """``x``, or for a tensor marked by torch._dynamo.mark_dynamic an unmarked alias of it: a graph saved
    by aot_compile records its inputs as unmarked (torch 2.13) and its guards then refuse marked ones.
    Its dimensions are dynamic all the same (compile_method's ``dynamic``)."""
    return x.detach() if isinstance(x, torch.Tensor) and hasattr(x, "_dynamo_dynamic_indices") else x


def _saved_guards(entries) -> list[bool]:
    """Which of Dynamo's guards a saved graph keeps (guard_filter_fn): see _UNSAVED_GUARDS."""
    return [e.guard_type not in _UNSAVED_GUARDS for e in entries]


def _graph_dir(method: Callable, dynamic: bool | None) -> str:
    """Where the graphs of ``method`` are saved: under inductor's cache, in a directory named by
    torch's and Python's versions, the method, the compile options and the sources of its top-level
    package (every .py file in it: what the traced code may call)."""
    h = hashlib.sha256()
    h.update(repr((torch.__version__, sys.version, method.__module__, method.__qualname__, dynamic,
                   sorted(_options(dynamic).items()))).encode())
    h.update(_package_source_hash(method.__module__.partition(".")[0]).encode())
    return os.path.join(_graph_root(), f"{method.__qualname__}-{h.hexdigest()[:20]}")


def _graph_root() -> str:
    """Saved graphs live beside the kernels they call, in inductor's cache."""
    from torch._inductor.runtime.cache_dir_utils import cache_dir

    return os.path.join(cache_dir(), "robolearn_graphs")


@functools.cache
def _package_source_hash(package: str) -> str:
    """SHA-256 of the names and contents of every .py file in ``package``'s directory tree."""
    root = os.path.dirname(os.path.abspath(sys.modules[package].__file__))
    h = hashlib.sha256()
    for path in sorted(glob.glob(os.path.join(root, "**", "*.py"), recursive=True)):
        h.update(os.path.relpath(path, root).encode())
        with open(path, "rb") as f:
            h.update(f.read())
    return h.hexdigest()


def _options(dynamic: bool | None) -> dict:
    """Inductor's options for a function compiled here."""
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
    return options


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
