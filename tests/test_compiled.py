"""sim.compiled: how the simulator's steps are compiled."""

import io
import json
import logging
import os
import shutil
import subprocess
import sys
import threading
from pathlib import Path

import pytest
import torch

from sim.compiled import compile_if

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.skipif(shutil.which("g++") is None, reason="torch.compile builds CPU kernels with g++")
def test_a_function_compiled_here_is_still_compiled_past_torchs_default_of_eight_variants(monkeypatch):
    """Dynamo's variants of a function are shared by the whole process. Past torch's default limit of 8 it
    ran the simulator's step eagerly from then on (see RECOMPILE_LIMIT): here a ninth and later variant
    (each shape is one, dynamic=False) would raise instead."""
    from sim.compiled import RECOMPILE_LIMIT

    monkeypatch.setattr(torch._dynamo.config, "fail_on_recompile_limit_hit", True)

    def step(x: torch.Tensor) -> torch.Tensor:
        return x * 3.0 + 1.0

    fn = compile_if(step, True, dynamic=False)
    assert fn is not step, "not compiled (no Python headers?)"
    assert RECOMPILE_LIMIT > 10
    for n in range(1, 11):
        assert torch.equal(fn(torch.ones(n)), torch.full((n,), 4.0)), n


@pytest.mark.skipif(shutil.which("g++") is None, reason="torch.compile builds CPU kernels with g++")
def test_a_dynamic_batch_graph_first_compiled_small_still_runs_its_loops_on_every_thread():
    """Inductor would make this graph's loops single-threaded for good (272 elements < 2 threads x
    512) and reuse that kernel at every batch size: see the comment in compile_if."""
    from torch._inductor import config as inductor
    from torch._inductor.codecache import output_code_log

    def step(x: torch.Tensor) -> torch.Tensor:
        return (2.0 * x).sin() + x

    captured = io.StringIO()
    handler, level = logging.StreamHandler(captured), output_code_log.level
    output_code_log.addHandler(handler)
    output_code_log.setLevel(logging.DEBUG)
    try:
        with inductor.patch(fx_graph_cache=False):  # generate the kernel here, not from the disk cache
            compile_if(step, True, dynamic=True)(torch.ones(16, 17))
    finally:
        output_code_log.removeHandler(handler)
        output_code_log.setLevel(level)
    code = captured.getvalue()
    assert "cpp_fused" in code, "no C++ kernel was generated"
    assert "#pragma omp parallel" in code


def test_without_python_headers_compiling_falls_back_to_eager_with_a_warning(monkeypatch, tmp_path):
    """inductor's kernels include Python.h: without it the first compiled call would fail, so the
    function runs eagerly and says why."""
    import sysconfig

    real = sysconfig.get_paths
    monkeypatch.setattr(sysconfig, "get_paths", lambda *a, **k: {**real(*a, **k), "include": str(tmp_path)})

    def fn(x):
        return x + 1

    with pytest.warns(UserWarning, match="no Python.h in"):
        assert compile_if(fn, True) is fn


def test_without_triton_a_cuda_function_runs_eagerly_and_says_why(monkeypatch):
    """On a CUDA device inductor needs Triton: without it (here: this CPU build's own state, or patched)
    the function runs eagerly with a warning instead of failing at its first call; a CPU function is
    compiled as before."""
    import torch.utils._triton as triton

    monkeypatch.setattr(triton, "has_triton", lambda: False)

    def fn(x):
        return x + 1

    with pytest.warns(UserWarning, match="Triton"):
        assert compile_if(fn, True, device=torch.device("cuda")) is fn
    if shutil.which("g++") is not None:
        assert compile_if(fn, True, device="cpu") is not fn


