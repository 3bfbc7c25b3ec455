"""kvflow/pooling.py: the pooler from sentence-transformers files, `--pooler-config`
overrides, and the Matryoshka `dimensions` rules."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import numpy as np
import pytest

from kvflow.cli.args import add_engine_args, engine_options
from kvflow.config import EngineConfig
from kvflow.errors import ConfigError, InvalidRequestError
from kvflow.pooling import (
    PoolerConfig,
    PoolingSpec,
    check_dimensions,
    embedding_vector,
    resolve_pooling,
)

POOLING = "sentence_transformers.models.Pooling"
NORMALIZE = "sentence_transformers.models.Normalize"


def _model(tmp_path: Path, modules: list[str] | None, mode: str | None, **config: object) -> Path:
    tmp_path.mkdir(exist_ok=True)
    (tmp_path / "config.json").write_text(json.dumps({"hidden_size": 8, **config}))
    if modules is not None:
        entries = [{"path": "1_Pooling" if t == POOLING else "", "type": t} for t in modules]
        (tmp_path / "modules.json").write_text(json.dumps(entries))
    if mode is not None:
        (tmp_path / "1_Pooling").mkdir()
        modes = {f"pooling_mode_{m}": m == mode for m in ("lasttoken", "mean_tokens", "cls_token")}
        (tmp_path / "1_Pooling" / "config.json").write_text(json.dumps(modes))
    return tmp_path


@pytest.mark.parametrize(
    ("modules", "mode", "expected"),
    [
        (None, None, ("LAST", True)),  # no sentence-transformers files: the default
        ([POOLING, NORMALIZE], "mean_tokens", ("MEAN", True)),
        ([POOLING], "cls_token", ("CLS", False)),  # no Normalize module: not normalised
        ([POOLING, NORMALIZE], "lasttoken", ("LAST", True)),
    ],
)
def test_sentence_transformers_files(
    tmp_path: Path, modules: list[str] | None, mode: str | None, expected: tuple[str, bool]
) -> None:
    spec = resolve_pooling(_model(tmp_path, modules, mode), None)
    assert (spec.pooling_type, spec.normalize, spec.hidden_size) == (*expected, 8)
    assert spec.needs_every_position == (expected[0] != "LAST")


def test_pooler_config_overrides_each_key_it_sets(tmp_path: Path) -> None:
    model = _model(tmp_path, [POOLING, NORMALIZE], "mean_tokens")
    assert resolve_pooling(model, PoolerConfig(normalize=False)).pooling_type == "MEAN"
    spec = resolve_pooling(model, PoolerConfig.parse('{"pooling_type": "cls"}'))
    assert (spec.pooling_type, spec.normalize) == ("CLS", True)


def test_unsupported_sentence_transformers_mode_is_refused(tmp_path: Path) -> None:
    model = _model(tmp_path, [POOLING], None)
    (tmp_path / "1_Pooling").mkdir()
    (tmp_path / "1_Pooling" / "config.json").write_text('{"pooling_mode_max_tokens": true}')
    with pytest.raises(ConfigError, match="pooler-config"):
        resolve_pooling(model, None)


@pytest.mark.parametrize(
    "text", ['{"pooling_type": "MAX"}', '{"normalise": true}', '{"normalize": 1}', "[1]"]
)
def test_bad_pooler_config_is_a_config_error(text: str) -> None:
    with pytest.raises(ConfigError):
        PoolerConfig.parse(text)


def test_flags_reach_the_engine_config() -> None:
    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    args = parser.parse_args(["--runner", "pooling", "--pooler-config", '{"pooling_type": "MEAN"}'])
    config = EngineConfig.create(**engine_options(args))
    assert config.model.runner == "pooling"
    assert config.model.pooler_config == PoolerConfig(pooling_type="MEAN")
    with pytest.raises(SystemExit):
        parser.parse_args(["--pooler-config", '{"pooling_type": "MAX"}'])
    with pytest.raises(ConfigError, match="never decodes"):
        EngineConfig.create(runner="pooling", speculative_config={"method": "ngram",
                            "num_speculative_tokens": 2})  # fmt: skip


def test_matryoshka_dimensions(tmp_path: Path) -> None:
    plain = resolve_pooling(_model(tmp_path / "a", None, None), None)
    assert not plain.is_matryoshka
    with pytest.raises(InvalidRequestError, match="Matryoshka"):
        check_dimensions(plain, 4)
    check_dimensions(plain, None)
    listed = resolve_pooling(_model(tmp_path / "b", None, None, matryoshka_dimensions=[4, 8]), None)
    check_dimensions(listed, 4)
    with pytest.raises(InvalidRequestError, match=r"\[4, 8\]"):
        check_dimensions(listed, 6)
    free = resolve_pooling(_model(tmp_path / "c", None, None, is_matryoshka=True), None)
    check_dimensions(free, 6)
    with pytest.raises(InvalidRequestError, match=r"\[1, 8\]"):
        check_dimensions(free, 9)


@pytest.mark.parametrize("normalize", [True, False])
def test_embedding_vector_cuts_and_renormalises(normalize: bool) -> None:
    raw = np.arange(1, 9, dtype=np.float32)
    stored = raw / np.linalg.norm(raw) if normalize else raw
    spec = PoolingSpec(normalize=normalize, hidden_size=8, is_matryoshka=True)
    pooled = stored.astype("<f4").tobytes()
    assert np.array_equal(embedding_vector(pooled, spec, None), stored)
    cut = embedding_vector(pooled, spec, 3)
    want = raw[:3] / np.linalg.norm(raw[:3]) if normalize else raw[:3]
    assert cut.dtype == np.float32 and np.allclose(cut, want, atol=1e-6)
