"""crazyflie_bridge: a real Crazyflie 2.x over a Crazyradio (cflib), behind the safety layer.

    python -m deploy.crazyflie_bridge --ros-args -r __ns:=/cf1 -p uri:=radio://0/80/2M/E7E7E7E7E7 \
        -p policy:=<run_dir>/export/policy.onnx

The vehicle runs the policy ONBOARD: firmware/crazyflie (controller_oot.c) built from the same
export directory flies the network whenever it receives absolute position setpoints, and cuts
the motors on a stop setpoint. Stock firmware has no way to take rotor speeds over the radio, so
this bridge streams setpoints, chosen by the same safety layer (deploy/safety.py) as policy_node:

  ARMED      position setpoint = the safety layer's setpoint (the onboard policy flies to it), every
             period: from where the policy took over (armed on the floor, or a recovery) to the
             target at takeoff_speed
  FAILSAFE   position setpoint descending from the failsafe height (deploy/safety.py, DescentProfile.onboard):
             sinking faster at (1 - r) g (r = descent_thrust_ratio) from the last valid vertical velocity
             (a climbing vehicle's setpoint starts down at once), then braking at (1 - r) g to
             ONBOARD_TOUCHDOWN_SPEED (0.25 m/s) at ONBOARD_FLARE_HEIGHT (0.1 m) and on at that speed,
             so it reaches the floor before the safety layer's descent timer, which times the same
             profile, sends the stop: without states that timer runs the descent's time, the
             spin-down and the onboard descent's lag behind its setpoint (ONBOARD_DESCENT_LAG_S),
             with them the descent ends once they show it landed (deploy/safety.py: LANDED_SAMPLES
             on the floor); at the last valid x, y.
             When the radio link itself is lost nothing reaches the vehicle and the firmware's own
             dead-man (300 ms, then the stock controller, then the supervisor's 2 s stop) takes over.
             When the onboard estimate itself is broken (BROKEN_ESTIMATE_SAMPLES rejected in a row:
             non-finite or out of range) the onboard policy would fly any setpoint on it: the rotors
             are cut instead (DISARMED). When the firmware's stock controller flies instead of the onboard
             policy (rlpolicy.mode = PID fallback in ONBOARD_FALLBACK_SAMPLES samples in a row while ARMED: the
             glue's latched fault, or setpoints it cannot fly, as without the Kalman estimator), the safety
             layer fails safe without recovery: the stock controller flies the descent setpoints
  DISARMED / ESTOP  stop setpoint (motors off)
  shutdown   (Ctrl-C, SIGTERM) in flight: the descent of a disarm first, the newest states still fed to
             the safety layer (the executor has stopped) and /status and rotor_cmd published as in flight,
             then the stop setpoint (DISARMED; cut if not landed within LANDING_LIMIT_S)

State: the onboard estimate is streamed in two log blocks every 10 ms (one radio packet holds at
most 26 bytes of log data):
  pose      stateEstimate.x, y, z (world, m), vx, vy, vz (world, m/s)       6 x float32 = 24 B
  attitude  stateEstimate.qx, qy, qz, qw (body->world), gyro.x, y, z,     4 x float32 + 3 x FP16
            rlpolicy.mode, fault (who flies, the glue's latched fault)       + 2 x uint8 = 24 B
            (gyro: body frame FLU, deg/s -> rad/s here)
and, unless estimator_settle_spread is 0 (not checked), a third every 500 ms:
  variance  kalman.varPX, varPY, varPZ (m^2)                             3 x float32 = 12 B
            arming is refused until each has spread by less than estimator_settle_spread (0.001 m^2)
            over its last 10 samples, the newest at most 1.5 s old (KalmanSettling)
Blocks sampled in the same firmware tick (timestamps within 5 ms) form one state, published as
odom (nav_msgs/Odometry, pose world, twist body per REP 105) whatever its values, which this node's
subscription then checks like any other state: a non-finite or out-of-range estimate fails safe in
the same tick (one that jumped is dropped, deploy/safety.py), and the recording shows it. The stamp is
the time the firmware sampled it (FirmwareClock, on a steady clock), put on this node's clock: a packet
the radio delivered late (retries under interference come in bursts) is as old as it is, so the safety
layer's stale check holds it back; a sample no newer than the last one is dropped (counted in ``status``
as ``rejected``: ``out_of_order``, with those the safety layer drops for the same reason; only the
latter are logged).
The radio link's state is in ``status`` (``link``: null, or why commands cannot reach the vehicle);
without a link, arming is refused and a disarm or emergency stop answers success = false (the safety
layer still takes it). A lost or failed link is opened again every ``reconnect_s`` seconds (0: never;
then restart the bridge); an attempt that has not connected within OPEN_TIMEOUT_S is closed and made
again. A reconnection arms nothing: the missing states have put the safety layer in its failsafe
meanwhile. A gap that tripped the onboard glue's dead-man (300 ms) leaves its fault latched until a stop
setpoint, and while the streamed rlpolicy.fault shows it latched the failsafe does not recover (the
stock controller, not the policy, would fly the setpoints) and arming is refused (``policy_problem``).
``auto_arm`` is refused here: a real vehicle is armed by a person (with it, a link that came back would
arm the vehicle unattended).
Setpoints go out through a thread of their own (Uplink): cflib's send blocks while its radio thread retries
a lost packet (up to 2 s per call; for good, with cflib 0.1.34, when a Crazyradio is unplugged while
connected). The executor ticks on meanwhile, a newer setpoint replaces one not yet taken, and a send blocked
for UPLINK_STALL_S is a link problem in ``status`` (arming refused, a disarm or stop "NOT delivered"). At
shutdown the waits for the last stop (STOP_FLUSH_S) and for cflib's close_link (CLOSE_LINK_S) are bounded.
rotor_cmd carries what the offboard copy of the policy commands from the streamed state: a shadow
for recording and comparison with the onboard log (rlpolicy.a1..a4), not what the motors get.
"""

