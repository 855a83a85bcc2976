#!/usr/bin/env python3
"""Soak the gateway under hostile load (issue 15): `scripts/soak.sh [MINUTES]`.

Starts the shipped configuration (both pipelines, local stages, mock
attestation) on a free loopback port and drives it for MINUTES with a fixed
number of concurrent client connections (1,000 by default), each one a loop
of one kind of client:

- well-formed: plain embeddings, streamed completions, chat completions;
- hostile: clients that disconnect mid-stream, send the request head one
  byte every two seconds (slowloris), send the body slowly, never read a
  streamed answer, and malformed requests (bad JSON, unknown model, empty
  input, a 9 MB Content-Length, a garbage request line, bad sealing headers).

A stage is killed (SIGKILL) at one third and at two thirds of the run; the
gateway restarts it. Every 5 s the script samples the gateway's and each
stage's RSS and open file descriptors. It writes
`benchmark_results/soak.{json,md}`: requests by route and status, p50/p99 per
route, the samples, the kills and recoveries, the gateway's stream-cut
counters, and the verdict: every well-formed request got 200 or a clean
429/503/504 (streams: `[DONE]` or an error event), none hung (no answer within
its deadline plus 60 s), none lost (connection closed without an answer).

Standard library only; Linux (`/proc`).
"""

import argparse
import asyncio
import json
import os
import platform
import random
import re
import signal
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
EMBED_MODEL = "all-MiniLM-L6-v2"
GEN_MODEL = "SmolLM2-135M-Instruct"
SENTENCES = [
    "The patient reports mild chest pain after exercise.",
    "Quarterly revenue grew faster than operating costs.",
    "The contract may be terminated with thirty days notice.",
    "A short walk after dinner helps digestion.",
    "Interest rates rose for the third time this year.",
    "The witness did not recognise the defendant.",
]
PROMPTS = ["Once upon a time", "The capital of France is", "def fibonacci(n):", "Dear team,"]
# Well-formed requests must answer within their route's deadline (60 s by
# default); an answer this much later counts as hung.
GRACE_S = 60.0
# Client kinds and their share of the connections.
MIX = {
    "embeddings": 0.35,
    "completions_stream": 0.12,
    "chat": 0.03,
    "disconnect_mid_stream": 0.10,
    "slow_head": 0.10,
    "slow_body": 0.05,
    "never_read": 0.10,
    "malformed": 0.15,
}
WELL_FORMED = {"embeddings", "completions_stream", "chat"}


class Stats:
    """Outcomes per client kind."""

    def __init__(self):
        self.by_kind = {}

    def add(self, kind, outcome, latency_s=None):
        k = self.by_kind.setdefault(kind, {"outcomes": {}, "latencies": []})
        k["outcomes"][outcome] = k["outcomes"].get(outcome, 0) + 1
        if latency_s is not None:
            k["latencies"].append(latency_s)


def dechunk(body):
    """Decodes an HTTP/1.1 chunked body (returns what decodes)."""
    out, i = bytearray(), 0
    while i < len(body):
        j = body.find(b"\r\n", i)
        if j < 0:
            break
        try:
            n = int(body[i:j].split(b";")[0], 16)
        except ValueError:
            break
        if n == 0:
            break
        out += body[j + 2 : j + 2 + n]
        i = j + 2 + n + 2
    return bytes(out)


async def exchange(host, port, raw, deadline_s, read=True):
    """Sends `raw`, reads the whole answer (Connection: close). Returns
    (status or None, headers, body, elapsed) or raises asyncio.TimeoutError."""
    t0 = time.monotonic()
    reader, writer = await asyncio.wait_for(asyncio.open_connection(host, port), 10)
    try:
        writer.write(raw)
        await writer.drain()
        data = await asyncio.wait_for(reader.read(-1), deadline_s) if read else b""
    finally:
        writer.close()
    elapsed = time.monotonic() - t0
    head, _, body = data.partition(b"\r\n\r\n")
    m = re.match(rb"HTTP/1\.[01] (\d{3})", head)
    if not m:
        return None, {}, body, elapsed
    headers = {}
    for line in head.split(b"\r\n")[1:]:
        k, _, v = line.partition(b":")
        headers[k.strip().lower().decode()] = v.strip().decode(errors="replace")
    if headers.get("transfer-encoding") == "chunked":
        body = dechunk(body)
    return int(m.group(1)), headers, body, elapsed


