"""Config parsing and validation (no collectives): one ValueError naming every factor at fault,
every SageMaker key known, and a non-default value of a key that is not built refused by name.

A failure means modelparallel/config.py (or the key table in config_keys.py) accepts a bad
config, refuses a good one, or drops a key's value.
"""

import json

import pytest

from modelparallel.config import ENV_VAR, build_config, without_effect
from modelparallel.config_keys import DEFAULT_ONLY, IMPLEMENTED, KEYS, NO_EFFECT


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
    assert "unknown config key 'micro_batches'; did you mean 'microbatches'?" in msg
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


# A valid value other than the default, for keys where "default + 1" or "not default" is not one.
_OTHER = {"placement_strategy": "spread", "pipeline": "simple", "optimize": "speed",
          "ddp_dist_backend": "nccl", "tensor_parallel_degree": 2, "pipeline_parallel_degree": 2,
          "sharded_data_parallel_degree": 2, "hybrid_shard_degree": 2, "fp16": True,
          "checkpoint_staging": "journal"}
_BESIDE = {"pipeline_virtual_stages": {"pipeline_parallel_degree": 2}}  # keys meaningful only beside another


def _other_value(key):
    if key.name in _OTHER:
        return _OTHER[key.name]
    if key.type is bool:
        return not key.default
    if key.type is float:
        return key.default / 2
    return key.default + 1


def test_table_covers_every_config_field_and_defaults_build():
    cfg = build_config({}, 4)
    for key in KEYS:
        assert getattr(cfg, key.name) == key.default, key.name
        assert key.status in (IMPLEMENTED, NO_EFFECT, DEFAULT_ONLY), key.name
        assert build_config({key.name: key.default}, 4) == cfg, key.name


@pytest.mark.parametrize("key", KEYS, ids=lambda k: k.name)
def test_every_key_non_default(key):
    value = _other_value(key)
    if key.status == DEFAULT_ONLY:
        with pytest.raises(NotImplementedError, match=f"{key.name}={value!r}"):
            build_config({key.name: value}, 4)
        return
    cfg = build_config({**_BESIDE.get(key.name, {}), key.name: value}, 4)
    assert getattr(cfg, key.name) == value
    assert (key.name in without_effect({key.name: value})) == (key.status == NO_EFFECT)


def test_sagemaker_v1_keys_from_real_scripts():
    cfg = build_config({"partitions": 1, "microbatches": 4, "pipeline": "interleaved", "optimize": "speed",
                        "auto_partition": True, "default_partition": 0, "prescaled_batch": False,
                        "skip_tracing": True, "static_mode": True, "fast_mode": True, "ddp": True,
                        "ddp_dist_backend": "auto", "sharded_data_parallel_degree": 0,
                        "sdp_reduce_bucket_size": 5e8, "sdp_param_persistence_threshold": 1e6,
                        "sdp_max_live_parameters": 1e9, "sdp_hierarchical_allgather": True,
                        "tensor_parallel_degree": 2, "fp16_params": True}, 4)
    assert cfg.microbatches == 4 and cfg.pipeline_parallel_degree == 1 and cfg.shard_degree == 1
    assert cfg.sdp_reduce_bucket_size == 500_000_000 and cfg.fp16_params


def test_alias_and_sharding_degrees():
    assert build_config({"partitions": 1}, 2).pipeline_parallel_degree == 1
    with pytest.raises(ValueError, match="partitions=1 and pipeline_parallel_degree=2 name the same setting"):
        build_config({"partitions": 1, "pipeline_parallel_degree": 2}, 2)
    assert build_config({"partitions": 2}, 2).pipeline_parallel_degree == 2
    v2 = build_config({"tensor_parallel_degree": 2}, 8)
    assert v2.hybrid_shard_degree == 0 and v2.fsdp_shard_degree == 4 and v2.shard_degree == 1
    assert build_config({"hybrid_shard_degree": 2}, 8).fsdp_shard_degree == 2
    assert build_config({"sm_activation_offloading": True}, 2).activation_offloading


@pytest.mark.parametrize("raw, fragment", [
    ({"microbatches": 0}, "microbatches must be >= 1, got 0"),
    ({"sharded_data_parallel_degree": -1}, "sharded_data_parallel_degree must be >= 0"),
    ({"sdp_reduce_bucket_size": 1.5}, "sdp_reduce_bucket_size must be an integer"),
    ({"sdp_gradient_clipping": "1"}, "sdp_gradient_clipping must be a number"),
    ({"optimize": 1}, "optimize must be a str"),
])
def test_bad_values_of_new_keys(raw, fragment):
    with pytest.raises(ValueError, match=fragment):
        build_config(raw, 4)


def test_dimensions_that_do_not_compose_reported_with_the_other_problems():
    """The combinations still not built are refused by the config, naming their keys; beside an
    invalid value they are listed in the same error. Pipeline x context x expert compose."""
    with pytest.raises(ValueError) as info:
        build_config({"pipeline_parallel_degree": 2, "context_parallel_degree": 2, "expert_parallel_degree": 2,
                      "tensor_parallel_degree": 2, "sequence_parallel": True, "microbatches": 0}, 16)
    for part in ("microbatches must be >= 1", "sequence_parallel with expert_parallel_degree 2"):
        assert part in str(info.value), str(info.value)
    assert "expert_parallel_degree 2 with context_parallel_degree 2" not in str(info.value)
    assert "with pipeline_parallel_degree" not in str(info.value)
