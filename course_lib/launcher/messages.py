"""Messages between the kernel and persistent workers: plain pickle over an authenticated Connection.

`Connection.send` would use multiprocessing's ForkingPickler, for which torch
registers reductions that pass tensors as shared-memory file descriptors
through a separate, differently authenticated channel. Plain pickle copies
the bytes, which is what we want between a kernel and its ranks.
"""

from __future__ import annotations

import pickle
from multiprocessing.connection import Connection
from typing import Any

__all__ = ["receive", "send"]


def send(conn: Connection, message: Any) -> None:
    conn.send_bytes(pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL))


def receive(conn: Connection) -> Any:
    # Only ever called on connections that passed the HMAC challenge (pool.py, pool_worker.py).
    return pickle.loads(conn.recv_bytes())
