"""The documents resolve: every path, test and module they cite exists; the version and CI agree.

What is checked:

* README.md and docs/*.md: every repository path (``kvactors/...``, ``tests/...``,
  ``scripts/...``, ``docs/...``, ``.ci/...``), every relative Markdown link, every bare
  ``NAME.md``, every test reference ``tests/FILE.py::NAME`` (``::Class::method``; a
  ``[param]`` suffix is ignored) and every dotted name ``kvactors.a.b.Name`` (the module,
  then its top-level name, then that class's attribute);
* the docstrings of kvactors/: the ``docs/``, ``scripts/``, ``tests/`` paths and bare
  ``NAME.md`` names they cite.

References known not to resolve yet are listed once, in :data:`KNOWN_UNRESOLVED`, with what
they should become; the list must shrink as they are fixed: a listed reference that resolves
fails the test too, so the list cannot go stale.
"""

from __future__ import annotations

import ast
import functools
import importlib.metadata
import re
import tomllib
from pathlib import Path

import kvactors

ROOT = Path(__file__).resolve().parents[1]
DOCUMENTS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]

KNOWN_UNRESOLVED: dict[tuple[str, str], str] = {
    # (file, reference): what it should become. Empty: every reference resolves.
}

_PATH = re.compile(r"(?<![\w./~-])((?:kvactors|tests|scripts|docs|\.ci)/[\w./-]*)")
_TEST = re.compile(r"(?<![\w./-])(tests/[\w/]+\.py)::([\w:]+)")
_LINK = re.compile(r"\]\(([^)\s#]+)(?:#[^)]*)?\)")
_BARE_MD = re.compile(r"(?<![\w./-])([\w-]+\.md)\b")
_DOTTED = re.compile(r"(?<![\w./-])kvactors(?:\.[A-Za-z_]\w*)+")


def _rel(path: Path) -> str:
    return path.relative_to(ROOT).as_posix()


def _path_exists(ref: str, base: Path = ROOT) -> bool:
    return (base / ref.rstrip(".,;:")).exists() or (ROOT / ref.rstrip(".,;:")).exists()


def _bare_md_exists(name: str) -> bool:
    return (ROOT / name).exists() or (ROOT / "docs" / name).exists()


@functools.cache
def _tree(path: Path) -> ast.Module:
    return ast.parse(path.read_text(encoding="utf-8"))


def _names(body: list[ast.stmt]) -> dict[str, ast.stmt]:
    """Names a module or class body defines: defs, classes, assignments, imports."""
    names: dict[str, ast.stmt] = {}
    for node in body:
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
            names[node.name] = node
        elif isinstance(node, ast.Assign):
            for target in node.targets:
                if isinstance(target, ast.Name):
                    names[target.id] = node
                    if target.id == "__all__" and isinstance(node.value, ast.List | ast.Tuple):
                        for element in node.value.elts:
                            if isinstance(element, ast.Constant) and isinstance(element.value, str):
                                names.setdefault(element.value, node)
        elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            names[node.target.id] = node
        elif isinstance(node, ast.Import | ast.ImportFrom):
            for alias in node.names:
                names[(alias.asname or alias.name).split(".")[0]] = node
        elif isinstance(node, ast.If | ast.Try):
            names.update(_names(node.body))
            for handler in getattr(node, "handlers", ()):
                names.update(_names(handler.body))
    return names


def _test_exists(file: str, name: str) -> bool:
    path = ROOT / file
    if not path.is_file():
        return False
    body = _tree(path).body
    for part in name.split("::"):
        node = _names(body).get(part)
        if node is None:
            return False
        body = node.body if isinstance(node, ast.ClassDef) else []
    return True


def _module_file(parts: list[str]) -> Path | None:
    base = ROOT.joinpath(*parts)
    if (base / "__init__.py").is_file():
        return base / "__init__.py"
    if base.with_suffix(".py").is_file():
        return base.with_suffix(".py")
    return None


