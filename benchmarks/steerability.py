"""How much room does a diffusion base policy leave for steering its initial noise (DSRL)?

    python -m benchmarks.steerability <diffusion_bc run dir> [--draws 8] [--episodes 100] [--greedy 4 16]
        [--expert-match 4 16 64] [--expert-fit 100] [--fit-bounds 1.5 2 2.5 3] [--greedy-runs 3]

Every measure runs the frozen base on the same ``--episodes`` initial states and physics (one
evaluation seed, one episode per parallel env):

- w ~ N(0, I), once per draw (its own generator each time), and w = 0.
- Best of k draws: the fraction of initial states that succeed with at least one of the first k
  draws. This is not a measure of steering by itself: the observation noise differs between
  draws too (the environment's generator draws it, and episodes end at different times).
- The luck control: w = 0 in every run, with only the observation-noise stream changed (the
  environment's generator reseeded after the initial states are drawn). Its best of k is what
  chance alone gives; where it is close to the draws' best of k, those say little about steering.
- Where the noise decides, if anywhere: the same draws' first-query noise with w = 0 at every later
  query, and one draw held at every query of the episode. Best of k above the luck control's means
  the first decision's (or an episode-wide) noise chooses the outcome, which a steering policy
  could learn from the initial state alone.
- Greedy steering with a perfect one-chunk model (``--greedy K``): at every query, simulate K
  candidate noises (w = 0 and K - 1 draws) for one executed chunk from a saved simulator state, and
  execute the one with the best outcome (a success first, a failure last, else the most shaped
  progress: the task's dense reward terms other than success). A myopic heuristic with the true
  short-term effect of each noise, not an optimum: a far-sighted steering can do better, a
  learned one sees only the policy observation. Needs ``obs_source=state``. Which candidates are
  drawn changes the outcome a lot, so it runs ``--greedy-runs`` times with other candidate draws.
- Expert matching (``--expert-match K``): at every query, among the same kind of K candidates,
  execute the chunk closest (summed squared action difference) to what the task's scripted
  expert would do next from the true state (its own next chunk, simulated and undone). Can the
  base's noise reproduce the behaviour the demonstrations came from? Same candidate draws as the
  greedy runs. With ``--expert-fit S``, the noise is then optimised continuously towards the
  expert's chunk (S Adam steps through the DDIM sampler, w = b tanh(u) bounded like a DSRL
  actor's), starting from the closest candidate: what a steering actor with the expert as its
  target could reach at best, one query at a time.

Writes a section of BENCHMARKS.md.
"""

from __future__ import annotations

import argparse

import numpy as np
import torch
from omegaconf import OmegaConf

from benchmarks.common import load_run_policy, write_section
from policies.config import to_objects
from policies.evaluate import success_episodes
from sim.registry import get_task

SUCCESS = 1e3  # a one-chunk score that outranks any shaped progress of a chunk
FIT_CANDIDATES = 16  # the fitted noise starts from the closest of this many candidates
GREEDY_SEED = 3000  # greedy run r draws its candidates from a generator seeded GREEDY_SEED + r


def draw_candidates(k: int, n: int, latent_dim: int, gen: torch.Generator) -> torch.Tensor:
    """[k, n, latent] candidate noises per query: w = 0 first, then k - 1 draws of N(0, I)."""
    w = torch.randn(k, n, latent_dim, generator=gen)
    w[0] = 0.0
    return w


