"""The chat page at `/` (issue #70): content negotiation, its files and headers, the API key,
the opt-in per-token sources of streamed chat chunks, and the page itself driven in headless
Chromium (Playwright pointed at the distribution's browser) against the bundled model."""

from __future__ import annotations

import http.client
import json
import os
import shutil
import time

import pytest
from server_helpers import post, sse_events, start, stop

import mlxspec
from mlxspec.server.relay import SourceSpans

COUNT = "Count from 1 to 200."  # the bundled model's long answer (its context's worth)
MARKDOWN = "A **bold** `<b>` move:\n\n- one\n- two\n\n```python\nprint('<b>hi</b>')\n```\n"
CODE = "Write a python class for a linked list with many methods, with docstrings."


def get(url: str, path: str, headers=None):
    """(status, headers, body) of one GET."""
    host, port = url.removeprefix("http://").split(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=30)
    conn.request("GET", path, headers=headers or {})
    resp = conn.getresponse()
    body = resp.read()
    conn.close()
    return resp.status, {k.lower(): v for k, v in resp.getheaders()}, body


def chat(srv, content: str, mode: str, max_tokens: int = 200, **extra) -> list:
    """The events of a streamed greedy chat answer."""
    status, payload, _ = post(srv.url, "/v1/chat/completions", {
        "messages": [{"role": "user", "content": content}], "stream": True,
        "stream_options": {"include_usage": True}, "temperature": 0,
        "max_tokens": max_tokens, "speculative": {"mode": mode, **extra}})
    assert status == 200, payload
    return sse_events(payload)


def wait_until(check, seconds: float = 10.0) -> bool:
    end = time.monotonic() + seconds
    while not check():
        if time.monotonic() > end:
            return False
        time.sleep(0.05)
    return True


def merged(spans) -> list[list[str]]:
    """Spans with consecutive ones of one source joined (chunks split a source's run)."""
    out: list[list[str]] = []
    for text, source in spans:
        if out and out[-1][1] == source:
            out[-1][0] += text
        else:
            out.append([text, source])
    return out


@pytest.fixture(scope="module")
def server():
    srv = start(mlxspec.load(mode="auto"))
    yield srv
    stop(srv)


@pytest.fixture(scope="module")
def keyed():
    srv = start(mlxspec.load(mode="auto"), api_key="page-secret")
    yield srv
    stop(srv)


# ----------------------------------------------------------------- sources, unit by unit


def spans_of(pieces: dict[int, bytes], feeds) -> list:
    """Feed (ids, sources, content) triples to a `SourceSpans` over `pieces`; the spans of
    each content."""
    state = SourceSpans(pieces.__getitem__)
    out = []
    for ids, sources, content in feeds:
        state.feed(ids, sources)
        out.append(state.take(content))
    return out


def test_sources_keep_a_character_split_across_tokens_whole():
    e_acute = "é".encode()
    pieces = {1: b"caf", 2: e_acute[:1], 3: e_acute[1:] + b"!"}
    # the detokenizer holds the half character back: the first content lacks it
    got = spans_of(pieces, [([1, 2], ["ngram", "ngram"], "caf"),
                            ([3], ["target"], "é!")])
    assert got == [[["caf", "ngram"]], [["é!", "target"]]]


def test_sources_skip_text_the_content_lacks():
    pieces = {1: b" Hello", 2: b" world", 3: b"STOP", 4: b" more"}
    got = spans_of(pieces, [([1], ["draft"], "Hello"),  # the leading space trimmed
                            ([2, 3], ["target", "draft"], " world"),  # a stop string cut
                            ([4], None, "")])
    assert got == [[["Hello", "draft"]], [[" world", "target"]], []]


def test_sources_spans_always_spell_the_content():
    got = spans_of({1: b"ab"}, [([1], ["suffix"], "abXYZ")])  # text no token spelled
    assert "".join(t for t, _ in got[0]) == "abXYZ"
    assert got[0] == [["abXYZ", "suffix"]]


# ------------------------------------------------------------------------- the server


def test_get_root_negotiates_page_or_json_index(server):
    status, headers, body = get(server.url, "/", {"Accept": "application/json"})
    assert status == 200 and json.loads(body)["name"] == "mlxspec"
    status, _, body = get(server.url, "/", {"Accept": "*/*"})  # curl
    assert status == 200 and "endpoints" in json.loads(body)
    status, headers, body = get(server.url, "/", {
        "Accept": "text/html,application/xhtml+xml,application/xml;q=0.9,*/*;q=0.8"})
    assert status == 200 and headers["content-type"].startswith("text/html")
    assert b'<script type="module" src="/static/chat.js">' in body
    csp = headers["content-security-policy"]
    assert "default-src 'self'" in csp and "'unsafe-inline'" not in csp
    assert b"<script>" not in body and b"style=" not in body  # nothing inline


