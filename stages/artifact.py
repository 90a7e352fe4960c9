"""What a stage shows in the Prefect UI beyond its memory table, said by its Result, published by the flow.

stages/ never imports Prefect: a Result's `artifacts()` returns these plain records, and flows/ turns each into
`create_table_artifact` (table) or `create_markdown_artifact` (markdown). Keys are Prefect's: [a-z0-9-].
"""

from __future__ import annotations

import re
from dataclasses import dataclass


@dataclass(frozen=True)
class Artifact:
    key: str
    description: str
    table: list[dict] | None = None
    markdown: str | None = None

    def __post_init__(self) -> None:
        if not re.fullmatch(r"[a-z0-9-]+", self.key):
            raise ValueError(f"artifact key {self.key!r}: Prefect takes lowercase letters, digits and dashes only")
        if (self.table is None) == (self.markdown is None):
            raise ValueError(f"artifact {self.key}: exactly one of table or markdown")
