"""`mlxspec serve` end to end: the real server on a free loopback port, real clients (the
`openai` package, and raw HTTP replaying what llama.vim and Continue send), assertions on
content: greedy answers equal `Engine.generate`, FIM prompts carry the right tokens, predicted
outputs are accepted, concurrency, disconnects and bad input."""

from __future__ import annotations

import http.client
import json
import socket
import subprocess
import sys
import threading
import time

import pytest

openai = pytest.importorskip("openai")

from server_helpers import free_port, post, sse_events  # noqa: E402

import mlxspec  # noqa: E402
from mlxspec.server.app import make_server  # noqa: E402
from mlxspec.server.protocol import FimTokens, build_fim_prompt, detect_fim  # noqa: E402

CODE = "def stream_steps(self, prompt, max_tokens):\n    tokens = self.encode(prompt)\n    "
CHAT = [{"role": "system", "content": "You complete code."},
        {"role": "user", "content": "Write a function that returns the prompt cache."}]
CONTINUE_PREFIX = "class Engine:\n    def encode(self, prompt):\n        "
CONTINUE_SUFFIX = "\n        return tokens\n"
VIM_EXTRA = [{"text": "def common_prefix_len(a, b):\n    n = 0\n", "time": [1, 0],
              "filename": "mlxspec/proposers/draft.py"},
             {"text": "import mlx.core as mx\n", "time": [2, 0], "filename": "mlxspec/engine.py"}]
VIM_PREFIX = "def generate(self, prompt, **kwargs):\n"
VIM_MIDDLE = "    text, tokens = "
VIM_SUFFIX = "\n    return GenerationResult(text)\n"
CHUNKED = "# a prompt prefilled in chunks\n" + VIM_PREFIX * 3 + CONTINUE_PREFIX
CONCURRENT = [f"def step_{i}(self, tokens):\n    return {i} + " for i in range(8)]


def llama_vim_body(prefix, middle, suffix, extra, n_predict=24):
    """The body llama.vim's llama#fim sends (autoload/llama.vim), field for field."""
    return {
        "id_slot": 0,
        "input_prefix": prefix,
        "input_suffix": suffix,
        "input_extra": extra,
        "prompt": middle,
        "n_predict": n_predict,
        "stop": [],
        "n_indent": 4,
        "top_k": 40,
        "top_p": 0.90,
        "samplers": ["top_k", "top_p", "infill"],
        "stream": False,
        "cache_prompt": True,
        "t_max_prompt_ms": 500,
        "t_max_predict_ms": 60000,
        "response_fields": ["content", "timings/prompt_n", "timings/prompt_ms",
                            "timings/prompt_per_token_ms", "timings/prompt_per_second",
                            "timings/predicted_n", "timings/predicted_ms",
                            "timings/predicted_per_token_ms", "timings/predicted_per_second",
                            "truncated", "tokens_cached"],
    }


def llama_vim_warmup_body(extra):
    """llama.vim's ring-buffer cache warm-up (n_predict 0)."""
    return {"id_slot": 0, "input_prefix": "", "input_suffix": "", "input_extra": extra,
            "prompt": "", "n_predict": 0, "temperature": 0.0, "samplers": [], "stream": False,
            "cache_prompt": True, "t_max_prompt_ms": 1, "t_max_predict_ms": 1,
            "response_fields": [""]}


def continue_fim_body(model, prefix, suffix):
    """What Continue's OpenAI-compatible providers post for FIM autocomplete."""
    return {"model": model, "prompt": prefix, "suffix": suffix, "max_tokens": 24,
            "temperature": 0, "top_p": 1, "frequency_penalty": 0, "presence_penalty": 0,
            "stop": ["\n\n\n", "\n\n\n\n\n"], "stream": True}


# ----------------------------------------------------------------------------- fixtures


@pytest.fixture(scope="module")
def ref(model_dirs):
    """The reference: plain decoding with a separately loaded engine, all computed before the
    server starts (so no two threads ever run MLX at once)."""
    engine = mlxspec.load(str(model_dirs["qwen2"]), mode="none")
    tok = engine.tokenizer
    vocab = tok.get_vocab()

    def enc(s):
        return list(tok.encode(s, add_special_tokens=False))

    pre, suf, mid = (vocab[t] for t in ("<|fim_prefix|>", "<|fim_suffix|>", "<|fim_middle|>"))
    chat_ids = enc(tok.apply_chat_template(CHAT, add_generation_prompt=True, tokenize=False))
    continue_ids = [pre] + enc(CONTINUE_PREFIX) + [suf] + enc(CONTINUE_SUFFIX) + [mid]
    snippet = "\n\n--- snippet ---\n\n"
    vim_ids = [t for c in VIM_EXTRA for t in enc(snippet) + enc(c["text"])]
    vim_ids += [pre] + enc(VIM_PREFIX + VIM_MIDDLE) + [suf] + enc(VIM_SUFFIX) + [mid]

    def gen(prompt, n):
        return engine.generate(prompt, max_tokens=n, temperature=0.0)

    out = {
        "engine": engine, "enc": enc,
        "code": gen(CODE, 24), "code_ids": engine.encode(CODE),
        "chat_ids": chat_ids, "chat": gen(chat_ids, 40),
        "continue_ids": continue_ids, "continue": gen(continue_ids, 24),
        "vim_ids": vim_ids, "vim": gen(vim_ids, 24),
        "concurrent": [gen(p, 12) for p in CONCURRENT],
        "chunked": gen(CHUNKED, 16), "chunked_ids": engine.encode(CHUNKED),
        # A prompt whose greedy answer runs 200 tokens without an end-of-sequence token, for
        # the cancellation tests (a random model's answer may otherwise end at once).
        "long": next((p for p in [CODE] + CONCURRENT
                      if gen(p, 200).finish_reason == "length"), None),
    }
    return out


