"""Deploy logic without processes: state conversions, the observation, safety rules, the launch
runner's parser, the Crazyflie log conversion, the recorder's schemas and the package layout."""

from __future__ import annotations

import dataclasses
import json
import math
import os
import re
import signal
import subprocess
import sys
import threading
import time
import tomllib
from pathlib import Path

import numpy as np
import pytest
import torch

from deploy import ament
from deploy.crazyflie_bridge import (
    LOG_BLOCKS,
    LOG_TYPE_BYTES,
    MAX_LOG_BLOCK_BYTES,
    StateAssembler,
    state_from_log,
)
from deploy.launch import LaunchError, Scope, parse_cli, plan, substitute
from deploy.policy_node import ACTUATION_LOG_EVERY_S, DROP_LOG_EVERY_S, STATUS_EVERY, LogLimiter
from deploy.ros import NODE_PARAMETERS, PARAMETERS, names_node, params_file_sections, ros_arguments
from deploy.safety import (
    CLOCK_RESTART_WINDOW_S,
    CLOCK_RESTARTS_MAX,
    IDLE_ACTION,
    LANDED_SAMPLES,
    SPIN_DOWN_S,
    DescentProfile,
    Mode,
    OnboardDescent,
    SafeController,
    SafetyConfig,
)
from deploy.state import (
    InvalidState,
    State,
    StateLimits,
    fill_odometry,
    make_state,
    observation,
    quat_to_rotmat,
    stamp_seconds,
    state_from_odometry,
)
from sim.crazyflie.hover import InitConfig, QuadHoverEnv, QuadTaskConfig
from sim.crazyflie.params import GRAVITY, NOMINAL, action_to_rpm

REPO = Path(__file__).resolve().parents[1]
TARGET = np.array([0.0, 0.0, 1.0])


def random_quat(rng) -> np.ndarray:
    q = rng.normal(size=4)
    return q / np.linalg.norm(q)


# ---------------------------------------------------------------------------------------------
# state and observation


def test_odometry_round_trip_uses_body_frame_twist():
    from nav_msgs.msg import Odometry

    rng = np.random.default_rng(0)
    q = random_quat(rng)
    s = make_state([0.1, -0.2, 1.3], q, [0.5, -0.3, 0.2], [0.1, 0.2, -0.3], stamp=12.25)
    msg = fill_odometry(Odometry(), s, "world", "cf1")
    o = msg.pose.pose.orientation
    assert (o.x, o.y, o.z, o.w) == pytest.approx((q[1], q[2], q[3], q[0]))  # ROS order x, y, z, w
    v = msg.twist.twist.linear
    assert np.allclose([v.x, v.y, v.z], quat_to_rotmat(q).T @ s.vel)  # REP 105: twist in the body frame
    assert (msg.header.stamp.sec, msg.header.stamp.nanosec, msg.child_frame_id) == (12, 250_000_000, "cf1")
    back = state_from_odometry(msg)
    assert np.allclose(back.vel, s.vel) and np.allclose(back.quat, q) and np.allclose(back.omega, s.omega)


def test_yawed_vehicle_flying_forward_reports_world_velocity():
    from nav_msgs.msg import Odometry

    yaw90 = [math.cos(math.pi / 4), 0.0, 0.0, math.sin(math.pi / 4)]  # body x points along world y
    msg = Odometry()
    msg.header.frame_id = "world"
    o = msg.pose.pose.orientation
    o.w, o.x, o.y, o.z = yaw90
    msg.twist.twist.linear.x = 1.0  # forward in the body frame
    assert np.allclose(state_from_odometry(msg).vel, [0.0, 1.0, 0.0], atol=1e-12)


@pytest.mark.parametrize("quat, reason", [
    ((0.0, 0.0, 0.0, 0.0), "out_of_range"),
    ((1e200, 1e200, 0.0, 0.0), "out_of_range"),  # its norm overflows; the velocity must not
    ((2.0, 0.0, 0.0, 0.0), "out_of_range"),
    ((math.nan, 0.0, 0.0, 1.0), "nonfinite"),
])
def test_odometry_with_a_bad_quaternion_is_refused_for_it(quat, reason):
    from nav_msgs.msg import Odometry

    msg = Odometry()
    o = msg.pose.pose.orientation
    o.w, o.x, o.y, o.z = quat
    msg.twist.twist.linear.x = 1.0
    with pytest.raises(InvalidState) as e:
        state_from_odometry(msg)
    assert e.value.reason == reason


@pytest.mark.parametrize("bad, reason", [
    (dict(pos=[math.nan, 0, 1]), "nonfinite"),
    (dict(omega=[0, math.inf, 0]), "nonfinite"),
    (dict(quat=[0, 0, 0, 0]), "out_of_range"),
    (dict(vel=[50.0, 0, 0]), "out_of_range"),
    (dict(pos=[1e6, 0, 0]), "out_of_range"),
    (dict(omega=[0, 0, 100.0]), "out_of_range"),
])
def test_invalid_states_are_rejected_with_a_reason(bad, reason):
    good = dict(pos=[0, 0, 1], quat=[1, 0, 0, 0], vel=[0, 0, 0], omega=[0, 0, 0])
    with pytest.raises(InvalidState) as e:
        make_state(**(good | bad), stamp=0.0)
    assert e.value.reason == reason


def test_observation_matches_the_training_environment():
    """The deploy observation of a simulator state equals QuadHoverEnv's noise-free policy observation."""
    cfg = QuadTaskConfig()
    cfg.noise.enabled = False
    env = QuadHoverEnv(cfg, 8, seed=3)
    obs, _ = env.reset(seed=3)
    env.step(torch.rand(8, 4) * 2 - 1)
    obs = env._observe(None)["policy"].numpy()
    for i in range(8):
        s = env.backend.state[i].double().numpy()
        st = make_state(s[0:3], s[3:7], s[7:10], s[10:13], 0.0)
        mine = observation(st, np.asarray(cfg.target), env.prev_action[i].numpy())
        assert np.allclose(mine, obs[i], atol=1e-5)


# ---------------------------------------------------------------------------------------------
# safety layer


# 5 cm inside the default geofence's x = 1.5 m side, and 5 cm outside it: a step a sample can take
NEAR_FENCE, OUTSIDE_FENCE = [1.45, 0.0, 1.0], [1.55, 0.0, 1.0]


def hover_state(t: float = 0.0, z: float = 1.0, **kw) -> State:
    return make_state(kw.get("pos", [0.0, 0.0, z]), [1, 0, 0, 0], [0, 0, 0], [0, 0, 0], t)


class FakePolicy:
    def __init__(self):
        self.out = np.full(4, 0.3)
        self.calls = 0

    def __call__(self, obs):
        self.calls += 1
        assert obs.shape == (22,) and obs.dtype == np.float32
        if isinstance(self.out, Exception):
            raise self.out
        return self.out


def armed_controller(at=(0.0, 0.0, 1.0), **cfg) -> tuple[SafeController, FakePolicy]:
    """A controller armed at time 0 on states at rest at ``at`` (world, m), one every 10 ms before (as many
    as make a vehicle in the air: LANDED_SAMPLES)."""
    policy = FakePolicy()
    c = SafeController(policy, SafetyConfig(**cfg))
    for k in range(LANDED_SAMPLES - 1, -1, -1):
        c.on_state(hover_state(-0.01 * k, pos=list(at)), -0.01 * k)
    assert c.arm(0.0) == (True, "armed")
    return c, policy


def test_disarmed_is_idle_and_arming_needs_a_valid_state():
    c = SafeController(FakePolicy(), SafetyConfig())
    assert c.tick(0.0).action.tolist() == [IDLE_ACTION] * 4
    ok, msg = c.arm(0.0)
    assert not ok and "no state" in msg
    c.on_state(hover_state(pos=[5.0, 0.0, 1.0]), 0.0)
    ok, msg = c.arm(0.0)
    assert not ok and "geofence" in msg


def test_armed_runs_the_policy_and_clips():
    c, policy = armed_controller(max_action=0.5)
    policy.out = np.array([2.0, -3.0, 0.1, 0.7])
    cmd = c.tick(0.005)
    assert cmd.mode is Mode.ARMED and cmd.action.tolist() == [0.5, -1.0, 0.1, 0.5]


def test_failsafe_descent_gives_its_share_of_hover_thrust():
    """The failsafe's rotor command lifts descent_thrust_ratio of the weight (thrust = kf rpm^2 on each of
    the four rotors, rpm = (a + 1) / 2 rpm_max by the contract), so the vehicle sinks at (1 - ratio) g."""
    from sim.crazyflie.params import GRAVITY, NOMINAL

    for ratio in (0.9, 0.8):
        c = SafeController(FakePolicy(), SafetyConfig(descent_thrust_ratio=ratio))
        rpm = (c.descent_action + 1.0) / 2.0 * NOMINAL.rpm_max
        thrust = 4 * NOMINAL.kf * rpm**2
        assert thrust / (NOMINAL.mass * GRAVITY) == pytest.approx(ratio, rel=1e-9)
        p = c.descent_profile
        assert p.accel == pytest.approx((1.0 - ratio) * GRAVITY, rel=1e-12) and p.brake == 0.0


@pytest.mark.parametrize("fault", ["stale", "nan", "out_of_range", "geofence", "policy_exception", "policy_nan"])
def test_fault_switches_to_failsafe_in_the_same_tick_and_recovers(fault):
    c, policy = armed_controller(at=NEAR_FENCE)
    now = 0.0
    if fault == "stale":
        now = 0.06
    elif fault == "nan":
        c.on_state(None, now, "nonfinite: NaN")
    elif fault == "out_of_range":
        c.on_state(None, now, "out_of_range: speed")
    elif fault == "geofence":
        c.on_state(hover_state(pos=OUTSIDE_FENCE), now)
    elif fault == "policy_exception":
        policy.out = RuntimeError("boom")
    else:
        policy.out = np.array([math.nan, 0, 0, 0])
    cmd = c.tick(now)
    assert cmd.mode is Mode.FAILSAFE, cmd.reason
    assert np.allclose(cmd.action, c.descent_action) and c.descent_action < c.hover_action
    policy.out = np.full(4, 0.3)
    for k in range(1, 4):  # recover_count = 3 consecutive valid states
        c.on_state(hover_state(pos=NEAR_FENCE), now + 0.01 * k)
        cmd = c.tick(now + 0.01 * k)
    assert cmd.mode is Mode.ARMED and cmd.reason.startswith("recovered")


def test_failsafe_descent_ends_disarmed_after_the_fall_time():
    c, _ = armed_controller()
    assert c.tick(0.1).mode is Mode.FAILSAFE  # stale
    fall = math.sqrt(2 * 1.0 / ((1 - c.cfg.descent_thrust_ratio) * GRAVITY)) + 0.3
    assert c.tick(0.1 + fall - 0.01).mode is Mode.FAILSAFE
    cmd = c.tick(0.1 + fall + 0.01)
    assert cmd.mode is Mode.DISARMED and cmd.action.tolist() == [IDLE_ACTION] * 4 and "re-arm" in cmd.reason
    c.on_state(hover_state(t=5), 5.0)
    assert c.tick(5.0).mode is Mode.DISARMED  # no automatic re-arm after landing


def test_failsafe_descent_of_a_climbing_vehicle_lasts_until_it_can_reach_the_floor():
    c, _ = armed_controller()
    c.on_state(make_state([0, 0, 1.0], [1, 0, 0, 0], [0, 0, 1.0], [0, 0, 0], 0.0), 0.0)  # climbing at 1 m/s
    assert c.tick(0.1).mode is Mode.FAILSAFE  # stale
    a = (1 - c.cfg.descent_thrust_ratio) * GRAVITY
    fall = (1.0 + math.sqrt(1.0 + 2 * a * 1.0)) / a + 0.3  # rises, then sinks from its apex: 3.1 s
    assert fall > math.sqrt(2 * 1.0 / a) + 0.3 + 1.0  # 1.7 s from rest
    assert c.tick(0.1 + fall - 0.01).mode is Mode.FAILSAFE
    assert c.tick(0.1 + fall + 0.01).mode is Mode.DISARMED


def test_failsafe_with_fresh_states_descends_until_they_show_the_floor():
    """A geofence failsafe keeps receiving valid states: those above the floor extend the descent
    (a disturbance can slow the sink), up to twice the first estimate; LANDED_SAMPLES below landed_height
    end it, fewer do not (a glitch to the floor, believed near it)."""
    c, _ = armed_controller(at=NEAR_FENCE)
    a = (1 - c.cfg.descent_thrust_ratio) * GRAVITY
    first = math.sqrt(2 * 1.0 / a) + 0.3
    t, z, vz, on_floor = 0.0, 1.0, 0.0, 0
    while True:  # sinking at a / 2 only: it reaches the floor after the first estimate
        c.on_state(make_state([OUTSIDE_FENCE[0], 0.0, z], [1, 0, 0, 0], [0, 0, vz], [0, 0, 0], t), t)
        mode = c.tick(t).mode
        on_floor = on_floor + 1 if z < c.cfg.landed_height else 0
        if on_floor == LANDED_SAMPLES:
            break
        assert mode is Mode.FAILSAFE, (t, z)
        t += 0.01
        z, vz = (1.0 - 0.25 * a * t * t, -0.5 * a * t) if z > 0.0 else (0.0, 0.0)
        z = max(z, 0.0)
    assert mode is Mode.DISARMED and "landed" in c.reason and first < t < 2 * first, (mode, c.reason, t)
    c, _ = armed_controller(at=NEAR_FENCE)  # at 0.3 m: twice two samples on the floor, 3 back up in between
    assert c.tick(0.1).mode is Mode.FAILSAFE  # (stale)
    for t, z in [(0.11, 0.3), (0.12, 0.3), (0.13, 0.3), (0.5, 0.0), (0.51, 0.0), (0.52, 0.3), (0.53, 0.3),
                 (0.54, 0.3), (0.8, 0.0), (0.81, 0.0)]:  # (after a free fall from 0.3 m: 0.25 s)
        assert c.on_state(hover_state(t, pos=[OUTSIDE_FENCE[0], 0.0, z]), t) is None  # (believed: within max_jump)
        assert c.tick(t).mode is Mode.FAILSAFE, (t, c.reason)
    c, _ = armed_controller(at=NEAR_FENCE)  # a state that stays fresh but never sinks: the cap ends the descent
    for k in range(1000):
        t = 0.01 * k
        c.on_state(hover_state(t, pos=OUTSIDE_FENCE), t)
        if c.tick(t).mode is Mode.DISARMED:
            break
    assert 2 * first - 0.02 <= t <= 2 * first + 0.02


def test_recovery_needs_consecutive_valid_states_inside_the_geofence():
    c, _ = armed_controller(at=NEAR_FENCE)
    for k in range(1, 6):  # five states outside the fence
        c.on_state(hover_state(pos=OUTSIDE_FENCE), 0.01 * k)
        assert c.tick(0.01 * k).mode is Mode.FAILSAFE
        assert c.latest.pos.tolist() == OUTSIDE_FENCE  # believed (a fence breach is not a glitch)
    for k in range(6, 8):  # two inside are not three
        c.on_state(hover_state(pos=NEAR_FENCE), 0.01 * k)
        assert c.tick(0.01 * k).mode is Mode.FAILSAFE
    assert c.tick(0.2).mode is Mode.FAILSAFE  # stale gap: the count starts again
    for k, t in enumerate((0.21, 0.22, 0.23)):
        c.on_state(hover_state(pos=NEAR_FENCE), t)
        assert c.tick(t).mode is (Mode.ARMED if k == 2 else Mode.FAILSAFE)
    c, _ = armed_controller(at=NEAR_FENCE)  # states bunched between two ticks: one outside, then two inside
    c.on_state(hover_state(pos=OUTSIDE_FENCE), 0.01)
    assert c.tick(0.01).mode is Mode.FAILSAFE
    for t, p in ((0.014, OUTSIDE_FENCE), (0.016, NEAR_FENCE), (0.018, NEAR_FENCE)):
        c.on_state(hover_state(pos=p), t)
    assert c.tick(0.02).mode is Mode.FAILSAFE
    c.on_state(hover_state(pos=NEAR_FENCE), 0.025)
    assert c.tick(0.03).mode is Mode.ARMED


def test_a_policy_that_keeps_leaving_the_fence_lands_after_max_recoveries():
    """Closed loop with a policy that climbs whenever it flies: every breach of the ceiling fails safe
    and the descent brings it back inside, where valid states would hand it back to the policy. Without
    a limit this bounces at the fence for as long as the battery lasts; with it the failsafe after
    ``max_recoveries`` recoveries lands."""
    c, _ = armed_controller()
    z, vz, t, dt = 1.0, 0.0, 0.0, 0.01
    while t < 60.0 and c.mode is not Mode.DISARMED:
        c.on_state(make_state([0.0, 0.0, z], [1, 0, 0, 0], [0.0, 0.0, vz], [0, 0, 0], t), t)
        mode = c.tick(t).mode
        vz += (2.0 if mode is Mode.ARMED else -c.descent_profile.accel) * dt  # the policy climbs at 2 m/s^2
        z, t = z + vz * dt, t + dt
        if z <= 0.0:  # on the floor
            z, vz = 0.0, 0.0
    assert c.mode is Mode.DISARMED, (t, z, c.failsafe_count)
    assert c.status()["recoveries"] == c.cfg.max_recoveries == 3 and c.failsafe_count == 4
    assert "3 recoveries in the last 30 s, no more" in c.reason and "rotors cut" in c.reason
    c.on_state(hover_state(t, z=z), t)
    assert c.arm(t) == (True, "armed") and c.status()["recoveries"] == 0  # re-arming grants them again


def test_recoveries_far_apart_do_not_add_up():
    """Single link gaps over a long flight: each one recovers, however many there are."""
    c, _ = armed_controller()
    for k in range(6):  # a stale gap every 20 s; max_recoveries = 3 within 30 s
        t0 = 20.0 * k + 1.0
        c.on_state(hover_state(t0 - 0.1), t0 - 0.1)
        assert c.tick(t0 - 0.1).mode is Mode.ARMED
        assert c.tick(t0).mode is Mode.FAILSAFE  # stale
        for i in range(1, 4):
            c.on_state(hover_state(t0 + 0.01 * i), t0 + 0.01 * i)
            mode = c.tick(t0 + 0.01 * i).mode
        assert mode is Mode.ARMED and c.status()["recoveries"] <= 2, (k, c.reason)


@pytest.mark.parametrize("bad", [dict(stale_timeout=math.nan), dict(stale_timeout=0.0), dict(landed_height=math.nan),
                                 dict(landed_height=0.0),
                                 dict(ground_height=math.inf), dict(target=(0.0, math.nan, 1.0)),
                                 dict(target=(0.0, 0.0, 3.0)), dict(target=(0.0, 0.0, -0.1)),
                                 dict(recover_count=0), dict(recover_count=2.5), dict(max_recoveries=-1),
                                 dict(max_recoveries=math.nan), dict(recovery_window=0.0), dict(takeoff_speed=0.0),
                                 dict(takeoff_speed=math.inf), dict(ground_timeout=0.0),
                                 dict(ground_timeout=math.nan), dict(max_jump=0.0), dict(max_jump=math.inf),
                                 dict(max_attitude_jump_deg=0.0), dict(max_attitude_jump_deg=180.0),
                                 dict(max_held_tilt_deg=20.0), dict(max_held_tilt_deg=180.0),
                                 dict(max_held_tilt_s=0.0), dict(max_held_tilt_s=math.nan),
                                 dict(max_arm_speed=0.0), dict(max_arm_rate=math.nan)])
def test_safety_config_refuses_limits_that_would_switch_a_rule_off(bad):
    with pytest.raises(ValueError, match=next(iter(bad))):
        SafetyConfig(**bad)


def test_the_policy_flies_to_a_setpoint_moving_from_where_it_took_over_to_the_target():
    seen = []
    # (the vehicle stays on the floor for 2.5 s here: longer than the default ground_timeout)
    c = SafeController(lambda obs: seen.append(obs.copy()) or np.full(4, 0.3),
                       SafetyConfig(takeoff_speed=0.5, ground_timeout=5.0))
    start = np.array([0.3, 0.0, 0.0])  # on the floor
    c.on_state(hover_state(pos=start), 0.0)
    assert c.arm(0.0) == (True, "armed")
    d = TARGET - start
    for t in (0.0, 1.0, 2.5):  # the target is 1.04 m away: reached after 2.09 s
        c.on_state(hover_state(t, pos=start), t)
        assert c.tick(t).mode is Mode.ARMED
        expected = start + d * min(1.0, 0.5 * t / np.linalg.norm(d))
        assert np.allclose(c.setpoint(t), expected) and np.allclose(seen[-1][:3], start - expected, atol=1e-6)
    c.on_state(hover_state(2.9, z=0.8), 2.9)  # in the air
    assert c.tick(2.9).mode is Mode.ARMED
    c.on_state(None, 3.0, "nonfinite: NaN")  # a failsafe, then a recovery 0.5 m below the target
    assert c.tick(3.0).mode is Mode.FAILSAFE
    for k in range(1, 4):
        c.on_state(hover_state(3.0 + 0.01 * k, z=0.5), 3.0 + 0.01 * k)
        mode = c.tick(3.0 + 0.01 * k).mode
    assert mode is Mode.ARMED and np.allclose(seen[-1][:3], 0.0)  # the ramp starts again where it took over
    assert np.allclose(c.setpoint(3.03 + 0.5), [0.0, 0.0, 0.75])


def test_the_deploy_nodes_refuse_a_policy_of_action_chunks(tmp_path):
    """A model of the Crazyflie contract that outputs chunks (exec_horizon) loads as an OnnxPolicy but
    could never fly a node (one action per period): refused when the node loads it, naming why."""
    from deploy.policy_node import load_onnx_policy
    from export.onnx_policy import ContractError, OnnxPolicy, export_onnx

    class Chunks(torch.nn.Module):
        def forward(self, obs):
            return torch.tanh(obs[:, :8]).reshape(-1, 2, 4)

    path = tmp_path / "chunks.onnx"
    export_onnx(Chunks(), path, {"exec_horizon": "2"})
    assert OnnxPolicy(path)(np.zeros(22, np.float32)).shape == (1, 2, 4)
    with pytest.raises(ContractError, match="diffusion policy \\(chunks of 2 actions\\)"):
        load_onnx_policy(str(path))


@pytest.mark.parametrize("vehicle", ["nominal", "heavy, weak, slow motors"])
def test_the_shipped_policy_takes_off_from_the_floor(vehicle):
    """A real Crazyflie is armed on the floor, rotors stopped, 1 m below its target. The shipped hover
    policy, behind the safety layer, takes off and hovers in the torch simulator with the sim_bridge's
    floor, for the nominal vehicle and for the randomization's corner with the least thrust margin
    (mass x1.2, kf x0.9, battery 0.85, motor time constant 0.12 s: thrust-to-weight ~1.4), which
    without the setpoint ramp tipped over on the floor."""
    from deploy.policy_node import load_onnx_policy
    from deploy.sim_bridge import keep_on_floor
    from sim.crazyflie.dynamics import STATE_DIM, TorchBackend, VehicleBatch

    policy, contract = load_onnx_policy(str(REPO / "policies/pretrained/quad_hover/export/policy.onnx"))
    backend = TorchBackend(1, NOMINAL, contract["policy_period_s"])
    v = VehicleBatch.nominal(1, NOMINAL)
    if vehicle != "nominal":
        v.mass *= 1.2
        v.kf *= 0.9
        v.thrust_scale[:] = 0.85
        v.motor_tau[:] = 0.12
    for start in ([0.0, 0.0, 0.0], [0.3, -0.2, 0.0]):
        s = torch.zeros(1, STATE_DIM)
        s[0, :3], s[0, 3] = torch.tensor(start), 1.0  # level, at rest, rotors stopped
        backend.set_state(torch.arange(1), s, v)
        c = SafeController(policy, SafetyConfig())
        errors, tilts, lift_off = [], [], None
        for k in range(500):  # 5 s
            t = k * contract["policy_period_s"]
            x = backend.state[0].double().numpy()
            c.on_state(make_state(x[0:3], x[3:7], x[7:10], x[10:13], t), t)
            if k == 0:
                assert c.arm(t) == (True, "armed")
            cmd = c.tick(t)
            assert cmd.mode is Mode.ARMED, (t, cmd.reason)
            rpm = torch.as_tensor(action_to_rpm(cmd.action, contract["rpm_max"]), dtype=torch.float32)[None]
            keep_on_floor(backend, backend.step(rpm, torch.zeros(1, 3), torch.zeros(1, 3)), v)
            x = backend.state[0].double().numpy()
            errors.append(np.linalg.norm(x[0:3] - TARGET))
            tilts.append(math.degrees(math.acos(np.clip(1 - 2 * (x[4] ** 2 + x[5] ** 2), -1, 1))))
            if lift_off is None and x[2] >= c.cfg.landed_height:
                lift_off = t
        assert np.mean(errors[-200:]) < 0.05, (start, np.mean(errors[-200:]))  # the hover criterion's bound
        assert max(tilts) < 15.0, (start, max(tilts))
        # off the floor well before the safety layer would cut the rotors there (0.25 s nominal, 0.81 s weak)
        assert lift_off is not None and lift_off < 0.75 * c.cfg.ground_timeout, (start, lift_off)


