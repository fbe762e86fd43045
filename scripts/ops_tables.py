#!/usr/bin/env python3
"""The settings and metrics tables of docs/operations.md, derived from the code.

    python scripts/ops_tables.py            # print both tables (descriptions from the code)
    python scripts/ops_tables.py --check    # exit 1 if docs/operations.md has drifted

The check (also run by tests/ipdp/test_docs.py) requires the document's tables to list exactly
every IPDP_* setting (ipdp/settings.py and each role's settings) with its type and default, and exactly every metric of
ipdp/metrics.py with its type and labels; the description column is written by hand. A metric's
description begins with the roles that serve it ("Aggregator, trainer: …"), and the check
compares those with each role's registry (ipdp.metrics.role_registry): a role that serves a
metric the table does not name for it, or lacks one the table does, is drift too.
"""

from __future__ import annotations

import argparse
import re
import sys
import types
import typing
from pathlib import Path

import annotated_types
from pydantic import SecretStr
from pydantic_settings import BaseSettings

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

OPERATIONS_MD = REPO / "docs" / "operations.md"


# --------------------------------------------------------------------------- settings


#: Where the settings models live: the shared ones, then each role's own.
SETTINGS_MODULES = ("ipdp.settings", "aggregator.settings", "trainer.settings", "producer.loadgen",
                    "gateway.settings", "helper.settings")


def settings_models() -> list[type[BaseSettings]]:
    """Every pydantic-settings model of SETTINGS_MODULES, in definition order."""
    import importlib

    out = []
    for name in SETTINGS_MODULES:
        module = importlib.import_module(name)
        out += [obj for obj in vars(module).values()
                if isinstance(obj, type) and issubclass(obj, BaseSettings)
                and obj is not BaseSettings and obj.__module__ == module.__name__]
    return out


def env_name(model: type[BaseSettings], field: str) -> str:
    return f"{model.model_config.get('env_prefix', '')}{field}".upper()


def settings_env_names() -> set[str]:
    """Every environment variable the settings models read."""
    return {env_name(m, f) for m in settings_models() for f in m.model_fields}


def _type_name(annotation) -> str:
    origin = typing.get_origin(annotation)
    if origin is typing.Literal:
        return " \\| ".join(f"`{v}`" for v in typing.get_args(annotation))
    if origin in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(annotation) if a is not type(None)]
        return " \\| ".join(_type_name(a) for a in args)
    if annotation is SecretStr:
        return "secret string"
    return {str: "string", int: "integer", float: "number", bool: "boolean"}.get(
        annotation, getattr(annotation, "__name__", str(annotation)))


def _bounds(metadata) -> str:
    marks = []
    for m in metadata:
        for cls, attr, sym in ((annotated_types.Ge, "ge", "≥"), (annotated_types.Gt, "gt", ">"),
                               (annotated_types.Le, "le", "≤"), (annotated_types.Lt, "lt", "<")):
            if isinstance(m, cls):
                marks.append(f"{sym} {getattr(m, attr)}")
    return ", ".join(marks)


def setting_type(info) -> str:
    bounds = _bounds(info.metadata)
    return _type_name(info.annotation) + (f" ({bounds})" if bounds else "")


def setting_default(info) -> str:
    value = info.default
    return "unset" if value is None else f"`{value}`"


def settings_rows() -> list[tuple[str, str, str, str]]:
    """(variable, type, default, description from the code or '') per field; a field a model
    inherits from another settings model is listed once, under the model that defines it."""
    return [(env_name(m, f), setting_type(i), setting_default(i), i.description or "")
            for m in settings_models() for f, i in m.model_fields.items() if _defines(m, f)]


def _defines(model: type[BaseSettings], field: str) -> bool:
    return not any(field in getattr(base, "model_fields", {}) for base in model.__bases__)


# --------------------------------------------------------------------------- metrics


def metric_objects() -> list:
    """Every prometheus_client metric object defined in ipdp.metrics."""
    from prometheus_client.metrics import MetricWrapperBase

    from ipdp import metrics

    return [obj for obj in vars(metrics).values() if isinstance(obj, MetricWrapperBase)]


def exposed_name(metric) -> str:
    """The name as written in PromQL: counters with `_total`, others as declared."""
    family = metric.describe()[0]
    return family.name + ("_total" if family.type == "counter" else "")


def metric_rows() -> list[tuple[str, str, str, str]]:
    """(name, type, labels, help) per metric."""
    rows = []
    for m in metric_objects():
        family = m.describe()[0]
        labels = ", ".join(f"`{label}`" for label in m._labelnames) or "—"
        rows.append((exposed_name(m), family.type, labels, family.documentation))
    return rows


def series_names() -> dict[str, str]:
    """Every series name ipdp exports (histograms: _bucket/_sum/_count) → its metric's name."""
    out = {}
    for m in metric_objects():
        family = m.describe()[0]
        base = exposed_name(m)
        out[base] = base
        if family.type == "histogram":
            for suffix in ("_bucket", "_sum", "_count"):
                out[family.name + suffix] = base
    return out


