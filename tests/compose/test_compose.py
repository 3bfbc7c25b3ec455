"""The Docker Compose deployment: the file itself (always), and the stack for real.

The live tests need a Docker engine, compose v2 and the images that
docker/build_images.sh builds; `docker/test_compose.sh` (`make test-compose`) sets all
that up and runs this module with KVFLOW_TEST_COMPOSE=1. The stack runs as its own
compose project with free host ports, published on 127.0.0.1 only, and is taken down
with its volumes at the end; any failure prints every container's log.
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
import shutil
import socket
import subprocess
import threading
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import msgspec
import pytest
import yaml
import zmq

from kvflow.proto.addresses import ServiceAddresses
from kvflow.proto.frontend import EngineDead
from kvflow.proto.stats import SchedulerStats
from kvflow.runtime.cluster_auth import secure_socket

REPO = Path(__file__).resolve().parents[2]
COMPOSE_FILE = REPO / "compose.yaml"
DASHBOARD = REPO / "docker" / "grafana" / "kvflow-dashboard.json"
ROLES = ("worker", "scheduler", "detokenizer", "frontend")
BASE_PORT = 5550
# Which service binds each channel (see the comments of kvflow/proto/addresses.py).
BINDER = {
    "scheduler_input": "scheduler",
    "worker_plan": "scheduler",
    "worker_result": "scheduler",
    "stats": "scheduler",
    "detokenizer_input": "detokenizer",
    "frontend_output": "detokenizer",
}
PROJECT = "kvflow-compose-test"
UP_TIMEOUT_S = 900
REQUEST_TIMEOUT_S = 300.0  # one 8-token completion on a loaded 2-core machine
SCRAPE_WAIT_S = 60.0


def compose_services() -> dict[str, Any]:
    return yaml.safe_load(COMPOSE_FILE.read_text())["services"]


SECRET_ENV = {"KVFLOW_CLUSTER_SECRET_FILE": "/run/secrets/cluster_secret"}


def expected_addresses() -> dict[str, str]:
    """A role's environment: the address table and where the cluster secret is mounted."""
    return {**ServiceAddresses.tcp(BINDER, BASE_PORT).as_env(), **SECRET_ENV}


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def channel_port(channel: str) -> int:
    return int(getattr(ServiceAddresses.tcp(BINDER, BASE_PORT), channel).rsplit(":", 1)[1])


# ---- the compose file (no Docker needed) ------------------------------------------------


def test_every_role_has_the_shared_address_table() -> None:
    services = compose_services()
    for role in ROLES:
        assert services[role]["environment"] == expected_addresses(), role


def test_every_kvflow_service_mounts_the_cluster_secret() -> None:
    compose = yaml.safe_load(COMPOSE_FILE.read_text())
    secret = compose["secrets"]["cluster_secret"]["file"]
    assert ".kvflow-secrets/" in secret  # generated (docker/make_cluster_secret.sh)
    assert ".kvflow-secrets/" in (REPO / ".gitignore").read_text()  # and never committed
    for name, service in compose["services"].items():
        if str(service.get("image", "")).startswith("${KVFLOW_IMAGE"):
            assert service["secrets"] == ["cluster_secret"], name
            env = service["environment"]
            assert env["KVFLOW_CLUSTER_SECRET_FILE"] == "/run/secrets/cluster_secret", name


def test_published_ports_are_loopback_only() -> None:
    for name, service in compose_services().items():
        for port in service.get("ports", []):
            assert str(port).startswith("127.0.0.1:"), f"{name} publishes {port}"


