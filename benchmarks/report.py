"""Markdown tables for benchmarks/results/*.md, and writing a result's pair of files."""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path


def write_results(out: str | Path, name: str, summary: dict, markdown: str) -> None:
    """<out>/<name>.json (the summary) and <out>/<name>.md, the folder made if needed."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{name}.json").write_text(json.dumps(summary, indent=2) + "\n")
    (out / f"{name}.md").write_text(markdown)


def markdown_table(rows: list[dict], columns: Sequence[tuple[str, str, str]]) -> str:
    """One row per dict; ``columns`` are (title, key, format string such as "{:.2f}")."""
    lines = ["| " + " | ".join(title for title, _, _ in columns) + " |", "|" + "---|" * len(columns)]
    for row in rows:
        lines.append("| " + " | ".join(fmt.format(row[key]) for _, key, fmt in columns) + " |")
    return "\n".join(lines)
