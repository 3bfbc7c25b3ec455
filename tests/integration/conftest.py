"""Fixtures for the integration tests: a tiny random-weight Llama and a real
`kvflow serve` on loopback (see serve_harness.py).

The model (2 layers, hidden 64, the embedded SmolLM2 tokenizer and chat template) is
built once and kept in pytest's cache directory: reading the tokenizer out of the GGUF
takes ~20 s, building the weights a fraction of a second.
"""

from __future__ import annotations

import shutil
from collections.abc import Iterator
from pathlib import Path

import pytest
from serve_harness import Server, build_tiny_llama, start_server, stop_server

_MODEL_VERSION = 2  # bump when the tiny model's recipe changes


@pytest.fixture(scope="session")
def tiny_model_dir(pytestconfig: pytest.Config, tmp_path_factory: pytest.TempPathFactory) -> Path:
    import transformers

    key = f"kvflow-tiny-llama-v{_MODEL_VERSION}-tf{transformers.__version__}"
    cache = pytestconfig.cache
    root = cache.mkdir("kvflow") if cache is not None else tmp_path_factory.mktemp("model")
    target = root / key
    if not (target / "config.json").is_file():
        shutil.rmtree(target, ignore_errors=True)
        try:
            build_tiny_llama(target)
        except OSError:  # another session renamed its copy into place first
            if not (target / "config.json").is_file():
                raise
    return target


@pytest.fixture(scope="module")
def server(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    """One `kvflow serve` for the module; its teardown proves a clean SIGTERM shutdown."""
    srv = start_server(tiny_model_dir, tmp_path_factory.mktemp("serve"))
    print(f"\nkvflow serve ready in {srv.startup_s:.1f} s")
    yield srv
    code, survivors = stop_server(srv)
    assert survivors == [], f"orphans after SIGTERM: {survivors}\n{srv.log_tail()}"
    assert code == 0, srv.log_tail()
