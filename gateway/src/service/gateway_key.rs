//! The gateway's own HPKE key, for clients that trust the host with their
//! plaintext but not the network (the receipt records `sealing =
//! gateway`): a [`KeyRing`] of ids 0x80..=0xff that rotates on `[keys]
//! rotate_secs`, and the replay guard of the requests sealed to it.

use crate::openai_error::ApiError;
use proto::key_rotation::{retirement, IdChoice, KeyRing};
use proto::sealing::{
    check_fresh, open_request, unix_now, KeyConfig, ReplayGuard, ResponseKeyMaterial, SealError,
    SealedHeaders, HEADER_KEY_ID, REPLAY_WINDOW,
};
use std::sync::{Arc, Mutex, RwLock};
use std::time::{Duration, Instant};

/// Key ids of the gateway-held HPKE keys (enclave-held keys use the lower half).
pub const GATEWAY_HPKE_KEY_IDS: std::ops::RangeInclusive<u8> = 0x80..=0xff;

/// The gateway's own HPKE keys. With `[keys] rotate_secs` a new key
/// replaces the current one on schedule, and the replaced one is accepted
/// `overlap_secs` longer.
pub struct GatewayKey {
    ring: RwLock<KeyRing>,
    rotation: Option<(Duration, Duration)>,
    replay: Mutex<ReplayGuard>,
}

impl GatewayKey {
    /// A fresh key that never rotates.
    pub fn generate() -> Self {
        Self::rotating(None)
    }

    /// A fresh key (id 0x80), replaced every `rotation.0` and overlapping
    /// its successor by `rotation.1` (see [`GatewayKey::run`]).
    pub fn rotating(rotation: Option<(Duration, Duration)>) -> Self {
        Self {
            ring: RwLock::new(KeyRing::generate(GATEWAY_HPKE_KEY_IDS, IdChoice::Next)),
            rotation,
            replay: Mutex::new(ReplayGuard::new(REPLAY_WINDOW, 1 << 20)),
        }
    }

    /// The current key's id.
    pub fn key_id(&self) -> u8 {
        self.ring.read().unwrap().current().key_id()
    }

    /// Whether `key_id` is one of the gateway's key ids (current, retiring
    /// or retired: all are answered by the gateway, never relayed).
    pub fn owns(key_id: u8) -> bool {
        GATEWAY_HPKE_KEY_IDS.contains(&key_id)
    }

    /// The configurations of the keys accepted now, current first.
    pub fn configs(&self) -> Vec<KeyConfig> {
        self.ring.read().unwrap().configs(Instant::now())
    }

    /// Makes a new current key (the next free id in the gateway's range)
    /// and retires the one it replaces after `overlap`.
    pub fn rotate(&self, overlap: Duration) {
        let now = Instant::now();
        let rotated = self
            .ring
            .write()
            .unwrap()
            .rotate(now, retirement(now, overlap, unix_now()));
        match rotated {
            Some(id) => tracing::info!(key_id = id, "gateway HPKE key rotated"),
            None => tracing::warn!("every gateway HPKE key id is held: rotation skipped"),
        }
    }

    /// Rotates on the schedule, forever (returns at once without one).
    pub async fn run(self: Arc<Self>) {
        let Some((every, overlap)) = self.rotation else {
            return;
        };
        let mut tick = tokio::time::interval_at(tokio::time::Instant::now() + every, every);
        loop {
            tick.tick().await;
            self.rotate(overlap);
        }
    }

    /// Opens a request sealed to one of the keys accepted now, refusing
    /// it when stale or replayed; returns the plaintext and the material
    /// its answer is sealed with.
    pub(super) fn open(
        &self,
        sealed: &SealedHeaders,
        body: &[u8],
    ) -> Result<(Vec<u8>, ResponseKeyMaterial), ApiError> {
        let key = self
            .ring
            .read()
            .unwrap()
            .get(sealed.key_id, Instant::now())
            .ok_or_else(|| ApiError::unknown_key(sealed.key_id))?;
        let (plaintext, material) = open_request(&key, sealed, body).map_err(|e| {
            ApiError::invalid(
                Some(HEADER_KEY_ID),
                format!("the sealed request cannot be opened: {e}"),
            )
        })?;
        let mut guard = self.replay.lock().unwrap();
        // An old request is refused outright; checked under the guard's lock,
        // at the moment it is recorded, so no replay outlives the guard.
        check_fresh(sealed, unix_now()).map_err(ApiError::stale)?;
        let now = Instant::now();
        guard
            .check_and_insert(&sealed.enc, now)
            .map_err(|e| match e {
                // Full of keys still inside their window: ask to retry when
                // the oldest leaves it, rather than refusing for good.
                SealError::ReplayCacheFull => {
                    ApiError::replay_guard_full(guard.retry_after(now).as_secs().max(1))
                }
                e => ApiError::invalid(Some(HEADER_KEY_ID), format!("refused: {e}")),
            })?;
        Ok((plaintext, material))
    }
}
