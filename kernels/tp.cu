// Tensor parallelism: the full-width q/k RMSNorm when each rank holds a slice of the heads.
// Each rank sums the squares of its slice per token (tp_qk_sumsq), the world adds the sums
// (an all-reduce of 2 floats per token), then every rank scales its slice with the total
// (tp_qk_scale on the exact path; the fast path's qk_norm_rope_store_tp reads the sums itself).

// ss[2 t] = sum of squares of q row t (qw values), ss[2 t + 1] = of k row t (kw values), each
// accumulated in f64 and rounded to f32 once (the CPU backend's arithmetic). grid (nt, 2),
// block 256.
extern "C" __global__ void __launch_bounds__(256) tp_qk_sumsq(const float* q, i64 qs, const float* k, i64 ks, int qw,
                                                              int kw, float* ss) {
    __shared__ double part[8];
    int t = blockIdx.x;
    bool is_k = blockIdx.y == 1;
    const float* x = is_k ? k + t * ks : q + t * qs;
    int n = is_k ? kw : qw;
    double s = 0.0;
    for (int i = threadIdx.x; i < n; i += blockDim.x) {
        double v = (double)x[i];
        s += v * v;
    }
    s = warp_sum_d(s);
    int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    if (lane == 0) part[warp] = s;
    __syncthreads();
    if (threadIdx.x == 0) {
        double tot = 0.0;
        for (int w = 0; w < (int)(blockDim.x >> 5); w++) tot += part[w];
        ss[2 * t + (is_k ? 1 : 0)] = (float)tot;
    }
}

// In place: x[i] = x[i] * inv * w[i], inv = 1 / sqrt((float)(ss / n_full) + eps) with ss the
// world's sum of squares of the row (2 floats per token as tp_qk_sumsq writes them) and
// n_full the whole row's width (all heads). grid (nt, 2), block 256.
extern "C" __global__ void __launch_bounds__(256) tp_qk_scale(float* q, i64 qs, const float* qn, float* k, i64 ks,
                                                              const float* kn, int qw, int kw, const float* ss,
                                                              int q_full, int k_full, float eps) {
    int t = blockIdx.x;
    bool is_k = blockIdx.y == 1;
    float* x = is_k ? k + t * ks : q + t * qs;
    const float* w = is_k ? kn : qn;
    int n = is_k ? kw : qw;
    double full = (double)(is_k ? k_full : q_full);
    float mean = (float)((double)ss[2 * t + (is_k ? 1 : 0)] / full);
    float inv = 1.0f / sqrtf(__fadd_rn(mean, eps));
    for (int i = threadIdx.x; i < n; i += blockDim.x) x[i] = __fmul_rn(__fmul_rn(x[i], inv), w[i]);
}

// ---------------------------------------------------------------------------------------------
// One-shot all-reduce (sum) of a small f32 tensor over peer memory (NVLink / PCIe P2P), for
// the fast decode path's per-layer collectives (rank-worker/src/cuda/peer_allreduce.rs).
//
// Every rank owns one peer-visible region (cuMemAlloc, mapped into every other rank through
// CUDA IPC or, for ranks that are threads of one process, peer access):
//   [ep: maxb u32][flags: maxb x world u32][pad to 256 B][data: maxb x 2 x world x AR_CHUNK f32]
// Block b handles floats [b * AR_CHUNK, (b + 1) * AR_CHUNK) of the tensor. It
//   1. bumps its own epoch counter ep[b] (device memory, so a captured CUDA graph replays
//      correctly: no per-call host argument) and picks the data half by epoch parity;
//   2. pushes its slice of the local partial into slot `me` of that half in every peer's
//      region (remote stores), then, after the block's barrier, releases flag[b][me] = epoch
//      in every peer's region (system scope);
//   3. waits (acquire, system scope) until every peer's flag[b][peer] in its own region has
//      reached the epoch, then sums all ranks' slices **in rank order** (its own from
//      registers), so every rank computes bit-identical values, and writes them in place.
// Reaching epoch e at a peer means that peer finished epoch e - 1 (the previous launch on its
// stream), hence finished reading the half of parity e (epoch e - 2): one barrier a call.
// Blocks only wait for the same block index on the peers, never for each other.
// Dead peer: while waiting, every 1024 polls the block reads `ctl` (host-mapped memory: ctl[0]
// is set by the host to abort, `NcclAbort::abort`; ctl[1] by any block that gave up) and
// %globaltimer; on abort or after `timeout_ns` (0 = none) it sets ctl[1] (1 = aborted, 2 = timed
// out; the host reads it) and returns without writing: the step's results are garbage and the
// world must be re-joined. Later launches see ctl[1] after 1024 polls and return too.
// grid = ceil(n / AR_CHUNK) <= maxb, block 256; launched with PDL (starts with the wait).
#define AR_CHUNK 1024
#define AR_MAXW 8

