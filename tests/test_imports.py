"""Imports go one way: no circle among coordinator and workers modules, no workers module imports coordinator.

Every import counts, at module level or inside a function: a lazy import
hides a circle from the interpreter until the day the order changes.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("coordinator", "workers")


def modules(root: Path, packages: tuple[str, ...]) -> dict[str, Path]:
    """Every module of `packages` under `root`, by dotted name (a package by its __init__)."""
    found = {}
    for package in packages:
        for path in sorted((root / package).rglob("*.py")):
            parts = path.relative_to(root).with_suffix("").parts
            found[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return found


def ancestors(name: str) -> list[str]:
    """The packages enclosing module `name`, innermost first: a.b.c → a.b, a."""
    parts = name.split(".")
    return [".".join(parts[:i]) for i in range(len(parts) - 1, 0, -1)]


def imported(name: str, path: Path, known: dict[str, Path]) -> Iterator[tuple[str, bool]]:
    """The modules `name` imports, each with whether it is named (True) or only implied (False).

    `import a.b` names a.b and implies a; `from a import b` names the
    submodule a.b when there is one, else a itself, and implies a.
    """
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"), str(path))):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield alias.name, True
                yield from ((a, False) for a in ancestors(alias.name))
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # relative: `from ..x import y` in a.b.c is `from a.x import y`
                parts = package.split(".")
                base = ".".join([*parts[: len(parts) - node.level + 1], *filter(None, [node.module])])
            subs = [f"{base}.{alias.name}" for alias in node.names if f"{base}.{alias.name}" in known]
            takes_names = len(subs) < len(node.names)
            yield from ((sub, True) for sub in subs)
            yield base, takes_names
            yield from ((a, False) for a in ancestors(base))


def import_graph(root: Path, packages: tuple[str, ...]) -> dict[str, set[str]]:
    """Who imports whom among the modules of `packages`.

    An implied import of a package enclosing the importer is left out: that
    package's __init__ has already begun when the importer runs, so it adds
    no edge. A name taken from it (`from pkg import name`) is an edge.
    """
    known = modules(root, packages)
    graph: dict[str, set[str]] = {}
    for name, path in known.items():
        own = set(ancestors(name))
        graph[name] = {
            target
            for target, named in imported(name, path, known)
            if target in known and target != name and (named or target not in own)
        }
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Circles covering every module caught in one, found per group that reach one another (Tarjan)."""
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
            group = {v}
            while (w := stack.pop()) != v:
                group.add(w)
            uncovered = group if len(group) > 1 else set()
            while uncovered:
                found.append(circle(graph, group, min(uncovered)))
                uncovered = uncovered - set(found[-1])

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def circle(graph: dict[str, set[str]], group: set[str], start: str) -> list[str]:
    """A shortest path start → … → start inside `group` (breadth first)."""
    parent: dict[str, str] = {}
    frontier = [start]
    while frontier:
        following = []
        for v in frontier:
            for w in sorted(graph[v] & group):
                if w == start:
                    path = [v]
                    while path[-1] != start:
                        path.append(parent[path[-1]])
                    return [*reversed(path), start]
                if w not in parent:
                    parent[w] = v
                    following.append(w)
        frontier = following
    raise AssertionError(f"no circle through {start} in {sorted(group)}")


def test_no_modules_of_coordinator_or_workers_import_each_other_in_a_circle():
    found = cycles(import_graph(ROOT, PACKAGES))
    assert found == [], "import circles:\n" + "\n".join(" → ".join(c) for c in found)


def imports_across(graph: dict[str, set[str]], importer: str, imported: str) -> list[str]:
    """Each `a imports b` with a in top-level package `importer` and b in `imported`."""
    return sorted(
        f"{name} imports {target}"
        for name, targets in graph.items()
        if name.split(".")[0] == importer
        for target in targets
        if target.split(".")[0] == imported
    )


def test_no_workers_module_imports_coordinator():
    assert imports_across(import_graph(ROOT, PACKAGES), "workers", "coordinator") == []


def test_the_graph_holds_every_module_and_each_kind_of_import():
    graph = import_graph(ROOT, PACKAGES)
    assert {"workers", "workers.models", "workers.models.transformer", "coordinator.cli.main"} <= graph.keys()
    assert "workers.models.gguf_file" in graph["workers.models.transformer"]  # from a.b.c import name
    assert "workers.fake" in graph["workers.models"]  # a module outside the importer's package
    assert "workers.models.transformer" in graph["workers.models"]  # an import inside a function


