"""The options of this area, as the CLI and the offline API take them: the API key from a
flag, a file or the environment; the load limits as engine flags for the scheduler, and
refused by the offline `LLM` (which runs every prompt it is given)."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvflow import LLM
from kvflow.cli.args import engine_options
from kvflow.cli.main import build_parser
from kvflow.cli.serve import resolve_api_key, resolve_reasoning_parser
from kvflow.config import EngineConfig
from kvflow.errors import ConfigError
from kvflow.services.frontend.config import FrontendConfig


def _args(*argv: str) -> object:
    return build_parser().parse_args(["frontend", "--ipc-dir", "/tmp/x", *argv])


def test_api_key_from_flag_file_or_environment(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("KVFLOW_API_KEY", raising=False)
    assert resolve_api_key(_args()) is None
    assert resolve_api_key(_args("--api-key", "k1")) == "k1"
    key_file = tmp_path / "key"
    key_file.write_text("k2\nignored\n")
    assert resolve_api_key(_args("--api-key-file", str(key_file))) == "k2"
    monkeypatch.setenv("KVFLOW_API_KEY", "k3")
    assert resolve_api_key(_args()) == "k3"
    assert resolve_api_key(_args("--api-key", "k1")) == "k1"  # the flag wins
    with pytest.raises(SystemExit, match="not both"):
        resolve_api_key(_args("--api-key", "k1", "--api-key-file", str(key_file)))
    with pytest.raises(SystemExit, match="cannot read"):
        resolve_api_key(_args("--api-key-file", str(tmp_path / "missing")))
    key_file.write_text("  \n")
    with pytest.raises(SystemExit, match="empty"):
        resolve_api_key(_args("--api-key-file", str(key_file)))


def test_load_limits_are_engine_flags_of_every_role() -> None:
    for role in ("serve", "scheduler", "frontend"):
        argv = [role, "--max-waiting-requests", "8", "--max-queue-delay", "2.5"]
        if role != "serve":
            argv += ["--ipc-dir", "/tmp/x"]
        options = engine_options(build_parser().parse_args(argv))
        config = EngineConfig.create(device="cpu", dtype="float32", **options).scheduler
        assert (config.max_waiting_requests, config.max_queue_delay) == (8, 2.5)
    with pytest.raises(ConfigError, match="max_waiting_requests must be >= 1"):
        EngineConfig.create(device="cpu", dtype="float32", max_waiting_requests=0)


@pytest.mark.parametrize("option", [{"max_waiting_requests": 4}, {"max_queue_delay": 1.0}])
def test_offline_llm_refuses_load_limits(option: dict[str, float]) -> None:
    with pytest.raises(ConfigError, match="kvflow serve"):
        LLM(device="cpu", dtype="float32", **option)


def test_cpu_attention_backend_is_refused_on_cuda() -> None:
    from kvflow.device_resolution import resolve_attention_backend

    assert resolve_attention_backend("cpu", "cpu") == "cpu"
    assert resolve_attention_backend("auto", "cuda") == "triton"
    with pytest.raises(ConfigError, match="device cpu only"):
        resolve_attention_backend("cpu", "cuda")


def test_reasoning_parser_is_checked_at_start() -> None:
    assert resolve_reasoning_parser(_args()) is None
    assert resolve_reasoning_parser(_args("--reasoning-parser", "qwen3")) == "qwen3"
    assert resolve_reasoning_parser(_args("--reasoning-parser", "deepseek_r1")) == "deepseek_r1"
    with pytest.raises(SystemExit, match="known: deepseek_r1, qwen3"):
        resolve_reasoning_parser(_args("--reasoning-parser", "qwen9"))
    with pytest.raises(ConfigError, match="unknown reasoning parser"):
        FrontendConfig("m", max_model_len=8, vocab_size=8, reasoning_parser="qwen9")
