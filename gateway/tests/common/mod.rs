//! Test harness: starts the real `gateway` binary (which starts real
//! `enclave-stage` processes) on a temporary config and talks HTTP to it.
#![allow(dead_code)]

#[path = "../support/embeddings_reference.rs"]
mod embeddings_reference;
#[allow(unused_imports)]
pub use embeddings_reference::cosine;
use embeddings_reference::load_reference;

use std::io::{BufRead, BufReader, Read};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::Duration;

/// Repository root.
pub fn root() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("..")
}

/// A packaged model folder (set up by scripts/setup.sh), checked for `file`.
fn packaged_model(name: &str, file: &str) -> PathBuf {
    let d = root().join("models").join(name);
    assert!(d.join(file).exists(), "run scripts/setup.sh first");
    d.canonicalize().unwrap()
}

/// The packaged MiniLM folder.
pub fn model_dir() -> PathBuf {
    packaged_model("all-minilm-l6-v2", "manifest.json")
}

/// The packaged SmolLM2 folder.
pub fn smollm_dir() -> PathBuf {
    packaged_model("smollm2-135m-instruct", "tokenizer.json")
}

/// A fresh temporary folder.
pub fn temp_dir(tag: &str) -> PathBuf {
    static N: std::sync::atomic::AtomicU32 = std::sync::atomic::AtomicU32::new(0);
    let n = N.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    let d = std::env::temp_dir().join(format!("gw-test-{tag}-{}-{n}", std::process::id()));
    let _ = std::fs::remove_dir_all(&d);
    std::fs::create_dir_all(&d).unwrap();
    d
}

/// How to start a gateway.
pub struct Options {
    /// Layer ranges, entry stage first.
    pub stages: Vec<[u32; 2]>,
    /// Policy text; `None` = dev policy matching `stages`.
    pub policy: Option<String>,
    /// Model folder.
    pub model_dir: PathBuf,
    /// Extra `[server]` lines.
    pub server_extra: String,
    /// Extra `[pipeline]` lines (e.g. `replicas = 3`).
    pub pipeline_extra: String,
    /// Environment for the gateway (inherited by its stages).
    pub env: Vec<(String, String)>,
    /// Stage addresses for `launch = "remote"` (`None`: local launch).
    pub remote: Option<Vec<String>>,
    /// Extra top-level tables (e.g. `[auth]`), appended at the end.
    pub extra: String,
    /// `server.listen` (`None`: `127.0.0.1:0`).
    pub listen: Option<String>,
}

impl Default for Options {
    fn default() -> Self {
        Self {
            stages: vec![[0, 3], [3, 6]],
            policy: None,
            model_dir: model_dir(),
            server_extra: String::new(),
            pipeline_extra: String::new(),
            env: Vec::new(),
            remote: None,
            extra: String::new(),
            listen: None,
        }
    }
}

/// A dev policy (mock allowed, local build trusted) for these stages.
pub fn dev_policy(stages: &[[u32; 2]]) -> String {
    let mut p = String::from("allow_mock = true\ntrust_local_build = true\n");
    for (i, s) in stages.iter().enumerate() {
        p += &format!("[[stages]]\nindex = {i}\nlayers = [{}, {}]\n", s[0], s[1]);
    }
    p
}

/// For stages the test starts itself (the gateway cannot vouch for "the
/// local build"): writes the stages' own policy (mock allowed, peers must
/// be the same build) to `dir/stage-policy.toml` and returns its path and a
/// gateway policy that pins the stages' measurement, which covers the
/// binary, the embeddings manifest and that stage policy file.
pub fn remote_stage_policies(dir: &Path, stages: &[[u32; 2]]) -> (PathBuf, String) {
    let stage_policy = dir.join("stage-policy.toml");
    std::fs::write(&stage_policy, dev_policy(stages)).unwrap();
    let manifest = proto::manifest::LoadedManifest::load(&model_dir()).unwrap();
    let m = proto::attestation::mock_measurement(
        &proto::digest::Sha256Digest::of_file(&stage_binary()).unwrap(),
        &manifest.digest,
        &proto::digest::Sha256Digest::of_file(&stage_policy).unwrap(),
    )
    .pinned_form();
    let mut gateway = String::from("allow_mock = true\n");
    for (i, s) in stages.iter().enumerate() {
        gateway += &format!(
            "[[stages]]\nindex = {i}\nlayers = [{}, {}]\nmeasurements = [\"{m}\"]\n",
            s[0], s[1]
        );
    }
    (stage_policy, gateway)
}

