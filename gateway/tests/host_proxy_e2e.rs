//! `gateway host-proxy` end to end over TCP routes (the same relay code
//! serves vsock routes on a Nitro parent): a real two-stage embeddings
//! pipeline whose every stage channel passes through the proxy, as on
//! Nitro. The gateway dials the stages through one route each, and stage 0
//! dials stage 1 through a third (`peer_address`). Stage 1 is killed (clean
//! 503s), restarted on the same address, and service resumes through the
//! same proxy with neither the proxy nor the gateway restarted.

mod common;

use common::{
    alive, assert_error_shape, cosine, embed, http_get, reference, remote_stage_policies, temp_dir,
    vectors, Gateway, Options, StageProc,
};
use serde_json::json;
use std::io::{BufRead, BufReader};
use std::process::{Child, Command, Stdio};
use std::time::Duration;

const MODEL: &str = "all-MiniLM-L6-v2";

/// A running `gateway host-proxy`.
struct HostProxy {
    child: Child,
    /// The bound listen endpoints, in route order.
    listening: Vec<String>,
}

impl HostProxy {
    fn start(routes: &[(&str, &str)], dir: &std::path::Path) -> HostProxy {
        let mut cmd = Command::new(env!("CARGO_BIN_EXE_gateway"));
        cmd.arg("host-proxy");
        for (l, t) in routes {
            cmd.args(["--route", &format!("{l}={t}")]);
        }
        let mut child = cmd
            .env("RUST_LOG", "debug")
            .env("NO_COLOR", "1")
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(std::fs::File::create(dir.join("host-proxy.log")).unwrap())
            .spawn()
            .unwrap();
        let mut lines = BufReader::new(child.stdout.take().unwrap()).lines();
        let mut listening = Vec::new();
        for l in lines.by_ref() {
            let l = l.unwrap();
            if l == "HOST-PROXY READY" {
                break;
            }
            let route = l.strip_prefix("HOST-PROXY ROUTE ").unwrap();
            listening.push(route.split_once('=').unwrap().0.to_string());
        }
        std::thread::spawn(move || for _ in lines {});
        assert_eq!(listening.len(), routes.len());
        HostProxy { child, listening }
    }
}

impl Drop for HostProxy {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

async fn ready_status(url: &str) -> u16 {
    http_get(&format!("{url}/readyz")).await.status().as_u16()
}

#[tokio::test]
async fn pipeline_through_the_host_proxy_survives_a_stage_restart() {
    let dir = temp_dir("host-proxy");
    let layers = [[0, 3], [3, 6]];
    // Remote stages: the gateway cannot vouch for "the local build", so the
    // measurement is pinned.
    let (policy, policy_text) = remote_stage_policies(&dir, &layers);
    let s0 = StageProc::start(0, 2, layers[0], &policy, &dir);
    let mut s1 = StageProc::start(1, 2, layers[1], &policy, &dir);
    let s1_endpoint = s1.endpoint.clone();
    let proxy = HostProxy::start(
        &[
            ("tcp://127.0.0.1:0", &s0.endpoint),
            ("tcp://127.0.0.1:0", &s1_endpoint),
            ("tcp://127.0.0.1:0", &s1_endpoint),
        ],
        &dir,
    );
    let (to_s0, to_s1, s0_to_s1) = (
        proxy.listening[0].clone(),
        proxy.listening[1].clone(),
        proxy.listening[2].clone(),
    );
    let gw = Gateway::start(Options {
        policy: Some(policy_text.clone()),
        remote: Some(vec![to_s0, to_s1]),
        env: vec![(
            "GATEWAY_PIPELINE__STAGES__1__PEER_ADDRESS".into(),
            s0_to_s1.clone(),
        )],
        ..Options::default()
    });

    let (texts, _, refs) = reference();
    let (s, b) = embed(&gw.url, json!({"model": MODEL, "input": texts[..4]})).await;
    assert_eq!(s, 200, "{b}\n{}", gw.log());
    for (v, r) in vectors(&b).iter().zip(&refs) {
        assert!(cosine(v, r) >= 0.9999);
    }
    // Stage 0 was told to reach stage 1 through the peer route.
    let s0_log = std::fs::read_to_string(dir.join("stage0.log")).unwrap();
    assert!(s0_log.contains(&s0_to_s1), "{s0_log}");

    // Stage 1 dies: the proxy closes its relayed connections, the gateway
    // answers 503 (never hangs, never 500) and says it is not ready.
    let _ = s1.child.kill();
    let _ = s1.child.wait();
    let mut saw_503 = false;
    for _ in 0..40 {
        let (s, b) = embed(&gw.url, json!({"model": MODEL, "input": "while down"})).await;
        match s {
            503 => {
                assert_error_shape(&b);
                saw_503 = true;
                break;
            }
            200 => tokio::time::sleep(Duration::from_millis(250)).await,
            other => panic!("unexpected {other} while stage 1 is down: {b}"),
        }
    }
    assert!(saw_503, "no 503 after stage 1 died:\n{}", gw.log());
    assert_eq!(ready_status(&gw.url).await, 503);
    // The proxy is still up, and still accepts (then closes) connections.
    assert!(alive(proxy.child.id()), "the host proxy exited");

    // Stage 1 comes back at the same address: the gateway rebuilds the
    // pipeline through the same proxy routes by itself.
    let s1b = StageProc::start_with(1, 2, layers[1], &policy, &dir, &s1_endpoint, &[]);
    assert_eq!(s1b.endpoint, s1_endpoint);
    let mut ready = false;
    for _ in 0..240 {
        if ready_status(&gw.url).await == 200 {
            ready = true;
            break;
        }
        tokio::time::sleep(Duration::from_millis(250)).await;
    }
    assert!(ready, "pipeline did not recover:\n{}", gw.log());
    let (s, b) = embed(&gw.url, json!({"model": MODEL, "input": texts[0]})).await;
    assert_eq!(s, 200, "{b}");
    assert!(cosine(&vectors(&b)[0], &refs[0]) >= 0.9999);
    assert!(alive(proxy.child.id()) && alive(gw.child.id()));
    // The relay logged byte counts and endpoints only.
    let plog = std::fs::read_to_string(dir.join("host-proxy.log")).unwrap();
    assert!(
        plog.contains("connection closed") || plog.contains("connection ended"),
        "{plog}"
    );
    assert!(
        !plog.contains(&texts[0]),
        "the proxy logged request content"
    );
}
