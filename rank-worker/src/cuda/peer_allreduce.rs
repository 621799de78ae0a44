//! One-shot all-reduce (sum) of small f32 tensors over CUDA peer memory: the fast decode
//! path's tensor-parallel collectives (`nt x hidden` partials, `2 x nt` q/k sums of squares)
//! in one kernel launch (`tp_ar_oneshot`, kernels/tp.cu) instead of an `ncclAllReduce`.
//!
//! Each rank allocates one region with plain `cuMemAlloc` (epoch counters, barrier flags and
//! two halves of per-rank data slots); the regions are exchanged once, when the communicator
//! is built ([`PeerAllReduce::setup`], through an NCCL all-gather): ranks in other processes
//! open each other's region with `cuIpcOpenMemHandle`, ranks that are threads of one process
//! (the benchmark, the tests) use the raw pointer after `cuCtxEnablePeerAccess`. The kernel
//! pushes its partial into every peer's region, raises a flag there, waits for every peer's
//! flag in its own region and sums the world's partials in rank order, so every rank gets
//! bit-identical results. Epochs live in device memory (CUDA graph capture and replay work).
//!
//! Two kernels: `tp_ar_lamport` (default; data slots preset to a sentinel, readers wait on the
//! data itself) and `tp_ar_oneshot` (data, then a release flag per block).
//!
//! Switches: `MINIMAX_TP_ALLREDUCE=oneshot|nccl` (default oneshot), `MINIMAX_TP_ONESHOT=
//! lamport|flag` (default lamport), `MINIMAX_TP_ONESHOT_MAX`
//! (largest tensor in floats, default 131072 = 32 tokens x 4096), `MINIMAX_TP_ONESHOT_TIMEOUT_MS`
//! (how long a launch waits for a peer before it gives up, default 300000; 0 = forever).
//! Every rank must use the same settings; if they differ, or a peer's memory cannot be
//! reached, every rank falls back to NCCL (one log line says why).
//!
//! Dead peer: the waiting kernel polls a host-mapped abort word that [`PeerAllReduce::abort`]
//! sets (the rank's watcher calls it through `NcclAbort::abort`, next to `ncclCommAbort`), and
//! gives up by itself after the timeout; either way it records why in a second host-mapped
//! word ([`PeerAllReduce::failed`], read by `NcclAbort::is_aborted`), so the step is reported
//! as a broken world and the ranks are re-joined.

use std::ffi::c_void;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicU8, Ordering};

use cudarc::driver::{CudaContext, CudaStream, sys};

use super::error::CudaError;
use super::gpu::{Arg, Gpu};

/// Floats one block of the kernel handles (256 threads x float4); kernels/tp.cu `AR_CHUNK`.
pub const AR_CHUNK: usize = 1024;
/// Largest world the kernel supports; kernels/tp.cu `AR_MAXW`.
pub const AR_MAXW: usize = 8;
/// Bytes each rank contributes to the set-up all-gather.
pub(crate) const INFO_BYTES: usize = 256;
const MAGIC: &[u8; 8] = b"MMXPEER1";
const DEFAULT_MAX: usize = 32 * 4096;
const DEFAULT_TIMEOUT_MS: u64 = 300_000;

/// Which implementation the fast path's tensor-parallel all-reduces use.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ArMode {
    /// [`PeerAllReduce`] for tensors up to the size limit, NCCL above it.
    Oneshot,
    /// Always `ncclAllReduce`.
    Nccl,
}

/// `MINIMAX_TP_ALLREDUCE` (default oneshot; an unknown value is logged and ignored).
pub fn mode_from_env() -> ArMode {
    match std::env::var("MINIMAX_TP_ALLREDUCE").as_deref() {
        Ok("nccl") => ArMode::Nccl,
        Ok("oneshot") | Err(_) => ArMode::Oneshot,
        Ok(v) => {
            tracing::warn!("MINIMAX_TP_ALLREDUCE={v}: expected oneshot or nccl; using oneshot");
            ArMode::Oneshot
        }
    }
}

