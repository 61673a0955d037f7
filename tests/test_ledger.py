"""The collective ledger: what a rank records, and how the kernel reads it back.

Recording runs in a fresh interpreter with a real one-rank gloo group, so the
patched torch.distributed never leaks into the test process.
"""

import json
import subprocess
import sys
import textwrap

from course_lib.launcher.diagnosis import cell_line, describe_stuck, importing, rank_state, rank_where
from course_lib.rank.ledger import LedgerReader, read_ledger

RECORD_SCRIPT = textwrap.dedent("""
    import sys, torch, torch.distributed as dist
    from course_lib.rank import ledger
    ledger.install(sys.argv[1])
    dist.init_process_group("gloo", init_method="tcp://127.0.0.1:0", rank=0, world_size=1)
    x = torch.ones(1024)
    dist.all_reduce(x)
    dist.broadcast(x, 0)
    out = [torch.zeros(1024, dtype=torch.float64)]
    dist.all_gather(out, torch.ones(1024, dtype=torch.float64))
    dist.all_gather_object([None], {"a": 1})   # calls all_gather inside: recorded once
    work = dist.all_reduce(x, async_op=True)
    work.wait()
    dist.barrier()
    try:
        dist.all_reduce(x, op=dist.ReduceOp.BAND)  # bitwise AND of floats: refused inside, recorded as raised
    except Exception:
        pass
    pair = dist.new_group([0])
    dist.all_reduce(x, group=pair)
    dist.destroy_process_group()
""")


def test_ledger_records_each_call_once_with_op_shape_dtype_bytes(tmp_path):
    path = tmp_path / "ledger.jsonl"
    subprocess.run([sys.executable, "-c", RECORD_SCRIPT, str(path)], check=True, timeout=120)
    entries = read_ledger(str(path))
    summary = [(e["op"], e["seq"], e["group"], e["shapes"], e["dtype"], e["bytes"], e["async"]) for e in entries]
    assert summary == [
        ("all_reduce", 1, "world", [[1024]], "float32", 4096, False),
        ("broadcast", 2, "world", [[1024]], "float32", 4096, False),
        ("all_gather", 3, "world", [[1024]], "float64", 8192, False),
        ("all_gather_object", 4, "world", [], None, 0, False),
        ("all_reduce", 5, "world", [[1024]], "float32", 4096, True),
        ("barrier", 6, "world", [], None, 0, False),
        ("all_reduce", 7, "world", [[1024]], "float32", 4096, False),
        ("all_reduce", 1, "ranks 0", [[1024]], "float32", 4096, False),
    ]
    assert all(e["end"] is not None and e["end"] >= e["start"] for e in entries)
    assert [e["error"] for e in entries] == [None] * 6 + ["RuntimeError", None]
    for line in path.read_text().splitlines():
        json.loads(line)  # every line is valid JSON


FLAT_COLLECTIVES_SCRIPT = textwrap.dedent("""
    import sys, torch, torch.distributed as dist
    from course_lib.rank import ledger
    ledger.install(sys.argv[1])
    dist.init_process_group("gloo", init_method="tcp://127.0.0.1:0", rank=0, world_size=1)
    out = torch.zeros(6)
    dist.all_gather_into_tensor(out, torch.ones(6))     # torch 2.13: a wrapper of all_gather_single
    if hasattr(dist, "all_gather_single"):              # what FSDP2 calls
        dist.all_gather_single(out, torch.ones(6))
        dist.reduce_scatter_single(torch.zeros(3), torch.ones(3))
    dist.destroy_process_group()
""")


def test_flat_collectives_fsdp_uses_are_recorded_once(tmp_path):
    # FSDP1/FSDP2 all-gather and reduce-scatter through the *_single functions; a ledger
    # that missed them would show an FSDP training step with no communication at all.
    import torch.distributed as dist

    path = str(tmp_path / "ledger.jsonl")
    subprocess.run([sys.executable, "-c", FLAT_COLLECTIVES_SCRIPT, path], check=True, timeout=120)
    summary = [(e["op"], e["call"], e["bytes"]) for e in read_ledger(path)]
    # One name per collective whatever torch calls it (the deprecated wrapper included); the call as made.
    expected = [("all_gather_single", "all_gather_into_tensor", 24)]
    if hasattr(dist, "all_gather_single"):
        expected += [("all_gather_single", "all_gather_single", 24), ("reduce_scatter_single", "reduce_scatter_single", 12)]
    assert summary == expected


WRAPPED_SCRIPT = textwrap.dedent("""
    import sys, torch.distributed as dist, torch.distributed.distributed_c10d as c10d
    from course_lib.rank import ledger
    from course_lib.vocabulary import RECORDED_OPS
    ledger.install(sys.argv[1])
    ledger.install(sys.argv[1])  # idempotent: nothing wrapped twice
    for name in RECORDED_OPS:
        for module in (dist, c10d):
            fn = getattr(module, name, None)
            if fn is not None:
                assert fn.__course_lib_ledger__ and not getattr(fn.__wrapped__, "__course_lib_ledger__", False), name
    print(sum(hasattr(dist, name) for name in RECORDED_OPS))
""")


