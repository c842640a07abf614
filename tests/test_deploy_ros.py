"""The deploy nodes as real processes on real DDS (loopback only, one ROS domain per test).

Hover: hover.launch.xml through the launch runner, backend sim and hil, with the trained hover
policy shipped at policies/pretrained/quad_hover. Safety: failsafe when the simulator dies, on
stale / NaN / out-of-range states, recovery, a 10k-message fuzz. Latency: p50/p99 of state
receipt -> command publication, printed. Recording: record:=true writes MCAP, deploy.plot draws it.
The other tests use the small seeded policy of tests/conftest.py (exported here): it does not fly,
it only has to answer.
"""

from __future__ import annotations

import itertools
import json
import math
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from deploy import ament
from deploy.safety import CLOCK_RESTART_WINDOW_S
from deploy.testing import REPO, RosWorld
from sim.crazyflie.params import NOMINAL

HOVER_POLICY = REPO / "policies/pretrained/quad_hover/export/policy.onnx"
PERIOD = 0.01
CLOCK_TIMEOUT = 0.5  # policy_node's default clock_timeout, s
RPM_MAX = NOMINAL.rpm_max


@pytest.fixture(scope="module")
def seeded_policy(run_dir) -> Path:
    """policy.onnx (+ policy.c/h) of the conftest actor: random weights, right contract."""
    from policies.export import export_run

    onnx = run_dir / "export" / "policy.onnx"
    if not onnx.is_file():
        export_run(run_dir)
    return onnx


@pytest.fixture(scope="module")
def prefix(tmp_path_factory) -> Path:
    """An ament prefix with this package linked in (what `python -m deploy.ament` does)."""
    p = tmp_path_factory.mktemp("ament")
    ament.install_links(p)
    return p


def world(prefix: Path | None = None) -> RosWorld:
    w = RosWorld()
    if prefix is not None:
        w.env["AMENT_PREFIX_PATH"] = f"{prefix}:{sys.prefix}"
    return w


class Observed:
    """Observer subscriptions: odometry, rotor commands and status, each with receipt wall time."""

    def __init__(self, w: RosWorld, robot: str = "cf1"):
        from nav_msgs.msg import Odometry
        from std_msgs.msg import Float32MultiArray, String

        n = w.observer()
        self.odom: list[tuple[float, float, np.ndarray]] = []  # (wall, stamp, pos)
        self.cmd: list[tuple[float, np.ndarray]] = []
        self.status: list[tuple[float, dict]] = []
        n.create_subscription(Odometry, f"/{robot}/odom", self._odom, 100)
        n.create_subscription(Float32MultiArray, f"/{robot}/rotor_cmd", lambda m: self.cmd.append(
            (time.monotonic(), np.asarray(m.data, dtype=np.float64))), 1000)
        n.create_subscription(String, f"/{robot}/status", lambda m: self.status.append(
            (time.monotonic(), json.loads(m.data))), 1000)

    def _odom(self, m) -> None:
        p = m.pose.pose.position
        self.odom.append((time.monotonic(), m.header.stamp.sec + 1e-9 * m.header.stamp.nanosec,
                          np.array([p.x, p.y, p.z])))

    def mode(self) -> str | None:
        return self.status[-1][1]["mode"] if self.status else None

    def seen_mode(self, mode: str, since: float = 0.0) -> bool:
        return any(s["mode"] == mode for t, s in self.status if t >= since)


def check_commands(cmds) -> None:
    a = np.array([c for _, c in cmds])
    assert a.shape[1:] == (4,) and np.isfinite(a).all(), "non-finite rotor command"
    assert (a >= 0).all() and (a <= RPM_MAX + 1e-3).all(), f"rotor command out of [0, {RPM_MAX}] rpm"


# ---------------------------------------------------------------------------------------------
# hover through the launch file


def hover(backend: str, prefix: Path) -> dict:
    if not HOVER_POLICY.is_file():
        pytest.fail(f"{HOVER_POLICY} is missing: ship the trained hover run at policies/pretrained/quad_hover "
                    "and export it (python -m policies.export policies/pretrained/quad_hover)")
    with world(prefix) as w:
        rec = Observed(w)
        launch = w.start("-m", "deploy.launch", "launch/hover.launch.xml", f"backend:={backend}",
                         f"policy:={HOVER_POLICY}", name="launch")

        def released():
            return re.search(r"released at t = ([0-9.]+) s", w.output(launch))

        w.spin_until(released, 60, "the simulator to release the vehicle")
        t_release = float(released().group(1))

        def status_span() -> float:  # simulated time (s) between the first and last status seen in flight
            flying = [s["t"] for _, s in rec.status if s.get("t", 0.0) > t_release]
            return flying[-1] - flying[0] if flying else 0.0

        # Both streams: the observer takes one message per spin, and under load the status can lag the odometry;
        # and its first status in flight can come late (a clean clone's full suite: the first 1.3 s after the
        # release were missing, discovery under load), so it waits for 3 s of them, not for a time.
        w.spin_until(lambda: rec.odom and rec.odom[-1][1] > t_release + 4.0 and status_span() > 3.0, 30,
                     "4 s of simulated flight and 3 s of it in status")
        assert RosWorld.stop(launch) == 0, w.output(launch)
        out = w.output(launch)
    target = np.array([0.0, 0.0, 1.0])
    window = [(s, np.linalg.norm(p - target)) for _, s, p in rec.odom if t_release + 3.0 <= s <= t_release + 4.0]
    assert len(window) > 50, f"only {len(window)} odometry samples in the 1 s window"
    worst = max(e for _, e in window)
    lat = [s for _, s in rec.status if s.get("latency_ms", {}).get("n")][-1]
    print(f"\n{backend}: max error 3..4 s after release {worst * 100:.1f} cm; latency state->command ms "
          f"{lat['latency_ms']}, policy inference ms {lat['inference_ms']}, watchdog ticks {lat['watchdog_ticks']}")
    assert "process has finished cleanly" in out
    assert "lock-step with the controller" in out and "lock-step: no command" not in out, out
    # One control tick per 10 ms of simulated time over the flight (the node's own counts in status).
    flying = [s for _, s in rec.status if s.get("t", 0.0) > t_release]
    ticks, span = flying[-1]["ticks"] - flying[0]["ticks"], flying[-1]["t"] - flying[0]["t"]
    assert span > 3.0 and abs(ticks - span / 0.01) <= 1, (ticks, span)
    assert "implausible" not in flying[-1]["rejected"], flying[-1]["rejected"]  # no sample taken for a glitch
    assert worst < 0.05, f"{backend}: {worst * 100:.1f} cm from the target 3 s after release (limit 5 cm)\n{out}"
    check_commands(rec.cmd)
    return lat


def test_hover_sim(prefix):
    hover("sim", prefix)


def test_hover_hil(prefix):
    hover("hil", prefix)


