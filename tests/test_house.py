"""House rules over the whole tree, read with ``ast`` only (nothing of the project is imported):

1. the imports among the project's own modules (prepack, loader, schemas) form no cycle (imports
   inside functions count; those under ``if TYPE_CHECKING:`` do not, since they never run);
2. no function in ``prepack/`` takes more than 6 parameters;
3. ``prepack/`` imports the project's own modules inside functions at most 22 times, and each such
   import says why in a comment (on its line or the line just above).

That ``loader/`` imports none of prepack, ray, PIL, transformers is checked in
tests/loader/test_nemo.py.  The checkers take a root directory, so the unit tests at the bottom
run them on tiny synthetic trees written to tmp_path: each rule is seen to fail and to pass.
"""

from __future__ import annotations

import ast
import functools
import io
import textwrap
import tokenize
from pathlib import Path

from tests.helpers.paths import REPO

OWN = ("prepack", "loader", "schemas")  # the project's top-level packages
MAX_PARAMETERS = 6  # per function in prepack/; self/cls not counted, *args and **kwargs one each
# imports of OWN modules inside functions in prepack/: 22 since `prepack latents` and prepack/run's
# rooms (each subcommand's handler imports its tool when it runs, so that `prepack --help` stays quick;
# `restore` takes its tool from two rooms: the bounded pack's and the latents')
MAX_INNER_IMPORTS = 22


# ---------------------------------------------------------------------------------------------
# reading the tree


def modules(root: str | Path, packages=OWN) -> dict[str, Path]:
    """Dotted module name -> file, for every .py under root/<package> (a package is its __init__)."""
    root = Path(root)
    found = {}
    for package in packages:
        for path in sorted((root / package).rglob("*.py")):
            parts = list(path.relative_to(root).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            found[".".join(parts)] = path
    return found


@functools.lru_cache(maxsize=None)
def _read(path: str, mtime_ns: int, size: int) -> tuple[str, ast.Module]:
    """A file's text and tree, read once per version of the file (the rules share them)."""
    source = Path(path).read_text(encoding="utf-8")
    return source, ast.parse(source, filename=path)


def _source_and_tree(path: Path) -> tuple[str, ast.Module]:
    stat = path.stat()
    return _read(str(path), stat.st_mtime_ns, stat.st_size)


def _parse(path: Path) -> ast.Module:
    return _source_and_tree(path)[1]


def _is_type_checking(test: ast.expr) -> bool:
    """``if TYPE_CHECKING:`` or ``if typing.TYPE_CHECKING:``."""
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def _walk_imports(tree: ast.Module):
    """Yield (import node, inside a function, under ``if TYPE_CHECKING:``) for every import."""

    def visit(node, in_function, type_checking):
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.Import, ast.ImportFrom)):
                yield child, in_function, type_checking
            elif isinstance(child, ast.If) and _is_type_checking(child.test):
                for stmt in child.body:
                    yield from visit(ast.Module(body=[stmt], type_ignores=[]), in_function, True)
                for stmt in child.orelse:
                    yield from visit(ast.Module(body=[stmt], type_ignores=[]), in_function, type_checking)
            else:
                inner = in_function or isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda))
                yield from visit(child, inner, type_checking)

    yield from visit(tree, False, False)


def _absolute_from(module: str, is_package: bool, node: ast.ImportFrom) -> str:
    """The absolute module named by a ``from ... import`` (relative levels resolved)."""
    if node.level == 0:
        return node.module or ""
    parts = module.split(".") if is_package else module.split(".")[:-1]
    parts = parts[: len(parts) - (node.level - 1)] if node.level > 1 else parts
    return ".".join(parts + ([node.module] if node.module else []))


def _known(name: str, known) -> str | None:
    """The longest prefix of a dotted name that is one of the known modules."""
    parts = name.split(".")
    for end in range(len(parts), 0, -1):
        candidate = ".".join(parts[:end])
        if candidate in known:
            return candidate
    return None


def project_imports(module: str, path: Path, known) -> list[tuple[str, ast.stmt, bool, bool]]:
    """(imported project module, import node, inside a function, under TYPE_CHECKING) for each
    project module an import statement of ``module`` names.  ``from x import y`` names x.y when
    that is a module, else x; ``import a.b.c`` names a.b.c (the parent packages it also runs are
    not counted as edges: a package importing its own submodules is not a cycle)."""
    found = []
    is_package = path.name == "__init__.py"
    for node, in_function, type_checking in _walk_imports(_parse(path)):
        targets = []
        if isinstance(node, ast.Import):
            targets = [_known(alias.name, known) for alias in node.names]
        else:
            base = _absolute_from(module, is_package, node)
            for alias in node.names:
                sub = f"{base}.{alias.name}" if base else alias.name
                targets.append(sub if sub in known else _known(base, known))
        for target in dict.fromkeys(t for t in targets if t):
            found.append((target, node, in_function, type_checking))
    return found


