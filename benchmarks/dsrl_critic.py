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

With ``--advantage N`` it measures instead whether the critic sees what one decision's noise is
worth (section "DSRL critic: does it see a decision's advantage?"). N episodes from the
evaluation's initial states run the trained actor's deterministic noise; at every query of a
running episode, two alternatives to the actor's noise w_pi:

- w_fit: the noise fitted to the scripted expert's next chunk within the run's bound
  (``benchmarks.steerability.fit_noise``, 100 Adam steps from w_pi), steering toward the
  demonstrator;
- w_rand: b tanh(u), u ~ N(0, I), a noise the untrained actor could draw.

Each alternative's true advantage A = G(alternative's chunk, then the actor) - G(actor's chunk,
then the actor) is one Monte Carlo rollout each to the episode's end from the same simulator state
and generators (common random numbers), G the return with the run's rewards and discount per
decision. The critic's estimate is Q(s, w_alt) - Q(s, w_pi) of the noise critic (and, for DSRL-NA,
of Q^A on the executed chunks too). A critic the actor can climb has estimates that correlate
with A and agree with its sign.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch
from omegaconf import OmegaConf

from benchmarks.common import write_section
from benchmarks.steerability import draw_candidates, episodes, expert_chunk, fit_noise
from policies import checkpoint as ckpt
from policies.config import to_objects
from policies.train import make_algo
from sim.registry import get_task


def load_run(run: Path, seed: int = 0):
    """(task config, algo config, the DSRL algorithm at the run's last checkpoint, its env steps)."""
    if not (run / "config.yaml").is_file() or not (run / ckpt.LAST).is_file():
        raise SystemExit(f"error: {run}: no config.yaml and {ckpt.LAST} there; expected an algo=dsrl run directory")
    cfg = OmegaConf.load(run / "config.yaml")
    if cfg.algo.name != "dsrl":
        raise SystemExit(f"error: {run} is an algo={cfg.algo.name} run; this benchmark reads the critics of an "
                         "algo=dsrl run")
    task_cfg, algo_cfg = to_objects(cfg)
    env = get_task(task_cfg.name).env_cls(task_cfg, algo_cfg.num_envs, device="cpu", seed=seed)
    algo = make_algo("dsrl", algo_cfg, env, torch.device("cpu"), seed)
    algo.buffer.persist(run / ckpt.REPLAY)  # where the run's replay rows are (read here, never written)
    try:
        state = ckpt.load(run / ckpt.LAST)
        algo.load_state_dict(state["algo"])
    except ckpt.CheckpointError as e:
        raise SystemExit(f"error: {run}: {e}") from None
    return task_cfg, algo_cfg, algo, state["trainer"]["env_steps"]


