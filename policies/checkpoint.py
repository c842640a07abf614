"""Checkpoints: atomic writes, clear errors on a missing or corrupt file, and loading the
deployable policy from a run directory (used by eval, export and deployment)."""

from __future__ import annotations

import os
from pathlib import Path

import torch
from omegaconf import OmegaConf

from .networks import Actor

LAST = "checkpoints/last.pt"  # full training state, for resume
BEST = "checkpoints/best.pt"  # actor of the confirmed pass, else of the best evaluation so far; for eval/export
REPLAY = "checkpoints/replay"  # an off-policy run's replay rows, in segments last.pt refers to (policies/replay.py)
# A new best policy is written here first, then last.pt (which records the evaluation), then renamed
# to best.pt: a kill between the two writes never leaves a best.pt that last.pt knows nothing about.
BEST_PENDING = "checkpoints/best.pending.pt"


class CheckpointError(Exception):
    pass


def save_atomic(obj: dict, path: Path) -> None:
    """Write to a temporary file and rename, so a kill never leaves a half-written checkpoint."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(path.suffix + ".tmp")
    torch.save(obj, tmp)
    with open(tmp, "rb") as f:
        os.fsync(f.fileno())
    os.replace(tmp, path)


def settle_best(run_dir: Path, evals: list[dict], unit: str = "env_steps") -> None:
    """Finish or drop a best policy written before a kill (``evals``: the evaluations last.pt
    holds): promoted to best.pt if last.pt recorded its evaluation, else deleted (the resumed run
    evaluates that point again)."""
    pending = run_dir / BEST_PENDING
    if not pending.is_file():
        return
    try:
        rec = torch.load(pending, map_location="cpu", weights_only=False)
        recorded = bool(evals) and rec.get(unit) == evals[-1][unit]
    except Exception:  # a damaged file is not a policy to keep
        recorded = False
    if recorded:
        os.replace(pending, run_dir / BEST)
    else:
        pending.unlink()


def is_rng_state_key(key) -> bool:
    """Whether the training state holds a random-generator state under ``key``: the naming rule is
    "gen", "<name>_gen" (torch.Generator.get_state) and "torch_rng" (torch.get_rng_state). Those are
    CPU byte tensors whatever the generator's device, and set_state refuses any other: they stay on
    the CPU when a checkpoint is loaded onto a GPU."""
    return isinstance(key, str) and (key in ("gen", "torch_rng") or key.endswith("_gen"))


def load(path: Path, device="cpu") -> dict:
    """The object saved at ``path``, its tensors on ``device`` (generator states on the CPU)."""
    if not path.is_file():
        raise CheckpointError(f"no checkpoint at {path}: train first (python -m policies.train ...)")
    try:
        obj = torch.load(path, map_location="cpu", weights_only=False)
    except Exception as e:  # torch raises many types for truncated/garbled files
        raise CheckpointError(f"checkpoint {path} is corrupt or unreadable ({type(e).__name__}); nothing was changed") from None
    return _to_device(obj, torch.device(device))


def _to_device(obj, device: torch.device, key: str | None = None):
    """``obj``'s tensors on ``device``, but for generator states and optimizer step counts: an optimizer
    places its ``step`` itself when it loads (on the parameters' device only where fused or capturable
    Adam needs it there; a non-fused Adam reads a CUDA step back to the host twice per tensor and step)."""
    if isinstance(obj, torch.Tensor):
        return obj if is_rng_state_key(key) or key == "step" else obj.to(device)
    if isinstance(obj, dict):
        return {k: _to_device(v, device, k) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(_to_device(v, device) for v in obj)
    return obj


def policy_record(policy: torch.nn.Module, cfg, eval_result: dict, steps: int, unit: str = "env_steps",
                  revisions: list[str] | None = None) -> dict:
    """A self-contained deployable policy: its class, constructor arguments and weights, how far its
    run had trained (``unit``: "env_steps", or "gradient_steps" for an offline algorithm), the
    version of the task's contract it was trained on (require_contract compares it) and the code
    revisions that trained it (``revisions``: one per session that changed it, oldest first)."""
    from sim.registry import get_task

    return {
        "policy_class": type(policy).__name__, "policy_spec": dict(policy.spec), "policy": policy.state_dict(),
        "eval": eval_result, unit: steps, "config": OmegaConf.to_container(cfg, resolve=True),
        "contract": get_task(cfg.task.name).contract.version, "source_revisions": list(revisions or ["unknown"]),
    }


def policy_classes() -> dict[str, type]:
    from .diffusion import DiffusionPolicy
    from .dsrl import SteeredDiffusionPolicy

    return {c.__name__: c for c in (Actor, DiffusionPolicy, SteeredDiffusionPolicy)}


def policy_from_record(rec: dict, where: Path, device="cpu") -> torch.nn.Module:
    """The policy a record describes (eval mode); a record this version's networks cannot hold
    (another class, constructor arguments or weight layout) is a CheckpointError naming ``where``."""
    classes = policy_classes()
    cls = rec.get("policy_class")
    if cls not in classes:
        raise CheckpointError(f"{where}: policy class '{cls}' is not one of {', '.join(classes)}")
    try:
        policy = classes[cls](**rec["policy_spec"]).to(device)
        policy.load_state_dict(rec["policy"])
    except (TypeError, KeyError, RuntimeError, ValueError) as e:  # e.g. saved by a revision with other networks
        first = (str(e).strip().splitlines() or [type(e).__name__])[0]
        raise CheckpointError(f"{where}: its {cls} does not fit this version's networks ({first}); "
                              f"train it again") from None
    return policy.eval()


def load_record(run_dir: str | Path, device="cpu") -> dict:
    """The record of a run's best policy (class, constructor arguments, weights, config, eval)."""
    if not Path(run_dir).is_dir():
        raise CheckpointError(f"{run_dir}: no such run directory")
    path = Path(run_dir) / BEST
    if not path.is_file():
        if (Path(run_dir) / path.name).is_file():  # <run>/checkpoints given for <run>
            raise CheckpointError(f"{run_dir}: give the run directory, not its checkpoints ({Path(run_dir).parent})")
        if not (Path(run_dir) / "config.yaml").is_file():
            raise CheckpointError(f"{run_dir} is not a run directory (no config.yaml, no {BEST}): expected one "
                                  f"made by python -m policies.train")
        raise CheckpointError(f"no checkpoint at {path} yet: the run has not finished its first evaluation "
                              f"(resume={run_dir} trains on)")
    rec = load(path, device)
    if not isinstance(rec, dict) or not isinstance(rec.get("config"), dict):
        raise CheckpointError(f"{path} is not a policy record of policies.train (no config in it)")
    return rec


