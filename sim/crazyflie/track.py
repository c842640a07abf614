"""quad_track: follow a figure-eight (lemniscate of Gerono) at a configurable speed.

Same observation, reward, termination and randomization as quad_hover (hover.py); only
the reference moves. The 22-float observation carries position and velocity errors
relative to the moving reference, so the policy contract is unchanged.
"""

from __future__ import annotations

import math

import torch

from .hover import POLICY_PERIOD, QuadHoverEnv


def lemniscate(phase: torch.Tensor, size: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Offset (m) and its derivative w.r.t. phase of the figure-eight in the horizontal plane:
    x = size sin(phase), y = size/2 sin(2 phase), z = 0."""
    z = torch.zeros_like(phase)
    pos = torch.stack((size * torch.sin(phase), 0.5 * size * torch.sin(2 * phase), z), dim=-1)
    dpos = torch.stack((size * torch.cos(phase), size * torch.cos(2 * phase), z), dim=-1)
    return pos, dpos


def lemniscate_second_derivative(phase: torch.Tensor, size: float) -> torch.Tensor:
    """Second derivative w.r.t. phase (m / rad^2) of the figure-eight's offset (``lemniscate``)."""
    z = torch.zeros_like(phase)
    return torch.stack((-size * torch.sin(phase), -2 * size * torch.sin(2 * phase), z), dim=-1)


def phase_rate(size: float, speed: float, samples: int = 4096) -> float:
    """Phase rate (rad/s) that makes the mean speed along the figure-eight ``speed`` m/s."""
    _, d = lemniscate(torch.linspace(0, 2 * math.pi, samples), size)
    length = d.norm(dim=-1).mean().item() * 2 * math.pi  # m per lap
    return 2 * math.pi * speed / length


class QuadTrackEnv(QuadHoverEnv):
    """Tracking variant: the reference starts at a random phase of the figure-eight."""

    def __init__(self, cfg, *args, **kwargs):
        self.omega_ref = phase_rate(cfg.track_size, cfg.track_speed)
        super().__init__(cfg, *args, **kwargs)

    def _phase(self, rows: torch.Tensor | None = None) -> torch.Tensor:
        """Phase (rad) of every env's reference now (of ``rows`` only, if given)."""
        phase, t = (self.phase, self.t) if rows is None else (self.phase[rows], self.t[rows])
        return phase + self.omega_ref * POLICY_PERIOD * t.float()

    def reference(self, rows: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        target = self.target if rows is None else self.target[rows]
        off, doff = lemniscate(self._phase(rows), self.cfg.track_size)
        return target + off, doff * self.omega_ref

    def reference_acceleration(self) -> torch.Tensor:
        """Reference acceleration (world, m/s^2) per env: d^2 offset / d phase^2 times omega^2."""
        return lemniscate_second_derivative(self._phase(), self.cfg.track_size) * self.omega_ref**2