@torch.no_grad()
def critic_ranking(run: Path, states: int, select: int = 0, n_episodes: int = 100, seed: int = 0) -> dict:
    """Mean noise-critic value (min over the twin critics) for each noise above, the fraction
    of buffer states where Q(s, 0) > Q(s, w ~ N(0, I)), and with ``select`` > 0 the success rates
    of the actor's noise, of w = 0 and of the critic's choice among ``select`` candidates."""
    task_cfg, algo_cfg, algo, steps = load_run(run, seed)
    qw = algo.q if algo_cfg.variant == "sac" else algo.qw
    gen = torch.Generator().manual_seed(seed)
    b = algo.buffer.sample(states, gen)
    s, n, d = b["critic"], states, algo.latent_dim

    def q(w: torch.Tensor) -> torch.Tensor:
        return qw(torch.cat((s, w), -1)).min(-1).values

    q0, q_rand = q(torch.zeros(n, d)), q(torch.randn(n, d, generator=gen))
    w_pi = algo.actor.noise(b["obs"])
    row = {"run": str(run), "variant": algo_cfg.variant, "steps": steps, "q0": q0.mean().item(),
           "dim": d, "bound": algo_cfg.noise_bound,
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


def rollout_return(env, algo, first: torch.Tensor, done: torch.Tensor, gamma: float) -> torch.Tensor:
    """Discounted return [n] (per decision) of executing the chunk ``first`` [n, H, A], then the
    actor's deterministic noise, to each env's episode end (``done`` marks envs not to count).
    The environment is left in the state it started in."""
    saved, ended = env.state_dict(), done.clone()
    ret, disc, chunk = torch.zeros(env.num_envs), 1.0, first
    while not ended.all():
        for j in range(chunk.shape[1]):
            obs, r, term, trunc, _ = env.step(chunk[:, j])
            ret += disc * torch.where(ended, torch.zeros_like(r), r)
            ended |= term | trunc
        if ended.all():
            break
        disc *= gamma
        chunk = algo.base(obs["policy"], algo.actor.noise(obs["policy"]))
    env.load_state_dict(saved)
    return ret


@torch.no_grad()
def decision_advantage(run: Path, n_episodes: int, seed: int = 0, fit_steps: int = 100) -> dict:
    """True (Monte Carlo) and estimated advantages over the actor's noise of w_fit and w_rand at every
    query of ``n_episodes`` episodes run by the actor (see the module docstring)."""
    task_cfg, algo_cfg, algo, steps = load_run(run, seed)
    base, bound, d, na = algo.base, algo_cfg.noise_bound, algo.latent_dim, algo_cfg.variant == "na"
    qw = algo.q if not na else algo.qw
    env = get_task(task_cfg.name).env_cls(task_cfg, n_episodes, device="cpu", seed=12345, backend="mujoco")
    obs, _ = env.reset(seed=12345)
    gen, finished = torch.Generator().manual_seed(seed + 2), torch.zeros(n_episodes, dtype=torch.bool)
    rec: dict[str, list[torch.Tensor]] = {k: [] for k in ("true_fit", "true_rand", "est_fit", "est_rand",
                                                           "est_a_fit", "est_a_rand", "dist_pi", "dist_fit")}
    while not finished.all():
        target = expert_chunk(env, algo.exec_horizon)
        w_pi = algo.actor.noise(obs["policy"])
        w_fit = fit_noise(base, obs["policy"], target, w_pi, fit_steps, bound)
        w_rand = bound * torch.tanh(torch.randn(n_episodes, d, generator=gen))
        chunks = {k: base(obs["policy"], w) for k, w in (("pi", w_pi), ("fit", w_fit), ("rand", w_rand))}
        g = {k: rollout_return(env, algo, c, finished, algo_cfg.gamma) for k, c in chunks.items()}
        alive = ~finished

        def noise_q(w: torch.Tensor) -> torch.Tensor:
            return qw(torch.cat((obs["critic"], w), -1)).min(-1).values

        def action_q(c: torch.Tensor) -> torch.Tensor:
            return algo.q(torch.cat((obs["critic"], c.reshape(n_episodes, -1)), -1)).min(-1).values

        q_pi = noise_q(w_pi)
        qa_pi = action_q(chunks["pi"]) if na else None
        for alt, w in (("fit", w_fit), ("rand", w_rand)):
            rec[f"true_{alt}"].append((g[alt] - g["pi"])[alive])
            rec[f"est_{alt}"].append((noise_q(w) - q_pi)[alive])
            if na:
                rec[f"est_a_{alt}"].append((action_q(chunks[alt]) - qa_pi)[alive])
        for k in ("pi", "fit"):
            rec[f"dist_{k}"].append((chunks[k] - target).square().mean((1, 2))[alive])
        for j in range(algo.exec_horizon):  # the actor's own chunk: on-policy states
            obs, _, term, trunc, _ = env.step(chunks["pi"][:, j])
            finished |= term | trunc
    r = {k: torch.cat(v) for k, v in rec.items() if v}

    def stats(true: torch.Tensor, est: torch.Tensor) -> dict:
        nz = true != 0
        return {"corr": torch.corrcoef(torch.stack((true, est)))[0, 1].item(),
                "sign": ((true > 0) == (est > 0))[nz].float().mean().item() if nz.any() else float("nan")}

    out = {"run": str(run), "variant": algo_cfg.variant, "steps": steps, "bound": bound, "queries": len(r["true_fit"]),
           "dist_pi": r["dist_pi"].mean().item(), "dist_fit": r["dist_fit"].mean().item()}
    for alt in ("fit", "rand"):
        t = r[f"true_{alt}"]
        out[alt] = {"true": t.mean().item(), "true_se": (t.std() / len(t) ** 0.5).item(),
                    "true_pos": (t > 0).float().mean().item(), "true_neg": (t < 0).float().mean().item(),
                    "est": r[f"est_{alt}"].mean().item(), **stats(t, r[f"est_{alt}"])}
        if na:
            out[alt].update(est_a=r[f"est_a_{alt}"].mean().item(),
                            **{f"{k}_a": v for k, v in stats(t, r[f"est_a_{alt}"]).items()})
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("runs", nargs="+", help="run directories of algo=dsrl runs")
    ap.add_argument("--states", type=int, default=4096)
    ap.add_argument("--select", type=int, default=16, help="candidates for the critic's choice (0: skip)")
    ap.add_argument("--episodes", type=int, default=100)
    ap.add_argument("--advantage", type=int, default=0, metavar="N",
                    help="measure the critic against one decision's true advantage over N episodes instead")
    ap.add_argument("--no-write", action="store_true")
    a = ap.parse_args()
    torch.set_num_threads(1)
    if a.advantage > 0:
        return advantage_main(a)
    sel = (f" success: actor's w | success: w = 0 | success: the critic's choice among {a.select} |"
           if a.select > 0 else "")
    table = ("| run | variant | env steps | Q(s, 0) | Q(s, w ~ N(0, I)) | Q(s, actor's w) | Q(s, buffer w) | "
             f"states with Q(s, 0) > Q(s, w ~ N(0, I)) | mean norm of the actor's w |{sel}\n"
             "|---|---|---:|---:|---:|---:|---:|---:|---:|" + ("---:|" * 3 if a.select > 0 else "") + "\n")
    print(table, end="", flush=True)  # the header; each run's row as it comes
    rows = []
    for run in a.runs:
        r = critic_ranking(Path(run), a.states, a.select, a.episodes)
        rows.append(r)
        qb = f"{r['q_buffer']:.3f}" if r["q_buffer"] is not None else "-"
        table += (f"| `{run}` | {r['variant']}, b = {r['bound']:g} | {r['steps']:,} | {r['q0']:.3f} | {r['q_rand']:.3f} | "
                  f"{r['q_pi']:.3f} | {qb} | {r['prefer0'] * 100:.0f}% | {r['w_pi_norm']:.2f} |")
        if a.select > 0:
            table += "".join(f" {r[k] * 100:.0f}% |" for k in ("success_actor", "success_zero", "success_select"))
        table += "\n"
        print(table.splitlines()[-1], flush=True)
    note = (f"{a.states} states drawn from each run's replay buffer (its last checkpoint); Q is the minimum of the "
            "twin noise critics (DSRL-SAC: Q(s, w); DSRL-NA: Q^W). For reference, a d-dimensional w ~ N(0, I) has "
            "a norm of about sqrt(d) (d = " + ", ".join(sorted({str(r["dim"]) for r in rows})) + " here), and a noise "
            "bound b allows up to b sqrt(d).")
    if a.select > 0:
        note += (f" Success columns: {a.episodes} episodes from `policies.eval`'s initial states (seed 12345; "
                 f"training evaluations use seed + 10000, other states) with "
                 f"the run's last actor, with w = 0, and with the noise the critic values most among w = 0 and "
                 f"{a.select - 1} draws of b tanh(u), u ~ N(0, I), chosen at every query.")
    print(note)
    if not a.no_write:
        write_section("DSRL critic: does it rank the noises?",
                      f"python -m benchmarks.dsrl_critic {' '.join(a.runs)} --select {a.select} "
                      f"--episodes {a.episodes} --states {a.states}",
                      table + "\n" + note, threads=1)


def advantage_main(a: argparse.Namespace) -> None:
    table = ("| run | variant | env steps | b | queries | alternative | true advantage (SE) | true > 0 / < 0 | "
             "critic's estimate | correlation | sign agreement |\n|---|---|---:|---:|---:|---|---:|---:|---:|---:|---:|\n")
    print(table, end="", flush=True)  # the header; the rows as they come
    dists = []
    for run in a.runs:
        r = decision_advantage(Path(run), a.advantage)
        head = f"| `{run}` | {r['variant']} | {r['steps']:,} | {r['bound']:g} | {r['queries']} |"
        for alt, name in (("fit", "w_fit"), ("rand", "w_rand")):
            x = r[alt]
            rows = [("noise critic", x["est"], x["corr"], x["sign"])]
            if "est_a" in x:
                rows.append(("Q^A", x["est_a"], x["corr_a"], x["sign_a"]))
            for critic, est, corr, sign in rows:
                table += (f"{head} {name}, {critic} | {x['true']:+.3f} ({x['true_se']:.3f}) | "
                          f"{x['true_pos'] * 100:.0f}% / {x['true_neg'] * 100:.0f}% | {est:+.3f} | {corr:+.2f} | "
                          f"{sign * 100:.0f}% |\n")
                print(table.splitlines()[-1], flush=True)
        dists.append(f"`{run}` {r['dist_pi']:.3f} / {r['dist_fit']:.3f}")
    note = (f"{a.advantage} episodes per run from `policies.eval`'s initial states (seed 12345), run by the actor's "
            "deterministic noise w_pi. At every query of a running episode: w_fit, the noise fitted to the scripted "
            "expert's next chunk (100 Adam steps from w_pi, within the run's bound b); w_rand = b tanh(u), u ~ N(0, I). "
            "True advantage: G(alternative's chunk, then the actor) - G(actor's chunk, then the actor), one rollout "
            "each to the episode's end from the same simulator state and generators, G the discounted return per "
            "decision with the run's reward and gamma; mean over queries, its standard error (queries taken as "
            "independent, which those of one episode are not: it is a lower bound), and the share of "
            "queries where it is positive / negative (zero: both rollouts end alike). Critic's estimate: "
            "Q(s, alternative) - Q(s, w_pi), min of the twin critics; noise critic: Q(s, w) (DSRL-SAC) or Q^W "
            "(DSRL-NA); Q^A: DSRL-NA's critic over the executed chunks. Correlation: Pearson's, over queries, of "
            "the estimate with the true advantage; sign agreement: over queries with a non-zero true advantage. "
            "Squared distance per action component of the actor's / w_fit's chunk to the expert's: "
            + "; ".join(dists) + ".")
    print(note)
    if not a.no_write:
        write_section("DSRL critic: does it see a decision's advantage?",
                      f"python -m benchmarks.dsrl_critic {' '.join(a.runs)} --advantage {a.advantage}",
                      table + "\n" + note, threads=1)


if __name__ == "__main__":
    main()
