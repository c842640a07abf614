"""sim_bridge: one simulated Crazyflie on ROS 2, the time source of a simulated flight.

    python -m deploy.sim_bridge --ros-args -r __ns:=/cf1 -p physics:=torch

Runs a backend of sim/crazyflie (torch: TorchBackend, mujoco, pybullet; the same physics and
motor model as training and evaluation) for one vehicle, one policy period (10 ms) per step,
paced by a steady timer at period / real_time_factor (real time by default, faster with a
factor > 1; under CPU load the simulation slows down, simulated time stays exact).

Publishes   /clock (rosgraph_msgs/Clock, simulated time, starts at 0), odom (nav_msgs/Odometry,
            stamped with simulated time, pose world ENU, twist BODY frame per REP 105)
Subscribes  rotor_cmd (std_msgs/Float32MultiArray, 4 rotor speed setpoints, rpm, M1..M4). The
            setpoint is held until the next one; the backend's first-order motor lag turns it
            into rotor speed. Commands that are not 4 finite numbers are ignored (counted in the
            log); finite ones are clipped to [0, rpm_max].
Lock-step   with ``lockstep``, a step is taken only once a rotor command has arrived since the
            last published state (or after ``lockstep_timeout`` wall seconds without one: the held
            command is used and the timeout counted). The controller then always acts on the state
            it was sent, whatever its wall-clock compute time. A command does not name its state,
            so states in flight when lock-step starts (the release of a held vehicle, states published
            while it sat) or resumes (after a timeout) would pair every later step with the command
            for the state before it: there the simulator first waits, without stepping, until the
            controller has answered them all (no command for LOCKSTEP_QUIET_S wall seconds, at most
            lockstep_timeout), and steps on with the answer to its newest state. Hardware in the loop uses it: the
            policy runs on an emulated MCU whose wall time (QEMU on a shared host, 5-20 ms per step
            measured) says nothing about the real MCU's (18k instructions, ~0.1 ms at 168 MHz), so
            pacing by wall clock would inject a latency the real vehicle does not have. The sim
            launch file uses it too: without it a node that wakes late for a tick (a loaded host,
            or real_time_factor > 1) misses that period and the vehicle flies the held command.
Start       the vehicle sits at ``initial_position`` (level, at rest, rotors at hover speed) and,
            with ``hold_until_command``, is held there (physics paused, clock and odometry
            running) until the first command with a rotor above 0 rpm: a hand launch.
            With ``clamped`` the vehicle stays there for good (a test stand: commands are received,
            the state never changes), for bench tests of the control chain.
Watchdog    a moving vehicle whose last rotor command is older than ``command_timeout`` simulated
            seconds (0.5 s by default, the stock Crazyflie commander's first watchdog limit,
            COMMANDER_WDT_TIMEOUT_STABILIZE in crazyflie-firmware's commander.h) gets 0 rpm: a
            controller that dies or hangs leaves a falling vehicle, not one that flies its last
            command forever. The stock firmware first levels the vehicle and stops
            the motors at 2 s; this vehicle has no onboard attitude controller to level with, so it
            stops them at the first limit. The next valid command drives the rotors again.
Floor       z = 0 (world): a vehicle that sinks below it is put back on it at rest.
"""

from __future__ import annotations

import sys
import time
from typing import TYPE_CHECKING

import numpy as np

from sim.crazyflie.dynamics import OMEGA, POS, QUAT, RPM, STATE_DIM, VEL, VehicleBatch

from .ros import (CONTROL_PUB_QOS, CONTROL_QOS, ODOM, ROTOR_CMD, WORLD_FRAME, Node, param, refuse_unknown_parameters,
                  run_node, vector_param)
from .state import State, fill_odometry

if TYPE_CHECKING:
    import torch

    from sim.crazyflie.dynamics import TorchBackend
    from sim.crazyflie.mujoco_backend import MujocoBackend
    from sim.crazyflie.pybullet_backend import PybulletBackend

BACKENDS = ("torch", "mujoco", "pybullet")
# Lock-step: wall seconds without a command after which the states in flight count as answered: longer
# than a controller's answer takes (the emulated MCU's 5-20 ms per exchange on a loaded host).
LOCKSTEP_QUIET_S = 0.05


