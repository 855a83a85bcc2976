#!/usr/bin/env python3
"""End-to-end check of the gateway's OpenAI API with the stock `openai` SDK and
LangChain's `ChatOpenAI`: embeddings, completions and chat completions.

    python3 scripts/test_openai_sdk.py --base-url http://127.0.0.1:PORT/v1
    python3 scripts/test_openai_sdk.py --base-url http://127.0.0.1:PROXY/v1 --expect-verified

With --expect-verified (a `gateway proxy` in front of the gateway), whole chat
answers must carry `receipt-verified: true` (streams end with `[DONE]` only
once the proxy verified their receipt).

Prints one line per check and ends with "N passed, M failed"; exits non-zero on
any failure. Needs scripts/requirements-test.txt (scripts/test_venv.sh's virtualenv,
which scripts/test.sh puts first on PATH).
"""
import argparse
import base64
import json
import os
import sys
import traceback

import numpy as np
import openai
from openai import OpenAI

MODEL = "all-MiniLM-L6-v2"
DIM = 384
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
REFERENCE = os.path.join(ROOT, "gateway", "tests", "data", "embeddings_reference.json")
COMPLETION_MODEL = "SmolLM2-135M-Instruct"
COMPLETION_REFERENCE = os.path.join(ROOT, "gateway", "tests", "data", "completions_reference.json")

TEXTS3 = [
    "The weather is lovely today.",
    "Der schnelle braune Fuchs springt \u00fcber den faulen Hund.",
    "def add(a, b):\n    return a + b",
]


class Checks:
    def __init__(self):
        self.passed = 0
        self.failed = 0

    def run(self, name, fn):
        try:
            detail = fn()
        except Exception as e:  # noqa: BLE001 - report every failure, keep going
            self.failed += 1
            print(f"FAIL {name}: {type(e).__name__}: {e}")
            if os.environ.get("VERBOSE"):
                traceback.print_exc()
        else:
            self.passed += 1
            print(f"PASS {name}" + (f" ({detail})" if detail else ""))

    def summary(self):
        """Prints the counts; the exit status (non-zero on any failure)."""
        print(f"{self.passed} passed, {self.failed} failed")
        return 0 if self.failed == 0 else 1


def vec(x):
    """Embedding -> float64 numpy array; decodes a base64 string the way the SDK does."""
    if isinstance(x, str):
        return np.frombuffer(base64.b64decode(x), dtype="<f4").astype(np.float64)
    return np.asarray(x, dtype=np.float64)


def check(cond, msg):
    if not cond:
        raise AssertionError(msg)


def check_unit(v, dim, what):
    check(v.shape == (dim,), f"{what}: expected {dim} dims, got {v.shape}")
    check(bool(np.all(np.isfinite(v))), f"{what}: non-finite values")
    n = float(np.linalg.norm(v))
    check(abs(n - 1.0) < 1e-4, f"{what}: L2 norm {n} is not 1 (tol 1e-4)")


