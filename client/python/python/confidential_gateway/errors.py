"""Exceptions: every one means that nothing unverified was handed out.

Each carries the machine-readable ``code`` that ``gateway proxy`` puts in its
502 errors (e.g. ``receipt_verification_failed``), the ``message`` and, for a
receipt, the ``reason`` of the first failed check (e.g. ``unknown_signer``).
"""

from __future__ import annotations

from typing import Optional


class ConfidentialError(Exception):
    """A request could not be sealed, or its answer could not be verified."""

    def __init__(self, code: str, message: str, reason: Optional[str] = None) -> None:
        super().__init__(f"{code}: {message}")
        self.code = code
        self.message = message
        self.reason = reason


class EvidenceError(ConfidentialError):
    """The gateway's attestation evidence does not verify against any policy."""


class ResponseError(ConfidentialError):
    """The answer is not sealed, does not open, or its HTTP status was altered."""


class ReceiptError(ConfidentialError):
    """The answer's receipt is missing or does not verify; the answer was withheld."""
