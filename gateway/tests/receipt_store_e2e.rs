//! End to end: the receipt store shared by several gateways (issue 14's
//! "several gateways"). A receipt issued by one gateway is fetched from
//! another gateway sharing the store and verifies; it outlives the gateway
//! that issued it. Twice: an SQLite file (the default, one machine) and a
//! real PostgreSQL server that the test starts itself (Debian's
//! `postgresql` package; `scripts/test.sh` installs it), with the password
//! given only in `PGPASSWORD`. And when the database goes away, requests
//! are still answered with their receipts, while `GET /v1/receipts/{id}`
//! says 503 `receipt_store_unavailable` instead of a false 404.

mod common;

use base64::Engine as _;
use common::{
    alive, client_policy_text, evidence_bundle, http_get, metrics_text, post_exact, sample, signal,
    temp_dir, Gateway, Options,
};
use proto::policy::Policy;
use proto::receipt::{verify_receipt, DigestSalt, VerifyInputs};
use serde_json::json;
use std::net::TcpListener;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

const MODEL: &str = "all-MiniLM-L6-v2";

/// One embeddings request's receipt id, receipt and digest salt (from the
/// response headers), with the exact request and response bytes.
struct Issued {
    id: String,
    receipt: Vec<u8>,
    salt: DigestSalt,
    request: Vec<u8>,
    response: Vec<u8>,
}

async fn issue(url: &str, text: &str) -> Issued {
    let request = serde_json::to_vec(&json!({"model": MODEL, "input": [text]})).unwrap();
    let r = post_exact(&format!("{url}/v1/embeddings"), request.clone(), None).await;
    assert_eq!(r.status(), 200);
    let h = r.headers().clone();
    Issued {
        id: h["receipt-id"].to_str().unwrap().to_string(),
        receipt: base64::engine::general_purpose::URL_SAFE_NO_PAD
            .decode(h["receipt"].to_str().unwrap())
            .unwrap(),
        salt: hex::decode(h["receipt-digest-salt"].to_str().unwrap())
            .unwrap()
            .try_into()
            .unwrap(),
        request,
        response: r.bytes().await.unwrap().to_vec(),
    }
}

/// Fetches `issued` from the gateway at `url` and verifies it against the
/// issuing gateway's evidence (`policy` pins its stages).
async fn fetch_and_verify(url: &str, issued: &Issued, evidence_from: &str, policy: &Policy) {
    let r = http_get(&format!("{url}/v1/receipts/{}", issued.id)).await;
    assert_eq!(r.status(), 200, "the receipt is found through {url}");
    assert_eq!(
        r.headers()["receipt-digest-salt"].to_str().unwrap(),
        hex::encode(issued.salt)
    );
    let stored = r.bytes().await.unwrap().to_vec();
    assert_eq!(
        stored, issued.receipt,
        "the same bytes the issuing gateway sent"
    );
    let nonce = b"shared store";
    let (lines, verified) = evidence_bundle(evidence_from, nonce)
        .await
        .verify(policy, nonce);
    let verified = verified.unwrap_or_else(|| panic!("evidence must verify: {lines:#?}"));
    let mut inputs = VerifyInputs::new(&stored, &verified.stage_keys);
    inputs.request = Some(&issued.request);
    inputs.response = Some(&issued.response);
    inputs.digest_salt = Some(&issued.salt);
    inputs.expected_manifest = Some(verified.manifest_digest);
    inputs.allow_mock = true;
    let report = verify_receipt(&inputs);
    assert!(report.ok(), "{:#?}", report.checks);
}

fn options(receipts: &str, env: &[(&str, &str)]) -> Options {
    Options {
        extra: format!("\n[receipts]\n{receipts}\n"),
        env: env
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect(),
        ..Options::default()
    }
}

