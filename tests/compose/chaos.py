"""Chaos run against a compose profile: load at a fixed concurrency while a random role
is SIGKILLed every few seconds, then a tally of what every request got.

    python tests/compose/chaos.py --profile dp --duration 180      # the documented table
    python tests/compose/chaos.py --profile tp --tp-model-dir DIR  # tp needs a model (heads % 2)

Brings the profile up as its own compose project on free 127.0.0.1 ports, takes greedy
references one request at a time, then runs the load and the killer, drains, checks the
service answers again, and takes the project down. The images must be built
(docker/build_images.sh, or `make test-compose` once) and `make cluster-secret` run.
Killing means SIGKILL of the container's PID 1 (tini) from the host: a crash, which
`restart: unless-stopped` answers (`docker kill` would count as a manual stop).

Outcomes: exact (the reference text), complete (full length, well formed, other text:
a bfloat16 near-tie flipped by a different batch or a recompute), rejected (503 or
connection refused: the service said "not now" before admitting it), error (an error
status other than 503, or a malformed or short reply), dropped (the connection closed
without a reply: the HTTP process died with it, or Docker's port proxy had no container
to forward to), lost (no answer within the client timeout). Each error, drop and loss is
charged to the role killed last before it ended.
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import random
import signal
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from test_compose import COMPOSE_FILE, compose_command, free_port, print_logs, run

OUTCOMES = ("exact", "complete", "rejected", "error", "dropped", "lost")
PROMPTS = (
    "The capital of France is",
    "Once upon a time, in a small village,",
    "The three primary colours are",
    "To make a cup of tea, first",
    "The largest planet in the solar system is",
    "A haiku about the sea:",
    "def fibonacci(n):",
    "The quick brown fox",
)


@dataclass(frozen=True)
class Profile:
    target: str  # the service `up --wait` brings up (with its dependencies)
    port_env: str  # the variable compose.yaml publishes the target's port with
    roles: tuple[str, ...]  # the roles the killer picks from


# Every role of each profile is eligible, the HTTP entry point included: its death drops
# the connections it held (an error, never a silent loss), and the restart must serve.
PROFILES = {
    "dp": Profile(
        "frontend-dp",
        "KVFLOW_DP_HTTP_PORT",
        (
            "worker",
            "scheduler",
            "detokenizer",
            "worker-e1",
            "scheduler-e1",
            "detokenizer-e1",
            "frontend-dp",
        ),
    ),
    "disagg": Profile("proxy", "KVFLOW_DISAGG_HTTP_PORT", ("prefill", "decode", "proxy")),
    "tp": Profile(
        "frontend-tp",
        "KVFLOW_TP_HTTP_PORT",
        ("worker-tp0", "worker-tp1", "scheduler-tp", "detokenizer-tp", "frontend-tp"),
    ),
}


@dataclass
class ChaosConfig:
    profile: str
    duration_s: float = 180.0
    interval_s: float = 20.0
    concurrency: int = 16
    max_tokens: int = 8
    client_timeout_s: float = 300.0
    seed: int = 0
    project: str = "kvflow-chaos"
    tp_model_dir: str | None = None


@dataclass
class Tally:
    outcomes: Counter[str] = field(default_factory=Counter)
    errors_by_role: Counter[str] = field(default_factory=Counter)
    kills: list[tuple[float, str]] = field(default_factory=list)
    samples: dict[str, str] = field(default_factory=dict)  # outcome -> one example
    recovered_s: float | None = None
    lock: threading.Lock = field(default_factory=threading.Lock)

    def record(self, outcome: str, detail: str, at: float) -> None:
        with self.lock:
            self.outcomes[outcome] += 1
            self.samples.setdefault(outcome, detail[:300])
            if outcome in ("error", "dropped", "lost"):
                before = [role for t, role in self.kills if t <= at]
                self.errors_by_role[f"{outcome}:{before[-1] if before else 'none'}"] += 1

    def summary(self) -> dict[str, object]:
        sent = sum(self.outcomes.values())
        kills = Counter(role for _, role in self.kills)
        return {
            "sent": sent,
            **{k: self.outcomes[k] for k in OUTCOMES},
            "kills": dict(kills),
            "errors_by_last_kill": dict(self.errors_by_role),
            "samples": self.samples,
            "recovered_s": self.recovered_s,
        }


def post(api: str, body: dict[str, object], timeout: float) -> dict[str, object]:
    request = urllib.request.Request(
        api + "/v1/completions",
        data=json.dumps(body).encode(),
        headers={"Content-Type": "application/json"},
    )
    with urllib.request.urlopen(request, timeout=timeout) as response:
        return dict(json.load(response))


def request_body(prompt: str, max_tokens: int) -> dict[str, object]:
    return {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0, "ignore_eos": True}


def classify(reply: dict[str, object], reference: str, max_tokens: int) -> tuple[str, str]:
    choices = reply.get("choices")
    usage = reply.get("usage")
    if not (isinstance(choices, list) and len(choices) == 1 and isinstance(usage, dict)):
        return "error", f"malformed reply: {reply}"
    choice = choices[0]
    if choice.get("finish_reason") != "length" or usage.get("completion_tokens") != max_tokens:
        return "error", f"incomplete reply: {reply}"
    text = str(choice.get("text"))
    return ("exact" if text == reference else "complete"), text


def one_request(api: str, prompt: str, reference: str, config: ChaosConfig) -> tuple[str, str]:
    """The outcome of one request, and a detail for the report."""
    try:
        reply = post(api, request_body(prompt, config.max_tokens), config.client_timeout_s)
    except urllib.error.HTTPError as e:
        try:
            body = e.read().decode(errors="replace")
        except (ConnectionError, http.client.HTTPException) as read_error:
            body = f"(body lost: {read_error!r})"
        return ("rejected" if e.code == 503 else "error"), f"{e.code} {body}"
    except TimeoutError as e:
        return "lost", repr(e)
    except urllib.error.URLError as e:
        if isinstance(e.reason, TimeoutError):
            return "lost", repr(e)
        if isinstance(e.reason, ConnectionRefusedError):
            return "rejected", repr(e)
        return "dropped", repr(e)
    except (ConnectionError, http.client.HTTPException) as e:
        return "dropped", repr(e)
    except json.JSONDecodeError as e:
        return "error", repr(e)
    return classify(reply, reference, config.max_tokens)


def load_loop(
    api: str,
    references: dict[str, str],
    config: ChaosConfig,
    tally: Tally,
    deadline: float,
    seed: int,
) -> None:
    rng = random.Random(seed)
    while time.monotonic() < deadline:
        prompt = rng.choice(PROMPTS)
        outcome, detail = one_request(api, prompt, references[prompt], config)
        tally.record(outcome, detail, time.monotonic())
        if outcome not in ("exact", "complete"):
            time.sleep(1.0)  # as a client backs off; not a tight loop of refusals


def container_pid(compose: list[str], env: dict[str, str], role: str) -> int:
    container = run([*compose, "ps", "-q", role], env, 60).stdout.strip()
    if not container:
        return 0
    state = run(["docker", "inspect", "-f", "{{.State.Pid}}", container], env, 60).stdout
    return int(state.strip() or 0)


def kill_loop(
    compose: list[str], env: dict[str, str], config: ChaosConfig, tally: Tally, deadline: float
) -> None:
    rng = random.Random(config.seed)
    roles = PROFILES[config.profile].roles
    while time.monotonic() + config.interval_s < deadline:
        time.sleep(config.interval_s)
        role = rng.choice(roles)
        pid = container_pid(compose, env, role)
        if pid <= 0:  # still restarting from an earlier kill: pick again next time
            print(f"[chaos] {role} is not running; no kill", flush=True)
            continue
        os.kill(pid, 9)
        with tally.lock:
            tally.kills.append((time.monotonic(), role))
        elapsed = time.monotonic() - deadline + config.duration_s
        print(
            f"[chaos] t={elapsed:.0f}s SIGKILL {role} (pid {pid}); so far {dict(tally.outcomes)}",
            flush=True,
        )


def take_references(api: str, config: ChaosConfig) -> dict[str, str]:
    """Each prompt once (together), before any kill: the greedy text the run is held to."""
    texts: dict[str, str] = {}

    def take(prompt: str) -> None:
        reply = post(api, request_body(prompt, config.max_tokens), config.client_timeout_s)
        texts[prompt] = str(reply["choices"][0]["text"])  # type: ignore[index]

    threads = [threading.Thread(target=take, args=(prompt,)) for prompt in PROMPTS]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert len(texts) == len(PROMPTS), "a reference request failed before any kill"
    print(f"[chaos] references taken: {texts}", flush=True)
    return texts


def wait_healthy(api: str, config: ChaosConfig, timeout: float) -> float | None:
    """Seconds until one completion succeeds again after the load ended, None if never."""
    start = time.monotonic()
    while time.monotonic() - start < timeout:
        outcome, _ = one_request(api, PROMPTS[0], "", config)
        if outcome in ("exact", "complete"):
            return time.monotonic() - start
        time.sleep(2.0)
    return None


def run_chaos(api: str, compose: list[str], env: dict[str, str], config: ChaosConfig) -> Tally:
    references = take_references(api, config)
    tally = Tally()
    deadline = time.monotonic() + config.duration_s
    threads = [
        threading.Thread(
            target=load_loop, args=(api, references, config, tally, deadline, i), daemon=True
        )
        for i in range(config.concurrency)
    ]
    killer = threading.Thread(
        target=kill_loop, args=(compose, env, config, tally, deadline), daemon=True
    )
    for thread in [*threads, killer]:
        thread.start()
    for thread in [*threads, killer]:  # a load thread ends within one client timeout
        thread.join()
    tally.recovered_s = wait_healthy(api, config, 300.0)
    return tally


def patient_health_checks(profile: Profile, directory: Path) -> Path:
    """A compose override giving each role's health check 30 s and 20 tries: on a loaded
    machine the check's own Python start can pass 5 s, and `up --wait` must not fail
    over that (health gates only the start order; restarts follow the process)."""
    checks = {"healthcheck": {"timeout": "30s", "retries": 20}}
    path = directory / "chaos-health.yaml"
    path.write_text(json.dumps({"services": dict.fromkeys(profile.roles, checks)}))
    return path


@contextmanager
def profile_stack(config: ChaosConfig) -> Iterator[tuple[str, list[str], dict[str, str]]]:
    """The profile up (own project, free ports), then down with its volumes."""
    profile = PROFILES[config.profile]
    port = free_port()
    env = {**os.environ, profile.port_env: str(port)}
    for name in ("KVFLOW_HTTP_PORT", "KVFLOW_PROMETHEUS_PORT"):
        env[name] = str(free_port())
    if config.tp_model_dir:
        env["KVFLOW_TP_MODEL_DIR"] = config.tp_model_dir
    with tempfile.TemporaryDirectory() as directory:
        override = patient_health_checks(profile, Path(directory))
        compose = [*compose_command(), "-f", str(COMPOSE_FILE), "-f", str(override)]
        compose += ["-p", config.project, "--profile", config.profile]
        run([*compose, "down", "-v", "--remove-orphans", "--timeout", "10"], env, 180)
        up = run(
            [*compose, "up", "-d", "--wait", "--wait-timeout", "900", profile.target], env, 1200
        )
        try:
            if up.returncode != 0:
                raise RuntimeError(f"compose up ({config.profile}) failed:\n{up.stdout}{up.stderr}")
            yield f"http://127.0.0.1:{port}", compose, env
        except BaseException:
            print_logs(compose, env)
            raise
        finally:
            run([*compose, "down", "-v", "--remove-orphans", "--timeout", "30"], env, 300)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--profile", choices=sorted(PROFILES), required=True)
    parser.add_argument("--duration", type=float, default=180.0)
    parser.add_argument("--interval", type=float, default=20.0)
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--max-tokens", type=int, default=8)
    parser.add_argument("--client-timeout", type=float, default=300.0)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--project", default="kvflow-chaos")
    parser.add_argument("--tp-model-dir")
    parser.add_argument("--json", help="also write the tally here")
    args = parser.parse_args()
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(1))  # so that the stack goes down
    config = ChaosConfig(
        args.profile,
        args.duration,
        args.interval,
        args.concurrency,
        args.max_tokens,
        args.client_timeout,
        args.seed,
        args.project,
        args.tp_model_dir,
    )
    with profile_stack(config) as (api, compose, env):
        summary = run_chaos(api, compose, env, config).summary()
    text = json.dumps({"profile": config.profile, **summary}, indent=2)
    print(text)
    if args.json:
        Path(args.json).write_text(text)


if __name__ == "__main__":
    main()
