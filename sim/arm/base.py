"""Shared machinery of the arm tasks (reach.py, push.py, pick_place.py): N MuJoCo simulations
stepped in a Python loop behind the batched Gymnasium vector-env interface the trainers use
(torch tensors in and out, same-step autoreset, seeding, observation noise, camera, exact
checkpointing). What a task is (goal, reward, success, randomization, expert) lives in its file.

One MjModel per environment: the randomized physical parameters (cube mass and inertia,
cube friction, camera pose) are written into that env's own model at the start of each episode,
followed by ``mj_setConst`` so the derived constants (e.g. the constraint scaling) match. No
model field is ever shared between environments, so nothing depends on call order.
The renderer is built on env 0's model: geometry is identical across envs, and the
(randomized) camera pose is read from each env's MjData.

Observation (float32), identical layout in every task so policies transfer:

    policy [29]:  0:7   joint positions (rad)          7:14  joint velocities (rad/s)
                  14:17 TCP (``ee`` site) position (world, m)
                  17    gripper opening, distance between the fingers (m, 0 .. 0.08)
                  18:21 cube position (world, m)       21:25 cube orientation (quat w, x, y, z; w >= 0)
                  25:28 goal position (world, m)
                  28    TCP yaw about world z (rad; 0: fingers opening along world y)
                  arm_reach has no cube: 18:25 are zeros.
                  Noise (NoiseConfig) on joint positions, joint velocities and the cube position.
    critic [44]:  0:29  the policy observation without noise
                  29:32 cube linear velocity (world, m/s)   32:35 cube angular velocity (cube frame, rad/s)
                  35    cube mass scale   36 friction scale (1 = nominal)
                  37:40 cube - TCP (m)    40:43 goal - cube (m)   (zeros without a cube)
                  43    time fraction t / episode_steps
                  with randomization.max_latency_steps = L > 0 only (critic [45 + 5 L]):
                  44    the episode's actuation latency / L
                  45:45+5L  the actions issued and not yet applied, newest first (5 per period;
                        zeros beyond the episode's latency)
    image (camera != "none"): "rgb" uint8 [3, H, W]; "depth" float32 [1, H, W] (m, z-depth);
                  "rgbd" float32 [4, H, W], RGB scaled to [0, 1] then depth in m. The depth is the
                  sensor's (``depth_image``: with NoiseConfig.depth's noise), as perception's is.

Action [5] in [-1, 1]: [dx, dy, dz] desired TCP displacement per control step, world frame,
times ``IKConfig.max_delta`` = 0.02 m (0.4 m/s at 20 Hz); dyaw, the desired turn of the gripper
about world z per control step, times ``IKConfig.max_dyaw`` = 0.1 rad, the yaw kept within
+-``IKConfig.yaw_limit`` = 90 deg (the IK closes ``rot_gain`` = 0.8 of the orientation error per
step, so a held full command turns ~0.08 rad per step, 1.6 rad/s); both turned into joint
targets by the differential IK of control.py, which keeps the gripper pointing down; gripper:
-1 = open (fingers 0.08 m apart), +1 = closed, linear in between (the fingers move at up to
0.05 m/s each).
``nominal_action`` 0.0 holds the TCP still with the gripper half open.
The end-effector pose is controlled and observed as position and yaw (top-down grasping): the
fingers can be turned square to a cube at any yaw. With the yaw fixed (contract v1, as in OpenAI's
Fetch tasks, Plappert et al. 2018) a cube at 30-45 deg was held across its vertical edges: a
diffusion base cloned from the pick-and-place expert succeeded in 51 % of such episodes against
80-83 % below 30 deg, most failures lifting the cube and never getting it over the goal
(BENCHMARKS.md, "Arm tasks: the gripper's yaw").
Control period 0.05 s (20 Hz), 25 physics steps of 2 ms each.

Episodes: reward_type "sparse" gives 1.0 at every step where the task's success holds, else 0.0
(with terminate_on_success, the default, the episode ends there, so exactly once); "time" gives
-1 / episode_steps at every step without success and charges a failure the steps it skips (the
return is minus the fraction of the time limit spent before success, in [-1, 0]); "dense" sums the task's named reward terms, shifted to costs when the
episode ends at success (see step()). terminated = success (if terminate_on_success) | failure
(the task's, e.g. the cube off the table) | a non-finite state; truncated = the time limit.
"""

from __future__ import annotations

import copy
import ctypes.util
import math
import os
from dataclasses import dataclass, field
from typing import Callable

import gymnasium as gym
import numpy as np
import torch

# MuJoCo picks its OpenGL backend when it is imported: EGL renders headless (no display), OSMesa
# (software) where there is no EGL library. Set MUJOCO_GL before importing mujoco to choose.
if "MUJOCO_GL" not in os.environ:
    os.environ["MUJOCO_GL"] = "egl" if ctypes.util.find_library("EGL") else "osmesa"
import mujoco  # noqa: E402

from . import model as mdl  # noqa: E402
from .control import DiffIK, IKConfig, hand_yaw  # noqa: E402
from .params import NOMINAL, ArmParams  # noqa: E402

POLICY_DIM = 29
CRITIC_DIM = 44  # without latency; 45 + 5 L with randomization.max_latency_steps = L > 0
ACT_DIM = 5
HOLD_ACTION = np.array([0.0, 0.0, 0.0, 0.0, -1.0])  # hold the TCP still, gripper open: the command before an episode
# Policy observation slices (see the module docstring).
JOINT_POS, JOINT_VEL, EE_POS, GRIPPER, CUBE_POS, CUBE_QUAT, GOAL_POS, EE_YAW = (
    slice(0, 7), slice(7, 14), slice(14, 17), slice(17, 18), slice(18, 21), slice(21, 25), slice(25, 28),
    slice(28, 29))
# Action components (see the module docstring).
MOVE, TURN, GRIP = slice(0, 3), 3, 4
STATE_SPEC = mujoco.mjtState.mjSTATE_INTEGRATION
_DIVERGENCE_WARNINGS = np.array([mujoco.mjtWarning.mjWARN_BADQPOS, mujoco.mjtWarning.mjWARN_BADQVEL,
                                 mujoco.mjtWarning.mjWARN_BADQACC, mujoco.mjtWarning.mjWARN_BADCTRL], dtype=int)


