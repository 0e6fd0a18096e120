"""The import graph has floors, and modules share no private names.

kernels -> recipes and quantization (and the backend, autocast) -> ops -> what is
built on ops (graphs, warmup, apply_recipe, convert, models, the main job): a module
imports only from its own floor or below, lazily inside a function too, and never
a name another module keeps private (a leading underscore)."""

from __future__ import annotations

import ast
import pathlib

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
FLOORS = [  # (floor, module prefixes as dotted names under te_fuser)
    (0, ("kernels",)),
    (1, ("epoch", "fp8", "callable_key", "recipe", "recipe_agreement", "quantization", "backend", "autocast")),
    (2, ("ops",)),
    (3, ("graphs", "warmup", "apply", "convert", "parallel", "checkpoint", "models", "plot", "__main__", "__init__")),
]


def _dotted(path: pathlib.Path) -> str:
    rel = path.relative_to(ROOT).with_suffix("")
    parts = list(rel.parts)
    if parts[0] == "te_fuser":
        parts = parts[1:]
    if parts and parts[-1] == "__init__" and len(parts) > 1:
        parts = parts[:-1]
    return ".".join(parts) or "__init__"


def _floor(dotted: str) -> int:
    for floor, prefixes in FLOORS:
        if any(dotted == p or dotted.startswith(p + ".") for p in prefixes):
            return floor
    raise AssertionError(f"{dotted}: no floor assigned (add it to FLOORS)")


def _sources():
    return sorted(p for p in [*(ROOT / "te_fuser").rglob("*.py"), *(ROOT / "kernels").rglob("*.py")])


def _imported(path: pathlib.Path, node: ast.ImportFrom) -> list[str]:
    """The te_fuser-internal modules an import names (dotted, as in FLOORS)."""
    if node.level == 0:
        module = node.module or ""
        if module != "te_fuser" and not module.startswith("te_fuser."):
            return []
        base = module.split(".")[1:]
    else:
        here = _dotted(path).split(".")
        package = here if path.name == "__init__.py" else here[:-1]
        base = package[: len(package) - (node.level - 1)]
        base += node.module.split(".") if node.module else []
    if node.module is None or base == []:  # `from .. import backend`: the names are modules
        return [".".join([*base, a.name]) for a in node.names]
    return [".".join(base)]


@pytest.mark.parametrize("path", _sources(), ids=lambda p: str(p.relative_to(ROOT)))
def test_a_module_imports_only_from_its_floor_or_below(path):
    mine = _floor(_dotted(path))
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            for target in _imported(path, node):
                if _has_floor(target):
                    assert _floor(target) <= mine, \
                        f"{_dotted(path)} (floor {mine}) imports {target} (floor {_floor(target)}, line {node.lineno})"


def _has_floor(dotted: str) -> bool:
    try:
        _floor(dotted)
        return True
    except AssertionError:
        return False


@pytest.mark.parametrize("path", _sources(), ids=lambda p: str(p.relative_to(ROOT)))
def test_no_private_name_is_imported_from_another_module(path):
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            private = [a.name for a in node.names if a.name.startswith("_") and not a.name.startswith("__")]
            assert not private, f"{_dotted(path)} imports {private} from {node.module} (line {node.lineno})"


def test_the_kernel_layer_imports_nothing_of_te_fuser():
    for path in (ROOT / "kernels").rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom):
                assert not (node.level == 0 and (node.module or "").startswith("te_fuser")), path
                assert node.level <= len(path.relative_to(ROOT / "kernels").parts), f"{path}: imports above kernels"


@pytest.mark.parametrize("path", sorted((ROOT / "te_fuser" / "ops" / "fused").glob("*.py")), ids=lambda p: p.name)
def test_a_fused_op_imports_nothing_from_another_fused_op(path):
    """Helpers two fused ops share live in the basic-op layer (``ops/basic``), so a
    fused op is one file that can be read, copied or removed alone."""
    if path.name == "__init__.py":
        return  # the rule table imports every fused op
    tree = ast.parse(path.read_text())
    siblings = [n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.level == 1 and n.module]
    assert not siblings, f"{path.name} imports from sibling fused ops: {siblings}"
