"""The policy firmware: glue unit tests on the host, the cross-build for the Crazyflie's MCU, and the
exported policy on an emulated STM32F405 (QEMU), closed loop with the simulator.

The fast tests use an untrained actor with random weights (it does not hover; it exercises the
numerics and the link). ``test_pretrained_hovers_through_the_mcu`` runs the hover criterion's
closed loop on the shipped policy in policies/pretrained/quad_hover/ and is skipped until it exists.
"""

import math
import os
import re
import signal
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from omegaconf import OmegaConf

from export.c_codegen import contract_macro, generate_c
from export.onnx_policy import export_onnx
from firmware import build, pil
from policies import checkpoint as ckpt
from policies.config import to_objects
from policies.evaluate import EPISODE_SECONDS, SUCCESS_RATE_REQUIRED, evaluate_hover
from policies.networks import Actor
from sim.crazyflie.contract import CONTRACT, POLICY_PERIOD
from sim.crazyflie.params import NOMINAL
from sim.registry import get_task

REPO = Path(__file__).resolve().parents[1]
PRETRAINED_HOVER = REPO / "policies" / "pretrained" / "quad_hover"
ACTION_TOL = 1e-5  # MCU vs onnxruntime, per action: the image's own boot self-test bound (measured: 3-5e-7)


def requires(*tools: str):
    missing = [t for t in tools if shutil.which(t) is None]
    return pytest.mark.skipif(bool(missing), reason=f"not installed: {', '.join(missing)}")


def export_actor(actor: Actor, out_dir: Path, note: str) -> Path:
    """policy.onnx + policy.c/.h of ``actor`` in out_dir, as ``python -m policies.export`` writes them."""
    export_onnx(actor, out_dir / "policy.onnx", {"task": "quad_hover", "note": note})
    generate_c(actor, out_dir, header_note=note)
    return out_dir


def random_actor(seed: int = 0) -> Actor:
    """The deployable actor architecture with random weights and a plausible hover normaliser."""
    torch.manual_seed(seed)
    actor = Actor(obs_dim=CONTRACT.obs_size, act_dim=CONTRACT.action_size, hidden=[32, 32], activation="tanh",
                  init_action=NOMINAL.hover_action)
    level = [1.0, 0.0, 0.0, 0.0, 1.0, 0.0, 0.0, 0.0, 1.0]
    std = [0.15] * 3 + [0.3] * 9 + [0.4] * 3 + [1.0] * 3 + [0.1] * 4  # m, 1, m/s, rad/s, 1
    with torch.no_grad():
        actor.obs_norm.mean.copy_(torch.tensor([0.0] * 3 + level + [0.0] * 6 + [NOMINAL.hover_action] * 4))
        actor.obs_norm.var.copy_(torch.tensor(std) ** 2)
        # The output layer starts near zero by design; spread it so actions vary with the input.
        actor.net[-1].weight.normal_(0.0, 0.3)
    return actor.eval()


