"""Answer cells for lesson 03's grader tests: the solutions (as in solutions/03_join_solutions.ipynb) and
plausible wrong answers, each of which must lose exactly the points its mistake deserves."""

JOIN_SOLUTION = '''%%exercise 03.join_uneven_training
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.algorithms.join import Join


def train(ddp_model, optimizer, batches, stop_at_first) -> int:
    try:
        with Join([ddp_model], throw_on_early_termination=stop_at_first):
            for inputs, targets in batches:
                optimizer.zero_grad()
                F.mse_loss(ddp_model(inputs), targets).backward()
                optimizer.step()
    except RuntimeError:
        if not stop_at_first:
            raise
    world = dist.get_world_size()
    key = torch.tensor([len(batches) * world + dist.get_rank()])
    dist.all_reduce(key, op=dist.ReduceOp.MIN)
    return int(key.item()) % world
'''

# The plain loop: the rank with fewer batches leaves while the others wait in DDP's all-reduce.
JOIN_MISSING = '''%%exercise 03.join_uneven_training
import torch.nn.functional as F


def train(ddp_model, optimizer, batches, stop_at_first) -> int:
    for inputs, targets in batches:
        optimizer.zero_grad()
        F.mse_loss(ddp_model(inputs), targets).backward()
        optimizer.step()
    return 0
'''

# Divides each step's sum by the ranks still training: another training than DDP's default.
JOIN_DIVIDES_BY_ACTIVE = JOIN_SOLUTION.replace("Join([ddp_model], throw_on_early_termination=stop_at_first)",
                                               "Join([ddp_model], throw_on_early_termination=stop_at_first, "
                                               "divide_by_initial_world_size=False)")

# Never stops early: the ranks that ran out shadow the others to the end.
JOIN_NEVER_STOPS = JOIN_SOLUTION.replace("throw_on_early_termination=stop_at_first",
                                         "throw_on_early_termination=False")

# Only a rank that ran out knows it (from its exception); the others return None.
JOIN_ONLY_THE_RANK_OUT_KNOWS = '''%%exercise 03.join_uneven_training
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.algorithms.join import Join


def train(ddp_model, optimizer, batches, stop_at_first) -> int:
    first = None
    try:
        with Join([ddp_model], throw_on_early_termination=stop_at_first):
            for inputs, targets in batches:
                optimizer.zero_grad()
                F.mse_loss(ddp_model(inputs), targets).backward()
                optimizer.step()
    except RuntimeError as error:
        if "exhausted all inputs" in str(error) and str(error).startswith("Rank"):
            first = dist.get_rank()
    return first
'''

# Reports with MAX: on a tie, the highest of the ranks that ran out together.
JOIN_HIGHEST_ON_TIE = JOIN_SOLUTION.replace(
    "    key = torch.tensor([len(batches) * world + dist.get_rank()])\n",
    "    key = torch.tensor([len(batches) * world + world - 1 - dist.get_rank()])\n").replace(
    "    return int(key.item()) % world\n", "    return world - 1 - int(key.item()) % world\n")