__device__ __forceinline__ u32 ar_ld_acquire(const u32* p) {
    u32 v;
    asm volatile("ld.acquire.sys.global.u32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
    return v;
}
__device__ __forceinline__ void ar_st_release(u32* p, u32 v) {
    asm volatile("st.release.sys.global.u32 [%0], %1;" ::"l"(p), "r"(v) : "memory");
}
__device__ __forceinline__ u64 ar_clock_ns() {
    u64 t;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
    return t;
}

// Helpers of both one-shot kernels below.
// Programmatic dependent launch: wait for the previous kernel, let the next one be scheduled.
__device__ __forceinline__ void ar_pdl_enter() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    asm volatile("griddepcontrol.wait;" ::: "memory");
    asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
#endif
}
// pp[me] with constant indices only (pp stays in registers).
__device__ __forceinline__ u64 ar_pick(const u64* pp, int me) {
    u64 mine = 0;
#pragma unroll
    for (int w = 0; w < AR_MAXW; w++)
        if (w == me) mine = pp[w];
    return mine;
}
// Bumps the block's epoch counter *ep and returns the new epoch.
__device__ __forceinline__ u32 ar_next_epoch(u32* ep) {
    u32 e = *ep + 1;
    *ep = e;
    return e;
}
// This thread's four values x[i0 .. i0 + 4) (zeros past n; one 16-byte load when vec).
__device__ __forceinline__ float4 ar_load4(const float* x, int i0, int n, bool vec) {
    float4 v = make_float4(0.f, 0.f, 0.f, 0.f);
    if (vec) {
        v = *(const float4*)(x + i0);
    } else {
        if (i0 < n) v.x = x[i0];
        if (i0 + 1 < n) v.y = x[i0 + 1];
        if (i0 + 2 < n) v.z = x[i0 + 2];
        if (i0 + 3 < n) v.w = x[i0 + 3];
    }
    return v;
}
// Writes acc back where ar_load4 read (nothing past n).
__device__ __forceinline__ void ar_store4(float* x, int i0, int n, bool vec, float4 acc) {
    if (vec) {
        *(float4*)(x + i0) = acc;
    } else {
        if (i0 < n) x[i0] = acc.x;
        if (i0 + 1 < n) x[i0 + 1] = acc.y;
        if (i0 + 2 < n) x[i0 + 2] = acc.z;
        if (i0 + 3 < n) x[i0 + 3] = acc.w;
    }
}
// Rank w's slice T into the rank-order sum ACC (w == 0 starts it). A macro, as AR_POLL: an
// inline function here changes the kernels' integer code.
#define AR_SUM4(ACC, T, W)                       \
    if ((W) == 0) {                              \
        ACC = T;                                 \
    } else {                                     \
        ACC.x = __fadd_rn(ACC.x, T.x);           \
        ACC.y = __fadd_rn(ACC.y, T.y);           \
        ACC.z = __fadd_rn(ACC.z, T.z);           \
        ACC.w = __fadd_rn(ACC.w, T.w);           \
    }
