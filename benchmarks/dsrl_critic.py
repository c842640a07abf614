"""Does a DSRL critic tell good noises from bad ones? The critic the actor climbs (Q^W: the noise
critic of either variant) at the states of the run's replay buffer, for four noises:

    python -m benchmarks.dsrl_critic <dsrl run dir> [<dsrl run dir> ...] [--states 4096]

- w = 0: the untrained steered policy's deterministic noise (w = b tanh(mu), mu ~ 0);
- w ~ N(0, I): the base policy's own noise;
- the trained actor's deterministic noise b tanh(mu(s)), what is evaluated and deployed;
- the noises stored in the buffer (DSRL-SAC only: DSRL-NA's critics never learn from its stored
  noises, and its demonstrations carry a placeholder w = 0).

On arm_pick_place the base scores ~80 % at w = 0 and ~60 % with w ~ N(0, I) (BENCHMARKS.md), so
a critic that has learned what the noise does should rank w = 0 above a random noise in most
states. With ``--select K`` (K > 0) it also runs ``--episodes`` episodes (the evaluation's initial
states) three ways: the trained actor's noise, w = 0, and at every query the candidate the critic
values most among w = 0 and K - 1 draws of b tanh(u), u ~ N(0, I) (the untrained actor's noises).
A critic that ranks noises makes the last beat w = 0, whatever the actor learned from it; compare
with the greedy choice by true one-chunk outcomes in ``benchmarks.steerability``. Prints one table row per
run and, unless --no-write, replaces the BENCHMARKS.md section.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch
from omegaconf import OmegaConf

from benchmarks.common import write_section
from benchmarks.steerability import draw_candidates, episodes
from policies import checkpoint as ckpt
from policies.config import to_objects
from policies.train import make_algo
from sim.registry import get_task


@torch.no_grad()
def critic_ranking(run: Path, states: int, select: int = 0, n_episodes: int = 100, seed: int = 0) -> dict:
    """Mean noise-critic value (min over the twin critics) for each noise above, the fraction
    of buffer states where Q(s, 0) > Q(s, w ~ N(0, I)), and with ``select`` > 0 the success rates
    of the actor's noise, of w = 0 and of the critic's choice among ``select`` candidates."""
    cfg = OmegaConf.load(run / "config.yaml")
    task_cfg, algo_cfg = to_objects(cfg)
    env = get_task(task_cfg.name).env_cls(task_cfg, algo_cfg.num_envs, device="cpu", seed=seed)
    algo = make_algo("dsrl", algo_cfg, env, torch.device("cpu"), seed)
    state = ckpt.load(run / ckpt.LAST)
    algo.load_state_dict(state["algo"])
    qw = algo.q if algo_cfg.variant == "sac" else algo.qw
    gen = torch.Generator().manual_seed(seed)
    b = algo.buffer.sample(states, gen)
    s, n, d = b["critic"], states, algo.latent_dim

    def q(w: torch.Tensor) -> torch.Tensor:
        return qw(torch.cat((s, w), -1)).min(-1).values

    q0, q_rand = q(torch.zeros(n, d)), q(torch.randn(n, d, generator=gen))
    w_pi = algo.actor.noise(b["obs"])
    row = {"run": str(run), "variant": algo_cfg.variant, "steps": state["trainer"]["env_steps"], "q0": q0.mean().item(),
           "q_rand": q_rand.mean().item(), "q_pi": q(w_pi).mean().item(),
           "q_buffer": q(b["w"]).mean().item() if algo_cfg.variant == "sac" else None,
           "prefer0": (q0 > q_rand).float().mean().item(), "w_pi_norm": w_pi.norm(dim=-1).mean().item()}
    if select > 0:
        cand_gen, bound = torch.Generator().manual_seed(seed + 1), algo_cfg.noise_bound

        def chosen(obs: dict) -> torch.Tensor:
            m = len(obs["critic"])
            cands = bound * torch.tanh(draw_candidates(select, m, d, cand_gen))  # w = 0 first
            values = torch.stack([qw(torch.cat((obs["critic"], c), -1)).min(-1).values for c in cands])
            return cands[values.argmax(0), torch.arange(m)]

        def succ(noise) -> float:
            return float(episodes(algo.base, task_cfg, n_episodes, 12345, noise).mean())  # policies.eval's seed

        row.update(success_actor=succ(lambda obs: algo.actor.noise(obs["policy"])),
                   success_zero=succ(lambda obs: torch.zeros(len(obs["policy"]), d)), success_select=succ(chosen))
    return row


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("runs", nargs="+", help="run directories of algo=dsrl runs")
    ap.add_argument("--states", type=int, default=4096)
    ap.add_argument("--select", type=int, default=16, help="candidates for the critic's choice (0: skip)")
    ap.add_argument("--episodes", type=int, default=100)
    ap.add_argument("--no-write", action="store_true")
    a = ap.parse_args()
    torch.set_num_threads(1)
    sel = (f" success: actor's w | success: w = 0 | success: the critic's choice among {a.select} |"
           if a.select > 0 else "")
    table = ("| run | variant | env steps | Q(s, 0) | Q(s, w ~ N(0, I)) | Q(s, actor's w) | Q(s, buffer w) | "
             f"states with Q(s, 0) > Q(s, w ~ N(0, I)) | mean norm of the actor's w |{sel}\n"
             "|---|---|---:|---:|---:|---:|---:|---:|---:|" + ("---:|" * 3 if a.select > 0 else "") + "\n")
    for run in a.runs:
        r = critic_ranking(Path(run), a.states, a.select, a.episodes)
        qb = f"{r['q_buffer']:.3f}" if r["q_buffer"] is not None else "-"
        table += (f"| `{run}` | {r['variant']} | {r['steps']:,} | {r['q0']:.3f} | {r['q_rand']:.3f} | "
                  f"{r['q_pi']:.3f} | {qb} | {r['prefer0'] * 100:.0f}% | {r['w_pi_norm']:.2f} |")
        if a.select > 0:
            table += "".join(f" {r[k] * 100:.0f}% |" for k in ("success_actor", "success_zero", "success_select"))
        table += "\n"
        print(table.splitlines()[-1], flush=True)
    note = (f"{a.states} states drawn from each run's replay buffer (its last checkpoint); Q is the minimum of the "
            "twin noise critics (DSRL-SAC: Q(s, w); DSRL-NA: Q^W). For reference, a 16-dimensional w ~ N(0, I) has "
            "a norm of about 4; the noise bound b = 1.5 allows up to 6.")
    if a.select > 0:
        note += (f" Success columns: {a.episodes} episodes from `policies.eval`'s initial states (seed 12345; "
                 f"training evaluations use seed + 10000, other states) with "
                 f"the run's last actor, with w = 0, and with the noise the critic values most among w = 0 and "
                 f"{a.select - 1} draws of b tanh(u), u ~ N(0, I), chosen at every query.")
    if not a.no_write:
        write_section("DSRL critic: does it rank the noises?",
                      f"python -m benchmarks.dsrl_critic {' '.join(a.runs)} --select {a.select} "
                      f"--episodes {a.episodes}",
                      table + "\n" + note, threads=1)


if __name__ == "__main__":
    main()