@pytest.fixture(scope="module")
def server(model_dirs, ref):
    engine = mlxspec.load(str(model_dirs["qwen2"]), mode="ngram", num_draft=4)
    # As loading a float16 model on the CPU backend does: weights still lazy, on this thread's
    # stream (the worker thread must not be the one to evaluate them).
    from mlx.utils import tree_map

    engine.model.update(tree_map(lambda a: a * 1, engine.model.parameters()))
    srv = make_server(engine, "127.0.0.1", 0, spec_max_concurrency=2, max_batch=8,
                      max_body_bytes=64 * 1024)
    thread = threading.Thread(target=srv.serve_forever, daemon=True)
    thread.start()
    yield srv
    srv.shutdown()
    srv.server_close()


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0,
                         timeout=60)


def wait_idle(server, timeout=5.0):
    end = time.time() + timeout
    while time.time() < end:
        if server.worker.active() == 0 and server.worker.inbox.qsize() == 0:
            return True
        time.sleep(0.01)
    return False


# ----------------------------------------------------------------------------- OpenAI API


def test_models_and_health(server, client):
    models = client.models.list()
    assert [m.id for m in models.data] == [server.config.model_name]
    conn = http.client.HTTPConnection(*server.server_address[:2], timeout=10)
    conn.request("GET", "/health")
    resp = conn.getresponse()
    assert resp.status == 200 and json.loads(resp.read())["status"] == "ok"


def test_completion_greedy_equals_generate(server, client, ref):
    name = server.config.model_name
    r = client.completions.create(model=name, prompt=CODE, max_tokens=24, temperature=0)
    assert r.choices[0].text == ref["code"].text
    assert r.usage.completion_tokens == len(ref["code"].tokens)
    assert r.usage.prompt_tokens == len(ref["code_ids"])
    spec = r.usage.model_extra["speculative"]
    assert spec["mode"] == "ngram" and spec["target_forwards"] >= 1
    # Token ids as the prompt, and streaming with usage: the same text.
    r = client.completions.create(model=name, prompt=ref["code_ids"], max_tokens=24,
                                  temperature=0, stream=True,
                                  stream_options={"include_usage": True})
    chunks = list(r)
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert text == ref["code"].text
    assert chunks[-1].usage.completion_tokens == len(ref["code"].tokens)
    # The second request extends nothing new but reuses the cached prompt.
    assert chunks[-1].usage.prompt_tokens_details.cached_tokens > 0


def test_speculative_override_and_prompt_cache(server, client, ref):
    r = client.completions.create(model="mlxspec", prompt=CODE, max_tokens=24, temperature=0,
                                  extra_body={"speculative": {"mode": "none"}})
    assert r.choices[0].text == ref["code"].text
    spec = r.usage.model_extra["speculative"]
    assert spec["mode"] == "none" and spec["drafted_tokens"] == 0
    # A prompt extending an earlier one reuses its cached prefix.
    r = client.completions.create(model="mlxspec", prompt=CODE + ref["code"].text + "\n",
                                  max_tokens=4, temperature=0)
    assert r.usage.prompt_tokens_details.cached_tokens >= len(ref["code_ids"]) - 1


