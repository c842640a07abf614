"""How much room does a diffusion base policy leave for steering its initial noise (DSRL)?

    python -m benchmarks.steerability <diffusion_bc run dir> [--draws 8] [--episodes 100]

Runs the frozen base on the same ``--episodes`` initial states and physics (one evaluation seed)
once per noise draw, w ~ N(0, I) with its own generator each time, and once with w = 0. The
fraction of initial states that succeed with at least one of the first k draws (it grows with k)
is a best-of-k oracle: what choosing the best noise per state would have given. It is not a
strict bound on steering, because the observation noise differs between draws too (episodes end
at different times, and the environment's generator that samples new episodes also draws the
noise). Writes a section of BENCHMARKS.md.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import numpy as np
import torch
from omegaconf import OmegaConf

from benchmarks.common import write_section
from policies import checkpoint as ckpt
from policies.config import to_objects
from policies.evaluate import evaluate_success


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("run", help="run directory of an algo=diffusion_bc run")
    ap.add_argument("--draws", type=int, default=8)
    ap.add_argument("--episodes", type=int, default=100)
    ap.add_argument("--seed", type=int, default=12345, help="evaluation seed: fixes the initial states")
    ap.add_argument("--no-write", action="store_true")
    a = ap.parse_args()
    torch.set_num_threads(1)
    base, rec = ckpt.load_policy(Path(a.run))
    task_cfg, _ = to_objects(OmegaConf.create(rec["config"]))

    def run(noise) -> np.ndarray:
        with torch.no_grad():
            return evaluate_success(lambda obs: base(obs, noise(len(obs))), task_cfg, a.episodes, seed=a.seed).success

    zero = run(lambda n: torch.zeros(n, base.latent_dim))
    draws = []
    for k in range(a.draws):
        gen = torch.Generator().manual_seed(1000 + k)
        draws.append(run(lambda n, g=gen: torch.randn(n, base.latent_dim, generator=g)))
        print(f"draw {k}: {draws[-1].mean() * 100:.0f}%", flush=True)
    s = np.array(draws)  # [draws, episodes]
    any_k = [s[: k + 1].any(0).mean() for k in range(a.draws)]
    hist = np.bincount(s.sum(0), minlength=a.draws + 1)
    table = ("| measure | success |\n|---|---:|\n"
             f"| base, w ~ N(0, I): mean over {a.draws} draws (min-max) | {s.mean() * 100:.0f}% "
             f"({s.mean(1).min() * 100:.0f}-{s.mean(1).max() * 100:.0f}%) |\n"
             f"| base, w = 0 | {zero.mean() * 100:.0f}% |\n"
             + "".join(f"| some draw among the first {k + 1} succeeds | {v * 100:.0f}% |\n"
                       for k, v in enumerate(any_k) if k + 1 in (1, 2, 4, 8, 16, 32) or k + 1 == a.draws))
    body = (f"Base: `{a.run}` ({task_cfg.name}), {a.episodes} initial states (evaluation seed {a.seed}).\n\n"
            f"{table}\nInitial states by the number of successful draws (0..{a.draws}): "
            f"{', '.join(map(str, hist))}.\n\nThe 'some draw' rows are a best-of-k oracle: the success of the "
            "best of k noise draws per initial state. They indicate how much a steering policy could gain, not "
            "a guaranteed level: initial states and physics are the same in every draw, the observation noise "
            "is not, and the steering policy does not see the randomized mass and friction.")
    print(body)
    if not a.no_write:
        write_section(f"Diffusion base: room for steering ({task_cfg.name})",
                      f"python -m benchmarks.steerability {a.run} --draws {a.draws} --episodes {a.episodes}", body)


if __name__ == "__main__":
    main()
