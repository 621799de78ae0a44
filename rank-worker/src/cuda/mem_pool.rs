//! The stream-ordered allocator's pool. Every per-step buffer comes from `cuMemAllocAsync` on the
//! device's default memory pool, whose release threshold is 0 by default: at each
//! synchronization (every step ends with one) CUDA hands the pool's free memory back to the
//! driver, so the next prefill step maps its workspace again. Keeping it (threshold u64::MAX,
//! as caching allocators do) is opt-in: `minimax-bench --pool-ab` measured under 1 % on prefill
//! steps of an H200, for memory held at its high-water mark.

use cudarc::driver::sys;

use super::env_flag::EnvFlag;
use super::error::CudaError;
use super::gpu::Gpu;

/// `MINIMAX_POOL_KEEP=1`: the default pool keeps what it reserved across synchronizations
/// (read when a `Gpu` opens its device).
pub static POOL_KEEP: EnvFlag = EnvFlag::new("MINIMAX_POOL_KEEP", false);

impl Gpu {
    /// The device's default memory pool (the one `cuMemAllocAsync` on our stream uses).
    fn default_pool(&self) -> Result<sys::CUmemoryPool, CudaError> {
        self.ctx.bind_to_thread()?;
        let mut pool: sys::CUmemoryPool = std::ptr::null_mut();
        unsafe { sys::cuDeviceGetDefaultMemPool(&mut pool, self.ctx.cu_device()) }.result()?;
        Ok(pool)
    }

    /// Whether the default pool keeps freed memory across synchronizations (`true`: release
    /// threshold u64::MAX) or hands it back at each one (`false`, CUDA's default; the pool is
    /// trimmed at once).
    pub fn set_pool_keep(&self, keep: bool) -> Result<(), CudaError> {
        let pool = self.default_pool()?;
        let mut threshold: u64 = if keep { u64::MAX } else { 0 };
        unsafe {
            sys::cuMemPoolSetAttribute(pool, sys::CUmemPool_attribute::CU_MEMPOOL_ATTR_RELEASE_THRESHOLD, &mut threshold as *mut u64 as *mut std::ffi::c_void)
        }
        .result()?;
        if !keep {
            self.sync()?;
            unsafe { sys::cuMemPoolTrimTo(pool, 0) }.result()?;
        }
        Ok(())
    }

    /// Bytes the default pool holds from the driver now and at its high-water mark.
    pub fn pool_reserved(&self) -> Result<(u64, u64), CudaError> {
        let pool = self.default_pool()?;
        let get = |attr| -> Result<u64, CudaError> {
            let mut v: u64 = 0;
            unsafe { sys::cuMemPoolGetAttribute(pool, attr, &mut v as *mut u64 as *mut std::ffi::c_void) }.result()?;
            Ok(v)
        };
        Ok((get(sys::CUmemPool_attribute::CU_MEMPOOL_ATTR_RESERVED_MEM_CURRENT)?, get(sys::CUmemPool_attribute::CU_MEMPOOL_ATTR_RESERVED_MEM_HIGH)?))
    }
}
