//! TLS end to end: the real gateway with `[server.tls]` and a test CA made
//! here (rcgen), called by a rustls client that trusts only that CA over
//! HTTP/1.1 and HTTP/2 (ALPN); certificate reload on SIGHUP without
//! dropping connections; plain HTTP off loopback refused; `check-config`.

mod common;

use common::{
    client, p, root, seal_cli, signal, temp_dir, vectors, write_config, Gateway, Options,
};
use rcgen::{
    BasicConstraints, CertificateParams, DnType, ExtendedKeyUsagePurpose, IsCa, KeyPair,
    KeyUsagePurpose, SerialNumber,
};
use serde_json::json;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::{Duration, Instant};

const MODEL: &str = "all-MiniLM-L6-v2";

/// A test certificate authority.
struct Ca {
    cert: rcgen::Certificate,
    key: KeyPair,
}

impl Ca {
    fn new() -> Ca {
        let mut p = CertificateParams::new(Vec::<String>::new()).unwrap();
        p.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
        p.distinguished_name
            .push(DnType::CommonName, "gateway test CA");
        p.key_usages = vec![
            KeyUsagePurpose::KeyCertSign,
            KeyUsagePurpose::CrlSign,
            KeyUsagePurpose::DigitalSignature,
        ];
        let key = KeyPair::generate().unwrap();
        let cert = p.self_signed(&key).unwrap();
        Ca { cert, key }
    }

    /// A server certificate for 127.0.0.1 and localhost: (cert PEM, key PEM, cert DER).
    fn issue(&self, serial: u64) -> (String, String, Vec<u8>) {
        let mut p =
            CertificateParams::new(vec!["localhost".to_string(), "127.0.0.1".to_string()]).unwrap();
        p.serial_number = Some(SerialNumber::from(serial));
        p.distinguished_name
            .push(DnType::CommonName, format!("gateway test server {serial}"));
        p.extended_key_usages = vec![ExtendedKeyUsagePurpose::ServerAuth];
        let key = KeyPair::generate().unwrap();
        let cert = p.signed_by(&key, &self.cert, &self.key).unwrap();
        (cert.pem(), key.serialize_pem(), cert.der().to_vec())
    }
}

/// Writes `cert.pem` and `key.pem` into `dir`; returns the `[server.tls]` lines.
fn write_pair(dir: &Path, cert: &str, key: &str) -> String {
    std::fs::write(dir.join("key.pem"), key).unwrap();
    std::fs::write(dir.join("cert.pem"), cert).unwrap();
    format!(
        "[server.tls]\ncert = {:?}\nkey = {:?}\n",
        dir.join("cert.pem"),
        dir.join("key.pem")
    )
}

/// A client that trusts only `ca_pem` (none: no roots at all).
fn tls_client(ca_pem: Option<&str>, http1_only: bool) -> reqwest::Client {
    let mut b = reqwest::Client::builder()
        .use_rustls_tls()
        .tls_built_in_root_certs(false)
        .tls_info(true)
        .timeout(Duration::from_secs(120));
    if let Some(pem) = ca_pem {
        b = b.add_root_certificate(reqwest::Certificate::from_pem(pem.as_bytes()).unwrap());
    }
    if http1_only {
        b = b.http1_only();
    }
    b.build().unwrap()
}

/// POSTs an embeddings request; returns the HTTP version and the server
/// certificate (DER) of the connection it went over.
async fn embed_tls(client: &reqwest::Client, url: &str) -> (reqwest::Version, Vec<u8>) {
    let r = client
        .post(format!("{url}/v1/embeddings"))
        .json(&json!({"model": MODEL, "input": ["hello over tls", "bonjour"]}))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 200);
    let version = r.version();
    let peer = r
        .extensions()
        .get::<reqwest::tls::TlsInfo>()
        .and_then(|i| i.peer_certificate())
        .expect("TLS info with the peer certificate")
        .to_vec();
    let body: serde_json::Value = r.json().await.unwrap();
    let v = vectors(&body);
    assert_eq!(v.len(), 2);
    assert_eq!(v[0].len(), 384);
    (version, peer)
}

/// Waits until the gateway log contains `needle` `count` times.
fn wait_log(gw: &Gateway, needle: &str, count: usize) -> String {
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let log = gw.log();
        if log.matches(needle).count() >= count {
            return log;
        }
        assert!(
            Instant::now() < deadline,
            "no {needle:?} (x{count}) in the log:\n{log}"
        );
        std::thread::sleep(Duration::from_millis(50));
    }
}

