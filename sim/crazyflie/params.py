"""Crazyflie 2.x physical parameters: the one source of truth for every backend.

Units are SI. Body frame FLU (x forward, y left, z up), world frame ENU (z up).
Rotor order is the Crazyflie firmware's: M1 front-right, M2 back-right, M3 back-left,
M4 front-left. Every simulator backend (PyTorch, MuJoCo, PyBullet) and the randomizer
build their models from :class:`CrazyflieParams`; no constant here is typed anywhere else.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

GRAVITY = 9.81  # m/s^2, standard gravity rounded as in the Crazyflie firmware (GRAVITY_MAGNITUDE)


@dataclass(frozen=True)
class CrazyflieParams:
    """Nominal Crazyflie 2.x (bare frame, stock 1S LiPo, no decks)."""

    # Take-off mass incl. battery. Bitcraze datasheet: 27 g.
    mass: float = 0.027
    # Principal moments of inertia, kg m^2. J. Foerster, "System Identification of the
    # Crazyflie 2.0 Nano Quadrocopter", ETH Zurich 2015 (Ixx 16.57e-6, Iyy 16.66e-6, Izz 29.26e-6).
    inertia: tuple[float, float, float] = (16.571710e-6, 16.655602e-6, 29.261652e-6)
    # Rotor hub positions in the body frame (x, y), m, order M1..M4: the project issue's
    # (+-0.028, +-0.028) m, as gym-pybullet-drones' cf2x.urdf places them (arm 0.0397 m from the
    # centre, 0.0397 / sqrt(2) = 0.028 m on each axis; a 79 mm motor-to-motor diagonal). Bitcraze's
    # 92 mm (frame_half_extents below) is often quoted as the rotor-to-rotor diagonal; read that way,
    # the real hubs sit at ~32.5 mm per axis, ~16 % farther out than these (more roll/pitch torque
    # per unit of thrust difference), a difference the randomized inertia does not cover.
    rotor_xy: tuple[tuple[float, float], ...] = (
        (0.028, -0.028),  # M1 front-right
        (-0.028, -0.028),  # M2 back-right
        (-0.028, 0.028),  # M3 back-left
        (0.028, 0.028),  # M4 front-left
    )
    # Sign of each rotor's yaw reaction torque on the frame, about body z: -, +, -, + (the project
    # issue's, and gym-pybullet-drones' for the cf2x). A rotor's drag reacts on the frame against
    # its spin, so M1 and M3 spin counter-clockwise seen from above (torque -z), M2 and M4 clockwise.
    rotor_yaw_sign: tuple[float, float, float, float] = (-1.0, 1.0, -1.0, 1.0)
    # Thrust per rotor T = kf * rpm^2, N/rpm^2. gym-pybullet-drones cf2x.urdf (kf = 3.16e-10),
    # consistent with Foerster 2015's static thrust measurements.
    kf: float = 3.16e-10
    # Yaw drag torque per unit thrust, m (Q = km * T). Foerster 2015 measures ~0.006 m.
    km: float = 0.006
    # Maximum rotor speed, rpm. With kf above this gives thrust-to-weight 2.25, the figure
    # gym-pybullet-drones uses for the cf2x (0.595 N total vs 0.265 N weight).
    rpm_max: float = 21702.0
    # First-order motor lag time constant, s, of the nominal vehicle (brushed 7x16 mm motors, 45 mm
    # props). Not from one identification: a value inside the 0.03 (fresh) .. 0.15 s (worn) span
    # the project issue gives, which Learning to Fly (RLtools l2f) randomizes over. The task's
    # randomizer covers 0.03-0.12 s by default (sim/crazyflie/hover.py, RandomizationConfig).
    motor_tau: float = 0.05
    # Propeller radius, m (gym-pybullet-drones cf2x.urdf, used by the ground-effect model).
    prop_radius: float = 0.0231348
    # Ground effect coefficient (gym-pybullet-drones cf2x.urdf, Shi et al. "Neural Lander").
    ground_effect_coeff: float = 11.36859
    # Rotor drag coefficients, N / (rad/s) / (m/s) per rotor (gym-pybullet-drones cf2x.urdf).
    drag_coeff_xy: float = 9.1785e-7
    drag_coeff_z: float = 10.311e-7
    # Downwash model coefficients (gym-pybullet-drones cf2x.urdf).
    downwash_coeffs: tuple[float, float, float] = (2267.18, 0.16, -0.11)
    # Collision box half-extents of the frame, m: the overall size 92 x 92 x 29 mm of the Bitcraze
    # datasheet (arms and motor mounts included), rounded.
    frame_half_extents: tuple[float, float, float] = (0.046, 0.046, 0.015)

    @property
    def weight(self) -> float:
        """Gravity force on the vehicle, N."""
        return self.mass * GRAVITY

    @property
    def max_thrust(self) -> float:
        """Total thrust with all rotors at rpm_max, N."""
        return 4.0 * self.kf * self.rpm_max**2

    @property
    def thrust_to_weight(self) -> float:
        return self.max_thrust / self.weight

    @property
    def hover_rpm(self) -> float:
        """Rotor speed at which the four rotors carry the weight, rpm."""
        return math.sqrt(self.weight / (4.0 * self.kf))

    @property
    def hover_action(self) -> float:
        """Normalised action in [-1, 1] that commands hover_rpm on every rotor."""
        return 2.0 * self.hover_rpm / self.rpm_max - 1.0


NOMINAL = CrazyflieParams()


def action_to_rpm(action, rpm_max: float = NOMINAL.rpm_max):
    """Policy contract: rotor rpm setpoint = (a + 1) / 2 * rpm_max, a in [-1, 1]."""
    return (action + 1.0) * 0.5 * rpm_max


def rpm_to_action(rpm, rpm_max: float = NOMINAL.rpm_max):
    """Inverse of :func:`action_to_rpm`."""
    return 2.0 * rpm / rpm_max - 1.0