def test_a_hil_failsafe_is_flown_by_the_mcu_to_the_floor(prefix):
    """backend:=hil, disarmed in flight: as on the real vehicle, the MCU's policy flies the descending
    setpoints (rotor commands that differ per rotor and period, not the safety layer's fixed descent
    command), which brake to the floor, and the rotors are cut once a state shows the vehicle on the floor."""
    from std_srvs.srv import SetBool

    from deploy.safety import SafeController, SafetyConfig
    from sim.crazyflie.params import action_to_rpm

    open_loop = action_to_rpm(SafeController(lambda o: o, SafetyConfig()).descent_action, RPM_MAX)
    with world(prefix) as w:
        rec = Observed(w)
        launch = w.start("-m", "deploy.launch", "launch/hover.launch.xml", "backend:=hil", f"policy:={HOVER_POLICY}",
                         name="launch")
        arm = w.observer().create_client(SetBool, "/cf1/arm")
        w.spin_until(lambda: rec.mode() == "armed" and rec.odom and rec.odom[-1][2][2] > 0.9, 60, "a hover at 1 m")
        w.spin_for(1.0)
        t0 = time.monotonic()
        future = arm.call_async(SetBool.Request(data=False))
        w.spin_until(future.done, 5, "the disarm service")
        w.spin_until(lambda: rec.seen_mode("disarmed", t0), 20, "the descent to end")
        t_fs = next(t for t, s in rec.status if t >= t0 and s["mode"] == "failsafe")
        t_cut, status = next((t, s) for t, s in rec.status if t >= t0 and s["mode"] == "disarmed")
        w.spin_for(0.3)
        assert RosWorld.stop(launch) == 0, w.output(launch)
    descent = np.array([c for t, c in rec.cmd if t_fs < t < t_cut])[3:-3]  # received between the two statuses
    assert len(descent) > 50, len(descent)
    assert np.abs(descent - open_loop).max() > 500 and descent.std(0).min() > 100, (open_loop, descent[::20])
    assert "landed" in status["reason"], status["reason"]
    z_at_cut = [p[2] for t, _, p in rec.odom if t <= t_cut][-1]
    assert z_at_cut < 0.06, f"the rotors were cut {z_at_cut:.2f} m above the floor"
    # The sink over the last 10 cm (odometry every 10 ms of simulated time): with the braking setpoints
    # (deploy.safety.DescentProfile.onboard) at most 0.33 m/s; with setpoints that only sank (before
    # 2026-12-02, put back for one run of this test) up to 0.72 m/s.
    low = [(stamp, p[2]) for t, stamp, p in rec.odom if t_fs <= t <= t_cut]
    sinks = [(z0 - z1) / (s1 - s0) for (s0, z0), (s1, z1) in zip(low, low[1:]) if s1 > s0 and z0 < 0.1]
    assert sinks and max(sinks) < 0.45, sinks


# ---------------------------------------------------------------------------------------------
# safety with real processes


@pytest.mark.parametrize("params, message", [
    (dict(stale_timeout=1), "parameter stale_timeout: expected a float (write 1.0, not 1)"),
    (dict(stale_timeout=".nan"), "stale_timeout nan: expected finite values"),
    (dict(clock_timeout="-1.0"), "parameter clock_timeout=-1.0: expected a positive time (s)"),
    (dict(recover_count=0), "recover_count 0: expected a whole number >= 1"),
    (dict(target=[0.0, 0.0, 3.0]), "target [0.0, 0.0, 3.0] must lie inside the geofence [-1.5, -1.5, -0.2]..[1.5, 1.5, 2.5]"),
    # ignored by rclpy: the vehicle would have flown with the default limit
    (dict(max_tilt_degs=45.0), "parameter max_tilt_degs: no node of this package has it (misspelt?); ROS 2 would "
                               "ignore it and keep the default"),
])
def test_bad_parameters_are_one_error_line(seeded_policy, params, message):
    with world() as w:
        proc = w.start(*w.node_cmd("policy_node", policy=seeded_policy, **params), name="policy")
        assert proc.wait(timeout=60) == 2, w.output(proc)
        out = w.output(proc)
    assert f"error: {message}" in out and "Traceback" not in out, out


@pytest.mark.parametrize("robot, params, message", [
    # rcl refuses arguments in rclpy.init, before the node exists: it used to be a traceback
    ("cf-1", {}, "error: the ROS arguments: failed to initialize rcl: Couldn't parse remap rule: '-r __ns:=/cf-1'"),
    # an empty value as the launcher writes it (rcl cannot parse 'policy:='): the node's own message
    ("cf1", dict(policy="''"), "error: parameter 'policy' is empty: pass policy:=<run_dir>/export/policy.onnx"),
])
def test_start_up_errors_before_the_node_are_one_error_line(robot, params, message):
    with world() as w:
        proc = w.start(*w.node_cmd("policy_node", robot=robot, **params), name="policy")
        assert proc.wait(timeout=60) == 2, w.output(proc)
        out = w.output(proc)
    assert message in out and "Traceback" not in out, out


@pytest.mark.parametrize("params, message", [
    # the onboard policy flies the motors (firmware/crazyflie clips to [-1, 1]): a lower max_action
    # would limit only the offboard shadow
    (dict(max_action=0.8), "max_action 0.8: the real vehicle's onboard policy does not take it"),
    (dict(reconnect_s=-1.0), "reconnect_s -1: expected >= 0 s (0: never reconnect)"),
    (dict(estimator_settle_spread=-0.001), "estimator_settle_spread -0.001: expected >= 0 m^2 (0: not checked)"),
    (dict(auto_arm=True), "auto_arm: a real vehicle is armed by a call to the arm service, never automatically"),
    (dict(reconect_s=1.0, geofence=[1.0]), "parameters geofence, reconect_s: no node of this package has them"),
])
def test_the_real_vehicles_bridge_refuses_bad_parameters_before_the_radio(seeded_policy, params, message):
    """A parameter the real vehicle's bridge cannot take is one error line, before it opens a radio link."""
    with world() as w:
        proc = w.start(*w.node_cmd("crazyflie_bridge", policy=seeded_policy, **params), name="bridge")
        assert proc.wait(timeout=60) == 2, w.output(proc)
        out = w.output(proc)
    assert f"error: {message}" in out, out
    assert "Traceback" not in out and "connecting" not in out, out


def test_a_parameter_in_another_nodes_section_is_one_error_line(seeded_policy, tmp_path):
    """A params file's section written for a node (/**/sim_bridge) with a parameter of another node
    (the safety layer's max_tilt_deg): it reaches only sim_bridge, which does not declare it, and the
    policy would fly with its default. The node the section names refuses to start; one whose section
    is right starts. So does a node given another node's parameter with -p (a launch file's <param>)."""
    wrong = tmp_path / "wrong.yaml"
    wrong.write_text("/**:\n  ros__parameters:\n    stale_timeout: 0.05\n"
                     "/**/sim_bridge:\n  ros__parameters:\n    command_timeout: 0.5\n    max_tilt_deg: 45.0\n")
    right = tmp_path / "right.yaml"
    right.write_text("/**:\n  ros__parameters:\n    max_tilt_deg: 45.0\n"
                     "/cf1:\n  sim_bridge:\n    ros__parameters:\n      command_timeout: 0.5\n"
                     "/cf2/sim_bridge:\n  ros__parameters:\n    uri: radio://0/80/2M\n")  # not this node's
    with world() as w:
        bad = w.start(*w.node_cmd("sim_bridge", clamped=True), "--params-file", str(wrong), name="bad")
        good = w.start(*w.node_cmd("sim_bridge", robot="cf1", clamped=True), "--params-file", str(right), name="good")
        given = w.start(*w.node_cmd("sim_bridge", clamped=True, max_tilt_deg=45.0), name="given")  # -p: its alone
        assert bad.wait(timeout=60) == 2, w.output(bad)
        assert given.wait(timeout=60) == 2, w.output(given)
        w.spin_until(lambda: "sim_bridge: torch backend" in w.output(good), 60, "the right file's node to start")
        assert good.poll() is None, w.output(good)
        out, given_out = w.output(bad), w.output(given)
    assert (f"error: parameter max_tilt_deg in the section /**/sim_bridge of {wrong}: sim_bridge has no such "
            "parameter (policy_node, firmware_bridge, crazyflie_bridge have it)") in out, out
    assert "Traceback" not in out, out
    assert ("error: parameter max_tilt_deg: sim_bridge has no such parameter (policy_node, firmware_bridge, "
            "crazyflie_bridge have it)") in given_out and "Traceback" not in given_out, given_out


