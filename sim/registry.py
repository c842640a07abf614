"""Task registry: task name -> environment class, default config, evaluation criterion and the
run defaults (budget, evaluation interval, early stop) that ``policies.train`` uses for it."""

from __future__ import annotations

import importlib
from dataclasses import dataclass, field

from sim.crazyflie.hover import BACKENDS as QUAD_BACKENDS


# Quadrotor: the hover criterion decides; PPO passes it after ~2.5M steps (1024 envs, BENCHMARKS.md).
# An evaluation (100 episodes of 5 s) costs ~0.25 s in torch, under a tenth of the training between two.
# Evaluating every 250k steps (with an older recipe that needed 4-7M steps) stopped seeds 0-2 sooner
# but on policies that scored 90-94 % in policies.eval for two of them: PPO's success swings between
# evaluations, and the more often it is sampled the likelier the first pass is a marginal policy. A
# pass is confirmed in all three simulators (the criterion's own demand; a torch-only confirmation let
# a policy stop that scored 90 % in PyBullet), only when the replayed evaluation passes: ~0.25 s in
# torch, then MuJoCo (~2.1 s) and PyBullet (~2.7 s) at once, ~3.0 s in all (ad-hoc timing, 2 cores).
HOVER_SUCCESS_RATE = 0.95  # the hover criterion's required rate in each simulator (policies/evaluate.py)
QUAD_RUN = {"max_env_steps": 200_000_000, "eval_every_steps": 500_000, "stop_at_success": HOVER_SUCCESS_RATE,
            "confirm_backends": list(QUAD_BACKENDS)}
# Manipulation (MuJoCo, ~1-2k env steps/s): 50k steps, evaluate every 5k, never stop early.
ARM_RUN = {"max_env_steps": 50_000, "eval_every_steps": 5_000, "stop_at_success": 0.0, "confirm_backends": ["mujoco"]}


def _load(path: str):
    """The object at ``"package.module:name"``, its module imported on first use."""
    module, _, name = path.partition(":")
    return getattr(importlib.import_module(module), name)


@dataclass(frozen=True)
class TaskSpec:
    """A task, with its code named by where it lives: a task's modules are imported when it is used,
    so that a quadrotor run does not load the arm tasks and MuJoCo (~0.15 s of each start)."""

    env_path: str  # "module:class" of the vector environment
    config_path: str  # "module:callable" that makes the default config (with config_kwargs)
    config_kwargs: dict = field(default_factory=dict)
    criterion: str = "hover"  # policies/evaluate.py: "hover" (quadrotor) or "success" (task success rate)
    run_defaults: dict = field(default_factory=lambda: dict(QUAD_RUN))
    contract_path: str = "sim.crazyflie.contract:CONTRACT"  # the exported policy's observation/action contract
    backends: tuple[str, ...] = QUAD_BACKENDS  # simulators the task runs in (evaluation, confirmation)

    @property
    def env_cls(self) -> type:
        return _load(self.env_path)

    def default_config(self):
        return _load(self.config_path)(**self.config_kwargs)

    @property
    def config_cls(self) -> type:
        return type(self.default_config())

    @property
    def contract(self):
        return _load(self.contract_path)

    @property
    def has_expert(self) -> bool:
        """Whether the task's environment has a scripted expert (``expert_action``) to demonstrate it."""
        return hasattr(self.env_cls, "expert_action")


def _arm(module: str, env: str) -> TaskSpec:
    return TaskSpec(f"sim.arm.{module}:{env}", f"sim.arm.{module}:default_config", criterion="success",
                    run_defaults=dict(ARM_RUN), contract_path="sim.arm.contract:CONTRACT", backends=("mujoco",))


TASKS: dict[str, TaskSpec] = {
    "quad_hover": TaskSpec("sim.crazyflie.hover:QuadHoverEnv", "sim.crazyflie.hover:QuadTaskConfig",
                           {"name": "quad_hover"}),
    "quad_track": TaskSpec("sim.crazyflie.track:QuadTrackEnv", "sim.crazyflie.hover:QuadTaskConfig",
                           {"name": "quad_track", "episode_seconds": 10.0}),
    "arm_reach": _arm("reach", "ArmReachEnv"),
    "arm_push": _arm("push", "ArmPushEnv"),
    "arm_pick_place": _arm("pick_place", "ArmPickPlaceEnv"),
}


class UnknownTaskError(ValueError):
    pass


def get_task(name: str) -> TaskSpec:
    if name not in TASKS:
        raise UnknownTaskError(f"unknown task '{name}'. Valid tasks: {', '.join(sorted(TASKS))}")
    return TASKS[name]


def require_expert(name: str, why: str) -> None:
    """ValueError unless task ``name`` has a scripted expert; the message says ``why`` one is needed and
    names the tasks that have one."""
    if not get_task(name).has_expert:
        experts = ", ".join(sorted(t for t, spec in TASKS.items() if spec.has_expert))
        raise ValueError(f"{why}, which task {name} has none of (the tasks with one: {experts})")
