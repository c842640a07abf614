"""A hover policy in closed loop in the three simulators: the same criterion episodes in torch,
MuJoCo and PyBullet (policies/evaluate.py: randomized vehicles, noise, latency, the initial-state
distribution), their success rates, the episodes where a simulator's verdict differs from torch's,
and how far its position error gets from torch's over the episodes.

    python -m benchmarks.closed_loop [run_dir] [--episodes 1000] [--no-write]

``run_dir`` defaults to the shipped policy, policies/pretrained/quad_hover.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import numpy as np
import torch
from omegaconf import OmegaConf

from benchmarks.common import load_run_policy, write_section
from policies.config import UserError, to_objects
from policies.evaluate import evaluate_hover
from sim.crazyflie.hover import BACKENDS
from sim.registry import get_task

ROOT = Path(__file__).resolve().parents[1]
SHIPPED = ROOT / "policies/pretrained/quad_hover"
BATCH = 100  # episodes per evaluation, the criterion's
FIRST_SEED = 5000  # batch k runs evaluate_hover(seed=FIRST_SEED + k)


def run(policy, task_cfg, episodes: int) -> dict[str, dict]:
    """Per simulator: success [episodes] bool, position error [T, episodes] m (NaN once an episode
    left the 1 m ball) and the wall time (s) of its evaluations."""
    out = {}
    for backend in BACKENDS:
        t0 = time.perf_counter()
        runs = [evaluate_hover(policy, task_cfg, BATCH, backend=backend, seed=FIRST_SEED + k)
                for k in range(episodes // BATCH)]
        out[backend] = {"success": np.concatenate([r.success for r in runs]),
                        "error": np.concatenate([r.position_error for r in runs], axis=1),
                        "seconds": time.perf_counter() - t0}
    return out


def table(res: dict[str, dict]) -> str:
    ref = res["torch"]
    rows = ["| simulator | success | episodes whose verdict differs from torch's (passes there, fails here "
            "/ the reverse) | largest position-error difference to torch [mm] | wall time [s] |",
            "|---|---:|---:|---:|---:|"]
    for backend, r in res.items():
        worse = int((ref["success"] & ~r["success"]).sum())
        better = int((~ref["success"] & r["success"]).sum())
        gap = np.abs(r["error"] - ref["error"])
        same_exits = np.array_equal(np.isnan(r["error"]), np.isnan(ref["error"]))
        gap_mm = f"{np.nanmax(gap) * 1e3:.2f}" + ("" if same_exits else " (episodes leave at other steps)")
        rows.append(f"| {backend} | {r['success'].mean() * 100:.1f} % | {worse} / {better} | "
                    f"{gap_mm if backend != 'torch' else '-'} | {r['seconds']:.1f} |")
    return "\n".join(rows)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("run_dir", nargs="?", default=str(SHIPPED))
    ap.add_argument("--episodes", type=int, default=1000, help=f"a multiple of {BATCH}")
    ap.add_argument("--no-write", action="store_true")
    args = ap.parse_args()
    if args.episodes < BATCH or args.episodes % BATCH:
        raise SystemExit(f"error: --episodes {args.episodes}: expected a multiple of {BATCH}")
    torch.set_num_threads(1)
    policy, rec = load_run_policy(args.run_dir, "Actor", "algo=ppo or algo=sac")
    task = rec["config"]["task"]["name"]
    spec = get_task(task)
    if spec.criterion != "hover":
        raise SystemExit(f"error: {args.run_dir} is a {task} run; this benchmark flies quadrotor policies")
    try:  # the run's task (target, simulator substeps, reference); the criterion sets its own conditions
        task_cfg, _ = to_objects(OmegaConf.create(rec["config"]))
    except UserError as e:
        raise SystemExit(f"error: {args.run_dir}: {e}") from None
    body = table(run(policy, task_cfg, args.episodes))
    print(body)
    if not args.no_write:
        where = "the shipped policy" if Path(args.run_dir).resolve() == SHIPPED else f"the policy of `{args.run_dir}`"
        write_section("Closed loop in the three simulators",
                      "python -m benchmarks.closed_loop" + ("" if where == "the shipped policy" else f" {args.run_dir}")
                      + ("" if args.episodes == 1000 else f" --episodes {args.episodes}"),
                      f"{where.capitalize()}, {args.episodes} criterion episodes (seeds {FIRST_SEED}-"
                      f"{FIRST_SEED + args.episodes // BATCH - 1}, {BATCH} each), the same in every simulator; "
                      f"one thread.\n\n{body}", threads=1)


if __name__ == "__main__":
    main()
