"""Manipulation pillar end to end with tiny budgets: demonstrations on disk, diffusion behaviour
cloning, DSRL (both variants) on a frozen base, perception in the loop, ONNX export, clear errors."""

from __future__ import annotations

import copy
import hashlib
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from omegaconf import OmegaConf
from torch import nn

from policies import checkpoint as ckpt
from policies import dataset as ds
from policies.config import UserError, compose_config, to_objects
from policies.dsrl import DSRL
from policies.normalizer import RunningNorm
from sim.arm.base import ACT_DIM, CRITIC_DIM, POLICY_DIM
from sim.registry import get_task

ROOT = Path(__file__).resolve().parents[1]
FAST = ["progress=false", "threads=1", "eval_episodes=4"]


def cli(module: str, *args: str, timeout: float = 300) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", module, *args], cwd=ROOT, capture_output=True, text=True,
                          timeout=timeout)


def sha(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


@pytest.fixture(scope="module")
def demos(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("demos") / "push"
    r = cli("policies.collect", "task=arm_push", "episodes=6", "noise=0.2", "num_envs=6", f"out={out}", "progress=false")
    assert r.returncode == 0, r.stderr
    return out


@pytest.fixture(scope="module")
def base_run(demos, tmp_path_factory) -> Path:
    run = tmp_path_factory.mktemp("bc") / "base"
    r = cli("policies.train", "task=arm_push", "algo=diffusion_bc", f"dataset={demos}", "algo.gradient_steps=200",
            "algo.updates_per_iteration=50", "algo.eval_every_updates=200", f"run_dir={run}", *FAST)
    assert r.returncode == 0, r.stdout + r.stderr
    return run


def test_dataset_round_trip(demos):
    d = ds.load(demos, task="arm_push", obs_dim=POLICY_DIM, act_dim=ACT_DIM)
    assert d.num_episodes == 6 and d.meta["expert_noise"] == 0.2 and d.meta["format"] == ds.FORMAT
    assert len(d.obs) == len(d.critic) == len(d.action) == d.episode_ends[-1]
    assert d.obs.dtype == np.float32 and d.critic.shape[1] == CRITIC_DIM
    ok = d.episode_success()
    assert ok.sum() == d.meta["successes"] >= 5, "the expert succeeds at noise 0.2"
    for s, success in zip(d.episode_slices(), ok):
        # sparse reward with termination: reward 1 exactly at the last step of a successful episode
        assert d.reward[s].sum() == float(success) and (d.reward[s][-1] == 1.0) == success
        assert d.terminal[s][-1] == success and not d.terminal[s][:-1].any()
    assert d.meta["seed"] == 0 and d.meta["num_envs"] == 6  # what fixes the dataset, both recorded
    steps = get_task("arm_push").default_config().episode_steps
    for s in d.episode_slices():  # each row holds the observation its action was taken from (critic 43: t / T)
        np.testing.assert_allclose(d.critic[s][:, 43], np.arange(s.stop - s.start) / steps, atol=1e-6)
    chunks = d.action_chunks(4)
    last = d.episode_ends[0] - 1
    assert np.array_equal(chunks[last], np.repeat(d.action[last][None], 4, 0)), "chunks never cross an episode"
    assert np.array_equal(chunks[0], d.action[:4])
    with pytest.raises(ds.DatasetError, match="holds 'arm_push' demonstrations"):
        ds.load(demos, task="arm_pick_place")
    with pytest.raises(ds.DatasetError, match="no dataset at"):
        ds.load(demos.parent / "missing")


def test_dataset_save_load_is_exact_with_images(tmp_path):
    """What policies.collect gathers is what the dataset gives back, array for array and dtype for
    dtype, the optional camera images included, episodes in the order they started."""
    from policies.collect import collect

    cfg = compose_config(["task=arm_reach", "task.camera=depth", "task.image_size=64"])
    task_cfg, _ = to_objects(cfg)
    eps, period = collect(task_cfg, episodes=3, noise=0.3, seed=1, num_envs=2, progress=False)
    ds.save(tmp_path / "d", eps, {"task": "arm_reach", "expert_noise": 0.3, "control_period_s": period})
    d = ds.load(tmp_path / "d", task="arm_reach", obs_dim=POLICY_DIM, act_dim=ACT_DIM)
    assert d.num_episodes == 3 and d.image is not None and d.image.shape[1:] == (1, 64, 64)
    for ep, s in zip(eps, d.episode_slices()):
        for key, value in ep.items():
            got = getattr(d, key)[s]
            assert got.dtype == value.dtype and np.array_equal(got, value), key
    assert d.image.any(), "rendered depth, not a blank"


def test_collect_keeps_the_first_episodes_to_start_not_to_finish(monkeypatch):
    """The kept episodes are the first ones by start (step, env), whatever their length: the first to
    finish would be the short ones. With successful_only and an expert that cannot succeed, one line."""
    from policies.collect import collect
    from sim.arm.push import ArmPushEnv

    log, clock = [], [0]
    init, step = ArmPushEnv.__init__, ArmPushEnv.step

    def logged_init(self, *a, **k):
        init(self, *a, **k)
        self.on_episode_end = lambda env, idx: log.extend(((clock[0] + 1 - int(env.t[i]), int(i)), int(env.t[i]))
                                                          for i in idx)

    def counted_step(self, a):
        out = step(self, a)
        clock[0] += 1
        return out

    monkeypatch.setattr(ArmPushEnv, "__init__", logged_init)
    monkeypatch.setattr(ArmPushEnv, "step", counted_step)
    task_cfg, _ = to_objects(compose_config(["task=arm_push", "task.expert_worse_share=0.5"]))
    eps, _ = collect(task_cfg, episodes=12, noise=0.2, seed=0, num_envs=6, progress=False)
    by_start = [length for _, length in sorted(log)][:12]
    assert [len(ep["action"]) for ep in eps] == by_start
    assert by_start != [length for _, length in log][:12], "finishing order would have kept other episodes"
    # Many envs for one episode: the short ones pile up while the first runs on, which is no failure.
    assert len(collect(task_cfg, episodes=1, noise=0.2, seed=0, num_envs=48, progress=False)[0]) == 1
    task_cfg.episode_steps = 3  # too short to succeed
    with pytest.raises(UserError, match="the expert succeeded in 0 of 120 episodes"):
        collect(task_cfg, episodes=1, noise=0.0, seed=0, num_envs=6, successful_only=True, progress=False)


def test_damaged_datasets_are_one_error_line(demos, tmp_path):
    import shutil

    for damage, message in ((lambda d: (d / "meta.json").write_text("{not json"), "meta.json is not readable JSON"),
                            (lambda d: (d / "data.npz").write_bytes((d / "data.npz").read_bytes()[:500]),
                             "data.npz is damaged")):
        d = tmp_path / message.split()[0]
        shutil.copytree(demos, d)
        damage(d)
        with pytest.raises(ds.DatasetError, match=message):
            ds.load(d)
        r = cli("policies.train", "task=arm_push", "algo=diffusion_bc", f"dataset={d}", f"run_dir={tmp_path / 'r'}",
                *FAST)
        assert r.returncode == 2 and message in r.stderr and "Traceback" not in r.stderr, r.stderr
    (tmp_path / "a_file").write_text("")
    r = cli("policies.collect", "task=arm_reach", "episodes=1", f"out={tmp_path / 'a_file'}", "progress=false")
    assert r.returncode == 2 and "cannot write a dataset" in r.stderr and "Traceback" not in r.stderr, r.stderr
    # An existing dataset (or any directory with files) is never collected over; bad values are named, up front.
    before = {f.name: f.read_bytes() for f in demos.iterdir()}
    for args, message in (([f"out={demos}"], f"out={demos} is not empty (data.npz, meta.json): datasets are never "
                           "written over; give another out= or delete it"),
                          (["noise=-1", f"out={tmp_path / 'new'}"], "noise=-1.0: expected >= 0"),
                          (["episodes=0", f"out={tmp_path / 'new'}"], "episodes=0: expected at least 1"),
                          (["num_envs=0", f"out={tmp_path / 'new'}"], "num_envs=0: expected at least 1")):
        r = cli("policies.collect", "task=arm_push", "episodes=1", *args, "progress=false")
        assert r.returncode == 2 and message in r.stderr and len(r.stderr.strip().splitlines()) == 1, r.stderr
    assert {f.name: f.read_bytes() for f in demos.iterdir()} == before and not (tmp_path / "new").exists()
    r = cli("policies.collect", "task=quad_hover", "episodes=1", f"out={tmp_path / 'new'}", "progress=false")
    assert r.returncode == 2 and r.stderr.strip() == (  # the quadrotor tasks have no scripted expert
        "error: policies.collect rolls out a scripted expert, which task quad_hover has none of (the tasks with "
        "one: arm_pick_place, arm_push, arm_reach)"), r.stderr


def test_dataset_arrays_that_disagree_with_their_episode_ends_are_refused(demos, tmp_path):
    """Episode ends that do not increase, or an image array of another length than the steps, are one
    error at load (a hand-merged dataset), not misaligned training data."""
    import shutil

    with np.load(demos / "data.npz") as z:
        arrays = {k: z[k] for k in z.files}
    ends = arrays["episode_ends"]
    for name, edit, message in (
            ("order", {"episode_ends": ends[[1, 0, *range(2, len(ends))]]}, "episode ends are not increasing"),
            ("images", {"image": np.zeros((int(ends[-1]) - 1, 1, 8, 8), np.uint8)}, "do not hold the"),
    ):
        d = tmp_path / name
        shutil.copytree(demos, d)
        np.savez(d / "data.npz", **{**arrays, **edit})
        with pytest.raises(ds.DatasetError, match=message):
            ds.load(d)
    first = ds.load(demos).first(2)
    assert first.meta["steps"] == len(first.obs) == int(ends[1]) and first.meta["episodes"] == 2


def test_the_bc_ema_forgets_its_random_initial_weights_within_its_warm_up(demos):
    """The first update's average takes 90 % of the trained weights (decay (1 + 0) / (10 + 0)), not
    0.5 % (the 0.995 of later updates): an early evaluation is not of the random initial network."""
    from policies.diffusion import DiffusionBC

    cfg = compose_config(["task=arm_push", "algo=diffusion_bc", f"algo.dataset={demos}",
                          "algo.updates_per_iteration=1"])
    task_cfg, algo_cfg = to_objects(cfg)
    env = get_task("arm_push").env_cls(task_cfg, 1, seed=0)
    bc = DiffusionBC(algo_cfg, env, torch.device("cpu"), seed=0)
    before = [p.detach().clone() for p in bc.model.parameters()]
    assert all(torch.equal(a, b) for a, b in zip(before, bc.actor.parameters()))
    bc.train_iteration()
    moved = max((p - b).abs().max().item() for b, p in zip(before, bc.model.parameters()))
    assert moved > 1e-4, "the update did not move the model: the average's weight cannot show"
    for b, p, pe in zip(before, bc.model.parameters(), bc.actor.parameters()):
        assert torch.allclose(pe - b, 0.9 * (p - b), atol=1e-7)
    env.close()


def test_diffusion_bc_run(base_run, demos):
    """A diffusion_bc run's best policy is a DiffusionPolicy that learned its demonstrations, observation to
    action: from w = 0 its chunks are closer to the experts' than any observation-blind answer can be, the best
    constant chunk (the per-component median) and the same policy fed another row's observation. (Measured
    for 200 gradient steps on 6 episodes, seeds 0-2: 0.21-0.24 mean absolute error, against 0.31-0.32 for the
    median chunk and 0.37-0.39 shuffled; an untrained network's clipped chunks, the old reference, are at 1.06.)"""
    rec = ckpt.load(base_run / ckpt.BEST)
    assert rec["policy_class"] == "DiffusionPolicy" and rec["config"]["algo"]["name"] == "diffusion_bc"
    policy, _ = ckpt.load_policy(base_run)
    obs = torch.zeros(3, POLICY_DIM)
    w = torch.randn(3, policy.latent_dim)
    assert policy(obs, w).shape == (3, 4, ACT_DIM) and torch.equal(policy(obs, w), policy(obs, w))
    d = ds.load(demos, task="arm_push", obs_dim=POLICY_DIM, act_dim=ACT_DIM)
    obs, want = torch.as_tensor(d.obs), torch.as_tensor(d.action_chunks(4))
    with torch.no_grad():
        zero = torch.zeros(len(obs), policy.latent_dim)
        err = (policy(obs, zero) - want).abs().mean().item()
        constant = (want - want.median(0).values).abs().mean().item()
        shuffled = (policy(obs[torch.randperm(len(obs), generator=torch.Generator().manual_seed(0))], zero)
                    - want).abs().mean().item()
    assert err < 0.8 * constant and err < 0.7 * shuffled, (err, constant, shuffled)


def test_bc_needs_a_matching_dataset(demos, tmp_path):
    r = cli("policies.train", "task=arm_pick_place", "algo=diffusion_bc", f"algo.dataset={demos}",
            f"run_dir={tmp_path / 'r'}", *FAST)
    assert r.returncode == 2 and "holds 'arm_push' demonstrations" in r.stderr and "Traceback" not in r.stderr
    # The same floats from another source of the cube pose: a policy labelled perception but trained on
    # the simulator's cube (or the reverse) would be exported and deployed with the wrong input.
    r = cli("policies.train", "task=arm_push", "algo=diffusion_bc", f"algo.dataset={demos}",
            "task.obs_source=perception", f"run_dir={tmp_path / 'p'}", *FAST)
    assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr
    assert "collected with task.obs_source=state, this run has task.obs_source=perception" in r.stderr
    assert not (tmp_path / "p" / "checkpoints").exists()


def test_bc_keeps_to_its_budget_and_refuses_a_changed_dataset_on_resume(demos, tmp_path):
    """gradient_steps that are no multiple of updates_per_iteration: the run stops at the budget, its
    cosine learning rate at 0 (it used to train on, the rate climbing again). A resume after the
    dataset was collected again is refused; ema_decay=1 (an EMA that never moves) is refused."""
    import shutil

    data, run = tmp_path / "data", tmp_path / "bc"
    shutil.copytree(demos, data)
    r = cli("policies.train", "task=arm_push", "algo=diffusion_bc", f"dataset={data}", "algo.gradient_steps=150",
            "algo.updates_per_iteration=100", "algo.eval_every_updates=100", f"run_dir={run}", *FAST)
    assert r.returncode in (0, 1) and "Traceback" not in r.stderr, r.stderr
    state = torch.load(run / ckpt.LAST, weights_only=False)["algo"]
    assert state["updates"] == 150 and state["sched"]["_last_lr"][0] < 1e-9
    shutil.rmtree(data)  # collected again (collect never writes over a dataset)
    r = cli("policies.collect", "task=arm_push", "episodes=3", "noise=0.2", "num_envs=3", f"out={data}", "progress=false")
    assert r.returncode == 0, r.stderr
    r = cli("policies.train", f"resume={run}", "progress=false")  # its checkpoint loads before "nothing to train"
    assert r.returncode == 2 and f"the dataset at {data} changed since this run started" in r.stderr, r.stderr
    assert "Traceback" not in r.stderr
    r = cli("policies.train", "task=arm_push", "algo=diffusion_bc", f"dataset={data}", "algo.ema_decay=1.0",
            f"run_dir={tmp_path / 'ema'}", *FAST)
    assert r.returncode == 2 and "ema_decay 1.0: expected a value in [0, 1)" in r.stderr, r.stderr
    assert not (tmp_path / "ema").exists()


@pytest.mark.parametrize("variant", ["na", "sac"])
def test_the_target_critic_normalises_as_the_critic_does(base_run, variant):
    """The TD target's network uses the critic's current input statistics (it used to lag one
    collect behind, and at the first update used none)."""
    algo = _dsrl(base_run, variant)
    algo.collect()
    seen = []
    td_target = algo.td_target
    algo.td_target = lambda b: seen.append(torch.equal(algo.q_target.obs_norm.mean, algo.q.obs_norm.mean)) or td_target(b)
    algo.update()
    assert seen == [True] and algo.q.obs_norm.mean.abs().sum() > 0


@pytest.mark.parametrize("variant", ["na", "sac"])
def test_dsrl_leaves_the_base_untouched(base_run, tmp_path, variant):
    before = sha(base_run / ckpt.BEST)
    base, _ = ckpt.load_policy(base_run)
    run = tmp_path / variant
    r = cli("policies.train", "task=arm_push", "algo=dsrl", f"algo.variant={variant}", f"algo.base={base_run}",
            "algo.warmup_steps=64", "algo.batch_size=32", "max_env_steps=256", "eval_every_steps=256",
            f"run_dir={run}", *FAST)
    assert r.returncode == 0, r.stdout + r.stderr
    assert sha(base_run / ckpt.BEST) == before, "the base run's checkpoint was modified"
    steered, rec = ckpt.load_policy(run)
    assert rec["policy_class"] == "SteeredDiffusionPolicy"
    frozen = steered.base.state_dict()
    assert frozen.keys() == base.state_dict().keys()
    for k, v in base.state_dict().items():
        assert torch.equal(v, frozen[k]), f"base weight {k} changed"
    trained = torch.load(run / ckpt.LAST, weights_only=False)["algo"]
    assert trained["updates"] > 0, "the run must have updated its actor and critics"


def _replay_rows(run: Path, total: int) -> dict[str, torch.Tensor]:
    """The first ``total`` replay rows of a run whose ring has not wrapped, from its segment files."""
    segments = sorted((run / ckpt.REPLAY).glob("rows_*.pt"))
    rows = [torch.load(p) for p in segments]
    out = {k: torch.cat([r[k] for r in rows]) for k in rows[0]}
    assert all(len(v) == total for v in out.values()), "the segments of an unwrapped ring hold its rows once"
    return out


@pytest.mark.parametrize("n_step", [1, 3])
def test_dsrl_resume_is_exact_and_refuses_a_changed_base(base_run, tmp_path, n_step):
    """DSRL-NA stopped at 128 env steps and resumed to 256 ends where one run to 256 does, bit for
    bit (actor, both critics, buffer; with n_step 3 the decisions pending at the stop too);
    resuming after the base's weights changed is refused."""
    import shutil

    base = tmp_path / "base"
    shutil.copytree(base_run, base)
    common = ["task=arm_push", "algo=dsrl", "algo.variant=na", f"algo.base={base}", "algo.warmup_steps=64",
              "algo.batch_size=32", f"algo.n_step={n_step}", "eval_every_steps=100000", *FAST]
    straight, split = tmp_path / "straight", tmp_path / "split"
    for run, steps in ((straight, 256), (split, 128)):
        r = cli("policies.train", *common, f"max_env_steps={steps}", f"run_dir={run}")
        assert r.returncode in (0, 1) and "Traceback" not in r.stderr, r.stderr  # 1: ended below the success bar
    r = cli("policies.train", f"resume={split}", "max_env_steps=256", "progress=false")
    assert r.returncode in (0, 1) and "Traceback" not in r.stderr, r.stderr
    a, b = (torch.load(run / ckpt.LAST, weights_only=False)["algo"] for run in (straight, split))
    assert a["updates"] == b["updates"] > 0
    for key in ("pi", "q", "qw"):
        assert all(torch.equal(a[key][k], b[key][k]) for k in a[key]), f"{key} diverged after the resume"
    assert a["buffer"]["size"] == b["buffer"]["size"] > 0
    rows_a, rows_b = (_replay_rows(run, d["buffer"]["total"]) for run, d in ((straight, a), (split, b)))
    assert all(torch.equal(v, rows_b[k]) for k, v in rows_a.items())
    assert ("discount" in rows_a) == (n_step > 1) and len(a["pending"]) == len(b["pending"]) == n_step - 1
    assert all(torch.equal(p[k], q[k]) for p, q in zip(a["pending"], b["pending"]) for k in p)
    rec = torch.load(base / ckpt.BEST, weights_only=False)
    first = next(iter(rec["policy"]))
    rec["policy"][first] = rec["policy"][first] + 1e-3
    ckpt.save_atomic(rec, base / ckpt.BEST)
    r = cli("policies.train", f"resume={split}", "max_env_steps=384", "progress=false")
    assert r.returncode == 2 and "Traceback" not in r.stderr
    assert f"the base policy at {base} changed since this DSRL run started" in r.stderr, r.stderr


def _dsrl(base_run: Path, variant: str, overrides=()) -> DSRL:
    cfg = compose_config(["task=arm_push", "algo=dsrl", f"algo.variant={variant}", f"algo.base={base_run}",
                          "algo.warmup_steps=0", "algo.batch_size=128", *overrides])
    task_cfg, algo_cfg = to_objects(cfg)
    env = get_task("arm_push").env_cls(task_cfg, algo_cfg.num_envs, seed=0)
    return DSRL(algo_cfg, env, torch.device("cpu"), 0)


def test_dsrl_never_stores_a_nonfinite_decision(base_run):
    algo = _dsrl(base_run, "sac")
    n = algo.env.num_envs
    algo.env.datas[1].qvel[:] = np.nan  # diverges inside the next decision's first step
    algo.collect()
    assert algo.env.nonfinite_resets == 1 and algo.buffer.size == n - 1 and algo.decisions == n
    assert all(torch.isfinite(v[: algo.buffer.size]).all() for v in algo.buffer.data.values())


@pytest.mark.parametrize("time_out_ends_return", [True, False])
def test_dsrl_starts_every_episode_at_home_as_an_evaluation_does(base_run, time_out_ends_return):
    """An episode that ends inside a chunk is not continued by the chunk's remaining actions: the next
    decision starts a new episode at t = 0, the arm at home and at rest, as evaluation's do. The
    time-outs end their returns as the task says (the arm's do; a task whose don't is bootstrapped from
    the episode's final observation), a failure always."""
    algo = _dsrl(base_run, "na", ["task.episode_steps=22"])
    env, n = algo.env, algo.env.num_envs
    assert n >= 4
    env.time_out_ends_return = time_out_ends_return
    env.t[:3] = [20, 18, 0]  # env 0 ends at the chunk's 2nd step, env 1 at its last, env 2 goes on
    env.datas[3].qpos[env.cube_qadr + 2] = -0.2  # env 3: the cube knocked off the table, a failure at the 1st step
    algo.collect()
    done = float(time_out_ends_return)
    b = algo.buffer.data
    assert env.t[:4].tolist() == [0, 0, 4, 0] and b["done"][:4].tolist() == [done, done, 0.0, 1.0]
    assert b["next_critic"][:2, CRITIC_DIM - 1].tolist() == [1.0, 1.0]  # the final observations: t / T = 1
    home = np.array(env.params.panda.home)
    for i in (0, 1):
        assert np.allclose(env.qpos[i, env.arm_qadr], home) and np.allclose(env.qvel[i, env.arm_dadr], 0.0)
        assert algo.obs["critic"][i, CRITIC_DIM - 1] == 0.0  # the critic's episode clock t / episode_steps
    assert not np.allclose(env.qpos[2, env.arm_qadr], home)


def test_dsrl_n_step_rows_sum_the_one_step_rows(base_run):
    """algo.n_step=3 collects what n_step=1 does and stores, for every decision, the discounted sum
    of its next 3 decisions' rewards with the state after them, cut short where the episode ends
    (here mid-chunk, at different decisions in different envs); decisions whose 3 successors are not
    collected yet stay pending. A decision that reaches a non-finite state is stored by neither; with
    n_step 3 the pending decisions of that env are stored cut short before it."""
    one, three = (_dsrl(base_run, "sac", ["task.reward_type=dense", "task.episode_steps=34", *o])
                  for o in ([], ["algo.n_step=3"]))
    T, n, g = 24, one.env.num_envs, one.cfg.gamma
    assert n <= 8
    for algo in (one, three):  # episode clocks staggered: env e's episodes end at the 2nd step of
        algo.env.t[:] = 32 - 4 * np.arange(n)  # decisions e, e + 9, e + 18 (a new one starts at each decision)
    for _ in range(T):
        one.collect()
        three.collect()
    assert one.buffer.size == T * n and "discount" not in one.buffer.data  # no decision was lost
    rows = {k: v[: T * n].reshape(T, n, *v.shape[1:]) for k, v in one.buffer.data.items()}  # [decision, env]
    assert len({tuple(np.flatnonzero(rows["done"][:, e].numpy())) for e in range(n)}) == n
    expected = []
    for e in range(n):
        for t in range(T):
            m = 1
            while m < 3 and not rows["done"][t + m - 1, e] and t + m < T:
                m += 1
            if m < 3 and not rows["done"][t + m - 1, e]:
                continue  # pending: its successors are not collected yet
            expected.append((t, e, m))
    got = {k: v[: three.buffer.size] for k, v in three.buffer.data.items()}
    assert three.buffer.size == len(expected) == T * n - sum(int(p["open"].sum()) for p in three.pending)
    assert len(three.pending) == 2
    for t, e, m in expected:
        i = (got["obs"] == rows["obs"][t, e]).all(-1).nonzero()[:, 0]
        assert len(i) == 1, "each decision is stored once"
        i, last = i.item(), t + m - 1
        for k in ("critic", "w", "chunk"):
            assert torch.equal(got[k][i], rows[k][t, e]), k
        for k in ("next_obs", "next_critic", "done"):
            assert torch.equal(got[k][i], rows[k][last, e]), k
        assert got["discount"][i] == pytest.approx(g**m)
        ret = sum(g**q * rows["reward"][t + q, e].item() for q in range(m))
        assert got["reward"][i].item() == pytest.approx(ret, rel=1e-5, abs=1e-6)
    # env 1 diverges in its next decision: that decision is never stored; its 2 pending ones are,
    # with the rewards they have summed, bootstrapped from where the diverging decision started
    pending_1 = [(p["obs"][1], p["reward"][1].item(), age) for age, p in enumerate(reversed(three.pending), 1)
                 if p["open"][1]]
    start_1 = (three.obs["policy"][1].clone(), three.obs["critic"][1].clone())
    first_new = three.buffer.size
    three.env.datas[1].qvel[:] = np.nan
    three.collect()
    assert len(pending_1) == 2 and three.env.nonfinite_resets == 1 and three.buffer.size > first_new
    new = {k: v[first_new: three.buffer.size] for k, v in three.buffer.data.items()}
    assert not (new["obs"] == start_1[0]).all(-1).any(), "the diverging decision is not stored"
    for obs, reward, age in pending_1:
        i = (new["obs"] == obs).all(-1).nonzero()[:, 0]
        assert len(i) == 1
        i = i.item()
        assert new["reward"][i].item() == reward and new["discount"][i].item() == pytest.approx(g**age)
        assert torch.equal(new["next_obs"][i], start_1[0]) and torch.equal(new["next_critic"][i], start_1[1])
        assert new["done"][i] == 0
    assert not any(p["open"][1] for p in three.pending)
    assert all(torch.isfinite(v[: three.buffer.size]).all() for v in three.buffer.data.values())


@pytest.mark.parametrize("reward_type, bounds", [("time", (-1.0, 0.0)), ("sparse", (0.0, 1.0)), ("dense", None)])
def test_dsrl_targets_stay_in_the_return_range(base_run, reward_type, bounds):
    """A critic that overestimates (here: its target network's output shifted by +-5) cannot push
    TD targets outside the returns the task can pay."""
    algo = _dsrl(base_run, "sac", [f"task.reward_type={reward_type}"])
    assert algo.return_range == bounds
    for _ in range(4):
        algo.collect()
    batch = algo.buffer.sample(64, torch.Generator().manual_seed(0))
    for shift in (5.0, -5.0):
        with torch.no_grad():
            for net in algo.q_target.nets:
                net[-1].bias.fill_(shift)
        t = algo.td_target(batch)
        if bounds is None:  # dense: no clip, so the shifted critic shows through
            assert (t * shift > 0).any()
        else:
            assert t.min() >= bounds[0] and t.max() <= bounds[1]


@pytest.mark.parametrize("variant", ["na", "sac"])
def test_deployed_bootstrap_noise_is_the_actors_mean(base_run, variant):
    """algo.bootstrap_noise=deployed: the TD target continues with the noise that evaluation and export
    deploy (the steered policy's own noise(), computed there in float64), the same at every call;
    sampled (the default) draws w' ~ pi_w(s') anew at each call."""
    algo = _dsrl(base_run, variant, ["algo.bootstrap_noise=deployed"])
    for _ in range(2):
        algo.collect()
    batch = algo.buffer.sample(32, torch.Generator().manual_seed(0))
    seen = []  # the w' the target continues with: the base's noise input (na), Q's noise input (sac)
    if variant == "na":
        sample = algo.base.sample
        algo.base.sample = lambda obs, w: seen.append(w) or sample(obs, w)
    else:
        forward = algo.q_target.forward
        algo.q_target.forward = lambda x: seen.append(x[:, -algo.latent_dim:]) or forward(x)
    first, second = algo.td_target(batch), algo.td_target(batch)
    with torch.no_grad():
        deployed = algo.actor.noise(batch["next_obs"])
    assert len(seen) == 2 and torch.allclose(seen[0], deployed, atol=1e-4) and torch.equal(first, second)
    assert deployed.abs().max() > 0.01  # (a trained-looking noise, not w = 0 by accident)
    algo.cfg.bootstrap_noise = "sampled"
    assert not torch.equal(algo.td_target(batch), algo.td_target(batch))
    assert not torch.allclose(seen[-1], deployed, atol=1e-2)
    with pytest.raises(Exception, match="algo.bootstrap_noise=mean: expected sampled or deployed"):
        _dsrl(base_run, variant, ["algo.bootstrap_noise=mean"])


@pytest.mark.parametrize("variant", ["na", "sac"])
def test_short_dsrl_run_improves_the_critic_fit(base_run, variant):
    """With gamma = 0 the critic's target is the decision's own reward (dense, the sum over the
    executed chunk): its error on a fixed batch of collected decisions must drop within 300
    updates, for Q(s, w) (DSRL-SAC) and for Q^A(s, a) and the distilled Q^W(s, w) (DSRL-NA)."""
    torch.manual_seed(0)
    algo = _dsrl(base_run, variant, ["task.reward_type=dense", "algo.gamma=0.0"])
    for _ in range(40):
        algo.collect()
    batch = algo.buffer.sample(512, torch.Generator().manual_seed(0))
    a_in = batch["w"] if variant == "sac" else batch["chunk"]

    def error() -> float:
        with torch.no_grad():
            q = algo.q(torch.cat((batch["critic"], a_in), -1)).mean(-1)
            return (batch["reward"] - q).square().mean().item()

    before = error()
    spread = batch["reward"].var().item()
    for _ in range(300):
        m = algo.update()
    after = error()
    assert after < 0.3 * spread < before, f"critic error {before:.3f} -> {after:.3f} (reward variance {spread:.3f})"
    if variant == "na":
        assert m["qw_loss"] < 0.3 * spread, f"Q^W must follow Q^A: loss {m['qw_loss']:.3f}"


class _TiltedCritic(nn.Module):
    """Q(s, w) = slope * sum(w) for both twins: a spurious preference of the size the noise critics
    showed on arm_pick_place (0.004-0.009 between w = 0 and w ~ N(0, I), BENCHMARKS.md)."""

    def __init__(self, latent_dim: int, slope: float):
        super().__init__()
        self.latent_dim, self.slope = latent_dim, slope
        self.unused = nn.Parameter(torch.zeros(()))  # the critic step needs something to differentiate

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q = self.slope * x[:, -self.latent_dim:].sum(-1) + 0.0 * self.unused
        return torch.stack((q, q), -1)


@pytest.mark.parametrize("prior", [True, False])
def test_noise_prior_keeps_the_steering_near_the_base_noise(base_run, prior):
    """Against a critic that prefers large w by a small margin, the entropy-regularised actor
    lowers its temperature (its entropy is above target) and follows the slope most of the way to
    the bound; the prior-regularised one raises it until its KL to N(0, I) is near the target, and
    stays near w = 0. The temperature learns fast here (alpha_lr 3e-2) to show this in 250 updates."""
    torch.manual_seed(0)
    algo = _dsrl(base_run, "sac", [f"algo.noise_prior={prior}", "algo.critic_lr=0", "algo.actor_lr=3e-3",
                                   "algo.alpha_lr=3e-2"])
    for _ in range(4):
        algo.collect()
    algo.q = _TiltedCritic(algo.latent_dim, slope=0.005)
    algo.q_target = copy.deepcopy(algo.q)
    obs = algo.buffer.sample(256, torch.Generator().manual_seed(0))["obs"]
    for _ in range(250):
        m = algo.update()
    with torch.no_grad():
        w = algo.actor.noise(obs).mean().item()  # the deployed (deterministic) noise
    if prior:
        target = algo.latent_dim * algo.cfg.prior_kl_per_dim
        assert w < 0.35 and m["alpha"] > algo.cfg.init_alpha, f"mean w {w:.2f}, alpha {m['alpha']:.4f}"
        assert m["regulariser"] < 2 * target, f"KL {m['regulariser']:.2f} nats, target {target:.2f}"
    else:
        assert w > 0.8 and m["alpha"] < algo.cfg.init_alpha, f"mean w {w:.2f}, alpha {m['alpha']:.4f}"


def test_dsrl_refuses_a_bad_base(tmp_path, run_dir, base_run):
    r = cli("policies.train", "task=arm_push", "algo=dsrl", f"base={tmp_path / 'nowhere'}",
            f"run_dir={tmp_path / 'a'}", *FAST)
    assert r.returncode == 2 and f"{tmp_path / 'nowhere'}: no such run directory" in r.stderr, r.stderr
    assert "Traceback" not in r.stderr
    (tmp_path / "empty").mkdir()
    r = cli("policies.train", "task=arm_push", "algo=dsrl", f"base={tmp_path / 'empty'}",
            f"run_dir={tmp_path / 'a'}", *FAST)
    assert r.returncode == 2 and "Traceback" not in r.stderr
    assert f"{tmp_path / 'empty'} is not a run directory (no config.yaml, no checkpoints/best.pt)" in r.stderr, r.stderr
    r = cli("policies.train", "task=arm_push", "algo=dsrl", f"algo.base={run_dir}", f"run_dir={tmp_path / 'b'}", *FAST)
    assert r.returncode == 2 and "holds a 'Actor' policy; DSRL steers a diffusion policy" in r.stderr
    # ... whatever its networks: a PPO run of another revision is named for its kind, not its layout.
    rec = torch.load(Path(run_dir) / ckpt.BEST, weights_only=False)
    ckpt.save_atomic({**rec, "policy_spec": {**rec["policy_spec"], "hidden": [7]}}, tmp_path / "ppo_old" / ckpt.BEST)
    r = cli("policies.train", "task=arm_push", "algo=dsrl", f"algo.base={tmp_path / 'ppo_old'}",
            f"run_dir={tmp_path / 'b2'}", *FAST)
    assert r.returncode == 2 and "holds a 'Actor' policy; DSRL steers a diffusion policy" in r.stderr, r.stderr
    r = cli("policies.train", "task=arm_pick_place", "algo=dsrl", f"algo.base={base_run}",
            f"run_dir={tmp_path / 'c'}", *FAST)
    assert r.returncode == 2 and "was trained on 'arm_push'" in r.stderr
    r = cli("policies.train", "task=arm_push", "algo=dsrl", f"run_dir={tmp_path / 'd'}", *FAST)
    assert r.returncode == 2 and "algo=dsrl needs algo.base=" in r.stderr
    exec_horizon = torch.load(Path(base_run) / ckpt.BEST, weights_only=False)["policy_spec"]["exec_horizon"]
    for override, expected in (("algo.noise_bound=0", "expected b > 0"), ("algo.utd=-1", "expected > 0 gradient"),
                               (f"max_env_steps={3 * exec_horizon - 1}",  # (with algo.num_envs=3, below)
                                f"max_env_steps={3 * exec_horizon - 1}: less than one iteration of algo=dsrl, "
                                f"{3 * exec_horizon} env steps (algo.num_envs x the base's exec_horizon "
                                f"{exec_horizon})")):
        r = cli("policies.train", "task=arm_push", "algo=dsrl", f"algo.base={base_run}", "algo.num_envs=3", override,
                f"run_dir={tmp_path / 'e'}", *FAST)
        assert r.returncode == 2 and expected in r.stderr and "Traceback" not in r.stderr, (override, r.stderr)
        assert not (tmp_path / "e").exists()
    # A base saved by a revision with other networks: other weight shapes, an unknown constructor
    # argument, a record without its config. One line each from train and eval, nothing written.
    rec = torch.load(Path(base_run) / ckpt.BEST, weights_only=False)
    spec = rec["policy_spec"]
    for name, bad in (("shapes", {**rec, "policy_spec": {**spec, "hidden": spec["hidden"] + 8}}),
                      ("argument", {**rec, "policy_spec": {**spec, "dropout": 0.1}}),
                      ("denoiser", {**rec, "policy_spec": {**spec, "denoiser": "transformer"}}),
                      ("noconfig", {k: v for k, v in rec.items() if k != "config"})):
        old = tmp_path / f"base_{name}"
        ckpt.save_atomic(bad, old / ckpt.BEST)
        r = cli("policies.train", "task=arm_push", "algo=dsrl", f"algo.base={old}", f"run_dir={tmp_path / name}", *FAST)
        expected = "no config in it" if name == "noconfig" else "does not fit this version's networks"
        assert r.returncode == 2 and expected in r.stderr and "Traceback" not in r.stderr, (name, r.stderr)
        assert not (tmp_path / name).exists()
        r = cli("policies.eval", str(old))
        assert r.returncode == 2 and expected in r.stderr and "Traceback" not in r.stderr, (name, r.stderr)
    # A base of an earlier arm contract (the yaw fixed: 28 observation and 4 action floats): one line
    # each from eval and export, nothing written.
    old = tmp_path / "base_v1"
    ckpt.save_atomic({**rec, "policy_spec": {**spec, "obs_dim": 28, "act_dim": 4}}, old / ckpt.BEST)
    for module in ("policies.eval", "policies.export"):
        r = cli(module, str(old))
        assert r.returncode == 2 and "trained on an earlier contract" in r.stderr, (module, r.stderr)
        assert len(r.stderr.strip().splitlines()) == 1 and "Traceback" not in r.stderr, r.stderr
    assert sorted(p.name for p in old.iterdir()) == [ckpt.BEST.split("/")[0]]
    # A base of the same sizes trained on another version of the contract (v2: the arm without Franka's
    # limits) is refused by eval, export and as DSRL's base, one line each.
    assert rec["contract"] == get_task("arm_push").contract.version
    v2 = tmp_path / "base_v2"
    ckpt.save_atomic({**rec, "contract": "arm-ee-delta-v2"}, v2 / ckpt.BEST)
    steer_it = ("policies.train", "task=arm_push", "algo=dsrl", f"algo.base={v2}", f"run_dir={tmp_path / 'v2run'}",
                *FAST)
    for args in (("policies.eval", str(v2)), ("policies.export", str(v2)), steer_it):
        r = cli(*args)
        assert r.returncode == 2 and "trained on contract arm-ee-delta-v2" in r.stderr, (args[0], r.stderr)
        assert len(r.stderr.strip().splitlines()) == 1 and "Traceback" not in r.stderr, r.stderr
    assert not (tmp_path / "v2run").exists() and sorted(p.name for p in v2.iterdir()) == [ckpt.BEST.split("/")[0]]
    # One saved before versions were recorded cannot tell v2 from v3: refused too.
    legacy = tmp_path / "base_legacy"
    ckpt.save_atomic({k: v for k, v in rec.items() if k != "contract"}, legacy / ckpt.BEST)
    r = cli("policies.eval", str(legacy))
    assert r.returncode == 2 and "saved before the contract's version was recorded" in r.stderr, r.stderr
    assert len(r.stderr.strip().splitlines()) == 1 and "Traceback" not in r.stderr, r.stderr


def test_dsrl_benchmarks_refuse_a_run_of_another_kind(tmp_path, run_dir, base_run):
    """The steering benchmarks name the run they need in one line: a base for steerability, a DSRL
    run for the critic (a PPO run, a base or nothing at all given instead)."""
    for module, run, expected in (("benchmarks.steerability", run_dir, "holds a 'Actor' policy"),
                                  ("benchmarks.steerability", tmp_path / "nowhere", "no such run directory"),
                                  ("benchmarks.dsrl_critic", base_run, "is an algo=diffusion_bc run"),
                                  ("benchmarks.dsrl_critic", tmp_path, "expected an algo=dsrl run directory")):
        r = cli(module, str(run), "--no-write")
        assert r.returncode != 0 and expected in r.stderr and "Traceback" not in r.stderr, (module, r.stderr)


def test_manipulation_benchmark_refuses_bad_options_before_running(tmp_path):
    """benchmarks.manipulation checks its options before it collects or trains anything."""
    for args, expected in ((["--methods", "dsrl_sac", "dsrl_sac"], "give each method once"),
                           (["--tasks", "arm_reach", "--worse-share", "0.5"], "only arm_push has a worse operator")):
        r = cli("benchmarks.manipulation", *args, "--work", str(tmp_path), "--no-write")
        assert r.returncode == 2 and expected in r.stderr and "Traceback" not in r.stderr, r.stderr
    assert not any(tmp_path.iterdir())


def test_steered_policy_exports_to_onnx_with_parity(base_run, tmp_path):
    from export.onnx_policy import ContractError, OnnxPolicy
    from sim.arm.contract import CONTRACT as ARM
    from sim.crazyflie.contract import CONTRACT as CRAZYFLIE

    run = tmp_path / "dsrl"
    r = cli("policies.train", "task=arm_push", "algo=dsrl", f"algo.base={base_run}", "algo.warmup_steps=64",
            "algo.batch_size=32", "max_env_steps=128", "eval_every_steps=128", f"run_dir={run}", *FAST)
    assert r.returncode == 0, r.stderr
    with torch.no_grad():  # make the steering non-trivial, so parity covers the actor too
        policy, rec = ckpt.load_policy(run)
        for p in policy.latent.net.parameters():
            p.add_(0.02 * torch.randn(p.shape, generator=torch.Generator().manual_seed(p.numel())))
        ckpt.save_atomic(rec | {"policy": policy.state_dict()}, run / ckpt.BEST)
    r = cli("policies.export", str(run))
    assert r.returncode == 0, r.stdout + r.stderr
    assert "(ok: onnxruntime within" in r.stdout, r.stdout
    onnx = OnnxPolicy(run / "export/policy.onnx", ARM)
    obs = np.load(run / "export/parity_obs.npy")[:200]
    with torch.no_grad():
        ref = policy(torch.as_tensor(obs)).numpy()
        # ... mostly inside the bound, where tanh does not hide the actor's errors (a perturbation of 0.3
        # put 76 % of the noise within 1e-4 of +-1.5)
        w = policy.noise(torch.as_tensor(obs))
        inside = (w.abs() < 0.9 * policy.noise_bound).float().mean().item()
        assert inside > 0.5 and w.std() > 0.3, (inside, w.std())
    got = onnx(obs)
    assert got.shape == (200, 4, ACT_DIM) and np.abs(got - ref).max() < 1e-4
    assert np.abs(ref).max() > 0.3, "parity on a policy that does something"
    # A deployment reads how many of the chunk's actions to execute per query from the metadata.
    assert (onnx.metadata["exec_horizon"], onnx.metadata["pred_horizon"], onnx.metadata["ddim_steps"]) == ("4", "4", "5")
    assert float(onnx.metadata["noise_bound"]) == policy.noise_bound
    with pytest.raises(ContractError, match="takes no noise"):  # the steering actor picks it, not the caller
        onnx(obs, np.zeros((200, policy.base.latent_dim), np.float32))
    with pytest.raises(ContractError, match="another observation/action contract"):
        OnnxPolicy(run / "export/policy.onnx", CRAZYFLIE)


def test_unsteered_base_exports_with_a_noise_input(base_run, tmp_path):
    from export.onnx_policy import ContractError, OnnxPolicy
    from sim.arm.contract import CONTRACT as ARM

    r = cli("policies.export", str(base_run))
    assert r.returncode == 0 and "ok" in r.stdout, r.stdout + r.stderr
    onnx = OnnxPolicy(base_run / "export/policy.onnx", ARM)
    policy, rec = ckpt.load_policy(base_run)
    # An offline run counts gradient steps, and says so in its record and the exported metadata.
    import onnx as onnx_lib
    meta = {p.key: p.value for p in onnx_lib.load(str(base_run / "export/policy.onnx")).metadata_props}
    assert rec["gradient_steps"] == 200 and meta["gradient_steps"] == "200"
    assert "env_steps" not in rec and "env_steps" not in meta
    assert meta["exec_horizon"] == str(policy.exec_horizon) and "noise_bound" not in meta
    assert meta["obs_source"] == "state"  # the cube pose it learned from: the simulator's, not the camera's estimate
    # Observations of closed-loop rollouts (two steps of 100 environments) and random ones around them:
    # the export's own parity set, a smaller draw of another seed; each with a noise of its own
    from policies.export import parity_observations

    task_cfg, _ = to_objects(OmegaConf.create(rec["config"]))
    obs = parity_observations(policy, task_cfg, n=200, seed=1).astype(np.float32)
    assert obs.shape == (400, POLICY_DIM) and np.abs(obs).max() > 0.1
    w = np.random.default_rng(0).standard_normal((len(obs), policy.latent_dim)).astype(np.float32)
    with torch.no_grad():
        ref = policy(torch.as_tensor(obs), torch.as_tensor(w)).numpy()
    assert np.abs(onnx(obs, w) - ref).max() < 1e-4
    with pytest.raises(ContractError, match="pass noise"):
        onnx(obs)
    # A model whose graph disagrees with its chunk metadata (a deployment executes exec_horizon actions per
    # query, and draws pred_horizon x A noise) is refused on load.
    for key, value, says in (("exec_horizon", "8", "does not fit its metadata"),
                             ("pred_horizon", "8", "its metadata's pred_horizon 8")):
        model = onnx_lib.load(str(base_run / "export/policy.onnx"))
        next(p for p in model.metadata_props if p.key == key).value = value
        onnx_lib.save(model, str(tmp_path / f"{key}.onnx"))
        with pytest.raises(ContractError, match=says):
            OnnxPolicy(tmp_path / f"{key}.onnx", ARM)


def test_parity_observations_are_the_same_at_every_export(base_run):
    """The closed-loop half of the parity observations comes from rollouts of a policy that draws its
    own noise: seeded, so an export checks the same observations each time (it used to draw them
    from torch's global generator, and the check's outcome varied from run to run)."""
    from policies.export import parity_observations

    policy, rec = ckpt.load_policy(base_run)
    task_cfg, _ = to_objects(OmegaConf.create(rec["config"]))
    torch.manual_seed(123)
    a = parity_observations(policy, task_cfg, n=400)
    torch.manual_seed(456)
    saved = torch.get_rng_state()
    b = parity_observations(policy, task_cfg, n=400)
    assert np.array_equal(a, b) and torch.equal(torch.get_rng_state(), saved), "the caller's generator is left as it was"


def test_unet_base_trains_and_exports(demos, tmp_path):
    """algo.denoiser=unet through the same trainer and export as the MLP: ONNX parity, chunk metadata."""
    from export.onnx_policy import OnnxPolicy
    from sim.arm.contract import CONTRACT as ARM

    run = tmp_path / "unet"
    r = cli("policies.train", "task=arm_push", "algo=diffusion_bc", f"dataset={demos}", "algo.denoiser=unet",
            "algo.unet_channels=16", "algo.blocks=1", "algo.gradient_steps=100", "algo.updates_per_iteration=50",
            "algo.eval_every_updates=100", f"run_dir={run}", *FAST)
    assert r.returncode == 0, r.stdout + r.stderr
    policy, rec = ckpt.load_policy(run)
    assert rec["gradient_steps"] == 100 and policy.spec["denoiser"] == "unet"
    r = cli("policies.export", str(run))
    assert r.returncode == 0 and "(ok: onnxruntime within" in r.stdout, r.stdout + r.stderr
    onnx = OnnxPolicy(run / "export/policy.onnx", ARM)
    obs = np.load(run / "export/parity_obs.npy")
    # The export's parity rule: onnxruntime no farther from the float64 chunk than float32 PyTorch
    # (2x at the 99.9th percentile of observations, 4x at the worst, or 1e-5), on a policy whose
    # chunks vary; an export off by 1e-3 fails it.
    from policies.export import parity

    res = parity(policy, onnx, obs)
    assert res["onnx_error_q"] <= max(1e-5, 2 * res["torch_error_q"]) and res["ok"], res
    assert res["onnx_error"] <= max(1e-5, 4 * res["torch_error"]), res
    assert res["torch_error"] > 1e-6, "the U-Net's float32 rounding is what the rule allows for"
    assert not parity(policy, lambda *x: onnx(*x) + 1e-3, obs[:500])["ok"]
    # On other noises than the export's check used, as closely as before the rule replaced the tolerance.
    w = np.random.default_rng(0).standard_normal((len(obs), policy.latent_dim)).astype(np.float32)
    with torch.no_grad():
        ref = policy(torch.as_tensor(obs), torch.as_tensor(w)).numpy()
    assert np.abs(onnx(obs, w) - ref).max() < 3e-4 and np.abs(ref).max() > 0.1
    # Steered by a DSRL actor (random here): the export's float64 reference runs the U-Net in float64 too
    # (a float32 noise into it raised "Input type (float) and bias type (double) should be the same").
    from export.onnx_policy import export_onnx
    from policies.dsrl import SteeredDiffusionPolicy

    latent = dict(obs_dim=policy.spec["obs_dim"], act_dim=policy.latent_dim, hidden=[32, 32], activation="relu",
                  init_action=0.0)
    steered = SteeredDiffusionPolicy(policy.spec, latent, noise_bound=1.5)
    steered.base.load_state_dict(policy.state_dict())
    torch.manual_seed(0)
    with torch.no_grad():
        for p in steered.latent.net.parameters():
            p.normal_(0.0, 0.1)
    export_onnx(steered.eval(), tmp_path / "steered.onnx", {"task": "arm_push", "exec_horizon": policy.exec_horizon,
                                                            "pred_horizon": policy.pred_horizon}, ARM)
    res = parity(steered, OnnxPolicy(tmp_path / "steered.onnx", ARM), obs[:500])
    assert res["ok"] and res["torch_error"] > 1e-6, res
    assert onnx.metadata["exec_horizon"] == "4" and onnx.metadata["policy_class"] == "DiffusionPolicy"
    r = cli("policies.train", "task=arm_push", "algo=diffusion_bc", f"dataset={demos}", "algo.denoiser=unet",
            "algo.unet_levels=4", f"run_dir={tmp_path / 'bad'}", *FAST)
    assert r.returncode != 0 and "Traceback" not in r.stderr and "divisible by 2^(unet_levels - 1)" in r.stderr, r.stderr
    assert not (tmp_path / "bad").exists()


def test_policy_runs_from_the_perceived_cube():
    """obs_source=perception: the cube slice of the policy observation is the camera's estimate."""
    from sim.arm.base import CUBE_POS

    cfg = OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(get_task("arm_push").config_cls),
                                              {"obs_source": "perception"}))
    env = get_task("arm_push").env_cls(cfg, 4, seed=3)
    obs, _ = env.reset(seed=3)
    for _ in range(3):
        obs, *_ = env.step(env.expert_action())
    est, true = obs["policy"][:, CUBE_POS], obs["critic"][:, CUBE_POS]
    err = (est - true).norm(dim=-1)
    assert err.max() < 0.01, f"perceived cube {err.tolist()} m from the true one (limit 1 cm)"
    # The estimates themselves (the observation noise alone keeps the simulator's value within 1 cm too)
    assert all(e.ok for e in env.perception.estimates)
    assert torch.equal(est, torch.as_tensor(np.stack([e.position for e in env.perception.estimates]), dtype=est.dtype))
    # A step where environment 1 ends estimates its final cube and then every environment's:
    # five estimates for four environments, not eight.
    calls = []
    estimate = env.perception.estimate
    env.perception.estimate = lambda i: calls.append(i) or estimate(i)
    env.t[1] = env.max_steps - 1
    obs, _, _, truncated, info = env.step(env.expert_action())
    assert truncated.tolist() == [False, True, False, False] and calls == [1, 0, 1, 2, 3], calls
    final = info["final_obs"]
    assert (final["policy"][1, CUBE_POS] - final["critic"][1, CUBE_POS]).norm() < 0.01
    # What a robot has: the sensor's noisy depth and the camera pose it believes (calibrated), never the true
    # pose or the exact render. With an error of 3 cm put into the believed pose, the estimate moves with it.
    seen = []
    camera_info, depth_image = env.camera_info, env.depth_image
    env.camera_info = lambda i, calibrated=True: seen.append(("pose", calibrated)) or camera_info(i, calibrated)
    env.depth_image = lambda i: seen.append(("depth", "sensor")) or depth_image(i)
    before = env.perception.estimate(0)
    assert set(seen) == {("pose", True), ("depth", "sensor")}, seen

    def shifted(i, calibrated=True):
        K, T = camera_info(i, calibrated)
        T = T.copy()
        T[0, 3] += 0.03  # the believed camera 3 cm further along world x
        return K, T

    env.camera_info = shifted
    env.depth_image = lambda i: depth_image(i)
    env.sensor_gen.manual_seed(5)
    a = env.perception.estimate(0)
    env.camera_info = camera_info
    env.sensor_gen.manual_seed(5)
    b = env.perception.estimate(0)
    assert before.ok and a.ok and b.ok
    assert np.allclose(a.position - b.position, [0.03, 0.0, 0.0], atol=1e-5), (a.position, b.position)
    env.perception.estimate = estimate
    # A checkpoint carries the estimates held where none can be made (a lifted or hidden cube).
    env.perception.last[1] += 0.05
    other = get_task("arm_push").env_cls(cfg, 4, seed=4)
    other.load_state_dict(env.state_dict())
    assert np.array_equal(other.perception.last, env.perception.last)
    assert other.perception.failures == env.perception.failures


