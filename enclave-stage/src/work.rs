//! What the connection handlers and a compute thread exchange, for every
//! model kind: work in arrival order ([`Work`]) and what goes downstream
//! ([`Output`]).

use proto::frames::{
    ActivationBatch, ActivationMessage, BatchItem, FeedbackMessage, GenerationContext,
    PipelineError, RequestContext, ResultMessage, StageTiming,
};

/// Work for the compute thread, in arrival order.
pub enum Work {
    /// A request begins (its context precedes its rows).
    Begin(Box<RequestContext>),
    /// Tokenized inputs (entry stage).
    Seqs(Vec<Seq>),
    /// A micro-batch from the previous stage.
    Batch(ActivationBatch),
    /// The previous stages' receipt links for a request.
    Links {
        /// The request.
        request_id: u64,
        /// Links in stage order.
        links: Vec<Vec<u8>>,
        /// The same stages' timings of the request.
        timings: Vec<StageTiming>,
        /// The receipt key of the attested stage they came from (its link,
        /// the last, must be signed with it).
        signer: [u8; 32],
    },
    /// A request failed upstream.
    Failed {
        /// The request.
        request_id: u64,
        /// Why.
        error: PipelineError,
    },
    /// A completions request opened by the entry stage, with its prompts'
    /// token ids (generation stages).
    BeginGeneration {
        /// What later stages learn about it.
        ctx: Box<GenerationContext>,
        /// Token ids of each prompt.
        prompts: Vec<Vec<u32>>,
    },
    /// A generation message from the previous stage (`BeginGeneration`, `Step`).
    Activation(ActivationMessage),
    /// Sampled tokens from the exit stage (entry stage of a generation pipeline).
    Feedback(FeedbackMessage),
    /// The client went away: drop the request.
    Cancel {
        /// The request.
        request_id: u64,
    },
    /// The pipeline this stage served was torn down: drop every request.
    Reset,
}

impl Work {
    /// The requests this work is about, sorted without repeats (none for
    /// [`Work::Reset`]): what fails when handling it panics.
    pub fn request_ids(&self) -> Vec<u64> {
        let mut ids: Vec<u64> = match self {
            Work::Begin(ctx) => vec![ctx.env.request_id],
            Work::Seqs(seqs) => seqs.iter().map(|s| s.item.request_id).collect(),
            Work::Batch(b) | Work::Activation(ActivationMessage::Batch(b)) => {
                b.items.iter().map(|i| i.request_id).collect()
            }
            Work::BeginGeneration { ctx, .. }
            | Work::Activation(ActivationMessage::BeginGeneration(ctx)) => {
                vec![ctx.env.request_id]
            }
            Work::Activation(ActivationMessage::Begin(ctx)) => vec![ctx.env.request_id],
            Work::Activation(ActivationMessage::Step(b)) => {
                b.seqs.iter().map(|s| s.request_id).collect()
            }
            Work::Activation(
                ActivationMessage::Links { request_id, .. }
                | ActivationMessage::Failed { request_id, .. },
            )
            | Work::Links { request_id, .. }
            | Work::Failed { request_id, .. }
            | Work::Cancel { request_id }
            | Work::Feedback(FeedbackMessage::Dropped { request_id }) => vec![*request_id],
            Work::Feedback(FeedbackMessage::Tokens(t)) => t.iter().map(|t| t.request_id).collect(),
            Work::Reset => Vec::new(),
        };
        ids.sort_unstable();
        ids.dedup();
        ids
    }
}

/// What the compute thread (or a session) sends downstream.
pub enum Output {
    /// To the next stage.
    Activation(ActivationMessage),
    /// To the gateway (exit stage).
    Result(ResultMessage),
    /// To the entry stage, on the feedback channel (generation exit stage).
    Feedback(FeedbackMessage),
}

/// Builds the failure message for the right direction.
pub fn failure(exit: bool, request_id: u64, error: PipelineError) -> Output {
    if exit {
        Output::Result(ResultMessage::Failed { request_id, error })
    } else {
        Output::Activation(ActivationMessage::Failed { request_id, error })
    }
}

/// The failure a cancelled request travels on with (status 499), so that
/// every later stage drops it too.
pub fn cancelled() -> PipelineError {
    PipelineError {
        kind: proto::frames::ErrorKind::Internal,
        status: 499,
        message: "the client closed the request".into(),
        retry_after_secs: None,
        sealed_body: None,
    }
}

/// A request's failure as it travels on: status and `message` for the host,
/// and the OpenAI error `api` sealed to the client when the request's
/// envelope (so its response key) is known here; the host cannot read it.
pub fn sealed_error(
    env: Option<&proto::frames::Envelope>,
    api: &proto::openai::ApiError,
    kind: proto::frames::ErrorKind,
    message: String,
) -> PipelineError {
    let sealed_body =
        env.and_then(|e| proto::sealing::seal_response(&e.response_key, &api.body_bytes()).ok());
    PipelineError {
        kind,
        status: api.status,
        message,
        retry_after_secs: None,
        sealed_body,
    }
}

/// One tokenized input waiting for compute.
#[derive(Clone, Debug)]
pub struct Seq {
    /// Where the result belongs.
    pub item: BatchItem,
    /// Token ids.
    pub ids: Vec<u32>,
}
