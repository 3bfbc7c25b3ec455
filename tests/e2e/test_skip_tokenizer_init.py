"""`skip_tokenizer_init`: a model directory with only config.json (random weights) runs
on token ids; outputs are token ids with empty text, and text prompts are refused."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvflow import LLM, SamplingParams
from kvflow.bench.shapes import shape_config
from kvflow.errors import InvalidRequestError
from kvflow.tokenizer import has_tokenizer_files, read_eos_token_ids

TINY = dict(
    hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
    num_key_value_heads=2, head_dim=16, vocab_size=512, eos_token_id=7,
)  # fmt: skip


@pytest.fixture(scope="module")
def bare_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("config-only")
    shape_config("llama-1b", **TINY).save_pretrained(path)
    assert not has_tokenizer_files(path)
    return path


def test_eos_ids_come_from_the_config(bare_dir: Path) -> None:
    assert read_eos_token_ids(bare_dir) == frozenset({7})


@pytest.mark.parametrize("skip", [True, False])
def test_token_ids_in_and_out(bare_dir: Path, embedded_model_dir: Path, skip: bool) -> None:
    # skip=False: a model with a tokenizer, loaded without it, gives the same token ids
    # as with it and no text.
    if not skip:
        pytest.importorskip("transformers")
    model = bare_dir if skip else embedded_model_dir
    llm = LLM(str(model), load_format="dummy", skip_tokenizer_init=True, num_threads=1,
              block_size=4, num_blocks=64, dtype="float32")  # fmt: skip
    params = SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True)
    prompts = [{"prompt_token_ids": [1, 2, 3, 4]}, [5, 6, 7]]
    outputs = llm.generate(prompts, params)
    assert [o.prompt_token_ids for o in outputs] == [[1, 2, 3, 4], [5, 6, 7]]
    for output in outputs:
        assert len(output.outputs[0].token_ids) == 5
        assert output.outputs[0].text == ""
        assert output.prompt is None
    with pytest.raises(InvalidRequestError, match="send prompts as token ids"):
        llm.generate(["Hello"], params)
    with pytest.raises(InvalidRequestError, match=r"skip-tokenizer-init.*no chat template"):
        llm.chat([{"role": "user", "content": "Hi"}], params)
    if not skip:  # the same ids as the engine with its tokenizer
        llm.close()
        del llm
        with_tokenizer = LLM(str(model), load_format="dummy", num_threads=1, block_size=4,
                             num_blocks=64, dtype="float32")  # fmt: skip
        again = with_tokenizer.generate(prompts, params)
        assert [o.outputs[0].token_ids for o in again] == [o.outputs[0].token_ids for o in outputs]
        assert again[0].outputs[0].text != ""
