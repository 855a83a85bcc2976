//! `gateway verify evidence`, `gateway verify receipt` and `gateway verify
//! attestation`: offline verification with one line per check.
//!
//! Output: one line per check, `PASS|FAIL|SKIP|WARN|INFO name: detail`
//! (a failed receipt check ends with its stable reason code in brackets,
//! e.g. `[response_mismatch]`), then a `RESULT` line. `--json` prints one
//! JSON document instead. Exit code 0 only when every check holds.

use crate::bundle::load_bundle;
use crate::io::{parse_hex, read_input};
use crate::log_state::LogState;
use crate::{EXIT_FAILED, EXIT_OK};
use anyhow::{anyhow, bail, Result};
use clap::{Args, Subcommand};
use proto::attestation::{AnyVerifier, AttestError, BindingError, ExpectedBinding, Measurement};
use proto::bundle::{EvidenceBundle, LegacyEvidence, VerifiedBundle};
use proto::nitro::{decode_document, NitroVerifier};
use proto::policy::Policy;
use proto::report::CheckStatus;
use serde_json::json;
use std::path::{Path, PathBuf};

mod receipt;
mod receipt_log;
#[cfg(test)]
mod tests;

use receipt::run_receipt;
pub use receipt::ReceiptArgs;

/// `gateway verify …`
#[derive(Subcommand, Debug)]
pub enum VerifyCommand {
    /// Verify an evidence bundle against a measurement policy.
    Evidence(EvidenceArgs),
    /// Verify a receipt against an evidence bundle (verified first) and the
    /// request/response bytes the client kept.
    Receipt(Box<ReceiptArgs>),
    /// Verify one raw AWS Nitro attestation document (CBOR or base64):
    /// COSE signature, certificate chain to the pinned AWS root at `--at`,
    /// optionally PCRs against a policy and the bound nonce / key / data.
    Attestation(AttestationArgs),
}

/// `gateway verify attestation`
#[derive(Args, Debug)]
pub struct AttestationArgs {
    /// Judge certificate validity at this time (Unix seconds); documents'
    /// leaf certificates live about three hours.
    #[arg(long)]
    pub at: u64,
    /// Check the PCRs against this measurement policy (TOML).
    #[arg(long)]
    pub policy: Option<PathBuf>,
    /// With `--policy`: the stage whose PCR sets apply (default: any stage).
    #[arg(long, requires = "policy")]
    pub stage: Option<u32>,
    /// Expected nonce (hex).
    #[arg(long)]
    pub nonce: Option<String>,
    /// Expected public key (hex).
    #[arg(long)]
    pub public_key: Option<String>,
    /// Expected user data (hex).
    #[arg(long)]
    pub user_data: Option<String>,
    /// Machine-readable output (one JSON document).
    #[arg(long)]
    pub json: bool,
    /// The document: raw CBOR (COSE_Sign1, tagged or not) or its base64
    /// text; `-` for standard input.
    pub document: PathBuf,
}

/// `gateway verify evidence`
#[derive(Args, Debug)]
pub struct EvidenceArgs {
    /// Measurement policy (TOML, as config/policy.toml).
    #[arg(long)]
    pub policy: PathBuf,
    /// The nonce (hex) sent as `/v1/attestation?nonce=`; without it the
    /// bundle's own nonce is used and freshness is NOT checked.
    #[arg(long)]
    pub nonce: Option<String>,
    /// Judge Nitro certificates at this time (Unix seconds) instead of now
    /// (fresh documents' leaf certificates live about three hours).
    #[arg(long)]
    pub at: Option<u64>,
    /// Machine-readable output (one JSON document).
    #[arg(long)]
    pub json: bool,
    /// With a log-backed policy: the latest transparency-log checkpoint
    /// seen, kept in FILE (JSON; made if missing). The bundle's checkpoint
    /// must be consistent with it (no split view); the larger is saved.
    #[arg(long, value_name = "FILE")]
    pub log_state: Option<PathBuf>,
    /// The log whose tiles prove consistency (its prefix, e.g.
    /// https://gw/v1/transparency), read only when the bundle's checkpoint
    /// and the saved one differ in size.
    #[arg(long, value_name = "URL", requires = "log_state")]
    pub log: Option<String>,
    /// How to reach --log.
    #[command(flatten)]
    pub transport: crate::Transport,
    /// The bundle: the CBOR from `/v1/attestation` with `Accept:
    /// application/cbor`, or its JSON form; `-` for standard input.
    pub bundle: PathBuf,
}

