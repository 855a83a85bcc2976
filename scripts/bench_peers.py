#!/usr/bin/env python3
"""Side-by-side benchmark against the tools people run unprotected.

Completions: llama.cpp (llama-cpp-python, built from source for this CPU)
against the bare in-process stage code (`enclave-stage/examples/
bench_decode.rs`), on the same GGUF-derived weights, the same thread counts
and the same prompt lengths. Embeddings: ONNX Runtime (f32, int8) and
sentence-transformers against bare Candle and the gateway
(`peers_embeddings.py`). Each part runs its systems interleaved round by
round so that drift on a shared machine hits all alike.

Run through scripts/bench_peers.sh (it builds the venv and the binaries).
Writes benchmark_results/peers.{json,md} and peers.png; a part not run this
time keeps its previous results (and says from which commit they are).
"""
import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import time

import peers_embeddings

GGUF = "models/smollm2-135m-instruct/SmolLM2-135M-Instruct.Q4_1.gguf"


def ids(n):
    """The same pseudo-text as bench_decode.rs: ids spread over the vocabulary."""
    return [100 + (i * 7919) % 40000 for i in range(n)]


def llama_cpp_run(model_path, threads, prompts, decode):
    import llama_cpp

    llm = llama_cpp.Llama(
        model_path=model_path,
        n_ctx=1024,
        n_batch=512,
        n_ubatch=512,
        n_threads=threads,
        n_threads_batch=threads,
        logits_all=False,
        verbose=False,
    )

    def first(p):
        llm.reset()
        llm.eval(p)
        return int(max(range(llm.n_vocab()), key=lambda t: llm.scores[llm.n_tokens - 1][t]))

    first(ids(8))  # warm-up
    ttft = {}
    for n in prompts:
        t = time.perf_counter()
        llm.reset()
        llm.eval(ids(n))
        ttft[str(n)] = (time.perf_counter() - t) * 1e3
    llm.reset()
    llm.eval(ids(32))
    import numpy as np

    tok = int(np.argmax(llm.scores[llm.n_tokens - 1]))
    t = time.perf_counter()
    for _ in range(decode):
        llm.eval([tok])
        tok = int(np.argmax(llm.scores[llm.n_tokens - 1]))
    tok_s = decode / (time.perf_counter() - t)
    del llm
    return {"ttft_ms": ttft, "decode_tok_s": tok_s}


def ours_run(binary, weights, threads, prompts, decode):
    env = dict(os.environ, RAYON_NUM_THREADS=str(threads), CANDLE_NUM_THREADS=str(threads))
    out = subprocess.run(
        [binary, "--weights", weights, "--prompt-tokens", ",".join(map(str, prompts)),
         "--decode-tokens", str(decode)],
        env=env, check=True, capture_output=True, text=True,
    ).stdout
    return json.loads(out.strip().splitlines()[-1])


def gateway_run(binary):
    """One round of bench_completions: the gateway with 1 and 2 stages as
    shipped (q4_1, 2 threads per stage), short prompts, 64 tokens each."""
    out = "target/bench/completions-round"
    subprocess.run([binary, "--completions-config", "threads_per_stage = 2", "--single-runs", "5",
                    "--concurrency", "1,16", "--out", out], check=True, stdout=subprocess.DEVNULL)
    d = json.load(open(out + ".json"))
    return {k: {"decode_tok_s": 1e3 / d[k]["per_token_ms_p50"], "ttft_short_ms": d[k]["ttft_ms_p50"],
                "ttft_512_ms": d[k]["ttft_long_prompt_ms_p50"],
                "aggregate_16_tok_s": d[k]["aggregate"]["16"]["tokens_per_s"]}
            for k in ("one_stage", "two_stages")}


