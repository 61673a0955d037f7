"""04.wrap_policy: an auto-wrap policy of the learner's own; graded by the units FSDP built and one SGD step."""

from __future__ import annotations

from ...spec import Exercise, Item, RunOutcome, RunSpec
from .common import FSDP1_OPS, FSDP_PRELOAD, LR, compare_params, draw_batch, draw_weights, sgd_reference

__all__ = ["MIN_NUMEL", "WRAP_A", "WRAP_B", "WRAP_POLICY", "expected_units", "linear_sizes"]

MIN_NUMEL = 1000  # 04.wrap_policy: a Linear outside a Block with at least this many parameters is a unit


def _policy_case(n: int, sizes: dict, weights_seed: int, rows: int, batch_seed: int) -> dict[int, tuple]:
    from .drivers import wrap_model

    weights = draw_weights(lambda: wrap_model(sizes), weights_seed)
    inputs, targets = draw_batch(n * rows, sizes["features"], sizes["out"], batch_seed)
    return {r: (sizes, weights, inputs[r * rows:(r + 1) * rows], targets[r * rows:(r + 1) * rows], LR)
            for r in range(n)}


def linear_sizes(sizes: dict) -> dict[str, tuple[int, bool]]:
    """{name: (parameters, inside a Block)} of every Linear of wrap_model(sizes)."""
    import torch

    from ....models import Block
    from .drivers import wrap_model

    model = wrap_model(sizes)
    inside = {f"{name}.{child}" for name, m in model.named_modules() if isinstance(m, Block)
              for child, _ in m.named_modules() if child}
    return {name: (sum(p.numel() for p in m.parameters()), name in inside)
            for name, m in model.named_modules() if isinstance(m, torch.nn.Linear)}


def expected_units(sizes: dict, min_numel: int = MIN_NUMEL, strictly_more: bool = False) -> list[str]:
    """The FSDP units of wrap_model(sizes) under the policy's rule: the root (""), every Block, every Linear
    outside a Block with at least `min_numel` parameters (more than, with `strictly_more`), in module order."""
    from ....models import Block
    from .drivers import wrap_model

    linears = linear_sizes(sizes)
    units = []
    for name, module in wrap_model(sizes).named_modules():
        numel, inside = linears.get(name, (0, True))
        big = numel > min_numel if strictly_more else numel >= min_numel
        if name == "" or isinstance(module, Block) or (name in linears and not inside and big):
            units.append(name)
    return units


def _policy_label(outcome: RunOutcome, case: int) -> str:
    sizes = outcome.inputs[case][0][0]
    return (f"case {case + 1} of {len(outcome.inputs)} ({sizes['layers']} Blocks, "
            f"stem.0 Linear({sizes['features']}, {sizes['width']}), head Linear({sizes['dim']}, {sizes['out']}))")


def _units_hint(got: list[str], sizes: dict) -> str:
    linears = linear_sizes(sizes)
    expected = expected_units(sizes)
    missing = [name for name in expected if name not in got]
    extra = [name for name in got if name not in expected]
    if got == [""]:
        return ("only the root is a unit: FSDP first asks the policy with recurse=True whether to look inside a "
                "module (nonwrapped_numel is then everything below it); return True there, and decide with "
                "recurse=False")
    if got == expected_units(sizes, strictly_more=True):
        exact = [name for name in missing if linears.get(name, (0,))[0] == MIN_NUMEL]
        return (f"{exact[0]} has exactly {MIN_NUMEL} parameters: 'at least' is nonwrapped_numel >= MIN_NUMEL, "
                "not >")
    inside = [name for name in extra if linears.get(name, (0, False))[1]]
    small = [name for name in extra if name in linears and not linears[name][1]]
    if inside:
        return (f"{inside[0]} is a Linear inside a Block ({linears[inside[0]][0]} parameters): its Block's unit "
                f"holds it; wrap a Linear only with at least {MIN_NUMEL} parameters, and Blocks whatever their size")
    if small:
        return (f"{small[0]} has {linears[small[0]][0]} parameters, fewer than {MIN_NUMEL}: leave it to its parent's "
                "unit")
    blocks = [name for name in missing if name.startswith("blocks.")]
    if blocks:
        return f"{blocks[0]} is a Block: every Block must be a unit of its own (isinstance(module, Block))"
    return f"missing {', '.join(missing) or 'none'}; not expected {', '.join(extra) or 'none'}"


