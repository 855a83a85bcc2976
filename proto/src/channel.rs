//! The attested stage channel.
//!
//! Handshake (three length-prefixed CBOR messages, then one record):
//! 1. initiator → responder `ClientHello { version, attested, eph_i, challenge_i }`
//! 2. responder → initiator `ServerHello { eph_r, challenge_r, evidence_r,
//!    claims_r? }`, where evidence_r binds `public_key = eph_r`,
//!    `nonce = challenge_i` and the stage's claims for the `channel`
//!    purpose: mock evidence carries `user_data = "channel" ‖ 0 ‖
//!    CBOR(StageClaims)`, Nitro evidence a digest of both with the claims
//!    beside it in `claims_r` (see [`crate::attestation::claims_binding`]);
//! 3. initiator → responder `Finish { evidence_i?, claims_i? }` (a stage
//!    initiator binds `eph_i` and `challenge_r` the same way; the host
//!    gateway has no evidence);
//! 4. keys: HKDF-SHA256(salt = H(transcript of 1..3), ikm = X25519(eph_i,
//!    eph_r)) expanded into one ChaCha20-Poly1305 key per direction; the
//!    responder's first record says whether it accepted the initiator.
//!
//! Records: `u32 length ‖ u64 sequence ‖ AEAD(ciphertext)`, where the
//! sequence is also the AEAD nonce and the 12-byte header (length and
//! sequence) is authenticated as associated data.
//! Sequence numbers are strictly contiguous per direction from 0: a dropped,
//! duplicated, reordered or replayed record is an error that poisons the
//! channel. A message is one or more records (a flag byte marks the last);
//! record and message sizes are bounded on send and on receive. A direction
//! stops before `max_records`, far below the 2^64 nonce space, so no nonce
//! is ever reused under a key; the endpoints then open a new channel.
//!
//! Written here rather than taken from a TLS crate because the handshake
//! must carry enclave attestation documents bound to the ephemeral keys and
//! the peer's challenge, which rustls has no place for.

use crate::attestation::{
    attest_claims, bound_claims, AnyVerifier, AttestationProvider, Evidence, EvidenceFormat,
    EvidencePurpose, EvidenceVerifier, VerifiedDocument,
};
use crate::digest::Sha256Digest;
use crate::frames::StageClaims;
use crate::transport::BoxStream;
use crate::wipe::{SecretHkdf, WipeOnDrop};
use chacha20poly1305::aead::{AeadInPlace, KeyInit};
use chacha20poly1305::{ChaCha20Poly1305, Key, Nonce};
use rand::RngCore;
use serde::{de::DeserializeOwned, Deserialize, Serialize};
use std::sync::Arc;
use std::time::Duration;
use tokio::io::{AsyncReadExt, AsyncWriteExt, BufReader, ReadHalf, WriteHalf};
use x25519_dalek::{EphemeralSecret, PublicKey};
use zeroize::Zeroizing;

const VERSION: u32 = 1;
const HANDSHAKE_MAX: usize = 256 * 1024;
const TAG_LEN: usize = 16;
const FLAG_FINAL: u8 = 1;

/// Size limits of a channel.
#[derive(Clone, Copy, Debug)]
pub struct ChannelLimits {
    /// Largest plaintext chunk in one record.
    pub max_record: usize,
    /// Largest whole message.
    pub max_message: usize,
    /// Records a direction may carry before the channel must be replaced.
    pub max_records: u64,
    /// Time allowed for the whole handshake.
    pub handshake_timeout: Duration,
}

impl Default for ChannelLimits {
    fn default() -> Self {
        Self {
            max_record: 1 << 20,
            max_message: 256 << 20,
            max_records: 1 << 48,
            handshake_timeout: Duration::from_secs(30),
        }
    }
}

