//! `gateway proxy`: a local OpenAI-compatible endpoint in the client's own
//! trust domain.
//!
//! At start it lists the upstream's models (`GET /v1/models`) and, for each,
//! fetches `/v1/attestation?model=…` with a fresh random nonce and verifies
//! the bundle against the policies given (`--policy`, repeatable: one per
//! pipeline, e.g. embeddings and completions). Every policy must verify at
//! least one model's evidence, or the proxy refuses to start. A model whose
//! evidence no policy accepts is not served. The entry stage's HPKE key is
//! taken from the verified evidence (never from the unauthenticated
//! `/.well-known` endpoint). Then, for each API request (routed by its
//! `model`):
//!
//! 1. the plaintext body is sealed to that model's entry key and forwarded
//!    with the sealing headers and a fresh `receipt-nonce` (or the client's);
//! 2. the sealed response is opened as it arrives;
//! 3. the receipt, which the exit stage sealed into the response as its
//!    trailer (or, from an older upstream, the `receipt` header or `GET
//!    /v1/receipts/{id}`), is verified against the verified stage keys, the
//!    exact request and response bytes and the nonce;
//! 4. whole responses: the plaintext is returned with the receipt headers,
//!    `receipt-verified: true` and `receipt-nonce`; a receipt that does not
//!    verify turns the answer into a 502 (OpenAI error shape, code
//!    `receipt_verification_failed`). Streams (`stream: true`): whole events
//!    are forwarded as they open, except `data: [DONE]` (however the sealed
//!    chunks split it), which is held back until the receipt over the whole
//!    event stream verifies; if it does not, the client gets an error event
//!    instead and no `[DONE]`. A stream that ends without a receipt is
//!    complete only if a stage ended it with an error event; otherwise the
//!    proxy ends it with its own error event.
//! 5. fail closed on errors: no error response carries a verified receipt,
//!    and each says so (`receipt-verified: false`). A stage error comes
//!    sealed to the proxy (only the stages hold the response key) and passes
//!    with the host's status; a sealed body under an error status that is a
//!    complete answer with its receipt, or not an error at all, means the
//!    host altered the status: 502 `upstream_status_mismatch`.
//!
//! Verified receipts are kept (last [`RECEIPTS_KEPT`]) and served at `GET
//! /v1/receipts/{id}`; with `--archive DIR` every verified exchange is also
//! written to `DIR/<receipt id>/` (request, response, receipt, nonce and the
//! evidence it was checked against) so that an auditor can re-run `gateway
//! verify receipt` on it offline.
//!
//! When the upstream answers `hpke_key_unknown` (its stages restarted with
//! new keys), the proxy re-attests once and seals again. A plain 400 to a
//! sealed request (a restarted stage may reuse the key id with a new key,
//! so the body does not open) also triggers a re-attestation, at most every
//! 10 s, and a retry if the attested entry key changed. A receipt signed by
//! a key the proxy does not know triggers one re-attestation before it is
//! rejected. New evidence must verify against the same policy; if it does
//! not, the request fails with 502 `evidence_not_verified`.
//!
//! Under a log-backed policy (`[transparency] log_key`) the log checkpoint
//! each verified bundle carries must also be consistent with the latest one
//! the proxy saw ([`crate::log_state`]: a consistency proof read from the
//! log's tiles at `--log`, default `<upstream>/v1/transparency`); a split
//! view fails the attestation like a policy failure. The latest checkpoint
//! is kept in memory, and across restarts with `--log-state FILE`. Under one
//! with `receipts_logged`, an answer whose receipt verified is also held
//! until its receipt is proven logged ([`crate::sealed::inclusion`]: the
//! RFC 9942 inclusion receipt from `GET /v1/receipts/{id}/inclusion`,
//! checked against the log key and its tree against that checkpoint), and
//! archived with it (`inclusion.cose`); otherwise 502 `receipt_not_logged`.

use crate::bundle::fetch_bundle;
use crate::log_state::{HttpTiles, LogState};
use crate::seal_open::AeadArg;
use crate::sealed::{Attested, Sealed};
use crate::transport::{base_url, http_client, random_nonce};
use crate::{EXIT_FAILED, EXIT_OK};
use anyhow::{anyhow, Context, Result};
use api_error::ApiError;
use axum::body::Bytes;
use axum::http::{header, HeaderValue, StatusCode};
use axum::response::{IntoResponse, Response};
use clap::Args;
use proto::bundle::VerifiedBundle;
use proto::policy::Policy;
use proto::report::CheckStatus;
use proto::sealing::Aead;
use std::collections::VecDeque;
use std::path::PathBuf;
use std::sync::{Arc, Mutex, RwLock};
use std::time::{Duration, Instant};

