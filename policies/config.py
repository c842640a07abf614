"""Run configuration: typed schemas for Hydra, composition from ``policies/config/`` YAML,
and the clear one-line errors a user gets for a bad task name or override."""

from __future__ import annotations

import hashlib
import json
import math
import os
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

from hydra import compose, initialize_config_dir
from hydra.core.config_store import ConfigStore
from hydra.errors import HydraException
from omegaconf import DictConfig, ListConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException
import torch

from sim.registry import TASKS, UnknownTaskError, get_task, require_expert

from .diffusion import DiffusionBCConfig
from .dsrl import DSRLConfig
from .networks import ACTIVATIONS
from .ppo import PPOConfig
from .sac import SACConfig

CONFIG_DIR = Path(__file__).parent / "config"
ALGOS = {"ppo": PPOConfig, "sac": SACConfig, "diffusion_bc": DiffusionBCConfig, "dsrl": DSRLConfig}


@dataclass
class RunConfig:
    """Top-level run settings (``python -m policies.train key=value ...``)."""

    task: Any = None  # task group: task/<name>.yaml
    algo: Any = None  # algorithm group: algo/<name>.yaml
    seed: int = 0
    device: str = "cpu"  # torch device for simulation and learning, e.g. cuda
    threads: int = 2  # torch CPU threads
    run_dir: Optional[str] = None  # default runs/<task>/<algo>_seed<seed>_<time>
    resume: Optional[str] = None  # run directory to continue from its last checkpoint
    # The next four default (None) to the task's values (sim/registry.py: quadrotor 200M steps,
    # every 500k, stop at 0.95 confirmed in torch, MuJoCo and PyBullet; manipulation 50k steps, every
    # 5k, never stop early). Offline algorithms (diffusion_bc) count their own budget in gradient steps.
    # Budget in environment steps (all envs together), checked after each iteration: a run trains whole
    # iterations (PPO: num_envs x horizon env steps), so it ends at the first multiple at or past the budget.
    max_env_steps: Optional[int] = None
    eval_every_steps: Optional[int] = None  # evaluate (the task's criterion) and checkpoint this often
    # stop at the first evaluation with this success rate that new episodes confirm in every
    # simulator of confirm_backends (0: never stop early)
    stop_at_success: Optional[float] = None
    # Simulators the confirmation runs in, confirm_episodes new episodes each, a different set in
    # each (the hover criterion asks >= 95 % in all three). By the binomial law a policy at 92 %
    # passes one set of 100 at >= 95 % with probability 0.18, three independent ones with 0.006;
    # one at 97 % passes three with 0.78.
    confirm_backends: Optional[list[str]] = None
    confirm_episodes: int = 100
    max_seconds: float = 1800.0  # wall-clock budget
    eval_episodes: int = 100
    eval_at_start: bool = False  # also evaluate before the first update (the start of a learning curve)
    checkpoint_every_seconds: float = 30.0  # also checkpoint this often between evaluations
    progress: bool = True  # progress bar
    log_every_seconds: float = 60.0  # with progress=false (logs), a line of the steps, rate and reward this often


# Keys a resumed run may change: budgets and presentation, never what is learned.
RESUMABLE_OVERRIDES = {"max_env_steps", "max_seconds", "progress", "resume", "threads", "stop_at_success",
                       "confirm_backends", "confirm_episodes", "eval_every_steps", "checkpoint_every_seconds",
                       "eval_at_start", "log_every_seconds"}


def is_offline(algo_cfg) -> bool:
    """Whether an algorithm (its config) learns offline, from a dataset: its budget and its evaluations
    count gradient steps (``gradient_steps``, ``eval_every_updates``), the environment is only evaluated."""
    return "gradient_steps" in algo_cfg


class UserError(Exception):
    """A mistake the user can fix; printed as one line, no traceback."""


def _register_schemas() -> None:
    """Typed schemas for Hydra: the run's and every algorithm's. A task's comes when it is composed
    (:func:`_register_task_schema`): it imports the task's modules (sim/registry.py)."""
    cs = ConfigStore.instance()
    cs.store(name="run_schema", node=RunConfig)
    for name, schema in ALGOS.items():
        cs.store(group="algo", name=f"{name}_schema", node=schema)


