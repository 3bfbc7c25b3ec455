"""The scheduler with an asynchronous KV connector (zmq), no model: requests wait for
their KV in a state of their own, ready ones go first, failed ones recompute or fail,
and no block is freed (or leaked) while a pull may still write into it."""

from __future__ import annotations

import pytest

from kvflow.cluster_secret import ClusterSecret
from kvflow.config import SchedulerConfig
from kvflow.kv_transfer.scheduler.zmq_connector import ZmqScheduler
from kvflow.kv_transfer_config import KVTransferConfig
from kvflow.proto.engine import TokenDelta
from kvflow.proto.kv_transfer import KVTransferStepStats
from kvflow.proto.sampling import KVTransferParams
from kvflow.proto.step import StepPlan, StepResult
from kvflow.sampling_params import SamplingParams
from kvflow.services.proxy.pairing import InstancePools, decode_request, prefill_request
from kvflow.services.scheduler.features import make_step_features
from kvflow.services.scheduler.kv_cache_manager import KVCacheManager
from kvflow.services.scheduler.request import Request, RequestStatus
from kvflow.services.scheduler.scheduler import Scheduler

BLOCK = 4
NUM_BLOCKS = 16
REMOTE = "tcp://127.0.0.1:1"


def _scheduler(policy: str = "recompute") -> Scheduler:
    config = KVTransferConfig("kv_consumer", "zmq")
    connector = ZmqScheduler(config, BLOCK, policy)
    kv_cache = KVCacheManager(NUM_BLOCKS, BLOCK)
    scheduler_config = SchedulerConfig()
    features = make_step_features(scheduler_config, kv_cache, 1024, kv_connector=connector)
    return Scheduler(scheduler_config, kv_cache, 1024, features=features)


def _request(
    req_id: str, num_tokens: int = 10, remote: str | None = REMOTE, first: int = 0
) -> Request:
    kv = KVTransferParams(remote_address=remote) if remote else None
    params = SamplingParams(max_tokens=4, kv_transfer_params=kv)
    return Request(req_id, list(range(first, first + num_tokens)), params, max_tokens=4)


def _loads_end(scheduler: Scheduler, finished: list[str], failed: list[str]) -> list[TokenDelta]:
    """A step result that reports asynchronous loads that ended; returns its deltas."""
    loads = KVTransferStepStats(finished_loading=finished, failed_loading=failed)
    result = StepResult(0, [], [], kv_transfer=loads)
    return scheduler.update_from_output(StepPlan(0, [], [], [], []), result)


def _integrity(scheduler: Scheduler, free: int = NUM_BLOCKS) -> None:
    scheduler.kv_cache.check_integrity()
    assert scheduler.kv_cache.num_free_blocks == free


def test_parked_request_does_not_block_others_then_goes_first() -> None:
    scheduler = _scheduler()
    scheduler.add_request(_request("remote"))
    scheduler.add_request(_request("local", 6, remote=None, first=100))
    plan = scheduler.schedule()
    assert plan.scheduled_req_ids == ["local"]  # "remote" waits for its KV, unplanned
    assert plan.kv_connector is not None
    (load,) = plan.kv_connector.loads
    assert load.req_id == "remote" and load.remote == REMOTE and len(load.keys) == 3
    assert scheduler.requests["remote"].status == RequestStatus.WAITING_FOR_REMOTE_KV
    assert _loads_end(scheduler, ["remote"], []) == []
    plan = scheduler.schedule()
    new = {n.req_id: n for n in plan.new_requests}
    assert new["remote"].num_computed_tokens == 9  # loaded; the last token is computed
    assert dict(zip(plan.scheduled_req_ids, plan.num_scheduled_tokens))["remote"] == 1


@pytest.mark.parametrize("policy", ["recompute", "fail"])
def test_failed_load_frees_its_blocks_and_follows_the_policy(policy: str) -> None:
    scheduler = _scheduler(policy)
    scheduler.add_request(_request("a"))
    scheduler.schedule()
    failed = _loads_end(scheduler, [], ["a"])
    if policy == "fail":
        assert [d.req_id for d in failed] == ["a"] and "a" not in scheduler.requests
        assert failed[0].finish_reason == "error" and "kv_load_failure_policy" in str(
            failed[0].error
        )
        _integrity(scheduler)
        return
    plan = scheduler.schedule()  # computed here now, never asked to load again
    assert plan.kv_connector is None
    assert plan.num_scheduled_tokens == [10] and plan.new_requests[0].num_computed_tokens == 0
    _integrity(scheduler, NUM_BLOCKS - 3)


