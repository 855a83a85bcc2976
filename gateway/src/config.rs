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

use anyhow::{anyhow, bail, Context, Result};
use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

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
    pub weights: proto::frames::WeightFormat,
    /// Compute threads per local completions stage (default:
    /// `[pipeline] threads_per_stage`). A single stream keeps one stage busy
    /// at a time, and the quantized decode step splits its products across
    /// these threads.
    #[serde(default)]
    pub threads_per_stage: Option<usize>,
    /// The stages, entry stage first.
    pub stages: Vec<StageConfig>,
}

/// `[auth]`: API keys for the `/v1/*` routes.
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

/// Checks a stage list: contiguous non-empty layer ranges from 0, and an
/// address for each stage when the stages are remote.
/// `k` names a key path (with the environment variable that set it, if any).
fn validate_stages(
    section: &str,
    stages: &[StageConfig],
    launch: Launch,
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
            p.parse::<proto::transport::Endpoint>()
                .map_err(|e| anyhow!("{key}: {e}"))?;
        }
        if launch == Launch::Remote && s.address.is_none() {
            bail!(
                "{}: required when pipeline.launch = \"remote\"",
                k(&format!("{section}.stages[{i}].address"))
            );
        }
    }
    Ok(())
}

/// Whether a `listen` address is on loopback (`127.0.0.0/8`, `::1`, `localhost`).
pub fn is_loopback(listen: &str) -> bool {
    if let Ok(a) = listen.parse::<std::net::SocketAddr>() {
        return a.ip().is_loopback();
    }
    matches!(listen.rsplit_once(':'), Some((host, _)) if host.eq_ignore_ascii_case("localhost"))
}

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
    /// How long to wait for the stages to come up.
    #[serde(default = "default_connect_timeout")]
    pub connect_timeout_secs: u64,
    /// The stages, entry stage first.
    pub stages: Vec<StageConfig>,
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

impl GatewayConfig {
    /// Reads the file, applies the environment overrides
    /// (`GATEWAY_<SECTION>__<KEY>`) and validates the result.
    pub fn load(path: &Path) -> Result<Self> {
        let env = std::env::vars_os().filter_map(|(k, v)| Some((k.into_string().ok()?, v)));
        Self::load_with_env(path, env)
    }

    /// [`Self::load`] with the environment given explicitly.
    pub fn load_with_env(
        path: &Path,
        env: impl IntoIterator<Item = (String, std::ffi::OsString)>,
    ) -> Result<Self> {
        let text = std::fs::read_to_string(path)
            .with_context(|| format!("reading config {}", path.display()))?;
        Self::parse(&text, env).with_context(|| format!("config {}", path.display()))
    }

    fn parse(
        text: &str,
        env: impl IntoIterator<Item = (String, std::ffi::OsString)>,
    ) -> Result<Self> {
        // Syntax errors are reported here, with line and column.
        let mut table: toml::Table = toml::from_str(text)?;
        let overrides = apply_env_overrides(&mut table, env)?;
        let mut cfg: GatewayConfig = serde_path_to_error::deserialize(toml::Value::Table(table))
            .map_err(|e| {
                let path = e.path().to_string();
                // toml appends "in `path`" on a line of its own: the path is
                // named in front already.
                let inner = e.inner().to_string();
                let why = inner.lines().next().unwrap_or_default().trim_end();
                anyhow!("{}: {why}", key_name(&overrides, &path))
            })?;
        cfg.overrides = overrides;
        cfg.validate()?;
        Ok(cfg)
    }

    /// How errors name the key at `path`: the path itself, or for a key set
    /// in the environment `VARIABLE (path)`.
    pub fn key(&self, path: &str) -> String {
        key_name(&self.overrides, path)
    }

    /// Rewrites an error whose message begins with a key path (as
    /// `server.tls.cert: …`) to name the environment variable when that key
    /// was overridden.
    pub fn attribute(&self, e: anyhow::Error) -> anyhow::Error {
        let msg = format!("{e:#}");
        for path in self.overrides.keys() {
            if let Some(rest) = msg.strip_prefix(path.as_str()) {
                if rest.starts_with([':', ' ']) {
                    return anyhow!("{}{rest}", self.key(path));
                }
            }
        }
        e
    }

