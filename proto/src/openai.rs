//! The OpenAI API's wire format as the entry and exit stages speak it:
//! request validation, response bodies and error bodies. It lives in
//! `proto` because the stages, not the host, read the (sealed) requests and
//! write the (sealed) responses. Kept free of I/O so every rule is unit-tested.

use base64::Engine as _;
use serde::{Deserialize, Serialize};
use serde_json::{json, Value};

/// The API paths the stages serve (compared as this enum, not as strings).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum ApiEndpoint {
    /// `POST /v1/embeddings`.
    Embeddings,
    /// `POST /v1/completions`.
    Completions,
    /// `POST /v1/chat/completions`.
    ChatCompletions,
}

impl ApiEndpoint {
    /// Every endpoint.
    pub const ALL: [ApiEndpoint; 3] = [
        ApiEndpoint::Embeddings,
        ApiEndpoint::Completions,
        ApiEndpoint::ChatCompletions,
    ];

    /// The path (what receipts name).
    pub const fn path(self) -> &'static str {
        match self {
            ApiEndpoint::Embeddings => "/v1/embeddings",
            ApiEndpoint::Completions => "/v1/completions",
            ApiEndpoint::ChatCompletions => "/v1/chat/completions",
        }
    }

    /// The endpoint at `path`, if the stages serve it.
    pub fn from_path(path: &str) -> Option<Self> {
        Self::ALL.into_iter().find(|e| e.path() == path)
    }

    /// Whether a generation model serves it (completions and chat).
    pub fn is_generation(self) -> bool {
        !matches!(self, ApiEndpoint::Embeddings)
    }
}

/// An OpenAI-shaped error: HTTP status plus
/// `{"error":{"message","type","param","code"}}`.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct ApiError {
    /// HTTP status.
    pub status: u16,
    /// Human-readable message (never echoes request content).
    pub message: String,
    /// OpenAI error type (`invalid_request_error`, `server_error`).
    pub kind: String,
    /// The offending parameter, if any.
    pub param: Option<String>,
    /// Machine-readable code, if any.
    pub code: Option<String>,
}

impl ApiError {
    /// An `invalid_request_error` with `status`.
    fn request_error(
        status: u16,
        message: String,
        param: Option<&str>,
        code: Option<&str>,
    ) -> Self {
        Self {
            status,
            message,
            kind: "invalid_request_error".into(),
            param: param.map(str::to_string),
            code: code.map(str::to_string),
        }
    }

    /// 400 for a malformed or unsupported request.
    pub fn invalid(param: Option<&str>, message: impl Into<String>) -> Self {
        Self::request_error(400, message.into(), param, None)
    }

    /// 404 for an unknown model.
    pub fn model_not_found(model: &str) -> Self {
        let message =
            format!("The model `{model}` does not exist or you do not have access to it.");
        Self::request_error(404, message, Some("model"), Some("model_not_found"))
    }

    /// 404 for an unknown route.
    pub fn unknown_route(method: &str, path: &str) -> Self {
        let message = format!("Unrecognized request URL ({method} {path}).");
        Self::request_error(404, message, None, Some("unknown_url"))
    }

    /// 405 for a known route with the wrong method.
    pub fn method_not_allowed(method: &str, path: &str) -> Self {
        let message = format!("Method {method} is not allowed for {path}.");
        Self::request_error(405, message, None, None)
    }

    /// 500 for a failure inside the pipeline.
    pub fn internal(message: impl Into<String>) -> Self {
        Self {
            status: 500,
            message: message.into(),
            kind: "server_error".into(),
            param: None,
            code: None,
        }
    }

    /// The JSON body.
    pub fn body(&self) -> Value {
        json!({"error": {"message": self.message, "type": self.kind, "param": self.param, "code": self.code}})
    }

    /// The JSON body as bytes.
    pub fn body_bytes(&self) -> Vec<u8> {
        serde_json::to_vec(&self.body()).expect("JSON of a JSON value")
    }
}

/// `Err` of a 400 naming `param`: how request validation reports a bad field.
pub fn invalid<T>(param: &str, message: impl Into<String>) -> Result<T, ApiError> {
    Err(ApiError::invalid(Some(param), message))
}

/// How vectors are encoded in the response.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub enum Encoding {
    /// JSON float arrays.
    Float,
    /// Base64 of little-endian f32 bytes (what the OpenAI SDKs decode).
    Base64,
}

/// A validated embeddings request.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct EmbeddingsRequest {
    /// The model asked for.
    pub model: String,
    /// The texts, in order.
    pub inputs: Vec<String>,
    /// Response encoding.
    pub encoding: Encoding,
    /// Output dimensions (truncate + renormalise), if asked.
    pub dimensions: Option<usize>,
}

