//! AWS Nitro Enclaves attestation documents: parsing and verification.
//!
//! A Nitro document is a COSE_Sign1 (RFC 9052), tagged (18) or not, signed
//! with ES384 by a short-lived leaf certificate that chains to the AWS Nitro
//! root G1. [`NitroVerifier::verify`] checks, in this order, each failure
//! with its own [`AttestError`] variant:
//!
//! 1. the COSE structure: a `COSE_Sign1`, protected header `alg = ES384`
//!    (-35) and no critical parameters, an attached payload, a signature of
//!    exactly 96 bytes (`r ‖ s`, 48 bytes each, as RFC 9053 §2.1 says), an
//!    empty unprotected header, and the outer array in its shortest CBOR
//!    encoding (re-encoding the parsed structure gives the same bytes);
//! 2. the payload (CBOR map, AWS's "syntactical validation"): `module_id`
//!    non-empty text, `digest` = `"SHA384"`, `timestamp` > 0 (ms), `pcrs` a
//!    map of 1–32 entries, index < 32, each value 32, 48 or 64 bytes,
//!    `certificate` and each `cabundle` entry 1–1024 bytes of DER, at least one
//!    `cabundle` entry, optional `public_key` (≤ 1024 bytes), `user_data`
//!    and `nonce` (≤ 512 bytes each; absent or null reads as empty);
//! 3. the certificate chain, with `rustls-webpki` (the verifier rustls uses):
//!    a path from `certificate` through the `cabundle` entries to the
//!    **pinned** root ([`AWS_NITRO_ROOT_G1_PEM`]). The bundle's own root is
//!    never a trust anchor: the `cabundle` entries are only candidate
//!    intermediates, so a bundle that carries another root leads nowhere
//!    ([`AttestError::UntrustedChain`]). Every certificate's signature is
//!    checked with its issuer's key, and must be ECDSA P-384 with SHA-384
//!    as all of AWS's chain is (`CHAIN_ALGS`), every certificate
//!    below the root must be valid at the caller's "now"
//!    ([`AttestError::CertificateExpired`] / [`AttestError::CertificateNotYetValid`];
//!    a `notBefore` up to [`MAX_CLOCK_SKEW_SECS`] ahead of "now" is
//!    accepted, because an enclave's clock runs without NTP),
//!    issuers must be CAs (basic constraints, path length), the leaf must
//!    not be a CA, and unknown critical extensions are refused; the pinned
//!    root's own validity window is checked here too;
//! 4. the COSE signature over `Sig_structure = ["Signature1", protected,
//!    h'', payload]` with the leaf's P-384 key ([`AttestError::BadSignature`]).
//!
//! PCR policy and the binding of `nonce`, `public_key` and `user_data` are
//! the caller's (the `policy` and `attestation` modules).

#[cfg(feature = "nitro")]
pub mod nsm;

pub use crate::evidence::Pcrs;
use crate::evidence::{AttestError, EvidenceFormat, Measurement, VerifiedDocument};
use ciborium::Value;
use coset::{CborSerializable, CoseSign1, TaggedCborSerializable};
use rustls_pki_types::pem::PemObject;
use rustls_pki_types::{
    alg_id, AlgorithmIdentifier, CertificateDer, InvalidSignature, SignatureVerificationAlgorithm,
    UnixTime,
};
use std::collections::BTreeMap;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

/// The AWS Nitro Enclaves root certificate G1 (PEM), pinned. Published by
/// AWS (`AWS_NitroEnclaves_Root-G1.zip`); valid 2019-10-28 to 2049-10-28.
pub const AWS_NITRO_ROOT_G1_PEM: &str = include_str!("aws-nitro-root-g1.pem");

/// SHA-256 of the pinned root's DER encoding (as AWS publishes it).
pub const AWS_NITRO_ROOT_G1_SHA256: &str =
    "641a0321a3e244efe456463195d606317ed7cdcc3c1756e09893f3c68f79bb5b";

