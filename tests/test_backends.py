"""The MuJoCo and PyBullet backends fly the same Crazyflie as the torch training backend.

Every backend starts from the same state, gets the same motor commands and external wrench,
and must produce the same 1 s trajectory; the optional PyBullet aerodynamic effects are
checked against their models; MuJoCo renders headless.
"""

import math
import os

import numpy as np
import pytest
import torch

from sim.crazyflie.dynamics import OMEGA, POS, QUAT, RPM, VEL, TorchBackend, VehicleBatch, quat_mul, quat_to_rotmat
from sim.crazyflie.mujoco_backend import MujocoBackend
from sim.crazyflie.params import NOMINAL
from sim.crazyflie.pybullet_backend import RPM_TO_RAD_S, PybulletBackend

DT = 0.01  # s, control period
STEPS = 100  # 1 s of flight

# Largest difference to the torch reference (substeps=10, h = 1 ms) over the whole flight.
TOLERANCES = {
    # MuJoCo (RK4, forces at the substep midpoint) matches a float64 RK4 to a few micrometres; what
    # is left is the float32 rounding of the torch state (measured 2.9e-5 m, 2.4e-5 rad, 1e-4 m/s,
    # 3.8e-5 rad/s). ~10x margin: a wrong frame, sign or integration shows up far above (holding the
    # forces at the substep-start attitude alone gives 8.8e-4 m). The rotor model (thrust, rotor positions,
    # yaw signs) is sim/crazyflie/forces.py in every backend, so it cannot differ here: test_physics.py
    # checks it against the parameters per motor.
    MujocoBackend: dict(pos=2.5e-4, angle=2.5e-4, vel=1e-3, omega=5e-4),
    # PyBullet integrates with semi-implicit Euler, read as leapfrog (pybullet_backend.py). Measured
    # 0.13 mm, 9.4e-5 rad, 0.40 mm/s, 1.8e-4 rad/s at h = 1 ms, halving with h: PyBullet's gyroscopic
    # term, from its stored angular velocity, is first order (the two tests after this one). Tolerances
    # allow ~3x that. Its velocities read as they are, half a substep old, gave 0.64 mm, 1.7e-4 rad,
    # 2.4 mm/s and 4.5e-3 rad/s.
    PybulletBackend: dict(pos=4e-4, angle=3e-4, vel=1.2e-3, omega=5e-4),
}


def initial_state(n: int) -> torch.Tensor:
    """1 m up, tilted (roll 0.1, pitch -0.05, yaw 0.3 rad), moving and rotating, rotors at hover."""
    s = torch.zeros(n, 17)
    s[:, POS] = torch.tensor((0.0, 0.0, 1.0))
    half = torch.tensor((0.1, -0.05, 0.3)) / 2
    (cr, cp, cy), (sr, sp, sy) = torch.cos(half), torch.sin(half)
    s[:, QUAT] = torch.stack(
        (cr * cp * cy + sr * sp * sy, sr * cp * cy - cr * sp * sy, cr * sp * cy + sr * cp * sy, cr * cp * sy - sr * sp * cy)
    )
    s[:, VEL] = torch.tensor((0.3, -0.2, 0.1))
    s[:, OMEGA] = torch.tensor((0.3, -0.2, 0.4))
    s[:, RPM] = NOMINAL.hover_rpm
    return s


def vehicles(n: int) -> VehicleBatch:
    """Environment 0 nominal, the others randomized in every field (per-environment parameters)."""
    v = VehicleBatch.nominal(n, NOMINAL)
    v.mass[1:] *= 1.1
    v.inertia[1:] *= torch.tensor((1.1, 0.9, 1.2))
    v.kf[1:] *= 0.95
    v.km[1:] *= 1.2
    v.motor_tau[1:] = 0.1
    v.thrust_scale[1:] = 1.05
    return v


