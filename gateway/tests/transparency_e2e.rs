//! End to end: the transparency log (issue 49). A gateway with
//! `[transparency]` makes its log at start and logs its locally built
//! stages' releases; the log is served read-only in the C2SP tlog-tiles
//! layout; `gateway policy pin --log-key` pins only what the log holds;
//! `gateway log add-release` grows the log while the gateway serves it; the
//! log survives a restart; an independent verifier written from the C2SP
//! texts (`scripts/tlog_verify.py`) reads the same tiles; and a log altered
//! on disk is refused.

mod common;

use common::{cli, evidence_bundle, http_get, p, start_proxy, temp_dir, Gateway, Options};
use proto::policy::Policy;
use proto::report::CheckStatus;
use proto::transparency::{split_bundle, verify_checkpoint, Entry, Measurement};
use std::path::Path;
use std::process::Command;

const MODEL: &str = "all-MiniLM-L6-v2";
const ORIGIN: &str = "test.example/tlog";

fn options(log_dir: &Path, log_local_build: bool) -> Options {
    Options {
        extra: format!(
            "\n[transparency]\ndir = {log_dir:?}\norigin = {ORIGIN:?}\nlog_local_build = {log_local_build}\n"
        ),
        ..Options::default()
    }
}

fn vkey_of(log_dir: &Path) -> String {
    let (code, out, err) = cli(&["log", "vkey", "--dir", p(log_dir)]);
    assert_eq!(code, 0, "{err}");
    out.trim().to_string()
}

async fn checkpoint(url: &str, vkey: &str) -> (Vec<u8>, proto::transparency::Checkpoint) {
    let r = http_get(&format!("{url}/v1/transparency/checkpoint")).await;
    assert_eq!(r.status(), 200);
    assert_eq!(r.headers()["cache-control"], "no-cache");
    let note = r.bytes().await.unwrap().to_vec();
    let cp = verify_checkpoint(&note, vkey, ORIGIN).expect("the served checkpoint verifies");
    (note, cp)
}

/// `gateway policy pin --gateway URL --model MODEL --out OUT EXTRA…`:
/// (exit code, stdout, stderr).
fn pin(url: &str, out: &Path, extra: &[&str]) -> (i32, String, String) {
    common::policy_pin(url, MODEL, out, extra)
}

/// `gateway policy pin --log-key VKEY` for MODEL into `out`.
fn pin_from_log(url: &str, vkey: &str, out: &Path) -> (i32, String, String) {
    pin(url, out, &["--log-key", vkey])
}

/// The `transparency log` check line of a bundle's verification.
fn log_line(lines: &[proto::report::Check]) -> (CheckStatus, String) {
    lines
        .iter()
        .find(|l| l.name == "transparency log")
        .map(|l| (l.status, l.detail.clone()))
        .expect("a transparency log line")
}