    /// The effective configuration as TOML (defaults filled in, overrides
    /// applied), with API key digests redacted.
    pub fn effective_toml(&self) -> String {
        let mut shown = self.clone();
        for k in &mut shown.auth.keys {
            k.sha256 = "<redacted>".into();
        }
        let body = toml::to_string(&shown).unwrap_or_else(|e| format!("# not shown: {e}"));
        let mut out = String::new();
        for (path, var) in &self.overrides {
            out += &format!("# {path} is set by {var}\n");
        }
        out += body.trim_end();
        out.push('\n');
        out
    }

    fn validate(&self) -> Result<()> {
        let k = |path: &str| self.key(path);
        let p = &self.pipeline;
        validate_stages("pipeline", &p.stages, p.launch, &k)?;
        if let Some(c) = &self.completions {
            validate_stages("completions", &c.stages, p.launch, &k)?;
            for (key, v) in [
                ("kv_cache_tokens", c.kv_cache_tokens),
                ("max_step_seqs", c.max_step_seqs),
                ("step_tokens", c.step_tokens),
            ] {
                if v == 0 {
                    bail!("{}: must be at least 1", k(&format!("completions.{key}")));
                }
            }
        }
        self.check_listen()?;
        self.telemetry.validate(&k)?;
        if self.server.max_inputs == 0 {
            bail!("{}: must be at least 1", k("server.max_inputs"));
        }
        let t = &self.server.timeouts;
        for (key, secs) in [
            (
                "server.request_timeout_secs",
                Some(self.server.request_timeout_secs),
            ),
            ("server.timeouts.embeddings_secs", t.embeddings_secs),
            ("server.timeouts.completions_secs", t.completions_secs),
            ("server.timeouts.attestation_secs", t.attestation_secs),
        ] {
            if secs == Some(0) {
                bail!("{}: must be at least 1", k(key));
            }
        }
        if p.threads_per_stage == 0 {
            bail!("{}: must be at least 1", k("pipeline.threads_per_stage"));
        }
        if self.completions.as_ref().and_then(|c| c.threads_per_stage) == Some(0) {
            bail!("{}: must be at least 1", k("completions.threads_per_stage"));
        }
        let a = &self.auth;
        if a.default_requests_per_minute == Some(0) {
            bail!(
                "{}: must be at least 1 (omit it for no limit)",
                k("auth.default_requests_per_minute")
            );
        }
        if a.default_max_concurrent == Some(0) {
            bail!(
                "{}: must be at least 1 (omit it for no limit)",
                k("auth.default_max_concurrent")
            );
        }
        let mut names = std::collections::HashSet::new();
        for (i, key) in a.keys.iter().enumerate() {
            let field = |f: &str| k(&format!("auth.keys[{i}].{f}"));
            if key.name.is_empty() {
                bail!("{}: must not be empty", field("name"));
            }
            if !names.insert(key.name.as_str()) {
                bail!("{}: duplicate name {:?}", field("name"), key.name);
            }
            let ok = key.sha256.len() == 64 && hex::decode(&key.sha256).is_ok();
            if !ok {
                bail!(
                    "{}: must be 64 hex digits (the SHA-256 of the token; see `gateway hash-key`)",
                    field("sha256")
                );
            }
            if key.requests_per_minute == Some(0) {
                bail!(
                    "{}: must be at least 1 (omit it for no limit)",
                    field("requests_per_minute")
                );
            }
            if key.max_concurrent == Some(0) {
                bail!(
                    "{}: must be at least 1 (omit it for no limit)",
                    field("max_concurrent")
                );
            }
        }
        Ok(())
    }

    /// Refuses plain HTTP on a non-loopback address unless
    /// `server.allow_plain_http` is set (run again after `--listen`).
    pub fn check_listen(&self) -> Result<()> {
        let s = &self.server;
        if s.tls.is_none() && !s.allow_plain_http && !is_loopback(&s.listen) {
            bail!(
                "{}: refusing plain HTTP on non-loopback address {} = {:?}; \
                 configure [server.tls] (cert, key) or set server.allow_plain_http = true \
                 (e.g. behind a TLS-terminating proxy)",
                self.key("server.allow_plain_http"),
                self.key("server.listen"),
                s.listen
            );
        }
        Ok(())
    }