mod api_error;
mod exchange;
mod handlers;
mod stream;

use handlers::router;

/// Response header the proxy adds when the receipt verified.
pub const HEADER_RECEIPT_VERIFIED: &str = "receipt-verified";
/// Response header with the sealing the receipt records.
pub const HEADER_RECEIPT_SEALING: &str = "receipt-sealing";
/// How many verified receipts the proxy keeps for `GET /v1/receipts/{id}`.
pub const RECEIPTS_KEPT: usize = 4096;
const HEADER_RECEIPT: &str = "receipt";
const HEADER_RECEIPT_ID: &str = "receipt-id";
const HEADER_RECEIPT_NONCE: &str = "receipt-nonce";
/// Response header with the salt of the receipt's digests (hex): what the
/// caller needs, with the request and response, to check the receipt again.
pub const HEADER_RECEIPT_DIGEST_SALT: &str = "receipt-digest-salt";
const MAX_RECEIPT_HEADER: usize = 8 * 1024;

/// `gateway proxy`
#[derive(Args, Debug)]
pub struct ProxyArgs {
    /// The upstream gateway, e.g. http://127.0.0.1:8080 (plain HTTP).
    #[arg(long)]
    pub upstream: String,
    /// Measurement policy a pipeline's evidence must satisfy; repeat it for
    /// each pipeline to use (e.g. one for embeddings, one for completions).
    /// It must pin the stages' measurements: for development, `gateway
    /// policy pin --trust-on-first-use` writes one. The gateway's own
    /// config/policy*.toml trust "the local build", which only the gateway
    /// that launches the stages can compute: they do not work here.
    #[arg(long, required = true)]
    pub policy: Vec<PathBuf>,
    /// Where to listen (keep it on loopback: this side sees plaintext).
    #[arg(long, default_value = "127.0.0.1:8081")]
    pub listen: String,
    /// AEAD for the sealed requests.
    #[arg(long, value_enum, default_value = "aes128gcm")]
    pub aead: AeadArg,
    /// Upstream request timeout in seconds (for a stream: the longest
    /// silence between two pieces of it).
    #[arg(long, default_value_t = 120)]
    pub timeout_secs: u64,
    /// Largest request body accepted.
    #[arg(long, default_value_t = 8 << 20)]
    pub max_body_bytes: usize,
    /// Write every verified exchange to DIR/<receipt id>/ (request, response,
    /// receipt, nonces, evidence) for offline re-verification. The folder
    /// holds plaintext: keep it in the client's trust domain.
    #[arg(long)]
    pub archive: Option<PathBuf>,
    /// With log-backed policies: keep the latest transparency-log
    /// checkpoint seen in FILE (JSON), so that consistency is required
    /// across restarts too (without it, it is kept in memory only).
    #[arg(long, value_name = "FILE")]
    pub log_state: Option<PathBuf>,
    /// The transparency log whose tiles prove consistency between the
    /// checkpoints seen (its prefix; default `<upstream>/v1/transparency`).
    #[arg(long, value_name = "URL")]
    pub log: Option<String>,
    /// How to reach the upstream gateway.
    #[command(flatten)]
    pub transport: crate::Transport,
}

/// What the proxy trusts for one model: the last verified evidence.
struct Trusted {
    att: Attested,
    /// Bumped by every re-attestation.
    epoch: u64,
    /// When it was verified.
    at: Instant,
}

/// One attested pipeline: a model and the policy its evidence satisfies.
struct Route {
    model: String,
    policy: Policy,
    trusted: RwLock<Arc<Trusted>>,
    /// Serializes re-attestations.
    reattest: tokio::sync::Mutex<()>,
}

/// A plain 400 to a sealed request may mean the stages restarted with a new
/// key under the same key id (the body then does not open). The proxy
/// re-attests to find out, at most this often.
const SUSPECT_REATTEST_INTERVAL: Duration = Duration::from_secs(10);

/// Shared proxy state.
pub struct Proxy {
    upstream: String,
    aead: Aead,
    client: reqwest::Client,
    max_body: usize,
    idle: Duration,
    routes: Vec<Route>,
    receipts: Mutex<VecDeque<([u8; 16], Vec<u8>)>>,
    archive: Option<PathBuf>,
    log: LogCheck,
}

/// The latest log checkpoint seen, and where the log's tiles are.
struct LogCheck {
    state: tokio::sync::Mutex<LogState>,
    tiles: HttpTiles,
}

