//! The handshake as a state machine without I/O: each side takes the
//! peer's message bytes and returns its own, and ends with one
//! [`RecordSealer`] and one [`RecordOpener`] keyed from the transcript.
//! A driver with a socket (the tokio one is behind the feature `io`) moves
//! the bytes.

use super::messages::{decode, ClientHello, Finish, Outcome, ServerHello, VERSION};
use super::record::{RecordOpener, RecordSealer};
use super::{ChannelError, ChannelLimits};
use crate::attestation::{
    attest_claims, bound_claims, AnyVerifier, AttestationProvider, Evidence, EvidenceFormat,
    EvidencePurpose, EvidenceVerifier, VerifiedDocument,
};
use crate::digest::Sha256Digest;
use crate::frames::StageClaims;
use crate::wipe::SecretHkdf;
use chacha20poly1305::aead::KeyInit;
use chacha20poly1305::{ChaCha20Poly1305, Key};
use rand::RngCore;
use std::sync::Arc;
use x25519_dalek::{EphemeralSecret, PublicKey};
use zeroize::Zeroizing;

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

/// One direction's sealer and the other's opener, keyed by the handshake.
pub struct Keys {
    /// Seals what this side sends.
    pub send: RecordSealer,
    /// Opens what the peer sends.
    pub recv: RecordOpener,
}

/// The initiator after sending its hello, waiting for the responder's.
pub struct Initiator {
    secret: EphemeralSecret,
    eph: [u8; 32],
    challenge: [u8; 32],
    hello: Vec<u8>,
}

impl Initiator {
    /// Starts a handshake: returns the state and message 1 (unframed).
    pub fn start(local: &LocalIdentity) -> (Self, Vec<u8>) {
        let (secret, eph, challenge) = fresh();
        let hello = crate::cbor::to_vec(&ClientHello {
            version: VERSION,
            attested: local.provider.is_some(),
            eph,
            challenge,
        });
        let m1 = hello.clone();
        (
            Self {
                secret,
                eph,
                challenge,
                hello,
            },
            m1,
        )
    }

    /// Takes message 2: verifies the responder's evidence and runs `check`
    /// on it, then returns message 3 and the state that waits for the
    /// responder's verdict on us (its first record).
    pub fn finish(
        self,
        local: &LocalIdentity,
        m2: &[u8],
        limits: ChannelLimits,
        check: PeerCheck<'_>,
    ) -> Result<(Vec<u8>, AwaitingVerdict), ChannelError> {
        let hello: ServerHello = decode(m2, "server hello")?;
        check_version(hello.version)?;
        let peer = verify_peer(
            local.verifier.as_ref(),
            hello.evidence,
            hello.claims.as_deref(),
            &hello.eph,
            &self.challenge,
        )?;
        check(&peer).map_err(ChannelError::PeerRejected)?;
        let (evidence, claims) = match local.attest(&self.eph, &hello.challenge)? {
            Some((e, c)) => (Some(e), c),
            None => (None, None),
        };
        let m3 = crate::cbor::to_vec(&Finish { evidence, claims });
        let (i2r, r2i) = derive_keys(self.secret, &hello.eph, &[&self.hello, m2, &m3])?;
        let keys = Keys {
            send: RecordSealer::new(i2r, limits),
            recv: RecordOpener::new(r2i, limits),
        };
        Ok((m3, AwaitingVerdict { keys, peer }))
    }
}

/// The initiator after its finish, waiting for the responder's verdict:
/// the keys are released only when the verdict accepts us.
pub struct AwaitingVerdict {
    keys: Keys,
    peer: PeerInfo,
}

impl AwaitingVerdict {
    /// The opener to read the verdict record with.
    pub fn opener(&mut self) -> &mut RecordOpener {
        &mut self.keys.recv
    }

    /// Takes the verdict (`None`: the responder closed before sending
    /// one); when it accepts us, the keys and the peer.
    pub fn verdict(self, msg: Option<&[u8]>) -> Result<(Keys, PeerInfo), ChannelError> {
        read_verdict(msg)?;
        Ok((self.keys, self.peer))
    }
}

/// The responder after sending its hello, waiting for the initiator's
/// finish.
pub struct Responder {
    secret: EphemeralSecret,
    challenge: [u8; 32],
    peer_eph: [u8; 32],
    peer_attested: bool,
    transcript: [Vec<u8>; 2],
}

impl Responder {
    /// Takes message 1 and returns the state and message 2 (unframed),
    /// which carries our evidence.
    pub fn hello(local: &LocalIdentity, m1: &[u8]) -> Result<(Self, Vec<u8>), ChannelError> {
        let hello: ClientHello = decode(m1, "client hello")?;
        check_version(hello.version)?;
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
        let state = Self {
            secret,
            challenge,
            peer_eph: hello.eph,
            peer_attested: hello.attested,
            transcript: [m1.to_vec(), m2.clone()],
        };
        Ok((state, m2))
    }

    /// Takes message 3 and judges the initiator (its evidence, if it
    /// claimed to be attested, and `check`). Returns the verdict sealed as
    /// the first record(s), to be sent whichever way it went, and, only
    /// when the initiator is accepted, the keys and the peer.
    #[allow(clippy::type_complexity)]
    pub fn finish(
        self,
        local: &LocalIdentity,
        m3: &[u8],
        limits: ChannelLimits,
        check: PeerCheck<'_>,
    ) -> Result<(Vec<u8>, Result<(Keys, PeerInfo), ChannelError>), ChannelError> {
        let finish: Finish = decode(m3, "finish")?;
        let [m1, m2] = &self.transcript;
        let (i2r, r2i) = derive_keys(self.secret, &self.peer_eph, &[m1, m2, m3])?;
        let mut keys = Keys {
            send: RecordSealer::new(r2i, limits),
            recv: RecordOpener::new(i2r, limits),
        };
        let verdict = match (self.peer_attested, finish.evidence) {
            (false, None) => Ok(PeerInfo {
                evidence: None,
                document: None,
                claims: None,
            }),
            (true, Some(ev)) => verify_peer(
                local.verifier.as_ref(),
                ev,
                finish.claims.as_deref(),
                &self.peer_eph,
                &self.challenge,
            ),
            _ => Err(ChannelError::PeerRejected(
                "attestation flag and evidence disagree".into(),
            )),
        }
        .and_then(|peer| {
            check(&peer).map_err(ChannelError::PeerRejected)?;
            Ok(peer)
        });
        let outcome = crate::cbor::to_vec(&match &verdict {
            Ok(_) => Outcome::Accepted,
            Err(e) => Outcome::Rejected(e.to_string()),
        });
        let mut records = Vec::new();
        for (chunk, last) in keys.send.chunks(&outcome)? {
            records.extend(keys.send.seal(chunk, last)?);
        }
        Ok((records, verdict.map(|peer| (keys, peer))))
    }
}

/// Reads the responder's verdict (its first record) on the initiator;
/// `None` is a close before any verdict.
fn read_verdict(msg: Option<&[u8]>) -> Result<(), ChannelError> {
    let Some(msg) = msg else {
        return Err(ChannelError::Truncated);
    };
    match crate::cbor::from_slice::<Outcome>(msg).map_err(ChannelError::Malformed)? {
        Outcome::Accepted => Ok(()),
        Outcome::Rejected(why) => Err(ChannelError::RejectedByPeer(why)),
    }
}

fn check_version(version: u32) -> Result<(), ChannelError> {
    if version != VERSION {
        return Err(ChannelError::Handshake(format!(
            "unsupported version {version}"
        )));
    }
    Ok(())
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
