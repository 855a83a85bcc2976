//! Sealing and opening response bodies (and their trailer).

use super::chunks::{ChunkOpener, ChunkSealer};
use super::cipher::{Direct, OpenCipher, SealCipher};
use super::error::SealError;
use super::headers::SealLimits;
use super::response_key::{ClientResponseKey, ResponseKeyMaterial};
use hpke::rand_core::{CryptoRng, RngCore};

// Named only in doc links.
#[cfg(doc)]
use super::DEFAULT_MAX_CHUNK;

/// Streaming response sealer. The first output of [`ResponseSealer::seal`]
/// starts with the random response nonce; then chunks as for requests.
pub struct ResponseSealer {
    inner: ChunkSealer,
}

impl ResponseSealer {
    /// A sealer with a fresh response nonce from the OS.
    pub fn new(material: &ResponseKeyMaterial) -> Result<Self, SealError> {
        Self::new_with_rng(material, &mut rand::rngs::OsRng)
    }

    /// A sealer with a response nonce from `rng`.
    pub fn new_with_rng<R: CryptoRng + RngCore>(
        material: &ResponseKeyMaterial,
        rng: &mut R,
    ) -> Result<Self, SealError> {
        let mut nonce = vec![0u8; material.aead.response_nonce_len()];
        rng.fill_bytes(&mut nonce);
        let cipher = Direct::for_response(material, &nonce)?;
        let mut inner = ChunkSealer::new(SealCipher::Direct(cipher));
        inner.prefix = nonce;
        Ok(Self { inner })
    }

    /// Sets the largest plaintext per chunk (see [`ChunkSealer::set_max_chunk`]).
    pub fn set_max_chunk(&mut self, max_chunk: usize) {
        self.inner.set_max_chunk(max_chunk);
    }

    /// Seals `data` (see [`ChunkSealer::seal`]); the first call's output
    /// begins with the response nonce.
    pub fn seal(&mut self, data: &[u8], last: bool) -> Result<Vec<u8>, SealError> {
        self.inner.seal(data, last)
    }

    /// Ends the body with an empty final chunk.
    pub fn finish(&mut self) -> Result<Vec<u8>, SealError> {
        self.inner.finish()
    }

    /// Ends the body with `trailer` (e.g. the receipt) as its final chunk,
    /// authenticated with the trailer AAD so that it can never be read as
    /// response data. At most one chunk ([`DEFAULT_MAX_CHUNK`] unless set).
    pub fn finish_with_trailer(&mut self, trailer: &[u8]) -> Result<Vec<u8>, SealError> {
        self.inner.seal_trailer(trailer)
    }

    /// Whether the final chunk was sealed.
    pub fn is_finished(&self) -> bool {
        self.inner.is_finished()
    }
}

/// Streaming response opener: reads the response nonce, derives the keys,
/// then opens chunks like [`ChunkOpener`].
pub struct ResponseOpener {
    key: ClientResponseKey,
    limits: SealLimits,
    nonce: Vec<u8>,
    inner: Option<ChunkOpener>,
    failed: bool,
}

impl ResponseOpener {
    /// An opener for the response to the request sealed with `key`.
    pub fn new(key: &ClientResponseKey, limits: SealLimits) -> Self {
        Self {
            key: key.clone(),
            limits,
            nonce: Vec::new(),
            inner: None,
            failed: false,
        }
    }

    /// Feeds bytes; returns the plaintext of every chunk they completed.
    pub fn feed(&mut self, data: &[u8]) -> Result<Vec<Vec<u8>>, SealError> {
        if self.failed {
            return Err(SealError::Poisoned);
        }
        let r = self.feed_inner(data);
        if r.is_err() {
            self.failed = true;
        }
        r
    }

    pub(super) fn feed_inner(&mut self, mut data: &[u8]) -> Result<Vec<Vec<u8>>, SealError> {
        if self.inner.is_none() {
            let need = self.key.0.aead.response_nonce_len();
            if self.limits.max_body < need as u64 {
                return Err(SealError::MessageTooLarge {
                    limit: self.limits.max_body,
                });
            }
            let take = (need - self.nonce.len()).min(data.len());
            self.nonce.extend_from_slice(&data[..take]);
            data = &data[take..];
            if self.nonce.len() < need {
                return Ok(Vec::new());
            }
            let cipher = Direct::for_response(&self.key.0, &self.nonce)?;
            let mut opener = ChunkOpener::new(OpenCipher::Direct(cipher), self.limits, true);
            opener.received = need as u64;
            self.inner = Some(opener);
        }
        self.inner.as_mut().expect("set above").feed(data)
    }

    /// Whether the final chunk has been opened.
    pub fn is_complete(&self) -> bool {
        self.inner.as_ref().is_some_and(|o| o.is_complete())
    }

    /// The trailer (the receipt) if the body ended with one; `None` before
    /// the end or when the body ended with a plain final chunk.
    pub fn trailer(&self) -> Option<&[u8]> {
        self.inner.as_ref().and_then(|o| o.trailer.as_deref())
    }

    /// Ends the body: `Ok` only if the final chunk arrived and nothing
    /// followed it.
    pub fn finish(self) -> Result<(), SealError> {
        if self.failed {
            return Err(SealError::Poisoned);
        }
        match self.inner {
            Some(o) => o.finish(),
            None => Err(SealError::Truncated),
        }
    }
}

/// Seals a whole response body (one-shot).
pub fn seal_response(
    material: &ResponseKeyMaterial,
    plaintext: &[u8],
) -> Result<Vec<u8>, SealError> {
    ResponseSealer::new(material)?.seal(plaintext, true)
}

/// Seals a whole response body and ends it with `trailer` (one-shot).
pub fn seal_response_with_trailer(
    material: &ResponseKeyMaterial,
    plaintext: &[u8],
    trailer: &[u8],
) -> Result<Vec<u8>, SealError> {
    let mut sealer = ResponseSealer::new(material)?;
    let mut out = sealer.seal(plaintext, false)?;
    out.extend(sealer.finish_with_trailer(trailer)?);
    Ok(out)
}

/// Opens a whole sealed response body (one-shot, default limits); a
/// trailer, if any, is authenticated and dropped.
pub fn open_response(key: &ClientResponseKey, body: &[u8]) -> Result<Vec<u8>, SealError> {
    open_response_with_trailer(key, body).map(|(plaintext, _)| plaintext)
}

/// Opens a whole sealed response body (one-shot, default limits) and
/// returns it with its trailer (the receipt), if it ended with one.
pub fn open_response_with_trailer(
    key: &ClientResponseKey,
    body: &[u8],
) -> Result<(Vec<u8>, Option<Vec<u8>>), SealError> {
    let mut opener = ResponseOpener::new(key, SealLimits::default());
    let plaintext = opener.feed(body)?.concat();
    let trailer = opener.trailer().map(<[u8]>::to_vec);
    opener.finish()?;
    Ok((plaintext, trailer))
}