def episodes(base, task_cfg, n: int, seed: int, noise, stream: int | None = None, greedy: int = 0,
             greedy_gen: torch.Generator | None = None, record: list[dict] | None = None,
             match_expert: bool = False, fit_steps: int = 0, bound: float = 1.5,
             distances: list[float] | None = None) -> np.ndarray:
    """Success [n] of one episode per env. ``noise(obs)`` gives one query's noises [n, latent] from
    the observation dict (``policy``, ``critic``); ``stream`` reseeds the environment's generator
    after the reset (same initial states, other observation noise); ``greedy`` > 1 picks each
    query's noise among that many by simulating their chunks, and appends to ``record`` (if given)
    at every query, for the episodes still running: their observations, candidates [N, K, latent],
    scores [N, K] and env indices; with ``match_expert`` it picks the chunk closest to the scripted
    expert's own next chunk instead, then (``fit_steps`` > 0) fits that noise to it (:func:`fit_noise`,
    within [-bound, bound]) and appends the mean squared distance per action of the executed chunks
    of the running episodes to ``distances`` (if given)."""
    env = get_task(task_cfg.name).env_cls(task_cfg, n, device="cpu", seed=seed, backend="mujoco")
    obs, _ = env.reset(seed=seed)
    if stream is not None:
        env.gen.manual_seed(stream)

    def act(obs: dict, finished: torch.Tensor) -> torch.Tensor:
        if greedy <= 1:
            return base(obs["policy"], noise(obs))
        w = draw_candidates(greedy, n, base.latent_dim, greedy_gen)
        chunks = torch.stack([base(obs["policy"], w[k]) for k in range(greedy)])  # [K, n, H, A]
        if match_expert:
            target = expert_chunk(env, chunks.shape[2])
            best = (chunks - target).square().sum((2, 3)).argmin(0)  # [n] among the K candidates
            chunk = chunks[best, torch.arange(n)]
            if fit_steps > 0:
                chunk = base(obs["policy"], fit_noise(base, obs["policy"], target, w[best, torch.arange(n)], fit_steps,
                                                      bound))
            if distances is not None:
                distances.append((chunk - target)[~finished].square().mean().item())
            return chunk
        score = candidate_scores(env, chunks)
        if record is not None:
            alive = ~finished
            record.append({"policy": obs["policy"][alive], "critic": obs["critic"][alive],
                           "w": w[:, alive].transpose(0, 1), "env": torch.nonzero(alive).squeeze(1),
                           "score": torch.as_tensor(score[:, alive.numpy()].T, dtype=torch.float32)})
        return chunks[torch.as_tensor(score.argmax(0)), torch.arange(n)]

    with torch.no_grad():
        return success_episodes(env, obs, act)[0].numpy()


def candidate_scores(env, chunks: torch.Tensor) -> np.ndarray:
    """One-chunk outcome [K, n] of each candidate chunk [K, n, H, A] per env, simulated from the
    current state: the sum over the chunk's steps of the shaped progress (the task's dense reward
    terms other than success, each in [0, weight]), where the step that ends an episode adds
    SUCCESS for a success, -SUCCESS for a failure (e.g. the cube off the table) and 0 for a
    time-out instead, and later steps add nothing. A chunk's progress is far below SUCCESS / 2. The
    environment is left in the state it started in (ArmEnv.state_dict: simulator, episode
    counters, generators)."""
    if env.perception is not None:
        raise ValueError("the greedy oracle needs obs_source=state: the perception pipeline's state is not saved")
    saved, (k_cands, n) = env.state_dict(), chunks.shape[:2]
    score = np.zeros((k_cands, n))
    for k in range(k_cands):
        env.load_state_dict(saved)
        ended = np.zeros(n, bool)
        for j in range(chunks.shape[2]):
            _, _, term, trunc, info = env.step(chunks[k, :, j])
            success, done = info["success"].numpy(), (term | trunc).numpy()
            terms = env.reward_terms(env.success())  # of the next episode where one ended: masked below
            progress = sum(v for name, v in terms.items() if name != "success")
            outcome = np.where(success, SUCCESS, np.where(term.numpy(), -SUCCESS, np.where(done, 0.0, progress)))
            score[k] += np.where(ended, 0.0, outcome)
            ended |= done
    env.load_state_dict(saved)
    return score


def expert_chunk(env, h: int) -> torch.Tensor:
    """The scripted expert's next ``h`` actions [n, h, A] from the current true state, simulated and
    undone. Its phase machine is first advanced on the current state and keeps that advance (the
    base never reads it): the expert then plans from where the episode really is."""
    env.expert()
    saved = env.state_dict()
    actions = []
    for _ in range(h):
        actions.append(env.expert_action())
        env.step(actions[-1])
    env.load_state_dict(saved)
    return torch.stack(actions, 1)


def fit_noise(base, obs: torch.Tensor, target: torch.Tensor, w0: torch.Tensor, steps: int, bound: float,
              lr: float = 0.1) -> torch.Tensor:
    """Noise w [n, latent] in [-bound, bound] whose executed chunk base(obs, w) is closest (squared
    error) to ``target`` [n, H, A]: ``steps`` Adam steps on u, w = bound tanh(u), from w0 clipped
    into the bound. Keeps, per env, the better of the start and the result."""
    def error(w: torch.Tensor) -> torch.Tensor:
        return (base(obs, w) - target).square().sum((1, 2))

    w_start = w0.clamp(-0.99 * bound, 0.99 * bound)
    u = torch.atanh(w_start / bound).requires_grad_(True)
    opt = torch.optim.Adam([u], lr=lr)
    with torch.enable_grad():
        for _ in range(steps):
            opt.zero_grad()
            error(bound * torch.tanh(u)).sum().backward(inputs=[u])  # each env's u sees only its own error
            opt.step()
    w = (bound * torch.tanh(u)).detach()
    return torch.where((error(w) < error(w_start))[:, None], w, w_start)


