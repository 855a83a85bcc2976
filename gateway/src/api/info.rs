//! The routes that read state rather than run a model: `/metrics`,
//! `/v1/models`, `/readyz`, `/v1/receipts/{id}`, `/.well-known/hpke-keys`
//! and `/v1/attestation`.

use super::models::owner_of;
use super::{AppState, HEADER_RECEIPT_DIGEST_SALT, HEADER_REPLICA};
use crate::auth::Caller;
use crate::openai_error::ApiError;
use crate::pipeline::{Failure, Replicas};
use crate::receipt_store::Stored;
use axum::extract::{Path, Query, State};
use axum::http::{header, HeaderMap, HeaderValue};
use axum::response::{IntoResponse, Response};
use axum::{Extension, Json};
use base64::Engine as _;
use proto::bundle::{EvidenceBundle, StageEvidence};
use proto::sealing::{KeyConfig, KEYS_MEDIA_TYPE};
use serde_json::json;
use std::collections::HashMap;
use std::sync::Arc;

pub(super) async fn metrics_handler(State(s): State<AppState>) -> Response {
    let mut text = s.metrics.render(Some(&s.service.embeddings.health()));
    let views = futures_util::future::join_all(s.service.pipelines().into_iter().flat_map(|r| {
        let n = r.members().len();
        r.members().iter().map(move |p| p.view(n))
    }))
    .await;
    text += &crate::stage_metrics::render(&views);
    (
        [(
            header::CONTENT_TYPE,
            "text/plain; version=0.0.4; charset=utf-8",
        )],
        text,
    )
        .into_response()
}

pub(super) fn model_json(id: &str) -> serde_json::Value {
    json!({"id": id, "object": "model", "created": 0, "owned_by": "confidential-gateway"})
}

pub(super) async fn list_models(State(s): State<AppState>) -> Response {
    let data: Vec<_> = s
        .service
        .pipelines()
        .iter()
        .map(|p| model_json(p.model_id()))
        .collect();
    Json(json!({"object": "list", "data": data})).into_response()
}

pub(super) async fn get_model(State(s): State<AppState>, Path(id): Path<String>) -> Response {
    if s.service.by_model(&id).is_some() {
        Json(model_json(&id)).into_response()
    } else {
        ApiError::model_not_found(&id).into_response()
    }
}

pub(super) async fn readyz(State(s): State<AppState>) -> Response {
    let mut pipelines = Vec::new();
    let mut mock = false;
    let mut debug = false;
    for r in s.service.pipelines() {
        // Ready while at least one replica is; every replica is listed,
        // an unready one with its reason.
        let mut first_ready = None;
        let mut replicas = Vec::new();
        for p in r.members() {
            match p.status() {
                Ok(stages) => {
                    mock |= stages.iter().any(|st| st.evidence == "mock");
                    debug |= stages.iter().any(|st| st.debug);
                    first_ready.get_or_insert_with(|| stages.clone());
                    replicas.push(json!({"replica": p.replica, "ready": true, "stages": stages}));
                }
                Err(reason) => {
                    replicas.push(json!({"replica": p.replica, "ready": false, "reason": reason}));
                }
            }
        }
        let Some(stages) = first_ready else {
            return ApiError::not_ready(&format!("{}: {}", r.model_id(), r.not_ready_reason()))
                .into_response();
        };
        let p = r.primary();
        pipelines.push(json!({
            "endpoint": p.endpoint.path(),
            "endpoints": p.endpoints().iter().map(|e| e.path()).collect::<Vec<_>>(),
            "model": p.model_id,
            "stages": stages,
            "replicas": replicas,
        }));
    }
    let mut body = json!({
        "status": "ready",
        "model": s.service.embeddings.model_id(),
        "stages": pipelines[0]["stages"],
        "pipelines": pipelines,
    });
    if let Some(w) = warning(mock, debug) {
        body["warning"] = json!(w);
    }
    Json(body).into_response()
}

