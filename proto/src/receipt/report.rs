//! The report of a receipt's verification: one line per check in the
//! order they ran ([`Check`]), and the verdict ([`VerifyReport`]).

use super::error::ReceiptError;
use super::format::{ReceiptBody, Sealing};
pub use crate::report::CheckStatus;

/// One line of a receipt's verification report: the shared report line
/// with the typed reason.
pub type Check = crate::report::Check<ReceiptError>;

impl crate::report::ReasonCode for ReceiptError {
    fn code(&self) -> &'static str {
        ReceiptError::code(self)
    }
}

/// The result of [`verify_receipt`]: every check in order and the verdict
/// (the first failure).
#[derive(Clone, Debug)]
pub struct VerifyReport {
    /// Checks in the order they ran.
    pub checks: Vec<Check>,
    /// The decoded receipt, once its signature and signer verified.
    pub receipt: Option<ReceiptBody>,
    /// Whether the receipt's `sealing` was proven against the client's own
    /// encapsulated key (check `sealing` passed), rather than taken on the
    /// host's word.
    pub sealing_proven: bool,
}

impl VerifyReport {
    /// `Some(sealing)` only when it was proven against the client's key:
    /// `Some(Sealing::Enclave)` means the entry stage opened exactly what the
    /// client sealed, so the host relayed ciphertext only.
    pub fn proven_sealing(&self) -> Option<Sealing> {
        self.receipt
            .as_ref()
            .filter(|_| self.sealing_proven && self.ok())
            .map(|r| r.sealing)
    }

    /// Whether every check passed (skipped ones aside).
    pub fn ok(&self) -> bool {
        self.failure().is_none()
    }

    /// The first failed check's reason.
    pub fn failure(&self) -> Option<&ReceiptError> {
        self.checks.iter().find_map(|c| c.error.as_ref())
    }

    /// `Ok` or the first failure.
    pub fn verdict(&self) -> Result<(), ReceiptError> {
        self.failure().map_or(Ok(()), |e| Err(e.clone()))
    }

    /// Machine-readable form: `{ok, reason, checks: [{name, status, detail,
    /// reason}], receipt: {…} | null}`.
    pub fn to_json(&self) -> serde_json::Value {
        let checks: Vec<_> = self.checks.iter().map(Check::to_json).collect();
        let receipt = self.receipt.as_ref().map(|r| {
            serde_json::json!({
                "receipt_id": hex::encode(r.receipt_id),
                "issued_at_ms": r.issued_at_ms,
                "endpoint": r.endpoint,
                "model_id": r.model_id,
                "manifest_digest": r.manifest_digest.hex(),
                "request_digest": r.request_digest.hex(),
                "response_digest": r.response_digest.hex(),
                "client_nonce": r.client_nonce.as_ref().map(hex::encode),
                "sequence": r.sequence,
                "mock": r.mock,
                "sealing": r.sealing.as_str(),
                "sealing_proven": self.sealing_proven,
                "version": r.version,
                "stages": r.links(),
            })
        });
        serde_json::json!({
            "ok": self.ok(),
            "reason": self.failure().map(|e| e.code()),
            "checks": checks,
            "receipt": receipt,
        })
    }
}

pub(super) struct Report(pub(super) Vec<Check>);

impl Report {
    pub(super) fn pass(&mut self, name: impl Into<String>, detail: impl Into<String>) {
        self.0.push(Check {
            name: name.into(),
            status: CheckStatus::Pass,
            detail: detail.into(),
            error: None,
        });
    }

    pub(super) fn skip(&mut self, name: impl Into<String>, detail: impl Into<String>) {
        self.0.push(Check {
            name: name.into(),
            status: CheckStatus::Skipped,
            detail: detail.into(),
            error: None,
        });
    }

    pub(super) fn fail(&mut self, name: impl Into<String>, error: ReceiptError) {
        self.0.push(Check {
            name: name.into(),
            status: CheckStatus::Fail,
            detail: error.to_string(),
            error: Some(error),
        });
    }

    /// The value of `result`, or `None` with its error recorded as a failed
    /// check `name` (a passed check is the caller's to record, with detail).
    pub(super) fn require<T>(
        &mut self,
        name: impl Into<String>,
        result: Result<T, ReceiptError>,
    ) -> Option<T> {
        result.map_err(|e| self.fail(name, e)).ok()
    }

    /// Records `result`; returns whether it passed.
    pub(super) fn check(
        &mut self,
        name: impl Into<String>,
        result: Result<String, ReceiptError>,
    ) -> bool {
        match result {
            Ok(detail) => {
                self.pass(name, detail);
                true
            }
            Err(e) => {
                self.fail(name, e);
                false
            }
        }
    }
}
