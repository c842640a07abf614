"""Safety layer around a policy: arming, emergency stop, geofence, command clipping, failsafe.

Pure Python (no ROS), so every rule is unit-testable; the ROS nodes feed it states and call
:meth:`SafeController.tick` once per policy period. Time ``now`` (s) is the node's clock: steady
wall time on hardware, simulated time under a simulator.

Modes and rules, checked on every tick:
  DISARMED  rotors at idle (0 rpm). ``arm()`` (std_srvs/SetBool true) switches to ARMED only with
            a fresh, valid state inside the geofence, tilted no more than ``max_arm_tilt_deg``, moving
            no faster than ``max_arm_speed`` and turning no faster than ``max_arm_rate`` on any axis
            (the hover training's initial states: a vehicle carried or thrown is outside what the policy
            learnt from; none of these is checked when arming from a failsafe descent, as for a recovery:
            in flight the policy flies a tilted, moving vehicle, which the descent's attitude-neutral
            command does not level), and a steady clock (below). With ``auto_arm`` the first such state arms
            once after start-up (simulation and HIL launch files use it, real flights do not), unless
            the caller holds it (``auto_arm_hold``: policy_node while the recorder is not listening,
            firmware_bridge with a failed MCU).
  ARMED     the policy flies, to a setpoint that starts where the vehicle is when the policy takes
            over (arming, recovery) and moves in a straight line to ``target`` at ``takeoff_speed``
            (a vehicle armed on the floor, as a real one is, would otherwise start 1 m and more from
            its target, farther than the hover training's initial states: the heaviest, weakest
            vehicles of the randomization then tipped over on the floor instead of taking off).
            A state problem (older than ``stale_timeout`` by its stamp, non-finite, out of
            range, outside the geofence) or a policy error (exception, non-finite or misshapen
            output) switches to FAILSAFE in the same tick. A rejected state counts at the next tick
            even if a valid one arrived after it. Actions are clipped to [-1, max_action].
            A valid state tilted beyond ``max_tilt_deg`` (upside down by default) is a state problem
            (FAILSAFE: the policy does not fly on it); confirmed by the next sample, tilted beyond it as
            well or out of range or non-finite (a tumbling vehicle's rates exceed the limits), while
            current (younger than ``stale_timeout``; ARMED or FAILSAFE), or followed by no sample at all
            before it goes stale (a tumbling vehicle lost by the motion capture), it is a tumble: the
            rotors are cut (DISARMED, counted in ``failsafe_count``), as a descent's thrust would drive a
            tumbled vehicle into the floor. One sample is not enough: after a few lost samples the attitude
            check below lets one through that is upside down (180 deg after ~70 ms), and a glitch must
            not cut the rotors in the air; the next, level sample is dropped against it (no confirmation
            counts after that), the stale rule keeps the failsafe, and the vehicle recovers once its
            samples are plausible again.
            Current valid states tilted beyond ``max_held_tilt_deg`` (60 deg) for ``max_held_tilt_s`` (0.5 s)
            while ARMED or FAILSAFE cut the rotors (DISARMED, counted): a vehicle held tilted (caught in a
            net, wedged) is not flying, and its thrust only pushes it on.
            A vehicle whose valid states show it on the floor (below ``landed_height``) for
            ``ground_timeout`` without a break while ARMED did not take off, or came down and cannot
            leave the floor (tipped over, a broken rotor): the rotors are cut and the mode is DISARMED
            (counted in ``failsafe_count``, as a failsafe on the ground, which also cuts at once, is).
  FAILSAFE  controlled descent: every rotor at the speed giving ``descent_thrust_ratio`` of the
            hover thrust (a fixed, attitude-neutral command: with no trustworthy state there is
            nothing to close a loop on), so the vehicle sinks at (1 - ratio) g, for the time the
            last valid height and vertical velocity take to reach the floor at that acceleration
            (a vehicle climbing when the failsafe starts rises first) plus the rotors' spin-down (the
            bridges whose onboard policy flies the descent time its braking setpoints instead and add
            the policy's lag: DescentProfile.onboard), or until it has landed: ``LANDED_SAMPLES`` valid
            states below ``landed_height`` with none at twice that height or more and no dropped sample
            between them, no sooner than it could have fallen
            freely from the last state in the air (one at twice that height or more, as are
            ``LANDED_SAMPLES`` of the last 2 ``LANDED_SAMPLES`` - 1: fewer may be the estimate's noise)
            (a glitch to the floor may be believed: see "Implausible samples");
            then the rotors are cut and the mode is DISARMED: flying again needs re-arming. Valid states
            that still show it in the air (a geofence failsafe keeps receiving them) extend the descent
            to their own fall time, up to twice the first estimate (a state that is fresh but wrong must
            not keep the rotors spinning forever).
            On the ground (landed by the rule above, or below ``landed_height`` having never been
            in the air since start-up) or with no valid state ever, the rotors are cut at once.
            Recovery: while still descending, ``recover_count`` consecutive valid states inside
            the geofence (a stale gap or a state outside starts the count again) hand control
            back to the policy without re-arming, at most ``max_recoveries`` times within
            ``recovery_window`` seconds: a policy that keeps flying out of the fence (or a fault that
            keeps coming back) would otherwise chatter between ARMED and FAILSAFE at the fence
            forever, as each new failsafe starts a new descent; once they are used up, a failsafe
            lands. Link gaps spread over a long flight do not add up (re-arming also clears them).
            No recovery while the caller says the policy cannot fly (``recovery_hold``: firmware_bridge
            with a failed MCU, whose every policy call fails): that failsafe lands.
  ESTOP     ``estop()`` (std_srvs/Trigger): rotors cut at once, latched until ``arm()``.
A sample taken before the last valid state (reordered in transport) is dropped: flown on, it would put
the state back in time. Implausible samples (a glitch of the estimator or the motion capture: an outlier,
a swapped marker) are dropped, as a sample that arrived late is: the policy flies on the last valid
state, and the stale rule fails safe if no plausible sample follows within ``stale_timeout``.
Dropped samples (implausible or out of order: a second source's samples stamped ahead of the
vehicle's make the vehicle's out of order) that have come over more than ``stale_timeout`` within the last twice
``stale_timeout``, a third of all the samples received then or more (half as many as the valid ones),
with valid ones among them, the last within ``stale_timeout``, are a state problem (a failsafe, no
recovery, no arming): a second source of states interleaved with the vehicle's, at up to twice its
rate, would otherwise keep a wrong last valid state current (a faster one cannot be told from an
intermittent glitch by counting, and is not caught; nor is one within ``max_jump`` of the vehicle,
whose samples are all valid); rarer ones (an intermittent glitch: one sample in four) are only dropped;
random outliers in 5-10 % of the samples come in such clusters within seconds. A sample is implausible
when it lies farther from the last valid state than StateLimits.max_speed covers in the time between the two
(each taken at its receipt minus its age), plus ``max_jump``, or its tilt (the body z axis from the last
valid state's) changed more than the two samples' mean roll and pitch rate, sped up at
``max_angular_accel``, covers in that time, plus ``max_attitude_jump_deg`` (yaw is not compared: no rule
depends on it). Believed, one sample below the fence's floor would cut the rotors of a vehicle in the
air, and one upside down would be a failsafe. An estimate that jumped and stays (a re-converged filter)
is believed once the time since the last valid state covers the jump at max_speed: a jump of up to
``max_jump`` plus max_speed x ``stale_timeout`` (0.8 m by default) reaches the policy as a step of its
position error, as without this rule; a larger one comes after the stale rule's failsafe, so the policy
takes over again by a recovery, its setpoint ramp starting where the estimate now puts the vehicle. A
glitch that lasts that long is believed as well (a glitch to the floor then does not end a failsafe
descent sooner than a free fall from the last valid height could have). A dropped sample restarts the
recovery count and the floor's count of a landing (two sources that disagree are not a vehicle on the
floor). Velocities are not compared between samples (a collision changes them at once).
A clock that goes back (a simulator reset or restart: /clock from 0 again) starts the controller up
again, DISARMED (``auto_arm`` arms it again on the first valid state unless the operator disarmed or
stopped it since the last arming; an emergency stop stays latched): its kept times would lie ahead.
It is seen only if the new clock is first heard before it has passed the old one. A new simulator
process is heard once DDS has discovered it (2.9 s after its first message in one test run here; Fast
DDS announces a participant 5 times at 100 ms, then every 3 s): a simulator restarted after its
predecessor had run less than about 3 s of simulated time (at real_time_factor 1) can first be heard
ahead of where the old clock stopped, and is taken for a clock that stopped and went on (the stale
rule's failsafe, then a recovery, as for a paused simulator).
A clock that goes back ``CLOCK_RESTARTS_MAX`` times within ``CLOCK_RESTART_WINDOW_S`` of steady wall
time is taken for two clocks (two simulators publishing /clock), not for restarts, which come seconds
apart: arming, by the operator or ``auto_arm``, is refused until the clock has gone that long without
going back (a restart on every other message would otherwise arm and disarm the rotors period after
period).
``disarm()`` (SetBool false) in flight is a controlled descent without recovery (during a failsafe
descent: that descent goes on, as timed, without recovery); on the ground it cuts the rotors.
"""

