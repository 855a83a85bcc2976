//! Transports the stage channel runs over. Everything above this module sees
//! only a byte stream ([`BoxStream`]): TCP (`tcp://host:port`) for local
//! development and containers, vsock (`vsock://CID:PORT`) between Nitro
//! enclaves and their parent instance.

use std::fmt;
use std::str::FromStr;
use tokio::io::{AsyncRead, AsyncWrite};
use tokio::net::{TcpListener, TcpStream};
use tokio_vsock::{VsockAddr, VsockListener, VsockStream, VMADDR_CID_ANY};

/// A bidirectional byte stream.
pub trait ByteStream: AsyncRead + AsyncWrite + Send + Unpin + 'static {}
impl<T: AsyncRead + AsyncWrite + Send + Unpin + 'static> ByteStream for T {}

/// A boxed byte stream.
pub type BoxStream = Box<dyn ByteStream>;

/// The CID of the parent instance as seen from inside a Nitro enclave.
pub const NITRO_PARENT_CID: u32 = 3;

/// Where a stage listens or can be reached.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Endpoint {
    /// `tcp://host:port`.
    Tcp(String),
    /// `vsock://CID:PORT`; `vsock://any:PORT` listens on every CID (inside
    /// an enclave: the enclave's own).
    Vsock {
        /// Context id (`u32::MAX` = any, for listening).
        cid: u32,
        /// Port.
        port: u32,
    },
}

const SCHEMES: &str = "expected tcp://host:port or vsock://CID:PORT";

impl FromStr for Endpoint {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        if let Some(rest) = s.strip_prefix("tcp://") {
            if rest.rsplit_once(':').is_none() {
                return Err(format!("endpoint {s:?}: expected tcp://host:port"));
            }
            Ok(Endpoint::Tcp(rest.to_string()))
        } else if let Some(rest) = s.strip_prefix("vsock://") {
            let bad = |why: &str| format!("endpoint {s:?}: {why} (expected vsock://CID:PORT)");
            let (cid, port) = rest.split_once(':').ok_or_else(|| bad("no port"))?;
            let cid = if cid.eq_ignore_ascii_case("any") {
                VMADDR_CID_ANY
            } else {
                cid.parse()
                    .map_err(|_| bad("the CID is not a number or `any`"))?
            };
            let port = port.parse().map_err(|_| bad("the port is not a number"))?;
            Ok(Endpoint::Vsock { cid, port })
        } else {
            Err(format!("endpoint {s:?}: unsupported scheme ({SCHEMES})"))
        }
    }
}

impl fmt::Display for Endpoint {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Endpoint::Tcp(a) => write!(f, "tcp://{a}"),
            Endpoint::Vsock { cid, port } if *cid == VMADDR_CID_ANY => {
                write!(f, "vsock://any:{port}")
            }
            Endpoint::Vsock { cid, port } => write!(f, "vsock://{cid}:{port}"),
        }
    }
}

/// Adds the endpoint, and for vsock a hint when the machine has no vsock
/// support, to an I/O error.
fn explain(endpoint: &Endpoint, what: &str, e: std::io::Error) -> std::io::Error {
    let hint = match (endpoint, e.raw_os_error()) {
        // EAFNOSUPPORT, ENODEV: no AF_VSOCK in this kernel / no transport.
        (Endpoint::Vsock { .. }, Some(97 | 19)) => {
            " (this machine has no vsock support: run inside a Nitro enclave or on its parent \
             instance, or load the vsock kernel modules)"
        }
        _ => "",
    };
    std::io::Error::new(e.kind(), format!("{what} {endpoint}: {e}{hint}"))
}

/// Opens a stream to an endpoint.
pub async fn connect(endpoint: &Endpoint) -> std::io::Result<BoxStream> {
    match endpoint {
        Endpoint::Tcp(addr) => {
            let s = TcpStream::connect(addr).await?;
            s.set_nodelay(true)?;
            Ok(Box::new(s))
        }
        Endpoint::Vsock { cid, port } => {
            let s = VsockStream::connect(VsockAddr::new(*cid, *port))
                .await
                .map_err(|e| explain(endpoint, "connecting to", e))?;
            Ok(Box::new(s))
        }
    }
}

/// This machine's vsock context id (inside a Nitro enclave: the
/// `--enclave-cid` it was started with).
pub fn local_cid() -> std::io::Result<u32> {
    vsock::get_local_cid().map_err(|e| {
        std::io::Error::new(
            e.kind(),
            format!("reading the local vsock CID from /dev/vsock: {e}"),
        )
    })
}

/// A bound listener.
pub enum Listener {
    /// TCP listener.
    Tcp(TcpListener),
    /// vsock listener.
    Vsock(VsockListener),
}

impl Listener {
    /// Binds an endpoint (`tcp://127.0.0.1:0` picks a free port).
    pub async fn bind(endpoint: &Endpoint) -> std::io::Result<Self> {
        match endpoint {
            Endpoint::Tcp(addr) => Ok(Listener::Tcp(TcpListener::bind(addr).await?)),
            Endpoint::Vsock { cid, port } => VsockListener::bind(VsockAddr::new(*cid, *port))
                .map(Listener::Vsock)
                .map_err(|e| explain(endpoint, "listening on", e)),
        }
    }

