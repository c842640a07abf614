"""MuJoCo backend: same interface as :class:`~sim.crazyflie.dynamics.TorchBackend`, plus videos.

All environments live in one MjModel as free-floating bodies that never touch each other
(every geom has contype = conaffinity = 0; contacts and constraints are disabled, which makes
a step of 100 vehicles 12 % faster), so one ``mj_step`` advances them all. The model is
generated from :class:`CrazyflieParams`; per-environment mass and inertia from the
:class:`VehicleBatch` are written into ``model.body_mass`` / ``model.body_inertia``.

Rotor forces enter through ``data.xfrc_applied`` (world frame, at the body's centre of mass)
and are held constant over each MuJoCo substep. They are evaluated at the substep midpoint
(rotor speeds exactly, attitude predicted from the current body rate), which keeps the
scheme second order: a float64 RK4 reference agrees to a few micrometres after 1 s of flight.
"""

from __future__ import annotations

import os

import numpy as np
import torch

# MuJoCo picks its OpenGL backend when it is imported: EGL renders headless (no display).
os.environ.setdefault("MUJOCO_GL", "egl")
import mujoco  # noqa: E402

from .dynamics import OMEGA, POS, QUAT, RPM, VEL, VehicleBatch  # noqa: E402
from .forces import body_torque_terms, cross_rows, rotor_thrusts  # noqa: E402
from .params import GRAVITY, CrazyflieParams  # noqa: E402

# Chase camera offset from the drone, world frame, m (behind-right, above; looks at the drone).
CAMERA_OFFSET = (-0.35, -0.25, 0.2)


def _fmt(values) -> str:
    return " ".join(f"{v:.9g}" for v in values)


def _camera_xyaxes(offset) -> tuple[float, ...]:
    """MJCF ``xyaxes`` (camera right and up, world frame) for a camera at ``offset`` looking at the origin."""
    forward = -np.asarray(offset, dtype=float)
    forward /= np.linalg.norm(forward)
    right = np.cross(forward, (0.0, 0.0, 1.0))
    right /= np.linalg.norm(right)
    return tuple(right) + tuple(np.cross(right, forward))


def build_mjcf(params: CrazyflieParams, num_vehicles: int, dt: float) -> str:
    """MJCF with ``num_vehicles`` Crazyflies (bodies ``cf0``..), a visual floor and a mocap ``target``.

    ``dt`` is the MuJoCo timestep (s). Mass and inertia are the nominal values of ``params``;
    the backend overwrites them per environment. Visual sizes derive from the rotor layout.
    """
    arm_x = max(abs(x) for x, _ in params.rotor_xy)
    arm_y = max(abs(y) for _, y in params.rotor_xy)
    pcb_half_z = params.frame_half_extents[2] / 5
    arm_radius = params.prop_radius / 8
    disc_half_height = params.prop_radius / 20
    rotor_z = 2 * pcb_half_z + disc_half_height
    front_rgba, back_rgba = "0.85 0.15 0.1 0.9", "0.25 0.25 0.25 0.9"

    indent = "\n      "
    vehicles = []
    for i in range(num_vehicles):
        geoms = [f'<geom type="box" size="{_fmt((arm_x / 2, arm_y / 2, pcb_half_z))}" rgba="0.1 0.3 0.6 1"/>']
        for x, y in params.rotor_xy:
            geoms.append(f'<geom type="capsule" fromto="0 0 0 {_fmt((x, y, 0))}" size="{arm_radius:.9g}" rgba="0.2 0.2 0.2 1"/>')
            rgba = front_rgba if x > 0 else back_rgba
            geoms.append(
                f'<geom type="cylinder" pos="{_fmt((x, y, rotor_z))}" size="{_fmt((params.prop_radius, disc_half_height))}"'
                f' rgba="{rgba}"/>'
            )
        vehicles.append(
            f"""
    <body name="cf{i}">
      <freejoint/>
      <inertial pos="0 0 0" mass="{params.mass:.9g}" diaginertia="{_fmt(params.inertia)}"/>
      <camera name="track{i}" mode="trackcom" pos="{_fmt(CAMERA_OFFSET)}" xyaxes="{_fmt(_camera_xyaxes(CAMERA_OFFSET))}"/>
      {indent.join(geoms)}
    </body>"""
        )

    return f"""<mujoco model="crazyflie">
  <option timestep="{dt:.9g}" integrator="RK4" gravity="0 0 {-GRAVITY:.9g}">
    <flag contact="disable" constraint="disable"/>
  </option>
  <visual>
    <quality shadowsize="0"/>
    <map znear="0.01"/>
  </visual>
  <statistic extent="1" center="0 0 1"/>
  <default>
    <geom contype="0" conaffinity="0"/>
  </default>
  <asset>
    <texture name="sky" type="skybox" builtin="gradient" rgb1="0.6 0.75 0.9" rgb2="0.15 0.2 0.3" width="256" height="256"/>
    <texture name="grid" type="2d" builtin="checker" rgb1="0.3 0.32 0.35" rgb2="0.22 0.24 0.26" width="512" height="512"/>
    <material name="grid" texture="grid" texrepeat="1 1" texuniform="true"/>
  </asset>
  <worldbody>
    <light directional="true" pos="0 0 5" dir="0 0 -1" diffuse="0.8 0.8 0.8"/>
    <geom name="floor" type="plane" size="50 50 0.1" material="grid"/>{"".join(vehicles)}
    <body name="target" mocap="true">
      <geom type="sphere" size="{params.prop_radius:.9g}" rgba="0.1 0.9 0.2 0.6"/>
    </body>
  </worldbody>
</mujoco>
"""


