"""The rank side of lesson 08: pipeline parallelism: how each exercise calls the learner's function.

Runs on the ranks, in the learner's process (see course_lib/grading/drivers.py for the rules every driver
follows: copy the inputs, return plain data). The pipeline is the exercises' own, not the lesson's: stage s is
`Linear(widths[s], widths[s + 1])` then `Tanh`, and every boundary has a width of its own (7, 9, 11), so a
message's shape says which boundary it crosses, and its direction which kind it is. `make_model` and
`make_batch` also run in the checker's process, without torch.distributed: one process's reference.
"""

from __future__ import annotations

import warnings

import torch

from ...drivers import describe

__all__ = ["balance", "execute_order", "gpipe", "make_batch", "make_model", "one_f_one_b", "order_problem",
           "widths"]

WIDTH_IN, WIDTH_OUT = 5, 3
BOUNDARIES = (7, 9, 11)  # the widths of the activations crossing boundaries 1, 2, 3: distinct, so told apart


def widths(stages: int) -> list[int]:
    """The activation widths: the input, every boundary's, the output (stages + 1 numbers)."""
    return [WIDTH_IN, *BOUNDARIES[:stages - 1], WIDTH_OUT]


def make_model(stages: int, seed: int) -> torch.nn.Sequential:
    """The whole pipeline, seeded: module s is stage s (`Linear` then `Tanh`); the global RNG is left as it was."""
    w = widths(stages)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return torch.nn.Sequential(*(torch.nn.Sequential(torch.nn.Linear(w[s], w[s + 1]), torch.nn.Tanh())
                                     for s in range(stages)))


