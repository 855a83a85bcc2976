//! The embedding model as a stage serves it: the start of its compute
//! thread ([`LoadedModel`]) and the entry stage's admission of a request
//! ([`ServedModel`]: validation, tokenization, the bounded queue).

use super::batcher::{BatchLimits, Seq};
use super::compute::{admit_rows, rows_left, Compute};
use super::engine::Engine;
use crate::kernels::bf16_matmul::Kernel;
use crate::model::{
    spawn_compute, Admission, ComputeSetup, LoadedModel, OpenedRequest, Pending, Refusal,
    ServedModel, StageModel,
};
use crate::tokens::off_runtime_if_large;
use crate::work::Work;
use anyhow::Result;
use proto::frames::{BatchItem, RequestContext, StageClaims};
use proto::manifest::LoadedManifest;
use proto::openai::{parse_embeddings, ApiEndpoint, ApiError};
use std::sync::Arc;

/// How many full-size requests' rows (`max_inputs` each) the entry stage
/// queues before it answers 503 + `Retry-After`.
const QUEUED_REQUESTS: usize = 4;

impl LoadedModel for Engine {
    fn manifest_and_claims(&mut self) -> (&LoadedManifest, &mut StageClaims) {
        (&self.manifest, &mut self.claims)
    }

    fn start(self: Box<Self>, setup: ComputeSetup) -> Result<StageModel> {
        let (weights, kernel) = self.weights();
        let kernel_name = kernel.map_or("candle-f32", Kernel::name);
        tracing::info!(%weights, kernel = kernel_name, "weights loaded");
        if kernel == Some(Kernel::Portable) {
            tracing::warn!("this CPU has no AVX-512 BF16: bf16 weights run no faster than f32 here (weights = \"f32\" is as fast and exact)");
        }
        let engine = Arc::new(*self);
        let limits = BatchLimits {
            token_budget: setup.limits.token_budget,
            max_rows: setup.limits.max_rows,
            memory_budget: setup.limits.memory_budget,
        };
        let shape = engine.shape();
        let compute = Compute::new(engine.clone(), setup.keys, setup.out, limits, shape);
        let work = setup.work;
        spawn_compute(move || compute.run(work))?;
        Ok(Arc::new(Embeddings {
            engine,
            max_inputs: setup.limits.max_inputs,
        }))
    }
}

/// A serving embedding stage.
struct Embeddings {
    engine: Arc<Engine>,
    max_inputs: usize,
}

impl ServedModel for Embeddings {
    fn claims(&self) -> &StageClaims {
        &self.engine.claims
    }

    fn serves(&self, endpoint: ApiEndpoint) -> bool {
        !endpoint.is_generation()
    }

    fn has_feedback(&self) -> bool {
        false
    }

    fn admit<'a>(&'a self, request: OpenedRequest<'a>) -> Pending<'a, Result<Admission, Refusal>> {
        Box::pin(self.admit_embeddings(request))
    }
}

impl Embeddings {
    /// Parses, checks and tokenizes an embeddings request, and reserves
    /// room for its rows in the compute thread's bounded queue.
    async fn admit_embeddings(&self, opened: OpenedRequest<'_>) -> Result<Admission, Refusal> {
        let engine = &self.engine;
        let mut request =
            parse_embeddings(opened.plaintext, self.max_inputs, engine.hidden_size())?;
        if request.model != engine.claims.model_id {
            return Err(ApiError::model_not_found(&request.model).into());
        }
        let inputs = std::mem::take(&mut request.inputs);
        let n_inputs = inputs.len() as u32;
        let seqs = tokenize(engine, opened.request_id, inputs)
            .await
            .map_err(|e| ApiError::invalid(Some("input"), e))?;
        // A bounded queue: past it, 503 and retry (before the replay guard
        // remembers the request, so the client's retry is not a replay).
        let rows = seqs.len();
        if !admit_rows(rows, self.max_inputs * QUEUED_REQUESTS) {
            return Err(Refusal {
                api: ApiError {
                    status: 503,
                    message: "The server is at capacity for embeddings; retry shortly.".into(),
                    kind: "server_error".into(),
                    param: None,
                    code: Some("overloaded".into()),
                },
                retry_after_secs: Some(1),
            });
        }
        Ok(Admission {
            work: Box::new(move |env| {
                let ctx = RequestContext {
                    env,
                    request,
                    n_inputs,
                };
                vec![Work::Begin(Box::new(ctx)), Work::Seqs(seqs)]
            }),
            release: Some(Box::new(move || rows_left(rows))),
        })
    }
}

/// Token ids of each input, in order (off the runtime when large).
async fn tokenize(
    engine: &Arc<Engine>,
    request_id: u64,
    inputs: Vec<String>,
) -> Result<Vec<Seq>, String> {
    let total_bytes: usize = inputs.iter().map(|t| t.len()).sum();
    let engine = engine.clone();
    off_runtime_if_large(total_bytes, move || {
        inputs
            .iter()
            .enumerate()
            .map(|(i, t)| {
                let ids = engine.tokenize(t).map_err(|e| format!("input {i}: {e}"))?;
                Ok(Seq {
                    item: BatchItem {
                        request_id,
                        index: i as u32,
                        tokens: ids.len() as u32,
                    },
                    ids,
                })
            })
            .collect::<Result<Vec<_>, String>>()
    })
    .await
}
