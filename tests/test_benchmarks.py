"""Benchmark bookkeeping: a rerun puts its measurement on top of its section and keeps what was there;
the manipulation benchmark times training without evaluations and never reuses a run of other settings."""

from __future__ import annotations

import json

import pytest
from omegaconf import OmegaConf

import benchmarks.common as common


def test_write_section_keeps_earlier_results_and_other_sections(tmp_path, monkeypatch):
    md = tmp_path / "BENCHMARKS.md"
    md.write_text("# Benchmarks\n\n## A\n\nold table\n\n### A note by hand\n\nkept\n\n## B\n\nb stays\n")
    monkeypatch.setattr(common, "BENCHMARKS_MD", md)
    asked = []
    monkeypatch.setattr(common, "REVISION_AT_START", "abc1234")
    monkeypatch.setattr(common, "source_revision", lambda **kw: asked.append(kw) or "abc1234")
    common.write_section("A", "python -m benchmarks.a", "new table", threads=1)
    assert asked == [{"short": True, "ignore": ("BENCHMARKS.md",)}]  # the file it writes does not count as a change
    common.write_section("C", "python -m benchmarks.c", "c table", threads=1)
    text = md.read_text()
    a, rest = text.split("## B\n")
    assert a.index("new table") < a.index("Earlier measurements of this section") < a.index("old table")
    assert "### A note by hand\n\nkept" in a and "Command: `python -m benchmarks.a`" in a and "revision abc1234" in a
    assert rest.startswith("\nb stays\n") and rest.rstrip().endswith("c table") and text.count("## A\n") == 1
    monkeypatch.setattr(common, "source_revision", lambda **kw: "def5678")  # a commit made while it ran
    common.write_section("A", "python -m benchmarks.a", "newer table", threads=1)
    assert "revision abc1234 (at the start; def5678 when written)" in md.read_text()


def test_source_revision_marks_changed_files_other_than_those_ignored(monkeypatch):
    from types import SimpleNamespace

    from export import onnx_policy

    full = "abc1234" + "0" * 33
    status = [" M BENCHMARKS.md"]  # porcelain lines: "XY path"

    def git(cmd, **_):  # answers as git does to the options given; an untracked file ("??") is always there
        if cmd[1:-1] == ["rev-parse", "--short"] or cmd[1:] == ["rev-parse", "HEAD"]:
            return SimpleNamespace(stdout=("abc1234" if "--short" in cmd else full) + "\n")
        assert cmd[1:3] == ["status", "--porcelain"], cmd
        untracked = [] if "--untracked-files=no" in cmd else ["?? benchmarks/results/new.png"]
        return SimpleNamespace(stdout="".join(line + "\n" for line in status + untracked))

    monkeypatch.setattr(onnx_policy.subprocess, "run", git)
    assert onnx_policy.source_revision(short=True, ignore=("BENCHMARKS.md",)) == "abc1234"
    assert onnx_policy.source_revision() == full + "+uncommitted"
    status[:] = []
    assert onnx_policy.source_revision() == full  # untracked files (a new result) do not count
    status[:] = [" M BENCHMARKS.md", "M  sim/crazyflie/params.py"]
    assert onnx_policy.source_revision(ignore=("BENCHMARKS.md",)) == full + "+uncommitted"

    def no_git(*_, **__):
        raise OSError("git not found")

    monkeypatch.setattr(onnx_policy.subprocess, "run", no_git)
    assert onnx_policy.source_revision() == "unknown"


def test_manipulation_training_time_leaves_out_every_evaluation():
    from benchmarks.manipulation import training_seconds

    # The training clock is stamped after each iteration: it holds the evaluations at 0 and 5k steps,
    # not the last one, which ran after the last stamp (train 30 s, evaluations 2 + 3 + 4 s).
    res = {"run_dir": "r", "train_seconds": 35.0, "eval_seconds": 9.0,
           "evals": [{"eval_duration_s": 2.0}, {"eval_duration_s": 3.0}, {"eval_duration_s": 4.0}]}
    assert training_seconds(res) == 30.0
    with pytest.raises(SystemExit, match="before evaluations were timed"):
        training_seconds({**res, "evals": [{}, {}]})


