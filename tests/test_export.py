"""Exported policies act like the trained one and refuse to run where they would be wrong.

A small seeded actor (tests/conftest.py) is exported end to end by policies.export. The ONNX
model must match PyTorch, carry its contract and provenance, and be refused by OnnxPolicy when
it does not fit. The generated C must compile warning-free under strict flags, match
onnxruntime, run clean under ASan/UBSan, and survive fuzzing: any 22 floats give either a
finite action in [-1, 1] or an error code with the safe action.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import onnx
import pytest
import torch
from omegaconf import OmegaConf
from torch import nn

from export.c_codegen import DRIVER, DRIVER_OUT, UnsupportedLayerError, generate_c
from export.onnx_policy import ContractError, OnnxPolicy, source_revision
from policies import checkpoint as ckpt
from policies.config import config_hash
from policies.export import PARITY_FLOOR, export_run, main
from policies.networks import Actor
from sim.crazyflie.contract import CONTRACT

from conftest import make_actor

REPO = Path(__file__).resolve().parents[1]
C_DIR = Path(__file__).parent / "c"
N = 10_000  # parity_observations: N random then N on-distribution observations
STRICT = ["-std=c99", "-Wall", "-Wextra", "-Werror", "-Wdouble-promotion"]
SANITIZE = ["-fsanitize=address,undefined", "-fno-sanitize-recover=all", "-fno-omit-frame-pointer", "-g"]
SANITIZER_ENV = {**os.environ, "ASAN_OPTIONS": "detect_leaks=1", "UBSAN_OPTIONS": "print_stacktrace=1"}


# ---------------------------------------------------------------------------------------------
# helpers


@pytest.fixture(scope="module")
def exported(run_dir):
    """export_run on the fixture run: paths, its parity result and the observations it used."""
    res = export_run(run_dir)
    res["obs"] = np.load(run_dir / "export" / "parity_obs.npy")
    return res


def header_constants(h: Path) -> dict[str, str]:
    return dict(re.findall(r"#define (POLICY_\w+) (\S+)", h.read_text()))


def compile_c(cc: str, flags: list[str], sources: list[Path], include: Path, out: Path) -> Path:
    cmd = [cc, *flags, f"-I{include}", *map(str, sources), "-o", str(out)] + ([] if "-c" in flags else ["-lm"])
    r = subprocess.run(cmd, capture_output=True, text=True)
    assert r.returncode == 0 and not r.stderr, f"{' '.join(cmd)}\n{r.stderr}"
    return out


def run_driver(exe: Path, obs: np.ndarray, tmp: Path) -> tuple[np.ndarray, str]:
    """(rc, action) per observation row and the driver's stdout; fails on any sanitizer report."""
    obs_file, out_file = tmp / "obs.bin", tmp / "out.bin"
    np.ascontiguousarray(obs, dtype="<f4").tofile(obs_file)
    r = subprocess.run([str(exe), str(obs_file), str(out_file)], capture_output=True, text=True,
                       env=SANITIZER_ENV, timeout=120)
    assert r.returncode == 0 and not r.stderr, f"driver exit {r.returncode}\n{r.stderr[-4000:]}"
    out = np.fromfile(out_file, dtype=DRIVER_OUT)
    assert len(out) == len(obs)
    return out, r.stdout


