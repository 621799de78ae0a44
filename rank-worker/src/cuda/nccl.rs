//! NCCL communicators for tensor-parallel CUDA worlds (one rank process per GPU). Rank 0
//! makes the NCCL unique id at CREATE ([`unique_id`]); every rank builds its communicator
//! from it at JOIN ([`NcclComm::join`]) on its model's stream, so collectives are ordered
//! with the kernels of a step. NVLink multicast (NVLS) stays off: `NCCL_NVLS_ENABLE=0` is set
//! before the communicator is built unless the environment already says otherwise.

use std::sync::Arc;

use cudarc::driver::{CudaContext, CudaSlice, CudaStream};
use cudarc::nccl::{Comm, Id, ReduceOp};

use super::error::CudaError;

/// Bytes of an NCCL unique id (`ncclUniqueId`).
pub const NCCL_ID_BYTES: usize = 128;

const HINT: &str = "libnccl.so (NCCL 2.28) must be on the loader path (e.g. a libnccl.so link to the \
                    nvidia-nccl package's libnccl.so.2 in a directory named by LD_LIBRARY_PATH)";

fn nccl_err(call: &'static str, e: cudarc::nccl::result::NcclError) -> CudaError {
    CudaError::Nccl { call, detail: format!("{e:?}") }
}

fn ensure_lib() -> Result<(), CudaError> {
    // cudarc panics if the library is missing; check first so the caller gets an error.
    if unsafe { cudarc::nccl::sys::is_culib_present() } {
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
    let id = Id::new().map_err(|e| nccl_err("ncclGetUniqueId", e))?;
    Ok(id.internal().iter().map(|&c| c as u8).collect())
}

/// One rank's communicator, bound to its model's stream.
pub struct NcclComm {
    comm: Comm,
    ctx: Arc<CudaContext>,
}

// SAFETY: the communicator is only used by the thread holding the engine lock (one step at a
// time); NCCL communicators may be used from any thread as long as calls are not concurrent.
unsafe impl Send for NcclComm {}
unsafe impl Sync for NcclComm {}

impl NcclComm {
    /// Joins the world: blocks until all `world` ranks have called it with the same id.
    pub fn join(ctx: &Arc<CudaContext>, stream: &Arc<CudaStream>, rank: usize, world: usize, id: &[u8]) -> Result<Self, CudaError> {
        ensure_lib()?;
        nvls_off();
        if id.len() != NCCL_ID_BYTES {
            return Err(CudaError::Shape(format!("NCCL unique id of {} bytes, expected {NCCL_ID_BYTES}", id.len())));
        }
        let mut internal = [0 as core::ffi::c_char; NCCL_ID_BYTES];
        for (d, &s) in internal.iter_mut().zip(id) {
            *d = s as core::ffi::c_char;
        }
        ctx.bind_to_thread()?;
        let comm = Comm::from_rank(stream.clone(), rank, world, Id::uninit(internal)).map_err(|e| nccl_err("ncclCommInitRank", e))?;
        Ok(Self { comm, ctx: ctx.clone() })
    }

    pub fn rank(&self) -> usize {
        self.comm.rank()
    }

    pub fn world(&self) -> usize {
        self.comm.world_size()
    }

    /// In-place sum of `buf` over the world, enqueued on the model's stream.
    pub fn all_reduce_sum(&self, buf: &mut CudaSlice<f32>) -> Result<(), CudaError> {
        self.ctx.bind_to_thread()?;
        self.comm.all_reduce_in_place(buf, &ReduceOp::Sum).map_err(|e| nccl_err("ncclAllReduce", e))?;
        Ok(())
    }
}
