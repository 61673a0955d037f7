"""02.ddp_from_scratch: DDP written by hand, checked on real ranks against one process.

The learner's class wraps a module: its constructor gives every rank rank 0's parameters; hooks
fill buckets of at most a cap with gradients in the order they become ready and start an
asynchronous all-reduce per full bucket while backward runs; finish_gradient_synchronization()
waits, averages and copies back; no_sync() accumulates without communicating.

Each of the first two runs has two cases (drivers.ddp_from_scratch runs both): the ranks start with
the same parameters (gradients, parameters after 3 SGD steps, buckets, overlap, no_sync), and with
different ones (rank 0's after the constructor; one process's after 3 steps). The third run's module
has a frozen parameter (its .grad stays None, it has no hook) and a weight tied to another layer's (one
Parameter used twice, listed once by parameters(), ready once): gradients, steps and buckets. Overlap is read
from the clock of the ledger: each all_reduce's start against when backward returned, when the
last gradient was ready, and when anything waited for a collective.
"""

from __future__ import annotations

import functools
import math

from ....units import binary_bytes
from ...compare import first_difference
from ...spec import Exercise, Item, RunOutcome, RunSpec
from .bucketed import greedy_buckets
from .common import ALL_REDUCE, ATOL, LR, RTOL, _ratio_hint

__all__ = ["DDP_FROM_SCRATCH", "LAYERS", "MICRO_ROWS", "ROWS", "SHARED", "ready_order"]

LAYERS = ((4, 8), (8, 8), (8, 2))  # (in, out) of each Linear: Linear(4, 8) -> ReLU -> Linear(8, 8) -> ReLU -> Linear(8, 2)
ROWS, MICRO_ROWS, STEPS = 4, 2, 3  # rows per rank in each step, in each micro-batch; SGD steps before the no_sync one
NAMES = tuple(f"{2 * i}.{kind}" for i in range(len(LAYERS)) for kind in ("weight", "bias"))
# The third run's module: Linear(4, 8) -> ReLU -> Linear(8, 8) -> ReLU -> Linear(8, 8) -> ReLU -> Linear(8, 2), its first
# weight frozen (a frozen embedding's place) and its third layer's weight the second's (tied, as an LM head and its
# embedding are): 6 parameters that train, one listed by parameters() but without a gradient.
SHARED = {"layers": ((4, 8), (8, 8), (8, 8), (8, 2)), "frozen": ("0.weight",), "tied": (("4.weight", "2.weight"),)}


def _weights(seed: int, layers: tuple = LAYERS) -> list:
    """[0.weight, 0.bias, 2.weight, ...], drawn as nn.Linear draws them (uniform within 1/sqrt(fan_in))."""
    import torch

    generator = torch.Generator().manual_seed(seed)
    shapes = [shape for fan_in, out in layers for shape in (((out, fan_in), fan_in), ((out,), fan_in))]
    return [(torch.rand(shape, generator=generator) * 2 - 1) / math.sqrt(fan_in) for shape, fan_in in shapes]


def _model(weights: list, frozen=(), tied=()):
    from .drivers import mlp_from_weights

    return mlp_from_weights(weights, frozen, tied)


def _shape_of(outcome: RunOutcome, case: int) -> tuple:
    """(frozen, tied) of a case's module: empty for the plain one."""
    args = outcome.inputs[case][0]
    return (tuple(args[5]), tuple(map(tuple, args[6]))) if len(args) > 5 else ((), ())


@functools.cache
def ready_order(layers: tuple = LAYERS, frozen: tuple = (), tied: tuple = ()) -> tuple[tuple[str, int], ...]:
    """(name, bytes) of each gradient in the order backward makes it ready: one process's hooks say
    (a tied weight once, a frozen one never)."""
    import torch

    model, order = _model(_weights(0, layers), frozen, tied), []
    for name, parameter in model.named_parameters():
        if parameter.requires_grad:
            parameter.register_post_accumulate_grad_hook(
                lambda p, name=name: order.append((name, p.grad.numel() * p.grad.element_size())))
    model(torch.zeros(1, layers[0][0])).sum().backward()
    return tuple(order)


