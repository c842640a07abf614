"""Export a trained run: ``python -m policies.export <run_dir>``.

Writes ``<run_dir>/export/policy.onnx`` (contract metadata embedded) and ``policy.c`` /
``policy.h`` (C99, no heap), then checks PyTorch vs onnxruntime on 10k random and 10k
on-distribution observations and prints the largest difference.
"""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import torch
from omegaconf import OmegaConf

from export.c_codegen import UnsupportedLayerError, generate_c
from export.onnx_policy import ContractError, OnnxPolicy, export_onnx, source_revision
from sim.crazyflie.contract import CONTRACT
from sim.registry import get_task

from . import checkpoint as ckpt
from .config import config_hash, to_objects

PARITY_TOL = 1e-5


def parity_observations(actor, task_cfg, n: int = 10_000, seed: int = 0) -> np.ndarray:
    """n random observations (wide ranges, all components) and n from closed-loop rollouts."""
    g = torch.Generator().manual_seed(seed)
    scale = torch.tensor([1.0] * 3 + [1.0] * 9 + [3.0] * 3 + [10.0] * 3 + [1.0] * 4)
    random = (2 * torch.rand(n, CONTRACT.obs_size, generator=g) - 1) * scale
    envs = 100
    env = get_task(task_cfg.name).env_cls(task_cfg, envs, seed=seed)
    obs, _ = env.reset(seed=seed)
    on_dist = []
    with torch.no_grad():
        for _ in range(n // envs):
            on_dist.append(obs["policy"])
            obs, *_ = env.step(actor(obs["policy"]))
    return torch.cat((random, *on_dist)).numpy()


def export_run(run_dir: Path) -> dict:
    actor, rec = ckpt.load_policy(run_dir)
    cfg = OmegaConf.create(rec["config"])
    task_cfg, _ = to_objects(cfg)
    out = run_dir / "export"
    meta = {
        "task": task_cfg.name, "algo": cfg.algo.name, "config_hash": config_hash(cfg),
        "source_revision": source_revision(), "env_steps": rec["env_steps"],
        "eval_success_rate": rec["eval"]["success_rate"],
    }
    onnx_path = out / "policy.onnx"
    export_onnx(actor, onnx_path, meta)
    generate_c(actor, out, header_note=f"task {task_cfg.name}, config {meta['config_hash']}, rev {meta['source_revision']}")

    obs = parity_observations(actor, task_cfg)
    with torch.no_grad():
        ref = actor(torch.as_tensor(obs)).numpy()
    got = OnnxPolicy(onnx_path)(obs)
    err = float(np.abs(ref - got).max())
    np.save(out / "parity_obs.npy", obs)
    return {"onnx": onnx_path, "c": out / "policy.c", "h": out / "policy.h", "max_abs_diff": err, "n": len(obs)}


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) != 1:
        print("usage: python -m policies.export <run_dir>", file=sys.stderr)
        return 2
    try:
        res = export_run(Path(argv[0]))
    except (ckpt.CheckpointError, UnsupportedLayerError, ContractError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(f"wrote {res['onnx']}, {res['c']}, {res['h']}")
    ok = res["max_abs_diff"] <= PARITY_TOL
    print(f"parity PyTorch vs onnxruntime on {res['n']} observations: max |diff| = {res['max_abs_diff']:.2e} "
          f"({'ok' if ok else 'FAILED'}, tolerance {PARITY_TOL:g})")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
