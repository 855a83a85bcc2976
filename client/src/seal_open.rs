//! `gateway seal` and `gateway open`: HPKE body sealing for `curl` users.
//!
//! ```text
//! gateway seal --gateway http://127.0.0.1:8080 --policy policy.toml \
//!     --in req.json --out body.bin --headers headers.txt --key-out client-key.json
//! curl -sS --data-binary @body.bin -H @headers.txt -D resp-headers.txt \
//!     -o resp.bin http://127.0.0.1:8080/v1/embeddings
//! gateway open --key client-key.json --in resp.bin --out resp.json
//! ```
//!
//! Files (documented in `docs/curl.md`):
//!
//! - **body** (`--out`): the sealed request body, binary (`u32be(len) ‖
//!   ciphertext` chunks, `docs/protocol.md` §6.4); send it unchanged.
//! - **headers** (`--headers`): one `name: value` per line, as `curl -H
//!   @file` reads them: `hpke-key-id`, `hpke-aead`, `hpke-encapsulated-key`,
//!   `hpke-sealed-at` (send it within 5 minutes: older sealed requests are
//!   refused), `content-type: application/octet-stream` and, unless
//!   `--no-receipt-nonce`, a fresh `receipt-nonce`.
//! - **client key** (`--key-out`, written with mode 0600): JSON with what
//!   opens the response (the secret exported from the request's HPKE
//!   context). Anyone holding it can read the response; delete it after
//!   `gateway open`.

use crate::bundle::{fetch_bundle, load_bundle};
use crate::client_key::{aead_name, pick_key, ClientKeyFile};
use crate::io::{parse_hex, read_input, write_output};
use crate::sealed::sse;
use crate::transport::{base_url, http_client, random_nonce, runtime};
use crate::verify::verify_evidence;
use crate::{EXIT_FAILED, EXIT_OK};
use anyhow::{anyhow, bail, Context, Result};
use clap::{Args, ValueEnum};
use proto::policy::Policy;
use proto::receipt::ReceiptTrailer;
use proto::report::CheckStatus;
use proto::sealing::{open_response_with_trailer, seal_request, Aead, KeyConfig};
use std::path::{Path, PathBuf};
use std::time::Duration;

/// An AEAD on the command line.
#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub enum AeadArg {
    /// AES-128-GCM (HPKE AEAD id 1).
    #[value(name = "aes128gcm")]
    Aes128Gcm,
    /// ChaCha20-Poly1305 (HPKE AEAD id 3).
    #[value(name = "chacha20poly1305")]
    ChaCha20Poly1305,
}

impl From<AeadArg> for Aead {
    fn from(a: AeadArg) -> Self {
        match a {
            AeadArg::Aes128Gcm => Aead::Aes128Gcm,
            AeadArg::ChaCha20Poly1305 => Aead::ChaCha20Poly1305,
        }
    }
}

/// `gateway seal`
#[derive(Args, Debug)]
pub struct SealArgs {
    /// The key configurations: the raw `application/ohttp-keys` bytes from
    /// `GET /.well-known/hpke-keys` (not authenticated: prefer --evidence or
    /// --gateway with --policy).
    #[arg(long, conflicts_with_all = ["gateway", "evidence"], required_unless_present_any = ["gateway", "evidence"])]
    pub keys: Option<PathBuf>,
    /// Take the entry stage's key from this evidence bundle (CBOR or JSON from
    /// `/v1/attestation`), verified against --policy first.
    #[arg(long, conflicts_with = "gateway", requires = "policy")]
    pub evidence: Option<PathBuf>,
    /// Fetch the keys from this gateway: with --policy from fresh evidence,
    /// verified (recommended); without, from `/.well-known/hpke-keys`.
    #[arg(long)]
    pub gateway: Option<String>,
    /// Measurement policy the evidence must satisfy.
    #[arg(long)]
    pub policy: Option<PathBuf>,
    /// The nonce (hex) --evidence was fetched with (freshness check).
    #[arg(long, requires = "evidence")]
    pub evidence_nonce: Option<String>,
    /// Key id to seal to (default: the first key that supports --aead).
    #[arg(long)]
    pub key_id: Option<u8>,
    /// The AEAD.
    #[arg(long, value_enum, default_value = "aes128gcm")]
    pub aead: AeadArg,
    /// The plaintext request body (the JSON you would POST); `-` for stdin.
    #[arg(long = "in")]
    pub input: PathBuf,
    /// Where to write the sealed body; `-` for stdout.
    #[arg(long)]
    pub out: PathBuf,
    /// Where to write the request headers (one `name: value` per line, for `curl -H @FILE`).
    #[arg(long)]
    pub headers: PathBuf,
    /// Where to write the client key that opens the response (mode 0600; secret).
    #[arg(long)]
    pub key_out: PathBuf,
    /// The receipt nonce (hex) to ask for; default: 16 fresh random bytes.
    #[arg(long, conflicts_with = "no_receipt_nonce")]
    pub receipt_nonce: Option<String>,
    /// Do not send a receipt nonce.
    #[arg(long)]
    pub no_receipt_nonce: bool,
    /// HTTP timeout in seconds (with --gateway).
    #[arg(long, default_value_t = 60)]
    pub timeout_secs: u64,
    /// With --gateway: the model whose pipeline to seal to (e.g. the
    /// completions model); default: the gateway's default pipeline.
    #[arg(long, requires = "gateway")]
    pub model: Option<String>,
    /// Seal to keys no verified evidence vouches for (--keys, or --gateway
    /// without --policy): the host could have listed a key of its own and
    /// read the request. Refused without this flag.
    #[arg(long)]
    pub insecure_unverified_keys: bool,
    /// How to reach the gateway (with --gateway).
    #[command(flatten)]
    pub transport: crate::Transport,
}

