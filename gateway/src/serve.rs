//! The HTTP server loop: hyper-util's auto builder (HTTP/1.1 and HTTP/2)
//! over any [`axum::serve::Listener`] (plain TCP, or the TLS listener), with
//! the bounds `axum::serve` does not set:
//!
//! - **at most `max_connections` open connections**: past it, accepting
//!   waits (new connections queue in the kernel's backlog) until one closes;
//! - **a header-read timeout**: a connection that has not sent a request's
//!   whole head within `header_read_timeout` is closed (slowloris), which
//!   needs hyper's timer, here Tokio's;
//! - **an idle deadline for both protocols**: a connection with no request
//!   in flight (none begun yet, or all answered) for `header_read_timeout`
//!   is closed. hyper's own timeout covers only HTTP/1 heads; this one also
//!   covers the bytes before the version is known (zero bytes, a partial
//!   HTTP/2 preface) and HTTP/2 connections that open no stream, so no
//!   unauthenticated socket holds a connection slot for long. HTTP/2 also
//!   gets keep-alive pings and at most [`H2_MAX_STREAMS`] streams;
//! - **an optional send-buffer size** per connection ([`bind`]), so a
//!   client that stops reading pins little memory and its stream's
//!   stalled-reader deadline starts soon;
//! - **graceful shutdown**: on the signal, stop accepting, let every
//!   connection finish its requests, and return when all are closed.

use axum::extract::Request;
use axum::serve::Listener;
use axum::Router;
use hyper::body::Incoming;
use hyper_util::rt::{TokioExecutor, TokioIo, TokioTimer};
use hyper_util::server::conn::auto::Builder;
use hyper_util::service::TowerToHyperService;
use std::future::Future;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};
use tokio::net::{TcpListener, TcpSocket};
use tokio::sync::{watch, Semaphore};
use tower::ServiceExt as _;

/// Bounds on connections.
#[derive(Clone, Copy, Debug)]
pub struct ServeLimits {
    /// Most connections open at once.
    pub max_connections: usize,
    /// Longest time to receive a request's head (HTTP/1.1), and the idle
    /// deadline of every connection: how long it may have no request in
    /// flight, from its first byte on (both protocols).
    pub header_read_timeout: Duration,
}

/// Most concurrent streams on one HTTP/2 connection (hyper's default is 200).
pub const H2_MAX_STREAMS: u32 = 32;

/// One connection's requests in flight and when that last changed: what its
/// idle deadline is measured from.
struct Activity {
    in_flight: AtomicUsize,
    changed: Mutex<Instant>,
}

/// Marks a request in flight until it is dropped (with its response body).
struct InFlight(Arc<Activity>);

impl Activity {
    fn new() -> Arc<Self> {
        Arc::new(Self {
            in_flight: AtomicUsize::new(0),
            changed: Mutex::new(Instant::now()),
        })
    }

    fn begin(self: &Arc<Self>) -> InFlight {
        self.in_flight.fetch_add(1, Ordering::SeqCst);
        *self.changed.lock().unwrap() = Instant::now();
        InFlight(self.clone())
    }

    /// How long the connection has had nothing in flight.
    fn idle_for(&self) -> Duration {
        if self.in_flight.load(Ordering::SeqCst) > 0 {
            return Duration::ZERO;
        }
        self.changed.lock().unwrap().elapsed()
    }
}

impl Drop for InFlight {
    fn drop(&mut self) {
        *self.0.changed.lock().unwrap() = Instant::now();
        self.0.in_flight.fetch_sub(1, Ordering::SeqCst);
    }
}

/// Binds the listening socket for `listen` (`host:port`). `send_buffer`
/// sets `SO_SNDBUF` on it, which every accepted connection inherits (Linux
/// copies the listener's buffer sizes and turns off send autotuning).
pub async fn bind(listen: &str, send_buffer: Option<u32>) -> std::io::Result<TcpListener> {
    let addr = tokio::net::lookup_host(listen)
        .await?
        .next()
        .ok_or_else(|| {
            std::io::Error::new(
                std::io::ErrorKind::NotFound,
                "the address resolves to nothing",
            )
        })?;
    let socket = if addr.is_ipv4() {
        TcpSocket::new_v4()?
    } else {
        TcpSocket::new_v6()?
    };
    socket.set_reuseaddr(true)?;
    if let Some(n) = send_buffer {
        socket.set_send_buffer_size(n)?;
    }
    socket.bind(addr)?;
    socket.listen(1024)
}

