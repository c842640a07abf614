"""Collect scripted-expert demonstrations into a dataset (format: policies/dataset.py).

    python -m policies.collect task=arm_push episodes=100 noise=0.3 [out=data/arm_push] [seed=0]
        [num_envs=16] [successful_only=false] [progress=true] [task.<field>=value ...]
    python -m policies.collect task=arm_push episodes=60 noise=0.2 task.expert_worse_share=0.5   # two operators

The expert is the task's own (``expert_action`` in its task file), acting on the true simulator
state; ``noise`` is the std of Gaussian noise added to its actions (action units, clipped to
[-1, 1]). The first episodes to start are kept, in that order (not the first to finish, which are the
short ones), so a seed and num_envs fix the dataset (the environments draw their episodes each in turn;
meta.json records both).
"""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import torch
from omegaconf import OmegaConf
from tqdm import tqdm

from export.onnx_policy import source_revision
from sim.registry import get_task, require_expert

from . import dataset as ds
from .config import UserError, compose_config, exit_code, held_files, help_requested, to_objects

OPTIONS = {"episodes": int, "noise": float, "seed": int, "out": str, "num_envs": int, "successful_only": bool,
           "progress": bool}
DEFAULTS = {"episodes": 100, "noise": 0.0, "seed": 0, "out": "", "num_envs": 16, "successful_only": False,
            "progress": True}


def parse(argv: list[str]) -> tuple[dict, list[str]]:
    opts, rest = dict(DEFAULTS), []
    for a in argv:
        k, eq, v = a.partition("=")
        if not eq:
            raise UserError(f"argument '{a}' is not of the form key=value")
        if k in OPTIONS:
            try:
                opts[k] = {"true": True, "false": False}[v.lower()] if OPTIONS[k] is bool else OPTIONS[k](v)
            except (KeyError, ValueError):
                raise UserError(f"{k}={v}: expected a value of type {OPTIONS[k].__name__}") from None
        elif k == "task" or k.startswith("task."):
            rest.append(a)
        else:
            raise UserError(f"unknown option '{k}': expected task=..., task.<field>=... or one of {', '.join(OPTIONS)}")
    if not any(a.startswith("task=") for a in rest):
        raise UserError("which task? e.g. python -m policies.collect task=arm_push episodes=100 out=data/arm_push")
    if not opts["out"]:  # where algo=diffusion_bc looks by default
        opts["out"] = "data/" + next(a for a in rest if a.startswith("task=")).split("=", 1)[1]
    for k in ("episodes", "num_envs"):
        if opts[k] < 1:
            raise UserError(f"{k}={opts[k]}: expected at least 1")
    if not opts["noise"] >= 0:
        raise UserError(f"noise={opts['noise']}: expected >= 0 (the std of the expert's action noise)")
    out = Path(opts["out"])  # checked before collecting: a dataset (or a run) is never written over
    if out.exists() and not out.is_dir():
        raise UserError(f"cannot write a dataset at '{out}': it is a file")
    if held := held_files(out):
        raise UserError(f"out={out} is not empty ({held}): datasets are never written over; give another out= or "
                        "delete it")
    return opts, rest


@torch.no_grad()
def collect(task_cfg, episodes: int, noise: float, seed: int, num_envs: int, successful_only: bool = False,
            progress: bool = True) -> tuple[list[dict[str, np.ndarray]], float]:
    """Roll the expert out in ``num_envs`` parallel envs and keep the first ``episodes`` episodes in
    the order they started (with ``successful_only``, the first successful ones). Not the first to
    finish: those are the short ones, and a dataset of them would over-represent quick episodes
    (and, with two operators, the quicker one). Returns the episodes and the control period (s)."""
    try:
        require_expert(task_cfg.name, "policies.collect rolls out a scripted expert")
    except ValueError as e:
        raise UserError(str(e)) from None
    try:
        env = get_task(task_cfg.name).env_cls(task_cfg, num_envs, seed=seed)
    except ValueError as e:  # a task value the environment refuses
        raise UserError(f"task {task_cfg.name}: {e}") from None
    try:
        return _collect(env, task_cfg, episodes, noise, seed, successful_only, progress)
    finally:  # its renderers (a camera task) hold OpenGL contexts
        env.close()


