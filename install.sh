#!/usr/bin/env bash
# Installs everything the project needs on a fresh Debian machine (apt + pip), idempotent.
set -euo pipefail
cd "$(dirname "$0")"
SUDO=""
[ "$(id -u)" = 0 ] || SUDO=sudo
APT_PACKAGES=(
  libosmesa6 libegl1 libgl1   # headless MuJoCo rendering (EGL / OSMesa)
  gcc clang libclang-rt-14-dev  # host build of the exported C policy, sanitizers, libFuzzer
  g++  # torch.compile (inductor) builds the fused simulator step and PPO loss as C++
  gcc-arm-none-eabi libnewlib-arm-none-eabi qemu-system-arm  # Cortex-M4 cross-build, emulated STM32F405
)
missing=()
for p in "${APT_PACKAGES[@]}"; do dpkg -s "$p" >/dev/null 2>&1 || missing+=("$p"); done
if [ ${#missing[@]} -gt 0 ]; then
  $SUDO apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq "${missing[@]}" >/dev/null
fi
python3 -m pip install -q -e ".[test,deploy,perception]"
python3 -m deploy.ament   # register the ROS 2 package robolearn in sys.prefix (editable installs skip data-files)