/// What `/readyz` and `/v1/attestation` warn of: mock evidence, Nitro
/// enclaves in debug mode, or both.
fn warning(mock: bool, debug: bool) -> Option<String> {
    let parts: Vec<&str> = [
        (mock, proto::attestation::MOCK_WARNING),
        (debug, proto::attestation::DEBUG_WARNING),
    ]
    .into_iter()
    .filter_map(|(on, w)| on.then_some(w))
    .collect();
    (!parts.is_empty()).then(|| parts.join("; "))
}

/// The kept receipt `id` if `caller` may read it ([`Stored::readable_by`]);
/// else the response: the same 404 as for an id never issued, or 503 when
/// the store cannot be read.
async fn readable_receipt(
    s: &AppState,
    caller: Option<Extension<Caller>>,
    id: &str,
) -> Result<Stored, Response> {
    let caller = owner_of(caller);
    let wanted = hex::decode(id)
        .ok()
        .and_then(|b| <[u8; 16]>::try_from(b).ok());
    let found = match wanted {
        None => None,
        Some(wanted) => match s.service.receipts.get(&wanted).await {
            Ok(found) => found,
            Err(e) => {
                tracing::warn!(error = %format!("{e:#}"), "the receipt store cannot be read");
                return Err(
                    crate::openai_error::ApiError::receipt_store_unavailable().into_response()
                );
            }
        },
    };
    found
        .filter(|kept| kept.readable_by(caller.as_deref()))
        .ok_or_else(|| {
            ApiError {
                code: Some("receipt_not_found"),
                ..ApiError::from_stage(404, format!("No receipt {id} is retained here."))
            }
            .into_response()
        })
}

/// `GET /v1/receipts/{id}`: the receipt, and the salt of its digests where
/// the gateway holds it, to whoever [`Stored::readable_by`] allows; anyone
/// else gets the same 404 as for an id that was never issued.
pub(super) async fn get_receipt(
    State(s): State<AppState>,
    caller: Option<Extension<Caller>>,
    Path(id): Path<String>,
) -> Response {
    let mut kept = match readable_receipt(&s, caller, &id).await {
        Ok(Stored { trailer, .. }) => trailer,
        Err(r) => return r,
    };
    let receipt = std::mem::take(&mut kept.receipt);
    let mut r = ([(header::CONTENT_TYPE, "application/cose")], receipt).into_response();
    if let Some(v) = kept
        .digest_salt
        .and_then(|salt| HeaderValue::from_str(&hex::encode(salt)).ok())
    {
        r.headers_mut().insert(HEADER_RECEIPT_DIGEST_SALT, v);
    }
    r
}

/// `GET /v1/receipts/{id}/inclusion`: an RFC 9942 COSE receipt that the
/// receipt's digest is in the transparency log, against its latest
/// checkpoint; 404 `receipt_not_logged`, with `Retry-After` until its
/// batch is appended, without when receipts are not logged.
pub(super) async fn receipt_inclusion(
    State(s): State<AppState>,
    caller: Option<Extension<Caller>>,
    Path(id): Path<String>,
) -> Response {
    let kept = match readable_receipt(&s, caller, &id).await {
        Ok(k) => k,
        Err(r) => return r,
    };
    // Retry-After only where asking again can help (a batch not appended yet).
    let not_logged = |why: &str, retry: bool| {
        let mut r = ApiError {
            code: Some("receipt_not_logged"),
            ..ApiError::from_stage(404, format!("Receipt {id} {why}."))
        }
        .into_response();
        if retry {
            r.headers_mut()
                .insert(header::RETRY_AFTER, HeaderValue::from_static("1"));
        }
        r
    };
    let (Some(log), Some(_)) = (s.transparency.clone(), &s.service.receipt_log) else {
        return not_logged("is not logged: this gateway does not log receipts", false);
    };
    let leaf = proto::transparency::ReceiptEntry::leaf_of(&kept.trailer.receipt);
    match tokio::task::spawn_blocking(move || log.lock().unwrap().inclusion_receipt(&leaf)).await {
        Ok(Ok(Some(cose))) => ([(header::CONTENT_TYPE, "application/cose")], cose).into_response(),
        Ok(Ok(None)) => not_logged("is not in the log's latest checkpoint yet", true),
        Ok(Err(e)) => {
            tracing::error!(error = %format!("{e:#}"), "transparency log read failed");
            ApiError::internal("the transparency log could not be read").into_response()
        }
        Err(e) => ApiError::internal(e.to_string()).into_response(),
    }
}

