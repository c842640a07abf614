"""The Crazyflie policy's input/output contract, written once.

Trained policies are exported with this contract in their ONNX metadata; every consumer
(ROS 2 policy node, firmware generator, evaluators) compares the model's contract with
this one on load and refuses a mismatch.
"""

from __future__ import annotations

from dataclasses import dataclass

from sim.contract import ContractBase, Field

from .params import NOMINAL


@dataclass(frozen=True)
class PolicyContract(ContractBase):
    version: str = "crazyflie-rpm-v1"
    observation: tuple[Field, ...] = (
        Field("position_minus_reference", 3, "world ENU", "m"),
        Field("rotation_matrix_body_to_world_row_major", 9, "body FLU -> world ENU", "1"),
        Field("velocity_minus_reference", 3, "world ENU", "m/s"),
        Field("angular_velocity", 3, "body FLU", "rad/s"),
        Field("previous_action", 4, "rotor order M1..M4", "1"),
    )
    action_size: int = 4
    action_range: tuple[float, float] = (-1.0, 1.0)
    action_meaning: str = "rotor i rpm setpoint = (a_i + 1) / 2 * rpm_max"
    rotor_order: tuple[str, ...] = ("M1 front-right (+x,-y)", "M2 back-right (-x,-y)",
                                    "M3 back-left (-x,+y)", "M4 front-left (+x,+y)")
    rpm_max: float = NOMINAL.rpm_max
    policy_period_s: float = 0.01
    quaternion_convention: str = "w,x,y,z body->world"


CONTRACT = PolicyContract()
OBS_DIM = CONTRACT.obs_size  # 22
ACT_DIM = CONTRACT.action_size  # 4
POLICY_PERIOD = CONTRACT.policy_period_s  # s
# Where each field is in the observation (cf_policy_glue.h's CFP_OBS_* repeat the starts; a test compares them).
OBS_POSITION, OBS_ROTATION, OBS_VELOCITY, OBS_ANGULAR_VELOCITY, OBS_PREVIOUS_ACTION = (
    CONTRACT.slice(f.name) for f in CONTRACT.observation)
