//! The stage's own keys, generated in the process and never leaving it:
//! the Ed25519 receipt-signing key, the entry stage's HPKE keys (rotated on
//! a schedule, [`HpkeKeys`]), and the boot evidence that binds the receipt
//! key and the first HPKE key (receipt links name its digest).

use ed25519_dalek::SigningKey;
use proto::attestation::{
    attest_claims, AttestError, AttestationProvider, Evidence, EvidenceFormat, EvidencePurpose,
};
use proto::digest::Sha256Digest;
use proto::frames::StageClaims;
use proto::key_rotation::{retirement, IdChoice, KeyRing};
use proto::sealing::{unix_now, KeyConfig, ServerKey};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

/// Enclave-held HPKE key ids are drawn from this range at every start, so a
/// client holding a restarted stage's old key is told to refetch (unknown key
/// id) rather than failing to open; ids from 0x80 are the gateway's.
pub const ENCLAVE_HPKE_KEY_IDS: std::ops::RangeInclusive<u8> = 1..=0x7f;

/// Parses `--hpke-key-ids LO-HI`: a range inside [`ENCLAVE_HPKE_KEY_IDS`]
/// of at least 4 ids (a current key, keys still overlapping, and room for a
/// new one). A gateway running several replicas of a pipeline gives each
/// entry stage its own range, so that a key id names one replica.
pub fn parse_key_ids(s: &str) -> Result<std::ops::RangeInclusive<u8>, String> {
    let (lo, hi) = s
        .split_once('-')
        .ok_or_else(|| format!("{s:?}: expected LO-HI, e.g. 1-42"))?;
    let parse = |v: &str| v.trim().parse::<u8>().map_err(|e| format!("{v:?}: {e}"));
    let (lo, hi) = (parse(lo)?, parse(hi)?);
    if !ENCLAVE_HPKE_KEY_IDS.contains(&lo) || !ENCLAVE_HPKE_KEY_IDS.contains(&hi) {
        return Err(format!("{s:?}: enclave key ids are 1 to 127"));
    }
    if hi < lo || hi - lo < 3 {
        return Err(format!("{s:?}: at least 4 ids are needed"));
    }
    Ok(lo..=hi)
}

/// A fresh Ed25519 receipt-signing key. `SigningKey::generate` draws the
/// seed into a local array it never wipes; here the seed lives in a buffer
/// wiped on drop, and the key itself wipes its copy (`ZeroizeOnDrop`).
fn receipt_key() -> SigningKey {
    use rand::RngCore;
    let mut seed = zeroize::Zeroizing::new([0u8; 32]);
    rand::rngs::OsRng.fill_bytes(&mut *seed);
    SigningKey::from_bytes(&seed)
}

/// Keys and boot evidence of one stage.
pub struct StageKeys {
    /// Receipt-signing key.
    pub receipt: SigningKey,
    /// The entry stage's HPKE keys.
    pub hpke: Option<Arc<HpkeKeys>>,
    /// Evidence made at start: binds the receipt key (`public_key`) and the
    /// claims (`user_data`, see `proto::attestation::claims_binding`) with
    /// an empty nonce.
    pub boot_evidence: Evidence,
    /// Digest of `boot_evidence`, named in this stage's receipt links.
    pub evidence_digest: Sha256Digest,
    /// Whether the evidence is mock (recorded in receipts).
    pub mock: bool,
    sequence: AtomicU64,
}

impl StageKeys {
    /// Generates the keys, fills them into `claims` and makes the boot
    /// evidence; an entry stage's HPKE key ids are drawn from `key_ids`,
    /// and its key rotates on `rotation`.
    pub fn generate(
        claims: &mut StageClaims,
        provider: &dyn AttestationProvider,
        rotation: Option<Rotation>,
        key_ids: std::ops::RangeInclusive<u8>,
    ) -> Result<Self, AttestError> {
        let receipt = receipt_key();
        let hpke = claims
            .is_entry()
            .then(|| KeyRing::generate(key_ids, IdChoice::Random));
        claims.receipt_key = receipt.verifying_key().to_bytes();
        claims.hpke_keys = hpke
            .as_ref()
            .map(|r| KeyConfig::encode_list(&[r.current().config()]))
            .unwrap_or_default();
        let boot_evidence = attest_claims(
            provider,
            &claims.receipt_key,
            EvidencePurpose::Boot,
            claims,
            &[],
        )?;
        Ok(Self {
            evidence_digest: boot_evidence.digest(),
            mock: provider.format() == EvidenceFormat::Mock,
            boot_evidence,
            hpke: hpke.map(|r| Arc::new(HpkeKeys::new(r, receipt.clone(), rotation))),
            receipt,
            sequence: AtomicU64::new(0),
        })
    }