def test_a_node_declares_only_parameters_of_the_list_unknown_ones_are_checked_against():
    """refuse_unknown_parameters knows a node's parameters by deploy.ros.NODE_PARAMETERS: a node declaring one
    missing there would have it refused when given. param() says so at once (each node is built by these
    tests): against the node's own list once refuse_unknown_parameters has named it, else against them all."""
    import rclpy

    from deploy.ros import param, refuse_unknown_parameters
    from deploy.testing import free_domain_id

    ctx = rclpy.Context()
    rclpy.init(args=[], context=ctx, domain_id=free_domain_id())
    try:
        node = rclpy.create_node("declares", context=ctx)
        with pytest.raises(AssertionError, match="parameter max_speed: not in any of deploy.ros.NODE_PARAMETERS"):
            param(node, "max_speed", 1.0)
        assert param(node, "max_jump", 0.4) == 0.4
        node.destroy_node()
        node = rclpy.create_node("sim_bridge", context=ctx)
        refuse_unknown_parameters(node, "sim_bridge")
        with pytest.raises(AssertionError, match=re.escape("max_jump: not in deploy.ros.NODE_PARAMETERS['sim_bridge']")):
            param(node, "max_jump", 0.4)  # the safety layer's, not the simulator's
        assert param(node, "clamped", False) is False
        node.destroy_node()
    finally:
        rclpy.shutdown(context=ctx)


def test_the_hil_bridge_refuses_a_max_action_below_1_before_the_mcu(seeded_policy):
    """firmware_bridge: the MCU's glue feeds back its own action, so a lower clip would give its policy a
    previous action the simulated vehicle never flew: one error line, before QEMU starts."""
    with world() as w:
        proc = w.start(*w.node_cmd("firmware_bridge", policy=seeded_policy, max_action=0.8), name="bridge")
        assert proc.wait(timeout=60) == 2, w.output(proc)
        out = w.output(proc)
    assert "error: max_action 0.8: the MCU's glue feeds its own action back to the policy" in out, out
    assert "Traceback" not in out and "MCU booted" not in out, out


def test_failsafe_when_the_simulator_dies(seeded_policy):
    with world() as w:
        rec = Observed(w)
        sim = w.start(*w.node_cmd("sim_bridge", clamped=True), name="sim")
        w.start(*w.node_cmd("policy_node", policy=seeded_policy, use_sim_time=True, auto_arm=True), name="policy")
        w.spin_until(lambda: rec.mode() == "armed" and len(rec.odom) > 20, 60, "the policy node to arm")
        w.spin_for(0.5)
        RosWorld.stop(sim, signal.SIGKILL)
        killed = time.monotonic()
        w.spin_until(lambda: rec.seen_mode("failsafe", killed), 5, "the failsafe")

        def safe(c: np.ndarray) -> bool:  # the safety layer's: one command for all four rotors, below hover
            return bool(np.allclose(c, c[0]) and c[0] < NOMINAL.hover_rpm)  # (the descent, or idle once landed)

        # The observer takes one message per topic and pass, so under load its 100 Hz commands can lag its
        # 10 Hz status (the likely reading of a clean clone's failure: 0.3 s after the failsafe's status, 2 of
        # the last 10 commands seen were still the policy's). It waits for 10 of the safety layer's commands.
        w.spin_until(lambda: sum(safe(c) for t, c in rec.cmd if t >= killed) >= 10, 5, "10 failsafe commands")
        w.spin_for(0.2)
        # The policy's commands end with the failsafe: from the safety layer's first one, every command is its.
        after = [c for t, c in rec.cmd if t >= killed]
        first = next(i for i, c in enumerate(after) if safe(c))
        assert len(after) - first >= 10 and all(safe(c) for c in after[first:]), after[first:]
    # The node's own measurement: how long /clock had been still when it switched (steady clock). The
    # failsafe the kill caused: a loaded machine can starve the node of states for a moment before it.
    t_failsafe, reason = next((t, s["reason"]) for t, s in rec.status if s["mode"] == "failsafe" and t >= killed)
    match = re.match(r"stale: /clock stopped (\d+) ms ago", reason)
    assert match, [s["reason"] for _, s in rec.status if s["mode"] == "failsafe"]
    stopped = float(match.group(1)) * 1e-3
    # The observer's view: first failsafe status or descent command after the last state it saw.
    last_state = max(t for t, _, _ in rec.odom)
    descent = [t for t, c in rec.cmd if t > last_state and np.allclose(c, c[0]) and c[0] < NOMINAL.hover_rpm]
    seen = min([t_failsafe, *descent[:1]]) - last_state
    print(f"\nsimulator killed: failsafe when /clock had been still {stopped * 1e3:.0f} ms (limit "
          f"{CLOCK_TIMEOUT * 1e3:.0f} ms), seen by an observer {seen * 1e3:.0f} ms after the last state it received")
    # By design at most one watchdog period after the limit; 2 periods + 20 ms allow for the OS
    # scheduling a Python process late on a shared 2-core machine. The observer's view adds its own
    # scheduling (it was seen to stall for up to 1 s under load): printed, not asserted.
    assert CLOCK_TIMEOUT <= stopped <= CLOCK_TIMEOUT + 2 * PERIOD + 0.02
    check_commands(rec.cmd)


def test_a_paused_simulator_is_not_a_fault_a_stopped_one_is(seeded_policy):
    """The simulator process frozen (SIGSTOP) for less than clock_timeout: simulated time stops with
    it, the policy node stays armed and the watchdog never ticks; frozen for longer: failsafe, and
    control comes back by itself when it runs again (SIGCONT). The node's clock_timeout is 1 s here,
    the pause 0.25 s: with the default 0.5 s a loaded machine once took 0.26 s more than the pause to
    get /clock going again (a clean clone's suite, 2026-11-29), which the node rightly took for a stop. Another
    clean clone saw 1,006 ms at the 1 s limit (2026-12-01): not examined; a stall of the policy node's own
    was read as a stopped /clock until then (test_a_stalled_policy_node_does_not_blame_the_clock)."""
    timeout = 2 * CLOCK_TIMEOUT
    with world() as w:
        rec = Observed(w)
        sim = w.start(*w.node_cmd("sim_bridge", clamped=True), name="sim")
        w.start(*w.node_cmd("policy_node", policy=seeded_policy, use_sim_time=True, auto_arm=True,
                            clock_timeout=timeout), name="policy")
        w.spin_until(lambda: rec.mode() == "armed" and len(rec.odom) > 20, 60, "the policy node to arm")
        w.spin_for(0.3)
        watchdog_before = rec.status[-1][1]["watchdog_ticks"]
        t0 = time.monotonic()
        sim.send_signal(signal.SIGSTOP)
        w.spin_for(timeout / 4)
        sim.send_signal(signal.SIGCONT)
        w.spin_for(0.5)
        assert not rec.seen_mode("failsafe", t0), [s for t, s in rec.status if t >= t0 and s["mode"] != "armed"]
        assert rec.status[-1][1]["watchdog_ticks"] == watchdog_before
        t1 = time.monotonic()
        sim.send_signal(signal.SIGSTOP)
        w.spin_until(lambda: rec.seen_mode("failsafe", t1), 5, "the failsafe on a stopped /clock")
        sim.send_signal(signal.SIGCONT)
        t2 = time.monotonic()
        w.spin_until(lambda: rec.seen_mode("armed", t2), 5, "recovery when the simulator runs again")
        reason = next(s["reason"] for t, s in rec.status if t >= t1 and s["mode"] == "failsafe")
    assert reason.startswith("stale: /clock stopped"), reason
    assert rec.status[-1][1]["watchdog_ticks"] > watchdog_before
    check_commands(rec.cmd)


