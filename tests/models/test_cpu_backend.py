"""The `cpu` attention backend (native paged decode kernel) end to end, and its fallbacks."""

from __future__ import annotations

import logging
import sysconfig
from pathlib import Path
from typing import Any

import pytest

from kvflow import LLM, SamplingParams
from kvflow.kernels.cpu import native_build
from kvflow.kernels.cpu.paged_decode import load_paged_decode


def _backend(llm: LLM) -> Any:
    return llm.engine.runner.model.attention_layers()[0].backend


@pytest.mark.native(load_paged_decode() is not None)
@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_cpu_backend_matches_torch_backend(tiny_model_dir: Any, arch: str) -> None:
    path = str(tiny_model_dir(arch))
    # Ragged prompts decoding side by side; small blocks and budget give chunked prefill
    # on a cached prefix in mixed steps, and contexts spanning many blocks.
    prompts = [[1, 2, 3, 4, 5, 6, 7], [9, 8, 7], list(range(100, 161)), [5] * 18]
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    options = dict(device="cpu", dtype="float32", block_size=4, max_num_batched_tokens=16)
    torch_out = LLM(path, attention_backend="torch", **options).generate(prompts, params)
    cpu_llm = LLM(path, attention_backend="cpu", **options)
    cpu_out = cpu_llm.generate(prompts, params)
    assert [o.token_ids for o in cpu_out] == [o.token_ids for o in torch_out]
    assert _backend(cpu_llm)._decode_kernel is not None


def test_auto_picks_the_cpu_backend_on_cpu(tiny_model_dir: Any) -> None:
    llm = LLM(str(tiny_model_dir("llama")), device="cpu", dtype="float32")
    assert llm.engine.config.device.attention_backend == "cpu"


@pytest.fixture
def fresh_library_cache() -> Any:
    native_build.load_library.cache_clear()
    native_build.load_module.cache_clear()
    yield
    native_build.load_library.cache_clear()
    native_build.load_module.cache_clear()


def test_no_compiler_falls_back_to_torch(
    fresh_library_cache: Any, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setenv("CXX", "no-such-compiler")
    monkeypatch.setenv("PATH", "/nonexistent")
    with caplog.at_level(logging.WARNING):
        assert load_paged_decode() is None
    assert "no C++ compiler" in caplog.text


def test_switched_off_by_environment(fresh_library_cache: Any, monkeypatch: Any) -> None:
    monkeypatch.setenv("KVFLOW_CPU_KERNELS", "0")
    assert load_paged_decode() is None


@pytest.mark.native(native_build._compiler() is not None)
def test_compile_error_is_reported_not_raised(
    fresh_library_cache: Any, monkeypatch: Any, tmp_path: Any, caplog: Any
) -> None:
    (tmp_path / "paged_decode_attention.cpp").write_text("this is not C++\n")
    monkeypatch.setattr(native_build, "SOURCE_DIR", tmp_path)
    monkeypatch.setenv("KVFLOW_CACHE_DIR", str(tmp_path / "cache"))
    with caplog.at_level(logging.WARNING):
        assert load_paged_decode() is None
    assert "unavailable" in caplog.text and "failed" in caplog.text


def test_build_all_names_what_is_unavailable(fresh_library_cache: Any, monkeypatch: Any) -> None:
    monkeypatch.setenv("KVFLOW_CPU_KERNELS", "0")
    with pytest.raises(RuntimeError, match=", ".join(native_build.NATIVE_KERNELS)):
        native_build.build_all()


@pytest.mark.native(native_build._compiler() is not None)
def test_build_all_builds_into_the_cache(
    fresh_library_cache: Any, monkeypatch: Any, tmp_path: Any
) -> None:
    monkeypatch.setenv("KVFLOW_CACHE_DIR", str(tmp_path))
    native_build.build_all()
    built = sorted(p.name for p in (tmp_path / "kernels").glob("*/*.so"))
    expected = [f"{name}.so" for name in native_build.NATIVE_KERNELS]
    if _has_python_headers():  # the fast-call modules too
        expected += [f"kvflow_{name}.so" for name in native_build.MODULE_KERNELS]
    assert built == sorted(expected)


def _has_python_headers() -> bool:
    include = sysconfig.get_paths().get("include")
    return bool(include) and (Path(include) / "Python.h").exists()


@pytest.mark.native(native_build._compiler() is not None)
def test_fast_call_module_needs_python_headers(
    fresh_library_cache: Any, monkeypatch: Any, tmp_path: Any, caplog: Any
) -> None:
    """Without Python.h the module is not built, and the kernels go through ctypes."""
    monkeypatch.setenv("KVFLOW_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(sysconfig, "get_paths", lambda: {"include": str(tmp_path)})
    with caplog.at_level(logging.INFO):
        assert native_build.load_module("elementwise") is None
    assert "no Python headers" in caplog.text
    assert native_build.load_library("elementwise") is not None


def test_fast_call_module_switched_off_by_environment(
    fresh_library_cache: Any, monkeypatch: Any
) -> None:
    monkeypatch.setenv("KVFLOW_CPU_KERNELS", "0")
    assert native_build.load_module("elementwise") is None
