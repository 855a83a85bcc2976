//! Which attestation provider a stage runs with: `mock` (development; a
//! public key signs, proves nothing) or `nitro` (the Nitro Secure Module,
//! `/dev/nsm`, compiled in with the Cargo feature `nitro`).

use anyhow::Result;
use proto::attestation::{
    mock_measurement, AttestationProvider, Measurement, MockProvider, DEBUG_WARNING, MOCK_WARNING,
};
use proto::digest::Sha256Digest;
use proto::policy::Policy;
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

/// Applies the in-enclave policy's `allow_debug` (written by `build-eif.sh
/// --debug-policy` for a first bring-up) only where it is safe: a stage
/// that runs in Nitro debug mode itself (its own PCRs zero, its memory open
/// to the parent anyway) may accept debug-mode neighbours; a stage that is
/// not in debug mode never does, whatever the policy says, so a production
/// enclave never sends data to one whose memory the parent can read. Says
/// so loudly either way.
pub fn apply_debug_rule(policy: &mut Policy, own: &Measurement) {
    let own_debug = matches!(own, Measurement::Nitro(pcrs) if pcrs.is_debug());
    if own_debug {
        tracing::warn!("{DEBUG_WARNING}");
    }
    if !policy.allow_debug {
        return;
    }
    if own_debug {
        tracing::warn!(
            "the policy allows debug-mode neighbours (allow_debug = true, a build-eif.sh \
             --debug-policy image): accepted, since this enclave runs in debug mode too"
        );
    } else {
        policy.allow_debug = false;
        tracing::warn!(
            "the policy allows debug-mode neighbours (allow_debug = true, a build-eif.sh \
             --debug-policy image), but this stage is not in Nitro debug mode: \
             debug-mode neighbours are refused"
        );
    }
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

    fn nitro(fill: u8) -> Measurement {
        Measurement::Nitro(proto::evidence::Pcrs(
            [0u8, 1, 2, 8]
                .iter()
                .map(|&i| (i, vec![fill; 48]))
                .collect(),
        ))
    }

    fn debug_policy() -> Policy {
        Policy::from_toml(
            "allow_mock = false\nallow_debug = true\ntrust_same_image = true\n\
             [[stages]]\nindex = 0\nlayers = [0, 3]\n",
        )
        .unwrap()
    }

    #[test]
    fn a_stage_not_in_debug_mode_ignores_allow_debug() {
        let mut p = debug_policy();
        apply_debug_rule(&mut p, &nitro(7));
        assert!(!p.allow_debug);
        let mut p = debug_policy();
        apply_debug_rule(
            &mut p,
            &mock_measurement(
                &Sha256Digest([1; 32]),
                &Sha256Digest([2; 32]),
                &Sha256Digest([3; 32]),
            ),
        );
        assert!(!p.allow_debug, "a mock stage is not in debug mode");
    }

    #[test]
    fn a_debug_mode_stage_keeps_allow_debug_and_a_production_policy_stays_closed() {
        let mut p = debug_policy();
        apply_debug_rule(&mut p, &nitro(0));
        assert!(p.allow_debug);
        let mut p = debug_policy();
        p.allow_debug = false;
        apply_debug_rule(&mut p, &nitro(0));
        assert!(!p.allow_debug);
    }
}
