//! NCCL communicators for CUDA worlds (one rank process per GPU). Rank 0 makes the NCCL
//! unique id at CREATE ([`unique_id`]); every rank builds its communicator from it at JOIN
//! ([`NcclComm::join`]) on its model's stream, so collectives are ordered with the kernels of
//! a step. NVLink multicast (NVLS) stays off: `NCCL_NVLS_ENABLE=0` is set before the
//! communicator is built unless the environment already says otherwise.
//!
//! Failure: an NCCL kernel whose peer died spins on the GPU forever, and the host thread of
//! the step waits behind it (stream sync or a device-to-host copy). Death is detected outside
//! NCCL (the rank's watcher sees the test transport's sockets close, or a step outlives its
//! deadline) and the watcher calls [`NcclAbort::abort`] from another thread:
//! `ncclCommAbort` sets the communicator's abort flag, which NCCL's kernels poll, so the
//! blocked collective returns; every later call on this communicator is refused with
//! [`CudaError::Nccl`] ("communicator aborted: ...") instead of touching freed memory. A new
//! JOIN builds a fresh communicator from a fresh unique id.
//!
//! Small all-reduces of the fast decode path: [`NcclComm::all_reduce_sum_dev`] takes the
//! one-shot peer-memory kernel ([`super::peer_allreduce`]) built at JOIN when every rank could
//! build it, NCCL otherwise and for large tensors. The abort also releases a one-shot launch
//! waiting on a dead peer, and a launch that timed out marks the communicator aborted.

use std::sync::atomic::{AtomicU8, Ordering};
use std::sync::{Arc, Mutex, OnceLock, Weak};
use std::time::{Duration, Instant};

use cudarc::driver::{CudaContext, CudaStream, DevicePtr, DevicePtrMut};
use cudarc::nccl::{result, sys};

use super::error::CudaError;
use super::gpu::Gpu;
use super::peer_allreduce::{INFO_BYTES, PeerAllReduce};

/// Bytes of an NCCL unique id (`ncclUniqueId`).
pub const NCCL_ID_BYTES: usize = 128;

const HINT: &str = "libnccl.so (NCCL 2.28) must be on the loader path (e.g. a libnccl.so link to the \
                    nvidia-nccl package's libnccl.so.2 in a directory named by LD_LIBRARY_PATH)";

/// How long an abort waits for a collective that is being enqueued right now before it
/// aborts anyway (an enqueue only blocks when the GPU's launch queue is full behind a hung
/// collective, which only the abort can free).
const ABORT_WAIT: Duration = Duration::from_secs(2);

fn nccl_err(call: &'static str, e: result::NcclError) -> CudaError {
    CudaError::Nccl { call, detail: format!("{e:?}") }
}

fn ensure_lib() -> Result<(), CudaError> {
    // cudarc panics if the library is missing; check first so the caller gets an error.
    if unsafe { sys::is_culib_present() } {
        Ok(())
    } else {
        Err(CudaError::LibraryMissing { lib: "libnccl", hint: HINT })
    }
}

fn nvls_off() {
    if std::env::var_os("NCCL_NVLS_ENABLE").is_none() {
        // SAFETY: set once, before NCCL reads its environment; the rank sets no other
        // variables concurrently.
        unsafe { std::env::set_var("NCCL_NVLS_ENABLE", "0") };
    }
}

/// A fresh NCCL unique id (rank 0, at CREATE). Starts NCCL's bootstrap listener in this
/// process.
pub fn unique_id() -> Result<Vec<u8>, CudaError> {
    ensure_lib()?;
    nvls_off();
    let id = result::get_uniqueid().map_err(|e| nccl_err("ncclGetUniqueId", e))?;
    Ok(id.internal.iter().map(|&c| c as u8).collect())
}

const LIVE: u8 = 0;
const ABORTING: u8 = 1;
const FREED: u8 = 2;

/// The raw communicator and whether it may still be used.
struct Cell {
    comm: sys::ncclComm_t,
    ctx: Arc<CudaContext>,
    state: AtomicU8,
    /// Held while a call is enqueued, so an abort never frees the communicator under it.
    calls: Mutex<()>,
    why: Mutex<String>,
    /// The one-shot all-reduce over peer memory (set at JOIN when every rank built it).
    peer: OnceLock<PeerAllReduce>,
}

