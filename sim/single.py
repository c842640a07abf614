"""Single-environment Gymnasium view of a batched task (NumPy in, NumPy out), for tools and
checkers that expect ``gymnasium.Env``. Training uses the batched environment directly."""

from __future__ import annotations

import gymnasium as gym
import numpy as np
import torch

from sim.registry import get_task


class SingleEnv(gym.Env):
    metadata = {"render_modes": []}

    def __init__(self, task: str = "quad_hover", cfg=None, backend: str | None = None, seed: int = 0):
        spec = get_task(task)
        kwargs = {} if backend is None else {"backend": backend}  # None: the task's default backend
        self.vec = spec.env_cls(cfg or spec.default_config(), 1, seed=seed, **kwargs)
        self.observation_space = self.vec.single_observation_space
        self.action_space = self.vec.single_action_space

    @staticmethod
    def _np(obs: dict[str, torch.Tensor]) -> dict[str, np.ndarray]:
        # Floating-point entries as float32; others (uint8 RGB images) keep their dtype.
        return {k: v[0].cpu().numpy().astype(np.float32) if v.is_floating_point() else v[0].cpu().numpy()
                for k, v in obs.items()}

    def reset(self, *, seed: int | None = None, options: dict | None = None):
        super().reset(seed=seed)
        obs, _ = self.vec.reset(seed=seed)
        return self._np(obs), {}

    def step(self, action):
        a = torch.as_tensor(np.asarray(action, dtype=np.float32)).reshape(1, -1)
        obs, r, term, trunc, info = self.vec.step(a)
        # The vector env has already reset a finished episode; report the final observation.
        if term[0] or trunc[0]:
            obs = info["final_obs"]
        return self._np(obs), float(r[0]), bool(term[0]), bool(trunc[0]), {}
