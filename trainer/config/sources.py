"""A source of a weighted data mixture: one table of `[[data.sources]]` or `[[validation.sources]]`."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class SourceConfig:
    """One weighted source of a mixture: a table of a `[[data.sources]]` or `[[validation.sources]]` array."""

    path: str = ""
    weight: float = 0.0
    name: str = ""
    text_field: str = ""
    format: str = ""

    def label(self, index: int) -> str:
        """The source's name in messages and metric keys (data/tokens/<name>): `name`, else the last part
        of its path that is no glob pattern, without extension (`source<index>` when nothing is left)."""
        if self.name:
            return self.name
        parts = [p for p in self.path.rstrip("/").split("/") if p and not any(c in p for c in "*?[")]
        stem = parts[-1].split(".")[0] if parts else ""
        return "".join(c if c.isalnum() or c in "_-" else "_" for c in stem) or f"source{index}"

    def option(self, section: str, index: int) -> str:
        """How errors name the source: `data.sources[1] (code)`."""
        return f"{section}.sources[{index}] ({self.label(index)})"


# The keys of a source table; the others come from its section ("" = as data.text_field, data.format).
SOURCE_REQUIRED = ("path", "weight")