class MujocoBackend:
    """All environments stepped by one MuJoCo model (RK4, timestep dt / substeps)."""

    name = "mujoco"

    def __init__(self, num_envs: int, params: CrazyflieParams, dt: float, substeps: int = 10, device="cpu"):
        self.num_envs, self.params, self.device = num_envs, params, torch.device(device)
        self.dt, self.substeps = dt, substeps
        self.model = mujoco.MjModel.from_xml_string(build_mjcf(params, num_envs, dt / substeps))
        self.data = mujoco.MjData(self.model)
        self._bodies = np.array([mujoco.mj_name2id(self.model, mujoco.mjtObj.mjOBJ_BODY, f"cf{i}") for i in range(num_envs)])
        self._target = mujoco.mj_name2id(self.model, mujoco.mjtObj.mjOBJ_BODY, "target")
        # Views into MuJoCo's arrays. Free joint: qpos = pos (world) | quat (w x y z, body->world),
        # qvel = linear velocity (world) | angular velocity (BODY frame, checked by experiment).
        self._qpos = self.data.qpos.reshape(num_envs, 7)
        self._qvel = self.data.qvel.reshape(num_envs, 6)
        self._rpm = np.zeros((num_envs, 4))
        self._renderer: mujoco.Renderer | None = None
        self._set_vehicle(VehicleBatch.nominal(num_envs, params, self.device))
        self.state = self._read_state()

    def _set_vehicle(self, vehicle: VehicleBatch) -> None:
        self.vehicle = vehicle
        v = {k: t.detach().to("cpu", torch.float64).numpy() for k, t in vehicle.items()}
        self.model.body_mass[self._bodies] = v["mass"]
        self.model.body_inertia[self._bodies] = v["inertia"]
        # MuJoCo caches mass-derived constants (e.g. dof_M0, the mass matrix of these "simple"
        # bodies, and subtree masses): recompute them. mj_setConst resets qpos, so keep the state.
        saved = [a.copy() for a in (self.data.qpos, self.data.qvel, self.data.mocap_pos)]
        mujoco.mj_setConst(self.model, self.data)
        for dst, src in zip((self.data.qpos, self.data.qvel, self.data.mocap_pos), saved):
            dst[:] = src
        self._kf, self._thrust_scale = v["kf"][:, None], v["thrust_scale"][:, None]
        self._km = v["km"]
        # Rotor lag rpm += (cmd - rpm) * (1 - exp(-t / tau)) is the exact solution of the torch
        # backend's drpm/dt = (cmd - rpm) / tau with cmd held over the step.
        h = self.model.opt.timestep
        self._lag_half = 1.0 - np.exp(-0.5 * h / v["motor_tau"])[:, None]
        self._lag = 1.0 - np.exp(-h / v["motor_tau"])[:, None]

    def _read_state(self) -> torch.Tensor:
        state = np.concatenate((self._qpos, self._qvel, self._rpm), axis=1)
        return torch.as_tensor(state, dtype=torch.float32, device=self.device)

    def set_state(self, idx: torch.Tensor, state: torch.Tensor, vehicle: VehicleBatch) -> None:
        """Place environments ``idx`` in ``state`` with physical parameters ``vehicle`` (full batch)."""
        ids = torch.arange(self.num_envs)[torch.as_tensor(idx).cpu()].numpy()
        s = state.detach().to("cpu", torch.float64).reshape(len(ids), -1).numpy()
        q = s[:, QUAT]
        self._qpos[ids, :3] = s[:, POS]
        self._qpos[ids, 3:] = q / np.linalg.norm(q, axis=-1, keepdims=True)
        self._qvel[ids, :3] = s[:, VEL]
        self._qvel[ids, 3:] = s[:, OMEGA]
        self._rpm[ids] = s[:, RPM]
        self._set_vehicle(vehicle)
        self.state = self._read_state()

    def step(self, rpm_cmd: torch.Tensor, force_world: torch.Tensor, torque_body: torch.Tensor) -> torch.Tensor:
        """Advance every environment by dt seconds; returns the new [N, 17] state.

        ``rpm_cmd`` [N, 4] rotor speed setpoints, ``force_world`` [N, 3] N (world),
        ``torque_body`` [N, 3] N m (body), all held over the step.
        """
        cmd, f_ext, t_ext = (x.detach().to("cpu", torch.float64).numpy() for x in (rpm_cmd, force_world, torque_body))
        # One MjData holds every vehicle, and a non-finite force makes MuJoCo reset all of it: a
        # vehicle with a non-finite input is stepped without it and reported non-finite, as the other
        # backends report it, so that the environment resets that one alone.
        bad = ~(np.isfinite(cmd).all(1) & np.isfinite(f_ext).all(1) & np.isfinite(t_ext).all(1))
        if bad.any():
            cmd, f_ext, t_ext = (np.where(bad[:, None], 0.0, x) for x in (cmd, f_ext, t_ext))
        h = self.model.opt.timestep
        for _ in range(self.substeps):
            mujoco.mj_kinematics(self.model, self.data)  # xmat: body->world rotation of the current state
            rot = self.data.xmat[self._bodies].reshape(-1, 3, 3)
            thrusts = rotor_thrusts(self._rpm + (cmd - self._rpm) * self._lag_half, self._kf, self._thrust_scale)
            tx, ty, yaw_sum = body_torque_terms(thrusts.T, self.params)
            torque_b = np.stack((tx, ty, self._km * yaw_sum), axis=-1) + t_ext
            thrust_b = np.zeros_like(torque_b)
            thrust_b[:, 2] = thrusts.sum(-1)
            # Rotate with the attitude at the substep midpoint, R (I + h/2 [omega]x) to first order,
            # so that the body-fixed thrust and torque follow the body while MuJoCo holds them.
            half_turn = 0.5 * h * self._qvel[:, 3:]
            force = (rot @ (thrust_b + cross_rows(half_turn, thrust_b))[:, :, None])[:, :, 0] + f_ext
            torque = (rot @ (torque_b + cross_rows(half_turn, torque_b))[:, :, None])[:, :, 0]
            self.data.xfrc_applied[self._bodies] = np.concatenate((force, torque), axis=-1)
            mujoco.mj_step(self.model, self.data)
            self._rpm += (cmd - self._rpm) * self._lag
        self.state = self._read_state()
        if bad.any():
            self.state[torch.as_tensor(bad, device=self.device)] = float("nan")
        return self.state

    def render(self, env_ids, width: int = 320, height: int = 240, targets: np.ndarray | None = None) -> np.ndarray:
        """RGB frames, uint8 [len(env_ids), height, width, 3], each from its drone's chase camera.

        Other environments' drones are hidden. ``targets`` [len(env_ids), 3] (world, m) draws
        a green marker at each environment's target position.
        """
        r = self._renderer
        if r is None or (r.width, r.height) != (width, height):
            if r is not None:
                r.close()
            vis = self.model.vis.global_  # the offscreen framebuffer must hold the frame
            vis.offwidth, vis.offheight = max(vis.offwidth, width), max(vis.offheight, height)
            self._renderer = r = mujoco.Renderer(self.model, height, width)
        ids = torch.as_tensor(env_ids).cpu().reshape(-1).tolist()
        frames = np.empty((len(ids), height, width, 3), dtype=np.uint8)
        geom_body = self.model.geom_bodyid
        for k, i in enumerate(ids):
            if targets is not None:
                self.data.mocap_pos[self.model.body_mocapid[self._target]] = targets[k]
            # mj_step leaves positions and cameras at the start of the last step: recompute them.
            mujoco.mj_forward(self.model, self.data)
            r.update_scene(self.data, camera=f"track{i}")
            hidden = np.zeros(self.model.nbody, dtype=bool)
            hidden[self._bodies] = True
            hidden[self._bodies[i]] = False
            hidden[self._target] = targets is None
            for g in r.scene.geoms[: r.scene.ngeom]:
                if g.objtype == mujoco.mjtObj.mjOBJ_GEOM and hidden[geom_body[g.objid]]:
                    # Shrunk to nothing, not only transparent: the other environments' drones fly
                    # where this one does, and blending ~100 of them in front of the camera made a
                    # software-rendered frame ~17x slower.
                    g.rgba[3] = 0.0
                    g.size[:] = 0.0
            r.render(out=frames[k])
        return frames

    def close(self) -> None:
        """Free the offscreen renderer (OpenGL context)."""
        if self._renderer is not None:
            self._renderer.close()
            self._renderer = None
