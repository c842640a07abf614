"""The failsafe descent as the real vehicle flies it: the shipped hover policy following the descending
position setpoints crazyflie_bridge sends (deploy.safety.OnboardDescent: sinking, then braking to the floor;
no velocity reference), in the torch simulator, from rest at each height and from fast sinks (STARTS), for
the nominal vehicle and corners of the hover training's randomization. It measures how long the vehicle lags its setpoint, which ONBOARD_DESCENT_LAG_S (the
no-state timer's margin, deploy/safety.py) must cover, and how fast it reaches the floor. ``--sweep``
adds the same descents along other profiles (braking, touchdown speed, flare height; the one without
braking that the bridges flew until 2026-12-02): how deploy/safety.py's were chosen.

    python -m benchmarks.onboard_descent [--sweep] [--no-write]
"""

from __future__ import annotations

import argparse
from dataclasses import replace
from pathlib import Path

import numpy as np
import torch

from benchmarks.common import write_section
from deploy.policy_node import load_onnx_policy
from deploy.safety import ONBOARD_DESCENT_LAG_S, SPIN_DOWN_S, DescentProfile, SafetyConfig
from deploy.sim_bridge import keep_on_floor
from deploy.state import make_state, observation
from sim.crazyflie.contract import POLICY_PERIOD
from sim.crazyflie.dynamics import OMEGA, POS, QUAT, RPM, STATE_DIM, VEL, VehicleBatch
from sim.crazyflie.hover import make_backend
from sim.crazyflie.params import GRAVITY, NOMINAL, action_to_rpm

POLICY = Path(__file__).resolve().parents[1] / "policies/pretrained/quad_hover/export/policy.onnx"
HEIGHTS = (1.0, 2.5)  # m: a hover, and the geofence's ceiling
# The main table's starts: from rest at HEIGHTS, and failsafes during a fast sink: at 1 m sinking at 1 m/s (on
# the braking curve's reach), and at 0.5 m sinking at 1.5 m/s (beyond it: the setpoint brakes at 2.7 m/s^2)
STARTS = tuple((h, 0.0) for h in HEIGHTS) + ((1.0, -1.0), (0.5, -1.5))
# Scales of the nominal vehicle (the hover training's randomization ranges, sim/crazyflie/hover.py).
VEHICLES = {
    "nominal": {},
    "heavy (mass x1.2)": dict(mass=1.2),
    "slow motors (tau 0.15 s)": dict(motor_tau=0.15),
    "light, fast (mass x0.9, kf x1.1, tau 0.03 s)": dict(mass=0.9, kf=1.1, motor_tau=0.03),
    "weakest (mass x1.2, kf x0.9, battery 0.85, tau 0.12 s)": dict(mass=1.2, kf=0.9, thrust_scale=0.85,
                                                                   motor_tau=0.12),
}
LANDED = SafetyConfig().landed_height  # m


def descend(policy, profile: DescentProfile, h0: float, scales: dict, vz0: float = 0.0,
            seconds: float = 5.0) -> tuple[np.ndarray, np.ndarray]:
    """Heights (m) and vertical velocities (m/s) after each 10 ms period of a descent along ``profile`` from
    ``h0`` (m) at vertical velocity ``vz0`` (m/s, up > 0), level, over sim_bridge's floor (a vehicle below
    z = 0 is put back on it at rest; the velocity recorded is the one before)."""
    backend, v = make_backend("torch", 1, NOMINAL, 1, "cpu"), VehicleBatch.nominal(1, NOMINAL)
    v.mass *= scales.get("mass", 1.0)
    v.kf *= scales.get("kf", 1.0)
    v.thrust_scale[:] = scales.get("thrust_scale", 1.0)
    v.motor_tau[:] = scales.get("motor_tau", NOMINAL.motor_tau)
    s = torch.zeros(1, STATE_DIM)
    s[0, POS.start + 2], s[0, QUAT.start], s[0, VEL.start + 2] = h0, 1.0, vz0  # level: w of (w, x, y, z)
    s[0, RPM] = float(torch.sqrt(v.mass * GRAVITY / (4 * v.kf * v.thrust_scale))[0])  # its hover speed
    backend.set_state(torch.arange(1), s, v)
    prev, zeros, z, vz = np.full(4, NOMINAL.hover_action), torch.zeros(1, 3), [], []
    for k in range(int(round(seconds / POLICY_PERIOD))):
        x = backend.state[0].double().numpy()
        setpoint = np.array([0.0, 0.0, profile.z(h0, vz0, k * POLICY_PERIOD, 0.0)])
        prev = np.clip(np.asarray(policy(observation(make_state(x[POS], x[QUAT], x[VEL], x[OMEGA], 0.0), setpoint,
                                                                  prev.astype(np.float32))), float), -1.0, 1.0)
        after = backend.step(torch.as_tensor(action_to_rpm(prev, NOMINAL.rpm_max), dtype=torch.float32)[None],
                             zeros, zeros)
        z.append(float(after[0, POS][2]))
        vz.append(float(after[0, VEL][2]))
        keep_on_floor(backend, after, v)
    return np.array(z), np.array(vz)


