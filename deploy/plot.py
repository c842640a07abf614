"""Plot a recorded flight: ``python -m deploy.plot <bag.mcap> [-o out.png] [--robot cf1] [--run K]``.

Three panels over time (s, the recording's clock; odometry at its header stamps): position (world, m) with the target,
attitude (roll, pitch, yaw in degrees from the odometry quaternion, ZYX convention) and the
rotor speed commands (rpm, M1..M4). Failsafe periods from the status topic are shaded.
Writes <bag>.png next to the bag unless -o is given, and prints the path. A recording that was
never finished (its recorder killed) is plotted up to where it ends, with a warning. Where the recording's
clock went back (a simulator restarted under the recorder), each part is a run of its own (read_flight):
the last is plotted, with a warning, unless --run names another.
"""

from __future__ import annotations

import argparse
import json
import math
import struct
import sys
from pathlib import Path

import numpy as np


def euler_zyx_deg(q: np.ndarray) -> np.ndarray:
    """Quaternions (w, x, y, z) [N, 4] -> roll, pitch, yaw [N, 3] in degrees (yaw-pitch-roll, ZYX)."""
    w, x, y, z = q.T
    roll = np.arctan2(2 * (w * x + y * z), 1 - 2 * (x * x + y * y))
    pitch = np.arcsin(np.clip(2 * (w * y - z * x), -1.0, 1.0))
    yaw = np.arctan2(2 * (w * z + x * y), 1 - 2 * (y * y + z * z))
    return np.degrees(np.stack((roll, pitch, yaw), axis=-1))


MCAP_MAGIC = b"\x89MCAP0\r\n"  # the first bytes of every MCAP file (the MCAP specification)
# s a clock must go back by to start a new run: a restarted simulator's goes back to 0, while a radio link's
# stamps jitter by milliseconds
RUN_BREAK_S = 0.5


def _messages(bag: Path, topics: list[str]) -> tuple[list, bool]:
    """Decoded messages of ``topics`` in the order they were recorded, and whether the file was finished.
    A recording whose recorder was killed has no summary: it is read from the start up to where it
    breaks off."""
    from mcap.exceptions import McapError
    from mcap.reader import NonSeekingReader, make_reader
    from mcap_ros2.decoder import DecoderFactory

    try:
        with bag.open("rb") as f:
            return list(make_reader(f, decoder_factories=[DecoderFactory()]).iter_decoded_messages(
                topics=topics, log_time_order=False)), True
    except Exception:  # no summary, or a damaged one (McapError, struct.error, UnicodeDecodeError, ...)
        pass
    messages = []
    with bag.open("rb") as f:
        try:
            for m in NonSeekingReader(f, decoder_factories=[DecoderFactory()]).iter_decoded_messages(
                    topics=topics, log_time_order=False):
                messages.append(m)
        except (McapError, EOFError, struct.error):  # the end of what was written (a record cut short)
            pass
    if not messages:
        with bag.open("rb") as f:
            if f.read(len(MCAP_MAGIC)) != MCAP_MAGIC:
                raise ValueError("no MCAP file (its first bytes are not MCAP's magic)")
    return messages, False


def _topics(bag: Path) -> list[str]:
    """The topics of the messages a recording holds (up to where it breaks off, if it does)."""
    from mcap.reader import NonSeekingReader

    seen: set[str] = set()
    with bag.open("rb") as f:
        try:
            for _schema, channel, _message in NonSeekingReader(f).iter_messages(log_time_order=False):
                seen.add(channel.topic)
        except Exception:  # the end of what was written (a record cut short)
            pass
    return sorted(seen)


def _run_at(runs: list[tuple[list, list, list]], clock: float, last: float) -> tuple[list, list, list]:
    """The lists of the run a message at ``clock`` (s) goes to, the one before at ``last``: a new run at the
    first message and where the clock went back by more than RUN_BREAK_S."""
    if not runs or clock < last - RUN_BREAK_S:
        runs.append(([], [], []))
    return runs[-1]