/// A running gateway process.
pub struct Gateway {
    pub child: Child,
    pub url: String,
    pub dir: PathBuf,
}

/// Starting failed: the gateway exited. Its stderr is here.
pub struct StartFailure {
    pub code: Option<i32>,
    pub stderr: String,
}

/// Writes `dir/policy.toml` and `dir/gateway.toml` for `opts`; returns the config path.
pub fn write_config(opts: &Options, dir: &Path) -> PathBuf {
    let policy = opts
        .policy
        .clone()
        .unwrap_or_else(|| dev_policy(&opts.stages));
    std::fs::write(dir.join("policy.toml"), policy).unwrap();
    let stage_bin = PathBuf::from(env!("CARGO_BIN_EXE_gateway")).with_file_name("enclave-stage");
    assert!(
        stage_bin.exists(),
        "build enclave-stage first: {}",
        stage_bin.display()
    );
    let mut cfg = format!(
        "[server]\nlisten = {:?}\n{}\n[pipeline]\n{}\npolicy = {:?}\nmodel_dir = {:?}\nlaunch = \"{}\"\nstage_binary = {:?}\nconnect_timeout_secs = 60\n",
        opts.listen.as_deref().unwrap_or("127.0.0.1:0"),
        opts.server_extra,
        opts.pipeline_extra,
        dir.join("policy.toml"),
        opts.model_dir,
        if opts.remote.is_some() { "remote" } else { "local" },
        stage_bin
    );
    for (i, s) in opts.stages.iter().enumerate() {
        cfg += &format!("[[pipeline.stages]]\nlayers = [{}, {}]\n", s[0], s[1]);
        if let Some(addrs) = &opts.remote {
            cfg += &format!("address = {:?}\n", addrs[i]);
        }
    }
    cfg += &opts.extra;
    if !opts.extra.contains("[receipts]") {
        // Each test gateway its own receipt store (the default file is shared).
        cfg += &format!("\n[receipts]\npath = {:?}\n", dir.join("receipts.sqlite3"));
    }
    let path = dir.join("gateway.toml");
    std::fs::write(&path, cfg).unwrap();
    path
}

impl Gateway {
    /// Starts a gateway; `Err` with its stderr if it exits before listening.
    /// Starts a gateway that must refuse to start (and exit non-zero); its
    /// stderr. Panics with `why` if it started.
    pub fn refused(opts: Options, why: &str) -> String {
        let f = Self::try_start(opts).err().expect(why);
        assert_ne!(f.code, Some(0), "a refusal exits non-zero");
        f.stderr
    }

    /// [`Gateway::refused`] with the default options but the policy `policy`.
    pub fn refused_by_policy(policy: &str, why: &str) -> String {
        let opts = Options {
            policy: Some(policy.into()),
            ..Options::default()
        };
        Self::refused(opts, why)
    }

    /// [`Gateway::refused`] with the default options plus the config `extra`
    /// and the environment `env`.
    pub fn refused_with(extra: &str, env: &[(&str, &str)], why: &str) -> String {
        let env = env
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect();
        let opts = Options {
            extra: extra.into(),
            env,
            ..Options::default()
        };
        Self::refused(opts, why)
    }

    pub fn try_start(opts: Options) -> Result<Gateway, StartFailure> {
        let dir = temp_dir("gw");
        let cfg = write_config(&opts, &dir);
        let stderr_path = dir.join("stderr.log");
        let mut cmd = Command::new(env!("CARGO_BIN_EXE_gateway"));
        cmd.args(["serve", "--config"])
            .arg(&cfg)
            .env("RUST_LOG", "info")
            .env("NO_COLOR", "1")
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(std::fs::File::create(&stderr_path).unwrap());
        for (k, v) in &opts.env {
            cmd.env(k, v);
        }
        let mut child = cmd.spawn().expect("spawn gateway");
        let stdout = child.stdout.take().unwrap();
        let mut lines = BufReader::new(stdout).lines();
        let url = loop {
            match lines.next() {
                Some(Ok(l)) => {
                    if let Some(u) = l.strip_prefix("GATEWAY LISTENING ") {
                        break Some(u.to_string());
                    }
                }
                _ => break None,
            }
        };
        // The rest of stdout is kept in `dir/stdout.log` (tests search it).
        let mut stdout_log = std::fs::File::create(dir.join("stdout.log")).unwrap();
        std::thread::spawn(move || {
            use std::io::Write as _;
            for l in lines.map_while(Result::ok) {
                let _ = writeln!(stdout_log, "{l}");
            }
        });
        match url {
            Some(url) => Ok(Gateway { child, url, dir }),
            None => {
                let status = child.wait().unwrap();
                let mut stderr = String::new();
                std::fs::File::open(&stderr_path)
                    .unwrap()
                    .read_to_string(&mut stderr)
                    .unwrap();
                Err(StartFailure {
                    code: status.code(),
                    stderr,
                })
            }
        }
    }

