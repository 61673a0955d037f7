"""The one place that decides which backend and device the ranks use.

Rule: NCCL with one GPU per rank when this node has at least as many GPUs as
local ranks; otherwise gloo on CPU. Every decision carries a plain-words
reason, which the first output line of a multi-rank cell shows.
"""

from __future__ import annotations

import dataclasses
import os

__all__ = ["BACKEND_CHOICES", "ENV_GLOO_ON_SHARED_GPU", "BackendChoice", "BackendError", "choose_backend", "gpu_count"]

BACKEND_CHOICES = ("auto", "gloo", "nccl")

# "1": where there are fewer GPUs than ranks, `auto` gives gloo moving CUDA tensors, the ranks sharing the
# GPUs (rank r on cuda:r % gpus), instead of gloo on CPU. Only the GPU script sets it (tests/gpu_node/):
# on a machine with one GPU it runs a 2-rank cell's device paths, which 1-rank NCCL cannot.
ENV_GLOO_ON_SHARED_GPU = "COURSE_GLOO_ON_SHARED_GPU"


class BackendError(ValueError):
    """The requested backend cannot run here (e.g. NCCL without a GPU per rank)."""


@dataclasses.dataclass(frozen=True)
class BackendChoice:
    backend: str  # "gloo" or "nccl"
    device_type: str  # "cpu" or "cuda"
    reason: str  # why, in plain words, for the first output line
    # What the caller asked for ("auto", "gloo", "nccl"): a cell that asked for gloo keeps its tensors on
    # the CPU on purpose, so the GPU-node rehearsal leaves it alone (launcher/torchrun.py).
    requested: str = "auto"

    def header(self, nproc: int, tag: str = "torchrun") -> str:
        """The first line a multi-rank cell prints: world size, backend, device, why."""
        ranks = "1 rank" if nproc == 1 else f"{nproc} ranks"
        return f"[{tag}] {ranks}, backend {self.backend} on {self.device_type} ({self.reason})"


def gpu_count() -> int:
    """CUDA GPUs visible to this process (0 when torch has no CUDA)."""
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def choose_backend(nproc: int, requested: str = "auto", *, gpus: int | None = None) -> BackendChoice:
    """Pick backend and device for `nproc` ranks on this node.

    `gpus` overrides the detected GPU count (used by tests and by launch
    scripts that already know it).
    """
    if requested not in BACKEND_CHOICES:
        raise BackendError(f"unknown backend {requested!r}: choose one of {', '.join(BACKEND_CHOICES)}")
    if gpus is None:
        gpus = gpu_count()
    gpu_word = "GPU" if gpus == 1 else "GPUs"

    if requested == "gloo":
        return BackendChoice("gloo", "cpu", "asked for gloo", requested="gloo")
    if requested == "nccl":
        if gpus < nproc:
            raise BackendError(
                f"--backend nccl needs one GPU per rank: {nproc} ranks asked, {gpus} {gpu_word} found; "
                "use --backend gloo (or auto)"
            )
        return BackendChoice("nccl", "cuda", f"asked for nccl, {gpus} {gpu_word} found, one per rank", requested="nccl")
    # auto
    if gpus == 0:
        return BackendChoice("gloo", "cpu", "no CUDA GPU found")
    if gpus < nproc:
        if os.environ.get(ENV_GLOO_ON_SHARED_GPU) == "1":
            return BackendChoice("gloo", "cuda", f"{gpus} {gpu_word} for {nproc} ranks, shared: gloo moving CUDA "
                                                 f"tensors ({ENV_GLOO_ON_SHARED_GPU}=1)")
        return BackendChoice("gloo", "cpu", f"{gpus} {gpu_word} for {nproc} ranks; NCCL needs one GPU per rank")
    return BackendChoice("nccl", "cuda", f"{gpus} {gpu_word} found, one per rank")
