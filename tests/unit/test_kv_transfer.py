"""Sans-IO parts of the KV connectors: block keys, the block wire format, the config,
and the scheduler's bookkeeping with a shared-storage connector (no model)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from kvflow.block_hash import extend_block_hashes
from kvflow.cluster_secret import ClusterSecret
from kvflow.config import SchedulerConfig
from kvflow.errors import ConfigError
from kvflow.kv_transfer.scheduler.block_keys import prompt_block_keys
from kvflow.kv_transfer.scheduler.shared_storage import SharedStorageScheduler
from kvflow.kv_transfer.worker.block_io import (
    decode_block,
    encode_block,
    gather_block,
    gather_blocks,
    scatter_block,
    scatter_blocks,
)
from kvflow.kv_transfer_config import KVTransferConfig, block_file_path
from kvflow.runtime.cluster_auth import cluster_settings
from kvflow.sampling_params import SamplingParams
from kvflow.services.scheduler.features import make_step_features
from kvflow.services.scheduler.kv_cache_manager import KVCacheManager
from kvflow.services.scheduler.request import Request, RequestStatus
from kvflow.services.scheduler.scheduler import Scheduler

BLOCK = 4


def test_keys_are_the_prefix_cache_hashes_plus_a_partial_tail() -> None:
    tokens = list(range(10))
    keys = prompt_block_keys(tokens, BLOCK, None)
    hashes = extend_block_hashes([], tokens, BLOCK, None)
    assert keys[:2] == [h.hex() for h in hashes] and len(keys) == 3
    assert prompt_block_keys(tokens[:8], BLOCK, None) == keys[:2]  # aligned: no tail
    assert prompt_block_keys(tokens[:9], BLOCK, None)[2] != keys[2]  # tail tokens differ
    assert prompt_block_keys(tokens, BLOCK, "tenant")[0] != keys[0]  # the salt separates
    assert prompt_block_keys([1, 2], BLOCK, "a") != prompt_block_keys([1, 2], BLOCK, None)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_block_round_trip_and_layout_check(dtype: torch.dtype) -> None:
    caches = [torch.randn(2, 5, BLOCK, 2, 3).to(dtype) for _ in range(3)]
    data = encode_block(gather_block(caches, 1))
    shape = [3, 2, BLOCK, 2, 3]
    block = decode_block(data, shape, dtype)
    targets = [torch.zeros_like(c) for c in caches]
    scatter_block(targets, 4, block)
    for source, target in zip(caches, targets):
        assert torch.equal(source[:, 1], target[:, 4])
    with pytest.raises(ValueError, match="shape"):
        decode_block(data, [3, 2, BLOCK, 2, 4], dtype)
    with pytest.raises(ValueError, match="bytes"):
        decode_block(data[:-2], shape, dtype)


def test_batched_gather_and_scatter_match_the_per_block_ones() -> None:
    caches = [torch.randn(2, 6, BLOCK, 2, 3) for _ in range(3)]
    blocks = gather_blocks(caches, [4, 1])
    assert torch.equal(blocks[0], gather_block(caches, 4))
    assert torch.equal(blocks[1], gather_block(caches, 1))
    targets = [torch.zeros_like(c) for c in caches]
    scatter_blocks(targets, [0, 5], blocks)
    for source, target in zip(caches, targets):
        assert torch.equal(target[:, 0], source[:, 4]) and torch.equal(target[:, 5], source[:, 1])
        assert not target[:, 1:5].any()


def test_config_parse() -> None:
    config = KVTransferConfig.parse(
        '{"kv_role": "kv_both", "kv_connector": "shared-storage",'
        ' "kv_connector_extra_config": {"storage_path": "/x"}}'
    )
    assert config.is_producer and config.is_consumer and config.storage_path == "/x"
    for bad, match in [
        ("[]", "JSON object"),
        ('{"kv_role": "kv_both"}', "kv_connector"),
        ('{"kv_role": "kv_both", "kv_connector": "shared-storage", "x": 1}', "unknown"),
        ('{"kv_role": "kv_both", "kv_connector": "nccl"}', "kv_connector must be"),
    ]:
        with pytest.raises(ConfigError, match=match):
            KVTransferConfig.parse(bad)


def _scheduler(tmp_path: Path, role: str, num_blocks: int = 16) -> Scheduler:
    config = KVTransferConfig(role, "shared-storage", {"storage_path": str(tmp_path)})  # type: ignore[arg-type]
    connector = SharedStorageScheduler(config, BLOCK, "ns")
    scheduler_config, kv_cache = SchedulerConfig(), KVCacheManager(num_blocks, BLOCK)
    features = make_step_features(scheduler_config, kv_cache, 1024, kv_connector=connector)
    return Scheduler(scheduler_config, kv_cache, 1024, features=features)


def _request(req_id: str, num_tokens: int) -> Request:
    params = SamplingParams(max_tokens=4)
    return Request(req_id, list(range(num_tokens)), params, max_tokens=4)


def _salted_keys(tokens: list[int]) -> list[str]:
    """The keys a connector uses: salted with the tests' cluster secret (conftest)."""
    return prompt_block_keys(tokens, BLOCK, None, cluster_settings().secret)


