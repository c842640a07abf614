#!/usr/bin/env bash
# Installs everything the project needs on a fresh Debian machine (apt + pip), idempotent.
# The Python packages go into a virtual environment, .venv, made by the first python3 on the PATH
# (>= 3.11): Debian's own Python refuses pip installs (PEP 668), and the ROS 2 wheels find their
# Python modules, libraries and ament index only in a virtual environment's (or a Python build's
# own) layout. The README's commands activate it first: . .venv/bin/activate
set -euo pipefail
cd "$(dirname "$0")"
SUDO=""
[ "$(id -u)" = 0 ] || SUDO=sudo
python3 -c 'import sys; sys.exit(sys.version_info < (3, 11))' || {
  echo "error: $(command -v python3) is Python $(python3 -c 'import platform; print(platform.python_version())'); the project needs >= 3.11" >&2
  exit 1
}
APT_PACKAGES=(
  libosmesa6 libegl1 libgl1   # headless MuJoCo rendering (EGL / OSMesa)
  gcc clang libclang-rt-dev  # host build of the exported C policy, sanitizers, libFuzzer (clang's runtime)
  make  # firmware/build.py builds the images with make
  g++  # torch.compile (inductor) builds the fused simulator step and PPO loss as C++
  gcc-arm-none-eabi libnewlib-arm-none-eabi qemu-system-arm  # Cortex-M4 cross-build, emulated STM32F405
)
# inductor's kernels include Python.h: Debian's Python has its C headers only with python3-dev
python3 -c 'import os, sys, sysconfig; sys.exit(not os.path.isfile(os.path.join(sysconfig.get_paths()["include"], "Python.h")))' \
  || APT_PACKAGES+=(python3-dev)
# Debian's Python makes virtual environments with pip only with python3-venv installed
python3 -c 'import ensurepip, venv' 2>/dev/null || APT_PACKAGES+=(python3-venv)
missing=()
# installed, not merely known to dpkg (a package removed but not purged keeps a dpkg -s entry)
installed() { dpkg-query -W -f='${Status}' "$1" 2>/dev/null | grep -q '^install ok installed$'; }
for p in "${APT_PACKAGES[@]}"; do installed "$p" || missing+=("$p"); done
if [ ${#missing[@]} -gt 0 ]; then
  $SUDO apt-get update -qq
  # through env: sudo's env_reset would drop a variable set before it, and debconf could prompt
  $SUDO env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${missing[@]}" >/dev/null
fi
# The environment takes ~3.1 GB (open3d ~1 GB, torch, MuJoCo, PyBullet, ROS 2), and pip holds a
# downloaded wheel in TMPDIR while it unpacks it: say so up front instead of pip's OSError half-way.
need_free() {  # <directory> <MB> <what needs it>
  local free_kb
  free_kb=$(df -Pk "$1" | awk 'NR == 2 {print $4}')
  if [ "$free_kb" -lt $(($2 * 1024)) ]; then
    echo "error: $((free_kb / 1024)) MB free on the disk of $1; $3 needs about $2 MB" >&2
    exit 1
  fi
}
need_free "${TMPDIR:-/tmp}" 1024 "pip's download of the largest wheel"
# a new environment, or a fresh one where an interrupted run left it without pip
if ! .venv/bin/python -m pip --version >/dev/null 2>&1; then
  need_free . 5120 "the new virtual environment"
  python3 -m venv --clear .venv
else
  need_free . 1024 "completing the virtual environment"  # an earlier run may have stopped half-way
fi
# --no-cache-dir: no second copy of every wheel in ~/.cache/pip; -c: the versions the tests ran with (constraints.txt)
.venv/bin/python -m pip install -q --no-cache-dir -c constraints.txt -e ".[test,deploy,perception]"
.venv/bin/python -m deploy.ament   # register the ROS 2 package robolearn in .venv (editable installs skip data-files)
# Compile the quadrotor training's simulator and PPO kernels into inductor's cache (sim/compiled.py:
# ~/.cache/robolearn/torchinductor) with 8 iterations (128 steps of each environment) and two evaluations of the main job's
# configuration: ~50 s once on a 2-core Intel Xeon, ~7 s when they are there already. The first
# `policies.train task=quad_hover` then loads them instead of compiling (BENCHMARKS.md "Time to hover"). With
# ROBOLEARN_SAVE_GRAPHS=1 it also saves the traced graphs of the simulator's step and of PPO's rollout step and
# loss, which later processes load instead of tracing them again (sim/compiled.py, compile_method). 128
# steps, so that training episodes end while others go on: a reset of some environments is observed by a
# graph of its own (reset()'s graph of every environment is tied to the batch size), traced (~1.5 s) in every
# run whose warm-up had none (32 steps had none since the criterion's environments stopped sharing
# training's layout: BENCHMARKS.md, "Actuation latency: what the vehicle has").
# Everything is installed by now: a failure here only leaves the kernels to the first training run.
warmup=$(mktemp -d)
trap 'rm -rf "$warmup"' EXIT
if ! ROBOLEARN_SAVE_GRAPHS=1 .venv/bin/python -m policies.train task=quad_hover max_env_steps=131072 \
    eval_every_steps=65536 stop_at_success=0 progress=false run_dir="$warmup/run" >"$warmup/log" 2>&1; then
  tail -n 20 "$warmup/log" >&2
  echo "warning: compiling the training's kernels failed (above); the first training run will compile them" >&2
fi