def test_healthchecks_probe_the_ports_each_role_owns() -> None:
    services = compose_services()
    health = {name: services[name]["healthcheck"]["test"] for name in (*ROLES, "prometheus")}
    assert health["scheduler"][-2:] == ["stats", f"tcp://127.0.0.1:{channel_port('stats')}"]
    detokenizer_ports = [str(channel_port(c)) for c, s in BINDER.items() if s == "detokenizer"]
    assert health["detokenizer"][-3:] == ["listening", *detokenizer_ports]
    worker_ports = [str(channel_port(c)) for c in ("worker_plan", "worker_result")]
    assert health["worker"][-3:] == ["connected", *worker_ports]
    assert health["frontend"][-1] == "http://127.0.0.1:8000/health"
    assert health["prometheus"][-1] == "http://127.0.0.1:9090/-/ready"


def test_frontend_waits_for_a_serving_engine() -> None:
    depends = compose_services()["frontend"]["depends_on"]
    assert depends["scheduler"]["condition"] == "service_healthy"
    assert depends["detokenizer"]["condition"] == "service_healthy"


def test_prometheus_scrapes_the_frontend() -> None:
    config = yaml.safe_load((REPO / "docker" / "prometheus.yml").read_text())
    job = {j["job_name"]: j for j in config["scrape_configs"]}["kvflow"]
    assert job["metrics_path"] == "/metrics"
    assert job["static_configs"][0]["targets"] == ["frontend:8000"]
    assert "8000" in compose_services()["frontend"]["command"]


# ---- docker/healthcheck.py (the containers' health checks) --------------------------------


def load_healthcheck() -> Any:
    spec = importlib.util.spec_from_file_location("healthcheck", REPO / "docker" / "healthcheck.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_healthcheck_reads_listening_and_connected_ports() -> None:
    healthcheck = load_healthcheck()
    with socket.socket() as server:
        server.bind(("127.0.0.1", 0))
        server.listen()
        port = int(server.getsockname()[1])
        assert healthcheck.check_ports([port], listening=True) is None
        assert (
            healthcheck.check_ports([port], listening=False) == f"not connected to port(s) [{port}]"
        )
        with socket.create_connection(("127.0.0.1", port)):
            assert healthcheck.check_ports([port], listening=False) is None
    assert healthcheck.check_ports([port], listening=True) == f"not listening on port(s) [{port}]"


def publish_until(stop: threading.Event, address: str, message: Any) -> None:
    context = zmq.Context()
    publisher = context.socket(zmq.PUB)
    publisher.bind(secure_socket(publisher, address, bind=True))  # as the scheduler binds
    encoded = msgspec.msgpack.encode(message)
    while not stop.wait(0.05):
        publisher.send(encoded)
    context.destroy(linger=0)


@pytest.mark.parametrize(
    ("message", "problem"),
    [
        (SchedulerStats(1.0, "0", num_running=0, num_waiting=0, kv_cache_usage=0.0), None),
        (EngineDead("worker 0 exited"), "engine dead: worker 0 exited"),
    ],
)
def test_healthcheck_reads_the_scheduler_stats(message: Any, problem: str | None) -> None:
    healthcheck = load_healthcheck()
    address = f"tcp://127.0.0.1:{free_port()}"
    assert healthcheck.check_stats(address, 0.2) == f"no scheduler stats on {address} within 0.2 s"
    stop = threading.Event()
    publisher = threading.Thread(target=publish_until, args=(stop, address, message))
    publisher.start()
    try:
        assert healthcheck.check_stats(address, 10.0) == problem
    finally:
        stop.set()
        publisher.join()


# ---- the live stack -----------------------------------------------------------------------

live = pytest.mark.skipif(
    os.environ.get("KVFLOW_TEST_COMPOSE") != "1",
    reason="brings up the Docker Compose stack: run `make test-compose` "
    "(docker/test_compose.sh), or set KVFLOW_TEST_COMPOSE=1 with the images built",
)


@dataclass
class Stack:
    compose: list[str]
    http_port: int
    prometheus_port: int

    @property
    def api(self) -> str:
        return f"http://127.0.0.1:{self.http_port}/v1"

    def prometheus_query(self, query: str) -> dict[str, Any]:
        """The JSON answer of an instant query; raises on a non-2xx (e.g. a parse error)."""
        params = urllib.parse.urlencode({"query": query})
        url = f"http://127.0.0.1:{self.prometheus_port}/api/v1/query?{params}"
        with urllib.request.urlopen(url, timeout=30) as response:
            return json.load(response)


def compose_command() -> list[str]:
    if os.environ.get("KVFLOW_COMPOSE"):
        return os.environ["KVFLOW_COMPOSE"].split()
    plugin = subprocess.run(["docker", "compose", "version"], capture_output=True, check=False)
    if plugin.returncode == 0:
        return ["docker", "compose"]
    cached = Path.home() / ".cache" / "kvflow-docker" / "bin" / "docker-compose"
    if cached.is_file():
        return [str(cached)]
    pytest.fail("no compose v2: run docker/test_compose.sh, or set KVFLOW_COMPOSE")


def run(args: list[str], env: dict[str, str], timeout: float) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        args, env=env, capture_output=True, text=True, timeout=timeout, check=False, cwd=REPO
    )


