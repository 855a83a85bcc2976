//! The stage's clock against a reference clock: the KVM PTP clock
//! (`/dev/ptp0`, the `ptp_kvm` driver of AWS's enclave kernels), which reads
//! the hypervisor's time.
//!
//! An enclave has no NTP, and its clock drifts (seconds per week are
//! reported). The entry stage judges every sealed request's sealing time
//! by its own clock ([`proto::sealing::check_fresh`]: at most
//! [`MAX_REQUEST_AGE_SECS`] either way), and the exit stage stamps receipts
//! with it. A clock further off than that window would refuse fresh
//! requests or accept old ones (replays the guard no longer remembers), so
//! a stage whose clock is off by more than [`MAX_REQUEST_AGE_SECS`] from the
//! reference refuses to be configured (the gateway's `/readyz` then names
//! the skew) and refuses to open sealed requests. Where there is no
//! reference clock (no `/dev/ptp0`: outside an enclave, or a kernel without
//! `ptp_kvm`), the check says so and is skipped.
//!
//! The check runs at start and again when the last one is older than
//! [`RECHECK`] (at a configuration or a sealed request), so a clock that
//! drifts out, or is put right, is noticed while the stage runs.

use proto::sealing::MAX_REQUEST_AGE_SECS;
use std::path::{Path, PathBuf};
use std::sync::Mutex;
use std::time::{Duration, Instant};

/// The KVM PTP clock's device in AWS's enclave kernels.
pub const PTP_DEVICE: &str = "/dev/ptp0";
/// How old a check may be before it is made again.
pub const RECHECK: Duration = Duration::from_secs(60);

/// The outcome of one clock check.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum ClockState {
    /// No reference clock could be read: the check is skipped.
    Unchecked {
        /// Why (no device, or the read failed).
        reason: String,
    },
    /// The stage's clock is within the window of the reference.
    Within {
        /// The stage's clock minus the reference, in milliseconds.
        skew_ms: i64,
    },
    /// The stage's clock is off by more than the window: sealed requests
    /// are refused.
    Outside {
        /// The stage's clock minus the reference, in milliseconds.
        skew_ms: i64,
    },
}

impl ClockState {
    /// Whether sealed requests must be refused.
    pub fn refuses(&self) -> bool {
        matches!(self, Self::Outside { .. })
    }

    /// One line for logs, `ConfigureFailed` and the gateway's `/readyz`.
    pub fn describe(&self, device: &Path) -> String {
        let secs = |ms: i64| ms as f64 / 1000.0;
        match self {
            Self::Unchecked { reason } => {
                format!("clock not checked: {reason}")
            }
            Self::Within { skew_ms } => format!(
                "clock checked against {}: {:+.3} s off, within the ±{MAX_REQUEST_AGE_SECS} s sealed-request window",
                device.display(),
                secs(*skew_ms)
            ),
            Self::Outside { skew_ms } => format!(
                "the stage's clock is {:+.3} s off {}, beyond the ±{MAX_REQUEST_AGE_SECS} s sealed-request window: \
                 refusing to serve sealed requests until it is set right",
                secs(*skew_ms),
                device.display()
            ),
        }
    }
}

/// The decision alone: `system` and `reference` are the two clocks' times
/// (nanoseconds since the Unix epoch) read at the same moment. Outside when
/// they differ by more than [`MAX_REQUEST_AGE_SECS`].
pub fn judge(system_ns: i128, reference_ns: i128) -> ClockState {
    let skew = system_ns - reference_ns;
    let skew_ms = (skew / 1_000_000).clamp(i64::MIN as i128, i64::MAX as i128) as i64;
    if skew.unsigned_abs() > u128::from(MAX_REQUEST_AGE_SECS) * 1_000_000_000 {
        ClockState::Outside { skew_ms }
    } else {
        ClockState::Within { skew_ms }
    }
}

/// Reads `CLOCK_REALTIME` and the PTP clock at `device` at (nearly) the same
/// moment: the system clock is read before and after the PTP clock, and
/// their midpoint taken. Returns `(system_ns, reference_ns)`.
#[cfg(target_os = "linux")]
pub fn read_ptp(device: &Path) -> std::io::Result<(i128, i128)> {
    use std::os::fd::AsRawFd;
    let file = std::fs::File::open(device)?;
    // A dynamic POSIX clock's id (the kernel's FD_TO_CLOCKID): the file
    // descriptor complemented, shifted left by 3, with CLOCKFD (3).
    let id: libc::clockid_t = ((!file.as_raw_fd()) << 3) | 3;
    let read = |clock: libc::clockid_t| -> std::io::Result<i128> {
        let mut ts = libc::timespec {
            tv_sec: 0,
            tv_nsec: 0,
        };
        // SAFETY: `ts` is a valid, writable timespec; clock_gettime writes
        // only it, and `file` keeps the clock's descriptor open meanwhile.
        if unsafe { libc::clock_gettime(clock, &mut ts) } != 0 {
            return Err(std::io::Error::last_os_error());
        }
        Ok(i128::from(ts.tv_sec) * 1_000_000_000 + i128::from(ts.tv_nsec))
    };
    let before = read(libc::CLOCK_REALTIME)?;
    let reference = read(id)?;
    let after = read(libc::CLOCK_REALTIME)?;
    Ok((before + (after - before) / 2, reference))
}

