#!/usr/bin/env python3
"""Structured outputs' cost (issue 32): decode speed under a JSON schema and
under tools against unconstrained decoding of the same prompt, through the
gateway, rounds interleaved; the mask time per token (p50/p99) of those
answers' grammars, from enclave-stage's bench_grammar example; and the same
decode comparison for llama.cpp's own grammar sampler (`LlamaGrammar`, GBNF
from the same JSON schema) on the same GGUF, when --llama-python names a
Python that has llama_cpp (scripts/bench_structured.sh passes the benchmark
virtualenv's).

Writes benchmark_results/structured.{json,md,png}. Run it through
scripts/bench_structured.sh.
"""
import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_venv import run_plot  # noqa: E402

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), ".."))
MODEL = "SmolLM2-135M-Instruct"
MODEL_DIR = os.path.join(ROOT, "models", "smollm2-135m-instruct")
GGUF = os.path.join(MODEL_DIR, "SmolLM2-135M-Instruct.Q4_1.gguf")
PROMPT = [{"role": "user", "content": "Write a long story about a dragon who learns to bake."}]
# The story's minimum length makes every mode write about max_tokens tokens,
# so that the three decode at the same context lengths.
STORY = {"type": "object", "properties": {"title": {"type": "string", "maxLength": 60},
                                          "story": {"type": "string", "minLength": 600}},
         "required": ["title", "story"], "additionalProperties": False}
TOOL = {"type": "function", "function": {
    "name": "publish_story", "description": "Publishes a story.", "parameters": STORY}}
BENCH_GRAMMAR = os.path.join(ROOT, "target/release/examples/bench_grammar")
# Each constrained mode and the unconstrained run of the same prompt tokens
# it is compared with (tools add their system text to the prompt).
CASES = {
    "unconstrained": {},
    "json_schema": {"response_format": {"type": "json_schema",
                                        "json_schema": {"name": "story", "schema": STORY}}},
    "unconstrained, tools' prompt": {"messages": "tools prompt"},
    "tools": {"tools": [TOOL], "tool_choice": "required"},
}
BASELINE = {"json_schema": "unconstrained", "tools": "unconstrained, tools' prompt"}


def whole(url, body):
    """One request: (seconds, completion tokens, the answer's text as the
    model wrote it, calls in the output syntax)."""
    req = urllib.request.Request(url + "/v1/chat/completions", data=json.dumps(body).encode(),
                                 headers={"content-type": "application/json"})
    t0 = time.perf_counter()
    with urllib.request.urlopen(req, timeout=600) as r:
        v = json.load(r)
    dt = time.perf_counter() - t0
    m = v["choices"][0]["message"]
    calls = m.get("tool_calls") or []
    text = m.get("content") or "\n".join(
        f'<tool_call>\n{{"name": "{c["function"]["name"]}", '
        f'"arguments": {c["function"]["arguments"]}}}\n</tool_call>' for c in calls)
    return dt, v["usage"]["completion_tokens"], text


def measure(url, body, short, long):
    """Decode rate by difference, which cancels the prefill and everything
    else a request does once: (long - short) tokens over the time a
    `long`-token answer takes beyond a `short`-token one; and the time to the
    first token (a 1-token answer). Every mode's answer runs to its limit."""
    t1, _, _ = whole(url, {**body, "max_tokens": 1})
    ts, ns, _ = whole(url, {**body, "max_tokens": short})
    tl, nl, text = whole(url, {**body, "max_tokens": long})
    rate = (nl - ns) / (tl - ts) if nl == long and ns == short and tl > ts else float("nan")
    return rate, t1, nl, text


def start_gateway():
    p = subprocess.Popen([os.path.join(ROOT, "target/release/gateway"), "serve", "--listen",
                          "127.0.0.1:0"], stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
                         cwd=ROOT, text=True)
    for line in p.stdout:
        if line.startswith("GATEWAY LISTENING "):
            return p, line.split()[-1]
    raise RuntimeError("the gateway did not start")


def summary(xs):
    xs = sorted(xs)
    return {"median": statistics.median(xs),
            "p99": xs[min(len(xs) - 1, int(round(0.99 * (len(xs) - 1))))], "n": len(xs)}