/// Largest `user_data` / `nonce` the NSM accepts and a document may carry.
pub const MAX_USER_DATA: usize = 512;
/// Largest `nonce` (same limit as `user_data`).
pub const MAX_NONCE: usize = 512;
/// Largest `public_key`.
pub const MAX_PUBLIC_KEY: usize = 1024;
/// Number of PCRs the NSM has.
pub const PCR_COUNT: u8 = 32;

/// How far ahead of the verifier's clock a certificate's `notBefore` may
/// lie (seconds). The NSM issues a leaf only seconds before the document
/// (3–15 s in the recorded documents), so a verifier whose clock is a
/// little behind the NSM's (an enclave's clock has no NTP and drifts
/// seconds per week; so may a client's) would otherwise refuse fresh
/// documents as not yet valid. Expiry is judged at the verifier's own
/// clock, with no tolerance.
pub const MAX_CLOCK_SKEW_SECS: u64 = 300;

/// The payload of a Nitro attestation document.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct NitroPayload {
    /// Issuing NSM's module id.
    pub module_id: String,
    /// Time the document was made, Unix milliseconds.
    pub timestamp_ms: u64,
    /// The PCRs.
    pub pcrs: Pcrs,
    /// Leaf certificate (DER).
    pub certificate: Vec<u8>,
    /// CA bundle (DER), root first as the NSM writes it; untrusted.
    pub cabundle: Vec<Vec<u8>>,
    /// Bound public key (empty when absent).
    pub public_key: Vec<u8>,
    /// Bound user data (empty when absent).
    pub user_data: Vec<u8>,
    /// Bound nonce (empty when absent).
    pub nonce: Vec<u8>,
}

/// A verified Nitro document with what the verifier learned on the way.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct NitroVerified {
    /// The fields, in the form every evidence verifier returns.
    pub document: VerifiedDocument,
    /// The payload as parsed.
    pub payload: NitroPayload,
    /// Whether the COSE_Sign1 carried its tag (18).
    pub tagged: bool,
    /// Length of the verified path: leaf, intermediates and the pinned root.
    pub chain_len: usize,
    /// The leaf certificate's validity window, Unix seconds.
    pub leaf_validity: (u64, u64),
}

/// The time certificates are judged at.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum VerifyTime {
    /// The system clock at each verification.
    SystemClock,
    /// A fixed time, Unix seconds (offline checks of recorded documents).
    At(u64),
    /// The document's own `timestamp`: "was it genuine when it was made".
    /// For boot evidence, made at stage start and outliving its three-hour
    /// leaf certificate; freshness comes from elsewhere (a nonce-bound
    /// document judged at "now" that binds the same claims).
    DocumentTime,
}

/// Verifies Nitro attestation documents against a pinned root.
#[derive(Clone, Debug)]
pub struct NitroVerifier {
    root: CertificateDer<'static>,
    time: VerifyTime,
}

impl Default for NitroVerifier {
    fn default() -> Self {
        Self::aws()
    }
}

/// ES384 over COSE: ECDSA P-384 with SHA-384 and the signature as raw
/// `r ‖ s` (RFC 9053 §2.1), which webpki's algorithms (X.509's DER-encoded
/// signatures) do not cover. A thin adapter to ring's fixed-length verifier.
#[derive(Debug)]
struct CoseEs384;

impl SignatureVerificationAlgorithm for CoseEs384 {
    fn verify_signature(
        &self,
        public_key: &[u8],
        message: &[u8],
        signature: &[u8],
    ) -> Result<(), InvalidSignature> {
        ring::signature::UnparsedPublicKey::new(
            &ring::signature::ECDSA_P384_SHA384_FIXED,
            public_key,
        )
        .verify(message, signature)
        .map_err(|_| InvalidSignature)
    }

    fn public_key_alg_id(&self) -> AlgorithmIdentifier {
        alg_id::ECDSA_P384
    }

    fn signature_alg_id(&self) -> AlgorithmIdentifier {
        alg_id::ECDSA_SHA384
    }
}

/// Nitro certificates carry no extended key usage; none is required, and
/// one that is present is not held against a certificate AWS signed.
struct AnyEku;