def _cases(n: int, cap: int, seed: int) -> list[dict[int, tuple]]:
    """Two cases: every rank starts from weights(seed), then rank r from weights(seed + 1 + r).

    Rank r's batches: ROWS rows of each of the STEPS steps' batch, then two micro-batches of MICRO_ROWS.
    """
    import torch

    generator = torch.Generator().manual_seed(seed)
    cases = []
    for different in (False, True):
        rows = STEPS * n * ROWS + 2 * n * MICRO_ROWS
        inputs = torch.randn(rows, LAYERS[0][0], generator=generator)
        targets = torch.randn(rows, LAYERS[-1][1], generator=generator)
        case = {}
        for r in range(n):
            steps, micro = _rank_batches(inputs, targets, n, r)
            case[r] = (_weights(seed + 1 + r if different else seed), cap, steps, micro, LR)
        cases.append(case)
    return cases


def _reference(outcome: RunOutcome, case: int) -> dict:
    """One process from rank 0's weights on every step's whole batch, then on all the micro-batches."""
    import torch

    n, inputs = outcome.nproc, outcome.inputs[case]
    model = _model(inputs[0][0], *_shape_of(outcome, case))
    optimizer = torch.optim.SGD(model.parameters(), lr=inputs[0][4])
    batches = [(torch.cat([inputs[r][2][s][0] for r in range(n)]), torch.cat([inputs[r][2][s][1] for r in range(n)]))
               for s in range(STEPS)]
    micro = [pair for r in range(n) for pair in inputs[r][3]]
    batches.append((torch.cat([x for x, _ in micro]), torch.cat([y for _, y in micro])))  # equal micro-batches
    found: dict = {"grads": [], "params": []}
    for x, y in batches:
        torch.nn.functional.mse_loss(model(x), y).backward()
        found["grads"].append({name: None if p.grad is None else p.grad.clone()
                               for name, p in model.named_parameters()})
        optimizer.step()
        optimizer.zero_grad()
        found["params"].append({name: p.detach().clone() for name, p in model.named_parameters()})
    return found


def _own_grads(outcome: RunOutcome, case: int, rank: int) -> dict:
    """This rank's gradient of step 1 on its own rows, before any averaging."""
    import torch

    weights, _, steps, _, _ = outcome.inputs[case][rank]
    model = _model(weights)
    torch.nn.functional.mse_loss(model(steps[0][0]), steps[0][1]).backward()
    return {name: p.grad for name, p in model.named_parameters()}


def _label(outcome: RunOutcome, case: int) -> str:
    frozen, tied = _shape_of(outcome, case)
    if frozen or tied:
        return _shared_label(frozen, tied)
    return ("the ranks start from the same parameters", "the ranks start from different parameters")[case]


def _shared_label(frozen: tuple, tied: tuple) -> str:
    return ("the module with " + " and ".join([f"{name} frozen" for name in frozen]
                                              + [f"{name} tied to {source}" for name, source in tied]))


def _shared_cases(n: int, cap: int, seed: int) -> list[dict[int, tuple]]:
    """One case, every rank from the same weights of SHARED's module: its frozen and tied names ride along."""
    import torch

    layers = SHARED["layers"]
    generator = torch.Generator().manual_seed(seed)
    rows = STEPS * n * ROWS + 2 * n * MICRO_ROWS
    inputs = torch.randn(rows, layers[0][0], generator=generator)
    targets = torch.randn(rows, layers[-1][1], generator=generator)
    weights, case = _weights(seed, layers), {}
    for r in range(n):
        steps, micro = _rank_batches(inputs, targets, n, r)
        case[r] = (weights, cap, steps, micro, LR, list(SHARED["frozen"]), [list(pair) for pair in SHARED["tied"]])
    return [case]


def _rank_batches(inputs, targets, n: int, r: int) -> tuple[list, list]:
    """Rank r's rows: STEPS batches of ROWS (rank-interleaved per step), then its 2 micro-batches after them."""
    steps = [(inputs[(s * n + r) * ROWS:(s * n + r + 1) * ROWS], targets[(s * n + r) * ROWS:(s * n + r + 1) * ROWS])
             for s in range(STEPS)]
    base = STEPS * n * ROWS
    micro = [(inputs[base + (2 * r + i) * MICRO_ROWS:base + (2 * r + i + 1) * MICRO_ROWS],
              targets[base + (2 * r + i) * MICRO_ROWS:base + (2 * r + i + 1) * MICRO_ROWS]) for i in range(2)]
    return steps, micro


def _all_reduces(result, start: float, end: float) -> list[dict]:
    return [e for e in result.ledger if e["op"] == "all_reduce" and start <= e["start"] <= end]


