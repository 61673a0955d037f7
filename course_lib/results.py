"""Values that ranks sent back with `cl.publish(name, value)`.

After a cell, `cl.results[name]` is `{rank: value}`, sorted by rank. A later
cell that publishes the same name replaces it.
"""

from __future__ import annotations

from typing import Any

__all__ = ["results"]

results: dict[str, dict[int, Any]] = {}
