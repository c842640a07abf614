"""Firmware numbers for an exported policy: Cortex-M4 cross-build sizes, and the closed loop
through the emulated STM32F405 (QEMU netduinoplus2): hover criterion over 20 episodes, largest
difference to onnxruntime, instructions per policy step.

    python -m benchmarks.firmware_pil [run_dir]   (default: the shipped policies/pretrained/quad_hover)
"""

from __future__ import annotations

import sys
import tempfile
from pathlib import Path

import numpy as np
from omegaconf import OmegaConf

from benchmarks.common import write_section
from firmware.build import cross_sizes
from firmware.pil import McuPolicy
from policies.config import to_objects
from policies.evaluate import evaluate_hover
from policies.export import export_run

ROOT = Path(__file__).resolve().parents[1]
PRETRAINED = ROOT / "policies/pretrained/quad_hover"


def main() -> None:
    run_dir = Path(sys.argv[1]) if len(sys.argv) > 1 else PRETRAINED
    export = export_run(run_dir)
    if not export["ok"]:
        sys.exit(f"error: the export of {run_dir} failed its check (files in {export['onnx'].parent}): {export}")
    export_dir = export["onnx"].parent
    with tempfile.TemporaryDirectory() as build:
        sizes = cross_sizes(export_dir, Path(build))
    task_cfg, _ = to_objects(OmegaConf.load(run_dir / "config.yaml"))
    with McuPolicy(export_dir) as mcu:
        res = evaluate_hover(mcu, task_cfg, episodes=20, seed=777)
        stats = mcu.stats
    ins = np.asarray(stats.instructions)
    body = f"""Policy: `{run_dir.relative_to(ROOT) if run_dir.is_relative_to(ROOT) else run_dir}` (MLP 22-32-32-4, tanh).

| quantity | value |
|---|---|
| Cortex-M4 cross-build (`arm-none-eabi-gcc -mcpu=cortex-m4 -mthumb -mfloat-abi=hard -mfpu=fpv4-sp-d16 -O2`), policy core + glue | text {sizes['text']} B, data {sizes['data']} B, bss {sizes['bss']} B |
| closed loop on the emulated MCU (torch simulator), 20 episodes, hover criterion | {res.summary().replace('|', ';')} |
| max abs difference MCU vs onnxruntime over {stats.steps} steps | {stats.max_abs_diff:.2e} (errors: {stats.errors}) |
| instructions per policy step | mean {ins.mean():.0f}, min {ins.min():.0f}, max {ins.max():.0f} (target <= 20k) |
| wall time per MCU exchange (QEMU on this machine) | {stats.seconds_per_step * 1e3:.2f} ms |

Instruction count method: QEMU runs with `-icount shift=5` (every guest instruction advances
virtual time by exactly 32 ns); the image reads SysTick (168 MHz core clock) around
`policy_step`, subtracts the cost of an empty measurement and divides by 5.376 ticks per
instruction. Cross-checked against an exact single-stepped trace (`-singlestep -d exec`) of the
self-test call in `tests/test_firmware.py`. These are instructions, not cycles: flash wait
states and FPU latencies of the real chip are not modelled."""
    write_section("Firmware: size and processor-in-the-loop", "python -m benchmarks.firmware_pil", body)
    print(body)


if __name__ == "__main__":
    main()
