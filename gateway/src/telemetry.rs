//! OpenTelemetry traces over OTLP/HTTP (protobuf), when `[telemetry]
//! otlp_endpoint` is set; off by default, and then nothing here runs: no
//! exporter, no OpenTelemetry layer, and the request span is `Span::none()`.
//!
//! One span per `/v1/embeddings`, `/v1/completions` or `/v1/chat/completions` request (GenAI
//! semantic conventions: `gen_ai.operation.name`, `gen_ai.request.model`,
//! `gen_ai.response.model`, `gen_ai.usage.*`, `gen_ai.response.finish_reasons`,
//! plus `http.route` and `http.response.status_code`), continuing the
//! caller's W3C `traceparent` when it sends one. Its trace id and span id go
//! to the entry stage inside the attested channel ([`TraceContext`]); the
//! stages report their timings back with the response, and the gateway
//! emits a child span per stage hop (with a `queue` child) at the times the
//! stages measured. Spans carry ids, counts, times, model ids and status
//! codes only: never prompts, outputs, keys or tokens.

use axum::extract::{MatchedPath, Request, State};
use axum::http::HeaderMap;
use axum::middleware::Next;
use axum::response::Response;
use opentelemetry::trace::{
    Span as _, SpanContext, SpanId, SpanKind, Status, TraceContextExt, TraceFlags, TraceId,
    TraceState, Tracer as _, TracerProvider as _,
};
use opentelemetry::{Array, KeyValue, StringValue, Value};
use opentelemetry_otlp::{Protocol, WithExportConfig};
use opentelemetry_sdk::trace::{
    BatchConfigBuilder, BatchSpanProcessor, Sampler, SdkTracer, SdkTracerProvider,
};
use proto::frames::{RequestTelemetry, TraceContext};
use serde::{Deserialize, Serialize};
use std::sync::{Arc, OnceLock};
use std::time::{Duration, SystemTime, UNIX_EPOCH};
use tracing::Instrument;
use tracing_opentelemetry::OpenTelemetrySpanExt;
use tracing_subscriber::Layer as _;

/// Target of the request spans; the OpenTelemetry layer sees nothing else
/// (no log line of any module becomes a span event).
pub const TARGET: &str = "gateway::telemetry";
/// How often the batch exporter sends.
const EXPORT_DELAY: Duration = Duration::from_millis(500);
/// Timeout of one export.
const EXPORT_TIMEOUT: Duration = Duration::from_secs(5);

/// `[telemetry]`: where traces go.
#[derive(Clone, Debug, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct TelemetryConfig {
    /// OTLP/HTTP collector base URL (`http://127.0.0.1:4318`; `/v1/traces`
    /// is appended unless present). Unset: no tracing.
    #[serde(default)]
    pub otlp_endpoint: Option<String>,
    /// `service.name` of the exported resource.
    #[serde(default = "default_service_name")]
    pub service_name: String,
    /// Fraction of new traces sampled (a caller's sampled flag is followed).
    #[serde(default = "default_sample_ratio")]
    pub sample_ratio: f64,
}

impl Default for TelemetryConfig {
    fn default() -> Self {
        Self {
            otlp_endpoint: None,
            service_name: default_service_name(),
            sample_ratio: default_sample_ratio(),
        }
    }
}

fn default_service_name() -> String {
    "confidential-gateway".into()
}
fn default_sample_ratio() -> f64 {
    1.0
}

impl TelemetryConfig {
    /// Checks the values; `key` names a key path in errors.
    pub fn validate(&self, key: &dyn Fn(&str) -> String) -> anyhow::Result<()> {
        if let Some(e) = &self.otlp_endpoint {
            if !e.starts_with("http://") {
                anyhow::bail!(
                    "{}: must be an http:// URL (OTLP/HTTP; send to a local OpenTelemetry \
                     Collector, which can forward over TLS), got {e:?}",
                    key("telemetry.otlp_endpoint")
                );
            }
        }
        if !(0.0..=1.0).contains(&self.sample_ratio) {
            anyhow::bail!("{}: must be between 0 and 1", key("telemetry.sample_ratio"));
        }
        if self.service_name.is_empty() {
            anyhow::bail!("{}: must not be empty", key("telemetry.service_name"));
        }
        Ok(())
    }

