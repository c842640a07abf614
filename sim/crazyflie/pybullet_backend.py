"""PyBullet backend: same interface as :class:`~sim.crazyflie.dynamics.TorchBackend`.

One headless (DIRECT) PyBullet world holds every environment as a free rigid body built from
a URDF generated from :class:`CrazyflieParams`; collisions are disabled, so bodies never
interact except through the optional downwash model. Each substep applies to every body one
force at its centre of mass (the rotor thrusts along body z plus the external force) and one
torque (the moments of the thrusts about the hubs' lever arms, the yaw reaction and the
external torque), then calls ``stepSimulation`` (semi-implicit Euler, timestep dt / substeps).
For a rigid body this is the same as applying each thrust at its hub, with two PyBullet calls
per body instead of six (PyBullet has no batched call, so these calls set the backend's speed).
Semi-implicit Euler with forces from the substep's start is the leapfrog scheme, second order,
if its velocities are taken as those of half a substep earlier: a placed state's velocities are
stored so (``_stagger``), the reported state adds the missing half substep of acceleration, and
the kick across a change of the external wrench takes half of each. PyBullet's own gyroscopic
term, computed from the stored angular velocity, stays first order (tests/test_backends.py).
Optional aerodynamic effects follow the models of gym-pybullet-drones (ground effect, rotor drag,
downwash) with the coefficients of ``params``, with three differences: the drag coefficients act on the
body-frame velocity (in-plane and along the rotor axis; gym-pybullet-drones applies them to the world
velocity's components), the downwash pushes along world -z (there along the lower drone's body -z), and
the ground effect scales with the battery's thrust scale like the thrust it adds to.
"""

from __future__ import annotations

import math
import os
import sys
import tempfile
from itertools import chain

import numpy as np
import torch

from .dynamics import OMEGA, POS, QUAT, RPM, VEL, VehicleBatch
from .forces import body_torque_terms, cross_rows, rotor_thrusts
from .params import GRAVITY, CrazyflieParams


def _import_pybullet():
    """pybullet, without the "pybullet build time: ..." line its C module writes to stderr on import (in the
    middle of a training's output: the confirmations import it); anything else written then is passed on."""
    try:
        sys.stderr.flush()
        saved = os.dup(2)
    except (AttributeError, OSError):  # no stderr (closed): nothing to keep clean
        import pybullet
        return pybullet
    with tempfile.TemporaryFile() as caught:
        try:
            os.dup2(caught.fileno(), 2)
            import pybullet
        finally:
            sys.stderr.flush()  # Python's own writes, into the file too
            os.dup2(saved, 2)
            os.close(saved)
            caught.seek(0)
            rest = [ln for ln in caught.read().decode(errors="replace").splitlines(keepends=True)
                    if not ln.startswith("pybullet build time:")]
            if rest:
                sys.stderr.write("".join(rest))
    return pybullet


p = _import_pybullet()

# gym-pybullet-drones clips rotor heights in its ground-effect model at
# 0.25 R sqrt(15 C / 4), which caps the extra thrust at 4/15 of the rotor's own thrust.
GROUND_EFFECT_MAX_GAIN = 4.0 / 15.0
# Horizontal distance beyond which another drone's downwash is ignored, m (gym-pybullet-drones).
DOWNWASH_RANGE = 10.0
RPM_TO_RAD_S = 2.0 * math.pi / 60.0
# Each environment's body lives at its own origin, this far along world x from the previous one
# (m; environment coordinates are world coordinates minus that origin). Bullet's broadphase pairs
# bodies whose bounding boxes overlap before it looks at collision masks: 100 vehicles around one
# target made stepSimulation ~7x slower (350 vs 50 us per call, measured here) than spread ones.
ENV_SPACING = 10.0
LEVI_CIVITA = np.zeros((3, 3, 3))
LEVI_CIVITA[0, 1, 2] = LEVI_CIVITA[1, 2, 0] = LEVI_CIVITA[2, 0, 1] = 1.0
LEVI_CIVITA[0, 2, 1] = LEVI_CIVITA[2, 1, 0] = LEVI_CIVITA[1, 0, 2] = -1.0


