//! OpenAI-shaped error responses: `{"error":{"message","type","param","code"}}`.

use axum::http::{header, HeaderValue, StatusCode};
use axum::response::{IntoResponse, Response};

/// The code of a sealed request refused for its sealing time.
pub const SEALED_REQUEST_STALE: &str = "sealed_request_stale";

/// An error as the API returns it.
#[derive(Debug, Clone)]
pub struct ApiError {
    /// HTTP status.
    pub status: StatusCode,
    /// Human-readable message (never echoes request content).
    pub message: String,
    /// OpenAI error type.
    pub kind: &'static str,
    /// The offending parameter, if any.
    pub param: Option<&'static str>,
    /// Machine-readable code, if any.
    pub code: Option<&'static str>,
    /// Seconds to wait before retrying (503).
    pub retry_after: Option<u64>,
}

impl ApiError {
    fn new(status: StatusCode, kind: &'static str, message: impl Into<String>) -> Self {
        Self {
            status,
            message: message.into(),
            kind,
            param: None,
            code: None,
            retry_after: None,
        }
    }

    /// 400 for a request that is malformed or asks for something unsupported.
    pub fn invalid(param: Option<&'static str>, message: impl Into<String>) -> Self {
        Self {
            param,
            ..Self::new(StatusCode::BAD_REQUEST, "invalid_request_error", message)
        }
    }

    /// 404 for an unknown model.
    pub fn model_not_found(model: &str) -> Self {
        Self {
            param: Some("model"),
            code: Some("model_not_found"),
            ..Self::new(
                StatusCode::NOT_FOUND,
                "invalid_request_error",
                proto::openai::ApiError::model_not_found(model).message,
            )
        }
    }

    /// 404 for an unknown route.
    pub fn unknown_route(method: &str, path: &str) -> Self {
        Self {
            code: Some("unknown_url"),
            ..Self::new(
                StatusCode::NOT_FOUND,
                "invalid_request_error",
                proto::openai::ApiError::unknown_route(method, path).message,
            )
        }
    }

    /// 405 for a known route with the wrong method.
    pub fn method_not_allowed(method: &str, path: &str) -> Self {
        Self::new(
            StatusCode::METHOD_NOT_ALLOWED,
            "invalid_request_error",
            proto::openai::ApiError::method_not_allowed(method, path).message,
        )
    }

    /// 413 for a body over the limit.
    pub fn too_large(limit: usize) -> Self {
        Self {
            code: Some("request_too_large"),
            ..Self::new(
                StatusCode::PAYLOAD_TOO_LARGE,
                "invalid_request_error",
                format!("Request body exceeds the limit of {limit} bytes."),
            )
        }
    }

    /// 503 when the pipeline cannot serve.
    pub fn not_ready(reason: &str) -> Self {
        Self {
            code: Some("pipeline_not_ready"),
            retry_after: Some(1),
            ..Self::new(
                StatusCode::SERVICE_UNAVAILABLE,
                "server_error",
                format!("The inference pipeline is not ready: {reason}"),
            )
        }
    }

    /// 503 when the receipt store cannot be read.
    pub fn receipt_store_unavailable() -> Self {
        Self {
            code: Some("receipt_store_unavailable"),
            retry_after: Some(1),
            ..Self::new(
                StatusCode::SERVICE_UNAVAILABLE,
                "server_error",
                "The receipt store cannot be read now; try again.",
            )
        }
    }

    /// 503 + `Retry-After` when the replay guard of the gateway-held key is
    /// full of keys still inside their window.
    pub fn replay_guard_full(retry_after_secs: u64) -> Self {
        Self {
            code: Some("replay_guard_full"),
            retry_after: Some(retry_after_secs),
            ..Self::new(
                StatusCode::SERVICE_UNAVAILABLE,
                "server_error",
                format!("Too many sealed requests to remember for replay protection; retry in {retry_after_secs} s."),
            )
        }
    }

    /// 503 `server_overloaded` + `Retry-After: 1` when the gateway already
    /// has `max` requests in flight (`server.max_in_flight`).
    pub fn overloaded(max: usize) -> Self {
        Self {
            code: Some("server_overloaded"),
            retry_after: Some(1),
            ..Self::new(
                StatusCode::SERVICE_UNAVAILABLE,
                "server_error",
                format!("The gateway is at its limit of {max} requests in flight; retry shortly."),
            )
        }
    }