// SAFETY: `comm` is only passed to NCCL under `calls` (or by the abort, which NCCL allows
// from another thread); the state machine makes sure it is freed exactly once.
unsafe impl Send for Cell {}
unsafe impl Sync for Cell {}

impl Cell {
    /// Runs one NCCL enqueue unless the communicator was aborted.
    fn call(&self, name: &'static str, f: impl FnOnce(sys::ncclComm_t) -> Result<result::NcclStatus, result::NcclError>) -> Result<(), CudaError> {
        let _held = self.calls.lock().unwrap_or_else(|e| e.into_inner());
        if self.state.load(Ordering::Acquire) != LIVE {
            return Err(self.aborted_err(name));
        }
        self.ctx.bind_to_thread()?;
        f(self.comm).map_err(|e| nccl_err(name, e))?;
        Ok(())
    }

    fn aborted_err(&self, call: &'static str) -> CudaError {
        CudaError::Nccl { call, detail: format!("communicator aborted: {}", self.why.lock().unwrap_or_else(|e| e.into_inner())) }
    }

    /// `ncclCommAbort` once; later calls return false.
    fn abort(&self, why: &str) -> bool {
        if self.state.compare_exchange(LIVE, ABORTING, Ordering::AcqRel, Ordering::Acquire).is_err() {
            return false;
        }
        *self.why.lock().unwrap_or_else(|e| e.into_inner()) = why.to_string();
        // A one-shot launch waiting on a dead peer polls this word: release it first.
        if let Some(p) = self.peer.get() {
            p.abort();
        }
        // Normally no call is in flight (the step waits in a stream sync, not in NCCL).
        let deadline = Instant::now() + ABORT_WAIT;
        let held = loop {
            match self.calls.try_lock() {
                Ok(g) => break Some(g),
                Err(std::sync::TryLockError::Poisoned(p)) => break Some(p.into_inner()),
                Err(std::sync::TryLockError::WouldBlock) if Instant::now() < deadline => std::thread::sleep(Duration::from_millis(5)),
                Err(std::sync::TryLockError::WouldBlock) => break None,
            }
        };
        if held.is_none() {
            tracing::warn!("aborting the NCCL communicator while a call is being enqueued (it is blocked behind the hung collective)");
        }
        let _ = self.ctx.bind_to_thread();
        let t0 = Instant::now();
        // SAFETY: the communicator is live (state machine above) and never used after this.
        let res = unsafe { result::comm_abort(self.comm) };
        self.state.store(FREED, Ordering::Release);
        drop(held);
        match res {
            Ok(_) => tracing::warn!("NCCL communicator aborted in {:.0} ms: {why}", t0.elapsed().as_secs_f64() * 1e3),
            Err(e) => tracing::error!("ncclCommAbort: {e:?} ({why})"),
        }
        true
    }
}

impl Drop for Cell {
    fn drop(&mut self) {
        // Abort rather than destroy: ncclCommDestroy waits for outstanding work, which may
        // never finish when a peer is gone.
        if *self.state.get_mut() == LIVE {
            let _ = self.ctx.bind_to_thread();
            // SAFETY: last owner; the communicator is live and used by nobody else.
            unsafe {
                let _ = result::comm_abort(self.comm);
            }
        }
    }
}

/// Aborts a communicator from another thread (the rank's watcher) without owning it.
#[derive(Clone)]
pub struct NcclAbort(Weak<Cell>);

impl NcclAbort {
    /// Aborts the communicator (if it still exists and is live) so a collective blocked on a
    /// dead peer returns; returns whether this call did it. May take a moment: call it off
    /// the async runtime.
    pub fn abort(&self, why: &str) -> bool {
        self.0.upgrade().is_some_and(|c| c.abort(why))
    }

    /// Whether the communicator was aborted (or is gone): results of the step that was
    /// running are garbage.
    pub fn is_aborted(&self) -> bool {
        self.0.upgrade().is_none_or(|c| c.state.load(Ordering::Acquire) != LIVE || c.peer.get().is_some_and(|p| p.failed() != 0))
    }
}