#: How the metrics table's descriptions name the processes that serve a metric; the model
#: subscriber (`ipdp models`) counts but serves no /metrics.
ROLE_NAMES = {"aggregator": "aggregator", "trainer": "trainer", "gateway": "gateway",
              "load generator": "loadgen", "helper": "helper", "model subscriber": None}


def served_metrics(role: str) -> set[str]:
    """The ipdp_* metrics the role's /metrics serves (its registry's families)."""
    from ipdp.metrics import role_registry

    return {family.name + ("_total" if family.type == "counter" else "")
            for family in role_registry(role).collect() if family.name.startswith("ipdp_")}


def documented_roles(meaning: str) -> set[str | None] | None:
    """The roles a description begins with ("Aggregator, trainer: …"), None if it names none."""
    head = meaning.split(":", 1)[0].lower()
    names = [n.strip() for n in re.split(r",| and ", head)]
    if len(meaning.split(":", 1)) < 2 or not all(n in ROLE_NAMES for n in names):
        return None
    return {ROLE_NAMES[n] for n in names}


def role_problems(documented: dict[str, list[str]]) -> list[str]:
    """Where the metrics table's roles and the roles' registries disagree."""
    problems, by_role = [], {role: set() for role in ROLE_NAMES.values() if role}
    for name, cells in documented.items():
        roles = documented_roles(cells[2]) if len(cells) > 2 else None
        if roles is None:
            problems.append(f"metric {name}: its meaning must begin with the roles that serve "
                            f"it ({', '.join(n.capitalize() for n in ROLE_NAMES)}, then ':')")
            continue
        for role in roles - {None}:
            by_role[role].add(name)
    for role, names in by_role.items():
        served = served_metrics(role)
        problems += [f"metric {n}: the {role} serves it, the table does not say so"
                     for n in sorted(served - names)]
        problems += [f"metric {n}: the table says the {role} serves it, its registry does not"
                     for n in sorted(names - served)]
    return problems


# --------------------------------------------------------------------------- markdown

_ROW = re.compile(r"^\|\s*`(?P<key>(?:IPDP|ipdp)_\w+)`\s*\|(?P<rest>.*)\|\s*$")


def doc_rows(text: str, prefix: str) -> dict[str, list[str]]:
    """Table rows of `text` whose first cell is a backticked name starting with `prefix`."""
    rows: dict[str, list[str]] = {}
    for line in text.splitlines():
        m = _ROW.match(line.strip())
        if m and m["key"].startswith(prefix):
            cells = [c.strip() for c in re.split(r"(?<!\\)\|", m["rest"])]
            if m["key"] in rows:
                raise ValueError(f"{m['key']} is listed twice")
            rows[m["key"]] = cells
    return rows


def check(text: str) -> list[str]:
    """Every way the document's tables differ from the code (empty: in sync)."""
    problems: list[str] = []
    for kind, prefix, rows, columns, where in (
        ("setting", "IPDP_", settings_rows(), ("type", "default"), "no settings model reads it"),
        ("metric", "ipdp_", metric_rows(), ("type", "labels"),
         "ipdp/metrics.py does not export it"),
    ):
        documented = doc_rows(text, prefix)
        if kind == "metric":
            problems += role_problems(documented)
        for name, first, second, _ in rows:
            cells = documented.pop(name, None)
            if cells is None:
                problems.append(f"{kind} {name} is missing from the {kind}s table")
                continue
            if len(cells) < 3 or not cells[2]:
                problems.append(f"{kind} {name}: expected | {columns[0]} | {columns[1]} | … |")
                continue
            for column, doc_value, code_value in zip(columns, cells[:2], (first, second),
                                                      strict=True):
                if doc_value != code_value:
                    problems.append(f"{kind} {name}: {column} {doc_value!r}, "
                                    f"the code says {code_value!r}")
        problems += [f"{name} is documented but {where}" for name in documented]
    return problems


def render() -> str:
    lines = ["| Variable | Type | Default | Meaning |", "|---|---|---|---|"]
    lines += [f"| `{n}` | {t} | {d} | {desc or 'TODO'} |" for n, t, d, desc in settings_rows()]
    lines += ["", "| Metric | Type | Labels | Meaning |", "|---|---|---|---|"]
    lines += [f"| `{n}` | {t} | {labels} | {h} |" for n, t, labels, h in metric_rows()]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(allow_abbrev=False, description=__doc__.split("\n\n")[0])
    parser.add_argument("--check", action="store_true",
                        help="compare with docs/operations.md instead of printing")
    args = parser.parse_args(argv)
    if not args.check:
        print(render())
        return 0
    problems = check(OPERATIONS_MD.read_text(encoding="utf-8"))
    for p in problems:
        print(f"docs/operations.md: {p}", file=sys.stderr)
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
