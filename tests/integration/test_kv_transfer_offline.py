"""Disaggregated prefill/decode in process: a producer LLM saves prompt KV to shared
storage, a consumer LLM loads it and decodes. Greedy outputs must equal a colocated
engine's, and the consumer must compute no prompt token but the last of each prompt."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from kvflow import LLM, SamplingParams
from kvflow.errors import ConfigError
from kvflow.kv_transfer.scheduler.step_feature import KVTransferFeature

PROMPTS = [
    "The quick brown fox jumps over the lazy dog. " * 6,  # long: several blocks + a tail
    "Hello",  # shorter than a block
    "One two three four five six seven eight nine ten eleven twelve thirteen fourteen",
]


def _llm(model: Path, kv: dict[str, Any] | None = None, **options: Any) -> LLM:
    return LLM(
        str(model),
        dtype="float32",
        device="cpu",
        num_threads=1,
        num_blocks=64,
        block_size=8,
        kv_transfer_config=kv,
        **options,
    )


def _kv(role: str, path: Path) -> dict[str, Any]:
    return {
        "kv_role": role,
        "kv_connector": "shared-storage",
        "kv_connector_extra_config": {"storage_path": str(path)},
    }


def _count_scheduled(llm: LLM) -> list[int]:
    """Tokens each executed step computed (wraps the runner)."""
    runner = llm.engine.runner
    counts: list[int] = []
    execute = runner.execute

    def counting(plan: Any) -> Any:
        counts.append(plan.total_num_scheduled_tokens)
        return execute(plan)

    runner.execute = counting
    return counts


@pytest.mark.slow
def test_prefill_then_decode_equals_colocated(tiny_model_dir: Path, tmp_path: Path) -> None:
    model = tiny_model_dir
    params = [
        SamplingParams(max_tokens=12, temperature=0.0),
        SamplingParams(max_tokens=8, temperature=0.0, n=2),
        SamplingParams(max_tokens=12, temperature=0.0, stop=[" the"]),
    ]
    colocated = [o.outputs for o in _llm(model).generate(PROMPTS, params)]

    producer = _llm(model, _kv("kv_producer", tmp_path))
    prefill = [SamplingParams(max_tokens=1, temperature=0.0)] * len(PROMPTS)
    producer.generate(PROMPTS, prefill)
    assert list(tmp_path.rglob("*.kv")), "the producer saved no block"
    producer.engine.kv_cache.check_integrity()

    consumer = _llm(model, _kv("kv_consumer", tmp_path), enable_prefix_caching=False)
    counts = _count_scheduled(consumer)
    outputs = [o.outputs for o in consumer.generate(PROMPTS, params)]
    assert [[c.token_ids for c in o] for o in outputs] == [
        [c.token_ids for c in o] for o in colocated
    ]
    assert [[c.text for c in o] for o in outputs] == [[c.text for c in o] for o in colocated]
    # Per sample: its prompt's last token, then one token per output after the first.
    num_samples = sum(p.n for p in params)
    num_outputs = sum(len(c.token_ids) for o in outputs for c in o)
    assert sum(counts) == num_samples + num_outputs - num_samples
    feature = consumer.engine.scheduler.feature(KVTransferFeature)
    assert feature is not None
    connector = feature.connector
    prompt_lens = [len(consumer.tokenizer.encode(p)) for p in PROMPTS]
    loaded = sum((n - 1) * p.n for n, p in zip(prompt_lens, params))
    assert connector.counters.num_loaded_tokens == loaded
    consumer.engine.kv_cache.check_integrity()
    assert consumer.engine.kv_cache.num_free_blocks == 64


def test_disk_prefix_cache_across_instances(tiny_model_dir: Path, tmp_path: Path) -> None:
    """kv_both: a second instance reuses the first one's saved prefix blocks."""
    model = tiny_model_dir
    params = SamplingParams(max_tokens=4, temperature=0.0)
    first = _llm(model, _kv("kv_both", tmp_path)).generate(PROMPTS[:1], params)
    second = _llm(model, _kv("kv_both", tmp_path))
    counts = _count_scheduled(second)
    again = second.generate(PROMPTS[:1], params)
    assert again[0].outputs[0].token_ids == first[0].outputs[0].token_ids
    assert counts[0] == 1  # the first step computed the prompt's last token only