pub(super) async fn hpke_keys(
    State(s): State<AppState>,
    Query(q): Query<HashMap<String, String>>,
) -> Response {
    let chosen: Vec<&Arc<Replicas>> = match q.get("model") {
        Some(m) => match s.service.by_model(m) {
            Some(p) => vec![p],
            None => return ApiError::model_not_found(m).into_response(),
        },
        None => s.service.pipelines(),
    };
    let mut keys = Vec::new();
    let mut serves = HashMap::new();
    for r in chosen {
        if let Err(reason) = r.ready() {
            return ApiError::not_ready(&reason).into_response();
        }
        // Every ready replica's entry keys (each replica its own ids).
        for p in r.members() {
            if let Ok(k) = p.entry_keys() {
                for c in &k {
                    serves.insert(c.key_id, (p.model_id.clone(), p.endpoint.path(), p.replica));
                }
                keys.extend(k);
            }
        }
    }
    keys.extend(s.service.gateway_key.configs());
    if q.get("format").map(String::as_str) == Some("json") {
        let list: Vec<_> = keys
            .iter()
            .map(|k| {
                let gateway = crate::service::GatewayKey::owns(k.key_id);
                json!({
                    "key_id": k.key_id,
                    "public_key": hex::encode(k.public_key),
                    "kem": "DHKEM(X25519, HKDF-SHA256)",
                    "aeads": k.aeads.iter().map(|a| format!("{a:?}")).collect::<Vec<_>>(),
                    "held_by": if gateway { "gateway" } else { "enclave" },
                    "model": serves.get(&k.key_id).map(|m| m.0.clone()),
                    "endpoint": serves.get(&k.key_id).map(|m| m.1),
                    "replica": serves.get(&k.key_id).map(|m| m.2),
                    "note": if gateway {
                        "held by the untrusted host: it opens your request and re-seals it to the entry stage"
                    } else {
                        "held by the attested entry stage (stage 0); bound in its evidence at /v1/attestation (a rotated key: signed with the receipt key that evidence binds)"
                    },
                })
            })
            .collect();
        return Json(json!({"keys": list})).into_response();
    }
    (
        [(header::CONTENT_TYPE, KEYS_MEDIA_TYPE)],
        KeyConfig::encode_list(&keys),
    )
        .into_response()
}

