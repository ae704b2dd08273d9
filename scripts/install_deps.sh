#!/usr/bin/env bash
# Installs the Debian packages thdpack builds and tests with, only those missing (idempotent).
# Usage: scripts/install_deps.sh   (as root, or with sudo available)
set -euo pipefail

packages=(
  g++ make cmake pkg-config
  libgtest-dev googletest libbenchmark-dev
  libcli11-dev nlohmann-json3-dev
  libopenmpi-dev openmpi-bin
  pybind11-dev python3-dev python3-numpy python3-pytest python3-torch python3-venv binutils ninja-build
  python3-pytest-xdist ccache
  clang libclang-rt-dev
)

missing=()
for p in "${packages[@]}"; do
  if ! dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed"; then
    missing+=("$p")
  fi
done
if [ ${#missing[@]} -eq 0 ]; then
  exit 0
fi

echo "install_deps: installing ${missing[*]}" >&2
sudo_cmd=()
if [ "$(id -u)" -ne 0 ]; then
  sudo_cmd=(sudo)
fi
export DEBIAN_FRONTEND=noninteractive
"${sudo_cmd[@]}" apt-get update -qq
"${sudo_cmd[@]}" apt-get install -y -qq --no-install-recommends "${missing[@]}"
