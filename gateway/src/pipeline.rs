//! The pipeline orchestrator: attests every stage against the policy,
//! builds the data path gateway → stage 0 → … → exit stage → gateway,
//! dispatches requests and routes results back to their callers. When any
//! stage channel breaks, pending requests fail with 503 and the pipeline is
//! rebuilt as soon as the stages answer again.

use proto::attestation::{mock_measurement, EvidenceFormat, Measurement};
use proto::channel::{
    self, ChannelError, ChannelLimits, ChannelReceiver, ChannelSender, LocalIdentity, PeerInfo,
};
use proto::digest::Sha256Digest;
use proto::frames::{
    BatchItem, ConfigureOutcome, EmbedRequest, ErrorKind, HostMessage, PipelineError, ResultMessage,
};
use proto::manifest::LoadedManifest;
use proto::policy::Policy;
use proto::transport::{self, Endpoint};
use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex as StdMutex};
use std::time::Duration;
use tokio::sync::{oneshot, Mutex, Notify};

/// What the pipeline needs to know about its stages.
#[derive(Clone, Debug)]
pub struct StageTarget {
    /// Where the stage listens.
    pub endpoint: Endpoint,
    /// Layers it must claim.
    pub layers: [u32; 2],
}

/// Embeddings of one request, in input order.
#[derive(Debug)]
pub struct EmbedOutput {
    /// One vector per input.
    pub vectors: Vec<Vec<f32>>,
    /// Tokens per input, from the entry stage's tokenizer.
    pub tokens: Vec<u32>,
}

/// Why connecting the pipeline failed.
#[derive(Debug, Clone)]
pub struct ConnectError {
    /// A stage was reached but its evidence or claims were refused.
    pub rejected: bool,
    /// What happened, naming the stage.
    pub reason: String,
}

impl ConnectError {
    fn unreachable(reason: String) -> Self {
        Self {
            rejected: false,
            reason,
        }
    }
}

/// Why a request failed.
#[derive(Debug, Clone)]
pub enum Failure {
    /// The pipeline is not ready (503).
    NotReady(String),
    /// The request took too long (504).
    Timeout,
    /// A stage reported an error for this request.
    Stage(PipelineError),
}

struct Pending {
    vectors: Vec<Option<Vec<f32>>>,
    tokens: Vec<u32>,
    remaining: usize,
    done: oneshot::Sender<Result<EmbedOutput, Failure>>,
}

/// Attestation summary of one connected stage.
#[derive(Clone, Debug, serde::Serialize)]
pub struct StageStatus {
    /// Stage index.
    pub index: u32,
    /// Layer range.
    pub layers: [u32; 2],
    /// `mock` or `nitro`.
    pub evidence: &'static str,
    /// Pinned form of its measurement.
    pub measurement: String,
    /// Endpoint.
    pub endpoint: String,
}

struct Connected {
    entry: Arc<Mutex<ChannelSender>>,
    /// Host channels to the other stages, held open while connected and
    /// dropped (closing them) when the pipeline breaks.
    _others: Vec<ChannelSender>,
    stages: Vec<StageStatus>,
    epoch: u64,
}

/// The orchestrator.
pub struct Pipeline {
    targets: StdMutex<Vec<StageTarget>>,
    policy: Policy,
    local_measurement: Option<Measurement>,
    /// Model id from the manifest.
    pub model_id: String,
    /// Width of the model's output vectors (from its verified `config.json`).
    pub dimension: usize,
    /// Manifest digest the stages must claim.
    pub manifest_digest: Sha256Digest,
    connected: StdMutex<Option<Connected>>,
    not_ready_reason: StdMutex<String>,
    pending: StdMutex<HashMap<u64, Pending>>,
    next_id: AtomicU64,
    epoch: AtomicU64,
    broken: Notify,
    limits: ChannelLimits,
}

