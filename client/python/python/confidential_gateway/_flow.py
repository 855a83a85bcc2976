"""One sealed exchange as a generator that yields its I/O: written once,
driven by the sync transport (``run_sync``) and the async one
(``run_async``). It yields ``("send", request)`` for a response whose body
is not read yet, ``("read", response)`` for a response's whole body, and
``("sleep", seconds)`` to wait before asking again."""

from __future__ import annotations

import time
from contextlib import closing
from typing import Any, Callable, Dict, Generator, List, Optional, Tuple

import anyio
import httpx

from . import _native
from ._core import UNKNOWN_SIGNER, Core, Plan, Trusted, is_sealed
from .errors import ConfidentialError, EvidenceError, ReceiptError

Flow = Generator[Tuple[str, Any], Any, Any]


def with_tiles(plan: Plan, check: Callable[[Dict[str, bytes]], Tuple[Optional[str], List[str]]],
               fail: Callable[[str], ConfidentialError]) -> Flow:
    """Runs a log check (``Evidence.observe_log``, ``Evidence.check_inclusion``)
    step by step, fetching from the gateway's log the tiles it asks for;
    returns what it found."""
    tiles: Dict[str, bytes] = {}
    for _ in range(_native.LOG_STEPS):
        found, need = check(tiles)
        if found is not None:
            return found
        for path in need:
            url = f"{plan.root}/v1/transparency/{path}"
            response = yield ("send", httpx.Request("GET", url))
            body = yield ("read", response)
            if response.status_code != 200:
                raise fail(f"fetching the log's tile {url}: HTTP {response.status_code}")
            tiles[path] = body
    raise fail(f"the log's tiles yield no proof after {_native.LOG_STEPS} rounds of fetching")


def attest(core: Core, plan: Plan) -> Flow:
    """Fetches and verifies the plan's evidence and, under a log-backed
    policy, its log checkpoint against the latest seen; returns the ``Trusted``."""
    request, nonce = core.attestation_request(plan)
    response = yield ("send", request)
    body = yield ("read", response)
    trusted = core.accept(plan, response.status_code, body, nonce)
    yield from with_tiles(plan, lambda t: trusted.evidence.observe_log(core.log_state, t),
                          lambda m: EvidenceError("evidence_not_verified", f"log consistency: {m}"))
    core.trust(plan, trusted)
    return trusted


def prove_logged(core: Core, plan: Plan, trusted: Trusted, receipt: "_native.Receipt") -> Flow:
    """Under a policy that requires receipts to be logged: fetches the
    receipt's inclusion receipt (asking again, with growing pauses, while the
    gateway has not appended it), checks it and the tree it proves against the
    latest checkpoint seen; returns its bytes (None when not required)."""
    if not trusted.evidence.receipts_logged:
        return None
    wait, pause, longest = _native.INCLUSION_WAIT
    url = f"{plan.root}/v1/receipts/{receipt.id}/inclusion"
    headers = {"authorization": plan.auth} if plan.auth else {}
    deadline = time.monotonic() + wait
    while True:
        response = yield ("send", httpx.Request("GET", url, headers=headers))
        body = yield ("read", response)
        if response.status_code == 200:
            break
        # A 404 without Retry-After is final: the gateway does not log receipts.
        again = "retry-after" in response.headers or response.status_code != 404
        if not again or time.monotonic() + pause > deadline:
            raise ReceiptError("receipt_not_logged",
                               _native.never_logged(f"GET {url}: HTTP {response.status_code}"))
        yield ("sleep", pause)
        pause = min(pause * 2, longest)
    yield from with_tiles(
        plan, lambda t: trusted.evidence.check_inclusion(core.log_state, receipt.cose, body, t),
        lambda m: ReceiptError("receipt_not_logged", f"the receipt's log entry: {m}"))
    return body


def verified(core: Core, plan: Plan, verify: Callable[[Optional["_native.Evidence"]], Any]) -> Flow:
    """``verify`` against the evidence the request was sealed to; a receipt
    signed by a key the evidence does not hold (a stage restarted) is checked
    once more against freshly verified evidence."""
    try:
        return verify(None)
    except ReceiptError as e:
        if e.reason not in UNKNOWN_SIGNER:
            raise
    trusted = yield from attest(core, plan)
    return verify(trusted.evidence)


def exchange(core: Core, request: httpx.Request, body: bytes) -> Flow:
    """The whole exchange. Returns the response to hand out, or, for a
    sealed stream, ``(plan, trusted, sealed, upstream)`` for the transport
    to wrap in its event stream."""
    plan = core.plan(request, body)
    if plan is None:
        return (yield ("send", request))
    trusted = core.current(plan) or (yield from attest(core, plan))
    for attempt in range(2):
        sent, sealed = core.seal(plan, trusted, request)
        response = yield ("send", sent)
        if plan.stream and response.is_success and is_sealed(response):
            return plan, trusted, sealed, response
        body = yield ("read", response)
        if attempt == 0 and core.suspect(trusted, response, body):
            fresh = yield from attest(core, plan)
            if core.worth_retry(trusted, fresh, body):
                trusted = fresh
                continue
        if not response.is_success or not is_sealed(response):
            return core.not_success(sealed, response, body)
        plain, receipt = yield from verified(core, plan, lambda ev: sealed.open(body, ev))
        inclusion = yield from prove_logged(core, plan, core.current(plan) or trusted, receipt)
        core.keep(sealed, receipt, plain, inclusion)
        return core.response(response, plain, "application/json", receipt, sealed, inclusion)
    raise AssertionError("unreachable")


def stream_end(core: Core, plan: Plan, sealed: "_native.Sealed",
               opener: "_native.StreamOpener", extensions: dict) -> Flow:
    """After the last sealed chunk: the receipt over the whole stream
    verified (or a stage's error event ended it); returns what is still to
    hand out (``[DONE]``)."""
    opener.finish()
    receipt, rest = yield from verified(core, plan, opener.verify)
    if receipt is not None:
        trusted = core.current(plan)
        if trusted is None:  # attested before the stream was sent: cannot happen
            raise ReceiptError("receipt_verification_failed", "no verified evidence for this stream")
        inclusion = yield from prove_logged(core, plan, trusted, receipt)
        core.keep(sealed, receipt, opener.all, inclusion)
        extensions["receipt"] = receipt
        if inclusion is not None:
            extensions["receipt_inclusion"] = inclusion
    return rest


def _step(flow: Flow, value: Any) -> Tuple[str, Any]:
    """The flow's next I/O, or ``("done", result)``."""
    try:
        return flow.send(value)
    except StopIteration as stop:
        return "done", stop.value


def run_sync(flow: Flow, inner: httpx.BaseTransport) -> Any:
    """Drives a flow with a sync transport."""
    op, arg = _step(flow, None)
    while op != "done":
        if op == "send":
            op, arg = _step(flow, inner.handle_request(arg))
        elif op == "sleep":
            time.sleep(arg)
            op, arg = _step(flow, None)
        else:
            with closing(arg):
                op, arg = _step(flow, arg.read())
    return arg


async def run_async(flow: Flow, inner: httpx.AsyncBaseTransport) -> Any:
    """Drives a flow with an async transport."""
    op, arg = _step(flow, None)
    while op != "done":
        if op == "send":
            response = await inner.handle_async_request(arg)
        elif op == "sleep":
            await anyio.sleep(arg)
            response = None
        else:
            try:
                response = await arg.aread()
            finally:
                await arg.aclose()
        op, arg = _step(flow, response)
    return arg

