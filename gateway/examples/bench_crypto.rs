//! Per-request crypto cost against single-sentence inference, in one process
//! on one machine: HPKE open + seal (request and response), the receipt
//! signatures of a two-stage pipeline, and the digests the stages compute,
//! against bare in-process Candle embedding one sentence (all 6 layers).
//!
//! Run: `scripts/bench_crypto.sh` (writes `benchmark_results/crypto.{json,md}`).

use ed25519_dalek::SigningKey;
use enclave_stage::engine::{Engine, StageSpec};
use proto::digest::Sha256Digest;
use proto::receipt::{link_digest, sign_link, sign_receipt, Link, ReceiptBody, Sealing};
use proto::sealing::{open_request, open_response, seal_request, seal_response, Aead, ServerKey};
use std::time::Instant;

const SENTENCE: &str =
    "The quarterly report shows revenue growth in every region except the north.";

fn median_us(mut v: Vec<f64>) -> f64 {
    v.sort_by(|a, b| a.partial_cmp(b).unwrap());
    v[v.len() / 2]
}

fn time<F: FnMut()>(iters: usize, mut f: F) -> f64 {
    for _ in 0..iters / 10 {
        f();
    }
    let mut samples = Vec::with_capacity(iters);
    for _ in 0..iters {
        let t = Instant::now();
        f();
        samples.push(t.elapsed().as_secs_f64() * 1e6);
    }
    median_us(samples)
}

fn main() -> anyhow::Result<()> {
    std::env::set_var("RAYON_NUM_THREADS", "1");
    std::env::set_var("CANDLE_NUM_THREADS", "1");
    let engine = Engine::load(
        std::path::Path::new("models/all-minilm-l6-v2"),
        &StageSpec {
            stage_index: 0,
            num_stages: 1,
            layers: 0..6,
        },
    )?;
    let request =
        serde_json::to_vec(&serde_json::json!({"model": "all-MiniLM-L6-v2", "input": SENTENCE}))?;
    let vector = engine.embed_texts(&[SENTENCE])?.remove(0);
    let response = serde_json::to_vec(&serde_json::json!({
        "object": "list",
        "data": [{"object": "embedding", "index": 0, "embedding": vector}],
        "model": "all-MiniLM-L6-v2",
        "usage": {"prompt_tokens": 17, "total_tokens": 17},
    }))?;
    let inference_us = time(200, || {
        engine.embed_texts(&[SENTENCE]).unwrap();
    });

    let key = ServerKey::generate(1);
    let config = key.config();
    let mut rows = Vec::new();
    for aead in [Aead::Aes128Gcm, Aead::ChaCha20Poly1305] {
        // Client side, for context (not enclave work).
        let client_us = time(1000, || {
            let (h, body, client) = seal_request(&config, aead, &request).unwrap();
            let (_, material) = open_request(&key, &h, &body).unwrap();
            let sealed = seal_response(&material, &response).unwrap();
            open_response(&client, &sealed).unwrap();
        });
        // Enclave side: open the request (one X25519 + AEAD), seal the response.
        let sealed_requests: Vec<_> = (0..1000)
            .map(|_| seal_request(&config, aead, &request).unwrap())
            .collect();
        let mut i = 0;
        let open_us = time(900, || {
            let (h, body, _) = &sealed_requests[i % sealed_requests.len()];
            i += 1;
            open_request(&key, h, body).unwrap();
        });
        let (h, body, _) = &sealed_requests[0];
        let (_, material) = open_request(&key, h, body).unwrap();
        let seal_us = time(2000, || {
            seal_response(&material, &response).unwrap();
        });
        rows.push((format!("{aead:?}"), open_us, seal_us, client_us));
    }
    let signer = SigningKey::from_bytes(&[7; 32]);
    let signing_us = time(2000, || {
        let d = Sha256Digest::of(&request);
        let link0 = sign_link(
            &signer,
            &Link {
                receipt_id: [1; 16],
                stage_index: 0,
                layers: [0, 3],
                evidence_digest: d,
                received_digest: d,
                sent_digest: d,
                prev_link_digest: None,
            },
        );
        let link1 = sign_link(
            &signer,
            &Link {
                receipt_id: [1; 16],
                stage_index: 1,
                layers: [3, 6],
                evidence_digest: d,
                received_digest: d,
                sent_digest: Sha256Digest::of(&response),
                prev_link_digest: Some(link_digest(&link0)),
            },
        );
        sign_receipt(
            &signer,
            &ReceiptBody {
                receipt_id: [1; 16],
                issued_at_ms: 0,
                endpoint: "/v1/embeddings".into(),
                model_id: "all-MiniLM-L6-v2".into(),
                manifest_digest: d,
                request_digest: d,
                response_digest: Sha256Digest::of(&response),
                client_nonce: None,
                sequence: 0,
                mock: true,
                sealing: Sealing::Plain,
                chain: vec![link0, link1],
            },
        );
    });
    // Row digests: stage 0 hashes what it sends, stage 1 what it receives
    // (17 tokens x 384 f32 per stage boundary).
    let row = vec![0u8; 17 * 384 * 4];
    let digests_us = time(2000, || {
        Sha256Digest::of(&row);
        Sha256Digest::of(&row);
    });

    let mut json_rows = Vec::new();
    let mut md = String::from("# Per-request crypto vs single-sentence inference\n\n");
    md += &format!(
        "One process, one thread, this machine ({} cores visible). Request: one sentence \
         ({} bytes of JSON); response: one 384-d float vector ({} bytes of JSON). Medians over \
         about 1000-2000 runs (inference: 200 runs).\n\n",
        std::thread::available_parallelism()
            .map(|n| n.get())
            .unwrap_or(0),
        request.len(),
        response.len()
    );
    md += &format!(
        "Bare in-process Candle, one sentence, all 6 layers: **{inference_us:.0} µs** (p50).\n\n"
    );
    md += "Enclave-side crypto per request, all stages together (open the sealed request, \
seal the response, sign two links and the receipt, hash what crosses the stage boundary):\n\n";
    md += "| AEAD | open µs | seal response µs | signing µs | digests µs | total µs | share of inference | (client seal+open, both sides, µs) |\n|---|---|---|---|---|---|---|---|\n";
    for (aead, open_us, seal_us, client_us) in &rows {
        let total = open_us + seal_us + signing_us + digests_us;
        let share = total / inference_us * 100.0;
        md += &format!(
            "| {aead} | {open_us:.1} | {seal_us:.1} | {signing_us:.1} | {digests_us:.1} | {total:.1} | **{share:.2} %** | {client_us:.1} |\n"
        );
        json_rows.push(serde_json::json!({
            "aead": aead, "open_us": open_us, "seal_response_us": seal_us, "signing_us": signing_us,
            "digests_us": digests_us, "total_us": total, "share_of_inference_pct": share,
            "client_round_trip_us": client_us,
        }));
    }
    md += "\nTarget: ≤ 1 % of single-sentence inference. The stages run in parallel, so each \
stage's own share is smaller than the total (stage 0: open + one link; exit stage: seal + \
link + receipt). Rerun: `scripts/bench_crypto.sh` (on an idle machine).\n";
    std::fs::create_dir_all("benchmark_results")?;
    std::fs::write("benchmark_results/crypto.md", &md)?;
    std::fs::write(
        "benchmark_results/crypto.json",
        serde_json::to_vec_pretty(&serde_json::json!({
            "inference_p50_us": inference_us,
            "request_bytes": request.len(),
            "response_bytes": response.len(),
            "rows": json_rows,
        }))?,
    )?;
    print!("{md}");
    Ok(())
}
