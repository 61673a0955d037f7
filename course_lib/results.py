"""Values that ranks sent back with `cl.publish(name, value)`.

After a cell, `cl.results[name]` is `{rank: value}`, sorted by rank. A later
cell that publishes the same name replaces it.
"""

from __future__ import annotations

from typing import Any

__all__ = ["ledgers", "results"]

results: dict[str, dict[int, Any]] = {}

# The collective ledger of each rank (course_lib/ledger.py) as of the last cell:
# {rank: [{"seq", "op", "group", "shapes", "dtype", "bytes", "start", "end", "async"}, ...]}.
# One-shot cells replace it; persistent ranks accumulate it until the pool restarts.
ledgers: dict[int, list[dict]] = {}