/// `scripts/tlog_verify.py` when Python has what it needs (scripts/test.sh's
/// virtualenv does); `None` when not.
fn python_verifier(url: &str, vkey: &str, state: &Path) -> Option<(bool, String)> {
    let script = common::root().join("scripts/tlog_verify.py");
    let ok = Command::new("python3")
        .args(["-c", "import cryptography"])
        .status()
        .is_ok_and(|s| s.success());
    if !ok || !script.exists() {
        eprintln!(
            "SKIPPED the independent verifier: python3 with `cryptography` and {} needed",
            script.display()
        );
        return None;
    }
    let out = Command::new("python3")
        .arg(&script)
        .args([
            "--url",
            &format!("{url}/v1/transparency"),
            "--vkey",
            vkey,
            "--state",
            p(state),
            "--inclusion",
            "0",
            "--json",
        ])
        .output()
        .unwrap();
    Some((
        out.status.success(),
        format!(
            "{}{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        ),
    ))
}

fn record(dir: &Path) -> std::path::PathBuf {
    let path = dir.join("build-record.json");
    let manifest = proto::manifest::LoadedManifest::load(&common::model_dir())
        .unwrap()
        .digest;
    std::fs::write(
        &path,
        serde_json::json!({
            "format": "enclave-stage build record v1",
            "binary": {"sha256": "11".repeat(32)},
            "model": {"manifest_sha256": manifest.hex()},
            "stage_policy": {"sha256": "22".repeat(32)},
            "pipeline": {"layers": [[0, 3], [3, 6]]},
            "source": {"commit": "0123abc", "dirty": false},
        })
        .to_string(),
    )
    .unwrap();
    path
}

#[tokio::test(flavor = "multi_thread")]
async fn releases_are_logged_served_pinned_and_kept() {
    let dir = temp_dir("tlog");
    let log_dir = dir.join("log");
    let mut gw = Gateway::start(options(&log_dir, true));
    let vkey = vkey_of(&log_dir);
    assert!(vkey.starts_with(&format!("{ORIGIN}+")), "{vkey}");
    use std::os::unix::fs::PermissionsExt;
    let mode = std::fs::metadata(log_dir.join("key"))
        .unwrap()
        .permissions()
        .mode();
    assert_eq!(mode & 0o777, 0o600, "the log key is the owner's only");

    // The local build's release, one entry per stage, in the served log.
    let (note, cp) = checkpoint(&gw.url, &vkey).await;
    assert_eq!(cp.size(), 2, "{}", String::from_utf8_lossy(&note));
    let r = http_get(&format!("{}/v1/transparency/tile/entries/000.p/2", gw.url)).await;
    assert_eq!(r.status(), 200);
    assert_eq!(
        r.headers()["cache-control"],
        "public, max-age=31536000, immutable"
    );
    let leaves = split_bundle(&r.bytes().await.unwrap()).unwrap();
    let bundle = evidence_bundle(&gw.url, b"tlog").await;
    let mut layers = Vec::new();
    for (leaf, stage) in leaves.iter().zip(&bundle.stages) {
        let Ok(Entry::Release(rel)) = Entry::from_bytes(leaf) else {
            panic!("a release entry");
        };
        assert!(matches!(rel.measurement, Measurement::Mock(_)));
        assert_eq!(rel.manifest_digest, stage.claims.manifest_sha256);
        assert!(rel.version.starts_with("local build"), "{}", rel.version);
        layers.push(rel.layers);
    }
    assert_eq!(layers, [(0, 3), (3, 6)]);
    let tile = http_get(&format!("{}/v1/transparency/tile/0/000.p/2", gw.url))
        .await
        .bytes()
        .await
        .unwrap();
    let leaf_hashes: Vec<u8> = leaves
        .iter()
        .flat_map(|l| Entry::from_bytes(l).unwrap().leaf_hash().0)
        .collect();
    assert_eq!(
        tile.to_vec(),
        leaf_hashes,
        "level 0 holds the entries' RFC 6962 leaf hashes"
    );
    for missing in [
        "tile/0/000.p/4",
        "tile/0/000",
        "tile/entries/001",
        "tile/0/0",
        "tile/8/0/000",
        "tile/0/000.p/0",
        "tile/64/000",
        "tile/entries/000.p/0",
    ] {
        let r = http_get(&format!("{}/v1/transparency/{missing}", gw.url)).await;
        assert_eq!(r.status(), 404, "{missing}");
        let body: serde_json::Value = r.json().await.unwrap();
        assert!(body["error"]["message"].is_string(), "{body}");
    }

    // A policy pinned from the log: no trust on first use, and it verifies
    // fresh evidence.
    let out = dir.join("logged.toml");
    let (code, stdout, err) = pin_from_log(&gw.url, &vkey, &out);
    assert_eq!(code, 0, "{stdout}\n{err}");
    assert!(!err.contains("TRUST ON FIRST USE"), "{err}");
    let text = std::fs::read_to_string(&out).unwrap();
    assert!(text.contains("release entry [0, 1]"), "{text}");
    assert!(text.contains(ORIGIN), "{text}");
    assert_eq!(text.matches("measurements = [\"mock:").count(), 2, "{text}");
    assert!(
        text.contains(&format!("[transparency]\nlog_key = {vkey:?}")),
        "{text}"
    );
    let policy = Policy::load(&out).unwrap();
    let nonce = b"fresh nonce";
    let bundle = evidence_bundle(&gw.url, nonce).await;
    let (lines, verified) = bundle.verify(&policy, nonce);
    assert!(verified.is_some(), "{lines:#?}");
    assert_eq!(log_line(&lines).0, CheckStatus::Pass, "{lines:#?}");
    assert!(log_line(&lines).1.contains("entries [0, 1]"), "{lines:#?}");

    // At each use the policy needs the bundle's proofs: a host that drops
    // them, tampers with one, or serves another log's checkpoint is refused.
    let mut stripped = bundle.clone();
    stripped.transparency = None;
    let (lines, verified) = stripped.verify(&policy, nonce);
    assert!(verified.is_none());
    assert!(
        log_line(&lines).1.contains("carries no proofs"),
        "{lines:#?}"
    );
    let mut tampered = bundle.clone();
    tampered.transparency.as_mut().unwrap().stages[1].proof[0][0] ^= 1;
    let (lines, verified) = tampered.verify(&policy, nonce);
    assert!(verified.is_none());
    assert!(
        log_line(&lines)
            .1
            .contains("stage 1: entry 1 is not proven included"),
        "{lines:#?}"
    );
    let mut swapped = bundle.clone();
    swapped.transparency.as_mut().unwrap().stages.swap(0, 1);
    let (lines, _) = swapped.verify(&policy, nonce);
    assert!(
        log_line(&lines).1.contains("the proof is for stage 1"),
        "{lines:#?}"
    );

    // The keys a client seals to are logged too (the first attestation
    // logged them): a bundle without that proof, or whose key set is not
    // the logged one, is refused.
    let (code, listed, _) = cli(&["log", "entries", "--dir", p(&log_dir)]);
    assert_eq!(code, 0);
    let keys: serde_json::Value = serde_json::from_str(listed.lines().nth(2).unwrap()).unwrap();
    assert_eq!(keys["kind"], "key_set", "{listed}");
    let key_line = |lines: &[proto::report::Check]| {
        let l = lines
            .iter()
            .find(|l| l.name == "logged key set")
            .expect("a key-set line");
        (l.status, l.detail.clone())
    };
    let (lines, _) = bundle.verify(&policy, nonce);
    assert_eq!(key_line(&lines).0, CheckStatus::Pass, "{lines:#?}");
    assert!(key_line(&lines).1.contains("key-set entry 2"), "{lines:#?}");
    let mut unlogged = bundle.clone();
    unlogged.transparency.as_mut().unwrap().key_set = None;
    let (lines, verified) = unlogged.verify(&policy, nonce);
    assert!(verified.is_none());
    assert!(
        key_line(&lines).1.contains("proves no key-set entry"),
        "{lines:#?}"
    );
    let mut other_keys = bundle.clone();
    let proven = other_keys
        .transparency
        .as_mut()
        .unwrap()
        .key_set
        .as_mut()
        .unwrap();
    let Ok(Entry::KeySet(mut k)) = Entry::from_bytes(&proven.entry) else {
        panic!("a key-set entry");
    };
    k.key_set_digest = proto::digest::Sha256Digest([9; 32]);
    proven.entry = Entry::KeySet(k).to_bytes();
    let (lines, verified) = other_keys.verify(&policy, nonce);
    assert!(verified.is_none());
    assert!(
        key_line(&lines)
            .1
            .contains("not the one the entry stage publishes"),
        "{lines:#?}"
    );

    // The proxy attests the gateway with the log-backed policy.
    let proxy = start_proxy(&gw.url, &[&out], &[], &dir)
        .unwrap_or_else(|(code, log)| panic!("proxy on the log-backed policy ({code}):\n{log}"));
    drop(proxy);

    // Another key under the same name: the checkpoint is refused, nothing written.
    let other = dir.join("other-log");
    let (code, other_vkey, err) = cli(&["log", "init", "--dir", p(&other), "--origin", ORIGIN]);
    assert_eq!(code, 0, "{err}");
    let refused = dir.join("refused.toml");
    let (code, _, err) = pin_from_log(&gw.url, other_vkey.trim(), &refused);
    assert_eq!(code, 2, "{err}");
    assert!(err.contains("checkpoint signature"), "{err}");
    assert!(!refused.exists());
    // And a policy naming that key refuses the gateway's proofs.
    let mut other_policy = policy.clone();
    other_policy.transparency.as_mut().unwrap().log_key = other_vkey.trim().to_string();
    let (lines, verified) = bundle.verify(&other_policy, nonce);
    assert!(verified.is_none());
    assert!(
        log_line(&lines).1.contains("the log's checkpoint"),
        "{lines:#?}"
    );

    // The independent verifier reads the same log, and keeps its checkpoint.
    let state = dir.join("verifier-state");
    if let Some((ok, report)) = python_verifier(&gw.url, &vkey, &state) {
        assert!(ok, "{report}");
        let v: serde_json::Value = serde_json::from_str(report.lines().next().unwrap()).unwrap();
        assert_eq!(v["size"], 3, "two releases and the key set");
        assert_eq!(
            v["entries"][1]["bytes"],
            hex::encode(&leaves[1]),
            "{report}"
        );
    }

    // A release logged from a build record while the gateway serves: it
    // reads the grown log without a restart; logging it again adds nothing.
    let rec = record(&dir);
    let add = || {
        cli(&[
            "log",
            "add-release",
            "--dir",
            p(&log_dir),
            p(&rec),
            "--mock",
        ])
    };
    let (code, stdout, err) = add();
    assert_eq!(code, 0, "{err}");
    assert!(
        stdout.contains("2 stage entries at [3, 4], 2 new; log size 5"),
        "{stdout}"
    );
    let (code, stdout, _) = add();
    assert_eq!(code, 0);
    assert!(stdout.contains("0 new; log size 5"), "{stdout}");
    let (note4, cp4) = checkpoint(&gw.url, &vkey).await;
    assert_eq!(cp4.size(), 5);
    let (code, listed, _) = cli(&["log", "entries", "--dir", p(&log_dir)]);
    assert_eq!(code, 0);
    let last: serde_json::Value = serde_json::from_str(listed.lines().nth(4).unwrap()).unwrap();
    assert_eq!(last["version"], "commit 0123abc", "{listed}");
    assert_eq!(last["layers"], serde_json::json!([3, 6]));
    if let Some((ok, report)) = python_verifier(&gw.url, &vkey, &state) {
        assert!(ok, "an append-only growth is consistent:\n{report}");
    }

    // Restarted, the gateway serves the same log: the same signed
    // checkpoint, and its local build is not logged again.
    assert_eq!(gw.interrupt(), Some(0));
    let gw = Gateway::start(options(&log_dir, true));
    let (again, _) = checkpoint(&gw.url, &vkey).await;
    assert_eq!(again, note4, "the log survives the restart unchanged");
    drop(gw);

    // The host alters an entry on disk: the gateway refuses to serve it
    // (and would not sign over the changed history).
    let entries = log_dir.join("entries");
    let mut bytes = std::fs::read(&entries).unwrap();
    let at = bytes.len() - 3;
    bytes[at] ^= 1;
    std::fs::write(&entries, &bytes).unwrap();
    let stderr = Gateway::refused(
        options(&log_dir, true),
        "an altered log must stop the start",
    );
    assert!(stderr.contains("the log was altered"), "{stderr}");
}

#[tokio::test(flavor = "multi_thread")]
async fn a_measurement_the_log_does_not_hold_is_not_pinned() {
    let dir = temp_dir("tlog-empty");
    let log_dir = dir.join("log");
    let gw = Gateway::start(options(&log_dir, false));
    let vkey = vkey_of(&log_dir);
    let (_, cp) = checkpoint(&gw.url, &vkey).await;
    assert_eq!(cp.size(), 0, "log_local_build = false logs nothing");
    let out = dir.join("p.toml");
    let (code, stdout, err) = pin_from_log(&gw.url, &vkey, &out);
    assert_eq!(code, 1, "{stdout}\n{err}");
    assert!(err.contains("stage 0: measurement mock:"), "{err}");
    assert!(
        err.contains("is not a release in transparency log"),
        "{err}"
    );
    assert!(!out.exists(), "nothing written");
    // A log-backed policy for these very measurements (written by hand):
    // the bundle carries no proofs, since the log holds no release.
    let (code, _, err) = pin(&gw.url, &out, &["--trust-on-first-use"]);
    assert_eq!(code, 0, "{err}");
    let mut policy = Policy::load(&out).unwrap();
    policy.transparency = Some(proto::policy::LogPolicy::new(vkey.clone()));
    let nonce = b"n";
    let (lines, verified) = evidence_bundle(&gw.url, nonce).await.verify(&policy, nonce);
    assert!(verified.is_none());
    assert!(
        log_line(&lines).1.contains("carries no proofs"),
        "{lines:#?}"
    );
    // Neither a TOFU nor a log key: refused, naming both.
    let (code, _, err) = pin(&gw.url, &out, &[]);
    assert_eq!(code, 2);
    assert!(
        err.contains("--log-key") && err.contains("--trust-on-first-use"),
        "{err}"
    );
}
