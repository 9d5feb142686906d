"""The README's layout table and docs/layout.md are generated from the docstrings: current, and a module
without one is refused by name."""

from __future__ import annotations

import pytest

from tests.helpers import script_module

layout_doc = script_module("layout_doc")


def test_the_readme_table_and_docs_layout_are_current():
    assert layout_doc.main(["--check"]) == 0, "run `python3 scripts/layout_doc.py`"


def test_every_folder_and_module_is_listed():
    readme, layout = layout_doc.README.read_text(), layout_doc.LAYOUT.read_text()
    for folder in layout_doc.folders():
        rel = folder.relative_to(layout_doc.ROOT).as_posix()
        assert f"[`{rel}/`]" in readme and f"\n## {rel}\n" in layout
        for module in layout_doc.modules(folder):
            assert f"| `{module.name}` |" in layout


def test_a_module_without_a_docstring_is_named(tmp_path, monkeypatch):
    monkeypatch.setattr(layout_doc, "ROOT", tmp_path)
    (tmp_path / "pkg").mkdir()
    (tmp_path / "pkg" / "__init__.py").write_text('"""A package. More here."""\n')
    (tmp_path / "pkg" / "quiet.py").write_text("x = 1\n")
    assert layout_doc.summary(tmp_path / "pkg" / "__init__.py") == "A package."
    with pytest.raises(layout_doc.MissingDocstring, match="pkg/quiet.py has no docstring"):
        layout_doc.summary(tmp_path / "pkg" / "quiet.py")
