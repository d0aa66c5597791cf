"""Each layer imports only the layers below it (docs/design.md, "Layers"); the services never import each other."""

from __future__ import annotations

import ast
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent

# Bottom to top; modules of one rank may import each other (rpc and observability sit side by side).
RANKS: dict[str, int] = {
    "minedraft": 0,  # the package itself, its generated protos, errors and demo models
    "minedraft.proto": 0,
    "minedraft.errors": 0,
    "minedraft.flag_spec": 0,  # what a flag is: the options of layers above declare theirs with it
    "minedraft.kernels": 1,
    "minedraft.engine": 2,
    "minedraft.channels": 3,
    "minedraft.observability": 4,
    "minedraft.rpc": 4,
    "target_service": 5,
    "draft_service": 5,
    "coordinator": 5,
    "minedraft_app": 6,
}
SERVICES = ("target_service", "draft_service", "coordinator")
PACKAGES = ("minedraft", *SERVICES, "minedraft_app")


def layer_of(module: str) -> str:
    """The longest entry of RANKS that `module` is or lies inside."""
    parts = module.split(".")
    for n in range(len(parts), 0, -1):
        if ".".join(parts[:n]) in RANKS:
            return ".".join(parts[:n])
    raise AssertionError(f"{module} is in no layer: add it to RANKS")


def module_name(path: Path) -> str:
    parts = path.relative_to(REPO).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imported_modules(path: Path) -> list[tuple[int, str]]:
    """(line, module) of every import of our packages in `path`, also inside functions and TYPE_CHECKING blocks."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            # `from minedraft.engine import sampling` imports minedraft.engine.sampling
            found += [(node.lineno, f"{node.module}.{alias.name}") for alias in node.names]
    return [(line, name) for line, name in found if name.split(".")[0] in PACKAGES]


def production_modules() -> list[Path]:
    paths = [p for package in PACKAGES for p in (REPO / package).rglob("*.py")]
    return sorted(p for p in paths if "proto" not in p.relative_to(REPO).parts[:2])


def test_no_module_imports_a_layer_above_it() -> None:
    upward = []
    for path in production_modules():
        own = layer_of(module_name(path))
        for line, name in imported_modules(path):
            other = layer_of(name)
            if RANKS[other] > RANKS[own] or (own in SERVICES and other in SERVICES and other != own):
                upward.append(f"{path.relative_to(REPO)}:{line} ({own}) imports {name} ({other})")
    assert not upward, "imports of a layer above, or of another service:\n" + "\n".join(upward)


def test_every_module_has_a_layer() -> None:
    for path in production_modules():
        layer_of(module_name(path))


def test_the_check_sees_an_upward_import(tmp_path: Path) -> None:
    module = tmp_path / "m.py"
    module.write_text("from coordinator.main import serve\nimport minedraft.engine.sampling\n", encoding="utf-8")
    names = [name for _, name in imported_modules(module)]
    assert names == ["coordinator.main.serve", "minedraft.engine.sampling"]
    assert RANKS[layer_of(names[0])] > RANKS[layer_of("minedraft.engine.kv_cache")]


def import_graph() -> dict[str, set[str]]:
    """Module -> the project modules it imports (a `from package import name` counts as the module `name` where it
    is one, else as `package`), imports inside functions and TYPE_CHECKING blocks included."""
    paths = {module_name(p): p for p in production_modules()}
    graph: dict[str, set[str]] = {}
    for module, path in paths.items():
        targets = set()
        for _, name in imported_modules(path):
            while name and name not in paths:
                name = name.rpartition(".")[0]
            if name and name != module:
                targets.add(name)
        graph[module] = targets
    return graph


def import_circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected groups of more than one module (Tarjan's algorithm)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    circles: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for other in graph.get(node, ()):
            if other not in index:
                visit(other)
                low[node] = min(low[node], low[other])
            elif other in on_stack:
                low[node] = min(low[node], index[other])
        if low[node] == index[node]:
            group = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                group.append(member)
                if member == node:
                    break
            if len(group) > 1:
                circles.append(sorted(group))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return circles


def test_no_import_circle() -> None:
    circles = import_circles(import_graph())
    assert not circles, "import circles:\n" + "\n".join(" <-> ".join(c) for c in circles)


def test_the_check_sees_a_circle() -> None:
    assert import_circles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert import_circles({"a": {"b"}, "b": set()}) == []


MAX_FILE_LINES, MAX_CLASS_LINES = 700, 300  # the project's rule for product code (generated protos aside)


def test_no_product_file_or_class_too_long() -> None:
    """Product modules stay readable: none over MAX_FILE_LINES lines, no class over MAX_CLASS_LINES."""
    long = []
    for package in PACKAGES:
        for path in sorted((REPO / package).rglob("*.py")):
            if "proto" in path.relative_to(REPO).parts:
                continue
            source = path.read_text()
            if source.count("\n") > MAX_FILE_LINES:
                long.append(f"{path.relative_to(REPO)}: {source.count(chr(10))} lines")
            for node in ast.walk(ast.parse(source)):
                lines = (node.end_lineno or node.lineno) - node.lineno + 1 if isinstance(node, ast.ClassDef) else 0
                if lines > MAX_CLASS_LINES:
                    long.append(f"{path.relative_to(REPO)}: class {getattr(node, 'name', '?')}, {lines} lines")
    assert not long, long