def _expected_buckets(cap: int) -> list[int]:
    return greedy_buckets([nbytes for _, nbytes in ready_order()], cap)


# ---------------------------------------------------------------- judges


def _averaged(outcome: RunOutcome) -> list[str]:
    """The first case: after each finish_gradient_synchronization(), every .grad is one process's on the whole batch."""
    n, case = outcome.nproc, 0
    expected = _reference(outcome, case)["grads"]
    for rank, result in sorted(outcome.results[case].items()):
        for step, got in enumerate(result.output["grads"]):
            where = f"rank {rank}, step {step + 1}"
            for name in NAMES:
                if got[name] is None:
                    return [f"{where}: {name}.grad is None after finish_gradient_synchronization()"]
                wrong = first_difference(got[name], expected[step][name], rtol=RTOL, atol=ATOL)
                if not wrong:
                    continue
                hint = _ratio_hint(got[name], expected[step][name], n)
                if not hint and step == 0:
                    own = _own_grads(outcome, case, rank)
                    if not first_difference(got[name], own[name], rtol=RTOL, atol=ATOL):
                        averaged = [m for m in NAMES if not first_difference(got[m], expected[0][m], rtol=RTOL,
                                                                               atol=ATOL)]
                        hint = (f": that is this rank's own gradient, not averaged (while {averaged[0]} was "
                                "averaged): a bucket's average never reached its gradients" if averaged else
                                ": that is this rank's own gradient: nothing was averaged")
                elif not hint:
                    hint = (": step 1's gradients were right; something left over from the step before "
                            "(a bucket, a count) changed this one")
                return [f"{where}: {name}.grad after finish_gradient_synchronization() {wrong}{hint}"]
    return []


def _equal_to_one_process(outcome: RunOutcome) -> list[str]:
    """Every case: after 3 SGD steps every rank's parameters are one process's, started from rank 0's."""
    for case, by_rank in enumerate(outcome.results):
        expected = _reference(outcome, case)["params"]
        rank0 = dict(_model(outcome.inputs[case][0][0], *_shape_of(outcome, case)).named_parameters())
        strays = [rank for rank, result in sorted(by_rank.items())
                  if any(first_difference(result.output["start"][name], rank0[name].detach()) for name in rank0)]
        for rank, result in sorted(by_rank.items()):
            for step in range(STEPS):
                got = result.output["params"][step]
                for name in rank0:
                    wrong = first_difference(got[name], expected[step][name], rtol=RTOL, atol=ATOL)
                    if not wrong:
                        continue
                    hint = ""
                    if strays:
                        hint = (f": rank{'s' if len(strays) > 1 else ''} {', '.join(map(str, strays))} did not start "
                                "from rank 0's parameters, so the averaged gradients mix different models")
                    return [f"rank {rank}, {_label(outcome, case)}: {name} after step {step + 1} {wrong}{hint}"]
    return []


def _bucket_hint(got: list[int], expected: list[int], cap: int, order: tuple = (), names: tuple = NAMES) -> str:
    order = order or ready_order()
    ready = [nbytes for _, nbytes in order]
    in_parameter_order = [nbytes for _, nbytes in sorted(order, key=lambda item: names.index(item[0]))]
    if got == ready:
        return ": one all_reduce per gradient; pack the gradients into flat buckets"
    if got == expected[:-1]:
        return ": the last bucket was never all-reduced"
    if got == greedy_buckets(in_parameter_order, cap):
        return (": buckets filled in the order of module.parameters(); fill them in the order the gradients "
                "become ready (the last layer's first)")
    if got == greedy_buckets(in_parameter_order, cap)[::-1]:
        return (": buckets made of consecutive parameters in the order of module.parameters() (DDP's assignment "
                "before its first rebuild), each started once complete; fill them in the order the gradients "
                "become ready (the last layer's first)")
    reach = []
    for nbytes in ready:  # DDP's own rule: add, then close once the bucket reaches the cap
        if not reach or reach[-1] >= cap:
            reach.append(0)
        reach[-1] += nbytes
    if got == reach:
        return (f": buckets that pass {binary_bytes(cap)} (DDP's rule closes a bucket once it reaches the cap); "
                "here a gradient that would pass the cap starts the next bucket")
    if len(got) == 1 and len(expected) > 1:
        return f": everything in one bucket; a bucket holds at most {binary_bytes(cap)}"
    return ""


