//! The CPU **test transport**: a full mesh of loopback stream sockets (TCP `host:port`, or
//! `unix:///path`) between the ranks of one world, so CI can run multi-process pipeline and
//! tensor parallelism without GPUs. GPU ranks use NCCL behind the same [`Collective`] trait;
//! nothing here is meant to be fast.
//!
//! Setup ([`TestTransport::join`]): rank `r` listens on `peer_addrs[r]`, dials every rank below
//! it (retrying until the deadline) and accepts every rank above it. A dialer sends a hello
//! (magic, world id, its rank); the acceptor checks the world id (a connection from a stale
//! world is dropped) and acknowledges. Then one reader thread per peer moves frames into a
//! channel, so writes never block on a peer that is itself writing, and every receive is a
//! `recv_timeout`: a dead peer (EOF, reset) or a silent one (timeout) is an error, never a hang.
//!
//! All-reduce is an all-gather followed by a sum in rank order on every rank, so every rank
//! gets bit-identical results.

use std::io::{self, Read, Write};
use std::net::{TcpListener, TcpStream};
use std::os::unix::net::{UnixListener, UnixStream};
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::mpsc::{self, Receiver, RecvTimeoutError};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use crate::comm::{CommError, Collective};

const MAGIC: &[u8; 8] = b"MMXTT001";
/// Frame kinds; a receiver checks it got the kind it expects (same op order on every rank).
/// Each kind has its own inbox per peer, so a pipeline stage's step agreement (gathers) can
/// run on one thread while its compute (activations) runs on another.
const KIND_GATHER: u8 = 1;
const KIND_ACTIVATIONS: u8 = 2;
const N_KINDS: usize = 2;
/// Largest frame accepted (guards against a corrupt length).
const MAX_FRAME: u64 = 1 << 34;

fn err(op: &'static str, detail: impl std::fmt::Display) -> CommError {
    CommError { op, detail: detail.to_string() }
}

/// A connected stream of either family.
enum Conn {
    Tcp(TcpStream),
    Unix(UnixStream),
}

impl Conn {
    fn try_clone(&self) -> io::Result<Conn> {
        Ok(match self {
            Conn::Tcp(s) => Conn::Tcp(s.try_clone()?),
            Conn::Unix(s) => Conn::Unix(s.try_clone()?),
        })
    }
    fn set_timeouts(&self, read: Option<Duration>, write: Option<Duration>) -> io::Result<()> {
        match self {
            Conn::Tcp(s) => {
                s.set_nodelay(true)?;
                s.set_read_timeout(read)?;
                s.set_write_timeout(write)
            }
            Conn::Unix(s) => {
                s.set_read_timeout(read)?;
                s.set_write_timeout(write)
            }
        }
    }
    fn shutdown(&self) {
        let _ = match self {
            Conn::Tcp(s) => s.shutdown(std::net::Shutdown::Both),
            Conn::Unix(s) => s.shutdown(std::net::Shutdown::Both),
        };
    }
}

impl Read for Conn {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        match self {
            Conn::Tcp(s) => s.read(buf),
            Conn::Unix(s) => s.read(buf),
        }
    }
}

impl Write for Conn {
    fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
        match self {
            Conn::Tcp(s) => s.write(buf),
            Conn::Unix(s) => s.write(buf),
        }
    }
    fn flush(&mut self) -> io::Result<()> {
        match self {
            Conn::Tcp(s) => s.flush(),
            Conn::Unix(s) => s.flush(),
        }
    }
}

/// Where a rank listens for its peers.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum PeerAddr {
    Tcp(String),
    Unix(PathBuf),
}

impl PeerAddr {
    /// `unix:///path` or `host:port`.
    pub fn parse(s: &str) -> Result<Self, CommError> {
        if let Some(p) = s.strip_prefix("unix://") {
            if p.is_empty() {
                return Err(err("join", format!("empty unix path in '{s}'")));
            }
            Ok(PeerAddr::Unix(PathBuf::from(p)))
        } else if s.contains(':') {
            Ok(PeerAddr::Tcp(s.to_string()))
        } else {
            Err(err("join", format!("peer address '{s}' is neither host:port nor unix:///path")))
        }
    }

    fn dial(&self) -> io::Result<Conn> {
        match self {
            PeerAddr::Tcp(a) => TcpStream::connect(a).map(Conn::Tcp),
            PeerAddr::Unix(p) => UnixStream::connect(p).map(Conn::Unix),
        }
    }
}

