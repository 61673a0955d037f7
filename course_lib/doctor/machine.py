"""What this machine offers for distributed training: cores, memory, GPUs, backends.

Defined in notebooks/00_setup.ipynb.
"""

from __future__ import annotations

import os
import platform

import psutil

__all__ = ["describe_machine"]


def describe_machine(*, show: bool = True) -> dict:
    """Print and return cores, memory, Python/torch versions, GPUs and compiled-in backends."""
    import torch
    import torch.distributed as dist

    gpus = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())] if torch.cuda.is_available() else []
    info = {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "cpu_cores": os.cpu_count(),
        "memory_gib": round(psutil.virtual_memory().total / 2**30, 1),
        "gpus": gpus,
        "distributed_available": dist.is_available(),
        "backends": {
            "gloo": dist.is_gloo_available(),
            "nccl": dist.is_nccl_available(),
            "mpi": dist.is_mpi_available(),
            "xccl": getattr(dist, "is_xccl_available", lambda: False)(),
        },
    }
    if show:
        print(f"Python {info['python']}, torch {info['torch']}")
        print(f"CPU cores: {info['cpu_cores']}, memory: {info['memory_gib']} GiB")
        print(f"CUDA GPUs: {len(gpus)}" + (f" ({', '.join(gpus)})" if gpus else ""))
        print("torch.distributed available:", info["distributed_available"])
        print("backends compiled into this torch:", ", ".join(k for k, v in info["backends"].items() if v) or "none")
    return info