def keep_on_floor(backend: TorchBackend | MujocoBackend | PybulletBackend, state: torch.Tensor,
                  vehicle: VehicleBatch) -> None:
    """The floor, z = 0 (world): a vehicle of ``state`` ([1, 17], after a step of ``backend``, one of
    ``sim.crazyflie.hover.make_backend``'s) below it is put back on it at rest (no contact model: its
    attitude is kept)."""
    import torch

    if float(state[0, POS][2]) < 0.0:
        s = state.clone()
        s[0, POS.start + 2] = 0.0
        s[0, VEL], s[0, OMEGA] = 0.0, 0.0
        backend.set_state(torch.arange(1), s, vehicle)


class SimBridge(Node):
    def __init__(self, **node_options):
        """``node_options`` go to rclpy's Node (``context=`` for a node built inside a test)."""
        super().__init__("sim_bridge", **node_options)
        refuse_unknown_parameters(self, "sim_bridge")
        import torch
        from nav_msgs.msg import Odometry
        from rclpy.clock import Clock, ClockType
        from rosgraph_msgs.msg import Clock as ClockMsg
        from std_msgs.msg import Float32MultiArray

        from sim.crazyflie.contract import POLICY_PERIOD
        from sim.crazyflie.hover import make_backend
        from sim.crazyflie.params import NOMINAL

        torch.set_num_threads(1)  # one vehicle: threads only add overhead on a shared machine
        self.torch = torch
        self.robot = param(self, "robot", "cf1", "robot name: child frame id of the odometry")
        self.world_frame = param(self, "world_frame", WORLD_FRAME, "frame id of the world (ENU) frame")
        backend = param(self, "physics", "torch", f"simulator backend: {', '.join(BACKENDS)}")
        if backend not in BACKENDS:
            raise ValueError(f"physics '{backend}': expected one of {', '.join(BACKENDS)}")
        rtf = float(param(self, "real_time_factor", 1.0, "simulated seconds per wall second"))
        if not rtf > 0:
            raise ValueError(f"real_time_factor {rtf}: expected a positive number")
        self.hold = bool(param(self, "hold_until_command", True, "hold the vehicle until a rotor command > 0"))
        self.clamped = bool(param(self, "clamped", False, "test stand: the vehicle never moves"))
        self.lockstep = bool(param(self, "lockstep", False, "step only after a command for the last state"))
        self.lockstep_timeout = float(param(self, "lockstep_timeout", 1.0, "lock-step: wall seconds to wait"))
        self.lockstep_timeouts = 0
        self.command_timeout = float(param(self, "command_timeout", 0.5, "simulated seconds without a rotor "
                                           "command before the rotors are stopped"))
        if not 0.0 < self.command_timeout < float("inf"):
            raise ValueError(f"command_timeout {self.command_timeout}: expected a positive time (s)")
        self.watchdog_stops = 0
        p0 = vector_param(self, "initial_position", [0.0, 0.0, 1.0], "world, m")

        self.params, self.period = NOMINAL, POLICY_PERIOD
        self.backend = make_backend(backend, 1, NOMINAL, 1, "cpu")
        self.vehicle = VehicleBatch.nominal(1, NOMINAL)
        s = torch.zeros(1, STATE_DIM)
        s[0, POS] = torch.as_tensor(p0)
        s[0, QUAT.start] = 1.0  # level: w of (w, x, y, z)
        s[0, RPM] = NOMINAL.hover_rpm
        self.backend.set_state(torch.arange(1), s, self.vehicle)
        self.rpm_cmd = torch.zeros(1, 4)
        self.zeros = torch.zeros(1, 3)
        self.steps = 0
        self._cmd_step: int | None = None  # step of the last valid command (None: none yet, rotors at 0 rpm)
        self._watchdog_cut = False
        self.bad_commands = 0
        self._cmd_since_publish = False
        self._published_at = time.monotonic()
        self._cmd_wall = -float("inf")  # steady time of the last valid command
        self._drain_from: float | None = None  # lock-step: since when the states in flight are being answered

        self.clock_pub = self.create_publisher(ClockMsg, "/clock", 10)
        self.odom_pub = self.create_publisher(Odometry, ODOM, CONTROL_PUB_QOS)
        self.create_subscription(Float32MultiArray, ROTOR_CMD, self._on_cmd, CONTROL_QOS)
        self._clock_msg, self._odom_msg = ClockMsg, Odometry
        self.create_timer(self.period / rtf, self._step, clock=Clock(clock_type=ClockType.STEADY_TIME))
        self.get_logger().info(f"sim_bridge: {backend} backend, start {p0.tolist()} m, "
                               f"{rtf:g}x real time{', lock-step with the controller' if self.lockstep else ''}"
                               f"{', held until the first command' if self.hold else ''}")
        self._publish()

    def _on_cmd(self, msg) -> None:
        data = np.asarray(msg.data, dtype=np.float64)
        if data.shape != (4,) or not np.isfinite(data).all():
            self.bad_commands += 1
            self.get_logger().warning(f"ignored rotor command {data.tolist()[:8]}: expected 4 finite rpm values "
                                      f"({self.bad_commands} so far)", throttle_duration_sec=1.0)
            return
        self._cmd_since_publish = True
        self._cmd_step = self.steps
        self._cmd_wall = time.monotonic()
        if self._watchdog_cut:
            self._watchdog_cut = False
            self.get_logger().info(f"rotor commands again at t = {self.steps * self.period:.2f} s")
        self.rpm_cmd = self.torch.as_tensor(np.clip(data, 0.0, self.params.rpm_max), dtype=self.torch.float32)[None]
        if self.hold and not self.clamped and data.max() > 0.0:
            self.hold = False
            self._drain_from = time.monotonic()  # the states published while it sat are still being answered
            self.get_logger().info(f"released at t = {self.steps * self.period:.2f} s")

    def _step(self) -> None:
        moving = not (self.hold or self.clamped)
        if moving and self.lockstep and self._drain_from is not None:
            now = time.monotonic()
            if now - self._cmd_wall < LOCKSTEP_QUIET_S and now - self._drain_from < self.lockstep_timeout:
                return  # answers to states sent earlier are still coming: no step, no new state
            self._drain_from = None
        if moving and self.lockstep and not self._cmd_since_publish:
            if time.monotonic() - self._published_at < self.lockstep_timeout:
                return  # wait for the controller's command for the state last sent
            self._drain_from = time.monotonic()  # its late answers, and any before them, are drained next
            self.lockstep_timeouts += 1
            self.get_logger().warning(f"lock-step: no command {self.lockstep_timeout:g} s after the state of "
                                      f"t = {self.steps * self.period:.2f} s, stepping with the held one "
                                      f"({self.lockstep_timeouts} so far)", throttle_duration_sec=1.0)
        if (moving and self._cmd_step is not None and not self._watchdog_cut
                and (self.steps - self._cmd_step) * self.period >= self.command_timeout):
            self._watchdog_cut = True
            self.watchdog_stops += 1
            self.rpm_cmd = self.torch.zeros(1, 4)
            self.get_logger().warning(f"no rotor command for {self.command_timeout:g} s at t = "
                                      f"{self.steps * self.period:.2f} s (the last at t = "
                                      f"{self._cmd_step * self.period:.2f} s): rotors stopped "
                                      f"({self.watchdog_stops} so far)")
        if moving:
            keep_on_floor(self.backend, self.backend.step(self.rpm_cmd, self.zeros, self.zeros), self.vehicle)
        self.steps += 1
        self._publish()

    def _publish(self) -> None:
        # Odometry before the clock: a policy node ticking on /clock then sees the state of the
        # same instant (one period of latency less).
        ns = round(self.steps * self.period * 1e9)
        s = self.backend.state[0].double().numpy()
        state = State(pos=s[POS], quat=s[QUAT], vel=s[VEL], omega=s[OMEGA], stamp=ns * 1e-9)
        self.odom_pub.publish(fill_odometry(self._odom_msg(), state, self.world_frame, self.robot))
        clock = self._clock_msg()
        clock.clock.sec, clock.clock.nanosec = divmod(ns, 1_000_000_000)
        self.clock_pub.publish(clock)
        self._cmd_since_publish = False
        self._published_at = time.monotonic()


def main() -> int:
    return run_node(SimBridge, ())


if __name__ == "__main__":
    sys.exit(main())