def test_block_keys_are_salted_with_the_cluster_secret() -> None:
    tokens = list(range(10))
    plain = prompt_block_keys(tokens, BLOCK, None)
    one, other = ClusterSecret(b"a" * 32), ClusterSecret(b"b" * 32)
    salted = prompt_block_keys(tokens, BLOCK, None, one)
    assert len(salted) == len(plain) and not set(salted) & set(plain)
    assert salted == [one.salt_block_key(k) for k in plain]  # deterministic per secret
    assert prompt_block_keys(tokens, BLOCK, None, other) != salted


def _touch(tmp_path: Path, keys: list[str]) -> None:
    for key in keys:
        path = Path(block_file_path(str(tmp_path), "ns", key))
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(b"")


def test_producer_saves_each_prompt_block_once_when_the_prompt_completes(tmp_path: Path) -> None:
    scheduler = _scheduler(tmp_path, "kv_producer")
    scheduler.config = SchedulerConfig(max_num_batched_tokens=6)  # a 10-token prompt: 2 chunks
    scheduler.add_request(_request("a", 10))
    first = scheduler.schedule()
    assert first.kv_connector is None  # prompt not complete yet
    second = scheduler.schedule()
    assert second.kv_connector is not None
    (save,) = second.kv_connector.saves
    assert save.keys == _salted_keys(list(range(10)))
    assert save.block_ids == scheduler.kv_cache.get_block_ids("a")
    assert not second.kv_connector.loads


def test_consumer_loads_the_stored_run_and_computes_the_last_token(tmp_path: Path) -> None:
    scheduler = _scheduler(tmp_path, "kv_consumer")
    keys = _salted_keys(list(range(10)))
    _touch(tmp_path, keys)
    scheduler.add_request(_request("a", 10))
    plan = scheduler.schedule()
    assert plan.num_scheduled_tokens == [1]  # 9 tokens loaded, the last one computed
    assert plan.new_requests[0].num_computed_tokens == 9
    assert plan.kv_connector is not None
    (load,) = plan.kv_connector.loads
    assert load.keys == keys and load.block_ids == scheduler.kv_cache.get_block_ids("a")
    scheduler.finish_requests(["a"], RequestStatus.FINISHED_ABORTED)
    scheduler.kv_cache.check_integrity()
    assert scheduler.kv_cache.num_free_blocks == 16


def test_consumer_loads_only_an_unbroken_run_after_the_local_hit(tmp_path: Path) -> None:
    scheduler = _scheduler(tmp_path, "kv_consumer")
    keys = _salted_keys(list(range(10)))
    _touch(tmp_path, [keys[0], keys[2]])  # block 1 missing: only block 0 loads
    scheduler.add_request(_request("a", 10))
    plan = scheduler.schedule()
    assert plan.new_requests[0].num_computed_tokens == BLOCK
    assert plan.kv_connector is not None and plan.kv_connector.loads[0].keys == [keys[0]]
    # The same prompt again: blocks 0-1 are local hits now (the first request computed
    # block 1), and the lookup goes on from there: the stored tail loads.
    scheduler.add_request(_request("b", 10))
    plan = scheduler.schedule()
    assert plan.new_requests[0].num_computed_tokens == 9
    assert plan.kv_connector is not None and plan.kv_connector.loads[0].keys == [keys[2]]


def test_parallel_engines_are_refused_with_a_connector() -> None:
    from kvflow.config import EngineConfig

    kv = {"kv_role": "kv_consumer", "kv_connector": "zmq"}
    for option in ({"data_parallel_size": 2}, {"tensor_parallel_size": 2}):
        with pytest.raises(ConfigError, match="one engine of one rank"):
            EngineConfig.create(device="cpu", dtype="float32", kv_transfer_config=kv, **option)
    config = EngineConfig.create(device="cpu", dtype="float32", kv_transfer_config=kv)
    assert config.kv_transfer.kv_transfer_config is not None
    assert config.kv_transfer.kv_load_failure_policy == "recompute"


def test_a_bad_block_file_fails_the_load_once(tmp_path: Path) -> None:
    from kvflow.kv_transfer.worker.connector import KVLoadError
    from kvflow.kv_transfer.worker.shared_storage import SharedStorageWorker
    from kvflow.proto.kv_transfer import KVBlockTransfer, KVConnectorMeta

    caches = [torch.zeros(2, 4, BLOCK, 2, 3) for _ in range(2)]
    worker = SharedStorageWorker(str(tmp_path), "ns", caches)
    path = Path(block_file_path(str(tmp_path), "ns", "ab" * 32))
    path.parent.mkdir(parents=True)
    path.write_bytes(b"\x00\x00\x00\x00 not a block")
    meta = KVConnectorMeta(loads=[KVBlockTransfer("r", [1], ["ab" * 32])])
    with pytest.raises(KVLoadError, match="request r"):
        worker.start_load_kv(meta)
    assert not path.exists()  # moved aside: the retry's lookup computes the block instead
