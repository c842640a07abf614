"""policy_node: the exported policy (ONNX) behind the safety layer, on ROS 2.

    python -m deploy.policy_node --ros-args -r __ns:=/cf1 -p policy:=<run_dir>/export/policy.onnx

Subscribes   odom (nav_msgs/Odometry: pose world ENU, twist BODY frame, REP 105)
Publishes    rotor_cmd (std_msgs/Float32MultiArray: 4 rotor speed setpoints in rpm, M1..M4, the
             policy contract's mapping rpm = (a + 1) / 2 * rpm_max of the clipped action a),
             status (std_msgs/String, JSON: mode, reason, failsafe_count, recoveries (within the
             window), target, setpoint (what the policy flies to, null when it does not fly), latency and
             inference time percentiles in ms, accepted and rejected state counts, control ticks,
             watchdog ticks and (sim time) armed ticks on a state older than the tick, link (null, or
             why commands cannot reach the vehicle); on every mode change and at 10 Hz)
Services     arm (std_srvs/SetBool), emergency_stop (std_srvs/Trigger)
Rules        deploy/safety.py. Every received state is checked (finite, plausible, header stamp
             not ahead of this node's clock by more than stale_timeout, pose in the world frame, twist in
             the body frame named by the robot parameter) before it can reach the policy. A state
             stamped more than stale_timeout ago arrived late: it is dropped (counted as rejected
             "stale"), as is one taken before the last valid state ("out_of_order") or one that jumped
             from it ("implausible", deploy/safety.py),
             and the failsafe follows from the last valid state's age if nothing newer comes. Dropped
             samples are logged with the reason, one line a second at most (with the count since the last).

Timing: one control tick per policy period (contract, 10 ms) on the node's clock: a steady wall
clock, or /clock with use_sim_time:=true. The safety layer runs on that clock too: under sim time a
state is stale when it is stale_timeout old in simulated time, so a simulator slowed down by a busy
host (the simulated world pauses with it) is not a fault; with sim_bridge in lock-step (the sim and
hil launch files) the policy sees exactly one tick per 10 ms of simulated time, as in training. A simulator that stops altogether stops /clock: a
steady-clock watchdog then declares the state stale once /clock, having run, has not advanced for
clock_timeout wall seconds (0.5 s: longer than the stalls of a loaded host, measured up to ~70 ms) and keeps
ticking the failsafe until /clock moves again; a stall of this node's own is not taken for a stopped
/clock (see _watchdog). Before the first /clock the node ticks on the steady
clock too (idle rotors, status), with nothing to arm on.
Latency: wall time from the receipt of a state to the publication of the command computed from
it (each state counted once), reported in status and printed at exit.

The node runs any policy callable (obs (22,) float32 -> action (4,)); firmware_bridge reuses it
with the policy on the emulated MCU.
"""

from __future__ import annotations

import json
import math
import sys
import time
from collections import deque
from pathlib import Path
from typing import Callable

import numpy as np

from .ros import (
    ARM,
    CONTROL_PUB_QOS,
    ESTOP,
    ODOM,
    ROTOR_CMD,
    STATUS,
    STATE_QOS,
    STATUS_QOS,
    WORLD_FRAME,
    Node,
    param,
    refuse_unknown_parameters,
    rotor_command_msg,
    run_node,
    vector_param,
)
from .safety import Command, Mode, OnboardDescent, SafeController, SafetyConfig
from .state import InvalidState, stamp_seconds, state_from_odometry

Policy = Callable[[np.ndarray], np.ndarray]
RECORDER = "recorder"  # the recorder node's name (deploy/recorder.py), which wait_for_recorder_s waits for
STATUS_EVERY = 10  # ticks between periodic status messages (10 Hz at the 10 ms period)
DROP_LOG_EVERY_S = 1.0  # at most one log line per this many seconds (node clock) about dropped state samples
# At most one log line per this many seconds (node clock) about the same kind of failed actuation: a radio
# error that comes and goes between sent setpoints logged up to every period (100 lines/s) before.
ACTUATION_LOG_EVERY_S = 5.0


class LogLimiter:
    """At most one log line per ``every`` seconds (the caller's clock) for events of one kind; an event of
    another kind than the last line's gets its line at once, and a clock that went back lets a line through."""

    def __init__(self, every: float):
        self.every = every
        self._kind: str | None = None  # the kind of the last line
        self._at, self._held = -math.inf, 0  # its time (s), and the events of its kind held back since

    def due(self, kind: str, t: float) -> int | None:
        """None if the event at ``t`` (s) gets no line; else how many of its kind were held back since that
        kind's last line (0 after a line of another kind)."""
        if kind == self._kind and 0.0 <= t - self._at < self.every:
            self._held += 1
            return None
        held = self._held if kind == self._kind else 0
        self._kind, self._at, self._held = kind, t, 0
        return held


