"""Processor-in-the-loop: the exported C policy running on an emulated STM32F405.

QEMU's ``netduinoplus2`` machine is an STM32F405 (Cortex-M4F, the Crazyflie 2.x's MCU). The
bare-metal image of ``firmware/qemu/`` receives each observation over USART1 (QEMU's first
``-serial``, here the process's stdin/stdout), runs ``policy_step`` and answers with the action,
the return code and the SysTick ticks the step took. :class:`McuPolicy` wraps it as a policy
callable (torch obs [N, 22] -> action [N, 4], the N rows one after the other on the one MCU), so
``evaluate_hover(McuPolicy(export_dir), task_cfg)`` flies the simulator closed loop through the
emulated MCU, one exchange per 10 ms of simulated time. Every action is compared with
onnxruntime on the same observation. :meth:`McuPolicy.glue_step` runs the onboard controller's glue
instead (``firmware/crazyflie/src/cf_policy_glue.c``: the observation built on the MCU from the
state estimate, gyro and setpoint in the firmware's units, the policy, the action-to-motor-force
mapping with the stock Crazyflie 2.x thrust limit, dead-man and faults), as the vehicle runs it.

Instruction counts: QEMU runs with ``-icount shift=5``, so every guest instruction advances the
virtual clock by exactly 2^5 ns; SysTick counts the 168 MHz core clock in virtual time, which makes
instructions = ticks / (168e6 * 32e-9) = ticks / 5.376, minus the cost of reading the timer
(measured at boot). QEMU does not model the DWT cycle counter (CYCCNT reads 0).
:func:`count_instructions_exact` checks the method against a single-stepped execution trace.
These are instructions, not cycles: flash wait states and FPU latencies of a real STM32F405 at
168 MHz are not modelled.
"""

from __future__ import annotations

import hashlib
import math
import os
import select
import shutil
import struct
import subprocess
import tempfile
import time
import weakref
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from export.onnx_policy import OnnxPolicy
from sim.crazyflie.contract import CONTRACT, OBS_ROTATION
from sim.crazyflie.params import NOMINAL

from .build import FIRMWARE_DIR, build_pil_image, check_export_dir

ICOUNT_SHIFT = 5  # every guest instruction advances QEMU's virtual clock by 2**5 ns
CORE_CLOCK_HZ = 168e6  # netduinoplus2 system clock, SysTick's source
TICKS_PER_INSTRUCTION = CORE_CLOCK_HZ * 2**ICOUNT_SHIFT * 1e-9  # 5.376

# Framing, as in firmware/qemu/frame.h.
SYNC = b"\xa5\x5a"
FRAME_OBS, FRAME_ACTION, FRAME_BOOT, FRAME_NACK, FRAME_QUIT, FRAME_SENSORS, FRAME_MOTORS = (ord(c) for c in "OABNQSM")
# cf_policy_glue.h: setpoint kinds, modes and faults
SETPOINT_STOP, SETPOINT_POSITION, SETPOINT_OTHER = 0, 1, 2
GLUE_MODES = ("idle", "policy", "fallback")
GLUE_FAULTS = ("none", "dead-man", "policy error")
MAX_PAYLOAD = 96
HEADER_SIZE = 5
# Payloads (little-endian), as frame.h describes them: boot report; action (rc, action[4], ticks);
# motors (rc, mode, fault, 2 pad bytes, action[4], normalized motor force[4], ticks).
BOOT_FORMAT, ACTION_FORMAT, MOTORS_FORMAT = "<iIIIIff", "<i4fI", "<iBB2x8fI"
FRAMES_PER_WRITE = 32  # keeps both pipe directions far below their 64 KB buffers
# MCU vs onnxruntime, per action, for the same network: the export's C check allows 1e-5 against
# onnxruntime on 20k observations (3-5e-7 measured on the MCU); another network differs by ~0.1.
MATCH_TOL = 1e-4


def force_to_action(force: np.ndarray, thrust_max: float) -> np.ndarray:
    """The contract action whose rotor speed gives normalized motor ``force`` (thrust / ``thrust_max``)
    on the simulated rotor: the inverse of cf_policy_glue's action-to-force mapping, below its clamp at
    force 1 (an action above it saturates at this action); force 0 (a motor the glue stops below
    thrust_min) is action -1."""
    rpm = np.sqrt(np.maximum(np.asarray(force, np.float64), 0.0) * thrust_max / NOMINAL.kf)
    return 2.0 * rpm / NOMINAL.rpm_max - 1.0


class PilError(Exception):
    """The emulated MCU could not be started or did not answer as expected."""