def inputs(k: int, n: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Hover rpm with +-1.5 % per-motor sinusoids (tilts up to ~18 deg), plus a small external wrench."""
    t = k * DT
    freq, phase = torch.tensor((2.1, 2.7, 3.3, 1.9)), torch.tensor((0.0, 1.0, 2.0, 3.0))
    rpm_cmd = NOMINAL.hover_rpm * (1.0 + 0.015 * torch.sin(2 * math.pi * freq * t + phase))
    force_world = torch.tensor((0.01 * math.sin(3 * t), 0.005, -0.003))  # N
    torque_body = torch.tensor((2e-6, -1e-6, 3e-6 * math.cos(2 * t)))  # N m
    return rpm_cmd.repeat(n, 1), force_world.repeat(n, 1), torque_body.repeat(n, 1)


def fly(backend, steps: int = STEPS, vehicle: VehicleBatch | None = None) -> torch.Tensor:
    n = backend.num_envs
    backend.set_state(torch.arange(n), initial_state(n), vehicles(n) if vehicle is None else vehicle)
    return torch.stack([backend.step(*inputs(k, n)).clone() for k in range(steps)])


def max_errors(traj: torch.Tensor, ref: torch.Tensor) -> dict[str, float]:
    traj, ref = traj.double(), ref.double()
    q_ref_conj = ref[..., QUAT] * torch.tensor((1.0, -1.0, -1.0, -1.0), dtype=torch.float64)
    q_err = quat_mul(q_ref_conj, traj[..., QUAT])
    angle = 2 * torch.atan2(q_err[..., 1:].norm(dim=-1), q_err[..., 0].abs())
    return dict(
        pos=(traj[..., POS] - ref[..., POS]).norm(dim=-1).max().item(),
        angle=angle.max().item(),
        vel=(traj[..., VEL] - ref[..., VEL]).norm(dim=-1).max().item(),
        omega=(traj[..., OMEGA] - ref[..., OMEGA]).norm(dim=-1).max().item(),
    )


@pytest.fixture
def make():
    """Backend factory that closes what it made (PyBullet worlds, MuJoCo renderers)."""
    made = []

    def _make(cls, n: int, **kwargs):
        made.append(cls(n, NOMINAL, DT, **kwargs))
        return made[-1]

    yield _make
    for backend in made:
        if hasattr(backend, "close"):
            backend.close()


@pytest.fixture(scope="module")
def reference() -> torch.Tensor:
    return fly(TorchBackend(2, NOMINAL, DT, substeps=10))


@pytest.mark.parametrize("cls", [MujocoBackend, PybulletBackend])
def test_trajectory_matches_torch(cls, make, reference):
    backend = make(cls, 2)
    traj = fly(backend)
    assert traj.shape == reference.shape and traj.dtype == torch.float32
    tilt = torch.acos(1 - 2 * (reference[..., 4] ** 2 + reference[..., 5] ** 2))
    assert 0.1 < tilt.max() < 0.5, "the manoeuvre should tilt the drone clearly but not flip it"
    errors = max_errors(traj, reference)
    for key, tol in TOLERANCES[cls].items():
        assert errors[key] < tol, f"{backend.name} {key} error {errors[key]:.3g} > {tol:.3g} ({errors})"
    assert (traj[..., RPM] - reference[..., RPM]).abs().max() < 0.05  # rpm, float32 rounding of ~1.4e4


def test_training_step_matches_the_reference(reference):
    """The torch backend as training and evaluation run it (QuadTaskConfig.substeps = 1: one RK4
    step per 10 ms policy period) flies the reference (10 RK4 substeps) within MuJoCo's
    tolerances: measured 3.1e-5 m, 2.4e-5 rad, 1.0e-4 m/s, 3.8e-5 rad/s, the float32 rounding
    level (RK4's error at h = 10 ms with motor time constants of 0.05-0.1 s stays below it)."""
    from sim.crazyflie.hover import QuadTaskConfig

    assert QuadTaskConfig().substeps == 1
    traj = fly(TorchBackend(2, NOMINAL, DT, substeps=QuadTaskConfig().substeps))
    errors = max_errors(traj, reference)
    for key, tol in TOLERANCES[MujocoBackend].items():
        assert errors[key] < tol, f"substeps=1 {key} error {errors[key]:.3g} > {tol:.3g} ({errors})"


def test_pybullet_error_is_first_order_integration(make, reference):
    """Halving PyBullet's timestep halves its error: the disagreement is discretization (PyBullet's
    gyroscopic term, next test), not model."""
    coarse = max_errors(fly(make(PybulletBackend, 2, substeps=10)), reference)
    fine = max_errors(fly(make(PybulletBackend, 2, substeps=20)), reference)
    for key in ("pos", "vel", "omega"):
        assert 0.4 < fine[key] / coarse[key] < 0.6, (key, coarse, fine)


def test_pybullet_without_gyroscopic_torque_is_exact_to_rounding(make):
    """With an isotropic inertia, where w x Jw = 0, PyBullet read as leapfrog flies the manoeuvre
    (whose external wrench changes every 10 ms) to the float32 rounding level at h = 1 ms: measured
    2.0e-5 m, 1.1e-5 rad, 5.7e-5 m/s, 2.5e-5 rad/s, flat in h; tolerances ~2.5x that. Without the
    wrench averaged over the kick across each change: 1.3e-4 m, 1.9e-4 m/s, 1.3e-4 rad/s."""
    v = vehicles(2)
    v.inertia = v.inertia[:, :1].repeat(1, 3)
    ref = fly(TorchBackend(2, NOMINAL, DT, substeps=10), vehicle=v)
    errors = max_errors(fly(make(PybulletBackend, 2), vehicle=v), ref)
    for key, tol in dict(pos=6e-5, angle=3e-5, vel=1.5e-4, omega=6e-5).items():
        assert errors[key] < tol, f"pybullet {key} error {errors[key]:.3g} > {tol:.3g} ({errors})"


@pytest.mark.parametrize("cls", [TorchBackend, MujocoBackend, PybulletBackend])
def test_set_state_subset_leaves_other_envs(cls, make):
    """Resetting environment 1 in flight leaves environment 0 where it is and on the trajectory it flies
    without the reset (PyBullet's reset path re-staggers and averages only the reset body)."""
    backend = make(cls, 2)
    before = backend.state.clone()
    state = initial_state(1)
    backend.set_state(torch.tensor([1]), state, vehicles(2))
    assert torch.equal(backend.state[0], before[0])
    torch.testing.assert_close(backend.state[1], state[0], atol=1e-6, rtol=1e-6)
    flown, alone = make(cls, 2), make(cls, 2)
    for b in (flown, alone):
        b.set_state(torch.arange(2), initial_state(2), vehicles(2))
    for k in range(STEPS):
        if k == 30:
            restart = initial_state(1)
            restart[:, POS] = torch.tensor((0.5, 0.5, 0.5))
            flown.set_state(torch.tensor([1]), restart, vehicles(2))
            torch.testing.assert_close(flown.state[1], restart[0], atol=1e-6, rtol=1e-6)
        a, b = flown.step(*inputs(k, 2))[0], alone.step(*inputs(k, 2))[0]
        torch.testing.assert_close(a, b, atol=0.0, rtol=0.0, msg=f"environment 0 at step {k}")


@pytest.mark.parametrize("cls", [TorchBackend, MujocoBackend, PybulletBackend])
def test_a_fast_spin_is_not_capped(cls, make):
    """A vehicle spinning at 150 rad/s about a principal axis (a tumble; PyBullet's default cap was
    100 rad/s and 100 m/s) keeps its rate and a fast fall its speed, with the rotors stopped."""
    backend = make(cls, 1)
    s = initial_state(1)
    s[:, QUAT], s[:, OMEGA], s[:, VEL], s[:, RPM] = torch.tensor((1.0, 0.0, 0.0, 0.0)), torch.tensor((150.0, 0, 0)), \
        torch.tensor((0.0, 0.0, -120.0)), 0.0
    s[:, POS] = torch.tensor((0.0, 0.0, 1000.0))
    backend.set_state(torch.arange(1), s, VehicleBatch.nominal(1, NOMINAL))
    zero = torch.zeros(1, 3)
    for _ in range(3):
        state = backend.step(torch.zeros(1, 4), zero, zero)
    assert state[0, OMEGA][0].item() == pytest.approx(150.0, rel=1e-3), state[0, OMEGA]
    assert state[0, VEL][2].item() == pytest.approx(-120.0 - 9.81 * 0.03, rel=1e-3), state[0, VEL]


def hover(backend, pos: list, vel=(0.0, 0.0, 0.0), steps: int = 20) -> torch.Tensor:
    """Level drones at ``pos`` [N, 3] with rotors at hover rpm, flown for ``steps``; final state."""
    n = backend.num_envs
    s = torch.zeros(n, 17)
    s[:, POS], s[:, 3], s[:, VEL], s[:, RPM] = torch.tensor(pos), 1.0, torch.tensor(vel), NOMINAL.hover_rpm
    backend.set_state(torch.arange(n), s, VehicleBatch.nominal(n, NOMINAL))
    cmd, zero = torch.full((n, 4), NOMINAL.hover_rpm), torch.zeros(n, 3)
    for _ in range(steps):
        backend.step(cmd, zero, zero)
    return backend.state


def _integrate_1d(z0: float, acc, seconds: float, h: float = 1e-5) -> float:
    """Height after ``seconds`` from rest at ``z0`` under the acceleration ``acc(z)`` (m/s^2), by
    semi-implicit Euler at a step far below the backend's."""
    z, v = z0, 0.0
    for _ in range(int(round(seconds / h))):
        v += h * acc(z)
        z += h * v
    return z


def test_pybullet_ground_effect_lifts_only_near_ground(make):
    """At hover rpm and level the extra thrust is the weight times C (R / 4z)^2 (Shi et al. 2019, as
    gym-pybullet-drones writes it; heights clipped from below where the gain reaches 4/15): the rise over
    0.2 s from 3 cm matches that equation integrated on its own."""
    pos = [[0.0, 0.0, 0.03], [0.0, 0.0, 1.0]]
    rise = hover(make(PybulletBackend, 2, ground_effect=True), pos)[:, 2] - hover(make(PybulletBackend, 2), pos)[:, 2]
    c, r = NOMINAL.ground_effect_coeff, NOMINAL.prop_radius
    clip = r / 4 * math.sqrt(c / (4 / 15))  # the height of the model's maximum gain, 4/15
    want = _integrate_1d(0.03, lambda z: 9.81 * c * (r / (4 * max(z, clip))) ** 2, 0.2) - 0.03
    assert rise[0].item() == pytest.approx(want, rel=0.05), (rise[0].item(), want)  # ~4.5 cm
    # 1 m up the extra thrust is 4e-4 of the weight: < 0.1 mm after 0.2 s.
    assert abs(rise[1]) < 1e-4


def test_pybullet_drag_opposes_the_body_frame_velocity(make):
    """Rotor drag is -diag(c_xy, c_xy, c_z) times the velocity in the body frame, times the summed rotor
    speeds, rotated back to the world: on a rolled, pitched and yawed vehicle it is not the world-frame
    formula (c_z is 1.12 c_xy)."""
    backend = make(PybulletBackend, 1, drag=True)
    s = torch.zeros(1, 17)
    half = torch.tensor([0.5, 0.35, 0.7]) / 2  # roll, pitch, yaw (rad) as one rotation about a unit axis
    axis = half / half.norm()
    s[0, QUAT] = torch.cat((torch.cos(half.norm())[None], axis * torch.sin(half.norm())))
    s[0, POS], s[0, VEL], s[0, RPM] = torch.tensor([0.0, 0.0, 1.0]), torch.tensor([1.0, -0.5, 0.2]), NOMINAL.hover_rpm
    backend.set_state(torch.arange(1), s, VehicleBatch.nominal(1, NOMINAL))
    R = quat_to_rotmat(s[0, QUAT]).double()
    c = torch.diag(torch.tensor([NOMINAL.drag_coeff_xy, NOMINAL.drag_coeff_xy, NOMINAL.drag_coeff_z], dtype=torch.float64))
    speed = 4 * NOMINAL.hover_rpm * RPM_TO_RAD_S
    v = s[0, VEL].double()
    want = -(R @ c @ R.T @ v) * speed
    got = torch.as_tensor(backend._drag_force()[0])
    torch.testing.assert_close(got, want, rtol=1e-6, atol=0.0)
    assert (got - (-(c @ v) * speed)).norm() > 0.02 * want.norm()  # the frame shows at this attitude


def test_pybullet_drag_decelerates(make):
    vel, steps = (1.0, -0.5, 0.2), 20
    with_drag = hover(make(PybulletBackend, 1, drag=True), [[0.0, 0.0, 1.0]], vel, steps)
    plain = hover(make(PybulletBackend, 1), [[0.0, 0.0, 1.0]], vel, steps)
    # Level drone: a = -diag(c_xy, c_xy, c_z) * sum(rotor rad/s) / m * v, so v decays exponentially.
    rate = torch.tensor((NOMINAL.drag_coeff_xy, NOMINAL.drag_coeff_xy, NOMINAL.drag_coeff_z))
    rate = rate * 4 * NOMINAL.hover_rpm * RPM_TO_RAD_S / NOMINAL.mass
    expected = torch.tensor(vel) * (torch.exp(-rate * steps * DT) - 1.0)
    torch.testing.assert_close(with_drag[0, VEL] - plain[0, VEL], expected, rtol=0.03, atol=1e-5)


def test_pybullet_downwash_pushes_the_lower_drone(make):
    pos = [[0.0, 0.0, 1.0], [0.0, 0.0, 2.0]]  # drone 1 hovers 1 m above drone 0
    dz = hover(make(PybulletBackend, 2, downwash=True), pos)[:, 2] - hover(make(PybulletBackend, 2), pos)[:, 2]
    # gym-pybullet-drones' model straight below a drone dz above: c1 (R / 4 dz)^2 N down (0.076 N, ~0.3 weight
    # at 1 m), growing weaker as the lower drone sinks: ~5.5 cm lower after 0.2 s.
    c1, r = NOMINAL.downwash_coeffs[0], NOMINAL.prop_radius
    want = _integrate_1d(1.0, lambda z: -c1 * (r / (4 * (2.0 - z))) ** 2 / NOMINAL.mass, 0.2) - 1.0
    assert dz[0].item() == pytest.approx(want, rel=0.03), (dz[0].item(), want)
    assert abs(dz[1]) < 1e-6


def test_mujoco_render_shows_drone_and_target(make):
    backend = make(MujocoBackend, 2)
    s = initial_state(2)
    s[1, POS] = torch.tensor((2.0, 0.0, 1.0))
    backend.set_state(torch.arange(2), s, vehicles(2))
    target = np.array([[0.1, 0.05, 1.05]])
    frames = backend.render([0], width=96, height=72, targets=target)
    assert frames.shape == (1, 72, 96, 3) and frames.dtype == np.uint8
    r, g, b = (frames[0, ..., c].astype(int) for c in range(3))
    assert ((r > 120) & (g < 70) & (b < 70)).sum() > 5, "front rotors (red) not visible"
    assert ((g > r + 60) & (g > b + 60)).sum() > 5, "target marker (green) not visible"
    r, g, b = (backend.render([0], width=96, height=72)[0, ..., c].astype(int) for c in range(3))
    assert ((g > r + 60) & (g > b + 60)).sum() == 0, "target marker drawn without a target"
    alone = backend.render([0], width=96, height=72)
    s[1, POS] = s[0, POS] + torch.tensor((0.05, 0.02, 0.0))  # the other environment's drone in the same place
    backend.set_state(torch.arange(2), s, vehicles(2))
    assert np.array_equal(backend.render([0], width=96, height=72), alone), "another environment's drone drawn"


def test_pybullet_effects_are_chosen_in_the_task_config():
    """task.pybullet_effects reaches the PyBullet backend of a quadrotor task (evaluation,
    confirmation) and leaves the other simulators as they are; downwash is not offered (the
    episodes are independent vehicles, not a swarm)."""
    from sim.crazyflie.hover import QuadHoverEnv, QuadTaskConfig

    cases = (([], (False, False)), (["drag"], (False, True)), (["ground_effect", "drag"], (True, True)))
    for effects, expected in cases:
        backend = QuadHoverEnv(QuadTaskConfig(pybullet_effects=effects, compile=False), 2, backend="pybullet").backend
        assert (backend.ground_effect, backend.drag, backend.downwash) == (*expected, False), effects
        backend.close()
    QuadHoverEnv(QuadTaskConfig(pybullet_effects=["drag"], compile=False), 2, backend="torch")  # nothing to switch
    with pytest.raises(ValueError, match="unknown PyBullet effect"):
        QuadHoverEnv(QuadTaskConfig(pybullet_effects=["downwash"], compile=False), 2, backend="pybullet")


def test_the_closed_loop_agrees_in_every_simulator():
    """The shipped hover policy flies the same 100 criterion episodes (randomized vehicles, noise,
    latency) in the three simulators (benchmarks/closed_loop.py): the same verdict on each, and the
    position error within 2 mm of torch's at every step. Measured 0.03 mm (MuJoCo) and 0.39 mm
    (PyBullet) with the policy shipped since 2026-12-02 (AMD EPYC; 0.16 and 0.66 mm with the one
    before). PyBullet's velocities read half a substep old (before the leapfrog reading) let one
    slow, delayed vehicle of these break into oscillation: 52 mm, and 1.9 % fewer successes than torch
    over 1,000 episodes (BENCHMARKS.md, "Closed loop in the three simulators")."""
    from benchmarks.closed_loop import SHIPPED, run
    from policies.checkpoint import load_policy
    from sim.registry import get_task

    actor, _ = load_policy(SHIPPED)
    res = run(actor, get_task("quad_hover").default_config(), 100)
    ref = res["torch"]
    for b in ("mujoco", "pybullet"):
        # an episode that leaves the 1 m ball is NaN from there on: it must leave at the same step
        assert np.array_equal(np.isnan(res[b]["error"]), np.isnan(ref["error"])), b
        gap = np.nanmax(np.abs(res[b]["error"] - ref["error"]))
        assert gap < 2e-3, f"{b}: position error {gap * 1e3:.2f} mm from torch's"
        assert (res[b]["success"] == ref["success"]).all(), b


def test_the_pybullet_backend_imports_without_pybullets_build_line(tmp_path):
    """pybullet's C module prints "pybullet build time: ..." to stderr on import, which landed in the middle
    of a training's output (its confirmations import the backend); the backend imports it quietly, and
    stderr works afterwards."""
    import subprocess
    import sys
    from pathlib import Path

    code = "import sys, sim.crazyflie.pybullet_backend as b; b.p.getAPIVersion(); print('after', file=sys.stderr)"
    r = subprocess.run([sys.executable, "-c", code], cwd=Path(__file__).resolve().parents[1], capture_output=True,
                       text=True, timeout=60)
    assert r.returncode == 0 and r.stderr == "after\n", r.stderr
    # Anything else written then (a warning of numpy's, ...) is passed on; without stderr it still imports.
    fake = tmp_path / "pybullet.py"
    fake.write_text("import os, sys\nos.write(2, b'pybullet build time: now\\nfrom C\\n')\n"
                    "print('from Python', file=sys.stderr)\n")
    code = f"import sys; sys.path.insert(0, {str(tmp_path)!r}); import sim.crazyflie.pybullet_backend"
    r = subprocess.run([sys.executable, "-c", code], cwd=Path(__file__).resolve().parents[1], capture_output=True,
                       text=True, timeout=60)
    assert r.returncode == 0 and r.stderr == "from C\nfrom Python\n", r.stderr
    r = subprocess.run([sys.executable, "-c", "import sim.crazyflie.pybullet_backend; print('ok')"],
                       cwd=Path(__file__).resolve().parents[1], stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
                       text=True, timeout=60, preexec_fn=lambda: os.close(2))
    assert r.returncode == 0 and r.stdout == "ok\n"