from __future__ import annotations

import dataclasses
import sys
import threading
import time
from collections import deque
from collections.abc import Callable

import numpy as np

from .policy_node import ControllerNode, load_onnx_policy
from .ros import CONTROL_PUB_QOS, ODOM, param, run_node
from .safety import Command, Mode
from .state import InvalidState, State, fill_odometry, make_state, unit_quat

LOG_PERIOD_MS = 10  # the state's two blocks (STATE_BLOCKS)
LOG_BLOCKS: dict[str, list[tuple[str, str]]] = {
    "pose": [(f"stateEstimate.{v}", "float") for v in ("x", "y", "z", "vx", "vy", "vz")],
    "attitude": [(f"stateEstimate.{v}", "float") for v in ("qx", "qy", "qz", "qw")]
    + [(f"gyro.{v}", "FP16") for v in ("x", "y", "z")]
    + [("rlpolicy.mode", "uint8_t"), ("rlpolicy.fault", "uint8_t")],  # firmware/crazyflie/src/controller_oot.c
    "variance": [(f"kalman.varP{v}", "float") for v in "XYZ"],  # the Kalman filter's position variances, m^2
}
STATE_BLOCKS = ("pose", "attitude")  # paired into one state (StateAssembler)
# Arming waits until the onboard Kalman filter has settled: each position variance's spread over its last
# SETTLE_SAMPLES samples, VARIANCE_PERIOD_MS apart, below the estimator_settle_spread parameter. The figures
# (10 samples 500 ms apart, 0.001 m^2) are those with which Bitcraze's cflib examples wait for the position
# estimator before flying (wait_for_position_estimator).
VARIANCE_PERIOD_MS = 500
SETTLE_SAMPLES = 10
LOG_TYPE_BYTES = {"float": 4, "FP16": 2, "uint8_t": 1}
# rlpolicy.mode and .fault (firmware/crazyflie/src/cf_policy_glue.h: cfp_mode_t, cfp_fault_t)
ONBOARD_MODES = ("idle", "policy", "PID fallback")
ONBOARD_FAULTS = ("none", "dead-man", "policy error")
ONBOARD_FALLBACK = 2
# Consecutive attitude samples (10 ms apart) showing the stock controller flying while ARMED after which the
# bridge fails safe: a sample or two may still be from before the arming's first setpoint arrived.
ONBOARD_FALLBACK_SAMPLES = 3
MAX_LOG_BLOCK_BYTES = 26  # CRTP log data packet: 30 bytes minus block id and 3-byte timestamp
PAIR_TOLERANCE_MS = 5
# s: a link attempt that has not connected by then is closed and made again. cflib's set-up (the platform
# information, then the log, memory and parameter tables of contents, fetched anew: no cache) has no
# timeout of its own and waits for ever for an answer that does not come.
OPEN_TIMEOUT_S = 15.0
# s: a link that cflib has dropped but not marked closed for this long was never opened. cflib marks a
# link closed microseconds after it reports the link's failure, but an open that fails inside open_link
# (no link driver: the dongle busy with another program, unplugged, a USB error) leaves it INITIALIZED.
UNCLOSED_S = 1.0
# Consecutive rejected samples of the onboard estimate after which it counts as broken: a single
# glitch is left to the failsafe and its recovery (the onboard policy flew on it for one sample anyway).
BROKEN_ESTIMATE_SAMPLES = 3
# A descent at shutdown ends by this time (s), inside the launch runner's 5 s from SIGINT to SIGTERM:
# from the geofence's 2.5 m ceiling at rest its timer runs 3.29 s of braked descent, 0.3 s of spin-down and
# the 0.8 s lag, 4.39 s (deploy/safety.py, ONBOARD_DESCENT_LAG_S; tested). A vehicle climbing there is timed
# longer (its rise counted as the open-loop descent's, at (1 - ratio) g; 4.5 s at 0.1 m/s) while its setpoint
# still goes down at once from 2.5 m: this limit then cuts the rotors first, 1.2 s after the setpoint reached
# the floor, more than the 0.27 s the simulated vehicles lagged it.
LANDING_LIMIT_S = 4.5
# s: at shutdown the stop setpoint is sent every period for this long before the link closes. cflib's radio
# thread sends the queued packets one at a time and retries each until acknowledged; closing the link stops
# the thread and empties its queue (RadioDriver.close), so a stop sent once, right before, can be lost with
# one unacknowledged packet, and the onboard policy would fly on to the 300 ms dead-man and the stock PID.
# cflib's own examples wait 0.1 s after their last setpoint for the same reason.
STOP_REPEAT_S = 0.15
# s: a setpoint that cflib has not taken for this long (Uplink.blocked_for) counts as a link problem: arming is
# refused and a disarm or stop answers "NOT delivered" meanwhile. cflib's radio thread retries an unacknowledged
# packet up to 100 times before it reports the link lost, and its one-packet queue blocks the next setpoint
# meanwhile (RadioDriver.send_packet, up to 2 s). Ten control periods; the onboard dead-man waits 300 ms.
UPLINK_STALL_S = 0.1
# s: at shutdown, how long the last stop setpoint may wait for cflib to take it before the link is closed anyway
STOP_FLUSH_S = 0.5
# s: at shutdown, how long cflib's close_link may take. It sends a last setpoint under the lock a blocked send
# holds, and with a Crazyradio unplugged its link-error handling can wait for a radio thread that has died:
# it would never return. Past this it is left to itself in a daemon thread, and the node exits.
CLOSE_LINK_S = 0.5