/// One rank's communicator, bound to its model's stream.
pub struct NcclComm {
    cell: Arc<Cell>,
    stream: Arc<CudaStream>,
    rank: usize,
    world: usize,
}

impl NcclComm {
    /// Joins the world: blocks until all `world` ranks have called it with the same id, then
    /// checks the communicator with one all-reduce of `rank + 1` (which also makes NCCL
    /// connect its peers now rather than inside the first step). `oneshot`: also build the
    /// one-shot peer-memory all-reduce (tensor-parallel worlds; pipeline stages never
    /// all-reduce). Every rank must pass the same `oneshot`: its set-up is two collectives.
    pub fn join(ctx: &Arc<CudaContext>, stream: &Arc<CudaStream>, rank: usize, world: usize, id: &[u8], oneshot: bool) -> Result<Self, CudaError> {
        ensure_lib()?;
        nvls_off();
        if id.len() != NCCL_ID_BYTES {
            return Err(CudaError::Shape(format!("NCCL unique id of {} bytes, expected {NCCL_ID_BYTES}", id.len())));
        }
        if rank >= world {
            return Err(CudaError::Shape(format!("NCCL rank {rank} outside world {world}")));
        }
        let mut uid = sys::ncclUniqueId { internal: [0; NCCL_ID_BYTES] };
        for (d, &s) in uid.internal.iter_mut().zip(id) {
            *d = s as core::ffi::c_char;
        }
        ctx.bind_to_thread()?;
        let mut raw: sys::ncclComm_t = std::ptr::null_mut();
        // SAFETY: `raw` is a valid out pointer; the id is the one rank 0 made.
        unsafe { result::comm_init_rank(&mut raw, world as i32, uid, rank as i32) }.map_err(|e| nccl_err("ncclCommInitRank", e))?;
        let comm = Self {
            cell: Arc::new(Cell {
                comm: raw,
                ctx: ctx.clone(),
                state: AtomicU8::new(LIVE),
                calls: Mutex::new(()),
                why: Mutex::new(String::new()),
                peer: OnceLock::new(),
            }),
            stream: stream.clone(),
            rank,
            world,
        };
        let mut probe = stream.clone_htod(&[rank as f32 + 1.0])?;
        comm.all_reduce_sum(&mut probe)?;
        let got = stream.clone_dtoh(&probe)?[0];
        let want = (world * (world + 1) / 2) as f32;
        if got != want {
            return Err(CudaError::Nccl { call: "ncclAllReduce", detail: format!("self-test sum {got}, expected {want}") });
        }
        // The one-shot path: every rank takes part in its two set-up collectives.
        let gather = |mine: &[u8]| comm.all_gather_bytes(mine);
        let agree = |ok: bool| -> Result<bool, CudaError> {
            let mut b = stream.clone_htod(&[if ok { 1.0f32 } else { 0.0 }])?;
            comm.all_reduce_sum(&mut b)?;
            Ok(stream.clone_dtoh(&b)?[0] == world as f32)
        };
        if oneshot && let Some(p) = PeerAllReduce::setup(ctx, stream, rank, world, &gather, &agree)? {
            let _ = comm.cell.peer.set(p);
        }
        Ok(comm)
    }

    /// All-gather of `mine` (the same length on every rank) in rank order; blocking.
    fn all_gather_bytes(&self, mine: &[u8]) -> Result<Vec<u8>, CudaError> {
        if mine.len() != INFO_BYTES {
            return Err(CudaError::Shape(format!("all-gather of {} bytes, expected {INFO_BYTES}", mine.len())));
        }
        let send = self.stream.clone_htod(mine)?;
        let mut recv = self.stream.alloc_zeros::<u8>(mine.len() * self.world)?;
        {
            let (sp, _rs) = send.device_ptr(&self.stream);
            let (rp, _rr) = recv.device_ptr_mut(&self.stream);
            let s = self.stream.cu_stream();
            self.cell.call("ncclAllGather", |c| unsafe {
                // SAFETY: `sp` holds `mine.len()` bytes and `rp` world times that, on this device.
                result::all_gather(sp as _, rp as _, mine.len(), sys::ncclDataType_t::ncclUint8, c, s as _)
            })?;
        }
        Ok(self.stream.clone_dtoh(&recv)?)
    }

