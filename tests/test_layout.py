"""The layout of docs/ARCHITECTURE.md, checked on the source: imports run one way
(tooling -> server app -> common, tooling -> client app -> common), the server and the
client apps never import each other, nothing imports the tooling, no module is part of
an import cycle, and no file cites a document outside the repository."""

import ast
import io
import re
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest
from flwr.cli.build import build_fab_from_disk

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("common", "fedefc_client", "fedefc_server", "fedefc_cli")
# package -> the project packages it may import
ALLOWED = {"common": {"common"},
           "fedefc_client": {"fedefc_client", "common"},
           "fedefc_server": {"fedefc_server", "common"},
           "fedefc_cli": set(PACKAGES)}


def module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def project_imports(path: Path) -> set[str]:
    """The project modules ``path`` imports (absolute names, relative imports resolved)."""
    name = module_name(path)
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[:len(package.split(".")) - node.level + 1]
                base = ".".join(anchor + ([base] if base else []))
            found.add(base)
            found.update(f"{base}.{alias.name}" for alias in node.names)
    modules = {module_name(p) for pkg in PACKAGES for p in (ROOT / pkg).rglob("*.py")}
    return {m for m in found if m in modules and m != name}


SOURCES = [p for pkg in PACKAGES for p in sorted((ROOT / pkg).rglob("*.py"))]
GRAPH = {module_name(p): project_imports(p) for p in SOURCES}


@pytest.mark.parametrize("path", SOURCES, ids=lambda p: str(p.relative_to(ROOT)))
def test_imports_run_one_way(path):
    package = module_name(path).split(".")[0]
    wrong = {m for m in GRAPH[module_name(path)] if m.split(".")[0] not in ALLOWED[package]}
    assert not wrong, f"{package} may import only {sorted(ALLOWED[package])}"


def test_no_import_cycle():
    done, on_path = set(), []

    def visit(module):
        if module in on_path:
            cycle = on_path[on_path.index(module):] + [module]
            pytest.fail("import cycle: " + " -> ".join(cycle))
        if module in done:
            return
        on_path.append(module)
        for other in sorted(GRAPH[module]):
            # importing a package's submodule runs the package's __init__ first, which
            # imports nothing here: the edge to the submodule is the one that counts
            visit(other)
        on_path.pop()
        done.add(module)

    for module in sorted(GRAPH):
        visit(module)


def test_imports_stay_at_the_top_of_modules_unless_a_measured_lazy_import():
    """An import inside a function must say why: a comment naming the start-up time saved."""
    for path in SOURCES:
        lines = path.read_text().splitlines()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                for inner in ast.walk(node):
                    if isinstance(inner, (ast.Import, ast.ImportFrom)):
                        line = lines[inner.lineno - 1]
                        assert re.search(r"#.*\d s\b", line), f"{path}:{inner.lineno}: {line}"


def test_the_run_config_schema_and_the_nodes_first_checks_import_no_torch():
    """What validates a run config (the schema, every method's settings, the named
    datasets' registrations, the node's policy) and the ClientApp module Flower loads
    import no torch: ``fedefc deploy submit`` checks a config and a node refuses a run
    without its 1-2 s of CPU (docs/BENCHMARKS.md, "A run every node refuses")."""
    probe = ("import sys, common.methods, common.named_datasets, fedefc_client.policy, "
             "fedefc_client.client_app; "
             "print(sorted(m for m in sys.modules if m == 'torch' or m.startswith('torch.')))")
    out = subprocess.run([sys.executable, "-c", probe], cwd=ROOT, capture_output=True,
                         text=True, check=True)
    assert out.stdout.strip() == "[]", out.stdout[-500:]


def test_the_components_are_flowers_names():
    text = (ROOT / "pyproject.toml").read_text()
    assert 'serverapp = "fedefc_server.server_app:app"' in text
    assert 'clientapp = "fedefc_client.client_app:app"' in text


def test_no_file_cites_a_document_outside_the_repository():
    pattern = re.compile(r"(^|[^-\w])(ALGORITHM|BASELINES)\.md|\.\./shared")
    for path in ROOT.rglob("*"):
        if path.suffix not in (".py", ".md", ".toml", ".sh", ".yml") or \
                {"results", ".venv", ".git"} & set(path.relative_to(ROOT).parts):
            continue
        for number, line in enumerate(path.read_text().splitlines(), 1):
            assert not pattern.search(line), f"{path.relative_to(ROOT)}:{number}: {line}"


def test_the_app_flower_ships_holds_the_two_apps_and_common_only():
    """What ``flwr run`` packs (Flower's own FAB builder, in process): no tooling, no
    tests, docs or results."""
    with zipfile.ZipFile(io.BytesIO(build_fab_from_disk(ROOT))) as fab:
        tops = {name.split("/")[0] for name in fab.namelist()}
    assert tops == {".info", "pyproject.toml", "common", "fedefc_server", "fedefc_client"}
