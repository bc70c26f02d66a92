"""The install builds the native copy loop wherever it can."""

from __future__ import annotations

import shutil
import sys

import pytest

from kvactors.transfer.native import native_copy_available


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="built and checked on Linux")
def test_the_native_copy_loop_is_built_where_a_compiler_is() -> None:
    """A C compiler here means the install built the loop: a silent build failure would skip every
    native test and leave the engine on the slower torch copier."""
    if shutil.which("cc") is None and shutil.which("gcc") is None:
        pytest.skip("no C compiler: the torch copier is used")
    assert native_copy_available(), "a C compiler is here but kvactors.transfer._streamcopy is not built"
