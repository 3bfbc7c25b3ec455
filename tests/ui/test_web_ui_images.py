"""The playground with a model that reads images (a tiny LLaVA): images come in from the
file input, a paste and a drop, show in the composer and the conversation, and go to
the server as image_url parts with data: URLs; the per-message limit holds. (A
text-only model's page shows no image input: test_web_ui.py.)"""

from __future__ import annotations

import base64
import io
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from llava_fixture import make_llava_dir, random_image
from serve_harness import Server, start_server, stop_server

pytestmark = pytest.mark.slow

TIMEOUT_MS = 60_000
API_KEY = "ui-test-key"
# Hands the page a PNG (base64) as a File, by a paste on the message box or a drop on
# the composer: what the browser does with a real clipboard or drag.
GIVE_FILE = """([how, b64]) => {
  const bytes = Uint8Array.from(atob(b64), (c) => c.charCodeAt(0));
  const data = new DataTransfer();
  data.items.add(new File([bytes], "given.png", { type: "image/png" }));
  const event = how === "paste"
    ? new ClipboardEvent("paste", { clipboardData: data, bubbles: true, cancelable: true })
    : new DragEvent("drop", { dataTransfer: data, bubbles: true, cancelable: true });
  document.getElementById(how === "paste" ? "prompt" : "composer").dispatchEvent(event);
}"""


def png(seed: int) -> bytes:
    buffer = io.BytesIO()
    random_image(seed, 40, 30).save(buffer, format="PNG")  # type: ignore[attr-defined]
    return buffer.getvalue()


@pytest.fixture(scope="module")
def vision_server(
    embedded_model_dir: Path, tmp_path_factory: pytest.TempPathFactory, chromium: Any
) -> Iterator[Server]:
    llava = make_llava_dir(tmp_path_factory.mktemp("llava"), embedded_model_dir, 28)
    limits = ["--limit-mm-per-prompt", '{"image": 2}', "--block-size", "4"]
    srv = start_server(llava, tmp_path_factory.mktemp("serve"), "--api-key", API_KEY, *limits)
    yield srv
    code, survivors = stop_server(srv)
    assert survivors == [] and code == 0, srv.log_tail()


@pytest.fixture
def page(chromium: Any, vision_server: Server) -> Iterator[Any]:
    context = chromium.new_context(viewport={"width": 1280, "height": 860})
    context.add_init_script(f"sessionStorage.setItem('kvflow-api-key', '{API_KEY}')")
    page = context.new_page()
    page.set_default_timeout(TIMEOUT_MS)
    page.goto(vision_server.base_url + "/")
    page.locator("#model-name").filter(has_text="tiny").wait_for()
    yield page
    context.close()


def test_images_from_input_paste_and_drop_reach_the_model(
    page: Any, tmp_path: Path, screenshots: Path
) -> None:
    from playwright.sync_api import expect

    attach = page.get_by_text("Add image")
    expect(attach).to_be_visible()
    picked = tmp_path / "picked.png"
    picked.write_bytes(png(1))
    page.locator("#image-input").set_input_files(str(picked))
    page.evaluate(GIVE_FILE, ["paste", base64.b64encode(png(2)).decode()])
    pending = page.locator("#attachments img")
    expect(pending).to_have_count(2)
    page.evaluate(GIVE_FILE, ["drop", base64.b64encode(png(3)).decode()])  # one too many
    expect(page.locator("#status")).to_contain_text("At most 2 images")
    expect(pending).to_have_count(2)
    page.get_by_label("Remove image 2").click()
    page.evaluate(GIVE_FILE, ["drop", base64.b64encode(png(3)).decode()])
    expect(pending).to_have_count(2)
    page.get_by_label("Max tokens").fill("4")
    page.screenshot(path=str(screenshots / "images-composer.png"), full_page=True)
    with page.expect_request("**/v1/chat/completions") as request:
        page.get_by_label("Message").fill("How do they differ?")
        page.get_by_label("Message").press("Enter")
    content = json.loads(request.value.post_data)["messages"][-1]["content"]
    expected = [base64.b64encode(png(seed)).decode() for seed in (1, 3)]
    assert [p["image_url"]["url"].split(",", 1)[1] for p in content[:2]] == expected
    assert all(p["image_url"]["url"].startswith("data:image/png;base64,") for p in content[:2])
    assert content[2] == {"type": "text", "text": "How do they differ?"}
    answer = page.locator(".msg.assistant").last
    expect(answer).to_have_attribute("data-state", "done", timeout=TIMEOUT_MS)
    expect(page.locator(".msg.user").last.locator("img")).to_have_count(2)
    expect(page.locator("#attachments")).to_be_hidden()
    page.get_by_label("Mode").select_option("completions")  # raw prompts take no images
    expect(attach).to_be_hidden()
    page.screenshot(path=str(screenshots / "images-conversation.png"), full_page=True)
