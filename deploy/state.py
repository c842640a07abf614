"""The robot state as the deploy nodes see it, its checks, and the policy observation.

Conventions (STYLE.md): SI units, world frame ENU (z up), body frame FLU, quaternions
(w, x, y, z) body->world. ROS messages carry quaternions as (x, y, z, w); the conversion
happens here and only here.

Odometry convention (REP 105, nav_msgs/Odometry): the pose is in ``header.frame_id`` (the
world frame), the twist in ``child_frame_id`` (the body frame). Every node of this package
publishes and reads ``twist.twist.linear`` as the BODY-frame velocity; the policy observation
wants the world-frame velocity, so :func:`state_from_odometry` rotates it: v_world = R v_body.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from sim.crazyflie.contract import ACT_DIM, OBS_DIM


@dataclass(frozen=True)
class State:
    """One rigid-body state sample. Arrays are float64."""

    pos: np.ndarray  # (3,) world ENU, m
    quat: np.ndarray  # (4,) w, x, y, z, body->world, unit
    vel: np.ndarray  # (3,) world ENU, m/s
    omega: np.ndarray  # (3,) body FLU, rad/s
    stamp: float  # s, the publisher's clock (sim time or wall time)


@dataclass(frozen=True)
class StateLimits:
    """Plausibility bounds: a state outside them is "out_of_range" (a broken estimator, not a
    flight the policy can handle). Defaults bound what a Crazyflie 2.x can physically do."""

    max_abs_position: float = 100.0  # m, any axis
    max_speed: float = 10.0  # m/s
    max_rate: float = 35.0  # rad/s per axis (the gyro saturates at 2000 deg/s = 34.9 rad/s)
    quat_norm_tol: float = 0.1  # |1 - |q|| above this is not a rotation


class InvalidState(ValueError):
    """A state that must not reach the policy; ``reason`` is "nonfinite" or "out_of_range"."""

    def __init__(self, reason: str, detail: str):
        super().__init__(f"{reason}: {detail}")
        self.reason = reason


def quat_to_rotmat(q: np.ndarray) -> np.ndarray:
    """Unit quaternion (w, x, y, z) -> rotation matrix body->world (3, 3)."""
    w, x, y, z = q
    return np.array(
        [
            [1 - 2 * (y * y + z * z), 2 * (x * y - w * z), 2 * (x * z + w * y)],
            [2 * (x * y + w * z), 1 - 2 * (x * x + z * z), 2 * (y * z - w * x)],
            [2 * (x * z - w * y), 2 * (y * z + w * x), 1 - 2 * (x * x + y * y)],
        ]
    )


def unit_quat(q: np.ndarray, tol: float = StateLimits.quat_norm_tol) -> np.ndarray:
    """q / |q| where q is finite and non-zero and |q| within ``tol`` of 1 (``math.inf``: any finite,
    non-zero q); any other q unchanged, for make_state to refuse."""
    with np.errstate(all="ignore"):
        norm = np.linalg.norm(q)
        usable = bool(np.isfinite(q).all()) and norm > 0 and abs(norm - 1.0) <= tol
        return q / norm if usable else q


def make_state(pos, quat, vel, omega, stamp: float, limits: StateLimits = StateLimits()) -> State:
    """Checked State from position (world, m), quaternion (w, x, y, z), velocity (world, m/s) and
    body rates (body, rad/s); raises InvalidState. The quaternion is normalised."""
    parts = [np.asarray(v, dtype=np.float64).reshape(-1) for v in (pos, quat, vel, omega)]
    if [len(p) for p in parts] != [3, 4, 3, 3]:
        raise InvalidState("out_of_range", f"component sizes {[len(p) for p in parts]}, expected [3, 4, 3, 3]")
    pos, q, vel, omega = parts
    if not (all(np.isfinite(p).all() for p in parts) and math.isfinite(stamp)):
        raise InvalidState("nonfinite", "NaN or infinity in the state")
    norm = float(np.linalg.norm(q))
    if abs(norm - 1.0) > limits.quat_norm_tol:
        raise InvalidState("out_of_range", f"quaternion norm {norm:.3g}, expected 1")
    if np.abs(pos).max() > limits.max_abs_position:
        raise InvalidState("out_of_range", f"position {pos.round(2).tolist()} m beyond {limits.max_abs_position} m")
    if np.linalg.norm(vel) > limits.max_speed:
        raise InvalidState("out_of_range", f"speed {np.linalg.norm(vel):.3g} m/s above {limits.max_speed} m/s")
    if np.abs(omega).max() > limits.max_rate:
        raise InvalidState("out_of_range", f"body rate {np.abs(omega).max():.3g} rad/s above {limits.max_rate} rad/s")
    return State(pos, q / norm, vel, omega, stamp)


def stamp_seconds(stamp) -> float:
    """builtin_interfaces/Time -> s."""
    return stamp.sec + 1e-9 * stamp.nanosec


def state_from_odometry(msg, limits: StateLimits = StateLimits()) -> State:
    """nav_msgs/Odometry (pose in world, twist in body, REP 105) -> checked State."""
    p, o = msg.pose.pose.position, msg.pose.pose.orientation
    v, w = msg.twist.twist.linear, msg.twist.twist.angular
    q = np.array([o.w, o.x, o.y, o.z])
    v_body = np.array([v.x, v.y, v.z])
    with np.errstate(all="ignore"):  # non-finite input is rejected by make_state
        v_world = quat_to_rotmat(unit_quat(q, math.inf)) @ v_body  # a far-off norm is refused for itself
    return make_state((p.x, p.y, p.z), q, v_world, (w.x, w.y, w.z), stamp_seconds(msg.header.stamp), limits)


def fill_odometry(msg, state: State, frame_id: str, child_frame_id: str):
    """Write ``state`` into a nav_msgs/Odometry ``msg`` (twist in the body frame); returns msg."""
    msg.header.stamp.sec = int(math.floor(state.stamp))
    msg.header.stamp.nanosec = min(int(round((state.stamp - math.floor(state.stamp)) * 1e9)), 999_999_999)
    msg.header.frame_id, msg.child_frame_id = frame_id, child_frame_id
    p, o = msg.pose.pose.position, msg.pose.pose.orientation
    p.x, p.y, p.z = (float(c) for c in state.pos)
    o.w, o.x, o.y, o.z = (float(c) for c in state.quat)
    v_body = quat_to_rotmat(state.quat).T @ state.vel
    lin, ang = msg.twist.twist.linear, msg.twist.twist.angular
    lin.x, lin.y, lin.z = (float(c) for c in v_body)
    ang.x, ang.y, ang.z = (float(c) for c in state.omega)
    return msg


def observation(state: State, target: np.ndarray, prev_action: np.ndarray) -> np.ndarray:
    """The 22-float policy observation (sim/crazyflie/contract.py), float32:
    position - target (world, m) | R body->world row-major | velocity (world, m/s; the hover
    reference velocity is 0) | angular velocity (body, rad/s) | previous action."""
    obs = np.concatenate(
        (state.pos - target, quat_to_rotmat(state.quat).reshape(9), state.vel, state.omega, prev_action)
    ).astype(np.float32)
    assert obs.shape == (OBS_DIM,) and prev_action.shape == (ACT_DIM,)
    return obs