impl webpki::ExtendedKeyUsageValidator for AnyEku {
    fn validate(&self, iter: webpki::KeyPurposeIdIter<'_, '_>) -> Result<(), webpki::Error> {
        for id in iter {
            id?;
        }
        Ok(())
    }
}

/// Certificate signature algorithms accepted in the chain: only what AWS's
/// chain uses (every certificate from the root G1 down to the leaf is
/// ECDSA P-384 signed with SHA-384). A certificate signed otherwise is
/// refused ([`AttestError::BadCertificate`]), however it chains.
static CHAIN_ALGS: &[&dyn SignatureVerificationAlgorithm] = &[webpki::ring::ECDSA_P384_SHA384];

/// The current time, Unix seconds.
pub fn unix_now() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_secs())
        .unwrap_or(0)
}

fn malformed(what: impl std::fmt::Display) -> AttestError {
    AttestError::Malformed(format!("Nitro document: {what}"))
}

/// Parses the outer COSE_Sign1 (tagged or not); returns it and whether it was tagged.
pub fn parse_cose(document: &[u8]) -> Result<(CoseSign1, bool), AttestError> {
    // Tag 18 (COSE_Sign1) is the single byte 0xd2.
    let tagged = document.first() == Some(&0xd2);
    let sign1 = if tagged {
        CoseSign1::from_tagged_slice(document)
    } else {
        CoseSign1::from_slice(document)
    }
    .map_err(|e| malformed(format!("not a COSE_Sign1: {e}")))?;
    Ok((sign1, tagged))
}

fn bytes_field(v: Value, name: &str, min: usize, max: usize) -> Result<Vec<u8>, AttestError> {
    match v {
        Value::Bytes(b) if (min..=max).contains(&b.len()) => Ok(b),
        Value::Bytes(b) => Err(malformed(format!(
            "{name} is {} bytes (allowed {min}..={max})",
            b.len()
        ))),
        _ => Err(malformed(format!("{name} is not a byte string"))),
    }
}

fn optional_bytes(v: Option<Value>, name: &str, max: usize) -> Result<Vec<u8>, AttestError> {
    match v {
        None | Some(Value::Null) => Ok(Vec::new()),
        Some(v) => bytes_field(v, name, 0, max),
    }
}

/// Parses and syntactically checks a payload (step 2 of the module docs).
pub fn parse_payload(payload: &[u8]) -> Result<NitroPayload, AttestError> {
    let value: Value = crate::cbor::from_slice(payload).map_err(malformed)?;
    let Value::Map(entries) = value else {
        return Err(malformed("payload is not a map"));
    };
    let mut fields: BTreeMap<String, Value> = BTreeMap::new();
    for (k, v) in entries {
        let Value::Text(k) = k else {
            return Err(malformed("payload has a non-text key"));
        };
        if fields.insert(k.clone(), v).is_some() {
            return Err(malformed(format!("payload repeats key {k}")));
        }
    }
    let mut take = |name: &str| fields.remove(name);
    let module_id = match take("module_id") {
        Some(Value::Text(s)) if !s.is_empty() => s,
        _ => return Err(malformed("module_id missing or empty")),
    };
    match take("digest") {
        Some(Value::Text(s)) if s == "SHA384" => {}
        _ => return Err(malformed("digest is not \"SHA384\"")),
    }
    let timestamp_ms = match take("timestamp") {
        Some(Value::Integer(i)) => u64::try_from(i)
            .ok()
            .filter(|&t| t > 0)
            .ok_or_else(|| malformed("timestamp is not a positive integer"))?,
        _ => return Err(malformed("timestamp missing")),
    };
    let pcrs = match take("pcrs") {
        Some(Value::Map(m)) if !m.is_empty() && m.len() <= PCR_COUNT as usize => {
            let mut out = BTreeMap::new();
            for (k, v) in m {
                let index = match k {
                    Value::Integer(i) => u8::try_from(i).ok().filter(|&i| i < PCR_COUNT),
                    _ => None,
                }
                .ok_or_else(|| malformed("PCR index is not 0..31"))?;
                let value = bytes_field(v, &format!("PCR{index}"), 32, 64)?;
                if ![32, 48, 64].contains(&value.len()) {
                    return Err(malformed(format!("PCR{index} is {} bytes", value.len())));
                }
                if out.insert(index, value).is_some() {
                    return Err(malformed(format!("PCR{index} repeated")));
                }
            }
            Pcrs(out)
        }
        _ => return Err(malformed("pcrs missing, empty or too large")),
    };
    let certificate = bytes_field(
        take("certificate").ok_or_else(|| malformed("certificate missing"))?,
        "certificate",
        1,
        1024,
    )?;
    let cabundle = match take("cabundle") {
        Some(Value::Array(a)) if !a.is_empty() => a
            .into_iter()
            .map(|c| bytes_field(c, "cabundle entry", 1, 1024))
            .collect::<Result<Vec<_>, _>>()?,
        _ => return Err(malformed("cabundle missing or empty")),
    };
    let public_key = optional_bytes(take("public_key"), "public_key", MAX_PUBLIC_KEY)?;
    let user_data = optional_bytes(take("user_data"), "user_data", MAX_USER_DATA)?;
    let nonce = optional_bytes(take("nonce"), "nonce", MAX_NONCE)?;
    Ok(NitroPayload {
        module_id,
        timestamp_ms,
        pcrs,
        certificate,
        cabundle,
        public_key,
        user_data,
        nonce,
    })
}

