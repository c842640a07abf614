"""Hover evaluation: the measures it reports describe the flight they summarise."""

import copy
import json
import os
import signal
import subprocess
import sys
import time
import warnings
from pathlib import Path

import numpy as np
import pytest
import torch
from omegaconf import OmegaConf

from policies import checkpoint as ckpt
from policies.config import to_objects
from policies.evaluate import criterion_config, evaluate_backends, evaluate_hover, tilt_deg
from sim.crazyflie.contract import POLICY_PERIOD
from sim.crazyflie.dynamics import POS, VEL
from sim.crazyflie.params import GRAVITY

ROOT = Path(__file__).resolve().parents[1]
PRETRAINED = ROOT / "policies/pretrained/quad_hover"


def test_common_offset_is_where_the_policy_holds_the_vehicle():
    """Feeding the shipped policy a position error 4 cm too large in x moves its equilibrium 4 cm
    to -x for every vehicle: the common offset shows exactly that shift, the other axes stay."""
    policy, rec = ckpt.load_policy(PRETRAINED)
    task_cfg, _ = to_objects(OmegaConf.create(rec["config"]))
    shift = torch.tensor([0.04] + [0.0] * 21)
    base = evaluate_hover(policy, task_cfg, episodes=50)
    states = []
    held = evaluate_hover(lambda obs: policy(obs + shift), task_cfg, episodes=50,
                          frames_cb=lambda env, t: states.append(env.backend.state[:, :3].clone()))
    # from the simulator's states: position - target over the last 2 s (200 periods), over the episodes that stayed
    stayed = ~np.isnan(held.position_error[-1])
    offset = (torch.stack(states)[-200:, stayed] - torch.tensor(task_cfg.target)).double().mean((0, 1))
    assert stayed.sum() >= 45 and np.allclose(held.common_offset, offset.numpy(), atol=1e-6), (held.common_offset, offset)
    assert max(abs(v) for v in base.common_offset) < 0.02, base.common_offset
    assert abs(held.common_offset[0] - base.common_offset[0] + 0.04) < 0.01, (base.common_offset, held.common_offset)
    for axis in (1, 2):
        assert abs(held.common_offset[axis] - base.common_offset[axis]) < 0.01, (base.common_offset, held.common_offset)
    assert "common offset (x, y, z)" in held.summary() and "common_offset_x_m" in held.as_dict()


def test_an_evaluation_where_every_episode_fails_is_valid_json_and_plots_quietly(tmp_path):
    """Full thrust leaves the 1 m ball in every episode: the means over the episodes that stayed are
    over none, and the result's dict (results.json, eval_*.json) holds null there, not NaN. Its plot
    draws the median only while half the episodes or more run, and warns of no empty median."""
    from policies.eval import plot_errors, running_median

    task_cfg, _ = to_objects(OmegaConf.create(ckpt.load_record(PRETRAINED)["config"]))
    res = evaluate_hover(lambda obs: torch.ones(obs.shape[0], 4), task_cfg, episodes=8)
    assert res.left_ball == 8 and np.isnan(res.mean_final_error)
    assert "nan" not in res.summary() and "last-2s measures: none (every episode left the ball)" in res.summary()
    d = json.loads(json.dumps(res.as_dict(), allow_nan=False))
    assert d["mean_final_error_m"] is None and d["common_offset_x_m"] is None and d["success_rate"] == 0.0
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        plot_errors(res, tmp_path / "error.png")
        running, median = running_median(np.array([[1, 2, 3, 4], [1, 2, np.nan, np.nan], [1] + [np.nan] * 3,
                                                   [np.nan] * 4]))
    assert (tmp_path / "error.png").is_file()
    assert running.tolist() == [True, True, False, False] and median.tolist() == [2.5, 1.5]
    odd, _ = running_median(np.array([[1, 2, 3], [1, 2, np.nan], [1, np.nan, np.nan]]))
    assert odd.tolist() == [True, True, False]  # 1 of 3 running is not half