def _collect(env, task_cfg, episodes: int, noise: float, seed: int, successful_only: bool,
             progress: bool) -> tuple[list[dict[str, np.ndarray]], float]:
    num_envs = env.num_envs
    obs, _ = env.reset(seed=seed)
    keys = ["obs", "critic", "action", "reward", "success", "terminal"] + (["image"] if "image" in obs else [])
    running = [{k: [] for k in keys} for _ in range(num_envs)]
    started = [0] * num_envs  # step at which each env's running episode started
    finished: list[tuple[tuple[int, int], dict[str, np.ndarray]]] = []  # ((start step, env), episode)
    kept: list[dict[str, np.ndarray]] = []
    max_final, final_failures = 20 * episodes + 100, 0  # successful_only: an expert that (nearly) never succeeds
    bar = tqdm(total=episodes, unit="episode", disable=not progress, desc=f"collect {task_cfg.name}")
    t = 0
    while True:
        action = env.expert_action(noise)
        nxt, reward, term, trunc, info = env.step(action)
        step = {"obs": obs["policy"], "critic": obs["critic"], "action": action, "reward": reward,
                "success": info["success"], "terminal": term}
        if "image" in obs:
            step["image"] = obs["image"]
        for i in range(num_envs):
            for k in keys:
                running[i][k].append(step[k][i].cpu().numpy())
        t += 1
        ended = (term | trunc).nonzero().flatten().tolist()
        for i in ended:
            finished.append(((started[i], i), {k: np.stack(v) for k, v in running[i].items()}))
            running[i], started[i] = {k: [] for k in keys}, t
        obs = nxt
        if not ended:
            continue
        # Every episode that started before the earliest running one has finished: those are final.
        final = sorted((e for e in finished if e[0][0] < min(started)), key=lambda e: e[0])
        chosen = [ep for _, ep in final if ep["success"].any() or not successful_only][:episodes]
        bar.update(len(chosen) - len(kept))
        kept = chosen
        if len(kept) == episodes:
            break
        if successful_only:  # final failures are never kept: count them and let them go
            succeeded = len(chosen)  # every final success (fewer than ``episodes``, or the loop had ended)
            final_failures += len(final) - succeeded
            finished = [e for e in finished if e[0][0] >= min(started) or e[1]["success"].any()]
            if succeeded + final_failures >= max_final:
                raise UserError(f"successful_only=true: the expert succeeded in {succeeded} of "
                                f"{succeeded + final_failures} episodes at noise={noise}, not "
                                f"{episodes}; lower noise= or collect without successful_only")
    bar.close()
    return kept, env.control_period


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if help_requested(argv, __doc__):
        return 0
    try:
        o, overrides = parse(argv)
        cfg = compose_config(overrides)
        task_cfg, _ = to_objects(cfg)
        eps, period = collect(task_cfg, o["episodes"], o["noise"], o["seed"], o["num_envs"], o["successful_only"],
                              o["progress"])
    except UserError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    meta = {"task": task_cfg.name, "task_config": OmegaConf.to_container(cfg.task, resolve=True),
            "expert_noise": o["noise"], "seed": o["seed"], "num_envs": o["num_envs"],
            "successful_only": o["successful_only"],
            "control_period_s": period, "source_revision": source_revision()}
    try:
        path = ds.save(Path(o["out"]), eps, meta)
    except ds.DatasetError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    ok = sum(bool(e["success"].any()) for e in eps)
    print(f"wrote {len(eps)} episodes ({ok} successful, {sum(len(e['action']) for e in eps)} steps) to {path}")
    return 0


if __name__ == "__main__":
    sys.exit(exit_code(main))
