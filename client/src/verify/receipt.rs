//! `gateway verify receipt`: the evidence first, then the receipt against
//! the request, response and nonces the client kept, and what the command
//! line asks of it (endpoint, sealing); a missing input fails unless
//! `--insecure-partial`.

use super::{load_policy, print_lines, result_line, verify_evidence, Line};
use crate::bundle::load_bundle;
use crate::client_key::ClientKeyFile;
use crate::io::{parse_hex, read_input};
use crate::{EXIT_FAILED, EXIT_OK};
use anyhow::{anyhow, bail, Context, Result};
use clap::Args;
use proto::receipt::{
    verify_receipt, CheckStatus, DigestSalt, ReceiptBody, Sealing, VerifyInputs, VerifyReport,
};
use serde_json::json;
use std::path::PathBuf;

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
    /// The salt of the receipt's digests (hex), needed to check --request
    /// and --response against a v4 receipt (default: the one `gateway
    /// open` kept in --client-key; a plain request's is in the
    /// `receipt-digest-salt` response header).
    #[arg(long)]
    pub digest_salt: Option<String>,
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
    /// The receipt's RFC 9942 inclusion receipt in the policy's
    /// transparency log (`GET /v1/receipts/{id}/inclusion`, or an archive's
    /// `inclusion.cose`): required when the policy says `receipts_logged`.
    #[arg(long, value_name = "FILE")]
    pub inclusion: Option<PathBuf>,
    /// With --inclusion: the latest log checkpoint seen, kept in FILE
    /// (`gateway verify evidence --log-state`, read only here): the tree the
    /// inclusion receipt proves must be consistent with it (no split view).
    #[arg(long, value_name = "FILE", requires = "inclusion")]
    pub log_state: Option<PathBuf>,
    /// The log whose tiles prove that consistency (its prefix, e.g.
    /// https://gw/v1/transparency), read only when the sizes differ.
    #[arg(long, value_name = "URL", requires = "log_state")]
    pub log: Option<String>,
    /// How to reach --log.
    #[command(flatten)]
    pub transport: crate::Transport,
    /// Machine-readable output (one JSON document).
    #[arg(long)]
    pub json: bool,
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
    proto::text::decode_base64(text)
        .ok_or_else(|| anyhow!("the receipt is neither COSE_Sign1 bytes nor base64(url) text"))
}

pub(super) fn sealing_detail(s: Sealing) -> &'static str {
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

pub(super) fn receipt_info(r: &ReceiptBody, sealing_proven: bool, nonce_given: bool) -> Vec<Line> {
    // Only "enclave" claims that the host did not see the request; "gateway"
    // and "plain" say it did, so they need no proof.
    let sealing = if sealing_proven || r.sealing != Sealing::Enclave {
        Line::new(
            CheckStatus::Info,
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
            CheckStatus::Warn,
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
            CheckStatus::Info,
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
            if r.mock {
                CheckStatus::Warn
            } else {
                CheckStatus::Info
            },
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
            CheckStatus::Info,
            "nonce",
            format!(
                "the receipt carries client nonce {} (not checked: pass --nonce)",
                hex::encode(n)
            ),
        ));
    }
    out
}

pub(super) fn run_receipt(a: ReceiptArgs) -> Result<i32> {
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
    let digest_salt = match (&a.digest_salt, &client_key) {
        (Some(s), _) => Some(
            DigestSalt::try_from(parse_hex("--digest-salt", s)?.as_slice())
                .map_err(|_| anyhow!("--digest-salt: not 32 bytes"))?,
        ),
        (None, Some(k)) => k.digest_salt,
        (None, None) => None,
    };

    // Offline, like `gateway verify evidence`: legacy evidence is accepted
    // (and reported as such).
    let mut evidence = verify_evidence(
        &bundle,
        &policy,
        evidence_nonce.as_deref(),
        a.at,
        proto::bundle::LegacyEvidence::Accept,
    );
    for l in &mut evidence.lines {
        if matches!(l.status, CheckStatus::Pass | CheckStatus::Fail) {
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
    inputs.digest_salt = digest_salt.as_ref();
    inputs.expected_nonce = nonce.as_deref();
    inputs.expected_manifest = Some(verified.manifest_digest);
    inputs.allow_mock = policy.allow_mock;
    inputs.sealed_to = client_key.as_ref().map(ClientKeyFile::sealed_to);
    let report = verify_receipt(&inputs);
    let mut extra = cli_checks(
        &a,
        &report,
        &Given {
            request: request.is_some(),
            response: response.is_some(),
            nonce: nonce.is_some(),
            evidence_nonce: evidence_nonce.is_some(),
            inclusion: a.inclusion.is_some()
                || !policy
                    .transparency
                    .as_ref()
                    .is_some_and(|l| l.receipts_logged),
        },
    );
    let log = super::receipt_log::LogArgs {
        inclusion: a.inclusion.as_ref(),
        log_state: a.log_state.as_ref(),
        log: a.log.as_deref(),
        transport: &a.transport,
    };
    extra.extend(super::receipt_log::log_lines(&log, &policy, &receipt)?);
    let ok = report.ok() && !extra.iter().any(|l| l.status == CheckStatus::Fail);

    if a.json {
        let mut doc = json!({
            "ok": ok,
            "reason": report
                .failure()
                .map(|e| e.code())
                .or_else(|| extra.iter().find_map(|l| l.error)),
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
                status: c.status,
                name: c.name.clone(),
                detail: c.detail.clone(),
                error: c.error.as_ref().map(|e| e.code()),
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
            .or_else(|| extra.iter().find_map(|l| l.error));
        match first {
            None => result_line(true, "receipt", &lines),
            Some(code) => {
                let failed = lines
                    .iter()
                    .filter(|l| l.status == CheckStatus::Fail)
                    .count();
                println!("RESULT: FAILED ({failed} check(s) failed; first: {code})");
            }
        }
    }
    Ok(if ok { EXIT_OK } else { EXIT_FAILED })
}

/// Which inputs `verify receipt` was given.
pub(super) struct Given {
    request: bool,
    response: bool,
    nonce: bool,
    evidence_nonce: bool,
    /// An inclusion receipt was given, or the policy needs none.
    inclusion: bool,
}

/// The checks of the command line itself: inputs not given fail unless
/// --insecure-partial (then each says INSECURE), and what --no-nonce,
/// --endpoint and --expect-sealing ask of the receipt.
pub(super) fn cli_checks(a: &ReceiptArgs, report: &VerifyReport, g: &Given) -> Vec<Line> {
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
        (
            g.inclusion,
            "log inclusion",
            "--inclusion (the receipt's inclusion receipt; the policy says receipts_logged)",
        ),
    ];
    for (given, name, what) in missing {
        if given {
            continue;
        }
        out.push(if a.insecure_partial {
            Line::new(
                CheckStatus::Warn,
                name,
                format!("INSECURE (--insecure-partial): not checked: {what} was not given"),
            )
        } else {
            let mut l = Line::new(
                CheckStatus::Fail,
                name,
                format!(
                    "not given: {what}; without it the receipt proves less than it seems \
                     (--insecure-partial accepts that)"
                ),
            );
            l.error = Some("input_missing");
            l
        });
    }
    let Some(r) = &report.receipt else {
        return out;
    };
    let mut check = |name: &str, ok: bool, pass: String, fail: String, reason: &'static str| {
        out.push(super::pass_or_fail(
            ok,
            name,
            if ok { pass } else { fail },
            reason,
        ));
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
