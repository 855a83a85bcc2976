//! `gateway verify evidence`, `gateway verify receipt` and `gateway verify
//! attestation`: offline verification with one line per check.
//!
//! Output: one line per check, `PASS|FAIL|SKIP|WARN|INFO name: detail`
//! (a failed receipt check ends with its stable reason code in brackets,
//! e.g. `[response_mismatch]`), then a `RESULT` line. `--json` prints one
//! JSON document instead. Exit code 0 only when every check holds.

use super::client_key::ClientKeyFile;
use super::{load_bundle, parse_hex, read_input, EXIT_FAILED, EXIT_OK};
use anyhow::{anyhow, bail, Context, Result};
use base64::Engine as _;
use clap::{Args, Subcommand};
use proto::attestation::{AnyVerifier, AttestError, BindingError, ExpectedBinding, Measurement};
use proto::bundle::{EvidenceBundle, VerifiedBundle};
use proto::nitro::{decode_document, NitroVerifier};
use proto::policy::Policy;
use proto::receipt::{
    verify_receipt, CheckStatus, ReceiptBody, Sealing, VerifyInputs, VerifyReport,
};
use serde_json::json;
use std::path::{Path, PathBuf};

/// `gateway verify …`
#[derive(Subcommand, Debug)]
pub enum VerifyCommand {
    /// Verify an evidence bundle against a measurement policy.
    Evidence(EvidenceArgs),
    /// Verify a receipt against an evidence bundle (verified first) and the
    /// request/response bytes the client kept.
    Receipt(ReceiptArgs),
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
    /// The bundle: the CBOR from `/v1/attestation` with `Accept:
    /// application/cbor`, or its JSON form; `-` for standard input.
    pub bundle: PathBuf,
}

/// `gateway verify receipt`
#[derive(Args, Debug)]
pub struct ReceiptArgs {
    /// The evidence bundle (CBOR or JSON from `/v1/attestation`).
    #[arg(long)]
    pub evidence: PathBuf,
    /// Measurement policy; its `allow_mock` also decides whether a mock
    /// receipt is accepted.
    #[arg(long)]
    pub policy: PathBuf,
    /// The nonce (hex) the evidence was fetched with; without it the
    /// evidence's freshness is not checked (a WARN line says so).
    #[arg(long)]
    pub evidence_nonce: Option<String>,
    /// The exact request body the client sent (plaintext).
    #[arg(long)]
    pub request: Option<PathBuf>,
    /// The exact response body the client received (plaintext: opened, if sealed).
    #[arg(long)]
    pub response: Option<PathBuf>,
    /// The `receipt-nonce` (hex) the client sent with the request (default:
    /// the one in --client-key).
    #[arg(long, conflicts_with = "no_nonce")]
    pub nonce: Option<String>,
    /// The client sent no `receipt-nonce`: the receipt must carry none.
    #[arg(long)]
    pub no_nonce: bool,
    /// The API path the request was sent to (e.g. `/v1/chat/completions`):
    /// the receipt must name it.
    #[arg(long)]
    pub endpoint: Option<String>,
    /// How the request must have been sealed (`enclave` must be proven with
    /// --client-key).
    #[arg(long, value_parser = ["enclave", "gateway", "plain"])]
    pub expect_sealing: Option<String>,
    /// Accept a verification without --request, --response, the receipt
    /// nonce (--nonce, --no-nonce or --client-key) or --evidence-nonce:
    /// what is not given is not checked, and every such line says INSECURE.
    /// Without this flag a missing input fails the verification.
    #[arg(long)]
    pub insecure_partial: bool,
    /// The client key file `gateway seal --key-out` wrote: proves the
    /// receipt's `sealing` against the encapsulated key the request was
    /// sealed with (without it, `sealing` is the host's word).
    #[arg(long)]
    pub client_key: Option<PathBuf>,
    /// The receipt: raw COSE_Sign1 bytes (`GET /v1/receipts/{id}`), the
    /// base64url text of the `receipt` response header, or the response
    /// headers as `curl -D` saved them (the `receipt:` line is used).
    #[arg(
        long,
        conflicts_with = "receipt_b64",
        required_unless_present = "receipt_b64"
    )]
    pub receipt: Option<PathBuf>,
    /// The receipt as base64url text (the `receipt` response header's value).
    #[arg(long)]
    pub receipt_b64: Option<String>,
    /// Judge the evidence's Nitro certificates at this time (Unix seconds)
    /// instead of now: e.g. when the receipt was issued.
    #[arg(long)]
    pub at: Option<u64>,
    /// Machine-readable output (one JSON document).
    #[arg(long)]
    pub json: bool,
}

