"""Shared helpers for benchmarks: machine description and writing a section of BENCHMARKS.md."""

from __future__ import annotations

import os
import platform
import re
from datetime import date
from pathlib import Path

import torch

from export.onnx_policy import source_revision
from policies import checkpoint as ckpt

BENCHMARKS_MD = Path(__file__).resolve().parents[1] / "BENCHMARKS.md"


# The load average when the benchmark started (1, 5, 15 min): what else was running on this shared
# machine before it (the benchmark's own load comes after).
LOAD_AT_START = os.getloadavg()
# The checkout's revision when the benchmark started, the code its numbers were measured on (a run takes
# minutes to hours; a commit made meanwhile is named beside it when the section is written).
REVISION_AT_START = source_revision(short=True, ignore=(BENCHMARKS_MD.name,))  # the file written does not count


def machine(threads: int | None = None) -> str:
    """CPU, memory, Python, torch and the load average at the start; ``threads``: the torch threads the
    measured runs used (default: this process's)."""
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
            f"torch {torch.__version__} ({n} thread{'s' if n != 1 else ''}), load average at the start "
            f"{' / '.join(f'{x:.2f}' for x in LOAD_AT_START)} (1 / 5 / 15 min)")


def write_section(title: str, command: str, body: str, threads: int | None = None) -> None:
    """Put a new measurement at the top of the section ``## title`` of BENCHMARKS.md (appended
    if there is none); ``threads`` as in machine(). What the section held before stays below it,
    under a line that says so: a rerun never erases earlier results or the notes written by hand."""
    text = BENCHMARKS_MD.read_text() if BENCHMARKS_MD.exists() else "# Benchmarks\n"
    today = date.today().isoformat()
    revision = REVISION_AT_START
    now = source_revision(short=True, ignore=(BENCHMARKS_MD.name,))
    if now != revision:
        revision += f" (at the start; {now} when written)"
    section = (f"## {title}\n\nCommand: `{command}`  \nMachine: {machine(threads)}  \n"
               f"Date: {today}, revision {revision}\n\n{body.strip()}\n\n")
    pattern = re.compile(rf"^## {re.escape(title)}\n(.*?)(?=^## |\Z)", re.S | re.M)
    match = pattern.search(text)
    if match is None:
        text = text.rstrip() + "\n\n" + section
    else:
        earlier = (f"Earlier measurements of this section (before the one above, {today}):\n\n"
                   f"{match.group(1).strip()}\n\n")
        text = text[: match.start()] + section + earlier + text[match.end():]
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
