"""The layers of docs/ARCHITECTURE.md: what each folder may import, no import cycle, and
the commands apart from the adapter."""

import ast
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
CORE = ROOT / "h2o_fn"
# folder -> package, as pyproject.toml's [tool.setuptools.package-dir] maps them
PACKAGES = {"h2o_fn": "h2o_fn", "adapters": "h2o_fn.adapters", "metal_ops": "h2o_fn.metal_ops"}


def project_modules():
    """module name -> path, for every .py file of the installed packages."""
    out = {}
    for folder, package in PACKAGES.items():
        for path in sorted((ROOT / folder).rglob("*.py")):
            parts = list(path.relative_to(ROOT / folder).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts = parts[:-1]
            out[".".join([package, *parts])] = path
    return out


def imports_of(name: str, path: Path, modules) -> set:
    """Project modules `name` imports anywhere in its file (also inside functions)."""
    package = name if path.name == "__init__.py" else name.rsplit(".", 1)[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.rsplit(".", node.level - 1)[0] if node.level > 1 else package
                module = f"{base}.{node.module}" if node.module else base
            else:
                module = node.module
            # `from pkg import sub` imports the submodule when there is one
            subs = {f"{module}.{a.name}" for a in node.names} & modules.keys()
            found.update(subs or {module})
    return {m for m in found if m in modules and m != name}


def import_graph():
    modules = project_modules()
    return {name: imports_of(name, path, modules) for name, path in modules.items()}


def test_no_import_cycle_among_the_projects_modules():
    graph = import_graph()
    state, stack = {}, []

    def visit(node):
        state[node] = "open"
        stack.append(node)
        for nxt in sorted(graph[node]):
            if state.get(nxt) == "open":
                cycle = stack[stack.index(nxt):] + [nxt]
                raise AssertionError("import cycle: " + " -> ".join(cycle))
            if nxt not in state:
                visit(nxt)
        stack.pop()
        state[node] = "done"

    for node in sorted(graph):
        if node not in state:
            visit(node)
    assert "h2o_fn.adapters.cli.generate" in graph  # the walk saw the commands


def test_the_graph_sees_function_level_imports(tmp_path):
    path = tmp_path / "m.py"
    path.write_text("def f():\n    from .attention import x\n    from h2o_fn import core\n")
    modules = project_modules()
    assert imports_of("h2o_fn.adapters.m", path, modules) == {"h2o_fn.adapters.attention", "h2o_fn.core"}


def test_no_argparse_module_beside_the_adapter():
    """Commands live in adapters/cli/; nothing else in adapters/ parses arguments."""
    for path in (ROOT / "adapters").rglob("*.py"):
        if "cli" in path.relative_to(ROOT / "adapters").parts:
            continue
        imported = {a.name for n in ast.walk(ast.parse(path.read_text())) if isinstance(n, ast.Import)
                       for a in n.names}
        imported |= {n.module for n in ast.walk(ast.parse(path.read_text())) if isinstance(n, ast.ImportFrom)}
        assert "argparse" not in imported, path


def test_metrics_and_the_adapter_import_no_command():
    graph = import_graph()
    for name, deps in graph.items():
        if name.startswith("h2o_fn.adapters") and not name.startswith("h2o_fn.adapters.cli"):
            assert not {d for d in deps if d.startswith("h2o_fn.adapters.cli")}, name


def test_core_modules_import_neither_adapters_nor_metal_ops():
    """The core (h2o_fn/) imports neither the adapters nor the kernel op, nor mlx-lm
    (docs/ARCHITECTURE.md, "What each folder may import")."""
    for path in CORE.glob("*.py"):
        if path.name == "__main__.py":  # the command line loads adapters on demand, by name
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            names = []
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                names = [("." * node.level) + (node.module or "")]
            for name in names:
                assert "adapters" not in name and "metal_ops" not in name, (path.name, name)
                assert not name.startswith("mlx_lm"), (path.name, name)


def test_importing_the_core_loads_no_adapter():
    code = ("import sys, h2o_fn; print(any(m.startswith(('h2o_fn.adapters', 'h2o_fn.metal_ops', 'mlx_lm')) "
            "for m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


SIZED = ("h2o_fn", "adapters", "metal_ops")
NAMEDTUPLE_API = {"_replace", "_asdict", "_fields", "_make"}


def test_no_class_over_200_lines_and_no_function_body_over_60():
    """A newcomer reads a class on two screens and a function on one (issue 18)."""
    big = []
    for folder in SIZED:
        for path in sorted((ROOT / folder).rglob("*.py")):
            for node in ast.walk(ast.parse(path.read_text())):
                if isinstance(node, ast.ClassDef) and node.end_lineno - node.lineno + 1 > 200:
                    big.append(f"{path.relative_to(ROOT)}: class {node.name}")
                if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                    body = node.body[1:] if ast.get_docstring(node) and len(node.body) > 1 else node.body
                    if node.end_lineno - body[0].lineno + 1 > 60:
                        big.append(f"{path.relative_to(ROOT)}: def {node.name}")
    assert not big, big


def test_no_module_reads_another_objects_private_attributes():
    """`x._name` only on self/cls (NamedTuple's own API aside); mlx-lm's internals only in
    the one compat module that names the version they were read from."""
    found = []
    for folder in SIZED:
        for path in sorted((ROOT / folder).rglob("*.py")):
            if path.name == "serve_compat.py":
                continue
            for node in ast.walk(ast.parse(path.read_text())):
                if (isinstance(node, ast.Attribute) and node.attr.startswith("_")
                        and not node.attr.startswith("__") and node.attr not in NAMEDTUPLE_API
                        and not (isinstance(node.value, ast.Name) and node.value.id in ("self", "cls"))):
                    found.append(f"{path.relative_to(ROOT)}:{node.lineno} {ast.unparse(node)}")
    assert not found, found
