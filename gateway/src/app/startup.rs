//! `gateway serve`: loads the config, opens the receipt store, starts (or
//! finds) every model's replicas of attested stages, builds the inference
//! service and the HTTP API over it, and serves until shut down.

use super::ServeArgs;
use crate::config::{GatewayConfig, Launch};
use crate::pipeline::{discovery, Pipeline, Replicas, StageTarget};
use crate::{
    api, auth, config, launcher, metrics, own_model, receipt_store, serve, service, shutdown,
    telemetry, timeouts, tls,
};
use anyhow::{Context, Result};
use proto::manifest::LoadedManifest;
use proto::policy::Policy;
use std::time::Duration;

/// How long connections may stay open after the shutdown deadline (for the
/// cancelled requests' answers to be written) before they are dropped.
const CLOSE_AFTER_DEADLINE: Duration = Duration::from_secs(1);

/// Runs `gateway serve` to its end.
pub(super) async fn serve(args: ServeArgs) -> Result<()> {
    let mut cfg = GatewayConfig::load(&args.config)?;
    let routes = timeouts::RouteTimeouts::from_config(&cfg.server);
    if let Some(l) = args.listen {
        cfg.server.listen = l;
        cfg.check_listen()
            .with_context(|| format!("--listen {}", cfg.server.listen))?;
    }
    if let Some(path) = &args.model {
        let model = own_model::GgufModel::inspect(path)?;
        // `--stages`, else `--stage-memory`, else `[completions]
        // stage_memory`, else 2 stages.
        let configured = cfg
            .completions
            .as_ref()
            .and_then(|c| c.stage_memory.clone());
        let layers = match (
            args.stages,
            args.stage_memory.as_ref().or(configured.as_ref()),
        ) {
            (Some(n), _) => own_model::split_layers(model.layers, n).context("--stages")?,
            (None, Some(memory)) => {
                let c = cfg.completions.clone();
                own_model::planned_layers(&model, memory, c.as_ref())
                    .with_context(|| format!("stage memory {memory}"))?
            }
            (None, None) => own_model::split_layers(model.layers, 2.min(model.layers as usize))?,
        };
        let c = own_model::completions(&cfg, &model, &layers, &args.model_cache)
            .with_context(|| format!("--model {}", path.display()))?;
        cfg.replace_completions(c)
            .with_context(|| format!("--model {}", path.display()))?;
        tracing::info!(
            model = %model.model_id,
            architecture = %model.architecture,
            sha256 = %model.sha256.hex(),
            stages = ?layers,
            "serving --model as the completions pipeline"
        );
    }
    if let Some(dir) = &args.embedding_model {
        let model = own_model::EmbeddingModel::inspect(dir)?;
        let stages = args
            .embedding_stages
            .unwrap_or(2.min(model.layers as usize));
        let layers = own_model::split_layers(model.layers, stages).context("--embedding-stages")?;
        own_model::embeddings(&mut cfg, &model, &layers, &args.model_cache)
            .with_context(|| format!("--embedding-model {}", dir.display()))?;
        tracing::info!(
            model = %model.model_id,
            architecture = %model.architecture,
            stages = ?layers,
            "serving --embedding-model as the embeddings pipeline"
        );
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
            "API keys required on /v1/embeddings, /v1/chat/completions, /v1/completions, /v1/models, /v1/receipts"
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
    if policy.allow_mock {
        tracing::warn!(
            "MOCK ATTESTATION ALLOWED by policy {}: stage evidence from the public mock key is accepted; \
             this deployment proves nothing to clients",
            cfg.pipeline.policy.display()
        );
    }
    if policy.allow_debug {
        tracing::warn!(
            "NITRO DEBUG-MODE ENCLAVES ALLOWED by policy {} (allow_debug = true, build-eif.sh --debug-policy): \
             their memory is readable by this parent; for a first bring-up only",
            cfg.pipeline.policy.display()
        );
    }
    // The receipt store first: a database that cannot be reached stops the
    // start before any stage is launched.
    let receipt_store =
        receipt_store::ReceiptStore::open(&cfg.receipts, cfg.server.receipt_retention).await?;
    tracing::info!(store = receipt_store.kind(), "receipt store open");
    // The transparency log too: a folder that cannot be read stops the start.
    let transparency = match &cfg.transparency {
        Some(t) => {
            let log = t
                .open()
                .with_context(|| format!("transparency log {}", t.dir.display()))?;
            tracing::info!(dir = %t.dir.display(), size = log.size(), vkey = %log.vkey(), "transparency log open");
            Some(std::sync::Arc::new(std::sync::Mutex::new(log)))
        }
        None => None,
    };
    let specs = cfg.pipelines();
    let mut policies = Vec::new();
    for s in &specs {
        policies.push(
            Policy::load(&s.policy)
                .map_err(|e| anyhow::anyhow!("{} policy {}: {e}", s.name, s.policy.display()))?,
        );
    }
    // Stages found through DNS: the first pairing into replica slots.
    let mut slots = Vec::new();
    for s in &specs {
        slots.push(match &s.discovery {
            Some(names) => Some(
                discovery::first_slots(
                    names,
                    s.replicas,
                    Duration::from_secs(cfg.pipeline.connect_timeout_secs),
                )
                .await
                .with_context(|| s.name)?,
            ),
            None => None,
        });
    }
    // The pipelines (every replica of each) load their models at the same time.
    let started = futures_util::future::join_all(specs.iter().zip(&policies).zip(&slots).flat_map(
        |((s, policy), slots)| {
            (0..s.replicas).map(|r| start_pipeline(&cfg, s, policy, r, slots.as_ref()))
        },
    ))
    .await;
    let mut ok = Vec::new();
    let mut first_error = None;
    for r in started {
        match r {
            Ok(s) => ok.push(s),
            Err(e) => {
                first_error.get_or_insert(e);
            }
        }
    }
    if let Some(e) = first_error {
        for s in ok {
            if let Some(st) = s.stages {
                st.stop().await;
            }
        }
        return Err(e);
    }
    let mut stages = Vec::new();
    let mut pipelines = Vec::new();
    for s in ok {
        stages.extend(s.stages);
        pipelines.push(s.pipeline);
    }
    // Each model's replicas, in the order started (specs in order, replica 0 first).
    let mut models = Vec::new();
    let mut members = pipelines.iter().cloned();
    for s in &specs {
        models.push(Replicas::new(members.by_ref().take(s.replicas).collect()));
    }
    for ((s, model), slots) in specs.iter().zip(&models).zip(slots) {
        if let (Some(names), Some(slots)) = (&s.discovery, slots) {
            wait_for_a_replica(&cfg, s, model).await?;
            tokio::spawn(discovery::run(
                model.members().to_vec(),
                names.clone(),
                slots,
                Duration::from_secs(cfg.pipeline.discovery_secs.max(1)),
            ));
        }
    }
    let mut witnessing = None;
    if let (Some(log), Some(t)) = (&transparency, &cfg.transparency) {
        if t.log_local_build {
            crate::transparency::releases::log_local_builds(log, &pipelines)
                .context("logging the local build's releases")?;
        }
        if !t.witnesses.is_empty() {
            // Cosigned before the first bundle is served; then kept so.
            let w = std::sync::Arc::new(crate::transparency::witnessing::Witnessing::new(
                log.clone(),
                &t.witnesses,
            )?);
            let n = w.round().await;
            tracing::info!(
                cosigned = n,
                witnesses = t.witnesses.len(),
                "transparency log witnessed"
            );
            tokio::spawn(w.clone().run(Duration::from_secs(t.witness_interval_secs)));
            witnessing = Some(w);
        }
    }
    let pipeline = models[0].clone();
    let completions = models.get(1).cloned();
    let shutdown = shutdown::Shutdown::new(Duration::from_secs(cfg.server.shutdown_grace_secs));
    let gateway_key = std::sync::Arc::new(service::GatewayKey::rotating(cfg.keys.rotation()));
    tokio::spawn(gateway_key.clone().run());
    // An answer holds its in-flight permit at most this long.
    let longest_route = routes
        .for_route(timeouts::COMPLETIONS)
        .max(routes.for_route(timeouts::EMBEDDINGS));
    let routes = std::sync::Arc::new(routes);
    let receipt_log = match (&transparency, &cfg.transparency) {
        (Some(log), Some(t)) if t.log_receipts => {
            Some(crate::transparency::receipts::ReceiptLogger::spawn(
                log.clone(),
                Duration::from_millis(t.receipt_batch_ms),
            ))
        }
        _ => None,
    };
    let service = std::sync::Arc::new(service::Service {
        receipt_log,
        embeddings: pipeline.clone(),
        completions,
        gateway_key,
        receipts: std::sync::Arc::new(receipt_store),
        metrics: metrics.clone(),
        timeout: routes.for_route(timeouts::EMBEDDINGS),
        routes: routes.clone(),
    });
    let state = api::AppState {
        service,
        limits: api::ApiLimits {
            max_body_bytes: cfg.server.max_body_bytes,
            routes,
        },
        auth: std::sync::Arc::new(api_keys),
        metrics,
        shutdown: shutdown.clone(),
        attestation: std::sync::Arc::new(crate::attestation_limits::AttestationLimits::new(
            cfg.server.attestation_per_minute,
            Duration::from_secs(cfg.server.attestation_cache_secs),
        )),
        in_flight: crate::in_flight::InFlightCap::new(cfg.server.max_in_flight, longest_route),
        transparency,
        witnessing,
    };
    let listener = serve::bind(&cfg.server.listen, cfg.server.send_buffer_bytes)
        .await
        .with_context(|| format!("binding {}", cfg.server.listen))?;
    let addr = listener.local_addr()?;
    // Registered before we announce ourselves, so an early Ctrl-C or SIGTERM
    // is a clean shutdown rather than the default kill.
    let on_signal = shutdown.on_signal()?;
    let router = api::router(state);
    let limits = serve::ServeLimits {
        max_connections: cfg.server.max_connections,
        header_read_timeout: Duration::from_secs(cfg.server.header_read_timeout_secs),
    };
    let served = async {
        match tls_cert {
            Some(cert) => {
                let config = std::sync::Arc::new(tls::server_config(cert)?);
                let listener = tls::TlsListener::new(listener, config)?;
                tracing::info!(address = %addr, model = %pipeline.model_id(), "gateway listening (TLS; HTTP/1.1 and HTTP/2)");
                println!("GATEWAY LISTENING https://{addr}");
                serve::serve(listener, router, limits, on_signal).await;
            }
            None => {
                tracing::info!(address = %addr, model = %pipeline.model_id(), "gateway listening");
                println!("GATEWAY LISTENING http://{addr}");
                serve::serve(listener, router, limits, on_signal).await;
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
    for p in &pipelines {
        p.close().await;
    }
    for s in stages {
        s.stop().await;
    }
    telemetry::shutdown();
    tracing::info!("stopped");
    Ok(())
}

/// A pipeline that is connected and verified, with its local stages.
struct StartedPipeline {
    pipeline: std::sync::Arc<Pipeline>,
    stages: Option<launcher::LocalStages>,
}

/// Starts (or finds) one pipeline's stages, waits for the first verified
/// connection, and keeps it supervised.
async fn start_pipeline(
    cfg: &GatewayConfig,
    spec: &config::PipelineSpec,
    policy: &Policy,
    replica: usize,
    slots: Option<&discovery::Slots>,
) -> Result<StartedPipeline> {
    let manifest = LoadedManifest::load(&spec.model_dir).with_context(|| {
        format!(
            "{} model not found at {}: run scripts/setup.sh first",
            spec.name,
            spec.model_dir.display()
        )
    })?;
    let (stages, endpoints, restarts) = match cfg.pipeline.launch {
        Launch::Local => {
            let (s, restarts) = launcher::LocalStages::start(cfg, spec, replica).await?;
            let eps = s.endpoints.clone();
            (Some(s), eps, Some(restarts))
        }
        Launch::Remote => match slots {
            // Found through DNS: this slot's chain, or placeholders until
            // one resolves.
            Some(slots) => {
                let eps = match &slots[replica] {
                    Some(chain) => discovery::endpoints(chain),
                    None => {
                        vec![
                            proto::io::transport::Endpoint::Tcp("0.0.0.0:0".into());
                            spec.stages.len()
                        ]
                    }
                };
                (None, eps, None)
            }
            None => {
                let eps = spec
                    .stages
                    .iter()
                    .map(|s| s.address.as_deref().unwrap_or_default().parse())
                    .collect::<Result<Vec<_>, String>>()
                    .map_err(anyhow::Error::msg)?;
                (None, eps, None)
            }
        },
    };
    let targets: Vec<StageTarget> = endpoints
        .into_iter()
        .zip(&spec.stages)
        .map(|(endpoint, s)| {
            Ok(StageTarget {
                endpoint,
                layers: s.layers,
                peer: s.peer_address.as_deref().map(str::parse).transpose()?,
            })
        })
        .collect::<Result<_, String>>()
        .map_err(anyhow::Error::msg)?;
    // Only a binary the gateway launches itself can stand for "the local build".
    let stage_binary = match cfg.pipeline.launch {
        Launch::Local => cfg.stage_binary().ok(),
        Launch::Remote => None,
    };
    // Local stages are launched with the pipeline's policy file.
    let local_build = stage_binary.as_deref().map(|b| (b, spec.policy.as_path()));
    let key_ids = crate::pipeline::key_ids(replica, spec.replicas);
    let pipeline = Pipeline::new(
        targets,
        policy.clone(),
        &manifest,
        local_build,
        replica,
        key_ids,
    )?;
    if let Some(slots) = slots {
        // A slot of a discovered pipeline does not hold up the start: the
        // caller waits for any replica of the model.
        if slots[replica].is_none() {
            pipeline.set_targets(None);
        }
        pipeline.retry_soon();
        tokio::spawn(pipeline.clone().supervise_after_first());
        return Ok(StartedPipeline {
            pipeline,
            stages: None,
        });
    }
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
    let failed = match first {
        Ok(Ok(())) => None,
        Ok(Err(e)) => Some(format!("refusing to serve {}: {e}", spec.name)),
        Err(_) => Some(format!(
            "{} stages did not become ready in time: {}",
            spec.name,
            pipeline.status().err().unwrap_or_default()
        )),
    };
    if let Some(why) = failed {
        if let Some(s) = stages {
            s.stop().await;
        }
        anyhow::bail!(why);
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
    Ok(StartedPipeline { pipeline, stages })
}

/// Waits until some replica of a discovered pipeline is verified and
/// connected (the others keep trying in the background).
async fn wait_for_a_replica(
    cfg: &GatewayConfig,
    spec: &config::PipelineSpec,
    model: &Replicas,
) -> Result<()> {
    let deadline =
        tokio::time::Instant::now() + Duration::from_secs(cfg.pipeline.connect_timeout_secs);
    while model.ready().is_err() {
        if tokio::time::Instant::now() > deadline {
            anyhow::bail!(
                "{} stages did not become ready in time: {}",
                spec.name,
                model.not_ready_reason()
            );
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    for p in model.members() {
        if p.status().is_ok() {
            p.log_verified();
        }
    }
    Ok(())
}
