"""Who may use a local server (issue #16): the Host check against DNS rebinding, CORS only for
local origins by default, the API key (constant-time, also on /metrics), and logs without
keys or prompts. A tiny random model on a byte tokenizer: nothing here depends on the text."""

from __future__ import annotations

import http.client
import json
import logging
import shutil
import subprocess
import threading

import pytest

from mlxspec.server.app import AccessPolicy, make_server

FOREIGN = "attacker.example"


def start(llama_pair, **options):
    from conftest import make_engine

    srv = make_server(make_engine(llama_pair[0], "ngram"), "127.0.0.1", 0, **options)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    return srv


def stop(srv) -> None:
    srv.shutdown()
    srv.server_close()


@pytest.fixture(scope="module")
def default_server(llama_pair):
    srv = start(llama_pair)
    yield srv
    stop(srv)


def call(srv, method, path, body=None, headers=None):
    """One request; returns (status, headers dict (lower-case names), parsed or raw body)."""
    conn = http.client.HTTPConnection(*srv.server_address[:2], timeout=30)
    data = json.dumps(body).encode() if body is not None else None
    hdrs = {"Content-Type": "application/json", **(headers or {})}
    conn.request(method, path, data, hdrs)
    resp = conn.getresponse()
    raw = resp.read()
    conn.close()
    try:
        payload = json.loads(raw) if raw else None
    except json.JSONDecodeError:
        payload = raw
    return resp.status, {k.lower(): v for k, v in resp.getheaders()}, payload


COMPLETION = {"prompt": "abc", "max_tokens": 2, "temperature": 0}


def test_foreign_host_is_refused_with_a_way_out(default_server):
    port = default_server.server_address[1]
    for method, path, body in [("GET", "/v1/models", None), ("POST", "/v1/completions", COMPLETION),
                               ("GET", "/health", None), ("OPTIONS", "/v1/completions", None)]:
        status, _, payload = call(default_server, method, path, body,
                                  {"Host": f"{FOREIGN}:{port}", "Origin": f"http://{FOREIGN}"})
        assert status == 403, (method, path)
        err = payload["error"]
        assert err["code"] == "host_not_allowed"
        assert f"--allowed-host {FOREIGN}" in err["message"]
    # The generation never ran.
    assert default_server.worker.active() == 0


@pytest.mark.parametrize("host", ["127.0.0.1", "127.0.0.1:{port}", "localhost", "localhost:{port}",
                                  "LocalHost:{port}", "[::1]", "[::1]:{port}"])
def test_loopback_host_forms_are_answered(default_server, host):
    port = default_server.server_address[1]
    status, _, payload = call(default_server, "POST", "/v1/completions", COMPLETION,
                              {"Host": host.format(port=port)})
    assert status == 200 and payload["usage"]["completion_tokens"] == 2


@pytest.mark.parametrize("host", ["127.0.0.1.attacker.example", "localhost.attacker.example:80",
                                  "10.0.0.5:8080", "[::2]", "", "localhost:80@attacker.example"])
def test_lookalike_hosts_are_refused(default_server, host):
    status, _, _ = call(default_server, "GET", "/v1/models", headers={"Host": host})
    assert status == 403, host


def test_allowed_host_restores_access(llama_pair):
    srv = start(llama_pair, allowed_hosts=("proxy.lan", "box.example:9000"))
    try:
        assert call(srv, "GET", "/v1/models", headers={"Host": "proxy.lan:8080"})[0] == 200
        assert call(srv, "GET", "/v1/models", headers={"Host": "PROXY.LAN"})[0] == 200
        assert call(srv, "GET", "/v1/models", headers={"Host": "box.example:9000"})[0] == 200
        assert call(srv, "GET", "/v1/models", headers={"Host": "box.example:9001"})[0] == 403
        assert call(srv, "GET", "/v1/models", headers={"Host": FOREIGN})[0] == 403
        assert call(srv, "GET", "/v1/models", headers={"Host": "localhost"})[0] == 200
    finally:
        stop(srv)
    srv = start(llama_pair, allowed_hosts=("*",))
    try:
        assert call(srv, "GET", "/v1/models", headers={"Host": FOREIGN})[0] == 200
    finally:
        stop(srv)


