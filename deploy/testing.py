"""Harness for tests and measurements that run the nodes as real processes on real DDS.

Each :class:`RosWorld` gets its own ROS_DOMAIN_ID with discovery limited to localhost, starts
processes with that environment, and owns an rclpy context in the calling process for an
independent observer node. Everything it started is stopped on exit (SIGINT, then SIGKILL).
"""

from __future__ import annotations

import itertools
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Callable

from .ros import ensure_ament_prefix

REPO = Path(__file__).resolve().parents[1]
_domains = itertools.count()


def free_domain_id() -> int:
    """A ROS domain id for one test: distinct within this process, spread over the pid across
    concurrent test runs (ids 1..100 map to distinct DDS ports)."""
    return 1 + (os.getpid() * 7 + next(_domains)) % 100


class RosWorld:
    def __init__(self, domain_id: int | None = None):
        ensure_ament_prefix()
        self.domain_id = free_domain_id() if domain_id is None else domain_id
        self._tmp = tempfile.TemporaryDirectory(prefix="deploy_test_")
        # ROS_LOG_DIR: each node's rcl log file goes with this world, not into ~/.ros/log (one per process)
        self.env = {**os.environ, "ROS_DOMAIN_ID": str(self.domain_id), "ROS_AUTOMATIC_DISCOVERY_RANGE": "LOCALHOST",
                    "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])),
                    "PYTHONUNBUFFERED": "1", "ROS_LOG_DIR": self._tmp.name}
        self.procs: list[subprocess.Popen] = []
        self.logs: list[Path] = []
        self.context = None
        self.node = None
        self.executor = None

    # ------------------------------------------------------------------ processes
    def start(self, *cmd: str, name: str = "proc") -> subprocess.Popen:
        """Start ``cmd`` (``-m module`` means ``python -m module``) in this world; output to a log file."""
        argv = [sys.executable, *cmd] if cmd[0] == "-m" else list(cmd)
        log = Path(self._tmp.name) / f"{name}-{len(self.procs)}.log"
        proc = subprocess.Popen(argv, env=self.env, cwd=REPO, stdout=log.open("wb"), stderr=subprocess.STDOUT,
                                start_new_session=True)
        self.procs.append(proc)
        self.logs.append(log)
        return proc

    def node_cmd(self, module: str, robot: str = "cf1", **params) -> list[str]:
        """``python -m deploy.<module>`` in namespace /<robot> with ROS parameters."""
        args = ["-m", f"deploy.{module}", "--ros-args", "-r", f"__ns:=/{robot}"]
        for k, v in params.items():
            args += ["-p", f"{k}:={json.dumps(v) if isinstance(v, (list, bool)) else v}"]
        return args

    def output(self, proc: subprocess.Popen) -> str:
        return self.logs[self.procs.index(proc)].read_text(errors="replace")

    def all_output(self) -> str:
        return "\n".join(f"--- {p.name}\n{p.read_text(errors='replace')[-4000:]}" for p in self.logs)

    @staticmethod
    def stop(proc: subprocess.Popen, sig: int = signal.SIGINT, timeout: float = 15.0) -> int:
        """Signal the process group, wait, SIGKILL if needed; returns the exit code. The wait
        outlasts the launch runner's own escalation (SIGINT, SIGTERM at 5 s, SIGKILL at 10 s), so
        a launch is never killed before it has killed its nodes (they run in their own sessions)."""
        if proc.poll() is None:
            try:
                os.killpg(proc.pid, sig)
                proc.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
            except ProcessLookupError:
                pass
        return proc.wait()

    # ------------------------------------------------------------------ observer
    def observer(self):
        """An rclpy node in this process, on this world's domain."""
        if self.node is None:
            import rclpy
            from rclpy.executors import SingleThreadedExecutor

            self.context = rclpy.Context()
            rclpy.init(context=self.context, domain_id=self.domain_id)
            self.node = rclpy.create_node(f"observer_{os.getpid()}", context=self.context)
            self.executor = SingleThreadedExecutor(context=self.context)
            self.executor.add_node(self.node)
        return self.node

    def spin_until(self, done: Callable[[], bool], timeout: float, what: str) -> None:
        """Spin the observer until ``done()``; AssertionError naming ``what`` and the process logs on timeout."""
        deadline = time.monotonic() + timeout
        while not done():
            if time.monotonic() > deadline:
                raise AssertionError(f"timed out after {timeout:g} s waiting for {what}\n{self.all_output()}")
            self.executor.spin_once(timeout_sec=0.02)

    def spin_for(self, seconds: float) -> None:
        deadline = time.monotonic() + seconds
        while time.monotonic() < deadline:
            self.executor.spin_once(timeout_sec=0.02)

    def __enter__(self) -> "RosWorld":
        return self

    def __exit__(self, *exc) -> None:
        for p in reversed(self.procs):
            self.stop(p)
        if self.node is not None:
            self.executor.shutdown()
            self.node.destroy_node()
            self.context.try_shutdown()
        self._tmp.cleanup()
