//! Pipeline messages carried inside the stage channel (CBOR).
//!
//! Three directions, three types, so that no endpoint can be handed a
//! message meant for another:
//! - [`HostMessage`]: gateway → a stage (configuration, requests to stage 0);
//! - [`ActivationMessage`]: stage *i* → stage *i+1* (activations, failures);
//! - [`ResultMessage`]: exit stage → gateway (outputs, failures);
//! - [`FeedbackMessage`]: exit stage → entry stage of a generation pipeline
//!   (the sampled token ids, on their own attested channel).
//!
//! Every data message carries the request id(s) and micro-batch id it
//! belongs to, so a failure is always attributed to exactly the requests it
//! touched.

pub use crate::claims::{StageClaims, WeightFormat};
use crate::completions::CompletionsRequest;
use crate::digest::Sha256Digest;
use crate::evidence::Evidence;
use crate::openai::EmbeddingsRequest;
use crate::receipt::{OpenedKey, ReceiptId, Sealing};
use crate::sealing::{ResponseKeyMaterial, SealedHeaders};
use crate::tensor::TensorFrame;
use serde::{Deserialize, Serialize};

/// A request-scoped error as it travels the pipeline.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct PipelineError {
    /// Class of failure.
    pub kind: ErrorKind,
    /// HTTP status the client gets.
    pub status: u16,
    /// Human-readable reason (never contains request content).
    pub message: String,
    /// Seconds after which a retry may succeed (429/503 from admission).
    #[serde(default)]
    pub retry_after_secs: Option<u32>,
    /// The OpenAI error body sealed to the client's response key, when the
    /// entry stage could open the request (so the host cannot read it).
    #[serde(with = "serde_bytes")]
    pub sealed_body: Option<Vec<u8>>,
}

/// Class of a pipeline failure.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub enum ErrorKind {
    /// The request's input is unusable (4xx).
    BadInput,
    /// The sealed body could not be opened (4xx).
    Sealing,
    /// The body is sealed to a key id the entry stage does not accept (any
    /// more): the client should fetch the current keys and seal again.
    UnknownKey,
    /// The body opened but was sealed too long ago (or ahead) by the entry
    /// stage's clock (`sealing::check_fresh`): seal it again.
    Stale,
    /// The stage failed on this request (500).
    Internal,
}

/// Gateway → stage.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub enum HostMessage {
    /// Sets where this stage sends its output: `Some(endpoint)` for the next
    /// stage (which it dials and attests), `None` when this stage is the exit
    /// stage and answers on this very channel. Only the host channel that
    /// configured a stage may configure it again while it is open; any other
    /// gets `ConfigureFailed`.
    Configure {
        /// Next stage's endpoint, as `tcp://host:port`.
        next: Option<String>,
        /// Generation pipelines of more than one stage: the entry stage's
        /// endpoint, which the exit stage dials (and attests) to send the
        /// sampled token ids back. `None` everywhere else.
        #[serde(default)]
        feedback: Option<String>,
        /// Entry stage: the HPKE key ids `[first, last]` it must use from
        /// now on (the gateway gives each replica of a pipeline its own, so
        /// that a key id names one replica). A current key outside the
        /// range is replaced at once (the new one signed into its key set)
        /// and keys outside it are dropped. `None`: keep the keys as they are.
        #[serde(default)]
        key_ids: Option<[u8; 2]>,
    },
    /// A sealed API request for the entry stage.
    Request(SealedRequest),
    /// The client went away: drop the request in every stage (entry stage).
    Cancel {
        /// The request.
        request_id: u64,
    },
    /// Asks for fresh evidence bound to a verifier's nonce.
    Attest {
        /// The verifier's nonce (at most 64 bytes).
        #[serde(with = "serde_bytes")]
        nonce: Vec<u8>,
    },
    /// Asks for the stage's load counters ([`StageReply::Stats`]).
    Stats,
}

