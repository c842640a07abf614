"""Run a ROS 2 XML launch file without the ROS 2 `launch` package (not installable from PyPI).

    python -m deploy.launch launch/hover.launch.xml backend:=sim [name:=value ...]

Implements the subset of the ROS 2 XML launch format this project uses, with the semantics of
the ROS 2 launch documentation, and fails with a clear message on anything else:

  <arg name default description/>   launch argument; a value given on the command line or by an
                                    including file wins over the default; no value and no default
                                    is an error, and so is a command-line argument no file declares
      <choice value/>               the values it may take (any, if none is listed): another is an error
  <let name value/>                 set a launch configuration
  <set_env name value/>             environment variable for the processes started after it
  <node pkg exec name namespace args output on_exit>   one process: <prefix>/lib/<pkg>/<exec>, the prefix
      <param name value/>           found in the ament index (AMENT_PREFIX_PATH), started with
      <param from="file.yaml"/>     --ros-args: -r __node:=, -r __ns:=, -p name:=value,
      <remap from to/>              --params-file, -r from:=to (in document order). One difference
                                    from ros2 launch: a <param name value/> is a command-line -p, which a
                                    params file's section for this node (/**/name) overrides; ros2 launch
                                    writes it into a file of its own under the node's full name, which
                                    wins. The shipped files set no parameter both ways.
                                    on_exit="shutdown": when this node exits, however it exits, the
                                    launch stops the others (as ros2 launch does)
  <group scoped>                    children in a scope (default scoped="true": configurations and
                                    environment set inside do not leak out)
  <include file>  <arg name value/> another launch file, in a scope holding the given arguments
                                    (what it sets does not leak into the including file; wrap an
                                    include in <group> for the same under ros2 launch)
  if="..." / unless="..."           on every element but an include's <arg> (as in ros2 launch):
                                    true/false/1/0 (case-insensitive), else error

Substitutions: $(var name), $(env NAME [default]), $(find-pkg-share pkg), $(find-pkg-prefix pkg),
$(dirname), $(filename), $(eval python-expression) (Python's builtins and the math module's names),
nested and quoted ('...' or "...", backslash escapes the next character) arguments allowed.

Every node runs as a child process, its output prefixed with [name-N]. Ctrl-C, SIGTERM, SIGHUP
(the terminal closed; not under nohup) or a closed output pipe stops all of them (SIGINT, then
SIGTERM after 5 s, to each node; then SIGKILL after 5 s more, to each node's process group, i.e.
with anything it started), and so does an error of the runner itself before it exits. A node gets
SIGHUP if the runner dies (even by SIGKILL; the project's nodes stop on it as on Ctrl-C, without
escalating). The runner also ends when every child has exited, with
exit code 0 only if all of them exited cleanly. Nodes find the runner's Python first on their PATH.
"""

from __future__ import annotations

import math
import os
import re
import selectors
import shlex
import signal
import subprocess
import sys
import time
import xml.etree.ElementTree as ET
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

STOP_TIMEOUT = 5.0  # s between SIGINT -> SIGTERM -> SIGKILL, as ros2 launch


class LaunchError(Exception):
    """A launch file or command line this runner cannot execute; the message says what and where."""


# ---------------------------------------------------------------------------------------------
# ament index


def ament_prefixes() -> list[Path]:
    return [Path(p) for p in (os.environ.get("AMENT_PREFIX_PATH") or sys.prefix).split(os.pathsep) if p]


def package_prefix(pkg: str) -> Path:
    """The install prefix of ROS package ``pkg`` (ament resource index 'packages')."""
    for prefix in ament_prefixes():
        if (prefix / "share" / "ament_index" / "resource_index" / "packages" / pkg).is_file():
            return prefix
    raise LaunchError(f"package '{pkg}' is not in the ament index (AMENT_PREFIX_PATH="
                      f"{os.pathsep.join(map(str, ament_prefixes()))}); for this project run "
                      f"`python -m deploy.ament` after `pip install -e .` (see deploy/README.md)")