from __future__ import annotations

import math
import time
from collections import deque
from dataclasses import dataclass, replace
from enum import Enum
from typing import Callable, NamedTuple

import numpy as np

from sim.crazyflie.contract import ACT_DIM
from sim.crazyflie.params import GRAVITY, NOMINAL, CrazyflieParams, rpm_to_action

from .state import State, StateLimits, observation, quat_to_rotmat

IDLE_ACTION = -1.0  # action -1 = 0 rpm (contract: rpm = (a + 1) / 2 * rpm_max)
SPIN_DOWN_S = 0.3  # s added to a failsafe descent's fall time: the rotors' spin-down
# A simulator is restarted (a new process) or reset by hand or by a harness, seconds apart at the
# quickest; two /clock publishers send the clock back with every other message (50 times a second for
# two simulators at 10 ms steps).
CLOCK_RESTARTS_MAX = 3  # clock restarts within the window that mark the clock as unsteady
CLOCK_RESTART_WINDOW_S = 2.0  # s, steady wall time; also how long the clock must then go without going back
# Valid states below landed_height that end a failsafe descent (none at twice landed_height or more between
# them), and valid states at twice landed_height or more, of the last 2 LANDED_SAMPLES - 1, that put the
# vehicle in the air again
LANDED_SAMPLES = 3


class Mode(str, Enum):
    DISARMED = "disarmed"
    ARMED = "armed"
    FAILSAFE = "failsafe"
    ESTOP = "estop"