    /// Starts a gateway or panics with its log.
    pub fn start(opts: Options) -> Gateway {
        match Self::try_start(opts) {
            Ok(g) => g,
            Err(f) => panic!("gateway failed to start ({:?}):\n{}", f.code, f.stderr),
        }
    }

    /// The gateway's log so far (its stderr, which its local stages share).
    pub fn log(&self) -> String {
        std::fs::read_to_string(self.dir.join("stderr.log")).unwrap_or_default()
    }

    /// What the gateway printed on stdout after its listening line.
    pub fn stdout(&self) -> String {
        std::fs::read_to_string(self.dir.join("stdout.log")).unwrap_or_default()
    }

    /// Pids of the stage processes (children of the gateway).
    pub fn stage_pids(&self) -> Vec<u32> {
        children_of(self.child.id())
    }

    /// Sends SIGINT (as Ctrl-C does) and waits for exit.
    pub fn interrupt(&mut self) -> Option<i32> {
        signal(self.child.id(), "INT");
        self.wait_exit("SIGINT")
    }

    /// Waits (up to 10 s) for the gateway to exit after `what`; its exit code.
    pub fn wait_exit(&mut self, what: &str) -> Option<i32> {
        for _ in 0..200 {
            if let Some(s) = self.child.try_wait().unwrap() {
                return s.code();
            }
            std::thread::sleep(Duration::from_millis(50));
        }
        panic!(
            "gateway did not stop within 10 s of {what}:\n{}",
            self.log()
        );
    }

    /// Starts a gateway whose stages have the test-only fault switch set
    /// (`opts.env`, see [`fault_env`]); panics if the stage binary was built
    /// without the `fault-injection` feature.
    pub fn start_faulty(opts: Options) -> Gateway {
        let gw = Gateway::start(opts);
        assert!(
            gw.log().contains("FAULT INJECTION ENABLED"),
            "the stage binary was built without the `fault-injection` feature: \
             build with `cargo build --release --workspace --features enclave-stage/fault-injection` \
             (scripts/test.sh does)"
        );
        gw
    }
}

