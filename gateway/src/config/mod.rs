//! The gateway's configuration: one file (`config/gateway.toml`) plus
//! environment overrides.
//!
//! Every key can be overridden by an environment variable named
//! `GATEWAY_` + the key's path in upper case with `__` between the levels
//! (array elements by index): `GATEWAY_SERVER__LISTEN=0.0.0.0:8443`,
//! `GATEWAY_PIPELINE__STAGES__1__ADDRESS=tcp://10.0.0.7:7000`. The value is
//! read as a TOML value when it is one (`true`, `30`, `[0, 3]`, `"quoted"`)
//! and as a string otherwise. Errors name the key, and for an overridden key
//! the variable too (`GATEWAY_SERVER__MAX_INPUTS (server.max_inputs): …`).
//!
//! Relative paths are resolved against the current directory (run the
//! gateway from the repository root, as the README does).

use anyhow::{anyhow, bail, Result};
use proto::frames::WeightFormat;
use proto::io::transport::Endpoint;
use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;
use std::path::PathBuf;
use std::time::Duration;

mod env;
mod load;
#[cfg(test)]
mod tests;

/// Prefix of environment overrides.
pub const ENV_PREFIX: &str = "GATEWAY_";
/// Separator between key levels in an override's name.
pub const ENV_SEPARATOR: &str = "__";

/// The whole file.
#[derive(Clone, Debug, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct GatewayConfig {
    /// HTTP server settings.
    pub server: ServerConfig,
    /// The stage pipeline.
    pub pipeline: PipelineConfig,
    /// API keys and per-key limits (off by default).
    #[serde(default)]
    pub auth: AuthConfig,
    /// Key paths set by environment overrides → the variable's name.
    #[serde(skip)]
    pub overrides: BTreeMap<String, String>,
    /// The text-generation pipeline for `/v1/completions` and
    /// `/v1/chat/completions` (none: not served).
    #[serde(default)]
    pub completions: Option<CompletionsConfig>,
    /// OpenTelemetry traces (off unless `otlp_endpoint` is set).
    #[serde(default)]
    pub telemetry: crate::telemetry::TelemetryConfig,
    /// HPKE key rotation (off by default).
    #[serde(default)]
    pub keys: KeysConfig,
    /// Where receipts are kept (an SQLite file by default).
    #[serde(default)]
    pub receipts: crate::receipt_store::ReceiptsConfig,
    /// The transparency log served under `/v1/transparency/` (none: off).
    #[serde(default)]
    pub transparency: Option<crate::transparency::releases::TransparencyConfig>,
}

/// `[keys]`: rotation of the HPKE keys clients seal to: the gateway-held
/// key, and the entry stages' enclave-held keys of locally launched stages
/// (remote stages take `--hpke-rotate-secs` themselves). A new key is
/// published (the entry stage's signed with its attested receipt key)
/// when it is made; the key it replaces is accepted `overlap_secs` longer,
/// then requests sealed to it get `hpke_key_unknown`.
#[derive(Clone, Debug, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct KeysConfig {
    /// Seconds between new keys; 0 (the default): keys last as long as
    /// their process.
    #[serde(default)]
    pub rotate_secs: u64,
    /// Seconds a replaced key is still accepted.
    #[serde(default = "default_overlap_secs")]
    pub overlap_secs: u64,
}

fn default_overlap_secs() -> u64 {
    3600
}

impl Default for KeysConfig {
    fn default() -> Self {
        Self {
            rotate_secs: 0,
            overlap_secs: default_overlap_secs(),
        }
    }
}

impl KeysConfig {
    /// The schedule, if keys rotate: (every, overlap).
    pub fn rotation(&self) -> Option<(Duration, Duration)> {
        (self.rotate_secs > 0).then(|| {
            (
                Duration::from_secs(self.rotate_secs),
                Duration::from_secs(self.overlap_secs),
            )
        })
    }

    /// The stage arguments that carry the schedule to locally launched stages.
    pub fn stage_args(&self) -> Vec<String> {
        if self.rotate_secs == 0 {
            return Vec::new();
        }
        vec![
            "--hpke-rotate-secs".into(),
            self.rotate_secs.to_string(),
            "--hpke-overlap-secs".into(),
            self.overlap_secs.to_string(),
        ]
    }
}

