#!/usr/bin/env python3
"""What users get: drives a running minimax-gateway over HTTP and prints a table.

Measures, through /v1/completions with streaming (SSE) and `ignore_eos` so every request
decodes exactly the asked number of tokens:
  - batch-1 decode tok/s for a 5-token prompt and a 100-token decode (the headline figure),
  - TTFT (time to first token) for prompts of 512, 513, 8192 and 32768 tokens (those that fit
    the served context), which is prefill time plus one decode step, as users see it,
  - aggregate decode tok/s and p50/p99 inter-token latency at 1, 4, 16 and 32 concurrent streams.
Prompts are token-id arrays (random ids, fixed seed) so the prompt length is exact; each
prompt differs from the others in its first token, so the prefix cache does not shorten them.

Requests are greedy unless `--sampling default` (the server's sampling defaults: MiniMax's
temperature 1, top_p 0.95, top_k 40, what most clients get).

Standard library only, so it runs on any machine with Python 3. Example:
  tools/bench/http_bench.py --url http://127.0.0.1:8000 --streams 1,4,16,32
"""

import argparse
import http.client
import json
import random
import statistics
import sys
import threading
import time
import urllib.parse
import urllib.request


# What each request asks for: greedy (temperature 0), or the server's defaults (MiniMax's
# recommended temperature 1, top_p 0.95, top_k 40), set by --sampling.
SAMPLING = {"temperature": 0}


def stream_completion(url, api_key, prompt, max_tokens, timeout, extra=None, usage=None):
    """Runs one streamed completion; returns (t_start, [arrival time of each token chunk]).
    `extra`: more request fields (they override the defaults); `usage`: a dict the stream's
    usage object is stored into, when the server sends one."""
    u = urllib.parse.urlparse(url)
    conn = http.client.HTTPConnection(u.hostname, u.port or 80, timeout=timeout)
    body = json.dumps({
        "prompt": prompt,
        "max_tokens": max_tokens,
        "stream": True,
        "ignore_eos": True,
        **SAMPLING,
        **(extra or {}),
    })
    headers = {"Content-Type": "application/json"}
    if api_key:
        headers["Authorization"] = f"Bearer {api_key}"
    t0 = time.perf_counter()
    conn.request("POST", "/v1/completions", body=body, headers=headers)
    resp = conn.getresponse()
    if resp.status != 200:
        raise RuntimeError(f"HTTP {resp.status}: {resp.read()[:300]!r}")
    arrivals = []
    for raw in resp:
        line = raw.decode("utf-8", "replace").strip()
        if not line.startswith("data: "):
            continue
        data = line[6:]
        if data == "[DONE]":
            break
        ev = json.loads(data)
        if "error" in ev:
            raise RuntimeError(f"stream error: {ev['error']}")
        if usage is not None and ev.get("usage"):
            usage.update(ev["usage"])
        for ch in ev.get("choices", []):
            if ch.get("text") or ch.get("finish_reason") is None:
                arrivals.append(time.perf_counter())
    conn.close()
    return t0, arrivals


def model_info(url, api_key):
    u = urllib.parse.urlparse(url)
    conn = http.client.HTTPConnection(u.hostname, u.port or 80, timeout=30)
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    conn.request("GET", "/v1/models", headers=headers)
    resp = conn.getresponse()
    models = json.loads(resp.read())["data"]
    conn.close()
    return models[0]


def prompt_ids(rng, n, vocab, salt):
    ids = [rng.randrange(1, vocab) for _ in range(n)]
    ids[0] = 1 + (salt % (vocab - 1))
    return ids


STEP_COUNTERS = ("minimax_steps_total", "minimax_step_tokens_total", "minimax_step_seconds_total",
                 "minimax_step_rank_compute_seconds_total", "minimax_step_gap_seconds_total")


def step_counters(url, api_key):
    """The gateway's step-time counters (zeros if it does not export them)."""
    req = urllib.request.Request(url + "/metrics", headers={"Authorization": f"Bearer {api_key}"} if api_key else {})
    with urllib.request.urlopen(req, timeout=10) as r:
        text = r.read().decode()
    vals = {}
    for line in text.splitlines():
        parts = line.split()
        if len(parts) == 2 and parts[0] in STEP_COUNTERS:
            vals[parts[0]] = float(parts[1])
    return [vals.get(k, 0.0) for k in STEP_COUNTERS]


def step_row(label, before, after):
    """Where the served steps' time went between two scrapes: per step, the rank's compute,
    the rest of the round trip (gRPC, agreement) and the engine's own serial work."""
    d = [b - a for a, b in zip(before, after)]
    steps = d[0]
    if steps <= 0:
        return None
    ms = lambda x: x / steps * 1000
    return (f"{label}: steps, tokens/step, ms/step rank compute / rest of round trip / engine gap",
            f"{steps:.0f}, {d[1] / steps:.1f}, {ms(d[3]):.2f} / {ms(d[2] - d[3]):.2f} / {ms(d[4]):.2f}")