// Multi-threaded: the clients' connections must still be driven (HTTP/2
// answers the server's GOAWAY ping) while this thread waits in `interrupt`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tls_h1_h2_unknown_ca_refused_and_sighup_reload_keeps_connections() {
    let ca = Ca::new();
    let ca_pem = ca.cert.pem();
    let certs = temp_dir("tls-certs");
    let (cert_a, key_a, der_a) = ca.issue(1);
    let tls = write_pair(&certs, &cert_a, &key_a);
    let mut gw = Gateway::start(Options {
        server_extra: tls,
        ..Options::default()
    });
    assert!(gw.url.starts_with("https://127.0.0.1:"), "{}", gw.url);
    let url = gw.url.clone();

    // HTTP/1.1 and HTTP/2 (chosen by ALPN), both verifying the certificate.
    let h1 = tls_client(Some(&ca_pem), true);
    let (v, peer) = embed_tls(&h1, &url).await;
    assert_eq!(v, reqwest::Version::HTTP_11);
    assert_eq!(peer, der_a);
    let h2 = tls_client(Some(&ca_pem), false);
    let (v, peer) = embed_tls(&h2, &url).await;
    assert_eq!(v, reqwest::Version::HTTP_2);
    assert_eq!(peer, der_a);
    // The name works too.
    let by_name = url.replace("127.0.0.1", "localhost");
    let r = h2.get(format!("{by_name}/healthz")).send().await.unwrap();
    assert_eq!(r.status(), 200);

    // A client that does not trust the CA fails the handshake; plain HTTP
    // to the TLS port gets no HTTP answer.
    let untrusting = tls_client(None, false);
    let e = untrusting
        .get(format!("{url}/healthz"))
        .send()
        .await
        .expect_err("must not verify");
    assert!(e.is_connect(), "{e:?}");
    let plain = client()
        .get(format!("{}/healthz", url.replace("https://", "http://")))
        .send()
        .await;
    assert!(
        plain.is_err() || plain.as_ref().unwrap().status() != 200,
        "{plain:?}"
    );

    // A bad new certificate is refused, naming the file, and the old one stays.
    std::fs::write(certs.join("cert.pem"), "not a certificate\n").unwrap();
    signal(gw.child.id(), "HUP");
    let log = wait_log(&gw, "reload failed", 1);
    assert!(
        log.contains(&certs.join("cert.pem").display().to_string()),
        "{log}"
    );
    let (_, peer) = embed_tls(&tls_client(Some(&ca_pem), false), &url).await;
    assert_eq!(peer, der_a);

    // A new certificate (new serial and key): new connections see it, the
    // established HTTP/1.1 keep-alive and HTTP/2 connections keep working.
    let (cert_b, key_b, der_b) = ca.issue(2);
    assert_ne!(der_a, der_b);
    write_pair(&certs, &cert_b, &key_b);
    signal(gw.child.id(), "HUP");
    wait_log(&gw, "TLS certificate reloaded", 1);
    let (v, peer) = embed_tls(&tls_client(Some(&ca_pem), false), &url).await;
    assert_eq!(v, reqwest::Version::HTTP_2);
    assert_eq!(peer, der_b, "a new connection must see the new certificate");
    let (v, peer) = embed_tls(&tls_client(Some(&ca_pem), true), &url).await;
    assert_eq!(v, reqwest::Version::HTTP_11);
    assert_eq!(peer, der_b);
    let (v, peer) = embed_tls(&h2, &url).await;
    assert_eq!(v, reqwest::Version::HTTP_2);
    assert_eq!(peer, der_a, "the HTTP/2 connection must be the old one");
    let (v, peer) = embed_tls(&h1, &url).await;
    assert_eq!(v, reqwest::Version::HTTP_11);
    assert_eq!(peer, der_a, "the keep-alive connection must be the old one");

    // Graceful shutdown still works with TLS connections open.
    assert_eq!(gw.interrupt(), Some(0), "{}", gw.log());
}

fn gateway_cmd() -> Command {
    let mut c = Command::new(env!("CARGO_BIN_EXE_gateway"));
    c.env("NO_COLOR", "1").env_remove("GATEWAY_API_KEYS");
    c
}

