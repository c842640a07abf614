"""MJCF of the arm scene, generated from :mod:`sim.arm.params` (no mesh files, no constant typed twice).

Scene: a Franka Panda built from capsules and cylinders (visual only: the links do not collide,
which keeps collision detection cheap; the policy works above the table, where only the hand
can touch anything), a Franka Hand whose housing and two finger pads do collide, a table (its
top is z = 0), a free-floating cube, a mocap ``goal`` body (a visual marker site, no collision;
in arm_pick_place also the raised pad the cube has to be placed on) and a fixed ``front``
camera. The TCP site ``ee`` is in site group 3, hidden in images.

Actuation: seven joint position servos (PD, gains and torque limits in PandaParams) and one
position servo on the ``grip`` tendon, the mean of the two finger openings (0 closed .. 0.04 m
open), with the two finger joints held equal by an equality constraint and their speed limited
by passive damping (GripperParams). Gravity on the arm and hand is compensated (body
``gravcomp``), as the Franka controller does; the cube's is not.
"""

from __future__ import annotations

import math

import numpy as np

from .params import ArmParams

# Names shared with base.py / control.py.
ARM_JOINTS = tuple(f"joint{i}" for i in range(1, 8))
FINGER_JOINTS = ("finger_left", "finger_right")
EE_SITE = "ee"
CUBE = "cube"
GOAL = "goal"  # mocap body
PAD = "pad"
CAMERA = "front"
GRIP_ACTUATOR = "grip"
FINGER_GEOMS = ("finger_left", "finger_right")

# Collision classes: contype = conaffinity = 1 for geoms that touch, 0 for visual geoms.
VISUAL = 'contype="0" conaffinity="0" group="1"'
SOLID = 'contype="1" conaffinity="1"'


def _f(values) -> str:
    return " ".join(f"{float(v):.9g}" for v in np.atleast_1d(values))


def rpy_to_quat(roll: float, pitch: float, yaw: float) -> np.ndarray:
    """URDF fixed-axis roll-pitch-yaw (R = Rz(yaw) Ry(pitch) Rx(roll)) as a quaternion (w, x, y, z)."""
    cr, sr = math.cos(roll / 2), math.sin(roll / 2)
    cp, sp = math.cos(pitch / 2), math.sin(pitch / 2)
    cy, sy = math.cos(yaw / 2), math.sin(yaw / 2)
    return np.array((cr * cp * cy + sr * sp * sy, sr * cp * cy - cr * sp * sy,
                     cr * sp * cy + sr * cp * sy, cr * cp * sy - sr * sp * cy))


def look_at_xyaxes(pos, lookat) -> np.ndarray:
    """MuJoCo camera axes (x right, y up, in world) for a camera at ``pos`` looking at ``lookat``
    (MuJoCo cameras look along their -z axis)."""
    forward = np.asarray(lookat, float) - np.asarray(pos, float)
    forward /= np.linalg.norm(forward)
    right = np.cross(forward, (0.0, 0.0, 1.0))
    right /= np.linalg.norm(right)
    return np.concatenate((right, np.cross(right, forward)))


