//! `gateway`: the host-side binary. `gateway serve` reads
//! `config/gateway.toml`, starts (or connects to) the attested stages,
//! verifies them against the policy and serves the OpenAI-compatible API.
//! The client verbs (`verify`, `seal`, `open`, `proxy`) are in [`cli`].

mod api;
mod auth;
mod cli;
mod config;
mod launcher;
mod metrics;
mod openai_error;
mod pipeline;
mod receipts;

use anyhow::{Context, Result};
use clap::{Parser, Subcommand};
use config::{GatewayConfig, Launch};
use pipeline::{Pipeline, StageTarget};
use proto::manifest::LoadedManifest;
use proto::policy::Policy;
use std::path::PathBuf;
use std::time::Duration;

#[derive(Parser, Debug)]
#[command(
    version,
    about = "Confidential inference gateway (OpenAI-compatible API over attested stages)"
)]
struct Cli {
    #[command(subcommand)]
    command: Option<Command>,
}

#[derive(Subcommand, Debug)]
#[allow(clippy::large_enum_variant)] // parsed once at start
enum Command {
    /// Start the stages (local launch) or connect to them, verify them, and serve the API.
    Serve(ServeArgs),
    /// Print the SHA-256 (hex) of an API token read from stdin, for `[[auth.keys]] sha256`.
    HashKey,
    #[command(flatten)]
    Client(cli::ClientCommand),
}

#[derive(clap::Args, Debug, Default)]
struct ServeArgs {
    /// Config file.
    #[arg(long, default_value = "config/gateway.toml")]
    config: PathBuf,
    /// Override `server.listen`.
    #[arg(long)]
    listen: Option<String>,
}

fn main() -> Result<()> {
    let cli = Cli::parse();
    tracing_subscriber::fmt()
        .with_writer(std::io::stderr)
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env().unwrap_or_else(|_| "info".into()),
        )
        .init();
    let args = match cli.command {
        Some(Command::Serve(a)) => a,
        Some(Command::Client(c)) => std::process::exit(cli::run(c)),
        Some(Command::HashKey) => return hash_key(),
        None => ServeArgs {
            config: "config/gateway.toml".into(),
            listen: None,
        },
    };
    tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()?
        .block_on(serve(args))
}

/// `gateway hash-key`: one token on stdin (a trailing newline is ignored).
fn hash_key() -> Result<()> {
    use std::io::Read;
    let mut token = String::new();
    std::io::stdin()
        .read_to_string(&mut token)
        .context("reading the token from stdin")?;
    let token = token.trim_end_matches(['\n', '\r']);
    if token.is_empty() {
        anyhow::bail!("no token on stdin");
    }
    println!("{}", hex::encode(auth::digest(token.as_bytes())));
    Ok(())
}