def test_the_depth_image_and_the_perception_see_the_same_frame(monkeypatch):
    """A depth camera in the observation and obs_source=perception: each env's depth frame is rendered
    once per observation, and the image the policy gets is the frame, with its sensor noise, that the
    cube estimate came from (two renders gave two independent noise draws, at twice the cost)."""
    import sim.arm.perception as perception

    spec = get_task("arm_push")
    cfg = spec.default_config()
    cfg.obs_source, cfg.camera = "perception", "depth"
    env = spec.env_cls(cfg, 2, seed=3)
    env.reset(seed=3)
    seen, renders = [], []
    estimate = perception.estimate_cube_position
    monkeypatch.setattr(perception, "estimate_cube_position",
                        lambda depth, *a, **k: seen.append(depth) or estimate(depth, *a, **k))
    render = env.render
    env.render = lambda i, rgb=True, depth=True, size=None: renders.append((i, depth)) or render(i, rgb, depth, size)
    obs, *_ = env.step(env.expert_action())
    assert renders == [(0, True), (1, True)] and len(seen) == 2
    for i in range(2):
        assert np.array_equal(obs["image"][i, 0].numpy(), seen[i])
    assert not np.array_equal(seen[0], env.render(0, rgb=False)["depth"]), "the sensor's frame, noise and all"


