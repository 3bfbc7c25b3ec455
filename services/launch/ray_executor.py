"""`kvflow serve --distributed-executor-backend ray`: data-parallel engines placed on
the nodes of a running Ray cluster, one frontend here.

    ray start --head ...            (host A)     ray start --address A:6379 ...   (host B)
    kvflow serve --distributed-executor-backend ray --data-parallel-size 2   (on a node)
      ├─ Ray placement group per engine: one bundle, STRICT_PACK
      │    {"CPU": 1 + W} on CPU, {"CPU": 1, "GPU": W} on CUDA (W = TP x PP ranks), so an
      │    engine's ranks always share one node (their collectives stay on that host)
      ├─ EngineHost actor in each bundle (services/launch/ray_engine.py): spawns the engine's
      │    processes on its node, binds their ZeroMQ sockets on the node's address
      ├─ monitor thread: asks every actor for its engine's death twice a second; an
      │    actor that is gone (its node left the cluster) takes its engine out of
      │    routing for good, as an engine death does; the others keep serving
      └─ frontend (HTTP) here, connected over tcp to every engine

Ray only places and watches the engines: requests and tokens flow over ZeroMQ. Ray's
own control plane pickles (a Ray cluster's ports belong on a trusted network, as Ray's
documentation says); kvflow's sockets still carry only msgspec messages, over CURVE:
every node mounts the cluster secret at the same path (--cluster-secret-file), which the
actors are told (the path only: the secret never travels through Ray).
"""

from __future__ import annotations

import logging
import os
import socket
import sys
import threading
import time
from dataclasses import dataclass
from typing import Any

import msgspec

from kvflow.cluster_secret import SECRET_FILE_ENV
from kvflow.config import EngineConfig
from kvflow.errors import ConfigError, KvflowError
from kvflow.proto.addresses import ServiceAddresses
from kvflow.runtime.cluster_auth import cluster_settings
from kvflow.runtime.lifecycle import StopFlag
from kvflow.services.launch.data_parallel import _run_frontend
from kvflow.services.launch.dp_hosts import DataParallelHosts
from kvflow.services.launch.launcher import ServeOptions, _resolve_model, _TokenizerPreload
from kvflow.services.launch.ray_engine import EngineHost, EngineStart

logger = logging.getLogger(__name__)

_MONITOR_S = 0.5
_CALL_TIMEOUT_S = 10.0


def import_ray() -> Any:
    try:
        import ray
    except ImportError:
        raise ConfigError(
            "--distributed-executor-backend ray needs Ray: pip install 'kvflow[ray]'"
        ) from None
    return ray


def engine_bundle(config: EngineConfig, device: str) -> dict[str, float]:
    """The resources one engine holds on its node: the scheduler and detokenizer share
    a CPU; each rank gets a CPU, or a GPU on CUDA."""
    ranks = config.parallel.world_size
    if device == "cuda":
        return {"CPU": 1.0, "GPU": float(ranks)}
    return {"CPU": float(1 + ranks)}


@dataclass
class RayEngine:
    """The frontend's handle on one engine placed by Ray."""

    index: int
    actor: Any
    placement_group: Any
    addresses: ServiceAddresses
    failure: str | None = None  # set for good when the actor (its node) is lost
    down: str | None = None  # what the actor last reported

    @property
    def death(self) -> str | None:
        return self.failure or self.down


def serve_on_ray(config: EngineConfig, options: ServeOptions) -> int:
    """`serve()` on a Ray cluster; 0 after a clean shutdown, 1 on error."""
    if options.dp_hosts != DataParallelHosts():
        print(
            "kvflow serve: Ray places every engine: no --headless/--data-parallel-* "
            "host flags with --distributed-executor-backend ray",
            file=sys.stderr,
        )
        return 1
    start = time.monotonic()
    stop = StopFlag().install()
    ray = import_ray()
    engines: list[RayEngine] = []
    try:
        model_dir = _resolve_model(config)  # this host's copy: tokenizer, chat template
        preload = _TokenizerPreload(model_dir, config.model.skip_tokenizer_init)
        _connect(ray, options.ray_address)
        engines = _place_engines(ray, config, options)
        logger.info("%d engines ready on Ray in %.1f s", len(engines), time.monotonic() - start)
        monitor = _Monitor(ray, engines)
        monitor.start()
        try:
            if not stop.is_set():
                _run_frontend(config, options, engines, model_dir, preload.get(), start, stop)
        finally:
            monitor.close()
        return 0
    except KvflowError as exc:
        print(f"kvflow serve: {exc}", file=sys.stderr)
        return 1
    finally:
        _release(ray, engines, options)
        if ray.is_initialized():
            ray.shutdown()


def _connect(ray: Any, address: str | None) -> None:
    """Join the running cluster (never start one: that is `ray start`'s job)."""
    if address is not None:
        _check_reachable(address)
    try:
        ray.init(address=address or "auto", logging_level=logging.WARNING)
    except (ConnectionError, RuntimeError) as exc:
        raise KvflowError(
            f"no Ray cluster at {address or 'auto'} (start one with `ray start --head`, "
            f"or give --ray-address HOST:PORT): {exc}"
        ) from exc
    logger.info("Ray cluster: %s", ray.cluster_resources())


