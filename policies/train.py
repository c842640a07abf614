"""Training entry point: ``python -m policies.train task=quad_hover [algo=ppo seed=0 device=cpu ...]``.

A run directory holds the resolved config (config.yaml), checkpoints/ (last.pt for resume,
best.pt for eval/export), TensorBoard logs (tb/) and results.json. The loop is algorithm
agnostic: an algorithm exposes train_iteration(), actor (the deployable policy module),
state_dict() and load_state_dict(). Online algorithms count progress in environment steps;
an offline one (``config.is_offline``, e.g. diffusion_bc) in gradient steps (``progress()``),
with its own budget and evaluation interval (``gradient_steps``, ``eval_every_updates``).
"""

from __future__ import annotations

import fcntl
import json
import os
import signal
import sys
import threading
import time
from datetime import datetime
from pathlib import Path

import torch
from omegaconf import DictConfig, OmegaConf
from torch.utils.tensorboard import SummaryWriter
from tqdm import tqdm

from export.onnx_policy import source_revision
from sim.registry import get_task

from . import checkpoint as ckpt
from .config import (RESUMABLE_OVERRIDES, UserError, check_device, compose_config, config_hash, diff_keys,
                     exit_code, expand_shorthands, held_files, help_requested, ieee_float32_on, is_offline, to_objects,
                     train_usage)
from .evaluate import EvaluationProcessError, evaluate, evaluate_backends

_IMPORTED = time.time()


def process_start_time() -> float:
    """Wall-clock time (s since the epoch) at which this process started. Linux (/proc); elsewhere
    the time of this module's import."""
    try:
        start_ticks = int(Path("/proc/self/stat").read_text().rsplit(")", 1)[1].split()[19])  # field 22
        age = time.clock_gettime(time.CLOCK_BOOTTIME) - start_ticks / os.sysconf("SC_CLK_TCK")
        return time.time() - age
    except (OSError, ValueError, IndexError, AttributeError):
        return _IMPORTED


def make_algo(name: str, algo_cfg, env, device: torch.device, seed: int):
    if name == "ppo":
        from .ppo import PPO

        return PPO(algo_cfg, env, device, seed)
    if name == "sac":
        from .sac import SAC

        return SAC(algo_cfg, env, device, seed)
    if name == "diffusion_bc":
        from .diffusion import DiffusionBC

        return DiffusionBC(algo_cfg, env, device, seed)
    if name == "dsrl":
        from .dsrl import DSRL

        return DSRL(algo_cfg, env, device, seed)
    raise UserError(f"unknown algo '{name}'")


# What a training checkpoint (checkpoints/last.pt, written in run()) holds that a resume restores.
RESUME_KEYS = {"algo", "env", "torch_rng", "trainer"}