    /// The endpoint actually bound.
    pub fn local_endpoint(&self) -> std::io::Result<Endpoint> {
        match self {
            Listener::Tcp(l) => Ok(Endpoint::Tcp(l.local_addr()?.to_string())),
            Listener::Vsock(l) => {
                let a = l.local_addr()?;
                Ok(Endpoint::Vsock {
                    cid: a.cid(),
                    port: a.port(),
                })
            }
        }
    }

    /// Accepts one connection; returns the stream and a printable peer.
    pub async fn accept(&self) -> std::io::Result<(BoxStream, String)> {
        match self {
            Listener::Tcp(l) => {
                let (s, peer) = l.accept().await?;
                s.set_nodelay(true)?;
                Ok((Box::new(s), peer.to_string()))
            }
            Listener::Vsock(l) => {
                let (s, peer) = l.accept().await?;
                Ok((
                    Box::new(s),
                    format!("vsock://{}:{}", peer.cid(), peer.port()),
                ))
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;
    use tokio::io::{AsyncReadExt, AsyncWriteExt};

    #[test]
    fn endpoints_parse_and_print_back() {
        for s in [
            "tcp://127.0.0.1:9000",
            "tcp://stage0:9000",
            "tcp://[::1]:1",
            "vsock://16:9000",
            "vsock://3:8001",
            "vsock://any:9000",
        ] {
            let e: Endpoint = s.parse().unwrap();
            assert_eq!(e.to_string(), s);
        }
        assert_eq!(
            "vsock://16:9000".parse::<Endpoint>().unwrap(),
            Endpoint::Vsock {
                cid: 16,
                port: 9000
            }
        );
        assert_eq!(
            "vsock://ANY:7".parse::<Endpoint>().unwrap(),
            Endpoint::Vsock {
                cid: VMADDR_CID_ANY,
                port: 7
            }
        );
    }

    #[test]
    fn bad_endpoints_say_what_is_expected() {
        for (s, want) in [
            ("vsock://16", "no port"),
            ("vsock://x:9000", "CID is not a number"),
            ("vsock://16:port", "port is not a number"),
            ("vsock://16:-1", "port is not a number"),
            ("vsock://4294967296:1", "CID is not a number"),
            ("tcp://nohost", "expected tcp://host:port"),
            ("udp://1:2", "unsupported scheme"),
            ("16:9000", "vsock://CID:PORT"),
        ] {
            let e = s.parse::<Endpoint>().unwrap_err();
            assert!(e.contains(want), "{s}: {e}");
        }
    }

    /// Connecting to a vsock CID nobody serves fails with an error that
    /// names the endpoint (with or without vsock in this kernel); never a
    /// panic or a hang.
    #[tokio::test]
    async fn vsock_connect_to_nowhere_fails_cleanly() {
        let ep = Endpoint::Vsock {
            cid: 0x7fff_fff0,
            port: 9,
        };
        let r = tokio::time::timeout(Duration::from_secs(20), connect(&ep))
            .await
            .expect("connect must not hang");
        let Err(e) = r else {
            panic!("connected to a CID that does not exist")
        };
        assert!(e.to_string().contains("vsock://2147483632:9"), "{e}");
    }

    /// Binding vsock works where the kernel has it (the bound endpoint
    /// prints back) and otherwise fails with the endpoint and a hint. Where
    /// loopback vsock works, a byte stream passes through.
    #[tokio::test]
    async fn vsock_listen_works_or_fails_with_a_clear_error() {
        let ep: Endpoint = "vsock://any:0".parse().unwrap();
        // Port 0 is not "any port" for vsock; use a fixed high one.
        let ep = match ep {
            Endpoint::Vsock { cid, .. } => Endpoint::Vsock {
                cid,
                port: 40_000 + std::process::id() % 20_000,
            },
            e => e,
        };
        let l = match Listener::bind(&ep).await {
            Ok(l) => l,
            Err(e) => {
                let m = e.to_string();
                assert!(m.contains("listening on vsock://any:"), "{m}");
                return;
            }
        };
        let bound = l.local_endpoint().unwrap();
        assert!(bound.to_string().starts_with("vsock://"), "{bound}");
        let Endpoint::Vsock { port, .. } = bound else {
            unreachable!()
        };
        // Loopback (CID 1) needs the vsock_loopback transport; try it briefly.
        let local = Endpoint::Vsock { cid: 1, port };
        let Ok(Ok(mut c)) = tokio::time::timeout(Duration::from_secs(3), connect(&local)).await
        else {
            return;
        };
        let (mut s, peer) = l.accept().await.unwrap();
        assert!(peer.starts_with("vsock://"), "{peer}");
        c.write_all(b"ciphertext").await.unwrap();
        let mut buf = [0u8; 10];
        s.read_exact(&mut buf).await.unwrap();
        assert_eq!(&buf, b"ciphertext");
    }
}
