"""What every node of this package shares: names, parameter declaration, the spin loop.

Topics are relative names, so a node started in namespace ``/<robot>`` (Crazyswarm2 style,
default ``cf1``) talks on ``/cf1/odom``, ``/cf1/rotor_cmd``, ``/cf1/status``; ``/clock`` is global.
"""

from __future__ import annotations

import faulthandler
import os
import re
import signal
import sys
import threading
import time
from pathlib import Path
from typing import Callable

import numpy as np

try:
    import rclpy
    from rclpy.executors import ExternalShutdownException
    from rclpy.impl.implementation_singleton import rclpy_implementation as _rclpy  # its RCLError: rcl's failures
    from rclpy.node import Node
    from rclpy.qos import HistoryPolicy, QoSProfile, ReliabilityPolicy
    from rclpy.signals import SignalHandlerOptions
except ImportError as e:  # a user mistake: print how to fix it, not a traceback
    sys.exit(f"error: ROS 2 Python packages are missing ({e.name}): pip install \"ros-rclpy[fastrtps]\" "
             "ros-std-msgs ros-geometry-msgs ros-sensor-msgs ros-nav-msgs ros-std-srvs ros-rosgraph-msgs")

ODOM = "odom"  # nav_msgs/Odometry: pose world ENU, twist body FLU (REP 105)
ROTOR_CMD = "rotor_cmd"  # std_msgs/Float32MultiArray: 4 rotor speed setpoints, rpm, order M1..M4
STATUS = "status"  # std_msgs/String: JSON, see policy_node
ARM = "arm"  # std_srvs/SetBool: true arms, false disarms
ESTOP = "emergency_stop"  # std_srvs/Trigger
WORLD_FRAME = "world"
ROTOR_LABEL = "rotor_rpm_M1_M2_M3_M4"

# Control traffic, reliable. Command subscribers keep the newest sample only (a late command is
# never worth acting on); the safety layer's state subscription keeps 10, so that every sample is
# checked even when several arrive within one period (a radio burst): the newest still wins, a bad
# one among them still fails safe. Publishers keep 10 so that a slow reader that wants everything
# (the recorder) still gets every sample.
CONTROL_QOS = QoSProfile(depth=1, reliability=ReliabilityPolicy.RELIABLE, history=HistoryPolicy.KEEP_LAST)
STATE_QOS = QoSProfile(depth=10, reliability=ReliabilityPolicy.RELIABLE, history=HistoryPolicy.KEEP_LAST)
CONTROL_PUB_QOS = QoSProfile(depth=10, reliability=ReliabilityPolicy.RELIABLE, history=HistoryPolicy.KEEP_LAST)
STATUS_QOS = QoSProfile(depth=10, reliability=ReliabilityPolicy.RELIABLE, history=HistoryPolicy.KEEP_LAST)
# This project's own packages: a module of theirs that is missing is a bug, not an installation problem
PROJECT_PACKAGES = ("benchmarks", "deploy", "export", "firmware", "policies", "sim")


def ensure_ament_prefix() -> None:
    """ament index look-ups (message type support) need AMENT_PREFIX_PATH; default: this Python's prefix."""
    if not os.environ.get("AMENT_PREFIX_PATH"):
        os.environ["AMENT_PREFIX_PATH"] = sys.prefix