@functools.cache
def _logger_names() -> frozenset[str]:
    """The stdlib loggers kvactors logs to: ``kvactors`` and each ``component_logger("x")``'s ``kvactors.x``."""
    names = {"kvactors"}
    for path in (ROOT / "kvactors").rglob("*.py"):
        names.update(f"kvactors.{n}" for n in re.findall(r'component_logger\(\s*"([\w.]+)"', path.read_text()))
    return frozenset(names)


def _dotted_exists(ref: str) -> bool:
    if ref in _logger_names():
        return True
    parts = ref.split(".")
    for cut in range(len(parts), 0, -1):
        module = _module_file(parts[:cut])
        if module is None:
            continue
        rest = parts[cut:]
        if not rest:
            return True
        node = _names(_tree(module).body).get(rest[0])
        if node is None:
            return False
        if len(rest) > 1 and isinstance(node, ast.ClassDef):
            return rest[1] in _names(node.body)
        return True
    return False


def _document_unresolved(doc: Path) -> set[tuple[str, str]]:
    text = doc.read_text(encoding="utf-8")
    name = _rel(doc)
    bad: set[tuple[str, str]] = set()
    for file, test in _TEST.findall(text):
        test = re.sub(r"\[.*", "", test)
        if not _test_exists(file, test):
            bad.add((name, f"{file}::{test}"))
    for ref in _PATH.findall(re.sub(r"::[\w:]+", "", text)):
        if not _path_exists(ref):
            bad.add((name, ref.rstrip(".,;:")))
    for target in _LINK.findall(text):
        if "://" not in target and not _path_exists(target, doc.parent):
            bad.add((name, target))
    for md in _BARE_MD.findall(text):
        if not _bare_md_exists(md):
            bad.add((name, md))
    for ref in _DOTTED.findall(text):
        if not _dotted_exists(ref):
            bad.add((name, ref))
    return bad


def _docstrings(path: Path) -> list[str]:
    nodes = [node for node in ast.walk(_tree(path))
             if isinstance(node, ast.Module | ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef)]
    texts = [ast.get_docstring(node, clean=False) for node in nodes]
    # Attribute docstrings: a string literal right after an assignment.
    texts += [node.value.value for node in ast.walk(_tree(path))
              if isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant)
              and isinstance(node.value.value, str)]
    return [text for text in texts if text]


def _docstring_unresolved(path: Path) -> set[tuple[str, str]]:
    bad: set[tuple[str, str]] = set()
    for text in _docstrings(path):
        for ref in _PATH.findall(text):
            if ref.split("/")[0] in ("docs", "scripts", "tests") and not _path_exists(ref):
                bad.add((_rel(path), ref.rstrip(".,;:")))
        for md in _BARE_MD.findall(text):
            if not _bare_md_exists(md):
                bad.add((_rel(path), md))
    return bad


def _all_unresolved() -> set[tuple[str, str]]:
    bad: set[tuple[str, str]] = set()
    for doc in DOCUMENTS:
        bad |= _document_unresolved(doc)
    for path in sorted((ROOT / "kvactors").rglob("*.py")):
        bad |= _docstring_unresolved(path)
    return bad


def test_every_reference_in_the_documents_and_docstrings_resolves():
    unresolved = _all_unresolved() - set(KNOWN_UNRESOLVED)
    assert not unresolved, "references to nothing: " + ", ".join(f"{f}: {r}" for f, r in sorted(unresolved))


def test_the_known_unresolved_list_is_not_stale():
    fixed = set(KNOWN_UNRESOLVED) - _all_unresolved()
    assert not fixed, "these resolve now; remove them from KNOWN_UNRESOLVED: " + ", ".join(map(str, sorted(fixed)))