/// `gateway open`
#[derive(Args, Debug)]
pub struct OpenArgs {
    /// The client key file written by `gateway seal --key-out`.
    #[arg(long)]
    pub key: PathBuf,
    /// The sealed response body (as `curl -o` saved it); `-` for stdin.
    #[arg(long = "in")]
    pub input: PathBuf,
    /// Where to write the plaintext response; `-` (default) for stdout.
    #[arg(long, default_value = "-")]
    pub out: PathBuf,
    /// Where to write the receipt the exit stage sealed into the response
    /// (its trailer), for `gateway verify receipt --receipt`.
    #[arg(long)]
    pub receipt_out: Option<PathBuf>,
}

fn load_policy(path: Option<&Path>) -> Result<Policy> {
    let path = path.ok_or_else(|| anyhow!("--policy is required"))?;
    Policy::load(path).map_err(|e| anyhow!(e))
}

/// Gets the key configurations from where the arguments say; the flag says
/// whether they come from verified evidence.
fn keys_for(a: &SealArgs) -> Result<(Vec<KeyConfig>, bool)> {
    if let Some(path) = &a.keys {
        let bytes = read_input(path)?;
        let keys = KeyConfig::decode_list(&bytes)
            .map_err(|e| anyhow!("{}: not application/ohttp-keys: {e}", path.display()))?;
        return Ok((keys, false));
    }
    if let Some(path) = &a.evidence {
        let policy = load_policy(a.policy.as_deref())?;
        let bundle = load_bundle(path)?;
        let nonce = a
            .evidence_nonce
            .as_deref()
            .map(|n| parse_hex("--evidence-nonce", n))
            .transpose()?;
        return verified_keys(&bundle, &policy, nonce.as_deref()).map(|k| (k, true));
    }
    let base = base_url(a.gateway.as_deref().unwrap_or_default(), &a.transport)?;
    let client = http_client(Duration::from_secs(a.timeout_secs), &a.transport)?;
    runtime()?.block_on(async {
        if let Some(p) = &a.policy {
            let policy = load_policy(Some(p))?;
            let nonce = random_nonce(32);
            let bundle = fetch_bundle(&client, &base, &nonce, a.model.as_deref()).await?;
            return verified_keys(&bundle, &policy, Some(&nonce)).map(|k| (k, true));
        }
        let mut url = format!("{base}/.well-known/hpke-keys");
        if let Some(m) = &a.model {
            url += &format!("?model={}", crate::transport::percent_encode(m));
        }
        let body = crate::transport::get_ok(&client, &url, None)
            .await?
            .bytes()
            .await?;
        let keys = KeyConfig::decode_list(&body).map_err(|e| anyhow!("GET {url}: {e}"))?;
        Ok((keys, false))
    })
}

fn verified_keys(
    bundle: &proto::bundle::EvidenceBundle,
    policy: &Policy,
    nonce: Option<&[u8]>,
) -> Result<Vec<KeyConfig>> {
    // About to seal to these keys: evidence without a purpose label is
    // refused, as on every online path.
    let out = verify_evidence(
        bundle,
        policy,
        nonce,
        None,
        proto::bundle::LegacyEvidence::Refuse,
    );
    let ok = out.ok();
    for l in &out.lines {
        if !ok || l.status != CheckStatus::Pass {
            eprintln!("{l}");
        }
    }
    match out.verified.filter(|_| ok) {
        Some(v) => Ok(v.entry_keys),
        None => {
            bail!("the evidence does not verify against the policy: refusing to seal to its keys")
        }
    }
}

