#!/usr/bin/env python3
"""The Python package against a live gateway, with the stock openai SDK.

    python test_client.py --base-url http://127.0.0.1:PORT --policy p0.toml --policy p1.toml

Run in a clean virtualenv holding only the built wheel and `openai`
(scripts/test.sh does this). Checks: embeddings (float and base64),
completions, chat, streams (sync and async), a structured output and a
streamed tool call, each receipt verified; the archive re-verifies with `python -m confidential_gateway verify-receipt`; a
log-backed policy that requires logged receipts (with --log-key); a
policy that does not match, a POST to another path; and a tampering relay
between client and gateway (a flipped byte in a sealed answer, a streamed
chunk or the receipt trailer, an unsealed answer, an altered status, a cut
stream): every one raises and no altered text comes out.
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import http.client
import json
import math
import os
import struct
import subprocess
import sys
import tempfile
import threading
import traceback
import urllib.parse
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import openai

import confidential_gateway as cg

EMBED = "all-MiniLM-L6-v2"
LM = "SmolLM2-135M-Instruct"
TESTS = []


def test(fn):
    TESTS.append(fn)
    return fn


class Env:
    def __init__(self, base: str, policies: list, relay: str, archive: Path,
                 log_key: str = None) -> None:
        self.base, self.policies, self.relay, self.archive = base, policies, relay, archive
        self.log_key = log_key
        self.http = cg.http_client(policies, archive=archive)
        self.client = openai.OpenAI(base_url=base + "/v1", api_key="unused", max_retries=0,
                                    http_client=self.http)

    def tampered(self, mode: str) -> openai.OpenAI:
        """A client whose requests go through the relay in `mode`."""
        return openai.OpenAI(base_url=f"{self.relay}/{mode}/v1", api_key="unused", max_retries=0,
                             http_client=cg.http_client(self.policies))


def plain(base: str, path: str, body: dict) -> dict:
    """The same request sent to the gateway unsealed (for comparison)."""
    u = urllib.parse.urlsplit(base)
    c = http.client.HTTPConnection(u.hostname, u.port, timeout=120)
    c.request("POST", path, json.dumps(body), {"content-type": "application/json"})
    return json.loads(c.getresponse().read())


def check_receipt(r, endpoint: str, model: str):
    assert r is not None, "no receipt"
    assert r.endpoint == endpoint and r.model == model, (r.endpoint, r.model)
    assert r.sealing == "enclave", r.sealing
    assert len(r.cose) > 64 and len(r.id) == 32
    return r


def cosine(a, b) -> float:
    dot = sum(x * y for x, y in zip(a, b))
    return dot / math.sqrt(sum(x * x for x in a) * sum(y * y for y in b))


@test
def embeddings_float_and_base64(env: Env):
    texts = ["The weather is lovely today.", "def add(a, b): return a + b"]
    raw = env.client.embeddings.with_raw_response.create(model=EMBED, input=texts)
    assert raw.headers["receipt-verified"] == "true"
    r = check_receipt(cg.receipt_of(raw), "/v1/embeddings", EMBED)
    assert raw.headers["receipt-id"] == r.id
    got = raw.parse()
    want = plain(env.base, "/v1/embeddings", {"model": EMBED, "input": texts})
    for g, w in zip(got.data, want["data"]):
        assert len(g.embedding) == 384 and cosine(g.embedding, w["embedding"]) > 0.9999
    b64 = env.client.embeddings.create(model=EMBED, input=texts, encoding_format="base64")
    for x, y in zip(b64.data, got.data):
        raw_f32 = base64.b64decode(x.embedding)
        floats = struct.unpack(f"<{len(raw_f32) // 4}f", raw_f32)
        assert cosine(floats, y.embedding) > 0.9999
    check_receipt(env.http._transport.last_receipt, "/v1/embeddings", EMBED)
    return f"receipt {r.id[:8]}"


@test
def completions_match_the_plain_answer(env: Env):
    req = {"model": LM, "prompt": "The capital of France is", "max_tokens": 8, "temperature": 0}
    raw = env.client.completions.with_raw_response.create(**req)
    check_receipt(cg.receipt_of(raw), "/v1/completions", LM)
    text = raw.parse().choices[0].text
    assert text == plain(env.base, "/v1/completions", req)["choices"][0]["text"], text
    return repr(text)


@test
def chat_and_streams(env: Env):
    msgs = [{"role": "user", "content": "What is the capital of France?"}]
    raw = env.client.chat.completions.with_raw_response.create(
        model=LM, messages=msgs, temperature=0, max_tokens=12)
    check_receipt(cg.receipt_of(raw), "/v1/chat/completions", LM)
    whole = raw.parse().choices[0].message.content
    stream = env.client.chat.completions.create(
        model=LM, messages=msgs, temperature=0, max_tokens=12, stream=True)
    text = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
    assert text == whole, (text, whole)
    check_receipt(cg.receipt_of(stream), "/v1/chat/completions", LM)
    s2 = env.client.completions.create(model=LM, prompt="Once upon a time", max_tokens=10,
                                       seed=7, stream=True)
    parts = [c.choices[0].text for c in s2]
    assert parts and cg.receipt_of(s2).endpoint == "/v1/completions"
    return repr(text)


@test
def structured_output_and_tool_calls(env: Env):
    schema = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 20},
                                               "age": {"type": "integer"}},
              "required": ["name", "age"], "additionalProperties": False}
    raw = env.client.chat.completions.with_raw_response.create(
        model=LM, temperature=0, max_tokens=60,
        messages=[{"role": "user", "content": "Describe a person named Ada aged 36."}],
        response_format={"type": "json_schema",
                         "json_schema": {"name": "person", "schema": schema, "strict": True}})
    check_receipt(cg.receipt_of(raw), "/v1/chat/completions", LM)
    person = json.loads(raw.parse().choices[0].message.content)
    assert set(person) == {"name", "age"} and isinstance(person["age"], int), person
    tool = {"type": "function", "function": {
        "name": "get_weather", "parameters": {
            "type": "object", "properties": {"city": {"type": "string", "maxLength": 30}},
            "required": ["city"], "additionalProperties": False}}}
    ask = [{"role": "user", "content": "What is the weather in Paris?"}]
    stream = env.client.chat.completions.create(
        model=LM, temperature=0, max_tokens=60, messages=ask, tools=[tool],
        tool_choice="required", stream=True)
    name, args, finish = "", "", None
    for c in stream:
        for ch in c.choices:
            for d in ch.delta.tool_calls or []:
                name += (d.function.name or "") if d.function else ""
                args += (d.function.arguments or "") if d.function else ""
            finish = ch.finish_reason or finish
    check_receipt(cg.receipt_of(stream), "/v1/chat/completions", LM)
    assert name == "get_weather" and finish == "tool_calls", (name, finish)
    assert isinstance(json.loads(args)["city"], str), args
    return f"{person}; get_weather({args.strip()})"


@test
def async_client(env: Env):
    async def go():
        client = openai.AsyncOpenAI(base_url=env.base + "/v1", api_key="unused",
                                    http_client=cg.async_http_client(env.policies))
        e = await client.embeddings.with_raw_response.create(model=EMBED, input="hello")
        check_receipt(cg.receipt_of(e), "/v1/embeddings", EMBED)
        stream = await client.chat.completions.create(
            model=LM, messages=[{"role": "user", "content": "Hi"}], max_tokens=6, stream=True)
        out = [c async for c in stream]
        check_receipt(cg.receipt_of(stream), "/v1/chat/completions", LM)
        await client.close()
        tampered = openai.AsyncOpenAI(base_url=f"{env.relay}/flip-middle/v1", api_key="unused",
                                      max_retries=0, http_client=cg.async_http_client(env.policies))
        try:
            await tampered.embeddings.create(model=EMBED, input="secret")
        except cg.ResponseError as e:
            assert e.code == "response_unopenable", e.code
        else:
            raise AssertionError("a flipped byte went unnoticed")
        await tampered.close()
        return len(out)
    return f"{asyncio.run(go())} chunks; a flipped byte raised"


@test
def archive_reverifies_offline(env: Env):
    folders = [d for d in env.archive.iterdir() if not d.name.startswith(".")]
    assert folders, "nothing archived"
    d = sorted(folders, key=lambda p: p.stat().st_mtime)[-1]
    assert (d.stat().st_mode & 0o777) == 0o700
    r = cg.receipt_of(env.client.embeddings.with_raw_response.create(model=EMBED, input="x"))
    d = env.archive / r.id
    text = lambda f: (d / f).read_text().strip()  # noqa: E731
    args = ["--receipt", str(d / "receipt.cbor"), "--evidence", str(d / "evidence.cbor"),
            "--policy", env.policies[0], "--evidence-nonce", text("evidence-nonce.hex"),
            "--request", str(d / "request.json"), "--response", str(d / "response"),
            "--nonce", text("nonce.hex"), "--digest-salt", text("digest-salt.hex"),
            "--endpoint", "/v1/embeddings"]
    run = lambda: subprocess.run([sys.executable, "-m", "confidential_gateway",  # noqa: E731
                                  "verify-receipt", *args], capture_output=True, text=True)
    ok = run()
    assert ok.returncode == 0 and "RESULT: OK" in ok.stdout, ok.stdout + ok.stderr
    body = bytearray((d / "response").read_bytes())
    body[len(body) // 2] ^= 1
    (d / "response").write_bytes(bytes(body))
    bad = run()
    assert bad.returncode == 1 and "RESULT: FAILED" in bad.stdout, bad.stdout
    return "exit 0, then 1 after a flipped byte"


@test
def receipts_verify_only_against_their_own_evidence(env: Env):
    """The native layer by hand: seal to one pipeline's attested key, then
    check the answer's receipt against the other pipeline's evidence."""
    import httpx

    def attest(model, policy):
        nonce = os.urandom(32)
        r = httpx.get(f"{env.base}/v1/attestation", params={"nonce": nonce.hex(), "model": model},
                      headers={"accept": "application/cbor"})
        return cg.Evidence.verify(r.content, Path(policy).read_text(), nonce)
    emb, lm = attest(EMBED, env.policies[0]), attest(LM, env.policies[1])
    sealed = emb.seal("/v1/embeddings", json.dumps({"model": EMBED, "input": "hi"}).encode(),
                      os.urandom(16))
    r = httpx.post(env.base + "/v1/embeddings", content=sealed.body, headers=sealed.headers)
    assert r.status_code == 200, r.text
    raises(lambda: sealed.open(r.content, lm), cg.ReceiptError, "receipt_verification_failed")
    plain, receipt = sealed.open(r.content)
    assert json.loads(plain)["data"][0]["embedding"] and receipt.sealing == "enclave"
    # A receipt checked against another request (same key, other nonce) fails.
    other = emb.seal("/v1/embeddings", json.dumps({"model": EMBED, "input": "hi"}).encode(),
                     os.urandom(16))
    raises(lambda: other.open(r.content), cg.ResponseError, "response_unopenable")
    return "wrong evidence: ReceiptError; another request's key: ResponseError"


@test
def pin_writes_a_policy_the_package_accepts(env: Env):
    out = env.archive.parent / "pinned-embeddings.toml"
    pin = lambda *extra: subprocess.run([sys.executable, "-m", "confidential_gateway", "pin",  # noqa: E731
                                         "--gateway", env.base, "--model", EMBED, "--out", str(out),
                                         *extra], capture_output=True, text=True)
    refused = pin()
    assert refused.returncode == 2 and "--trust-on-first-use" in refused.stderr, refused.stderr
    assert not out.exists()
    done = pin("--trust-on-first-use")
    assert done.returncode == 0 and "TRUST ON FIRST USE" in done.stderr, done.stdout + done.stderr
    c = openai.OpenAI(base_url=env.base + "/v1", api_key="unused", max_retries=0,
                      http_client=cg.http_client([str(out)]))
    r = c.embeddings.with_raw_response.create(model=EMBED, input="pinned")
    assert r.headers["receipt-verified"] == "true", dict(r.headers)
    return "refused without --trust-on-first-use; the pinned policy verifies"


@test
def from_build_writes_a_nitro_policy(env: Env):
    record = env.archive.parent / "build-record.json"
    record.write_text(json.dumps({
        "format": "enclave-stage build record v1",
        "source": {"commit": "0" * 40, "dirty": False, "source_date_epoch": 1_700_000_000},
        "binary": {"file": "enclave-stage", "sha256": "ab" * 32},
        "model": {"name": "all-minilm-l6-v2", "manifest_sha256": "cd" * 32},
        "stage_policy": {"path_in_image": "/config/policy.toml", "sha256": "ef" * 32},
        "pipeline": {"layers": [[0, 3], [3, 6]]},
        "nitro": {"nitro_cli": "Nitro CLI 1.4.2", "pcr0": "a1" * 48, "pcr1": "b2" * 48,
                  "pcr2": "c3" * 48}}))
    out = env.archive.parent / "from-build.toml"
    done = subprocess.run([sys.executable, "-m", "confidential_gateway", "from-build", str(record),
                           "--out", str(out)], capture_output=True, text=True)
    assert done.returncode == 0, done.stdout + done.stderr
    text = out.read_text()
    assert "allow_mock = false" in text and text.count('pcr2 = "' + "c3" * 48 + '"') == 2, text
    # The gateway's stages are mock: the Nitro policy refuses them.
    c = openai.OpenAI(base_url=env.base + "/v1", api_key="unused", max_retries=0,
                      http_client=cg.http_client([str(out)]))
    raises(lambda: c.embeddings.create(model=EMBED, input="secret"), cg.EvidenceError,
           "evidence_not_verified")
    return "a Nitro policy with the record's PCRs for both stages; mock stages refused"


@test
def log_backed_policy_requires_logged_receipts(env: Env):
    """A policy pinned from the log with --receipts-logged: each answer comes
    with its checked RFC 9942 inclusion receipt (archived too), the log
    checkpoint kept in a state file grows only by proven consistency, and a
    relay that tampers with the inclusion receipt, hides it, or alters the
    log's tiles is refused."""
    if env.log_key is None:
        return "SKIPPED: no --log-key (the gateway's transparency log key)"
    tmp = env.archive.parent
    policy = tmp / "log-backed.toml"
    pin = subprocess.run([sys.executable, "-m", "confidential_gateway", "pin", "--gateway", env.base,
                          "--model", EMBED, "--log-key", env.log_key, "--receipts-logged",
                          "--out", str(policy)], capture_output=True, text=True)
    assert pin.returncode == 0, pin.stdout + pin.stderr
    assert "receipts_logged = true" in policy.read_text()
    state, archive = tmp / "log-state.json", tmp / "log-archive"

    def client(relay_mode=None, **options):
        base = f"{env.relay}/{relay_mode}" if relay_mode else env.base
        return openai.OpenAI(base_url=base + "/v1", api_key="unused", max_retries=0,
                             http_client=cg.http_client([str(policy)], log_state=state, **options))
    raw = client(archive=archive).embeddings.with_raw_response.create(model=EMBED, input="logged")
    r = check_receipt(cg.receipt_of(raw), "/v1/embeddings", EMBED)
    inclusion = cg.inclusion_of(raw)
    assert inclusion is not None, "no inclusion receipt"
    assert (archive / r.id / "inclusion.cose").read_bytes() == inclusion
    kept = json.loads(state.read_text())
    sizes = [log["size"] for log in kept["logs"]]
    assert len(sizes) == 1, kept
    # Offline: the archive re-verifies with its inclusion receipt, not without.
    d = archive / r.id
    text = lambda f: (d / f).read_text().strip()  # noqa: E731
    args = ["--receipt", str(d / "receipt.cbor"), "--evidence", str(d / "evidence.cbor"),
            "--policy", str(policy), "--evidence-nonce", text("evidence-nonce.hex"),
            "--request", str(d / "request.json"), "--response", str(d / "response"),
            "--nonce", text("nonce.hex"), "--digest-salt", text("digest-salt.hex")]
    run = lambda *extra: subprocess.run([sys.executable, "-m", "confidential_gateway",  # noqa: E731
                                         "verify-receipt", *args, *extra], capture_output=True, text=True)
    ok = run("--inclusion", str(d / "inclusion.cose"))
    assert ok.returncode == 0 and "PASS log inclusion" in ok.stdout, ok.stdout + ok.stderr
    missing = run()
    assert missing.returncode == 1 and "FAIL log inclusion" in missing.stdout, missing.stdout
    # The answers above grew the log: a new client on the same state file
    # proves the larger checkpoint consistent from tiles (fetched by the
    # package's own flow) and keeps it.
    client().embeddings.create(model=EMBED, input="grow the log")
    fresh = client()
    fresh.embeddings.create(model=EMBED, input="after growth")
    grown = [log["size"] for log in json.loads(state.read_text())["logs"]]
    assert grown[0] > sizes[0], (sizes, grown)
    # A relay that flips every byte of the tiles: the next larger checkpoint
    # cannot be proven consistent with the kept one.
    client().embeddings.create(model=EMBED, input="grow it again")
    try:
        client("tile-flip").embeddings.create(model=EMBED, input="secret")
    except cg.EvidenceError as e:
        assert e.code == "evidence_not_verified" and "split view" in e.message, e.message
    else:
        raise AssertionError("altered tiles went unnoticed")
    # A relay that tampers with the inclusion receipt, or says receipts are
    # not logged: the answer is withheld.
    for mode in ("inclusion-flip", "inclusion-off"):
        raises(lambda: client(mode).embeddings.create(model=EMBED, input="secret"),
               cg.ReceiptError, "receipt_not_logged")
    return f"log size {sizes[0]} -> {grown[0]} proven; tampered tile, inclusion flipped or hidden: refused"


