"""DSRL: steer a frozen diffusion policy by reinforcement learning in its initial-noise space
(``algo=dsrl base=<diffusion_bc run dir>``), after Wagenmaker et al., "Steering Your Diffusion
Policy with Latent Space Reinforcement Learning" (2025).

The base policy (policies/diffusion.py) is a black box a = pi_dp(s, w): deterministic DDIM from
the initial noise w. A SAC actor pi_w(s) picks w = b * tanh(u), u ~ N(mu(s), sigma(s)), bounded
to [-b, b] (``noise_bound``). One decision executes the base's ``exec_horizon`` actions; its
reward is their sum and the discount ``gamma`` applies per decision. The base's weights never
change (they are not even given to an optimiser); its run directory is only read.

Variants (``variant``):
- ``sac`` (DSRL-SAC): plain SAC in the latent-noise MDP, the replay buffer holds w.
- ``na`` (DSRL-NA, noise-aliased): a critic Q^A(s, a) over the executed action chunk learns by
  TD from the buffer (next action a' = pi_dp(s', pi_w(s'))); a critic Q^W(s, w) is distilled
  from it on w ~ N(0, I), Q^W(s, w) ~ Q^A(s, pi_dp(s, w)), and the actor ascends Q^W. Since
  Q^A is over actions, demonstrations can go into the buffer (``demos``): every noise that
  maps to a good action benefits, which is the aliasing the name refers to.

Critics see the privileged critic observation (asymmetric actor-critic); the actor sees the
policy observation. ``utd`` gradient updates per collected decision. The actor's regulariser is
its KL to the base's own noise distribution (``noise_prior``, see DSRLConfig) rather than SAC's
entropy bonus, so the steering leaves w ~ N(0, I) only as far as the noise critic pays for.

Two choices for sparse tasks that end at success: (1) the critic targets carry no entropy bonus
(it stays in the actor's loss): with one, every decision before the end pays alpha * H (about
0.21 with 20 noise dimensions at alpha 0.01), so a success, which stops that stream, would be
worth less than never succeeding; (2) a time-out ends the return like a termination where the task
says so (``env.time_out_ends_return``: the arm's critics observe the time left in the episode), as
in SAC and PPO; elsewhere it is bootstrapped from the episode's final observation.
"""

from __future__ import annotations

import copy
import hashlib
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

import numpy as np
import torch
from torch import nn

from . import checkpoint as ckpt
from . import dataset as ds
from .diffusion import DiffusionPolicy
from .networks import Actor, Critic, frozen, polyak_update, share_buffers, squashed_log_prob
from .replay import ReplayBuffer