class Uplink:
    """Setpoints to the vehicle, handed to cflib by a thread of their own: cflib's send blocks while its radio
    thread retries a packet (one-packet queue, up to 2 s per call), which in the executor would stop the
    ticks, the state checks and the services with it. A setpoint not yet taken is replaced by a newer one
    (``replaced`` counts them): one computed before a stall is stale once the stall ends. A send that raises
    is kept for ``take_error``; the thread goes on with the next setpoint. Each setpoint is posted for a
    link, numbered by ``epoch``: ``discard`` (the link lost) drops the one waiting and starts a new epoch,
    and a setpoint posted for an older epoch is dropped (its sender read the link as up just before)."""

    def __init__(self, commander, clock: Callable[[], float] = time.monotonic):
        self._commander, self._clock = commander, clock
        self._cond = threading.Condition()
        self._pending: tuple[str, tuple] | None = None  # (commander method, its arguments)
        self._sending_since: float | None = None  # when the send under way started (``clock``)
        self._error: str | None = None
        self._closed = False
        self.replaced = 0
        self.epoch = 0
        self._thread = threading.Thread(target=self._run, name="crazyflie-uplink", daemon=True)
        self._thread.start()

    def position(self, epoch: int, x: float, y: float, z: float) -> None:
        """Position setpoint (world, m), yaw 0, for the link of ``epoch``: the onboard policy flies to it."""
        self._post(epoch, "send_position_setpoint", (x, y, z, 0.0))

    def stop(self, epoch: int) -> None:
        """Stop setpoint for the link of ``epoch``: the motors off (and the onboard glue's latched fault cleared)."""
        self._post(epoch, "send_stop_setpoint", ())

    def _post(self, epoch: int, method: str, args: tuple) -> None:
        with self._cond:
            if self._closed:
                raise RuntimeError("the uplink is closed")
            if epoch != self.epoch:  # for a link lost since its sender looked
                return
            self.replaced += self._pending is not None
            self._pending = (method, args)
            self._cond.notify_all()

    def discard(self) -> None:
        """The link is lost: drop the setpoint not yet taken, and any posted for it later (a new epoch)."""
        with self._cond:
            self._pending = None
            self.epoch += 1
            self._cond.notify_all()

    def alive(self) -> bool:
        """Whether the thread still runs (after ``close``: a send still blocked in cflib)."""
        return self._thread.is_alive()

    def _run(self) -> None:
        while True:
            with self._cond:
                while self._pending is None and not self._closed:
                    self._cond.wait()
                if self._pending is None:  # closed, nothing left to send
                    return
                (method, args), self._pending = self._pending, None
                self._sending_since = self._clock()
            error = None
            try:
                getattr(self._commander, method)(*args)
            except Exception as e:  # a radio error: the bridge's tick reports it (take_error)
                error = f"{type(e).__name__}: {e}"
            with self._cond:
                self._sending_since = None
                self._error = error or self._error
                self._cond.notify_all()

    def blocked_for(self) -> float:
        """Seconds the send under way has taken so far (0 while idle)."""
        since = self._sending_since
        return 0.0 if since is None else max(self._clock() - since, 0.0)

    def take_error(self) -> str | None:
        """The last send's error since the last call, if one raised."""
        with self._cond:
            error, self._error = self._error, None
            return error

    def flush(self, timeout: float) -> bool:
        """Wait until the newest setpoint has been handed to cflib (at most ``timeout`` s); True if it was."""
        with self._cond:
            return self._cond.wait_for(lambda: self._pending is None and self._sending_since is None, timeout)

    def close(self, timeout: float) -> None:
        """No more setpoints; the thread ends once the last one is sent (waited for at most ``timeout`` s: a
        send blocked in cflib ends with cflib's 2 s time-out, or never with a Crazyradio unplugged)."""
        with self._cond:
            self._closed = True
            self._cond.notify_all()
        self._thread.join(timeout)