/// Runs `gateway check-config --config <path>`: (exit code, stdout, stderr).
fn check_config(path: &Path) -> (Option<i32>, String, String) {
    let out = gateway_cmd()
        .arg("check-config")
        .arg("--config")
        .arg(path)
        .output()
        .unwrap();
    (
        out.status.code(),
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

fn config_with(opts: Options) -> PathBuf {
    let dir = temp_dir("check");
    write_config(&opts, &dir)
}

#[test]
fn plain_http_off_loopback_is_refused_naming_the_key() {
    let f = Gateway::try_start(Options {
        listen: Some("0.0.0.0:0".into()),
        ..Options::default()
    })
    .err()
    .expect("must refuse");
    let stderr = f.stderr;
    assert_eq!(f.code, Some(1), "{stderr}");
    assert!(stderr.contains("server.allow_plain_http"), "{stderr}");

    // `--listen` is checked the same way.
    let cfg = config_with(Options::default());
    let out = gateway_cmd()
        .args(["serve", "--listen", "[::]:0", "--config"])
        .arg(&cfg)
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(1));
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("server.allow_plain_http"), "{err}");

    // With the key set, the config is accepted.
    let cfg = config_with(Options {
        listen: Some("0.0.0.0:0".into()),
        server_extra: "allow_plain_http = true\n".into(),
        ..Options::default()
    });
    let (code, out, err) = check_config(&cfg);
    assert_eq!(code, Some(0), "{out}{err}");
    assert!(out.contains("http://0.0.0.0:0"), "{out}");
}

#[test]
fn check_config_ok_and_failing_cases() {
    // The shipped config (run from the repository root, as documented).
    let out = gateway_cmd()
        .current_dir(root())
        .arg("check-config")
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert_eq!(
        out.status.code(),
        Some(0),
        "{stdout}{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(stdout.starts_with("OK config/gateway.toml: http://127.0.0.1:8080, model all-MiniLM-L6-v2, 2 stages (local)"), "{stdout}");

    // TLS on a public address.
    let ca = Ca::new();
    let certs = temp_dir("check-certs");
    let (cert, key, _) = ca.issue(7);
    let tls = write_pair(&certs, &cert, &key);
    let good = Options {
        listen: Some("0.0.0.0:8443".into()),
        server_extra: tls.clone(),
        ..Options::default()
    };
    let (code, out, err) = check_config(&config_with(good));
    assert_eq!(code, Some(0), "{out}{err}");
    assert!(out.starts_with("OK "), "{out}");
    // Then the effective configuration, defaults filled in.
    assert!(out.contains("\n[server]\n"), "{out}");
    assert!(out.contains("receipt_retention = 10000"), "{out}");
    assert!(out.contains("https://0.0.0.0:8443"), "{out}");
    assert!(out.contains(MODEL), "{out}");

    let fails = |opts: Options, key: &str| {
        let (code, out, err) = check_config(&config_with(opts));
        assert_eq!(code, Some(1), "{key}: {out}{err}");
        assert!(err.contains(key), "expected {key:?} in: {err}");
        assert!(!out.contains("OK"), "{out}");
    };
    // Missing certificate file.
    fails(
        Options {
            server_extra: format!(
                "[server.tls]\ncert = {:?}\nkey = {:?}\n",
                certs.join("missing.pem"),
                certs.join("key.pem")
            ),
            ..Options::default()
        },
        "server.tls.cert",
    );
    // A key that does not belong to the certificate.
    let (_, other_key, _) = ca.issue(8);
    std::fs::write(certs.join("other-key.pem"), other_key).unwrap();
    fails(
        Options {
            server_extra: format!(
                "[server.tls]\ncert = {:?}\nkey = {:?}\n",
                certs.join("cert.pem"),
                certs.join("other-key.pem")
            ),
            ..Options::default()
        },
        "server.tls.key",
    );
    // Unknown key in [server.tls].
    fails(
        Options {
            server_extra: format!("{tls}chain = \"x.pem\"\n"),
            ..Options::default()
        },
        "chain",
    );
    // Plain HTTP off loopback.
    fails(
        Options {
            listen: Some("0.0.0.0:8080".into()),
            ..Options::default()
        },
        "server.allow_plain_http",
    );
    // Policy file that does not parse.
    fails(
        Options {
            policy: Some("allow_mock = maybe\n".into()),
            ..Options::default()
        },
        "pipeline.policy",
    );
    // Model folder without a manifest.
    fails(
        Options {
            model_dir: certs.clone(),
            ..Options::default()
        },
        "pipeline.model_dir",
    );
    // A bad value elsewhere is named too.
    fails(
        Options {
            server_extra: "max_inputs = 0\n".into(),
            ..Options::default()
        },
        "server.max_inputs",
    );

    // Environment overrides: applied, shown, and named when they are wrong.
    let cfg = config_with(Options::default());
    let out = gateway_cmd()
        .args(["check-config", "--config"])
        .arg(&cfg)
        .env("GATEWAY_SERVER__LISTEN", "127.0.0.1:9")
        .env("GATEWAY_SERVER__MAX_INPUTS", "7")
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert_eq!(out.status.code(), Some(0), "{stdout}");
    assert!(
        stdout.starts_with("OK ") && stdout.contains("http://127.0.0.1:9,"),
        "{stdout}"
    );
    assert!(
        stdout.contains("# server.listen is set by GATEWAY_SERVER__LISTEN"),
        "{stdout}"
    );
    assert!(stdout.contains("max_inputs = 7"), "{stdout}");
    for (var, value) in [
        ("GATEWAY_SERVER__MAX_INPUTS", "0"),
        ("GATEWAY_SERVER__NO_SUCH_KEY", "1"),
        ("GATEWAY_PIPELINE__THREADS_PER_STAGE", "two"),
    ] {
        let out = gateway_cmd()
            .args(["check-config", "--config"])
            .arg(&cfg)
            .env(var, value)
            .output()
            .unwrap();
        let err = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(1), "{var}: {err}");
        assert!(err.contains(var), "{var} not named in: {err}");
    }
}