def test_the_criterion_ignores_a_run_trained_on_easier_conditions():
    """A run trained without randomization and noise, from a narrower start, terminating closer to
    the target, is still judged on the criterion's conditions: the same episodes as for a run with
    the defaults."""
    policy, rec = ckpt.load_policy(PRETRAINED)
    task_cfg, _ = to_objects(OmegaConf.create(rec["config"]))
    easy = copy.deepcopy(task_cfg)
    easy.randomization.enabled = easy.noise.enabled = False
    easy.init.pos = easy.init.tilt_deg = easy.init.vel = easy.init.omega = 0.0
    easy.fail_distance = 0.2  # and a termination the criterion's 1 m ball does not have
    a, b = evaluate_hover(policy, task_cfg, episodes=20), evaluate_hover(policy, easy, episodes=20)
    assert np.array_equal(a.position_error, b.position_error, equal_nan=True) and a.success_rate == b.success_rate
    assert np.nanmax(a.position_error[0]) > 0.1, "the episodes start away from the target"


def test_eval_results_of_other_episodes_or_effects_go_beside_the_default(tmp_path, capsys):
    """policies.eval on a quadrotor run: another seed or number of episodes, or PyBullet's effects other
    than the run's, write result files of their own that say so, and leave the default evaluation's alone."""
    from policies.eval import main

    run = tmp_path / "run"
    (run / "checkpoints").mkdir(parents=True)
    (run / "checkpoints/best.pt").write_bytes((PRETRAINED / "checkpoints/best.pt").read_bytes())
    common = [str(run), "backend=pybullet", "episodes=4"]
    main(common)
    assert f"results: {run / 'eval_pybullet_episodes4.json'}\n" in capsys.readouterr().out  # where to look
    default = (run / "eval_pybullet_episodes4.json").read_text()
    assert json.loads(default)["seed"] == 12345 and "pybullet_effects" not in json.loads(default)
    main([*common, "seed=3"])
    main([*common, "effects=drag"])
    assert json.loads((run / "eval_pybullet_episodes4_seed3.json").read_text())["seed"] == 3
    assert (run / "eval_pybullet_episodes4_seed3_error.png").is_file()
    assert json.loads((run / "eval_pybullet_effects-drag_episodes4.json").read_text())["pybullet_effects"] == ["drag"]
    assert (run / "eval_pybullet_episodes4.json").read_text() == default
    main([str(run), "backend=pybullet", "plot=false"])  # the default evaluation: 100 episodes
    full = (run / "eval_pybullet.json").read_text()
    assert json.loads(full)["episodes"] == 100
    main([*common, "plot=false"])  # a few episodes (e.g. for a video) go beside it
    assert (run / "eval_pybullet.json").read_text() == full


