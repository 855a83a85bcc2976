#!/usr/bin/env python3
"""Writes docs/layout.md from the tree: every Rust source file of the
workspace with the first sentence of its `//!` module comment, and every
script with the first line of its header comment.

    scripts/layout.py          # rewrite docs/layout.md
    scripts/layout.py --check  # exit 1 if docs/layout.md is stale (the test suite runs this)
"""

import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
OUT = ROOT / "docs/layout.md"
CRATES = ["proto", "enclave-stage", "gateway", "client"]
# The folders, what each holds (the files follow, each from its own comment).
FOLDERS = [
    "| path | what |",
    "| --- | --- |",
    "| `proto/` | wire formats and crypto: the attested stage channel, pipeline messages and stage claims, tensor frames, evidence, attestation (mock, Nitro) and policy, model manifests, HPKE body sealing (`sealing/`), receipts (`receipt/`), the evidence bundle, OpenAI request validation and response bodies (embeddings, completions, chat) |",
    "| `enclave-stage/` | one pipeline stage: a BERT or Llama layer range on Candle (the kind picked from the manifest in `serving/mod.rs`; the connection handlers in `server/` see it only through `model.rs`'s traits). By layer: `models/` holds the model families (BERT in `models/bert/`, with our fused layer ops in `ops.rs`, pooling and tokenizer; Llama-family decoders (llama, qwen2, qwen3, phi3, gemma2) in `models/llama/`; the tokenizer a GGUF describes in `models/gguf_tokenizer.rs`); `kernels/` our own products (bf16 with AVX-512 BF16 in `bf16_matmul.rs`; quantized with AVX-512 VNNI and AVX2 in `qmatmul/`, a GGUF's blocks read in `qmatmul/ggml.rs`) and the one CPU-feature detection; `serving/` how each kind is served (`serving/embedding/`: micro-batching, compute thread, tracker; `serving/generation/`: scheduler, compute thread, chat template, grammars, output rules); stage keys and boot evidence, opening and validating sealed requests, rendering the chat template and tokenizing (entry), micro-batching, per-request row digests and receipt links (one finisher for both models, `receipt_link.rs`), pooling as the model folder names it (`models/bert/pooling.rs`), response sealing and the receipt (exit) |",
    "| `gateway/` | the host binary: the HTTP server (`serve.rs`: connection cap, header-read timeout), OpenAI API (`api/`, axum), sealing for plain clients, pipeline orchestrator, receipt store, local stage launcher, metrics and traces, your own GGUF or embedding folder served (`own_model/`) and a GGUF split by memory (`plan.rs`); `fuzz/`: the fuzz targets of every parser ([`docs/fuzzing.md`](fuzzing.md)) |",
    "| `client/` | the client side, which runs in the client's trust domain, not on the host: the client verbs (verify, seal/open, the `proxy`; `client::sealed` is the transport-free core they share with the Python package), which the `gateway` binary dispatches to; `python/`: the Python package (PyO3 over the client crate: an httpx transport for the `openai` SDK) |",
    "| `config/` | gateway config, measurement policy, pinned model manifests |",
    "| `scripts/` | setup, start, tests, reference-vector generation, benchmark |",
    "| `benchmark_results/` | committed benchmark output with how to rerun it |",
    "| `docker/` | FROM scratch images of the stage (also the Nitro enclave image) and the gateway, compose ([`docs/containers.md`](containers.md)), Kubernetes manifests (`k8s/`: kustomize base, overlays `mock` and `nitro`; [`docs/deploy-kubernetes.md`](deploy-kubernetes.md)) |",
    "| `docs/` | every page the README links: troubleshooting, clients, API, curl walkthrough, your own model, operations, architecture, protocol, receipts, threat model, structured outputs, deployments, testing, fuzzing, benchmarks, status |",
]


def tracked(prefix):
    files = subprocess.run(["git", "ls-files", "--cached", "--others", "--exclude-standard", prefix],
                           cwd=ROOT, capture_output=True, text=True, check=True).stdout.split()
    return sorted(f for f in files if (ROOT / f).exists())


def first_sentence(lines):
    text = " ".join(l.strip() for l in lines).strip()
    if not text:
        return "(no module comment)"
    m = re.match(r"(.+?\.)(\s|$)", text)
    return (m.group(1) if m else text).rstrip(":;").replace("|", "\\|")


def rust_summary(path):
    lines = []
    for line in path.read_text().splitlines():
        if line.startswith("//!"):
            body = line[3:].strip()
            if not body and lines:
                break
            lines.append(body)
        elif lines or line.strip():
            break
    return first_sentence(lines)


def script_summary(path):
    lines = []
    text = path.read_text().splitlines()
    if path.suffix == ".py":
        src = "\n".join(text)
        m = re.search(r'^(?:#![^\n]*\n)?(?:#[^\n]*\n)*\s*"""(.*?)"""', src, re.S)
        if m:
            return first_sentence(m.group(1).strip().split("\n\n")[0].splitlines())
    for line in text[1 if text and text[0].startswith("#!") else 0:]:
        if line.startswith("#"):
            body = line.lstrip("#").strip()
            if not body and lines:
                break
            if body:
                lines.append(body)
        elif lines or line.strip():
            break
    return first_sentence(lines)


def render():
    out = ["# Layout, file by file", "",
           "Generated by `scripts/layout.py` from each file's own module comment (the first "
           "sentence of its `//!` lines, or of a script's header); the test suite fails when this "
           "page is stale.", "", "## Folders", ""] + FOLDERS + [""]
    for crate in CRATES:
        out += [f"## `{crate}/`", "", "| file | what |", "| --- | --- |"]
        for f in tracked(crate):
            if f.endswith(".rs"):
                out.append(f"| `{f}` | {rust_summary(ROOT / f)} |")
        out.append("")
    out += ["## `scripts/`", "", "| file | what |", "| --- | --- |"]
    for f in tracked("scripts"):
        if f.endswith((".sh", ".py")) and f.count("/") == 1:
            out.append(f"| `{f}` | {script_summary(ROOT / f)} |")
    out.append("")
    return "\n".join(out)


def main():
    text = render()
    if "--check" in sys.argv:
        if not OUT.exists() or OUT.read_text() != text:
            print("docs/layout.md is stale: run scripts/layout.py", file=sys.stderr)
            sys.exit(1)
        return
    OUT.write_text(text)


if __name__ == "__main__":
    main()
