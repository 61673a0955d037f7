"""course_lib.backend_choice: the one rule that picks backend and device (pure, no processes)."""

import sys

import pytest

from course_lib.backend_choice import BACKEND_CHOICES, BackendChoice, BackendError, choose_backend, gpu_count


def test_auto_without_gpu_is_gloo_on_cpu():
    choice = choose_backend(2, "auto", gpus=0)
    assert (choice.backend, choice.device_type) == ("gloo", "cpu")
    assert choice.reason == "no CUDA GPU found"


def test_auto_is_the_default():
    assert choose_backend(4, gpus=0) == choose_backend(4, "auto", gpus=0)


@pytest.mark.parametrize(("nproc", "gpus", "reason"), [
    (2, 1, "1 GPU for 2 ranks; NCCL needs one GPU per rank"),
    (4, 3, "3 GPUs for 4 ranks; NCCL needs one GPU per rank"),
])
def test_auto_with_fewer_gpus_than_ranks_falls_back_to_gloo(nproc, gpus, reason):
    choice = choose_backend(nproc, "auto", gpus=gpus)
    assert (choice.backend, choice.device_type) == ("gloo", "cpu")
    assert choice.reason == reason


@pytest.mark.parametrize(("nproc", "gpus", "reason"), [
    (1, 1, "1 GPU found, one per rank"),
    (2, 2, "2 GPUs found, one per rank"),
    (2, 8, "8 GPUs found, one per rank"),
])
def test_auto_with_a_gpu_per_rank_is_nccl_on_cuda(nproc, gpus, reason):
    choice = choose_backend(nproc, "auto", gpus=gpus)
    assert (choice.backend, choice.device_type) == ("nccl", "cuda")
    assert choice.reason == reason


@pytest.mark.parametrize("gpus", [0, 1, 8])
def test_explicit_gloo_is_always_cpu(gpus):
    assert choose_backend(4, "gloo", gpus=gpus) == BackendChoice("gloo", "cpu", "asked for gloo", requested="gloo")


def test_explicit_nccl_with_enough_gpus():
    choice = choose_backend(2, "nccl", gpus=2)
    assert (choice.backend, choice.device_type) == ("nccl", "cuda")
    assert choice.reason == "asked for nccl, 2 GPUs found, one per rank"


@pytest.mark.parametrize(("nproc", "gpus", "counts"), [
    (2, 0, "2 ranks asked, 0 GPUs found"),
    (2, 1, "2 ranks asked, 1 GPU found"),
    (8, 4, "8 ranks asked, 4 GPUs found"),
])
def test_nccl_without_a_gpu_per_rank_is_a_one_line_error_with_the_counts(nproc, gpus, counts):
    with pytest.raises(BackendError) as info:
        choose_backend(nproc, "nccl", gpus=gpus)
    message = str(info.value)
    assert "\n" not in message
    assert counts in message
    assert "--backend gloo" in message  # says what to do instead


@pytest.mark.parametrize("requested", ["bogus", "NCCL", "", "mpi"])
def test_unknown_backend_is_an_error_naming_the_choices(requested):
    with pytest.raises(BackendError) as info:
        choose_backend(2, requested, gpus=0)
    message = str(info.value)
    assert "\n" not in message
    assert repr(requested) in message
    assert all(name in message for name in BACKEND_CHOICES)


def test_backend_error_is_a_value_error():
    # Callers that only know ValueError still catch it.
    assert issubclass(BackendError, ValueError)


def test_gpu_count_is_only_detected_when_not_given(monkeypatch):
    backend_mod = sys.modules["course_lib.backend_choice"]
    monkeypatch.setattr(backend_mod, "gpu_count", lambda: 4)
    assert choose_backend(4).backend == "nccl"
    assert choose_backend(4, gpus=0).backend == "gloo"


@pytest.mark.skipif(gpu_count() > 0, reason="this machine has a CUDA GPU")
def test_this_machine_without_gpu_picks_gloo():
    choice = choose_backend(2)
    assert (choice.backend, choice.device_type) == ("gloo", "cpu")


@pytest.mark.parametrize(("nproc", "expected"), [
    (1, "[torchrun] 1 rank, backend gloo on cpu (no CUDA GPU found)"),
    (2, "[torchrun] 2 ranks, backend gloo on cpu (no CUDA GPU found)"),
    (4, "[torchrun] 4 ranks, backend gloo on cpu (no CUDA GPU found)"),
])
def test_header_names_world_size_backend_device_and_reason(nproc, expected):
    assert choose_backend(nproc, gpus=0).header(nproc) == expected


def test_header_for_nccl():
    assert choose_backend(2, gpus=2).header(2) == "[torchrun] 2 ranks, backend nccl on cuda (2 GPUs found, one per rank)"


def test_the_gpu_script_can_have_ranks_share_a_gpu_through_gloo(monkeypatch):
    """COURSE_GLOO_ON_SHARED_GPU=1 (tests/gpu_node/ only): fewer GPUs than ranks gives gloo on CUDA, said in
    the header; without it, or without any GPU, gloo stays on the CPU; a GPU per rank is NCCL either way."""
    from course_lib.backend_choice import ENV_GLOO_ON_SHARED_GPU

    monkeypatch.delenv(ENV_GLOO_ON_SHARED_GPU, raising=False)
    assert (choose_backend(2, gpus=1).backend, choose_backend(2, gpus=1).device_type) == ("gloo", "cpu")
    monkeypatch.setenv(ENV_GLOO_ON_SHARED_GPU, "1")
    shared = choose_backend(2, gpus=1)
    assert (shared.backend, shared.device_type) == ("gloo", "cuda")
    assert shared.header(2) == ("[torchrun] 2 ranks, backend gloo on cuda (1 GPU for 2 ranks, shared: gloo moving "
                                "CUDA tensors (COURSE_GLOO_ON_SHARED_GPU=1))")
    assert choose_backend(2, gpus=0).device_type == "cpu"
    assert choose_backend(2, gpus=2).backend == "nccl"