/// Which one-shot kernel runs (both exchange the same data and sum in rank order).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum OneshotKind {
    /// `tp_ar_lamport`: slots preset to a sentinel, readers wait on the data itself (no flags,
    /// no fences; one remote write on the critical path).
    Lamport,
    /// `tp_ar_oneshot`: data, then a release flag per block; readers wait on the flags.
    Flag,
}

static KIND: AtomicU8 = AtomicU8::new(0);

/// The kernel the one-shot path launches: `MINIMAX_TP_ONESHOT=lamport|flag` (default lamport)
/// unless [`set_oneshot_kind`] chose one.
pub fn oneshot_kind() -> OneshotKind {
    match KIND.load(Ordering::Relaxed) {
        1 => OneshotKind::Lamport,
        2 => OneshotKind::Flag,
        _ => {
            let k = match std::env::var("MINIMAX_TP_ONESHOT").as_deref() {
                Ok("flag") => OneshotKind::Flag,
                Ok("lamport") | Err(_) => OneshotKind::Lamport,
                Ok(v) => {
                    tracing::warn!("MINIMAX_TP_ONESHOT={v}: expected lamport or flag; using lamport");
                    OneshotKind::Lamport
                }
            };
            set_oneshot_kind(k);
            k
        }
    }
}

/// Benchmark A/B inside one process (same rules as [`set_force_nccl`]).
pub fn set_oneshot_kind(k: OneshotKind) {
    KIND.store(if k == OneshotKind::Lamport { 1 } else { 2 }, Ordering::SeqCst);
}

static FORCE_NCCL: AtomicBool = AtomicBool::new(false);
static CALLS: AtomicU64 = AtomicU64::new(0);

/// Benchmark A/B inside one process: route every all-reduce through NCCL (true) or let the
/// communicators that built a one-shot path use it (false). Every rank must switch between
/// the same two steps, and captured graphs must be dropped (`CudaModel::clear_graphs`).
pub fn set_force_nccl(on: bool) {
    FORCE_NCCL.store(on, Ordering::SeqCst);
}

/// Whether [`set_force_nccl`] is on.
pub fn force_nccl() -> bool {
    FORCE_NCCL.load(Ordering::Relaxed)
}

/// One-shot launches enqueued in this process so far (tests check that the path is used).
pub fn oneshot_calls() -> u64 {
    CALLS.load(Ordering::Relaxed)
}

fn env_usize(name: &str, default: u64) -> u64 {
    match std::env::var(name) {
        Ok(v) => v.trim().parse().unwrap_or_else(|_| {
            tracing::warn!("{name}={v}: not a number; using {default}");
            default
        }),
        Err(_) => default,
    }
}

fn drv(call: &'static str, r: sys::CUresult) -> Result<(), String> {
    r.result().map_err(|e| format!("{call}: {e:?}"))
}

/// This machine's boot id: ranks with the same pid on different hosts are not one process.
fn boot_id() -> [u8; 40] {
    let mut b = [0u8; 40];
    if let Ok(s) = std::fs::read_to_string("/proc/sys/kernel/random/boot_id") {
        let s = s.trim().as_bytes();
        let n = s.len().min(40);
        b[..n].copy_from_slice(&s[..n]);
    }
    b
}

/// What one rank tells the others at set-up (fixed little-endian layout, [`INFO_BYTES`]).
#[derive(Clone, Debug, PartialEq)]
struct Info {
    ok: bool,
    kind: u8,
    pid: u32,
    maxb: u32,
    timeout_ms: u64,
    ptr: u64,
    ipc: [u8; 64],
    bus: [u8; 32],
    boot: [u8; 40],
}

impl Info {
    fn encode(&self) -> [u8; INFO_BYTES] {
        let mut b = [0u8; INFO_BYTES];
        b[0..8].copy_from_slice(MAGIC);
        b[8] = self.ok as u8;
        b[9] = self.kind;
        b[12..16].copy_from_slice(&self.pid.to_le_bytes());
        b[16..20].copy_from_slice(&self.maxb.to_le_bytes());
        b[24..32].copy_from_slice(&self.timeout_ms.to_le_bytes());
        b[32..40].copy_from_slice(&self.ptr.to_le_bytes());
        b[40..104].copy_from_slice(&self.ipc);
        b[104..136].copy_from_slice(&self.bus);
        b[136..176].copy_from_slice(&self.boot);
        b
    }