def test_perception_carries_a_grasped_cube_and_ignores_the_goal_marker():
    """arm_pick_place with obs_source=perception along the scripted expert: while the cube is lifted
    (hidden in the gripper) the observed cube moves with the hand, within 1.5 cm of the true one (it
    stayed on the table, ~17 cm off, before the grasp was tracked); on the table the estimate never
    jumps to the goal marker above the pad (27 cm off while the depth image showed the marker)."""
    from sim.arm.base import CUBE_POS

    spec = get_task("arm_pick_place")
    cfg = spec.default_config()
    cfg.obs_source = "perception"
    env = spec.env_cls(cfg, 2, seed=5)
    obs, _ = env.reset(seed=5)
    lifted, table = [], []
    done = np.zeros(2, bool)
    for _ in range(60):
        obs, _, term, trunc, _ = env.step(env.expert_action())
        # what the policy sees is the perception's (the observation noise alone stays within these bounds)
        assert torch.equal(obs["policy"][:, CUBE_POS], torch.as_tensor(env.perception.last, dtype=torch.float32))
        err = (obs["policy"][:, CUBE_POS] - obs["critic"][:, CUBE_POS]).norm(dim=-1).numpy()
        up = obs["critic"][:, CUBE_POS][:, 2].numpy() > env.params.cube.half + 0.005
        done |= (term | trunc).numpy()
        lifted += list(err[up & ~done])
        table += list(err[~up & ~done])
    env.close()
    assert len(lifted) > 20 and max(lifted) < 0.015, (len(lifted), max(lifted, default=None))
    assert max(table) < 0.02, max(table)


