"""Demonstration datasets on disk: what ``python -m policies.collect`` writes and what behaviour
cloning (``algo=diffusion_bc``) and DSRL-NA (demonstrations in the replay buffer) read.

Format ``robolearn-demos-v1``, a directory with two files:

``meta.json``
    format, task name and the task config the data was collected with, observation and action
    sizes, number of episodes and of successful ones, the expert's noise, seed, control period
    (s), creation time and source revision.
``data.npz`` (NumPy, uncompressed), all episodes concatenated along the first axis (T steps):
    ``obs`` [T, D] float32      policy observation at each step (as the policy saw it, noisy; its
                                 cube pose from the task config's ``obs_source``)
    ``critic`` [T, Dc] float32  privileged critic observation at the same step
    ``action`` [T, A] float32   action taken, in the action space's units ([-1, 1])
    ``reward`` [T] float32      reward received for that action
    ``success`` [T] bool        task success reached by that action
    ``terminal`` [T] bool       the episode terminated (not truncated) after that action
    ``episode_ends`` [E] int64  exclusive end index of each episode (episode i spans
                                 episode_ends[i-1]..episode_ends[i])
    ``image`` [T, C, H, W]      optional, when the task's camera was on (uint8 rgb / float32 depth)
"""

from __future__ import annotations

import hashlib
import json
import os
import time
import zipfile
from dataclasses import dataclass
from pathlib import Path

import numpy as np

FORMAT = "robolearn-demos-v1"
REQUIRED = ("obs", "critic", "action", "reward", "success", "terminal", "episode_ends")


class DatasetError(Exception):
    """A dataset that is missing, malformed or made for another task."""


@dataclass
class Demonstrations:
    obs: np.ndarray
    critic: np.ndarray
    action: np.ndarray
    reward: np.ndarray
    success: np.ndarray
    terminal: np.ndarray
    episode_ends: np.ndarray
    meta: dict
    image: np.ndarray | None = None

    @property
    def num_episodes(self) -> int:
        return len(self.episode_ends)

    def episode_slices(self) -> list[slice]:
        starts = np.concatenate(([0], self.episode_ends[:-1]))
        return [slice(int(s), int(e)) for s, e in zip(starts, self.episode_ends)]

    def episode_success(self) -> np.ndarray:
        return np.array([self.success[s].any() for s in self.episode_slices()])

    def first(self, episodes: int) -> "Demonstrations":
        """The first ``episodes`` episodes (all when 0 or more than there are)."""
        if episodes <= 0 or episodes >= self.num_episodes:
            return self
        end = int(self.episode_ends[episodes - 1])
        cut = {k: getattr(self, k)[:end] for k in REQUIRED if k != "episode_ends"}
        meta = {**self.meta, "episodes": episodes, "steps": end,
                "successes": int(self.episode_success()[:episodes].sum())}
        return Demonstrations(**cut, episode_ends=self.episode_ends[:episodes].copy(), meta=meta,
                              image=None if self.image is None else self.image[:end])

    def digest(self) -> str:
        """SHA-256 (16 hex digits) of the per-step arrays and episode ends: what training reads."""
        h = hashlib.sha256()
        for k in REQUIRED:
            a = np.ascontiguousarray(getattr(self, k))
            h.update(f"{k}{a.dtype}{a.shape}".encode())
            h.update(a.tobytes())
        return h.hexdigest()[:16]

    def action_chunks(self, horizon: int) -> np.ndarray:
        """[T, horizon, A]: the actions taken from each step on, padded past an episode's end
        by repeating its last action (for the arm's displacement commands that is a move that goes
        on, not a stop: the demonstrator never executed these, but a clone learns them as targets and
        executes them where success does not cut its chunk short), never crossing into the next episode."""
        out = np.empty((len(self.action), horizon, self.action.shape[1]), dtype=np.float32)
        for s in self.episode_slices():
            idx = np.minimum(np.arange(s.start, s.stop)[:, None] + np.arange(horizon), s.stop - 1)
            out[s] = self.action[idx]
        return out