def completions(a):
    """Runs the completions part; returns its JSON section."""
    import llama_cpp

    prompts = [int(p) for p in a.prompts.split(",")]
    systems = []
    for weights, peer_model in [("q8_0", a.q8_gguf), ("q4_1", GGUF)]:
        for threads in (1, 2):
            systems.append((f"llama.cpp {weights}", weights, threads, lambda m=peer_model, t=threads: llama_cpp_run(m, t, prompts, a.decode)))
            systems.append((f"stage code {weights}", weights, threads, lambda w=weights, t=threads: ours_run(a.binary, w, t, prompts, a.decode)))
    samples = {}
    for r in range(a.rounds):
        for name, weights, threads, fn in systems:
            res = fn()
            samples.setdefault((name, weights, threads), []).append(res)
            print(f"round {r} {name} threads={threads}: {json.dumps(res)}", file=sys.stderr)
        res = gateway_run(a.completions_binary)
        samples.setdefault(("gateway", "q4_1", 2), []).append(res)
        print(f"round {r} gateway: {json.dumps(res)}", file=sys.stderr)
    gw = samples.pop(("gateway", "q4_1", 2))
    gateway = {k: {m: statistics.median(x[k][m] for x in gw) for m in gw[0][k]} for k in gw[0]}

    rows = []
    for (name, weights, threads), runs in samples.items():
        row = {
            "system": name, "weights": weights, "threads": threads, "rounds": len(runs),
            "decode_tok_s_median": statistics.median(x["decode_tok_s"] for x in runs),
        }
        for n in prompts:
            row[f"ttft_{n}_ms_median"] = statistics.median(x["ttft_ms"][str(n)] for x in runs)
        rows.append(row)

    def find(system, weights, threads):
        return next(r for r in rows if r["system"] == system and r["weights"] == weights and r["threads"] == threads)

    ratios = []
    for weights in ("q8_0", "q4_1"):
        for threads in (1, 2):
            o, p = find(f"stage code {weights}", weights, threads), find(f"llama.cpp {weights}", weights, threads)
            ratio = {"weights": weights, "threads": threads,
                     "decode_vs_llama_cpp": o["decode_tok_s_median"] / p["decode_tok_s_median"]}
            for n in prompts:
                ratio[f"ttft_{n}_vs_llama_cpp"] = o[f"ttft_{n}_ms_median"] / p[f"ttft_{n}_ms_median"]
            ratios.append(ratio)
    peer = find("llama.cpp q4_1", "q4_1", 2)
    for k, v in gateway.items():
        v["decode_vs_llama_cpp_q4_1_2_threads"] = v["decode_tok_s"] / peer["decode_tok_s_median"]
        v["ttft_512_vs_llama_cpp_q4_1_2_threads"] = v["ttft_512_ms"] / peer["ttft_512_ms_median"]
    return {
        "gateway": gateway,
        "commit": a.commit, "rounds": a.rounds, "prompts": prompts,
        "llama_cpp_python": llama_cpp.__version__,
        "method": "interleaved rounds; each system loads the model, warms up with an 8-token prompt, "
                  "times prefill+first logits for each prompt length (TTFT), then greedy-decodes "
                  f"{a.decode} tokens after a 32-token prompt; medians over rounds",
        "rows": rows,
        "ratios": ratios,
    }


def completions_markdown(c):
    prompts = c["prompts"]
    md = ["| system | weights | threads | decode tok/s | " + " | ".join(f"TTFT {n} tok (ms)" for n in prompts) + " |",
          "| --- | --- | --- | --- | " + " | ".join("---" for _ in prompts) + " |"]
    for r in c["rows"]:
        md.append(f"| {r['system']} | {r['weights']} | {r['threads']} | {r['decode_tok_s_median']:.1f} | "
                  + " | ".join(f"{r[f'ttft_{n}_ms_median']:.0f}" for n in prompts) + " |")
    md.append("")
    md.append("| weights | threads | decode, ours / llama.cpp | " + " | ".join(f"TTFT {n}, ours / llama.cpp (lower is better)" for n in prompts) + " |")
    md.append("| --- | --- | --- | " + " | ".join("---" for _ in prompts) + " |")
    for r in c["ratios"]:
        md.append(f"| {r['weights']} | {r['threads']} | {r['decode_vs_llama_cpp']:.2f}× | "
                  + " | ".join(f"{r[f'ttft_{n}_vs_llama_cpp']:.2f}×" for n in prompts) + " |")
    g = c.get("gateway")
    if g:
        md += ["", "| gateway (q4_1, 2 threads per stage, as shipped) | decode tok/s (1 / per-token p50) | decode / llama.cpp q4_1 2 threads | TTFT 512-token prompt (ms) | TTFT 512 / llama.cpp q4_1 2 threads (lower is better) | TTFT, short prompt (ms) | aggregate tok/s @16 |",
               "| --- | --- | --- | --- | --- | --- | --- |"]
        for k, name in (("one_stage", "1 stage"), ("two_stages", "2 stages")):
            v = g[k]
            t512 = (f"{v['ttft_512_ms']:.0f} | {v['ttft_512_vs_llama_cpp_q4_1_2_threads']:.2f}×"
                    if "ttft_512_ms" in v else "– | –")
            md.append(f"| {name} | {v['decode_tok_s']:.1f} | {v['decode_vs_llama_cpp_q4_1_2_threads']:.2f}× | "
                      f"{t512} | {v['ttft_short_ms']:.0f} | {v['aggregate_16_tok_s']:.1f} |")
    return "\n".join(md)


