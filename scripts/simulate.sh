#!/usr/bin/env bash
# Set up (scripts/setup.sh) and run the main job: `kvactors simulate`. Arguments go to it.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh
exec .venv/bin/kvactors simulate "$@"
