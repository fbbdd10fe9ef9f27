"""Markdown tables for benchmarks/results/*.md."""

from __future__ import annotations

from collections.abc import Sequence


def markdown_table(rows: list[dict], columns: Sequence[tuple[str, str, str]]) -> str:
    """One row per dict; ``columns`` are (title, key, format string such as "{:.2f}")."""
    lines = ["| " + " | ".join(title for title, _, _ in columns) + " |", "|" + "---|" * len(columns)]
    for row in rows:
        lines.append("| " + " | ".join(fmt.format(row[key]) for _, key, fmt in columns) + " |")
    return "\n".join(lines)