def test_static_files_and_nothing_else(server):
    for name, kind in (("chat.js", "text/javascript"), ("chat.css", "text/css"),
                       ("markdown.js", "text/javascript"), ("status.js", "text/javascript")):
        status, headers, _ = get(server.url, f"/static/{name}")
        assert status == 200 and headers["content-type"].startswith(kind)
        assert "content-security-policy" in headers
    for path in ("/static/page.py", "/static/..%2fpage.py", "/static/nope.js"):
        assert get(server.url, path)[0] == 404
    # the Host check covers the page too (DNS rebinding)
    assert get(server.url, "/", {"Accept": "text/html", "Host": "evil.example"})[0] == 403


def test_api_key_guards_data_not_the_page(keyed):
    assert get(keyed.url, "/", {"Accept": "text/html"})[0] == 200
    assert get(keyed.url, "/static/chat.js")[0] == 200
    assert get(keyed.url, "/", {"Accept": "application/json"})[0] == 401  # the index: as before
    assert get(keyed.url, "/v1/models")[0] == 401
    assert get(keyed.url, "/v1/models", {"Authorization": "Bearer page-secret"})[0] == 200


def test_sources_only_when_asked(server):
    plain = chat(server, CODE, "draft")
    assert not any("sources" in c["choices"][0]["delta"]
                   for c in plain if isinstance(c, dict) and c["choices"])
    asked = chat(server, CODE, "draft", sources=True)
    deltas = [c["choices"][0]["delta"] for c in asked
              if isinstance(c, dict) and c["choices"] and c["choices"][0]["delta"].get("content")]
    for delta in deltas:  # each chunk's spans spell its content
        assert "".join(t for t, _ in delta["sources"]) == delta["content"]
    spans = merged(s for d in deltas for s in d["sources"])
    usage = asked[-2]["usage"]
    assert "".join(d["content"] for d in deltas) == "".join(
        d["content"] for c in plain if isinstance(c, dict) and c["choices"]
        for d in [c["choices"][0]["delta"]] if d.get("content"))
    assert {s for _, s in spans} <= {"draft", "target"}
    assert usage["speculative"]["accepted_tokens"] > 0
    assert any(s == "draft" for _, s in spans)


# ------------------------------------------------------------------------ in a browser


def chromium_path() -> str | None:
    found = os.environ.get("MLXSPEC_CHROMIUM") or shutil.which("chromium") or shutil.which(
        "chromium-browser")
    return found if found and os.path.exists(found) else None


@pytest.fixture(scope="module")
def browser():
    sync_api = pytest.importorskip("playwright.sync_api",
                                   reason="playwright is not installed (pip install -e '.[test]')")
    path = chromium_path()
    if path is None:
        pytest.skip("no Chromium found (apt-get install chromium; .ci/run installs it)")
    with sync_api.sync_playwright() as p:
        browser = p.chromium.launch(executable_path=path, args=["--no-sandbox"])
        yield browser
        browser.close()


def open_page(browser, url: str):
    """A fresh page on `url` and the console errors it reports."""
    page = browser.new_page(viewport={"width": 1200, "height": 800})
    errors: list[str] = []
    page.on("console", lambda m: m.type == "error" and errors.append(m.text))
    page.on("pageerror", lambda e: errors.append(str(e)))
    page.goto(url + "/")
    return page, errors


def send(page, text: str, mode: str, max_tokens: int) -> None:
    page.select_option("#mode", mode)
    page.fill("#max-tokens", str(max_tokens))
    page.dispatch_event("#max-tokens", "change")
    page.fill("#input", text)
    page.click("#send")


