#!/usr/bin/env bash
# The static checks CI runs before the tests: ruff (ruff.toml) and mypy (setup.cfg [mypy]).
# Uses the tools of the virtual environment $1 (default .venv, as scripts/setup.sh builds it,
# with the `lint` extra). Both run; the exit status is the first failure's (127: a tool is missing).
set -uo pipefail
cd "$(dirname "$0")/.."
VENV=${1:-.venv}
status=0
check() { "$@"; local rc=$?; if [ "$rc" != 0 ] && [ "$status" = 0 ]; then status=$rc; fi; }
check "$VENV/bin/ruff" check kvactors tests scripts
check "$VENV/bin/mypy" kvactors
exit "$status"