def executable(pkg: str, exe: str) -> Path:
    path = package_prefix(pkg) / "lib" / pkg / exe
    if not (path.is_file() and os.access(path, os.X_OK)):
        raise LaunchError(f"package '{pkg}' has no executable '{exe}' ({path} is missing or not executable)")
    return path


# ---------------------------------------------------------------------------------------------
# substitutions


@dataclass
class Scope:
    configs: dict[str, str]
    env: dict[str, str]
    file: Path
    declared: set[str] = field(default_factory=set)

    def child(self, configs: dict[str, str] | None = None) -> "Scope":
        return Scope(dict(self.configs) | (configs or {}), dict(self.env), self.file, self.declared)


def _parse(text: str, i: int, stop: str) -> tuple[list, int]:
    """Parts (str or (name, [args])) of ``text`` from i up to an unescaped char in ``stop``."""
    parts: list = []
    buf = ""
    while i < len(text) and text[i] not in stop:
        if text.startswith("$(", i):
            if buf:
                parts.append(buf)
                buf = ""
            m = re.compile(r"[a-zA-Z][a-zA-Z0-9_-]*").match(text, i + 2)
            if not m:
                raise LaunchError(f"substitution without a name at {text[i:]!r}")
            name, i, args = m.group(), m.end(), []
            while True:
                while i < len(text) and text[i].isspace():
                    i += 1
                if i >= len(text):
                    raise LaunchError(f"unclosed substitution $({name} in {text!r}")
                if text[i] == ")":
                    i += 1
                    break
                if text[i] in "'\"":
                    arg, i = _parse(text, i + 1, text[i])
                    if i >= len(text):
                        raise LaunchError(f"unclosed quote in {text!r}")
                    i += 1
                else:
                    arg, i = _parse(text, i, " \t\n)")
                args.append(arg)
            parts.append((name, args))
        elif text[i] == "\\" and stop in ("'", '"') and i + 1 < len(text):
            buf += text[i + 1]  # inside quotes a backslash escapes the next character
            i += 2
        else:
            buf += text[i]
            i += 1
    if buf:
        parts.append(buf)
    return parts, i


def _eval_parts(parts: list, scope: Scope) -> str:
    out = []
    for p in parts:
        if isinstance(p, str):
            out.append(p)
        else:
            name, args = p
            out.append(_substitute(name, [_eval_parts(a, scope) for a in args], scope))
    return "".join(out)


def _substitute(name: str, args: list[str], scope: Scope) -> str:
    def need(n: int | tuple[int, int]) -> None:
        lo, hi = (n, n) if isinstance(n, int) else n
        if not lo <= len(args) <= hi:
            raise LaunchError(f"$({name} ...) takes {lo if lo == hi else f'{lo} or {hi}'} argument(s), got {args}")

    if name == "var":
        need(1)
        if args[0] not in scope.configs:
            raise LaunchError(f"$(var {args[0]}): no launch configuration '{args[0]}' is set at this point "
                              f"(declare it with <arg> or <let> before use)")
        return scope.configs[args[0]]
    if name == "env":
        need((1, 2))
        if args[0] in scope.env:
            return scope.env[args[0]]
        if len(args) == 2:
            return args[1]
        raise LaunchError(f"$(env {args[0]}): environment variable not set (give a default: $(env {args[0]} value))")
    if name == "find-pkg-share":
        need(1)
        return str(package_prefix(args[0]) / "share" / args[0])
    if name == "find-pkg-prefix":
        need(1)
        return str(package_prefix(args[0]))
    if name == "dirname":
        need(0)
        return str(scope.file.parent)
    if name == "filename":
        need(0)
        return str(scope.file)
    if name == "eval":
        need(1)
        try:
            # as ROS 2's python_expression: Python's builtins and the math module's names (and `math`)
            return str(eval(args[0], {}, {**vars(math), "math": math}))  # launch files are code, as in ROS
        except Exception as e:
            raise LaunchError(f"$(eval {args[0]!r}) failed: {type(e).__name__}: {e}") from None
    raise LaunchError(f"unsupported substitution $({name} ...): supported are var, env, find-pkg-share, "
                      f"find-pkg-prefix, dirname, filename, eval")


def substitute(text: str, scope: Scope) -> str:
    parts, _ = _parse(text, 0, "")
    return _eval_parts(parts, scope)