def read_flight(bag: Path, robot: str, run: int = -1) -> dict:
    """Arrays from the bag: t_odom, pos, quat (w,x,y,z), t_cmd, rpm, status [(t, dict)], finished
    (False: an unfinished recording, read up to where it breaks off), runs and run.

    A simulator restarted under the recorder starts its clock over (as does a system clock set back):
    where a clock goes back by more than RUN_BREAK_S a run of its own begins (``runs`` of them, in the
    order recorded), and the arrays hold run number ``run`` (0-based; -1, the default: the last).
    Odometry is split where its header stamps (the simulator's clock) go back, the commands and status,
    which have no stamp, where their log times (the recorder's clock) do: the recorder logs the new
    simulator's first odometry on the old clock, before it hears the new /clock. The n-th break of
    each is taken for the same restart."""
    from mcap.exceptions import McapError

    odom, cmd, status = f"/{robot}/odom", f"/{robot}/rotor_cmd", f"/{robot}/status"
    odom_runs: list[tuple[list, list, list]] = []  # (t, pos, quat) of each run
    log_runs: list[tuple[list, list, list]] = []  # (t_cmd, rpm, status) of each run
    last_stamp = last_log = -math.inf
    try:
        messages, finished = _messages(bag, [odom, cmd, status])
        for _schema, channel, raw, msg in messages:
            t = raw.log_time * 1e-9
            if channel.topic == odom:  # at its state's time: logged when it arrived, which under a
                # simulator is before the /clock of that step (a period after the command it follows)
                stamp = msg.header.stamp.sec + msg.header.stamp.nanosec * 1e-9
                t_o, pos, quat = _run_at(odom_runs, stamp, last_stamp)
                last_stamp = stamp
                p, o = msg.pose.pose.position, msg.pose.pose.orientation
                t_o.append(stamp)
                pos.append((p.x, p.y, p.z))
                quat.append((o.w, o.x, o.y, o.z))
                continue
            t_c, rpm, st = _run_at(log_runs, t, last_log)
            last_log = t
            if channel.topic == cmd and len(msg.data) == 4:
                t_c.append(t)
                rpm.append(list(msg.data))
            elif channel.topic == status:
                try:
                    st.append((t, json.loads(msg.data)))
                except ValueError:
                    pass
    except (McapError, OSError, ValueError) as e:
        raise ValueError(f"{bag} is not a readable MCAP recording ({type(e).__name__}: {e})") from None
    for parts in (odom_runs, log_runs):  # a restart seen in one only (no command since, say): empty in the other
        parts += [([], [], []) for _ in range(max(len(odom_runs), len(log_runs)) - len(parts))]
    runs = [o + lg for o, lg in zip(odom_runs, log_runs)]
    if runs and not -len(runs) <= run < len(runs):
        raise ValueError(f"{bag} holds {len(runs)} run(s) (its clock went back {len(runs) - 1} time(s)): "
                         f"no run {run + 1 if run >= 0 else run}")
    t_o, pos, quat, t_c, rpm, st = runs[run] if runs else ([], [], [], [], [], [])
    if not t_o and len(runs) > 1:
        raise ValueError(f"{bag}: run {run % len(runs) + 1} of {len(runs)} (its clock went back {len(runs) - 1} "
                         f"time(s)) has no messages on {odom}; --run chooses another")
    if not t_o:
        topics = _topics(bag)
        others = [t for t in topics if t.endswith("/odom")]
        why = (f"wrong --robot? it has {', '.join(others)}" if others else
               f"it holds {', '.join(topics)} only: stopped before the first state?" if topics else
               "it holds no messages")
        raise ValueError(f"{bag} has no messages on {odom}: {why}")
    return {"t_odom": np.array(t_o), "pos": np.array(pos), "quat": np.array(quat),
            "t_cmd": np.array(t_c), "rpm": np.array(rpm).reshape(-1, 4), "status": st, "finished": finished,
            "runs": len(runs), "run": run % len(runs)}


