#!/usr/bin/env python3
"""A queueing simulation of the scale-out on real hosts (docs/scaling.md).

What it models, and with which assumptions (all stated in docs/scaling.md):
- a replica is a chain of S stages; under load its stages work on different
  micro-batches at once (pipelining), so a replica serves requests at the
  rate of its slowest stage, mu_replica = 1 / max(stage service time);
  a request's own latency is the sum of the stage times plus the hops;
- replicas have cores of their own (one enclave per stage, whole cores),
  so R replicas give R x mu_replica until the gateways run out of CPU;
- a gateway spends g ms of CPU per request (HTTP, JSON, HPKE, receipt
  storage); gateways scale out behind a Service;
- arrivals are Poisson; each request goes to the replica with the fewest
  requests in flight (join-shortest-queue, what the gateway does); service
  times vary (log-normal, coefficient of variation CV).

Outputs, for R = 1, 2, 4, 8, 16 replicas at a fixed per-replica utilization:
throughput, p50/p99 latency, gateway cores needed, and the fleet's KV-cache
memory for the completions pipeline.

Usage: scripts/scaling_model.py [--stage-ms 1.0,1.0] [--hop-ms 0.3]
       [--gateway-ms 0.24] [--cv 0.3] [--util 0.7] [--requests 200000]
Prints a markdown table (docs/scaling.md holds the default run).
"""
import argparse
import heapq
import math
import random


def simulate(replicas, stage_ms, hop_ms, cv, util, requests, seed=7):
    """Mean throughput (req/s) and latency percentiles (ms) for JSQ routing."""
    rng = random.Random(seed)
    bottleneck = max(stage_ms)
    mu = 1000.0 / bottleneck  # requests/s one replica sustains
    lam = util * mu * replicas
    sigma = math.sqrt(math.log(1 + cv * cv))

    def draw(mean):
        return rng.lognormvariate(math.log(mean) - sigma * sigma / 2, sigma)

    # Each replica: the time its bottleneck stage is next free, and the
    # completion times of the requests it holds (for the in-flight count).
    free_at = [0.0] * replicas
    holding = [[] for _ in range(replicas)]
    t = 0.0
    lat = []
    for _ in range(requests):
        t += rng.expovariate(lam) * 1000.0
        for h in holding:
            while h and h[0] <= t:
                heapq.heappop(h)
        r = min(range(replicas), key=lambda i: (len(holding[i]), i))
        # The bottleneck stage serialises; the other stages overlap with it.
        start = max(t, free_at[r])
        service = draw(bottleneck)
        free_at[r] = start + service
        rest = sum(draw(s) for s in stage_ms) - bottleneck
        done = free_at[r] + max(rest, 0.0) + hop_ms * (len(stage_ms) + 1)
        heapq.heappush(holding[r], done)
        lat.append(done - t)
    lat.sort()
    q = lambda p: lat[min(len(lat) - 1, int(p * len(lat)))]
    return lam, q(0.50), q(0.99)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--stage-ms", default="1.0,1.0",
                    help="per-request service time of each stage at saturation (ms)")
    ap.add_argument("--hop-ms", type=float, default=0.3)
    ap.add_argument("--gateway-ms", type=float, default=0.24,
                    help="gateway CPU per request (ms)")
    ap.add_argument("--cv", type=float, default=0.3)
    ap.add_argument("--util", type=float, default=0.7)
    ap.add_argument("--requests", type=int, default=200000)
    ap.add_argument("--kv-tokens", type=int, default=8192,
                    help="completions: KV-cache tokens per stage")
    ap.add_argument("--kv-layers", type=int, default=30)
    ap.add_argument("--kv-stages", type=int, default=2)
    a = ap.parse_args()
    stage_ms = [float(x) for x in a.stage_ms.split(",")]
    kv_stage_mib = a.kv_tokens * (a.kv_layers / a.kv_stages) * 1536 / 2**20
    print(f"| replicas | throughput (req/s) | p50 (ms) | p99 (ms) | gateway cores at 70 % | completions KV, whole fleet (MiB) |")
    print("| --- | --- | --- | --- | --- | --- |")
    for r in [1, 2, 4, 8, 16]:
        lam, p50, p99 = simulate(r, stage_ms, a.hop_ms, a.cv, a.util, a.requests)
        gw = lam * a.gateway_ms / 1000.0 / 0.7
        kv = r * a.kv_stages * kv_stage_mib
        print(f"| {r} | {lam:.0f} | {p50:.1f} | {p99:.1f} | {gw:.2f} | {kv:.0f} |")


if __name__ == "__main__":
    main()