@dataclass
class SafetyConfig:
    """Safety parameters (ROS parameters of the same names). Positions world ENU, m."""

    target: tuple[float, float, float] = (0.0, 0.0, 1.0)  # hover target, world, m
    stale_timeout: float = 0.05  # s: a state older than this triggers the failsafe
    geofence_min: tuple[float, float, float] = (-1.5, -1.5, -0.2)  # m, world box corner
    geofence_max: tuple[float, float, float] = (1.5, 1.5, 2.5)  # m
    max_action: float = 1.0  # upper clip of every action (1 = rpm_max)
    descent_thrust_ratio: float = 0.9  # failsafe descent thrust / hover thrust (< 1: sinks at (1 - r) g)
    ground_height: float = 0.0  # m, world z of the floor
    landed_height: float = 0.05  # m above the floor: below this the vehicle counts as on the ground
    recover_count: int = 3  # consecutive valid states that end a failsafe descent
    max_recoveries: int = 3  # failsafe descents that may end in recovery within recovery_window; then one lands
    recovery_window: float = 30.0  # s
    takeoff_speed: float = 0.5  # m/s: the setpoint's speed from where the policy takes over to the target
    # s on the floor while ARMED before the rotors are cut: about twice the 0.96 s the policy shipped until
    # 2026-12-02 took to leave the floor in the randomization's weakest corner (0.81 s for the one shipped
    # since; deploy/README.md, "Safety layer").
    ground_timeout: float = 2.0
    # deg: arming is refused above this tilt (body z from world z): the hover training's initial attitudes
    # go up to 30 deg (issue #2's criterion), so a vehicle tilted further is outside what the policy learnt from.
    max_arm_tilt_deg: float = 30.0
    # m/s per axis (world) and rad/s per axis (body): arming is refused faster, the hover training's initial
    # velocities and body rates (sim/crazyflie/hover.py InitConfig, not imported: it would load torch here)
    max_arm_speed: float = 0.5
    max_arm_rate: float = 1.0
    max_tilt_deg: float = 90.0  # deg: a fresh state tilted beyond this (upside down) cuts the rotors
    # deg and s: current states tilted beyond max_held_tilt_deg for max_held_tilt_s while ARMED or FAILSAFE cut the
    # rotors (a vehicle caught in a net, or wedged against a wall, with the policy or the descent at full thrust).
    # 60 deg is PX4's failure detector's default roll and pitch limit (FD_FAIL_R, FD_FAIL_P); the hover training
    # starts at up to 30 deg and its criterion ends below 10 deg.
    max_held_tilt_deg: float = 60.0
    max_held_tilt_s: float = 0.5
    # m: how far a sample may lie beyond where the last valid state could have moved at StateLimits.max_speed
    # (the estimate's noise and corrections: a few mm from motion capture, ~1-2 cm from the Crazyflie's
    # Lighthouse and ~10 cm from its UWB positioning by Bitcraze's figures); farther is a glitch, dropped
    max_jump: float = 0.3
    # deg: how much further a sample's tilt may have changed than its roll and pitch rates allow; further is dropped
    max_attitude_jump_deg: float = 30.0
    auto_arm: bool = False

    def __post_init__(self):
        # Every comparison with NaN is false: a NaN limit would silently turn its rule off.
        finite = {"target": self.target, "stale_timeout": self.stale_timeout, "ground_height": self.ground_height,
                  "landed_height": self.landed_height, "geofence_min": self.geofence_min,
                  "geofence_max": self.geofence_max}
        for name, value in finite.items():
            if not np.isfinite(np.asarray(value, float)).all():
                raise ValueError(f"{name} {value}: expected finite values")
        if not self.stale_timeout > 0.0:
            raise ValueError(f"stale_timeout {self.stale_timeout}: expected a positive time (s)")
        if not self.landed_height > 0.0:  # at 0 no state above the floor counts as on it: floor rules off
            raise ValueError(f"landed_height {self.landed_height}: expected a height > 0 (m)")
        if int(self.recover_count) != self.recover_count or self.recover_count < 1:
            raise ValueError(f"recover_count {self.recover_count}: expected a whole number >= 1")
        if not (math.isfinite(self.max_recoveries) and int(self.max_recoveries) == self.max_recoveries
                and self.max_recoveries >= 0):
            raise ValueError(f"max_recoveries {self.max_recoveries}: expected a whole number >= 0")
        if not self.recovery_window > 0.0 or not math.isfinite(self.recovery_window):
            raise ValueError(f"recovery_window {self.recovery_window}: expected a positive time (s)")
        lo, hi = np.asarray(self.geofence_min, float), np.asarray(self.geofence_max, float)
        if lo.shape != (3,) or hi.shape != (3,) or not (lo < hi).all():
            raise ValueError(f"geofence_min {lo.tolist()} must be below geofence_max {hi.tolist()} on every axis")
        t = np.asarray(self.target, float)
        if t.shape != (3,) or not ((lo < t) & (t < hi)).all():  # a policy flying to it would fail safe at the fence
            raise ValueError(f"target {t.tolist()} must lie inside the geofence {lo.tolist()}..{hi.tolist()}")
        if not t[2] > self.ground_height + self.landed_height:
            raise ValueError(f"target {t.tolist()} must be above the floor (ground_height + landed_height = "
                             f"{self.ground_height + self.landed_height:g} m)")
        if not self.takeoff_speed > 0.0 or not math.isfinite(self.takeoff_speed):
            raise ValueError(f"takeoff_speed {self.takeoff_speed}: expected a positive speed (m/s)")
        if not self.ground_timeout > 0.0 or not math.isfinite(self.ground_timeout):
            raise ValueError(f"ground_timeout {self.ground_timeout}: expected a positive time (s)")
        if not (0.0 < self.descent_thrust_ratio < 1.0):
            raise ValueError(f"descent_thrust_ratio {self.descent_thrust_ratio}: expected a value in (0, 1)")
        if not (0.0 <= self.max_arm_tilt_deg <= self.max_tilt_deg < 180.0):  # 180: no state is ever beyond it
            raise ValueError(f"max_arm_tilt_deg {self.max_arm_tilt_deg}, max_tilt_deg {self.max_tilt_deg}: expected "
                             "0 <= max_arm_tilt_deg <= max_tilt_deg < 180")
        if not (self.max_arm_tilt_deg <= self.max_held_tilt_deg < 180.0):  # (beyond max_tilt_deg: the tumble rule's)
            raise ValueError(f"max_held_tilt_deg {self.max_held_tilt_deg}: expected a value from max_arm_tilt_deg "
                             f"{self.max_arm_tilt_deg} to below 180")
        if not self.max_held_tilt_s > 0.0 or not math.isfinite(self.max_held_tilt_s):
            raise ValueError(f"max_held_tilt_s {self.max_held_tilt_s}: expected a positive time (s)")
        if not self.max_jump > 0.0 or not math.isfinite(self.max_jump):
            raise ValueError(f"max_jump {self.max_jump}: expected a positive distance (m)")
        if not 0.0 < self.max_attitude_jump_deg < 180.0:  # 180: no attitude is ever beyond it
            raise ValueError(f"max_attitude_jump_deg {self.max_attitude_jump_deg}: expected a value in (0, 180)")
        for name in ("max_arm_speed", "max_arm_rate"):
            value = getattr(self, name)
            if not value > 0.0 or not math.isfinite(value):
                raise ValueError(f"{name} {value}: expected a positive value")
        if not (-1.0 < self.max_action <= 1.0):
            raise ValueError(f"max_action {self.max_action}: expected a value in (-1, 1]")


@dataclass(frozen=True)
class Command:
    action: np.ndarray  # (4,) in [-1, 1], rotor order M1..M4
    mode: Mode
    reason: str  # why the controller is in this mode