def rotmat_xyzw(q: np.ndarray) -> np.ndarray:
    """Unit quaternions (x, y, z, w), PyBullet's order, [N, 4] -> rotation matrices body->world
    [N, 3, 3]: R = (w^2 - v.v) I + 2 v v^T + 2 w [v]x, in a few array operations whatever N
    (a getMatrixFromQuaternion call per body cost 1.5 us each; dynamics.quat_to_rotmat works on
    tensors, and its element-wise form in NumPy cost 32 us a call for one vehicle)."""
    v, w = q[:, :3], q[:, 3]
    cross = -np.einsum("ijk,nk->nij", LEVI_CIVITA, v)  # [v]x a = v x a
    return ((w * w - (v * v).sum(-1))[:, None, None] * np.eye(3) + 2.0 * v[:, :, None] * v[:, None, :]
            + 2.0 * w[:, None, None] * cross)


def build_urdf(params: CrazyflieParams) -> str:
    """Single-link URDF: nominal mass and principal inertia, frame collision box."""
    ixx, iyy, izz = params.inertia
    size = " ".join(f"{2 * h:.9g}" for h in params.frame_half_extents)
    return f"""<?xml version="1.0"?>
<robot name="crazyflie">
  <link name="base_link">
    <inertial>
      <origin xyz="0 0 0" rpy="0 0 0"/>
      <mass value="{params.mass:.9g}"/>
      <inertia ixx="{ixx:.9g}" ixy="0" ixz="0" iyy="{iyy:.9g}" iyz="0" izz="{izz:.9g}"/>
    </inertial>
    <collision>
      <origin xyz="0 0 0" rpy="0 0 0"/>
      <geometry><box size="{size}"/></geometry>
    </collision>
  </link>
</robot>
"""


