"""Answer cells for the grader's tests: the solutions (as in solutions/01_process_groups_solutions.ipynb)
and plausible wrong answers, each of which must lose exactly the points its mistake deserves."""

RING_SOLUTION = '''%%exercise 01.ring_allreduce
import torch
import torch.distributed as dist


def ring_allreduce(tensor: torch.Tensor) -> None:
    rank, world = dist.get_rank(), dist.get_world_size()
    send_to, recv_from = (rank + 1) % world, (rank - 1) % world
    chunks = torch.tensor_split(tensor.view(-1), world)
    for step in range(world - 1):  # reduce-scatter
        send_index, recv_index = (rank - step) % world, (rank - step - 1) % world
        incoming = torch.empty_like(chunks[recv_index])
        request = dist.isend(chunks[send_index], send_to)
        dist.recv(incoming, recv_from)
        request.wait()
        chunks[recv_index].add_(incoming)
    for step in range(world - 1):  # all-gather
        send_index, recv_index = (rank + 1 - step) % world, (rank - step) % world
        incoming = torch.empty_like(chunks[recv_index])
        request = dist.isend(chunks[send_index], send_to)
        dist.recv(incoming, recv_from)
        request.wait()
        chunks[recv_index].copy_(incoming)
'''

# Float32 buffers whatever the tensor's dtype: right sums, but an int64 tensor leaves in half its bytes.
RING_FLOAT_BUFFERS = (RING_SOLUTION
                      .replace("incoming = torch.empty_like(chunks[recv_index])",
                               "incoming = torch.empty(chunks[recv_index].shape)")
                      .replace("request = dist.isend(chunks[send_index], send_to)",
                               "request = dist.isend(chunks[send_index].float(), send_to)")
                      .replace("chunks[recv_index].add_(incoming)", "chunks[recv_index].add_(incoming.to(tensor.dtype))"))

RING_AVERAGES = RING_SOLUTION + "    tensor /= world\n"

# Passes the whole tensor around the ring, adding what arrives: right sums, (N-1)x the bytes.
RING_WHOLE_TENSOR = '''%%exercise 01.ring_allreduce
import torch
import torch.distributed as dist


def ring_allreduce(tensor):
    rank, world = dist.get_rank(), dist.get_world_size()
    passing = tensor.clone()
    for _ in range(world - 1):
        incoming = torch.empty_like(tensor)
        request = dist.isend(passing, (rank + 1) % world)
        dist.recv(incoming, (rank - 1) % world)
        request.wait()
        tensor.add_(incoming)
        passing = incoming
'''

# Receives from the wrong neighbour: fine on 2 ranks (both neighbours are the same rank), hangs on 4.
RING_WRONG_PEER = RING_SOLUTION.replace("recv_from = (rank + 1) % world, (rank - 1) % world",
                                        "recv_from = (rank + 1) % world, (rank + 1) % world")

# Rank 1 returns at once while rank 0 waits for its message: rank 0 is stuck in the learner's recv,
# rank 1 in the checker's barrier after the function.
RING_RANK_1_RETURNS = '''%%exercise 01.ring_allreduce
import torch.distributed as dist


def ring_allreduce(tensor):
    if dist.get_rank() == 0:
        dist.recv(tensor.clone(), 1)
'''

RING_USES_ALL_REDUCE = '''%%exercise 01.ring_allreduce
import torch.distributed as dist


def ring_allreduce(tensor):
    dist.all_reduce(tensor)
'''

ALLGATHER_SOLUTION = '''%%exercise 01.allgather_from_broadcast
import torch
import torch.distributed as dist


def all_gather_by_broadcast(tensor: torch.Tensor) -> list[torch.Tensor]:
    gathered = []
    for src in range(dist.get_world_size()):
        buffer = tensor.clone() if src == dist.get_rank() else torch.empty_like(tensor)
        dist.broadcast(buffer, src=src)
        gathered.append(buffer)
    return gathered
'''

# One receive buffer, appended every time: every entry ends up as the last rank's tensor.
ALLGATHER_ONE_BUFFER = '''%%exercise 01.allgather_from_broadcast
import torch
import torch.distributed as dist


def all_gather_by_broadcast(tensor):
    gathered, buffer = [], torch.empty_like(tensor)
    for src in range(dist.get_world_size()):
        if src == dist.get_rank():
            buffer.copy_(tensor)
        dist.broadcast(buffer, src=src)
        gathered.append(buffer)
    return gathered
'''

# Broadcasts into the input itself and clones: right list, but the caller's tensor is overwritten.
ALLGATHER_OVERWRITES_INPUT = '''%%exercise 01.allgather_from_broadcast
import torch.distributed as dist


def all_gather_by_broadcast(tensor):
    gathered = []
    for src in range(dist.get_world_size()):
        if src == dist.get_rank():
            mine = tensor.clone()
            dist.broadcast(mine, src=src)
            gathered.append(mine)
        else:
            dist.broadcast(tensor, src=src)
            gathered.append(tensor.clone())
    return gathered
'''

GRID_SOLUTION = '''%%exercise 01.grid_groups
import torch.distributed as dist


def grid_groups(rows: int, cols: int):
    rank = dist.get_rank()
    row_group = col_group = None
    for row in range(rows):  # every rank creates every group, in the same order
        members = [row * cols + col for col in range(cols)]
        group = dist.new_group(members)
        if rank in members:
            row_group = group
    for col in range(cols):
        members = [row * cols + col for row in range(rows)]
        group = dist.new_group(members)
        if rank in members:
            col_group = group
    return row_group, col_group
'''

# Rows and columns swapped: both kinds of group exist, each rank gets the other one.
GRID_SWAPPED = GRID_SOLUTION.replace("return row_group, col_group", "return col_group, row_group")

# Rank 0 waits for a message nobody sends after creating the groups: ranks 1-3 return them and wait
# in the checker's all_gather_object of every rank's group names (drivers.process_groups).
GRID_RANK_0_STUCK = GRID_SOLUTION.replace("    return row_group, col_group", """\
    if rank == 0:
        import torch
        dist.recv(torch.zeros(1), 1)
    return row_group, col_group""")

# Only the members create each group (use_local_synchronization=True, lesson 01 section 6): a right answer
# too, which the statement must not call a hang (review 0001, item 8).
GRID_OWN_GROUPS_ONLY = '''%%exercise 01.grid_groups
import torch.distributed as dist


def grid_groups(rows, cols):
    rank = dist.get_rank()
    row, col = divmod(rank, cols)
    row_group = dist.new_group([row * cols + c for c in range(cols)], use_local_synchronization=True)
    col_group = dist.new_group([r * cols + col for r in range(rows)], use_local_synchronization=True)
    return row_group, col_group
'''

# The classic mistake: a plain new_group for this rank's own row and column only. gloo names such groups by a
# per-process counter, so [0, 1] and [2, 3] share a name and gloo would pair their ranks: a hang or a wrong sum
# from run to run. The check finds the shared name before using the groups, so it fails the same way every time.
GRID_OWN_GROUPS_PLAIN = GRID_OWN_GROUPS_ONLY.replace(", use_local_synchronization=True", "")