# Every parameter each node of this package declares (param() refuses a name missing from its node's list), so that a
# given parameter no node has, or one given to a node that does not have it (-p, its params-file section), is refused
# (refuse_unknown_parameters): rclpy ignores it, and a misspelt limit in a params file (max_tilt_degs),
# or one written in another node's section, would fly with the default, unsaid.
CONTROLLER_PARAMETERS = frozenset({  # policy.ControllerNode: policy_node, firmware_bridge, crazyflie_bridge
    "robot", "policy", "world_frame", "target", "stale_timeout", "geofence_min", "geofence_max", "max_action",
    "descent_thrust_ratio", "ground_height", "landed_height", "recover_count", "max_recoveries",
    "recovery_window", "takeoff_speed", "ground_timeout", "max_arm_tilt_deg", "max_arm_speed", "max_arm_rate",
    "max_tilt_deg", "max_held_tilt_deg", "max_held_tilt_s", "max_jump", "max_attitude_jump_deg", "auto_arm",
    "wait_for_recorder_s", "clock_timeout",
})
NODE_PARAMETERS: dict[str, frozenset[str]] = {  # by the name each node is built with
    "policy_node": CONTROLLER_PARAMETERS,
    "firmware_bridge": CONTROLLER_PARAMETERS,
    "crazyflie_bridge": CONTROLLER_PARAMETERS | {"uri", "reconnect_s", "estimator_settle_spread"},
    "sim_bridge": frozenset({"robot", "world_frame", "physics", "real_time_factor", "hold_until_command", "clamped",
                             "lockstep", "lockstep_timeout", "command_timeout", "initial_position"}),
    "recorder": frozenset({"robot", "path"}),
}
PARAMETERS = frozenset().union(*NODE_PARAMETERS.values())
# Parameters of rclpy itself that a launch may give any node.
ROS_PARAMETERS = frozenset({"use_sim_time", "start_type_description_service"})


def _ros_parameter(name: str) -> bool:
    return name in ROS_PARAMETERS or name.startswith("qos_overrides.")


def params_file_sections(path: Path) -> list[tuple[str, list[str]]]:
    """The node sections of a ROS 2 params file as rcl reads them: (node name pattern, its parameter
    names), the pattern fully qualified (a leading / added, nested namespace keys joined), nested
    parameter keys joined with '.'. Read as YAML nodes, not values: every document of the file, a
    section repeated (rcl merges it), a tag rcl ignores. ValueError (one line) if it is no YAML."""
    import yaml

    def names(body: yaml.Node, prefix: str = "") -> list[str]:
        if not isinstance(body, yaml.MappingNode) or not body.value:  # a value (an empty mapping: rcl's too)
            return [prefix.removesuffix(".")]
        return [n for k, v in body.value for n in names(v, f"{prefix}{k.value}.")]

    def walk(tree: yaml.Node, ns: str) -> list[tuple[str, list[str]]]:
        out = []
        for key, body in tree.value if isinstance(tree, yaml.MappingNode) else ():
            if key.value == "ros__parameters":
                out.append((ns or "/", names(body) if isinstance(body, yaml.MappingNode) and body.value else []))
            else:  # a node or a namespace; a node's mapping may hold further nodes, as rcl reads it
                out += walk(body, f"{ns}/{str(key.value).strip('/')}")
        return out

    try:
        return [section for doc in yaml.compose_all(path.read_text()) for section in walk(doc, "")]
    except yaml.YAMLError as e:
        raise ValueError(f"params file {path}: not YAML ({str(e).splitlines()[0]})") from None


def ros_arguments(argv: list[str]) -> tuple[list[Path], list[str]]:
    """What a command line gives a node's parameters as rcl takes it, inside ``--ros-args`` blocks (each
    ends at ``--`` or the end; there may be several): the params files (``--params-file <path>``) and
    the names given a value (``-p``/``--param name:=value``)."""
    takes_value = {"-p", "--param", "-r", "--remap", "-e", "--enclave", "--log-level", "--log-config-file",
                   "--log-file-name", "--params-file"}
    files, names, inside, i = [], [], False, 0
    while i < len(argv):
        if argv[i] == "--ros-args":
            inside = True
        elif inside and argv[i] == "--":
            inside = False
        elif inside and argv[i] in takes_value and i + 1 < len(argv):
            if argv[i] == "--params-file":
                files.append(Path(argv[i + 1]))
            elif argv[i] in ("-p", "--param") and ":=" in argv[i + 1]:
                names.append(argv[i + 1].split(":=", 1)[0])
            i += 1
        i += 1
    return files, names


