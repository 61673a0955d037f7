"""04.wrap_policy: an auto-wrap policy for a partly frozen model (FSDP1 refuses a unit mixing frozen and trainable
parameters with use_orig_params=False); graded by the units FSDP built and one SGD step."""

from __future__ import annotations

from ...compare import each_result
from ...spec import Exercise, Item, RunOutcome, RunSpec
from .common import FSDP1_OPS, FSDP_PRELOAD, LR, compare_params, draw_batch, draw_weights, sgd_reference

__all__ = ["WRAP_A", "WRAP_B", "WRAP_POLICY", "expected_units"]


def _policy_case(n: int, sizes: dict, weights_seed: int, rows: int, batch_seed: int) -> dict[int, tuple]:
    from .drivers import wrap_model

    weights = draw_weights(lambda: wrap_model(sizes), weights_seed)
    inputs, targets = draw_batch(n * rows, sizes["features"], sizes["out"], batch_seed)
    return {r: (sizes, weights, inputs[r * rows:(r + 1) * rows], targets[r * rows:(r + 1) * rows], LR)
            for r in range(n)}


def _own(module) -> list:
    return list(module.parameters(recurse=False))


def expected_units(sizes: dict) -> list[str]:
    """The FSDP units of wrap_model(sizes), in module order: the root (""), every Block, and every module whose
    own parameters (recurse=False) are all frozen: FSDP asks children before parents, so a frozen module is a unit
    before its parent is asked, and a parent left with nothing to hold is not one."""
    from ....models import Block
    from .drivers import wrap_model

    return [name for name, module in wrap_model(sizes).named_modules()
            if name == "" or isinstance(module, Block) or (_own(module) and not any(p.requires_grad
                                                                                  for p in _own(module)))]


def _policy_label(outcome: RunOutcome, case: int) -> str:
    sizes = outcome.inputs[case][0][0]
    return f"case {case + 1} of {len(outcome.inputs)} ({sizes['layers']} Blocks, frozen: {', '.join(sizes['frozen'])})"


def _units_hint(got: list[str], held: dict, sizes: dict) -> str:
    from .drivers import wrap_model

    model = wrap_model(sizes)
    expected = expected_units(sizes)
    extra = [name for name in got if name not in expected]
    missing = [name for name in expected if name not in got]
    empty = [name for name in extra if held.get(name) == 0]
    if empty:
        module = model.get_submodule(empty[0])
        if list(module.parameters()):
            what = "has nothing left to hold (its children are units already, their FlatParameters frozen)"
        else:
            what = "has no parameters (all(...) over none is True)"
        return (f"{empty[0]} ({type(module).__name__}) {what}, yet it became a unit of 0 parameters: a module "
                "with nonwrapped_numel 0 is not a unit")
    trainable = [name for name in extra if any(p.requires_grad for p in model.get_submodule(name).parameters())]
    if trainable:
        return (f"{trainable[0]} is trainable and not a Block: the root's unit holds it (only Blocks and frozen "
                "modules are units)")
    blocks = [name for name in missing if name.startswith("blocks.") and name.count(".") == 1]
    if blocks:
        return (f"{blocks[0]} is a Block: every Block must be a unit of its own; FSDP asks whether to make a "
                "module a unit (recurse=False) only if it was let inside it (recurse=True)")
    return f"missing {', '.join(missing) or 'none'}; not expected {', '.join(extra) or 'none'}"


def _units(outcome: RunOutcome) -> list[str]:
    """The modules that became FSDP units (FSDP.fsdp_modules, named as in the plain model) are the expected ones."""
    for case, rank, result in each_result(outcome):
        sizes = outcome.inputs[case][0][0]
        expected = expected_units(sizes)
        got = result.output["units"]
        if got == expected:
            continue
        shown = lambda names: "[" + ", ".join(repr(n) for n in names) + "]"  # noqa: E731
        return [f"rank {rank}, {_policy_label(outcome, case)}: the FSDP units are {shown(got)}, expected "
                f"{shown(expected)}: {_units_hint(got, result.output['held'], sizes)}"]
    return []


def _policy_trained(outcome: RunOutcome) -> list[str]:
    """After one SGD step every rank's whole parameters equal one process's step on the whole batch (the frozen
    ones unchanged)."""
    import torch

    from .drivers import wrap_model

    expected = {}
    for case, rank, result in each_result(outcome):
        if case not in expected:
            sizes, weights, _, _, lr = outcome.inputs[case][0]
            inputs = torch.cat([outcome.inputs[case][r][2] for r in range(outcome.nproc)])
            targets = torch.cat([outcome.inputs[case][r][3] for r in range(outcome.nproc)])
            model = wrap_model(sizes)
            model.load_state_dict(weights)
            expected[case] = sgd_reference(model, [(inputs, targets)], lr)
        wrong = compare_params(result.output["params"], expected[case], f"rank {rank}, {_policy_label(outcome, case)}")
        if wrong:
            return [wrong]
    return []


# embed.0 and embed.1 frozen in both: two units, not embed (left with nothing); the norm frozen in A, trainable in
# B; in B a Linear inside a Block is frozen (blocks.0.up: a unit inside its Block's).
WRAP_A = {"features": 6, "dim": 8, "hidden": 13, "layers": 2, "out": 5, "frozen": ["embed", "norm"]}
WRAP_B = {"features": 7, "dim": 8, "hidden": 12, "layers": 3, "out": 4, "frozen": ["embed", "blocks.0.up"]}

WRAP_POLICY = Exercise(
    id="04.wrap_policy",
    function="policy",
    signature="policy(module: torch.nn.Module, recurse: bool, nonwrapped_numel: int) -> bool",
    driver="fsdp_wrap_policy",
    allowed_ops=FSDP1_OPS,
    preload=FSDP_PRELOAD,
    runs=(
        RunSpec(2, lambda n: [_policy_case(n, WRAP_A, 41, 2, 141)],
                (Item("the FSDP units: the root, each Block, embed.0, embed.1 and norm (2 ranks)", 1, _units),
                 Item("one SGD step equals one process on the whole batch (2 ranks)", 1, _policy_trained)),
                timeout_s=10),
        RunSpec(3, lambda n: [_policy_case(n, WRAP_B, 42, 2, 142)],
                (Item("the FSDP units: the root, each Block, embed.0, embed.1 and blocks.0.up (3 ranks)", 1,
                      _units),
                 Item("one SGD step equals one process on the whole batch (3 ranks)", 1, _policy_trained)),
                timeout_s=10),
    ),
    hints=(
        "Reread lesson 04, section 6 'Wrap policies and the peak' (how FSDP walks the module tree asking the "
        "policy), and the appendix on options (frozen and trainable parameters in one unit).",
        "A parameter's requires_grad; module.parameters(recurse=False); nonwrapped_numel.",
        "FSDP asks about each module twice: first whether to look inside it (it must look everywhere), then, once "
        "its children are done, whether to make it a unit; answer that second question from the module's type and "
        "its own parameters, and never for a module that has nothing left to hold.",
    ),
)
