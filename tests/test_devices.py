"""Where a rank computes: ``modelparallel/devices.py`` with a faked GPU count, in one process.

A failure means a rank would take a GPU its machine lacks (CUDA's "invalid device ordinal" at
start-up instead of a sentence), ``MODELPARALLEL_DEVICE=cpu`` no longer keeps a job on CPU, or a
bad value of it is accepted silently. Look at ``rank_device`` and ``launch_problems`` first.
"""

import pytest
import torch

from modelparallel import devices


@pytest.fixture
def gpus(monkeypatch):
    """Pretend this machine shows ``n`` GPUs (``set(n)``), with the device switch unset."""
    monkeypatch.delenv(devices.DEVICE_ENV, raising=False)
    made_current = []
    monkeypatch.setattr(torch.cuda, "set_device", made_current.append)

    def fake(n: int):
        monkeypatch.setattr(torch.cuda, "is_available", lambda: n > 0)
        monkeypatch.setattr(torch.cuda, "device_count", lambda: n)
        return made_current

    return fake


def test_each_local_rank_takes_its_own_gpu(gpus):
    made_current = gpus(2)
    assert devices.rank_device(1) == torch.device("cuda", 1) and made_current == [1]
    assert devices.backend() == "nccl" and devices.gpu_count() == 2


def test_a_local_rank_without_a_gpu_is_refused_with_the_counts(gpus):
    gpus(1)
    with pytest.raises(RuntimeError, match=r"local rank 1 has no GPU: this machine shows 1 GPU\(s\).*"
                                           r"MODELPARALLEL_DEVICE=cpu"):
        devices.rank_device(1)


def test_the_cpu_switch_keeps_a_gpu_machine_on_cpu(gpus, monkeypatch):
    made_current = gpus(1)
    monkeypatch.setenv(devices.DEVICE_ENV, "cpu")
    assert devices.rank_device(3) == torch.device("cpu") and devices.backend() == "gloo"
    assert devices.gpu_count() == 0 and devices.launch_problems(8, "fix") == [] and made_current == []


def test_cuda_asked_for_without_a_gpu_and_bad_values_are_errors(gpus, monkeypatch):
    gpus(0)
    monkeypatch.setenv(devices.DEVICE_ENV, "cuda")
    with pytest.raises(RuntimeError, match="MODELPARALLEL_DEVICE=cuda but PyTorch sees no GPU"):
        devices.rank_device(0)
    monkeypatch.setenv(devices.DEVICE_ENV, "gpu")
    with pytest.raises(ValueError, match="MODELPARALLEL_DEVICE='gpu': use one of cpu, cuda"):
        devices.requested()


def test_launch_problems_compare_ranks_per_machine_with_gpus(gpus):
    gpus(0)
    assert devices.launch_problems(4, "fix") == []  # no GPU: a CPU run, any rank count
    gpus(2)
    assert devices.launch_problems(2, "fix") == []
    (line,) = devices.launch_problems(3, "lower --nproc")
    assert "3 ranks per machine but PyTorch sees 2 GPU(s)" in line and "lower --nproc" in line
    assert "MODELPARALLEL_DEVICE=cpu" in line and "\n" not in line
