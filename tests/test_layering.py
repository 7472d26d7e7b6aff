"""The dependency between the kernels and the worker runs one way: the worker imports kernels/, never the reverse,
and only the triton-free part of kernels/ when its modules are loaded, so CPU callers never import triton.

The checks parse the sources with `ast` instead of importing them, so they see imports in every branch and function.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from shared.config import DEFAULT_MODEL_DIR

ROOT = Path(__file__).resolve().parent.parent
KERNELS = ROOT / "kernels"
SERVICES = ROOT / "services"
KERNELS_MUST_NOT_IMPORT = ("services", "shared")  # kernels/ is a leaf: torch, triton and itself only
TRITON_FREE_KERNEL_MODULES = {"kernels": KERNELS / "__init__.py", "kernels.constants": KERNELS / "constants.py"}


def _is_module(name: str) -> bool:
    path = ROOT.joinpath(*name.split("."))
    return path.with_suffix(".py").is_file() or (path / "__init__.py").is_file()


def _imported(node: ast.AST) -> list[str]:
    """The absolute module names an import statement loads (`from a import b` loads a, and a.b if a module)."""
    if isinstance(node, ast.Import):
        return [alias.name for alias in node.names]
    if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module is not None:
        submodules = [f"{node.module}.{alias.name}" for alias in node.names]
        return [node.module] + [name for name in submodules if _is_module(name)]
    return []


def _top_level(module: str) -> str:
    return module.split(".", 1)[0]


def _loads_triton(module: str) -> bool:
    """Whether importing the module imports triton: triton itself or a kernel module other than the triton-free."""
    top = _top_level(module)
    return top == "triton" or (top == "kernels" and module not in TRITON_FREE_KERNEL_MODULES)


def _parse(path: Path) -> ast.Module:
    return ast.parse(path.read_text(), filename=str(path))


def _sources(folder: Path) -> Iterator[tuple[str, ast.Module]]:
    for path in sorted(folder.rglob("*.py")):
        yield str(path.relative_to(ROOT)), _parse(path)


def test_kernels_import_nothing_from_the_worker() -> None:
    offending = [
        (name, module)
        for name, tree in _sources(KERNELS)
        for node in ast.walk(tree)
        for module in _imported(node)
        if _top_level(module) in KERNELS_MUST_NOT_IMPORT
    ]
    assert offending == [], f"kernels/ must not import {KERNELS_MUST_NOT_IMPORT}: {offending}"


def test_the_triton_free_kernel_modules_stay_free_of_triton() -> None:
    offending = [
        (name, module)
        for name, path in TRITON_FREE_KERNEL_MODULES.items()
        for node in ast.walk(_parse(path))
        for module in _imported(node)
        if _loads_triton(module)
    ]
    assert offending == [], f"these modules are imported by CPU code and must not load triton: {offending}"


def test_services_import_kernel_modules_only_inside_functions() -> None:
    offending = [
        (name, module)
        for name, tree in _sources(SERVICES)
        for node in tree.body  # the module-level statements, run when the module is imported
        for module in _imported(node)
        if _loads_triton(module)
    ]
    assert offending == [], f"services/ may load only {list(TRITON_FREE_KERNEL_MODULES)} at import time: {offending}"


@pytest.mark.parametrize("module", ["services.gateway.app", "services.detokenizer.service", "services.launcher"])
def test_services_without_a_model_do_not_load_torch(module: str) -> None:
    """The gateway, the detokenizer and `specmesh up` start (and restart) without torch's import and teardown."""
    probe = f"import sys, {module}; sys.exit('torch' in sys.modules)"
    result = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, f"importing {module} loads torch\n{result.stderr[-2000:]}"


@pytest.mark.parametrize("command", ["up", "gateway", "detokenizer"])
def test_commands_without_a_model_resolve_their_options_without_torch(command: str) -> None:
    """Checking options against the model reads its config and weight headers, never torch (2 s of every start)."""
    probe = (
        "import sys; from services.cli import parse; "
        f"parse([{command!r}, '--model', {str(DEFAULT_MODEL_DIR)!r}]); sys.exit('torch' in sys.modules)"
    )
    result = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, f"specmesh {command} loads torch to resolve its options\n{result.stderr[-2000:]}"