def stop_case(text: str) -> tuple[str, str]:
    """A stop string from the middle of `text` and the text the answer must end before."""
    stop = text[len(text) // 2 : len(text) // 2 + 3]
    return stop, text[: text.find(stop)]


def test_stop_strings(server, client, ref):
    stop, want = stop_case(ref["code"].text)
    r = client.completions.create(model="mlxspec", prompt=CODE, max_tokens=24, temperature=0,
                                  stop=[stop])
    assert r.choices[0].text == want and r.choices[0].finish_reason == "stop"


def test_batched_plain_path(server, client, ref, monkeypatch):
    """With --spec-max-concurrency 0 every request runs in mlx-lm's BatchGenerator: the same
    greedy text, stop strings, streaming, usage."""
    monkeypatch.setattr(server.worker, "spec_max_concurrency", 0)
    r = client.completions.create(model="mlxspec", prompt=CODE, max_tokens=24, temperature=0)
    assert r.choices[0].text == ref["code"].text
    assert r.usage.model_extra["speculative"]["batched"] is True
    assert r.usage.completion_tokens == len(ref["code"].tokens)
    stop, want = stop_case(ref["code"].text)
    r = client.completions.create(model="mlxspec", prompt=CODE, max_tokens=24, temperature=0,
                                  stop=[stop], stream=True)
    chunks = list(r)
    assert "".join(c.choices[0].text for c in chunks) == want
    assert chunks[-1].choices[0].finish_reason == "stop"
    r = client.chat.completions.create(model="mlxspec", messages=CHAT, max_tokens=40,
                                       temperature=0)
    assert r.choices[0].message.content == ref["chat"].text


def test_long_prompt_prefilled_in_chunks(server, client, ref, monkeypatch):
    """A long prompt is prefilled a chunk per worker round (other streams go on meanwhile);
    the answer is unchanged and the chunks are not reported as cached."""
    from mlxspec import admission

    monkeypatch.setattr(server.worker, "prefill_chunk", 8)
    prefill = admission.prefill
    chunks = []

    def counting(engine, tokens, pc, proposer, limit=None, progress=None):
        if tokens == ref["chunked_ids"]:
            chunks.append(limit)
        return prefill(engine, tokens, pc, proposer, limit=limit, progress=progress)

    monkeypatch.setattr(admission, "prefill", counting)
    assert len(ref["chunked_ids"]) > 3 * 8
    r = client.completions.create(model="mlxspec", prompt=CHUNKED, max_tokens=16, temperature=0)
    assert r.choices[0].text == ref["chunked"].text
    assert r.usage.prompt_tokens_details.cached_tokens < 8  # at most a shared first chunk
    # chunks, then the rest at once (or with the round's joiners: no call of its own)
    assert chunks.count(8) >= 3 and set(chunks) <= {8, None}


def test_chat_and_streaming(server, client, ref):
    r = client.chat.completions.create(model=server.config.model_name, messages=CHAT,
                                       max_tokens=40, temperature=0)
    assert r.choices[0].message.content == ref["chat"].text
    assert r.usage.prompt_tokens == len(ref["chat_ids"])
    stream = client.chat.completions.create(model=server.config.model_name, messages=CHAT,
                                            max_tokens=40, temperature=0, stream=True,
                                            stream_options={"include_usage": True})
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == ref["chat"].text
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] in ("length", "stop")
    assert chunks[-1].usage.total_tokens == len(ref["chat_ids"]) + len(ref["chat"].tokens)


def test_predicted_outputs(server, client, ref):
    def ask(prediction=None):
        extra = {"prediction": {"type": "content", "content": prediction}} if prediction else {}
        return client.chat.completions.create(
            model=server.config.model_name, messages=CHAT, max_tokens=40, temperature=0,
            extra_body={**extra, "speculative": {"mode": "ngram"}})

    plain = ask()
    predicted = ask(ref["chat"].text)
    assert plain.choices[0].message.content == ref["chat"].text
    assert predicted.choices[0].message.content == ref["chat"].text  # lossless
    details = predicted.usage.completion_tokens_details
    # This random model's answer may not survive decode/encode (the tiny tokenizer merges its
    # bytes differently), so only a round-tripping answer must have predicted tokens accepted;
    # otherwise at most chance matches. (Predictions that match are accepted: test_edit.py and
    # the bundled-model tests.)
    if ref["enc"](ref["chat"].text) == ref["chat"].tokens:
        assert details.accepted_prediction_tokens > 0
    assert plain.usage.completion_tokens_details.accepted_prediction_tokens == 0
    # Every accepted predicted token is a target forward saved: fewer forwards than tokens,
    # where plain decoding takes one per token. (Against n-gram speculation without the
    # prediction the gain is only guaranteed for text that survives decode/encode; a random
    # model's byte soup does not, so that comparison is left to the benchmark.)
    forwards = predicted.usage.model_extra["speculative"]["target_forwards"]
    assert forwards <= predicted.usage.completion_tokens - details.accepted_prediction_tokens
    # (n-gram speculation on the answer itself still saves forwards below)
    none = client.chat.completions.create(
        model=server.config.model_name, messages=CHAT, max_tokens=40, temperature=0,
        extra_body={"speculative": {"mode": "none"},
                    "prediction": {"type": "content", "content": ref["chat"].text}})
    assert none.usage.model_extra["speculative"]["target_forwards"] == len(ref["chat"].tokens)
    assert forwards < len(ref["chat"].tokens)
    # The OpenAI SDK's list-of-parts form works too.
    parts = client.chat.completions.create(
        model=server.config.model_name, messages=CHAT, max_tokens=40, temperature=0,
        prediction={"type": "content", "content": [{"type": "text", "text": ref["chat"].text}]})
    assert parts.choices[0].message.content == ref["chat"].text
    assert (parts.usage.completion_tokens_details.accepted_prediction_tokens
            == details.accepted_prediction_tokens)  # the same prediction, the same count
    # An extension: predictions on /v1/completions too.
    r = client.completions.create(model="mlxspec", prompt=CODE, max_tokens=24, temperature=0,
                                  extra_body={"prediction": {"type": "content",
                                                             "content": ref["code"].text}})
    assert r.choices[0].text == ref["code"].text
    assert r.usage.completion_tokens_details.accepted_prediction_tokens > 0


# ----------------------------------------------------------------------------- editors