def write(root: Path, files: dict[str, str]) -> Path:
    """Lay out a source tree of `files` (path: text) under `root`."""
    for name, text in files.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text(text)
    return root


def test_a_circle_through_an_import_inside_a_function_is_found(tmp_path):
    root = write(tmp_path, {
        "pkg/__init__.py": "",
        "pkg/a.py": "from pkg.b import thing\n",
        "pkg/b.py": "def thing():\n    from pkg import a\n    return a\n",
        "pkg/c.py": "import pkg.a\n",
    })  # fmt: skip
    assert cycles(import_graph(root, ("pkg",))) == [["pkg.a", "pkg.b", "pkg.a"]]


def test_a_submodule_taking_a_name_from_its_package_init_that_imports_it_is_a_circle(tmp_path):
    root = write(tmp_path, {
        "pkg/__init__.py": "from pkg.sub.x import X\n",
        "pkg/sub/__init__.py": "",
        "pkg/sub/x.py": "from ..errors import Error\nfrom pkg import helper\nX = 1\n",
        "pkg/errors.py": "Error = ValueError\n",
    })  # fmt: skip
    graph = import_graph(root, ("pkg",))
    assert graph["pkg.sub.x"] == {"pkg.errors", "pkg"}  # relative import resolved; pkg is named
    assert cycles(graph) == [["pkg", "pkg.sub.x", "pkg"]]


def test_importing_a_sibling_submodule_is_not_a_circle_through_the_package(tmp_path):
    root = write(tmp_path, {
        "pkg/__init__.py": "from pkg.a import A\n",
        "pkg/a.py": "from pkg.b import B\nA = B\n",
        "pkg/b.py": "B = 1\n",
        "other/__init__.py": "",
        "other/user.py": "from pkg.b import B\n",
    })  # fmt: skip
    graph = import_graph(root, ("pkg", "other"))
    assert cycles(graph) == []
    assert graph["other.user"] == {"pkg.b", "pkg"}  # importing pkg.b runs pkg/__init__ first


def test_a_package_importing_a_module_that_imports_back_into_it_is_a_circle(tmp_path):
    root = write(tmp_path, {
        "pkg/__init__.py": "",
        "pkg/models/__init__.py": "from pkg import fake\n",
        "pkg/models/spec.py": "",
        "pkg/fake.py": "from pkg.models.spec import parse\n",
    })  # fmt: skip
    assert cycles(import_graph(root, ("pkg",))) == [["pkg.fake", "pkg.models", "pkg.fake"]]


def test_a_lower_package_importing_a_higher_one_is_found_even_inside_a_function(tmp_path):
    root = write(tmp_path, {
        "low/__init__.py": "",
        "low/part.py": "def use():\n    from high.top import thing\n    return thing\n",
        "high/__init__.py": "",
        "high/top.py": "from low.part import use\nthing = use\n",
    })  # fmt: skip
    graph = import_graph(root, ("low", "high"))
    assert imports_across(graph, "low", "high") == ["low.part imports high", "low.part imports high.top"]
    assert imports_across(graph, "high", "low") == ["high.top imports low", "high.top imports low.part"]


# The coordinator's wings, lowest first: a module may import its own wing and those below it, never one
# above. Ground holds the run record, the bus, the errors and the units every wing shares; the cluster
# owns one lifetime of everything below it; the API and the CLI are faces over the cluster.
WINGS = (
    (
        "ground",
        ("coordinator", "coordinator.stats", "coordinator.events", "coordinator.errors", "coordinator.units"),
    ),
    ("store", ("coordinator.store",)),
    ("launch", ("coordinator.launch",)),
    ("plan", ("coordinator.plan",)),
    ("stages", ("coordinator.stages",)),
    ("runs", ("coordinator.runs",)),
    ("cluster", ("coordinator.cluster",)),
    ("api", ("coordinator.api",)),
    ("cli", ("coordinator.cli", "coordinator.__main__")),
    ("testing", ("coordinator.testing",)),
)


def wing_of(name: str) -> int | None:
    """The height of the wing module `name` belongs to (its longest matching prefix), None outside them."""
    best: tuple[int, int] | None = None
    for height, (_, prefixes) in enumerate(WINGS):
        for prefix in prefixes:
            if (name == prefix or name.startswith(prefix + ".")) and (best is None or len(prefix) > best[1]):
                best = (height, len(prefix))
    return None if best is None else best[0]