impl Pipeline {
    /// A pipeline over `targets`. `stage_binary`, when known, gives the
    /// local-build measurement that `trust_local_build` accepts.
    pub fn new(
        targets: Vec<StageTarget>,
        policy: Policy,
        manifest: &LoadedManifest,
        stage_binary: Option<&std::path::Path>,
    ) -> anyhow::Result<Arc<Self>> {
        let local_measurement = match stage_binary {
            Some(p) if p.exists() => Some(mock_measurement(
                &Sha256Digest::of_file(p)?,
                &manifest.digest,
            )),
            _ => None,
        };
        let cfg_path = manifest.verified_path("config.json")?;
        let cfg: serde_json::Value = serde_json::from_slice(&std::fs::read(&cfg_path)?)?;
        let dimension = cfg["hidden_size"]
            .as_u64()
            .ok_or_else(|| anyhow::anyhow!("{}: no hidden_size", cfg_path.display()))?
            as usize;
        Ok(Arc::new(Self {
            dimension,
            targets: StdMutex::new(targets),
            policy,
            local_measurement,
            model_id: manifest.manifest.model_id.clone(),
            manifest_digest: manifest.digest,
            connected: StdMutex::new(None),
            not_ready_reason: StdMutex::new("pipeline is starting".into()),
            pending: StdMutex::new(HashMap::new()),
            next_id: AtomicU64::new(1),
            epoch: AtomicU64::new(0),
            broken: Notify::new(),
            limits: ChannelLimits::default(),
        }))
    }

    /// A stage now listens at `endpoint` (a restarted local stage).
    pub fn set_endpoint(&self, index: usize, endpoint: Endpoint) {
        if let Some(t) = self.targets.lock().unwrap().get_mut(index) {
            tracing::info!(stage = index, endpoint = %endpoint, "stage endpoint changed");
            t.endpoint = endpoint;
        }
    }

    /// Records why the pipeline is not serving.
    pub fn set_not_ready(&self, reason: &str) {
        *self.not_ready_reason.lock().unwrap() = reason.to_string();
    }

    /// `Ok(stages)` when serving, else why not.
    pub fn status(&self) -> Result<Vec<StageStatus>, String> {
        match &*self.connected.lock().unwrap() {
            Some(c) => Ok(c.stages.clone()),
            None => Err(self.not_ready_reason.lock().unwrap().clone()),
        }
    }

    /// Connects once; on failure says why (naming the stage) and whether the
    /// stage was reached but refused by policy (`rejected`).
    pub async fn connect(self: &Arc<Self>) -> Result<(), ConnectError> {
        let epoch = self.epoch.fetch_add(1, Ordering::SeqCst) + 1;
        let targets = self.targets.lock().unwrap().clone();
        let n = targets.len();
        let mut channels: Vec<Option<(ChannelSender, ChannelReceiver)>> =
            (0..n).map(|_| None).collect();
        let mut stages = Vec::new();
        // Exit stage first, so that each stage's next hop is already configured.
        for i in (0..n).rev() {
            let t = &targets[i];
            let stream = transport::connect(&t.endpoint).await.map_err(|e| {
                ConnectError::unreachable(format!("stage {i} at {}: {e}", t.endpoint))
            })?;
            let check = |p: &PeerInfo| self.check_stage(i as u32, n, t, p);
            let (mut tx, mut rx, peer) =
                channel::initiate(stream, &LocalIdentity::host(), self.limits, &check)
                    .await
                    .map_err(|e| ConnectError {
                        rejected: matches!(e, ChannelError::PeerRejected(_)),
                        reason: format!("stage {i} at {}: {e}", t.endpoint),
                    })?;
            let next = (i + 1 < n).then(|| targets[i + 1].endpoint.to_string());
            tx.send_msg(&HostMessage::Configure { next })
                .await
                .map_err(|e| ConnectError::unreachable(format!("stage {i}: {e}")))?;
            match rx.recv_msg::<ConfigureOutcome>().await {
                Ok(Some(ConfigureOutcome::Configured)) => {}
                Ok(Some(ConfigureOutcome::Failed(why))) => {
                    return Err(ConnectError {
                        rejected: why.contains("not accepted"),
                        reason: format!("stage {i}: {why}"),
                    })
                }
                Ok(None) => {
                    return Err(ConnectError::unreachable(format!(
                        "stage {i} closed the channel during configuration"
                    )))
                }
                Err(e) => return Err(ConnectError::unreachable(format!("stage {i}: {e}"))),
            }
            let doc = peer.document.as_ref().expect("stages are attested");
            stages.push(StageStatus {
                index: i as u32,
                layers: t.layers,
                evidence: match doc.format {
                    EvidenceFormat::Mock => "mock",
                    EvidenceFormat::Nitro => "nitro",
                },
                measurement: doc.measurement.pinned_form(),
                endpoint: t.endpoint.to_string(),
            });
            channels[i] = Some((tx, rx));
        }
        stages.reverse();
        let mut entry = None;
        let mut others = Vec::new();
        for (i, ch) in channels.into_iter().enumerate() {
            let (tx, rx) = ch.expect("every stage connected");
            let this = self.clone();
            let exit = i + 1 == n;
            tokio::spawn(async move { this.read_stage(i, rx, exit, epoch).await });
            if i == 0 {
                entry = Some(Arc::new(Mutex::new(tx)));
            } else {
                others.push(tx);
            }
        }
        *self.connected.lock().unwrap() = Some(Connected {
            entry: entry.expect("at least one stage"),
            _others: others,
            stages,
            epoch,
        });
        Ok(())
    }