@pytest.mark.parametrize("auto_arm", [False, True])
def test_a_clock_that_goes_back_starts_the_controller_up_again(auto_arm):
    """A simulator reset sends its clock back to 0 without a pause (no stale state, no failsafe): the
    times the controller keeps (ramp start, recoveries, descent end, state age) would lie in the new
    clock's future, e.g. a setpoint ramp frozen until the old time came round again. It starts up
    again instead: DISARMED, armed again by auto_arm on the first valid state."""
    c = SafeController(FakePolicy(), SafetyConfig(auto_arm=auto_arm))
    c.on_state(hover_state(50.0, z=0.2), 50.0)
    assert c.arm(50.0)[0] and c.tick(50.0).mode is Mode.ARMED
    assert c.tick(50.1).mode is Mode.FAILSAFE  # no state for 0.1 s: stale; then valid states recover it
    t = 50.1
    while c.mode is not Mode.ARMED:
        t = round(t + 0.01, 2)
        c.on_state(hover_state(t, z=0.2), t)
        assert c.tick(t).mode in (Mode.FAILSAFE, Mode.ARMED) and t < 51.0
    assert c.status()["recoveries"] == 1
    c.on_state(hover_state(0.01, z=0.2), 0.01)  # the reset: a valid state at t = 0.01 s
    cmd = c.tick(0.01)
    if auto_arm:
        assert cmd.mode is Mode.ARMED and c.setpoint(0.51)[2] == pytest.approx(0.45)  # the ramp runs from 0.01 s
    else:
        assert cmd.mode is Mode.DISARMED and f"clock went back from {t:.3f} s to 0.010 s" in cmd.reason
        assert c.status()["recoveries"] == 0  # by the restart, not by the arm below
        assert cmd.action.tolist() == [IDLE_ACTION] * 4 and c.arm(0.02)[0]
    assert c.status()["recoveries"] == 0


def two_clocks(c: SafeController, wall: list[float], periods: int) -> list:
    """``periods`` 10 ms periods of two simulators' interleaved /clock (one at 50 s, one started at 0 s),
    the wall clock (``wall[0]``, s) from 0 s: one state and one tick per message; the commands."""
    cmds = []
    for k in range(periods):
        now = (50.0 if k % 2 == 0 else 0.0) + 0.01 * (k // 2)
        wall[0] = 0.01 * k
        c.on_state(hover_state(now), now)
        cmds.append(c.tick(now))
    return cmds


def test_two_clocks_keep_the_rotors_idle_until_one_is_left():
    """Two simulators publishing /clock (one at 50 s, one just started) send the clock back with every
    other message. Restarted each time, auto_arm would arm the rotors every other period; from the third
    restart within 2 s of wall time arming is refused (auto_arm and the operator's), with one status
    reason, until the clock has run 2 s without going back."""
    assert (CLOCK_RESTARTS_MAX, CLOCK_RESTART_WINDOW_S) == (3, 2.0)
    wall = [0.0]
    c = SafeController(FakePolicy(), SafetyConfig(auto_arm=True), wall=lambda: wall[0])
    cmds = two_clocks(c, wall, 200)
    assert [cmd.mode for cmd in cmds[:5]] == [Mode.ARMED] * 5  # armed, and re-armed at once after the 1st and 2nd restart
    reasons = set()
    for k, cmd in enumerate(cmds[5:], 5):  # from the third restart
        reasons.add(cmd.reason)
        assert cmd.mode is Mode.DISARMED and cmd.action.tolist() == [IDLE_ACTION] * 4, (k, cmd.reason)
    assert reasons == {"clock went back 3 times within 2 s (more than one /clock publisher?): rotors idle, "
                       "arming once it has run steadily"}
    ok, why = c.arm(0.99)
    assert not ok and "more than one /clock publisher" in why and why.endswith("steady for 2.0 s more")
    # one simulator left: armed again once its clock has gone 2 s of wall time without going back
    t_last = wall[0]
    for k in range(1, 1200):
        now, wall[0] = 1.0 + 0.01 * k, t_last + 0.01 * k
        c.on_state(hover_state(now), now)
        if c.tick(now).mode is Mode.ARMED:
            break
    assert wall[0] - t_last == pytest.approx(2.0, abs=0.011)


def test_restarts_seconds_apart_are_not_two_clocks():
    """A harness that restarts its simulator every 1.5 s (a new process: seconds apart at the quickest)
    has auto_arm arm again after every restart, for as long as it goes on."""
    wall = [0.0]
    c = SafeController(FakePolicy(), SafetyConfig(auto_arm=True), wall=lambda: wall[0])
    for k in range(3000):  # 30 s of 10 ms periods, the clock from 0 again every 1.5 s
        now = 0.01 * (k % 150) + 0.001
        wall[0] = 0.01 * k
        c.on_state(hover_state(now), now)
        assert c.tick(now).mode is Mode.ARMED, (k, c.reason)


def test_a_disarm_while_the_clock_is_unsteady_is_not_undone_by_auto_arm():
    """The operator's disarm during the two-clock lockout: the status no longer promises auto_arm, and
    none comes when the clock is steady again; arm() flies."""
    wall = [0.0]
    c = SafeController(FakePolicy(), SafetyConfig(auto_arm=True), wall=lambda: wall[0])
    two_clocks(c, wall, 10)
    assert c.clock_unsteady() is not None and "arming once" in c.reason
    assert c.disarm(0.05) == "disarmed: disarm requested: rotors idle, re-arm to fly"
    for k in range(1, 400):
        now, wall[0] = 0.05 + 0.01 * k, 0.09 + 0.01 * k
        c.on_state(hover_state(now), now)
        assert c.tick(now).mode is Mode.DISARMED and c.reason == "disarm requested: rotors idle, re-arm to fly"
    assert c.arm(now)[0] and c.tick(now).mode is Mode.ARMED


@pytest.mark.parametrize("stop", ["estop", "disarm"])
def test_an_operators_stop_outlasts_a_clock_that_goes_back(stop):
    """After an emergency stop or a disarm, a restarted simulator's clock neither clears the stop nor lets
    auto_arm fly again: only arm() does."""
    c = SafeController(FakePolicy(), SafetyConfig(auto_arm=True))
    c.on_state(hover_state(50.0), 50.0)
    assert c.tick(50.0).mode is Mode.ARMED  # auto_arm
    c.estop() if stop == "estop" else c.disarm(50.0)
    for k in range(1, 30):
        c.on_state(hover_state(0.01 * k, z=0.0), 0.01 * k)
        cmd = c.tick(0.01 * k)
        assert cmd.mode is (Mode.ESTOP if stop == "estop" else Mode.DISARMED), (k, cmd.reason)
        assert cmd.action.tolist() == [IDLE_ACTION] * 4
    assert c.arm(0.3)[0] and c.tick(0.3).mode is Mode.ARMED


def test_a_vehicle_that_stays_on_the_floor_while_armed_is_cut():
    """Armed on the floor, a vehicle that does not take off (or comes down and cannot leave the floor:
    tipped over, a broken rotor) has its rotors cut after ground_timeout; a moment off the floor
    starts the count again."""
    policy = FakePolicy()
    c = SafeController(policy, SafetyConfig(ground_timeout=1.0))
    c.on_state(hover_state(z=0.0), 0.0)
    assert c.arm(0.0)[0]
    for k in range(300):
        t = 0.01 * k
        z = 0.2 if 50 <= k < 60 else 0.01  # off the floor from 0.5 s to 0.6 s
        c.on_state(hover_state(t, z=z), t)
        cmd = c.tick(t)
        if cmd.mode is not Mode.ARMED:
            break
    assert cmd.mode is Mode.DISARMED and t == pytest.approx(1.6) and "on the floor for 1 s" in cmd.reason
    assert cmd.action.tolist() == [IDLE_ACTION] * 4 and c.status()["failsafe_count"] == 1
    # Re-arming starts a new count.
    c.on_state(hover_state(3.0, z=0.01), 3.0)
    assert c.arm(3.0)[0] and c.tick(3.0).mode is Mode.ARMED
    c.on_state(hover_state(3.99, z=0.01), 3.99)
    assert c.tick(3.99).mode is Mode.ARMED


def test_failsafe_on_the_ground_cuts_at_once_and_estop_latches():
    c, _ = armed_controller(at=(0.0, 0.0, 0.01))
    c.on_state(None, 0.0, "nonfinite: NaN")
    assert c.tick(0.0).mode is Mode.DISARMED
    c, _ = armed_controller()
    c.estop()
    for k in range(5):
        c.on_state(hover_state(), 0.01 * k)
        assert c.tick(0.01 * k).mode is Mode.ESTOP
    assert c.arm(0.05)[0] and c.tick(0.05).mode is Mode.ARMED


def test_arming_in_flight_keeps_the_previous_action():
    c, policy = armed_controller(at=NEAR_FENCE)
    policy.out = np.full(4, 0.3)
    c.tick(0.0)
    assert c.arm(0.0) == (True, "already armed") and np.allclose(c.prev_action, 0.3)
    c.on_state(hover_state(pos=OUTSIDE_FENCE), 0.01)
    assert c.tick(0.01).mode is Mode.FAILSAFE
    c.on_state(hover_state(pos=NEAR_FENCE), 0.02)
    assert c.arm(0.02)[0] and np.allclose(c.prev_action, c.descent_action)  # the rotors' last command
    c.disarm(0.03)
    for t in (0.5, 0.51, 0.52):  # landed (LANDED_SAMPLES states on the floor, later than a free fall from 1 m)
        c.on_state(hover_state(t, pos=[1.45, 0.0, 0.0]), t)
    assert c.tick(0.52).mode is Mode.DISARMED
    assert c.arm(0.52)[0] and np.allclose(c.prev_action, c.hover_action)  # from the ground: as in training


def test_disarm_in_flight_descends_without_recovery():
    c, _ = armed_controller()
    c.disarm(0.0)
    assert c.status()["failsafe_count"] == 0  # the operator's descent is no failsafe
    for k in range(1, 6):
        c.on_state(hover_state(), 0.01 * k)
        assert c.tick(0.01 * k).mode is Mode.FAILSAFE


@pytest.mark.parametrize("mode", [Mode.ARMED, Mode.FAILSAFE])
def test_a_vehicle_held_tilted_has_its_rotors_cut(mode):
    """Caught in a net at 2 m, rolled 70 deg, valid states streaming (the tumble rule waits for 90 deg): after
    max_held_tilt_s beyond max_held_tilt_deg the rotors are cut, in flight or in a failsafe's descent. Rolled
    as far for less than that, then level again, it flies on."""
    c, _ = armed_controller(at=(0.0, 0.0, 2.0))
    t = 0.0
    if mode is Mode.FAILSAFE:
        c.disarm(t)  # the operator's descent
    assert c.tick(t).mode is mode

    def roll(deg: float) -> None:
        nonlocal t
        t = round(t + 0.01, 2)
        assert c.on_state(tilted_state(deg, t, z=2.0), t) is None
        c.tick(t)

    for deg in (10, 20, 30, 40, 50, 60, 70):  # rolling over (10 deg per sample: no attitude jump)
        roll(deg)
    for _ in range(round(0.3 / 0.01)):  # 0.3 s beyond 60 deg ...
        roll(70)
    for deg in (60, 50, 40, 30, 20, 10, 0, 0, 0):  # ... then level again: no cut
        roll(deg)
        assert c.mode is mode, c.reason
    for deg in (10, 20, 30, 40, 50, 60, 70):
        roll(deg)
    start = t
    while c.mode is mode:
        roll(70)
        assert t < 2.0
    assert c.mode is Mode.DISARMED and c.reason.startswith("held tilted: beyond 60 deg"), c.reason
    assert c.cfg.max_held_tilt_s <= t - start + 0.01 <= c.cfg.max_held_tilt_s + 0.02
    assert c.status()["failsafe_count"] == 1


def test_auto_arm_arms_once():
    """auto_arm arms on the first valid state, and only once: after a failsafe has landed (here on its
    timer, the states lost at 1 m) the valid states that come back leave the rotors cut until the operator
    arms."""
    c = SafeController(FakePolicy(), SafetyConfig(auto_arm=True))
    assert c.tick(0.0).mode is Mode.DISARMED
    c.on_state(hover_state(), 0.0)
    assert c.tick(0.0).mode is Mode.ARMED
    t = 0.0
    while (mode := c.tick(t).mode) is not Mode.DISARMED:  # no state after t = 0: stale, a failsafe descent
        assert mode in (Mode.ARMED, Mode.FAILSAFE) and t < 5.0, (mode, t)
        t = round(t + 0.01, 2)
    assert c.status()["failsafe_count"] == 1
    for _ in range(50):  # valid states again, on the floor
        t = round(t + 0.01, 2)
        c.on_state(hover_state(t, z=0.0), t)
        assert c.tick(t).mode is Mode.DISARMED and "re-arm" in c.reason, c.reason
    assert c.arm(t)[0] and c.tick(t).mode is Mode.ARMED  # the operator's arm


def test_the_sim_bridge_clips_rotor_commands_to_the_motors_range_and_ignores_malformed_ones():
    """sim_bridge's rotor_cmd handler: each of 4 finite rpm values clipped to [0, rpm_max] (a negative one to
    0, not to -rpm_max or left as is); a command of another length or with a NaN or infinity changes nothing
    and is counted (the ROS fuzz test checks the node stays up under 10k such messages)."""
    from deploy.sim_bridge import SimBridge

    b = object.__new__(SimBridge)  # the handler alone: no ROS node, no simulator
    b.torch, b.params, b.bad_commands, b.steps, b.period = torch, NOMINAL, 0, 7, 0.01
    b._watchdog_cut, b.hold, b.clamped = False, False, False
    warned = []
    b.get_logger = lambda: type("Log", (), {"warning": lambda self, m, **kw: warned.append(m),
                                            "info": lambda self, m, **kw: None})()
    msg = type("Msg", (), {})
    msg.data = [-5.0, 1e6, 100.0, NOMINAL.rpm_max + 1]
    b._on_cmd(msg)
    assert b.rpm_cmd.tolist() == [[0.0, NOMINAL.rpm_max, 100.0, NOMINAL.rpm_max]] and b.bad_commands == 0
    for data in ([1.0, 2.0, 3.0], [1.0, 2.0, 3.0, 4.0, 5.0], [1.0, math.nan, 3.0, 4.0], [math.inf, 1.0, 1.0, 1.0], []):
        msg.data = data
        b._on_cmd(msg)
        assert b.rpm_cmd.tolist() == [[0.0, NOMINAL.rpm_max, 100.0, NOMINAL.rpm_max]], data
    assert b.bad_commands == 5 and len(warned) == 5 and "expected 4 finite rpm values" in warned[-1]


def test_sim_time_ticks_on_an_older_state_are_counted():
    """Under sim time the policy should act on the state of its tick's instant (sim_bridge publishes it
    before /clock; lock-step waits for the answer): an ARMED tick whose newest state is a period older is
    counted in /status's older_state_ticks; a tick on the state of its instant, or not ARMED, is not."""
    from deploy.policy_node import ControllerNode, Percentiles

    c = SafeController(FakePolicy(), SafetyConfig())
    node = object.__new__(ControllerNode)
    clock = {"t": 1.0}
    node.controller, node._to_rpm, node._now = c, lambda a: a, lambda: clock["t"]
    node.cmd_pub = type("Pub", (), {"publish": lambda self, m: None})()
    node._publish_status = lambda cmd: None
    node._state_received_at, node._ticks, node._last, node._actuate_log = (
        None, 0, ("", ""), LogLimiter(ACTUATION_LOG_EVERY_S))
    node.latency, node._recorder_deadline, node.use_sim_time, node.older_state_ticks = Percentiles(), None, True, 0
    node._recorder_hold = None
    c.on_state(hover_state(1.0), 1.0)
    node._tick()  # disarmed
    assert c.arm(1.0)[0]
    node._tick()  # on the state of its instant
    assert node.older_state_ticks == 0
    clock["t"] = 1.01
    node._tick()  # /clock moved on before the state of 1.01 s came
    assert c.mode is Mode.ARMED and node.older_state_ticks == 1
    c.on_state(hover_state(1.01), 1.01)
    node._tick()
    assert node.older_state_ticks == 1


@pytest.mark.parametrize("recorder", ["subscribes", "never comes"])
def test_auto_arm_waits_for_the_recorder_to_listen(recorder):
    """policy_node with wait_for_recorder_s (hover.launch.xml record:=true): auto_arm holds, with the
    reason on /status, until a node named recorder subscribes to both rotor_cmd and status (the recording
    then holds the take-off), or the wait runs out (armed all the same, with a warning)."""
    from deploy.policy_node import ControllerNode, Percentiles

    c = SafeController(FakePolicy(), SafetyConfig(auto_arm=True))
    node = object.__new__(ControllerNode)
    node.controller, node._to_rpm, node._now = c, lambda a: a, lambda: 0.0
    statuses, logged, subscribers = [], [], {"/cf1/rotor_cmd": ["recorder"], "/cf1/status": ["probe"]}
    matched = {"/cf1/rotor_cmd": 1, "/cf1/status": 1}  # subscriptions DDS has matched to the publisher
    node.cmd_pub = type("Pub", (), {"topic_name": "/cf1/rotor_cmd", "publish": lambda self, m: None,
                                    "get_subscription_count": lambda self: matched[self.topic_name]})()
    node.status_pub = type("Pub", (), {"topic_name": "/cf1/status",
                                       "get_subscription_count": lambda self: matched[self.topic_name]})()
    node._publish_status = lambda cmd: statuses.append((cmd.mode, cmd.reason))
    node._state_received_at, node._ticks, node._last, node._actuate_log = (
        None, 0, ("", ""), LogLimiter(ACTUATION_LOG_EVERY_S))
    node.latency, node.use_sim_time, node.older_state_ticks = Percentiles(), False, 0
    node._recorder_hold = "waiting for the recorder (at most 60 s)"
    node.get_logger = lambda: type("Log", (), {k: staticmethod(logged.append) for k in ("info", "warning")})()
    node.get_subscriptions_info_by_topic = lambda topic: [type("Info", (), {"node_name": n})()
                                                          for n in subscribers[topic]]
    node._recorder_deadline = time.monotonic() + (60.0 if recorder == "subscribes" else 0.2)
    c.on_state(hover_state(), 0.0)
    for _ in range(3):  # the recorder takes rotor_cmd but not yet status
        node._tick()
    assert c.mode is Mode.DISARMED and statuses[-1] == (Mode.DISARMED, "auto_arm: waiting for the recorder (at most 60 s)")
    if recorder == "subscribes":
        subscribers["/cf1/status"].append("recorder")  # in the graph, not yet matched: no arming
        node._tick()
        assert c.mode is Mode.DISARMED
        matched["/cf1/status"] = 2
    else:
        time.sleep(0.2)
    node._tick()
    assert c.mode is Mode.ARMED and c.auto_arm_hold is None and node._recorder_deadline is node._recorder_hold is None
    assert ("the recorder takes rotor_cmd and status" in logged[-1]) == (recorder == "subscribes"), logged
    assert ("arming without it" in logged[-1]) == (recorder == "never comes"), logged


def test_under_sim_time_the_wait_for_the_recorder_starts_with_the_first_clock():
    """The recorder subscribes only once it has heard /clock (deploy/recorder.py), so under sim time
    policy_node's wait_for_recorder_s counts from its own first /clock, not from its start: a slow
    simulator start does not use the wait up."""
    from deploy.policy_node import ControllerNode

    node = object.__new__(ControllerNode)
    ticks = []
    node._tick = lambda: ticks.append(time.monotonic())
    node._clock_seen_wall, node._recorder_deadline = None, None
    node._recorder_hold, node._recorder_wait_s = "waiting for the recorder (at most 10 s)", 10.0
    before = time.monotonic()
    node._clock_tick()
    assert before + 10.0 <= node._recorder_deadline <= ticks[0] + 10.0
    first = node._recorder_deadline
    time.sleep(0.01)
    node._clock_tick()  # later /clock ticks leave it
    assert node._recorder_deadline == first and len(ticks) == 2


# ---------------------------------------------------------------------------------------------
# launch runner


def scope(**configs) -> Scope:
    return Scope(dict(configs), {"HOME_X": "/h"}, Path("/ws/launch/a.launch.xml"))


@pytest.mark.parametrize("text, expected", [
    ("$(var robot)/odom", "cf1/odom"),
    ("$(dirname)/x.yaml", "/ws/launch/x.yaml"),
    ("$(env HOME_X)", "/h"),
    ("$(env NOPE 'a b')", "a b"),
    ("$(eval '\\'$(var backend)\\' != \\'real\\'')", "True"),
    ("$(eval '2 * pi > 6')", "True"),
])
def test_substitutions(text, expected):
    assert substitute(text, scope(robot="cf1", backend="sim")) == expected


@pytest.mark.parametrize("text, message", [
    ("$(var nope)", "no launch configuration 'nope'"),
    ("$(env NOPE)", "not set"),
    ("$(command ls)", "unsupported substitution $(command"),
    ("$(var robot", "unclosed"),
    ("$(eval '1 +')", "failed"),
])
def test_substitution_errors_are_clear(text, message):
    with pytest.raises(LaunchError) as e:
        substitute(text, scope(robot="cf1"))
    assert message in str(e.value)


def write(path: Path, text: str) -> Path:
    path.write_text(text)
    return path


@pytest.fixture
def ament_prefix(tmp_path, monkeypatch) -> Path:
    prefix = tmp_path / "prefix"
    ament.install_links(prefix)
    monkeypatch.setenv("AMENT_PREFIX_PATH", str(prefix))
    return prefix


def test_every_parameter_of_the_shipped_params_file_is_one_a_node_declares():
    """rclpy ignores a params-file key that no node declares: a misspelt safety limit would fly with the
    default, unsaid. Each key of launch/hover.yaml is declared (param/vector_param) by the node of its
    section, or by some node for the /** section; and deploy.ros.NODE_PARAMETERS, by which the nodes
    refuse an unknown one, is what each declares (the controller nodes: policy_node's ControllerNode and
    their own)."""
    def declared(name: str) -> set[str]:
        return set(re.findall(r"\b(?:vector_)?param\(self, \"(\w+)\"", (REPO / f"deploy/{name}.py").read_text()))

    nodes = {name: declared(name) for name in ("sim_bridge", "recorder")}
    nodes |= {name: declared("policy_node") | declared(name) for name in ("firmware_bridge", "crazyflie_bridge")}
    nodes["policy_node"] = declared("policy_node")
    assert nodes == NODE_PARAMETERS, "deploy.ros.NODE_PARAMETERS lists what each node declares"
    assert set().union(*nodes.values()) == PARAMETERS
    sections = dict(params_file_sections(REPO / "launch/hover.yaml"))
    assert {"/**", "/**/sim_bridge", "/**/crazyflie_bridge"} <= set(sections)
    for section, names in sections.items():
        node = section.removeprefix("/**").removeprefix("/")
        unknown = set(names) - (nodes[node] if node else PARAMETERS)
        assert not unknown, f"{section}: {sorted(unknown)} declared by no node"


def test_params_file_sections_are_read_and_matched_as_rcl_does(tmp_path):
    """The sections a node checks its own parameters in: rcl's reading of a params file (a leading /
    added, nested namespace keys joined, nested parameter names joined with '.') and its wildcards."""
    path = write(tmp_path / "p.yaml", """
/**:
  ros__parameters: {target: [0.0, 0.0, 1.0]}
sim_bridge:
  ros__parameters: {qos_overrides: {/clock: {publisher: {depth: 5}}}}
/cf1:
  policy_node:
    ros__parameters: {max_tilt_deg: 45.0}
/*/cf2/crazyflie_bridge:
  ros__parameters: {uri: radio://0/80/2M}
""")
    assert params_file_sections(path) == [
        ("/**", ["target"]), ("/sim_bridge", ["qos_overrides./clock.publisher.depth"]),
        ("/cf1/policy_node", ["max_tilt_deg"]), ("/*/cf2/crazyflie_bridge", ["uri"])]
    assert names_node("/**/sim_bridge", "/cf1/sim_bridge", "sim_bridge")
    assert names_node("/**/sim_bridge", "/sim_bridge", "sim_bridge")  # ** is any number of tokens, none too
    assert names_node("/sim_bridge", "/sim_bridge", "sim_bridge")
    assert not names_node("/sim_bridge", "/cf1/sim_bridge", "sim_bridge")
    assert not names_node("/**", "/cf1/sim_bridge", "sim_bridge")  # every node's: not written for this one
    assert not names_node("/**/policy_node", "/cf1/sim_bridge", "sim_bridge")
    assert not names_node("/cf2/policy_node", "/cf1/policy_node", "policy_node")
    assert names_node("/*/cf2/crazyflie_bridge", "/lab/cf2/crazyflie_bridge", "crazyflie_bridge")
    assert not names_node("/*/cf2/crazyflie_bridge", "/cf2/crazyflie_bridge", "crazyflie_bridge")  # * is one token
    # what PyYAML's values would lose or refuse, and rcl reads: another document, a section repeated
    # (rcl merges the two), a tag, a node's mapping holding another node, an empty parameter mapping
    path = write(tmp_path / "q.yaml", """
/**/sim_bridge:
  ros__parameters: {clamped: true}
/**/sim_bridge:
  ros__parameters: {max_jump: 0.4, d: {}}
---
/cf1:
  ros__parameters: {a: !foo 1}
  sim_bridge:
    ros__parameters: {lockstep: true}
""")
    assert params_file_sections(path) == [("/**/sim_bridge", ["clamped"]), ("/**/sim_bridge", ["max_jump", "d"]),
                                          ("/cf1", ["a"]), ("/cf1/sim_bridge", ["lockstep"])]
    with pytest.raises(ValueError, match="params file .*r.yaml: not YAML"):
        params_file_sections(write(tmp_path / "r.yaml", "a: [1\n"))


def test_params_files_and_values_are_those_of_the_ros_arguments():
    """rcl reads --params-file and -p inside a --ros-args block only (to -- or the end; there may be
    several), and the value of another ROS argument is not one."""
    argv = ["node", "--params-file", "not.yaml", "-p", "no:=1", "--ros-args", "-p", "x:=1", "--params-file", "a.yaml",
            "--", "--params-file", "user.yaml", "--ros-args", "-r", "__ns:=/cf1", "--params-file", "b.yaml",
            "--param", "y:=[1, 2]", "-r", "-p", "-p", "--params-file"]
    assert ros_arguments(argv) == ([Path("a.yaml"), Path("b.yaml")], ["x", "y"])
    argv = ["node", "--ros-args", "-p", "--params-file", "--params-file", "c.yaml"]
    assert ros_arguments(argv) == ([Path("c.yaml")], [])


def test_hover_launch_plans_the_documented_processes(ament_prefix):
    def names(**a):
        return [p.name for p in plan(REPO / "launch/hover.launch.xml", a)]

    assert names() == ["sim_bridge", "policy_node"]
    assert names(backend="hil", record="true") == ["sim_bridge", "policy_node", "recorder"]
    assert names(backend="real") == ["crazyflie_bridge"]
    procs = plan(REPO / "launch/hover.launch.xml", {"robot": "cf7", "policy": "/p.onnx"})
    argv = procs[1].argv
    assert argv[0] == str(ament_prefix / "lib/robolearn/policy_node")
    assert ["-r", "__ns:=/cf7"] == argv[argv.index("__ns:=/cf7") - 1: argv.index("__ns:=/cf7") + 1]
    assert "policy:=/p.onnx" in argv and "use_sim_time:=true" in argv
    assert ["--params-file", str(REPO / "launch/hover.yaml")] == argv[argv.index("--params-file"):][:2]
    for arg, value, valid in (("backend", "sitl", "sim, hil, real"), ("physics", "bullet", "torch, mujoco, pybullet")):
        with pytest.raises(LaunchError, match=f"{arg}:={value} is not one of its choices \\({valid}\\)"):
            names(**{arg: value})
    # rcl would refuse these in every node (each a traceback): one error line from the launcher
    for robot in ("cf-1", "1cf", "cf 1", "__x", "a__b"):
        with pytest.raises(LaunchError, match=f"namespace '{robot}' is no ROS name"):
            names(robot=robot)
    assert "__ns:=/cf_1/a" in plan(REPO / "launch/hover.launch.xml", {"robot": "cf_1/a"})[1].argv
    # an empty value is written as YAML's empty string (rcl cannot parse 'policy:=')
    assert "policy:=''" in plan(REPO / "launch/hover.launch.xml", {"policy": ""})[1].argv


def test_launch_semantics_scoping_conditions_and_errors(ament_prefix, tmp_path):
    write(tmp_path / "inc.launch.xml", '<launch><arg name="who"/><let name="leak" value="x"/>'
          '<node pkg="robolearn" exec="recorder" name="$(var who)"/></launch>')
    main = write(tmp_path / "main.launch.xml", """<launch>
      <arg name="flag" default="false"/>
      <group><let name="inner" value="1"/></group>
      <node pkg="robolearn" exec="sim_bridge" name="a" if="$(var flag)"/>
      <node pkg="robolearn" exec="sim_bridge" name="b" unless="$(var flag)"><remap from="odom" to="x"/></node>
      <include file="inc.launch.xml"><arg name="who" value="c"/></include>
      <set_env name="FOO" value="bar"/>
      <node pkg="robolearn" exec="sim_bridge" name="d" if="$(eval '\\'$(var flag)\\' == \\'false\\'')"/>
    </launch>""")
    root = write(tmp_path / "root.launch.xml",
                 '<launch><node pkg="robolearn" exec="sim_bridge" namespace="/"/></launch>')
    assert "__ns:=/" in plan(root, {})[0].argv  # the root namespace
    procs = plan(main, {})
    assert [p.name for p in procs] == ["b", "c", "d"]
    assert "odom:=x" in procs[0].argv and procs[2].env["FOO"] == "bar" and "FOO" not in procs[0].env
    assert [p.name for p in plan(main, {"flag": "True"})] == ["a", "c"]
    bad = {
        '<launch><node pkg="robolearn" exec="sim_bridge" respawn="true"/></launch>': "unsupported attribute",
        '<launch><timer period="1"/></launch>': "unsupported element",
        '<launch><arg name="x"/></launch>': "'x' is required",
        '<launch><node pkg="robolearn" exec="nope"/></launch>': "no executable 'nope'",
        '<launch><node pkg="nopkg" exec="x"/></launch>': "not in the ament index",
        '<launch><group if="maybe"/></launch>': "not a boolean",
        '<launch><arg name="x" default="c"><choice value="a"/><choice value="b"/></arg></launch>':
            "x:=c is not one of its choices (a, b)",
        '<launch><arg name="x" default="a"><value>a</value></arg></launch>': "only <choice value/>",
        '<launch><let name="x" value="1"/><node pkg="robolearn" exec="sim_bridge" name="$(var inner)"/></launch>':
            "no launch configuration 'inner'",
    }
    for text, message in bad.items():
        with pytest.raises(LaunchError) as e:
            plan(write(tmp_path / "bad.launch.xml", text), {})
        assert message in str(e.value), text
    with pytest.raises(LaunchError, match="unknown launch argument"):
        plan(main, {"flgа": "true"})
    # As ROS 2 launch: an argument's default is resolved only when used, its description never
    lazy = write(tmp_path / "lazy.launch.xml", '<launch><arg name="x" default="$(env ROBOLEARN_UNSET_VARIABLE)" '
                 'description="in $(units)"/><node pkg="robolearn" exec="sim_bridge" name="$(var x)"/></launch>')
    assert [p.name for p in plan(lazy, {"x": "given"})] == ["given"]
    with pytest.raises(LaunchError, match="ROBOLEARN_UNSET_VARIABLE"):
        plan(lazy, {})
    with pytest.raises(LaunchError, match="expected name:=value"):
        parse_cli(["x.launch.xml", "backend=sim"])


def _fake_nodes(tmp_path: Path, nodes: dict[str, str]) -> Path:
    """An ament prefix with package 'fake' whose executables are the given Python scripts."""
    prefix = tmp_path / "fake_prefix"
    (prefix / "share/ament_index/resource_index/packages").mkdir(parents=True)
    (prefix / "share/ament_index/resource_index/packages/fake").write_text("")
    (prefix / "lib/fake").mkdir(parents=True)
    for name, body in nodes.items():
        exe = prefix / "lib/fake" / name
        exe.write_text("#!/usr/bin/env python3\n" + body)
        exe.chmod(0o755)
    return prefix


SLEEPER = """import os, sys, time
print("pid", os.getpid(), "python", sys.executable, flush=True)
time.sleep(120)
"""


def _start_runner(tmp_path: Path, launch: str, prefix: Path, nohup: bool = False) -> subprocess.Popen:
    """The launch runner on ``launch`` (XML), its output a pipe, the venv not on the PATH; with
    ``nohup``, SIGHUP ignored as nohup leaves it, else at its default whatever this test process
    inherited (a suite run under nohup would otherwise start every runner "under nohup")."""
    file = write(tmp_path / "t.launch.xml", launch)
    env = {**os.environ, "AMENT_PREFIX_PATH": str(prefix), "PATH": "/usr/bin:/bin"}
    return subprocess.Popen([sys.executable, "-m", "deploy.launch", str(file)], cwd=REPO, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            preexec_fn=lambda: signal.signal(signal.SIGHUP, signal.SIG_IGN if nohup else signal.SIG_DFL))


def _kill(pids: list[int]) -> None:
    for pid in pids:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def _wait_pids(proc: subprocess.Popen, n: int, lines: list[str]) -> list[int]:
    deadline = time.monotonic() + 30
    while len([ln for ln in lines if "] pid " in ln]) < n and time.monotonic() < deadline:
        lines.append(proc.stdout.readline())
    return [int(ln.split("] pid ")[1].split()[0]) for ln in lines if "] pid " in ln]


def _gone(pid: int, within: float) -> bool:
    deadline = time.monotonic() + within
    while time.monotonic() < deadline:
        try:
            if "zombie" in Path(f"/proc/{pid}/status").read_text().lower():
                return True
        except (FileNotFoundError, ProcessLookupError):  # gone, also between a look and the read
            return True
        time.sleep(0.05)
    return False


@pytest.mark.parametrize("how", ["SIGHUP", "SIGKILL", "closed output"])
def test_no_node_outlives_the_launch_runner(tmp_path, how):
    """The terminal closing (SIGHUP), the runner killed, or its output pipe closed (`| head`): every
    node stops (they used to run on, re-parented to init). Nodes run the runner's Python even with
    the venv not on the PATH."""
    prefix = _fake_nodes(tmp_path, {"sleeper": SLEEPER})
    proc = _start_runner(tmp_path, '<launch><node pkg="fake" exec="sleeper" name="a"/>'
                                      '<node pkg="fake" exec="sleeper" name="b"/></launch>', prefix)
    lines: list[str] = []
    pids = _wait_pids(proc, 2, lines)
    try:
        assert len(pids) == 2, lines
        assert all(f"python {sys.executable}" in ln for ln in lines if "] pid " in ln), lines
        if how == "closed output":
            proc.stdout.close()
            os.kill(pids[0], signal.SIGUSR1)  # the runner's next write (this node's end) finds the pipe closed
        else:
            os.kill(proc.pid, getattr(signal, how))
        assert all(_gone(pid, 12.0) for pid in pids), f"a node outlived the runner ({how})"
    finally:
        _kill(pids)
        proc.kill()
        proc.wait()


STOPPER = """import sys, time
sys.path.insert(0, {repo!r})
from deploy.ros import stop_on_signals
stop = stop_on_signals()
print("pid", __import__("os").getpid(), "python", sys.executable, flush=True)
stop.wait()
with open({log!r}, "a") as f:
    f.write("stopping\\n")
time.sleep(2.0)  # a shutdown descent
with open({log!r}, "a") as f:
    f.write("descent done\\n")
"""


def test_a_node_finishes_its_stop_when_the_runner_dies_during_it(tmp_path):
    """Ctrl-C, then the runner killed while the node flies its shutdown descent: the node gets SIGHUP
    from the kernel (the runner's death), which never escalates, and finishes the descent."""
    log = tmp_path / "node.log"
    prefix = _fake_nodes(tmp_path, {"stopper": STOPPER.format(repo=str(REPO), log=str(log))})
    proc = _start_runner(tmp_path, '<launch><node pkg="fake" exec="stopper" name="n"/></launch>', prefix)
    lines: list[str] = []
    pids = _wait_pids(proc, 1, lines)
    try:
        assert len(pids) == 1, lines
        proc.send_signal(signal.SIGINT)
        deadline = time.monotonic() + 10
        while not (log.exists() and "stopping" in log.read_text()) and time.monotonic() < deadline:
            time.sleep(0.05)
        proc.kill()  # the runner dies mid-descent
        proc.wait()
        assert _gone(pids[0], 10.0)
        assert log.read_text().split() == ["stopping", "descent", "done"], log.read_text()
    finally:
        _kill(pids)


def test_under_nohup_a_hangup_stops_nothing(tmp_path):
    prefix = _fake_nodes(tmp_path, {"sleeper": SLEEPER})
    proc = _start_runner(tmp_path, '<launch><node pkg="fake" exec="sleeper" name="a"/></launch>', prefix, nohup=True)
    lines: list[str] = []
    pids = _wait_pids(proc, 1, lines)
    try:
        assert len(pids) == 1, lines
        proc.send_signal(signal.SIGHUP)
        assert not _gone(pids[0], 1.0) and proc.poll() is None, "SIGHUP stopped a launch run under nohup"
        proc.send_signal(signal.SIGINT)
        assert proc.wait(timeout=15) == 0 and _gone(pids[0], 5.0)
    finally:
        proc.kill()
        _kill(pids)


def _run_here(procs) -> int:
    """deploy.launch.run in this process, its signal handlers restored afterwards."""
    import deploy.launch as launch

    handlers = {sig: signal.getsignal(sig) for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)}
    try:
        return launch.run(procs)
    finally:
        for sig, handler in handlers.items():
            signal.signal(sig, handler)


