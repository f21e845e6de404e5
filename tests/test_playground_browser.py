"""The playground page (`server/static`, served at `/`) in a real browser: Debian's Chromium
driven by Playwright against one real `specdec serve --api-key` process.

What it checks: the page loads without errors and asks for the key on a 401 (in a masked
text field, not a password field a password manager would keep); a streamed JSON-schema answer
shows its tokens coloured by source (forced and target among them, in the legend's colours) and
validates against the schema in the page; a tool call renders as a card; the server panel
follows `/metrics`; the whole flow works by keyboard alone; and, with the browser answering in
the server's place (`page.route`), a failed model list, a stream cut off before its final event
and a data block that is not JSON show as errors, a closing event's token sources join the
answer's tokens, and a pattern JS cannot read is reported unchecked, never valid.

Screenshots go to `$SPECDEC_ARTIFACTS` (else the test's temporary directory);
`SPECDEC_WRITE_SCREENSHOT=1` also writes the README's `docs/playground.png`.
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path

import pytest

CHROMIUM = os.environ.get("SPECDEC_CHROMIUM", "/usr/bin/chromium")
if not os.access(CHROMIUM, os.X_OK):
    pytest.skip(f"no Chromium at {CHROMIUM} (scripts/dev test installs Debian's chromium as "
                f"root; SPECDEC_CHROMIUM names another)", allow_module_level=True)
from playwright import sync_api  # noqa: E402  (a test extra: missing, the setup is broken)

pytestmark = pytest.mark.model

KEY = "test-key"
STORE = "specdec.playground.key"  # the page's sessionStorage entry (server/static/app.js)
ARGS = ["--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
        "--disable-background-networking", "--disable-component-update", "--disable-sync"]
ANSWER_S = 90_000  # ms: one short answer, on a loaded 2-core machine
ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def server_args():
    return ("--api-key", KEY)


@pytest.fixture(scope="module")
def browser():
    pw = sync_api.sync_playwright().start()
    b = pw.chromium.launch(executable_path=CHROMIUM, args=ARGS, headless=True)
    yield b
    b.close()
    pw.stop()


@pytest.fixture(scope="module")
def artifacts(tmp_path_factory) -> Path:
    d = os.environ.get("SPECDEC_ARTIFACTS")
    path = Path(d) if d else tmp_path_factory.mktemp("playground")
    path.mkdir(parents=True, exist_ok=True)
    return path


class Tab:
    """A page in a fresh browser context, with what its console and network did."""

    def __init__(self, browser, server, key: str | None, refresh_ms: int = 300) -> None:
        self.ctx = browser.new_context(viewport={"width": 1280, "height": 900})
        if key is not None:  # as if typed into this tab earlier: the page keeps it per tab
            self.ctx.add_init_script(f"sessionStorage.setItem({json.dumps(STORE)}, "
                                     f"{json.dumps(key)})")
        self.page = self.ctx.new_page()
        self.errors: list[str] = []
        self.origin = server.url
        self.foreign: list[str] = []
        self.page.on("console", lambda m: m.type == "error" and self.errors.append(m.text))
        self.page.on("pageerror", lambda e: self.errors.append(f"pageerror: {e}"))
        self.page.on("request", lambda r: r.url.startswith(self.origin) or r.url.startswith(
            "data:") or self.foreign.append(r.url))
        self.page.goto(f"{server.url}/?refresh={refresh_ms}")

    def close(self) -> None:
        self.ctx.close()

    def send_and_wait(self) -> None:
        before = self.page.locator("#transcript .turn.assistant.done").count()
        self.page.click("#send")
        self.page.wait_for_function(
            f"document.querySelectorAll('#transcript .turn.assistant.done').length > {before}"
            " || !document.getElementById('error').hidden", timeout=ANSWER_S)
        assert self.page.locator("#error").is_hidden(), self.page.inner_text("#error")

    def clean(self) -> None:
        assert not self.errors, self.errors
        assert not self.foreign, self.foreign


@pytest.fixture
def tab(browser, server):
    made: list[Tab] = []

    def open_tab(key: str | None = KEY, **kw) -> Tab:
        made.append(Tab(browser, server, key, **kw))
        return made[-1]
    yield open_tab
    for t in made:
        t.close()


def colour(page, selector: str) -> str:
    return page.eval_on_selector(selector, "e => getComputedStyle(e).backgroundColor")


def test_loads_clean_and_asks_for_the_key(tab, artifacts):
    t = tab(key=None)
    page = t.page
    # The key field: masked, but no password field (so no password manager offers to keep it).
    assert page.get_attribute("#api-key", "type") == "text"
    assert page.locator("input[type=password], input[autocomplete=username]").count() == 0
    assert page.eval_on_selector("#api-key",
                                 "e => getComputedStyle(e).webkitTextSecurity") == "disc"
    page.wait_for_selector("#auth-banner:not([hidden])")
    page.fill("#user", "hi")
    page.click("#send")
    page.wait_for_selector("#error.auth-error:not([hidden])")
    msg = page.inner_text("#error")
    assert "401" in msg and "API key" in msg, msg
    assert "API key" in page.inner_text("#auth-banner")
    assert page.input_value("#user") == "hi"  # the message is kept to send again
    assert page.locator("#transcript .turn").count() == 0
    # The only errors without the key are the browser's own log lines for the 401s.
    assert not [e for e in t.errors if not re.search(r"status of 401", e)], t.errors
    page.screenshot(path=str(artifacts / "playground-401.png"), full_page=True)

    # With the key: the models load, and a reload keeps the key (this tab only) with no errors.
    page.fill("#api-key", KEY)
    page.press("#api-key", "Enter")
    page.wait_for_selector("#auth-banner[hidden]", state="attached")
    page.wait_for_function("document.querySelector('#model option').value !== 'default'")
    t.errors.clear()
    page.reload()
    assert page.input_value("#api-key") == KEY
    assert page.evaluate(f"sessionStorage.getItem({json.dumps(STORE)})") == KEY
    page.wait_for_function("Number(document.getElementById('srv-updated').dataset.updates) >= 2")
    assert page.locator("#auth-banner").is_hidden()
    assert page.locator("#legend .tok").count() == 7
    t.clean()


def test_json_schema_answer_coloured_and_valid(tab, artifacts):
    t = tab()
    page = t.page
    page.select_option("#constraint", "json_schema")
    page.select_option("#example", label="person: name + age")
    page.fill("#user", "Invent a person.")
    page.fill("#max-tokens", "40")
    t.send_and_wait()
    page.screenshot(path=str(artifacts / "playground-json.png"), full_page=True)

    v = page.locator("#stat-validation")
    assert v.inner_text() == "valid" and "valid" in (v.get_attribute("class") or "").split()
    answer = json.loads("".join(page.locator("#transcript .turn.assistant > .answer").last
                                .all_inner_texts()))
    assert set(answer) == {"name", "age"}
    assert page.evaluate("document.documentElement.dataset.tokenSources") == "on", \
        "the server refused token_sources"
    forced = "#transcript .tok[data-source=forced]"
    target = "#transcript .tok[data-source=target]"
    assert page.locator(forced).count() >= 1 and page.locator(target).count() >= 1, \
        page.eval_on_selector_all("#transcript .tok", "s => s.map(e => e.dataset.source)")
    f, g = colour(page, forced), colour(page, target)
    assert f != g
    assert f == colour(page, "#legend .tok[data-source=forced]")
    assert g == colour(page, "#legend .tok[data-source=target]")
    assert "forced" in page.get_attribute(forced, "aria-label")
    # A forced token's details: the grammar allowed one token.
    page.hover(forced)
    tip = page.locator("#token-tip")
    tip.wait_for(state="visible")
    assert "forced" in tip.inner_text() and "allowed 1 token" in tip.inner_text()
    # The request panel: counters from the answer's `specdec` object.
    assert page.inner_text("#stat-finish") in ("stop", "length")
    assert page.inner_text("#stat-rounds") != "—"
    assert page.locator("#stat-sources tbody tr[data-source=forced]").count() == 1
    page.screenshot(path=str(artifacts / "playground-json-tip.png"), full_page=True)
    if os.environ.get("SPECDEC_WRITE_SCREENSHOT") == "1":
        (ROOT / "docs").mkdir(exist_ok=True)
        page.screenshot(path=str(ROOT / "docs" / "playground.png"), full_page=True)
    t.clean()


def test_tool_call_card(tab, artifacts):
    t = tab()
    page = t.page
    page.select_option("#api", "messages")  # Anthropic's shape: x-api-key, tool_choice "any"
    page.select_option("#constraint", "tools")
    page.select_option("#example", label="weather")
    page.select_option("#tool-choice", "required")
    page.fill("#user", "What is the weather in Paris?")
    page.fill("#max-tokens", "48")
    t.send_and_wait()
    card = page.locator("#transcript .tool-card").first
    assert card.locator(".tool-name").inner_text() == "get_weather"
    args = json.loads(card.locator(".tool-args").inner_text())
    assert isinstance(args.get("city"), str)
    assert card.locator(".tool-check.valid").count() == 1
    assert "Tool result for get_weather" in page.inner_text("#user-label")
    page.screenshot(path=str(artifacts / "playground-tool.png"), full_page=True)
    t.clean()


def test_server_panel_follows_metrics(tab, artifacts):
    t = tab(refresh_ms=250)
    page = t.page
    updated = page.locator("#srv-updated")
    page.wait_for_function("Number(document.getElementById('srv-updated').dataset.updates) >= 2")
    first = updated.inner_text()
    before = int(page.get_attribute("#srv-requests", "data-count"))
    page.fill("#user", "Say hello.")
    page.fill("#max-tokens", "8")
    t.send_and_wait()
    page.wait_for_function(
        f"Number(document.getElementById('srv-requests').dataset.count) > {before}"
        " && Number(document.getElementById('srv-throughput').dataset.peak) > 0")
    assert updated.inner_text() != first
    assert "tok/s" in page.inner_text("#srv-throughput")
    assert page.inner_text("#srv-models") != "—"
    assert "grammars" in page.inner_text("#srv-grammar")
    page.locator("#server-panel").screenshot(path=str(artifacts / "playground-server.png"))
    t.clean()


def tab_to(page, want: str, limit: int = 60) -> None:
    """Press Tab until the focused element matches the CSS selector `want`."""
    for _ in range(limit):
        page.keyboard.press("Tab")
        if page.evaluate(f"!!document.activeElement?.matches({json.dumps(want)})"):
            return
    raise AssertionError(f"Tab never reached {want}")


def focus_ring(page) -> str:
    return page.evaluate("getComputedStyle(document.activeElement).outlineStyle")


def test_keyboard_only(tab, artifacts):
    t = tab()
    page = t.page
    tab_to(page, "#api")
    assert focus_ring(page) != "none"
    page.keyboard.press("ArrowDown")  # Chat Completions -> Responses
    assert page.input_value("#api") == "responses"
    tab_to(page, "#user")
    assert focus_ring(page) != "none"
    page.keyboard.type("Say hi.")
    tab_to(page, "#max-tokens")
    page.keyboard.press("Control+A")
    page.keyboard.type("12")
    page.keyboard.press("Control+Enter")
    page.wait_for_selector("#transcript .turn.assistant.done", timeout=ANSWER_S)
    assert page.locator("#error").is_hidden(), page.inner_text("#error")
    tab_to(page, "#transcript .tok")
    assert focus_ring(page) != "none"
    tip = page.locator("#token-tip")
    tip.wait_for(state="visible")
    assert tip.get_attribute("data-source") == page.evaluate(
        "document.activeElement.dataset.source")
    assert page.evaluate("document.activeElement.getAttribute('aria-describedby')") == "token-tip"
    page.screenshot(path=str(artifacts / "playground-keyboard.png"), full_page=True)
    page.keyboard.press("Escape")
    tip.wait_for(state="hidden")
    # The next turn from the keyboard: Enter in the message field sends it.
    tab_to(page, "#user", limit=200)
    page.keyboard.type("Thanks!")
    page.keyboard.press("Enter")
    page.wait_for_function(
        "document.querySelectorAll('#transcript .turn.assistant.done').length === 2",
        timeout=ANSWER_S)
    assert page.locator("#transcript .turn.user").count() == 2
    t.clean()


def sse(*events) -> str:
    """An SSE body: each event a `data:` block (a string as it is, else as JSON)."""
    return "".join(f"data: {e if isinstance(e, str) else json.dumps(e)}\n\n" for e in events)


def tok(text: str, source: str = "target") -> dict:
    return {"id": 1, "text": text, "source": source, "allowed": None, "logprob": -0.5, "top": []}


def chunk(delta: dict | None = None, finish: str | None = None,
          sources: list | None = None) -> dict:
    choice = {"index": 0, "delta": delta or {}, "finish_reason": finish}
    if sources is not None:
        choice["token_sources"] = sources
    return {"id": "chatcmpl-1", "object": "chat.completion.chunk", "choices": [choice]}


def test_stream_faults_and_closing_tokens(tab, artifacts):
    """The browser answers in the server's place (`page.route`): what a broken or cut-off
    stream, a failed model list and the closing events' token sources look like."""
    t = tab()
    page = t.page
    page.route("**/v1/models", lambda r: r.fulfill(
        status=503, content_type="application/json",
        body=json.dumps({"error": {"message": "models are loading", "type": "unavailable"}})))
    page.reload()
    page.wait_for_function("document.getElementById('model-note').textContent.includes('503')")
    assert page.locator("#model-note").is_visible()
    assert "models are loading" in page.inner_text("#model-note")
    assert page.input_value("#model") == "default"

    bodies: list[str] = []
    for path in ("**/v1/chat/completions", "**/v1/messages"):
        page.route(path, lambda r: r.fulfill(status=200, content_type="text/event-stream",
                                             body=bodies.pop(0)))

    def send(body: str, text: str = "hi") -> None:
        bodies.append(body)
        before = page.locator("#transcript .turn.assistant.done").count()
        page.fill("#user", text)
        page.click("#send")
        page.wait_for_function(
            f"document.querySelectorAll('#transcript .turn.assistant.done').length > {before}"
            " && document.body.dataset.busy === 'false'", timeout=10_000)

    # A stream that ends with no final event (no finish_reason, no [DONE]): an error, not success.
    send(sse(chunk({"content": "Hel"}, sources=[tok("Hel")])))
    assert "ended before the answer finished" in page.inner_text("#error")
    assert page.locator("#transcript .turn.assistant.cut").count() == 1
    assert page.inner_text("#stat-finish") == "cut off"
    page.screenshot(path=str(artifacts / "playground-cut-off.png"), full_page=True)
    # A data block that is not JSON: reported, not skipped.
    send(sse(chunk({"content": "Hi"}), "{not json", chunk(finish="stop"), "[DONE]"))
    assert "not JSON" in page.inner_text("#error")
    assert page.locator("#transcript .turn.assistant.cut").count() == 2

    # The closing chunk's token sources join the tokens (apart from the text, not twice); a
    # pattern JS cannot read is reported as not checked, never as valid.
    page.select_option("#constraint", "json_schema")
    page.fill("#constraint-text", json.dumps({"type": "object", "properties": {
        "code": {"type": "string", "pattern": "[z-a]"}}}))
    text = '{"code": "x"}'
    send(sse(chunk({"content": text}, sources=[tok(text)]),
             chunk(finish="stop", sources=[tok("<|end|>", "forced")]), "[DONE]"))
    assert page.locator("#error").is_hidden(), page.inner_text("#error")
    last = page.locator("#transcript .turn.assistant").last
    assert last.locator(":scope > .answer").inner_text() == text
    closing = last.locator(".markup .tok[data-source=forced]")
    assert closing.count() == 1 and closing.get_attribute("tabindex") == "0"
    assert last.locator(".tok").count() == 2
    v = page.locator("#stat-validation")
    assert v.inner_text().startswith("pattern not checked in the page"), v.inner_text()
    assert "valid" not in (v.get_attribute("class") or "").split()
    page.screenshot(path=str(artifacts / "playground-unchecked.png"), full_page=True)

    # Messages: message_delta's token sources; an answer without message_stop is cut off.
    page.select_option("#constraint", "none")
    page.select_option("#api", "messages")
    head = [{"type": "message_start", "message": {"usage": {"input_tokens": 3}}},
            {"type": "content_block_start", "index": 0, "content_block": {"type": "text"}},
            {"type": "content_block_delta", "index": 0,
             "delta": {"type": "text_delta", "text": "Yes"}, "token_sources": [tok("Yes")]},
            {"type": "content_block_stop", "index": 0},
            {"type": "message_delta", "delta": {"stop_reason": "end_turn"},
             "usage": {"output_tokens": 2}, "token_sources": [tok("</s>", "forced")]}]
    send(sse(*head, {"type": "message_stop"}))
    assert page.locator("#error").is_hidden(), page.inner_text("#error")
    last = page.locator("#transcript .turn.assistant").last
    assert last.locator(":scope > .answer").inner_text() == "Yes"
    assert last.locator(".markup .tok[data-source=forced]").count() == 1
    assert page.inner_text("#stat-finish") == "end_turn"
    send(sse(*head))
    assert "ended before the answer finished" in page.inner_text("#error")
    assert page.inner_text("#stat-finish") == "end_turn (cut off)"
    assert not [e for e in t.errors if "status of 503" not in e], t.errors
    assert not t.foreign, t.foreign