_register_schemas()


def _register_task_schema(task: str) -> None:
    """The task's typed schema, holding its defaults (sim/registry.py: e.g. quad_track's 10 s
    episodes), so that its YAML file names the task and nothing else."""
    ConfigStore.instance().store(group="task", name=f"{task}_schema", node=get_task(task).default_config())


# The task of a command line that names none: config/config.yaml's default.
DEFAULT_TASK = next(d.task for d in OmegaConf.load(CONFIG_DIR / "config.yaml").defaults
                    if isinstance(d, DictConfig) and "task" in d)


# Short forms on the command line: base=<run> for algo.base=<run> (dsrl), dataset=<dir> for algo.dataset=<dir>.
SHORTHANDS = {"base": "algo.base", "dataset": "algo.dataset"}
PATH_KEYS = ("base", "dataset", "demos")  # algo fields naming a directory: stored absolute
# Algorithm settings (in the algorithms that have them) that must be at least 1, and those that must
# lie in a range (lo, hi, whether lo itself is allowed): outside them a run would fail later, halfway,
# or learn nothing without saying so.
ALGO_COUNTS = ("num_envs", "gradient_steps", "eval_every_updates", "horizon", "epochs", "minibatches",
               "batch_size", "buffer_size", "updates_per_iteration", "hidden", "pred_horizon", "diffusion_steps")
ALGO_RANGES = {"gamma": (0.0, 1.0, True), "gae_lambda": (0.0, 1.0, True), "tau": (0.0, 1.0, False),
               "clip": (0.0, math.inf, False), "init_alpha": (0.0, math.inf, False),  # log(alpha) is learnt
               # a learning rate of 0 freezes that network (tests use it)
               "lr": (0.0, math.inf, True), "actor_lr": (0.0, math.inf, True), "critic_lr": (0.0, math.inf, True),
               "alpha_lr": (0.0, math.inf, True),
               # PPO's adaptive learning rate climbs to max_lr (a negative one ascends the loss); a negative
               # gradient-norm bound flips the gradient (clip_grad_norm_ scales by it)
               "max_lr": (0.0, math.inf, False), "max_grad_norm": (0.0, math.inf, False),
               "desired_kl": (0.0, math.inf, True)}


def held_files(path: Path, ignore: tuple[str, ...] = ()) -> str:
    """The names in directory ``path`` (but ``ignore``), the first three and "..." for more; "" where it
    is empty or absent: for the errors of commands that write only into a new or empty directory."""
    names = sorted(p.name for p in path.iterdir() if p.name not in ignore) if path.is_dir() else []
    return ", ".join(names[:3]) + (", ..." if len(names) > 3 else "")


def exit_code(main) -> int:
    """``main()`` of a command-line entry point, or 130 (the shell's code for SIGINT) with one line instead
    of a traceback when Ctrl-C stops it."""
    try:
        return main()
    except KeyboardInterrupt:
        print("interrupted (Ctrl-C)", file=sys.stderr)
        return 130


def help_requested(argv: list[str], usage: str) -> bool:
    """``-h`` / ``--help`` anywhere on a command line: print ``usage`` and say so (the caller exits 0)."""
    if any(a in ("-h", "--help") for a in argv):
        print((usage or "").strip())  # a module docstring is None under python -OO
        return True
    return False


def train_usage() -> str:
    """What ``python -m policies.train --help`` prints."""
    return f"""usage: python -m policies.train [key=value ...]

  task=<name>        {', '.join(sorted(TASKS))} (default {DEFAULT_TASK})
  algo=<name>        {', '.join(sorted(ALGOS))} (default ppo)
  seed=0 device=cpu|cuda threads=<n> progress=true|false
  max_env_steps=<n> max_seconds=<s> eval_every_steps=<n> eval_episodes=<n> stop_at_success=<rate>
  confirm_backends=[<simulator>,...] (default: the task's) confirm_episodes=<n>
  eval_at_start=false checkpoint_every_seconds=<s> log_every_seconds=<s> (with progress=false)
  run_dir=<dir>      (default runs/<task>/<algo>_seed<seed>_<time>, linked from runs/latest)
  resume=<run_dir>   continue a killed run from its last checkpoint
  base=<run_dir>     the diffusion base that algo=dsrl steers; dataset=<dir> the demonstrations of diffusion_bc
  task.<field>=value, algo.<field>=value: any field of the task's and the algorithm's config
                     (policies/config/task/, policies/config/algo/; typed in the task's file under
                     sim/ and in policies/<algo>.py); the run's own fields: policies/config.py (RunConfig)
"""