def test_the_checker_finds_what_it_should():
    """The resolvers themselves: a wrong name of each kind is caught, a right one passes."""
    assert _test_exists("tests/test_contract.py", "test_rule1_finish_once_and_no_submit_after_it")
    assert _test_exists("tests/test_stateful.py", "TestManagerMachine")
    assert _test_exists("tests/test_pool.py", "RowLRUMachine")
    assert not _test_exists("tests/test_contract.py", "test_rule9_does_not_exist")
    assert not _test_exists("tests/no_such_file.py", "test_x")
    assert _dotted_exists("kvactors.core.lifecycle.LifecycleTable.maybe_finalize")
    assert _dotted_exists("kvactors.SecondaryTier")
    assert _dotted_exists("kvactors.integrations.vllm.KvactorsOffloadingSpec")
    assert not _dotted_exists("kvactors.core.lifecycle.LifecycleTable.no_such_method")
    assert not _dotted_exists("kvactors.core.no_such_module")
    assert _PATH.findall("see `docs/contract.md`, not /dev/shm/kvactors_pool") == ["docs/contract.md"]
    assert _TEST.findall("`tests/test_x.py::A::test_b[p]`") == [("tests/test_x.py", "A::test_b")]


def test_version_is_the_installed_metadata_and_pyproject_version():
    with open(ROOT / "pyproject.toml", "rb") as f:
        declared = tomllib.load(f)["project"]["version"]
    assert kvactors.__version__ == importlib.metadata.version("kvactors") == declared


def test_ci_runs_the_readme_test_command_with_lint_first():
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    command = re.search(r"CI runs `([^`]+)`", readme)
    assert command is not None, "README.md names the command CI runs"
    ci = (ROOT / ".ci" / "run").read_text(encoding="utf-8")
    assert f"exec {command.group(1)}\n" in ci
    test_sh = (ROOT / "scripts" / "test.sh").read_text(encoding="utf-8").splitlines()
    lint = next(i for i, line in enumerate(test_sh) if line.startswith("suite lint scripts/lint.sh"))
    main = next(i for i, line in enumerate(test_sh) if line.startswith("suite main "))
    assert lint < main
    lint_sh = (ROOT / "scripts" / "lint.sh").read_text(encoding="utf-8")
    assert "ruff\" check kvactors tests scripts" in lint_sh and "mypy\" kvactors" in lint_sh
    with open(ROOT / "pyproject.toml", "rb") as f:
        extras = tomllib.load(f)["project"]["optional-dependencies"]
    assert {re.split(r"[<>=]", dep)[0] for dep in extras["lint"]} == {"ruff", "mypy"}
    setup = (ROOT / "scripts" / "setup.sh").read_text(encoding="utf-8")
    installed = re.search(r'pip_install -e "\.\[([\w,]+)\]"', setup)
    assert installed is not None and {"test", "lint"} <= set(installed.group(1).split(","))


def _documented_options(section: str) -> set[str]:
    """The ``--options`` of the option table under a ``## `kvactors NAME` `` heading of docs/cli.md."""
    text = (ROOT / "docs" / "cli.md").read_text(encoding="utf-8")
    body = re.split(r"^## ", text, flags=re.MULTILINE)
    part = next(p for p in body if p.startswith(f"`kvactors {section}`"))
    rows = [line for line in part.splitlines() if line.startswith("| `--")]
    return {option for row in rows for option in re.findall(r"`(--[\w-]+)", row.split("|")[1])}


def test_cli_md_documents_every_option_of_each_command_and_no_other():
    """docs/cli.md's option tables and the commands' parsers name the same options (``--help`` aside)."""
    from kvactors.cli import build_parser, subparsers

    parsers = subparsers(build_parser()[0])
    for name in ("simulate", "stress"):
        declared = {option for action in parsers[name]._actions for option in action.option_strings
                    if option.startswith("--") and option != "--help"}
        documented = _documented_options(name)
        assert documented <= declared, f"{name}: documented, not an option: {sorted(documented - declared)}"
        undocumented = declared - documented - {"--num-blocks"}  # stress's old name, named in the text
        assert not undocumented, f"{name}: options docs/cli.md does not name: {sorted(undocumented)}"
    assert "--num-blocks" in (ROOT / "docs" / "cli.md").read_text(encoding="utf-8")