def test_a_stalled_policy_node_does_not_blame_the_clock(seeded_policy):
    """The policy node's own process frozen (SIGSTOP) for longer than clock_timeout while the simulator
    runs on: when it runs again, its steady-clock watchdog is due before the /clock messages that waited
    in its queue are taken (rclpy's executor serves ready timers before subscriptions), so it must not
    read its own stall as a stopped /clock. Whatever else the safety layer makes of the stall, the
    reason is never "/clock stopped"."""
    with world() as w:
        rec = Observed(w)
        w.start(*w.node_cmd("sim_bridge", clamped=True), name="sim")
        policy = w.start(*w.node_cmd("policy_node", policy=seeded_policy, use_sim_time=True, auto_arm=True),
                         name="policy")
        w.spin_until(lambda: rec.mode() == "armed" and len(rec.odom) > 20, 60, "the policy node to arm")
        t0 = time.monotonic()
        policy.send_signal(signal.SIGSTOP)
        w.spin_for(2 * CLOCK_TIMEOUT)
        policy.send_signal(signal.SIGCONT)
        w.spin_until(lambda: sum(t > t0 for t, _ in rec.status) > 10, 10, "status from the policy node again")
        w.spin_for(0.5)
    blamed = [s["reason"] for t, s in rec.status if t >= t0 and "/clock stopped" in s["reason"]]
    assert not blamed, blamed
    assert rec.status[-1][1]["watchdog_ticks"] == 0
    check_commands(rec.cmd)


def test_a_restarted_simulator_starts_the_safety_layer_again(seeded_policy):
    """A simulator restarted under a running policy node sends /clock from 0 again: the safety layer,
    whose times are that clock's, starts up again (DISARMED, then armed again by auto_arm) instead
    of comparing the new times with the old ones. The first simulator runs 6 s: the policy node may hear
    the new one only after DDS has discovered it (2.9 s after its first message in one run here; Fast DDS
    announces a participant 5 times at 100 ms, then every 3 s), and a new clock first heard past the old
    one does not go back (deploy/safety.py). At d0487d5 it failed 4 of 7 runs with the first simulator
    killed at 2 s, and passed 6 of 6 at 6 s."""
    with world() as w:
        rec = Observed(w)
        sim = w.start(*w.node_cmd("sim_bridge", clamped=True), name="sim")
        w.start(*w.node_cmd("policy_node", policy=seeded_policy, use_sim_time=True, auto_arm=True), name="policy")
        w.spin_until(lambda: rec.mode() == "armed" and rec.odom and rec.odom[-1][1] > 6.0, 60,
                     "the policy node to arm and 6 s of simulated time")
        RosWorld.stop(sim, signal.SIGKILL)
        w.start(*w.node_cmd("sim_bridge", clamped=True), name="sim2")
        t0 = time.monotonic()
        w.spin_until(lambda: any("clock went back" in s["reason"] for t, s in rec.status if t >= t0), 30,
                     "the safety layer to see the clock go back")
        t1, first = min(((t, s) for t, s in rec.status if t >= t0 and "clock went back" in s["reason"]),
                        key=lambda ts: ts[0])
        assert first["mode"] == "disarmed", first  # started up again: DISARMED before auto_arm arms it
        w.spin_until(lambda: rec.seen_mode("armed", t1), 10, "auto_arm to arm again")
    check_commands(rec.cmd)


def test_a_second_simulator_on_the_same_clock_keeps_the_rotors_idle(seeded_policy):
    """A second simulator started beside the first (both publishing /clock, one at 0 s, one 2 s and more
    ahead) sends the clock back with every other message: the safety layer names the two clocks and
    stays DISARMED, its rotors idle (auto_arm would otherwise arm on every restart); with one simulator
    left, it arms again once the clock has gone 2 s without going back."""
    with world() as w:
        rec = Observed(w)
        w.start(*w.node_cmd("sim_bridge", clamped=True), name="sim")
        w.start(*w.node_cmd("policy_node", policy=seeded_policy, use_sim_time=True, auto_arm=True), name="policy")
        w.spin_until(lambda: rec.mode() == "armed" and rec.odom and rec.odom[-1][1] > 2.0, 60,
                     "the policy node to arm and 2 s of simulated time")
        second = w.start(*w.node_cmd("sim_bridge", clamped=True), name="sim2")
        t0 = time.monotonic()
        w.spin_until(lambda: any("more than one /clock publisher" in s["reason"] for t, s in rec.status if t >= t0),
                     30, "the safety layer to name the two clocks")
        t1 = min(t for t, s in rec.status if t >= t0 and "more than one /clock publisher" in s["reason"])
        w.spin_for(3.0)
        t_kill = time.monotonic()
        assert not rec.seen_mode("armed", t1), [s["reason"] for t, s in rec.status if t >= t1 and s["mode"] == "armed"]
        idle = [c for t, c in rec.cmd if t1 + 0.1 <= t < t_kill]  # (commands sent before the status: in flight)
        assert len(idle) > 100 and all((c == 0.0).all() for c in idle), [c for c in idle if (c != 0.0).any()][:3]
        RosWorld.stop(second, signal.SIGKILL)
        t2 = time.monotonic()
        w.spin_until(lambda: rec.seen_mode("armed", t2), CLOCK_RESTART_WINDOW_S + 20, "auto_arm with one clock left")
        t3 = min(t for t, s in rec.status if t >= t2 and s["mode"] == "armed")
    assert t3 - t2 >= CLOCK_RESTART_WINDOW_S - 0.5, t3 - t2  # 2 s without going back, counted from the last restart
    check_commands(rec.cmd)


@pytest.mark.parametrize("compute_ms", [3, 12])
def test_lockstep_flies_each_step_on_the_command_for_its_state(compute_ms):
    """sim_bridge in lock-step (the sim and hil launch files), held until the first command: a controller
    that answers each state after ``compute_ms`` (the emulated MCU takes 5-20 ms) has every step flown with
    the command computed from the state it starts from. Before, the states published while the vehicle
    sat and still in flight at its release paired every later step with the command for the state before
    it (one period of latency at 8-15 ms; a review's in-process script, 2026-11-29). In this process,
    nodes on their own executors, so the controller's delay is exact."""
    import collections
    import threading

    import rclpy
    from nav_msgs.msg import Odometry
    from rclpy.executors import SingleThreadedExecutor
    from std_msgs.msg import Float32MultiArray

    from deploy.ros import CONTROL_PUB_QOS, CONTROL_QOS, rotor_command_msg
    from deploy.sim_bridge import SimBridge
    from deploy.testing import free_domain_id

    ctx = rclpy.Context()
    rclpy.init(args=["--ros-args", "-r", "__ns:=/cf1", "-p", "lockstep:=true"], context=ctx,
               domain_id=free_domain_id())
    stop, threads = threading.Event(), []
    try:
        sim, ctl = SimBridge(context=ctx), rclpy.create_node("controller", namespace="cf1", context=ctx)
        applied = []  # (the step the simulator takes from, the state index its command was computed from)
        step = sim.backend.step
        sim.backend.step = lambda rpm, f, t: applied.append((sim.steps, round(float(rpm[0, 0])) - 10_000)) or step(
            rpm, f, t)
        pub = ctl.create_publisher(Float32MultiArray, "rotor_cmd", CONTROL_PUB_QOS)

        def answer(msg):
            k = round((msg.header.stamp.sec + 1e-9 * msg.header.stamp.nanosec) / sim.period)
            time.sleep(compute_ms * 1e-3)
            pub.publish(rotor_command_msg([10_000.0 + k] * 4))  # its state's index, in the command

        ctl.create_subscription(Odometry, "odom", answer, CONTROL_QOS)

        def spin(node):
            ex = SingleThreadedExecutor(context=ctx)
            ex.add_node(node)
            while not stop.is_set():
                ex.spin_once(timeout_sec=0.05)

        threads = [threading.Thread(target=spin, args=(n,)) for n in (sim, ctl)]
        for t in threads:
            t.start()
        time.sleep(3.0)
    finally:
        stop.set()
        for t in threads:
            t.join()
        rclpy.shutdown(context=ctx)
    offsets = collections.Counter(s - k for s, k in applied)
    assert len(applied) > 100 and offsets == {0: len(applied)}, offsets
    assert sim.lockstep_timeouts == 0