def expand_shorthands(overrides: list[str]) -> list[str]:
    """base=<run> -> algo.base=<run>, dataset=<dir> -> algo.dataset=<dir>; other overrides as given."""
    return [SHORTHANDS[o.split("=", 1)[0]] + "=" + o.split("=", 1)[1] if o.split("=", 1)[0] in SHORTHANDS
            and "=" in o else o for o in overrides]


def compose_config(overrides: list[str]) -> DictConfig:
    """Compose the run config from YAML + command-line overrides, validated against the schemas."""
    given, overrides = overrides, expand_shorthands(overrides)
    for o in overrides:
        key, _, value = o.partition("=")
        if key.startswith(("+", "~")):  # Hydra's key addition and deletion: a typo would be kept and never read
            raise UserError(f"override '{o}': adding (+) or deleting (~) config keys is not supported; every "
                            f"setting already exists (see policies/config/ and the task's config class)")
        if key.startswith("hydra."):  # Hydra's own settings: this entry point has its own run_dir
            raise UserError(f"override '{o}': hydra.* settings are not used here (the run directory is run_dir=)")
        if key in ("task.name", "algo.name"):  # the schema and defaults come from task= / algo=: a name alone mixes them
            group = key.split(".")[0]
            raise UserError(f"override '{o}': choose the {group} with {group}=<name>, not {key}=")
        if key == "task" and value not in TASKS:
            raise UserError(f"unknown task '{value}'. Valid tasks: {', '.join(sorted(TASKS))}")
        if key == "algo" and value not in ALGOS:
            raise UserError(f"unknown algo '{value}'. Valid algos: {', '.join(sorted(ALGOS))}")
        if "=" not in o or not key:
            raise UserError(f"override '{o}' is not of the form key=value")
    _register_task_schema(next((o.split("=", 1)[1] for o in reversed(overrides) if o.split("=", 1)[0] == "task"),
                               DEFAULT_TASK))
    try:
        with initialize_config_dir(str(CONFIG_DIR), version_base="1.3"):
            cfg = compose("config", overrides=overrides)
    except (HydraException, OmegaConfBaseException) as e:
        text = _first_lines(e)
        algo = next((o.split("=", 1)[1] for o in reversed(overrides) if o.split("=", 1)[0] == "algo"), "ppo")
        for short, owner in (("base", "dsrl"), ("dataset", "diffusion_bc")):  # typed as base= / dataset=
            typed = next((o for o in given if o.startswith(f"{short}=")), None)
            if f"Key '{short}' not in" in text and typed is not None:
                raise UserError(f"{typed}: algo={algo} takes no {short} (it is algo={owner}'s)") from None
        raise UserError(f"bad override: {text}") from None
    for k, v in get_task(cfg.task.name).run_defaults.items():
        if cfg[k] is None:
            cfg[k] = v
    if cfg.algo.get("dataset") == "":  # the default: where policies.collect writes by default
        cfg.algo.dataset = f"data/{cfg.task.name}"
    for key in PATH_KEYS:  # read again by resumes and benchmarks, maybe from another working directory
        if cfg.algo.get(key):
            cfg.algo[key] = os.path.abspath(os.path.expanduser(cfg.algo[key]))  # symlinks kept as given
    check_finite(cfg)
    if cfg.algo.name in ("diffusion_bc", "dsrl"):
        does = "steers a diffusion policy learnt" if cfg.algo.name == "dsrl" else "learns"
        try:
            require_expert(cfg.task.name, f"algo={cfg.algo.name} {does} from a scripted expert's demonstrations")
        except ValueError as e:
            raise UserError(str(e)) from None
    if is_offline(cfg.algo):
        steps = [o for o in given if o.split("=", 1)[0] in ("max_env_steps", "eval_every_steps")]
        if steps:
            raise UserError(f"{steps[0]}: algo={cfg.algo.name} takes no environment steps (it learns offline); its "
                            f"budget is algo.gradient_steps, its evaluations every algo.eval_every_updates")
    sims = get_task(cfg.task.name).backends
    if not cfg.confirm_backends or any(b not in sims for b in cfg.confirm_backends):
        raise UserError(f"confirm_backends={list(cfg.confirm_backends)}: expected one or more of {', '.join(sims)} "
                        f"(the simulators {cfg.task.name} runs in)")
    if len(set(cfg.confirm_backends)) < len(cfg.confirm_backends):
        raise UserError(f"confirm_backends={list(cfg.confirm_backends)}: name each simulator once")
    counts = {k: cfg[k] for k in ("confirm_episodes", "eval_episodes", "threads", "max_env_steps", "eval_every_steps")}
    for key in ALGO_COUNTS:  # in the algorithms that have them
        if key in cfg.algo:
            counts[f"algo.{key}"] = cfg.algo[key]
    for key, value in counts.items():
        if value < 1:
            raise UserError(f"{key}={value}: expected at least 1")
    if "buffer_size" in cfg.algo and cfg.algo.buffer_size < cfg.algo.num_envs:
        # One step adds a row per environment: a ring smaller than that would overwrite rows of the same
        # write, which an index_put with repeated indices leaves unordered (on CUDA, not the newest).
        raise UserError(f"algo.buffer_size={cfg.algo.buffer_size}: expected at least algo.num_envs="
                        f"{cfg.algo.num_envs} (the rows one step adds)")
    for key, (lo, hi, closed_lo) in ALGO_RANGES.items():
        if key in cfg.algo:
            v = cfg.algo[key]
            if not ((v >= lo if closed_lo else v > lo) and v <= hi):
                raise UserError(f"algo.{key}={v}: expected a value in {'[' if closed_lo else '('}{lo:g}, {hi:g}]")
    for key in ("actor_hidden", "critic_hidden"):  # layer widths of the algorithms' MLPs
        if key in cfg.algo and not all(w >= 1 for w in cfg.algo[key]):
            raise UserError(f"algo.{key}={list(cfg.algo[key])}: expected layer widths of at least 1")
    if "activation" in cfg.algo and cfg.algo.activation not in ACTIVATIONS:
        raise UserError(f"algo.activation={cfg.algo.activation}: expected one of {', '.join(ACTIVATIONS)}")
    if not 0.0 <= cfg.stop_at_success <= 1.0:
        raise UserError(f"stop_at_success={cfg.stop_at_success}: expected a success rate in [0, 1] (0: never stop early)")
    if not cfg.max_seconds > 0:
        raise UserError(f"max_seconds={cfg.max_seconds}: expected > 0")
    for key in ("checkpoint_every_seconds", "log_every_seconds"):
        if not cfg[key] > 0:
            raise UserError(f"{key}={cfg[key]}: expected > 0")
    check_device(cfg.device)
    return cfg


