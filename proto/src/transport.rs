//! Transports the stage channel runs over. Everything above this module sees
//! only a byte stream; TCP is implemented here, vsock joins it for Nitro.

use std::fmt;
use std::str::FromStr;
use tokio::io::{AsyncRead, AsyncWrite};
use tokio::net::{TcpListener, TcpStream};

/// A bidirectional byte stream.
pub trait ByteStream: AsyncRead + AsyncWrite + Send + Unpin + 'static {}
impl<T: AsyncRead + AsyncWrite + Send + Unpin + 'static> ByteStream for T {}

/// A boxed byte stream.
pub type BoxStream = Box<dyn ByteStream>;

/// Where a stage listens or can be reached.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Endpoint {
    /// `tcp://host:port`.
    Tcp(String),
}

impl FromStr for Endpoint {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        if let Some(rest) = s.strip_prefix("tcp://") {
            if rest.rsplit_once(':').is_none() {
                return Err(format!("endpoint {s:?}: expected tcp://host:port"));
            }
            Ok(Endpoint::Tcp(rest.to_string()))
        } else {
            Err(format!(
                "endpoint {s:?}: unsupported scheme (expected tcp://host:port)"
            ))
        }
    }
}

impl fmt::Display for Endpoint {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Endpoint::Tcp(a) => write!(f, "tcp://{a}"),
        }
    }
}

/// Opens a stream to an endpoint.
pub async fn connect(endpoint: &Endpoint) -> std::io::Result<BoxStream> {
    match endpoint {
        Endpoint::Tcp(addr) => {
            let s = TcpStream::connect(addr).await?;
            s.set_nodelay(true)?;
            Ok(Box::new(s))
        }
    }
}

/// A bound listener.
pub enum Listener {
    /// TCP listener.
    Tcp(TcpListener),
}

impl Listener {
    /// Binds an endpoint (`tcp://127.0.0.1:0` picks a free port).
    pub async fn bind(endpoint: &Endpoint) -> std::io::Result<Self> {
        match endpoint {
            Endpoint::Tcp(addr) => Ok(Listener::Tcp(TcpListener::bind(addr).await?)),
        }
    }

    /// The endpoint actually bound.
    pub fn local_endpoint(&self) -> std::io::Result<Endpoint> {
        match self {
            Listener::Tcp(l) => Ok(Endpoint::Tcp(l.local_addr()?.to_string())),
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
        }
    }
}
