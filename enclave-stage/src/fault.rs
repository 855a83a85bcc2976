//! Test-only fault injection. Compiled in only with the `fault-injection`
//! Cargo feature (which also changes the binary, and so its measurement).
//! `STAGE_FAULT_STAGE=<index>` picks the stage; then
//! - `STAGE_FAULT_TOKENS=<n>` fails every micro-batch containing a sequence
//!   of exactly `n` tokens;
//! - `STAGE_FAULT_DELAY_MS=<ms>` delays every micro-batch by `ms`;
//! - `STAGE_FAULT_TOKEN_ID=<id>` (generation entry stage) fails every step
//!   whose input token ids contain `id`;
//! - `STAGE_FAULT_HOST_REPLAY_CAPACITY=<n>` (entry stage) shrinks the replay
//!   guard's partition for host-sealed requests to `n` keys;
//! - `STAGE_FAULT_PANIC=1` makes a step or micro-batch the fault fails
//!   panic instead, and
//!   the first `Stats` a host channel asks for panic its session (panic
//!   containment tests).

use proto::frames::BatchItem;

/// The configured fault, if any.
#[derive(Clone, Copy, Debug, Default)]
pub struct Fault {
    #[cfg_attr(not(feature = "fault-injection"), allow(dead_code))]
    stage: Option<u32>,
    #[cfg_attr(not(feature = "fault-injection"), allow(dead_code))]
    tokens: Option<u32>,
    #[cfg_attr(not(feature = "fault-injection"), allow(dead_code))]
    delay_ms: Option<u64>,
    #[cfg_attr(not(feature = "fault-injection"), allow(dead_code))]
    token_id: Option<u32>,
    #[cfg_attr(not(feature = "fault-injection"), allow(dead_code))]
    host_replay_capacity: Option<usize>,
    #[cfg_attr(not(feature = "fault-injection"), allow(dead_code))]
    panic: bool,
}

impl Fault {
    /// Reads the fault switch from the environment (no-op without the feature).
    pub fn from_env() -> Self {
        #[cfg(feature = "fault-injection")]
        {
            fn var<T: std::str::FromStr>(name: &str) -> Option<T> {
                std::env::var(name).ok().and_then(|v| v.parse().ok())
            }
            let f = Self {
                stage: var("STAGE_FAULT_STAGE"),
                tokens: var("STAGE_FAULT_TOKENS"),
                delay_ms: var("STAGE_FAULT_DELAY_MS"),
                token_id: var("STAGE_FAULT_TOKEN_ID"),
                host_replay_capacity: var("STAGE_FAULT_HOST_REPLAY_CAPACITY"),
                panic: var::<u8>("STAGE_FAULT_PANIC") == Some(1),
            };
            if f.stage.is_some() {
                tracing::warn!(fault = ?f, "FAULT INJECTION ENABLED (test build)");
            }
            f
        }
        #[cfg(not(feature = "fault-injection"))]
        Self::default()
    }

    /// The replay guard's capacity for host-sealed requests at `stage`, if
    /// the fault overrides it.
    pub fn host_replay_capacity(&self, stage: u32) -> Option<usize> {
        #[cfg(feature = "fault-injection")]
        if self.stage == Some(stage) {
            return self.host_replay_capacity;
        }
        let _ = stage;
        None
    }

    /// Applies the fault to a micro-batch at `stage`: sleeps if a delay is
    /// set, and returns whether the micro-batch must fail.
    pub fn fires(&self, stage: u32, items: &[BatchItem]) -> bool {
        #[cfg(feature = "fault-injection")]
        if self.stage == Some(stage) {
            if let Some(ms) = self.delay_ms {
                std::thread::sleep(std::time::Duration::from_millis(ms));
            }
            return self
                .tokens
                .is_some_and(|t| items.iter().any(|i| i.tokens == t));
        }
        let _ = (stage, items);
        false
    }

    /// Whether a fault that fires panics (instead of failing its step).
    pub fn panics(&self) -> bool {
        #[cfg(feature = "fault-injection")]
        return self.panic;
        #[cfg(not(feature = "fault-injection"))]
        false
    }

    /// Panics once per process at `stage` when `STAGE_FAULT_PANIC` is set:
    /// the first host session that asks for `Stats` dies of it.
    pub fn panic_once_in_session(&self, stage: u32) {
        #[cfg(feature = "fault-injection")]
        if self.stage == Some(stage) && self.panic {
            static ONCE: std::sync::atomic::AtomicBool = std::sync::atomic::AtomicBool::new(false);
            if !ONCE.swap(true, std::sync::atomic::Ordering::Relaxed) {
                panic!("injected panic in a host session");
            }
        }
        let _ = stage;
    }

    /// [`Fault::fires`] for a generation step; also fails a step whose input
    /// ids (entry stage) contain the configured token id.
    pub fn fires_step(&self, stage: u32, items: &[BatchItem], ids: Option<&[u32]>) -> bool {
        #[cfg(feature = "fault-injection")]
        if self.stage == Some(stage) {
            if let (Some(t), Some(ids)) = (self.token_id, ids) {
                if ids.contains(&t) {
                    return true;
                }
            }
        }
        let _ = ids;
        self.fires(stage, items)
    }
}
