"""Sealed requests and verified receipts for the confidential inference
gateway, inside your own process.

    import openai, confidential_gateway as cg
    client = openai.OpenAI(base_url="https://gateway.example/v1", api_key="...",
                           http_client=cg.http_client(["policy.toml"]))
    r = client.embeddings.create(model="all-MiniLM-L6-v2", input=["hello"])

Every API request is sealed (RFC 9180 HPKE) to the entry stage whose
attestation evidence verified against your policy; every answer is opened
here and handed out only after its signed receipt verified. Anything else
raises a ``ConfidentialError``. The cryptography is the project's Rust client
crate, the same code as ``gateway verify`` and ``gateway proxy``.
"""

from ._native import Evidence, LogState, Receipt, Sealed, StreamOpener
from .errors import ConfidentialError, EvidenceError, ReceiptError, ResponseError
from .transport import AsyncSealedTransport, SealedTransport, async_http_client, http_client

__all__ = [
    "AsyncSealedTransport", "ConfidentialError", "Evidence", "EvidenceError", "LogState",
    "Receipt", "ReceiptError", "ResponseError", "Sealed", "SealedTransport", "StreamOpener",
    "async_http_client", "http_client", "inclusion_of", "receipt_of",
]


def _extensions(response: object) -> dict:
    http = getattr(response, "http_response", None) or getattr(response, "response", None) or response
    return getattr(http, "extensions", None) or {}


def receipt_of(response: object) -> "Receipt | None":
    """The verified receipt of an httpx response, an openai raw response
    (``client.….with_raw_response.create(...)``) or an openai stream once it
    has been read to the end; None if there is none (yet)."""
    return _extensions(response).get("receipt")


def inclusion_of(response: object) -> "bytes | None":
    """Under a policy that requires logged receipts: the checked RFC 9942
    inclusion receipt of the response's receipt (as ``receipt_of`` finds
    it); None otherwise."""
    return _extensions(response).get("receipt_inclusion")
