"""PPO with an asymmetric actor-critic: the actor sees the 22-float policy observation,
the critic also sees the privileged simulator state.

One iteration = ``horizon`` steps of every environment, then ``epochs`` passes of clipped
PPO over ``minibatches`` shuffled minibatches. Time-limit truncations are bootstrapped with
the critic's value of the final observation, unless the task says a time-out ends the return
(``env.time_out_ends_return``); non-finite transitions are masked out.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from sim.compiled import compile_method

from .networks import Actor, Critic, squashed_log_prob
from .normalizer import RunningNorm


@dataclass
class PPOConfig:
    name: str = "ppo"
    # Parallel environments. quad_hover on 2 CPU cores, seeds 0-2, time to the first (unconfirmed)
    # pass with an earlier reward (the default now passes at ~2.5M steps): 1024 envs 28-34 s at
    # 3.5-4.5M steps; 2048 60-92 s at 9.5-14M; 512 40-71 s at 3.5-9.5M (more PPO iterations per
    # sample pay until the simulator's per-step overhead dominates).
    num_envs: int = 1024
    horizon: int = 16  # steps per environment per iteration
    epochs: int = 4  # optimisation passes over each batch
    minibatches: int = 4
    gamma: float = 0.99
    gae_lambda: float = 0.95
    clip: float = 0.2  # policy ratio clip
    lr: float = 1e-3
    desired_kl: float = 0.01  # adaptive learning rate target (0 disables)
    max_lr: float = 1e-2  # ceiling of the adaptive learning rate
    entropy_coef: float = 0.005  # keeps exploring long enough to learn yaw and precise position
    value_coef: float = 1.0
    max_grad_norm: float = 1.0
    critic_warmup_iterations: int = 0  # iterations that fit only the value function before the actor moves
    init_log_std: float = -2.0  # initial exploration std exp(-2) ~ 0.14 in pre-tanh units
    actor_hidden: list[int] = field(default_factory=lambda: [32, 32])
    critic_hidden: list[int] = field(default_factory=lambda: [64, 64])
    activation: str = "tanh"
    # Compile the minibatch loss (forward and backward) and the rollout's network step with
    # torch.compile: ~10-30 % faster updates on a CPU, ~9 % faster rollouts (1024 envs: 49.8 -> 45.3 ms
    # per iteration); the first run on a machine compiles for ~15 s, cached on disk after.
    compile: bool = True


class PPO:
    def __init__(self, cfg: PPOConfig, env, device: torch.device, seed: int):
        self.cfg, self.env, self.device = cfg, env, device
        # env steps of one train_iteration (the trainer refuses a smaller budget), and what sets them
        self.iteration_steps, self.iteration_size = env.num_envs * cfg.horizon, "algo.num_envs x algo.horizon"
        if cfg.minibatches > self.iteration_steps:  # empty minibatches: NaN losses, nothing learnt
            raise ValueError(f"minibatches {cfg.minibatches}: more than the num_envs x horizon = "
                             f"{self.iteration_steps} transitions of an iteration")
        if self.iteration_steps < 2:  # the advantages' standard deviation needs two
            raise ValueError("num_envs x horizon = 1: an iteration needs at least 2 transitions")
        torch.manual_seed(seed)
        obs_dim = env.single_observation_space["policy"].shape[0]
        critic_dim = env.single_observation_space["critic"].shape[0]
        act_dim = env.single_action_space.shape[0]
        self.actor = Actor(obs_dim, act_dim, cfg.actor_hidden, cfg.activation, env.nominal_action, cfg.init_log_std).to(device)
        self.critic = Critic(critic_dim, cfg.critic_hidden, cfg.activation).to(device)
        self.value_norm = RunningNorm(1).to(device)
        # fused: one kernel for every parameter's update instead of a dozen small ops per tensor
        self.opt = torch.optim.Adam([*self.actor.parameters(), *self.critic.parameters()], lr=cfg.lr, fused=True)
        # (graphs saved by install.sh's warm-up run are loaded instead of tracing: sim.compiled.compile_method)
        self._loss_fn = compile_method(self, "_loss", cfg.compile, device=device)
        self._act_fn = compile_method(self, "_act", cfg.compile, device=device)
        self.lr = cfg.lr
        self.gen = torch.Generator(device=device)
        self.gen.manual_seed(seed + 1)
        self.obs, _ = env.reset(seed=seed)
        self.iteration = 0

    def value(self, critic_obs: torch.Tensor) -> torch.Tensor:
        return self.value_norm.denormalize(self.critic(critic_obs)[:, None])[:, 0]

    @torch.no_grad()
    def rollout(self) -> dict[str, torch.Tensor]:
        c, env = self.cfg, self.env
        T, N = c.horizon, env.num_envs
        buf = {k: [] for k in ("obs", "critic", "u", "logp", "value", "reward", "done", "valid")}
        episode_returns, episode_lengths, env_rewards = [], [], []
        for _ in range(T):
            obs, critic_obs = self.obs["policy"], self.obs["critic"]
            # Eager: inside torch.compile (2.13) the normaliser's float64 sample count was not written
            # back, so every step's statistics replaced the running ones (PPO then failed to learn).
            self.actor.obs_norm.update(obs)
            self.critic.obs_norm.update(critic_obs)
            eps = torch.randn((N, self.actor.act_dim), generator=self.gen, device=self.device)
            u, logp, value = self._act_fn(obs, critic_obs, eps)
            self.obs, reward, term, trunc, info = env.step(torch.tanh(u))
            if "episode_return" in info:
                episode_returns.append(info["episode_return"])
                episode_lengths.append(info["episode_length"])
            valid = ~info["nonfinite"] if "nonfinite" in info else torch.ones(N, dtype=torch.bool, device=self.device)
            env_rewards.append(reward)  # what the task paid, for the log (before the bootstrap below)
            if trunc.any() and not env.time_out_ends_return:
                # Time limit is not a terminal state: bootstrap with V(final observation).
                reward = reward + c.gamma * trunc.float() * self.value(info["final_obs"]["critic"])
            for k, v in zip(buf, (obs, critic_obs, u, logp, value, reward, term | trunc, valid)):
                buf[k].append(v)
        batch = {k: torch.stack(v) for k, v in buf.items()}  # [T, N, ...]
        last_value = self.value(self.obs["critic"])

        # Generalised advantage estimation, backwards in time.
        adv = torch.zeros_like(batch["reward"])
        gae = torch.zeros(N, device=self.device)
        for t in reversed(range(T)):
            next_value = last_value if t == T - 1 else batch["value"][t + 1]
            not_done = 1.0 - batch["done"][t].float()
            delta = batch["reward"][t] + c.gamma * next_value * not_done - batch["value"][t]
            # A step into a non-finite state is left out of the loss, and out of the steps before it: they
            # bootstrap from V of its (finite) start instead of reading it as an end paying 0 (as DSRL cuts there).
            gae = (delta + c.gamma * c.gae_lambda * not_done * gae) * batch["valid"][t]
            adv[t] = gae
        batch["adv"] = adv
        batch["ret"] = adv + batch["value"]
        out = {k: v.flatten(0, 1) for k, v in batch.items()}
        out["env_reward"] = torch.stack(env_rewards).flatten()
        out["episode_return"] = torch.cat(episode_returns) if episode_returns else torch.zeros(0)
        out["episode_length"] = torch.cat(episode_lengths) if episode_lengths else torch.zeros(0)
        return out

    def _act(self, obs: torch.Tensor, critic_obs: torch.Tensor, eps: torch.Tensor):
        """One rollout step of the networks: sample the pre-tanh action u = mu + std * eps
        (eps ~ N(0, I)); returns (u, log pi(tanh(u)), V(critic_obs))."""
        mu, log_std = self.actor.dist_params(obs)
        u = mu + log_std.exp() * eps
        return u, squashed_log_prob(u, mu, log_std), self.value(critic_obs)

    def _loss(self, m: dict[str, torch.Tensor], adv: torch.Tensor, ret_n: torch.Tensor, actor_on: float):
        """Clipped PPO loss of one minibatch: (loss, policy loss, value loss, entropy, ratio, log ratio)."""
        c = self.cfg
        mu, log_std = self.actor.dist_params(m["obs"])
        log_ratio = squashed_log_prob(m["u"], mu, log_std) - m["logp"]
        ratio = log_ratio.exp()
        policy_loss = -torch.min(ratio * adv, ratio.clamp(1 - c.clip, 1 + c.clip) * adv).mean()
        value_loss = (self.critic(m["critic"]) - ret_n).square().mean()
        entropy = log_std.sum(-1).mean()  # Gaussian entropy up to a constant
        loss = actor_on * (policy_loss - c.entropy_coef * entropy) + c.value_coef * value_loss
        return loss, policy_loss, value_loss, entropy, ratio, log_ratio

    def update(self, b: dict[str, torch.Tensor]) -> dict[str, float]:
        c = self.cfg
        keys = ("obs", "critic", "u", "logp", "adv", "ret")
        valid = b["valid"]
        b = {k: b[k] for k in keys} if bool(valid.all()) else {k: b[k][valid] for k in keys}
        n = b["adv"].shape[0]
        if n < max(c.minibatches, 2):  # (nearly) every row non-finite: nothing to learn (one row: a NaN std)
            return {"lr": self.lr, "action_std": self.actor.log_std.exp().mean().item(), "skipped_update": 1.0}
        self.value_norm.update(b["ret"][:, None])
        ret_n = (b["ret"][:, None] - self.value_norm.mean) / torch.sqrt(self.value_norm.var + self.value_norm.eps)
        ret_n = ret_n[:, 0]
        adv = (b["adv"] - b["adv"].mean()) / (b["adv"].std() + 1e-8)
        mb = n // c.minibatches
        stats = {"policy_loss": 0.0, "value_loss": 0.0, "kl": 0.0, "entropy": 0.0}
        updates = 0
        for _ in range(c.epochs):
            perm = torch.randperm(n, generator=self.gen, device=self.device)
            for i in range(c.minibatches):
                idx = perm[i * mb:(i + 1) * mb]
                m = {k: v.index_select(0, idx) for k, v in b.items()}  # index_select: ~4x faster than v[idx] on CPU
                # During warm-up only the critic learns: advantages from an untrained critic are noise.
                actor_on = float(self.iteration >= c.critic_warmup_iterations)
                loss, policy_loss, value_loss, entropy, ratio, log_ratio = self._loss_fn(
                    m, adv.index_select(0, idx), ret_n.index_select(0, idx), actor_on)
                self.opt.zero_grad(set_to_none=True)
                loss.backward()
                torch.nn.utils.clip_grad_norm_([*self.actor.parameters(), *self.critic.parameters()], c.max_grad_norm)
                self.opt.step()
                with torch.no_grad():
                    kl = ((ratio - 1) - log_ratio).mean().item()
                if c.desired_kl > 0 and self.iteration >= c.critic_warmup_iterations:  # adaptive step size, as in rsl_rl / legged_gym
                    if kl > 2 * c.desired_kl:
                        self.lr = max(self.lr / 1.5, 1e-5)
                    elif kl < c.desired_kl / 2:
                        self.lr = min(self.lr * 1.5, c.max_lr)
                    for g in self.opt.param_groups:
                        g["lr"] = self.lr
                stats["policy_loss"] += policy_loss.item()
                stats["value_loss"] += value_loss.item()
                stats["kl"] += kl
                stats["entropy"] += entropy.item()
                updates += 1
        out = {k: v / updates for k, v in stats.items()}
        out["lr"] = self.lr
        out["action_std"] = self.actor.log_std.exp().mean().item()
        return out

    def train_iteration(self) -> dict[str, float]:
        """Collect one batch and learn from it; returns scalar metrics for logging."""
        batch = self.rollout()
        metrics = self.update(batch)
        if "skipped_update" not in metrics:  # the critic's warm-up counts updates made
            self.iteration += 1
        metrics["reward"] = batch["env_reward"].mean().item()  # per step; the bootstrapped one is GAE's
        if len(batch["episode_return"]):
            metrics["episode_return"] = batch["episode_return"].mean().item()
            metrics["episode_length_s"] = batch["episode_length"].mean().item()
        return metrics

    def state_dict(self) -> dict:
        return {
            "actor": self.actor.state_dict(), "critic": self.critic.state_dict(),
            "value_norm": self.value_norm.state_dict(), "opt": self.opt.state_dict(), "lr": self.lr,
            "gen": self.gen.get_state(), "obs": self.obs, "iteration": self.iteration,
        }

    def load_state_dict(self, d: dict) -> None:
        self.actor.load_state_dict(d["actor"])
        self.critic.load_state_dict(d["critic"])
        self.value_norm.load_state_dict(d["value_norm"])
        self.opt.load_state_dict(d["opt"])
        for g in self.opt.param_groups:  # a checkpoint of an older revision restores fused=None
            g["fused"] = True
            for p in g["params"]:  # and leaves its step counts on the CPU, where fused CUDA Adam cannot read them
                if "step" in self.opt.state.get(p, {}):
                    self.opt.state[p]["step"] = self.opt.state[p]["step"].to(p.device, torch.float32)
        self.lr = d["lr"]
        self.gen.set_state(d["gen"])
        self.obs = d["obs"]
        self.iteration = d["iteration"]