def plot(flight: dict, out: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    t0 = flight["t_odom"][0]
    fig, axes = plt.subplots(3, 1, figsize=(9, 8), sharex=True)
    t = flight["t_odom"] - t0
    for i, (name, color) in enumerate(zip("xyz", ("tab:red", "tab:green", "tab:blue"))):
        axes[0].plot(t, flight["pos"][:, i], color=color, label=name)
    targets = [s.get("target") for _, s in flight["status"] if s.get("target")]
    if targets:
        for i, color in enumerate(("tab:red", "tab:green", "tab:blue")):
            axes[0].axhline(targets[-1][i], color=color, ls="--", lw=0.8)
    axes[0].set(ylabel="position [m]")
    eul = euler_zyx_deg(flight["quat"])
    for i, name in enumerate(("roll", "pitch", "yaw")):
        axes[1].plot(t, eul[:, i], label=name)
    axes[1].set(ylabel="attitude [deg]")
    for i in range(4):
        axes[2].plot(flight["t_cmd"] - t0, flight["rpm"][:, i], lw=0.8, label=f"M{i + 1}")
    axes[2].set(ylabel="rotor command [rpm]", xlabel="time [s]")
    # Shade the spans the status topic reports as failsafe.
    span_start = None
    for ts, s in flight["status"] + [(None, {"mode": "end"})]:
        if s.get("mode") == "failsafe" and span_start is None:
            span_start = ts
        elif s.get("mode") != "failsafe" and span_start is not None:
            end = ts if ts is not None else flight["t_odom"][-1]
            for ax in axes:
                ax.axvspan(span_start - t0, end - t0, color="tab:orange", alpha=0.2)
            span_start = None
    for ax in axes:
        ax.grid(alpha=0.3)
        ax.legend(loc="upper right", ncol=4, fontsize=8)
    axes[0].set_title(title)
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m deploy.plot", description="Plot a recorded flight (MCAP) to a PNG.")
    ap.add_argument("bag", type=Path)
    ap.add_argument("-o", "--out", type=Path, help="PNG path (default: next to the bag)")
    ap.add_argument("--robot", default="cf1")
    ap.add_argument("--run", type=int, help="which run (1: the first) of a recording whose clock went back "
                                            "(a simulator restarted under the recorder); default: the last")
    args = ap.parse_args(argv)
    if args.bag.is_dir():  # the recorder's directory (bag:=) given for one of its recordings
        newest = max(args.bag.glob("*.mcap"), key=lambda p: p.stat().st_mtime, default=None)
        print(f"error: {args.bag} is a directory: give one recording in it"
              + (f" (the newest: {newest})" if newest else " (it holds no .mcap file)"), file=sys.stderr)
        return 2
    if not args.bag.is_file():
        print(f"error: no file {args.bag}", file=sys.stderr)
        return 2
    try:
        if args.run is not None and args.run < 1:
            raise ValueError(f"--run {args.run}: runs are counted from 1")
        flight = read_flight(args.bag, args.robot, -1 if args.run is None else args.run - 1)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if flight["runs"] > 1:
        print(f"warning: the clock of {args.bag} went back {flight['runs'] - 1} time(s) (a simulator restarted under "
              "the recorder, a second /clock publisher, or the system clock set back): plotting run "
              f"{flight['run'] + 1} of {flight['runs']} (--run chooses another)", file=sys.stderr)
    if not flight["finished"]:
        print(f"warning: {args.bag} was never finished (its recorder killed?): plotting the "
              f"{len(flight['t_odom'])} odometry messages up to where it ends", file=sys.stderr)
    out = args.out or args.bag.with_suffix(".png")
    plot(flight, out, f"{args.bag.name}: {args.robot}, {flight['t_odom'][-1] - flight['t_odom'][0]:.1f} s")
    print(out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