/// `[completions]`: a second pipeline of stages serving a Llama model for
/// `/v1/completions`. Launch mode, stage binary and the connect timeout are
/// shared with `[pipeline]` (threads too, unless set here).
#[derive(Clone, Debug, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct CompletionsConfig {
    /// Measurement policy for this pipeline's stages (layers and manifest
    /// differ from the embedding model's).
    pub policy: PathBuf,
    /// Model folder (with `manifest.json`).
    pub model_dir: PathBuf,
    /// KV-cache budget per stage, in tokens (each stage holds this many
    /// tokens of keys and values for its own layers); requests are admitted
    /// by it.
    #[serde(default = "default_kv_tokens")]
    pub kv_cache_tokens: usize,
    /// Most sequences in one decoding step.
    #[serde(default = "default_step_seqs")]
    pub max_step_seqs: usize,
    /// Most requests waiting for KV-cache room; beyond it new ones get 503.
    #[serde(default = "default_max_waiting")]
    pub max_waiting: usize,
    /// Most tokens per step (longer prefills run alone).
    #[serde(default = "default_token_budget")]
    pub step_tokens: usize,
    /// How the stages hold the weights: `q4_1` (default: the GGUF's blocks
    /// as packaged), `q8_0` (re-quantized at load) or `f32` (dequantized;
    /// reproduces the `transformers` reference token for token). Quality of
    /// each: `benchmark_results/quality.md`.
    #[serde(default)]
    pub weights: WeightFormat,
    /// Compute threads per local completions stage (default:
    /// `[pipeline] threads_per_stage`). A single stream keeps one stage busy
    /// at a time, and the quantized decode step splits its products across
    /// these threads.
    #[serde(default)]
    pub threads_per_stage: Option<usize>,
    /// Replicas of the completions pipeline (`local` only; default 1).
    #[serde(default = "default_replicas")]
    pub replicas: usize,
    /// Each stage's memory (`"1GiB"`): `serve --model` without `--stages`
    /// splits the model as `gateway plan` does for it (none: 2 stages).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub stage_memory: Option<String>,
    /// The stages, entry stage first.
    pub stages: Vec<StageConfig>,
}

/// `[auth]`: API keys for the keyed routes (all of `/v1/*` but
/// `/v1/attestation`).
#[derive(Clone, Debug, Default, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct AuthConfig {
    /// Require `Authorization: Bearer <token>` on `/v1/*`.
    #[serde(default)]
    pub enabled: bool,
    /// Limit for keys that do not set `requests_per_minute` (none: unlimited).
    #[serde(default)]
    pub default_requests_per_minute: Option<u32>,
    /// Limit for keys that do not set `max_concurrent` (none: unlimited).
    #[serde(default)]
    pub default_max_concurrent: Option<u32>,
    /// Keys given by their SHA-256 digest.
    #[serde(default)]
    pub keys: Vec<ApiKeyConfig>,
}

/// `[[auth.keys]]` (or an inline table in `auth.keys`).
#[derive(Clone, Debug, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct ApiKeyConfig {
    /// A label for logs (never the token).
    pub name: String,
    /// SHA-256 of the token, 64 hex digits (`gateway hash-key`).
    pub sha256: String,
    /// Token-bucket rate: requests per minute (bursts up to this many).
    #[serde(default)]
    pub requests_per_minute: Option<u32>,
    /// Requests this key may have in flight at once.
    #[serde(default)]
    pub max_concurrent: Option<u32>,
}

