//! API keys for the keyed routes (the three POST endpoints, `/v1/models`,
//! `/v1/receipts`; `/v1/attestation` stays open): bearer tokens checked
//! against SHA-256 digests in constant time, with a per-key token-bucket
//! rate limit and a per-key concurrency limit.
//!
//! Tokens are never stored: keys come from `[auth] keys` as digests, or from
//! `GATEWAY_API_KEYS` (`name:token,...`) hashed as soon as they are read.
//! Neither tokens nor digests reach logs, errors or metrics; logs name the
//! key by its configured `name` only.

use crate::config::AuthConfig;
use crate::metrics::{AuthRejection, Metrics};
use crate::openai_error::ApiError;
use anyhow::{bail, Result};
use axum::extract::{Request, State};
use axum::http::{header, HeaderValue, StatusCode};
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};
use std::sync::{Arc, Mutex};
use std::time::Instant;
use subtle::ConstantTimeEq;
use tokio::sync::Semaphore;

/// Environment variable with extra keys: comma-separated `name:token` pairs.
pub const ENV_KEYS: &str = "GATEWAY_API_KEYS";

/// SHA-256 of a token.
pub fn digest(token: &[u8]) -> [u8; 32] {
    proto::digest::Sha256Digest::of(token).0
}

/// Who made a request, when `[auth]` is on: its API key's owner id
/// ([`owner_id`]). The key middleware puts it in the request's extensions;
/// the receipt store keeps it as the receipt's owner. Absent when `[auth]`
/// is off.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Caller(pub Arc<str>);

/// The owner id of the key whose token has SHA-256 `digest`: hex of
/// SHA-256(`"confidential-inference receipt owner v1" ‖ digest`). It follows
/// the token, not the key's name (a label, which may be given to another
/// token later), is the same on every gateway that knows the token, and is
/// not the digest itself (which the config holds).
pub fn owner_id(digest: &[u8; 32]) -> String {
    let mut input = b"confidential-inference receipt owner v1".to_vec();
    input.extend_from_slice(digest);
    proto::digest::Sha256Digest::of(&input).hex()
}

/// The configured keys, their limits and their live state.
pub struct ApiKeys {
    enabled: bool,
    keys: Vec<Key>,
    metrics: Arc<Metrics>,
}

struct Key {
    name: String,
    digest: [u8; 32],
    owner: Arc<str>,
    bucket: Option<Mutex<Bucket>>,
    concurrency: Option<Arc<Semaphore>>,
}

/// A token bucket: `capacity` requests, refilled at `per_sec`.
struct Bucket {
    capacity: f64,
    tokens: f64,
    per_sec: f64,
    last: Instant,
}

impl Bucket {
    fn per_minute(rpm: u32) -> Self {
        Self {
            capacity: rpm as f64,
            tokens: rpm as f64,
            per_sec: rpm as f64 / 60.0,
            last: Instant::now(),
        }
    }

    /// Takes one token, or says how many seconds until one is there.
    fn take(&mut self, now: Instant) -> Result<(), u64> {
        let elapsed = now.saturating_duration_since(self.last).as_secs_f64();
        self.last = now;
        self.tokens = (self.tokens + elapsed * self.per_sec).min(self.capacity);
        if self.tokens >= 1.0 {
            self.tokens -= 1.0;
            Ok(())
        } else {
            Err((((1.0 - self.tokens) / self.per_sec).ceil() as u64).max(1))
        }
    }
}

impl ApiKeys {
    /// Keys from `[auth]` plus those in `env` (the value of [`ENV_KEYS`]).
    /// Errors name the bad entry, never a token.
    pub fn from_config(cfg: &AuthConfig, env: Option<&str>, metrics: Arc<Metrics>) -> Result<Self> {
        let key = |name: String, digest: [u8; 32], rpm: Option<u32>, conc: Option<u32>| Key {
            name,
            digest,
            owner: owner_id(&digest).into(),
            bucket: rpm
                .or(cfg.default_requests_per_minute)
                .map(|r| Mutex::new(Bucket::per_minute(r))),
            concurrency: conc
                .or(cfg.default_max_concurrent)
                .map(|c| Arc::new(Semaphore::new(c as usize))),
        };
        let mut keys = Vec::new();
        for k in &cfg.keys {
            let mut d = [0u8; 32];
            hex::decode_to_slice(&k.sha256, &mut d).map_err(|_| {
                anyhow::anyhow!("auth.keys: {:?}: sha256 is not 64 hex digits", k.name)
            })?;
            keys.push(key(
                k.name.clone(),
                d,
                k.requests_per_minute,
                k.max_concurrent,
            ));
        }
        if let Some(env) = env.filter(|_| cfg.enabled) {
            for (i, pair) in env
                .split(',')
                .map(str::trim)
                .filter(|p| !p.is_empty())
                .enumerate()
            {
                let Some((name, token)) = pair.split_once(':') else {
                    bail!("{ENV_KEYS}: entry {i} is not `name:token`");
                };
                let name = name.trim();
                if name.is_empty() || token.is_empty() {
                    bail!("{ENV_KEYS}: entry {i} has an empty name or token");
                }
                if keys.iter().any(|k: &Key| k.name == name) {
                    bail!("{ENV_KEYS}: entry {i}: key name {name:?} is already used");
                }
                keys.push(key(name.to_string(), digest(token.as_bytes()), None, None));
            }
        }
        if cfg.enabled && keys.is_empty() {
            bail!("auth.enabled: no API keys: add [[auth.keys]] or set {ENV_KEYS}");
        }
        Ok(Self {
            enabled: cfg.enabled,
            keys,
            metrics,
        })
    }

    /// Whether keys are required.
    pub fn enabled(&self) -> bool {
        self.enabled
    }