enum Listener {
    Tcp(TcpListener),
    Unix(UnixListener, PathBuf),
}

impl Listener {
    fn bind(addr: &PeerAddr) -> io::Result<Self> {
        let l = match addr {
            PeerAddr::Tcp(a) => Listener::Tcp(TcpListener::bind(a)?),
            PeerAddr::Unix(p) => {
                if let Some(dir) = p.parent() {
                    std::fs::create_dir_all(dir)?;
                }
                let _ = std::fs::remove_file(p);
                let l = UnixListener::bind(p)?;
                use std::os::unix::fs::PermissionsExt;
                std::fs::set_permissions(p, std::fs::Permissions::from_mode(0o600))?;
                Listener::Unix(l, p.clone())
            }
        };
        match &l {
            Listener::Tcp(t) => t.set_nonblocking(true)?,
            Listener::Unix(u, _) => u.set_nonblocking(true)?,
        }
        Ok(l)
    }

    fn accept(&self) -> io::Result<Conn> {
        let c = match self {
            Listener::Tcp(t) => Conn::Tcp(t.accept()?.0),
            Listener::Unix(u, _) => Conn::Unix(u.accept()?.0),
        };
        match &c {
            Conn::Tcp(s) => s.set_nonblocking(false)?,
            Conn::Unix(s) => s.set_nonblocking(false)?,
        }
        Ok(c)
    }
}

impl Drop for Listener {
    fn drop(&mut self) {
        if let Listener::Unix(_, p) = self {
            let _ = std::fs::remove_file(p);
        }
    }
}

type Frame = (u8, Vec<u8>);

struct Peer {
    writer: Mutex<Conn>,
    /// One inbox per frame kind (`kind - 1`).
    inboxes: Vec<Mutex<Receiver<Result<Frame, String>>>>,
    /// A handle to shut the socket down from `abort`.
    control: Conn,
}

/// One rank's endpoint of the test transport.
pub struct TestTransport {
    rank: usize,
    world: usize,
    /// `None` at this rank's own index.
    peers: Vec<Option<Peer>>,
    timeout: Duration,
    broken: Arc<Mutex<Option<String>>>,
    aborted: Arc<AtomicBool>,
}

fn write_frame(w: &mut Conn, kind: u8, payload: &[u8]) -> io::Result<()> {
    let mut head = [0u8; 9];
    head[0] = kind;
    head[1..].copy_from_slice(&(payload.len() as u64).to_le_bytes());
    w.write_all(&head)?;
    w.write_all(payload)?;
    w.flush()
}

fn read_frame(r: &mut Conn) -> io::Result<Frame> {
    let mut head = [0u8; 9];
    r.read_exact(&mut head)?;
    let len = u64::from_le_bytes(head[1..].try_into().unwrap());
    if len > MAX_FRAME {
        return Err(io::Error::new(io::ErrorKind::InvalidData, format!("frame of {len} bytes")));
    }
    let mut payload = vec![0u8; len as usize];
    r.read_exact(&mut payload)?;
    Ok((head[0], payload))
}

fn hello(world_id: &[u8], rank: usize) -> Vec<u8> {
    let mut h = MAGIC.to_vec();
    h.extend_from_slice(&(world_id.len() as u32).to_le_bytes());
    h.extend_from_slice(world_id);
    h.extend_from_slice(&(rank as u32).to_le_bytes());
    h
}

/// Reads a hello; returns the sender's rank if it names `world_id`.
fn read_hello(c: &mut Conn, world_id: &[u8]) -> io::Result<Option<usize>> {
    let mut magic = [0u8; 8];
    c.read_exact(&mut magic)?;
    let mut n = [0u8; 4];
    c.read_exact(&mut n)?;
    let n = u32::from_le_bytes(n) as usize;
    if &magic != MAGIC || n > 4096 {
        return Ok(None);
    }
    let mut id = vec![0u8; n];
    c.read_exact(&mut id)?;
    let mut r = [0u8; 4];
    c.read_exact(&mut r)?;
    Ok((id == world_id).then_some(u32::from_le_bytes(r) as usize))
}