def _check_reachable(address: str) -> None:
    """Fail in seconds: Ray's own client retries an unreachable address for minutes."""
    host, _, port = address.removeprefix("ray://").rpartition(":")
    try:
        socket.create_connection((host, int(port)), timeout=5.0).close()
    except (OSError, ValueError) as exc:
        raise KvflowError(f"no Ray cluster at {address}: {exc}") from exc


def _place_engines(ray: Any, config: EngineConfig, options: ServeOptions) -> list[RayEngine]:
    """A placement group and an EngineHost actor per engine; all start at once."""
    from ray.util.placement_group import placement_group
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    device = "cuda" if config.device.device == "cuda" else "cpu"
    bundle = engine_bundle(config, device)
    groups = [
        placement_group([bundle], strategy="STRICT_PACK", name=f"kvflow-engine{i}")
        for i in range(config.parallel.data_parallel_size)
    ]
    actors: list[Any] = []
    try:
        ready, _ = ray.wait([g.ready() for g in groups], num_returns=len(groups), timeout=60.0)
        if len(ready) < len(groups):
            raise KvflowError(
                f"the Ray cluster cannot place {len(groups)} engines of {bundle} each "
                f"(available: {ray.available_resources()})"
            )
        host_class = ray.remote(max_restarts=0)(EngineHost)
        encoded = msgspec.msgpack.encode(config)
        for index, group in enumerate(groups):
            strategy = PlacementGroupSchedulingStrategy(group, placement_group_bundle_index=0)
            actor = host_class.options(
                num_cpus=bundle["CPU"], num_gpus=bundle.get("GPU", 0), scheduling_strategy=strategy
            ).remote(_engine_start(ray, index, encoded, options, group))
            actors.append(actor)
        addresses = _wait_started(ray, actors, options.startup_timeout_s)
    except BaseException:
        _free(ray, actors, groups)
        raise
    return [
        RayEngine(i, actor, group, ServiceAddresses(**found))
        for i, (actor, group, found) in enumerate(zip(actors, groups, addresses))
    ]


def _wait_started(ray: Any, actors: list[Any], timeout_s: float) -> list[dict[str, str]]:
    started = [actor.start.remote() for actor in actors]
    try:
        return list(ray.get(started, timeout=timeout_s))
    except Exception as exc:  # an actor's error, or Ray's timeout
        raise KvflowError(f"an engine failed to start on Ray: {exc}") from exc


def _engine_start(
    ray: Any, index: int, config: bytes, options: ServeOptions, group: Any
) -> EngineStart:
    node = _bundle_node(ray, group)
    logger.info("engine %d placed on Ray node %s (%s)", index, node["NodeID"], node["host"])
    return EngineStart(
        index,
        config,
        node["host"],
        options.startup_timeout_s,
        options.shutdown_timeout_s,
        secret_file=os.environ.get(SECRET_FILE_ENV, ""),
        insecure=cluster_settings().insecure,
    )


def _bundle_node(ray: Any, group: Any) -> dict[str, str]:
    """The node that holds the group's bundle, and the address other hosts reach it by."""
    from ray.util import placement_group_table

    node_id = placement_group_table(group)["bundles_to_node_id"][0]
    node = next(n for n in ray.nodes() if n["NodeID"] == node_id)
    return {"NodeID": node_id, "host": node["NodeManagerAddress"]}


class _Monitor:
    """Polls each actor for its engine's state; a lost actor is a permanent death."""

    def __init__(self, ray: Any, engines: list[RayEngine]) -> None:
        self._ray = ray
        self._engines = engines
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._run, name="kvflow-ray-monitor", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def close(self) -> None:
        self._done.set()
        self._thread.join()

    def _run(self) -> None:
        while not self._done.wait(_MONITOR_S):
            for engine in self._engines:
                if engine.failure is None:
                    self._poll(engine)

    def _poll(self, engine: RayEngine) -> None:
        try:
            engine.down = self._ray.get(engine.actor.death.remote(), timeout=_CALL_TIMEOUT_S)
        except self._ray.exceptions.GetTimeoutError:
            return  # a busy node answers late; a lost one fails the call
        except self._ray.exceptions.RayError as exc:
            engine.failure = f"engine {engine.index}: its Ray actor is gone ({type(exc).__name__})"
            logger.error("%s", engine.failure)


def _release(ray: Any, engines: list[RayEngine], options: ServeOptions) -> None:
    """Stop every engine's processes, then free its actor and placement group."""
    if not engines:
        return
    stops = [e.actor.stop.remote() for e in engines if e.failure is None]
    try:
        ray.get(stops, timeout=2 * options.shutdown_timeout_s + 5.0)
    except Exception as exc:  # the actor kill below still ends their processes
        logger.warning("engines did not stop cleanly: %s", exc)
    _free(ray, [e.actor for e in engines], [e.placement_group for e in engines])


def _free(ray: Any, actors: list[Any], groups: list[Any]) -> None:
    from ray.util import remove_placement_group

    for actor in actors:
        ray.kill(actor)
    for group in groups:
        remove_placement_group(group)
