"""Batched Crazyflie rigid-body dynamics in PyTorch: the fast backend used for training.

State layout, shape [N, 17] (all environments stepped as one tensor, CPU or CUDA):
    pos (3, world, m) | quat (4, w x y z, body->world) | vel (3, world, m/s)
    | omega (3, body, rad/s) | rpm (4, rotor speeds M1..M4)
Integration: classic RK4 on the full state (rotor lag included) with the rotor speed
setpoint, external force (world, N) and external torque (body, N m) held over the step.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .forces import body_torque_terms, rotor_thrusts
from .params import GRAVITY, CrazyflieParams

POS, QUAT, VEL, OMEGA, RPM = slice(0, 3), slice(3, 7), slice(7, 10), slice(10, 13), slice(13, 17)
STATE_DIM = 17


@dataclass
class VehicleBatch:
    """Per-environment physical parameters (randomized), each a tensor of shape [N] or [N, 3]."""

    mass: torch.Tensor
    inertia: torch.Tensor  # [N, 3] principal moments, kg m^2
    kf: torch.Tensor
    km: torch.Tensor
    motor_tau: torch.Tensor
    thrust_scale: torch.Tensor  # battery-like multiplier on every rotor's thrust

    @classmethod
    def nominal(cls, n: int, params: CrazyflieParams, device="cpu") -> "VehicleBatch":
        def full(v):
            return torch.full((n,), float(v), device=device)

        return cls(
            mass=full(params.mass),
            inertia=torch.tensor(params.inertia, device=device).repeat(n, 1),
            kf=full(params.kf),
            km=full(params.km),
            motor_tau=full(params.motor_tau),
            thrust_scale=full(1.0),
        )

    def items(self):
        return vars(self).items()


def quat_to_rotmat(q: torch.Tensor) -> torch.Tensor:
    """Unit quaternion (w, x, y, z) [..., 4] -> rotation matrix body->world [..., 3, 3]."""
    w, x, y, z = q.unbind(-1)
    return torch.stack(
        (
            1 - 2 * (y * y + z * z), 2 * (x * y - w * z), 2 * (x * z + w * y),
            2 * (x * y + w * z), 1 - 2 * (x * x + z * z), 2 * (y * z - w * x),
            2 * (x * z - w * y), 2 * (y * z + w * x), 1 - 2 * (x * x + y * y),
        ),
        dim=-1,
    ).reshape(q.shape[:-1] + (3, 3))


def quat_mul(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Hamilton product of (w, x, y, z) quaternions."""
    aw, ax, ay, az = a.unbind(-1)
    bw, bx, by, bz = b.unbind(-1)
    return torch.stack(
        (
            aw * bw - ax * bx - ay * by - az * bz,
            aw * bx + ax * bw + ay * bz - az * by,
            aw * by - ax * bz + ay * bw + az * bx,
            aw * bz + ax * by - ay * bx + az * bw,
        ),
        dim=-1,
    )


Columns = tuple[torch.Tensor, ...]  # a state, setpoint or force split into its components, each [N]


def _derivative(s: Columns, rpm_cmd: Columns, v: VehicleBatch, params: CrazyflieParams,
                force: Columns, torque: Columns, inertia: Columns) -> Columns:
    """Time derivative of the 17 state components, written per component (scalar equations
    over [N] tensors), so that torch.compile fuses a whole RK4 step into one loop."""
    _, _, _, qw, qx, qy, qz, vx, vy, vz, wx, wy, wz, *rpm = s  # position does not enter
    ixx, iyy, izz = inertia
    thrusts = [rotor_thrusts(r, v.kf, v.thrust_scale) for r in rpm]
    tx, ty, yaw_sum = body_torque_terms(thrusts, params)
    tx, ty, tz = tx + torque[0], ty + torque[1], v.km * yaw_sum + torque[2]

    # Thrust acts along the body z axis, whose world direction is the third column of R(q).
    thrust_per_kg = sum(thrusts) / v.mass
    ax = 2 * (qx * qz + qw * qy) * thrust_per_kg + force[0] / v.mass
    ay = 2 * (qy * qz - qw * qx) * thrust_per_kg + force[1] / v.mass
    az = (1 - 2 * (qx * qx + qy * qy)) * thrust_per_kg + force[2] / v.mass - GRAVITY

    # Euler's equation with diagonal inertia: J w_dot = tau - w x (J w).
    dwx = (tx - (izz - iyy) * wy * wz) / ixx
    dwy = (ty - (ixx - izz) * wz * wx) / iyy
    dwz = (tz - (iyy - ixx) * wx * wy) / izz

    # q_dot = 0.5 q (x) (0, omega)
    dqw = 0.5 * (-qx * wx - qy * wy - qz * wz)
    dqx = 0.5 * (qw * wx + qy * wz - qz * wy)
    dqy = 0.5 * (qw * wy - qx * wz + qz * wx)
    dqz = 0.5 * (qw * wz + qx * wy - qy * wx)
    drpm = [(c - r) / v.motor_tau for c, r in zip(rpm_cmd, rpm)]
    return (vx, vy, vz, dqw, dqx, dqy, dqz, ax, ay, az, dwx, dwy, dwz, *drpm)