@pytest.mark.skipif(shutil.which("g++") is None, reason="torch.compile builds CPU kernels with g++")
def test_kernels_are_cached_where_a_reboot_keeps_them_unless_the_user_says_otherwise(monkeypatch, tmp_path):
    """Inductor's default cache is in /tmp, which Debian empties at boot; install.sh fills the
    project's once (see compile_if). Inductor's own default in the variable (written there by any
    import of torch._dynamo, as this test's process has done) counts as unset; a user's choice stays."""
    import os

    from torch._inductor.runtime.cache_dir_utils import default_cache_dir

    def fn(x):
        return (3.0 * x).cos()

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    ours = tmp_path / "robolearn" / "torchinductor"
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", default_cache_dir())
    compiled = compile_if(fn, True)
    assert os.environ["TORCHINDUCTOR_CACHE_DIR"] == str(ours)
    torch.testing.assert_close(compiled(torch.ones(8)), fn(torch.ones(8)))
    assert any(p.is_file() for p in ours.rglob("*")), "inductor wrote nothing into the project's cache"
    monkeypatch.delenv("TORCHINDUCTOR_CACHE_DIR")
    monkeypatch.setenv("XDG_CACHE_HOME", "relative/dir")  # ignored: not an absolute path
    compile_if(fn, True)
    assert os.environ["TORCHINDUCTOR_CACHE_DIR"] == os.path.join(os.path.expanduser("~"), ".cache", "robolearn",
                                                                  "torchinductor")
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "mine"))
    compile_if(fn, True)
    assert os.environ["TORCHINDUCTOR_CACHE_DIR"] == str(tmp_path / "mine")


def test_a_single_environment_advances_its_step_counter_once_per_step(tmp_path):
    """A batch of one steps eagerly (sim/crazyflie/hover.py): compiled by a process with one thread, its
    graph's loop-free blocks ran on every thread of a two-thread process, and the in-place step counter
    could advance twice in one step. Here the one-thread compile and the two-thread steps of that failure,
    with an empty kernel cache so that nothing compiled elsewhere is loaded."""
    code = """if True:
        import torch
        torch.set_num_threads(1)
        from sim.crazyflie.hover import QuadHoverEnv, QuadTaskConfig
        env = QuadHoverEnv(QuadTaskConfig(), 1, seed=0)
        hover = torch.full((1, 4), 2 * env.hover_action - 1)
        env.reset(seed=0)
        env.step(hover)
        torch.set_num_threads(2)
        counts = []
        for _ in range(20):
            env.reset(seed=0)
            env.step(hover)
            counts.append(int(env.t[0]))
        print(counts)
    """
    env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": str(tmp_path / "kernels")}
    res = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr
    assert res.stdout.strip() == str([1] * 20), res.stdout


_SAVED_GRAPH_RUN = """if True:
    import json, sys, torch
    import sim.compiled
    sim.compiled._graph_root = lambda: sys.argv[2]  # the test's directory, beside the kernel cache in use
    from sim.crazyflie.hover import QuadHoverEnv, QuadTaskConfig, RandomizationConfig

    def run(env, fallback=False):
        if fallback:  # torch.compile of the bound methods, as without saved graphs
            env._transition_fn, env._observe_fn = env._transition_fn.fallback, env._observe_fn.fallback
        g = torch.Generator().manual_seed(1)
        obs, _ = env.reset(seed=0)
        out = [obs["critic"]]
        for _ in range(30):  # with resets of a few rows (failures and time-outs: 1 s episodes)
            obs, reward, *_ = env.step(torch.rand(env.num_envs, 4, generator=g) * 2 - 1)
            out += [obs["policy"], obs["critic"], reward[:, None]]
        return torch.cat(out, 1).tolist()

    cfg = QuadTaskConfig(episode_seconds=0.1)
    env = QuadHoverEnv(cfg, 64, seed=0)
    calls = []  # of torch.compile's bound methods: none, every call goes through a saved graph
    for saved in (env._transition_fn, env._observe_fn):
        saved.fallback = lambda *a, f=saved.fallback: calls.append(1) or f(*a)
    result = {"saved": run(env), "graphs": [len(env._transition_fn.graphs), len(env._observe_fn.graphs)],
              "fallback_calls": len(calls)}
    if sys.argv[1] == "save":
        result["traced"] = run(QuadHoverEnv(cfg, 64, seed=0), fallback=True)
    else:  # another latency range has other shapes: the saved guards refuse it (checked, not compiled)
        other = QuadHoverEnv(QuadTaskConfig(randomization=RandomizationConfig(max_latency_steps=2)), 64, seed=0)
        other.reset(seed=0)
        args = (torch.zeros(64, 4), other._observation_noise(), torch.tensor(1.0))
        same = QuadHoverEnv(cfg, 32, seed=1)  # the same structure, another batch size: passes
        same.reset(seed=1)
        with torch.no_grad():
            result["other_passes"] = [g.guard_check(other, *args) for g in env._transition_fn.graphs]
            result["same_passes"] = [g.guard_check(same, args[0][:32], args[1][:32], args[2])
                                     for g in env._transition_fn.graphs]
    print(json.dumps(result))
"""