def make_batch(stages: int, rows: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Input [rows, 5] and target [rows, 3], float32, from a generator of their own."""
    generator = torch.Generator().manual_seed(seed + 1)
    return (torch.randn(rows, WIDTH_IN, generator=generator),
            torch.randn(rows, WIDTH_OUT, generator=generator))


def _grads(stage: torch.nn.Module) -> dict:
    return {n: None if p.grad is None else p.grad.detach().cpu().clone() for n, p in stage.named_parameters()}


def _loss_value(value) -> tuple[float | None, str]:
    """The learner's returned loss as a float (None for None), or why it is not one."""
    if value is None:
        return None, ""
    if isinstance(value, torch.Tensor) and value.numel() == 1:
        return float(value.detach().cpu().reshape(())), ""
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return float(value), ""
    return None, describe(value)


def gpipe(fn, seed: int, stages: int, m: int, rows: int, inputs, targets):
    """08.gpipe: this rank's stage (forward and backward hooks record what it ran, in order), then the learner's
    step; back: the loss it returned, its stage's gradients and the record [["F" | "B", rows], ...]."""
    import torch.distributed as dist
    import torch.nn.functional as F

    rank = dist.get_rank()
    stage = make_model(stages, seed)[rank]
    ran = []

    def on_forward(module, args, out):
        ran.append(["F", int(out.shape[0])])
        if out.requires_grad:  # its gradient arrives when this stage's backward starts
            out.register_hook(lambda grad: ran.append(["B", int(grad.shape[0])]))

    stage.register_forward_hook(on_forward)
    returned = fn(stage, None if inputs is None else inputs.clone(), None if targets is None else targets.clone(),
                  F.mse_loss, m, (rows, widths(stages)[rank]))
    loss, wrong_type = _loss_value(returned)
    return {"loss": loss, "returned": wrong_type, "grads": _grads(stage), "ran": ran}


def balance(fn, cases: list):
    """08.balance: the learner's split for each (layer_costs, stages) case this rank was given, as plain data."""
    out = []
    for costs, stages in cases:
        got = fn(list(costs), stages)
        if isinstance(got, (list, tuple)) and all(isinstance(n, int) and not isinstance(n, bool) for n in got):
            out.append({"split": [int(n) for n in got], "returned": ""})
        else:
            out.append({"split": None, "returned": describe(got)})
    return out


# 08.one_f_one_b ----------------------------------------------------------------------------------------------

def _normalised(order, rank: int, stages: int, m: int) -> tuple[list[str] | None, str]:
    """The learner's order for `rank` as ["F0", "B0", ...], or why it is not a list of ("F" | "B", microbatch)."""
    call = f"one_f_one_b_order({rank}, {stages}, {m})"
    if not isinstance(order, (list, tuple)):
        return None, f"{call} returned a {describe(order)}, not a list of (\"F\" or \"B\", microbatch) pairs"
    actions = []
    for action in order:
        if (not isinstance(action, (list, tuple)) or len(action) != 2 or action[0] not in ("F", "B")
                or not isinstance(action[1], int) or isinstance(action[1], bool)):
            return None, (f"{call} holds {action!r}: each action is a pair (\"F\" or \"B\", microbatch index)")
        if not 0 <= action[1] < m:
            return None, f"{call} holds {tuple(action)!r}: microbatches are numbered 0 to {m - 1}"
        actions.append(f"{action[0]}{action[1]}")
    return actions, ""


def order_problem(orders: dict[int, list[str]], stages: int, m: int) -> str:
    """Why these orders cannot run ("" if they can): an action missing or twice, a backward before its forward,
    or a deadlock: the ranks each waiting for a message that a peer sends only later. Messages are sent without
    waiting (isend), so a rank waits only where it receives: a forward for rank - 1's activation, a backward for
    rank + 1's gradient; each message carries its microbatch as its tag."""
    for rank, order in orders.items():
        call = f"one_f_one_b_order({rank}, {stages}, {m})"
        for kind in "FB":
            counts = [order.count(f"{kind}{i}") for i in range(m)]
            if counts != [1] * m:
                i = next(i for i, n in enumerate(counts) if n != 1)
                return (f"{call} runs {kind}{i} {counts[i]} times: each microbatch's forward and backward run once "
                        "on every rank")
        for i in range(m):
            if order.index(f"B{i}") < order.index(f"F{i}"):
                return (f"{call} runs B{i} before F{i}: a backward needs the activations its forward saved (and "
                        "the last rank, its loss)")
    position = {rank: 0 for rank in orders}
    done: dict[int, set] = {rank: set() for rank in orders}

    def waits_for(rank: int, action: str):
        peer = rank - 1 if action[0] == "F" else rank + 1
        return (peer, action) if 0 <= peer < stages else None

    moved = True
    while moved:
        moved = False
        for rank, order in orders.items():
            while position[rank] < len(order):
                action = order[position[rank]]
                need = waits_for(rank, action)
                if need is not None and need[1] not in done[need[0]]:
                    break
                done[rank].add(action)
                position[rank] += 1
                moved = True
    stuck = [rank for rank in orders if position[rank] < len(orders[rank])]
    if not stuck:
        return ""
    said = []
    for rank in stuck:
        action = orders[rank][position[rank]]
        peer, _ = waits_for(rank, action)
        what = "activation" if action[0] == "F" else "gradient"
        theirs = (f"which waits at its {orders[peer][position[peer]]}" if position[peer] < len(orders[peer])
                  else "which has finished")
        said.append(f"rank {rank} waits at {action} for the {what} of microbatch {action[1:]} from rank {peer}, "
                    f"{theirs}")
    return "these orders deadlock: " + "; ".join(said)


def execute_order(order: list[str], seed: int, stages: int, m: int, rows: int) -> dict:
    """Run `order` on this rank's stage: a forward receives its input from rank - 1 (irecv, waited), a backward
    the gradient of its output from rank + 1; each sends on without waiting (isend, tag = microbatch), waited at
    the end. On gloo (the checker's backend) a lone isend does not hold the rank: gloo moves it on its own
    thread while the rank goes on; under NCCL one would pair it with the next receive in one batch_isend_irecv,
    as the lesson's section 4 does. Back: the loss (last rank), the stage's gradients, the most microbatches
    alive (forward run, backward not yet: their activations held) at once."""
    import torch.distributed as dist
    import torch.nn.functional as F

    rank = dist.get_rank()
    stage = make_model(stages, seed)[rank]
    x, y = make_batch(stages, rows, seed)
    xs, ys = x.chunk(m), y.chunk(m)
    w, size = widths(stages), rows // m
    inputs, outputs, sends, alive = {}, {}, [], set()
    peak, loss = 0, 0.0
    for action in order:
        kind, i = action[0], int(action[1:])
        if kind == "F":
            a = xs[i]
            if rank > 0:
                a = torch.empty(size, w[rank])
                dist.irecv(a, rank - 1, tag=i).wait()
                a.requires_grad_()
            out = stage(a)
            alive.add(i)
            peak = max(peak, len(alive))
            if rank == stages - 1:
                out = F.mse_loss(out, ys[i]) / m  # the mean over microbatches
                loss += out.item()
            else:
                sends.append((dist.isend(out.detach(), rank + 1, tag=i), out))
            inputs[i], outputs[i] = a, out
        else:
            grad = None
            if rank < stages - 1:
                grad = torch.empty(size, w[rank + 1])
                dist.irecv(grad, rank + 1, tag=i).wait()
            torch.autograd.backward(outputs.pop(i), grad)
            alive.discard(i)
            a = inputs.pop(i)
            if rank > 0:
                sends.append((dist.isend(a.grad, rank - 1, tag=i), a))
    for work, _ in sends:
        work.wait()
    return {"loss": loss if rank == stages - 1 else None, "grads": _grads(stage), "peak": peak}


def _torch_1f1b(seed: int, stages: int, m: int, rows: int) -> list[str]:
    """The order torch's Schedule1F1B runs on this rank, recorded with hooks on the stage's module (not
    `pipeline_order`, whose last stage's forwards read F1 .. Fm on torch 2.13 and 2.15); the second step's, as
    the first also infers the shapes."""
    import torch.distributed as dist
    import torch.nn.functional as F
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B

    rank = dist.get_rank()
    module = make_model(stages, seed)[rank]
    ran = []
    module.register_forward_pre_hook(lambda mod, args: ran.append("F"))
    module.register_full_backward_pre_hook(lambda mod, grad_output: ran.append("B"))
    schedule = Schedule1F1B(PipelineStage(module, rank, stages, torch.device("cpu")), n_microbatches=m,
                            loss_fn=F.mse_loss)
    x, y = make_batch(stages, rows, seed)
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="Full backward hook is firing")  # stage 0: no input grad
        for _ in range(2):
            ran.clear()
            if rank == 0:
                schedule.step(x)
            elif rank == stages - 1:
                schedule.step(target=y, losses=[])
            else:
                schedule.step()
    dist.barrier()  # its last sends received everywhere before the learner's order runs
    count = {"F": 0, "B": 0}
    order = []
    for kind in ran:  # each kind runs its microbatches in order 0, 1, ...
        order.append(f"{kind}{count[kind]}")
        count[kind] += 1
    return order


def one_f_one_b(fn, seed: int, stages: int, m: int, rows: int):
    """08.one_f_one_b: torch's Schedule1F1B first (its order, from hooks), then the learner's order for every
    rank (the function is called with each rank's arguments, so every rank sees every order and all agree
    whether they can run); then this rank's order run for real."""
    import torch.distributed as dist

    rank = dist.get_rank()
    torch_order = _torch_1f1b(seed, stages, m, rows)
    orders, problem = {}, ""
    for r in range(stages):
        orders[r], problem = _normalised(fn(r, stages, m), r, stages, m)
        if problem:
            break
    problem = problem or order_problem(orders, stages, m)
    if problem:
        return {"problem": problem, "torch": torch_order, "order": orders.get(rank)}
    ran = execute_order(orders[rank], seed, stages, m, rows)
    return {"problem": "", "torch": torch_order, "order": orders[rank], **ran}
