"""Simulator throughput: environment steps per second of the batched PyTorch backend from 1 to
16384 environments, and of the MuJoCo and PyBullet backends (full task env step: dynamics,
observation, reward, termination, autoreset).

    python -m benchmarks.sim_throughput [--seconds 2]
"""

from __future__ import annotations

import argparse
import time

import torch

from benchmarks.common import write_section
from sim.crazyflie.dynamics import TorchBackend
from sim.crazyflie.hover import QuadHoverEnv, QuadTaskConfig
from sim.crazyflie.params import NOMINAL


def measure(fn, steps_per_call: int, seconds: float) -> float:
    fn()
    n, t0 = 0, time.perf_counter()
    while time.perf_counter() - t0 < seconds:
        fn()
        n += steps_per_call
    return n / (time.perf_counter() - t0)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--seconds", type=float, default=2.0)
    ap.add_argument("--no-write", action="store_true")
    args = ap.parse_args()
    torch.set_num_threads(2)
    rows = []
    for n in (1, 16, 256, 1024, 4096, 16384):
        env = QuadHoverEnv(QuadTaskConfig(), n)
        env.reset(seed=0)
        a = torch.full((n, 4), env.hover_action)
        full = measure(lambda: env.step(a), n, args.seconds)
        be = TorchBackend(n, NOMINAL, 0.01)
        cmd, z = torch.full((n, 4), NOMINAL.hover_rpm), torch.zeros(n, 3)
        dyn = measure(lambda: be.step(cmd, z, z), n, args.seconds)
        rows.append(("torch", n, full, dyn))
        print(rows[-1], flush=True)
    for backend in ("mujoco", "pybullet"):
        for n in (1, 16):
            env = QuadHoverEnv(QuadTaskConfig(), n, backend=backend)
            env.reset(seed=0)
            a = torch.full((n, 4), env.hover_action)
            rows.append((backend, n, measure(lambda: env.step(a), n, args.seconds), float("nan")))
            print(rows[-1], flush=True)
    table = "| backend | envs | task env steps/s | dynamics-only steps/s |\n|---|---:|---:|---:|\n"
    table += "\n".join(f"| {b} | {n} | {f:,.0f} | {'' if d != d else f'{d:,.0f}'} |" for b, n, f, d in rows)
    note = ("Task env step = latency buffer, RK4 dynamics (1 step of 10 ms), noisy observation, privileged "
            "observation, reward terms, termination and same-step autoreset. MuJoCo and PyBullet integrate at "
            "1 ms (10 substeps per 10 ms step) with one vehicle per environment, stepped in a Python loop.")
    if not args.no_write:
        write_section("Simulator throughput", "python -m benchmarks.sim_throughput", table + "\n\n" + note)


if __name__ == "__main__":
    main()