def prepare(argv: list[str]) -> tuple[DictConfig, Path, dict | None]:
    """Resolve config, run directory and (when resuming) the checkpoint to continue from."""
    resume = next((a.split("=", 1)[1] for a in argv if a.startswith("resume=")), None)
    if resume is None:
        cfg = compose_config(argv)
        run_dir = Path(cfg.run_dir or f"runs/{cfg.task.name}/{cfg.algo.name}_seed{cfg.seed}_{datetime.now():%Y%m%d-%H%M%S}")
        if (run_dir / ckpt.LAST).exists():
            try:
                lock_run_dir(run_dir).close()  # a run still going there: "in use by another policies.train process"
            except OSError:  # no lock file can be made there (read-only): not one in use by a run
                pass
            raise UserError(f"{run_dir} already holds a run; continue it with resume={run_dir} or pick another run_dir")
        # a run killed before its first checkpoint, a dataset, ... (a lock alone is checked when it is taken)
        if held := held_files(run_dir, ignore=(LOCK,)):
            raise UserError(f"run_dir={run_dir} is not empty ({held}): a run writes into a directory of its own; "
                            "pick another run_dir")
        cfg.run_dir = str(run_dir)
        return cfg, run_dir, None

    # the directory itself: a symlink (runs/latest) that another run moves on must not take the writes with it
    run_dir = Path(resume).resolve()
    if any(a.split("=", 1)[0] == "run_dir" for a in argv):
        raise UserError(f"resume={resume} continues that run in its own directory: leave run_dir= out")
    saved_path = run_dir / "config.yaml"
    if not saved_path.is_file():
        raise UserError(f"resume={resume}: no config.yaml there; expected a run directory made by policies.train")
    try:
        saved = OmegaConf.load(saved_path)
        saved.task.name, saved.algo.name  # noqa: B018 (the two choices a run is re-composed from)
    except Exception as e:  # YAML, OmegaConf or attribute errors: a damaged or foreign file
        raise UserError(f"resume={resume}: {saved_path} is not a readable policies.train config "
                        f"({type(e).__name__}); nothing was changed") from None
    # Re-compose from the saved choices plus the new overrides, then allow only budget changes.
    base = [f"task={saved.task.name}", f"algo={saved.algo.name}"]
    cfg = compose_config(base + [a for a in argv if not a.startswith("resume=")])
    cfg.run_dir, cfg.resume = saved.run_dir, None
    new, old = OmegaConf.to_container(cfg), OmegaConf.to_container(saved)
    for k in RESUMABLE_OVERRIDES:
        old[k] = new[k]
    explicit = {a.split("=", 1)[0] for a in expand_shorthands(argv)}
    # task=/algo= repeating the run's own choice change nothing by themselves (their defaults may, e.g.
    # a default path made absolute in another working directory: those stay as saved)
    explicit -= {g for g in ("task", "algo") if new[g]["name"] == saved[g].name}  # the choice composed (the last)
    # a key given on the command line, or inside one given whole (task.reward={...}, task=...)
    bad = [k for k in diff_keys(new, old) if any(k == e or k.startswith(e + ".") for e in explicit)
           or k.split(".")[0] in explicit]
    for group in ("task", "algo"):  # another task or algorithm changes most of its fields: name the choice
        if group in explicit and new[group]["name"] != saved[group].name:
            raise UserError(f"resume={resume}: cannot change {group} ({saved[group].name} -> {new[group]['name']}) "
                            "of an existing run; start a new run")
    if bad:
        raise UserError(f"resume={resume}: cannot change {', '.join(bad)} of an existing run "
                        f"(only {', '.join(sorted(RESUMABLE_OVERRIDES - {'resume'}))} may change)")
    # Budgets the user gave now replace the saved ones; everything else stays as saved. A budget key
    # that a run of an older revision did not have yet (e.g. confirm_backends) takes today's default.
    newer = {k: cfg[k] for k in RESUMABLE_OVERRIDES - {"resume"} if k not in saved}
    merged = OmegaConf.merge(saved, newer, {k: cfg[k] for k in RESUMABLE_OVERRIDES & explicit if k != "resume"})
    if merged.threads != saved.threads:  # torch's reductions round by their split across threads
        print(f"note: threads {saved.threads} -> {merged.threads}: the run goes on, but its numbers no longer match "
              f"a run that went on with {saved.threads} bit for bit", flush=True)
    try:
        check_device(merged.device)  # a run made on a GPU machine, resumed on one without
    except UserError as e:
        raise UserError(f"resume={resume}: {e}") from None
    if not (run_dir / ckpt.LAST).is_file():
        raise UserError(f"resume={resume}: no checkpoint there yet (the run stopped before its first, which comes "
                        f"after checkpoint_every_seconds or at its first evaluation): delete {run_dir} and start again")
    try:
        state = ckpt.load(run_dir / ckpt.LAST, merged.device)
    except ckpt.CheckpointError as e:
        raise UserError(str(e)) from None
    missing = sorted(RESUME_KEYS - set(state)) if isinstance(state, dict) else sorted(RESUME_KEYS)
    if missing:  # a file that loads but is something else, e.g. a policy record copied over it
        raise UserError(f"resume={resume}: {run_dir / ckpt.LAST} is not a training checkpoint of policies.train "
                        f"(no {', '.join(missing)} in it); nothing was changed")
    if state.get("config_hash") != config_hash(merged):
        raise UserError(f"resume={resume}: checkpoint was written by a different config than {saved_path}")
    task = merged.task.name
    problem = ckpt.contract_version_problem(state.get("contract"), task, get_task(task).contract)
    if problem:  # its best policies so far were made under that version; the rest would be stamped anew
        raise UserError(f"resume={resume}: {problem}: start a new run")
    return merged, run_dir, state