def _started(out: str) -> list[int]:
    """The pids of the processes the runner's output says it started."""
    return [int(x) for x in re.findall(r"process started with pid \[(\d+)\]", out)]


def test_an_error_of_the_runner_itself_stops_every_node(tmp_path, monkeypatch, capsys):
    """The runner's own loop raising (here its selector, from the 5th call on): the nodes are stopped
    (SIGINT first, as on Ctrl-C) before the error propagates, none is left running."""
    import selectors

    import deploy.launch as launch

    prefix = _fake_nodes(tmp_path, {"sleeper": SLEEPER})
    monkeypatch.setenv("AMENT_PREFIX_PATH", str(prefix))
    procs = plan(write(tmp_path / "t.launch.xml", '<launch><node pkg="fake" exec="sleeper" name="a"/>'
                       '<node pkg="fake" exec="sleeper" name="b"/></launch>'), {})

    class FailingSelector(selectors.DefaultSelector):
        calls = 0

        def select(self, timeout=None):
            FailingSelector.calls += 1
            if FailingSelector.calls >= 5:
                raise RuntimeError("selector broke")
            return super().select(timeout)

    monkeypatch.setattr(launch.selectors, "DefaultSelector", FailingSelector)
    with pytest.raises(RuntimeError, match="selector broke"):
        _run_here(procs)
    out = capsys.readouterr().out
    pids = _started(out)
    try:
        assert len(pids) == 2 and "launch runner error: stopping 2 process(es)" in out, out
        assert all(_gone(pid, 1.0) for pid in pids)
    finally:
        _kill(pids)


def test_a_node_with_on_exit_shutdown_stops_the_launch_when_it_exits(tmp_path, monkeypatch, capsys):
    """<node on_exit="shutdown"> (the shipped files' simulator and policy nodes): its exit (here code 2, as a
    policy node refusing its policy path) stops the other nodes and fails the run; without it the others ran
    on alone until Ctrl-C. Another on_exit value is refused."""
    prefix = _fake_nodes(tmp_path, {"sleeper": SLEEPER, "failing": "import sys\nsys.exit(2)\n"})
    monkeypatch.setenv("AMENT_PREFIX_PATH", str(prefix))
    procs = plan(write(tmp_path / "t.launch.xml", '<launch><node pkg="fake" exec="sleeper" name="sim"/>'
                       '<node pkg="fake" exec="failing" name="policy" on_exit="shutdown"/></launch>'), {})
    t0 = time.monotonic()
    code = _run_here(procs)
    out = capsys.readouterr().out
    pids = _started(out)
    try:
        assert code == 1 and time.monotonic() - t0 < 10.0, out
        assert "policy-2 exited (on_exit=shutdown): stopping 1 process(es)" in out and _gone(pids[0], 1.0), out
    finally:
        _kill(pids)
    with pytest.raises(LaunchError, match="on_exit supports 'shutdown' only"):
        plan(write(tmp_path / "u.launch.xml",
                   '<launch><node pkg="fake" exec="sleeper" on_exit="respawn"/></launch>'), {})
    for name in ("backend_sim", "backend_hil", "backend_real"):  # the node that flies, and the simulator
        xml = (REPO / "launch" / f"{name}.launch.xml").read_text()
        assert all(f'exec="{node}"' not in xml or re.search(rf'exec="{node}"[^>]*on_exit="shutdown"', xml)
                   for node in ("sim_bridge", "policy_node", "firmware_bridge", "crazyflie_bridge")), name


@pytest.mark.parametrize("order", ["second fails", "first fails"])
def test_a_process_that_cannot_start_fails_the_run(order, capsys):
    """A node whose executable cannot be run (here: missing): the run stops the ones started and exits
    non-zero, whichever position it has (the others, stopped cleanly, made it exit with 0)."""
    import deploy.launch as launch

    ok = launch.Process("sleeper", [sys.executable, "-c", "import time; time.sleep(30)"], dict(os.environ))
    bad = launch.Process("missing", ["/nonexistent/node"], dict(os.environ))
    code = _run_here([ok, bad] if order == "second fails" else [bad, ok])
    out = capsys.readouterr().out
    pids = _started(out)
    try:
        assert code == 1 and "could not start missing" in out, out
        assert len(pids) == (1 if order == "second fails" else 0) and all(_gone(pid, 1.0) for pid in pids)
    finally:
        _kill(pids)


def test_an_exited_nodes_orphan_holding_its_output_does_not_stall_the_runner(tmp_path):
    """A node that exits while a child it started still holds its stdout: the runner relays what is
    there and goes on (it used to block until that child ended, 30 s here)."""
    import threading

    prefix = _fake_nodes(tmp_path, {"sleeper": SLEEPER, "forker": (
        "import subprocess, sys\nchild = subprocess.Popen(['sleep', '30'])\nprint('forked', child.pid, flush=True)\n"
        "sys.exit(3)\n")})
    proc = _start_runner(tmp_path, '<launch><node pkg="fake" exec="forker" name="f"/>'
                                   '<node pkg="fake" exec="sleeper" name="s"/></launch>', prefix)
    lines: list[str] = []
    threading.Thread(target=lambda: lines.extend(iter(proc.stdout.readline, "")), daemon=True).start()

    def wait_for(text: str, within: float) -> bool:
        deadline = time.monotonic() + within
        while not any(text in ln for ln in lines) and time.monotonic() < deadline:
            time.sleep(0.05)
        return any(text in ln for ln in lines)

    try:
        assert wait_for("[f-1] forked", 20), lines
        assert wait_for("[f-1]: process has died [exit code 3]", 5), lines
        proc.send_signal(signal.SIGINT)
        assert proc.wait(timeout=5) == 1 and wait_for("[s-2]: process has finished cleanly", 5), lines
    finally:
        proc.kill()
        for ln in lines:
            if "[f-1] forked " in ln:
                try:
                    os.kill(int(ln.split()[-1]), signal.SIGKILL)
                except ProcessLookupError:
                    pass


def test_launch_eval_has_builtins_and_math_and_include_args_refuse_conditions(ament_prefix, tmp_path):
    write(tmp_path / "inc.launch.xml", '<launch><arg name="who" default="default"/>'
          '<node pkg="robolearn" exec="recorder" name="$(var who)"/></launch>')
    main = write(tmp_path / "main.launch.xml", """<launch>
      <node pkg="robolearn" exec="sim_bridge" name="n$(eval 'abs(-2) + int(math.pi)')"/>
      <include file="inc.launch.xml"/>
    </launch>""")
    assert [p.name for p in plan(main, {})] == ["n5", "default"]
    conditional = write(tmp_path / "cond.launch.xml", '<launch><include file="inc.launch.xml">'
                        '<arg name="who" value="given" if="false"/></include></launch>')
    with pytest.raises(LaunchError, match="if/unless are not accepted on an include's <arg>"):
        plan(conditional, {})


def test_hover_launch_names_the_recording_after_the_robot(ament_prefix):
    recorder = plan(REPO / "launch/hover.launch.xml", {"record": "true", "robot": "cf2"})[-1]
    assert recorder.name == "recorder" and "robot:=cf2" in recorder.argv


def _channel(writer, topic: str, type_name: str) -> int:
    """A channel of ``type_name`` messages on ``topic`` as the recorder registers it."""
    from deploy.recorder import msg_definition

    return writer.register_channel(topic, "cdr", writer.register_schema(type_name, "ros2msg",
                                                                        msg_definition(type_name).encode()))


def _odom_bag(path: Path, n: int, finish: bool, restart_at: int | None = None, stale: int = 0) -> None:
    """n odometry messages at 100 Hz (x = i / 100 m, stamped as logged), each followed by a rotor command
    when restart_at is given, in the recorder's layout and writer settings; unfinished: no summary. From
    message ``restart_at`` on, the simulator's clock starts over at 0 and x at 10 m (a simulator restarted
    under the recorder); the recorder's clock follows ``stale`` messages later (it logs those on the old one)."""
    from nav_msgs.msg import Odometry
    from rclpy.serialization import serialize_message
    from std_msgs.msg import Float32MultiArray

    from deploy.recorder import new_writer

    f = path.open("wb")
    w = new_writer(f)
    w.start()
    odom = _channel(w, "/cf1/odom", "nav_msgs/msg/Odometry")
    cmd = _channel(w, "/cf1/rotor_cmd", "std_msgs/msg/Float32MultiArray")
    for i in range(n):
        k, x0 = (i - restart_at, 10.0) if restart_at is not None and i >= restart_at else (i, 0.0)
        log = (restart_at - 1) * 10_000_000 if restart_at is not None and 0 <= k < stale and x0 else k * 10_000_000
        m = Odometry()
        m.pose.pose.position.x, m.pose.pose.orientation.w = x0 + k / 100, 1.0
        m.header.stamp.sec, m.header.stamp.nanosec = divmod(k * 10_000_000, 1_000_000_000)
        w.add_message(odom, log_time=log, data=serialize_message(m), publish_time=log)
        if restart_at is not None:
            c = serialize_message(Float32MultiArray(data=[x0 + k / 100] * 4))
            w.add_message(cmd, log_time=log, data=c, publish_time=log)
    if finish:
        w.finish()
    f.close()


def test_a_second_signal_while_the_recorder_takes_the_last_messages_still_finishes_the_file(tmp_path, monkeypatch):
    """The launch runner's SIGTERM comes 5 s after Ctrl-C, and the recorder may still be taking the landing's
    messages then: the KeyboardInterrupt it raises used to skip writer.finish(), leaving a file without its
    summary."""
    from mcap.reader import make_reader

    import deploy.recorder as rec

    node = object.__new__(rec.Recorder)
    node.path, node._file = tmp_path / "r.mcap", (tmp_path / "r.mcap").open("xb")
    node.writer, node.counts = rec.new_writer(node._file), {"/cf1/odom": 0}
    node.writer.start(profile="ros2", library="test")

    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(rec, "drain", interrupted)
    node.close()
    with node.path.open("rb") as f:
        assert make_reader(f).get_summary() is not None


