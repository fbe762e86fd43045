"""Generated blocks inside hand-written markdown: `<!-- NAME:begin -->` … `<!-- NAME:end -->`."""

from __future__ import annotations

from pathlib import Path


def markers(name: str) -> tuple[str, str]:
    """The begin and end comments of block `name`."""
    return f"<!-- {name}:begin -->", f"<!-- {name}:end -->"


def replace_block(md: Path, name: str, generated: str) -> bool:
    """Replace block `name` in `md` by `generated`; False (file untouched) if it has no block."""
    begin, end = markers(name)
    text = md.read_text(encoding="utf-8") if md.exists() else ""
    if begin not in text or end not in text:
        return False
    head, rest = text.split(begin, 1)
    md.write_text(f"{head}{begin}\n{generated.rstrip()}\n{end}{rest.split(end, 1)[1]}",
                  encoding="utf-8")
    return True