def best_of_k(s: np.ndarray) -> list[float]:
    """[draws, episodes] successes -> fraction of episodes with a success among the first k draws."""
    return [float(s[: k + 1].any(0).mean()) for k in range(len(s))]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("run", help="run directory of an algo=diffusion_bc run")
    ap.add_argument("--draws", type=int, default=8)
    ap.add_argument("--episodes", type=int, default=100)
    ap.add_argument("--greedy", type=int, nargs="*", default=[4, 16], help="candidate noises per query")
    ap.add_argument("--expert-match", type=int, nargs="*", default=[4, 16, 64],
                    help="candidate noises per query for the choice closest to the scripted expert")
    ap.add_argument("--expert-fit", type=int, default=100,
                    help="Adam steps fitting the noise to the expert's chunk (from the closest of 16 candidates)")
    ap.add_argument("--fit-bounds", type=float, nargs="*", default=[1.5, 2.0, 2.5, 3.0],
                    help="noise bounds b of the fitted noise (DSRL's default is 1.5)")
    ap.add_argument("--greedy-runs", type=int, default=3,
                    help="greedy and expert-matching runs per candidate count (other draws)")
    ap.add_argument("--seed", type=int, default=12345, help="evaluation seed: fixes the initial states")
    ap.add_argument("--no-write", action="store_true")
    a = ap.parse_args()
    torch.set_num_threads(1)
    base, rec = load_run_policy(a.run, "DiffusionPolicy", "algo=diffusion_bc")
    task_cfg, _ = to_objects(OmegaConf.create(rec["config"]))

    def zeros(obs: dict) -> torch.Tensor:
        return torch.zeros(len(obs["policy"]), base.latent_dim)

    def run(noise, **kw) -> np.ndarray:
        return episodes(base, task_cfg, a.episodes, a.seed, noise, **kw)

    def first_query(w: torch.Tensor):
        """w [n, latent] at the episodes' first query, w = 0 at every later one."""
        queries = []

        def noise(obs: dict) -> torch.Tensor:
            queries.append(1)
            return w if len(queries) == 1 else zeros(obs)
        return noise

    zero = run(zeros)
    draws, first, held, luck = [], [], [], []
    for k in range(a.draws):
        gen = torch.Generator().manual_seed(1000 + k)
        draws.append(run(lambda obs, g=gen: torch.randn(len(obs["policy"]), base.latent_dim, generator=g)))
        w = torch.randn(a.episodes, base.latent_dim, generator=gen.manual_seed(1000 + k))  # the draws' first noise
        first.append(run(first_query(w)))
        held.append(run(lambda obs, w=w: w))
        luck.append(run(zeros, stream=2000 + k))
        print(f"draw {k}: {draws[-1].mean() * 100:.0f}%, its first noise only {first[-1].mean() * 100:.0f}%, held "
              f"{held[-1].mean() * 100:.0f}%, w = 0 with noise stream {k}: {luck[-1].mean() * 100:.0f}%", flush=True)
    greedy: dict[int, list[float]] = {}
    for k in a.greedy:
        for r in range(a.greedy_runs):
            gen = torch.Generator().manual_seed(GREEDY_SEED + r)
            greedy.setdefault(k, []).append(run(zeros, greedy=k, greedy_gen=gen).mean())
            print(f"greedy among {k}, run {r}: {greedy[k][-1] * 100:.0f}%", flush=True)
    base.requires_grad_(False)  # frozen: fit_noise differentiates through it with respect to w only
    # (K candidates, bound b of the fitted noise or None: no fit) -> successes, distances per run
    matched: dict[tuple[int, float | None], tuple[list[float], list[float]]] = {}
    for k, bound in [(k, None) for k in a.expert_match] + [(FIT_CANDIDATES, b) for b in a.fit_bounds]:
        fit = {} if bound is None else {"fit_steps": a.expert_fit, "bound": bound}
        for r in range(a.greedy_runs):
            gen, dist = torch.Generator().manual_seed(GREEDY_SEED + r), []
            ok = run(zeros, greedy=k, greedy_gen=gen, match_expert=True, distances=dist, **fit)
            rates, dists = matched.setdefault((k, bound), ([], []))
            rates.append(ok.mean())
            dists.append(float(np.mean(dist)))
            print(f"closest to the expert among {k}" + (f", fitted in [-{bound}, {bound}]" if bound is not None else "")
                  + f", run {r}: {rates[-1] * 100:.0f}%, squared distance per action {dists[-1]:.3f}", flush=True)
    s, z = np.array(draws), np.array(luck)
    cols = [s, np.array(first), np.array(held), z]
    shown = [k for k in range(a.draws) if k + 1 in (1, 2, 4, 8, 16, 32) or k + 1 == a.draws]
    pct = lambda v: f"{v * 100:.0f}%"  # noqa: E731
    table = ("| measure | w ~ N(0, I) draws | the draw's first noise, then w = 0 | the draw's first noise held "
             "| w = 0, other observation noise (luck control) |\n|---|---:|---:|---:|---:|\n"
             f"| mean over {a.draws} runs (min-max) | "
             + " | ".join(f"{pct(c.mean())} ({pct(c.mean(1).min())}-{pct(c.mean(1).max())})" for c in cols) + " |\n"
             + "".join(f"| some run among the first {k + 1} succeeds | "
                       + " | ".join(pct(best_of_k(c)[k]) for c in cols) + " |\n" for k in shown))
    greedy_rows = "".join(f"| greedy steering among {k} noises per query (true one-chunk outcomes): mean of "
                          f"{len(v)} runs (min-max) | {pct(np.mean(v))} ({pct(min(v))}-{pct(max(v))}) | |\n"
                          for k, v in greedy.items())
    for (k, bound), (v, dist) in matched.items():
        how = (f"the noise fitted to the scripted expert's next chunk in {a.expert_fit} Adam steps from the closest "
               f"of {k}, w in [-{bound:g}, {bound:g}]" if bound is not None else
               f"chunk closest to the scripted expert's next chunk among {k} noises per query")
        greedy_rows += (f"| {how}: mean of {len(v)} runs (min-max) | {pct(np.mean(v))} ({pct(min(v))}-{pct(max(v))}) "
                        f"| {np.mean(dist):.3f} |\n")
    body = (f"Base: `{a.run}` ({task_cfg.name}), {a.episodes} initial states (evaluation seed {a.seed}).\n\n"
            f"| measure | success | squared distance per action to the expert's |\n|---|---:|---:|\n"
            f"| base, w = 0 | {pct(zero.mean())} | |\n{greedy_rows}\n{table}\n"
            f"Initial states by the number of successful runs (0..{a.draws}): draws "
            f"{', '.join(map(str, np.bincount(s.sum(0), minlength=a.draws + 1)))}; luck control "
            f"{', '.join(map(str, np.bincount(z.sum(0), minlength=a.draws + 1)))}.\n\n"
            "The 'some run' rows are best-of-k oracles over whole episodes. The luck control keeps w = 0 and "
            "changes only the observation noise: where its best of k is close to the draws', the draws' "
            "best of k measures how sensitive the outcome is to any perturbation, not how much choosing the "
            "noise can gain. The first-noise and held columns use each draw's first noise only at the first "
            "query (w = 0 after) or at every query: a best of k above the luck control's means that noise, "
            "chosen once from the initial state, decides the outcome. The greedy rows choose the noise at every query by simulating each candidate's "
            "chunk from the true simulator state (a success first, a failure last, else the most shaped "
            "progress): a myopic measure of what the base's noise can steer one decision at a time, not an "
            "optimum and not a learned policy. The expert rows choose, among candidates drawn the same way, "
            "the chunk closest to the scripted expert's own next chunk from the true state (summed squared "
            "action difference): whether the base's noise can reproduce the behaviour of the demonstrator. "
            "The fitted rows then optimise that noise towards the expert's chunk through the DDIM sampler, "
            "bounded to [-b, b] as a DSRL actor's noise is (b tanh(u)): what a steering with the expert as "
            "its target reaches for each bound. Distance: mean over queries and running episodes of the "
            "executed chunk's squared difference to the expert's, per action component.")
    print(body)
    if not a.no_write:
        write_section(f"Diffusion base: room for steering ({task_cfg.name})",
                      f"python -m benchmarks.steerability {a.run} --draws {a.draws} --episodes {a.episodes} "
                      f"--greedy {' '.join(map(str, a.greedy))} --expert-match {' '.join(map(str, a.expert_match))} "
                      f"--expert-fit {a.expert_fit} --fit-bounds {' '.join(f'{b:g}' for b in a.fit_bounds)} "
                      f"--greedy-runs {a.greedy_runs} --seed {a.seed}", body)


if __name__ == "__main__":
    main()
