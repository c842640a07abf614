"""Can the base's noise be chosen from an observation? A supervised test of part of what a DSRL
critic has to learn, with true one-chunk outcomes as labels instead of TD targets:

    python -m benchmarks.noise_chooser runs/bench_manipulation/arm_push/base [--envs 1000]

1. Collect: ``--envs`` episodes from other initial states than the evaluation's (seed + 1),
   steered by benchmarks.steerability's greedy choice; at every query of a running episode, both
   observations (``policy``: what the deployed actor sees; ``critic``: the privileged state a
   DSRL critic sees), K candidate noises (w = 0 and K - 1 draws of N(0, I)) and their true
   one-chunk scores (``candidate_scores``).
2. Fit a chooser f(obs, w) (MLP 256 x 2) per observation with a listwise loss: within each
   state, cross-entropy to a softmax of the candidates' standardised progress (a success on top,
   a failure at the bottom). Only the ranking within a state is learned, not the state's value,
   which a Q-critic must also learn. A tenth of the episodes is held out to measure the ranking.
3. Steer: at every query, execute the candidate with the highest f among w = 0 and K - 1 fresh
   draws (steerability's greedy candidate draws), on the evaluation's initial states.

The fit states are those of greedy steering, not those the chooser visits itself. If a chooser
closes most of the gap between w = 0 and the greedy choice, the noise's one-chunk effect can be
read from that observation with this much data; if not, the greedy choice's gain rests on more
than the observation tells (or on more data or capacity than used here). Writes a section of
BENCHMARKS.md.
"""

from __future__ import annotations

import argparse
import time

import numpy as np
import torch
from omegaconf import OmegaConf

from benchmarks.common import load_run_policy, write_section
from benchmarks.steerability import GREEDY_SEED, SUCCESS, draw_candidates, episodes
from policies.config import to_objects
from policies.networks import mlp

PROGRESS_STD_FLOOR = 1e-3  # reward units: below this spread, a state's candidates count as equal


def collect(base, task_cfg, n: int, seed: int, k: int) -> dict[str, torch.Tensor]:
    """``policy`` [N, D], ``critic`` [N, C], ``w`` [N, K, latent], ``score`` [N, K] and ``env`` [N]
    (episode index) at every query of ``n`` greedily steered episodes that are still running."""
    record: list[dict] = []
    episodes(base, task_cfg, n, seed, None, greedy=k, greedy_gen=torch.Generator().manual_seed(seed), record=record)
    return {key: torch.cat([r[key] for r in record]) for key in record[0]}


def soft_ranking(score: torch.Tensor, temperature: float = 0.5) -> torch.Tensor:
    """[N, K] one-chunk scores -> [N, K] target distribution within each state: the softmax of the
    progress standardised over the state's candidates that neither succeed nor fail (clipped to
    +-3; a spread below PROGRESS_STD_FLOOR counts as none), a success at +3, a failure at -3."""
    success, failure = score > SUCCESS / 2, score < -SUCCESS / 2
    live = ~(success | failure)
    count = live.sum(1, keepdim=True).clamp(min=1)
    mean = torch.where(live, score, 0.0).sum(1, keepdim=True) / count
    var = torch.where(live, (score - mean) ** 2, 0.0).sum(1, keepdim=True) / count
    z = ((score - mean) / var.sqrt().clamp(min=PROGRESS_STD_FLOOR)).clamp(-3.0, 3.0)
    z = torch.where(success, 3.0, torch.where(failure, -3.0, z))
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


def rank_of_random_pick(score: torch.Tensor) -> float:
    """rank_of_pick's expectation for a uniformly random pick (ties counted as the measure does)."""
    return (score[:, None, :] > score[:, :, None]).sum(-1).float().mean().item()


