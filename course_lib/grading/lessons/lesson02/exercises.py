"""Lesson 02's exercises: data parallelism by hand, gradient buckets, no_sync accumulation, a compression hook.

Every rank gets the same small Linear-ReLU-Linear model (weights drawn here, in
the checker's process, from a fixed seed; drivers.mlp_from_weights builds it)
and its own shard of a batch. The reference is one process on the whole batch,
computed here without torch.distributed: the averaged gradients, the step of
SGD, within float32 rounding (float16 rounding for the compression hook).
Judges name the rank, the case and the first wrong value, and recognise the
usual mistakes (a sum that was not divided, a gradient left as this rank's own,
one all-reduce per tensor, a bucket never copied back, a synchronisation on
every micro-batch or on none, float32 on the wire).
"""

from __future__ import annotations

import math

from ....units import binary_bytes
from ...compare import first_difference
from ...spec import Exercise, Item, RunOutcome, RunSpec

__all__ = ["EXERCISES", "FP16_ATOL", "FP16_RTOL", "RTOL", "ATOL", "greedy_buckets"]

# float32 results that differ from the reference only by the order of additions.
RTOL, ATOL = 1e-5, 1e-6
# float16 on the wire: 11 significant bits, a rounding of at most 2**-11 (about 4.9e-4) of a value
# per cast, division and addition. The solution is at most 1.8e-4 off in these cases (gradients of
# 4.5e-3 to 0.39); a missing division by N is off by (N-1) times the gradient.
FP16_RTOL, FP16_ATOL = 1e-2, 1e-3
LR = 0.1  # SGD's learning rate in 02.no_sync_accumulation
FEATURES, HIDDEN, OUT = 4, 6, 2  # the model: Linear(4, 6) -> ReLU -> Linear(6, 2)
NAMES = ("0.weight", "0.bias", "2.weight", "2.bias")
ALL_REDUCE = frozenset({"all_reduce"})
DDP_PRELOAD = ("torch._dynamo",)  # DistributedDataParallel's constructor imports it


def _weights(seed: int) -> list:
    """[0.weight, 0.bias, 2.weight, 2.bias], drawn as nn.Linear draws them (uniform within 1/sqrt(fan_in))."""
    import torch

    generator = torch.Generator().manual_seed(seed)
    shapes = [((HIDDEN, FEATURES), FEATURES), ((HIDDEN,), FEATURES), ((OUT, HIDDEN), HIDDEN), ((OUT,), HIDDEN)]
    return [(torch.rand(shape, generator=generator) * 2 - 1) / math.sqrt(fan_in) for shape, fan_in in shapes]


def _batch(size: int, seed: int) -> tuple:
    import torch

    generator = torch.Generator().manual_seed(seed)
    return torch.randn(size, FEATURES, generator=generator), torch.randn(size, OUT, generator=generator)


def _model(weights: list, frozen=()):
    from .drivers import mlp_from_weights

    model = mlp_from_weights(weights)
    for name, parameter in model.named_parameters():
        parameter.requires_grad_(name not in frozen)
    return model


def _grads(weights: list, inputs, targets, frozen=()) -> dict:
    """{name: gradient of mse_loss on (inputs, targets), None for a frozen parameter}: one process."""
    import torch

    model = _model(weights, frozen)
    torch.nn.functional.mse_loss(model(inputs), targets).backward()
    return {name: p.grad for name, p in model.named_parameters()}


def _ratio_hint(got, expected, n: int, rtol: float = 1e-3, atol: float = 1e-6) -> str:
    """Why `got` is a multiple of `expected` (within rtol, atol), if it is one the usual mistakes make ("" otherwise)."""
    import torch

    scale = float((got.double() * expected.double()).sum() / expected.double().square().sum().clamp_min(1e-30))
    if not torch.allclose(got.double(), scale * expected.double(), rtol=rtol, atol=atol):
        return ""
    if math.isclose(scale, n, rel_tol=1e-3):
        return f": that is {n} times the average, the sum; divide it by the world size (or use ReduceOp.AVG)"
    divisor = n / scale
    if abs(divisor - round(divisor)) < 1e-3 and round(divisor) not in (0, n):
        return f": that is the sum divided by {round(divisor)}; divide by the world size, {n} here"
    return ""


