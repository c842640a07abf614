"""Hover evaluation: the measures it reports describe the flight they summarise."""

from pathlib import Path

import numpy as np
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


def test_simulators_evaluated_at_once_give_the_sequential_results():
    """MuJoCo and PyBullet evaluate in forked processes while torch runs here: every episode's
    outcome and error trace equals the one of a run in this process."""
    policy, rec = ckpt.load_policy(PRETRAINED)
    task_cfg, _ = to_objects(OmegaConf.create(rec["config"]))
    seeds = {"torch": 3, "mujoco": 4, "pybullet": 5}
    together = evaluate_backends(policy, task_cfg, 12, seeds)
    assert list(together) == list(seeds)
    for backend, seed in seeds.items():
        alone = evaluate_hover(policy, task_cfg, 12, backend, seed)
        assert together[backend].backend == backend
        assert (together[backend].success == alone.success).all()
        assert np.array_equal(together[backend].position_error, alone.position_error, equal_nan=True), backend
