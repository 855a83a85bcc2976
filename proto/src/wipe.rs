//! Wiping secrets from memory when they are dropped: byte buffers (encoded
//! messages that carry a response secret or a digest salt) and HKDF states.
//!
//! Small secrets live in [`zeroize::Zeroizing`] or types that implement
//! [`zeroize::ZeroizeOnDrop`]. Two things need more than that:
//!
//! - **Large buffers** (whole channel messages, up to hundreds of MiB):
//!   `Zeroize` on `[u8]` writes one volatile byte at a time, about three
//!   times slower than `memset`. [`wipe`] fills with zeros at `memset`
//!   speed and then calls [`zeroize::optimization_barrier`], which is how
//!   the `zeroize` crate itself keeps such stores from being removed as
//!   dead.
//! - **HKDF states**: `hkdf::Hkdf` (0.12) keeps the PRK as two keyed
//!   SHA-256 states and offers no `Zeroize`. [`SecretHkdf`] overwrites its
//!   state with that of an all-zero PRK when dropped (safe code: the fields
//!   are plain arrays and counters, rewritten in place).
//!
//! What none of this reaches (copies the compiler makes on the stack,
//! reallocations inside dependencies) is listed in `docs/threat-model.md`.

use hkdf::Hkdf;
use sha2::Sha256;
use std::sync::LazyLock;
use zeroize::ZeroizeOnDrop;

/// Overwrites `bytes` with zeros in a way the compiler keeps.
pub fn wipe(bytes: &mut [u8]) {
    bytes.fill(0);
    zeroize::optimization_barrier(bytes);
}

/// A byte buffer wiped with [`wipe`] (all of its capacity) when dropped:
/// for encoded messages, where `Zeroizing<Vec<u8>>` would be slower.
#[derive(Default)]
pub struct WipeOnDrop(pub Vec<u8>);

impl Drop for WipeOnDrop {
    fn drop(&mut self) {
        wipe_vec(&mut self.0);
    }
}

impl ZeroizeOnDrop for WipeOnDrop {}

impl std::ops::Deref for WipeOnDrop {
    type Target = Vec<u8>;
    fn deref(&self) -> &Vec<u8> {
        &self.0
    }
}

impl std::ops::DerefMut for WipeOnDrop {
    fn deref_mut(&mut self) -> &mut Vec<u8> {
        &mut self.0
    }
}

/// Wipes a vector's whole allocation (its length and its spare capacity)
/// and empties it.
pub fn wipe_vec(v: &mut Vec<u8>) {
    let cap = v.capacity();
    v.resize(cap, 0);
    wipe(v);
    v.clear();
}

/// The state of an all-zero PRK: what a dropped [`SecretHkdf`] holds.
static ZERO_PRK: LazyLock<Hkdf<Sha256>> =
    LazyLock::new(|| Hkdf::from_prk(&[0u8; 32]).expect("32 bytes is a valid PRK"));

/// HKDF-SHA256 whose state (the PRK, as keyed hash states) is overwritten
/// when dropped.
pub struct SecretHkdf(Hkdf<Sha256>);

impl SecretHkdf {
    /// `HKDF-Extract(salt, ikm)`, keeping the PRK only inside the state.
    pub fn new(salt: Option<&[u8]>, ikm: &[u8]) -> Self {
        Self(Hkdf::new(salt, ikm))
    }

    /// `HKDF-Extract(salt, ikm)`: the state and the PRK itself (copied into
    /// a buffer that is wiped on drop; the library's copy is wiped here).
    pub fn extract(salt: Option<&[u8]>, ikm: &[u8]) -> (zeroize::Zeroizing<[u8; 32]>, Self) {
        let (mut prk, hk) = Hkdf::<Sha256>::extract(salt, ikm);
        let mut out = zeroize::Zeroizing::new([0u8; 32]);
        out.copy_from_slice(&prk);
        wipe(&mut prk);
        (out, Self(hk))
    }

    /// The state of a known PRK (at least 32 bytes).
    pub fn from_prk(prk: &[u8]) -> Option<Self> {
        Hkdf::from_prk(prk).ok().map(Self)
    }

    /// `HKDF-Expand(prk, info, L = out.len())`.
    pub fn expand(&self, info: &[u8], out: &mut [u8]) -> Result<(), hkdf::InvalidLength> {
        self.0.expand(info, out)
    }
}

impl Drop for SecretHkdf {
    fn drop(&mut self) {
        self.0 = ZERO_PRK.clone();
        zeroize::optimization_barrier(&self.0);
    }
}

impl ZeroizeOnDrop for SecretHkdf {}

#[cfg(test)]
mod tests {
    use super::*;

    fn assert_zod<T: ZeroizeOnDrop>() {}

    /// Issue 34, item 3: the channel's keys and HKDF state, the AEAD keys
    /// and encoded messages wipe themselves when dropped (the types that
    /// hold HPKE keys, response secrets and digest salts are checked in
    /// their own modules' tests).
    #[test]
    fn key_and_buffer_holders_are_zeroize_on_drop() {
        // The channel's direction ciphers (the crate wipes their keys), and
        // AES-128-GCM's round keys (the `zeroize` feature of aes; that of
        // ghash wipes the GHASH key, without the marker trait).
        assert_zod::<chacha20poly1305::ChaCha20Poly1305>();
        assert_zod::<aes::Aes128>();
        // HKDF states (the channel's, and the HPKE receiver's PRKs).
        assert_zod::<SecretHkdf>();
        // Encoded messages on the channel.
        assert_zod::<WipeOnDrop>();
    }

    #[test]
    fn buffers_are_wiped() {
        let mut v = Vec::with_capacity(64);
        v.extend_from_slice(&[0xa5; 40]);
        v.truncate(10);
        wipe_vec(&mut v);
        assert!(v.is_empty());
        assert_eq!(v.capacity(), 64);
        let mut s = [0x5a_u8; 33];
        wipe(&mut s);
        assert_eq!(s, [0; 33]);
    }

    #[test]
    fn secret_hkdf_matches_hkdf() {
        let (prk, hk) = SecretHkdf::extract(Some(b"salt"), b"ikm");
        let (want_prk, want) = Hkdf::<Sha256>::extract(Some(b"salt"), b"ikm");
        assert_eq!(&prk[..], &want_prk[..]);
        let (mut a, mut b) = ([0u8; 42], [0u8; 42]);
        hk.expand(b"info", &mut a).unwrap();
        want.expand(b"info", &mut b).unwrap();
        assert_eq!(a, b);
        let again = SecretHkdf::from_prk(&prk[..]).unwrap();
        again.expand(b"info", &mut a).unwrap();
        assert_eq!(a, b);
        let new = SecretHkdf::new(Some(b"salt"), b"ikm");
        new.expand(b"info", &mut a).unwrap();
        assert_eq!(a, b);
    }
}
