"""`kvflow bench vlm`: the flags each engine and the client get, the figures taken from
the client's result, the table; `kvflow bench vlm-config`'s size options; the vLLM
server's command, environment and its Pixtral import shim."""

from __future__ import annotations

import argparse
import importlib.util
import sys
from pathlib import Path
from typing import Any

import pytest

from kvflow.bench import serve, vllm_server, vlm, vlm_config
from kvflow.cli.main import build_parser


def _args(*argv: str) -> argparse.Namespace:
    return build_parser().parse_args(["bench", "vlm", *argv])


def test_defaults_are_the_issue_workload() -> None:
    args = _args()
    assert (args.num_prompts, args.input_len, args.output_len) == (32, 64, 64)
    assert (args.max_concurrency, args.request_image_size, args.compare) == (8, "448x448", None)
    assert args.handler is vlm.run


def test_the_client_gets_the_same_workload_for_either_engine(tmp_path: Path) -> None:
    args = _args("--num-prompts", "5", "--output-len", "7", "--request-image-size", "64x48")
    result = tmp_path / "r.json"
    argv = vlm.workload_args(args, "http://127.0.0.1:1", tmp_path, result)
    parser = argparse.ArgumentParser()
    serve.add_args(parser)
    parsed = parser.parse_args(argv)
    assert parsed.random_image_size == (64, 48) and parsed.num_prompts == 5
    assert (parsed.random_input_len, parsed.random_output_len) == (64, 7)
    assert parsed.max_concurrency == 8 and parsed.ignore_eos and parsed.save_result
    assert parsed.metric_percentiles == [50.0, 99.0]
    assert Path(parsed.result_dir) / parsed.result_filename == result
    assert parsed.tokenizer == str(tmp_path)


def test_both_servers_get_the_same_model_settings(tmp_path: Path) -> None:
    args = _args(
        "--max-model-len", "2048", "--kv-cache-gib", "2", "--kvflow-args", "--block-size 32"
    )
    ours = vlm.kvflow_serve_args(args, tmp_path)
    spec = vllm_server.VllmServe(tmp_path, "bfloat16", 2048, 2, extra_args=("--x",))
    peer = vllm_server.server_args(spec, 1234)
    for flag, value in [("--model", str(tmp_path)), ("--load-format", "dummy"),
                        ("--dtype", "bfloat16"), ("--max-model-len", "2048"), ("--seed", "0")]:  # fmt: skip
        assert ours[ours.index(flag) + 1] == value == peer[peer.index(flag) + 1]
    assert "--no-enable-prefix-caching" in ours and "--no-enable-prefix-caching" in peer
    assert ours[ours.index("--kv-cache-memory") + 1] == "2" and ours[-2:] == ["--block-size", "32"]
    assert peer[peer.index("--host") + 1] == "127.0.0.1" and peer[-1] == "--x"
    env = vllm_server.server_env(spec, 2, tmp_path)
    assert env["VLLM_CPU_KVCACHE_SPACE"] == "2" and env["VLLM_CPU_OMP_THREADS_BIND"] == "0-1"
    assert env["PYTHONPATH"] == str(tmp_path)


def _document(**overrides: Any) -> dict[str, Any]:
    values = dict(failed=0, errors=["", ""], output_throughput=12.5, p50_ttft_ms=100.0,
                  p99_ttft_ms=300.0, completed=2, duration=4.0)  # fmt: skip
    return {**values, **overrides}


def test_figures_come_from_the_result_and_failures_are_errors() -> None:
    result = vlm.engine_result("kvflow", _document())
    assert (result.output_tok_s, result.ttft_p50_ms, result.ttft_p99_ms) == (12.5, 100.0, 300.0)
    with pytest.raises(RuntimeError, match=r"1 requests failed.*boom"):
        vlm.engine_result("vllm", _document(failed=1, errors=["", "boom"]))


def test_table_and_json_give_the_ratios() -> None:
    ours = vlm.engine_result("kvflow", _document(output_throughput=26.0, p99_ttft_ms=150.0))
    peer = vlm.engine_result("vllm 0.32.0", _document(output_throughput=20.0))
    table = vlm.format_table([ours, peer]).splitlines()
    assert table[1].split() == ["kvflow", "26.00", "100.0", "150.0"]
    assert table[2].split() == ["vllm", "0.32.0", "20.00", "100.0", "300.0"]
    assert table[3].split() == ["kvflow", "/", "vllm", "1.30x", "1.00x", "0.50x"]
    report = vlm.report_json([ours, peer])
    assert report["output_tok_s_ratio"] == 1.3 and report["ttft_p99_ratio"] == 0.5
    assert len(vlm.format_table([ours]).splitlines()) == 2
    assert "output_tok_s_ratio" not in vlm.report_json([ours])


def test_config_sizes_shrink_with_vllm_friendly_heads() -> None:
    full = vlm_config.text_config(vlm_config.Sizes())
    assert (full["hidden_size"], full["num_hidden_layers"], full["num_attention_heads"]) == (
        1024, 24, 16,
    )  # fmt: skip
    assert full["num_key_value_heads"] == 4
    small = vlm_config.text_config(vlm_config.Sizes(text_hidden=128, text_layers=2))
    assert (small["num_attention_heads"], small["num_key_value_heads"]) == (2, 1)
    assert small["intermediate_size"] == 512 and small["num_hidden_layers"] == 2
    with pytest.raises(ValueError, match="multiple of 64"):
        vlm_config.text_config(vlm_config.Sizes(text_hidden=96))
    siglip = vlm_config.TOWERS["siglip"]
    tower = vlm_config.vision_config(siglip, vlm_config.Sizes())
    assert (tower["num_attention_heads"], tower["image_size"]) == (16, 384)
    assert vlm_config.image_tokens(siglip, 384) == 729
    assert vlm_config.image_tokens(vlm_config.TOWERS["clip"], 336) == 576
    tiny = vlm_config.vision_config(siglip, vlm_config.Sizes(vision_hidden=64, image_size=112))
    assert (tiny["num_attention_heads"], tiny["intermediate_size"]) == (1, 239)
    assert vlm_config.image_tokens(siglip, 112) == 64
    with pytest.raises(ValueError, match="patch"):
        vlm_config.vision_config(siglip, vlm_config.Sizes(image_size=10))


def test_shim_maps_pixtral_torchvision_module_to_its_pil_sibling(tmp_path: Path) -> None:
    spec = importlib.util.spec_from_file_location("shim_under_test", vllm_server.SHIM)
    assert spec is not None and spec.loader is not None
    shim = importlib.util.module_from_spec(spec)
    before = list(sys.meta_path)
    spec.loader.exec_module(shim)
    sys.meta_path[:] = before  # only the finder is under test, not its installation
    (tmp_path / shim.SIBLING).write_text("x = 1\n")
    finder = shim._PixtralPilFinder()
    found = finder.find_spec(shim.TARGET, [str(tmp_path)])
    assert found is not None and found.origin == str(tmp_path / shim.SIBLING)
    assert found.name == shim.TARGET
    assert finder.find_spec("transformers.other", [str(tmp_path)]) is None
    assert finder.find_spec(shim.TARGET, [str(tmp_path / "missing")]) is None