def test_continue_fim_completion_with_suffix(server, ref):
    status, payload, _ = post(server.url, "/v1/completions",
                           continue_fim_body(server.config.model_name, CONTINUE_PREFIX,
                                             CONTINUE_SUFFIX))
    assert status == 200
    assert server.worker.last_prompt == ref["continue_ids"]
    events = sse_events(payload)
    assert events[-1] == "[DONE]"
    text = "".join(e["choices"][0]["text"] for e in events[:-1] if e["choices"])
    assert text == ref["continue"].text.split("\n\n\n")[0]
    # Continue's generic OpenAI `_streamFim`: POST {apiBase}/fim/completions, reads
    # choices[0].delta.content.
    body = continue_fim_body(server.config.model_name, CONTINUE_PREFIX, CONTINUE_SUFFIX)
    status, payload, _ = post(server.url, "/v1/fim/completions", body,
                           headers={"Accept": "application/json", "x-api-key": "",
                                    "Authorization": "Bearer undefined"})
    assert status == 200 and server.worker.last_prompt == ref["continue_ids"]
    events = sse_events(payload)
    assert "".join(e["choices"][0]["delta"].get("content") or "" for e in events[:-1]
                   if e["choices"]) == text


def test_tabby_raw_fim_prompt(server, ref):
    """Tabby's `openai/completion` backend formats `prompt_template` itself: the FIM tokens
    arrive as text and must become the special tokens."""
    prompt = f"<|fim_prefix|>{CONTINUE_PREFIX}<|fim_suffix|>{CONTINUE_SUFFIX}<|fim_middle|>"
    status, payload, _ = post(server.url, "/v1/completions",
                           {"model": "mlxspec", "prompt": prompt, "max_tokens": 24,
                            "temperature": 0.0, "stream": False, "presence_penalty": 0.0})
    assert status == 200 and server.worker.last_prompt == ref["continue_ids"]
    assert json.loads(payload)["choices"][0]["text"] == ref["continue"].text


def test_continue_llama_cpp_provider(server, ref):
    """Continue's `llama.cpp` provider: POST /completion, streamed, reads `content`."""
    body = {"prompt": CODE, "stream": True, "n_predict": 24, "min_p": 0.0, "stop": [],
            "top_k": 1, "top_p": 1.0, "temperature": 0, "frequency_penalty": 0,
            "presence_penalty": 0}
    status, payload, _ = post(server.url, "/completion", body)
    assert status == 200
    events = sse_events(payload)
    assert "".join(e["content"] for e in events) == ref["code"].text
    assert events[-1]["stop"] is True and events[-1]["tokens_predicted"] == len(ref["code"].tokens)


def test_llama_vim_infill(server, ref):
    status, payload, _ = post(server.url, "/infill", llama_vim_warmup_body(VIM_EXTRA))
    assert status == 200 and json.loads(payload) == {}  # response_fields [""]
    status, payload, _ = post(server.url, "/infill",
                           llama_vim_body(VIM_PREFIX, VIM_MIDDLE, VIM_SUFFIX, VIM_EXTRA))
    assert status == 200
    assert server.worker.last_prompt == ref["vim_ids"]
    body = json.loads(payload)
    assert body["content"] == ref["vim"].text
    assert body["timings/predicted_n"] == len(ref["vim"].tokens)
    assert body["tokens_cached"] > 0  # the warm-up cached the extra context
    assert body["truncated"] is False
    assert set(body) == {"content", "timings/prompt_n", "timings/prompt_ms",
                         "timings/prompt_per_token_ms", "timings/prompt_per_second",
                         "timings/predicted_n", "timings/predicted_ms",
                         "timings/predicted_per_token_ms", "timings/predicted_per_second",
                         "truncated", "tokens_cached"}
    # Without response_fields: llama.cpp's whole object, with the draft counts.
    req = llama_vim_body(VIM_PREFIX, VIM_MIDDLE, VIM_SUFFIX, VIM_EXTRA)
    del req["response_fields"]
    status, payload, _ = post(server.url, "/infill", req)
    full = json.loads(payload)
    assert full["content"] == ref["vim"].text and full["stop"] is True
    assert full["tokens_predicted"] == len(ref["vim"].tokens)
    assert {"draft_n", "draft_n_accepted", "prompt_n", "predicted_n"} <= set(full["timings"])
    # Streaming /infill (llama.vscode can stream): llama.cpp's data lines, last one stop=true.
    req["stream"] = True
    status, payload, _ = post(server.url, "/infill", req)
    events = sse_events(payload)
    assert events[-1]["stop"] is True
    assert "".join(e["content"] for e in events) == ref["vim"].text


def test_fim_assembly_with_repo_tokens():
    vocab = {"<|fim_prefix|>": 1, "<|fim_suffix|>": 2, "<|fim_middle|>": 3, "<|file_sep|>": 4,
             "<|repo_name|>": 5}
    fim = detect_fim(vocab)
    assert fim == FimTokens("qwen", 1, 2, 3, 4, 5)

    def enc(s):
        return [ord(c) + 100 for c in s]

    ids, truncated = build_fim_prompt(enc, fim, "ab", "cd", extra=[{"filename": "f", "text": "x"}],
                                      middle="m")
    assert ids == ([5] + enc("myproject\n") + [4] + enc("f\n") + enc("x") + [4]
                   + enc("filename\n") + [1] + enc("abm") + [2] + enc("cd") + [3])
    assert not truncated
    ids, truncated = build_fim_prompt(enc, fim, "p" * 100, "s" * 100, extra=[{"text": "x" * 50}],
                                      budget=43)
    assert truncated and len(ids) == 43
    assert ids[:2] == [1, enc("p")[0]] and ids[-1] == 3  # extra dropped first, then trimmed 3:1
    assert detect_fim({"<fim_prefix>": 1, "<fim_suffix>": 2, "<fim_middle>": 3}).style == "starcoder"
    assert detect_fim({"▁<PRE>": 1, "▁<SUF>": 2, "▁<MID>": 3}).style == "codellama"
    assert detect_fim({"a": 1}) is None