def names_node(pattern: str, fqn: str, name: str) -> bool:
    """Whether the params-file section ``pattern`` is written for the node ``name`` (its last token is
    that name, no wildcard) and applies to it at ``fqn`` (ROS 2 wildcards: * one token, ** any number)."""
    if pattern.rsplit("/", 1)[-1] != name:
        return False
    tokens = [re.escape(t) for t in pattern.strip("/").split("/")]
    regex = "".join("(/[^/]+)*" if t == r"\*\*" else "/[^/]+" if t == r"\*" else f"/{t}" for t in tokens)
    return re.fullmatch(regex, fqn) is not None


def refuse_unknown_parameters(node: Node, kind: str) -> None:
    """Raise ValueError (one line from run_node) if ``node`` (built as ``kind``, a key of NODE_PARAMETERS)
    was given (params file, ``name:=value``) a parameter that no node of this package declares, or its
    command line (run_node gives rclpy sys.argv) gives it another node's parameter: with ``-p``, or in a
    params-file section written for this node (another node's, in the wrong section). Call it
    first thing after Node.__init__: before a radio link or an emulator starts. param() then holds the
    node's declarations to NODE_PARAMETERS[kind]."""
    node._parameter_kind = kind
    given = node._parameter_overrides  # rclpy's own record of them (no public accessor)
    unknown = sorted(n for n in given if n not in PARAMETERS and not _ros_parameter(n))
    if unknown:
        it = "them" if len(unknown) > 1 else "it"
        raise ValueError(f"parameter{'s' if len(unknown) > 1 else ''} {', '.join(unknown)}: no node of this package "
                         f"has {it} (misspelt?); ROS 2 would ignore {it} and keep the default")
    files, given_here = ros_arguments(sys.argv)
    for n in given_here:  # a command line's -p is this node's alone (the launcher's <param> too)
        if n not in NODE_PARAMETERS[kind] and not _ros_parameter(n):
            raise ValueError(f"parameter {n}: {kind} has no such parameter ({_owners(n)} it); ROS 2 would ignore it")
    for path in files:
        for pattern, names in params_file_sections(path):
            if not names_node(pattern, node.get_fully_qualified_name(), node.get_name()):
                continue
            for n in names:
                if n not in NODE_PARAMETERS[kind] and not _ros_parameter(n):
                    raise ValueError(f"parameter {n} in the section {pattern} of {path}: {kind} has no such parameter "
                                     f"({_owners(n)} it); ROS 2 would ignore it. Write it in the section of a node "
                                     "that takes it, by the name that node runs under, or under /**")


def _owners(name: str) -> str:
    """Which nodes have parameter ``name``, as 'a, b have' / 'a has' / 'no node has'."""
    owners = [k for k, v in NODE_PARAMETERS.items() if name in v]
    return f"{', '.join(owners)} {'has' if len(owners) == 1 else 'have'}" if owners else "no node has"


def param(node: Node, name: str, default, description: str = ""):
    """Declare a ROS parameter and return its value (lists come back as Python lists). A value of
    another type than the default's (ROS 2 types parameters strictly: 1 is not a double) raises
    ValueError, which run_node prints as one line."""
    from rcl_interfaces.msg import ParameterDescriptor
    from rclpy.exceptions import ParameterException

    kind = getattr(node, "_parameter_kind", None)  # set by refuse_unknown_parameters
    if name not in (PARAMETERS if kind is None else NODE_PARAMETERS[kind]):
        where = "any of deploy.ros.NODE_PARAMETERS" if kind is None else f"deploy.ros.NODE_PARAMETERS['{kind}']"
        raise AssertionError(f"parameter {name}: not in {where} (refuse_unknown_parameters' lists): add it there")

    try:
        value = node.declare_parameter(name, default, ParameterDescriptor(description=description)).value
    except ParameterException as e:
        example = {float: " (write 1.0, not 1)", list: " (write [0.0, 0.0, 1.0], not [0, 0, 1])"}.get(type(default), "")
        raise ValueError(f"parameter {name}: expected a {type(default).__name__}{example}; {e}") from None
    return list(value) if isinstance(value, (list, tuple, np.ndarray)) else value


