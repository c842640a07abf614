"""Safety layer around a policy: arming, emergency stop, geofence, command clipping, failsafe.

Pure Python (no ROS), so every rule is unit-testable; the ROS nodes feed it states and call
:meth:`SafeController.tick` once per policy period. Time ``now`` (s) is the node's clock: steady
wall time on hardware, simulated time under a simulator.

Modes and rules, checked on every tick:
  DISARMED  rotors at idle (0 rpm). ``arm()`` (std_srvs/SetBool true) switches to ARMED only with
            a fresh, valid state inside the geofence. With ``auto_arm`` the first such state arms
            once after start-up (simulation and HIL launch files use it, real flights do not).
  ARMED     the policy flies. A state problem (older than ``stale_timeout``, non-finite, out of
            range, outside the geofence) or a policy error (exception, non-finite or misshapen
            output) switches to FAILSAFE in the same tick. Actions are clipped to [-1, max_action].
  FAILSAFE  controlled descent: every rotor at the speed giving ``descent_thrust_ratio`` of the
            hover thrust (a fixed, attitude-neutral command: with no trustworthy state there is
            nothing to close a loop on) for the time a fall from the last valid height takes at
            that deceleration, or until a valid state shows the vehicle below ``landed_height``;
            then the rotors are cut and the mode is DISARMED: flying again needs re-arming.
            On the ground (or with no valid state ever) the rotors are cut at once.
            Recovery: while still descending, ``recover_count`` consecutive valid states inside
            the geofence hand control back to the policy without re-arming.
  ESTOP     ``estop()`` (std_srvs/Trigger): rotors cut at once, latched until ``arm()``.
``disarm()`` (SetBool false) in flight is a controlled descent without recovery; on the ground it
cuts the rotors.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from enum import Enum
from typing import Callable

import numpy as np

from sim.crazyflie.contract import ACT_DIM
from sim.crazyflie.params import GRAVITY, NOMINAL, CrazyflieParams, rpm_to_action

from .state import State, observation

IDLE_ACTION = -1.0  # action -1 = 0 rpm (contract: rpm = (a + 1) / 2 * rpm_max)


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
    auto_arm: bool = False

    def __post_init__(self):
        lo, hi = np.asarray(self.geofence_min, float), np.asarray(self.geofence_max, float)
        if lo.shape != (3,) or hi.shape != (3,) or not (lo < hi).all():
            raise ValueError(f"geofence_min {list(lo)} must be below geofence_max {list(hi)} on every axis")
        if not (0.0 < self.descent_thrust_ratio < 1.0):
            raise ValueError(f"descent_thrust_ratio {self.descent_thrust_ratio}: expected a value in (0, 1)")
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
                 params: CrazyflieParams = NOMINAL):
        self.policy, self.cfg = policy, cfg
        self.target = np.asarray(cfg.target, dtype=np.float64)
        self.hover_action = params.hover_action
        self.descent_action = rpm_to_action(params.hover_rpm * math.sqrt(cfg.descent_thrust_ratio), params.rpm_max)
        self.descent_accel = (1.0 - cfg.descent_thrust_ratio) * GRAVITY  # m/s^2, downwards
        self.mode, self.reason = Mode.DISARMED, "start-up"
        self.prev_action = np.full(ACT_DIM, IDLE_ACTION)
        self.failsafe_count = 0
        self._latest: State | None = None  # last valid state
        self._latest_time = -math.inf  # time it was received (s, the caller's clock)
        self._input_error: str | None = "no state received yet"
        self._good_streak = 0
        self._descent_end = math.inf
        self._may_recover = True
        self._auto_arm_pending = cfg.auto_arm
        self._policy_error = ""

    # ------------------------------------------------------------------ inputs
    def on_state(self, state: State | None, now: float, error: str | None = None) -> None:
        """A received state sample: a valid State, or None with ``error`` ("nonfinite: ...")."""
        if state is None:
            self._input_error, self._good_streak = error or "invalid state", 0
            return
        self._latest, self._latest_time, self._input_error = state, now, None
        self._good_streak += 1

    def state_problem(self, now: float) -> str | None:
        """Why the current state must not be flown on, or None."""
        if self._input_error is not None:
            return self._input_error
        age = now - self._latest_time
        if age > self.cfg.stale_timeout:
            return f"stale: last state {age * 1e3:.0f} ms old (limit {self.cfg.stale_timeout * 1e3:.0f} ms)"
        p = self._latest.pos
        if (p < self.cfg.geofence_min).any() or (p > self.cfg.geofence_max).any():
            return f"geofence: position {np.round(p, 2).tolist()} m outside the box"
        return None

    @property
    def latest(self) -> State | None:
        """The last valid state received."""
        return self._latest

    def height(self) -> float | None:
        """Height above the floor from the last valid state (m), None before any."""
        return None if self._latest is None else float(self._latest.pos[2] - self.cfg.ground_height)

    # ------------------------------------------------------------------ services
    def arm(self, now: float) -> tuple[bool, str]:
        problem = self.state_problem(now)
        if problem is not None:
            return False, f"refused to arm: {problem}"
        self._set(Mode.ARMED, "armed")
        self.prev_action = np.full(ACT_DIM, self.hover_action)  # as at the start of a training episode
        self._auto_arm_pending = False
        return True, "armed"

    def disarm(self, now: float) -> str:
        self._auto_arm_pending = False
        if self.mode in (Mode.ARMED, Mode.FAILSAFE):
            self._enter_failsafe("disarm requested", now, may_recover=False)
        return f"{self.mode.value}: {self.reason}"

    def estop(self) -> str:
        self._auto_arm_pending = False
        self._set(Mode.ESTOP, "emergency stop: rotors cut, re-arm to fly")
        return self.reason

    # ------------------------------------------------------------------ control
    def tick(self, now: float) -> Command:
        """One policy period: decide the mode, return the rotor command."""
        problem = self.state_problem(now)
        if self.mode is Mode.DISARMED and self._auto_arm_pending and problem is None:
            self.arm(now)
        if self.mode is Mode.FAILSAFE:
            self._update_failsafe(problem, now)
        if self.mode is Mode.ARMED:
            if problem is not None:
                self._enter_failsafe(problem, now)
            else:
                action = self._run_policy()
                if action is not None:
                    return self._command(action)
                self._enter_failsafe(self._policy_error, now)
        if self.mode is Mode.FAILSAFE:
            return self._command(np.full(ACT_DIM, self.descent_action))
        return self._command(np.full(ACT_DIM, IDLE_ACTION))

    def status(self) -> dict:
        return {"mode": self.mode.value, "reason": self.reason, "failsafe_count": self.failsafe_count,
                "target": [float(v) for v in self.target],
                "prev_action": [round(float(a), 4) for a in self.prev_action]}

    # ------------------------------------------------------------------ internals
    def _set(self, mode: Mode, reason: str) -> None:
        self.mode, self.reason = mode, reason

    def _command(self, action: np.ndarray) -> Command:
        self.prev_action = action
        return Command(action.copy(), self.mode, self.reason)

    def _run_policy(self) -> np.ndarray | None:
        obs = observation(self._latest, self.target, self.prev_action.astype(np.float32))
        try:
            out = np.asarray(self.policy(obs), dtype=np.float64).reshape(-1)
        except Exception as e:  # any failure of the policy is a failsafe, never a crash
            self._policy_error = f"policy error: {type(e).__name__}: {e}"[:200]
            return None
        if out.shape != (ACT_DIM,) or not np.isfinite(out).all():
            self._policy_error = f"policy error: output {np.round(out, 3).tolist()[:8]} is not {ACT_DIM} finite values"
            return None
        return np.clip(out, -1.0, self.cfg.max_action)

    def _enter_failsafe(self, why: str, now: float, may_recover: bool = True) -> None:
        self.failsafe_count += 1
        self._may_recover = may_recover
        self._good_streak = 0
        h = self.height()
        if h is None or h < self.cfg.landed_height:
            self._set(Mode.DISARMED, f"{why}; on the ground: rotors cut, re-arm to fly")
            return
        # Time to sink h at the constant descent deceleration, plus the rotors' spin-down.
        self._descent_end = now + math.sqrt(2.0 * h / self.descent_accel) + 0.3
        self._set(Mode.FAILSAFE, f"{why}; controlled descent from {h:.2f} m")

    def _update_failsafe(self, problem: str | None, now: float) -> None:
        fresh_height = self.height() if problem is None or problem.startswith("geofence") else None
        if now >= self._descent_end or (fresh_height is not None and fresh_height < self.cfg.landed_height):
            self._set(Mode.DISARMED, f"{self.reason}; landed: rotors cut, re-arm to fly")
        elif self._may_recover and problem is None and self._good_streak >= self.cfg.recover_count:
            self._set(Mode.ARMED, "recovered: valid state again")
