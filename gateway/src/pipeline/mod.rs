//! The pipeline orchestrator: attests every stage against the policy,
//! builds the data path gateway → stage 0 → … → exit stage → gateway,
//! relays sealed requests and routes sealed responses back to their callers.
//! When any stage channel breaks, pending requests fail with 503 and the
//! pipeline is rebuilt as soon as the stages answer again.
//!
//! The gateway never sees plaintext on this path unless it sealed the request
//! itself (plain OpenAI clients): it holds no key of the stages.
//!
//! Building the path (attesting, configuring, key sets, breaks and
//! rebuilds) is [`connect`]; requests in flight (submitting, routing
//! results, attestation and stats requests) are [`requests`].

use proto::attestation::{mock_measurement, Evidence, Measurement};
use proto::channel::ChannelLimits;
use proto::digest::Sha256Digest;
use proto::frames::{PipelineError, RequestTelemetry, StageClaims, StageStats};
use proto::io::queue::QueuedSender;
use proto::io::transport::Endpoint;
use proto::manifest::{LoadedManifest, ModelTask};
use proto::openai::ApiEndpoint;
use proto::policy::Policy;
use proto::receipt::ReceiptId;
use proto::sealing::KeyConfig;
use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex as StdMutex};
use tokio::sync::{mpsc, oneshot, Mutex, Notify};

mod connect;
pub mod discovery;
mod replicas;
mod requests;

pub use connect::check_boot_evidence;
pub use replicas::{key_ids, Replicas, MAX_REPLICAS};
pub use requests::Submission;

/// Why a replica found through DNS is not ready while it has no addresses.
const UNASSIGNED: &str =
    "no stage addresses for this replica: DNS does not name a whole chain of stages for it";

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
    /// The request never reached the entry stage (503): another replica
    /// may take it.
    NotSent(String),
    /// The request took too long (504).
    Timeout,
}
/// A whole response sealed to the client, with its receipt.
#[derive(Debug)]
pub struct WholeReply {
    /// HTTP status.
    pub status: u16,
    /// Sealed body.
    pub body: Vec<u8>,
    /// Signed receipt.
    pub receipt: Vec<u8>,
    /// Receipt id.
    pub receipt_id: ReceiptId,
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
    Response(WholeReply),
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
    /// A Nitro enclave in debug mode (PCRs zero, its memory readable by the
    /// parent): accepted only by a policy with `allow_debug`.
    #[serde(skip_serializing_if = "std::ops::Not::not")]
    pub debug: bool,
    /// The stage's own report of its clock check (unverified: for the
    /// operator).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub clock: Option<String>,
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
    senders: Vec<QueuedSender>,
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
    /// The next request id, held while a request is queued on the entry
    /// stage's channel: the entry stage refuses ids that do not increase.
    next_id: Mutex<u64>,
    epoch: AtomicU64,
    broken: Notify,
    limits: ChannelLimits,
    /// Times the pipeline was re-established after breaking (metrics).
    pub reconnects: AtomicU64,
    /// Connection attempts refused by policy (metrics).
    pub attestation_failures: AtomicU64,
    /// Set by [`Pipeline::close`]: no reconnecting, no "broken" alarms.
    closing: std::sync::atomic::AtomicBool,
    /// Which replica of its model this pipeline is (0 when there is one).
    pub replica: usize,
    /// The HPKE key ids its entry stage is told to use.
    key_ids: std::ops::RangeInclusive<u8>,
    /// Whether `targets` hold stage addresses (a replica found through DNS
    /// has none until a whole chain of stages resolves).
    assigned: std::sync::atomic::AtomicBool,
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
        replica: usize,
        key_ids: std::ops::RangeInclusive<u8>,
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
            endpoint: match manifest.manifest.serves() {
                Ok(ModelTask::Completion) => ApiEndpoint::Completions,
                Ok(ModelTask::Embedding) => ApiEndpoint::Embeddings,
                Err(e) => anyhow::bail!("{e}"),
            },
            connected: StdMutex::new(None),
            not_ready_reason: StdMutex::new("pipeline is starting".into()),
            pending: StdMutex::new(HashMap::new()),
            attest_waiters: StdMutex::new(HashMap::new()),
            stats_waiters: StdMutex::new(HashMap::new()),
            usage: Default::default(),
            next_id: Mutex::new(1),
            epoch: AtomicU64::new(0),
            broken: Notify::new(),
            limits: ChannelLimits::default(),
            reconnects: AtomicU64::new(0),
            attestation_failures: AtomicU64::new(0),
            closing: Default::default(),
            replica,
            key_ids,
            assigned: std::sync::atomic::AtomicBool::new(true),
        }))
    }

    /// When this pipeline trusts the stage binary the gateway launches
    /// (`trust_local_build`): the mock measurement of that build and each
    /// stage's layers, what a release entry of the local build says.
    pub fn local_build(&self) -> Option<(&Measurement, Vec<[u32; 2]>)> {
        let m = self.local_measurement.as_ref()?;
        if !self.policy.trust_local_build {
            return None;
        }
        let layers = self
            .targets
            .lock()
            .unwrap()
            .iter()
            .map(|t| t.layers)
            .collect();
        Some((m, layers))
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

    /// Every stage's address at once (a replica found through DNS), or
    /// none: the replica has no complete chain of stages and is not used.
    /// A pipeline not connected now tries the new addresses at once; a
    /// connected one keeps its channels until they break.
    pub fn set_targets(&self, endpoints: Option<Vec<Endpoint>>) {
        match endpoints {
            Some(eps) => {
                let mut t = self.targets.lock().unwrap();
                for (target, ep) in t.iter_mut().zip(eps) {
                    target.endpoint = ep;
                }
                drop(t);
                self.assigned.store(true, Ordering::SeqCst);
                if self.epoch().is_none() {
                    self.broken.notify_one();
                }
            }
            None => {
                self.assigned.store(false, Ordering::SeqCst);
                self.set_not_ready(UNASSIGNED);
            }
        }
    }

    /// Whether the replica has stage addresses.
    pub fn is_assigned(&self) -> bool {
        self.assigned.load(Ordering::SeqCst)
    }

    /// Starts the reconnect loop of a pipeline that has not connected yet.
    pub fn retry_soon(&self) {
        self.broken.notify_one();
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

    /// Whether the entry stage accepts requests sealed to `key_id` with
    /// `aead` now (no copy of the key list: asked on every sealed request).
    pub fn accepts(&self, key_id: u8, aead: proto::sealing::Aead) -> bool {
        self.connected.lock().unwrap().as_ref().is_some_and(|c| {
            c.entry_keys
                .iter()
                .any(|k| k.key_id == key_id && k.supports(aead))
        })
    }

    /// Requests this gateway has sent to the pipeline and not yet seen
    /// finish (streams until their end): its load, for routing.
    pub fn in_flight(&self) -> usize {
        self.pending.lock().unwrap().len()
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
    /// stage's counters (asked now, each within [`STATS_TIMEOUT`]);
    /// `replicas`: how many its model has (more than one: labelled).
    ///
    /// [`STATS_TIMEOUT`]: crate::stage_metrics::STATS_TIMEOUT
    pub async fn view(&self, replicas: usize) -> crate::stage_metrics::PipelineView<'_> {
        crate::stage_metrics::PipelineView {
            generation: self.is_generation(),
            health: self.health(),
            usage: &self.usage,
            stats: self.stats(crate::stage_metrics::STATS_TIMEOUT).await,
            replica: (replicas > 1).then_some(self.replica),
        }
    }
}
