"""firmware_bridge: policy_node with the onboard controller running on the emulated Crazyflie MCU (HIL).

    python -m deploy.firmware_bridge --ros-args -r __ns:=/cf1 -p policy:=<run_dir>/export/policy.onnx

Same topics, services, safety layer and parameters as policy_node (deploy/policy_node.py); only
the policy differs: ``firmware.pil.McuPolicy`` builds the exported C policy (policy.c / policy.h
next to policy.onnx) with the onboard controller's glue (firmware/crazyflie/src/cf_policy_glue.c)
into the bare-metal STM32F405 image and runs it in QEMU. Every control tick sends what
controller_oot.c gives the glue on the vehicle (the state estimate, the gyro in deg/s, the safety
layer's setpoint) and flies the simulator with the motor forces it returns, mapped back to rotor
speeds: the MCU builds the observation, runs the policy, clamps at the stock Crazyflie 2.x thrust
limit (actions above ~0.74 saturate, as on the vehicle) and keeps its own previous action. A glue
that leaves its policy mode (a policy error on the MCU: non-finite input or output) is a policy
error here too, so the safety layer fails safe; the glue's fault stays latched until the safety
layer disarms, which sends it the stop setpoint the real bridge sends. A failsafe is flown as on the
real vehicle: the MCU's policy flies the descending position setpoints crazyflie_bridge sends
(``safety.OnboardDescent``), timed along ``DescentProfile.onboard`` plus its lag; the safety layer's open-loop
descent command stands in only where the glue does not fly (a latched fault: the vehicle's stock PID
fallback is not in the image). The ONNX file is loaded too,
for the contract check, and the image is refused unless its policy.c computes the ONNX model's
actions (``McuPolicy.check_against``).
"""

from __future__ import annotations

import dataclasses
import sys
from pathlib import Path
from typing import Callable

import numpy as np

from sim.crazyflie.contract import OBS_POSITION, OBS_VELOCITY, POLICY_PERIOD

from .policy_node import ControllerNode, Policy
from .ros import run_node
from .safety import Command, Mode
from .state import State


class GlueAdapter:
    """The onboard controller on the MCU (``firmware.pil.McuPolicy.glue_step``) as a single-observation
    policy callable (22,) -> (4,). ``latest`` gives the state the observation was built from; the
    setpoint is recovered from the observation's position and velocity errors."""

    # ms per call: one policy period, so every call is a policy tick with a fresh setpoint
    PERIOD_MS = round(POLICY_PERIOD * 1000)

    def __init__(self, mcu, latest: Callable[[], State]):
        from firmware import pil  # imported once here, not on every control tick

        self.mcu, self.latest, self.pil = mcu, latest, pil
        self.now_ms = 0
        self.engaged = False  # the glue was last told to fly (not stopped)
        self.latched = False  # the glue answered with a latched fault: it flies nothing until a stop
        self.failed: str | None = None  # why the MCU no longer answers (dead, hung, garbled): never asked again

    def _exchange(self, *args, **kwargs):
        """One glue step on the MCU; the first failure (an exception, a timeout) is kept and every later
        call refused at once, so that a hung MCU costs one timeout, not one per control period."""
        if self.failed is not None:
            raise RuntimeError(f"the MCU failed earlier: {self.failed}")
        try:
            return self.mcu.glue_step(*args, **kwargs)
        except Exception as e:
            self.failed = f"{type(e).__name__}: {e}"[:200]
            raise

    def __call__(self, obs: np.ndarray) -> np.ndarray:
        st = self.latest()
        return self._fly(st.pos - obs[OBS_POSITION], st.vel - obs[OBS_VELOCITY])

    def fly_to(self, setpoint: np.ndarray) -> np.ndarray | None:
        """The MCU's action for a position setpoint (world, m; velocity reference 0) from the latest state,
        as crazyflie_bridge sends the vehicle in a failsafe; None where its glue does not fly it (a latched
        fault: on the vehicle the stock PID would take over, which the image does not run; a failed MCU)."""
        if self.latched or self.failed is not None:
            return None
        try:
            return self._fly(np.asarray(setpoint, np.float64), np.zeros(3))
        except Exception:
            return None

    def _fly(self, setpoint_pos: np.ndarray, setpoint_vel: np.ndarray) -> np.ndarray:
        """One policy period of the glue, flying to the setpoint from the latest state: the action of the
        motor forces it returns; RuntimeError if it is not in policy mode."""
        pil, st = self.pil, self.latest()
        self.now_ms += self.PERIOD_MS
        self.engaged = True  # before the exchange: one that times out may still have reached the MCU
        out = self._exchange(st.pos, st.quat, st.vel, np.degrees(st.omega), setpoint_pos, setpoint_vel,
                             self.now_ms, self.now_ms)
        if pil.GLUE_MODES[out.mode] != "policy":
            self.latched = True
            raise RuntimeError(f"the onboard controller on the MCU is in mode {pil.GLUE_MODES[out.mode]} "
                               f"(fault: {pil.GLUE_FAULTS[out.fault]}, policy_step returned {out.rc})")
        return pil.force_to_action(out.force, self.mcu.boot.thrust_max)

    def stop(self) -> None:
        """The stop setpoint (motors off; clears a latched fault), once after the glue was flying; nothing
        to a failed MCU."""
        if self.engaged and self.failed is None:
            self.engaged = self.latched = False  # before the exchange: a failing one is not retried every period
            self.now_ms += self.PERIOD_MS
            zeros = np.zeros(3)
            self._exchange(zeros, (1.0, 0.0, 0.0, 0.0), zeros, zeros, zeros, zeros, self.now_ms, self.now_ms,
                           setpoint_kind=self.pil.SETPOINT_STOP)


