"""Data flows one way (design.md): preprocess -> vision -> mm -> lm, app on top. No module of a
folder imports a folder it may not, not even inside a function."""

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
FOLDERS = ("preprocess", "vision", "lm", "mm", "app")
MAY_IMPORT = {  # besides itself
    "preprocess": set(),
    "vision": set(),
    "lm": set(),
    "mm": {"preprocess", "vision", "lm"},
    "app": {"preprocess", "vision", "lm", "mm"},
}


def _imported_folders(path: Path) -> set[str]:
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            found |= {alias.name.split(".")[0] for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            found.add(node.module.split(".")[0])
    return found & set(FOLDERS)


@pytest.mark.parametrize("folder", FOLDERS)
def test_no_upward_or_sideways_import(folder):
    bad = []
    for path in sorted((ROOT / folder).rglob("*.py")):
        for other in _imported_folders(path) - MAY_IMPORT[folder] - {folder}:
            bad.append(f"{path.relative_to(ROOT)} imports {other}")
    assert not bad, "imports against the data flow (design.md):\n" + "\n".join(bad)
