"""Task registry: task name -> (environment class, default config)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from sim.crazyflie.hover import QuadHoverEnv, QuadTaskConfig
from sim.crazyflie.track import QuadTrackEnv


@dataclass(frozen=True)
class TaskSpec:
    env_cls: type
    default_config: Callable[[], object]


TASKS: dict[str, TaskSpec] = {
    "quad_hover": TaskSpec(QuadHoverEnv, lambda: QuadTaskConfig(name="quad_hover")),
    "quad_track": TaskSpec(QuadTrackEnv, lambda: QuadTaskConfig(name="quad_track", episode_seconds=10.0)),
}


class UnknownTaskError(ValueError):
    pass


def get_task(name: str) -> TaskSpec:
    if name not in TASKS:
        raise UnknownTaskError(f"unknown task '{name}'. Valid tasks: {', '.join(sorted(TASKS))}")
    return TASKS[name]