def test_config_refusals() -> None:
    with pytest.raises(ConfigError, match="kv_port"):
        LLM(kv_transfer_config={"kv_role": "kv_producer", "kv_connector": "zmq"})
    with pytest.raises(ConfigError, match="storage_path"):
        LLM(kv_transfer_config={"kv_role": "kv_consumer", "kv_connector": "shared-storage"})
    with pytest.raises(ConfigError, match="kv_role"):
        LLM(kv_transfer_config='{"kv_role": "decoder", "kv_connector": "shared-storage"}')


@pytest.mark.slow
def test_producer_copies_each_layer_during_the_forward(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    """Every attention layer hands its blocks over from inside the forward, and the
    files are byte for byte those of one copy after the forward."""
    prefill = [SamplingParams(max_tokens=1, temperature=0.0)] * len(PROMPTS)
    folders = {True: tmp_path / "by_layer", False: tmp_path / "after_forward"}
    for layer_by_layer, folder in folders.items():
        producer = _llm(tiny_model_dir, _kv("kv_producer", folder))
        connector = producer.engine.runner.kv_connector
        assert connector is not None
        connector.layer_by_layer = layer_by_layer
        for cache in connector.caches:  # a partial tail block's unused slots: not garbage
            cache.zero_()
        copier, handed = connector._copier, []
        submit = copier.submit

        def counting(save: Any, layer: int, submit: Any = submit, handed: Any = handed) -> Any:
            handed.append(layer)
            return submit(save, layer)

        copier.submit = counting  # type: ignore[method-assign]
        producer.generate(PROMPTS, prefill)
        num_layers = len(connector.caches)
        if layer_by_layer:  # one saving step at least, each with every layer in order
            assert handed and handed == list(range(num_layers)) * (len(handed) // num_layers)
        else:
            assert handed == []
    files = {True: sorted(folders[True].rglob("*.kv")), False: sorted(folders[False].rglob("*.kv"))}
    assert len(files[True]) == len(files[False]) > len(PROMPTS)
    for a, b in zip(files[True], files[False]):
        assert a.relative_to(folders[True]) == b.relative_to(folders[False])
        assert a.read_bytes() == b.read_bytes()


@pytest.mark.parametrize("kv_cache_dtype", ["int8", "fp8_e4m3"])
def test_quantized_blocks_cross_instances(
    tiny_model_dir: Path, tmp_path: Path, kv_cache_dtype: str
) -> None:
    """A quantized cache's blocks go to disk and into another instance byte for byte:
    the second instance, computing the last prompt token over the loaded prefix, gives
    what the first gives over its own cached prefix (a local prefix-cache hit reads the
    same dequantized rows; its first, fresh run attended unquantized K/V instead)."""
    params = SamplingParams(max_tokens=6, temperature=0.0)
    kv = _kv("kv_both", tmp_path)
    first = _llm(tiny_model_dir, kv, kv_cache_dtype=kv_cache_dtype)
    first.generate(PROMPTS[:1], params)
    local_hit = first.generate(PROMPTS[:1], params)[0].outputs[0]
    second = _llm(tiny_model_dir, kv, kv_cache_dtype=kv_cache_dtype)
    counts = _count_scheduled(second)
    loaded = second.generate(PROMPTS[:1], params)[0].outputs[0]
    assert counts[0] == 1  # the prompt's last token only: the rest came from disk
    assert loaded.token_ids == local_hit.token_ids
    # A float instance never reads them: another namespace, so it computes the prompt.
    plain = _llm(tiny_model_dir, kv)
    plain_counts = _count_scheduled(plain)
    plain.generate(PROMPTS[:1], params)
    assert plain_counts[0] > 1
