"""The package's layers only look down: no import cycle between modules, the
kernels' bindings (_native) import nothing from the layers above them, and
the file readers (io.model_file, io.hf) leave telling files apart to io.load.
Read from the sources with ast, imports inside functions included."""
import ast
from pathlib import Path

import llmc_py

ROOT = Path(llmc_py.__file__).parent
ABOVE_NATIVE = ("io", "model", "generate", "train", "data", "monitors")


def _module_name(path):
    parts = ("llmc_py",) + path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def import_graph():
    """{module: the llmc_py modules it imports} (a name imported from a package
    counts as the package unless it is one of its modules)."""
    paths = {_module_name(p): p for p in ROOT.rglob("*.py")}
    graph = {}
    for name, path in paths.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        targets = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                targets.update(a.name for a in node.names)
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    up = package.split(".")[:len(package.split(".")) - node.level + 1]
                    base = ".".join(up + ([base] if base else []))
                targets.update(f"{base}.{a.name}" if f"{base}.{a.name}" in paths else base
                               for a in node.names)
        graph[name] = {t for t in targets if t in paths and t != name}
    return graph


def cycles(graph):
    """The import cycles: groups of two or more modules that reach each other."""
    reach = {m: set() for m in graph}
    for start in graph:
        todo = list(graph[start])
        while todo:
            m = todo.pop()
            if m not in reach[start]:
                reach[start].add(m)
                todo.extend(graph[m])
    groups = {frozenset({m} | {n for n in reach[m] if m in reach[n]}) for m in graph}
    return sorted(sorted(g) for g in groups if len(g) > 1)


def test_no_import_cycle():
    assert cycles(import_graph()) == []


def test_the_kernel_bindings_import_nothing_from_above():
    upper = tuple(f"llmc_py.{p}" for p in ABOVE_NATIVE)
    wrong = {m: sorted(t for t in targets if t.startswith(upper))
             for m, targets in import_graph().items() if m.startswith("llmc_py._native")}
    assert {m: t for m, t in wrong.items() if t} == {}


def test_the_model_file_readers_do_not_import_each_other():
    graph = import_graph()
    readers = {"llmc_py.io.model_file", "llmc_py.io.hf"}
    for reader in readers:
        assert not graph[reader] & (readers | {"llmc_py.io.load", "llmc_py.io"}), reader


def test_the_model_imports_nothing_from_training_or_generation():
    upper = ("llmc_py.train", "llmc_py.generate")
    wrong = {m: sorted(t for t in targets if t.startswith(upper))
             for m, targets in import_graph().items() if m.startswith("llmc_py.model")}
    assert {m: t for m, t in wrong.items() if t} == {}
