"""The package's layers import downward only (README, Layout): the drivers
never reach up into the session, backend or front ends, nor into each
other, so either can be read, tested and replaced on its own."""

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parent.parent / "sandboxns"

# module -> package modules it must not import
FORBIDDEN = {
    "_paths": {"_files", "_driver", "_session", "_backend", "_templates"},
    "_driver": {"_native", "_bwrap", "_registry", "_session", "_open", "_backend"},
    "_native": {"_bwrap", "_registry", "_session", "_open", "_backend", "_templates"},
    "_bwrap": {"_native", "_registry", "_session", "_open", "_backend", "_templates"},
    "_templates": {"_session", "_open", "_backend"},
    "_registry": {"_session", "_open", "_backend"},
    "_state": {"_backend", "_pool", "_open", "_native", "_bwrap"},
    "_pool": {"_backend", "_state", "_session", "_open", "_native", "_bwrap"},
    "_handle": {"_backend", "_open", "_native", "_bwrap"},
}


def _runtime_nodes(tree: ast.AST):
    """Every node but those under ``if TYPE_CHECKING:`` (annotations only)."""
    for node in ast.iter_child_nodes(tree):
        if isinstance(node, ast.If) and isinstance(node.test, ast.Name) and node.test.id == "TYPE_CHECKING":
            for branch in node.orelse:  # runs, unlike the body
                yield branch
                yield from _runtime_nodes(branch)
            continue
        yield node
        yield from _runtime_nodes(node)


def package_imports(module: str) -> set[str]:
    tree = ast.parse((PACKAGE / f"{module}.py").read_text())
    found = set()
    for node in _runtime_nodes(tree):
        if isinstance(node, ast.ImportFrom) and node.level == 1:
            if node.module:
                found.add(node.module.split(".")[0])
            else:
                found.update(alias.name for alias in node.names)
    return found


@pytest.mark.parametrize("module", sorted(FORBIDDEN))
def test_module_imports_only_below_itself(module):
    assert package_imports(module) & FORBIDDEN[module] == set()


def test_the_check_sees_imports():
    # The session layer does import the drivers' contract: the parser finds it.
    assert "_driver" in package_imports("_session")
    # A handle names its backend in annotations only, which the check leaves out.
    assert "_backend" not in package_imports("_handle")
    assert "from ._backend import Backend" in (PACKAGE / "_handle.py").read_text()
