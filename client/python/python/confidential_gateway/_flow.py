"""One sealed exchange as a generator that yields its I/O: written once,
driven by the sync transport (``run_sync``) and the async one
(``run_async``). It yields ``("send", request)`` for a response whose body
is not read yet, and ``("read", response)`` for a response's whole body."""

from __future__ import annotations

from contextlib import closing
from typing import Any, Callable, Generator, Optional, Tuple

import httpx

from . import _native
from ._core import UNKNOWN_SIGNER, Core, Plan, is_sealed
from .errors import ReceiptError

Flow = Generator[Tuple[str, Any], Any, Any]


def attest(core: Core, plan: Plan) -> Flow:
    """Fetches and verifies the plan's evidence; returns the ``Trusted``."""
    request, nonce = core.attestation_request(plan)
    response = yield ("send", request)
    body = yield ("read", response)
    return core.accept(plan, response.status_code, body, nonce)


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
        core.keep(sealed, receipt, plain)
        return core.response(response, plain, "application/json", receipt, sealed)
    raise AssertionError("unreachable")


def stream_end(core: Core, plan: Plan, sealed: "_native.Sealed",
               opener: "_native.StreamOpener", extensions: dict) -> Flow:
    """After the last sealed chunk: the receipt over the whole stream
    verified (or a stage's error event ended it); returns what is still to
    hand out (``[DONE]``)."""
    opener.finish()
    receipt, rest = yield from verified(core, plan, opener.verify)
    if receipt is not None:
        core.keep(sealed, receipt, opener.all)
        extensions["receipt"] = receipt
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
        else:
            try:
                response = await arg.aread()
            finally:
                await arg.aclose()
        op, arg = _step(flow, response)
    return arg

