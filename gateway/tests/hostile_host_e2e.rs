//! The host plays against the stages (issue 29): the test opens the host
//! channels of real `enclave-stage` processes itself and does what a
//! hostile host may do (repeat or lower request ids, open extra upstream or
//! feedback sessions with extra stage processes, reconnect half of a
//! pipeline, configure twice, replay and relabel sealed requests), with
//! real clients that seal with the client crate and accept an answer only
//! when `client::sealed` opens it and verifies its receipt against fresh,
//! verified evidence.
//!
//! The invariant, checked in every case: no answer that a client's
//! verifier accepts differs from what the model computes for that client's
//! own request (embeddings: cosine > 0.9999 to the clean vector of its own
//! text and not to the other client's; generation, greedy: the clean text).
//! Failing closed (a failure, no answer, a closed channel) is fine.
//!
//! Run one at a time (they share a lock): timing matters when requests are
//! queued behind a busy compute thread.

mod common;

use common::cosine;
use common::hostile::{
    accept, busy_inputs, completion_text, configure_at, fresh_id, request, request_id_of, serial,
    Client, Configured, Host, Pipeline, Rig, Want, ANSWER, CLOSE,
};
use proto::frames::{HostMessage, ResultMessage};
use proto::receipt::Sealing;
use serde_json::json;
use std::time::Duration;

const EMBED_LAYERS: &[[u32; 2]] = &[[0, 3], [3, 6]];
/// The victim's input.
const VICTIM: &str =
    "Patient record: the biopsy confirmed an early-stage melanoma on the left shoulder.";
/// The host's (attacker's) input.
const ATTACKER: &str = "Transfer all remaining funds to the offshore account before the audit.";
/// Generation prompts of the victim and the attacker.
const VICTIM_PROMPT: &str = "The capital of France is";
const ATTACKER_PROMPT: &str = "def fibonacci(n):";

/// The two clients of an embeddings attack, with their clean vectors (from
/// one clean request on the same pipeline).
async fn embedding_clients(p: &mut Pipeline) -> (Client, Client) {
    let refs = p.clean_vectors(&[VICTIM, ATTACKER]).await;
    assert!(
        cosine(&refs[0], &refs[1]) < 0.9,
        "the two texts must embed apart for the test to mean anything"
    );
    let victim = p.client("victim", VICTIM, Want::Vector(refs[0].clone()));
    let attacker = p.client("attacker", ATTACKER, Want::Vector(refs[1].clone()));
    (victim, attacker)
}

/// The two clients of a generation attack, with their clean texts.
async fn generation_clients(p: &mut Pipeline) -> (Client, Client) {
    let v = p.clean_text(VICTIM_PROMPT).await;
    let a = p.clean_text(ATTACKER_PROMPT).await;
    assert_ne!(v, a, "the two prompts must complete apart");
    let victim = p.client("victim", VICTIM_PROMPT, Want::Text(v));
    let attacker = p.client("attacker", ATTACKER_PROMPT, Want::Text(a));
    (victim, attacker)
}

/// Whether any result is a response for `id`.
fn answered(results: &[ResultMessage], id: u64) -> bool {
    results
        .iter()
        .any(|r| matches!(r, ResultMessage::Response { request_id, .. } if *request_id == id))
}

/// A busy request, then two clients' requests under one request id, in
/// `order`; every result is offered to both clients. The invariant is
/// asserted at once; what else must hold (the second request gets no
/// answer its client accepts, the entry stage closes its host channel) is
/// returned as a list of what did not, so that both orders get tried.
async fn duplicate_id_round(
    p: &mut Pipeline,
    busy: serde_json::Value,
    order: [&Client; 2],
) -> Vec<String> {
    let busy = p.seal(&busy);
    assert!(p.submit(&busy, fresh_id(), Sealing::Enclave).await);
    let id = fresh_id();
    for c in order {
        // The entry may already have closed the channel: failing closed.
        let _ = p.submit(&c.sealed, id, Sealing::Enclave).await;
    }
    let results = p.collect(3, Duration::from_secs(30)).await;
    let accepted = p.check_invariant(&results, &order);
    let mut problems = Vec::new();
    if accepted[1] > 0 {
        problems.push(format!(
            "the request sent second under the repeated id {id} got an answer its client accepts"
        ));
    }
    if !p.entry_closed(CLOSE).await {
        problems.push(format!(
            "the entry stage kept its host channel open after request id {id} was repeated \
             (results: {:?})",
            results.iter().map(summary).collect::<Vec<_>>()
        ));
    }
    problems
}