# ---------------------------------------------------------------- 02.average_gradients


def _shard_cases(n: int, specs: list[tuple[int, int, int, tuple]]) -> list[dict[int, tuple]]:
    """One case per (weights seed, batch size, batch seed, frozen names): rank r gets rows r*b/n.. of the batch."""
    cases = []
    for weights_seed, size, batch_seed, frozen in specs:
        weights, (inputs, targets) = _weights(weights_seed), _batch(size, batch_seed)
        rows = size // n
        cases.append({r: (weights, inputs[r * rows:(r + 1) * rows], targets[r * rows:(r + 1) * rows], list(frozen))
                      for r in range(n)})
    return cases


def _full_batch(outcome: RunOutcome, case: int) -> tuple:
    """The whole batch of a case: every rank's shard, in rank order."""
    import torch

    shards = [outcome.inputs[case][r] for r in range(outcome.nproc)]
    return torch.cat([s[1] for s in shards]), torch.cat([s[2] for s in shards])


def _batch_label(outcome: RunOutcome, case: int) -> str:
    inputs, _ = _full_batch(outcome, case)
    return (f"case {case + 1} of {len(outcome.inputs)} (batch of {inputs.shape[0]} split over "
            f"{outcome.nproc} ranks)")


def _averaged(outcome: RunOutcome) -> list[str]:
    """Every rank's .grad equals one process's gradient on the whole batch (None where frozen)."""
    n = outcome.nproc
    for case, by_rank in enumerate(outcome.results):
        weights, _, _, frozen = outcome.inputs[case][0]
        expected = _grads(weights, *_full_batch(outcome, case), frozen)
        for rank in range(n):
            got = by_rank[rank].output["grads"]
            own = _grads(*outcome.inputs[case][rank])  # this rank's gradient before averaging
            where = f"rank {rank}, {_batch_label(outcome, case)}"
            averaged = [name for name in NAMES if expected[name] is not None and got[name] is not None
                        and not first_difference(got[name], expected[name], rtol=RTOL, atol=ATOL)]
            for name in NAMES:
                if expected[name] is None:
                    if got[name] is not None:
                        return [f"{where}: {name} is frozen (requires_grad=False) but has a .grad afterwards; "
                                "leave a parameter whose .grad is None alone"]
                    continue
                if got[name] is None:
                    return [f"{where}: {name}.grad is None afterwards, expected the averaged gradient"]
                wrong = first_difference(got[name], expected[name], rtol=RTOL, atol=ATOL)
                if not wrong:
                    continue
                hint = _ratio_hint(got[name], expected[name], n)
                if not hint and not first_difference(got[name], own[name], rtol=RTOL, atol=ATOL):
                    if averaged:
                        hint = (f": that is this rank's own gradient, not averaged (while {averaged[0]} was "
                                "averaged); average every parameter's .grad, biases too")
                    else:
                        hint = (": that is this rank's own gradient; every .grad is unchanged: all-reduce "
                                "each p.grad (not p or p.data)")
                return [f"{where}: {name}.grad {wrong}{hint}"]
    return []


AVERAGE = Exercise(
    id="02.average_gradients",
    function="average_gradients",
    signature="average_gradients(model: torch.nn.Module) -> None",
    driver="average_gradients",
    allowed_ops=ALL_REDUCE,
    required_ops=ALL_REDUCE,
    runs=(
        RunSpec(2, lambda n: _shard_cases(n, [(1, 8, 11, ())]),
                (Item("averages every gradient on 2 ranks", 1, _averaged),)),
        RunSpec(3, lambda n: _shard_cases(n, [(2, 9, 12, ())]),
                (Item("averages every gradient on 3 ranks", 1, _averaged),)),
        RunSpec(2, lambda n: _shard_cases(n, [(3, 6, 13, ("0.weight",))]),
                (Item("skips a frozen parameter (requires_grad=False, .grad None)", 1, _averaged),)),
    ),
)


# ---------------------------------------------------------------- 02.bucketed_allreduce