def state_from_log(pose: dict, attitude: dict, stamp: float) -> State:
    """Two log blocks (cflib data dicts) -> State in SI units, NOT checked: the bridge publishes every
    sample as odom and its own subscription checks it like any other state (make_state), so a bad
    sample reaches the safety layer in order, in the same tick, and the recording keeps it."""
    g = attitude
    q = np.array([g["stateEstimate.qw"], g["stateEstimate.qx"], g["stateEstimate.qy"], g["stateEstimate.qz"]],
                 dtype=np.float64)
    return State(
        np.array([pose["stateEstimate.x"], pose["stateEstimate.y"], pose["stateEstimate.z"]], dtype=np.float64),
        unit_quat(q),  # normalised as make_state does, so that the odometry round trip is exact
        np.array([pose["stateEstimate.vx"], pose["stateEstimate.vy"], pose["stateEstimate.vz"]], dtype=np.float64),
        np.radians(np.array([g[f"gyro.{a}"] for a in "xyz"], dtype=np.float64)),
        stamp,
    )


class FirmwareClock:
    """The time a log sample was taken (s, on the steady clock its arrivals are given on) from its
    firmware timestamp (ms since the vehicle booted, 24 bits in the log packet: it wraps after 4.66 h)
    and its arrival: firmware time plus the smallest offset (arrival minus firmware time) seen so far,
    that of the quickest delivery, so that a late delivery keeps its age. The offset may rise by
    ``DRIFT`` per second of firmware time (a firmware crystal slower than the host's; STM32 crystals
    are specified to tens of ppm), otherwise it would only ever fall. Arrivals on a steady clock: a
    step of the system clock (NTP) would otherwise age every later sample by the step."""

    DRIFT = 1e-4  # s/s
    WRAP = 1 << 24  # ms: cflib reads the log timestamp from 3 bytes

    def __init__(self):
        self.offset: float | None = None  # s
        self.last_raw: int | None = None  # the last sample's timestamp as sent (ms, 24 bits)
        self.ms = 0  # the last sample's firmware time, unwrapped (ms)

    def stamp(self, timestamp_ms: int, arrival: float) -> float | None:
        """The sample's time (s, the arrival's clock), or None for a sample no newer than the last
        (late or repeated: up to half the wrap, 2.3 h, behind it)."""
        if self.last_raw is None:
            self.ms = timestamp_ms
        else:
            ahead = (timestamp_ms - self.last_raw) % self.WRAP
            if ahead == 0 or ahead >= self.WRAP // 2:
                return None
            self.ms += ahead
        self.last_raw = timestamp_ms
        t = self.ms * 1e-3
        seen = arrival - t
        if self.offset is None:
            self.offset = seen
        else:
            self.offset = min(seen, self.offset + self.DRIFT * ahead * 1e-3)
        return t + self.offset


def _name(names: tuple[str, ...], value: int) -> str:
    return names[value] if 0 <= value < len(names) else f"unknown {value}"


class StateAssembler:
    """Pairs the two log blocks of one firmware tick; ``feed`` returns a State when a pair completes,
    stamped with its sampling time (FirmwareClock), or None (no pair yet, or a sample no newer than
    the last: ``dropped`` counts those)."""

    def __init__(self):
        self.latest: dict[str, tuple[int, dict]] = {}
        self.clock = FirmwareClock()
        self.dropped = 0

    def feed(self, block: str, timestamp_ms: int, data: dict, arrival: float) -> State | None:
        """``arrival``: when the block was received (s, a steady clock); the State's stamp is on that clock."""
        if block not in STATE_BLOCKS:
            raise ValueError(f"unknown log block '{block}'")
        self.latest[block] = (timestamp_ms, data)
        if len(self.latest) < len(STATE_BLOCKS):
            return None
        (tp, pose), (ta, att) = self.latest["pose"], self.latest["attitude"]
        if abs(tp - ta) > PAIR_TOLERANCE_MS:
            return None
        self.latest.clear()
        stamp = self.clock.stamp(min(tp, ta), arrival)  # the older block's time: its age is not understated
        if stamp is None:
            self.dropped += 1
            return None
        return state_from_log(pose, att, stamp)


class KalmanSettling:
    """Whether the onboard Kalman filter's position estimate has settled: each of kalman.varPX, varPY,
    varPZ (m^2) spread by less than ``spread`` over its last SETTLE_SAMPLES samples (0: not checked).
    Just after power-on, a reset or a move of the vehicle, the variances are still falling and the
    estimate still moving; the onboard policy would fly on it. Samples that stopped coming for
    STALE_PERIODS periods judge nothing."""

    STALE_PERIODS = 3

    def __init__(self, spread: float):
        self.spread = spread
        self.history: deque[tuple[float, float, float]] = deque(maxlen=SETTLE_SAMPLES)
        self.last_arrival: float | None = None  # s, the caller's steady clock

    def feed(self, data: dict, arrival: float) -> None:
        """One variance sample, received at ``arrival`` (s, a steady clock)."""
        self.history.append(tuple(float(data[f"kalman.varP{v}"]) for v in "XYZ"))
        self.last_arrival = arrival

    def problem(self, now: float) -> str | None:
        """Why the estimate does not count as settled at ``now`` (s, feed's clock), or None."""
        if self.spread <= 0:
            return None
        window = f"{SETTLE_SAMPLES} samples {VARIANCE_PERIOD_MS} ms apart"
        if len(self.history) < SETTLE_SAMPLES:
            return f"the onboard Kalman filter has not settled yet ({len(self.history)} of {window} so far)"
        age = now - self.last_arrival
        if not age < self.STALE_PERIODS * VARIANCE_PERIOD_MS * 1e-3:
            return f"no variance sample of the onboard Kalman filter for {age:.1f} s: its settling is unknown"
        h = np.array(self.history)
        spread = h.max(axis=0) - h.min(axis=0)
        if not np.isfinite(h).all() or (spread >= self.spread).any():
            return (f"the onboard Kalman filter has not settled: its position variances (x, y, z) spread by "
                    f"{', '.join(f'{v:.2g}' for v in spread)} m^2 over the last {window} (below "
                    f"{self.spread:g} needed: estimator_settle_spread)")
        return None