/// One line of output: the report line every verifier uses, with a
/// stable reason code when a receipt check failed.
pub(crate) type Line = proto::report::Check;

/// A PASS line, or a FAIL line with the reason code `reason`.
pub(crate) fn pass_or_fail(ok: bool, name: &str, detail: String, reason: &'static str) -> Line {
    let mut l = Line::new(
        if ok {
            CheckStatus::Pass
        } else {
            CheckStatus::Fail
        },
        name,
        detail,
    );
    if !ok {
        l.error = Some(reason);
    }
    l
}

/// What a failed check under a `trust_local_build` policy adds.
pub const TRUST_LOCAL_BUILD_HINT: &str =
    "trust_local_build applies only inside the gateway that launches the stages; a client \
     accepts pinned measurements only (`gateway policy from-build` writes them from the \
     build record of an image you rebuilt; for development, `gateway policy pin \
     --trust-on-first-use` pins what the server reports; docs/curl.md)";

/// The outcome of verifying a bundle.
pub(crate) struct EvidenceOutcome {
    pub lines: Vec<Line>,
    pub verified: Option<VerifiedBundle>,
    pub nonce_checked: bool,
    pub nonce: Vec<u8>,
}

impl EvidenceOutcome {
    /// Whether everything held.
    pub fn ok(&self) -> bool {
        self.verified.is_some() && self.lines.iter().all(|l| l.status != CheckStatus::Fail)
    }

    /// Machine-readable form.
    pub fn to_json(&self) -> serde_json::Value {
        let v = self.verified.as_ref();
        json!({
            "ok": self.ok(),
            "nonce": hex::encode(&self.nonce),
            "nonce_checked": self.nonce_checked,
            "checks": self.lines.iter().map(Line::to_json).collect::<Vec<_>>(),
            "mock": v.map(|v| v.mock),
            "manifest_sha256": v.map(|v| v.manifest_digest.hex()),
            "stages": v.map(|v| v.stage_keys.iter().zip(&v.measurements).map(|(k, m)| json!({
                "index": k.stage_index,
                "layers": k.layers,
                "measurement": m,
                "evidence_digest": k.evidence_digest.hex(),
                "receipt_key": hex::encode(k.receipt_key),
            })).collect::<Vec<_>>()),
            "entry_keys": v.map(|v| v.entry_keys.iter().map(|k| json!({
                "key_id": k.key_id,
                "public_key": hex::encode(k.public_key),
                "aeads": k.aeads.iter().map(|a| super::client_key::aead_name(*a)).collect::<Vec<_>>(),
            })).collect::<Vec<_>>()),
        })
    }
}

/// Verifies `bundle` against `policy`. `nonce`: the one the verifier sent,
/// or `None` to take the bundle's own (freshness then is not checked).
/// `at`: the time Nitro certificates are judged at (none: now). `legacy`:
/// whether evidence made before documents carried a purpose label is
/// accepted: only the offline verbs (`gateway verify evidence`, `gateway
/// verify receipt`), which check bundles archived before the label
/// existed, say [`LegacyEvidence::Accept`]; every path that is about to
/// seal to the keys a bundle vouches for (the SDK, the proxy, `gateway
/// seal`) refuses it.
pub(crate) fn verify_evidence(
    bundle: &EvidenceBundle,
    policy: &Policy,
    nonce: Option<&[u8]>,
    at: Option<u64>,
    legacy: LegacyEvidence,
) -> EvidenceOutcome {
    let mut lines = Vec::new();
    let nonce_checked = nonce.is_some();
    let nonce = nonce.unwrap_or(&bundle.nonce).to_vec();
    if !nonce_checked {
        lines.push(Line::new(
            CheckStatus::Warn,
            "freshness",
            format!(
                "no --nonce given: using the bundle's own nonce ({}), so this does not show \
                 that the evidence is fresh (it may be replayed)",
                if bundle.nonce.is_empty() {
                    "empty".to_string()
                } else {
                    hex::encode(&bundle.nonce)
                }
            ),
        ));
    }
    let mut verifier = AnyVerifier::default();
    if let Some(t) = at {
        verifier.nitro = verifier.nitro.at(t);
        lines.push(Line::new(
            CheckStatus::Info,
            "time",
            format!("Nitro certificates are judged at {t} (Unix s), not now"),
        ));
    }
    let (checks, verified) = bundle.verify_accepting(policy, &nonce, &verifier, legacy);
    let mut measurement_failed = false;
    for c in checks {
        measurement_failed |= c.failed() && c.detail.contains("is not in the policy");
        lines.push(Line::new(c.status, c.name, c.detail));
    }
    if measurement_failed && policy.trust_local_build {
        lines.push(Line::new(CheckStatus::Info, "hint", TRUST_LOCAL_BUILD_HINT));
    }
    if let Some(v) = &verified {
        if v.mock {
            lines.push(Line::new(
                CheckStatus::Warn,
                "mock",
                format!(
                    "{} (accepted because the policy sets allow_mock = true)",
                    proto::attestation::MOCK_WARNING
                ),
            ));
        }
    }
    EvidenceOutcome {
        lines,
        verified,
        nonce_checked,
        nonce,
    }
}

