//! Which attestation provider a stage runs with: `mock` (development; a
//! public key signs, proves nothing) or `nitro` (the Nitro Secure Module,
//! `/dev/nsm`, compiled in with the Cargo feature `nitro`).

use anyhow::Result;
use proto::attestation::{
    mock_measurement, AttestationProvider, Measurement, MockProvider, MOCK_WARNING,
};
use proto::digest::Sha256Digest;
use std::sync::Arc;

/// `--attestation`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum AttestationKind {
    /// The development mock provider.
    Mock,
    /// The Nitro Secure Module.
    Nitro,
}

impl std::str::FromStr for AttestationKind {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        match s {
            "mock" => Ok(Self::Mock),
            "nitro" => Ok(Self::Nitro),
            _ => Err(format!("{s:?}: expected `mock` or `nitro`")),
        }
    }
}

/// Whether this binary was built with Nitro support (feature `nitro`).
pub const NITRO_BUILT_IN: bool = cfg!(feature = "nitro");

/// A provider and the measurement it attests (the stage's own: it also
/// accepts a neighbour with the same one when the policy says so).
pub struct Selected {
    /// Makes the stage's documents.
    pub provider: Arc<dyn AttestationProvider>,
    /// Mock: SHA-256 over binary, manifest and policy; Nitro: this enclave's PCRs.
    pub measurement: Measurement,
}

/// Opens the provider of `kind` for stage `stage_index`; `binary`,
/// `manifest` and `policy` are the digests a mock measurement is made of.
pub fn select(
    kind: AttestationKind,
    stage_index: u32,
    binary: &Sha256Digest,
    manifest: &Sha256Digest,
    policy: &Sha256Digest,
) -> Result<Selected> {
    match kind {
        AttestationKind::Mock => {
            let measurement = mock_measurement(binary, manifest, policy);
            tracing::warn!("{MOCK_WARNING}");
            tracing::warn!(
                stage = stage_index,
                measurement = %measurement.pinned_form(),
                "MOCK ATTESTATION in use: this stage's evidence is signed by a public mock key"
            );
            Ok(Selected {
                provider: Arc::new(MockProvider::new(
                    format!("mock-stage-{stage_index}"),
                    &measurement,
                )),
                measurement,
            })
        }
        AttestationKind::Nitro => nitro(stage_index),
    }
}

#[cfg(feature = "nitro")]
fn nitro(stage_index: u32) -> Result<Selected> {
    use proto::nitro::nsm::{own_measurement, NitroProvider};
    let provider =
        NitroProvider::open().map_err(|e| anyhow::anyhow!("--attestation nitro: {e}"))?;
    let measurement = own_measurement(&provider, &proto::nitro::NitroVerifier::aws())
        .map_err(|e| anyhow::anyhow!("--attestation nitro: our own document: {e}"))?;
    tracing::info!(
        stage = stage_index,
        measurement = %measurement.pinned_form(),
        "Nitro attestation (/dev/nsm)"
    );
    Ok(Selected {
        provider: Arc::new(provider),
        measurement,
    })
}

#[cfg(not(feature = "nitro"))]
fn nitro(_stage_index: u32) -> Result<Selected> {
    ensure_supported(AttestationKind::Nitro)?;
    unreachable!("ensure_supported refuses nitro in this build")
}

/// Fails when this build cannot provide `kind` (Nitro without the feature).
pub fn ensure_supported(kind: AttestationKind) -> Result<()> {
    if kind == AttestationKind::Nitro && !NITRO_BUILT_IN {
        anyhow::bail!(
            "--attestation nitro: this enclave-stage was built without Nitro support \
             (rebuild with `cargo build --release -p enclave-stage --features nitro`)"
        );
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn kinds_parse() {
        assert_eq!("mock".parse(), Ok(AttestationKind::Mock));
        assert_eq!("nitro".parse(), Ok(AttestationKind::Nitro));
        assert!("sev"
            .parse::<AttestationKind>()
            .unwrap_err()
            .contains("mock"));
    }

    #[test]
    fn mock_measures_binary_manifest_and_policy() {
        let (b, m, p) = (
            Sha256Digest::of(b"bin"),
            Sha256Digest::of(b"manifest"),
            Sha256Digest::of(b"policy"),
        );
        let s = select(AttestationKind::Mock, 0, &b, &m, &p).unwrap();
        assert_eq!(s.measurement, mock_measurement(&b, &m, &p));
        assert_eq!(
            s.provider.format(),
            proto::attestation::EvidenceFormat::Mock
        );
    }

    /// Without the feature: a clear refusal. With it, outside an enclave:
    /// a clear error naming /dev/nsm (inside one this test is skipped).
    #[test]
    fn nitro_fails_clearly_where_it_cannot_run() {
        if std::path::Path::new("/dev/nsm").exists() {
            return;
        }
        let d = Sha256Digest::of(b"x");
        let e = select(AttestationKind::Nitro, 0, &d, &d, &d)
            .err()
            .expect("no NSM here")
            .to_string();
        if NITRO_BUILT_IN {
            assert!(e.contains("/dev/nsm"), "{e}");
        } else {
            assert!(e.contains("built without Nitro support"), "{e}");
        }
    }
}