def test_manipulation_reuses_a_run_only_if_it_has_the_same_settings(tmp_path):
    from benchmarks.manipulation import cached
    from policies.config import compose_config

    run = tmp_path / "dsrl_na_seed0"
    args = ["task=arm_reach", "algo=dsrl", "algo.variant=na", "seed=0", f"run_dir={run}", "max_env_steps=50000"]
    assert cached(run, args) is None
    run.mkdir()
    OmegaConf.save(compose_config([*args, "progress=false"]), run / "config.yaml")
    (run / "results.json").write_text(json.dumps({"env_steps": 50000}))
    assert cached(run, args) == {"env_steps": 50000}
    saved = OmegaConf.load(run / "config.yaml")
    del saved["log_every_seconds"]  # a run from before that key: only what is printed differs
    OmegaConf.save(saved, run / "config.yaml")
    assert cached(run, args) == {"env_steps": 50000}
    with pytest.raises(SystemExit, match=r"other settings \(algo.variant, max_env_steps\)"):
        cached(run, [*args[:2], "algo.variant=sac", *args[3:-1], "max_env_steps=150000"])


def test_manipulation_reuses_a_dataset_only_of_the_same_task_settings(tmp_path, monkeypatch):
    """A dataset under --work is read only if it was collected with the benchmark's counts and today's
    task settings (e.g. an older time limit refuses it), before any base is trained on it."""
    from types import SimpleNamespace

    import benchmarks.manipulation as manipulation
    from benchmarks.manipulation import base_policy
    from policies.config import compose_config

    a = SimpleNamespace(demos=50, noise=0.3, worse_share=0.0, bc_steps=10, chunk=None, episodes=1, threads=1)
    task = OmegaConf.to_container(compose_config(["task=arm_push"]).task, resolve=True)
    data = tmp_path / "data"
    data.mkdir()
    meta = {"episodes": 50, "expert_noise": 0.3, "task_config": {**task, "episode_steps": task["episode_steps"] - 60}}
    (data / "meta.json").write_text(json.dumps(meta))
    with pytest.raises(SystemExit, match=r"other task settings \(episode_steps\)"):
        base_policy("arm_push", tmp_path, a)
    (data / "meta.json").write_text(json.dumps({**meta, "episodes": 30}))
    with pytest.raises(SystemExit, match="holds 30 demonstrations at noise 0.3"):
        base_policy("arm_push", tmp_path, a)
    mixed = {**meta, "task_config": {**task, "expert_worse_share": 0.5}}  # demonstrations of --worse-share 0.5
    (data / "meta.json").write_text(json.dumps(mixed))
    with pytest.raises(SystemExit, match=r"other task settings \(expert_worse_share\)"):
        base_policy("arm_push", tmp_path, a)
    # ... which a --worse-share 0.5 run reads (its base a cached run here), and today's unmixed one it refuses
    monkeypatch.setattr(manipulation, "cached", lambda run, args: {"env_steps": 1})
    assert base_policy("arm_push", tmp_path, SimpleNamespace(**{**vars(a), "worse_share": 0.5}))[1] == mixed
    (data / "meta.json").write_text(json.dumps({**meta, "task_config": task}))
    with pytest.raises(SystemExit, match=r"other task settings \(expert_worse_share\)"):
        base_policy("arm_push", tmp_path, SimpleNamespace(**{**vars(a), "worse_share": 0.5}))


