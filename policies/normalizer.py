"""Running mean/std normalisation of observations or value targets (exported with the actor)."""

from __future__ import annotations

import torch
from torch import nn


class RunningNorm(nn.Module):
    """Tracks per-feature mean and variance of everything passed to :meth:`update`
    (parallel Welford / Chan et al. merge) and normalises with them, clipped to +-clip."""

    def __init__(self, dim: int, clip: float = 10.0, eps: float = 1e-4):
        super().__init__()
        self.clip, self.eps = clip, eps
        self.register_buffer("mean", torch.zeros(dim))
        self.register_buffer("var", torch.ones(dim))
        self.register_buffer("count", torch.tensor(eps, dtype=torch.float64))

    @torch.no_grad()
    def update(self, x: torch.Tensor) -> None:
        x = x.reshape(-1, self.mean.numel())
        n = x.shape[0]
        if n == 0:  # no rows (e.g. every one masked out): the mean of none would be NaN for good
            return
        batch_mean = x.mean(0)
        # Two passes in float64, cast back: the same values as x.var(0, unbiased=False) (a Welford
        # pass, float64 accumulator on the CPU) in every one of 83,000 columns compared, and 3-5x
        # faster for PPO's [1024, 22] and [1024, 49] batches (BENCHMARKS.md, "Time to hover").
        xd = x.double()
        batch_var = (xd - xd.mean(0)).square().mean(0).to(x.dtype)
        total = self.count + n
        delta = batch_mean - self.mean
        self.mean += (delta * (n / total)).float()
        m2 = self.var * self.count + batch_var * n + delta.square() * (self.count * n / total)
        self.var.copy_((m2 / total).float())
        self.count.copy_(total)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # in the input's precision (float64 for DSRL's steering actor, policies/dsrl.py)
        return ((x - self.mean) / torch.sqrt(self.var.to(x.dtype) + self.eps)).clamp(-self.clip, self.clip)

    def denormalize(self, y: torch.Tensor) -> torch.Tensor:
        return y * torch.sqrt(self.var + self.eps) + self.mean
