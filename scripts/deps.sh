#!/usr/bin/env bash
# Installs what Terrace needs to build and test, if it is missing: Debian packages (apt-get) and a
# Python virtual environment (.venv) with the test oracles. Safe to run repeatedly; quiet when all is
# present. Sourced or run by scripts/demo.sh and scripts/test.sh.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"

apt_packages=(build-essential cmake ninja-build pkg-config git
  liburing-dev librocksdb-dev libboost-dev libfmt-dev catch2 libxxhash-dev nlohmann-json3-dev
  libcli11-dev libabsl-dev libopenblas-dev libzstd-dev liblz4-dev fio python3 python3-venv python3-pip
  librsvg2-bin ${TERRACE_EXTRA_APT:-})  # librsvg2-bin: rsvg-convert, for `terrace report --png`

missing=()
for p in "${apt_packages[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q 'install ok installed' || missing+=("$p")
done
if ((${#missing[@]})); then
  echo "terrace: installing Debian packages: ${missing[*]}"
  sudo=""
  if [ "$(id -u)" != 0 ]; then sudo="sudo"; fi
  export DEBIAN_FRONTEND=noninteractive
  $sudo apt-get update -qq
  $sudo apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
fi

if [ "${TERRACE_SKIP_PYTHON:-0}" != 1 ]; then
  venv="$root/.venv"
  if [ ! -x "$venv/bin/python" ]; then
    echo "terrace: creating Python environment $venv"
    python3 -m venv "$venv"
  fi
  if ! "$venv/bin/python" -c 'import numpy, safetensors, ml_dtypes, pytest, xxhash' 2>/dev/null; then
    echo "terrace: installing Python test oracles (numpy, safetensors, ml_dtypes, pytest)"
    "$venv/bin/python" -m pip install -q --disable-pip-version-check numpy safetensors ml_dtypes pytest xxhash
  fi
fi