def request(method, path, body=b"", extra=""):
    return (
        f"{method} {path} HTTP/1.1\r\nHost: soak\r\nConnection: close\r\n"
        f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n{extra}\r\n"
    ).encode() + body


def classify_stream(status, body):
    if status != 200:
        return str(status)
    if b"data: [DONE]" in body:
        return "200 [DONE]"
    if b'"error"' in body:
        return "200 error event"
    return "200 truncated"


CLEAN = {"200", "200 [DONE]", "200 error event", "429", "503", "504"}


async def well_formed(kind, host, port, stats, stop):
    rnd = random.Random()
    while time.monotonic() < stop:
        if kind == "embeddings":
            body = {"model": EMBED_MODEL, "input": rnd.sample(SENTENCES, rnd.randint(1, 4))}
            path = "/v1/embeddings"
        elif kind == "completions_stream":
            body = {"model": GEN_MODEL, "prompt": rnd.choice(PROMPTS), "max_tokens": 16,
                    "temperature": 0.7, "stream": True}
            path = "/v1/completions"
        else:
            body = {"model": GEN_MODEL, "max_tokens": 8,
                    "messages": [{"role": "user", "content": rnd.choice(PROMPTS)}]}
            path = "/v1/chat/completions"
        raw = request("POST", path, json.dumps(body).encode())
        try:
            status, headers, resp, elapsed = await exchange(host, port, raw, 60 + GRACE_S)
        except asyncio.TimeoutError:
            stats.add(kind, "HUNG")
            continue
        except OSError as e:
            stats.add(kind, f"connect error {type(e).__name__}")
            await asyncio.sleep(1)
            continue
        if status is None:
            stats.add(kind, "LOST (closed without an answer)")
            continue
        outcome = classify_stream(status, resp) if kind == "completions_stream" else str(status)
        stats.add(kind, outcome, elapsed if outcome in ("200", "200 [DONE]") else None)
        if status in (429, 503):
            retry = headers.get("retry-after", "1")
            await asyncio.sleep(min(float(retry) if retry.isdigit() else 1.0, 5.0))


async def start_stream(host, port, prompt):
    """Opens a connection and sends a streamed 64-token completion request."""
    body = json.dumps({"model": GEN_MODEL, "prompt": prompt, "max_tokens": 64,
                       "stream": True}).encode()
    reader, writer = await asyncio.wait_for(asyncio.open_connection(host, port), 10)
    writer.write(request("POST", "/v1/completions", body))
    await writer.drain()
    return reader, writer


async def disconnect_mid_stream(host, port, stats, stop):
    while time.monotonic() < stop:
        try:
            reader, writer = await start_stream(host, port, "Tell me a long story")
            got = b""
            t0 = time.monotonic()
            while b"data:" not in got and time.monotonic() - t0 < 120:
                chunk = await asyncio.wait_for(reader.read(4096), 120)
                if not chunk:
                    break
                got += chunk
            writer.close()
            stats.add("disconnect_mid_stream", "disconnected after first event" if b"data:" in got
                      else (got.split(b"\r\n")[0].decode(errors="replace")[:40] or "closed"))
        except (asyncio.TimeoutError, OSError) as e:
            stats.add("disconnect_mid_stream", f"error {type(e).__name__}")
        await asyncio.sleep(random.uniform(0, 1))


