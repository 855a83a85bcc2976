"""httpx transports that seal every API request to the attested entry stage
and verify every answer's receipt before handing it out.

``SealedTransport`` (sync) and ``AsyncSealedTransport`` wrap an inner httpx
transport (plain ``httpx.HTTPTransport()`` by default). For each POST to an
API path (``/v1/embeddings``, ``/v1/completions``, ``/v1/chat/completions``):

1. on first use of a model (and again when the gateway's keys change), fetch
   ``GET /v1/attestation`` with a fresh nonce and verify it against the
   policies; no policy accepts it: ``EvidenceError``;
2. seal the body to the attested entry key, send it with a fresh
   ``receipt-nonce``;
3. whole answers: open, verify the receipt, return the plaintext with the
   receipt headers (``receipt-verified: true``, ``receipt-id``) and the
   ``Receipt`` in ``response.extensions["receipt"]``;
4. streams: hand out whole events as they open; ``data: [DONE]`` only after
   the receipt over the whole stream verified (then it is in
   ``response.extensions["receipt"]``); otherwise raise instead.

Under a log-backed policy (``gateway policy pin --log-key``) each
attestation's log checkpoint must be consistent with the latest one seen
(``log_state``), and under one with ``receipts_logged`` an answer is handed
out only once its receipt is proven included in the log (the RFC 9942
inclusion receipt is then in ``response.extensions["receipt_inclusion"]``);
otherwise ``EvidenceError`` / ``ReceiptError`` (``receipt_not_logged``).

Nothing is ever sent or returned in the clear in place of a sealed exchange:
other POSTs are refused, an unsealed or altered answer raises.
"""

from __future__ import annotations

from contextlib import closing
from typing import AsyncIterator, Dict, Iterable, Iterator, Optional

import httpx

from . import _native
from ._core import Core, PathLike
from ._flow import exchange, run_async, run_sync, stream_end


class _Base:
    def __init__(self, policies: Iterable[PathLike], *, aead: str = "aes128gcm",
                 archive: Optional[PathLike] = None, insecure_plain_http: bool = False,
                 receipts_kept: int = 1024, log_state: Optional[PathLike] = None) -> None:
        self._core = Core(policies, aead, archive, insecure_plain_http, receipts_kept, log_state)

    @property
    def receipts(self) -> Dict[str, "_native.Receipt"]:
        """The last verified receipts by id (oldest first)."""
        with self._core.lock:
            return dict(self._core.receipts)

    @property
    def last_receipt(self) -> Optional["_native.Receipt"]:
        """The most recently verified receipt."""
        return self._core.last_receipt

    def _events(self, result, stream_class) -> httpx.Response:
        """The response to hand out: as the flow made it, or a sealed stream
        wrapped in ``stream_class`` (which fills in the receipt once it verified;
        httpx copies the extensions dict, so it gets the response's own)."""
        if isinstance(result, httpx.Response):
            return result
        _, _, sealed, upstream = result
        events = stream_class(self, result)
        out = self._core.response(upstream, events, "text/event-stream", sealed=sealed)
        events.extensions = out.extensions
        return out


class SealedTransport(_Base, httpx.BaseTransport):
    """A sync httpx transport: ``httpx.Client(transport=SealedTransport([...]))``.

    Args:
        policies: measurement policy files (TOML, as for ``gateway proxy``);
            a model is served when one of them accepts its evidence.
        transport: the inner transport (default ``httpx.HTTPTransport()``).
        aead: ``"aes128gcm"`` or ``"chacha20poly1305"``.
        archive: a folder to write every verified exchange to (plaintext:
            keep it in your own trust domain), as ``gateway proxy --archive``.
        insecure_plain_http: allow ``http://`` to a host that is not loopback.
        receipts_kept: how many verified receipts ``receipts`` keeps.
        log_state: with log-backed policies, a file (JSON) that keeps the
            latest transparency-log checkpoint seen, so that every later one
            must be consistent with it across restarts too (as ``gateway
            proxy --log-state``); without it, it is kept in memory.
    """

    def __init__(self, policies: Iterable[PathLike], *,
                 transport: Optional[httpx.BaseTransport] = None, **options) -> None:
        super().__init__(policies, **options)
        self._inner = transport or httpx.HTTPTransport()

    def handle_request(self, request: httpx.Request) -> httpx.Response:
        result = run_sync(exchange(self._core, request, request.read()), self._inner)
        return self._events(result, _SyncEvents)

    def close(self) -> None:
        self._inner.close()


class _SyncEvents(httpx.SyncByteStream):
    def __init__(self, transport: SealedTransport, result) -> None:
        self._t = transport
        self._plan, _, self._sealed, self._upstream = result
        self.extensions: dict = {}

    def __iter__(self) -> Iterator[bytes]:
        opener = self._sealed.stream()
        with closing(self._upstream):
            for piece in self._upstream.iter_raw():
                yield opener.feed(piece)
                if opener.is_complete:
                    break
        end = stream_end(self._t._core, self._plan, self._sealed, opener, self.extensions)
        yield run_sync(end, self._t._inner)

    def close(self) -> None:
        self._upstream.close()


class AsyncSealedTransport(_Base, httpx.AsyncBaseTransport):
    """The async twin of ``SealedTransport``:
    ``httpx.AsyncClient(transport=AsyncSealedTransport([...]))``. Same
    arguments; ``transport`` defaults to ``httpx.AsyncHTTPTransport()``."""

    def __init__(self, policies: Iterable[PathLike], *,
                 transport: Optional[httpx.AsyncBaseTransport] = None, **options) -> None:
        super().__init__(policies, **options)
        self._inner = transport or httpx.AsyncHTTPTransport()

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        body = await request.aread()
        result = await run_async(exchange(self._core, request, body), self._inner)
        return self._events(result, _AsyncEvents)

    async def aclose(self) -> None:
        await self._inner.aclose()


class _AsyncEvents(httpx.AsyncByteStream):
    def __init__(self, transport: AsyncSealedTransport, result) -> None:
        self._t = transport
        self._plan, _, self._sealed, self._upstream = result
        self.extensions: dict = {}

    async def __aiter__(self) -> AsyncIterator[bytes]:
        opener = self._sealed.stream()
        try:
            async for piece in self._upstream.aiter_raw():
                yield opener.feed(piece)
                if opener.is_complete:
                    break
        finally:
            await self._upstream.aclose()
        end = stream_end(self._t._core, self._plan, self._sealed, opener, self.extensions)
        yield await run_async(end, self._t._inner)

    async def aclose(self) -> None:
        await self._upstream.aclose()


def http_client(policies: Iterable[PathLike], **options) -> httpx.Client:
    """An ``httpx.Client`` with a ``SealedTransport``: pass it to
    ``openai.OpenAI(http_client=...)``. Options as for ``SealedTransport``;
    ``timeout`` (default 120 s) goes to the client."""
    timeout = options.pop("timeout", 120.0)
    return httpx.Client(transport=SealedTransport(policies, **options), timeout=timeout)


def async_http_client(policies: Iterable[PathLike], **options) -> httpx.AsyncClient:
    """An ``httpx.AsyncClient`` with an ``AsyncSealedTransport``: pass it to
    ``openai.AsyncOpenAI(http_client=...)``."""
    timeout = options.pop("timeout", 120.0)
    return httpx.AsyncClient(transport=AsyncSealedTransport(policies, **options), timeout=timeout)