# ---------------------------------------------------------------------------------------------
# 1. import cycles


def import_graph(root: str | Path, packages=OWN, type_checking: bool = False):
    """module -> {imported project module -> [where, ...]} ("path:line"), module-level and
    function-level imports; ``if TYPE_CHECKING:`` imports are left out (they never run) unless
    type_checking is true."""
    root = Path(root)
    known = modules(root, packages)
    graph: dict[str, dict[str, list[str]]] = {m: {} for m in known}
    for module, path in known.items():
        for target, node, _, under_tc in project_imports(module, path, known):
            if under_tc and not type_checking:
                continue
            where = f"{path.relative_to(root).as_posix()}:{node.lineno}"
            graph[module].setdefault(target, []).append(where)
    return graph


def _strongly_connected(graph) -> list[list[str]]:
    """Tarjan's components, iteratively (the graph is small but recursion is not needed)."""
    index, low, on_stack, stack, components, counter = {}, {}, set(), [], [], [0]
    for start in sorted(graph):
        if start in index:
            continue
        work = [(start, iter(sorted(graph[start])))]
        index[start] = low[start] = counter[0]
        counter[0] += 1
        stack.append(start)
        on_stack.add(start)
        while work:
            node, children = work[-1]
            for child in children:
                if child not in index:
                    index[child] = low[child] = counter[0]
                    counter[0] += 1
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph[child]))))
                    break
                if child in on_stack:
                    low[node] = min(low[node], index[child])
            else:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[node])
                if low[node] == index[node]:
                    component = []
                    while True:
                        member = stack.pop()
                        on_stack.discard(member)
                        component.append(member)
                        if member == node:
                            break
                    components.append(sorted(component))
    return components


def _shortest_cycle(graph, component: list[str]) -> list[str]:
    """A shortest cycle through the component's first module, staying inside the component."""
    members, start = set(component), component[0]
    parent, frontier = {start: None}, [start]
    while frontier:
        following = []
        for node in frontier:
            for child in sorted(graph[node]):
                if child == start:
                    path = [node]
                    while parent[path[-1]] is not None:
                        path.append(parent[path[-1]])
                    return list(reversed(path)) + [start]
                if child in members and child not in parent:
                    parent[child] = node
                    following.append(child)
        frontier = following
    raise AssertionError(f"no cycle in component {component}")


def import_cycles(graph) -> list[list[str]]:
    """One cycle (a -> b -> ... -> a) per group of modules that import each other."""
    cycles = []
    for component in _strongly_connected(graph):
        if len(component) > 1 or component[0] in graph[component[0]]:
            cycles.append(_shortest_cycle(graph, component))
    return sorted(cycles)


def describe_cycles(graph, cycles) -> str:
    lines = []
    for cycle in cycles:
        lines.append(" -> ".join(cycle))
        for a, b in zip(cycle, cycle[1:]):
            lines.append(f"    {a} imports {b} at {', '.join(graph[a][b])}")
    return "\n".join(lines)


# ---------------------------------------------------------------------------------------------
# 2. wide functions


def parameter_count(node: ast.FunctionDef | ast.AsyncFunctionDef) -> int:
    """Parameters, ``self``/``cls`` (a leading one) not counted, ``*args``/``**kwargs`` one each."""
    a = node.args
    positional = [p.arg for p in a.posonlyargs + a.args]
    count = len(positional) + len(a.kwonlyargs) + (a.vararg is not None) + (a.kwarg is not None)
    if positional and positional[0] in ("self", "cls"):
        count -= 1
    return count


def wide_functions(root: str | Path, package: str = "prepack", limit: int = MAX_PARAMETERS):
    """[(path:line, qualified name, parameter count)] of the functions over the limit."""
    root = Path(root)
    found = []
    for module, path in modules(root, (package,)).items():

        def visit(node, prefix):
            for child in ast.iter_child_nodes(node):
                if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)):
                    name = f"{prefix}{child.name}"
                    count = parameter_count(child)
                    if count > limit:
                        found.append((f"{path.relative_to(root).as_posix()}:{child.lineno}", name, count))
                    visit(child, f"{name}.<locals>.")
                elif isinstance(child, ast.ClassDef):
                    visit(child, f"{prefix}{child.name}.")
                else:
                    visit(child, prefix)

        visit(_parse(path), f"{module}.")
    return found