@pytest.mark.skipif(shutil.which("g++") is None, reason="torch.compile builds CPU kernels with g++")
def test_a_saved_graph_is_loaded_by_a_later_process_with_the_traced_graphs_results(tmp_path):
    """compile_method: a process with ROBOLEARN_SAVE_GRAPHS=1 saves the simulator's graphs (the step's and
    the reset rows' observation); a later one loads them instead of tracing, with results bit-identical
    to the traced graphs'; a damaged file is skipped with a warning, and an environment whose structure
    differs (longer latency: other shapes) is refused by the saved guards, and so compiled as before."""
    from sim.compiled import SAVE_GRAPHS_ENV

    env = {k: v for k, v in os.environ.items() if k != SAVE_GRAPHS_ENV}

    def run(mode: str, **extra) -> dict:
        res = subprocess.run([sys.executable, "-c", _SAVED_GRAPH_RUN, mode, str(tmp_path)], cwd=ROOT,
                             env={**env, **extra}, capture_output=True, text=True, timeout=600)
        assert res.returncode == 0, res.stderr
        return json.loads(res.stdout.splitlines()[-1]), res.stderr

    saving, _ = run("save", **{SAVE_GRAPHS_ENV: "1"})
    assert saving["graphs"][0] == 1 and saving["graphs"][1] >= 1 and saving["fallback_calls"] == 0, saving["graphs"]
    assert saving["saved"] == saving["traced"]
    graph_dirs = list(tmp_path.iterdir())
    assert len(graph_dirs) == 2
    (graph_dirs[0] / "zz-damaged.graph").write_bytes(b"not a graph")

    loading, stderr = run("load")
    assert loading["graphs"] == saving["graphs"] and loading["fallback_calls"] == 0  # the damaged file is not ...
    assert "ignoring the saved compiled graph" in stderr and "zz-damaged.graph" in stderr  # ... and says so
    assert loading["saved"] == saving["traced"]
    assert loading["other_passes"] == [False] and loading["same_passes"] == [True]


class _LockOwner:  # (module-level, as the owners of the tests below: a local class would not pickle at all)
    def __init__(self):
        self.lock, self.x = threading.Lock(), torch.arange(3.0)

    def f(self, y: torch.Tensor) -> torch.Tensor:
        return self.x * y + 1.0