# ----------------------------------------------------------------------------- load and faults


def test_eight_concurrent_clients(server, client, ref):
    results = [None] * len(CONCURRENT)

    def run(i):
        results[i] = client.completions.create(model="mlxspec", prompt=CONCURRENT[i],
                                               max_tokens=12, temperature=0)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(CONCURRENT))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert all(r is not None for r in results)
    for r, want in zip(results, ref["concurrent"]):
        assert r.choices[0].text == want.text
        assert r.usage.completion_tokens == len(want.tokens)
    batched = [r.usage.model_extra["speculative"]["batched"] for r in results]
    assert any(batched) and not all(batched)  # above --spec-max-concurrency: plain, batched
    # A batched request's KV cache is kept too: its next turn reuses it.
    i = batched.index(True)
    r = client.completions.create(model="mlxspec", prompt=CONCURRENT[i] + results[i].choices[0].text,
                                  max_tokens=2, temperature=0)
    assert r.usage.prompt_tokens_details.cached_tokens >= len(ref["enc"](CONCURRENT[i]))


def test_requests_over_the_batch_bound_wait_to_open(model_dirs, ref):
    """Over --spec-max-concurrency a request decodes plainly in the batch (usage.batched);
    over that plus --max-batch it waits to open, and answers as alone once it runs."""
    from server_helpers import post, start, stop

    engine = mlxspec.load(str(model_dirs["qwen2"]), mode="ngram", num_draft=4)
    srv = start(engine, spec_max_concurrency=1, max_batch=1)
    worker, most_open = srv.worker, [0]
    orig = worker._step_all

    def counted():
        most_open[0] = max(most_open[0], sum(j.opened for j in worker.jobs))
        orig()

    worker._step_all = counted
    results = [None] * 4

    def run(i):
        results[i] = post(srv.url, "/v1/completions",
                          {"prompt": CONCURRENT[i], "max_tokens": 12, "temperature": 0})

    try:
        threads = [threading.Thread(target=run, args=(i,)) for i in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=60)
    finally:
        stop(srv)
    bodies = [json.loads(r[1]) for r in results]
    assert [b["choices"][0]["text"] for b in bodies] == [w.text for w in ref["concurrent"][:4]]
    assert most_open[0] == 2
    assert any(b["usage"]["speculative"]["batched"] for b in bodies)


def test_default_server_verifies_concurrent_requests_in_one_batch(model_dirs, ref):
    """With the defaults, concurrent greedy requests share the batched speculative step
    (`usage.speculative.batched_speculative`) and answer what `generate` does; a sampled
    request with a seed shares the batch too and draws what it draws alone; a request alone
    runs in the batch (its engine loop there) and answers as `generate`."""
    from server_helpers import post, start, stop

    engine = mlxspec.load(str(model_dirs["qwen2"]), mode="ngram", num_draft=4)
    round_robin = start(engine, batch_spec=False)  # each speculative request its own forward
    assert round_robin.worker.spec_max_concurrency == 2
    stop(round_robin)
    srv = start(engine)
    assert srv.worker.spec_max_concurrency == 32  # an upper bound: the batch steps plainly
    try:
        status, payload, _ = post(srv.url, "/v1/completions",
                                  {"prompt": CONCURRENT[0], "max_tokens": 12, "temperature": 0})
        alone = json.loads(payload)
        assert status == 200 and alone["usage"]["speculative"]["batched_speculative"]
        assert alone["choices"][0]["text"] == ref["concurrent"][0].text
        seeded = {"prompt": CONCURRENT[1], "max_tokens": 12, "temperature": 1.0, "seed": 5}
        want_seeded = json.loads(post(srv.url, "/v1/completions", seeded)[1])
        out = [None] * 7  # within --spec-max-concurrency (32): none in the plain batch

        def run(i):
            body = seeded if i == 6 else {
                "prompt": CONCURRENT[i], "max_tokens": 12, "temperature": 0}
            out[i] = json.loads(post(srv.url, "/v1/completions", body)[1])

        threads = [threading.Thread(target=run, args=(i,)) for i in range(len(out))]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=60)
        for r, want in zip(out[:6], ref["concurrent"]):
            assert r["choices"][0]["text"] == want.text
        flags = [r["usage"]["speculative"]["batched_speculative"] for r in out]
        assert sum(flags) >= 2
        assert out[-1]["choices"][0]["text"] == want_seeded["choices"][0]["text"], out[-1]["usage"]["speculative"]
        # /metrics counts the requests the batched step served (the first two, alone, too)
        conn = http.client.HTTPConnection(*srv.url.removeprefix("http://").split(":"))
        conn.request("GET", "/metrics")
        metrics = conn.getresponse().read().decode()
        line = next(x for x in metrics.splitlines()
                    if x.startswith("mlxspec_batched_speculative_generations_total "))
        assert int(line.split()[-1]) == 2 + sum(flags)
    finally:
        stop(srv)