def print_logs(compose: list[str], env: dict[str, str]) -> None:
    for args in (["ps", "-a"], ["logs", "--no-color", "--timestamps", "--tail", "200"]):
        result = run([*compose, *args], env, timeout=120)
        print(f"\n$ {' '.join(args)}\n{result.stdout}{result.stderr}")


def timed(label: str, start: float) -> None:
    print(f"\n[compose] {label}: {time.monotonic() - start:.1f} s", flush=True)


@pytest.fixture(scope="module")
def stack(request: pytest.FixtureRequest) -> Iterator[Stack]:
    if shutil.which("docker") is None:
        pytest.fail("no docker client: run docker/test_compose.sh")
    ports = {"KVFLOW_HTTP_PORT": free_port(), "KVFLOW_PROMETHEUS_PORT": free_port()}
    env = {**os.environ, **{key: str(value) for key, value in ports.items()}}
    compose = [*compose_command(), "-f", str(COMPOSE_FILE), "-p", PROJECT]
    # Leftovers of an interrupted run would hold the project's names and volumes.
    run([*compose, "down", "-v", "--remove-orphans", "--timeout", "10"], env, timeout=180)
    start = time.monotonic()
    up = run([*compose, "up", "-d", "--wait", "--wait-timeout", str(UP_TIMEOUT_S)], env, 1200)
    timed("up -d --wait (all services healthy)", start)
    failed_before = request.session.testsfailed
    try:
        if up.returncode != 0:
            print_logs(compose, env)
            pytest.fail(f"compose up failed:\n{up.stdout}{up.stderr}")
        yield Stack(compose, ports["KVFLOW_HTTP_PORT"], ports["KVFLOW_PROMETHEUS_PORT"])
        if request.session.testsfailed > failed_before:
            print_logs(compose, env)
    finally:
        start = time.monotonic()
        down = run([*compose, "down", "-v", "--remove-orphans", "--timeout", "30"], env, 300)
        timed("down -v", start)
        assert down.returncode == 0, down.stderr


@pytest.fixture(scope="module")
def completion(stack: Stack) -> Any:
    """One greedy 8-token completion through the published port (official client)."""
    import openai

    client = openai.OpenAI(base_url=stack.api, api_key="unused", timeout=REQUEST_TIMEOUT_S)
    (model,) = client.models.list().data
    start = time.monotonic()
    result = client.completions.create(
        model=model.id,
        prompt="The capital of France is",
        max_tokens=8,
        temperature=0.0,
        extra_body={"ignore_eos": True},
    )
    timed("one completion", start)
    return result


@live
def test_completion_through_the_published_port(completion: Any) -> None:
    (choice,) = completion.choices
    assert choice.finish_reason == "length"
    assert completion.usage.completion_tokens == 8
    assert completion.usage.prompt_tokens > 0
    assert choice.text.strip()


