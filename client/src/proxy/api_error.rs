//! The proxy's OpenAI-shaped error responses: the wire form the gateway and
//! the stages use ([`proto::openai::ApiError`]) as an axum response.

use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};

/// An error as the proxy returns it.
#[derive(Debug, Clone)]
pub struct ApiError(pub proto::openai::ApiError);

impl ApiError {
    /// 400 for a malformed request.
    pub fn invalid(param: Option<&str>, message: impl Into<String>) -> Self {
        Self(proto::openai::ApiError::invalid(param, message))
    }

    /// 404 for a model no verified pipeline serves.
    pub fn model_not_found(model: &str) -> Self {
        Self(proto::openai::ApiError::model_not_found(model))
    }

    /// 404 for an unknown route.
    pub fn unknown_route(method: &str, path: &str) -> Self {
        Self(proto::openai::ApiError::unknown_route(method, path))
    }

    /// 405 for a known route with the wrong method.
    pub fn method_not_allowed(method: &str, path: &str) -> Self {
        Self(proto::openai::ApiError::method_not_allowed(method, path))
    }

    /// 500 for a failure inside the proxy.
    pub fn internal(message: impl Into<String>) -> Self {
        Self(proto::openai::ApiError::internal(message))
    }

    /// Any status, with an OpenAI error `kind` and a machine-readable `code`.
    pub fn coded(status: StatusCode, kind: &str, code: &str, message: String) -> Self {
        Self(proto::openai::ApiError {
            status: status.as_u16(),
            message,
            kind: kind.into(),
            param: None,
            code: Some(code.into()),
        })
    }

    /// The JSON body as bytes.
    pub fn body_bytes(&self) -> Vec<u8> {
        self.0.body_bytes()
    }
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        let status =
            StatusCode::from_u16(self.0.status).unwrap_or(StatusCode::INTERNAL_SERVER_ERROR);
        (status, axum::Json(self.0.body())).into_response()
    }
}

impl From<crate::sealed::Refused> for ApiError {
    /// A refused answer or evidence: 502, the refusal's code.
    fn from(r: crate::sealed::Refused) -> Self {
        Self::coded(StatusCode::BAD_GATEWAY, "server_error", r.code, r.message)
    }
}
