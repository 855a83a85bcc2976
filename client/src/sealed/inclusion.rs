//! Receipts proven logged, for a log-backed policy with `receipts_logged`:
//! the RFC 9942 inclusion receipt of a receipt's log entry (its SHA-256
//! only), checked against the policy's log key. No I/O: `gateway proxy`
//! and the Python package fetch it from `GET /v1/receipts/{id}/inclusion`
//! ([`inclusion_path`]) until it is there (the gateway appends receipts in
//! batches), check it here, then check its tree against the latest
//! checkpoint they kept ([`crate::log_state::LogState::check_root`]).

use super::{Attested, Refused};
use proto::transparency::{verify_receipt_logged, ProvenInclusion};
use std::time::Duration;

/// The refusal code of an answer whose receipt is not proven logged.
pub const NOT_LOGGED: &str = "receipt_not_logged";

/// How long a client waits for a receipt's entry to be appended before it
/// refuses the answer (the gateway appends every `receipt_batch_ms`).
pub const INCLUSION_WAIT: Duration = Duration::from_secs(10);

/// The first pause between two asks; each next one doubles, up to
/// [`INCLUSION_POLL_MAX`].
pub const INCLUSION_POLL_FIRST: Duration = Duration::from_millis(50);

/// The longest pause between two asks.
pub const INCLUSION_POLL_MAX: Duration = Duration::from_secs(1);

/// The API path that serves receipt `id`'s inclusion receipt.
pub fn inclusion_path(id: &[u8; 16]) -> String {
    format!("/v1/receipts/{}/inclusion", hex::encode(id))
}

impl Attested {
    /// Whether the policy requires every receipt to be proven logged.
    pub fn receipts_logged(&self) -> bool {
        self.log.as_ref().is_some_and(|l| l.receipts_logged)
    }

    /// Checks `inclusion`, an RFC 9942 receipt, proves that the entry of
    /// `receipt` (its COSE_Sign1 bytes) is in the policy's log; what it
    /// proves, or the refusal (also when the policy names no log).
    pub fn check_inclusion(
        &self,
        receipt: &[u8],
        inclusion: &[u8],
    ) -> Result<ProvenInclusion, Refused> {
        let Some(log) = &self.log else {
            return Err(Refused::new(
                NOT_LOGGED,
                "the policy names no transparency log to check a receipt's inclusion against",
            ));
        };
        verify_receipt_logged(&log.log_key, receipt, inclusion)
            .map_err(|why| Refused::new(NOT_LOGGED, format!("{why}; the response was withheld")))
    }
}

/// The refusal of an answer whose inclusion receipt never came: `why` says
/// what the gateway answered last.
pub fn never_logged(why: &str) -> Refused {
    Refused::new(
        NOT_LOGGED,
        format!(
            "the policy requires receipts to be logged, and the gateway served no inclusion receipt within {} s ({why}); the response was withheld",
            INCLUSION_WAIT.as_secs()
        ),
    )
}
