//! End to end: transparency-log witnesses (issue 49 item 3). `gateway
//! witness serve` processes speak C2SP tlog-witness; a gateway with
//! `[[transparency.witnesses]]` has its checkpoints cosigned, at start and
//! as the log grows (consistency proofs from what each witness saw); a
//! policy naming witnesses (`gateway policy pin --witness`) needs their
//! quorum. Playing a log operator who forks the log: the witness refuses
//! another root at a size it cosigned, a proof that does not verify, a
//! shrinking tree, another key and an unknown log, and keeps its state
//! across a restart.

mod common;

use common::{
    cli, evidence_bundle, gateway_bin, http_get, p, policy_pin, temp_dir, Gateway, Options,
};
use proto::policy::Policy;
use proto::report::CheckStatus;
use proto::transparency::{
    sign_checkpoint, verify_checkpoint, verify_cosignatures, AddCheckpoint, HashStore,
};
use std::io::{BufRead, BufReader};
use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

const MODEL: &str = "all-MiniLM-L6-v2";
const ORIGIN: &str = "test.example/witnessed";

/// A running `gateway witness serve`.
struct WitnessProc {
    child: Child,
    url: String,
}

impl Drop for WitnessProc {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// `gateway witness init`: the witness's verifier key.
fn witness_key(dir: &Path, name: &str) -> String {
    let key = dir.join(format!("{name}.key"));
    let (code, out, err) = cli(&["witness", "init", "--name", name, "--key", p(&key)]);
    assert_eq!(code, 0, "{err}");
    let (code, again, _) = cli(&["witness", "vkey", "--key", p(&key)]);
    assert_eq!((code, again.trim()), (0, out.trim()));
    out.trim().to_string()
}

fn start_witness(dir: &Path, name: &str, log_vkey: &str, listen: &str) -> WitnessProc {
    let mut child = Command::new(gateway_bin())
        .args(["witness", "serve", "--key"])
        .arg(dir.join(format!("{name}.key")))
        .arg("--state")
        .arg(dir.join(format!("{name}-state")))
        .args(["--log", log_vkey, "--listen", listen])
        .env("RUST_LOG", "info")
        .stdout(Stdio::piped())
        .stderr(std::fs::File::create(dir.join(format!("{name}.log"))).unwrap())
        .spawn()
        .unwrap();
    let mut line = String::new();
    BufReader::new(child.stdout.take().unwrap())
        .read_line(&mut line)
        .unwrap();
    let addr = line
        .trim()
        .strip_prefix("WITNESS LISTENING ")
        .unwrap_or_else(|| panic!("witness did not start: {line:?}"));
    WitnessProc {
        url: format!("http://{addr}"),
        child,
    }
}

fn free_port() -> String {
    let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    l.local_addr().unwrap().to_string()
}

/// The served checkpoint once `ok` holds of it (within 30 s).
async fn checkpoint_when(url: &str, ok: impl Fn(&[u8]) -> bool) -> Vec<u8> {
    let t0 = Instant::now();
    loop {
        let note = http_get(&format!("{url}/v1/transparency/checkpoint"))
            .await
            .bytes()
            .await
            .unwrap()
            .to_vec();
        if ok(&note) {
            return note;
        }
        assert!(
            t0.elapsed() < Duration::from_secs(30),
            "never: {}",
            String::from_utf8_lossy(&note)
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}

fn cosigners(note: &[u8], w: &str) -> usize {
    verify_cosignatures(note, &[w.to_string()]).unwrap().len()
}

#[tokio::test(flavor = "multi_thread")]
async fn witnesses_cosign_the_log_and_policies_need_their_quorum() {
    let dir = temp_dir("witnessed");
    let log_dir = dir.join("log");
    let (code, vkey, err) = cli(&["log", "init", "--dir", p(&log_dir), "--origin", ORIGIN]);
    assert_eq!(code, 0, "{err}");
    let vkey = vkey.trim().to_string();
    let (w1, w2) = (
        witness_key(&dir, "w1.example"),
        witness_key(&dir, "w2.example"),
    );
    let wit1 = start_witness(&dir, "w1.example", &vkey, "127.0.0.1:0");
    // The second witness is down when the gateway starts.
    let w2_addr = free_port();
    let gw = Gateway::start(Options {
        extra: format!(
            "\n[transparency]\ndir = {log_dir:?}\norigin = {ORIGIN:?}\nwitness_interval_secs = 1\n\
             [[transparency.witnesses]]\nurl = {:?}\nvkey = {w1:?}\n\
             [[transparency.witnesses]]\nurl = \"http://{w2_addr}\"\nvkey = {w2:?}\n",
            wit1.url
        ),
        ..Options::default()
    });
    // Cosigned by the first witness before the API served.
    let r = http_get(&format!("{}/v1/transparency/checkpoint", gw.url)).await;
    let note = r.bytes().await.unwrap().to_vec();
    let cp = verify_checkpoint(&note, &vkey, ORIGIN).unwrap();
    assert_eq!(cp.size(), 2, "the local build's two stages");
    assert_eq!((cosigners(&note, &w1), cosigners(&note, &w2)), (1, 0));
    assert!(
        gw.log().contains("no cosignature"),
        "the down witness is logged"
    );

    // A policy needing the first witness: pinned, and each bundle checks it.
    let out = dir.join("policy.toml");
    let pin = |extra: &[&str]| {
        policy_pin(
            &gw.url,
            MODEL,
            &out,
            &[&["--log-key", &vkey], extra].concat(),
        )
    };
    let (code, _, err) = pin(&["--witness", &w1]);
    assert_eq!(code, 0, "{err}");
    assert!(
        err.contains("cosigned by 1 of the policy's witnesses"),
        "{err}"
    );
    let policy = Policy::load(&out).unwrap();
    assert_eq!(
        policy.transparency.as_ref().unwrap().witnesses,
        std::slice::from_ref(&w1)
    );
    let check = |policy: &Policy, bundle: &proto::bundle::EvidenceBundle| {
        let (lines, verified) = bundle.verify(policy, &bundle.nonce);
        let l = lines.iter().find(|l| l.name == "transparency log").unwrap();
        (verified.is_some(), l.status, l.detail.clone())
    };
    let bundle = evidence_bundle(&gw.url, b"w").await;
    let (ok, status, detail) = check(&policy, &bundle);
    assert!(ok && status == CheckStatus::Pass, "{detail}");
    // Both witnesses (quorum 2, the default): refused, naming why.
    std::fs::remove_file(&out).unwrap();
    let (code, _, err) = pin(&["--witness", &w1, "--witness", &w2]);
    assert_eq!(code, 1, "{err}");
    assert!(err.contains("carries 1 valid cosignature(s)"), "{err}");
    assert!(err.contains("requires 2"), "{err}");
    assert!(!out.exists(), "nothing written");
    let (code, _, err) = pin(&["--witness", &w1, "--witness", &w2, "--witness-quorum", "3"]);
    assert_eq!(code, 2, "{err}");
    let mut both = policy.clone();
    both.transparency.as_mut().unwrap().witnesses = vec![w1.clone(), w2.clone()];
    let (ok, status, detail) = check(&both, &bundle);
    assert!(!ok && status == CheckStatus::Fail, "{detail}");
    assert!(detail.contains("split view"), "{detail}");
    // The bundle's cosignature stripped by the host: refused.
    let mut stripped = bundle.clone();
    let t = stripped.transparency.as_mut().unwrap();
    let text = String::from_utf8(t.checkpoint.clone()).unwrap();
    t.checkpoint = text
        .lines()
        .filter(|l| !l.starts_with("— w1.example "))
        .map(|l| format!("{l}\n"))
        .collect::<String>()
        .into_bytes();
    let (ok, _, detail) = check(&policy, &stripped);
    assert!(!ok && detail.contains("carries 0 valid"), "{detail}");

    // The second witness comes up: the next round has it cosign.
    let _wit2 = start_witness(&dir, "w2.example", &vkey, &w2_addr);
    let note = checkpoint_when(&gw.url, |n| cosigners(n, &w2) == 1).await;
    assert_eq!(cosigners(&note, &w1), 1);
    // (A fresh nonce: the gateway keeps each nonce's bundle.)
    let (ok, _, detail) = check(&both, &evidence_bundle(&gw.url, b"w2").await);
    assert!(ok, "{detail}");

    // A client keeps the checkpoint it saw (`verify evidence --log-state`).
    let state = dir.join("log-state.json");
    let log_url = format!("{}/v1/transparency", gw.url);
    let both_path = dir.join("both.toml");
    std::fs::write(&both_path, toml::to_string(&both).unwrap()).unwrap();
    let verify_saved = |nonce: &'static [u8]| {
        let url = gw.url.clone();
        let (state, log_url, both_path) = (state.clone(), log_url.clone(), both_path.clone());
        let dir = dir.clone();
        async move {
            let bytes = common::attestation_cbor(&url, nonce).await.2;
            let path = dir.join(format!("bundle-{}.cbor", hex::encode(nonce)));
            std::fs::write(&path, bytes).unwrap();
            cli(&[
                "verify",
                "evidence",
                "--policy",
                p(&both_path),
                "--nonce",
                &hex::encode(nonce),
                "--log-state",
                p(&state),
                "--log",
                &log_url,
                "--insecure-plain-http",
                p(&path),
            ])
        }
    };
    let (code, out, err) = verify_saved(b"v1").await;
    assert_eq!(code, 0, "{out}{err}");
    assert!(out.contains("PASS log consistency"), "{out}");

    // The log grows (another process appends): both witnesses cosign the
    // new size, from a consistency proof.
    let record = dir.join("record.json");
    std::fs::write(
        &record,
        serde_json::json!({
            "format": "enclave-stage build record v1",
            "binary": {"sha256": "11".repeat(32)},
            "model": {"manifest_sha256": "33".repeat(32)},
            "stage_policy": {"sha256": "22".repeat(32)},
            "pipeline": {"layers": [[0, 6]]},
            "source": {"commit": "0123abc", "dirty": false},
        })
        .to_string(),
    )
    .unwrap();
    let (code, _, err) = cli(&[
        "log",
        "add-release",
        "--dir",
        p(&log_dir),
        p(&record),
        "--mock",
    ]);
    assert_eq!(code, 0, "{err}");
    let note = checkpoint_when(&gw.url, |n| {
        verify_checkpoint(n, &vkey, ORIGIN).unwrap().size() == 4
            && cosigners(n, &w1) == 1
            && cosigners(n, &w2) == 1
    })
    .await;
    assert!(String::from_utf8_lossy(&note).contains("\n4\n"));
    // The client proves the growth from the log's tiles and keeps size 3.
    let (code, out, err) = verify_saved(b"v2").await;
    assert_eq!(code, 0, "{out}{err}");
    assert!(
        out.contains("proven consistent with the checkpoint kept at size 3"),
        "{out}"
    );
    let kept: serde_json::Value = serde_json::from_slice(&std::fs::read(&state).unwrap()).unwrap();
    assert_eq!(kept["logs"][0]["size"], 4, "{kept}");
    // A forked history at the kept size, signed with the log's own key and
    // cosigned by nobody, planted in the state (as if shown to this client
    // before): the gateway's checkpoint is then refused as a split view.
    let seed: [u8; 32] = std::fs::read(log_dir.join("key"))
        .unwrap()
        .try_into()
        .unwrap();
    let key = ed25519_dalek::SigningKey::from_bytes(&seed);
    let fork_root = proto::transparency::Hash([7; 32]);
    let forged = sign_checkpoint(&key, ORIGIN, 4, fork_root).unwrap();
    let mut planted = kept.clone();
    planted["logs"][0]["root"] = hex::encode(fork_root.0).into();
    planted["logs"][0]["checkpoint"] = String::from_utf8(forged).unwrap().into();
    std::fs::write(&state, planted.to_string()).unwrap();
    let (code, out, err) = verify_saved(b"v3").await;
    assert_eq!(code, 1, "{out}{err}");
    assert!(
        out.contains("FAIL log consistency") && out.contains("split view"),
        "{out}"
    );
}

#[tokio::test(flavor = "multi_thread")]
async fn a_witness_refuses_a_forked_log_and_keeps_what_it_saw() {
    let dir = temp_dir("fork");
    let log_dir = dir.join("log");
    let (code, vkey, err) = cli(&["log", "init", "--dir", p(&log_dir), "--origin", ORIGIN]);
    assert_eq!(code, 0, "{err}");
    let vkey = vkey.trim().to_string();
    // The log operator's key, as a dishonest operator holds it.
    let seed: [u8; 32] = std::fs::read(log_dir.join("key"))
        .unwrap()
        .try_into()
        .unwrap();
    let key = ed25519_dalek::SigningKey::from_bytes(&seed);
    let w = witness_key(&dir, "w.example");
    let mut wit = start_witness(&dir, "w.example", &vkey, "127.0.0.1:0");

    let tree = |tag: &str, n: u64| {
        let mut t = HashStore::new();
        for i in 0..n {
            let branch = if i < 3 { "common" } else { tag };
            t.append(format!("{branch} {i}").as_bytes()).unwrap();
        }
        t
    };
    let note = |t: &HashStore, n: u64, k: &ed25519_dalek::SigningKey| {
        sign_checkpoint(k, ORIGIN, n, t.root(n).unwrap()).unwrap()
    };
    let post = |body: Vec<u8>| {
        let url = format!("{}/add-checkpoint", wit.url);
        async move {
            let r = common::client().post(url).body(body).send().await.unwrap();
            let ct = r
                .headers()
                .get("content-type")
                .map(|v| v.to_str().unwrap().to_string());
            (r.status().as_u16(), ct, r.text().await.unwrap())
        }
    };
    let add = |old: u64, proof: Vec<proto::transparency::Hash>, checkpoint: Vec<u8>| {
        AddCheckpoint {
            old_size: old,
            proof,
            checkpoint,
        }
        .to_bytes()
    };
    let (a, b) = (tree("a", 8), tree("b", 8));

    // Branch A at size 4: cosigned.
    let (code, _, body) = post(add(0, vec![], note(&a, 4, &key))).await;
    assert_eq!(code, 200, "{body}");
    let cosigned =
        proto::transparency::add_cosignatures(&note(&a, 4, &key), std::slice::from_ref(&body))
            .unwrap();
    assert_eq!(cosigners(&cosigned, &w), 1);
    // A log that forgot what the witness saw: 409 with the size.
    let (code, ct, body) = post(add(0, vec![], note(&a, 6, &key))).await;
    assert_eq!(
        (code, ct.as_deref(), body.as_str()),
        (409, Some("text/x.tlog.size"), "4\n")
    );
    // Branch B at the same size: a fork, refused.
    let (code, ct, body) = post(add(4, vec![], note(&b, 4, &key))).await;
    assert_eq!(code, 409, "{body}");
    assert_ne!(ct.as_deref(), Some("text/x.tlog.size"));
    // Branch B grown, with B's own proof from 4: does not extend A's 4.
    let proof = b.prove_consistency(6, 4).unwrap();
    let (code, _, body) = post(add(4, proof, note(&b, 6, &key))).await;
    assert_eq!(code, 422, "{body}");
    // A shrinking tree, another key, another log, a malformed body.
    let (code, _, _) = post(add(4, vec![], note(&a, 3, &key))).await;
    assert_eq!(code, 400);
    let other = ed25519_dalek::SigningKey::from_bytes(&[9; 32]);
    let proof = a.prove_consistency(6, 4).unwrap();
    let (code, _, _) = post(add(4, proof.clone(), note(&a, 6, &other))).await;
    assert_eq!(code, 403);
    let stranger = sign_checkpoint(&key, "other.example/log", 6, a.root(6).unwrap()).unwrap();
    let (code, _, _) = post(add(4, proof.clone(), stranger)).await;
    assert_eq!(code, 404);
    let (code, _, _) = post(b"old 4\nnot base64\n\n".to_vec()).await;
    assert_eq!(code, 400);
    // A's honest growth: cosigned.
    let (code, _, body) = post(add(4, proof, note(&a, 6, &key))).await;
    assert_eq!(code, 200, "{body}");
    let log = std::fs::read_to_string(dir.join("w.example.log")).unwrap();
    assert!(log.contains("FORK"), "{log}");

    // Restarted, the witness still holds size 6 of branch A.
    drop(wit);
    wit = start_witness(&dir, "w.example", &vkey, "127.0.0.1:0");
    let post = |body: Vec<u8>| {
        let url = format!("{}/add-checkpoint", wit.url);
        async move {
            let r = common::client().post(url).body(body).send().await.unwrap();
            (r.status().as_u16(), r.text().await.unwrap())
        }
    };
    assert_eq!(
        post(add(0, vec![], note(&a, 8, &key))).await,
        (409, "6\n".into())
    );
    let proof = b.prove_consistency(8, 6).unwrap();
    assert_eq!(post(add(6, proof, note(&b, 8, &key))).await.0, 422);
    let proof = a.prove_consistency(8, 6).unwrap();
    assert_eq!(post(add(6, proof, note(&a, 8, &key))).await.0, 200);
    // One witness per state folder.
    let out = Command::new(gateway_bin())
        .args(["witness", "serve", "--key"])
        .arg(dir.join("w.example.key"))
        .arg("--state")
        .arg(dir.join("w.example-state"))
        .args(["--log", &vkey, "--listen", "127.0.0.1:0"])
        .output()
        .unwrap();
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("in use by another witness"));
}