def test_plot_splits_a_recording_where_its_clock_went_back(tmp_path, capsys):
    """A simulator restarted under the recorder starts the clocks over: the two flights are runs of their
    own (sorted by log time they were interleaved), the last plotted unless --run names one. The new
    simulator's first odometry, logged on the recorder's old clock, goes with the new flight."""
    from deploy.plot import main as plot_main
    from deploy.plot import read_flight

    for finish, stale in ((True, 0), (True, 3), (False, 3)):  # with the summary, or without (a killed recorder)
        bag = tmp_path / f"restart_{finish}_{stale}.mcap"
        _odom_bag(bag, 500, finish=finish, restart_at=300, stale=stale)
        last, first = read_flight(bag, "cf1"), read_flight(bag, "cf1", run=0)
        assert (last["runs"], last["run"], first["run"]) == (2, 1, 0)
        assert np.allclose(first["pos"][:, 0], np.arange(300) / 100)
        assert np.allclose(first["rpm"][:300, 0], first["pos"][:, 0])
        n = len(last["pos"])  # all 200 (finished), up to where the unfinished file breaks off
        assert (n == 200 if finish else 100 < n <= 200) and np.allclose(last["pos"][:, 0], 10 + np.arange(n) / 100)
        assert np.all(np.diff(last["t_odom"]) > 0) and np.all(np.diff(first["t_odom"]) > 0)
        # the commands logged on the old clock stay with the old flight (they have no stamp of their own)
        assert len(first["t_cmd"]) == 300 + stale and (last["rpm"][:, 0] >= 10).all()
    bag = tmp_path / "restart_True_3.mcap"
    capsys.readouterr()
    assert plot_main([str(bag)]) == 0
    err = capsys.readouterr().err
    assert "went back 1 time(s)" in err and "plotting run 2 of 2" in err, err
    assert plot_main([str(bag), "--run", "1", "-o", str(tmp_path / "first.png")]) == 0
    assert "plotting run 1 of 2" in capsys.readouterr().err
    for bad in ("3", "0"):
        assert plot_main([str(bag), "--run", bad]) == 2
        assert capsys.readouterr().err.startswith("error: ")
    _odom_bag(tmp_path / "one.mcap", 50, finish=True)
    assert read_flight(tmp_path / "one.mcap", "cf1")["runs"] == 1
    # a run without odometry (status logged after the recorder's clock went back, no state since) is one
    # error line naming it
    from nav_msgs.msg import Odometry
    from rclpy.serialization import serialize_message
    from std_msgs.msg import String

    from deploy.recorder import new_writer

    with (tmp_path / "status_only.mcap").open("wb") as f:
        w = new_writer(f)
        w.start()
        odom = _channel(w, "/cf1/odom", "nav_msgs/msg/Odometry")
        status = _channel(w, "/cf1/status", "std_msgs/msg/String")
        for i in range(100):
            m = Odometry()
            m.header.stamp.nanosec = i * 10_000_000
            w.add_message(odom, log_time=i * 10_000_000, data=serialize_message(m), publish_time=0)
        for log in (990_000_000, 0):
            w.add_message(status, log_time=log, data=serialize_message(String(data="{}")), publish_time=0)
        w.finish()
    no_odometry = r"run 2 of 2 \(its clock went back 1 time\(s\)\) has no messages on /cf1/odom"
    with pytest.raises(ValueError, match=no_odometry):
        read_flight(tmp_path / "status_only.mcap", "cf1")
    assert len(read_flight(tmp_path / "status_only.mcap", "cf1", run=0)["t_odom"]) == 100