    /// The one-shot peer-memory all-reduce, when every rank built it at JOIN.
    pub fn oneshot(&self) -> Option<&PeerAllReduce> {
        self.cell.peer.get()
    }

    /// In-place sum of `n` f32 at device address `ptr` over the world on `g`'s stream (the
    /// communicator's): the one-shot kernel when it is on and `n` fits (unless
    /// [`super::peer_allreduce::set_force_nccl`]), else `ncclAllReduce`. The choice depends
    /// only on `n` and settings every rank shares, so all ranks take the same path.
    pub fn all_reduce_sum_dev(&self, g: &Gpu, ptr: u64, n: usize) -> Result<(), CudaError> {
        match self.cell.peer.get() {
            Some(p) if p.fits(n) && !super::peer_allreduce::force_nccl() => {
                let _held = self.cell.calls.lock().unwrap_or_else(|e| e.into_inner());
                if self.cell.state.load(Ordering::Acquire) != LIVE {
                    return Err(self.cell.aborted_err("tp_ar_oneshot"));
                }
                p.launch(g, ptr, n)
            }
            _ => self.all_reduce_sum_raw(ptr, n),
        }
    }

    pub fn rank(&self) -> usize {
        self.rank
    }

    pub fn world(&self) -> usize {
        self.world
    }

    /// A handle the rank's watcher uses to abort this communicator from another thread.
    pub fn abort_handle(&self) -> NcclAbort {
        NcclAbort(Arc::downgrade(&self.cell))
    }

    /// In-place sum of `buf` over the world, enqueued on the model's stream.
    pub fn all_reduce_sum<R: DevicePtrMut<f32>>(&self, buf: &mut R) -> Result<(), CudaError> {
        let n = buf.len();
        let (p, _record) = buf.device_ptr_mut(&self.stream);
        let s = self.stream.cu_stream();
        self.cell.call("ncclAllReduce", |c| unsafe {
            // SAFETY: `p` is `n` f32 on this device, valid while `_record` lives.
            result::all_reduce(p as _, p as _, n, sys::ncclDataType_t::ncclFloat32, sys::ncclRedOp_t::ncclSum, c, s as _)
        })
    }

    /// In-place sum of `n` f32 at device address `ptr` over the world, enqueued on the model's
    /// stream (the fast path: sub-ranges of its workspace, also inside a CUDA graph capture).
    pub fn all_reduce_sum_raw(&self, ptr: u64, n: usize) -> Result<(), CudaError> {
        let s = self.stream.cu_stream();
        self.cell.call("ncclAllReduce", |c| unsafe {
            // SAFETY: the caller passes `n` f32 of device memory on this communicator's device.
            result::all_reduce(ptr as _, ptr as _, n, sys::ncclDataType_t::ncclFloat32, sys::ncclRedOp_t::ncclSum, c, s as _)
        })
    }

    /// Sends `buf` to rank `peer` (pipeline: a stage's hidden states to the next stage),
    /// enqueued on the model's stream; device to device, no host copy.
    pub fn send<S: DevicePtr<f32>>(&self, buf: &S, peer: usize) -> Result<(), CudaError> {
        let n = buf.len();
        let (p, _record) = buf.device_ptr(&self.stream);
        let s = self.stream.cu_stream();
        self.cell.call("ncclSend", |c| unsafe {
            // SAFETY: `p` is `n` f32 on this device, valid while `_record` lives.
            result::send(p as _, n, sys::ncclDataType_t::ncclFloat32, peer as i32, c, s as _)
        })
    }

    /// Receives `buf.len()` floats from rank `peer` into `buf`, enqueued on the model's stream.
    pub fn recv<R: DevicePtrMut<f32>>(&self, buf: &mut R, peer: usize) -> Result<(), CudaError> {
        let n = buf.len();
        let (p, _record) = buf.device_ptr_mut(&self.stream);
        let s = self.stream.cu_stream();
        self.cell.call("ncclRecv", |c| unsafe {
            // SAFETY: `p` is `n` f32 on this device, valid while `_record` lives.
            result::recv(p as _, n, sys::ncclDataType_t::ncclFloat32, peer as i32, c, s as _)
        })
    }
}