class PybulletBackend:
    """All environments as bodies of one PyBullet world, stepped with timestep dt / substeps.

    ``ground_effect``: extra rotor thrust near the ground plane z = 0 (Shi et al. 2019).
    ``drag``: rotor drag opposing the body-frame velocity, proportional to the rotor speeds.
    ``downwash``: every drone is pushed down by drones flying above it. The environments share
    one airspace for this model, so only enable it when they form one swarm.
    """

    name = "pybullet"

    def __init__(
        self,
        num_envs: int,
        params: CrazyflieParams,
        dt: float,
        substeps: int = 10,
        device="cpu",
        ground_effect: bool = False,
        drag: bool = False,
        downwash: bool = False,
    ):
        self.num_envs, self.params, self.device = num_envs, params, torch.device(device)
        self.dt, self.substeps = dt, substeps
        self._half_substep = 0.5 * dt / substeps  # s
        self.ground_effect, self.drag, self.downwash = ground_effect, drag, downwash
        self._client = p.connect(p.DIRECT)
        p.setGravity(0.0, 0.0, -GRAVITY, physicsClientId=self._client)
        p.setTimeStep(dt / substeps, physicsClientId=self._client)
        self._origin = np.zeros((num_envs, 3))
        self._origin[:, 0] = ENV_SPACING * np.arange(num_envs)
        with tempfile.NamedTemporaryFile("w", suffix=".urdf", delete=False) as f:
            f.write(build_urdf(params))
        try:
            self._bodies = [
                p.loadURDF(f.name, origin.tolist(), flags=p.URDF_USE_INERTIA_FROM_FILE, physicsClientId=self._client)
                for origin in self._origin
            ]
        finally:
            os.unlink(f.name)
        for b in self._bodies:
            p.setCollisionFilterGroupMask(b, -1, 0, 0, physicsClientId=self._client)
            # PyBullet damps velocities by default, lets resting bodies sleep and caps every velocity
            # component at 100 (m/s, rad/s; a tumbling Crazyflie passes 100 rad/s in ~0.2 s): none is physics.
            p.changeDynamics(
                b, -1, linearDamping=0.0, angularDamping=0.0, maxJointVelocity=1e4,
                activationState=p.ACTIVATION_STATE_DISABLE_SLEEPING, physicsClientId=self._client,
            )
        self._hubs = np.array([(x, y, 0.0) for x, y in params.rotor_xy])  # body frame, m
        self._drag_coeff = np.array((params.drag_coeff_xy, params.drag_coeff_xy, params.drag_coeff_z))
        self._ground_effect_h_clip = 0.25 * params.prop_radius * math.sqrt(params.ground_effect_coeff / GROUND_EFFECT_MAX_GAIN)
        self._rpm = np.zeros((num_envs, 4))
        # Linear (world, m/s^2) and angular (body, rad/s^2) accelerations at the last read state: the
        # half-substep kick between PyBullet's staggered velocities and the reported ones.
        self._acc, self._alpha = np.zeros((num_envs, 3)), np.zeros((num_envs, 3))
        self._placed = np.ones(num_envs, dtype=bool)  # placed (here or by set_state), velocities not yet staggered
        # External force (world, N) and torque (body, N m) of the last step: the first substep of the
        # next one kicks with the mean of those and the new ones (half of its kick lies before the change).
        self._f_prev, self._t_prev = np.zeros((num_envs, 3)), np.zeros((num_envs, 3))
        self._set_vehicle(VehicleBatch.nominal(num_envs, params, self.device))
        self._read()
        self.state = self._state()

    def _set_vehicle(self, vehicle: VehicleBatch) -> None:
        self.vehicle = vehicle
        v = {k: t.detach().to("cpu", torch.float64).numpy() for k, t in vehicle.items()}
        for b, m, inertia in zip(self._bodies, v["mass"].tolist(), v["inertia"].tolist()):
            p.changeDynamics(b, -1, mass=m, localInertiaDiagonal=inertia, physicsClientId=self._client)
        self._kf, self._thrust_scale, self._km = v["kf"][:, None], v["thrust_scale"][:, None], v["km"]
        self._mass, self._inertia = v["mass"], v["inertia"]
        # Exact solution of drpm/dt = (cmd - rpm) / tau over one substep with cmd held.
        self._lag = 1.0 - np.exp(-self.dt / self.substeps / v["motor_tau"])[:, None]

    def _read(self, velocities: bool = True) -> None:
        """Pull every body's pose (and, with ``velocities``, its velocity) from PyBullet: world frame,
        positions relative to the environment's origin, quaternions x y z w. A call per body and
        quantity (PyBullet has no batched getter); the tuples are flattened into one array at once
        (np.array over tuples of tuples cost ~20 us per call for 100 bodies)."""
        c, n = self._client, self.num_envs
        # The client id goes by position in the per-body calls here and in step(): PyBullet parses
        # keywords ~0.14 us slower per call, ~0.2 s of 100 evaluation episodes (1.5M calls).
        poses = [p.getBasePositionAndOrientation(b, c) for b in self._bodies]
        pose = np.fromiter(chain.from_iterable(chain.from_iterable(poses)), float, 7 * n).reshape(n, 7)
        self._com_world = [xyz for xyz, _ in poses]  # where step() applies the forces, PyBullet's coordinates
        self._pos, self._quat_xyzw = pose[:, :3] - self._origin, pose[:, 3:]
        self._rot = rotmat_xyzw(self._quat_xyzw)
        if velocities:
            twists = [p.getBaseVelocity(b, c) for b in self._bodies]
            twist = np.fromiter(chain.from_iterable(chain.from_iterable(twists)), float, 6 * n).reshape(n, 6)
            self._vel, self._omega_world = twist[:, :3], twist[:, 3:]
            # PyBullet reports angular velocity in the world frame; ours is body: R^T omega_world.
            self._omega_body = np.einsum("nji,nj->ni", self._rot, self._omega_world)

    def _state(self) -> torch.Tensor:
        """The [N, 17] state at the last read: PyBullet's velocities, half a substep old, plus half a
        substep of the current acceleration."""
        half = self._half_substep
        quat = self._quat_xyzw[:, [3, 0, 1, 2]]
        state = np.concatenate((self._pos, quat, self._vel + half * self._acc, self._omega_body + half * self._alpha,
                                self._rpm), axis=1)
        return torch.as_tensor(state, dtype=torch.float32, device=self.device)

    def set_state(self, idx: torch.Tensor, state: torch.Tensor, vehicle: VehicleBatch) -> None:
        """Place environments ``idx`` in ``state`` with physical parameters ``vehicle`` (full batch)."""
        ids = torch.arange(self.num_envs)[torch.as_tensor(idx).cpu()].tolist()
        s = state.detach().to("cpu", torch.float64).reshape(len(ids), -1).numpy()
        q_xyzw = s[:, QUAT][:, [1, 2, 3, 0]] / np.linalg.norm(s[:, QUAT], axis=-1, keepdims=True)
        omega_world = np.einsum("nij,nj->ni", rotmat_xyzw(q_xyzw), s[:, OMEGA])
        pos = s[:, POS] + self._origin[ids]
        for k, i in enumerate(ids):
            b = self._bodies[i]
            p.resetBasePositionAndOrientation(b, pos[k].tolist(), q_xyzw[k].tolist(), physicsClientId=self._client)
            p.resetBaseVelocity(b, s[k, VEL].tolist(), omega_world[k].tolist(), physicsClientId=self._client)
        self._rpm[ids] = s[:, RPM]
        self._set_vehicle(vehicle)
        # The state is reported as given; the next step, which brings the external wrench, staggers
        # the velocities (_stagger).
        self._acc[ids], self._alpha[ids] = 0.0, 0.0
        self._placed[ids] = True
        self._read()
        self.state = self._state()

    def _stagger(self, f_ext: np.ndarray, t_ext: np.ndarray) -> None:
        """Give the environments placed by ``set_state`` since the last step PyBullet's velocities of
        half a substep earlier, v - h/2 a (leapfrog), with the accelerations under the step's wrench."""
        ids = np.flatnonzero(self._placed)
        acc, alpha = self._accelerations(*self._wrench(f_ext, t_ext))
        vel = self._vel - self._half_substep * acc
        omega_world = self._omega_world - self._half_substep * np.einsum("nij,nj->ni", self._rot, alpha)
        for i in ids.tolist():
            p.resetBaseVelocity(self._bodies[i], vel[i].tolist(), omega_world[i].tolist(), physicsClientId=self._client)
        self._f_prev[ids], self._t_prev[ids] = f_ext[ids], t_ext[ids]  # no change to average over
        self._placed[:] = False
        self._read()

    def _ground_effect_gain(self, hub_z: np.ndarray) -> np.ndarray:
        """Extra thrust per unit rotor thrust, [N, 4], from rotor heights above z = 0 (m).

        Shi et al. 2019 as in gym-pybullet-drones: C (R / 4z)^2, heights clipped from below,
        and only while the drone is upright (body z pointing up).
        """
        z = np.maximum(hub_z, self._ground_effect_h_clip)
        gain = self.params.ground_effect_coeff * (self.params.prop_radius / (4.0 * z)) ** 2
        return gain * (self._rot[:, 2, 2] > 0.0)[:, None]

    def _drag_force(self) -> np.ndarray:
        """Rotor drag, world frame, N: -diag(c_xy, c_xy, c_z) v_body times the summed rotor speeds (rad/s)."""
        v_body = np.einsum("nji,nj->ni", self._rot, self._vel)
        f_body = -self._drag_coeff * (self._rpm.sum(-1, keepdims=True) * RPM_TO_RAD_S) * v_body
        return np.einsum("nij,nj->ni", self._rot, f_body)

    def _downwash_force(self) -> np.ndarray:
        """Downward push on each drone, world frame, N, from every drone above it (gym-pybullet-drones model)."""
        c1, c2, c3 = self.params.downwash_coeffs
        dz = self._pos[None, :, 2] - self._pos[:, None, 2]  # [i, j]: height of drone j above drone i
        dxy = np.linalg.norm(self._pos[None, :, :2] - self._pos[:, None, :2], axis=-1)
        above = (dz > 0.0) & (dxy < DOWNWASH_RANGE)
        dz = np.where(above, dz, 1.0)  # placeholder height where no drone is above, masked out below
        alpha = c1 * (self.params.prop_radius / (4.0 * dz)) ** 2
        beta = c2 * dz + c3
        push = np.where(above, alpha * np.exp(-0.5 * (dxy / beta) ** 2), 0.0).sum(-1)
        force = np.zeros((self.num_envs, 3))
        force[:, 2] = -push
        return force

    def _wrench(self, f_ext: np.ndarray, t_ext: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Force (N) and torque (N m) on every body at the last read state, both world frame: the
        rotor thrusts along body z, their moments about the hubs' lever arms, the yaw reaction, the
        enabled aerodynamic effects, and the external force (world) and torque (body)."""
        thrusts = rotor_thrusts(self._rpm, self._kf, self._thrust_scale)
        # Roll and pitch: moments of the hub forces (ground effect included); yaw: the rotors' reaction.
        tx, ty, yaw_sum = body_torque_terms(thrusts.T, self.params)
        lift = thrusts
        if self.ground_effect:
            # rotor heights above z = 0, [N, 4] m
            hub_z = self._pos[:, None, 2] + np.einsum("nj,kj->nk", self._rot[:, 2, :], self._hubs)
            lift = thrusts * (1.0 + self._ground_effect_gain(hub_z))
            tx, ty, _ = body_torque_terms(lift.T, self.params)
        torque_b = t_ext + np.stack((tx, ty, self._km * yaw_sum), axis=-1)
        torque = np.einsum("nij,nj->ni", self._rot, torque_b)
        force = f_ext + self._rot[:, :, 2] * lift.sum(-1, keepdims=True)  # thrust along body z, world
        if self.drag:
            force = force + self._drag_force()
        if self.downwash:
            force = force + self._downwash_force()
        return force, torque

    def _accelerations(self, force: np.ndarray, torque: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Linear acceleration (world, m/s^2) and angular acceleration (body, rad/s^2) under the
        world-frame ``force`` and ``torque``, from Newton's and Euler's equations (diagonal inertia)."""
        acc = force / self._mass[:, None]
        acc[:, 2] -= GRAVITY
        omega = self._omega_body
        torque_b = np.einsum("nji,nj->ni", self._rot, torque)
        return acc, (torque_b - cross_rows(omega, self._inertia * omega)) / self._inertia

    def step(self, rpm_cmd: torch.Tensor, force_world: torch.Tensor, torque_body: torch.Tensor) -> torch.Tensor:
        """Advance every environment by dt seconds; returns the new [N, 17] state.

        ``rpm_cmd`` [N, 4] rotor speed setpoints, ``force_world`` [N, 3] N (world),
        ``torque_body`` [N, 3] N m (body), all held over the step.
        """
        cmd, f_ext, t_ext = (x.detach().to("cpu", torch.float64).numpy() for x in (rpm_cmd, force_world, torque_body))
        c, world = self._client, p.WORLD_FRAME
        if self._placed.any():
            self._stagger(f_ext, t_ext)
        for k in range(self.substeps):
            # Semi-implicit Euler: every force is evaluated at the start of the substep.
            if k == 0:
                force, torque = self._wrench(0.5 * (self._f_prev + f_ext), 0.5 * (self._t_prev + t_ext))
            else:
                force, torque = self._wrench(f_ext, t_ext)
            for b, f, pos, tq in zip(self._bodies, force.tolist(), self._com_world, torque.tolist()):
                p.applyExternalForce(b, -1, f, pos, world, c)  # at the centre of mass; c: client (see _read)
                # WORLD_FRAME: PyBullet applies a LINK_FRAME torque on a base link in the wrong frame.
                p.applyExternalTorque(b, -1, tq, world, c)
            p.stepSimulation(physicsClientId=c)
            self._rpm += (cmd - self._rpm) * self._lag
            # The forces of a substep need the attitude and position; velocities only rotor drag.
            self._read(velocities=self.drag or k == self.substeps - 1)
        self._acc, self._alpha = self._accelerations(*self._wrench(f_ext, t_ext))
        self._f_prev, self._t_prev = f_ext, t_ext
        self.state = self._state()
        return self.state

    def close(self) -> None:
        """Disconnect the PyBullet world."""
        p.disconnect(physicsClientId=self._client)
