"""Answer cells for lesson 08's grader tests: the solutions (as in solutions/08_pipeline_solutions.ipynb) and
plausible wrong answers, each of which must lose exactly the points its mistake deserves."""

GPIPE_SOLUTION = '''%%exercise 08.gpipe
import torch
import torch.distributed as dist


def gpipe_step(stage, inputs, targets, loss_fn, n_microbatches, input_shape):
    rank, world = dist.get_rank(), dist.get_world_size()
    first, last = rank == 0, rank == world - 1
    m = n_microbatches
    xs = inputs.chunk(m) if first else None
    ys = targets.chunk(m) if last else None
    received, outputs, total = [], [], 0.0     # kept until the backwards: the graph lives on them
    for i in range(m):                         # all forwards ...
        if first:
            a = xs[i]
        else:
            a = torch.empty(input_shape[0] // m, *input_shape[1:])   # the receiver knows the shape
            dist.recv(a, src=rank - 1)
            a.requires_grad_()                 # so the backward fills a.grad, which goes back to rank - 1
        out = stage(a)
        if last:
            out = loss_fn(out, ys[i]) / m
            total += out.item()
        else:
            dist.send(out.detach(), dst=rank + 1)   # the values only: the graph stays here
        received.append(a)
        outputs.append(out)
    for i in range(m):                         # ... then all backwards, in the same microbatch order
        grad = None                            # the last rank starts from its loss
        if not last:
            grad = torch.empty_like(outputs[i])
            dist.recv(grad, src=rank + 1)
        torch.autograd.backward(outputs[i], grad)
        if not first:
            dist.send(received[i].grad, dst=rank - 1)
    return total if last else None
'''

# Each microbatch's loss unscaled (the mean returned right): gradients m times one process's.
GPIPE_NO_SCALE = (GPIPE_SOLUTION.replace("out = loss_fn(out, ys[i]) / m", "out = loss_fn(out, ys[i])")
                  .replace("total += out.item()", "total += out.item() / m"))
assert "ys[i]) / m" not in GPIPE_NO_SCALE and "item() / m" in GPIPE_NO_SCALE

# The losses added up and returned as they are: the gradients are right, the loss m times too large.
GPIPE_SUM_RETURNED = GPIPE_SOLUTION.replace("total += out.item()", "total += out.item() * m")
assert GPIPE_SUM_RETURNED != GPIPE_SOLUTION

# The received input never marked as needing a gradient: its .grad is None, and nothing can be sent back.
GPIPE_NO_REQUIRES_GRAD = GPIPE_SOLUTION.replace(
    "            a.requires_grad_()                 # so the backward fills a.grad, which goes back to rank - 1\n", "")
assert "requires_grad_" not in GPIPE_NO_REQUIRES_GRAD

# Forward and backward of each microbatch in turn (gradient accumulation through the pipeline): right values,
# not GPipe's order.
GPIPE_F_B_IN_TURN = '''%%exercise 08.gpipe
import torch
import torch.distributed as dist


def gpipe_step(stage, inputs, targets, loss_fn, n_microbatches, input_shape):
    rank, world = dist.get_rank(), dist.get_world_size()
    first, last = rank == 0, rank == world - 1
    m = n_microbatches
    total = 0.0
    for i in range(m):
        if first:
            a = inputs.chunk(m)[i]
        else:
            a = torch.empty(input_shape[0] // m, *input_shape[1:])
            dist.recv(a, src=rank - 1)
            a.requires_grad_()
        out = stage(a)
        if last:
            loss = loss_fn(out, targets.chunk(m)[i]) / m
            total += loss.item()
            loss.backward()
        else:
            dist.send(out.detach(), dst=rank + 1)
            grad = torch.empty_like(out)
            dist.recv(grad, src=rank + 1)
            out.backward(grad)
        if not first:
            dist.send(a.grad, dst=rank - 1)
    return total if last else None
'''

# No microbatches at all: the whole batch crosses each boundary in one message (the naive split).
GPIPE_WHOLE_BATCH = '''%%exercise 08.gpipe
import torch
import torch.distributed as dist


def gpipe_step(stage, inputs, targets, loss_fn, n_microbatches, input_shape):
    rank, world = dist.get_rank(), dist.get_world_size()
    if rank == 0:
        a = inputs
    else:
        a = torch.empty(input_shape)
        dist.recv(a, src=rank - 1)
        a.requires_grad_()
    out = stage(a)
    if rank == world - 1:
        loss = loss_fn(out, targets)
        loss.backward()
    else:
        dist.send(out.detach(), dst=rank + 1)
        grad = torch.empty_like(out)
        dist.recv(grad, src=rank + 1)
        out.backward(grad)
    if rank > 0:
        dist.send(a.grad, dst=rank - 1)
    return loss.item() if rank == world - 1 else None
'''

