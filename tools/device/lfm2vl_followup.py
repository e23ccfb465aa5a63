#!/usr/bin/env python3
"""A chat's follow-up turn over HTTP: the prefix cache's worth to the first token.

Starts `tessera serve` on a model, then for each of N conversations sends a first turn whose
user message holds ~HISTORY tokens of text and, once it is answered, the follow-up: the same
history, the reply, and a new user message of ~20 tokens. Each request is non-streamed with
`max_tokens: 1`, so its round trip is the time to its first (only) token; the reply's
`usage.prompt_tokens_details.cached_tokens` says how much of the prompt came from the cache.
Prints one table (median and range of the round trips, prompt and cached tokens) and the
server's `/metrics` hit counters. Python's standard library only.

  lfm2vl_followup.py --bin .dev/bin/tessera --model /tmp/lfm2full [--device cuda] [--n 8]
                     [--history 2000]
"""
import argparse
import http.client
import json
import statistics
import subprocess
import sys
import time


def request(port, method, path, body=None, timeout=120):
    c = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
    headers = {"content-type": "application/json"} if body is not None else {}
    c.request(method, path, body=json.dumps(body) if body is not None else None, headers=headers)
    r = c.getresponse()
    data = r.read()
    c.close()
    return r.status, data


def chat(port, model, messages):
    body = {"model": model, "messages": messages, "max_tokens": 1, "temperature": 0}
    t = time.perf_counter()
    status, data = request(port, "POST", "/v1/chat/completions", body)
    ms = (time.perf_counter() - t) * 1e3
    if status != 200:
        sys.exit(f"chat: HTTP {status}: {data[:300]!r}")
    r = json.loads(data)
    u = r["usage"]
    return ms, r["choices"][0]["message"]["content"], u["prompt_tokens"], u["prompt_tokens_details"]["cached_tokens"]


def metric(port, name):
    _, data = request(port, "GET", "/metrics")
    for line in data.decode().splitlines():
        if line.startswith(name + " ") or line.startswith(name + "{"):
            return float(line.rsplit(" ", 1)[1])
    return float("nan")


# The server's own clocks (seconds summed over requests; the chat lane's queue wait).
SERVER = {
    "ttft": "tessera_chat_time_to_first_token_seconds_sum",
    "queue": 'tessera_queue_duration_seconds_sum{lane="chat"}',
    "step": "tessera_chat_step_duration_seconds_sum",
}


def server_clocks(port):
    """The server's summed clocks now, so that one request's share is a difference."""
    _, data = request(port, "GET", "/metrics")
    out = dict.fromkeys(SERVER, float("nan"))
    for line in data.decode().splitlines():
        for key, name in SERVER.items():
            if line.startswith(name + " "):
                out[key] = float(line.rsplit(" ", 1)[1])
    return out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--bin", default=".dev/bin/tessera")
    ap.add_argument("--model", required=True)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--port", type=int, default=18431)
    ap.add_argument("--n", type=int, default=8, help="conversations (the first is a warm-up)")
    ap.add_argument("--ready-s", type=float, default=150, help="seconds to wait for the server")
    ap.add_argument("--history", type=int, default=2000,
                    help="prompt tokens of the first turn (words scaled after the warm-up to reach it)")
    args = ap.parse_args()
    cmd = [args.bin, "serve", "--model", args.model, "--device", args.device, "--port", str(args.port)]
    server = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        # Ready once /health answers 200 (the first start on a machine compiles the kernels).
        started = time.perf_counter()
        while True:
            try:
                if request(args.port, "GET", "/health", timeout=2)[0] == 200:
                    break
            except OSError:
                pass
            if server.poll() is not None:
                sys.exit("server exited: " + server.stderr.read()[-2000:])
            if time.perf_counter() - started > args.ready_s:
                sys.exit(f"server not ready in {args.ready_s} s")
            time.sleep(0.1)
        print(f"server ready after {time.perf_counter() - started:.1f} s", flush=True)
        model = json.loads(request(args.port, "GET", "/v1/models")[1])["data"][0]["id"]
        words = "the quick brown fox jumps over a lazy dog while seven cats watch".split()
        first, follow, inside = [], [], []
        n_words = args.history // 2
        for i in range(args.n):
            history = f"Notes {i}: " + " ".join(words[(i + k) % len(words)] for k in range(n_words))
            m1 = [{"role": "user", "content": history}]
            ms1, reply, p1, c1 = chat(args.port, model, m1)
            m2 = m1 + [
                {"role": "assistant", "content": reply},
                {"role": "user", "content": "Summarise the notes above in one short sentence, please, for the report."},
            ]
            before = server_clocks(args.port)
            ms2, _, p2, c2 = chat(args.port, model, m2)
            after = server_clocks(args.port)
            inside.append({k: (after[k] - before[k]) * 1e3 for k in SERVER})
            if i > 0:  # the first conversation warms up the server
                first.append((ms1, p1, c1))
                follow.append((ms2, p2, c2))
            else:  # and tells how many tokens a word takes
                n_words = max(1, round(n_words * args.history / p1))
        hit = metric(args.port, "tessera_chat_prefix_cache_hit_tokens_total")
        total = metric(args.port, "tessera_chat_prompt_tokens_total")
    finally:
        server.terminate()
        server.wait(timeout=30)

    def row(name, runs):
        ms = [r[0] for r in runs]
        med = statistics.median(ms)
        print(f"{name:>26} {med:8.3f} ms ({min(ms):.3f}–{max(ms):.3f}) "
              f"prompt {statistics.median([r[1] for r in runs]):.0f} tokens, "
              f"cached {statistics.median([r[2] for r in runs]):.0f}")

    print(f"LFM2-VL chat over HTTP ({args.model}, {args.device}), {len(first)} conversations after a warm-up;"
          " round trip of a non-streamed request with max_tokens 1:")
    row("first turn (cold)", first)
    row("follow-up (+ ~20 tokens)", follow)
    print(f"/metrics: {hit:.0f} of {total:.0f} prompt tokens from the prefix cache")
    # Where a follow-up's round trip goes, by the server's clocks: from the handler's start to
    # the first text (ttft), of which waiting in the queue and the device steps (the prefill).
    parts = "  ".join(
        f"{k} {statistics.median(d[k] for d in inside[1:]):.3f} ms" for k in SERVER)
    print(f"follow-up by the server's clocks (medians): {parts}")


if __name__ == "__main__":
    main()
