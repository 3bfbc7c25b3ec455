"""`kvflow bench kernels`: roofline arithmetic exactly, and one tiny end-to-end run."""

from __future__ import annotations

import argparse
import json

from kvflow.bench.kernel_args import add_kernel_bench_args
from kvflow.bench.kernels import (
    Case,
    Measurement,
    _measure,
    _peaks,
    _speedups,
    run_kernel_bench,
)
from kvflow.kernels.cpu.paged_decode import load_paged_decode

TINY = (
    "--num-tokens 16 --hidden-size 64 --intermediate-size 64 --num-heads 4 --num-kv-heads 2 "
    "--head-dim 32 --batch 2 --context 40 --prefill-reqs 2 --prefill-chunk 8 "
    "--prefill-prefix 8 --vocab-size 100 --warmup 0 --iters 1"
)


def _args(argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_kernel_bench_args(parser)
    return parser.parse_args(argv.split())


def test_measure_against_peaks():
    case = Case("k", bytes=2 * 10**9, flops=10**12, impls={})
    m = _measure(case, "triton", 1000.0, (4.0, 2.0))  # 1 s; peaks 4 GB/s, 2 TFLOP/s
    assert (m.gb_per_s, m.gflop_per_s) == (2.0, 1000.0)
    assert (m.pct_peak_bandwidth, m.pct_peak_flops) == (50.0, 50.0)
    assert _measure(case, "torch", 1000.0, (None, None)).pct_peak_bandwidth is None


def test_peak_flags_override_and_cpu_has_no_table_entry():
    import torch

    cpu = torch.device("cpu")
    assert _peaks(_args(""), cpu) == (None, None)
    assert _peaks(_args("--peak-bandwidth-gbs 100 --peak-tflops 5"), cpu) == (100.0, 5.0)


def test_speedups_are_baseline_over_triton():
    rows = [
        Measurement("decode_attention b1", impl, ms, 0, 0, None, None)
        for impl, ms in (("triton", 2.0), ("torch-gather+sdpa", 7.0), ("torch-sdpa", 3.0))
    ]
    assert _speedups(rows, "decode_attention") == {
        "triton vs torch-gather+sdpa": 3.5,
        "triton vs torch-sdpa": 1.5,
    }
    assert _speedups(rows[1:], "decode_attention") == {}
    native = Measurement("decode_attention b1", "cpu-native", 1.4, 0, 0, None, None)
    assert _speedups([native, *rows[1:]], "decode_attention") == {
        "cpu-native vs torch-gather+sdpa": 5.0,
        "cpu-native vs torch-sdpa": 2.14,
    }


def test_tiny_run_reports_every_kernel(capsys, device):
    report = run_kernel_bench(_args(TINY + " --json"))
    assert json.loads(capsys.readouterr().out) == report
    kernels = {m["kernel"].split()[0] for m in report["results"]}
    cpu_only = {"linear_bf16"} if device == "cpu" else set()  # the CPU's bf16 linear routes
    assert kernels == {
        "store_kv", "grammar_bitmask", "fused_add_rms_norm", "rotary_neox", "silu_and_mul",
        "decode_attention", "prefill_attention", *cpu_only,
    }  # fmt: skip
    impls = {m["impl"] for m in report["results"]}
    assert ("triton" in impls) == (device == "cuda")
    native_built = load_paged_decode() is not None
    assert ("cpu-native" in impls) == (device == "cpu" and native_built)
    if "cpu-native" in impls:
        assert "cpu-native vs torch-gather+sdpa" in report["decode_attention_speedup"]
    assert all(m["time_ms"] > 0 for m in report["results"])


def test_cpu_linear_cases_agree_and_count_the_bytes_read():
    import torch

    from kvflow.bench.kernel_cases import cpu_linear_cases
    from kvflow.kernels.cpu import block_linear

    args = _args(TINY + " --linear-rows 1,3")
    assert cpu_linear_cases(args, torch.device("cpu"), torch.bfloat16) == []  # float32 only
    cases = {c.name: c for c in cpu_linear_cases(args, torch.device("cpu"), torch.float32)}
    formats = list(block_linear.FORMATS) if block_linear.available() else []
    assert sorted(cases) == sorted(
        f"linear_{kind.lower()} {rows}x64->64" for rows in (1, 3) for kind in ["f32", *formats]
    )
    activations = 4 * 3 * (64 + 64)
    assert cases["linear_f32 3x64->64"].bytes == 4 * 64 * 64 + activations
    for name, case in cases.items():
        torch.testing.assert_close(
            case.impls["cpu-native"](), case.impls["torch"](), atol=1e-4, rtol=1e-4, msg=name
        )
        for impl in ("cpu-int8", "cpu-vnni"):  # two int8 activation digits: ~1e-4 relative
            if impl in case.impls:
                torch.testing.assert_close(
                    case.impls[impl](), case.impls["torch"](), atol=1e-2, rtol=1e-3, msg=name
                )
    if formats:  # Q4_1: 64 rows x 2 blocks x (16 code bytes + 4 + 4 float scale/offset)
        assert cases["linear_q4_1 3x64->64"].bytes == 64 * 2 * 24 + activations


def test_decode_case_on_a_quantized_cache_of_several_layers(device):
    """`--kv-cache-dtype int8 --kv-layers 3`: the native kernel reads the int8 rows (68
    bytes at head_dim 64 instead of 128) of each layer in turn and agrees with the
    dequantized SDPA baseline; float-only implementations are left out."""
    import torch

    from kvflow.bench.kernel_cases import attention_cases

    args = _args(
        TINY.replace("--head-dim 32", "--head-dim 64") + " --kv-cache-dtype int8 --kv-layers 3"
    )
    case = attention_cases(args, torch.device(device), torch.float32)[0]
    assert case.name == "decode_attention b2 ctx40 kv=int8"
    assert case.bytes == 2 * 2 * 40 * 2 * 68 + 2 * 2 * 4 * 64 * 4
    assert "triton" not in case.impls and "torch-ref" not in case.impls
    if device != "cpu" or load_paged_decode() is None:
        return
    expected = case.impls["torch-gather+sdpa"]().squeeze(2)  # [b, h, d]
    for _ in range(3):  # one call per layer: the first layer's comes back on the fourth
        case.impls["cpu-native"]()
    actual = case.impls["cpu-native"]()
    torch.testing.assert_close(actual, expected, atol=2e-4, rtol=1e-3)


def test_cpu_bf16_linear_cases_agree():
    import torch

    from kvflow.bench.kernel_cases import cpu_bf16_linear_cases
    from kvflow.kernels.cpu import bf16_gemm

    args = _args(TINY + " --linear-rows 1,9")
    assert cpu_bf16_linear_cases(args, torch.device("cpu"), torch.float32) == []  # bf16 only
    cases = {c.name: c for c in cpu_bf16_linear_cases(args, torch.device("cpu"), torch.bfloat16)}
    assert sorted(cases) == ["linear_bf16 1x64->64", "linear_bf16 9x64->64"]
    assert cases["linear_bf16 9x64->64"].bytes == 2 * (64 * 64 + 9 * 128)
    for name, case in cases.items():
        assert ("cpu-native" in case.impls) == bf16_gemm.available()
        expected = case.impls["torch"]().float()
        for impl, fn in case.impls.items():
            torch.testing.assert_close(
                fn().float(), expected, atol=0.05, rtol=0.02, msg=name + impl
            )
