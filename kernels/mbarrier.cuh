// mbarrier and bulk-copy helpers of the ring kernels (stream.cu, gstream.cu, fast_kq.cu's
// kq_mvs_*): a producer thread's cp.async.bulk global -> shared copies complete on an mbarrier
// (expect_tx + bytes); consumers wait on the phase parity. Prepended to the modules that use
// them (nvrtc.rs), after common.cuh.
//
// The PTX below exists from sm_90 on; below it the kernels compile to nothing useful and the
// host never launches them (the plans in stream.rs, gstream.rs and fast_kq.rs check the arch).
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
#define BK_PTX 1
#else
#define BK_PTX 0
#endif
__device__ __forceinline__ void bk_mb_init(u64* b, u32 count) {
#if BK_PTX
    asm volatile("mbarrier.init.shared.b64 [%0], %1;" ::"r"(smem_addr(b)), "r"(count) : "memory");
#endif
}
__device__ __forceinline__ void bk_mb_fence_init() {
#if BK_PTX
    asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
#endif
}
__device__ __forceinline__ void bk_mb_expect(u64* b, u32 bytes) {
#if BK_PTX
    u64 st;
    asm volatile("mbarrier.arrive.expect_tx.shared.b64 %0, [%1], %2;" : "=l"(st) : "r"(smem_addr(b)), "r"(bytes) : "memory");
#endif
}
__device__ __forceinline__ void bk_mb_arrive(u64* b) {
#if BK_PTX
    u64 st;
    asm volatile("mbarrier.arrive.shared.b64 %0, [%1];" : "=l"(st) : "r"(smem_addr(b)) : "memory");
#endif
}
__device__ __forceinline__ bool bk_mb_try(u64* b, u32 parity) {
    u32 ok = 1;
#if BK_PTX
    asm volatile(
        "{\n .reg .pred p;\n mbarrier.try_wait.parity.shared.b64 p, [%1], %2;\n selp.u32 %0, 1, 0, p;\n}"
        : "=r"(ok)
        : "r"(smem_addr(b)), "r"(parity)
        : "memory");
#endif
    return ok != 0;
}
// Waits until the phase of parity `parity` of *b has completed.
__device__ __forceinline__ void bk_mb_wait(u64* b, u32 parity) {
    while (!bk_mb_try(b, parity)) {
    }
}
// bk_mb_wait without spinning: try_wait with a suspend-time hint parks the thread until the
// phase completes (or the hint, 1 ms, runs out), so waiting warps do not take issue slots
// from the consumers (gstream.cu: spinning producer and epilogue warps were ~7% of a grouped
// gate/up's issues).
__device__ __forceinline__ void bk_mb_sleep(u64* b, u32 parity) {
    u32 ok = 1;
    do {
#if BK_PTX
        asm volatile(
            "{\n .reg .pred p;\n mbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2, %3;\n selp.u32 %0, 1, 0, p;\n}"
            : "=r"(ok)
            : "r"(smem_addr(b)), "r"(parity), "r"(1000000u)
            : "memory");
#endif
    } while (!ok);
}

// bytes (a multiple of 16, both addresses 16-byte aligned) from global to shared memory,
// counted on *b when they have landed.
__device__ __forceinline__ void bk_copy(void* dst, const void* src, u32 bytes, u64* b) {
#if BK_PTX
    asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];" ::"r"(
                     smem_addr(dst)),
                 "l"(src), "r"(bytes), "r"(smem_addr(b))
                 : "memory");
#endif
}
