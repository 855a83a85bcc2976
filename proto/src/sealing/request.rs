//! Sealing and opening request bodies.

use super::chunks::{ChunkOpener, ChunkSealer};
use super::cipher::{HpkeReceiver, HpkeSender, OpenCipher, SealCipher};
use super::error::SealError;
use super::freshness::unix_now;
use super::headers::{SealLimits, SealedHeaders};
use super::keys::{request_info, Aead, KeyConfig, Sealer, ServerKey};
use super::response_key::{ClientResponseKey, ResponseKeyMaterial};
use super::RESPONSE_EXPORT_LABEL;
use hpke::rand_core::{CryptoRng, RngCore};

// Named only in doc links.
#[cfg(doc)]
use super::freshness::check_fresh;

/// Starts sealing a request to `config` with `aead` (OS randomness).
/// Returns the headers to send, the body sealer and the key to open the
/// response with.
pub fn seal_request_stream(
    config: &KeyConfig,
    aead: Aead,
) -> Result<(SealedHeaders, ChunkSealer, ClientResponseKey), SealError> {
    seal_request_stream_with_rng(config, aead, &mut rand::rngs::OsRng)
}

/// [`seal_request_stream`] with the caller's random number generator.
pub fn seal_request_stream_with_rng<R: CryptoRng + RngCore>(
    config: &KeyConfig,
    aead: Aead,
    rng: &mut R,
) -> Result<(SealedHeaders, ChunkSealer, ClientResponseKey), SealError> {
    seal_request_stream_at(config, aead, unix_now(), rng)
}

/// [`seal_request_stream_with_rng`] with the sealing time given (Unix
/// seconds) instead of the system clock's.
pub fn seal_request_stream_at<R: CryptoRng + RngCore>(
    config: &KeyConfig,
    aead: Aead,
    sealed_at: u64,
    rng: &mut R,
) -> Result<(SealedHeaders, ChunkSealer, ClientResponseKey), SealError> {
    seal_request_stream_as(config, aead, sealed_at, Sealer::Client, rng)
}

/// [`seal_request_stream_at`] for a request sealed by `sealer` (the
/// others seal as a client).
pub fn seal_request_stream_as<R: CryptoRng + RngCore>(
    config: &KeyConfig,
    aead: Aead,
    sealed_at: u64,
    sealer: Sealer,
    rng: &mut R,
) -> Result<(SealedHeaders, ChunkSealer, ClientResponseKey), SealError> {
    if !config.supports(aead) {
        return Err(SealError::UnsupportedAead(aead.id()));
    }
    let info = request_info(config.key_id, aead, sealed_at, sealer);
    let (enc, ctx) = HpkeSender::setup(&config.public_key, &info, aead, rng)?;
    let mut secret = vec![0u8; aead.key_len()];
    ctx.export(RESPONSE_EXPORT_LABEL, &mut secret)?;
    let headers = SealedHeaders {
        key_id: config.key_id,
        aead,
        enc,
        sealed_at,
    };
    let key = ClientResponseKey(ResponseKeyMaterial { aead, enc, secret });
    Ok((headers, ChunkSealer::new(SealCipher::Hpke(ctx)), key))
}

/// Starts opening a sealed request with `key`. Returns the body opener and
/// the material to seal the response with. The request's age is the
/// caller's to check ([`check_fresh`]) once it opened.
///
/// Errors: [`SealError::UnknownKeyId`] if `headers` name another key;
/// [`SealError::BadEncapsulatedKey`] if decapsulation fails.
pub fn open_request_stream(
    key: &ServerKey,
    headers: &SealedHeaders,
    limits: SealLimits,
) -> Result<(ChunkOpener, ResponseKeyMaterial), SealError> {
    open_request_stream_as(key, headers, limits, Sealer::Client)
}

/// [`open_request_stream`] for a request sealed by `sealer` (a request
/// sealed by another does not open: [`SealError::Open`]).
pub fn open_request_stream_as(
    key: &ServerKey,
    headers: &SealedHeaders,
    limits: SealLimits,
    sealer: Sealer,
) -> Result<(ChunkOpener, ResponseKeyMaterial), SealError> {
    if headers.key_id != key.key_id {
        return Err(SealError::UnknownKeyId(headers.key_id));
    }
    let info = request_info(key.key_id, headers.aead, headers.sealed_at, sealer);
    let ctx = HpkeReceiver::setup(key, &headers.enc, &info, headers.aead)?;
    let mut secret = vec![0u8; headers.aead.key_len()];
    ctx.export(RESPONSE_EXPORT_LABEL, &mut secret)?;
    let material = ResponseKeyMaterial {
        aead: headers.aead,
        enc: headers.enc,
        secret,
    };
    Ok((
        ChunkOpener::new(OpenCipher::Hpke(ctx), limits, false),
        material,
    ))
}

/// Seals a whole request body as a client (one-shot).
pub fn seal_request(
    config: &KeyConfig,
    aead: Aead,
    plaintext: &[u8],
) -> Result<(SealedHeaders, Vec<u8>, ClientResponseKey), SealError> {
    seal_request_as(config, aead, plaintext, Sealer::Client)
}

/// Seals a whole request body as `sealer` (one-shot).
pub fn seal_request_as(
    config: &KeyConfig,
    aead: Aead,
    plaintext: &[u8],
    sealer: Sealer,
) -> Result<(SealedHeaders, Vec<u8>, ClientResponseKey), SealError> {
    let (headers, mut chunks, key) =
        seal_request_stream_as(config, aead, unix_now(), sealer, &mut rand::rngs::OsRng)?;
    let body = chunks.seal(plaintext, true)?;
    Ok((headers, body, key))
}

/// Opens a whole request body a client sealed (one-shot, default limits).
pub fn open_request(
    key: &ServerKey,
    headers: &SealedHeaders,
    body: &[u8],
) -> Result<(Vec<u8>, ResponseKeyMaterial), SealError> {
    open_request_as(key, headers, body, Sealer::Client)
}

/// Opens a whole request body `sealer` sealed (one-shot, default limits).
pub fn open_request_as(
    key: &ServerKey,
    headers: &SealedHeaders,
    body: &[u8],
    sealer: Sealer,
) -> Result<(Vec<u8>, ResponseKeyMaterial), SealError> {
    let (mut opener, material) =
        open_request_stream_as(key, headers, SealLimits::default(), sealer)?;
    let plaintext = opener.feed(body)?.concat();
    opener.finish()?;
    Ok((plaintext, material))
}