class SafeController:
    """Policy + safety rules. ``policy`` maps one observation (22,) float32 to an action (4,)."""

    def __init__(self, policy: Callable[[np.ndarray], np.ndarray], cfg: SafetyConfig,
                 params: CrazyflieParams = NOMINAL, wall: Callable[[], float] = time.monotonic,
                 descent: DescentProfile | None = None, limits: StateLimits = StateLimits()):
        """``limits``: the bounds the samples were checked against (make_state), whose speed bounds how far a
        sample can be from the last. ``wall``: steady wall time (s), which only the
        clock-restart rate is counted on. ``descent``: what a failsafe descent's timer times, by default
        this layer's own open-loop descent command (DescentProfile.open_loop); the bridges whose onboard
        policy flies the descent as setpoints give theirs (DescentProfile.onboard, with its lag)."""
        self.policy, self.cfg, self.wall, self.limits = policy, cfg, wall, limits
        self.descent_profile = descent if descent is not None else DescentProfile.open_loop(cfg)
        self.target = np.asarray(cfg.target, dtype=np.float64)
        self.hover_action = params.hover_action
        self.descent_action = rpm_to_action(params.hover_rpm * math.sqrt(cfg.descent_thrust_ratio), params.rpm_max)
        # rad/s^2: twice the roll or pitch acceleration of two rotors on one side at full speed, the others
        # stopped (503 rad/s^2 for the nominal vehicle): for heavier, longer-armed variants and knocks
        arm = max(abs(c) for xy in params.rotor_xy for c in xy)
        self.max_angular_accel = 2.0 * 2.0 * params.kf * params.rpm_max ** 2 * arm / min(params.inertia[:2])
        self.failsafe_count = 0
        self._clock = -math.inf  # the latest time (s) on_state() or tick() was given
        self._operator_stop = False  # disarm() or estop() since the last arm(): no auto_arm after a restart
        # Why auto_arm must wait, set by the caller every tick (ControllerNode: arm_problem() or the recorder), or None
        self.auto_arm_hold: str | None = None
        # Why the policy cannot fly again, set by the caller every tick (ControllerNode: policy_problem(), a
        # failed MCU), or None: a failsafe descent then lands instead of handing back to a policy that fails
        self.recovery_hold: str | None = None
        self._clock_restarts: list[float] = []  # wall times (s) of the clock's restarts within the window
        self._unsteady_until = -math.inf  # wall time (s) until which the clock counts as unsteady
        self._start_up("start-up")

    def _start_up(self, reason: str) -> None:
        """The state of a controller that has just started: DISARMED, no state, nothing timed."""
        self.mode, self.reason = Mode.DISARMED, reason
        self._ramp_from, self._ramp_start = self.target, 0.0  # setpoint ramp: start position (world, m), time (s)
        self._on_floor_since: float | None = None  # time (s) since which an ARMED vehicle has been on the floor
        self.prev_action = np.full(ACT_DIM, IDLE_ACTION)
        self._recovered_at: list[float] = []  # times (s) of the recoveries within recovery_window
        self._latest: State | None = None  # last valid state
        self._latest_time = -math.inf  # time it was sampled (s, the caller's clock: receipt minus its age)
        self._input_error: str | None = "no state received yet"
        # The first sample rejected (or outside the geofence) since the last tick: a valid state received
        # after it, before the tick, must not hide it (several states can arrive within one period).
        self._rejected: str | None = None
        self._good_streak = 0
        # Tilted beyond max_tilt_deg: 1 for the last valid state, +1 for each next sample that confirms it (tilted
        # as well, or out of range or non-finite: a tumbling vehicle's rates may exceed the limits); 1 is a
        # failsafe, 2 a tumble. _tilt_open: no sample at all since the last tilted one (confirmations count only
        # then; one contradicted in between, by a sample dropped against it, is a glitch).
        self._tumbled, self._tilt_open = 0, False
        self._floor_streak = 0  # valid states below landed_height, none at twice that or more between them
        # tick time (s) since which the current states have been tilted beyond max_held_tilt_deg
        self._held_tilt_since: float | None = None
        # whether each of the last 2 LANDED_SAMPLES - 1 valid states was at twice landed_height or more
        self._high: deque[bool] = deque(maxlen=2 * LANDED_SAMPLES - 1)
        # the last valid state in the air: when it was taken (s), its height (m), its vz (m/s)
        self._in_air: tuple[float, float, float] | None = None
        # the valid States received within the last twice stale_timeout: when (s), and whether each was dropped
        self._recent: deque[tuple[float, bool]] = deque()
        self._descent_end = self._descent_cap = math.inf
        self._may_recover = True
        self._auto_arm_pending = self.cfg.auto_arm and not self._operator_stop
        self._policy_error = ""
        self._now_seen = 0.0  # the last tick's time (s), for status()

    def _check_clock(self, now: float) -> None:
        """A clock that goes back is a restarted simulator's (/clock from 0 again; a steady clock never
        does): every time kept (state age, descent end, recoveries, ramp, floor timer) would be wrong, so
        the controller starts up again, DISARMED (re-armed on the first valid state with auto_arm, once
        the clock is steady: ``clock_unsteady``)."""
        if not math.isfinite(now):  # every comparison with NaN is false: no state would ever be stale
            raise ValueError(f"time {now}: expected a finite time (s)")
        if now < self._clock:
            t = self.wall()
            was_unsteady = t < self._unsteady_until
            self._clock_restarts = [r for r in self._clock_restarts[-(CLOCK_RESTARTS_MAX - 1):]
                                    if r > t - CLOCK_RESTART_WINDOW_S] + [t]
            if was_unsteady or len(self._clock_restarts) >= CLOCK_RESTARTS_MAX:
                self._unsteady_until = t + CLOCK_RESTART_WINDOW_S
            unsteady = self.clock_unsteady()
            why = unsteady or f"clock went back from {self._clock:.3f} s to {now:.3f} s (a restarted simulator?)"
            estop = self.mode is Mode.ESTOP  # an emergency stop stays latched until arm()
            self._start_up(why)
            if estop:
                self._set(Mode.ESTOP, f"{why}: emergency stop kept, re-arm to fly")
            elif unsteady:  # the same reason at every restart: not a new status every period
                self.reason += (": rotors idle, arming once it has run steadily" if self._auto_arm_pending
                                else ": rotors idle, re-arm to fly once it has run steadily")
            else:
                self.reason += (": rotors idle, arming on the first valid state" if self._auto_arm_pending
                                else ": rotors idle, re-arm to fly")
        self._clock = now

    def clock_unsteady(self) -> str | None:
        """Why the clock cannot be flown on, or None: it went back ``CLOCK_RESTARTS_MAX`` times within
        ``CLOCK_RESTART_WINDOW_S`` of wall time, and has not since gone that long without going back."""
        if self.wall() >= self._unsteady_until:
            return None
        return (f"clock went back {CLOCK_RESTARTS_MAX} times within {CLOCK_RESTART_WINDOW_S:g} s "
                "(more than one /clock publisher?)")

    # ------------------------------------------------------------------ inputs
    def on_state(self, state: State | None, now: float, error: str | None = None, age: float = 0.0) -> str | None:
        """A received state sample: a valid State, or None with ``error`` ("nonfinite: ..."). ``age`` (s):
        how old the sample already is at ``now`` (by its stamp); its staleness counts from then. Returns
        why a valid State was dropped ("out_of_order: ..." or "implausible: ...", module docstring), else None."""
        self._check_clock(now)
        if not math.isfinite(age):  # a NaN sampling time would turn the stale rule off, as a NaN ``now`` would
            raise ValueError(f"age {age}: expected a finite time (s)")
        if state is None:
            self._input_error, self._good_streak = error or "invalid state", 0
            self._rejected = self._rejected or self._input_error
            if self._tilt_open and (error or "").startswith(("out_of_range", "nonfinite")):
                self._tumbled += 1
            self._tilt_open = False
            return None
        sampled = now - max(age, 0.0)
        if sampled < self._latest_time:  # flown on, it would put the state back in time (and its age with it)
            dropped = (f"out_of_order: taken {(self._latest_time - sampled) * 1e3:.0f} ms before the last valid "
                       "state")
        else:
            dropped = self._jump(state, sampled)
        while self._recent and self._recent[0][0] < now - 2.0 * self.cfg.stale_timeout:
            self._recent.popleft()
        self._recent.append((now, dropped is not None))
        if dropped is not None:  # as if it had not arrived; a recovery needs consecutive plausible states
            # and a landing consecutive floor states: two sources that disagree are not a vehicle on the floor
            self._good_streak = self._floor_streak = 0
            self._tilt_open = False
            return dropped
        self._latest, self._latest_time, self._input_error = state, sampled, None
        tilted = self.tilt_deg() > self.cfg.max_tilt_deg
        self._tumbled = (self._tumbled + 1 if self._tilt_open else 1) if tilted else 0
        self._tilt_open = tilted
        h = self.height()
        self._high.append(h >= 2.0 * self.cfg.landed_height)
        if h < self.cfg.landed_height:
            self._floor_streak += 1
        else:
            self._on_floor_since = None  # the ARMED floor timer wants the floor without a break
            if self._high[-1]:  # off the floor: the floor's count starts again
                self._floor_streak = 0
                if sum(self._high) >= LANDED_SAMPLES:  # in the air (fewer could be the estimate's noise)
                    self._in_air = (sampled, h, float(state.vel[2]))
        # Recovery counts consecutive valid states inside the geofence; tick() restarts the count
        # at a stale gap.
        if self._inside(state.pos):
            self._good_streak += 1
        else:
            self._good_streak = 0
            self._rejected = self._rejected or self._fence_problem(state.pos)
        return None

    def _jump(self, state: State, sampled: float) -> str | None:
        """Why ``state``, taken at ``sampled`` (s), cannot follow the last valid state (module docstring,
        "Implausible samples"), or None (also without a valid state since start-up)."""
        ref = self._latest
        if ref is None:
            return None
        dt = sampled - self._latest_time  # >= 0: one taken before the last valid state is out of order
        moved, reach = float(np.linalg.norm(state.pos - ref.pos)), self.limits.max_speed * dt + self.cfg.max_jump
        if moved > reach:
            return (f"implausible: position {np.round(state.pos, 2).tolist()} m, {moved:.2f} m from the last valid "
                    f"state {dt * 1e3:.0f} ms apart (limit {reach:.2f} m)")
        # the angle between the two body z axes (column 2 of R body->world: the body z axis in world coordinates)
        z_new, z_ref = quat_to_rotmat(state.quat)[:, 2], quat_to_rotmat(ref.quat)[:, 2]
        tilted = math.degrees(math.acos(min(max(float(np.dot(z_new, z_ref)), -1.0), 1.0)))
        rate = 0.5 * (float(np.linalg.norm(state.omega[:2])) + float(np.linalg.norm(ref.omega[:2])))  # rad/s
        bound = math.degrees(rate * dt + 0.5 * self.max_angular_accel * dt * dt) + self.cfg.max_attitude_jump_deg
        if tilted > bound:
            return f"implausible: tilt changed {tilted:.0f} deg in {dt * 1e3:.0f} ms (limit {bound:.0f} deg)"
        return None

    def state_problem(self, now: float) -> str | None:
        """Why the current state must not be flown on (or a sample rejected since the last tick), or None."""
        if self._input_error is not None:
            return self._input_error
        drops = [t for t, dropped in self._recent if dropped and t >= now - 2.0 * self.cfg.stale_timeout]
        accepted = [t for t, dropped in self._recent if not dropped and t >= now - 2.0 * self.cfg.stale_timeout]
        if (len(drops) >= 2 and drops[-1] - drops[0] > self.cfg.stale_timeout
                and now - drops[-1] <= self.cfg.stale_timeout and 2 * len(drops) >= len(accepted)
                and any(drops[0] < t < drops[-1] for t in accepted)):  # interleaved (not one estimate that jumped)
            return ("dropped samples (implausible or out of order) keep coming, a third of all or more (a second "
                    "source of states?)")
        age = now - self._latest_time
        if age > self.cfg.stale_timeout:
            return f"stale: last state {age * 1e3:.0f} ms old (limit {self.cfg.stale_timeout * 1e3:.0f} ms)"
        if self._tumbled:
            tilt = f"tilted {self.tilt_deg():.0f} deg (limit {self.cfg.max_tilt_deg:g} deg)"
            return f"tumbled: {tilt}" if self._tumbled >= 2 else f"{tilt}: a tumble if the next sample shows it too"
        if self._rejected is not None:
            return self._rejected
        p = self._latest.pos
        if not self._inside(p):
            return self._fence_problem(p)
        return None

    def state_fresh(self, now: float) -> bool:
        """Whether the last valid state is current at ``now`` (its height and attitude can be used,
        inside the fence or not): no sample rejected after it, and no older than ``stale_timeout``."""
        return self._input_error is None and self._current(now)

    def _current(self, now: float) -> bool:
        """Whether the last valid state is no older than ``stale_timeout`` at ``now`` (False without one)."""
        return now - self._latest_time <= self.cfg.stale_timeout

    @staticmethod
    def _fence_problem(pos: np.ndarray) -> str:
        return f"geofence: position {np.round(pos, 2).tolist()} m outside the box"

    def tilt_deg(self) -> float:
        """Tilt of the last valid state (deg): the angle of its body z axis from world z."""
        q = self._latest.quat  # (w, x, y, z), unit
        cos = 1.0 - 2.0 * (q[1] * q[1] + q[2] * q[2])  # R[2, 2] of body -> world
        return math.degrees(math.acos(min(max(cos, -1.0), 1.0)))

    def _inside(self, pos: np.ndarray) -> bool:
        return bool((pos >= self.cfg.geofence_min).all() and (pos <= self.cfg.geofence_max).all())

    @property
    def latest(self) -> State | None:
        """The last valid state received."""
        return self._latest

    def height(self) -> float | None:
        """Height above the floor from the last valid state (m), None before any."""
        return None if self._latest is None else float(self._latest.pos[2] - self.cfg.ground_height)

    def descent_start(self, now: float) -> tuple[float, float, float] | None:
        """Where a failsafe descent at ``now`` is timed from: world z (m), vertical velocity (m/s, up > 0) and
        the time (s) of that state: the last valid one, or the last in the air where the one near the floor
        may be a glitch (``_fall_from``); None before any valid state. OnboardDescent starts its setpoints
        there, so that they and the timer follow one profile."""
        if self._latest is None:
            return None
        h, v, since = self._fall_from(now)
        return self.cfg.ground_height + h, v, now - since

    # ------------------------------------------------------------------ services
    def arm(self, now: float) -> tuple[bool, str]:
        self._check_clock(now)
        if self.mode is Mode.ARMED:  # the policy flies on, its previous action untouched
            return True, "already armed"
        unsteady = self.clock_unsteady()
        if unsteady is not None:
            return False, (f"refused to arm: {unsteady}, steady for "
                           f"{self._unsteady_until - self.wall():.1f} s more")
        problem = self.state_problem(now)
        if problem is not None:
            return False, f"refused to arm: {problem}"
        unsettled = None if self.mode is Mode.FAILSAFE else self._unsettled()
        if unsettled is not None:
            return False, f"refused to arm: {unsettled[0]}"
        if self.mode is not Mode.FAILSAFE:  # rotors idle: as at the start of a training episode
            self.prev_action = np.full(ACT_DIM, self.hover_action)
        # (from a failsafe descent the rotors still turn: the previous action is the descent command)
        self._set(Mode.ARMED, "armed")
        self._take_over(now)
        self._recovered_at = []
        self._auto_arm_pending = self._operator_stop = False
        return True, "armed"

    def setpoint(self, now: float) -> np.ndarray:
        """Where the policy is told to fly at ``now`` (world, m): from the position where it last took
        over, toward ``target`` at ``takeoff_speed``, then ``target``."""
        d = self.target - self._ramp_from
        dist = float(np.linalg.norm(d))
        travelled = self.cfg.takeoff_speed * max(now - self._ramp_start, 0.0)
        return self.target.copy() if travelled >= dist else self._ramp_from + d * (travelled / dist)

    def disarm(self, now: float) -> str:
        self._check_clock(now)
        self._auto_arm_pending, self._operator_stop = False, True
        if self.mode is Mode.ARMED:  # the operator's descent: not counted as a failsafe
            self._enter_failsafe("disarm requested", now, may_recover=False, counted=False)
        elif self.mode is Mode.FAILSAFE:  # the descent goes on as timed (and counted once): no recovery
            if self._may_recover:
                self._may_recover = False
                self.reason += "; disarm requested: no recovery"
        elif self.mode is Mode.DISARMED:  # a reason that promised auto_arm would be out of date
            self._set(Mode.DISARMED, "disarm requested: rotors idle, re-arm to fly")
        return f"{self.mode.value}: {self.reason}"

    def fail_safe(self, why: str, now: float) -> None:
        """A problem only the caller sees (crazyflie_bridge: the vehicle's stock controller flying instead of
        its policy): ARMED -> the failsafe's descent, without recovery (the policy would not fly again)."""
        if self.mode is Mode.ARMED:
            self._enter_failsafe(why, now, may_recover=False)

    def cut(self, why: str) -> None:
        """Rotors cut at once (DISARMED, counted in ``failsafe_count``), by the caller's rule: e.g. a
        bridge whose vehicle cannot fly the descent (its onboard state estimate is broken)."""
        if self.mode in (Mode.ARMED, Mode.FAILSAFE):
            self.failsafe_count += 1
            self._set(Mode.DISARMED, f"{why}: rotors cut, re-arm to fly")

    def estop(self) -> str:
        self._auto_arm_pending, self._operator_stop = False, True
        self._set(Mode.ESTOP, "emergency stop: rotors cut, re-arm to fly")
        return self.reason

    # ------------------------------------------------------------------ control
    def tick(self, now: float) -> Command:
        """One policy period: decide the mode, return the rotor command."""
        self._check_clock(now)
        self._now_seen = now
        if self._recovered_at and now - self._recovered_at[0] >= self.cfg.recovery_window:
            self._recovered_at = [t for t in self._recovered_at if now - t < self.cfg.recovery_window]
        # A sample rejected since the last tick counts here, once; on_state() already restarted the
        # recovery count at it, so only a problem of the current state (a stale gap) restarts it here.
        rejected = self._rejected
        problem = self.state_problem(now)
        self._rejected = None
        if problem is not None and problem is not rejected:
            self._good_streak = 0
        # The last valid state is current (inside the fence or not): its height and attitude can be used.
        fresh = self.state_fresh(now)
        if self.mode is Mode.DISARMED and self._auto_arm_pending and problem is None:
            if self.auto_arm_hold is not None:  # the caller's reason to wait
                self.reason = f"auto_arm: {self.auto_arm_hold}"
            else:
                armed, _ = self.arm(now)
                unsteady, unsettled = (None, None) if armed else (self.clock_unsteady(), self._unsettled())
                # without the figures arm() gives (a countdown, a tilt): a new status message per period
                if unsteady is not None:  # (as the clock's restart said)
                    self.reason = f"{unsteady}: rotors idle, arming once it has run steadily"
                elif unsettled is not None:
                    self.reason = f"auto_arm: {unsettled[1]}"
        # A tumble (two samples, module docstring) is acted on while its state is current, even with a sample
        # rejected after it: descent thrust would drive a tumbled vehicle into the floor.
        # So is a tilted state that no sample followed before it went stale (a tumbling vehicle lost by the motion
        # capture; one whose next samples come late, or not at all).
        confirmed, unanswered = self._tumbled >= 2 and self._current(now), self._tilt_open and not self._current(now)
        if self.mode in (Mode.ARMED, Mode.FAILSAFE) and (confirmed or unanswered):
            self.failsafe_count += 1
            self._set(Mode.DISARMED, f"tumbled: tilted {self.tilt_deg():.0f} deg (limit {self.cfg.max_tilt_deg:g} "
                                     f"deg){', no sample since' if unanswered else ''}: rotors cut, re-arm to fly")
        held = self._held_tilt(now)  # (None unless ARMED or FAILSAFE)
        if held is not None:
            self.failsafe_count += 1
            self._set(Mode.DISARMED, f"held tilted: beyond {self.cfg.max_held_tilt_deg:g} deg for {held:.2f} s "
                                     f"(limit {self.cfg.max_held_tilt_s:g} s): rotors cut, re-arm to fly")
        if self.mode is Mode.FAILSAFE:
            self._update_failsafe(problem, now, fresh)
        if self.mode is Mode.ARMED:
            if problem is not None:
                self._enter_failsafe(problem, now)
            elif self._stuck_on_floor(now):
                self.failsafe_count += 1  # a rule took the rotors from the policy, as a failsafe on the ground does
                self._set(Mode.DISARMED, f"on the floor for {self.cfg.ground_timeout:g} s while armed: "
                                         "rotors cut, re-arm to fly")
            else:
                action = self._run_policy(now)
                if action is not None:
                    return self._command(action)
                self._enter_failsafe(self._policy_error, now)
        if self.mode is Mode.FAILSAFE:
            return self._command(np.full(ACT_DIM, self.descent_action))
        return self._command(np.full(ACT_DIM, IDLE_ACTION))

    def status(self) -> dict:
        return {"mode": self.mode.value, "reason": self.reason, "failsafe_count": self.failsafe_count,
                "recoveries": len(self._recovered_at),
                "target": [float(v) for v in self.target],
                # what the policy flies to (None when it does not fly)
                "setpoint": ([round(float(v), 4) for v in self.setpoint(self._now_seen)]
                             if self.mode is Mode.ARMED else None),
                "prev_action": [round(float(a), 4) for a in self.prev_action]}

    # ------------------------------------------------------------------ internals
    def _set(self, mode: Mode, reason: str) -> None:
        self.mode, self.reason = mode, reason

    def _command(self, action: np.ndarray) -> Command:
        self.prev_action = action
        return Command(action.copy(), self.mode, self.reason)

    def _unsettled(self) -> tuple[str, str] | None:
        """Why the last valid state is outside the hover training's initial states for arming, in full and
        without its figure (tilt, then velocity, then body rates), or None."""
        cfg, s = self.cfg, self._latest
        if self.tilt_deg() > cfg.max_arm_tilt_deg:
            return (f"tilted {self.tilt_deg():.0f} deg (limit {cfg.max_arm_tilt_deg:g} deg): level the vehicle",
                    f"tilted beyond {cfg.max_arm_tilt_deg:g} deg, arming once level")
        speed, rate = float(np.abs(s.vel).max()), float(np.abs(s.omega).max())
        if speed > cfg.max_arm_speed:
            return (f"moving at {speed:.2f} m/s (limit {cfg.max_arm_speed:g} m/s per axis): hold the vehicle still",
                    f"moving faster than {cfg.max_arm_speed:g} m/s, arming once still")
        if rate > cfg.max_arm_rate:
            return (f"turning at {rate:.2f} rad/s (limit {cfg.max_arm_rate:g} rad/s per axis): hold the vehicle "
                    "still", f"turning faster than {cfg.max_arm_rate:g} rad/s, arming once still")
        return None

    def _take_over(self, now: float) -> None:
        """The policy takes over (arming, recovery): the setpoint ramp starts where the vehicle is."""
        self._ramp_from, self._ramp_start = self._latest.pos.astype(np.float64).copy(), now
        self._on_floor_since = None

    def _held_tilt(self, now: float) -> float | None:
        """How long (s) current states have shown the vehicle tilted beyond max_held_tilt_deg while it flew
        (ARMED or FAILSAFE), once that is max_held_tilt_s or more; else None."""
        if self.mode not in (Mode.ARMED, Mode.FAILSAFE) or not self.state_fresh(now) \
                or self.tilt_deg() <= self.cfg.max_held_tilt_deg:
            self._held_tilt_since = None
            return None
        if self._held_tilt_since is None:
            self._held_tilt_since = now
        held = now - self._held_tilt_since
        return held if held >= self.cfg.max_held_tilt_s else None

    def _stuck_on_floor(self, now: float) -> bool:
        """Whether the (fresh, valid) state has shown the vehicle on the floor for ``ground_timeout``."""
        if self.height() >= self.cfg.landed_height:  # (its timer was stopped when that state came)
            return False
        if self._on_floor_since is None:
            self._on_floor_since = now
        return now - self._on_floor_since >= self.cfg.ground_timeout

    def _run_policy(self, now: float) -> np.ndarray | None:
        obs = observation(self._latest, self.setpoint(now), self.prev_action.astype(np.float32))
        try:
            out = np.asarray(self.policy(obs), dtype=np.float64).reshape(-1)
        except Exception as e:  # any failure of the policy is a failsafe, never a crash
            self._policy_error = f"policy error: {type(e).__name__}: {e}"[:200]
            return None
        if out.shape != (ACT_DIM,) or not np.isfinite(out).all():
            self._policy_error = f"policy error: output {np.round(out, 3).tolist()[:8]} is not {ACT_DIM} finite values"
            return None
        return np.clip(out, -1.0, self.cfg.max_action)

    def _enter_failsafe(self, why: str, now: float, may_recover: bool = True, counted: bool = True) -> None:
        self.failsafe_count += counted
        self._may_recover = may_recover and len(self._recovered_at) < self.cfg.max_recoveries
        if may_recover and not self._may_recover:
            why += f"; {len(self._recovered_at)} recoveries in the last {self.cfg.recovery_window:g} s, no more"
        self._good_streak = 0
        if self.height() is None or self._on_floor(now):
            self._set(Mode.DISARMED, f"{why}; on the ground: rotors cut, re-arm to fly")
            return
        fall = self._fall_time(now)
        self._descent_end, self._descent_cap = now + fall, now + 2.0 * fall
        self._set(Mode.FAILSAFE, f"{why}; controlled descent from {self._fall_from(now)[0]:.2f} m")

    def _on_floor(self, now: float) -> bool:
        """Whether the valid states show the vehicle on the floor: the last below landed_height, and, if one
        was in the air since start-up, ``LANDED_SAMPLES`` of them and time enough for a free fall from it."""
        if self.height() >= self.cfg.landed_height:
            return False
        return self._in_air is None or (self._floor_streak >= LANDED_SAMPLES and now >= self._earliest_landing())

    def _fall_from(self, now: float) -> tuple[float, float, float]:
        """Where a descent at ``now`` is timed from: height (m), vertical velocity (world z, m/s; up > 0) and
        the time (s) since then. The last valid state's; but a state near the floor that a free fall could
        not have reached yet may be a believed glitch: then the last valid state in the air's (see
        LANDED_SAMPLES)."""
        h = max(self.height(), 0.0)
        if self._in_air is not None and h < 2.0 * self.cfg.landed_height and now < self._earliest_landing():
            t, h, v = self._in_air
            return h, v, now - t
        return h, float(self._latest.vel[2]), 0.0

    def _fall_time(self, now: float) -> float:
        """Time (s) from ``now`` to the floor along the descent's profile from ``_fall_from``'s height and
        vertical velocity, less the time since, plus the profile's ``settle_s``."""
        h, v, since = self._fall_from(now)
        return max(self.descent_profile.fall_time(h, v) - since, 0.0) + self.descent_profile.settle_s

    def _earliest_landing(self) -> float:
        """The earliest time (s) the vehicle can be on the floor: a free fall from the last valid state in the air
        (see LANDED_SAMPLES), from its height h and vertical velocity v (up > 0): h + v t - g t^2 / 2 = 0."""
        if self._in_air is None:
            return -math.inf
        t, h, v = self._in_air
        return t + (v + math.sqrt(v * v + 2.0 * GRAVITY * h)) / GRAVITY

    def _update_failsafe(self, problem: str | None, now: float, fresh: bool) -> None:
        if self._may_recover and self.recovery_hold is not None:
            self._may_recover = False
            self.reason += f"; no recovery: {self.recovery_hold}"
        fresh_height = self.height() if fresh else None
        if fresh_height is not None and fresh_height >= self.cfg.landed_height:  # still in the air
            self._descent_end = min(max(self._descent_end, now + self._fall_time(now)), self._descent_cap)
        if now >= self._descent_end or (fresh_height is not None and self._on_floor(now)):
            self._set(Mode.DISARMED, f"{self.reason}; landed: rotors cut, re-arm to fly")
        elif self._may_recover and problem is None and self._good_streak >= self.cfg.recover_count:
            self._recovered_at.append(now)
            self._take_over(now)
            self._set(Mode.ARMED, f"recovered: valid state again ({len(self._recovered_at)} of "
                                  f"{self.cfg.max_recoveries} within {self.cfg.recovery_window:g} s)")


