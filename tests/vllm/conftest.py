"""The vLLM suites: each runs in the venv of its vLLM flavour (scripts/setup_vllm.sh); skipped without vLLM."""

import os

import pytest

os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

try:
    import vllm  # noqa: F401

    HAVE_VLLM = True
except Exception:
    HAVE_VLLM = False


def pytest_collection_modifyitems(config, items):
    if HAVE_VLLM:
        return
    skip = pytest.mark.skip(reason="vLLM is not installed in this venv (scripts/setup_vllm.sh)")
    for item in items:
        if "tests/vllm/" in str(item.fspath).replace(os.sep, "/"):
            item.add_marker(skip)
