"""Evaluate a trained run: ``python -m policies.eval <run_dir> [backend=torch|mujoco|pybullet]
[episodes=100] [video=true] [plot=false] [seed=12345] [device=cpu] [effects=ground_effect,drag]
[obs_source=state|perception] [base_noise=normal|zero] [task.<field>=value ...]``.

Quadrotor tasks: prints the hover criterion's success rate and errors, writes eval_<backend>.json,
a plot of position error over time (PNG) and optionally a GIF of a few episodes rendered
offscreen with MuJoCo, all into the run directory. Manipulation tasks (MuJoCo only): the task
success rate over ``episodes`` episodes and, where the task names milestones (arm_pick_place: grasped,
lifted, over the goal), its failed episodes counted by the furthest one reached, written to
eval_mujoco.json, a plot of the distance the task's success bounds (the TCP's to the goal for arm_reach,
the cube's, horizontally, for arm_push and arm_pick_place) over time against the success radius
(eval_mujoco_distance.png), and optionally a GIF of the
first episodes seen by the front camera; ``obs_source=perception`` runs the policy from the depth
camera's cube estimate instead of the simulator's (whatever it was trained on), written to
eval_mujoco_perception.json (and .gif). ``base_noise=zero`` runs a diffusion base (an algo=diffusion_bc
run) from the initial noise w = 0 at every query, its most likely chunks and where DSRL's untrained
actor starts, instead of the base policy's own w ~ N(0, I) (``normal``, the default); its results go
to files ending in ``_w0``. Another number of ``episodes`` than the default 100 adds ``_episodes<N>``
and an evaluation ``seed`` other than the default 12345 adds ``_seed<N>`` to the file names, so
evaluations of other episodes sit beside the default one; every result records its seed.
``effects=`` (PyBullet's optional aerodynamics instead of the run's) writes ``eval_pybullet_effects-<names>*``
(e.g. ``_effects-ground_effect+drag``), which lists them.

``task.<field>=value`` evaluates under another setting of the run's task config (e.g.
``task.randomization.max_latency_steps=2``); the results then go to ``eval_<...>_overrides-<digest>.json``
(8 hex digits of the sorted overrides, so that other overrides write other files; and .png, .gif;
``..._w0.json`` with ``base_noise=zero``), which lists the overrides under ``task_overrides``. Quadrotor tasks: the hover
criterion's conditions (initial states, randomization, noise) are the task's defaults whatever the
run trained with; these overrides change them too, so the result is a judge by the criterion's
bounds under those conditions, no longer the criterion (its termination distance, episode length,
``randomization.hard_fraction`` and ``randomization.latency_margin`` stay fixed and cannot be
overridden). The task itself (``task.name``) is the run's.
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
from pathlib import Path
from typing import Callable

import numpy as np
import torch
from omegaconf import OmegaConf

from sim.crazyflie.hover import POLICY_PERIOD, PYBULLET_EFFECTS
from sim.registry import get_task

from . import checkpoint as ckpt
from .config import UserError, check_device, check_finite, exit_code, help_requested, ieee_float32_on, to_objects
from .evaluate import (CRITERION_FIXED, EPISODE_SECONDS, LAST_SECONDS, MEAN_ERROR_LAST_2S, SUCCESS_RATE_REQUIRED,
                       EvalResult, SuccessResult, criterion_config, evaluate_hover, evaluate_success)

OPTIONS = {"backend": str, "episodes": int, "video": bool, "plot": bool, "seed": int, "device": str, "effects": str,
           "obs_source": str, "base_noise": str}
DEFAULTS = {"backend": None, "episodes": 100, "video": False, "plot": True, "seed": 12345, "device": "cpu",
            "effects": None,  # PyBullet's optional aerodynamics, comma-separated (default: the run's)
            "obs_source": None,  # manipulation: state or perception (default: the run's)
            "base_noise": "normal"}  # a diffusion base's initial noise: normal (w ~ N(0, I)) or zero


def parse(argv: list[str]) -> tuple[Path, dict]:
    if not argv or "=" in argv[0]:
        raise UserError("usage: python -m policies.eval <run_dir> [backend=torch|mujoco|pybullet] [episodes=N] "
                        "[video=true] [plot=false] [seed=N] [device=cpu|cuda] [effects=ground_effect,drag,...] "
                        "[obs_source=state|perception] [base_noise=normal|zero] [task.<field>=value ...]")
    opts = dict(DEFAULTS, task_overrides=[])
    for a in argv[1:]:
        k, _, v = a.partition("=")
        if k.startswith("task.") and _:
            if k == "task.name":
                raise UserError(f"override '{a}': the task is the run's; evaluate a run of that task instead")
            opts["task_overrides"].append(a)
            continue
        if k not in OPTIONS or not _:
            raise UserError(f"unknown option '{a}': expected key=value with key in {', '.join(OPTIONS)}, "
                            "or task.<field>=value")
        try:
            opts[k] = {"true": True, "false": False}[v.lower()] if OPTIONS[k] is bool else OPTIONS[k](v)
        except (KeyError, ValueError):
            raise UserError(f"option {k}={v}: expected a value of type {OPTIONS[k].__name__}") from None
    check_device(opts["device"])
    if opts["episodes"] < 1:
        raise UserError(f"episodes={opts['episodes']}: expected at least 1")
    if opts["base_noise"] not in ("normal", "zero"):
        raise UserError(f"base_noise={opts['base_noise']}: expected normal (w ~ N(0, I)) or zero (w = 0)")
    if opts["backend"] not in (None, "torch", "mujoco", "pybullet"):
        raise UserError(f"backend={opts['backend']}: expected one of torch, mujoco, pybullet")
    if opts["effects"] is not None:
        opts["effects"] = [e for e in opts["effects"].split(",") if e]
        if opts["backend"] != "pybullet" or any(e not in PYBULLET_EFFECTS for e in opts["effects"]):
            raise UserError(f"effects={','.join(opts['effects'])}: expected any of {', '.join(PYBULLET_EFFECTS)} "
                            "with backend=pybullet")
    return Path(argv[0]), opts


def with_base_noise(policy: Callable, base_noise: str) -> Callable:
    """``policy`` as evaluated: a diffusion base (one that takes its initial noise) from w = 0 at every
    query if ``base_noise`` is "zero"; any policy unchanged for "normal"."""
    if base_noise == "normal":
        return policy
    if not getattr(policy, "takes_noise", False):
        raise UserError("base_noise applies to a diffusion base (an algo=diffusion_bc run); this run's policy takes "
                        "no initial noise (for a DSRL run, evaluate its algo.base)")
    return lambda obs: policy(obs, torch.zeros(len(obs), policy.latent_dim, device=obs.device))


def override_task(task_cfg, overrides: list[str]):
    """The run's task config with ``task.<field>=value`` overrides applied, typed by the task's
    config class; an unknown field or a value of the wrong type raises UserError naming it."""
    if not overrides:
        return task_cfg
    cfg = OmegaConf.structured(task_cfg)
    for o in overrides:
        key, _, value = o.partition("=")
        try:
            OmegaConf.update(cfg, key.removeprefix("task."), OmegaConf.from_dotlist([f"v={value}"]).v, merge=False)
        except Exception as e:  # OmegaConf's errors for an unknown key or an ill-typed value
            raise UserError(f"override '{o}': {str(e).strip().splitlines()[0]}") from None
    check_finite(cfg, "task")
    return OmegaConf.to_object(cfg)


def evaluated_as(opts: dict) -> tuple[str, dict]:
    """For the options that chose what was evaluated: what the result files' names add (nothing for the
    defaults, so that other seeds or settings sit beside the default evaluation instead of over it) and
    the fields the result records (the evaluation seed always: the initial states and randomization drawn)."""
    suffix, fields = "", {"seed": opts["seed"]}
    if opts["task_overrides"]:  # which ones, by a digest: two evaluations under other overrides keep both files
        digest = hashlib.sha1(" ".join(sorted(opts["task_overrides"])).encode()).hexdigest()[:8]
        suffix, fields["task_overrides"] = suffix + f"_overrides-{digest}", opts["task_overrides"]
    if opts["effects"] is not None:
        suffix, fields["pybullet_effects"] = suffix + "_effects-" + ("+".join(opts["effects"]) or "none"), opts["effects"]
    if opts["base_noise"] == "zero":
        suffix, fields["base_noise"] = suffix + "_w0", "zero"
    if opts["episodes"] != DEFAULTS["episodes"]:  # e.g. a few episodes for a video
        suffix += f"_episodes{opts['episodes']}"
    if opts["seed"] != DEFAULTS["seed"]:
        suffix += f"_seed{opts['seed']}"
    return suffix, fields


def running_median(values: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Per time step of ``values`` [T, episodes] (NaN once an episode has ended): where half or more
    of the episodes still run, and their median there. Later, the median of the few left would
    describe survivors only (and of none, be undefined)."""
    running = np.isfinite(values).sum(1) >= max(1, (values.shape[1] + 1) // 2)
    return running, np.nanmedian(values[running], axis=1)


def plot_errors(res: EvalResult, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    t = np.arange(1, res.position_error.shape[0] + 1) * POLICY_PERIOD  # after each step
    fig, ax = plt.subplots(figsize=(7, 4))
    ax.plot(t, res.position_error * 100, color="tab:blue", alpha=0.15, lw=0.8)
    running, median = running_median(res.position_error)
    ax.plot(t[running], median * 100, color="k", lw=2, label="median (half or more running)")
    ax.axhline(MEAN_ERROR_LAST_2S * 100, color="tab:red", ls="--", label="5 cm (last-2 s mean bound)")
    ax.axvspan(EPISODE_SECONDS - LAST_SECONDS, EPISODE_SECONDS, color="tab:green", alpha=0.08, label="criterion window")
    ax.set(xlabel="time [s]", ylabel="position error [cm]", yscale="log",
           title=f"{res.backend}: success {res.success_rate * 100:.0f}% of {res.episodes}")
    ax.legend(loc="upper right")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def plot_goal_distance(res: SuccessResult, path: Path, period: float) -> None:
    """A manipulation evaluation's goal distance (the task's, ArmEnv.goal_distance) over each episode,
    ``period`` s per control step, against its success radius."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    d = res.goal_distance[: int(np.isfinite(res.goal_distance).any(1).sum())] * 100  # cm, up to the last step run
    t = np.arange(1, d.shape[0] + 1) * period  # after each step
    fig, ax = plt.subplots(figsize=(7, 4))
    for ok, color in ((True, "tab:green"), (False, "tab:red")):
        if (res.success == ok).any():
            ax.plot(t, d[:, res.success == ok], color=color, alpha=0.15, lw=0.8)
            ax.plot([], [], color=color, label="succeeded" if ok else "failed")  # one legend entry per outcome
    running, median = running_median(d)
    ax.plot(t[running], median, color="k", lw=2, label="median (half or more running)")
    ax.axhline(res.success_radius * 100, color="tab:blue", ls="--", label="success radius")
    ax.set(xlabel="time [s]", ylabel="distance to goal [cm]", yscale="log",
           title=f"{res.backend}: success {res.success_rate * 100:.0f}% of {res.episodes}")
    ax.legend(loc="lower left")  # where the episodes start, far from the goal
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


VIDEO_EPISODES = 3  # shown side by side
ARM_VIDEO_PX = 160  # square frames of the arm's front camera


def save_gif(frames: list[np.ndarray], path: Path, frame_seconds: float) -> None:
    """A GIF playing ``frame_seconds`` per frame (GIF stores whole hundredths of a second)."""
    import imageio.v2 as imageio

    imageio.mimsave(path, frames, duration=round(frame_seconds * 1000), loop=0)  # imageio's pillow writer: ms
    print(f"video: {path}")


def arm_video(episodes: int) -> tuple[list[np.ndarray], Callable, Callable]:
    """Frames of the first episodes side by side, one per control step until every evaluated
    episode has ended, and the two callbacks of evaluate_success that fill them (``frames_cb``,
    ``on_episode_end``; the first alone would film on into the next episodes). An ended episode
    holds its last frame, rendered before the env resets."""
    frames: list[np.ndarray] = []
    shown = range(min(VIDEO_EPISODES, episodes))
    last: dict[int, np.ndarray] = {}
    ended: set[int] = set()

    def render(env, i: int) -> None:
        last[i] = env.render(i, depth=False, size=ARM_VIDEO_PX)["rgb"]

    def on_episode_end(env, idx: np.ndarray) -> None:
        for i in set(idx.tolist()) & set(shown) - ended:  # the first episode's end only
            render(env, i)
            ended.add(i)

    def frames_cb(env, t: int, finished: torch.Tensor) -> None:
        for i in shown:
            if i not in ended:
                render(env, i)
        frames.append(np.concatenate([last[i] for i in shown], axis=1))

    return frames, frames_cb, on_episode_end


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if help_requested(argv, __doc__):
        return 0
    try:
        run_dir, o = parse(argv)
        ieee_float32_on(torch.device(o["device"]))
        actor, rec = ckpt.load_policy(run_dir, o["device"])
        task_cfg, _ = to_objects(OmegaConf.create(rec["config"]))
        spec = get_task(task_cfg.name)
        conditions = None  # quadrotor: the criterion's, the task's default initial states, randomization, noise
        if o["task_overrides"] and spec.criterion != "success":
            fixed = [x for x in o["task_overrides"] if x.partition("=")[0].removeprefix("task.") in CRITERION_FIXED]
            if fixed:
                raise UserError(f"override '{fixed[0]}': the hover criterion sets it (policies/evaluate.py)")
            conditions = override_task(spec.default_config(), o["task_overrides"])
        task_cfg = override_task(task_cfg, o["task_overrides"])
        policy = with_base_noise(actor, o["base_noise"])
        if o["obs_source"] is not None:
            if spec.criterion != "success":
                raise UserError(f"obs_source applies to the manipulation tasks; {task_cfg.name} observes its state")
            task_cfg.obs_source = o["obs_source"]
        if o["obs_source"] is not None or o["task_overrides"]:  # a value no env runs with: one line, up front
            try:
                spec.env_cls.check_config(task_cfg if conditions is None else criterion_config(task_cfg, conditions))
            except ValueError as e:  # e.g. obs_source=perception for a task without a cube
                raise UserError(f"task {task_cfg.name}: {e}") from None
    except (UserError, ckpt.CheckpointError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    suffix, recorded = evaluated_as(o)
    if o["effects"] is not None:
        task_cfg.pybullet_effects = o["effects"]
    if spec.criterion == "success":
        if o["backend"] not in (None, "mujoco"):
            print(f"error: task {task_cfg.name} runs in MuJoCo only (backend=mujoco)", file=sys.stderr)
            return 2
        frames, cb, end_cb = arm_video(o["episodes"]) if o["video"] else ([], None, None)
        res = evaluate_success(policy, task_cfg, o["episodes"], "mujoco", o["seed"], o["device"], frames_cb=cb,
                               on_episode_end=end_cb)
        print(res.summary())
        name = ("eval_mujoco_perception" if task_cfg.obs_source == "perception" else "eval_mujoco") + suffix
        record = {**res.as_dict(), **recorded, "obs_source": task_cfg.obs_source}
        (run_dir / f"{name}.json").write_text(json.dumps(record, indent=2))
        print(f"results: {run_dir / (name + '.json')}")
        if o["plot"]:
            plot_goal_distance(res, run_dir / f"{name}_distance.png", spec.contract.policy_period_s)
            print(f"plot: {run_dir / (name + '_distance.png')}")
        if frames:
            save_gif(frames, run_dir / f"{name}.gif", spec.contract.policy_period_s)
        return 0
    o["backend"] = o["backend"] or "torch"
    frames: list[np.ndarray] = []
    cb = None
    if o["video"]:
        if o["backend"] != "mujoco":
            print("note: video is rendered with MuJoCo; use backend=mujoco to record one", file=sys.stderr)
        else:
            os.environ.setdefault("MUJOCO_GL", "egl")

            shown = list(range(min(VIDEO_EPISODES, o["episodes"])))  # the first episodes, side by side

            def cb(env, t):
                if t % 3 == 0:  # 33 fps
                    frames.append(np.concatenate(env.backend.render(shown, 160, 120), axis=1))

    if conditions is not None:
        print(f"note: judged by the criterion's bounds under {' '.join(o['task_overrides'])}, "
              "not the hover criterion's conditions", file=sys.stderr)
    res = evaluate_hover(policy, task_cfg, o["episodes"], o["backend"], o["seed"], o["device"], frames_cb=cb,
                         conditions=conditions)
    print(res.summary())
    name = f"eval_{o['backend']}{suffix}"
    (run_dir / f"{name}.json").write_text(json.dumps({**res.as_dict(), **recorded}, indent=2))
    print(f"results: {run_dir / (name + '.json')}")
    if o["plot"]:
        plot_errors(res, run_dir / f"{name}_error.png")
        print(f"plot: {run_dir / (name + '_error.png')}")
    if frames:
        save_gif(frames, run_dir / f"eval_mujoco{suffix}.gif", 3 * POLICY_PERIOD)
    return 0 if res.success_rate >= SUCCESS_RATE_REQUIRED else 1


if __name__ == "__main__":
    with torch.no_grad():
        sys.exit(exit_code(main))