/// Runs `gateway seal`.
pub fn run_seal(a: SealArgs) -> Result<()> {
    let aead: Aead = a.aead.into();
    let plaintext = read_input(&a.input)?;
    let receipt_nonce = match (&a.receipt_nonce, a.no_receipt_nonce) {
        (Some(n), _) => Some(parse_hex("--receipt-nonce", n)?),
        (None, true) => None,
        (None, false) => Some(random_nonce(16)),
    };
    let unverified = a.keys.is_some() || (a.evidence.is_none() && a.policy.is_none());
    if unverified && !a.insecure_unverified_keys {
        bail!(
            "refusing to seal to keys that no verified evidence vouches for: the host could list \
             a key of its own and read the request. Give --policy (with --gateway or --evidence), \
             or --insecure-unverified-keys to seal to an unauthenticated key list anyway"
        );
    }
    let (keys, verified) = keys_for(&a)?;
    let key = pick_key(&keys, a.key_id, aead)?;
    if !verified {
        eprintln!(
            "INSECURE keys (--insecure-unverified-keys): not taken from verified evidence; the \
             host could have substituted its own key (use --gateway URL --policy P, or --evidence \
             B --policy P)"
        );
    }
    let (headers, body, client_key) =
        seal_request(&key, aead, &plaintext).map_err(|e| anyhow!("sealing failed: {e}"))?;
    let mut header_text = String::new();
    for (k, v) in headers.to_header_values() {
        header_text += &format!("{k}: {v}\n");
    }
    header_text += "content-type: application/octet-stream\n";
    if let Some(n) = &receipt_nonce {
        header_text += &format!("receipt-nonce: {}\n", hex::encode(n));
    }
    let file = ClientKeyFile {
        key: client_key,
        key_id: key.key_id,
        receipt_nonce: receipt_nonce.clone(),
        request_sha256: proto::digest::Sha256Digest::of(&plaintext).hex(),
        digest_salt: None,
    };
    file.save(&a.key_out)?;
    std::fs::write(&a.headers, header_text)
        .with_context(|| format!("writing {}", a.headers.display()))?;
    write_output(&a.out, &body)?;
    eprintln!(
        "sealed {} bytes to key {} ({}{}) -> {} bytes; headers in {}, response key in {} (secret){}",
        plaintext.len(),
        key.key_id,
        aead_name(aead),
        if verified { ", from verified evidence" } else { "" },
        body.len(),
        a.headers.display(),
        a.key_out.display(),
        receipt_nonce
            .map(|n| format!("; receipt nonce {}", hex::encode(n)))
            .unwrap_or_default()
    );
    Ok(())
}

/// Runs `gateway open`; returns the exit code: 0 only for a whole answer
/// with its receipt trailer (a sealed error is written out but exits 1; a
/// body cut short, without a trailer, exits 1 and writes nothing).
pub fn run_open(a: OpenArgs) -> Result<i32> {
    let mut file = ClientKeyFile::load(&a.key)?;
    let body = read_input(&a.input)?;
    match open_response_with_trailer(&file.key, &body) {
        Ok((plain, trailer)) => {
            let trailer = match trailer.as_deref().map(ReceiptTrailer::decode).transpose() {
                Ok(t) => t,
                Err(e) => {
                    eprintln!("error: the sealed receipt trailer is malformed: {e}; the response was not written");
                    return Ok(EXIT_FAILED);
                }
            };
            // No trailer: only a whole sealed error may end so. Anything else
            // was cut short (a stream the host cancelled ends with the exit
            // stage's error event and no receipt): nothing proves it, so
            // nothing is written.
            if trailer.is_none() && !sse::is_error_object(&plain) {
                eprintln!("error: {}", cut_short(&plain));
                return Ok(EXIT_FAILED);
            }
            // The receipt's entry stage must have opened *this* request's
            // encapsulated key; otherwise the host opened it (it handed out
            // a key of its own) and re-sealed everything: nothing is written.
            if let Some(t) = &trailer {
                match file.check_opened(&t.receipt) {
                    Ok(true) => {}
                    Ok(false) => eprintln!(
                        "WARN sealing: a v2 receipt does not say which key the enclave opened; \
                         whether the host saw the request is not proven"
                    ),
                    Err(e) => {
                        eprintln!("error: {e:#}; the response was not written");
                        return Ok(EXIT_FAILED);
                    }
                }
            }
            write_output(&a.out, &plain)?;
            // An error the stage sealed to the client (it opened the request,
            // then refused it): written out for the user, but not a success.
            if trailer.is_none() {
                if let Some(err) = serde_json::from_slice::<serde_json::Value>(&plain)
                    .ok()
                    .and_then(|v| v.get("error").cloned())
                {
                    eprintln!(
                        "error: the enclave answered with an error (sealed to you, written out): {}",
                        serde_json::to_string(&err).unwrap_or_default()
                    );
                    return Ok(EXIT_FAILED);
                }
            }
            // The salt of the receipt's digests goes into the key file, the
            // client's record of this exchange, for `verify receipt
            // --client-key`.
            if let Some(salt) = trailer.as_ref().and_then(|t| t.digest_salt) {
                if a.key.as_os_str() == "-" {
                    // The key came on stdin: there is no file to keep it in.
                    eprintln!("receipt digest salt: {}", hex::encode(salt));
                } else {
                    file.digest_salt = Some(salt);
                    file.save(&a.key)?;
                }
            }
            match (&a.receipt_out, trailer) {
                (Some(path), Some(t)) => std::fs::write(path, &t.receipt)
                    .with_context(|| format!("writing {}", path.display()))?,
                (Some(_), None) => {
                    eprintln!(
                        "error: the sealed response carries no receipt (an error answer has none)"
                    );
                    return Ok(EXIT_FAILED);
                }
                (None, _) => {}
            }
            Ok(EXIT_OK)
        }
        Err(e) => {
            // An error the host answered itself (e.g. an unknown key id or a
            // replay) is plain JSON, not sealed.
            if let Ok(v) = serde_json::from_slice::<serde_json::Value>(&body) {
                if v.get("error").is_some() {
                    eprintln!(
                        "error: the response is not sealed: the gateway answered itself (not the enclave): {}",
                        serde_json::to_string(&v["error"]).unwrap_or_default()
                    );
                    return Ok(EXIT_FAILED);
                }
            }
            eprintln!("error: the response does not open with this key: {e}");
            Ok(EXIT_FAILED)
        }
    }
}