/// An API request as the entry stage receives it: always HPKE-sealed (by the
/// client, or by the gateway for plain OpenAI clients).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct SealedRequest {
    /// Gateway-assigned request id.
    pub request_id: u64,
    /// The API path (`/v1/embeddings`).
    pub endpoint: String,
    /// Key id, AEAD and encapsulated key from the request headers.
    pub headers: SealedHeaders,
    /// The sealed body (chunk framing of [`crate::sealing`]).
    #[serde(with = "serde_bytes")]
    pub body: Vec<u8>,
    /// The client's receipt nonce, if it sent one.
    #[serde(with = "serde_bytes")]
    pub client_nonce: Option<Vec<u8>>,
    /// Who sealed the body, as the gateway reports it (recorded in the receipt).
    pub sealing: Sealing,
    /// The gateway's trace context when tracing is on (ids only, no content).
    #[serde(default)]
    pub trace: Option<TraceContext>,
}

impl SealedRequest {
    /// Who must have sealed the body for its label to be true: a client
    /// for `enclave`, the host's gateway for `plain` and `gateway`. The
    /// stage opens it as sealed by that party (bound in the HPKE `info`),
    /// so a relabelled request does not open.
    pub fn sealer(&self) -> crate::sealing::Sealer {
        match self.sealing {
            Sealing::Enclave => crate::sealing::Sealer::Client,
            Sealing::Plain | Sealing::Gateway => crate::sealing::Sealer::Host,
        }
    }
}

/// W3C trace context of a request: which trace and parent span the stages'
/// timings belong to. Random ids chosen by the gateway or its caller; never
/// derived from request content.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct TraceContext {
    /// Trace id.
    #[serde(with = "serde_bytes")]
    pub trace_id: [u8; 16],
    /// The gateway's request span id (the parent of the stages' spans).
    #[serde(with = "serde_bytes")]
    pub span_id: [u8; 8],
    /// W3C trace flags (bit 0: sampled).
    pub flags: u8,
}

/// One stage's timing of one request, reported back so that the gateway can
/// emit the per-stage spans (stages cannot reach a collector).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct StageTiming {
    /// Stage index.
    pub stage_index: u32,
    /// Unix time (ns, the stage's clock) when the request reached the stage
    /// (its announcement was taken up by the compute thread).
    pub start_unix_ns: u64,
    /// From arrival to the request's first micro-batch or step (ns).
    pub queue_ns: u64,
    /// Time of the micro-batches or steps the request took part in (ns;
    /// a batch shared by several requests counts for each of them).
    pub compute_ns: u64,
    /// Unix time (ns) when the stage finished its part.
    pub end_unix_ns: u64,
    /// Micro-batches or steps the request took part in.
    pub batches: u32,
}

/// What the exit stage reports about a finished request besides its sealed
/// response: counts and timings only (the host sees the ciphertext's size
/// and timing anyway), never content.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct RequestTelemetry {
    /// Every stage's timing, entry stage first.
    pub stages: Vec<StageTiming>,
    /// Prompt (input) tokens.
    pub input_tokens: u64,
    /// Generated tokens (0 for embeddings).
    pub output_tokens: u64,
    /// Finish reason of each choice (`stop`, `length`); empty for embeddings.
    pub finish_reasons: Vec<String>,
    /// Unix time (ns, exit stage clock) when the first token was sampled.
    pub first_token_unix_ns: Option<u64>,
}

impl RequestTelemetry {
    /// What the host may learn of a request sealed as `sealing`: all of it
    /// when the host saw the request anyway (`plain`, `gateway`); for a
    /// request sealed to the enclave, token counts only to their bucket
    /// ([`bucket_count`]) and no finish reasons (whether an answer stopped
    /// or ran to its limit says something about it).
    pub fn for_host(mut self, sealing: Sealing) -> Self {
        if sealing == Sealing::Enclave {
            self.input_tokens = bucket_count(self.input_tokens);
            self.output_tokens = bucket_count(self.output_tokens);
            self.finish_reasons.clear();
        }
        self
    }
}

/// A count as the host may see it for a request sealed to the enclave:
/// rounded up to a multiple of 16, then as sealed bodies' lengths are
/// (Padmé: only the top `⌊log₂ ⌊log₂ n⌋⌋ + 1` bits may be set), so that it
/// tells about `log log n` bits.
pub fn bucket_count(n: u64) -> u64 {
    crate::sealing::padded_len_with(n as usize, 16) as u64
}

