"""Manipulation learning curves: success rate vs environment steps of the diffusion base policy
(w ~ N(0, I), and from w = 0, where DSRL's untrained actor starts), DSRL-NA, DSRL-SAC and SAC from
scratch, plus wall time per 1k env steps.

    python -m benchmarks.manipulation [--tasks arm_push arm_pick_place] [--methods dsrl_sac dsrl_na sac_matched]
        [--seeds 0 1 2] [--steps 50000] [--eval-every 10000] [--episodes 100] [--demos 20] [--noise 0.3]
        [--bc-steps 10000] [--chunk H] [--threads 1] [--worse-share 0]

Per task: collect ``--demos`` scripted-expert episodes at ``--noise`` (a deliberately small,
noisy dataset), train one diffusion base policy on it (seed 0; ``--chunk H``: H actions predicted
and executed per query instead of diffusion_bc's default), then run every method for every
seed with ``policies.train`` and read the evaluations from each run's results.json. The base
policy's curves are flat: it is evaluated with ``--episodes`` episodes once per seed, from w ~ N(0, I)
and from w = 0. Writes
``benchmarks/results/<task>_success_<date>.png`` (``_2``, ``_3``, ... after the day's first) and
one section of BENCHMARKS.md per task.

With ``--worse-share S`` > 0 (arm_push), a share S of the demonstrations comes from the task's worse
operator instead (``expert_worse_share`` in sim/arm/push.py): a base whose noise chooses between two
behaviours rather than only its jitter around one. Its runs, plot and section are separate
(``<task>_worse<S>``, section "Manipulation: <task> from mixed demonstrators").

Runs are cached: a dataset, base or method run whose output already exists under ``--work`` is
read, not repeated (delete its directory to run it again), so a table can combine runs made at
different revisions; the section says which revision wrote it. A cached run made with other settings
than this command's (its saved config; the dataset's size and noise) stops the benchmark instead.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from datetime import date
from pathlib import Path

import numpy as np

from benchmarks.common import write_section

ROOT = Path(__file__).resolve().parents[1]
OUT = ROOT / "benchmarks" / "results"
METHODS = {  # method -> policies.train overrides (besides task, seed, budgets)
    "dsrl_sac": ["algo=dsrl", "algo.variant=sac"],
    "dsrl_na": ["algo=dsrl", "algo.variant=na"],
    # SAC's entropy bonus instead of the noise prior (policies/dsrl.py, DSRLConfig.noise_prior), which
    # keeps the actor near w = 0: without it DSRL-NA learned on arm_reach and lost on arm_push (BENCHMARKS.md)
    "dsrl_sac_noprior": ["algo=dsrl", "algo.variant=sac", "algo.noise_prior=false"],
    "dsrl_na_noprior": ["algo=dsrl", "algo.variant=na", "algo.noise_prior=false"],
    # TD targets over 3 decisions: ahead of dsrl_na_noprior on every arm_reach seed at 50k steps, behind
    # it at 150k (BENCHMARKS.md)
    "dsrl_na_noprior_n3": ["algo=dsrl", "algo.variant=na", "algo.noise_prior=false", "algo.n_step=3"],
    # DSRL-NA with the noise bound at which a noise fitted to the scripted expert's chunks passes 90 %
    # on arm_pick_place (against 71 % within the default 1.5; benchmarks.steerability, BENCHMARKS.md)
    "dsrl_na_b3": ["algo=dsrl", "algo.variant=na", "algo.noise_bound=3.0"],
    # DSRL-NA whose TD targets continue with the deployed noise b tanh(mu(s')), not a sampled one
    "dsrl_na_deployed": ["algo=dsrl", "algo.variant=na", "algo.bootstrap_noise=deployed"],
    "dsrl_sac_deployed": ["algo=dsrl", "algo.variant=sac", "algo.bootstrap_noise=deployed"],
    # DSRL-NA with the base's own demonstrations as ordinary entries of Q^A's buffer ({data}: the
    # task's dataset under --work), as DSRL's best Robomimic figures are
    "dsrl_na_demos": ["algo=dsrl", "algo.variant=na", "algo.demos={data}"],
    "dsrl_na_noprior_demos": ["algo=dsrl", "algo.variant=na", "algo.noise_prior=false", "algo.demos={data}"],
    "sac": ["algo=sac"],  # SAC's defaults, the quadrotor's (the tables before 2026-11-25 ran these)
    # SAC from scratch with DSRL's budget and networks: one update per decision of the base's chunk
    # (H env steps; 8 envs, 8 / H updates per iteration), batch 256, 256x256 networks, LayerNorm
    # critics, learning rates 3e-4, 2000 warm-up steps, and DSRL's discount of 0.99 per decision as
    # 0.99^(1/H) per step (H = 4: 2 updates per iteration, 0.9975). See method_overrides.
    "sac_matched": ["algo=sac", "algo.num_envs=8", "algo.updates_per_iteration={sac_updates}", "algo.batch_size=256",
            "algo.warmup_steps=2000", "algo.actor_hidden=[256,256]", "algo.critic_hidden=[256,256]",
            "algo.critic_layer_norm=true", "algo.actor_lr=3e-4", "algo.critic_lr=3e-4", "algo.alpha_lr=3e-4",
            "algo.gamma={sac_gamma}"],
}
DEFAULT_METHODS = ["dsrl_sac", "dsrl_na", "sac_matched"]
COLORS = ("tab:blue", "tab:orange", "tab:green", "tab:purple", "tab:brown", "tab:pink", "tab:olive", "tab:cyan")


def method_overrides(method: str, data, chunk: int | None) -> list[str]:
    """``METHODS[method]`` for a task: ``{data}`` its dataset; sac_matched's updates and discount
    matched to one DSRL decision of ``chunk`` env steps (None: diffusion_bc's default chunk)."""
    from policies.diffusion import DiffusionBCConfig

    h = DiffusionBCConfig().exec_horizon if chunk is None else chunk
    if method == "sac_matched" and 8 % h:
        raise SystemExit(f"error: sac_matched makes 8 / H updates per iteration of its 8 envs; --chunk {h} does not "
                         "divide 8")
    return [o.format(data=data, sac_updates=8 // h, sac_gamma=f"{0.99 ** (1 / h):.4f}") for o in METHODS[method]]


def check_steered_base(run: Path, digest: str) -> None:
    """Stop if the cached DSRL run ``run`` steered another base than the one of ``digest`` (its
    weights): the run directory names only the base's path, which a rebuilt base keeps."""
    import torch

    from policies import checkpoint as ckpt

    steered = torch.load(run / ckpt.LAST, map_location="cpu", weights_only=False)["algo"]["base_digest"]
    if steered != digest:
        raise SystemExit(f"error: {run} steered another base than the one now at its algo.base: delete it to run it "
                         "again")


def train(args: list[str], log: Path) -> dict:
    log.parent.mkdir(parents=True, exist_ok=True)
    with open(log, "w") as f:
        rc = subprocess.run([sys.executable, "-m", "policies.train", *args, "progress=false"], cwd=ROOT, stdout=f,
                            stderr=subprocess.STDOUT).returncode
    run_dir = next(a.split("=", 1)[1] for a in args if a.startswith("run_dir="))
    path = Path(run_dir) / "results.json"
    if not path.is_file():
        raise RuntimeError(f"training failed (rc {rc}), see {log}")
    return json.loads(path.read_text())


def cached(run: Path, args: list[str]) -> dict | None:
    """The results of ``run`` if it was made with exactly ``args`` (its saved config against the one
    they compose, the run directory aside), None if it does not exist; a run of other settings
    stops the benchmark with one line, so that its numbers never go out under this command."""
    if not (run / "results.json").is_file():
        return None
    from omegaconf import OmegaConf

    from policies.config import compose_config, diff_keys

    want = OmegaConf.to_container(compose_config([*args, "progress=false"]))
    have = OmegaConf.to_container(OmegaConf.load(run / "config.yaml"))
    differ = [k for k in diff_keys(want, have) if k not in ("run_dir", "progress", "log_every_seconds")]  # not results
    if differ:
        raise SystemExit(f"error: {run} was made with other settings ({', '.join(differ)}): delete it or give "
                         f"another --work")
    return json.loads((run / "results.json").read_text())


def base_args(task: str, data: Path, run: Path, a) -> list[str]:
    """policies.train settings of the task's diffusion base (seed 0); ``a.chunk`` actions per query
    (its pred_horizon and exec_horizon), or the algorithm's default if None."""
    chunk = [] if a.chunk is None else [f"algo.pred_horizon={a.chunk}", f"algo.exec_horizon={a.chunk}"]
    return [f"task={task}", "algo=diffusion_bc", f"algo.dataset={data}", f"algo.gradient_steps={a.bc_steps}", *chunk,
            f"run_dir={run}", "seed=0", "stop_at_success=0", f"eval_episodes={a.episodes}", f"threads={a.threads}"]


def base_policy(task: str, work: Path, a) -> tuple[Path, dict]:
    data = work / "data"
    worse = [f"task.expert_worse_share={a.worse_share}"] if a.worse_share > 0 else []
    if not (data / "meta.json").is_file():
        subprocess.run([sys.executable, "-m", "policies.collect", f"task={task}", f"episodes={a.demos}",
                        f"noise={a.noise}", "seed=0", f"out={data}", "progress=false", *worse], cwd=ROOT, check=True)
    meta = json.loads((data / "meta.json").read_text())
    if (meta["episodes"], meta["expert_noise"]) != (a.demos, a.noise):
        raise SystemExit(f"error: {data} holds {meta['episodes']} demonstrations at noise {meta['expert_noise']}, "
                         f"not --demos {a.demos} --noise {a.noise}: delete it or give another --work")
    # ... of today's task settings, --worse-share's expert_worse_share among them: a dataset of another time limit,
    # randomization or operator mix is not this command's
    from omegaconf import OmegaConf

    from policies.config import compose_config, diff_keys

    want = OmegaConf.to_container(compose_config([f"task={task}", *worse]).task, resolve=True)
    differ = diff_keys(want, meta.get("task_config", {}))
    if differ:
        raise SystemExit(f"error: {data} was collected with other task settings ({', '.join(differ)}): delete it or "
                         f"give another --work")
    run = work / "base"
    args = base_args(task, data, run, a)
    if cached(run, args) is None:
        train(args, work / "base.log")
    return run, meta


def new_path(path: Path) -> Path:
    """``path``, or if it exists the first of ``<stem>_2<suffix>``, ``<stem>_3<suffix>``, ... that does not."""
    candidate, n = path, 1
    while candidate.exists():
        n += 1
        candidate = path.with_stem(f"{path.stem}_{n}")
    return candidate


def training_seconds(res: dict) -> float:
    """Wall time of a run's training alone: its training clock (stamped after each iteration, so it
    holds every evaluation but the last, which ran after the last stamp) minus those evaluations."""
    durations = [e.get("eval_duration_s") for e in res["evals"]]
    if None in durations:
        raise SystemExit(f"error: {res['run_dir']} is from before evaluations were timed one by one: delete it to "
                         "run it again")
    return res["train_seconds"] - sum(durations[:-1])


def evaluate_base(policy, rec: dict, seeds: list[int], episodes: int) -> tuple[list[float], list[float]]:
    """The base's (``policy`` and its run record, ``checkpoint.load_policy``) success rates on the
    episodes of each evaluation seed, with w ~ N(0, I) (the base policy) and from w = 0 (its most
    likely chunks, where DSRL's untrained actor starts)."""
    import torch
    from omegaconf import OmegaConf

    from policies.config import to_objects
    from policies.eval import with_base_noise
    from policies.evaluate import evaluate_success

    task_cfg, _ = to_objects(OmegaConf.create(rec["config"]))
    with torch.no_grad():
        return tuple([evaluate_success(with_base_noise(policy, noise), task_cfg, episodes, seed=20_000 + s).success_rate
                      for s in seeds] for noise in ("normal", "zero"))


def plot(task: str, curves: dict, base: list[float], base_zero: list[float], steps: int, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.2))
    ax.axhspan(min(base), max(base), color="gray", alpha=0.2)
    ax.axhline(np.mean(base), color="gray", ls="--", label=f"base, w ~ N(0, I) ({np.mean(base) * 100:.0f}%)")
    ax.axhspan(min(base_zero), max(base_zero), color="black", alpha=0.08)
    ax.axhline(np.mean(base_zero), color="black", ls="-.", lw=1,
               label=f"base, w = 0 ({np.mean(base_zero) * 100:.0f}%)")
    for (name, runs), color in zip(curves.items(), COLORS):
        xs = {tuple(e["env_steps"] for e in r["evals"]) for r in runs}
        if len(xs) != 1:
            raise SystemExit(f"error: the {name} runs were evaluated at different steps: {sorted(xs)}")
        x = np.array(xs.pop())
        ys = np.array([[e["success_rate"] for e in r["evals"]] for r in runs])
        ax.plot(x, ys.mean(0), color=color, lw=2, label=f"{name} (mean of {len(runs)} seeds)")
        ax.fill_between(x, ys.min(0), ys.max(0), color=color, alpha=0.2)
    ax.axhline(0.9, color="tab:red", lw=0.8, ls=":", label="target 90%")
    ax.set(xlabel="environment steps", ylabel="success rate", ylim=(-0.02, 1.02), xlim=(0, steps * 1.02), title=task)
    ax.legend(loc="lower right", fontsize=8)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main() -> None:
    from policies import checkpoint as ckpt
    from policies.dsrl import weights_digest

    ap = argparse.ArgumentParser()
    ap.add_argument("--tasks", nargs="+", default=["arm_push", "arm_pick_place"])
    ap.add_argument("--methods", nargs="+", default=DEFAULT_METHODS, choices=list(METHODS))
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    ap.add_argument("--steps", type=int, default=50_000)
    ap.add_argument("--eval-every", type=int, default=10_000)
    ap.add_argument("--episodes", type=int, default=100)
    ap.add_argument("--demos", type=int, default=20)
    ap.add_argument("--noise", type=float, default=0.3)
    ap.add_argument("--bc-steps", type=int, default=10_000)
    ap.add_argument("--chunk", type=int, default=None,
                    help="actions per query of the diffusion base (its pred_horizon and exec_horizon; default: "
                         "diffusion_bc's)")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--worse-share", type=float, default=0.0,
                    help="share of the demonstrations by the task's worse operator (arm_push)")
    ap.add_argument("--work", default=str(ROOT / "runs" / "bench_manipulation"))
    ap.add_argument("--no-write", action="store_true")
    a = ap.parse_args()
    note = ("Success at 0 steps is the untrained steering actor, whose deterministic noise is about w = 0 "
            "(the base's most likely chunk), not the base with w ~ N(0, I); the base (w = 0) rows evaluate the base "
            "from w = 0 on the episodes of its w ~ N(0, I) rows. The base rows are one base (trained with seed 0), "
            "their seed the evaluation episodes' (those of the DSRL runs of that seed). "
            f"Wall time per 1k env steps is training time without evaluations (it holds the checkpoint writes), on "
            f"{a.threads} thread(s). The target "
            "(from the issue): from a 30-50 % base to >= 90 % within 50k environment steps. Published "
            "reference: DSRL-NA on Robomimic Can from a 40 % base reaches about 65-75 % after 150-300k steps "
            "without demonstrations (Wagenmaker et al. 2025, independent reproduction).")
    if len(set(a.methods)) != len(a.methods) or len(a.methods) > len(COLORS):
        ap.error(f"--methods: give each method once, at most {len(COLORS)} (one plot colour each)")
    mixed = a.worse_share > 0
    if mixed and set(a.tasks) != {"arm_push"}:
        ap.error("--worse-share: only arm_push has a worse operator (expert_worse_share); give --tasks arm_push")
    for task in a.tasks:
        name = f"{task}_worse{a.worse_share:g}" if mixed else task
        work = Path(a.work) / name
        base_run, meta = base_policy(task, work, a)
        base_net, base_rec = ckpt.load_policy(base_run)
        base, base_zero = evaluate_base(base_net, base_rec, a.seeds, a.episodes)
        base_digest = weights_digest(base_net)
        print(f"{task}: base success {base}, at w = 0 {base_zero}", flush=True)
        curves, rows = {}, []
        for m in a.methods:
            curves[m] = []
            for seed in a.seeds:
                run = work / f"{m}_seed{seed}"
                overrides = method_overrides(m, work / "data", a.chunk)
                args = [f"task={task}", *overrides, f"seed={seed}", f"run_dir={run}", f"max_env_steps={a.steps}",
                        f"eval_every_steps={a.eval_every}", f"eval_episodes={a.episodes}", "eval_at_start=true",
                        "stop_at_success=0", f"threads={a.threads}", "max_seconds=3600"]
                if m.startswith("dsrl"):
                    args.append(f"algo.base={base_run}")
                res = cached(run, args)
                if res is not None and m.startswith("dsrl"):
                    check_steered_base(run, base_digest)
                res = res or train(args, work / f"{m}_seed{seed}.log")
                if res["env_steps"] < a.steps:
                    raise SystemExit(f"error: {run} stopped at {res['env_steps']} env steps, before --steps {a.steps} "
                                     f"(its max_seconds=3600?): delete it to run it again")
                curves[m].append(res)
                train_s = training_seconds(res)
                rows.append((m, seed, res["evals"][0]["success_rate"], res["evals"][-1]["success_rate"],
                             max(e["success_rate"] for e in res["evals"]), 1000 * train_s / res["env_steps"]))
                print(task, rows[-1], flush=True)
        # a new file: the sections of earlier runs (the same day's too) keep showing their own curves;
        # --no-write leaves the repo's results alone
        png = new_path((work if a.no_write else OUT) / f"{name}_success_{date.today():%Y%m%d}.png")
        plot(task, curves, base, base_zero, a.steps, png)
        table = ("| method | seed | success at 0 steps | success at the end | best evaluation "
                 "| wall time per 1k env steps [s] |\n|---|---:|---:|---:|---:|---:|\n")
        table += "".join(f"| base (w ~ N(0, I)) | {s} | - | {b * 100:.0f}% | - | - |\n" for s, b in zip(a.seeds, base))
        table += "".join(f"| base (w = 0) | {s} | - | {b * 100:.0f}% | - | - |\n" for s, b in zip(a.seeds, base_zero))
        table += "".join(f"| {m} | {s} | {z * 100:.0f}% | {e * 100:.0f}% | {b * 100:.0f}% | {w:.2f} |\n"
                         for m, s, z, e, b, w in rows)
        shown = {m: " ".join(method_overrides(m, "<work>/<task>/data", a.chunk)) for m in a.methods}
        body = ("Methods: " + "; ".join(f"{m}: `{shown[m]}`" for m in a.methods)
                + f"\n\nDataset: {meta['episodes']} expert episodes at noise {meta['expert_noise']} "
                + f"({meta['successes']} successful"
                + (f"; a share {a.worse_share:g} of them by the worse operator" if mixed else "")
                + f"). Base: diffusion_bc, {a.bc_steps} gradient steps"
                + ("" if a.chunk is None else f", chunks of {a.chunk} actions (predicted and executed per query)")
                + ". "
                f"{a.episodes} evaluation episodes per point, every {a.eval_every} env steps.\n\n"
                f"![{task}](benchmarks/results/{png.name})\n\n{table}\n{note}")
        if not a.no_write:  # one section per task: a run of one task leaves the others' results alone
            cmd = (f"python -m benchmarks.manipulation --tasks {task} --methods {' '.join(a.methods)} "
                   f"--seeds {' '.join(map(str, a.seeds))} --steps {a.steps} --eval-every {a.eval_every} "
                   f"--episodes {a.episodes} --demos {a.demos} --noise {a.noise} --bc-steps {a.bc_steps} "
                   f"--threads {a.threads}" + (f" --worse-share {a.worse_share:g}" if mixed else "")
                   + ("" if a.chunk is None else f" --chunk {a.chunk}"))
            write_section(f"Manipulation: {task}" + (" from mixed demonstrators" if mixed else ""), cmd, body,
                          threads=a.threads)


if __name__ == "__main__":
    main()
