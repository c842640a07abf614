"""Builds of the policy firmware, driven from Python (tests, PIL harness) and the command line.

    python -m firmware.build sizes <export_dir>     cross-compiled text/data/bss of policy + glue
    python -m firmware.build vehicle-header         regenerate crazyflie/src/cf_vehicle.h

Everything goes through ``firmware/Makefile`` so ``make`` and Python build the same thing.
"""

from __future__ import annotations

import subprocess
import sys
import tempfile
from pathlib import Path

from sim.crazyflie.params import NOMINAL

FIRMWARE_DIR = Path(__file__).resolve().parent
VEHICLE_HEADER = FIRMWARE_DIR / "crazyflie" / "src" / "cf_vehicle.h"

# STM32F405: 1 MB flash, 192 KB RAM (128 KB SRAM + 64 KB core-coupled).
FLASH_BYTES = 1024 * 1024
RAM_BYTES = 192 * 1024


class BuildError(Exception):
    """A firmware build step failed; the message carries the compiler's last lines."""


def check_export_dir(export_dir: str | Path) -> Path:
    """The export directory as an absolute path, or a clear error if it has no C policy."""
    d = Path(export_dir).resolve()
    missing = [f for f in ("policy.c", "policy.h") if not (d / f).is_file()]
    if missing and all((d / "export" / f).is_file() for f in ("policy.c", "policy.h")):  # the run given
        raise BuildError(f"{d} is a run directory: give its export, {d / 'export'}")
    if missing:
        raise BuildError(f"{d} has no {' or '.join(missing)}: export a run first "
                         f"(python -m policies.export <run_dir> writes <run_dir>/export/)")
    return d


def make(target: str, build_dir: Path, **variables: str | Path) -> str:
    """Run one target of firmware/Makefile, return its stdout; BuildError on failure."""
    args = ["make", "--no-print-directory", "-C", str(FIRMWARE_DIR), target, f"BUILD={Path(build_dir).resolve()}"]
    args += [f"{k}={v}" for k, v in variables.items()]
    try:
        res = subprocess.run(args, capture_output=True, text=True, timeout=300)
    except FileNotFoundError:
        raise BuildError("`make` is not installed") from None
    if res.returncode != 0:
        tail = "\n".join((res.stdout + res.stderr).strip().splitlines()[-25:])
        raise BuildError(f"make {target} failed (exit {res.returncode}):\n{tail}")
    return res.stdout


def run_host_tests(build_dir: Path, cc: str = "gcc") -> str:
    """Compile the glue and framing unit tests with the host compiler ``cc`` and run them."""
    return make("host-test", build_dir, HOST_CC=cc)


def cross_sizes(export_dir: str | Path, build_dir: Path) -> dict[str, int]:
    """text/data/bss bytes of policy.c + cf_policy_glue.c compiled for the Crazyflie's Cortex-M4F.

    Objects only: newlib's tanhf/expm1f are linked in by the firmware (see the PIL image size for
    a complete link)."""
    out = make("sizes", build_dir, POLICY_DIR=check_export_dir(export_dir))
    return parse_size_total(out)


def parse_size_total(size_output: str) -> dict[str, int]:
    """The "(TOTALS)" row of ``arm-none-eabi-size -t`` (or the only row for one file)."""
    rows = [line.split() for line in size_output.strip().splitlines() if line.strip()]
    data = [r for r in rows if r and r[0].isdigit()]
    if not data:
        raise BuildError(f"no size table in:\n{size_output}")
    text, dat, bss = (int(v) for v in data[-1][:3])
    return {"text": text, "data": dat, "bss": bss, "flash": text + dat, "ram": dat + bss}


def build_pil_image(export_dir: str | Path, build_dir: Path) -> Path:
    """The bare-metal QEMU image (qemu/) for this export; returns the ELF path."""
    make("qemu", build_dir, POLICY_DIR=check_export_dir(export_dir))
    return Path(build_dir).resolve() / "qemu" / "pil.elf"


def vehicle_header() -> str:
    """cf_vehicle.h: the simulator's vehicle constants the C controller needs (params.py is the source)."""
    return f"""/* Generated from sim/crazyflie/params.py by `python -m firmware.build vehicle-header`: do not edit.
 * tests/test_firmware.py fails when it is out of date. */
#ifndef CF_VEHICLE_H
#define CF_VEHICLE_H

/* Rotor thrust per rpm^2 of the simulated Crazyflie the policy was trained on, N/rpm^2. */
#define CF_KF {NOMINAL.kf:.9e}f

/* Action that commands the nominal hover speed on every rotor ({NOMINAL.hover_rpm:.1f} rpm); the
 * previous-action observation starts here, as at every training reset. */
#define CF_HOVER_ACTION {NOMINAL.hover_action:.9e}f

#endif
"""


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv == ["vehicle-header"]:
        VEHICLE_HEADER.write_text(vehicle_header())
        print(f"wrote {VEHICLE_HEADER}")
        return 0
    if len(argv) == 2 and argv[0] == "sizes":
        try:
            with tempfile.TemporaryDirectory(prefix="cf_sizes_") as build_dir:  # the checkout may be read-only
                s = cross_sizes(argv[1], Path(build_dir))
        except BuildError as e:
            print(f"error: {e}", file=sys.stderr)
            return 2
        print(f"policy + glue for Cortex-M4F: text {s['text']} B, data {s['data']} B, bss {s['bss']} B "
              f"(flash {s['flash'] / FLASH_BYTES:.2%} of 1 MB, RAM {s['ram'] / RAM_BYTES:.2%} of 192 KB)")
        return 0
    print("usage: python -m firmware.build sizes <export_dir> | vehicle-header", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main())
