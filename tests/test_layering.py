"""The layers hold: the engine neither imports Airflow nor starts its components, and modules and
functions stay small enough to read (ast over the source files; nothing is imported)."""

import ast
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
MAX_MODULE_LINES = 400
MAX_FUNCTION_LINES = 60
# `airflow <component>` is how an Airflow component is started; these names only mean that.
COMPONENTS = {"api-server", "dag-processor", "triggerer"}
# "scheduler" also names a learning-rate scheduler: it counts only in an argv list (see _argv_list).
ARGV_COMPONENTS = COMPONENTS | {"scheduler"}


def _modules(*packages: str) -> list[Path]:
    return sorted(p for pkg in packages for p in (REPO / pkg).rglob("*.py") if "__pycache__" not in p.parts)


def _docstrings(tree: ast.AST) -> set[int]:
    """ids of the string constants that are docstrings (prose, which may name anything)."""
    out = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) and node.body:
            first = node.body[0]
            if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant):
                out.add(id(first.value))
    return out


def _argv_list(node: ast.List | ast.Tuple) -> bool:
    """An argv list: besides plain words it holds an option (`--x`) or a computed element (an
    executable path, `*prefix`), unlike a tuple of keys such as ("optimizer", "scheduler")."""
    for elt in node.elts:
        if not (isinstance(elt, ast.Constant) and isinstance(elt.value, str)) or elt.value.startswith("-"):
            return True
    return False


def _names_airflow(value: str) -> bool:
    """The Airflow executable or module: "airflow", ".../bin/airflow", "airflow scheduler ...",
    or a module path given to importlib ("airflow.sdk")."""
    return value == "airflow" or value.startswith(("airflow.", "airflow ")) or value.endswith("/airflow")


def airflow_uses(path: Path, root: Path = REPO) -> list[str]:
    """Where the module at `path` imports Airflow or names its executable or components."""
    tree = ast.parse(path.read_text(), filename=str(path))
    docstrings = _docstrings(tree)
    found = []
    for node in ast.walk(tree):  # every statement, also imports inside functions
        line = f"{path.relative_to(root)}:{getattr(node, 'lineno', '?')}"
        if isinstance(node, ast.Import):
            found += [f"{line}: import {a.name}" for a in node.names if a.name.split(".")[0] == "airflow"]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and (node.module or "").split(".")[0] == "airflow":
            found.append(f"{line}: from {node.module} import ...")
        elif isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in docstrings:
            if _names_airflow(node.value) or node.value in COMPONENTS:
                found.append(f"{line}: {node.value!r}")
        elif isinstance(node, (ast.List, ast.Tuple)) and _argv_list(node):
            found += [f"{line}: {e.value!r} in an argv list" for e in node.elts
                      if isinstance(e, ast.Constant) and e.value in ARGV_COMPONENTS]
    return sorted(found, key=lambda f: int(f.split(":")[1]))


def test_no_engine_module_imports_airflow_or_starts_its_components():
    modules = _modules("pipeline")
    assert len(modules) > 20  # the walk found the engine
    found = [use for path in modules for use in airflow_uses(path)]
    assert found == [], "the engine (pipeline/) must run without Airflow; Airflow code goes in plugins/:\n" + \
        "\n".join(found)


SAMPLE = '''"""The airflow scheduler, in prose: not a finding."""
def start():
    from airflow.sdk import DAG
    import airflow.models
    argv = [exe, "scheduler", "--skip-serve-logs"]
    keys = ("optimizer", "scheduler")
    name = "dag-processor"
    importlib.import_module("airflow.sdk")
    return [sys.executable, "-m", "airflow"]
'''


def test_the_check_finds_imports_executables_and_components_but_not_prose(tmp_path):
    path = tmp_path / "sample.py"
    path.write_text(SAMPLE)
    found = [f.split(": ", 1)[1] for f in airflow_uses(path, tmp_path)]
    assert found == ["from airflow.sdk import ...", "import airflow.models", "'scheduler' in an argv list",
                     "'dag-processor'", "'airflow.sdk'", "'airflow'"]


def test_no_module_over_400_lines_and_no_function_over_60():
    too_long = []
    for path in _modules("pipeline", "plugins", "dags"):
        source = path.read_text()
        rel = path.relative_to(REPO)
        lines = len(source.splitlines())
        if lines > MAX_MODULE_LINES:
            too_long.append(f"{rel}: {lines} lines (at most {MAX_MODULE_LINES})")
        for node in ast.walk(ast.parse(source, filename=str(path))):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                length = node.end_lineno - node.lineno + 1
                if length > MAX_FUNCTION_LINES:
                    too_long.append(f"{rel}:{node.lineno} {node.name}: {length} lines (at most {MAX_FUNCTION_LINES})")
    assert too_long == [], "split these by concept:\n" + "\n".join(too_long)