def wait_for_series(stack: Stack, query: str) -> list[dict[str, Any]]:
    """The query's result once it has data (Prometheus scrapes every 5 s; a rate needs
    two scrapes); fails if it has none by the deadline."""
    deadline = time.monotonic() + SCRAPE_WAIT_S
    while True:
        answer = stack.prometheus_query(query)
        assert answer["status"] == "success", answer
        if answer["data"]["result"]:
            return list(answer["data"]["result"])
        assert time.monotonic() < deadline, f"no data after {SCRAPE_WAIT_S:.0f} s: {query}"
        time.sleep(1.0)


@live
def test_prometheus_has_the_completion(stack: Stack, completion: Any) -> None:
    start = time.monotonic()
    query = 'sum(kvflow:request_success_total{job="kvflow", finished_reason="length"}) >= 1'
    (series,) = wait_for_series(stack, query)
    timed("Prometheus scraped the completion", start)
    assert float(series["value"][1]) >= 1.0
    # Token counters come from the scheduler's periodic stats, not from the request's
    # deltas: they may reach Prometheus a scrape later.
    tokens = completion.usage.completion_tokens
    (generated,) = wait_for_series(stack, f"sum(kvflow:generation_tokens_total) >= {tokens}")
    assert float(generated["value"][1]) >= tokens


# Grafana's own variables, as a dashboard over the last minutes would expand them.
GRAFANA_BUILTINS = {"__rate_interval": "1m", "__interval": "15s", "__range": "5m"}


def grafana_queries() -> list[tuple[str, str]]:
    """(panel title + refId, PromQL with every $variable expanded) of each panel target."""
    dashboard = json.loads(DASHBOARD.read_text())
    values = dict(GRAFANA_BUILTINS)
    for variable in dashboard["templating"]["list"]:
        if variable["type"] == "query":
            values[variable["name"]] = variable["allValue"]

    def expand(expr: str) -> str:
        return re.sub(r"\$\{?(\w+)\}?", lambda m: values[m.group(1)], expr)

    return [
        (f"{panel['title']} {target['refId']}", expand(target["expr"]))
        for panel in dashboard["panels"]
        for target in panel.get("targets", [])
        if not OPT_IN_METRIC.search(target["expr"])
    ]


# Opt-in features' series exist once the feature is used (a guided request, a server
# with --speculative-config, --kv-transfer-config or --enable-lora); the default stack runs none. Their panels' queries are
# still parsed and named by tests/unit/test_grafana_dashboard.py.
OPT_IN_METRIC = re.compile(
    r"kvflow:(grammar_|guided_requests|spec_decode_|kv_transfer_|kv_load_|lora_|"
    r"num_requests_waiting_for_remote_kv)"
)


@live
def test_every_grafana_panel_query_returns_data(stack: Stack, completion: Any) -> None:
    """After one completion every panel has a series (a rate over an idle minute is a
    0, a quantile of no new requests NaN: still data, where a misspelled metric, label
    or a counter that is not exported yet leaves the panel empty)."""
    queries = dict(grafana_queries())
    failures = []
    empty = set(queries)
    deadline = time.monotonic() + SCRAPE_WAIT_S
    while empty and not failures:
        for name in sorted(empty):
            try:
                answer = stack.prometheus_query(queries[name])
            except urllib.error.HTTPError as exc:  # 400 bad_data = the query does not parse
                failures.append(f"{name}: HTTP {exc.code} {exc.read().decode()[:300]}")
                continue
            if answer["status"] != "success":
                failures.append(f"{name}: {answer}")
            elif answer["data"]["result"]:
                empty.discard(name)
        if empty and time.monotonic() > deadline:
            failures += [f"{name}: no data after {SCRAPE_WAIT_S:.0f} s" for name in empty]
        elif empty:
            time.sleep(1.0)
    assert not failures, "\n".join(failures)
    print(f"\n[compose] {len(queries)} Grafana panel queries returned data", flush=True)


