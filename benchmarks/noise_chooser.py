"""Can the base's noise be chosen from the policy observation? A supervised test of what a DSRL
critic has to learn, with the true one-chunk outcomes as labels instead of TD targets:

    python -m benchmarks.noise_chooser runs/bench_manipulation/arm_push/base [--envs 1000]

1. Collect: ``--envs`` episodes from other initial states than the evaluation's (seed + 1),
   steered by benchmarks.steerability's greedy choice; at every query of a running episode, the
   policy observation, K candidate noises (w = 0 and K - 1 draws of N(0, I)) and their true
   one-chunk scores (``candidate_scores``).
2. Fit a chooser f(obs, w) (MLP 256 x 2) with a listwise loss: within each state, cross-entropy to
   a softmax of the candidates' standardised scores (a success on top, a failure at the bottom).
   Only the ranking within a state is learned, not the state's value, which a Q-critic must also
   learn; a tenth of the states is held out to measure the ranking.
3. Steer: at every query, execute the candidate with the highest f among w = 0 and K - 1 fresh
   draws, on the evaluation's initial states, ``--runs`` times with other draws.

If the chooser closes most of the gap between w = 0 and the greedy choice, the noise's effect is
learnable from the observation with this much data and a DSRL critic's failure to rank noises is
a failure of TD learning; if not, the greedy choice's gain rests on what only the simulator
knows. Writes a section of BENCHMARKS.md.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import numpy as np
import torch
from omegaconf import OmegaConf

from benchmarks.common import write_section
from benchmarks.steerability import SUCCESS, candidate_scores, episodes
from policies import checkpoint as ckpt
from policies.config import to_objects
from policies.networks import mlp
from sim.registry import get_task


@torch.no_grad()
def collect(base, task_cfg, n: int, seed: int, k: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Observations [N, D], candidate noises [N, K, latent] and their scores [N, K] at every query
    of ``n`` greedily steered episodes (only of episodes still running)."""
    env = get_task(task_cfg.name).env_cls(task_cfg, n, device="cpu", seed=seed, backend="mujoco")
    obs, _ = env.reset(seed=seed)
    gen = torch.Generator().manual_seed(seed)
    finished = np.zeros(n, bool)
    obs_l, w_l, s_l = [], [], []
    t = 0
    while t < env.max_steps and not finished.all():
        w = torch.randn(k, n, base.latent_dim, generator=gen)
        w[0] = 0.0
        chunks = torch.stack([base(obs["policy"], w[i]) for i in range(k)])  # [K, n, H, A]
        score = candidate_scores(env, chunks)
        alive = torch.as_tensor(~finished)
        obs_l.append(obs["policy"][alive])
        w_l.append(w[:, alive].transpose(0, 1))
        s_l.append(torch.as_tensor(score[:, ~finished].T, dtype=torch.float32))
        chunk = chunks[torch.as_tensor(score.argmax(0)), torch.arange(n)]
        for j in range(chunk.shape[1]):
            obs, _, term, trunc, _ = env.step(chunk[:, j])
            finished |= (term | trunc).numpy()
            t += 1
    return torch.cat(obs_l), torch.cat(w_l), torch.cat(s_l)


def soft_ranking(score: torch.Tensor, temperature: float = 0.5) -> torch.Tensor:
    """[N, K] scores -> [N, K] target distribution within each state: the softmax of the shaped
    progress standardised over the state's candidates (clipped to +-3), a success at +3 and a
    failure at -3."""
    progress = torch.where(score.abs() >= SUCCESS, torch.zeros_like(score), score)
    z = (progress - progress.mean(1, keepdim=True)) / (progress.std(1, keepdim=True) + 1e-6)
    z = torch.where(score >= SUCCESS, 3.0, torch.where(score <= -SUCCESS, -3.0, z.clamp(-3.0, 3.0)))
    return torch.softmax(z / temperature, 1)