ORDER_SOLUTION = '''%%exercise 08.one_f_one_b
def one_f_one_b_order(rank, stages, microbatches):
    # Forwards ahead: one per later stage, the slots before microbatch 0's gradient can come back.
    warm_up = min(stages - 1 - rank, microbatches)
    order = [("F", i) for i in range(warm_up)]
    forward, backward = warm_up, 0
    while forward < microbatches:              # steady state: one forward, then the oldest backward
        order += [("F", forward), ("B", backward)]
        forward += 1
        backward += 1
    return order + [("B", i) for i in range(backward, microbatches)]   # drain
'''

# GPipe's order: every forward first.
ORDER_GPIPE = '''%%exercise 08.one_f_one_b
def one_f_one_b_order(rank, stages, microbatches):
    return [("F", i) for i in range(microbatches)] + [("B", i) for i in range(microbatches)]
'''

# The same warm-up on every rank (stages - 1): later ranks hold more microbatches than 1F1B needs.
ORDER_SAME_WARM_UP = ORDER_SOLUTION.replace("min(stages - 1 - rank, microbatches)", "min(stages - 1, microbatches)")
assert ORDER_SAME_WARM_UP != ORDER_SOLUTION

# The warm-up counted from the wrong end (rank forwards): rank 0 waits for a gradient the last rank sends
# only after a forward that needs rank 0's next activation.
ORDER_WARM_UP_BY_RANK = ORDER_SOLUTION.replace("min(stages - 1 - rank, microbatches)", "min(rank, microbatches)")
assert ORDER_WARM_UP_BY_RANK != ORDER_SOLUTION

# The steady state's pair the other way round: the last rank (no warm-up) starts with B0.
ORDER_B_FIRST = ORDER_SOLUTION.replace('order += [("F", forward), ("B", backward)]',
                                       'order += [("B", backward), ("F", forward)]')
assert ORDER_B_FIRST != ORDER_SOLUTION

BALANCE_SOLUTION = '''%%exercise 08.balance
def balance_stages(layer_costs, stages):
    import itertools

    n = len(layer_costs)
    best = None                                # (cost of the slowest stage, layers per stage)
    # Every cut: stages - 1 positions between layers (the cases are small: at most C(9, 4) = 126 cuts).
    for cut in itertools.combinations(range(1, n), stages - 1):
        bounds = (0, *cut, n)
        slowest = max(sum(layer_costs[a:b]) for a, b in zip(bounds, bounds[1:]))
        if best is None or slowest < best[0]:
            best = (slowest, [b - a for a, b in zip(bounds, bounds[1:])])
    return best[1]
'''

BALANCE_EQUAL_COUNTS = '''%%exercise 08.balance
def balance_stages(layer_costs, stages):
    q, r = divmod(len(layer_costs), stages)
    return [q + (1 if s < r else 0) for s in range(stages)]
'''

BALANCE_GREEDY = '''%%exercise 08.balance
def balance_stages(layer_costs, stages):
    average = sum(layer_costs) / stages
    split, i = [], 0
    for s in range(stages - 1):
        k, total = 0, 0
        while i + k < len(layer_costs) - (stages - 1 - s) and (k == 0 or total < average):
            total += layer_costs[i + k]
            k += 1
        split.append(k)
        i += k
    return split + [len(layer_costs) - i]
'''

# A binary search over the bound with a greedy check, its groups returned as they are: under the best bound the
# greedy fill can need fewer stages than asked ([4, 8, 2, 2, 2] on 4: [1, 1, 3]).
BALANCE_BINARY_SEARCH_FEWER_STAGES = '''%%exercise 08.balance
def balance_stages(layer_costs, stages):
    def groups(bound):
        split, total = [0], 0
        for cost in layer_costs:
            if split[-1] and total + cost > bound:
                split.append(0)
                total = 0
            split[-1] += 1
            total += cost
        return split

    lo, hi = max(layer_costs), sum(layer_costs)
    while lo < hi:
        mid = (lo + hi) // 2
        if len(groups(mid)) <= stages:
            hi = mid
        else:
            lo = mid + 1
    return groups(lo)
'''

# The stages' costs returned instead of their layer counts.
BALANCE_COSTS = BALANCE_SOLUTION.replace("best = (slowest, [b - a for a, b in zip(bounds, bounds[1:])])",
                                         "best = (slowest, [sum(layer_costs[a:b]) for a, b in zip(bounds, bounds[1:])])")
assert BALANCE_COSTS != BALANCE_SOLUTION

# A stage may come out empty: a cut list of stage ends, one of them repeated.
BALANCE_EMPTY_STAGE = '''%%exercise 08.balance
def balance_stages(layer_costs, stages):
    return [len(layer_costs)] + [0] * (stages - 1)
'''

# The input's gradient never sent back: rank 0 waits for it for ever (the deadline names it).
GPIPE_NO_GRAD_SENT = GPIPE_SOLUTION.replace("""        if not first:
            dist.send(received[i].grad, dst=rank - 1)
""", "")
assert GPIPE_NO_GRAD_SENT != GPIPE_SOLUTION
