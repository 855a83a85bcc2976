//! The client-side verbs of the `gateway` binary: everything a client that
//! does not trust the host needs, in its own trust domain.
//!
//! - `gateway verify evidence` / `gateway verify receipt`: offline checks of
//!   an evidence bundle against a measurement policy, and of a receipt
//!   against verified evidence and the request/response bytes the client
//!   kept ([`verify`]);
//! - `gateway seal` / `gateway open`: HPKE-seal a request body for `curl`
//!   and open the sealed response ([`seal`]);
//! - `gateway proxy`: a local OpenAI-compatible endpoint that verifies the
//!   upstream's evidence, seals every request to the attested entry stage
//!   and verifies every receipt ([`proxy`]).
//!
//! Exit codes: 0 when everything holds, 1 when a verification fails (or the
//! proxy refuses to start), 2 for usage and I/O errors.
//! The walkthrough is `docs/curl.md`.

pub mod client_key;
pub mod proxy;
pub mod seal;
pub mod verify;

use anyhow::{anyhow, bail, Context, Result};
use base64::Engine as _;
use clap::Subcommand;
use proto::bundle::EvidenceBundle;
use std::io::{Read, Write};
use std::path::Path;
use std::time::Duration;

/// Exit code: everything verified / the command succeeded.
pub const EXIT_OK: i32 = 0;
/// Exit code: a verification failed.
pub const EXIT_FAILED: i32 = 1;
/// Exit code: bad usage, unreadable input, network error.
pub const EXIT_ERROR: i32 = 2;

/// The client verbs (flattened into the binary's subcommands).
#[derive(Subcommand, Debug)]
pub enum ClientCommand {
    /// Verify evidence or a receipt offline (exit code 0 only when everything holds).
    #[command(subcommand)]
    Verify(verify::VerifyCommand),
    /// Seal a request body to the entry stage's HPKE key (for curl users).
    Seal(seal::SealArgs),
    /// Open a sealed response with the key `gateway seal` wrote.
    Open(seal::OpenArgs),
    /// A local OpenAI-compatible endpoint that verifies the upstream gateway's
    /// evidence, seals every request end to end and verifies every receipt.
    Proxy(proxy::ProxyArgs),
}

/// Runs a client verb; returns the process exit code.
pub fn run(cmd: ClientCommand) -> i32 {
    let result = match cmd {
        ClientCommand::Verify(c) => verify::run(c),
        ClientCommand::Seal(a) => seal::run_seal(a).map(|()| EXIT_OK),
        ClientCommand::Open(a) => seal::run_open(a),
        ClientCommand::Proxy(a) => proxy::run(a),
    };
    match result {
        Ok(code) => code,
        Err(e) => {
            eprintln!("error: {e:#}");
            EXIT_ERROR
        }
    }
}

/// Reads a file, or standard input for `-`.
pub(crate) fn read_input(path: &Path) -> Result<Vec<u8>> {
    if path.as_os_str() == "-" {
        let mut buf = Vec::new();
        std::io::stdin()
            .read_to_end(&mut buf)
            .context("reading standard input")?;
        return Ok(buf);
    }
    std::fs::read(path).with_context(|| format!("reading {}", path.display()))
}

/// Writes a file, or standard output for `-`.
pub(crate) fn write_output(path: &Path, data: &[u8]) -> Result<()> {
    if path.as_os_str() == "-" {
        let mut out = std::io::stdout().lock();
        out.write_all(data)?;
        return Ok(out.flush()?);
    }
    std::fs::write(path, data).with_context(|| format!("writing {}", path.display()))
}

/// Parses a hex argument (`--nonce`); an optional `0x` prefix is allowed.
pub(crate) fn parse_hex(what: &str, s: &str) -> Result<Vec<u8>> {
    let s = s.trim();
    hex::decode(s.strip_prefix("0x").unwrap_or(s)).map_err(|e| anyhow!("{what} is not hex: {e}"))
}

