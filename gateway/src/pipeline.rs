//! The pipeline orchestrator: attests every stage against the policy,
//! builds the data path gateway → stage 0 → … → exit stage → gateway,
//! relays sealed requests and routes sealed responses back to their callers.
//! When any stage channel breaks, pending requests fail with 503 and the
//! pipeline is rebuilt as soon as the stages answer again.
//!
//! The gateway never sees plaintext on this path unless it sealed the request
//! itself (plain OpenAI clients): it holds no key of the stages.

use proto::attestation::{
    claims_binding, mock_measurement, verify_boot, Evidence, EvidenceFormat, EvidencePurpose,
    Measurement,
};
use proto::channel::{
    self, ChannelError, ChannelLimits, ChannelReceiver, ChannelSender, LocalIdentity, PeerInfo,
};
use proto::digest::Sha256Digest;
use proto::frames::{
    HostMessage, PipelineError, RequestTelemetry, ResultMessage, SealedRequest, StageClaims,
    StageReply, StageStats,
};
use proto::manifest::LoadedManifest;
use proto::openai::ApiEndpoint;
use proto::policy::Policy;
use proto::receipt::{ReceiptId, Sealing};
use proto::sealing::{KeyConfig, SealedHeaders};
use proto::transport::{self, Endpoint};
use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex as StdMutex};
use std::time::{Duration, Instant};
use tokio::sync::{mpsc, oneshot, Mutex, Notify};

/// What the pipeline needs to know about its stages.
#[derive(Clone, Debug)]
pub struct StageTarget {
    /// Where the stage listens.
    pub endpoint: Endpoint,
    /// Layers it must claim.
    pub layers: [u32; 2],
    /// Where the other stages reach it, when not at `endpoint` (on Nitro:
    /// the parent's host-proxy port for it, `vsock://3:PORT`).
    pub peer: Option<Endpoint>,
}

impl StageTarget {
    /// The endpoint the other stages dial to reach this stage.
    pub fn peer_endpoint(&self) -> &Endpoint {
        self.peer.as_ref().unwrap_or(&self.endpoint)
    }
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

/// Why a request failed before any stage answered it.
#[derive(Debug, Clone)]
pub enum Failure {
    /// The pipeline is not ready (503).
    NotReady(String),
    /// The request took too long (504).
    Timeout,
}

/// What the exit stage sends for a request: one `Response` or `Failed`, or
/// a stream (`StreamStart`, any number of `StreamData`, one `StreamEnd`,
/// or `Failed` if the pipeline breaks).
#[derive(Debug)]
pub enum Reply {
    /// A streamed response begins.
    StreamStart {
        /// Its receipt id.
        receipt_id: ReceiptId,
    },
    /// Sealed bytes of the stream.
    StreamData(Vec<u8>),
    /// The last sealed bytes and the receipt (none if the stream failed).
    StreamEnd {
        /// Sealed bytes.
        data: Vec<u8>,
        /// The signed receipt.
        receipt: Option<Vec<u8>>,
    },
    /// A response sealed to the client, with its receipt.
    Response {
        /// HTTP status.
        status: u16,
        /// Sealed body.
        body: Vec<u8>,
        /// Signed receipt.
        receipt: Vec<u8>,
        /// Receipt id.
        receipt_id: ReceiptId,
    },
    /// A stage refused or failed the request.
    Failed(PipelineError),
}

/// A connected, verified stage.
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
    /// Its claims (keys, layers, manifest), bound in its evidence.
    #[serde(skip)]
    pub claims: StageClaims,
    /// Its boot evidence (receipt links name its digest).
    #[serde(skip)]
    pub boot_evidence: Evidence,
}

struct Connected {
    /// Host channels, entry stage first.
    senders: Vec<Arc<Mutex<ChannelSender>>>,
    /// The tasks reading each channel.
    readers: Vec<tokio::task::AbortHandle>,
    stages: Vec<StageStatus>,
    entry_keys: Vec<KeyConfig>,
    /// The entry stage's signed HPKE key set, if it sent one.
    key_set: Option<Vec<u8>>,
    epoch: u64,
}