/// `[server]`.
#[derive(Clone, Debug, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct ServerConfig {
    /// Address to listen on, e.g. `127.0.0.1:8080`.
    pub listen: String,
    /// Largest accepted request body (bytes); larger gets 413.
    #[serde(default = "default_max_body")]
    pub max_body_bytes: usize,
    /// Most inputs in one embeddings request.
    #[serde(default = "default_max_inputs")]
    pub max_inputs: usize,
    /// Time a request may take before it gets 504.
    #[serde(default = "default_timeout")]
    pub request_timeout_secs: u64,
    /// How many recent receipts `GET /v1/receipts/{id}` keeps.
    #[serde(default = "default_receipt_retention")]
    pub receipt_retention: usize,
    /// Serve plain HTTP on a non-loopback `listen` address (without
    /// `[server.tls]`); refused at start unless set.
    #[serde(default)]
    pub allow_plain_http: bool,
    /// On SIGTERM/SIGINT: how long requests in flight may still run before
    /// they are cancelled (503 `shutting_down`).
    #[serde(default = "default_shutdown_grace")]
    pub shutdown_grace_secs: u64,
    /// Most client connections open at once; past it, new connections wait
    /// in the listen backlog until one closes.
    #[serde(default = "default_max_connections")]
    pub max_connections: usize,
    /// Most `POST` requests the gateway works on at once, over all
    /// connections; past it a request gets 503 `server_overloaded` with
    /// `Retry-After: 1` before its body is read.
    #[serde(default = "default_max_in_flight")]
    pub max_in_flight: usize,
    /// A connection that has not sent a request's whole head within this
    /// many seconds is closed (slow-header clients).
    #[serde(default = "default_header_read_timeout")]
    pub header_read_timeout_secs: u64,
    /// The kernel send buffer of each client connection, in bytes (none:
    /// the kernel's autotuning, up to `net.ipv4.tcp_wmem`'s maximum). A
    /// bound caps the memory a client that stops reading can pin, and lets
    /// the stalled-reader deadline act sooner.
    #[serde(default)]
    pub send_buffer_bytes: Option<u32>,
    /// `GET /v1/attestation` calls per client address and minute that need
    /// fresh evidence from the stages (cached answers are not counted).
    #[serde(default = "default_attestation_per_minute")]
    pub attestation_per_minute: u32,
    /// How long evidence made for a nonce is served again for the same
    /// nonce (0: never).
    #[serde(default = "default_attestation_cache_secs")]
    pub attestation_cache_secs: u64,
    /// `[server.tls]`: serve HTTPS (none: plain HTTP).
    #[serde(default)]
    pub tls: Option<TlsConfig>,
    /// `[server.timeouts]`: per-route deadlines.
    #[serde(default)]
    pub timeouts: TimeoutsConfig,
}

/// `[server.timeouts]`: deadlines per route, seconds, until the response
/// headers. Routes not named here use `server.request_timeout_secs`.
#[derive(Clone, Debug, Default, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct TimeoutsConfig {
    /// `POST /v1/embeddings` (default: `server.request_timeout_secs`).
    #[serde(default)]
    pub embeddings_secs: Option<u64>,
    /// `POST /v1/completions` and `POST /v1/chat/completions` (default:
    /// `server.request_timeout_secs`).
    #[serde(default)]
    pub completions_secs: Option<u64>,
    /// `GET /v1/attestation`: fresh evidence from every stage (default 10).
    #[serde(default)]
    pub attestation_secs: Option<u64>,
}

/// `[server.tls]`.
#[derive(Clone, Debug, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct TlsConfig {
    /// PEM certificate chain, leaf first.
    pub cert: PathBuf,
    /// PEM private key (PKCS#8, PKCS#1 or SEC1).
    pub key: PathBuf,
}