def _one_all_reduce_per_bucket(outcome: RunOutcome) -> list[str]:
    """The first case, each of the 3 steps: between backward and the end of finish_gradient_synchronization(),
    one all_reduce per bucket of the rule, of its bytes, in the order the gradients became ready."""
    case = 0
    for rank, result in sorted(outcome.results[case].items()):
        cap = outcome.inputs[case][rank][1]
        expected = _expected_buckets(cap)
        for step, times in enumerate(result.output["times"]):
            got = [e["bytes"] for e in _all_reduces(result, times["backward"][0], times["finish_end"])]
            if got == expected:
                continue
            shown = lambda sizes: ", ".join(binary_bytes(s) for s in sizes)  # noqa: E731
            return [f"rank {rank}, step {step + 1}: {len(got)} all_reduce call{'s' if len(got) != 1 else ''}"
                    f"{' of ' + shown(got) if got else ''}, expected {len(expected)}, of {shown(expected)} "
                    f"(buckets of at most {binary_bytes(cap)}, in the order the gradients become ready)"
                    f"{_bucket_hint(got, expected, cap)}"]
    return []


def _overlapped(outcome: RunOutcome) -> list[str]:
    """The first case, each step: every all_reduce issued during backward is asynchronous, nothing waits for one
    before backward returns, the first starts before the last gradient is ready and all but the last
    start before backward returns."""
    case = 0
    for rank, result in sorted(outcome.results[case].items()):
        waits = result.output["waits"]
        for step, times in enumerate(result.output["times"]):
            begin, end = times["backward"]
            where = f"rank {rank}, step {step + 1}"
            calls = _all_reduces(result, begin, times["finish_end"])
            blocking = [e for e in calls if e["start"] <= end and not e["async"]]
            if blocking:
                return [f"{where}: {len(blocking)} all_reduce call{'s' if len(blocking) != 1 else ''} during backward "
                        "without async_op=True: backward waited for each, so communication never overlapped it"]
            waited = [t for t in waits if begin <= t <= end]
            if waited:
                return [f"{where}: waited for a collective {len(waited)} time{'s' if len(waited) != 1 else ''} "
                        "while backward ran (inside a hook): backward stalled on each bucket's all-reduce, no "
                        "overlap; wait only in finish_gradient_synchronization()"]
            if len(calls) < 2:
                continue  # one bucket (or none, which the bucket check reports): nothing to overlap
            early = [e for e in calls if e["start"] <= end]
            if calls[0]["start"] > times["last_ready"] or len(early) < len(calls) - 1:
                return [f"{where}: {len(early)} of {len(calls)} all_reduce calls started before backward returned, "
                        f"{'none' if calls[0]['start'] > times['last_ready'] else 'the first'} before the last "
                        "gradient was ready: start each bucket's all-reduce as soon as the bucket is complete, while "
                        "backward still computes the rest"]
    return []


def _no_sync(outcome: RunOutcome) -> list[str]:
    """The first case: a backward inside no_sync() communicates nothing; the next one, outside, gives one process's
    gradients and step on all the micro-batches."""
    n, case = outcome.nproc, 0
    reference = _reference(outcome, case)
    for rank, result in sorted(outcome.results[case].items()):
        record = result.output["no_sync"]
        inside = [e for e in result.ledger if record["span"][0] <= e["start"] <= record["span"][1]]
        if inside:
            return [f"rank {rank}: {len(inside)} {inside[0]['op']} call{'s' if len(inside) != 1 else ''} during a "
                    "forward and backward inside no_sync(): nothing may be sent there"]
        for label, got, expected in (("gradient", record["synced_grads"], reference["grads"][-1]),
                                     ("parameter", record["params"], reference["params"][-1])):
            for name in NAMES:
                wrong = first_difference(got[name], expected[name], rtol=RTOL, atol=ATOL)
                if wrong:
                    hint = _ratio_hint(got[name], expected[name], n) if label == "gradient" else ""
                    if label == "gradient" and not hint:
                        hint = _lost_micro_batch_hint(outcome, case, reference, got, name)
                    return [f"rank {rank}: after a backward inside no_sync() and one outside, {name}'s {label} "
                            f"{wrong} (one process on all the micro-batches){hint}"]
    return []