def test_eval_runs_a_state_policy_from_the_perceived_cube(base_run, run_dir):
    """policies.eval obs_source=perception: a policy trained on the simulator's cube runs from the
    camera's estimate, its result written beside the state evaluation; refused where it has no
    meaning (a quadrotor run) and for an unknown source, in one line."""
    r = cli("policies.eval", str(base_run), "episodes=2", "obs_source=perception")
    assert r.returncode == 0 and "success" in r.stdout, r.stdout + r.stderr
    import json

    assert json.loads((base_run / "eval_mujoco_perception_episodes2.json").read_text())["obs_source"] == "perception"
    assert (base_run / "eval_mujoco_perception_episodes2_distance.png").stat().st_size > 10_000, "the goal-distance plot"
    r = cli("policies.eval", str(base_run), "episodes=2", "obs_source=camera")
    assert r.returncode == 2 and "obs_source='camera': expected state or perception" in r.stderr
    assert "Traceback" not in r.stderr
    r = cli("policies.eval", str(run_dir), "obs_source=perception")
    assert r.returncode == 2 and "obs_source applies to the manipulation tasks" in r.stderr


def test_eval_runs_a_diffusion_base_from_zero_noise(base_run, run_dir, monkeypatch):
    """policies.eval base_noise=zero: a diffusion base executes the chunks it samples from w = 0 (the
    same for the same observation, unlike its own w ~ N(0, I)); that is the policy evaluated, its result
    in a file of its own that says so; refused for a policy that takes no noise and for an unknown
    value, in one line."""
    import json

    import policies.eval as ev

    base, _ = ckpt.load_policy(base_run)
    obs = torch.randn(5, base.spec["obs_dim"])
    with torch.no_grad():
        zero = ev.with_base_noise(base, "zero")
        assert torch.equal(zero(obs), base(obs, torch.zeros(5, base.latent_dim)))
        assert torch.equal(zero(obs), zero(obs)) and not torch.equal(base(obs), base(obs))
        assert ev.with_base_noise(base, "normal") is base
    evaluated = []
    real = ev.evaluate_success
    monkeypatch.setattr(ev, "evaluate_success", lambda policy, *a, **k: evaluated.append(policy) or real(policy, *a, **k))
    with torch.no_grad():
        assert ev.main([str(base_run), "episodes=2", "base_noise=zero"]) == 0
        assert torch.equal(evaluated[-1](obs), base(obs, torch.zeros(5, base.latent_dim)))
        assert ev.main([str(base_run), "episodes=2"]) == 0
        assert evaluated[-1] is not None and not torch.equal(evaluated[-1](obs), evaluated[-1](obs))
    assert json.loads((base_run / "eval_mujoco_w0_episodes2.json").read_text())["base_noise"] == "zero"
    default = (base_run / "eval_mujoco_episodes2.json").read_text()
    assert "base_noise" not in json.loads(default) and json.loads(default)["seed"] == 12345
    # other episodes go beside the default evaluation, not over it, and say which they were
    zero_default = (base_run / "eval_mujoco_w0_episodes2.json").read_text()
    assert ev.main([str(base_run), "episodes=2", "base_noise=zero", "seed=7"]) == 0
    assert json.loads((base_run / "eval_mujoco_w0_episodes2_seed7.json").read_text())["seed"] == 7
    assert (base_run / "eval_mujoco_w0_episodes2.json").read_text() == zero_default
    assert ev.main([str(base_run), "episodes=2", "seed=7"]) == 0
    assert json.loads((base_run / "eval_mujoco_episodes2_seed7.json").read_text())["seed"] == 7
    assert (base_run / "eval_mujoco_episodes2.json").read_text() == default
    r = cli("policies.eval", str(base_run), "episodes=2", "base_noise=one")
    assert r.returncode == 2 and "base_noise=one: expected normal" in r.stderr and "Traceback" not in r.stderr
    r = cli("policies.eval", str(run_dir), "base_noise=zero")
    assert r.returncode == 2 and "base_noise applies to a diffusion base" in r.stderr and "Traceback" not in r.stderr


