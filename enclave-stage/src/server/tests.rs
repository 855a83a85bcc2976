//! Stage server unit tests.

use super::requests::replay_refusal;
use proto::sealing::SealError;
use std::time::Duration;

#[test]
fn a_full_replay_guard_asks_to_retry() {
    let full = replay_refusal(SealError::ReplayCacheFull, Duration::from_millis(2500));
    assert_eq!((full.status, full.retry_after_secs), (503, Some(2)));
    assert!(full.message.contains("retry in 2 s"), "{}", full.message);
    let soon = replay_refusal(SealError::ReplayCacheFull, Duration::ZERO);
    assert_eq!(soon.retry_after_secs, Some(1));
    let replay = replay_refusal(SealError::Replay, Duration::from_secs(9));
    assert_eq!((replay.status, replay.retry_after_secs), (400, None));
}