class CrazyflieBridge(ControllerNode):
    ONBOARD_DESCENT = True  # the onboard policy flies the failsafe descent

    def __init__(self):
        super().__init__("crazyflie_bridge", load_onnx_policy)
        import cflib.crtp
        from cflib.crazyflie import Crazyflie
        from nav_msgs.msg import Odometry

        self.uri = param(self, "uri", "radio://0/80/2M/E7E7E7E7E7", "Crazyradio link URI")
        self.reconnect_s = float(param(self, "reconnect_s", 2.0, "s between attempts to open a lost link (0: never)"))
        if not self.reconnect_s >= 0:
            raise ValueError(f"reconnect_s {self.reconnect_s:g}: expected >= 0 s (0: never reconnect)")
        self.settle_spread = float(param(self, "estimator_settle_spread", 1e-3,
                                         "m^2: arming waits until each onboard Kalman position variance spreads "
                                         f"by less over its last {SETTLE_SAMPLES} samples (0: not checked)"))
        if not self.settle_spread >= 0:
            raise ValueError(f"estimator_settle_spread {self.settle_spread:g}: expected >= 0 m^2 (0: not checked)")
        self._settling = KalmanSettling(self.settle_spread)
        if self.controller.cfg.auto_arm:
            raise ValueError("auto_arm: a real vehicle is armed by a call to the arm service, never automatically "
                             "(a radio link that comes back would arm it unattended)")
        if self.controller.cfg.max_action < 1.0:  # the onboard policy flies the motors; its glue clips to [-1, 1]
            raise ValueError(f"max_action {self.controller.cfg.max_action:g}: the real vehicle's onboard policy "
                             "does not take it (firmware/crazyflie clips actions to [-1, 1]); leave it at 1")
        self._odom_pub = self.create_publisher(Odometry, ODOM, CONTROL_PUB_QOS)
        self._odom_msg = Odometry
        self._assembler = StateAssembler()
        self._lock = threading.Lock()
        # Rejected samples of the onboard estimate in a row; once there were
        # BROKEN_ESTIMATE_SAMPLES, the estimate counts as broken while the failsafe lasts: the onboard
        # policy flies on it, so no setpoint can bring the vehicle down.
        self._bad_samples = 0
        self._estimate_broken: str | None = None
        self._onboard: tuple[int, int] | None = None  # the newest rlpolicy (mode, fault) streamed
        self._fallback_samples = 0  # consecutive samples with rlpolicy.mode = PID fallback
        self._last_odom = None  # the newest odom published (shutdown feeds it to the safety layer itself)
        self.connected = False
        self._link = "not connected yet"  # why commands cannot reach the vehicle
        self._opening_since: float | None = None  # when the open_link under way started (self._steady)
        self._unclosed_since: float | None = None  # when cflib last reported the link down (None: opened since)
        self._closing = False  # shutdown: no more attempts
        self._closer: threading.Thread | None = None  # the last close_link, in a thread of its own (_start_close)
        self._close_reason: str | None = None  # why that close was made: the status keeps it, not cflib's "disconnected"
        # Counts the closes started and the link failures reported, under the lock: a link set-up finishing in
        # cflib's thread meanwhile (_on_connected) does not mark that link connected
        self._link_lock = threading.Lock()
        self._link_epoch = 0
        self._steady = time.monotonic  # the clock log arrivals are timed on (FirmwareClock)

        if self.uri.startswith("radio://"):
            from cflib.drivers.crazyradio import get_serials

            if not get_serials():
                raise ValueError(f"no Crazyradio dongle found for {self.uri}: plug one in (and check the USB "
                                 "permissions: Bitcraze's udev rules)")
        cflib.crtp.init_drivers()
        self.cf = Crazyflie(rw_cache=None)
        self._uplink = Uplink(self.cf.commander)
        self.cf.connected.add_callback(self._on_connected)
        self.cf.disconnected.add_callback(self._on_disconnected)
        self.cf.connection_failed.add_callback(lambda uri, msg: self._on_link(f"connection to {uri} failed: {msg}"))
        self.cf.connection_lost.add_callback(lambda uri, msg: self._on_link(f"link to {uri} lost: {msg}"))
        # a link error after cflib counted the link as closed (an attempt started in a callback's wake)
        self.cf.disconnected_link_error.add_callback(lambda uri, msg: self._on_link(f"link to {uri} failed: {msg}"))
        self._open_link()
        if self.reconnect_s > 0:
            self.create_timer(self.reconnect_s, self._retry_link)

    # ------------------------------------------------------------------ radio (cflib threads)
    def _open_link(self) -> None:
        self._opening_since = self._steady()  # before the call: cflib may report a failure from inside it
        self._unclosed_since = None
        self.get_logger().info(f"connecting to {self.uri}")
        self.cf.open_link(self.uri)

    def _retry_link(self) -> None:
        """Timer: open the link again when it is down, no attempt is under way and cflib has finished
        with the last link (it reports a failure before it marks the link closed; one that failed to open
        it never marks: UNCLOSED_S); close an attempt that has hung for OPEN_TIMEOUT_S, or a link given up
        on, without waiting for the close (_start_close): a call after it has returned opens again."""
        from cflib.crazyflie import State

        if self.connected or self._closing or self._closer_busy():
            return
        if self._opening_since is not None:
            if self._steady() - self._opening_since >= OPEN_TIMEOUT_S:
                self._start_close(f"connection to {self.uri} timed out: not connected after {OPEN_TIMEOUT_S:g} s")
            return
        if self.cf.state == State.DISCONNECTED:
            self._open_link()
        elif self.cf.state in (State.CONNECTED, State.SETUP_FINISHED) and self.cf.link is not None:
            # A link given up on (its log blocks failed; cflib 0.1.34 leaves a set-up link CONNECTED and never
            # sets SETUP_FINISHED): closed from here (cflib's own thread, where that is found, cannot close it:
            # close_link joins that thread), opened next time
            self._start_close(self._link)
        elif (self.cf.link is None and self._unclosed_since is not None
              and self._steady() - self._unclosed_since >= UNCLOSED_S):
            self._open_link()

    def _start_close(self, why: str | None) -> threading.Thread:
        """Start cflib's close_link in a thread of its own and return that thread: the close can block (it
        sends a setpoint under the lock a blocked send holds, and joins cflib's threads, ~1 s), and the
        executor ticks the safety layer meanwhile. ``why`` is the status until a new link is made (None:
        the shutdown's close, whose "disconnected" is then not logged, after the node's summary line)."""
        if why is not None:
            self._on_link(why)

        def close() -> None:
            try:
                self.cf.close_link()
            except Exception as e:  # cflib's state then decides what the timer does (a link left: closed again)
                self.get_logger().error(f"closing the radio link failed: {type(e).__name__}: {e}")
            finally:
                self._close_reason = None

        with self._link_lock:  # a set-up under way in cflib's thread then does not mark the link connected
            self._link_epoch += 1
            self._close_reason = self._link if why is None else why
            self._closer = threading.Thread(target=close, name="crazyflie-close", daemon=True)
            self._closer.start()
        return self._closer

    def _closer_busy(self) -> bool:
        """Whether the last close_link has not returned: no new link until it has (cflib's link object
        is still the old one). Read-only: cflib's threads call it too."""
        closer = self._closer
        return closer is not None and closer.is_alive()

    def _log_configs(self) -> list:
        """The log blocks (the variances' only when checked), new for each link: cflib marks a block added
        to a link, and the firmware forgets its blocks when a new link resets its logging."""
        from cflib.crazyflie.log import LogConfig

        configs = []
        for block, variables in LOG_BLOCKS.items():
            if block == "variance" and self.settle_spread <= 0:
                continue
            conf = LogConfig(name=block, period_in_ms=VARIANCE_PERIOD_MS if block == "variance" else LOG_PERIOD_MS)
            for name, fetch_as in variables:
                conf.add_variable(name, fetch_as)
            conf.data_received_cb.add_callback(self._on_log)
            conf.error_cb.add_callback(self._on_log_refused)
            configs.append(conf)
        return configs

    def _on_connected(self, uri: str) -> None:
        """cflib's thread: the link is set up. Its log blocks are added and started; the link counts as
        connected unless a close started meanwhile (the timer's, for a set-up that took OPEN_TIMEOUT_S, or
        the shutdown's) or a failure was reported (cflib's link error, in its radio thread; a log block
        refused): that close or failure may already be over, and a link marked connected after it would
        never be opened again."""
        with self._link_lock:  # the link failed, or is being closed, as its set-up finished
            if self._closing or self.cf.link is None or self._closer_busy():
                return
            epoch = self._link_epoch
        with self._lock:
            self._assembler = StateAssembler()  # a new link: the firmware's clock may have restarted
        self._settling = KalmanSettling(self.settle_spread)  # (the vehicle may have been reset or moved)
        self._onboard, self._fallback_samples = None, 0
        configs = self._log_configs()
        try:
            for conf in configs:  # every block added before any starts: a failure leaves none streaming
                self.cf.log.add_config(conf)  # KeyError: a variable not in the firmware's log table
        except (KeyError, AttributeError) as e:  # (AttributeError: a block cflib finds too large)
            # Raised here, cflib's thread would only log it to Python's logging, and the bridge would wait
            # for a state that never comes ("not connected yet", then a time-out) instead of saying why.
            self._on_link(f"the log blocks could not be set up on {uri}: {e} (firmware older than "
                          "this bridge's LOG_BLOCKS? Without the Kalman filter's kalman.varP*: "
                          "estimator_settle_spread=0)")
            return
        for conf in configs:
            conf.start()
        with self._link_lock:
            if self._link_epoch != epoch:
                return
            self.connected, self._opening_since = True, None
        self.get_logger().info(f"connected to {uri}, streaming the state estimate every {LOG_PERIOD_MS} ms")

    def _on_log_refused(self, conf, msg: str) -> None:
        """cflib: the firmware refused to create log block ``conf`` (out of memory, a block too long): no
        state would come over this link; _retry_link closes it and opens another."""
        self._on_link(f"the Crazyflie refused the log block {conf.name!r}: {msg}")

    def _on_disconnected(self, uri: str) -> None:
        """cflib's disconnected callback (close_link calls it): a close of ours keeps why it was made."""
        reason = self._close_reason  # (read once: the closing thread clears it)
        self._on_link(f"disconnected from {uri}" if reason is None else reason)

    def _on_link(self, what: str) -> None:
        # cflib's messages end in a traceback after a blank line ("Couldn't load link driver: <why>\n\n<traceback>",
        # its drivers' "...unplugged!\nException: <why>\n\n<traceback>"): what comes before it, as one line, goes to
        # the log, /status and the services' answers
        head = what.strip().split("\n\n", 1)[0]
        what = "; ".join(line.strip() for line in head.splitlines() if line.strip())
        if what != self._link:  # a retry failing as the last one did (a dongle unplugged) is not logged again
            self.get_logger().error(what)
        with self._link_lock:
            self._link_epoch += 1
            self.connected, self._opening_since, self._link = False, None, what
        self._uplink.discard()
        self._unclosed_since = self._steady()  # cflib has dropped the link: marked closed within microseconds, or never

    def link_problem(self) -> str | None:
        if self.connected:
            blocked = self._uplink.blocked_for()
            if blocked < UPLINK_STALL_S:
                return None
            return (f"the radio has not taken a setpoint for {blocked:.2f} s (cflib retrying a lost packet; "
                    f"{self._uplink.replaced} setpoints replaced by newer ones so far)")
        then = f"reconnecting every {self.reconnect_s:g} s" if self.reconnect_s > 0 else "restart the bridge"
        if self._closer_busy():
            then = f"the last link has not closed yet (cflib), then {then}"
        return f"no radio link ({self._link}); {then}"

    def _on_log(self, timestamp_ms: int, data: dict, conf) -> None:
        if conf.name == "variance":
            self._settling.feed(data, self._steady())
            return
        arrival = self._steady()
        if conf.name == "attitude":
            self._onboard = (int(data["rlpolicy.mode"]), int(data["rlpolicy.fault"]))
            self._fallback_samples = self._fallback_samples + 1 if self._onboard[0] == ONBOARD_FALLBACK else 0
        with self._lock:
            dropped = self._assembler.dropped
            state = self._assembler.feed(conf.name, timestamp_ms, data, arrival)
            if self._assembler.dropped > dropped:
                self.rejected["out_of_order"] = self.rejected.get("out_of_order", 0) + 1
        if state is not None:  # checked where every odom is, on the executor (ControllerNode._on_odom)
            try:
                make_state(state.pos, state.quat, state.vel, state.omega, state.stamp)
                self._bad_samples = 0
                if self.controller.mode is not Mode.FAILSAFE:  # a latch from before a new flight goes
                    self._estimate_broken = None
            except InvalidState as e:
                self._bad_samples += 1
                if self._bad_samples >= BROKEN_ESTIMATE_SAMPLES and self._estimate_broken is None:
                    self._estimate_broken = f"{self._bad_samples} samples in a row, the last: {e}"
            age = self._steady() - state.stamp  # its stamp onto this node's clock, which that check compares it with
            state = dataclasses.replace(state, stamp=self.get_clock().now().nanoseconds * 1e-9 - age)
            msg = fill_odometry(self._odom_msg(), state, self.world_frame, self.robot)
            self._last_odom = msg
            self._odom_pub.publish(msg)

    def arm_problem(self) -> str | None:
        """As every controller node's, and the onboard Kalman filter not settled (KalmanSettling)."""
        return super().arm_problem() or self._settling.problem(self._steady())

    def policy_problem(self) -> str | None:
        """The onboard glue's latched fault (until a stop setpoint clears it, sent every period while
        disarmed, the stock controller flies every setpoint), or the stream showing the stock controller
        flying: arming is refused and a failsafe lands without recovering meanwhile."""
        onboard = self._onboard
        if onboard is None or onboard[1] == 0:
            return self._onboard_fallback()
        fault = _name(ONBOARD_FAULTS, onboard[1])
        return f"the onboard policy has a latched fault ({fault}): cleared by a stop setpoint"

    def _onboard_fallback(self) -> str | None:
        """Why the stock controller flies instead of the onboard policy, if the stream shows it does."""
        if self._fallback_samples < ONBOARD_FALLBACK_SAMPLES:
            return None
        fault = self._onboard[1] if self._onboard is not None else 0
        why = f"fault: {_name(ONBOARD_FAULTS, fault)}" if fault else "a setpoint it cannot fly (Kalman estimator off?)"
        return f"the stock controller flies, not the onboard policy ({why}; {self._fallback_samples} samples)"

    # ------------------------------------------------------------------ actuation
    def actuate(self, cmd: Command, now: float) -> None:
        epoch = self._uplink.epoch  # read before the link's state: a loss reported in between drops the setpoint
        if not self.connected:
            return
        fallback = self._onboard_fallback()
        if cmd.mode is Mode.ARMED and fallback is not None:
            self.controller.fail_safe(fallback, now)  # its descent setpoints, flown by the stock controller
            cmd = dataclasses.replace(cmd, mode=self.controller.mode)
        broken = self._estimate_broken
        if cmd.mode is Mode.FAILSAFE and broken is not None:
            # The onboard policy (and the stock PID it falls back to) would fly a descent setpoint on the
            # broken estimate: far from where the vehicle is, it may fly off hard. Cut instead.
            self.controller.cut(f"onboard state estimate broken ({broken}): no setpoint can land on it")
            cmd = dataclasses.replace(cmd, mode=self.controller.mode)
        if cmd.mode is not Mode.FAILSAFE:  # recovered on valid states, or the rotors are off
            self._estimate_broken = None
        descent = self.descent.setpoint(cmd, self.controller, now)
        if descent is not None:
            self._uplink.position(epoch, *descent)
        elif cmd.mode is Mode.ARMED:
            self._uplink.position(epoch, *self.controller.setpoint(now))
        else:
            self._uplink.stop(epoch)
        error = self._uplink.take_error()
        if error is not None:  # an earlier setpoint's send raised: the tick logs it (ControllerNode._tick)
            raise RuntimeError(f"setpoint not sent: {error}")

    def close(self) -> None:
        self._closing = True
        try:
            if self.connected:
                self.descend_before_stop()
        finally:  # a second Ctrl-C cuts the descent short, not the stop setpoint
            try:
                if self.connected:
                    self.send_stops()
            finally:  # nor the link's closing (a third one)
                self._uplink.close(STOP_FLUSH_S)  # the last stop handed to cflib first
                self._close_link()
        # The summary line last: where the launch runner died, its output pipe is gone and printing
        # raises (BrokenPipeError), which before the descent skipped the descent and the stop setpoint.
        super().close()

    def _close_link(self) -> None:
        """cflib's close_link (or the one the timer started, if it has not returned), waited for at most
        CLOSE_LINK_S (then left to itself: the node exits)."""
        closer = self._closer
        closing = closer if closer is not None and closer.is_alive() else self._start_close(None)
        closing.join(CLOSE_LINK_S)
        if closing.is_alive():
            stuck = " (a setpoint's send is still blocked in cflib)" if self._uplink.alive() else ""
            self.get_logger().error(f"the radio link did not close within {CLOSE_LINK_S:g} s{stuck}: exiting "
                                    "without it; the onboard dead-man stops the vehicle if it still flies")

    def send_stops(self) -> None:
        """The stop setpoint once a period for STOP_REPEAT_S (at least twice), so that one reaches the
        vehicle before the link closes; each waits (up to a period) for cflib to take it, so that the next
        does not replace it."""
        for k in range(max(2, round(STOP_REPEAT_S / self.period))):
            if k:
                time.sleep(self.period)
            self._uplink.stop(self._uplink.epoch)
            self._uplink.flush(self.period)

    def descend_before_stop(self) -> None:
        """Stopped in flight (Ctrl-C, SIGTERM): the controlled descent of a disarm, then the caller's
        stop setpoint, which alone would cut the motors at height. The executor has stopped, so this
        loop hands the safety layer the newest state itself (as the odom subscription would): the
        descent ends when a state shows the vehicle on the floor, or on its timer if none arrives,
        bounded below the launch runner's SIGINT-to-SIGTERM time. Every mode change reaches /status, and
        each period's shadow rotor_cmd is published, so a recording holds the landing."""
        c = self.controller
        if c.mode not in (Mode.ARMED, Mode.FAILSAFE):
            return
        c.disarm(self._now())
        self._report_change()
        deadline = time.monotonic() + LANDING_LIMIT_S
        fed, published_error, send_error = self._last_odom, False, ""
        while c.mode is Mode.FAILSAFE and time.monotonic() < deadline:
            msg = self._last_odom
            if msg is not fed:
                fed = msg
                self._on_odom(msg)
            now = self._now()
            cmd = c.tick(now)
            try:  # the vehicle first; an earlier send's radio error (reported here) does not end the landing
                self.actuate(cmd, now)
            except RuntimeError as e:
                if str(e) != send_error:
                    self.get_logger().error(f"shutdown landing: {e}")
                send_error = str(e)
            try:  # then the record (rotor_cmd, /status), which must not end the landing if it fails
                self._publish_tick(cmd)
            except Exception as e:
                if not published_error:
                    self.get_logger().error(f"shutdown landing: publishing failed ({type(e).__name__}: {e})")
                published_error = True
            time.sleep(self.period)
        if c.mode is Mode.FAILSAFE:  # neither on the floor nor timed out by then: the caller's stop cuts the rotors
            c.cut(f"shutdown: not landed within {LANDING_LIMIT_S:g} s")
            self._report_change()


def main() -> int:
    from export.onnx_policy import ContractError

    return run_node(CrazyflieBridge, (ContractError,))


if __name__ == "__main__":
    sys.exit(main())