# How long the onboard policy's descent may lag the setpoints it follows (s): a position setpoint has no
# velocity reference, so a policy may brake the sink. Measured by `python -m benchmarks.onboard_descent`
# (BENCHMARKS.md, "Onboard failsafe descent": the shipped hover policy in the torch simulator, from rest at
# 1.0 and 2.5 m and from fast sinks, 1 m/s at 1 m and 1.5 m/s at 0.5 m, for the nominal vehicle and corners of
# the randomization): below landed_height (5 cm) at most 0.27 s after the braking setpoint reached the floor
# (the light, fast vehicle, which hovers above its setpoint; the others 0.12 s after it or sooner). With this
# lag the timer, which alone ends a descent when no state arrives, cuts the rotors 1.1 s after the setpoint
# reached the floor, 0.83 s after the latest of them was on it; from the geofence's 2.5 m ceiling at rest it
# runs 3.29 + 0.3 + 0.8 = 4.39 s, inside crazyflie_bridge's LANDING_LIMIT_S (4.5 s).
ONBOARD_DESCENT_LAG_S = 0.8
# The onboard descent's speed at the floor (m/s) and the height (m) from which it sinks at that speed: a
# setpoint that only sinks at (1 - descent_thrust_ratio) g reaches the floor at up to 2.2 m/s (from the
# geofence's 2.5 m ceiling), and the policy that follows it lands at up to that speed. The onboard descent
# brakes at the same (1 - ratio) g (1.1 times the hover thrust, inside every vehicle's reach) to this speed at
# this height. Chosen by `python -m benchmarks.onboard_descent --sweep` (BENCHMARKS.md) among braking at 0.1-0.3 g
# to 0.2-0.25 m/s at 0-20 cm: it landed every vehicle tried at 0.52 m/s or slower, as slowly as any, with the
# shortest descent of those that did (3.29 s from 2.5 m); braking harder or lower let the policy, which lags a
# moving setpoint by up to 0.5 m, arrive at up to 1.6 m/s (2.05 m/s without braking).
ONBOARD_TOUCHDOWN_SPEED = 0.25  # m/s
ONBOARD_FLARE_HEIGHT = 0.1  # m above the floor


