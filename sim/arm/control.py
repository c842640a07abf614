"""Cartesian control of the arm: the action [dx, dy, dz, dyaw, gripper] -> actuator targets.

Differential inverse kinematics, batched over environments (NumPy, float64):

    e   = [p_des - p_ee ; k_rot * rot_err(R_ee, R_des)]          6-vector, world frame
    J+  = J^T (J J^T + lambda^2 I)^-1                               damped least squares
    dq  = J+ e + (I - J+ J) k_null (q_home - q)                     null space pulls toward home
    dq *= min(1, min_i qd_max_i * T / |dq_i|)                       speed limits, direction kept
    q_target = q + dq, within [q_min + margin, q_max - margin]     approached at qdd_max (below)

Joint limits: a joint whose target would leave its range is locked at its bound and the rest of
the motion is solved again by the other joints (J with the locked columns zeroed, the locked
joints' own motion taken off e, no null-space motion of locked joints), until no free joint leaves
its range. Clipping the targets alone would keep the limits but not the commanded motion: driven
toward (0.25, 0, 0.016) m, near the robot's base, the TCP moved up to ~70 deg away from the command
and stopped 3.7 cm short with the hand tilted; it now arrives (tests/test_arm.py).

J is the 6x7 Jacobian of the ``ee`` site (mj_jacSite), R_des points the gripper straight down
at the desired yaw about world z (yaw 0: fingers opening along world y). ``p_des`` and the
desired yaw are the measured TCP position and yaw plus the commanded deltas, so nothing winds up
when the arm is blocked (by the table or the cube); the yaw stays within +-``yaw_limit`` of 0,
which covers every grasp of the cube (90 deg symmetry). The range is not centred on joint 7's:
toward -90 deg joint 7 reaches its limit in part of the workspace, and the joint lock below turns
the other joints instead. The IK corrects ``rot_gain`` of the orientation error per step, so a
held yaw command turns the gripper by ~0.8 x its desired turn per step.
The joint servos do not jump to q_target: over the period's 2 ms physics steps their reference
velocity moves from the joints' measured velocity toward the period's mean (q_target - q) / T with
no joint faster than Franka's acceleration limits qdd_max (all joints scaled together, so the TCP
keeps its direction; stopping in time before a joint's range ends), the reference position follows
it, and the velocity is fed forward through the PD gains: what a velocity command through a rate
limiter does (libfranka has one, at the robot's 1 kHz; here at the physics step's 500 Hz). Before
this (until 2026-11-28) the servos stepped toward each period's target: the joints peaked at 1.2-1.6
x qd_max under the scripted experts and 1.8 x under full-scale random actions, accelerating far
beyond qdd_max. Now they peak at 0.94-1.07 x qd_max under the experts at noise 0 and 0.3 (at most
0.1 % of physics steps above it) and at 1.07 x under full-scale random actions held for 10 steps
(7.8 % of steps above qd_max: the servo's overshoot of a reference cruising at qd_max), from an
ad-hoc script outside the repository, one episode of 8 environments each, 2026-11-28. Not where the
hand is pressed against something: the links do not collide, so random actions can take the hand
under the table's edge, and there a joint reached 1.94 x qd_max (a review's ad-hoc run, 2026-11-29:
4 environments, 300 steps of random actions each held for 10, joint 7, the reference at 0.98 x). What it costs
is what a real Panda costs: from rest, one command of 2 cm moves the TCP ~7 mm up in its period
(tests/test_arm.py), a held one moves 7, 17, then 21 mm per period (0.4 m/s), and the scripted
experts take longer and damp their approach (ArmEnv.toward; their docstrings).

Gripper: the action maps linearly to the finger opening target; the finger servo moves the
fingers at up to the Franka Hand's 0.05 m/s and squeezes with up to GripperParams.force per finger.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from .params import ArmParams


@dataclass(frozen=True)
class IKConfig:
    max_delta: float = 0.02  # m per control step for an action of 1 (0.4 m/s at 20 Hz), per axis
    damping: float = 0.02  # lambda of the damped least squares (m, rad)
    rot_gain: float = 0.8  # fraction of the orientation error corrected per step
    null_gain: float = 0.05  # fraction of the distance to home pulled per step in the null space
    limit_margin: float = 0.05  # rad kept from every joint limit
    # rad, desired turn per control step for an action of 1; the IK closes rot_gain of it per step, so
    # a held full command turns ~0.08 rad per step (1.6 rad/s at 20 Hz; the Franka's joint 7 turns at
    # up to 2.61 rad/s, Franka Emika datasheet): 45 deg in ~10 steps
    max_dyaw: float = 0.1
    yaw_limit: float = math.pi / 2  # rad, |desired gripper yaw about world z| (0: fingers open along world y)


def down_rotation(yaw: np.ndarray) -> np.ndarray:
    """[N,3,3] hand orientations (hand to world): z (approach) pointing down, x at ``yaw`` [N] (rad)."""
    c, s, z = np.cos(yaw), np.sin(yaw), np.zeros_like(yaw)
    x = np.stack((c, s, z), -1)
    y = np.stack((s, -c, z), -1)  # z x x, with z = -e_z
    return np.stack((x, y, np.stack((z, z, -np.ones_like(yaw)), -1)), axis=-1)


def hand_yaw(rot: np.ndarray) -> np.ndarray:
    """[N] yaw (rad, about world z) of the hand x axis of ``rot`` [N,3,3] (hand to world)."""
    return np.arctan2(rot[:, 1, 0], rot[:, 0, 0])


def rotation_error(rot: np.ndarray, rot_des: np.ndarray) -> np.ndarray:
    """Small-angle rotation vector (world frame, rad) taking ``rot`` [N,3,3] to ``rot_des`` [N,3,3]."""
    return 0.5 * np.cross(rot, rot_des, axisa=1, axisb=1, axisc=1).sum(-1)


class DiffIK:
    """Turns Cartesian TCP deltas into joint position targets (see the module docstring)."""

    def __init__(self, params: ArmParams, cfg: IKConfig = IKConfig()):
        p, control_period = params.panda, params.sim.control_period
        self.cfg = cfg
        self.q_home = np.array(p.home)
        self.lo = np.array(p.q_min) + cfg.limit_margin
        self.hi = np.array(p.q_max) - cfg.limit_margin
        self.max_step = np.array(p.qd_max) * control_period  # rad per control period
        self.period, self.dt, self.steps = control_period, params.sim.timestep, params.sim.substeps  # s, s, 1
        self.qd_max, self.qdd_max = np.array(p.qd_max), np.array(p.qdd_max)
        # Velocity feed-forward through the position servo: kp (q_ref + kv/kp v_ref - q) - kv qd is
        # kp (q_ref - q) + kv (v_ref - qd).
        self.lead = np.array(p.kv) / np.array(p.kp)  # s
        self.stroke = params.gripper.stroke

    def joint_targets(self, jac: np.ndarray, ee_pos: np.ndarray, ee_rot: np.ndarray, q: np.ndarray,
                      pos_des: np.ndarray, yaw_des: np.ndarray) -> np.ndarray:
        """jac [N,6,7] (rows: linear, angular), ee_pos [N,3], ee_rot [N,3,3] (hand to world),
        q [N,7], pos_des [N,3] (world, m), yaw_des [N] (rad) -> joint targets [N,7] (rad)."""
        c = self.cfg
        err = np.concatenate((pos_des - ee_pos, c.rot_gain * rotation_error(ee_rot, down_rotation(yaw_des))), axis=-1)
        pull = c.null_gain * (self.q_home - q)  # toward home, in the null space
        dq = self._solve(jac, err, pull)
        scale = self._velocity_scale(dq)
        step = dq * scale
        beyond = (q + step < self.lo) | (q + step > self.hi)
        rows = np.flatnonzero(beyond.any(-1))
        if rows.size:  # rare (near the base or the workspace's edge): re-solve those rows
            step[rows] = self._step_within_limits(jac[rows], err[rows] * scale[rows], pull[rows] * scale[rows],
                                                  q[rows], step[rows], beyond[rows])
        return np.clip(q + step, self.lo, self.hi)

    def reference_trajectory(self, q: np.ndarray, qd: np.ndarray,
                             q_target: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """The joints' reference positions (rad) and velocities (rad/s), each [N, steps, 7], at the end
        of each physics step (``dt``) of the control period, from the joints' positions q and
        velocities qd [N,7] at its start: the velocity moves from qd toward the period's mean
        (q_target - q) / T (which joint_targets keeps within qd_max) with no joint faster than
        qdd_max, and never faster than every joint can still stop before its range ends, as a
        velocity command through a rate limiter would move the robot. Both limits scale the joints'
        velocities together, so that the TCP keeps the IK's direction (from rest, a lift stays a
        lift; clipped joint by joint it went 2.8 cm sideways); a joint the servo has carried past its
        range's end brakes on its own."""
        v_cmd = (q_target - q) / self.period
        p, v = q.copy(), np.clip(qd, -self.qd_max, self.qd_max)
        dt = self.dt
        dv = self.qdd_max * dt
        pos, vel = np.empty((self.steps,) + q.shape), np.empty((self.steps,) + q.shape)
        for k in range(self.steps):
            # A joint its servo has carried past its range's end, still moving out, brakes alone at
            # qdd_max (the IK's target lies inside); the others move toward v_cmd together, scaled as a
            # whole (clipping each joint's change would bend the TCP's path).
            past = (np.where(v > 0, self.hi - p, p - self.lo) <= 0.0) & (v != 0.0)
            change = np.where(past, 0.0, v_cmd - v)
            toward = v + change * np.minimum(1.0, (dv / np.maximum(np.abs(change), 1e-12)).min(-1, keepdims=True))
            # Where that change would leave the joints too fast to stop before a range's end, they
            # brake together along their present velocities instead (_group_stop), by at most each
            # one's qdd_max: the change and the braking in one physics step took up to 2x that.
            toward, s_toward = self._group_stop(p, toward, past)
            if (s_toward >= 1.0).all():  # nearly always: far from every range's end
                v = toward
            else:
                held, s_held = self._group_stop(p, v, past)
                v = np.where(s_toward >= 1.0, toward, np.where(past, held, held * np.minimum(s_held, 1.0)))
            p = p + v * dt
            pos[k], vel[k] = p, v
        return pos.transpose(1, 0, 2), vel.transpose(1, 0, 2)

    def _group_stop(self, p: np.ndarray, v: np.ndarray, past: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """The velocities v [N,7] (rad/s) at positions p [N,7] with the joints in ``past`` (carried past
        their range's end, moving out) braked alone by qdd_max dt and a joint about to move out from its
        range's end stopped there; and the largest scale s [N,1] of the others' velocities with which
        they can still stop, braking together, before any of them reaches its range's end (s >= 1:
        no braking needed). Braking together scales every velocity by s, which falls by at most
        delta = min_j dv_j / |v_j| per physics step (the joint with the least acceleration to spare
        sets it), within a room of R = min_j room_j / |v_j| (in s: the shortest time to a range's end
        at the present speeds); from s in [n delta, (n + 1) delta) the group covers
        dt ((n + 1) s - delta n (n + 1) / 2) of R. (Each joint braking alone at its own qdd_max took the
        others' speed down in one physics step, at up to 30x their acceleration limits.)"""
        dt, dv = self.dt, self.qdd_max * self.dt
        v = np.where(past, np.sign(v) * np.maximum(np.abs(v) - dv, 0.0), v)
        room = np.where(v > 0, self.hi - p, p - self.lo)
        v = np.where((room <= 0.0) & ~past, 0.0, v)
        moving = ~past & (v != 0.0)
        some = moving.any(-1, keepdims=True)  # rows where none of them moves need no braking
        speed = np.maximum(np.abs(v), 1e-12)
        delta = np.where(some, np.where(moving, dv / speed, np.inf).min(-1, keepdims=True), 1.0)
        rooms = np.where(some, np.where(moving, np.maximum(room, 0.0) / speed, np.inf).min(-1, keepdims=True), 0.0)
        n = np.floor(np.sqrt(0.25 + 2.0 * rooms / (delta * dt)) - 0.5)
        stop = (rooms / dt + delta * n * (n + 1) / 2) / (n + 1)
        return v, np.where(some, stop, np.inf)

    def servo_references(self, q: np.ndarray, qd: np.ndarray, q_target: np.ndarray) -> np.ndarray:
        """The position servos' references [N, steps, 7] (rad) for reference_trajectory, its velocity
        fed forward (``lead``)."""
        pos, vel = self.reference_trajectory(q, qd, q_target)
        return pos + self.lead * vel

    def _solve(self, jac: np.ndarray, err: np.ndarray, pull: np.ndarray) -> np.ndarray:
        """Damped least squares dq [N,7] for the task error err [N,6], plus ``pull`` [N,7] projected
        onto the null space; zeroed columns of ``jac`` are joints that do not move."""
        jjt = jac @ jac.transpose(0, 2, 1) + self.cfg.damping**2 * np.eye(6)
        pinv = jac.transpose(0, 2, 1) @ np.linalg.inv(jjt)  # [N,7,6]
        dq = (pinv @ err[..., None])[..., 0]
        null = np.eye(7) - pinv @ jac
        return dq + (null @ pull[..., None])[..., 0]

    def _velocity_scale(self, dq: np.ndarray) -> np.ndarray:
        """[N,1] factor <= 1 that keeps every joint's target step within its speed limit times the
        control period, the direction kept."""
        return np.minimum(1.0, (self.max_step / np.maximum(np.abs(dq), 1e-12)).min(-1, keepdims=True))

    def _step_within_limits(self, jac: np.ndarray, err: np.ndarray, pull: np.ndarray, q: np.ndarray,
                            step: np.ndarray, beyond: np.ndarray) -> np.ndarray:
        """Joint steps [n,7] for the scaled task error ``err`` and null-space pull whose first solution
        ``step`` took the joints ``beyond`` out of their range: those are locked at their bound, the
        others re-solve the rest of the motion; repeated while a free joint leaves its range."""
        locked = beyond.copy()
        for _ in range(7):
            lock_step = np.where(locked, np.clip(q + step, self.lo, self.hi) - q, 0.0)
            free = ~locked
            rest = err - (jac @ lock_step[..., None])[..., 0]
            dq = self._solve(jac * free[:, None, :], rest, pull * free) * free
            step = lock_step + dq * self._velocity_scale(dq)
            beyond = free & ((q + step < self.lo) | (q + step > self.hi))
            if not beyond.any():
                break
            locked |= beyond
        return step

    def tcp_targets(self, ee_pos: np.ndarray, action_xyz: np.ndarray) -> np.ndarray:
        """Desired TCP position: measured TCP + action (clipped to [-1, 1]) x max_delta (world, m)."""
        return ee_pos + self.cfg.max_delta * np.clip(action_xyz, -1.0, 1.0)

    def yaw_targets(self, ee_rot: np.ndarray, action_yaw: np.ndarray) -> np.ndarray:
        """Desired gripper yaw [N] (rad): measured yaw + action (clipped to [-1, 1]) x max_dyaw, within
        +-yaw_limit."""
        c = self.cfg
        return np.clip(hand_yaw(ee_rot) + c.max_dyaw * np.clip(action_yaw, -1.0, 1.0), -c.yaw_limit, c.yaw_limit)

    def gripper_target(self, action_grip: np.ndarray) -> np.ndarray:
        """Gripper action -1 (open, 0.04 m per finger) .. +1 (closed, 0 m), mapped linearly to the
        mean finger opening target, m."""
        return self.stroke * (1.0 - np.clip(action_grip, -1.0, 1.0)) / 2
