"""recorder: every topic of the run into one MCAP file (the rosbag2 MCAP layout).

    python -m deploy.recorder --ros-args -p path:=bags [-p use_sim_time:=true]

Discovers topics every 0.5 s and subscribes to each new one that has a publisher (best effort if
any publisher is, else reliable: a subscription matches the publishers seen then) with raw
(serialized CDR) subscriptions, so messages are stored exactly as they travelled, never re-encoded. Schemas are
the ``ros2msg`` message definitions (with their dependencies) read from the installed ``.msg``
files, as rosbag2 writes them; any MCAP/ROS 2 tool (Foxglove, ``ros2 bag`` with the MCAP
plugin, ``mcap_ros2``) reads the file. Each channel holds its publishers' offered QoS and type hash, as
rosbag2 writes them (``ros2 bag play`` offers that QoS again). log_time is the receive time on this node's clock
(simulated time under use_sim_time), in ns. Under use_sim_time that clock reads 0 until this node has heard
/clock, so the recorder subscribes to topics only from the first discovery pass at which its clock reads more
than 0 (before, a message would be logged at t = 0; the simulator's first /clock is 0, its next 10 ms later), and
warns once if that has not come CLOCK_WARN_S after its start. A simulator restarted under a running recorder starts
its clock over: the log times after the restart go back (``deploy.plot`` takes each part as a run of its own).

``path``: a ``.mcap`` file (refused if it exists) or a directory, in which
``<robot>_<YYYYmmdd_HHMMSS>.mcap`` is created. The file is finished on Ctrl-C / SIGTERM.
"""

from __future__ import annotations

import importlib
import re
import sys
import time
from pathlib import Path

from .launch import LaunchError, package_prefix
from .ros import Node, drain, param, refuse_unknown_parameters, run_node, say

PRIMITIVES = {"bool", "byte", "char", "float32", "float64", "int8", "uint8", "int16", "uint16", "int32", "uint32",
              "int64", "uint64", "string", "wstring"}
DISCOVERY_PERIOD = 0.5  # s
CLOCK_WARN_S = 10.0  # s without /clock under use_sim_time before the recorder warns that it records nothing


def msg_definition(type_name: str) -> str:
    """ros2msg schema text of "pkg/msg/Type": its .msg, then each dependency once, after a
    line of 80 '=' and "MSG: pkg/Type"."""
    pkg, _, name = type_name.split("/")
    seen: dict[str, str] = {}

    def read(pkg_: str, name_: str) -> str:
        try:
            path = package_prefix(pkg_) / "share" / pkg_ / "msg" / f"{name_}.msg"
        except LaunchError as e:
            raise FileNotFoundError(str(e)) from None
        text = path.read_text()
        for line in text.splitlines():
            fields = line.split("#", 1)[0].split()
            if len(fields) < 2 or "=" in fields[1]:
                continue  # blank, comment or constant
            base = re.split(r"[\[<]", fields[0])[0]
            if base in PRIMITIVES:
                continue
            dep_pkg, dep_name = base.split("/") if "/" in base else (pkg_, base)
            key = f"{dep_pkg}/{dep_name}"
            if key not in seen:
                seen[key] = ""
                seen[key] = read(dep_pkg, dep_name)
        return text

    main = read(pkg, name)
    return main + "".join(f"\n{'=' * 80}\nMSG: {k}\n{v}" for k, v in seen.items())