@dataclass
class DSRLConfig:
    name: str = "dsrl"
    base: str = ""  # run directory of an algo=diffusion_bc run of the same task (required)
    variant: str = "na"  # "na" (DSRL-NA) or "sac" (DSRL-SAC)
    noise_bound: float = 1.5  # b: w in [-b, b]
    num_envs: int = 8
    buffer_size: int = 200_000  # decisions
    batch_size: int = 256
    utd: float = 1.0  # gradient updates per collected decision
    warmup_steps: int = 2_000  # env steps collected before the first update
    gamma: float = 0.99  # per decision (one executed chunk)
    # Decisions summed into each TD target: r_t + gamma r_t+1 + ... + gamma^(n-1) r_t+n-1 +
    # gamma^n Q(s_t+n), cut short at the episode's end (Sutton 1988; Rainbow's n = 3, Hessel et
    # al. 2018). A sparse success reward then reaches the first decisions n times sooner; the
    # targets are those of the behaviour that collected the n decisions, not of the current actor,
    # which they undervalue as it improves: on arm_reach n = 3 was ahead at 50k steps and behind
    # at 150k (BENCHMARKS.md).
    n_step: int = 1
    tau: float = 0.005  # target network Polyak rate
    actor_lr: float = 3e-4
    critic_lr: float = 3e-4
    alpha_lr: float = 3e-4
    # Entropy temperature. The initial actor's entropy over the arm's 20 noise dimensions (a chunk
    # of 4 actions of 5) is ~21 nats in w-space (b = 1.5; ~14 in tanh-space), so 0.1 would pay ~2.1
    # per decision for randomness, more than the sparse success reward of 1.
    init_alpha: float = 0.01
    init_log_std: float = 0.0  # the initial actor draws u ~ N(0, 1): w close to the base's N(0, I)
    # Target entropy per noise dimension, measured for tanh(u) in [-1, 1] (DSRL's reference setting
    # is 0); in w-space that is + log(b) per dimension.
    target_entropy_per_dim: float = 0.0
    # Regularise toward the base's own noise instead of rewarding entropy: the actor minimises
    # alpha * KL(pi_w(.|s) || N(0, I) truncated to [-b, b]) - Q(s, w), and alpha is tuned so that
    # the KL stays near ``prior_kl_per_dim`` x latent_dim nats (the closest a tanh-Gaussian gets is
    # ~0.02 per dimension at b = 1.5). With the entropy bonus alone (false; ``target_entropy_per_dim`` then
    # applies), alpha falls once the entropy is above target and nothing holds the actor's mean:
    # on arm_pick_place, noise critics that could not tell noises apart walked the deployed w to
    # a norm of 3-4, where the base succeeds ~60 % of the time against ~80 % at w = 0, and DSRL
    # ended below its start on every seed. With the prior, w stayed at a norm of 0.6-0.8 and the
    # success near the start (BENCHMARKS.md).
    noise_prior: bool = True
    prior_kl_per_dim: float = 0.05
    # The next noise w' of the TD target: "sampled" from pi_w(s') as SAC does, or the "deployed" one,
    # b tanh(mu(s')), so that the critics value the continuation that evaluation and export run (with the
    # noise prior the sampled w' stays near N(0, I), where the base does worse than at w = 0).
    bootstrap_noise: str = "sampled"
    actor_hidden: list[int] = field(default_factory=lambda: [256, 256])
    critic_hidden: list[int] = field(default_factory=lambda: [256, 256])
    # LayerNorm in the critics' hidden layers (DSRL's reference configuration uses it). Without
    # it, DSRL-SAC's Q grew to ~35-38 on arm_push in 50k steps, where true values are <= 1.
    critic_layer_norm: bool = True
    # Clip TD targets to the task's return range (env.return_range(), where the task has one), as
    # HER clips its targets to the -1/0 reward's range (Andrychowicz et al., 2017). With LayerNorm
    # but without the clip, DSRL-SAC's Q still rose to 7.5 on arm_pick_place (returns <= 1), and
    # with reward_type=time above 0 (returns <= 0) within 20k steps.
    clip_targets: bool = True
    demos: str = ""  # DSRL-NA: a policies.collect dataset loaded into the buffer ("" = none)
    # Share of every batch drawn from the demonstrations, which then sit in a buffer of their own
    # (as RLPD's symmetric sampling, Ball et al. 2023, draws half of each batch from its offline
    # data). None: they are ordinary entries of the replay buffer, a share that shrinks as it fills
    # (20 arm_reach demonstrations are 62 decisions, 0.5 % of the buffer after 50k env steps), and
    # once buffer_size decisions have been collected after them (800k env steps at the defaults,
    # chunks of 4) the ring overwrites them.
    demo_fraction: Optional[float] = None


class SteeredDiffusionPolicy(nn.Module):
    """What DSRL deploys: obs -> w = b * tanh(mu(obs)) -> frozen base -> executed chunk [N, H, A]."""

    def __init__(self, base: dict, latent: dict, noise_bound: float):
        super().__init__()
        self.spec = dict(base=dict(base), latent=dict(latent), noise_bound=noise_bound)
        self.base = DiffusionPolicy(**base)
        self.latent = Actor(**latent)
        self.noise_bound = noise_bound

    def noise(self, obs: torch.Tensor) -> torch.Tensor:
        """w = b tanh(mu(obs)) of the actor, evaluated in float64 (its float32 weights cast exactly).

        The base's map from w to actions is steep: its first DDIM step divides by sqrt(alpha_bar_T)
        = 0.01, so where the predicted chunk is not clipped an error in w reaches the action
        amplified up to ~90 times. A float32 actor gets w right to ~1e-4 only (a pre-tanh output
        is a sum of terms hundreds of times larger than itself), which left PyTorch and
        onnxruntime, summing in different orders, 6e-3 apart and each as far from the exact
        chunk. With w from float64, both are within 6e-5 of it; the base stays float32."""
        x = self.latent.obs_norm(obs.double())
        for layer in self.latent.net:
            if isinstance(layer, nn.Linear):
                x = nn.functional.linear(x, layer.weight.double(), layer.bias.double())
            else:
                x = layer(x)
        # float32 (the shared rounding of w), then the caller's type: a float64 copy (the export's exact
        # reference) runs its base in float64, which a U-Net's convolutions require.
        return (self.noise_bound * torch.tanh(x[..., : self.latent.act_dim])).float().to(obs.dtype)

    def forward(self, obs: torch.Tensor) -> torch.Tensor:
        return self.base(obs, self.noise(obs))