impl LogCheck {
    /// Requires the checkpoint of `att`'s bundle to be consistent with the
    /// latest seen, when `policy` is log-backed.
    async fn check(&self, model: &str, policy: &Policy, att: &Attested) -> Result<(), AttestError> {
        let Some(log) = &policy.transparency else {
            return Ok(());
        };
        let fail = |detail: String| {
            AttestError::Rejected(vec![crate::verify::Line::new(
                CheckStatus::Fail,
                "log consistency",
                detail,
            )
            .to_string()])
        };
        let note = match &att.bundle.transparency {
            Some(p) => &p.checkpoint,
            None => return Err(fail("the bundle carries no log checkpoint".into())),
        };
        let mut state = self.state.lock().await;
        match state.observe(&log.log_key, note, &self.tiles).await {
            Ok(seen) => {
                tracing::info!(model, "log consistency: {seen}");
                Ok(())
            }
            Err(e) => Err(fail(format!("{e:#}"))),
        }
    }
}

/// Why attestation failed.
enum AttestError {
    /// The evidence was fetched but does not verify.
    Rejected(Vec<String>),
    /// It could not be fetched.
    Unreachable(String),
}

impl AttestError {
    fn message(&self) -> String {
        match self {
            AttestError::Rejected(lines) => format!(
                "the upstream's evidence does not verify against the policy: {}",
                lines.join("; ")
            ),
            AttestError::Unreachable(e) => format!("fetching the upstream's evidence failed: {e}"),
        }
    }
}

/// A request sealed and sent, answered with a sealed success whose body is
/// not read yet.
struct Sent {
    response: reqwest::Response,
    /// What opens the answer and what its receipt must name.
    sealed: Sealed,
    trusted: Arc<Trusted>,
}

/// One request as the client sent it (owned: a stream's task keeps it).
struct Exchange {
    endpoint: &'static str,
    /// Index into [`Proxy::routes`].
    route: usize,
    request: Bytes,
    nonce: Vec<u8>,
    /// The caller's `Authorization`, for the gateway (the request and a
    /// receipt fetched by id).
    auth: Option<HeaderValue>,
}

fn error(status: StatusCode, kind: &'static str, code: &'static str, msg: String) -> ApiError {
    ApiError::coded(status, kind, code, msg)
}

fn bad_gateway(code: &'static str, msg: impl Into<String>) -> ApiError {
    error(StatusCode::BAD_GATEWAY, "server_error", code, msg.into())
}

/// Fetches one model's evidence with a fresh nonce and checks it (and,
/// under a log-backed policy, its log checkpoint against the latest seen).
async fn attest(
    client: &reqwest::Client,
    upstream: &str,
    model: &str,
    policy: &Policy,
    log: &LogCheck,
) -> Result<Attested, AttestError> {
    let nonce = random_nonce(32);
    let bundle = fetch_bundle(client, upstream, &nonce, Some(model))
        .await
        .map_err(|e| AttestError::Unreachable(format!("{e:#}")))?;
    let att = Attested::verify(bundle, policy, &nonce).map_err(AttestError::Rejected)?;
    log.check(model, policy, &att).await?;
    Ok(att)
}

impl Route {
    fn current(&self) -> Arc<Trusted> {
        self.trusted.read().expect("lock").clone()
    }
}

fn is_sealed(r: &reqwest::Response) -> bool {
    r.headers().contains_key("hpke-sealed")
        || r.headers()
            .get(header::CONTENT_TYPE)
            .is_some_and(|v| v.as_bytes().starts_with(b"application/octet-stream"))
}

fn json_response(status: StatusCode, body: Vec<u8>) -> Response {
    (status, [(header::CONTENT_TYPE, "application/json")], body).into_response()
}

fn log_verified(model: &str, v: &VerifiedBundle, what: &str) {
    for (k, m) in v.stage_keys.iter().zip(&v.measurements) {
        tracing::info!(
            model,
            stage = k.stage_index,
            layers = ?k.layers,
            measurement = %m,
            "{what}: stage verified"
        );
    }
    if v.mock {
        tracing::warn!("{}", proto::attestation::MOCK_WARNING);
    }
}

type AppState = Arc<Proxy>;

/// The upstream's model ids (`GET /v1/models`).
pub(crate) async fn upstream_models(
    client: &reqwest::Client,
    upstream: &str,
) -> Result<Vec<String>> {
    let url = format!("{upstream}/v1/models");
    let r = crate::transport::get_ok(client, &url, None).await?;
    let v: serde_json::Value = r.json().await.with_context(|| format!("GET {url}"))?;
    Ok(v["data"]
        .as_array()
        .map(|l| {
            l.iter()
                .filter_map(|m| m["id"].as_str().map(str::to_string))
                .collect()
        })
        .unwrap_or_default())
}

