"""Concurrent streaming clients against an OpenAI-compatible server (nibble serve, or any):
C clients at once, each one streamed chat completion of M tokens (ignore_eos) on its own prompt.
Prints one JSON line: aggregate decode tok/s (all completion tokens after each client's first,
over the time from the first client's first token to the last client's end), mean per-request
decode tok/s, mean and max time to first token, wall time.

    bench_serve_client.py BASE_URL CONCURRENCY MAX_TOKENS
"""
import http.client
import json
import sys
import threading
import time
import urllib.parse

base, conc, max_tokens = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
url = urllib.parse.urlparse(base)
TOPICS = ["the sea", "a mountain", "the city at night", "a library", "the desert", "a forest",
          "a train journey", "the moon", "a market", "winter", "a garden", "the river",
          "a lighthouse", "an old clock", "the harbour", "a storm"]


def one(i, out):
    c = http.client.HTTPConnection(url.hostname, url.port, timeout=3600)
    body = json.dumps({"messages": [{"role": "user", "content": f"Tell a story about {TOPICS[i % len(TOPICS)]}."}],
                       "max_tokens": max_tokens, "temperature": 0, "stream": True, "ignore_eos": True,
                       "stream_options": {"include_usage": True}})
    t0 = time.perf_counter()
    c.request("POST", url.path.rstrip("/") + "/chat/completions", body, {"Content-Type": "application/json"})
    r = c.getresponse()
    assert r.status == 200, r.read()
    first, tokens = None, 0
    for line in r:
        line = line.decode().strip()
        if not line.startswith("data: ") or line == "data: [DONE]":
            continue
        ev = json.loads(line[6:])
        if ev.get("usage"):
            tokens = ev["usage"]["completion_tokens"]
        elif first is None and ev["choices"] and ev["choices"][0]["delta"].get("content"):
            first = time.perf_counter()
    end = time.perf_counter()
    out[i] = {"start": t0, "first": first or end, "end": end, "tokens": tokens}


out = [None] * conc
threads = [threading.Thread(target=one, args=(i, out)) for i in range(conc)]
t0 = time.perf_counter()
for t in threads:
    t.start()
for t in threads:
    t.join()
wall = time.perf_counter() - t0
first = min(o["first"] for o in out)
last = max(o["end"] for o in out)
decoded = sum(o["tokens"] - 1 for o in out)
per = [(o["tokens"] - 1) / max(o["end"] - o["first"], 1e-9) for o in out]
ttft = [o["first"] - o["start"] for o in out]
print(json.dumps({"clients": conc, "tokens": sum(o["tokens"] for o in out),
                  "aggregate_tok_s": decoded / max(last - first, 1e-9),
                  "per_request_tok_s": sum(per) / len(per),
                  "ttft_mean_s": sum(ttft) / len(ttft), "ttft_max_s": max(ttft), "wall_s": wall}))