def check_finite(node, path: str = "") -> None:
    """UserError naming the first NaN or infinite number of the configuration: no setting of a task or an
    algorithm means one (an infinite episode, a NaN range or learning rate would fail or learn nothing later)."""
    is_dict = isinstance(node, DictConfig)
    for key, value in node.items_ex(resolve=True) if is_dict else enumerate(node):
        name = (f"{path}.{key}" if path else str(key)) if is_dict else f"{path}[{key}]"
        if isinstance(value, (DictConfig, ListConfig)):
            check_finite(value, name)
        elif isinstance(value, float) and not math.isfinite(value) and not (name == "max_seconds" and value > 0):
            raise UserError(f"{name}={value}: expected a finite number")  # (max_seconds=inf: no time limit)


def check_device(name: str) -> None:
    """A device torch knows and this machine has, or a UserError naming it."""
    try:
        device = torch.device(name)
    except RuntimeError:
        raise UserError(f"device={name}: expected a torch device such as cpu, cuda or cuda:1") from None
    if device.type == "cuda" and not torch.cuda.is_available():
        raise UserError(f"device={name}: this machine has no CUDA device (torch {torch.__version__}); use device=cpu")
    if device.type == "cuda" and device.index is not None and device.index >= torch.cuda.device_count():
        raise UserError(f"device={name}: this machine has {torch.cuda.device_count()} CUDA device(s)")
    if device.type not in ("cpu", "cuda"):
        raise UserError(f"device={name}: expected cpu or cuda (the simulators and trainers run on those)")