def _cylinder_inertia(mass: float, radius: float, a: np.ndarray, b: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Centre of mass and full inertia (ixx iyy izz ixy ixz iyz) of a solid cylinder from a to b
    (a sphere of the same radius when a == b)."""
    axis = b - a
    length = float(np.linalg.norm(axis))
    if length < 1e-6:
        i = 0.4 * mass * radius**2
        return a, np.array((i, i, i, 0.0, 0.0, 0.0))
    u = axis / length
    i_axial = 0.5 * mass * radius**2
    i_perp = mass * (3 * radius**2 + length**2) / 12
    t = i_perp * (np.eye(3) - np.outer(u, u)) + i_axial * np.outer(u, u)
    return (a + b) / 2, np.array((t[0, 0], t[1, 1], t[2, 2], t[0, 1], t[0, 2], t[1, 2]))


def _link_geoms(radius: float, child: np.ndarray, rgba: str) -> list[str]:
    """A joint housing (cylinder along the joint axis z) and a capsule to the next joint."""
    geoms = [f'<geom type="cylinder" size="{_f((radius, radius))}" rgba="{rgba}" {VISUAL}/>']
    if np.linalg.norm(child) > 1e-6:
        geoms.append(f'<geom type="capsule" fromto="0 0 0 {_f(child)}" size="{radius * 0.9:.9g}" rgba="{rgba}"'
                     f' {VISUAL}/>')
    return geoms


def build_mjcf(params: ArmParams, cube: bool = True, pad: bool = False) -> str:
    """The scene as an MJCF string. ``cube``: include the free cube (arm_reach has none);
    ``pad``: give the goal body the raised placing pad (arm_pick_place)."""
    p, g, tb, c, cam, sim = params.panda, params.gripper, params.table, params.cube, params.camera, params.sim

    # --- arm: link 0 welded to the world, links 1..7 each behind a hinge about its local z.
    chain_end = np.array((0.0, 0.0, p.flange_z))
    children = [np.array(x) for x in p.joint_pos[1:]] + [chain_end]
    light, dark = "0.92 0.92 0.92 1", "0.25 0.25 0.28 1"
    base = "\n".join(_link_geoms(p.link_radius[0], np.array(p.joint_pos[0]) - (0, 0, p.link_radius[1]), light))
    body = ""
    for i in reversed(range(7)):  # build inside-out: link 7 holds the hand
        com, inertia = _cylinder_inertia(p.link_mass[i], p.link_radius[i + 1], np.zeros(3), children[i])
        quat = rpy_to_quat(*p.joint_rpy[i])
        geoms = "\n".join(_link_geoms(p.link_radius[i + 1], children[i], dark if i in (4, 6) else light))
        inner = body if body else _hand(params)
        body = f"""
<body name="link{i + 1}" pos="{_f(p.joint_pos[i])}" quat="{_f(quat)}" gravcomp="1">
  <inertial pos="{_f(com)}" mass="{p.link_mass[i]:.9g}" fullinertia="{_f(inertia)}"/>
  <joint name="{ARM_JOINTS[i]}" axis="0 0 1" range="{_f((p.q_min[i], p.q_max[i]))}"
         armature="{p.armature:.9g}" damping="{p.joint_damping:.9g}"/>
  {geoms}
  {inner}
</body>"""

    xyaxes = look_at_xyaxes(cam.pos, cam.lookat)
    objects = ""
    if cube:
        objects += f"""
<body name="{CUBE}" pos="{_f((*c.start_xy, c.half))}">
  <freejoint name="{CUBE}"/>
  <geom name="{CUBE}" type="box" size="{_f((c.half,) * 3)}" mass="{c.mass:.9g}" friction="{_f(c.friction)}"
        condim="4" priority="1" solref="{_f(c.solref)}" rgba="0.85 0.2 0.15 1" {SOLID}/>
</body>"""
    pad_geom = ""
    if pad:  # under the goal point (the cube centre when placed): its top is the cube's bottom face
        pz = -(c.half + params.pad.height / 2)
        size = _f((params.pad.half, params.pad.half, params.pad.height / 2))
        pad_geom = f'<geom name="{PAD}" type="box" pos="0 0 {pz:.9g}" size="{size}" rgba="0.3 0.5 0.9 1" {SOLID}/>'

    fb_w, fb_h = cam.framebuffer
    return f"""
<mujoco model="panda_table">
  <compiler angle="radian" autolimits="true"/>
  <option timestep="{sim.timestep:.9g}" integrator="implicitfast" gravity="0 0 {-sim.gravity:.9g}"
          cone="{sim.cone}" impratio="{sim.impratio:.9g}"/>
  <!-- extent 1: MuJoCo scales the clip planes by it, so znear / zfar below are in metres -->
  <statistic extent="1" center="{_f((tb.centre_xy[0], 0.0, 0.3))}"/>
  <visual>
    <global offwidth="{fb_w}" offheight="{fb_h}"/>
    <quality shadowsize="0"/>
    <map znear="{cam.near:.9g}" zfar="{cam.far:.9g}"/>
  </visual>
  <worldbody>
    <light pos="0.4 -0.3 1.5" dir="0 0.2 -1" directional="true" castshadow="false"/>
    <geom name="floor" type="plane" pos="0 0 {-tb.height:.9g}" size="2 2 0.1" rgba="0.55 0.55 0.5 1" {VISUAL}/>
    <geom name="table" type="box" pos="{_f((*tb.centre_xy, -tb.thickness / 2))}"
          size="{_f((*tb.half_xy, tb.thickness / 2))}" friction="{tb.friction:.9g} 0.005 0.0001"
          rgba="0.72 0.6 0.45 1" {SOLID}/>
    <camera name="{CAMERA}" pos="{_f(cam.pos)}" xyaxes="{_f(xyaxes)}" fovy="{cam.fovy:.9g}"/>
    <body name="link0">
      {base}
      {body}
    </body>
    {objects}
    <body name="{GOAL}" mocap="true" pos="{_f((*c.start_xy, c.half))}">
      <site name="{GOAL}" type="sphere" size="0.012" rgba="0.1 0.8 0.2 0.8"/>
      {pad_geom}
    </body>
  </worldbody>
  <tendon>
    <fixed name="{GRIP_ACTUATOR}">
      <joint joint="{FINGER_JOINTS[0]}" coef="0.5"/>
      <joint joint="{FINGER_JOINTS[1]}" coef="0.5"/>
    </fixed>
  </tendon>
  <equality>
    <joint joint1="{FINGER_JOINTS[0]}" joint2="{FINGER_JOINTS[1]}" polycoef="0 1 0 0 0"/>
  </equality>
  <contact>
    <exclude body1="{FINGER_JOINTS[0]}" body2="{FINGER_JOINTS[1]}"/>
  </contact>
  <actuator>
    {_arm_actuators(params)}
    <position name="{GRIP_ACTUATOR}" tendon="{GRIP_ACTUATOR}" kp="{g.kp:.9g}"
              ctrlrange="0 {g.stroke:.9g}" forcerange="{_f((-2 * g.force, 2 * g.force))}"/>
  </actuator>
</mujoco>
"""


def _arm_actuators(params: ArmParams) -> str:
    p = params.panda
    return "\n    ".join(
        f'<position name="a{i + 1}" joint="{ARM_JOINTS[i]}" kp="{p.kp[i]:.9g}" kv="{p.kv[i]:.9g}"'
        f' ctrlrange="{_f((p.q_min[i], p.q_max[i]))}" forcerange="{_f((-p.torque_max[i], p.torque_max[i]))}"/>'
        for i in range(7)
    )


def _hand(params: ArmParams) -> str:
    """The Franka Hand on the flange: housing, TCP site ``ee``, two coupled fingers. The tendon
    force is shared by the two finger joints (coef 0.5 each), so each finger squeezes with up to
    ``force`` N when the tendon force saturates at 2 x ``force``."""
    p, g = params.panda, params.gripper
    _, fy, fz = g.finger_half  # the pad's inner face is the finger joint's origin plane
    fingers = ""
    for name, sign in zip(FINGER_JOINTS, (1.0, -1.0)):
        fingers += f"""
  <body name="{name}" pos="0 0 {g.finger_base_z:.9g}" gravcomp="1">
    <joint name="{name}" type="slide" axis="0 {sign:g} 0" range="0 {g.stroke:.9g}" damping="{g.finger_damping:.9g}"
           armature="0.01"/>
    <geom name="{name}" type="box" pos="0 {sign * fy:.9g} {fz:.9g}" size="{_f(g.finger_half)}"
          mass="{g.finger_mass:.9g}"
          friction="{g.friction:.9g} 0.005 0.0001" condim="4" rgba="0.15 0.15 0.15 1" {SOLID}/>
  </body>"""
    return f"""
<body name="hand" pos="0 0 {p.flange_z:.9g}" quat="{_f(rpy_to_quat(0, 0, g.hand_yaw))}" gravcomp="1">
  <geom name="hand" type="box" pos="0 0 {g.hand_half[2]:.9g}" size="{_f(g.hand_half)}" mass="{g.hand_mass:.9g}"
        rgba="0.92 0.92 0.92 1" {SOLID}/>
  <site name="{EE_SITE}" pos="0 0 {g.tcp_z:.9g}" size="0.008" rgba="1 1 0 0.5" group="3"/>
  {fingers}
</body>"""
