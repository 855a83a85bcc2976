//! The ciphers behind the chunk framing: the HPKE sender and receiver
//! contexts of a request, and the direct AEAD of a response.

use super::error::SealError;
// Via the parent's re-exports, not `keys` / `response_key`: `keys` refers to
// this module (no module circle, scripts/module_cycles.py).
use super::{Aead, ResponseKeyMaterial, ServerKey};
use super::{HpkeKem, AEAD_NONCE_LEN, KDF_ID, KEM_ID, KEY_LEN};
use crate::wipe::SecretHkdf;
use aes_gcm::aead::{Aead as _, KeyInit, Payload};
use hpke::aead::{AeadCtxS, AesGcm128, ChaCha20Poly1305 as HpkeChaCha};
use hpke::kdf::HkdfSha256;
use hpke::rand_core::{CryptoRng, RngCore};
use hpke::{Deserializable, OpModeS, Serializable};
use zeroize::Zeroizing;

pub(super) enum HpkeSender {
    Aes(Box<AeadCtxS<AesGcm128, HkdfSha256, HpkeKem>>),
    ChaCha(Box<AeadCtxS<HpkeChaCha, HkdfSha256, HpkeKem>>),
}

pub(super) fn crypto(e: hpke::HpkeError) -> SealError {
    match e {
        hpke::HpkeError::MessageLimitReached => SealError::MessageLimitReached,
        e => SealError::Crypto(e.to_string()),
    }
}

impl HpkeSender {
    pub(super) fn setup<R: CryptoRng + RngCore>(
        public_key: &[u8; KEY_LEN],
        info: &[u8],
        aead: Aead,
        rng: &mut R,
    ) -> Result<([u8; KEY_LEN], Self), SealError> {
        let pk = <HpkeKem as hpke::Kem>::PublicKey::from_bytes(public_key)
            .map_err(|e| SealError::MalformedKeyConfig(e.to_string()))?;
        let mode = OpModeS::Base;
        let (enc, ctx) = match aead {
            Aead::Aes128Gcm => {
                let (enc, ctx) = hpke::setup_sender(&mode, &pk, info, rng).map_err(crypto)?;
                (enc, HpkeSender::Aes(Box::new(ctx)))
            }
            Aead::ChaCha20Poly1305 => {
                let (enc, ctx) = hpke::setup_sender(&mode, &pk, info, rng).map_err(crypto)?;
                (enc, HpkeSender::ChaCha(Box::new(ctx)))
            }
        };
        let mut out = [0u8; KEY_LEN];
        out.copy_from_slice(&enc.to_bytes());
        Ok((out, ctx))
    }

    pub(super) fn seal(&mut self, pt: &[u8], aad: &[u8]) -> Result<Vec<u8>, SealError> {
        match self {
            HpkeSender::Aes(c) => c.seal(pt, aad),
            HpkeSender::ChaCha(c) => c.seal(pt, aad),
        }
        .map_err(crypto)
    }

    pub(super) fn export(&self, label: &[u8], out: &mut [u8]) -> Result<(), SealError> {
        match self {
            HpkeSender::Aes(c) => c.export(label, out),
            HpkeSender::ChaCha(c) => c.export(label, out),
        }
        .map_err(crypto)
    }
}

/// The receiving side of RFC 9180 base mode for DHKEM(X25519, HKDF-SHA256)
/// and HKDF-SHA256: `Decap` (§4.1), `KeySchedule` (§5.1), `Open` (§5.2) and
/// `Export` (§5.3), over the `x25519-dalek`, `hkdf` and AEAD crates.
///
/// Written out here rather than taken from `hpke::setup_receiver` because
/// that recomputes the recipient's public key from its private key on every
/// call: a second X25519 scalar multiplication, about a third of the cost of
/// opening a request, for a value [`ServerKey`] already holds. The sending
/// side stays on the `hpke` crate, so every sealed round trip in the tests
/// checks one against the other, and the RFC 9180 vectors check this one.
pub(super) struct HpkeReceiver {
    /// The AEAD with the context's key and base nonce; its counter is the
    /// sequence number (the nonce is `base_nonce XOR I2OSP(seq, Nn)`).
    cipher: Direct,
    exporter_secret: Zeroizing<[u8; 32]>,
    suite: [u8; 10],
}