def completions_targets(c):
    g = c.get("gateway", {}).get("two_stages")
    if not g or "ttft_512_ms" not in g:
        return ""
    d, t = g["decode_vs_llama_cpp_q4_1_2_threads"], g["ttft_512_vs_llama_cpp_q4_1_2_threads"]
    met = lambda ok: "met" if ok else "not met"
    return (f"\nTargets (issue 12), the 2-stage gateway as shipped against llama.cpp q4_1 with 2 threads: "
            f"single-stream decode ≥ 1.00×: **{d:.2f}×** ({met(d >= 1)}); time to first token at 512 prompt "
            f"tokens ≤ 1.00×: **{t:.2f}×** ({met(t <= 1)}).\n")


def plot(doc, path):
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib not installed: no plot", file=sys.stderr)
        return
    parts = [p for p in ("completions", "embeddings") if p in doc]
    fig, axes = plt.subplots(1, len(parts), figsize=(7 * len(parts), 4.2), squeeze=False)
    for ax, part in zip(axes[0], parts):
        rows = doc[part]["rows"]
        if part == "completions":
            gw = doc[part].get("gateway", {})
            rows = rows + [{"system": f"gateway {n}", "threads": 2, "decode_tok_s_median": gw[k]["decode_tok_s"]}
                           for k, n in (("one_stage", "1 stage"), ("two_stages", "2 stages")) if k in gw]
            labels = [f"{r['system']}\n{r['threads']} thr" for r in rows]
            ax.bar(range(len(rows)), [r["decode_tok_s_median"] for r in rows],
                   color=["#c44" if r["system"].startswith("llama") else
                          "#4a4" if r["system"].startswith("gateway") else "#48c" for r in rows])
            ax.set_xticks(range(len(rows)))
            ax.set_xticklabels(labels, fontsize=7, rotation=30, ha="right")
            ax.set_ylabel("single-stream decode, tokens/s")
            ax.set_title("SmolLM2-135M: llama.cpp vs stage code and gateway (q4_1)")
        else:
            width = 0.8 / len(rows)
            for i, r in enumerate(rows):
                xs = [j + i * width for j in range(len(peers_embeddings.LEVELS))]
                ax.bar(xs, [r[f"c{c}_sentences_per_s"] for c in peers_embeddings.LEVELS], width,
                       label=r["system"])
            ax.set_xticks([j + 0.4 - width / 2 for j in range(len(peers_embeddings.LEVELS))])
            ax.set_xticklabels([f"C={c}" for c in peers_embeddings.LEVELS])
            ax.set_ylabel("sentences/s")
            ax.set_title("all-MiniLM-L6-v2: ONNX Runtime / sentence-transformers vs ours")
            ax.set_ylim(0, 1.25 * max(r[f"c{c}_sentences_per_s"] for r in rows for c in peers_embeddings.LEVELS))
            ax.legend(fontsize=7, loc="upper center", ncol=3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--part", choices=["all", "completions", "embeddings", "render"], default="all",
                    help="render: only rewrite peers.md and the plot from peers.json")
    ap.add_argument("--binary", default="target/release/examples/bench_decode")
    ap.add_argument("--completions-binary", default="target/release/examples/bench_completions")
    ap.add_argument("--embeddings-binary", default="target/release/examples/bench_embeddings")
    ap.add_argument("--q8-gguf", help="the GGUF re-quantized to Q8_0 for llama.cpp")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--decode", type=int, default=64)
    ap.add_argument("--prompts", default="32,512")
    ap.add_argument("--embed-secs", type=float, default=4.0, help="seconds per peer and level per round")
    ap.add_argument("--threads", type=int, default=2, help="threads of the embeddings peers and bare Candle")
    ap.add_argument("--out", default="benchmark_results")
    ap.add_argument("--commit", default="")
    a = ap.parse_args()
    path = os.path.join(a.out, "peers.json")
    doc = {}
    if os.path.exists(path):
        old = json.load(open(path))
        doc = {k: old[k] for k in ("completions", "embeddings") if k in old}
        if "rows" in old:  # the first format: completions only, at the top level
            doc["completions"] = dict({k: old[k] for k in ("commit", "llama_cpp_python", "method", "rows", "ratios")},
                                      rounds=old["rows"][0]["rounds"], prompts=[32, 512])
    doc["machine"] = {"cpu": platform.processor() or open("/proc/cpuinfo").read().split("model name")[1].split("\n")[0].split(":", 1)[1].strip(),
                      "cores": os.cpu_count()}
    if a.part in ("all", "completions"):
        if not a.q8_gguf:
            ap.error("--q8-gguf is needed for the completions part")
        doc["completions"] = completions(a)
    if a.part in ("all", "embeddings"):
        e = peers_embeddings.run(a.rounds, a.threads, a.embed_secs, "target/bench", a.embeddings_binary,
                                 lambda m: print(m, file=sys.stderr))
        e.update({"commit": a.commit, "rounds": a.rounds})
        doc["embeddings"] = e
    os.makedirs(a.out, exist_ok=True)
    with open(path, "w") as f:
        json.dump(doc, f, indent=2)
        f.write("\n")
    cpu = doc["machine"]["cpu"]
    md = [f"""# Side by side with the unprotected tools

Machine: {cpu}, {doc['machine']['cores']} cores (shared VM). Rerun:
`scripts/bench_peers.sh [ROUNDS] [all|completions|embeddings]`. Peers are
installed from PyPI into a benchmark-only virtualenv (`target/bench-venv`).
"""]
    if "completions" in doc:
        c = doc["completions"]
        md.append(f"""## Completions beside llama.cpp (SmolLM2-135M-Instruct)

Commit `{c['commit']}`, {c['rounds']} rounds, llama-cpp-python
{c['llama_cpp_python']} built from source for this CPU (`GGML_NATIVE=ON`).

What runs: llama.cpp through its Python binding, in process, against our
**bare stage code** (`enclave-stage/examples/bench_decode.rs`: the whole
model as one `LlamaPart`, in process, no gateway, no pipeline). Same weights
on both sides: the packaged Q4_1 GGUF, and for Q8_0 a copy llama.cpp
re-quantized itself (`llama_model_quantize`; ours re-quantizes at load). Same
thread counts (llama.cpp `n_threads`, ours `RAYON_NUM_THREADS`), same
prompts (ids spread over the vocabulary). {c['method']}.

{completions_markdown(c)}
{completions_targets(c)}

Ratios above 1.00× are faster than llama.cpp for decode; below 1.00× is
faster for TTFT. The gateway rows come from `gateway/examples/bench_completions.rs`
run once per round between the others (HTTP streaming, the shipped config's
q4_1 and 2 threads per stage, greedy, 64 tokens; TTFT 512 is a 512-token
prefix of `scripts/data/quality-text.txt` with one token generated, the
short-prompt TTFT the English prompts of that benchmark).
""")
    if "embeddings" in doc:
        e = doc["embeddings"]
        cos = ", ".join(f"{k} {v:.5f}" for k, v in e["min_cosine_to_ort_f32"].items())
        rss = ", ".join(f"{b / 2**20:.0f} MiB" for b in e["gateway"]["stage_peak_rss_bytes"] if b)
        md.append(f"""## Embeddings beside ONNX Runtime and sentence-transformers (all-MiniLM-L6-v2)

Commit `{e['commit']}`, {e['rounds']} rounds, onnxruntime {e['versions']['onnxruntime']},
torch {e['versions']['torch']}. Peers, as people run them without protection:

{peers_embeddings.__doc__.split('Peers, as people run them without protection:')[1].strip()}

Method: {e['method']}. The gateway runs the shipped config's 2 stages
(threads_per_stage = {e['gateway']['threads_per_stage']}); its latency is per request, seen by
clients on the same 2 cores. Smallest cosine to ONNX Runtime f32 over the 32
sentences: {cos}. Stage peak RSS (VmHWM) in the last round: {rss}.

{peers_embeddings.markdown(e)}

Our stages hold the dense layers' weights in bf16, the shipped default
(`[pipeline] weights`; products with AVX-512 BF16, `enclave-stage/src/kernels/bf16_matmul.rs`).
Issue 12 lets a reduced-precision format be the default only if it is measured
faster than f32 and keeps cosine ≥ 0.999 to the f32 embeddings: bare bf16 runs
{e['ratios']['bare_bf16_vs_ort_f32_c64'] / e['ratios']['bare_f32_vs_ort_f32_c64']:.2f}× the
sentences/s of bare f32 at C=64, and its smallest cosine above is
{e['min_cosine_to_ort_f32']['bare Candle, bf16 (ours)']:.5f} (ONNX Runtime's dynamic int8 misses
that bar). Against ONNX Runtime int8 the gateway reaches {next(r for r in e['rows'] if r['system'] == peers_embeddings.GATEWAY_ROW)['c64_sentences_per_s'] / next(r for r in e['rows'] if r['system'] == 'onnxruntime int8')['c64_sentences_per_s']:.2f}× at C=64.

Target (issue 12): the gateway at C=64 ≥ 1.00× ONNX Runtime f32:
**{e['ratios']['gateway_vs_ort_f32_c64']:.2f}×**{' (met)' if e['ratios']['gateway_vs_ort_f32_c64'] >= 1 else ' (not met; where the time goes: below)'}.
{'' if e['ratios']['gateway_vs_ort_f32_c64'] >= 1 else peers_embeddings.WHERE_TIME_GOES}
""")
    md.append("![side by side](peers.png)\n")
    with open(os.path.join(a.out, "peers.md"), "w") as f:
        f.write("\n".join(md))
    print("\n".join(md))
    plot(doc, os.path.join(a.out, "peers.png"))


if __name__ == "__main__":
    main()
