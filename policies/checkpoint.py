"""Checkpoints: atomic writes, clear errors on a missing or corrupt file, and loading the
deployable actor from a run directory (used by eval, export and deployment)."""

from __future__ import annotations

import os
from pathlib import Path

import torch
from omegaconf import OmegaConf

from .networks import Actor

LAST = "checkpoints/last.pt"  # full training state, for resume
BEST = "checkpoints/best.pt"  # actor with the best evaluation so far, for eval/export


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


def load(path: Path, device="cpu") -> dict:
    if not path.is_file():
        raise CheckpointError(f"no checkpoint at {path}: train first (python -m policies.train ...)")
    try:
        return torch.load(path, map_location=device, weights_only=False)
    except Exception as e:  # torch raises many types for truncated/garbled files
        raise CheckpointError(f"checkpoint {path} is corrupt or unreadable ({type(e).__name__}); nothing was changed") from None


def policy_record(actor: Actor, cfg, eval_result: dict, env_steps: int) -> dict:
    return {
        "actor_spec": dict(actor.spec), "actor": actor.state_dict(), "eval": eval_result,
        "env_steps": env_steps, "config": OmegaConf.to_container(cfg, resolve=True),
    }


def load_policy(run_dir: str | Path, device="cpu") -> tuple[Actor, dict]:
    """The best actor of a run (eval mode) and its record (config, eval result, steps)."""
    rec = load(Path(run_dir) / BEST, device)
    actor = Actor(**rec["actor_spec"]).to(device)
    actor.load_state_dict(rec["actor"])
    actor.eval()
    return actor, rec