class FirmwareBridge(ControllerNode):
    ONBOARD_DESCENT = True  # the MCU flies the failsafe descent, as the vehicle does

    def __init__(self):
        self.mcu = self.glue = None
        super().__init__("firmware_bridge", self._load)

    def _load(self, path: str) -> tuple[Policy, dict]:
        from export.onnx_policy import OnnxPolicy
        from firmware.pil import McuPolicy

        max_action = float(self.get_parameter("max_action").value)  # declared by ControllerNode already
        if max_action < 1.0:  # before QEMU starts
            raise ValueError(f"max_action {max_action:g}: the MCU's glue feeds its own action back to the policy "
                             "(limited only as the firmware limits the motors), so a lower clip here would give it a "
                             "previous action the vehicle did not fly; leave it at 1")
        onnx = OnnxPolicy(path)  # refuses a model of another contract
        self.mcu = McuPolicy(Path(path).parent, compare_onnx=False, timeout_s=1.0)  # refuses a failed self-test
        diff = self.mcu.check_against(onnx)
        self.get_logger().info(f"MCU booted: self-test passed, {self.mcu.boot.self_test_instructions:.0f} "
                               f"instructions per policy step, actions within {diff:.1e} of {onnx.path.name}")
        self.glue = GlueAdapter(self.mcu, lambda: self.controller.latest)
        return self.glue, onnx.contract

    def policy_problem(self) -> str | None:
        """A failed MCU (dead, hung, garbled: ``GlueAdapter.failed``) flies no policy: arming is refused and a
        failsafe lands without recovering. Its commands still reach the simulator (the safety layer's, on
        rotor_cmd), so disarm and stop do too: not a link problem."""
        failed = self.glue.failed if self.glue is not None else None
        return None if failed is None else f"the emulated MCU failed ({failed}): restart the bridge"

    def vehicle_command(self, cmd: Command, now: float) -> Command:
        """In a failsafe, the MCU's policy flies the descending setpoints crazyflie_bridge sends the real
        vehicle, from the current state (on the vehicle its estimator runs on through a lost link), not
        the safety layer's open-loop rotor command. That command stands where the MCU cannot fly it (no
        current state here, the glue's latched fault, a failed MCU). Actions are clipped as the safety
        layer clips the policy's. ``status`` keeps showing the safety layer's previous action."""
        setpoint = self.descent.setpoint(cmd, self.controller, now)
        if setpoint is None or not self.controller.state_fresh(now):
            return cmd
        action = self.glue.fly_to(setpoint)
        if action is None or not np.isfinite(action).all():
            return cmd
        return dataclasses.replace(cmd, action=np.clip(action, -1.0, self.controller.cfg.max_action))

    def actuate(self, cmd: Command, now: float) -> None:
        if cmd.mode in (Mode.DISARMED, Mode.ESTOP):  # as crazyflie_bridge sends the vehicle
            self.glue.stop()

    def close(self) -> None:
        super().close()
        if self.mcu is not None:
            self.mcu.close()


def main() -> int:
    from export.onnx_policy import ContractError
    from firmware.build import BuildError
    from firmware.pil import PilError

    return run_node(FirmwareBridge, (ContractError, BuildError, PilError))


if __name__ == "__main__":
    sys.exit(main())
