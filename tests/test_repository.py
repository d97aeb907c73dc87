"""The repository's promises: README commands, CI, installed namespaces."""

import ast
import pathlib
import re
import runpy

ROOT = pathlib.Path(__file__).resolve().parents[1]


def readme_commands():
    return re.findall(r"```sh\n(.+?)\n```", (ROOT / "README.md").read_text())


MAIN_JOB = 'python -m pip install -e ".[data]" && hftatf-train'
TESTS = ('python -m pip install -e ".[dev]" && '
         "python -m pytest -n auto --maxprocesses 4 --dist loadgroup "
         '-m "not full_scale" && '
         "KERAS_BACKEND=jax python -m pytest -n auto --maxprocesses 4 "
         '--dist loadgroup -m "not slow and not full_scale"')


def test_readme_has_the_two_setup_commands():
    assert readme_commands() == [MAIN_JOB, TESTS]


def test_ci_runs_the_readme_test_command_exactly():
    lines = (ROOT / ".ci" / "run").read_text().splitlines()
    assert readme_commands()[1] in lines


def test_zoo_and_launchers_install_under_the_hftatf_namespace():
    import hftatf.models.mlp
    import hftatf.tpu.train

    assert pathlib.Path(hftatf.models.mlp.__file__).parent.name == "models"
    assert pathlib.Path(hftatf.tpu.train.__file__).parent.name == "tpu"


def setup_arguments(monkeypatch):
    """The keyword arguments setup.py passes to `setuptools.setup`."""
    import setuptools

    received = {}
    monkeypatch.setattr(setuptools, "setup", lambda **kw: received.update(kw))
    runpy.run_path(str(ROOT / "setup.py"))
    return received


def test_setup_installs_every_package(monkeypatch):
    listed = set(setup_arguments(monkeypatch)["packages"])
    found = {".".join(p.parent.relative_to(ROOT).parts)
             for p in (ROOT / "hftatf").rglob("__init__.py")}
    found |= {"hftatf." + p.parent.name
              for p in (ROOT / "models").glob("__init__.py")}
    found |= {"hftatf." + p.parent.name
              for p in (ROOT / "tpu").glob("__init__.py")}
    assert found <= listed, found - listed


def test_test_modules_have_unique_names():
    # pytest imports test files by module name (tests/ has no packages).
    names = [p.name for p in (ROOT / "tests").rglob("*.py")]
    assert sorted(set(names)) == sorted(names), sorted(
        n for n in set(names) if names.count(n) > 1)


def test_submodules_the_readme_uses_are_attributes_of_hftatf():
    # The README writes hftatf.backup.BackupAndRestore(...),
    # hftatf.distribute.strategy_from_name(...), hftatf.tuning.* after a
    # plain `import hftatf`.
    import hftatf

    for name in ("backup", "callbacks", "distribute", "export", "layers",
                 "optimizers", "passes", "seeds", "models", "tpu"):
        assert getattr(hftatf, name).__name__ == f"hftatf.{name}", name
    for used in re.findall(r"`hftatf\.([a-z_]+)\.",
                           (ROOT / "README.md").read_text()):
        assert hasattr(hftatf, used), used


# -- Layering: imports point down, files are read in one sitting ------------

MAX_LIBRARY_LINES = 600


def library_sources():
    """`{module name: path}` of every module of hftatf, the zoo and the
    launchers included under the names they install as (`hftatf.models`,
    `hftatf.tpu`); a package's `__init__` is the package's module."""
    roots = {"hftatf": ROOT / "hftatf", "hftatf.models": ROOT / "models",
             "hftatf.tpu": ROOT / "tpu"}
    sources = {}
    for prefix, top in roots.items():
        for path in sorted(top.rglob("*.py")):
            parts = path.relative_to(top).with_suffix("").parts
            # hftatf/models and hftatf/tpu link to the top-level folders,
            # which have their own root above.
            if prefix == "hftatf" and parts[0] in ("models", "tpu"):
                continue
            if parts[-1] == "__init__":
                parts = parts[:-1]
            sources[".".join((prefix, *parts))] = path
    return sources


def is_package(module, sources):
    return sources[module].name == "__init__.py"


def hftatf_imports(module, sources):
    """`(line, imported module, inside a function)` for every import of an
    hftatf module in `module`'s source. `from hftatf.x import y` imports
    the module `hftatf.x.y` where that is a module, else `hftatf.x`."""
    path = sources[module]
    tree = ast.parse(path.read_text(), str(path))
    package = module if is_package(module, sources) else (
        module.rpartition(".")[0])
    found = []

    def visit(node, in_function):
        for child in ast.iter_child_nodes(node):
            nested = in_function or isinstance(
                child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda))
            if isinstance(child, ast.Import):
                found.extend((child.lineno, alias.name, in_function)
                             for alias in child.names
                             if alias.name.split(".")[0] == "hftatf")
            elif isinstance(child, ast.ImportFrom):
                base = child.module or ""
                if child.level:
                    anchor = package.split(".")
                    anchor = anchor[:len(anchor) - child.level + 1]
                    base = ".".join(anchor + ([base] if base else []))
                if base.split(".")[0] == "hftatf":
                    for alias in child.names:
                        sub = f"{base}.{alias.name}"
                        found.append((child.lineno,
                                      sub if sub in sources else base,
                                      in_function))
            visit(child, nested)

    visit(tree, False)
    return found


