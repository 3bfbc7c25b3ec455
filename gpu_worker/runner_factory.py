"""One way to build a model runner: config -> model -> KV sizing -> allocation -> graphs.

The worker process (every launch path: `kvflow serve`, data parallel, headless, Ray,
the offline engine's worker group) and the offline engine's in-process runner both
call `build_runner`, so a rank and a single-process engine size their KV cache and
capture their graphs by the same rules.
"""

from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from kvflow.config import EngineConfig
from kvflow.errors import ConfigError
from kvflow.kv_transfer_config import engine_kv_namespace
from kvflow.metrics.device_peaks import DevicePeaks, resolve_peaks
from kvflow.metrics.startup_phases import StartupPhases
from kvflow.model_limits import read_model_limits

if TYPE_CHECKING:
    from torch import nn

    from kvflow.gpu_worker.model_runner import ModelRunner, RunnerConfig

logger = logging.getLogger(__name__)


@dataclass
class BuiltRunner:
    runner: ModelRunner
    max_model_len: int  # the context length served
    peaks: DevicePeaks | None  # the roofline's roofs, when asked for


def build_runner(
    config: EngineConfig,
    model_dir: Path,
    world_size: int = 1,
    phases: StartupPhases | None = None,
    *,
    measure_peaks: bool = False,
) -> BuiltRunner:
    """The model runner with its KV cache allocated and its decode graphs captured.
    With `world_size` > 1 it runs inside the rank's groups: the model built is this
    rank's shard, and every rank allocates the KV blocks that the most constrained rank
    can hold. `measure_peaks` resolves the device's peaks (calibrating, if need be)
    before the KV cache takes the memory."""
    phases = phases or StartupPhases()
    with phases.measure("worker_torch_import"):
        from kvflow.gpu_worker.distributed import min_over_ranks
        from kvflow.gpu_worker.model_runner import ModelRunner
        from kvflow.gpu_worker.parallel_state import get_tp_group
        from kvflow.tokenizer import read_eos_token_ids

    with phases.measure("tokenizer_load"):
        eos_token_ids = read_eos_token_ids(model_dir)
    if config.device.device == "cpu":
        with phases.measure("native_kernels"):
            from kvflow.kernels.cpu.native_build import load_all

            load_all()
    max_model_len = read_model_limits(model_dir, config.model.max_model_len).max_model_len
    with phases.measure("model_load"):
        runner = ModelRunner(
            _runner_config(config, model_dir, world_size, eos_token_ids, max_model_len)
        )
    peaks = None
    if measure_peaks:
        with phases.measure("roofline_calibration"):
            peaks = device_peaks(config)
    with phases.measure("kv_cache_profile"):
        num_blocks = min_over_ranks(
            runner.determine_num_blocks(), get_tp_group(), config.device.device
        )
    with phases.measure("kv_cache_allocate"):
        runner.initialize_kv_cache(num_blocks)
    took = runner.capture_decode_graphs(config.scheduler.max_num_seqs, max_model_len)
    if took > 0:  # a phase that did not run (CPU, --enforce-eager) is absent
        phases.add("cuda_graph_capture", took)
    from kvflow.gpu_worker.host_memory import return_freed_heap

    return_freed_heap()  # what loading and profiling freed (gpu_worker/host_memory.py)
    if peaks is not None and config.device.measure_weight_read:
        if runner.device.type != "cpu":  # device=auto that resolved to a GPU
            raise ConfigError("measure_weight_read times a CPU read pass: not on a GPU")
        with phases.measure("weight_read_pass"):
            peaks = weight_read_peaks(peaks, runner.model)
    return BuiltRunner(runner, max_model_len, peaks)


def weight_read_peaks(peaks: DevicePeaks, model: nn.Module) -> DevicePeaks:
    """`peaks` with the bandwidth roof of a read pass over the model's own weights, in
    this process, on the pages the decode steps will stream: a 2-vCPU guest reads its
    DRAM at a speed set per process (kvflow/metrics/weight_read.py), so a calibration
    taken elsewhere is no roof for this worker's steps."""
    from kvflow.metrics.weight_read import read_pass_bytes_per_s, weight_tensors

    nbytes, rate = read_pass_bytes_per_s(weight_tensors(model))
    if not rate:
        return peaks
    logger.info("weights' read pass: %.2f GB at %.1f GB/s", nbytes / 1e9, rate / 1e9)
    return DevicePeaks(peaks.flops, rate, f"{peaks.source} + weights' read pass")


def _runner_config(
    config: EngineConfig,
    model_dir: Path,
    world_size: int,
    eos_token_ids: frozenset[int],
    max_model_len: int,
) -> RunnerConfig:
    from kvflow.gpu_worker.distributed import threads_per_rank
    from kvflow.gpu_worker.model_runner import RunnerConfig

    return RunnerConfig(
        model_dir=model_dir,
        model=config.model,
        cache=config.cache,
        device=dataclasses.replace(
            config.device,
            num_threads=threads_per_rank(world_size, config.device.num_threads),
            # Collectives inside captured graphs are not verified yet: eager.
            enforce_eager=config.device.enforce_eager or world_size > 1,
        ),
        eos_token_ids=eos_token_ids,
        max_num_seqs=config.scheduler.max_num_seqs,
        max_model_len=max_model_len,
        kv_transfer=config.kv_transfer.kv_transfer_config,
        kv_namespace=engine_kv_namespace(config),
        kv_load_timeout=config.kv_transfer.kv_load_timeout,
        speculative=config.speculative.speculative_config,
        lora=config.lora if config.lora.enable_lora else None,
    )


def device_peaks(config: EngineConfig) -> DevicePeaks:
    """The roofline's roofs (flags, else the GPU table or a cached calibration)."""
    device = config.device
    return resolve_peaks(
        device.device, config.model.dtype, device.peak_flops, device.peak_bandwidth
    )
