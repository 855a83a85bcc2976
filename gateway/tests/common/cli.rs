//! The `gateway` binary's client verbs and `gateway proxy`, run as a user would, and Python scripts.

use std::io::{BufRead, BufReader};
use std::path::Path;
use std::process::{Child, Command, Stdio};

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

/// `gateway policy pin --gateway URL --model MODEL --out OUT EXTRA…`:
/// (exit code, stdout, stderr).
pub fn policy_pin(url: &str, model: &str, out: &Path, extra: &[&str]) -> (i32, String, String) {
    let head = [
        "policy",
        "pin",
        "--gateway",
        url,
        "--model",
        model,
        "--out",
        p(out),
    ];
    cli(&[&head[..], extra].concat())
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