def test_a_clock_that_goes_back_reaches_status_even_if_the_next_tick_arms_again(seeded_policy):
    """The restarted simulator's first state can bring the new clock (the controller starts up again)
    and, with auto_arm, the next tick arms on it: the start-up must still be published. Driven in
    this process, callbacks called in order, so the race a real restart leaves to chance is fixed."""
    import rclpy
    from rclpy.clock import ClockType
    from rclpy.time import Time

    from deploy.policy_node import ControllerNode, load_onnx_policy
    from deploy.testing import free_domain_id

    ctx, node = rclpy.Context(), None
    rclpy.init(args=["--ros-args", "-p", f"policy:={seeded_policy}", "-p", "use_sim_time:=true",
                     "-p", "auto_arm:=true"], context=ctx, domain_id=free_domain_id())
    try:
        node = ControllerNode("policy_node", load_onnx_policy, context=ctx)
        published: list[dict] = []
        node.status_pub.publish = lambda msg: published.append(json.loads(msg.data))

        def at(t: float) -> None:  # what /clock does to the node's clock
            node.get_clock().set_ros_time_override(Time(nanoseconds=round(t * 1e9), clock_type=ClockType.ROS_TIME))
            node._on_odom(odom_msg(stamp_ns=round(t * 1e9)))
            node._tick()

        at(5.0)
        assert published[-1]["mode"] == "armed"
        at(0.01)  # the new simulator's first state
        after = [(s["mode"], s["reason"]) for s in published[[s["mode"] for s in published].index("armed") + 1:]]
        assert after and after[0][0] == "disarmed" and after[0][1].startswith("clock went back from 5.000 s to 0.010 s"), after
        assert after[-1] == ("armed", "armed"), after
    finally:
        if node is not None:
            node.destroy_node()
        ctx.try_shutdown()


def test_dropped_samples_are_logged_with_why_at_most_once_a_second(seeded_policy):
    """A dropped state sample (implausible or late) reaches the log with its reason; a burst of them
    gives one line per DROP_LOG_EVERY_S of the node's clock, with the count since the last line."""
    import rclpy
    from rclpy.clock import ClockType
    from rclpy.time import Time

    from deploy.policy_node import DROP_LOG_EVERY_S, ControllerNode, load_onnx_policy
    from deploy.testing import free_domain_id

    ctx, node = rclpy.Context(), None
    rclpy.init(args=["--ros-args", "-p", f"policy:={seeded_policy}", "-p", "use_sim_time:=true"], context=ctx,
               domain_id=free_domain_id())
    try:
        node = ControllerNode("policy_node", load_onnx_policy, context=ctx)
        lines: list[str] = []  # the drop lines the node logged
        levels: list[str] = []  # and at which level: information while disarmed, a warning once armed

        class Log:
            def warning(self, msg: str, level: str = "warning") -> None:
                if msg.startswith("state sample dropped"):
                    lines.append(msg)
                    levels.append(level)

            def info(self, msg: str) -> None:
                self.warning(msg, "info")

        node.get_logger = Log

        def at(t: float, pos=(0.0, 0.0, 1.0), stamp: float | None = None) -> None:
            node.get_clock().set_ros_time_override(Time(nanoseconds=round(t * 1e9), clock_type=ClockType.ROS_TIME))
            node._on_odom(odom_msg(pos=pos, stamp_ns=round((t if stamp is None else stamp) * 1e9)))

        at(1.0)
        at(1.01, pos=(0.0, 0.0, -0.5))  # 1.5 m in 10 ms
        assert len(lines) == 1 and lines[0].startswith("state sample dropped, implausible: position"), lines
        for k in range(2, 50):  # more within the second: counted, not logged
            at(1.0 + 0.01 * k, pos=(0.0, 0.0, -0.5) if k % 2 else (0.0, 0.0, 1.0))
        at(1.5, stamp=1.0)  # late
        assert len(lines) == 1, lines
        at(1.01 + DROP_LOG_EVERY_S, stamp=1.0)
        assert len(lines) == 2 and lines[1].startswith("state sample dropped, late: stamped 1010 ms ago"), lines
        assert lines[1].endswith("(26 dropped since the last such line)"), lines
        assert node.rejected == {"implausible": 25, "stale": 2}, node.rejected
        assert levels == ["info", "info"], levels  # disarmed: the rotors are idle
        t = 2.1 + DROP_LOG_EVERY_S
        at(t)
        assert node.controller.arm(t)[0], "a fresh valid state arms"
        at(t + 0.01, pos=(0.0, 0.0, -0.5))
        assert levels == ["info", "info", "warning"] and "implausible" in lines[-1], (levels, lines)
    finally:
        if node is not None:
            node.destroy_node()
        ctx.try_shutdown()


def odom_msg(pos=(0.0, 0.0, 1.0), quat=(1.0, 0.0, 0.0, 0.0), vel=(0.0, 0.0, 0.0), omega=(0.0, 0.0, 0.0),
             stamp_ns: int = 0, frame: str = "world"):
    from nav_msgs.msg import Odometry

    m = Odometry()
    m.header.frame_id, m.child_frame_id = frame, "cf1"
    m.header.stamp.sec, m.header.stamp.nanosec = divmod(stamp_ns, 1_000_000_000)
    p, o = m.pose.pose.position, m.pose.pose.orientation
    p.x, p.y, p.z = pos
    o.w, o.x, o.y, o.z = quat
    m.twist.twist.linear.x, m.twist.twist.linear.y, m.twist.twist.linear.z = vel
    m.twist.twist.angular.x, m.twist.twist.angular.y, m.twist.twist.angular.z = omega
    return m