pub(super) const HPKE_V1: &[u8] = b"HPKE-v1";

/// `LabeledExtract(salt, label, ikm)` (RFC 9180 §4): the PRK and its HKDF,
/// both wiped when dropped ([`SecretHkdf`]).
pub(super) fn labeled_extract(
    suite: &[u8],
    salt: &[u8],
    label: &[u8],
    ikm: &[u8],
) -> (Zeroizing<[u8; 32]>, SecretHkdf) {
    let mut labeled = Zeroizing::new(Vec::with_capacity(
        HPKE_V1.len() + suite.len() + label.len() + ikm.len(),
    ));
    for part in [HPKE_V1, suite, label, ikm] {
        labeled.extend_from_slice(part);
    }
    SecretHkdf::extract(Some(salt), &labeled)
}

/// `LabeledExpand(prk, label, info, L)` into `out` (L = `out.len()`).
pub(super) fn labeled_expand(
    prk: &SecretHkdf,
    suite: &[u8],
    label: &[u8],
    info: &[u8],
    out: &mut [u8],
) -> Result<(), SealError> {
    let len = u16::try_from(out.len()).map_err(|_| SealError::Crypto("length".into()))?;
    let mut labeled =
        Vec::with_capacity(2 + HPKE_V1.len() + suite.len() + label.len() + info.len());
    labeled.extend_from_slice(&len.to_be_bytes());
    for part in [HPKE_V1, suite, label, info] {
        labeled.extend_from_slice(part);
    }
    prk.expand(&labeled, out)
        .map_err(|e| SealError::Crypto(e.to_string()))
}

impl HpkeReceiver {
    pub(super) fn setup(
        key: &ServerKey,
        enc: &[u8; KEY_LEN],
        info: &[u8],
        aead: Aead,
    ) -> Result<Self, SealError> {
        // Decap: dh = DH(skR, pkE); an all-zero result (a small-order pkE)
        // is refused, as the RFC requires.
        let dh = key.dh.diffie_hellman(&x25519_dalek::PublicKey::from(*enc));
        if !dh.was_contributory() {
            return Err(SealError::BadEncapsulatedKey);
        }
        let mut kem_suite = [0u8; 5];
        kem_suite[..3].copy_from_slice(b"KEM");
        kem_suite[3..].copy_from_slice(&KEM_ID.to_be_bytes());
        let (_, eae_prk) = labeled_extract(&kem_suite, b"", b"eae_prk", dh.as_bytes());
        let mut kem_context = [0u8; 2 * KEY_LEN];
        kem_context[..KEY_LEN].copy_from_slice(enc);
        kem_context[KEY_LEN..].copy_from_slice(&key.public);
        let mut shared = Zeroizing::new([0u8; 32]);
        labeled_expand(
            &eae_prk,
            &kem_suite,
            b"shared_secret",
            &kem_context,
            &mut *shared,
        )?;
        // KeySchedule, base mode (no PSK).
        let mut suite = [0u8; 10];
        suite[..4].copy_from_slice(b"HPKE");
        suite[4..6].copy_from_slice(&KEM_ID.to_be_bytes());
        suite[6..8].copy_from_slice(&KDF_ID.to_be_bytes());
        suite[8..].copy_from_slice(&aead.id().to_be_bytes());
        let (psk_id_hash, _) = labeled_extract(&suite, b"", b"psk_id_hash", b"");
        let (info_hash, _) = labeled_extract(&suite, b"", b"info_hash", info);
        let mut context = [0u8; 65];
        context[1..33].copy_from_slice(&*psk_id_hash);
        context[33..].copy_from_slice(&*info_hash);
        let (_, secret) = labeled_extract(&suite, &*shared, b"secret", b"");
        let mut aead_key = Zeroizing::new(vec![0u8; aead.key_len()]);
        let mut base_nonce = [0u8; AEAD_NONCE_LEN];
        let mut exporter_secret = Zeroizing::new([0u8; 32]);
        labeled_expand(&secret, &suite, b"key", &context, &mut aead_key)?;
        labeled_expand(&secret, &suite, b"base_nonce", &context, &mut base_nonce)?;
        labeled_expand(&secret, &suite, b"exp", &context, &mut *exporter_secret)?;
        Ok(Self {
            cipher: Direct::new(aead, &aead_key, base_nonce),
            exporter_secret,
            suite,
        })
    }

