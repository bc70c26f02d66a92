"""The package root: its public names, imported on first use (``import kvactors`` does not load torch)."""

from __future__ import annotations

import subprocess
import sys

import pytest

import kvactors

API_NAMES = {"AsyncTieringManager", "DiskTier", "JobResult", "LifecycleError", "LoadStoreSpec", "LookupResult",
             "ManagerStoppedError", "MemoryTier", "OffloadKey", "OffloadingEvent", "PrepareStoreOutput", "RedisTier",
             "ReqContext", "SecondaryTier", "TieringManager", "TransferEngine", "TransferError", "TransferJob"}


def _modules_after(code: str) -> set[str]:
    out = subprocess.run([sys.executable, "-c", code + "\nimport sys; print(' '.join(sys.modules))"],
                         capture_output=True, text=True, timeout=60, check=True)
    return set(out.stdout.split())


def test_every_public_name_is_importable_from_the_root() -> None:
    assert set(kvactors.__all__) >= API_NAMES
    assert set(kvactors.__all__) == set(kvactors._SOURCES)  # each name says where it comes from
    namespace: dict[str, object] = {}
    exec("from kvactors import *", namespace)
    assert set(namespace) >= API_NAMES
    from kvactors import TieringManager
    from kvactors.manager import TieringManager as direct

    assert TieringManager is direct and kvactors.TieringManager is direct
    assert set(dir(kvactors)) >= API_NAMES


def test_an_unknown_name_is_an_attribute_error() -> None:
    with pytest.raises(AttributeError, match="no_such_name"):
        _ = kvactors.no_such_name  # type: ignore[attr-defined]
    with pytest.raises(ImportError):
        exec("from kvactors import no_such_name", {})


@pytest.mark.timeout(180)
def test_import_and_the_cli_parser_do_not_load_torch() -> None:
    # The CLI builds every command's parser before it parses (kvactors --help prints them all).
    loaded = _modules_after("import kvactors, kvactors.cli; kvactors.cli.build_parser()")
    assert "torch" not in loaded
    assert "torch" in _modules_after("from kvactors import TieringManager")