impl TestTransport {
    /// Connects this rank to every other rank of the world `world_id`, listening on
    /// `addrs[rank]`; fails if the mesh is not complete within `timeout`. `op_timeout` bounds
    /// every later receive and send.
    pub fn join(rank: usize, world_id: &[u8], addrs: &[String], timeout: Duration, op_timeout: Duration) -> Result<Self, CommError> {
        let world = addrs.len();
        if rank >= world {
            return Err(err("join", format!("rank {rank} but {world} peer addresses")));
        }
        let addrs: Vec<PeerAddr> = addrs.iter().map(|a| PeerAddr::parse(a)).collect::<Result<_, _>>()?;
        let deadline = Instant::now() + timeout;
        let mut conns: Vec<Option<Conn>> = (0..world).map(|_| None).collect();
        let listener = if rank + 1 < world {
            Some(Listener::bind(&addrs[rank]).map_err(|e| err("join", format!("listen on {:?}: {e}", addrs[rank])))?)
        } else {
            None
        };
        // Dial every lower rank.
        for (peer, addr) in addrs.iter().enumerate().take(rank) {
            let mut last_err = String::new();
            loop {
                if Instant::now() >= deadline {
                    return Err(err("join", format!("rank {peer} at {addr:?} unreachable within {timeout:?}: {last_err}")));
                }
                match Self::dial_once(addr, world_id, rank, deadline) {
                    Ok(c) => {
                        conns[peer] = Some(c);
                        break;
                    }
                    Err(e) => {
                        last_err = e.to_string();
                        std::thread::sleep(Duration::from_millis(20));
                    }
                }
            }
        }
        // Accept every higher rank.
        if let Some(l) = &listener {
            while conns[rank + 1..].iter().any(Option::is_none) {
                if Instant::now() >= deadline {
                    let missing: Vec<usize> = (rank + 1..world).filter(|&p| conns[p].is_none()).collect();
                    return Err(err("join", format!("ranks {missing:?} did not connect within {timeout:?}")));
                }
                match l.accept() {
                    Ok(mut c) => {
                        let left = deadline.saturating_duration_since(Instant::now()).max(Duration::from_millis(10));
                        let _ = c.set_timeouts(Some(left), Some(left));
                        match read_hello(&mut c, world_id) {
                            Ok(Some(p)) if p > rank && p < world && conns[p].is_none() => {
                                if c.write_all(&[1]).is_ok() {
                                    conns[p] = Some(c);
                                }
                            }
                            Ok(other) => tracing::warn!(?other, "dropping a transport connection from another world"),
                            Err(e) => tracing::warn!("bad transport hello: {e}"),
                        }
                    }
                    Err(e) if e.kind() == io::ErrorKind::WouldBlock => std::thread::sleep(Duration::from_millis(5)),
                    Err(e) => return Err(err("join", format!("accept: {e}"))),
                }
            }
        }
        drop(listener);
        let broken = Arc::new(Mutex::new(None));
        let aborted = Arc::new(AtomicBool::new(false));
        let mut peers = Vec::with_capacity(world);
        for (p, c) in conns.into_iter().enumerate() {
            let Some(c) = c else {
                peers.push(None);
                continue;
            };
            let io_err = |e: io::Error| err("join", e);
            c.set_timeouts(None, Some(op_timeout)).map_err(io_err)?;
            let mut reader = c.try_clone().map_err(io_err)?;
            let control = c.try_clone().map_err(io_err)?;
            let (txs, rxs): (Vec<_>, Vec<_>) = (0..N_KINDS).map(|_| mpsc::channel::<Result<Frame, String>>()).unzip();
            let (broken2, aborted2) = (broken.clone(), aborted.clone());
            std::thread::Builder::new()
                .name(format!("transport-rx-{p}"))
                .spawn(move || {
                    loop {
                        match read_frame(&mut reader) {
                            Ok(f) if (1..=N_KINDS).contains(&usize::from(f.0)) => {
                                if txs[usize::from(f.0) - 1].send(Ok(f)).is_err() {
                                    return;
                                }
                            }
                            res => {
                                let e = match res {
                                    Err(e) => e,
                                    Ok((k, _)) => io::Error::new(io::ErrorKind::InvalidData, format!("unknown frame kind {k}")),
                                };
                                let why = if e.kind() == io::ErrorKind::UnexpectedEof {
                                    format!("rank {p} closed the connection (dead or shut down)")
                                } else {
                                    format!("connection to rank {p}: {e}")
                                };
                                if !aborted2.load(Ordering::SeqCst) {
                                    tracing::error!("{why}");
                                }
                                broken2.lock().unwrap().get_or_insert(why.clone());
                                for tx in &txs {
                                    let _ = tx.send(Err(why.clone()));
                                }
                                return;
                            }
                        }
                    }
                })
                .map_err(|e| err("join", e))?;
            peers.push(Some(Peer { writer: Mutex::new(c), inboxes: rxs.into_iter().map(Mutex::new).collect(), control }));
        }
        Ok(Self { rank, world, peers, timeout: op_timeout, broken, aborted })
    }

