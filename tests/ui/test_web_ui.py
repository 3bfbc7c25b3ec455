"""The built-in web UI in a real browser against a real `kvflow serve` (tiny random model).

What a user does: chat and watch the answer stream in, stop it, reproduce a seeded
sample, watch the engine view, enter the API key. Screenshots go to pytest's tmp dir.
"""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from serve_harness import Server, metric_values, wait_for

pytestmark = pytest.mark.slow

TIMEOUT_MS = 60_000
API_KEY = "ui-test-key"  # conftest.py starts the server with it
# Records the length of the newest answer's text at every DOM change.
WATCH_GROWTH = """() => {
  window.__lengths = [];
  const transcript = document.getElementById("transcript");
  new MutationObserver(() => {
    const answers = transcript.querySelectorAll(".msg.assistant .content");
    if (answers.length) window.__lengths.push(answers[answers.length - 1].textContent.length);
  }).observe(transcript, { subtree: true, childList: true, characterData: true });
}"""


@pytest.fixture
def page(chromium: Any, ui_server: Server) -> Iterator[Any]:
    """The playground, with the API key already in the tab's sessionStorage."""
    context = chromium.new_context(viewport={"width": 1280, "height": 860})
    context.add_init_script(f"sessionStorage.setItem('kvflow-api-key', '{API_KEY}')")
    page = context.new_page()
    page.set_default_timeout(TIMEOUT_MS)
    page.goto(ui_server.base_url + "/")
    page.locator("#model-name").filter(has_text="tiny").wait_for()
    yield page
    context.close()


def send(page: Any, text: str) -> Any:
    """Type a message, press Enter; returns the locator of the answer."""
    page.get_by_label("Message").fill(text)
    page.get_by_label("Message").press("Enter")
    return page.locator(".msg.assistant").last


def finished(answer: Any, state: str = "done") -> str:
    from playwright.sync_api import expect

    expect(answer).to_have_attribute("data-state", state, timeout=TIMEOUT_MS)
    return str(answer.locator(".choices").inner_text())


def test_chat_streams_token_by_token(page: Any, screenshots: Path) -> None:
    page.get_by_label("System prompt").fill("You are terse.")
    page.get_by_label("Max tokens").fill("120")
    page.evaluate(WATCH_GROWTH)
    answer = send(page, "Write **a** story about `code`.")
    text = finished(answer)
    assert page.locator("#attach").is_hidden()  # a text-only model takes no images
    lengths = page.evaluate("window.__lengths")
    growth = sorted(set(lengths))
    assert text.strip() and len(growth) >= 10, f"the text did not grow token by token: {lengths}"
    assert lengths == sorted(lengths), "the answer's text shrank while streaming"
    meta = answer.locator(".meta").last.inner_text()
    assert "TTFT" in meta and "tokens/s" in meta and "prompt tokens cached" in meta, meta
    user = page.locator(".msg.user").last
    assert "<" not in user.inner_html().replace("<div", "").replace("</div>", "")  # text, not HTML
    page.screenshot(path=str(screenshots / "playground.png"), full_page=True)


def _busy_engine(server: Server, count: int = 12) -> list[threading.Thread]:
    """Requests running beside the page's, so that its stream is slow enough to stop
    mid-way on any machine (alone, the tiny model writes 400 tokens in about a second)."""

    def one() -> None:
        body = {"model": "tiny", "prompt": "busy", "max_tokens": 400, "ignore_eos": True}
        headers = {"Authorization": f"Bearer {API_KEY}"}
        httpx.post(server.base_url + "/v1/completions", json=body, headers=headers, timeout=300)

    threads = [threading.Thread(target=one, daemon=True) for _ in range(count)]
    for thread in threads:
        thread.start()
    return threads


def test_stop_aborts_the_request_and_frees_its_blocks(page: Any, ui_server: Server) -> None:
    page.get_by_label("Max tokens").fill("400")

    def no_early_stop(route: Any) -> None:  # the tiny model's EOS must not end it first
        body = json.loads(route.request.post_data or "{}")
        route.continue_(post_data=json.dumps({**body, "ignore_eos": True}))

    page.route("**/v1/chat/completions", no_early_stop)
    busy = _busy_engine(ui_server)
    answer = send(page, "Tell me everything.")
    wait_for(lambda: len(answer.locator(".choices").inner_text()) > 20, 60, 0.05)
    page.get_by_role("button", name="Stop").click()
    page.unroute("**/v1/chat/completions")
    finished(answer, "stopped")
    for thread in busy:
        thread.join(timeout=300)
    stopped_at = answer.locator(".choices").inner_text()
    assert "stopped" in answer.locator(".meta").last.inner_text()

    def idle() -> bool:
        values = metric_values(ui_server.base_url)
        return (
            values["kvflow:kv_cache_usage_perc"] == 0 and values["kvflow:num_requests_running"] == 0
        )

    assert wait_for(idle, 15), metric_values(ui_server.base_url)
    assert answer.locator(".choices").inner_text() == stopped_at  # nothing more arrived
    assert page.get_by_role("button", name="Send").is_enabled()


