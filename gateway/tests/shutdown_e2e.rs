//! Graceful shutdown and per-route deadlines, end to end, with slow stages
//! (the test-only `fault-injection` switch delays every micro-batch).

mod common;

use common::{
    assert_error_shape, embed, http_get, metrics_text, post_with_header, root, sample, signal,
    slow_stage, temp_dir, vectors, wait_gone, Gateway, StageProc,
};
use serde_json::json;

const MODEL: &str = "all-MiniLM-L6-v2";

fn addr(gw: &Gateway) -> String {
    gw.url.strip_prefix("http://").unwrap().to_string()
}

/// Waits until the gateway has at least `n` requests in flight (the scrape
/// included).
async fn wait_in_flight(gw: &Gateway, n: f64) {
    for _ in 0..400 {
        let m = metrics_text(&gw.url).await;
        if sample(&m, "gateway_http_requests_in_flight") >= n {
            return;
        }
        tokio::time::sleep(std::time::Duration::from_millis(25)).await;
    }
    panic!("requests never reached the gateway:\n{}", gw.log());
}

#[tokio::test]
async fn sigterm_finishes_in_flight_requests_refuses_new_connections_and_stops_stages() {
    let mut gw = Gateway::start_faulty(slow_stage("2000", "shutdown_grace_secs = 120\n"));
    let stages = gw.stage_pids();
    assert_eq!(stages.len(), 2);
    let in_flight: Vec<_> = (0..2)
        .map(|i| {
            let url = gw.url.clone();
            tokio::spawn(async move {
                embed(
                    &url,
                    json!({"model": MODEL, "input": format!("in flight {i}")}),
                )
                .await
            })
        })
        .collect();
    wait_in_flight(&gw, 3.0).await;
    signal(gw.child.id(), "TERM");

    // The listener closes: new connections are refused while the requests
    // above are still being served.
    let mut refused = false;
    for _ in 0..400 {
        match std::net::TcpStream::connect(addr(&gw)) {
            Err(e) if e.kind() == std::io::ErrorKind::ConnectionRefused => {
                refused = true;
                break;
            }
            _ => std::thread::sleep(std::time::Duration::from_millis(25)),
        }
    }
    assert!(refused, "new connections still accepted:\n{}", gw.log());

    for r in in_flight {
        let (s, b) = r.await.unwrap();
        assert_eq!(
            s,
            200,
            "an in-flight request must finish: {b}\n{}",
            gw.log()
        );
        assert_eq!(vectors(&b).len(), 1);
    }
    assert_eq!(gw.wait_exit("SIGTERM"), Some(0), "{}", gw.log());
    let log = gw.log();
    wait_gone(
        &stages,
        &format!("stage processes outlived the gateway:\n{log}"),
    );
    for line in ["SIGTERM received", "stage channels closed", "stopped"] {
        assert!(log.contains(line), "missing {line:?} in the log:\n{log}");
    }
    assert!(
        !log.contains("cancelled at the shutdown deadline"),
        "nothing was due for cancelling:\n{log}"
    );
}

#[tokio::test]
async fn requests_running_at_the_deadline_are_cancelled_with_503() {
    // A micro-batch takes 60 s; the grace period is 1 s.
    let mut gw = Gateway::start_faulty(slow_stage("60000", "shutdown_grace_secs = 1\n"));
    let stages = gw.stage_pids();
    let url = gw.url.clone();
    let slow =
        tokio::spawn(async move { embed(&url, json!({"model": MODEL, "input": "slow"})).await });
    wait_in_flight(&gw, 2.0).await;
    signal(gw.child.id(), "TERM");
    let (s, b) = slow.await.unwrap();
    assert_eq!(s, 503, "{b}");
    assert_error_shape(&b);
    assert_eq!(b["error"]["code"], "shutting_down", "{b}");
    // It exits (long before the micro-batch could have finished) and takes
    // its stages with it.
    assert_eq!(gw.wait_exit("SIGTERM"), Some(0), "{}", gw.log());
    let log = gw.log();
    wait_gone(
        &stages,
        &format!("stage processes outlived the gateway:\n{log}"),
    );
    assert!(log.contains("cancelled at the shutdown deadline"), "{log}");
}

#[tokio::test]
async fn each_route_has_its_own_deadline() {
    // Embeddings get 1 s, everything else keeps the 60 s default.
    let gw = Gateway::start_faulty(slow_stage(
        "2500",
        "[server.timeouts]\nembeddings_secs = 1\n",
    ));
    let body = json!({"model": MODEL, "input": "slow"});
    let url = format!("{}/v1/embeddings", gw.url);
    let r = post_with_header(&url, &body, ("x-request-id", "deadline-test")).await;
    assert_eq!(r.status(), 504);
    assert_eq!(r.headers()["x-request-id"], "deadline-test");
    let b: serde_json::Value = r.json().await.unwrap();
    assert_error_shape(&b);
    assert_eq!(b["error"]["code"], "timeout", "{b}");
    assert!(
        b["error"]["message"].as_str().unwrap().contains("1 s"),
        "{b}"
    );
    // The evidence route (stages answer it outside the compute thread) is
    // not held to the embeddings deadline.
    let r = http_get(&format!("{}/v1/attestation", gw.url)).await;
    assert_eq!(r.status(), 200);
    let m = metrics_text(&gw.url).await;
    assert_eq!(
        sample(
            &m,
            "gateway_http_requests_total{endpoint=\"/v1/embeddings\",status=\"504\"}"
        ),
        1.0,
        "{m}"
    );
}

#[test]
fn a_stage_stops_on_sigterm_while_its_supervisor_holds_stdin() {
    // `--exit-with-stdin` reads stdin on a blocking thread; a signal must
    // still stop the stage while the supervisor keeps the pipe open.
    let dir = temp_dir("stage-sigterm");
    let policy = root().join("config/policy.toml");
    let stage = StageProc::start(0, 1, [0, 6], &policy, &dir);
    let pid = stage.child.id();
    signal(pid, "TERM");
    let log = || std::fs::read_to_string(dir.join("stage0.log")).unwrap_or_default();
    wait_gone(
        &[pid],
        &format!("stage processes outlived the gateway:\n{}", log()),
    );
    assert!(log().contains("SIGTERM; exiting"), "{}", log());
    drop(stage);
}