def pct(xs, p):
    if not xs:
        return float("nan")
    xs = sorted(xs)
    k = min(len(xs) - 1, max(0, int(round(p / 100 * (len(xs) - 1)))))
    return xs[k]


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--url", default="http://127.0.0.1:8000")
    ap.add_argument("--api-key", default=None)
    ap.add_argument("--vocab", type=int, default=None, help="token ids are drawn below this (default: 1000 for the demo model, else 150000)")
    ap.add_argument("--decode-tokens", type=int, default=100)
    ap.add_argument("--prefill", default="512,513,8192,32768")
    ap.add_argument("--streams", default="1,4,16,32")
    ap.add_argument("--stream-tokens", default="64", help="tokens each concurrent stream decodes; a comma list runs the stream rounds once for each (e.g. 32,128)")
    ap.add_argument("--timeout", type=float, default=600)
    ap.add_argument("--sampling", choices=["greedy", "default"], default="greedy",
                    help="greedy (temperature 0), or the server's default sampling (no sampling fields sent: MiniMax's temperature 1, top_p 0.95, top_k 40)")
    ap.add_argument("--structured", type=int, default=0, help="tokens of the structured-output round: batch-1 greedy streams constrained by a JSON schema (an array of integers: a small allowed set every token; a long string: nearly every token allowed) against an unconstrained one (0: skip)")
    ap.add_argument("--mixed", type=int, default=0, help="prompt length of the mixed-load round: an N-token prompt arrives while 4 streams decode; its TTFT and the streams' inter-token gaps during its prefill (0: skip)")
    a = ap.parse_args()
    global SAMPLING
    SAMPLING = {"temperature": 0} if a.sampling == "greedy" else {}

    info = model_info(a.url, a.api_key)
    ctx = int(info.get("context_length") or info.get("max_model_len") or 4096)
    vocab = a.vocab or (1000 if ctx <= 4096 else 150000)
    rng = random.Random(1234)
    salt = [0]

    def next_prompt(n):
        salt[0] += 1
        return prompt_ids(rng, n, vocab, salt[0])

    rows = []
    # Warm-up (kernel compilation, graph capture).
    stream_completion(a.url, a.api_key, next_prompt(5), 8, a.timeout)

    c0 = step_counters(a.url, a.api_key)
    t0, arr = stream_completion(a.url, a.api_key, next_prompt(5), a.decode_tokens, a.timeout)
    r = step_row("batch 1", c0, step_counters(a.url, a.api_key))
    if len(arr) >= 2:
        rate = (len(arr) - 1) / (arr[-1] - arr[0])
        rows.append((f"decode tok/s, batch 1, 5-token prompt, {a.decode_tokens} tokens", f"{rate:.1f}"))
        rows.append(("TTFT, 5-token prompt (ms)", f"{(arr[0] - t0) * 1000:.1f}"))
    if r:
        rows.append(r)

    for n in [int(x) for x in a.prefill.split(",") if x]:
        if n + 2 > ctx:
            rows.append((f"TTFT, {n}-token prompt", f"skipped (context {ctx})"))
            continue
        t0, arr = stream_completion(a.url, a.api_key, next_prompt(n), 2, a.timeout)
        if not arr:  # no chunk with text (a tokenizer smaller than the model's vocabulary)
            rows.append((f"TTFT, {n}-token prompt", "no text chunk"))
            continue
        ttft = arr[0] - t0
        rows.append((f"TTFT, {n}-token prompt (ms) / prefill tok/s", f"{ttft * 1000:.1f} / {n / ttft:.0f}"))

    lengths = [int(x) for x in str(a.stream_tokens).split(",") if x]
    rounds = [(s, n) for n in lengths for s in [int(x) for x in a.streams.split(",") if x]]
    for s, ntok in rounds:
        results = [None] * s
        errors = []
        # With several round lengths each row names its length.
        what = f"{s} streams" if len(lengths) == 1 else f"{s} streams x {ntok} tokens"

        def worker(i, prompt):
            try:
                results[i] = stream_completion(a.url, a.api_key, prompt, ntok, a.timeout)
            except Exception as e:  # reported below; a failed stream fails the benchmark
                errors.append(e)

        prompts = [next_prompt(5) for _ in range(s)]
        threads = [threading.Thread(target=worker, args=(i, prompts[i])) for i in range(s)]
        c0 = step_counters(a.url, a.api_key)
        start = time.perf_counter()
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        joined = time.perf_counter()
        if errors:
            # Keep what was measured: print the table so far, then fail.
            print(f"error at {what}: {errors[0]}", file=sys.stderr)
            rows.append((what, f"FAILED: {str(errors[0])[:120]}"))
            print_table(info, ctx, a.url, rows)
            sys.exit(1)
        end = max((r[1][-1] for r in results if r[1]), default=time.perf_counter())
        tokens = sum(len(r[1]) for r in results)
        itl = [b - a_ for r in results for a_, b in zip(r[1], r[1][1:])]
        rows.append((f"{what}: aggregate tok/s, ITL p50 / p99 (ms)",
                     f"{tokens / (end - start):.1f}, {pct(itl, 50) * 1000:.1f} / {pct(itl, 99) * 1000:.1f}"))
        # Every stream decodes exactly ntok tokens (ignore_eos): tokens over the wall time of
        # the whole round, whether or not every token's chunk carries text.
        rows.append((f"{what}: {s * ntok} tokens / wall time of the round (tok/s)", f"{s * ntok / (joined - start):.1f}"))
        r = step_row(what, c0, step_counters(a.url, a.api_key))
        if r:
            rows.append(r)

    if a.mixed and a.mixed + 2 <= ctx:
        rows.extend(mixed_round(a, next_prompt))
    if a.structured:
        rows.extend(structured_round(a, next_prompt))

    print_table(info, ctx, a.url, rows)