class Chooser(torch.nn.Module):
    """f(obs, w): a score per candidate noise; obs normalised by the fit data's mean and std."""

    def __init__(self, obs: torch.Tensor, latent_dim: int, hidden: int = 256):
        super().__init__()
        self.register_buffer("mean", obs.mean(0))
        self.register_buffer("std", obs.std(0) + 1e-6)
        self.net = mlp([obs.shape[1] + latent_dim, hidden, hidden, 1], "relu")

    def forward(self, obs: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        """obs [N, D], w [N, K, latent] -> [N, K]."""
        o = ((obs - self.mean) / self.std).unsqueeze(1).expand(-1, w.shape[1], -1)
        return self.net(torch.cat((o, w), -1)).squeeze(-1)


def rank_of_pick(score: torch.Tensor, pick: torch.Tensor) -> float:
    """Mean number of candidates with a strictly better true score than the picked one (0: best)."""
    return (score > score.gather(1, pick[:, None])).sum(1).float().mean().item()


def fit(obs: torch.Tensor, w: torch.Tensor, score: torch.Tensor, steps: int, seed: int) -> tuple[Chooser, dict]:
    """Fit a Chooser on 90 % of the states; ranking measures on the other 10 %."""
    gen = torch.Generator().manual_seed(seed)
    torch.manual_seed(seed)
    perm = torch.randperm(len(obs), generator=gen)
    held, train = perm[: len(obs) // 10], perm[len(obs) // 10:]
    f = Chooser(obs[train], w.shape[-1])
    opt = torch.optim.Adam(f.parameters(), lr=1e-3)
    target = soft_ranking(score)
    for _ in range(steps):
        i = train[torch.randint(len(train), (256,), generator=gen)]
        loss = -(target[i] * torch.log_softmax(f(obs[i], w[i]), 1)).sum(1).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
    with torch.no_grad():
        pick = f(obs[held], w[held]).argmax(1)
    return f.eval(), {"held_out": len(held), "rank": rank_of_pick(score[held], pick),
                      "rank_zero": rank_of_pick(score[held], torch.zeros(len(held), dtype=torch.long))}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("run", help="run directory of an algo=diffusion_bc run")
    ap.add_argument("--envs", type=int, default=1000, help="greedily steered episodes to learn from")
    ap.add_argument("--candidates", type=int, default=16)
    ap.add_argument("--fit-steps", type=int, default=4000)
    ap.add_argument("--runs", type=int, default=3, help="steered evaluations with other candidate draws")
    ap.add_argument("--episodes", type=int, default=100)
    ap.add_argument("--seed", type=int, default=12345, help="evaluation seed (the fit data uses seed + 1)")
    ap.add_argument("--no-write", action="store_true")
    a = ap.parse_args()
    torch.set_num_threads(1)
    base, rec = ckpt.load_policy(Path(a.run))
    task_cfg, _ = to_objects(OmegaConf.create(rec["config"]))
    k, t0 = a.candidates, time.time()
    obs, w, score = collect(base, task_cfg, a.envs, a.seed + 1, k)
    t_collect = time.time() - t0
    f, m = fit(obs, w, score, a.fit_steps, a.seed)
    print(f"{len(obs)} states x {k} candidates ({t_collect:.0f} s); held-out rank of the pick {m['rank']:.2f}, "
          f"of w = 0 {m['rank_zero']:.2f}", flush=True)

    def zeros(o: dict) -> torch.Tensor:
        return torch.zeros(len(o["policy"]), base.latent_dim)

    zero = episodes(base, task_cfg, a.episodes, a.seed, zeros).mean()
    chosen = []
    for r in range(a.runs):
        gen = torch.Generator().manual_seed(3000 + r)  # the candidate draws of steerability's greedy runs

        def choose(o: dict, g: torch.Generator = gen) -> torch.Tensor:
            cand = torch.randn(k, len(o["policy"]), base.latent_dim, generator=g)
            cand[0] = 0.0
            pick = f(o["policy"], cand.transpose(0, 1)).argmax(1)
            return cand[pick, torch.arange(len(pick))]

        with torch.no_grad():
            chosen.append(episodes(base, task_cfg, a.episodes, a.seed, choose).mean())
        print(f"learned choice, run {r}: {chosen[-1] * 100:.0f}%", flush=True)
    pct = lambda v: f"{v * 100:.0f}%"  # noqa: E731
    body = (f"Base: `{a.run}` ({task_cfg.name}). Fit data: {a.envs} greedily steered episodes from other initial "
            f"states (seed {a.seed + 1}): {len(obs)} states x {k} candidate noises with their true one-chunk "
            f"scores ({t_collect:.0f} s to simulate); {a.fit_steps} Adam steps of 256 states.\n\n"
            f"| measure | value |\n|---|---:|\n"
            f"| held-out states ({m['held_out']}): candidates truly better than the chooser's pick, mean of {k - 1} "
            f"| {m['rank']:.2f} |\n"
            f"| same for w = 0 (a random pick: {(k - 1) / 2:.1f}; the greedy choice: 0) | {m['rank_zero']:.2f} |\n"
            f"| success, w = 0 ({a.episodes} episodes, evaluation seed {a.seed}) | {pct(zero)} |\n"
            f"| success, the chooser's pick among {k} at every query: mean of {a.runs} runs (min-max) "
            f"| {pct(np.mean(chosen))} ({pct(min(chosen))}-{pct(max(chosen))}) |\n\n"
            "The greedy choice by true one-chunk outcomes, on the same initial states and candidate draws, is in "
            f"the section \"Diffusion base: room for steering ({task_cfg.name})\".")
    print(body)
    if not a.no_write:
        write_section(f"Diffusion base: a learned noise choice ({task_cfg.name})",
                      f"python -m benchmarks.noise_chooser {a.run} --envs {a.envs} --candidates {k} "
                      f"--fit-steps {a.fit_steps} --runs {a.runs} --episodes {a.episodes}", body)


if __name__ == "__main__":
    main()
