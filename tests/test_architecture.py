"""The package's shape: no import cycles between its modules (imports inside functions count too)."""
from __future__ import annotations

import ast
from pathlib import Path

import shuffleprune

ROOT = Path(shuffleprune.__file__).parent
REPO = ROOT.parent
# kernels/ and calib/ sit at the top of the repository and install as shuffleprune.kernels / .calib
TREES = {"shuffleprune": ROOT, "shuffleprune.calib": REPO / "calib", "shuffleprune.kernels": REPO / "kernels"}


def _modules() -> dict[str, Path]:
    out = {}
    for prefix, tree in TREES.items():
        for path in tree.rglob("*.py"):
            rel = path.relative_to(tree).with_suffix("")
            parts = [p for p in rel.parts if p != "__init__"]
            name = ".".join([prefix, *parts]) if parts else prefix
            if name.startswith("shuffleprune.calib.") and tree == ROOT:
                continue
            out[name] = path
    return out


def import_graph() -> dict[str, set[str]]:
    """``module -> modules of this package it imports`` (explicit imports only; a submodule's
    implicit import of its parent package is not an edge)."""
    modules = _modules()
    graph: dict[str, set[str]] = {m: set() for m in modules}
    for name, path in modules.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            targets = []
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                    base = ".".join(anchor + ([base] if base else []))
                subs = [f"{base}.{a.name}" for a in node.names if f"{base}.{a.name}" in modules]
                # ``from pkg import submodule`` imports the submodule; ``from pkg import name`` the package
                targets = subs + ([base] if len(subs) < len(node.names) else [])
            for t in targets:
                if t in modules and t != name:
                    graph[name].add(t)
    return graph


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        stack.append(node)
        for nxt in sorted(graph[node]):
            if state.get(nxt) == 1:
                return stack[stack.index(nxt):] + [nxt]
            if nxt not in state:
                found = visit(nxt)
                if found:
                    return found
        stack.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state:
            found = visit(node)
            if found:
                return found
    return None


def test_the_cycle_finder_finds_a_cycle():
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set()}) is None


def test_no_import_cycles_in_the_package():
    graph = import_graph()
    assert "shuffleprune.prune.driver" in graph and "shuffleprune.perm.core" in graph
    assert "shuffleprune.models" in graph["shuffleprune.prune.driver"]  # edges are found
    assert find_cycle(graph) is None, " -> ".join(find_cycle(graph))


def test_prune_and_dst_share_one_permutation_core():
    graph = import_graph()
    assert "shuffleprune.perm.core" in graph["shuffleprune.dst.sparsifier"]
    assert "shuffleprune.perm.core" in graph["shuffleprune.perm.learning"]
    assert not any(m.startswith("shuffleprune.prune") for m in graph["shuffleprune.perm.pruning"])


def test_what_auto_choice_reads_of_a_layer_is_what_sparse_linear_has():
    """``auto_choice`` reads the layer through a ``Protocol`` (the layer imports it, not the other way
    round); nothing checks that at run time, so here: every attribute it names is set on a real layer,
    and every method it names exists on ``SparseLinear`` with the same parameters."""
    import inspect
    from typing import get_type_hints

    import torch

    from shuffleprune.deploy import auto_choice
    from shuffleprune.deploy.format import compress
    from shuffleprune.deploy.sparse_linear import SparseLinear

    protocol = auto_choice.SparseLinear
    w = torch.randn(8, 16)
    w[:, 1::2] = 0
    layer = SparseLinear(*compress(w, 2, 4), 16, 2, 4)
    attributes = get_type_hints(protocol)
    assert {"values", "meta", "bias", "map_span", "tiled"} <= set(attributes)
    assert [name for name in attributes if not hasattr(layer, name)] == []
    methods = [name for name, value in vars(protocol).items() if inspect.isfunction(value) and not name.startswith("_")]
    assert {"candidates", "run", "run_on", "reference", "weight_copies", "own_gather"} <= set(methods)
    for name in methods:
        want = list(inspect.signature(getattr(protocol, name)).parameters)
        assert list(inspect.signature(getattr(SparseLinear, name)).parameters) == want, name


