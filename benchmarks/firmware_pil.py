"""Firmware numbers for an exported policy: Cortex-M4 cross-build sizes, and the closed loop
through the emulated STM32F405 (QEMU netduinoplus2): hover criterion over 20 episodes, largest
difference to onnxruntime, instructions per policy step, and instructions per step of the onboard
glue (cf_policy_glue's cfp_update, called every 1 ms stabilizer step) with and without the policy.

    python -m benchmarks.firmware_pil [run_dir] [--no-write]   (default: the shipped policies/pretrained/quad_hover)

The policy is exported into a temporary copy of the run (its own export/ stays as it is).
"""

from __future__ import annotations

import argparse
import shutil
import sys
import tempfile
from pathlib import Path

import numpy as np
from omegaconf import OmegaConf

from benchmarks.common import load_run_policy, write_section
from firmware.build import cross_sizes
from firmware.pil import GLUE_MODES, McuPolicy
from policies import checkpoint as ckpt
from policies.config import to_objects
from policies.evaluate import evaluate_hover
from policies.export import export_run

ROOT = Path(__file__).resolve().parents[1]
PRETRAINED = ROOT / "policies/pretrained/quad_hover"
GLUE_STEPS = 1000  # 1 s of stabilizer steps (1 kHz), 100 of them with the policy


def glue_instructions(mcu: McuPolicy) -> tuple[np.ndarray, np.ndarray]:
    """Instructions of the onboard glue's cfp_update on the MCU over GLUE_STEPS stabilizer steps of a
    vehicle hovering at its fresh position setpoint (1 m up, level, at rest): on the steps that run the
    policy (the engaging step and every 10th after it) and on those that hold its action."""
    zeros, pos = np.zeros(3), np.array([0.0, 0.0, 1.0])
    with_policy, held = [], []
    for k in range(GLUE_STEPS):
        now = 10_000 + k  # ms, and the stabilizer step (1 kHz)
        out = mcu.glue_step(pos, (1.0, 0.0, 0.0, 0.0), zeros, zeros, pos, zeros, now, now)
        if GLUE_MODES[out.mode] != "policy" or out.rc != 0:
            sys.exit(f"error: the glue left policy mode at step {k} ({GLUE_MODES[out.mode]}, rc {out.rc})")
        (with_policy if k % 10 == 0 else held).append(out.instructions)
    return np.asarray(with_policy), np.asarray(held)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("run_dir", nargs="?", default=str(PRETRAINED), help="a quad_hover run (default: the shipped one)")
    ap.add_argument("--no-write", action="store_true")
    args = ap.parse_args()
    run_dir = Path(args.run_dir)
    actor, _ = load_run_policy(run_dir, "Actor", "algo=ppo or algo=sac")
    shape = "-".join(map(str, [actor.spec["obs_dim"], *actor.spec["hidden"], actor.spec["act_dim"]]))
    with tempfile.TemporaryDirectory() as tmp:
        # exported into a copy of the run: the run's own export/ (tracked files, for the shipped one) stays
        work = Path(tmp) / "run"
        (work / "checkpoints").mkdir(parents=True)
        shutil.copy(run_dir / "config.yaml", work / "config.yaml")
        shutil.copy(run_dir / ckpt.BEST, work / ckpt.BEST)
        export = export_run(work)
        if not export["ok"]:
            sys.exit(f"error: the export of {run_dir} failed its check: {export}")
        export_dir = export["onnx"].parent
        sizes = cross_sizes(export_dir, Path(tmp) / "build")
        task_cfg, _ = to_objects(OmegaConf.load(run_dir / "config.yaml"))
        with McuPolicy(export_dir, Path(tmp) / "pil") as mcu:
            res = evaluate_hover(mcu, task_cfg, episodes=20, seed=777)
            stats = mcu.stats
            glue_policy, glue_held = glue_instructions(mcu)
    ins = np.asarray(stats.instructions)
    shown = run_dir.resolve().relative_to(ROOT) if run_dir.resolve().is_relative_to(ROOT) else run_dir
    body = f"""Policy: `{shown}` (MLP {shape}, {actor.spec["activation"]}).

| quantity | value |
|---|---|
| Cortex-M4 cross-build (`arm-none-eabi-gcc -mcpu=cortex-m4 -mthumb -mfloat-abi=hard -mfpu=fpv4-sp-d16 -O2`), policy core + glue | text {sizes['text']} B, data {sizes['data']} B, bss {sizes['bss']} B |
| closed loop on the emulated MCU (torch simulator), 20 episodes, hover criterion | {res.summary().replace('|', ';')} |
| max abs difference MCU vs onnxruntime over {stats.steps} steps | {stats.max_abs_diff:.2e} (errors: {stats.errors}) |
| instructions per policy step | mean {ins.mean():.0f}, min {ins.min():.0f}, max {ins.max():.0f} (target <= 20k) |
| instructions per onboard glue step (`cfp_update`, every 1 ms stabilizer step; {GLUE_STEPS} steps hovering at the setpoint): running the policy (every 10th) / holding its action | mean {glue_policy.mean():.0f}, max {glue_policy.max():.0f} / mean {glue_held.mean():.0f}, max {glue_held.max():.0f} |
| wall time per MCU exchange (QEMU on this machine) | {stats.seconds_per_step * 1e3:.2f} ms |

Instruction count method: QEMU runs with `-icount shift=5` (every guest instruction advances
virtual time by exactly 32 ns); the image reads SysTick (168 MHz core clock) around
`policy_step`, subtracts the cost of an empty measurement and divides by 5.376 ticks per
instruction. Cross-checked against an exact single-stepped trace (`-singlestep -d exec`) of the
self-test call in `tests/test_firmware.py`. These are instructions, not cycles: flash wait
states and FPU latencies of the real chip are not modelled."""
    print(body)
    if not args.no_write:
        command = "python -m benchmarks.firmware_pil" + ("" if run_dir.resolve() == PRETRAINED.resolve() else f" {shown}")
        write_section("Firmware: size and processor-in-the-loop", command, body)


if __name__ == "__main__":
    main()