def kill_container_process(stack: Stack, service: str) -> None:
    """SIGKILL a service's main process from the host: a crash, which Docker's restart
    policy answers (`docker kill` would count as a manual stop and suppress it)."""
    env = dict(os.environ)
    container = run([*stack.compose, "ps", "-q", service], env, timeout=60).stdout.strip()
    pid = run(["docker", "inspect", "-f", "{{.State.Pid}}", container], env, timeout=60)
    os.kill(int(pid.stdout.strip()), 9)


def http_status(url: str) -> int:
    try:
        with urllib.request.urlopen(url, timeout=10) as response:
            return int(response.status)
    except urllib.error.HTTPError as exc:
        return exc.code
    except OSError:
        return 0


@live
def test_worker_sigkill_mid_stream_resumes_the_stream(stack: Stack, completion: Any) -> None:
    """The worker container crashes mid-stream: Docker restarts it, the scheduler resumes
    the request, and the stream runs to its full length without an error.

    Token equality with an uncrashed run is checked under `kvflow serve` in float32
    (tests/integration/test_serve_failures.py); this stack runs bfloat16, where the
    recomputing prefill may round differently from the decode steps it replaces and
    flip a near-tie, as after any preemption. So here: the text streamed before the
    kill is the reference's, and the stream ends by length with every token."""
    import openai

    client = openai.OpenAI(base_url=stack.api, api_key="unused", timeout=REQUEST_TIMEOUT_S)
    request = {
        "model": completion.model,
        "prompt": "Here is a long story about a dragon and a knight:",
        "max_tokens": 40,
        "temperature": 0.0,
        "extra_body": {"ignore_eos": True},
    }
    reference = client.completions.create(**request).choices[0].text
    pieces: list[str] = []
    before_kill, finishes, usage = "", [], None
    start = time.monotonic()
    stream = client.completions.create(
        **request, stream=True, stream_options={"include_usage": True}
    )
    for chunk in stream:
        pieces.extend(choice.text for choice in chunk.choices)
        finishes.extend(c.finish_reason for c in chunk.choices if c.finish_reason)
        usage = chunk.usage or usage
        if len(pieces) == 4:
            before_kill = "".join(pieces)
            kill_container_process(stack, "worker")
            start = time.monotonic()
    timed("stream finished after the worker's SIGKILL", start)
    assert before_kill and reference.startswith(before_kill)
    assert finishes == ["length"] and usage is not None and usage.completion_tokens == 40
    health = f"http://127.0.0.1:{stack.http_port}/health"
    deadline = time.monotonic() + REQUEST_TIMEOUT_S
    while http_status(health) != 200 and time.monotonic() < deadline:
        time.sleep(0.5)
    assert http_status(health) == 200
    with urllib.request.urlopen(health.replace("/health", "/metrics"), timeout=10) as response:
        metrics = response.read().decode()
    assert re.search(r"^kvflow:worker_restarts_total\{[^}]*\} 1\.0$", metrics, re.M), metrics
    assert re.search(r"^kvflow:requests_resumed_total\{[^}]*\} 1\.0$", metrics, re.M), metrics


@live
def test_frontend_sigkill_is_restarted_by_docker(stack: Stack, completion: Any) -> None:
    """The frontend container crashes: the client's connection drops, Docker restarts
    it, and it serves again (the engine behind it never stopped)."""
    health = f"http://127.0.0.1:{stack.http_port}/health"
    assert http_status(health) == 200
    kill_container_process(stack, "frontend")
    start = time.monotonic()
    deadline = start + REQUEST_TIMEOUT_S
    while http_status(health) == 200 and time.monotonic() < deadline:
        time.sleep(0.1)  # until the killed process stops answering
    while http_status(health) != 200 and time.monotonic() < deadline:
        time.sleep(0.5)
    timed("frontend back (health 200) after its SIGKILL", start)
    assert http_status(health) == 200
