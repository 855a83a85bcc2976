//! Starts the stages as local child processes (the embedded default) and
//! keeps them running: a stage that dies is started again (with backoff)
//! and its new endpoint is reported, so the pipeline can reconnect without
//! restarting the gateway.
//!
//! Each stage gets a piped stdin and `--exit-with-stdin`, so it can never
//! outlive the gateway; it reports its bound endpoint on stdout.

use crate::config::{GatewayConfig, PipelineSpec};
use anyhow::{bail, Context, Result};
use proto::io::transport::Endpoint;
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
    name: &'static str,
    replica: usize,
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
            .with_context(|| {
                format!("starting {} stage {i} ({})", self.name, self.bin.display())
            })?;
        let stdout = child.stdout.take().expect("piped stdout");
        Ok((child, BufReader::new(stdout).lines()))
    }

    /// Waits for the stage's `LISTENING` line, then drains the rest of its
    /// stdout in the background (so a chatty stage never blocks on a pipe).
    async fn ready(
        &self,
        i: usize,
        child: &mut Child,
        mut lines: Lines<BufReader<ChildStdout>>,
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
        tracing::info!(pipeline = self.name, replica = self.replica, stage = i, pid = child.id(), endpoint = %ep, "local stage started");
        tokio::spawn(async move { while let Ok(Some(_)) = lines.next_line().await {} });
        Ok(ep)
    }
}

impl LocalStages {
    /// Starts every stage of replica `replica` of the pipeline (their model
    /// loads overlap) and waits until each has loaded its model and bound
    /// its listener. Restarts are reported on the returned receiver.
    pub async fn start(
        cfg: &GatewayConfig,
        spec: &PipelineSpec,
        replica: usize,
    ) -> Result<(Self, mpsc::Receiver<Restarted>)> {
        let bin = cfg.stage_binary()?;
        if !bin.exists() {
            bail!(
                "stage binary {} not found (build it with `cargo build --release`)",
                bin.display()
            );
        }
        let n = spec.stages.len();
        let p = &cfg.pipeline;
        let args = spec
            .stages
            .iter()
            .enumerate()
            .map(|(i, s)| {
                let mut a: Vec<String> = vec![
                    "--model-dir".into(),
                    spec.model_dir.display().to_string(),
                    "--stage-index".into(),
                    i.to_string(),
                    "--num-stages".into(),
                    n.to_string(),
                    "--layers".into(),
                    format!("{}..{}", s.layers[0], s.layers[1]),
                    "--listen".into(),
                    "tcp://127.0.0.1:0".into(),
                    "--policy".into(),
                    spec.policy.display().to_string(),
                    "--threads".into(),
                    spec.threads.to_string(),
                    "--exit-with-stdin".into(),
                ];
                a.extend(spec.stage_args.iter().cloned());
                a
            })
            .collect();
        let spawner = std::sync::Arc::new(Spawner {
            name: spec.name,
            replica,
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
        for (i, (mut child, lines)) in started.into_iter().enumerate() {
            endpoints.push(spawner.ready(i, &mut child, lines).await?);
            procs.push(child);
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

/// Owns one stage process: restarts it when it dies, stops it on shutdown.
async fn keep_running(
    i: usize,
    mut child: Child,
    spawner: std::sync::Arc<Spawner>,
    mut shutdown: watch::Receiver<bool>,
    restarts: mpsc::Sender<Restarted>,
) {
    // Held here, not in `child`: `Child::wait` closes the child's stdin,
    // which would tell the stage to exit.
    let mut stdin = child.stdin.take();
    let mut backoff = Duration::from_secs(1);
    loop {
        tokio::select! {
            status = child.wait() => {
                tracing::error!(pipeline = spawner.name, replica = spawner.replica, stage = i, ?status, "stage exited unexpectedly; restarting it");
            }
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
                let (mut c, l) = spawner.spawn(i)?;
                let ep = spawner.ready(i, &mut c, l).await?;
                Ok::<_, anyhow::Error>((c, ep))
            };
            match attempt.await {
                Ok((mut c, ep)) => {
                    stdin = c.stdin.take();
                    child = c;
                    backoff = Duration::from_secs(1);
                    let _ = restarts.send((i, ep)).await;
                    break;
                }
                Err(e) => {
                    tracing::error!(pipeline = spawner.name, stage = i, error = %e, "restarting the stage failed")
                }
            }
        }
    }
}