/// Both orders of [`duplicate_id_round`] (victim first, then attacker
/// first), each on a freshly configured pipeline of `rig`; panics with
/// everything that did not hold.
async fn duplicate_ids(rig: &Rig, generation: bool) {
    let mut problems = Vec::new();
    for victim_first in [true, false] {
        let mut p = rig.pipeline().await;
        let (victim, attacker, busy) = if generation {
            let (v, a) = generation_clients(&mut p).await;
            let mut busy = p.body(json!("Write a long story about a lighthouse keeper."));
            busy["max_tokens"] = json!(24);
            (v, a, busy)
        } else {
            let (v, a) = embedding_clients(&mut p).await;
            (v, a, p.body(busy_inputs(32)))
        };
        let order = if victim_first {
            [&victim, &attacker]
        } else {
            [&attacker, &victim]
        };
        for why in duplicate_id_round(&mut p, busy, order).await {
            problems.push(format!("victim first: {victim_first}: {why}"));
        }
        p.close().await;
    }
    assert!(problems.is_empty(), "issue 29: {problems:#?}");
}

/// A `Configure` of an extra session must answer `ConfigureFailed`, and
/// for that reason, not because the stage still belonged to a host channel
/// (which [`configure_at`] waits out).
fn assert_refused(r: &Result<Configured, String>, accepted: &str) {
    match r {
        Ok(_) => panic!("issue 29: {accepted}"),
        Err(why) => assert!(
            !why.contains("another host channel"),
            "refused only because the stage stayed owned by a closed host channel: {why}"
        ),
    }
}

/// A short line about a result (no content).
fn summary(r: &ResultMessage) -> String {
    match r {
        ResultMessage::Response { request_id, .. } => format!("response to {request_id}"),
        ResultMessage::Failed { request_id, error } => {
            format!("{request_id} failed: {}", error.message)
        }
        other => format!("{other:?}"),
    }
}

/// Plays: a host that keeps the entry stage's compute thread busy, then
/// sends a victim's and its own sealed embeddings requests under the same
/// request id (victim first, then, on a fresh pipeline, attacker first),
/// hoping that the stages merge or overwrite them; on a one-stage pipeline
/// (where no later stage's link can notice) and on two stages. Must hold:
/// the invariant; the request sent second never gets an answer its client
/// accepts; the entry stage closes its host channel on the repeated id.
#[tokio::test]
async fn duplicate_request_ids_embeddings() {
    let _one = serial().await;
    for layers in [&[[0, 6]][..], EMBED_LAYERS] {
        duplicate_ids(&Rig::embeddings("hostile-dup-emb", layers), false).await;
    }
}

/// Plays: the same as [`duplicate_request_ids_embeddings`] on a one-stage
/// SmolLM2 pipeline (greedy, 8 tokens), with a longer generation keeping
/// the compute busy. Must hold: the invariant; the second request is never
/// answered to its client; the entry stage closes its host channel.
#[tokio::test]
async fn duplicate_request_ids_generation() {
    let _one = serial().await;
    duplicate_ids(&Rig::generation("hostile-dup-gen", &[[0, 30]]), true).await;
}