def test_eval_judges_under_the_conditions_its_task_overrides_give(tmp_path):
    """policies.eval task.<field>=value on a quadrotor run changes the criterion's conditions (which
    ignore the run's own config): evaluate_hover takes them as ``conditions``, the command says it
    is no longer the criterion and writes a result of its own that lists the overrides. What the
    criterion fixes, or a value the env refuses, is one error line."""
    from policies.eval import override_task
    from sim.registry import get_task

    policy, rec = ckpt.load_policy(PRETRAINED)
    task_cfg, _ = to_objects(OmegaConf.create(rec["config"]))
    quiet = ["task.randomization.enabled=false", "task.noise.enabled=false"]
    conditions = override_task(get_task(task_cfg.name).default_config(), quiet)
    for cfg, on in ((criterion_config(task_cfg, None), True), (criterion_config(task_cfg, conditions), False)):
        assert cfg.randomization.enabled is on and cfg.noise.enabled is on  # each override taken, not one
    default = evaluate_hover(policy, task_cfg, episodes=20)
    judged = evaluate_hover(policy, task_cfg, episodes=20, conditions=conditions)
    assert abs(judged.mean_final_error - default.mean_final_error) > 1e-3 * default.mean_final_error
    run = tmp_path / "run"
    (run / "checkpoints").mkdir(parents=True)
    (run / "checkpoints/best.pt").write_bytes((PRETRAINED / "checkpoints/best.pt").read_bytes())
    r = subprocess.run([sys.executable, "-m", "policies.eval", str(run), "episodes=20", "plot=false", *quiet],
                       cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0 and "not the hover criterion's conditions" in r.stderr, r.stdout + r.stderr
    written = list(run.glob("eval_torch_overrides-*_episodes20.json"))
    assert len(written) == 1, written
    result = json.loads(written[0].read_text())
    assert result["task_overrides"] == quiet
    assert result["mean_final_error_m"] == pytest.approx(judged.mean_final_error, rel=1e-3)
    assert not (run / "eval_torch_episodes20.json").exists(), "the criterion's own result file is left alone"
    for bad, says in (("task.fail_distance=0.5", "the hover criterion sets it"),
                      ("task.randomization.hard_fraction=1", "the hover criterion sets it"),
                      ("task.randomization.latency_margin=0.5", "the hover criterion sets it"),
                      ("task.randomization.max_latency_steps=-1", "randomization.max_latency_steps=-1.0: expected >= 0"),
                      ("task.randomization.min_latency_steps=1.5", "min_latency_steps=1.5: expected <= max_latency_steps"),
                      ("task.randomization.motor_tau.lo=0.2", "expected 0 < lo <= hi"),
                      ("task.randomization.force_std=nan", "task.randomization.force_std=nan: expected a finite number")):
        r = subprocess.run([sys.executable, "-m", "policies.eval", str(run), "episodes=2", bad],
                           cwd=ROOT, capture_output=True, text=True, timeout=300)
        assert r.returncode == 2 and says in r.stderr and "Traceback" not in r.stderr, r.stderr


def test_tilt_is_measured_from_the_thrust_direction_the_reference_needs():
    """Level, the tilt from vertical is 0. A vehicle rolled (about x) or pitched (about y) by 6 deg
    has a tilt of 6 deg from vertical (a fixed target) and of 0 from the thrust direction of a
    reference accelerating at g tan(6 deg) to where that attitude thrusts (-y, +x); level under such a
    reference, 6 deg again."""
    angle = torch.deg2rad(torch.tensor(6.0))
    c, s, zero = torch.cos(angle / 2), torch.sin(angle / 2), torch.tensor(0.0)
    level = torch.tensor([1.0, 0.0, 0.0, 0.0])
    vertical = torch.tensor([0.0, 0.0, GRAVITY])
    assert tilt_deg(level, vertical).item() == 0.0
    side = GRAVITY * torch.tan(angle)
    for quat, turning in ((torch.stack((c, s, zero, zero)), torch.stack((zero, -side, torch.tensor(GRAVITY)))),
                          (torch.stack((c, zero, s, zero)), torch.stack((side, zero, torch.tensor(GRAVITY))))):
        assert tilt_deg(quat, vertical).item() == pytest.approx(6.0, abs=1e-3)
        assert tilt_deg(quat, turning).item() == pytest.approx(0.0, abs=0.05)
        assert tilt_deg(level, turning).item() == pytest.approx(6.0, abs=1e-3)


def test_the_track_criterion_measures_tilt_from_the_thrust_direction_the_reference_needs():
    """quad_track through evaluate_hover: a vehicle put on the figure-eight at every step, at the
    reference's velocity, its thrust axis along the reference's acceleration plus gravity (yaw 0), is
    judged on track and level (tilt ~0), although that axis leans several degrees from the vertical
    (a sign slip in the reference's acceleration would read twice that)."""
    from sim.crazyflie.params import NOMINAL
    from sim.registry import get_task

    cfg = get_task("quad_track").default_config()
    leans = []

    def place(env, t):
        pos, vel = env.reference()
        d = env.reference_acceleration() + torch.tensor([0.0, 0.0, GRAVITY])
        d = d / d.norm(dim=-1, keepdim=True)
        axis = torch.linalg.cross(torch.tensor([0.0, 0.0, 1.0]).expand_as(d), d, dim=-1)
        sin = axis.norm(dim=-1, keepdim=True)
        angle = torch.atan2(sin, d[:, 2:3])  # from the vertical, about the horizontal axis z x d
        state = env.backend.state.clone()
        state[:, 0:3], state[:, 7:10], state[:, 10:13] = pos, vel, 0.0
        state[:, 3:7] = torch.cat((torch.cos(angle / 2), axis / sin.clamp_min(1e-12) * torch.sin(angle / 2)), -1)
        env.backend.set_state(torch.arange(env.num_envs), state, env.vehicle)
        leans.append(torch.rad2deg(angle[:, 0]))

    res = evaluate_hover(lambda obs: torch.full((len(obs), 4), NOMINAL.hover_action), cfg, episodes=20,
                         frames_cb=place)
    assert torch.stack(leans)[-200:].max() > 4.0  # the figure-eight's thrust axis leans this far
    assert res.success_rate == 1.0 and res.max_tilt_last < 0.1 and res.mean_final_error < 0.001, res.summary()


def test_tilt_from_vertical_is_bit_for_bit_the_hover_criterion_tilt():
    """For a fixed target the measure is exactly the earlier acos(1 - 2(x^2 + y^2)) of the hover
    criterion, so quad_hover's verdicts do not move by a bit."""
    q = torch.randn(10_000, 4, generator=torch.Generator().manual_seed(0))
    q = q / q.norm(dim=-1, keepdim=True)
    earlier = torch.rad2deg(torch.acos((1 - 2 * (q[..., 1] ** 2 + q[..., 2] ** 2)).clamp(-1, 1)))
    up = torch.zeros(10_000, 3) + torch.tensor([0.0, 0.0, GRAVITY])
    assert torch.equal(tilt_deg(q, up), earlier)


def test_each_failed_episode_is_counted_under_the_bounds_it_broke():
    """Under a harder judge than the criterion (latency up to 1.5 periods), the shipped policy fails a few
    of 100 episodes (5 on the AMD EPYC of 2026-12-02: 3 over 5 cm, 5 over 10 deg), none by leaving the
    1 m ball: each failure breaks the 5 cm or the 10 deg bound over the last 2 s, and is counted under each
    bound it broke. The exact count is not pinned: another CPU's float rounding can move an episode that
    sits at a bound."""
    from sim.registry import get_task

    policy, rec = ckpt.load_policy(PRETRAINED)
    task_cfg, _ = to_objects(OmegaConf.create(rec["config"]))
    harder = get_task("quad_hover").default_config()
    harder.randomization.max_latency_steps = 1.5
    states = []  # every step's simulator state, read through the evaluation's frame hook
    res = evaluate_hover(policy, task_cfg, episodes=100, seed=5001, conditions=harder,
                         frames_cb=lambda env, t: states.append(env.backend.state.clone()))
    failed = int((~res.success).sum())
    assert 3 <= failed <= 12 and res.left_ball == 0, (failed, res.left_ball)
    assert res.error_failures >= 1 and res.tilt_failures >= 1, res.summary()
    # The verdicts again, from the states alone, as the issue words the criterion: never farther than
    # 1 m from the target, mean distance over the last 2 s (200 periods) under 5 cm, the angle between
    # the body's z axis and the world's under 10 deg throughout the last 2 s.
    s = torch.stack(states).double()  # [500, episodes, 17]
    assert s.shape[0] == 500
    dist = (s[..., 0:3] - torch.tensor(task_cfg.target, dtype=torch.float64)).norm(dim=-1)
    w, x, y = s[..., 3], s[..., 4], s[..., 5]
    body_z_up = 1 - 2 * (x * x + y * y)  # world z component of the body z axis
    tilt = torch.rad2deg(torch.acos(body_z_up.clamp(-1, 1)))
    over_5cm = dist[-200:].mean(0) >= 0.05
    over_10deg = tilt[-200:].amax(0) >= 10.0
    stayed = dist.amax(0) <= 1.0
    assert stayed.all()
    assert np.array_equal(res.success, (stayed & ~over_5cm & ~over_10deg).numpy())
    assert (res.error_failures, res.tilt_failures) == (int(over_5cm.sum()), int(over_10deg.sum()))


def test_an_episode_that_leaves_the_ball_counts_as_failed_from_then_on():
    """Full thrust on every rotor climbs out of the 1 m ball within ~1 s: every episode fails, and
    its position error is finite (within 1 m) up to the step it left and NaN from that step on. The
    ball's radius is 1 m, read from the simulator states rather than the evaluation's own constant:
    the last state inside is within 1 m, and one more period at its speed would take it beyond (the
    state that left is not seen: the episode resets in that step)."""
    policy, rec = ckpt.load_policy(PRETRAINED)
    task_cfg, _ = to_objects(OmegaConf.create(rec["config"]))
    states = []  # every step's simulator state, read through the evaluation's frame hook
    res = evaluate_hover(lambda obs: torch.ones(len(obs), 4), task_cfg, episodes=20,
                         frames_cb=lambda env, t: states.append(env.backend.state.clone()))
    assert res.left_ball == 20 and res.success_rate == 0.0 and not res.success.any()
    assert res.error_failures == res.tilt_failures == 0  # counted among the episodes that stayed
    err = res.position_error  # [T, episodes]
    s = torch.stack(states).double()
    dist = (s[..., POS] - torch.tensor(task_cfg.target, dtype=torch.float64)).norm(dim=-1)
    speed = s[..., VEL].norm(dim=-1)  # m/s, world
    for k in range(20):
        gone = np.isnan(err[:, k])
        first = int(np.argmax(gone))
        assert gone[first:].all() and not gone[:first].any() and 0 < first < 150, (k, first)
        assert err[first - 1, k] <= 1.0
        inside, step = float(dist[first - 1, k]), float(speed[first - 1, k]) * POLICY_PERIOD
        assert (dist[:first, k] <= 1.0).all() and inside + 1.2 * step > 1.0, (k, first, inside, step)
    assert np.isnan(res.mean_final_error) and np.isnan(res.common_offset).all()


def test_simulators_evaluated_at_once_give_the_sequential_results(tmp_path, monkeypatch):
    """MuJoCo and PyBullet evaluate in two forked processes while torch runs here: every episode's
    outcome and error trace equals the one of a run in this process."""
    import policies.evaluate as evaluation

    policy, rec = ckpt.load_policy(PRETRAINED)
    task_cfg, _ = to_objects(OmegaConf.create(rec["config"]))
    real, log = evaluation.evaluate, tmp_path / "pids.log"

    def evaluate(*args, backend=None, **kwargs):
        start = time.time()
        res = real(*args, backend=backend, **kwargs)
        with log.open("a") as f:
            f.write(f"{backend} {os.getpid()} {start} {time.time()}\n")
        return res

    monkeypatch.setattr(evaluation, "evaluate", evaluate)
    seeds = {"torch": 3, "mujoco": 4, "pybullet": 5}
    together = evaluate_backends(policy, task_cfg, 12, seeds)
    runs = {b: (int(pid), float(t0), float(t1)) for b, pid, t0, t1 in map(str.split, log.read_text().splitlines())}
    assert runs["torch"][0] == os.getpid() and len({runs[b][0] for b in seeds}) == 3
    (_, mujoco_start, mujoco_end), (_, pybullet_start, pybullet_end) = runs["mujoco"], runs["pybullet"]
    assert mujoco_start < pybullet_end and pybullet_start < mujoco_end, runs  # at the same time
    assert list(together) == list(seeds)
    for backend, seed in seeds.items():
        alone = evaluate_hover(policy, task_cfg, 12, backend, seed)
        assert together[backend].backend == backend
        assert (together[backend].success == alone.success).all()
        assert np.array_equal(together[backend].position_error, alone.position_error, equal_nan=True), backend


ORPHANS = """import multiprocessing, sys, threading, time
sys.path.insert(0, {root!r})
from omegaconf import OmegaConf
from policies import checkpoint as ckpt
from policies.config import to_objects
from policies.evaluate import evaluate_backends

policy, rec = ckpt.load_policy({pretrained!r})
task_cfg, _ = to_objects(OmegaConf.create(rec["config"]))


def report():
    while len(multiprocessing.active_children()) < 2:
        time.sleep(0.05)
    print(*[p.pid for p in multiprocessing.active_children()], flush=True)


threading.Thread(target=report, daemon=True).start()
evaluate_backends(policy, task_cfg, 1000, {{"mujoco": 1, "pybullet": 2}})
"""


def test_simulators_evaluated_at_once_die_with_a_killed_parent(tmp_path):
    """kill -9 of the process confirming a pass (the trainer) kills its MuJoCo and PyBullet evaluations too:
    left running, they held the run's lock and blocked on their result pipes for good (no resume)."""
    script = tmp_path / "orphans.py"
    script.write_text(ORPHANS.format(root=str(ROOT), pretrained=str(PRETRAINED)))
    parent = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE, text=True)
    try:
        children = [int(pid) for pid in parent.stdout.readline().split()]
    finally:
        parent.kill()
        parent.wait()
    assert len(children) == 2

    def alive(pid: int) -> bool:
        try:
            return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"  # a zombie is dead
        except FileNotFoundError:
            return False

    deadline = time.monotonic() + 5.0
    while any(map(alive, children)) and time.monotonic() < deadline:
        time.sleep(0.05)
    left = [pid for pid in children if alive(pid)]
    for pid in left:  # not to outlive the test
        os.kill(pid, signal.SIGKILL)
    assert not left, left


