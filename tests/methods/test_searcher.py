"""One `Searcher` protocol (methods/searcher.py): every class of the package and of the adapters' distributions with a
`search` method implements it, signature and return type, found by reading the sources (so a new class with a
drifted `search` fails here, Ray or not); the index, the Ray pool and the shards implement the rest of it too."""
from __future__ import annotations

import ast
import inspect
from pathlib import Path

import pytest

from endo_retrieval.distributed import ShardedIndex
from endo_retrieval.distributed_pipeline import Reader, ReaderPool
from endo_retrieval.methods.search import EndoIndex
from endo_retrieval.methods.searcher import Searcher, best_spans, check_search_k

ROOT = Path(__file__).resolve().parents[2]
PROTOCOL = ROOT / "endo_retrieval" / "methods" / "searcher.py"


def signature_of(func: ast.FunctionDef) -> tuple:
    """A method's parameters (name, kind, annotation, default) and return annotation, as written."""
    args = func.args
    positional = args.posonlyargs + args.args
    defaults = [None] * (len(positional) - len(args.defaults)) + list(args.defaults)
    text = lambda node: None if node is None else ast.unparse(node)  # noqa: E731
    params = [(a.arg, "positional", text(a.annotation), text(d)) for a, d in zip(positional, defaults)]
    params += [(a.arg, "keyword", text(a.annotation), text(d)) for a, d in zip(args.kwonlyargs, args.kw_defaults)]
    return tuple(params), text(args.vararg and args.vararg.annotation), text(args.kwarg and args.kwarg.annotation), \
        text(func.returns)


def searches(path: Path) -> dict[str, ast.FunctionDef]:
    """class name -> its `search` method, for every class of the file that defines one."""
    tree = ast.parse(path.read_text(), str(path))
    return {node.name: item for node in ast.walk(tree) if isinstance(node, ast.ClassDef)
            for item in node.body if isinstance(item, ast.FunctionDef) and item.name == "search"}


def protocol_search() -> tuple:
    return signature_of(searches(PROTOCOL)["Searcher"])


def drifted(source: str) -> list[str]:
    """The classes in `source` whose `search` is not the protocol's."""
    tree = ast.parse(source)
    return [node.name for node in ast.walk(tree) if isinstance(node, ast.ClassDef) for item in node.body
            if isinstance(item, ast.FunctionDef) and item.name == "search" and signature_of(item) != protocol_search()]


def package_files() -> list[Path]:
    files = list((ROOT / "endo_retrieval").rglob("*.py"))
    files += [p for dist in (ROOT / "integrations").iterdir() if (dist / "pyproject.toml").exists()
              for p in dist.rglob("*.py")]
    return [p for p in files if "__pycache__" not in p.parts and p != PROTOCOL]


def test_every_search_method_is_the_searcher_protocols():
    found, wrong = [], []
    for path in package_files():
        for name, func in searches(path).items():
            key = f"{path.relative_to(ROOT)}::{name}"
            found.append(key)
            if signature_of(func) != protocol_search():
                wrong.append(f"{key}: ({ast.unparse(func.args)}) -> {func.returns and ast.unparse(func.returns)}")
    assert wrong == []
    for cls in (EndoIndex, ReaderPool, ShardedIndex, Reader):  # users' searchers, and the pool's readers
        assert any(key.endswith(f"::{cls.__name__}") for key in found), cls


def test_the_check_catches_a_drifted_search():
    """The source-reading check fails a `search` whose options moved, lost a default or returns something else."""
    same = ("class A:\n    def search(self, question: str, k: int = 4, budget: int | None = None, method: str | None = "
            "None,\n               where: Callable[[dict], bool] | None = None, depth: int | None = None,\n"
            "               read_tokens: int | None = None, first_stage: str | None = None) -> list[Span]:\n"
            "        ...\n")
    assert drifted(same) == []
    assert drifted(same.replace("k: int = 4", "k: int")) == ["A"]
    assert drifted(same.replace(", first_stage: str | None = None", "")) == ["A"]
    assert drifted(same.replace("-> list[Span]", "-> list")) == ["A"]
    assert drifted(same.replace("method: str | None = None,\n               where", "where")
                   .replace("depth:", "method: str | None = None, depth:")) == ["A"]


@pytest.mark.parametrize("cls", [EndoIndex, ReaderPool, ShardedIndex])
def test_the_index_the_pool_and_the_shards_implement_the_whole_protocol(cls):
    """Beside `search`: `method`, `methods`, `check_method` and `pipeline`, whose options are the same."""
    for name in ("check_method", "pipeline"):
        want = inspect.signature(getattr(Searcher, name))
        got = inspect.signature(getattr(cls, name))
        assert list(got.parameters) == list(want.parameters), (cls, name)
        assert [p.default for p in got.parameters.values()] == [p.default for p in want.parameters.values()]
    assert isinstance(inspect.getattr_static(cls, "methods"), property)
    assert "method" in inspect.getsource(cls.__init__) or hasattr(cls, "method")
    assert inspect.signature(cls.search).return_annotation in ("list[Span]",)


def test_the_ranking_tail_of_the_span_methods():
    from endo_retrieval.core import Span

    spans = [Span(i, i + 1, 0, 1, "t", s, ("bm25",), f"d{i}", {"n": i}) for i, s in enumerate([0.2, 0.9, 0.5, 0.9])]
    assert [s.doc_id for s in best_spans(spans, 3)] == ["d1", "d3", "d2"]  # best first, ties in source order
    assert [s.doc_id for s in best_spans(spans, 3, lambda m: m["n"] != 1)] == ["d3", "d2", "d0"]
    assert check_search_k(2) == 2
    for bad in (0, True, 1.5, "3"):
        with pytest.raises(ValueError, match="k must be a whole number"):
            check_search_k(bad)