def offered_qos_profiles(publishers) -> str:
    """The publishers' offered QoS (rclpy TopicEndpointInfo list) as the YAML list rosbag2 stores in an MCAP
    channel's ``offered_qos_profiles`` (required by the MCAP ros2 profile; ``ros2 bag play`` offers the
    recorded QoS from it): policies by their rmw names ("best_effort", "transient_local"), durations as
    {sec, nsec}, in rosbag2's metadata version 9 format."""
    import yaml

    def duration(d) -> dict[str, int]:
        sec, nsec = divmod(int(d.nanoseconds), 1_000_000_000)
        return {"sec": sec, "nsec": nsec}

    profiles = [{"history": q.history.name.lower(), "depth": int(q.depth), "reliability": q.reliability.name.lower(),
                 "durability": q.durability.name.lower(), "deadline": duration(q.deadline),
                 "lifespan": duration(q.lifespan), "liveliness": q.liveliness.name.lower(),
                 "liveliness_lease_duration": duration(q.liveliness_lease_duration),
                 "avoid_ros_namespace_conventions": bool(q.avoid_ros_namespace_conventions)}
                for q in (i.qos_profile for i in publishers)]
    return yaml.safe_dump(profiles, sort_keys=False)


def message_class(type_name: str):
    pkg, kind, name = type_name.split("/")
    return getattr(importlib.import_module(f"{pkg}.{kind}"), name)


def bag_path(path: str, robot: str) -> Path:
    p = Path(path).expanduser()
    if p.suffix == ".mcap":
        if p.exists():
            raise ValueError(f"{p} exists: give another path= (recordings are never overwritten)")
    else:
        p = p / f"{robot}_{time.strftime('%Y%m%d_%H%M%S')}.mcap"
    p.parent.mkdir(parents=True, exist_ok=True)
    return p


def open_new(path: Path, numbered: bool):
    """(path, file) opened for writing only where no file is: a recording is never overwritten. With
    ``numbered`` (a name made from the time) a taken name gets _1, _2, ...: two recorders started in
    the same second."""
    for k in range(1000 if numbered else 1):
        candidate = path if k == 0 else path.with_name(f"{path.stem}_{k}{path.suffix}")
        try:
            return candidate, candidate.open("xb")
        except FileExistsError:
            continue
    raise ValueError(f"{path} exists: give another path= (recordings are never overwritten)")


# Bytes per MCAP chunk. A chunk reaches the file only once full (or at finish()), so a recorder killed
# without finishing (SIGKILL, out of memory, a crash) loses the chunk it was filling: with the mcap
# library's default of 1 MiB about 12 s of a simulated flight (~80 KB/s, a reviewer's measurement of
# sim_bridge's traffic, 2026-11-28: a recorder killed after 10 s left an empty file), with this ~0.4 s.
CHUNK_BYTES = 32 * 1024


def new_writer(f):
    """The recorder's MCAP writer on the binary file ``f``: ZSTD chunks of CHUNK_BYTES."""
    from mcap.writer import CompressionType, Writer

    return Writer(f, compression=CompressionType.ZSTD, chunk_size=CHUNK_BYTES)