pub(super) async fn attestation(
    State(s): State<AppState>,
    peer: Option<axum::Extension<axum::extract::ConnectInfo<std::net::SocketAddr>>>,
    headers: HeaderMap,
    Query(q): Query<HashMap<String, String>>,
) -> Response {
    let nonce = match q.get("nonce").map(hex::decode) {
        None => Vec::new(),
        Some(Ok(n)) if n.len() <= 64 => n,
        Some(_) => {
            return ApiError::invalid(Some("nonce"), "`nonce` must be hex, at most 64 bytes.")
                .into_response()
        }
    };
    let replicas = match q.get("model") {
        Some(m) => match s.service.by_model(m) {
            Some(p) => p.clone(),
            None => return ApiError::model_not_found(m).into_response(),
        },
        None => s.service.embeddings.clone(),
    };
    // One replica's evidence: the one asked for, else the least loaded
    // (its entry keys are the ones a client then seals to).
    let asked = match q.get("replica").map(|v| v.parse::<usize>()) {
        None => None,
        Some(Ok(i)) => Some(i),
        Some(Err(_)) => {
            return ApiError::invalid(Some("replica"), "`replica` must be a replica number.")
                .into_response()
        }
    };
    let pipeline = match replicas.ready_member(asked) {
        Ok(p) => p.clone(),
        Err(reason) => return ApiError::not_ready(&reason).into_response(),
    };
    // Evidence for this nonce made moments ago is served again; only a
    // call that needs fresh evidence counts against the client's rate.
    let slot = s.attestation.slot(
        &format!("{}#{}", pipeline.model_id, pipeline.replica),
        pipeline.epoch().unwrap_or(u64::MAX),
        &nonce,
    );
    if !slot.initialized() {
        if let Err(retry) = s.attestation.admit(peer.map(|p| p.0 .0.ip())) {
            return ApiError::rate_limited(
                "Too many attestation requests from this address; retry later, or reuse a nonce's evidence.",
                retry,
            )
            .into_response();
        }
    }
    let wait = s.limits.routes.for_route(crate::timeouts::ATTESTATION);
    let log = s.transparency.clone();
    let made = slot
        .get_or_try_init(|| async {
            let stages = pipeline.attest(&nonce, wait).await?;
            let key_set = pipeline.key_set().map(serde_bytes::ByteBuf::from);
            let transparency = match log {
                Some(log) => {
                    let w = s.witnessing.clone();
                    let key_set = key_set_entry(&stages, key_set.as_deref().map(|k| &k[..]));
                    release_proofs(log, w, &stages, pipeline.manifest.digest, key_set).await
                }
                None => None,
            };
            Ok::<_, Failure>(Arc::new(EvidenceBundle {
                nonce: nonce.clone(),
                manifest: pipeline.manifest_bytes.clone(),
                stages: stages
                    .into_iter()
                    .map(|(st, evidence)| StageEvidence {
                        key_set: (st.index == 0).then(|| key_set.clone()).flatten(),
                        index: st.index,
                        claims: st.claims,
                        boot_evidence: st.boot_evidence,
                        evidence,
                    })
                    .collect(),
                transparency,
            }))
        })
        .await;
    let bundle = match made {
        Ok(b) => b.clone(),
        Err(f) => {
            return match f {
                Failure::NotReady(r) | Failure::NotSent(r) => ApiError::not_ready(&r),
                Failure::Timeout => ApiError::timeout(wait.as_secs()),
            }
            .into_response()
        }
    };
    let wants_cbor = headers
        .get(header::ACCEPT)
        .and_then(|v| v.to_str().ok())
        .is_some_and(|v| v.contains("application/cbor"));
    let replica = (
        header::HeaderName::from_static(HEADER_REPLICA),
        HeaderValue::from(pipeline.replica),
    );
    if wants_cbor {
        return (
            [
                (
                    header::CONTENT_TYPE,
                    HeaderValue::from_static("application/cbor"),
                ),
                replica,
            ],
            proto::cbor::to_vec(bundle.as_ref()),
        )
            .into_response();
    }
    let mut body = bundle_json(&bundle);
    body["replica"] = json!(pipeline.replica);
    ([replica], Json(body)).into_response()
}

/// The bundle for people: the same content, bytes as hex/base64, plus the
/// CBOR form (base64) that `gateway verify evidence` reads.
pub(super) fn bundle_json(b: &EvidenceBundle) -> serde_json::Value {
    let b64 = |v: &[u8]| base64::engine::general_purpose::STANDARD.encode(v);
    let docs: Vec<_> = b
        .stages
        .iter()
        .map(|s| proto::attestation::verify_any(&s.evidence).ok())
        .collect();
    let stages: Vec<_> = b
        .stages
        .iter()
        .zip(&docs)
        .map(|(s, doc)| {
            json!({
                "index": s.index,
                "layers": [s.claims.layer_start, s.claims.layer_end],
                "evidence_format": format!("{:?}", s.evidence.format).to_lowercase(),
                "measurement": doc.as_ref().map(|d| d.measurement.pinned_form()),
                "receipt_key": hex::encode(s.claims.receipt_key),
                "hpke_keys": b64(&s.claims.hpke_keys),
                "key_set": s.key_set.as_ref().map(|k| b64(k)),
                "boot_evidence_sha256": s.boot_evidence.digest().hex(),
                "evidence": b64(&s.evidence.document),
                "boot_evidence": b64(&s.boot_evidence.document),
            })
        })
        .collect();
    let mock = b
        .stages
        .iter()
        .any(|s| s.evidence.format == proto::attestation::EvidenceFormat::Mock);
    let debug = docs.iter().flatten().any(
        |d| matches!(&d.measurement, proto::attestation::Measurement::Nitro(p) if p.is_debug()),
    );
    let mut out = json!({
        "nonce": hex::encode(&b.nonce),
        "manifest_sha256": proto::digest::Sha256Digest::of(&b.manifest).hex(),
        "manifest": serde_json::from_slice::<serde_json::Value>(&b.manifest).unwrap_or_default(),
        "stages": stages,
        "bundle_cbor": b64(&proto::cbor::to_vec(b)),
    });
    if let Some(w) = warning(mock, debug) {
        out["warning"] = json!(w);
    }
    out
}