fn chain_error(e: webpki::Error) -> AttestError {
    use webpki::Error as E;
    let secs = |t: UnixTime| t.as_secs();
    match e {
        E::CertExpired { time, not_after } => AttestError::CertificateExpired {
            now: secs(time),
            not_after: secs(not_after),
        },
        E::CertNotValidYet { time, not_before } => AttestError::CertificateNotYetValid {
            now: secs(time),
            not_before: secs(not_before),
        },
        E::UnknownIssuer => AttestError::UntrustedChain(
            "no path from the leaf through the cabundle to the pinned AWS Nitro root".into(),
        ),
        E::InvalidSignatureForPublicKey => AttestError::BadCertificate(
            "a certificate's signature does not verify with its issuer's key".into(),
        ),
        E::UnsupportedSignatureAlgorithmContext(_)
        | E::UnsupportedSignatureAlgorithmForPublicKeyContext(_) => AttestError::BadCertificate(
            "a certificate is signed with an algorithm AWS's chain does not use (only ECDSA \
             P-384 with SHA-384 is accepted)"
                .into(),
        ),
        other => AttestError::BadCertificate(format!("{other:?}")),
    }
}

/// Validity window (Unix seconds) of a DER certificate.
pub fn validity(der: &[u8]) -> Result<(u64, u64), AttestError> {
    use x509_cert::der::Decode;
    let cert = x509_cert::Certificate::from_der(der)
        .map_err(|e| AttestError::BadCertificate(format!("certificate does not parse: {e}")))?;
    let v = &cert.tbs_certificate.validity;
    Ok((
        v.not_before.to_unix_duration().as_secs(),
        v.not_after.to_unix_duration().as_secs(),
    ))
}

impl NitroVerifier {
    /// The production verifier: the pinned AWS Nitro root G1, the system clock.
    pub fn aws() -> Self {
        let root = CertificateDer::from_pem_slice(AWS_NITRO_ROOT_G1_PEM.as_bytes())
            .expect("the pinned AWS Nitro root is valid PEM");
        Self {
            root,
            time: VerifyTime::SystemClock,
        }
    }

    /// A verifier that pins another root (DER). Only for tests and private
    /// test CAs: no document from AWS hardware chains to it.
    pub fn with_root_der(der: Vec<u8>) -> Self {
        Self {
            root: CertificateDer::from(der),
            time: VerifyTime::SystemClock,
        }
    }

