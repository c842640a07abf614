"""Networks shared by every algorithm: the deployable actor and the privileged critics."""

from __future__ import annotations

import math
from collections.abc import Iterator
from contextlib import contextmanager

import torch
from torch import nn

from .normalizer import RunningNorm

ACTIVATIONS = {"tanh": nn.Tanh, "relu": nn.ReLU, "elu": nn.ELU}


def mlp(sizes: list[int], activation: str = "tanh", layer_norm: bool = False) -> nn.Sequential:
    """Linear layers with ``activation`` between them (after a LayerNorm if ``layer_norm``)."""
    layers: list[nn.Module] = []
    for i in range(len(sizes) - 1):
        layers.append(nn.Linear(sizes[i], sizes[i + 1]))
        if i < len(sizes) - 2:
            if layer_norm:
                layers.append(nn.LayerNorm(sizes[i + 1]))
            layers.append(ACTIVATIONS[activation]())
    return nn.Sequential(*layers)


class Actor(nn.Module):
    """Deployable policy: raw 22-float observation -> normalisation -> MLP -> tanh -> action.

    The stochastic policy is a Gaussian in pre-tanh space, a = tanh(u), u ~ N(mu(obs), std);
    the deterministic (deployed) action is tanh(mu). The output bias starts at the action
    that hovers the nominal vehicle so training starts near hover.
    """

    def __init__(self, obs_dim: int, act_dim: int, hidden: list[int], activation: str, init_action: float,
                 init_log_std: float = -1.0, state_dependent_std: bool = False):
        super().__init__()
        self.spec = dict(obs_dim=obs_dim, act_dim=act_dim, hidden=list(hidden), activation=activation,
                         init_action=init_action, init_log_std=init_log_std, state_dependent_std=state_dependent_std)
        self.obs_norm = RunningNorm(obs_dim)
        self.state_dependent_std = state_dependent_std
        self.net = mlp([obs_dim, *hidden, act_dim * (2 if state_dependent_std else 1)], activation)
        last = self.net[-1]
        nn.init.uniform_(last.weight, -1e-3, 1e-3)
        with torch.no_grad():
            last.bias.zero_()
            last.bias[:act_dim] = math.atanh(init_action)
            if state_dependent_std:
                last.bias[act_dim:] = init_log_std
        self.log_std = nn.Parameter(torch.full((act_dim,), init_log_std), requires_grad=not state_dependent_std)
        self.act_dim = act_dim

    def dist_params(self, obs: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        out = self.net(self.obs_norm(obs))
        if self.state_dependent_std:
            mu, log_std = out.split(self.act_dim, dim=-1)
            return mu, log_std.clamp(-5.0, 2.0)
        return out, self.log_std.expand_as(out)

    def forward(self, obs: torch.Tensor) -> torch.Tensor:
        """Deterministic action in [-1, 1] (what is exported and flown)."""
        return torch.tanh(self.dist_params(obs)[0])


def squashed_log_prob(u: torch.Tensor, mu: torch.Tensor, log_std: torch.Tensor) -> torch.Tensor:
    """log pi(a) for a = tanh(u), u ~ N(mu, exp(log_std)), summed over action dimensions."""
    normal = -0.5 * ((u - mu) / log_std.exp()).square() - log_std - 0.5 * math.log(2 * math.pi)
    # log |d tanh(u)/du| = 2 (log 2 - u - softplus(-2u)), numerically stable
    jac = 2.0 * (math.log(2.0) - u - nn.functional.softplus(-2.0 * u))
    return (normal - jac).sum(-1)


class Critic(nn.Module):
    """Value V(s_priv) or action value Q(s_priv, a) over the privileged critic observation.

    ``ensemble`` > 1 gives that many independent networks (separate weights, as in TD3/SAC's
    clipped double Q: heads on one shared trunk make correlated errors, and their minimum
    barely curbs overestimation); the output is then [N, ensemble], else [N]. ``layer_norm``
    normalises every hidden layer, which keeps off-policy critics from diverging (Ball et al.,
    RLPD, 2023; DSRL's reference configuration turns it on)."""

    def __init__(self, in_dim: int, hidden: list[int], activation: str, ensemble: int = 1, layer_norm: bool = False):
        super().__init__()
        self.obs_norm = RunningNorm(in_dim)
        self.nets = nn.ModuleList(mlp([in_dim, *hidden, 1], activation, layer_norm) for _ in range(ensemble))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.obs_norm(x)
        return torch.cat([net(x) for net in self.nets], dim=-1).squeeze(-1)


@contextmanager
def frozen(net: nn.Module) -> Iterator[None]:
    """Within the block ``net``'s weights need no gradient: an actor's loss through a critic
    reaches the critic's input, and the critic's weight gradients would be computed for nothing."""
    net.requires_grad_(False)
    try:
        yield
    finally:
        net.requires_grad_(True)


@torch.no_grad()
def polyak_update(target: nn.Module, source: nn.Module, tau: float) -> None:
    """target <- (1 - tau) target + tau source, for parameters (buffers: ``share_buffers``)."""
    for p, pt in zip(source.parameters(), target.parameters()):
        pt.lerp_(p, tau)


@torch.no_grad()
def share_buffers(target: nn.Module, source: nn.Module) -> None:
    """Copy the buffers (the input normaliser's statistics) of ``source`` into ``target``: called
    whenever the critic's statistics change, so the target network normalises its input as the
    critic does now, not with the statistics of the collect before (or, at the first update, none)."""
    for b, bt in zip(source.buffers(), target.buffers()):
        bt.copy_(b)
