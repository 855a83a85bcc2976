//! The gateway-wide cap on requests in flight (`server.max_in_flight`).
//!
//! Connections are capped (`server.max_connections`) and so are HTTP/2
//! streams per connection, but their product is tens of thousands of
//! requests, each of which may hold a body of up to `max_body_bytes`. This
//! cap bounds what the whole gateway works on at once: a `POST` that finds
//! every permit taken gets 503 `server_overloaded` with `Retry-After: 1` at
//! once, before its body is read. A permit is held until the response body
//! (a whole stream included) has been sent or dropped. `GET`s (health,
//! readiness, metrics, keys, evidence, receipts) are not counted, so an
//! overloaded gateway still answers its probes; `/v1/attestation` has its
//! own limits.

use crate::openai_error::ApiError;
use axum::body::Body;
use axum::extract::{Request, State};
use axum::http::Method;
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};
use std::sync::Arc;
use tokio::sync::Semaphore;

/// The permits of `server.max_in_flight`.
pub struct InFlightCap {
    permits: Arc<Semaphore>,
    max: usize,
}

impl InFlightCap {
    /// A cap of `max` requests in flight (at least 1).
    pub fn new(max: usize) -> Arc<Self> {
        let max = max.max(1);
        Arc::new(Self {
            permits: Arc::new(Semaphore::new(max)),
            max,
        })
    }

    /// Requests in flight now.
    pub fn in_flight(&self) -> usize {
        self.max - self.permits.available_permits()
    }
}

/// Middleware: 503 `server_overloaded` for a `POST` when `max_in_flight`
/// requests are already in flight; otherwise runs it holding a permit until
/// its response body ends.
pub async fn limit(State(cap): State<Arc<InFlightCap>>, req: Request, next: Next) -> Response {
    if req.method() != Method::POST {
        return next.run(req).await;
    }
    let Ok(permit) = cap.permits.clone().try_acquire_owned() else {
        tracing::info!(max = cap.max, "requests in flight at the gateway's cap");
        return ApiError::overloaded(cap.max).into_response();
    };
    hold_until_body_ends(next.run(req).await, permit)
}

/// `response` with `guard` kept alive until its body has been sent or
/// dropped (a stream counts until it ends or its client goes away).
pub fn hold_until_body_ends<G: Send + Sync + 'static>(response: Response, guard: G) -> Response {
    response.map(|body| {
        Body::new(http_body_util::BodyExt::map_frame(body, move |frame| {
            let _held = &guard;
            frame
        }))
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use axum::routing::{get, post};
    use axum::Router;
    use http_body_util::BodyExt as _;
    use tower::ServiceExt as _;

    /// A router whose first POST answers with a body that stays open until
    /// the test sends its end through the returned channel; later POSTs
    /// answer at once.
    fn app(cap: Arc<InFlightCap>) -> (Router, tokio::sync::mpsc::Sender<()>) {
        use futures_util::StreamExt as _;
        let (tx, rx) = tokio::sync::mpsc::channel::<()>(1);
        let rx = Arc::new(std::sync::Mutex::new(Some(rx)));
        let work = move || {
            let rx = rx.lock().unwrap().take();
            async move {
                let Some(mut rx) = rx else {
                    return Body::from("quick");
                };
                let first = futures_util::stream::once(async { Ok::<_, std::io::Error>("first") });
                let last = futures_util::stream::once(async move {
                    rx.recv().await;
                    Ok("last")
                });
                Body::from_stream(first.chain(last))
            }
        };
        let router = Router::new()
            .route("/work", post(work))
            .route("/healthz", get(|| async { "ok" }))
            .layer(axum::middleware::from_fn_with_state(cap, limit));
        (router, tx)
    }

    fn post_req() -> Request {
        Request::post("/work").body(Body::empty()).unwrap()
    }

    #[tokio::test]
    async fn past_the_cap_a_post_gets_503_until_a_stream_ends() {
        use futures_util::StreamExt as _;
        let cap = InFlightCap::new(1);
        let (router, end) = app(cap.clone());
        // The first request's response streams and holds the only permit.
        let first = router.clone().oneshot(post_req()).await.unwrap();
        assert_eq!(first.status(), 200);
        assert_eq!(cap.in_flight(), 1);
        let second = router.clone().oneshot(post_req()).await.unwrap();
        assert_eq!(second.status(), 503);
        assert_eq!(second.headers()["retry-after"], "1");
        let body = second.into_body().collect().await.unwrap().to_bytes();
        let v: serde_json::Value = serde_json::from_slice(&body).unwrap();
        assert_eq!(v["error"]["code"], "server_overloaded");
        assert_eq!(v["error"]["type"], "server_error");
        // GETs are not counted: probes are answered.
        let health = router
            .clone()
            .oneshot(Request::get("/healthz").body(Body::empty()).unwrap())
            .await
            .unwrap();
        assert_eq!(health.status(), 200);
        // The stream ends: its permit comes back with its body.
        end.send(()).await.unwrap();
        let mut stream = first.into_body().into_data_stream();
        while stream.next().await.is_some() {}
        drop(stream);
        assert_eq!(cap.in_flight(), 0);
        let third = router.oneshot(post_req()).await.unwrap();
        assert_eq!(third.status(), 200);
    }

    #[tokio::test]
    async fn a_dropped_response_gives_its_permit_back() {
        let cap = InFlightCap::new(1);
        let (router, _end) = app(cap.clone());
        let first = router.clone().oneshot(post_req()).await.unwrap();
        assert_eq!(cap.in_flight(), 1);
        // The client goes away before the stream ends.
        drop(first);
        assert_eq!(cap.in_flight(), 0);
        assert_eq!(router.oneshot(post_req()).await.unwrap().status(), 200);
    }
}