    fn check_stage(
        &self,
        index: u32,
        n: usize,
        t: &StageTarget,
        p: &PeerInfo,
    ) -> Result<(), String> {
        let (Some(doc), Some(c)) = (&p.document, &p.claims) else {
            return Err("stage presented no evidence".into());
        };
        self.policy
            .check(doc, c, self.local_measurement.as_ref())
            .map_err(|e| e.to_string())?;
        if c.stage_index != index || c.num_stages as usize != n {
            return Err(format!(
                "stage {index}: claims to be stage {} of {}, expected {index} of {}",
                c.stage_index, c.num_stages, n
            ));
        }
        if [c.layer_start, c.layer_end] != t.layers {
            return Err(format!(
                "stage {index}: claims layers [{}, {}), configured [{}, {})",
                c.layer_start, c.layer_end, t.layers[0], t.layers[1]
            ));
        }
        if c.manifest_sha256 != self.manifest_digest {
            return Err(format!(
                "stage {index}: serves manifest {}, the gateway's is {}",
                c.manifest_sha256, self.manifest_digest
            ));
        }
        Ok(())
    }

    async fn read_stage(
        self: Arc<Self>,
        index: usize,
        mut rx: ChannelReceiver,
        exit: bool,
        epoch: u64,
    ) {
        loop {
            if !exit {
                // Non-exit stages send nothing after configuration; wait for close.
                let r = rx.recv().await;
                tracing::warn!(stage = index, result = ?r.map(|m| m.map(|b| b.len())), "stage channel closed");
                break;
            }
            match rx.recv_msg::<ResultMessage>().await {
                Ok(Some(m)) => self.on_result(m),
                Ok(None) => {
                    tracing::warn!(stage = index, "exit stage closed its channel");
                    break;
                }
                Err(e) => {
                    tracing::warn!(stage = index, error = %e, "exit stage channel failed");
                    break;
                }
            }
        }
        self.mark_broken(epoch, format!("stage {index} disconnected"));
    }

    fn mark_broken(&self, epoch: u64, reason: String) {
        {
            let mut c = self.connected.lock().unwrap();
            if c.as_ref().map(|c| c.epoch) != Some(epoch) {
                return;
            }
            *c = None;
        }
        *self.not_ready_reason.lock().unwrap() = reason.clone();
        let drained: Vec<Pending> = self
            .pending
            .lock()
            .unwrap()
            .drain()
            .map(|(_, p)| p)
            .collect();
        tracing::warn!(reason = %reason, failed_requests = drained.len(), "pipeline broken");
        for p in drained {
            let _ = p.done.send(Err(Failure::NotReady(reason.clone())));
        }
        self.broken.notify_one();
    }

    fn on_result(&self, m: ResultMessage) {
        match m {
            ResultMessage::Embeddings {
                request_id,
                items,
                vectors,
                ..
            } => {
                let mut pending = self.pending.lock().unwrap();
                let Some(p) = pending.get_mut(&request_id) else {
                    tracing::debug!(
                        request_id,
                        "result for a request no longer waiting; dropped"
                    );
                    return;
                };
                let values = match vectors.to_f32() {
                    Ok(v) => v,
                    Err(e) => {
                        let p = pending.remove(&request_id).expect("present");
                        let _ = p.done.send(Err(Failure::Stage(internal(format!(
                            "bad result frame: {e}"
                        )))));
                        return;
                    }
                };
                let dim = if items.is_empty() {
                    0
                } else {
                    values.len() / items.len()
                };
                if !fill(p, &items, &values, dim) {
                    let p = pending.remove(&request_id).expect("present");
                    let _ = p.done.send(Err(Failure::Stage(internal(
                        "inconsistent result frame".into(),
                    ))));
                    return;
                }
                if p.remaining == 0 {
                    let p = pending.remove(&request_id).expect("present");
                    let out = EmbedOutput {
                        vectors: p.vectors.into_iter().map(|v| v.expect("filled")).collect(),
                        tokens: p.tokens,
                    };
                    let _ = p.done.send(Ok(out));
                }
            }
            ResultMessage::Failed { request_id, error } => {
                if let Some(p) = self.pending.lock().unwrap().remove(&request_id) {
                    let _ = p.done.send(Err(Failure::Stage(error)));
                }
            }
        }
    }