    /// The pipelines to run: embeddings (`[pipeline]`) and, when
    /// configured, completions (`[completions]`).
    pub fn pipelines(&self) -> Vec<PipelineSpec> {
        let p = &self.pipeline;
        let mut out = vec![PipelineSpec {
            name: "embeddings",
            policy: p.policy.clone(),
            model_dir: p.model_dir.clone(),
            stages: p.stages.clone(),
            stage_args: vec![
                "--token-budget".into(),
                p.token_budget.to_string(),
                "--max-inputs".into(),
                self.server.max_inputs.to_string(),
            ],
            threads: p.threads_per_stage,
        }];
        if let Some(c) = &self.completions {
            out.push(PipelineSpec {
                name: "completions",
                policy: c.policy.clone(),
                model_dir: c.model_dir.clone(),
                stages: c.stages.clone(),
                stage_args: vec![
                    "--kv-cache-tokens".into(),
                    c.kv_cache_tokens.to_string(),
                    "--max-step-seqs".into(),
                    c.max_step_seqs.to_string(),
                    "--max-waiting".into(),
                    c.max_waiting.to_string(),
                    "--token-budget".into(),
                    c.step_tokens.to_string(),
                    "--weights".into(),
                    c.weights.to_string(),
                ],
                threads: c.threads_per_stage.unwrap_or(p.threads_per_stage),
            });
        }
        out
    }

    /// The stage binary to launch.
    pub fn stage_binary(&self) -> Result<PathBuf> {
        match &self.pipeline.stage_binary {
            Some(p) => Ok(p.clone()),
            None => {
                let me = std::env::current_exe()?;
                Ok(me.with_file_name("enclave-stage"))
            }
        }
    }
}

/// `path` as errors show it: `VARIABLE (path)` when an environment variable
/// set it (or a key inside it, or the table that holds it), else `path`.
fn key_name(overrides: &BTreeMap<String, String>, path: &str) -> String {
    let hit = overrides.get(path).or_else(|| {
        overrides.iter().find_map(|(p, var)| {
            let inside = |outer: &str, inner: &str| {
                inner
                    .strip_prefix(outer)
                    .is_some_and(|r| r.starts_with(['.', '[']))
            };
            (inside(p, path) || inside(path, p)).then_some(var)
        })
    });
    match hit {
        Some(var) => format!("{var} ({path})"),
        None => path.to_string(),
    }
}

/// Applies every `GATEWAY_A__B[__C…]` variable to `table`; returns the key
/// paths it set (in error-message form, `a.b[1].c`) with their variables.
/// Variables without `__` after the prefix (such as `GATEWAY_API_KEYS`) are
/// not overrides.
fn apply_env_overrides(
    table: &mut toml::Table,
    env: impl IntoIterator<Item = (String, std::ffi::OsString)>,
) -> Result<BTreeMap<String, String>> {
    let mut vars: Vec<(String, std::ffi::OsString)> = env
        .into_iter()
        .filter(|(k, _)| {
            k.strip_prefix(ENV_PREFIX)
                .is_some_and(|r| r.contains(ENV_SEPARATOR))
        })
        .collect();
    // Deterministic order: `…__STAGES__2` after `…__STAGES__1`.
    vars.sort();
    let mut set = BTreeMap::new();
    for (var, value) in vars {
        let value = value
            .into_string()
            .map_err(|_| anyhow!("{var}: the value is not UTF-8"))?;
        let segments: Vec<String> = var[ENV_PREFIX.len()..]
            .split(ENV_SEPARATOR)
            .map(str::to_ascii_lowercase)
            .collect();
        if segments.iter().any(String::is_empty) {
            bail!("{var}: empty key level (levels are separated by exactly `{ENV_SEPARATOR}`)");
        }
        let path =
            set_path(table, &segments, env_value(&value)).map_err(|why| anyhow!("{var}: {why}"))?;
        set.insert(path, var);
    }
    Ok(set)
}

/// An override's value: a TOML value when it parses as exactly one, else the
/// text as a string.
fn env_value(text: &str) -> toml::Value {
    match toml::from_str::<toml::Table>(&format!("v = {text}")) {
        Ok(mut t) if t.len() == 1 => t.remove("v").expect("one key"),
        _ => toml::Value::String(text.to_string()),
    }
}

