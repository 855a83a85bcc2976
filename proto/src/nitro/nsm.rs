//! The Nitro Secure Module attestation provider (Cargo feature `nitro`).
//!
//! Inside a Nitro enclave, `/dev/nsm` signs attestation documents. The
//! provider asks it for one binding the stage's key (`public_key`), the
//! claims digest (`user_data`, see [`crate::claims::claims_binding`])
//! and the verifier's nonce, through the `aws-nitro-enclaves-nsm-api` crate.
//! Everything but the ioctl itself (request construction with the NSM's
//! size limits, response → [`Evidence`] mapping) is plain code that the
//! unit tests below exercise with a recorded document; the device sits
//! behind [`NsmDevice`].

use crate::evidence::{AttestError, AttestationProvider, Evidence, EvidenceFormat};
use crate::nitro::{MAX_NONCE, MAX_PUBLIC_KEY, MAX_USER_DATA};
use aws_nitro_enclaves_nsm_api::api::{Request, Response};
use aws_nitro_enclaves_nsm_api::driver;
use serde_bytes::ByteBuf;
use std::sync::Mutex;

/// Something that answers NSM requests: `/dev/nsm` ([`DevNsm`]), or a
/// stand-in in tests.
pub trait NsmDevice: Send + Sync {
    /// Sends one request and returns the NSM's response.
    fn process(&self, request: Request) -> Response;
}

/// The enclave's `/dev/nsm`, opened once and closed on drop.
pub struct DevNsm {
    fd: i32,
    // One request at a time through the descriptor.
    lock: Mutex<()>,
}

impl DevNsm {
    /// Opens `/dev/nsm`; fails outside a Nitro enclave.
    pub fn open() -> Result<Self, AttestError> {
        let fd = driver::nsm_init();
        if fd < 0 {
            return Err(AttestError::Provider(
                "cannot open /dev/nsm: not running inside a Nitro enclave".into(),
            ));
        }
        Ok(Self {
            fd,
            lock: Mutex::new(()),
        })
    }
}

impl Drop for DevNsm {
    fn drop(&mut self) {
        driver::nsm_exit(self.fd);
    }
}

impl NsmDevice for DevNsm {
    fn process(&self, request: Request) -> Response {
        let _one = self.lock.lock().unwrap_or_else(|e| e.into_inner());
        driver::nsm_process_request(self.fd, request)
    }
}

/// Builds the NSM attestation request. Empty fields are left out (the
/// document then has them absent); fields over the NSM's limits (user data
/// and nonce 512 bytes, public key 1024) are refused here rather than by
/// the device.
pub fn attestation_request(
    public_key: &[u8],
    user_data: &[u8],
    nonce: &[u8],
) -> Result<Request, AttestError> {
    for (name, v, max) in [
        ("public_key", public_key, MAX_PUBLIC_KEY),
        ("user_data", user_data, MAX_USER_DATA),
        ("nonce", nonce, MAX_NONCE),
    ] {
        if v.len() > max {
            return Err(AttestError::Provider(format!(
                "{name} of {} bytes exceeds the NSM's limit of {max}",
                v.len()
            )));
        }
    }
    let field = |v: &[u8]| (!v.is_empty()).then(|| ByteBuf::from(v.to_vec()));
    Ok(Request::Attestation {
        user_data: field(user_data),
        nonce: field(nonce),
        public_key: field(public_key),
    })
}

/// Maps the NSM's answer to evidence: the document as it came (the
/// COSE_Sign1 bytes, unmodified), or the NSM's error.
pub fn evidence_from_response(response: Response) -> Result<Evidence, AttestError> {
    match response {
        Response::Attestation { document } if !document.is_empty() => Ok(Evidence {
            format: EvidenceFormat::Nitro,
            document,
        }),
        Response::Attestation { .. } => Err(AttestError::Provider(
            "the NSM returned an empty document".into(),
        )),
        Response::Error(code) => Err(AttestError::Provider(format!(
            "the NSM refused the attestation request: {code:?}"
        ))),
        other => Err(AttestError::Provider(format!(
            "unexpected NSM response to an attestation request: {other:?}"
        ))),
    }
}

/// Attestation provider backed by the NSM.
pub struct NitroProvider<D: NsmDevice = DevNsm> {
    device: D,
}