    /// Opens one ciphertext; the sequence number advances only on success.
    pub(super) fn open(&mut self, ct: &[u8], aad: &[u8]) -> Result<Option<Vec<u8>>, SealError> {
        self.cipher.open(ct, aad)
    }

    /// `Export(exporter_context, L)` into `out`.
    pub(super) fn export(&self, label: &[u8], out: &mut [u8]) -> Result<(), SealError> {
        let prk = SecretHkdf::from_prk(&*self.exporter_secret)
            .ok_or_else(|| SealError::Crypto("exporter secret length".into()))?;
        labeled_expand(&prk, &self.suite, b"sec", label, out)
    }
}

/// The response AEAD (and the request's, inside [`HpkeReceiver`]): a key, a
/// base nonce and a chunk counter. The counter never wraps: the chunk that
/// would take it past `u64::MAX` is refused with
/// [`SealError::MessageLimitReached`] before anything is sealed or opened,
/// so no nonce is used twice.
pub(super) struct Direct {
    cipher: DirectAead,
    base_nonce: [u8; AEAD_NONCE_LEN],
    counter: u64,
}

pub(super) enum DirectAead {
    Aes(Box<aes_gcm::Aes128Gcm>),
    ChaCha(Box<chacha20poly1305::ChaCha20Poly1305>),
}

impl Direct {
    /// RFC 9458 §4.4 key schedule for the response.
    pub(super) fn for_response(
        material: &ResponseKeyMaterial,
        response_nonce: &[u8],
    ) -> Result<Self, SealError> {
        material.check()?;
        let aead = material.aead;
        let mut salt = Vec::with_capacity(KEY_LEN + response_nonce.len());
        salt.extend_from_slice(&material.enc);
        salt.extend_from_slice(response_nonce);
        let hk = SecretHkdf::new(Some(&salt), &material.secret);
        let mut key = Zeroizing::new(vec![0u8; aead.key_len()]);
        let mut base_nonce = [0u8; AEAD_NONCE_LEN];
        hk.expand(b"key", &mut key)
            .and_then(|_| hk.expand(b"nonce", &mut base_nonce))
            .map_err(|e| SealError::Crypto(e.to_string()))?;
        Ok(Self::new(aead, &key, base_nonce))
    }

    /// An AEAD with `key` (`Nk` bytes) and `base_nonce`, counter at 0.
    pub(super) fn new(aead: Aead, key: &[u8], base_nonce: [u8; AEAD_NONCE_LEN]) -> Self {
        let cipher = match aead {
            Aead::Aes128Gcm => DirectAead::Aes(Box::new(
                aes_gcm::Aes128Gcm::new_from_slice(key).expect("key length is Nk"),
            )),
            Aead::ChaCha20Poly1305 => DirectAead::ChaCha(Box::new(
                chacha20poly1305::ChaCha20Poly1305::new_from_slice(key).expect("key length is Nk"),
            )),
        };
        Self {
            cipher,
            base_nonce,
            counter: 0,
        }
    }

    pub(super) fn nonce(&self) -> [u8; AEAD_NONCE_LEN] {
        let mut n = self.base_nonce;
        for (b, c) in n[AEAD_NONCE_LEN - 8..]
            .iter_mut()
            .zip(self.counter.to_be_bytes())
        {
            *b ^= c;
        }
        n
    }

    /// The counter after this chunk's, or [`SealError::MessageLimitReached`].
    fn next_counter(&self) -> Result<u64, SealError> {
        self.counter
            .checked_add(1)
            .ok_or(SealError::MessageLimitReached)
    }

    pub(super) fn seal(&mut self, pt: &[u8], aad: &[u8]) -> Result<Vec<u8>, SealError> {
        let next = self.next_counter()?;
        let nonce = self.nonce();
        let payload = Payload { msg: pt, aad };
        let ct = match &self.cipher {
            DirectAead::Aes(c) => c.encrypt((&nonce).into(), payload),
            DirectAead::ChaCha(c) => c.encrypt((&nonce).into(), payload),
        }
        .map_err(|e| SealError::Crypto(e.to_string()))?;
        self.counter = next;
        Ok(ct)
    }

