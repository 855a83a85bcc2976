//! Clients that hold the gateway's resources (issue 18, finding 3), against
//! the real binaries: a request head that never completes (slowloris), and
//! a streamed answer whose client never reads it.

mod common;

use common::{
    assert_chat_serves, completions_options, http_get, http_post, metrics_text, sample, Gateway,
    Options,
};
use serde_json::json;
use std::time::{Duration, Instant};
use tokio::io::{AsyncReadExt as _, AsyncWriteExt as _};

/// Issue 18, finding 3: the real gateway closes a connection whose request
/// head does not arrive within `header_read_timeout_secs` (slowloris), and
/// keeps serving everyone else.
#[tokio::test]
async fn a_slow_request_head_is_cut_off() {
    use std::io::{Read, Write};
    let (gw, addr) = start_with_server("header_read_timeout_secs = 1\nmax_connections = 64\n");
    let t0 = std::time::Instant::now();
    let closed = tokio::task::spawn_blocking(move || {
        let mut slow = std::net::TcpStream::connect(&addr).unwrap();
        slow.write_all(b"GET /healthz HTTP/1.1\r\nhost: x\r\n")
            .unwrap();
        slow.set_read_timeout(Some(std::time::Duration::from_secs(30)))
            .unwrap();
        let mut buf = Vec::new();
        slow.read_to_end(&mut buf).is_ok()
    })
    .await
    .unwrap();
    assert!(closed, "the gateway kept the slow connection open");
    assert!(t0.elapsed() >= std::time::Duration::from_millis(900));
    let r = http_get(&format!("{}/healthz", gw.url)).await;
    assert_eq!(r.status(), 200);
}

/// A kept-alive connection that sends nothing after its first request is
/// closed once the header-read timeout passes (an idle timeout), so idle
/// clients do not hold connection slots for ever.
#[tokio::test]
async fn an_idle_kept_alive_connection_is_closed() {
    use std::io::{BufRead, BufReader, Read, Write};
    let (_gw, addr) = start_with_server("header_read_timeout_secs = 1\n");
    let (answered, idle_for) = tokio::task::spawn_blocking(move || {
        let mut conn = std::net::TcpStream::connect(&addr).unwrap();
        conn.write_all(b"GET /healthz HTTP/1.1\r\nhost: x\r\n\r\n")
            .unwrap();
        conn.set_read_timeout(Some(Duration::from_secs(30)))
            .unwrap();
        let mut r = BufReader::new(conn);
        let mut status = String::new();
        r.read_line(&mut status).unwrap();
        let mut length = 0usize;
        loop {
            let mut h = String::new();
            r.read_line(&mut h).unwrap();
            if h == "\r\n" {
                break;
            }
            if let Some(v) = h.to_ascii_lowercase().strip_prefix("content-length:") {
                length = v.trim().parse().unwrap();
            }
        }
        let mut body = vec![0u8; length];
        r.read_exact(&mut body).unwrap();
        // Now idle: the gateway closes the connection (EOF, not our timeout).
        let t0 = Instant::now();
        let mut rest = Vec::new();
        let closed = r.read_to_end(&mut rest).is_ok() && rest.is_empty();
        assert!(closed, "the idle connection was not closed: {rest:?}");
        (status, t0.elapsed())
    })
    .await
    .unwrap();
    assert!(answered.starts_with("HTTP/1.1 200"), "{answered}");
    assert!(idle_for >= Duration::from_millis(900), "{idle_for:?}");
}

