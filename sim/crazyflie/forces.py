"""Rotor force model shared by every backend.

The force model is written with array operators only, so the same code runs on NumPy arrays
(MuJoCo, PyBullet backends) and on batched PyTorch tensors (training backend).
"""

from __future__ import annotations

import numpy as np

from .params import CrazyflieParams


def rotor_thrusts(rpm, kf, thrust_scale=1.0):
    """Thrust of each rotor, N, in the shape of ``rpm`` ([N, 4], or [N] for one rotor).
    ``thrust_scale`` models battery sag.

    ``rpm`` may be slightly negative inside an integrator stage; thrust keeps its sign
    convention T = kf * rpm * |rpm| so the model stays smooth there.
    """
    return kf * rpm * abs(rpm) * thrust_scale


def body_torque_terms(thrusts, params: CrazyflieParams):
    """Roll and pitch torques (N m, body FLU) and the signed thrust sum for yaw.

    ``thrusts`` is indexed by rotor first: a sequence of four arrays (M1..M4), or an array
    [4, ...] (pass ``t.T`` for a batch laid out [N, 4]).

    Torque of rotor i at (x_i, y_i, 0) pushing +z: r x F = (y_i T_i, -x_i T_i, 0).
    Yaw reaction torque is km * sum_i s_i T_i; the caller multiplies by km so that km can
    be randomized per environment.
    """
    tx = sum(xy[1] * t for xy, t in zip(params.rotor_xy, thrusts))
    ty = sum(-xy[0] * t for xy, t in zip(params.rotor_xy, thrusts))
    yaw_sum = sum(s * t for s, t in zip(params.rotor_yaw_sign, thrusts))
    return tx, ty, yaw_sum


def cross_rows(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """Row-wise cross product a x b of [N, 3] NumPy arrays (np.cross spends ~25 us a call on its axis handling)."""
    (a0, a1, a2), (b0, b1, b2) = a.T, b.T
    return np.stack((a1 * b2 - a2 * b1, a2 * b0 - a0 * b2, a0 * b1 - a1 * b0), axis=1)
