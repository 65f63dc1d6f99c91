"""The layout's contract: `stages/` is plain PyTorch and never imports Ray; `deployments/` holds no model math;
no import cycles among `stages` and `deployments` modules; `deployments/` reaches `stages` only through the
modules allowlisted below."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
LAYERS = ("stages", "deployments")

# The `stages` modules `deployments/` may import (its face toward Serve). Engines are named by "module:Class"
# strings (DEFAULT_ENGINE_CLS) rather than imported, and are listed too.
DEPLOYMENTS_MAY_IMPORT = frozenset({
    "stages.contract",  # plain types and errors that cross deployments
    "stages.config",  # checkpoint facts (ModelConfig, GenerationDefaults)
    "stages.prompts",  # tokenizer and prompt building on the ingress
    "stages.voice.prompt",  # voice-clone prompts from reference audio
    "stages.chunking",  # the chunk schedule
    "stages.arrival_rate",  # the "more expected within the wait?" rule of batch holds (the engine's too)
    "stages.talker.layout",  # prefill_length and the KV-fit rule: planning on the ingress
    "stages.talker.engine_config",  # the engine's defaults (max_num_seqs), torch-free
    "stages.code2wav.engine_config",  # the engine's defaults (max_batch_size, stateful), torch-free
    "stages.qwen3_tts",  # loading a checkpoint
    "stages.row_invariant_products",  # a deterministic replica's cuBLAS setting, before its model loads
    "stages.random_checkpoint",  # writing the embedded default
    "stages.talker.engine",  # DEFAULT_ENGINE_CLS
    "stages.code2wav.engine",  # DEFAULT_ENGINE_CLS
    "stages.aligner.aligner",  # the Aligner deployment's DEFAULT_ENGINE_CLS
    "stages.aligner.timestamps",  # Word: the Aligner's answers, torch-free
    "stages.aligner.words",  # the word split and its languages: checking a piece before a forward, torch-free
    "stages.aligner.random_checkpoint",  # writing the embedded aligner
})


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


def _module_names(root: Path, packages: tuple[str, ...] = LAYERS) -> dict[str, Path]:
    """`a.b.c` -> its file, for every module of `packages` under `root` (a package is its __init__.py)."""
    modules = {}
    for package in packages:
        for path in (root / package).rglob("*.py"):
            parts = path.relative_to(root).with_suffix("").parts
            modules[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return modules


def _import_graph(root: Path, packages: tuple[str, ...] = LAYERS) -> dict[str, set[str]]:
    """module -> the modules of `packages` it imports, anywhere in the file (function bodies and
    TYPE_CHECKING blocks included). `from a.b import c` counts as `a.b.c` when that is a module."""
    modules = _module_names(root, packages)

    def known(name: str) -> str | None:
        while name and name not in modules:
            name = name.rpartition(".")[0]
        return name or None

    graph: dict[str, set[str]] = {}
    for module, path in modules.items():
        deps = set()
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.Import):
                deps.update(known(a.name) for a in node.names)
            elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                deps.update(known(f"{node.module}.{a.name}") for a in node.names)
        graph[module] = deps - {None, module}
    return graph


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components with more than one module (Tarjan), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in sorted(graph.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def _disallowed_stages_imports(graph: dict[str, set[str]]) -> list[str]:
    return sorted(
        f"{module} -> {dep}"
        for module, deps in graph.items() if module.split(".")[0] == "deployments"
        for dep in deps if dep.split(".")[0] == "stages" and dep not in DEPLOYMENTS_MAY_IMPORT
    )


def test_no_import_cycles():
    assert _cycles(_import_graph(ROOT)) == []


def test_deployments_import_only_allowlisted_stages_modules():
    assert _disallowed_stages_imports(_import_graph(ROOT)) == []


def _plant(root: Path, files: dict[str, str]) -> None:
    for name, text in files.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text(text, encoding="utf-8")


def test_cycle_check_finds_a_planted_cycle(tmp_path):
    _plant(tmp_path, {
        "stages/__init__.py": "",
        "stages/a.py": "from stages.b import thing\n",
        "stages/b.py": "def thing():\n    from stages import c\n",  # a lazy import closes it all the same
        "stages/c.py": "import stages.a\n",
        "stages/d.py": "from stages.a import x\n",  # imports into the cycle, is not part of it
        "deployments/__init__.py": "",
    })
    assert _cycles(_import_graph(tmp_path)) == [["stages.a", "stages.b", "stages.c"]]


def test_allowlist_check_finds_a_planted_import(tmp_path):
    _plant(tmp_path, {
        "stages/__init__.py": "",
        "stages/contract.py": "",
        "stages/talker/__init__.py": "",
        "stages/talker/runner.py": "",
        "deployments/__init__.py": "",
        "deployments/ok.py": "from stages.contract import SynthesisRequest\n",
        "deployments/bad.py": "def f():\n    from stages.talker import runner\n",
    })
    assert _disallowed_stages_imports(_import_graph(tmp_path)) == ["deployments.bad -> stages.talker.runner"]


def test_deployments_keep_few_top_level_modules_and_short_files():
    """`deployments/` is a package per Serve process; at its top only what several processes share (at most 14
    modules: the live text's mailbox and the event-loop lag readout are used by both the ingress and the Talker), and
    no file over 450 lines."""
    top = sorted(p.name for p in (ROOT / "deployments").glob("*.py"))
    assert len(top) <= 14, top
    long = {str(p.relative_to(ROOT)): n for p in (ROOT / "deployments").rglob("*.py")
            if (n := len(p.read_text(encoding="utf-8").splitlines())) > 450}
    assert long == {}


def test_a_talker_replica_has_what_live_text_unpickles_without_the_ingress_package():
    """A live call carries the ingress replica's `TextMailbox` handle and the Talker unpickles its events: the module
    holding both is loaded with the Talker's server, and it does not pull in the ingress package (the first live call
    imported it there, ~150 ms of the first audio of every context then arriving)."""
    import subprocess
    import sys

    code = ("import sys, deployments.talker.server\n"
            "assert 'deployments.text_mailbox' in sys.modules\n"
            "assert not any(m == 'deployments.ingress' or m.startswith('deployments.ingress.') for m in sys.modules)\n"
            "import deployments.text_mailbox\n"
            "assert not any(m.startswith('deployments.ingress') for m in sys.modules)\n")
    subprocess.run([sys.executable, "-c", code], cwd=ROOT, check=True, timeout=300)
