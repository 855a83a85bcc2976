//! The gateway's configuration file (`config/gateway.toml`).
//!
//! Relative paths are resolved against the current directory (run the
//! gateway from the repository root, as the README does).

use anyhow::{bail, Context, Result};
use serde::Deserialize;
use std::path::{Path, PathBuf};

/// The whole file.
#[derive(Clone, Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct GatewayConfig {
    /// HTTP server settings.
    pub server: ServerConfig,
    /// The stage pipeline.
    pub pipeline: PipelineConfig,
    /// API keys and per-key limits (off by default).
    #[serde(default)]
    pub auth: AuthConfig,
    /// The text-generation pipeline for `/v1/completions` (none: not served).
    #[serde(default)]
    pub completions: Option<CompletionsConfig>,
}

/// `[completions]`: a second pipeline of stages serving a Llama model for
/// `/v1/completions`. Policy, launch mode, stage binary, threads and the
/// connect timeout are shared with `[pipeline]`.
#[derive(Clone, Debug, Deserialize)]
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
    /// The stages, entry stage first.
    pub stages: Vec<StageConfig>,
}

/// `[auth]`: API keys for the `/v1/*` routes.
#[derive(Clone, Debug, Default, Deserialize)]
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
#[derive(Clone, Debug, Deserialize)]
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
#[derive(Clone, Debug, Deserialize)]
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
    /// `[server.tls]`: serve HTTPS (none: plain HTTP).
    #[serde(default)]
    pub tls: Option<TlsConfig>,
}

/// `[server.tls]`.
#[derive(Clone, Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct TlsConfig {
    /// PEM certificate chain, leaf first.
    pub cert: PathBuf,
    /// PEM private key (PKCS#8, PKCS#1 or SEC1).
    pub key: PathBuf,
}

/// Checks a stage list: contiguous non-empty layer ranges from 0, and an
/// address for each stage when the stages are remote.
fn validate_stages(section: &str, stages: &[StageConfig], launch: Launch) -> Result<()> {
    if stages.is_empty() {
        bail!("{section}.stages: at least one stage is required");
    }
    let mut expect = 0;
    for (i, s) in stages.iter().enumerate() {
        if s.layers[0] != expect || s.layers[1] <= s.layers[0] {
            bail!(
                "{section}.stages[{i}].layers: expected a non-empty range starting at {expect}, got {:?}",
                s.layers
            );
        }
        expect = s.layers[1];
        if launch == Launch::Remote && s.address.is_none() {
            bail!("{section}.stages[{i}].address: required when pipeline.launch = \"remote\"");
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
#[derive(Clone, Copy, Debug, Deserialize, PartialEq, Eq)]
#[serde(rename_all = "lowercase")]
pub enum Launch {
    /// Start the stages as child processes on loopback.
    Local,
    /// Connect to already running stages at their `address`.
    Remote,
}

/// `[pipeline]`.
#[derive(Clone, Debug, Deserialize)]
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
}

/// `[[pipeline.stages]]`.
#[derive(Clone, Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct StageConfig {
    /// Layers `[start, end)`.
    pub layers: [u32; 2],
    /// `tcp://host:port` (required for `remote`).
    #[serde(default)]
    pub address: Option<String>,
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
    /// Reads and validates a config file.
    pub fn load(path: &Path) -> Result<Self> {
        let text = std::fs::read_to_string(path)
            .with_context(|| format!("reading config {}", path.display()))?;
        let cfg: GatewayConfig =
            toml::from_str(&text).with_context(|| format!("config {}", path.display()))?;
        cfg.validate()
            .with_context(|| format!("config {}", path.display()))?;
        Ok(cfg)
    }

    fn validate(&self) -> Result<()> {
        let p = &self.pipeline;
        validate_stages("pipeline", &p.stages, p.launch)?;
        if let Some(c) = &self.completions {
            validate_stages("completions", &c.stages, p.launch)?;
            for (key, v) in [
                ("kv_cache_tokens", c.kv_cache_tokens),
                ("max_step_seqs", c.max_step_seqs),
                ("step_tokens", c.step_tokens),
            ] {
                if v == 0 {
                    bail!("completions.{key}: must be at least 1");
                }
            }
        }
        self.check_listen()?;
        if self.server.max_inputs == 0 {
            bail!("server.max_inputs: must be at least 1");
        }
        if p.threads_per_stage == 0 {
            bail!("pipeline.threads_per_stage: must be at least 1");
        }
        let a = &self.auth;
        if a.default_requests_per_minute == Some(0) {
            bail!("auth.default_requests_per_minute: must be at least 1 (omit it for no limit)");
        }
        if a.default_max_concurrent == Some(0) {
            bail!("auth.default_max_concurrent: must be at least 1 (omit it for no limit)");
        }
        let mut names = std::collections::HashSet::new();
        for (i, k) in a.keys.iter().enumerate() {
            if k.name.is_empty() {
                bail!("auth.keys[{i}].name: must not be empty");
            }
            if !names.insert(k.name.as_str()) {
                bail!("auth.keys[{i}].name: duplicate name {:?}", k.name);
            }
            let ok = k.sha256.len() == 64 && hex::decode(&k.sha256).is_ok();
            if !ok {
                bail!("auth.keys[{i}].sha256: must be 64 hex digits (the SHA-256 of the token; see `gateway hash-key`)");
            }
            if k.requests_per_minute == Some(0) {
                bail!(
                    "auth.keys[{i}].requests_per_minute: must be at least 1 (omit it for no limit)"
                );
            }
            if k.max_concurrent == Some(0) {
                bail!("auth.keys[{i}].max_concurrent: must be at least 1 (omit it for no limit)");
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
                "server.allow_plain_http: refusing plain HTTP on non-loopback address {:?}; \
                 configure [server.tls] (cert, key) or set server.allow_plain_http = true \
                 (e.g. behind a TLS-terminating proxy)",
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
                ],
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
}