def truth(text: str, what: str) -> bool:
    v = text.strip().lower()
    if v in ("true", "1"):
        return True
    if v in ("false", "0"):
        return False
    raise LaunchError(f"{what}: '{text}' is not a boolean (expected true, false, 1 or 0)")


# ---------------------------------------------------------------------------------------------
# launch file -> processes


@dataclass
class Process:
    name: str
    argv: list[str]
    env: dict[str, str]
    shutdown_on_exit: bool = False  # <node on_exit="shutdown">: its exit stops the launch


ALLOWED = {
    "arg": {"name", "default", "description"},
    "let": {"name", "value"},
    "set_env": {"name", "value"},
    "node": {"pkg", "exec", "name", "namespace", "args", "output", "on_exit"},
    "group": {"scoped"},
    "include": {"file"},
}
NODE_CHILDREN = {"param": [{"name", "value"}, {"from"}], "remap": [{"from", "to"}]}


def _where(el: ET.Element, scope: Scope) -> str:
    attrs = " ".join(f'{k}="{v}"' for k, v in el.attrib.items())
    return f"{scope.file}: <{el.tag}{' ' + attrs if attrs else ''}>"


# A ROS name (namespace): tokens of letters, digits and underscores, none starting with a digit, split by "/"
ROS_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*(/[A-Za-z_][A-Za-z0-9_]*)*")


def _attrs(el: ET.Element, allowed: set[str], scope: Scope, required: set[str] = frozenset(),
           verbatim: set[str] = frozenset()) -> dict[str, str]:
    """The element's attributes (but if/unless), checked against ``allowed`` and ``required``, with their
    substitutions resolved, but for those in ``verbatim`` (left as written)."""
    extra = set(el.attrib) - allowed - {"if", "unless"}
    if extra:
        raise LaunchError(f"{_where(el, scope)}: unsupported attribute(s) {sorted(extra)} "
                          f"(supported: {sorted(allowed)})")
    missing = required - set(el.attrib)
    if missing:
        raise LaunchError(f"{_where(el, scope)}: missing attribute(s) {sorted(missing)}")
    return {k: v if k in verbatim else substitute(v, scope) for k, v in el.attrib.items() if k not in ("if", "unless")}


def _enabled(el: ET.Element, scope: Scope) -> bool:
    if "if" in el.attrib and not truth(substitute(el.attrib["if"], scope), f"{_where(el, scope)} if"):
        return False
    if "unless" in el.attrib and truth(substitute(el.attrib["unless"], scope), f"{_where(el, scope)} unless"):
        return False
    return True


def _node(el: ET.Element, scope: Scope) -> Process:
    a = _attrs(el, ALLOWED["node"], scope, {"pkg", "exec"})
    if a.get("output", "screen") not in ("screen", "log", "both"):
        raise LaunchError(f"{_where(el, scope)}: output must be screen, log or both")
    if a.get("on_exit", "shutdown") != "shutdown":  # ros2 launch's other values name Python actions
        raise LaunchError(f"{_where(el, scope)}: on_exit supports 'shutdown' only")
    argv = [str(executable(a["pkg"], a["exec"])), *shlex.split(a.get("args", "")), "--ros-args"]
    if "name" in a:
        argv += ["-r", f"__node:={a['name']}"]
    if a.get("namespace"):
        ns = a["namespace"].strip("/")  # "" : the root namespace
        if ns and (not ROS_NAME.fullmatch(ns) or "__" in ns):  # rcl would refuse it in every node, with a traceback
            raise LaunchError(f"{_where(el, scope)}: namespace '{ns}' is no ROS name (letters, digits and single _, "
                              "not starting with a digit, segments split by /): e.g. robot:=cf1")
        argv += ["-r", f"__ns:=/{ns}"]
    for child in el:
        if child.tag not in NODE_CHILDREN:
            raise LaunchError(f"{_where(child, scope)} inside <node>: unsupported (supported: param, remap)")
        if not _enabled(child, scope):
            continue
        if child.tag == "remap":
            c = _attrs(child, {"from", "to"}, scope, {"from", "to"})
            argv += ["-r", f"{c['from']}:={c['to']}"]
        elif "from" in child.attrib:
            c = _attrs(child, {"from"}, scope, {"from"})
            path = Path(c["from"])
            if not path.is_file():
                raise LaunchError(f"{_where(child, scope)}: parameter file {path} does not exist")
            argv += ["--params-file", str(path)]
        else:
            c = _attrs(child, {"name", "value"}, scope, {"name", "value"})
            # rcl reads the value as YAML, and cannot parse nothing: an empty string is written ''
            argv += ["-p", f"{c['name']}:={c['value'] or repr('')}"]
    return Process(a.get("name", a["exec"]), argv, dict(scope.env), a.get("on_exit") == "shutdown")