type AttestWaiters = HashMap<(usize, Vec<u8>), Vec<oneshot::Sender<Evidence>>>;
type StatsWaiters = HashMap<usize, Vec<oneshot::Sender<StageStats>>>;
/// A reply with what the exit stage reported about the request (counts, timings).
type Answer = (Reply, Option<RequestTelemetry>);

/// The orchestrator.
pub struct Pipeline {
    targets: StdMutex<Vec<StageTarget>>,
    policy: Policy,
    local_measurement: Option<Measurement>,
    /// Model id from the manifest.
    pub model_id: String,
    /// The model manifest.
    pub manifest: LoadedManifest,
    /// The manifest's exact bytes (served in the evidence bundle).
    pub manifest_bytes: Vec<u8>,
    /// The API this pipeline serves first (generation pipelines also serve
    /// chat: [`Pipeline::endpoints`]).
    pub endpoint: ApiEndpoint,
    connected: StdMutex<Option<Connected>>,
    not_ready_reason: StdMutex<String>,
    pending: StdMutex<HashMap<u64, mpsc::UnboundedSender<Answer>>>,
    attest_waiters: StdMutex<AttestWaiters>,
    stats_waiters: StdMutex<StatsWaiters>,
    /// Requests, tokens, finish reasons and time to first token (metrics).
    pub usage: crate::stage_metrics::UsageCounters,
    next_id: AtomicU64,
    epoch: AtomicU64,
    broken: Notify,
    limits: ChannelLimits,
    /// Times the pipeline was re-established after breaking (metrics).
    pub reconnects: AtomicU64,
    /// Connection attempts refused by policy (metrics).
    pub attestation_failures: AtomicU64,
    /// Set by [`Pipeline::close`]: no reconnecting, no "broken" alarms.
    closing: std::sync::atomic::AtomicBool,
}

impl Pipeline {
    /// A pipeline over `targets`. `local_build`, when known (the stage
    /// binary and the policy file the gateway launches its stages with),
    /// gives the local-build measurement that `trust_local_build` accepts.
    pub fn new(
        targets: Vec<StageTarget>,
        policy: Policy,
        manifest: &LoadedManifest,
        local_build: Option<(&std::path::Path, &std::path::Path)>,
    ) -> anyhow::Result<Arc<Self>> {
        let local_measurement = match local_build {
            Some((binary, stage_policy)) if binary.exists() => Some(mock_measurement(
                &Sha256Digest::of_file(binary)?,
                &manifest.digest,
                &Sha256Digest::of_file(stage_policy)?,
            )),
            _ => None,
        };
        Ok(Arc::new(Self {
            targets: StdMutex::new(targets),
            policy,
            local_measurement,
            model_id: manifest.manifest.model_id.clone(),
            manifest: manifest.clone(),
            manifest_bytes: manifest.bytes.clone(),
            endpoint: if manifest.manifest.architecture == "llama" {
                ApiEndpoint::Completions
            } else {
                ApiEndpoint::Embeddings
            },
            connected: StdMutex::new(None),
            not_ready_reason: StdMutex::new("pipeline is starting".into()),
            pending: StdMutex::new(HashMap::new()),
            attest_waiters: StdMutex::new(HashMap::new()),
            stats_waiters: StdMutex::new(HashMap::new()),
            usage: Default::default(),
            next_id: AtomicU64::new(1),
            epoch: AtomicU64::new(0),
            broken: Notify::new(),
            limits: ChannelLimits::default(),
            reconnects: AtomicU64::new(0),
            attestation_failures: AtomicU64::new(0),
            closing: Default::default(),
        }))
    }

    /// Whether this pipeline generates text (`/v1/completions`, `/v1/chat/completions`).
    pub fn is_generation(&self) -> bool {
        self.endpoint.is_generation()
    }

