"""What the sync and async transports share: which requests are sealed,
attestation state, building the sealed request and the plaintext response.
No I/O here; the cryptography is the Rust client crate (``_native``)."""

from __future__ import annotations

import json
import os
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path
from typing import Dict, Iterable, List, Optional, Tuple, Union
from urllib.parse import quote

import httpx

from . import _native
from .errors import ConfidentialError, EvidenceError, ResponseError

#: The API paths whose requests are sealed; any other POST is refused.
ENDPOINTS: Tuple[str, ...] = tuple(_native.endpoints())
#: A plain 400 to a sealed request may mean the stages restarted under the
#: same key id: re-attest to find out, at most this often (as the proxy does).
SUSPECT_REATTEST_SECS = 10.0
#: Reasons of a receipt failure that one re-attestation may cure.
UNKNOWN_SIGNER = ("unknown_signer", "link_unknown_signer")
# Request headers not forwarded: the sealing replaces them.
_DROP = {"content-type", "content-length", "transfer-encoding", "receipt-nonce",
         "hpke-key-id", "hpke-aead", "hpke-encapsulated-key", "hpke-sealed-at"}
_KEEP_FROM_UPSTREAM = ("retry-after", "x-request-id")

PathLike = Union[str, "os.PathLike[str]"]


@dataclass
class Plan:
    """One API request to seal."""

    root: str
    endpoint: str
    model: str
    stream: bool
    body: bytes
    nonce: bytes
    #: The caller's ``Authorization`` (a gateway serves a receipt's
    #: inclusion receipt to the API key that made the request only).
    auth: Optional[str] = None


@dataclass
class Trusted:
    """The last verified evidence for one gateway and model."""

    evidence: "_native.Evidence"
    at: float


def is_sealed(response: httpx.Response) -> bool:
    """Whether the upstream sealed its answer."""
    return "hpke-sealed" in response.headers or response.headers.get(
        "content-type", "").startswith("application/octet-stream")


def error_code(body: bytes) -> Optional[str]:
    """The OpenAI error ``code`` of a JSON error body, if any."""
    try:
        code = json.loads(body)["error"]["code"]
    except (ValueError, KeyError, TypeError):
        return None
    return code if isinstance(code, str) else None