/// The log's proofs that `stages` are logged releases, or `None` (no such
/// releases, or the log cannot be read: logged, and the bundle goes
/// without them; a client whose policy needs them says so).
/// The key-set entry of the keys the entry stage publishes (its signed
/// set, or the list its evidence binds), as a client will check it.
fn key_set_entry(
    stages: &[(crate::pipeline::StageStatus, proto::attestation::Evidence)],
    signed: Option<&[u8]>,
) -> Option<Vec<u8>> {
    let claims = &stages.first()?.0.claims;
    let (keys, _) = proto::bundle::entry_keys(claims, signed).ok()?;
    Some(
        proto::transparency::Entry::KeySet(proto::transparency::KeySetEntry {
            key_set_digest: proto::digest::Sha256Digest::of(signed.unwrap_or(&claims.hpke_keys)),
            key_ids: keys.iter().map(|k| k.key_id).collect(),
        })
        .to_bytes(),
    )
}

/// The bundle's log proofs. A key set the log does not hold yet is logged
/// first (every key set ever published is in the log before a client can
/// seal to it), and the witnesses are asked to cosign the new checkpoint
/// before the proofs are cut from it.
async fn release_proofs(
    log: Arc<std::sync::Mutex<crate::transparency::Log>>,
    witnessing: Option<Arc<crate::transparency::witnessing::Witnessing>>,
    stages: &[(crate::pipeline::StageStatus, proto::attestation::Evidence)],
    manifest: proto::digest::Sha256Digest,
    key_set: Option<Vec<u8>>,
) -> Option<proto::transparency::ReleaseProofs> {
    let wanted: Vec<(u32, String, [u32; 2])> = stages
        .iter()
        .map(|(s, _)| (s.index, s.measurement.clone(), s.layers))
        .collect();
    if let Some(k) = key_set.clone() {
        let l = log.clone();
        let grown = tokio::task::spawn_blocking(move || {
            let mut l = l.lock().unwrap();
            let before = l.size();
            l.append_missing(&[k]).map(|_| l.size() > before)
        })
        .await;
        match grown {
            Ok(Ok(true)) => {
                tracing::info!("transparency log: the entry stage's key set logged");
                if let Some(w) = witnessing {
                    w.round().await;
                }
            }
            Ok(Ok(false)) => {}
            Ok(Err(e)) => {
                tracing::error!(error = %format!("{e:#}"), "transparency log: the key set not logged")
            }
            Err(e) => tracing::error!(error = %e, "transparency log: the key set not logged"),
        }
    }
    let made = tokio::task::spawn_blocking(move || {
        let stages: Vec<(u32, &str, [u32; 2])> = wanted
            .iter()
            .map(|(i, m, l)| (*i, m.as_str(), *l))
            .collect();
        log.lock()
            .unwrap()
            .release_proofs(&stages, &manifest, key_set.as_deref())
    })
    .await;
    match made {
        Ok(Ok(p)) => p,
        Ok(Err(e)) => {
            tracing::error!(error = %format!("{e:#}"), "transparency log: no release proofs");
            None
        }
        Err(e) => {
            tracing::error!(error = %e, "transparency log: no release proofs");
            None
        }
    }
}

#[cfg(test)]
mod tests {
    use super::warning;
    use proto::attestation::{DEBUG_WARNING, MOCK_WARNING};

    #[test]
    fn mock_and_debug_stages_are_each_labelled() {
        assert_eq!(warning(false, false), None);
        assert_eq!(warning(true, false).as_deref(), Some(MOCK_WARNING));
        assert_eq!(warning(false, true).as_deref(), Some(DEBUG_WARNING));
        let both = warning(true, true).unwrap();
        assert!(
            both.contains(MOCK_WARNING) && both.contains(DEBUG_WARNING),
            "{both}"
        );
    }
}
