"""`--compare llama.cpp` without building llama.cpp: the random checkpoint round-trips
through transformers, the commands are llama.cpp's, its JSONL row is read; where the
peers' llama.cpp source is unpacked, the converter turns the checkpoint into BF16 and
Q8_0 GGUFs; where llama-batched-bench is built, a tiny run end to end."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from kvflow.bench import llama_cpp_peer
from kvflow.bench.dummy_checkpoint import write_dummy_checkpoint
from kvflow.bench.llama_cpp_peer import LlamaCpp, Workload
from kvflow.bench.shapes import write_shape_dir
from kvflow.errors import ConfigError

SHRINK = dict(
    hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
    num_key_value_heads=2, head_dim=16,
)  # fmt: skip
MOE = dict(moe_intermediate_size=32, num_experts=4, num_experts_per_tok=2)


def _tiny(tmp_path: Path, name: str) -> Path:
    return write_shape_dir(name, tmp_path, **SHRINK, **(MOE if "moe" in name else {}))


@pytest.mark.parametrize("name", ["llama-1b", "qwen3-moe-1b"])
def test_checkpoint_round_trips_through_transformers(tmp_path: Path, name: str) -> None:
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    checkpoint = write_dummy_checkpoint(_tiny(tmp_path, name), tmp_path / "ck")
    model, info = AutoModelForCausalLM.from_pretrained(
        str(checkpoint), dtype=torch.bfloat16, output_loading_info=True
    )
    assert not info["missing_keys"]
    assert not info["unexpected_keys"]
    index = json.loads((checkpoint / "model.safetensors.index.json").read_text())
    files = {f: load_file(str(checkpoint / f)) for f in set(index["weight_map"].values())}
    params = dict(model.named_parameters())
    assert set(index["weight_map"]) == set(params)
    for key, file in index["weight_map"].items():
        written = files[file][key]
        assert torch.equal(params[key].data, written), key
        if "norm" in key:
            assert bool((written == 1).all())
        elif written.dim() == 2 and written.numel() > 4096:  # N(0, 1/in_features)
            assert float(written.float().std()) == pytest.approx(written.shape[1] ** -0.5, 0.1)
    assert (checkpoint / "tokenizer.json").is_file()


def test_commands() -> None:
    llama = LlamaCpp(Path("/src/llama.cpp"), Path("/build"))
    work = Workload(num_prompts=64, input_len=256, output_len=128, threads=2)
    command = llama_cpp_peer.batched_bench_command(llama, Path("/m.gguf"), work)
    assert command[0] == "/build/bin/llama-batched-bench"
    flags = dict(zip(command[1::2], command[2::2]))
    assert flags["-npp"] == "256" and flags["-ntg"] == "128" and flags["-npl"] == "64"
    assert flags["-t"] == flags["-tb"] == "2" and flags["-m"] == "/m.gguf"
    assert int(flags["-c"]) >= 64 * (256 + 128)  # every sequence's KV fits
    assert flags["--output-format"] == "jsonl"
    configure, build = llama.build_commands("llama-batched-bench")
    assert "-DGGML_NATIVE=ON" in configure and "-DGGML_AMX_INT8=OFF" in configure
    assert build[build.index("--target") + 1] == "llama-batched-bench"
    convert = llama.convert_command(Path("/ck"), Path("/o.gguf"), "q8_0")
    assert convert[1] == "/src/llama.cpp/convert_hf_to_gguf.py"
    assert convert[-2:] == ["--outtype", "q8_0"] and "/ck" in convert
    assert llama.convert_env()["PYTHONPATH"].startswith("/src/llama.cpp/gguf-py")


def test_reads_the_jsonl_row() -> None:
    row = {"n_kv_max": 24592, "n_batch": 2048, "n_ubatch": 512, "flash_attn": -1,
           "is_pp_shared": 0, "n_gpu_layers": 0, "n_threads": 2, "n_threads_batch": 2,
           "pp": 256, "tg": 128, "pl": 64, "n_kv": 24576, "t_pp": 10.0, "speed_pp": 1638.4,
           "t_tg": 20.0, "speed_tg": 409.6, "t": 30.0, "speed": 819.2}  # fmt: skip
    stdout = "| PP | TG |\n" + json.dumps(row) + "\n"
    assert llama_cpp_peer.parse_batched_bench(stdout)["t"] == 30.0
    with pytest.raises(RuntimeError, match="no result"):
        llama_cpp_peer.parse_batched_bench("error\n")


def test_missing_source_names_the_fix(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KVFLOW_LLAMA_CPP_SRC", str(tmp_path / "nowhere"))
    with pytest.raises(ConfigError, match="KVFLOW_LLAMA_CPP_SRC"):
        LlamaCpp.locate()


def _source_or_skip() -> LlamaCpp:
    try:
        return LlamaCpp.locate()
    except ConfigError:
        pytest.skip("llama.cpp's source is not unpacked (see /work/shared/peers/README.md)")


@pytest.mark.slow
@pytest.mark.parametrize(("name", "per_block"), [("llama-1b", 9), ("qwen2.5-3b", 12)])
def test_converts_to_bf16_and_q8_0(tmp_path: Path, name: str, per_block: int) -> None:
    """A Qwen2 shape converts as the Llama it equals, its q/k/v biases included."""
    pytest.importorskip("sentencepiece")  # the converter imports it for Llama vocabularies
    llama = _source_or_skip()
    ggufs = llama_cpp_peer.ensure_ggufs(llama, _tiny(tmp_path, name), tmp_path / "work")
    from gguf import GGMLQuantizationType, GGUFReader

    for outtype, kind in [("bf16", GGMLQuantizationType.BF16), ("q8_0", GGMLQuantizationType.Q8_0)]:
        reader = GGUFReader(str(ggufs[outtype]))
        tensors = {t.name: t for t in reader.tensors}
        assert tensors["blk.0.ffn_down.weight"].tensor_type == kind
        assert len([n for n in tensors if n.startswith("blk.")]) == 2 * per_block
        assert bytes(reader.fields["general.architecture"].parts[-1]) == b"llama"


def test_a_qwen2_checkpoint_is_read_through_a_llama_view(tmp_path: Path) -> None:
    checkpoint = tmp_path / "checkpoint"
    checkpoint.mkdir()
    config = {"model_type": "qwen2", "architectures": ["Qwen2ForCausalLM"], "hidden_size": 64}
    (checkpoint / "config.json").write_text(json.dumps(config))
    (checkpoint / "model.safetensors").write_bytes(b"weights")
    view = llama_cpp_peer.conversion_view(checkpoint)
    assert view != checkpoint and (view / "model.safetensors").read_bytes() == b"weights"
    seen = json.loads((view / "config.json").read_text())
    assert seen["architectures"] == ["LlamaForCausalLM"] and seen["model_type"] == "llama"
    assert seen["attention_bias"] is True and seen["hidden_size"] == 64
    assert llama_cpp_peer.conversion_view(checkpoint) == view  # again: the same view
    (checkpoint / "config.json").write_text(json.dumps({"model_type": "llama"}))
    assert llama_cpp_peer.conversion_view(checkpoint) == checkpoint


@pytest.mark.slow
def test_tiny_end_to_end(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    llama = _source_or_skip()
    if not llama.tool("llama-batched-bench").is_file():
        pytest.skip("llama-batched-bench is not built on this machine")
    from kvflow.cli.main import main

    argv = ["bench", "throughput", "--config", str(_tiny(tmp_path, "llama-1b")),
            "--num-prompts", "2", "--input-len", "8", "--output-len", "4", "--dtype",
            "bfloat16", "--num-threads", "2", "--compare", "llama.cpp", "--json"]  # fmt: skip
    assert main(argv) == 0
    report = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    for name in ("kvflow", "llama.cpp BF16", "llama.cpp Q8_0"):
        assert report[name]["output_tokens"] == 8, name