const TOKEN_IDS: &str = "Token-id arrays are not supported as `input`: send the text itself \
(a string or an array of strings). LangChain's OpenAIEmbeddings sends token ids by default; \
set `check_embedding_ctx_length=False` (and `tiktoken_enabled=False`) to send text.";

/// Parses a request body that must be a JSON object.
pub(crate) fn json_object(body: &[u8]) -> Result<Value, ApiError> {
    let v: Value = serde_json::from_slice(body)
        .map_err(|e| ApiError::invalid(None, format!("The request body is not valid JSON: {e}")))?;
    if !v.is_object() {
        return Err(ApiError::invalid(
            None,
            "The request body must be a JSON object.",
        ));
    }
    Ok(v)
}

/// The required, non-empty `model` field.
pub(crate) fn model_field(obj: &serde_json::Map<String, Value>) -> Result<String, ApiError> {
    match obj.get("model") {
        Some(Value::String(s)) if !s.is_empty() => Ok(s.clone()),
        Some(_) => invalid("model", "`model` must be a non-empty string."),
        None => invalid("model", "You must provide a model parameter."),
    }
}

/// The optional `user` field (accepted, never used or logged) must be a string.
pub(crate) fn user_field(obj: &serde_json::Map<String, Value>) -> Result<(), ApiError> {
    match obj.get("user") {
        Some(u) if !u.is_string() => invalid("user", "`user` must be a string."),
        _ => Ok(()),
    }
}

/// Parses and validates a request body.
pub fn parse_embeddings(
    body: &[u8],
    max_inputs: usize,
    native_dim: usize,
) -> Result<EmbeddingsRequest, ApiError> {
    let v = json_object(body)?;
    let obj = v.as_object().expect("checked");
    let model = model_field(obj)?;
    let inputs = match obj.get("input") {
        None | Some(Value::Null) => {
            return invalid("input", "You must provide an `input` parameter.")
        }
        Some(Value::String(s)) => vec![s.clone()],
        Some(Value::Array(items)) => {
            if items.is_empty() {
                return invalid("input", "`input` must not be an empty array.");
            }
            if items.len() > max_inputs {
                return invalid(
                    "input",
                    format!(
                        "`input` has {} items; at most {max_inputs} are allowed per request.",
                        items.len()
                    ),
                );
            }
            let mut out = Vec::with_capacity(items.len());
            for (i, it) in items.iter().enumerate() {
                match it {
                    Value::String(s) => out.push(s.clone()),
                    Value::Number(_) | Value::Array(_) => return invalid("input", TOKEN_IDS),
                    _ => return invalid("input", format!("`input[{i}]` must be a string.")),
                }
            }
            out
        }
        Some(_) => return invalid("input", "`input` must be a string or an array of strings."),
    };
    if let Some(i) = inputs.iter().position(|s| s.is_empty()) {
        return invalid(
            "input",
            format!("`input[{i}]` is an empty string; every input must contain text."),
        );
    }
    let encoding = match obj.get("encoding_format") {
        None | Some(Value::Null) => Encoding::Float,
        Some(Value::String(s)) if s == "float" => Encoding::Float,
        Some(Value::String(s)) if s == "base64" => Encoding::Base64,
        Some(_) => {
            return invalid(
                "encoding_format",
                "`encoding_format` must be \"float\" or \"base64\".",
            )
        }
    };
    let dimensions = match obj.get("dimensions") {
        None | Some(Value::Null) => None,
        Some(Value::Number(n)) => match n.as_u64() {
            Some(d) if d >= 1 && d as usize <= native_dim => Some(d as usize),
            _ => {
                return invalid(
                    "dimensions",
                    format!(
                        "`dimensions` must be an integer from 1 to {native_dim} for this model."
                    ),
                )
            }
        },
        Some(_) => return invalid("dimensions", "`dimensions` must be an integer."),
    };
    user_field(obj)?;
    Ok(EmbeddingsRequest {
        model,
        inputs,
        encoding,
        dimensions,
    })
}

/// Truncates to `dims` and renormalises to unit length.
pub fn shorten(v: &[f32], dims: usize) -> Vec<f32> {
    let mut out = v[..dims.min(v.len())].to_vec();
    let norm = out.iter().map(|x| x * x).sum::<f32>().sqrt();
    if norm > 0.0 {
        out.iter_mut().for_each(|x| *x /= norm);
    }
    out
}