/// Plays: a host that sends a victim's request under id `hi`, then its own
/// under a lower id (ids that go down). Must hold: the invariant; the
/// lower-id request is not answered; the entry stage closes its host
/// channel.
#[tokio::test]
async fn request_ids_that_go_down_are_refused() {
    let _one = serial().await;
    let rig = Rig::embeddings("hostile-down", EMBED_LAYERS);
    let mut p = rig.pipeline().await;
    let (victim, attacker) = embedding_clients(&mut p).await;
    let (lo, hi) = (fresh_id(), fresh_id());
    assert!(p.submit(&victim.sealed, hi, Sealing::Enclave).await);
    let _ = p.submit(&attacker.sealed, lo, Sealing::Enclave).await;
    let results = p.collect(2, Duration::from_secs(15)).await;
    p.check_invariant(&results, &[&victim, &attacker]);
    assert!(
        !answered(&results, lo),
        "issue 29: request id {lo} after {hi} (ids going down) was answered"
    );
    assert!(
        p.entry_closed(CLOSE).await,
        "issue 29: the entry stage kept its host channel open after id {lo} followed {hi}"
    );
    p.close().await;
}

/// Plays: a host with a legit two-stage pipeline that starts a second
/// stage-0 process and configures it onto the legit stage 1 (an extra
/// upstream session), then sends the attacker's request through it under
/// the victim's request id while the victim's goes through the legit
/// entry. Must hold: the invariant; stage 1 takes one upstream session per
/// configuration epoch, so the extra stage's `Configure` answers
/// `ConfigureFailed`; the legit pipeline still answers correctly.
#[tokio::test]
async fn an_extra_upstream_session_is_refused() {
    let _one = serial().await;
    let rig = Rig::embeddings("hostile-upstream", EMBED_LAYERS);
    let mut p = rig.pipeline().await;
    let (victim, attacker) = embedding_clients(&mut p).await;
    let rogue = rig.extra_stage(0, "rogue-stage0");
    let (mut rogue_host, configured) =
        configure_at(&rogue.endpoint, Some(rig.endpoint(1)), None).await;
    if let Ok(c) = &configured {
        // The injection itself: the attacker's text through the extra
        // entry stage (sealed to its key), under the victim's id.
        let claims = rogue_host.peer.claims.clone().unwrap();
        let (keys, _) = proto::bundle::entry_keys(&claims, c.key_set.as_deref()).unwrap();
        let body = serde_json::to_vec(&p.body(json!(ATTACKER))).unwrap();
        let (headers, body, _) =
            proto::sealing::seal_request(&keys[0], proto::sealing::Aead::Aes128Gcm, &body).unwrap();
        let id = fresh_id();
        let mut injected = request(&victim.sealed, id, Sealing::Enclave);
        injected.headers = headers;
        injected.body = body;
        injected.client_nonce = None;
        assert!(p.submit(&victim.sealed, id, Sealing::Enclave).await);
        let _ = rogue_host.send(&HostMessage::Request(injected)).await;
        let results = p.collect(2, Duration::from_secs(15)).await;
        p.check_invariant(&results, &[&victim, &attacker]);
    }
    assert_refused(
        &configured,
        "stage 1 accepted a second upstream session (a second stage-0 process configured onto \
         it) while its pipeline's stage 0 is connected",
    );
    rogue_host.close().await;
    drop(rogue);
    p.still_serves(VICTIM, &victim.want).await;
    p.close().await;
}

/// Plays: a host that closes only the entry stage's host channel (stage 0
/// tears its pipeline down), reconnects to stage 0 and configures it onto
/// stage 1 again while stage 1's host channel stays open. Must hold: the
/// reconfiguration answers `ConfigureFailed` (stage 1 already had its one
/// upstream session in this epoch); after stage 1's host channel is closed
/// and reopened too (exit stage first), the pipeline answers correctly.
#[tokio::test]
async fn reconnecting_only_the_entry_is_refused() {
    let _one = serial().await;
    let rig = Rig::embeddings("hostile-reconnect", EMBED_LAYERS);
    let mut p = rig.pipeline().await;
    let (victim, _) = embedding_clients(&mut p).await;
    let entry = p.hosts.remove(0);
    entry.close().await;
    let (again, r) = configure_at(&rig.endpoint(0), Some(rig.endpoint(1)), None).await;
    assert_refused(
        &r,
        "stage 0, reconnected alone, was configured onto stage 1 again, whose host channel (and \
         so configuration epoch) stayed the same: a second upstream session in one epoch",
    );
    again.close().await;
    for h in p.hosts {
        h.close().await;
    }
    let mut p = rig.pipeline().await;
    p.still_serves(VICTIM, &victim.want).await;
    p.close().await;
}

