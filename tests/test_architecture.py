"""The house rules that import-linter cannot see, read from the source itself.

import-linter (`lint-imports`, run by `make test`) checks the layers, the independence of
`sharding` and `store`, and that nothing imports in a cycle. These tests check the rest: no file
over 300 lines, no project import hidden inside a function outside the entry points, no
change of page or slot ownership outside the one allocator, and no linear algebra that blocks
XLA:CPU's thread pool.
"""

from __future__ import annotations

import ast
import pathlib
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
PACKAGES = ("flipjax", "kernels_pallas", "sharding", "store", "serve")
PROJECT = set(PACKAGES)
ENTRY_POINTS = {
    "flipjax/__init__.py",
    "flipjax/serve.py",
    "flipjax/ckpt.py",
    "flipjax/bench.py",
    "kernels_pallas/check.py",
}
MAX_LINES = 300


def sources() -> list[pathlib.Path]:
    return sorted(p for pkg in PACKAGES for p in (ROOT / pkg).rglob("*.py"))


def is_entry_point(path: pathlib.Path) -> bool:
    rel = path.relative_to(ROOT).as_posix()
    return (
        rel in ENTRY_POINTS
        or rel.startswith("flipjax/benchmarks/")
        or path.name in ("cli.py", "__main__.py")
    )


def project_imports_in_functions(tree: ast.AST) -> list[tuple[int, str]]:
    found = []
    for fn in ast.walk(tree):
        if not isinstance(fn, ast.FunctionDef | ast.AsyncFunctionDef):
            continue
        for node in ast.walk(fn):
            if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                names = [node.module]
            elif isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            else:
                continue
            found += [(node.lineno, n) for n in names if n.split(".")[0] in PROJECT]
    return found


def test_the_rules_see_every_package():
    assert len(sources()) > 50
    assert sum(is_entry_point(p) for p in sources()) >= 6


@pytest.mark.parametrize("path", sources(), ids=lambda p: p.relative_to(ROOT).as_posix())
def test_no_file_is_over_300_lines(path):
    lines = len(path.read_text().splitlines())
    assert lines <= MAX_LINES, f"{path.relative_to(ROOT)} has {lines} lines"


def test_no_project_import_hides_inside_a_function():
    hidden = {
        f"{p.relative_to(ROOT)}:{line} imports {name}"
        for p in sources()
        if not is_entry_point(p)
        for line, name in project_imports_in_functions(ast.parse(p.read_text()))
    }
    assert not hidden, "imports inside functions dodge the layer rules:\n" + "\n".join(hidden)


def test_only_the_allocator_changes_ownership():
    """The pools' ledger operations are called from the allocator alone (tests excepted)."""
    allowed = {"flipjax/runtime/allocator.py", "flipjax/runtime/pools.py"}
    calls = []
    for p in sources():
        if p.relative_to(ROOT).as_posix() in allowed:
            continue
        for node in ast.walk(ast.parse(p.read_text())):
            if (
                isinstance(node, ast.Call)
                and isinstance(node.func, ast.Attribute)
                and node.func.attr in ("allocate", "share", "release")
                and isinstance(node.func.value, ast.Attribute | ast.Name)
                and (getattr(node.func.value, "attr", None) or node.func.value.id)
                in ("pages", "slots", "pool", "_pages", "_slots")
            ):
                calls.append(f"{p.relative_to(ROOT)}:{node.lineno}")
    assert not calls, f"ownership changed outside the allocator at {calls}"


def test_a_lower_layer_imports_without_the_layers_above():
    """The public face loads lazily: reading a config (as the store and the CLIs do) pulls in
    neither jax nor the engine, and a store module can be imported first."""
    code = "import sys, store.checkpoints; print('flipjax.engine.engine' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "False", "importing a store module loaded the engine"
    bare = "import sys, flipjax.model.config; print('jax' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", bare], cwd=ROOT, capture_output=True, text=True)
    assert out.stdout.strip() == "False", "reading a config imported jax"


# Engine's whole public API, grouped by concern as the README's table lists it (a table that
# reads better packed).
ENGINE_API = {
    "from_pretrained",
    "info",
    "stats",
    "memory",
    "last_step",
    "add_request",
    "step",
    "has_unfinished",
    "progress",
    "abort",
    "generate",
    "flip",
    "arm",
    "follow",
    "checkpoint",
    "branch",
    "rewind",
    "list_checkpoints",
    "delete_checkpoint",
    "session",
    "check",
    "warmup",
    "flush_prefix_cache",
    "close",
}
ENGINE_INSIDE = ("flipjax/engine/",)
TEST_DOOR = "tests/support/internals.py"


