"""h2o_fn's core imports neither the adapters nor the kernel op (DESIGN.md section 1)."""

import ast
from pathlib import Path

CORE = Path(__file__).resolve().parent.parent / "h2o_fn"


def test_core_modules_import_neither_adapters_nor_metal_ops():
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
    import subprocess
    import sys

    code = "import sys, h2o_fn; print(any(m.startswith(('h2o_fn.adapters', 'h2o_fn.metal_ops', 'mlx_lm')) for m in sys.modules))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"
