"""rose.harness drives rose's processes from outside: the runtime (rose-worker, the engine, the job contract, the
settings) never imports it."""

from __future__ import annotations

import ast
from pathlib import Path

import rose

RUNTIME_PACKAGES = ("worker", "engine", "jobs", "config")


def harness_imports(path: Path) -> list[str]:
    """The `rose.harness...` modules `path` imports, at any depth (a lazy import inside a function counts)."""
    names = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names += [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.append(node.module)
    return [name for name in names if name.split(".")[:2] == ["rose", "harness"]]


def test_the_runtime_never_imports_the_harness():
    root = Path(rose.__file__).parent
    files = [root / "__init__.py", root / "__main__.py"]
    files += [f for package in RUNTIME_PACKAGES for f in (root / package).rglob("*.py")]
    assert len(files) > 20  # the packages were found
    offenders = {str(f.relative_to(root)): imports for f in files if (imports := harness_imports(f))}
    assert offenders == {}


def test_the_check_sees_lazy_imports(tmp_path):
    src = tmp_path / "m.py"
    src.write_text(
        "def f():\n    from rose.harness.worker_process import wait_for\n    import rose.harness\n"
    )
    assert harness_imports(src) == ["rose.harness.worker_process", "rose.harness"]