def raises(call, error, code):
    """Runs `call`; it must raise `error` with `code` and return nothing.
    The openai SDK (3.x) passes the package's exceptions through as they
    are: not wrapped, not retried."""
    got = []
    try:
        got.append(call())
    except BaseException as e:  # noqa: BLE001
        assert isinstance(e, error), f"raised {type(e).__name__}: {e!r} (cause {e.__cause__!r})"
        assert e.code == code, (e.code, e.message)
        return got
    raise AssertionError(f"no exception; returned {got[0]!r}"[:300])


@test
def wrong_policy_and_unsealed_paths_raise(env: Env):
    bad = Path(env.archive.parent / "wrong-policy.toml")
    bad.write_text(Path(env.policies[0]).read_text().replace('measurements = ["', 'measurements = ["00'))
    c = openai.OpenAI(base_url=env.base + "/v1", api_key="unused", max_retries=0,
                      http_client=cg.http_client([str(bad)]))
    raises(lambda: c.embeddings.create(model=EMBED, input="secret"), cg.EvidenceError,
           "evidence_not_verified")
    # The gateway's own development policy (trust_local_build) cannot work
    # in a client: the error says what to use instead, as the CLI does.
    own = openai.OpenAI(base_url=env.base + "/v1", api_key="unused", max_retries=0,
                        http_client=cg.http_client(["config/policy.toml"]))
    try:
        own.embeddings.create(model=EMBED, input="secret")
    except cg.EvidenceError as e:
        assert "trust_local_build" in e.message and "gateway policy pin" in e.message, e.message
    else:
        raise AssertionError("a trust_local_build policy was accepted by a client")
    raises(lambda: env.http.post(env.base + "/v1/responses", json={"model": LM, "input": "secret"}),
           cg.ConfidentialError, "endpoint_not_sealed")
    # Plain HTTP off loopback is refused before anything is sent.
    try:
        env.http.post("http://192.0.2.1:9/v1/embeddings", json={"model": EMBED, "input": "x"})
    except ValueError as e:
        assert "plain HTTP" in str(e), e
    else:
        raise AssertionError("plain HTTP to a remote host was allowed")
    return "EvidenceError (with the trust_local_build hint), endpoint_not_sealed, plain HTTP off loopback"