def _opened_worker(model_dirs, greedy: int, mode: str | None = None):
    """A worker (its thread not started) with a seeded sampled request (in `mode`) submitted
    first and `greedy` greedy ones after it, all admitted and opened in one round."""
    from mlxspec.server.protocol import GenRequest
    from mlxspec.server.worker import Worker

    engine = mlxspec.load(str(model_dirs["qwen2"]), mode="ngram", num_draft=4)
    worker = Worker(engine)
    prompts = [engine.encode(p) for p in CONCURRENT[: 1 + greedy]]
    seeded = worker.submit(GenRequest("completions", prompts[0], 8, temperature=1.0, seed=5,
                                      mode=mode))
    others = [worker.submit(GenRequest("completions", p, 8)) for p in prompts[1:]]
    worker._admit(block=False)
    for job in worker.jobs:
        worker._open_job(job)
    return engine, worker, prompts, seeded, others


def _events(job) -> list:
    events = []
    while not job.events.empty():
        events.append(job.events.get())
    return events


def test_every_job_is_a_row_of_the_shared_batch_a_seeded_one_too(model_dirs):
    """The worker opens every request as a row of the shared batch, a seeded sampled one
    too (it draws by position: what it draws alone); the worker steps every batch once a
    round and each answer equals `generate`'s."""
    from mlxspec.row import BatchRow
    from mlxspec.server.worker import Done

    engine, worker, prompts, seeded, greedy = _opened_worker(model_dirs, 3)
    assert all(isinstance(job.row, BatchRow) for job in worker.jobs)
    assert all(job.batch is worker.spec_batch for job in worker.jobs)
    while worker.jobs:
        worker._step_all()
    texts = []
    for job in [seeded, *greedy]:
        events = _events(job)
        assert isinstance(events[-1], Done), events[-1]
        texts.append("".join(e.text for e in events[:-1]))
    alone = engine.generate(prompts[0], max_tokens=8, temperature=1.0, seed=5)
    assert texts[0] == alone.text
    for text, p in zip(texts[1:], prompts[1:]):
        assert text == engine.generate(p, max_tokens=8, temperature=0).text


def test_a_batch_whose_step_raises_fails_its_own_rows_only(model_dirs, monkeypatch):
    from mlxspec.server.worker import Done, Failed

    # (a tree source decodes on a batch of its own)
    engine, worker, prompts, seeded, (greedy,) = _opened_worker(model_dirs, 1, "lookahead")
    assert seeded.batch is not greedy.batch

    def broken():
        raise RuntimeError("a step that raised")

    monkeypatch.setattr(seeded.batch, "step", broken)
    while worker.jobs:
        worker._step_all()
    (failed,) = _events(seeded)
    assert isinstance(failed, Failed) and failed.error.status == 500
    assert "a step that raised" in failed.error.message
    events = _events(greedy)
    assert isinstance(events[-1], Done)
    assert "".join(e.text for e in events[:-1]) == engine.generate(
        prompts[1], max_tokens=8, temperature=0).text


def test_disconnect_mid_stream_frees_the_worker(server, client, ref):
    assert ref["long"] is not None, "the fixture must provide a prompt with a long answer"
    cancels = server.metrics.cancels
    sock = socket.create_connection(server.server_address[:2], timeout=30)
    body = json.dumps({"prompt": ref["long"], "max_tokens": 200, "stream": True,
                       "temperature": 0}).encode()
    sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                 b"Content-Length: " + str(len(body)).encode() + b"\r\n\r\n" + body)
    got = b""
    while got.count(b"data: ") < 3:
        chunk = sock.recv(4096)
        assert chunk, got  # the server must not close before streaming
        got += chunk
    sock.close()
    start = time.time()
    r = client.completions.create(model="mlxspec", prompt="x = ", max_tokens=4, temperature=0)
    assert r.usage.completion_tokens >= 1
    assert time.time() - start < 5
    assert wait_idle(server)
    assert server.metrics.cancels == cancels + 1
    assert server.metrics.disconnects >= 1


def test_cancelled_non_streaming_request(server, client, ref, monkeypatch):
    """Editors kill their request (llama.vim kills curl) when the cursor moves on."""
    assert ref["long"] is not None, "the fixture must provide a prompt with a long answer"
    step = server.worker._emit

    def slow_step(job, produced):  # a tiny model answers 200 tokens faster than a client hangs up
        time.sleep(0.01)
        step(job, produced)

    monkeypatch.setattr(server.worker, "_emit", slow_step)
    cancels = server.metrics.cancels
    sock = socket.create_connection(server.server_address[:2], timeout=30)
    body = json.dumps({"prompt": ref["long"], "n_predict": 200, "temperature": 0}).encode()
    sock.sendall(b"POST /completion HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Length: "
                 + str(len(body)).encode() + b"\r\n\r\n" + body)
    end = time.time() + 10
    while server.worker.active() == 0 and time.time() < end:
        time.sleep(0.005)
    sock.close()
    r = client.completions.create(model="mlxspec", prompt="y = ", max_tokens=4, temperature=0)
    assert r.usage.completion_tokens >= 1
    assert wait_idle(server)
    assert server.metrics.cancels == cancels + 1