def load(file: Path, scope: Scope, out: list[Process]) -> None:
    """Append the processes of launch file ``file`` (evaluated in ``scope``) to ``out``."""
    if not file.is_file():
        raise LaunchError(f"launch file {file} does not exist")
    try:
        root = ET.parse(file).getroot()
    except ET.ParseError as e:
        raise LaunchError(f"{file} is not valid XML: {e}") from None
    if root.tag != "launch":
        raise LaunchError(f"{file}: root element is <{root.tag}>, expected <launch>")
    scope.file = file.resolve()
    _children(root, scope, out)


def _children(parent: ET.Element, scope: Scope, out: list[Process]) -> None:
    for el in parent:
        if el.tag not in ALLOWED:
            raise LaunchError(f"{_where(el, scope)}: unsupported element (supported: {', '.join(ALLOWED)})")
        if not _enabled(el, scope):
            continue
        if el.tag == "arg":
            # As ROS 2 launch: the default is resolved only when it is used, the description never.
            a = _attrs(el, ALLOWED["arg"], scope, {"name"}, verbatim={"default", "description"})
            choices = []
            for child in el:
                if child.tag != "choice":
                    raise LaunchError(f"{_where(child, scope)} inside <arg>: only <choice value/> is supported")
                choices.append(_attrs(child, {"value"}, scope, {"value"})["value"])
            scope.declared.add(a["name"])
            if a["name"] not in scope.configs:
                if "default" not in a:
                    raise LaunchError(f"{scope.file}: launch argument '{a['name']}' is required: "
                                      f"pass {a['name']}:=<value>")
                scope.configs[a["name"]] = substitute(a["default"], scope)
            if choices and scope.configs[a["name"]] not in choices:
                raise LaunchError(f"{scope.file}: launch argument {a['name']}:={scope.configs[a['name']]} is not "
                                  f"one of its choices ({', '.join(choices)})")
        elif el.tag == "let":
            a = _attrs(el, ALLOWED["let"], scope, {"name", "value"})
            scope.configs[a["name"]] = a["value"]
        elif el.tag == "set_env":
            a = _attrs(el, ALLOWED["set_env"], scope, {"name", "value"})
            scope.env[a["name"]] = a["value"]
        elif el.tag == "node":
            out.append(_node(el, scope))
        elif el.tag == "group":
            a = _attrs(el, ALLOWED["group"], scope)
            scoped = truth(a.get("scoped", "true"), f"{_where(el, scope)} scoped")
            _children(el, scope.child() if scoped else scope, out)
        elif el.tag == "include":
            a = _attrs(el, ALLOWED["include"], scope, {"file"})
            given = {}
            for child in el:
                if child.tag != "arg":
                    raise LaunchError(f"{_where(child, scope)} inside <include>: only <arg name value/> is supported")
                if {"if", "unless"} & set(child.attrib):  # ros2 launch refuses them there too
                    raise LaunchError(f"{_where(child, scope)} inside <include>: if/unless are not accepted "
                                      "on an include's <arg> (ros2 launch refuses them); put the condition "
                                      "on the <include>, or choose the value with $(eval ...)")
                c = _attrs(child, {"name", "value"}, scope, {"name", "value"})
                given[c["name"]] = c["value"]
            path = Path(a["file"])
            load(path if path.is_absolute() else scope.file.parent / path, scope.child(configs=given), out)


