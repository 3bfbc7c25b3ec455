"""The transformers-free EOS reader agrees with the transformers-based one."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from kvflow.tokenizer import load_eos_token_ids, load_tokenizer, read_eos_token_ids


@pytest.mark.parametrize("which", ["embedded", "tiny-qwen3"])
def test_read_eos_matches_tokenizer(which: str, request: pytest.FixtureRequest) -> None:
    if which == "embedded":
        model_dir: Path = request.getfixturevalue("embedded_model_dir")
    else:
        model_dir = request.getfixturevalue("tiny_model_dir")("qwen3")
    expected = load_eos_token_ids(model_dir, load_tokenizer(model_dir))
    assert expected  # the test means nothing on a model without EOS
    assert read_eos_token_ids(model_dir) == expected


def test_generation_config_list_adds_ids(embedded_model_dir: Path, tmp_path: Path) -> None:
    model_dir = tmp_path / "model"
    model_dir.mkdir()
    for f in embedded_model_dir.iterdir():
        if f.suffix == ".safetensors":
            continue  # only the tokenizer and config files matter here
        if f.is_file():
            (model_dir / f.name).write_bytes(f.read_bytes())
    (model_dir / "generation_config.json").write_text(json.dumps({"eos_token_id": [7, 9]}))
    ids = read_eos_token_ids(model_dir)
    assert {7, 9} <= ids
    assert ids == load_eos_token_ids(model_dir, load_tokenizer(model_dir))