@pytest.fixture(scope="module")
def build_dir(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("firmware_build")


@pytest.fixture(scope="module")
def export_dir(tmp_path_factory) -> Path:
    return export_actor(random_actor(), tmp_path_factory.mktemp("export"), "random test actor")


@pytest.fixture(scope="module")
def mcu(export_dir, build_dir):
    if shutil.which("qemu-system-arm") is None or shutil.which("arm-none-eabi-gcc") is None:
        pytest.skip("needs qemu-system-arm and arm-none-eabi-gcc")
    with pil.McuPolicy(export_dir, build_dir / "pil") as m:
        yield m
    assert m.proc.returncode == 0, f"QEMU exited with {m.proc.returncode}"


# ---------------------------------------------------------------------- host and cross builds
def test_vehicle_header_is_generated_from_params():
    assert build.VEHICLE_HEADER.read_text() == build.vehicle_header(), (
        "crazyflie/src/cf_vehicle.h is out of date with sim/crazyflie/params.py: "
        "run python -m firmware.build vehicle-header")


@pytest.mark.parametrize("cc", ["gcc", "clang"])
def test_glue_unit_tests_pass_on_host(cc, build_dir):
    if shutil.which(cc) is None:
        pytest.skip(f"{cc} not installed")
    out = build.run_host_tests(build_dir, cc=cc)
    assert ", 0 failed" in out


@requires("arm-none-eabi-gcc")
def test_controller_adapter_compiles_with_firmware_flags(export_dir, build_dir):
    build.make("adapter-check", build_dir, POLICY_DIR=export_dir)


def test_the_glue_header_places_the_observation_as_the_contract_does():
    """cf_policy_glue.h is written by hand: its offsets must be the contract's (sim/crazyflie/contract.py)."""
    header = (build.FIRMWARE_DIR / "crazyflie" / "src" / "cf_policy_glue.h").read_text()
    defined = {k: int(v) for k, v in re.findall(r"#define (CFP_OBS_\w+|CFP_ACT_DIM) (\d+)", header)}
    starts = [CONTRACT.slice(f.name).start for f in CONTRACT.observation]
    names = ("CFP_OBS_POS", "CFP_OBS_ROT", "CFP_OBS_VEL", "CFP_OBS_OMEGA", "CFP_OBS_PREV")
    assert [defined[k] for k in names] == starts
    assert (defined["CFP_OBS_DIM"], defined["CFP_ACT_DIM"]) == (CONTRACT.obs_size, CONTRACT.action_size)


@requires("arm-none-eabi-gcc")
@pytest.mark.parametrize("define, value, message", [("POLICY_OBS_DIM", "23", "observation size"),
                                                    ("POLICY_ACT_DIM", "3", "action size"),
                                                    ("POLICY_PERIOD_MS", "20", "period")])
def test_controller_adapter_refuses_a_policy_header_of_other_sizes(export_dir, build_dir, tmp_path, define, value,
                                                                   message):
    (tmp_path / "policy.c").write_text((export_dir / "policy.c").read_text())
    header = (export_dir / "policy.h").read_text()
    changed = re.sub(rf"#define {define} \d+", f"#define {define} {value}", header)
    assert changed != header
    (tmp_path / "policy.h").write_text(changed)
    with pytest.raises(build.BuildError, match=message):
        build.make("adapter-check", build_dir, POLICY_DIR=tmp_path)


@requires("arm-none-eabi-gcc")
def test_controller_adapter_refuses_a_policy_of_another_contract(export_dir, build_dir, tmp_path):
    """Same sizes, another contract (or an export from before contract macros): refused at compile time.
    The glue's configuration names the contract of sim/crazyflie/contract.py."""
    assert contract_macro(CONTRACT.version) in (REPO / "firmware/crazyflie/src/cf_policy_config.h").read_text()
    (tmp_path / "policy.c").write_text((export_dir / "policy.c").read_text())
    header = (export_dir / "policy.h").read_text()
    changed = header.replace(contract_macro(CONTRACT.version), contract_macro("crazyflie-rpm-v2"))
    assert changed != header
    (tmp_path / "policy.h").write_text(changed)
    with pytest.raises(build.BuildError, match="is not of contract crazyflie-rpm-v1"):
        build.make("adapter-check", build_dir, POLICY_DIR=tmp_path)


@requires("arm-none-eabi-gcc")
def test_controller_adapter_refuses_a_policy_header_without_its_self_test_tolerance(export_dir, build_dir, tmp_path):
    """An export from before policy.h carried POLICY_SELF_TEST_TOL: one line that says to re-export."""
    (tmp_path / "policy.c").write_text((export_dir / "policy.c").read_text())
    header = (export_dir / "policy.h").read_text()
    changed = re.sub(r"#define POLICY_SELF_TEST_TOL .*\n", "", header)
    assert changed != header
    (tmp_path / "policy.h").write_text(changed)
    with pytest.raises(build.BuildError, match="predates POLICY_SELF_TEST_TOL"):
        build.make("adapter-check", build_dir, POLICY_DIR=tmp_path)


@requires("arm-none-eabi-gcc")
def test_the_adapter_check_reads_the_exports_header_not_one_left_by_a_flight_build(export_dir, build_dir, tmp_path):
    """An out-of-tree build leaves policy.h in crazyflie/src (the adapter's own directory, where a quoted
    include looks first): adapter-check must still check POLICY_DIR's."""
    left = REPO / "firmware/crazyflie/src/policy.h"
    kept = left.read_bytes() if left.exists() else None
    try:
        left.write_text((export_dir / "policy.h").read_text().replace("#define POLICY_OBS_DIM 22",
                                                                       "#define POLICY_OBS_DIM 23"))
        build.make("adapter-check", build_dir, POLICY_DIR=export_dir)  # the good export passes
        (tmp_path / "policy.c").write_text((export_dir / "policy.c").read_text())
        (tmp_path / "policy.h").write_text((export_dir / "policy.h").read_text().replace(
            "#define POLICY_ACT_DIM 4", "#define POLICY_ACT_DIM 3"))
        left.write_text((export_dir / "policy.h").read_text())
        with pytest.raises(build.BuildError, match="action size"):  # a bad export fails beside a good stale header
            build.make("adapter-check", build_dir, POLICY_DIR=tmp_path)
    finally:
        if kept is None:
            left.unlink(missing_ok=True)
        else:
            left.write_bytes(kept)


@requires("arm-none-eabi-gcc", "arm-none-eabi-size")
def test_a_build_from_another_export_rebuilds_even_from_older_files(export_dir, build_dir, tmp_path):
    """make compares times only: an export whose files are older than the objects (the shipped one after
    a newer run's) would otherwise leave the previous policy in the build."""
    d = build_dir / "rebuild"
    build.cross_sizes(export_dir, d)
    first = (d / "arm" / "policy.o").read_bytes()
    other = export_actor(random_actor(seed=1), tmp_path / "other", "another random actor")
    for f in ("policy.c", "policy.h"):
        os.utime(other / f, (0, 0))  # 1970
    build.cross_sizes(other, d)
    second = d / "arm" / "policy.o"
    assert second.read_bytes() != first
    built = second.stat().st_mtime_ns
    build.cross_sizes(other, d)  # unchanged content: nothing rebuilt
    assert second.stat().st_mtime_ns == built


@requires("arm-none-eabi-gcc", "arm-none-eabi-size")
def test_cross_build_fits_the_stm32f405(export_dir, build_dir):
    sizes = build.cross_sizes(export_dir, build_dir)
    print(f"policy + glue, Cortex-M4F -O2: {sizes}")
    assert sizes["text"] > 0 and sizes["bss"] > 0
    assert sizes["flash"] <= build.FLASH_BYTES and sizes["ram"] <= build.RAM_BYTES


@requires("arm-none-eabi-gcc", "arm-none-eabi-size")
def test_the_sizes_command_prints_them_and_builds_outside_the_checkout(export_dir, capsys, monkeypatch):
    built_in, cross_sizes = [], build.cross_sizes
    monkeypatch.setattr(build, "cross_sizes", lambda export, d: built_in.append(Path(d)) or cross_sizes(export, d))
    assert build.main(["sizes", str(export_dir)]) == 0
    assert capsys.readouterr().out.startswith("policy + glue for Cortex-M4F: text ")
    assert not built_in[0].resolve().is_relative_to(REPO), "a read-only checkout would refuse it"


def test_missing_export_is_a_clear_error(tmp_path):
    with pytest.raises(build.BuildError, match="python -m policies.export"):
        build.cross_sizes(tmp_path, tmp_path / "build")
    (tmp_path / "export").mkdir()  # an exported run given for its export: named, not "export a run first"
    for name in ("policy.c", "policy.h"):
        (tmp_path / "export" / name).write_text("")
    with pytest.raises(build.BuildError) as e:
        build.cross_sizes(tmp_path, tmp_path / "build")
    assert str(e.value) == f"{tmp_path.resolve()} is a run directory: give its export, {tmp_path.resolve() / 'export'}"


# ---------------------------------------------------------------------- emulated MCU
def _running(pid: int) -> bool:
    """Whether process ``pid`` exists and is not a zombie (an orphan killed in a container whose init
    does not reap it stays one)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except (FileNotFoundError, ProcessLookupError):
        return False


@requires("qemu-system-arm", "arm-none-eabi-gcc", "setpriv")
def test_qemu_dies_with_the_process_that_started_it(export_dir, build_dir):
    """QEMU outlives its closed pipes: a firmware_bridge killed with SIGKILL (or crashing) left it running."""
    import subprocess
    import sys
    import time

    code = ("import time; from firmware import pil; "
            f"m = pil.McuPolicy({str(export_dir)!r}, {str(build_dir / 'pil')!r}, compare_onnx=False); "
            "print(m.proc.pid, flush=True); time.sleep(60)")
    child = subprocess.Popen([sys.executable, "-c", code], cwd=REPO, stdout=subprocess.PIPE, text=True)
    try:
        qemu = int(child.stdout.readline())
        assert _running(qemu)
    finally:
        child.kill()
        child.wait()
    deadline = time.monotonic() + 5.0
    while _running(qemu) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not _running(qemu), f"QEMU (pid {qemu}) outlived its parent"


def test_mcu_boots_and_passes_the_self_test(mcu):
    assert mcu.boot.self_test_rc == 0
    assert "self-test passed" in mcu.console()
    assert mcu.boot.self_test_instructions > 0


@requires("qemu-system-arm", "arm-none-eabi-gcc")
def test_an_image_that_fails_its_self_test_is_refused(export_dir, tmp_path):
    """An image whose policy.c does not compute its exported reference actions (here: the reference altered)
    is refused with the self-test's result, as the vehicle's firmware refuses to fly it."""
    bad = tmp_path / "export"
    shutil.copytree(export_dir, bad)
    c = (bad / "policy.c").read_text()
    head, _, rest = c.partition("selftest_action[POLICY_ACT_DIM] = {\n  ")
    (bad / "policy.c").write_text(f"{head}selftest_action[POLICY_ACT_DIM] = {{\n  -0.99f + 0.0f * {rest}")
    with pytest.raises(pil.PilError, match=r"failed its policy self-test \(rc 1\)"):
        pil.McuPolicy(bad, tmp_path / "build", compare_onnx=False)


def test_link_resynchronises_and_rejects_bad_input(mcu):
    obs = np.zeros(CONTRACT.obs_size, np.float32)
    good = pil.encode_frame(pil.FRAME_OBS, 77, obs.tobytes())
    corrupted = bytearray(good)
    corrupted[20] ^= 0x40
    mcu.send_bytes(b"\x00\x13\xa5\x00" + bytes(corrupted) + good)
    nack, answer = mcu.read_frame(), mcu.read_frame()
    assert nack.type == pil.FRAME_NACK
    assert answer.type == pil.FRAME_ACTION and answer.seq == 77

    # A non-finite observation: error code and the safe action (all rotors stopped).
    obs[5] = np.nan
    actions, rcs, _ = mcu.exchange(obs[None])
    assert rcs[0] == 1
    assert (actions[0] == -1.0).all()
    with pytest.raises(pil.PilError, match=r"observations of 22 floats, got shape \[22, 21\]"):
        mcu.exchange(np.zeros((22, 21), np.float32))  # not 21 observations of 22


def test_an_answer_that_comes_too_late_does_not_shift_the_next_ones(mcu):
    """QEMU frozen past the timeout (a stalled host): that exchange fails; its late answer is
    dropped when it arrives, and the next exchanges get their own answers."""
    obs = np.random.default_rng(0).normal(0.0, 0.3, (3, CONTRACT.obs_size)).astype(np.float32)
    expected, _, _ = mcu.exchange(obs)
    timeout, mcu.timeout_s = mcu.timeout_s, 0.2
    os.kill(mcu.proc.pid, signal.SIGSTOP)
    try:
        with pytest.raises(pil.PilError, match="no answer from the MCU"):
            mcu.exchange(obs[:1])
    finally:
        os.kill(mcu.proc.pid, signal.SIGCONT)
        mcu.timeout_s = timeout
    late = mcu.stats.late_answers
    actions, rcs, _ = mcu.exchange(obs[1:])
    assert (rcs == 0).all() and np.array_equal(actions, expected[1:])
    assert mcu.stats.late_answers == late + 1


def test_an_image_whose_policy_c_is_another_network_than_the_onnx_is_refused(mcu, export_dir, tmp_path):
    from export.onnx_policy import OnnxPolicy

    assert mcu.check_against(OnnxPolicy(export_dir / "policy.onnx")) < ACTION_TOL
    other = export_actor(random_actor(seed=1), tmp_path, "another random actor") / "policy.onnx"
    says = f"policy.c does not compute {re.escape(str(other))}'s policy: actions differ"
    with pytest.raises(pil.PilError, match=says):
        mcu.check_against(OnnxPolicy(other))


@requires("qemu-system-arm")
def test_tick_count_agrees_with_an_exact_instruction_trace(mcu):
    exact = pil.count_instructions_exact(mcu.elf)
    # The tick count also covers the call instruction and one timer read around the call.
    assert abs(mcu.boot.self_test_instructions - exact) <= 8, (mcu.boot.self_test_instructions, exact)


def test_closed_loop_through_the_mcu_matches_onnxruntime(mcu):
    mcu.stats = pil.PilStats()
    episodes = 2
    task_cfg = get_task("quad_hover").default_config()
    result = evaluate_hover(mcu, task_cfg, episodes=episodes)
    stats = mcu.stats
    print(f"\nPIL closed loop ({episodes} episodes of {EPISODE_SECONDS:g} s): {stats.summary()}")
    assert result.episodes == episodes
    assert stats.steps == episodes * round(EPISODE_SECONDS / POLICY_PERIOD)
    assert stats.errors == 0
    assert stats.max_abs_diff <= ACTION_TOL
    assert len(stats.instructions) == stats.steps and min(stats.instructions) > 0


def test_the_onboard_glue_on_the_mcu_flies_the_policy_from_firmware_units(mcu, export_dir):
    """cf_policy_glue on the MCU, given what controller_oot.c gives it on the vehicle (quaternion w, x,
    y, z; gyro in deg/s; the setpoint), computes the action onnxruntime computes from the contract
    observation (previous action: the hover action when it engages, then the last action as applied) and the
    motor forces of the thrust mapping, clamped at the stock THRUST_MAX and cut below its THRUST_MIN, and holds
    the action between policy periods; a stale setpoint latches the dead-man fault, a fresh stop clears it, a non-finite
    gyro is a policy error."""
    from deploy.state import make_state, observation
    from export.onnx_policy import OnnxPolicy

    onnx = OnnxPolicy(export_dir / "policy.onnx")
    assert mcu.boot.thrust_max == pytest.approx(0.1125)  # platform_defaults_cf2.h, stock propellers
    assert mcu.boot.thrust_min == pytest.approx(0.02)  # its THRUST_MIN: motors.c stops a motor below it
    zeros, now = np.zeros(3), 1000
    assert pil.GLUE_MODES[mcu.glue_step(zeros, (1, 0, 0, 0), zeros, zeros, zeros, zeros, now, now,
                                        setpoint_kind=pil.SETPOINT_STOP).mode] == "idle"
    rng = np.random.default_rng(7)
    prev = np.full(4, NOMINAL.hover_action, np.float32)
    saturated = 0
    for _ in range(30):
        now += 10
        q = rng.normal(size=4)
        st = make_state(rng.uniform(-1, 1, 3) + [0, 0, 1], q / np.linalg.norm(q), rng.normal(0, 0.5, 3),
                        rng.normal(0, 2.0, 3), 0.0)
        sp = rng.uniform(-0.3, 0.3, 3) + [0, 0, 1]
        out = mcu.glue_step(st.pos, st.quat, st.vel, np.degrees(st.omega), sp, zeros, now, now)
        assert pil.GLUE_MODES[out.mode] == "policy" and out.fault == 0 and out.rc == 0
        expected = onnx(observation(st, sp, prev)[None])[0]
        rpm = (expected.astype(np.float64) + 1) / 2 * NOMINAL.rpm_max
        thrust = NOMINAL.kf * rpm**2
        force = np.where(thrust < mcu.boot.thrust_min, 0.0, np.minimum(thrust / mcu.boot.thrust_max, 1.0))
        assert np.abs(out.force - force).max() <= 1e-5, (out.force, force)
        below = force < 1.0
        # the action applied (fed back as the next previous action): the policy's, or at the force limit
        # the action of that force, or -1 where the motor is stopped
        applied = np.where(force == 0.0, -1.0, np.where(below, expected, pil.force_to_action(1.0, mcu.boot.thrust_max)))
        assert np.abs(out.action - applied).max() <= ACTION_TOL, (out.action, expected)
        assert np.allclose(pil.force_to_action(out.force, mcu.boot.thrust_max), applied, atol=1e-5)
        saturated += int((~below).sum())
        prev = out.action
    assert saturated > 0  # some actions above ~0.74 were clamped, as on the vehicle
    # A stabilizer step within the policy period (5 ms on) holds the action, whatever the state; the
    # step travels in the frame (by default the ms clock: a 1 kHz stabilizer).
    held = mcu.glue_step(st.pos + 0.5, st.quat, st.vel, zeros, sp, zeros, now + 5, now + 5)
    assert pil.GLUE_MODES[held.mode] == "policy" and np.array_equal(held.action, prev)
    moved = mcu.glue_step(st.pos + 0.5, st.quat, st.vel, zeros, sp, zeros, now + 5, now + 5, step=now + 10)
    assert not np.array_equal(moved.action, prev)
    # Setpoints stop for longer than the dead-man time: in flight, the stock controller's turn, motors
    # not the policy's; a stop setpoint with a fresh stamp clears the fault.
    out = mcu.glue_step(st.pos, st.quat, st.vel, zeros, sp, zeros, now + 400, now)
    assert (pil.GLUE_MODES[out.mode], pil.GLUE_FAULTS[out.fault]) == ("fallback", "dead-man")
    assert not out.force.any()
    out = mcu.glue_step(zeros, (1, 0, 0, 0), zeros, zeros, zeros, zeros, now + 410, now + 410,
                        setpoint_kind=pil.SETPOINT_STOP)
    assert (pil.GLUE_MODES[out.mode], pil.GLUE_FAULTS[out.fault]) == ("idle", "none")
    out = mcu.glue_step(st.pos, st.quat, st.vel, (math.nan, 0, 0), sp, zeros, now + 420, now + 420)
    assert pil.GLUE_FAULTS[out.fault] == "policy error" and out.rc != 0 and not out.force.any()


# ---------------------------------------------------------------------- shipped policy
@pytest.mark.parametrize("run_dir", [PRETRAINED_HOVER], ids=["quad_hover"])
def test_pretrained_hovers_through_the_mcu(run_dir, tmp_path):
    """The hover criterion's closed loop (20 episodes) with every action computed by the MCU."""
    if not (run_dir / ckpt.BEST).is_file():
        pytest.skip(f"no shipped policy at {run_dir} yet")
    if shutil.which("qemu-system-arm") is None or shutil.which("arm-none-eabi-gcc") is None:
        pytest.skip("needs qemu-system-arm and arm-none-eabi-gcc")
    actor, _ = ckpt.load_policy(run_dir)
    task_cfg, _ = to_objects(OmegaConf.load(run_dir / "config.yaml"))
    export_dir = export_actor(actor, tmp_path / "export", f"from {run_dir.name}")
    episodes = 20
    with pil.McuPolicy(export_dir, tmp_path / "build") as mcu:
        assert mcu.boot.self_test_rc == 0, mcu.console()  # the real firmware would refuse to fly otherwise
        on_mcu = evaluate_hover(mcu, task_cfg, episodes=episodes)
        stats = mcu.stats
    assert mcu.proc.returncode == 0, f"QEMU exited with {mcu.proc.returncode}"
    in_torch = evaluate_hover(actor, task_cfg, episodes=episodes)
    print(f"\nMCU: {on_mcu.summary()}\n      {stats.summary()}\ntorch: {in_torch.summary()}")
    assert stats.errors == 0 and stats.max_abs_diff <= ACTION_TOL
    assert on_mcu.success_rate >= SUCCESS_RATE_REQUIRED
    # Same seed, same noise: the MCU may differ from PyTorch by float rounding, not by an episode more.
    assert math.isclose(on_mcu.success_rate, in_torch.success_rate, abs_tol=1.0 / episodes)