class Percentiles:
    """Rolling p50/p99 of the last ``n`` samples (s), reported in ms."""

    def __init__(self, n: int = 10_000):
        self.samples: deque[float] = deque(maxlen=n)

    def add(self, seconds: float) -> None:
        self.samples.append(seconds)

    def summary(self) -> dict:
        if not self.samples:
            return {"n": 0}
        a = np.asarray(self.samples) * 1e3
        return {"n": len(a), "p50": round(float(np.percentile(a, 50)), 3), "p99": round(float(np.percentile(a, 99)), 3),
                "max": round(float(a.max()), 3)}


def load_onnx_policy(path: str) -> tuple[Policy, dict]:
    """OnnxPolicy (contract checked on load) as a single-observation callable, and its contract. A
    model of chunks of actions or that takes the diffusion noise as an input is refused here: these
    nodes apply one action per period from one observation (it would arm, then fail safe at once)."""
    from export.onnx_policy import ContractError, OnnxPolicy

    onnx = OnnxPolicy(path)
    if onnx.noise_size or "exec_horizon" in onnx.metadata:
        raise ContractError(f"{path} is a diffusion policy (chunks of {onnx.metadata.get('exec_horizon', '?')} "
                            f"actions{', the noise as an input' if onnx.noise_size else ''}): the deploy nodes "
                            "fly one action per period; export a policy of one action (ppo, sac)")
    return (lambda obs: onnx(obs)[0]), onnx.contract