def greedy_buckets(sizes: list[int], cap: int) -> list[int]:
    """Bytes of each bucket when tensors of `sizes` bytes, in order, fill buckets of at most `cap` bytes.

    A tensor joins the open bucket if the bucket stays within `cap`; otherwise it opens the next.
    A tensor larger than `cap` gets a bucket of its own.
    """
    buckets: list[int] = []
    for size in sizes:
        if buckets and buckets[-1] + size <= cap:
            buckets[-1] += size
        else:
            buckets.append(size)
    return buckets


def _tensor_lists(n: int, specs: list[tuple[list[tuple], str, int]], seed: int) -> list[dict[int, tuple]]:
    """One case per (shapes, dtype name, cap in bytes): rank r gets its own integer-valued tensors."""
    import torch

    generator = torch.Generator().manual_seed(seed)
    cases = []
    for shapes, dtype, cap in specs:
        cases.append({r: ([torch.randint(-9, 10, shape, generator=generator).to(getattr(torch, dtype))
                           for shape in shapes], cap) for r in range(n)})
    return cases


def _list_label(outcome: RunOutcome, case: int) -> str:
    tensors, cap = outcome.inputs[case][0]
    shapes = ", ".join("x".join(map(str, t.shape)) for t in tensors)
    return (f"case {case + 1} of {len(outcome.inputs)} ({str(tensors[0].dtype)[6:]} tensors of shapes {shapes}, "
            f"cap {binary_bytes(cap)})")


def _list_averaged(outcome: RunOutcome) -> list[str]:
    """Every tensor of the list holds the average over ranks, in place, in its dtype."""
    import torch

    n = outcome.nproc
    for case, by_rank in enumerate(outcome.results):
        tensors = [outcome.inputs[case][r][0] for r in range(n)]
        expected = [sum(t[i].double() for t in tensors).div(n).to(tensors[0][i].dtype) for i in range(len(tensors[0]))]
        for rank in range(n):
            got = by_rank[rank].output["tensors"]
            where = f"rank {rank}, {_list_label(outcome, case)}"
            for index, want in enumerate(expected):
                wrong = first_difference(got[index], want, rtol=RTOL, atol=ATOL)
                if not wrong:
                    continue
                hint = ""
                if torch.equal(got[index], tensors[rank][index]):
                    hint = (": it is unchanged; copy the averaged flat bucket back into the tensors "
                            "(views of it, or torch._utils._unflatten_dense_tensors)")
                else:
                    hint = _ratio_hint(got[index], want, n)
                return [f"{where}: tensor {index} {wrong}{hint}"]
    return []


def _one_all_reduce_per_bucket(outcome: RunOutcome) -> list[str]:
    """The ledger: one all_reduce per bucket of the greedy packing, each of the bucket's bytes."""
    for case, by_rank in enumerate(outcome.results):
        tensors, cap = outcome.inputs[case][0]
        sizes = [t.numel() * t.element_size() for t in tensors]
        expected = greedy_buckets(sizes, cap)
        for rank, result in sorted(by_rank.items()):
            got = [entry["bytes"] for entry in result.ledger if entry["op"] == "all_reduce"]
            if got == expected:
                continue
            shown = lambda sizes: ", ".join(binary_bytes(s) for s in sizes)  # noqa: E731
            hint = ""
            if got == greedy_buckets(sizes, cap - 1):
                hint = (f": a bucket of exactly {binary_bytes(cap)} was split; a bucket may hold up to the cap, "
                        "equal included")
            elif got == sizes:
                hint = ": one all_reduce per tensor; pack consecutive tensors into flat buckets first"
            elif len(got) == 1 and len(expected) > 1:
                hint = f": everything in one bucket; start a new bucket when the next tensor would pass {binary_bytes(cap)}"
            elif sum(got) == sum(sizes):
                hint = (f": a bucket takes the next tensor while it stays within {binary_bytes(cap)}; a tensor "
                        "larger than the cap gets a bucket of its own")
            return [f"rank {rank}, {_list_label(outcome, case)}: {len(got)} all_reduce call{'s' if len(got) != 1 else ''}"
                    f"{' of ' + shown(got) if got else ''}, expected {len(expected)}, of {shown(expected)} "
                    f"(consecutive tensors, in order, in buckets of at most {binary_bytes(cap)}){hint}"]
    return []