/// Plays: a second host channel that sends `Configure` to each stage of a
/// configured pipeline, then a request on its channel to stage 0. Must
/// hold: both answer `ConfigureFailed` naming the other host channel;
/// the request closes the intruder's channel unanswered; the pipeline
/// still answers correctly.
#[tokio::test]
async fn a_second_configure_is_refused() {
    let _one = serial().await;
    let rig = Rig::embeddings("hostile-configure", EMBED_LAYERS);
    let mut p = rig.pipeline().await;
    let (victim, _) = embedding_clients(&mut p).await;
    for (i, next) in [(1, None), (0, Some(rig.endpoint(1)))] {
        let mut h = Host::open(&rig.endpoint(i)).await;
        match h.configure(next, None).await {
            Err(why) => assert!(why.contains("another host channel"), "stage {i}: {why}"),
            Ok(_) => panic!("a second host channel configured stage {i}"),
        }
        if i == 0 {
            let m = HostMessage::Request(request(&victim.sealed, fresh_id(), Sealing::Enclave));
            let _ = h.send(&m).await;
            assert!(
                h.closed_within(CLOSE).await,
                "stage 0 kept a non-configuring host channel open after it sent a request"
            );
        }
        h.close().await;
    }
    let stray = p.collect(1, Duration::from_secs(2)).await;
    assert!(stray.is_empty(), "the intruder's request was answered");
    p.still_serves(VICTIM, &victim.want).await;
    p.close().await;
}

/// Plays: a host that replays a client's sealed request (same headers and
/// body) under a new, higher id, with the same `sealing` label and
/// relabelled (enclave → plain, gateway), and one that delivers a client's
/// request labelled as its own (`plain`, `gateway`) the first time. Must
/// hold: the first delivery is answered and verifies; every replay is
/// refused (as a replay, or as a body that does not open under the label
/// it was given); a client's request labelled as the host's never opens
/// (who sealed it is bound in the HPKE `info`, issue 47), so the host
/// cannot read its exact metadata or choose its replay partition.
#[tokio::test]
async fn replays_are_refused_under_every_label() {
    use Sealing::{Enclave, Gateway, Plain};
    let _one = serial().await;
    let rig = Rig::embeddings("hostile-replay", EMBED_LAYERS);
    let mut p = rig.pipeline().await;
    let (victim, _) = embedding_clients(&mut p).await;
    // (first delivery's label, the replay's label); each pair with a
    // request of its own. The host picks the replay guard's partition, so
    // a replay is looked for in both: a relabelled one is refused too.
    let pairs = [(Enclave, Enclave), (Enclave, Plain), (Enclave, Gateway)];
    let clients: Vec<Client> = pairs
        .into_iter()
        .map(|(first, again)| {
            p.client(
                &format!("{first:?} then {again:?}"),
                VICTIM,
                victim.want.clone(),
            )
        })
        .collect();
    let mut firsts = Vec::new();
    for (c, (label, _)) in clients.iter().zip(pairs) {
        let id = fresh_id();
        assert!(p.submit(&c.sealed, id, label).await);
        firsts.push(id);
    }
    let results = p.collect(pairs.len(), ANSWER).await;
    let refs: Vec<&Client> = clients.iter().collect();
    p.check_invariant(&results, &refs);
    for (i, id) in firsts.iter().enumerate() {
        assert!(
            answered(&results, *id),
            "first delivery {i} ({:?}) not answered: {:?}",
            pairs[i].0,
            results.iter().map(summary).collect::<Vec<_>>()
        );
        let r = results
            .iter()
            .find(|r| matches!(r, ResultMessage::Response { request_id, .. } if request_id == id))
            .unwrap();
        if pairs[i].0 == Enclave {
            if let Err(why) = accept(&p.attested, &clients[i].sealed, r) {
                panic!("first delivery {i} does not verify: {why}");
            }
        }
    }
    let mut replays = Vec::new();
    for (c, (_, label)) in clients.iter().zip(pairs) {
        let id = fresh_id();
        assert!(p.submit(&c.sealed, id, label).await);
        replays.push(id);
    }
    let results = p.collect(pairs.len(), ANSWER).await;
    p.check_invariant(&results, &refs);
    let not_refused: Vec<String> = replays
        .iter()
        .zip(pairs)
        .filter(|(id, _)| {
            !results.iter().any(|r| {
                matches!(r, ResultMessage::Failed { request_id, error }
                    if request_id == *id && (error.message.to_lowercase().contains("replay")
                        || error.message.contains("cannot be opened")))
            })
        })
        .map(|(id, (first, again))| {
            let got: Vec<String> = results
                .iter()
                .filter(|r| request_id_of(r) == *id)
                .map(summary)
                .collect();
            format!("first {first:?}, replayed as {again:?}: {got:?}")
        })
        .collect();
    assert!(
        not_refused.is_empty(),
        "replays not refused as replays (issue 29; relabelled ones: item 4): {not_refused:#?}"
    );
    // A client's fresh request, first delivered labelled as the host's.
    for label in [Plain, Gateway] {
        let c = p.client(&format!("first as {label:?}"), VICTIM, victim.want.clone());
        let id = fresh_id();
        assert!(p.submit(&c.sealed, id, label).await);
        let r = p.result_for(id, ANSWER).await;
        match &r {
            Some(ResultMessage::Failed { error, .. })
                if error.message.contains("cannot be opened") => {}
            other => panic!(
                "a client's request labelled {label:?} by the host was not refused unopened: {:?}",
                other.as_ref().map(summary)
            ),
        }
    }
    p.close().await;
}

