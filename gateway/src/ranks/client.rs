//! gRPC channels to ranks: `unix:///run/minimax/rank-0.sock` (local ranks, the default) or
//! `http://host:port` / `host:port` (ranks on other hosts).

use std::path::PathBuf;
use std::time::Duration;

use hyper_util::rt::TokioIo;
use minimax_proto::v1::rank_client::RankClient;
use tonic::transport::{Channel, Endpoint, Uri};

/// Where a rank listens.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum RankAddr {
    Unix(PathBuf),
    Tcp(String),
}

impl RankAddr {
    /// Parses `unix:///path`, `unix:/path`, `http://host:port` or `host:port`.
    pub fn parse(s: &str) -> Result<Self, String> {
        let s = s.trim();
        if let Some(rest) = s.strip_prefix("unix://") {
            if rest.is_empty() {
                return Err(format!("empty unix socket path in {s:?}"));
            }
            return Ok(RankAddr::Unix(PathBuf::from(rest)));
        }
        if let Some(rest) = s.strip_prefix("unix:") {
            return Ok(RankAddr::Unix(PathBuf::from(rest)));
        }
        if s.starts_with("http://") {
            return Ok(RankAddr::Tcp(s.to_string()));
        }
        if s.starts_with("https://") {
            return Err(format!("{s:?}: TLS is not supported for rank connections"));
        }
        if s.contains(':') {
            return Ok(RankAddr::Tcp(format!("http://{s}")));
        }
        Err(format!("{s:?} is neither unix:///path nor host:port"))
    }

    /// The address as a rank's `--listen` flag takes it.
    pub fn to_listen(&self) -> String {
        match self {
            RankAddr::Unix(p) => format!("unix://{}", p.display()),
            RankAddr::Tcp(u) => u.trim_start_matches("http://").to_string(),
        }
    }
}

impl std::fmt::Display for RankAddr {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            RankAddr::Unix(p) => write!(f, "unix://{}", p.display()),
            RankAddr::Tcp(u) => f.write_str(u),
        }
    }
}

/// Opens a channel to a rank (one attempt, bounded by `timeout`).
pub async fn connect(addr: &RankAddr, timeout: Duration) -> Result<RankClient<Channel>, String> {
    let channel = match addr {
        RankAddr::Unix(path) => {
            let path = path.clone();
            // The URI is required by the API but unused: the connector dials the socket.
            let ep = Endpoint::try_from("http://[::1]:50051").map_err(|e| e.to_string())?.connect_timeout(timeout);
            let fut = ep.connect_with_connector(tower::service_fn(move |_: Uri| {
                let path = path.clone();
                async move { Ok::<_, std::io::Error>(TokioIo::new(tokio::net::UnixStream::connect(path).await?)) }
            }));
            tokio::time::timeout(timeout, fut).await.map_err(|_| format!("connecting to {addr} timed out"))?.map_err(|e| format!("connecting to {addr}: {e}"))?
        }
        RankAddr::Tcp(uri) => {
            let ep = Endpoint::try_from(uri.clone()).map_err(|e| format!("{uri}: {e}"))?.connect_timeout(timeout).tcp_nodelay(true);
            tokio::time::timeout(timeout, ep.connect()).await.map_err(|_| format!("connecting to {addr} timed out"))?.map_err(|e| format!("connecting to {addr}: {e}"))?
        }
    };
    Ok(RankClient::new(channel).max_decoding_message_size(256 << 20).max_encoding_message_size(256 << 20))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_addresses() {
        assert_eq!(RankAddr::parse("unix:///run/minimax/rank-0.sock").unwrap(), RankAddr::Unix("/run/minimax/rank-0.sock".into()));
        assert_eq!(RankAddr::parse("10.0.0.2:7000").unwrap(), RankAddr::Tcp("http://10.0.0.2:7000".into()));
        assert_eq!(RankAddr::parse("http://h:1").unwrap().to_listen(), "h:1");
        assert!(RankAddr::parse("https://h:1").is_err());
        assert!(RankAddr::parse("nonsense").is_err());
        assert_eq!(RankAddr::parse("unix:///a.sock").unwrap().to_string(), "unix:///a.sock");
    }
}
