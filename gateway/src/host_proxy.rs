//! `gateway host-proxy`: the byte relay on a Nitro parent instance.
//!
//! Enclaves have no network: an enclave reaches anything only through vsock
//! to its parent. Each `--route LISTEN=TARGET` listens on one endpoint
//! (`vsock://…` or `tcp://…`) and relays every connection it accepts to the
//! target with [`tokio::io::copy_bidirectional`]. It parses nothing and holds
//! no key: what passes is the stage channel's ciphertext (the channel is
//! attested and encrypted end to end between the stages and the gateway).
//!
//! A target that is down costs only the connection that tried it (accepted,
//! then closed); the listener stays, so once the target is back (an enclave
//! restarted with the same CID and port) new connections go through without
//! restarting the proxy or the gateway. Logs carry endpoints and byte
//! counts, never contents.

use anyhow::{Context, Result};
use proto::io::transport::{self, BoxStream, Endpoint, Listener};
use std::sync::Arc;
use std::time::Duration;

/// `gateway host-proxy` arguments.
#[derive(clap::Args, Debug)]
pub struct HostProxyArgs {
    /// A relay `LISTEN=TARGET`, e.g. `vsock://any:8001=vsock://17:9000` or
    /// `tcp://127.0.0.1:7000=vsock://16:9000`; repeat for more routes.
    /// `tcp://…:0` picks a free port (printed at start).
    #[arg(long = "route", required = true, value_parser = parse_route)]
    pub routes: Vec<Route>,
}

/// One relay: where it listens and where it forwards.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Route {
    /// Endpoint the proxy listens on.
    pub listen: Endpoint,
    /// Endpoint every accepted connection is relayed to.
    pub target: Endpoint,
}

/// Parses `LISTEN=TARGET`.
pub fn parse_route(s: &str) -> Result<Route, String> {
    let (l, t) = s
        .split_once('=')
        .ok_or_else(|| format!("route {s:?}: expected LISTEN=TARGET"))?;
    Ok(Route {
        listen: l.trim().parse()?,
        target: t.trim().parse()?,
    })
}

/// Runs the proxy until SIGINT or SIGTERM.
pub fn main(args: HostProxyArgs) -> Result<()> {
    tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()?
        .block_on(run(args))
}

async fn run(args: HostProxyArgs) -> Result<()> {
    // Bind every route before announcing any, so a bad one fails the start.
    let mut bound = Vec::new();
    for r in &args.routes {
        let l = Listener::bind(&r.listen)
            .await
            .with_context(|| format!("route {}={}", r.listen, r.target))?;
        bound.push((l, r.target.clone()));
    }
    for (l, target) in &bound {
        let at = l.local_endpoint()?;
        tracing::info!(listen = %at, target = %target, "relaying");
        println!("HOST-PROXY ROUTE {at}={target}");
    }
    println!("HOST-PROXY READY");
    use std::io::Write;
    std::io::stdout().flush()?;
    for (l, target) in bound {
        tokio::spawn(serve_route(l, Arc::new(target)));
    }
    let mut sigterm = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate())?;
    tokio::select! {
        _ = tokio::signal::ctrl_c() => {}
        _ = sigterm.recv() => {}
    }
    tracing::info!("host proxy stopped");
    Ok(())
}

/// Accepts forever; each connection is relayed on its own task.
async fn serve_route(listener: Listener, target: Arc<Endpoint>) {
    loop {
        match listener.accept().await {
            Ok((inbound, peer)) => {
                tokio::spawn(relay(inbound, peer, target.clone()));
            }
            Err(e) => {
                // Out of descriptors and the like: keep the listener.
                tracing::warn!(target = %target, "accept failed: {e}");
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
        }
    }
}

/// Relays one connection; a target that is down closes it.
async fn relay(mut inbound: BoxStream, peer: String, target: Arc<Endpoint>) {
    let mut outbound = match transport::connect(&target).await {
        Ok(s) => s,
        Err(e) => {
            tracing::warn!(%peer, target = %target, "target unreachable, closing the connection: {e}");
            return;
        }
    };
    match tokio::io::copy_bidirectional(&mut inbound, &mut outbound).await {
        Ok((up, down)) => {
            tracing::debug!(%peer, target = %target, bytes_to_target = up, bytes_from_target = down, "connection closed")
        }
        Err(e) => tracing::debug!(%peer, target = %target, "connection ended: {e}"),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use tokio::io::{AsyncReadExt, AsyncWriteExt};

    #[test]
    fn routes_parse() {
        let r = parse_route("vsock://any:8001=vsock://17:9000").unwrap();
        assert_eq!(r.listen.to_string(), "vsock://any:8001");
        assert_eq!(r.target.to_string(), "vsock://17:9000");
        let r = parse_route("tcp://127.0.0.1:0 = tcp://10.0.0.1:9000").unwrap();
        assert_eq!(r.target, Endpoint::Tcp("10.0.0.1:9000".into()));
        for (bad, want) in [
            ("tcp://127.0.0.1:1", "LISTEN=TARGET"),
            ("tcp://127.0.0.1:1=udp://x:1", "unsupported scheme"),
            ("vsock://x:1=tcp://a:1", "CID"),
        ] {
            let e = parse_route(bad).unwrap_err();
            assert!(e.contains(want), "{bad}: {e}");
        }
    }

    /// Bytes pass both ways unchanged; a target that is down closes the
    /// connection but not the listener; once it is back, relaying resumes.
    #[tokio::test]
    async fn relays_bytes_and_survives_the_target_going_away() {
        // An echo target on a fixed port, so it can come back on it.
        let target = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let taddr = target.local_addr().unwrap();
        let echo = |l: tokio::net::TcpListener| {
            tokio::spawn(async move {
                while let Ok((mut s, _)) = l.accept().await {
                    tokio::spawn(async move {
                        let (mut r, mut w) = s.split();
                        let _ = tokio::io::copy(&mut r, &mut w).await;
                    });
                }
            })
        };
        let task = echo(target);
        let listener = Listener::bind(&"tcp://127.0.0.1:0".parse().unwrap())
            .await
            .unwrap();
        let at = match listener.local_endpoint().unwrap() {
            Endpoint::Tcp(a) => a,
            e => panic!("{e}"),
        };
        tokio::spawn(serve_route(
            listener,
            Arc::new(Endpoint::Tcp(taddr.to_string())),
        ));
        let roundtrip = |at: String| async move {
            let mut c = tokio::net::TcpStream::connect(&at).await.unwrap();
            let data: Vec<u8> = (0..200_000u32).map(|i| (i % 251) as u8).collect();
            c.write_all(&data).await.unwrap();
            let mut back = vec![0u8; data.len()];
            c.read_exact(&mut back).await.map(|_| back == data)
        };
        assert!(roundtrip(at.clone()).await.unwrap());
        // Target down: the connection is accepted and closed (EOF).
        task.abort();
        let _ = task.await;
        let mut c = tokio::net::TcpStream::connect(&at).await.unwrap();
        let mut buf = [0u8; 1];
        let n = tokio::time::timeout(Duration::from_secs(10), c.read(&mut buf))
            .await
            .expect("closed promptly")
            .unwrap_or(0);
        assert_eq!(n, 0);
        // Target back on the same port: the same listener relays again.
        let again = tokio::net::TcpListener::bind(taddr).await.unwrap();
        let _task = echo(again);
        assert!(roundtrip(at).await.unwrap());
    }
}
