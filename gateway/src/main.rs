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
mod shutdown;
mod timeouts;
mod tls;

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
    /// Load and validate the config (and the policy, model manifest and TLS
    /// files it names) without starting anything; exit 0 when it is valid.
    CheckConfig(CheckConfigArgs),
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

#[derive(clap::Args, Debug)]
struct CheckConfigArgs {
    /// Config file.
    #[arg(long, default_value = "config/gateway.toml")]
    config: PathBuf,
}

fn main() -> Result<()> {
    let cli = Cli::parse();
    proto::logging::init();
    let args = match cli.command {
        Some(Command::Serve(a)) => a,
        Some(Command::Client(c)) => std::process::exit(cli::run(c)),
        Some(Command::HashKey) => return hash_key(),
        Some(Command::CheckConfig(a)) => std::process::exit(check_config(&a.config)),
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

/// `gateway check-config`: `OK …` with a summary on stdout and exit 0, or
/// the error (naming the bad key) on stderr and exit 1.
fn check_config(path: &std::path::Path) -> i32 {
    match check_config_summary(path) {
        Ok((summary, effective)) => {
            println!("OK {}: {summary}", path.display());
            println!("# effective configuration (file, environment overrides, defaults):");
            print!("{effective}");
            0
        }
        Err(e) => {
            eprintln!("config error: {e:#}");
            1
        }
    }
}

fn check_config_summary(path: &std::path::Path) -> Result<(String, String)> {
    let cfg = GatewayConfig::load(path)?;
    let scheme = match &cfg.server.tls {
        Some(t) => {
            tls::load_pair(&t.cert, &t.key)
                .map_err(|e| cfg.attribute(e))
                .with_context(|| format!("config {}", path.display()))?;
            "https"
        }
        None => "http",
    };
    let metrics = std::sync::Arc::new(metrics::Metrics::default());
    let env_keys = std::env::var(auth::ENV_KEYS).ok();
    let keys = auth::ApiKeys::from_config(&cfg.auth, env_keys.as_deref(), metrics)
        .with_context(|| format!("config {}", path.display()))?;
    let policy = Policy::load(&cfg.pipeline.policy).map_err(|e| {
        anyhow::anyhow!(
            "config {}: {}: {e}",
            path.display(),
            cfg.key("pipeline.policy")
        )
    })?;
    let manifest = LoadedManifest::load(&cfg.pipeline.model_dir).map_err(|e| {
        anyhow::anyhow!(
            "config {}: {}: {}: {e}",
            path.display(),
            cfg.key("pipeline.model_dir"),
            cfg.pipeline.model_dir.display()
        )
    })?;
    if cfg.pipeline.launch == Launch::Local {
        let bin = cfg.stage_binary()?;
        if !bin.exists() {
            anyhow::bail!(
                "config {}: {}: {} does not exist",
                path.display(),
                cfg.key("pipeline.stage_binary"),
                bin.display()
            );
        }
    }
    let auth = if keys.enabled() {
        format!("auth on ({} keys)", keys.len())
    } else {
        "auth off".to_string()
    };
    let summary = format!(
        "{scheme}://{}, model {}, {} stages ({}), {auth}, policy {}{}",
        cfg.server.listen,
        manifest.manifest.model_id,
        cfg.pipeline.stages.len(),
        match cfg.pipeline.launch {
            Launch::Local => "local",
            Launch::Remote => "remote",
        },
        cfg.pipeline.policy.display(),
        if policy.allow_mock {
            " (MOCK attestation allowed)"
        } else {
            ""
        },
    );
    Ok((summary, cfg.effective_toml()))
}

/// How long connections may stay open after the shutdown deadline (for the
/// cancelled requests' answers to be written) before they are dropped.
const CLOSE_AFTER_DEADLINE: Duration = Duration::from_secs(1);

async fn serve(args: ServeArgs) -> Result<()> {
    let mut cfg = GatewayConfig::load(&args.config)?;
    let routes = timeouts::RouteTimeouts::from_config(&cfg.server);
    if let Some(l) = args.listen {
        cfg.server.listen = l;
        cfg.check_listen()
            .with_context(|| format!("--listen {}", cfg.server.listen))?;
    }
    // Read the certificate before starting anything, so a bad one fails fast.
    let tls_cert = match &cfg.server.tls {
        Some(t) => Some(std::sync::Arc::new(
            tls::ReloadingCert::load(&t.cert, &t.key)
                .map_err(|e| cfg.attribute(e))
                .with_context(|| format!("config {}", args.config.display()))?,
        )),
        None => None,
    };
    // SIGHUP reloads the certificate (from now on, so an early one does not
    // kill the gateway with its stages).
    let mut sighup = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::hangup())?;
    let reload = tls_cert.clone();
    tokio::spawn(async move {
        while sighup.recv().await.is_some() {
            match &reload {
                Some(cert) => match cert.reload() {
                    Ok(()) => tracing::info!(
                        cert = %cert.cert_path().display(),
                        key = %cert.key_path().display(),
                        "SIGHUP: TLS certificate reloaded; new connections use it"
                    ),
                    Err(e) => tracing::error!(
                        "SIGHUP: TLS certificate reload failed, keeping the previous certificate: {e:#}"
                    ),
                },
                None => tracing::info!("SIGHUP: no [server.tls] configured, nothing to reload"),
            }
        }
    });
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
    let shutdown = shutdown::Shutdown::new(Duration::from_secs(cfg.server.shutdown_grace_secs));
    let state = api::AppState {
        pipeline: pipeline.clone(),
        limits: api::ApiLimits {
            max_body_bytes: cfg.server.max_body_bytes,
            timeout: routes.for_route(timeouts::EMBEDDINGS),
            routes: std::sync::Arc::new(routes),
        },
        receipts: std::sync::Arc::new(receipts::ReceiptStore::new(cfg.server.receipt_retention)),
        gateway_key: std::sync::Arc::new(api::GatewayKey::generate()),
        auth: std::sync::Arc::new(api_keys),
        metrics,
        shutdown: shutdown.clone(),
    };
    let listener = tokio::net::TcpListener::bind(&cfg.server.listen)
        .await
        .with_context(|| format!("binding {}", cfg.server.listen))?;
    let addr = listener.local_addr()?;
    // Registered before we announce ourselves, so an early Ctrl-C or SIGTERM
    // is a clean shutdown rather than the default kill.
    let on_signal = shutdown.on_signal()?;
    let router = api::router(state);
    let served = async {
        match tls_cert {
            Some(cert) => {
                let config = std::sync::Arc::new(tls::server_config(cert)?);
                let listener = tls::TlsListener::new(listener, config)?;
                tracing::info!(address = %addr, model = %pipeline.model_id, "gateway listening (TLS; HTTP/1.1 and HTTP/2)");
                println!("GATEWAY LISTENING https://{addr}");
                axum::serve(listener, router)
                    .with_graceful_shutdown(on_signal)
                    .await?;
            }
            None => {
                tracing::info!(address = %addr, model = %pipeline.model_id, "gateway listening");
                println!("GATEWAY LISTENING http://{addr}");
                axum::serve(listener, router)
                    .with_graceful_shutdown(on_signal)
                    .await?;
            }
        }
        Ok::<_, anyhow::Error>(())
    };
    // The server returns once every connection is closed. Requests still
    // running at the deadline are answered 503 by `shutdown::guard`; a
    // connection that is still open a moment later (a client that does not
    // read its answer) is dropped.
    let hard_stop = async {
        shutdown.expired().await;
        tokio::time::sleep(CLOSE_AFTER_DEADLINE).await;
    };
    tokio::select! {
        r = served => r?,
        _ = hard_stop => tracing::warn!("connections still open after the shutdown deadline; closing them"),
    }
    pipeline.close().await;
    if let Some(s) = stages {
        s.stop().await;
    }
    tracing::info!("stopped");
    Ok(())
}