/// Issue 18, finding 6: the client verbs reach a TLS gateway (trusting a
/// private CA given with --cacert), refuse one whose certificate they cannot
/// verify, and refuse plain HTTP off loopback unless told otherwise.
#[tokio::test]
async fn client_verbs_speak_tls_and_refuse_plain_http_off_loopback() {
    let ca = Ca::new();
    let certs = temp_dir("tls-client");
    let (cert, key, _) = ca.issue(7);
    let tls = write_pair(&certs, &cert, &key);
    let gw = Gateway::start(Options {
        server_extra: tls,
        ..Options::default()
    });
    let ca_path = certs.join("ca.pem");
    std::fs::write(&ca_path, ca.cert.pem()).unwrap();
    let policy = certs.join("policy.toml");
    let ready: serde_json::Value = tls_client(Some(&ca.cert.pem()), false)
        .get(format!("{}/readyz", gw.url))
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    let mut text = String::from("allow_mock = true\n");
    for st in ready["stages"].as_array().unwrap() {
        text += &format!(
            "[[stages]]\nindex = {}\nlayers = {}\nmeasurements = [{}]\n",
            st["index"], st["layers"], st["measurement"]
        );
    }
    std::fs::write(&policy, text).unwrap();
    let req = certs.join("req.json");
    std::fs::write(&req, br#"{"model":"all-MiniLM-L6-v2","input":"over TLS"}"#).unwrap();
    let (body, headers, key) = (
        certs.join("body.bin"),
        certs.join("headers.txt"),
        certs.join("key.json"),
    );
    let seal = |gateway: &str, extra: &[&str]| {
        let args = [&["--gateway", gateway, "--policy", p(&policy)], extra].concat();
        seal_cli(&args, [&req, &body, &headers, &key])
    };
    // With the CA: evidence fetched and verified over TLS, request sealed.
    let (code, out, err) = seal(&gw.url, &["--cacert", p(&ca_path)]);
    assert_eq!(code, 0, "{out}\n{err}");
    // Without it, the certificate does not verify: nothing is fetched.
    let (code, _, err) = seal(&gw.url, &[]);
    assert_ne!(code, 0);
    assert!(
        err.to_lowercase().contains("certificate") || err.contains("error sending request"),
        "{err}"
    );
    // Plain HTTP to a host that is not loopback is refused, naming the flag.
    let (code, _, err) = seal("http://192.0.2.1:8080", &[]);
    assert_eq!(code, 2, "{err}");
    assert!(err.contains("--insecure-plain-http"), "{err}");
}
