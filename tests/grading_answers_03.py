"""Answer cells for lesson 03's grader tests: the solutions (as in solutions/03_join.ipynb) and
plausible wrong answers, each of which must lose exactly the points its mistake deserves."""

JOIN_SOLUTION = '''%%exercise 03.join_uneven_training
import torch
import torch.nn.functional as F
from torch.distributed.algorithms.join import Join


def train(ddp_model, optimizer, batches) -> None:
    with Join([ddp_model]):
        for inputs, targets in batches:
            optimizer.zero_grad()
            F.mse_loss(ddp_model(inputs), targets).backward()
            optimizer.step()
'''

# The plain loop: the rank with fewer batches leaves while the others wait in DDP's all-reduce.
JOIN_MISSING = '''%%exercise 03.join_uneven_training
import torch.nn.functional as F


def train(ddp_model, optimizer, batches) -> None:
    for inputs, targets in batches:
        optimizer.zero_grad()
        F.mse_loss(ddp_model(inputs), targets).backward()
        optimizer.step()
'''

# Divides each step's sum by the ranks still training: another training than DDP's default.
JOIN_DIVIDES_BY_ACTIVE = JOIN_SOLUTION.replace("Join([ddp_model])",
                                               "Join([ddp_model], divide_by_initial_world_size=False)")

# Join switched off: the plain loop again.
JOIN_DISABLED = JOIN_SOLUTION.replace("Join([ddp_model])", "Join([ddp_model], enable=False)")

COUNTER_SOLUTION = '''%%exercise 03.counting_joinable
import torch
import torch.distributed as dist
from torch.distributed.algorithms.join import Join, Joinable, JoinHook


class CounterJoinHook(JoinHook):
    def __init__(self, counter):
        self.counter = counter

    def main_hook(self) -> None:
        zeros = torch.zeros(1, device=self.counter.join_device)
        dist.all_reduce(zeros, group=self.counter.join_process_group)
        self.counter.count += zeros

    def post_hook(self, is_last_joiner: bool) -> None:
        self.counter.is_last_joiner = is_last_joiner


class Counter(Joinable):
    def __init__(self):
        super().__init__()
        self.count = torch.zeros(1)
        self.is_last_joiner = None

    def __call__(self) -> None:
        Join.notify_join_context(self)
        ones = torch.ones(1, device=self.join_device)
        dist.all_reduce(ones, group=self.join_process_group)
        self.count += ones

    def join_hook(self, **kwargs) -> JoinHook:
        return CounterJoinHook(self)

    @property
    def join_device(self) -> torch.device:
        return torch.device("cpu")

    @property
    def join_process_group(self):
        return dist.group.WORLD
'''

# Never tells Join that this rank is still iterating: Join's all-reduces meet the counter's.
COUNTER_NO_NOTIFY = COUNTER_SOLUTION.replace("        Join.notify_join_context(self)\n", "")

# A joined rank all-reduces ones: it counts as taking part in every iteration.
COUNTER_SHADOWS_WITH_ONES = COUNTER_SOLUTION.replace(
    "zeros = torch.zeros(1, device=self.counter.join_device)", "zeros = torch.ones(1, device=self.counter.join_device)")

# main_hook makes no collective: the other ranks' all-reduces are matched by Join's own.
COUNTER_SILENT_MAIN_HOOK = COUNTER_SOLUTION.replace(
    "        zeros = torch.zeros(1, device=self.counter.join_device)\n"
    "        dist.all_reduce(zeros, group=self.counter.join_process_group)\n"
    "        self.counter.count += zeros\n", "        pass\n")

# post_hook does not record is_last_joiner.
COUNTER_POST_HOOK_FORGETS = COUNTER_SOLUTION.replace(
    "        self.counter.is_last_joiner = is_last_joiner\n", "        pass\n")

ZERO_SOLUTION = '''%%exercise 03.zero_consolidate_save
import torch
import torch.distributed as dist


def save_optimizer(optimizer, path: str) -> None:
    optimizer.consolidate_state_dict(to=0)
    if dist.get_rank() == 0:
        torch.save(optimizer.state_dict(), path)
'''

# Saves without consolidating: state_dict() raises on rank 0.
ZERO_NO_CONSOLIDATE = ZERO_SOLUTION.replace("    optimizer.consolidate_state_dict(to=0)\n", "")

# Consolidates on rank 0 only: consolidate_state_dict is a collective, rank 0 waits for the others' shards.
ZERO_CONSOLIDATE_ON_RANK_0 = '''%%exercise 03.zero_consolidate_save
import torch
import torch.distributed as dist


def save_optimizer(optimizer, path: str) -> None:
    if dist.get_rank() == 0:
        optimizer.consolidate_state_dict(to=0)
        torch.save(optimizer.state_dict(), path)
'''

# Saves on every rank: only rank 0 holds the consolidated state, the others' state_dict() raises.
ZERO_SAVES_ON_EVERY_RANK = ZERO_SOLUTION.replace(
    "    if dist.get_rank() == 0:\n        torch.save(optimizer.state_dict(), path)\n",
    "    torch.save(optimizer.state_dict(), path)\n")

# Saves the local optimizer's state: rank 0's shard only.
ZERO_SAVES_LOCAL_SHARD = '''%%exercise 03.zero_consolidate_save
import torch
import torch.distributed as dist


def save_optimizer(optimizer, path: str) -> None:
    if dist.get_rank() == 0:
        torch.save(optimizer.optim.state_dict(), path)
'''