    /// The traces URL.
    fn traces_url(&self) -> Option<String> {
        let e = self.otlp_endpoint.as_deref()?.trim_end_matches('/');
        Some(if e.ends_with("/v1/traces") {
            e.to_string()
        } else {
            format!("{e}/v1/traces")
        })
    }
}

struct Exporting {
    provider: SdkTracerProvider,
    tracer: SdkTracer,
}

static EXPORTING: OnceLock<Exporting> = OnceLock::new();

/// Installs logging and, when `cfg` names an OTLP endpoint, the trace
/// exporter.
pub fn init_logging(cfg: Option<TelemetryConfig>) {
    let Some((cfg, url)) = cfg.and_then(|c| c.traces_url().map(|u| (c, u))) else {
        proto::io::logging::init();
        return;
    };
    match build(&cfg, &url) {
        Ok(x) => {
            let layer = tracing_opentelemetry::layer()
                .with_tracer(x.tracer.clone())
                .with_filter(
                    tracing_subscriber::filter::Targets::new()
                        .with_target(TARGET, tracing::Level::INFO),
                )
                .boxed();
            proto::io::logging::init_with(Some(layer));
            let _ = EXPORTING.set(x);
            tracing::info!(endpoint = %url, sample_ratio = cfg.sample_ratio, "exporting traces over OTLP/HTTP");
        }
        Err(e) => {
            proto::io::logging::init();
            tracing::error!(endpoint = %url, error = %e, "OTLP exporter not started; no traces");
        }
    }
}

fn build(cfg: &TelemetryConfig, url: &str) -> anyhow::Result<Exporting> {
    let exporter = opentelemetry_otlp::SpanExporter::builder()
        .with_http()
        .with_protocol(Protocol::HttpBinary)
        .with_endpoint(url)
        .with_timeout(EXPORT_TIMEOUT)
        .build()?;
    let processor = BatchSpanProcessor::builder(exporter)
        .with_batch_config(
            BatchConfigBuilder::default()
                .with_scheduled_delay(EXPORT_DELAY)
                .build(),
        )
        .build();
    let provider = SdkTracerProvider::builder()
        .with_span_processor(processor)
        .with_sampler(Sampler::ParentBased(Box::new(Sampler::TraceIdRatioBased(
            cfg.sample_ratio,
        ))))
        .with_resource(
            opentelemetry_sdk::Resource::builder()
                .with_service_name(cfg.service_name.clone())
                .build(),
        )
        .build();
    let tracer = provider.tracer("gateway");
    Ok(Exporting { provider, tracer })
}

/// Whether traces are exported.
pub fn enabled() -> bool {
    EXPORTING.get().is_some()
}

/// Sends what is still buffered and stops the exporter (end of `serve`).
pub fn shutdown() {
    if let Some(x) = EXPORTING.get() {
        if let Err(e) = x.provider.shutdown() {
            tracing::warn!(error = %e, "trace exporter shutdown");
        }
    }
}

/// Parses a W3C `traceparent` header (`00-<trace id>-<span id>-<flags>`).
pub fn parse_traceparent(v: &str) -> Option<TraceContext> {
    let mut parts = v.trim().split('-');
    let (version, trace, span, flags) =
        (parts.next()?, parts.next()?, parts.next()?, parts.next()?);
    if version.len() != 2 || version == "ff" || (version == "00" && parts.next().is_some()) {
        return None;
    }
    let trace_id: [u8; 16] = hex::decode(trace).ok()?.try_into().ok()?;
    let span_id: [u8; 8] = hex::decode(span).ok()?.try_into().ok()?;
    let flags = u8::from_str_radix(flags, 16)
        .ok()
        .filter(|_| flags.len() == 2)?;
    if trace_id == [0; 16] || span_id == [0; 8] {
        return None;
    }
    Some(TraceContext {
        trace_id,
        span_id,
        flags,
    })
}