/// Builds the response body.
pub fn embeddings_response(
    req: &EmbeddingsRequest,
    model: &str,
    vectors: &[Vec<f32>],
    tokens: &[u32],
) -> Value {
    let data: Vec<Value> = vectors
        .iter()
        .enumerate()
        .map(|(i, v)| {
            let v = match req.dimensions {
                Some(d) if d < v.len() => shorten(v, d),
                _ => v.clone(),
            };
            let embedding = match req.encoding {
                Encoding::Float => json!(v),
                Encoding::Base64 => {
                    let bytes: Vec<u8> = v.iter().flat_map(|x| x.to_le_bytes()).collect();
                    json!(base64::engine::general_purpose::STANDARD.encode(bytes))
                }
            };
            json!({"object": "embedding", "index": i, "embedding": embedding})
        })
        .collect();
    let total: u64 = tokens.iter().map(|&t| t as u64).sum();
    json!({
        "object": "list",
        "data": data,
        "model": model,
        "usage": {"prompt_tokens": total, "total_tokens": total},
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn endpoints_by_path() {
        for e in ApiEndpoint::ALL {
            assert_eq!(ApiEndpoint::from_path(e.path()), Some(e));
        }
        assert_eq!(ApiEndpoint::from_path("/v1/models"), None);
        assert_eq!(ApiEndpoint::from_path("/v1/completions/"), None);
        assert!(!ApiEndpoint::Embeddings.is_generation());
        assert!(ApiEndpoint::ChatCompletions.is_generation());
    }

    fn p(body: &str) -> Result<EmbeddingsRequest, ApiError> {
        parse_embeddings(body.as_bytes(), 4, 384)
    }

    fn param_of(body: &str) -> Option<&'static str> {
        let e = p(body).unwrap_err();
        assert_eq!(e.status, 400, "{body}");
        e.param.map(|p| &*Box::leak(p.into_boxed_str()))
    }

    #[test]
    fn accepts_string_and_array() {
        let r = p(r#"{"model":"m","input":"hi"}"#).unwrap();
        assert_eq!(r.inputs, vec!["hi"]);
        assert_eq!(r.encoding, Encoding::Float);
        let r = p(r#"{"model":"m","input":["a","b"],"encoding_format":"base64","dimensions":8,"user":"u"}"#).unwrap();
        assert_eq!(r.inputs.len(), 2);
        assert_eq!(r.encoding, Encoding::Base64);
        assert_eq!(r.dimensions, Some(8));
    }

    #[test]
    fn rejects_bad_input_with_the_right_param() {
        assert_eq!(param_of("not json"), None);
        assert_eq!(param_of("[1]"), None);
        assert_eq!(param_of(r#"{"input":"x"}"#), Some("model"));
        assert_eq!(param_of(r#"{"model":"m"}"#), Some("input"));
        assert_eq!(param_of(r#"{"model":"m","input":[]}"#), Some("input"));
        assert_eq!(param_of(r#"{"model":"m","input":""}"#), Some("input"));
        assert_eq!(param_of(r#"{"model":"m","input":["a",""]}"#), Some("input"));
        assert_eq!(
            param_of(r#"{"model":"m","input":["a","b","c","d","e"]}"#),
            Some("input")
        );
        assert_eq!(param_of(r#"{"model":"m","input":5}"#), Some("input"));
        assert_eq!(
            param_of(r#"{"model":"m","input":"a","encoding_format":"int8"}"#),
            Some("encoding_format")
        );
        assert_eq!(
            param_of(r#"{"model":"m","input":"a","dimensions":385}"#),
            Some("dimensions")
        );
        assert_eq!(
            param_of(r#"{"model":"m","input":"a","dimensions":0}"#),
            Some("dimensions")
        );
        assert_eq!(
            param_of(r#"{"model":"m","input":"a","dimensions":1.5}"#),
            Some("dimensions")
        );
    }

    #[test]
    fn token_id_arrays_say_what_to_do() {
        for body in [
            r#"{"model":"m","input":[1,2,3]}"#,
            r#"{"model":"m","input":[[1,2],[3]]}"#,
        ] {
            let e = p(body).unwrap_err();
            assert!(
                e.message.contains("check_embedding_ctx_length=False"),
                "{}",
                e.message
            );
        }
    }

    #[test]
    fn base64_is_little_endian_f32_and_dimensions_renormalise() {
        let req = EmbeddingsRequest {
            model: "m".into(),
            inputs: vec!["a".into()],
            encoding: Encoding::Base64,
            dimensions: Some(2),
        };
        let body = embeddings_response(&req, "m", &[vec![3.0, 4.0, 12.0]], &[5]);
        let b64 = body["data"][0]["embedding"].as_str().unwrap();
        let bytes = base64::engine::general_purpose::STANDARD
            .decode(b64)
            .unwrap();
        let vals: Vec<f32> = bytes
            .chunks(4)
            .map(|c| f32::from_le_bytes(c.try_into().unwrap()))
            .collect();
        assert_eq!(vals, vec![0.6, 0.8]);
        assert_eq!(body["usage"]["prompt_tokens"], 5);
        assert_eq!(body["model"], "m");
    }
}