class Core:
    """Shared state of a transport: policies, verified evidence, receipts."""

    def __init__(self, policies: Iterable[PathLike], aead: str, archive: Optional[PathLike],
                 insecure_plain_http: bool, receipts_kept: int,
                 log_state: Optional[PathLike] = None) -> None:
        self.policies: List[Tuple[str, str]] = [(str(p), Path(p).read_text()) for p in policies]
        if not self.policies:
            raise ValueError("at least one policy file is required")
        if aead not in ("aes128gcm", "chacha20poly1305"):
            raise ValueError(f"aead {aead!r}: expected 'aes128gcm' or 'chacha20poly1305'")
        self.aead = aead
        self.archive = Path(archive) if archive is not None else None
        if self.archive is not None:
            self.archive.mkdir(mode=0o700, parents=True, exist_ok=True)
        self.insecure_plain_http = insecure_plain_http
        # The latest log checkpoint seen (log-backed policies): in memory, or
        # kept in a file so that consistency holds across restarts too.
        self.log_state = _native.LogState(str(log_state) if log_state is not None else None)
        self.kept = receipts_kept
        self.lock = threading.Lock()
        self.trusted: Dict[Tuple[str, str], Trusted] = {}
        # The policy that first accepted each gateway and model: a
        # re-attestation must pass the same one (as the proxy's routes), so
        # that a host cannot switch a model to a laxer policy by serving
        # other evidence (e.g. one without log proofs).
        self.pinned: Dict[Tuple[str, str], str] = {}
        self.receipts: "OrderedDict[str, _native.Receipt]" = OrderedDict()
        self.last_receipt: Optional[_native.Receipt] = None

    def plan(self, request: httpx.Request, body: bytes) -> Optional[Plan]:
        """The plan for an API request; None for requests that pass unchanged
        (GET: model lists, nothing confidential). Any other request is refused:
        it would reach the host in the clear."""
        path = request.url.path
        endpoint = next((e for e in ENDPOINTS if path.endswith(e)), None)
        if endpoint is None or request.method != "POST":
            if request.method in ("GET", "HEAD", "OPTIONS"):
                return None
            raise ConfidentialError(
                "endpoint_not_sealed",
                f"{request.method} {path}: only POST to {', '.join(ENDPOINTS)} is sealed; "
                "this request would reach the host in the clear, so it was not sent")
        root = _native.base_url(str(request.url.copy_with(path=path[: -len(endpoint)] or "/",
                                                           query=None, fragment=None)),
                                self.insecure_plain_http)
        try:
            doc = json.loads(body)
        except ValueError as e:
            raise ConfidentialError("invalid_request", f"the request body is not JSON: {e}") from None
        model = doc.get("model") if isinstance(doc, dict) else None
        if not isinstance(model, str):
            raise ConfidentialError("invalid_request", "`model` (a string) is required")
        nonce_hex = request.headers.get("receipt-nonce")
        try:
            nonce = bytes.fromhex(nonce_hex) if nonce_hex is not None else os.urandom(16)
        except ValueError:
            nonce = b""
        if not 1 <= len(nonce) <= 64:
            raise ConfidentialError("invalid_request", "the receipt-nonce header must be hex, 1 to 64 bytes")
        return Plan(root, endpoint, model, doc.get("stream") is True, body, nonce,
                    request.headers.get("authorization"))

    def current(self, plan: Plan) -> Optional[Trusted]:
        """The evidence verified for the plan's gateway and model, if any."""
        with self.lock:
            return self.trusted.get((plan.root, plan.model))

    def attestation_request(self, plan: Plan) -> Tuple[httpx.Request, bytes]:
        """``GET /v1/attestation`` for the plan's model, with a fresh nonce."""
        nonce = os.urandom(32)
        url = f"{plan.root}/v1/attestation?nonce={nonce.hex()}&model={quote(plan.model, safe='')}"
        return httpx.Request("GET", url, headers={"accept": "application/cbor"}), nonce

    def accept(self, plan: Plan, status: int, body: bytes, nonce: bytes) -> Trusted:
        """Verifies fetched evidence against each policy until one accepts it
        (trusted once ``trust`` is called: after the log checks)."""
        if status != 200:
            raise EvidenceError("evidence_not_verified",
                                f"GET /v1/attestation for {plan.model}: HTTP {status}: "
                                f"{body[:300].decode(errors='replace')}")
        why = []
        with self.lock:
            pinned = self.pinned.get((plan.root, plan.model))
        for path, text in self.policies:
            if pinned is not None and path != pinned:
                continue
            try:
                evidence = _native.Evidence.verify(body, text, nonce)
            except EvidenceError as e:
                why.append(f"policy {path}: {e.message}")
                continue
            with self.lock:
                self.pinned.setdefault((plan.root, plan.model), path)
            return Trusted(evidence, time.monotonic())
        raise EvidenceError("evidence_not_verified",
                            f"model {plan.model}: no policy accepts the gateway's evidence: "
                            + "; ".join(why))

    def trust(self, plan: Plan, trusted: Trusted) -> None:
        """Makes verified evidence the one the plan's gateway and model seal to."""
        with self.lock:
            self.trusted[(plan.root, plan.model)] = trusted

    def seal(self, plan: Plan, trusted: Trusted, original: httpx.Request
             ) -> Tuple[httpx.Request, "_native.Sealed"]:
        """The request sealed to the attested entry key, with the caller's
        other headers (its API key is for the gateway)."""
        sealed = trusted.evidence.seal(plan.endpoint, plan.body, plan.nonce, self.aead)
        headers = [(k, v) for k, v in original.headers.multi_items() if k.lower() not in _DROP]
        headers += sealed.headers
        return httpx.Request("POST", original.url, headers=headers, content=sealed.body,
                             extensions=original.extensions), sealed

    def suspect(self, trusted: Trusted, response: httpx.Response, body: bytes) -> bool:
        """Whether a refused sealed request calls for re-attestation: the
        gateway no longer knows the key, or a plain 400 to evidence older
        than ``SUSPECT_REATTEST_SECS``."""
        if response.status_code != 400 or is_sealed(response):
            return False
        return (error_code(body) == "hpke_key_unknown"
                or time.monotonic() - trusted.at >= SUSPECT_REATTEST_SECS)

    @staticmethod
    def worth_retry(old: Trusted, new: Trusted, body: bytes) -> bool:
        """After re-attesting: whether sealing again may help."""
        return error_code(body) == "hpke_key_unknown" or old.evidence.entry_keys != new.evidence.entry_keys

    def not_success(self, sealed: "_native.Sealed", response: httpx.Response,
                    body: bytes) -> httpx.Response:
        """An answer that is not a sealed success: a host-made error passes
        through (OpenAI-shaped), a sealed stage error is opened."""
        if not is_sealed(response):
            if response.is_success:
                raise ResponseError("response_not_sealed",
                                    "the upstream answered a sealed request with an unsealed response")
            return self.response(response, body, response.headers.get("content-type", "application/json"))
        plain = sealed.open_error(response.status_code, body)
        return self.response(response, plain, "application/json")

    def response(self, upstream: httpx.Response, content: Union[bytes, httpx.SyncByteStream,
                                                                 httpx.AsyncByteStream],
                 content_type: str, receipt: Optional["_native.Receipt"] = None,
                 sealed: Optional["_native.Sealed"] = None,
                 inclusion: Optional[bytes] = None) -> httpx.Response:
        """The plaintext response handed to the caller, with the receipt
        headers ``gateway proxy`` sets (``receipt-verified`` is ``true`` only
        on a whole response whose receipt verified), the ``Receipt`` in
        ``extensions["receipt"]`` and, where the policy required it, the
        receipt's checked inclusion receipt in ``extensions["receipt_inclusion"]``."""
        headers = {"content-type": content_type,
                   "receipt-verified": "true" if receipt is not None else "false"}
        for k in _KEEP_FROM_UPSTREAM:
            if k in upstream.headers:
                headers[k] = upstream.headers[k]
        if sealed is not None:
            headers["receipt-nonce"] = sealed.nonce
        extensions = {}
        if receipt is not None:
            headers.update({"receipt-id": receipt.id, "receipt-sealing": receipt.sealing})
            if receipt.digest_salt:
                headers["receipt-digest-salt"] = receipt.digest_salt
            extensions["receipt"] = receipt
        if inclusion is not None:
            extensions["receipt_inclusion"] = inclusion
        if isinstance(content, bytes):
            return httpx.Response(upstream.status_code, headers=headers, content=content,
                                  extensions=extensions)
        return httpx.Response(upstream.status_code, headers=headers, stream=content,
                              extensions=extensions)

    def keep(self, sealed: "_native.Sealed", receipt: "_native.Receipt", response: bytes,
             inclusion: Optional[bytes] = None) -> None:
        """Keeps a verified receipt (and archives the exchange, with the
        receipt's inclusion receipt where one was checked, if asked)."""
        with self.lock:
            self.receipts[receipt.id] = receipt
            while len(self.receipts) > self.kept:
                self.receipts.popitem(last=False)
            self.last_receipt = receipt
        if self.archive is not None:
            sealed.archive(str(self.archive), receipt, response, inclusion)