async def slow_head(host, port, stats, stop):
    head = b"POST /v1/embeddings HTTP/1.1\r\nHost: soak\r\nContent-Type: application/json\r\n"
    while time.monotonic() < stop:
        try:
            reader, writer = await asyncio.wait_for(asyncio.open_connection(host, port), 10)
            t0 = time.monotonic()
            closed = False
            for b in head:
                writer.write(bytes([b]))
                try:
                    await writer.drain()
                    data = await asyncio.wait_for(reader.read(4096), 2.0)
                    if data == b"" or data.startswith(b"HTTP/"):
                        closed = True
                        break
                except asyncio.TimeoutError:
                    continue
                except OSError:
                    closed = True
                    break
                if time.monotonic() - t0 > 120:
                    break
            writer.close()
            secs = time.monotonic() - t0
            stats.add("slow_head", "closed by the gateway" if closed else "NOT CLOSED in 120 s",
                      secs)
        except (asyncio.TimeoutError, OSError) as e:
            stats.add("slow_head", f"error {type(e).__name__}")


async def slow_body(host, port, stats, stop):
    body = json.dumps({"model": EMBED_MODEL, "input": "x" * 600}).encode()
    while time.monotonic() < stop:
        try:
            reader, writer = await asyncio.wait_for(asyncio.open_connection(host, port), 10)
            t0 = time.monotonic()
            writer.write(
                b"POST /v1/embeddings HTTP/1.1\r\nHost: soak\r\nConnection: close\r\n"
                b"Content-Type: application/json\r\n"
                + f"Content-Length: {len(body)}\r\n\r\n".encode())
            outcome = None
            for i in range(0, len(body), 8):
                try:
                    writer.write(body[i : i + 8])
                    await writer.drain()
                    data = await asyncio.wait_for(reader.read(4096), 1.0)
                    if data:
                        m = re.match(rb"HTTP/1\.[01] (\d{3})", data)
                        outcome = m.group(1).decode() if m else "answered"
                    else:
                        outcome = "closed by the gateway"
                    break
                except asyncio.TimeoutError:
                    continue
                except OSError:
                    outcome = "closed by the gateway"
                    break
            if outcome is None:
                data = await asyncio.wait_for(reader.read(-1), 60 + GRACE_S)
                m = re.match(rb"HTTP/1\.[01] (\d{3})", data)
                outcome = (m.group(1).decode() + " (body finished)") if m else "closed"
            writer.close()
            stats.add("slow_body", outcome, time.monotonic() - t0)
        except (asyncio.TimeoutError, OSError) as e:
            stats.add("slow_body", f"error {type(e).__name__}")


async def never_read(host, port, stats, stop):
    while time.monotonic() < stop:
        try:
            _, writer = await start_stream(host, port, "Write a poem")
            await asyncio.sleep(30)
            writer.close()
            stats.add("never_read", "held 30 s unread, then closed")
        except (asyncio.TimeoutError, OSError) as e:
            stats.add("never_read", f"error {type(e).__name__}")


MALFORMED = [
    ("bad json", request("POST", "/v1/embeddings", b'{"model": "all-MiniLM-L6-v2", "input": ')),
    ("unknown model", request("POST", "/v1/embeddings", b'{"model": "gpt-9", "input": "x"}')),
    ("empty input", request("POST", "/v1/embeddings", b'{"model": "all-MiniLM-L6-v2", "input": []}')),
    ("9 MB content-length", b"POST /v1/embeddings HTTP/1.1\r\nHost: soak\r\nConnection: close\r\n"
     b"Content-Type: application/json\r\nContent-Length: 9000000\r\n\r\n{"),
    ("garbage request line", b"GARBAGE \x00\xff\r\n\r\n"),
    ("bad sealing headers", request("POST", "/v1/embeddings", os.urandom(64),
                                    "hpke-key-id: 1\r\nhpke-aead: 1\r\nhpke-encapsulated-key: AAAA\r\n"
                                    "hpke-sealed-at: 0\r\n")),
    ("negative max_tokens", request("POST", "/v1/completions",
                                    b'{"model": "SmolLM2-135M-Instruct", "prompt": "x", "max_tokens": -5}')),
]


async def malformed(host, port, stats, stop):
    rnd = random.Random()
    while time.monotonic() < stop:
        name, raw = rnd.choice(MALFORMED)
        try:
            status, _, _, elapsed = await exchange(host, port, raw, 30)
            stats.add("malformed", f"{name}: {status if status else 'closed'}",
                      elapsed if status else None)
        except (asyncio.TimeoutError, OSError) as e:
            stats.add("malformed", f"{name}: error {type(e).__name__}")
        await asyncio.sleep(rnd.uniform(0, 0.5))