    fn dial_once(addr: &PeerAddr, world_id: &[u8], rank: usize, deadline: Instant) -> io::Result<Conn> {
        let mut c = addr.dial()?;
        let left = deadline.saturating_duration_since(Instant::now()).max(Duration::from_millis(10));
        c.set_timeouts(Some(left), Some(left))?;
        c.write_all(&hello(world_id, rank))?;
        let mut ack = [0u8; 1];
        c.read_exact(&mut ack)?;
        if ack[0] != 1 {
            return Err(io::Error::other("hello refused"));
        }
        Ok(c)
    }

    /// Why the world is broken, if a peer connection failed.
    pub fn broken(&self) -> Option<String> {
        self.broken.lock().unwrap().clone()
    }

    /// Tears the mesh down: every peer sees EOF at once (and fails instead of waiting).
    pub fn abort(&self) {
        self.aborted.store(true, Ordering::SeqCst);
        for p in self.peers.iter().flatten() {
            p.control.shutdown();
        }
    }

    fn peer(&self, p: usize, op: &'static str) -> Result<&Peer, CommError> {
        self.peers.get(p).and_then(Option::as_ref).ok_or_else(|| err(op, format!("no peer {p}")))
    }

    fn send(&self, p: usize, kind: u8, payload: &[u8], op: &'static str) -> Result<(), CommError> {
        if let Some(why) = self.broken() {
            return Err(err(op, why));
        }
        let peer = self.peer(p, op)?;
        write_frame(&mut peer.writer.lock().unwrap(), kind, payload).map_err(|e| err(op, format!("send to rank {p}: {e}")))
    }

    fn recv(&self, p: usize, kind: u8, op: &'static str) -> Result<Vec<u8>, CommError> {
        let peer = self.peer(p, op)?;
        let rx = peer.inboxes[usize::from(kind) - 1].lock().unwrap();
        match rx.recv_timeout(self.timeout) {
            Ok(Ok((k, payload))) if k == kind => Ok(payload),
            Ok(Ok((k, _))) => Err(err(op, format!("rank {p} sent frame kind {k}, expected {kind} (ranks out of step)"))),
            Ok(Err(why)) => Err(err(op, why)),
            Err(RecvTimeoutError::Timeout) => Err(err(op, format!("rank {p} sent nothing within {:?}", self.timeout))),
            Err(RecvTimeoutError::Disconnected) => Err(err(op, self.broken().unwrap_or_else(|| format!("rank {p} disconnected")))),
        }
    }

    /// Every rank's `mine`, indexed by rank (including this rank's own).
    pub fn all_gather(&self, mine: &[u8]) -> Result<Vec<Vec<u8>>, CommError> {
        for p in 0..self.world {
            if p != self.rank {
                self.send(p, KIND_GATHER, mine, "all_gather")?;
            }
        }
        let mut out = Vec::with_capacity(self.world);
        for p in 0..self.world {
            out.push(if p == self.rank { mine.to_vec() } else { self.recv(p, KIND_GATHER, "all_gather")? });
        }
        Ok(out)
    }

    /// Sends hidden states to pipeline stage `to`.
    pub fn send_activations(&self, to: usize, x: &[f32]) -> Result<(), CommError> {
        self.send(to, KIND_ACTIVATIONS, &f32s_to_bytes(x), "send_activations")
    }

    /// Receives hidden states from pipeline stage `from`.
    pub fn recv_activations(&self, from: usize) -> Result<Vec<f32>, CommError> {
        Ok(bytes_to_f32s(&self.recv(from, KIND_ACTIVATIONS, "recv_activations")?))
    }
}

impl Drop for TestTransport {
    fn drop(&mut self) {
        self.abort();
    }
}

fn f32s_to_bytes(x: &[f32]) -> Vec<u8> {
    x.iter().flat_map(|v| v.to_le_bytes()).collect()
}

fn bytes_to_f32s(b: &[u8]) -> Vec<f32> {
    b.chunks_exact(4).map(|c| f32::from_le_bytes(c.try_into().unwrap())).collect()
}