    /// The next receipt sequence number of this key (monotonic from 0).
    pub fn next_sequence(&self) -> u64 {
        self.sequence.fetch_add(1, Ordering::SeqCst)
    }
}

/// When the entry stage's HPKE key rotates.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Rotation {
    /// A new key every `every`.
    pub every: Duration,
    /// The key it replaces is still accepted this long after.
    pub overlap: Duration,
}

/// The entry stage's HPKE keys: a [`KeyRing`] (the current key first, then
/// those being retired; random ids from the stage's range) whose every
/// change is published as a [`KeySet`] signed with the receipt key (watch
/// [`HpkeKeys::subscribe`]).
pub struct HpkeKeys {
    receipt: SigningKey,
    rotation: Option<Rotation>,
    ring: Mutex<KeyRing>,
    signed: tokio::sync::watch::Sender<Vec<u8>>,
}

impl HpkeKeys {
    fn new(ring: KeyRing, receipt: SigningKey, rotation: Option<Rotation>) -> Self {
        let signed = Self::sign(&receipt, &ring);
        Self {
            receipt,
            rotation,
            ring: Mutex::new(ring),
            signed: tokio::sync::watch::channel(signed).0,
        }
    }

    fn sign(receipt: &SigningKey, ring: &KeyRing) -> Vec<u8> {
        ring.key_set(unix_now()).sign(receipt)
    }