async fn serve(args: ServeArgs) -> Result<()> {
    let mut cfg = GatewayConfig::load(&args.config)?;
    if let Some(l) = args.listen {
        cfg.server.listen = l;
    }
    let metrics = std::sync::Arc::new(metrics::Metrics::default());
    let env_keys = std::env::var(auth::ENV_KEYS).ok();
    let api_keys = auth::ApiKeys::from_config(&cfg.auth, env_keys.as_deref(), metrics.clone())?;
    if api_keys.enabled() {
        tracing::info!(
            keys = api_keys.len(),
            "API keys required on /v1/embeddings, /v1/models, /v1/receipts"
        );
    } else {
        if env_keys.is_some() {
            tracing::warn!(
                "{} is set but auth.enabled = false: keys are not checked",
                auth::ENV_KEYS
            );
        }
        tracing::warn!("auth.enabled = false: the API is open to anyone who can reach it");
    }
    let policy = Policy::load(&cfg.pipeline.policy).map_err(anyhow::Error::msg)?;
    let manifest = LoadedManifest::load(&cfg.pipeline.model_dir)
        .context("model not found: run scripts/setup.sh first")?;
    if policy.allow_mock {
        tracing::warn!(
            "MOCK ATTESTATION ALLOWED by policy {}: stage evidence from the public mock key is accepted; \
             this deployment proves nothing to clients",
            cfg.pipeline.policy.display()
        );
    }
    let (stages, endpoints, restarts) = match cfg.pipeline.launch {
        Launch::Local => {
            let (s, restarts) = launcher::LocalStages::start(&cfg).await?;
            let eps = s.endpoints.clone();
            (Some(s), eps, Some(restarts))
        }
        Launch::Remote => {
            let eps = cfg
                .pipeline
                .stages
                .iter()
                .map(|s| s.address.as_deref().unwrap_or_default().parse())
                .collect::<Result<Vec<_>, String>>()
                .map_err(anyhow::Error::msg)?;
            (None, eps, None)
        }
    };
    let targets: Vec<StageTarget> = endpoints
        .into_iter()
        .zip(&cfg.pipeline.stages)
        .map(|(endpoint, s)| StageTarget {
            endpoint,
            layers: s.layers,
        })
        .collect();
    // Only a binary the gateway launches itself can stand for "the local build".
    let stage_binary = match cfg.pipeline.launch {
        Launch::Local => cfg.stage_binary().ok(),
        Launch::Remote => None,
    };
    let pipeline = Pipeline::new(targets, policy, &manifest, stage_binary.as_deref())?;
    let connect_timeout = Duration::from_secs(cfg.pipeline.connect_timeout_secs);
    // Wait for the first verified connection before listening.
    let first = tokio::time::timeout(connect_timeout, async {
        loop {
            match pipeline.connect().await {
                Ok(()) => return Ok(()),
                Err(e) if e.rejected => return Err(e.reason),
                Err(e) => {
                    pipeline.set_not_ready(&e.reason);
                    tokio::time::sleep(Duration::from_millis(200)).await
                }
            }
        }
    })
    .await;
    match first {
        Ok(Ok(())) => {}
        Ok(Err(e)) => {
            if let Some(s) = stages {
                s.stop().await;
            }
            anyhow::bail!("refusing to serve: {e}");
        }
        Err(_) => {
            let reason = pipeline.status().err().unwrap_or_default();
            if let Some(s) = stages {
                s.stop().await;
            }
            anyhow::bail!("stages did not become ready in time: {reason}");
        }
    }
    pipeline.log_verified();
    if let Some(mut restarts) = restarts {
        let p = pipeline.clone();
        tokio::spawn(async move {
            while let Some((i, ep)) = restarts.recv().await {
                p.set_endpoint(i, ep);
            }
        });
    }
    tokio::spawn(pipeline.clone().supervise_after_first());
    let state = api::AppState {
        pipeline: pipeline.clone(),
        limits: api::ApiLimits {
            max_body_bytes: cfg.server.max_body_bytes,
            timeout: Duration::from_secs(cfg.server.request_timeout_secs),
        },
        receipts: std::sync::Arc::new(receipts::ReceiptStore::new(cfg.server.receipt_retention)),
        gateway_key: std::sync::Arc::new(api::GatewayKey::generate()),
        auth: std::sync::Arc::new(api_keys),
        metrics,
    };
    let listener = tokio::net::TcpListener::bind(&cfg.server.listen)
        .await
        .with_context(|| format!("binding {}", cfg.server.listen))?;
    let addr = listener.local_addr()?;
    // Registered before we announce ourselves, so an early Ctrl-C or SIGTERM
    // is a clean shutdown rather than the default kill.
    use tokio::signal::unix::{signal, SignalKind};
    let mut sigint = signal(SignalKind::interrupt())?;
    let mut sigterm = signal(SignalKind::terminate())?;
    tracing::info!(address = %addr, model = %pipeline.model_id, "gateway listening");
    println!("GATEWAY LISTENING http://{addr}");
    axum::serve(listener, api::router(state))
        .with_graceful_shutdown(async move {
            tokio::select! {
                _ = sigint.recv() => {}
                _ = sigterm.recv() => {}
            }
            tracing::info!("shutting down");
        })
        .await?;
    if let Some(s) = stages {
        s.stop().await;
    }
    tracing::info!("stopped");
    Ok(())
}