def load_policy(run_dir: str | Path, device="cpu") -> tuple[torch.nn.Module, dict]:
    """The best policy of a run (eval mode) and its record (config, eval result, steps); one whose
    observation or action size is not its task's current contract's (trained on an earlier one) is a
    CheckpointError."""
    rec = load_record(run_dir, device)
    where = Path(run_dir) / BEST
    require_contract(rec, where)
    return policy_from_record(rec, where, device), rec


def require_contract(rec: dict, where: Path) -> None:
    """CheckpointError if the record's policy (a steered one: its base) does not take the observation
    and give the action its task's contract (sim/*/contract.py) now defines, or was trained on another
    version of it (a version can change what the same floats mean, e.g. the arm's dynamics in v3;
    records saved before versions were recorded: contract_version_problem)."""
    from sim.registry import UnknownTaskError, get_task

    task = (rec["config"].get("task") or {}).get("name")
    spec = rec.get("policy_spec") or {}
    spec = spec.get("base", spec)
    try:
        contract = get_task(task).contract
    except UnknownTaskError:
        raise CheckpointError(f"{where}: trained on task '{task}', which this version does not have") from None
    sizes = (spec.get("obs_dim"), spec.get("act_dim"))
    if sizes != (contract.obs_size, contract.action_size):
        raise CheckpointError(f"{where}: its policy takes {sizes[0]} observation and gives {sizes[1]} action floats; "
                              f"task '{task}' now has {contract.obs_size} and {contract.action_size} (contract "
                              f"{contract.version}): it was trained on an earlier contract, train it again")
    problem = contract_version_problem(rec.get("contract"), task, contract)
    if problem:
        raise CheckpointError(f"{where}: {problem}: train it again")


def contract_version_problem(trained_on: str | None, task: str, contract) -> str | None:
    """Why a policy (or a run) made under contract version ``trained_on`` does not fit ``task``'s
    ``contract`` now; None if it does. A record saved before versions were recorded (None, before
    2026-11-29) fits only a contract that never had another version."""
    if trained_on is None:
        if not contract.EARLIER_VERSIONS:
            return None
        return (f"it was saved before the contract's version was recorded, and task '{task}' has had "
                f"{', '.join(contract.EARLIER_VERSIONS)} before {contract.version}")
    if trained_on != contract.version:
        return (f"it was trained on contract {trained_on}; task '{task}' now has {contract.version} "
                "(the same sizes, other meaning)")
    return None


def require_unchanged(what: str, saved: str | None, current: str | None, run: str = "run") -> None:
    """Refuse a resume whose input ``what`` (a dataset, a base policy) has another digest than when
    the ``run`` started (None: none loaded)."""
    if saved != current:
        from .config import UserError

        raise UserError(f"{what} changed since this {run} started (digest {current}, {saved} when it started); "
                        "start a new run")