def test_install_wraps_every_recorded_op_once(tmp_path):
    import torch

    from course_lib.vocabulary import OPS_SINCE, RECORDED_OPS

    version = tuple(int(part) for part in torch.__version__.split(".")[:2])
    here = [name for name in RECORDED_OPS if name not in OPS_SINCE or version >= OPS_SINCE[name]]
    done = subprocess.run([sys.executable, "-c", WRAPPED_SCRIPT, str(tmp_path / "ledger.jsonl")], check=True,
                          timeout=120, capture_output=True, text=True)
    assert int(done.stdout) == len(here)  # every recorded op this torch has (tests/test_vocabulary.py)


def test_reader_parses_only_new_lines_and_waits_for_a_cut_line(tmp_path):
    path = tmp_path / "ledger.jsonl"
    reader = LedgerReader(str(path))
    assert reader.read() == []  # no file yet
    start = '{"seq":1,"op":"all_reduce","group":"world","shapes":[[2]],"dtype":"float32","bytes":8,"start":1.0,"async":false}\n'
    path.write_text(start + '{"seq":1,"group":"world","end":2.')  # the end line is cut mid-write
    assert [(e["op"], e["end"]) for e in reader.read()] == [("all_reduce", None)]
    with open(path, "a") as handle:
        handle.write('5}\n')
    first = reader.read()
    assert [(e["op"], e["end"]) for e in first] == [("all_reduce", 2.5)]
    offset = reader.offset
    assert reader.read() == first and reader.offset == offset  # nothing new: nothing re-read


def test_diagnosis_names_waiting_and_running_ranks():
    ledgers = {
        0: [{"seq": 7, "op": "all_reduce", "group": "world", "bytes": 4096, "end": None, "async": False}],
        1: [{"seq": 6, "op": "broadcast", "group": "world", "bytes": 0, "end": 3.0, "async": False}],
        2: [{"seq": 7, "op": "all_reduce", "group": "world", "bytes": 4096, "end": None, "async": False}],
    }
    stacks = {0: "", 1: 'Current thread (most recent call first):\n  File "<cell>", line 12 in <module>\n', 2: ""}
    assert describe_stuck(ledgers, stacks) == [
        "ranks 0, 2 are waiting in all_reduce #7 (4 KiB, world group)",
        "rank 1 last completed broadcast #6 (world group) and is running Python at cell line 12",
    ]


def test_diagnosis_says_when_the_last_collective_raised():
    ledgers = {1: [{"seq": 3, "op": "all_reduce", "group": "world", "bytes": 8, "end": 2.0, "async": False,
                    "error": "RuntimeError"}]}
    stacks = {1: '  File "<cell>", line 5 in <module>\n'}
    assert describe_stuck(ledgers, stacks) == [
        "rank 1 is running Python at cell line 5, after all_reduce #3 (8 B, world group) raised RuntimeError"
    ]


def test_cell_line_reads_the_innermost_cell_frame_of_the_main_thread():
    stack = ('Thread 0x1 (most recent call first):\n  File "<cell>", line 99 in helper\n\n'
             'Current thread 0x2 (most recent call first):\n  File "/x/torch/c10d.py", line 5 in all_reduce\n'
             '  File "<cell>", line 4 in <module>\n')
    assert cell_line(stack) == 4
    assert cell_line("no frames") is None


# A rank's stack while its cell's line 2 runs `import torch` (faulthandler's shape, frames named short).
IMPORTING_TORCH = """Current thread (most recent call first):
  File "<frozen importlib._bootstrap_external>", line 1659 in _fill_cache
  File "<frozen importlib._bootstrap>", line 1176 in _find_and_load
  File "numpy/__init__.py", line 457 in <module>
  File "<frozen importlib._bootstrap>", line 1176 in _find_and_load
  File "torch/__init__.py", line 445 in <module>
  File "<frozen importlib._bootstrap_external>", line 940 in exec_module
  File "<frozen importlib._bootstrap>", line 1176 in _find_and_load
  File "<cell>", line 2 in <module>
"""
WAITING = {"seq": 3, "op": "all_reduce", "group": "world", "bytes": 12, "end": None, "async": False}
DONE = {"seq": 2, "op": "broadcast", "group": "world", "bytes": 0, "end": 1.0, "async": False}


