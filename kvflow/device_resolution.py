"""The "auto" options that depend on this machine, resolved before the config freezes.

`EngineConfig.create()` (config.py) calls these: which device runs the engine, its
attention backend and dtype, and whether the asked quantization runs there.
"""

from __future__ import annotations

import os

from kvflow.errors import ConfigError


def check_quantization(quantization: str, device: str, dtype: str) -> None:
    if quantization not in ("none", "q8_0", "gguf"):
        raise ConfigError(f"quantization must be none, q8_0 or gguf, got {quantization!r}")
    if quantization != "none" and device != "cpu":
        raise ConfigError(f"quantization {quantization} runs on the CPU only (device {device})")
    if quantization == "gguf" and dtype not in ("auto", "float32"):
        raise ConfigError(
            "quantization gguf reads the blocks of a float32 GGUF model: dtype float32"
        )


def resolve_device(device: str) -> str:
    if device == "auto":
        if not _nvidia_device_present():
            return "cpu"  # without importing torch: ~2 s of the launcher's start-up
        import torch

        return "cuda" if torch.cuda.is_available() else "cpu"
    if device not in ("cpu", "cuda"):
        raise ConfigError(f"device must be auto, cpu or cuda, got {device!r}")
    return device


def _nvidia_device_present() -> bool:
    """Cheap pre-check: no NVIDIA device node, or CUDA hidden by the environment, means
    no CUDA; otherwise torch decides."""
    if os.environ.get("CUDA_VISIBLE_DEVICES", None) in ("", "-1"):
        return False
    return os.path.exists("/dev/nvidiactl") or os.path.exists("/proc/driver/nvidia/version")


def resolve_attention_backend(backend: str, device: str) -> str:
    if backend == "auto":
        return "triton" if device == "cuda" else "cpu"
    if backend not in ("torch", "cpu", "triton"):
        raise ConfigError(f"attention_backend must be cpu, torch or triton, got {backend!r}")
    if backend == "cpu" and device != "cpu":
        # Its kernels are native CPU code reading host memory.
        raise ConfigError("attention_backend cpu runs on device cpu only")
    return backend


def resolve_dtype(dtype: str, device: str) -> str:
    """auto = bfloat16 on CUDA; on CPU whichever dtype this machine's matmuls run faster
    (kvflow/metrics/dtype_choice.py: measured once per CPU model, then cached)."""
    if dtype != "auto":
        if dtype not in ("float32", "bfloat16", "float16"):
            raise ConfigError(f"unsupported dtype {dtype!r}")
        return dtype
    if device == "cuda":
        return "bfloat16"
    from kvflow.metrics.dtype_choice import choose_cpu_dtype

    return choose_cpu_dtype().dtype
