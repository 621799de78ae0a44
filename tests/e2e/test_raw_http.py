"""Raw HTTP against the real gateway: SSE framing, equality, stop strings, n, batches,
concurrency, disconnect cancellation, and 4xx handling."""

import concurrent.futures
import http.client
import json
import math
import socket
import time


def request(server, method, path, body=None, headers=None, raw=None):
    conn = http.client.HTTPConnection(server.host, server.port, timeout=120)
    h = {"Authorization": f"Bearer {server.api_key}", "Content-Type": "application/json"}
    h.update(headers or {})
    data = raw if raw is not None else (json.dumps(body) if body is not None else None)
    conn.request(method, path, body=data, headers=h)
    r = conn.getresponse()
    out = r.status, dict(r.getheaders()), r.read().decode()
    conn.close()
    return out


def raw_post(server, path, data):
    """POST over a plain socket; the server may answer (413) and close before the body is sent."""
    sock = socket.create_connection((server.host, server.port), timeout=30)
    head = (
        f"POST {path} HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {server.api_key}\r\n"
        f"Content-Type: application/json\r\nContent-Length: {len(data)}\r\nConnection: close\r\n\r\n"
    )
    try:
        sock.sendall(head.encode() + data)
    except (BrokenPipeError, ConnectionResetError):
        pass
    resp = b""
    try:
        while True:
            chunk = sock.recv(65536)
            if not chunk:
                break
            resp += chunk
    except ConnectionResetError:
        pass
    sock.close()
    head, _, body = resp.partition(b"\r\n\r\n")
    return int(head.split(b" ")[1]), body.decode()


def post(server, path, body):
    s, _, b = request(server, "POST", path, body)
    return s, json.loads(b)


def sse(body):
    """Checks OpenAI framing and returns the data payloads."""
    assert body.endswith("\n\n")
    events = []
    for block in body.split("\n\n")[:-1]:
        assert block.startswith("data: "), block
        assert "\n" not in block, block
        events.append(block[len("data: "):])
    return events


def chat(content, **kw):
    return {"model": "m2-small", "messages": [{"role": "user", "content": content}], **kw}


def assemble(events):
    assert events[-1] == "[DONE]"
    out = {}
    for e in events[:-1]:
        c = json.loads(e)
        for ch in c["choices"]:
            slot = out.setdefault(ch["index"], {"content": "", "reasoning": "", "finish": None, "first": ch["delta"]})
            slot["content"] += ch["delta"].get("content") or ""
            slot["reasoning"] += ch["delta"].get("reasoning_content") or ""
            if ch["finish_reason"]:
                assert slot["finish"] is None
                slot["finish"] = ch["finish_reason"]
    return out


def test_sse_framing_and_stream_equals_non_stream(server):
    body = chat("Tell me something", max_tokens=16, seed=1234)
    s, full = post(server, "/v1/chat/completions", body)
    assert s == 200
    s, headers, text = request(server, "POST", "/v1/chat/completions", dict(body, stream=True))
    assert s == 200
    assert headers["content-type"].startswith("text/event-stream")
    got = assemble(sse(text))[0]
    assert got["first"] == {"role": "assistant", "content": ""}
    msg = full["choices"][0]["message"]
    assert got["content"] == msg["content"]
    assert got["reasoning"] == (msg.get("reasoning_content") or "")
    assert got["finish"] == full["choices"][0]["finish_reason"]


def test_replayed_reasoning_streams_identically(server):
    body = chat("REPLAY:reason what?")
    _, full = post(server, "/v1/chat/completions", body)
    _, _, text = request(server, "POST", "/v1/chat/completions", dict(body, stream=True))
    got = assemble(sse(text))[0]
    assert got["reasoning"] == full["choices"][0]["message"]["reasoning_content"] == "Two plus two is four.\nNo doubt."
    assert got["content"] == full["choices"][0]["message"]["content"]


def test_stop_strings_split_across_tokens(server):
    # Scripted text: "a STO" spans at least two tokens.
    for stream in (False, True):
        body = chat("REPLAY:stop go", stop=["a STO", "zzz"], stream=stream)
        s, _, text = request(server, "POST", "/v1/chat/completions", body)
        assert s == 200
        if stream:
            got = assemble(sse(text))[0]
            content, finish = got["content"], got["finish"]
        else:
            c = json.loads(text)["choices"][0]
            content, finish = c["message"]["content"], c["finish_reason"]
        assert content == "alpha bet"
        assert finish == "stop"
    # On the model's own (noise) output: cut at a substring spanning a token boundary.
    base = {"prompt": "The quick brown fox", "max_tokens": 24, "temperature": 0, "ignore_eos": True}
    _, r = post(server, "/v1/completions", dict(base, logprobs=0))
    text = r["choices"][0]["text"]
    toks = r["choices"][0]["logprobs"]["tokens"]
    # Token strings may hold partial UTF-8 (shown as U+FFFD); use a boundary between whole ones.
    stop = None
    for k in range(1, len(toks)):
        prefix = "".join(toks[:k])
        a, b = toks[k - 1], toks[k]
        if text.startswith(prefix) and "\ufffd" not in a + b and a.strip() and b.strip():
            stop = a[-2:] + b[:2]
            break
    if stop:
        _, r2 = post(server, "/v1/completions", dict(base, stop=[stop]))
        assert r2["choices"][0]["text"] == text[: text.index(stop)]
        assert r2["choices"][0]["finish_reason"] == "stop"