class ControllerNode(Node):
    """Safety layer + policy callable on ROS: states in, rotor commands and status out."""

    # Whether the vehicle's onboard policy flies a failsafe descent (safety.OnboardDescent: the bridges to
    # the real vehicle and to the emulated MCU) instead of the safety layer's open-loop rotor command; its
    # timer then times that descent (it brakes to the floor) and allows for its lag.
    ONBOARD_DESCENT = False

    def __init__(self, name: str, make_policy: Callable[[str], tuple[Policy, dict]], **node_options):
        """``node_options`` go to rclpy's Node (``context=`` for a node built inside a test)."""
        super().__init__(name, **node_options)
        refuse_unknown_parameters(self, name)
        from nav_msgs.msg import Odometry
        from rclpy.clock import Clock, ClockType
        from std_msgs.msg import Float32MultiArray, String
        from std_srvs.srv import SetBool, Trigger

        from sim.crazyflie.params import NOMINAL, action_to_rpm

        self.robot = param(self, "robot", "cf1", "robot name: frame id of the body")
        policy_path = param(self, "policy", "", "exported policy: <run_dir>/export/policy.onnx")
        if not policy_path:
            raise ValueError("parameter 'policy' is empty: pass policy:=<run_dir>/export/policy.onnx")
        self.world_frame = param(self, "world_frame", WORLD_FRAME, "frame id of the world (ENU) frame")
        d = SafetyConfig()
        cfg = SafetyConfig(
            target=tuple(vector_param(self, "target", list(d.target), "hover target, world, m")),
            stale_timeout=float(param(self, "stale_timeout", d.stale_timeout, "s")),
            geofence_min=tuple(vector_param(self, "geofence_min", list(d.geofence_min), "world, m")),
            geofence_max=tuple(vector_param(self, "geofence_max", list(d.geofence_max), "world, m")),
            max_action=float(param(self, "max_action", d.max_action, "upper clip of every action")),
            descent_thrust_ratio=float(param(self, "descent_thrust_ratio", d.descent_thrust_ratio, "of hover")),
            ground_height=float(param(self, "ground_height", d.ground_height, "world z of the floor, m")),
            landed_height=float(param(self, "landed_height", d.landed_height, "m above the floor")),
            recover_count=int(param(self, "recover_count", d.recover_count, "valid states ending a failsafe")),
            max_recoveries=int(param(self, "max_recoveries", d.max_recoveries, "recovered failsafes per window")),
            recovery_window=float(param(self, "recovery_window", d.recovery_window, "s: window of max_recoveries")),
            takeoff_speed=float(param(self, "takeoff_speed", d.takeoff_speed, "m/s: setpoint from take-over to target")),
            ground_timeout=float(param(self, "ground_timeout", d.ground_timeout, "s on the floor while armed: cut")),
            max_arm_tilt_deg=float(param(self, "max_arm_tilt_deg", d.max_arm_tilt_deg, "deg: no arming above it")),
            max_arm_speed=float(param(self, "max_arm_speed", d.max_arm_speed, "m/s per axis: no arming above it")),
            max_arm_rate=float(param(self, "max_arm_rate", d.max_arm_rate, "rad/s per axis: no arming above it")),
            max_tilt_deg=float(param(self, "max_tilt_deg", d.max_tilt_deg, "deg: tumbled above it, rotors cut")),
            max_held_tilt_deg=float(param(self, "max_held_tilt_deg", d.max_held_tilt_deg,
                                          "deg: held above it for max_held_tilt_s, rotors cut")),
            max_held_tilt_s=float(param(self, "max_held_tilt_s", d.max_held_tilt_s, "s: see max_held_tilt_deg")),
            max_jump=float(param(self, "max_jump", d.max_jump, "m beyond max speed: a sample farther is dropped")),
            max_attitude_jump_deg=float(param(self, "max_attitude_jump_deg", d.max_attitude_jump_deg,
                                              "deg beyond the body rates: a sample turned further is dropped")),
            auto_arm=bool(param(self, "auto_arm", d.auto_arm, "arm on the first valid state")),
        )
        # Recording a simulated flight (hover.launch.xml record:=true): the flight starts once the recorder
        # takes this node's commands and status, so the recording holds the take-off (the recorder finds
        # topics every 0.5 s and DDS matches them later still: a run armed 0.26 s before it listened).
        wait_s = float(param(self, "wait_for_recorder_s", 0.0, "auto_arm: wall s to wait for the recorder (0: none)"))
        if not 0.0 <= wait_s < math.inf:
            raise ValueError(f"parameter wait_for_recorder_s={wait_s}: expected a finite time >= 0 s (0: do not wait)")
        self._recorder_wait_s = wait_s
        # Counted from when the publishers exist (below); under sim time from the first /clock, since the
        # recorder subscribes only once it has heard /clock too (deploy/recorder.py) and a simulator that
        # starts slowly would otherwise use up the wait.
        self._recorder_deadline: float | None = None
        self._recorder_hold = (f"waiting for the recorder (at most {wait_s:g} s)" if wait_s > 0.0 and cfg.auto_arm
                               else None)
        self.clock_timeout = float(param(self, "clock_timeout", 0.5, "sim time: wall s without /clock = dead"))
        if not self.clock_timeout > 0.0 or not math.isfinite(self.clock_timeout):  # NaN would never fire
            raise ValueError(f"parameter clock_timeout={self.clock_timeout}: expected a positive time (s)")
        policy, contract = make_policy(str(Path(policy_path).expanduser()))
        self.period = float(contract["policy_period_s"])
        self.rpm_max = float(contract["rpm_max"])
        self._to_rpm = lambda a: action_to_rpm(a, self.rpm_max)
        self.descent = OnboardDescent(cfg) if self.ONBOARD_DESCENT else None
        self.controller = SafeController(self._timed(policy), cfg, NOMINAL,
                                         descent=self.descent.profile if self.descent else None)
        self.stale_timeout = cfg.stale_timeout

        self.cmd_pub = self.create_publisher(Float32MultiArray, ROTOR_CMD, CONTROL_PUB_QOS)
        self.status_pub = self.create_publisher(String, STATUS, STATUS_QOS)
        self._status_msg = String
        self.use_sim_time = bool(self.get_parameter("use_sim_time").value)
        if self._recorder_hold is not None and not self.use_sim_time:  # the recorder can subscribe from now on
            self._recorder_deadline = time.monotonic() + wait_s
        self.create_subscription(Odometry, ODOM, self._on_odom, STATE_QOS)
        self.create_service(SetBool, ARM, self._on_arm)
        self.create_service(Trigger, ESTOP, self._on_estop)

        self.latency, self.inference = Percentiles(), Percentiles()
        self.rejected: dict[str, int] = {}
        self.accepted = 0  # valid states received
        self._drop_log = LogLimiter(DROP_LOG_EVERY_S)  # on _now()
        self._state_received_at: float | None = None  # perf_counter of the newest unused state
        self._ticks = 0
        self.watchdog_ticks = 0  # ticks forced by the steady clock because /clock stopped
        # Sim time: ARMED ticks whose newest state was older than the tick (its instant's odometry not yet
        # taken when /clock ticked): the policy then acts one period late, which lock-step is meant to avoid
        self.older_state_ticks = 0
        self._last = ("", "")
        self._actuate_log = LogLimiter(ACTUATION_LOG_EVERY_S)  # on _now(), per kind of failure
        self._clock_seen_wall: float | None = None  # when /clock last drove a tick (sim time)
        # Sim time, steady-clock seconds (time.monotonic): the watchdog's last run, when this node last ran
        # again after a stall of its own, and whether the watchdog is ticking for a stopped /clock
        self._watchdog_ran: float | None = None
        self._running_since = -math.inf
        self._clock_stopped = False
        steady = Clock(clock_type=ClockType.STEADY_TIME)
        if self.use_sim_time:
            self.create_timer(self.period, self._clock_tick)  # node clock = /clock
            self.create_timer(self.period, self._watchdog, clock=steady)
        else:
            self.create_timer(self.period, self._tick, clock=steady)
        self.get_logger().info(f"{name}: {policy_path}, period {self.period * 1e3:g} ms, "
                               f"{'sim' if self.use_sim_time else 'wall'} time, "
                               f"target {[float(v) for v in cfg.target]} m")

    def _now(self) -> float:
        """The safety layer's time (s): simulated time under use_sim_time, else steady wall time."""
        return self.get_clock().now().nanoseconds * 1e-9 if self.use_sim_time else time.monotonic()

    # ------------------------------------------------------------------ inputs
    def _timed(self, policy: Policy) -> Policy:
        def run(obs: np.ndarray) -> np.ndarray:
            t0 = time.perf_counter()
            try:
                return policy(obs)
            finally:
                self.inference.add(time.perf_counter() - t0)

        return run

    def _on_odom(self, msg) -> None:
        now = self._now()
        try:
            if msg.header.frame_id != self.world_frame:
                raise InvalidState("malformed", f"pose frame '{msg.header.frame_id}', expected '{self.world_frame}'")
            if msg.child_frame_id != self.robot:  # the twist must be in this vehicle's body frame (REP 105)
                raise InvalidState("malformed", f"twist frame '{msg.child_frame_id}', expected the body frame "
                                                f"'{self.robot}'")
            state = state_from_odometry(msg)
            age = self.get_clock().now().nanoseconds * 1e-9 - stamp_seconds(msg.header.stamp)
            if age < -self.stale_timeout:  # stamped ahead of this node's clock: the clocks disagree
                raise InvalidState("stale", f"header stamp {-age * 1e3:.0f} ms ahead of this node's clock")
        except InvalidState as e:
            self.rejected[e.reason] = self.rejected.get(e.reason, 0) + 1
            self.controller.on_state(None, now, str(e))
        except Exception as e:  # anything else a message can do to the conversion: reject, never crash
            self.rejected["malformed"] = self.rejected.get("malformed", 0) + 1
            self.controller.on_state(None, now, f"malformed: {type(e).__name__}")
        else:
            if age > self.stale_timeout:
                # Late (a delayed delivery, a radio's retry burst): dropped and counted, not a fault of its
                # own. A newer sample may follow within the period; if none does, the last valid state
                # goes stale and fails safe by its own age.
                self.rejected["stale"] = self.rejected.get("stale", 0) + 1
                self._log_drop(f"late: stamped {age * 1e3:.0f} ms ago (limit {self.stale_timeout * 1e3:.0f} ms)")
                return
            # stale from its stamp on, not from its receipt
            dropped = self.controller.on_state(state, now, age=age)
            if dropped is None:
                self._state_received_at = time.perf_counter()
                self.accepted += 1
            else:  # taken before the last valid state, or a jump from it (deploy/safety.py, "Implausible samples")
                kind = dropped.split(":", 1)[0]  # "out_of_order" or "implausible"
                self.rejected[kind] = self.rejected.get(kind, 0) + 1
                self._log_drop(dropped)
        self._report_change()

    def _log_drop(self, why: str) -> None:
        """Log a dropped state sample and why, at most once per DROP_LOG_EVERY_S with the count since the
        last such line: a glitch is seen in the log, a burst of them does not flood it (status counts all).
        A warning while the rotors may turn; information while disarmed (a simulator's first samples come
        late while the processes start: that warned on every healthy start)."""
        held = self._drop_log.due("dropped", self._now())
        if held is not None:
            log = self.get_logger()
            (log.info if self.controller.mode is Mode.DISARMED else log.warning)(
                f"state sample dropped, {why}" + (f" ({held + 1} dropped since the last such line)" if held else ""))

    def _log_actuation_failure(self, kind: str) -> None:
        """Log a failed actuation: a new kind of failure at once, the same kind again at most once per
        ACTUATION_LOG_EVERY_S (node clock), with how often it came since its last line."""
        held = self._actuate_log.due(kind, self._now())
        if held is not None:
            self.get_logger().error(f"actuation failed: {kind}"
                                    + (f" (and {held} times since its last line, not logged)" if held else ""))

    def link_problem(self) -> str | None:
        """Why commands cannot reach the vehicle (crazyflie_bridge: no radio link), or None."""
        return None

    def policy_problem(self) -> str | None:
        """Why the policy cannot fly at all (firmware_bridge: a failed MCU), or None: no arming, no recovery."""
        return None

    def arm_problem(self) -> str | None:
        """Why the vehicle must not be armed: a link problem or a policy problem, or None."""
        return self.link_problem() or self.policy_problem()

    def _on_arm(self, request, response):
        now = self._now()
        link, refusal = self.link_problem(), self.arm_problem()
        if request.data and refusal is not None:
            response.success, response.message = False, f"refused to arm: {refusal}"
        elif request.data:
            response.success, response.message = self.controller.arm(now)
        else:
            response.success, response.message = link is None, self.controller.disarm(now)
            if link is not None:
                response.message += f" (NOT delivered: {link})"
        self.get_logger().info(f"arm({request.data}): {response.message}")
        # Status now; the mode's rotor command follows at the next tick (within a period): a tick
        # here would run the policy twice in one period.
        self._report_change(always=True)
        return response

    def _on_estop(self, request, response):
        link = self.link_problem()
        response.success, response.message = link is None, self.controller.estop()
        if link is not None:
            response.message += f" (NOT delivered: {link})"
        self.get_logger().warning(response.message)
        self._tick()
        return response

    def _report_change(self, always: bool = False) -> None:
        """Publish status now if a state or service changed the mode outside a tick (a clock that went
        back starts the controller up again): the next tick may change it once more (auto_arm arms on
        the state that came with the new clock), and every transition must reach /status and the log.
        The mode's rotor command follows at the next tick: a mode that the next tick changes again
        (a start-up re-armed at once) is reported but never commanded (no idle command, no actuate())."""
        c = self.controller
        if always or (c.mode.value, c.reason) != self._last:
            self._publish_status(Command(c.prev_action.copy(), c.mode, c.reason))

    # ------------------------------------------------------------------ control
    def _clock_tick(self) -> None:
        if self._clock_seen_wall is None and self._recorder_hold is not None:  # the first /clock
            self._recorder_deadline = time.monotonic() + self._recorder_wait_s
        self._tick()
        self._clock_seen_wall = time.monotonic()  # after the tick: a slow tick is not a stopped clock

    def _watchdog(self) -> None:
        """Sim time: tick on the steady clock, with the state marked unusable, while /clock is silent.

        A run that comes more than a quarter of clock_timeout after the previous one means this node
        itself did not run (a stalled process): the /clock messages sent meanwhile may still be on their
        way into its queue, and rclpy's executor serves ready timers before subscriptions. So a /clock
        that was running is judged stopped only once the node has run again for a quarter of
        clock_timeout: its own stall is not read as a stopped /clock. That grace is given once per
        silence of /clock (a node stalling again and again does not postpone the failsafe for good, nor
        does a clock_timeout so short that every run seems late): a /clock that did stop is declared at
        most a quarter of clock_timeout (and a period) after the later of its limit and the node's return.
        A watchdog already ticking goes on ticking."""
        now = time.monotonic()
        if (self._watchdog_ran is not None and now - self._watchdog_ran > self.clock_timeout / 4
                and self._clock_seen_wall is not None and self._clock_seen_wall > self._running_since):
            self._running_since = now
        self._watchdog_ran = now
        if self._clock_seen_wall is None:
            why = "no /clock yet: waiting for the simulator"
        else:
            stopped = now - self._clock_seen_wall
            if stopped <= self.clock_timeout:
                self._clock_stopped = False
                return
            if not self._clock_stopped and now - self._running_since <= self.clock_timeout / 4:
                return
            self._clock_stopped = True
            self.watchdog_ticks += 1
            why = f"stale: /clock stopped {stopped * 1e3:.0f} ms ago (limit {self.clock_timeout * 1e3:.0f} ms)"
        self.controller.on_state(None, self._now(), why)
        self._tick()

    def _recorder_listening(self) -> bool:
        """Whether a node named ``recorder`` subscribes to this node's rotor_cmd and status, and the
        publisher is matched to every subscription the graph shows (a subscription can show in the graph
        a second before DDS matches it: what is published meanwhile never reaches it)."""
        def listening(pub) -> bool:
            subs = self.get_subscriptions_info_by_topic(pub.topic_name)
            return any(i.node_name == RECORDER for i in subs) and pub.get_subscription_count() >= len(subs)

        return all(listening(pub) for pub in (self.cmd_pub, self.status_pub))

    def _hold_for_recorder(self) -> None:
        """Release auto_arm's hold once the recorder listens, or at the deadline (with a warning)."""
        if self._recorder_listening():
            self.get_logger().info("the recorder takes rotor_cmd and status: auto_arm may arm")
        elif time.monotonic() >= self._recorder_deadline:
            self.get_logger().warning(f"no recorder took rotor_cmd and status within wait_for_recorder_s: "
                                      "arming without it (the recording may miss the take-off)")
        else:
            return
        self._recorder_deadline = self._recorder_hold = None

    def _tick(self) -> None:
        if self._recorder_deadline is not None:
            self._hold_for_recorder()
        # auto_arm waits while the vehicle must not be armed (a failed MCU) or the recorder is not listening;
        # a failsafe lands instead of recovering while the policy cannot fly
        self.controller.auto_arm_hold = self.arm_problem() or self._recorder_hold
        self.controller.recovery_hold = self.policy_problem()
        now = self._now()
        received = self._state_received_at
        latest = self.controller.latest
        cmd = self.vehicle_command(self.controller.tick(now), now)
        if self.use_sim_time and cmd.mode is Mode.ARMED and latest is not None and latest.stamp < now - 5e-4:
            self.older_state_ticks += 1
        try:
            self.actuate(cmd, now)
        except Exception as e:  # hardware output failing (a dead MCU, a radio error) must not stop the ticks
            self._log_actuation_failure(f"{type(e).__name__}: {e}"[:200])
        self._publish_tick(cmd)
        if received is not None:
            if cmd.mode is Mode.ARMED:
                self.latency.add(time.perf_counter() - received)
            self._state_received_at = None

    def _publish_tick(self, cmd: Command) -> None:
        """One tick's rotor_cmd, and /status on a change of mode or reason and every STATUS_EVERY ticks."""
        self.cmd_pub.publish(rotor_command_msg(self._to_rpm(cmd.action)))
        self._ticks += 1
        if (cmd.mode.value, cmd.reason) != self._last or self._ticks % STATUS_EVERY == 0:
            self._publish_status(cmd)

    def vehicle_command(self, cmd: Command, now: float) -> Command:
        """The rotor command the vehicle gets for the safety layer's ``cmd``: that one here; firmware_bridge's
        MCU flies the failsafe descent itself, as the real vehicle's onboard policy does."""
        return cmd

    def actuate(self, cmd: Command, now: float) -> None:
        """Hardware output besides rotor_cmd; crazyflie_bridge sends setpoints to the vehicle here."""

    def _publish_status(self, cmd: Command) -> None:
        if (cmd.mode.value, cmd.reason) != self._last:
            if cmd.mode is Mode.ARMED:
                self.get_logger().info(f"{cmd.mode.value}: {cmd.reason}")
            else:
                self.get_logger().warning(f"{cmd.mode.value}: {cmd.reason}")
        self._last = (cmd.mode.value, cmd.reason)
        status = {"robot": self.robot, **self.controller.status(), "t": self.get_clock().now().nanoseconds * 1e-9,
                  "latency_ms": self.latency.summary(), "inference_ms": self.inference.summary(),
                  "accepted": self.accepted, "rejected": self.rejected, "ticks": self._ticks, "link": self.link_problem(),
                  "watchdog_ticks": self.watchdog_ticks, "older_state_ticks": self.older_state_ticks}
        self.status_pub.publish(self._status_msg(data=json.dumps(status)))

    def close(self) -> None:
        print(f"{self.get_name()} latency state->command ms {self.latency.summary()}, "
              f"inference ms {self.inference.summary()}", flush=True)


def main() -> int:
    from export.onnx_policy import ContractError

    return run_node(lambda: ControllerNode("policy_node", load_onnx_policy), (ContractError,))


if __name__ == "__main__":
    sys.exit(main())
