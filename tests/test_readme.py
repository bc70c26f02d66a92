"""The Python examples of README.md and of every page in docs/ run as they are.

An example is a fenced ``python`` block; a ``python-vllm`` block needs vLLM and is not run here
(the vLLM suites run its equivalent).
"""

from __future__ import annotations

import pathlib
import re

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
DOCUMENTS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
EXAMPLES = [(doc, n, source) for doc in DOCUMENTS
            for n, source in enumerate(re.findall(r"```python\n(.*?)```", doc.read_text(), flags=re.DOTALL))]
IDS = [f"{doc.relative_to(ROOT).as_posix()}-example{n}" for doc, n, _ in EXAMPLES]


def test_readme_has_examples():
    assert any(doc.name == "README.md" for doc, _, _ in EXAMPLES)


@pytest.mark.parametrize("pages", [("guide.md", "metrics.md", "testing.md")])
def test_the_moved_reference_keeps_its_examples(pages):
    """The examples that moved out of README.md are still run, in their pages."""
    assert {doc.name for doc, _, _ in EXAMPLES} >= set(pages)


@pytest.mark.parametrize(("doc", "n", "source"), EXAMPLES, ids=IDS)
def test_readme_example_runs(doc, n, source, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    exec(compile(source, str(doc), "exec"), {"__name__": "__readme__"})