/// Channel errors. Any error poisons the half it happened on.
#[derive(Debug, thiserror::Error)]
pub enum ChannelError {
    /// Transport failure.
    #[error("transport: {0}")]
    Io(#[from] std::io::Error),
    /// The peer closed the stream in the middle of a record or message.
    #[error("peer closed the channel mid-message")]
    Truncated,
    /// Handshake protocol failure.
    #[error("handshake: {0}")]
    Handshake(String),
    /// The peer's evidence or claims were not accepted.
    #[error("peer not accepted: {0}")]
    PeerRejected(String),
    /// The peer did not accept us.
    #[error("rejected by peer: {0}")]
    RejectedByPeer(String),
    /// A record arrived out of sequence (dropped, duplicated, reordered, replayed).
    #[error("record out of sequence: expected {expected}, got {got}")]
    OutOfSequence {
        /// The next sequence number expected.
        expected: u64,
        /// The one received.
        got: u64,
    },
    /// A record failed authentication.
    #[error("record {0} failed authentication")]
    Authentication(u64),
    /// A record is larger than allowed.
    #[error("record of {size} bytes exceeds the limit of {limit}")]
    RecordTooLarge {
        /// Its size.
        size: usize,
        /// The limit.
        limit: usize,
    },
    /// A message is larger than allowed.
    #[error("message of at least {size} bytes exceeds the limit of {limit}")]
    MessageTooLarge {
        /// Its size (so far).
        size: usize,
        /// The limit.
        limit: usize,
    },
    /// This direction has used up its record budget.
    #[error("record limit of {0} reached; the channel must be replaced")]
    RecordLimit(u64),
    /// A message did not decode.
    #[error("malformed message: {0}")]
    Malformed(String),
    /// An earlier error closed this half.
    #[error("channel closed after an earlier error")]
    Poisoned,
}

/// Who we are in a handshake, and how we verify the peer's evidence.
pub struct LocalIdentity {
    provider: Option<Arc<dyn AttestationProvider>>,
    claims: Option<StageClaims>,
    verifier: Arc<dyn EvidenceVerifier>,
}

/// Our evidence and, for formats that bind a digest of the claims, the
/// claims' bytes sent beside it.
type Attested = (Evidence, Option<Vec<u8>>);

impl LocalIdentity {
    /// The untrusted host (gateway): presents no evidence.
    pub fn host() -> Self {
        Self {
            provider: None,
            claims: None,
            verifier: Arc::new(AnyVerifier::default()),
        }
    }

    /// An attested stage.
    pub fn stage(provider: Arc<dyn AttestationProvider>, claims: StageClaims) -> Self {
        Self {
            provider: Some(provider),
            claims: Some(claims),
            verifier: Arc::new(AnyVerifier::default()),
        }
    }

    /// Verifies the peer's evidence with `verifier` instead of the default
    /// ([`AnyVerifier`]: pinned AWS Nitro root, system clock).
    pub fn with_verifier(mut self, verifier: Arc<dyn EvidenceVerifier>) -> Self {
        self.verifier = verifier;
        self
    }

    fn attest(&self, eph: &[u8; 32], nonce: &[u8; 32]) -> Result<Option<Attested>, ChannelError> {
        match (&self.provider, &self.claims) {
            (Some(p), Some(c)) => {
                let evidence = attest_claims(p.as_ref(), eph, EvidencePurpose::Channel, c, nonce)
                    .map_err(|e| ChannelError::Handshake(e.to_string()))?;
                let carried =
                    (evidence.format != EvidenceFormat::Mock).then(|| crate::cbor::to_vec(c));
                Ok(Some((evidence, carried)))
            }
            _ => Ok(None),
        }
    }
}

/// What we learned about the peer.
#[derive(Clone, Debug)]
pub struct PeerInfo {
    /// Its raw evidence (none for the host).
    pub evidence: Option<Evidence>,
    /// The verified document (none for the host).
    pub document: Option<VerifiedDocument>,
    /// Its claims, bound in the document (none for the host).
    pub claims: Option<StageClaims>,
}

impl PeerInfo {
    /// Whether the peer is the unattested host.
    pub fn is_host(&self) -> bool {
        self.evidence.is_none()
    }
}

/// A check of the peer (normally a policy check) run inside the handshake.
pub type PeerCheck<'a> = &'a (dyn Fn(&PeerInfo) -> Result<(), String> + Sync);

#[derive(Serialize, Deserialize)]
struct ClientHello {
    version: u32,
    attested: bool,
    #[serde(with = "serde_bytes")]
    eph: [u8; 32],
    #[serde(with = "serde_bytes")]
    challenge: [u8; 32],
}

#[derive(Serialize, Deserialize)]
struct ServerHello {
    version: u32,
    #[serde(with = "serde_bytes")]
    eph: [u8; 32],
    #[serde(with = "serde_bytes")]
    challenge: [u8; 32],
    evidence: Evidence,
    /// The claims whose digest the evidence binds (Nitro); absent for mock.
    #[serde(default, skip_serializing_if = "Option::is_none", with = "serde_bytes")]
    claims: Option<Vec<u8>>,
}

#[derive(Serialize, Deserialize)]
struct Finish {
    evidence: Option<Evidence>,
    /// As in `ServerHello`.
    #[serde(default, skip_serializing_if = "Option::is_none", with = "serde_bytes")]
    claims: Option<Vec<u8>>,
}

#[derive(Serialize, Deserialize)]
enum Outcome {
    Accepted,
    Rejected(String),
}

/// Sending half of an established channel.
pub struct ChannelSender {
    w: WriteHalf<BoxStream>,
    cipher: ChaCha20Poly1305,
    seq: u64,
    limits: ChannelLimits,
    poisoned: bool,
}

/// Receiving half of an established channel. `recv` is not cancel-safe:
/// drive it from one task.
pub struct ChannelReceiver {
    r: BufReader<ReadHalf<BoxStream>>,
    cipher: ChaCha20Poly1305,
    expected: u64,
    limits: ChannelLimits,
    poisoned: bool,
}

fn nonce(seq: u64) -> Nonce {
    let mut n = [0u8; 12];
    n[4..].copy_from_slice(&seq.to_be_bytes());
    Nonce::from(n)
}

impl ChannelSender {
    /// Sends one message (split into records as needed).
    ///
    /// Not cancel-safe, and fails closed when cancelled: the sender is
    /// poisoned before the first write and cleared only once the whole
    /// message is written, and each record's sequence number (its nonce) is
    /// taken before its bytes are written. A send future dropped part-way
    /// therefore leaves a sender that refuses every later message
    /// ([`ChannelError::Poisoned`]) instead of one that reuses a nonce or
    /// splices a message onto a half-written one. Callers that may be
    /// cancelled (request handlers) go through a queued writer task instead
    /// (the `channel_queue` module, which builds on this one).
    pub async fn send(&mut self, msg: &[u8]) -> Result<(), ChannelError> {
        if self.poisoned {
            return Err(ChannelError::Poisoned);
        }
        self.poisoned = true;
        let r = self.send_inner(msg).await;
        self.poisoned = r.is_err();
        r
    }