BUCKETED = Exercise(
    id="02.bucketed_allreduce",
    function="allreduce_bucketed",
    signature="allreduce_bucketed(tensors: list[torch.Tensor], bucket_cap_bytes: int) -> None",
    driver="in_place_list",
    allowed_ops=ALL_REDUCE,
    required_ops=ALL_REDUCE,
    runs=(
        RunSpec(2, lambda n: _tensor_lists(n, [([(3, 4), (5,), (2, 2), (7,), (6,)], "float32", 64),
                                               ([(4,), (2, 3), (3,)], "float64", 100)], seed=21),
                (Item("averages every tensor in place on 2 ranks (float32 and float64)", 1, _list_averaged),
                 Item("one all_reduce per bucket, of the bucket's bytes, on 2 ranks", 1, _one_all_reduce_per_bucket))),
        RunSpec(3, lambda n: _tensor_lists(n, [([(2,), (10, 4), (3,), (5,)], "float32", 32)], seed=22),
                (Item("averages on 3 ranks, with a tensor larger than the cap", 1, _list_averaged),
                 Item("one all_reduce per bucket on 3 ranks (the large tensor alone)", 1, _one_all_reduce_per_bucket))),
    ),
)


# ---------------------------------------------------------------- 02.no_sync_accumulation


def _micro_batch_cases(n: int, specs: list[tuple[int, int, int, int]]) -> list[dict[int, tuple]]:
    """One case per (weights seed, K, micro-batch size, batch seed): rank r gets K micro-batches of its own."""
    cases = []
    for weights_seed, k, size, batch_seed in specs:
        weights, (inputs, targets) = _weights(weights_seed), _batch(n * k * size, batch_seed)
        case = {}
        for r in range(n):
            rows = [(r * k + i) * size for i in range(k)]
            case[r] = (weights, [(inputs[s:s + size], targets[s:s + size]) for s in rows], LR)
        cases.append(case)
    return cases


def _sgd_step(weights: list, inputs, targets, lr: float) -> dict:
    """{name: parameter} after one SGD step on mse_loss of (inputs, targets): one process."""
    import torch

    model = _model(weights)
    optimizer = torch.optim.SGD(model.parameters(), lr=lr)
    torch.nn.functional.mse_loss(model(inputs), targets).backward()
    optimizer.step()
    return {name: p.detach() for name, p in model.named_parameters()}


def _micro_label(outcome: RunOutcome, case: int) -> str:
    micro_batches = outcome.inputs[case][0][1]
    return (f"case {case + 1} of {len(outcome.inputs)} (K={len(micro_batches)} micro-batches of "
            f"{micro_batches[0][0].shape[0]} per rank)")


def _stepped(outcome: RunOutcome) -> list[str]:
    """Every rank's parameters equal one process's SGD step on all ranks' micro-batches together."""
    import torch

    n = outcome.nproc
    for case, by_rank in enumerate(outcome.results):
        weights, _, lr = outcome.inputs[case][0]
        pairs = [pair for r in range(n) for pair in outcome.inputs[case][r][1]]
        inputs, targets = torch.cat([x for x, _ in pairs]), torch.cat([y for _, y in pairs])
        expected = _sgd_step(weights, inputs, targets, lr)
        k = len(outcome.inputs[case][0][1])
        first = by_rank[0].output["params"]
        for rank in range(n):
            got = by_rank[rank].output["params"]
            where = f"rank {rank}, {_micro_label(outcome, case)}"
            for index, name in enumerate(NAMES):
                wrong = first_difference(got[name], expected[name], rtol=RTOL, atol=ATOL)
                if not wrong:
                    continue
                hint = ""
                if any(first_difference(by_rank[r].output["params"][name], first[name], rtol=RTOL, atol=ATOL)
                       for r in range(n)):
                    hint = (": the ranks hold different parameters, so no gradient was all-reduced; run the "
                            "last micro-batch's backward outside no_sync()")
                else:
                    step, expected_step = got[name] - weights[index], expected[name] - weights[index]
                    if torch.allclose(step, k * expected_step, rtol=1e-3, atol=1e-6):
                        hint = f": the update is {k} times too large; divide each micro-batch's loss by K={k}"
                    elif torch.allclose(got[name], weights[index]):
                        hint = ": the parameter did not change; call optimizer.step() after the last backward"
                return [f"{where}: {name} {wrong}{hint}"]
    return []