def edge_observations(obs: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(non-finite rows, huge/tiny finite rows) built from on-distribution observations."""
    base = obs[N]
    bad = []
    for value in (np.nan, np.inf, -np.inf):
        for i in range(CONTRACT.obs_size):
            row = base.copy()
            row[i] = value
            bad.append(row)
    bad.append(np.full_like(base, np.nan))
    fmax = np.finfo(np.float32).max
    huge = [np.full_like(base, v) for v in (fmax, -fmax, 1e30, -1e30, 1e-45, -0.0)]
    for i in range(CONTRACT.obs_size):
        row = base.copy()
        row[i] = fmax if i % 2 else -fmax
        huge.append(row)
    return np.array(bad, dtype=np.float32), np.array(huge, dtype=np.float32)


# ---------------------------------------------------------------------------------------------
# ONNX


def test_onnx_matches_pytorch_on_random_and_on_distribution_observations(run_dir, exported):
    obs = exported["obs"]
    assert obs.shape == (2 * N, CONTRACT.obs_size) and exported["n"] == 2 * N
    actor, _ = ckpt.load_policy(run_dir)
    with torch.no_grad():
        ref = actor(torch.as_tensor(obs)).numpy()
    got = OnnxPolicy(exported["onnx"])(obs)
    random_err = np.abs(ref[:N] - got[:N]).max()
    on_dist_err = np.abs(ref[N:] - got[N:]).max()
    assert random_err <= 1e-5 and on_dist_err <= 1e-5, (random_err, on_dist_err)
    assert exported["ok"] and exported["tolerance"] == PARITY_FLOOR and exported["onnx_error"] <= PARITY_FLOOR
    assert exported["torch_error"] < 1e-6, "an MLP in float32 is ~1e-7 from float64"
    # The comparison means something only if the actions vary (a fresh actor outputs ~hover).
    assert ref.std(0).min() > 0.1 and np.abs(ref).max() > 0.9


def test_onnx_policy_refuses_a_non_finite_observation(exported):
    """OnnxPolicy refuses an observation holding an infinity or a NaN, as the generated C does (its
    error code and the safe action): the graph clamps an infinity to 10 std of its normaliser and
    answered with a plausible action."""
    policy = OnnxPolicy(exported["onnx"])
    obs = exported["obs"][:4].copy()
    assert np.isfinite(policy(obs)).all()
    for bad in (np.inf, -np.inf, np.nan):
        obs[2, 0] = bad
        with pytest.raises(ValueError, match=r"non-finite observation in row\(s\) \[2\]"):
            policy(obs)


def test_onnx_metadata_carries_contract_and_provenance(run_dir, exported):
    meta = {p.key: p.value for p in onnx.load(str(exported["onnx"])).metadata_props}
    cfg = OmegaConf.load(run_dir / "config.yaml")
    assert meta["contract"] == CONTRACT.to_json()
    assert meta["task"] == cfg.task.name
    assert meta["config_hash"] == config_hash(cfg)
    # The training's revision (the fixture's record has none: "unknown"), and the exporting checkout's.
    assert meta["source_revision"] == "unknown" and meta["export_revision"] == source_revision()
    assert meta["env_steps"] == "12345" and float(meta["eval_success_rate"]) == 0.5
    assert "exec_horizon" not in meta, "an MLP actor acts once per query: no chunk to describe"
    assert OnnxPolicy(exported["onnx"]).contract["version"] == CONTRACT.version


def test_source_revision_names_the_commit_and_uncommitted_changes(tmp_path):
    """source_revision (the provenance written into every export and run): the checkout's commit, with
    "+uncommitted" while a tracked file differs from it (an ignored path excepted), "unknown" outside git.
    Run on a copy of the module in a scratch repository, whose state the test sets."""
    import importlib.util

    (tmp_path / "export").mkdir()
    shutil.copy(REPO / "export" / "onnx_policy.py", tmp_path / "export")
    (tmp_path / "notes.txt").write_text("a\n")
    git = ["git", "-C", str(tmp_path), "-c", "user.name=t", "-c", "user.email=t@t", "-c", "commit.gpgsign=false"]

    def source_revision(**kw) -> str:
        spec = importlib.util.spec_from_file_location("scratch_onnx_policy", tmp_path / "export" / "onnx_policy.py")
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        return module.source_revision(**kw)

    assert source_revision() == "unknown"
    subprocess.run([*git, "init", "-q"], check=True)
    subprocess.run([*git, "add", "-A"], check=True)
    subprocess.run([*git, "commit", "-qm", "x"], check=True)
    head = subprocess.run([*git, "rev-parse", "HEAD"], check=True, capture_output=True, text=True).stdout.strip()
    assert len(head) == 40 and source_revision() == head
    assert head.startswith(source_revision(short=True)) and len(source_revision(short=True)) < 40
    (tmp_path / "untracked.txt").write_text("not part of the checkout")
    assert source_revision() == head
    (tmp_path / "notes.txt").write_text("b\n")
    assert source_revision() == head + "+uncommitted"
    assert source_revision(ignore=("notes.txt",)) == head


def _resave(src: Path, dst: Path, edit) -> Path:
    model = onnx.load(str(src))
    edit(model)
    onnx.save(model, str(dst))
    return dst


def test_onnx_policy_refuses_altered_contract(exported, tmp_path):
    def alter(model):
        for p in model.metadata_props:
            if p.key == "contract":
                p.value = p.value.replace('"policy_period_s": 0.01', '"policy_period_s": 0.02')
                assert "0.02" in p.value

    path = _resave(exported["onnx"], tmp_path / "altered.onnx", alter)
    with pytest.raises(ContractError, match=r"another observation/action contract .*policy_period_s"):
        OnnxPolicy(path)


def test_onnx_policy_refuses_model_without_metadata(exported, tmp_path):
    path = _resave(exported["onnx"], tmp_path / "bare.onnx", lambda m: m.ClearField("metadata_props"))
    with pytest.raises(ContractError, match="no policy contract in its metadata"):
        OnnxPolicy(path)


def test_onnx_policy_refuses_wrong_input_size(tmp_path):
    # A 21-input model that claims the right contract (e.g. exported before an observation change).
    from onnx import TensorProto, helper, numpy_helper

    w = numpy_helper.from_array(np.zeros((21, CONTRACT.action_size), np.float32), "w")
    graph = helper.make_graph([helper.make_node("MatMul", ["obs", "w"], ["action"])], "obs21",
                              [helper.make_tensor_value_info("obs", TensorProto.FLOAT, ["batch", 21])],
                              [helper.make_tensor_value_info("action", TensorProto.FLOAT, ["batch", 4])], [w])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)
    helper.set_model_props(model, {"contract": CONTRACT.to_json()})
    path = tmp_path / "obs21.onnx"
    onnx.save(model, str(path))
    with pytest.raises(ContractError, match=r"expected an input 'obs' \[N, 22\]"):
        OnnxPolicy(path)


def _graph_model(path: Path, nodes, outputs: list[tuple[str, list]]) -> Path:
    """An ONNX model from obs [batch, 22] to ``outputs`` (name, declared shape) with the right contract."""
    from onnx import TensorProto, helper

    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("obs", TensorProto.FLOAT, ["batch", 22])],
                              [helper.make_tensor_value_info(name, TensorProto.FLOAT, shape) for name, shape in outputs])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)
    helper.set_model_props(model, {"contract": CONTRACT.to_json()})
    onnx.save(model, str(path))
    return path


def test_onnx_policy_refuses_a_second_output_and_actions_of_another_shape_than_declared(tmp_path):
    """The output run is the one checked: a model with a well-shaped first output and another named 'action'
    is refused; a graph that declares [N, 4] but computes [N, 22] is refused at its first call."""
    from onnx import helper

    ends = [helper.make_node("Constant", [], [n], value_ints=[v]) for n, v in (("s", 0), ("e", 4), ("ax", 1))]
    decoy = _graph_model(tmp_path / "decoy.onnx", [*ends, helper.make_node("Slice", ["obs", "s", "e", "ax"], ["first"]),
                                                   helper.make_node("Identity", ["obs"], ["action"])],
                         [("first", ["batch", 4]), ("action", ["batch", 22])])
    with pytest.raises(ContractError, match=r"expected one output 'action', got \['first', 'action'\]"):
        OnnxPolicy(decoy)
    reshaped = [helper.make_node("Shape", ["obs"], ["shape"]), helper.make_node("Reshape", ["obs", "shape"], ["action"])]
    liar = OnnxPolicy(_graph_model(tmp_path / "liar.onnx", reshaped, [("action", ["batch", 4])]))  # not inferred
    with pytest.raises(ContractError, match=r"computed actions of shape \[1, 22\], expected \[1, 4\]"):
        liar(np.zeros(22))


def test_onnx_policy_refuses_observations_of_the_wrong_size(exported):
    policy = OnnxPolicy(exported["onnx"])
    assert policy(np.zeros(CONTRACT.obs_size)).shape == (1, CONTRACT.action_size)
    for shape in ([22, 21], [21], [2, 3, 22]):  # 22 x 21 floats must not pass as 21 x 22
        with pytest.raises(ContractError, match=rf"expected observations of 22 floats .* got shape \{shape}"):
            policy(np.zeros(shape))


def test_onnx_policy_refuses_missing_or_garbled_file(tmp_path):
    with pytest.raises(ContractError, match="no ONNX model at .*policies.export"):
        OnnxPolicy(tmp_path / "missing.onnx")
    (tmp_path / "garbled.onnx").write_bytes(b"not a model")
    with pytest.raises(ContractError, match="not a loadable ONNX model"):
        OnnxPolicy(tmp_path / "garbled.onnx")
    (tmp_path / "run" / "export").mkdir(parents=True)  # a run or export directory given for its model
    (tmp_path / "run" / "export" / "policy.onnx").write_bytes(b"")
    for given in (tmp_path / "run", tmp_path / "run" / "export"):
        with pytest.raises(ContractError) as e:
            OnnxPolicy(given)
        assert str(e.value) == f"{given} is a directory: give the model file, {tmp_path / 'run/export/policy.onnx'}"


# ---------------------------------------------------------------------------------------------
# C


@pytest.mark.parametrize("cc", ["gcc", "clang"])
def test_c_compiles_strict_and_matches_onnxruntime(exported, tmp_path, cc):
    out_dir = exported["c"].parent
    exe = compile_c(cc, [*STRICT, "-O2"], [exported["c"], DRIVER], out_dir, tmp_path / "driver")
    obs = exported["obs"]
    out, stdout = run_driver(exe, obs, tmp_path)
    assert "self_test 0\n" in stdout
    assert (out["rc"] == 0).all()
    onnx_act = OnnxPolicy(exported["onnx"])(obs)
    err = np.abs(out["action"] - onnx_act).max()
    assert err <= 1e-5, err


@pytest.mark.parametrize("activation", ["tanh", "elu"])
def test_c_links_only_single_precision_math(exported, tmp_path, activation):
    # Microcontroller build: no heap, no stdio, no double-precision libm (software-emulated on
    # a Cortex-M4); the header promises tanhf/expm1f only.
    c = exported["c"] if activation == "tanh" else generate_c(make_actor(activation, seed=1), tmp_path)[1]
    obj = tmp_path / "policy.o"
    compile_c("gcc", [*STRICT, "-O2", "-c"], [c], c.parent, obj)
    undefined = set(subprocess.run(["nm", "-u", str(obj)], capture_output=True, text=True, check=True).stdout.split())
    assert undefined - {"U"} <= {"tanhf", "expm1f"}, undefined


@pytest.mark.parametrize("activation", ["tanh", "elu"])
def test_c_for_the_cortex_m4_calls_no_soft_float_helper(exported, tmp_path, activation):
    # The same object for the Crazyflie's Cortex-M4F: there double arithmetic would call the soft-float
    # helpers (__aeabi_d*), which a host object cannot show.
    if not (shutil.which("arm-none-eabi-gcc") and shutil.which("arm-none-eabi-nm")):
        pytest.skip("needs arm-none-eabi-gcc (install.sh installs it)")
    c = exported["c"] if activation == "tanh" else generate_c(make_actor(activation, seed=1), tmp_path)[1]
    arm = tmp_path / "policy_arm.o"
    subprocess.run(["arm-none-eabi-gcc", "-mcpu=cortex-m4", "-mthumb", "-mfloat-abi=hard", "-mfpu=fpv4-sp-d16",
                    *STRICT, "-O2", "-c", str(c), "-o", str(arm)], check=True, cwd=c.parent)
    undefined = set(subprocess.run(["arm-none-eabi-nm", "-u", str(arm)], capture_output=True, text=True,
                                   check=True).stdout.split())
    # (GCC for the M4 zeroes local arrays with memset: a libc routine, no heap and no double)
    assert undefined - {"U"} <= {"tanhf", "expm1f", "memset", "memcpy"}, undefined


def test_c_under_sanitizers_on_edge_inputs(exported, tmp_path):
    consts = header_constants(exported["h"])
    out_dir = exported["c"].parent
    exe = compile_c("gcc", [*STRICT, "-O1", *SANITIZE], [exported["c"], DRIVER], out_dir,
                    tmp_path / "driver_san")
    bad, huge = edge_observations(exported["obs"])
    obs = np.concatenate((exported["obs"], bad, huge))
    out, stdout = run_driver(exe, obs, tmp_path)
    assert "self_test 0\n" in stdout

    n_ok = len(exported["obs"])
    bad_out, huge_out = out[n_ok:n_ok + len(bad)], out[n_ok + len(bad):]
    assert (out["rc"][:n_ok] == 0).all()
    # Non-finite input: refused, every rotor at the safe action (-1 = zero rpm).
    assert (bad_out["rc"] == int(consts["POLICY_ERR_INPUT"])).all()
    assert float(consts["POLICY_SAFE_ACTION"].strip("()f")) == -1.0
    assert (bad_out["action"] == -1.0).all()
    # Huge finite input saturates the normaliser clip and still flies like onnxruntime.
    assert (huge_out["rc"] == 0).all()
    assert np.isfinite(huge_out["action"]).all() and (np.abs(huge_out["action"]) <= 1.0).all()
    assert np.abs(huge_out["action"] - OnnxPolicy(exported["onnx"])(huge)).max() <= 1e-5


def test_c_fuzz_any_observation_gives_bounded_action_or_safe_error(exported, tmp_path):
    out_dir = exported["c"].parent
    exe = compile_c("clang", [*STRICT, "-O1", "-fsanitize=fuzzer,address,undefined", "-fno-sanitize-recover=all",
                              "-g"], [exported["c"], C_DIR / "policy_fuzz.c"], out_dir, tmp_path / "fuzz")
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    bad, huge = edge_observations(exported["obs"])
    seeds = np.concatenate((exported["obs"][::2000], bad[::11], huge[::4]))
    for i, row in enumerate(seeds):
        (corpus / f"seed{i}").write_bytes(row.astype("<f4").tobytes())
    r = subprocess.run([str(exe), "-seed=1", "-runs=200000", "-max_total_time=5", "-max_len=88",
                        f"-artifact_prefix={tmp_path}/", str(corpus)],
                       capture_output=True, text=True, env=SANITIZER_ENV, timeout=60)
    assert r.returncode == 0, r.stderr[-4000:]
    assert re.search(r"Done \d+ runs", r.stderr), r.stderr[-2000:]


@pytest.mark.parametrize("activation", ["relu", "elu", "elu alpha 0.5"])
def test_c_other_activations_match_pytorch(exported, tmp_path, activation):
    actor = make_actor(activation.split()[0], seed=1)
    if activation.endswith("0.5"):  # ELU's alpha is the module's (the C once took 1 for any)
        for m in actor.net:
            if isinstance(m, torch.nn.ELU):
                m.alpha = 0.5
    _, c = generate_c(actor, tmp_path)
    exe = compile_c("gcc", [*STRICT, "-O2"], [c, DRIVER], tmp_path, tmp_path / "driver")
    obs = exported["obs"]
    out, stdout = run_driver(exe, obs, tmp_path)
    assert "self_test 0\n" in stdout and (out["rc"] == 0).all()
    with torch.no_grad():
        ref = actor(torch.as_tensor(obs)).numpy()
    assert np.abs(out["action"] - ref).max() <= 1e-5


@pytest.mark.parametrize("activation", ["relu", "elu"])
def test_c_a_nan_made_inside_the_network_is_an_output_error(exported, tmp_path, activation):
    """Two first-layer units that overflow to +inf give NaN before the second layer's activation
    (inf - inf, 0 x inf); torch carries it to the output, and the C must report POLICY_ERR_OUTPUT, not
    turn it into a number (its ReLU once gave 0 for NaN, and a finite action came out)."""
    actor = make_actor(activation, seed=1)
    first, second = [m for m in actor.net if isinstance(m, torch.nn.Linear)][:2]
    with torch.no_grad():
        actor.obs_norm.mean[0], actor.obs_norm.var[0] = -1e6, 1.0  # feature 0 normalised to the clip, +10
        first.weight[:2], first.bias[:2] = 0.0, 3e38
        first.weight[:2, 0] = 1e38  # 3e38 + 10 x 1e38 overflows: +inf
        second.weight[0, :2] = torch.tensor([1.0, -1.0])  # inf - inf; every other unit meets inf x w,
        second.weight[1:, :2] = 0.0  # here 0 x inf: NaN in every second-layer unit
    obs = exported["obs"][:8]
    with torch.no_grad():
        assert torch.isnan(actor(torch.as_tensor(obs))).all()
    _, c = generate_c(actor, tmp_path)
    exe = compile_c("gcc", [*STRICT, "-O2"], [c, DRIVER], tmp_path, tmp_path / "driver")
    out, _ = run_driver(exe, obs, tmp_path)
    assert (out["rc"] == int(header_constants(tmp_path / "policy.h")["POLICY_ERR_OUTPUT"])).all(), out["rc"]


@pytest.mark.parametrize("task", ["quad_hover", "arm_push"])
def test_sac_actors_export_and_only_the_quadrotor_gets_c(tmp_path, task):
    """SAC's actor has a (mean, log std) head: its C is the mean half. C is for the Crazyflie's MCU:
    an arm policy exports to ONNX only. Both are parity-checked."""
    from policies.config import compose_config
    from sim.registry import get_task

    cfg = compose_config([f"task={task}", "algo=sac"])
    contract = get_task(task).contract
    actor = make_actor(obs_dim=contract.obs_size, state_dependent_std=True, act_dim=contract.action_size)
    OmegaConf.save(cfg, tmp_path / "config.yaml")
    ckpt.save_atomic(ckpt.policy_record(actor, cfg, {"success_rate": 0.5, "episodes": 10}, steps=1), tmp_path / ckpt.BEST)
    res = export_run(tmp_path)
    assert res["ok"], res
    if task != "quad_hover":
        assert "c" not in res and not (tmp_path / "export" / "policy.c").exists()
        return
    exe = compile_c("gcc", [*STRICT, "-O2"], [res["c"], DRIVER], res["c"].parent, tmp_path / "drv")
    obs = np.load(tmp_path / "export" / "parity_obs.npy")
    out, stdout = run_driver(exe, obs, tmp_path)
    assert "self_test 0\n" in stdout and (out["rc"] == 0).all()
    with torch.no_grad():
        ref = actor(torch.as_tensor(obs)).numpy()
    assert np.abs(ref).max() > 0.5 and np.abs(out["action"] - ref).max() <= 1e-5


# ---------------------------------------------------------------------------------------------
# CLI and generator errors


def test_cli_without_checkpoint_prints_one_error_line(tmp_path):
    r = subprocess.run([sys.executable, "-m", "policies.export", str(tmp_path)], capture_output=True, text=True,
                       cwd=REPO, timeout=120)
    assert r.returncode != 0
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error:") and "Traceback" not in r.stderr, r.stderr
    assert f"{tmp_path} is not a run directory (no config.yaml, no {ckpt.BEST})" in lines[0], lines


def test_cli_corrupt_checkpoint_prints_one_error_line(tmp_path, capsys):
    (tmp_path / ckpt.BEST).parent.mkdir(parents=True)
    (tmp_path / ckpt.BEST).write_bytes(b"\x80\x02 truncated")
    assert main([str(tmp_path)]) != 0
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error:") and "corrupt" in err[0]
    assert not (tmp_path / "export").exists()


@pytest.mark.parametrize("cli", ["policies.export", "policies.eval"])
def test_cli_config_of_another_revision_prints_one_error_line(run_dir, tmp_path, cli):
    rec = torch.load(run_dir / ckpt.BEST, weights_only=False)
    rec["config"]["task"]["a_key_of_another_revision"] = 1.0
    ckpt.save_atomic(rec, tmp_path / ckpt.BEST)
    r = subprocess.run([sys.executable, "-m", cli, str(tmp_path)], capture_output=True, text=True, cwd=REPO,
                       timeout=120)
    lines = r.stderr.strip().splitlines()
    assert r.returncode == 2 and len(lines) == 1 and "Traceback" not in r.stderr, r.stderr
    assert "does not fit this version" in lines[0] and "a_key_of_another_revision" in lines[0]


def test_the_c_check_allows_the_float32_rounding_of_a_wide_network(tmp_path):
    """The C against onnxruntime within the ONNX check's tolerance (4 x PyTorch's own float32 error, at
    least 1e-5): a correct ReLU actor of 512 x 512 with 3x weights rounds to 1.3e-5 from onnxruntime,
    which a fixed 1e-5 refused; the deployed 32 x 32 actor stays at the floor."""
    import copy

    from export.c_codegen import generate_c
    from export.onnx_policy import export_onnx
    from policies.export import c_parity, parity

    from policies.config import to_objects
    from policies.export import parity_observations

    pretrained, rec = ckpt.load_policy(REPO / "policies" / "pretrained" / "quad_hover")
    obs = parity_observations(pretrained, to_objects(OmegaConf.create(rec["config"]))[0])  # its export's 20k
    torch.manual_seed(0)
    wide = Actor(22, 4, [512, 512], "relu", 0.33)
    wide.obs_norm.load_state_dict(pretrained.obs_norm.state_dict())
    with torch.no_grad():
        for w in list(wide.net.parameters())[:-2]:
            w.mul_(3.0)
        wide.net[-1].weight.normal_(0.0, 0.05)
    for actor, name in ((wide.eval(), "wide"), (copy.deepcopy(pretrained), "deployed")):
        out = tmp_path / name
        export_onnx(actor, out / "policy.onnx", {"task": "quad_hover"})
        generate_c(actor, out)
        onnx = OnnxPolicy(out / "policy.onnx")
        res = parity(actor, onnx, obs)
        c = c_parity(out, obs, onnx(obs), max(1e-5, res["tolerance"]))
        assert res["onnx_ok"] and c["c_ok"], (name, res, c)
        if name == "wide":
            assert c["c_max_abs_diff"] > 1e-5 and res["tolerance"] > c["c_max_abs_diff"], (res, c)
        else:
            assert res["tolerance"] == 1e-5 and c["c_max_abs_diff"] < 1e-6, (res, c)


def test_export_names_a_missing_run_and_an_extra_argument(run_dir, tmp_path, capsys):
    assert main([str(tmp_path / "nope")]) == 2
    assert capsys.readouterr().err.strip() == f"error: {tmp_path / 'nope'}: no such run directory"
    (tmp_path / "empty").mkdir()  # a directory that is not a run, a run's checkpoints/, a run before its first
    assert main([str(tmp_path / "empty")]) == 2  # evaluation: each named for what it is (all said "train first")
    assert capsys.readouterr().err.strip() == (
        f"error: {tmp_path / 'empty'} is not a run directory (no config.yaml, no checkpoints/best.pt): expected one "
        f"made by python -m policies.train")
    assert main([str(Path(run_dir) / "checkpoints")]) == 2
    assert capsys.readouterr().err.strip() == (f"error: {Path(run_dir) / 'checkpoints'}: give the run directory, not "
                                               f"its checkpoints ({run_dir})")
    (tmp_path / "young").mkdir()
    (tmp_path / "young" / "config.yaml").write_text((Path(run_dir) / "config.yaml").read_text())
    assert main([str(tmp_path / "young")]) == 2
    assert capsys.readouterr().err.strip() == (f"error: no checkpoint at {tmp_path / 'young' / 'checkpoints/best.pt'} "
                                               f"yet: the run has not finished its first evaluation "
                                               f"(resume={tmp_path / 'young'} trains on)")
    assert main([str(run_dir), "foo=1"]) == 2
    assert capsys.readouterr().err.strip() == "error: unexpected argument 'foo=1'; usage: python -m policies.export <run_dir>"


def test_a_failed_check_leaves_the_last_good_export_in_place(run_dir, tmp_path, monkeypatch, capsys):
    import policies.export as pe

    d = tmp_path / "run"
    shutil.copytree(run_dir, d, ignore=shutil.ignore_patterns("export*"))
    assert main([str(d)]) == 0
    (d / "export" / "marker").write_text("the export that passed")
    assert "parity C (built for this host) vs onnxruntime" in capsys.readouterr().out
    real = pe.run_on_host

    def off(c_dir, obs):  # a C whose actions are 1e-3 off: the check fails
        self_test, out = real(c_dir, obs)
        out["action"] += 1e-3
        return self_test, out

    monkeypatch.setattr(pe, "run_on_host", off)
    assert main([str(d)]) == 1
    assert "export failed its check" in capsys.readouterr().err
    assert (d / "export" / "marker").is_file() and (d / "export.failed" / "policy.c").is_file()
    assert not (d / "export.tmp").exists()
    def broken(*a, **k):
        raise UnsupportedLayerError("the generator broke")

    monkeypatch.setattr(pe, "generate_c", broken)  # an error half-way: the ONNX written, no C
    assert main([str(d)]) == 2 and "the generator broke" in capsys.readouterr().err
    assert (d / "export" / "marker").is_file() and (d / "export.failed" / "policy.onnx").is_file()
    assert not (d / "export.failed" / "policy.c").exists() and not (d / "export.tmp").exists()


def _swap_activation(actor):
    actor.net[1] = nn.Sigmoid()


def _insert_layernorm(actor):
    actor.net.insert(1, nn.LayerNorm(32))


def _mix_activations(actor):
    actor.net[3] = nn.ReLU()


@pytest.mark.parametrize("edit, name", [(_swap_activation, "Sigmoid"), (_insert_layernorm, "LayerNorm"),
                                        (_mix_activations, "mixed activations")])
def test_generate_c_refuses_unsupported_layers(tmp_path, edit, name):
    actor = make_actor()
    edit(actor)
    with pytest.raises(UnsupportedLayerError, match=name):
        generate_c(actor, tmp_path)
    assert not (tmp_path / "policy.c").exists()
