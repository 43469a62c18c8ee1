"""Markdown pieces the report writes."""

from __future__ import annotations


def table(head: list[str], body: list[list[str]]) -> list[str]:
    """A pipe table's lines, then a blank line."""
    return [
        "| " + " | ".join(head) + " |",
        "|" + "---|" * len(head),
        *["| " + " | ".join(row) + " |" for row in body],
        "",
    ]
