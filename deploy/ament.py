"""Register this project as the ROS 2 package ``robolearn`` in an ament index.

A wheel install does it through setuptools data-files (the lines in deploy/README.md, which
must equal :data:`DATA_FILES`). An editable install (``pip install -e .``) skips data-files, so

    python -m deploy.ament [--prefix PREFIX]     (default: this Python's sys.prefix)

links the source tree into PREFIX instead, like ``colcon build --symlink-install``: edits of
launch files and nodes take effect without reinstalling. Then, on a machine with ROS 2,
``ros2 launch robolearn hover.launch.xml`` and ``ros2 run robolearn policy_node`` find them.
"""

from __future__ import annotations

import argparse
import glob
import os
import sys
from pathlib import Path

PACKAGE = "robolearn"
REPO = Path(__file__).resolve().parents[1]

# install directory (relative to the prefix) -> source globs (relative to the repository root)
DATA_FILES: dict[str, list[str]] = {
    "share/ament_index/resource_index/packages": [f"deploy/resource/{PACKAGE}"],
    f"share/{PACKAGE}": ["deploy/package.xml"],
    f"share/{PACKAGE}/launch": ["launch/*.launch.xml", "launch/*.yaml"],
    f"lib/{PACKAGE}": ["deploy/bin/*"],
}


def install_links(prefix: Path) -> list[Path]:
    """Symlink every DATA_FILES source into ``prefix``; returns the links made (existing ones are replaced)."""
    made = []
    for dest, patterns in DATA_FILES.items():
        (prefix / dest).mkdir(parents=True, exist_ok=True)
        for pattern in patterns:
            sources = sorted(glob.glob(str(REPO / pattern)))
            if not sources:
                raise FileNotFoundError(f"{pattern} matches no file under {REPO}")
            for src in sources:
                link = prefix / dest / Path(src).name
                if link.is_symlink() or link.exists():
                    link.unlink()
                link.symlink_to(src)
                made.append(link)
    return made


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m deploy.ament", description=__doc__.split("\n\n")[0])
    ap.add_argument("--prefix", type=Path, default=Path(sys.prefix), help="install prefix (default: %(default)s)")
    args = ap.parse_args(argv)
    try:
        made = install_links(args.prefix)
    except OSError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(f"registered ROS package '{PACKAGE}' in {args.prefix} ({len(made)} links); "
          f"set AMENT_PREFIX_PATH={args.prefix}{os.pathsep}... if it is not this Python's prefix")
    return 0


if __name__ == "__main__":
    sys.exit(main())