class _Phases(NamedTuple):
    """A descent from its start to the floor: sinking faster, braking, then at the touchdown speed."""

    faster_s: float  # s sinking faster, at the profile's accel
    peak: float  # m/s, the sink speed then
    braking_s: float  # s braking
    decel: float  # m/s^2 while braking
    touchdown_s: float  # s at the touchdown speed, from the flare height down


@dataclass(frozen=True)
class DescentProfile:
    """A failsafe descent from a height above the floor (m) and a vertical velocity (m/s, world z, up > 0):
    sinking at ``accel`` (m/s^2), from that velocity if sinking, from rest if climbing (a setpoint goes
    down at once; the timer's ``fall_time`` counts a climbing vehicle's rise to a stop at ``accel`` first);
    with ``brake`` > 0, decelerating at ``brake`` (m/s^2, or as hard as it takes if the start is already too
    fast to stop in time: harder than a policy lagging it follows, which then lands faster: the weakest
    vehicle of benchmarks.onboard_descent at 1.2 m/s from 1.5 m/s at 0.5 m) so as to sink at
    ``touchdown`` (m/s) from ``flare`` (m above the floor) down (at once from a start below it).
    ``settle_s`` (s) is what the descent's timer adds to the time to the floor before the rotors are cut."""

    accel: float
    brake: float = 0.0
    touchdown: float = 0.0
    flare: float = 0.0
    settle_s: float = SPIN_DOWN_S

    def __post_init__(self):
        if not self.accel > 0.0 or not self.brake >= 0.0 or not self.flare >= 0.0 or not self.settle_s >= 0.0:
            raise ValueError(f"{self}: expected accel > 0, brake, flare and settle_s >= 0")
        if self.brake > 0.0 and not self.touchdown > 0.0:
            raise ValueError(f"{self}: a braking descent needs a touchdown speed > 0 (it would never land)")

    @classmethod
    def open_loop(cls, cfg: SafetyConfig) -> DescentProfile:
        """The safety layer's own descent: a fixed rotor command that sinks at (1 - ratio) g, no braking
        (nothing to close a loop on), the rotors' spin-down added."""
        return cls((1.0 - cfg.descent_thrust_ratio) * GRAVITY)

    @classmethod
    def onboard(cls, cfg: SafetyConfig) -> DescentProfile:
        """The descent an onboard policy flies as position setpoints (OnboardDescent): sinking as the open-loop
        one and braking as fast to the floor, its timer allowing for the policy's lag behind the setpoint."""
        sink = cls.open_loop(cfg)
        return replace(sink, brake=sink.accel, touchdown=ONBOARD_TOUCHDOWN_SPEED, flare=ONBOARD_FLARE_HEIGHT,
                       settle_s=SPIN_DOWN_S + ONBOARD_DESCENT_LAG_S)

    def _phases(self, h: float, v: float) -> _Phases:
        """The phases from h > 0 m above the floor (the flare included), sinking at v >= 0 m/s."""
        a, b, vt = self.accel, self.brake, self.touchdown
        tail = 0.0
        if b > 0.0:
            tail = min(h, self.flare) / vt
            h -= self.flare  # from here on: the height above the flare
            if h <= 0.0:  # inside the flare: at the touchdown speed at once
                return _Phases(0.0, vt, 0.0, 0.0, tail)
            if v * v >= vt * vt + 2.0 * b * h:  # too fast to stop at b: brake at once, harder
                return _Phases(0.0, v, 2.0 * h / (v + vt), (v * v - vt * vt) / (2.0 * h), tail)
            if v * v + 2.0 * a * h > vt * vt:  # sink faster until the braking curve v^2 = vt^2 + 2 b h is met
                peak = math.sqrt((2.0 * a * b * h + b * v * v + a * vt * vt) / (a + b))
                return _Phases((peak - v) / a, peak, (peak - vt) / b, b, tail)
        # Sinking faster all the way down: without braking, or too slow to reach the touchdown speed above
        # the flare (then at vt from there)
        peak = math.sqrt(v * v + 2.0 * a * h)
        return _Phases((peak - v) / a, peak, 0.0, 0.0, tail)

    def fall_time(self, h: float, vz: float) -> float:
        """Time (s) from height h (m above the floor) and vertical velocity vz (m/s, up > 0) to the floor."""
        rise = max(vz, 0.0) / self.accel  # climbing: up to a stop first
        h += max(vz, 0.0) ** 2 / (2.0 * self.accel)
        if h <= 0.0:
            return rise
        p = self._phases(h, max(-vz, 0.0))
        return rise + p.faster_s + p.braking_s + p.touchdown_s

    def z(self, z0: float, vz0: float, seconds: float, ground: float) -> float:
        """World z (m) ``seconds`` after the start at world z0 (m) with vertical velocity vz0 (m/s, up > 0),
        from rest if climbing (a setpoint goes down at once), over the floor at world z ``ground`` (m)."""
        v = max(-vz0, 0.0)
        if z0 <= ground:
            return ground
        p = self._phases(z0 - ground, v)
        if seconds <= p.faster_s:
            return max(ground, z0 - v * seconds - 0.5 * self.accel * seconds ** 2)
        t1, tau = p.faster_s, min(seconds - p.faster_s, p.braking_s)
        sunk = v * t1 + 0.5 * self.accel * t1 ** 2 + p.peak * tau - 0.5 * p.decel * tau ** 2
        return max(ground, z0 - sunk - self.touchdown * max(seconds - t1 - p.braking_s, 0.0))


