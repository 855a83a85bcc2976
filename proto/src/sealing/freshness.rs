//! The age check of a sealed request: its sealing time, bound in the HPKE
//! `info`, against the receiver's clock.

use super::error::SealError;
use super::headers::SealedHeaders;
use super::MAX_REQUEST_AGE_SECS;

/// The current time, Unix seconds (0 before 1970).
pub fn unix_now() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_secs())
}

/// Refuses a request sealed more than [`MAX_REQUEST_AGE_SECS`] before or
/// after `now` (Unix seconds) with [`SealError::Stale`]. Check it only on a
/// request that opened: the time is then the sender's own.
pub fn check_fresh(headers: &SealedHeaders, now: u64) -> Result<(), SealError> {
    if headers.sealed_at.abs_diff(now) > MAX_REQUEST_AGE_SECS {
        return Err(SealError::Stale {
            sealed_at: headers.sealed_at,
            now,
        });
    }
    Ok(())
}