/// Two gateways on one store: a receipt from either is found through the
/// other and verifies; it is still there after its gateway stopped.
async fn shared_by_two_gateways(receipts: &str, env: &[(&str, &str)]) {
    let a = Gateway::start(options(receipts, env));
    let b = Gateway::start(options(receipts, env));
    let policy_a = Policy::from_toml(&client_policy_text(&a.url).await).unwrap();
    let policy_b = Policy::from_toml(&client_policy_text(&b.url).await).unwrap();
    let from_a = issue(&a.url, "issued by gateway A").await;
    let from_b = issue(&b.url, "issued by gateway B").await;
    fetch_and_verify(&b.url, &from_a, &a.url, &policy_a).await;
    fetch_and_verify(&a.url, &from_b, &b.url, &policy_b).await;
    // An id no gateway issued is still a 404.
    let r = http_get(&format!("{}/v1/receipts/{}", b.url, "00".repeat(16))).await;
    assert_eq!(r.status(), 404);
    let body: serde_json::Value = r.json().await.unwrap();
    assert_eq!(body["error"]["code"], "receipt_not_found");
    // Gateway B stops; a new gateway on the store still answers for B's
    // receipt (verified against B's evidence, archived by the test).
    let evidence_b = evidence_bundle(&b.url, b"before stopping").await;
    drop(b);
    let c = Gateway::start(options(receipts, env));
    let r = http_get(&format!("{}/v1/receipts/{}", c.url, from_b.id)).await;
    assert_eq!(r.status(), 200);
    let stored = r.bytes().await.unwrap().to_vec();
    assert_eq!(stored, from_b.receipt);
    let (_, verified) = evidence_b.verify(&policy_b, b"before stopping");
    let verified = verified.expect("B's archived evidence verifies");
    let mut inputs = VerifyInputs::new(&stored, &verified.stage_keys);
    inputs.request = Some(&from_b.request);
    inputs.response = Some(&from_b.response);
    inputs.digest_salt = Some(&from_b.salt);
    inputs.allow_mock = true;
    assert!(verify_receipt(&inputs).ok());
}

#[tokio::test]
async fn sqlite_store_is_shared_by_gateways_on_one_machine() {
    let dir = temp_dir("receipts-sqlite");
    let file = dir.join("store/receipts.sqlite3");
    shared_by_two_gateways(&format!("store = \"sqlite\"\npath = {file:?}"), &[]).await;
    use std::os::unix::fs::PermissionsExt;
    let mode = std::fs::metadata(&file).unwrap().permissions().mode();
    assert_eq!(
        mode & 0o777,
        0o600,
        "the store is readable by its owner only"
    );
}

/// A PostgreSQL server in a temporary folder, stopped on drop.
struct Postgres {
    child: Child,
    port: u16,
    dir: PathBuf,
    killed: bool,
}

const PG_USER: &str = "gateway";
const PG_PASSWORD: &str = "a test password, never in a URL";

/// The PostgreSQL server binaries (Debian puts them under
/// /usr/lib/postgresql/<version>/bin).
fn pg_bin(name: &str) -> PathBuf {
    let mut found: Vec<PathBuf> = std::fs::read_dir("/usr/lib/postgresql")
        .map(|d| {
            d.flatten()
                .map(|e| e.path().join("bin").join(name))
                .collect()
        })
        .unwrap_or_default();
    found.retain(|p| p.exists());
    found.sort();
    found.pop().unwrap_or_else(|| {
        panic!("no PostgreSQL server: install Debian's `postgresql` package (scripts/test.sh does)")
    })
}

/// Runs a PostgreSQL binary as the `postgres` user when we are root (the
/// server refuses to run as root).
fn pg_command(bin: &Path) -> Command {
    let root = Command::new("id")
        .arg("-u")
        .output()
        .is_ok_and(|o| o.stdout.starts_with(b"0\n"));
    if root {
        let mut c = Command::new("runuser");
        c.args(["-u", "postgres", "--"]).arg(bin);
        c
    } else {
        Command::new(bin)
    }
}

