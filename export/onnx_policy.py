"""ONNX export of a deployable policy and the checked loader every consumer uses.

The graph contains the whole deployable policy: raw contract observation in, observation
normalisation, network, action in [-1, 1] out. For an MLP actor: MLP and tanh squashing,
action [N, A]. For a diffusion policy: the DDIM denoising loop unrolled, action chunk
[N, H, A]; a steered (DSRL) policy computes its own noise from the observation, an unsteered
one takes it as a second input ``noise`` [N, H*A]. Metadata carries the robot's contract
(sim/crazyflie/contract.py, sim/arm/contract.py), the task, the training config hash and the
source revision.
"""

from __future__ import annotations

import json
import subprocess
import warnings
from pathlib import Path

import numpy as np
import torch

from sim.contract import ContractBase
from sim.crazyflie.contract import CONTRACT

INPUT, NOISE, OUTPUT = "obs", "noise", "action"


class ContractError(Exception):
    """An exported model that does not match what its consumer expects."""


def source_revision(short: bool = False, ignore: tuple[str, ...] = ()) -> str:
    """The checkout's git commit (``short``: abbreviated), with "+uncommitted" when tracked files other
    than ``ignore`` (paths from the repository root) differ from it; "unknown" outside a git checkout."""
    root = Path(__file__).resolve().parents[1]

    def git(*args: str) -> str:
        return subprocess.run(["git", *args], capture_output=True, text=True, check=True, cwd=root).stdout

    try:
        rev = git("rev-parse", *(["--short"] if short else []), "HEAD").strip()
        dirty = [line for line in git("status", "--porcelain", "--untracked-files=no").splitlines()
                 if line[3:] not in ignore]  # porcelain: "XY path"
    except (OSError, subprocess.CalledProcessError):
        return "unknown"
    return rev + ("+uncommitted" if dirty else "")


def export_onnx(policy: torch.nn.Module, path: Path, metadata: dict[str, str], contract: ContractBase = CONTRACT) -> None:
    """Write ``policy`` (raw obs [N, obs_size] -> action [N, A] or chunk [N, H, A]) to ``path``."""
    import onnx

    policy = policy.eval()
    inputs, names = (torch.zeros(1, contract.obs_size),), [INPUT]
    if getattr(policy, "takes_noise", False):  # an unsteered diffusion policy: the caller draws w
        inputs, names = inputs + (torch.zeros(1, policy.latent_dim),), names + [NOISE]
    path.parent.mkdir(parents=True, exist_ok=True)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.onnx.export(policy, inputs, str(path), input_names=names, output_names=[OUTPUT],
                          dynamic_axes={**{n: {0: "batch"} for n in names}, OUTPUT: {0: "batch"}}, opset_version=17,
                          dynamo=False)
    model = onnx.load(str(path))
    for k, v in {"contract": contract.to_json(), **metadata}.items():
        entry = model.metadata_props.add()
        entry.key, entry.value = k, str(v)
    onnx.checker.check_model(model)
    onnx.save(model, str(path))


