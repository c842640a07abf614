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


def derivative(
    state: torch.Tensor,
    rpm_cmd: torch.Tensor,
    v: VehicleBatch,
    params: CrazyflieParams,
    force_world: torch.Tensor,
    torque_body: torch.Tensor,
) -> torch.Tensor:
    """Time derivative of the [N, 17] state."""
    q = state[:, QUAT]
    vel = state[:, VEL]
    omega = state[:, OMEGA]
    rpm = state[:, RPM]

    thrusts = rotor_thrusts(rpm, v.kf[:, None], v.thrust_scale[:, None])
    tx, ty, yaw_sum = body_torque_terms(thrusts, params)
    torque = torch.stack((tx, ty, v.km * yaw_sum), dim=-1) + torque_body

    # Thrust acts along the body z axis: world direction is the third column of R.
    w, x, y, z = q.unbind(-1)
    body_z = torch.stack((2 * (x * z + w * y), 2 * (y * z - w * x), 1 - 2 * (x * x + y * y)), dim=-1)
    acc = body_z * (thrusts.sum(-1) / v.mass)[:, None] + force_world / v.mass[:, None]
    acc[:, 2] -= GRAVITY

    # Euler's equation with diagonal inertia: J w_dot = tau - w x (J w).
    domega = (torque - torch.linalg.cross(omega, v.inertia * omega)) / v.inertia
    # q_dot = 0.5 q (x) (0, omega)
    dq = 0.5 * quat_mul(q, torch.cat((torch.zeros_like(omega[:, :1]), omega), dim=-1))
    drpm = (rpm_cmd - rpm) / v.motor_tau[:, None]
    return torch.cat((vel, dq, acc, domega, drpm), dim=-1)


def rk4_step(
    state: torch.Tensor,
    rpm_cmd: torch.Tensor,
    v: VehicleBatch,
    params: CrazyflieParams,
    force_world: torch.Tensor,
    torque_body: torch.Tensor,
    dt: float,
) -> torch.Tensor:
    """One RK4 step of length dt (s); the quaternion is renormalised afterwards."""

    def f(s):
        return derivative(s, rpm_cmd, v, params, force_world, torque_body)

    k1 = f(state)
    k2 = f(state + 0.5 * dt * k1)
    k3 = f(state + 0.5 * dt * k2)
    k4 = f(state + dt * k3)
    out = state + (dt / 6.0) * (k1 + 2 * k2 + 2 * k3 + k4)
    q = out[:, QUAT]
    return torch.cat((out[:, :3], q / q.norm(dim=-1, keepdim=True), out[:, 7:]), dim=-1)


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
        h = self.dt / self.substeps
        for _ in range(self.substeps):
            self.state = rk4_step(self.state, rpm_cmd, self.vehicle, self.params, force_world, torque_body, h)
        return self.state