def save(path: str | Path, episodes: list[dict[str, np.ndarray]], meta: dict) -> Path:
    """Write episodes (each a dict of the per-step arrays above, without episode_ends)."""
    if not episodes:
        raise DatasetError("no episodes to save")
    path = Path(path)
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError as e:  # e.g. out= names a file
        raise DatasetError(f"cannot write a dataset at '{path}': {e.strerror}") from None
    keys = [k for k in REQUIRED if k != "episode_ends"] + (["image"] if "image" in episodes[0] else [])
    arrays = {k: np.concatenate([e[k] for e in episodes]) for k in keys}
    arrays["episode_ends"] = np.cumsum([len(e["action"]) for e in episodes]).astype(np.int64)
    # Both files to temporary names first, then each into place, meta.json last: a collection killed
    # midway leaves the earlier dataset whole (or none), never new data beside old meta.
    with open(path / "data.npz.tmp", "wb") as f:
        np.savez(f, **arrays)
    successes = int(sum(bool(e["success"].any()) for e in episodes))
    meta = {"format": FORMAT, **meta, "episodes": len(episodes), "successes": successes,
            "steps": int(arrays["episode_ends"][-1]), "obs_dim": int(arrays["obs"].shape[1]),
            "critic_dim": int(arrays["critic"].shape[1]), "act_dim": int(arrays["action"].shape[1]),
            "created": time.strftime("%Y-%m-%dT%H:%M:%S%z")}
    (path / "meta.json.tmp").write_text(json.dumps(meta, indent=2))
    (path / "meta.json").unlink(missing_ok=True)  # no meta beside the new data until the new meta
    os.replace(path / "data.npz.tmp", path / "data.npz")
    os.replace(path / "meta.json.tmp", path / "meta.json")
    return path


# Task config fields a dataset's meta.json may lack (collected before they existed), with the value it had then
FIELDS_BEFORE = {"obs_source": "state"}


def load(path: str | Path, task: str | None = None, obs_dim: int | None = None,
         act_dim: int | None = None, critic_dim: int | None = None,
         collected_with: dict | None = None) -> Demonstrations:
    """Read a dataset; with ``task``/``obs_dim``/``act_dim``/``critic_dim`` given, refuse one made
    for another task (or, for ``critic_dim``, another critic layout: with or without latency); with
    ``collected_with`` ({task config field: value}), one collected with another value of a field, e.g.
    ``obs_source``: the cube pose from the simulator or the camera's estimate, the same floats, so only
    meta.json tells them apart."""
    path = Path(path)
    if not (path / "meta.json").is_file() or not (path / "data.npz").is_file():
        empty = not path.is_dir() or not any(path.iterdir())  # collect writes only into a new or empty directory
        raise DatasetError(f"no dataset at '{path}': expected meta.json and data.npz there (make one with python -m "
                           f"policies.collect task=<task> out={path if empty else '<a new directory>'})")
    try:
        meta = json.loads((path / "meta.json").read_text())
    except (ValueError, UnicodeDecodeError):
        raise DatasetError(f"{path}/meta.json is not readable JSON: re-collect the dataset") from None
    if not isinstance(meta, dict) or meta.get("format") != FORMAT:
        raise DatasetError(f"{path}: format '{meta.get('format') if isinstance(meta, dict) else meta}', "
                           f"expected '{FORMAT}'")
    try:
        with np.load(path / "data.npz") as z:
            missing = [k for k in REQUIRED if k not in z]
            if missing:
                raise DatasetError(f"{path}/data.npz lacks {', '.join(missing)}")
            arrays = {k: z[k] for k in z.files}
    except (OSError, ValueError, zipfile.BadZipFile, EOFError) as e:
        raise DatasetError(f"{path}/data.npz is damaged ({type(e).__name__}): re-collect the dataset") from None
    ends = arrays["episode_ends"]
    if len(ends) == 0 or ends[0] <= 0 or (np.diff(ends) <= 0).any():
        raise DatasetError(f"{path}/data.npz: its episode ends are not increasing step counts: re-collect the dataset")
    per_step = [k for k in REQUIRED if k != "episode_ends"] + (["image"] if "image" in arrays else [])
    if any(len(arrays[k]) != ends[-1] for k in per_step):
        raise DatasetError(f"{path}/data.npz: its arrays do not hold the {ends[-1]} steps its "
                           "episode ends say: re-collect the dataset")
    demos = Demonstrations(**{k: arrays[k] for k in REQUIRED}, meta=meta, image=arrays.get("image"))
    if task is not None and meta.get("task") != task:
        raise DatasetError(f"{path} holds '{meta.get('task')}' demonstrations, this run is task '{task}'")
    if obs_dim is not None and demos.obs.shape[1] != obs_dim:
        raise DatasetError(f"{path}: observations have {demos.obs.shape[1]} floats, the task has {obs_dim}")
    if critic_dim is not None and demos.critic.shape[1] != critic_dim:
        raise DatasetError(f"{path}: privileged observations have {demos.critic.shape[1]} floats, the task has "
                           f"{critic_dim} (the arm's critic grows with randomization.max_latency_steps: "
                           "collected with another?)")
    if act_dim is not None and demos.action.shape[1] != act_dim:
        raise DatasetError(f"{path}: actions have {demos.action.shape[1]} floats, the task has {act_dim}")
    made = meta.get("task_config", {})
    for key, value in (collected_with or {}).items():
        was = made.get(key, FIELDS_BEFORE.get(key))
        if was != value:
            raise DatasetError(f"{path} was collected with task.{key}={was}, this run has task.{key}={value}: "
                               f"set task.{key}={was} or collect with {value}")
    return demos
