#!/usr/bin/env bash
# Set up kvactors on a fresh machine: a virtual environment in .venv with the
# CPU build of torch (when no torch is there yet), the package and its test
# dependencies and lint tools (ruff, mypy), redis-server and redis-cli for the Redis tests, and Mooncake Store
# (the extra mooncake; libibverbs1, which its binaries link to) for the Mooncake tests (Debian/Ubuntu).
# Idempotent: a second run only checks.
set -euo pipefail
cd "$(dirname "$0")/.."

if ! command -v redis-server >/dev/null 2>&1 || ! command -v redis-cli >/dev/null 2>&1; then
  if command -v apt-get >/dev/null 2>&1 && [ "$(id -u)" = 0 ]; then
    echo "setup: installing redis-server and redis-tools" >&2
    (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq redis-server redis-tools) >/dev/null \
      || echo "setup: could not install redis-server/redis-tools; the Redis tests will be skipped" >&2
  else
    echo "setup: no redis-server/redis-cli; the Redis tests will be skipped" >&2
  fi
fi

if ! ldconfig -p 2>/dev/null | grep -q "libibverbs.so.1"; then
  if command -v apt-get >/dev/null 2>&1 && [ "$(id -u)" = 0 ]; then
    echo "setup: installing libibverbs1 (for Mooncake Store)" >&2
    (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq libibverbs1) >/dev/null \
      || echo "setup: could not install libibverbs1; the Mooncake tests will be skipped" >&2
  else
    echo "setup: no libibverbs1; the Mooncake tests will be skipped" >&2
  fi
fi

PYTHON=${PYTHON:-python3}
# This workplace's pip configuration warns about every package it looks up locally: keep the noise out.
pip_install() { .venv/bin/python -m pip install -q "$@" 2> >(grep -v "is ignored: it is neither" >&2); }

if [ ! -x .venv/bin/python ]; then
  echo "setup: creating .venv" >&2
  "$PYTHON" -m venv .venv
fi
if ! .venv/bin/python -c "import torch" >/dev/null 2>&1; then
  # A bare torch requirement would pull a multi-GB CUDA build: take the CPU build first.
  echo "setup: installing torch (CPU build)" >&2
  pip_install "torch==2.13.0"
fi
if ! .venv/bin/python -c "import kvactors, pytest, hypothesis, pytest_timeout, prometheus_client" >/dev/null 2>&1 \
   || [ ! -x .venv/bin/ruff ] || [ ! -x .venv/bin/mypy ] \
   || [ pyproject.toml -nt .venv/.kvactors-installed ] || [ setup.py -nt .venv/.kvactors-installed ] \
   || [ kvactors/transfer/_streamcopy.c -nt .venv/.kvactors-installed ] \
   || { command -v cc >/dev/null 2>&1 && ! .venv/bin/python -c \
        "import sys; from kvactors.transfer.native import native_copy_available as a; sys.exit(not a())" \
        >/dev/null 2>&1; }; then
  # The editable install also builds the native copy loop in place (optional: skipped without a C compiler).
  echo "setup: installing kvactors and its test dependencies" >&2
  pip_install -e ".[test,plot,fast,metrics,lint]"
  touch .venv/.kvactors-installed
fi
if ! .venv/bin/python -c "import mooncake.store" >/dev/null 2>&1; then
  # Optional: a wheel for CPython 3.11 on x86-64 only; without it the Mooncake tests are skipped.
  echo "setup: installing Mooncake Store (extra mooncake)" >&2
  pip_install -e ".[mooncake]" || echo "setup: could not install Mooncake; the Mooncake tests will be skipped" >&2
fi