def test_n_and_batches_match_single_requests(server):
    s, r = post(server, "/v1/completions", {"prompt": ["Hello", "World"], "n": 2, "max_tokens": 6, "seed": 50, "ignore_eos": True})
    assert s == 200
    assert [c["index"] for c in r["choices"]] == [0, 1, 2, 3]
    for pi, prompt in enumerate(["Hello", "World"]):
        for i in range(2):
            _, single = post(server, "/v1/completions", {"prompt": prompt, "max_tokens": 6, "seed": 50 + i, "ignore_eos": True})
            assert r["choices"][pi * 2 + i]["text"] == single["choices"][0]["text"]
    s, r = post(server, "/v1/chat/completions", chat("n please", n=3, max_tokens=5, seed=7))
    assert s == 200 and [c["index"] for c in r["choices"]] == [0, 1, 2]
    assert r["usage"]["completion_tokens"] <= 15


def test_concurrent_requests_equal_sequential(server):
    bodies = [{"prompt": f"request number {i}", "max_tokens": 8, "seed": i, "ignore_eos": True} for i in range(32)]
    seq = [post(server, "/v1/completions", b)[1]["choices"][0]["text"] for b in bodies]
    with concurrent.futures.ThreadPoolExecutor(max_workers=32) as ex:
        results = list(ex.map(lambda b: post(server, "/v1/completions", b), bodies))
    for (s, r), want in zip(results, seq):
        assert s == 200
        assert r["choices"][0]["text"] == want


def wait_for(pred, timeout=20.0):
    deadline = time.time() + timeout
    while time.time() < deadline:
        if pred():
            return True
        time.sleep(0.2)
    return False


def test_disconnect_cancels_and_frees_pages(server):
    before = server.metrics()
    body = json.dumps({"prompt": "keep going", "max_tokens": 3000, "stream": True, "ignore_eos": True, "temperature": 0})
    sock = socket.create_connection((server.host, server.port), timeout=30)
    req = (
        f"POST /v1/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {server.api_key}\r\n"
        f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n{body}"
    )
    sock.sendall(req.encode())
    got = b""
    while got.count(b"data: ") < 3:
        chunk = sock.recv(4096)
        assert chunk, "server closed early"
        got += chunk
    assert server.metrics()["minimax_running_sequences"] >= 1
    sock.close()
    assert wait_for(lambda: server.metrics()["minimax_running_sequences"] == 0), server.metrics()
    after = server.metrics()
    assert after["minimax_kv_pages_used"] == 0, after
    assert after["minimax_requests_cancelled_total"] >= before.get("minimax_requests_cancelled_total", 0) + 1
    # The server keeps serving.
    s, _ = post(server, "/v1/completions", {"prompt": "still there?", "max_tokens": 2})
    assert s == 200


def test_bad_requests_get_4xx_and_server_keeps_serving(server):
    s, _, b = request(server, "POST", "/v1/chat/completions", raw="{not json")
    assert s == 400 and json.loads(b)["error"]["type"] == "invalid_request_error"
    s, r = post(server, "/v1/chat/completions", {"messages": "nope"})
    assert s == 400 and r["error"]["param"] == "messages"
    s, r = post(server, "/v1/chat/completions", chat("x", max_tokens="ten"))
    assert s == 400 and r["error"]["param"] == "max_tokens"
    s, r = post(server, "/v1/completions", {"prompt": "x", "echo": True})
    assert s == 400 and r["error"]["param"] == "echo"
    huge = json.dumps(chat("y" * (server.body_limit + 10))).encode()
    s, b = raw_post(server, "/v1/chat/completions", huge)
    assert s == 413 and json.loads(b)["error"]["code"] == "request_too_large"
    s, _, b = request(server, "GET", "/v1/unknown")
    assert s == 404 and "error" in json.loads(b)
    s, _, _ = request(server, "GET", "/v1/models", headers={"Authorization": "Bearer nope"})
    assert s == 401
    s, r = post(server, "/v1/chat/completions", chat("ok?", max_tokens=2))
    assert s == 200 and r["choices"][0]["message"]["role"] == "assistant"


def test_perplexity(server):
    s, r = post(server, "/v1/perplexity", {"model": "m2-small", "prompt": ["The cat sat on the mat", [1, 2, 3, 4]]})
    assert s == 200, r
    for d in r["data"]:
        assert d["logprobs"][0] is None
        assert len(d["logprobs"]) == len(d["tokens"])
        assert all(x <= 0 for x in d["logprobs"][1:])
        assert math.isclose(d["perplexity"], math.exp(d["nll"] / (len(d["tokens"]) - 1)), rel_tol=1e-4)


def test_health_and_metrics(server):
    s, _, b = request(server, "GET", "/health", headers={"Authorization": ""})
    assert s == 200 and json.loads(b)["status"] == "ok"
    m = server.metrics()
    for k in [
        "minimax_queue_depth",
        "minimax_running_sequences",
        "minimax_kv_pages_used",
        "minimax_kv_pages_free",
        "minimax_prefix_cache_hit_ratio",
        "minimax_rank_restarts_total",
        "minimax_time_to_first_token_seconds_count",
        "minimax_inter_token_latency_seconds_count",
        "minimax_generation_tokens_total",
    ]:
        assert k in m, k
    assert any(k.startswith('minimax_requests_total{endpoint="/v1/chat/completions",status="200"}') for k in m)


def test_prefix_cache_reuse_reported(server):
    long_system = "You are a helpful assistant. " * 40
    body = {"model": "m2-small", "max_tokens": 2, "messages": [{"role": "system", "content": long_system}, {"role": "user", "content": "first"}]}
    post(server, "/v1/chat/completions", body)
    body["messages"][1]["content"] = "second"
    _, r = post(server, "/v1/chat/completions", body)
    assert r["usage"]["prompt_tokens_details"]["cached_tokens"] > 0, r["usage"]