impl NitroProvider<DevNsm> {
    /// A provider over `/dev/nsm`; fails outside a Nitro enclave.
    pub fn open() -> Result<Self, AttestError> {
        Ok(Self {
            device: DevNsm::open()?,
        })
    }
}

impl<D: NsmDevice> NitroProvider<D> {
    /// A provider over another device (tests).
    pub fn with_device(device: D) -> Self {
        Self { device }
    }
}

impl<D: NsmDevice> AttestationProvider for NitroProvider<D> {
    fn format(&self) -> EvidenceFormat {
        EvidenceFormat::Nitro
    }

    fn attest(
        &self,
        public_key: &[u8],
        user_data: &[u8],
        nonce: &[u8],
    ) -> Result<Evidence, AttestError> {
        let request = attestation_request(public_key, user_data, nonce)?;
        evidence_from_response(self.device.process(request))
    }
}

/// This enclave's own measurement (its PCRs): a document the provider makes
/// binding nothing, checked against `verifier`'s root at the document's own
/// time (the enclave's clock has no NTP: judged at "now", a clock that lags
/// the NSM's would refuse the enclave's own fresh document, and "now" adds
/// nothing to a document made a moment ago). A stage accepts a neighbour
/// running the same image with it (`trust_same_image`).
pub fn own_measurement(
    provider: &dyn AttestationProvider,
    verifier: &crate::nitro::NitroVerifier,
) -> Result<crate::evidence::Measurement, AttestError> {
    let evidence = provider.attest(&[], &[], &[])?;
    let at_its_time = verifier
        .clone()
        .with_time(crate::nitro::VerifyTime::DocumentTime);
    Ok(at_its_time.verify(&evidence.document)?.document.measurement)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::claims::{attest_claims, bound_claims, claims_binding, EvidencePurpose};
    use crate::digest::Sha256Digest;
    use crate::frames::StageClaims;
    use crate::nitro::NitroVerifier;
    use aws_nitro_enclaves_nsm_api::api::ErrorCode;

    /// A document recorded on Nitro hardware (tests/fixtures/nitro/README.md).
    const RECORDED: &[u8] = include_bytes!("../../tests/fixtures/nitro/blindai-debug.cbor");
    const RECORDED_AT: u64 = 1_679_500_000;

    /// Answers with a canned response and keeps the requests it saw.
    struct Recorder {
        seen: Mutex<Vec<String>>,
        answer: fn() -> Response,
    }

    impl NsmDevice for Recorder {
        fn process(&self, request: Request) -> Response {
            self.seen.lock().unwrap().push(format!("{request:?}"));
            (self.answer)()
        }
    }

    fn recorder(answer: fn() -> Response) -> NitroProvider<Recorder> {
        NitroProvider::with_device(Recorder {
            seen: Mutex::new(Vec::new()),
            answer,
        })
    }

    /// Public key, user data and nonce of an attestation request.
    type Fields = (Option<Vec<u8>>, Option<Vec<u8>>, Option<Vec<u8>>);

    fn fields(r: Request) -> Fields {
        match r {
            Request::Attestation {
                user_data,
                nonce,
                public_key,
            } => (
                public_key.map(|b| b.into_vec()),
                user_data.map(|b| b.into_vec()),
                nonce.map(|b| b.into_vec()),
            ),
            other => panic!("not an attestation request: {other:?}"),
        }
    }

    #[test]
    fn request_carries_the_three_fields_and_leaves_out_empty_ones() {
        let r = attestation_request(b"key", b"data", b"nonce").unwrap();
        assert_eq!(
            fields(r),
            (
                Some(b"key".to_vec()),
                Some(b"data".to_vec()),
                Some(b"nonce".to_vec())
            )
        );
        let r = attestation_request(b"key", b"data", b"").unwrap();
        assert_eq!(fields(r).2, None);
    }

    #[test]
    fn request_respects_the_nsm_limits() {
        assert!(attestation_request(&[1; 1024], &[2; 512], &[3; 512]).is_ok());
        for (pk, ud, n) in [(1025, 0, 0), (0, 513, 0), (0, 0, 513)] {
            let e = attestation_request(&vec![1; pk], &vec![2; ud], &vec![3; n]).unwrap_err();
            assert!(
                matches!(e, AttestError::Provider(ref m) if m.contains("limit")),
                "{e}"
            );
        }
    }

    #[test]
    fn stage_claims_fit_as_a_digest() {
        // The claims themselves may exceed 512 bytes (HPKE keys, model id);
        // what goes to the NSM is their 32-byte digest.
        let claims = StageClaims {
            stage_index: 0,
            num_stages: 4,
            layer_start: 0,
            layer_end: 8,
            model_id: "m".repeat(600),
            manifest_sha256: Sha256Digest::of(b"manifest"),
            receipt_key: [7; 32],
            hpke_keys: vec![9; 300],
            weights: None,
        };
        let p = recorder(|| Response::Attestation {
            document: RECORDED.to_vec(),
        });
        attest_claims(&p, &[5; 32], EvidencePurpose::Channel, &claims, &[6; 32]).unwrap();
        let seen = p.device.seen.lock().unwrap();
        assert_eq!(seen.len(), 1);
        let digest = claims_binding(
            EvidenceFormat::Nitro,
            EvidencePurpose::Channel,
            &crate::cbor::to_vec(&claims),
        );
        assert_eq!(digest.len(), 32);
        // The request the device saw carried the digest, the key and the nonce.
        let want = format!(
            "{:?}",
            attestation_request(&[5; 32], &digest, &[6; 32]).unwrap()
        );
        assert_eq!(seen[0], want);
    }

    #[test]
    fn recorded_document_maps_to_verifiable_evidence() {
        let p = recorder(|| Response::Attestation {
            document: RECORDED.to_vec(),
        });
        let ev = p.attest(b"k", b"u", b"n").unwrap();
        assert_eq!(ev.format, EvidenceFormat::Nitro);
        assert_eq!(ev.document, RECORDED);
        let doc = NitroVerifier::aws()
            .at(RECORDED_AT)
            .verify(&ev.document)
            .unwrap()
            .document;
        assert_eq!(doc.public_key, b"my super secret key");
        assert_eq!(doc.user_data, b"hello, world!");
        // This recording binds no claims digest: a verifier refuses it as
        // stage evidence.
        assert!(bound_claims(&doc, EvidencePurpose::Channel, Some(b"claims")).is_err());
        // (The evidence verifier dispatch on recorded documents is tested in
        // tests/nitro.rs.)
    }

    #[test]
    fn nsm_errors_and_odd_answers_are_provider_errors() {
        let cases: [fn() -> Response; 3] = [
            || Response::Error(ErrorCode::InputTooLarge),
            || Response::Attestation { document: vec![] },
            || Response::GetRandom { random: vec![1] },
        ];
        for answer in cases {
            let e = recorder(answer).attest(b"k", b"u", b"n").unwrap_err();
            assert!(matches!(e, AttestError::Provider(_)), "{e}");
        }
    }

    #[test]
    fn own_measurement_is_the_verified_documents_pcrs() {
        let p = recorder(|| Response::Attestation {
            document: RECORDED.to_vec(),
        });
        // Judged at the document's own time: with the system clock, today,
        // its three-hour leaf has long expired.
        assert!(NitroVerifier::aws().verify(RECORDED).is_err());
        let m = own_measurement(&p, &NitroVerifier::aws()).unwrap();
        let crate::evidence::Measurement::Nitro(pcrs) = &m else {
            panic!("{m:?}")
        };
        assert!(pcrs.get(0).is_some() && pcrs.get(1).is_some() && pcrs.get(2).is_some());
        // It asked for a document binding nothing.
        let seen = p.device.seen.lock().unwrap();
        assert_eq!(
            seen[0],
            format!("{:?}", attestation_request(&[], &[], &[]).unwrap())
        );
        drop(seen);
        // A document that does not verify (another root) is refused.
        let other = rcgen::generate_simple_self_signed(vec!["x".into()]).unwrap();
        let e = own_measurement(&p, &NitroVerifier::with_root_der(other.cert.der().to_vec()))
            .unwrap_err();
        assert!(!e.to_string().is_empty());
        // An NSM error is a provider error.
        let e = own_measurement(
            &recorder(|| Response::Error(ErrorCode::InternalError)),
            &NitroVerifier::aws().at(RECORDED_AT),
        )
        .unwrap_err();
        assert!(matches!(e, AttestError::Provider(_)), "{e}");
    }

    #[test]
    fn opening_outside_an_enclave_fails_cleanly() {
        if std::path::Path::new("/dev/nsm").exists() {
            return;
        }
        assert!(matches!(
            NitroProvider::open(),
            Err(AttestError::Provider(m)) if m.contains("/dev/nsm")
        ));
    }
}