    /// Judges certificate validity at `unix_seconds` instead of the system
    /// clock (offline checks of recorded documents).
    pub fn at(self, unix_seconds: u64) -> Self {
        self.with_time(VerifyTime::At(unix_seconds))
    }

    /// Judges certificate validity at `time`.
    pub fn with_time(mut self, time: VerifyTime) -> Self {
        self.time = time;
        self
    }

    /// The time rule in force.
    pub fn time(&self) -> VerifyTime {
        self.time
    }

    /// DER of the pinned root.
    pub fn root_der(&self) -> &[u8] {
        self.root.as_ref()
    }

    /// Verifies a raw document (steps 1–4 of the module docs).
    pub fn verify(&self, document: &[u8]) -> Result<NitroVerified, AttestError> {
        let (sign1, tagged) = parse_cose(document)?;
        let alg = sign1.protected.header.alg.clone();
        if alg
            != Some(coset::RegisteredLabelWithPrivate::Assigned(
                coset::iana::Algorithm::ES384,
            ))
        {
            return Err(AttestError::UnsupportedAlgorithm(format!("{alg:?}")));
        }
        if !sign1.protected.header.crit.is_empty() {
            return Err(malformed("critical header parameters are not supported"));
        }
        if sign1.signature.len() != 96 {
            return Err(malformed(format!(
                "ES384 signature is {} bytes, expected 96 (r ‖ s)",
                sign1.signature.len()
            )));
        }
        // Nothing outside the signed parts may vary: an empty unprotected
        // header (as the NSM writes it) and the shortest CBOR encoding of
        // the outer array, so the same signed document has no other byte
        // form (besides the two the signature scheme allows; see
        // docs/threat-model.md).
        if !sign1.unprotected.is_empty() {
            return Err(malformed("the unprotected header is not empty"));
        }
        let again = if tagged {
            sign1.clone().to_tagged_vec()
        } else {
            sign1.clone().to_vec()
        };
        if again.ok().as_deref() != Some(document) {
            return Err(malformed(
                "not in its canonical CBOR encoding (non-minimal lengths, indefinite-length \
                 items, or bytes after the COSE_Sign1)",
            ));
        }
        let payload_bytes = sign1
            .payload
            .as_deref()
            .ok_or_else(|| malformed("no payload"))?;
        let payload = parse_payload(payload_bytes)?;
        let now = match self.time {
            VerifyTime::SystemClock => unix_now(),
            VerifyTime::At(t) => t,
            VerifyTime::DocumentTime => payload.timestamp_ms / 1000,
        };

        // 3. The chain, to the pinned root only.
        let (root_from, root_to) = validity(self.root.as_ref())?;
        if now.saturating_add(MAX_CLOCK_SKEW_SECS) < root_from {
            return Err(AttestError::CertificateNotYetValid {
                now,
                not_before: root_from,
            });
        }
        if now > root_to {
            return Err(AttestError::CertificateExpired {
                now,
                not_after: root_to,
            });
        }
        let anchor = webpki::anchor_from_trusted_cert(&self.root)
            .map_err(|e| AttestError::BadCertificate(format!("pinned root: {e:?}")))?;
        let leaf_der = CertificateDer::from(payload.certificate.as_slice());
        let leaf = webpki::EndEntityCert::try_from(&leaf_der).map_err(|e| {
            AttestError::BadCertificate(format!("leaf certificate does not parse: {e:?}"))
        })?;
        let intermediates: Vec<CertificateDer<'_>> = payload
            .cabundle
            .iter()
            .map(|c| CertificateDer::from(c.as_slice()))
            .collect();
        // Judged at `now`; a certificate that is not yet valid but starts
        // within the clock tolerance is judged again at its `notBefore`
        // (at most once per certificate of the chain, each time later).
        let mut at = now;
        let path = loop {
            let time = UnixTime::since_unix_epoch(Duration::from_secs(at));
            match leaf.verify_for_usage(
                CHAIN_ALGS,
                std::slice::from_ref(&anchor),
                &intermediates,
                time,
                AnyEku,
                None,
                None,
            ) {
                Ok(path) => break path,
                Err(webpki::Error::CertNotValidYet { not_before, .. })
                    if not_before.as_secs() > at
                        && not_before.as_secs() <= now.saturating_add(MAX_CLOCK_SKEW_SECS) =>
                {
                    at = not_before.as_secs();
                }
                Err(webpki::Error::CertNotValidYet { not_before, .. }) => {
                    return Err(AttestError::CertificateNotYetValid {
                        now,
                        not_before: not_before.as_secs(),
                    })
                }
                Err(e) => return Err(chain_error(e)),
            }
        };
        let chain_len = path.intermediate_certificates().count() + 2;
        let leaf_validity = validity(&payload.certificate)?;

        // 4. The COSE signature with the leaf's key.
        sign1.verify_signature(b"", |sig, tbs| {
            leaf.verify_signature(&CoseEs384, tbs, sig)
                .map_err(|_| AttestError::BadSignature)
        })?;

        let document = VerifiedDocument {
            format: EvidenceFormat::Nitro,
            module_id: payload.module_id.clone(),
            timestamp_ms: payload.timestamp_ms,
            measurement: Measurement::Nitro(payload.pcrs.clone()),
            public_key: payload.public_key.clone(),
            user_data: payload.user_data.clone(),
            nonce: payload.nonce.clone(),
        };
        Ok(NitroVerified {
            document,
            payload,
            tagged,
            chain_len,
            leaf_validity,
        })
    }
}

