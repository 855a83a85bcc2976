//! Starts the stages as local child processes (the embedded default) and
//! keeps them running: a stage that dies is started again (with backoff)
//! and its new endpoint is reported, so the pipeline can reconnect without
//! restarting the gateway.
//!
//! Each stage gets a piped stdin and `--exit-with-stdin`, so it can never
//! outlive the gateway; it reports its bound endpoint on stdout.

use crate::config::GatewayConfig;
use anyhow::{bail, Context, Result};
use proto::transport::Endpoint;
use std::path::PathBuf;
use std::process::Stdio;
use std::time::Duration;
use tokio::io::{AsyncBufReadExt, BufReader, Lines};
use tokio::process::{Child, ChildStdout, Command};
use tokio::sync::{mpsc, watch};
use tokio::task::JoinHandle;

/// Running local stages.
pub struct LocalStages {
    /// Where each stage listens now, entry stage first.
    pub endpoints: Vec<Endpoint>,
    shutdown: watch::Sender<bool>,
    tasks: Vec<JoinHandle<()>>,
}

/// A stage restarted at a new endpoint: `(index, endpoint)`.
pub type Restarted = (usize, Endpoint);

struct Spawner {
    bin: PathBuf,
    args: Vec<Vec<String>>,
    ready_timeout: Duration,
}

impl Spawner {
    fn spawn(&self, i: usize) -> Result<(Child, Lines<BufReader<ChildStdout>>)> {
        let mut child = Command::new(&self.bin)
            .args(&self.args[i])
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit())
            .kill_on_drop(true)
            .spawn()
            .with_context(|| format!("starting stage {i} ({})", self.bin.display()))?;
        let stdout = child.stdout.take().expect("piped stdout");
        Ok((child, BufReader::new(stdout).lines()))
    }

    async fn ready(
        &self,
        i: usize,
        child: &mut Child,
        lines: &mut Lines<BufReader<ChildStdout>>,
    ) -> Result<Endpoint> {
        let line = match tokio::time::timeout(self.ready_timeout, lines.next_line()).await {
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
        Ok(ep)
    }
}

impl LocalStages {
    /// Starts every configured stage (their model loads overlap) and waits
    /// until each has loaded its model and bound its listener. Restarts are
    /// reported on the returned receiver.
    pub async fn start(cfg: &GatewayConfig) -> Result<(Self, mpsc::Receiver<Restarted>)> {
        let bin = cfg.stage_binary()?;
        if !bin.exists() {
            bail!(
                "stage binary {} not found (build it with `cargo build --release`)",
                bin.display()
            );
        }
        let n = cfg.pipeline.stages.len();
        let p = &cfg.pipeline;
        let args = p
            .stages
            .iter()
            .enumerate()
            .map(|(i, s)| {
                vec![
                    "--model-dir".into(),
                    p.model_dir.display().to_string(),
                    "--stage-index".into(),
                    i.to_string(),
                    "--num-stages".into(),
                    n.to_string(),
                    "--layers".into(),
                    format!("{}..{}", s.layers[0], s.layers[1]),
                    "--listen".into(),
                    "tcp://127.0.0.1:0".into(),
                    "--policy".into(),
                    p.policy.display().to_string(),
                    "--threads".into(),
                    p.threads_per_stage.to_string(),
                    "--token-budget".into(),
                    p.token_budget.to_string(),
                    "--max-inputs".into(),
                    cfg.server.max_inputs.to_string(),
                    "--exit-with-stdin".into(),
                ]
            })
            .collect();
        let spawner = std::sync::Arc::new(Spawner {
            bin,
            args,
            ready_timeout: Duration::from_secs(p.connect_timeout_secs),
        });
        let mut started = Vec::new();
        for i in 0..n {
            started.push(spawner.spawn(i)?);
        }
        let mut endpoints = Vec::new();
        let mut procs = Vec::new();
        for (i, (mut child, mut lines)) in started.into_iter().enumerate() {
            endpoints.push(spawner.ready(i, &mut child, &mut lines).await?);
            procs.push((child, lines));
        }
        let (shutdown, _) = watch::channel(false);
        let (restarts, rx) = mpsc::channel(16);
        let tasks = procs
            .into_iter()
            .enumerate()
            .map(|(i, proc)| {
                tokio::spawn(keep_running(
                    i,
                    proc,
                    spawner.clone(),
                    shutdown.subscribe(),
                    restarts.clone(),
                ))
            })
            .collect();
        Ok((
            Self {
                endpoints,
                shutdown,
                tasks,
            },
            rx,
        ))
    }

    /// Stops the stages: closes their stdin, waits briefly, then kills.
    pub async fn stop(self) {
        let _ = self.shutdown.send(true);
        for t in self.tasks {
            let _ = t.await;
        }
    }
}

/// Owns one stage process: drains its stdout, restarts it when it dies,
/// stops it on shutdown.
async fn keep_running(
    i: usize,
    proc: (Child, Lines<BufReader<ChildStdout>>),
    spawner: std::sync::Arc<Spawner>,
    mut shutdown: watch::Receiver<bool>,
    restarts: mpsc::Sender<Restarted>,
) {
    let (mut child, mut lines) = proc;
    // Held here, not in `child`: `Child::wait` closes the child's stdin,
    // which would tell the stage to exit.
    let mut stdin = child.stdin.take();
    let mut backoff = Duration::from_secs(1);
    loop {
        tokio::select! {
            status = child.wait() => {
                tracing::error!(stage = i, ?status, "stage exited unexpectedly; restarting it");
            }
            _ = async { while lines.next_line().await.ok().flatten().is_some() {} std::future::pending::<()>().await } => unreachable!(),
            _ = shutdown.changed() => {
                drop(stdin.take());
                match tokio::time::timeout(Duration::from_secs(5), child.wait()).await {
                    Ok(_) => tracing::info!(stage = i, "stage stopped"),
                    Err(_) => {
                        tracing::warn!(stage = i, "stage did not stop; killing it");
                        let _ = child.kill().await;
                    }
                }
                return;
            }
        }
        loop {
            tokio::select! {
                _ = tokio::time::sleep(backoff) => {}
                _ = shutdown.changed() => return,
            }
            backoff = (backoff * 2).min(Duration::from_secs(30));
            let attempt = async {
                let (mut c, mut l) = spawner.spawn(i)?;
                let ep = spawner.ready(i, &mut c, &mut l).await?;
                Ok::<_, anyhow::Error>((c, l, ep))
            };
            match attempt.await {
                Ok((mut c, l, ep)) => {
                    stdin = c.stdin.take();
                    child = c;
                    lines = l;
                    backoff = Duration::from_secs(1);
                    let _ = restarts.send((i, ep)).await;
                    break;
                }
                Err(e) => tracing::error!(stage = i, error = %e, "restarting the stage failed"),
            }
        }
    }
}
