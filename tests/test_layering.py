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


# Inside lm/: the packages at its bottom import nothing above them. lm/formats (how weights are
# stored) knows no kernels; lm/kernels (the CPU kernels and their tuning) reads formats only.
LM_BELOW = {"lm.formats": {"lm.formats"}, "lm.kernels": {"lm.kernels", "lm.formats", "lm.hugepages"}}


def _lm_imports(path: Path) -> set[str]:
    """The lm modules `path` imports (absolute or relative), as dotted names."""
    package = ".".join(path.relative_to(ROOT).with_suffix("").parts[:-1])
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom):
            base = package.rsplit(".", node.level - 1)[0] if node.level else ""
            module = ".".join(p for p in (base, node.module or "") if p)
            found |= {f"{module}.{alias.name}" for alias in node.names} if not node.module else {module}
    return {name for name in found if name == "lm" or name.startswith("lm.")}


@pytest.mark.parametrize("package", sorted(LM_BELOW))
def test_the_bottom_of_lm_imports_nothing_above_it(package):
    bad = []
    for path in sorted((ROOT / package.replace(".", "/")).rglob("*.py")):
        for name in _lm_imports(path):
            if not any(name == ok or name.startswith(ok + ".") for ok in LM_BELOW[package]):
                bad.append(f"{path.relative_to(ROOT)} imports {name}")
    assert not bad, f"{package} imports above it:\n" + "\n".join(bad)
