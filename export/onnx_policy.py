"""ONNX export of the deployable actor and the checked loader every consumer uses.

The graph contains the whole deployable policy: raw contract observation in, observation
normalisation, MLP, tanh squashing, action in [-1, 1] out. Metadata carries the contract
(sim/crazyflie/contract.py), the task, the training config hash and the source revision.
"""

from __future__ import annotations

import json
import subprocess
import warnings
from pathlib import Path

import numpy as np
import torch

from sim.crazyflie.contract import CONTRACT, PolicyContract

INPUT, OUTPUT = "obs", "action"


class ContractError(Exception):
    """An exported model that does not match what its consumer expects."""


def source_revision() -> str:
    try:
        rev = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True, check=True,
                             cwd=Path(__file__).parent).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], capture_output=True,
                               text=True, cwd=Path(__file__).parent).stdout.strip()
        return rev + ("-dirty" if dirty else "")
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def export_onnx(actor: torch.nn.Module, path: Path, metadata: dict[str, str]) -> None:
    """Write ``actor`` (raw obs [N, 22] -> action [N, 4]) to ``path`` with ``metadata``."""
    import onnx

    actor = actor.eval()
    dummy = torch.zeros(1, CONTRACT.obs_size)
    path.parent.mkdir(parents=True, exist_ok=True)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.onnx.export(actor, (dummy,), str(path), input_names=[INPUT], output_names=[OUTPUT],
                          dynamic_axes={INPUT: {0: "batch"}, OUTPUT: {0: "batch"}}, opset_version=17, dynamo=False)
    model = onnx.load(str(path))
    for k, v in {"contract": CONTRACT.to_json(), **metadata}.items():
        entry = model.metadata_props.add()
        entry.key, entry.value = k, str(v)
    onnx.checker.check_model(model)
    onnx.save(model, str(path))


class OnnxPolicy:
    """onnxruntime session around an exported policy, contract checked on load."""

    def __init__(self, path: str | Path, contract: PolicyContract = CONTRACT):
        import onnxruntime as ort

        path = Path(path)
        if not path.is_file():
            raise ContractError(f"no ONNX model at {path}: export one with python -m policies.export <run_dir>")
        try:
            opts = ort.SessionOptions()
            opts.intra_op_num_threads = 1
            self.session = ort.InferenceSession(str(path), opts, providers=["CPUExecutionProvider"])
        except Exception as e:
            raise ContractError(f"{path} is not a loadable ONNX model ({type(e).__name__})") from None
        self.metadata = dict(self.session.get_modelmeta().custom_metadata_map)
        if "contract" not in self.metadata:
            raise ContractError(f"{path} has no policy contract in its metadata; re-export it with policies.export")
        bad = contract.mismatch(self.metadata["contract"])
        if bad:
            raise ContractError(f"{path} was exported for another observation/action contract (differs in: "
                                f"{', '.join(bad)}); expected {contract.version}")
        inp, out = self.session.get_inputs(), self.session.get_outputs()
        if [i.name for i in inp] != [INPUT] or inp[0].shape[-1] != contract.obs_size:
            raise ContractError(f"{path}: expected one input '{INPUT}' [N, {contract.obs_size}], got "
                                f"{[(i.name, i.shape) for i in inp]}")
        if out[0].shape[-1] != contract.action_size:
            raise ContractError(f"{path}: expected output [N, {contract.action_size}], got {out[0].shape}")
        self.contract = json.loads(self.metadata["contract"])

    def __call__(self, obs: np.ndarray) -> np.ndarray:
        obs = np.asarray(obs, dtype=np.float32).reshape(-1, CONTRACT.obs_size)
        return self.session.run([OUTPUT], {INPUT: obs})[0]