fn load_policy(path: &Path) -> Result<Policy> {
    Policy::load(path).map_err(|e| anyhow!(e))
}

fn print_lines(lines: &[Line]) {
    for l in lines {
        println!("{l}");
    }
}

fn result_line(ok: bool, what: &str, lines: &[Line]) {
    let failed = lines
        .iter()
        .filter(|l| l.status == CheckStatus::Fail)
        .count();
    if ok {
        println!("RESULT: OK ({what} verified)");
    } else {
        println!("RESULT: FAILED ({failed} check(s) failed)");
    }
}

/// Runs `gateway verify …`; returns the exit code.
pub fn run(cmd: VerifyCommand) -> Result<i32> {
    match cmd {
        VerifyCommand::Evidence(a) => run_evidence(a),
        VerifyCommand::Receipt(a) => run_receipt(*a),
        VerifyCommand::Attestation(a) => run_attestation(a),
    }
}

/// Hex, plus the text in quotes when it is printable UTF-8.
fn show_bytes(b: &[u8]) -> String {
    if b.is_empty() {
        return "(absent)".into();
    }
    match std::str::from_utf8(b) {
        Ok(t) if t.chars().all(|c| !c.is_control()) => format!("{} ({t:?})", hex::encode(b)),
        _ => hex::encode(b),
    }
}

/// Which step of `NitroVerifier::verify` an error belongs to.
fn failed_step(e: &AttestError) -> &'static str {
    match e {
        AttestError::Malformed(_) | AttestError::UnsupportedAlgorithm(_) => "document",
        AttestError::CertificateExpired { .. }
        | AttestError::CertificateNotYetValid { .. }
        | AttestError::UntrustedChain(_)
        | AttestError::BadCertificate(_) => "certificate chain",
        _ => "signature",
    }
}

