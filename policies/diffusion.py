"""Diffusion policy trained by behaviour cloning (``algo=diffusion_bc``).

The policy (after Chi et al., "Diffusion Policy", RSS 2023) predicts a chunk of
``pred_horizon`` actions from the current observation and executes the first
``exec_horizon`` of them before it is queried again.

- Training: DDPM (Ho et al. 2020) with epsilon prediction and the cosine noise schedule
  (Nichol & Dhariwal 2021, offset s = 0.008, betas capped at 0.999).
- Sampling: deterministic DDIM (Song et al. 2021, eta = 0) in ``ddim_steps`` steps. The
  initial noise w [pred_horizon x act_dim] therefore determines the action chunk:
  a = pi_dp(s, w). DSRL (policies/dsrl.py) steers the frozen policy through w.
- Denoiser (``denoiser``): a residual MLP over (noisy chunk, normalised observation, timestep
  embedding), or a 1-D temporal U-Net over the chunk's time axis conditioned on the same two
  (after Chi et al.'s ConditionalUnet1D, which they use on chunks of 16 actions): its convolutions
  share weights along the chunk. At the default 4 actions each update took ~9x the MLP's time,
  and it cloned the arm_push expert no better (BENCHMARKS.md).
- Observation normalisation: mean/std of the dataset, fixed, inside the module (exported).
  Actions are already in [-1, 1] (the action space), so predicted chunks are clipped there.
"""

from __future__ import annotations

import copy
import math
from dataclasses import dataclass

import numpy as np
import torch
from torch import nn

from . import checkpoint as ckpt
from . import dataset as ds
from .normalizer import RunningNorm


@dataclass
class DiffusionBCConfig:
    name: str = "diffusion_bc"
    # directory written by python -m policies.collect ("": data/<task> in the working directory, collect's default)
    dataset: str = ""
    max_episodes: int = 0  # train on the first N demonstrations only (0: all of them)
    num_envs: int = 1  # offline: the environment is used for evaluation only
    pred_horizon: int = 4  # actions predicted per query
    exec_horizon: int = 4  # actions executed per query (<= pred_horizon)
    diffusion_steps: int = 100  # DDPM steps T of the training noise schedule
    # Deterministic sampling steps. DSRL-NA samples the base twice per update, so the base's cost
    # sets its speed: 5 steps of a 128-wide, 2-block denoiser take 12 ms for a batch of 256 on one
    # core of this machine (8 steps of 256 x 3 blocks: 53 ms).
    ddim_steps: int = 5
    denoiser: str = "mlp"  # "mlp" or "unet"
    hidden: int = 128  # mlp: width
    blocks: int = 2  # mlp: residual blocks; unet: conv blocks per level
    # unet: channels of the first level (a multiple of 8, GroupNorm's groups), doubled at each of
    # unet_levels levels, the chunk's length halved between them (pred_horizon divisible by
    # 2^(unet_levels - 1)). 32 channels, 2 levels: ~0.2M weights, ~9x the mlp's time per update (BENCHMARKS.md).
    unet_channels: int = 32
    unet_levels: int = 2
    time_embed: int = 32  # sinusoidal timestep embedding size
    lr: float = 1e-3
    weight_decay: float = 1e-6
    batch_size: int = 256
    gradient_steps: int = 20_000  # training budget
    updates_per_iteration: int = 100  # gradient steps between progress updates
    eval_every_updates: int = 2_000
    # The evaluated/exported policy is an exponential moving average of the weights, with this decay
    # once past its warm-up: update n (from 0) uses min(ema_decay, (1 + n) / (10 + n)), so that the random
    # initial weights are gone from it within a few hundred updates, not 0.995^n (37 % after 200).
    ema_decay: float = 0.995


def cosine_alpha_bar(steps: int, s: float = 0.008, floor: float = 1e-4) -> torch.Tensor:
    """alpha_bar(t) for t = 1..steps (cumulative signal fraction), from the cosine schedule, floored.

    The cosine schedule reaches alpha_bar = 0 at t = T; with the last beta capped at 0.999 it
    leaves 2.4e-7 (T = 100). Sampling divides by sqrt(alpha_bar) to estimate the clean chunk, so
    there float32 rounding is amplified ~2000-fold and the first DDIM step is nearly a sign
    function of the noise: the noise-to-action map DSRL steers becomes jagged (measured: float32
    vs float64 differ by up to 0.05 on some observations). The floor (SNR 1e-4, still noise for
    all practical purposes) keeps that factor at 100."""
    t = torch.arange(steps + 1, dtype=torch.float64) / steps
    f = torch.cos((t + s) / (1 + s) * math.pi / 2) ** 2
    betas = (1 - f[1:] / f[:-1]).clamp(max=0.999)
    return torch.cumprod(1 - betas, 0).clamp(min=floor).float()