# ---------------------------------------------------------------------------------------------
# 3. imports of the project's own modules inside functions


def _comment_lines(source: str) -> set[int]:
    """Line numbers that carry a ``#`` comment (real comments, not ``#`` inside strings)."""
    lines = set()
    for token in tokenize.generate_tokens(io.StringIO(source).readline):
        if token.type == tokenize.COMMENT:
            lines.add(token.start[0])
    return lines


def inner_imports(root: str | Path, package: str = "prepack", own=OWN):
    """[(path:line, import statement, has a why-comment)] for every import of an ``own`` module
    (or a relative import) inside a function of ``package``.  The comment may sit on any line of
    the statement or on the line just above it."""
    root = Path(root)
    found = []
    for path in modules(root, (package,)).values():
        source, tree = _source_and_tree(path)
        comments = _comment_lines(source)
        for node, in_function, _ in _walk_imports(tree):
            if not in_function:
                continue
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            else:
                names = ["." * node.level] if node.level else [node.module or ""]
            if not any(n.startswith(".") or n.split(".")[0] in own for n in names):
                continue
            end = getattr(node, "end_lineno", None) or node.lineno
            commented = any(line in comments for line in range(node.lineno - 1, end + 1))
            text = ast.unparse(node)
            found.append((f"{path.relative_to(root).as_posix()}:{node.lineno}", text, commented))
    return found


# ---------------------------------------------------------------------------------------------
# the rules, on the real tree


def test_no_import_cycles_among_the_projects_modules():
    graph = import_graph(REPO)
    cycles = import_cycles(graph)
    assert not cycles, (
        f"{len(cycles)} import cycle(s) among prepack/loader/schemas (imports inside functions count; "
        f"`if TYPE_CHECKING:` ones do not):\n" + describe_cycles(graph, cycles)
    )


def test_no_function_in_prepack_takes_more_than_6_parameters():
    wide = wide_functions(REPO)
    assert not wide, (
        f"{len(wide)} function(s) in prepack/ take more than {MAX_PARAMETERS} parameters "
        "(self/cls not counted; *args and **kwargs one each):\n"
        + "\n".join(f"  {where}  {name}  ({count})" for where, name, count in wide)
    )


def test_prepack_imports_its_own_modules_inside_functions_at_most_22_times():
    found = inner_imports(REPO)
    assert len(found) <= MAX_INNER_IMPORTS, (
        f"{len(found)} imports of prepack/loader/schemas modules inside functions in prepack/ "
        f"(at most {MAX_INNER_IMPORTS}):\n" + "\n".join(f"  {where}  {text}" for where, text, _ in found)
    )


def test_each_import_inside_a_prepack_function_says_why():
    silent = [(where, text) for where, text, commented in inner_imports(REPO) if not commented]
    assert not silent, (
        f"{len(silent)} import(s) of prepack/loader/schemas modules inside functions in prepack/ with no "
        "`#` comment on the line or the line above saying why it is not at module level:\n"
        + "\n".join(f"  {where}  {text}" for where, text in silent)
    )


# ---------------------------------------------------------------------------------------------
# the checkers, on synthetic trees: each rule can fail and can pass


def _tree(root: Path, files: dict[str, str]) -> Path:
    for name, text in files.items():
        path = root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(textwrap.dedent(text), encoding="utf-8")
    return root


def test_checker_finds_a_cycle_through_an_import_inside_a_function(tmp_path):
    _tree(
        tmp_path,
        {
            "prepack/__init__.py": "",
            "prepack/a.py": "from prepack import b\n",
            "prepack/b.py": "def f():\n    import prepack.a\n",
            "schemas/__init__.py": "",
            "schemas/c.py": "import prepack.a\n",
        },
    )
    graph = import_graph(tmp_path)
    assert graph["prepack.a"] == {"prepack.b": ["prepack/a.py:1"]}  # `from prepack import b`: the submodule
    assert import_cycles(graph) == [["prepack.a", "prepack.b", "prepack.a"]]
    assert "prepack.b imports prepack.a at prepack/b.py:2" in describe_cycles(graph, import_cycles(graph))