fn remote_context(t: &TraceContext) -> opentelemetry::Context {
    opentelemetry::Context::new().with_remote_span_context(SpanContext::new(
        TraceId::from_bytes(t.trace_id),
        SpanId::from_bytes(t.span_id),
        TraceFlags::new(t.flags),
        true,
        TraceState::default(),
    ))
}

/// The request span of the current task, when tracing is on and one is
/// entered (captured by the pipeline at submission).
pub fn current_request_span() -> Option<tracing::Span> {
    if !enabled() {
        return None;
    }
    let span = tracing::Span::current();
    span.metadata()
        .is_some_and(|m| m.target() == TARGET)
        .then_some(span)
}

/// The trace context the stages get for `span`: its trace id and span id.
pub fn trace_context(span: &tracing::Span) -> Option<TraceContext> {
    let cx = span.context();
    let sc = cx.span().span_context().clone();
    sc.is_valid().then(|| TraceContext {
        trace_id: sc.trace_id().to_bytes(),
        span_id: sc.span_id().to_bytes(),
        flags: sc.trace_flags().to_u8(),
    })
}

fn at(unix_ns: u64) -> SystemTime {
    UNIX_EPOCH + Duration::from_nanos(unix_ns)
}

/// Records what the stages reported on the request span and emits one child
/// span per stage hop (and its queue wait) at the stages' times.
pub fn record_outcome(span: &tracing::Span, model: &str, generation: bool, t: &RequestTelemetry) {
    let Some(x) = EXPORTING.get() else { return };
    span.set_attribute("gen_ai.response.model", model.to_string());
    span.set_attribute("gen_ai.usage.input_tokens", t.input_tokens as i64);
    if generation {
        span.set_attribute("gen_ai.usage.output_tokens", t.output_tokens as i64);
        let reasons: Vec<StringValue> = t
            .finish_reasons
            .iter()
            .map(|r| StringValue::from(r.clone()))
            .collect();
        span.set_attribute(
            "gen_ai.response.finish_reasons",
            Value::Array(Array::String(reasons)),
        );
    }
    let parent = span.context();
    for s in &t.stages {
        let attrs = vec![
            KeyValue::new("gateway.stage.index", s.stage_index as i64),
            KeyValue::new("gateway.stage.queue_ns", s.queue_ns as i64),
            KeyValue::new("gateway.stage.compute_ns", s.compute_ns as i64),
            KeyValue::new("gateway.stage.batches", s.batches as i64),
        ];
        let mut hop = x
            .tracer
            .span_builder(format!("stage {}", s.stage_index))
            .with_kind(SpanKind::Internal)
            .with_start_time(at(s.start_unix_ns))
            .with_attributes(attrs)
            .start_with_context(&x.tracer, &parent);
        let hop_cx = parent.with_remote_span_context(hop.span_context().clone());
        let mut queue = x
            .tracer
            .span_builder(format!("stage {} queue", s.stage_index))
            .with_kind(SpanKind::Internal)
            .with_start_time(at(s.start_unix_ns))
            .with_attributes(vec![KeyValue::new(
                "gateway.stage.index",
                s.stage_index as i64,
            )])
            .start_with_context(&x.tracer, &hop_cx);
        queue.end_with_timestamp(at(s.start_unix_ns + s.queue_ns));
        hop.end_with_timestamp(at(s.end_unix_ns.max(s.start_unix_ns)));
    }
}

/// A route whose requests get a span: its template, GenAI operation name
/// and the model that serves it (if any).
#[derive(Clone, Debug)]
pub struct TracedRoute {
    /// Route template (`/v1/chat/completions`).
    pub route: &'static str,
    /// `gen_ai.operation.name` (`chat`, `text_completion`, `embeddings`).
    pub operation: &'static str,
    /// `gen_ai.request.model`: the model the route serves.
    pub model: Option<String>,
}