    async fn send_inner(&mut self, msg: &[u8]) -> Result<(), ChannelError> {
        if msg.len() > self.limits.max_message {
            return Err(ChannelError::MessageTooLarge {
                size: msg.len(),
                limit: self.limits.max_message,
            });
        }
        if msg.is_empty() {
            self.send_record(&[], true).await?;
        }
        let mut chunks = msg.chunks(self.limits.max_record.max(1)).peekable();
        while let Some(chunk) = chunks.next() {
            let last = chunks.peek().is_none();
            self.send_record(chunk, last).await?;
        }
        self.w.flush().await?;
        Ok(())
    }

    async fn send_record(&mut self, chunk: &[u8], last: bool) -> Result<(), ChannelError> {
        if chunk.len() > self.limits.max_record {
            return Err(ChannelError::RecordTooLarge {
                size: chunk.len(),
                limit: self.limits.max_record,
            });
        }
        if self.seq >= self.limits.max_records {
            return Err(ChannelError::RecordLimit(self.limits.max_records));
        }
        let mut buf = Vec::with_capacity(12 + 1 + chunk.len() + TAG_LEN);
        let len = (8 + 1 + chunk.len() + TAG_LEN) as u32;
        buf.extend_from_slice(&len.to_be_bytes());
        buf.extend_from_slice(&self.seq.to_be_bytes());
        let header: [u8; 12] = buf[..12].try_into().expect("12-byte header");
        let mut body = Vec::with_capacity(1 + chunk.len() + TAG_LEN);
        body.push(if last { FLAG_FINAL } else { 0 });
        body.extend_from_slice(chunk);
        self.cipher
            .encrypt_in_place(&nonce(self.seq), &header, &mut body)
            .map_err(|_| ChannelError::Handshake("encryption failed".into()))?;
        buf.extend_from_slice(&body);
        // The nonce is spent before the first byte goes out: a write that
        // fails or is cancelled never leaves it for another record.
        self.seq += 1;
        self.w.write_all(&buf).await?;
        Ok(())
    }

    /// Sends a CBOR-encoded value. The encoding (which may carry a response
    /// key or a digest salt) is wiped once sent, or when a cancelled send
    /// drops it.
    pub async fn send_msg<T: Serialize>(&mut self, value: &T) -> Result<(), ChannelError> {
        let bytes = WipeOnDrop(crate::cbor::to_vec(value));
        self.send(&bytes).await
    }

    /// Records sent so far.
    pub fn records_sent(&self) -> u64 {
        self.seq
    }

