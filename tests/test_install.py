"""The environment install.sh makes: every package at the version of constraints.txt."""

from __future__ import annotations

import importlib.metadata
import re
import sysconfig

from deploy.testing import REPO


def canonical(name: str) -> str:
    """A distribution's name as pip compares them (PEP 503)."""
    return re.sub(r"[-_.]+", "-", name).lower()


def test_the_environment_is_the_locked_one():
    """Every installed distribution but the project itself, torch (pinned in pyproject.toml) and pip's
    own tools is in constraints.txt at its installed version, and every locked one is installed: a
    dependency added or upgraded without the lock written again fails here."""
    locked = {}
    for line in (REPO / "constraints.txt").read_text().splitlines():
        line = line.split("#", 1)[0].strip()
        if line:
            name, _, version = line.partition("==")
            assert version, f"constraints.txt: {line!r} is not name==version"
            locked[canonical(name)] = version
    skip = {"robolearn", "torch", "pip", "setuptools", "wheel"}
    # the environment's own directory, as pip sees it: sys.path may hold more by now (setuptools, imported by
    # torch's compiler, puts its vendored packages there)
    site = sorted({sysconfig.get_paths()["purelib"], sysconfig.get_paths()["platlib"]})
    installed = {canonical(d.metadata["Name"]): d.version for d in importlib.metadata.distributions(path=site)}
    installed = {k: v for k, v in installed.items() if k not in skip}
    assert "torch" not in locked, "torch is pinned in pyproject.toml, not in constraints.txt"
    differ = {k: (installed.get(k), locked.get(k)) for k in installed.keys() | locked.keys()
              if installed.get(k) != locked.get(k)}
    assert not differ, f"installed vs constraints.txt: {differ}"