def fit(obs: torch.Tensor, w: torch.Tensor, score: torch.Tensor, episode: torch.Tensor, steps: int,
        seed: int) -> tuple[Chooser, dict[str, float]]:
    """Fit a Chooser with ``steps`` Adam steps of 256 states from 90 % of the episodes; ranks
    (in candidates, see rank_of_pick) of its pick, of w = 0 and of a random pick on the states of
    the other 10 %, and of its pick on the fit states."""
    gen = torch.Generator().manual_seed(seed)
    held_eps = torch.randperm(int(episode.max()) + 1, generator=gen)[: (int(episode.max()) + 1) // 10]
    held = torch.isin(episode, held_eps)
    train = torch.nonzero(~held).squeeze(1)
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        f = Chooser(obs[train], w.shape[-1])
    opt = torch.optim.Adam(f.parameters(), lr=1e-3)
    target = soft_ranking(score)
    for _ in range(steps):
        i = train[torch.randint(len(train), (256,), generator=gen)]
        loss = -(target[i] * torch.log_softmax(f(obs[i], w[i]), 1)).sum(1).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
    f.eval()
    with torch.no_grad():
        pick = f(obs[held], w[held]).argmax(1)
        fit_pick = f(obs[train], w[train]).argmax(1)
    zero = torch.zeros(int(held.sum()), dtype=torch.long)
    return f, {"held_out": float(held.sum()), "rank": rank_of_pick(score[held], pick),
               "rank_zero": rank_of_pick(score[held], zero), "rank_random": rank_of_random_pick(score[held]),
               "rank_fit": rank_of_pick(score[train], fit_pick)}


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
    if a.envs < 10:  # a tenth of the episodes is held out: none below 10, and every rank would be nan
        ap.error(f"--envs {a.envs}: expected at least 10 (a tenth of the episodes is held out)")
    torch.set_num_threads(1)
    base, rec = load_run_policy(a.run, "DiffusionPolicy", "algo=diffusion_bc")
    task_cfg, _ = to_objects(OmegaConf.create(rec["config"]))
    k, t0 = a.candidates, time.time()
    data = collect(base, task_cfg, a.envs, a.seed + 1, k)
    t_collect = time.time() - t0
    zero = episodes(base, task_cfg, a.episodes, a.seed,
                    lambda o: torch.zeros(len(o["policy"]), base.latent_dim)).mean()
    pct = lambda v: f"{v * 100:.0f}%"  # noqa: E731
    rows = ""
    for key in ("policy", "critic"):
        f, m = fit(data[key], data["w"], data["score"], data["env"], a.fit_steps, a.seed)
        chosen = []
        for r in range(a.runs):
            def choose(o: dict, g: torch.Generator = torch.Generator().manual_seed(GREEDY_SEED + r)) -> torch.Tensor:
                cand = draw_candidates(k, len(o[key]), base.latent_dim, g)
                return cand[f(o[key], cand.transpose(0, 1)).argmax(1), torch.arange(len(o[key]))]
            chosen.append(episodes(base, task_cfg, a.episodes, a.seed, choose).mean())
        print(f"{key}: {m}, success {[round(c * 100) for c in chosen]} %", flush=True)
        rows += (f"| `{key}` | {m['rank']:.2f} | {m['rank_fit']:.2f} | {m['rank_zero']:.2f} | {m['rank_random']:.2f} "
                 f"| {pct(np.mean(chosen))} ({pct(min(chosen))}-{pct(max(chosen))}) |\n")
    held = int(m["held_out"])
    body = (f"Base: `{a.run}` ({task_cfg.name}). Fit data: {a.envs} greedily steered episodes from other initial "
            f"states (seed {a.seed + 1}): {len(data['w'])} states x {k} candidate noises with their true "
            f"one-chunk scores ({t_collect:.0f} s to simulate); {a.fit_steps} Adam steps of 256 states per "
            f"chooser; {held} states of a tenth of the episodes held out. Success at w = 0: {pct(zero)} "
            f"({a.episodes} episodes, evaluation seed {a.seed}).\n\n"
            f"| chooser's observation | held-out rank of its pick | its rank on the fit states | held-out rank of w = 0 "
            f"| held-out rank of a random pick | success of its pick among {k}: mean of {a.runs} runs (min-max) |\n"
            f"|---|---:|---:|---:|---:|---:|\n{rows}\n"
            f"Rank: how many of the other {k - 1} candidates have a strictly better true one-chunk score (0: the "
            "greedy choice's pick). The runs use the greedy runs' candidate draws (seeds "
            f"{GREEDY_SEED}, {GREEDY_SEED + 1}, ...): with the same --episodes and --seed, the section "
            f"\"Diffusion base: room for steering ({task_cfg.name})\" gives the greedy choice on the same "
            "initial states and candidates.")
    print(body)
    if not a.no_write:
        write_section(f"Diffusion base: a learned noise choice ({task_cfg.name})",
                      f"python -m benchmarks.noise_chooser {a.run} --envs {a.envs} --candidates {k} "
                      f"--fit-steps {a.fit_steps} --runs {a.runs} --episodes {a.episodes} --seed {a.seed}", body)


if __name__ == "__main__":
    main()
