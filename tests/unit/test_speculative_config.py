"""--speculative-config parsing and validation (vLLM's JSON shape)."""

from __future__ import annotations

import argparse

import pytest

from kvflow.cli.args import add_engine_args, engine_options
from kvflow.config import EngineConfig
from kvflow.errors import ConfigError
from kvflow.speculative_config import SpeculativeConfig


def test_parses_json_and_dicts() -> None:
    text = '{"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 3}'
    config = SpeculativeConfig.parse(text)
    assert (config.method, config.num_speculative_tokens) == ("ngram", 4)
    assert (config.prompt_lookup_min, config.prompt_lookup_max) == (3, 3)  # one sets both
    assert SpeculativeConfig.parse(config.to_json()) == config
    assert (
        SpeculativeConfig.parse({"method": "suffix", "num_speculative_tokens": 8}).method
        == "suffix"
    )


@pytest.mark.parametrize(
    ("value", "message"),
    [
        ("[1]", "JSON object"),
        ("{nope", "valid JSON"),
        ({"method": "eagle", "num_speculative_tokens": 2}, "method"),
        ({"method": "ngram"}, "num_speculative_tokens"),
        ({"method": "ngram", "num_speculative_tokens": 0}, ">= 1"),
        ({"method": "ngram", "num_speculative_tokens": 2, "typo": 1}, "unknown"),
        (
            {
                "method": "ngram",
                "num_speculative_tokens": 2,
                "prompt_lookup_min": 4,
                "prompt_lookup_max": 2,
            },
            "prompt_lookup_min",
        ),
        ({"method": "draft_model", "num_speculative_tokens": 2}, "model"),
        ({"method": "ngram", "num_speculative_tokens": 2, "model": "/m"}, "model"),
        ({"method": "ngram", "num_speculative_tokens": 2, "disable_by_batch_size": 0}, "batch"),
        ({"method": "ngram", "num_speculative_tokens": 2, "min_acceptance_rate": 2}, "acceptance"),
        ({"method": "ngram", "num_speculative_tokens": "x"}, "speculative"),
    ],
)
def test_rejects_bad_configs(value: object, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        SpeculativeConfig.parse(value)  # type: ignore[arg-type]


def test_cli_flag_reaches_the_engine_config(capsys: pytest.CaptureFixture[str]) -> None:
    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    text = '{"method": "suffix", "num_speculative_tokens": 6}'
    args = parser.parse_args(
        ["--speculative-config", text, "--device", "cpu", "--dtype", "float32"]
    )
    config = EngineConfig.create(**engine_options(args))
    spec = config.speculative.speculative_config
    assert spec is not None and (spec.method, spec.num_speculative_tokens) == ("suffix", 6)
    assert EngineConfig.create(device="cpu", dtype="float32").speculative.speculative_config is None
    with pytest.raises(SystemExit):
        parser.parse_args(["--speculative-config", '{"method": "ngram"}'])
    assert "num_speculative_tokens" in capsys.readouterr().err


@pytest.mark.parametrize("method", ["ngram", "suffix", "draft_model"])
def test_acceptance_floor_defaults_to_the_measured_break_even(method: str) -> None:
    from kvflow.speculative_config import BREAK_EVEN_ACCEPTANCE

    model = {"model": "/m"} if method == "draft_model" else {}
    config = SpeculativeConfig.parse({"method": method, "num_speculative_tokens": 4, **model})
    assert config.min_acceptance_rate == BREAK_EVEN_ACCEPTANCE[method]
    assert 0.0 < config.acceptance_rate_floor < 1.0
    given = SpeculativeConfig.parse(
        {"method": method, "num_speculative_tokens": 4, "min_acceptance_rate": 0.25, **model}
    )
    assert given.acceptance_rate_floor == 0.25
    assert SpeculativeConfig.parse(given.to_json()) == given