def test_plot_reads_an_unfinished_or_cut_recording_up_to_where_it_ends(tmp_path, capsys):
    """A recorder killed before finishing its file (no summary) or a file cut short: the messages
    written are still plotted, flagged unfinished; a file with none is one error line."""
    from deploy.plot import main as plot_main
    from deploy.plot import read_flight

    _odom_bag(tmp_path / "done.mcap", 300, finish=True)
    assert read_flight(tmp_path / "done.mcap", "cf1")["finished"]
    _odom_bag(tmp_path / "killed.mcap", 300, finish=False)
    flight = read_flight(tmp_path / "killed.mcap", "cf1")
    assert not flight["finished"] and 250 <= len(flight["t_odom"]) <= 300
    assert np.all(np.diff(flight["t_odom"]) > 0) and np.allclose(flight["pos"][:, 0], np.arange(len(flight["pos"])) / 100)
    data = (tmp_path / "done.mcap").read_bytes()
    (tmp_path / "cut.mcap").write_bytes(data[: len(data) // 2])  # a record cut in the middle
    assert 50 <= len(read_flight(tmp_path / "cut.mcap", "cf1")["t_odom"]) < 300
    assert plot_main([str(tmp_path / "killed.mcap")]) == 0 and (tmp_path / "killed.png").stat().st_size > 10_000
    (tmp_path / "junk.mcap").write_bytes(b"not a recording")
    with pytest.raises(ValueError, match="is not a readable MCAP recording"):
        read_flight(tmp_path / "junk.mcap", "cf1")
    # another robot's recording names the odometry it has; the recorder's directory names its newest file
    for name in ("done.mcap", "killed.mcap"):  # finished, or not (read without its summary)
        with pytest.raises(ValueError) as e:
            read_flight(tmp_path / name, "cf2")
        assert str(e.value) == f"{tmp_path / name} has no messages on /cf2/odom: wrong --robot? it has /cf1/odom"
    os.utime(tmp_path / "killed.mcap", (2e9, 2e9))
    capsys.readouterr()
    assert plot_main([str(tmp_path)]) == 2
    assert capsys.readouterr().err == (f"error: {tmp_path} is a directory: give one recording in it (the newest: "
                                       f"{tmp_path / 'killed.mcap'})\n")


def test_pyproject_registers_the_ament_package():
    """The wheel's data-files must equal what `python -m deploy.ament` links (deploy/README.md)."""
    data_files = tomllib.loads((REPO / "pyproject.toml").read_text()).get("tool", {}).get("setuptools", {}).get(
        "data-files")
    assert data_files == ament.DATA_FILES, "add the [tool.setuptools.data-files] lines of deploy/README.md"


@pytest.mark.parametrize("bad", ["nonfinite", "geofence"])
def test_a_bad_sample_fails_safe_even_when_a_valid_one_follows_it_within_the_period(bad):
    """Two states in one period (a radio burst): a rejected or out-of-fence sample followed by a good
    one still fails safe at the tick."""
    at = NEAR_FENCE
    c, _ = armed_controller(at=at)
    assert c.tick(0.0).mode is Mode.ARMED
    if bad == "nonfinite":
        c.on_state(None, 0.005, "nonfinite: NaN")
    else:
        c.on_state(hover_state(0.005, pos=OUTSIDE_FENCE), 0.005)
    c.on_state(hover_state(0.008, pos=at), 0.008)
    cmd = c.tick(0.01)
    assert cmd.mode is Mode.FAILSAFE and cmd.reason.startswith(bad), cmd.reason
    for k in range(2, 5):  # recover_count = 3 valid states after the failsafe began
        c.on_state(hover_state(0.01 * k, pos=at), 0.01 * k)
        assert c.tick(0.01 * k).mode is (Mode.ARMED if k == 4 else Mode.FAILSAFE), k


def test_a_state_is_stale_from_its_stamp_not_from_its_receipt():
    c, _ = armed_controller()  # stale_timeout 50 ms
    c.on_state(hover_state(0.96), 1.0, age=0.04)  # received 40 ms after it was sampled
    assert c.tick(1.0).mode is Mode.ARMED
    cmd = c.tick(1.011)  # 51 ms after it was sampled, 11 ms after its receipt
    assert cmd.mode is Mode.FAILSAFE and cmd.reason.startswith("stale: last state 51 ms old"), cmd.reason


def test_a_disarm_during_a_failsafe_descent_keeps_its_timer_and_forbids_recovery():
    c, _ = armed_controller()
    assert c.tick(0.1).mode is Mode.FAILSAFE  # stale
    fall = math.sqrt(2 * 1.0 / ((1 - c.cfg.descent_thrust_ratio) * GRAVITY)) + 0.3
    c.disarm(0.5)
    c.disarm(0.6)
    assert c.status()["failsafe_count"] == 1 and c.reason.count("disarm requested") == 1, c.reason
    assert c.tick(0.1 + fall - 0.01).mode is Mode.FAILSAFE
    assert c.tick(0.1 + fall + 0.01).mode is Mode.DISARMED
    c, _ = armed_controller()
    assert c.tick(0.1).mode is Mode.FAILSAFE
    c.disarm(0.1)
    for k in range(1, 6):  # valid states that would end an undisarmed failsafe
        c.on_state(hover_state(0.1 + 0.01 * k), 0.1 + 0.01 * k)
        assert c.tick(0.1 + 0.01 * k).mode is Mode.FAILSAFE


def tilted_state(deg: float, t: float = 0.0, z: float = 0.0, rate: float = 0.0) -> State:
    """At rest at height ``z``, rolled ``deg`` about the body x axis, rolling at ``rate`` (rad/s)."""
    half = math.radians(deg) / 2
    return make_state([0.0, 0.0, z], [math.cos(half), math.sin(half), 0, 0], [0, 0, 0], [rate, 0, 0], t)


def test_arming_is_refused_tilted_and_a_tumbled_vehicle_is_cut():
    """Beyond max_tilt_deg one sample is a failsafe (the policy does not fly on it), two in a row a tumble: the
    rotors are cut."""
    c = SafeController(FakePolicy(), SafetyConfig())  # max_arm_tilt_deg 30, max_tilt_deg 90
    c.on_state(tilted_state(45.0, z=1.0), 0.0)
    ok, msg = c.arm(0.0)
    assert not ok and "tilted 45 deg" in msg, msg
    c.on_state(tilted_state(20.0, 0.01, z=1.0), 0.01)
    assert c.arm(0.01) == (True, "armed")
    rate = math.radians(17.0) / 0.01  # 29.7 rad/s: 17 deg per sample
    for k in range(1, 7):  # rolling over: 37, 54, 71, 88 deg (steep, but not over: the policy flies on), 105, 122
        c.on_state(tilted_state(20.0 + 17.0 * k, 0.01 + 0.01 * k, z=1.0, rate=rate), 0.01 + 0.01 * k)
        cmd = c.tick(0.01 + 0.01 * k)
        assert cmd.mode is {5: Mode.FAILSAFE, 6: Mode.DISARMED}.get(k, Mode.ARMED), (k, cmd.reason)
        if k == 5:
            assert cmd.reason.startswith("tilted 105 deg (limit 90 deg): a tumble if the next"), cmd.reason
    assert cmd.reason.startswith("tumbled: tilted 122 deg"), cmd.reason
    assert cmd.action.tolist() == [IDLE_ACTION] * 4 and c.status()["failsafe_count"] == 2
    c, _ = armed_controller()  # in a failsafe descent too
    assert c.tick(0.1).mode is Mode.FAILSAFE  # stale
    for t, mode in ((0.1, Mode.FAILSAFE), (0.11, Mode.DISARMED)):  # upside down
        c.on_state(make_state([1.0, 0.0, 1.0], [0.0, 1.0, 0, 0], [0, 0, 0], [0, 0, 0], t), t)
        assert c.tick(t).mode is mode, (t, c.reason)
    assert "tumbled" in c.reason and c.status()["failsafe_count"] == 2
    c, _ = armed_controller()  # ... also where a rejected sample follows it before the tick (a tumbling
    for k, deg in ((1, 40.0), (2, 80.0), (3, 120.0)):  # vehicle's next samples exceed the body-rate limit)
        c.on_state(tilted_state(deg, 0.01 * k, z=1.0, rate=34.0), 0.01 * k)
        assert c.tick(0.01 * k).mode is (Mode.DISARMED if k == 3 else Mode.ARMED)
        if k == 2:
            c.on_state(tilted_state(120.0, 0.03, z=1.0, rate=34.0), 0.03)
            c.on_state(None, 0.035, "out_of_range: body rate 40 rad/s")
            break
    cmd = c.tick(0.04)
    assert cmd.mode is Mode.DISARMED and cmd.reason.startswith("tumbled: tilted 120 deg"), cmd.reason
    c, _ = armed_controller()  # ... not where a stopped clock's watchdog marks the state stale
    assert c.on_state(tilted_state(100.0, 0.05, z=1.0), 0.05) is None
    c.on_state(None, 0.055, "stale: /clock stopped 600 ms ago (limit 500 ms)")
    assert c.tick(0.06).mode is Mode.FAILSAFE, c.reason
    c, _ = armed_controller()  # ... but not on a stale state: a latched fence breach does not make it current
    c.on_state(make_state([2.0, 0.0, 1.0], [0.0, 1.0, 0, 0], [0, 0, 0], [0, 0, 0], 0.0), 0.1, age=0.045)
    cmd = c.tick(0.11)
    assert cmd.mode is Mode.FAILSAFE and cmd.reason.startswith("stale"), cmd.reason
    with pytest.raises(ValueError, match="max_tilt_deg"):
        SafetyConfig(max_arm_tilt_deg=40.0, max_tilt_deg=30.0)


def upside_down(t: float, z: float = 1.0) -> State:
    return make_state([0.0, 0.0, z], [0.0, 1.0, 0.0, 0.0], [0, 0, 0], [0, 0, 0], t)


@pytest.mark.parametrize("glitch, why", [(hover_state(0.01, z=-0.5), "implausible: position [0.0, 0.0, -"),
                                         (upside_down(0.01), "implausible: tilt changed 180 deg")])
@pytest.mark.parametrize("z", [1.0, 0.0])
def test_a_single_glitch_is_dropped_not_flown_on(glitch, why, z):
    """One sample of an armed vehicle, hovering at 1 m or taking off from the floor, jumps (an estimator's
    outlier, a swapped motion-capture marker): below the fence's floor, or upside down. Believed, either
    would cut the rotors (a geofence failsafe on the ground) or be a failsafe (tilted), as each is once the
    time since the last valid state covers it. Dropped, the policy flies on as if it had not arrived."""
    glitch = dataclasses.replace(glitch, pos=glitch.pos + [0.0, 0.0, z - 1.0])
    c, policy = armed_controller(at=(0.0, 0.0, z))
    assert c.tick(0.0).mode is Mode.ARMED
    assert c.on_state(glitch, 0.01).startswith(why)
    calls = policy.calls
    cmd = c.tick(0.01)
    assert cmd.mode is Mode.ARMED and policy.calls == calls + 1 and c.latest.pos[2] == z, cmd.reason
    for k in range(2, 5):
        assert c.on_state(hover_state(0.01 * k, z=z), 0.01 * k) is None
        assert c.tick(0.01 * k).mode is Mode.ARMED, k
    assert c.status()["failsafe_count"] == 0
    c, _ = armed_controller(at=(0.0, 0.0, z))  # the same sample 130 ms after the last valid state is believed:
    assert c.tick(0.0).mode is Mode.ARMED  # 10 m/s covers 1.5 m; the rotors' angular acceleration, 180 deg
    glitch = dataclasses.replace(glitch, stamp=0.13)
    assert c.on_state(glitch, 0.13) is None
    cmd = c.tick(0.13)
    if z == 0.0:  # on the floor it was armed on
        assert cmd.mode is Mode.DISARMED and "rotors cut" in c.reason, c.reason
    elif "tilt" in why:  # not yet a tumble: that takes the next sample
        assert cmd.mode is Mode.FAILSAFE and cmd.reason.startswith("tilted 180 deg"), cmd.reason
    else:  # below the fence: a failsafe, but not on the ground (a free fall from 1 m takes 0.45 s)
        assert cmd.mode is Mode.FAILSAFE and cmd.reason.startswith("geofence"), cmd.reason


@pytest.mark.parametrize("gap, deg", [(0.02, 95.0), (0.03, 130.0), (0.05, 179.0)])
def test_an_attitude_glitch_after_lost_samples_is_dropped(gap, deg):
    """Level and still, samples lost, then one tilted beyond max_tilt_deg without a body rate that could have
    turned it there (the rotors' angular acceleration bounds the rest): dropped, not a tumble's cut."""
    c, _ = armed_controller()
    assert c.tick(0.0).mode is Mode.ARMED
    assert c.on_state(tilted_state(deg, gap, z=1.0), gap).startswith(f"implausible: tilt changed {deg:.0f} deg")
    assert c.tick(gap).mode is Mode.ARMED and c.status()["failsafe_count"] == 0


@pytest.mark.parametrize("gap, deg", [(0.05, 100.0), (0.08, 180.0)])
def test_a_tilted_glitch_after_lost_samples_is_a_failsafe_not_a_cut(gap, deg):
    """Level at 1 m, samples lost, then one tilted beyond max_tilt_deg that the rotors' angular acceleration could
    just have reached in the gap (believed), then level samples again: a failsafe (the policy does not fly on the
    tilted state), never a cut in the air. The level samples are dropped against it until they are plausible;
    the vehicle then recovers."""
    c, policy = armed_controller()
    assert c.tick(0.0).mode is Mode.ARMED
    assert c.on_state(tilted_state(deg, gap, z=1.0), gap) is None
    calls = policy.calls
    cmd = c.tick(gap)
    assert cmd.mode is Mode.FAILSAFE and cmd.reason.startswith(f"tilted {deg:.0f} deg"), cmd.reason
    assert policy.calls == calls
    modes = []
    for k in range(1, 30):
        t = gap + 0.01 * k
        c.on_state(hover_state(t), t)
        modes.append(c.tick(t).mode)
    assert Mode.DISARMED not in modes and modes[-1] is Mode.ARMED, modes
    assert c.reason.startswith("recovered"), c.reason


def test_two_tilted_glitches_with_a_level_sample_between_are_no_tumble():
    """Upside down after lost samples (believed), then a level sample (dropped against it), then upside down
    again, or out of range: the level sample answered the first; the others do not confirm a tumble."""
    for third in ("upside down", "out of range"):
        c, _ = armed_controller()
        assert c.tick(0.0).mode is Mode.ARMED
        assert c.on_state(tilted_state(180.0, 0.08, z=1.0), 0.08) is None
        assert c.on_state(hover_state(0.09), 0.09).startswith("implausible: tilt changed 180 deg")
        if third == "upside down":
            assert c.on_state(tilted_state(180.0, 0.1, z=1.0), 0.1) is None
        else:
            c.on_state(None, 0.1, "out_of_range: body rate 40 rad/s")
        cmd = c.tick(0.1)
        assert cmd.mode is Mode.FAILSAFE, (third, cmd.reason)


def test_a_tumble_whose_samples_stop_is_cut_once_its_state_is_stale():
    """Rolling over at 1 m, the samples pass max_tilt_deg and then stop (the motion capture lost the vehicle, or
    its samples all come late): a failsafe at the tilted one, the rotors cut when it goes stale with no sample
    after it; arming is refused for the tumble."""
    c, _ = armed_controller()
    for k, deg in enumerate((20.0, 40.0, 60.0, 80.0, 100.0), 1):
        c.on_state(tilted_state(deg, 0.01 * k, z=1.0, rate=34.0), 0.01 * k)
        assert c.tick(0.01 * k).mode is (Mode.FAILSAFE if deg > 90.0 else Mode.ARMED), (k, c.reason)
    assert c.tick(0.1).mode is Mode.FAILSAFE  # 50 ms: still current
    cmd = c.tick(0.11)
    assert cmd.mode is Mode.DISARMED and cmd.reason.startswith("tumbled: tilted 100 deg (limit 90 deg), no sample "
                                                               "since: rotors cut"), cmd.reason
    c.on_state(tilted_state(120.0, 0.12, z=1.0, rate=34.0), 0.12)  # ... also once confirmed: arming names the tumble
    c.on_state(tilted_state(140.0, 0.13, z=1.0, rate=34.0), 0.13)
    ok, msg = c.arm(0.13)
    assert not ok and "tumbled: tilted 140 deg" in msg, msg


def test_a_glitch_to_the_floor_lasting_a_few_samples_does_not_cut_an_armed_vehicle():
    """Taking off at 0.5 m, the estimate reads 2 cm for 40 ms, then the true height again: the first sample
    is dropped, the next ones believed (10 m/s covers 0.48 m in 20 ms), as is the true height after them.
    The policy flies on them; nothing cuts the rotors (the floor's rule waits ground_timeout)."""
    c, _ = armed_controller(at=(0.0, 0.0, 0.5))
    for k in range(1, 8):
        z = 0.02 if k <= 4 else 0.5
        c.on_state(hover_state(0.01 * k, z=z), 0.01 * k)
        assert c.tick(0.01 * k).mode is Mode.ARMED, (k, c.reason)
    assert c.status()["failsafe_count"] == 0 and c.latest.pos[2] == 0.5


def test_a_second_source_of_states_cannot_hide_the_vehicle():
    """Two sources interleaved (a second publisher on odom): one stays at the start, the vehicle is 0.6 m away.
    The first keeps the last valid state current and every sample of the second is dropped; once they have
    come over more than stale_timeout, a third of the samples or more, that is a failsafe, without recovery
    (or arming) while they come: also at half the rate of the other, and after a second of an intermittent
    glitch (every fourth sample), which alone is only dropped."""
    c, _ = armed_controller()
    modes = []
    for k in range(1, 60):
        t = 0.01 * k
        c.on_state(hover_state(t), t)  # the ghost, believed: it agrees with the last valid state
        c.on_state(hover_state(t + 0.005, pos=[0.6, 0.0, 1.0]), t + 0.005)  # the vehicle, dropped
        modes.append(c.tick(t + 0.005).mode)
    assert modes[:6] == [Mode.ARMED] * 6 and set(modes[6:]) == {Mode.FAILSAFE}, modes
    assert c.reason.startswith("dropped samples (implausible or out of order) keep coming, a third of all or more (a "
                               "second source of states?)"), c.reason
    assert c.arm(0.6)[0] is False
    for vehicle_every, glitch_first in ((1, True), (2, False)):  # (2: the vehicle's samples at half the rate)
        c, _ = armed_controller()
        t0 = 1.0 if glitch_first else 0.0
        for k in range(1, 100 if glitch_first else 0):  # a second of a glitch in every fourth sample: dropped
            c.on_state(hover_state(0.01 * k, z=0.0 if k % 4 == 0 else 1.0), 0.01 * k)
            assert c.tick(0.01 * k).mode is Mode.ARMED, (k, c.reason)
        modes = []
        for k in range(1, 30):
            t = t0 + 0.01 * k
            c.on_state(hover_state(t), t)
            if k % vehicle_every == 0:
                c.on_state(hover_state(t + 0.005, pos=[0.6, 0.0, 1.0]), t + 0.005)
            modes.append(c.tick(t + 0.005).mode)
        assert Mode.FAILSAFE in modes[:12] and modes[-1] is Mode.FAILSAFE, (vehicle_every, glitch_first, modes)


def test_a_second_source_on_the_floor_does_not_land_a_climbing_vehicle():
    """A second source keeps sending the pose from before take-off (on the floor) between the samples of a
    vehicle climbing at 0.5 m/s: a failsafe once the vehicle's samples are dropped against it; but the two
    disagree, so the floor's samples are no landing: the descent is timed from the vehicle in the air."""
    c = SafeController(FakePolicy(), SafetyConfig())
    c.on_state(hover_state(0.0, z=0.0), 0.0)
    assert c.arm(0.0)[0]
    modes = []
    for k in range(1, 200):
        t = 0.005 * k
        c.on_state(hover_state(t, z=0.0 if k % 2 == 0 else 0.5 * t), t)
        modes.append(c.tick(t).mode)
        if modes[-1] is Mode.DISARMED:
            break
    assert Mode.FAILSAFE in modes and Mode.DISARMED not in modes, (modes.index(Mode.DISARMED) * 0.005, c.reason)
    assert c.reason.startswith("dropped samples (implausible or out of order) keep coming"), c.reason


def test_a_long_glitch_to_the_floor_does_not_land_a_vehicle_flying_at_1_m():
    """The estimate reads 1 cm for 90 ms (a swapped marker), then 1 m again: the first samples are dropped (a
    failsafe once the last valid state is stale), the later ones believed (10 m/s covers 0.99 m in 70 ms),
    three of them on the floor; but a free fall from 1 m takes 0.45 s: not landed (a failsafe then starts a
    descent timed from 1 m, not from the floor). The true height is then dropped in turn (implausible samples
    keep coming), then believed, and the policy takes over again."""
    c, _ = armed_controller()
    modes = []
    for k in range(1, 40):
        t = 0.01 * k
        c.on_state(hover_state(t, z=0.01 if k <= 9 else 1.0), t)
        modes.append(c.tick(t).mode)
    assert Mode.DISARMED not in modes and modes[-1] is Mode.ARMED, modes
    assert c.reason.startswith("recovered"), c.reason
    c, _ = armed_controller()  # the same glitch, then no state at all (the link lost): a descent timed from 1 m
    for k in range(1, 10):
        c.on_state(hover_state(0.01 * k, z=0.01), 0.01 * k)
        c.tick(0.01 * k)
    assert c.tick(0.2).mode is Mode.FAILSAFE and c.tick(1.6).mode is Mode.FAILSAFE  # 1.43 s of fall, 0.3 s more
    assert c.tick(1.8).mode is Mode.DISARMED and "landed" in c.reason, c.reason


def test_a_floor_reflection_between_the_samples_of_a_vehicle_at_0_3_m_does_not_land_it():
    """Hovering at 0.3 m, each sample followed 5 ms later by one at 0 (a floor reflection, believed: within
    max_jump); then no state for 60 ms. The failsafe descends: samples in the air break the floor's count."""
    c, _ = armed_controller(at=(0.0, 0.0, 0.3))
    for k in range(1, 30):
        t = 0.01 * k
        c.on_state(hover_state(t, z=0.3), t)
        c.on_state(hover_state(t + 0.005, z=0.0), t + 0.005)
        c.tick(t + 0.005)
    cmd = c.tick(0.35)
    assert cmd.mode is Mode.FAILSAFE and cmd.reason.startswith("stale"), cmd.reason
    c, _ = armed_controller(at=(0.0, 0.0, 0.3), ground_timeout=1.0)  # nor is it on the floor "without a break" while
    for k in range(1, 150):  # armed, though every tick comes after a reflection
        t = 0.01 * k
        c.on_state(hover_state(t, z=0.3), t)
        c.on_state(hover_state(t + 0.005, z=0.0), t + 0.005)
        assert c.tick(t + 0.005).mode is Mode.ARMED, (t, c.reason)


def test_a_floor_reflection_and_a_gap_in_the_vehicles_samples_do_not_land_it_at_0_3_m():
    """As above, descending (disarmed) from 0.3 m, and the vehicle's samples missing for 30 ms while the
    reflections go on: three of them in a row are not a landing before a free fall from the last states in
    the air (half of the last ones at 0.3 m) could have got there."""
    c, _ = armed_controller(at=(0.0, 0.0, 0.3))
    for k in range(1, 60):
        t = 0.01 * k
        if not 40 <= k < 43:
            c.on_state(hover_state(t, z=0.3), t)
        c.on_state(hover_state(t + 0.005, z=0.0), t + 0.005)
        if k == 30:
            c.disarm(t + 0.005)
        assert c.tick(t + 0.005).mode is (Mode.ARMED if k < 30 else Mode.FAILSAFE), (k, c.reason)


def test_a_vehicle_resting_near_landed_height_lands():
    """On the floor at about landed_height (5 cm): its estimate reads 4 and 6 cm in turn, once 12 cm. Samples
    between landed_height and twice it neither count nor break the count; the one at 12 cm starts it again,
    but does not put the vehicle in the air (no new wait for a free fall from it: 0.16 s): it lands on the
    third below after it."""
    c, _ = armed_controller(at=(0.0, 0.0, 0.2))
    c.disarm(0.1)  # a descent without recovery, 0.2 m up: a free fall takes 0.2 s
    for k, z in enumerate([0.04, 0.06, 0.04, 0.06, 0.12, 0.04, 0.06, 0.04, 0.04]):
        t = 0.3 + 0.01 * k
        c.on_state(hover_state(t, z=z), t)
        assert c.tick(t).mode is (Mode.DISARMED if k == 8 else Mode.FAILSAFE), (k, c.reason)
    assert c.reason.endswith("landed: rotors cut, re-arm to fly"), c.reason


def test_glitches_that_keep_coming_are_a_failsafe_when_the_last_valid_state_goes_stale():
    """Every sample off by 1 m (a marker swapped for good, an estimator gone wrong): dropped while the last
    valid state is current; stale then, a failsafe descent from it."""
    c, _ = armed_controller()
    for k in range(1, 7):
        t = 0.01 * k
        if k < 6:
            assert c.on_state(hover_state(t, pos=[1.0, 0.0, 1.0]), t).startswith("implausible"), k
        cmd = c.tick(t)
        assert cmd.mode is (Mode.FAILSAFE if k == 6 else Mode.ARMED), (k, cmd.reason)
    assert cmd.reason.startswith("stale") and "controlled descent from 1.00 m" in cmd.reason, cmd.reason


def test_an_estimate_that_jumped_and_stays_is_believed_once_max_speed_covers_the_jump():
    """The estimate moves at once and stays there (a re-converged filter): dropped until 10 m/s over the time
    since the last valid state, plus max_jump (0.3 m), covers the jump. 0.5 m: believed 20 ms on, flown on
    at once. 1.2 m: the last valid state goes stale first (a failsafe descent from it); believed 90 ms on,
    and flown on again by a recovery, whose setpoint ramp starts where the estimate now puts the vehicle."""
    c, _ = armed_controller()
    assert c.tick(0.0).mode is Mode.ARMED
    assert c.on_state(hover_state(0.01, pos=[0.0, 0.5, 1.0]), 0.01).startswith("implausible: position")
    assert c.on_state(hover_state(0.02, pos=[0.0, 0.5, 1.0]), 0.02) is None
    assert c.tick(0.02).mode is Mode.ARMED and c.latest.pos[1] == 0.5
    c, _ = armed_controller()
    assert c.tick(0.0).mode is Mode.ARMED
    moved = [0.0, 1.2, 1.0]
    for k in range(1, 9):  # up to 80 ms after the last valid state: reach 1.1 m
        assert c.on_state(hover_state(0.01 * k, pos=moved), 0.01 * k).startswith("implausible: position"), k
        cmd = c.tick(0.01 * k)
        assert cmd.mode is (Mode.ARMED if k <= 5 else Mode.FAILSAFE) and c.latest.pos[1] == 0.0, (k, cmd.reason)
    assert cmd.reason.startswith("stale") and "controlled descent from 1.00 m" in cmd.reason, cmd.reason
    for k in range(9, 13):  # 90 ms on: reach 1.2 m; recover_count 3 more
        assert c.on_state(hover_state(0.01 * k, pos=moved), 0.01 * k) is None, k
        assert c.tick(0.01 * k).mode is (Mode.ARMED if k == 11 else Mode.FAILSAFE), (k, c.reason)
        if k == 11:
            break
    assert c.setpoint(0.11).tolist() == moved and c.status()["failsafe_count"] == 1


def test_a_time_that_is_not_finite_is_refused():
    """A NaN time would compare false with every limit: no state would ever be stale again."""
    c, _ = armed_controller()
    for call in (lambda: c.tick(math.nan), lambda: c.on_state(hover_state(0.01), math.inf), lambda: c.arm(math.nan),
                 lambda: c.on_state(hover_state(0.01), 0.01, age=math.nan)):
        with pytest.raises(ValueError, match="expected a finite time"):
            call()
    assert c.tick(0.1).mode is Mode.FAILSAFE and c.reason.startswith("stale"), c.reason


def test_fast_but_possible_motion_and_noise_are_not_taken_for_a_glitch():
    """A vehicle at 95 % of StateLimits.max_speed, turning at 95 % of max_rate about every body axis, with
    samples missing (up to stale_timeout between two) and one sample off by 0.25 m (max_jump 0.3 m):
    every sample is accepted. The same sample off by 0.4 m is not."""
    limits = StateLimits()
    speed, rate = 0.95 * limits.max_speed, 0.95 * limits.max_rate
    axis = np.ones(3) / math.sqrt(3.0)

    def sample(t: float, off: float = 0.0) -> State:
        half = 0.5 * rate * math.sqrt(3.0) * t  # rotation angle / 2 about the diagonal axis
        q = [math.cos(half), *(math.sin(half) * axis)]
        return make_state([-1.4 + speed * t + off, 0.0, 1.0], q, [speed, 0, 0], [rate] * 3, t)

    c = SafeController(FakePolicy(), SafetyConfig())
    times = [0.0, 0.01, 0.02, 0.07, 0.08, 0.13, 0.14, 0.15]  # 50 ms gaps
    for t in times:
        assert c.on_state(sample(t, off=0.25 if t == 0.08 else 0.0), t) is None, t
    flipped = sample(0.16)  # the same attitude as -q (a quaternion's sign is free)
    assert c.on_state(dataclasses.replace(flipped, quat=-flipped.quat), 0.16) is None
    # stamped 35 ms before the last valid state: dropped, as the state would go back in time with it
    assert c.on_state(sample(0.125), 0.17, age=0.045) == "out_of_order: taken 35 ms before the last valid state"
    assert c.latest.stamp == 0.16
    assert c.on_state(sample(0.17, off=0.4), 0.17).startswith("implausible: position"), c.reason


def test_arming_is_refused_for_a_vehicle_moving_or_turning_faster_than_the_training_started_from():
    """Carried, thrown, or spinning on the floor: outside the hover training's initial states (the limits are
    InitConfig's), refused with the figure; auto_arm waits with a reason that does not change with the figure,
    and arms once the vehicle is still. From a failsafe descent (in flight) arming does not check them."""
    init = InitConfig()
    d = SafetyConfig()
    assert (d.max_arm_tilt_deg, d.max_arm_speed, d.max_arm_rate) == (init.tilt_deg, init.vel, init.omega)
    moving = make_state([0, 0, 0], [1, 0, 0, 0], [0.0, -0.6, 0.0], [0, 0, 0], 0.0)
    turning = make_state([0, 0, 0], [1, 0, 0, 0], [0, 0, 0], [0.0, 0.0, 1.5], 0.0)
    for state, refusal in [(moving, "moving at 0.60 m/s (limit 0.5 m/s per axis)"),
                           (turning, "turning at 1.50 rad/s (limit 1 rad/s per axis)")]:
        c = SafeController(FakePolicy(), SafetyConfig())
        c.on_state(state, 0.0)
        ok, why = c.arm(0.0)
        assert not ok and why.startswith(f"refused to arm: {refusal}"), why
    c = SafeController(FakePolicy(), SafetyConfig(auto_arm=True))
    for k, v in enumerate([0.9, 0.7, 0.55]):
        c.on_state(make_state([0, 0, 0], [1, 0, 0, 0], [v, 0, 0], [0, 0, 0], 0.01 * k), 0.01 * k)
        assert c.tick(0.01 * k).mode is Mode.DISARMED
        assert c.reason == "auto_arm: moving faster than 0.5 m/s, arming once still", c.reason
    c.on_state(make_state([0, 0, 0], [1, 0, 0, 0], [0.1, 0, 0], [0, 0, 0], 0.03), 0.03)
    assert c.tick(0.03).mode is Mode.ARMED
    c, _ = armed_controller()
    assert c.tick(0.1).mode is Mode.FAILSAFE  # stale
    c.on_state(make_state([0, 0, 0.5], [1, 0, 0, 0], [0, 0, -2.0], [0, 0, 2.0], 0.1), 0.1)
    assert c.arm(0.1) == (True, "armed")
    wall = [0.0]  # auto_arm with a clock that went back three times and a moving vehicle: the clock's reason
    c = SafeController(FakePolicy(), SafetyConfig(auto_arm=True), wall=lambda: wall[0])
    for t in (1.0, 0.0, 1.0, 0.0, 1.0, 0.0):
        c.tick(t)
    c.on_state(make_state([0, 0, 0], [1, 0, 0, 0], [0.9, 0, 0], [0, 0, 0], 0.0), 0.0)
    assert c.tick(0.0).mode is Mode.DISARMED and c.reason.startswith("clock went back 3 times"), c.reason
    wall[0] = 3.0  # steady since: the vehicle's reason
    c.on_state(make_state([0, 0, 0], [1, 0, 0, 0], [0.9, 0, 0], [0, 0, 0], 0.01), 0.01)
    assert c.tick(0.01).mode is Mode.DISARMED and c.reason == "auto_arm: moving faster than 0.5 m/s, arming once still"


# ---------------------------------------------------------------------------------------------
# Crazyflie log conversion (no radio)


class WatchdogRig:
    """The policy node's steady-clock watchdog (sim time) alone, on a fake time.monotonic: ``run(t)`` is one
    watchdog run at t, ``clock(t)`` a /clock-driven tick at t; ``declared`` holds the times it failed safe."""

    def __init__(self, monkeypatch, clock_timeout: float, period: float = 0.01):
        import deploy.policy_node as pn

        self.t = 0.0
        monkeypatch.setattr(pn.time, "monotonic", lambda: self.t)
        n = object.__new__(pn.ControllerNode)
        n.clock_timeout, n.period, n.watchdog_ticks = clock_timeout, period, 0
        n._clock_seen_wall, n._watchdog_ran, n._running_since, n._clock_stopped = None, None, -math.inf, False
        self.declared: list[float] = []
        n.controller = type("C", (), {"on_state": lambda _, s, now, why: self.declared.append(self.t)})()
        n._now, n._tick, n._recorder_hold = (lambda: self.t), (lambda: None), None
        self.node = n

    def run(self, t: float) -> None:
        self.t = t
        self.node._watchdog()

    def clock(self, t: float) -> None:
        self.t = t
        self.node._clock_tick()


def test_the_watchdog_does_not_take_the_nodes_own_stall_for_a_stopped_clock(monkeypatch):
    """policy_node's watchdog (sim time): the node's own stall longer than clock_timeout, /clock heard again
    within a quarter of clock_timeout after it, is no failsafe; a /clock that stops is declared within a
    quarter of clock_timeout and a period after the later of its limit and the node's return, however often the
    node stalls meanwhile and however short clock_timeout is; a watchdog ticking for a stopped /clock goes on
    ticking across a stall."""
    P = 0.01
    w = WatchdogRig(monkeypatch, clock_timeout=0.5)
    for k in range(50):  # /clock and the watchdog every period
        w.clock(k * P)
        w.run(k * P + 0.005)
    w.run(1.5)  # the node stalled 1 s (no /clock heard, the watchdog late) ...
    w.clock(1.502)  # ... and the /clock that waited is taken right after
    for k in range(1, 50):
        w.clock(1.502 + k * P)
        w.run(1.505 + k * P)
    assert w.declared == [] and w.node.watchdog_ticks == 0

    w = WatchdogRig(monkeypatch, clock_timeout=0.5)
    w.clock(0.0)
    t = 0.0
    while t < 2.0 and not w.declared:  # /clock stopped at 0; the node stalls 0.2 s at every run
        t += 0.2
        w.run(t)
    assert w.declared and w.declared[0] <= 0.5 + 0.125 + 0.2 + 1e-9, w.declared
    t = w.declared[0]
    w.run(t + 0.3)  # a stall while failing safe: the ticks go on
    assert w.declared[-1] == t + 0.3

    for timeout in (0.02, 0.03, 0.04):  # a quarter of clock_timeout shorter than a period: every run looks late
        w = WatchdogRig(monkeypatch, clock_timeout=timeout)
        w.clock(0.0)
        k = 0
        while k < 100 and not w.declared:
            k += 1
            w.run(k * P)
        assert w.declared and w.declared[0] <= timeout + timeout / 4 + P + 1e-9, (timeout, w.declared)


def test_log_blocks_fit_one_radio_packet():
    for block, variables in LOG_BLOCKS.items():
        assert sum(LOG_TYPE_BYTES[t] for _, t in variables) <= MAX_LOG_BLOCK_BYTES, block


def log_pair(q_xyzw=(0.0, 0.0, 0.0, 1.0), gyro_dps=(9.0, -18.0, 4.5), pos=(0.5, -0.25, 1.0), vel=(0.1, 0.2, -0.3),
             onboard=(1, 0)):
    """One firmware tick's log blocks as cflib delivers them; ``onboard``: rlpolicy (mode, fault), the policy flying."""
    pose = {f"stateEstimate.{a}": v for a, v in zip("xyz", pos)}
    pose |= {f"stateEstimate.v{a}": v for a, v in zip("xyz", vel)}
    att = {f"stateEstimate.q{a}": v for a, v in zip("xyzw", q_xyzw)}
    att |= {f"gyro.{a}": v for a, v in zip("xyz", gyro_dps)}
    att |= {"rlpolicy.mode": onboard[0], "rlpolicy.fault": onboard[1]}
    return pose, att


def test_log_packets_become_si_state():
    s = math.sqrt(0.5)
    pose, att = log_pair(q_xyzw=(0.0, 0.0, s, s), gyro_dps=(90.0, -180.0, 45.0))
    st = state_from_log(pose, att, stamp=3.0)
    assert np.allclose(st.pos, [0.5, -0.25, 1.0]) and np.allclose(st.vel, [0.1, 0.2, -0.3])  # world, m, m/s
    assert np.allclose(st.quat, [s, 0.0, 0.0, s])  # (w, x, y, z) from the firmware's qx, qy, qz, qw
    assert np.allclose(st.omega, [math.pi / 2, -math.pi, math.pi / 4])  # deg/s -> rad/s


class FakeClock:
    """A ROS clock whose time (s) the test sets."""

    def __init__(self, t: float = 0.0):
        self.t = t

    def now(self):
        return type("Time", (), {"nanoseconds": int(round(self.t * 1e9))})()


def with_uplink(bridge, commander) -> None:
    """``bridge``'s setpoints go to ``commander`` through a real Uplink, and each actuation waits until the
    uplink has handed its setpoint on, so that the test sees every one (in the node a newer setpoint may
    replace one not yet taken)."""
    from deploy.crazyflie_bridge import CrazyflieBridge, Uplink

    bridge._uplink = Uplink(commander)

    def actuate(cmd, now):
        try:
            CrazyflieBridge.actuate(bridge, cmd, now)
        finally:
            assert bridge._uplink.flush(2.0)

    bridge.actuate = actuate


def fake_bridge(controller: SafeController, clock: FakeClock, connected: bool = True):
    """A CrazyflieBridge without ROS or radio: its odom subscription's callback, services and
    shutdown run on ``controller``; what it publishes as odom and sends to the vehicle is recorded."""
    from nav_msgs.msg import Odometry
    from std_msgs.msg import String

    from deploy.crazyflie_bridge import CrazyflieBridge, KalmanSettling
    from deploy.policy_node import Percentiles

    class Commander:
        def __init__(self):
            self.sent = []

        def send_position_setpoint(self, x, y, z, yaw):
            self.sent.append((time.monotonic(), z))

        def send_stop_setpoint(self):
            self.sent.append((time.monotonic(), "stop"))

    b = object.__new__(CrazyflieBridge)
    b.controller, b.stale_timeout = controller, controller.cfg.stale_timeout
    b.world_frame, b.robot, b._odom_msg = "world", "cf1", Odometry
    b._assembler, b._lock = StateAssembler(), threading.Lock()
    b.published = []
    b._odom_pub = type("Pub", (), {"publish": lambda self, msg: b.published.append(msg)})()
    b.get_clock = lambda: clock
    b._now = b._steady = lambda: clock.t
    b.rejected, b.accepted, b._state_received_at = {}, 0, None
    b._drop_log = LogLimiter(DROP_LOG_EVERY_S)
    # /status and rotor_cmd (the node's own _tick and _report_change publish them) are recorded too
    b.statuses, b.rotor_cmds = [], []
    b.status_pub = type("Pub", (), {"publish": lambda self, msg: b.statuses.append(json.loads(msg.data))})()
    b.cmd_pub = type("Pub", (), {"publish": lambda self, msg: b.rotor_cmds.append(list(msg.data))})()
    b._status_msg, b._to_rpm = String, lambda a: action_to_rpm(a, NOMINAL.rpm_max)
    b._last, b._ticks, b.watchdog_ticks, b._recorder_deadline = ("", ""), 0, 0, None
    b._actuate_log = LogLimiter(ACTUATION_LOG_EVERY_S)
    b.use_sim_time, b.older_state_ticks, b._recorder_hold = False, 0, None
    # rclpy's logger writes from C (a dead output pipe does not raise there): kept in a list here
    b.logged = []
    b.get_logger = lambda: type("Log", (), {k: staticmethod(b.logged.append) for k in ("info", "warning", "error")})()
    b.get_name = lambda: "crazyflie_bridge"
    b.latency, b.inference = Percentiles(), Percentiles()
    b.cf = type("Crazyflie", (), {"commander": Commander(), "close_link": lambda self: None})()
    with_uplink(b, b.cf.commander)
    b.connected, b._link, b.period, b.descent = connected, "test", 0.01, OnboardDescent(controller.cfg)
    b.uri, b.reconnect_s, b._opening_since, b._closing = "radio://0/80/2M/E7E7E7E7E7", 2.0, None, False
    b._unclosed_since, b._closer, b._close_reason = None, None, None
    b._link_lock, b._link_epoch = threading.Lock(), 0
    b._bad_samples, b._estimate_broken, b._last_odom = 0, None, None
    b._onboard, b._fallback_samples = None, 0
    b.settle_spread, b._settling = 0.0, KalmanSettling(0.0)  # (not checked: see its own test)
    controller.descent_profile = b.descent.profile  # as the bridge's own controller has it (ONBOARD_DESCENT)
    return b


def stream(bridge, fw_ms: int, arrival: float, subscribed: bool = True, **log) -> None:
    """One firmware tick's two log blocks, received at ``arrival`` (s), then (``subscribed``: the
    executor runs) the odom they make delivered to the bridge's own subscription."""
    pose, att = log_pair(**log)
    bridge.get_clock().t = arrival
    n = len(bridge.published)
    bridge._on_log(fw_ms, pose, type("Conf", (), {"name": "pose"})())
    bridge._on_log(fw_ms, att, type("Conf", (), {"name": "attitude"})())
    for msg in bridge.published[n:] if subscribed else ():
        bridge._on_odom(msg)


@pytest.mark.parametrize("onboard, why", [((2, 0), "a setpoint it cannot fly"), ((2, 1), "fault: dead-man")])
def test_the_stock_controller_flying_instead_of_the_onboard_policy_fails_safe_without_recovery(onboard, why):
    """rlpolicy.mode streamed as PID fallback while ARMED (the glue's latched fault, or position setpoints it
    cannot fly, as with the complementary estimator): ONBOARD_FALLBACK_SAMPLES in a row fail safe, fewer do
    not (samples from before the arming's first setpoint); the stock controller flies the descent setpoints;
    valid states do not hand the vehicle back (no recovery); a latched fault refuses arming."""
    from deploy.crazyflie_bridge import ONBOARD_FALLBACK_SAMPLES

    c = SafeController(FakePolicy(), SafetyConfig())
    clock = FakeClock(100.0)
    b = fake_bridge(c, clock)
    stream(b, 1000, 100.0, onboard=(0, 0))
    assert c.arm(100.0)[0] and b.arm_problem() is None
    for k in range(1, ONBOARD_FALLBACK_SAMPLES):  # fewer than ONBOARD_FALLBACK_SAMPLES, then the policy flies
        stream(b, 1000 + 10 * k, 100.0 + 0.01 * k, onboard=onboard)
        b.actuate(c.tick(clock.t), clock.t)
        assert c.mode is Mode.ARMED
    t = clock.t
    for k in range(1, 3 * ONBOARD_FALLBACK_SAMPLES):
        stream(b, 2000 + 10 * k, t + 0.01 * k, onboard=(1, 0) if k < 3 else onboard)
        cmd = c.tick(clock.t)
        b.actuate(cmd, clock.t)
        if k < 2 + ONBOARD_FALLBACK_SAMPLES:
            assert c.mode is Mode.ARMED, k
    assert c.mode is Mode.FAILSAFE and why in c.reason and "stock controller flies" in c.reason, c.reason
    z = [sp for _, sp in b.cf.commander.sent[-5:]]
    assert all(isinstance(v, float) for v in z) and z[-1] < 1.0  # descent setpoints, sinking
    for k in range(30):  # valid states at 1 m keep coming: no recovery (the tick's own decision)
        stream(b, 3000 + 10 * k, clock.t + 0.01, onboard=onboard)
        cmd = c.tick(clock.t)
        assert cmd.mode is Mode.FAILSAFE, cmd.reason
        b.actuate(cmd, clock.t)
    assert c.status()["recoveries"] == 0 and c.status()["failsafe_count"] == 1
    problem = b.policy_problem()  # arming refused (ControllerNode's arm service), for the fault or the PID flying
    assert problem is not None and b.arm_problem() == problem
    if onboard[1]:
        assert "latched fault (dead-man)" in problem
    else:
        assert "the stock controller flies" in problem


@pytest.mark.parametrize("bad, reason", [(dict(gyro_dps=(math.nan, 0, 0)), "nonfinite"),
                                         (dict(q_xyzw=(0.0, 0.0, 0.0, 0.5)), "out_of_range")])
def test_a_bad_onboard_estimate_is_published_rejected_by_the_odom_check_and_fails_safe(bad, reason):
    """The bridge publishes every sample; its odom subscription rejects a bad one, and the safety
    layer fails safe at the next tick although a good sample followed it within the period."""
    c = SafeController(FakePolicy(), SafetyConfig())
    b = fake_bridge(c, FakeClock(100.0))
    stream(b, 1000, 100.0)
    assert c.arm(100.0)[0] and c.tick(100.0).mode is Mode.ARMED
    stream(b, 1010, 100.01, **bad)
    stream(b, 1011, 100.011)  # a good one before the tick
    assert len(b.published) == 3 and b.rejected == {reason: 1} and b.accepted == 2
    cmd = c.tick(100.012)
    assert cmd.mode is Mode.FAILSAFE and cmd.reason.startswith(reason), cmd.reason
    # The onboard policy flies on that estimate: a descent setpoint would send it anywhere. One bad
    # sample (or two) is left to the failsafe: it descends as usual, whatever came after it ...
    b.actuate(cmd, 100.012)
    assert b.cf.commander.sent[-1][1] != "stop" and c.mode is Mode.FAILSAFE
    stream(b, 1020, 100.02, **bad)
    b.actuate(c.tick(100.021), 100.021)
    assert b.cf.commander.sent[-1][1] != "stop" and c.mode is Mode.FAILSAFE
    stream(b, 1030, 100.03, **bad)  # (two in a row)
    b.actuate(c.tick(100.031), 100.031)
    assert b.cf.commander.sent[-1][1] != "stop" and c.mode is Mode.FAILSAFE
    stream(b, 1035, 100.035, **bad)  # ... three in a row: the estimate is broken, the rotors are cut,
    stream(b, 1040, 100.04)  # also where a good sample came after them
    b.actuate(c.tick(100.041), 100.041)
    assert b.cf.commander.sent[-1][1] == "stop" and c.mode is Mode.DISARMED, b.cf.commander.sent[-3:]
    assert c.reason.startswith(f"onboard state estimate broken (3 samples in a row, the last: {reason}"), c.reason
    assert c.status()["failsafe_count"] == 2  # the failsafe and the cut, each counted
    for k in range(3):  # still broken on the ground, then good again: no latch left for the next flight
        stream(b, 1050 + k, 100.05 + 0.001 * k, **bad)
    assert b._estimate_broken is not None
    stream(b, 1060, 100.06)
    assert b._estimate_broken is None


@pytest.mark.parametrize("jump, dropped, failsafes", [(0.65, 3, 0), (1.5, 11, 1)])
def test_an_onboard_estimate_that_jumps_and_stays_is_flown_on_again_not_cut(jump, dropped, failsafes):
    """The real vehicle's onboard estimate moves and stays (a Lighthouse or UWB estimate re-converging): the
    onboard policy flies on it whatever this layer does, so cutting the rotors would turn a correction into
    a fall. Its samples are dropped as implausible (not counted as a broken estimate) until 10 m/s covers the
    jump: 0.65 m is then flown on at once; 1.5 m after the stale rule's failsafe (a descent setpoint) and a
    recovery."""
    c = SafeController(FakePolicy(), SafetyConfig())
    b = fake_bridge(c, FakeClock(100.0))
    stream(b, 1000, 100.0)
    assert c.arm(100.0)[0] and c.tick(100.0).mode is Mode.ARMED
    modes = []
    for k in range(1, 21):
        t = 100.0 + 0.01 * k
        stream(b, 1000 + 10 * k, t, pos=(0.5, -0.25 + jump, 1.0))
        cmd = c.tick(t + 0.001)
        b.actuate(cmd, t + 0.001)
        modes.append(cmd.mode)
    assert "stop" not in [z for _, z in b.cf.commander.sent] and b._estimate_broken is None
    assert (Mode.FAILSAFE in modes) == (failsafes > 0) and modes[-1] is Mode.ARMED, modes
    assert c.latest.pos[1] == pytest.approx(-0.25 + jump) and c.status()["failsafe_count"] == failsafes
    assert b.rejected == {"implausible": dropped}, b.rejected


def test_a_late_state_is_dropped_without_failing_safe_but_one_from_the_future_fails_safe():
    """A sample stamped more than stale_timeout ago (a radio retry burst) is counted and dropped: the
    fresh one after it keeps the policy flying; only the lack of a fresh state fails safe. A sample
    stamped ahead of the node's clock by more than stale_timeout is a clock fault and fails safe."""
    from nav_msgs.msg import Odometry

    from deploy.state import fill_odometry

    c = SafeController(FakePolicy(), SafetyConfig())
    clock = FakeClock(10.0)
    b = fake_bridge(c, clock)
    b._on_odom(fill_odometry(Odometry(), hover_state(10.0), "world", "cf1"))
    assert c.arm(10.0)[0] and c.tick(10.0).mode is Mode.ARMED
    clock.t = 10.01
    b._on_odom(fill_odometry(Odometry(), hover_state(9.94), "world", "cf1"))  # 70 ms old on arrival
    b._on_odom(fill_odometry(Odometry(), hover_state(10.009), "world", "cf1"))
    assert b.rejected == {"stale": 1} and c.tick(10.01).mode is Mode.ARMED
    clock.t = 10.02
    b._on_odom(fill_odometry(Odometry(), hover_state(10.08), "world", "cf1"))  # 60 ms ahead
    cmd = c.tick(10.02)
    assert b.rejected == {"stale": 2} and cmd.mode is Mode.FAILSAFE and "ahead of this node's clock" in cmd.reason
    c2 = SafeController(FakePolicy(), SafetyConfig())
    b2 = fake_bridge(c2, FakeClock(10.0))
    b2._on_odom(fill_odometry(Odometry(), hover_state(10.0), "world", "cf1"))
    assert c2.arm(10.0)[0]
    b2.get_clock().t = 10.06  # late samples alone: the last valid state goes stale
    b2._on_odom(fill_odometry(Odometry(), hover_state(10.0), "world", "cf1"))
    cmd = c2.tick(10.06)
    assert cmd.mode is Mode.FAILSAFE and cmd.reason.startswith("stale: last state 60 ms old"), cmd.reason


def test_log_samples_are_stamped_when_the_firmware_took_them():
    """A burst the radio delivers late keeps its age, so the stale check holds it back (stamped on
    receipt, three late samples in one burst ended a failsafe in one tick); a repeated or older sample
    is dropped; a firmware clock slower than the host's is followed."""
    from deploy.crazyflie_bridge import FirmwareClock

    c = SafeController(FakePolicy(), SafetyConfig())
    b = fake_bridge(c, FakeClock())
    for k in range(10):  # 10 ms apart, each 4-6 ms in transit
        stream(b, 5000 + 10 * k, 20.0 + 0.01 * k + (0.004 if k % 2 else 0.006))
    stamps = [stamp_seconds(m.header.stamp) for m in b.published]
    # the quickest delivery so far sets the offset: 6 ms for the first sample, 4 ms from the second on
    assert np.allclose(np.diff(stamps[1:]), 0.01, atol=1e-5) and stamps[-1] == pytest.approx(20.094, abs=1e-5)
    assert c.arm(20.1)[0] and c.tick(20.1).mode is Mode.ARMED
    assert c.tick(20.2).mode is Mode.FAILSAFE  # the link stalls for 0.3 s ...
    for k in range(10, 13):  # ... then delivers three old samples at once
        stream(b, 5000 + 10 * k, 20.4)
    assert b.rejected == {"stale": 3} and c.tick(20.4).mode is Mode.FAILSAFE
    stream(b, 5000 + 10 * 12, 20.41)  # the same sample again: dropped
    assert b.rejected == {"stale": 3, "out_of_order": 1}
    for k in range(40, 43):  # fresh samples again: the failsafe recovers on them
        stream(b, 5000 + 10 * k, 20.0 + 0.01 * k + 0.005)
        cmd = c.tick(20.0 + 0.01 * k + 0.006)
    assert cmd.mode is Mode.ARMED and cmd.reason.startswith("recovered"), cmd.reason
    fw = FirmwareClock()  # the firmware's crystal 50 ppm slow: an hour of samples, 5 ms in transit
    for k in range(0, 3_600_000, 1000):
        age = (k * 1.00005 * 1e-3 + 0.005) - fw.stamp(k, k * 1.00005 * 1e-3 + 0.005)
    assert 0.0 <= age < 0.005
    fw = FirmwareClock()  # the 24-bit timestamp wraps 4.66 h after boot: samples go on
    wrap = FirmwareClock.WRAP
    stamps = [fw.stamp(ms % wrap, 100.0 + 0.01 * k) for k, ms in enumerate(range(wrap - 20, wrap + 30, 10))]
    assert None not in stamps and np.allclose(np.diff(stamps), 0.01)
    assert fw.stamp((wrap + 10) % wrap, 100.1) is None  # an older one still is dropped
    c = SafeController(FakePolicy(), SafetyConfig())  # a step of the system clock (NTP) ages no sample
    clock = FakeClock(1000.0)
    b = fake_bridge(c, clock)
    steady = [50.0]
    b._steady = lambda: steady[0]
    for k in range(20):
        if k == 10:
            clock.t += 0.2  # the system clock steps 0.2 s ahead; the steady clock does not
        stream(b, 10 * k, clock.t)
        assert c.state_problem(clock.t) is None, k
        clock.t, steady[0] = clock.t + 0.01, steady[0] + 0.01


def test_without_a_radio_link_the_bridge_refuses_to_arm_and_says_a_stop_was_not_delivered():
    c = SafeController(FakePolicy(), SafetyConfig())
    b = fake_bridge(c, FakeClock(), connected=False)
    c.on_state(hover_state(), 0.0)
    request = type("Request", (), {"data": True})()
    response = b._on_arm(request, type("Response", (), {})())
    assert not response.success and "no radio link" in response.message and c.mode is Mode.DISARMED
    b.connected = True
    assert b._on_arm(request, type("Response", (), {})()).success and c.mode is Mode.ARMED
    b.connected, b._link = False, "link to radio://0 lost: timeout"
    response = b._on_estop(None, type("Response", (), {})())
    assert not response.success and "NOT delivered: no radio link (link to radio://0 lost" in response.message
    assert c.mode is Mode.ESTOP  # the safety layer took it all the same
    request.data = False
    assert not b._on_arm(request, type("Response", (), {})()).success


def test_a_lost_radio_link_is_opened_again_with_new_log_blocks_and_arms_nothing(monkeypatch):
    """After the link is lost, the bridge's timer opens it again: one attempt at a time, only once cflib
    has marked the last link closed (it reports a failure before it does), again after a failed attempt,
    and after closing one that hung for OPEN_TIMEOUT_S. Each link gets new log blocks, wired to the
    bridge and started (cflib marks a block added to its link; the firmware forgets its blocks), and a
    new assembler (the firmware clock may have restarted). The new link arms nothing: the safety layer,
    failed safe and landed on the missing states meanwhile, stays disarmed on valid states. A set-up that
    finishes on a dead link is ignored; after close() no attempt."""
    from cflib.crazyflie import State
    from cflib.crazyflie.log import LogConfig

    from deploy.crazyflie_bridge import OPEN_TIMEOUT_S

    c, _ = armed_controller(at=(0.5, -0.25, 1.0))  # where log_pair's states are
    clock = FakeClock()
    b = fake_bridge(c, clock)
    b.settle_spread = 1e-3  # the default: the variance block is asked for too
    cf = b.cf
    cf.state, cf.link = State.CONNECTED, object()  # cflib 0.1.34 never sets SETUP_FINISHED
    opened, added, started, closed = [], [], [], []

    def open_link(uri):  # cflib: INITIALIZED at once, connected or a failure callback later
        opened.append(uri)
        cf.state = State.INITIALIZED

    def close_link():  # cflib: the link closed, then its disconnected callback
        closed.append(clock.t)
        cf.state, cf.link = State.DISCONNECTED, None
        b._on_disconnected(b.uri)

    def link_error(*callbacks: str) -> None:  # cflib's order: link dropped, callbacks, then DISCONNECTED
        cf.link = None
        for what in callbacks:  # ("disconnected": cflib's disconnected callback)
            b._on_disconnected(b.uri) if what == "disconnected" else b._on_link(what)
            b._retry_link()  # the timer firing in between: cflib is not done with the link
        assert len(opened) == attempts
        cf.state = State.DISCONNECTED

    cf.open_link, cf.close_link = open_link, close_link
    cf.log = type("Log", (), {"add_config": lambda self, conf: added.append(conf)})()
    monkeypatch.setattr(LogConfig, "start", lambda conf: started.append(conf))

    stream(b, 1000, 0.0)
    assert c.tick(0.0).mode is Mode.ARMED
    attempts = 0
    link_error("disconnected", f"link to {b.uri} lost: Too many packets lost")
    assert "reconnecting every 2 s" in b.link_problem()
    clock.t = 0.5
    assert c.tick(0.5).mode is Mode.FAILSAFE  # no state since the loss
    b._retry_link()
    b._retry_link()  # the first attempt is still under way: no second one
    attempts = 1
    assert opened == [b.uri]
    link_error(f"connection to {b.uri} failed: Too many packets lost")
    b._retry_link()
    attempts = 2
    assert len(opened) == 2

    clock.t = 0.5 + OPEN_TIMEOUT_S - 0.01  # an attempt that neither connects nor fails ...
    b._retry_link()
    assert not closed and len(opened) == 2
    clock.t = 0.5 + OPEN_TIMEOUT_S
    b._retry_link()  # ... is closed after OPEN_TIMEOUT_S (in a thread of its own),
    b._closer.join(2.0)
    assert closed == [clock.t] and "timed out" in b._link
    b._retry_link()  # and made again
    attempts = 3
    assert len(opened) == 3
    assert c.tick(clock.t).mode is Mode.DISARMED  # the failsafe has landed on its timer meanwhile

    cf.link, cf.state = object(), State.CONNECTED
    assembler, settling = b._assembler, b._settling
    b._on_connected(b.uri)
    assert b.connected and b.link_problem() is None and b._assembler is not assembler
    assert b._settling is not settling  # the Kalman filter's settling is judged anew on each link
    assert [conf.name for conf in added] == list(LOG_BLOCKS) and started == added
    assert [v.name for conf in added for v in conf.variables] == [n for vs in LOG_BLOCKS.values() for n, _ in vs]
    assert all(conf.data_received_cb.callbacks == [b._on_log] for conf in added)
    assert [conf.period_in_ms for conf in added] == [10, 10, 500]  # the state's two blocks, the variances
    b._retry_link()
    assert len(opened) == 3  # connected: nothing to do
    t0 = clock.t
    for k in range(10):  # valid states on the new link
        stream(b, 20000 + 10 * k, t0 + 0.01 * k)
    assert c.tick(clock.t).mode is Mode.DISARMED and c.state_problem(clock.t) is None

    link_error("disconnected", f"link to {b.uri} lost: Too many packets lost")
    b._retry_link()
    attempts = 4
    b._on_connected(b.uri)  # a set-up that finished as its link died (cf.link None): ignored
    assert not b.connected and len(added) == len(LOG_BLOCKS)
    cf.link, cf.state = object(), State.CONNECTED
    b._on_connected(b.uri)
    n = len(LOG_BLOCKS)
    assert b.connected and len(added) == 2 * n and not set(map(id, added[:n])) & set(map(id, added[n:]))

    link_error("disconnected", f"link to {b.uri} lost: Too many packets lost")
    b.close()  # shut down while the link is down
    b._retry_link()
    assert len(opened) == 4
    b.reconnect_s = 0.0
    assert b.link_problem().endswith("restart the bridge")


@pytest.mark.parametrize("failure", ["variable missing", "variance missing", "block refused"])
def test_log_blocks_that_fail_are_reported_and_the_link_made_again(failure, monkeypatch):
    """Firmware without a variable of LOG_BLOCKS (cflib's add_config raises KeyError, in cflib's thread that
    only logs it), or one that refuses a block (its error callback): no state would ever come. The bridge
    says why in /status instead of "not connected yet", and its timer closes that link and opens another.
    A block that cannot be added leaves none streaming (all are added before any starts); without the
    Kalman filter's variances the message names estimator_settle_spread=0, with which that block is not
    asked for at all."""
    from cflib.crazyflie import State
    from cflib.crazyflie.log import LogConfig

    from deploy.crazyflie_bridge import KalmanSettling

    c = SafeController(FakePolicy(), SafetyConfig())
    b = fake_bridge(c, FakeClock(), connected=False)
    if failure == "variance missing":  # the check on: the variance block is asked for
        b.settle_spread, b._settling = 1e-3, KalmanSettling(1e-3)
    cf = b.cf
    cf.state, cf.link = State.CONNECTED, object()  # cflib 0.1.34 never sets SETUP_FINISHED
    opened, closed, added, started = [], [], [], []

    def add_config(conf):
        if failure == "variable missing" and conf.name == "attitude":
            raise KeyError("Variable stateEstimate.qx not in TOC")
        if failure == "variance missing" and conf.name == "variance":
            raise KeyError("Variable kalman.varPX not in TOC")
        added.append(conf)

    def close_link():  # cflib: the link closed, then its disconnected callback
        closed.append(True)
        cf.state, cf.link = State.DISCONNECTED, None
        b._on_disconnected(b.uri)

    cf.log = type("Log", (), {"add_config": lambda self, conf: add_config(conf)})()
    cf.open_link, cf.close_link = (lambda uri: opened.append(uri)), close_link
    monkeypatch.setattr(LogConfig, "start", lambda conf: started.append(conf.name))
    b._on_connected(b.uri)
    if failure == "block refused":
        assert b.connected and started == ["pose", "attitude"]  # (the variances not checked: not asked for)
        added[0].error_cb.call(added[0], "No memory to allocate Log block")  # cflib's thread
        want = "the Crazyflie refused the log block 'pose': No memory to allocate Log block"
    else:
        missing = "stateEstimate.qx" if failure == "variable missing" else "kalman.varPX"
        want = f"the log blocks could not be set up on {b.uri}: 'Variable {missing} not in TOC'"
        assert started == [] and "estimator_settle_spread=0" in b.link_problem()
    assert not b.connected and want in b.link_problem(), b.link_problem()
    b._retry_link()  # the timer: closes the link it gave up on, keeps the reason ...
    b._closer.join(2.0)
    assert closed == [True] and not opened and want in b.link_problem()
    b._retry_link()  # ... and opens a new one
    assert opened == [b.uri] and want in b.link_problem()


def test_a_close_that_blocks_does_not_block_the_timer_or_the_ticks(monkeypatch):
    """cflib's close_link blocks behind a send that its radio thread retries (a link given up on still takes
    stop setpoints; with a Crazyradio unplugged, for good). The timer starts the close and returns: the safety
    layer ticks on, no new link is opened while the old one is not closed (the status says so), and once the
    close returns the next timer call opens one. A shutdown meanwhile waits for that same close, bounded by
    CLOSE_LINK_S, instead of starting a second one."""
    from cflib.crazyflie import State
    from cflib.crazyflie.log import LogConfig

    from deploy.crazyflie_bridge import CLOSE_LINK_S, OPEN_TIMEOUT_S

    c, _ = armed_controller()
    clock = FakeClock()
    b = fake_bridge(c, clock, connected=False)
    cf = b.cf
    release, entered, opened, closes = threading.Event(), threading.Event(), [], []

    def close_link():  # cflib: waits for the blocked send's lock, then the link closed and its callback
        closes.append(clock.t)
        entered.set()
        release.wait(10.0)
        cf.state, cf.link = State.DISCONNECTED, None
        b._on_disconnected(b.uri)

    cf.open_link, cf.close_link = (lambda uri: opened.append(uri)), close_link
    cf.log = type("Log", (), {"add_config": lambda self, conf: None})()
    monkeypatch.setattr(LogConfig, "start", lambda conf: None)
    cf.state, cf.link = State.INITIALIZED, object()
    b._opening_since = 0.0  # an attempt that hangs ...
    clock.t = OPEN_TIMEOUT_S
    start = time.monotonic()
    b._retry_link()  # ... is closed: the timer does not wait for it (the close blocks for 10 s)
    assert time.monotonic() - start < 0.5 and entered.wait(2.0)
    assert c.tick(clock.t).mode is Mode.FAILSAFE  # the ticks go on (no state: the failsafe)
    for k in range(3):
        clock.t = OPEN_TIMEOUT_S + 2.0 * (k + 1)
        b._retry_link()
    assert opened == [] and closes == [OPEN_TIMEOUT_S]
    problem = b.link_problem()
    assert "timed out" in problem and "has not closed yet" in problem, problem
    b._on_connected(b.uri)  # the hung set-up finishing while its link is being closed: ignored
    assert not b.connected
    b._on_link(f"link to {b.uri} lost: Crazyradio unplugged")  # a failure meanwhile is not masked by the reason
    assert any("Crazyradio unplugged" in line for line in b.logged), b.logged

    release.set()  # the close returns, with cflib's "disconnected": the status keeps why it was closed
    b._closer.join(2.0)
    assert "timed out" in b._link and "has not closed yet" not in b.link_problem()
    b._retry_link()
    assert opened == [b.uri]

    release.clear()  # the new attempt hangs too, and the bridge is stopped while its close is blocked
    entered.clear()
    clock.t += OPEN_TIMEOUT_S
    b._retry_link()
    assert entered.wait(2.0)
    closer = b._closer
    start = time.monotonic()
    b.close()
    assert time.monotonic() - start < CLOSE_LINK_S + 0.5 and len(closes) == 2  # the same close (blocked 10 s), waited for
    assert any("did not close within" in line for line in b.logged), b.logged
    release.set()
    closer.join(2.0)
    assert not closer.is_alive()


@pytest.mark.parametrize("meanwhile", ["the timer's close", "a link error"])
def test_a_link_that_ends_during_its_set_up_is_not_counted_connected(meanwhile, monkeypatch):
    """cflib's thread sets a link up (log blocks added, then started) while the link ends: the timer, finding
    the attempt OPEN_TIMEOUT_S old, closes it, or cflib's radio thread reports a link error; and that is over
    before the set-up is. The link is not counted connected (the timer would never open another), the
    status says why it ended, and the next timer call opens a new link."""
    from cflib.crazyflie import State
    from cflib.crazyflie.log import LogConfig

    from deploy.crazyflie_bridge import OPEN_TIMEOUT_S

    c, _ = armed_controller()
    clock = FakeClock()
    b = fake_bridge(c, clock, connected=False)
    cf = b.cf
    opened, ended = [], []

    def close_link():  # cflib: the link closed, then its disconnected callback
        cf.state, cf.link = State.DISCONNECTED, None
        b._on_disconnected(b.uri)

    def add_config(conf):
        if ended:
            return
        ended.append(meanwhile)
        if meanwhile == "the timer's close":  # its close returns before the set-up does
            clock.t = OPEN_TIMEOUT_S
            b._retry_link()
            b._closer.join(2.0)
            assert not b._closer.is_alive()
        else:  # cflib's _link_error_cb: link dropped, disconnected and connection_lost, then DISCONNECTED
            cf.link = None
            b._on_disconnected(b.uri)
            b._on_link(f"link to {b.uri} lost: Too many packets lost")
            cf.state = State.DISCONNECTED

    cf.open_link, cf.close_link = opened.append, close_link
    cf.log = type("Log", (), {"add_config": lambda self, conf: add_config(conf)})()
    monkeypatch.setattr(LogConfig, "start", lambda conf: None)
    cf.state, cf.link = State.CONNECTED, object()
    b._opening_since = 0.0
    b._on_connected(b.uri)
    why = "timed out" if meanwhile == "the timer's close" else "Too many packets lost"
    assert ended and not b.connected and why in b._link, (b.connected, b._link)
    clock.t += b.reconnect_s
    b._retry_link()
    assert opened == [b.uri]


def test_the_shutdowns_own_close_logs_no_disconnection():
    """cflib calls its disconnected callback from the shutdown's close_link, which may return after the
    node's summary line: the bridge does not log that disconnection as a link problem."""
    c = SafeController(FakePolicy(), SafetyConfig())  # disarmed: no descent first
    b = fake_bridge(c, FakeClock())
    b.cf.close_link = lambda: b._on_disconnected(b.uri)
    b.close()
    assert not any("disconnected from" in line for line in b.logged), b.logged
    assert not b.connected

    def fails():
        raise OSError("USB error")

    b = fake_bridge(c, FakeClock())
    b.cf.close_link = fails  # a close that raises is logged, not left to the thread's stderr
    b.close()
    assert any("closing the radio link failed: OSError: USB error" in line for line in b.logged), b.logged


def test_a_link_that_failed_to_open_is_opened_again_and_reported_in_one_line():
    """An open that fails inside cflib's open_link (no link driver: the dongle busy with another program,
    unplugged, a USB error) leaves cflib INITIALIZED with no link, never DISCONNECTED, and reports a
    traceback. The bridge used to wait for DISCONNECTED for ever while /status said "reconnecting"; it now
    opens again at the timer once UNCLOSED_S has passed since the failure without the link closed, and
    reports what cflib said before the traceback, as one line."""
    from cflib.crazyflie import State

    from deploy.crazyflie_bridge import UNCLOSED_S

    c = SafeController(FakePolicy(), SafetyConfig())
    clock = FakeClock()
    b = fake_bridge(c, clock, connected=False)
    cf, opened = b.cf, []

    def open_link(uri):  # cflib's open_link when get_link_driver raises (checked against cflib 0.1.x)
        opened.append(clock.t)
        cf.state, cf.link = State.INITIALIZED, None
        b._on_link(f"connection to {uri} failed: Couldn't load link driver: Cannot find a Crazyradio Dongle\n\n"
                   "Traceback (most recent call last):\n  File \"crazyflie/__init__.py\", line 250, in open_link\n")

    cf.open_link = open_link
    b._open_link()
    assert opened == [0.0]
    assert b.link_problem() == (f"no radio link (connection to {b.uri} failed: Couldn't load link driver: Cannot "
                                "find a Crazyradio Dongle); reconnecting every 2 s")
    assert b.logged == [f"connecting to {b.uri}", b._link]  # one line, not the traceback
    clock.t = UNCLOSED_S - 0.01  # too soon to tell from a link cflib is still closing
    b._retry_link()
    assert opened == [0.0]
    for k in range(1, 4):  # every timer period, as long as the dongle is missing
        clock.t = 2.0 * k
        b._retry_link()
    assert opened == [0.0, 2.0, 4.0, 6.0]
    assert b.logged.count(b._link) == 1  # the same failure again is not logged again
    # a driver's message: its lines before the traceback, joined
    b._on_link("link to radio://0 lost: Error communicating with crazy radio ,it has probably been unplugged!\n"
               "Exception:[Errno 19] No such device\n\nTraceback (most recent call last):\n  File \"x.py\"")
    assert b._link == ("link to radio://0 lost: Error communicating with crazy radio ,it has probably been "
                       "unplugged!; Exception:[Errno 19] No such device")


def test_blocks_pair_by_firmware_timestamp():
    from nav_msgs.msg import Odometry

    a = StateAssembler()
    pose, att = log_pair()
    assert a.feed("pose", 1000, pose, 1.0) is None
    assert a.feed("attitude", 1020, att, 1.0) is None  # 20 ms apart: different firmware ticks
    st = a.feed("pose", 1020, pose, 1.02)
    assert st is not None and st.stamp == 1.02
    back = state_from_odometry(fill_odometry(Odometry(), st, "world", "cf1"))
    assert np.allclose(back.vel, st.vel)


class _DeadPipe:
    """stdout after the launch runner died: every write raises, as a closed pipe's does."""

    def write(self, _text):
        raise BrokenPipeError(32, "Broken pipe")

    def flush(self):
        raise BrokenPipeError(32, "Broken pipe")


@pytest.mark.parametrize("output", ["open", "runner died"])
def test_stopping_the_bridge_in_flight_descends_before_the_motors_stop(output, monkeypatch):
    """Ctrl-C with the vehicle at 1 m and no state arriving after it: close() streams setpoints that sink
    along the failsafe profile to the floor over the fall time and hold it there while the onboard descent
    catches up, and only then the stop setpoint, repeated for STOP_REPEAT_S before the link closes (cflib drops
    what is still queued then); also where the launch runner died and took the output pipe with it (the
    summary line raised first and skipped the descent and the stop)."""
    from deploy.crazyflie_bridge import STOP_REPEAT_S

    c, _ = armed_controller()
    b = fake_bridge(c, FakeClock())
    closed = []
    b.cf.close_link = lambda: closed.append(len(b.cf.commander.sent))  # closed after how many packets
    b._now = time.monotonic
    c.on_state(hover_state(t=time.monotonic()), time.monotonic())
    if output == "open":
        b.close()
    else:
        monkeypatch.setattr(sys, "stdout", _DeadPipe())
        with pytest.raises(BrokenPipeError):
            b.close()
    sent = b.cf.commander.sent
    assert closed == [len(sent)]
    first_stop = next(i for i, (_, z) in enumerate(sent) if z == "stop")
    stops = sent[first_stop:]
    repeats = round(STOP_REPEAT_S / b.period)  # (after the descent's own stop, its last tick's)
    assert all(z == "stop" for _, z in stops) and len(stops) >= repeats
    assert stops[-1][0] - stops[-repeats][0] >= (repeats - 1) * b.period
    heights = [z for _, z in sent[:first_stop]]
    profile = DescentProfile.onboard(c.cfg)
    fall = profile.fall_time(1.0, 0.0)  # (2.09 s: sinking, braking, then at the touchdown speed)
    timer = fall + profile.settle_s
    assert heights[0] > 0.99 and heights[-1] == 0.0 and all(a >= b for a, b in zip(heights, heights[1:]))
    floor_from = next(t for t, z in sent if z == 0.0) - sent[0][0]
    assert fall - 0.05 <= floor_from <= fall + 0.1 and timer - 0.05 <= sent[first_stop][0] - sent[0][0] <= timer + 0.2
    assert all(z == "stop" for _, z in sent[first_stop:]) and c.mode is Mode.DISARMED
    # The landing is on the record as a flight is: /status on each change (the disarm's descent, then the
    # rotors off) and every 10th tick, and the shadow rotor command of each period
    changes = [(st["mode"], st["reason"]) for st in b.statuses]
    changes = [m for i, m in enumerate(changes) if i == 0 or m != changes[i - 1]]
    assert [m for m, _ in changes] == [Mode.FAILSAFE.value, Mode.DISARMED.value] and "disarm requested" in changes[0][1], changes
    assert len(b.statuses) >= first_stop // STATUS_EVERY and b._ticks == len(b.rotor_cmds) == first_stop + 1
    descent_rpm = action_to_rpm(np.full(4, c.descent_action), NOMINAL.rpm_max)
    assert np.allclose(b.rotor_cmds[0], descent_rpm) and np.allclose(b.rotor_cmds[-1], 0.0)


def test_stopping_the_bridge_in_flight_lands_on_the_states_that_still_arrive(monkeypatch):
    """Ctrl-C at 1 m with the onboard estimate still streaming (the executor has stopped): the descent
    feeds the newest state to the safety layer itself, so the stop follows the states on the floor
    (LANDED_SAMPLES in a row), not a timer: here a vehicle that reaches the floor 0.6 s after its setpoint
    (more than the onboard policy lagged it in the simulator) is on the floor when the stop is sent, and the
    descent ends before the no-state timer."""
    import deploy.crazyflie_bridge as bridge_module

    c = SafeController(FakePolicy(), SafetyConfig())
    clock = FakeClock(100.0)
    b = fake_bridge(c, clock)
    b._now = b._steady = lambda: clock.t
    stream(b, 1000, 100.0, pos=(0.0, 0.0, 1.0), vel=(0.0, 0.0, 0.0))
    assert c.arm(100.0)[0] and c.tick(100.0).mode is Mode.ARMED
    heights, profile = [], DescentProfile.onboard(c.cfg)

    def sleep(period):  # a period passes; the vehicle sends its estimate: 0.6 s behind the setpoint
        clock.t += period
        t = clock.t - 100.0
        z = profile.z(1.0, 0.0, max(t - 0.6, 0.0), 0.0)
        vz = (profile.z(1.0, 0.0, max(t - 0.6, 0.0) + 1e-4, 0.0) - z) / 1e-4
        heights.append(z)
        stream(b, 1000 + round(t * 1000), clock.t, subscribed=False, pos=(0.0, 0.0, z), vel=(0.0, 0.0, vz))

    monkeypatch.setattr(bridge_module.time, "sleep", sleep)
    b.close()
    sent = b.cf.commander.sent
    stop = next(i for i, (_, z) in enumerate(sent) if z == "stop")
    fall = profile.fall_time(1.0, 0.0)
    assert c.mode is Mode.DISARMED and "landed" in c.reason, c.reason
    # the stop follows LANDED_SAMPLES states on the floor, and one more period at most (a free fall from the
    # last state 10 cm up, at its velocity: 0.12 s; the first state on the floor came 0.2 s after it)
    on_floor = next(i for i, h in enumerate(heights) if h < c.cfg.landed_height)
    assert LANDED_SAMPLES <= stop - on_floor <= LANDED_SAMPLES + 1, (stop - on_floor, heights[on_floor - 5:stop])
    assert fall + 0.6 - 0.05 <= clock.t - 100.0 < fall + profile.settle_s
    assert b.statuses[-1]["mode"] == Mode.DISARMED.value and "landed" in b.statuses[-1]["reason"]


def test_stopping_the_bridge_ends_a_descent_that_outlasts_the_landing_limit_disarmed(monkeypatch):
    """Ctrl-C at 1 m, the vehicle stuck above the floor (states keep coming, the descent never ends): at
    LANDING_LIMIT_S the rotors are cut, the stop setpoint sent, and /status says so (DISARMED, not a
    FAILSAFE the vehicle is no longer flying)."""
    import deploy.crazyflie_bridge as bridge_module

    c = SafeController(FakePolicy(), SafetyConfig())
    clock = FakeClock(100.0)
    b = fake_bridge(c, clock)
    stream(b, 1000, 100.0, pos=(0.0, 0.0, 1.0), vel=(0.0, 0.0, 0.0))
    assert c.arm(100.0)[0] and c.tick(100.0).mode is Mode.ARMED
    start = time.monotonic()
    monkeypatch.setattr(bridge_module, "LANDING_LIMIT_S", 0.3)
    wait = time.sleep

    def sleep(period):  # a period passes; the vehicle stays at 0.8 m
        clock.t += period
        stream(b, 1000 + round((clock.t - 100.0) * 1000), clock.t, subscribed=False, pos=(0.0, 0.0, 0.8),
               vel=(0.0, 0.0, 0.0))
        wait(period)

    monkeypatch.setattr(bridge_module.time, "sleep", sleep)
    b.close()
    assert 0.3 <= time.monotonic() - start < 1.0 and b.cf.commander.sent[-1][1] == "stop"
    assert c.mode is Mode.DISARMED and c.reason.startswith("shutdown: not landed within 0.3 s"), c.reason
    assert b.statuses[-1]["mode"] == Mode.DISARMED.value and b.statuses[-1]["reason"] == c.reason


class BlockingCommander:
    """A cflib commander whose sends block until ``release`` is set, as cflib's do while its radio thread
    retries a lost packet; what it sends is recorded as (time.monotonic(), z or "stop")."""

    def __init__(self):
        self.sent, self.release = [], threading.Event()

    @staticmethod
    def wait_until_sending(uplink) -> None:
        """Until ``uplink``'s thread is inside a send (blocked here), at most 2 s."""
        deadline = time.monotonic() + 2.0
        while uplink._sending_since is None and time.monotonic() < deadline:
            time.sleep(0.001)

    def send_position_setpoint(self, x, y, z, yaw):
        self.release.wait(10.0)
        self.sent.append((time.monotonic(), z))

    def send_stop_setpoint(self):
        self.release.wait(10.0)
        self.sent.append((time.monotonic(), "stop"))


def test_a_radio_that_takes_no_setpoint_blocks_neither_the_ticks_nor_the_services():
    """cflib's send blocks (its radio thread retrying a lost packet): the bridge's actuation returns at once;
    once a send has been blocked for UPLINK_STALL_S the link is a problem (arming refused, a stop "NOT
    delivered", /status says why); when the radio takes packets again only the newest setpoint follows the
    blocked one (setpoints computed during the stall are stale), and the link is no problem any more."""
    from deploy.crazyflie_bridge import UPLINK_STALL_S, CrazyflieBridge, Uplink

    c, _ = armed_controller()
    b = fake_bridge(c, FakeClock())
    radio = BlockingCommander()
    b._uplink = Uplink(radio)
    b.actuate = CrazyflieBridge.actuate.__get__(b)  # the node's own: nothing waits for the uplink
    for k in range(20):
        c.on_state(hover_state(0.01 * k), 0.01 * k)
        t0 = time.monotonic()
        b.actuate(c.tick(0.01 * k), 0.01 * k)
        assert time.monotonic() - t0 < 0.5  # (the send blocks for up to 10 s)
        if k == 0:
            radio.wait_until_sending(b._uplink)  # the first setpoint's send under way before the next comes
    assert b.link_problem() is None or b._uplink.blocked_for() >= UPLINK_STALL_S
    deadline = time.monotonic() + 2.0
    while b._uplink.blocked_for() < UPLINK_STALL_S and time.monotonic() < deadline:
        time.sleep(0.005)
    problem = b.link_problem()
    assert problem is not None and "has not taken a setpoint" in problem and "18 setpoints replaced" in problem, problem
    # the same problem refuses arming (its stall time read again, later: 0.10 s became 0.11 s between the calls)
    assert re.sub(r"for \d+\.\d+ s", "for <t> s", b.arm_problem() or "") == re.sub(r"for \d+\.\d+ s", "for <t> s", problem)
    response = b._on_estop(None, type("Response", (), {})())  # the service answers (and ticks) at once
    assert not response.success and "NOT delivered" in response.message and c.mode is Mode.ESTOP
    assert radio.sent == []
    radio.release.set()
    assert b._uplink.flush(2.0) and b.link_problem() is None
    assert [z for _, z in radio.sent] == [1.0, "stop"]  # the first setpoint, then the newest: the estop's


def test_arming_waits_until_the_onboard_kalman_filter_has_settled():
    """The variance block (kalman.varPX/PY/PZ every 500 ms): arming is refused until SETTLE_SAMPLES samples
    have come and each variance spread by less than estimator_settle_spread over them, again while one
    jumps (the vehicle moved, a reset) or is not finite; 0 checks nothing. (Each link starts it anew:
    test_a_lost_radio_link_is_opened_again_with_new_log_blocks_and_arms_nothing.)"""
    from deploy.crazyflie_bridge import SETTLE_SAMPLES, KalmanSettling

    c = SafeController(FakePolicy(), SafetyConfig())
    b = fake_bridge(c, FakeClock())
    b.settle_spread, b._settling = 1e-3, KalmanSettling(1e-3)
    c.on_state(hover_state(pos=[0.0, 0.0, 0.0]), 0.0)
    request = type("Request", (), {"data": True})()

    steady = [0.0]  # the steady clock of log arrivals (the controller's stays at 0: its state stays fresh)
    b._steady = lambda: steady[0]

    def variance(x, y=1e-4, z=1e-5):  # a sample every 500 ms
        steady[0] += 0.5
        b._on_log(0, {"kalman.varPX": x, "kalman.varPY": y, "kalman.varPZ": z}, type("Conf", (), {"name": "variance"})())

    def refusal():
        response = b._on_arm(request, type("Response", (), {})())
        assert c.mode is Mode.DISARMED or response.success
        return None if response.success else response.message

    for k in range(SETTLE_SAMPLES):  # falling from 0.1 to 0.019 m^2: too few samples at first, then not settled
        assert "Kalman filter has not settled" in refusal()
        variance(0.1 - 0.009 * k)
    assert "spread by 0.081, 0, 0 m^2" in refusal()
    for _ in range(SETTLE_SAMPLES - 1):
        variance(2e-4)
    assert "spread by 0.019, 0, 0 m^2" in refusal()  # the last of the falling ones is still in the window
    variance(2e-4)
    assert refusal() is None and c.mode is Mode.ARMED
    c.disarm(0.0)
    c.tick(0.0)
    variance(0.05)  # a jump (the estimator reset, the vehicle moved): not settled again for 10 samples
    assert "spread by 0.05, 0, 0 m^2" in refusal()
    for _ in range(SETTLE_SAMPLES):
        variance(3e-4)
    assert refusal() is None
    c.disarm(0.0)
    c.tick(0.0)
    steady[0] += 1.6  # the samples stopped (the link up): the last verdict is not kept
    assert "no variance sample of the onboard Kalman filter for 1.6 s" in refusal()
    variance(float("nan"))
    assert "nan" in refusal()
    b._settling = KalmanSettling(0.0)
    assert refusal() is None


def test_a_setpoint_waiting_when_the_link_is_lost_is_not_sent_on_the_next_link():
    """cflib reports the link lost while a send is blocked and a newer setpoint waits: that one is dropped
    (it was computed for the old link; a new link's first tick sends a fresh one), and so is one posted for
    the old link after the loss (a tick that read the link as up just before it)."""
    from deploy.crazyflie_bridge import Uplink

    c, _ = armed_controller()
    b = fake_bridge(c, FakeClock())
    radio = BlockingCommander()
    b._uplink = Uplink(radio)
    epoch = b._uplink.epoch
    b._uplink.position(epoch, 0.0, 0.0, 1.0)
    radio.wait_until_sending(b._uplink)
    b._uplink.position(epoch, 0.0, 0.0, 0.5)
    b._on_link(f"link to {b.uri} lost: Too many packets lost")
    b._uplink.position(epoch, 0.0, 0.0, 0.4)  # a tick that read the link as up just before the loss
    radio.release.set()
    assert b._uplink.flush(2.0) and [z for _, z in radio.sent] == [1.0]
    b._uplink.position(b._uplink.epoch, 0.0, 0.0, 0.3)  # the next link's
    assert b._uplink.flush(2.0) and [z for _, z in radio.sent] == [1.0, 0.3]


def test_a_setpoint_whose_send_raised_is_reported_by_the_next_tick_and_the_sends_go_on():
    """A send that raises (a radio error in cflib) surfaces as the next actuation's error, which the node's
    tick logs once (ControllerNode._tick); the next setpoints are sent."""
    from deploy.crazyflie_bridge import Uplink

    class FailingOnce:
        def __init__(self):
            self.sent = []

        def send_position_setpoint(self, x, y, z, yaw):
            if not self.sent:
                self.sent.append("raised")
                raise OSError("USB error")
            self.sent.append(z)

    c, _ = armed_controller()
    b = fake_bridge(c, FakeClock())
    radio = FailingOnce()
    with_uplink(b, radio)
    c.on_state(hover_state(0.0), 0.0)
    b.actuate(c.tick(0.0), 0.0)
    with pytest.raises(RuntimeError, match="setpoint not sent: OSError: USB error"):
        b.actuate(c.tick(0.01), 0.01)
    b.actuate(c.tick(0.02), 0.02)
    assert radio.sent == ["raised", 1.0, 1.0] and isinstance(b._uplink, Uplink)


def test_stopping_the_bridge_with_a_radio_that_takes_nothing_still_exits_in_time():
    """Shutdown while cflib's send is blocked for good (a Crazyradio unplugged): the stops are posted, the
    wait for the last one is bounded (STOP_FLUSH_S), and so is the wait for cflib's close_link
    (CLOSE_LINK_S), which with real cflib waits for the blocked send's lock (and may never return): the
    node exits within the launch runner's SIGINT-to-SIGTERM time and says why. What the fake radio takes
    once released is in order, the stop last; with a real unplugged radio nothing reaches the vehicle, and
    the onboard dead-man stops it."""
    from deploy.crazyflie_bridge import CLOSE_LINK_S, STOP_FLUSH_S, STOP_REPEAT_S, Uplink

    c = SafeController(FakePolicy(), SafetyConfig())  # disarmed: no descent first
    b = fake_bridge(c, FakeClock())
    radio = BlockingCommander()
    b._uplink = Uplink(radio)
    closed = []

    def close_link():  # cflib: blocked behind the stuck send
        radio.release.wait(10.0)
        closed.append(time.monotonic())

    b.cf.close_link = close_link
    b._uplink.position(b._uplink.epoch, 0.0, 0.0, 1.0)  # the send under way when the shutdown comes
    radio.wait_until_sending(b._uplink)
    start = time.monotonic()
    b.close()
    assert time.monotonic() - start < 2 * STOP_REPEAT_S + STOP_FLUSH_S + CLOSE_LINK_S + 0.5 and not closed
    assert any("did not close within" in line and "still blocked" in line for line in b.logged), b.logged
    radio.release.set()
    b._uplink._thread.join(2.0)
    deadline = time.monotonic() + 2.0
    while not closed and time.monotonic() < deadline:  # (close_link's own thread, released too)
        time.sleep(0.005)
    assert not b._uplink.alive() and [z for _, z in radio.sent] == [1.0, "stop"] and closed


def test_a_send_error_during_the_shutdown_landing_does_not_end_the_landing():
    """A setpoint's send raises during the shutdown landing (a radio hiccup): the error is logged and the
    descent goes on to the floor before the stop, instead of the stop cutting the rotors at height."""
    class FailingOnce:
        def __init__(self):
            self.sent = []

        def send_position_setpoint(self, x, y, z, yaw):
            self.sent.append((time.monotonic(), z))
            if len(self.sent) == 3:
                raise OSError("USB error")

        def send_stop_setpoint(self):
            self.sent.append((time.monotonic(), "stop"))

    c, _ = armed_controller()
    b = fake_bridge(c, FakeClock())
    radio = FailingOnce()
    with_uplink(b, radio)
    b.cf.close_link = lambda: None
    b._now = time.monotonic
    c.on_state(hover_state(t=time.monotonic()), time.monotonic())
    b.close()
    heights = [z for _, z in radio.sent]
    first_stop = heights.index("stop")
    assert heights[0] > 0.99 and heights[first_stop - 1] == 0.0 and all(z == "stop" for z in heights[first_stop:])
    assert any("shutdown landing: setpoint not sent: OSError: USB error" in line for line in b.logged), b.logged


def run_script(script: Path) -> subprocess.CompletedProcess:
    """Run a node script in a Python process of its own, on a ROS domain of the unit tests' own."""
    env = {**os.environ, "ROS_DOMAIN_ID": "97", "ROS_AUTOMATIC_DISCOVERY_RANGE": "LOCALHOST"}
    return subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=60, env=env)


STOPPING_NODE = """import sys, time
sys.path.insert(0, {repo!r})
from deploy.ros import Node, run_node


class Stopping(Node):
    def __init__(self):
        super().__init__({name!r})
        self.create_timer(0.05, self.stop)

    def stop(self):
        raise KeyboardInterrupt  # as Ctrl-C during a callback
{methods}

sys.exit(run_node(Stopping))
"""

CLOSER = """
    def close(self):
        raise BrokenPipeError(32, "Broken pipe")  # its summary line, to a dead launch runner's pipe

    def destroy_node(self):
        with open({log!r}, "a") as f:
            f.write("destroyed\\n")
        return super().destroy_node()
"""


def test_a_node_whose_clean_up_fails_is_destroyed_and_exits_non_zero(tmp_path):
    """run_node: a close() that raises (its output pipe gone) is reported in one line and the node is
    destroyed all the same; the exit code says the clean-up failed (the error used to escape run_node,
    skipping destroy_node and rclpy.shutdown)."""
    log = tmp_path / "node.log"
    script = write(tmp_path / "closer.py", STOPPING_NODE.format(repo=str(REPO), name="closer",
                                                                methods=CLOSER.format(log=str(log))))
    r = run_script(script)
    assert r.returncode == 1 and "Traceback" not in r.stderr, r.stderr
    assert "closer: clean-up failed (BrokenPipeError: [Errno 32] Broken pipe)" in r.stderr, r.stderr
    assert log.read_text() == "destroyed\n"


HANGER = """
    def destroy_node(self):
        time.sleep(60)  # as the DDS participant's deletion, hung
"""


def test_a_node_whose_teardown_hangs_prints_its_stacks_and_exits(tmp_path):
    """run_node: a teardown that hangs after the node's clean-up (destroying the node) prints every thread's
    Python stack and exits with code 1 after TEARDOWN_LIMIT_S, instead of waiting for the launcher's SIGKILL."""
    from deploy.ros import TEARDOWN_LIMIT_S

    script = write(tmp_path / "hanger.py", STOPPING_NODE.format(repo=str(REPO), name="hanger", methods=HANGER))
    start = time.monotonic()
    r = run_script(script)
    assert r.returncode == 1 and TEARDOWN_LIMIT_S <= time.monotonic() - start < 30.0, r.stderr
    assert "Timeout" in r.stderr and "in destroy_node" in r.stderr and "in run_node" in r.stderr, r.stderr


MISSING = """import sys
sys.path.insert(0, {repo!r})
from deploy.ros import run_node


def make():
    raise ModuleNotFoundError("No module named {name!r}", name={name!r})


sys.exit(run_node(make))
"""


@pytest.mark.parametrize("name, code", [("mcap.writer", 2), ("policies.nope", 1)])
def test_a_missing_package_is_one_error_line_a_missing_module_of_the_project_a_traceback(tmp_path, name, code):
    """A node whose package is not installed (the recorder's mcap, the bridge's cflib) says so in one line;
    a module of this project that is missing is a bug, and keeps its traceback."""
    script = write(tmp_path / "missing.py", MISSING.format(repo=str(REPO), name=name))
    r = run_script(script)
    assert r.returncode == code, r.stderr
    if code == 2:
        assert r.stderr.strip() == (f"error: the Python module {name} is missing: install the project with "
                                    "bash install.sh")
    else:
        assert "Traceback" in r.stderr and "policies.nope" in r.stderr, r.stderr


def test_the_bridge_publishes_the_state_in_its_world_frame_parameter():
    """The odometry the bridge makes from the log blocks carries the world_frame parameter, which its
    own subscription checks (with the constant 'world' a bridge run with world_frame:=map refused every
    state it published)."""
    from nav_msgs.msg import Odometry

    from deploy.crazyflie_bridge import CrazyflieBridge, StateAssembler

    published = []
    bridge = object.__new__(CrazyflieBridge)  # no ROS node, no radio
    bridge.world_frame, bridge.robot, bridge._odom_msg = "map", "cf1", Odometry
    bridge._assembler, bridge._lock = StateAssembler(), threading.Lock()
    bridge._odom_pub = type("Pub", (), {"publish": lambda self, msg: published.append(msg)})()
    bridge.get_clock = lambda: type("Clock", (), {"now": lambda self: type("T", (), {"nanoseconds": 10**9})()})()
    bridge._steady = lambda: 1.0
    bridge.controller, bridge._bad_samples, bridge._estimate_broken = SafeController(FakePolicy(), SafetyConfig()), 0, None
    bridge._onboard, bridge._fallback_samples = None, 0
    pose = {f"stateEstimate.{v}": 0.1 for v in ("x", "y", "z", "vx", "vy", "vz")}
    att = {"stateEstimate.qx": 0.0, "stateEstimate.qy": 0.0, "stateEstimate.qz": 0.0, "stateEstimate.qw": 1.0,
           "gyro.x": 0.0, "gyro.y": 0.0, "gyro.z": 0.0, "rlpolicy.mode": 1, "rlpolicy.fault": 0}
    bridge._on_log(100, pose, type("Conf", (), {"name": "pose"})())
    bridge._on_log(100, att, type("Conf", (), {"name": "attitude"})())
    assert len(published) == 1 and published[0].header.frame_id == "map"
    assert published[0].child_frame_id == "cf1"


def test_the_bridge_streams_the_safety_layers_setpoint_to_the_onboard_policy():
    """Armed on the floor: the position setpoints the real vehicle's onboard policy flies to start where
    it stands and rise to the target, the setpoint the offboard copy of the policy observes."""
    from deploy.crazyflie_bridge import CrazyflieBridge

    class Commander:
        def __init__(self):
            self.sent = []

        def send_position_setpoint(self, x, y, z, yaw):
            self.sent.append((x, y, z))

    bridge = object.__new__(CrazyflieBridge)  # no ROS node, no radio
    # (the state stays on the floor for 5 s here: longer than the default ground_timeout)
    bridge.controller = c = SafeController(FakePolicy(), SafetyConfig(ground_timeout=10.0))
    bridge.cf = type("Crazyflie", (), {"commander": Commander()})()
    with_uplink(bridge, bridge.cf.commander)
    bridge.connected, bridge.descent, bridge._estimate_broken = True, OnboardDescent(c.cfg), None
    bridge._onboard, bridge._fallback_samples = (1, 0), 0  # the onboard policy flies
    start = [0.3, 0.0, 0.0]
    c.on_state(hover_state(pos=start), 0.0)
    assert c.arm(0.0) == (True, "armed")
    for t in (0.0, 1.0, 5.0):
        c.on_state(hover_state(t, pos=start), t)
        bridge.actuate(c.tick(t), t)
        assert np.allclose(bridge.cf.commander.sent[-1], c.setpoint(t))
    sent = np.array(bridge.cf.commander.sent)
    assert np.allclose(sent[0], start) and 0.0 < sent[1][2] < 1.0 and np.allclose(sent[-1], TARGET)


def test_a_failed_mcu_is_asked_once_and_the_ticks_go_on():
    """firmware_bridge: the first failed exchange with the emulated MCU (dead or hung QEMU) is kept, and
    every later policy call and stop is refused without asking it again (a hung one cost its 1 s timeout
    in every control period, and a stop that kept failing raised at every tick). An actuation that raises
    does not stop the node's ticks: the command and the status still go out."""
    from deploy.firmware_bridge import GlueAdapter
    from deploy.policy_node import ControllerNode, Percentiles

    class DeadMcu:
        calls = 0

        def glue_step(self, *args, **kwargs):
            DeadMcu.calls += 1
            raise TimeoutError("no answer from the MCU within 1.0 s")

    glue = GlueAdapter(DeadMcu(), lambda: hover_state())
    obs = observation(hover_state(), TARGET, np.zeros(4, np.float32))
    with pytest.raises(TimeoutError):
        glue(obs)
    assert glue.engaged and DeadMcu.calls == 1
    for _ in range(3):
        with pytest.raises(RuntimeError, match="the MCU failed earlier: TimeoutError"):
            glue(obs)
        glue.stop()
    assert DeadMcu.calls == 1
    c, _ = armed_controller()
    node = object.__new__(ControllerNode)
    published, statuses, errors = [], [], []
    node.controller, node._to_rpm, node._now = c, lambda a: a, lambda: 0.0
    node.cmd_pub = type("Pub", (), {"publish": lambda self, m: published.append(m)})()
    node._state_received_at, node._ticks, node._last, node._actuate_log = (
        None, 0, ("", ""), LogLimiter(ACTUATION_LOG_EVERY_S))
    node.latency, node._recorder_deadline = Percentiles(), None
    node.use_sim_time, node.older_state_ticks, node._recorder_hold = False, 0, None
    node._publish_status = lambda cmd: statuses.append(cmd.mode)
    node.get_logger = lambda: type("Log", (), {"error": lambda self, m: errors.append(m)})()
    node.actuate = lambda cmd, now: glue.stop() or glue(obs)
    for _ in range(3):
        node._tick()
    assert len(published) == 3 and node._ticks == 3 and statuses
    assert len(errors) == 1 and "the MCU failed earlier" in errors[0], errors
    # An error that comes and goes (a radio error between sent setpoints): logged once per ACTUATION_LOG_EVERY_S
    # of the node's clock with how often it came in between; another kind at once.
    outcomes = iter([None, RuntimeError("radio"), RuntimeError("radio"), None, RuntimeError("radio"),
                     RuntimeError("radio"), OSError("usb"), RuntimeError("radio")])

    def actuate(cmd, now):
        outcome = next(outcomes)
        if outcome is not None:
            raise outcome

    node.actuate = actuate
    for _ in range(5):
        node._tick()
    assert errors[1:] == ["actuation failed: RuntimeError: radio"], errors  # and twice more, not logged
    node._now = lambda: ACTUATION_LOG_EVERY_S  # that long later
    node._tick()
    assert errors[2:] == ["actuation failed: RuntimeError: radio (and 2 times since its last line, not logged)"], errors
    node._tick()
    node._tick()
    assert errors[3:] == ["actuation failed: OSError: usb", "actuation failed: RuntimeError: radio"], errors


def test_the_hil_failsafe_is_the_mcus_only_from_a_current_state_and_a_flying_glue():
    """firmware_bridge: in a failsafe the MCU flies the descent setpoint from the current state, its
    action clipped as the policy's; the safety layer's open-loop command stands without a current state
    (the MCU would fly a frozen one), with a latched glue (asked no more until the stop) or a non-finite
    answer; outside a failsafe nothing changes."""
    from deploy.firmware_bridge import FirmwareBridge, GlueAdapter
    from firmware.pil import GLUE_MODES, GlueOutput, force_to_action

    class Mcu:
        boot = type("Boot", (), {"thrust_max": 0.1125})()

        def __init__(self):
            self.calls, self.mode, self.force = [], "policy", np.full(4, 0.9)

        def glue_step(self, pos, quat, vel, gyro, sp_pos, sp_vel, now_ms, sp_ms, **kw):
            self.calls.append((np.array(sp_pos), kw.get("setpoint_kind")))
            return GlueOutput(GLUE_MODES.index(self.mode), 0, 0, np.zeros(4), self.force.copy(), 0.0)

    c, _ = armed_controller()
    b = object.__new__(FirmwareBridge)
    b.controller, b.descent, b.glue = c, OnboardDescent(c.cfg), GlueAdapter(mcu := Mcu(), lambda: c.latest)
    armed = c.tick(0.0)
    assert b.vehicle_command(armed, 0.0) is armed and not mcu.calls
    c.disarm(0.03)  # a descent, from a state still current at 0.04 s (40 ms old)
    failsafe = c.tick(0.04)
    flown = b.vehicle_command(failsafe, 0.04)
    assert failsafe.mode is Mode.FAILSAFE and len(mcu.calls) == 1 and mcu.calls[0][0][2] == pytest.approx(1.0)
    assert np.allclose(flown.action, force_to_action(0.9, 0.1125))  # the action of 0.9 of thrust_max
    assert not np.allclose(flown.action, failsafe.action)
    stale = c.tick(0.2)
    assert b.vehicle_command(stale, 0.2) is stale and len(mcu.calls) == 1  # no current state: not asked
    c.on_state(hover_state(0.21), 0.21)
    mcu.force = np.full(4, np.nan)
    fresh = c.tick(0.21)
    assert b.vehicle_command(fresh, 0.21) is fresh and len(mcu.calls) == 2  # a non-finite answer
    mcu.mode, mcu.force = "fallback", np.zeros(4)
    assert b.vehicle_command(fresh, 0.21) is fresh and len(mcu.calls) == 3 and b.glue.latched
    assert b.vehicle_command(fresh, 0.21) is fresh and len(mcu.calls) == 3  # latched: not asked again
    b.glue.stop()
    assert not b.glue.latched and mcu.calls[-1][1] is not None  # the stop setpoint


def test_a_failed_mcu_refuses_arming_holds_auto_arm_and_says_so():
    """firmware_bridge: once the emulated MCU has failed (dead, hung: GlueAdapter.failed), arming is refused
    and auto_arm holds, with the reason on /status; a disarm or stop is still delivered (the safety layer's
    commands reach the simulator on rotor_cmd), so the link is not called broken. Before it, nothing is refused."""
    from deploy.firmware_bridge import FirmwareBridge, GlueAdapter

    class DeadMcu:
        def glue_step(self, *args, **kwargs):
            raise TimeoutError("no answer from the MCU within 1.0 s")

    c = SafeController(FakePolicy(), SafetyConfig(auto_arm=True))
    b = object.__new__(FirmwareBridge)
    b.controller, b.glue = c, GlueAdapter(DeadMcu(), lambda: c.latest)
    b.descent = OnboardDescent(c.cfg)
    b._now, b._report_change = lambda: 0.0, lambda always=False: None
    b.get_logger = lambda: type("Log", (), {k: staticmethod(lambda m: None) for k in ("info", "warning")})()
    assert b.arm_problem() is None and b.link_problem() is None
    c.on_state(hover_state(), 0.0)
    with pytest.raises(TimeoutError):
        b.glue(observation(hover_state(), TARGET, np.zeros(4, np.float32)))
    why = b.arm_problem()
    assert why.startswith("the emulated MCU failed (TimeoutError: no answer") and why.endswith("restart the bridge")
    assert b.link_problem() is None
    b._recorder_hold, b._recorder_deadline, b.use_sim_time, b.older_state_ticks = None, None, False, 0
    b._state_received_at, b._ticks, b._last, b._actuate_log = (
        None, 0, ("", ""), LogLimiter(ACTUATION_LOG_EVERY_S))
    b.cmd_pub = type("Pub", (), {"publish": lambda self, m: None})()
    b._publish_status, b._to_rpm, b.actuate = lambda cmd: None, lambda a: a, lambda cmd, now: None
    b._tick()  # the node's tick: auto_arm holds
    assert c.mode is Mode.DISARMED and c.reason == f"auto_arm: {why}"
    response = b._on_arm(type("Req", (), {"data": True})(), type("Res", (), {})())
    assert not response.success and response.message == f"refused to arm: {why}" and c.mode is Mode.DISARMED
    response = b._on_arm(type("Req", (), {"data": False})(), type("Res", (), {})())
    assert response.success and "NOT delivered" not in response.message


def test_a_mcu_that_fails_in_flight_is_a_failsafe_that_lands_without_recovering():
    """firmware_bridge: the MCU dies in flight; the failsafe it starts lands although valid states keep
    coming (they would hand the vehicle back to a policy that fails at once, counting a recovery and a new
    failsafe each time, up to max_recoveries), and /status's reason says why."""
    from deploy.firmware_bridge import FirmwareBridge, GlueAdapter
    from firmware.pil import GLUE_MODES, GlueOutput

    class Mcu:
        boot = type("Boot", (), {"thrust_max": 0.1125})()
        dead = False

        def glue_step(self, *args, **kwargs):
            if self.dead:
                raise TimeoutError("no answer from the MCU within 1.0 s")
            return GlueOutput(GLUE_MODES.index("policy"), 0, 0, np.zeros(4), np.full(4, 0.05), 0.0)

    mcu, now = Mcu(), [0.0]
    b = object.__new__(FirmwareBridge)
    c = SafeController(lambda obs: b.glue(obs), SafetyConfig())
    b.controller, b.glue, b.descent = c, GlueAdapter(mcu, lambda: c.latest), OnboardDescent(c.cfg)
    b._now, b._report_change = lambda: now[0], lambda always=False: None
    b.get_logger = lambda: type("Log", (), {k: staticmethod(lambda m: None) for k in ("info", "warning", "error")})()
    b._recorder_hold, b._recorder_deadline, b.use_sim_time, b.older_state_ticks = None, None, False, 0
    b._state_received_at, b._ticks, b._last, b._actuate_log = (
        None, 0, ("", ""), LogLimiter(ACTUATION_LOG_EVERY_S))
    b.cmd_pub = type("Pub", (), {"publish": lambda self, m: None})()
    b._publish_status, b._to_rpm, b.actuate = lambda cmd: None, lambda a: a, lambda cmd, now: None
    c.on_state(hover_state(), 0.0)
    assert c.arm(0.0) == (True, "armed")
    b._tick()
    assert c.mode is Mode.ARMED
    mcu.dead = True
    modes = []
    for k in range(1, 40):  # valid states at 1 m every period: recover_count (3) of them would recover
        now[0] = 0.01 * k
        c.on_state(hover_state(now[0]), now[0])
        b._tick()
        modes.append(c.mode)
    assert modes == [Mode.FAILSAFE] * len(modes), modes
    st = c.status()
    assert st["recoveries"] == 0 and st["failsafe_count"] == 1, st
    assert "no recovery: the emulated MCU failed (TimeoutError: no answer" in st["reason"], st["reason"]
    assert st["reason"].count("no recovery") == 1


def test_the_open_loop_descent_profile_is_the_simulated_failsafe():
    """No braking: h - |vz| t - a t^2 / 2 down to the floor, a = (1 - ratio) g; a climbing vehicle rises to a
    stop first (the timer's fall time), a climbing setpoint goes down at once."""
    p, a = DescentProfile.open_loop(SafetyConfig()), 0.1 * GRAVITY
    assert p.accel == pytest.approx(a) and p.settle_s == SPIN_DOWN_S
    assert p.z(1.0, 0.0, 0.0, 0.0) == 1.0
    assert p.z(1.0, 0.0, 1.0, 0.0) == pytest.approx(1.0 - 0.05 * GRAVITY)
    assert p.z(1.0, 0.0, 10.0, 0.0) == 0.0
    assert p.z(1.0, -0.5, 1.0, 0.0) == pytest.approx(0.5 - 0.05 * GRAVITY)  # sinking on
    assert p.z(1.0, 0.5, 1.0, 0.0) == pytest.approx(1.0 - 0.05 * GRAVITY)  # down at once
    assert p.z(1.5, 0.0, 1.0, 0.5) == pytest.approx(1.5 - 0.05 * GRAVITY)  # over a floor at 0.5 m
    assert p.fall_time(1.0, 0.0) == pytest.approx(math.sqrt(2.0 / a))
    assert p.fall_time(1.0, -0.5) == pytest.approx((-0.5 + math.sqrt(0.25 + 2 * a)) / a)
    assert p.fall_time(1.0, 0.5) == pytest.approx((0.5 + math.sqrt(0.25 + 2 * a)) / a)
    assert p.fall_time(0.0, 0.0) == 0.0


@pytest.mark.parametrize("z0, vz0", [(2.5, 0.0), (1.0, 0.0), (1.0, -0.5), (1.0, -1.5), (0.3, -1.5), (1.0, 0.8),
                                     (0.12, 0.0), (0.05, 0.0), (0.05, -0.6)])
def test_the_onboard_descent_brakes_to_the_touchdown_speed_and_reaches_the_floor_at_its_fall_time(z0, vz0):
    """The onboard setpoint, sampled every ms: it starts at z0, sinking at the start's speed (from rest if
    climbing), and never rises; it never sinks faster than it sank at the start or reached by (1 - ratio) g
    from it (so it has no jump); where it starts slower than its braking curve it changes speed by no more
    than (1 - ratio) g, and from rest it takes the closed-form time of a sink and a brake at (1 - ratio) g;
    where it starts faster it only slows; it is at the touchdown speed over the last ONBOARD_FLARE_HEIGHT
    (from a start inside it at once); it reaches the floor at fall_time and stays there."""
    from deploy.safety import ONBOARD_DESCENT_LAG_S, ONBOARD_FLARE_HEIGHT, ONBOARD_TOUCHDOWN_SPEED

    p, dt = DescentProfile.onboard(SafetyConfig()), 1e-3
    a, vt, flare, ground = 0.1 * GRAVITY, ONBOARD_TOUCHDOWN_SPEED, ONBOARD_FLARE_HEIGHT, 0.5  # a floor at 0.5 m
    assert p.accel == pytest.approx(a) and p.brake == pytest.approx(a)
    assert p.settle_s == pytest.approx(SPIN_DOWN_S + ONBOARD_DESCENT_LAG_S)
    fall = p.fall_time(z0, vz0)
    z = np.array([p.z(ground + z0, vz0, k * dt, ground) for k in range(int(fall / dt) + 50)]) - ground
    v = -np.diff(z) / dt  # sink speed (m/s) over each ms
    v0 = max(-vz0, 0.0)
    assert z[0] == pytest.approx(z0) and np.all(np.diff(z) <= 0.0) and z[-1] == pytest.approx(0.0, abs=1e-12)
    assert v[0] == pytest.approx(v0 if z0 > flare else vt, abs=0.01)
    landing = int(np.argmax(z <= 1e-12))
    assert v.max() <= max(v0, math.sqrt(v0 ** 2 + 2 * a * z0)) + 1e-6
    inside = z[:landing - 1] < flare - 1e-9  # ms that end inside the flare (the last one ends on the floor)
    assert np.allclose(v[:landing - 1][inside], vt, atol=1e-6)
    if vz0 > 0.0:  # climbing: the timer counts a rise to a stop that the setpoint does not make
        rise = vz0 / a
        assert fall == pytest.approx(rise + p.fall_time(z0 + vz0 ** 2 / (2 * a), 0.0))
        assert landing * dt == pytest.approx(p.fall_time(z0, 0.0), abs=2 * dt)
        return
    assert landing * dt == pytest.approx(fall, abs=2 * dt)
    above = z[2:landing] >= flare  # both ms above the flare (the speed may step to vt there)
    if v0 ** 2 < vt ** 2 + 2 * a * max(z0 - flare, 0.0):  # on or under its braking curve
        assert np.all(np.abs(np.diff(v[:landing - 1]))[above] <= a * dt + 1e-6)
        assert v.max() <= math.sqrt(vt ** 2 + 2 * a * z0) + 1e-6  # it never needs to brake harder
    else:  # too fast for the braking curve: it brakes from the start
        assert np.all(np.diff(v[:landing - 1])[above] <= 1e-9)
    if vz0 == 0.0 and 2 * a * (z0 - flare) > vt ** 2:  # from rest: to a peak at a, to vt at a, the flare at vt
        peak = math.sqrt(a * (z0 - flare) + vt ** 2 / 2)  # a peak^2 / 2a + (peak^2 - vt^2) / 2a = z0 - flare
        assert fall == pytest.approx((2 * peak - vt) / a + flare / vt, rel=1e-9)
    assert p.z(ground + z0, vz0, fall + 1.0, ground) == ground


def test_the_onboard_descent_starts_where_its_timer_starts_after_a_glitch_to_the_floor():
    """A sample at the floor 10 ms after the vehicle was 0.3 m up (within max_jump: valid), then no more: the
    failsafe is timed from the last state in the air (a free fall could not have reached the floor yet), and the
    onboard descent's setpoints start there too, not on the floor at once (the policy would dive to it
    without braking)."""
    cfg = SafetyConfig()
    c, descent = SafeController(FakePolicy(), cfg, descent=DescentProfile.onboard(cfg)), OnboardDescent(cfg)
    for k in range(6):
        c.on_state(make_state([0.0, 0.0, 0.3], [1, 0, 0, 0], [0.0, 0.0, 0.0], [0, 0, 0], 0.01 * k), 0.01 * k)
        if k == 0:
            assert c.arm(0.0)[0]
        assert c.tick(0.01 * k).mode is Mode.ARMED
    glitch = make_state([0.0, 0.0, 0.02], [1, 0, 0, 0], [0.0, 0.0, 0.0], [0, 0, 0], 0.06)
    assert c.on_state(glitch, 0.06) is None and c.height() == pytest.approx(0.02)  # believed
    now = 0.06 + cfg.stale_timeout + 0.01
    cmd = c.tick(now)
    assert cmd.mode is Mode.FAILSAFE, cmd.reason
    z0, vz0, t0 = c.descent_start(now)
    assert (z0, vz0, t0) == pytest.approx((0.3, 0.0, 0.05))
    first = descent.setpoint(cmd, c, now)[2]
    assert first == pytest.approx(DescentProfile.onboard(cfg).z(0.3, 0.0, now - 0.05, 0.0)) and first > 0.25


def test_descent_profiles_refuse_what_would_never_land():
    with pytest.raises(ValueError, match="needs a touchdown speed > 0"):
        DescentProfile(1.0, brake=1.0)
    for bad in (dict(accel=0.0), dict(accel=1.0, brake=-1.0), dict(accel=1.0, flare=-0.1),
                dict(accel=1.0, settle_s=-1.0)):
        with pytest.raises(ValueError, match="expected accel > 0"):
            DescentProfile(**bad)


def test_a_shutdown_descent_from_the_ceiling_is_timed_inside_the_landing_limit():
    """From rest at the geofence's ceiling, the onboard descent's no-state timer (its setpoints' time to the
    floor, the spin-down and the policy's lag) ends before crazyflie_bridge cuts a landing that did not end."""
    from deploy.crazyflie_bridge import LANDING_LIMIT_S

    cfg = SafetyConfig()
    p = DescentProfile.onboard(cfg)
    assert p.fall_time(cfg.geofence_max[2] - cfg.ground_height, 0.0) + p.settle_s < LANDING_LIMIT_S


@pytest.mark.parametrize("vz", [0.0, -0.5, -0.8, 0.5])
def test_the_bridges_failsafe_setpoint_reaches_the_floor_before_the_stop(vz):
    """States stop arriving with the vehicle at 1 m moving vertically at ``vz`` (m/s): the descent
    setpoints streamed to the vehicle reach the floor before the safety layer's timer sends the stop
    (a setpoint that sank from rest while the timer counted a sinking vehicle's shorter fall was still
    0.17-0.38 m up at the stop for vz = -0.5 to -0.8 m/s)."""
    from deploy.crazyflie_bridge import CrazyflieBridge

    class Commander:
        def __init__(self):
            self.sent = []

        def send_position_setpoint(self, x, y, z, yaw):
            self.sent.append(z)

        def send_stop_setpoint(self):
            self.sent.append("stop")

    bridge = object.__new__(CrazyflieBridge)  # no ROS node, no radio: the descent logic alone
    bridge.controller = c = SafeController(FakePolicy(), SafetyConfig(), descent=DescentProfile.onboard(SafetyConfig()))
    bridge.cf = type("Crazyflie", (), {"commander": Commander()})()
    with_uplink(bridge, bridge.cf.commander)
    bridge.connected, bridge.descent, bridge._estimate_broken = True, OnboardDescent(c.cfg), None
    bridge._onboard, bridge._fallback_samples = (1, 0), 0  # the onboard policy flies
    c.on_state(make_state([0.0, 0.0, 1.0], [1, 0, 0, 0], [0.0, 0.0, 0.0], [0, 0, 0], 0.0), 0.0)
    assert c.arm(0.0)[0]  # (at rest: arming is refused at more than 0.5 m/s)
    c.on_state(make_state([0.0, 0.0, 1.0], [1, 0, 0, 0], [0.0, 0.0, vz], [0, 0, 0], 0.0), 0.0)
    for k in range(400):  # no state after t = 0
        now = 0.01 * k
        bridge.actuate(c.tick(now), now)
        if "stop" in bridge.cf.commander.sent:
            break
    sent = bridge.cf.commander.sent
    stop = sent.index("stop")
    descent = sent[:stop]  # the armed setpoints (1 m) while the state is fresh, then the descent's
    assert len(descent) > 10 and descent[-1] == 0.0 and all(a >= b for a, b in zip(descent, descent[1:])), descent
    on_floor = len(descent) - descent.index(0.0)  # periods the setpoint was on the floor before the stop
    assert on_floor * 0.01 >= c.descent_profile.settle_s - 0.02, on_floor  # the policy's lag and the spin-down
    if vz <= 0.0:  # (a climbing vehicle's timer also counts a rise the setpoint does not make)
        assert on_floor * 0.01 <= c.descent_profile.settle_s + 0.02, on_floor


# ---------------------------------------------------------------------------------------------
# recorder schema


def test_recordings_are_never_overwritten(tmp_path):
    from deploy.recorder import open_new

    name = tmp_path / "cf1_20261126_120000.mcap"  # two recorders started in the same second
    (p1, f1), (p2, f2) = open_new(name, numbered=True), open_new(name, numbered=True)
    f1.write(b"first")
    f1.close(), f2.close()
    assert p1 == name and p2.name == "cf1_20261126_120000_1.mcap" and name.read_bytes() == b"first"
    with pytest.raises(ValueError, match="never overwritten"):
        open_new(name, numbered=False)  # a path the user named


def test_recorder_schema_decodes_real_messages(tmp_path):
    """A message serialized by rclpy, stored with our ros2msg schema, decodes with mcap_ros2."""
    from mcap.reader import make_reader
    from mcap.writer import Writer
    from mcap_ros2.decoder import DecoderFactory
    from nav_msgs.msg import Odometry
    from rclpy.serialization import serialize_message

    st = make_state([0.1, 0.2, 0.3], random_quat(np.random.default_rng(1)), [1, 2, 3], [4, 5, 6], 7.5)
    msg = fill_odometry(Odometry(), st, "world", "cf1")
    path = tmp_path / "x.mcap"
    with path.open("wb") as f:
        w = Writer(f)
        w.start(profile="ros2")
        ch = _channel(w, "/cf1/odom", "nav_msgs/msg/Odometry")
        w.add_message(ch, log_time=1, data=serialize_message(msg), publish_time=1)
        w.finish()
    with path.open("rb") as f:
        ((_, _, _, decoded),) = list(make_reader(f, decoder_factories=[DecoderFactory()]).iter_decoded_messages())
    assert decoded.child_frame_id == "cf1" and decoded.twist.twist.angular.z == 6.0
    assert decoded.pose.pose.position.y == pytest.approx(0.2)
