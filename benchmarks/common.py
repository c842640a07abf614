"""Shared helpers for benchmarks: machine description and writing a section of BENCHMARKS.md."""

from __future__ import annotations

import os
import platform
import re
import subprocess
from datetime import date
from pathlib import Path

import torch

from policies import checkpoint as ckpt

BENCHMARKS_MD = Path(__file__).resolve().parents[1] / "BENCHMARKS.md"


def machine(threads: int | None = None) -> str:
    """CPU, memory, Python and torch; ``threads``: the torch threads the measured runs used
    (default: this process's)."""
    cpu = "unknown CPU"
    try:
        for line in open("/proc/cpuinfo"):
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    n = threads or torch.get_num_threads()
    mem_gb = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30
    return (f"{os.cpu_count()} cores ({cpu}), {mem_gb:.0f} GB RAM, no GPU, Python {platform.python_version()}, "
            f"torch {torch.__version__} ({n} thread{'s' if n != 1 else ''})")


def revision() -> str:
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                              cwd=BENCHMARKS_MD.parent).stdout.strip() or "unknown"
    except OSError:
        return "unknown"


def write_section(title: str, command: str, body: str, threads: int | None = None) -> None:
    """Replace (or append) the section ``## title`` of BENCHMARKS.md; ``threads`` as in machine()."""
    text = BENCHMARKS_MD.read_text() if BENCHMARKS_MD.exists() else "# Benchmarks\n\nEvery number below was produced by the command written next to it.\n"
    section = (f"## {title}\n\nCommand: `{command}`  \nMachine: {machine(threads)}  \n"
               f"Date: {date.today().isoformat()}, revision {revision()}\n\n{body.strip()}\n\n")
    pattern = re.compile(rf"^## {re.escape(title)}\n.*?(?=^## |\Z)", re.S | re.M)
    text = pattern.sub(lambda _: section, text) if pattern.search(text) else text.rstrip() + "\n\n" + section
    BENCHMARKS_MD.write_text(text)


def load_run_policy(run: str | Path, policy_class: str, made_by: str) -> tuple[torch.nn.Module, dict]:
    """The best policy of ``run`` and its record, or exit with one line naming what is wrong: no
    such run, a corrupt checkpoint, or a policy of another class than ``policy_class`` (the run
    should have been made by ``made_by``, e.g. ``algo=diffusion_bc``)."""
    try:
        policy, rec = ckpt.load_policy(Path(run))
    except ckpt.CheckpointError as e:
        raise SystemExit(f"error: {run}: {e}") from None
    if rec.get("policy_class") != policy_class:
        raise SystemExit(f"error: {run} holds a '{rec.get('policy_class')}' policy; this benchmark needs the "
                         f"{policy_class} of an {made_by} run")
    return policy, rec