LLAMA = r"""
import json, sys, time, llama_cpp
gguf, rounds, max_tokens, threads = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
prompt, schema = json.loads(sys.argv[5]), json.loads(sys.argv[6])
llm = llama_cpp.Llama(model_path=gguf, n_threads=threads, n_ctx=2048, verbose=False, seed=0)
grammar = llama_cpp.LlamaGrammar.from_json_schema(json.dumps(schema), verbose=False)
out = {"unconstrained": [], "json_schema": []}
for r in range(rounds):
    for mode in (["unconstrained", "json_schema"] if r % 2 == 0 else ["json_schema", "unconstrained"]):
        kw = {"grammar": grammar} if mode == "json_schema" else {}
        t0 = time.perf_counter(); first = last = None; n = 0
        for chunk in llm.create_chat_completion(messages=prompt, max_tokens=max_tokens,
                                                temperature=0, stream=True, **kw):
            d = chunk["choices"][0]["delta"]
            if d.get("content"):
                n += 1; now = time.perf_counter(); first = first or now; last = now
        out[mode].append({"decode_tok_s": (n - 1) / (last - first), "ttft_s": first - t0, "tokens": n})
print(json.dumps({"version": llama_cpp.__version__, "runs": out}))
"""


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--llama-python", help="a Python with llama_cpp (the benchmark virtualenv)")
    ap.add_argument("--commit", default="unknown")
    ap.add_argument("--out", default=os.path.join(ROOT, "benchmark_results"))
    a = ap.parse_args()

    tools_prompt = subprocess.run([BENCH_GRAMMAR, "--tools-prompt", json.dumps([TOOL])],
                                  check=True, capture_output=True, text=True).stdout
    CASES["unconstrained, tools' prompt"]["messages"] = (
        [{"role": "system", "content": tools_prompt}] + PROMPT)
    gw, url = start_gateway()
    runs = {k: [] for k in CASES}
    texts = {}
    try:
        for i in range(2):  # warm-up
            whole(url, {"model": MODEL, "messages": PROMPT, "max_tokens": 16, "temperature": 0})
        for r in range(a.rounds):
            order = list(CASES)[r % len(CASES):] + list(CASES)[:r % len(CASES)]
            for name in order:
                body = {"model": MODEL, "messages": PROMPT, "temperature": 0, **CASES[name]}
                rate, ttft, n, text = measure(url, body, a.max_tokens // 4, a.max_tokens)
                runs[name].append({"decode_tok_s": rate, "ttft_s": ttft, "tokens": n})
                texts[name] = (body, text)
                print(f"round {r} {name}: {rate:.1f} tok/s, {n} tokens", flush=True)
    finally:
        gw.terminate()
        gw.wait()

    with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as f:
        json.dump([{"name": k, "body": b, "text": t}
                   for k, (b, t) in texts.items() if k in BASELINE], f)
    masks = json.loads(subprocess.run([BENCH_GRAMMAR, MODEL_DIR, f.name],
                                      check=True, capture_output=True, text=True).stdout)
    os.unlink(f.name)

    gateway = {}
    for name, rs in runs.items():
        gateway[name] = {"decode_tok_s": summary([x["decode_tok_s"] for x in rs]),
                         "ttft_ms": summary([x["ttft_s"] * 1000 for x in rs]),
                         "tokens": [x["tokens"] for x in rs]}
        if name in masks:
            gateway[name]["mask_us"] = summary(masks[name]["mask_us"])
            gateway[name]["compile_us"] = masks[name]["compile_us"]
    for name in gateway:
        base = gateway[BASELINE.get(name, name)]["decode_tok_s"]["median"]
        gateway[name]["decode_vs_unconstrained"] = gateway[name]["decode_tok_s"]["median"] / base

    llama = None
    if a.llama_python:
        r = subprocess.run([a.llama_python, "-c", LLAMA, GGUF, str(a.rounds), str(a.max_tokens),
                            "2", json.dumps(PROMPT), json.dumps(STORY)],
                           check=True, capture_output=True, text=True)
        raw = json.loads(r.stdout)
        llama = {"version": raw["version"]}
        for name, rs in raw["runs"].items():
            llama[name] = {"decode_tok_s": summary([x["decode_tok_s"] for x in rs]),
                           "tokens": [x["tokens"] for x in rs]}
        lb = llama["unconstrained"]["decode_tok_s"]["median"]
        llama["json_schema"]["decode_vs_unconstrained"] = (
            llama["json_schema"]["decode_tok_s"]["median"] / lb)

    doc = {"llama_cpp_build": os.path.basename(os.path.dirname(os.path.dirname(
               a.llama_python))) if a.llama_python else None,
           "commit": a.commit, "machine": f"{platform.machine()}, {os.cpu_count()} cores",
           "rounds": a.rounds, "max_tokens": a.max_tokens, "prompt": PROMPT[0]["content"],
           "gateway": gateway, "llama_cpp": llama,
           "method": "greedy chat completions through the gateway's 2-stage SmolLM2 "
                     "pipeline (shipped config), the modes interleaved round by round; decode "
                     "rate by difference: (max_tokens - max_tokens/4) tokens over the time a "
                     "max_tokens answer takes beyond a max_tokens/4 one (every answer runs to "
                     "its limit); TTFT: the time of a 1-token answer; mask times from "
                     "enclave-stage's bench_grammar on the answers' grammars and texts"}
    os.makedirs(a.out, exist_ok=True)
    with open(os.path.join(a.out, "structured.json"), "w") as f:
        json.dump(doc, f, indent=2)

    md = [f"""# Structured outputs: decode speed under a grammar

Commit {a.commit}, {doc['machine']}, {a.rounds} rounds interleaved, greedy,
`max_tokens` {a.max_tokens}, prompt "{PROMPT[0]['content']}". Rerun:
`scripts/bench_structured.sh [ROUNDS]`. {doc['method']}.

## The gateway (SmolLM2-135M Q4_1, 2 stages)

| mode | decode tok/s (median) | vs unconstrained, same prompt | TTFT ms (median) | mask µs p50 | mask µs p99 | compile ms |
| --- | --- | --- | --- | --- | --- | --- |"""]
    for name, g in gateway.items():
        m = g.get("mask_us")
        md.append(f"| {name} | {g['decode_tok_s']['median']:.1f} | "
                  f"{g['decode_vs_unconstrained']:.2f}× | {g['ttft_ms']['median']:.0f} | "
                  + (f"{m['median']:.0f} | {m['p99']:.0f} | {g['compile_us'] / 1000:.1f} |" if m
                     else "– | – | – |"))
    if llama:
        md.append(f"""
## llama.cpp (llama-cpp-python {llama['version']} in {doc['llama_cpp_build']}, same GGUF, 2 threads, GBNF from the same schema)

| mode | decode tok/s (median) | vs unconstrained |
| --- | --- | --- |
| unconstrained | {llama['unconstrained']['decode_tok_s']['median']:.1f} | 1.00× |
| json_schema | {llama['json_schema']['decode_tok_s']['median']:.1f} | {llama['json_schema']['decode_vs_unconstrained']:.2f}× |""")
    md.append("""
Each constrained mode is compared with unconstrained decoding of the same
prompt tokens: `tools` with "unconstrained, tools' prompt", which sends the
system text the entry stage adds for the tool (longer prompt, so slower
per token and a longer TTFT than the plain prompt). Goal (issue 32):
constrained decode ≥ 0.9× unconstrained. The mask is
computed in the exit stage's compute thread after the step's logits, so its
time adds to each constrained token's step; unconstrained choices compute
none.""")
    with open(os.path.join(a.out, "structured.md"), "w") as f:
        f.write("\n".join(md) + "\n")

    run_plot(r"""
import json, sys
import matplotlib; matplotlib.use("Agg")
import matplotlib.pyplot as plt
d = json.load(open(sys.argv[1]))
fig, ax = plt.subplots(figsize=(7, 4))
names = list(d["gateway"])
xs = range(len(names))
ax.bar([x - 0.2 for x in xs], [d["gateway"][n]["decode_tok_s"]["median"] for n in names],
       width=0.4, label="gateway (2 stages)")
if d["llama_cpp"]:
    ll = [d["llama_cpp"].get(n, {}).get("decode_tok_s", {}).get("median", 0) for n in names]
    ax.bar([x + 0.2 for x in xs], ll, width=0.4, label="llama.cpp (GBNF)")
ax.set_xticks(list(xs)); ax.set_xticklabels(names, rotation=12, fontsize=8)
ax.set_ylabel("decode tok/s (median)"); ax.legend()
ax.set_title("Decode under a grammar, SmolLM2-135M, commit " + d["commit"])
fig.tight_layout(); fig.savefig(sys.argv[2], dpi=100)
""", os.path.join(a.out, "structured.json"), os.path.join(a.out, "structured.png"))
    print(open(os.path.join(a.out, "structured.md")).read())


if __name__ == "__main__":
    main()