def test_abort_while_loading_keeps_blocks_until_the_pull_ends() -> None:
    scheduler = _scheduler()
    scheduler.add_request(_request("a"))
    scheduler.schedule()
    scheduler.finish_requests(["a"], RequestStatus.FINISHED_ABORTED)
    # The pull thread may still write into its 3 blocks: they are not free yet.
    assert scheduler.kv_cache.num_free_blocks == NUM_BLOCKS - 3
    assert scheduler.has_unfinished_requests()  # steps go on until the outcome comes
    assert _loads_end(scheduler, ["a"], []) == []
    _integrity(scheduler)
    assert not scheduler.has_unfinished_requests()


def test_a_prefix_hit_on_blocks_being_loaded_waits() -> None:
    scheduler = _scheduler()
    scheduler.add_request(_request("a"))
    scheduler.add_request(_request("b"))  # same prompt: would hit a's hashed blocks
    plan = scheduler.schedule()
    assert [load.req_id for load in plan.kv_connector.loads] == ["a"]  # type: ignore[union-attr]
    assert scheduler.requests["b"].status == RequestStatus.WAITING
    _loads_end(scheduler, ["a"], [])
    plan = scheduler.schedule()
    assert [(n.req_id, n.num_computed_tokens) for n in plan.new_requests] == [("a", 9)]
    # b: a's two full blocks are local hits now; only its tail block is pulled.
    assert scheduler.requests["b"].status == RequestStatus.WAITING_FOR_REMOTE_KV
    (load,) = plan.kv_connector.loads  # type: ignore[union-attr]
    assert load.req_id == "b" and len(load.keys) == 1


def test_worker_death_requeues_parked_requests_without_leaks() -> None:
    scheduler = _scheduler()
    scheduler.add_request(_request("a"))
    scheduler.schedule()
    scheduler.preempt_all()
    assert scheduler.requests["a"].status == RequestStatus.WAITING
    plan = scheduler.schedule()
    assert plan.num_scheduled_tokens == [10]  # recomputed: its producer is not trusted again


def test_worker_death_drops_the_kv_loaded_for_a_waiting_request() -> None:
    """Loaded but not yet scheduled: its blocks held KV on the worker that died."""
    scheduler = _scheduler()
    scheduler.add_request(_request("a"))
    scheduler.schedule()
    assert _loads_end(scheduler, ["a"], []) == []  # ready, first in the queue
    scheduler.preempt_all()
    _integrity(scheduler)
    plan = scheduler.schedule()
    assert plan.num_scheduled_tokens == [10]  # recomputed: its producer is not trusted again
    assert plan.new_requests[0].num_computed_tokens == 0 and plan.kv_connector is None


def test_proxy_requests() -> None:
    body = {"prompt": "x", "max_tokens": 50, "n": 3, "stream": True, "stop": ["a"], "seed": 1}
    prefill = prefill_request(body)
    assert prefill["max_tokens"] == 1 and "n" not in prefill and "stream" not in prefill
    assert prefill["seed"] == 1 and body["n"] == 3  # the client's body is untouched
    assert decode_request(body, "", None, 0.0) == body
    secret = ClusterSecret(b"s" * 32)
    params = decode_request(body, REMOTE, secret, 100.0)["kv_transfer_params"]
    assert params["remote_address"] == REMOTE and params["expires_at"] > 100.0
    assert (
        secret.check_kv_params(
            REMOTE, params["request_id"], params["expires_at"], params["signature"], now=100.0
        )
        is None
    )
    # A client's own kv_transfer_params never pass through: they are the proxy's to give.
    forged = {**body, "kv_transfer_params": {"remote_address": "tcp://evil:1"}}
    assert "kv_transfer_params" not in decode_request(forged, "", None, 0.0)
    pools = InstancePools(["p0", "p1"], ["d0"], ["tcp://p0", "tcp://p1"])
    assert [pools.pick() for _ in range(3)] == [
        ("p0", "tcp://p0", "d0"),
        ("p1", "tcp://p1", "d0"),
        ("p0", "tcp://p0", "d0"),
    ]
    with pytest.raises(ValueError, match="one --prefill-kv-address"):
        InstancePools(["p0", "p1"], ["d0"], ["tcp://p0"])
