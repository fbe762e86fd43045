"""The layout's three import rules, checked on the source (every import, top level or inside a
function), and a guard that the repository cites no file outside itself."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
ROLES = ("producer", "aggregator", "trainer", "gateway", "helper")


def imported_modules(path: Path, package: str | None = None) -> set[str]:
    """Every module an `import` or `from … import` in `path` names (relative ones resolved)."""
    tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
    if package is None:
        package = ".".join(path.relative_to(REPO).with_suffix("").parts[:-1])
    out: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                module = ".".join([*base, node.module] if node.module else base)
            else:
                module = node.module or ""
            out.add(module)
            out.update(f"{module}.{alias.name}" for alias in node.names)
    return out


def top(module: str) -> str:
    return module.split(".")[0]


def sources(*rooms: str) -> list[Path]:
    return sorted(p for room in rooms for p in (REPO / room).rglob("*.py"))


def violations(files: list[Path], forbidden) -> list[str]:
    return [f"{f.relative_to(REPO)} imports {m}"
            for f in files for m in sorted(imported_modules(f)) if forbidden(m)]


def test_the_contract_imports_no_role_no_bench_and_never_the_cli():
    contract = [f for f in sources("ipdp") if "cli" not in f.relative_to(REPO / "ipdp").parts]
    bad = violations(contract, lambda m: top(m) in (*ROLES, "bench", "scripts", "tests")
                     or m == "ipdp.cli" or m.startswith("ipdp.cli."))
    assert not bad, "\n".join(bad)


@pytest.mark.parametrize("role", ROLES)
def test_a_role_imports_no_other_role_and_not_the_cli(role):
    others = {r for r in ROLES if r != role} | {"bench", "scripts", "tests"}
    bad = violations(sources(role), lambda m: top(m) in others
                     or m == "ipdp.cli" or m.startswith("ipdp.cli."))
    assert not bad, "\n".join(bad)


def test_only_the_cli_tests_and_bench_import_the_embedded_runtime():
    allowed = {REPO / "ipdp" / "cli", REPO / "ipdp" / "embedded", REPO / "tests", REPO / "bench"}
    files = [f for f in sources("ipdp", *ROLES, "scripts")
             if not any(a in f.parents for a in allowed)]
    bad = violations(files, lambda m: m == "ipdp.embedded" or m.startswith("ipdp.embedded."))
    assert not bad, "\n".join(bad)


def test_the_device_sdk_imports_neither_redis_nor_the_study_store():
    device = [REPO / "producer" / f for f in ("contributor.py", "studies.py", "gateway_client.py")]
    bad = violations(device, lambda m: top(m) == "redis"
                     or m.startswith(("ipdp.state", "ipdp.redis_io")))
    assert not bad, "\n".join(bad)


def test_the_device_sdk_never_imports_the_model_loader():
    """Devices encode through ipdp.schema; predicting (ipdp.model, what a model's consumer
    loads) is no part of what ships to a device."""
    bad = violations(sources("producer"), lambda m: m in ("ipdp.model", "ipdp.load_model")
                     or m.startswith("ipdp.model."))
    assert not bad, "\n".join(bad)


def test_the_checker_sees_imports_inside_functions_and_relative_ones(tmp_path):
    sample = tmp_path / "probe.py"
    sample.write_text("def f():\n    from trainer.solver import solve_constrained\n"
                      "from ..cli import common\n", encoding="utf-8")
    found = imported_modules(sample, package="ipdp.embedded")
    assert {"trainer.solver", "ipdp.cli", "ipdp.cli.common"} <= found


def test_nothing_in_the_repository_cites_the_design_notes_outside_it():
    tracked = [p for p in REPO.rglob("*") if p.is_file() and p.suffix in (".py", ".md", ".yml",
               ".toml", ".sh", ".ts", ".html", ".json")
               and not {".venv", ".git", "node_modules", ".pytest_cache"} & set(p.parts)]
    cites = [f"{p.relative_to(REPO)}:{i}" for p in tracked
             for i, line in enumerate(p.read_text(encoding="utf-8", errors="replace")
                                      .splitlines(), 1)
             if re.search(r"DESIGN(\.md| §)|STYLE\.md|\.\./shared", line)
             and p != Path(__file__).resolve()]
    assert not cites, "cites a file outside the repository:\n" + "\n".join(cites)