BAD = [
    ("/v1/completions", b"{not json", 400),
    ("/v1/completions", b"[1, 2]", 400),
    ("/v1/completions", {"max_tokens": 4}, 400),  # missing prompt
    ("/v1/completions", {"prompt": 42}, 400),
    ("/v1/completions", {"prompt": "x", "max_tokens": 0}, 400),
    ("/v1/completions", {"prompt": "x", "max_tokens": -3}, 400),
    ("/v1/completions", {"prompt": "x", "max_tokens": "ten"}, 400),
    ("/v1/completions", {"prompt": "x", "temperature": "hot"}, 400),
    ("/v1/completions", {"prompt": "x", "stop": 3}, 400),
    ("/v1/completions", {"prompt": "x", "speculative": {"mode": "telepathy"}}, 400),
    ("/v1/completions", {"prompt": "x", "speculative": {"num_draft": 0}}, 400),
    ("/v1/completions", {"prompt": "def f(): pass\n" * 400}, 400),  # longer than the context
    ("/v1/completions", {"prompt": [1, 2, 99999]}, 400),
    ("/v1/completions", {"prompt": "x", "model": "gpt-4o"}, 404),
    ("/v1/completions", {"prompt": "x", "suffix": 5}, 400),
    ("/v1/chat/completions", {"model": "mlxspec"}, 400),
    ("/v1/chat/completions", {"messages": [{"content": "no role"}]}, 400),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}],
                              "prediction": {"type": "content", "content": 7}}, 400),
    ("/infill", {"input_prefix": 3}, 400),
    ("/infill", {"input_extra": "not a list"}, 400),
    ("/v1/nope", {"prompt": "x"}, 404),
    ("/v1/completions", b"x" * (100 * 1024), 413),  # over --max-body-bytes
]


def test_bad_inputs_get_status_codes_and_server_keeps_serving(server, client, ref):
    for path, body, status in BAD:
        raw = body if isinstance(body, bytes) else None
        got, payload, _ = post(server.url, path, body, raw=raw)
        assert got == status, (path, body if raw is None else raw[:40], payload[:200])
        err = json.loads(payload)["error"]
        assert err["message"] and err["type"]
    # A chunked body (no Content-Length) is read and validated like any other.
    sock = socket.create_connection(server.server_address[:2], timeout=10)
    sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nTransfer-Encoding: chunked\r\n\r\n"
                 b"2\r\n{}\r\n0\r\n\r\n")
    answer = http.client.HTTPResponse(sock)
    answer.begin()
    assert answer.status == 400 and "'prompt' is required" in json.loads(answer.read())[
        "error"]["message"]
    sock.close()
    conn = http.client.HTTPConnection(*server.server_address[:2], timeout=10)
    conn.request("GET", "/v1/completions")
    assert conn.getresponse().status == 405
    conn.close()
    r = client.completions.create(model=server.config.model_name, prompt=CODE, max_tokens=24,
                                  temperature=0)
    assert r.choices[0].text == ref["code"].text
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="no-such-model", prompt="x", max_tokens=2)


def test_full_queue_gets_503(server, client, monkeypatch):
    monkeypatch.setattr(server.worker, "max_queue", 0)
    status, payload, _ = post(server.url, "/v1/completions", {"prompt": "x", "max_tokens": 2})
    assert status == 503 and json.loads(payload)["error"]["type"] == "server_busy"
    monkeypatch.undo()
    assert client.completions.create(model="mlxspec", prompt="x", max_tokens=2).usage


def test_metrics(server, client):
    client.completions.create(model="mlxspec", prompt=CODE, max_tokens=8, temperature=0)
    conn = http.client.HTTPConnection(*server.server_address[:2], timeout=10)
    conn.request("GET", "/metrics")
    resp = conn.getresponse()
    text = resp.read().decode()
    assert resp.status == 200 and resp.getheader("Content-Type").startswith("text/plain")
    for name in ("mlxspec_requests_total{", "mlxspec_prompt_tokens_total ",
                 "mlxspec_generated_tokens_total ", 'mlxspec_drafted_tokens_total{mode="ngram"}',
                 'mlxspec_accepted_tokens_total{mode="ngram"}',
                 "mlxspec_request_duration_seconds_bucket{", "mlxspec_requests_active "):
        assert name in text, name
    assert 'mlxspec_requests_total{endpoint="/v1/completions",code="200"}' in text


