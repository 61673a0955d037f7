"""Lesson 07's predictions (see course_lib/predictions/__init__.py).

Each measures from what a run cell of notebooks/07_checkpointing.ipynb published (`cl.results`): the
losses of the resumes, the file holding each of Adam's step counters in the 4-rank checkpoint (from its
`.metadata`), and the files a rank's read plan touched.
"""

from __future__ import annotations

import math

from .spec import Prediction

__all__ = ["PREDICTIONS"]

LEFT_OUT = ("optim", "rng", "epoch")  # the parts left out, in the question's order


def _matching(results) -> tuple:
    """How many of the resumed losses (steps 4-6) equal the uninterrupted run's, per part left out."""
    uninterrupted = results["uninterrupted"][0][3:]
    resumed = results["resumed"][0]
    return tuple(sum(a == b for a, b in zip(resumed[part][1], uninterrupted)) for part in LEFT_OUT)


def _matching_formula(results) -> tuple:
    # A step's loss comes from the forward before its update: without Adam's state the first resumed step
    # still matches (its weights were loaded), the next do not; without the RNG or the epoch, the first
    # resumed step already sees other noise or other rows.
    return 1, 0, 0


def _counters_measured(results) -> tuple:
    """How many of Adam's step counters each rank's file of the 4-rank checkpoint holds (from its .metadata)."""
    files = list(results["four"][0]["step_files"].values())
    return tuple(files.count(f"__{rank}_0.distcp") for rank in range(4))


def _counters_formula(results) -> tuple:
    """The save planner's rule (_dedup_save_plans.py): going through the items in first-seen order (rank 0's
    plan first), each shared item goes to the rank with the fewest bytes planned so far, the lowest on a tie.
    Rank 0's model shards come before every counter in its plan (Adam's exp_avg and exp_avg_sq follow each
    parameter's counter), so rank 0 already has bytes when the first counter comes; each counter (4 bytes) then goes to the emptiest of ranks 1-3 in turn."""
    # Rank 0's shards (kilobytes) outweigh all the counters together (4 bytes each): it never has the fewest.
    planned, held = [math.inf, 0, 0, 0], [0, 0, 0, 0]
    for _ in range(results["four"][0]["parameters"]):
        rank = min(range(4), key=lambda r: planned[r])
        planned[rank] += 4
        held[rank] += 1
    return tuple(held)


def _files_formula(results) -> tuple:
    """Model alone: rank 0 of 2 holds rows [0, half), which ranks 0 and 1 of 4 saved: 2 files. With the
    optimizer: those, and every file holding one of the replicated step counters."""
    counters = set(results["four"][0]["step_files"].values())   # {counter's name: the file holding it}
    return 2, len({"__0_0.distcp", "__1_0.distcp"} | counters)


PREDICTIONS: dict[str, Prediction] = {
    "07.resume_parts": Prediction(
        id="07.resume_parts",
        question="losses of steps 4-6 equal to the uninterrupted run's, without optimizer / RNG / epoch",
        needs="resumed",
        measure=lambda results, ledgers: _matching(results),
        formula=_matching_formula,
        explanation=("a step's loss is computed by the forward before that step's update. Without Adam's state, step "
                     "4's forward still uses the loaded weights, the right rows and noise: it matches; its update then "
                     "starts Adam's moments from zero (and the fresh Adam's step count is already 1, from get_state_dict's "
                     "lr-0 step: section 1), so steps 5 and 6 differ. Without the RNG "
                     "state, step 4 draws the noise the fresh seed gives (step 1's), and without the epoch the "
                     "sampler still shuffles with epoch 0's order in the middle of epoch 1: both differ from step 4 "
                     "on, and once the weights differ nothing matches again."),
        unit="steps",
    ),
    "07.step_counters": Prediction(
        id="07.step_counters",
        question="Adam's step counters in each rank's file of the 4-rank checkpoint (ranks 0, 1, 2, 3)",
        needs="four",
        measure=lambda results, ledgers: _counters_measured(results),
        formula=_counters_formula,
        explanation=("a counter has the same name on every rank, so one rank writes it: the planner goes through "
                     "the items in first-seen order, rank 0's plan first, and gives each shared item to the rank "
                     "with the fewest bytes planned so far (the lowest rank on a tie). Rank 0's model shards come "
                     "before any counter in its state dict (Adam's moments follow each counter), so when the first counter comes rank 0 already has kilobytes planned and "
                     "ranks 1-3 none: the counter goes to rank 1 (4 bytes), the next to rank 2, then rank 3, then "
                     "rank 1 again: 12 counters, 4 each, none in rank 0's file."),
        unit="counters",
    ),
    "07.files_read": Prediction(
        id="07.files_read",
        question="files of the 4-rank checkpoint rank 0 of 2 reads: model alone, model and optimizer",
        needs="four_to_two",
        measure=lambda results, ledgers: tuple(len(results["four_to_two"][0]["read"][label])
                                               for label in ("model", "model and optimizer")),
        formula=_files_formula,
        explanation=("on 2 ranks, rank 0 holds the first half of each parameter's rows, which ranks 0 and 1 of 4 "
                     "saved: it reads their 2 files and never opens the other two. With the optimizer it also needs "
                     "every step counter, and the save spread those (written once each) over ranks 1, 2 and 3: "
                     "every file is read, if only for a few bytes."),
        unit="files",
    ),
}