def children(pid):
    """The gateway's stage processes: {role: pid}, role = model:index."""
    out = {}
    for d in os.listdir("/proc"):
        if not d.isdigit():
            continue
        try:
            stat = Path(f"/proc/{d}/stat").read_text()
            if int(stat.rsplit(")", 1)[1].split()[1]) != pid:
                continue
            argv = Path(f"/proc/{d}/cmdline").read_bytes().split(b"\0")
        except (OSError, ValueError, IndexError):
            continue
        argv = [a.decode(errors="replace") for a in argv]
        if "--model-dir" not in argv:
            continue
        model = Path(argv[argv.index("--model-dir") + 1]).name
        index = argv[argv.index("--stage-index") + 1] if "--stage-index" in argv else "0"
        out[f"{model}:{index}"] = int(d)
    return out


def proc_sample(pid):
    try:
        rss = next(int(l.split()[1]) for l in Path(f"/proc/{pid}/status").read_text().splitlines()
                   if l.startswith("VmRSS:"))
        fds = len(os.listdir(f"/proc/{pid}/fd"))
        return {"rss_mib": round(rss / 1024, 1), "fds": fds}
    except (OSError, StopIteration):
        return None


async def ready(host, port):
    try:
        status, _, _, _ = await exchange(host, port, request("GET", "/readyz"), 5)
        return status == 200
    except (asyncio.TimeoutError, OSError):
        return False


async def monitor(gw_pid, host, port, t0, stop, kills, samples):
    kill_at = [t0 + (stop - t0) / 3, t0 + 2 * (stop - t0) / 3]
    victims = ["all-minilm-l6-v2:1", "smollm2-135m-instruct:0"]
    while time.monotonic() < stop:
        now = time.monotonic()
        procs = {"gateway": gw_pid, **children(gw_pid)}
        samples.append({"t_s": round(now - t0, 1),
                        **{k: proc_sample(p) for k, p in procs.items()}})
        if kill_at and now >= kill_at[0]:
            kill_at.pop(0)
            role = victims.pop(0)
            pid = procs.get(role)
            if pid:
                os.kill(pid, signal.SIGKILL)
                k0 = time.monotonic()
                event = {"t_s": round(k0 - t0, 1), "stage": role, "pid": pid}
                while time.monotonic() - k0 < 180:
                    await asyncio.sleep(0.5)
                    new = children(gw_pid).get(role)
                    if new and new != pid and await ready(host, port):
                        event["recovered_after_s"] = round(time.monotonic() - k0, 1)
                        event["new_pid"] = new
                        break
                kills.append(event)
        await asyncio.sleep(5)


def percentile(xs, q):
    if not xs:
        return None
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(round(q * (len(xs) - 1))))]


def start_gateway(config):
    log = open(ROOT / "target/soak-gateway.log", "w")
    p = subprocess.Popen([str(ROOT / "target/release/gateway"), "serve", "--config", str(config),
                          "--listen", "127.0.0.1:0"], cwd=ROOT, stdout=subprocess.PIPE,
                         stderr=log, text=True)
    for line in p.stdout:
        if line.startswith("GATEWAY LISTENING "):
            url = line.split()[-1]
            break
    else:
        sys.exit("the gateway did not start: see target/soak-gateway.log")
    # Keep draining stdout.
    threading.Thread(target=lambda: [None for _ in p.stdout], daemon=True).start()
    host, port = url.split("//")[1].rsplit(":", 1)
    return p, host, int(port)


async def metrics_text(host, port):
    try:
        _, _, body, _ = await exchange(host, port, request("GET", "/metrics"), 10)
        return body.decode(errors="replace")
    except (asyncio.TimeoutError, OSError):
        return ""