    /// Every API this pipeline serves.
    pub fn endpoints(&self) -> Vec<ApiEndpoint> {
        ApiEndpoint::ALL
            .into_iter()
            .filter(|e| e.is_generation() == self.is_generation())
            .collect()
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

    /// The current connection's epoch (`None` while the pipeline is down):
    /// it changes whenever the pipeline is rebuilt, with new stage keys.
    pub fn epoch(&self) -> Option<u64> {
        self.connected.lock().unwrap().as_ref().map(|c| c.epoch)
    }

    /// The entry stage's published HPKE key configurations (enclave-held).
    pub fn entry_keys(&self) -> Result<Vec<KeyConfig>, String> {
        match &*self.connected.lock().unwrap() {
            Some(c) => Ok(c.entry_keys.clone()),
            None => Err(self.not_ready_reason.lock().unwrap().clone()),
        }
    }

    /// How many stages the pipeline has.
    pub fn stage_count(&self) -> usize {
        self.targets.lock().unwrap().len()
    }

    /// Readiness and connection counters for `/metrics`.
    pub fn health(&self) -> crate::metrics::PipelineHealth {
        crate::metrics::PipelineHealth {
            ready: self.status().is_ok(),
            stage_count: self.stage_count(),
            reconnects: self.reconnects.load(Ordering::Relaxed),
            attestation_failures: self.attestation_failures.load(Ordering::Relaxed),
        }
    }

    /// This pipeline for `/metrics`: its health, usage counters and every
    /// stage's counters (asked now, each within [`STATS_TIMEOUT`]).
    ///
    /// [`STATS_TIMEOUT`]: crate::stage_metrics::STATS_TIMEOUT
    pub async fn view(&self) -> crate::stage_metrics::PipelineView<'_> {
        crate::stage_metrics::PipelineView {
            generation: self.is_generation(),
            health: self.health(),
            usage: &self.usage,
            stats: self.stats(crate::stage_metrics::STATS_TIMEOUT).await,
        }
    }

    /// Connects once; on failure says why (naming the stage) and whether the
    /// stage was reached but refused by policy (`rejected`, also counted in
    /// `attestation_failures`).
    pub async fn connect(self: &Arc<Self>) -> Result<(), ConnectError> {
        let r = self.connect_once().await;
        if matches!(&r, Err(e) if e.rejected) {
            self.attestation_failures.fetch_add(1, Ordering::Relaxed);
        }
        r
    }

