"""Crazyflie model sanity: hover equilibrium, free fall, torque signs per motor."""

import math

import pytest
import torch

from sim.crazyflie.dynamics import OMEGA, POS, RPM, VEL, TorchBackend, VehicleBatch, derivative
from sim.crazyflie.params import GRAVITY, NOMINAL


def _state(rpm):
    s = torch.zeros(1, 17)
    s[:, 2] = 1.0
    s[:, 3] = 1.0
    s[:, RPM] = torch.as_tensor(rpm, dtype=torch.float32)
    return s


def _deriv(rpm, cmd=None, **vehicle):
    v = VehicleBatch.nominal(1, NOMINAL)
    for name, value in vehicle.items():
        getattr(v, name).fill_(value)
    s = _state(rpm)
    cmd = s[:, RPM] if cmd is None else torch.as_tensor(cmd, dtype=torch.float32)[None]
    z = torch.zeros(1, 3)
    return derivative(s, cmd, v, NOMINAL, z, z)[0]


def test_published_figures():
    assert NOMINAL.thrust_to_weight == pytest.approx(2.25, abs=0.01)
    assert 0.3 < NOMINAL.hover_action < 0.37  # hover at about 2/3 of max rpm


def test_hover_equilibrium_thrust():
    d = _deriv([NOMINAL.hover_rpm] * 4)
    assert torch.allclose(d, torch.zeros(17), atol=1e-4), d


def test_hover_holds_for_one_second():
    b = TorchBackend(1, NOMINAL, 0.01)
    b.set_state(torch.tensor([0]), _state([NOMINAL.hover_rpm] * 4), VehicleBatch.nominal(1, NOMINAL))
    cmd = torch.full((1, 4), NOMINAL.hover_rpm)
    z = torch.zeros(1, 3)
    for _ in range(100):
        s = b.step(cmd, z, z)
    assert (s[0, POS] - torch.tensor([0.0, 0.0, 1.0])).abs().max() < 1e-3


def test_free_fall():
    b = TorchBackend(1, NOMINAL, 0.01)
    b.set_state(torch.tensor([0]), _state([0.0] * 4), VehicleBatch.nominal(1, NOMINAL))
    z = torch.zeros(1, 3)
    for _ in range(50):
        s = b.step(torch.zeros(1, 4), z, z)
    t = 0.5
    assert s[0, 2].item() == pytest.approx(1.0 - 0.5 * GRAVITY * t * t, abs=1e-4)
    assert s[0, VEL][2].item() == pytest.approx(-GRAVITY * t, abs=1e-4)
    assert s[0, VEL][:2].abs().max() < 1e-6


# Motor i alone spinning faster: expected sign of (roll, pitch, yaw) angular acceleration, body FLU.
# M1 front-right pushes the right side up -> roll negative, front up -> pitch negative, yaw -.
@pytest.mark.parametrize(
    "motor, signs",
    [(0, (-1, -1, -1)), (1, (-1, 1, 1)), (2, (1, 1, -1)), (3, (1, -1, 1))],
)
def test_torque_sign_per_motor(motor, signs):
    rpm = [NOMINAL.hover_rpm] * 4
    rpm[motor] *= 1.1
    domega = _deriv(rpm)[10:13]
    for axis, sign in enumerate(signs):
        assert math.copysign(1, domega[axis].item()) == sign, (motor, domega)
    assert _deriv(rpm)[OMEGA].abs().min() > 0


@pytest.mark.parametrize("motor", range(4))
def test_torque_magnitude_per_motor(motor):
    """Motor i alone with 21 % more thrust than at hover (10 % more rpm): the angular acceleration is
    r x F over the inertia for roll and pitch and km times the thrust change, with the issue's yaw sign,
    over Izz for yaw; rotors at the issue's (+-a, +-a) in the Crazyflie's order (M1 front-right ...)."""
    a = abs(NOMINAL.rotor_xy[0][0])
    x, y = [(a, -a), (-a, -a), (-a, a), (a, a)][motor]  # M1 front-right, M2 back-right, M3 back-left, M4 front-left
    yaw_sign = (-1, 1, -1, 1)[motor]
    rpm = [NOMINAL.hover_rpm] * 4
    rpm[motor] *= 1.1
    dT = NOMINAL.kf * NOMINAL.hover_rpm ** 2 * (1.1 ** 2 - 1)  # N
    ixx, iyy, izz = NOMINAL.inertia
    want = torch.tensor([y * dT / ixx, -x * dT / iyy, NOMINAL.km * yaw_sign * dT / izz])
    assert torch.allclose(_deriv(rpm)[OMEGA], want, rtol=1e-4, atol=0), (_deriv(rpm)[OMEGA], want)


def test_battery_sag_scales_every_rotors_thrust():
    """thrust_scale multiplies each rotor's kf rpm^2: level at hover rpm, 0.9 of it sinks at 0.9 x the
    thrust over the mass minus g."""
    d = _deriv([NOMINAL.hover_rpm] * 4, thrust_scale=0.9)
    want = 0.9 * 4 * NOMINAL.kf * NOMINAL.hover_rpm ** 2 / NOMINAL.mass - GRAVITY
    assert d[VEL][2].item() == pytest.approx(want, rel=1e-5) and want < -0.9
    assert torch.allclose(d[OMEGA], torch.zeros(3), atol=1e-3)


def test_motor_lag_first_order():
    """d rpm / dt = (command - rpm) / tau for each motor, its own command (a swapped index shows)."""
    tau = NOMINAL.motor_tau
    cmd = [1000.0, 2000.0, 3000.0, 4000.0]
    d = _deriv([0.0, 500.0, 0.0, 5000.0], cmd=cmd)
    assert d[RPM].tolist() == pytest.approx([1000.0 / tau, 1500.0 / tau, 3000.0 / tau, -1000.0 / tau], rel=1e-5)