@dataclass
class RandomizationConfig:
    """Sampled once per episode. With ``enabled = False`` the cube starts at its nominal pose
    (CubeParams.start_xy, yaw 0) with nominal mass and friction, and the camera is at its nominal
    pose; goals are still drawn (they are the task, not a randomization)."""

    enabled: bool = True
    object_x: tuple[float, float] = (-0.1, 0.1)  # m, cube offset from CubeParams.start_xy
    object_y: tuple[float, float] = (-0.15, 0.15)  # m
    object_yaw: tuple[float, float] = (-math.pi / 4, math.pi / 4)  # rad (the cube has 90 deg symmetry)
    mass_scale: tuple[float, float] = (0.5, 2.0)  # x CubeParams.mass (inertia scales along)
    friction_scale: tuple[float, float] = (0.7, 1.3)  # x CubeParams.friction (all cube contacts)
    camera_pos: float = 0.02  # m, uniform +- per world axis
    camera_angle: float = 2.0  # deg, uniform +- about each camera axis
    # Actuation latency, whole control periods, uniform in 0..max_latency_steps per episode (with
    # ``enabled`` only; none without): the action applied at a step is the one issued that many
    # periods before (before the episode's first, "hold still, gripper open"). Off by default: a
    # Franka arm takes joint targets in its 1 kHz control loop (Franka Control Interface), ~1 ms
    # against the 50 ms period; a policy run off-board (camera, network, GPU) can lag a period or
    # more. With it on, the critic sees the episode's latency and the actions still in flight (see
    # the module docstring); the policy sees neither.
    max_latency_steps: int = 0


@dataclass
class NoiseConfig:
    """Gaussian noise (std) on the policy observation; the critic sees the clean values. The camera's
    errors (depth noise, extrinsics calibration error) reach the policy through the depth image and
    the perception's cube estimate (``obs_source=perception``)."""

    enabled: bool = True
    joint_pos: float = 0.001  # rad
    joint_vel: float = 0.01  # rad/s
    object_pos: float = 0.003  # m (cube position, as from a perception pipeline)
    # Depth noise, x the axial noise model of a structured-light depth camera (Nguyen, Izadi and
    # Lovell 2012, Kinect): std(z) = 1.2 mm + 1.9 mm/m^2 (z - 0.4 m)^2 per pixel, 1.6 mm at the
    # cube's ~0.85 m. 0 = an exact depth image.
    depth: float = 1.0
    # Error of the camera pose the perception believes (a calibrated eye-to-hand extrinsic), drawn
    # per episode: std per world axis (m) and about each camera axis (deg). Assumed, not measured:
    # the order of a careful checkerboard calibration. The randomized camera pose itself
    # (RandomizationConfig) is where the camera is; this is how well the robot knows it.
    camera_pos: float = 0.002  # m
    camera_angle: float = 0.2  # deg
    # The state observation's cube position as the calibrated camera places it: the true position
    # moved by this episode's calibration error (see seen_by_camera), before the per-step noise
    # above. The perception's estimate carries that same error for the whole episode: this judges
    # a policy against it without rendering (`policies.eval <run> task.noise.object_seen_by_camera=true`).
    # A pick_place base trained on it was no more robust (BENCHMARKS.md "Cube perception"). Off: the
    # true position plus the per-step noise.
    object_seen_by_camera: bool = False


@dataclass
class ArmTaskConfig:
    """Fields every arm task has (its own config extends this)."""

    name: str = "arm"
    episode_steps: int = 100  # control steps of 0.05 s
    # "sparse": 1.0 while success holds (once, with terminate_on_success); "time": -1 / episode_steps
    # for every step without success (minimum time); "dense": shaped. See step().
    reward_type: str = "sparse"
    terminate_on_success: bool = True
    # "state": the simulator's cube position (with noise); "perception": the depth camera's estimate
    # (sim/arm/perception.py, Open3D; ~20 ms per env and step on this machine)
    obs_source: str = "state"
    camera: str = "none"  # "none" | "rgb" | "depth" | "rgbd": adds obs["image"]
    image_size: int = 84  # px, square, 64 .. 96
    randomization: RandomizationConfig = field(default_factory=RandomizationConfig)
    noise: NoiseConfig = field(default_factory=NoiseConfig)