COUNTER_SOLUTION = '''%%exercise 03.counting_joinable
import torch
import torch.distributed as dist
from torch.distributed.algorithms.join import Join, Joinable, JoinHook


class CounterJoinHook(JoinHook):
    def __init__(self, counter):
        self.counter = counter

    def main_hook(self) -> None:
        """On a joined rank, once per iteration of the ranks still running."""
        group = self.counter.join_process_group
        sums = torch.zeros(2)  # no call, no value: leaves the sums alone
        peak = torch.tensor([float("-inf")])  # never wins a maximum (0 would, against negative values)
        dist.all_reduce(sums, group=group)
        dist.all_reduce(peak, op=dist.ReduceOp.MAX, group=group)
        self.counter.count += sums[0].item()  # what the others found, so this rank stays up to date
        self.counter.total += sums[1].item()
        self.counter.peak = max(self.counter.peak, peak.item())

    def post_hook(self, is_last_joiner: bool) -> None:
        """On every rank, once all have joined."""
        self.counter.is_last_joiner = is_last_joiner


class Counter(Joinable):
    def __init__(self):
        super().__init__()
        self.count, self.total, self.peak = 0.0, 0.0, float("-inf")
        self.is_last_joiner = None

    def __call__(self, value: float) -> None:
        """One iteration, with this rank's value."""
        Join.notify_join_context(self)  # before this iteration's collectives: "I have not joined"
        group = self.join_process_group
        sums = torch.tensor([1.0, value])  # one call, its value
        peak = torch.tensor([value])
        dist.all_reduce(sums, group=group)
        dist.all_reduce(peak, op=dist.ReduceOp.MAX, group=group)
        self.count += sums[0].item()
        self.total += sums[1].item()
        self.peak = max(self.peak, peak.item())

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
COUNTER_NO_NOTIFY = COUNTER_SOLUTION.replace(
    "        Join.notify_join_context(self)  # before this iteration's collectives: \"I have not joined\"\n", "")

# A joined rank stands in with one call: it counts as taking part in every iteration.
COUNTER_SHADOWS_WITH_ONES = COUNTER_SOLUTION.replace(
    "sums = torch.zeros(2)  # no call, no value: leaves the sums alone", "sums = torch.tensor([1.0, 0.0])")

# A joined rank stands in with zeros for the maximum too: 0 wins against negative values.
COUNTER_PEAK_SHADOWED_WITH_ZERO = COUNTER_SOLUTION.replace(
    "peak = torch.tensor([float(\"-inf\")])  # never wins a maximum (0 would, against negative values)",
    "peak = torch.zeros(1)")

# main_hook makes no collective: the others' all-reduces meet Join's own (zeros), the joined rank stops counting.
COUNTER_SILENT_MAIN_HOOK = COUNTER_SOLUTION[:COUNTER_SOLUTION.index("        group = self.counter.join_process_group")] + \
    "        pass\n\n" + COUNTER_SOLUTION[COUNTER_SOLUTION.index("    def post_hook"):]

# post_hook does not record is_last_joiner.
COUNTER_POST_HOOK_FORGETS = COUNTER_SOLUTION.replace(
    "        self.counter.is_last_joiner = is_last_joiner\n", "        pass\n")

ZERO_SOLUTION = '''%%exercise 03.zero_sharded_checkpoint
import os
import torch
import torch.distributed as dist


def save_shards(optimizer, folder: str) -> None:
    index = {p: i for i, p in enumerate(p for group in optimizer.param_groups for p in group["params"])}
    state = {index[p]: s for p, s in optimizer.optim.state.items()}
    torch.save(state, os.path.join(folder, f"shard_{dist.get_rank()}.pt"))


def load_shards(optimizer, folder: str) -> None:
    state = {}
    for name in sorted(os.listdir(folder)):
        state.update(torch.load(os.path.join(folder, name)))
    groups, start = [], 0
    for group in optimizer.param_groups:
        groups.append({**{k: v for k, v in group.items() if k != "params"},
                       "params": list(range(start, start + len(group["params"])))})
        start += len(group["params"])
    optimizer.load_state_dict({"state": state, "param_groups": groups})
'''

LOAD_WHOLE = '''

def load_shards(optimizer, folder: str) -> None:
    optimizer.load_state_dict(torch.load(os.path.join(folder, "whole.pt")))
'''

# Lesson 03's way: gather on rank 0, which writes one plain optimizer's file, loaded on every rank. It resumes
# right, on any number of ranks; but saving is a collective: rank 0 receives every share.
ZERO_CONSOLIDATES = '''%%exercise 03.zero_sharded_checkpoint
import os
import torch
import torch.distributed as dist


def save_shards(optimizer, folder: str) -> None:
    optimizer.consolidate_state_dict(to=0)
    if dist.get_rank() == 0:
        torch.save(optimizer.state_dict(), os.path.join(folder, "whole.pt"))
''' + LOAD_WHOLE

# Consolidates on rank 0 only: consolidate_state_dict is a collective, rank 0 waits for the others' shares.
ZERO_CONSOLIDATE_ON_RANK_0 = ZERO_CONSOLIDATES.replace(
    "    optimizer.consolidate_state_dict(to=0)\n    if dist.get_rank() == 0:\n",
    "    if dist.get_rank() == 0:\n        optimizer.consolidate_state_dict(to=0)\n")

# Saves the inner optimizer's state dict: its indices (0, 1, ...) are the rank's own, so the merged state
# puts one parameter's moments on another.
ZERO_LOCAL_INDEX = ZERO_SOLUTION.replace(
    '''    index = {p: i for i, p in enumerate(p for group in optimizer.param_groups for p in group["params"])}
    state = {index[p]: s for p, s in optimizer.optim.state.items()}
''', '''    state = optimizer.optim.state_dict()["state"]
''')

# Each rank reads only the file it wrote: right on the same ranks, wrong when the owners change.
ZERO_OWN_FILE_ONLY = ZERO_SOLUTION.replace(
    '''    for name in sorted(os.listdir(folder)):
        state.update(torch.load(os.path.join(folder, name)))
''', '''    mine = os.path.join(folder, f"shard_{dist.get_rank()}.pt")
    if os.path.exists(mine):
        state.update(torch.load(mine))