/// Attests every upstream model against the policies: each policy must
/// accept at least one model. Returns the routes, or the lines to print.
async fn attest_all(
    client: &reqwest::Client,
    upstream: &str,
    policies: Vec<(PathBuf, Policy)>,
    log: &LogCheck,
) -> Result<Vec<Route>, Vec<String>> {
    let models = upstream_models(client, upstream)
        .await
        .map_err(|e| vec![format!("fetching the upstream's evidence failed: {e:#}")])?;
    let mut routes: Vec<Route> = Vec::new();
    for (path, policy) in policies {
        let mut why = Vec::new();
        let mut accepted = false;
        let free: Vec<String> = models
            .iter()
            .filter(|m| !routes.iter().any(|r| &r.model == *m))
            .cloned()
            .collect();
        for model in &free {
            match attest(client, upstream, model, &policy, log).await {
                Ok(att) => {
                    log_verified(model, &att.verified, "attested upstream");
                    routes.push(Route {
                        model: model.clone(),
                        policy: policy.clone(),
                        trusted: RwLock::new(Arc::new(Trusted {
                            att,
                            epoch: 1,
                            at: Instant::now(),
                        })),
                        reattest: tokio::sync::Mutex::new(()),
                    });
                    accepted = true;
                }
                Err(e) => why.push(format!("model {model}: {}", e.message())),
            }
        }
        if !accepted {
            let mut lines = vec![format!(
                "policy {}: no upstream model's evidence verifies against it",
                path.display()
            )];
            lines.extend(why);
            return Err(lines);
        }
    }
    Ok(routes)
}

/// Runs `gateway proxy`; returns the exit code.
pub fn run(a: ProxyArgs) -> Result<i32> {
    let policies = a
        .policy
        .iter()
        .map(|p| Ok((p.clone(), Policy::load(p).map_err(|e| anyhow!(e))?)))
        .collect::<Result<Vec<_>>>()?;
    let upstream = base_url(&a.upstream, &a.transport)?;
    let client = http_client(Duration::from_secs(a.timeout_secs), &a.transport)?;
    if a.log_state.is_some() && !policies.iter().any(|(_, p)| p.transparency.is_some()) {
        anyhow::bail!(
            "--log-state: no --policy is log-backed ([transparency] log_key): there is no log checkpoint to keep"
        );
    }
    let log = LogCheck {
        state: tokio::sync::Mutex::new(match &a.log_state {
            Some(path) => LogState::load(path)?,
            None => LogState::in_memory(),
        }),
        tiles: HttpTiles {
            client: client.clone(),
            url: match &a.log {
                Some(url) => base_url(url, &a.transport).context("--log")?,
                None => format!("{upstream}/v1/transparency"),
            },
        },
    };
    if let Some(dir) = &a.archive {
        crate::io::create_private_dir(dir)?;
    }
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()?;
    rt.block_on(async move {
        let routes = match attest_all(&client, &upstream, policies, &log).await {
            Ok(r) => r,
            Err(lines) => {
                for l in &lines {
                    eprintln!("{l}");
                }
                eprintln!("refusing to start: the upstream's evidence does not verify against the policy");
                return Ok(EXIT_FAILED);
            }
        };
        let state = Arc::new(Proxy {
            upstream: upstream.clone(),
            aead: a.aead.into(),
            client,
            max_body: a.max_body_bytes,
            idle: Duration::from_secs(a.timeout_secs),
            routes,
            receipts: Mutex::new(VecDeque::new()),
            archive: a.archive,
            log,
        });
        let listener = tokio::net::TcpListener::bind(&a.listen)
            .await
            .with_context(|| format!("binding {}", a.listen))?;
        let addr = listener.local_addr()?;
        use tokio::signal::unix::{signal, SignalKind};
        let mut sigint = signal(SignalKind::interrupt())?;
        let mut sigterm = signal(SignalKind::terminate())?;
        tracing::info!(address = %addr, upstream = %upstream, "proxy listening: requests are sealed to the attested entry stage, receipts verified");
        println!("PROXY LISTENING http://{addr}");
        axum::serve(listener, router(state))
            .with_graceful_shutdown(async move {
                tokio::select! {
                    _ = sigint.recv() => {}
                    _ = sigterm.recv() => {}
                }
            })
            .await?;
        Ok(EXIT_OK)
    })
}