def test_eval_under_task_overrides(base_run):
    """policies.eval task.<field>=value: the run's task config with those fields changed, typed by its
    config class, its result in a file of its own that lists them; an unknown field, an ill-typed value,
    a value the env refuses (checked on the overridden config) or another task is one error line."""
    import json

    from policies.eval import override_task

    cfg = get_task("arm_push").default_config()
    new = override_task(cfg, ["task.noise.object_seen_by_camera=true", "task.randomization.max_latency_steps=2"])
    assert new.noise.object_seen_by_camera is True and new.randomization.max_latency_steps == 2
    assert cfg.noise.object_seen_by_camera is False and cfg.randomization.max_latency_steps == 0  # a copy
    r = cli("policies.eval", str(base_run), "episodes=2", "task.noise.object_seen_by_camera=true")
    assert r.returncode == 0 and "success" in r.stdout, r.stdout + r.stderr
    r = cli("policies.eval", str(base_run), "episodes=2", "task.randomization.max_latency_steps=1")
    assert r.returncode == 0, r.stdout + r.stderr
    written = {tuple(json.loads(f.read_text())["task_overrides"])
               for f in base_run.glob("eval_mujoco_overrides-*_episodes2.json")}
    assert written == {("task.noise.object_seen_by_camera=true",), ("task.randomization.max_latency_steps=1",)}, \
        "evaluations under other overrides write files of their own"
    for bad, says in (("task.noise.nope=1", ("override 'task.noise.nope=1'", "Key 'nope' not in 'NoiseConfig'")),
                      ("task.randomization.max_latency_steps=two",
                       ("override 'task.randomization.max_latency_steps=two'", "could not be converted to Integer")),
                      ("task.image_size=10", ("image_size=10: expected 64 .. 96 px",)),
                      ("task.name=arm_reach", ("override 'task.name=arm_reach'", "the task is the run's"))):
        r = cli("policies.eval", str(base_run), "episodes=2", bad)
        assert r.returncode == 2 and all(s in r.stderr for s in says), r.stderr
        assert "Traceback" not in r.stderr


