"""The project's modules import one another in one direction: no module reaches itself through its imports.

Every import counts, also those inside functions (a lazy import still ties the two modules together). Module names
come from the package folder endo_retrieval/ and, for each ecosystem distribution
under integrations/, from its folder (integrations/langchain-endo/langchain_endo is langchain_endo). `from pkg import
name` points at pkg.name when that is a module of ours, else at pkg.
"""
from __future__ import annotations

import ast
import tomllib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
UNSAFE_LOADS = ("weights_only=" + "False", "allow_pickle=" + "True")  # split, so this file does not match itself


def project_modules() -> dict[str, Path]:
    """module name -> file, for every .py under the package folders pyproject.toml maps."""
    tool = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    roots = [(ROOT / folder, package.split(".")) for package, folder in
             {"endo_retrieval": "endo_retrieval", **tool.get("package-dir", {})}.items()]
    roots += [(dist, []) for dist in [*(ROOT / "integrations").iterdir(), ROOT / "bench"]
              if (dist / "pyproject.toml").exists()]
    modules = {}
    for folder, package in roots:
        for path in folder.rglob("*.py"):
            parts = path.relative_to(folder).with_suffix("").parts
            if not package and len(parts) == 1:  # a distribution's own scripts (smoke.py) are no modules
                continue
            name = ".".join((*package, *parts[:-1], *(() if parts[-1] == "__init__" else parts[-1:])))
            modules[name] = path
    return modules


def imports_of(name: str, path: Path, modules: dict[str, Path]) -> set[str]:
    """The project modules that `name` (at `path`) imports anywhere in its body."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(anchor + ([base] if base else []))
            targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in modules else base for a in node.names]
        else:
            continue
        found |= {t for t in targets if t in modules and t != name}
    return found


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One cycle of the directed graph as [a, b, ..., a], or None (depth-first search, colours white/grey/black)."""
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        stack.append(node)
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                return stack[stack.index(nxt):] + [nxt]
            if nxt not in state and (cycle := visit(nxt)):
                return cycle
        stack.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state and (cycle := visit(node)):
            return cycle
    return None


def test_the_walker_sees_every_package_and_lazy_imports():
    modules = project_modules()
    files = {p.resolve() for p in modules.values()}
    assert [p for d in ("endo_retrieval", "integrations", "bench") for p in (ROOT / d).rglob("*.py")
            if p.resolve() not in files and p.name != "smoke.py"] == []  # every module of the three folders is walked
    for name in ("endo_retrieval.model.backbone", "endo_retrieval.attention.base", "endo_bench.runner",
                 "endo_retrieval.kernels.sae_topk", "llama_index.retrievers.endo", "llama_index.retrievers.endo.base",
                 "endo_retrieval.integrations", "langchain_endo.retrievers"):
        assert name in modules
    # `endo prepare` imports the calibration commands inside a function
    prepare = "endo_retrieval.cli.prepare"
    assert "endo_retrieval.cli.calibrate" in imports_of(prepare, modules[prepare], modules)


def test_the_library_and_the_adapters_import_nothing_from_the_bench():
    """The bench (bench/, `endo_bench`) measures the library from outside, as kvpress keeps its evaluation apart:
    no module the wheels ship imports it, not even lazily."""
    modules = project_modules()
    shipped = {name: path for name, path in modules.items() if not name.startswith("endo_bench")}
    assert any(n.startswith("endo_bench") for n in modules) and "llama_index.retrievers.endo" in shipped
    reaching = {name: sorted(m for m in imports_of(name, path, modules) if m.startswith("endo_bench"))
                for name, path in shipped.items()}
    assert {name: found for name, found in reaching.items() if found} == {}


def test_find_cycle_finds_one():
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": {"c"}, "d": {"a", "c"}}) is None


def test_no_import_cycles():
    modules = project_modules()
    graph = {name: imports_of(name, path, modules) for name, path in modules.items()}
    cycle = find_cycle(graph)
    assert cycle is None, "import cycle: " + " -> ".join(cycle or [])


@pytest.mark.parametrize("pattern", UNSAFE_LOADS, ids=["torch.load", "np.load"])
def test_no_file_is_loaded_with_pickle(pattern):
    """torch.load and np.load may unpickle, which runs code; everything the project reads is tensors or arrays."""
    hits = [str(p.relative_to(ROOT)) for p in ROOT.rglob("*.py")
            if ".venv" not in p.parts and pattern in p.read_text()]
    assert hits == []


# endo_retrieval's subpackages and top modules, bottom to top; a module imports only from its own layer or below.
# "" is the package's own __init__ (the public names, imported lazily from the layers below it).
LAYERS = [
    {"core", "files", "array_file", "corpus", "corpus_columns", "sentences", "threads"},  # shared types, safe files
    {"kernels"},
    {"scoring"},
    {"model"},
    {"attention"},
    {"index"},
    {"methods"},
    {"", "integrations", "distributed", "distributed_pipeline"},
    {"calibration"},
    {"cli"},
]
LAZY_CEILING = 15  # imports of the package's own modules inside functions, each saying why (torch off the CLI's path)


def layer_of(module: str) -> int:
    unit = module.split(".")[1] if "." in module else ""
    return next(i for i, layer in enumerate(LAYERS) if unit in layer)


def arrows_up() -> set[tuple[str, str, str]]:
    """(importer, imported) for every import of the package that points to a higher layer."""
    modules = project_modules()
    found = set()
    for name, path in modules.items():
        if name.split(".")[0] != "endo_retrieval":
            continue
        for target in imports_of(name, path, modules):
            if target.startswith("endo_retrieval") and layer_of(target) > layer_of(name):
                found.add((name, target))
    return found


def test_every_unit_of_the_package_has_a_layer():
    units = {n.split(".")[1] if "." in n else "" for n in project_modules() if n.split(".")[0] == "endo_retrieval"}
    assert units == set().union(*LAYERS)


def test_imports_point_down_the_layers():
    unit = lambda module: module.split(".")[1] if "." in module else ""  # noqa: E731
    up = {(unit(a), unit(b)) for a, b in arrows_up()}
    assert up == set(), sorted(arrows_up())


def lazy_imports() -> list[tuple[str, int, str]]:
    """(file, line, statement) for every import of the package's own modules made inside a function."""
    found = []
    for name, path in project_modules().items():
        if name.split(".")[0] != "endo_retrieval":
            continue
        for func in ast.walk(ast.parse(path.read_text())):
            if isinstance(func, (ast.FunctionDef, ast.AsyncFunctionDef)):
                for node in ast.walk(func):
                    if isinstance(node, ast.ImportFrom) and (node.level or (node.module or "").startswith("endo_")) \
                            or isinstance(node, ast.Import) and any(a.name.startswith("endo_") for a in node.names):
                        found.append((str(path.relative_to(ROOT)), node.lineno, ast.unparse(node)))
    return sorted(set(found))


def test_few_imports_inside_functions():
    assert 0 < len(lazy_imports()) <= LAZY_CEILING, len(lazy_imports())


def test_the_layer_check_sees_an_arrow_up():
    assert layer_of("endo_retrieval.index.engine") > layer_of("endo_retrieval.model.sae")
    assert layer_of("endo_retrieval.core") == 0 and layer_of("endo_retrieval") < layer_of("endo_retrieval.cli")