    /// 429 `rate_limit_exceeded` + `Retry-After` (OpenAI's type `requests`).
    pub fn rate_limited(message: impl Into<String>, retry_after_secs: u64) -> Self {
        Self {
            code: Some("rate_limit_exceeded"),
            retry_after: Some(retry_after_secs),
            ..Self::new(StatusCode::TOO_MANY_REQUESTS, "requests", message)
        }
    }

    /// 504 when a request times out.
    pub fn timeout(secs: u64) -> Self {
        Self {
            code: Some("timeout"),
            ..Self::new(
                StatusCode::GATEWAY_TIMEOUT,
                "server_error",
                format!("The request did not complete within {secs} s."),
            )
        }
    }

    /// 503 for a request refused or cancelled because the gateway is
    /// shutting down.
    pub fn shutting_down() -> Self {
        Self {
            code: Some("shutting_down"),
            retry_after: Some(1),
            ..Self::new(
                StatusCode::SERVICE_UNAVAILABLE,
                "server_error",
                "The gateway is shutting down; retry the request.",
            )
        }
    }

    /// 400 for a sealed request to a key that is not (or no longer) published.
    pub fn unknown_key(key_id: u8) -> Self {
        Self {
            param: Some("hpke-key-id"),
            code: Some("hpke_key_unknown"),
            ..Self::new(
                StatusCode::BAD_REQUEST,
                "invalid_request_error",
                format!(
                    "HPKE key id {key_id} is not a current key: fetch the current keys from \
                     /.well-known/hpke-keys (or /v1/attestation) and seal again."
                ),
            )
        }
    }

    /// A failure reported by a stage without a sealed body.
    pub fn from_stage(status: u16, message: String) -> Self {
        let status = StatusCode::from_u16(status).unwrap_or(StatusCode::INTERNAL_SERVER_ERROR);
        let kind = if status.is_client_error() {
            "invalid_request_error"
        } else {
            "server_error"
        };
        Self::new(status, kind, message)
    }

    /// A stage's refusal of a request, in OpenAI's shape (an unknown key
    /// keeps its `hpke_key_unknown` code, which clients act on).
    pub fn from_pipeline(e: proto::frames::PipelineError) -> Self {
        let kind = e.kind;
        let mut api = Self::from_stage(e.status, e.message);
        match kind {
            proto::frames::ErrorKind::UnknownKey => {
                api.param = Some("hpke-key-id");
                api.code = Some("hpke_key_unknown");
            }
            proto::frames::ErrorKind::Stale => {
                api.param = Some(proto::sealing::HEADER_SEALED_AT);
                api.code = Some(SEALED_REQUEST_STALE);
            }
            _ => {}
        }
        api
    }

    /// 400 `sealed_request_stale` for a sealed request the gateway opened
    /// whose sealing time is too far from its clock.
    pub fn stale(e: proto::sealing::SealError) -> Self {
        Self {
            param: Some(proto::sealing::HEADER_SEALED_AT),
            code: Some(SEALED_REQUEST_STALE),
            ..Self::invalid(None, format!("the sealed request is refused: {e}"))
        }
    }

    /// 500 for a failure inside the pipeline.
    pub fn internal(message: impl Into<String>) -> Self {
        Self::new(StatusCode::INTERNAL_SERVER_ERROR, "server_error", message)
    }

    /// The same error in the wire form the stages also use (one body shape).
    pub fn wire(&self) -> proto::openai::ApiError {
        proto::openai::ApiError {
            status: self.status.as_u16(),
            message: self.message.clone(),
            kind: self.kind.to_string(),
            param: self.param.map(str::to_string),
            code: self.code.map(str::to_string),
        }
    }

    /// The JSON body as bytes.
    pub fn body_bytes(&self) -> Vec<u8> {
        self.wire().body_bytes()
    }
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        let mut resp = (self.status, axum::Json(self.wire().body())).into_response();
        if let Some(s) = self.retry_after {
            resp.headers_mut()
                .insert(header::RETRY_AFTER, HeaderValue::from(s));
        }
        resp
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_full_replay_guard_is_a_503_with_retry_after() {
        let r = ApiError::replay_guard_full(7).into_response();
        assert_eq!(r.status(), StatusCode::SERVICE_UNAVAILABLE);
        assert_eq!(r.headers()[axum::http::header::RETRY_AFTER], "7");
    }
}