/// Checks a stage list: contiguous non-empty layer ranges from 0, an
/// address for each stage when the stages are remote, and a parent relay
/// (`vsock://3:PORT`) as the `peer_address` of every stage a Nitro enclave
/// dials: the next stage, and with `feedback` (a generation pipeline of
/// several stages) the entry stage, which the exit stage sends tokens to.
/// `k` names a key path (with the environment variable that set it, if any).
fn validate_stages(
    section: &str,
    stages: &[StageConfig],
    launch: Launch,
    feedback: bool,
    k: &dyn Fn(&str) -> String,
) -> Result<()> {
    if stages.is_empty() {
        bail!(
            "{}: at least one stage is required",
            k(&format!("{section}.stages"))
        );
    }
    let mut expect = 0;
    for (i, s) in stages.iter().enumerate() {
        if s.layers[0] != expect || s.layers[1] <= s.layers[0] {
            bail!(
                "{}: expected a non-empty range starting at {expect}, got {:?}",
                k(&format!("{section}.stages[{i}].layers")),
                s.layers
            );
        }
        expect = s.layers[1];
        if let Some(p) = &s.peer_address {
            let key = k(&format!("{section}.stages[{i}].peer_address"));
            if launch != Launch::Remote {
                bail!("{key}: only with pipeline.launch = \"remote\"");
            }
            p.parse::<proto::io::transport::Endpoint>()
                .map_err(|e| anyhow!("{key}: {e}"))?;
        }
        if launch == Launch::Remote && s.address.is_none() {
            bail!(
                "{}: required when pipeline.launch = \"remote\"",
                k(&format!("{section}.stages[{i}].address"))
            );
        }
        if let Some(name) = s.address.as_deref().and_then(dns_name) {
            let key = k(&format!("{section}.stages[{i}].address"));
            if name
                .rsplit_once(':')
                .is_none_or(|(_, p)| p.parse::<u16>().is_err())
            {
                bail!("{key}: expected dns://host:port");
            }
        }
    }
    let dns = stages
        .iter()
        .filter(|s| s.address.as_deref().and_then(dns_name).is_some())
        .count();
    if dns != 0 && dns != stages.len() {
        bail!(
            "{}: either every stage address is dns://host:port or none is",
            k(&format!("{section}.stages"))
        );
    }
    let n = stages.len();
    let feedback_dial = (feedback && n > 1).then_some((n - 1, 0));
    for (from, to) in (1..n).map(|i| (i - 1, i)).chain(feedback_dial) {
        if !is_enclave(&stages[from]) {
            continue;
        }
        let relayed = stages[to]
            .peer_address
            .as_deref()
            .and_then(|p| p.parse().ok())
            .is_some_and(|e| {
                matches!(e, Endpoint::Vsock { cid, .. } if cid == proto::io::transport::NITRO_PARENT_CID)
            });
        if !relayed {
            bail!(
                "{}: stage {from} is a Nitro enclave (its address is vsock://CID:PORT with a CID \
                 above 3) and an enclave reaches only its parent, so stage {to} needs \
                 peer_address = \"vsock://3:PORT\", a parent port that `gateway host-proxy` \
                 relays to stage {to} (docs/deploy-nitro.md)",
                k(&format!("{section}.stages[{to}].peer_address"))
            );
        }
    }
    Ok(())
}

/// Whether a stage is a Nitro enclave: its address is a vsock CID other than
/// the parent's (`any`, the host and the parent are not enclaves).
fn is_enclave(stage: &StageConfig) -> bool {
    matches!(
        stage.address.as_deref().and_then(|a| a.parse().ok()),
        Some(Endpoint::Vsock { cid, .. }) if cid > proto::io::transport::NITRO_PARENT_CID && cid != u32::MAX
    )
}

/// Whether a `listen` address is on loopback (`127.0.0.0/8`, `::1`, `localhost`).
pub use client::transport::is_loopback;

/// How the gateway reaches the stages.
#[derive(Clone, Copy, Debug, Deserialize, Serialize, PartialEq, Eq)]
#[serde(rename_all = "lowercase")]
pub enum Launch {
    /// Start the stages as child processes on loopback.
    Local,
    /// Connect to already running stages at their `address`.
    Remote,
}

/// `[pipeline]`.
#[derive(Clone, Debug, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct PipelineConfig {
    /// Measurement policy file.
    pub policy: PathBuf,
    /// Model folder (with `manifest.json`).
    pub model_dir: PathBuf,
    /// `local` or `remote`.
    pub launch: Launch,
    /// Stage binary for `local` (default: `enclave-stage` next to the gateway binary).
    #[serde(default)]
    pub stage_binary: Option<PathBuf>,
    /// Compute threads per local stage.
    #[serde(default = "default_threads")]
    pub threads_per_stage: usize,
    /// Padded tokens per micro-batch (local stages).
    #[serde(default = "default_token_budget")]
    pub token_budget: usize,
    /// How the local stages hold the dense layers' weights: `bf16` (the
    /// stages' default: rounded to bfloat16, AVX-512 BF16 products) or `f32`
    /// (the model's own). Speed and cosine of each:
    /// `benchmark_results/embeddings.md`.
    #[serde(default)]
    pub weights: Option<WeightFormat>,
    /// How long to wait for the stages to come up.
    #[serde(default = "default_connect_timeout")]
    pub connect_timeout_secs: u64,
    /// Replicas of the pipeline: each a whole chain of stages, attested on
    /// its own; requests go to the least loaded. `local`: how many to
    /// start; `remote` with `dns://` stage addresses: the most to use.
    #[serde(default = "default_replicas")]
    pub replicas: usize,
    /// `dns://` stage addresses: seconds between resolutions.
    #[serde(default = "default_discovery_secs")]
    pub discovery_secs: u64,
    /// The stages, entry stage first.
    pub stages: Vec<StageConfig>,
}