    fn decode(b: &[u8]) -> Option<Self> {
        if b.len() != INFO_BYTES || &b[0..8] != MAGIC {
            return None;
        }
        let u32_at = |o: usize| u32::from_le_bytes(b[o..o + 4].try_into().unwrap());
        let u64_at = |o: usize| u64::from_le_bytes(b[o..o + 8].try_into().unwrap());
        Some(Self {
            ok: b[8] == 1,
            kind: b[9],
            pid: u32_at(12),
            maxb: u32_at(16),
            timeout_ms: u64_at(24),
            ptr: u64_at(32),
            ipc: b[40..104].try_into().unwrap(),
            bus: b[104..136].try_into().unwrap(),
            boot: b[136..176].try_into().unwrap(),
        })
    }
}

/// Offset of the Lamport kernel's part of a region (kernels/tp.cu's layout: the flag
/// kernel's epochs, flags and two halves of `world` data slots per block come first).
pub fn lamport_offset(maxb: usize, world: usize) -> usize {
    let data_off = (4 * maxb * (1 + world)).next_multiple_of(256);
    data_off + maxb * 2 * world * AR_CHUNK * 4
}

/// Offset of the Lamport kernel's data slots (after its epochs).
fn lamport_data(maxb: usize, world: usize) -> usize {
    lamport_offset(maxb, world) + (4 * maxb).next_multiple_of(256)
}

/// Bytes of one rank's region for `maxb` blocks and `world` ranks: the flag kernel's part,
/// then the Lamport kernel's epochs and three buffers of `world` data slots per block.
pub fn region_bytes(maxb: usize, world: usize) -> usize {
    lamport_data(maxb, world) + maxb * 3 * world * AR_CHUNK * 4
}

/// One rank's one-shot all-reduce: its own region, the world's regions as this device sees
/// them, and the host-mapped abort/failure words.
pub struct PeerAllReduce {
    ctx: Arc<CudaContext>,
    stream: Arc<CudaStream>,
    rank: usize,
    world: usize,
    maxb: usize,
    timeout_ns: u64,
    own: sys::CUdeviceptr,
    peers: [u64; AR_MAXW],
    ipc_opened: Vec<sys::CUdeviceptr>,
    retained: Vec<sys::CUdevice>,
    /// Host-mapped pinned words: [0] abort (host writes), [1] failure (kernel writes).
    ctl: *mut u32,
    ctl_dev: u64,
    how: &'static str,
    launches: AtomicU64,
}

// SAFETY: the raw pointers are device/pinned allocations owned by this value; the host words
// are only accessed with volatile single-word reads and writes.
unsafe impl Send for PeerAllReduce {}
unsafe impl Sync for PeerAllReduce {}

/// What a failed local set-up step leaves behind (freed by `Drop` of the partial value).
type Local = Result<(), String>;

/// The set-up all-gather: this rank's [`INFO_BYTES`] in, every rank's (rank order) out.
pub(crate) type Gather<'a> = dyn Fn(&[u8]) -> Result<Vec<u8>, CudaError> + 'a;