/// Plays: a host with a legit two-stage SmolLM2 pipeline that starts a
/// second exit-stage process and configures it with the legit entry stage
/// as its feedback peer (an extra feedback session, the way to inject
/// sampled tokens into others' generations). Must hold: the legit
/// pipeline still answers correctly; the entry stage takes one feedback
/// session per configuration epoch, so the extra stage's `Configure`
/// answers `ConfigureFailed`.
#[tokio::test]
async fn an_extra_feedback_session_is_refused() {
    let _one = serial().await;
    let rig = Rig::generation("hostile-feedback", &[[0, 15], [15, 30]]);
    let mut p = rig.pipeline().await;
    let clean = p.clean_text(VICTIM_PROMPT).await;
    let rogue = rig.extra_stage(1, "rogue-stage1");
    let (rogue_host, configured) = configure_at(&rogue.endpoint, None, Some(rig.endpoint(0))).await;
    p.still_serves(VICTIM_PROMPT, &Want::Text(clean)).await;
    assert_refused(
        &configured,
        "the entry stage accepted a second feedback session (a second exit-stage process \
         configured with it as feedback) while its pipeline's exit stage is connected",
    );
    rogue_host.close().await;
    p.close().await;
}

/// Plays (found by review after the first fixes): a host that cross-wires
/// two generation pipelines of the same attested build. A second exit
/// process X1 takes the real entry stage E's one feedback session; the real
/// exit stage X2 feeds a second entry process E2; E → X2 and E2 → X1. The
/// victim's request goes to E and the host's own to E2 under the same id,
/// both running exactly 8 tokens (end-of-text banned), so the tokens the
/// host's pipeline samples would become the victim's next inputs while X2
/// streams and signs the victim's answer. Must hold: the victim never
/// accepts an answer that is not the model's own greedy completion of its
/// prompt, and (issue 47) the victim's outcome is **the same** whether the
/// host's tokens equal the victim's (the host's request is the victim's
/// prompt) or not: otherwise fail-or-continue answers "was my guess the
/// victim's token?". Before fed-back tokens were tagged with the request's
/// feedback key, the first run failed and the second was answered.
#[tokio::test]
async fn tokens_fed_back_from_another_pipeline_fail_the_request() {
    let _one = serial().await;
    let rig = Rig::generation("hostile-crosswired", &[[0, 15], [15, 30]]);
    // The victim's right answer, from the pipeline wired as the gateway wires it.
    let mut p = rig.pipeline().await;
    let clean = {
        let s = p.seal(&banned_eos(&p, VICTIM_PROMPT));
        completion_text(&p.answer(&s).await)
    };
    p.close().await;
    let wrong_guess = crosswired(&rig, ATTACKER_PROMPT, &clean, "a").await;
    let right_guess = crosswired(&rig, VICTIM_PROMPT, &clean, "b").await;
    assert_eq!(
        wrong_guess, right_guess,
        "the victim's outcome depends on whether the host's fed-back tokens equal its own: \
         an equality oracle on the sealed answer"
    );
    assert!(
        wrong_guess.starts_with("failed"),
        "a cross-wired pipeline should fail the victim's request: {wrong_guess}"
    );
}