/// The routes [`trace_request`] wraps in a span.
#[derive(Clone, Debug, Default)]
pub struct TracedRoutes(pub Vec<TracedRoute>);

/// Middleware: wraps the requests of the [`TracedRoutes`] (embeddings,
/// completions, chat) in their span when tracing is on (otherwise it only
/// passes the request on).
pub async fn trace_request(
    State(routes): State<Arc<TracedRoutes>>,
    req: Request,
    next: Next,
) -> Response {
    if !enabled() {
        return next.run(req).await;
    }
    let route = req
        .extensions()
        .get::<MatchedPath>()
        .map(|p| p.as_str().to_string());
    let Some(traced) = route
        .as_deref()
        .and_then(|r| routes.0.iter().find(|t| t.route == r))
    else {
        return next.run(req).await;
    };
    let (op, model) = (traced.operation, traced.model.clone());
    let route = route.unwrap_or_default();
    let name = match &model {
        Some(m) => format!("{op} {m}"),
        None => op.to_string(),
    };
    let span = tracing::info_span!(
        target: TARGET,
        "gen_ai.request",
        otel.name = %name,
        otel.kind = "server",
        otel.status_code = tracing::field::Empty,
    );
    if let Some(parent) = incoming(req.headers()) {
        let _ = span.set_parent(remote_context(&parent));
    }
    span.set_attribute("gen_ai.operation.name", op);
    if let Some(m) = model {
        span.set_attribute("gen_ai.request.model", m);
    }
    span.set_attribute("http.request.method", req.method().as_str().to_string());
    span.set_attribute("http.route", route);
    let resp = next.run(req).instrument(span.clone()).await;
    let status = resp.status().as_u16();
    span.set_attribute("http.response.status_code", status as i64);
    if status >= 400 {
        span.set_attribute("error.type", status.to_string());
    }
    if status >= 500 {
        span.set_status(Status::error(format!("HTTP {status}")));
    }
    resp
}

fn incoming(h: &HeaderMap) -> Option<TraceContext> {
    parse_traceparent(h.get("traceparent")?.to_str().ok()?)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn traceparent_parsing() {
        let t =
            parse_traceparent("00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01").unwrap();
        assert_eq!(hex::encode(t.trace_id), "4bf92f3577b34da6a3ce929d0e0e4736");
        assert_eq!(hex::encode(t.span_id), "00f067aa0ba902b7");
        assert_eq!(t.flags, 1);
        for bad in [
            "",
            "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7",
            "00-00000000000000000000000000000000-00f067aa0ba902b7-01",
            "00-4bf92f3577b34da6a3ce929d0e0e4736-0000000000000000-01",
            "ff-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01",
            "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01-extra",
            "00-xyz-00f067aa0ba902b7-01",
            "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-1",
        ] {
            assert!(parse_traceparent(bad).is_none(), "{bad:?}");
        }
    }

    #[test]
    fn config_checks_and_url() {
        let k = |p: &str| p.to_string();
        let mut c = TelemetryConfig::default();
        assert!(c.validate(&k).is_ok());
        assert_eq!(c.traces_url(), None);
        c.otlp_endpoint = Some("http://127.0.0.1:4318/".into());
        assert_eq!(c.traces_url().unwrap(), "http://127.0.0.1:4318/v1/traces");
        c.otlp_endpoint = Some("http://c:4318/v1/traces".into());
        assert_eq!(c.traces_url().unwrap(), "http://c:4318/v1/traces");
        c.otlp_endpoint = Some("https://c:4318".into());
        assert!(c
            .validate(&k)
            .unwrap_err()
            .to_string()
            .contains("telemetry.otlp_endpoint"));
        c.otlp_endpoint = None;
        c.sample_ratio = 2.0;
        assert!(c.validate(&k).is_err());
    }
}