    /// Embeds `inputs` through the pipeline.
    pub async fn embed(
        &self,
        inputs: Vec<String>,
        timeout: Duration,
    ) -> Result<EmbedOutput, Failure> {
        let entry = match &*self.connected.lock().unwrap() {
            Some(c) => c.entry.clone(),
            None => {
                return Err(Failure::NotReady(
                    self.not_ready_reason.lock().unwrap().clone(),
                ))
            }
        };
        let request_id = self.next_id.fetch_add(1, Ordering::Relaxed);
        let n = inputs.len();
        let (done, wait) = oneshot::channel();
        self.pending.lock().unwrap().insert(
            request_id,
            Pending {
                vectors: vec![None; n],
                tokens: vec![0; n],
                remaining: n,
                done,
            },
        );
        let _guard = PendingGuard {
            pipeline: self,
            request_id,
        };
        let msg = HostMessage::Embed(EmbedRequest { request_id, inputs });
        if let Err(e) = entry.lock().await.send_msg(&msg).await {
            return Err(Failure::NotReady(format!("entry stage channel: {e}")));
        }
        match tokio::time::timeout(timeout, wait).await {
            Ok(Ok(r)) => r,
            Ok(Err(_)) => Err(Failure::NotReady("pipeline dropped the request".into())),
            Err(_) => Err(Failure::Timeout),
        }
    }

    /// After the first connection: waits for a break, then reconnects until
    /// the stages answer and verify again; forever.
    pub async fn supervise_after_first(self: Arc<Self>) {
        loop {
            self.broken.notified().await;
            let mut last = String::new();
            loop {
                tokio::time::sleep(Duration::from_millis(500)).await;
                match self.connect().await {
                    Ok(()) => {
                        tracing::info!("pipeline reconnected");
                        self.log_verified();
                        break;
                    }
                    Err(e) => {
                        *self.not_ready_reason.lock().unwrap() = e.reason.clone();
                        if e.reason != last {
                            tracing::error!(reason = %e.reason, "pipeline not ready");
                            last = e.reason;
                        }
                    }
                }
            }
        }
    }

    /// Logs what was verified (called once the pipeline is up).
    pub fn log_verified(&self) {
        let st = self.status().unwrap_or_default();
        for s in &st {
            tracing::info!(
                stage = s.index,
                layers = ?s.layers,
                evidence = s.evidence,
                measurement = %s.measurement,
                "stage attested and verified against policy"
            );
        }
        if st.iter().any(|s| s.evidence == "mock") {
            tracing::warn!("MOCK ATTESTATION: stages run without enclave hardware; their evidence proves nothing");
        }
    }
}

/// Removes a request's pending entry when its caller stops waiting.
struct PendingGuard<'a> {
    pipeline: &'a Pipeline,
    request_id: u64,
}

impl Drop for PendingGuard<'_> {
    fn drop(&mut self) {
        self.pipeline
            .pending
            .lock()
            .unwrap()
            .remove(&self.request_id);
    }
}

fn internal(message: String) -> PipelineError {
    PipelineError {
        kind: ErrorKind::Internal,
        message,
    }
}

fn fill(p: &mut Pending, items: &[BatchItem], values: &[f32], dim: usize) -> bool {
    if dim == 0 || values.len() != dim * items.len() {
        return false;
    }
    for (row, item) in items.iter().enumerate() {
        let Some(slot) = p.vectors.get_mut(item.index as usize) else {
            return false;
        };
        if slot.is_some() {
            return false;
        }
        *slot = Some(values[row * dim..(row + 1) * dim].to_vec());
        p.tokens[item.index as usize] = item.tokens;
        p.remaining -= 1;
    }
    true
}