def pass_holds(tr: dict, cfg: DictConfig) -> bool:
    """Whether the run's confirmed pass (``tr``: the trainer state) meets this config's stop rule: a
    resumed run may ask for a higher bar or a stricter confirmation than the one it passed."""
    if not tr["passed"] or cfg.stop_at_success <= 0:
        return False
    done = tr.get("passed_with", {})  # runs of older revisions recorded neither
    return (tr.get("passed_at", cfg.stop_at_success) >= cfg.stop_at_success
            and set(cfg.confirm_backends) <= set(done.get("backends", cfg.confirm_backends))
            and done.get("episodes", cfg.confirm_episodes) >= cfg.confirm_episodes)


def save_config(cfg: DictConfig, run_dir: Path) -> None:
    """``run_dir/config.yaml``, written atomically: a new run's config, or a resumed run's with the
    budgets it resumed with (a kill, then ``resume=<run_dir>`` alone, goes on to those)."""
    path, text = run_dir / "config.yaml", OmegaConf.to_yaml(cfg)
    if path.is_file() and path.read_text() == text:
        return
    tmp = run_dir / "config.yaml.tmp"
    tmp.write_text(text)
    os.replace(tmp, path)


def run(cfg: DictConfig, run_dir: Path, resume_state: dict | None, t_start: float, lock=None) -> dict:
    """Train until the budget ends or a confirmed pass; ``t_start`` (s since the epoch) is what
    the time to success counts from; ``lock``: the run directory's lock if the caller holds it already."""
    task_cfg, algo_cfg = to_objects(cfg)
    device = torch.device(cfg.device)
    ieee_float32_on(device)
    torch.set_num_threads(cfg.threads)
    # The environment and the algorithm first: a value their constructors refuse or a missing base
    # policy stops the run before anything is written.
    spec = get_task(task_cfg.name)
    try:
        env = spec.env_cls(task_cfg, algo_cfg.num_envs, device=device, seed=cfg.seed)
    except ValueError as e:
        raise UserError(f"task {task_cfg.name}: {e}") from None
    try:
        algo = make_algo(algo_cfg.name, algo_cfg, env, device, cfg.seed)
    except ValueError as e:
        raise UserError(f"algo {algo_cfg.name}: {e}") from None
    offline = is_offline(cfg.algo)
    if not offline and cfg.max_env_steps < algo.iteration_steps:
        # The budget is checked after each iteration: it would train a whole one, past the budget, unsaid.
        raise UserError(f"max_env_steps={cfg.max_env_steps}: less than one iteration of algo={algo_cfg.name}, "
                        f"{algo.iteration_steps:,} env steps ({algo.iteration_size})")
    if getattr(algo, "buffer", None) is not None:  # off-policy: its replay rows go to segment files, new ones per save
        algo.buffer.persist(run_dir / ckpt.REPLAY)
    try:
        run_dir.mkdir(parents=True, exist_ok=True)
    except OSError as e:  # a file there, no permission, a read-only file system
        raise UserError(f"run_dir={run_dir}: cannot make that directory ({e.strerror})") from None
    with lock if lock is not None else lock_run_dir(run_dir):  # held until this function ends, however it ends
        if resume_state is None:
            save_config(cfg, run_dir)

        budget, eval_every, unit = ((algo_cfg.gradient_steps, algo_cfg.eval_every_updates, "update") if offline
                                    else (cfg.max_env_steps, cfg.eval_every_steps, "step"))
        steps_key = "gradient_steps" if offline else "env_steps"  # what tr["env_steps"] counts
        tr = {"iteration": 0, "env_steps": 0, "seconds": 0.0, "next_eval": eval_every,
              "best_success": -1.0, "best_error": float("inf"), "evals": [], "time_to_success": None, "passed": False,
              "eval_seconds": 0.0}
        if resume_state is not None:
            try:
                algo.load_state_dict(resume_state["algo"])
            except (RuntimeError, KeyError) as e:  # e.g. a checkpoint of networks laid out by an older revision
                first = str(e).strip().splitlines()[0]
                raise UserError(f"resume={run_dir}: {ckpt.LAST} does not fit this version's {algo_cfg.name} "
                                f"networks ({first}); start a new run") from None
            except ckpt.CheckpointError as e:  # its replay rows missing or damaged
                raise UserError(f"resume={run_dir}: {e}") from None
            env.load_state_dict(resume_state["env"])
            torch.set_rng_state(resume_state["torch_rng"])
            tr = {"passed": False, **resume_state["trainer"]}  # checkpoints of older revisions lack "passed"
            save_config(cfg, run_dir)  # the budgets it resumes with, for the next resume of it
            ckpt.settle_best(run_dir, tr["evals"], steps_key)
            if tr.get("eval_every", eval_every) != eval_every:  # a new interval: from the last evaluation on, or
                tr["next_eval"] = (tr["evals"][-1][steps_key] + eval_every if tr["evals"]  # its grid from 0 past here
                                   else (tr["env_steps"] // eval_every + 1) * eval_every)
            while tr["evals"] and tr["next_eval"] - eval_every > tr["evals"][-1][steps_key]:
                tr["next_eval"] -= eval_every  # moved on by a budget's end evaluation (checkpoints of older revisions)
            print(f"resuming {run_dir} at {tr['env_steps']:,} {unit}s ({tr['seconds']:.1f} s of training, "
                  f"{len(tr['evals'])} evaluations before it)", flush=True)
            (run_dir / "results.json").unlink(missing_ok=True)  # an earlier session's end: not this run's
        tr["eval_every"] = eval_every
        # The code revisions that trained this run, one per session that ran other code than the one
        # before it (a resume after a pull adds one); checkpoints of older revisions recorded none.
        revisions, rev = tr.setdefault("source_revisions", ["unknown"] if resume_state else []), source_revision()
        if not revisions or revisions[-1] != rev:
            revisions.append(rev)
        latest = run_dir.parent.parent / "latest" if run_dir.parent.parent.name == "runs" else None
        if latest is not None:  # runs/latest -> this run (once a resume has loaded), for the README's commands
            link = latest.with_name(f".latest.{os.getpid()}")  # replaced in one step: runs starting together
            link.unlink(missing_ok=True)
            link.symlink_to(run_dir.resolve(), target_is_directory=True)
            os.replace(link, latest)
        # A resumed run drops the events logged after its checkpoint (they are logged again); every event's
        # step is in env steps (gradient steps offline), those up to the checkpoint's stay.
        writer = SummaryWriter(str(run_dir / "tb"), purge_step=tr["env_steps"] + 1 if resume_state is not None else None)
        if resume_state is None:
            writer.add_text("config", f"```\n{OmegaConf.to_yaml(cfg)}\n```")

        def save_last():
            ckpt.save_atomic({"algo": algo.state_dict(), "env": env.state_dict(), "torch_rng": torch.get_rng_state(),
                              "trainer": tr, "config_hash": config_hash(cfg),
                              "contract": spec.contract.version}, run_dir / ckpt.LAST)

        bar = tqdm(total=budget, initial=tr["env_steps"], unit=unit, unit_scale=True,
                   disable=not cfg.progress, dynamic_ncols=True, desc=f"{task_cfg.name}/{algo_cfg.name}")
        def evaluate_and_keep_best() -> tuple[float, bool]:
            """Evaluate the current policy, keep it as best.pt if it is the best so far, checkpoint.
            Returns the success rate and whether it passes: stop_at_success reached and confirmed."""
            t_eval = time.time()
            res = evaluate(algo.actor, task_cfg, cfg.eval_episodes, device=device, seed=cfg.seed + 10_000)
            rec = {**res.as_dict(), steps_key: tr["env_steps"], "seconds": tr["seconds"]}
            reached = cfg.stop_at_success > 0 and res.success_rate >= cfg.stop_at_success
            if reached:
                # Every evaluation replays the same episodes (comparable points on the curve), so the
                # first pass among many noisy ones overstates the policy: quadrotor policies stopped at
                # 95-96 % there scored 91-94 % on other episodes. A pass counts once episodes new at each
                # check confirm it in every simulator of confirm_backends (config.py): torch, then the
                # others at once (policies/evaluate.py); one that falls short cancels those after it.
                seeds = {b: cfg.seed + 20_000 + 10 * len(tr["evals"]) + i for i, b in enumerate(cfg.confirm_backends)}
                try:
                    checks = evaluate_backends(algo.actor, task_cfg, cfg.confirm_episodes, seeds, device,
                                               cfg.stop_at_success)
                except EvaluationProcessError as e:  # a simulator's process died or raised: stop, resumable
                    save_last()  # without this evaluation: a resume evaluates at the next (at once if spent)
                    raise UserError(f"the confirmation of {res.success_rate * 100:.0f}% at {tr['env_steps']:,} "
                                    f"{unit}s stopped the run: {e}; its last checkpoint holds this step, "
                                    f"resume={run_dir} goes on from it") from None
                rec["confirm"] = {b: check.success_rate for b, check in checks.items()}
                rec["confirm_success_rate"] = min(rec["confirm"].values())
                reached = rec["confirm_success_rate"] >= cfg.stop_at_success
            rec["eval_duration_s"] = time.time() - t_eval  # the training clock ("seconds") includes all but the last
            tr["eval_seconds"] += rec["eval_duration_s"]
            tr["evals"].append(rec)
            for k, v in rec.items():
                if isinstance(v, (int, float)) and k not in ("episodes", steps_key, "seconds"):
                    writer.add_scalar(f"eval/{k}", v, tr["env_steps"])
            # Best = a confirmed pass (it ends the run); before one, the highest success rate, ties
            # broken by the task's secondary measure (lower is better).
            better = (res.success_rate, -res.tiebreak) > (tr["best_success"], -tr["best_error"])
            new_best = reached or (better and not tr["passed"])
            if new_best:
                tr["best_success"], tr["best_error"] = res.success_rate, res.tiebreak
                ckpt.save_atomic(ckpt.policy_record(algo.actor, cfg, rec, tr["env_steps"], steps_key,
                                                   tr["source_revisions"]),
                                 run_dir / ckpt.BEST_PENDING)
            if reached:
                tr["passed"], tr["passed_at"] = True, cfg.stop_at_success
                tr["passed_with"] = {"backends": list(cfg.confirm_backends), "episodes": cfg.confirm_episodes}
            if reached and tr["time_to_success"] is None:
                tr["time_to_success"] = time.time() - t_start if resume_state is None else None
            confirm = (" | new episodes: " + ", ".join(f"{b} {v * 100:.0f}%" for b, v in rec["confirm"].items())
                       if "confirm" in rec else "")
            bar.write(f"eval @ {tr['env_steps']:,} {unit}s, {tr['seconds']:.1f} s: {res.summary()}{confirm}")
            save_last()
            if new_best:  # last.pt now records this evaluation (ckpt.BEST_PENDING)
                os.replace(run_dir / ckpt.BEST_PENDING, run_dir / ckpt.BEST)
            return res.success_rate, reached

        t_session = time.time()
        seconds_before = tr["seconds"]
        last_ckpt = time.time()
        success = tr["evals"][-1]["success_rate"] if tr["evals"] else float("nan")
        # A resumed run that passed at the bar it still stops at, or whose budget is spent, has nothing
        # left to do: one more iteration would train past its end. (A raised bar trains on to a pass at
        # it, which then replaces best.pt.)
        done = None
        if resume_state is not None:
            if pass_holds(tr, cfg):
                done = (f"it passed at stop_at_success={tr.get('passed_at', cfg.stop_at_success)}; a higher "
                        f"stop_at_success (or a stricter confirmation) trains on to a pass at that bar")
            elif tr["env_steps"] >= budget or tr["seconds"] >= cfg.max_seconds:
                raise_steps = ("start a new run with a larger algo.gradient_steps" if offline
                               else f"raise max_env_steps (now {budget:,})")
                more = [raise_steps] if tr["env_steps"] >= budget else []  # only what ran out
                more += [f"raise max_seconds (now {cfg.max_seconds:g})"] if tr["seconds"] >= cfg.max_seconds else []
                done = f"its budget is spent; to go on, {' and '.join(more)}"
            if done:
                bar.write(f"resume={run_dir}: nothing to train at {tr['env_steps']:,} {unit}s: {done}")
        stop = done is not None
        # Its budget spent, but not evaluated where its checkpoint is (killed before its first evaluation, or
        # a confirmation process died at the budget's end): evaluate it once.
        if stop and not pass_holds(tr, cfg) and (not tr["evals"] or tr["evals"][-1][steps_key] < tr["env_steps"]):
            success, _ = evaluate_and_keep_best()
        if not stop and cfg.eval_at_start and not tr["evals"]:  # the starting point of a learning curve
            success, stop = evaluate_and_keep_best()
        # Ctrl-C stops at the end of the iteration (or evaluation) under way, with a checkpoint there;
        # a second one stops at once (main: one line, the last checkpoint kept).
        interrupted: list[float] = []

        def on_sigint(signum, frame) -> None:
            if interrupted:
                raise KeyboardInterrupt
            interrupted.append(time.time())
            bar.write("Ctrl-C: stopping with a checkpoint after this iteration (Ctrl-C again to stop at once)")

        # Only where Python takes signals, and not where SIGINT is ignored (a job started with & by a script)
        in_main = (threading.current_thread() is threading.main_thread()
                   and signal.getsignal(signal.SIGINT) is not signal.SIG_IGN)
        previous = signal.signal(signal.SIGINT, on_sigint) if in_main else None
        logged_at, logged_steps = time.time(), tr["env_steps"]  # without the bar: a line per log_every_seconds
        try:
            while not stop and not interrupted:
                t0 = time.time()
                metrics = algo.train_iteration()
                now = algo.progress() if offline else env.total_steps
                steps = now - tr["env_steps"]
                tr["env_steps"] = now  # gradient steps for an offline algorithm
                tr["iteration"] += 1
                tr["seconds"] = seconds_before + time.time() - t_session
                sps = steps / max(time.time() - t0, 1e-9)
                for k, v in metrics.items():
                    writer.add_scalar(f"train/{k}", v, tr["env_steps"])
                writer.add_scalar("perf/steps_per_second", sps, tr["env_steps"])
                writer.add_scalar("train/curriculum", env.curriculum(), tr["env_steps"])
                writer.add_scalar("train/nonfinite_resets", env.nonfinite_resets, tr["env_steps"])

                out_of_budget = tr["env_steps"] >= budget or tr["seconds"] >= cfg.max_seconds
                if tr["env_steps"] >= tr["next_eval"] or out_of_budget:
                    while tr["env_steps"] >= tr["next_eval"]:  # an evaluation at a budget's end keeps the grid
                        tr["next_eval"] += eval_every
                    success, stop = evaluate_and_keep_best()
                    last_ckpt = time.time()
                    logged_at, logged_steps = time.time(), tr["env_steps"]  # its line was just written
                elif time.time() - last_ckpt >= cfg.checkpoint_every_seconds:
                    save_last()
                    last_ckpt = time.time()
                bar.update(steps)
                main_metric = "reward" if "reward" in metrics else "loss"
                bar.set_postfix({"sps": f"{sps:,.0f}", "success": f"{success:.2f}",
                                 main_metric: f"{metrics[main_metric]:.3f}"})
                if not cfg.progress and time.time() - logged_at >= cfg.log_every_seconds:
                    rate = (tr["env_steps"] - logged_steps) / (time.time() - logged_at)
                    evaluated = f"last evaluation {success:.2f}" if tr["evals"] else "no evaluation yet"
                    bar.write(f"train @ {tr['env_steps']:,} {unit}s, {tr['seconds']:.1f} s: {rate:,.0f} {unit}s/s, "
                              f"{main_metric} {metrics[main_metric]:.3f}, {evaluated}")
                    logged_at, logged_steps = time.time(), tr["env_steps"]
                stop = stop or out_of_budget
                if interrupted and not stop:
                    save_last()
        finally:
            if in_main:
                signal.signal(signal.SIGINT, previous)
        bar.close()
        writer.close()
        if interrupted and not stop:  # not ended: no results.json, a resume goes on from the checkpoint
            return {"interrupted": True, steps_key: tr["env_steps"], "train_seconds": tr["seconds"]}

        passed = pass_holds(tr, cfg)
        results = {"run_dir": str(run_dir), steps_key: tr["env_steps"], "train_seconds": tr["seconds"],
                   "best_success": tr["best_success"], "passed": passed,
                   # what confirmed the pass: the simulators and the new episodes in each (None without one)
                   "passed_with": tr.get("passed_with") if passed else None,
                   "time_to_success_s": tr["time_to_success"],
                   "eval_seconds": tr["eval_seconds"], "source_revisions": tr["source_revisions"],
                   "evals": tr["evals"]}
        tmp = run_dir / "results.json.tmp"  # whole or absent, as the README says, also after a kill
        tmp.write_text(json.dumps(results, indent=2))
        os.replace(tmp, run_dir / "results.json")
        return results


LOCK = ".lock"  # in the run directory, held while a policies.train runs there


def lock_run_dir(run_dir: Path):
    """An exclusive lock on ``run_dir`` (the open file, a context manager: closing it releases the lock,
    as does the end of the process): a second policies.train there, started before the first one's checkpoint or
    resuming a run still going, stops with one line instead of training over it (and deleting its
    replay segments)."""
    f = open(run_dir / LOCK, "a")
    try:
        fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        f.close()
        raise UserError(f"{run_dir} is in use by another policies.train process") from None
    return f


def main(argv: list[str] | None = None) -> int:
    # Without argv (the command line), the time to success counts from the process start: what a
    # user waits for after typing the command, the imports included (~2.5 s here: torch,
    # torch.compile, TensorBoard). With argv (a call from Python), from this call.
    t_start = process_start_time() if argv is None else time.time()
    argv = sys.argv[1:] if argv is None else argv
    if help_requested(argv, train_usage()):
        return 0
    lock = None
    try:
        # A resume locks its run before it reads the checkpoint: a process still writing there (or being
        # killed) would otherwise hand it an older last.pt, and the resumed run would train over newer progress.
        resume = next((Path(a.split("=", 1)[1]) for a in argv if a.startswith("resume=")), None)
        if resume is not None and (resume / "config.yaml").is_file():
            try:
                lock = lock_run_dir(resume)
            except OSError as e:  # e.g. a read-only run directory: a resumed run writes there
                raise UserError(f"resume={resume}: cannot make its lock file ({e.strerror or e}); a resumed run "
                                "writes into its run directory") from None
        cfg, run_dir, state = prepare(argv)
    except UserError as e:
        if lock is not None:
            lock.close()
        print(f"error: {e}", file=sys.stderr)
        return 2
    try:
        res = run(cfg, run_dir, state, t_start, lock)
    except UserError as e:  # e.g. a missing dataset or base policy, found when the algorithm starts
        print(f"error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:  # before the training loop, or a second Ctrl-C in it
        last = run_dir / ckpt.LAST
        kept = (f"its last checkpoint ({ckpt.LAST}, {time.time() - last.stat().st_mtime:.0f} s old) is kept: "
                f"resume={run_dir} goes on from it" if last.is_file() else "it has no checkpoint yet")
        print(f"interrupted: {kept}", file=sys.stderr)
        return 130
    finally:
        if lock is not None:
            lock.close()
    steps = f"{res['gradient_steps']:,} gradient steps" if "gradient_steps" in res else f"{res['env_steps']:,} env steps"
    if res.get("interrupted"):
        print(f"interrupted at {steps} ({res['train_seconds']:.1f} s of training), checkpointed: resume={run_dir} "
              f"goes on from there", file=sys.stderr)
        return 130
    passed = res["passed"]  # a pass confirmed on new episodes, not merely the best evaluation
    last = f", the last evaluation {res['evals'][-1]['success_rate'] * 100:.1f}%" if res["evals"] else ""
    print(f"{steps} in {res['train_seconds']:.1f} s: best success rate {res['best_success'] * 100:.1f}% "
          f"(checkpoints/best.pt){last}"
          + (f" ({'a' if passed else 'no'} pass of {cfg.stop_at_success:g} confirmed on new episodes)"
             if cfg.stop_at_success > 0 else ""))
    print(f"run directory: {run_dir}  (config.yaml, checkpoints/, tb/, results.json)")
    if get_task(cfg.task.name).criterion == "hover":
        print(f"evaluate: python -m policies.eval {run_dir} backend=mujoco")
    else:
        print(f"evaluate: python -m policies.eval {run_dir}")
    return 0 if passed or cfg.stop_at_success <= 0 else 1


if __name__ == "__main__":
    sys.exit(exit_code(main))
