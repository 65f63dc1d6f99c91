"""The layout's contract: `stages/` is plain PyTorch and never imports Ray; `deployments/` holds no model math."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _imports(path: Path) -> set[str]:
    tree = ast.parse(path.read_text(encoding="utf-8"))
    names: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names.update(a.name.split(".")[0] for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module.split(".")[0])
    return names


def test_stages_never_import_ray():
    offenders = [str(p.relative_to(ROOT)) for p in (ROOT / "stages").rglob("*.py") if "ray" in _imports(p)]
    assert offenders == []


def test_deployments_define_no_torch_modules():
    offenders = []
    for path in (ROOT / "deployments").rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.ClassDef) and any(
                isinstance(b, ast.Attribute) and b.attr == "Module" for b in node.bases
            ):
                offenders.append(f"{path.relative_to(ROOT)}:{node.name}")
    assert offenders == []