fn default_replicas() -> usize {
    1
}

fn default_discovery_secs() -> u64 {
    10
}

/// One pipeline to start: its model, stages and model-specific stage flags.
#[derive(Clone, Debug)]
pub struct PipelineSpec {
    /// `embeddings` or `completions` (for logs).
    pub name: &'static str,
    /// Measurement policy of its stages.
    pub policy: PathBuf,
    /// Model folder.
    pub model_dir: PathBuf,
    /// Stages, entry first.
    pub stages: Vec<StageConfig>,
    /// Extra flags for each local stage.
    pub stage_args: Vec<String>,
    /// Compute threads per local stage.
    pub threads: usize,
    /// How many replicas of the pipeline to run (with `discovery`: the most).
    pub replicas: usize,
    /// `dns://` stage addresses: each stage's `host:port` to resolve; every
    /// address a name resolves to is one instance of that stage.
    pub discovery: Option<Vec<String>>,
}

/// The `host:port` of a `dns://host:port` stage address.
pub fn dns_name(address: &str) -> Option<&str> {
    address.strip_prefix("dns://")
}

/// `[[pipeline.stages]]`.
#[derive(Clone, Debug, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct StageConfig {
    /// Layers `[start, end)`.
    pub layers: [u32; 2],
    /// `tcp://host:port` or `vsock://CID:PORT` (required for `remote`).
    #[serde(default)]
    pub address: Option<String>,
    /// Where the other stages reach this one, when not at `address` (remote
    /// only). On Nitro the gateway dials an enclave at `vsock://CID:PORT`,
    /// but an enclave reaches its neighbour only through the parent's
    /// `gateway host-proxy`: `vsock://3:PORT`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub peer_address: Option<String>,
}

impl StageConfig {
    /// A locally launched stage running `layers`.
    pub fn local(layers: [u32; 2]) -> Self {
        Self {
            layers,
            address: None,
            peer_address: None,
        }
    }
}

impl CompletionsConfig {
    /// A `[completions]` table with every setting at its default.
    pub fn new(policy: PathBuf, model_dir: PathBuf, stages: Vec<StageConfig>) -> Self {
        Self {
            policy,
            model_dir,
            kv_cache_tokens: default_kv_tokens(),
            max_step_seqs: default_step_seqs(),
            max_waiting: default_max_waiting(),
            step_tokens: default_token_budget(),
            weights: WeightFormat::default(),
            threads_per_stage: None,
            replicas: default_replicas(),
            stage_memory: None,
            stages,
        }
    }
}

fn default_max_body() -> usize {
    8 << 20
}
fn default_max_inputs() -> usize {
    2048
}
fn default_timeout() -> u64 {
    60
}
fn default_shutdown_grace() -> u64 {
    30
}
fn default_max_connections() -> usize {
    1024
}
fn default_max_in_flight() -> usize {
    512
}
fn default_attestation_per_minute() -> u32 {
    60
}
fn default_attestation_cache_secs() -> u64 {
    10
}
fn default_header_read_timeout() -> u64 {
    10
}
fn default_receipt_retention() -> usize {
    10_000
}
fn default_threads() -> usize {
    1
}
fn default_token_budget() -> usize {
    4096
}
fn default_connect_timeout() -> u64 {
    120
}
fn default_kv_tokens() -> usize {
    16_384
}
fn default_step_seqs() -> usize {
    64
}
fn default_max_waiting() -> usize {
    256
}
