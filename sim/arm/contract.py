"""The arm policies' input/output contract, written once (layout: base.py's module docstring).

Exported arm policies carry it in their ONNX metadata; loaders compare it and refuse a mismatch.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from sim.contract import ContractBase, Field

from . import base
from .control import IKConfig
from .params import NOMINAL


@dataclass(frozen=True)
class ArmContract(ContractBase):
    # v3 (2026-11-28): the joints reach the IK's targets within Franka's acceleration limits
    # (sim/arm/control.py), so a policy of v2's faster arm would meet other dynamics behind the same layout
    version: str = "arm-ee-delta-v3"
    EARLIER_VERSIONS: ClassVar[tuple[str, ...]] = ("arm-ee-delta-v1", "arm-ee-delta-v2")  # v2: the gripper's yaw
    observation: tuple[Field, ...] = (
        Field("joint_positions", 7, "joints 1..7", "rad"),
        Field("joint_velocities", 7, "joints 1..7", "rad/s"),
        Field("tcp_position", 3, "world (robot base origin, table top z = 0)", "m"),
        Field("gripper_opening", 1, "distance between the fingers", "m"),
        Field("cube_position", 3, "world", "m"),
        Field("cube_quaternion", 4, "w,x,y,z cube->world, w >= 0", "1"),
        Field("goal_position", 3, "world", "m"),
        Field("tcp_yaw", 1, "gripper about world z, 0: fingers opening along world y", "rad"),
    )
    action_size: int = base.ACT_DIM
    action_range: tuple[float, float] = (-1.0, 1.0)
    action_meaning: str = (f"[dx, dy, dz] desired TCP displacement per step = a * {IKConfig().max_delta} m, "
                           "world frame, reached within Franka's joint speed and acceleration limits (from rest "
                           "about a third of it in the first step); "
                           f"dyaw desired gripper turn about world z per step = a * {IKConfig().max_dyaw} rad "
                           f"(the IK closes {IKConfig().rot_gain} of it per step), "
                           f"|yaw| <= {IKConfig().yaw_limit:.4f} (differential IK, gripper down); "
                           "gripper -1 open .. +1 closed")
    policy_period_s: float = NOMINAL.sim.control_period


CONTRACT = ArmContract()
assert CONTRACT.obs_size == base.POLICY_DIM, "contract and observation layout disagree"
assert [CONTRACT.slice(f.name) for f in CONTRACT.observation] == [
    base.JOINT_POS, base.JOINT_VEL, base.EE_POS, base.GRIPPER, base.CUBE_POS, base.CUBE_QUAT, base.GOAL_POS,
    base.EE_YAW], "the observation's slices (base.py) are not the contract's fields"
