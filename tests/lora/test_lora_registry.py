"""The frontend's adapter registry and the runtime-update gate, without a server."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvflow.config import EngineConfig
from kvflow.errors import ConfigError, LoRAAdapterError, ModelNotFoundError
from kvflow.lora_config import RUNTIME_UPDATES_ENV, LoRAConfig, LoRAModule
from kvflow.services.frontend.errors import APIError
from kvflow.services.frontend.lora_registry import LoRARegistry
from kvflow.services.frontend.serving_lora import load_lora_adapter


def test_runtime_updates_are_off_unless_enabled(
    lora_base: Path, lora_adapters: dict[str, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv(RUNTIME_UPDATES_ENV, raising=False)
    registry = LoRARegistry(LoRAConfig(enable_lora=True), str(lora_base), "base")
    body = f'{{"lora_name": "a1", "lora_path": "{lora_adapters["a1"]}"}}'.encode()
    with pytest.raises(APIError, match="runtime LoRA updates are off"):
        load_lora_adapter(registry, body)
    monkeypatch.setenv(RUNTIME_UPDATES_ENV, "true")
    assert load_lora_adapter(registry, body).status_code == 200
    assert registry.resolve("a1") is not None and registry.resolve("base") is None
    with pytest.raises(ModelNotFoundError, match="model not found"):
        registry.resolve("a3")


def test_start_up_adapters_and_cli_flags(lora_base: Path, lora_adapters: dict[str, Path]) -> None:
    good = LoRAModule("a1", str(lora_adapters["a1"]))
    config = LoRAConfig(enable_lora=True, max_lora_rank=4, lora_modules=(good,))
    with pytest.raises(ConfigError, match="--lora-modules a1: LoRA rank 8 is above"):
        LoRARegistry(config, str(lora_base), "base")  # a bad adapter stops the start
    registry = LoRARegistry(
        LoRAConfig(enable_lora=True, max_lora_rank=8, lora_modules=(good,)), str(lora_base), "b"
    )
    first = registry.resolve("a1")
    assert first is not None and first.lora_int_id > 0
    with pytest.raises(LoRAAdapterError, match="already served"):
        registry.load("a1", str(lora_adapters["a1"]))
    import argparse

    from kvflow.cli.args import add_engine_args, engine_options

    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    json_module = '{"name": "a2", "path": "/p/a2", "base_model_name": "tiny"}'
    args = parser.parse_args(
        ["--enable-lora", "--max-loras", "3", "--lora-modules", "a1=/p/a1", json_module]
    )
    engine = EngineConfig.create(**engine_options(args))
    assert engine.lora.max_loras == 3
    assert engine.lora.lora_modules == (
        LoRAModule("a1", "/p/a1"),
        LoRAModule("a2", "/p/a2", "tiny"),
    )
