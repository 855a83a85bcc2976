//! TLS for the gateway's HTTP server (`[server.tls]`): rustls with the
//! `ring` provider, ALPN `h2` and `http/1.1`, and certificate reload.
//!
//! The certificate and key live behind a [`ReloadingCert`] resolver that
//! rustls asks on every handshake, so [`ReloadingCert::reload`] (on SIGHUP)
//! changes what NEW connections see while established connections keep the
//! session they negotiated. A reload that fails (unreadable file, bad PEM,
//! key that does not match the certificate) keeps the old pair.
//!
//! [`TlsListener`] is an `axum::serve::Listener` for the server loop: a
//! background task accepts TCP connections and runs each handshake in its
//! own task (a slow or silent client does not hold up others; a handshake
//! has 10 s, and at most 256 run at once), handing finished TLS streams to
//! the server loop, whose hyper-util auto builder serves HTTP/1.1 and
//! HTTP/2 on them.

use anyhow::{anyhow, bail, Context, Result};
use rustls::crypto::CryptoProvider;
use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, PrivateKeyDer};
use rustls::server::{ClientHello, ResolvesServerCert};
use rustls::sign::CertifiedKey;
use rustls::ServerConfig;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::sync::{Arc, RwLock};
use std::time::Duration;
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::mpsc;
use tokio_rustls::server::TlsStream;
use tokio_rustls::TlsAcceptor;

/// A client that has not finished its handshake after this is dropped.
const HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(10);
/// Most TLS handshakes in progress at once; more connections wait in the
/// listen backlog (handshakes happen before the server loop's connection
/// cap counts a connection).
const MAX_HANDSHAKES: usize = 256;

fn provider() -> Arc<CryptoProvider> {
    Arc::new(rustls::crypto::ring::default_provider())
}

/// Reads a certificate chain (`server.tls.cert`) and its private key
/// (`server.tls.key`); errors name the key and the file.
pub fn load_pair(cert: &Path, key: &Path) -> Result<CertifiedKey> {
    let chain: Vec<CertificateDer<'static>> = CertificateDer::pem_file_iter(cert)
        .map_err(|e| anyhow!("server.tls.cert: {}: {e}", cert.display()))?
        .collect::<Result<_, _>>()
        .map_err(|e| anyhow!("server.tls.cert: {}: {e}", cert.display()))?;
    if chain.is_empty() {
        bail!(
            "server.tls.cert: {}: no PEM certificate found",
            cert.display()
        );
    }
    let der = PrivateKeyDer::from_pem_file(key)
        .map_err(|e| anyhow!("server.tls.key: {}: {e}", key.display()))?;
    let signing = provider()
        .key_provider
        .load_private_key(der)
        .map_err(|e| anyhow!("server.tls.key: {}: {e}", key.display()))?;
    let pair = CertifiedKey::new(chain, signing);
    pair.keys_match().map_err(|e| {
        anyhow!(
            "server.tls.key: {} does not match server.tls.cert {}: {e}",
            key.display(),
            cert.display()
        )
    })?;
    Ok(pair)
}

/// The server certificate, re-read from its files on [`Self::reload`].
#[derive(Debug)]
pub struct ReloadingCert {
    cert: PathBuf,
    key: PathBuf,
    current: RwLock<Arc<CertifiedKey>>,
}

impl ReloadingCert {
    /// Loads the pair; an error names the bad file.
    pub fn load(cert: &Path, key: &Path) -> Result<Self> {
        let pair = load_pair(cert, key)?;
        Ok(Self {
            cert: cert.to_path_buf(),
            key: key.to_path_buf(),
            current: RwLock::new(Arc::new(pair)),
        })
    }

    /// Re-reads the files; on error the old pair stays in use.
    pub fn reload(&self) -> Result<()> {
        let pair = load_pair(&self.cert, &self.key)?;
        *self.current.write().unwrap_or_else(|e| e.into_inner()) = Arc::new(pair);
        Ok(())
    }

    /// The certificate file (for logs).
    pub fn cert_path(&self) -> &Path {
        &self.cert
    }

    /// The key file (for logs).
    pub fn key_path(&self) -> &Path {
        &self.key
    }
}

impl ResolvesServerCert for ReloadingCert {
    fn resolve(&self, _hello: ClientHello<'_>) -> Option<Arc<CertifiedKey>> {
        Some(
            self.current
                .read()
                .unwrap_or_else(|e| e.into_inner())
                .clone(),
        )
    }
}

/// The rustls server configuration: TLS 1.2 and 1.3, no client
/// certificates, ALPN `h2` then `http/1.1`, certificate from `cert`.
pub fn server_config(cert: Arc<ReloadingCert>) -> Result<ServerConfig> {
    let mut cfg = ServerConfig::builder_with_provider(provider())
        .with_safe_default_protocol_versions()
        .context("TLS protocol versions")?
        .with_no_client_auth()
        .with_cert_resolver(cert);
    cfg.alpn_protocols = vec![b"h2".to_vec(), b"http/1.1".to_vec()];
    Ok(cfg)
}

/// TLS connections, as an `axum::serve::Listener`.
pub struct TlsListener {
    rx: mpsc::Receiver<(TlsStream<TcpStream>, SocketAddr)>,
    local: SocketAddr,
}

impl TlsListener {
    /// Accepts on `tcp` and runs handshakes with `config` in the background.
    pub fn new(tcp: TcpListener, config: Arc<ServerConfig>) -> std::io::Result<Self> {
        let local = tcp.local_addr()?;
        let acceptor = TlsAcceptor::from(config);
        let (tx, rx) = mpsc::channel(64);
        let handshakes = Arc::new(tokio::sync::Semaphore::new(MAX_HANDSHAKES));
        tokio::spawn(async move {
            loop {
                let Ok(slot) = handshakes.clone().acquire_owned().await else {
                    return;
                };
                let (stream, peer) = match tcp.accept().await {
                    Ok(c) => c,
                    Err(e) => {
                        // e.g. out of file descriptors: back off, as axum does.
                        tracing::warn!(error = %e, "accepting a connection failed");
                        tokio::time::sleep(Duration::from_millis(100)).await;
                        continue;
                    }
                };
                if tx.is_closed() {
                    return;
                }
                let acceptor = acceptor.clone();
                let tx = tx.clone();
                tokio::spawn(async move {
                    let _slot = slot;
                    match tokio::time::timeout(HANDSHAKE_TIMEOUT, acceptor.accept(stream)).await {
                        Ok(Ok(tls)) => {
                            let _ = tx.send((tls, peer)).await;
                        }
                        Ok(Err(e)) => {
                            tracing::debug!(peer = %peer, error = %e, "TLS handshake failed")
                        }
                        Err(_) => tracing::debug!(peer = %peer, "TLS handshake timed out"),
                    }
                });
            }
        });
        Ok(Self { rx, local })
    }
}

impl axum::serve::Listener for TlsListener {
    type Io = TlsStream<TcpStream>;
    type Addr = SocketAddr;

    async fn accept(&mut self) -> (Self::Io, Self::Addr) {
        match self.rx.recv().await {
            Some(c) => c,
            // The accept task only ends once axum has stopped accepting.
            None => std::future::pending().await,
        }
    }

    fn local_addr(&self) -> std::io::Result<Self::Addr> {
        Ok(self.local)
    }
}