def test_stale_nan_out_of_range_states_failsafe_and_recover(seeded_policy):
    with world() as w:
        rec = Observed(w)
        node = w.observer()
        from nav_msgs.msg import Odometry

        pub = node.create_publisher(Odometry, "/cf1/odom", 10)
        # four faults in a few seconds, each to recover from: more than the default 3 recoveries per 30 s
        # (that limit: test_a_policy_that_keeps_leaving_the_fence_lands_after_max_recoveries)
        policy = w.start(*w.node_cmd("policy_node", policy=seeded_policy, auto_arm=True, max_recoveries=10),
                         name="policy")
        fault = {"kind": None}

        def publish():
            now = node.get_clock().now().nanoseconds
            kind = fault["kind"]
            if kind == "stale":
                return
            msg = {"nan": odom_msg(pos=(math.nan, 0.0, 1.0), stamp_ns=now),
                   "out_of_range": odom_msg(vel=(40.0, 0.0, 0.0), stamp_ns=now),
                   "implausible": odom_msg(pos=(0.0, 0.0, -0.5), stamp_ns=now)}.get(kind, odom_msg(stamp_ns=now))
            if kind == "malformed":  # a twist in another frame than the body's
                msg.child_frame_id = "world"
            if kind == "implausible":  # one glitch below the fence's floor, at 1 m: dropped, not a cut in the air
                fault["kind"] = None
            pub.publish(msg)

        node.create_timer(PERIOD, publish)
        w.spin_until(lambda: rec.mode() == "armed", 60, "the policy node to arm")
        for kind in ("stale", "nan", "out_of_range", "malformed"):
            fault["kind"] = kind
            t0 = time.monotonic()
            w.spin_until(lambda: rec.seen_mode("failsafe", t0), 2, f"failsafe on {kind} states")
            reason = [s["reason"] for t, s in rec.status if t >= t0 and s["mode"] == "failsafe"][0]
            assert reason.startswith({"nan": "nonfinite"}.get(kind, kind)), reason
            fault["kind"] = None
            t1 = time.monotonic()
            w.spin_until(lambda: rec.seen_mode("armed", t1), 2, f"recovery after {kind}")
        t0, fault["kind"] = time.monotonic(), "implausible"
        w.spin_until(lambda: rec.status[-1][1]["rejected"].get("implausible") == 1, 2, "the glitch to be dropped")
        w.spin_until(lambda: time.monotonic() > t0 + 0.5, 2, "0.5 s")
        assert not rec.seen_mode("failsafe", t0) and rec.mode() == "armed", rec.status[-1][1]
        assert policy.poll() is None
        check_commands(rec.cmd)


def fuzz_odometry(rng: np.random.Generator, now_ns: int):
    """An Odometry with extreme, non-finite or nonsensical content (sometimes valid)."""
    specials = [math.nan, math.inf, -math.inf, 1e308, -1e308, 5e-324, 0.0, -0.0, 1e9, 3.4e38]

    def value():
        r = rng.random()
        if r < 0.3:
            return float(rng.choice(specials))
        if r < 0.6:
            return float(rng.normal() * 10.0 ** rng.integers(-3, 6))
        return float(rng.normal())

    def vec(n: int) -> tuple[float, ...]:
        return tuple(value() for _ in range(n))

    stamp = int(rng.choice([now_ns, now_ns - 10**9, now_ns + 10**9, 0, int(rng.integers(0, (2**31 - 1) * 10**9))]))
    frame = str(rng.choice(["world"] * 16 + ["", "map", "wörld", "w" * 300]))
    m = odom_msg(vec(3), vec(4), vec(3), vec(3), stamp, frame)
    m.pose.covariance = [value() for _ in range(36)]
    return m


def test_fuzz_every_subscribed_topic(seeded_policy):
    """10k malformed odometry and 10k malformed /clock messages (the node runs on sim time, so it
    subscribes to both), plus arm/e-stop calls: the node stays up, every command is finite and in
    range, and it still arms on valid states afterwards, once the clock has gone CLOCK_RESTART_WINDOW_S
    without going back."""
    from nav_msgs.msg import Odometry
    from rosgraph_msgs.msg import Clock
    from std_srvs.srv import SetBool

    rng = np.random.default_rng(0)
    with world() as w:
        rec = Observed(w)
        node = w.observer()
        odom = node.create_publisher(Odometry, "/cf1/odom", 10)
        clock = node.create_publisher(Clock, "/clock", 10)
        arm = node.create_client(SetBool, "/cf1/arm")
        policy = w.start(*w.node_cmd("policy_node", policy=seeded_policy, use_sim_time=True, auto_arm=True),
                         name="policy")
        w.spin_until(lambda: rec.status and odom.get_subscription_count() and clock.get_subscription_count(), 60,
                     "the policy node to come up")
        for i in range(10_000):
            c = Clock()
            c.clock.sec = int(rng.integers(-2**31, 2**31))
            c.clock.nanosec = int(rng.integers(0, 2**32))
            clock.publish(c)
            odom.publish(fuzz_odometry(rng, 5 * 10**9))
            if i % 1000 == 0:
                arm.call_async(SetBool.Request(data=bool(i % 2000)))
            if i % 20 == 0:
                w.executor.spin_once(timeout_sec=0)
            time.sleep(0.0004)  # ~1.5k messages/s per topic: the node's depth-1 queue keeps only the newest
        w.spin_for(1.0)
        assert policy.poll() is None, w.output(policy)
        n_during = len(rec.cmd)
        # Valid sim time and states again: the node must still work.
        t = {"ns": 10**9}

        def good():
            t["ns"] += 10**7
            c = Clock()
            c.clock.sec, c.clock.nanosec = divmod(t["ns"], 10**9)
            odom.publish(odom_msg(stamp_ns=t["ns"]))
            clock.publish(c)

        node.create_timer(PERIOD, good)
        w.spin_for(0.5)
        # The fuzzed clock went back thousands of times: arming waits until it has run steadily.
        future = arm.call_async(SetBool.Request(data=True))
        w.spin_until(future.done, 5, "the arm service")
        assert not future.result().success and "/clock publisher" in future.result().message, future.result().message
        w.spin_for(CLOCK_RESTART_WINDOW_S)
        future = arm.call_async(SetBool.Request(data=True))
        w.spin_until(future.done, 5, "the arm service")
        assert future.result().success, future.result().message
        w.spin_until(lambda: rec.mode() == "armed", 5, "armed after the fuzz")
        status = rec.status[-1][1]
    seen = status["accepted"] + sum(status["rejected"].values())
    print(f"\nfuzz: the node processed {seen} of 10000 odometry messages (accepted {status['accepted']}, "
          f"rejected {status['rejected']}), sent {n_during} commands during the fuzz")
    assert n_during > 50 and seen > 3000
    check_commands(rec.cmd)


def test_fuzz_sim_bridge_commands():
    """10k malformed rotor commands (any length, NaN, inf, huge, negative): the simulator stays up,
    ignores what is not 4 finite numbers, clips the rest, and its state stays finite."""
    from std_msgs.msg import Float32MultiArray

    rng = np.random.default_rng(1)
    specials = np.array([np.nan, np.inf, -np.inf, 3.4e38, -3.4e38, 1e-45, 0.0, -1.0, 1e6], dtype=np.float32)
    with world() as w:
        rec = Observed(w)
        cmd = w.observer().create_publisher(Float32MultiArray, "/cf1/rotor_cmd", 10)
        sim = w.start(*w.node_cmd("sim_bridge", hold_until_command=False), name="sim")
        w.spin_until(lambda: len(rec.odom) > 10 and cmd.get_subscription_count(), 60, "the simulator")
        for i in range(10_000):
            n = int(rng.choice([0, 1, 3, 4, 4, 4, 5, 100]))
            data = np.where(rng.random(n) < 0.3, rng.choice(specials, n), rng.normal(size=n) * 3e4).astype(np.float32)
            cmd.publish(Float32MultiArray(data=data.tolist()))
            if i % 20 == 0:
                w.executor.spin_once(timeout_sec=0)
            time.sleep(0.0002)
        w.spin_for(0.5)
        assert sim.poll() is None, w.output(sim)
        assert "ignored rotor command" in w.output(sim)
    pos = np.array([p for _, _, p in rec.odom])
    assert np.isfinite(pos).all() and len(pos) > 100