def vector_param(node: Node, name: str, default: list[float], description: str, size: int = 3) -> np.ndarray:
    value = np.asarray(param(node, name, [float(v) for v in default], description), dtype=np.float64)
    if value.shape != (size,) or not np.isfinite(value).all():
        raise ValueError(f"parameter {name}={value.tolist()}: expected {size} finite numbers")
    return value


def rotor_command_msg(rpm: np.ndarray):
    """std_msgs/Float32MultiArray carrying 4 rotor speed setpoints (rpm, M1..M4)."""
    from std_msgs.msg import Float32MultiArray, MultiArrayDimension

    msg = Float32MultiArray()
    msg.layout.dim = [MultiArrayDimension(label=ROTOR_LABEL, size=4, stride=4)]
    msg.data = [float(v) for v in rpm]
    return msg


def stop_on_signals() -> threading.Event:
    """An event that the first SIGINT or SIGTERM sets; the spin loop checks it between callbacks.

    rclpy's own handlers shut the context down from a signal-handling thread while this thread may
    be inside a callback (publishing, running the policy): a race that showed up as a rare segfault
    (exit code -11) of policy_node at SIGTERM under a loaded CI machine. Here the node stops in its
    own thread, after the callback in progress, and cleans up in order. A second signal, for a node
    stuck in a callback or in its clean-up, interrupts it (KeyboardInterrupt); a third one acts as if
    no handler were installed.

    SIGHUP (the terminal closed, or the launch runner died: deploy/launch.py asks the kernel for it)
    stops the node the same way but never escalates: a node flying its shutdown descent when its
    launcher dies finishes the descent. Ignored SIGHUP (nohup) stays ignored."""
    stop = threading.Event()

    def on_signal(_signum, _frame):
        if not stop.is_set():
            stop.set()
            return
        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, signal.SIG_DFL)
        raise KeyboardInterrupt

    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, on_signal)
    if signal.getsignal(signal.SIGHUP) is not signal.SIG_IGN:
        signal.signal(signal.SIGHUP, lambda _signum, _frame: stop.set())
    return stop


def spin(node: Node, stop: threading.Event) -> None:
    """Spin until ``stop`` is set or the context shuts down; survives a callback raising.

    rclpy's own /clock handler raises on a malformed Clock message (negative seconds), which would
    otherwise end the node: the message is dropped, the error logged (once per kind), and spinning
    goes on. A signal is seen within one wait (at most 0.1 s)."""
    from rclpy.executors import SingleThreadedExecutor

    executor = SingleThreadedExecutor(context=node.context)
    executor.add_node(node)
    seen: set[str] = set()
    try:
        while node.context.ok() and not stop.is_set():
            try:
                executor.spin_once(timeout_sec=0.1)
            except (KeyboardInterrupt, ExternalShutdownException):
                raise
            except Exception as e:
                if not node.context.ok():
                    break
                kind = f"{type(e).__name__}: {e}"
                if kind not in seen:
                    seen.add(kind)
                    node.get_logger().error(f"callback failed, message dropped ({kind})")
    finally:
        executor.shutdown()


def drain(node: Node, received: Callable[[], int], limit_s: float = 1.0, quiet_s: float = 0.04) -> None:
    """Take the messages still queued for ``node``'s subscriptions once its spinning has stopped (every
    node of a launch gets Ctrl-C at once, and a node behind keeps up to its queues' depth unread), and
    those still arriving: spin until ``quiet_s`` pass without one adding to ``received()`` (messages taken
    so far), or ``limit_s``."""
    from rclpy.executors import SingleThreadedExecutor

    executor = SingleThreadedExecutor(context=node.context)
    executor.add_node(node)
    start = time.monotonic()
    deadline, last, count = start + limit_s, start, received()
    try:
        while time.monotonic() < deadline and node.context.ok():
            executor.spin_once(timeout_sec=0.02)
            if received() != count:
                count, last = received(), time.monotonic()
            elif time.monotonic() - last >= quiet_s:
                break
    finally:
        executor.shutdown()