/// A stage's load counters, answered to [`HostMessage::Stats`]. Counters
/// are totals since the stage started.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct StageStats {
    /// Requests this stage holds now (announced, not yet finished here).
    pub requests: u64,
    /// Requests waiting for KV-cache room (generation entry stage).
    pub waiting: u64,
    /// Sequences being generated (generation stages).
    pub active_sequences: u64,
    /// KV-cache tokens allocated (generation stages), to its
    /// [`bucket_count`].
    pub kv_tokens_used: u64,
    /// Micro-batches (or generation steps) run.
    pub batches: u64,
    /// Rows (sequences) over all micro-batches or steps.
    pub batch_rows: u64,
    /// Micro-batches by rows, one count per bound of [`BATCH_SIZE_BOUNDS`]
    /// (not cumulative: bucket *i* counts sizes in `(bound[i-1], bound[i]]`),
    /// plus one for larger ones.
    pub batch_size_counts: Vec<u64>,
    /// Tokens run through this stage's layers, to its [`bucket_count`].
    pub tokens: u64,
    /// Time spent computing (ns).
    pub compute_ns: u64,
}

/// Upper bounds of the micro-batch size buckets of [`StageStats`].
pub const BATCH_SIZE_BOUNDS: [u64; 9] = [1, 2, 4, 8, 16, 32, 64, 128, 256];

/// Stage → gateway on the host channel.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub enum StageReply {
    /// Configuration done; carries the stage's boot evidence (bound to its
    /// receipt key and claims, empty nonce), which receipts refer to.
    Configured {
        /// The boot evidence.
        boot_evidence: Evidence,
        /// The entry stage's current HPKE keys signed with its receipt key
        /// ([`crate::key_rotation::KeySet`]); `None` elsewhere.
        #[serde(default)]
        key_set: Option<serde_bytes::ByteBuf>,
        /// The stage's clock check against its reference clock, one line
        /// for the operator (`/readyz`); `None` from a stage that does not
        /// check. The host's to read and report, bound to nothing.
        #[serde(default)]
        clock: Option<String>,
    },
    /// The entry stage rotated its HPKE key: its new signed key set, sent
    /// on the host channel unasked.
    KeySet(serde_bytes::ByteBuf),
    /// Configuration failed; the reason names the peer and check.
    ConfigureFailed(String),
    /// The stage's load counters.
    Stats(StageStats),
    /// Fresh evidence for an `Attest` request.
    Evidence {
        /// The nonce it binds.
        #[serde(with = "serde_bytes")]
        nonce: Vec<u8>,
        /// The document.
        evidence: Evidence,
    },
    /// A finished or failed request (exit stage).
    Result(ResultMessage),
    /// The next stage was lost; the pipeline must be rebuilt.
    DownstreamLost(String),
}

/// One sequence's place in a micro-batch.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct BatchItem {
    /// Request it belongs to.
    pub request_id: u64,
    /// Index of the input within the request.
    pub index: u32,
    /// Real (unpadded) token count.
    pub tokens: u32,
}

/// Activations of a micro-batch between two stages.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct ActivationBatch {
    /// Micro-batch id, unique per sending stage.
    pub micro_batch_id: u64,
    /// Sequences, in row order.
    pub items: Vec<BatchItem>,
    /// Hidden states `[batch, seq, hidden]`, f32.
    pub hidden: TensorFrame,
    /// Attention mask `[batch, seq]`, u32 0/1.
    pub mask: TensorFrame,
}

/// What every stage needs to know about any request to make its receipt
/// link and, in the exit stage, the receipt and the sealed answer. Shared by
/// [`RequestContext`] (embeddings) and [`GenerationContext`] (completions,
/// chat), so that the receipt is built by one piece of code for both.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Envelope {
    /// Gateway-assigned request id.
    pub request_id: u64,
    /// The receipt id chosen by the entry stage.
    pub receipt_id: ReceiptId,
    /// The API path.
    pub endpoint: String,
    /// SHA-256 of the exact plaintext request bytes.
    pub request_digest: Sha256Digest,
    /// The per-request secret that salts every digest in the receipt
    /// (drawn by the entry stage; reaches the client only inside the sealed
    /// response, never the host).
    pub digest_salt: crate::receipt::DigestSalt,
    /// The client's receipt nonce.
    #[serde(with = "serde_bytes")]
    pub client_nonce: Option<Vec<u8>>,
    /// Who sealed the request.
    pub sealing: Sealing,
    /// The HPKE key the entry stage opened the request with (bound into
    /// its receipt link).
    pub opened: OpenedKey,
    /// Key material that seals the response to the client.
    pub response_key: ResponseKeyMaterial,
    /// The gateway's trace context, when tracing is on.
    #[serde(default)]
    pub trace: Option<TraceContext>,
}