def load_base(run_dir: str, task: str, obs_dim: int, act_dim: int, device) -> tuple[DiffusionPolicy, str]:
    """The frozen base policy of a diffusion_bc run, and a digest of its weights."""
    from .config import UserError

    if not run_dir:
        raise UserError("algo=dsrl needs algo.base=<run dir of an algo=diffusion_bc run of this task>")
    try:
        rec = ckpt.load_record(run_dir, device)
        if rec.get("policy_class") != "DiffusionPolicy":  # the kind first: a PPO run of any revision
            raise UserError(f"algo.base={run_dir} holds a '{rec.get('policy_class')}' policy; DSRL steers a "
                            f"diffusion policy (train one with python -m policies.train task={task} algo=diffusion_bc)")
        ckpt.require_contract(rec, Path(run_dir) / ckpt.BEST)
        base = ckpt.policy_from_record(rec, Path(run_dir) / ckpt.BEST, device)
    except ckpt.CheckpointError as e:
        raise UserError(f"algo.base={run_dir}: {e}") from None
    base_task, spec = rec["config"]["task"]["name"], base.spec
    if base_task != task or spec["obs_dim"] != obs_dim or spec["act_dim"] != act_dim:
        raise UserError(f"algo.base={run_dir} was trained on '{base_task}' (obs {spec['obs_dim']}, action "
                        f"{spec['act_dim']}); this run is '{task}' (obs {obs_dim}, action {act_dim})")
    return base.requires_grad_(False), weights_digest(base)


def weights_digest(module: nn.Module) -> str:
    h = hashlib.sha256()
    for k, v in module.state_dict().items():
        h.update(k.encode())
        h.update(v.detach().cpu().contiguous().numpy().tobytes())
    return h.hexdigest()[:16]