/// Serves `router` on `listener` until `shutdown` completes and every
/// connection has closed.
pub async fn serve<L>(
    mut listener: L,
    router: Router,
    limits: ServeLimits,
    shutdown: impl Future<Output = ()> + Send + 'static,
) where
    L: Listener,
    L::Addr: Clone + Send + Sync + 'static,
{
    let mut builder = Builder::new(TokioExecutor::new());
    builder
        .http1()
        .timer(TokioTimer::new())
        .header_read_timeout(limits.header_read_timeout);
    builder
        .http2()
        .timer(TokioTimer::new())
        .max_concurrent_streams(H2_MAX_STREAMS)
        .keep_alive_interval(Some(limits.header_read_timeout))
        .keep_alive_timeout(limits.header_read_timeout);
    let idle = limits.header_read_timeout;
    let slots = Arc::new(Semaphore::new(limits.max_connections.max(1)));
    // Dropped on the signal: every connection task then starts its graceful
    // shutdown; `closed` completes once every task dropped its receiver.
    let (signal_tx, _) = watch::channel(());
    let signal_tx = Arc::new(signal_tx);
    let (closed_tx, closed_rx) = watch::channel(());
    let stop = signal_tx.clone();
    tokio::spawn(async move {
        shutdown.await;
        stop.send_replace(());
        drop(stop);
    });
    let mut stopping = signal_tx.subscribe();
    stopping.mark_unchanged();
    loop {
        let slot = tokio::select! {
            s = slots.clone().acquire_owned() => s.expect("the semaphore is never closed"),
            _ = stopping.changed() => break,
        };
        let (io, addr) = tokio::select! {
            c = listener.accept() => c,
            _ = stopping.changed() => break,
        };
        // Handlers see the peer address as `ConnectInfo` (e.g. the
        // attestation route's per-client rate). Each request is in flight
        // until its response body is done or dropped.
        let activity = Activity::new();
        let service = {
            let (router, activity) = (router.clone(), activity.clone());
            TowerToHyperService::new(tower::service_fn(move |req: Request<Incoming>| {
                let in_flight = activity.begin();
                let mut req = req.map(axum::body::Body::new);
                req.extensions_mut()
                    .insert(axum::extract::ConnectInfo(addr.clone()));
                let answer = router.clone().oneshot(req);
                async move {
                    let res = answer.await?;
                    Ok::<_, std::convert::Infallible>(res.map(|body| {
                        axum::body::Body::new(http_body_util::BodyExt::map_frame(
                            body,
                            move |frame| {
                                let _held = &in_flight;
                                frame
                            },
                        ))
                    }))
                }
            }))
        };
        let builder = builder.clone();
        let mut signal = signal_tx.subscribe();
        signal.mark_unchanged();
        let closed = closed_rx.clone();
        tokio::spawn(async move {
            let conn = builder.serve_connection_with_upgrades(TokioIo::new(io), service);
            tokio::pin!(conn);
            let mut draining = false;
            let mut tick = tokio::time::interval((idle / 4).max(Duration::from_millis(25)));
            loop {
                tokio::select! {
                    r = conn.as_mut() => {
                        if let Err(e) = r {
                            tracing::debug!(error = %e, "connection ended with an error");
                        }
                        break;
                    }
                    _ = tick.tick() => {
                        if activity.idle_for() >= idle {
                            tracing::debug!("idle connection closed");
                            break;
                        }
                    }
                    _ = signal.changed(), if !draining => {
                        draining = true;
                        conn.as_mut().graceful_shutdown();
                    }
                }
            }
            drop(slot);
            drop(closed);
        });
    }
    drop(listener);
    drop(closed_rx);
    closed_tx.closed().await;
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::{Read, Write};

    /// A server of one route with `max_connections` and a 300 ms deadline:
    /// its address, what stops it, and its task.
    async fn test_server(
        max_connections: usize,
    ) -> (
        std::net::SocketAddr,
        tokio::sync::oneshot::Sender<()>,
        tokio::task::JoinHandle<()>,
    ) {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let router = Router::new().route("/", axum::routing::get(|| async { "ok" }));
        let (stop_tx, stop_rx) = tokio::sync::oneshot::channel::<()>();
        let server = tokio::spawn(serve(
            listener,
            router,
            ServeLimits {
                max_connections,
                header_read_timeout: Duration::from_millis(300),
            },
            async {
                let _ = stop_rx.await;
            },
        ));
        (addr, stop_tx, server)
    }

    /// Stops the server and waits until its shutdown completes.
    async fn stop(stop_tx: tokio::sync::oneshot::Sender<()>, server: tokio::task::JoinHandle<()>) {
        stop_tx.send(()).unwrap();
        tokio::time::timeout(Duration::from_secs(5), server)
            .await
            .expect("shutdown completes")
            .unwrap();
    }

    /// Issue 29, finding 2: connections that never send a request (zero
    /// bytes, a partial HTTP/2 preface, a whole preface and SETTINGS but no
    /// stream) are closed after the deadline, so they cannot hold the
    /// connection slots; the next client is served.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn connections_without_a_request_are_closed_at_the_deadline() {
        let (addr, stop_tx, server) = test_server(3).await;
        let answer = tokio::task::spawn_blocking(move || {
            // An empty HTTP/2 SETTINGS frame after the client preface.
            let settings: &[u8] = &[0, 0, 0, 4, 0, 0, 0, 0, 0];
            let preface = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n".to_vec();
            let idle: Vec<Vec<u8>> = vec![
                Vec::new(),
                b"PRI * HTTP/2.0\r\n".to_vec(),
                [preface, settings.to_vec()].concat(),
            ];
            let t0 = std::time::Instant::now();
            let mut held = Vec::new();
            for bytes in &idle {
                let mut s = std::net::TcpStream::connect(addr).unwrap();
                s.write_all(bytes).unwrap();
                held.push(s);
            }
            for (i, s) in held.iter_mut().enumerate() {
                s.set_read_timeout(Some(Duration::from_secs(20))).unwrap();
                let mut buf = Vec::new();
                // EOF (or a reset) from the server, not our read timeout.
                let r = s.read_to_end(&mut buf);
                let closed = match &r {
                    Ok(_) => true,
                    Err(e) => e.kind() == std::io::ErrorKind::ConnectionReset,
                };
                assert!(closed, "idle connection {i} was kept open: {r:?}");
            }
            let cut = t0.elapsed();
            assert!(
                cut >= Duration::from_millis(250),
                "closed too early: {cut:?}"
            );
            let mut c = std::net::TcpStream::connect(addr).unwrap();
            c.write_all(b"GET / HTTP/1.1\r\nhost: x\r\nconnection: close\r\n\r\n")
                .unwrap();
            c.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
            let mut answer = String::new();
            c.read_to_string(&mut answer).unwrap();
            answer
        })
        .await
        .unwrap();
        assert!(answer.starts_with("HTTP/1.1 200"), "{answer}");
        stop(stop_tx, server).await;
    }

    /// A client that sends half a request head and then nothing is closed
    /// after the header-read timeout; a second connection over the cap
    /// waits until a slot frees.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn slow_heads_are_closed_and_connections_are_capped() {
        let (addr, stop_tx, server) = test_server(1).await;
        let result = tokio::task::spawn_blocking(move || {
            let t0 = std::time::Instant::now();
            let mut slow = std::net::TcpStream::connect(addr).unwrap();
            slow.write_all(b"GET / HTTP/1.1\r\nhost: x\r\n").unwrap();
            // The only slot is taken: a second client is not served yet.
            let mut second = std::net::TcpStream::connect(addr).unwrap();
            second
                .write_all(b"GET / HTTP/1.1\r\nhost: x\r\nconnection: close\r\n\r\n")
                .unwrap();
            // The slow head is cut off: the server closes it (EOF, not
            // our read timeout), and not before the header-read timeout.
            let mut buf = Vec::new();
            slow.set_read_timeout(Some(Duration::from_secs(30)))
                .unwrap();
            let closed = slow.read_to_end(&mut buf).is_ok();
            let cut = t0.elapsed();
            assert!(closed, "the server did not close the slow connection");
            // ...and then the second client gets its answer.
            let mut answer = String::new();
            second
                .set_read_timeout(Some(Duration::from_secs(10)))
                .unwrap();
            second.read_to_string(&mut answer).unwrap();
            (cut, answer)
        })
        .await
        .unwrap();
        let (cut, answer) = result;
        assert!(
            cut >= Duration::from_millis(250),
            "closed before the timeout: {cut:?}"
        );
        assert!(answer.starts_with("HTTP/1.1 200"), "{answer}");
        stop(stop_tx, server).await;
    }
}
