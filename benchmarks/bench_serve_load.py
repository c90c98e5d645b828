"""The endpoint under load: does a huge request stall the others? (consequence.serve, issue 36).

A thread polls ``GET /health`` on its own keep-alive connection every 10 ms while one large
chat-completions request is sent to the same server (bundled tiny model, 127.0.0.1); the
table gives the large request's status and wall time, and the /health latencies measured
while it was in flight (median, 99th percentile, maximum). Cases:

1. ``idle``: /health alone (the baseline);
2. ``5 MB, default limit``: a 5 MB message against ``--max-body-bytes`` 4 MiB: a 413 before
   the body is decoded;
3. ``5 MB, limit 16 MiB``: the same message let through the limit: refused as
   ``context_length_exceeded`` before tokenising (no token covers more than the vocabulary's
   longest token, so 5 M characters cannot fit 1024 tokens);
4. ``3 MB tokenised``: a 3 MB message with the context length set to 131072 (as for a
   long-context model), so that the text passes that bound and is tokenised in full, off the
   event loop, then refused by its exact token count. The worker thread releases the GIL
   while the tokenizer runs, but not while ``tokenizers`` turns its 2 M ids into a Python list
   (one call, ~0.1 s unloaded): the longest /health wait here is that call;
5. ``32 concurrent calls``: /health while 32 ordinary calls are sampled (48 tokens each).

Before issue 36 the 5 MB message took 9 s to be refused and /health waited 7-10 s meanwhile.
Prints a table and writes ``benchmarks/results/bench_serve_load.json`` (atomically).

Run: ``python benchmarks/bench_serve_load.py``.
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import platform
import statistics
import threading
import time
from pathlib import Path

import torch

from consequence.harness.renderer import Renderer
from consequence.policy.tiny import load_policy
from consequence.serve.app import BackgroundServer, ServeSettings, create_app, model_context_length

BUNDLED = Path(__file__).resolve().parent.parent / "consequence" / "assets" / "tiny-repair"
POLL_S = 0.01
BUDGET_MS = 100.0  # the target: /health stays under this while a large request is handled


class HealthPoller(threading.Thread):
    """Polls ``GET /health`` on one keep-alive connection; keeps (start time, latency s) of each."""

    def __init__(self, port: int):
        super().__init__(daemon=True)
        self.port, self.samples, self.stop = port, [], threading.Event()

    def run(self) -> None:
        conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=60)
        while not self.stop.is_set():
            t0 = time.perf_counter()
            conn.request("GET", "/health")
            conn.getresponse().read()
            self.samples.append((t0, time.perf_counter() - t0))
            time.sleep(POLL_S)
        conn.close()


def _post(port: int, path: str, body: bytes) -> tuple[int, str]:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=600)
    conn.request("POST", path, body, {"Content-Type": "application/json"})
    r = conn.getresponse()
    text = r.read().decode()
    conn.close()
    code = json.loads(text).get("error", {}).get("code") if r.status >= 400 else "ok"
    return r.status, code or ""


def _body(chars: int) -> bytes:
    text = ("hello world " * (chars // 12 + 1))[:chars]
    return json.dumps({"model": "tiny", "messages": [{"role": "user", "content": text}], "max_tokens": 8}).encode()


def measure(model, tok, case: str, max_body: int, max_context: int, send) -> dict:
    """Serve with these limits, poll /health, run ``send(port)``; the case's row."""
    settings = ServeSettings("tiny", max_context, max_tokens=48, max_body_bytes=max_body)
    with BackgroundServer(create_app(model, Renderer(tok, []), settings)) as server:
        _post(server.port, "/v1/chat/completions", _body(20))  # warm-up: first-request costs out of the timing
        poller = HealthPoller(server.port)
        poller.start()
        time.sleep(0.3)
        t0 = time.perf_counter()
        status, code = send(server.port)
        wall = time.perf_counter() - t0
        time.sleep(0.1)
        poller.stop.set()
        poller.join()
    during = [lat * 1000 for start, lat in poller.samples if t0 <= start <= t0 + wall] or [0.0]
    during.sort()
    return {
        "case": case,
        "status": status,
        "code": code,
        "request_wall_s": round(wall, 3),
        "health_polls": len(during),
        "health_median_ms": round(statistics.median(during), 2),
        "health_p99_ms": round(during[min(len(during) - 1, int(0.99 * len(during)))], 2),
        "health_max_ms": round(max(during), 2),
    }


def _concurrent(port: int) -> tuple[int, str]:
    out: list[tuple[int, str]] = []
    threads = [
        threading.Thread(target=lambda k=k: out.append(_post(port, f"/s/load-{k}/v1/chat/completions", _body(40))))
        for k in range(32)
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return (200, "ok") if all(s == 200 for s, _ in out) else (max(s for s, _ in out), "some failed")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", type=Path, default=Path(__file__).parent / "results" / "bench_serve_load.json")
    args = ap.parse_args()
    torch.set_num_threads(max(1, os.cpu_count() or 2))
    load = os.getloadavg()
    model, tok = load_policy(BUNDLED)
    ctx = model_context_length(model)
    five_mb, three_mb = _body(5_000_000), _body(3_000_000)
    rows = [
        measure(model, tok, "idle", 4 * 2**20, ctx, lambda port: (time.sleep(2.0), (200, "ok"))[1]),
        measure(model, tok, "5 MB, default limit", 4 * 2**20, ctx, lambda p: _post(p, "/v1/chat/completions", five_mb)),
        measure(model, tok, "5 MB, limit 16 MiB", 16 * 2**20, ctx, lambda p: _post(p, "/v1/chat/completions", five_mb)),
        measure(model, tok, "3 MB tokenised", 16 * 2**20, 131072, lambda p: _post(p, "/v1/chat/completions", three_mb)),
        measure(model, tok, "32 concurrent calls", 4 * 2**20, ctx, _concurrent),
    ]
    print(
        f"{'case':<22} {'status':>6} {'code':<24} {'wall s':>7} {'polls':>6} {'median ms':>10} {'p99 ms':>8} "
        f"{'max ms':>8}"
    )
    for r in rows:
        print(
            f"{r['case']:<22} {r['status']:>6} {r['code']:<24} {r['request_wall_s']:>7.2f} {r['health_polls']:>6} "
            f"{r['health_median_ms']:>10.2f} {r['health_p99_ms']:>8.2f} {r['health_max_ms']:>8.2f}"
        )
    worst = max(r["health_max_ms"] for r in rows if r["case"].startswith("5 MB"))
    print(f"/health latency while a 5 MB request was refused: at most {worst:.1f} ms (target < {BUDGET_MS:g} ms)")
    print(f"load average before: {load[0]:.1f} on {os.cpu_count()} cores")
    payload = {
        "rows": rows,
        "model": "bundled tiny-repair",
        "health_poll_interval_s": POLL_S,
        "target_ms": BUDGET_MS,
        "torch_threads": torch.get_num_threads(),
        "load_average_before": list(load),
        "cpu_count": os.cpu_count(),
        "machine": platform.machine(),
        "command": "python benchmarks/bench_serve_load.py",
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    tmp = args.out.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(payload, indent=2) + "\n")
    tmp.replace(args.out)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
