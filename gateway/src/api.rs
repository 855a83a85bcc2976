//! The HTTP API: routes, body limits, and mapping pipeline failures to
//! OpenAI-shaped errors.

use crate::embeddings;
use crate::openai_error::ApiError;
use crate::pipeline::{Failure, Pipeline};
use axum::body::{to_bytes, Body};
use axum::extract::{Path, State};
use axum::http::{header, HeaderMap, Method, StatusCode, Uri};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Json, Router};
use proto::frames::ErrorKind;
use serde_json::json;
use std::sync::Arc;
use std::time::{Duration, Instant};

/// Settings the handlers need.
#[derive(Clone, Debug)]
pub struct ApiLimits {
    /// Largest request body.
    pub max_body_bytes: usize,
    /// Most inputs per request.
    pub max_inputs: usize,
    /// Per-request deadline.
    pub timeout: Duration,
}

/// Shared handler state.
#[derive(Clone)]
pub struct AppState {
    /// The stage pipeline.
    pub pipeline: Arc<Pipeline>,
    /// Limits.
    pub limits: ApiLimits,
}

/// Builds the router.
pub fn router(state: AppState) -> Router {
    Router::new()
        .route("/v1/embeddings", post(embeddings_handler))
        .route("/v1/models", get(list_models))
        .route("/v1/models/{id}", get(get_model))
        .route("/healthz", get(|| async { Json(json!({"status": "ok"})) }))
        .route("/readyz", get(readyz))
        .fallback(|method: Method, uri: Uri| async move {
            ApiError::unknown_route(method.as_str(), uri.path())
        })
        .method_not_allowed_fallback(|method: Method, uri: Uri| async move {
            ApiError::method_not_allowed(method.as_str(), uri.path())
        })
        .with_state(state)
}

fn model_json(id: &str) -> serde_json::Value {
    json!({"id": id, "object": "model", "created": 0, "owned_by": "confidential-gateway"})
}

async fn list_models(State(s): State<AppState>) -> Response {
    Json(json!({"object": "list", "data": [model_json(&s.pipeline.model_id)]})).into_response()
}

async fn get_model(State(s): State<AppState>, Path(id): Path<String>) -> Response {
    if id == s.pipeline.model_id {
        Json(model_json(&id)).into_response()
    } else {
        ApiError::model_not_found(&id).into_response()
    }
}

async fn readyz(State(s): State<AppState>) -> Response {
    match s.pipeline.status() {
        Ok(stages) => {
            let mock = stages.iter().any(|st| st.evidence == "mock");
            let mut body =
                json!({"status": "ready", "model": s.pipeline.model_id, "stages": stages});
            if mock {
                body["warning"] = json!(proto::attestation::MOCK_WARNING);
            }
            Json(body).into_response()
        }
        Err(reason) => ApiError::not_ready(&reason).into_response(),
    }
}

async fn embeddings_handler(State(s): State<AppState>, headers: HeaderMap, body: Body) -> Response {
    let started = Instant::now();
    let result = embed(&s, &headers, body).await;
    let status = match &result {
        Ok(_) => StatusCode::OK,
        Err(e) => e.status,
    };
    tracing::info!(
        endpoint = "/v1/embeddings",
        status = status.as_u16(),
        latency_ms = started.elapsed().as_secs_f64() * 1e3,
        "request"
    );
    match result {
        Ok(v) => Json(v).into_response(),
        Err(e) => e.into_response(),
    }
}

async fn embed(
    s: &AppState,
    headers: &HeaderMap,
    body: Body,
) -> Result<serde_json::Value, ApiError> {
    let limit = s.limits.max_body_bytes;
    let declared = headers
        .get(header::CONTENT_LENGTH)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.parse::<usize>().ok());
    if declared.is_some_and(|n| n > limit) {
        return Err(ApiError::too_large(limit));
    }
    let bytes = to_bytes(body, limit)
        .await
        .map_err(|_| ApiError::too_large(limit))?;
    let req = embeddings::parse(&bytes, s.limits.max_inputs, s.pipeline.dimension)?;
    if req.model != s.pipeline.model_id {
        return Err(ApiError::model_not_found(&req.model));
    }
    let out = s
        .pipeline
        .embed(req.inputs.clone(), s.limits.timeout)
        .await
        .map_err(|f| match f {
            Failure::NotReady(r) => ApiError::not_ready(&r),
            Failure::Timeout => ApiError::timeout(s.limits.timeout.as_secs()),
            Failure::Stage(e) => match e.kind {
                ErrorKind::BadInput => ApiError::invalid(Some("input"), e.message),
                ErrorKind::Overloaded => ApiError::not_ready(&e.message),
                ErrorKind::Internal => ApiError::internal(e.message),
            },
        })?;
    Ok(embeddings::response(
        &req,
        &s.pipeline.model_id,
        &out.vectors,
        &out.tokens,
    ))
}