// In a wait loop (poll counter `it`, t0: the first check's time, 0 before): every 1024th poll
// checks the abort flags and the timeout; on giving up records why in ctl[1] and runs
// ON_GIVE_UP (which leaves the loop). A macro, not a function: the spin loop's code stays as
// written (a function version costs tp_ar_oneshot 8 registers and tp_ar_lamport a spill).
#define AR_POLL(ON_GIVE_UP)                                                   \
    if ((it & 1023) == 0) {                                                   \
        u32 why = 0;                                                          \
        if (ctl[0] != 0 || ctl[1] != 0) why = 1;                              \
        u64 now = ar_clock_ns();                                              \
        if (t0 == 0) t0 = now;                                                \
        else if (timeout_ns != 0 && now - t0 > timeout_ns) why = 2;           \
        if (why != 0) {                                                       \
            if (ctl[1] == 0) ctl[1] = why;                                    \
            __threadfence_system();                                           \
            ON_GIVE_UP;                                                       \
        }                                                                     \
    }

// The start of both kernels (arguments p0 .. p7, me): PDL wait, then declares pp (the ranks'
// regions), the block's shared s_epoch / s_bad, b (block), tid and mine (this rank's region).
#define AR_BEGIN()                                                    \
    ar_pdl_enter();                                                   \
    const u64 pp[AR_MAXW] = {p0, p1, p2, p3, p4, p5, p6, p7};         \
    __shared__ u32 s_epoch;                                           \
    __shared__ int s_bad;                                             \
    const int b = blockIdx.x, tid = threadIdx.x;                      \
    const u64 mine = ar_pick(pp, me)

extern "C" __global__ void __launch_bounds__(256)
    tp_ar_oneshot(float* x, int n, int me, int world, int maxb, u64 p0, u64 p1, u64 p2, u64 p3, u64 p4, u64 p5,
                  u64 p6, u64 p7, volatile u32* ctl, u64 timeout_ns) {
    AR_BEGIN();
    const u64 flag_off = 4ull * maxb;
    const u64 data_off = (4ull * maxb * (1 + world) + 255) & ~255ull;
    if (tid == 0) {
        s_epoch = ar_next_epoch((u32*)mine + b);
        s_bad = 0;
    }
    __syncthreads();
    const u32 e = s_epoch;
    const u64 half = (u64)(b * 2 + (e & 1)) * world;
    const int i0 = b * AR_CHUNK + tid * 4;
    const bool vec = ((u64)x & 15) == 0 && i0 + 3 < n;
    const float4 v = ar_load4(x, i0, n, vec);
#pragma unroll
    for (int w = 0; w < AR_MAXW; w++) {
        if (w < world && w != me) {
            float4* dst = (float4*)(pp[w] + data_off) + (half + me) * (AR_CHUNK / 4) + tid;
            *dst = v;
        }
    }
    __syncthreads();
#pragma unroll
    for (int w = 0; w < AR_MAXW; w++) {
        if (tid == w && w < world && w != me) {
            ar_st_release((u32*)(pp[w] + flag_off) + b * world + me, e);
        }
    }
    if (tid < world && tid != me) {
        const u32* f = (const u32*)(mine + flag_off) + b * world + tid;
        u64 t0 = 0;
        for (u32 it = 1;; it++) {
            if ((int)(ar_ld_acquire(f) - e) >= 0) break;
            AR_POLL(s_bad = 1; break);
        }
    }
    __syncthreads();
    if (s_bad) return;
    float4 acc = v;
    for (int w = 0; w < world; w++) {
        float4 t = v;
        if (w != me) t = __ldcg((const float4*)(mine + data_off) + (half + w) * (AR_CHUNK / 4) + tid);
        AR_SUM4(acc, t, w);
    }
    ar_store4(x, i0, n, vec, acc);
}

// The same one-shot all-reduce without flags (the "Lamport" variant, `tp_ar_lamport`): data
// slots hold a sentinel (all bits set, a NaN GPU arithmetic never produces) until a peer's
// value lands, so each thread waits on its own 16 bytes and the critical path is one remote
// write, no fences. Three buffers by epoch mod 3: in epoch e a rank writes buffer e % 3 in its
// peers, reads its own buffer e % 3 and resets its buffer (e + 2) % 3 (read in epoch e - 1;
// no peer writes it before epoch e + 2, which needs this rank's epoch e + 1 data, pushed by a
// later launch, so the reset is complete first). A partial whose bits equal the sentinel is
// sent (and summed) as the canonical NaN 0x7fffffff. Region after the flag variant's:
//   [ep: maxb u32][pad to 256 B][data: maxb x 3 x world x AR_CHUNK f32]
// Abort, timeout and launch shape as tp_ar_oneshot.
#define AR_SENT 0xffffffffu