def test_sim_bridge_stops_the_rotors_when_commands_stop():
    """A controller that dies leaves a falling vehicle (command watchdog, 0.5 s of simulated time),
    not one that flies its last command forever; a new command drives the rotors again."""
    from std_msgs.msg import Float32MultiArray

    hover = Float32MultiArray(data=[float(NOMINAL.hover_rpm)] * 4)
    with world() as w:
        rec = Observed(w)
        cmd = w.observer().create_publisher(Float32MultiArray, "/cf1/rotor_cmd", 10)
        sim = w.start(*w.node_cmd("sim_bridge"), name="sim")
        w.spin_until(lambda: len(rec.odom) > 10 and cmd.get_subscription_count(), 60, "the simulator")
        for _ in range(30):  # ~0.3 s of hover commands: released, holds its height
            cmd.publish(hover)
            w.spin_for(PERIOD)
        w.spin_until(lambda: "released at" in w.output(sim), 10, "the release")
        w.spin_until(lambda: rec.odom[-1][2][2] < 0.01, 30, "the vehicle to fall to the floor")
        out = w.output(sim)
        assert out.count("no rotor command for 0.5 s") == 1, out
        t_stop, t_cmd = map(float, re.search(r"no rotor command for 0.5 s at t = ([0-9.]+) s \(the last at t = "
                                             r"([0-9.]+) s\)", out).groups())
        assert abs(t_stop - t_cmd - 0.5) < PERIOD / 2, (t_stop, t_cmd)  # simulated time: exact, whatever the load
        heights = [p[2] for _, s, p in rec.odom if s < t_stop]
        assert min(heights[-40:]) > 0.9, "the vehicle sank while its hover command was held"
        cmd.publish(hover)
        w.spin_until(lambda: "rotor commands again" in w.output(sim), 10, "the next command to be taken")
        assert sim.poll() is None


def test_recorder_records_a_best_effort_publisher_of_a_topic_first_seen_without_one(tmp_path):
    """A topic that shows up with only a subscriber, then gets a best-effort publisher: the recorder
    subscribes once a publisher is there, with its QoS (a reliable subscription made at first sight
    never matched it, and the topic was lost for the whole recording)."""
    from collections import Counter

    import yaml
    from mcap.reader import make_reader
    from rclpy.qos import QoSProfile, ReliabilityPolicy
    from std_msgs.msg import String

    bag = tmp_path / "rec.mcap"
    best_effort = QoSProfile(depth=10, reliability=ReliabilityPolicy.BEST_EFFORT)
    with world() as w:
        n = w.observer()
        n.create_subscription(String, "/be_topic", lambda m: None, best_effort)
        rec = w.start(*w.node_cmd("recorder", path=str(bag)), name="recorder")
        w.spin_until(lambda: "recording every topic" in w.output(rec), 60, "the recorder")
        w.spin_for(1.5)  # three discovery passes see /be_topic with no publisher
        pub = n.create_publisher(String, "/be_topic", best_effort)

        def published_and_recorded() -> bool:
            pub.publish(String(data="x"))
            return "first message on /be_topic" in w.output(rec)

        w.spin_until(published_and_recorded, 20, "the recorder's first /be_topic message")
        assert RosWorld.stop(rec, signal.SIGTERM) == 0, w.output(rec)
    with bag.open("rb") as f:
        reader = make_reader(f)
        counts = Counter(ch.topic for _, ch, _ in reader.iter_messages())
        channel = next(ch for ch in reader.get_summary().channels.values() if ch.topic == "/be_topic")
    assert counts["/be_topic"] > 0, counts
    # the publisher's offered QoS, as rosbag2 stores it (the MCAP ros2 profile requires it)
    offered = yaml.safe_load(channel.metadata["offered_qos_profiles"])
    assert len(offered) == 1 and offered[0]["reliability"] == "best_effort", offered
    assert offered[0]["durability"] == "volatile" and offered[0]["deadline"] == {"sec": 9223372036, "nsec": 854775807}
    assert channel.metadata["topic_type_hash"].startswith("RIHS01_"), channel.metadata


def test_recorder_under_sim_time_records_nothing_before_its_clock_runs(tmp_path):
    """Under use_sim_time the recorder's clock reads 0 until it hears /clock: it subscribes only after,
    so no message is logged at t = 0 (a launch's recording had the take-off's arming and first commands
    there, 0.12 s before the simulator released the vehicle), and it warns when no /clock comes."""
    from builtin_interfaces.msg import Time
    from mcap.reader import make_reader
    from rosgraph_msgs.msg import Clock
    from std_msgs.msg import String

    bag, t0 = tmp_path / "rec.mcap", 5.0  # s, the first /clock
    with world() as w:
        n = w.observer()
        pub, clock = n.create_publisher(String, "/topic", 10), n.create_publisher(Clock, "/clock", 10)
        rec = w.start(*w.node_cmd("recorder", path=str(bag), use_sim_time=True), name="recorder")
        w.spin_until(lambda: "recording every topic" in w.output(rec), 60, "the recorder")

        def warned() -> bool:  # messages without /clock, until the recorder says it records nothing (10 s)
            pub.publish(String(data="before"))
            w.spin_for(0.02)
            return "no /clock within 10 s (use_sim_time): nothing is recorded" in w.output(rec)

        w.spin_until(warned, 30, "the recorder's warning that no /clock came")
        assert "first message" not in w.output(rec), w.output(rec)
        ticks = itertools.count()

        def clocked_and_recorded() -> bool:
            sec, nanosec = divmod(round(t0 * 1e9) + 10_000_000 * next(ticks), 10**9)  # 10 ms per tick
            clock.publish(Clock(clock=Time(sec=sec, nanosec=nanosec)))
            pub.publish(String(data="after"))
            w.spin_for(0.01)
            return "first message on /topic" in w.output(rec)

        w.spin_until(clocked_and_recorded, 30, "the recorder's first /topic message")
        assert RosWorld.stop(rec, signal.SIGTERM) == 0, w.output(rec)
    with bag.open("rb") as f:
        logged = [(ch.topic, m.log_time * 1e-9, m.data) for _, ch, m in make_reader(f).iter_messages()]
    topic = [(t, data) for name, t, data in logged if name == "/topic"]
    assert topic and all(t >= t0 for t, _ in topic), topic[:5]
    assert not any(b"before" in data for _, data in topic), "a message sent before /clock was recorded"
    assert all(t >= t0 for _, t, _ in logged), [x[:2] for x in logged if x[1] < t0][:5]


def test_latency(seeded_policy):
    """State receipt -> command publication inside policy_node, with the simulator on /clock."""
    with world() as w:
        rec = Observed(w)
        w.start(*w.node_cmd("sim_bridge", clamped=True), name="sim")
        w.start(*w.node_cmd("policy_node", policy=seeded_policy, use_sim_time=True, auto_arm=True), name="policy")
        w.spin_until(lambda: rec.mode() == "armed", 60, "the policy node to arm")
        w.spin_until(lambda: rec.status[-1][1]["latency_ms"].get("n", 0) >= 500, 30, "500 commands")
        s = rec.status[-1][1]
    print(f"\nlatency state->command ms {s['latency_ms']}, inference ms {s['inference_ms']}, "
          f"watchdog ticks {s['watchdog_ticks']} of {s['ticks']}")
    assert s["latency_ms"]["p50"] < PERIOD * 1e3