def test_the_docs_relative_links_point_at_files_that_exist():
    """Every relative Markdown link in the README and the notes it sends readers to (the kernels' design notes,
    the GPU history) names a file of the repository, resolved from the linking file's folder as a renderer
    resolves it: the notes were moved out of the README, and a link that lost its target would say nothing."""
    import re

    root = Path(__file__).resolve().parents[1]
    docs = [root / "README.md", root / "kernels" / "README.md", root / "scripts" / "results" / "gpu_history.md",
            root / "scripts" / "results" / "gpu_cpu_stops.md"]
    links = 0
    for doc in docs:
        for target in re.findall(r"\]\(([^)\s]+)\)", doc.read_text()):
            if re.match(r"[a-z]+://|#|mailto:|…|\.\.\.$", target):
                continue
            links += 1
            assert (doc.parent / target.split("#", 1)[0]).exists(), f"{doc.relative_to(root)} links to {target}"
    assert links >= 5


def test_every_package_folder_is_one_the_wheel_installs():
    """``pyproject.toml`` lists the packages by name (``kernels/`` and ``calib/`` install under ``shuffleprune``): a
    folder left out of that list works in this editable checkout and is missing from the wheel users install."""
    import tomllib

    listed = set(tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"])
    folders = {name for name, path in _modules().items() if path.name == "__init__.py"}
    assert "shuffleprune.runtime" in folders and folders == listed, (folders - listed, listed - folders)


def test_every_module_is_in_the_readmes_picture_of_the_code():
    """The README's "How it is built" is the living picture of the code: a module added, moved or renamed
    without it there fails here (kernels name their CUDA text and Python launcher together: ``x.cu / .py``)."""
    readme = (REPO / "README.md").read_text()
    start = readme.index("## How it is built")
    section = readme[start:readme.index("\n## ", start + 1)]
    modules = [path for tree in TREES.values() for path in tree.rglob("*.py") if path.name != "__init__.py"]
    assert any(path.name == "fold.py" for path in modules)
    missing = [str(path.relative_to(REPO)) for path in modules
               if path.name not in section and f"{path.stem}.cu / .py" not in section]
    assert missing == [], f"not in README's How it is built: {missing}"


def _import_kernels_from_the_repository(extra_path: Path | None) -> str:
    """What ``import kernels`` names in a Python started at the repository's root (``python -m pytest`` does,
    so the root is on ``sys.path``), with ``extra_path`` also on it; and that ``shuffleprune.kernels`` is ours."""
    import os
    import subprocess
    import sys

    env = {**os.environ, "PYTHONPATH": str(extra_path or "")}
    code = ("import kernels, shuffleprune.kernels.nm_words as ours; "
            "print(getattr(kernels, 'MARK', kernels.__file__)); print(ours.__file__)")
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, env=env, capture_output=True, text=True, check=True)
    name, ours = out.stdout.splitlines()
    assert Path(ours) == REPO / "kernels" / "nm_words.py"
    return name


def test_the_kernels_folder_never_hides_the_installed_kernels_package(tmp_path):
    """Hugging Face's ``kernels`` package (which transformers ≥ 5.25 installs and imports with every model) is what
    ``import kernels`` gives even where the repository's ``kernels/`` folder comes first on ``sys.path``; without
    that package, the folder stays importable by that name (transformers then finds no version and no hub kernels)."""
    installed = tmp_path / "site"
    (installed / "kernels").mkdir(parents=True)
    (installed / "kernels" / "__init__.py").write_text("MARK = 'the installed kernels package'\n")
    (installed / "kernels-0.19.1.dist-info").mkdir()
    (installed / "kernels-0.19.1.dist-info" / "METADATA").write_text("Metadata-Version: 2.1\nName: kernels\nVersion: 0.19.1\n")
    assert _import_kernels_from_the_repository(installed) == "the installed kernels package"
    import sys
    from importlib.machinery import PathFinder

    elsewhere = PathFinder.find_spec("kernels", [p for p in sys.path if p and Path(p).resolve() != REPO])
    want = elsewhere.origin if elsewhere is not None else str(REPO / "kernels" / "__init__.py")   # this venv's own, if any
    assert _import_kernels_from_the_repository(None) == want