def test_host_policy_off_loopback():
    """Bound to another address, the Host check follows --allowed-host (and the API key)."""
    open_ = AccessPolicy("0.0.0.0")
    assert open_.host_allowed(FOREIGN) and open_.host_allowed("192.168.1.5:8080")
    named = AccessPolicy("0.0.0.0", allowed_hosts=("gpu-box.lan",))
    assert named.host_allowed("gpu-box.lan:8080") and named.host_allowed("localhost:8080")
    assert named.host_allowed("192.168.1.5:8080")  # an IP literal cannot be a rebound name
    assert not named.host_allowed(FOREIGN)
    loop = AccessPolicy("127.0.0.1")
    assert not loop.host_allowed("192.168.1.5:8080") and loop.host_allowed(None)
    assert AccessPolicy("::1").host_allowed("[::1]:8080")


@pytest.mark.parametrize("origin", ["http://localhost:3000", "http://127.0.0.1:5173",
                                    "https://[::1]:8443", "http://localhost"])
def test_local_origins_are_echoed(default_server, origin):
    status, headers, _ = call(default_server, "POST", "/v1/completions", COMPLETION,
                              {"Origin": origin})
    assert status == 200
    assert headers["access-control-allow-origin"] == origin
    assert "origin" in headers["vary"].lower()


@pytest.mark.parametrize("origin", [f"http://{FOREIGN}", "http://localhost.attacker.example",
                                    "http://127.0.0.1.nip.io:8080", "null", "file://"])
def test_foreign_origins_get_no_cors_header(default_server, origin):
    status, headers, _ = call(default_server, "POST", "/v1/completions", COMPLETION,
                              {"Origin": origin})
    assert status == 200  # answered (curl-like clients send no Origin), but unreadable to a page
    assert "access-control-allow-origin" not in headers
    status, headers, _ = call(default_server, "GET", "/v1/models", headers={"Origin": origin})
    assert "access-control-allow-origin" not in headers


def test_preflight(default_server):
    pre = {"Access-Control-Request-Method": "POST",
           "Access-Control-Request-Headers": "authorization, content-type"}
    status, headers, payload = call(default_server, "OPTIONS", "/v1/chat/completions",
                                    headers={"Origin": f"http://{FOREIGN}", **pre})
    assert status == 403 and "access-control-allow-origin" not in headers
    assert f"--cors-origin http://{FOREIGN}" in payload["error"]["message"]
    status, headers, _ = call(default_server, "OPTIONS", "/v1/chat/completions",
                              headers={"Origin": "http://localhost:3000", **pre})
    assert status == 204
    assert headers["access-control-allow-origin"] == "http://localhost:3000"
    assert "POST" in headers["access-control-allow-methods"]
    assert "authorization" in headers["access-control-allow-headers"].lower()
    # Without an Origin (not a browser): allowed methods, no CORS headers.
    status, headers, _ = call(default_server, "OPTIONS", "/v1/completions")
    assert status == 204 and "access-control-allow-origin" not in headers


