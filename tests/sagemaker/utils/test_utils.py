"""SageMaker v2's ``torch.sagemaker.utils`` and ``logger`` helpers under ``modelparallel``.

A failure names the helper: ``get_global_ranks`` listing the wrong members of a group (a
checkpoint coordinator outside the group), ``timeit`` logging on the wrong rank, or the module
helpers losing parameter identity (ties) or leaving tensors on meta.
"""

import logging

import torch
from torch import nn

import harness
import modelparallel as smp
from modelparallel.sagemaker.logger import get_logger
from modelparallel.sagemaker.utils.module_utils import empty_module_params, move_buffers_to_device
from modelparallel.sagemaker.utils.process_group_utils import get_global_ranks
from modelparallel.sagemaker.utils.utils import timeit


def global_ranks():
    smp.init({"tensor_parallel_degree": 2})
    return get_global_ranks(smp.get_tp_process_group()), get_global_ranks(smp.get_rdp_process_group()), \
        get_global_ranks()


def test_get_global_ranks():
    out = harness.run(4, global_ranks)
    for rank, (tp, rdp, world) in enumerate(out):
        assert tp == [rank - rank % 2, rank - rank % 2 + 1] and rdp == [rank % 2, rank % 2 + 2]
        assert world == [0, 1, 2, 3]


def test_timeit_logs_on_rank_0_only(caplog):
    get_logger()
    logging.getLogger("modelparallel").propagate = True
    try:
        with caplog.at_level(logging.INFO, logger="modelparallel"):
            with timeit(True, "Model creation", 0):
                pass
            with timeit(True, "elsewhere", 1):
                pass
            with timeit(False, "disabled", 0):
                pass
    finally:
        logging.getLogger("modelparallel").propagate = False
    text = caplog.text
    assert "Model creation:" in text and "elsewhere" not in text and "disabled" not in text


def test_empty_module_params_keeps_ties_and_moves_buffers():
    with torch.device("meta"):
        emb = nn.Embedding(5, 3)
        head = nn.Linear(3, 5, bias=False)
    head.weight = emb.weight
    emb.register_buffer("pos", torch.arange(5, device="meta"))
    tied = emb.weight
    empty_module_params(emb)
    assert emb.weight is tied and head.weight is tied and not tied.is_meta
    move_buffers_to_device(emb, torch.device("cpu"))
    assert emb.pos.device.type == "cpu" and emb.pos.shape == (5,)


def test_get_logger_child():
    assert get_logger("data").name == "modelparallel.data"