# ---------------------------------------------------------------------------------------------
# launch runner, recording and plot


def test_a_stopped_recorder_records_what_is_sent_while_the_others_stop():
    """After Ctrl-C the recorder keeps taking messages while they still come (the real bridge's landing
    publishes odometry for up to 4.5 s after the launch's SIGINT): deploy.ros.drain with the recorder's
    limits (Recorder.close) takes a 2.5 s stream at 100 Hz that starts as it stops whole (gaps up to RECORD_QUIET_S between messages), and it finishes within
    its limit."""
    import threading

    import rclpy
    from rclpy.qos import QoSProfile, ReliabilityPolicy
    from std_msgs.msg import String

    from deploy.crazyflie_bridge import LANDING_LIMIT_S
    from deploy.launch import STOP_TIMEOUT
    from deploy.recorder import RECORD_AFTER_STOP_S, RECORD_QUIET_S
    from deploy.ros import drain

    assert LANDING_LIMIT_S < RECORD_AFTER_STOP_S < STOP_TIMEOUT  # the landing, before the runner's SIGTERM

    reliable = QoSProfile(depth=1000, reliability=ReliabilityPolicy.RELIABLE)
    with world() as w:
        n = w.observer()
        stopped = rclpy.create_node("stopped", context=w.context)
        got = []
        stopped.create_subscription(String, "/landing", lambda m: got.append(m.data), reliable)
        pub = n.create_publisher(String, "/landing", reliable)
        w.spin_until(lambda: pub.get_subscription_count() == 1, 20, "the subscription to match")

        def land():
            for k in range(250):
                pub.publish(String(data=str(k)))
                time.sleep(0.01)

        sender = threading.Thread(target=land)
        t0 = time.monotonic()
        sender.start()
        drain(stopped, lambda: len(got), limit_s=RECORD_AFTER_STOP_S, quiet_s=RECORD_QUIET_S)
        took = time.monotonic() - t0
        sender.join()
        stopped.destroy_node()
    assert got == [str(k) for k in range(250)] and took < RECORD_AFTER_STOP_S, (len(got), took)


def test_a_stopped_node_takes_what_is_still_queued_for_it():
    """deploy.ros.drain (the recorder's close, before it finishes the file): messages that reached a
    node's subscription queue but were never taken, as when Ctrl-C stops a recorder that runs behind,
    are taken; without it they were lost with the node."""
    import rclpy
    from rclpy.qos import QoSProfile, ReliabilityPolicy
    from std_msgs.msg import String

    from deploy.ros import drain

    reliable = QoSProfile(depth=1000, reliability=ReliabilityPolicy.RELIABLE)
    with world() as w:
        n = w.observer()
        behind = rclpy.create_node("behind", context=w.context)  # spun by nothing: it "runs behind"
        got = []
        behind.create_subscription(String, "/queued", lambda m: got.append(m.data), reliable)
        pub = n.create_publisher(String, "/queued", reliable)
        w.spin_until(lambda: pub.get_subscription_count() == 1, 20, "the subscription to match")
        for k in range(300):
            pub.publish(String(data=str(k)))
        w.spin_for(0.5)  # delivered into the queue, not taken
        assert got == []
        drain(behind, lambda: len(got))
        behind.destroy_node()
    assert got == [str(k) for k in range(300)]


def test_a_killed_recorder_keeps_what_it_recorded(tmp_path):
    """SIGKILL (no chance to finish the file): the recording holds the flight up to about the last
    0.5 s, not nothing (with 1 MiB chunks it held nothing after 10 s of a simulated flight)."""
    from deploy.plot import read_flight

    bag = tmp_path / "killed.mcap"
    with world() as w:
        observed = Observed(w)
        w.start(*w.node_cmd("sim_bridge"), name="sim")
        rec = w.start(*w.node_cmd("recorder", path=str(bag)), name="recorder")
        w.spin_until(lambda: "first message on /cf1/odom" in w.output(rec), 60, "the recorder's first odometry")
        w.spin_for(3.0)
        seen = observed.odom[-1][1]  # the newest state's stamp (simulated time) when the recorder dies
        RosWorld.stop(rec, signal.SIGKILL)
    flight = read_flight(bag, "cf1")
    assert not flight["finished"] and len(flight["t_odom"]) > 150, len(flight["t_odom"])
    # up to about its last 0.5 s (0.2 s more for the observer's and the recorder's own delivery)
    assert seen - flight["t_odom"][-1] < 0.7, (seen, flight["t_odom"][-1])


def test_record_plot_and_sigterm_stops_every_node(seeded_policy, prefix, tmp_path):
    bag = tmp_path / "flight.mcap"
    with world(prefix) as w:
        rec = Observed(w)
        launch = w.start("-m", "deploy.launch", "launch/hover.launch.xml", f"policy:={seeded_policy}",
                         "record:=true", f"bag:={bag}", name="launch")
        # DDS discovery can lag seconds behind on a loaded machine, and the recorder's subscription
        # can show in the graph ~1 s before the publisher is matched to it (a clean-clone run: 78 commands
        # 1.5 s after the subscription showed): wait for its first rotor command and its first odometry
        # (each matched on its own: a run here recorded odometry from 2.19 s of simulated time only, 52
        # samples, where the commands had come from the start), then 1.5 s more.
        w.spin_until(lambda: all(f"first message on /cf1/{t}" in w.output(launch) for t in ("rotor_cmd", "odom"))
                     and len(rec.cmd) > 100, 60, "the recorder's first rotor command and odometry, and 1 s of commands")
        w.spin_for(1.5)
        pids = [int(p) for p in re.findall(r"process started with pid \[(\d+)\]", w.output(launch))]
        assert len(pids) == 3
        assert RosWorld.stop(launch, signal.SIGTERM) == 0, w.output(launch)
        out = w.output(launch)
        for pid in pids:
            assert not Path(f"/proc/{pid}").exists() or "zombie" in Path(f"/proc/{pid}/status").read_text().lower()
    res = subprocess.run([sys.executable, "-m", "deploy.plot", str(bag)], capture_output=True, text=True, cwd=REPO,
                         timeout=60)
    assert res.returncode == 0, res.stderr
    assert Path(res.stdout.strip()).stat().st_size > 10_000
    from deploy.plot import read_flight

    flight = read_flight(bag, "cf1")
    assert len(flight["t_odom"]) > 100 and len(flight["t_cmd"]) > 100 and flight["status"]
    # auto_arm waited for the recorder (record:=true), so the recording holds the take-off: the arming
    # itself on /status, and the policy's commands from the first one the simulator flew
    assert "the recorder takes rotor_cmd and status" in out, out
    # lock-step: every armed tick acted on the state of its own instant (the newest status is the recorder's last)
    last = flight["status"][-1][1]
    assert last["older_state_ticks"] <= 0.01 * last["ticks"], last
    modes = [(st["mode"], st["reason"]) for _, st in flight["status"]]
    k = next(i for i, (mode, _) in enumerate(modes) if mode == "armed")
    assert modes[k] == ("armed", "armed") and all(mode == "disarmed" for mode, _ in modes[:k]), modes[:k + 1]
    released = float(re.search(r"released at t = ([\d.]+) s", out).group(1))
    first_flown = flight["t_cmd"][np.argmax(flight["rpm"].max(axis=1) > 0)]  # before it: idle commands
    assert abs(flight["status"][k][0] - released) < 0.025 and abs(first_flown - released) < 0.025, \
        (released, flight["status"][k][0], first_flown)
