//! How the client verbs reach a gateway: TLS roots, the rule against plain
//! HTTP off loopback, and the small pieces every request needs (nonces,
//! query encoding, a runtime).

use anyhow::{bail, Context, Result};
use std::time::Duration;

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
pub fn http_client(timeout: Duration, t: &Transport) -> Result<reqwest::Client> {
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
pub fn base_url(url: &str, t: &Transport) -> Result<String> {
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
    if !is_loopback(&host_port) && !t.insecure_plain_http {
        bail!(
            "{u}: plain HTTP to a host that is not loopback would send API keys and plain \
             requests in the clear; use https:// (with --cacert for a private CA), or \
             --insecure-plain-http"
        );
    }
    Ok(u.to_string())
}

/// Whether a `host:port` (or socket address) is on loopback: `127.0.0.0/8`,
/// `::1` or `localhost`.
pub fn is_loopback(listen: &str) -> bool {
    if let Ok(a) = listen.parse::<std::net::SocketAddr>() {
        return a.ip().is_loopback();
    }
    matches!(listen.rsplit_once(':'), Some((host, _)) if host.eq_ignore_ascii_case("localhost"))
}

/// Percent-encodes a query value (model ids are usually plain already).
pub fn percent_encode(v: &str) -> String {
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

/// `GET url` (with `Accept: accept` if given): the response if it is a success, or an
/// error naming the URL, the status and the start of the answer.
pub async fn get_ok(
    client: &reqwest::Client,
    url: &str,
    accept: Option<&str>,
) -> Result<reqwest::Response> {
    let mut req = client.get(url);
    if let Some(a) = accept {
        req = req.header(reqwest::header::ACCEPT, a);
    }
    let r = req.send().await.with_context(|| format!("GET {url}"))?;
    let status = r.status();
    if !status.is_success() {
        let body = r.bytes().await.unwrap_or_default();
        bail!(
            "GET {url}: {status}: {}",
            String::from_utf8_lossy(&body[..body.len().min(500)])
        );
    }
    Ok(r)
}

/// A fresh random nonce.
pub fn random_nonce(len: usize) -> Vec<u8> {
    use rand::RngCore;
    let mut n = vec![0u8; len];
    rand::rngs::OsRng.fill_bytes(&mut n);
    n
}

/// A current-thread runtime for the client verbs that talk HTTP.
pub fn runtime() -> Result<tokio::runtime::Runtime> {
    Ok(tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()?)
}