def test_eval_video_of_a_manipulation_policy(base_run):
    """policies.eval video=true on an arm task: a GIF of the first episodes side by side, one frame per
    control step from the front camera until every episode has ended, at the control rate."""
    import imageio.v2 as imageio
    from PIL import Image

    r = cli("policies.eval", str(base_run), "episodes=2", "video=true")
    assert r.returncode == 0 and "video:" in r.stdout, r.stdout + r.stderr
    path = base_run / "eval_mujoco_episodes2.gif"
    frames = imageio.mimread(path)
    assert frames[0].shape[:2] == (160, 2 * 160), frames[0].shape
    assert 10 < len(frames) <= get_task("arm_push").default_config().episode_steps, len(frames)
    assert np.ptp(frames[0]) > 0 and not np.array_equal(frames[0], frames[-1]), "a scene that moves"
    gif = Image.open(path)
    gif.seek(1)
    assert gif.info["duration"] == 50, "20 Hz, as the arm is controlled"


def test_dsrl_na_loads_demonstrations(base_run, demos, monkeypatch):
    """algo.demos: every demonstration becomes decisions of exec_horizon steps in Q^A's buffer,
    an episode's last one ending the return; DSRL-SAC (whose buffer holds noises) refuses them."""
    from policies.config import UserError

    algo = _dsrl(base_run, "na", [f"algo.demos={demos}"])
    d = ds.load(demos)
    per_episode = [-(-(s.stop - s.start) // algo.exec_horizon) for s in d.episode_slices()]
    assert algo.demo_transitions == algo.buffer.size == sum(per_episode)
    done = algo.buffer.data["done"][: algo.buffer.size]
    assert done.sum().item() == d.num_episodes
    assert algo.buffer.data["reward"][: algo.buffer.size].sum().item() == d.episode_success().sum()
    first = algo.buffer.data["chunk"][0].reshape(algo.exec_horizon, -1).numpy()
    assert np.array_equal(first, d.action[: algo.exec_horizon])
    # The critics' normalisers count the demonstrations' rows (Q^A: state and chunk; Q^W: state and a
    # noise of the base's N(0, I)), as collect() counts each collected decision, the target critic's too;
    # the actor's counts their policy observations (its loss and the TD target's next noise use them).
    rows = torch.cat((algo.buffer.data["critic"], algo.buffer.data["chunk"]), -1)[: algo.buffer.size].double()
    eps = RunningNorm(1).count.item()  # the count of a normaliser that has seen nothing
    for norm in (algo.q.obs_norm, algo.q_target.obs_norm, algo.qw.obs_norm, algo.pi.obs_norm):
        assert norm.count.item() == pytest.approx(algo.buffer.size + eps)
    policy_rows = algo.buffer.data["obs"][: algo.buffer.size].double()
    assert torch.allclose(algo.pi.obs_norm.mean, policy_rows.mean(0).to(algo.pi.obs_norm.mean.dtype), atol=1e-4)
    assert torch.allclose(algo.q.obs_norm.mean, rows.mean(0).to(algo.q.obs_norm.mean.dtype), atol=1e-4)
    assert torch.allclose(algo.q_target.obs_norm.mean, algo.q.obs_norm.mean)
    critic_dim = algo.buffer.data["critic"].shape[1]
    assert torch.allclose(algo.qw.obs_norm.mean[:critic_dim], algo.q.obs_norm.mean[:critic_dim])
    # With 3-decision returns: the same decisions, each episode's last 3 ending its return, and
    # each success's reward counted in the 3 decisions up to it, discounted.
    three = _dsrl(base_run, "na", [f"algo.demos={demos}", "algo.n_step=3"])
    b3 = {k: v[: three.buffer.size] for k, v in three.buffer.data.items()}
    g = three.cfg.gamma
    assert three.buffer.size == algo.buffer.size and torch.equal(b3["chunk"], algo.buffer.data["chunk"][: algo.buffer.size])
    assert b3["done"].sum().item() == sum(min(3, k) for k in per_episode) and min(per_episode) >= 3
    assert b3["reward"].sum().item() == pytest.approx(d.episode_success().sum() * (1 + g + g * g), rel=1e-5)
    assert torch.allclose(b3["discount"][b3["done"] == 0], torch.tensor(g**3))
    # a row's next state is the observation 3 decisions (12 steps) on
    first = d.episode_slices()[0]
    assert torch.equal(b3["obs"][0], torch.as_tensor(d.obs[first.start]))
    assert torch.equal(b3["next_obs"][0], torch.as_tensor(d.obs[first.start + 3 * three.exec_horizon]))
    assert torch.equal(b3["next_critic"][1], torch.as_tensor(d.critic[first.start + 4 * three.exec_horizon]))
    with pytest.raises(UserError, match="DSRL-NA only"):
        _dsrl(base_run, "sac", [f"algo.demos={demos}"])
    # A run whose critic also sees the latency refuses demonstrations collected without it.
    latency_critic = CRITIC_DIM + 1 + ACT_DIM
    with pytest.raises(UserError, match=f"privileged observations have {CRITIC_DIM} floats, the task has {latency_critic}"):
        _dsrl(base_run, "na", [f"algo.demos={demos}", "task.randomization.max_latency_steps=1"])
    # Rewards and the critic's time feature must mean what they mean online.
    for override, message in (("task.episode_steps=77", "collected with task.episode_steps="),
                              ("task.reward_type=time", "collected with task.reward_type=sparse"),
                              ("task.terminate_on_success=false", "collected with task.terminate_on_success=True"),
                              ("task.obs_source=perception", "collected with task.obs_source=state")):
        with pytest.raises(UserError, match=message):
            _dsrl(base_run, "na", [f"algo.demos={demos}", override])
    # An episode's last decision ends its return: refused where the task bootstraps its time-outs.
    monkeypatch.setattr(type(algo.env), "time_out_ends_return", False)
    with pytest.raises(UserError, match="bootstraps its time-outs"):
        _dsrl(base_run, "na", [f"algo.demos={demos}"])
    monkeypatch.undo()
    # Resumed after the demonstrations were collected again: refused (their digest is checkpointed).
    state = algo.state_dict()
    algo.load_state_dict(state)  # the same demonstrations: fine
    with pytest.raises(UserError, match="changed since this DSRL run started"):
        algo.load_state_dict({**state, "demos_digest": "0" * 16})


def test_dsrl_na_draws_a_fixed_share_of_each_batch_from_the_demonstrations(base_run, demos):
    """algo.demo_fraction: the demonstrations sit in a buffer of their own and fill that share of
    every batch however large the replay buffer grows; a share outside [0, 1], or one without
    demonstrations, is refused."""
    from policies.config import UserError

    algo = _dsrl(base_run, "na", [f"algo.demos={demos}", "algo.demo_fraction=0.25"])
    assert algo.buffer.size == 0 and algo.demo_buffer.size == algo.demo_transitions > 0
    demo_chunks = algo.demo_buffer.data["chunk"]
    for _ in range(3):
        algo.collect()
    batch = algo._sample_batch()
    from_demos = (batch["chunk"][:, None] == demo_chunks[None]).all(-1).any(-1)
    assert len(from_demos) == 128 and from_demos.sum().item() == 32 and from_demos[-32:].all()
    algo.update()  # the mixed batch trains
    with pytest.raises(UserError, match="demo_fraction"):
        _dsrl(base_run, "na", [f"algo.demos={demos}", "algo.demo_fraction=1.5"])
    with pytest.raises(UserError, match="demo_fraction"):
        _dsrl(base_run, "na", ["algo.demo_fraction=0.5"])


def test_greedy_steering_oracle_restores_the_simulator_and_prefers_progress():
    """benchmarks.steerability's perfect-model oracle: trying candidate chunks (one of which ends an
    episode mid-chunk) leaves every env where it was, so the next steps match those of an env that
    never tried them, bit for bit; and the scripted expert's chunk beats holding still."""
    from benchmarks.steerability import candidate_scores

    def env_after_three_expert_steps(episode_steps: int):
        cfg = get_task("arm_push").default_config()
        cfg.episode_steps = episode_steps
        env = get_task("arm_push").env_cls(cfg, 6, seed=3)
        env.reset(seed=3)
        for _ in range(3):  # leave the initial state, where every env is at rest
            env.step(env.expert_action())
        return env

    env = env_after_three_expert_steps(100)
    expert = env.expert_action().unsqueeze(1).expand(-1, 4, -1)  # (advances the expert's phases)
    best = candidate_scores(env, torch.stack((torch.zeros_like(expert), expert))).argmax(0)  # chunks [K=2, N, H, A] -> [N]
    assert (best == 1).mean() >= 5 / 6, best

    short = env_after_three_expert_steps(5)  # a 4-step chunk from step 3 crosses the episode's end
    twin = env_after_three_expert_steps(5)
    candidate_scores(short, torch.stack((torch.zeros_like(expert), expert)))
    for j in range(4):
        a = expert[:, j]
        (o1, r1, te1, tr1, _), (o2, r2, te2, tr2, _) = short.step(a), twin.step(a)
        for key in ("policy", "critic"):
            assert torch.equal(o1[key], o2[key]), (j, key)
        assert torch.equal(r1, r2) and torch.equal(te1, te2) and torch.equal(tr1, tr2)


def test_expert_chunk_is_the_experts_next_chunk_and_leaves_the_env_in_place():
    """benchmarks.steerability's expert matching compares the base's chunks with the scripted
    expert's own next chunk: the actions an identical env's expert takes over the next steps, and
    simulating them leaves the env where it was (the next steps match the twin's bit for bit)."""
    from benchmarks.steerability import expert_chunk

    def env_after_three_expert_steps():
        env = get_task("arm_push").env_cls(get_task("arm_push").default_config(), 6, seed=3)
        env.reset(seed=3)
        for _ in range(3):
            env.step(env.expert_action())
        return env

    env, twin = env_after_three_expert_steps(), env_after_three_expert_steps()
    chunk = expert_chunk(env, 4)
    assert chunk.shape == (6, 4, ACT_DIM) and chunk[:, :, :3].abs().sum() > 0
    twin.expert()  # expert_chunk advances the expert's phases on the current state first
    for j in range(4):
        a = twin.expert_action()
        assert torch.equal(chunk[:, j], a), j
        (o1, r1, te1, tr1, _), (o2, r2, te2, tr2, _) = env.step(chunk[:, j]), twin.step(a)
        for key in ("policy", "critic"):
            assert torch.equal(o1[key], o2[key]), (j, key)
        assert torch.equal(r1, r2) and torch.equal(te1, te2) and torch.equal(tr1, tr2)


def test_fit_noise_reaches_a_chunk_the_base_can_make_within_the_bound(base_run, demos):
    """benchmarks.steerability's continuous expert matching: from the closest of 16 drawn noises (as the
    benchmark starts it), Adam on w = b tanh(u) through the DDIM sampler moves toward the noise of a
    chunk the base makes from another noise inside the bound, stays inside the bound, and never returns
    a noise worse than its start. The map from noise to chunk is not convex (and flat where DDIM clips
    x0), so some rows end in a local minimum. Until the BC average had a warm-up (2026-11-29) this base
    was 37 % its random initial weights and the fit started from w = 0; on the trained base one of the
    8 rows stopped there at 85 % of its starting error (3.1, against 0.01-0.06 for the others), at
    0.03-8 % from the closest of 16."""
    from benchmarks.steerability import fit_noise

    base, _ = ckpt.load_policy(base_run)
    base.requires_grad_(False)
    gen = torch.Generator().manual_seed(0)
    d = ds.load(demos, task="arm_push")
    obs = torch.as_tensor(d.obs[:: len(d.obs) // 8][:8])  # states the base was trained on
    w_true = (0.8 * torch.randn(8, base.latent_dim, generator=gen)).clamp(-1.2, 1.2)
    target = base(obs, w_true)

    def error(w):
        return (base(obs, w) - target).square().sum((1, 2))

    candidates = torch.randn(16, *w_true.shape, generator=gen)
    start = candidates[torch.stack([error(c) for c in candidates]).argmin(0), torch.arange(len(w_true))]

    w = fit_noise(base, obs, target, start, steps=200, bound=1.5)
    assert w.abs().max() <= 1.5
    assert (error(w) <= error(start)).all()
    ratio = error(w) / error(start)
    assert ratio.median() < 0.05 and error(w).mean() < 0.1 * error(start).mean(), (error(w), error(start))
    zero = torch.zeros_like(w_true)
    far = fit_noise(base, obs, target + 5.0, zero, steps=0, bound=1.5)  # no step: the start itself
    assert torch.equal(far, zero)


def test_rollout_return_pays_the_first_chunk_and_leaves_the_simulator_as_it_was(base_run):
    """benchmarks.dsrl_critic's Monte Carlo return: with gamma = 0 it is the first chunk's summed
    reward (as stepping that chunk gives), envs marked done count 0, and the environment ends in
    the state it started in (so every alternative is rolled out from the same state)."""
    from benchmarks.dsrl_critic import rollout_return

    algo = _dsrl(base_run, "sac", ["task.reward_type=dense"])
    env = algo.env
    for _ in range(3):
        algo.collect()
    obs, n = algo.obs, env.num_envs
    first = algo.base(obs["policy"], torch.randn(n, algo.latent_dim, generator=torch.Generator().manual_seed(1)))
    done = torch.zeros(n, dtype=torch.bool)
    done[0] = True
    before = env.state_dict()
    g0 = rollout_return(env, algo, first, done, gamma=0.0)
    g_half = rollout_return(env, algo, first, done, gamma=0.5)
    after = env.state_dict()
    assert np.array_equal(before["mj"], after["mj"]) and np.array_equal(before["t"], after["t"])
    reward, ended = torch.zeros(n), torch.zeros(n, dtype=torch.bool)
    for j in range(first.shape[1]):
        _, r, term, trunc, _ = env.step(first[:, j])
        reward += torch.where(ended, torch.zeros_like(r), r)
        ended |= term | trunc
    assert g0[0] == 0 and g_half[0] == 0
    torch.testing.assert_close(g0[1:], reward[1:].float())
    assert (g_half[1:] != g0[1:]).all(), "later decisions must add their discounted reward"


def test_noise_chooser_learns_a_ranking_within_each_state():
    """benchmarks.noise_chooser: the target ranks a success (also after some progress) first and a
    failure (also after some progress) last, and is uniform where candidates do not differ; when
    the best noise depends on the observation (score = -|w - obs[:, :d]|^2), the fitted chooser's
    pick on held-out episodes beats w = 0 and a random pick."""
    from benchmarks.noise_chooser import fit, soft_ranking
    from benchmarks.steerability import SUCCESS

    gen = torch.Generator().manual_seed(0)
    n, k, d = 2000, 8, 2
    obs = torch.randn(n, 5, generator=gen)
    w = torch.randn(n, k, d, generator=gen)
    w[:, 0] = 0.0
    score = -((w - obs[:, None, :d]) ** 2).sum(-1)
    target = soft_ranking(torch.cat((score[:2], torch.full((1, k), 0.25))))
    target_terminal = soft_ranking(torch.tensor([[0.1, 0.2, SUCCESS + 0.3, 0.0, 0.4, -SUCCESS + 0.6, 0.2, 0.1]]))
    assert torch.allclose(target.sum(1), torch.ones(3))
    assert target[0].argmax() == score[0].argmax() and torch.allclose(target[2], torch.full((k,), 1 / k))
    assert target_terminal[0].argmax() == 2 and target_terminal[0].argmin() == 5
    _, m = fit(obs, w, score, torch.arange(n) // 20, steps=1500, seed=0)  # 100 "episodes" of 20 states
    assert m["rank"] < 0.5 and m["rank_zero"] > 1.5 and m["rank_random"] > 3.0, m


def test_sac_trains_on_an_arm_task_with_a_camera(tmp_path):
    """SAC learns from the state observations while the env also renders its camera: the steps that end
    an episode (arm_reach: 30 steps, crossed here) store that episode's final state, the images stay out."""
    run = tmp_path / "sac"
    r = cli("policies.train", "task=arm_reach", "algo=sac", "task.camera=rgbd", "algo.num_envs=2",
            "algo.warmup_steps=10", "algo.batch_size=8", "max_env_steps=80", "eval_every_steps=80",
            f"run_dir={run}", *FAST)
    assert r.returncode == 0 and "Traceback" not in r.stderr, r.stderr[-2000:]
    rows = _replay_rows(run, 80)
    assert set(rows) == {"obs", "critic", "action", "reward", "next_obs", "next_critic", "done"}  # no image
    assert rows["obs"].shape[1] == rows["next_obs"].shape[1] == POLICY_DIM and rows["critic"].shape[1] == CRITIC_DIM
    ends = rows["done"] == 1.0
    assert ends.sum() >= 2, "no episode ended: the test crosses none"
    # the observation that ended the episode (its clock t / T > 0), not the next episode's first (0)
    assert (rows["next_critic"][ends, CRITIC_DIM - 1] > 0).all()
    going_on = ~ends[:-2]  # elsewhere the next state is the one the env's next row starts from (2 envs a step)
    assert torch.equal(rows["next_critic"][:-2][going_on], rows["critic"][2:][going_on])