def parse_cli(argv: list[str]) -> tuple[Path, dict[str, str]]:
    if not argv or ":=" in argv[0] or argv[0] in ("-h", "--help"):
        raise LaunchError("usage: python -m deploy.launch <file.launch.xml> [name:=value ...]")
    args = {}
    for a in argv[1:]:
        name, sep, value = a.partition(":=")
        if not sep or not name:
            raise LaunchError(f"argument '{a}': expected name:=value")
        args[name] = value
    return Path(argv[0]), args


def plan(file: Path, args: dict[str, str]) -> list[Process]:
    """Every process the launch file starts with these arguments, in order (nothing is started)."""
    env = dict(os.environ)
    env.setdefault("AMENT_PREFIX_PATH", sys.prefix)
    # The nodes' executables start with `#!/usr/bin/env python3`: this Python (the venv's, also when
    # the runner was started as .venv/bin/python without activating it) comes first.
    env["PATH"] = os.pathsep.join([str(Path(sys.executable).parent), *filter(None, env.get("PATH", "").split(os.pathsep))])
    scope = Scope(dict(args), env, file.resolve())
    out: list[Process] = []
    load(file, scope, out)
    unknown = set(args) - scope.declared
    if unknown:
        raise LaunchError(f"unknown launch argument(s) {sorted(unknown)}: {file} declares {sorted(scope.declared)}")
    return out


# ---------------------------------------------------------------------------------------------
# processes


_PR_SET_PDEATHSIG = 1


def _child_setup(parent: int, prctl) -> Callable[[], None]:
    """What each node's process does before exec: SIGHUP when the runner dies, however it dies (even
    SIGKILL), so no node (a bridge flying a real vehicle) outlives the launch. The project's nodes
    take SIGHUP as a stop like Ctrl-C that never escalates (deploy/ros.py): a node already flying its
    shutdown descent finishes it. SIGHUP is reset to its default first (a runner under nohup ignores
    it, and an ignored disposition would survive exec)."""
    def setup() -> None:
        signal.signal(signal.SIGHUP, signal.SIG_DFL)
        if prctl is not None:
            prctl(_PR_SET_PDEATHSIG, signal.SIGHUP)
        if os.getppid() != parent:  # the runner died before prctl took effect
            os.kill(os.getpid(), signal.SIGHUP)
    return setup


def _prctl():
    """libc's prctl (Linux), resolved in the runner rather than in each forked child; None elsewhere."""
    import ctypes

    try:
        return ctypes.CDLL(None, use_errno=True).prctl
    except (OSError, AttributeError):
        return None


ESCALATION = ((signal.SIGINT, 0.0), (signal.SIGTERM, STOP_TIMEOUT), (signal.SIGKILL, 2 * STOP_TIMEOUT))