@test
def tampered_whole_answers_raise(env: Env):
    emb = lambda c: c.embeddings.create(model=EMBED, input="secret text")  # noqa: E731
    raises(lambda: emb(env.tampered("flip-middle")), cg.ResponseError, "response_unopenable")
    # The last sealed chunk is the receipt trailer.
    raises(lambda: emb(env.tampered("flip-last")), cg.ResponseError, "response_unopenable")
    raises(lambda: emb(env.tampered("unsealed")), cg.ResponseError, "response_not_sealed")
    raises(lambda: emb(env.tampered("status-500")), cg.ResponseError, "upstream_status_mismatch")
    ok = emb(env.tampered("key-unknown-once"))
    assert len(ok.data[0].embedding) == 384
    return "4 tamperings raised; hpke_key_unknown re-attested and retried"


@test
def tampered_streams_raise_without_done(env: Env):
    def stream(mode):
        out = []
        s = env.tampered(mode).completions.create(model=LM, prompt="Once upon a time",
                                                  max_tokens=16, seed=1, stream=True)
        return lambda: [out.append(c.choices[0].text) for c in s]
    for mode, error, code in [("flip-middle", cg.ResponseError, "response_unopenable"),
                              ("flip-last", cg.ResponseError, "response_unopenable"),
                              ("cut", cg.ResponseError, "response_unopenable")]:
        raises(stream(mode), error, code)
    return "flipped chunk, flipped receipt, cut stream"