class Recorder(Node):
    def __init__(self):
        super().__init__("recorder")
        refuse_unknown_parameters(self, "recorder")
        robot = param(self, "robot", "cf1", "robot name, used in the default file name")
        where = param(self, "path", "bags", "a .mcap file or a directory")
        import mcap.writer  # noqa: F401  (a missing package is one error line, before an empty file is made)

        self.path, self._file = open_new(bag_path(where, robot), numbered=Path(where).suffix != ".mcap")
        self.writer = new_writer(self._file)
        self.writer.start(profile="ros2", library="robolearn deploy.recorder")
        self.channels: dict[str, int] = {}
        self.skipped: set[str] = set()
        self.counts: dict[str, int] = {}
        self.sim_time = bool(self.get_parameter("use_sim_time").value)
        self._clock_wait_until: float | None = time.monotonic() + CLOCK_WARN_S  # steady s; None once warned
        from rclpy.clock import Clock, ClockType

        # Discovery runs on the steady clock: under use_sim_time a paused simulator (or one waiting in
        # lock-step for a command) stops /clock, and topics that appear meanwhile must still be found.
        self.create_timer(DISCOVERY_PERIOD, self._discover, clock=Clock(clock_type=ClockType.STEADY_TIME))
        self.get_logger().info(f"recording every topic to {self.path}"
                               + (" once /clock runs (use_sim_time)" if self.sim_time else ""))
        self._discover()

    def _discover(self) -> None:
        from rclpy.qos import QoSProfile, ReliabilityPolicy

        self._file.flush()  # the chunks written so far reach the disk (a killed recorder keeps them)
        if self.sim_time and self.get_clock().now().nanoseconds == 0:
            # No /clock heard yet (this node's /clock subscription can be matched after its others: a
            # launch's recording logged the take-off's status and commands at t = 0). The simulator's
            # clock runs while it holds the vehicle, and policy_node's auto_arm waits for this node's
            # subscriptions (wait_for_recorder_s from its own first /clock), so the take-off is recorded
            # unless that wait runs out.
            if self._clock_wait_until is not None and time.monotonic() > self._clock_wait_until:
                self._clock_wait_until = None
                self.get_logger().warning(f"no /clock within {CLOCK_WARN_S:g} s (use_sim_time): nothing is recorded "
                                          "until a simulator publishes it")
            return
        for topic, types in self.get_topic_names_and_types():
            if topic in self.channels or topic in self.skipped:
                continue
            publishers = self.get_publishers_info_by_topic(topic)
            if not publishers:  # its QoS is chosen from its publishers: look again on the next pass
                continue
            try:
                schema = self.writer.register_schema(types[0], "ros2msg", msg_definition(types[0]).encode())
                cls = message_class(types[0])
            except (OSError, ImportError, AttributeError, ValueError) as e:
                self.skipped.add(topic)
                self.get_logger().warning(f"not recording {topic} ({types[0]}): {e}")
                continue
            best_effort = any(i.qos_profile.reliability == ReliabilityPolicy.BEST_EFFORT for i in publishers)
            qos = QoSProfile(depth=1000, reliability=ReliabilityPolicy.BEST_EFFORT if best_effort
                             else ReliabilityPolicy.RELIABLE)
            metadata = {"offered_qos_profiles": offered_qos_profiles(publishers),
                        "topic_type_hash": str(publishers[0].topic_type_hash)}
            self.channels[topic] = self.writer.register_channel(topic, "cdr", schema, metadata)
            self.counts[topic] = 0
            self.create_subscription(cls, topic, lambda data, t=topic: self._write(t, data), qos, raw=True)

    def _write(self, topic: str, data: bytes) -> None:
        now = self.get_clock().now().nanoseconds
        if self.counts[topic] == 0:  # the subscription is matched and data flows (discovery can take seconds)
            self.get_logger().info(f"first message on {topic}")
        self.writer.add_message(self.channels[topic], log_time=now, data=data, publish_time=now,
                                sequence=self.counts[topic])
        self.counts[topic] += 1

    def close(self) -> None:
        # The end of the run: what was still queued when Ctrl-C came, and what the other nodes still send
        # while they stop (a launch stops every node at once; the real vehicle's bridge flies its landing,
        # within crazyflie_bridge.LANDING_LIMIT_S, publishing odometry), until they go quiet.
        cut = False
        try:
            drain(self, lambda: sum(self.counts.values()), limit_s=RECORD_AFTER_STOP_S, quiet_s=RECORD_QUIET_S)
        except KeyboardInterrupt:  # a second signal (the launch runner's SIGTERM): the file is finished all the same
            cut = True
        self.writer.finish()
        self._file.close()
        say(f"recorder: {sum(self.counts.values())} messages on {len(self.counts)} topics -> {self.path}"
             + (" (stopped while taking the last messages)" if cut else ""))


# s after Ctrl-C at most: past the real bridge's 4.5 s landing, inside the launch runner's 5 s to SIGTERM
RECORD_AFTER_STOP_S = 4.8
# s without a message that end it: longer than a radio link's gaps between the bridge's 10 ms samples
RECORD_QUIET_S = 0.25


def main() -> int:
    return run_node(Recorder, ())


if __name__ == "__main__":
    sys.exit(main())