# s a node's teardown after its clean-up may take (~20 ms measured for sim_bridge: destroy_node and rclpy's
# shutdown) before it prints every thread's stack and exits: before the launch runner's SIGKILL, 10 s after its
# SIGINT, also after the longest clean-up (the recorder's, up to 4.8 s)
TEARDOWN_LIMIT_S = 3.0


def run_node(make: Callable[[], Node], user_errors: tuple[type[Exception], ...] = ()) -> int:
    """rclpy.init, build the node, spin until Ctrl-C / SIGTERM / shutdown, clean up.

    ValueError, OSError, a missing module or one of ``user_errors`` raised while building the node,
    and ROS arguments rcl cannot parse, are user mistakes (bad parameter, missing file, wrong model):
    printed as one line, exit code 2.
    A crash in native code (rclpy, the DDS layer, onnxruntime) prints the Python stack of every
    thread to stderr before the process dies. So does a teardown that hangs (destroying the node, rclpy's
    shutdown, most of the interpreter's exit) for TEARDOWN_LIMIT_S after the node's own clean-up, which then exits
    with code 1: a call into native code that holds the GIL (the DDS participant's deletion joins its
    threads) blocks the Python signal handlers, so the launcher's SIGKILL would otherwise end it without a
    trace (sim_bridge, once in ~20 simulated flights, not reproduced since)."""
    faulthandler.enable()
    stop = stop_on_signals()  # before anything starts: a signal while the node is built stops it after
    ensure_ament_prefix()
    try:
        # (refuse_unknown_parameters reads sys.argv's params files too)
        rclpy.init(args=sys.argv, signal_handler_options=SignalHandlerOptions.NO)
    except _rclpy.RCLError as e:  # e.g. __ns:=/cf-1, no ROS name: rcl's reason, without its lexer's
        print(f"error: the ROS arguments: {str(e).split('. Error:')[0]}", file=sys.stderr)
        return 2
    node, code = None, 0
    try:
        try:
            node = make()
        except ModuleNotFoundError as e:
            if (e.name or "").split(".")[0] in PROJECT_PACKAGES:  # a bug of this project: its traceback
                raise
            # a package the node needs (mcap, cflib): an installation problem
            print(f"error: the Python module {e.name} is missing: install the project with bash install.sh",
                  file=sys.stderr)
            return 2
        except (ValueError, OSError, *user_errors) as e:
            print(f"error: {e}", file=sys.stderr)
            return 2
        spin(node, stop)
    except (KeyboardInterrupt, ExternalShutdownException):
        pass
    finally:
        if node is not None:
            close = getattr(node, "close", None)
            try:
                if close is not None:
                    close()
            except KeyboardInterrupt:  # a second signal cut the clean-up short (close() sends what must be sent)
                say(f"{node.get_name()}: clean-up interrupted")
            except Exception as e:  # e.g. its output gone with a dead launch runner: destroy the node all the same
                say(f"{node.get_name()}: clean-up failed ({type(e).__name__}: {e})")
                code = 1
            faulthandler.dump_traceback_later(TEARDOWN_LIMIT_S, exit=True)  # left on until the process ends
            node.destroy_node()
        if rclpy.ok():
            rclpy.shutdown()
    return code


def say(line: str) -> None:
    """One line to stderr, if it still goes anywhere (a launch runner that died took the pipe with it)."""
    try:
        print(line, file=sys.stderr, flush=True)
    except OSError:
        pass