def engine_private_names() -> set[str]:
    """Every private name an `Engine` has: its methods' and the attributes it assigns."""
    names: set[str] = set()
    for rel in ("flipjax/engine/engine.py", "flipjax/engine/checkpoint_api.py"):
        for node in ast.walk(ast.parse((ROOT / rel).read_text())):
            if isinstance(node, ast.FunctionDef | ast.AnnAssign | ast.Attribute):
                name = getattr(node, "name", None) or getattr(node, "attr", None)
                if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
                    name = node.target.id
                if name and name.startswith("_") and not name.startswith("__"):
                    names.add(name)
    return names


def test_the_engine_api_is_the_documented_one():
    from flipjax.engine.engine import Engine

    public = {n for n in dir(Engine) if not n.startswith("_")} | {"info"}
    assert public == ENGINE_API, f"added: {public - ENGINE_API}, gone: {ENGINE_API - public}"
    readme = (ROOT / "README.md").read_text()
    undocumented = sorted(n for n in ENGINE_API if f"`{n}" not in readme)
    assert not undocumented, f"README documents no {undocumented}"


def test_nothing_outside_the_engine_reaches_into_it():
    """Outside `flipjax/engine`, an engine's private names are touched only by the tests'
    one door into it; everyone else uses the API or `stats()`."""
    private = engine_private_names()
    assert {"_parts", "_settle", "_drained"} <= private
    files = sources() + sorted((ROOT / "tests").rglob("*.py"))
    reached = []
    for p in files:
        rel = p.relative_to(ROOT).as_posix()
        if rel.startswith(ENGINE_INSIDE) or rel == TEST_DOOR:
            continue
        for node in ast.walk(ast.parse(p.read_text())):
            if (
                isinstance(node, ast.Attribute)
                and node.attr in private
                and not (isinstance(node.value, ast.Name) and node.value.id in ("self", "cls"))
            ):
                reached.append(f"{rel}:{node.lineno} .{node.attr}")
    assert not reached, "private engine names used outside the engine:\n" + "\n".join(reached)


TEST_FOLDERS = {"model", "runtime", "engine", "sharding", "store", "serve", "kernels"}


def imported_modules(tree: ast.AST) -> list[tuple[int, str]]:
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            found.append((node.lineno, node.module or ""))
    return found


def test_tests_sit_by_layer_and_import_only_support():
    """Test modules live in the folder of the layer they test, with unique names (pytest imports
    them by basename), and share code only through `tests/support`, never by importing each
    other."""
    tests = ROOT / "tests"
    modules = sorted(tests.rglob("test_*.py"))
    names = [p.name for p in modules]
    assert len(names) == len(set(names)), "two test modules share a name"
    misplaced = [
        p.relative_to(tests).as_posix()
        for p in modules
        if p.parent.name not in TEST_FOLDERS and p.name != "test_architecture.py"
    ]
    assert not misplaced, f"test modules outside a layer folder: {misplaced}"
    crossing = []
    for p in modules + sorted((tests / "support").glob("*.py")):
        for line, name in imported_modules(ast.parse(p.read_text())):
            parts = name.split(".")
            if parts[0].startswith("test_") or (parts[0] == "tests" and parts[1:2] != ["support"]):
                crossing.append(f"{p.relative_to(ROOT)}:{line} imports {name}")
    assert not crossing, "\n".join(crossing)


# XLA:CPU runs these as library calls (LAPACK, ducc's FFT) that fan out into the intra-op pool
# from a thread of that pool and wait there: two at once on a two-core machine wait forever.
POOL_BLOCKING = {"triangular_solve", "solve_triangular", "solve", "cholesky", "eigh", "eig"}
POOL_BLOCKING |= {"svd", "qr", "lu", "lu_factor", "inv", "det", "slogdet", "lstsq", "pinv"}


def dotted(node: ast.AST) -> str:
    parts = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    if isinstance(node, ast.Name):
        parts.append(node.id)
    return ".".join(reversed(parts))


def test_no_program_calls_linear_algebra_that_blocks_xla_s_thread_pool():
    found = []
    for p in sources():
        for node in ast.walk(ast.parse(p.read_text())):
            name = dotted(node) if isinstance(node, ast.Attribute) else ""
            parts = name.split(".")
            if parts[0] not in ("jax", "jnp", "lax") or len(parts) < 3:
                continue
            if (parts[-2] == "linalg" and parts[-1] in POOL_BLOCKING) or parts[-2] == "fft":
                found.append(f"{p.relative_to(ROOT)}:{node.lineno} {name}")
    assert not found, "programs must not call these on the CPU:\n" + "\n".join(found)