@pytest.mark.parametrize("slow", ["mujoco", "pybullet"])
@pytest.mark.parametrize("rates, kept", [
    ({"torch": 0.99, "pybullet": 0.50, "mujoco": 0.99}, ["torch", "pybullet"]),
    ({"torch": 0.99, "pybullet": 0.99, "mujoco": 0.50}, ["torch", "pybullet", "mujoco"]),
    ({"torch": 0.50, "pybullet": 0.99, "mujoco": 0.99}, ["torch"]),
])
def test_simulators_evaluated_at_once_stop_where_a_sequential_run_would(monkeypatch, rates, kept, slow):
    """Scripted success rates, bar 0.95: the result holds torch first, then the simulators in the
    order asked, up to the first that falls short, whichever process finishes first (``slow``'s
    evaluation takes 1 s longer)."""
    import dataclasses

    import policies.evaluate as evaluation

    policy, rec = ckpt.load_policy(PRETRAINED)
    task_cfg, _ = to_objects(OmegaConf.create(rec["config"]))
    real = evaluation.evaluate

    def evaluate(*a, backend=None, **k):
        res = dataclasses.replace(real(*a, backend=backend, **k), success_rate=rates[backend])
        time.sleep(1.0 if backend == slow else 0.0)
        return res

    monkeypatch.setattr(evaluation, "evaluate", evaluate)
    res = evaluate_backends(policy, task_cfg, 4, {"pybullet": 1, "torch": 2, "mujoco": 3}, stop_below=0.95)
    assert list(res) == kept
    assert [r.success_rate for r in res.values()] == [rates[b] for b in kept]