def run(processes: list[Process]) -> int:
    """Start every process, relay their output, stop them all on SIGINT/SIGTERM/SIGHUP (unless
    SIGHUP is ignored, as under nohup), on losing the output (a closed pipe) and on any error of
    the runner itself."""
    stop: dict[str, str | None] = {"reason": None}
    output_ok = [True]

    def on_signal(signum, _frame):
        stop["reason"] = stop["reason"] or signal.Signals(signum).name

    for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):  # SIGHUP: the terminal closed
        if sig != signal.SIGHUP or signal.getsignal(sig) is not signal.SIG_IGN:
            signal.signal(sig, on_signal)

    def say(text: str) -> None:
        if not output_ok[0]:
            return
        try:
            sys.stdout.write(text)
            sys.stdout.flush()
        except OSError:  # e.g. `| head` exited: keep reading the nodes' pipes, stop them
            output_ok[0] = False
            stop["reason"] = stop["reason"] or "output closed"

    def log(msg: str) -> None:
        say(f"[INFO] [launch]: {msg}\n")

    sel = selectors.DefaultSelector()
    running: dict[subprocess.Popen, str] = {}
    shutdown_on_exit: set[str] = set()  # labels of the nodes whose exit stops the launch
    codes: dict[str, int] = {}
    partial: dict[str, bytes] = {}
    stopping = {"since": None, "sent": []}  # when the stop began, the signals sent since

    def relay(label: str, data: bytes, final: bool = False) -> None:
        buf = partial.pop(label, b"") + data
        *lines, rest = buf.split(b"\n")
        if final and rest:
            lines, rest = lines + [rest], b""
        if rest:
            partial[label] = rest
        if lines:
            say("".join(f"[{label}] {ln.decode(errors='replace')}\n" for ln in lines))

    def available(fd: int) -> bytes:
        """What the pipe holds now, without waiting for its end (a node's orphaned child may hold
        its write end open long after the node exited)."""
        chunks = []
        while True:
            try:
                data = os.read(fd, 65536)
            except BlockingIOError:
                break
            if not data:
                break
            chunks.append(data)
        return b"".join(chunks)

    def service() -> None:
        """Relay what the nodes wrote (so none blocks on a full pipe) and reap the ones that exited."""
        for key, _ in sel.select(timeout=0.1):
            proc, label = key.data
            try:
                data = os.read(key.fileobj.fileno(), 65536)
            except BlockingIOError:
                continue
            if data:
                relay(label, data)
            else:
                sel.unregister(key.fileobj)
        for proc in [p for p in running if p.poll() is not None]:
            label = running.pop(proc)
            codes[label] = proc.returncode
            if proc.stdout in (k.fileobj for k in sel.get_map().values()):
                sel.unregister(proc.stdout)
            relay(label, available(proc.stdout.fileno()), final=True)
            proc.stdout.close()
            state = "process has finished cleanly" if proc.returncode in (0, -signal.SIGINT) else \
                f"process has died [exit code {proc.returncode}]"
            say(f"[INFO] [{label}]: {state}\n")
            if label in shutdown_on_exit and stop["reason"] is None:
                stop["reason"] = f"{label} exited (on_exit=shutdown)"

    def escalate() -> None:
        """SIGINT at once, SIGTERM after STOP_TIMEOUT, SIGKILL (to each group) after twice that."""
        now = time.monotonic()
        if stopping["since"] is None:
            stopping["since"] = now
            log(f"{stop['reason']}: stopping {len(running)} process(es)")
        for sig, after in ESCALATION:
            if now - stopping["since"] >= after and sig not in stopping["sent"]:
                stopping["sent"].append(sig)
                for proc in running:
                    try:  # like ros2 launch: the node itself, so it can stop its own children in order
                        (os.killpg if sig == signal.SIGKILL else os.kill)(proc.pid, sig)
                    except ProcessLookupError:
                        pass

    try:
        setup = _child_setup(os.getpid(), _prctl())
        for i, p in enumerate(processes, 1):
            label = f"{p.name}-{i}"
            try:
                proc = subprocess.Popen(p.argv, env=p.env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                        start_new_session=True, preexec_fn=setup)
            except OSError as e:
                log(f"could not start {label}: {e}")
                codes[label] = 127  # the shell's "could not run": the run fails however the others stop
                stop["reason"] = "a process could not start"
                break
            os.set_blocking(proc.stdout.fileno(), False)
            running[proc] = label
            if p.shutdown_on_exit:
                shutdown_on_exit.add(label)
            sel.register(proc.stdout, selectors.EVENT_READ, (proc, label))
            say(f"[INFO] [{label}]: process started with pid [{proc.pid}]\n")
        while running:
            service()
            if stop["reason"] is not None and running:
                escalate()
    finally:
        if running:  # the runner itself failed: the same stop, from where it had got to
            stop["reason"] = stop["reason"] or "launch runner error"
            deadline = time.monotonic() + 3 * STOP_TIMEOUT
            while running and time.monotonic() < deadline:
                try:
                    service()
                except Exception:  # relaying is what failed: stop waiting on the nodes' output
                    time.sleep(0.1)
                    for proc in [p for p in running if p.poll() is not None]:
                        running.pop(proc)
                escalate()
    return 0 if all(c in (0, -signal.SIGINT) for c in codes.values()) else 1


def main(argv: list[str] | None = None) -> int:
    try:
        file, args = parse_cli(sys.argv[1:] if argv is None else argv)
        processes = plan(file, args)
    except LaunchError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return run(processes)


if __name__ == "__main__":
    sys.exit(main())