class ArmEnv(gym.vector.VectorEnv):
    """Batched arm task; subclasses define the task (see the module docstring for the interface)."""

    metadata = {"autoreset_mode": gym.vector.AutoresetMode.SAME_STEP}
    OBJECT_POS = CUBE_POS  # cube-position slice of the policy observation (the perception code overwrites it)
    TCP_POS, TCP_YAW, GRIPPER_OPENING = EE_POS, EE_YAW, GRIPPER  # what the perception reads to follow a grasped cube
    HAS_CUBE = True
    HAS_PAD = False
    # A time-out ends the return, as a termination does: the critic observes the time left
    # (t / episode_steps), so the time-out is the end of its MDP (V at t = T is 0; bootstrapping there
    # evaluated a state with t = T, which no update trains on).
    time_out_ends_return = True
    # The task's stages on the way to success, in order (milestones()): where a failed episode got
    # to, for the evaluation's failure breakdown. None by default.
    MILESTONES: tuple[str, ...] = ()
    nominal_action = 0.0  # what an actor's output is initialised to: hold still, gripper half open

    @classmethod
    def check_config(cls, cfg: ArmTaskConfig, params: ArmParams = NOMINAL) -> None:
        """ValueError naming the first value this task cannot run with, before a model is built."""
        if cfg.obs_source not in ("state", "perception"):
            raise ValueError(f"obs_source='{cfg.obs_source}': expected state or perception")
        if cfg.obs_source == "perception" and not cls.HAS_CUBE:
            raise ValueError(f"obs_source=perception: task '{cfg.name}' has no cube to perceive")
        if cfg.camera not in ("none", "rgb", "depth", "rgbd"):
            raise ValueError(f"camera='{cfg.camera}': expected one of none, rgb, depth, rgbd")
        lo, hi = params.camera.image_size_range
        if not lo <= cfg.image_size <= hi:
            raise ValueError(f"image_size={cfg.image_size}: expected {lo} .. {hi} px")
        if cfg.reward_type not in ("sparse", "time", "dense"):
            raise ValueError(f"reward_type='{cfg.reward_type}': expected 'sparse', 'time' or 'dense'")
        if cfg.randomization.max_latency_steps < 0:
            raise ValueError(f"randomization.max_latency_steps={cfg.randomization.max_latency_steps}: expected >= 0")
        if cfg.episode_steps < 1:  # the critic's time feature and the time reward divide by it
            raise ValueError(f"episode_steps={cfg.episode_steps}: expected >= 1")
        r = cfg.randomization
        for name in ("object_x", "object_y", "object_yaw", "mass_scale", "friction_scale"):
            lo, hi = getattr(r, name)
            if not lo <= hi or (name.endswith("_scale") and not lo > 0):
                raise ValueError(f"randomization.{name}={[lo, hi]}: expected low <= high"
                                 + (", both > 0 (a scale of the nominal value)" if name.endswith("_scale") else ""))
        if r.camera_pos < 0 or r.camera_angle < 0:
            raise ValueError(f"randomization.camera_pos={r.camera_pos}, camera_angle={r.camera_angle}: expected >= 0")

    def __init__(self, cfg: ArmTaskConfig, num_envs: int, device: str | torch.device = "cpu", seed: int = 0,
                 backend: str = "mujoco", params: ArmParams = NOMINAL):
        if backend != "mujoco":
            raise ValueError(f"unknown backend '{backend}' for task '{cfg.name}': the arm tasks run on MuJoCo only "
                             "(backend='mujoco')")
        self.check_config(cfg, params)
        self.cfg, self.params, self.num_envs = cfg, params, num_envs
        self.device = torch.device(device)
        self.control_period = params.sim.control_period  # s
        self.max_steps = cfg.episode_steps
        lat = cfg.randomization.max_latency_steps
        self.critic_dim = CRITIC_DIM + (1 + ACT_DIM * lat if lat > 0 else 0)
        self.ik = DiffIK(params, IKConfig())

        # --- MuJoCo: one compiled model, copied per env (each env's randomized fields are its own)
        self.xml = mdl.build_mjcf(params, cube=self.HAS_CUBE, pad=self.HAS_PAD)
        model = mujoco.MjModel.from_xml_string(self.xml)
        self.models = [copy.deepcopy(model) for _ in range(num_envs)]
        self.datas = [mujoco.MjData(m) for m in self.models]
        self._ids(model)
        self.state_size = mujoco.mj_stateSize(model, STATE_SPEC)
        self._renderers: dict[int, mujoco.Renderer] = {}  # by image size, px (render())
        # Called as on_episode_end(env, idx) in the step that ends the episodes of envs idx, before
        # they reset: the last state of each is still in the simulator (e.g. a video's final frame),
        # except for an env that went non-finite, which MuJoCo has already reset by itself.
        self.on_episode_end: Callable[[ArmEnv, np.ndarray], None] | None = None
        self._depth_scene_option = mujoco.MjvOption()  # depth renders leave the sites (goal marker) out
        self._depth_scene_option.sitegroup[:] = 0

        # --- spaces
        box = gym.spaces.Box
        spaces = {"policy": box(-np.inf, np.inf, (POLICY_DIM,), np.float32),
                  "critic": box(-np.inf, np.inf, (self.critic_dim,), np.float32)}
        s = cfg.image_size
        if cfg.camera == "rgb":
            spaces["image"] = box(0, 255, (3, s, s), np.uint8)
        elif cfg.camera == "depth":
            spaces["image"] = box(0.0, np.inf, (1, s, s), np.float32)
        elif cfg.camera == "rgbd":
            spaces["image"] = box(0.0, np.inf, (4, s, s), np.float32)
        self.single_observation_space = gym.spaces.Dict(spaces)
        self.single_action_space = box(-1.0, 1.0, (ACT_DIM,), np.float32)
        self.observation_space = gym.vector.utils.batch_space(self.single_observation_space, num_envs)
        self.action_space = gym.vector.utils.batch_space(self.single_action_space, num_envs)

        # --- per-env episode state (NumPy, float64 like MuJoCo)
        n = num_envs
        self.goal = np.zeros((n, 3))
        self.mass_scale = np.ones(n)
        self.friction_scale = np.ones(n)
        self.cam_pos = np.tile(self.nominal_cam_pos, (n, 1))
        self.cam_quat = np.tile(self.nominal_cam_quat, (n, 1))
        self.t = np.zeros(n, dtype=np.int64)
        self.episode_return = np.zeros(n)
        self.succeeded = np.zeros(n, dtype=bool)  # success at any step of the episode
        self.furthest = np.full(n, -1, dtype=np.int64)  # index in MILESTONES of the furthest reached this episode, -1 none
        self.expert_phase = np.zeros(n, dtype=np.int64)
        self.expert_t0 = np.zeros(n, dtype=np.int64)  # step at which the current expert phase began
        self.latency = np.zeros(n, dtype=np.int64)  # control periods (RandomizationConfig.max_latency_steps)
        # The actions issued, newest first: row k is the one issued k periods ago.
        self.action_queue = np.tile(HOLD_ACTION, (n, cfg.randomization.max_latency_steps + 1, 1))
        # Snapshot of the simulator state after the last step (filled by _gather)
        self.qpos = np.zeros((n, model.nq))
        self.qvel = np.zeros((n, model.nv))
        self.ee_pos = np.zeros((n, 3))
        self.ee_rot = np.zeros((n, 3, 3))
        self.jac = np.zeros((n, 6, 7))
        self.finger_touch = np.zeros((n, 2), dtype=bool)  # left, right finger in contact with the cube
        self._jacp = np.zeros((3, model.nv))
        self._jacr = np.zeros((3, model.nv))

        self.gen = torch.Generator(device="cpu")  # every episode draw and the observation noise
        self.gen.manual_seed(seed)
        self.expert_gen = torch.Generator(device="cpu")  # expert action noise only
        self.expert_gen.manual_seed(seed + 1)
        # The camera's errors (depth noise, calibration error): a stream of their own, so that they
        # change nothing else (the state observation's runs draw exactly as without a camera).
        self.sensor_gen = torch.Generator(device="cpu")
        self.sensor_gen.manual_seed(seed + 2)
        self.calib_pos = np.zeros((n, 3))  # believed - true camera position (world, m), per episode
        self.calib_quat = np.tile((1.0, 0.0, 0.0, 0.0), (n, 1))  # believed = true rotation @ this (camera frame)
        self.total_steps = 0  # env steps by all envs together
        self.nonfinite_resets = 0
        nz = cfg.noise
        self.obs_noise_std = np.zeros(POLICY_DIM)
        self.obs_noise_std[JOINT_POS], self.obs_noise_std[JOINT_VEL] = nz.joint_pos, nz.joint_vel
        if self.HAS_CUBE:
            self.obs_noise_std[CUBE_POS] = nz.object_pos
        self.perception = None
        self._frames: dict[int, np.ndarray] | None = None  # depth frames of the observation being made
        if cfg.obs_source == "perception":
            from .perception import Perception  # Open3D is needed in this mode only

            self.perception = Perception(self)
        self._reset_envs(np.arange(n))

    def _ids(self, m: mujoco.MjModel) -> None:
        self.arm_qadr = np.array([m.jnt_qposadr[m.joint(j).id] for j in mdl.ARM_JOINTS])
        self.arm_dadr = np.array([m.jnt_dofadr[m.joint(j).id] for j in mdl.ARM_JOINTS])
        # The arm's dofs are contiguous (a chain built in order): slicing beats fancy indexing.
        assert (np.diff(self.arm_dadr) == 1).all()
        self.arm_dofs = slice(int(self.arm_dadr[0]), int(self.arm_dadr[-1]) + 1)
        self.finger_qadr = np.array([m.jnt_qposadr[m.joint(j).id] for j in mdl.FINGER_JOINTS])
        self.ee_id = m.site(mdl.EE_SITE).id
        self.cam_id = m.camera(mdl.CAMERA).id
        self.grip_act = m.actuator(mdl.GRIP_ACTUATOR).id
        self.arm_act = np.array([m.actuator(f"a{i}").id for i in range(1, 8)])
        self.finger_geoms = tuple(m.geom(g).id for g in mdl.FINGER_GEOMS)
        self.goal_mocap = m.body_mocapid[m.body(mdl.GOAL).id]
        self.nominal_cam_pos, self.nominal_cam_quat = m.cam_pos[self.cam_id].copy(), m.cam_quat[self.cam_id].copy()
        if self.HAS_CUBE:
            jid = m.joint(mdl.CUBE).id
            self.cube_qadr, self.cube_dadr = m.jnt_qposadr[jid], m.jnt_dofadr[jid]
            self.cube_body, self.cube_geom = m.body(mdl.CUBE).id, m.geom(mdl.CUBE).id
            self.nominal_inertia = m.body_inertia[self.cube_body].copy()
            self.nominal_friction = m.geom_friction[self.cube_geom].copy()

    # ================================================================ state snapshot
    @property
    def cube_pos(self) -> np.ndarray:
        return self.qpos[:, self.cube_qadr:self.cube_qadr + 3] if self.HAS_CUBE else np.zeros((self.num_envs, 3))

    @property
    def cube_quat(self) -> np.ndarray:
        if not self.HAS_CUBE:
            return np.zeros((self.num_envs, 4))
        q = self.qpos[:, self.cube_qadr + 3:self.cube_qadr + 7]
        return np.where(q[:, :1] < 0, -q, q)  # q and -q are the same rotation: keep w >= 0

    @property
    def cube_vel(self) -> np.ndarray:
        """[N,6] linear (world, m/s) and angular (cube frame, rad/s) velocity of the cube (MuJoCo free joint)."""
        return self.qvel[:, self.cube_dadr:self.cube_dadr + 6] if self.HAS_CUBE else np.zeros((self.num_envs, 6))

    @property
    def ee_yaw(self) -> np.ndarray:
        """[N] gripper yaw about world z (rad; 0: fingers opening along world y)."""
        return hand_yaw(self.ee_rot)

    @property
    def cube_yaw(self) -> np.ndarray:
        """[N] the yaw about world z (rad, -pi .. pi) of the cube's faces: its x axis, or, where the cube
        lies tipped with x more than 30 deg out of the horizontal, its y axis turned back by 90 deg."""
        w, x, y, z = self.cube_quat.T
        yaw_x = np.arctan2(2 * (w * z + x * y), 1 - 2 * (y * y + z * z))
        yaw_y = np.arctan2(1 - 2 * (x * x + z * z), 2 * (x * y - w * z)) - math.pi / 2
        x_up = np.abs(2 * (x * z - w * y))  # |z component| of the x axis: > 0.5, tipped more than 30 deg
        return np.where(x_up > 0.5, yaw_y, yaw_x)

    @property
    def ee_vel(self) -> np.ndarray:
        """TCP velocity [N,3] (world, m/s), from the joints' velocities."""
        return (self.jac[:, :3] @ self.qvel[:, self.arm_dadr, None])[..., 0]

    @property
    def opening(self) -> np.ndarray:
        """Distance between the fingers, m."""
        return self.qpos[:, self.finger_qadr].sum(-1)

    def _gather(self, i: int) -> None:
        """Copy what observation, reward, IK and expert need out of env i's (forwarded) MjData."""
        m, d = self.models[i], self.datas[i]
        self.qpos[i], self.qvel[i] = d.qpos, d.qvel
        self.ee_pos[i] = d.site_xpos[self.ee_id]
        self.ee_rot[i] = d.site_xmat[self.ee_id].reshape(3, 3)
        mujoco.mj_jacSite(m, d, self._jacp, self._jacr, self.ee_id)
        self.jac[i, :3], self.jac[i, 3:] = self._jacp[:, self.arm_dofs], self._jacr[:, self.arm_dofs]
        if self.HAS_CUBE:
            touch = [False, False]
            for g1, g2 in d.contact.geom[:d.ncon].tolist():  # a handful of contacts: plain Python is fastest
                if g1 == self.cube_geom or g2 == self.cube_geom:
                    other = g1 + g2 - self.cube_geom
                    touch[0] |= other == self.finger_geoms[0]
                    touch[1] |= other == self.finger_geoms[1]
            self.finger_touch[i] = touch

    # ================================================================ observation
    def _observe(self, rows: np.ndarray | None = None) -> dict[str, torch.Tensor]:
        """The observation (_observe_now), each env's depth frame rendered once: the camera's image and
        the perception's estimate see the same frame, with the same sensor noise (depth_image)."""
        self._frames = {}
        try:
            return self._observe_now(rows)
        finally:
            self._frames = None

    def _observe_now(self, rows: np.ndarray | None = None) -> dict[str, torch.Tensor]:
        """The observation of every environment; the camera and the perception (~20 ms per
        environment) only for ``rows`` (all if None): the other rows then keep the state
        observation and a blank image, as an episode's final observation needs only its own rows.
        The noise is drawn for every row either way, so its stream does not depend on ``rows``."""
        n = self.num_envs
        clean = np.concatenate((self.qpos[:, self.arm_qadr], self.qvel[:, self.arm_dadr], self.ee_pos,
                                self.opening[:, None], self.cube_pos, self.cube_quat, self.goal,
                                self.ee_yaw[:, None]), axis=-1)
        policy = clean
        if self.cfg.noise.enabled:
            if self.cfg.noise.object_seen_by_camera and self.HAS_CUBE:
                policy = clean.copy()  # the critic keeps the true position
                policy[:, CUBE_POS] = self.seen_by_camera(self.cube_pos)
            policy = policy + self.obs_noise_std * self._randn((n, POLICY_DIM))
        if self.perception is not None:  # the camera's cube estimate replaces the simulator's
            policy = policy.copy()  # the critic keeps the true position
            self.perception.update(policy, rows)
        rel_cube = self.cube_pos - self.ee_pos if self.HAS_CUBE else np.zeros((n, 3))
        rel_goal = self.goal - self.cube_pos if self.HAS_CUBE else np.zeros((n, 3))
        critic = [clean, self.cube_vel, self.mass_scale[:, None], self.friction_scale[:, None], rel_cube, rel_goal,
                  (self.t / self.max_steps)[:, None]]
        lat = self.cfg.randomization.max_latency_steps
        if lat > 0:  # the next `latency` steps apply the newest `latency` issued actions
            in_flight = self.action_queue[:, :lat] * (np.arange(lat) < self.latency[:, None])[:, :, None]
            critic += [(self.latency / lat)[:, None], in_flight.reshape(n, -1)]
        critic = np.concatenate(critic, axis=-1)
        obs = {"policy": self._tensor(policy), "critic": self._tensor(critic)}
        if self.cfg.camera != "none":
            if rows is None:
                image = np.stack([self._image(i) for i in range(n)])
            else:
                first = self._image(int(rows[0]))
                image = np.zeros((n, *first.shape), first.dtype)
                image[rows[0]] = first
                for i in rows[1:]:
                    image[i] = self._image(int(i))
            obs["image"] = torch.from_numpy(image).to(self.device)
        return obs

    def _tensor(self, x: np.ndarray) -> torch.Tensor:
        return torch.from_numpy(x.astype(np.float32)).to(self.device)

    def _image(self, i: int) -> np.ndarray:
        cam = self.cfg.camera
        if cam == "depth":
            return self.depth_image(i)[None]
        rgb = self.render(i, rgb=True, depth=False)["rgb"].transpose(2, 0, 1)
        if cam == "rgb":
            return rgb
        return np.concatenate((rgb.astype(np.float32) / 255.0, self.depth_image(i)[None]))

    # ================================================================ task hooks (override)
    def sample_episode(self, idx: np.ndarray) -> None:
        """Place the cube and the goal for envs ``idx`` (after their physics was reset)."""
        raise NotImplementedError

    def success(self) -> np.ndarray:
        raise NotImplementedError

    def goal_distance(self) -> np.ndarray:
        """[N] m: the distance that the task's success bounds by ``cfg.success_radius`` (step() reports it
        in ``info["goal_distance"]``; evaluation plots it). Default (the cube tasks): the cube centre's
        horizontal distance to the goal."""
        return np.linalg.norm(self.goal[:, :2] - self.cube_pos[:, :2], axis=-1)

    def failure(self) -> np.ndarray:
        """Episode failure (ends it, terminated = True), [N] bool. Default: the cube left the table."""
        if not self.HAS_CUBE:
            return np.zeros(self.num_envs, dtype=bool)
        return self.cube_pos[:, 2] < -0.05

    def milestones(self) -> np.ndarray:
        """[N, len(MILESTONES)] bool: which of the task's milestones hold at this step, each one
        requiring the ones before it. Default: the task has none."""
        return np.zeros((self.num_envs, 0), dtype=bool)

    def reward_terms(self, success: np.ndarray) -> dict[str, np.ndarray]:
        """Named shaping terms, each [N] in [0, weight], summed into the dense reward. Each name is
        the field of ``cfg.reward`` holding its weight, and the success bonus is named "success":
        step() reads the weights by these names to turn the other terms into costs."""
        raise NotImplementedError

    def expert(self) -> np.ndarray:
        """Scripted expert action [N, ACT_DIM] from the true state; updates expert_phase / expert_t0."""
        raise NotImplementedError

    # ================================================================ shared randomization
    def randomize_physics(self, idx: np.ndarray) -> None:
        """Cube mass/inertia and friction, camera pose, actuation latency: drawn if randomization is
        enabled, else nominal (no latency)."""
        r, k = self.cfg.randomization, len(idx)
        if r.enabled:
            if self.HAS_CUBE:
                self.mass_scale[idx] = self._uniform(k, r.mass_scale)
                self.friction_scale[idx] = self._uniform(k, r.friction_scale)
            dpos = r.camera_pos * (2 * self._rand((k, 3)) - 1)
            dang = np.radians(r.camera_angle) * (2 * self._rand((k, 3)) - 1)
            if r.max_latency_steps > 0:
                self.latency[idx] = np.floor(self._rand((k,)) * (r.max_latency_steps + 1)).astype(np.int64)
        else:
            self.mass_scale[idx] = 1.0
            self.friction_scale[idx] = 1.0
            self.latency[idx] = 0
            dpos, dang = np.zeros((k, 3)), np.zeros((k, 3))
        for j, i in enumerate(idx):
            q, dq, out = self.nominal_cam_quat.copy(), np.zeros(4), np.zeros(4)
            for axis in range(3):  # small rotations about the camera's own x, y, z axes
                mujoco.mju_axisAngle2Quat(dq, np.eye(3)[axis], dang[j, axis])
                mujoco.mju_mulQuat(out, q, dq)
                q = out.copy()
            self.cam_pos[i], self.cam_quat[i] = self.nominal_cam_pos + dpos[j], q
        self.draw_calibration(idx)

    def draw_calibration(self, idx: np.ndarray) -> None:
        """This episode's error of the camera pose the perception believes (NoiseConfig), from the
        sensor stream: Gaussian per world axis (m) and about each camera axis (rad)."""
        nz, k = self.cfg.noise, len(idx)
        if not nz.enabled:
            self.calib_pos[idx], self.calib_quat[idx] = 0.0, (1.0, 0.0, 0.0, 0.0)
            return
        g = torch.randn((k, 6), generator=self.sensor_gen, dtype=torch.float64).numpy()
        self.calib_pos[idx] = nz.camera_pos * g[:, :3]
        for j, i in enumerate(idx):
            rotvec = np.radians(nz.camera_angle) * g[j, 3:]
            angle = float(np.linalg.norm(rotvec))
            q = np.array((1.0, 0.0, 0.0, 0.0))
            if angle > 0:
                mujoco.mju_axisAngle2Quat(q, rotvec / angle, angle)
            self.calib_quat[i] = q

    def _apply_params(self, i: int) -> None:
        """Write env i's randomized parameters into its own model, then refresh derived constants."""
        m = self.models[i]
        if self.HAS_CUBE:
            m.body_mass[self.cube_body] = self.params.cube.mass * self.mass_scale[i]
            m.body_inertia[self.cube_body] = self.nominal_inertia * self.mass_scale[i]
            m.geom_friction[self.cube_geom] = self.nominal_friction * self.friction_scale[i]
        m.cam_pos[self.cam_id], m.cam_quat[self.cam_id] = self.cam_pos[i], self.cam_quat[i]
        mujoco.mj_setConst(m, self.datas[i])

    def set_cube_pose(self, i: int, xy, yaw: float) -> None:
        """Cube resting on the table at ``xy`` (world, m) with ``yaw`` (rad), at rest."""
        a = self.cube_qadr
        half = self.params.cube.half
        self.datas[i].qpos[a:a + 7] = (xy[0], xy[1], half, math.cos(yaw / 2), 0.0, 0.0, math.sin(yaw / 2))
        self.datas[i].qvel[self.cube_dadr:self.cube_dadr + 6] = 0.0

    def set_goal(self, i: int, pos) -> None:
        self.goal[i] = pos
        self.datas[i].mocap_pos[self.goal_mocap] = pos

    def sample_cube_xy_yaw(self, k: int) -> tuple[np.ndarray, np.ndarray]:
        """Initial cube xy [k,2] (world, m) and yaw [k] (rad): RandomizationConfig ranges, or nominal."""
        r, c = self.cfg.randomization, self.params.cube
        xy = np.tile(np.array(c.start_xy), (k, 1))
        if not r.enabled:
            return xy, np.zeros(k)
        xy[:, 0] += self._uniform(k, r.object_x)
        xy[:, 1] += self._uniform(k, r.object_y)
        return xy, self._uniform(k, r.object_yaw)

    # ================================================================ gym API
    def reset(self, *, seed: int | None = None, options: dict | None = None):
        if seed is not None:  # a seeded reset starts the experiment over
            self.gen.manual_seed(seed)
            self.expert_gen.manual_seed(seed + 1)
            self.sensor_gen.manual_seed(seed + 2)
            self.total_steps = 0
        self._reset_envs(np.arange(self.num_envs))
        return self._observe(), {}

    def restart(self, idx: np.ndarray) -> dict[str, torch.Tensor]:
        """Start new episodes in envs ``idx`` between steps; returns their observations (rows ``idx``).
        For a policy that executes action chunks: step() resets an env in the step that ends its
        episode, so an episode ending inside a chunk would start the next one with the chunk's
        remaining actions, from a state (arm moving, up to 8 cm from home, at t = 1..3) that an
        evaluation, which starts every episode at t = 0 from home at rest, never shows."""
        idx = np.asarray(idx)
        self._reset_envs(idx)
        obs = self._observe(idx)
        return {k: v[torch.as_tensor(idx, device=v.device)] for k, v in obs.items()}

    def _reset_envs(self, idx: np.ndarray) -> None:
        self.randomize_physics(idx)
        home, stroke = np.array(self.params.panda.home), self.params.gripper.stroke
        for i in idx:
            m, d = self.models[i], self.datas[i]
            self._apply_params(i)
            mujoco.mj_resetData(m, d)
            d.qpos[self.arm_qadr] = home
            d.qpos[self.finger_qadr] = stroke
            d.ctrl[self.arm_act] = home
            d.ctrl[self.grip_act] = stroke
        self.action_queue[idx] = HOLD_ACTION
        self.sample_episode(idx)
        for i in idx:
            mujoco.mj_forward(self.models[i], self.datas[i])
            self._gather(i)
        if self.perception is not None:
            self.perception.reset(idx)
        self.t[idx] = 0
        self.episode_return[idx] = 0.0
        self.succeeded[idx] = False
        self.furthest[idx] = -1
        self.expert_phase[idx] = 0
        self.expert_t0[idx] = 0

    def step(self, action: torch.Tensor):
        issued = torch.as_tensor(action).detach().cpu().numpy().astype(np.float64)
        if issued.shape != (self.num_envs, ACT_DIM):  # e.g. a policy of another contract version
            raise ValueError(f"action of shape {tuple(issued.shape)}: expected ({self.num_envs}, {ACT_DIM}), "
                             "[dx, dy, dz, dyaw, gripper] per environment")
        # A non-finite action fails its env as a non-finite state does; it is not queued or applied
        # (MuJoCo would zero every control of that env, and NaN in the queue would reach the critic's
        # in-flight actions). Checked before the clip, which would turn an infinity into a full command.
        bad_action = ~np.isfinite(issued).all(-1)
        issued = np.clip(issued, -1.0, 1.0)
        issued[bad_action] = 0.0
        self.action_queue = np.concatenate((issued[:, None], self.action_queue[:, :-1]), axis=1)
        a = self.action_queue[np.arange(self.num_envs), self.latency]  # the action issued `latency` periods ago
        q = self.qpos[:, self.arm_qadr]
        pos_des = self.ik.tcp_targets(self.ee_pos, a[:, MOVE])
        yaw_des = self.ik.yaw_targets(self.ee_rot, a[:, TURN])
        q_target = self.ik.joint_targets(self.jac, self.ee_pos, self.ee_rot, q, pos_des, yaw_des)
        grip = self.ik.gripper_target(a[:, GRIP])
        refs = self.ik.servo_references(q, self.qvel[:, self.arm_dadr], q_target)
        bad = bad_action.copy()
        for i in range(self.num_envs):
            m, d = self.models[i], self.datas[i]
            d.ctrl[self.grip_act] = grip[i]
            for ref in refs[i]:
                d.ctrl[self.arm_act] = ref
                mujoco.mj_step(m, d)
            # MuJoCo resets the data by itself on a non-finite or huge qpos, qvel or qacc (and warns).
            warnings = d.warning.number  # a view: counts per warning type
            bad[i] |= warnings[_DIVERGENCE_WARNINGS].any() or not np.isfinite(d.qpos).all() \
                or not np.isfinite(d.qvel).all()
            warnings[_DIVERGENCE_WARNINGS] = 0
            mujoco.mj_forward(m, d)
            self._gather(i)
        self.t += 1
        self.total_steps += self.num_envs

        success = self.success() & ~bad
        failed = self.failure() | bad
        if self.cfg.reward_type == "sparse":
            reward = success.astype(np.float64)
        elif self.cfg.reward_type == "time":
            # Minimum time: -1 per step short of success, and a failure also pays the steps it skips,
            # so the return is minus the steps to success (-episode_steps at worst), divided by
            # episode_steps to keep returns in [-1, 0] like "sparse". The same information as
            # "sparse", but every decision's value says how far success is, which gives a critic
            # far more to fit than one reward per episode; DSRL's reference code trains on this form
            # (the sparse reward minus 1 per step: opatil-rai/dsrl, env_utils.py).
            reward = (-(~success).astype(np.float64) - failed * (self.max_steps - self.t)) / self.max_steps
        else:
            terms = self.reward_terms(success)
            reward = np.where(bad, 0.0, sum(terms.values()))  # the terms of a non-finite state are not numbers
            if self.cfg.terminate_on_success:
                # Minimum-time form: the shaping terms become costs (<= 0 per step), so ending the
                # episode at success never forfeits reward, and a failure (a non-finite state
                # included) pays the largest cost of every step it skips. (With positive shaping,
                # hovering next to the goal until the time limit out-earns the success bonus.)
                # Term names are the weights' field names.
                worst = sum(getattr(self.cfg.reward, k) for k in terms if k != "success")
                reward = reward - worst - failed * worst * (self.max_steps - self.t)
        terminated = failed | (success & self.cfg.terminate_on_success)
        truncated = (self.t >= self.max_steps) & ~terminated
        done = terminated | truncated
        self.episode_return += reward
        self.succeeded |= success
        held = self.milestones() & ~bad[:, None]  # as success: nothing of a diverged (reset) state counts
        if held.shape[1]:  # the last milestone that holds (-1: none), kept if further than before
            last = np.where(held.any(1), held.shape[1] - 1 - np.argmax(held[:, ::-1], 1), -1)
            self.furthest = np.maximum(self.furthest, last)

        info: dict = {"success": torch.from_numpy(success).to(self.device),
                      "goal_distance": self._tensor(self.goal_distance())}
        if done.any():
            idx = np.flatnonzero(done)
            final = self._observe(idx)
            if bad.any():  # never let a non-finite state reach training: zero it, mark it, reset it
                self.nonfinite_resets += int(bad.sum())
                info["nonfinite"] = torch.from_numpy(bad).to(self.device)
                final = {k: torch.nan_to_num(v, 0.0, 0.0, 0.0) if v.is_floating_point() else v
                         for k, v in final.items()}
            info["final_obs"] = final
            info["_final_obs"] = torch.from_numpy(done).to(self.device)
            info["episode_return"] = self._tensor(self.episode_return[idx])
            info["episode_success"] = torch.from_numpy(self.succeeded[idx].copy()).to(self.device)
            info["episode_milestone"] = torch.from_numpy(self.furthest[idx].copy()).to(self.device)  # -1: none reached
            info["episode_length"] = self._tensor(self.t[idx] * self.control_period)  # s
            if self.on_episode_end is not None:
                self.on_episode_end(self, idx)
            self._reset_envs(idx)
        return (self._observe(), self._tensor(reward), torch.from_numpy(terminated).to(self.device),
                torch.from_numpy(truncated).to(self.device), info)

    def curriculum(self) -> float:
        return 1.0

    def return_range(self) -> tuple[float, float] | None:
        """Bounds on any (discounted) return from any state, or None where the reward has none
        as simple: "sparse" with terminate_on_success pays 1 at most once, "time" adds up to at
        most one episode's -1."""
        if self.cfg.reward_type == "time":
            return (-1.0, 0.0)
        if self.cfg.reward_type == "sparse" and self.cfg.terminate_on_success:
            return (0.0, 1.0)
        return None

    # ================================================================ expert
    def expert_action(self, noise: float = 0.0) -> torch.Tensor:
        """The task's scripted expert on the true simulator state, plus Gaussian noise of std
        ``noise`` (action units), clipped to [-1, 1]. [N, ACT_DIM] float32."""
        a = self.expert()
        if noise > 0:
            a = a + noise * torch.randn(a.shape, generator=self.expert_gen, dtype=torch.float64).numpy()
        return self._tensor(np.clip(a, -1.0, 1.0))

    def _phase(self, mask: np.ndarray, phase: int) -> None:
        """Move envs ``mask`` to expert phase ``phase``, remembering when."""
        self.expert_phase[mask] = phase
        self.expert_t0[mask] = self.t[mask]

    def toward(self, target: np.ndarray, gain: float = 1.0, damping: float = 1.0) -> np.ndarray:
        """Action [N,3] moving the TCP toward ``target`` (world, m): ``gain`` x the distance less
        ``damping`` x how far the TCP's current velocity takes it in a period, saturating at 1. The
        damping keeps the acceleration-limited arm (control.py) from overshooting: without it the
        pick-and-place expert's descent went 23 mm past the cube's centre, fingertips at the table,
        and its success at noise 0.3 was 166/200 against 198/200 (ad-hoc, 2026-11-28)."""
        step = gain * (target - self.ee_pos) - damping * self.ee_vel * self.control_period
        return np.clip(step / self.ik.cfg.max_delta, -1.0, 1.0)

    def grasp_yaw(self) -> np.ndarray:
        """[N] the gripper yaw (rad) that sets the fingers square to the cube's faces (the cube's yaw
        modulo its 90 deg symmetry) closest to the current one within +-IKConfig.yaw_limit."""
        g = self.ee_yaw + (self.cube_yaw - self.ee_yaw + math.pi / 4) % (math.pi / 2) - math.pi / 4
        lim = self.ik.cfg.yaw_limit
        return np.where(g > lim, g - math.pi / 2, np.where(g < -lim, g + math.pi / 2, g))

    def turn(self, yaw: np.ndarray, gain: float = 1.0) -> np.ndarray:
        """Action [N] turning the gripper toward ``yaw`` (rad): proportional, saturating at 1."""
        return np.clip(gain * (yaw - self.ee_yaw) / self.ik.cfg.max_dyaw, -1.0, 1.0)

    # ================================================================ camera
    def render(self, env_index: int = 0, rgb: bool = True, depth: bool = True,
               size: int | None = None) -> dict[str, np.ndarray]:
        """Env ``env_index`` seen by the ``front`` camera, ``size`` px square (default ``image_size``,
        the observation's camera; a video may ask for more, up to CameraParams.framebuffer's height):
        ``rgb`` uint8 [H, W, 3] and ``depth`` float32 [H, W], z-depth in metres (distance along the
        optical axis; pixels that see nothing read the far clip distance, CameraParams.far). Row 0
        is the top of the image. The goal marker (a site) shows in RGB, not in depth: it is a
        drawing, not a surface."""
        s = size or self.cfg.image_size
        if s not in self._renderers:
            height = int(self.models[0].vis.global_.offheight)
            if not 1 <= s <= height:
                raise ValueError(f"render size {s} px: expected 1..{height} (the offscreen framebuffer, "
                                 "CameraParams.framebuffer)")
            try:
                self._renderers[s] = mujoco.Renderer(self.models[0], s, s)
            except Exception as e:  # no OpenGL context: say how to get one
                raise RuntimeError(f"cannot render (MUJOCO_GL={os.environ.get('MUJOCO_GL')}): {e}. Headless rendering "
                                   "needs MUJOCO_GL=egl (GPU or Mesa) or MUJOCO_GL=osmesa, set before mujoco is "
                                   "imported") from e
        r, out = self._renderers[s], {}
        if rgb:
            r.update_scene(self.datas[env_index], camera=mdl.CAMERA)
            out["rgb"] = r.render().copy()
        if depth:  # without the sites: a depth sensor does not see the goal marker
            r.update_scene(self.datas[env_index], camera=mdl.CAMERA, scene_option=self._depth_scene_option)
            r.enable_depth_rendering()
            out["depth"] = r.render().astype(np.float32)
            r.disable_depth_rendering()
        return out

    def depth_image(self, env_index: int) -> np.ndarray:
        """What the depth camera of env ``env_index`` measures: its rendered z-depth [H, W] (m) with
        the sensor's noise (``depth_noise``); within one observation, one frame per env (_observe)."""
        frames = self._frames
        if frames is not None and env_index in frames:
            return frames[env_index]
        depth = self.depth_noise(self.render(env_index, rgb=False, depth=True)["depth"])
        if frames is not None:
            frames[env_index] = depth
        return depth

    def depth_noise(self, depth: np.ndarray) -> np.ndarray:
        """``depth`` (an exact z-depth image, m) plus Gaussian noise of NoiseConfig.depth times std(z)
        of the Nguyen et al. model, from the sensor stream (pixels without a return stay as they are)."""
        nz = self.cfg.noise
        if not nz.enabled or nz.depth == 0:
            return depth
        std = nz.depth * (0.0012 + 0.0019 * (depth.astype(np.float64) - 0.4) ** 2)
        g = torch.randn(depth.shape, generator=self.sensor_gen, dtype=torch.float64).numpy()
        # No return: nothing in range (the far clip, as rendered: MuJoCo's float32 reverse-z conversion reads
        # it up to ~5e-5 short at other clip planes, 4.9999952 of 5 m here) or an invalid reading
        valid = np.isfinite(depth) & (depth > 0) & (depth < self.params.camera.far * (1 - 1e-4))
        return np.where(valid, depth + std * g, depth).astype(np.float32)

    def camera_info(self, env_index: int = 0, calibrated: bool = True) -> tuple[np.ndarray, np.ndarray]:
        """Intrinsics K [3,3] (px) and camera pose T_world_cam [4,4] in the OpenCV convention
        (x right, y down, z forward) for env ``env_index``: the pose a calibrated system believes
        (the randomized true pose with this episode's calibration error, NoiseConfig), or with
        ``calibrated=False`` the true one.

        K: square pixels, f = (H / 2) / tan(fovy / 2); the principal point is the image centre with
        pixel centres at integer coordinates, cx = (W - 1) / 2, cy = (H - 1) / 2.
        Pose: MuJoCo's camera frame has x right, y up and looks along -z, so
        R_world_cv = R_world_mujoco @ diag(1, -1, -1) (flip y and z); the origin is the same."""
        s = self.cfg.image_size
        f = (s / 2) / math.tan(math.radians(self.models[env_index].cam_fovy[self.cam_id]) / 2)
        k = np.array([[f, 0.0, (s - 1) / 2], [0.0, f, (s - 1) / 2], [0.0, 0.0, 1.0]])
        d = self.datas[env_index]
        rot, pos = d.cam_xmat[self.cam_id].reshape(3, 3), d.cam_xpos[self.cam_id].copy()
        if calibrated:
            err = np.zeros(9)
            mujoco.mju_quat2Mat(err, self.calib_quat[env_index])
            rot, pos = rot @ err.reshape(3, 3), pos + self.calib_pos[env_index]
        t = np.eye(4)
        t[:3, :3] = rot @ np.diag((1.0, -1.0, -1.0))
        t[:3, 3] = pos
        return k, t

    def seen_by_camera(self, world_pos: np.ndarray) -> np.ndarray:
        """[N, 3] world points (m), one per env, where the calibrated camera places them: the
        point in the true camera frame, mapped to the world by the believed pose (camera_info).
        With the true pose (c, R) and the believed one (c + dc, R E): c + dc + R E R^T (p - c)."""
        out = np.empty_like(world_pos)
        err = np.zeros(9)
        for i, d in enumerate(self.datas):
            rot, pos = d.cam_xmat[self.cam_id].reshape(3, 3), d.cam_xpos[self.cam_id]
            mujoco.mju_quat2Mat(err, self.calib_quat[i])
            out[i] = pos + self.calib_pos[i] + rot @ (err.reshape(3, 3) @ (rot.T @ (world_pos[i] - pos)))
        return out

    def close_extras(self, **kwargs) -> None:
        """Free the offscreen renderer (OpenGL context); ``close()`` (gymnasium) calls this."""
        for r in self._renderers.values():
            r.close()
        self._renderers.clear()

    # ================================================================ checkpointing
    def state_dict(self) -> dict:
        """Everything needed to continue bit-exactly: each env's MuJoCo integration state, its
        randomized parameters, the episode counters, the expert's phases, both generators and, with
        obs_source=perception, the cube estimates held."""
        mj = np.zeros((self.num_envs, self.state_size))
        for i in range(self.num_envs):
            mujoco.mj_getState(self.models[i], self.datas[i], mj[i], STATE_SPEC)
        arrays = {k: getattr(self, k).copy() for k in self._STATE_ARRAYS}
        sd = {"mj": mj, **arrays, "gen": self.gen.get_state(), "expert_gen": self.expert_gen.get_state(),
              "sensor_gen": self.sensor_gen.get_state(), "total_steps": self.total_steps, "nonfinite_resets": self.nonfinite_resets}
        if self.perception is not None:
            sd["perception"] = self.perception.state_dict()
        return sd

    _STATE_ARRAYS = ("goal", "mass_scale", "friction_scale", "cam_pos", "cam_quat", "calib_pos", "calib_quat", "t",
                     "episode_return", "succeeded", "furthest", "expert_phase", "expert_t0", "latency", "action_queue")
    # The arrays that checkpoints of older revisions lack, and what they load as: the feature off
    # (here: no latency, nothing in flight, an exactly known camera pose, no milestone reached yet in
    # the episodes under way).
    _STATE_DEFAULTS: dict[str, Callable[["ArmEnv"], np.ndarray]] = {
        "latency": lambda env: np.zeros(env.num_envs, dtype=np.int64),
        "action_queue": lambda env: np.tile(HOLD_ACTION, env.action_queue.shape[:2] + (1,)),
        "calib_pos": lambda env: np.zeros((env.num_envs, 3)),
        "calib_quat": lambda env: np.tile((1.0, 0.0, 0.0, 0.0), (env.num_envs, 1)),
        "furthest": lambda env: np.full(env.num_envs, -1, dtype=np.int64),
    }

    def load_state_dict(self, sd: dict) -> None:
        if sd["mj"].shape != (self.num_envs, self.state_size):
            raise ValueError(f"state_dict holds {sd['mj'].shape[0]} envs of state size {sd['mj'].shape[1]}; "
                             f"this env has {self.num_envs} of size {self.state_size} (same task and num_envs needed)")
        sd = {**{k: default(self) for k, default in self._STATE_DEFAULTS.items() if k not in sd}, **sd}
        if sd["action_queue"].shape != self.action_queue.shape:
            raise ValueError(f"state_dict holds actions of {sd['action_queue'].shape[1] - 1} periods of latency; "
                             f"this env has {self.cfg.randomization.max_latency_steps} (same max_latency_steps needed)")
        for k in self._STATE_ARRAYS:
            setattr(self, k, np.array(sd[k], copy=True))
        self.gen.set_state(sd["gen"])
        self.expert_gen.set_state(sd["expert_gen"])
        if "sensor_gen" in sd:  # absent in checkpoints of older revisions: the stream goes on from here
            self.sensor_gen.set_state(sd["sensor_gen"])
        self.total_steps, self.nonfinite_resets = sd["total_steps"], sd["nonfinite_resets"]
        if self.perception is not None and "perception" in sd:  # absent in checkpoints of older revisions
            self.perception.load_state_dict(sd["perception"])
        for i in range(self.num_envs):
            self._apply_params(i)
            mujoco.mj_setState(self.models[i], self.datas[i], sd["mj"][i], STATE_SPEC)
            mujoco.mj_forward(self.models[i], self.datas[i])
            self._gather(i)

    # ================================================================ random helpers (torch generator)
    def _rand(self, shape) -> np.ndarray:
        return torch.rand(shape, generator=self.gen, dtype=torch.float64).numpy()

    def _randn(self, shape) -> np.ndarray:
        return torch.randn(shape, generator=self.gen, dtype=torch.float64).numpy()

    def _uniform(self, k: int, r: tuple[float, float]) -> np.ndarray:
        return r[0] + (r[1] - r[0]) * self._rand((k,))