def test_eval_command_writes_results_plot_and_video(tmp_path):
    """`python -m policies.eval <run> backend=mujoco video=true` with fewer episodes than the video
    shows by default: the JSON of the printed result, the error plot and a GIF of both episodes."""
    import imageio.v2 as imageio
    from PIL import Image

    run = tmp_path / "run"
    (run / "checkpoints").mkdir(parents=True)
    (run / "checkpoints/best.pt").write_bytes((PRETRAINED / "checkpoints/best.pt").read_bytes())
    cmd = [sys.executable, "-m", "policies.eval", str(run), "backend=mujoco", "episodes=2", "video=true"]
    r = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300,
                       env={**os.environ, "MUJOCO_GL": os.environ.get("MUJOCO_GL", "egl")})
    assert r.returncode in (0, 1) and "Traceback" not in r.stderr, r.stderr
    res = json.loads((run / "eval_mujoco_episodes2.json").read_text())
    assert res["episodes"] == 2 and res["backend"] == "mujoco" and f"{res['success_rate'] * 100:.1f}%" in r.stdout
    assert (run / "eval_mujoco_episodes2_error.png").stat().st_size > 10_000
    frames = imageio.mimread(run / "eval_mujoco_episodes2.gif")
    assert len(frames) == 167 and frames[0].shape[:2] == (120, 2 * 160), (len(frames), frames[0].shape)
    assert np.ptp(frames[0]) > 0, "a rendered scene, not a blank image"
    gif = Image.open(run / "eval_mujoco_episodes2.gif")
    gif.seek(1)
    assert gif.info["duration"] == 30, "every third 10 ms step: real time"

    r = subprocess.run([sys.executable, "-m", "policies.eval", str(run), "episodes=0"], cwd=ROOT,
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and r.stderr.strip() == "error: episodes=0: expected at least 1", r.stderr


def test_arm_video_ends_each_episode_on_its_last_state():
    """policies.eval's arm video: an episode that ended keeps the frame of its last state (rendered
    before the env resets), not the one of the step before. The policy moves the hand up and down
    by 2 cm every step, so consecutive frames differ until the time limit ends both episodes."""
    os.environ.setdefault("MUJOCO_GL", "egl")
    from policies.eval import ARM_VIDEO_PX, arm_video
    from policies.evaluate import evaluate_success
    from sim.registry import get_task

    cfg = get_task("arm_reach").default_config()
    frames, frames_cb, on_episode_end = arm_video(episodes=2)

    def bob(obs: torch.Tensor) -> torch.Tensor:  # TCP z (obs 16) about 0.25 m
        a = torch.zeros(len(obs), 5)  # [dx, dy, dz, dyaw, gripper]
        a[:, 2] = torch.where(obs[:, 16] < 0.25, 1.0, -1.0)
        return a

    last_states = []

    def end(env, idx):  # what the simulator shows before the reset
        last_states.append([env.render(i, depth=False, size=ARM_VIDEO_PX)["rgb"] for i in idx])
        on_episode_end(env, idx)

    res = evaluate_success(bob, cfg, episodes=2, frames_cb=frames_cb, on_episode_end=end)
    assert res.success_rate == 0.0 and len(frames) == cfg.episode_steps and len(last_states) == 1
    assert np.array_equal(frames[-1], np.concatenate(last_states[0], axis=1))
    assert not np.array_equal(frames[-1], frames[-2]), "the last step's motion is in the video"


def test_a_manipulation_evaluation_records_the_goal_distance_of_each_step():
    """evaluate_success keeps the task's goal distance after every step of each episode (the plot
    policies.eval draws): the value of the step's own state, the last one before the reset. The hand
    moves up to 2 cm every step, so a value one step stale or taken after the reset would differ."""
    from policies.evaluate import evaluate_success
    from sim.registry import get_task

    cfg = get_task("arm_reach").default_config()

    def bob(obs: torch.Tensor) -> torch.Tensor:  # TCP z (obs 16) about 0.25 m
        a = torch.zeros(len(obs), 5)
        a[:, 2] = torch.where(obs[:, 16] < 0.25, 1.0, -1.0)
        return a

    at_end = {}

    def end(env, idx):  # before the reset
        at_end.update(zip(idx.tolist(), env.goal_distance()[idx].tolist()))

    res = evaluate_success(bob, cfg, episodes=3, on_episode_end=end)
    d = res.goal_distance
    assert d.shape == (cfg.episode_steps, 3) and np.isfinite(d).all() and res.success_radius == cfg.success_radius
    assert sorted(at_end) == [0, 1, 2]
    np.testing.assert_allclose(d[-1], [at_end[i] for i in range(3)], rtol=1e-6)
    assert (np.abs(d[-1] - d[-2]) > 1e-4).all(), "the step before holds another distance: staleness would show"


def test_an_evaluation_closes_its_simulator():
    """Every PyBullet evaluation disconnects its physics client, also when it fails midway (each
    held a world of vehicles until the process ended; the closed-loop benchmark opened one per
    batch). Compared with the clients open before, which other tests in this process may hold."""
    import pybullet as p

    def connected() -> set[int]:
        return {i for i in range(64) if p.isConnected(physicsClientId=i)}

    policy, rec = ckpt.load_policy(PRETRAINED)
    task_cfg, _ = to_objects(OmegaConf.create(rec["config"]))
    before = connected()
    for seed in range(3):
        evaluate_hover(policy, task_cfg, episodes=4, backend="pybullet", seed=seed)
    assert connected() == before

    def crash(env, t):
        assert len(connected()) == len(before) + 1  # the evaluation's own client is open here
        raise RuntimeError("a frame callback fails")

    with pytest.raises(RuntimeError, match="frame callback"):
        evaluate_hover(policy, task_cfg, episodes=4, backend="pybullet", frames_cb=crash)
    assert connected() == before