''')

# Only rank 0 saves (its share): the others' state is lost.
ZERO_RANK_0_SAVES = ZERO_SOLUTION.replace(
    '''    torch.save(state, os.path.join(folder, f"shard_{dist.get_rank()}.pt"))
''', '''    if dist.get_rank() == 0:
        torch.save(state, os.path.join(folder, f"shard_{dist.get_rank()}.pt"))
''')

# Loads nothing: the new optimizer starts Adam from zero moments.
ZERO_LOADS_NOTHING = ZERO_SOLUTION[:ZERO_SOLUTION.index("def load_shards")] + '''def load_shards(optimizer, folder: str) -> None:
    pass
'''

ZERO1_SOLUTION = '''%%exercise 03.zero1_by_hand
import torch
import torch.distributed as dist


class ShardedOptimizer:
    def __init__(self, params, optimizer_class, **defaults):
        self.params = list(params)
        world, rank = dist.get_world_size(), dist.get_rank()
        sizes = [0] * world
        self.owner = {}
        for p in sorted(self.params, key=lambda t: t.numel(), reverse=True):
            least = sizes.index(min(sizes))
            self.owner[p] = least
            sizes[least] += p.numel()
        self.optim = optimizer_class([p for p in self.params if self.owner[p] == rank], **defaults)

    def zero_grad(self) -> None:
        for p in self.params:
            p.grad = None

    @torch.no_grad()
    def step(self) -> None:
        world = dist.get_world_size()
        trained = [p for p in self.params if p.grad is not None]
        for p in trained:
            dist.all_reduce(p.grad)
            p.grad.div_(world)
        self.optim.step()
        for p in trained:
            dist.broadcast(p, src=self.owner[p])
'''

# Averages every parameter's gradient, a frozen one's (None) too: all_reduce refuses None, the model with a
# frozen parameter raises (the solution this exercise had once).
ZERO1_NONE_GRADIENT = ZERO1_SOLUTION.replace(
    "        trained = [p for p in self.params if p.grad is not None]\n", "").replace(
    "        for p in trained:\n", "        for p in self.params:\n")
assert ZERO1_NONE_GRADIENT.count("for p in self.params:") == 3

# Splits only the parameters that train: right parameters, but not ZeroRedundancyOptimizer's owners.
ZERO1_SPLITS_TRAINABLE_ONLY = ZERO1_SOLUTION.replace(
    "        self.params = list(params)\n", "        self.params = [p for p in params if p.requires_grad]\n")
assert ZERO1_SPLITS_TRAINABLE_ONLY != ZERO1_SOLUTION

# Every rank builds the inner optimizer over every parameter: right parameters, the state not sharded.
ZERO1_STEPS_EVERYTHING = ZERO1_SOLUTION.replace(
    "optimizer_class([p for p in self.params if self.owner[p] == rank], **defaults)",
    "optimizer_class(self.params, **defaults)")

# No broadcast: each rank's copies of the others' parameters never change.
ZERO1_NO_BROADCAST = ZERO1_SOLUTION.replace(
    "        for p in trained:\n            dist.broadcast(p, src=self.owner[p])\n", "")
assert ZERO1_NO_BROADCAST != ZERO1_SOLUTION

# Gradients not averaged: each owner steps with the gradient of its own rows.
ZERO1_NOT_AVERAGED = ZERO1_SOLUTION.replace(
    "            dist.all_reduce(p.grad)\n            p.grad.div_(world)\n", "            pass\n")

# Summed, not divided: Adam hardly notices (its step is scale-free), SGD steps N times too far.
ZERO1_SUMMED = ZERO1_SOLUTION.replace("            p.grad.div_(world)\n", "")

# Round-robin in the parameters' order instead of the greedy split by size.
ZERO1_ROUND_ROBIN = ZERO1_SOLUTION.replace(
    "        for p in sorted(self.params, key=lambda t: t.numel(), reverse=True):\n"
    "            least = sizes.index(min(sizes))\n",
    "        for index, p in enumerate(self.params):\n            least = index % world\n")

# torch's own ZeroRedundancyOptimizer wrapped: what the exercise asks to build, refused by the checker.
ZERO1_WRAPS_TORCHS = '''%%exercise 03.zero1_by_hand
import torch.distributed as dist
from torch.distributed.optim import ZeroRedundancyOptimizer


class ShardedOptimizer:
    def __init__(self, params, optimizer_class, **defaults):
        self.params = list(params)
        self.zero = ZeroRedundancyOptimizer(self.params, optimizer_class=optimizer_class, **defaults)
        self.optim = self.zero.optim

    def zero_grad(self) -> None:
        self.zero.zero_grad()

    def step(self) -> None:
        for p in self.params:
            dist.all_reduce(p.grad)
            p.grad.div_(dist.get_world_size())
        self.zero.step()
'''