impl PeerAllReduce {
    /// Builds the one-shot path for `rank` of `world`, or returns None (NCCL only) when it is
    /// switched off, the world is too large, the ranks' settings differ or any rank cannot
    /// reach a peer's memory. `gather` is an all-gather of [`INFO_BYTES`] per rank and `agree`
    /// returns whether every rank passed true; both are collectives every rank calls exactly
    /// once, in this order, whatever happens locally (so the ranks never disagree).
    pub(crate) fn setup(
        ctx: &Arc<CudaContext>,
        stream: &Arc<CudaStream>,
        rank: usize,
        world: usize,
        gather: &Gather,
        agree: &dyn Fn(bool) -> Result<bool, CudaError>,
    ) -> Result<Option<Self>, CudaError> {
        let want = mode_from_env() == ArMode::Oneshot && (2..=AR_MAXW).contains(&world);
        let max = env_usize("MINIMAX_TP_ONESHOT_MAX", DEFAULT_MAX as u64).clamp(1, 1 << 24) as usize;
        let timeout_ms = env_usize("MINIMAX_TP_ONESHOT_TIMEOUT_MS", DEFAULT_TIMEOUT_MS);
        let mut me = Self {
            ctx: ctx.clone(),
            stream: stream.clone(),
            rank,
            world,
            maxb: max.div_ceil(AR_CHUNK),
            timeout_ns: timeout_ms.saturating_mul(1_000_000),
            own: 0,
            peers: [0; AR_MAXW],
            ipc_opened: Vec::new(),
            retained: Vec::new(),
            ctl: std::ptr::null_mut(),
            ctl_dev: 0,
            how: "",
            launches: AtomicU64::new(0),
        };
        let kind = if oneshot_kind() == OneshotKind::Lamport { 1 } else { 2 };
        let mut info = Info { ok: false, kind, pid: std::process::id(), maxb: me.maxb as u32, timeout_ms, ptr: 0, ipc: [0; 64], bus: [0; 32], boot: boot_id() };
        let local = if want { me.alloc(&mut info) } else { Err("MINIMAX_TP_ALLREDUCE=nccl".into()) };
        info.ok = local.is_ok();
        let all = gather(&info.encode())?;
        let infos: Vec<Option<Info>> = all.chunks(INFO_BYTES).map(Info::decode).collect();
        let why = match (&local, infos.len() == world) {
            (Err(e), _) => Some(format!("rank {rank}: {e}")),
            (_, false) => Some(format!("all-gather returned {} entries for a world of {world}", infos.len())),
            _ => me.open(&info, &infos).err(),
        };
        let ok = agree(why.is_none())?;
        if !ok {
            if want {
                let why = why.unwrap_or_else(|| "another rank cannot use it".into());
                tracing::warn!(rank, world, "one-shot all-reduce off, NCCL for every all-reduce: {why}");
            }
            return Ok(None);
        }
        tracing::info!(rank, world, via = me.how, max_floats = me.max_floats(), timeout_ms, "one-shot all-reduce over peer memory on");
        Ok(Some(me))
    }

    /// Allocates and zeroes this rank's region and the host words; fills `info`.
    fn alloc(&mut self, info: &mut Info) -> Local {
        self.ctx.bind_to_thread().map_err(|e| format!("bind: {e:?}"))?;
        let bytes = region_bytes(self.maxb, self.world);
        unsafe {
            drv("cuMemAlloc", sys::cuMemAlloc_v2(&mut self.own, bytes))?;
            drv("cuMemsetD8Async", sys::cuMemsetD8Async(self.own, 0, bytes, self.stream.cu_stream()))?;
            // The Lamport slots start as the sentinel (all bits set).
            let ld = lamport_data(self.maxb, self.world);
            drv("cuMemsetD8Async", sys::cuMemsetD8Async(self.own + ld as u64, 0xff, bytes - ld, self.stream.cu_stream()))?;
            let mut h: *mut c_void = std::ptr::null_mut();
            drv("cuMemHostAlloc", sys::cuMemHostAlloc(&mut h, 8, sys::CU_MEMHOSTALLOC_DEVICEMAP | sys::CU_MEMHOSTALLOC_PORTABLE))?;
            self.ctl = h as *mut u32;
            std::ptr::write_volatile(self.ctl, 0);
            std::ptr::write_volatile(self.ctl.add(1), 0);
            drv("cuMemHostGetDevicePointer", sys::cuMemHostGetDevicePointer_v2(&mut self.ctl_dev, h, 0))?;
            let mut ipc: sys::CUipcMemHandle = std::mem::zeroed();
            drv("cuIpcGetMemHandle", sys::cuIpcGetMemHandle(&mut ipc, self.own))?;
            for (d, &s) in info.ipc.iter_mut().zip(ipc.reserved.iter()) {
                *d = s as u8;
            }
            let mut bus = [0 as std::ffi::c_char; 32];
            drv("cuDeviceGetPCIBusId", sys::cuDeviceGetPCIBusId(bus.as_mut_ptr(), 31, self.ctx.cu_device()))?;
            for (d, &s) in info.bus.iter_mut().zip(bus.iter()) {
                *d = s as u8;
            }
        }
        info.ptr = self.own;
        Ok(())
    }