def timestep_embedding(t: torch.Tensor, dim: int) -> torch.Tensor:
    half = dim // 2
    freqs = torch.exp(-math.log(10_000.0) * torch.arange(half, device=t.device, dtype=torch.float32) / half)
    ang = t.float()[:, None] * freqs[None]
    return torch.cat((ang.sin(), ang.cos()), dim=-1)


def conditioning(obs: torch.Tensor, t: torch.Tensor, time_embed: int) -> torch.Tensor:
    """What every denoiser layer is conditioned on: [normalised observation | timestep embedding]."""
    return torch.cat((obs, timestep_embedding(t, time_embed)), dim=-1)


def film(h: torch.Tensor, scale_shift: torch.Tensor) -> torch.Tensor:
    """FiLM (Perez et al. 2018): h * (1 + scale) + shift, ``scale_shift`` = [scale | shift] along
    h's feature axis (1: [N, F] or [N, C, L] with a [N, 2C, 1] scale_shift)."""
    scale, shift = scale_shift.chunk(2, dim=1)
    return h * (1 + scale) + shift


class ResidualBlock(nn.Module):
    def __init__(self, hidden: int, cond: int):
        super().__init__()
        self.norm = nn.LayerNorm(hidden)
        self.fc1, self.fc2 = nn.Linear(hidden, hidden), nn.Linear(hidden, hidden)
        self.film = nn.Linear(cond, 2 * hidden)  # conditioning as per-feature scale and shift
        nn.init.zeros_(self.fc2.weight)
        nn.init.zeros_(self.fc2.bias)

    def forward(self, x: torch.Tensor, c: torch.Tensor) -> torch.Tensor:
        h = film(self.norm(x), self.film(c))
        return x + self.fc2(nn.functional.silu(self.fc1(h)))


class ResidualMLPDenoiser(nn.Module):
    """eps_theta(x_t, t, obs): x_t the noisy flattened chunk [N, H*A], obs normalised [N, D]."""

    def __init__(self, x_dim: int, obs_dim: int, hidden: int, blocks: int, time_embed: int):
        super().__init__()
        self.time_embed = time_embed
        cond = obs_dim + time_embed
        self.inp = nn.Linear(x_dim + cond, hidden)
        self.blocks = nn.ModuleList(ResidualBlock(hidden, cond) for _ in range(blocks))
        self.out = nn.Sequential(nn.LayerNorm(hidden), nn.SiLU(), nn.Linear(hidden, x_dim))

    def forward(self, x: torch.Tensor, t: torch.Tensor, obs: torch.Tensor) -> torch.Tensor:
        c = conditioning(obs, t, self.time_embed)
        h = self.inp(torch.cat((x, c), dim=-1))
        for b in self.blocks:
            h = b(h, c)
        return self.out(h)


UNET_GROUPS = 8  # GroupNorm groups in every conv block