/// A client that sends a streamed chat request and then never reads: once
/// the socket and the gateway's queue are full, the gateway waits the
/// route's deadline, cuts the stream (counted as `client_stopped_reading`)
/// and the sequences are freed in the stage, while the client still holds
/// its connection open.
#[tokio::test]
async fn a_stream_whose_client_never_reads_is_cancelled() {
    let mut opts = completions_options(&[[0, 30]], "");
    // The route's deadline is also how long the pipeline may stay silent:
    // 10 s, not less, so that a first step slowed by the other tests'
    // gateways starting beside this one on a 2-core machine (cut as a
    // silent pipeline at 3 s, 26 Nov 2026) is not mistaken for the cut
    // this test waits for.
    opts.server_extra =
        "send_buffer_bytes = 16384\n[server.timeouts]\ncompletions_secs = 10\n".into();
    let gw = Gateway::start(opts);
    let addr: std::net::SocketAddr = gw.url.strip_prefix("http://").unwrap().parse().unwrap();
    // Sixteen choices: about 3 KB of events per step, so the socket
    // buffers fill long before the answer ends.
    let body = json!({"model": "SmolLM2-135M-Instruct", "stream": true, "n": 16,
        "max_tokens": 480, "temperature": 1.0,
        "logit_bias": {"2": -100, "0": -100},
        "messages": [{"role": "user", "content": "Tell me a long story."}]})
    .to_string();
    let socket = tokio::net::TcpSocket::new_v4().unwrap();
    socket.set_recv_buffer_size(4096).unwrap();
    let mut conn = socket.connect(addr).await.unwrap();
    conn.write_all(
        format!(
            "POST /v1/chat/completions HTTP/1.1\r\nhost: {addr}\r\n\
             content-type: application/json\r\ncontent-length: {}\r\n\r\n{body}",
            body.len()
        )
        .as_bytes(),
    )
    .await
    .unwrap();
    // Read the status line only, then never again.
    let mut head = [0u8; 12];
    conn.read_exact(&mut head).await.unwrap();
    if &head != b"HTTP/1.1 200" {
        let mut rest = vec![0u8; 2000];
        let n = conn.read(&mut rest).await.unwrap();
        panic!(
            "{}{}",
            String::from_utf8_lossy(&head),
            String::from_utf8_lossy(&rest[..n])
        );
    }
    let cut = "gateway_streams_cut_total{reason=\"client_stopped_reading\"}";
    let deadline = Instant::now() + Duration::from_secs(180);
    let mut generating = false;
    loop {
        let m = metrics_text(&gw.url).await;
        generating |= sample(
            &m,
            "gateway_stage_active_sequences{pipeline=\"completions\",stage=\"0\"}",
        ) > 0.0;
        if sample(&m, cut) >= 1.0 {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "the stalled stream was never cut:\n{}",
            gw.log()
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    assert!(generating, "the stream never started");
    // The stage gives the four sequences and their KV room back.
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        let m = metrics_text(&gw.url).await;
        let seqs = sample(
            &m,
            "gateway_stage_active_sequences{pipeline=\"completions\",stage=\"0\"}",
        );
        let kv = sample(
            &m,
            "gateway_stage_kv_cache_tokens{pipeline=\"completions\",stage=\"0\"}",
        );
        if seqs == 0.0 && kv == 0.0 {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "sequences not freed: {seqs}, KV {kv}"
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    // Nothing else was counted as cut, and the gateway serves the next one.
    let m = metrics_text(&gw.url).await;
    assert_eq!(
        sample(&m, "gateway_streams_cut_total{reason=\"pipeline\"}"),
        0.0
    );
    assert_chat_serves(&gw.url).await;
    drop(conn);
}

/// `server.max_in_flight` bounds the POSTs the whole gateway works on: with
/// a cap of 1, a request whose body is still arriving holds the one permit,
/// the next POST gets 503 `server_overloaded` with `Retry-After` at once,
/// probes are still answered, and once the first request is answered the
/// next one is served.
#[tokio::test]
async fn past_max_in_flight_a_post_gets_503_and_probes_still_answer() {
    use std::io::{Read, Write};
    let (gw, addr) = start_with_server("max_in_flight = 1\n");
    let body = br#"{"model":"all-MiniLM-L6-v2","input":"held open"}"#;
    let mut slow = std::net::TcpStream::connect(&addr).unwrap();
    slow.set_nodelay(true).unwrap();
    // The head and the first bytes of the body in one write.
    let mut head = format!(
        "POST /v1/embeddings HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\ncontent-length: {}\r\nconnection: close\r\n\r\n",
        body.len()
    )
    .into_bytes();
    head.extend_from_slice(&body[..10]);
    slow.write_all(&head).unwrap();
    slow.flush().unwrap();
    // The held request has its permit once the gateway has read its head:
    // it is in flight beside the metrics request that asks.
    let deadline = Instant::now() + Duration::from_secs(20);
    while sample(
        &metrics_text(&gw.url).await,
        "gateway_http_requests_in_flight",
    ) < 2.0
    {
        assert!(
            Instant::now() < deadline,
            "the gateway never began the held request:\n{}",
            gw.log()
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let url = format!("{}/v1/embeddings", gw.url);
    let req = json!({"model": "all-MiniLM-L6-v2", "input": "second"});
    // (Counted in flight a few middleware layers before it takes its
    // permit: a POST in between would still be served.)
    let mut tries = 0;
    let refused = loop {
        let r = http_post(&url, &req).await;
        if r.status() == 503 {
            break r;
        }
        assert_eq!(r.status(), 200);
        tries += 1;
        assert!(tries < 20, "the cap never refused a request:\n{}", gw.log());
        tokio::time::sleep(Duration::from_millis(50)).await;
    };
    assert_eq!(refused.headers()["retry-after"], "1");
    let v: serde_json::Value = refused.json().await.unwrap();
    assert_eq!(v["error"]["code"], "server_overloaded", "{v}");
    assert_eq!(http_get(&format!("{}/healthz", gw.url)).await.status(), 200);
    assert_eq!(http_get(&format!("{}/readyz", gw.url)).await.status(), 200);
    // The held request completes and is answered; then its permit is back.
    slow.write_all(&body[10..]).unwrap();
    let mut answer = String::new();
    slow.read_to_string(&mut answer).unwrap();
    assert!(answer.starts_with("HTTP/1.1 200"), "{answer}");
    assert_eq!(http_post(&url, &req).await.status(), 200);
}

/// A gateway with `server_extra` in `[server]`, and its `host:port`.
fn start_with_server(server_extra: &str) -> (Gateway, String) {
    let gw = Gateway::start(Options {
        server_extra: server_extra.into(),
        ..Options::default()
    });
    let addr = gw.url.strip_prefix("http://").unwrap().to_string();
    (gw, addr)
}