__device__ __forceinline__ uint4 ar_ld_vol4(const uint4* p) {
    uint4 v;
    asm volatile("ld.volatile.global.v4.u32 {%0, %1, %2, %3}, [%4];"
                 : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
                 : "l"(p)
                 : "memory");
    return v;
}
__device__ __forceinline__ void ar_st_vol4(uint4* p, uint4 v) {
    asm volatile("st.volatile.global.v4.u32 [%0], {%1, %2, %3, %4};" ::"l"(p), "r"(v.x), "r"(v.y), "r"(v.z), "r"(v.w)
                 : "memory");
}
__device__ __forceinline__ bool ar_has_sent(uint4 v) {
    return v.x == AR_SENT || v.y == AR_SENT || v.z == AR_SENT || v.w == AR_SENT;
}
__device__ __forceinline__ u32 ar_canon(u32 b) { return b == AR_SENT ? 0x7fffffffu : b; }

extern "C" __global__ void __launch_bounds__(256)
    tp_ar_lamport(float* x, int n, int me, int world, int maxb, u64 p0, u64 p1, u64 p2, u64 p3, u64 p4, u64 p5,
                  u64 p6, u64 p7, volatile u32* ctl, u64 timeout_ns) {
    AR_BEGIN();
    // The flag variant's region comes first (see tp_ar_oneshot).
    const u64 lam_off = ((4ull * maxb * (1 + world) + 255) & ~255ull) + (u64)maxb * 2 * world * AR_CHUNK * 4;
    const u64 ldata = lam_off + ((4ull * maxb + 255) & ~255ull);
    if (tid == 0) {
        s_epoch = ar_next_epoch((u32*)(mine + lam_off) + b);
        s_bad = 0;
    }
    __syncthreads();
    const u32 e = s_epoch;
    const u64 cur = (u64)(b * 3 + (int)(e % 3)) * world, old = (u64)(b * 3 + (int)((e + 2) % 3)) * world;
    const int i0 = b * AR_CHUNK + tid * 4;
    const bool vec = ((u64)x & 15) == 0 && i0 + 3 < n;
    const float4 v = ar_load4(x, i0, n, vec);
    uint4 vb = make_uint4(ar_canon(__float_as_uint(v.x)), ar_canon(__float_as_uint(v.y)), ar_canon(__float_as_uint(v.z)),
                          ar_canon(__float_as_uint(v.w)));
#pragma unroll
    for (int w = 0; w < AR_MAXW; w++)
        if (w < world && w != me) ar_st_vol4((uint4*)(pp[w] + ldata) + (cur + me) * (AR_CHUNK / 4) + tid, vb);
    const uint4 sent = make_uint4(AR_SENT, AR_SENT, AR_SENT, AR_SENT);
    for (int w = 0; w < world; w++)
        if (w != me) ar_st_vol4((uint4*)(mine + ldata) + (old + w) * (AR_CHUNK / 4) + tid, sent);
    float4 acc = make_float4(0.f, 0.f, 0.f, 0.f);
    bool bad = false;
    for (int w = 0; w < world && !bad; w++) {
        uint4 t = vb;
        if (w != me) {
            const uint4* src = (const uint4*)(mine + ldata) + (cur + w) * (AR_CHUNK / 4) + tid;
            u64 t0 = 0;
            for (u32 it = 1;; it++) {
                t = ar_ld_vol4(src);
                if (!ar_has_sent(t)) break;
                AR_POLL(bad = true; break);
            }
        }
        float4 f = make_float4(__uint_as_float(t.x), __uint_as_float(t.y), __uint_as_float(t.z), __uint_as_float(t.w));
        AR_SUM4(acc, f, w);
    }
    if (bad) s_bad = 1;
    __syncthreads();
    if (s_bad) return;
    ar_store4(x, i0, n, vec, acc);
}