    /// Opens one ciphertext: `Ok(None)` when it does not authenticate (the
    /// counter stays), an error when the counter is spent.
    pub(super) fn open(&mut self, ct: &[u8], aad: &[u8]) -> Result<Option<Vec<u8>>, SealError> {
        let next = self.next_counter()?;
        let nonce = self.nonce();
        let payload = Payload { msg: ct, aad };
        let pt = match &self.cipher {
            DirectAead::Aes(c) => c.decrypt((&nonce).into(), payload),
            DirectAead::ChaCha(c) => c.decrypt((&nonce).into(), payload),
        };
        let pt = pt.ok();
        if pt.is_some() {
            self.counter = next;
        }
        Ok(pt)
    }

    /// Test only: moves the counter (to reach its limit without 2^64 chunks).
    #[cfg(test)]
    pub(super) fn set_counter(&mut self, counter: u64) {
        self.counter = counter;
    }
}

pub(super) enum SealCipher {
    Hpke(HpkeSender),
    Direct(Direct),
}

pub(super) enum OpenCipher {
    Hpke(HpkeReceiver),
    Direct(Direct),
}

impl OpenCipher {
    pub(super) fn open(&mut self, ct: &[u8], aad: &[u8]) -> Result<Option<Vec<u8>>, SealError> {
        match self {
            OpenCipher::Hpke(c) => c.open(ct, aad),
            OpenCipher::Direct(c) => c.open(ct, aad),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::sealing::{request_info, ClientResponseKey};

    /// Issue 34, item 2: the chunk counter stops at its limit with a typed
    /// error instead of wrapping to 0 (which would reuse nonce 0, and every
    /// nonce after it, under the same key).
    #[test]
    fn the_chunk_counter_stops_at_its_limit_instead_of_wrapping() {
        for aead in Aead::ALL {
            let key = vec![7u8; aead.key_len()];
            let mut sealer = Direct::new(aead, &key, [3; AEAD_NONCE_LEN]);
            let mut opener = Direct::new(aead, &key, [3; AEAD_NONCE_LEN]);
            sealer.set_counter(u64::MAX - 1);
            opener.set_counter(u64::MAX - 1);
            // The last counter value below the limit still works...
            let ct = sealer.seal(b"last chunk", b"").unwrap();
            assert_eq!(
                opener.open(&ct, b"").unwrap().as_deref(),
                Some(&b"last chunk"[..])
            );
            // ...and then both directions refuse, naming the reason.
            assert_eq!(
                sealer.seal(b"one more", b""),
                Err(SealError::MessageLimitReached)
            );
            assert_eq!(opener.open(&ct, b""), Err(SealError::MessageLimitReached));
        }
    }

    fn assert_zod<T: zeroize::ZeroizeOnDrop>() {}

    /// Issue 34, item 3: HPKE keys and response secrets wipe themselves
    /// when dropped.
    #[test]
    fn keys_and_response_secrets_are_zeroize_on_drop() {
        assert_zod::<ServerKey>();
        assert_zod::<ResponseKeyMaterial>();
        assert_zod::<ClientResponseKey>();
        assert_zod::<SecretHkdf>();
    }

    /// The request side (RFC 9180 receiver) runs on the same counter, and
    /// the `hpke` crate's limit on the sending side maps to the same error.
    #[test]
    fn the_hpke_receiver_and_sender_report_the_limit_as_such() {
        let key = ServerKey::derive(1, b"limit");
        let aead = Aead::ChaCha20Poly1305;
        let info = request_info(1, aead, 0, crate::sealing::Sealer::Client);
        let (enc, mut sender) =
            HpkeSender::setup(&key.public_key(), &info, aead, &mut rand::rngs::OsRng).unwrap();
        let mut receiver = HpkeReceiver::setup(&key, &enc, &info, aead).unwrap();
        let ct = sender.seal(b"x", b"").unwrap();
        receiver.cipher.set_counter(u64::MAX);
        assert_eq!(receiver.open(&ct, b""), Err(SealError::MessageLimitReached));
        assert_eq!(
            crypto(hpke::HpkeError::MessageLimitReached),
            SealError::MessageLimitReached
        );
    }
}