    /// Maps every peer's region into this device's address space.
    fn open(&mut self, mine: &Info, infos: &[Option<Info>]) -> Local {
        self.ctx.bind_to_thread().map_err(|e| format!("bind: {e:?}"))?;
        let mut how = "peer";
        for (w, inf) in infos.iter().enumerate() {
            let inf = inf.as_ref().ok_or_else(|| format!("rank {w} sent no peer-memory info"))?;
            if !inf.ok {
                return Err(format!("rank {w} has no one-shot region"));
            }
            if inf.maxb != mine.maxb || inf.timeout_ms != mine.timeout_ms || inf.kind != mine.kind {
                return Err(format!("rank {w} has other settings (MINIMAX_TP_ONESHOT, _MAX or _TIMEOUT_MS differ)"));
            }
            if w == self.rank {
                self.peers[w] = self.own;
                continue;
            }
            if inf.boot != mine.boot {
                return Err(format!("rank {w} runs on another host"));
            }
            let mut dev: sys::CUdevice = 0;
            let bus = inf.bus;
            unsafe {
                drv("cuDeviceGetByPCIBusId (the peer's GPU must be visible to this process)", sys::cuDeviceGetByPCIBusId(&mut dev, bus.as_ptr() as *const std::ffi::c_char))?;
                let mut can = 0;
                drv("cuDeviceCanAccessPeer", sys::cuDeviceCanAccessPeer(&mut can, self.ctx.cu_device(), dev))?;
                if can == 0 {
                    return Err(format!("this GPU cannot access rank {w}'s GPU (cuDeviceCanAccessPeer)"));
                }
                if inf.pid == mine.pid {
                    // Same process: the raw pointer is valid here once peer access is on.
                    let mut pctx: sys::CUcontext = std::ptr::null_mut();
                    drv("cuDevicePrimaryCtxRetain", sys::cuDevicePrimaryCtxRetain(&mut pctx, dev))?;
                    self.retained.push(dev);
                    let r = sys::cuCtxEnablePeerAccess(pctx, 0);
                    if r != sys::CUresult::CUDA_SUCCESS && r != sys::CUresult::CUDA_ERROR_PEER_ACCESS_ALREADY_ENABLED {
                        return Err(format!("cuCtxEnablePeerAccess: {r:?}"));
                    }
                    self.peers[w] = inf.ptr;
                } else {
                    let mut h: sys::CUipcMemHandle = std::mem::zeroed();
                    for (d, &s) in h.reserved.iter_mut().zip(inf.ipc.iter()) {
                        *d = s as std::ffi::c_char;
                    }
                    let mut p: sys::CUdeviceptr = 0;
                    drv("cuIpcOpenMemHandle", sys::cuIpcOpenMemHandle_v2(&mut p, h, sys::CUipcMem_flags::CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS as u32))?;
                    self.ipc_opened.push(p);
                    self.peers[w] = p;
                    how = "ipc";
                }
            }
        }
        self.how = how;
        Ok(())
    }

    /// Largest tensor (floats) the one-shot path takes; NCCL above.
    pub fn max_floats(&self) -> usize {
        self.maxb * AR_CHUNK
    }

    /// Launches this rank enqueued (graph replays not counted).
    pub fn launches(&self) -> u64 {
        self.launches.load(Ordering::Relaxed)
    }