def test_page_streams_colours_stops_and_keeps_the_conversation(browser, server):
    page, errors = open_page(browser, server.url)
    page.wait_for_selector("#model-name:has-text('bundled')")
    assert page.locator("#legend .src").count() == 6

    # a reply with its tokens coloured by source and its figures under it
    send(page, CODE, "draft", 200)
    stats = page.locator(".message.assistant .stats").last
    stats.locator("text=/tokens\\/forward/").wait_for(timeout=60000)
    shown = page.eval_on_selector_all(
        ".message.assistant:last-child .body span",
        "spans => spans.map(s => [s.textContent, s.dataset.source])")
    replay = chat(server, CODE, "draft", sources=True)  # the same request, greedy: the same
    deltas = [c["choices"][0]["delta"] for c in replay
              if isinstance(c, dict) and c["choices"] and c["choices"][0]["delta"].get("content")]
    assert merged(shown) == merged(s for d in deltas for s in d["sources"])
    usage = replay[-2]["usage"]["speculative"]
    assert stats.get_attribute("data-accepted") == str(usage["accepted_tokens"])
    assert stats.get_attribute("data-drafted") == str(usage["drafted_tokens"])
    assert stats.get_attribute("data-forwards") == str(usage["target_forwards"])
    assert f"({usage['accepted_tokens']}/{usage['drafted_tokens']})" in stats.inner_text()
    assert any(source == "draft" for _, source in shown)

    # a long reply, stopped while it streams (each step slowed, so that the answer cannot end
    # before the stop reaches the server on a loaded machine)
    cancels = server.metrics.cancels + server.metrics.disconnects
    emit = server.worker._emit

    def slow_emit(job, produced):
        time.sleep(0.01)
        emit(job, produced)

    server.worker._emit = slow_emit
    send(page, COUNT, "none", 1000)
    body = page.locator(".message.assistant").last.locator(".body")
    page.wait_for_function(
        "() => document.querySelector('.message.assistant:last-child .body').textContent.length > 40")
    page.click("#stop")
    page.locator(".message.assistant .stats").last.locator("text=stopped").wait_for()
    stopped_text = body.inner_text()
    page.wait_for_timeout(300)
    assert body.inner_text() == stopped_text  # nothing more came
    assert page.is_enabled("#send") and not page.is_enabled("#stop")
    assert wait_until(lambda: server.metrics.cancels + server.metrics.disconnects > cancels)
    server.worker._emit = emit

    # a reload keeps the conversation, colours and figures
    page.reload()
    page.wait_for_selector(".message.assistant .stats")
    assert page.locator(".message").count() == 4
    assert page.eval_on_selector_all(
        ".message.assistant:nth-child(2) .body span",
        "spans => spans.map(s => [s.textContent, s.dataset.source])") == shown
    assert "stopped" in page.locator(".message.assistant .stats").last.inner_text()

    # a reply with a code block: coloured, its code in a block of its own; with colours off,
    # Markdown (HTML escaped) with copy buttons
    cut = MARKDOWN.index("hi")
    spans = [[MARKDOWN[:cut], "ngram"], [MARKDOWN[cut:], "target"]]
    page.evaluate("""([content, spans]) => {
        const chat = JSON.parse(localStorage.getItem('mlxspec.chat'));
        chat.messages.push({role: 'assistant', content, spans});
        localStorage.setItem('mlxspec.chat', JSON.stringify(chat));
    }""", [MARKDOWN, spans])
    page.reload()
    reply = page.locator(".message.assistant").last
    assert reply.locator("pre.code-sources").inner_text() == "print('<b>hi</b>')\n"
    assert reply.locator("pre.code-sources .src-ngram").inner_text() == "print('<b>"
    page.uncheck("#colour")
    reply.locator(".code button.copy").wait_for()
    assert reply.locator("pre code").inner_text() == "print('<b>hi</b>')"
    assert reply.locator("strong").inner_text() == "bold"
    assert reply.locator("li").count() == 2 and reply.locator("b").count() == 0
    page.context.grant_permissions(["clipboard-read", "clipboard-write"])
    reply.locator("button.copy").click()
    assert page.evaluate("navigator.clipboard.readText()") == "print('<b>hi</b>')"

    # the status view reads /health, /v1/models, /props and /metrics
    page.click("#show-status")
    page.wait_for_selector("#status-facts dt:has-text('Memory')")
    assert page.is_hidden("#chat-view") and page.is_visible("#acceptance-chart")
    assert "in flight" in page.locator("#status-facts").inner_text()
    page.click("#new-chat")
    assert page.locator(".message").count() == 0
    assert errors == []
    page.close()


def test_page_asks_for_the_api_key(browser, keyed):
    page, errors = open_page(browser, keyed.url)
    page.wait_for_selector("#key-dialog[open]")
    page.fill("#key", "page-secret")
    page.click("#key-form button")
    page.wait_for_selector("#model-name:has-text('bundled')")
    assert page.evaluate("localStorage.getItem('mlxspec.apiKey')") == "page-secret"
    # the 401s before the key are the browser's console errors; nothing else
    assert all("401" in e for e in errors), errors
    page.close()