    /// Closes the sending direction.
    pub async fn close(mut self) {
        self.shutdown().await;
    }

    /// Closes the sending direction of a sender others may still hold
    /// (their later sends fail).
    pub async fn shutdown(&mut self) {
        let _ = self.w.shutdown().await;
    }
}

impl ChannelReceiver {
    /// Receives one message; `Ok(None)` on a clean close between messages.
    pub async fn recv(&mut self) -> Result<Option<Vec<u8>>, ChannelError> {
        if self.poisoned {
            return Err(ChannelError::Poisoned);
        }
        let r = self.recv_inner().await;
        if r.is_err() {
            self.poisoned = true;
        }
        r
    }

    async fn recv_inner(&mut self) -> Result<Option<Vec<u8>>, ChannelError> {
        let mut msg = Vec::new();
        let mut first = true;
        loop {
            let mut header = [0u8; 12];
            // Only an end of stream before the first byte of a message is a
            // clean close; one anywhere after it, even inside the length
            // prefix, is a truncation.
            let mut filled = 0;
            while filled < 4 {
                match self.r.read(&mut header[filled..4]).await? {
                    0 if first && filled == 0 => return Ok(None),
                    0 => return Err(ChannelError::Truncated),
                    n => filled += n,
                }
            }
            first = false;
            let len = u32::from_be_bytes(header[..4].try_into().expect("4 bytes")) as usize;
            let limit = 8 + 1 + self.limits.max_record + TAG_LEN;
            if len > limit {
                return Err(ChannelError::RecordTooLarge { size: len, limit });
            }
            if len < 8 + 1 + TAG_LEN {
                return Err(ChannelError::Malformed(format!(
                    "record of {len} bytes is too short"
                )));
            }
            read_exact_or_truncated(&mut self.r, &mut header[4..]).await?;
            let seq = u64::from_be_bytes(header[4..].try_into().expect("8 bytes"));
            if seq != self.expected {
                return Err(ChannelError::OutOfSequence {
                    expected: self.expected,
                    got: seq,
                });
            }
            if seq >= self.limits.max_records {
                return Err(ChannelError::RecordLimit(self.limits.max_records));
            }
            let mut body = vec![0u8; len - 8];
            read_exact_or_truncated(&mut self.r, &mut body).await?;
            self.cipher
                .decrypt_in_place(&nonce(seq), &header, &mut body)
                .map_err(|_| ChannelError::Authentication(seq))?;
            self.expected += 1;
            let flags = body[0];
            if flags & !FLAG_FINAL != 0 {
                return Err(ChannelError::Malformed(format!(
                    "unknown record flags {flags:#04x}"
                )));
            }
            if flags & FLAG_FINAL == 0 && body.len() == 1 {
                return Err(ChannelError::Malformed("empty non-final record".into()));
            }
            if msg.len() + body.len() - 1 > self.limits.max_message {
                return Err(ChannelError::MessageTooLarge {
                    size: msg.len() + body.len() - 1,
                    limit: self.limits.max_message,
                });
            }
            if msg.is_empty() && flags & FLAG_FINAL != 0 {
                body.remove(0);
                return Ok(Some(body));
            }
            msg.extend_from_slice(&body[1..]);
            if flags & FLAG_FINAL != 0 {
                return Ok(Some(msg));
            }
        }
    }