    /// "ipc" (rank processes) or "peer" (ranks in one process).
    pub fn via(&self) -> &'static str {
        self.how
    }

    /// Whether a tensor of `n` floats goes through the one-shot kernel (the same answer on
    /// every rank: it depends only on `n` and the agreed limit).
    pub fn fits(&self, n: usize) -> bool {
        n >= 1 && n <= self.max_floats()
    }

    /// Enqueues the in-place sum of `n` f32 at `ptr` (this device) on `g`'s stream, which
    /// must be the communicator's stream; also inside a CUDA graph capture.
    pub fn launch(&self, g: &Gpu, ptr: u64, n: usize) -> Result<(), CudaError> {
        if !self.fits(n) {
            return Err(CudaError::Shape(format!("one-shot all-reduce of {n} floats (1..={})", self.max_floats())));
        }
        if g.stream.cu_stream() != self.stream.cu_stream() {
            return Err(CudaError::Shape("one-shot all-reduce enqueued on another stream than its communicator's".into()));
        }
        let p = &self.peers;
        let args = [
            Arg::P(ptr),
            Arg::I(n as i32),
            Arg::I(self.rank as i32),
            Arg::I(self.world as i32),
            Arg::I(self.maxb as i32),
            Arg::P(p[0]),
            Arg::P(p[1]),
            Arg::P(p[2]),
            Arg::P(p[3]),
            Arg::P(p[4]),
            Arg::P(p[5]),
            Arg::P(p[6]),
            Arg::P(p[7]),
            Arg::P(self.ctl_dev),
            Arg::P(self.timeout_ns),
        ];
        let name = if oneshot_kind() == OneshotKind::Lamport { "tp_ar_lamport" } else { "tp_ar_oneshot" };
        g.launch_pdl(name, (n.div_ceil(AR_CHUNK) as u32, 1, 1), 256, 0, &args)?;
        CALLS.fetch_add(1, Ordering::Relaxed);
        self.launches.fetch_add(1, Ordering::Relaxed);
        Ok(())
    }

    /// Releases every launch waiting on a peer (they return without writing; see
    /// [`PeerAllReduce::failed`]). Safe from any thread, at any time.
    pub fn abort(&self) {
        if !self.ctl.is_null() {
            // SAFETY: pinned host word owned by self; volatile so the write is not elided.
            unsafe { std::ptr::write_volatile(self.ctl, 1) };
        }
    }

    /// 0 while healthy; 1 = a launch gave up after an abort, 2 = a launch timed out waiting
    /// for a peer (its results, and every later step's, are garbage).
    pub fn failed(&self) -> u32 {
        if self.ctl.is_null() {
            return 0;
        }
        // SAFETY: pinned host word owned by self, written by the device.
        unsafe { std::ptr::read_volatile(self.ctl.add(1)) }
    }
}

impl Drop for PeerAllReduce {
    fn drop(&mut self) {
        // A launch still waiting on a dead peer would keep the stream busy forever: release
        // it, let the stream drain, then unmap and free. (A healthy world has nothing pending:
        // every launch pushes its data and flags before it waits, so peers never wait on a
        // rank that is dropping.)
        self.abort();
        let _ = self.ctx.bind_to_thread();
        let _ = self.stream.synchronize();
        unsafe {
            for &p in &self.ipc_opened {
                let _ = sys::cuIpcCloseMemHandle(p);
            }
            if self.own != 0 {
                let _ = sys::cuMemFree_v2(self.own);
            }
            if !self.ctl.is_null() {
                let _ = sys::cuMemFreeHost(self.ctl as *mut c_void);
            }
            for &d in &self.retained {
                let _ = sys::cuDevicePrimaryCtxRelease_v2(d);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn info_round_trips_and_rejects_garbage() {
        let i = Info { ok: true, kind: 1, pid: 4242, maxb: 128, timeout_ms: 300_000, ptr: 0x7f00_1234_5600, ipc: [7; 64], bus: [b'0'; 32], boot: [b'a'; 40] };
        assert_eq!(Info::decode(&i.encode()), Some(i.clone()));
        let mut bad = i.encode();
        bad[0] = b'X';
        assert_eq!(Info::decode(&bad), None);
        assert_eq!(Info::decode(&bad[..100]), None);
    }

    #[test]
    fn region_layout_matches_the_kernel() {
        // kernels/tp.cu: data_off = (4 maxb (1 + world) + 255) & ~255.
        assert_eq!(lamport_offset(3, 2), 256 + 3 * 2 * 2 * AR_CHUNK * 4);
        assert_eq!(lamport_offset(128, 8), (4 * 128 * 9usize).next_multiple_of(256) + 128 * 2 * 8 * AR_CHUNK * 4);
        // tp_ar_lamport: ldata = lam_off + ((4 maxb + 255) & ~255), three buffers after it.
        assert_eq!(region_bytes(3, 2), lamport_offset(3, 2) + 256 + 3 * 3 * 2 * AR_CHUNK * 4);
        assert_eq!(region_bytes(128, 8), lamport_offset(128, 8) + 512 + 128 * 3 * 8 * AR_CHUNK * 4);
    }
}