/// Plays (issue 47): a host that reads a sealed stream's chunk sizes, which
/// were one sealed chunk per token with the token's text length in clear
/// (" capital of France is Paris." read as 8, 3, 7, 3, 6, 1). Must hold:
/// every chunk after the first of a sealed stream has the same ciphertext
/// length, whatever its tokens, for answers of different token lengths, and
/// the stream still opens and verifies for its client (`completions_e2e`,
/// `sealing_e2e` stream their answers through the same code).
#[tokio::test]
async fn sealed_stream_chunks_do_not_tell_token_lengths() {
    let _one = serial().await;
    let rig = Rig::generation("hostile-shape", &[[0, 15], [15, 30]]);
    let mut p = rig.pipeline().await;
    let mut lengths = std::collections::BTreeMap::new();
    for prompt in [VICTIM_PROMPT, ATTACKER_PROMPT, "Numbers: 1, 22, 333, 4444,"] {
        let mut b = banned_eos(&p, prompt);
        b["stream"] = json!(true);
        b["max_tokens"] = json!(12);
        let chunks = sealed_chunk_lengths(&mut p, &b).await;
        assert!(chunks.len() >= 12, "{prompt:?}: {chunks:?}");
        lengths.insert(prompt, chunks);
    }
    // The token chunks (all but the first, which carries the first event,
    // and the last two: the final event and the trailer) are all one size,
    // for every answer; every chunk is a whole bucket.
    let mut sizes = std::collections::BTreeSet::new();
    for (prompt, chunks) in &lengths {
        for &c in chunks {
            assert_eq!(
                (c - proto::sealing::TAG_LEN) % proto::sealing::PAD_BUCKET,
                0,
                "{prompt:?}: a chunk of {c} bytes is not a whole bucket: {chunks:?}"
            );
        }
        sizes.extend(chunks[1..chunks.len() - 2].iter().copied());
    }
    assert_eq!(
        sizes.len(),
        1,
        "token chunks of several sizes, so their lengths show: {lengths:?}"
    );
    p.close().await;
}

/// The ciphertext length of every sealed chunk of the stream the pipeline
/// answers `body` with, sealed to the enclave, as the host sees them.
async fn sealed_chunk_lengths(p: &mut Pipeline, body: &serde_json::Value) -> Vec<usize> {
    let sealed = p.seal(body);
    let id = fresh_id();
    assert!(p.submit(&sealed, id, Sealing::Enclave).await);
    let mut first = true;
    let mut chunks = Vec::new();
    for m in p.stream_for(id, ANSWER).await {
        let data = match m {
            ResultMessage::StreamData { data, .. } => data,
            ResultMessage::StreamEnd { data, .. } => data,
            ResultMessage::StreamStart { .. } => continue,
            other => panic!("the stream failed: {other:?}"),
        };
        // The first bytes are the response nonce (AES-128-GCM: 16).
        let mut rest = if std::mem::take(&mut first) {
            &data[16..]
        } else {
            &data[..]
        };
        while !rest.is_empty() {
            let len = u32::from_be_bytes(rest[..4].try_into().unwrap()) as usize;
            chunks.push(len);
            rest = &rest[4 + len..];
        }
    }
    chunks
}