/// Reading a PTP clock needs Linux.
#[cfg(not(target_os = "linux"))]
pub fn read_ptp(_device: &Path) -> std::io::Result<(i128, i128)> {
    Err(std::io::Error::new(
        std::io::ErrorKind::Unsupported,
        "PTP clocks are read on Linux only",
    ))
}

/// Checks the clock against `device` once.
pub fn check(device: &Path) -> ClockState {
    if !device.exists() {
        return ClockState::Unchecked {
            reason: format!(
                "no {} (no KVM PTP clock: outside an enclave, or a kernel without ptp_kvm); \
                 sealed requests are judged by this stage's own clock",
                device.display()
            ),
        };
    }
    match read_ptp(device) {
        Ok((system, reference)) => judge(system, reference),
        Err(e) => ClockState::Unchecked {
            reason: format!("{} cannot be read ({e})", device.display()),
        },
    }
}

/// The stage's clock check, repeated when older than [`RECHECK`].
pub struct ClockGuard {
    device: PathBuf,
    last: Mutex<(Instant, ClockState)>,
}

impl ClockGuard {
    /// Checks the clock against `device` now and logs the outcome.
    pub fn new(device: impl Into<PathBuf>) -> Self {
        let device = device.into();
        let state = check(&device);
        log(&device, &state);
        Self {
            device,
            last: Mutex::new((Instant::now(), state)),
        }
    }

    /// The latest outcome, checked again when older than [`RECHECK`] (a
    /// change is logged).
    pub fn current(&self) -> ClockState {
        let mut last = self.last.lock().expect("clock check lock");
        if last.0.elapsed() >= RECHECK {
            let state = check(&self.device);
            if std::mem::discriminant(&last.1) != std::mem::discriminant(&state) {
                log(&self.device, &state);
            }
            *last = (Instant::now(), state);
        }
        last.1.clone()
    }

    /// [`Self::current`] as one line.
    pub fn describe(&self) -> String {
        self.current().describe(&self.device)
    }

    /// Why sealed requests are refused now, if they are.
    pub fn refusal(&self) -> Option<String> {
        let state = self.current();
        state.refuses().then(|| state.describe(&self.device))
    }
}

fn log(device: &Path, state: &ClockState) {
    let line = state.describe(device);
    match state {
        ClockState::Outside { .. } => tracing::error!("{line}"),
        ClockState::Unchecked { .. } => tracing::warn!("{line}"),
        ClockState::Within { .. } => tracing::info!("{line}"),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const S: i128 = 1_000_000_000;
    const NOW: i128 = 1_750_000_000 * S;

    #[test]
    fn skew_within_the_window_is_accepted_either_way() {
        for skew in [0, S / 2, -S / 2, 299 * S, -299 * S, 300 * S, -300 * S] {
            let state = judge(NOW + skew, NOW);
            assert_eq!(
                state,
                ClockState::Within {
                    skew_ms: (skew / 1_000_000) as i64
                }
            );
            assert!(!state.refuses());
        }
    }

    #[test]
    fn skew_beyond_the_window_refuses_either_way() {
        for skew in [
            300 * S + 1,
            -(300 * S + 1),
            301 * S,
            -301 * S,
            3600 * S,
            -NOW,
        ] {
            let state = judge(NOW + skew, NOW);
            assert_eq!(
                state,
                ClockState::Outside {
                    skew_ms: (skew / 1_000_000) as i64
                },
                "skew {skew} ns"
            );
            assert!(state.refuses());
        }
    }

    #[test]
    fn the_window_is_the_sealed_request_freshness_window() {
        let w = i128::from(MAX_REQUEST_AGE_SECS) * S;
        assert!(!judge(NOW + w, NOW).refuses());
        assert!(judge(NOW + w + 1, NOW).refuses());
        assert!(judge(NOW - w - 1, NOW).refuses());
    }

    #[test]
    fn the_refusal_names_the_skew_the_device_and_the_window() {
        let line = ClockState::Outside { skew_ms: -412_250 }.describe(Path::new("/dev/ptp0"));
        assert!(line.contains("-412.250 s off /dev/ptp0"), "{line}");
        assert!(line.contains("±300 s"), "{line}");
        assert!(line.contains("refusing to serve sealed requests"), "{line}");
        let line = ClockState::Within { skew_ms: 1_500 }.describe(Path::new("/dev/ptp0"));
        assert!(line.contains("+1.500 s off"), "{line}");
    }

    #[test]
    fn without_the_device_the_check_is_skipped_and_says_so() {
        let dir = std::env::temp_dir().join(format!("no-ptp-{}", std::process::id()));
        let state = check(&dir.join("ptp0"));
        let ClockState::Unchecked { reason } = &state else {
            panic!("{state:?}")
        };
        assert!(reason.contains("no KVM PTP clock"), "{reason}");
        assert!(!state.refuses());
        let guard = ClockGuard::new(dir.join("ptp0"));
        assert_eq!(guard.refusal(), None);
        assert!(guard.describe().starts_with("clock not checked: no "));
    }

    #[test]
    fn a_device_that_is_no_clock_is_reported_not_trusted() {
        // A regular file opens, but is no dynamic POSIX clock: the read
        // fails (EINVAL) and the check is skipped, naming the error.
        let f = std::env::temp_dir().join(format!("fake-ptp-{}", std::process::id()));
        std::fs::write(&f, b"").unwrap();
        let state = check(&f);
        std::fs::remove_file(&f).ok();
        let ClockState::Unchecked { reason } = &state else {
            panic!("{state:?}")
        };
        assert!(reason.contains("cannot be read"), "{reason}");
    }
}
