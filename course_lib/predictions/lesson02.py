"""Lesson 02's predictions (see course_lib/predictions/__init__.py).

- `02.sampler_counts` (section 3): indices per rank from `DistributedSampler`, padded and with `drop_last`.
- `02.bucket_calls` (section 4): DDP's all-reduces in a step after the bucket rebuild, and the bytes of the first.
- `02.memory_bytes` (section 9): the bytes one rank holds after an Adam step under DDP.
"""

from __future__ import annotations

import math
from typing import Mapping

from .. import theory
from .spec import Prediction, Tolerance

__all__ = ["PREDICTIONS", "ddp_buckets"]


def _sampler_counts(results: Mapping, ledgers: Mapping) -> tuple:
    """(indices rank 0 got, padded; with drop_last), or every rank's pair when the ranks got different numbers."""
    got = {rank: (len(value["padded"]), len(value["drop_last"])) for rank, value in results["sampler"].items()}
    if len(set(got.values())) != 1:
        return tuple(got[rank] for rank in sorted(got))
    return got[0]


def _sampler_formula(results: Mapping) -> tuple:
    """Padding: ceil(n / N) each (the list padded to a multiple of N); drop_last: floor(n / N)."""
    size, world = results["sampler"][0]["dataset_size"], len(results["sampler"])
    return math.ceil(size / world), size // world


def _by_step(entries: list[dict]) -> list[list[dict]]:
    """One rank's all_reduce calls, cut at its world barriers: step k = the calls after the k-th barrier."""
    steps: list[list[dict]] = []
    for entry in entries:
        if entry["op"] == "barrier" and entry["group"] == "world":
            steps.append([])
        elif steps and entry["op"] == "all_reduce":
            steps[-1].append(entry)
    return steps


def _bucket_calls(results: Mapping, ledgers: Mapping) -> tuple:
    """(all_reduce calls in the last step on rank 0, bytes of the first one)."""
    last = _by_step(ledgers[0])[-1]
    return len(last), last[0]["bytes"] if last else 0


def ddp_buckets(grad_bytes: list[int], cap_bytes: float) -> list[int]:
    """Bytes of DDP's rebuilt buckets (section 4's rule): gradients in reverse order of `model.parameters()`
    (`grad_bytes` is in parameter order), a bucket closed as soon as its size reaches the cap.

    The rule of torch 2.13 with `find_unused_parameters=False`, after the first iteration, for a model
    whose gradients become ready in reverse parameter order (as a stack of layers does).
    """
    buckets: list[int] = []
    for nbytes in reversed(grad_bytes):
        if not buckets or buckets[-1] >= cap_bytes:
            buckets.append(0)
        buckets[-1] += nbytes
    return buckets


def _bucket_formula(results: Mapping) -> tuple:
    shapes = results["buckets"][0]
    buckets = ddp_buckets(shapes["grad_bytes"], shapes["cap_bytes"])
    return len(buckets), buckets[0]


def _memory_held(results: Mapping, ledgers: Mapping) -> int:
    """Rank 0 after the step: parameters, gradients, Adam's state and DDP's buckets (the table's `ddp buckets`
    column; `measure_step`'s category "buffers")."""
    after_step = results["memory"][0]["phases"]["step"]
    return sum(after_step[k] for k in ("parameters", "gradients", "optimizer", "buffers"))


def _memory_formula(results: Mapping) -> int:
    """16 bytes per parameter (4 weight, 4 gradient, 8 Adam), 4 more for DDP's buckets, and Adam's 4-byte
    `step` counter per parameter tensor."""
    numels = results["memory_numels"][0]
    per_param = theory.bytes_per_param(precision="fp32", optimizer="adam").total + 4
    return per_param * sum(numels) + 4 * len(numels)


PREDICTIONS: dict[str, Prediction] = {
    "02.sampler_counts": Prediction(
        id="02.sampler_counts",
        question="indices per rank for 10 samples over 4 ranks (padded, drop_last=True)",
        needs="sampler",
        measure=_sampler_counts,
        formula=_sampler_formula,
        explanation=("with padding every rank gets ceil(10 / 4) = 3 indices: the sampler repeats the first two "
                     "indices (0 and 1) to make 12, so ranks 2 and 3 see samples 0 and 1 a second time. With "
                     "drop_last=True it cuts the list to 4 x floor(10 / 4) = 8 indices, 2 per rank, and samples 8 "
                     "and 9 are not seen in this epoch."),
        unit="indices",
        tolerance=Tolerance(),
    ),
    "02.bucket_calls": Prediction(
        id="02.bucket_calls",
        question="all_reduce calls in step 3, and the bytes of the first",
        needs="buckets",
        measure=_bucket_calls,
        formula=_bucket_formula,
        explanation=("each layer's gradients take (128 x 128 + 128) x 4 = 66,048 bytes. In reverse order 5.bias "
                     "and 5.weight make 66,048 bytes, below the cap of 104,857; 4.bias and 4.weight bring the "
                     "bucket to 132,096 bytes, which reaches the cap and closes it. Every bucket holds two layers: "
                     "3 buckets of 132,096 bytes, one all_reduce each, 396,288 bytes in all, as many as one "
                     "bucket would send."),
        unit="",
        tolerance=Tolerance(),
    ),
    "02.memory_bytes": Prediction(
        id="02.memory_bytes",
        question="bytes one rank holds after the Adam step under DDP",
        needs="memory",
        measure=_memory_held,
        formula=_memory_formula,
        explanation=("every rank holds the whole model's state: 4 bytes per parameter for the weights, 4 for the "
                     "gradients, 8 for Adam's two moments, and 4 for DDP's buckets (a second copy of the "
                     "gradients, unless gradient_as_bucket_view=True): 20 x 99,072 = 1,981,440 bytes, plus Adam's "
                     "4-byte step counter for each of the 12 parameter tensors, 48 bytes. Two ranks or a thousand, "
                     "the bytes per rank stay the same."),
        unit="B",
        tolerance=Tolerance(relative=0.01),
    ),
}