/// Sets `segments` (table keys, or array indices for arrays) to `value`,
/// creating tables on the way; returns the path in error-message form.
fn set_path(
    table: &mut toml::Table,
    segments: &[String],
    value: toml::Value,
) -> Result<String, String> {
    let mut path = segments[0].clone();
    let mut cur = table
        .entry(segments[0].clone())
        .or_insert_with(|| toml::Value::Table(toml::Table::new()));
    for seg in &segments[1..] {
        cur = match cur {
            toml::Value::Table(t) => {
                path = format!("{path}.{seg}");
                t.entry(seg.clone())
                    .or_insert_with(|| toml::Value::Table(toml::Table::new()))
            }
            toml::Value::Array(a) => {
                let i: usize = seg
                    .parse()
                    .map_err(|_| format!("{path} is an array: expected an index, got {seg:?}"))?;
                if i > a.len() {
                    return Err(format!(
                        "{path}[{i}]: index out of range ({} elements; the next one is {})",
                        a.len(),
                        a.len()
                    ));
                }
                if i == a.len() {
                    a.push(toml::Value::Table(toml::Table::new()));
                }
                path = format!("{path}[{i}]");
                &mut a[i]
            }
            _ => {
                return Err(format!(
                    "{path} is a value, not a table: cannot set {seg:?} in it"
                ))
            }
        };
    }
    *cur = value;
    Ok(path)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn shipped_config_loads_with_auth_off() {
        let path = Path::new(env!("CARGO_MANIFEST_DIR")).join("../config/gateway.toml");
        let cfg = GatewayConfig::load(&path).unwrap();
        assert!(!cfg.auth.enabled);
        assert!(cfg.auth.keys.is_empty());
        assert_eq!(cfg.server.receipt_retention, 10_000);
    }

    #[test]
    fn container_config_loads_as_remote() {
        let path = Path::new(env!("CARGO_MANIFEST_DIR")).join("../docker/gateway.toml");
        let cfg = GatewayConfig::load(&path).unwrap();
        assert_eq!(cfg.pipeline.launch, Launch::Remote);
        let addrs: Vec<_> = cfg
            .pipeline
            .stages
            .iter()
            .map(|s| s.address.clone())
            .collect();
        assert_eq!(
            addrs,
            [
                Some("tcp://stage0:9000".to_string()),
                Some("tcp://stage1:9000".to_string())
            ]
        );
        assert!(cfg.server.allow_plain_http && cfg.server.tls.is_none());
    }

    #[test]
    fn nitro_config_has_vsock_stages_and_a_peer_address() {
        let path = Path::new(env!("CARGO_MANIFEST_DIR")).join("../config/gateway-nitro.toml");
        let cfg = GatewayConfig::load(&path).unwrap();
        assert_eq!(cfg.pipeline.launch, Launch::Remote);
        let s = &cfg.pipeline.stages;
        assert_eq!(s[0].address.as_deref(), Some("vsock://16:9000"));
        assert_eq!(s[1].peer_address.as_deref(), Some("vsock://3:8001"));
        // A bad peer address, or one without remote stages, names the key.
        let text = std::fs::read_to_string(&path).unwrap();
        let bad = text.replace("vsock://3:8001", "vsock://three:8001");
        let e = format!("{:#}", GatewayConfig::parse(&bad, env(&[])).unwrap_err());
        assert!(e.contains("pipeline.stages[1].peer_address"), "{e}");
        let e = format!(
            "{:#}",
            GatewayConfig::parse(&text, env(&[("GATEWAY_PIPELINE__LAUNCH", "local")])).unwrap_err()
        );
        assert!(e.contains("peer_address: only with"), "{e}");
    }

    #[test]
    fn auth_keys_are_validated_by_name() {
        let base = std::fs::read_to_string(
            Path::new(env!("CARGO_MANIFEST_DIR")).join("../config/gateway.toml"),
        )
        .unwrap()
        .replace("[auth]\nenabled = false", "[auth]\nenabled = true");
        let with = |keys: &str| {
            let text = base.replace("keys = [", &format!("keys = [{keys},"));
            let cfg: GatewayConfig = toml::from_str(&text).unwrap();
            cfg.validate().map_err(|e| e.to_string())
        };
        let d = "ab".repeat(32);
        assert!(with(&format!("{{ name = \"a\", sha256 = \"{d}\" }}")).is_ok());
        let e = with(&format!(
            "{{ name = \"a\", sha256 = \"{d}\" }}, {{ name = \"a\", sha256 = \"{d}\" }}"
        ))
        .unwrap_err();
        assert!(e.contains("auth.keys[1].name"), "{e}");
        let e = with(&format!(
            "{{ name = \"a\", sha256 = \"{d}\", requests_per_minute = 0 }}"
        ))
        .unwrap_err();
        assert!(e.contains("auth.keys[0].requests_per_minute"), "{e}");
        let e = with("{ name = \"a\", sha256 = \"xyz\" }").unwrap_err();
        assert!(e.contains("auth.keys[0].sha256"), "{e}");
    }

    #[test]
    fn plain_http_off_loopback_needs_the_key() {
        let base = std::fs::read_to_string(
            Path::new(env!("CARGO_MANIFEST_DIR")).join("../config/gateway.toml"),
        )
        .unwrap();
        let with = |listen: &str, extra: &str| {
            let text = base.replace(
                "listen = \"127.0.0.1:8080\"",
                &format!("listen = {listen:?}\n{extra}"),
            );
            let cfg: GatewayConfig = toml::from_str(&text).unwrap();
            cfg.validate().map_err(|e| e.to_string())
        };
        for ok in [
            "127.0.0.1:8080",
            "[::1]:8080",
            "localhost:8080",
            "127.0.0.2:1",
        ] {
            assert!(with(ok, "").is_ok(), "{ok}");
        }
        for bad in [
            "0.0.0.0:8080",
            "[::]:8080",
            "10.0.0.1:80",
            "gateway.example:443",
        ] {
            let e = with(bad, "").unwrap_err();
            assert!(e.contains("server.allow_plain_http"), "{bad}: {e}");
        }
        assert!(with("0.0.0.0:8080", "allow_plain_http = true").is_ok());
        let tls = "[server.tls]\ncert = \"c.pem\"\nkey = \"k.pem\"\n";
        let text = base.replace("[pipeline]", &format!("{tls}\n[pipeline]"));
        let text = text.replace("127.0.0.1:8080", "0.0.0.0:8443");
        let cfg: GatewayConfig = toml::from_str(&text).unwrap();
        cfg.validate().unwrap();
        assert_eq!(cfg.server.tls.unwrap().cert, PathBuf::from("c.pem"));
    }

    fn shipped() -> String {
        std::fs::read_to_string(
            Path::new(env!("CARGO_MANIFEST_DIR")).join("../config/gateway.toml"),
        )
        .unwrap()
    }

    fn env(pairs: &[(&str, &str)]) -> Vec<(String, std::ffi::OsString)> {
        pairs
            .iter()
            .map(|(k, v)| (k.to_string(), v.into()))
            .collect()
    }

    #[test]
    fn env_overrides_set_keys_of_every_kind() {
        let cfg = GatewayConfig::parse(
            &shipped(),
            env(&[
                ("GATEWAY_SERVER__LISTEN", "127.0.0.1:9999"),
                ("GATEWAY_SERVER__MAX_INPUTS", "16"),
                ("GATEWAY_AUTH__ENABLED", "true"),
                ("GATEWAY_PIPELINE__LAUNCH", "remote"),
                (
                    "GATEWAY_PIPELINE__STAGES__0__ADDRESS",
                    "tcp://10.0.0.1:7000",
                ),
                (
                    "GATEWAY_PIPELINE__STAGES__1__ADDRESS",
                    "tcp://10.0.0.2:7000",
                ),
                ("GATEWAY_PIPELINE__STAGES__1__LAYERS", "[3, 6]"),
                (
                    "GATEWAY_COMPLETIONS__STAGES__0__ADDRESS",
                    "tcp://10.0.0.3:7000",
                ),
                (
                    "GATEWAY_COMPLETIONS__STAGES__1__ADDRESS",
                    "tcp://10.0.0.4:7000",
                ),
                ("GATEWAY_PIPELINE__STAGE_BINARY", "\"123\""),
                // Not overrides: no `__` after the prefix, or another prefix.
                ("GATEWAY_API_KEYS", "a:b"),
                ("SERVER__LISTEN", "x"),
            ]),
        )
        .unwrap();
        assert_eq!(cfg.server.listen, "127.0.0.1:9999");
        assert_eq!(cfg.server.max_inputs, 16);
        assert!(cfg.auth.enabled);
        assert_eq!(cfg.pipeline.launch, Launch::Remote);
        assert_eq!(
            cfg.pipeline.stages[1].address.as_deref(),
            Some("tcp://10.0.0.2:7000")
        );
        assert_eq!(cfg.pipeline.stage_binary, Some(PathBuf::from("123")));
        assert_eq!(
            cfg.overrides
                .get("pipeline.stages[1].address")
                .map(String::as_str),
            Some("GATEWAY_PIPELINE__STAGES__1__ADDRESS")
        );
        assert_eq!(cfg.overrides.len(), 10);
        // The effective config shows the values and where they came from.
        let shown = cfg.effective_toml();
        assert!(
            shown.contains("# server.listen is set by GATEWAY_SERVER__LISTEN"),
            "{shown}"
        );
        assert!(shown.contains("listen = \"127.0.0.1:9999\""), "{shown}");
        // Defaults are filled in.
        assert!(shown.contains("receipt_retention = 10000"), "{shown}");
        let again: GatewayConfig = toml::from_str(
            &shown
                .lines()
                .filter(|l| !l.starts_with('#'))
                .collect::<Vec<_>>()
                .join("\n"),
        )
        .unwrap();
        assert_eq!(again.server.listen, cfg.server.listen);
    }

    #[test]
    fn env_override_errors_name_the_variable() {
        let err = |pairs: &[(&str, &str)]| {
            format!(
                "{:#}",
                GatewayConfig::parse(&shipped(), env(pairs)).unwrap_err()
            )
        };
        for (pairs, want) in [
            (
                vec![("GATEWAY_SERVER__MAX_INPUTS", "0")],
                "GATEWAY_SERVER__MAX_INPUTS (server.max_inputs): must be at least 1",
            ),
            (
                vec![("GATEWAY_SERVER__MAX_BODY_BYTES", "lots")],
                "GATEWAY_SERVER__MAX_BODY_BYTES (server.max_body_bytes): invalid type",
            ),
            (
                vec![("GATEWAY_SERVER__BOGUS", "1")],
                "GATEWAY_SERVER__BOGUS",
            ),
            (
                vec![("GATEWAY_PIPELINE__STAGES__1__LAYERS", "[4, 6]")],
                "GATEWAY_PIPELINE__STAGES__1__LAYERS (pipeline.stages[1].layers): expected",
            ),
            (
                vec![("GATEWAY_PIPELINE__STAGES__5__LAYERS", "[6, 7]")],
                "GATEWAY_PIPELINE__STAGES__5__LAYERS: pipeline.stages[5]: index out of range",
            ),
            (
                vec![("GATEWAY_SERVER__LISTEN__PORT", "1")],
                "GATEWAY_SERVER__LISTEN__PORT: server.listen is a value",
            ),
            (
                vec![("GATEWAY_SERVER____LISTEN", "1")],
                "GATEWAY_SERVER____LISTEN: empty key level",
            ),
            (
                vec![("GATEWAY_AUTH__KEYS__0__NAME", "a")],
                "GATEWAY_AUTH__KEYS__0__NAME (auth.keys[0]",
            ),
        ] {
            let e = err(&pairs);
            assert!(e.contains(want), "{pairs:?}: expected {want:?} in {e:?}");
        }
        // A bad key in the file is named without any variable.
        let text = shipped().replace("max_inputs = 2048", "max_inputs = 0");
        let e = format!("{:#}", GatewayConfig::parse(&text, env(&[])).unwrap_err());
        assert!(
            e.starts_with("server.max_inputs: must be at least 1"),
            "{e}"
        );
        let text = shipped().replace("max_inputs = 2048", "max_inputs = \"many\"");
        let e = format!("{:#}", GatewayConfig::parse(&text, env(&[])).unwrap_err());
        assert!(e.starts_with("server.max_inputs: invalid type"), "{e}");
    }

    #[test]
    fn env_override_turns_tracing_on_and_errors_name_it() {
        let shipped =
            std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../config/gateway.toml");
        let load = |v: &str| {
            GatewayConfig::load_with_env(
                &shipped,
                [("GATEWAY_TELEMETRY__OTLP_ENDPOINT".to_string(), v.into())],
            )
        };
        let cfg = load("http://127.0.0.1:4318").unwrap();
        assert_eq!(
            cfg.telemetry.otlp_endpoint.as_deref(),
            Some("http://127.0.0.1:4318")
        );
        assert_eq!(cfg.telemetry.service_name, "confidential-gateway");
        let shown = cfg.effective_toml();
        assert!(
            shown.contains("[telemetry]")
                && shown.contains("otlp_endpoint = \"http://127.0.0.1:4318\""),
            "{shown}"
        );
        let e = format!("{:#}", load("grpc://x:4317").unwrap_err());
        assert!(
            e.contains("GATEWAY_TELEMETRY__OTLP_ENDPOINT (telemetry.otlp_endpoint): must be an http:// URL"),
            "{e}"
        );
        // Off by default.
        let cfg = GatewayConfig::load_with_env(&shipped, []).unwrap();
        assert!(cfg.telemetry.otlp_endpoint.is_none());
    }
}