def first_landed(z: np.ndarray, what: str) -> int:
    """The period a descent's heights ``z`` (m) are first below landed_height; stops the benchmark with
    one line naming ``what`` if they never are."""
    if not (z < LANDED).any():
        raise SystemExit(f"error: {what} never came below {LANDED * 100:.0f} cm in {len(z) * POLICY_PERIOD:g} s")
    return int(np.argmax(z < LANDED))


def sweep(policy) -> str:
    """A table of the landing speeds and lags of every vehicle and height along other profiles."""
    shipped = DescentProfile.onboard(SafetyConfig())
    a = shipped.accel
    profiles = [("no braking (until 2026-12-02)", DescentProfile(a))]
    for brake in (a, 1.5 * a, 2.0 * a, 3.0 * a):
        for touchdown, flare in ((0.25, 0.0), (0.25, 0.1), (0.25, 0.2), (0.2, 0.15)):
            p = replace(shipped, brake=brake, touchdown=touchdown, flare=flare)
            mark = " (shipped)" if p == shipped else ""
            profiles.append((f"{brake / GRAVITY:.2g} g to {touchdown:g} m/s at {flare:g} m{mark}", p))
    rows = []
    for label, p in profiles:
        fastest, lags = [], []
        for scales in VEHICLES.values():
            for h0 in HEIGHTS:
                z, vz = descend(policy, p, h0, scales)
                k = first_landed(z, f"{label}: a vehicle from {h0:g} m")
                fastest.append(-vz[k:].min())
                lags.append((k + 1) * POLICY_PERIOD - p.fall_time(h0, 0.0))
        rows.append(f"| {label} | {p.fall_time(HEIGHTS[-1], 0.0):.2f} | {max(lags):.2f} | "
                    f"{fastest[0]:.2f}, {fastest[1]:.2f} | {max(fastest):.2f} |")
    return f"""Other profiles, the same vehicles and heights (braking to a touchdown speed at a flare height, then on at that speed):

| profile | setpoint's descent from {HEIGHTS[-1]:g} m [s] | latest below {LANDED * 100:.0f} cm after the setpoint's arrival [s] | fastest sink below {LANDED * 100:.0f} cm, nominal vehicle from {HEIGHTS[0]:g} / {HEIGHTS[-1]:g} m [m/s] | fastest sink below {LANDED * 100:.0f} cm, any vehicle [m/s] |
|---|---:|---:|---|---:|
""" + "\n".join(rows)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--sweep", action="store_true", help="also fly other descent profiles")
    ap.add_argument("--no-write", action="store_true")
    args = ap.parse_args()
    torch.set_num_threads(1)
    policy, _ = load_onnx_policy(str(POLICY))
    profile = DescentProfile.onboard(SafetyConfig())
    rows, worst = [], 0.0
    for name, scales in VEHICLES.items():
        for h0, vz0 in STARTS:
            z, vz = descend(policy, profile, h0, scales, vz0)
            k = first_landed(z, f"{name} from {h0:g} m")
            floor = profile.fall_time(h0, vz0)  # s: the setpoint reaches the floor
            timer = floor + SPIN_DOWN_S  # its time, as an open-loop descent's timer would count it
            landed = (k + 1) * POLICY_PERIOD
            worst = max(worst, landed - floor)
            t = int(round(timer / POLICY_PERIOD)) - 1
            rows.append(f"| {name} | {h0:g}, {vz0:g} | {landed - floor:.2f} | {z[t]:.2f} m, {vz[t]:.2f} m/s | {vz[k]:.2f} | "
                        f"{vz[k:].min():.2f} |")
    body = f"""Policy: `policies/pretrained/quad_hover` (its export), setpoints of `deploy.safety.OnboardDescent` (descent_thrust_ratio {SafetyConfig().descent_thrust_ratio}: sinking at {profile.accel:.2f} m/s^2, braking at {profile.brake:.2f} m/s^2 to {profile.touchdown:g} m/s at {profile.flare:g} m, then on at that speed), torch simulator, level, at hover rotor speed.

| vehicle | from [m], vertical velocity [m/s] | below {LANDED * 100:.0f} cm, after the setpoint reached the floor [s] | at the setpoint's arrival + {SPIN_DOWN_S} s: height, vertical velocity | vertical velocity below {LANDED * 100:.0f} cm [m/s] | fastest sink from there [m/s] |
|---|---:|---:|---|---:|---:|
""" + "\n".join(rows) + f"""

The latest landing comes {worst:.2f} s after the setpoint reached the floor; the no-state timer of a descent flown
onboard cuts the rotors {SPIN_DOWN_S + ONBOARD_DESCENT_LAG_S:.1f} s after it (spin-down {SPIN_DOWN_S} s + `ONBOARD_DESCENT_LAG_S`
{ONBOARD_DESCENT_LAG_S} s). Simulator figures: the real vehicle's thrust limit (firmware/README.md) is not modelled here."""
    if args.sweep:
        body += "\n\n" + sweep(policy)
    print(body)
    if not args.no_write:
        command = "python -m benchmarks.onboard_descent" + (" --sweep" if args.sweep else "")
        write_section("Onboard failsafe descent", command, body, threads=1)


if __name__ == "__main__":
    main()