def _units(outcome: RunOutcome) -> list[str]:
    """The modules that became FSDP units (FSDP.fsdp_modules, named as in the plain model) are the expected ones."""
    for case, by_rank in enumerate(outcome.results):
        sizes = outcome.inputs[case][0][0]
        expected = expected_units(sizes)
        for rank, result in sorted(by_rank.items()):
            got = result.output["units"]
            if got == expected:
                continue
            shown = lambda names: "[" + ", ".join(repr(n) for n in names) + "]"  # noqa: E731
            return [f"rank {rank}, {_policy_label(outcome, case)}: the FSDP units are {shown(got)}, expected "
                    f"{shown(expected)}: {_units_hint(got, sizes)}"]
    return []


def _policy_trained(outcome: RunOutcome) -> list[str]:
    """After one SGD step every rank's whole parameters equal one process's step on the whole batch."""
    import torch

    from .drivers import wrap_model

    for case, by_rank in enumerate(outcome.results):
        sizes, weights, _, _, lr = outcome.inputs[case][0]
        inputs = torch.cat([outcome.inputs[case][r][2] for r in range(outcome.nproc)])
        targets = torch.cat([outcome.inputs[case][r][3] for r in range(outcome.nproc)])
        model = wrap_model(sizes)
        model.load_state_dict(weights)
        expected = sgd_reference(model, [(inputs, targets)], lr)
        for rank, result in sorted(by_rank.items()):
            wrong = compare_params(result.output["params"], expected, f"rank {rank}, {_policy_label(outcome, case)}")
            if wrong:
                return [wrong]
    return []


WRAP_A = {"features": 9, "width": 100, "dim": 8, "hidden": 13, "layers": 2, "out": 5}  # stem.0: exactly 1000
WRAP_B = {"features": 26, "width": 37, "dim": 8, "hidden": 13, "layers": 3, "out": 120}  # stem.0: 999, head: 1080

WRAP_POLICY = Exercise(
    id="04.wrap_policy",
    function="policy",
    signature="policy(module: torch.nn.Module, recurse: bool, nonwrapped_numel: int) -> bool",
    driver="fsdp_wrap_policy",
    allowed_ops=FSDP1_OPS,
    preload=FSDP_PRELOAD,
    runs=(
        RunSpec(2, lambda n: [_policy_case(n, WRAP_A, 41, 2, 141)],
                (Item("the FSDP units: the root, each Block, stem.0 with exactly 1000 parameters (2 ranks)", 1,
                      _units),
                 Item("one SGD step equals one process on the whole batch (2 ranks)", 1, _policy_trained)),
                timeout_s=10),
        RunSpec(3, lambda n: [_policy_case(n, WRAP_B, 42, 2, 142)],
                (Item("the FSDP units: the root, each Block, the head with 1080 parameters (3 ranks)", 1, _units),
                 Item("one SGD step equals one process on the whole batch (3 ranks)", 1, _policy_trained)),
                timeout_s=10),
    ),
    hints=(
        "Reread lesson 04, section 6 'Wrap policies and the peak' (the custom policy, and how FSDP walks the "
        "module tree asking it).",
        "A callable auto_wrap_policy(module, recurse, nonwrapped_numel), as FullyShardedDataParallel calls "
        "it; isinstance with course_lib.models.Block and torch.nn.Linear.",
        "FSDP asks about each module twice: first whether to look inside it (it must look everywhere to reach"
        " the modules you want), then, once its children are done, whether to make it a unit; answer that "
        "second question from the module's type and from the parameters no unit below has taken.",
    ),
)