impl Collective for TestTransport {
    fn rank(&self) -> usize {
        self.rank
    }
    fn world(&self) -> usize {
        self.world
    }
    fn all_reduce_sum(&self, buf: &mut [f32]) -> Result<(), CommError> {
        if self.world == 1 {
            return Ok(());
        }
        let all = self.all_gather(&f32s_to_bytes(buf))?;
        if all.iter().any(|b| b.len() != buf.len() * 4) {
            return Err(err("all_reduce_sum", "ranks passed buffers of different lengths"));
        }
        // Sum in rank order on every rank: bit-identical everywhere.
        let vals: Vec<Vec<f32>> = all.iter().map(|b| bytes_to_f32s(b)).collect();
        for (i, out) in buf.iter_mut().enumerate() {
            let mut s = vals[0][i];
            for v in &vals[1..] {
                s += v[i];
            }
            *out = s;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn world(n: usize, addrs: Vec<String>) -> Vec<TestTransport> {
        let handles: Vec<_> = (0..n)
            .map(|r| {
                let a = addrs.clone();
                std::thread::spawn(move || TestTransport::join(r, b"w1", &a, Duration::from_secs(10), Duration::from_secs(5)).unwrap())
            })
            .collect();
        handles.into_iter().map(|h| h.join().unwrap()).collect()
    }

    fn unix_addrs(n: usize, tag: &str) -> Vec<String> {
        let dir = std::env::temp_dir().join(format!("mmx-tt-{tag}-{}", std::process::id()));
        (0..n).map(|r| format!("unix://{}/r{r}.sock", dir.display())).collect()
    }

    #[test]
    fn all_reduce_is_bit_identical_and_in_rank_order() {
        let ts = world(3, unix_addrs(3, "ar"));
        // Every rank keeps its transport until all are done: a rank that finishes first and
        // drops its transport closes its sockets, which (rightly) breaks the world for a rank
        // still sending (seen once on a loaded 2-core machine).
        let done = std::sync::Arc::new(std::sync::Barrier::new(ts.len()));
        let hs: Vec<_> = ts
            .into_iter()
            .map(|t| {
                let done = done.clone();
                std::thread::spawn(move || {
                    let mut b = vec![0.1f32 * (t.rank() + 1) as f32, 1e8, -1e8 + t.rank() as f32];
                    let r = t.all_reduce_sum(&mut b);
                    done.wait();
                    r.unwrap();
                    b
                })
            })
            .collect();
        let res: Vec<Vec<f32>> = hs.into_iter().map(|h| h.join().unwrap()).collect();
        let want0 = 0.1f32 + 0.2f32 + 0.3f32;
        for r in &res {
            assert_eq!(r[0].to_bits(), want0.to_bits());
            assert_eq!(r.iter().map(|v| v.to_bits()).collect::<Vec<_>>(), res[0].iter().map(|v| v.to_bits()).collect::<Vec<_>>());
        }
    }

    #[test]
    fn tcp_pipeline_and_dead_peer_is_an_error_not_a_hang() {
        let ports: Vec<String> = (0..2)
            .map(|_| {
                let l = TcpListener::bind("127.0.0.1:0").unwrap();
                l.local_addr().unwrap().to_string()
            })
            .collect();
        let mut ts = world(2, ports);
        let t1 = ts.pop().unwrap();
        let t0 = ts.pop().unwrap();
        t0.send_activations(1, &[1.0, 2.0]).unwrap();
        assert_eq!(t1.recv_activations(0).unwrap(), vec![1.0, 2.0]);
        drop(t1);
        let t = Instant::now();
        let e = t0.recv_activations(1).unwrap_err();
        assert!(t.elapsed() < Duration::from_secs(2), "{e}");
        assert!(e.to_string().contains("closed"), "{e}");
    }

    #[test]
    fn silent_peer_times_out() {
        let addrs = unix_addrs(2, "to");
        let hs: Vec<_> = (0..2)
            .map(|r| {
                let a = addrs.clone();
                std::thread::spawn(move || TestTransport::join(r, b"w", &a, Duration::from_secs(10), Duration::from_millis(300)).unwrap())
            })
            .collect();
        let ts: Vec<_> = hs.into_iter().map(|h| h.join().unwrap()).collect();
        let t = Instant::now();
        let e = ts[0].all_gather(b"x").unwrap_err();
        assert!(t.elapsed() < Duration::from_secs(2) && e.to_string().contains("nothing within"), "{e}");
    }

    #[test]
    fn join_gives_up_when_a_peer_never_comes() {
        let addrs = unix_addrs(2, "gu");
        let t = Instant::now();
        let e = TestTransport::join(1, b"w", &addrs, Duration::from_millis(300), Duration::from_secs(1)).err().unwrap();
        assert!(t.elapsed() < Duration::from_secs(2), "{e}");
    }
}