def derivative(
    state: torch.Tensor,
    rpm_cmd: torch.Tensor,
    v: VehicleBatch,
    params: CrazyflieParams,
    force_world: torch.Tensor,
    torque_body: torch.Tensor,
) -> torch.Tensor:
    """Time derivative of the [N, 17] state."""
    cols = _derivative(state.unbind(1), rpm_cmd.unbind(1), v, params, force_world.unbind(1), torque_body.unbind(1),
                       v.inertia.unbind(1))
    return torch.stack(cols, dim=1)


def rk4_step(
    state: torch.Tensor,
    rpm_cmd: torch.Tensor,
    v: VehicleBatch,
    params: CrazyflieParams,
    force_world: torch.Tensor,
    torque_body: torch.Tensor,
    dt: float,
    substeps: int = 1,
) -> torch.Tensor:
    """``substeps`` classic RK4 steps of dt / substeps (s) each; the quaternion is renormalised
    after each. The setpoint and the external force and torque are held over the whole dt."""
    s = state.unbind(1)
    args = (rpm_cmd.unbind(1), v, params, force_world.unbind(1), torque_body.unbind(1), v.inertia.unbind(1))
    h = dt / substeps
    for _ in range(substeps):
        k1 = _derivative(s, *args)
        k2 = _derivative(tuple(x + 0.5 * h * k for x, k in zip(s, k1)), *args)
        k3 = _derivative(tuple(x + 0.5 * h * k for x, k in zip(s, k2)), *args)
        k4 = _derivative(tuple(x + h * k for x, k in zip(s, k3)), *args)
        s = [x + (h / 6.0) * (a + 2 * b + 2 * c + d) for x, a, b, c, d in zip(s, k1, k2, k3, k4)]
        inv_norm = torch.rsqrt(s[3] * s[3] + s[4] * s[4] + s[5] * s[5] + s[6] * s[6])
        s[3:7] = [x * inv_norm for x in s[3:7]]
    return torch.stack(s, dim=1)


class TorchBackend:
    """All environments' states as one tensor, stepped with :func:`rk4_step`."""

    name = "torch"

    def __init__(self, num_envs: int, params: CrazyflieParams, dt: float, substeps: int = 1, device="cpu"):
        self.num_envs, self.params, self.device = num_envs, params, torch.device(device)
        self.dt, self.substeps = dt, substeps
        self.state = torch.zeros(num_envs, STATE_DIM, device=self.device)
        self.state[:, 3] = 1.0
        self.vehicle = VehicleBatch.nominal(num_envs, params, self.device)

    def set_state(self, idx: torch.Tensor, state: torch.Tensor, vehicle: VehicleBatch) -> None:
        """Place environments ``idx`` in ``state`` with physical parameters ``vehicle`` (full batch)."""
        self.state[idx] = state
        self.vehicle = vehicle

    def step(self, rpm_cmd: torch.Tensor, force_world: torch.Tensor, torque_body: torch.Tensor) -> torch.Tensor:
        """Advance every environment by dt seconds; returns the new [N, 17] state."""
        self.state = rk4_step(self.state, rpm_cmd, self.vehicle, self.params, force_world, torque_body, self.dt,
                              self.substeps)
        return self.state

    def close(self) -> None:
        """Nothing to free: the state is a tensor."""