async def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--minutes", type=float, default=10)
    ap.add_argument("--connections", type=int, default=1000)
    ap.add_argument("--config", default=str(ROOT / "config/gateway.toml"))
    ap.add_argument("--out", default=str(ROOT / "benchmark_results"))
    a = ap.parse_args()

    gw, host, port = start_gateway(a.config)
    try:
        for _ in range(240):
            if await ready(host, port):
                break
            await asyncio.sleep(0.5)
        t0 = time.monotonic()
        stop = t0 + a.minutes * 60
        stats, kills, samples = Stats(), [], []
        tasks = [asyncio.create_task(monitor(gw.pid, host, port, t0, stop, kills, samples))]
        counts = {k: max(1, round(a.connections * share)) for k, share in MIX.items()}
        fns = {"disconnect_mid_stream": disconnect_mid_stream, "slow_head": slow_head,
               "slow_body": slow_body, "never_read": never_read, "malformed": malformed}
        for kind, n in counts.items():
            for _ in range(n):
                fn = fns.get(kind)
                coro = fn(host, port, stats, stop) if fn else well_formed(kind, host, port, stats, stop)
                tasks.append(asyncio.create_task(coro))
                await asyncio.sleep(0.002)
        await asyncio.gather(*tasks)
        # Everything has closed: the last sample shows what is left open.
        await asyncio.sleep(5)
        procs = {"gateway": gw.pid, **children(gw.pid)}
        samples.append({"t_s": round(time.monotonic() - t0, 1), "after_clients_closed": True,
                        **{k: proc_sample(p) for k, p in procs.items()}})
        metrics = await metrics_text(host, port)
    finally:
        gw.send_signal(signal.SIGINT)
        try:
            gw.wait(40)
        except subprocess.TimeoutExpired:
            gw.kill()
    write_report(a, counts, stats, kills, samples, metrics)