def test_cors_origin_flags(llama_pair):
    srv = start(llama_pair, cors_origins=("https://chat.example.com",))
    try:
        _, headers, _ = call(srv, "GET", "/v1/models", headers={"Origin": "https://chat.example.com"})
        assert headers["access-control-allow-origin"] == "https://chat.example.com"
        _, headers, _ = call(srv, "GET", "/v1/models", headers={"Origin": f"http://{FOREIGN}"})
        assert "access-control-allow-origin" not in headers
        assert call(srv, "OPTIONS", "/v1/models",
                    headers={"Origin": "https://chat.example.com"})[0] == 204
    finally:
        stop(srv)
    srv = start(llama_pair, cors_origins=("*",))  # today's old behaviour, explicitly
    try:
        _, headers, _ = call(srv, "GET", "/v1/models", headers={"Origin": f"http://{FOREIGN}"})
        assert headers["access-control-allow-origin"] == "*"
        status, headers, _ = call(srv, "OPTIONS", "/v1/models",
                                  headers={"Origin": f"http://{FOREIGN}"})
        assert status == 204 and headers["access-control-allow-origin"] == "*"
    finally:
        stop(srv)


def test_api_key_on_metrics_not_health(llama_pair, monkeypatch):
    import hmac

    from mlxspec.server import access as app

    compared = []
    real = hmac.compare_digest

    def spy(a, b):
        compared.append((a, b))
        return real(a, b)

    monkeypatch.setattr(app.hmac, "compare_digest", spy)
    srv = start(llama_pair, api_key="sekret-key")
    try:
        assert call(srv, "GET", "/health")[0] == 200
        assert call(srv, "GET", "/metrics")[0] == 401
        assert call(srv, "GET", "/metrics", headers={"Authorization": "Bearer sekret-kez"})[0] == 401
        assert call(srv, "GET", "/props")[0] == 401
        status, headers, payload = call(srv, "GET", "/metrics",
                                        headers={"Authorization": "Bearer sekret-key"})
        assert status == 200 and b"mlxspec_requests_total" in payload
        assert call(srv, "GET", "/v1/models", headers={"x-api-key": "sekret-key"})[0] == 200
        assert compared, "the key must be compared with hmac.compare_digest"
    finally:
        stop(srv)


def test_logs_never_hold_the_key_and_prompts_only_when_asked(llama_pair, caplog):
    caplog.set_level(logging.INFO, logger="mlxspec.server")
    secret_prompt = "PROMPT-TEXT-4711"
    for log_prompts in (False, True):
        caplog.clear()
        srv = start(llama_pair, api_key="sekret-key", log_prompts=log_prompts)
        try:
            body = {**COMPLETION, "prompt": secret_prompt}
            status, _, _ = call(srv, "POST", "/v1/completions?api_key=sekret-key", body,
                                {"Authorization": "Bearer sekret-key"})
            assert status == 200
            call(srv, "POST", "/v1/completions", body, {"Authorization": "Bearer wrong-key"})
        finally:
            stop(srv)
        text = caplog.text
        assert "POST /v1/completions 200" in text and "POST /v1/completions 401" in text
        assert "sekret-key" not in text and "wrong-key" not in text
        assert "Authorization" not in text and "Bearer" not in text
        assert (secret_prompt in text) is log_prompts


def test_clients_work_unchanged_with_the_defaults(default_server):
    """The openai package, llama.vim's /infill path (curl) and plain curl, as users run them."""
    openai = pytest.importorskip("openai")
    url = default_server.url
    c = openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=30)
    assert c.completions.create(model="mlxspec", prompt="abc", max_tokens=2).usage.completion_tokens == 2
    local = openai.OpenAI(base_url=url.replace("127.0.0.1", "localhost") + "/v1", api_key="none",
                          max_retries=0, timeout=30)
    assert local.models.list().data
    if shutil.which("curl"):
        out = subprocess.run(["curl", "-s", "--max-time", "30", url + "/v1/completions",
                              "-H", "Content-Type: application/json",
                              "-d", json.dumps(COMPLETION)],
                             capture_output=True, text=True, check=True).stdout
        assert json.loads(out)["usage"]["completion_tokens"] == 2
        out = subprocess.run(["curl", "-s", "--max-time", "30", url + "/completion",
                              "--data", "@-"], input=json.dumps({"prompt": "abc", "n_predict": 2}),
                             capture_output=True, text=True, check=True).stdout
        assert json.loads(out)["tokens_predicted"] == 2
