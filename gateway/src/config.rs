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
        if p.stages.is_empty() {
            bail!("pipeline.stages: at least one stage is required");
        }
        let mut expect = 0;
        for (i, s) in p.stages.iter().enumerate() {
            if s.layers[0] != expect || s.layers[1] <= s.layers[0] {
                bail!(
                    "pipeline.stages[{i}].layers: expected a non-empty range starting at {expect}, got {:?}",
                    s.layers
                );
            }
            expect = s.layers[1];
            if p.launch == Launch::Remote && s.address.is_none() {
                bail!("pipeline.stages[{i}].address: required when pipeline.launch = \"remote\"");
            }
        }
        if self.server.max_inputs == 0 {
            bail!("server.max_inputs: must be at least 1");
        }
        if p.threads_per_stage == 0 {
            bail!("pipeline.threads_per_stage: must be at least 1");
        }
        Ok(())
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