def mixed_round(a, next_prompt):
    """Chunked prefill under load: 4 streams decode 300 tokens each; 0.5 s in, an a.mixed-token
    prompt arrives. Returns its TTFT and the decoding streams' inter-token gaps that end while it
    is being prefilled (what the prefill chunk size trades against TTFT)."""
    results, errors = [None] * 4, []

    def worker(i, prompt):
        try:
            results[i] = stream_completion(a.url, a.api_key, prompt, 300, a.timeout)
        except Exception as e:
            errors.append(e)

    threads = [threading.Thread(target=worker, args=(i, next_prompt(5))) for i in range(4)]
    for t in threads:
        t.start()
    time.sleep(0.5)
    t0, arr = stream_completion(a.url, a.api_key, next_prompt(a.mixed), 2, a.timeout)
    for t in threads:
        t.join()
    if errors or not arr:
        return [(f"mixed: {a.mixed}-token prompt while 4 streams decode", f"FAILED: {errors[0] if errors else 'no text chunk'}")]
    first = arr[0]
    gaps = [b - a_ for r in results for a_, b in zip(r[1], r[1][1:]) if t0 <= b <= first + 0.05]
    before = [b - a_ for r in results for a_, b in zip(r[1], r[1][1:]) if b < t0]
    return [
        (f"mixed: TTFT of a {a.mixed}-token prompt while 4 streams decode (ms)", f"{(first - t0) * 1000:.1f}"),
        ("mixed: decoding streams' inter-token gap during that prefill, p50 / max (ms); before it, p50",
         f"{pct(gaps, 50) * 1000:.1f} / {max(gaps, default=float('nan')) * 1000:.1f}; {pct(before, 50) * 1000:.1f}"),
    ]


# The structured-output round's documents: long enough that the model cannot end them early.
STRUCTURED = [
    ("integers", {"type": "array", "items": {"type": "integer"}, "minItems": 4000}),
    ("string", {"type": "object", "properties": {"t": {"type": "string", "minLength": 20000}}, "required": ["t"]}),
]


def structured_round(a, next_prompt):
    """Batch-1 greedy decode of a.structured tokens, unconstrained and then under each schema of
    STRUCTURED (response_format json_schema on /v1/completions: the document starts at the first
    token). Per-token time from the stream's arrivals and its usage; the gateway's step split
    shows where a constrained step's extra time goes (the mask is made in the engine's gap)."""
    rows = []
    cases = [("unconstrained", None)] + [(n, {"type": "json_schema", "json_schema": {"name": n, "schema": sch}}) for n, sch in STRUCTURED]
    for name, fmt in cases:
        usage = {}
        extra = {"stream_options": {"include_usage": True}}
        if fmt:
            extra.update({"response_format": fmt, "ignore_eos": False})
        c0 = step_counters(a.url, a.api_key)
        try:
            t0, arr = stream_completion(a.url, a.api_key, next_prompt(5), a.structured, a.timeout, extra, usage)
        except Exception as e:
            rows.append((f"structured ({name})", f"FAILED: {str(e)[:120]}"))
            continue
        r = step_row(f"structured ({name})", c0, step_counters(a.url, a.api_key))
        n = usage.get("completion_tokens", len(arr))
        if len(arr) >= 2:
            rows.append((f"structured ({name}): decode tok/s, batch 1, {n} tokens", f"{(n - 1) / (arr[-1] - arr[0]):.1f}"))
        if r:
            rows.append(r)
    return rows


def print_table(info, ctx, url, rows):
    w = max(len(r[0]) for r in rows)
    how = "greedy" if SAMPLING else "server-default sampling (temperature 1, top_p 0.95, top_k 40)"
    print(f"model {info['id']}, context {ctx}, {url}, {how}")
    print(f"| {'metric'.ljust(w)} | value |")
    print(f"| {'-' * w} | ----- |")
    for k, v in rows:
        print(f"| {k.ljust(w)} | {v} |")


if __name__ == "__main__":
    main()