def upward_imports(graph: dict[str, set[str]]) -> list[str]:
    """Each import from a lower wing into a higher one."""
    return sorted(
        f"{name} ({WINGS[low][0]}) imports {target} ({WINGS[high][0]})"
        for name, targets in graph.items()
        if (low := wing_of(name)) is not None
        for target in targets
        if (high := wing_of(target)) is not None and high > low
    )


def test_every_coordinator_module_belongs_to_a_wing():
    graph = import_graph(ROOT, PACKAGES)
    assert [name for name in graph if name.startswith("coordinator") and wing_of(name) is None] == []


def test_no_coordinator_wing_imports_a_wing_above_it():
    assert upward_imports(import_graph(ROOT, PACKAGES)) == []


def test_an_upward_import_between_wings_is_found(tmp_path):
    root = write(tmp_path, {
        "coordinator/__init__.py": "",
        "coordinator/launch/__init__.py": "",
        "coordinator/launch/ray.py": "def f():\n    from coordinator.plan.split import size_text\n",
        "coordinator/plan/__init__.py": "",
        "coordinator/plan/split.py": "from coordinator.launch import ray\n",
    })  # fmt: skip
    assert upward_imports(import_graph(root, ("coordinator",))) == [
        "coordinator.launch.ray (launch) imports coordinator.plan (plan)",
        "coordinator.launch.ray (launch) imports coordinator.plan.split (plan)",
    ]


# What a face of the HTTP API may import from the coordinator besides its own wing: the cluster's narrow
# face, ground and the request shapes; never the parts the cluster runs (stages, launch, plan, store, runs).
API_MAY_IMPORT = (*WINGS[0][1], "coordinator.cluster", "coordinator.runs.requests")


def api_reaching_past_the_cluster(graph: dict[str, set[str]]) -> list[str]:
    """Each import by an api module of a coordinator module neither in API_MAY_IMPORT nor in the api."""
    # A package enclosing an allowed module (coordinator.runs for coordinator.runs.requests) runs when
    # that module is imported: no reach of its own. A name taken from one of its other modules is.
    allowed = {*API_MAY_IMPORT, *(a for module in API_MAY_IMPORT for a in ancestors(module))}

    def in_api(name: str) -> bool:
        return name == "coordinator.api" or name.startswith("coordinator.api.")

    return sorted(
        f"{name} imports {target}"
        for name, targets in graph.items()
        if in_api(name)
        for target in targets
        if target.split(".")[0] == "coordinator" and target not in allowed and not in_api(target)
    )


def test_api_modules_import_only_the_cluster_ground_the_request_shapes_and_the_api():
    assert api_reaching_past_the_cluster(import_graph(ROOT, PACKAGES)) == []


def test_an_api_module_reaching_past_the_cluster_is_found(tmp_path):
    root = write(tmp_path, {
        "coordinator/__init__.py": "",
        "coordinator/stats.py": "",
        "coordinator/cluster.py": "",
        "coordinator/runs/__init__.py": "",
        "coordinator/runs/requests.py": "",
        "coordinator/runs/runner.py": "",
        "coordinator/stages/__init__.py": "",
        "coordinator/stages/node.py": "",
        "coordinator/store/__init__.py": "",
        "coordinator/store/history.py": "",
        "coordinator/api/__init__.py": "",
        "coordinator/api/common.py": "",
        "coordinator/api/fine.py": (
            "from coordinator.api.common import x\nfrom coordinator.cluster import Cluster\n"
            "from coordinator.runs.requests import RunRequest\nfrom coordinator.stats import ClusterRun\n"
            "from workers.protocol.report import NodeReport\n"
        ),
        "coordinator/api/reaches.py": (
            "from coordinator.runs.runner import RunFinishedError\nfrom coordinator.stages import node\n"
            "def f():\n    from coordinator.store.history import StoreError\n"
        ),
    })  # fmt: skip
    assert api_reaching_past_the_cluster(import_graph(root, ("coordinator",))) == [
        "coordinator.api.reaches imports coordinator.runs.runner",
        "coordinator.api.reaches imports coordinator.stages",
        "coordinator.api.reaches imports coordinator.stages.node",
        "coordinator.api.reaches imports coordinator.store",
        "coordinator.api.reaches imports coordinator.store.history",
    ]