@pytest.mark.skipif(shutil.which("g++") is None, reason="torch.compile builds CPU kernels with g++")
def test_a_graph_that_cannot_be_saved_is_compiled_as_usual_with_a_warning(monkeypatch, tmp_path):
    """Saving describes the owner by pickling it: an owner holding a lock cannot be, and the method then
    runs through torch.compile as without saving, once warned."""
    import warnings

    import sim.compiled
    from sim.compiled import SAVE_GRAPHS_ENV, compile_method

    monkeypatch.setattr(sim.compiled, "_graph_root", lambda: str(tmp_path))
    monkeypatch.setenv(SAVE_GRAPHS_ENV, "1")
    f = compile_method(_LockOwner(), "f", True, dynamic=True)
    with pytest.warns(UserWarning, match=r"could not save the compiled graph of _LockOwner.f \(TypeError: cannot pickle"):
        assert torch.equal(f(torch.full((3,), 2.0)), torch.tensor([1.0, 3.0, 5.0]))
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # not tried again
        assert torch.equal(f(torch.ones(3)), torch.tensor([1.0, 2.0, 3.0]))
    assert f.graphs == [] and not list(tmp_path.rglob("*.graph"))


class _GeneratorHolder:
    def __init__(self):
        self.gen = torch.Generator().manual_seed(0)


class _HolderOwner:
    def __init__(self):
        self.holder, self.x = _GeneratorHolder(), torch.arange(3.0)

    def f(self, y: torch.Tensor) -> torch.Tensor:
        return self.x * y + 1.0


@pytest.mark.skipif(shutil.which("g++") is None, reason="torch.compile builds CPU kernels with g++")
def test_a_saved_graph_that_would_not_load_is_not_kept(monkeypatch, tmp_path):
    """An owner holding, one level down, a torch.Generator (not set aside: its holder holds no saved graph)
    pickles into the guards but does not unpickle: the file is loaded back once when saved, and a file no
    later process could load is deleted, the method compiled as usual with a warning (it used to be kept,
    then refused with a warning by every later process, and saved again by every warm-up)."""
    import sim.compiled
    from sim.compiled import SAVE_GRAPHS_ENV, compile_method

    monkeypatch.setattr(sim.compiled, "_graph_root", lambda: str(tmp_path))
    monkeypatch.setenv(SAVE_GRAPHS_ENV, "1")
    f = compile_method(_HolderOwner(), "f", True, dynamic=True)
    with pytest.warns(UserWarning, match=r"could not save the compiled graph of _HolderOwner.f \(SystemError"):
        assert torch.equal(f(torch.full((3,), 2.0)), torch.tensor([1.0, 3.0, 5.0]))
    assert f.graphs == [] and not list(tmp_path.rglob("*.graph"))


def test_a_saved_graph_whose_traced_source_changed_is_stale():
    """Dynamo keeps the lines and SHA-256 of every function a graph inlined: a graph whose lines no longer
    hash alike (edited since it was saved) is refused by name, whatever the directory's key says."""
    import hashlib
    import inspect

    from sim.compiled import _stale_source
    from sim.crazyflie import dynamics

    lines, first = inspect.getsourcelines(dynamics.rk4_step)
    source = type("Src", (), {"module": dynamics.__name__, "firstlineno": first, "lastlineno": first + len(lines),
                              "checksum": hashlib.sha256("".join(lines).encode()).hexdigest()})

    def graph(*sources):
        return type("Graph", (), {"source_info": lambda self: type("Info", (), {"inlined_sources": set(sources)})()})()

    assert _stale_source(graph(source)) is None
    edited = type("Src", (source,), {"checksum": hashlib.sha256(b"an older rk4_step").hexdigest()})
    assert _stale_source(graph(source, edited)) == (f"sim.crazyflie.dynamics changed since it was traced "
                                                    f"(lines {first}-{first + len(lines)})")