class DSRL:
    def __init__(self, cfg: DSRLConfig, env, device: torch.device, seed: int):
        from .config import UserError

        if cfg.variant not in ("na", "sac"):
            raise UserError(f"algo.variant={cfg.variant}: expected na (DSRL-NA) or sac (DSRL-SAC)")
        if cfg.bootstrap_noise not in ("sampled", "deployed"):
            raise UserError(f"algo.bootstrap_noise={cfg.bootstrap_noise}: expected sampled or deployed")
        if not cfg.noise_bound > 0:
            raise UserError(f"algo.noise_bound={cfg.noise_bound}: expected b > 0 (the steering noise lies in [-b, b])")
        if not cfg.utd > 0:
            raise UserError(f"algo.utd={cfg.utd}: expected > 0 gradient updates per collected decision")
        if not cfg.n_step >= 1:
            raise UserError(f"algo.n_step={cfg.n_step}: expected >= 1 decisions per TD target")
        self.cfg, self.env, self.device = cfg, env, device
        torch.manual_seed(seed)
        obs_dim = env.single_observation_space["policy"].shape[0]
        critic_dim = env.single_observation_space["critic"].shape[0]
        act_dim = env.single_action_space.shape[0]
        base, self.base_digest = load_base(cfg.base, env.cfg.name, obs_dim, act_dim, device)
        self.exec_horizon = base.exec_horizon
        # env steps of one train_iteration: a decision (a chunk) in every environment
        self.iteration_steps = env.num_envs * self.exec_horizon
        self.iteration_size = f"algo.num_envs x the base's exec_horizon {self.exec_horizon}"
        self.latent_dim = latent_dim = base.latent_dim
        self.actor = SteeredDiffusionPolicy(base.spec, dict(obs_dim=obs_dim, act_dim=latent_dim,
                                            hidden=list(cfg.actor_hidden), activation="relu", init_action=0.0,
                                            init_log_std=cfg.init_log_std, state_dependent_std=True),
                                            cfg.noise_bound).to(device)
        self.actor.base.load_state_dict(base.state_dict())
        self.actor.base.eval().requires_grad_(False)
        self.base = self.actor.base
        self.pi = self.actor.latent
        chunk_dim = self.exec_horizon * act_dim
        q_in = critic_dim + (latent_dim if cfg.variant == "sac" else chunk_dim)
        self.q = Critic(q_in, cfg.critic_hidden, "relu", 2, cfg.critic_layer_norm).to(device)  # Q^W (sac) or Q^A (na)
        self.q_target = copy.deepcopy(self.q)
        if cfg.variant == "na":
            self.qw = Critic(critic_dim + latent_dim, cfg.critic_hidden, "relu", 2, cfg.critic_layer_norm).to(device)
            self.qw_opt = torch.optim.Adam(self.qw.parameters(), lr=cfg.critic_lr)
        self.log_alpha = torch.tensor(math.log(cfg.init_alpha), device=device, requires_grad=True)
        self.pi_opt = torch.optim.Adam(self.pi.parameters(), lr=cfg.actor_lr)
        self.q_opt = torch.optim.Adam(self.q.parameters(), lr=cfg.critic_lr)
        self.alpha_opt = torch.optim.Adam([self.log_alpha], lr=cfg.alpha_lr)
        # reward: the n-step discounted sum; next_*: the state n decisions on; discount: gamma^(decisions
        # summed), a column only when n_step > 1 (with one decision it is gamma)
        fields = {"obs": (obs_dim,), "critic": (critic_dim,), "w": (latent_dim,), "chunk": (chunk_dim,), "reward": (),
                  "next_obs": (obs_dim,), "next_critic": (critic_dim,), "done": ()}
        self.buffer = ReplayBuffer(cfg.buffer_size, fields | ({"discount": ()} if cfg.n_step > 1 else {}), device)
        # Decisions of the last n_step - 1 collections whose n-step targets are not complete yet, oldest first.
        self.pending: list[dict[str, torch.Tensor]] = []
        self.gen = torch.Generator(device=device)
        self.gen.manual_seed(seed + 1)
        self.return_range = env.return_range() if cfg.clip_targets and hasattr(env, "return_range") else None
        self.obs, _ = env.reset(seed=seed)
        self.decisions = 0
        self.updates = 0
        self.owed_updates = 0.0
        self.demo_transitions = 0
        self.demos_digest: str | None = None
        self.demo_buffer: ReplayBuffer | None = None
        if cfg.demo_fraction is not None and not (cfg.demos and 0.0 <= cfg.demo_fraction <= 1.0):
            raise UserError(f"algo.demo_fraction={cfg.demo_fraction}: expected a share in [0, 1] of each batch, "
                            "with demonstrations to draw it from (algo.demos=<dataset>)")
        if cfg.demos:
            if cfg.variant != "na":
                raise UserError("algo.demos: demonstrations go into the buffer of DSRL-NA only (algo.variant=na); "
                                "DSRL-SAC's buffer holds noises, which demonstrations do not have")
            self._load_demos(cfg.demos, obs_dim, act_dim)

    # ------------------------------------------------------------------ data
    def _load_demos(self, path: str, obs_dim: int, act_dim: int) -> None:
        """Demonstrations as decisions of exec_horizon steps (a chunk cut short by the episode's
        end is padded with its last action), with n_step-decision returns as collect() stores them;
        an episode's last decision ends the return, a time-out's too: a dataset holds no observation
        after an episode's last step to bootstrap from, so demonstrations need a task whose time-outs
        end returns (``env.time_out_ends_return``, every arm task)."""
        from .config import UserError

        if not self.env.time_out_ends_return:
            raise UserError(f"algo.demos: task {self.env.cfg.name} bootstraps its time-outs, and a dataset holds "
                            "no observation after an episode's last step to bootstrap from")
        try:
            d = ds.load(path, task=self.env.cfg.name, obs_dim=obs_dim, act_dim=act_dim,
                        critic_dim=self.env.single_observation_space["critic"].shape[0],
                        # rewards and the critic's time feature (t / episode_steps) must mean what they mean
                        # online, and the observation's cube pose must come from the same source
                        collected_with={k: getattr(self.env.cfg, k) for k in
                                        ("reward_type", "episode_steps", "terminate_on_success", "obs_source")})
        except ds.DatasetError as e:
            raise UserError(f"algo.demos: {e}") from None
        self.demos_digest = d.digest()
        h, g, n_step = self.exec_horizon, self.cfg.gamma, self.cfg.n_step
        rows = {k: [] for k in ("obs", "critic", "chunk", "reward", "next_obs", "next_critic", "done", "discount")}
        for s in d.episode_slices():
            starts = list(range(s.start, s.stop, h))
            r = [d.reward[t:min(t + h, s.stop)].sum() for t in starts]
            for j, t in enumerate(starts):
                m = min(n_step, len(starts) - j)  # decisions summed: n_step, fewer at the episode's end
                done = j + m >= len(starts)  # terminated or timed out (see the docstring)
                idx = np.minimum(np.arange(t, t + h), s.stop - 1)  # the last chunk padded with its last action
                rows["obs"].append(d.obs[t])
                rows["critic"].append(d.critic[t])
                rows["chunk"].append(d.action[idx].reshape(-1))
                rows["reward"].append(sum(r[j + i] * g**i for i in range(m)))
                nxt = starts[j + m] if not done else t  # the next state of a last decision is never used (masked)
                rows["next_obs"].append(d.obs[nxt])
                rows["next_critic"].append(d.critic[nxt])
                rows["done"].append(float(done))
                rows["discount"].append(g**m)
        if n_step == 1:
            del rows["discount"]
        batch = {k: torch.as_tensor(np.stack(v), device=self.device) for k, v in rows.items()}
        n = len(batch["obs"])
        if self.cfg.demo_fraction is not None:  # a buffer of their own, re-made from the dataset on resume
            self.demo_buffer = ReplayBuffer(n, {k: v.shape[1:] for k, v in self.buffer.data.items()}, self.device)
        into = self.buffer if self.demo_buffer is None else self.demo_buffer
        into.add(**batch, w=torch.zeros(n, self.latent_dim, device=self.device))
        self.demo_transitions = n
        # The critics train on these rows from the first update on, so their normalisers count them as
        # they count every collected decision. Without it an expert's states were scaled by the first
        # collections' statistics alone: after one collection 94 % of arm_pick_place's demonstration
        # rows had a feature at the normaliser's clip, after 100 1 % (BENCHMARKS.md, "DSRL on
        # arm_pick_place"). A resume loads the statistics saved with the critics, demonstrations included.
        # The actor's too: its loss and the TD target's next noise are computed on these rows' states.
        self._count_in_critic_norms(batch["critic"], batch["chunk"])
        self.pi.obs_norm.update(batch["obs"])

    def _count_in_critic_norms(self, critic_obs: torch.Tensor, q_action: torch.Tensor) -> None:
        """Add rows the critics train on to their observation normalisers: Q's (and its target's) over
        the critic observation and Q's action input; DSRL-NA's Q^W's over the critic observation and
        the w ~ N(0, I) it learns on (update())."""
        self.q.obs_norm.update(torch.cat((critic_obs, q_action), -1))
        share_buffers(self.q_target, self.q)  # the TD target normalises as the critic does
        if self.cfg.variant == "na":
            w_dist = torch.randn((len(critic_obs), self.latent_dim), generator=self.gen, device=self.device)
            self.qw.obs_norm.update(torch.cat((critic_obs, w_dist), -1))

    def _log_prior(self, w: torch.Tensor) -> torch.Tensor:
        """log density of w under the base's noise N(0, I) truncated to [-b, b], summed over dimensions."""
        b = self.cfg.noise_bound
        log_mass = math.log(math.erf(b / math.sqrt(2.0)))  # of [-b, b] under N(0, 1)
        return (-0.5 * w.square() - 0.5 * math.log(2 * math.pi) - log_mass).sum(-1)

    def _sample_w(self, obs: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """w = b tanh(u) and log pi(w | obs) (the change of variables includes the scale b)."""
        mu, log_std = self.pi.dist_params(obs)
        u = mu + log_std.exp() * torch.randn(mu.shape, generator=self.gen, device=self.device)
        logp = squashed_log_prob(u, mu, log_std) - self.latent_dim * math.log(self.cfg.noise_bound)
        return self.cfg.noise_bound * torch.tanh(u), logp

    @torch.no_grad()
    def collect(self) -> torch.Tensor:
        """One decision in every environment: exec_horizon env steps of the steered base. An env
        whose episode ends inside the chunk runs the chunk's remaining actions in the episode the
        env's same-step reset began; that episode is dropped and a new one started after the chunk
        (ArmEnv.restart), so every episode starts as in evaluation: at t = 0, at home, at rest. The
        dropped steps count as env steps: at most exec_horizon - 1 per episode that ends by success or failure
        (a time-out of episode_steps divisible by exec_horizon ends at a chunk's end). Before, 477 of the 634
        episodes of a 50k-step arm_push DSRL-NA run had started 1-3 steps in."""
        obs, n = self.obs, self.env.num_envs
        self.pi.obs_norm.update(obs["policy"])
        w, _ = self._sample_w(obs["policy"])
        chunk = self.base.sample(obs["policy"], w)[:, : self.exec_horizon]
        reward = torch.zeros(n, device=self.device)
        ended = torch.zeros(n, dtype=torch.bool, device=self.device)
        bad = torch.zeros(n, dtype=torch.bool, device=self.device)  # the decision reached a non-finite state
        timed_out = torch.zeros(n, dtype=torch.bool, device=self.device)  # its episode ended at the time limit
        nxt = {k: torch.zeros_like(v) for k, v in obs.items() if k in ("policy", "critic")}
        for k in range(self.exec_horizon):
            o, r, term, trunc, info = self.env.step(chunk[:, k])
            reward += torch.where(ended, torch.zeros_like(r), r)
            new = (term | trunc) & ~ended
            if new.any():
                for key in nxt:
                    nxt[key][new] = info["final_obs"][key][new]
                if "nonfinite" in info:
                    bad |= info["nonfinite"] & new
                timed_out |= new & trunc & ~term
                ended |= new
        for key in nxt:
            nxt[key][~ended] = o[key][~ended]
        restart = ended & ~(term | trunc)  # ended before the chunk's last step
        if restart.any():
            rows = restart.nonzero()[:, 0]
            fresh = self.env.restart(rows.cpu().numpy())
            for key, v in fresh.items():  # o is step()'s own new tensors: nxt holds copies of its rows
                o[key][rows] = v
        self.obs = o
        self._count_in_critic_norms(obs["critic"], self._q_action_input(w, chunk))
        self.pending.append(dict(obs=obs["policy"], critic=obs["critic"], w=w, chunk=chunk.reshape(n, -1),
                                 reward=torch.zeros(n, device=self.device),
                                 open=torch.ones(n, dtype=torch.bool, device=self.device)))
        terminal = ended if self.env.time_out_ends_return else ended & ~timed_out
        self._store(reward, ended, terminal, bad, nxt)
        self.decisions += n
        return reward

    def _store(self, reward: torch.Tensor, ended: torch.Tensor, terminal: torch.Tensor, bad: torch.Tensor,
               nxt: dict[str, torch.Tensor]) -> None:
        """Add this decision's reward to the pending decisions of each env and store those now
        complete: n_step decisions old, or their episode ended here; ``terminal``: the ended ones
        whose return ends there (not bootstrapped; time-outs only where the task says so, see the
        module's text). A decision that reached a non-finite state is never fed to training; the
        earlier decisions of that env still pending are stored cut short before it, bootstrapped from
        the (finite) state it started from."""
        g, n_step = self.cfg.gamma, self.cfg.n_step
        start = self.pending[-1]  # this decision: its observations are where it started
        for age, p in enumerate(reversed(self.pending)):  # age: decisions before this one in p's sum
            cut = p["open"] & bad if age > 0 else None
            if cut is not None and cut.any():  # p's sum so far, age decisions, continued by Q at `start`
                k = int(cut.sum())
                self.buffer.add(**{key: p[key][cut] for key in ("obs", "critic", "w", "chunk", "reward")},
                                discount=torch.full((k,), g**age, device=self.device),
                                next_obs=start["obs"][cut], next_critic=start["critic"][cut],
                                done=torch.zeros(k, device=self.device))
                p["open"] = p["open"] & ~cut
            # Closed slots add on too, but are never stored again. Not in place: a state_dict()
            # taken earlier holds these tensors.
            p["reward"] = p["reward"] + reward * g**age
            close = p["open"] & ended if age + 1 < n_step else p["open"]  # a non-finite state ends its episode too
            keep = close & ~bad
            if keep.any():
                row = {k: p[k][keep] for k in ("obs", "critic", "w", "chunk", "reward")}
                if n_step > 1:
                    row["discount"] = torch.full((int(keep.sum()),), g ** (age + 1), device=self.device)
                self.buffer.add(**row, next_obs=nxt["policy"][keep], next_critic=nxt["critic"][keep],
                                done=terminal[keep].float())
            p["open"] = p["open"] & ~close
        self.pending = [p for p in self.pending if p["open"].any()]

    def _q_action_input(self, w: torch.Tensor, chunk: torch.Tensor) -> torch.Tensor:
        return w if self.cfg.variant == "sac" else chunk.reshape(len(chunk), -1)

    # ------------------------------------------------------------------ learning
    @torch.no_grad()
    def td_target(self, b: dict[str, torch.Tensor]) -> torch.Tensor:
        """r + gamma^n (1 - done) min_i Q'_i(s', next) for a row of n decisions (n_step, fewer at an
        episode's end), next = w' ~ pi_w(s') (or the deployed b tanh(mu(s')): bootstrap_noise) for DSRL-SAC,
        or the base's action chunk from it for DSRL-NA; clipped to the task's return range if it has one."""
        if self.cfg.bootstrap_noise == "deployed":
            w2 = self.cfg.noise_bound * torch.tanh(self.pi.dist_params(b["next_obs"])[0])
        else:
            w2, _ = self._sample_w(b["next_obs"])
        if self.cfg.variant == "sac":
            q_next = self.q_target(torch.cat((b["next_critic"], w2), -1)).min(-1).values
        else:  # Q^A of the action the steered base takes next
            a2 = self.base.sample(b["next_obs"], w2)[:, : self.exec_horizon].reshape(len(w2), -1)
            q_next = self.q_target(torch.cat((b["next_critic"], a2), -1)).min(-1).values
        target = b["reward"] + b.get("discount", self.cfg.gamma) * (1 - b["done"]) * q_next
        if self.return_range is not None:  # a value outside the task's return range is an error
            target = target.clamp(*self.return_range)
        return target

    def _sample_batch(self) -> dict[str, torch.Tensor]:
        """A batch of decisions: with a demonstration buffer, round(demo_fraction * batch_size) of
        them from it and the rest from the replay buffer; else uniform over the replay buffer."""
        if self.demo_buffer is None:
            return self.buffer.sample(self.cfg.batch_size, self.gen)
        n_demo = round(self.cfg.demo_fraction * self.cfg.batch_size)
        own, demo = self.buffer.sample(self.cfg.batch_size - n_demo, self.gen), self.demo_buffer.sample(n_demo, self.gen)
        return {k: torch.cat((own[k], demo[k])) for k in own}

    def update(self) -> dict[str, float]:
        c = self.cfg
        b = self._sample_batch()
        alpha = self.log_alpha.exp().detach()
        metrics: dict[str, float] = {}
        target = self.td_target(b)
        a_in = b["w"] if c.variant == "sac" else b["chunk"]
        q = self.q(torch.cat((b["critic"], a_in), -1))
        q_loss = (q - target[:, None]).square().mean()
        self.q_opt.zero_grad(set_to_none=True)
        q_loss.backward()
        self.q_opt.step()
        metrics["q_loss"] = q_loss.item()

        if c.variant == "na":  # distil Q^W(s, w) from Q^A(s, pi_dp(s, w)), w ~ N(0, I)
            with torch.no_grad():
                w_rand = torch.randn(c.batch_size, self.latent_dim, generator=self.gen, device=self.device)
                a_rand = self.base.sample(b["obs"], w_rand)[:, : self.exec_horizon].reshape(c.batch_size, -1)
                qa = self.q(torch.cat((b["critic"], a_rand), -1)).min(-1).values
            qw = self.qw(torch.cat((b["critic"], w_rand), -1))
            qw_loss = (qw - qa[:, None]).square().mean()
            self.qw_opt.zero_grad(set_to_none=True)
            qw_loss.backward()
            self.qw_opt.step()
            metrics["qw_loss"] = qw_loss.item()
        actor_q = self.q if c.variant == "sac" else self.qw

        w, logp = self._sample_w(b["obs"])
        if c.noise_prior:  # one-sample estimate of KL(pi_w || prior); entropy alone otherwise
            reg = logp - self._log_prior(w)
            target = self.latent_dim * c.prior_kl_per_dim  # alpha rises while the KL is above it
        else:
            reg = logp
            target = -self.latent_dim * (c.target_entropy_per_dim + math.log(c.noise_bound))  # in w-space
        with frozen(actor_q):
            pi_loss = (alpha * reg - actor_q(torch.cat((b["critic"], w), -1)).min(-1).values).mean()
            self.pi_opt.zero_grad(set_to_none=True)
            pi_loss.backward()
        self.pi_opt.step()
        metrics["regulariser"] = reg.mean().item()
        alpha_loss = -(self.log_alpha * (reg.detach() - target)).mean()
        self.alpha_opt.zero_grad(set_to_none=True)
        alpha_loss.backward()
        self.alpha_opt.step()
        polyak_update(self.q_target, self.q, c.tau)
        self.updates += 1
        return {**metrics, "actor_loss": pi_loss.item(), "alpha": alpha.item(), "q_mean": q.mean().item()}

    def train_iteration(self) -> dict[str, float]:
        reward = self.collect()
        metrics = {"reward": reward.mean().item()}
        if self.env.total_steps >= self.cfg.warmup_steps and self.buffer.size > 0:  # n-step rows come n decisions late
            self.owed_updates += self.cfg.utd * self.env.num_envs  # fractions carry over
            while self.owed_updates >= 1.0:
                metrics.update(self.update())
                self.owed_updates -= 1.0
        return metrics

    # ------------------------------------------------------------------ checkpointing
    def state_dict(self) -> dict:
        d = {"pi": self.pi.state_dict(), "q": self.q.state_dict(), "q_target": self.q_target.state_dict(),
             "log_alpha": self.log_alpha.detach().clone(), "pi_opt": self.pi_opt.state_dict(),
             "q_opt": self.q_opt.state_dict(), "alpha_opt": self.alpha_opt.state_dict(),
             "buffer": self.buffer.state_dict(), "gen": self.gen.get_state(), "obs": self.obs,
             "decisions": self.decisions, "updates": self.updates, "owed_updates": self.owed_updates,
             "base_digest": self.base_digest, "demos_digest": self.demos_digest,
             "pending": [dict(p) for p in self.pending]}
        if self.cfg.variant == "na":
            d.update(qw=self.qw.state_dict(), qw_opt=self.qw_opt.state_dict())
        return d

    def load_state_dict(self, d: dict) -> None:
        ckpt.require_unchanged(f"the base policy at {self.cfg.base}", d["base_digest"], self.base_digest, "DSRL run")
        ckpt.require_unchanged(f"the demonstrations at {self.cfg.demos}",  # older checkpoints lack the digest
                               d.get("demos_digest", self.demos_digest), self.demos_digest, "DSRL run")
        self.pi.load_state_dict(d["pi"])
        self.q.load_state_dict(d["q"])
        self.q_target.load_state_dict(d["q_target"])
        with torch.no_grad():
            self.log_alpha.copy_(d["log_alpha"])
        self.pi_opt.load_state_dict(d["pi_opt"])
        self.q_opt.load_state_dict(d["q_opt"])
        self.alpha_opt.load_state_dict(d["alpha_opt"])
        self.buffer.load_state_dict(d["buffer"])
        self.gen.set_state(d["gen"])
        self.obs = d["obs"]
        self.decisions, self.updates, self.owed_updates = d["decisions"], d["updates"], d["owed_updates"]
        self.pending = [dict(p) for p in d.get("pending", [])]  # none before n_step existed
        if self.cfg.variant == "na":
            self.qw.load_state_dict(d["qw"])
            self.qw_opt.load_state_dict(d["qw_opt"])