impl Drop for Gateway {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// Environment for [`Gateway::start_faulty`]: the fault switch on `stage`
/// plus `extra` settings (`STAGE_FAULT_DELAY_MS`, `STAGE_FAULT_TOKENS`).
pub fn fault_env(stage: u32, extra: &[(&str, &str)]) -> Vec<(String, String)> {
    let mut v = vec![("STAGE_FAULT_STAGE".to_string(), stage.to_string())];
    v.extend(
        extra
            .iter()
            .map(|(k, val)| (k.to_string(), val.to_string())),
    );
    v
}

/// Options whose stage 1 takes `delay_ms` over every micro-batch (for
/// [`Gateway::start_faulty`]), with `server_extra` in `[server]`.
pub fn slow_stage(delay_ms: &str, server_extra: &str) -> Options {
    Options {
        env: fault_env(1, &[("STAGE_FAULT_DELAY_MS", delay_ms)]),
        server_extra: server_extra.into(),
        ..Options::default()
    }
}

/// Waits (up to 10 s) until every pid is gone; panics with `what` if not.
pub fn wait_gone(pids: &[u32], what: &str) {
    for _ in 0..200 {
        if pids.iter().all(|p| !alive(*p)) {
            return;
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    panic!("{what}");
}

/// `POST url` with `body` as JSON and one extra header (panics on a
/// transport error).
pub async fn post_with_header(
    url: &str,
    body: &serde_json::Value,
    (name, value): (&str, &str),
) -> reqwest::Response {
    client()
        .post(url)
        .header(name, value)
        .json(body)
        .send()
        .await
        .unwrap()
}

/// A response's `Retry-After` seconds (panics if absent or not a number).
pub fn retry_after(r: &reqwest::Response) -> u64 {
    r.headers()["retry-after"]
        .to_str()
        .unwrap()
        .parse()
        .unwrap()
}

/// `GET /metrics` as text.
pub async fn metrics_text(url: &str) -> String {
    let r = http_get(&format!("{url}/metrics")).await;
    assert_eq!(r.status(), 200);
    r.text().await.unwrap()
}

/// The value of the sample named exactly `name` (with its labels); 0 if absent.
pub fn sample(text: &str, name: &str) -> f64 {
    text.lines()
        .find_map(|l| l.strip_prefix(name)?.strip_prefix(' ')?.parse().ok())
        .unwrap_or(0.0)
}

/// Sends a signal by name with the `kill` utility.
pub fn signal(pid: u32, sig: &str) {
    let _ = Command::new("kill")
        .arg(format!("-{sig}"))
        .arg(pid.to_string())
        .status();
}

/// Whether a process exists (and is not a zombie).
pub fn alive(pid: u32) -> bool {
    match std::fs::read_to_string(format!("/proc/{pid}/stat")) {
        Ok(s) => !s
            .rsplit(')')
            .next()
            .unwrap_or("")
            .trim_start()
            .starts_with('Z'),
        Err(_) => false,
    }
}

/// Child pids of `pid`.
pub fn children_of(pid: u32) -> Vec<u32> {
    let mut out = Vec::new();
    for e in std::fs::read_dir("/proc").unwrap().flatten() {
        let Ok(p) = e.file_name().to_string_lossy().parse::<u32>() else {
            continue;
        };
        let Ok(stat) = std::fs::read_to_string(format!("/proc/{p}/stat")) else {
            continue;
        };
        let rest = stat.rsplit(')').next().unwrap_or("");
        let ppid: Option<u32> = rest.split_whitespace().nth(1).and_then(|v| v.parse().ok());
        if ppid == Some(pid) {
            out.push(p);
        }
    }
    out.sort();
    out
}

/// The stage binary next to the gateway binary.
pub fn stage_binary() -> PathBuf {
    PathBuf::from(env!("CARGO_BIN_EXE_gateway")).with_file_name("enclave-stage")
}

/// A stage process started by the test itself (for `launch = "remote"`).
pub struct StageProc {
    pub child: Child,
    pub endpoint: String,
}

impl StageProc {
    /// Starts stage `index` of `n` on `layers` with `policy`; waits for LISTENING.
    pub fn start(index: u32, n: u32, layers: [u32; 2], policy: &Path, dir: &Path) -> StageProc {
        Self::start_with(index, n, layers, policy, dir, "tcp://127.0.0.1:0", &[])
    }

    /// [`Self::start`] listening on `listen` (e.g. the endpoint of a stage
    /// it replaces), with `extra` stage arguments.
    pub fn start_with(
        index: u32,
        n: u32,
        layers: [u32; 2],
        policy: &Path,
        dir: &Path,
        listen: &str,
        extra: &[&str],
    ) -> StageProc {
        let mut child = Command::new(stage_binary())
            .arg("--model-dir")
            .arg(model_dir())
            .args([
                "--stage-index",
                &index.to_string(),
                "--num-stages",
                &n.to_string(),
            ])
            .args(["--layers", &format!("{}..{}", layers[0], layers[1])])
            .arg("--policy")
            .arg(policy)
            .args(["--listen", listen])
            .args(extra)
            .arg("--exit-with-stdin")
            .env("NO_COLOR", "1")
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(std::fs::File::create(dir.join(format!("stage{index}.log"))).unwrap())
            .spawn()
            .unwrap();
        let mut lines = BufReader::new(child.stdout.take().unwrap()).lines();
        let line = lines
            .next()
            .and_then(Result::ok)
            .unwrap_or_else(|| panic!("stage {index} did not start (see {})", dir.display()));
        let endpoint = line.strip_prefix("LISTENING ").unwrap().to_string();
        std::thread::spawn(move || for _ in lines {});
        StageProc { child, endpoint }
    }
}

impl Drop for StageProc {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// A TCP relay that forwards to `target` and records every byte both ways.
pub struct CaptureRelay {
    pub endpoint: String,
    pub captured: std::sync::Arc<std::sync::Mutex<Vec<u8>>>,
}

impl CaptureRelay {
    /// Starts a relay in front of `target` (`tcp://host:port`).
    pub fn start(target: &str) -> CaptureRelay {
        use std::io::{Read as _, Write as _};
        let target = target.strip_prefix("tcp://").unwrap().to_string();
        let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let endpoint = format!("tcp://{}", listener.local_addr().unwrap());
        let captured = std::sync::Arc::new(std::sync::Mutex::new(Vec::new()));
        let cap = captured.clone();
        std::thread::spawn(move || {
            for conn in listener.incoming().flatten() {
                let Ok(upstream) = std::net::TcpStream::connect(&target) else {
                    continue;
                };
                for (mut from, mut to) in [
                    (conn.try_clone().unwrap(), upstream.try_clone().unwrap()),
                    (upstream, conn),
                ] {
                    let cap = cap.clone();
                    std::thread::spawn(move || {
                        let mut buf = vec![0u8; 65536];
                        while let Ok(n) = from.read(&mut buf) {
                            if n == 0 || to.write_all(&buf[..n]).is_err() {
                                break;
                            }
                            cap.lock().unwrap().extend_from_slice(&buf[..n]);
                        }
                        let _ = to.shutdown(std::net::Shutdown::Both);
                    });
                }
            }
        });
        CaptureRelay { endpoint, captured }
    }

    /// Whether `needle` occurs anywhere in what passed.
    pub fn saw(&self, needle: &[u8]) -> bool {
        self.captured
            .lock()
            .unwrap()
            .windows(needle.len())
            .any(|w| w == needle)
    }

    /// Bytes captured so far.
    pub fn len(&self) -> usize {
        self.captured.lock().unwrap().len()
    }
}

/// A client's policy text: the measurements the gateway reports, pinned,
/// mock allowed (trust on first use: for tests against a local gateway).
pub async fn client_policy_text(url: &str) -> String {
    let ready: serde_json::Value = get_json(&format!("{url}/readyz")).await;
    let mut text = String::from("allow_mock = true\n");
    for s in ready["stages"].as_array().unwrap() {
        text += &format!(
            "[[stages]]\nindex = {}\nlayers = [{}, {}]\nmeasurements = [\"{}\"]\n",
            s["index"],
            s["layers"][0],
            s["layers"][1],
            s["measurement"].as_str().unwrap()
        );
    }
    text
}

/// POSTs a sealed body to `/v1/embeddings` with its sealing headers.
pub async fn post_sealed(
    url: &str,
    headers: &proto::sealing::SealedHeaders,
    body: Vec<u8>,
) -> reqwest::Response {
    let mut rb = client().post(format!("{url}/v1/embeddings")).body(body);
    for (k, v) in headers.to_header_values() {
        rb = rb.header(k, v);
    }
    rb.send().await.unwrap()
}

/// An HTTP client for tests.
pub fn client() -> reqwest::Client {
    reqwest::Client::builder()
        .timeout(Duration::from_secs(120))
        .build()
        .unwrap()
}

/// POSTs `/v1/embeddings` and returns (status, JSON body).
pub async fn embed(gw_url: &str, body: serde_json::Value) -> (u16, serde_json::Value) {
    let r = http_post(&format!("{gw_url}/v1/embeddings"), &body).await;
    let status = r.status().as_u16();
    (status, r.json().await.unwrap_or(serde_json::Value::Null))
}

/// Vectors from a float-encoded embeddings response.
pub fn vectors(body: &serde_json::Value) -> Vec<Vec<f32>> {
    body["data"]
        .as_array()
        .unwrap()
        .iter()
        .map(|d| {
            d["embedding"]
                .as_array()
                .unwrap()
                .iter()
                .map(|x| x.as_f64().unwrap() as f32)
                .collect()
        })
        .collect()
}

/// Largest absolute difference.
pub fn max_diff(a: &[f32], b: &[f32]) -> f32 {
    a.iter()
        .zip(b)
        .map(|(x, y)| (x - y).abs())
        .fold(0.0, f32::max)
}

/// Reference texts, token counts and sentence-transformers vectors.
pub fn reference() -> (Vec<String>, Vec<u64>, Vec<Vec<f32>>) {
    let r = load_reference(&root());
    (r.texts, r.tokens, r.vectors)
}

/// Asserts an OpenAI-shaped error body.
pub fn assert_error_shape(body: &serde_json::Value) {
    let e = &body["error"];
    assert!(e["message"].is_string(), "no error.message in {body}");
    assert!(e["type"].is_string(), "no error.type in {body}");
    assert!(
        e.get("param").is_some() && e.get("code").is_some(),
        "param/code missing in {body}"
    );
}

/// The `gateway` binary under test.
pub fn gateway_bin() -> &'static str {
    env!("CARGO_BIN_EXE_gateway")
}

/// A path as `&str` (test paths are UTF-8).
pub fn p(path: &Path) -> &str {
    path.to_str().unwrap()
}

/// Runs `gateway ARGS` to completion: (exit code, stdout, stderr).
pub fn cli(args: &[&str]) -> (i32, String, String) {
    let out = Command::new(gateway_bin())
        .args(args)
        .env("NO_COLOR", "1")
        .env("RUST_LOG", "warn")
        .stdin(Stdio::null())
        .output()
        .expect("run gateway");
    (
        out.status.code().unwrap_or(-1),
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

/// A running `gateway proxy`.
pub struct ProxyProc {
    pub child: Child,
    pub url: String,
}

impl Drop for ProxyProc {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// Starts `gateway proxy --upstream U --policy P… EXTRA…`; `Err((exit code,
/// stderr))` if it exits first.
pub fn start_proxy(
    upstream: &str,
    policies: &[&Path],
    extra: &[&str],
    dir: &Path,
) -> Result<ProxyProc, (i32, String)> {
    let stderr_path = dir.join(format!(
        "proxy-{}.log",
        policies[0].file_stem().unwrap().to_str().unwrap()
    ));
    let mut cmd = Command::new(gateway_bin());
    cmd.args(["proxy", "--upstream", upstream, "--listen", "127.0.0.1:0"]);
    for policy in policies {
        cmd.arg("--policy").arg(policy);
    }
    let mut child = cmd
        .args(extra)
        .env("NO_COLOR", "1")
        .env("RUST_LOG", "info")
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(std::fs::File::create(&stderr_path).unwrap())
        .spawn()
        .expect("spawn proxy");
    let mut lines = BufReader::new(child.stdout.take().unwrap()).lines();
    let url = lines.find_map(|l| {
        l.ok()
            .and_then(|l| l.strip_prefix("PROXY LISTENING ").map(str::to_string))
    });
    std::thread::spawn(move || for _ in lines {});
    match url {
        Some(url) => Ok(ProxyProc { child, url }),
        None => {
            let status = child.wait().unwrap();
            Err((
                status.code().unwrap_or(-1),
                std::fs::read_to_string(&stderr_path).unwrap_or_default(),
            ))
        }
    }
}

/// What a [`tampering_relay`] changes in the gateway's answers to POSTs.
#[derive(Clone, Copy)]
pub enum Tamper {
    /// Flips the last byte (the signature) of the `receipt` header.
    ReceiptHeader,
    /// Flips the last byte of the body (for a sealed answer: its trailer).
    LastBodyByte,
    /// Answers with this HTTP status instead of the upstream's.
    Status(u16),
}

/// An HTTP relay in front of a gateway that tampers with the answers to
/// POST requests; everything else passes. It runs on its own thread (test
/// threads block on child processes). Bodies are buffered whole.
pub fn tampering_relay(upstream: String, tamper: Tamper) -> String {
    use axum::body::{to_bytes, Body};
    use axum::http::{HeaderValue, Method, Request};
    use axum::response::Response;
    use base64::Engine as _;
    let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    listener.set_nonblocking(true).unwrap();
    let app = axum::Router::new().fallback(move |req: Request<Body>| {
        let upstream = upstream.clone();
        async move {
            let (parts, body) = req.into_parts();
            let post = parts.method == Method::POST;
            let body = to_bytes(body, 64 << 20).await.unwrap();
            let url = format!("{upstream}{}", parts.uri);
            let mut rb = client().request(parts.method, url).body(body);
            for (k, v) in &parts.headers {
                if k != "host" && k != "content-length" {
                    rb = rb.header(k, v);
                }
            }
            let r = rb.send().await.unwrap();
            let status = match tamper {
                Tamper::Status(s) if post => s,
                _ => r.status().as_u16(),
            };
            let mut out = Response::builder().status(status);
            for (k, v) in r.headers() {
                if post && k == "receipt" && matches!(tamper, Tamper::ReceiptHeader) {
                    let mut rc = base64::engine::general_purpose::URL_SAFE_NO_PAD
                        .decode(v.to_str().unwrap())
                        .unwrap();
                    *rc.last_mut().unwrap() ^= 1;
                    let b64 = base64::engine::general_purpose::URL_SAFE_NO_PAD.encode(rc);
                    out = out.header(k, HeaderValue::from_str(&b64).unwrap());
                } else if k != "content-length" && k != "transfer-encoding" {
                    out = out.header(k, v);
                }
            }
            let mut bytes = r.bytes().await.unwrap().to_vec();
            if post && matches!(tamper, Tamper::LastBodyByte) {
                if let Some(b) = bytes.last_mut() {
                    *b ^= 1;
                }
            }
            out.body(Body::from(bytes)).unwrap()
        }
    });
    serve_on_thread(listener, app)
}

/// Serves `app` on `listener` (non-blocking, already bound) from a thread of
/// its own (test threads block on child processes); returns its URL.
pub fn serve_on_thread(listener: std::net::TcpListener, app: axum::Router) -> String {
    let addr = listener.local_addr().unwrap();
    std::thread::spawn(move || {
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .unwrap();
        rt.block_on(async move {
            let listener = tokio::net::TcpListener::from_std(listener).unwrap();
            axum::serve(listener, app).await.unwrap()
        })
    });
    format!("http://{addr}")
}

/// `GET url`, the body (panics on a transport error).
pub async fn get_bytes(url: &str) -> axum::body::Bytes {
    http_get(url).await.bytes().await.unwrap()
}

/// Whether `python3` can import the stock `openai` SDK (`NO_PYTHON_SDK=1`
/// forces the reqwest fallbacks).
pub fn python_openai_available() -> bool {
    if std::env::var_os("NO_PYTHON_SDK").is_some() {
        return false;
    }
    Command::new("python3")
        .args(["-c", "import openai"])
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .status()
        .is_ok_and(|s| s.success())
}

/// Writes a policy to `path` that pins the measurements `model`'s stages
/// report in `/readyz` (mock allowed), as a client would after checking them
/// out of band; returns `path`.
pub async fn pinned_policy(url: &str, model: &str, path: &Path) -> PathBuf {
    let ready: serde_json::Value = get_json(&format!("{url}/readyz")).await;
    let pipeline = ready["pipelines"]
        .as_array()
        .unwrap()
        .iter()
        .find(|p| p["model"] == model)
        .unwrap_or_else(|| panic!("{model} in /readyz: {ready}"));
    let mut text = String::from("allow_mock = true\n");
    for st in pipeline["stages"].as_array().unwrap() {
        text += &format!(
            "[[stages]]\nindex = {}\nlayers = {}\nmeasurements = [{}]\n",
            st["index"], st["layers"], st["measurement"]
        );
    }
    std::fs::write(path, text).unwrap();
    path.to_path_buf()
}

/// The `data:` payloads of a Server-Sent-Events body, in order.
pub fn sse_events(body: &[u8]) -> Vec<String> {
    String::from_utf8(body.to_vec())
        .unwrap()
        .split("\n\n")
        .filter(|e| !e.is_empty())
        .map(|e| e.strip_prefix("data: ").expect("data event").to_string())
        .collect()
}

/// Options for a gateway with a 1-stage embeddings pipeline (fewer
/// processes) and a SmolLM2 completions pipeline running `stages`, under a
/// policy that trusts the local build; `extra` lines go into `[completions]`.
pub fn completions_options(stages: &[[u32; 2]], extra: &str) -> Options {
    let dir = temp_dir("cpl-policy");
    let mut policy = String::from("allow_mock = true\ntrust_local_build = true\n");
    for (i, s) in stages.iter().enumerate() {
        policy += &format!("[[stages]]\nindex = {i}\nlayers = [{}, {}]\n", s[0], s[1]);
    }
    let path = dir.join("policy-completions.toml");
    std::fs::write(&path, policy).unwrap();
    let mut table = format!(
        "[completions]\npolicy = {:?}\nmodel_dir = {:?}\n{extra}\n",
        path,
        root().join("models/smollm2-135m-instruct")
    );
    for s in stages {
        table += &format!("[[completions.stages]]\nlayers = [{}, {}]\n", s[0], s[1]);
    }
    Options {
        stages: vec![[0, 6]],
        extra: table,
        ..Options::default()
    }
}

/// `GET /v1/attestation?nonce=…` as CBOR: status, `Retry-After`, body.
pub async fn attestation_cbor(url: &str, nonce: &[u8]) -> (u16, Option<String>, Vec<u8>) {
    attestation_cbor_query(url, &format!("nonce={}", hex::encode(nonce))).await
}

/// `GET /v1/attestation?QUERY` as CBOR: status, `Retry-After`, body.
pub async fn attestation_cbor_query(url: &str, query: &str) -> (u16, Option<String>, Vec<u8>) {
    let r = client()
        .get(format!("{url}/v1/attestation?{query}"))
        .header("accept", "application/cbor")
        .send()
        .await
        .unwrap();
    let retry = r
        .headers()
        .get("retry-after")
        .map(|v| v.to_str().unwrap().to_string());
    (
        r.status().as_u16(),
        retry,
        r.bytes().await.unwrap().to_vec(),
    )
}

/// The evidence bundle for `nonce` (panics unless 200).
pub async fn evidence_bundle(url: &str, nonce: &[u8]) -> proto::bundle::EvidenceBundle {
    let (status, _, body) = attestation_cbor(url, nonce).await;
    assert_eq!(status, 200, "{}", String::from_utf8_lossy(&body));
    proto::cbor::from_slice(&body).unwrap()
}

/// Asserts that the gateway at `url` answers a short chat request with 200.
pub async fn assert_chat_serves(url: &str) {
    let (status, b, _) = post_json(
        url,
        "/v1/chat/completions",
        &serde_json::json!({"model": "SmolLM2-135M-Instruct", "max_tokens": 4,
                "messages": [{"role": "user", "content": "Hi"}]}),
    )
    .await;
    assert_eq!(status, 200, "{b}");
}

/// POSTs `body` as JSON to `url` + `path`: status, JSON body (null if none)
/// and headers.
pub async fn post_json(
    url: &str,
    path: &str,
    body: &serde_json::Value,
) -> (u16, serde_json::Value, reqwest::header::HeaderMap) {
    let r = http_post(&format!("{url}{path}"), body).await;
    let status = r.status().as_u16();
    let headers = r.headers().clone();
    (
        status,
        r.json().await.unwrap_or(serde_json::Value::Null),
        headers,
    )
}

/// GETs `url` and parses the JSON body (panics on any failure).
pub async fn get_json(url: &str) -> serde_json::Value {
    http_get(url).await.json().await.unwrap()
}

/// `GET url` with the test client (panics on a transport error).
pub async fn http_get(url: &str) -> reqwest::Response {
    client().get(url).send().await.unwrap()
}

/// `POST url` with `body` as JSON (panics on a transport error).
pub async fn http_post(url: &str, body: &serde_json::Value) -> reqwest::Response {
    client().post(url).json(body).send().await.unwrap()
}

/// `POST url` with `body`, exact bytes, as JSON, and a `receipt-nonce`
/// header if given (panics on a transport error).
pub async fn post_exact(
    url: &str,
    body: Vec<u8>,
    receipt_nonce: Option<&str>,
) -> reqwest::Response {
    let mut rb = client()
        .post(url)
        .header("content-type", "application/json")
        .body(body);
    if let Some(n) = receipt_nonce {
        rb = rb.header("receipt-nonce", n);
    }
    rb.send().await.unwrap()
}

/// `gateway seal ARGS --in REQ --out BODY --headers HEADERS --key-out KEY`,
/// with the files given in that order.
pub fn seal_cli(args: &[&str], [req, body, headers, key]: [&Path; 4]) -> (i32, String, String) {
    let files = [
        "--in",
        p(req),
        "--out",
        p(body),
        "--headers",
        p(headers),
        "--key-out",
        p(key),
    ];
    cli(&[&["seal"], args, &files[..]].concat())
}

/// Asserts that `r` is an OpenAI-shaped error with `status` whose message
/// mentions `needle`; returns its body.
pub async fn expect_api_error(
    r: reqwest::Response,
    status: u16,
    needle: &str,
) -> serde_json::Value {
    assert_eq!(r.status(), status);
    let e: serde_json::Value = r.json().await.unwrap();
    assert_error_shape(&e);
    let message = e["error"]["message"].as_str().unwrap();
    assert!(message.contains(needle), "{e}");
    e
}

/// Runs `python3 -c script args…` (no proxy for loopback, no
/// `OPENAI_BASE_URL` from the environment), asserts it succeeded and parses
/// its stdout as JSON.
pub fn run_python_json(script: &str, args: &[&str]) -> serde_json::Value {
    let out = std::process::Command::new("python3")
        .arg("-c")
        .arg(script)
        .args(args)
        .env("NO_PROXY", "127.0.0.1,localhost")
        .env_remove("OPENAI_BASE_URL")
        .output()
        .expect("python3");
    assert!(
        out.status.success(),
        "python3 script failed:\n{}\n{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    serde_json::from_slice(&out.stdout).unwrap()
}
