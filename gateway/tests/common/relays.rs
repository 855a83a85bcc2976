//! Relays between a test and a gateway: one that records every byte, one that tampers with answers.

use super::http::client;

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