/// The digest salt is wiped when the envelope is dropped; the response key
/// wipes its own secret.
impl Drop for Envelope {
    fn drop(&mut self) {
        zeroize::Zeroize::zeroize(&mut self.digest_salt);
    }
}

impl zeroize::ZeroizeOnDrop for Envelope {}

/// What later stages need to know about an embeddings request; sent by the
/// entry stage ahead of the request's activations, inside the attested
/// channel.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct RequestContext {
    /// Ids, digests, sealing and the response key.
    pub env: Envelope,
    /// The validated request with `inputs` emptied (texts stay in stage 0).
    pub request: EmbeddingsRequest,
    /// Number of inputs.
    pub n_inputs: u32,
}

/// One prompt of a completions request as later stages see it.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct PromptInfo {
    /// Its length in tokens.
    pub tokens: u32,
    /// Its token ids, only when the exit stage needs them (`echo`).
    pub ids: Option<Vec<u32>>,
}

/// What later stages need to know about a completions request (the
/// generation counterpart of [`RequestContext`]).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct GenerationContext {
    /// Ids, digests, sealing and the response key.
    pub env: Envelope,
    /// The validated request with `prompts` emptied (text stays in stage 0).
    pub request: CompletionsRequest,
    /// The prompts' lengths (and ids when echoed), in order.
    pub prompts: Vec<PromptInfo>,
    /// The sampling seed (the request's, or one drawn by the entry stage).
    pub seed: u64,
    /// Unix seconds when the entry stage accepted the request.
    pub created: u64,
    /// The key the exit stage tags fed-back tokens with (drawn by the entry
    /// stage per request; see [`crate::feedback`]).
    pub feedback_key: crate::feedback::FeedbackKey,
}

/// One sequence's tokens in a generation step.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct StepSeq {
    /// Request it belongs to.
    pub request_id: u64,
    /// Choice index within the request.
    pub choice: u32,
    /// Tokens of this sequence already cached before this step.
    pub pos: u32,
    /// Tokens of this sequence in the step (prompt length for a prefill, 1
    /// for a decode step).
    pub len: u32,
    /// A decode step's input token, which the entry stage was fed back
    /// (`None` for a prefill). The exit stage checks that it is the token it
    /// sampled last for this choice, so tokens that reach the entry stage
    /// from anywhere else fail the request.
    #[serde(default)]
    pub input: Option<u32>,
}

/// Hidden states of one generation step between two stages: the rows of
/// all its sequences packed into one `[tokens, hidden]` f32 tensor.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct StepBatch {
    /// Step id, unique per sending stage.
    pub step_id: u64,
    /// Sequences, in row order.
    pub seqs: Vec<StepSeq>,
    /// `[tokens, hidden]` f32.
    pub hidden: TensorFrame,
}

/// A sampled token on its way back to the entry stage.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct NextToken {
    /// Request.
    pub request_id: u64,
    /// Choice index.
    pub choice: u32,
    /// The token id (the next step's input unless `finished`).
    pub token: u32,
    /// The choice is complete: the entry stage stops feeding it.
    pub finished: bool,
    /// The exit stage's tag over this token under the request's feedback
    /// key; the entry stage fails the request, before feeding anything, on
    /// a tag that does not verify ([`crate::feedback`]).
    pub tag: crate::feedback::FeedbackTag,
}

/// Exit stage → entry stage (generation pipelines of two or more stages).
/// Only token ids cross back, never logits or text.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub enum FeedbackMessage {
    /// The tokens sampled in one step.
    Tokens(Vec<NextToken>),
    /// The exit stage dropped a request (it failed there): stop feeding it.
    Dropped {
        /// The request.
        request_id: u64,
    },
}