class OnnxPolicy:
    """onnxruntime session around an exported policy, contract checked on load."""

    def __init__(self, path: str | Path, contract: ContractBase = CONTRACT):
        import onnxruntime as ort

        self.path = path = Path(path)
        if not path.is_file():
            inside = next((m for m in (path / "policy.onnx", path / "export" / "policy.onnx") if m.is_file()), None)
            if inside is not None:  # an export or a run directory given for its model
                raise ContractError(f"{path} is a directory: give the model file, {inside}")
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
        if [i.name for i in inp] not in ([INPUT], [INPUT, NOISE]) or inp[0].shape[-1] != contract.obs_size:
            raise ContractError(f"{path}: expected an input '{INPUT}' [N, {contract.obs_size}] (and for an unsteered "
                                f"diffusion policy '{NOISE}'), got {[(i.name, i.shape) for i in inp]}")
        self.noise_size = inp[1].shape[-1] if len(inp) == 2 else 0
        self.obs_size = contract.obs_size
        if [o.name for o in out] != [OUTPUT]:  # the one output run is the one checked
            raise ContractError(f"{path}: expected one output '{OUTPUT}', got {[o.name for o in out]}")
        if out[0].shape[-1] != contract.action_size:
            raise ContractError(f"{path}: expected output [N, {contract.action_size}], got {out[0].shape}")
        # A chunked policy's metadata says how many actions a query executes (a deployment reads it) and
        # how many it predicts (the noise holds them all): the graph must agree with both.
        chunk = self.metadata.get("exec_horizon")
        if len(out[0].shape) != (3 if chunk else 2) or (chunk and out[0].shape[1] != int(chunk)):
            raise ContractError(f"{path}: output {out[0].shape} does not fit its metadata (exec_horizon {chunk}: "
                                f"expected [N, {chunk}, {contract.action_size}])" if chunk else
                                f"{path}: output {out[0].shape}, expected [N, {contract.action_size}] (no exec_horizon "
                                "in its metadata)")
        pred = self.metadata.get("pred_horizon")
        if self.noise_size and pred and self.noise_size != int(pred) * contract.action_size:
            raise ContractError(f"{path}: noise input of {self.noise_size} floats, its metadata's pred_horizon {pred} "
                                f"x {contract.action_size} actions says {int(pred) * contract.action_size}")
        self.contract = json.loads(self.metadata["contract"])
        self.chunk, self.action_size = (int(chunk) if chunk else None), contract.action_size

    def __call__(self, obs: np.ndarray, noise: np.ndarray | None = None) -> np.ndarray:
        """Action [N, A] (or chunk [N, H, A]) for observations [N, D] or one observation [D]; an
        unsteered diffusion policy needs ``noise`` [N, H*A] too, and no other model takes one."""
        feed = {INPUT: _rows(obs, self.obs_size, "observation")}
        if self.noise_size:
            if noise is None:
                raise ContractError(f"this model is a diffusion policy without a steering actor: pass noise "
                                    f"[N, {self.noise_size}] (w ~ N(0, I) samples the base policy)")
            feed[NOISE] = _rows(noise, self.noise_size, "noise")
            if len(feed[NOISE]) != len(feed[INPUT]):
                raise ContractError(f"{len(feed[INPUT])} observations but {len(feed[NOISE])} noises")
        elif noise is not None:  # it would be ignored: the caller believes it chooses the noise
            raise ContractError("this model takes no noise: it is an actor, or a diffusion policy whose steering "
                                "actor picks the noise")
        action = self.session.run([OUTPUT], feed)[0]
        # a graph's declared shapes are not what it computes: checked on every call, as the generated C's are fixed
        expected = (len(feed[INPUT]), *((self.chunk,) if self.chunk else ()), self.action_size)
        if action.shape != expected:
            raise ContractError(f"{self.path} computed actions of shape {list(action.shape)}, expected "
                                f"{list(expected)}")
        return action


def _rows(x, size: int, what: str) -> np.ndarray:
    """``x`` as float32 rows [N, size]: one vector [size] or a batch [N, size], nothing reshaped
    across rows (22 observations of 21 floats must not become 21 of 22)."""
    a = np.asarray(x, dtype=np.float32)
    if a.ndim not in (1, 2) or a.shape[-1] != size:
        raise ContractError(f"expected {what}s of {size} floats ([{size}] or [N, {size}]), got shape {list(a.shape)}")
    a = a.reshape(-1, size)
    if not np.isfinite(a).all():
        # Refused as the generated C refuses it (POLICY_ERR_INPUT): the graph's normaliser would clamp an
        # infinity to 10 std and answer with a plausible action, a NaN would give NaN actions.
        rows = np.flatnonzero(~np.isfinite(a).all(1))
        raise ValueError(f"non-finite {what} in row(s) {rows[:5].tolist()}{' ...' if len(rows) > 5 else ''}")
    return a
