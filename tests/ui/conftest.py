"""Fixtures for the web UI tests: a real `kvflow serve` (tiny random model, API key on)
and Debian's Chromium driven headless by Playwright.

Never `playwright install` (it downloads browsers): the tests launch /usr/bin/chromium
(Debian package `chromium`). Without it they skip, or fail under CI, where .ci/run
installs it and sets KVFLOW_REQUIRE_CHROMIUM=1 (as KVFLOW_REQUIRE_PROMTOOL does).
"""

from __future__ import annotations

import importlib.util
import os
import shutil
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

sys.path.insert(0, str(Path(__file__).parents[1] / "integration"))  # serve_harness

from serve_harness import Server, start_server, stop_server


def _integration_fixtures() -> Any:
    """tests/integration/conftest.py, loaded under its own name (its tiny model is ours)."""
    path = Path(__file__).parents[1] / "integration" / "conftest.py"
    spec = importlib.util.spec_from_file_location("kvflow_integration_conftest", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


tiny_model_dir = _integration_fixtures().tiny_model_dir

API_KEY = "ui-test-key"
CHROMIUM = os.environ.get("KVFLOW_CHROMIUM", "/usr/bin/chromium")


def _missing(what: str) -> None:
    if os.environ.get("KVFLOW_REQUIRE_CHROMIUM") == "1":  # set by .ci/run
        pytest.fail(f"{what} is required for the web UI tests but missing")
    pytest.skip(f"{what} is missing (.ci/run installs it)")


@pytest.fixture(scope="module")
def chromium() -> Iterator[Any]:
    """A headless Chromium (Playwright's Browser)."""
    if shutil.which(CHROMIUM) is None:
        _missing(f"Chromium ({CHROMIUM}, Debian package 'chromium')")
    try:
        from playwright.sync_api import sync_playwright
    except ImportError:
        _missing("the Python package playwright (pip install -e '.[dev]')")
    with sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=CHROMIUM, headless=True)
        yield browser
        browser.close()


@pytest.fixture(scope="module")
def ui_server(
    tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory, chromium: Any
) -> Iterator[Server]:
    """`kvflow serve --api-key` for the module (started after Chromium is found)."""
    srv = start_server(tiny_model_dir, tmp_path_factory.mktemp("serve"), "--api-key", API_KEY)
    yield srv
    code, survivors = stop_server(srv)
    assert survivors == [] and code == 0, srv.log_tail()


@pytest.fixture(scope="module")
def screenshots(tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tmp_path_factory.mktemp("screenshots")
    print(f"\nweb UI screenshots in {folder}")
    return folder