def test_seeded_sampling_reproduces_and_logprobs_show_a_heat_map(page: Any) -> None:
    page.get_by_label("Temperature").fill("1.0")
    page.get_by_label("Seed").fill("1234")
    page.get_by_label("Max tokens").fill("24")
    finished(send(page, "Pick a random word."))
    # Compared: two regenerations. The very first answer of this test has been seen to
    # differ from later identical requests in its last tokens (an engine question, not
    # the UI's: the request bodies are byte-identical; see the web-ui branch report).
    regenerate = page.get_by_role("button", name="Regenerate")
    regenerate.click()
    first = finished(page.locator(".msg.assistant").last)
    regenerate.click()
    again = finished(page.locator(".msg.assistant").last)
    assert again == first and first.strip()
    page.get_by_label("Seed").fill("99")
    regenerate.click()
    other = finished(page.locator(".msg.assistant").last)
    assert other != first
    page.get_by_label("Token logprobs heat map").check()
    regenerate.click()
    heat = page.locator(".msg.assistant").last
    assert finished(heat).strip() == other.strip()  # same seed, same sample
    assert heat.locator(".tok").count() >= 5
    assert "p=" in (heat.locator(".tok").first.get_attribute("title") or "")
    assert page.locator(".msg.assistant").count() == 1  # regenerate replaces the answer


def test_completion_mode_sends_the_raw_prompt(page: Any) -> None:
    page.get_by_label("Mode").select_option("completions")
    page.get_by_label("Max tokens").fill("16")
    answer = send(page, "Once upon a time")
    assert finished(answer).strip()
    assert answer.locator(".role").inner_text().lower() == "completion"


def _stream_in_background(server: Server) -> tuple[threading.Thread, threading.Event]:
    """A long chat completion; setting the event closes it (the server aborts it)."""
    stop = threading.Event()

    def run() -> None:
        body = {"messages": [{"role": "user", "content": "Go on."}], "max_tokens": 400}
        headers = {"Authorization": f"Bearer {API_KEY}"}
        with httpx.stream(
            "POST",
            server.base_url + "/v1/chat/completions",
            json={**body, "stream": True},
            headers=headers,
            timeout=60,
        ) as response:
            for _ in response.iter_lines():
                if stop.is_set():
                    return

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread, stop


def test_engine_view_shows_running_requests(
    page: Any, ui_server: Server, screenshots: Path
) -> None:
    from playwright.sync_api import expect

    page.get_by_role("tab", name="Playground").focus()
    page.keyboard.press("ArrowRight")  # the tabs answer the keyboard
    engine = page.get_by_role("region", name="Engine 0")
    running = engine.locator(".running")
    expect(running).to_have_text("0", timeout=TIMEOUT_MS)
    thread, stop = _stream_in_background(ui_server)
    try:
        expect(running).to_have_text("1", timeout=TIMEOUT_MS)
        expect(engine.locator(".timeline rect").first).to_be_attached()
        assert engine.locator(".block").count() >= 1
        page.wait_for_timeout(1500)  # a few steps on the timeline
        page.screenshot(path=str(screenshots / "engine.png"), full_page=True)
    finally:
        stop.set()
        thread.join(60)
    expect(running).to_have_text("0", timeout=TIMEOUT_MS)
    assert "free" in (engine.locator(".block-map").get_attribute("aria-label") or "")


def test_without_the_key_the_page_asks_for_it(chromium: Any, ui_server: Server) -> None:
    from playwright.sync_api import expect

    context = chromium.new_context()
    page = context.new_page()
    page.set_default_timeout(TIMEOUT_MS)
    try:
        page.goto(ui_server.base_url + "/ui")
        dialog = page.get_by_role("dialog", name="API key required")
        expect(dialog).to_be_visible()
        key = page.get_by_label("API key", exact=True)
        expect(key).to_be_focused()
        key.fill("wrong")
        key.press("Enter")
        expect(page.get_by_role("alert")).to_contain_text("valid")
        expect(dialog).to_be_visible()
        key.fill(API_KEY)
        key.press("Enter")
        expect(dialog).to_be_hidden()
        expect(page.locator("#model-name")).to_have_text("model: tiny")
        assert page.evaluate("sessionStorage.getItem('kvflow-api-key')") == API_KEY
    finally:
        context.close()


def test_phone_viewport_has_no_horizontal_scroll(chromium: Any, ui_server: Server) -> None:
    context = chromium.new_context(viewport={"width": 390, "height": 844}, is_mobile=True)
    context.add_init_script(f"sessionStorage.setItem('kvflow-api-key', '{API_KEY}')")
    page = context.new_page()
    try:
        for view in ("#playground", "#engine"):
            page.goto(ui_server.base_url + "/" + view)
            page.locator("#model-name").filter(has_text="tiny").wait_for()
            width = page.evaluate("[document.documentElement.scrollWidth, window.innerWidth]")
            assert width[0] <= width[1], f"{view}: content {width[0]} px wide in {width[1]} px"
    finally:
        context.close()