class FiLMConvBlock(nn.Module):
    """Two 1-D convolutions over time (each with GroupNorm and SiLU), the conditioning as a
    per-channel scale and shift between them, and a residual connection. [N, C_in, L] -> [N, C_out, L]."""

    def __init__(self, c_in: int, c_out: int, cond: int, kernel: int = 3):
        super().__init__()
        self.conv1 = nn.Conv1d(c_in, c_out, kernel, padding=kernel // 2)
        self.conv2 = nn.Conv1d(c_out, c_out, kernel, padding=kernel // 2)
        self.norm1, self.norm2 = nn.GroupNorm(UNET_GROUPS, c_out), nn.GroupNorm(UNET_GROUPS, c_out)
        self.film = nn.Linear(cond, 2 * c_out)
        self.skip = nn.Conv1d(c_in, c_out, 1) if c_in != c_out else nn.Identity()

    def forward(self, x: torch.Tensor, c: torch.Tensor) -> torch.Tensor:
        h = film(nn.functional.silu(self.norm1(self.conv1(x))), self.film(c)[:, :, None])
        return nn.functional.silu(self.norm2(self.conv2(h))) + self.skip(x)


class TemporalUNetDenoiser(nn.Module):
    """eps_theta(x_t, t, obs) with the chunk as a sequence of ``horizon`` actions ([N, A, H],
    actions as channels): ``levels`` levels of FiLM conv blocks, the length halved (strided
    convolution) and the channels doubled from one to the next, the way back up mirroring it with
    the skip connections of the way down. x_t [N, H*A] flattened as the MLP's, obs normalised [N, D]."""

    def __init__(self, act_dim: int, horizon: int, obs_dim: int, hidden: int, blocks: int, levels: int,
                 time_embed: int):
        super().__init__()
        self.act_dim, self.horizon, self.time_embed = act_dim, horizon, time_embed
        cond = obs_dim + time_embed
        dims = [hidden * 2**i for i in range(levels)]

        def stage(c_in: int, c_out: int) -> nn.ModuleList:
            return nn.ModuleList(FiLMConvBlock(c_in if j == 0 else c_out, c_out, cond) for j in range(blocks))

        self.down = nn.ModuleList(stage(act_dim if i == 0 else dims[i - 1], d) for i, d in enumerate(dims))
        self.downsample = nn.ModuleList(nn.Conv1d(d, d, 3, stride=2, padding=1) for d in dims[:-1])
        self.mid = stage(dims[-1], dims[-1])
        self.upsample = nn.ModuleList(nn.ConvTranspose1d(dims[i + 1], dims[i + 1], 4, stride=2, padding=1)
                                      for i in reversed(range(levels - 1)))
        self.up = nn.ModuleList(stage(dims[i + 1] + dims[i], dims[i]) for i in reversed(range(levels - 1)))
        self.out = nn.Sequential(nn.Conv1d(dims[0], dims[0], 3, padding=1), nn.GroupNorm(UNET_GROUPS, dims[0]),
                                 nn.SiLU(), nn.Conv1d(dims[0], act_dim, 1))

    def forward(self, x: torch.Tensor, t: torch.Tensor, obs: torch.Tensor) -> torch.Tensor:
        c = conditioning(obs, t, self.time_embed)
        h = x.reshape(-1, self.horizon, self.act_dim).transpose(1, 2)
        skips = []
        for i, stage in enumerate(self.down):
            for block in stage:
                h = block(h, c)
            if i < len(self.downsample):
                skips.append(h)
                h = self.downsample[i](h)
        for block in self.mid:
            h = block(h, c)
        for upsample, stage in zip(self.upsample, self.up):
            h = torch.cat((upsample(h), skips.pop()), dim=1)
            for block in stage:
                h = block(h, c)
        return self.out(h).transpose(1, 2).flatten(1)


DENOISERS = ("mlp", "unet")


class DiffusionPolicy(nn.Module):
    """obs [N, D] (+ initial noise w [N, H*A]) -> executed action chunk [N, exec_horizon, A].
    Denoiser settings as in DiffusionBCConfig: ``hidden`` for the mlp, ``unet_*`` for the unet."""

    takes_noise = True  # deployed unsteered, the caller draws w (the ONNX export gets a noise input)

    def __init__(self, obs_dim: int, act_dim: int, pred_horizon: int, exec_horizon: int, diffusion_steps: int,
                 ddim_steps: int, hidden: int, blocks: int, time_embed: int, denoiser: str = "mlp",
                 unet_channels: int = 32, unet_levels: int = 2):
        super().__init__()
        if not 1 <= exec_horizon <= pred_horizon:
            raise ValueError(f"exec_horizon {exec_horizon}: expected 1..pred_horizon ({pred_horizon})")
        if not 1 <= ddim_steps <= diffusion_steps:
            raise ValueError(f"ddim_steps {ddim_steps}: expected 1..diffusion_steps ({diffusion_steps})")
        if time_embed < 2 or time_embed % 2:  # sin and cos of time_embed / 2 frequencies
            raise ValueError(f"time_embed {time_embed}: expected an even number >= 2")
        if denoiser not in DENOISERS:
            raise ValueError(f"denoiser '{denoiser}': expected one of {', '.join(DENOISERS)}")
        if denoiser == "unet":
            if unet_levels < 1 or pred_horizon % 2 ** (unet_levels - 1):
                raise ValueError(f"unet_levels {unet_levels}: the unet halves the chunk between levels, so "
                                 f"pred_horizon ({pred_horizon}) must be divisible by 2^(unet_levels - 1) "
                                 "(unet_levels >= 1)")
            if unet_channels < UNET_GROUPS or unet_channels % UNET_GROUPS:
                raise ValueError(f"unet_channels {unet_channels}: expected a multiple of {UNET_GROUPS} "
                                 "(GroupNorm's groups)")
            # Every GroupNorm normalises channels x length / groups values, the same at each level: with
            # fewer than 4 the normalised features carry next to nothing of the input.
            if unet_channels * pred_horizon < 4 * UNET_GROUPS:
                raise ValueError(f"unet_channels {unet_channels} x pred_horizon {pred_horizon}: expected >= "
                                 f"{4 * UNET_GROUPS}, so that each GroupNorm group holds 4 values or more")
            if blocks < 1:
                raise ValueError(f"blocks {blocks}: the unet needs at least one conv block per level")
        self.spec = dict(obs_dim=obs_dim, act_dim=act_dim, pred_horizon=pred_horizon, exec_horizon=exec_horizon,
                         diffusion_steps=diffusion_steps, ddim_steps=ddim_steps, hidden=hidden, blocks=blocks,
                         time_embed=time_embed, denoiser=denoiser)
        if denoiser == "unet":
            self.spec.update(unet_channels=unet_channels, unet_levels=unet_levels)
        self.act_dim, self.pred_horizon, self.exec_horizon = act_dim, pred_horizon, exec_horizon
        self.latent_dim = pred_horizon * act_dim
        self.obs_norm = RunningNorm(obs_dim)
        self.denoiser = (ResidualMLPDenoiser(self.latent_dim, obs_dim, hidden, blocks, time_embed) if denoiser == "mlp"
                         else TemporalUNetDenoiser(act_dim, pred_horizon, obs_dim, unet_channels, blocks, unet_levels,
                                                   time_embed))
        self.register_buffer("alpha_bar", cosine_alpha_bar(diffusion_steps))
        # DDIM visits ddim_steps evenly spaced training timesteps, from the noisiest down to 0.
        self.register_buffer("ddim_t", torch.linspace(diffusion_steps - 1, 0, ddim_steps).round().long())

    def loss(self, obs: torch.Tensor, chunk: torch.Tensor, gen: torch.Generator) -> torch.Tensor:
        """DDPM epsilon-prediction loss on expert chunks [N, pred_horizon, A]."""
        x0 = chunk.reshape(len(chunk), -1)
        t = torch.randint(0, len(self.alpha_bar), (len(x0),), generator=gen, device=x0.device)
        eps = torch.randn(x0.shape, generator=gen, device=x0.device)
        ab = self.alpha_bar[t][:, None]
        xt = ab.sqrt() * x0 + (1 - ab).sqrt() * eps
        return (self.denoiser(xt, t, self.obs_norm(obs)) - eps).square().mean()

    def sample(self, obs: torch.Tensor, noise: torch.Tensor) -> torch.Tensor:
        """Deterministic DDIM: full predicted chunk [N, pred_horizon, A] from the initial noise."""
        o = self.obs_norm(obs)
        x = noise
        steps = self.ddim_t.tolist()  # a Python loop: unrolled into the exported ONNX graph
        for i, t in enumerate(steps):
            ab = self.alpha_bar[t]
            ab_prev = self.alpha_bar[steps[i + 1]] if i + 1 < len(steps) else torch.ones_like(ab)
            eps = self.denoiser(x, torch.full_like(x[:, 0], float(t)), o)  # batch size stays dynamic in ONNX
            x0 = ((x - (1 - ab).sqrt() * eps) / ab.sqrt()).clamp(-1.0, 1.0)
            eps = (x - ab.sqrt() * x0) / (1 - ab).sqrt()  # consistent with the clipped x0
            x = ab_prev.sqrt() * x0 + (1 - ab_prev).sqrt() * eps
        return x.reshape(-1, self.pred_horizon, self.act_dim)

    def forward(self, obs: torch.Tensor, noise: torch.Tensor | None = None) -> torch.Tensor:
        """Executed chunk [N, exec_horizon, A]; noise None samples w ~ N(0, I) (the base policy)."""
        if noise is None:
            noise = torch.randn(len(obs), self.latent_dim, device=obs.device)
        return self.sample(obs, noise)[:, : self.exec_horizon]


class DiffusionBC:
    """Offline behaviour cloning of a DiffusionPolicy on a demonstration dataset. The trainer
    counts its progress in gradient steps (``progress()``; ``config.is_offline``); the environment
    is only evaluated."""

    def __init__(self, cfg: DiffusionBCConfig, env, device: torch.device, seed: int):
        from .config import UserError

        self.cfg, self.device = cfg, device
        torch.manual_seed(seed)
        obs_dim = env.single_observation_space["policy"].shape[0]
        act_dim = env.single_action_space.shape[0]
        if not 0.0 <= cfg.ema_decay < 1.0:  # 1 would evaluate and export the initial random weights
            raise ValueError(f"ema_decay {cfg.ema_decay}: expected a value in [0, 1)")
        path = self.dataset_path = cfg.dataset or f"data/{env.cfg.name}"
        try:
            demos = ds.load(path, task=env.cfg.name, obs_dim=obs_dim, act_dim=act_dim,
                            collected_with={"obs_source": env.cfg.obs_source} if hasattr(env.cfg, "obs_source")
                            else None).first(cfg.max_episodes)
        except ds.DatasetError as e:
            raise UserError(str(e)) from None
        self.dataset_digest = demos.digest()
        self.obs = torch.as_tensor(demos.obs, device=device)
        self.chunks = torch.as_tensor(demos.action_chunks(cfg.pred_horizon), device=device)
        self.model = DiffusionPolicy(obs_dim, act_dim, cfg.pred_horizon, cfg.exec_horizon, cfg.diffusion_steps,
                                     cfg.ddim_steps, cfg.hidden, cfg.blocks, cfg.time_embed, cfg.denoiser,
                                     cfg.unet_channels, cfg.unet_levels).to(device)
        self.model.obs_norm.update(self.obs)  # fixed dataset statistics
        self.actor = copy.deepcopy(self.model).eval()  # EMA weights: what is evaluated and exported
        for p in self.actor.parameters():
            p.requires_grad_(False)
        self.opt = torch.optim.AdamW(self.model.denoiser.parameters(), lr=cfg.lr, weight_decay=cfg.weight_decay)
        self.sched = torch.optim.lr_scheduler.CosineAnnealingLR(self.opt, T_max=max(cfg.gradient_steps, 1))
        self.gen = torch.Generator(device=device)
        self.gen.manual_seed(seed + 1)
        self.updates = 0

    def progress(self) -> int:
        return self.updates

    def train_iteration(self) -> dict[str, float]:
        c, losses = self.cfg, []
        for _ in range(min(c.updates_per_iteration, c.gradient_steps - self.updates)):  # never past the budget
            idx = torch.randint(0, len(self.obs), (c.batch_size,), generator=self.gen, device=self.device)
            loss = self.model.loss(self.obs[idx], self.chunks[idx], self.gen)
            self.opt.zero_grad(set_to_none=True)
            loss.backward()
            self.opt.step()
            self.sched.step()
            decay = min(c.ema_decay, (1 + self.updates) / (10 + self.updates))
            with torch.no_grad():
                for p, pe in zip(self.model.parameters(), self.actor.parameters()):
                    pe.lerp_(p, 1 - decay)
            self.updates += 1
            losses.append(loss.item())
        return {"loss": float(np.mean(losses)), "lr": self.sched.get_last_lr()[0]}

    def state_dict(self) -> dict:
        return {"model": self.model.state_dict(), "ema": self.actor.state_dict(), "opt": self.opt.state_dict(),
                "sched": self.sched.state_dict(), "gen": self.gen.get_state(), "updates": self.updates,
                "dataset_digest": self.dataset_digest}

    def load_state_dict(self, d: dict) -> None:
        ckpt.require_unchanged(f"the dataset at {self.dataset_path}",  # older checkpoints lack the digest
                               d.get("dataset_digest", self.dataset_digest), self.dataset_digest)
        self.model.load_state_dict(d["model"])
        self.actor.load_state_dict(d["ema"])
        self.opt.load_state_dict(d["opt"])
        self.sched.load_state_dict(d["sched"])
        self.gen.set_state(d["gen"])
        self.updates = d["updates"]