def _lost_micro_batch_hint(outcome: RunOutcome, case: int, reference: dict, got: dict, name: str) -> str:
    """If the gradient is the average of the micro-batch outside no_sync() only, say the inside one was lost."""
    import torch

    n, inputs = outcome.nproc, outcome.inputs[case]
    model = _model(inputs[0][0])
    with torch.no_grad():
        for parameter, value in zip(model.parameters(), reference["params"][STEPS - 1].values()):
            parameter.copy_(value)
    x = torch.cat([inputs[r][3][1][0] for r in range(n)])
    y = torch.cat([inputs[r][3][1][1] for r in range(n)])
    (torch.nn.functional.mse_loss(model(x), y) / 2).backward()
    outside_only = dict(model.named_parameters())[name].grad
    if first_difference(got[name], outside_only, rtol=1e-4, atol=1e-6):
        return ""
    return (": that is the average of the micro-batch run outside no_sync() only: the gradient computed inside "
            "it was lost; what a backward adds to .grad inside no_sync() must be part of the next average")


def _rank0_parameters(outcome: RunOutcome) -> list[str]:
    """The second case: right after the constructor, every rank holds rank 0's parameters exactly."""
    case = 1
    rank0 = dict(zip(NAMES, outcome.inputs[case][0][0]))
    for rank, result in sorted(outcome.results[case].items()):
        for name in NAMES:
            wrong = first_difference(result.output["start"][name], rank0[name])
            if wrong:
                own = dict(zip(NAMES, outcome.inputs[case][rank][0]))[name]
                hint = (": it is this rank's own: the ranks start different and stay different" if
                        not first_difference(result.output["start"][name], own) else "")
                return [f"rank {rank}, {_label(outcome, case)}: {name} right after the constructor {wrong} "
                        f"(rank 0's){hint}"]
    return []


def _shared_grads(outcome: RunOutcome) -> list[str]:
    """The module with a frozen and a tied parameter: after each finish_gradient_synchronization() the frozen
    parameter's .grad is still None and every other .grad (the tied one: both uses' sum) is one process's."""
    n, case = outcome.nproc, 0
    frozen, tied = _shape_of(outcome, case)
    expected = _reference(outcome, case)["grads"]
    for rank, result in sorted(outcome.results[case].items()):
        for step, got in enumerate(result.output["grads"]):
            where = f"rank {rank}, {_label(outcome, case)}, step {step + 1}"
            for name, want in expected[step].items():
                if want is None:
                    if got[name] is not None:
                        return [f"{where}: {name} is frozen (requires_grad=False) but its .grad is a tensor after "
                                "finish_gradient_synchronization(); a parameter that gets no gradient must keep "
                                ".grad None (the optimizer then skips it)"]
                    continue
                if got[name] is None:
                    return [f"{where}: {name}.grad is None after finish_gradient_synchronization()"]
                wrong = first_difference(got[name], want, rtol=RTOL, atol=ATOL)
                if wrong:
                    hint = _ratio_hint(got[name], want, n)
                    if name in dict(tied).values() and not hint:
                        hint = (": the tied weight's gradient is the sum over both layers that use it, which "
                                "autograd makes before its one hook runs")
                    return [f"{where}: {name}.grad after finish_gradient_synchronization() {wrong}{hint}"]
    return []


def _shared_buckets(outcome: RunOutcome) -> list[str]:
    """The module with a frozen and a tied parameter, each step: one all_reduce per bucket of the gradients that
    exist (the frozen one has none, the tied one is ready once), in the order they become ready."""
    case = 0
    frozen, tied = _shape_of(outcome, case)
    layers = tuple(tuple(w.shape[::-1]) for w in outcome.inputs[case][0][0][::2])
    order = ready_order(layers, frozen, tied)
    sizes = dict(order)
    for rank, result in sorted(outcome.results[case].items()):
        cap = outcome.inputs[case][rank][1]
        expected = greedy_buckets([nbytes for _, nbytes in order], cap)
        for step, times in enumerate(result.output["times"]):
            got = [e["bytes"] for e in _all_reduces(result, times["backward"][0], times["finish_end"])]
            if got == expected:
                continue
            shown = lambda values: ", ".join(binary_bytes(v) for v in values)  # noqa: E731
            where = (f"rank {rank}, {_label(outcome, case)}, step {step + 1}: {len(got)} all_reduce "
                     f"call{'s' if len(got) != 1 else ''}{' of ' + shown(got) if got else ''}, expected "
                     f"{len(expected)}, of {shown(expected)} (buckets of at most {binary_bytes(cap)})")
            extra = sum(got) - sum(expected)
            twice = [source for _, source in tied if sizes.get(source) == extra]
            if twice:
                return [f"{where}: {twice[0]} was all-reduced twice; it is one Parameter used by two layers, "
                        "listed once by module.parameters() and ready once per backward: give it one hook and one "
                        "place in a bucket"]
            if got == expected[:-1]:
                return [f"{where}: the last bucket was never all-reduced; {', '.join(frozen)} is frozen: it gets "
                        "no gradient and its hook never runs, so count only the parameters that require a "
                        "gradient when you wait for the last one"]
            names = tuple(name for name, _ in _model(outcome.inputs[case][0][0], frozen, tied).named_parameters())
            return [where + _bucket_hint(got, expected, cap, order, names)]
    return []