def test_checker_resolves_relative_imports_into_a_cycle(tmp_path):
    _tree(
        tmp_path,
        {
            "loader/__init__.py": "from .x import X\n",
            "loader/x.py": "from .sub.y import Y\nX = 1\n",
            "loader/sub/__init__.py": "",
            "loader/sub/y.py": "from .. import x\nfrom ..x import X\nY = 2\n",
        },
    )
    graph = import_graph(tmp_path)
    assert graph["loader"] == {"loader.x": ["loader/__init__.py:1"]}
    assert graph["loader.sub.y"] == {"loader.x": ["loader/sub/y.py:1", "loader/sub/y.py:2"]}
    assert import_cycles(graph) == [["loader.sub.y", "loader.x", "loader.sub.y"]]


def test_checker_passes_a_tree_without_cycles_and_leaves_out_type_checking(tmp_path):
    _tree(
        tmp_path,
        {
            "schemas/__init__.py": "from schemas import p\n",  # a package importing its own module
            "schemas/p.py": "import os\nimport schemas.q\n",
            "schemas/q.py": (
                "from typing import TYPE_CHECKING\n"
                "if TYPE_CHECKING:\n"
                "    from schemas.p import P\n"
                "else:\n"
                "    import json\n"
            ),
        },
    )
    assert import_cycles(import_graph(tmp_path)) == []
    assert import_cycles(import_graph(tmp_path, type_checking=True)) == [["schemas.p", "schemas.q", "schemas.p"]]


def test_checker_finds_a_self_import(tmp_path):
    _tree(tmp_path, {"prepack/__init__.py": "", "prepack/s.py": "def f():\n    from prepack import s\n"})
    assert import_cycles(import_graph(tmp_path)) == [["prepack.s", "prepack.s"]]


def test_checker_finds_a_function_with_7_parameters(tmp_path):
    _tree(
        tmp_path,
        {
            "prepack/__init__.py": "",
            "prepack/w.py": """\
                def six(a, b, c, d, e, f):
                    def seven(a, b, /, c, *, d, e, f, g):
                        pass

                class K:
                    def method(self, a, b, c, d, e, f):
                        pass

                    @classmethod
                    def star(cls, a, b, c, d, e, *args, **kwargs):
                        pass

                async def spread(a, b, c, d, e, *args, **kwargs):
                    pass
            """,
            "loader/__init__.py": "def outside_prepack(a, b, c, d, e, f, g, h):\n    pass\n",
        },
    )
    assert wide_functions(tmp_path) == [
        ("prepack/w.py:2", "prepack.w.six.<locals>.seven", 7),
        ("prepack/w.py:10", "prepack.w.K.star", 7),
        ("prepack/w.py:13", "prepack.w.spread", 7),
    ]


def test_checker_passes_functions_of_at_most_6_parameters(tmp_path):
    _tree(
        tmp_path,
        {
            "prepack/__init__.py": "",
            "prepack/w.py": "class K:\n    def m(self, a, b, c, d, *a2, **kw):\n        pass\n",
        },
    )
    assert wide_functions(tmp_path) == []


def test_checker_finds_an_uncommented_import_inside_a_function(tmp_path):
    _tree(
        tmp_path,
        {
            "prepack/__init__.py": "",
            "prepack/i.py": """\
                import prepack.j  # module level: not counted


                def f():
                    import os
                    import prepack.j
                    # pyarrow is heavy: only when a bound is used
                    from schemas import record
                    from . import j  # a cycle otherwise
                    from loader.reader import (
                        Reader,  # why: the loader is optional here
                    )
                    s = "# not a comment"; from prepack import j
            """,
            "prepack/j.py": "",
        },
    )
    found = inner_imports(tmp_path)
    assert found == [
        ("prepack/i.py:6", "import prepack.j", False),
        ("prepack/i.py:8", "from schemas import record", True),
        ("prepack/i.py:9", "from . import j", True),
        ("prepack/i.py:10", "from loader.reader import Reader", True),
        ("prepack/i.py:13", "from prepack import j", False),
    ]


def test_checker_counts_inner_imports_against_the_limit(tmp_path):
    body = "".join(f"    import prepack.m{i}  # lazy\n" for i in range(MAX_INNER_IMPORTS + 1))
    _tree(tmp_path, {"prepack/__init__.py": "", "prepack/many.py": "def f():\n" + body})
    found = inner_imports(tmp_path)
    assert len(found) == MAX_INNER_IMPORTS + 1 and all(commented for _, _, commented in found)
    _tree(tmp_path, {"prepack/many.py": "def f():\n" + "".join(body.splitlines(True)[:MAX_INNER_IMPORTS])})
    assert len(inner_imports(tmp_path)) == MAX_INNER_IMPORTS
