"""torchrun for multinode.sh: the same agent (`torch.distributed.run`), with the waiting said and its failures in one line.

    python launch/agent.py TORCHRUN_FLAGS... SCRIPT.py [ARGS...]     (multinode.sh runs this; torchrun's own flags)

What a learner meets before training starts, which torchrun answers with silence, then a traceback:
- the rendezvous port on this host held by another program (not a torchrun rendezvous): one line at once;
- waiting for the other nodes: one line before, then one every ~15 s until the workers start;
- nodes that never arrive within c10d's `join_timeout` (multinode.sh's JOIN_TIMEOUT): one line naming the endpoint
  and what to check, instead of torch's traceback ending in a bare `RendezvousTimeoutError`.
Everything else (the workers' output, a failed worker's report, restarts) is torchrun's, unchanged.
"""

from __future__ import annotations

import datetime
import errno
import os
import pathlib
import socket
import sys
import threading
import time

from torch.distributed import TCPStore
from torch.distributed.elastic.rendezvous.api import RendezvousConnectionError, RendezvousTimeoutError
from torch.distributed.run import main as torchrun_main
from torch.distributed.run import parse_args

NOTE_EVERY_S = 15  # at most: with a shorter join timeout, twice within it


def say(line: str) -> None:
    print(f"multinode.sh: {line}", file=sys.stderr, flush=True)


def join_timeout(rdzv_conf: str) -> int:
    """c10d's join_timeout from torchrun's --rdzv-conf (k=v,k=v); 600 s, c10d's default, if not there."""
    conf = dict(item.split("=", 1) for item in rdzv_conf.split(",") if "=" in item)
    return int(conf.get("join_timeout", 600))


def is_rendezvous(host: str, port: int, wait_s: float) -> bool:
    """Does a TCPStore (another agent's rendezvous) answer at host:port within wait_s?

    TCPStore's client waits forever on a listener that never answers (its timeout does not cover the
    handshake), so it connects in a daemon thread and is given up on after wait_s.
    """
    answered: list[bool] = []

    def connect():
        try:
            TCPStore(host, port, is_master=False, timeout=datetime.timedelta(seconds=wait_s))
            answered.append(True)
        except Exception:  # refused, reset, or a timeout: not a store that works
            answered.append(False)

    thread = threading.Thread(target=connect, daemon=True)
    thread.start()
    thread.join(wait_s)
    return answered == [True]


def port_problem(endpoint: str) -> str | None:
    """The endpoint's port on this host, taken by a program that is not a rendezvous: one line; else None.

    Free: the first agent will host the rendezvous there. Taken by a rendezvous: another agent (of this job on
    this host, or of another job: c10d's store serves several) hosts it, which is fine. Not this host's
    address: another node hosts it, nothing to check here.
    """
    host, _, port_text = endpoint.rpartition(":")
    host, port = host.strip("[]") or "127.0.0.1", int(port_text or 29400)
    with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET) as s:
        try:
            s.bind((host, port))
            return None
        except socket.gaierror:
            return None  # a name this host cannot resolve: torchrun says so itself
        except OSError as e:
            if e.errno != errno.EADDRINUSE:
                return None  # EADDRNOTAVAIL: not one of this host's addresses
    if is_rendezvous(host, port, wait_s=3):
        return None
    return (f"port {port} at {host} (RDZV_ENDPOINT) is taken by another program, not a torchrun rendezvous: "
            f"pick a free port (the same on every node), e.g. RDZV_ENDPOINT={host}:{port + 1}")


def has_workers() -> bool:
    """Has this agent started its workers (child processes)? Read from /proc (Linux); False elsewhere."""
    me = str(os.getpid())
    for stat in pathlib.Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue  # a process that ended meanwhile
        if fields[1] == me:  # the field after the state is the parent's PID
            return True
    return False


def note_while_waiting(nodes: str, endpoint: str, timeout_s: int) -> None:
    """A line every ~15 s until the workers start or the join timeout has passed (a daemon thread)."""
    every = max(1, min(NOTE_EVERY_S, timeout_s // 2))
    started = time.monotonic()
    while True:
        time.sleep(every)
        waited = time.monotonic() - started
        if has_workers() or waited >= timeout_s:
            return
        say(f"still waiting for {nodes} nodes at {endpoint} ({waited:.0f} of {timeout_s} s)")


def main(argv: list[str]) -> int:
    args = parse_args(argv)
    endpoint, nodes, timeout_s = args.rdzv_endpoint, args.nnodes.replace(":", " to "), join_timeout(args.rdzv_conf)
    if args.rdzv_backend == "c10d":
        if problem := port_problem(endpoint):
            say(problem)
            return 2
        say(f"waiting up to {timeout_s} s for {nodes} nodes at {endpoint}, id {args.rdzv_id}")
        threading.Thread(target=note_while_waiting, args=(nodes, endpoint, timeout_s), daemon=True).start()
    try:
        torchrun_main(argv)
    except RendezvousTimeoutError:
        say(f"no group of {nodes} nodes formed at {endpoint} (id {args.rdzv_id}) within {timeout_s} s: check "
            f"that every node runs multinode.sh with the same NNODES, RDZV_ENDPOINT and RDZV_ID, that the host "
            f"name resolves on every node and its port is open between them (a firewall); JOIN_TIMEOUT waits longer")
        return 1
    except RendezvousConnectionError:
        say(f"could not reach the rendezvous at {endpoint}: check that the host name resolves here, that "
            f"multinode.sh runs on that host too, and that its port is open between the nodes (a firewall)")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
