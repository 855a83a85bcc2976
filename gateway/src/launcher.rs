//! Starts the stages as local child processes (the embedded default).
//!
//! Each stage gets a piped stdin and `--exit-with-stdin`, so it can never
//! outlive the gateway; it reports its bound endpoint on stdout.

use crate::config::GatewayConfig;
use anyhow::{bail, Context, Result};
use proto::transport::Endpoint;
use std::process::Stdio;
use std::time::Duration;
use tokio::io::{AsyncBufReadExt, BufReader};
use tokio::process::{Child, Command};

/// Running local stages.
pub struct LocalStages {
    children: Vec<Child>,
    /// Where each stage listens, entry stage first.
    pub endpoints: Vec<Endpoint>,
}

impl LocalStages {
    /// Starts every configured stage and waits until each has loaded its
    /// model and bound its listener.
    pub async fn start(cfg: &GatewayConfig) -> Result<Self> {
        let bin = cfg.stage_binary()?;
        if !bin.exists() {
            bail!(
                "stage binary {} not found (build it with `cargo build --release`)",
                bin.display()
            );
        }
        let n = cfg.pipeline.stages.len();
        let mut children = Vec::new();
        let mut endpoints = Vec::new();
        let mut readers = Vec::new();
        for (i, s) in cfg.pipeline.stages.iter().enumerate() {
            let mut cmd = Command::new(&bin);
            cmd.arg("--model-dir")
                .arg(&cfg.pipeline.model_dir)
                .args(["--stage-index", &i.to_string()])
                .args(["--num-stages", &n.to_string()])
                .args(["--layers", &format!("{}..{}", s.layers[0], s.layers[1])])
                .args(["--listen", "tcp://127.0.0.1:0"])
                .arg("--policy")
                .arg(&cfg.pipeline.policy)
                .args(["--threads", &cfg.pipeline.threads_per_stage.to_string()])
                .args(["--token-budget", &cfg.pipeline.token_budget.to_string()])
                .args(["--max-inputs", &cfg.server.max_inputs.to_string()])
                .arg("--exit-with-stdin")
                .stdin(Stdio::piped())
                .stdout(Stdio::piped())
                .stderr(Stdio::inherit())
                .kill_on_drop(true);
            let mut child = cmd
                .spawn()
                .with_context(|| format!("starting stage {i} ({})", bin.display()))?;
            let stdout = child.stdout.take().expect("piped stdout");
            children.push(child);
            readers.push(BufReader::new(stdout).lines());
        }
        // All stages load their models at once; then collect their endpoints.
        let deadline = Duration::from_secs(cfg.pipeline.connect_timeout_secs);
        for (i, (child, mut lines)) in children.iter_mut().zip(readers).enumerate() {
            let line = match tokio::time::timeout(deadline, lines.next_line()).await {
                Ok(Ok(Some(l))) => l,
                Ok(Ok(None)) | Ok(Err(_)) => {
                    let status = child.wait().await.ok();
                    bail!("stage {i} exited before it was ready ({status:?}); see its log above");
                }
                Err(_) => bail!("stage {i} did not become ready in time"),
            };
            let ep = line
                .strip_prefix("LISTENING ")
                .with_context(|| format!("stage {i} printed {line:?} instead of LISTENING"))?;
            let ep: Endpoint = ep.parse().map_err(anyhow::Error::msg)?;
            tracing::info!(stage = i, pid = child.id(), endpoint = %ep, "local stage started");
            tokio::spawn(async move { while let Ok(Some(_)) = lines.next_line().await {} });
            endpoints.push(ep);
        }
        Ok(Self {
            children,
            endpoints,
        })
    }

    /// Stops the stages: closes their stdin, waits briefly, then kills.
    pub async fn stop(mut self) {
        for c in &mut self.children {
            drop(c.stdin.take());
        }
        for (i, c) in self.children.iter_mut().enumerate() {
            match tokio::time::timeout(Duration::from_secs(5), c.wait()).await {
                Ok(_) => tracing::info!(stage = i, "stage stopped"),
                Err(_) => {
                    tracing::warn!(stage = i, "stage did not stop; killing it");
                    let _ = c.kill().await;
                }
            }
        }
    }
}