/// Stage → next stage.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub enum ActivationMessage {
    /// A request begins (precedes its micro-batches).
    Begin(Box<RequestContext>),
    /// A completions request begins (precedes its steps).
    BeginGeneration(Box<GenerationContext>),
    /// One generation step.
    Step(StepBatch),
    /// A micro-batch to continue.
    Batch(ActivationBatch),
    /// The sending stage's signed receipt links for a request (all earlier
    /// stages' links, its own last), after its last micro-batch.
    Links {
        /// The request.
        request_id: u64,
        /// COSE_Sign1 links in stage order.
        links: Vec<serde_bytes::ByteBuf>,
        /// The timings of the same stages, in the same order.
        #[serde(default)]
        timings: Vec<StageTiming>,
    },
    /// A request failed upstream; pass it on.
    Failed {
        /// The request.
        request_id: u64,
        /// Why.
        error: PipelineError,
    },
}

/// Exit stage → gateway.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub enum ResultMessage {
    /// The finished response, sealed to the client, with its receipt.
    Response {
        /// The request.
        request_id: u64,
        /// HTTP status.
        status: u16,
        /// The response body sealed to the client's response key.
        #[serde(with = "serde_bytes")]
        body: Vec<u8>,
        /// The signed receipt (COSE_Sign1).
        #[serde(with = "serde_bytes")]
        receipt: Vec<u8>,
        /// Its id.
        receipt_id: ReceiptId,
        /// Counts and per-stage timings (no content).
        #[serde(default)]
        telemetry: Option<RequestTelemetry>,
    },
    /// A request failed somewhere in the pipeline.
    Failed {
        /// The request.
        request_id: u64,
        /// Why.
        error: PipelineError,
    },
    /// A streamed response begins (HTTP 200, `text/event-stream`).
    StreamStart {
        /// The request.
        request_id: u64,
        /// The receipt id the stream's receipt will have.
        receipt_id: ReceiptId,
    },
    /// Sealed bytes of the event stream (the first carry the response nonce).
    StreamData {
        /// The request.
        request_id: u64,
        /// Sealed chunks, to append to the response body as they are.
        #[serde(with = "serde_bytes")]
        data: Vec<u8>,
    },
    /// The last sealed bytes of the stream (through `data: [DONE]`, or an
    /// error event), and the receipt over the whole event stream.
    StreamEnd {
        /// The request.
        request_id: u64,
        /// Sealed final chunk(s).
        #[serde(with = "serde_bytes")]
        data: Vec<u8>,
        /// The signed receipt; `None` when the stream ended with an error.
        #[serde(with = "serde_bytes")]
        receipt: Option<Vec<u8>>,
        /// Counts and per-stage timings (no content); `None` on error.
        #[serde(default)]
        telemetry: Option<RequestTelemetry>,
    },
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Issue 34, item 3: an envelope wipes its digest salt when dropped
    /// (its response key wipes its own secret).
    #[test]
    fn an_envelope_is_zeroize_on_drop() {
        fn assert_zod<T: zeroize::ZeroizeOnDrop>() {}
        assert_zod::<Envelope>();
        assert_zod::<ResponseKeyMaterial>();
    }

    /// Issue 47, item 6: the host gets bucketed counts and no finish
    /// reasons for a request sealed to the enclave, all of it otherwise.
    #[test]
    fn telemetry_of_sealed_requests_is_bucketed() {
        let t = RequestTelemetry {
            input_tokens: 13,
            output_tokens: 1_000,
            finish_reasons: vec!["stop".into()],
            ..Default::default()
        };
        let sealed = t.clone().for_host(Sealing::Enclave);
        assert_eq!((sealed.input_tokens, sealed.output_tokens), (16, 1_024));
        assert!(sealed.finish_reasons.is_empty());
        for s in [Sealing::Plain, Sealing::Gateway] {
            assert_eq!(t.clone().for_host(s), t);
        }
        assert_eq!(bucket_count(0), 0);
        for n in [1, 17, 100, 5_000] {
            assert!(bucket_count(n) >= n && bucket_count(n).is_multiple_of(16));
        }
        assert_eq!(bucket_count(1), bucket_count(16));
    }
}