def check_response(r, n_inputs, dim=DIM):
    check(r.model == MODEL, f"model field {r.model!r} != {MODEL!r}")
    check(len(r.data) == n_inputs, f"expected {n_inputs} embeddings, got {len(r.data)}")
    check([d.index for d in r.data] == list(range(n_inputs)),
          f"indices {[d.index for d in r.data]} not 0..{n_inputs - 1}")
    check(r.usage is not None and r.usage.prompt_tokens > 0,
          f"usage.prompt_tokens must be > 0, got {r.usage}")
    vs = [vec(d.embedding) for d in r.data]
    for i, v in enumerate(vs):
        check_unit(v, dim, f"data[{i}]")
    return vs


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--base-url", required=True, help="e.g. http://127.0.0.1:8080/v1")
    ap.add_argument("--api-key", default="unused")
    ap.add_argument("--expect-verified", action="store_true",
                    help="a gateway proxy is in front: answers must say receipt-verified: true")
    ap.add_argument("--timeout", type=float, default=120.0)
    ap.add_argument("--reference", default=REFERENCE,
                    help="sentence-transformers reference file (skipped if absent)")
    args = ap.parse_args()

    client = OpenAI(base_url=args.base_url, api_key=args.api_key,
                    timeout=args.timeout, max_retries=0)
    c = Checks()
    got = {}

    def models_list():
        ids = [m.id for m in client.models.list()]
        check(MODEL in ids, f"{MODEL} not in models.list(): {ids}")
        return ", ".join(ids)

    def single_float():
        r = client.embeddings.create(model=MODEL, input=TEXTS3[0], encoding_format="float")
        check(all(isinstance(x, float) for x in r.data[0].embedding),
              "encoding_format=float returned non-float items")
        got["single_float"] = check_response(r, 1)[0]
        return f"prompt_tokens={r.usage.prompt_tokens}"

    def list_float():
        r = client.embeddings.create(model=MODEL, input=TEXTS3, encoding_format="float")
        got["list_float"] = check_response(r, 3)
        return f"prompt_tokens={r.usage.prompt_tokens}"

    def list_base64_explicit():
        # With an explicit encoding_format the SDK hands back the raw base64 string.
        r = client.embeddings.create(model=MODEL, input=TEXTS3, encoding_format="base64")
        check(all(isinstance(d.embedding, str) for d in r.data),
              "encoding_format=base64 did not return base64 strings")
        got["list_b64"] = check_response(r, 3)

    def single_base64_sdk_default():
        # No encoding_format: the SDK asks for base64 on the wire and decodes it itself.
        r = client.embeddings.create(model=MODEL, input=TEXTS3[0])
        check(not isinstance(r.data[0].embedding, str), "SDK did not decode base64")
        got["single_default"] = check_response(r, 1)[0]

    def float_equals_base64():
        worst = 0.0
        pairs = list(zip(got["list_float"], got["list_b64"]))
        pairs.append((got["single_float"], got["single_default"]))
        for a, b in pairs:
            worst = max(worst, float(np.max(np.abs(a - b))))
        check(worst <= 1e-6, f"float vs base64 max abs diff {worst} > 1e-6")
        return f"max diff {worst:.2e}"

    def batch_equals_single():
        d = float(np.max(np.abs(got["list_float"][0] - got["single_float"])))
        check(d <= 1e-5, f"same text in a batch vs alone differs by {d} > 1e-5")
        cos = float(got["list_float"][0] @ got["list_float"][1])
        check(cos < 0.99, f"different texts give (near) identical embeddings (cos {cos})")
        return f"max diff {d:.2e}"

    def dimensions_128():
        r = client.embeddings.create(model=MODEL, input=TEXTS3, dimensions=128,
                                     encoding_format="float")
        check_response(r, 3, dim=128)

    def dimensions_128_base64():
        r = client.embeddings.create(model=MODEL, input=TEXTS3[0], dimensions=128)
        check_response(r, 1, dim=128)

    def unknown_model():
        try:
            client.embeddings.create(model="nope", input="hello", encoding_format="float")
        except openai.NotFoundError as e:
            return f"HTTP {e.status_code}"
        raise AssertionError("model='nope' did not raise openai.NotFoundError")

    def token_ids_rejected():
        try:
            client.embeddings.create(model=MODEL, input=[[101, 2023]], encoding_format="float")
        except openai.BadRequestError as e:
            return f"HTTP {e.status_code}"
        raise AssertionError("token-id array input did not raise openai.BadRequestError")

    def matches_reference():
        if not os.path.isfile(args.reference):
            return "skipped: no reference file"
        with open(args.reference, encoding="utf-8") as f:
            items = json.load(f)["items"]
        # a short one, a non-English one and the longest (truncated) one
        pick = [items[0], next(i for i in items if not i["text"].isascii()),
                max(items, key=lambda i: i["tokens"])]
        r = client.embeddings.create(model=MODEL, input=[i["text"] for i in pick],
                                     encoding_format="float")
        vs = check_response(r, len(pick))
        # The shipped stages hold the weights in bf16: each value may move by
        # about 1e-3 (f32 weights stay within 1e-4), the direction hardly.
        worst = max(float(np.max(np.abs(v - np.asarray(i["embedding"]))))
                    for v, i in zip(vs, pick))
        check(worst <= 5e-3, f"max abs diff vs sentence-transformers {worst} > 5e-3")
        cos = min(float(np.dot(v, i["embedding"]) / np.linalg.norm(v) / np.linalg.norm(i["embedding"]))
                  for v, i in zip(vs, pick))
        check(cos >= 0.9999, f"cosine to sentence-transformers {cos} < 0.9999")
        return f"max diff {worst:.2e}, cosine >= {cos:.6f}"

    c.run("models.list includes " + MODEL, models_list)
    c.run("embeddings single string, float", single_float)
    c.run("embeddings list of 3, float", list_float)
    c.run("embeddings list of 3, base64 (explicit)", list_base64_explicit)
    c.run("embeddings single string, SDK default (base64 decoded by SDK)",
          single_base64_sdk_default)
    if all(k in got for k in ("list_float", "list_b64", "single_float", "single_default")):
        c.run("float and base64 results equal within 1e-6", float_equals_base64)
    else:
        c.run("float and base64 results equal within 1e-6",
              lambda: (_ for _ in ()).throw(AssertionError("earlier request failed")))
    if "list_float" in got and "single_float" in got:
        c.run("batched == single embedding within 1e-5", batch_equals_single)
    c.run("dimensions=128 gives 128-d unit vectors", dimensions_128)
    c.run("dimensions=128 with SDK default encoding", dimensions_128_base64)
    c.run("model='nope' raises NotFoundError", unknown_model)
    c.run("token-id array input raises BadRequestError", token_ids_rejected)
    c.run("matches sentence-transformers reference (cosine >= 0.9999)", matches_reference)

    # ---- completions (SmolLM2 across two stages) ----
    ids = [m.id for m in client.models.list().data]
    if COMPLETION_MODEL not in ids:
        print(f"SKIP completions: {COMPLETION_MODEL} is not served ([completions] not configured)")
    else:
        ref = json.load(open(COMPLETION_REFERENCE))["items"][0]

        def completion_greedy():
            r = client.completions.create(model=COMPLETION_MODEL, prompt=ref["prompt"],
                                          max_tokens=8, temperature=0)
            check(r.object == "text_completion", f"object {r.object!r}")
            check(len(r.choices) == 1 and r.choices[0].finish_reason == "length",
                  f"choices {r.choices}")
            check(r.usage.prompt_tokens == len(ref["prompt_ids"]),
                  f"prompt_tokens {r.usage.prompt_tokens} != {len(ref['prompt_ids'])}")
            check(r.usage.completion_tokens == 8, f"completion_tokens {r.usage.completion_tokens}")
            check(ref["text"].startswith(r.choices[0].text),
                  f"greedy text {r.choices[0].text!r} is not a prefix of the reference")
            return repr(r.choices[0].text)

        def completion_stream_equals_whole():
            kw = dict(model=COMPLETION_MODEL, prompt="Once upon a time", max_tokens=24,
                      temperature=0.8, top_p=0.95, seed=42, n=2)
            whole = client.completions.create(**kw)
            texts = ["", ""]
            finish = [None, None]
            usage = None
            for chunk in client.completions.create(stream=True,
                                                   stream_options={"include_usage": True}, **kw):
                if chunk.usage is not None:
                    usage = chunk.usage
                for ch in chunk.choices:
                    texts[ch.index] += ch.text
                    finish[ch.index] = ch.finish_reason or finish[ch.index]
            for i, ch in enumerate(whole.choices):
                check(texts[i] == ch.text, f"choice {i}: streamed {texts[i]!r} != {ch.text!r}")
                check(finish[i] == ch.finish_reason, f"choice {i}: finish {finish[i]}")
            check(usage is not None and usage.total_tokens == whole.usage.total_tokens,
                  f"usage chunk {usage} vs {whole.usage}")
            check(texts[0] != texts[1], "the two samples are identical")
            return f"{len(texts[0])}+{len(texts[1])} chars"

        def completion_stop_and_echo():
            r = client.completions.create(model=COMPLETION_MODEL, prompt=ref["prompt"],
                                          max_tokens=32, temperature=0, stop=["."], echo=True)
            ch = r.choices[0]
            check(ch.finish_reason == "stop", f"finish {ch.finish_reason}")
            check(ch.text.startswith(ref["prompt"]), f"echo missing: {ch.text!r}")
            check("." not in ch.text[len(ref["prompt"]):], f"stop not applied: {ch.text!r}")
            return repr(ch.text)

        def completion_context_error():
            try:
                client.completions.create(model=COMPLETION_MODEL, prompt="hi", max_tokens=100000)
            except openai.BadRequestError as e:
                check("context length" in str(e), f"message: {e}")
                return "BadRequestError"
            raise AssertionError("no error for max_tokens over the context")

        def verified(raw):
            if args.expect_verified:
                v = raw.headers.get("receipt-verified")
                check(v == "true", f"receipt-verified header {v!r}")

        question = [{"role": "system", "content": "You are a concise assistant."},
                    {"role": "user", "content": "What is the capital of France?"}]

        def chat_greedy():
            raw = client.chat.completions.with_raw_response.create(
                model=COMPLETION_MODEL, messages=question, max_tokens=16, temperature=0)
            verified(raw)
            r = raw.parse()
            check(r.object == "chat.completion", f"object {r.object!r}")
            check(r.id.startswith("chatcmpl-"), f"id {r.id!r}")
            m = r.choices[0].message
            check(m.role == "assistant" and m.content, f"message {m}")
            check("Paris" in m.content, f"answer {m.content!r} does not name Paris")
            check(r.usage.prompt_tokens > 20 and r.usage.completion_tokens > 0, f"usage {r.usage}")
            return repr(m.content)

        def chat_stream_equals_whole():
            kw = dict(model=COMPLETION_MODEL, max_tokens=24, temperature=0.8, seed=11, n=2,
                      messages=[{"role": "user", "content": [
                          {"type": "text", "text": "Write one sentence about the sea."}]}])
            whole = client.chat.completions.create(**kw)
            # Through the proxy a stream has no verdict header: [DONE] comes only
            # once its receipt verified, else an error event makes the SDK raise.
            raw = client.chat.completions.with_raw_response.create(
                stream=True, stream_options={"include_usage": True}, **kw)
            texts, finish, roles, usage = ["", ""], [None, None], [None, None], None
            for chunk in raw.parse():
                check(chunk.object == "chat.completion.chunk", f"object {chunk.object!r}")
                if chunk.usage is not None:
                    usage = chunk.usage
                for ch in chunk.choices:
                    if roles[ch.index] is None:
                        roles[ch.index] = ch.delta.role
                    texts[ch.index] += ch.delta.content or ""
                    finish[ch.index] = ch.finish_reason or finish[ch.index]
            check(roles == ["assistant", "assistant"], f"first deltas carry role: {roles}")
            for i, ch in enumerate(whole.choices):
                check(texts[i] == ch.message.content,
                      f"choice {i}: streamed {texts[i]!r} != {ch.message.content!r}")
                check(finish[i] == ch.finish_reason, f"choice {i}: finish {finish[i]}")
            check(usage is not None and usage.total_tokens == whole.usage.total_tokens,
                  f"usage chunk {usage} vs {whole.usage}")
            return f"{len(texts[0])}+{len(texts[1])} chars"

        def langchain_invoke_and_stream():
            from langchain_openai import ChatOpenAI
            from langchain_core.messages import HumanMessage, SystemMessage

            llm = ChatOpenAI(model=COMPLETION_MODEL, base_url=args.base_url, api_key="unused",
                             temperature=0, max_tokens=16, max_retries=0)
            msgs = [SystemMessage(question[0]["content"]), HumanMessage(question[1]["content"])]
            whole = llm.invoke(msgs).content
            streamed = "".join(chunk.content for chunk in llm.stream(msgs))
            sdk = client.chat.completions.create(model=COMPLETION_MODEL, messages=question,
                                                 max_tokens=16, temperature=0)
            check(whole == sdk.choices[0].message.content,
                  f"invoke {whole!r} != openai SDK {sdk.choices[0].message.content!r}")
            check(streamed == whole, f"stream {streamed!r} != invoke {whole!r}")
            return repr(whole)

        c.run("chat.completions.create greedy answers and has the chat shape", chat_greedy)
        c.run("chat stream=True: role first, concatenates to the same-seed whole text",
              chat_stream_equals_whole)
        c.run("LangChain ChatOpenAI invoke == stream == openai SDK", langchain_invoke_and_stream)
        c.run("completions.create greedy matches the transformers reference", completion_greedy)
        c.run("completions stream=True concatenates to the same-seed whole text",
              completion_stream_equals_whole)
        c.run("completions stop + echo", completion_stop_and_echo)
        c.run("completions over the context raises BadRequestError", completion_context_error)

    return c.summary()


if __name__ == "__main__":
    sys.exit(main())