impl Postgres {
    fn start() -> Postgres {
        let dir = temp_dir("receipts-pg");
        let data = dir.join("data");
        let pwfile = dir.join("pw");
        std::fs::write(&pwfile, PG_PASSWORD).unwrap();
        // The server's user must own its folder (and read the password file).
        let _ = Command::new("chown")
            .args(["-R", "postgres:postgres"])
            .arg(&dir)
            .status();
        let out = pg_command(&pg_bin("initdb"))
            .args(["-U", PG_USER, "-A", "scram-sha-256", "--pwfile"])
            .arg(&pwfile)
            .arg("-D")
            .arg(&data)
            .output()
            .unwrap();
        assert!(
            out.status.success(),
            "initdb: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        std::fs::remove_file(&pwfile).unwrap();
        let port = TcpListener::bind("127.0.0.1:0")
            .unwrap()
            .local_addr()
            .unwrap()
            .port();
        let child = pg_command(&pg_bin("postgres"))
            .arg("-D")
            .arg(&data)
            .args(["-p", &port.to_string(), "-k"])
            .arg(&dir)
            .args(["-c", "listen_addresses=127.0.0.1"])
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .unwrap();
        let pg = Postgres {
            child,
            port,
            dir,
            killed: false,
        };
        let t = Instant::now();
        while std::net::TcpStream::connect(("127.0.0.1", port)).is_err() {
            assert!(
                t.elapsed() < Duration::from_secs(60),
                "PostgreSQL did not start"
            );
            std::thread::sleep(Duration::from_millis(100));
        }
        pg
    }

    fn url(&self) -> String {
        format!("postgres://{PG_USER}@127.0.0.1:{}/postgres", self.port)
    }

    /// Stops the server at once: `SIGKILL` of the postmaster and of every
    /// backend it forked. A backend outlives its killed postmaster until it
    /// next waits on its client, so killing only the postmaster leaves the
    /// gateway's pooled connections answering for a moment (a flaky 200
    /// where the test expects the store to be gone).
    fn kill(&mut self) {
        if std::mem::replace(&mut self.killed, true) {
            return;
        }
        // Through runuser the child is runuser: kill the server itself (its
        // pid is the first line of postmaster.pid). Stopped first, so it
        // forks no backend between the listing and the kill.
        let mut pids = Vec::new();
        if let Ok(text) = std::fs::read_to_string(self.dir.join("data/postmaster.pid")) {
            if let Some(pid) = text.lines().next().and_then(|l| l.trim().parse().ok()) {
                signal(pid, "STOP");
                pids.push(pid);
                pids.extend(children_of(pid));
            }
        }
        for &pid in &pids {
            signal(pid, "KILL");
        }
        let t = Instant::now();
        while pids.iter().any(|&p| alive(p)) && t.elapsed() < Duration::from_secs(10) {
            std::thread::sleep(Duration::from_millis(20));
        }
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// The processes whose parent is `pid` (from `/proc/*/stat`).
fn children_of(pid: u32) -> Vec<u32> {
    let Ok(dir) = std::fs::read_dir("/proc") else {
        return Vec::new();
    };
    dir.flatten()
        .filter_map(|e| e.file_name().to_str()?.parse::<u32>().ok())
        .filter(|child| {
            std::fs::read_to_string(format!("/proc/{child}/stat")).is_ok_and(|s| {
                // Fields after the parenthesised name: state, ppid, ...
                s.rsplit(')')
                    .next()
                    .and_then(|rest| rest.split_whitespace().nth(1)?.parse::<u32>().ok())
                    == Some(pid)
            })
        })
        .collect()
}

impl Drop for Postgres {
    fn drop(&mut self) {
        self.kill();
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

#[tokio::test]
async fn postgres_store_is_shared_by_a_fleet_and_its_loss_is_not_a_404() {
    let mut pg = Postgres::start();
    let receipts = format!("store = \"postgres\"\nurl = {:?}", pg.url());
    let env = [("PGPASSWORD", PG_PASSWORD)];
    shared_by_two_gateways(&receipts, &env).await;

    // Without the password the gateway does not start, and says why.
    match Gateway::try_start(options(&receipts, &[("PGPASSWORD", "wrong")])) {
        Ok(_) => panic!("a gateway started with the wrong database password"),
        Err(f) => assert!(f.stderr.contains("receipts.url"), "{}", f.stderr),
    }
    // A password in the URL is refused before anything connects.
    let with_password = format!(
        "store = \"postgres\"\nurl = \"postgres://{PG_USER}:{PG_PASSWORD}@127.0.0.1:{}/postgres\"",
        pg.port
    );
    match Gateway::try_start(options(&with_password, &[])) {
        Ok(_) => panic!("a gateway started with a password in its config"),
        Err(f) => {
            assert!(f.stderr.contains("PGPASSWORD"), "{}", f.stderr);
            assert!(
                !f.stderr.contains(PG_PASSWORD),
                "the password is not echoed"
            );
        }
    }

    // The database goes away under a running gateway.
    let gw = Gateway::start(options(&receipts, &env));
    let before = issue(&gw.url, "stored before the database went away").await;
    pg.kill();
    let r = http_get(&format!("{}/v1/receipts/{}", gw.url, before.id)).await;
    assert_eq!(r.status(), 503, "not a false 404");
    assert!(r.headers().contains_key("retry-after"));
    let body: serde_json::Value = r.json().await.unwrap();
    assert_eq!(body["error"]["code"], "receipt_store_unavailable");
    // Requests are still answered, with their receipts; the metric counts
    // the receipts the store did not keep.
    let after = issue(&gw.url, "answered while the database is away").await;
    assert!(!after.receipt.is_empty());
    let text = metrics_text(&gw.url).await;
    assert!(
        sample(&text, "gateway_receipts_not_stored_total") >= 1.0,
        "{text}"
    );
    assert!(!gw.log().contains(PG_PASSWORD), "no secret in the log");
}