    /// Receives and decodes a CBOR value; `Ok(None)` on a clean close. The
    /// received plaintext is wiped once decoded.
    pub async fn recv_msg<T: DeserializeOwned>(&mut self) -> Result<Option<T>, ChannelError> {
        match self.recv().await? {
            None => Ok(None),
            Some(bytes) => {
                let bytes = WipeOnDrop(bytes);
                crate::cbor::from_slice(&bytes).map(Some).map_err(|e| {
                    self.poisoned = true;
                    ChannelError::Malformed(e)
                })
            }
        }
    }
}

async fn read_exact_or_truncated<R: AsyncReadExt + Unpin>(
    r: &mut R,
    buf: &mut [u8],
) -> Result<(), ChannelError> {
    r.read_exact(buf).await.map(|_| ()).map_err(|e| {
        if e.kind() == std::io::ErrorKind::UnexpectedEof {
            ChannelError::Truncated
        } else {
            e.into()
        }
    })
}

async fn write_frame<W: AsyncWriteExt + Unpin>(
    w: &mut W,
    bytes: &[u8],
) -> Result<(), ChannelError> {
    w.write_all(&(bytes.len() as u32).to_be_bytes()).await?;
    w.write_all(bytes).await?;
    w.flush().await?;
    Ok(())
}

async fn read_frame<R: AsyncReadExt + Unpin>(r: &mut R) -> Result<Vec<u8>, ChannelError> {
    let mut len = [0u8; 4];
    read_exact_or_truncated(r, &mut len).await?;
    let len = u32::from_be_bytes(len) as usize;
    if len > HANDSHAKE_MAX {
        return Err(ChannelError::RecordTooLarge {
            size: len,
            limit: HANDSHAKE_MAX,
        });
    }
    let mut buf = vec![0u8; len];
    read_exact_or_truncated(r, &mut buf).await?;
    Ok(buf)
}

fn decode<T: DeserializeOwned>(bytes: &[u8], what: &str) -> Result<T, ChannelError> {
    crate::cbor::from_slice(bytes).map_err(|e| ChannelError::Handshake(format!("{what}: {e}")))
}

/// Verifies evidence and its binding to this session; returns the peer.
fn verify_peer(
    verifier: &dyn EvidenceVerifier,
    evidence: Evidence,
    carried_claims: Option<&[u8]>,
    eph: &[u8; 32],
    our_challenge: &[u8; 32],
) -> Result<PeerInfo, ChannelError> {
    let doc = verifier
        .verify(&evidence)
        .map_err(|e| ChannelError::PeerRejected(e.to_string()))?;
    if doc.public_key != eph {
        return Err(ChannelError::PeerRejected(
            "evidence is not bound to the peer's channel key".into(),
        ));
    }
    if doc.nonce != our_challenge {
        return Err(ChannelError::PeerRejected(
            "evidence is not bound to our challenge (stale or replayed evidence)".into(),
        ));
    }
    let claims: StageClaims = bound_claims(&doc, EvidencePurpose::Channel, carried_claims)
        .map_err(ChannelError::PeerRejected)?;
    Ok(PeerInfo {
        evidence: Some(evidence),
        document: Some(doc),
        claims: Some(claims),
    })
}

fn derive_keys(
    secret: EphemeralSecret,
    peer: &[u8; 32],
    transcript: &[&[u8]],
) -> Result<(ChaCha20Poly1305, ChaCha20Poly1305), ChannelError> {
    let shared = secret.diffie_hellman(&PublicKey::from(*peer));
    if !shared.was_contributory() {
        return Err(ChannelError::Handshake("peer sent a low-order key".into()));
    }
    let th = Sha256Digest::of_parts("stage-channel/v1 transcript", transcript);
    // The HKDF state, the direction keys and the ciphers holding them are
    // all wiped when dropped (the shared secret wipes itself).
    let hk = SecretHkdf::new(Some(&th.0), shared.as_bytes());
    let mut i2r = Zeroizing::new([0u8; 32]);
    let mut r2i = Zeroizing::new([0u8; 32]);
    hk.expand(b"stage-channel/v1 initiator->responder", &mut *i2r)
        .expect("32 bytes is a valid HKDF length");
    hk.expand(b"stage-channel/v1 responder->initiator", &mut *r2i)
        .expect("32 bytes is a valid HKDF length");
    Ok((
        ChaCha20Poly1305::new(Key::from_slice(&*i2r)),
        ChaCha20Poly1305::new(Key::from_slice(&*r2i)),
    ))
}

fn fresh() -> (EphemeralSecret, [u8; 32], [u8; 32]) {
    let secret = EphemeralSecret::random_from_rng(rand::rngs::OsRng);
    let public = PublicKey::from(&secret).to_bytes();
    let mut challenge = [0u8; 32];
    rand::rngs::OsRng.fill_bytes(&mut challenge);
    (secret, public, challenge)
}

fn halves(
    stream: BoxStream,
    send: ChaCha20Poly1305,
    recv: ChaCha20Poly1305,
    limits: ChannelLimits,
) -> (ChannelSender, ChannelReceiver) {
    let (r, w) = tokio::io::split(stream);
    (
        ChannelSender {
            w,
            cipher: send,
            seq: 0,
            limits,
            poisoned: false,
        },
        ChannelReceiver {
            r: BufReader::with_capacity(256 * 1024, r),
            cipher: recv,
            expected: 0,
            limits,
            poisoned: false,
        },
    )
}

async fn with_timeout<T>(
    limits: &ChannelLimits,
    fut: impl std::future::Future<Output = Result<T, ChannelError>>,
) -> Result<T, ChannelError> {
    tokio::time::timeout(limits.handshake_timeout, fut)
        .await
        .map_err(|_| ChannelError::Handshake("timed out".into()))?
}

/// Runs the initiator side of the handshake (the gateway, or a stage dialing
/// the next stage). `check` decides whether the responder is acceptable.
pub async fn initiate(
    stream: BoxStream,
    local: &LocalIdentity,
    limits: ChannelLimits,
    check: PeerCheck<'_>,
) -> Result<(ChannelSender, ChannelReceiver, PeerInfo), ChannelError> {
    with_timeout(&limits, async move {
        let mut stream = stream;
        let (secret, eph, challenge) = fresh();
        let m1 = crate::cbor::to_vec(&ClientHello {
            version: VERSION,
            attested: local.provider.is_some(),
            eph,
            challenge,
        });
        write_frame(&mut stream, &m1).await?;
        let m2 = read_frame(&mut stream).await?;
        let hello: ServerHello = decode(&m2, "server hello")?;
        if hello.version != VERSION {
            return Err(ChannelError::Handshake(format!(
                "unsupported version {}",
                hello.version
            )));
        }
        let peer = verify_peer(
            local.verifier.as_ref(),
            hello.evidence,
            hello.claims.as_deref(),
            &hello.eph,
            &challenge,
        )?;
        check(&peer).map_err(ChannelError::PeerRejected)?;
        let (evidence, claims) = match local.attest(&eph, &hello.challenge)? {
            Some((e, c)) => (Some(e), c),
            None => (None, None),
        };
        let m3 = crate::cbor::to_vec(&Finish { evidence, claims });
        write_frame(&mut stream, &m3).await?;
        let (i2r, r2i) = derive_keys(secret, &hello.eph, &[&m1, &m2, &m3])?;
        let (tx, mut rx) = halves(stream, i2r, r2i, limits);
        match rx.recv_msg::<Outcome>().await? {
            Some(Outcome::Accepted) => Ok((tx, rx, peer)),
            Some(Outcome::Rejected(why)) => Err(ChannelError::RejectedByPeer(why)),
            None => Err(ChannelError::Truncated),
        }
    })
    .await
}

/// Runs the responder side (a stage accepting a connection). `check` decides
/// whether the initiator is acceptable; a rejection is reported to it.
pub async fn respond(
    stream: BoxStream,
    local: &LocalIdentity,
    limits: ChannelLimits,
    check: PeerCheck<'_>,
) -> Result<(ChannelSender, ChannelReceiver, PeerInfo), ChannelError> {
    with_timeout(&limits, async move {
        let mut stream = stream;
        let m1 = read_frame(&mut stream).await?;
        let hello: ClientHello = decode(&m1, "client hello")?;
        if hello.version != VERSION {
            return Err(ChannelError::Handshake(format!(
                "unsupported version {}",
                hello.version
            )));
        }
        let (secret, eph, challenge) = fresh();
        let (evidence, claims) = local
            .attest(&eph, &hello.challenge)?
            .ok_or_else(|| ChannelError::Handshake("a responder must be attested".into()))?;
        let m2 = crate::cbor::to_vec(&ServerHello {
            version: VERSION,
            eph,
            challenge,
            evidence,
            claims,
        });
        write_frame(&mut stream, &m2).await?;
        let m3 = read_frame(&mut stream).await?;
        let finish: Finish = decode(&m3, "finish")?;
        let (i2r, r2i) = derive_keys(secret, &hello.eph, &[&m1, &m2, &m3])?;
        let (mut tx, rx) = halves(stream, r2i, i2r, limits);
        let verdict = match (hello.attested, finish.evidence) {
            (false, None) => Ok(PeerInfo {
                evidence: None,
                document: None,
                claims: None,
            }),
            (true, Some(ev)) => verify_peer(
                local.verifier.as_ref(),
                ev,
                finish.claims.as_deref(),
                &hello.eph,
                &challenge,
            ),
            _ => Err(ChannelError::PeerRejected(
                "attestation flag and evidence disagree".into(),
            )),
        }
        .and_then(|peer| {
            check(&peer).map_err(ChannelError::PeerRejected)?;
            Ok(peer)
        });
        match verdict {
            Ok(peer) => {
                tx.send_msg(&Outcome::Accepted).await?;
                Ok((tx, rx, peer))
            }
            Err(e) => {
                let _ = tx.send_msg(&Outcome::Rejected(e.to_string())).await;
                Err(e)
            }
        }
    })
    .await
}