/// Decodes an evidence bundle from what `GET /v1/attestation` returns:
/// the CBOR bundle (`Accept: application/cbor`), or the JSON form (its
/// `bundle_cbor` field, base64, is what is verified; the rest of the JSON is
/// for people and is ignored).
pub(crate) fn decode_bundle(bytes: &[u8]) -> Result<EvidenceBundle> {
    let text_start = bytes.iter().find(|b| !b.is_ascii_whitespace());
    if text_start == Some(&b'{') {
        let v: serde_json::Value =
            serde_json::from_slice(bytes).context("the evidence is not valid JSON")?;
        let b64 = v["bundle_cbor"].as_str().ok_or_else(|| {
            anyhow!("the JSON evidence has no `bundle_cbor` field (is it from /v1/attestation?)")
        })?;
        let cbor = base64::engine::general_purpose::STANDARD
            .decode(b64.trim())
            .or_else(|_| base64::engine::general_purpose::URL_SAFE_NO_PAD.decode(b64.trim()))
            .context("`bundle_cbor` is not base64")?;
        return proto::cbor::from_slice(&cbor)
            .map_err(|e| anyhow!("`bundle_cbor` is not an evidence bundle: {e}"));
    }
    proto::cbor::from_slice(bytes).map_err(|e| anyhow!("not an evidence bundle (CBOR): {e}"))
}

/// Reads an evidence bundle file (CBOR or the JSON from `/v1/attestation`).
pub(crate) fn load_bundle(path: &Path) -> Result<EvidenceBundle> {
    decode_bundle(&read_input(path)?).with_context(|| format!("evidence {}", path.display()))
}

/// How the client verbs reach a gateway: which extra root certificate to
/// trust, and whether plain HTTP off loopback is allowed.
#[derive(clap::Args, Clone, Debug, Default)]
pub struct Transport {
    /// A PEM certificate (e.g. a private CA) to trust for an https://
    /// gateway, besides the platform's roots.
    #[arg(long)]
    pub cacert: Option<std::path::PathBuf>,
    /// Allow http:// to a gateway that is not on loopback: API keys and
    /// plain requests would cross the network in the clear. Refused
    /// without this flag.
    #[arg(long)]
    pub insecure_plain_http: bool,
}

/// An HTTP client: HTTPS with rustls (the platform's roots and
/// `--cacert`), HTTP where [`base_url`] allowed it.
pub(crate) fn http_client(timeout: Duration, t: &Transport) -> Result<reqwest::Client> {
    let mut b = reqwest::Client::builder().use_rustls_tls().timeout(timeout);
    if let Some(path) = &t.cacert {
        let pem = std::fs::read(path).with_context(|| format!("reading {}", path.display()))?;
        let certs = reqwest::Certificate::from_pem_bundle(&pem)
            .with_context(|| format!("{}: not a PEM certificate", path.display()))?;
        if certs.is_empty() {
            bail!("{}: no PEM certificate in it", path.display());
        }
        for c in certs {
            b = b.add_root_certificate(c);
        }
    }
    b.build().context("building the HTTP client")
}

/// `url` without a trailing slash: `https://…`, or `http://…` to a
/// loopback host (any host with `--insecure-plain-http`).
pub(crate) fn base_url(url: &str, t: &Transport) -> Result<String> {
    let u = url.trim().trim_end_matches('/');
    if u.starts_with("https://") {
        return Ok(u.to_string());
    }
    let Some(rest) = u.strip_prefix("http://") else {
        bail!("{u}: expected an https:// (or loopback http://) URL");
    };
    let host = rest.split('/').next().unwrap_or_default();
    let host_port = if host.ends_with(']') || !host.contains(':') {
        format!("{host}:80")
    } else {
        host.to_string()
    };
    if !crate::config::is_loopback(&host_port) && !t.insecure_plain_http {
        bail!(
            "{u}: plain HTTP to a host that is not loopback would send API keys and plain \
             requests in the clear; use https:// (with --cacert for a private CA), or \
             --insecure-plain-http"
        );
    }
    Ok(u.to_string())
}

