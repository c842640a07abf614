"""Time to hover: wall time from the start of ``python -m policies.train task=quad_hover`` to the
first checkpoint that passes the hover criterion (>= 95 % of 100 episodes), for several seeds.

    python -m benchmarks.time_to_hover [--seeds 0 1 2] [--max-seconds 900]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from benchmarks.common import write_section

ROOT = Path(__file__).resolve().parents[1]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    ap.add_argument("--max-seconds", type=float, default=900)
    ap.add_argument("--no-write", action="store_true")
    args = ap.parse_args()
    rows = []
    for seed in args.seeds:
        run_dir = Path(tempfile.mkdtemp(prefix=f"tth_s{seed}_", dir=ROOT / "runs")) if (ROOT / "runs").is_dir() \
            else Path(tempfile.mkdtemp(prefix=f"tth_s{seed}_"))
        t0 = time.time()
        subprocess.run([sys.executable, "-m", "policies.train", "task=quad_hover", f"seed={seed}",
                        f"run_dir={run_dir}", f"max_seconds={args.max_seconds}", "progress=false"], cwd=ROOT, check=False)
        wall = time.time() - t0
        res = json.loads((run_dir / "results.json").read_text())
        first = next((e for e in res["evals"] if e["success_rate"] >= 0.95), None)
        rows.append({"seed": seed, "run_dir": str(run_dir), "time_to_success_s": res["time_to_success_s"], "wall_s": wall,
                     "env_steps": first["env_steps"] if first else None, "best": res["best_success"],
                     "final_error_cm": first["mean_final_error_m"] * 100 if first else None})
        print(rows[-1], flush=True)
    table = "| seed | time to first passing checkpoint [s] | env steps | success at that checkpoint | last-2 s mean error [cm] |\n|---:|---:|---:|---:|---:|\n"
    for r in rows:
        tts = f"{r['time_to_success_s']:.1f}" if r["time_to_success_s"] else f"not reached in {args.max_seconds:.0f} s"
        steps = f"{r['env_steps']:,}" if r["env_steps"] else "-"
        err = f"{r['final_error_cm']:.2f}" if r["final_error_cm"] else "-"
        table += f"| {r['seed']} | {tts} | {steps} | {r['best'] * 100:.0f}% | {err} |\n"
    note = ("Time is measured from process start (imports included) to the end of the evaluation that first "
            "passes the hover criterion on the torch backend (100 episodes, randomization and noise on); "
            "training stops there. Reference (from the issue): the Learning-to-Fly C++ recipe trains 300k "
            "steps in ~52 s on this kind of machine. Target: >= 95 % in <= 30 s.")
    if not args.no_write:
        write_section("Time to hover", "python -m benchmarks.time_to_hover --seeds " + " ".join(map(str, args.seeds)),
                      table + "\n" + note)


if __name__ == "__main__":
    main()
