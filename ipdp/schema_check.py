"""A CSV read against a study's schema, column by column: what a device would make of each value.

`ipdp study create --schema s.json --check-csv sample.csv` prints this before it creates the
study, and creates nothing when the file cannot feed it (:attr:`CsvCheck.problems`); `ipdp
loadgen --dataset csv:PATH` names the columns behind a file without a usable row. The check
reads the whole file on the operator's machine and prints counts only, never a row.
"""

from __future__ import annotations

import csv
import math
from dataclasses import dataclass, field
from pathlib import Path

from ipdp.schema import Schema

#: How many distinct offending values a problem quotes.
EXAMPLES = 3


@dataclass
class ColumnCheck:
    """What one schema column of the file holds: ``values`` non-empty cells, of which
    ``not_numbers`` are not numbers (numeric column) or ``unknown_labels`` not one of the
    classes (class target), ``outside`` outside the public range (clipped on a device), and
    ``empty`` empty cells."""

    name: str
    values: int = 0
    empty: int = 0
    not_numbers: int = 0
    unknown_labels: int = 0
    outside: int = 0
    examples: list[str] = field(default_factory=list)
    labels: dict[str, int] = field(default_factory=dict)

    def note(self, text: str) -> None:
        if text not in self.examples and len(self.examples) < EXAMPLES:
            self.examples.append(text)

    @property
    def outside_share(self) -> float:
        usable = self.values - self.not_numbers - self.unknown_labels
        return self.outside / usable if usable else 0.0


@dataclass
class CsvCheck:
    """The file's header, its rows and one :class:`ColumnCheck` per schema column."""

    path: str
    header: list[str]
    rows: int
    missing: list[str]
    columns: list[ColumnCheck]

    @property
    def problems(self) -> list[str]:
        """Why the file cannot feed the study as it is; empty when it can."""
        out = []
        if self.missing:
            out.append(f"{self.path}: no column(s) {', '.join(self.missing)} that the schema "
                       f"names; columns: {', '.join(self.header)}")
        for c in self.columns:
            quoted = ", ".join(repr(x) for x in c.examples)
            if c.not_numbers:
                out.append(f"column {c.name}: {c.not_numbers} of {c.values} value(s) are not "
                           f"numbers ({quoted}): the schema reads it as a number")
            if c.unknown_labels:
                out.append(f"column {c.name}: {c.unknown_labels} of {c.values} value(s) are not "
                           f"one of the target's classes ({quoted})")
            if not c.values:
                out.append(f"column {c.name}: every cell is empty")
        return out


def _number(text: str) -> float | None:
    try:
        v = float(text)
    except ValueError:
        return None
    return v if math.isfinite(v) else None


def check_csv(path: str | Path, schema: Schema, *, delimiter: str = ",") -> CsvCheck:
    """Read ``path`` (a header row, then one row per example) against ``schema``.

    Raises OSError for a file that cannot be read and ValueError for one without a header."""
    path = Path(path)
    with open(path, newline="", encoding="utf-8-sig") as f:
        reader = csv.reader(f, delimiter=delimiter)
        header = [c.strip() for c in next(reader, [])]
        if not header:
            raise ValueError(f"{path}: empty file, expected a header row")
        names = [*schema.feature_names, schema.target.name]
        missing = [n for n in names if n not in header]
        present = [n for n in names if n in header]
        checks = {n: ColumnCheck(n) for n in present}
        ranges = {f.name: (f.min, f.max) for f in schema.features}
        target = schema.target
        if not target.is_class:
            ranges[target.name] = (target.min, target.max)
        where = {n: header.index(n) for n in present}
        rows = 0
        for row in reader:
            if not row:
                continue
            rows += 1
            for name, i in where.items():
                c = checks[name]
                cell = row[i].strip() if i < len(row) else ""
                if not cell:
                    c.empty += 1
                    continue
                c.values += 1
                if name == target.name and target.is_class:
                    c.labels[cell] = c.labels.get(cell, 0) + 1
                    if cell not in target.classes:
                        c.unknown_labels += 1
                        c.note(cell)
                    continue
                v = _number(cell)
                if v is None:
                    c.not_numbers += 1
                    c.note(cell)
                elif not ranges[name][0] <= v <= ranges[name][1]:
                    c.outside += 1
    return CsvCheck(str(path), header, rows, missing, [checks[n] for n in present])


def check_rows(check: CsvCheck, schema: Schema) -> list[tuple[str, str]]:
    """One (column, what it holds) row per schema column, for a table."""
    out = []
    for c in check.columns:
        if c.name == schema.target.name and schema.target.is_class:
            labels = ", ".join(f"{k!r} {v}" for k, v in sorted(c.labels.items()))
            text = f"{c.values} label(s): {labels or 'none'}"
        else:
            lo, hi = ((schema.target.min, schema.target.max) if c.name == schema.target.name
                      else next((f.min, f.max) for f in schema.features if f.name == c.name))
            text = (f"{c.values - c.not_numbers} number(s), {c.outside} outside [{lo:g}, {hi:g}] "
                    f"({100 * c.outside_share:.1f} %, clipped on a device)")
            if c.not_numbers:
                text += f", {c.not_numbers} not a number"
        if c.empty:
            text += f", {c.empty} empty"
        out.append((c.name, text))
    return out