/// Fetches the evidence bundle for `nonce` from a gateway (CBOR): the
/// pipeline serving `model`, or the default one.
pub(crate) async fn fetch_bundle(
    client: &reqwest::Client,
    base: &str,
    nonce: &[u8],
    model: Option<&str>,
) -> Result<EvidenceBundle> {
    let mut url = format!("{base}/v1/attestation?nonce={}", hex::encode(nonce));
    if let Some(m) = model {
        url += &format!("&model={}", percent_encode(m));
    }
    let r = client
        .get(&url)
        .header(reqwest::header::ACCEPT, "application/cbor")
        .send()
        .await
        .with_context(|| format!("GET {url}"))?;
    let status = r.status();
    let body = r.bytes().await.with_context(|| format!("GET {url}"))?;
    if !status.is_success() {
        bail!(
            "GET {url}: {status}: {}",
            String::from_utf8_lossy(&body[..body.len().min(500)])
        );
    }
    decode_bundle(&body).with_context(|| format!("GET {url}"))
}

/// Writes `data` to `path` with mode 0600 (also when the file existed).
pub(crate) fn write_private(path: &Path, data: &[u8]) -> Result<()> {
    use std::os::unix::fs::{OpenOptionsExt, PermissionsExt};
    let mut f = std::fs::OpenOptions::new()
        .write(true)
        .create(true)
        .truncate(true)
        .mode(0o600)
        .open(path)
        .with_context(|| format!("writing {}", path.display()))?;
    f.set_permissions(std::fs::Permissions::from_mode(0o600))
        .with_context(|| format!("chmod 600 {}", path.display()))?;
    f.write_all(data)
        .with_context(|| format!("writing {}", path.display()))
}

/// Creates `dir` (and missing parents) readable by its owner only (0700),
/// also when it existed: client-side archives hold plaintext.
pub(crate) fn create_private_dir(dir: &Path) -> Result<()> {
    use std::os::unix::fs::{DirBuilderExt, PermissionsExt};
    std::fs::DirBuilder::new()
        .recursive(true)
        .mode(0o700)
        .create(dir)
        .with_context(|| format!("creating {}", dir.display()))?;
    std::fs::set_permissions(dir, std::fs::Permissions::from_mode(0o700))
        .with_context(|| format!("chmod 700 {}", dir.display()))
}

/// Percent-encodes a query value (model ids are usually plain already).
pub(crate) fn percent_encode(v: &str) -> String {
    v.bytes()
        .map(|b| {
            if b.is_ascii_alphanumeric() || b"-._~".contains(&b) {
                (b as char).to_string()
            } else {
                format!("%{b:02X}")
            }
        })
        .collect()
}

/// A fresh random nonce.
pub(crate) fn random_nonce(len: usize) -> Vec<u8> {
    use rand::RngCore;
    let mut n = vec![0u8; len];
    rand::rngs::OsRng.fill_bytes(&mut n);
    n
}

/// A current-thread runtime for the client verbs that talk HTTP.
pub(crate) fn runtime() -> Result<tokio::runtime::Runtime> {
    Ok(tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()?)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn private_file_mode() {
        use std::os::unix::fs::PermissionsExt;
        let p = std::env::temp_dir().join(format!("gw-cli-key-{}", std::process::id()));
        std::fs::write(&p, b"old").unwrap();
        std::fs::set_permissions(&p, std::fs::Permissions::from_mode(0o644)).unwrap();
        write_private(&p, b"secret").unwrap();
        let mode = std::fs::metadata(&p).unwrap().permissions().mode() & 0o777;
        assert_eq!(mode, 0o600);
        assert_eq!(std::fs::read(&p).unwrap(), b"secret");
        std::fs::remove_file(&p).unwrap();
    }

    #[test]
    fn private_dir_mode() {
        use std::os::unix::fs::PermissionsExt;
        let d = std::env::temp_dir().join(format!("gw-cli-dir-{}/a/b", std::process::id()));
        create_private_dir(&d).unwrap();
        let mode = std::fs::metadata(&d).unwrap().permissions().mode() & 0o777;
        assert_eq!(mode, 0o700);
        std::fs::remove_dir_all(d.parent().unwrap().parent().unwrap()).unwrap();
    }
}