/// Status of a line of output.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Status {
    Pass,
    Fail,
    Skip,
    Warn,
    Info,
}

impl Status {
    fn label(self) -> &'static str {
        match self {
            Status::Pass => "PASS",
            Status::Fail => "FAIL",
            Status::Skip => "SKIP",
            Status::Warn => "WARN",
            Status::Info => "INFO",
        }
    }

    fn json(self) -> &'static str {
        match self {
            Status::Pass => "pass",
            Status::Fail => "fail",
            Status::Skip => "skipped",
            Status::Warn => "warn",
            Status::Info => "info",
        }
    }
}

/// One line of output.
#[derive(Clone, Debug)]
pub(crate) struct Line {
    pub status: Status,
    pub name: String,
    pub detail: String,
    pub reason: Option<&'static str>,
}

impl Line {
    fn new(status: Status, name: impl Into<String>, detail: impl Into<String>) -> Self {
        Self {
            status,
            name: name.into(),
            detail: detail.into(),
            reason: None,
        }
    }

    pub(crate) fn text(&self) -> String {
        let mut s = format!("{} {}: {}", self.status.label(), self.name, self.detail);
        if let Some(r) = self.reason {
            s += &format!(" [{r}]");
        }
        s
    }

    fn to_json(&self) -> serde_json::Value {
        json!({
            "name": self.name,
            "status": self.status.json(),
            "detail": self.detail,
            "reason": self.reason,
        })
    }
}

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
        self.verified.is_some() && self.lines.iter().all(|l| l.status != Status::Fail)
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
/// `at`: the time Nitro certificates are judged at (none: now).
pub(crate) fn verify_evidence(
    bundle: &EvidenceBundle,
    policy: &Policy,
    nonce: Option<&[u8]>,
    at: Option<u64>,
) -> EvidenceOutcome {
    let mut lines = Vec::new();
    let nonce_checked = nonce.is_some();
    let nonce = nonce.unwrap_or(&bundle.nonce).to_vec();
    if !nonce_checked {
        lines.push(Line::new(
            Status::Warn,
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
            Status::Info,
            "time",
            format!("Nitro certificates are judged at {t} (Unix s), not now"),
        ));
    }
    let (checks, verified) = bundle.verify_with(policy, &nonce, &verifier);
    let mut measurement_failed = false;
    for c in checks {
        measurement_failed |= !c.ok && c.detail.contains("is not in the policy");
        lines.push(Line::new(
            if c.ok { Status::Pass } else { Status::Fail },
            c.name,
            c.detail,
        ));
    }
    if measurement_failed && policy.trust_local_build {
        lines.push(Line::new(
            Status::Info,
            "hint",
            "trust_local_build applies only inside the gateway that launches the stages; an \
             offline verifier accepts pinned measurements only (see docs/curl.md)",
        ));
    }
    if let Some(v) = &verified {
        if v.mock {
            lines.push(Line::new(
                Status::Warn,
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
        println!("{}", l.text());
    }
}

fn result_line(ok: bool, what: &str, lines: &[Line]) {
    let failed = lines.iter().filter(|l| l.status == Status::Fail).count();
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
        VerifyCommand::Receipt(a) => run_receipt(a),
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
                Status::Pass,
                "document",
                format!(
                    "COSE_Sign1 ({}), ES384, payload well formed",
                    if v.tagged { "tagged" } else { "untagged" }
                ),
            ));
            lines.push(Line::new(
                Status::Pass,
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
                Status::Pass,
                "signature",
                "ES384 signature by the leaf certificate's key verifies",
            ));
            Some(v)
        }
        Err(e) => {
            let step = failed_step(&e);
            let at = steps.iter().position(|s| *s == step).unwrap_or(0);
            for s in &steps[..at] {
                lines.push(Line::new(Status::Pass, *s, "ok"));
            }
            lines.push(Line::new(Status::Fail, step, e.to_string()));
            for s in &steps[at + 1..] {
                lines.push(Line::new(Status::Skip, *s, "not checked"));
            }
            None
        }
    };
    if let Some(v) = &v {
        let d = &v.document;
        let Measurement::Nitro(pcrs) = &d.measurement else {
            bail!("a Nitro document without PCRs");
        };
        lines.push(Line::new(Status::Info, "module_id", d.module_id.clone()));
        lines.push(Line::new(
            Status::Info,
            "timestamp",
            format!("{} ms ({} Unix s)", d.timestamp_ms, d.timestamp_ms / 1000),
        ));
        for (i, p) in &pcrs.0 {
            lines.push(Line::new(Status::Info, format!("PCR{i}"), hex::encode(p)));
        }
        lines.push(Line::new(
            Status::Info,
            "public_key",
            show_bytes(&d.public_key),
        ));
        lines.push(Line::new(
            Status::Info,
            "user_data",
            show_bytes(&d.user_data),
        ));
        lines.push(Line::new(Status::Info, "nonce", show_bytes(&d.nonce)));
        if pcrs.is_debug() {
            lines.push(Line::new(
                Status::Warn,
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
                    Status::Pass,
                    format!("binding {name}"),
                    "matches the expected value",
                ),
                Err(_) => Line::new(Status::Fail, format!("binding {name}"), err.to_string()),
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
                    Status::Pass,
                    "policy",
                    format!("PCRs accepted for stage {s} ({})", pcrs.pinned_form()),
                ),
                None => Line::new(
                    Status::Fail,
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
    let ok = v.is_some() && lines.iter().all(|l| l.status != Status::Fail);
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
            "checks": lines.iter().filter(|l| l.status != Status::Info).map(Line::to_json).collect::<Vec<_>>(),
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

fn run_evidence(a: EvidenceArgs) -> Result<i32> {
    let policy = load_policy(&a.policy)?;
    let bundle = load_bundle(&a.bundle)?;
    let nonce = a
        .nonce
        .as_deref()
        .map(|n| parse_hex("--nonce", n))
        .transpose()?;
    let out = verify_evidence(&bundle, &policy, nonce.as_deref(), a.at);
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

/// Reads a receipt: raw COSE_Sign1 bytes, or base64url/base64 text.
pub(crate) fn decode_receipt_text(bytes: &[u8]) -> Result<Vec<u8>> {
    // A COSE_Sign1 is a CBOR array of 4 (0x84); anything else is taken as text.
    if bytes.first() == Some(&0x84) {
        return Ok(bytes.to_vec());
    }
    let text = std::str::from_utf8(bytes)
        .map_err(|_| anyhow!("the receipt is neither COSE_Sign1 bytes nor base64 text"))?
        .trim();
    // Response headers as `curl -D` saved them: take the `receipt:` line.
    let header = text.lines().find_map(|l| {
        l.split_once(':')
            .filter(|(name, _)| name.trim().eq_ignore_ascii_case("receipt"))
            .map(|(_, value)| value.trim())
    });
    let text = header.unwrap_or(text);
    let engines = [
        base64::engine::general_purpose::URL_SAFE_NO_PAD,
        base64::engine::general_purpose::URL_SAFE,
        base64::engine::general_purpose::STANDARD,
        base64::engine::general_purpose::STANDARD_NO_PAD,
    ];
    engines
        .iter()
        .find_map(|e| e.decode(text).ok())
        .ok_or_else(|| anyhow!("the receipt is neither COSE_Sign1 bytes nor base64(url) text"))
}

fn sealing_detail(s: Sealing) -> &'static str {
    match s {
        Sealing::Enclave => {
            "the client sealed to the entry stage's enclave-held HPKE key: the host relayed ciphertext only"
        }
        Sealing::Gateway => {
            "the client sealed to the gateway's own key: the gateway opened and re-sealed the request (the host saw plaintext)"
        }
        Sealing::Plain => {
            "a plain request: the gateway sealed it to the entry stage (the host saw plaintext)"
        }
    }
}

fn receipt_info(r: &ReceiptBody, sealing_proven: bool, nonce_given: bool) -> Vec<Line> {
    // Only "enclave" claims that the host did not see the request; "gateway"
    // and "plain" say it did, so they need no proof.
    let sealing = if sealing_proven || r.sealing != Sealing::Enclave {
        Line::new(
            Status::Info,
            "sealing",
            format!(
                "{}: {}{}",
                r.sealing.as_str(),
                sealing_detail(r.sealing),
                if sealing_proven {
                    " (proven: the entry stage's signed link names the key this request was sealed with)"
                } else {
                    ""
                }
            ),
        )
    } else {
        Line::new(
            Status::Warn,
            "sealing",
            format!(
                "NOT PROVEN: the receipt says \"enclave\", which is only the host's word ({}); \
                 a sealed client proves it with --client-key",
                if r.version == proto::receipt::ReceiptVersion::V2 {
                    "a v2 receipt does not say which key the enclave opened"
                } else {
                    "no client key given"
                }
            ),
        )
    };
    let mut out = vec![
        Line::new(
            Status::Info,
            "receipt",
            format!(
                "id {}, endpoint {}, model {}, issued at {} ms, sequence {}, {} stage(s)",
                hex::encode(r.receipt_id),
                r.endpoint,
                r.model_id,
                r.issued_at_ms,
                r.sequence,
                r.links()
            ),
        ),
        sealing,
        Line::new(
            if r.mock { Status::Warn } else { Status::Info },
            "mock",
            if r.mock {
                format!("yes: {}", proto::attestation::MOCK_WARNING)
            } else {
                "no: the receipt was made with hardware evidence".to_string()
            },
        ),
    ];
    if let (Some(n), false) = (&r.client_nonce, nonce_given) {
        out.push(Line::new(
            Status::Info,
            "nonce",
            format!(
                "the receipt carries client nonce {} (not checked: pass --nonce)",
                hex::encode(n)
            ),
        ));
    }
    out
}

fn run_receipt(a: ReceiptArgs) -> Result<i32> {
    let policy = load_policy(&a.policy)?;
    let bundle = load_bundle(&a.evidence)?;
    let evidence_nonce = a
        .evidence_nonce
        .as_deref()
        .map(|n| parse_hex("--evidence-nonce", n))
        .transpose()?;
    let receipt = match (&a.receipt, &a.receipt_b64) {
        (Some(p), _) => decode_receipt_text(&read_input(p)?)
            .with_context(|| format!("receipt {}", p.display()))?,
        (None, Some(s)) => decode_receipt_text(s.as_bytes()).context("--receipt-b64")?,
        (None, None) => bail!("give the receipt with --receipt FILE or --receipt-b64 STRING"),
    };
    let request = a.request.as_deref().map(read_input).transpose()?;
    let response = a.response.as_deref().map(read_input).transpose()?;
    let client_key = a
        .client_key
        .as_deref()
        .map(ClientKeyFile::load)
        .transpose()?;
    let nonce = match (&a.nonce, &client_key) {
        (Some(n), _) => Some(parse_hex("--nonce", n)?),
        (None, Some(k)) => k.receipt_nonce.clone(),
        (None, None) => None,
    };

    let mut evidence = verify_evidence(&bundle, &policy, evidence_nonce.as_deref(), a.at);
    for l in &mut evidence.lines {
        if matches!(l.status, Status::Pass | Status::Fail) {
            l.name = format!("evidence.{}", l.name);
        }
    }
    let Some(verified) = evidence.verified.clone().filter(|_| evidence.ok()) else {
        if a.json {
            let doc = json!({
                "ok": false,
                "reason": "evidence_not_verified",
                "evidence": evidence.to_json(),
                "receipt": serde_json::Value::Null,
            });
            println!("{}", serde_json::to_string_pretty(&doc)?);
        } else {
            print_lines(&evidence.lines);
            println!("FAIL receipt: not checked: the evidence does not verify against the policy [evidence_not_verified]");
            result_line(false, "receipt", &evidence.lines);
        }
        return Ok(EXIT_FAILED);
    };

    let mut inputs = VerifyInputs::new(&receipt, &verified.stage_keys);
    inputs.request = request.as_deref();
    inputs.response = response.as_deref();
    inputs.expected_nonce = nonce.as_deref();
    inputs.expected_manifest = Some(verified.manifest_digest);
    inputs.allow_mock = policy.allow_mock;
    inputs.sealed_to = client_key.as_ref().map(ClientKeyFile::sealed_to);
    let report = verify_receipt(&inputs);
    let extra = cli_checks(
        &a,
        &report,
        &Given {
            request: request.is_some(),
            response: response.is_some(),
            nonce: nonce.is_some(),
            evidence_nonce: evidence_nonce.is_some(),
        },
    );
    let ok = report.ok() && !extra.iter().any(|l| l.status == Status::Fail);

    if a.json {
        let mut doc = json!({
            "ok": ok,
            "reason": report
                .failure()
                .map(|e| e.code())
                .or_else(|| extra.iter().find_map(|l| l.reason)),
            "evidence": evidence.to_json(),
            "receipt": report.to_json(),
            "inputs": extra.iter().map(Line::to_json).collect::<Vec<_>>(),
        });
        if let Some(r) = &report.receipt {
            doc["sealing"] = json!(r.sealing.as_str());
            doc["sealing_proven"] = json!(report.sealing_proven);
            doc["mock"] = json!(r.mock);
        }
        println!("{}", serde_json::to_string_pretty(&doc)?);
    } else {
        let mut lines = evidence.lines.clone();
        for c in &report.checks {
            lines.push(Line {
                status: match c.status {
                    CheckStatus::Pass => Status::Pass,
                    CheckStatus::Fail => Status::Fail,
                    CheckStatus::Skipped => Status::Skip,
                },
                name: c.name.clone(),
                detail: c.detail.clone(),
                reason: c.error.as_ref().map(|e| e.code()),
            });
        }
        lines.extend(extra.iter().cloned());
        if let Some(r) = &report.receipt {
            lines.extend(receipt_info(r, report.sealing_proven, nonce.is_some()));
        }
        print_lines(&lines);
        let first = report
            .failure()
            .map(|e| e.code())
            .or_else(|| extra.iter().find_map(|l| l.reason));
        match first {
            None => result_line(true, "receipt", &lines),
            Some(code) => {
                let failed = lines.iter().filter(|l| l.status == Status::Fail).count();
                println!("RESULT: FAILED ({failed} check(s) failed; first: {code})");
            }
        }
    }
    Ok(if ok { EXIT_OK } else { EXIT_FAILED })
}

/// Which inputs `verify receipt` was given.
struct Given {
    request: bool,
    response: bool,
    nonce: bool,
    evidence_nonce: bool,
}

/// The checks of the command line itself: inputs not given fail unless
/// --insecure-partial (then each says INSECURE), and what --no-nonce,
/// --endpoint and --expect-sealing ask of the receipt.
fn cli_checks(a: &ReceiptArgs, report: &VerifyReport, g: &Given) -> Vec<Line> {
    let mut out = Vec::new();
    let missing = [
        (
            g.request,
            "request",
            "--request (the exact request bytes sent)",
        ),
        (
            g.response,
            "response",
            "--response (the exact response bytes received)",
        ),
        (
            g.nonce || a.no_nonce,
            "nonce",
            "the receipt nonce sent (--nonce, --no-nonce or --client-key)",
        ),
        (
            g.evidence_nonce,
            "evidence.freshness",
            "--evidence-nonce (the nonce the evidence was fetched with)",
        ),
    ];
    for (given, name, what) in missing {
        if given {
            continue;
        }
        out.push(if a.insecure_partial {
            Line::new(
                Status::Warn,
                name,
                format!("INSECURE (--insecure-partial): not checked: {what} was not given"),
            )
        } else {
            let mut l = Line::new(
                Status::Fail,
                name,
                format!(
                    "not given: {what}; without it the receipt proves less than it seems \
                     (--insecure-partial accepts that)"
                ),
            );
            l.reason = Some("input_missing");
            l
        });
    }
    let Some(r) = &report.receipt else {
        return out;
    };
    let mut check = |name: &str, ok: bool, pass: String, fail: String, reason: &'static str| {
        let mut l = Line::new(
            if ok { Status::Pass } else { Status::Fail },
            name,
            if ok { pass } else { fail },
        );
        if !ok {
            l.reason = Some(reason);
        }
        out.push(l);
    };
    if a.no_nonce {
        check(
            "nonce",
            r.client_nonce.is_none(),
            "no client nonce, as none was sent".into(),
            "the receipt carries a client nonce, but --no-nonce says none was sent".into(),
            "nonce_mismatch",
        );
    }
    if let Some(e) = &a.endpoint {
        check(
            "endpoint",
            &r.endpoint == e,
            format!("{e}, as expected"),
            format!("the receipt names {}, not {e}", r.endpoint),
            "endpoint_mismatch",
        );
    }
    if let Some(want) = &a.expect_sealing {
        let proven = r.sealing.as_str() != "enclave" || report.sealing_proven;
        check(
            "sealing.expected",
            r.sealing.as_str() == want && proven,
            format!("{want}, as expected"),
            if r.sealing.as_str() == want {
                format!("{want}, but not proven: give --client-key")
            } else {
                format!("the receipt says {}, not {want}", r.sealing.as_str())
            },
            "sealing_mismatch",
        );
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn receipt_text_forms() {
        let raw = vec![0x84, 1, 2, 3, 0xff];
        assert_eq!(decode_receipt_text(&raw).unwrap(), raw);
        let b64 = base64::engine::general_purpose::URL_SAFE_NO_PAD.encode(&raw);
        assert_eq!(decode_receipt_text(b64.as_bytes()).unwrap(), raw);
        assert_eq!(
            decode_receipt_text(format!("{b64}\n").as_bytes()).unwrap(),
            raw
        );
        assert_eq!(
            decode_receipt_text(format!("Receipt: {b64}\r\n").as_bytes()).unwrap(),
            raw
        );
        let dump = format!("HTTP/1.1 200 OK\r\nreceipt-id: 00ff\r\nReceipt: {b64}\r\n\r\n");
        assert_eq!(decode_receipt_text(dump.as_bytes()).unwrap(), raw);
        assert!(decode_receipt_text(b"not base64 at all!").is_err());
    }
}