def crc16(data: bytes) -> int:
    """CRC-16/CCITT-FALSE (poly 0x1021, init 0xFFFF), as frame_crc16 in frame.c."""
    crc = 0xFFFF
    for byte in data:
        crc ^= byte << 8
        for _ in range(8):
            crc = ((crc << 1) ^ 0x1021) & 0xFFFF if crc & 0x8000 else (crc << 1) & 0xFFFF
    return crc


def encode_frame(ftype: int, seq: int, payload: bytes = b"") -> bytes:
    if len(payload) > MAX_PAYLOAD:
        raise ValueError(f"payload of {len(payload)} bytes, at most {MAX_PAYLOAD}")
    body = bytes((ftype, seq & 0xFF, len(payload))) + payload
    return SYNC + body + struct.pack("<H", crc16(body))


@dataclass
class Frame:
    type: int
    seq: int
    payload: bytes


class FrameReader:
    """Frames from a file descriptor, resynchronising on the sync pair like frame.c."""

    def __init__(self, fd: int):
        self.fd = fd
        self.buf = bytearray()

    def _parse(self) -> Frame | None:
        while True:
            start = self.buf.find(SYNC)
            if start < 0:
                del self.buf[: max(len(self.buf) - 1, 0)]  # keep a trailing 0xA5
                return None
            del self.buf[:start]
            if len(self.buf) < HEADER_SIZE:
                return None
            n = self.buf[4]
            if n > MAX_PAYLOAD:
                del self.buf[:1]
                continue
            if len(self.buf) < HEADER_SIZE + n + 2:
                return None
            body = bytes(self.buf[2:HEADER_SIZE + n])
            (crc,) = struct.unpack_from("<H", self.buf, HEADER_SIZE + n)
            if crc != crc16(body):
                del self.buf[:1]
                continue
            del self.buf[: HEADER_SIZE + n + 2]
            return Frame(body[0], body[1], body[3:])

    def read(self, timeout_s: float) -> Frame | None:
        """The next valid frame, or None after timeout_s seconds or at end of stream."""
        deadline = time.monotonic() + timeout_s
        while (frame := self._parse()) is None:
            left = deadline - time.monotonic()
            if left <= 0 or not select.select([self.fd], [], [], left)[0]:
                return None
            chunk = os.read(self.fd, 4096)
            if not chunk:
                return None
            self.buf += chunk
        return frame


@dataclass
class BootReport:
    self_test_rc: int  # policy_self_test: 0 = outputs match the exported reference
    self_test_instructions: float
    overhead_ticks: int  # SysTick ticks of an empty measurement, subtracted from every count
    obs_dim: int
    act_dim: int
    thrust_max: float  # N per motor at the glue's normalized force 1 (the stock Crazyflie 2.x THRUST_MAX)
    thrust_min: float  # N per motor below which the glue stops a motor, as the firmware does (THRUST_MIN)


@dataclass
class GlueOutput:
    """One cfp_update on the MCU (firmware/crazyflie/src/cf_policy_glue.h)."""

    mode: int  # index into GLUE_MODES
    fault: int  # index into GLUE_FAULTS, latched until a fresh stop setpoint
    rc: int  # the last policy_step return code
    action: np.ndarray  # (4,) the last action as applied (saturated at the force limit), held between periods
    force: np.ndarray  # (4,) normalized motor force 0..1 (0 unless mode is policy)
    instructions: float  # of this cfp_update


@dataclass
class PilStats:
    steps: int = 0
    errors: int = 0  # policy_step return codes != 0
    max_abs_diff: float = 0.0  # largest |MCU - onnxruntime| over steps with rc == 0
    instructions: list[float] = field(default_factory=list)  # per policy_step
    seconds: float = 0.0  # wall time spent exchanging frames with QEMU
    late_answers: int = 0  # answers to an exchange that had timed out, dropped when they arrived

    @property
    def seconds_per_step(self) -> float:
        return self.seconds / max(self.steps, 1)

    def summary(self) -> str:
        ins = np.asarray(self.instructions) if self.instructions else np.zeros(1)
        return (f"{self.steps} MCU steps, {self.errors} errors, max |MCU - onnxruntime| {self.max_abs_diff:.2e}, "
                f"instructions/step mean {ins.mean():.0f} (min {ins.min():.0f}, max {ins.max():.0f}), "
                f"{self.seconds_per_step * 1e3:.2f} ms wall per exchange"
                + (f", {self.late_answers} late answers dropped" if self.late_answers else ""))


