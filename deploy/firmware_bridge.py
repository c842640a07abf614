"""firmware_bridge: policy_node with the policy running on the emulated Crazyflie MCU (HIL).

    python -m deploy.firmware_bridge --ros-args -r __ns:=/cf1 -p policy:=<run_dir>/export/policy.onnx

Same topics, services, safety layer and parameters as policy_node (deploy/policy_node.py); only
the policy differs: ``firmware.pil.McuPolicy`` builds the exported C policy (policy.c / policy.h
next to policy.onnx) into the bare-metal STM32F405 image and runs it in QEMU; every control tick
sends the observation over the emulated UART and uses the action the MCU computes. A nonzero
return code from policy_step on the MCU (its own input/output checks) is a policy error, so the
safety layer fails safe. The ONNX file is loaded too, for the contract check, and the image is
refused unless its policy.c computes the ONNX model's actions (``McuPolicy.check_against``).
"""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np

from .policy_node import ControllerNode, Policy
from .ros import run_node


class McuAdapter:
    """firmware.pil.McuPolicy as a single-observation policy callable (22,) -> (4,)."""

    def __init__(self, mcu):
        self.mcu = mcu

    def __call__(self, obs: np.ndarray) -> np.ndarray:
        actions, rcs, _ticks = self.mcu.exchange(obs.reshape(1, -1))
        if rcs[0] != 0:
            raise RuntimeError(f"policy_step on the MCU returned {int(rcs[0])}")
        return actions[0]


class FirmwareBridge(ControllerNode):
    def __init__(self):
        self.mcu = None
        super().__init__("firmware_bridge", self._load)

    def _load(self, path: str) -> tuple[Policy, dict]:
        from export.onnx_policy import OnnxPolicy
        from firmware.pil import McuPolicy

        onnx = OnnxPolicy(path)  # refuses a model of another contract
        self.mcu = McuPolicy(Path(path).parent, compare_onnx=False, timeout_s=1.0)
        if self.mcu.boot.self_test_rc != 0:
            raise ValueError(f"the MCU image failed its policy self-test (rc {self.mcu.boot.self_test_rc})")
        diff = self.mcu.check_against(onnx)
        self.get_logger().info(f"MCU booted: self-test passed, {self.mcu.boot.self_test_instructions:.0f} "
                               f"instructions per policy step, actions within {diff:.1e} of {onnx.path.name}")
        contract = onnx.contract
        return McuAdapter(self.mcu), contract

    def close(self) -> None:
        super().close()
        if self.mcu is not None:
            self.mcu.close()


def main(args: list[str] | None = None) -> int:
    from export.onnx_policy import ContractError
    from firmware.build import BuildError
    from firmware.pil import PilError

    return run_node(FirmwareBridge, (ContractError, BuildError, PilError), args)


if __name__ == "__main__":
    sys.exit(main())
