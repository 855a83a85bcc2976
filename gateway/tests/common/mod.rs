//! Test harness: starts the real `gateway` binary (which starts real
//! `enclave-stage` processes) on a temporary config and talks HTTP to it.
#![allow(dead_code)]

mod cli;
pub mod hostile;
mod http;
mod relays;
#[allow(unused_imports)]
pub use cli::{
    cli, gateway_bin, p, policy_pin, python_openai_available, run_python_json, seal_cli,
    start_proxy, ProxyProc,
};
#[allow(unused_imports)]
pub use http::{
    assert_chat_serves, assert_error_shape, attestation_cbor, attestation_cbor_query, client,
    client_policy_text, embed, evidence_bundle, expect_api_error, get_bytes, get_json, http_get,
    http_post, manifest_pinned_policy, metrics_text, model_ids, pinned_policy, post_exact,
    post_json, post_sealed, post_with_header, retry_after, sample, sse_events,
};
#[allow(unused_imports)]
pub use relays::{serve_on_thread, tampering_relay, CaptureRelay, Tamper};

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
    /// Extra `gateway serve` arguments (after `--config`).
    pub serve_args: Vec<String>,
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
            serve_args: Vec::new(),
        }
    }
}

/// Options that serve a user's own model: `gateway serve FLAG PATH
/// STAGES_FLAG N --model-cache CACHE` (`--model` / `--stages`,
/// `--embedding-model` / `--embedding-stages`).
pub fn own_model_options(
    (flag, path): (&str, &Path),
    (stages_flag, n): (&str, usize),
    cache: &Path,
) -> Options {
    Options {
        serve_args: vec![
            flag.into(),
            path.display().to_string(),
            stages_flag.into(),
            n.to_string(),
            "--model-cache".into(),
            cache.display().to_string(),
        ],
        ..Options::default()
    }
}

/// The one model folder `serve --model` / `--embedding-model` wrote under
/// `cache`: its `manifest.json`'s bytes and parsed value.
pub fn written_manifest(cache: &Path) -> (Vec<u8>, serde_json::Value) {
    let folders: Vec<PathBuf> = std::fs::read_dir(cache)
        .unwrap()
        .map(|e| e.unwrap().path())
        .collect();
    assert_eq!(folders.len(), 1, "{folders:?}");
    let bytes = std::fs::read(folders[0].join("manifest.json")).unwrap();
    let value = serde_json::from_slice(&bytes).unwrap();
    (bytes, value)
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
    remote_stage_policies_for(&model_dir(), dir, stages)
}

/// [`remote_stage_policies`] for the model in `model` (e.g. [`smollm_dir`]).
pub fn remote_stage_policies_for(
    model: &Path,
    dir: &Path,
    stages: &[[u32; 2]],
) -> (PathBuf, String) {
    let stage_policy = dir.join("stage-policy.toml");
    std::fs::write(&stage_policy, dev_policy(stages)).unwrap();
    let manifest = proto::manifest::LoadedManifest::load(model).unwrap();
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
            .args(&opts.serve_args)
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

/// Which stage of which model a test starts ([`StageProc::spawn`]).
#[derive(Clone, Copy)]
pub struct StageSpec<'a> {
    /// Model folder (e.g. [`model_dir`], [`smollm_dir`]).
    pub model: &'a Path,
    /// Stage index (0 = entry stage).
    pub index: u32,
    /// Stages in the pipeline.
    pub n: u32,
    /// Layer range.
    pub layers: [u32; 2],
    /// Log file name in the test folder, without `.log`.
    pub log: &'a str,
    /// Extra environment (the test build's fault switches).
    pub env: &'a [(&'a str, &'a str)],
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
        let log = format!("stage{index}");
        let spec = StageSpec {
            model: &model_dir(),
            index,
            n,
            layers,
            log: &log,
            env: &[],
        };
        Self::spawn(&spec, policy, dir, listen, extra)
    }

    /// Starts the stage `spec` describes (any model), logging to
    /// `dir/{spec.log}.log`; waits for LISTENING.
    pub fn spawn(
        spec: &StageSpec<'_>,
        policy: &Path,
        dir: &Path,
        listen: &str,
        extra: &[&str],
    ) -> StageProc {
        let StageSpec {
            model,
            index,
            n,
            layers,
            log,
            env,
        } = *spec;
        let mut child = Command::new(stage_binary())
            .arg("--model-dir")
            .arg(model)
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
            .envs(env.iter().copied())
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(std::fs::File::create(dir.join(format!("{log}.log"))).unwrap())
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