    /// How many keys are configured.
    pub fn len(&self) -> usize {
        self.keys.len()
    }

    /// Whether no key is configured.
    pub fn is_empty(&self) -> bool {
        self.keys.is_empty()
    }

    /// The key whose digest equals the token's, comparing every key's
    /// digest in constant time (no early exit).
    fn find(&self, token: &[u8]) -> Option<&Key> {
        let d = digest(token);
        let mut found = None;
        for k in &self.keys {
            if bool::from(k.digest.ct_eq(&d)) {
                found = Some(k);
            }
        }
        found
    }
}

fn unauthorized(message: &str) -> Response {
    let mut r = ApiError {
        status: StatusCode::UNAUTHORIZED,
        message: message.to_string(),
        kind: "invalid_request_error",
        param: None,
        code: Some("invalid_api_key"),
        retry_after: None,
    }
    .into_response();
    r.headers_mut()
        .insert(header::WWW_AUTHENTICATE, HeaderValue::from_static("Bearer"));
    r
}

fn too_many(message: String, retry_after: u64) -> Response {
    ApiError::rate_limited(message, retry_after).into_response()
}

/// The bearer token of a request, if it has one.
fn bearer(req: &Request) -> Option<&[u8]> {
    let v = req.headers().get(header::AUTHORIZATION)?.as_bytes();
    let (scheme, rest) = v.split_at(v.iter().position(|b| *b == b' ')?);
    if !scheme.eq_ignore_ascii_case(b"bearer") {
        return None;
    }
    let token = rest.trim_ascii();
    (!token.is_empty()).then_some(token)
}

/// Middleware for the `/v1/*` routes: 401 without a valid key, 429 over
/// the key's limits; otherwise runs the request holding one of the key's
/// concurrency permits until its response body (a whole stream included)
/// has been sent or dropped.
pub async fn require_key(
    State(keys): State<Arc<ApiKeys>>,
    mut req: Request,
    next: Next,
) -> Response {
    if !keys.enabled {
        return next.run(req).await;
    }
    let Some(token) = bearer(&req) else {
        keys.metrics.auth_rejected(AuthRejection::Missing);
        return unauthorized(
            "You didn't provide an API key. Send it as `Authorization: Bearer <key>`.",
        );
    };
    let Some(key) = keys.find(token) else {
        keys.metrics.auth_rejected(AuthRejection::Invalid);
        return unauthorized("Incorrect API key provided.");
    };
    let _permit = match &key.concurrency {
        None => None,
        Some(sem) => match sem.clone().try_acquire_owned() {
            Ok(p) => Some(p),
            Err(_) => {
                keys.metrics.auth_rejected(AuthRejection::Concurrency);
                tracing::info!(key = %key.name, "concurrency limit reached");
                return too_many(
                    format!(
                        "Too many concurrent requests for API key `{}`: wait for one to finish.",
                        key.name
                    ),
                    1,
                );
            }
        },
    };
    if let Some(bucket) = &key.bucket {
        let taken = bucket.lock().unwrap().take(Instant::now());
        if let Err(secs) = taken {
            keys.metrics.auth_rejected(AuthRejection::RateLimited);
            tracing::info!(key = %key.name, retry_after = secs, "rate limit reached");
            return too_many(
                format!(
                    "Rate limit reached for API key `{}`: retry in {secs} s.",
                    key.name
                ),
                secs,
            );
        }
    }
    req.extensions_mut().insert(Caller(key.owner.clone()));
    let resp = next.run(req).await;
    match _permit {
        // The permit lives as long as the response body: a stream counts
        // against the key's limit until it ends or its client goes away.
        Some(permit) => crate::in_flight::hold_until_body_ends(resp, permit),
        None => resp,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::ApiKeyConfig;
    use std::time::Duration;

    fn cfg(keys: Vec<ApiKeyConfig>) -> AuthConfig {
        AuthConfig {
            enabled: true,
            keys,
            ..Default::default()
        }
    }

    #[test]
    fn bucket_refills_and_says_when() {
        let t0 = Instant::now();
        let mut b = Bucket::per_minute(2);
        b.last = t0;
        assert!(b.take(t0).is_ok());
        assert!(b.take(t0).is_ok());
        assert_eq!(b.take(t0), Err(30));
        assert_eq!(b.take(t0 + Duration::from_secs(15)), Err(15));
        assert!(b.take(t0 + Duration::from_secs(31)).is_ok());
    }

    #[test]
    fn config_and_env_keys_match_by_digest() {
        let k = ApiKeyConfig {
            name: "a".into(),
            sha256: hex::encode(digest(b"tok-a")),
            requests_per_minute: None,
            max_concurrent: None,
        };
        let keys = ApiKeys::from_config(
            &cfg(vec![k]),
            Some(" b:tok-b , c:tok:c "),
            Arc::new(Metrics::default()),
        )
        .unwrap();
        assert_eq!(keys.len(), 3);
        assert_eq!(keys.find(b"tok-a").unwrap().name, "a");
        assert_eq!(keys.find(b"tok-b").unwrap().name, "b");
        assert_eq!(keys.find(b"tok:c").unwrap().name, "c");
        assert!(keys.find(b"tok-d").is_none());
    }

    #[test]
    fn bad_env_never_echoes_the_token() {
        let m = Arc::new(Metrics::default());
        let e = ApiKeys::from_config(&cfg(vec![]), Some("secret-token-no-colon"), m.clone())
            .err()
            .unwrap();
        assert!(!format!("{e:#}").contains("secret"), "{e:#}");
        let e = ApiKeys::from_config(&cfg(vec![]), Some(""), m)
            .err()
            .unwrap();
        assert!(format!("{e:#}").contains("no API keys"));
    }
}
