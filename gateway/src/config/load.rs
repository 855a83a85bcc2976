//! Loading a config file: parsing (errors name the key path), environment
//! overrides, checks, and the effective config as TOML.

use super::env::{apply_env_overrides, key_name};
use super::{
    dns_name, validate_stages, CompletionsConfig, GatewayConfig, Launch, PipelineSpec, StageConfig,
};
use anyhow::{anyhow, bail, Context, Result};
use client::transport::is_loopback;
use proto::frames::WeightFormat;
use std::path::{Path, PathBuf};

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

    /// Parses and validates config text with the environment overrides
    /// `env` ([`Self::load_with_env`] without the file).
    pub fn parse(
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

    pub(super) fn validate(&self) -> Result<()> {
        let k = |path: &str| self.key(path);
        let p = &self.pipeline;
        validate_stages("pipeline", &p.stages, p.launch, false, &k)?;
        let served = |key: &str, w: WeightFormat, served: &[WeightFormat]| {
            w.served_by(served)
                .map(|_| ())
                .map_err(|e| anyhow!("{}: {e}", k(key)))
        };
        if let Some(w) = p.weights {
            served("pipeline.weights", w, &WeightFormat::EMBEDDING)?;
        }
        if let Some(c) = &self.completions {
            validate_stages("completions", &c.stages, p.launch, true, &k)?;
            served("completions.weights", c.weights, &WeightFormat::GENERATION)?;
            if let Some(m) = &c.stage_memory {
                crate::plan::parse_bytes(m).with_context(|| k("completions.stage_memory"))?;
            }
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
        for (key, n) in [
            ("pipeline.replicas", Some(p.replicas)),
            (
                "completions.replicas",
                self.completions.as_ref().map(|c| c.replicas),
            ),
        ] {
            let Some(n) = n else { continue };
            if n == 0 || n > crate::pipeline::MAX_REPLICAS {
                bail!(
                    "{}: must be from 1 to {}",
                    k(key),
                    crate::pipeline::MAX_REPLICAS
                );
            }
            let stages = if key.starts_with("pipeline") {
                &p.stages
            } else {
                &self.completions.as_ref().expect("checked above").stages
            };
            let dns = stages
                .iter()
                .any(|s| s.address.as_deref().and_then(dns_name).is_some());
            if n > 1 && p.launch == Launch::Remote && !dns {
                bail!(
                    "{}: replicas of remote stages are found through dns:// stage addresses (or run one gateway per chain, sharing the receipt store)",
                    k(key)
                );
            }
        }
        self.check_listen()?;
        self.telemetry.validate(&k)?;
        self.receipts.check(&k)?;
        if let Some(t) = &self.transparency {
            t.check(&k)?;
        }
        if self.keys.rotate_secs > 0 && self.keys.overlap_secs == 0 {
            bail!(
                "{}: must be at least 1 when keys rotate (requests sealed to the old key need time to arrive)",
                k("keys.overlap_secs")
            );
        }
        if self.server.max_inputs == 0 {
            bail!("{}: must be at least 1", k("server.max_inputs"));
        }
        if self.server.max_in_flight == 0 {
            bail!("{}: must be at least 1", k("server.max_in_flight"));
        }
        if self.server.max_connections == 0 {
            bail!("{}: must be at least 1", k("server.max_connections"));
        }
        if self.server.attestation_per_minute == 0 {
            bail!("{}: must be at least 1", k("server.attestation_per_minute"));
        }
        if self.server.send_buffer_bytes.is_some_and(|n| n < 4096) {
            bail!("{}: must be at least 4096", k("server.send_buffer_bytes"));
        }
        let t = &self.server.timeouts;
        for (key, secs) in [
            (
                "server.request_timeout_secs",
                Some(self.server.request_timeout_secs),
            ),
            (
                "server.header_read_timeout_secs",
                Some(self.server.header_read_timeout_secs),
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
        limit(a.default_requests_per_minute, || {
            k("auth.default_requests_per_minute")
        })?;
        limit(a.default_max_concurrent, || {
            k("auth.default_max_concurrent")
        })?;
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
            limit(key.requests_per_minute, || field("requests_per_minute"))?;
            limit(key.max_concurrent, || field("max_concurrent"))?;
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

    /// Serves `completions` instead of the `[completions]` table read (if
    /// any), checked as a loaded one is.
    pub fn replace_completions(&mut self, completions: CompletionsConfig) -> Result<()> {
        self.completions = Some(completions);
        self.validate()
    }

    /// Serves the model in `model_dir`, under `policy`, on `stages` as the
    /// embeddings pipeline instead of `[pipeline]`'s (its other settings
    /// kept), checked as a loaded config is.
    pub fn replace_pipeline_model(
        &mut self,
        policy: PathBuf,
        model_dir: PathBuf,
        stages: Vec<StageConfig>,
    ) -> Result<()> {
        self.pipeline.policy = policy;
        self.pipeline.model_dir = model_dir;
        self.pipeline.stages = stages;
        self.validate()
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
            ]
            .into_iter()
            .chain(
                p.weights
                    .iter()
                    .flat_map(|w| ["--weights".into(), w.to_string()]),
            )
            .chain(self.keys.stage_args())
            .collect(),
            threads: p.threads_per_stage,
            replicas: p.replicas,
            discovery: discovery(p.launch, &p.stages),
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
                ]
                .into_iter()
                .chain(self.keys.stage_args())
                .collect(),
                threads: c.threads_per_stage.unwrap_or(p.threads_per_stage),
                replicas: c.replicas,
                discovery: discovery(p.launch, &c.stages),
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

/// Each stage's `host:port` when the stages are found through DNS.
fn discovery(launch: Launch, stages: &[StageConfig]) -> Option<Vec<String>> {
    if launch != Launch::Remote {
        return None;
    }
    stages
        .iter()
        .map(|s| s.address.as_deref().and_then(dns_name).map(str::to_string))
        .collect()
}

/// An optional limit is absent (no limit) or at least 1; `key` names it.
fn limit(value: Option<u32>, key: impl FnOnce() -> String) -> Result<()> {
    if value == Some(0) {
        bail!("{}: must be at least 1 (omit it for no limit)", key());
    }
    Ok(())
}