def test_model_without_fim_tokens_and_api_key(llama_pair):
    from conftest import make_engine

    engine = make_engine(llama_pair[0], "ngram")  # byte tokenizer: no FIM tokens
    srv = make_server(engine, "127.0.0.1", 0, api_key="sekret")
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    auth = {"Authorization": "Bearer sekret"}
    try:
        status, payload, _ = post(srv.url, "/v1/completions",
                               {"prompt": "def f(", "suffix": "):\n", "max_tokens": 4}, headers=auth)
        assert status == 400 and "fill-in-the-middle" in json.loads(payload)["error"]["message"]
        # llama.cpp's answer for a model without FIM tokens (editors match on it)
        status, payload, _ = post(srv.url, "/infill", llama_vim_body("a", "b", "c", []),
                                  headers=auth)
        error = json.loads(payload)["error"]
        assert status == 501 and error["type"] == "not_supported_error"
        assert error["message"].startswith("Infill is not supported by this model: prefix token")
        status, _, _ = post(srv.url, "/v1/completions", {"prompt": "abc", "max_tokens": 4})
        assert status == 401
        c = openai.OpenAI(base_url=srv.url + "/v1", api_key="sekret", max_retries=0)
        assert c.completions.create(model="mlxspec", prompt="abc", max_tokens=4).usage.completion_tokens == 4
        with pytest.raises(openai.AuthenticationError):
            openai.OpenAI(base_url=srv.url + "/v1", api_key="wrong", max_retries=0).models.list()
    finally:
        srv.shutdown()
        srv.server_close()


@pytest.mark.slow
def test_cli_serve_starts_on_loopback(model_dirs):
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "mlxspec.cli.main", "serve", "-m",
                             str(model_dirs["llama"]), "--port", str(port), "--cors-origin", "*"],
                            stderr=subprocess.PIPE, text=True)
    try:
        lines = []
        for line in proc.stderr:
            lines.append(line)
            if "listening on" in line:
                break
        assert f"listening on http://127.0.0.1:{port} (loopback only" in "".join(lines)
        assert "warning: --cors-origin '*'" in "".join(lines)
        status, payload, _ = post(f"http://127.0.0.1:{port}", "/v1/completions",
                               {"prompt": "def", "max_tokens": 3, "temperature": 0})
        assert status == 200 and json.loads(payload)["usage"]["completion_tokens"] == 3
    finally:
        proc.terminate()
        proc.wait(timeout=10)


def test_small_pieces():
    from mlxspec.cli.serve import parse_size
    from mlxspec.server.answers import pick_fields
    from mlxspec.stopstrings import TextStream

    assert parse_size("2GB") == 2 << 30 and parse_size("512mb") == 512 << 20
    assert parse_size("1000") == 1000
    body = {"content": "x", "timings": {"prompt_n": 3, "draft_n": 2}, "stop": True}
    assert pick_fields(body, ["content", "timings/prompt_n", "nope", ""]) == {
        "content": "x", "timings/prompt_n": 3}

    class Detok:  # one character per token
        def __init__(self):
            self.text, self.last_segment = "", ""

        def reset(self):
            self.text = ""

        def add_token(self, t):
            self.last_segment += chr(t)

        def finalize(self):
            pass

    class Tok:
        @property
        def detokenizer(self):
            return Detok()

    ts = TextStream(Tok(), ["END"])
    out = []
    for ch in "abcENxEND!":
        text, hit = ts.add(ord(ch))
        ts.detok.last_segment = ""
        out.append(text)
        if hit:
            break
    assert "".join(out) == "abcENx" and hit and ts.stopping_word == "END"


SEEDED = {"prompt": "I believe the meaning of life is", "n_predict": 8, "seed": 42,
          "temperature": 0.8}


@pytest.mark.slow
def test_a_seeded_request_answers_the_same_in_every_mode_and_beside_any_others():
    """llama.cpp's seeded request sent 4 times in each mode answers `none`'s text every time,
    alone and with 7 other requests (greedy, sampled, seeded, other modes) in flight; the
    server-wide --seed gives a request without one the same answer."""
    from server_helpers import post, start, stop

    engine = mlxspec.load(None, mode="auto")
    srv = start(engine)
    try:
        def ask(body):
            status, payload, _ = post(srv.url, "/completion", body)
            assert status == 200, payload
            return json.loads(payload)["content"]

        want = ask({**SEEDED, "speculative": {"mode": "none"}})
        for mode in ("none", "ngram", "draft", "lookahead", "suffix", "auto"):
            answers = [ask({**SEEDED, "speculative": {"mode": mode}}) for _ in range(4)]
            assert answers == [want] * 4, mode
        others = [{"prompt": f"def f{i}(x):\n    return", "n_predict": 6 + i,
                   "temperature": [0, 1.0, 0.7][i % 3], **({"seed": i} if i % 2 else {}),
                   "speculative": {"mode": ["ngram", "auto", "draft", "none"][i % 4]}}
                  for i in range(7)]
        bodies = [SEEDED] * 4 + others
        out = [None] * len(bodies)

        def run(i):
            out[i] = ask(bodies[i])

        threads = [threading.Thread(target=run, args=(i,)) for i in range(len(bodies))]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=120)
        assert out[:4] == [want] * 4
        assert all(o is not None for o in out)
    finally:
        stop(srv)
    seeded = start(engine, default_seed=42)
    try:
        body = {k: v for k, v in SEEDED.items() if k != "seed"}
        status, payload, _ = post(seeded.url, "/completion", body)
        assert json.loads(payload)["content"] == want
    finally:
        stop(seeded)