/// Plays (issue 47, item 2): counting a coalesced stream's chunks. Must
/// hold: with `stream_options.coalesce_ms`, the host sees about one chunk
/// per time slice, not one per token: 48 tokens in slices of a second
/// come in far fewer chunks than tokens (the first chunk goes at once, the
/// rest at the first step after each second and at the end), each a whole
/// bucket.
#[tokio::test]
async fn coalesced_streams_show_slices_not_tokens() {
    let _one = serial().await;
    let rig = Rig::generation("hostile-slices", &[[0, 15], [15, 30]]);
    let mut p = rig.pipeline().await;
    let mut b = banned_eos(&p, VICTIM_PROMPT);
    b["stream"] = json!(true);
    b["max_tokens"] = json!(48);
    let per_token = sealed_chunk_lengths(&mut p, &b).await;
    assert!(per_token.len() >= 48, "{per_token:?}");
    b["stream_options"] = json!({"coalesce_ms": 1000});
    let sliced = sealed_chunk_lengths(&mut p, &b).await;
    assert!(
        sliced.len() * 4 <= per_token.len(),
        "{} chunks for 48 tokens in one-second slices: {sliced:?}",
        sliced.len()
    );
    for c in &sliced {
        assert_eq!(
            (c - proto::sealing::TAG_LEN) % proto::sealing::PAD_BUCKET,
            0,
            "{sliced:?}"
        );
    }
    p.close().await;
}

/// Plays (issue 47, item 8): a host whose session with a stage dies of a
/// panic inside the stage (injected in the test build: the first `Stats`
/// a session asks for). Must hold: the stage tears that session's pipeline
/// down and releases itself, so a new host channel configures it (before,
/// it stayed owned by the dead session and refused every configuration
/// until restarted).
#[tokio::test]
async fn a_host_session_that_panics_releases_the_stage() {
    let _one = serial().await;
    let rig = Rig::generation("hostile-panic", &[[0, 30]]);
    let stage = rig.extra_stage_with(
        0,
        "panicky",
        &[("STAGE_FAULT_STAGE", "0"), ("STAGE_FAULT_PANIC", "1")],
    );
    let (mut h, r) = configure_at(&stage.endpoint, None, None).await;
    r.expect("the first host channel configures the stage");
    assert!(h.send(&HostMessage::Stats).await);
    assert!(
        h.closed_within(CLOSE).await,
        "the panicking session's channel closes"
    );
    let (mut h2, r) = configure_at(&stage.endpoint, None, None).await;
    r.expect("a new host channel configures the stage after the panic");
    assert!(h2.send(&HostMessage::Stats).await);
    assert!(
        matches!(
            h2.next(ANSWER).await,
            common::hostile::Next::Reply(proto::frames::StageReply::Stats(_))
        ),
        "the reconfigured stage answers"
    );
    h2.close().await;
}

/// A completions body for `prompt` that runs exactly 8 tokens (the end of
/// text and padding banned).
fn banned_eos(p: &Pipeline, prompt: &str) -> serde_json::Value {
    let mut b = p.body(json!(prompt));
    b["logit_bias"] = json!({"0": -100, "2": -100});
    b
}

