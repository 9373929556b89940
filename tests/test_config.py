"""Config parsing and validation (no collectives): one ValueError naming every factor at fault.

A failure means modelparallel/config.py accepts a bad config or refuses a good one.
"""

import json

import pytest

from modelparallel.config import ENV_VAR, build_config


def test_defaults_and_dp_degree():
    cfg = build_config({"tensor_parallel_degree": 2}, world_size=8)
    assert (cfg.tensor_parallel_degree, cfg.dp_degree, cfg.pipeline_parallel_degree) == (2, 4, 1)


def test_json_file_and_environment(tmp_path, monkeypatch):
    path = tmp_path / "mp.json"
    path.write_text(json.dumps({"tensor_parallel_degree": 4, "bf16": True}))
    assert build_config(str(path), 4).bf16
    monkeypatch.setenv(ENV_VAR, str(path))
    assert build_config(None, 4).tensor_parallel_degree == 4
    monkeypatch.setenv(ENV_VAR, '{"tensor_parallel_degree": 2}')
    assert build_config(None, 4).dp_degree == 2


def test_every_problem_named_at_once():
    with pytest.raises(ValueError) as err:
        build_config({"tensor_parallel_degree": 3, "pipeline_parallel_degree": 2, "micro_batches": 4}, 8)
    msg = str(err.value)
    assert "micro_batches" in msg
    assert "pipeline_parallel_degree=2" in msg
    assert "world size 8 is not divisible by tensor_parallel_degree 3 x pipeline_parallel_degree 2 = 6" in msg


@pytest.mark.parametrize("raw, fragment", [
    ({"tensor_parallel_degree": 0}, "tensor_parallel_degree must be >= 1, got 0"),
    ({"tensor_parallel_degree": "2"}, "tensor_parallel_degree must be an integer"),
    ({"ddp": 1}, "ddp must be true or false"),
    ({"placement_strategy": "diagonal"}, "placement_strategy"),
    ({"fp16": True, "bf16": True}, "fp16 and bf16"),
    ({"sharded_data_parallel_degree": 2, "hybrid_shard_degree": 4}, "disagree"),
    ({"tensor_parallel_degree": 2, "hybrid_shard_degree": 3}, "does not divide the data-parallel degree 2"),
])
def test_bad_values(raw, fragment):
    with pytest.raises(ValueError, match=fragment):
        build_config(raw, 4)


def test_accepts_sagemaker_names():
    cfg = build_config({"sharded_data_parallel_degree": 2, "ddp": True, "random_seed": 7,
                        "placement_strategy": "spread"}, 4)
    assert cfg.shard_degree == 2 and cfg.random_seed == 7
    assert build_config({"placement_strategy": "TPD"}, 4).placement_strategy == "TPD"
