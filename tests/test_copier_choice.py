"""The copier choice of the engine and the vLLM worker, written once (kvactors.transfer.choice)."""

from __future__ import annotations

from typing import Any

import pytest

from kvactors.transfer import choice
from kvactors.transfer.choice import COPIERS, check_copier, host_copier

pytestmark = pytest.mark.timeout(30)


class _Log:
    def __init__(self) -> None:
        self.warnings: list[tuple[str, dict[str, Any]]] = []

    def warning(self, event: str, **fields: Any) -> None:
        self.warnings.append((event, fields))


def _choose(choice_: str, *, blocked: str | None = None, native_fails: bool = False) -> tuple[str, Any, _Log]:
    log = _Log()

    def native() -> Any:
        if native_fails:
            raise RuntimeError("no memory for the native copier")
        return "native copier"

    name, copier = host_copier(choice_, native=native, torch_copier=lambda: "torch copier", blocked=blocked,
                               log=log)  # type: ignore[arg-type]
    return name, copier, log


@pytest.fixture
def built(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(choice, "native_copy_available", lambda: True)


def test_every_copier_name_is_checked_and_nothing_else_passes() -> None:
    for name in COPIERS:
        check_copier(name)
    for bad in ("Native", "", None, 1, ["native"], "cuda"):
        with pytest.raises(ValueError, match="copier must be one of"):
            check_copier(bad)


@pytest.mark.usefixtures("built")
def test_auto_and_native_build_the_native_copier_where_it_runs_and_torch_builds_torch() -> None:
    assert _choose("auto")[:2] == ("native", "native copier")
    assert _choose("native")[:2] == ("native", "native copier")
    name, copier, log = _choose("torch", blocked="whatever")
    assert (name, copier, log.warnings) == ("torch", "torch copier", [])


@pytest.mark.usefixtures("built")
@pytest.mark.parametrize(("blocked", "native_fails", "reason"), [
    ("the device cache is not contiguous", False, "not contiguous"),
    (None, True, "no memory for the native copier"),
])
def test_where_native_cannot_run_auto_warns_and_falls_back_and_native_refuses(blocked, native_fails, reason) -> None:
    name, copier, log = _choose("auto", blocked=blocked, native_fails=native_fails)
    assert (name, copier) == ("torch", "torch copier")
    assert [(event, reason in fields["error"]) for event, fields in log.warnings] == [
        ("native_copier_unavailable", True)]
    with pytest.raises(ValueError, match=f"copier='native' cannot be used: .*{reason}"):
        _choose("native", blocked=blocked, native_fails=native_fails)


def test_without_the_extension_auto_falls_back_and_native_refuses(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(choice, "native_copy_available", lambda: False)
    name, _, log = _choose("auto")
    assert name == "torch" and log.warnings[0][1]["error"].startswith("it is not built")
    with pytest.raises(ValueError, match="not built"):
        _choose("native")