    async fn connect_once(self: &Arc<Self>) -> Result<(), ConnectError> {
        let epoch = self.epoch.fetch_add(1, Ordering::SeqCst) + 1;
        let targets = self.targets.lock().unwrap().clone();
        let n = targets.len();
        let mut channels: Vec<Option<(ChannelSender, ChannelReceiver)>> =
            (0..n).map(|_| None).collect();
        let mut stages = Vec::new();
        let mut entry_key_set = None;
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
            let next = (i + 1 < n).then(|| targets[i + 1].peer_endpoint().to_string());
            // A generation exit stage sends sampled tokens back to the entry stage.
            let feedback = (self.is_generation() && n > 1 && i + 1 == n)
                .then(|| targets[0].peer_endpoint().to_string());
            tx.send_msg(&HostMessage::Configure { next, feedback })
                .await
                .map_err(|e| ConnectError::unreachable(format!("stage {i}: {e}")))?;
            let boot = match rx.recv_msg::<StageReply>().await {
                Ok(Some(StageReply::Configured {
                    boot_evidence,
                    key_set,
                })) => {
                    if i == 0 {
                        entry_key_set = key_set.map(serde_bytes::ByteBuf::into_vec);
                    }
                    boot_evidence
                }
                Ok(Some(StageReply::ConfigureFailed(why))) => {
                    return Err(ConnectError {
                        rejected: why.contains("not accepted"),
                        reason: format!("stage {i}: {why}"),
                    })
                }
                Ok(Some(_)) => {
                    return Err(ConnectError::unreachable(format!(
                        "stage {i} answered configuration with something else"
                    )))
                }
                Ok(None) => {
                    return Err(ConnectError::unreachable(format!(
                        "stage {i} closed the channel during configuration"
                    )))
                }
                Err(e) => return Err(ConnectError::unreachable(format!("stage {i}: {e}"))),
            };
            let doc = peer.document.as_ref().expect("stages are attested");
            let claims = peer.claims.clone().expect("stages make claims");
            check_boot_evidence(&boot, &claims, &doc.measurement).map_err(|why| ConnectError {
                rejected: true,
                reason: format!("stage {i}: boot evidence refused: {why}"),
            })?;
            stages.push(StageStatus {
                index: i as u32,
                layers: t.layers,
                evidence: match doc.format {
                    EvidenceFormat::Mock => "mock",
                    EvidenceFormat::Nitro => "nitro",
                },
                measurement: doc.measurement.pinned_form(),
                endpoint: t.endpoint.to_string(),
                claims,
                boot_evidence: boot,
            });
            channels[i] = Some((tx, rx));
        }
        stages.reverse();
        let (entry_keys, _) =
            proto::bundle::entry_keys(&stages[0].claims, entry_key_set.as_deref()).map_err(
                |e| ConnectError {
                    rejected: true,
                    reason: format!("stage 0: its HPKE keys are unusable: {e}"),
                },
            )?;
        let mut senders = Vec::new();
        let mut readers = Vec::new();
        for (i, ch) in channels.into_iter().enumerate() {
            let (tx, rx) = ch.expect("every stage connected");
            let this = self.clone();
            readers.push(
                tokio::spawn(async move { this.read_stage(i, rx, epoch).await }).abort_handle(),
            );
            senders.push(Arc::new(Mutex::new(tx)));
        }
        *self.connected.lock().unwrap() = Some(Connected {
            senders,
            readers,
            stages,
            entry_keys,
            key_set: entry_key_set,
            epoch,
        });
        Ok(())
    }

    /// The entry stage rotated its HPKE key: publish its new signed set.
    /// A set its attested receipt key did not sign breaks the pipeline.
    fn on_key_set(&self, epoch: u64, set: Vec<u8>) -> Result<(), String> {
        let mut connected = self.connected.lock().unwrap();
        let Some(c) = connected.as_mut().filter(|c| c.epoch == epoch) else {
            return Ok(());
        };
        (c.entry_keys, _) = proto::bundle::entry_keys(&c.stages[0].claims, Some(&set))?;
        c.key_set = Some(set);
        tracing::info!(
            model = %self.model_id,
            keys = ?c.entry_keys.iter().map(|k| k.key_id).collect::<Vec<_>>(),
            "entry stage rotated its HPKE key"
        );
        Ok(())
    }

    /// The entry stage's HPKE keys as it last signed them (served in the
    /// evidence bundle).
    pub fn key_set(&self) -> Option<Vec<u8>> {
        let connected = self.connected.lock().unwrap();
        connected.as_ref().and_then(|c| c.key_set.clone())
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
        if c.manifest_sha256 != self.manifest.digest {
            return Err(format!(
                "stage {index}: serves manifest {}, the gateway's is {}",
                c.manifest_sha256, self.manifest.digest
            ));
        }
        Ok(())
    }

    async fn read_stage(self: Arc<Self>, index: usize, mut rx: ChannelReceiver, epoch: u64) {
        let reason = loop {
            match rx.recv_msg::<StageReply>().await {
                Ok(Some(StageReply::Result(m))) => self.on_result(m),
                Ok(Some(StageReply::Evidence { nonce, evidence })) => {
                    let waiters = self.attest_waiters.lock().unwrap().remove(&(index, nonce));
                    for w in waiters.into_iter().flatten() {
                        let _ = w.send(evidence.clone());
                    }
                }
                Ok(Some(StageReply::Stats(stats))) => {
                    let waiters = self.stats_waiters.lock().unwrap().remove(&index);
                    for w in waiters.into_iter().flatten() {
                        let _ = w.send(stats.clone());
                    }
                }
                Ok(Some(StageReply::KeySet(set))) if index == 0 => {
                    if let Err(why) = self.on_key_set(epoch, set.into_vec()) {
                        break format!("stage 0: {why}");
                    }
                }
                Ok(Some(StageReply::DownstreamLost(why))) => {
                    break format!("stage {index} lost its next stage: {why}")
                }
                Ok(Some(other)) => {
                    break format!("stage {index} sent an unexpected message: {other:?}")
                }
                Ok(None) => break format!("stage {index} disconnected"),
                Err(e) => break format!("stage {index} channel failed: {e}"),
            }
        };
        self.mark_broken(epoch, reason);
    }

    fn mark_broken(&self, epoch: u64, reason: String) {
        if self.closing.load(Ordering::SeqCst) {
            return;
        }
        let old = {
            let mut c = self.connected.lock().unwrap();
            if c.as_ref().map(|c| c.epoch) != Some(epoch) {
                return;
            }
            c.take()
        };
        // Close every channel of the broken pipeline, the surviving stages'
        // too: a stage accepts a new configuration only once the host
        // channel that configured it has closed.
        if let Some(old) = old {
            for r in old.readers {
                r.abort();
            }
            for tx in old.senders {
                tokio::spawn(async move { tx.lock().await.shutdown().await });
            }
        }
        *self.not_ready_reason.lock().unwrap() = reason.clone();
        // Dropping the waiters' senders fails every pending request with 503.
        let failed = self.pending.lock().unwrap().drain().count();
        self.attest_waiters.lock().unwrap().clear();
        self.stats_waiters.lock().unwrap().clear();
        tracing::warn!(reason = %reason, failed_requests = failed, "pipeline broken");
        self.broken.notify_one();
    }

    fn on_result(&self, m: ResultMessage) {
        let mut telemetry = None;
        let (request_id, reply, last) = match m {
            ResultMessage::Response {
                request_id,
                status,
                body,
                receipt,
                receipt_id,
                telemetry: t,
            } => {
                telemetry = t;
                let reply = Reply::Response {
                    status,
                    body,
                    receipt,
                    receipt_id,
                };
                (request_id, reply, true)
            }
            ResultMessage::Failed { request_id, error } => (request_id, Reply::Failed(error), true),
            ResultMessage::StreamStart {
                request_id,
                receipt_id,
            } => (request_id, Reply::StreamStart { receipt_id }, false),
            ResultMessage::StreamData { request_id, data } => {
                (request_id, Reply::StreamData(data), false)
            }
            ResultMessage::StreamEnd {
                request_id,
                data,
                receipt,
                telemetry: t,
            } => {
                telemetry = t;
                (request_id, Reply::StreamEnd { data, receipt }, true)
            }
        };
        let mut pending = self.pending.lock().unwrap();
        let w = if last {
            pending.remove(&request_id)
        } else {
            pending.get(&request_id).cloned()
        };
        match w {
            Some(w) => {
                let _ = w.send((reply, telemetry));
            }
            None => tracing::debug!(
                request_id,
                "answer for a request no longer waiting; dropped"
            ),
        }
    }

    /// Relays a sealed request to the entry stage and waits for its first
    /// answer (a whole response, a failure, or the start of a stream, whose
    /// rest comes through the returned [`Submission`]).
    #[allow(clippy::too_many_arguments)]
    pub async fn submit(
        self: &Arc<Self>,
        endpoint: &str,
        headers: SealedHeaders,
        body: Vec<u8>,
        client_nonce: Option<Vec<u8>>,
        sealing: Sealing,
        timeout: Duration,
    ) -> Result<(Reply, Submission), Failure> {
        let entry = self.sender(0)?;
        let request_id = self.next_id.fetch_add(1, Ordering::Relaxed);
        let (done, rx) = mpsc::unbounded_channel();
        self.pending.lock().unwrap().insert(request_id, done);
        let span = crate::telemetry::current_request_span();
        let trace = span.as_ref().and_then(crate::telemetry::trace_context);
        let mut sub = Submission {
            pipeline: self.clone(),
            request_id,
            rx,
            finished: false,
            span,
            submitted: Instant::now(),
            submitted_unix_ns: crate::stage_metrics::unix_ns(),
            streamed: false,
        };
        let msg = HostMessage::Request(SealedRequest {
            request_id,
            endpoint: endpoint.to_string(),
            headers,
            body,
            client_nonce,
            sealing,
            trace,
        });
        if let Err(e) = entry.lock().await.send_msg(&msg).await {
            sub.finished = true;
            return Err(Failure::NotReady(format!("entry stage channel: {e}")));
        }
        let first = sub.next(timeout).await?;
        Ok((first, sub))
    }

    fn not_ready(&self) -> Failure {
        Failure::NotReady(self.not_ready_reason.lock().unwrap().clone())
    }

    fn sender(&self, index: usize) -> Result<Arc<Mutex<ChannelSender>>, Failure> {
        match &*self.connected.lock().unwrap() {
            Some(c) => Ok(c.senders[index].clone()),
            None => Err(Failure::NotReady(
                self.not_ready_reason.lock().unwrap().clone(),
            )),
        }
    }

    /// Fresh evidence of every stage bound to `nonce`, with each stage's status.
    pub async fn attest(
        &self,
        nonce: &[u8],
        timeout: Duration,
    ) -> Result<Vec<(StageStatus, Evidence)>, Failure> {
        let stages = self.status().map_err(Failure::NotReady)?;
        let mut waits = Vec::new();
        for s in &stages {
            let i = s.index as usize;
            let (tx, rx) = oneshot::channel();
            self.attest_waiters
                .lock()
                .unwrap()
                .entry((i, nonce.to_vec()))
                .or_default()
                .push(tx);
            let sender = self.sender(i)?;
            let msg = HostMessage::Attest {
                nonce: nonce.to_vec(),
            };
            if let Err(e) = sender.lock().await.send_msg(&msg).await {
                return Err(Failure::NotReady(format!("stage {i}: {e}")));
            }
            waits.push(rx);
        }
        let mut out = Vec::new();
        for (s, w) in stages.into_iter().zip(waits) {
            match tokio::time::timeout(timeout, w).await {
                Ok(Ok(ev)) => out.push((s, ev)),
                Ok(Err(_)) => {
                    return Err(Failure::NotReady("pipeline broke while attesting".into()))
                }
                Err(_) => return Err(Failure::Timeout),
            }
        }
        Ok(out)
    }

    /// Every stage's load counters (`None` for a stage that did not answer
    /// within `timeout`, or when the pipeline is down).
    pub async fn stats(&self, timeout: Duration) -> Vec<Option<StageStats>> {
        let n = self.stage_count();
        let mut waits = Vec::new();
        for i in 0..n {
            let Ok(sender) = self.sender(i) else {
                waits.push(None);
                continue;
            };
            let (tx, rx) = oneshot::channel();
            self.stats_waiters
                .lock()
                .unwrap()
                .entry(i)
                .or_default()
                .push(tx);
            let sent = sender.lock().await.send_msg(&HostMessage::Stats).await;
            waits.push(sent.is_ok().then_some(rx));
        }
        let mut out = Vec::new();
        for w in waits {
            out.push(match w {
                Some(rx) => tokio::time::timeout(timeout, rx)
                    .await
                    .ok()
                    .and_then(Result::ok),
                None => None,
            });
        }
        out
    }

    /// After the first connection: waits for a break, then reconnects until
    /// the stages answer and verify again; forever.
    pub async fn supervise_after_first(self: Arc<Self>) {
        loop {
            self.broken.notified().await;
            let mut last = String::new();
            loop {
                tokio::time::sleep(Duration::from_millis(500)).await;
                if self.closing.load(Ordering::SeqCst) {
                    return;
                }
                match self.connect().await {
                    Ok(()) => {
                        self.reconnects.fetch_add(1, Ordering::Relaxed);
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

    /// Closes every stage channel (the sending direction, cleanly, where no
    /// request still holds it) and stops reconnecting: the last step of a
    /// graceful shutdown.
    pub async fn close(&self) {
        self.closing.store(true, Ordering::SeqCst);
        *self.not_ready_reason.lock().unwrap() = "the gateway is shutting down".into();
        let connected = self.connected.lock().unwrap().take();
        self.pending.lock().unwrap().clear();
        let Some(c) = connected else { return };
        for (i, tx) in c.senders.into_iter().enumerate() {
            match Arc::try_unwrap(tx) {
                Ok(tx) => tx.into_inner().close().await,
                Err(_) => tracing::debug!(stage = i, "channel still shared; dropped instead"),
            }
        }
        tracing::info!("stage channels closed");
    }

    /// Logs what was verified (called whenever the pipeline comes up).
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

/// Checks that a stage's boot evidence verifies (Nitro: at its own time,
/// since it was made at stage start), binds its receipt key and the same
/// claims as its channel evidence, and has the same measurement.
pub fn check_boot_evidence(
    boot: &Evidence,
    claims: &StageClaims,
    measurement: &Measurement,
) -> Result<(), String> {
    let doc = verify_boot(boot).map_err(|e| e.to_string())?;
    if &doc.measurement != measurement {
        return Err("its measurement differs from the channel evidence".into());
    }
    if doc.public_key != claims.receipt_key {
        return Err("it is not bound to the stage's receipt key".into());
    }
    if doc.user_data
        != claims_binding(
            doc.format,
            EvidencePurpose::Boot,
            &proto::cbor::to_vec(claims),
        )
    {
        return Err("its claims differ from the channel evidence".into());
    }
    Ok(())
}

/// A request in flight: the rest of its answer. Dropping it before the
/// answer is complete (the client went away, or timed out) forgets the
/// request here and tells the entry stage to drop it in every stage.
pub struct Submission {
    pipeline: Arc<Pipeline>,
    request_id: u64,
    rx: mpsc::UnboundedReceiver<Answer>,
    finished: bool,
    /// The request's trace span (tracing on); kept open until the answer ends.
    span: Option<tracing::Span>,
    submitted: Instant,
    submitted_unix_ns: u64,
    /// A stream's first bytes came (time to first token is measured there).
    streamed: bool,
}

impl Submission {
    /// The next part of the answer, within `timeout`.
    pub async fn next(&mut self, timeout: Duration) -> Result<Reply, Failure> {
        match tokio::time::timeout(timeout, self.rx.recv()).await {
            Ok(Some((r, telemetry))) => {
                self.observe(&r, telemetry.as_ref());
                if matches!(
                    r,
                    Reply::Response { .. } | Reply::Failed(_) | Reply::StreamEnd { .. }
                ) {
                    self.finished = true;
                }
                Ok(r)
            }
            Ok(None) => {
                self.finished = true;
                Err(self.pipeline.not_ready())
            }
            Err(_) => Err(Failure::Timeout),
        }
    }
}

impl Submission {
    /// Metrics and the trace span from an answer: time to first token when
    /// a stream's first bytes come, counts and stage spans at the end.
    fn observe(&mut self, r: &Reply, telemetry: Option<&RequestTelemetry>) {
        let p = &self.pipeline;
        if matches!(r, Reply::StreamData(_)) && !self.streamed {
            self.streamed = true;
            p.usage.first_token(self.submitted.elapsed());
        }
        let Some(t) = telemetry else { return };
        if !self.streamed && p.is_generation() {
            if let Some(first) = t.first_token_unix_ns {
                let ns = first.saturating_sub(self.submitted_unix_ns);
                p.usage.first_token(Duration::from_nanos(ns));
            }
        }
        p.usage.finished(t);
        if let Some(span) = &self.span {
            crate::telemetry::record_outcome(span, &p.model_id, p.is_generation(), t);
        }
    }
}

impl Drop for Submission {
    fn drop(&mut self) {
        if let Some(span) = &self.span {
            // The OpenTelemetry layer ends a span at its last exit: a stream's
            // span ends here, with the stream, not with the response headers.
            span.in_scope(|| {});
        }
        self.pipeline
            .pending
            .lock()
            .unwrap()
            .remove(&self.request_id);
        if self.finished {
            return;
        }
        let Ok(entry) = self.pipeline.sender(0) else {
            return;
        };
        let request_id = self.request_id;
        tracing::info!(
            request_id,
            "client stopped waiting; cancelling in the stages"
        );
        if let Ok(rt) = tokio::runtime::Handle::try_current() {
            rt.spawn(async move {
                let _ = entry
                    .lock()
                    .await
                    .send_msg(&HostMessage::Cancel { request_id })
                    .await;
            });
        }
    }
}