_SAVED_PPO_RUN = """if True:
    import hashlib, json, sys, torch
    import sim.compiled
    sim.compiled._graph_root = lambda: sys.argv[2]  # the test's directory, beside the kernel cache in use
    from policies.ppo import PPO, PPOConfig
    from sim.crazyflie.hover import QuadHoverEnv, QuadTaskConfig

    def run(fallback=False):
        # the main job's sizes, whose kernels install.sh's warm-up has compiled (1 s episodes: some resets)
        env = QuadHoverEnv(QuadTaskConfig(episode_seconds=1.0), 1024, seed=0)
        algo = PPO(PPOConfig(), env, torch.device("cpu"), 0)
        calls = []
        for name in ("_act_fn", "_loss_fn"):
            saved = getattr(algo, name)
            if fallback:  # torch.compile of the bound methods, as without saved graphs
                setattr(algo, name, saved.fallback)
            else:
                saved.fallback = lambda *a, f=saved.fallback: calls.append(1) or f(*a)
        for _ in range(3):
            algo.train_iteration()
        h = hashlib.sha256()
        for p in [*algo.actor.parameters(), *algo.critic.parameters()]:
            h.update(p.detach().numpy().tobytes())
        graphs = [] if fallback else [len(algo._act_fn.graphs), len(algo._loss_fn.graphs)]
        return h.hexdigest(), graphs, len(calls), algo

    fingerprint, graphs, fallback_calls, algo = run()
    result = {"saved": fingerprint, "graphs": graphs, "fallback_calls": fallback_calls}
    if sys.argv[1] == "save":
        result["traced"] = run(fallback=True)[0]
    else:  # what the saved guards refuse: another clip, the critic's warm-up (actor_on 0), another activation
        batch, rows = algo.rollout(), torch.arange(4096)
        m = {k: batch[k].index_select(0, rows) for k in ("obs", "critic", "u", "logp", "adv", "ret")}
        loss, act = algo._loss_fn.graphs[0], algo._act_fn.graphs[0]
        checks = {"same": loss.guard_check(algo, m, m["adv"], m["ret"], 1.0),
                  "actor_on 0": loss.guard_check(algo, m, m["adv"], m["ret"], 0.0)}
        algo.cfg.clip = 0.3
        checks["clip 0.3"] = loss.guard_check(algo, m, m["adv"], m["ret"], 1.0)
        elu = PPO(PPOConfig(activation="elu"), algo.env, torch.device("cpu"), 0)
        obs = algo.obs["policy"], algo.obs["critic"], torch.zeros(1024, 4)
        with torch.no_grad():
            checks["act same"] = act.guard_check(algo, *obs)
            checks["act elu"] = act.guard_check(elu, *obs)
        result["checks"] = checks
    print(json.dumps(result))
"""


@pytest.mark.skipif(shutil.which("g++") is None, reason="torch.compile builds CPU kernels with g++")
def test_ppos_saved_graphs_train_as_the_traced_ones(tmp_path):
    """PPO's rollout step and loss (forward and backward) through compile_method: saved by one process
    (the trainer's environment, which holds saved graphs of its own, is left out of the trace), loaded by
    the next without tracing, and three iterations of training end in bit-identical networks; the saved
    guards refuse another PPO constant, the critic's warm-up and another activation."""
    from sim.compiled import SAVE_GRAPHS_ENV

    env = {k: v for k, v in os.environ.items() if k != SAVE_GRAPHS_ENV}

    def run(mode: str, **extra) -> dict:
        res = subprocess.run([sys.executable, "-c", _SAVED_PPO_RUN, mode, str(tmp_path)], cwd=ROOT,
                             env={**env, **extra}, capture_output=True, text=True, timeout=600)
        assert res.returncode == 0, res.stderr
        assert "could not save" not in res.stderr, res.stderr
        return json.loads(res.stdout.splitlines()[-1])

    saving = run("save", **{SAVE_GRAPHS_ENV: "1"})
    assert saving["graphs"] == [1, 1] and saving["fallback_calls"] == 0 and saving["saved"] == saving["traced"]
    assert {d.name.split("-")[0] for d in tmp_path.iterdir()} >= {"PPO._act", "PPO._loss"}
    loading = run("load")
    checks = loading.pop("checks")
    assert loading == {"saved": saving["traced"], "graphs": [1, 1], "fallback_calls": 0}
    assert checks == {"same": True, "actor_on 0": False, "clip 0.3": False, "act same": True, "act elu": False}