def test_importing_names_the_module_the_cell_line_imports():
    assert importing(IMPORTING_TORCH) == "torch"  # not numpy, which torch imports
    assert importing('  File "/home/me/work/helpers.py", line 3 in <module>\n'
                     '  File "<frozen importlib._bootstrap>", line 1176 in _find_and_load\n'
                     '  File "<cell>", line 5 in <module>\n') == "helpers"
    assert importing('  File "<frozen importlib._bootstrap>", line 1078 in _find_spec\n'
                     '  File "<cell>", line 5 in <module>\n') == ""  # its file not found yet
    assert importing('  File "torch/distributed/distributed_c10d.py", line 3252 in all_reduce\n'
                     '  File "<cell>", line 8 in <module>\n') is None
    assert importing("") is None


def test_a_rank_importing_before_any_collective_is_starting_up_not_stuck():
    assert describe_stuck({0: [], 1: []}, {0: IMPORTING_TORCH, 1: IMPORTING_TORCH}) == [
        "ranks 0, 1 are still starting up (importing torch at cell line 2)"]
    # After a collective, an import is only what the rank does at that line.
    assert describe_stuck({0: [DONE]}, {0: IMPORTING_TORCH}) == [
        "rank 0 last completed broadcast #2 (world group) and is importing torch at cell line 2"]


def test_rank_where_says_where_an_interrupted_rank_was():
    in_collective = ('Current thread (most recent call first):\n'
                     '  File "torch/distributed/distributed_c10d.py", line 3252 in all_reduce\n'
                     '  File "<cell>", line 12 in <module>\n')
    assert rank_where([DONE, WAITING], in_collective) == "at cell line 12, waiting in all_reduce #3 (12 B, world group)"
    assert rank_where([], IMPORTING_TORCH) == "starting up (importing torch at cell line 2)"
    assert rank_where([DONE], IMPORTING_TORCH) == "at cell line 2, importing torch, after broadcast #2 (world group)"
    assert rank_where([], '  File "<cell>", line 7 in <module>\n') == "at cell line 7, before any collective"
    assert rank_where([], None) == "starting up (before the cell's first line)"  # no stack: the hook not yet in
    assert rank_where([], '  File "course_lib/rank/__init__.py", line 9 in _destroy_if_open\n') == (
        "outside the cell (before its first line or after its last), before any collective")


BATCH_P2P_SCRIPT = textwrap.dedent("""
    import sys, torch, torch.distributed as dist
    from course_lib.rank import ledger
    rank = int(sys.argv[2])
    ledger.install(sys.argv[1])
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{sys.argv[3]}", rank=rank, world_size=2)
    small, large = torch.ones(4), torch.zeros(8, dtype=torch.float64)   # 16 B and 64 B
    mine, theirs = (small, large) if rank == 0 else (large, small)
    incoming = torch.empty_like(theirs)
    for work in dist.batch_isend_irecv([dist.P2POp(dist.isend, mine, 1 - rank),
                                        dist.P2POp(dist.irecv, incoming, 1 - rank)]):
        work.wait()
    assert torch.equal(incoming, theirs)
    dist.destroy_process_group()
""")


def test_batch_isend_irecv_records_its_ops_bytes_and_peers(tmp_path):
    import socket

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    ranks = [subprocess.Popen([sys.executable, "-c", BATCH_P2P_SCRIPT, str(tmp_path / f"ledger{r}.jsonl"), str(r),
                               str(port)]) for r in (0, 1)]
    try:
        assert [rank.wait(timeout=120) for rank in ranks] == [0, 0]
    finally:
        for rank in ranks:
            rank.kill()  # by the PID we started; a no-op for one that ended
    for rank, (sent, received) in enumerate([(16, 64), (64, 16)]):
        [entry] = read_ledger(str(tmp_path / f"ledger{rank}.jsonl"))
        assert entry["op"] == "batch_isend_irecv" and entry["bytes"] == sent + received
        assert entry["ops"] == [["isend", 1 - rank, sent], ["irecv", 1 - rank, received]]


def test_a_rank_inside_a_wrapped_work_wait_is_waiting_for_its_posted_transfer():
    # A grader's driver (lesson 09) wraps Work.wait in Python, so the wait shows as the innermost frame.
    posted = {"seq": 1, "op": "batch_isend_irecv", "group": "world", "bytes": 2048, "end": 1.0, "async": True}
    stack = ('Current thread 0x2 (most recent call first):\n'
             '  File "/x/course_lib/grading/lessons/lesson09/drivers.py", line 58 in wait\n'
             '  File "<cell>", line 36 in ring_attention_online\n')
    assert rank_state([posted], stack) == ("{be} waiting in wait() at cell line 36, on a transfer posted by "
                                           "batch_isend_irecv #1 (2 KiB, world group) or earlier")
    computing = stack.replace(' in wait\n', ' in helper\n')
    assert rank_state([posted], computing).startswith("last completed batch_isend_irecv #1")
    # Any other Python wait (threading's, a future's result) is not a transfer's.
    threading_wait = stack.replace("/x/course_lib/grading/lessons/lesson09/drivers.py", "/usr/lib/python3.11/threading.py")
    assert "waiting in wait()" not in rank_state([posted], threading_wait)
