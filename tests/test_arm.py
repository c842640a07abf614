"""The arm tasks (sim/arm): Cartesian control, scripted experts, episode semantics, exact resume,
the Gymnasium checker, the camera and the randomizer."""

import os

import ctypes.util

if "MUJOCO_GL" not in os.environ:  # headless rendering: EGL, else OSMesa (as sim/arm/base.py chooses)
    os.environ["MUJOCO_GL"] = "egl" if ctypes.util.find_library("EGL") else "osmesa"

import dataclasses  # noqa: E402

import mujoco  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402
import torch  # noqa: E402
from gymnasium.utils.env_checker import check_env  # noqa: E402

from sim.arm.base import ACT_DIM, CRITIC_DIM, CUBE_POS, EE_POS, EE_YAW, MOVE, POLICY_DIM, TURN  # noqa: E402
from sim.arm.params import NOMINAL  # noqa: E402
from sim.arm.pick_place import ArmPickPlaceEnv  # noqa: E402
from sim.arm.push import ArmPushEnv  # noqa: E402
from sim.arm.reach import ArmReachEnv  # noqa: E402
from sim.registry import get_task  # noqa: E402
from sim.single import SingleEnv  # noqa: E402


@pytest.fixture(autouse=True)
def one_thread():
    """The arm envs are NumPy/MuJoCo-bound; one torch thread, restored for the other test modules."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


def make(task: str, n: int, seed: int = 0, **overrides):
    spec = get_task(task)
    cfg = dataclasses.replace(spec.default_config(), **overrides)
    return spec.env_cls(cfg, n, seed=seed)


def drive_to(env, target: np.ndarray, steps: int) -> None:
    """Command the TCP toward ``target`` [N,3] (proportional, saturating actions), checking the
    joint limits after every step."""
    lo, hi = np.array(NOMINAL.panda.q_min), np.array(NOMINAL.panda.q_max)
    for _ in range(steps):
        a = torch.zeros(env.num_envs, ACT_DIM)
        a[:, MOVE] = torch.from_numpy(env.toward(target, gain=0.8))
        env.step(a)
        q = env.qpos[:, env.arm_qadr]
        assert (q >= lo).all() and (q <= hi).all(), f"joint limit violated: {q}"


def test_ik_reaches_targets_and_respects_joint_limits():
    env = make("arm_reach", 5, episode_steps=1000, terminate_on_success=False)
    env.reset(seed=0)
    targets = np.array([[0.35, -0.2, 0.05], [0.6, 0.2, 0.3], [0.5, 0.0, 0.15], [0.4, 0.25, 0.35], [0.65, -0.1, 0.1]])
    drive_to(env, targets, 40)
    err = np.linalg.norm(env.ee_pos - targets, axis=-1)
    assert err.max() < 0.005, err
    down = -env.ee_rot[:, :, 2] @ np.array((0.0, 0.0, 1.0))  # hand z axis along world -z
    assert down.min() > np.cos(np.radians(2.0)), down
    # Far out of reach (in front, behind, below the table, above): targets clamp inside the limits.
    far = np.array([[1.5, 0.0, 0.2], [-0.8, 0.3, 0.4], [0.5, 0.0, -0.5], [0.0, 0.0, 1.5], [0.3, -1.2, 0.2]])
    drive_to(env, far, 60)


def test_joint_references_brake_within_franka_limits_near_the_ranges_ends():
    """Random full-scale joint targets, period after period, drive joints to their ranges' ends: the
    references stay within the ranges, and no joint accelerates beyond qdd_max or moves beyond qd_max,
    also while the joints brake together for one of them (each joint braking alone at its own limit
    took the others' speed down at up to 30x theirs, in ~0.4 % of the physics steps)."""
    from sim.arm.control import DiffIK

    ik, p, dt = DiffIK(NOMINAL), NOMINAL.panda, NOMINAL.sim.timestep
    qd_max, qdd_max = np.array(p.qd_max), np.array(p.qdd_max)
    rng = np.random.default_rng(0)
    q, qd = np.tile(ik.q_home, (64, 1)), np.zeros((64, 7))
    near = 0
    for _ in range(60):
        target = np.clip(q + rng.uniform(-1, 1, q.shape) * ik.max_step, ik.lo, ik.hi)
        pos, vel = ik.reference_trajectory(q, qd, target)
        accel = np.diff(np.concatenate((qd[:, None], vel), axis=1), axis=1) / dt
        assert (np.abs(accel) <= qdd_max * (1 + 1e-9)).all(), np.abs(accel / qdd_max).max()
        assert (np.abs(vel) <= qd_max * (1 + 1e-9)).all()
        assert ((pos >= ik.lo - 1e-12) & (pos <= ik.hi + 1e-12)).all()
        near += int((np.minimum(pos - ik.lo, ik.hi - pos) < 0.01).any(-1).sum())
        q, qd = pos[:, -1], vel[:, -1]
    assert near > 500, "the chains reach the ranges' ends"


def test_joints_keep_franka_speed_and_acceleration_limits(monkeypatch):
    """The servo references accelerate at no more than qdd_max and move at no more than qd_max; the
    joints follow within the servo's overshoot, checked at every 2 ms physics step (peak 1.07 x qd_max
    under these actions; 1.75 x when the servos stepped toward each period's target)."""
    env = make("arm_push", 4, seed=2)
    env.reset(seed=2)
    p, dt = NOMINAL.panda, NOMINAL.sim.timestep
    qd_max, qdd_max = np.array(p.qd_max), np.array(p.qdd_max)
    ik, lo, hi, period = env.ik, env.ik.lo, env.ik.hi, env.control_period

    def references(q, qd, target):
        """The period's references, checked against the limits."""
        pos, vel = ik.reference_trajectory(q, qd, target)
        assert pos.shape == vel.shape == (4, NOMINAL.sim.substeps, 7)
        accel = np.diff(np.concatenate((qd[:, None], vel), axis=1), axis=1) / dt
        assert (np.abs(accel) <= qdd_max * (1 + 1e-9)).all(), np.abs(accel / qdd_max).max()
        assert (np.abs(vel) <= qd_max * (1 + 1e-9)).all()
        assert np.allclose(np.diff(np.concatenate((q[:, None], pos), axis=1), axis=1), vel * dt)
        return pos, vel

    q = env.qpos[:, env.arm_qadr].copy()
    references(q, np.zeros((4, 7)), q + qd_max * period)  # from rest to full speed
    references(q, qd_max * np.array([1, -1, 1, -1])[:, None], q - qd_max * period)  # reversal
    # Joint 4 carried 0.1 mrad past its range's end by its servo, still drifting out; joint 1 cruising:
    # joint 4 brakes alone, joint 1 goes on (one stop for all froze the arm within a physics step).
    q4, qd4 = q.copy(), np.zeros((4, 7))
    q4[:, 3], qd4[:, 3], qd4[:, 0] = hi[3] + 1e-4, 0.01, 1.0
    pos, vel = references(q4, qd4, np.where(np.arange(7) == 0, q4 + period, np.minimum(q4, hi)))
    assert (vel[:, :, 0] > 0.99).all() and (vel[:, 1:, 3] <= 0).all()  # joint 4 stopped, then back inside
    # Joint 6 resting at its range's end and pulled outward (as a reference that arrived there within a
    # period and still has v_cmd outward is), joint 1 cruising: joint 6 stays, joint 1 goes on.
    q6, qd6 = q.copy(), np.zeros((4, 7))
    q6[:, 5], qd6[:, 0] = hi[5], 1.0
    pos, vel = references(q6, qd6, q6 + np.where(np.arange(7) == 0, period, np.where(np.arange(7) == 5, 1e-4, 0.0)))
    assert (vel[:, :, 0] > 0.99).all() and (pos[:, :, 5] == hi[5]).all()
    # Joint 2 toward its range's end at full speed, period after period: it stops inside, at qdd_max.
    q2, qd2 = q.copy(), np.zeros((4, 7))
    q2[:, 1], qd2[:, 1] = hi[1] - 0.4, qd_max[1]
    for _ in range(10):
        pos, vel = references(q2, qd2, np.where(np.arange(7) == 1, np.minimum(hi, q2 + qd_max * period), q2))
        assert (pos <= hi).all()
        q2, qd2 = pos[:, -1], vel[:, -1]
    assert (qd2[:, 1] == 0).all() and (hi[1] - q2[:, 1] < 0.01).all()
    speeds = []
    step = mujoco.mj_step

    def recorded(m, d, n=1):
        for _ in range(n):
            step(m, d)
            speeds.append(np.abs(d.qvel[env.arm_dadr]) / qd_max)

    monkeypatch.setattr(mujoco, "mj_step", recorded)
    rng = np.random.default_rng(0)
    for k in range(40):  # full-scale random actions, each held for 10 periods
        if k % 10 == 0:
            a = torch.as_tensor(rng.uniform(-1, 1, (4, ACT_DIM)), dtype=torch.float32)
        env.step(a)
    assert len(speeds) == 40 * 4 * NOMINAL.sim.substeps
    assert max(s.max() for s in speeds) < 1.15


def test_ik_at_a_joint_limit_still_moves_the_tcp_as_commanded():
    """Near the robot's base (x = 0.25 m, on the table) joint 4 reaches its limit: the other joints
    carry the motion on and the TCP arrives, pointing down (clipping the targets alone left it
    stuck 3.7 cm short with the hand tilted ~2.4 deg)."""
    env = make("arm_reach", 1, episode_steps=1000, terminate_on_success=False)
    env.reset(seed=0)
    target = np.array([[0.25, 0.0, 0.016]])
    limited = 0
    for _ in range(60):
        a = np.zeros((1, 3))
        a[:] = env.toward(target, gain=0.8)
        q_target = env.ik.joint_targets(env.jac, env.ee_pos, env.ee_rot, env.qpos[:, env.arm_qadr],
                                        env.ik.tcp_targets(env.ee_pos, a), np.zeros(1))
        assert (q_target >= env.ik.lo).all() and (q_target <= env.ik.hi).all()
        limited += int(np.isclose(q_target, env.ik.lo).any() or np.isclose(q_target, env.ik.hi).any())
        drive_to(env, target, 1)
    assert limited >= 5  # the limit was in play
    assert np.linalg.norm(env.ee_pos[0] - target[0]) < 0.005
    assert -env.ee_rot[0, 2, 2] > np.cos(np.radians(1.0))  # hand z axis still along world -z


def test_ik_turns_the_gripper_about_world_z_within_its_limit():
    """The dyaw action turns the pointing-down gripper by up to max_dyaw per step, the TCP held
    still; the observation reports the yaw; commanded further, it stops at +-yaw_limit; an action
    of the wrong size is refused with a clear error."""
    env = make("arm_reach", 3, episode_steps=1000, terminate_on_success=False)
    obs, _ = env.reset(seed=0)
    assert np.abs(obs["policy"][:, EE_YAW].numpy()).max() < 0.01  # home: yaw 0
    start = env.ee_pos.copy()
    targets = np.array([0.6, -0.4, 0.0])
    for _ in range(30):
        a = np.zeros((3, ACT_DIM))
        a[:, MOVE] = env.toward(start, gain=0.8)
        a[:, TURN] = env.turn(targets, gain=0.8)
        obs, *_ = env.step(torch.from_numpy(a))
    assert np.abs(env.ee_yaw - targets).max() < np.radians(1.0), env.ee_yaw
    assert np.allclose(obs["policy"][:, EE_YAW].numpy()[:, 0], env.ee_yaw, atol=1e-6)
    assert np.linalg.norm(env.ee_pos - start, axis=-1).max() < 0.003
    assert (-env.ee_rot[:, 2, 2]).min() > np.cos(np.radians(2.0))  # still pointing down
    for _ in range(30):  # full turn commanded beyond the limit, both ways
        env.step(torch.tensor([[0, 0, 0, 1.0, -1], [0, 0, 0, -1.0, -1], [0, 0, 0, 1.0, -1]]))
    limit = env.ik.cfg.yaw_limit
    assert np.allclose(env.ee_yaw, [limit, -limit, limit], atol=np.radians(1.5)), env.ee_yaw
    with pytest.raises(ValueError, match=r"expected \(3, 5\)"):
        env.step(torch.zeros(3, 4))


def test_yaw_conventions_and_the_grasp_yaw_within_the_limit():
    """down_rotation and hand_yaw invert each other (yaw +90 deg: hand x along world +y, hand z down);
    cube_yaw reads the yaw the episode set, also for a cube tipped onto a face; grasp_yaw is square to
    the cube and within +-yaw_limit, also where the nearest square yaw lies beyond it."""
    import types

    from sim.arm.control import down_rotation, hand_yaw

    yaws = np.array([-1.5, -0.4, 0.0, 0.9, 1.5])
    assert np.allclose(hand_yaw(down_rotation(yaws)), yaws)
    assert np.allclose(down_rotation(np.array([np.pi / 2]))[0], [[0, 1, 0], [1, 0, 0], [0, 0, -1]], atol=1e-12)
    env = make("arm_pick_place", 8, seed=3)
    set_yaw = np.zeros(8)
    set_pose = env.set_cube_pose

    def record(i, xy, yaw):
        set_yaw[i] = yaw
        return set_pose(i, xy, yaw)

    env.set_cube_pose = record
    env.reset(seed=3)
    assert np.abs(set_yaw).max() > 0.3 and np.allclose(env.cube_yaw, set_yaw, atol=1e-6)
    half = np.sqrt(0.5)
    tipped = types.SimpleNamespace(cube_quat=np.array([[half, 0.0, half, 0.0]]))  # 90 deg about y: x points down
    assert np.allclose(type(env).cube_yaw.fget(tipped), [0.0], atol=1e-9)
    lim = env.ik.cfg.yaw_limit
    # The first four: the nearest square yaw lies beyond the limit (1.90 for the first), or is the cube's own;
    # the last two: the nearest lies within it, a quarter turn from the cube's yaw.
    fake = types.SimpleNamespace(ee_yaw=np.array([1.2, 0.0, -1.2, 0.2, 1.2, -1.0]),
                                 cube_yaw=np.array([0.33, 0.7, -0.33, -0.5, -0.33, 0.6]), ik=env.ik)
    g = type(env).grasp_yaw(fake)
    assert np.allclose(g, [0.33, 0.7, -0.33, -0.5, np.pi / 2 - 0.33, 0.6 - np.pi / 2]) and (np.abs(g) <= lim).all()
    square = (g - fake.cube_yaw + np.pi / 4) % (np.pi / 2) - np.pi / 4
    assert np.allclose(square, 0.0)


def test_pick_place_expert_closes_the_fingers_square_to_the_cube():
    """When the expert starts to close (phase 2), the fingers' axis (hand y) is parallel to one of
    the cube's face normals, read from the raw rotation and quaternion: within 3 deg."""
    env = make("arm_pick_place", 8, seed=4)
    env.reset(seed=4)
    checked = np.zeros(8, bool)
    for _ in range(80):
        env.step(env.expert_action())
        closing = (env.expert_phase == 2) & ~checked
        if closing.any():
            w, x, y, z = env.cube_quat[closing].T
            face = np.arctan2(2 * (x * y + w * z), 1 - 2 * (y * y + z * z))  # cube x axis yaw
            fingers = np.arctan2(env.ee_rot[closing, 1, 1], env.ee_rot[closing, 0, 1])  # hand y axis yaw
            off = (fingers - face + np.pi / 4) % (np.pi / 2) - np.pi / 4
            assert np.degrees(np.abs(off)).max() < 3.0, np.degrees(off)
            checked |= closing
    assert checked.sum() >= 6


@pytest.mark.parametrize("task", ["arm_reach", "arm_push", "arm_pick_place"])
@pytest.mark.parametrize("noise", [0.0, 0.1])
def test_scripted_expert_succeeds(task, noise):
    n = 20
    env = make(task, n, seed=1)
    env.reset(seed=1)
    finished = np.zeros(n, dtype=bool)
    success = np.zeros(n, dtype=bool)
    for _ in range(env.max_steps):
        _, _, term, trunc, info = env.step(env.expert_action(noise))
        success |= info["success"].numpy() & ~finished
        finished |= (term | trunc).numpy()
    assert finished.all()
    assert success.mean() >= 0.9, f"{task} expert at noise {noise}: {success.mean():.0%}"


def test_push_success_needs_the_cube_on_the_table():
    """A cube carried over the goal (the pick-and-place expert run in arm_push) is no push success,
    however close horizontally; set down on the goal it is."""
    carry = {k: v for k, v in vars(ArmPickPlaceEnv).items() if k.isupper()}
    CarryInPush = type("CarryInPush", (ArmPushEnv,), dict(carry, expert=ArmPickPlaceEnv.expert,
                                                           grasped=ArmPickPlaceEnv.grasped))
    env = CarryInPush(get_task("arm_push").default_config(), 8, seed=0)
    env.reset(seed=0)
    carried_over, placed = 0, 0
    for _ in range(env.max_steps):
        _, _, _, _, info = env.step(env.expert_action(0.0))
        placed += int(info["success"].sum())
        over = env.goal_distance() < env.cfg.success_radius
        lifted = over & (env.cube_pos[:, 2] > NOMINAL.cube.half + 0.01)
        carried_over += int(lifted.sum())
        assert not env.success()[lifted].any()
    assert carried_over > 0 and placed > 0, (carried_over, placed)


def test_pick_place_milestones_say_how_far_an_episode_got():
    """The expert's successful episodes pass every milestone; the expert stopped once its fingers
    have closed (held there, closed) gets as far as "grasped"; a new episode starts with none;
    evaluate_success counts the failed episodes by the furthest milestone, and a policy that holds
    still, open, reaches none."""
    from policies.evaluate import evaluate_success, success_episodes

    env = make("arm_pick_place", 6, seed=1)
    assert env.MILESTONES == ("grasped", "lifted", "over the goal")
    obs, _ = env.reset(seed=1)
    succeeded, _, furthest, _ = success_episodes(env, obs, lambda o, finished: env.expert_action())
    assert succeeded.sum() >= 5 and (furthest[succeeded] == 2).all()
    for _ in range(60):  # second episodes under way: some grasp again
        if (env.furthest >= 0).any():
            break
        env.step(env.expert_action())
    assert (env.furthest >= 0).any()
    env.reset(seed=2)
    assert (env.furthest == -1).all()

    env = make("arm_pick_place", 4, seed=1, episode_steps=60)
    obs, _ = env.reset(seed=1)
    stopped = np.zeros(4, dtype=bool)

    def stop_at_lift(o, finished):
        a = env.expert_action()
        stopped[:] |= env.expert_phase >= 3  # phase 3 lifts: from there on, hold still with the gripper closed
        a[torch.from_numpy(stopped)] = torch.tensor([0.0, 0.0, 0.0, 0.0, 1.0])
        return a

    succeeded, _, furthest, _ = success_episodes(env, obs, stop_at_lift)
    assert stopped.all() and not succeeded.any() and (furthest == 0).all()

    cfg = dataclasses.replace(get_task("arm_pick_place").default_config(), episode_steps=20)
    hold_open = torch.tensor([0.0, 0.0, 0.0, 0.0, -1.0])
    res = evaluate_success(lambda obs: hold_open.expand(len(obs), ACT_DIM), cfg, 4, seed=0)
    assert res.success_rate == 0.0
    assert res.failures_by_milestone() == {"none": 4, "grasped": 0, "lifted": 0, "over the goal": 0}
    assert res.as_dict()["failures_by_milestone"] == res.failures_by_milestone()
    assert "failures by the furthest milestone reached: none 4, grasped 0" in res.summary()


def test_worse_push_operator_misses_along_its_own_direction():
    """expert_worse_share=1: every episode's demonstrator commits to a direction 20-35 deg off the
    cube-to-goal line and pushes the cube along it (so it misses); 0.5 mixes the two operators."""
    n = 16
    env = make("arm_push", n, seed=2, expert_worse_share=1.0)
    env.reset(seed=2)
    assert env.worse_operator.all()
    start, goal, direction = env.cube_pos[:, :2].copy(), env.goal[:, :2].copy(), env.worse_dir.copy()
    line = (goal - start) / np.linalg.norm(goal - start, axis=-1, keepdims=True)
    off = np.degrees(np.arccos(np.clip((line * direction).sum(-1), -1.0, 1.0)))
    assert ((off > 19.9) & (off < 35.1)).all(), off
    finished, success = np.zeros(n, dtype=bool), np.zeros(n, dtype=bool)
    end = start.copy()

    def on_episode_end(e, idx):  # the cube where each first episode ended, before the reset
        first = idx[~finished[idx]]
        end[first] = e.cube_pos[first, :2]

    env.on_episode_end = on_episode_end
    while not finished.all():
        _, _, term, trunc, info = env.step(env.expert_action(0.0))
        success |= info["success"].numpy() & ~finished
        finished |= (term | trunc).numpy()
    assert success.mean() <= 0.25, success
    moved = end - start
    heading = np.degrees(np.arccos(np.clip((moved * direction).sum(-1) / np.linalg.norm(moved, axis=-1), -1, 1)))
    assert np.median(heading) < 12.0, heading  # the operator's way (6-7 deg here), not the goal's (20-35 deg off it)
    mixed = make("arm_push", 200, seed=3, expert_worse_share=0.5)
    assert 0.4 < mixed.worse_operator.mean() < 0.6


def test_sparse_reward_and_termination():
    env = make("arm_reach", 4)
    obs, _ = env.reset(seed=0)
    assert obs["policy"].shape == (4, POLICY_DIM) and obs["critic"].shape == (4, CRITIC_DIM)
    ended = np.zeros(4, dtype=bool)
    hooked = []  # on_episode_end's view: the ended envs before their reset

    def on_episode_end(e, idx):
        hooked.append((idx.copy(), e.t[idx].copy(), e.success()[idx].copy()))

    env.on_episode_end = on_episode_end
    length = np.zeros(4, dtype=int)  # steps of each env's current episode
    for _ in range(env.max_steps):
        goal = env.goal.copy()
        obs, reward, term, trunc, info = env.step(env.expert_action())
        success = info["success"].numpy()
        length += 1
        if (term | trunc).any():
            idx, steps, succeeded = hooked.pop()
            assert np.array_equal(idx, np.flatnonzero((term | trunc).numpy()))
            assert np.array_equal(steps, length[idx]) and np.array_equal(succeeded, term.numpy()[idx]), \
                "the ended episodes' last state, not a reset one"
            length[idx] = 0
        assert not hooked, "called once per step that ends episodes"
        assert reward.dtype == torch.float32 and np.array_equal(reward.numpy(), success.astype(np.float32))
        assert np.array_equal(term.numpy(), success)  # reach has no failure termination
        if term.any():
            assert np.array_equal(info["_final_obs"].numpy(), (term | trunc).numpy())
            for i in np.flatnonzero(term.numpy()):
                ee = info["final_obs"]["critic"][i, EE_POS].numpy()  # the observation that ended it
                assert np.linalg.norm(ee - goal[i]) < env.cfg.success_radius + 1e-6
                assert obs["critic"][i, -1] == 0.0  # already reset: time fraction 0
            done = (term | trunc).numpy()
            assert info["episode_success"].numpy().tolist() == term.numpy()[done].tolist()
            assert torch.equal(info["episode_return"], term[torch.from_numpy(done)].float())
        ended |= term.numpy()
    assert ended.all()
    # Holding still: no reward, truncated (not terminated) at the time limit.
    env.reset(seed=0)
    for _ in range(env.max_steps):
        _, reward, term, trunc, info = env.step(torch.zeros(4, ACT_DIM))
        assert (reward == 0).all() and not term.any()
    assert trunc.all() and not info["episode_success"].any()


def test_time_reward_counts_the_steps_to_success():
    env = make("arm_reach", 4, reward_type="time")
    env.reset(seed=0)
    steps = np.zeros(4, dtype=int)
    while True:
        _, reward, term, trunc, info = env.step(env.expert_action())
        steps += 1
        success = info["success"].numpy()
        assert np.array_equal(reward.numpy(), -(~success).astype(np.float32) / np.float32(env.max_steps))
        if term.any():  # the first episode to end: its return is minus the steps before success
            i = int(np.flatnonzero(term.numpy())[0])
            assert info["episode_return"][0].item() == pytest.approx(-(steps[i] - 1) / env.max_steps)
            break
    push = make("arm_push", 2, reward_type="time")
    push.reset(seed=0)
    push.datas[1].qpos[push.cube_qadr + 2] = -0.2  # cube knocked off the table at step 1: pays every step
    _, r, term, _, _ = push.step(torch.zeros(2, ACT_DIM))
    assert term.tolist() == [False, True] and r.tolist() == pytest.approx([-1.0 / push.max_steps, -1.0])


def test_exact_resume_push():
    env = make("arm_push", 3, seed=5, episode_steps=100)  # a time-out within the 115 steps below
    env.reset(seed=5)
    for _ in range(25):
        env.step(env.expert_action(0.2))
    state = env.state_dict()
    other = make("arm_push", 3, seed=123, episode_steps=100)
    # As a checkpoint of a revision before the arm's latency option (no latency, nothing in flight)
    # and before the worse push operator
    old = ("latency", "action_queue", "worse_operator", "worse_dir")
    other.load_state_dict({k: v for k, v in state.items() if k not in old})
    g = torch.Generator().manual_seed(0)
    ended = 0
    for k in range(90):  # crosses episode ends; the expert's phases and noise generator resume too
        if k % 2:
            a, a2 = env.expert_action(0.3), other.expert_action(0.3)
            assert torch.equal(a, a2)
        else:
            a = torch.rand(3, ACT_DIM, generator=g) * 2 - 1
        obs, r, te, tr, _ = env.step(a)
        obs2, r2, te2, tr2, _ = other.step(a)
        assert all(torch.equal(obs[key], obs2[key]) for key in obs)
        assert torch.equal(r, r2) and torch.equal(te, te2) and torch.equal(tr, tr2)
        ended += int((te | tr).sum())
    assert other.total_steps == env.total_steps
    assert ended >= 1, "no episode ended: the resume was not checked across an episode end"


def test_gymnasium_check_env():
    check_env(SingleEnv("arm_push"), skip_render_check=True)


def test_render_and_camera_info():
    env = make("arm_reach", 2, camera="rgbd", image_size=64)
    obs, _ = env.reset(seed=2)
    assert obs["image"].shape == (2, 4, 64, 64) and obs["image"].dtype == torch.float32
    env.set_goal(1, (0.0, 0.0, -1.0))  # the goal marker out of the camera's view
    mujoco.mj_forward(env.models[1], env.datas[1])
    frame = env.render(1)
    assert frame["rgb"].shape == (64, 64, 3) and frame["rgb"].dtype == np.uint8
    assert frame["depth"].shape == (64, 64) and frame["depth"].dtype == np.float32
    big = env.render(1, depth=False, size=128)["rgb"]  # another size (a video's) from its own renderer
    assert big.shape == (128, 128, 3) and np.ptp(big) > 0
    with pytest.raises(ValueError, match="render size 481 px: expected 1..480"):
        env.render(1, size=481)
    k, t_world_cam = env.camera_info(1, calibrated=False)  # the true pose (the render's)
    nominal = np.array(NOMINAL.camera.pos)
    assert 0 < np.abs(t_world_cam[:3, 3] - nominal).max() <= env.cfg.randomization.camera_pos + 1e-9  # jitter seen
    for u, v in [(31, 31), (32, 32), (10, 50), (55, 45)]:  # centre and around, all on the table top
        z = float(frame["depth"][v, u])
        p_cam = np.linalg.inv(k) @ np.array((u, v, 1.0)) * z
        p_world = t_world_cam[:3, :3] @ p_cam + t_world_cam[:3, 3]
        assert abs(p_world[2]) < 0.005, (u, v, p_world)  # on the table plane z = 0
    # An episode's final observation renders the environments that ended; the others' rows are blank.
    env.t[0] = env.max_steps - 1
    obs, _, _, truncated, info = env.step(torch.zeros(2, ACT_DIM))
    assert truncated.tolist() == [True, False]
    assert info["final_obs"]["image"][0].abs().sum() > 0 and not info["final_obs"]["image"][1].any()
    assert obs["image"][1].abs().sum() > 0
    rgb = make("arm_push", 1, camera="rgb")
    o, _ = rgb.reset(seed=0)
    assert o["image"].shape == (1, 3, 84, 84) and o["image"].dtype == torch.uint8
    assert rgb.single_observation_space["image"].contains(o["image"][0].numpy())


def test_randomization_changes_and_disables():
    env = make("arm_pick_place", 2)
    env.reset(seed=0)
    body, geom = env.cube_body, env.cube_geom
    def snapshot():
        m = env.models[0]
        return m.body_mass[body], m.geom_friction[geom, 0], env.cube_pos[0].copy(), env.cube_quat[0].copy()

    first = snapshot()
    env.reset()
    second = snapshot()
    assert first[0] != second[0] and first[1] != second[1]
    assert not np.allclose(first[2], second[2]) and not np.allclose(first[3], second[3])
    lo, hi = env.cfg.randomization.mass_scale
    assert lo * NOMINAL.cube.mass <= second[0] <= hi * NOMINAL.cube.mass

    cfg = get_task("arm_pick_place").default_config()
    cfg.randomization.enabled = False
    fixed = ArmPickPlaceEnv(cfg, 2, seed=0)
    for seed in (0, 1):
        fixed.reset(seed=seed)
        for i in range(2):
            m = fixed.models[i]
            assert m.body_mass[body] == pytest.approx(NOMINAL.cube.mass)
            assert np.allclose(m.geom_friction[geom], NOMINAL.cube.friction)
            assert np.allclose(fixed.cube_pos[i], (*NOMINAL.cube.start_xy, NOMINAL.cube.half), atol=1e-3)
            assert np.allclose(fixed.cube_quat[i], (1, 0, 0, 0), atol=1e-3)
            assert np.allclose(fixed.camera_info(i, calibrated=False)[1][:3, 3], NOMINAL.camera.pos)


def test_action_latency():
    """randomization.max_latency_steps: each env applies the action issued `latency` periods before
    (hold still before the episode's first), its latency drawn per episode; the critic sees it and
    the actions still in flight; resume holds them; the default has none and 44 critic features."""
    from sim.arm.base import HOLD_ACTION

    assert make("arm_reach", 2).observation_space["critic"].shape == (2, CRITIC_DIM)
    cfg = get_task("arm_reach").default_config()
    cfg.randomization.max_latency_steps = 2
    env = get_task("arm_reach").env_cls(cfg, 12, seed=3)
    obs, _ = env.reset(seed=3)
    assert env.observation_space["critic"].shape == (12, CRITIC_DIM + 1 + 2 * ACT_DIM)
    latency = env.latency.copy()
    assert set(latency.tolist()) == {0, 1, 2}, latency
    assert np.array_equal(obs["critic"][:, CRITIC_DIM].numpy(), (latency / 2).astype(np.float32))
    up = torch.zeros(12, ACT_DIM)
    up[:, 2] = 1.0  # one step of +2 cm in z, then hold still
    z = [env.ee_pos[:, 2].copy()]
    for k in range(4):
        obs, *_ = env.step(up if k == 0 else torch.zeros(12, ACT_DIM))
        z.append(env.ee_pos[:, 2].copy())
        if k == 0:  # in flight: `up` where the latency is 1 or 2, then the episode's initial hold where it is 2
            flight = obs["critic"][:, CRITIC_DIM + 1:].numpy().reshape(12, 2, ACT_DIM)
            assert np.array_equal(flight[:, 0], np.where(latency[:, None] >= 1, up.numpy(), 0.0))
            assert np.array_equal(flight[:, 1], np.where(latency[:, None] == 2, HOLD_ACTION, 0.0).astype(np.float32))
    rise = np.diff(np.array(z), axis=0)  # [step, env]
    moved = rise > 0.003  # from rest, the joints' acceleration limits take the TCP ~7 mm up in the first period
    assert moved.any(0).all() and np.array_equal(moved.argmax(0), latency), rise.round(4)
    assert (np.abs(rise) < 0.0005)[np.arange(4)[:, None] < latency].all(), rise.round(4)  # still until then
    # Resume mid-flight: a command issued but not yet applied is in the state.
    env.reset(seed=4)
    env.step(up)
    other = get_task("arm_reach").env_cls(cfg, 12, seed=9)
    other.load_state_dict(env.state_dict())
    for _ in range(3):
        o1, *_ = env.step(torch.zeros(12, ACT_DIM))
        o2, *_ = other.step(torch.zeros(12, ACT_DIM))
        assert torch.equal(o1["critic"], o2["critic"])
    state = env.state_dict()
    cfg.randomization.max_latency_steps = 1
    with pytest.raises(ValueError, match="actions of 2 periods of latency; this env has 1"):
        get_task("arm_reach").env_cls(cfg, 12).load_state_dict(state)
    cfg.randomization.max_latency_steps = -1
    with pytest.raises(ValueError, match="max_latency_steps=-1: expected >= 0"):
        get_task("arm_reach").env_cls(cfg, 1)


def test_interface_errors_and_layout():
    with pytest.raises(ValueError, match="backend"):
        ArmPushEnv(get_task("arm_push").default_config(), 1, backend="torch")
    with pytest.raises(ValueError, match="obs_source='camera': expected state or perception"):
        make("arm_push", 1, obs_source="camera")
    with pytest.raises(ValueError, match="task 'arm_reach' has no cube to perceive"):
        make("arm_reach", 1, obs_source="perception")
    env = make("arm_push", 2, noise=dataclasses.replace(get_task("arm_push").default_config().noise, enabled=False))
    obs, _ = env.reset(seed=0)
    assert ArmPushEnv.OBJECT_POS == CUBE_POS
    assert np.allclose(obs["policy"][:, ArmPushEnv.OBJECT_POS].numpy(), env.cube_pos, atol=1e-6)
    assert torch.equal(obs["policy"], obs["critic"][:, :POLICY_DIM])
    assert isinstance(ArmReachEnv.nominal_action, float) and env.curriculum() == 1.0
    assert env.control_period == 0.05 and env.single_action_space.shape == (ACT_DIM,) == (5,)


@pytest.mark.parametrize("field, value, message", [
    ("episode_steps", 0, "episode_steps=0: expected >= 1"),
    ("randomization.mass_scale", (0.0, 0.0), r"mass_scale=\[0.0, 0.0\]: expected low <= high, both > 0"),
    ("randomization.friction_scale", (-1.0, -1.0), "friction_scale"),
    ("randomization.object_x", (0.1, -0.1), r"object_x=\[0.1, -0.1\]: expected low <= high"),
])
def test_arm_config_refuses_values_that_make_non_finite_or_inverted_data(field, value, message):
    cfg = get_task("arm_push").default_config()
    holder = cfg.randomization if field.startswith("randomization.") else cfg
    setattr(holder, field.split(".")[-1], value)
    with pytest.raises(ValueError, match=message):
        ArmPushEnv(cfg, 1)


@pytest.mark.parametrize("value", [float("nan"), float("inf")])
def test_a_non_finite_action_fails_its_env_alone(value):
    """A non-finite action is a failure of its env, flagged non-finite, not applied (an infinity is
    not clipped into a full command): the other envs step exactly as they would have, and no
    observation (the critic's actions in flight included) holds NaN."""
    cfg = get_task("arm_push").default_config()
    cfg.randomization.max_latency_steps = 2
    envs = [get_task("arm_push").env_cls(cfg, 3, seed=5) for _ in range(2)]
    actions = torch.tensor([[0.5, -0.2, 0.3, 0.2, 1.0]] * 3)
    for env in envs:
        env.reset(seed=5)
        env.step(actions)
    bad = actions.clone()
    bad[0, 3] = value
    obs, reward, term, _, info = envs[0].step(bad)
    ref, *_ = envs[1].step(actions)
    assert term.tolist() == [True, False, False] and info["nonfinite"].tolist() == [True, False, False]
    assert envs[0].nonfinite_resets == 1 and torch.isfinite(reward).all()
    assert all(torch.isfinite(v).all() for v in (*obs.values(), *info["final_obs"].values()))
    # (the policy observation's noise differs: env 0's reset drew from the shared generator first)
    assert torch.equal(obs["critic"][1:], ref["critic"][1:]) and np.array_equal(envs[0].qpos[1:], envs[1].qpos[1:])


def test_dense_reward_and_nonfinite_reset():
    env = make("arm_pick_place", 3, reward_type="dense")
    env.reset(seed=0)
    _, reward, _, _, info = env.step(env.expert_action())
    # Ending at success must never forfeit reward: every step short of success costs (<= 0).
    assert torch.isfinite(reward).all() and not info["success"].any() and (reward <= 0).all()
    push = make("arm_push", 2, reward_type="dense")
    push.reset(seed=0)
    push.datas[1].qpos[push.cube_qadr + 2] = -0.2  # cube knocked off the table: a failure
    _, r, term, _, _ = push.step(torch.zeros(2, ACT_DIM))
    worst = push.cfg.reward.reach + push.cfg.reward.goal
    assert term.tolist() == [False, True] and -worst <= r[0] <= 0
    # this step's cost (between 0 and worst) plus the worst cost of the max_steps - 1 steps it skips
    assert -worst * push.max_steps <= r[1] <= -worst * (push.max_steps - 1)
    env.datas[1].qvel[:] = np.nan  # MuJoCo resets a diverged state by itself; the env must notice
    _, reward, term, _, info = env.step(torch.zeros(3, ACT_DIM))
    # a non-finite state is a failure at step 2: the worst cost of this step and of the remaining ones
    w = env.cfg.reward
    worst = w.reach + w.grasp + w.lift + w.place
    assert term.tolist() == [False, True, False] and env.nonfinite_resets == 1
    assert reward[1].item() == pytest.approx(-worst * (env.max_steps - 1))
    assert info["nonfinite"].tolist() == [False, True, False] and not info["success"][1]
    assert all(torch.isfinite(v).all() for v in info["final_obs"].values()) and env.t[1] == 0


def test_reach_goals_are_not_reached_before_the_first_action():
    """arm_reach draws its goals at least 2 success radii from where the TCP starts (the goal box holds
    that point): from a box of +-3 cm around it, no goal is closer, and none is reached at the first
    step of a policy that holds still; a box within those radii is refused in one line."""
    cfg = get_task("arm_reach").default_config()
    start = np.array([0.45, 0.0, 0.25])  # the TCP at the home pose (world, m)
    cfg.goal_x, cfg.goal_y, cfg.goal_z = (0.42, 0.48), (-0.03, 0.03), (0.22, 0.28)
    env = get_task("arm_reach").env_cls(cfg, 64, seed=0)
    env.reset(seed=0)
    np.testing.assert_allclose(env.ee_pos, np.tile(start, (64, 1)), atol=1e-3)
    for _ in range(3):
        assert (np.linalg.norm(env.goal - start, axis=-1) >= 2 * cfg.success_radius).all()
        _, _, _, _, info = env.step(torch.zeros(64, ACT_DIM))
        assert not info["success"].any()
        env.reset()
    cfg.goal_x, cfg.goal_y, cfg.goal_z = (0.44, 0.46), (-0.01, 0.01), (0.24, 0.26)
    with pytest.raises(ValueError, match="every goal lies within 2 success radii of where the TCP starts"):
        get_task("arm_reach").env_cls(cfg, 4, seed=0)