def ieee_float32_on(device: torch.device) -> None:
    """On CUDA, float32 convolutions and matrix products in IEEE single precision, as on the CPU: cuDNN
    runs float32 convolutions in TF32 (a 10-bit mantissa) by default on Ampere and newer GPUs, and the
    diffusion policy's DDIM amplifies rounding up to ~100-fold (policies/diffusion.py), so the
    noise-to-action map DSRL steers (a U-Net base's) would be coarser on a GPU. Process-wide."""
    if device.type == "cuda":
        # cuDNN by its older flag: after the newer cudnn.*.fp32_precision, torch 2.13 raises on every read of
        # cudnn.allow_tf32 (pytorch issue 179445), which inductor's convolution templates make
        torch.backends.cudnn.allow_tf32 = False
        torch.backends.cuda.matmul.fp32_precision = "ieee"


def _first_lines(e: Exception) -> str:
    msgs = []
    while e is not None:
        text = " ".join(line.strip() for line in str(e).splitlines() if line.strip() and "full_key" not in line
                        and "object_type" not in line and "reference_type" not in line
                        and not line.strip().startswith("To append to your config use +"))  # refused above
        if text and text not in msgs:
            msgs.append(text)
        e = e.__cause__
    return ": ".join(msgs)


# Task keys added after runs were first saved, each with the value a run saved without it trained with
# (not today's default): a resumed, evaluated or exported run of an older revision keeps its behaviour.
LEGACY_TASK_VALUES = {"randomization.hard_fraction": 0.0, "randomization.latency_margin": 0.0,
                      "randomization.min_latency_steps": 0.0}


def to_objects(cfg: DictConfig) -> tuple[Any, Any]:
    """Typed task and algorithm config objects from a composed or saved (plain) config; a saved one
    that this version's config classes do not accept (a key or task of another revision) raises
    UserError. A saved one without a key of LEGACY_TASK_VALUES takes the value given there."""
    try:
        schema = OmegaConf.structured(get_task(cfg.task.name).config_cls)
        task = OmegaConf.merge(schema, cfg.task)
        for key, value in LEGACY_TASK_VALUES.items():
            if OmegaConf.select(schema, key) is not None and OmegaConf.select(cfg.task, key) is None:
                OmegaConf.update(task, key, value)
        algo = OmegaConf.merge(OmegaConf.structured(ALGOS[cfg.algo.name]), cfg.algo)
        return OmegaConf.to_object(task), OmegaConf.to_object(algo)
    except (OmegaConfBaseException, UnknownTaskError, KeyError) as e:
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise UserError(f"the run's config does not fit this version's config classes ({first})") from None


def config_hash(cfg: DictConfig) -> str:
    """Hash of everything that affects learning (budgets and paths excluded)."""
    d = OmegaConf.to_container(cfg, resolve=True)
    for k in RESUMABLE_OVERRIDES | {"run_dir", "eval_every_steps", "eval_episodes", "stop_at_success",
                                    "checkpoint_every_seconds"}:
        d.pop(k, None)
    return hashlib.sha256(json.dumps(d, sort_keys=True).encode()).hexdigest()[:16]


def diff_keys(a: Any, b: Any, prefix: str = "") -> list[str]:
    """Dotted keys whose values differ between two plain containers."""
    if isinstance(a, dict) and isinstance(b, dict):
        out = []
        for k in sorted(set(a) | set(b)):
            out += diff_keys(a.get(k), b.get(k), f"{prefix}{k}.")
        return out
    return [] if a == b else [prefix.rstrip(".")]