def _synchronised_once(outcome: RunOutcome) -> list[str]:
    """The ledger: one all_reduce per DDP bucket per step, each of the bucket's bytes."""
    for case, by_rank in enumerate(outcome.results):
        k = len(outcome.inputs[case][0][1])
        for rank, result in sorted(by_rank.items()):
            buckets = result.output["buckets"]
            expected = [4 * numel for numel in buckets]  # float32 gradients
            got = [entry["bytes"] for entry in result.ledger if entry["op"] == "all_reduce"]
            if got == expected:
                continue
            where = f"rank {rank}, {_micro_label(outcome, case)}"
            plural = "s" if len(expected) != 1 else ""
            should = f"expected {len(expected)} (one per DDP bucket{plural}, on the last backward only)"
            if not got:
                return [f"{where}: no all_reduce, {should}: DDP never synchronised; run the last backward "
                        "outside no_sync()"]
            hint = ""
            if got == expected * (len(got) // len(expected)) and len(got) // len(expected) > 1:
                hint = (f": DDP synchronised {len(got) // len(expected)} times; run the first K-1={k - 1} "
                        "backwards inside ddp_model.no_sync()")
            return [f"{where}: {len(got)} all_reduce calls of {', '.join(binary_bytes(b) for b in got)}, "
                    f"{should}{hint}"]
    return []


def _gradients_cleared(outcome: RunOutcome) -> list[str]:
    """No gradient left after the step (optimizer.zero_grad(): None, or zeros)."""
    for case, by_rank in enumerate(outcome.results):
        for rank, result in sorted(by_rank.items()):
            for name in NAMES:
                grad = result.output["grads"][name]
                if grad is not None and bool(grad.ne(0).any()):
                    return [f"rank {rank}, {_micro_label(outcome, case)}: {name}.grad is not zero after the step; "
                            "call optimizer.zero_grad() after optimizer.step(), or the next step adds to it"]
    return []


ACCUMULATION = Exercise(
    id="02.no_sync_accumulation",
    function="accumulation_step",
    signature=("accumulation_step(ddp_model: DistributedDataParallel, optimizer: torch.optim.Optimizer, "
               "micro_batches: list[tuple[torch.Tensor, torch.Tensor]]) -> None"),
    driver="ddp_accumulation",
    allowed_ops=ALL_REDUCE,
    preload=DDP_PRELOAD,
    runs=(
        RunSpec(2, lambda n: _micro_batch_cases(n, [(4, 2, 3, 41), (5, 3, 2, 42)]),
                (Item("one step equals one process on the whole batch (2 ranks, K=2 and K=3)", 1, _stepped),
                 Item("DDP all-reduces once per bucket per step (K-1 backwards inside no_sync)", 1,
                      _synchronised_once),
                 Item("leaves no gradient behind (zero_grad after the step)", 1, _gradients_cleared))),
        RunSpec(3, lambda n: _micro_batch_cases(n, [(6, 2, 2, 43)]),
                (Item("one step equals one process on the whole batch (3 ranks, K=2)", 1, _stepped),)),
    ),
)


# ---------------------------------------------------------------- 02.fp16_compress_hook


def _own_hook(judge):
    """`judge`, after checking that the hook did not use torch's own compression hooks."""

    def judged(outcome: RunOutcome) -> list[str]:
        for by_rank in outcome.results:
            for rank, result in sorted(by_rank.items()):
                # fp16_compress_hook and bf16_compress_hook call _compress_hook: name what the learner called.
                used = [n for n in result.output["torch_compression"] if n != "_compress_hook"] or \
                    result.output["torch_compression"]
                if used:
                    return [f"rank {rank}: your hook uses torch's own {', '.join(used)}; write the compression "
                            "yourself (cast, divide, all_reduce, cast back)"]
        return judge(outcome)

    judged.__doc__ = judge.__doc__
    return judged


def _hook_grads(outcome: RunOutcome) -> list[str]:
    """Every rank's .grad is the full-batch gradient, within float16 rounding."""
    n = outcome.nproc
    for case, by_rank in enumerate(outcome.results):
        weights = outcome.inputs[case][0][0]
        expected = _grads(weights, *_full_batch(outcome, case))
        for rank in range(n):
            got = by_rank[rank].output["grads"]
            for name in NAMES:
                wrong = first_difference(got[name], expected[name], rtol=FP16_RTOL, atol=FP16_ATOL)
                if wrong:
                    # A sum of N float16 gradients carries N times their rounding.
                    hint = _ratio_hint(got[name], expected[name], n, FP16_RTOL, n * FP16_ATOL)
                    return [f"rank {rank}, {_batch_label(outcome, case)}: {name}.grad {wrong}{hint}"]
    return []


def _float16_on_the_wire(outcome: RunOutcome) -> list[str]:
    """The ledger: one all_reduce per DDP bucket, float16, 2 bytes per gradient element."""
    for case, by_rank in enumerate(outcome.results):
        for rank, result in sorted(by_rank.items()):
            buckets = result.output["buckets"]
            calls = [entry for entry in result.ledger if entry["op"] == "all_reduce"]
            where = f"rank {rank}, {_batch_label(outcome, case)}"
            expected = ", ".join(f"float16 of {binary_bytes(2 * numel)}" for numel in buckets)
            got = ", ".join(f"{entry['dtype']} of {binary_bytes(entry['bytes'])}" for entry in calls)
            if [(e["dtype"], e["bytes"]) for e in calls] == [("float16", 2 * numel) for numel in buckets]:
                continue
            hint = ""
            if calls and all(e["dtype"] == "float32" for e in calls):
                hint = (": float32 on the wire, twice the bytes; all-reduce bucket.buffer().to(torch.float16), "
                        "not the buffer itself")
            return [f"{where}: all_reduce {got or 'never called'}, expected {len(buckets)} call"
                    f"{'s' if len(buckets) != 1 else ''}: {expected} (half the float32 gradients' bytes){hint}"]
    return []


def _asynchronous(outcome: RunOutcome) -> list[str]:
    """The ledger: the hook's all_reduce was started with async_op=True (backward goes on meanwhile)."""
    for case, by_rank in enumerate(outcome.results):
        for rank, result in sorted(by_rank.items()):
            blocking = [e for e in result.ledger if e["op"] == "all_reduce" and not e["async"]]
            if blocking:
                return [f"rank {rank}, {_batch_label(outcome, case)}: the all_reduce was not asynchronous, so "
                        "backward waited for it; call dist.all_reduce(..., async_op=True) and return "
                        ".get_future().then(...)"]
    return []


FP16_HOOK = Exercise(
    id="02.fp16_compress_hook",
    function="fp16_compress",
    signature="fp16_compress(process_group: dist.ProcessGroup | None, bucket: dist.GradBucket) "
              "-> torch.futures.Future[torch.Tensor]",
    driver="ddp_comm_hook",
    allowed_ops=ALL_REDUCE,
    required_ops=ALL_REDUCE,
    preload=DDP_PRELOAD,
    runs=(
        RunSpec(2, lambda n: [{r: case[r][:3] for r in case} for case in _shard_cases(n, [(7, 8, 71, ())])],
                (Item("gradients equal the full-batch ones within float16 rounding (2 ranks)", 1,
                      _own_hook(_hook_grads)),
                 Item("all-reduces float16: half the bytes of the float32 gradients (2 ranks)", 1,
                      _own_hook(_float16_on_the_wire)),
                 Item("starts the all_reduce with async_op=True and returns its future", 1,
                      _own_hook(_asynchronous)))),
        RunSpec(3, lambda n: [{r: case[r][:3] for r in case} for case in _shard_cases(n, [(8, 9, 72, ())])],
                (Item("gradients equal the full-batch ones within float16 rounding (3 ranks)", 1,
                      _own_hook(_hook_grads)),
                 Item("all-reduces float16: half the bytes of the float32 gradients (3 ranks)", 1,
                      _own_hook(_float16_on_the_wire)))),
    ),
)

EXERCISES = {exercise.id: exercise for exercise in (AVERAGE, BUCKETED, ACCUMULATION, FP16_HOOK)}