/// Reads a raw document from a file's bytes: raw CBOR (COSE_Sign1, tagged
/// or not) or its base64 text (standard or URL-safe alphabet, padded or not).
pub fn decode_document(bytes: &[u8]) -> Result<Vec<u8>, AttestError> {
    if matches!(bytes.first(), Some(0x84 | 0xd2)) {
        return Ok(bytes.to_vec());
    }
    let text = std::str::from_utf8(bytes)
        .map_err(|_| malformed("neither CBOR (COSE_Sign1) nor base64 text"))?;
    crate::text::decode_base64(text)
        .ok_or_else(|| malformed("neither CBOR (COSE_Sign1) nor base64 text"))
}

#[cfg(test)]
mod tests {
    use super::*;
    use sha2::{Digest, Sha256};

    #[test]
    fn pinned_root_is_the_published_one() {
        let v = NitroVerifier::aws();
        assert_eq!(
            hex::encode(Sha256::digest(v.root_der())),
            AWS_NITRO_ROOT_G1_SHA256
        );
        let (from, to) = validity(v.root_der()).unwrap();
        // 2019-10-28 13:28:05 UTC .. 2049-10-28 14:28:05 UTC
        assert_eq!((from, to), (1_572_269_285, 2_519_044_085));
    }

    #[test]
    fn pinned_form_and_debug() {
        let mut p = Pcrs::default();
        assert!(p.is_debug());
        p.0.insert(0, vec![0; 48]);
        p.0.insert(1, vec![1; 48]);
        p.0.insert(2, vec![2; 48]);
        p.0.insert(8, vec![0; 48]);
        assert!(p.is_debug());
        let f = p.pinned_form();
        assert!(f.starts_with("nitro:pcr0=0000"), "{f}");
        assert!(!f.contains("pcr8"), "{f}");
        p.0.insert(0, vec![9; 48]);
        p.0.insert(8, vec![8; 48]);
        assert!(!p.is_debug());
        assert!(p
            .pinned_form()
            .ends_with(&format!(",pcr8={}", "08".repeat(48))));
    }

    #[test]
    fn document_decoding_forms() {
        let raw = vec![0x84, 0x40, 0xa0, 0xf6, 0x40];
        assert_eq!(decode_document(&raw).unwrap(), raw);
        use base64::Engine as _;
        let b64 = base64::engine::general_purpose::STANDARD.encode(&raw);
        assert_eq!(decode_document(format!("{b64}\n").as_bytes()).unwrap(), raw);
        assert!(decode_document(b"\xff\xfe").is_err());
    }
}
