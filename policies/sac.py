"""Soft actor-critic with automatic temperature and an asymmetric critic: the actor sees the
22-float policy observation, the twin Q-functions see the privileged critic observation
and the action. Many environments step in parallel; each iteration adds one transition per
environment and takes ``updates_per_iteration`` gradient steps. A time-out is bootstrapped
through (its next state's value) unless the task says it ends the return
(``env.time_out_ends_return``, where the critic observes the episode's clock).
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field

import torch

from .networks import Actor, Critic, frozen, polyak_update, share_buffers, squashed_log_prob
from .replay import ReplayBuffer


@dataclass
class SACConfig:
    name: str = "sac"
    num_envs: int = 64
    buffer_size: int = 1_000_000
    batch_size: int = 1024
    updates_per_iteration: int = 4  # gradient steps per parallel env step (UTD = this / num_envs)
    warmup_steps: int = 10_000  # env steps with the initial (near-hover) policy before updating
    gamma: float = 0.99
    tau: float = 0.005  # target network Polyak rate
    actor_lr: float = 1e-3
    critic_lr: float = 1e-3
    alpha_lr: float = 1e-3
    init_alpha: float = 0.1
    target_entropy_per_dim: float = -1.0
    actor_hidden: list[int] = field(default_factory=lambda: [32, 32])
    critic_hidden: list[int] = field(default_factory=lambda: [128, 128])
    critic_layer_norm: bool = False  # LayerNorm in the critics' hidden layers
    activation: str = "relu"


class SAC:
    def __init__(self, cfg: SACConfig, env, device: torch.device, seed: int):
        self.cfg, self.env, self.device = cfg, env, device
        self.iteration_steps, self.iteration_size = env.num_envs, "algo.num_envs"  # env steps of one train_iteration
        torch.manual_seed(seed)
        obs_dim = env.single_observation_space["policy"].shape[0]
        critic_dim = env.single_observation_space["critic"].shape[0]
        self.act_dim = act_dim = env.single_action_space.shape[0]
        self.actor = Actor(obs_dim, act_dim, cfg.actor_hidden, "tanh", env.nominal_action, -1.0,
                           state_dependent_std=True).to(device)
        self.q = Critic(critic_dim + act_dim, cfg.critic_hidden, cfg.activation, ensemble=2,
                        layer_norm=cfg.critic_layer_norm).to(device)
        self.q_target = copy.deepcopy(self.q)
        self.log_alpha = torch.tensor(float(torch.tensor(cfg.init_alpha).log()), device=device, requires_grad=True)
        # fused: one kernel for every parameter's update instead of a dozen small ops per tensor
        self.actor_opt = torch.optim.Adam(self.actor.parameters(), lr=cfg.actor_lr, fused=True)
        self.q_opt = torch.optim.Adam(self.q.parameters(), lr=cfg.critic_lr, fused=True)
        self.alpha_opt = torch.optim.Adam([self.log_alpha], lr=cfg.alpha_lr)
        self.buffer = ReplayBuffer(cfg.buffer_size, {"obs": (obs_dim,), "critic": (critic_dim,), "action": (act_dim,),
                                                     "reward": (), "next_obs": (obs_dim,), "next_critic": (critic_dim,),
                                                     "done": ()}, device)
        self.gen = torch.Generator(device=device)
        self.gen.manual_seed(seed + 1)
        self.obs, _ = env.reset(seed=seed)

    def _sample(self, obs: torch.Tensor, eps: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """A squashed Gaussian action and its log-probability; ``eps`` ~ N(0, I) (drawn if not given)."""
        mu, log_std = self.actor.dist_params(obs)
        if eps is None:
            eps = torch.randn(mu.shape, generator=self.gen, device=self.device)
        u = mu + log_std.exp() * eps
        logp = squashed_log_prob(u, mu, log_std)
        return torch.tanh(u), logp

    def _q(self, net, critic_obs, action) -> torch.Tensor:
        return net(torch.cat((critic_obs, action), dim=-1))  # [B, 2]

    @torch.no_grad()
    def collect(self) -> torch.Tensor:
        obs = self.obs
        self.actor.obs_norm.update(obs["policy"])
        action, _ = self._sample(obs["policy"])
        self.q.obs_norm.update(torch.cat((obs["critic"], action), -1))  # the critic's input: state and action
        share_buffers(self.q_target, self.q)  # the TD target normalises as the critic does
        self.obs, reward, term, trunc, info = self.env.step(action)
        nxt = {k: self.obs[k] for k in ("policy", "critic")}  # the learned ones (not a camera's images)
        if "final_obs" in info:  # same-step autoreset: learn from the observation that ended the episode
            m = info["_final_obs"][:, None]
            nxt = {k: torch.where(m, info["final_obs"][k], v) for k, v in nxt.items()}
        keep = ~info["nonfinite"] if "nonfinite" in info else torch.ones_like(term)
        done = term | trunc if self.env.time_out_ends_return else term
        self.buffer.add(obs=obs["policy"][keep], critic=obs["critic"][keep], action=action[keep], reward=reward[keep],
                        next_obs=nxt["policy"][keep], next_critic=nxt["critic"][keep], done=done[keep].float())
        return reward

    def _critic_loss(self, b: dict[str, torch.Tensor], alpha: torch.Tensor, eps: torch.Tensor) -> torch.Tensor:
        """Twin-Q regression to the soft TD target; ``eps`` ~ N(0, I) samples the next action."""
        with torch.no_grad():
            a2, logp2 = self._sample(b["next_obs"], eps)
            q_next = self._q(self.q_target, b["next_critic"], a2).min(-1).values - alpha * logp2
            target = b["reward"] + self.cfg.gamma * (1 - b["done"]) * q_next
        return (self._q(self.q, b["critic"], b["action"]) - target[:, None]).square().mean()

    def update(self) -> dict[str, float]:
        c = self.cfg
        b = self.buffer.sample(c.batch_size, self.gen)
        alpha = self.log_alpha.exp().detach()
        eps_next, eps = torch.randn((2, c.batch_size, self.act_dim), generator=self.gen, device=self.device)
        q_loss = self._critic_loss(b, alpha, eps_next)
        self.q_opt.zero_grad(set_to_none=True)
        q_loss.backward()
        self.q_opt.step()

        a, logp = self._sample(b["obs"], eps)
        with frozen(self.q):
            actor_loss = (alpha * logp - self._q(self.q, b["critic"], a).min(-1).values).mean()
            self.actor_opt.zero_grad(set_to_none=True)
            actor_loss.backward()
        self.actor_opt.step()

        alpha_loss = -(self.log_alpha * (logp.detach() + c.target_entropy_per_dim * self.act_dim)).mean()
        self.alpha_opt.zero_grad(set_to_none=True)
        alpha_loss.backward()
        self.alpha_opt.step()

        polyak_update(self.q_target, self.q, c.tau)
        return {"q_loss": q_loss.item(), "actor_loss": actor_loss.item(), "alpha": alpha.item()}

    def train_iteration(self) -> dict[str, float]:
        reward = self.collect()
        metrics = {"reward": reward.mean().item()}
        if self.env.total_steps >= self.cfg.warmup_steps:
            for _ in range(self.cfg.updates_per_iteration):
                metrics.update(self.update())
        return metrics

    def state_dict(self) -> dict:
        return {
            "actor": self.actor.state_dict(), "q": self.q.state_dict(), "q_target": self.q_target.state_dict(),
            "log_alpha": self.log_alpha.detach().clone(), "actor_opt": self.actor_opt.state_dict(),
            "q_opt": self.q_opt.state_dict(), "alpha_opt": self.alpha_opt.state_dict(),
            "buffer": self.buffer.state_dict(), "gen": self.gen.get_state(), "obs": self.obs,
        }

    def load_state_dict(self, d: dict) -> None:
        self.actor.load_state_dict(d["actor"])
        self.q.load_state_dict(d["q"])
        self.q_target.load_state_dict(d["q_target"])
        with torch.no_grad():
            self.log_alpha.copy_(d["log_alpha"])
        self.actor_opt.load_state_dict(d["actor_opt"])
        self.q_opt.load_state_dict(d["q_opt"])
        self.alpha_opt.load_state_dict(d["alpha_opt"])
        self.buffer.load_state_dict(d["buffer"])
        self.gen.set_state(d["gen"])
        self.obs = d["obs"]