    fn ring(&self) -> std::sync::MutexGuard<'_, KeyRing> {
        self.ring.lock().expect("key lock")
    }

    /// The key with `key_id`, if the stage still accepts it.
    pub fn get(&self, key_id: u8) -> Option<ServerKey> {
        self.ring().get(key_id, Instant::now())
    }

    /// The current signed key set.
    pub fn signed(&self) -> Vec<u8> {
        self.signed.borrow().clone()
    }

    /// Follows the signed key set as it changes.
    pub fn subscribe(&self) -> tokio::sync::watch::Receiver<Vec<u8>> {
        self.signed.subscribe()
    }

    /// Makes a new current key (an id of its range no held key has) and
    /// schedules the retirement of the one it replaces. With every id of
    /// the range held (overlaps longer than the rotation period), the
    /// rotation waits for a key to retire.
    pub fn rotate(&self, overlap: Duration) {
        let mut ring = self.ring();
        let now = Instant::now();
        match ring.rotate(now, retirement(now, overlap, unix_now())) {
            Some(id) => {
                self.signed.send_replace(Self::sign(&self.receipt, &ring));
                tracing::info!(key_id = id, "HPKE key rotated");
            }
            None => tracing::warn!("no free HPKE key id in this stage's range: rotation skipped"),
        }
    }

    /// From now on draws key ids from `ids` only: keys outside it are
    /// dropped (they named this stage under an earlier assignment), and if
    /// the current key was one of them a new one is made at once.
    pub fn confine(&self, ids: std::ops::RangeInclusive<u8>) {
        let mut ring = self.ring();
        let (changed, made) = ring.confine(ids);
        if let Some(id) = made {
            tracing::info!(
                key_id = id,
                "HPKE key replaced: the gateway assigned other key ids"
            );
        }
        if changed {
            self.signed.send_replace(Self::sign(&self.receipt, &ring));
        }
    }

    /// Drops the keys whose retirement has come; re-signs if any went.
    fn retire_due(&self) {
        let mut ring = self.ring();
        if ring.retire_due(Instant::now()) {
            self.signed.send_replace(Self::sign(&self.receipt, &ring));
            tracing::info!("retired HPKE key(s) no longer accepted");
        }
    }

    /// Rotates on the schedule and retires keys when due, forever (returns
    /// at once without a schedule).
    pub async fn run(self: Arc<Self>) {
        let Some(rotation) = self.rotation else {
            return;
        };
        let mut next_rotation = Instant::now() + rotation.every;
        loop {
            let next_retirement = self.ring().next_retirement();
            let wake = next_retirement.map_or(next_rotation, |r| r.min(next_rotation));
            tokio::time::sleep_until(wake.into()).await;
            self.retire_due();
            if Instant::now() >= next_rotation {
                self.rotate(rotation.overlap);
                next_rotation += rotation.every;
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proto::key_rotation::KeySet;

    fn assert_zod<T: zeroize::ZeroizeOnDrop>() {}

    /// Issue 34, item 3: the stage's secrets wipe themselves when dropped
    /// (the receipt key, and each HPKE key the stage holds or hands out).
    #[test]
    fn stage_secrets_are_wiped_on_drop() {
        assert_zod::<SigningKey>();
        assert_zod::<ServerKey>();
        let a = receipt_key();
        let b = receipt_key();
        assert_ne!(a.verifying_key(), b.verifying_key(), "fresh seeds");
    }

    fn keys() -> HpkeKeys {
        HpkeKeys::new(
            KeyRing::with_key(
                ServerKey::derive(5, b"first"),
                ENCLAVE_HPKE_KEY_IDS,
                IdChoice::Random,
            ),
            SigningKey::from_bytes(&[3; 32]),
            None,
        )
    }

    #[test]
    fn a_rotated_key_is_accepted_until_its_retirement_then_refused() {
        let k = keys();
        let vk = k.receipt.verifying_key().to_bytes();
        assert!(k.get(5).is_some());
        k.rotate(Duration::from_millis(200));
        let set = KeySet::verify(&k.signed(), &vk).unwrap();
        assert_eq!(set.keys.len(), 2);
        let new_id = set.keys[0].0.key_id;
        assert_ne!(new_id, 5);
        assert_eq!(set.keys[0].1, None, "the new key has no retirement");
        assert_eq!(set.keys[1].0.key_id, 5);
        assert!(
            set.keys[1].1.is_some(),
            "the old key's retirement is published"
        );
        assert!(k.get(5).is_some() && k.get(new_id).is_some(), "overlap");
        std::thread::sleep(Duration::from_millis(250));
        assert!(k.get(5).is_none(), "retired");
        k.retire_due();
        let set = KeySet::verify(&k.signed(), &vk).unwrap();
        assert_eq!(
            set.configs().iter().map(|c| c.key_id).collect::<Vec<_>>(),
            [new_id]
        );
    }

    #[test]
    fn key_ids_stay_in_the_stage_range_through_rotations() {
        assert_eq!(parse_key_ids("43-84").unwrap(), 43..=84);
        for bad in ["0-10", "120-130", "10-12", "9-3", "7", "a-b"] {
            assert!(parse_key_ids(bad).is_err(), "{bad}");
        }
        let ids = parse_key_ids("43-46").unwrap();
        let k = HpkeKeys::new(
            KeyRing::with_key(
                ServerKey::derive(43, b"first"),
                ids.clone(),
                IdChoice::Random,
            ),
            SigningKey::from_bytes(&[3; 32]),
            None,
        );
        // Overlaps longer than the rotations: four keys fill the range,
        // a fifth rotation waits for one to retire.
        for _ in 0..4 {
            k.rotate(Duration::from_secs(3600));
        }
        let held: Vec<u8> = k.ring().held_ids();
        assert_eq!(held.len(), 4, "{held:?}");
        assert!(held.iter().all(|id| ids.contains(id)), "{held:?}");
        let mut distinct = held.clone();
        distinct.sort();
        distinct.dedup();
        assert_eq!(distinct.len(), 4, "ids are never shared: {held:?}");
    }

    #[test]
    fn confining_replaces_a_key_outside_the_new_range_and_signs_the_change() {
        let k = keys(); // key 5, range 1-127
        let vk = k.receipt.verifying_key().to_bytes();
        let first = k.signed();
        k.confine(parse_key_ids("5-20").unwrap());
        assert_eq!(k.signed(), first, "key 5 is in range: nothing changes");
        k.confine(parse_key_ids("40-43").unwrap());
        assert!(k.get(5).is_none(), "the old key is gone");
        let set = KeySet::verify(&k.signed(), &vk).unwrap();
        assert_eq!(set.keys.len(), 1);
        let id = set.keys[0].0.key_id;
        assert!((40..=43).contains(&id), "{id}");
        assert!(k.get(id).is_some());
        // Later rotations stay in the new range.
        k.rotate(Duration::from_secs(60));
        let set = KeySet::verify(&k.signed(), &vk).unwrap();
        assert!(set.keys.iter().all(|(c, _)| (40..=43).contains(&c.key_id)));
    }
}
