//! Test-only fault injection. Compiled in only with the `fault-injection`
//! Cargo feature (which also changes the binary, and so its measurement):
//! `STAGE_FAULT_STAGE=<index>` and `STAGE_FAULT_TOKENS=<n>` make that stage
//! fail every micro-batch containing a sequence of exactly `n` tokens.

use proto::frames::BatchItem;

/// The configured fault, if any.
#[derive(Clone, Copy, Debug, Default)]
pub struct Fault {
    #[cfg_attr(not(feature = "fault-injection"), allow(dead_code))]
    trigger: Option<(u32, u32)>,
}

impl Fault {
    /// Reads the fault switch from the environment (no-op without the feature).
    pub fn from_env() -> Self {
        #[cfg(feature = "fault-injection")]
        {
            let stage = std::env::var("STAGE_FAULT_STAGE")
                .ok()
                .and_then(|v| v.parse().ok());
            let tokens = std::env::var("STAGE_FAULT_TOKENS")
                .ok()
                .and_then(|v| v.parse().ok());
            if let (Some(s), Some(t)) = (stage, tokens) {
                tracing::warn!(
                    stage = s,
                    tokens = t,
                    "FAULT INJECTION ENABLED (test build)"
                );
                return Self {
                    trigger: Some((s, t)),
                };
            }
        }
        Self::default()
    }

    /// Whether this stage must fail a micro-batch with these items.
    pub fn fires(&self, stage: u32, items: &[BatchItem]) -> bool {
        #[cfg(feature = "fault-injection")]
        if let Some((s, t)) = self.trigger {
            return s == stage && items.iter().any(|i| i.tokens == t);
        }
        let _ = (stage, items);
        false
    }
}
