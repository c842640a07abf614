"""Shared fixtures: a small seeded actor saved as a run directory, so export can be tested
end to end without training."""

from __future__ import annotations

import math
import os
import tempfile
from pathlib import Path

import pytest
import torch
from omegaconf import OmegaConf

from policies import checkpoint as ckpt
from policies.config import compose_config
from policies.networks import Actor
from sim.crazyflie.params import NOMINAL

# rcl writes a log file per ROS process (this one's and every node a test starts) into ~/.ros/log unless told
# otherwise: the test run's go to a directory of their own (deploy.testing.RosWorld gives each world one)
_ROS_LOGS = tempfile.TemporaryDirectory(prefix="robolearn_test_ros_logs_")
os.environ.setdefault("ROS_LOG_DIR", _ROS_LOGS.name)

# Fast DDS (the ROS wheels' middleware) keeps shared-memory segments, their lock files and port semaphores in
# /dev/shm, and leaves them behind when a participant ends without cleaning up (the nodes the ROS tests kill, stop or
# time out): ~50 files a suite run, ~10 MB, which filled a container's 64 MB /dev/shm within a few runs. The ones the
# session created and no process still has open or mapped are removed at its end.
_SHM = Path("/dev/shm")
_SHM_PATTERNS = ("fastdds_*", "sem.fastdds_*")


def _fastdds_shm_files() -> set[Path]:
    return {f for pattern in _SHM_PATTERNS for f in _SHM.glob(pattern)} if _SHM.is_dir() else set()


def _shm_files_in_use() -> set[Path]:
    """Files under /dev/shm that a live process has open or mapped (read from /proc)."""
    used: set[Path] = set()
    for proc in Path("/proc").glob("[0-9]*"):
        try:
            used.update(Path(line.split(maxsplit=5)[5].strip()) for line in (proc / "maps").read_text().splitlines()
                        if "/dev/shm/" in line)
            for fd in (proc / "fd").iterdir():
                target = os.readlink(fd)
                if target.startswith("/dev/shm/"):
                    used.add(Path(target))
        except (OSError, IndexError):  # a process that ended meanwhile, or one not ours to read
            continue
    return used


_SHM_BEFORE = _fastdds_shm_files()


def pytest_sessionfinish(session, exitstatus) -> None:
    for f in _fastdds_shm_files() - _SHM_BEFORE - _shm_files_in_use():
        f.unlink(missing_ok=True)


HOVER_ACTION = NOMINAL.hover_action  # the action that hovers the nominal Crazyflie, as the trainer initialises it


def make_actor(activation: str = "tanh", seed: int = 0, obs_dim: int = 22, state_dependent_std: bool = False,
               act_dim: int = 4) -> Actor:
    """Actor with seeded weights large enough that actions span [-1, 1] (a fresh Actor's output
    layer is ~0, which would make every parity check trivially pass), and a normaliser whose
    mean and variance differ per feature so a wrong normalisation shows up. ``state_dependent_std``:
    SAC's actor, whose last layer also gives the log std."""
    torch.manual_seed(seed)
    actor = Actor(obs_dim=obs_dim, act_dim=act_dim, hidden=[32, 32], activation=activation, init_action=HOVER_ACTION,
                  state_dependent_std=state_dependent_std)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for m in actor.net:
            if isinstance(m, torch.nn.Linear):
                m.weight.copy_(torch.randn(m.weight.shape, generator=g) * 1.5 / math.sqrt(m.in_features))
                m.bias.copy_(0.2 * torch.randn(m.bias.shape, generator=g))
        norm = actor.obs_norm
        norm.mean.copy_(0.5 * torch.randn(obs_dim, generator=g))
        norm.var.copy_(torch.empty(obs_dim).uniform_(0.05, 4.0, generator=g))
        norm.count.fill_(1e5)
    return actor.eval()


@pytest.fixture(scope="session")
def run_dir(tmp_path_factory) -> Path:
    """A minimal run directory as policies.train leaves it: config.yaml + checkpoints/best.pt."""
    d = tmp_path_factory.mktemp("run")
    cfg = compose_config([])
    OmegaConf.save(cfg, d / "config.yaml")
    eval_result = {"success_rate": 0.5, "episodes": 10}
    ckpt.save_atomic(ckpt.policy_record(make_actor(), cfg, eval_result, steps=12345), d / ckpt.BEST)
    return d
