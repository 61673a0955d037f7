"""Lesson 07's predictions (see course_lib/predictions/__init__.py).

Each measures from what a run cell of notebooks/07_checkpointing.ipynb published (`cl.results`): the
losses of the resumes, the tensor bytes in each file of the 4-rank checkpoint (from its `.metadata`),
and the files a rank's read plan touched.
"""

from __future__ import annotations

from ..theory import chunk_sizes
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


def _rank0_formula(results) -> int:
    """Rank 0's rows of every parameter (torch.chunk of dim 0 over 4), three times (weights, exp_avg,
    exp_avg_sq), 4 bytes each. The step counters are left out of the question and of the measure alike."""
    published = results["four"][0]
    rows = 0
    for shape in published["shapes"].values():
        columns = 1
        for size in shape[1:]:
            columns *= size
        rows += chunk_sizes(shape[0], 4)[0] * columns
    return 3 * 4 * rows


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
                     "starts Adam's moments from zero and step count 1, so steps 5 and 6 differ. Without the RNG "
                     "state, step 4 draws the noise the fresh seed gives (step 1's), and without the epoch the "
                     "sampler still shuffles with epoch 0's order in the middle of epoch 1: both differ from step 4 "
                     "on, and once the weights differ nothing matches again."),
        unit="steps",
    ),
    "07.rank0_bytes": Prediction(
        id="07.rank0_bytes",
        question="bytes of shards (rows of parameters, exp_avg, exp_avg_sq) in rank 0's file of the 4-rank checkpoint",
        needs="four",
        measure=lambda results, ledgers: results["four"][0]["shard_bytes"]["__0_0.distcp"],
        formula=_rank0_formula,
        explanation=("every parameter's dim 0 divides by 4, so rank 0 holds a quarter of the rows of each: 589 of the "
                     "2,356 parameters, and Adam's exp_avg and exp_avg_sq are sharded the same way: 3 x 589 x 4 bytes. "
                     "The step counters (plain tensors with the same name on every rank) are written once each, by "
                     "the rank with the fewest bytes planned when the planner reaches them; rank 0's shards come "
                     "first in its order, so here they went to ranks 1-3 (cl.results['four'][0]['step_files']). The "
                     "file on disk is larger: each tensor carries torch.save's header."),
        unit="B",
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