def test_every_manipulation_method_composes_a_valid_config(tmp_path):
    """Each method's overrides are valid policies.train settings; the demonstrations' methods point
    algo.demos at the task's dataset under --work; SAC from scratch makes one update per DSRL decision
    of the base's chunk and discounts as DSRL does per decision (0.99)."""
    from benchmarks.manipulation import METHODS, method_overrides
    from policies.config import compose_config

    for m in METHODS:
        cfg = compose_config(["task=arm_push", *method_overrides(m, tmp_path / "data", None)])
        assert cfg.algo.get("demos", "") == (str(tmp_path / "data") if m.endswith("_demos") else ""), m
    for chunk, updates, gamma in ((None, 2, 0.9975), (4, 2, 0.9975), (8, 1, 0.9987)):
        cfg = compose_config(["task=arm_push", *method_overrides("sac_matched", tmp_path, chunk)])
        assert (cfg.algo.num_envs, cfg.algo.updates_per_iteration, cfg.algo.gamma) == (8, updates, gamma)
        assert abs(cfg.algo.gamma ** (8 / updates) - 0.99) < 1e-3  # per decision of 8 / updates env steps
    with pytest.raises(SystemExit, match="--chunk 3 does not divide 8"):
        method_overrides("sac_matched", tmp_path, 3)


def test_manipulation_never_reads_a_dsrl_run_of_another_base(tmp_path):
    """A cached DSRL run is read only if it steered the base now at its algo.base (by weights digest)."""
    import torch

    from benchmarks.manipulation import check_steered_base

    run = tmp_path / "dsrl_na_seed0"
    (run / "checkpoints").mkdir(parents=True)
    torch.save({"algo": {"base_digest": "b3cf56c869bb75f2"}}, run / "checkpoints" / "last.pt")
    check_steered_base(run, "b3cf56c869bb75f2")
    with pytest.raises(SystemExit, match="steered another base"):
        check_steered_base(run, "0123456789abcdef")


def test_manipulation_base_chunk(tmp_path):
    """--chunk H trains the base to predict and execute H actions per query; without it the base has
    diffusion_bc's defaults, and a cached base of the other kind is not reused."""
    from argparse import Namespace

    from benchmarks.manipulation import base_args, cached
    from policies.config import compose_config

    a = Namespace(chunk=8, bc_steps=10, episodes=2, threads=1)
    run = tmp_path / "base"
    eight = base_args("arm_pick_place", tmp_path / "data", run, a)
    cfg = compose_config(eight)
    assert (cfg.algo.pred_horizon, cfg.algo.exec_horizon) == (8, 8)
    default = base_args("arm_pick_place", tmp_path / "data", run, Namespace(**{**vars(a), "chunk": None}))
    cfg = compose_config(default)
    assert (cfg.algo.pred_horizon, cfg.algo.exec_horizon) == (4, 4)
    run.mkdir()
    OmegaConf.save(compose_config([*eight, "progress=false"]), run / "config.yaml")
    (run / "results.json").write_text("{}")
    with pytest.raises(SystemExit, match=r"other settings \(algo.exec_horizon, algo.pred_horizon\)"):
        cached(run, default)


def test_manipulation_plot_never_replaces_an_earlier_one(tmp_path):
    """A second run on the same day writes its plot beside the first, which an earlier section shows."""
    from benchmarks.manipulation import new_path

    first = tmp_path / "arm_reach_success_20261127.png"
    assert new_path(first) == first
    first.write_bytes(b"png")
    assert new_path(first) == tmp_path / "arm_reach_success_20261127_2.png"
    (tmp_path / "arm_reach_success_20261127_2.png").write_bytes(b"png")
    assert new_path(first) == tmp_path / "arm_reach_success_20261127_3.png"


def test_noise_chooser_refuses_too_few_episodes_to_hold_a_tenth_out(tmp_path):
    """With fewer than 10 episodes none is held out and every held-out rank was nan, printed as a result."""
    import subprocess
    import sys
    from pathlib import Path

    r = subprocess.run([sys.executable, "-m", "benchmarks.noise_chooser", str(tmp_path), "--envs", "4"],
                       cwd=Path(__file__).resolve().parents[1], capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and "error: --envs 4: expected at least 10" in r.stderr, r.stderr