/// What `open` says of a sealed body that ended without its receipt trailer
/// and is not a whole sealed error: where it was cut, and the error event it
/// ended with, if any.
fn cut_short(plain: &[u8]) -> String {
    let last_error = sse::ends_with_error_event(plain)
        .then(|| {
            let text = String::from_utf8_lossy(plain);
            let last = text
                .trim_end()
                .rsplit("\n\n")
                .next()?
                .strip_prefix("data: ")?;
            let v: serde_json::Value = serde_json::from_str(last).ok()?;
            Some(format!(
                "; its last event is an error: {}",
                serde_json::to_string(&v["error"]).ok()?
            ))
        })
        .flatten()
        .unwrap_or_default();
    format!(
        "the sealed response was cut: it ends without its receipt trailer and is not a \
         sealed error (e.g. the host cancelled the stream){last_error}; its {} bytes are \
         unverified and were not written",
        plain.len()
    )
}

#[cfg(test)]
mod tests {
    use super::*;
    use proto::sealing::{open_request, open_response, seal_response, ServerKey};

    #[test]
    fn client_key_file_round_trips_and_opens() {
        let server = ServerKey::derive(3, b"cli test key");
        for aead in Aead::ALL {
            let (headers, body, key) = seal_request(&server.config(), aead, b"{}").unwrap();
            let (plain, material) = open_request(&server, &headers, &body).unwrap();
            assert_eq!(plain, b"{}");
            let file = ClientKeyFile {
                key,
                key_id: 3,
                receipt_nonce: Some(vec![1, 2]),
                request_sha256: "ab".into(),
                digest_salt: Some([6; 32]),
            };
            let text = serde_json::to_string(&file.to_json().unwrap()).unwrap();
            let back = ClientKeyFile::from_json(&serde_json::from_str(&text).unwrap()).unwrap();
            assert_eq!(back.key, file.key);
            assert_eq!(back.receipt_nonce, Some(vec![1, 2]));
            assert_eq!(back.digest_salt, Some([6; 32]));
            let sealed = seal_response(&material, b"response").unwrap();
            assert_eq!(open_response(&back.key, &sealed).unwrap(), b"response");
        }
    }

    #[test]
    fn a_cut_body_is_named_with_its_last_error_event() {
        let ev = b"data: {\"choices\":[]}\n\ndata: {\"error\":{\"message\":\"The request was cancelled.\",\"code\":\"generation_failed\"}}\n\n";
        let m = cut_short(ev);
        assert!(m.contains("cut"), "{m}");
        assert!(m.contains("The request was cancelled."), "{m}");
        let m = cut_short(b"data: {\"choices\":[]}\n\n");
        assert!(m.contains("cut") && !m.contains("last event"), "{m}");
    }
}