class Relay(BaseHTTPRequestHandler):
    """Between client and gateway: `/<mode>/...` forwards `...` and alters
    the answer to a sealed POST as `mode` says."""

    upstream = ""
    seen: set = set()

    def log_message(self, *_):
        pass

    def _forward(self, method):
        mode, _, rest = self.path.lstrip("/").partition("/")
        u = urllib.parse.urlsplit(self.upstream)
        body = self.rfile.read(int(self.headers.get("content-length") or 0))
        if method == "POST" and mode == "key-unknown-once" and mode not in Relay.seen:
            Relay.seen.add(mode)
            return self._send(400, {"content-type": "application/json"},
                              b'{"error":{"message":"unknown key","type":"invalid_request_error",'
                              b'"code":"hpke_key_unknown"}}')
        c = http.client.HTTPConnection(u.hostname, u.port, timeout=120)
        headers = {k: v for k, v in self.headers.items() if k.lower() not in ("host", "connection")}
        c.request(method, "/" + rest, body if method == "POST" else None, headers)
        r = c.getresponse()
        status, out = r.status, bytearray(r.read())
        hdrs = {k: v for k, v in r.getheaders()
                if k.lower() not in ("content-length", "transfer-encoding", "connection")}
        if method == "GET" and out:
            if mode == "inclusion-flip" and rest.endswith("/inclusion") and status == 200:
                out[-1] ^= 0x01
            elif mode == "inclusion-off" and rest.endswith("/inclusion"):
                status, hdrs = 404, {"content-type": "application/json"}
                out = bytearray(b'{"error":{"message":"not logged","type":"invalid_request_error",'
                                b'"code":"receipt_not_logged"}}')
            elif mode == "tile-flip" and "/v1/transparency/tile/" in "/" + rest and status == 200:
                out = bytearray(b ^ 0x01 for b in out)
        if method == "POST" and out:
            if mode == "flip-middle":
                out[len(out) // 2] ^= 0x01
            elif mode == "flip-last":
                out[-1] ^= 0x01
            elif mode == "cut":
                out = out[: len(out) * 2 // 3]
            elif mode == "unsealed":
                hdrs = {"content-type": "application/json"}
                out = bytearray(json.dumps({"object": "list", "model": EMBED, "data": [
                    {"object": "embedding", "index": 0, "embedding": [0.5] * 384}],
                    "usage": {"prompt_tokens": 1, "total_tokens": 1}}).encode())
            elif mode == "status-500":
                status = 500
        self._send(status, hdrs, bytes(out))

    def _send(self, status, headers, body):
        self.send_response(status)
        for k, v in headers.items():
            self.send_header(k, v)
        self.send_header("content-length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def do_GET(self):
        self._forward("GET")

    def do_POST(self):
        self._forward("POST")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--base-url", required=True, help="the gateway, e.g. http://127.0.0.1:8080")
    ap.add_argument("--policy", action="append", required=True)
    ap.add_argument("--log-key", help="the gateway's transparency log key (`gateway log vkey`)")
    a = ap.parse_args()
    Relay.upstream = a.base_url
    relay = ThreadingHTTPServer(("127.0.0.1", 0), Relay)
    threading.Thread(target=relay.serve_forever, daemon=True).start()
    failed = 0
    with tempfile.TemporaryDirectory() as tmp:
        env = Env(a.base_url.rstrip("/"), a.policy, f"http://127.0.0.1:{relay.server_port}",
                  Path(tmp) / "archive", a.log_key)
        for t in TESTS:
            try:
                detail = t(env)
                print(f"PASS {t.__name__}" + (f" ({detail})" if detail else ""))
            except Exception as e:  # noqa: BLE001 - report each, go on
                failed += 1
                print(f"FAIL {t.__name__}: {type(e).__name__}: {e}")
                traceback.print_exc()
    print(f"{len(TESTS) - failed} passed, {failed} failed")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