fn run_attestation(a: AttestationArgs) -> Result<i32> {
    let policy = a.policy.as_deref().map(load_policy).transpose()?;
    let raw = read_input(&a.document)?;
    let hex_arg =
        |what: &str, v: &Option<String>| v.as_deref().map(|s| parse_hex(what, s)).transpose();
    let nonce = hex_arg("--nonce", &a.nonce)?;
    let public_key = hex_arg("--public-key", &a.public_key)?;
    let user_data = hex_arg("--user-data", &a.user_data)?;
    let verifier = NitroVerifier::aws().at(a.at);
    let mut lines = Vec::new();
    let result = decode_document(&raw).and_then(|d| verifier.verify(&d));
    let steps = ["document", "certificate chain", "signature"];
    let v = match result {
        Ok(v) => {
            lines.push(Line::new(
                CheckStatus::Pass,
                "document",
                format!(
                    "COSE_Sign1 ({}), ES384, payload well formed",
                    if v.tagged { "tagged" } else { "untagged" }
                ),
            ));
            lines.push(Line::new(
                CheckStatus::Pass,
                "certificate chain",
                format!(
                    "{} certificates up to the pinned AWS Nitro root G1 (sha256 {}), all valid at {} (Unix s); leaf valid {}..{}",
                    v.chain_len,
                    proto::nitro::AWS_NITRO_ROOT_G1_SHA256,
                    a.at,
                    v.leaf_validity.0,
                    v.leaf_validity.1
                ),
            ));
            lines.push(Line::new(
                CheckStatus::Pass,
                "signature",
                "ES384 signature by the leaf certificate's key verifies",
            ));
            Some(v)
        }
        Err(e) => {
            let step = failed_step(&e);
            let at = steps.iter().position(|s| *s == step).unwrap_or(0);
            for s in &steps[..at] {
                lines.push(Line::new(CheckStatus::Pass, *s, "ok"));
            }
            lines.push(Line::new(CheckStatus::Fail, step, e.to_string()));
            for s in &steps[at + 1..] {
                lines.push(Line::new(CheckStatus::Skipped, *s, "not checked"));
            }
            None
        }
    };
    if let Some(v) = &v {
        let d = &v.document;
        let Measurement::Nitro(pcrs) = &d.measurement else {
            bail!("a Nitro document without PCRs");
        };
        lines.push(Line::new(
            CheckStatus::Info,
            "module_id",
            d.module_id.clone(),
        ));
        lines.push(Line::new(
            CheckStatus::Info,
            "timestamp",
            format!("{} ms ({} Unix s)", d.timestamp_ms, d.timestamp_ms / 1000),
        ));
        for (i, p) in &pcrs.0 {
            lines.push(Line::new(
                CheckStatus::Info,
                format!("PCR{i}"),
                hex::encode(p),
            ));
        }
        lines.push(Line::new(
            CheckStatus::Info,
            "public_key",
            show_bytes(&d.public_key),
        ));
        lines.push(Line::new(
            CheckStatus::Info,
            "user_data",
            show_bytes(&d.user_data),
        ));
        lines.push(Line::new(CheckStatus::Info, "nonce", show_bytes(&d.nonce)));
        if pcrs.is_debug() {
            lines.push(Line::new(
                CheckStatus::Warn,
                "debug",
                "the enclave ran in debug mode (PCRs zero): the parent could read its memory",
            ));
        }
        for (name, want, err) in [
            ("nonce", nonce.as_deref(), BindingError::Nonce),
            ("public_key", public_key.as_deref(), BindingError::PublicKey),
            ("user_data", user_data.as_deref(), BindingError::UserData),
        ] {
            let Some(want) = want else { continue };
            let expected = match name {
                "nonce" => ExpectedBinding {
                    nonce: Some(want),
                    ..Default::default()
                },
                "public_key" => ExpectedBinding {
                    public_key: Some(want),
                    ..Default::default()
                },
                _ => ExpectedBinding {
                    user_data: Some(want),
                    ..Default::default()
                },
            };
            lines.push(match d.check_binding(&expected) {
                Ok(()) => Line::new(
                    CheckStatus::Pass,
                    format!("binding {name}"),
                    "matches the expected value",
                ),
                Err(_) => Line::new(
                    CheckStatus::Fail,
                    format!("binding {name}"),
                    err.to_string(),
                ),
            });
        }
        if let Some(policy) = &policy {
            let stages: Vec<u32> = match a.stage {
                Some(s) => vec![s],
                None => policy.stages.iter().map(|s| s.index).collect(),
            };
            let results: Vec<(u32, Result<(), String>)> = stages
                .iter()
                .map(|&s| {
                    (
                        s,
                        policy
                            .check_measurement(d, s, None)
                            .map_err(|e| e.to_string()),
                    )
                })
                .collect();
            let line = match results.iter().find(|(_, r)| r.is_ok()) {
                Some((s, _)) => Line::new(
                    CheckStatus::Pass,
                    "policy",
                    format!("PCRs accepted for stage {s} ({})", pcrs.pinned_form()),
                ),
                None => Line::new(
                    CheckStatus::Fail,
                    "policy",
                    results
                        .iter()
                        .map(|(_, r)| r.clone().unwrap_err())
                        .collect::<Vec<_>>()
                        .join("; ")
                        .chars()
                        .take(2000)
                        .collect::<String>()
                        + if results.is_empty() {
                            "the policy names no stage"
                        } else {
                            ""
                        },
                ),
            };
            lines.push(line);
        }
    }
    let ok = v.is_some() && lines.iter().all(|l| l.status != CheckStatus::Fail);
    if a.json {
        let d = v.as_ref().map(|v| &v.document);
        let pcrs = d.and_then(|d| match &d.measurement {
            Measurement::Nitro(p) => Some(
                p.0.iter()
                    .map(|(i, v)| (i.to_string(), json!(hex::encode(v))))
                    .collect::<serde_json::Map<_, _>>(),
            ),
            _ => None,
        });
        let doc = json!({
            "ok": ok,
            "at": a.at,
            "checks": lines.iter().filter(|l| l.status != CheckStatus::Info).map(Line::to_json).collect::<Vec<_>>(),
            "module_id": d.map(|d| d.module_id.clone()),
            "timestamp_ms": d.map(|d| d.timestamp_ms),
            "pcrs": pcrs,
            "debug": v.as_ref().map(|v| v.payload.pcrs.is_debug()),
            "public_key": d.map(|d| hex::encode(&d.public_key)),
            "user_data": d.map(|d| hex::encode(&d.user_data)),
            "nonce": d.map(|d| hex::encode(&d.nonce)),
            "tagged": v.as_ref().map(|v| v.tagged),
            "chain_len": v.as_ref().map(|v| v.chain_len),
            "leaf_validity": v.as_ref().map(|v| [v.leaf_validity.0, v.leaf_validity.1]),
        });
        println!("{}", serde_json::to_string_pretty(&doc)?);
    } else {
        print_lines(&lines);
        result_line(ok, "attestation document", &lines);
    }
    Ok(if ok { EXIT_OK } else { EXIT_FAILED })
}

