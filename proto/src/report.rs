//! One line of a verification report, the same for every verifier: a
//! receipt's checks (`receipt::verify_receipt`, whose lines carry the typed
//! [`crate::receipt::ReceiptError`]), an evidence bundle's
//! (`bundle::EvidenceBundle::verify`) and the client's `gateway verify`
//! output, which adds warnings and information lines.

use serde::Serialize;
use std::fmt;

/// Outcome of one check.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum CheckStatus {
    /// The check held.
    Pass,
    /// The check failed.
    Fail,
    /// Not checked (input not given).
    Skipped,
    /// Holds, with a warning the reader should see (mock evidence, say).
    Warn,
    /// Not a check: information about what was verified.
    Info,
}

impl CheckStatus {
    /// The four-letter label of the text form.
    pub fn label(self) -> &'static str {
        match self {
            CheckStatus::Pass => "PASS",
            CheckStatus::Fail => "FAIL",
            CheckStatus::Skipped => "SKIP",
            CheckStatus::Warn => "WARN",
            CheckStatus::Info => "INFO",
        }
    }

    /// The name in the JSON form (`pass`, `fail`, `skipped`, `warn`, `info`).
    pub fn json(self) -> &'static str {
        match self {
            CheckStatus::Pass => "pass",
            CheckStatus::Fail => "fail",
            CheckStatus::Skipped => "skipped",
            CheckStatus::Warn => "warn",
            CheckStatus::Info => "info",
        }
    }
}

/// A reason a check failed that has a stable machine-readable code.
pub trait ReasonCode {
    /// The code (e.g. `bad_signature`).
    fn code(&self) -> &'static str;
}

impl ReasonCode for &'static str {
    fn code(&self) -> &'static str {
        self
    }
}

/// One line of a verification report. `E` is why it failed, when the
/// verifier says so in a form a program can act on (a receipt's
/// [`crate::receipt::ReceiptError`]; a bare reason code by default).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Check<E = &'static str> {
    /// Check name, e.g. `receipt.signature`, `link[1].data_flow`.
    pub name: String,
    /// Outcome.
    pub status: CheckStatus,
    /// Human-readable detail (the reason, when it failed).
    pub detail: String,
    /// The reason, when it failed and the verifier gives one.
    pub error: Option<E>,
}

impl<E> Check<E> {
    /// A line without a typed reason.
    pub fn new(status: CheckStatus, name: impl Into<String>, detail: impl Into<String>) -> Self {
        Self {
            name: name.into(),
            status,
            detail: detail.into(),
            error: None,
        }
    }

    /// Whether it is a check that held.
    pub fn passed(&self) -> bool {
        self.status == CheckStatus::Pass
    }

    /// Whether it is a check that failed.
    pub fn failed(&self) -> bool {
        self.status == CheckStatus::Fail
    }
}

impl<E: ReasonCode> Check<E> {
    /// Machine-readable form: `{name, status, detail, reason}`.
    pub fn to_json(&self) -> serde_json::Value {
        serde_json::json!({
            "name": self.name,
            "status": self.status.json(),
            "detail": self.detail,
            "reason": self.error.as_ref().map(|e| e.code()),
        })
    }
}

/// `LABEL name: detail [reason]`.
impl<E: ReasonCode> fmt::Display for Check<E> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{} {}: {}", self.status.label(), self.name, self.detail)?;
        if let Some(e) = &self.error {
            write!(f, " [{}]", e.code())?;
        }
        Ok(())
    }
}