def write_report(a, counts, stats, kills, samples, metrics):
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True,
                            text=True).stdout.strip()
    dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=ROOT,
                           capture_output=True, text=True).stdout.strip()
    cpu = next((l.split(":", 1)[1].strip() for l in Path("/proc/cpuinfo").read_text().splitlines()
                if l.startswith("model name")), platform.processor())
    routes = {}
    bad = []
    for kind, k in stats.by_kind.items():
        lat = k["latencies"]
        routes[kind] = {"connections": counts.get(kind), "outcomes": k["outcomes"],
                        "total": sum(k["outcomes"].values()),
                        "p50_s": percentile(lat, 0.5), "p99_s": percentile(lat, 0.99)}
        if kind in WELL_FORMED:
            bad += [(kind, o, n) for o, n in k["outcomes"].items() if o not in CLEAN]
    hostile_fail = [(kind, o, n) for kind in ("slow_head",) for o, n in
                    stats.by_kind.get(kind, {"outcomes": {}})["outcomes"].items() if "NOT" in o]
    roles = sorted({k for s in samples for k in s if k not in ("t_s", "after_clients_closed")})
    series = {r: [(s["t_s"], s[r]["rss_mib"], s[r]["fds"]) for s in samples if s.get(r)]
              for r in roles}
    cuts = dict(re.findall(r'gateway_streams_cut_total\{reason="([a-z_]+)"\} (\d+)', metrics))
    doc = {"commit": commit + ("-dirty" if dirty else ""), "machine": f"{cpu}, {os.cpu_count()} cores",
           "minutes": a.minutes, "connections": a.connections, "routes": routes, "kills": kills,
           "samples": samples, "stream_cuts": cuts,
           "verdict": {"well_formed_not_clean": bad, "slow_heads_not_closed": hostile_fail,
                       "ok": not bad and not hostile_fail and len(kills) == 2
                       and all("recovered_after_s" in k for k in kills)}}
    out = Path(a.out)
    out.mkdir(exist_ok=True)
    (out / "soak.json").write_text(json.dumps(doc, indent=1) + "\n")

    md = ["# Soak under hostile load", "",
          f"Machine: {doc['machine']}; commit `{doc['commit']}`; "
          f"{time.strftime('%Y-%m-%dT%H:%M:%SZ', time.gmtime())}. Rerun: `scripts/soak.sh "
          f"{a.minutes:g}` (writes this file and `soak.json`).", "",
          f"The shipped config (`config/gateway.toml`: both pipelines, 2 + 2 local stages, mock "
          f"attestation) driven for {a.minutes:g} minutes by {a.connections} concurrent client "
          "connections, each a loop of one kind of client (HTTP/1.1, `Connection: close`, raw "
          "sockets from `scripts/soak.py`, on the same 2 cores as the gateway and its stages). "
          "A stage was killed with SIGKILL at one third and two thirds of the run.", "",
          "## Verdict", ""]
    v = doc["verdict"]
    md.append(f"- Well-formed requests answered with anything but 200 (streams: `[DONE]` or an "
              f"error event) or a clean 429/503/504: **{sum(n for *_, n in bad)}**"
              + (f" ({bad})" if bad else "") + ".")
    md.append(f"- Hung (no answer within the deadline + {GRACE_S:.0f} s) or lost (closed without "
              f"an answer): **{sum(n for _, o, n in bad if 'HUNG' in o or 'LOST' in o)}**.")
    md.append(f"- Slowloris connections not closed by the gateway: **{sum(n for *_, n in hostile_fail)}**.")
    kill_lines = "; ".join(
        "{} at {} s: ready again after {} s".format(k["stage"], k["t_s"],
                                                      k.get("recovered_after_s", "never"))
        for k in kills)
    md.append(f"- Stage kills recovered: **{sum('recovered_after_s' in k for k in kills)} of "
              f"{len(kills)}** ({kill_lines}).")
    md.append(f"- Streams the gateway cut (`gateway_streams_cut_total`): {cuts or 'none'}.")
    md += ["", "## Requests by client kind", "",
           "| client kind | connections | requests | outcomes | p50 s | p99 s |",
           "| --- | --- | --- | --- | --- | --- |"]
    fmt = lambda x: "–" if x is None else f"{x:.2f}"
    for kind in MIX:
        r = routes.get(kind)
        if not r:
            continue
        outs = ", ".join(f"{o}: {n}" for o, n in sorted(r["outcomes"].items(), key=lambda x: -x[1]))
        md.append(f"| {kind} | {r['connections']} | {r['total']} | {outs} | {fmt(r['p50_s'])} | "
                  f"{fmt(r['p99_s'])} |")
    md += ["", "Latency: for well-formed kinds, successful requests only (whole answer read); "
           "for slow_head, seconds until the gateway closed the connection; for slow_body, until "
           "the answer or the close.", "", "## Memory and file descriptors", "",
           "RSS (MiB) and open file descriptors per process, every 5 s; stages are named "
           "model:index (a killed stage's replacement continues its row).", "",
           "| process | RSS at 1 min | RSS max | RSS at end | growth over the second half | RSS after clients closed | fds at 1 min | fds max | fds after clients closed |",
           "| --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    half = a.minutes * 30
    for r, pts in series.items():
        if not pts:
            continue
        after = [s[r] for s in samples if s.get("after_clients_closed") and s.get(r)]
        at1 = next((p for p in pts if p[0] >= 60), pts[0])
        end = pts[-2] if len(pts) > 1 and after else pts[-1]
        # Growth from the middle of the run (or a minute after the process
        # was last restarted, if later) to its end: flat memory is ~0.
        restarted = max((k["t_s"] for k in kills if k["stage"] == r), default=0)
        since = max(half, restarted + 60)
        base = next((p for p in pts if p[0] >= since), None)
        growth = (f"{end[1] - base[1]:+.1f} MiB from {base[0]:.0f} s"
                  if base and base[0] < end[0] else "–")
        md.append(f"| {r} | {at1[1]} | {max(p[1] for p in pts)} | {end[1]} | {growth} | "
                  f"{after[0]['rss_mib'] if after else '–'} | {at1[2]} | {max(p[2] for p in pts)} | "
                  f"{after[0]['fds'] if after else '–'} |")
    md += ["", "The full series is in `soak.json` (`samples`).", ""]
    (out / "soak.md").write_text("\n".join(md))
    print("\n".join(md))
    sys.exit(0 if v["ok"] else 1)


if __name__ == "__main__":
    asyncio.run(main())
