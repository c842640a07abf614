"""Physical parameters of the arm scene (Franka Panda arm and hand, table, cube, camera): the one
source of truth that the MJCF (model.py), the controller (control.py) and the tasks read.

Units are SI (m, kg, s, rad, N). World frame z-up: the origin is the robot's mounting point on
the table top, x points from the robot over the table, z up; the table top is the plane z = 0.
Quaternions are (w, x, y, z).

Kinematics: Franka Emika, "Robot and interface specifications" (FCI documentation), and the
same numbers in the franka_description URDF (panda_arm.xacro / hand.xacro): joint origins,
joint limits, velocity and torque limits, flange and hand offsets. Everything else (masses,
inertias, link radii, gains) is an approximation, marked as such where it is defined.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

Vec3 = tuple[float, float, float]
Vec7 = tuple[float, float, float, float, float, float, float]


@dataclass(frozen=True)
class PandaParams:
    """7-DoF Franka Panda arm. Joint i rotates about the z axis of its own frame; its frame sits at
    ``joint_pos[i]`` in the parent link frame, rotated by ``joint_rpy[i]`` (URDF convention: fixed-axis
    roll, pitch, yaw). Link 0 (the base) is fixed at the world origin."""

    # Joint origins in the parent frame, m (franka_description panda_arm.xacro; equivalently the
    # modified-DH table of the FCI docs: d1 = 0.333, d3 = 0.316, a4 = 0.0825, a5 = -0.0825,
    # d5 = 0.384, a7 = 0.088, flange d = 0.107).
    joint_pos: tuple[Vec3, ...] = (
        (0.0, 0.0, 0.333),
        (0.0, 0.0, 0.0),
        (0.0, -0.316, 0.0),
        (0.0825, 0.0, 0.0),
        (-0.0825, 0.384, 0.0),
        (0.0, 0.0, 0.0),
        (0.088, 0.0, 0.0),
    )
    joint_rpy: tuple[Vec3, ...] = (
        (0.0, 0.0, 0.0),
        (-math.pi / 2, 0.0, 0.0),
        (math.pi / 2, 0.0, 0.0),
        (math.pi / 2, 0.0, 0.0),
        (-math.pi / 2, 0.0, 0.0),
        (math.pi / 2, 0.0, 0.0),
        (math.pi / 2, 0.0, 0.0),
    )
    flange_z: float = 0.107  # m, flange along link-7 z
    # Limits (FCI docs, "Limits for Panda"): position rad, velocity rad/s, torque N m.
    q_min: Vec7 = (-2.8973, -1.7628, -2.8973, -3.0718, -2.8973, -0.0175, -2.8973)
    q_max: Vec7 = (2.8973, 1.7628, 2.8973, -0.0698, 2.8973, 3.7525, 2.8973)
    qd_max: Vec7 = (2.1750, 2.1750, 2.1750, 2.1750, 2.6100, 2.6100, 2.6100)
    torque_max: Vec7 = (87.0, 87.0, 87.0, 87.0, 12.0, 12.0, 12.0)
    # rad/s^2, same source (libfranka's rate limiter uses them; MoveIt's panda_moveit_config
    # joint_limits.yaml lists a quarter of each)
    qdd_max: Vec7 = (15.0, 7.5, 10.0, 12.5, 15.0, 20.0, 20.0)
    # Home: gripper pointing down, fingers opening along world y, TCP at (0.45, 0, 0.25) m (solved
    # with control.DiffIK from Franka's "ready" pose (0, -pi/4, 0, -3pi/4, 0, pi/2, pi/4), whose TCP
    # is at (0.307, 0, 0.487) m; q2, q4, q6 changed, elbow still up).
    home: Vec7 = (0.0, -0.1848, 0.0, -2.4967, 0.0, 2.3119, 0.7854)
    # Link masses 1..7, kg: approximate, rounded from the identified values of C. Gaz et al.,
    # "Dynamic identification of the Franka Emika Panda robot", RA-L 2019. Inertias are not the
    # identified ones: each link is a solid cylinder of radius ``link_radius`` along its segment.
    link_mass: Vec7 = (4.97, 0.65, 3.23, 3.59, 1.23, 1.67, 0.74)
    # Visual capsule radii of links 0..7, m (approximate outer shape).
    link_radius: tuple[float, ...] = (0.07, 0.065, 0.065, 0.06, 0.06, 0.055, 0.05, 0.045)
    # Joint-space PD (MuJoCo position actuators, torque = kp (q_target - q) - kv qd, clipped to
    # torque_max). Chosen, not Franka's: about critically damped for the joint-space inertia at
    # home (~1.0-1.6 kg m^2 for joints 1-4, ~0.1 for 5-7 incl. armature); a 0.05 rad step in the
    # target is 80-100 % done after one 50 ms control period, without overshoot. Gravity is
    # compensated separately (as the Franka controller does), so kp only rejects payload and contacts.
    kp: Vec7 = (8000.0, 8000.0, 6000.0, 6000.0, 3000.0, 3000.0, 3000.0)  # N m/rad
    kv: Vec7 = (180.0, 220.0, 160.0, 160.0, 35.0, 35.0, 35.0)  # N m s/rad
    # Rotor (reflected) inertia per joint, kg m^2: approximate; also keeps the 2 ms step stable.
    armature: float = 0.1
    joint_damping: float = 1.0  # N m s/rad, passive


@dataclass(frozen=True)
class GripperParams:
    """Franka Hand: two fingers sliding along the hand's y axis, coupled to move symmetrically.
    Hand frame: z along the approach direction (pointing out of the flange), fingers open along y."""

    hand_yaw: float = -math.pi / 4  # rad, hand about the flange z axis (URDF panda_hand_joint)
    hand_mass: float = 0.73  # kg (Franka Hand datasheet ~0.7 kg incl. fingers; approximate)
    finger_mass: float = 0.015  # kg each (approximate)
    finger_base_z: float = 0.0584  # m, finger joints along hand z (URDF panda_finger_joint)
    tcp_z: float = 0.1034  # m, tool centre point (between the fingertips) along hand z (Franka docs)
    stroke: float = 0.04  # m per finger: the opening (distance between fingers) is 0 .. 0.08 m
    force: float = 70.0  # N, continuous grasp force (Franka Hand datasheet; 140 N peak)
    speed: float = 0.05  # m/s per finger, about the Franka Hand's maximum (approximate)
    # Finger position servo on the mean finger opening (tendon): force = kp (target - opening / 2),
    # clipped to 2 x ``force`` (each finger gets half). Stiff, so it saturates 7 mm from the
    # target: the fingers close at full force onto anything in between. The finger speed is
    # limited by a passive damping of force / speed per finger joint (70 N at 0.05 m/s), which
    # MuJoCo integrates implicitly (no damping term in the servo).
    kp: float = 20000.0  # N/m
    # Finger pad box half extents in the finger frame (x across, y thickness, z length), m.
    finger_half: Vec3 = (0.01, 0.008, 0.027)
    hand_half: Vec3 = (0.025, 0.1, 0.028)  # m, hand housing box
    friction: float = 1.0  # finger pads (the cube's own friction decides its contacts, see CubeParams)

    @property
    def finger_damping(self) -> float:
        """N s/m per finger joint: at full force a finger moves at ``speed``."""
        return self.force / self.speed


@dataclass(frozen=True)
class TableParams:
    """Table in front of the robot; its top is the plane z = 0 (world)."""

    centre_xy: tuple[float, float] = (0.4, 0.0)  # m
    half_xy: tuple[float, float] = (0.55, 0.5)  # m
    thickness: float = 0.04  # m
    height: float = 0.75  # m above the floor (the floor is visual only, at z = -height)
    friction: float = 0.5  # sliding


@dataclass(frozen=True)
class CubeParams:
    """The object: a cube, resting on the table at ``start_xy`` (nominal, before randomization)."""

    half: float = 0.025  # m (5 cm cube; fits the 8 cm gripper opening at any yaw)
    mass: float = 0.1  # kg
    # Sliding, torsional, rolling. The cube has a higher contact priority than the table and the
    # fingers, so these (times the randomized friction scale) govern all of its contacts.
    friction: Vec3 = (0.8, 0.005, 0.0001)
    # Contact stiffness (MuJoCo solref: time constant s, damping ratio) of all cube contacts:
    # 2 physics steps, the stiffest MuJoCo integrates reliably. The default (0.02 s) lets the
    # fingers squeeze 8 mm into the cube at the 70 N grasp force; this leaves < 1 mm.
    solref: tuple[float, float] = (0.004, 1.0)
    start_xy: tuple[float, float] = (0.5, 0.0)  # m, world


@dataclass(frozen=True)
class PadParams:
    """arm_pick_place goal: a low square pad on the table, the goal is the cube resting on it.
    Its height stops a cube from being pushed onto it (the cube has to be lifted)."""

    half: float = 0.05  # m, half side of the square
    height: float = 0.025  # m, top above the table (half the cube's size)


@dataclass(frozen=True)
class CameraParams:
    """Fixed camera looking at the table from the front. Pose: position and the point it looks at
    (world, m); the image is square, ``fovy`` is MuJoCo's vertical field of view."""

    pos: Vec3 = (1.1, 0.0, 0.6)
    lookat: Vec3 = (0.5, 0.0, 0.0)
    fovy: float = 45.0  # deg
    image_size_range: tuple[int, int] = (64, 96)  # px, allowed (the task picks one: ArmTaskConfig.image_size)
    near: float = 0.05  # m, clip planes (MuJoCo's are fractions of the model extent; set explicitly)
    far: float = 5.0  # m
    framebuffer: tuple[int, int] = (640, 480)  # px, offscreen buffer (also for videos)


@dataclass(frozen=True)
class SimParams:
    """Integration: a 2 ms physics step, 25 steps per 50 ms control period (20 Hz policy)."""

    timestep: float = 0.002  # s
    control_period: float = 0.05  # s (20 Hz)
    gravity: float = 9.81  # m/s^2
    # Elliptic friction cones with a high impedance ratio: frictional contacts (the grasp) hold
    # without the slow creep of MuJoCo's default pyramidal cones.
    cone: str = "elliptic"
    impratio: float = 10.0

    @property
    def substeps(self) -> int:
        return round(self.control_period / self.timestep)


@dataclass(frozen=True)
class ArmParams:
    panda: PandaParams = field(default_factory=PandaParams)
    gripper: GripperParams = field(default_factory=GripperParams)
    table: TableParams = field(default_factory=TableParams)
    cube: CubeParams = field(default_factory=CubeParams)
    pad: PadParams = field(default_factory=PadParams)
    camera: CameraParams = field(default_factory=CameraParams)
    sim: SimParams = field(default_factory=SimParams)


NOMINAL = ArmParams()
