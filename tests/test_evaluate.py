"""Hover evaluation: the measures it reports describe the flight they summarise."""

import os
from pathlib import Path

import numpy as np
import pytest
import torch
from omegaconf import OmegaConf

from policies import checkpoint as ckpt
from policies.config import to_objects
from policies.evaluate import evaluate_backends, evaluate_hover

PRETRAINED = Path(__file__).resolve().parents[1] / "policies/pretrained/quad_hover"


def test_common_offset_is_where_the_policy_holds_the_vehicle():
    """Feeding the shipped policy a position error 4 cm too large in x moves its equilibrium 4 cm
    to -x for every vehicle: the common offset shows exactly that shift, the other axes stay."""
    policy, rec = ckpt.load_policy(PRETRAINED)
    task_cfg, _ = to_objects(OmegaConf.create(rec["config"]))
    shift = torch.tensor([0.04] + [0.0] * 21)
    base = evaluate_hover(policy, task_cfg, episodes=50)
    held = evaluate_hover(lambda obs: policy(obs + shift), task_cfg, episodes=50)
    assert max(abs(v) for v in base.common_offset) < 0.02, base.common_offset
    assert abs(held.common_offset[0] - base.common_offset[0] + 0.04) < 0.01, (base.common_offset, held.common_offset)
    for axis in (1, 2):
        assert abs(held.common_offset[axis] - base.common_offset[axis]) < 0.01, (base.common_offset, held.common_offset)
    assert "common offset (x, y, z)" in held.summary() and "common_offset_x_m" in held.as_dict()


def test_an_episode_that_leaves_the_ball_counts_as_failed_from_then_on():
    """Full thrust on every rotor climbs out of the 1 m ball within ~1 s: every episode fails, and
    its position error is finite (within 1 m) up to the step it left and NaN from that step on."""
    policy, rec = ckpt.load_policy(PRETRAINED)
    task_cfg, _ = to_objects(OmegaConf.create(rec["config"]))
    res = evaluate_hover(lambda obs: torch.ones(len(obs), 4), task_cfg, episodes=20)
    assert res.failures == 20 and res.success_rate == 0.0 and not res.success.any()
    err = res.position_error  # [T, episodes]
    for k in range(20):
        gone = np.isnan(err[:, k])
        first = int(np.argmax(gone))
        assert gone[first:].all() and not gone[:first].any() and 0 < first < 150, (k, first)
        assert err[first - 1, k] <= 1.0
    assert np.isnan(res.mean_final_error) and np.isnan(res.common_offset).all()


def test_simulators_evaluated_at_once_give_the_sequential_results(tmp_path, monkeypatch):
    """MuJoCo and PyBullet evaluate in two forked processes while torch runs here: every episode's
    outcome and error trace equals the one of a run in this process."""
    import policies.evaluate as evaluation

    policy, rec = ckpt.load_policy(PRETRAINED)
    task_cfg, _ = to_objects(OmegaConf.create(rec["config"]))
    real, log = evaluation.evaluate, tmp_path / "pids.log"

    def evaluate(*args, backend=None, **kwargs):
        with log.open("a") as f:
            f.write(f"{backend} {os.getpid()}\n")
        return real(*args, backend=backend, **kwargs)

    monkeypatch.setattr(evaluation, "evaluate", evaluate)
    seeds = {"torch": 3, "mujoco": 4, "pybullet": 5}
    together = evaluate_backends(policy, task_cfg, 12, seeds)
    pids = dict(line.split() for line in log.read_text().splitlines())
    assert int(pids["torch"]) == os.getpid() and len({pids["mujoco"], pids["pybullet"], pids["torch"]}) == 3
    assert list(together) == list(seeds)
    for backend, seed in seeds.items():
        alone = evaluate_hover(policy, task_cfg, 12, backend, seed)
        assert together[backend].backend == backend
        assert (together[backend].success == alone.success).all()
        assert np.array_equal(together[backend].position_error, alone.position_error, equal_nan=True), backend


@pytest.mark.parametrize("rates, kept", [
    ({"torch": 0.99, "pybullet": 0.50, "mujoco": 0.99}, ["torch", "pybullet"]),
    ({"torch": 0.99, "pybullet": 0.99, "mujoco": 0.50}, ["torch", "pybullet", "mujoco"]),
    ({"torch": 0.50, "pybullet": 0.99, "mujoco": 0.99}, ["torch"]),
])
def test_simulators_evaluated_at_once_stop_where_a_sequential_run_would(monkeypatch, rates, kept):
    """Scripted success rates, bar 0.95: the result holds torch first, then the simulators in the
    order asked, up to the first that falls short, whichever process finishes first."""
    import dataclasses

    import policies.evaluate as evaluation

    policy, rec = ckpt.load_policy(PRETRAINED)
    task_cfg, _ = to_objects(OmegaConf.create(rec["config"]))
    real = evaluation.evaluate
    monkeypatch.setattr(evaluation, "evaluate", lambda *a, backend=None, **k: dataclasses.replace(
        real(*a, backend=backend, **k), success_rate=rates[backend]))
    res = evaluate_backends(policy, task_cfg, 4, {"pybullet": 1, "torch": 2, "mujoco": 3}, stop_below=0.95)
    assert list(res) == kept
    assert [r.success_rate for r in res.values()] == [rates[b] for b in kept]