# Bytes: 5 buckets on 2 ranks (two gradients larger than the cap), 3 on 3 ranks. At each cap the buckets in
# the order gradients become ready differ from those made in the order of module.parameters() and started as
# each completes (at 128 B on 2 ranks both would send 104, 256, 32, 128 B).
CAPS = {2: 96, 3: 300}
# The shared module's gradients (104, 32, 256, 32 B at this cap): one more 256 B is the tied weight twice.
SHARED_CAP = 128

DDP_FROM_SCRATCH = Exercise(
    id="02.ddp_from_scratch",
    function="DDPFromScratch",
    signature="DDPFromScratch(module: torch.nn.Module, bucket_cap_bytes: int)",
    driver="ddp_from_scratch",
    allowed_ops=frozenset({"all_reduce", "broadcast"}),
    required_ops=ALL_REDUCE,
    runs=(
        RunSpec(2, lambda n: _cases(n, CAPS[2], seed=81),
                (Item("every .grad is the full-batch average after finish_gradient_synchronization() (2 ranks)", 1,
                      _averaged),
                 Item("3 SGD steps equal one process, from equal and from different parameters (2 ranks)", 1,
                      _equal_to_one_process),
                 Item(f"one all_reduce per bucket of at most {CAPS[2]} B, in the order gradients become ready "
                      "(2 ranks)", 1, _one_all_reduce_per_bucket),
                 Item("the all_reduces start asynchronously while backward runs, and nothing waits before it "
                      "returns (overlap)", 1, _overlapped),
                 Item("no_sync(): nothing sent inside it; the next synchronised step equals one process", 1, _no_sync),
                 Item("the constructor gives every rank rank 0's parameters (2 ranks)", 1, _rank0_parameters))),
        RunSpec(3, lambda n: _cases(n, CAPS[3], seed=91),
                (Item("3 SGD steps equal one process, from equal and from different parameters (3 ranks)", 1,
                      _equal_to_one_process),
                 Item(f"one all_reduce per bucket of at most {CAPS[3]} B (3 ranks)", 1, _one_all_reduce_per_bucket),
                 Item("the constructor gives every rank rank 0's parameters (3 ranks)", 1, _rank0_parameters))),
        RunSpec(2, lambda n: _shared_cases(n, SHARED_CAP, seed=101),
                (Item("a frozen parameter keeps .grad None, a tied weight's gradient is averaged once, the others "
                      "equal one process (2 ranks)", 1, _shared_grads),
                 Item("3 SGD steps of the module with a frozen and a tied parameter equal one process (2 ranks)", 1,
                      _equal_to_one_process),
                 Item(f"one all_reduce per bucket of at most {SHARED_CAP} B of the gradients that exist: none for "
                      "the frozen parameter, the tied one once (2 ranks)", 1, _shared_buckets))),
    ),
    hints=(
        "Reread lesson 02, section 2 (what DDP's constructor does) and, in section 4, 'The two pieces of the "
        "overlap': a hook that runs when a gradient is ready, and an all-reduce that returns before it has "
        "finished.",
        "torch.Tensor.register_post_accumulate_grad_hook; dist.all_reduce(..., async_op=True) and the handle's "
        "wait(); dist.broadcast(..., src=0); contextlib.contextmanager.",
        "Copy rank 0's parameters to every rank once, in the constructor. Give each parameter a hook that, unless "
        "a flag set by no_sync() says otherwise, adds its gradient to the open bucket; when the next gradient "
        "would not fit, flatten the bucket, start its all-reduce without waiting, keep the handle and open a new "
        "bucket; start the last bucket once every gradient has arrived (or at the start of the finish call). "
        "finish_gradient_synchronization() waits for each handle, divides by the world size and copies each "
        "slice back into its parameter's .grad, then forgets the buckets for the next step.",
    ),
)