/// `--log-state`: the `log consistency` line for a bundle that verified
/// (the state file read, the bundle's checkpoint observed, the file saved).
fn log_consistency(a: &EvidenceArgs, policy: &Policy, bundle: &EvidenceBundle) -> Result<Line> {
    let path = a.log_state.as_deref().expect("--log-state given");
    let Some(log) = &policy.transparency else {
        bail!("--log-state needs a log-backed policy ([transparency] log_key)");
    };
    let mut state = LogState::load(path)?;
    let note = match &bundle.transparency {
        Some(p) => &p.checkpoint,
        None => bail!("the bundle carries no log checkpoint"),
    };
    let tiles = crate::log_state::HttpTiles::from_arg(a.log.as_deref(), &a.transport)?;
    let observed = crate::transport::runtime()?.block_on(state.observe(&log.log_key, note, &tiles));
    Ok(match observed {
        Ok(seen) => Line::new(
            CheckStatus::Pass,
            "log consistency",
            format!("{seen} ({})", path.display()),
        ),
        Err(e) => Line::new(CheckStatus::Fail, "log consistency", format!("{e:#}")),
    })
}

fn run_evidence(a: EvidenceArgs) -> Result<i32> {
    let policy = load_policy(&a.policy)?;
    if a.log_state.is_some() && policy.transparency.is_none() {
        bail!("--log-state needs a log-backed policy ([transparency] log_key)");
    }
    let bundle = load_bundle(&a.bundle)?;
    let nonce = a
        .nonce
        .as_deref()
        .map(|n| parse_hex("--nonce", n))
        .transpose()?;
    // Offline: a bundle archived before documents carried a purpose label
    // still verifies, reported as LEGACY.
    let mut out = verify_evidence(
        &bundle,
        &policy,
        nonce.as_deref(),
        a.at,
        LegacyEvidence::Accept,
    );
    if a.log_state.is_some() {
        out.lines.push(if out.ok() {
            log_consistency(&a, &policy, &bundle)?
        } else {
            Line::new(
                CheckStatus::Skipped,
                "log consistency",
                "not checked: the evidence does not verify",
            )
        });
    }
    if a.json {
        println!("{}", serde_json::to_string_pretty(&out.to_json())?);
    } else {
        print_lines(&out.lines);
        if let Some(v) = &out.verified {
            for (k, m) in v.stage_keys.iter().zip(&v.measurements) {
                println!(
                    "INFO stage {}: layers [{}, {}), measurement {m}, receipt key {}",
                    k.stage_index,
                    k.layers[0],
                    k.layers[1],
                    hex::encode(k.receipt_key)
                );
            }
            for k in &v.entry_keys {
                println!(
                    "INFO entry HPKE key: id {}, public key {}",
                    k.key_id,
                    hex::encode(k.public_key)
                );
            }
        }
        result_line(out.ok(), "evidence", &out.lines);
    }
    Ok(if out.ok() { EXIT_OK } else { EXIT_FAILED })
}