def import_graph(sources):
    """`{module: {imported module: first line}}` over hftatf's modules,
    imports at module level and inside functions alike."""
    graph = {module: {} for module in sources}
    for module in sources:
        for line, target, _ in hftatf_imports(module, sources):
            # `import hftatf.x.y` names a module; a name that is not one
            # (an attribute reached through a package) belongs to the
            # closest module above it.
            while target not in sources and "." in target:
                target = target.rpartition(".")[0]
            if target != module and target in sources:
                graph[module].setdefault(target, line)
    return graph


def strongly_connected(graph):
    """The strongly connected components of `graph` with more than one
    module (Tarjan's algorithm, iterative)."""
    index, low, on_stack, stack, components = {}, {}, set(), [], []
    for start in sorted(graph):
        if start in index:
            continue
        work = [(start, iter(sorted(graph[start])))]
        index[start] = low[start] = len(index)
        stack.append(start)
        on_stack.add(start)
        while work:
            node, successors = work[-1]
            advanced = False
            for succ in successors:
                if succ not in index:
                    index[succ] = low[succ] = len(index)
                    stack.append(succ)
                    on_stack.add(succ)
                    work.append((succ, iter(sorted(graph[succ]))))
                    advanced = True
                    break
                if succ in on_stack:
                    low[node] = min(low[node], index[succ])
            if advanced:
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = set()
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.add(member)
                    if member == node:
                        break
                if len(component) > 1:
                    components.append(component)
    return components


def shortest_path(graph, start, goal, within):
    """The shortest import path from `start` to `goal` inside `within`."""
    previous, frontier = {start: None}, [start]
    while frontier and goal not in previous:
        following = []
        for node in frontier:
            for succ in sorted(graph[node]):
                if succ in within and succ not in previous:
                    previous[succ] = node
                    following.append(succ)
        frontier = following
    path, node = [], goal
    while node is not None:
        path.append(node)
        node = previous[node]
    return path[::-1]


def import_cycles(graph):
    """The import cycles of `graph`: for every import that closes a cycle,
    the shortest cycle through it, each cycle once (started at its
    smallest module)."""
    cycles = set()
    for component in strongly_connected(graph):
        for module in component:
            for target in graph[module]:
                if target in component:
                    cycle = [module] + shortest_path(
                        graph, target, module, component)[:-1]
                    first = cycle.index(min(cycle))
                    cycles.add(tuple(cycle[first:] + cycle[:first]))
    return sorted(cycles, key=lambda c: (len(c), c))


def describe_cycle(cycle, graph, sources):
    steps = [f"{a} ({sources[a].relative_to(ROOT)}:{graph[a][b]})"
             for a, b in zip(cycle, cycle[1:] + cycle[:1])]
    return " -> ".join(steps + [cycle[0]])


def test_import_cycles_names_every_import_that_closes_one():
    graph = {"a": {"b": 1}, "b": {"c": 2, "d": 3}, "c": {"a": 4},
             "d": {"b": 5}, "e": {"a": 6}}
    assert strongly_connected(graph) == [{"a", "b", "c", "d"}]
    assert import_cycles(graph) == [("b", "d"), ("a", "b", "c")]


def test_the_import_graph_has_no_cycle():
    sources = library_sources()
    graph = import_graph(sources)
    components = strongly_connected(graph)
    cycles = import_cycles(graph)
    report = [f"{len(components)} group(s) of modules import each other "
              f"in a circle, {len(cycles)} cycle(s):"]
    report += ["  group: " + ", ".join(sorted(c)) for c in components]
    report += ["  " + describe_cycle(c, graph, sources) for c in cycles]
    assert not cycles, "\n".join(report)


def test_library_files_are_read_in_one_sitting():
    too_long = sorted(
        (len(path.read_text().splitlines()), str(path.relative_to(ROOT)))
        for path in (ROOT / "hftatf").rglob("*.py")
        if path.relative_to(ROOT / "hftatf").parts[0] not in (
            "models", "tpu"))
    too_long = [(n, p) for n, p in too_long if n > MAX_LIBRARY_LINES]
    assert not too_long, (
        f"{len(too_long)} file(s) of hftatf/ over {MAX_LIBRARY_LINES} "
        "lines:\n" + "\n".join(f"  {p}: {n}" for n, p in too_long[::-1]))


def test_no_hftatf_import_inside_a_function():
    # Imports point down the layers, so none needs hiding in a function;
    # optional third-party packages may still be imported on use.
    sources = library_sources()
    inside = [f"  {sources[m].relative_to(ROOT)}:{line}: {target}"
              for m in sorted(sources)
              for line, target, in_function in hftatf_imports(m, sources)
              if in_function]
    assert not inside, (f"{len(inside)} import(s) of hftatf inside a "
                        "function:\n" + "\n".join(inside))
