"""Simulator throughput: environment steps per second of the batched PyTorch backend from 1 to
65536 environments, compiled (the default, ``task.compile=true``) and eager, and of the MuJoCo
and PyBullet backends (full task env step: latency, dynamics, observation with noise, privileged
observation, reward, termination, autoreset).

    python -m benchmarks.sim_throughput [--seconds 2] [--threads 2]
"""

from __future__ import annotations

import argparse
import time

import torch

from benchmarks.common import write_section
from sim.compiled import compile_if
from sim.crazyflie.dynamics import TorchBackend, rk4_step
from sim.crazyflie.hover import QuadHoverEnv, QuadTaskConfig
from sim.crazyflie.params import NOMINAL

SIZES = (1, 16, 256, 1024, 2048, 4096, 16384, 65536)


def measure(fn, steps_per_call: int, seconds: float) -> float:
    """Steps per second of ``fn`` over ``seconds`` of wall time, after one warm-up call."""
    fn()
    n, t0 = 0, time.perf_counter()
    while time.perf_counter() - t0 < seconds:
        fn()
        n += steps_per_call
    return n / (time.perf_counter() - t0)


def task_steps_per_second(n: int, compile: bool, seconds: float, backend: str = "torch") -> float:
    """Full task env steps/s with actions that move the vehicles (so episodes end and reset)."""
    cfg = QuadTaskConfig()
    cfg.compile = compile
    env = QuadHoverEnv(cfg, n, backend=backend)
    env.reset(seed=0)
    gen = torch.Generator().manual_seed(0)
    actions = [env.hover_action + 0.2 * torch.randn(n, 4, generator=gen) for _ in range(8)]
    i = [0]

    def step():
        i[0] += 1
        env.step(actions[i[0] % 8])

    return measure(step, n, seconds)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--seconds", type=float, default=2.0)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--no-write", action="store_true")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    dynamics = compile_if(rk4_step, True, dynamic=True)  # as the task compiles its step
    if dynamics is rk4_step:  # compile_if fell back to eager (its warning says why)
        raise SystemExit("error: torch.compile cannot build here (no C++ compiler or no Python.h): the compiled "
                         "column would be eager; install g++ and python3-dev")
    t0 = time.time()
    task_steps_per_second(16, True, 0.1)  # compiles (or loads from the on-disk cache) once for every size
    compile_s = time.time() - t0
    rows = []
    for n in SIZES:
        compiled = task_steps_per_second(n, True, args.seconds)
        eager = task_steps_per_second(n, False, args.seconds)
        be = TorchBackend(n, NOMINAL, 0.01)
        cmd, z = torch.full((n, 4), NOMINAL.hover_rpm), torch.zeros(n, 3)

        def dyn_step():
            be.state = dynamics(be.state, cmd, be.vehicle, NOMINAL, z, z, 0.01)

        rows.append(("torch", n, compiled, eager, measure(dyn_step, n, args.seconds)))
        print(rows[-1], flush=True)
    for backend in ("mujoco", "pybullet"):
        for n in (1, 16, 100):  # 100: the hover evaluation's batch
            rows.append((backend, n, task_steps_per_second(n, False, args.seconds, backend), None, None))
            print(rows[-1], flush=True)

    def fmt(x):
        return "" if x is None else f"{x:,.0f}"

    table = ("| backend | envs | task env steps/s (compiled) | task env steps/s (eager) | dynamics-only steps/s (compiled RK4) |\n"
             "|---|---:|---:|---:|---:|\n")
    table += "\n".join(f"| {b} | {n} | {fmt(c)} | {fmt(e)} | {fmt(d)} |" for b, n, c, e, d in rows)
    note = (f"Threads: {args.threads}. Task env step = latency buffer, RK4 dynamics (1 step of 10 ms), noisy observation, "
            "privileged observation, reward terms, termination and same-step autoreset, with random actions around "
            "hover. Compiled = `task.compile=true` (the default): torch.compile with dynamic batch size; the first "
            f"call in this process (building a 16-environment task, compiling or loading its kernels from the "
            f"on-disk cache, 0.1 s of steps) took {compile_s:.1f} s. MuJoCo and PyBullet integrate at 1 ms (10 "
            "substeps per 10 ms step), never compiled (their rows use the first column): MuJoCo steps every vehicle "
            "in one model, one mj_step per substep; PyBullet every vehicle in one world, with a force and a torque "
            "call per body per substep.")
    if not args.no_write:
        write_section("Simulator throughput", f"python -m benchmarks.sim_throughput --threads {args.threads} "
                      f"--seconds {args.seconds:g}",
                      table + "\n\n" + note)


if __name__ == "__main__":
    main()