class OnboardDescent:
    """The failsafe descent as position setpoints, for a vehicle whose onboard policy flies it instead
    of this layer's open-loop rotor command (crazyflie_bridge: the real vehicle; firmware_bridge: the
    emulated MCU): at the last valid x, y, from the height and vertical velocity the safety layer times the
    descent from (SafeController.descent_start), along ``profile`` (DescentProfile.onboard: sinking as the
    open-loop descent, braking to the floor), so that it reaches the floor no later than the safety layer's
    timer, which times the same profile (SafeController's ``descent_profile``) and adds the policy's lag."""

    def __init__(self, cfg: SafetyConfig):
        self.profile, self.ground = DescentProfile.onboard(cfg), cfg.ground_height
        # start: its time (s), the last valid x, y (m, world), world z (m) and vertical velocity (m/s)
        self._from: tuple[float, np.ndarray, float, float] | None = None

    def setpoint(self, cmd: Command, controller: SafeController, now: float) -> np.ndarray | None:
        """Where the vehicle is sent at ``now`` (world, m) while ``cmd`` is a failsafe's and ``controller``
        ever received a valid state, else None (and the next failsafe starts anew)."""
        latest = controller.latest
        if cmd.mode is not Mode.FAILSAFE or latest is None:
            self._from = None
            return None
        if self._from is None:
            z0, vz0, t0 = controller.descent_start(now)
            self._from = (t0, latest.pos[:2].copy(), z0, vz0)
        t0, xy, z0, vz0 = self._from
        return np.array([xy[0], xy[1], self.profile.z(z0, vz0, now - t0, self.ground)])