/// One cross-wired run (see above) with the host's own request for
/// `attacker_prompt`: what the victim observes of its request (failed with
/// a status, accepted, refused, nothing), after checking the invariant.
async fn crosswired(rig: &Rig, attacker_prompt: &str, clean: &str, tag: &str) -> String {
    let e2 = rig.extra_stage(0, &format!("entry2{tag}"));
    let x1 = rig.extra_stage(1, &format!("exit1{tag}"));
    let (x1_host, r) = configure_at(&x1.endpoint, None, Some(rig.endpoint(0))).await;
    r.expect("X1 takes the entry stage's feedback session");
    let (mut e2_host, r) = configure_at(&e2.endpoint, Some(x1.endpoint.clone()), None).await;
    let e2_keys = r.expect("E2 dials X1").key_set;
    let mut p = rig.pipeline_fed_by(Some(e2.endpoint.clone())).await;
    let victim = Client {
        name: "victim".into(),
        sealed: p.seal(&banned_eos(&p, VICTIM_PROMPT)),
        want: Want::Text(clean.into()),
    };
    // The host's own request, sealed to E2's key.
    let (keys, _) =
        proto::bundle::entry_keys(e2_host.peer.claims.as_ref().unwrap(), e2_keys.as_deref())
            .unwrap();
    let attacker_body = serde_json::to_vec(&banned_eos(&p, attacker_prompt)).unwrap();
    let (headers, sealed_body, _) =
        proto::sealing::seal_request(&keys[0], proto::sealing::Aead::Aes128Gcm, &attacker_body)
            .unwrap();
    let id = fresh_id();
    assert!(p.submit(&victim.sealed, id, Sealing::Enclave).await);
    let attack = HostMessage::Request(proto::frames::SealedRequest {
        request_id: id,
        endpoint: "/v1/completions".into(),
        headers,
        body: sealed_body,
        client_nonce: None,
        // Sealed as a client would (the host may play one).
        sealing: Sealing::Enclave,
        trace: None,
    });
    assert!(e2_host.send(&attack).await);
    let results = p.collect(1, Duration::from_secs(30)).await;
    p.check_invariant(&results, &[&victim]);
    let seen = match results.iter().find(|r| request_id_of(r) == id) {
        None => "no answer".to_string(),
        Some(ResultMessage::Failed { error, .. }) => format!("failed with {}", error.status),
        Some(r) => match accept(&p.attested, &victim.sealed, r) {
            Ok(_) => "accepted".into(),
            Err(_) => "refused".into(),
        },
    };
    p.close().await;
    e2_host.close().await;
    x1_host.close().await;
    seen
}

/// Plays: a host that delivers clients' sealed completions requests under
/// another endpoint (chat, embeddings, a look-alike path), each a first
/// delivery of its own request. The endpoint is not inside the seal, so
/// the stage only learns it from the host. Must hold: the invariant; no
/// relabelled delivery gets an answer its client accepts (the stage
/// refuses what its model does not serve or what does not parse as that
/// endpoint's request, and the receipt names the endpoint it served,
/// which the client compares with where it sent the request); a request
/// delivered under its own endpoint is answered and verifies.
#[tokio::test]
async fn relabelled_endpoints_are_not_accepted() {
    let _one = serial().await;
    let rig = Rig::generation("hostile-endpoint", &[[0, 30]]);
    let mut p = rig.pipeline().await;
    let clean = p.clean_text(VICTIM_PROMPT).await;
    let labels = [
        "/v1/chat/completions",
        "/v1/embeddings",
        "/v1/completions/",
        "/v1/Completions",
    ];
    let clients: Vec<Client> = labels
        .iter()
        .map(|l| {
            p.client(
                &format!("relabelled {l}"),
                VICTIM_PROMPT,
                Want::Text(clean.clone()),
            )
        })
        .collect();
    let mut ids = Vec::new();
    for (c, label) in clients.iter().zip(labels) {
        let id = fresh_id();
        let mut req = request(&c.sealed, id, Sealing::Enclave);
        req.endpoint = label.into();
        assert!(p.hosts[0].send(&HostMessage::Request(req)).await);
        ids.push(id);
    }
    let results = p.collect(labels.len(), ANSWER).await;
    let refs: Vec<&Client> = clients.iter().collect();
    p.check_invariant(&results, &refs);
    for ((c, label), id) in clients.iter().zip(labels).zip(&ids) {
        for r in results.iter().filter(|r| request_id_of(r) == *id) {
            if let Ok(v) = accept(&p.attested, &c.sealed, r) {
                panic!("a delivery relabelled {label} was accepted by its client: {v}");
            }
        }
    }
    // The same kind of request under its own endpoint: answered, verified.
    let own = p.client("own endpoint", VICTIM_PROMPT, Want::Text(clean.clone()));
    let id = fresh_id();
    assert!(p.submit(&own.sealed, id, Sealing::Enclave).await);
    let r = p
        .result_for(id, ANSWER)
        .await
        .expect("the request under its own endpoint is answered");
    let v = accept(&p.attested, &own.sealed, &r).expect("and verifies");
    assert_eq!(completion_text(&v), clean);
    p.close().await;
}