def qemu_command(elf: Path, *extra: str) -> list[str]:
    exe = shutil.which("qemu-system-arm")
    if exe is None:
        raise PilError("qemu-system-arm not found; install it (Debian: apt-get install qemu-system-arm)")
    return [exe, "-M", "netduinoplus2", "-nographic", "-monitor", "none", "-serial", "stdio",
            "-semihosting-config", "enable=on,target=native", "-icount", f"shift={ICOUNT_SHIFT}",
            *extra, "-kernel", str(elf)]


def default_build_dir(export_dir: Path) -> Path:
    """One persistent build directory per export directory, so make rebuilds only what changed."""
    return FIRMWARE_DIR / "build" / f"pil-{hashlib.sha1(str(export_dir).encode()).hexdigest()[:10]}"


def _stop(proc: subprocess.Popen) -> None:
    """Make sure a QEMU process is gone (also run by the finalizer if close() was never called)."""
    if proc.poll() is None:
        proc.kill()
    proc.wait()
    for f in (proc.stdin, proc.stdout):
        if f is not None and not f.closed:
            try:
                f.close()
            except OSError:  # stdin still held unsent bytes for a QEMU that has already exited
                pass


class McuPolicy:
    """The exported policy on the emulated MCU, as a policy callable obs [N, 22] -> action [N, 4].

    Use as a context manager (or call close()); QEMU is killed at garbage collection or exit
    otherwise. ``stats`` accumulates steps, errors, the largest difference to onnxruntime,
    instructions per step and wall time.
    """

    def __init__(self, export_dir: str | Path, build_dir: str | Path | None = None, compare_onnx: bool = True,
                 timeout_s: float = 10.0):
        self.export_dir = check_export_dir(export_dir)
        build_dir = Path(build_dir) if build_dir else default_build_dir(self.export_dir)
        self.elf = build_pil_image(self.export_dir, build_dir)
        self.onnx = OnnxPolicy(self.export_dir / "policy.onnx") if compare_onnx else None
        self.timeout_s = timeout_s
        self.stats = PilStats()
        self._seq = 0
        self._stderr = tempfile.TemporaryFile()  # semihosting console; a file never blocks QEMU
        # QEMU outlives closed pipes: killed with its parent however that dies (kill -9, a crash), through
        # util-linux's setpriv (PR_SET_PDEATHSIG before exec; a preexec_fn is unsafe in a threaded ROS node).
        setpriv = shutil.which("setpriv")
        die_with_parent = [setpriv, "--pdeathsig", "KILL", "--"] if setpriv else []
        self.proc = subprocess.Popen([*die_with_parent, *qemu_command(self.elf)], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, stderr=self._stderr)
        self._finalizer = weakref.finalize(self, _stop, self.proc)
        self._reader = FrameReader(self.proc.stdout.fileno())
        try:
            self.boot = self._read_boot()
            if self.boot.self_test_rc != 0:  # as the vehicle's firmware refuses to fly it
                raise PilError(f"the MCU image failed its policy self-test (rc {self.boot.self_test_rc}): its "
                               f"policy.c does not compute the actions exported with it\n{self.console()}")
        except BaseException:
            self.close()
            raise

    # ------------------------------------------------------------------ lifecycle
    def close(self) -> int | None:
        """Ask the image to quit (semihosting exit 0), kill QEMU if it does not; returns its exit code."""
        if self.proc.poll() is None:
            try:
                self.proc.stdin.write(encode_frame(FRAME_QUIT, 0))
                self.proc.stdin.flush()
                self.proc.wait(timeout=2.0)
            except (OSError, subprocess.TimeoutExpired):
                pass
        self._finalizer()
        self._stderr.close()
        return self.proc.returncode

    def __enter__(self) -> "McuPolicy":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def console(self) -> str:
        """What the image printed on the semihosting console (QEMU's stderr) so far."""
        self._stderr.seek(0)
        return self._stderr.read().decode(errors="replace")

    # ------------------------------------------------------------------ link
    def send_bytes(self, data: bytes) -> None:
        try:
            self.proc.stdin.write(data)
            self.proc.stdin.flush()
        except OSError:
            raise self._error("could not write to QEMU") from None

    def read_frame(self) -> Frame:
        frame = self._reader.read(self.timeout_s)
        if frame is None:
            raise self._error(f"no answer from the MCU within {self.timeout_s:g} s")
        return frame

    def _error(self, what: str) -> PilError:
        state = "still running" if self.proc.poll() is None else f"exited with {self.proc.returncode}"
        return PilError(f"{what} (QEMU {state}; console: {self.console().strip()!r})")

    def _read_boot(self) -> BootReport:
        f = self.read_frame()
        if f.type != FRAME_BOOT or len(f.payload) != struct.calcsize(BOOT_FORMAT):
            raise self._error(f"expected the boot report, got frame type {chr(f.type)!r}")
        rc, ticks, overhead, obs_dim, act_dim, thrust_max, thrust_min = struct.unpack(BOOT_FORMAT, f.payload)
        if (obs_dim, act_dim) != (CONTRACT.obs_size, CONTRACT.action_size):
            raise self._error(f"the image's policy maps {obs_dim} -> {act_dim}, the contract is "
                              f"{CONTRACT.obs_size} -> {CONTRACT.action_size}")
        return BootReport(rc, (ticks - overhead) / TICKS_PER_INSTRUCTION, overhead, obs_dim, act_dim, thrust_max,
                          thrust_min)

    def instructions(self, ticks: int) -> float:
        return (ticks - self.boot.overhead_ticks) / TICKS_PER_INSTRUCTION

    # ------------------------------------------------------------------ policy
    def exchange(self, obs: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Run policy_step on the MCU for every row of obs [N, 22] (float32), in order.

        Returns actions [N, 4], return codes [N] and SysTick ticks [N]. Frames are pipelined:
        up to FRAMES_PER_WRITE observations are written before their answers are read."""
        obs = np.ascontiguousarray(obs, dtype=np.float32)
        if obs.ndim not in (1, 2) or obs.shape[-1] != CONTRACT.obs_size:
            raise PilError(f"expected observations of {CONTRACT.obs_size} floats, got shape {list(obs.shape)}")
        obs = obs.reshape(-1, CONTRACT.obs_size)
        n = len(obs)
        actions = np.empty((n, CONTRACT.action_size), np.float32)
        rcs = np.empty(n, np.int32)
        ticks = np.empty(n, np.int64)
        for start in range(0, n, FRAMES_PER_WRITE):
            rows = range(start, min(start + FRAMES_PER_WRITE, n))
            seqs = [(self._seq + i) & 0xFF for i in range(len(rows))]
            self._seq = (self._seq + len(rows)) & 0xFF
            self.send_bytes(b"".join(encode_frame(FRAME_OBS, s, obs[i].tobytes()) for s, i in zip(seqs, rows)))
            for s, i in zip(seqs, rows):
                f = self.read_frame()
                # An answer to an earlier exchange that timed out (QEMU stalled by a loaded host) arrives
                # late, ahead of this one's: drop it, or every later exchange would read the one before.
                while f.type == FRAME_ACTION and 0 < (s - f.seq) & 0xFF < 128:
                    self.stats.late_answers += 1
                    f = self.read_frame()
                if f.type != FRAME_ACTION or f.seq != s or len(f.payload) != struct.calcsize(ACTION_FORMAT):
                    raise self._error(f"expected the action for frame {s}, got type {chr(f.type)!r} seq {f.seq}")
                rc, a0, a1, a2, a3, t = struct.unpack(ACTION_FORMAT, f.payload)
                actions[i], rcs[i], ticks[i] = (a0, a1, a2, a3), rc, t
        return actions, rcs, ticks

    def glue_step(self, pos, quat, vel, gyro_dps, setpoint_pos, setpoint_vel, now_ms: int, setpoint_ms: int,
                  setpoint_kind: int = SETPOINT_POSITION, step: int | None = None,
                  in_flight: bool = True) -> GlueOutput:
        """One stabilizer step of the onboard controller on the MCU, with the inputs controller_oot.c
        gives it on the vehicle: estimated position (m), attitude quaternion (w, x, y, z, body to
        world), velocity (m/s, world), gyro (deg/s, body FLU), the setpoint's position and velocity,
        the time and the setpoint's time stamp (ms, uint32 clock), its kind, the stabilizer step (1 kHz
        main loop; by default ``now_ms``, as if the stabilizer started with the clock) and whether it
        flies. The glue runs the policy on the step it engages and every 10 steps after."""
        floats = np.concatenate([np.asarray(x, np.float32).reshape(-1) for x in
                                 (pos, quat, vel, gyro_dps, setpoint_pos, setpoint_vel)])
        if floats.shape != (19,):
            raise PilError(f"glue inputs: expected 3 + 4 + 3 + 3 + 3 + 3 floats, got {floats.size}")
        step = now_ms if step is None else step
        payload = floats.tobytes() + struct.pack("<IIIBB", now_ms & 0xFFFFFFFF, setpoint_ms & 0xFFFFFFFF,
                                                 step & 0xFFFFFFFF, int(bool(in_flight)), setpoint_kind)
        seq = self._seq
        self._seq = (self._seq + 1) & 0xFF
        self.send_bytes(encode_frame(FRAME_SENSORS, seq, payload))
        f = self.read_frame()
        while f.type in (FRAME_ACTION, FRAME_MOTORS) and 0 < (seq - f.seq) & 0xFF < 128:  # late, see exchange
            self.stats.late_answers += 1
            f = self.read_frame()
        if f.type != FRAME_MOTORS or f.seq != seq or len(f.payload) != struct.calcsize(MOTORS_FORMAT):
            raise self._error(f"expected the motors for frame {seq}, got type {chr(f.type)!r} seq {f.seq}")
        rc, mode, fault, *values, ticks = struct.unpack(MOTORS_FORMAT, f.payload)
        values = np.array(values, np.float32)
        return GlueOutput(mode, fault, rc, values[:4], values[4:], self.instructions(ticks))

    def check_against(self, onnx: OnnxPolicy, samples: int = 32, tol: float = MATCH_TOL) -> float:
        """Refuse an image whose policy.c is not ``onnx``'s network (a stale or swapped file next to
        the ONNX model: the image's boot self-test only checks policy.c against itself). Runs
        ``samples`` fixed observations around hover on both; returns the largest action difference."""
        rng = np.random.default_rng(0)
        hover = np.zeros(CONTRACT.obs_size, np.float32)
        hover[OBS_ROTATION] = np.eye(3, dtype=np.float32).reshape(9)
        obs = (hover + rng.normal(0.0, 0.3, (samples, CONTRACT.obs_size))).astype(np.float32)
        actions, rcs, _ = self.exchange(obs)
        if (rcs != 0).any():
            raise PilError(f"policy_step on the MCU returned {int(rcs[rcs != 0][0])} on a test observation")
        diff = float(np.abs(actions - onnx(obs)).max())
        if not diff <= tol:
            raise PilError(f"the MCU image's policy.c does not compute {onnx.path}'s policy: actions differ by "
                           f"up to {diff:.3g} (allowed {tol:g}); export the run again (python -m policies.export "
                           f"<run_dir>) so that both files come from one export")
        return diff

    def __call__(self, obs: torch.Tensor) -> torch.Tensor:
        x = obs.detach().to("cpu", torch.float32).numpy()
        t0 = time.perf_counter()
        actions, rcs, ticks = self.exchange(x)
        s = self.stats
        s.seconds += time.perf_counter() - t0
        s.steps += len(x)
        s.errors += int((rcs != 0).sum())
        s.instructions.extend(self.instructions(int(t)) for t in ticks)
        if self.onnx is not None and (rcs == 0).any():
            ok = rcs == 0
            diff = float(np.abs(actions[ok] - self.onnx(x[ok])).max())
            s.max_abs_diff = max(s.max_abs_diff, diff if math.isfinite(diff) else math.inf)  # max() would drop a NaN
        return torch.as_tensor(actions, device=obs.device)


def count_instructions_exact(elf: str | Path, function: str = "policy_self_test", timeout_s: float = 60.0) -> int:
    """Instructions executed by the first call of ``function`` (default: the boot self-test),
    counted from a single-stepped QEMU execution trace (one logged translation block per
    instruction). Independent of SysTick, to validate the tick-based count."""
    with tempfile.TemporaryDirectory() as tmp:
        log = Path(tmp) / "exec.log"
        cmd = qemu_command(Path(elf), "-singlestep", "-d", "exec,nochain", "-D", str(log))
        proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL)
        try:
            frame = FrameReader(proc.stdout.fileno()).read(timeout_s)
            if frame is None or frame.type != FRAME_BOOT:
                raise PilError(f"{elf} did not boot under the execution trace")
            proc.stdin.write(encode_frame(FRAME_QUIT, 0))
            proc.stdin.flush()
            proc.wait(timeout=timeout_s)
        finally:
            _stop(proc)
        symbols: list[str] = []
        for line in log.read_text(errors="replace").splitlines():
            if line.startswith("Trace"):
                symbols.append(line.rsplit(maxsplit=1)[-1])
            elif "rewound execution of TB" in line and symbols:
                symbols.pop()  # the block was aborted at an I/O access and is executed again
    if function not in symbols:
        raise PilError(f"{function} never ran in the trace of {elf}")
    start = symbols.index(function)
    caller = symbols[start - 1]
    end = symbols.index(caller, start)
    return end - start

