// The fast decode path (small batches, up to a few dozen tokens per step) and the synthetic
// weight fill.
//
// Activations for the weight products are quantized to "q8": per 32 elements one f32 scale
// d = max|x| / 127 and int8 q = round(x / d) (ties to even), kept in two arrays (q: [row][n]
// int8, d: [row][n / 32] f32). No fp16 anywhere in scales or sums: MiniMax-M2.7's expert
// inputs overflow fp16 block sums. Products are integer dp4a dot products per 32 (Q8_0: per 8)
// elements, scaled by the weight and activation scales and accumulated in f32.
//
// Weight rows are staged warp-wide through shared memory with coalesced 16-byte loads:
// Q8_0 (34-byte blocks) and IQ4_XS (136-byte blocks) are not 16-byte aligned per block, but
// 8 Q8_0 blocks or 2 IQ4_XS blocks make 272 bytes = 17 x 16 bytes (a "chunk"). Rows must be
// whole chunks (Q8_0: cols % 256 == 0, IQ4_XS: cols % 512 == 0); the host checks.

// Programmatic dependent launch (the host's Gpu::launch_pdl): every kernel launched that way
// starts with pdl_enter(): wait until the previous kernel on the stream has completed and its
// writes are visible (griddepcontrol.wait; a no-op when launched without PDL), then allow the
// next kernel to be scheduled (its blocks wait in their own pdl_enter), which hides launch
// latency and ramp-up behind this kernel's tail. Nothing may touch memory before it.
__device__ __forceinline__ void pdl_enter() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    asm volatile("griddepcontrol.wait;" ::: "memory");
    asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
#endif
}
// The two halves of pdl_enter, for kernels that do work before the wait (the "p" / "e"
// variants; host: fast::pdl_prefetch / pdl_early). Before pdl_wait() a kernel may only read
// memory that no kernel of the step writes (weights, norm weights, the step's metadata, which
// the host uploads before the step's first kernel) and write its own shared memory / registers.
// pdl_trigger() before pdl_wait() (the "early trigger" of small kernels) lets the next kernel
// start its own pre-wait loads while this one still waits: the next kernel's pdl_wait still
// returns only after this kernel, hence everything before it, has completed.
__device__ __forceinline__ void pdl_wait() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    asm volatile("griddepcontrol.wait;" ::: "memory");
#endif
}
__device__ __forceinline__ void pdl_trigger() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
#endif
}

#define CH 272
#define CH16 17

// ---------------------------------------------------------------- synthetic fill --------
__device__ __forceinline__ u64 splitmix64(u64& s) {
    s += 0x9E3779B97F4A7C15ull;
    u64 z = s;
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    return z ^ (z >> 31);
}
__device__ __forceinline__ float splitmix_f(u64& s) { return (float)(splitmix64(s) >> 40) * (1.0f / 16777216.0f); }

// Random valid quant blocks: random bits everywhere, then the fp16 scale fields at byte offsets
// off0/off1 (-1 = none) set uniform in [lo, hi) (off1 gets the same range, negated if neg1), or,
// when r1 != 0, off1 = r1 x off0's value (K-quant mins: zero-mean weights on average).
// One thread per block; bb must be even. grid (ceil(nblocks / 256)), block 256.
extern "C" __global__ void fill_quant(u8* p, i64 nblocks, int bb, u64 seed, int off0, int off1, int neg1, float lo,
                                      float hi, int e8m0, float r1) {
    i64 b = blockIdx.x * (i64)blockDim.x + threadIdx.x;
    if (b >= nblocks) return;
    u64 s = seed ^ ((u64)b * 0xD1B54A32D192ED03ull);
    u16* q = (u16*)(p + b * bb);
    u64 r = 0;
    for (int i = 0; i < bb / 2; i++) {
        if ((i & 3) == 0) r = splitmix64(s);
        q[i] = (u16)(r >> (16 * (i & 3)));
    }
    float v0 = lo + (hi - lo) * splitmix_f(s);
    if (off0 >= 0) q[off0 / 2] = f32_to_f16(v0);
    if (off1 >= 0) {
        float v = r1 != 0.f ? v0 * r1 : lo + (hi - lo) * splitmix_f(s);
        q[off1 / 2] = f32_to_f16(neg1 ? -v : v);
    }
    if (e8m0) p[b * bb] = 118 + (u8)(splitmix64(s) % 5);
}

// n f32 values uniform in [lo, hi). grid (ceil(n / 256)), block 256.
extern "C" __global__ void fill_f32(float* p, i64 n, u64 seed, float lo, float hi) {
    i64 i = blockIdx.x * (i64)blockDim.x + threadIdx.x;
    if (i >= n) return;
    u64 s = seed ^ ((u64)i * 0xD1B54A32D192ED03ull);
    p[i] = lo + (hi - lo) * splitmix_f(s);
}

// n 16-bit values (f16 or bf16 bit patterns, chosen by bf16) uniform in [lo, hi).
extern "C" __global__ void fill_h16(u16* p, i64 n, u64 seed, float lo, float hi, int bf16) {
    i64 i = blockIdx.x * (i64)blockDim.x + threadIdx.x;
    if (i >= n) return;
    u64 s = seed ^ ((u64)i * 0xD1B54A32D192ED03ull);
    float v = lo + (hi - lo) * splitmix_f(s);
    p[i] = bf16 ? f32_to_bf16(v) : f32_to_f16(v);
}

// ------------------------------------------------------------- q8 activations -----------
// q8_lane (one 32-element group, one value per lane): common.cuh.

// One row's optional RMSNorm (w != null; f32 sum of squares), optional f32 copy of the result
// (yr != null) and q8 quantization into qr/dr by a block of 1024 threads: value i of thread x is
// element x + 1024 i (all loads issued at once); per thread the sum of squares in i order
// (explicit fma), a butterfly per warp, then a butterfly over the 32 warp sums. n % 32 == 0,
// n <= 1024 NV. part: 32 floats of shared memory.
template <int NV>
__device__ __forceinline__ void norm_q8_row(const float* xr, const float* w, int n, float eps, float* yr, i8* qr,
                                            float* dr, float* part) {
    int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    float xv[NV], wv[NV];
#pragma unroll
    for (int i = 0; i < NV; i++) {
        int idx = threadIdx.x + i * 1024;
        xv[i] = idx < n ? xr[idx] : 0.f;
        wv[i] = (w && idx < n) ? w[idx] : 1.f;
    }
    float inv = 1.0f;
    if (w) {
        float ss = 0.f;
#pragma unroll
        for (int i = 0; i < NV; i++) ss = __fmaf_rn(xv[i], xv[i], ss);
        ss = warp_sum(ss);
        if (lane == 0) part[warp] = ss;
        __syncthreads();
        float t = warp_sum(part[lane]);
        inv = 1.0f / sqrtf(t / (float)n + eps);
    }
#pragma unroll
    for (int i = 0; i < NV; i++) {
        int idx = threadIdx.x + i * 1024;
        if (idx < n) {  // warp-uniform: n % 32 == 0
            float v = w ? __fmul_rn(__fmul_rn(xv[i], inv), wv[i]) : xv[i];
            if (yr) yr[idx] = v;
            qr[idx] = (i8)q8_lane(v, dr + (idx >> 5));
        }
    }
}

__device__ __forceinline__ void cp_async16(void* smem, const void* gmem) {
    u32 s;
    asm volatile("{ .reg .u64 a; cvta.to.shared.u64 a, %1; cvt.u32.u64 %0, a; }" : "=r"(s) : "l"(smem));
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16;" ::"r"(s), "l"(gmem) : "memory");
}
__device__ __forceinline__ void cp_async_wait_all() { asm volatile("cp.async.wait_all;" ::: "memory"); }

// Row r = blockIdx.x of x: norm_q8_row (see above). n % 32 == 0, n <= NQ_MAXV * 1024.
// grid (nrows), block 1024.
#define NQ_MAXV 12
extern "C" __global__ void __launch_bounds__(1024) norm_q8(const float* x, i64 xs, const float* w, int n, float eps,
                                                           float* y, i64 ys, i8* q, float* d) {
    pdl_enter();
    __shared__ float part[32];
    norm_q8_row<NQ_MAXV>(x + blockIdx.x * xs, w, n, eps, y ? y + blockIdx.x * ys : nullptr, q + (i64)blockIdx.x * n,
                         d + (i64)blockIdx.x * (n / 32), part);
}
// norm_q8 with the early trigger (pdl_trigger before pdl_wait): the next kernel (q/k/v, the
// router, lm_head) may start its weight loads while this one waits for the previous kernel.
extern "C" __global__ void __launch_bounds__(1024) norm_q8e(const float* x, i64 xs, const float* w, int n, float eps,
                                                            float* y, i64 ys, i8* q, float* d) {
    pdl_trigger();
    pdl_wait();
    __shared__ float part[32];
    norm_q8_row<NQ_MAXV>(x + blockIdx.x * xs, w, n, eps, y ? y + blockIdx.x * ys : nullptr, q + (i64)blockIdx.x * n,
                         d + (i64)blockIdx.x * (n / 32), part);
}

// The last-block pattern (attn_dec6m: decode attention + merge): every block publishes its
// results (stores, then __threadfence by every thread), then counts itself in *cnt; the block
// that arrives last sees all of them (reads through L2) and runs the epilogue, then resets *cnt
// to 0 for the next launch. Returns whether this block is the last. Every thread of the block
// must call it.
__device__ __forceinline__ bool arrive_last(u32* cnt, u32 nblocks) {
    __shared__ int s_last;
    __threadfence();
    __syncthreads();
    if (threadIdx.x == 0) s_last = atomicAdd(cnt, 1u) == nblocks - 1;
    __syncthreads();
    bool last = s_last;
    if (last) __threadfence();
    return last;
}

// Router logits in f32: y[t][r] = W row r . x[t] (W f32 [rows][n], n % 4 == 0, 16-byte
// aligned rows). A warp per (row, token), 12 float4 loads per lane in flight per round.
// grid (ceil(rows / 4), nt), block 128.
#define RT_UNR 12
// One step of a router row's sum (every router kernel's, so that they agree bit for bit).
__device__ __forceinline__ float router_acc(float acc, float4 w, float4 x) {
    return acc + (w.x * x.x + w.y * x.y + w.z * x.z + w.w * x.w);
}
// One router row: y[t][r] = W row r . x[t] by warp (r, t); lane 0 writes it (and, with fence,
// makes it visible device-wide before returning: the fused top-k's last block reads it).
__device__ __forceinline__ void router_row(const float* W, int rows, int n, const float* x, i64 xs, float* y, i64 ys,
                                           int r, int t, int lane, bool fence) {
    if (r >= rows) return;
    const float4* wr = (const float4*)(W + (i64)r * n);
    const float4* xt = (const float4*)(x + (i64)t * xs);
    int n4 = n >> 2;
    float acc = 0.f;
    for (int base = 0; base < n4; base += 32 * RT_UNR) {
        float4 wv[RT_UNR], xv[RT_UNR];
#pragma unroll
        for (int i = 0; i < RT_UNR; i++) {
            int idx = base + lane + 32 * i;
            if (idx < n4) {
                wv[i] = __ldg(wr + idx);
                xv[i] = xt[idx];
            }
        }
#pragma unroll
        for (int i = 0; i < RT_UNR; i++) {
            int idx = base + lane + 32 * i;
            if (idx < n4) acc = router_acc(acc, wv[i], xv[i]);
        }
    }
    acc = warp_sum(acc);
    if (lane == 0) {
        y[(i64)t * ys + r] = acc;
        if (fence) __threadfence();
    }
}

extern "C" __global__ void __launch_bounds__(128) router_f32(const float* W, int rows, int n, const float* x, i64 xs,
                                                             float* y, i64 ys) {
    pdl_enter();
    int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    router_row(W, rows, n, x, xs, y, ys, blockIdx.x * 4 + warp, blockIdx.y, lane, false);
}

// Router top-k of the fast path: the same function as moe.cu's moe_route, bit for bit (same
// score formulas and summation order), but launched with PDL and with the scores in registers
// (lane holds experts lane + 32 i). Sigmoid (gating 2) or softmax (1) scores, top-k on
// score + bias, ties to the lower expert index, weights = chosen unbiased scores renormalised.
// grid (nt), block 32; E <= 32 * RK_MAXE, k <= 32.
#define RK_MAXE 8
__device__ __forceinline__ float ld_cg(const float* p) {
    float v;
    asm volatile("ld.global.cg.f32 %0, [%1];" : "=f"(v) : "l"(p));
    return v;
}
// An order key of a top-k choice value: unsigned order = float order (-0 as +0), NaN lowest.
__device__ __forceinline__ u32 topk_key(float v) {
    if (v != v) return 0u;
    const u32 b = __float_as_uint(v + 0.0f);
    return (b & 0x80000000u) ? ~b : (b | 0x80000000u);
}
__device__ __forceinline__ u32 redux_max_u32(u32 v) {
    u32 r;
    asm volatile("redux.sync.max.u32 %0, %1, 0xffffffff;" : "=r"(r) : "r"(v));
    return r;
}
__device__ __forceinline__ u32 redux_min_u32(u32 v) {
    u32 r;
    asm volatile("redux.sync.min.u32 %0, %1, 0xffffffff;" : "=r"(r) : "r"(v));
    return r;
}
// route_topk_warp's loads (split off so that the routed gate/up issues them before the MoE
// norm's sums): lane holds logit and bias of experts lane + 32 i, zeros past E.
__device__ __forceinline__ void route_topk_load(const float* lg, const float* bias, int E, int lane,
                                                float (&sc)[RK_MAXE], float (&ch)[RK_MAXE]) {
#pragma unroll
    for (int i = 0; i < RK_MAXE; i++) {
        int e = lane + 32 * i;
        sc[i] = e < E ? ld_cg(lg + e) : 0.f;
        ch[i] = e < E ? bias[e] : 0.f;
    }
}
// The rest of route_topk_warp, on the loaded scores times scale.
__device__ __forceinline__ void route_topk_select(float (&sc)[RK_MAXE], float (&ch)[RK_MAXE], int E, int k, int gating,
                                                  int* ids_t, float* w_t, int lane, float scale) {
#pragma unroll
    for (int i = 0; i < RK_MAXE; i++) sc[i] = __fmul_rn(sc[i], scale);
    if (gating == 2) {
#pragma unroll
        for (int i = 0; i < RK_MAXE; i++) sc[i] = 1.0f / (1.0f + expf(-sc[i]));
    } else {
        float mx = NEG_INF;
#pragma unroll
        for (int i = 0; i < RK_MAXE; i++)
            if (lane + 32 * i < E) mx = fmaxf(mx, sc[i]);
        mx = warp_max(mx);
        float s = 0.f;
#pragma unroll
        for (int i = 0; i < RK_MAXE; i++) {
            sc[i] = expf(sc[i] - mx);
            if (lane + 32 * i < E) s += sc[i];
        }
        s = warp_sum(s);
#pragma unroll
        for (int i = 0; i < RK_MAXE; i++) sc[i] = sc[i] / s;
    }
#pragma unroll
    for (int i = 0; i < RK_MAXE; i++) ch[i] = lane + 32 * i < E ? sc[i] + ch[i] : NEG_INF;
    float total = 0.f, my_s = 0.f;
    int my_id = 0;
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
    // Each round: the lane's best (order key, expert), then two warp reductions in one
    // instruction each (redux.sync: the largest key, then the lowest expert holding it) instead
    // of five shuffle rounds of three values. The same choice as the shuffle form below (the key
    // orders floats as < does, -0 as +0; ties go to the lower expert), so the same ids and
    // weights. NaN scores get the lowest key: they win only where nothing else is left, with a
    // NaN weight, and the ids stay in range.
    u32 ck[RK_MAXE];
#pragma unroll
    for (int i = 0; i < RK_MAXE; i++) ck[i] = topk_key(ch[i]);
    for (int j = 0; j < k; j++) {
        u32 bk = 0, be = 0xffffffffu;
        float bsl = 0.f;
#pragma unroll
        for (int i = 0; i < RK_MAXE; i++) {
            const u32 e = lane + 32 * i;
            if (e < (u32)E && (ck[i] > bk || (ck[i] == bk && e < be))) {
                bk = ck[i];
                be = e;
                bsl = sc[i];
            }
        }
        const u32 m = redux_max_u32(bk);
        const int bi = (int)redux_min_u32(bk == m ? be : 0xffffffffu);
        const float bs = __shfl_sync(0xffffffffu, bsl, bi & 31);
#pragma unroll
        for (int i = 0; i < RK_MAXE; i++)
            if (lane + 32 * i == bi) ck[i] = topk_key(NEG_INF);
#else
    for (int j = 0; j < k; j++) {
        float best = NEG_INF, bs = 0.f;
        int bi = 0x7fffffff;
#pragma unroll
        for (int i = 0; i < RK_MAXE; i++) {
            int e = lane + 32 * i;
            if (e < E && (ch[i] > best || (ch[i] == best && e < bi))) {
                best = ch[i];
                bi = e;
                bs = sc[i];
            }
        }
#pragma unroll
        for (int o = 16; o > 0; o >>= 1) {
            float ob = __shfl_xor_sync(0xffffffffu, best, o);
            int oi = __shfl_xor_sync(0xffffffffu, bi, o);
            float os = __shfl_xor_sync(0xffffffffu, bs, o);
            if (ob > best || (ob == best && oi < bi)) {
                best = ob;
                bi = oi;
                bs = os;
            }
        }
        // NaN logits (an overflowed residual) compare false everywhere: no expert wins. Take
        // expert j so the expert kernels stay in bounds; bs = 0 makes the weights 0 / 0 = NaN,
        // which reaches the logits instead of an illegal address.
        if (bi >= E) bi = j;
#pragma unroll
        for (int i = 0; i < RK_MAXE; i++)
            if (lane + 32 * i == bi) ch[i] = NEG_INF;
#endif
        total += bs;
        if (lane == j) {
            my_id = bi;
            my_s = bs;
        }
    }
    if (lane < k) {
        ids_t[lane] = my_id;
        w_t[lane] = my_s / total;
    }
}
// The top-k of one token by one warp: logits lg (read through L2) times scale (exact at 1: the
// streamed gate/up passes the MoE norm's 1 / rms, which router_topk_f32n's last block applies
// to the stored logits with the same rounding), outputs ids_t[k], w_t[k].
__device__ __forceinline__ void route_topk_warp(const float* lg, const float* bias, int E, int k, int gating,
                                                int* ids_t, float* w_t, int lane, float scale = 1.0f) {
    float sc[RK_MAXE], ch[RK_MAXE];
    route_topk_load(lg, bias, E, lane, sc, ch);
    route_topk_select(sc, ch, E, k, gating, ids_t, w_t, lane, scale);
}


extern "C" __global__ void __launch_bounds__(32) moe_route_fast(const float* logits, const float* bias, int E, int k,
                                                                int gating, int* ids, float* w) {
    pdl_enter();
    int t = blockIdx.x;
    route_topk_warp(logits + (i64)t * E, bias, E, k, gating, ids + t * k, w + t * k, threadIdx.x);
}

// The tail of the fused router kernels: every block counts itself in cnt[t] once its logits
// are stored and fenced; the last block of token t runs the top-k on all of them (read through
// L2) and resets cnt[t] for the next launch. Called by every thread of the block.
__device__ __forceinline__ void router_last_block_topk(float* y, i64 ys, const float* bias, int rows, int k, int gating,
                                                       int* ids, float* w, u32* cnt, int t, int warp, int lane) {
    __shared__ int last;
    __syncthreads();
    if (threadIdx.x == 0) last = atomicAdd(&cnt[t], 1u) == gridDim.x - 1;
    __syncthreads();
    if (last && warp == 0) {
        __threadfence();
        route_topk_warp(y + (i64)t * ys, bias, rows, k, gating, ids + t * k, w + t * k, lane);
        if (lane == 0) cnt[t] = 0;
    }
}

// router_f32 and moe_route_fast in one launch: every block writes its logits, fences, and counts
// itself in cnt[t]; the last block of token t runs the top-k on all of them (read through L2)
// and resets cnt[t] to 0 for the next launch. Same results as the two kernels, bit for bit.
// grid (ceil(rows / 4), nt), block 128; rows <= 32 * RK_MAXE, k <= 32; cnt zero at first use.
extern "C" __global__ void __launch_bounds__(128) router_topk_f32(const float* W, int rows, int n, const float* x,
                                                                  i64 xs, float* y, i64 ys, const float* bias, int k,
                                                                  int gating, int* ids, float* w, u32* cnt) {
    pdl_enter();
    int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, t = blockIdx.y;
    router_row(W, rows, n, x, xs, y, ys, blockIdx.x * 4 + warp, t, lane, true);
    router_last_block_topk(y, ys, bias, rows, k, gating, ids, w, cnt, t, warp, lane);
}

#define RT_X 24
// The row loop of the one-token routers: each lane issues the loads of RT_X float4 of its warp's
// weight row (wr, n4 float4; `live` false past the last row: no loads, zero sum), the block runs
// `stage` (every thread: it fills sx, the x the rows are dotted with) while they are in flight,
// and the lanes dot the row with sx in router_row's order. Returns the lane's partial sum.
template <class Stage>
__device__ __forceinline__ float router_row_staged(const float4* wr, int n4, bool live, int lane, const float4* sx,
                                                   Stage stage) {
    float acc = 0.f;
    for (int base = 0; base < n4; base += 32 * RT_X) {
        float4 wv[RT_X];
#pragma unroll
        for (int i = 0; i < RT_X; i++) {
            const int idx = base + lane + 32 * i;
            if (live && idx < n4) wv[i] = __ldg(wr + idx);
        }
        if (base == 0) {
            stage();
            __syncthreads();
        }
#pragma unroll
        for (int i = 0; i < RT_X; i++) {
            const int idx = base + lane + 32 * i;
            if (live && idx < n4) acc = router_acc(acc, wv[i], sx[idx]);
        }
    }
    return acc;
}

// router_topk_f32 for one token with its whole weight row in flight at once: each lane issues
// the loads of RT_X float4 of the row (a 3072-float row in one round instead of two), then the
// block stages the token's x in shared memory (x is in L2: written by the norm just before)
// while they are in flight, and the lanes dot the row with x read from shared memory. One DRAM
// round trip a row instead of two; the same sums in the same order (router_row's), so
// bit-identical. grid (ceil(rows / 4), nt), block 128, dynamic shared memory 4 n bytes.
extern "C" __global__ void __launch_bounds__(128) router_topk_f32x(const float* W, int rows, int n, const float* x,
                                                                  i64 xs, float* y, i64 ys, const float* bias, int k,
                                                                  int gating, int* ids, float* w, u32* cnt) {
    extern __shared__ float4 rx_sm[];
    pdl_enter();
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, t = blockIdx.y, r = blockIdx.x * 4 + warp;
    const int n4 = n >> 2;
    const bool live = r < rows;
    const float4* wr = (const float4*)(W + (i64)(live ? r : 0) * n);
    const float4* xt = (const float4*)(x + (i64)t * xs);
    float acc = router_row_staged(wr, n4, live, lane, rx_sm, [&] {
        for (int i = threadIdx.x; i < n4; i += 128) rx_sm[i] = xt[i];
    });
    if (live) {
        acc = warp_sum(acc);
        if (lane == 0) {
            y[(i64)t * ys + r] = acc;
            __threadfence();
        }
    }
    router_last_block_topk(y, ys, bias, rows, k, gating, ids, w, cnt, t, warp, lane);
}

// The MoE norm's 1 / rms of one token from router_topk_f32n's group sums of squares ss_t
// (ng = n / 32 of them), by one warp, every lane the same value: the one sum order of the last
// block's scale and of the streamed gate/up that routes inline (moe_gate_up_blkr).
__device__ __forceinline__ float router_norm_inv(const float* ss_t, int ng, int n, float eps, int lane) {
    float sum = 0.f;
    for (int g0 = 0; g0 < ng; g0 += 32) sum += g0 + lane < ng ? __ldcg(ss_t + g0 + lane) : 0.f;
    sum = warp_sum(sum);
    return 1.0f / sqrtf(sum / (float)n + eps);
}

// norm_q8 (weight nw) and router_topk_f32x without the separate norm launch. RMSNorm's scale
// is one scalar a token, so with h the unnormalized row and u = nw h (elementwise):
//   logits = Wr (u inv),  q8(u inv) = q8(u) with its scales times inv,
// inv = 1 / sqrt(mean(h^2) + eps). Every block stages u in shared memory and dots its rows
// with it (raw logits into y); its warps also take the q8 groups g = 4 blockIdx.x + warp,
// + 4 gridDim.x, ...: q8 of u (scale into d), and the group's sum of h^2 into ss[g]. The last
// block of token t (the fused router's arrival) adds the n / 32 group sums in order, scales
// its token's logits and the q8 scales by inv, then runs the top-k. No block does the whole
// norm, so the MoE norm's launch and its wait leave the chain. Logits differ from
// norm_q8 + router_topk_f32x by f32 rounding. grid (ceil(rows / w), nt), block 32 w, dynamic
// shared memory 4 n bytes; n % 32 == 0, n <= 32 * 4 * gridDim.x * ... (any: groups loop).
// TAIL false (router_f32n): no arrival, no scale, no top-k: y keeps the raw logits, d the
// unscaled q8 scales, ss the group sums, and the streamed gate/up after it routes
// (moe_gate_up_blkr: every block takes inv and the top-k itself), so the router's arrival, its
// last block's scale and top-k leave the chain; ids, w and cnt are not touched. Either kernel:
// blocks of 1, 2, 4 or 8 warps (16: router_topk_f32n16; a warp a row: grid ceil(rows /
// warps)), the same sums whatever the split.
template <bool TAIL>
__device__ __forceinline__ void router_f32n_impl(const float* W, int rows, int n, const float* x, i64 xs,
                                                 const float* nw, float eps, float* y, i64 ys, const float* bias,
                                                 int k, int gating, int* ids, float* w, u32* cnt, i8* q, float* d,
                                                 float* ss, int pf) {
    extern __shared__ float4 rn_x[];
    const int wpb = blockDim.x >> 5;  // warps a block (any: each row and q8 group is one warp's)
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, t = blockIdx.y, r = blockIdx.x * wpb + warp;
    const int n4 = n >> 2, ng = n >> 5;
    const bool live = r < rows;
    const float4* wr = (const float4*)(W + (i64)(live ? r : 0) * n);
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    // pf: the warp's weight row asked of L2 before the wait (weights only; one bulk prefetch).
    if (pf && live && lane == 0 && t == 0)
        asm volatile("cp.async.bulk.prefetch.L2.global [%0], %1;" ::"l"(wr), "r"(n * 4) : "memory");
#endif
    pdl_enter();
    const float4* xt = (const float4*)(x + (i64)t * xs);
    const float4* gw = (const float4*)nw;
    float* dt = d + (i64)t * ng;
    float acc = router_row_staged(wr, n4, live, lane, rn_x, [&] {
        for (int i = threadIdx.x; i < n4; i += blockDim.x) {
            const float4 h = __ldcg(xt + i), g = gw[i];
            rn_x[i] = make_float4(h.x * g.x, h.y * g.y, h.z * g.z, h.w * g.w);
        }
        // This block's q8 groups (from L2: x was read just above) and their sums of squares.
        for (int grp = blockIdx.x * wpb + warp; grp < ng; grp += wpb * gridDim.x) {
            const int e = (grp << 5) + lane;
            const float h = __ldcg(x + (i64)t * xs + e);
            const float sq = warp_sum(h * h);
            q[(i64)t * n + e] = (i8)q8_lane(h * nw[e], dt + grp);
            if (lane == 0) ss[(i64)t * ng + grp] = sq;
        }
    });
    if (live) {
        acc = warp_sum(acc);
        if (lane == 0) y[(i64)t * ys + r] = acc;
    }
    if (!TAIL) return;
    // router_last_block_topk, with the scale applied first.
    __shared__ int last;
    __shared__ float s_inv;
    __threadfence();
    __syncthreads();
    if (threadIdx.x == 0) last = atomicAdd(&cnt[t], 1u) == gridDim.x - 1;
    __syncthreads();
    if (!last) return;
    __threadfence();
    if (warp == 0) {
        const float inv = router_norm_inv(ss + (i64)t * ng, ng, n, eps, lane);
        if (lane == 0) s_inv = inv;
    }
    __syncthreads();
    const float inv = s_inv;
    float* yt = y + (i64)t * ys;
    for (int e = threadIdx.x; e < rows; e += blockDim.x) yt[e] = __fmul_rn(__ldcg(yt + e), inv);
    for (int g = threadIdx.x; g < ng; g += blockDim.x) dt[g] = __fmul_rn(__ldcg(dt + g), inv);
    __threadfence_block();
    __syncthreads();
    if (warp == 0) {
        route_topk_warp(yt, bias, rows, k, gating, ids + t * k, w + t * k, lane);
        if (lane == 0) cnt[t] = 0;
    }
}
#define ROUTER_F32N_ARGS                                                                                          \
    const float *W, int rows, int n, const float *x, i64 xs, const float *nw, float eps, float *y, i64 ys,        \
        const float *bias, int k, int gating, int *ids, float *w, u32 *cnt, i8 *q, float *d, float *ss, int pf
extern "C" __global__ void __launch_bounds__(256) router_topk_f32n(ROUTER_F32N_ARGS) {
    router_f32n_impl<true>(W, rows, n, x, xs, nw, eps, y, ys, bias, k, gating, ids, w, cnt, q, d, ss, pf);
}
// Blocks of 16 warps (their own register budget: 128 a thread).
extern "C" __global__ void __launch_bounds__(512) router_topk_f32n16(ROUTER_F32N_ARGS) {
    router_f32n_impl<true>(W, rows, n, x, xs, nw, eps, y, ys, bias, k, gating, ids, w, cnt, q, d, ss, pf);
}
extern "C" __global__ void __launch_bounds__(256) router_f32n(ROUTER_F32N_ARGS) {
    router_f32n_impl<false>(W, rows, n, x, xs, nw, eps, y, ys, bias, k, gating, ids, w, cnt, q, d, ss, pf);
}

// router_topk_f32 for several tokens: warp (row, group of up to 4 tokens) loads each round of
// its weight row once and dots it with each token's x (router_topk_f32 re-reads the row for
// every token: at 32 tokens 100 MB of the ~200 MB of L2 reads a layer). Per (row, token) the
// same sums in the same order as router_row: logits, ids and weights bit-identical. A block
// counts itself for each of its tokens; the last block of token t0 + w runs its top-k in warp
// w. grid (ceil(rows / 4), ceil(nt / 4)), block 128.
extern "C" __global__ void __launch_bounds__(128) router_topk_f32t4(const float* W, int rows, int n, const float* x,
                                                                    i64 xs, int nt, float* y, i64 ys, const float* bias,
                                                                    int k, int gating, int* ids, float* w, u32* cnt) {
    pdl_enter();
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, r = blockIdx.x * 4 + warp;
    const int t0 = blockIdx.y * 4, tn = min(4, nt - t0), n4 = n >> 2;
    if (r < rows) {
        const float4* wr = (const float4*)(W + (i64)r * n);
        float acc[4] = {0.f, 0.f, 0.f, 0.f};
        for (int base = 0; base < n4; base += 32 * RT_UNR) {
            float4 wv[RT_UNR];
#pragma unroll
            for (int i = 0; i < RT_UNR; i++) {
                const int idx = base + lane + 32 * i;
                if (idx < n4) wv[i] = __ldg(wr + idx);
            }
#pragma unroll
            for (int tt = 0; tt < 4; tt++) {
                if (tt >= tn) break;
                const float4* xt = (const float4*)(x + (i64)(t0 + tt) * xs);
                float4 xv[RT_UNR];
#pragma unroll
                for (int i = 0; i < RT_UNR; i++) {
                    const int idx = base + lane + 32 * i;
                    if (idx < n4) xv[i] = xt[idx];
                }
#pragma unroll
                for (int i = 0; i < RT_UNR; i++) {
                    const int idx = base + lane + 32 * i;
                    if (idx < n4) acc[tt] = router_acc(acc[tt], wv[i], xv[i]);
                }
            }
        }
#pragma unroll
        for (int tt = 0; tt < 4; tt++) {
            const float v = warp_sum(acc[tt]);
            if (tt < tn && lane == 0) {
                y[(i64)(t0 + tt) * ys + r] = v;
                __threadfence();
            }
        }
    }
    __shared__ int last[4];
    __syncthreads();
    if (threadIdx.x < tn) last[threadIdx.x] = atomicAdd(&cnt[t0 + threadIdx.x], 1u) == gridDim.x - 1;
    __syncthreads();
    if (warp < tn && last[warp]) {
        __threadfence();
        route_topk_warp(y + (i64)(t0 + warp) * ys, bias, rows, k, gating, ids + (t0 + warp) * k, w + (t0 + warp) * k, lane);
        if (lane == 0) cnt[t0 + warp] = 0;
    }
}

// router_topk_f32 with the weight row loaded into registers before pdl_wait (RT_PRE float4
// per lane: rows of at most 32 * RT_PRE * 4 = 3072 floats; the host checks), so the router's
// 3 MB overlap the previous kernel. Then x in rounds of RT_UNR and the same sums in the same
// order as router_row (bit-identical). Same arguments and grid as router_topk_f32.
#define RT_PRE 24
extern "C" __global__ void __launch_bounds__(128) router_topk_f32p(const float* W, int rows, int n, const float* x,
                                                                   i64 xs, float* y, i64 ys, const float* bias, int k,
                                                                   int gating, int* ids, float* w, u32* cnt) {
    int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, t = blockIdx.y;
    int r = blockIdx.x * 4 + warp, n4 = n >> 2;
    bool live = r < rows;
    const float4* wr = (const float4*)(W + (i64)(live ? r : 0) * n);
    float4 wv[RT_PRE];
#pragma unroll
    for (int i = 0; i < RT_PRE; i++) {
        int idx = lane + 32 * i;
        if (live && idx < n4) wv[i] = __ldg(wr + idx);
    }
    pdl_wait();
    pdl_trigger();
    if (live) {
        const float4* xt = (const float4*)(x + (i64)t * xs);
        float acc = 0.f;
#pragma unroll
        for (int b = 0; b < RT_PRE; b += RT_UNR) {
            float4 xv[RT_UNR];
#pragma unroll
            for (int i = 0; i < RT_UNR; i++) {
                int idx = lane + 32 * (b + i);
                if (idx < n4) xv[i] = xt[idx];
            }
#pragma unroll
            for (int i = 0; i < RT_UNR; i++) {
                int idx = lane + 32 * (b + i);
                if (idx < n4)
                    acc = router_acc(acc, wv[b + i], xv[i]);
            }
        }
        acc = warp_sum(acc);
        if (lane == 0) {
            y[(i64)t * ys + r] = acc;
            __threadfence();
        }
    }
    router_last_block_topk(y, ys, bias, rows, k, gating, ids, w, cnt, t, warp, lane);
}

// ------------------------------------------------ RMSNorm folded into its consumer ------
// norm_q8_row's RMSNorm (f32 sum of squares) computed by W warps instead of 1024 threads, bit
// for bit: real warp `warp` plays the virtual warps warp + W m (m < 32 / W) with the same lanes,
// so every virtual warp's butterfly runs on one real warp, and the 32 virtual warp sums meet in
// part[] and are added as there (virtual thread v holds elements v + 1024 i, zero past n, which
// leave its fma chain unchanged). Loads xv / wv (element (m, i) of this thread), returns
// 1 / rms. BAR 0: __syncthreads; else named barrier BAR over the W warps. n % 32 == 0,
// n <= 1024 MAXI.
template <int BAR, int W>
__device__ __forceinline__ void nv_bar() {
    if (BAR == 0) __syncthreads();
    else asm volatile("bar.sync %0, %1;" ::"r"(BAR), "r"(32 * W) : "memory");
}
template <int W, int MAXI, int BAR>
__device__ __forceinline__ float norm_virtual(const float* xr, const float* w, int n, float eps,
                                              float (&xv)[32 / W][MAXI], float (&wv)[32 / W][MAXI], float* part,
                                              int warp, int lane) {
    constexpr int M = 32 / W;
#pragma unroll
    for (int m = 0; m < M; m++)
#pragma unroll
        for (int i = 0; i < MAXI; i++) {
            int idx = ((warp + W * m) << 5) + lane + 1024 * i;
            xv[m][i] = idx < n ? __ldcg(xr + idx) : 0.f;  // written by other blocks (stream.cu's down)
            wv[m][i] = idx < n ? w[idx] : 1.f;
        }
#pragma unroll
    for (int m = 0; m < M; m++) {
        float ss = 0.f;
#pragma unroll
        for (int i = 0; i < MAXI; i++) ss = __fmaf_rn(xv[m][i], xv[m][i], ss);
        ss = warp_sum(ss);
        if (lane == 0) part[warp + W * m] = ss;
    }
    nv_bar<BAR, W>();
    float t = warp_sum(part[lane]);
    return 1.0f / sqrtf(t / (float)n + eps);
}

#define RN_MAXI 4
// router_topk_norm_f32's first part (128 threads, every block): the token's row xr normalized
// (weight nw) into xn (shared), then this block's share of its q8 groups into qt / dt.
__device__ __forceinline__ void router_norm_prologue(const float* xr, const float* nw, int n, float eps, float* xn,
                                                     i8* qt, float* dt, int warp, int lane) {
    __shared__ float part[32];
    {
        float xv[8][RN_MAXI], wv[8][RN_MAXI];
        const float inv = norm_virtual<4, RN_MAXI, 0>(xr, nw, n, eps, xv, wv, part, warp, lane);
#pragma unroll
        for (int m = 0; m < 8; m++)
#pragma unroll
            for (int i = 0; i < RN_MAXI; i++) {
                int idx = ((warp + 4 * m) << 5) + lane + 1024 * i;
                if (idx < n) xn[idx] = __fmul_rn(__fmul_rn(xv[m][i], inv), wv[m][i]);
            }
    }
    __syncthreads();
    for (int g = blockIdx.x * 4 + warp; g < (n >> 5); g += 4 * gridDim.x)
        qt[(g << 5) + lane] = (i8)q8_lane(xn[(g << 5) + lane], dt + g);
}
// norm_q8 (RMSNorm weight nw, q8 into q / d) and router_topk_f32 in one launch: every block
// normalizes token t's row itself (norm_virtual: the values of norm_q8's f32 output, bit for
// bit) into shared memory, its warps write their share of the q8 groups, then it runs
// router_topk_f32's rows on the shared copy (router_row: same sums, same order). Logits, ids,
// weights and q8 bit-identical to norm_q8 + router_topk_f32. Same grid as router_topk_f32,
// dynamic shared memory 4 n bytes; n % 128 == 0, n <= 1024 RN_MAXI.
extern "C" __global__ void __launch_bounds__(128) router_topk_norm_f32(
    const float* W, int rows, int n, const float* x, i64 xs, const float* nw, float eps, float* y, i64 ys,
    const float* bias, int k, int gating, int* ids, float* w, u32* cnt, i8* q, float* d) {
    pdl_enter();
    extern __shared__ float4 rn_sm[];
    float* xn = (float*)rn_sm;
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, t = blockIdx.y;
    router_norm_prologue(x + (i64)t * xs, nw, n, eps, xn, q + (i64)t * n, d + (i64)t * (n >> 5), warp, lane);
    router_row(W, rows, n, xn, 0, y, ys, blockIdx.x * 4 + warp, t, lane, true);
    router_last_block_topk(y, ys, bias, rows, k, gating, ids, w, cnt, t, warp, lane);
}

// ----------------------------------------------------------- weight staging -------------
__device__ __forceinline__ int4 ld_stream(const int4* p) {
    int4 v;
    asm volatile("ld.global.nc.L1::no_allocate.v4.s32 {%0,%1,%2,%3}, [%4];"
                 : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
                 : "l"(p));
    return v;
}

// Copies nrows row slices of n16 x 16 bytes (row j starts at rowptr(j), 16-byte aligned) into
// this warp's shared buffer, back to back. All loads are issued before the first store.
template <int MAXL, typename F>
__device__ __forceinline__ void stage(u8* sm, int n16, int nrows, F rowptr, int lane) {
    int total = n16 * nrows;
    int4 v[MAXL];
#pragma unroll
    for (int i = 0; i < MAXL; i++) {
        int idx = lane + 32 * i;
        if (idx < total) {
            int j = idx / n16;
            v[i] = ld_stream((const int4*)rowptr(j) + (idx - j * n16));
        }
    }
    __syncwarp();
#pragma unroll
    for (int i = 0; i < MAXL; i++) {
        int idx = lane + 32 * i;
        if (idx < total) ((int4*)sm)[idx] = v[i];
    }
    __syncwarp();
}

// Split staging for software pipelining: stage_ld issues a phase's loads into registers
// (nothing waits on them until stage_st), so the next phase's loads are in flight while this
// phase's staged data is being dotted. stage_st first syncs the warp (every lane is done
// reading the previous phase from shared memory), stores, and syncs again.
template <int MAXL, typename F>
__device__ __forceinline__ void stage_ld(int4 (&v)[MAXL], int n16, int nrows, F rowptr, int lane) {
    int total = n16 * nrows;
#pragma unroll
    for (int i = 0; i < MAXL; i++) {
        int idx = lane + 32 * i;
        if (idx < total) {
            int j = idx / n16;
            v[i] = ld_stream((const int4*)rowptr(j) + (idx - j * n16));
        }
    }
}
template <int MAXL>
__device__ __forceinline__ void stage_st(u8* sm, const int4 (&v)[MAXL], int total, int lane) {
    __syncwarp();
#pragma unroll
    for (int i = 0; i < MAXL; i++) {
        int idx = lane + 32 * i;
        if (idx < total) ((int4*)sm)[idx] = v[i];
    }
    __syncwarp();
}


template <int T> struct FastT;
template <> struct FastT<T_Q8_0> { static const int UPC = 32; };   // units per chunk (8 values each)
template <> struct FastT<T_IQ4_XS> { static const int UPC = 16; }; // (32 values each)

// acc[t] += unit u of a staged chunk (global chunk index gch) . x[t], for t < nv.
template <int T, int NT>
__device__ __forceinline__ void unit_dot(const u8* chunk, int u, int gch, const i8* xq, i64 xqs, const float* xd,
                                         i64 xds, int nv, float* acc) {
    if (T == T_Q8_0) {
        const u8* blk = chunk + (u >> 2) * 34;
        int qq = u & 3;
        int kb = gch * 8 + (u >> 2);
        float dw = f16_to_f32(*(const u16*)blk);
        const u16* qs = (const u16*)(blk + 2 + 8 * qq);
        int w0 = (int)((u32)qs[0] | ((u32)qs[1] << 16));
        int w1 = (int)((u32)qs[2] | ((u32)qs[3] << 16));
#pragma unroll
        for (int t = 0; t < NT; t++) {
            if (t < nv) {
                int2 xv = *(const int2*)(xq + t * xqs + kb * 32 + qq * 8);
                int s = __dp4a(w0, xv.x, 0);
                s = __dp4a(w1, xv.y, s);
                acc[t] += dw * xd[t * xds + kb] * (float)s;
            }
        }
    } else {
        int b = u >> 3, sb = u & 7;
        const u8* blk = chunk + b * 136;
        int kb = gch * 2 + b;
        float d = f16_to_f32(*(const u16*)blk);
        u32 sh = *(const u16*)(blk + 2);
        int ls = ((blk[4 + (sb >> 1)] >> (4 * (sb & 1))) & 15) | (((sh >> (2 * sb)) & 3) << 4);
        float dl = d * (float)(ls - 32);
        const uint2* qp = (const uint2*)(blk + 8 + 16 * sb);
        uint2 qa = qp[0], qb = qp[1];
        u32 lo[4], hi[4];
        iq4_lookup(qa.x, lo[0], hi[0]);
        iq4_lookup(qa.y, lo[1], hi[1]);
        iq4_lookup(qb.x, lo[2], hi[2]);
        iq4_lookup(qb.y, lo[3], hi[3]);
#pragma unroll
        for (int t = 0; t < NT; t++) {
            if (t < nv) {
                const int4* xp = (const int4*)(xq + t * xqs + kb * 256 + sb * 32);
                int4 xa = xp[0], xb = xp[1];
                int s = __dp4a((int)lo[0], xa.x, 0);
                s = __dp4a((int)lo[1], xa.y, s);
                s = __dp4a((int)lo[2], xa.z, s);
                s = __dp4a((int)lo[3], xa.w, s);
                s = __dp4a((int)hi[0], xb.x, s);
                s = __dp4a((int)hi[1], xb.y, s);
                s = __dp4a((int)hi[2], xb.z, s);
                s = __dp4a((int)hi[3], xb.w, s);
                acc[t] += dl * xd[t * xds + kb * 8 + sb] * (float)s;
            }
        }
    }
}

// This lane's share of staged chunks [0, nch) (global chunk gch0 + i) dotted with x.
template <int T, int NT>
__device__ __forceinline__ void dot_staged(const u8* sm, int nch, int gch0, const i8* xq, i64 xqs, const float* xd,
                                           i64 xds, int nv, float* acc, int lane) {
    const int UPC = FastT<T>::UPC;
    int units = nch * UPC;
    for (int u = lane; u < units; u += 32) {
        int ch = u / UPC;
        unit_dot<T, NT>(sm + ch * CH, u - ch * UPC, gch0 + ch, xq, xqs, xd, xds, nv, acc);
    }
}

// ------------------------------------------------------------ dense products ------------
#define MVQ_WARPS 8
#define MVQ_PH 8  // chunks staged per phase (2176 bytes per warp)

// Up to three matrices sharing one input (q, k, v): row r of the launch is row r of segment 0,
// then segment 1, then 2. y[t][row] (+)= W row . x[t]. grid (ceil(total_rows / MVQ_WARPS),
// ceil(nv / NT)), block 32 * MVQ_WARPS. x has ncol = 32 * 8 * nchunks (Q8_0) or 512 * nchunks
// (IQ4_XS) elements per row.
template <int T, int NT>
__device__ __forceinline__ void mvq_dense(const u8* W0, i64 rb0, int rows0, float* y0, i64 ys0, const u8* W1, i64 rb1,
                                          int rows1, float* y1, i64 ys1, const u8* W2, i64 rb2, int rows2, float* y2,
                                          i64 ys2, int nchunks, const i8* xq, const float* xd, int ncol, int nv,
                                          int accumulate) {
    __shared__ __align__(16) u8 sm_all[MVQ_WARPS][MVQ_PH * CH];
    int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    int r = blockIdx.x * MVQ_WARPS + warp;
    int v0 = blockIdx.y * NT;
    MV_SEGMENT_OR_RETURN();
    int nv_here = min(NT, nv - v0);
    const u8* row = W + r * rb;
    u8* sm = sm_all[warp];
    const i8* xqv = xq + (i64)v0 * ncol;
    const float* xdv = xd + (i64)v0 * (ncol / 32);
    float acc[NT];
#pragma unroll
    for (int t = 0; t < NT; t++) acc[t] = 0.f;
    const int L = (MVQ_PH * CH16 + 31) / 32;
    int4 v[L];
    stage_ld<L>(v, min(MVQ_PH, nchunks) * CH16, 1, [&](int) { return row; }, lane);
    for (int c0 = 0; c0 < nchunks; c0 += MVQ_PH) {
        int nch = min(MVQ_PH, nchunks - c0);
        stage_st<L>(sm, v, nch * CH16, lane);
        int c1 = c0 + MVQ_PH;
        if (c1 < nchunks)
            stage_ld<L>(v, min(MVQ_PH, nchunks - c1) * CH16, 1, [&](int) { return row + (i64)c1 * CH; }, lane);
        dot_staged<T, NT>(sm, nch, c0, xqv, ncol, xdv, ncol / 32, nv_here, acc, lane);
    }
    mv_store<NT>(acc, y, ys, r, v0, nv_here, lane, accumulate);
}

// Q8_0 dense product with the whole row slice in flight (the host's default for Q8_0:
// MINIMAX_MVQ=1; =0 the staged mvq_* above). A warp copies up to MAXCH chunks of its row to
// shared memory with cp.async (16 bytes each, L1 bypassed, no registers held, so every load of
// the slice is in flight at once), waits once, then each lane dots a pair of blocks (68 bytes =
// 17 aligned words; consecutive lanes read consecutive pairs, a word stride of 17, so the 32
// lanes hit 32 different banks). Block 0 of a pair starts 2 bytes into a word: its quants are
// realigned with one prmt per 4 values. Same arguments and grid as mvq_dense (WARPS rows per
// block); rows longer than MAXCH chunks take several phases.
// One phase of mvqs_q8: the warp's nch staged chunks (chunk c0 of the row onwards) dotted with
// the NT vectors, each lane a pair of Q8_0 blocks at a time (see mvqs_q8).
// X8 (NT 1): the activations carry one scale per 8 columns (stream.cu's dn_x8: xdv holds ncol / 8
// of them), so each block's 8 dp4a give 4 sums of 2, each scaled by its own group's scale.
template <int NT, bool X8 = false>
__device__ __forceinline__ void mvqs_dot(const u8* sm, int nch, int c0, const i8* xqv, const float* xdv, int ncol,
                                         int nv_here, float (&acc)[NT], int lane) {
    for (int pp = lane; pp < nch * 4; pp += 32) {
        const u32* wp = (const u32*)(sm + pp * 68);
        u32 w[17];
#pragma unroll
        for (int i = 0; i < 17; i++) w[i] = wp[i];
        int kb = c0 * 8 + 2 * pp;  // the pair's first block, in q8 groups of the row
        float d0 = f16_to_f32((u16)(w[0] & 0xffffu)), d1 = f16_to_f32((u16)(w[8] >> 16));
        int q0[8];
#pragma unroll
        for (int j = 0; j < 8; j++) q0[j] = (int)__byte_perm(w[j], w[j + 1], 0x5432);
#pragma unroll
        for (int t = 0; t < NT; t++) {
            if (t < nv_here) {
                const int4* xp = (const int4*)(xqv + (i64)t * ncol + kb * 32);
                int4 a = xp[0], b = xp[1], c = xp[2], d = xp[3];
                if (X8) {
                    const float4 e0 = *(const float4*)(xdv + kb * 4), e1 = *(const float4*)(xdv + kb * 4 + 4);
                    const int p0 = __dp4a(q0[1], a.y, __dp4a(q0[0], a.x, 0));
                    const int p1 = __dp4a(q0[3], a.w, __dp4a(q0[2], a.z, 0));
                    const int p2 = __dp4a(q0[5], b.y, __dp4a(q0[4], b.x, 0));
                    const int p3 = __dp4a(q0[7], b.w, __dp4a(q0[6], b.z, 0));
                    const int p4 = __dp4a((int)w[10], c.y, __dp4a((int)w[9], c.x, 0));
                    const int p5 = __dp4a((int)w[12], c.w, __dp4a((int)w[11], c.z, 0));
                    const int p6 = __dp4a((int)w[14], d.y, __dp4a((int)w[13], d.x, 0));
                    const int p7 = __dp4a((int)w[16], d.w, __dp4a((int)w[15], d.z, 0));
                    const float g0 = e0.x * (float)p0 + e0.y * (float)p1 + e0.z * (float)p2 + e0.w * (float)p3;
                    const float g1 = e1.x * (float)p4 + e1.y * (float)p5 + e1.z * (float)p6 + e1.w * (float)p7;
                    acc[t] += d0 * g0 + d1 * g1;
                    continue;
                }
                float2 s = *(const float2*)(xdv + (i64)t * (ncol / 32) + kb);
                int s0 = __dp4a(q0[0], a.x, 0);
                s0 = __dp4a(q0[1], a.y, s0);
                s0 = __dp4a(q0[2], a.z, s0);
                s0 = __dp4a(q0[3], a.w, s0);
                s0 = __dp4a(q0[4], b.x, s0);
                s0 = __dp4a(q0[5], b.y, s0);
                s0 = __dp4a(q0[6], b.z, s0);
                s0 = __dp4a(q0[7], b.w, s0);
                int s1 = __dp4a((int)w[9], c.x, 0);
                s1 = __dp4a((int)w[10], c.y, s1);
                s1 = __dp4a((int)w[11], c.z, s1);
                s1 = __dp4a((int)w[12], c.w, s1);
                s1 = __dp4a((int)w[13], d.x, s1);
                s1 = __dp4a((int)w[14], d.y, s1);
                s1 = __dp4a((int)w[15], d.z, s1);
                s1 = __dp4a((int)w[16], d.w, s1);
                acc[t] += d0 * s.x * (float)s0 + d1 * s.y * (float)s1;
            }
        }
    }
}

// PRE: the first phase's cp.async copies are issued before pdl_wait (the "p" kernels; weights
// only, so they overlap the previous kernel), the activations are read after it.
template <int NT, int WARPS, int MAXCH, bool PRE = false>
__device__ __forceinline__ void mvqs_q8(const u8* W0, i64 rb0, int rows0, float* y0, i64 ys0, const u8* W1, i64 rb1,
                                        int rows1, float* y1, i64 ys1, const u8* W2, i64 rb2, int rows2, float* y2,
                                        i64 ys2, int nchunks, const i8* xq, const float* xd, int ncol, int nv,
                                        int accumulate) {
    __shared__ __align__(16) u8 sm_all[WARPS][MAXCH * CH];
    int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    int r = blockIdx.x * WARPS + warp;
    int v0 = blockIdx.y * NT;
    MV_SEGMENT_OR_RETURN();
    int nv_here = min(NT, nv - v0);
    const u8* row = W + r * rb;
    u8* sm = sm_all[warp];
    const i8* xqv = xq + (i64)v0 * ncol;
    const float* xdv = xd + (i64)v0 * (ncol / 32);
    float acc[NT];
#pragma unroll
    for (int t = 0; t < NT; t++) acc[t] = 0.f;
    if (PRE) {
        int n16 = min(MAXCH, nchunks) * CH16;
        for (int i = lane; i < n16; i += 32) cp_async16(sm + 16 * i, (const int4*)row + i);
        pdl_wait();
        pdl_trigger();
    }
    for (int c0 = 0; c0 < nchunks; c0 += MAXCH) {
        int nch = min(MAXCH, nchunks - c0);
        int n16 = nch * CH16;
        if (!PRE || c0 > 0) {
            __syncwarp();  // every lane is done reading the previous phase
            const int4* src = (const int4*)(row + (i64)c0 * CH);
            for (int i = lane; i < n16; i += 32) cp_async16(sm + 16 * i, src + i);
        }
        cp_async_wait_all();
        __syncwarp();
        mvqs_dot<NT>(sm, nch, c0, xqv, xdv, ncol, nv_here, acc, lane);
    }
    mv_store<NT>(acc, y, ys, r, v0, nv_here, lane, accumulate);
}

// Instances: NT vectors per block; "s" = 8 warps x 12-chunk phases (rows of <= 12 chunks:
// q/k/v, lm_head at hidden 3072), "l" = 4 warps x 24-chunk phases (the o-projection's 6144
// columns in one phase); 26 KB of shared memory each. Suffix "p": the PRE variant.
#define MVQS_INST(nt, sfx, warps, maxch)                                                                         \
    extern "C" __global__ void __launch_bounds__(32 * warps) mvqs_q8_0_##nt##sfx(                                \
        const u8* W0, i64 rb0, int rows0, float* y0, i64 ys0, const u8* W1, i64 rb1, int rows1, float* y1, i64 ys1, \
        const u8* W2, i64 rb2, int rows2, float* y2, i64 ys2, int nchunks, const i8* xq, const float* xd, int ncol,  \
        int nv, int acc) {                                                                                       \
        pdl_enter();                                                                                             \
        mvqs_q8<nt, warps, maxch>(W0, rb0, rows0, y0, ys0, W1, rb1, rows1, y1, ys1, W2, rb2, rows2, y2, ys2, nchunks, \
                                  xq, xd, ncol, nv, acc);                                                        \
    }                                                                                                            \
    extern "C" __global__ void __launch_bounds__(32 * warps) mvqs_q8_0_##nt##sfx##p(                             \
        const u8* W0, i64 rb0, int rows0, float* y0, i64 ys0, const u8* W1, i64 rb1, int rows1, float* y1, i64 ys1, \
        const u8* W2, i64 rb2, int rows2, float* y2, i64 ys2, int nchunks, const i8* xq, const float* xd, int ncol,  \
        int nv, int acc) {                                                                                       \
        mvqs_q8<nt, warps, maxch, true>(W0, rb0, rows0, y0, ys0, W1, rb1, rows1, y1, ys1, W2, rb2, rows2, y2, ys2,   \
                                        nchunks, xq, xd, ncol, nv, acc);                                         \
    }
MVQS_INST(1, s, 8, 12)
MVQS_INST(4, s, 8, 12)
MVQS_INST(8, s, 8, 12)
MVQS_INST(1, l, 4, 24)
MVQS_INST(4, l, 4, 24)
MVQS_INST(8, l, 4, 24)

// ------------------------------------------- Q8_0 dense products on tensor cores -------
// For steps of several tokens (batched decode). mvqs_* re-reads every token's q8 activations
// for every weight row (32 tokens x 3072 columns x 8192 rows: 0.9 GB of L1/L2 reads for one
// q/k/v product) and is bound by that, not by the weights (334 us vs 6 us of weight bytes, H200).
// Here the step's tokens are the M side of mma.sync m16n8k32 (s8 x s8 -> s32, exact) and the
// weight rows the N side; one MMA per 32-column Q8_0 block, its sums scaled in f32 by (token's
// q8 scale x block's f16 scale) and added over the blocks in order.
// Block (128 threads): 16 weight rows (two n8 tiles) x 32 tokens (two m16 tiles); warp w takes
// the K quarter w (chunks [w n / 4, (w + 1) n / 4), a chunk = 8 Q8_0 blocks = 272 bytes a row)
// and streams its 16 rows' chunks through a ring of MM8_NB one-chunk shared buffers with
// cp.async (MM8_NB - 1 chunks in flight while one is multiplied). The quarters are added in
// shared memory in a fixed order, then stored like mvqs_* (y (+)= ...). Same arguments as
// mvqs_*; grid (ceil(total_rows / 16), ceil(nv / 32)), block 32 x warps (4, or 8 for mvmma8),
// MM8_SMEM(warps, ring) bytes of dynamic shared memory.
#define MM8_NB 4
#define MM8_BUF (16 * CH)  // 16 rows x 272 bytes: a row is 68 words, so rows g = 0..7 start on banks 4g
#define MM8_SMEM(nw, nb) ((nw) * (nb) * MM8_BUF)



// mvqs_q8 (PRE) with RPW rows per warp, for rows of at most MAXCH chunks (one phase; the host
// checks): every copy of the warp's RPW rows is issued before pdl_wait, so a grid of
// rows / (WARPS RPW) blocks can be resident at once beside the previous kernel (q/k/v at
// hidden 3072: 8192 rows, 1024 blocks of 4 warps x 2 rows, 26 KB; the 8-warp mvqs_q8_0_1sp
// fits ~6 blocks of 8 rows an SM by registers, so a quarter of its blocks start after the
// wait). Per row the same arithmetic as mvqs_q8 (bit-identical). grid
// (ceil(total_rows / (WARPS RPW)), ceil(nv / NT)), block 32 WARPS.
// X8 (NT 1): xd holds ncol / 8 scales (mvqs_dot's X8) of the unnormalized u = h nw, and xss the
// ncol / 8 groups' sums of h^2 (ncol <= MAXCH 256); every warp adds them (lane j: groups j,
// j + 32, ..., then the butterfly) into the same 1 / rms, which scales its sums: y = W (u / rms).
template <int NT, int WARPS, int MAXCH, int RPW, bool X8 = false>
__device__ __forceinline__ void mvqs_q8_rows(const u8* W0, i64 rb0, int rows0, float* y0, i64 ys0, const u8* W1,
                                             i64 rb1, int rows1, float* y1, i64 ys1, const u8* W2, i64 rb2, int rows2,
                                             float* y2, i64 ys2, int nchunks, const i8* xq, const float* xd, int ncol,
                                             int nv, int accumulate, const float* xss = nullptr, float eps = 0.f) {
    static_assert(!X8 || NT == 1, "x8 activations: one token");
    __shared__ __align__(16) u8 sm_all[WARPS][RPW][MAXCH * CH];
    int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    int r0 = (blockIdx.x * WARPS + warp) * RPW;
    int v0 = blockIdx.y * NT;
    const u8* wr[RPW];
    float* yr[RPW];
    i64 ysr[RPW];
    int rr[RPW];
    bool ok[RPW];
    int n16 = nchunks * CH16;
#pragma unroll
    for (int j = 0; j < RPW; j++) {
        ok[j] = mv_seg_row(r0 + j, W0, rb0, rows0, y0, ys0, W1, rb1, rows1, y1, ys1, W2, rb2, rows2, y2, ys2, wr[j],
                           rr[j], yr[j], ysr[j]);
        if (ok[j])
            for (int i = lane; i < n16; i += 32) cp_async16(sm_all[warp][j] + 16 * i, (const int4*)wr[j] + i);
    }
    if (!ok[0]) return;
    pdl_wait();
    pdl_trigger();
    int nv_here = min(NT, nv - v0);
    const i8* xqv = xq + (i64)v0 * ncol;
    const float* xdv = xd + (i64)v0 * (ncol / (X8 ? 8 : 32));
    // X8: the group sums are loaded here and added after the dots, so their round trip overlaps
    // the activations' (plain loads: every warp reads the same 1.5 KB, which L1 serves after the
    // first; L2-only loads of one hot line by 4,096 warps queue in its slice).
    constexpr int XG = X8 ? (MAXCH * 256 / 8 + 31) / 32 : 1;
    float sqv[XG];
    if (X8) {
#pragma unroll
        for (int i = 0; i < XG; i++) sqv[i] = lane + 32 * i < (ncol >> 3) ? xss[lane + 32 * i] : 0.f;
    }
    cp_async_wait_all();
    __syncwarp();
#pragma unroll
    for (int j = 0; j < RPW; j++) {
        if (ok[j]) {
            float acc[NT];
#pragma unroll
            for (int t = 0; t < NT; t++) acc[t] = 0.f;
            mvqs_dot<NT, X8>(sm_all[warp][j], nchunks, 0, xqv, xdv, ncol, nv_here, acc, lane);
            if (X8) {
                float sq = 0.f;
#pragma unroll
                for (int i = 0; i < XG; i++) sq += sqv[i];
                acc[0] *= 1.0f / sqrtf(warp_sum(sq) / (float)ncol + eps);
            }
            mv_store<NT>(acc, yr[j], ysr[j], rr[j], v0, nv_here, lane, accumulate);
        }
    }
}
// "s2p": 4 warps x 2 rows of up to 12 chunks (26 KB), PRE.
#define MVQS2_INST(nt)                                                                                           \
    extern "C" __global__ void __launch_bounds__(128) mvqs_q8_0_##nt##s2p(                                       \
        const u8* W0, i64 rb0, int rows0, float* y0, i64 ys0, const u8* W1, i64 rb1, int rows1, float* y1, i64 ys1, \
        const u8* W2, i64 rb2, int rows2, float* y2, i64 ys2, int nchunks, const i8* xq, const float* xd, int ncol,  \
        int nv, int acc) {                                                                                       \
        mvqs_q8_rows<nt, 4, 12, 2>(W0, rb0, rows0, y0, ys0, W1, rb1, rows1, y1, ys1, W2, rb2, rows2, y2, ys2, nchunks, \
                                   xq, xd, ncol, nv, acc);                                                       \
    }
MVQS2_INST(1)
MVQS2_INST(4)
// mvqs_q8_0_1s2p on x8 activations (stream.cu's dn_x8: xd = ncol / 8 scales, xss = their sums of
// squares, eps the norm's): the attention norm's 1 / rms taken here, so the down before it
// needs no meeting of its blocks.
extern "C" __global__ void __launch_bounds__(128) mvqs_q8_0_1s2p8(
    const u8* W0, i64 rb0, int rows0, float* y0, i64 ys0, const u8* W1, i64 rb1, int rows1, float* y1, i64 ys1,
    const u8* W2, i64 rb2, int rows2, float* y2, i64 ys2, int nchunks, const i8* xq, const float* xd, int ncol, int nv,
    int acc, const float* xss, float eps) {
    mvqs_q8_rows<1, 4, 12, 2, true>(W0, rb0, rows0, y0, ys0, W1, rb1, rows1, y1, ys1, W2, rb2, rows2, y2, ys2, nchunks,
                                    xq, xd, ncol, nv, acc, xss, eps);
}

__device__ __forceinline__ void mma_s8_16832(int (&c)[4], const u32 (&a)[4], u32 b0, u32 b1) {
    asm volatile(
        "mma.sync.aligned.m16n8k32.row.col.s32.s8.s8.s32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%10,%11,%12,%13};"
        : "=r"(c[0]), "=r"(c[1]), "=r"(c[2]), "=r"(c[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1), "r"(0), "r"(0), "r"(0), "r"(0));
}

// The mma.m16n8k32 B fragment of lane (g, t) from the Q8_0 block at blk, the j-th 34-byte
// block of a 272-byte chunk row staged at a 4-byte boundary: b0 = quants 4t..4t+3, b1 = 16+4t..
// (odd blocks start 2 bytes into a word, so their quants are word-aligned; even ones are
// realigned with byte_perm).
__device__ __forceinline__ void q8_0_bfrag(const u8* blk, int j, int t, u32& b0, u32& b1) {
    if (j & 1) {
        b0 = *(const u32*)(blk + 2 + 4 * t);
        b1 = *(const u32*)(blk + 18 + 4 * t);
    } else {
        const u32* wp = (const u32*)blk;
        b0 = __byte_perm(wp[t], wp[t + 1], 0x5432);
        b1 = __byte_perm(wp[4 + t], wp[5 + t], 0x5432);
    }
}

// PRE: the first NB - 1 ring chunks (weights) are issued before pdl_wait (mvmma_q8_0p).
// NB: ring buffers per warp (4: mvmma_q8_0*, 3: mvmma3_q8_0*, whose 52 KB let four blocks share
// an SM: q/k/v's 512 blocks at M2.7 size run in one wave instead of 1.3; the host picks it only
// for such grids, the deeper ring is faster where the blocks take several waves anyway). The K
// quarters' partial sums go through each warp's own ring once its copies have landed (no extra
// shared memory). Same arithmetic for both, in the same order: bit-identical. NW: warps a block,
// each a K range of its own (8: mvmma8_q8_0*, for grids of fewer blocks than the SMs hold, e.g.
// the o-projection's 192: twice the warps an SM, half the chunks a warp; the NW partial sums are
// added in warp order, so its results differ from the 4-warp kernels' by f32 rounding).
template <bool PRE, int NB = MM8_NB, int NW = 4>
__device__ __forceinline__ void mvmma_q8_0_impl(const u8* W0, i64 rb0, int rows0, float* y0, i64 ys0, const u8* W1,
                                                i64 rb1, int rows1, float* y1, i64 ys1, const u8* W2, i64 rb2,
                                                int rows2, float* y2, i64 ys2, int nchunks, const i8* xq,
                                                const float* xd, int ncol, int nv, int accumulate) {
    extern __shared__ __align__(16) u8 dyn_smem[];
    int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    int g = lane >> 2, t = lane & 3;
    int r0 = blockIdx.x * 16;
    int v0 = blockIdx.y * 32;
    u8* ring = dyn_smem + warp * (NB * MM8_BUF);
    int c_beg = warp * nchunks / NW, c_end = (warp + 1) * nchunks / NW;
    int n = c_end - c_beg;
    // Piece p (16 bytes) of a chunk belongs to row p / 17; the row's source, once per lane.
    const u8* src[9];
#pragma unroll
    for (int k = 0; k < 9; k++) {
        int p = lane + 32 * k;
        const u8* w = nullptr;
        int rr;
        float* y;
        i64 ys;
        if (p < 16 * CH16 && mv_seg_row(r0 + p / CH16, W0, rb0, rows0, y0, ys0, W1, rb1, rows1, y1, ys1, W2, rb2, rows2,
                                        y2, ys2, w, rr, y, ys))
            w += (p % CH16) * 16;
        else
            w = nullptr;
        src[k] = w;
    }
    auto issue = [&](int i) {  // chunk i of this warp into buffer i % NB (always one group)
        if (i < n) {
            u8* b = ring + (i % NB) * MM8_BUF;
            i64 off = (i64)(c_beg + i) * CH;
#pragma unroll
            for (int k = 0; k < 9; k++) {
                int p = lane + 32 * k;
                if (src[k]) cp_async16(b + p * 16, src[k] + off);
            }
        }
        cp_async_commit();
    };
    int tok[4];
    bool tv[4];
#pragma unroll
    for (int i = 0; i < 4; i++) {
        tok[i] = v0 + (i >> 1) * 16 + (i & 1) * 8 + g;  // m tile i >> 1, A row g or g + 8
        tv[i] = tok[i] < nv;
    }
    float acc[2][2][4];  // [m tile][n tile][c register]
#pragma unroll
    for (int m = 0; m < 2; m++)
#pragma unroll
        for (int q = 0; q < 2; q++)
#pragma unroll
            for (int i = 0; i < 4; i++) acc[m][q][i] = 0.f;
#pragma unroll
    for (int i = 0; i < NB - 1; i++) issue(i);
    if (PRE) {
        pdl_wait();
        pdl_trigger();
    }
    for (int i = 0; i < n; i++) {
        issue(i + NB - 1);
        cp_async_wait<NB - 1>();  // chunk i has landed (this lane's pieces)
        __syncwarp();             // ... and every lane's
        const u8* b = ring + (i % NB) * MM8_BUF;
        int kb0 = (c_beg + i) * 8;
#pragma unroll
        for (int j = 0; j < 8; j++) {
            int kb = kb0 + j;
            u32 a[2][4];
            float dx[2][2];
#pragma unroll
            for (int m = 0; m < 2; m++)
#pragma unroll
                for (int h = 0; h < 2; h++) {
                    int ti = 2 * m + h;
                    const i8* xr = xq + (i64)tok[ti] * ncol + kb * 32;
                    a[m][h] = tv[ti] ? *(const u32*)(xr + 4 * t) : 0u;
                    a[m][2 + h] = tv[ti] ? *(const u32*)(xr + 16 + 4 * t) : 0u;
                    dx[m][h] = tv[ti] ? xd[(i64)tok[ti] * (ncol / 32) + kb] : 0.f;
                }
#pragma unroll
            for (int q = 0; q < 2; q++) {
                const u8* blk = b + (q * 8 + g) * CH + j * 34;
                u32 b0, b1;
                q8_0_bfrag(blk, j, t, b0, b1);
                // This lane's output columns: rows q * 8 + 2t and + 1.
                float dw0 = f16_to_f32(*(const u16*)(b + (q * 8 + 2 * t) * CH + j * 34));
                float dw1 = f16_to_f32(*(const u16*)(b + (q * 8 + 2 * t + 1) * CH + j * 34));
#pragma unroll
                for (int m = 0; m < 2; m++) {
                    int cr[4];
                    mma_s8_16832(cr, a[m], b0, b1);
                    acc[m][q][0] += dx[m][0] * dw0 * (float)cr[0];
                    acc[m][q][1] += dx[m][0] * dw1 * (float)cr[1];
                    acc[m][q][2] += dx[m][1] * dw0 * (float)cr[2];
                    acc[m][q][3] += dx[m][1] * dw1 * (float)cr[3];
                }
            }
        }
        __syncwarp();  // every lane is done with this buffer before it is refilled
    }
    cp_async_wait<0>();
    __syncwarp();  // every lane's copies have landed and every lane is done reading the ring
    // Quarters 1..3 hand their sums (16 x 32 floats, in their own ring) to quarter 0, which
    // adds them in order and stores.
    if (warp > 0) {
        float* mine = (float*)ring;
#pragma unroll
        for (int m = 0; m < 2; m++)
#pragma unroll
            for (int q = 0; q < 2; q++)
#pragma unroll
                for (int i = 0; i < 4; i++) mine[(m * 8 + q * 4 + i) * 32 + lane] = acc[m][q][i];
    }
    __syncthreads();
    if (warp > 0) return;
#pragma unroll
    for (int m = 0; m < 2; m++)
#pragma unroll
        for (int q = 0; q < 2; q++)
#pragma unroll
            for (int i = 0; i < 4; i++) {
                float v = acc[m][q][i];
#pragma unroll
                for (int w = 1; w < NW; w++) v += ((const float*)(dyn_smem + w * (NB * MM8_BUF)))[(m * 8 + q * 4 + i) * 32 + lane];
                int ti = 2 * m + (i >> 1);  // token g or g + 8 of m tile m
                int r = r0 + q * 8 + 2 * t + (i & 1);
                const u8* wr;
                int rr;
                float* y;
                i64 ys;
                if (tv[ti] && mv_seg_row(r, W0, rb0, rows0, y0, ys0, W1, rb1, rows1, y1, ys1, W2, rb2, rows2, y2, ys2,
                                         wr, rr, y, ys)) {
                    float* yp = y + (i64)tok[ti] * ys + rr;
                    *yp = accumulate ? *yp + v : v;
                }
            }
}

// The entry points: NAME (waits for the previous kernel first) and NAMEp (PRE), NB ring
// buffers a warp, NW warps a block.
#define MVMMA_INST(name, nb, nw)                                                                                   \
    extern "C" __global__ void __launch_bounds__(32 * nw) name(                                                   \
        const u8* W0, i64 rb0, int rows0, float* y0, i64 ys0, const u8* W1, i64 rb1, int rows1, float* y1, i64 ys1, \
        const u8* W2, i64 rb2, int rows2, float* y2, i64 ys2, int nchunks, const i8* xq, const float* xd, int ncol,  \
        int nv, int accumulate) {                                                                                  \
        pdl_enter();                                                                                               \
        mvmma_q8_0_impl<false, nb, nw>(W0, rb0, rows0, y0, ys0, W1, rb1, rows1, y1, ys1, W2, rb2, rows2, y2, ys2,   \
                                       nchunks, xq, xd, ncol, nv, accumulate);                                     \
    }                                                                                                              \
    extern "C" __global__ void __launch_bounds__(32 * nw) name##p(                                                \
        const u8* W0, i64 rb0, int rows0, float* y0, i64 ys0, const u8* W1, i64 rb1, int rows1, float* y1, i64 ys1, \
        const u8* W2, i64 rb2, int rows2, float* y2, i64 ys2, int nchunks, const i8* xq, const float* xd, int ncol,  \
        int nv, int accumulate) {                                                                                  \
        mvmma_q8_0_impl<true, nb, nw>(W0, rb0, rows0, y0, ys0, W1, rb1, rows1, y1, ys1, W2, rb2, rows2, y2, ys2,    \
                                      nchunks, xq, xd, ncol, nv, accumulate);                                      \
    }
MVMMA_INST(mvmma_q8_0, MM8_NB, 4)
MVMMA_INST(mvmma3_q8_0, 3, 4)
MVMMA_INST(mvmma8_q8_0, 3, 8)

// ------------------------------------------------------------- MoE (decode) -------------

// Pair p = blockIdx.y (token p / k, expert ids[p]): act[p][r] = silu(gate_r . x) * (up_r . x)
// for the block's 32 rows, quantized to q8 (aq [p][ff], ad [p][ff / 32]). grid (ff / 32,
// npairs), block 32 * 32 / ROWS.
// ROWS rows per warp, PH chunks per matrix per phase; the block has 32 / ROWS warps (32 rows).
// Variants (host: MINIMAX_GU=4|2|1): (4, 6) 8 warps, (2, 3) 16 warps, (1, 2) 32 warps.
template <int T, int GU_ROWS, int GU_PH>
__device__ __forceinline__ void moe_gate_up(const u8* G, const u8* U, i64 rb, i64 es, int nchunks, const int* ids,
                                            int k, const i8* xq, const float* xd, int ncol, i8* aq, float* ad,
                                            int ff) {
    __shared__ __align__(16) u8 sm_all[32 / GU_ROWS][2 * GU_PH * CH];
    __shared__ float act[32];
    int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    int p = blockIdx.y;
    int t = p / k;
    i64 eoff = (i64)ids[p] * es;
    const i8* xqt = xq + (i64)t * ncol;
    const float* xdt = xd + (i64)t * (ncol / 32);
    u8* sm = sm_all[warp];
    // Steps (row i, phase ph) in order; the next step's loads are issued before this step's
    // dot products (software pipelining through registers).
    const int L = (2 * GU_PH * CH16 + 31) / 32;
    int nph = (nchunks + GU_PH - 1) / GU_PH;
    int nsteps = GU_ROWS * nph;
    int4 v[L];
    auto ld = [&](int s) {
        int i = s / nph, c0 = (s - i * nph) * GU_PH;
        int nch = min(GU_PH, nchunks - c0);
        i64 ro = eoff + (i64)(blockIdx.x * 32 + warp * GU_ROWS + i) * rb + (i64)c0 * CH;
        stage_ld<L>(v, nch * CH16, 2, [&](int j) { return (j ? U : G) + ro; }, lane);
    };
    ld(0);
    float ag[1] = {0.f}, au[1] = {0.f};
    for (int s = 0; s < nsteps; s++) {
        int i = s / nph, c0 = (s - i * nph) * GU_PH;
        int nch = min(GU_PH, nchunks - c0);
        stage_st<L>(sm, v, 2 * nch * CH16, lane);
        if (s + 1 < nsteps) ld(s + 1);
        dot_staged<T, 1>(sm, nch, c0, xqt, 0, xdt, 0, 1, ag, lane);
        dot_staged<T, 1>(sm + nch * CH, nch, c0, xqt, 0, xdt, 0, 1, au, lane);
        if (c0 + nch == nchunks) {
            float g = warp_sum(ag[0]), u = warp_sum(au[0]);
            if (lane == 0) act[warp * GU_ROWS + i] = silu_times(g, u);
            ag[0] = 0.f;
            au[0] = 0.f;
        }
    }
    gu_act_q8(act, warp, lane, p, aq, ad, ff);
}

// Register-direct IQ4_XS gate/up (MINIMAX_GU_REG=2|4|4n|2n picks the shape, =0 the staged
// moe_gate_up above; the default is the persistent moe_gate_up_pst below, reg2 for inputs wider
// than 3072): no shared-memory staging. Lane
// `lane` owns units (32-value sub-blocks) u = u0 + lane + 32 i,
// i < GR_XU, the same columns for every row, so its activation slice (2 x int4 + scale per
// unit) is loaded once and kept in registers across the warp's GU_ROWS rows. Per unit it reads
// the block header (d, scales_h, scales_l: one 8-byte load, the same address for the 8 lanes of
// a block) and its 16 code bytes (two 8-byte loads) straight from global memory; the next row's
// loads are issued before this row's dp4a (PF = 1; the "n" variants: no prefetch, fewer
// registers, reg4n capped at 2 blocks per SM). Same grid as moe_gate_up: (ff / 32, npairs), block
// 32 * 32 / GU_ROWS.
#define GR_XU 3
__device__ __forceinline__ uint2 ldg_u2(const u8* p) { return __ldg((const uint2*)p); }
__device__ __forceinline__ float iq4_unit_reg(uint2 h, uint2 qa, uint2 qb, int sb, int4 xa, int4 xb) {
    float d = f16_to_f32((u16)(h.x & 0xffffu));
    int ls = ((h.y >> (4 * sb)) & 15) | (((h.x >> (16 + 2 * sb)) & 3) << 4);
    u32 lo[4], hi[4];
    iq4_lookup(qa.x, lo[0], hi[0]);
    iq4_lookup(qa.y, lo[1], hi[1]);
    iq4_lookup(qb.x, lo[2], hi[2]);
    iq4_lookup(qb.y, lo[3], hi[3]);
    int s = __dp4a((int)lo[0], xa.x, 0);
    s = __dp4a((int)lo[1], xa.y, s);
    s = __dp4a((int)lo[2], xa.z, s);
    s = __dp4a((int)lo[3], xa.w, s);
    s = __dp4a((int)hi[0], xb.x, s);
    s = __dp4a((int)hi[1], xb.y, s);
    s = __dp4a((int)hi[2], xb.z, s);
    s = __dp4a((int)hi[3], xb.w, s);
    return d * (float)(ls - 32) * (float)s;
}
struct GrRow {
    uint2 gh[GR_XU], ga[GR_XU], gb[GR_XU], uh[GR_XU], ua[GR_XU], ub[GR_XU];
};
// The activation slice of lane `lane` for units ub0 + lane + 32 i (i < GR_XU; q8 row at xqt /
// xdt, nu units): two int4 of codes and the scale each, scale 0 past nu.
__device__ __forceinline__ void gr_x_load_at(const i8* xqt, const float* xdt, int ub0, int lane, int nu,
                                             int4 (&xa)[GR_XU], int4 (&xb)[GR_XU], float (&xs)[GR_XU]) {
#pragma unroll
    for (int i = 0; i < GR_XU; i++) {
        int un = ub0 + lane + 32 * i;
        xs[i] = 0.f;
        if (un < nu) {
            const int4* xp = (const int4*)(xqt + un * 32);
            xa[i] = xp[0];
            xb[i] = xp[1];
            xs[i] = xdt[un];
        }
    }
}
__device__ __forceinline__ void gr_load(GrRow& w, const u8* g, const u8* u, int ub0, int lane, int nu) {
#pragma unroll
    for (int i = 0; i < GR_XU; i++) {
        int un = ub0 + lane + 32 * i;
        if (un < nu) {
            int off = (un >> 3) * 136, qo = off + 8 + 16 * (un & 7);
            w.gh[i] = ldg_u2(g + off);
            w.ga[i] = ldg_u2(g + qo);
            w.gb[i] = ldg_u2(g + qo + 8);
            w.uh[i] = ldg_u2(u + off);
            w.ua[i] = ldg_u2(u + qo);
            w.ub[i] = ldg_u2(u + qo + 8);
        }
    }
}
template <int GU_ROWS, int PF>
__device__ __forceinline__ void moe_gate_up_reg_iq4(const u8* G, const u8* U, i64 rb, i64 es, const int* ids, int k,
                                                    const i8* xq, const float* xd, int ncol, i8* aq, float* ad,
                                                    int ff) {
    __shared__ float act[32];
    int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    int p = blockIdx.y;
    int t = p / k;
    i64 eoff = (i64)ids[p] * es;
    const i8* xqt = xq + (i64)t * ncol;
    const float* xdt = xd + (i64)t * (ncol / 32);
    int nu = ncol >> 5;
    int row0 = blockIdx.x * 32 + warp * GU_ROWS;
    float ag[GU_ROWS], au[GU_ROWS];
#pragma unroll
    for (int r = 0; r < GU_ROWS; r++) ag[r] = au[r] = 0.f;
    for (int ub0 = 0; ub0 < nu; ub0 += 32 * GR_XU) {
        int4 xa[GR_XU], xb[GR_XU];
        float xs[GR_XU];
        GrRow cur, nxt;
        gr_load(cur, G + eoff + (i64)row0 * rb, U + eoff + (i64)row0 * rb, ub0, lane, nu);
        gr_x_load_at(xqt, xdt, ub0, lane, nu, xa, xb, xs);
#pragma unroll
        for (int r = 0; r < GU_ROWS; r++) {
            if (!PF && r > 0)
                gr_load(cur, G + eoff + (i64)(row0 + r) * rb, U + eoff + (i64)(row0 + r) * rb, ub0, lane, nu);
            if (PF && r + 1 < GU_ROWS)
                gr_load(nxt, G + eoff + (i64)(row0 + r + 1) * rb, U + eoff + (i64)(row0 + r + 1) * rb, ub0, lane,
                        nu);
#pragma unroll
            for (int i = 0; i < GR_XU; i++) {
                int un = ub0 + lane + 32 * i;
                if (un < nu) {
                    int sb = un & 7;
                    ag[r] += xs[i] * iq4_unit_reg(cur.gh[i], cur.ga[i], cur.gb[i], sb, xa[i], xb[i]);
                    au[r] += xs[i] * iq4_unit_reg(cur.uh[i], cur.ua[i], cur.ub[i], sb, xa[i], xb[i]);
                }
            }
            if (PF && r + 1 < GU_ROWS) cur = nxt;
        }
    }
#pragma unroll
    for (int r = 0; r < GU_ROWS; r++) {
        float g = warp_sum(ag[r]), u = warp_sum(au[r]);
        if (lane == 0) act[warp * GU_ROWS + r] = silu_times(g, u);
    }
    gu_act_q8(act, warp, lane, p, aq, ad, ff);
}
extern "C" __global__ void __launch_bounds__(256) moe_gate_up_reg4_iq4_xs(
    const u8* G, const u8* U, i64 rb, i64 es, int nchunks, const int* ids, int k, const i8* xq, const float* xd,
    int ncol, i8* aq, float* ad, int ff) {
    pdl_enter();
    moe_gate_up_reg_iq4<4, 1>(G, U, rb, es, ids, k, xq, xd, ncol, aq, ad, ff);
}
extern "C" __global__ void __launch_bounds__(512) moe_gate_up_reg2_iq4_xs(
    const u8* G, const u8* U, i64 rb, i64 es, int nchunks, const int* ids, int k, const i8* xq, const float* xd,
    int ncol, i8* aq, float* ad, int ff) {
    pdl_enter();
    moe_gate_up_reg_iq4<2, 1>(G, U, rb, es, ids, k, xq, xd, ncol, aq, ad, ff);
}
extern "C" __global__ void __launch_bounds__(256, 2) moe_gate_up_reg4n_iq4_xs(
    const u8* G, const u8* U, i64 rb, i64 es, int nchunks, const int* ids, int k, const i8* xq, const float* xd,
    int ncol, i8* aq, float* ad, int ff) {
    pdl_enter();
    moe_gate_up_reg_iq4<4, 0>(G, U, rb, es, ids, k, xq, xd, ncol, aq, ad, ff);
}
extern "C" __global__ void __launch_bounds__(512) moe_gate_up_reg2n_iq4_xs(
    const u8* G, const u8* U, i64 rb, i64 es, int nchunks, const int* ids, int k, const i8* xq, const float* xd,
    int ncol, i8* aq, float* ad, int ff) {
    pdl_enter();
    moe_gate_up_reg_iq4<2, 0>(G, U, rb, es, ids, k, xq, xd, ncol, aq, ad, ff);
}

// iq4_prmt / iq4_lookup_il (the cheaper IQ4 decode, session 5): common.cuh.
// The codebook words t0 / t2 for iq4_lookup_il as values ptxas cannot see through, so they stay
// in two registers: z must be 0 at run time but unknown to the compiler (an empty asm or a
// shuffle of the literal is folded back into the constant) and per thread (a uniform z puts
// them in uniform registers, copied out before every use). Callers pass (row_bytes >> 62) &
// threadIdx.x.
__device__ __forceinline__ void iq4_pin(u32 z, u32& t0, u32& t2) {
    t0 = IQ4_T0 ^ z;
    t2 = IQ4_T2 ^ z;
}
// iq4_lookup's result (lo / hi nibbles of bytes 0..3) from iq4_lookup_il's: two prmts.
__device__ __forceinline__ void iq4_lookup_lh(u32 w, u32& lo, u32& hi, u32 t0 = IQ4_T0, u32 t2 = IQ4_T2) {
    u32 r0, r1;
    iq4_lookup_il(w, r0, r1, t0, t2);
    lo = iq4_prmt(r0, r1, 0x6420u);
    hi = iq4_prmt(r0, r1, 0x7531u);
}
// A unit's activations (xa = elements 0..15, xb = 16..31) into iq4_lookup_il's order: word 2i
// = (x[4i], x[4i+16], x[4i+1], x[4i+17]), word 2i+1 = (x[4i+2], x[4i+18], x[4i+3], x[4i+19]).
__device__ __forceinline__ void iq4_x_il(int4& xa, int4& xb) {
    int4 a = xa, b = xb;
    xa = make_int4((int)iq4_prmt(a.x, b.x, 0x5140u), (int)iq4_prmt(a.x, b.x, 0x7362u),
                   (int)iq4_prmt(a.y, b.y, 0x5140u), (int)iq4_prmt(a.y, b.y, 0x7362u));
    xb = make_int4((int)iq4_prmt(a.z, b.z, 0x5140u), (int)iq4_prmt(a.z, b.z, 0x7362u),
                   (int)iq4_prmt(a.w, b.w, 0x5140u), (int)iq4_prmt(a.w, b.w, 0x7362u));
}
// iq4_unit_reg with interleaved activations (iq4_x_il): the same integer dot product (as two
// chains of 4 dp4a, added: exact) and the same f32 expression, so bit-identical.
// A unit's scale d * (ls - 32) (sub-block sb of the superblock header h), as iq4_unit_reg and
// iq4_decode compute it.
__device__ __forceinline__ float iq4_unit_scale(uint2 h, int sb) {
    int ls = ((h.y >> (4 * sb)) & 15) | (((h.x >> (16 + 2 * sb)) & 3) << 4);
    return f16_to_f32((u16)(h.x & 0xffffu)) * (float)(ls - 32);
}
// w[0..3] . xa + w[4..7] . xb as two dp4a chains, added (exact).
__device__ __forceinline__ int iq4_dot2(const u32 (&w)[8], int4 xa, int4 xb) {
    int s0 = __dp4a((int)w[0], xa.x, 0);
    int s1 = __dp4a((int)w[4], xb.x, 0);
    s0 = __dp4a((int)w[1], xa.y, s0);
    s1 = __dp4a((int)w[5], xb.y, s1);
    s0 = __dp4a((int)w[2], xa.z, s0);
    s1 = __dp4a((int)w[6], xb.z, s1);
    s0 = __dp4a((int)w[3], xa.w, s0);
    s1 = __dp4a((int)w[7], xb.w, s1);
    return s0 + s1;
}
__device__ __forceinline__ float iq4_unit_il(uint2 h, uint2 qa, uint2 qb, int sb, int4 xa, int4 xb,
                                             u32 t0 = IQ4_T0, u32 t2 = IQ4_T2) {
    u32 r[8];
    iq4_lookup_il(qa.x, r[0], r[1], t0, t2);
    iq4_lookup_il(qa.y, r[2], r[3], t0, t2);
    iq4_lookup_il(qb.x, r[4], r[5], t0, t2);
    iq4_lookup_il(qb.y, r[6], r[7], t0, t2);
    return iq4_unit_scale(h, sb) * (float)iq4_dot2(r, xa, xb);
}
// A unit's codes through iq4_lookup_lh, in iq4_lookup's lo / hi order: w[i] = lo of word i,
// w[4 + i] = hi of word i (qa.x, qa.y, qb.x, qb.y).
__device__ __forceinline__ void iq4_unit_lh_codes(uint2 qa, uint2 qb, u32 (&w)[8], u32 t0, u32 t2) {
    iq4_lookup_lh(qa.x, w[0], w[4], t0, t2);
    iq4_lookup_lh(qa.y, w[1], w[5], t0, t2);
    iq4_lookup_lh(qb.x, w[2], w[6], t0, t2);
    iq4_lookup_lh(qb.y, w[3], w[7], t0, t2);
}
// iq4_unit_reg with natural-order activations through iq4_lookup_lh (two dp4a chains).
__device__ __forceinline__ float iq4_unit_lh(uint2 h, uint2 qa, uint2 qb, int sb, int4 xa, int4 xb,
                                             u32 t0 = IQ4_T0, u32 t2 = IQ4_T2) {
    u32 w[8];
    iq4_unit_lh_codes(qa, qb, w, t0, t2);
    return iq4_unit_scale(h, sb) * (float)iq4_dot2(w, xa, xb);
}

// Persistent IQ4_XS gate/up (the default for inputs of at most 96 units, i.e. 3072 columns):
// the same per-row arithmetic as moe_gate_up_reg2 (bit-identical), but the grid is one wave
// (the host launches SMs x resident blocks) and each block walks the (pair, 32-row group) tasks
// blockIdx.x, + gridDim.x, ...; warp w computes rows 2w and 2w + 1 of each task, and the next
// row's weight loads (across task boundaries too) are issued before this row's dp4a work, so an
// SM always has loads in flight while it computes (the per-task grid of reg2 runs ~3 waves of one
// block per SM, each waiting for its loads, then computing with nothing in flight). The q8
// epilogue of a task is done by warp 0 from a double-buffered act row (one barrier per task).
// The lane's activation units (ncol <= 32 * GR_XU * 32: one round) stay in registers while the
// token does not change. ff = the activations' row stride (>= grows, the expert's rows).
// grid (min(tasks, resident)), block 512.
__device__ __forceinline__ void gr_x_load(const i8* xq, const float* xd, int t, int ncol, int lane, int nu,
                                          int4 (&xa)[GR_XU], int4 (&xb)[GR_XU], float (&xs)[GR_XU]) {
    gr_x_load_at(xq + (i64)t * ncol, xd + (i64)t * (ncol / 32), 0, lane, nu, xa, xb, xs);
}
template <bool IL>
__device__ __forceinline__ void moe_gate_up_pst_impl(const u8* G, const u8* U, i64 rb, i64 es, const int* ids, int k,
                                                     const i8* xq, const float* xd, int ncol, i8* aq, float* ad,
                                                     int ff, int npairs, int grows) {
    __shared__ float act[2][32];
    int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    int nu = ncol >> 5, nrg = grows >> 5, ntask = npairs * nrg;
    int task = blockIdx.x;
    if (task >= ntask) return;  // block-uniform
    // Weight rows of step (task, i): gate/up row (task % nrg) * 32 + 2 warp + i of the expert
    // of pair task / nrg.
    auto row_off = [&](int tk, int e, int i) { return (i64)e * es + (i64)((tk % nrg) * 32 + warp * 2 + i) * rb; };
    int e_cur = ids[task / nrg];
    GrRow cur, nxt;
    i64 o0 = row_off(task, e_cur, 0);
    gr_load(cur, G + o0, U + o0, 0, lane, nu);
    int t_x = -1;
    int4 xa[GR_XU], xb[GR_XU];
    float xs[GR_XU];
    int buf = 0;
    for (; task < ntask; task += gridDim.x) {
        int p = task / nrg, t = p / k;
        int ntk = task + gridDim.x;
        int e_nxt = ntk < ntask ? ids[ntk / nrg] : 0;
        if (t != t_x) {
            gr_x_load(xq, xd, t, ncol, lane, nu, xa, xb, xs);
            if (IL) {
#pragma unroll
                for (int j = 0; j < GR_XU; j++) iq4_x_il(xa[j], xb[j]);
            }
            t_x = t;
        }
        float ag[2], au[2];
#pragma unroll
        for (int i = 0; i < 2; i++) {
            // Next step's loads: row 1 of this task, or row 0 of the next one.
            if (i == 0) {
                i64 o = row_off(task, e_cur, 1);
                gr_load(nxt, G + o, U + o, 0, lane, nu);
            } else if (ntk < ntask) {
                i64 o = row_off(ntk, e_nxt, 0);
                gr_load(nxt, G + o, U + o, 0, lane, nu);
            }
            ag[i] = au[i] = 0.f;
#pragma unroll
            for (int j = 0; j < GR_XU; j++) {
                int un = lane + 32 * j;
                if (un < nu) {
                    int sb = un & 7;
                    if (IL) {
                        ag[i] += xs[j] * iq4_unit_il(cur.gh[j], cur.ga[j], cur.gb[j], sb, xa[j], xb[j]);
                        au[i] += xs[j] * iq4_unit_il(cur.uh[j], cur.ua[j], cur.ub[j], sb, xa[j], xb[j]);
                    } else {
                        ag[i] += xs[j] * iq4_unit_reg(cur.gh[j], cur.ga[j], cur.gb[j], sb, xa[j], xb[j]);
                        au[i] += xs[j] * iq4_unit_reg(cur.uh[j], cur.ua[j], cur.ub[j], sb, xa[j], xb[j]);
                    }
                }
            }
            cur = nxt;
        }
#pragma unroll
        for (int i = 0; i < 2; i++) {
            float g = warp_sum(ag[i]), u = warp_sum(au[i]);
            if (lane == 0) act[buf][warp * 2 + i] = silu_times(g, u);
        }
        __syncthreads();
        if (warp == 0) {
            int rg = task % nrg;
            int q = q8_lane(act[buf][lane], ad + (i64)p * (ff / 32) + rg);
            aq[(i64)p * ff + rg * 32 + lane] = (i8)q;
        }
        buf ^= 1;
        e_cur = e_nxt;
    }
}
extern "C" __global__ void __launch_bounds__(512) moe_gate_up_pst_iq4_xs(const u8* G, const u8* U, i64 rb, i64 es,
                                                                         int nchunks, const int* ids, int k,
                                                                         const i8* xq, const float* xd, int ncol,
                                                                         i8* aq, float* ad, int ff, int npairs,
                                                                         int grows) {
    pdl_enter();
    moe_gate_up_pst_impl<false>(G, U, rb, es, ids, k, xq, xd, ncol, aq, ad, ff, npairs, grows);
}
// moe_gate_up_pst with the activations interleaved in registers once per token (iq4_x_il) and
// the weights decoded by iq4_lookup_il (no lo/hi reordering): same integer sums, same f32
// arithmetic, bit-identical. The default (host GateUpKind::PersistIl); M2.7 layer on one H200:
// 22.6 -> 20.2 us. Keeps pdl_enter's wait-before-trigger: moe_down_rx4 relies on it.
extern "C" __global__ void __launch_bounds__(512) moe_gate_up_psx_iq4_xs(const u8* G, const u8* U, i64 rb, i64 es,
                                                                         int nchunks, const int* ids, int k,
                                                                         const i8* xq, const float* xd, int ncol,
                                                                         i8* aq, float* ad, int ff, int npairs,
                                                                         int grows) {
    pdl_enter();
    moe_gate_up_pst_impl<true>(G, U, rb, es, ids, k, xq, xd, ncol, aq, ad, ff, npairs, grows);
}

// moe_gate_up_psx at two blocks per SM (32 warps instead of 16; Nsight: pst / psx issue from
// ~1.3 eligible warps per scheduler, 127 registers, so the codebook constants are even
// re-materialized per use). The token's interleaved activations live in shared memory (loaded
// by the block when the token changes, read back per unit: 2 LDS.128 + 1 LDS), and a step is
// one matrix row (gate row 2w, up row 2w, gate 2w + 1, up 2w + 1), the next step's weights
// in flight (3 units x 24 bytes per lane). Same units, same f32 expressions and order as
// pst / psx: bit-identical. Wait before trigger (pdl_enter), as moe_down_rx4 requires.
// Measured slower than psx (23.9 vs 20.2 us per M2.7 layer; Nsight: twice the eligible warps
// but the same issue rate, ~0.5 per scheduler, 64 registers with some spills): opt-in only
// (MINIMAX_GU_REG=y).
// grid (min(tasks, SMs x 2)), block 512.
struct GuW {
    uint2 h[GR_XU], a[GR_XU], b[GR_XU];
};
__device__ __forceinline__ void gu_wload(GuW& w, const u8* m, int lane, int nu) {
#pragma unroll
    for (int i = 0; i < GR_XU; i++) {
        int un = lane + 32 * i;
        if (un < nu) {
            int off = (un >> 3) * 136, qo = off + 8 + 16 * (un & 7);
            w.h[i] = ldg_u2(m + off);
            w.a[i] = ldg_u2(m + qo);
            w.b[i] = ldg_u2(m + qo + 8);
        }
    }
}
extern "C" __global__ void __launch_bounds__(512, 2) moe_gate_up_psy_iq4_xs(const u8* G, const u8* U, i64 rb, i64 es,
                                                                            int nchunks, const int* ids, int k,
                                                                            const i8* xq, const float* xd, int ncol,
                                                                            i8* aq, float* ad, int ff, int npairs,
                                                                            int grows) {
    pdl_enter();
    __shared__ int4 sxa[GR_XU * 32], sxb[GR_XU * 32];
    __shared__ float sxd[GR_XU * 32];
    __shared__ float act[2][32];
    int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    int nu = ncol >> 5, nrg = grows >> 5, ntask = npairs * nrg;
    int task = blockIdx.x;
    if (task >= ntask) return;  // block-uniform
    // Step s of a task: matrix s & 1 (gate, up), row (task % nrg) * 32 + 2 warp + (s >> 1).
    auto woff = [&](int tk, int e, int s) { return (i64)e * es + (i64)((tk % nrg) * 32 + warp * 2 + (s >> 1)) * rb; };
    int e_cur = ids[task / nrg];
    u32 t0, t2;
    iq4_pin((u32)(rb >> 62) & threadIdx.x, t0, t2);
    GuW cur, nxt;
    gu_wload(cur, G + woff(task, e_cur, 0), lane, nu);
    int t_x = -1, buf = 0;
    for (; task < ntask; task += gridDim.x) {
        int p = task / nrg, t = p / k;
        int ntk = task + gridDim.x;
        int e_nxt = ntk < ntask ? ids[ntk / nrg] : 0;
        if (t != t_x) {  // block-uniform
            __syncthreads();  // every warp is done with the previous token's activations
            for (int u = threadIdx.x; u < nu; u += blockDim.x) {
                const int4* xp = (const int4*)(xq + (i64)t * ncol + u * 32);
                int4 a = xp[0], b = xp[1];
                iq4_x_il(a, b);
                sxa[u] = a;
                sxb[u] = b;
                sxd[u] = xd[(i64)t * (ncol / 32) + u];
            }
            __syncthreads();
            t_x = t;
        }
        float acc[4];
#pragma unroll
        for (int s = 0; s < 4; s++) {
            if (s < 3) {
                gu_wload(nxt, ((s + 1) & 1 ? U : G) + woff(task, e_cur, s + 1), lane, nu);
            } else if (ntk < ntask) {
                gu_wload(nxt, G + woff(ntk, e_nxt, 0), lane, nu);
            }
            float a = 0.f;
#pragma unroll
            for (int j = 0; j < GR_XU; j++) {
                int un = lane + 32 * j;
                if (un < nu) a += sxd[un] * iq4_unit_il(cur.h[j], cur.a[j], cur.b[j], un & 7, sxa[un], sxb[un], t0, t2);
            }
            acc[s] = a;
            cur = nxt;
        }
#pragma unroll
        for (int i = 0; i < 2; i++) {
            float g = warp_sum(acc[2 * i]), u = warp_sum(acc[2 * i + 1]);
            if (lane == 0) act[buf][warp * 2 + i] = silu_times(g, u);
        }
        __syncthreads();
        if (warp == 0) {
            int rg = task % nrg;
            int q = q8_lane(act[buf][lane], ad + (i64)p * (ff / 32) + rg);
            aq[(i64)p * ff + rg * 32 + lane] = (i8)q;
        }
        buf ^= 1;
        e_cur = e_nxt;
    }
}

// Persistent IQ4_XS down + weighted combine (MINIMAX_DN=p, when a row's k * ff / 32 units fit
// one round of 4 warps x 32 lanes x 3; measured no faster than reg4, the default): moe_down_reg4's
// arithmetic (bit-identical),
// one wave of blocks walking the (token, row pair) tasks blockIdx.x, + gridDim.x, ...; warp w
// takes part w % 4 of row 2 task + w / 4 (units s * 32 + lane + 128 i of the row's k expert
// rows). The lane's units, their expert, routing weight and activations are the same for every
// row of a token (registers); the next task's weight loads are issued before this task's dp4a
// work. Partial sums of a row are added in a fixed order from a double-buffered array (one
// barrier per task). grid (min(tasks, resident)), block 256; k <= 32.
extern "C" __global__ void __launch_bounds__(256) moe_down_pst_iq4_xs(const u8* W, i64 rb, i64 es, int rows,
                                                                      int nchunks, const int* ids, const float* wts,
                                                                      int k, const i8* aq, const float* ad, int ff,
                                                                      float* hidden, i64 hs, int nt) {
    pdl_enter();
    const int DU = 3;
    __shared__ float part[2][8];
    int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    int s = warp & 3;
    int upe = ff >> 5, nu = k * upe;
    int nrp = (rows + 1) >> 1, ntask = nt * nrp;
    int task = blockIdx.x;
    // The lane's units (fixed), their expert slot j and offset uu inside the expert row.
    int jj[DU], uo[DU];
    bool ok[DU];
#pragma unroll
    for (int i = 0; i < DU; i++) {
        int un = s * 32 + lane + 128 * i;
        ok[i] = un < nu;
        jj[i] = ok[i] ? un / upe : 0;
        int uu = un - jj[i] * upe;
        uo[i] = uu;
    }
    uint2 h[DU], qa[DU], qb[DU], hn[DU], qan[DU], qbn[DU];
    i64 eo[DU];  // expert offsets of the current token
    auto wload = [&](int tk, const i64 (&eoff)[DU], uint2 (&hh)[DU], uint2 (&aa)[DU], uint2 (&bb)[DU]) {
        int r = (tk % nrp) * 2 + (warp >> 2);
        if (r >= rows) return;
#pragma unroll
        for (int i = 0; i < DU; i++) {
            if (ok[i]) {
                const u8* b = W + eoff[i] + (i64)r * rb + (uo[i] >> 3) * 136;
                hh[i] = ldg_u2(b);
                aa[i] = ldg_u2(b + 8 + 16 * (uo[i] & 7));
                bb[i] = ldg_u2(b + 16 + 16 * (uo[i] & 7));
            }
        }
    };
    int buf = 0;
    if (task < ntask) {
        int t_x = -1;
        int4 xa[DU], xb[DU];
        float xs[DU];
        int t0 = task / nrp;
#pragma unroll
        for (int i = 0; i < DU; i++) eo[i] = ok[i] ? (i64)ids[t0 * k + jj[i]] * es : 0;
        wload(task, eo, h, qa, qb);
        for (; task < ntask; task += gridDim.x) {
            int t = task / nrp;
            int ntk = task + gridDim.x;
            if (t != t_x) {
#pragma unroll
                for (int i = 0; i < DU; i++) {
                    xs[i] = 0.f;
                    if (ok[i]) {
                        i64 pp = (i64)t * k + jj[i];
                        const int4* xp = (const int4*)(aq + pp * ff + uo[i] * 32);
                        xa[i] = xp[0];
                        xb[i] = xp[1];
                        xs[i] = ad[pp * upe + uo[i]] * wts[pp];
                    }
                }
                t_x = t;
            }
            if (ntk < ntask) {
                int tn = ntk / nrp;
                i64 en[DU];
#pragma unroll
                for (int i = 0; i < DU; i++) en[i] = tn == t ? eo[i] : (ok[i] ? (i64)ids[tn * k + jj[i]] * es : 0);
                wload(ntk, en, hn, qan, qbn);
#pragma unroll
                for (int i = 0; i < DU; i++) eo[i] = tn == t ? eo[i] : en[i];
            }
            int r = (task % nrp) * 2 + (warp >> 2);
            float total = 0.f;
            if (r < rows) {
#pragma unroll
                for (int i = 0; i < DU; i++)
                    if (ok[i]) total += xs[i] * iq4_unit_reg(h[i], qa[i], qb[i], uo[i] & 7, xa[i], xb[i]);
            }
            total = warp_sum(total);
            if (lane == 0) part[buf][warp] = total;
            __syncthreads();
            if (r < rows && s == 0 && lane == 0) {
                float sum = 0.f;
#pragma unroll
                for (int i = 0; i < 4; i++) sum += part[buf][warp + i];
                hidden[(i64)t * hs + r] += sum;
            }
            buf ^= 1;
#pragma unroll
            for (int i = 0; i < DU; i++) {
                h[i] = hn[i];
                qa[i] = qan[i];
                qb[i] = qbn[i];
            }
        }
    }
}

#define DN_MAXCH 12  // staged chunks per phase (experts x chunks per row)

// hidden[t][r] += sum_j w[t*k + j] * (down[ids[t*k + j]] row r . act[t*k + j]): the down
// products of a token's k experts and their weighted combine, without atomics (deterministic).
// grid (ceil(rows / 8), nt), block 256 (a warp per row). nchunks (per row) <= DN_MAXCH.
template <int T>
__device__ __forceinline__ void moe_down(const u8* W, i64 rb, i64 es, int rows, int nchunks, const int* ids,
                                         const float* wts, int k, const i8* aq, const float* ad, int ff,
                                         float* hidden, i64 hs) {
    __shared__ __align__(16) u8 sm_all[8][DN_MAXCH * CH];
    int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    int r = blockIdx.x * 8 + warp;
    if (r >= rows) return;
    int t = blockIdx.y;
    u8* sm = sm_all[warp];
    int eg = DN_MAXCH / nchunks;
    float total = 0.f;
    const int L = (DN_MAXCH * CH16 + 31) / 32;
    int4 v[L];
    stage_ld<L>(v, nchunks * CH16, min(eg, k), [&](int j) { return W + (i64)ids[t * k + j] * es + r * rb; }, lane);
    for (int j0 = 0; j0 < k; j0 += eg) {
        int ne = min(eg, k - j0);
        stage_st<L>(sm, v, nchunks * CH16 * ne, lane);
        int j1 = j0 + eg;
        if (j1 < k)
            stage_ld<L>(v, nchunks * CH16, min(eg, k - j1),
                        [&](int j) { return W + (i64)ids[t * k + j1 + j] * es + r * rb; }, lane);
        for (int j = 0; j < ne; j++) {
            int p = t * k + j0 + j;
            float a[1] = {0.f};
            dot_staged<T, 1>(sm + j * nchunks * CH, nchunks, 0, aq + (i64)p * ff, 0, ad + (i64)p * (ff / 32), 0, 1, a,
                             lane);
            total += wts[p] * a[0];
        }
    }
    total = warp_sum(total);
    if (lane == 0) hidden[(i64)t * hs + r] += total;
}

// Register-direct IQ4_XS down + weighted combine (the host's default for IQ4_XS experts:
// MINIMAX_DN=4 (SPLIT 4, 3 units per lane and round), =2 (SPLIT 2, 6 units), =0 the staged
// moe_down above). Same result as moe_down: hidden[t][r] += sum_j w[t*k+j] * (down[ids[t*k+j]]
// row r . act[t*k+j]). The k expert rows of output row r are one list of k * ff / 32 units
// (32-value sub-blocks); SPLIT warps share a row, warp part s taking units s * 32 + lane +
// 32 * SPLIT * i. A round issues every weight load (block header + 16 code bytes as three 8-byte
// loads) and every activation load (2 x int4 + scale) of its DU units before the first dp4a.
// The SPLIT partial sums are added in a fixed order (deterministic, no atomics).
// grid (ceil(rows / (8 / SPLIT)), nt), block 256; k <= 32.
template <int SPLIT, int DU>
__device__ __forceinline__ void moe_down_reg_iq4(const u8* W, i64 rb, i64 es, int rows, const int* ids,
                                                 const float* wts, int k, const i8* aq, const float* ad, int ff,
                                                 float* hidden, i64 hs) {
    __shared__ int s_e[32];
    __shared__ float s_w[32];
    __shared__ float part[8];
    int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    int s = warp % SPLIT;
    int r = blockIdx.x * (8 / SPLIT) + warp / SPLIT;
    int t = blockIdx.y;
    if (threadIdx.x < k) {
        s_e[threadIdx.x] = ids[t * k + threadIdx.x];
        s_w[threadIdx.x] = wts[t * k + threadIdx.x];
    }
    __syncthreads();
    bool valid = r < rows;
    int upe = ff >> 5, nu = k * upe;
    const u8* wrow = W + (i64)r * rb;
    float total = 0.f;
    for (int u0 = s * 32; u0 < nu; u0 += 32 * SPLIT * DU) {
        uint2 h[DU], qa[DU], qb[DU];
        int4 xa[DU], xb[DU];
        float xs[DU];
        int sbs[DU];
#pragma unroll
        for (int i = 0; i < DU; i++) {
            int un = u0 + lane + 32 * SPLIT * i;
            xs[i] = 0.f;
            sbs[i] = 0;
            if (valid && un < nu) {
                int j = un / upe, uu = un - j * upe;
                const u8* b = wrow + (i64)s_e[j] * es + (uu >> 3) * 136;
                sbs[i] = uu & 7;
                h[i] = ldg_u2(b);
                qa[i] = ldg_u2(b + 8 + 16 * (uu & 7));
                qb[i] = ldg_u2(b + 16 + 16 * (uu & 7));
                i64 p = (i64)t * k + j;
                const int4* xp = (const int4*)(aq + p * ff + uu * 32);
                xa[i] = xp[0];
                xb[i] = xp[1];
                xs[i] = ad[p * upe + uu] * s_w[j];
            }
        }
#pragma unroll
        for (int i = 0; i < DU; i++) {
            int un = u0 + lane + 32 * SPLIT * i;
            if (valid && un < nu) total += xs[i] * iq4_unit_reg(h[i], qa[i], qb[i], sbs[i], xa[i], xb[i]);
        }
    }
    total = warp_sum(total);
    if (lane == 0) part[warp] = total;
    __syncthreads();
    if (valid && s == 0 && lane == 0) {
        float sum = 0.f;
#pragma unroll
        for (int i = 0; i < SPLIT; i++) sum += part[warp + i];
        hidden[(i64)t * hs + r] += sum;
    }
}
extern "C" __global__ void __launch_bounds__(256) moe_down_reg4_iq4_xs(const u8* W, i64 rb, i64 es, int rows,
                                                                       int nchunks, const int* ids, const float* wts,
                                                                       int k, const i8* aq, const float* ad, int ff,
                                                                       float* hidden, i64 hs) {
    pdl_enter();
    moe_down_reg_iq4<4, 3>(W, rb, es, rows, ids, wts, k, aq, ad, ff, hidden, hs);
}
// moe_down_reg4 with its weight stream started before the PDL wait (the default; MINIMAX_DN=4
// = reg4): the expert ids and routing weights are read and the first round's weight loads
// issued, then pdl_wait(), then the gate/up activations. Same units, same order of sums, and
// iq4_unit_lh gives iq4_unit_reg's numbers: bit-identical to reg4.
// Why reading ids / wts before the wait is safe although this step writes them: they come from
// the router, and the kernel launched right before this one is an expert gate/up kernel (on a
// tensor-parallel non-lead rank a cuMemsetD32Async sits in between, which is not a kernel and
// so is fully ordered). Every gate/up kernel starts with pdl_enter(): griddepcontrol.wait, and
// only then launch_dependents. This grid cannot be scheduled before every gate/up block has
// executed launch_dependents (or exited), i.e. after each returned from its wait, which
// returns only once the prerequisite grids (the router, and transitively everything before
// it: each waited before completing) have completed and their memory operations are performed
// and visible (PTX ISA, griddepcontrol). The router's writes are therefore in L2 before this
// grid's first instruction; they are read with ld.global.cg (L2, not a possibly stale L1
// line). Weights are never written. Nothing is written, and nothing the gate/up kernel writes
// (aq, ad) is read, before pdl_wait(). Launching this kernel right after the router (or after a
// gate/up kernel that triggers before its wait) would break this.
// grid (ceil(rows / 2), nt), block 256; k <= 32.
extern "C" __global__ void __launch_bounds__(256) moe_down_rx4_iq4_xs(const u8* W, i64 rb, i64 es, int rows,
                                                                      int nchunks, const int* ids, const float* wts,
                                                                      int k, const i8* aq, const float* ad, int ff,
                                                                      float* hidden, i64 hs) {
    const int SPLIT = 4, DU = 3, STEP = 32 * SPLIT * DU;
    __shared__ int s_e[32];
    __shared__ float s_w[32];
    __shared__ float part[8];
    int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    int s = warp % SPLIT;
    int r = blockIdx.x * (8 / SPLIT) + warp / SPLIT;
    int t = blockIdx.y;
    if (threadIdx.x < k) {
        s_e[threadIdx.x] = __ldcg(ids + t * k + threadIdx.x);
        s_w[threadIdx.x] = __ldcg(wts + t * k + threadIdx.x);
    }
    __syncthreads();
    bool valid = r < rows;
    int upe = ff >> 5, nu = k * upe;
    const u8* wrow = W + (i64)r * rb;
    uint2 h[DU], qa[DU], qb[DU];
    int jj[DU], uus[DU];
    auto wload = [&](int u0) {
#pragma unroll
        for (int i = 0; i < DU; i++) {
            int un = u0 + lane + 32 * SPLIT * i;
            jj[i] = 0;
            uus[i] = 0;
            if (valid && un < nu) {
                int j = un / upe, uu = un - j * upe;
                jj[i] = j;
                uus[i] = uu;
                const u8* b = wrow + (i64)s_e[j] * es + (uu >> 3) * 136;
                h[i] = ldg_u2(b);
                qa[i] = ldg_u2(b + 8 + 16 * (uu & 7));
                qb[i] = ldg_u2(b + 16 + 16 * (uu & 7));
            }
        }
    };
    wload(s * 32);
    pdl_wait();
    pdl_trigger();
    u32 t0, t2;
    iq4_pin((u32)(rb >> 62) & threadIdx.x, t0, t2);
    float total = 0.f;
    for (int u0 = s * 32; u0 < nu; u0 += STEP) {
        int4 xa[DU], xb[DU];
        float xs[DU];
#pragma unroll
        for (int i = 0; i < DU; i++) {
            int un = u0 + lane + 32 * SPLIT * i;
            xs[i] = 0.f;
            if (valid && un < nu) {
                i64 p = (i64)t * k + jj[i];
                const int4* xp = (const int4*)(aq + p * ff + uus[i] * 32);
                xa[i] = xp[0];
                xb[i] = xp[1];
                xs[i] = ad[p * upe + uus[i]] * s_w[jj[i]];
            }
        }
#pragma unroll
        for (int i = 0; i < DU; i++) {
            int un = u0 + lane + 32 * SPLIT * i;
            if (valid && un < nu) total += xs[i] * iq4_unit_lh(h[i], qa[i], qb[i], uus[i] & 7, xa[i], xb[i], t0, t2);
        }
        if (u0 + STEP < nu) wload(u0 + STEP);
    }
    total = warp_sum(total);
    if (lane == 0) part[warp] = total;
    __syncthreads();
    if (valid && s == 0 && lane == 0) {
        float sum = 0.f;
#pragma unroll
        for (int i = 0; i < SPLIT; i++) sum += part[warp + i];
        hidden[(i64)t * hs + r] += sum;
    }
}
extern "C" __global__ void __launch_bounds__(256) moe_down_reg2_iq4_xs(const u8* W, i64 rb, i64 es, int rows,
                                                                       int nchunks, const int* ids, const float* wts,
                                                                       int k, const i8* aq, const float* ad, int ff,
                                                                       float* hidden, i64 hs) {
    pdl_enter();
    moe_down_reg_iq4<2, 6>(W, rb, es, rows, ids, wts, k, aq, ad, ff, hidden, hs);
}

// ------------------------------------------ MoE grouped by expert (steps of several tokens) --
// The step's (token, expert) pairs grouped by expert, so that each chosen expert's weights are
// read once for all the tokens routed to it (and its IQ4 codes decoded once). grp (i32): [0] =
// n, the number of chosen experts ("slots"); [1, 1+E) expert of slot s; [1+E, 1+2E) offset of
// slot s in the pair list; [1+2E, 1+3E) its pair count; [1+3E, 1+3E+npairs) the pair list.
// Slot numbers and the order inside a slot come from shared-memory atomics (they vary from run
// to run), but every output element is computed from one pair alone in a fixed order, so the
// results do not. grid 1, block 256; E <= 1024.
extern "C" __global__ void __launch_bounds__(256) moe_group(const int* ids, int npairs, int E, int* grp) {
    pdl_enter();
    __shared__ int cnt[1024], off[1024], fill[1024];
    __shared__ int nslot, total;
    int* g_exp = grp + 1;
    int* g_off = grp + 1 + E;
    int* g_cnt = grp + 1 + 2 * E;
    int* g_pairs = grp + 1 + 3 * E;
    for (int e = threadIdx.x; e < E; e += blockDim.x) {
        cnt[e] = 0;
        fill[e] = 0;
    }
    if (threadIdx.x == 0) nslot = total = 0;
    __syncthreads();
    for (int p = threadIdx.x; p < npairs; p += blockDim.x) {
        int e = ids[p];
        if ((unsigned)e < (unsigned)E) atomicAdd(&cnt[e], 1);
    }
    __syncthreads();
    for (int e = threadIdx.x; e < E; e += blockDim.x) {
        int c = cnt[e];
        if (c > 0) {
            int s = atomicAdd(&nslot, 1);
            int o = atomicAdd(&total, c);
            off[e] = o;
            g_exp[s] = e;
            g_off[s] = o;
            g_cnt[s] = c;
        }
    }
    __syncthreads();
    for (int p = threadIdx.x; p < npairs; p += blockDim.x) {
        int e = ids[p];
        if ((unsigned)e < (unsigned)E) g_pairs[off[e] + atomicAdd(&fill[e], 1)] = p;
    }
    if (threadIdx.x == 0) grp[0] = nslot;
}

// One IQ4_XS unit (32 values) decoded to packed int8 codebook values and its scale d * (ls - 32).
__device__ __forceinline__ float iq4_decode(uint2 h, uint2 qa, uint2 qb, int sb, u32 (&lo)[4], u32 (&hi)[4]) {
    iq4_lookup(qa.x, lo[0], hi[0]);
    iq4_lookup(qa.y, lo[1], hi[1]);
    iq4_lookup(qb.x, lo[2], hi[2]);
    iq4_lookup(qb.y, lo[3], hi[3]);
    int ls = ((h.y >> (4 * sb)) & 15) | (((h.x >> (16 + 2 * sb)) & 3) << 4);
    return f16_to_f32((u16)(h.x & 0xffffu)) * (float)(ls - 32);
}
// iq4_decode, with PIN through iq4_lookup_lh over the codebook words t0 / t2 (pinned by the
// caller with iq4_pin; same bytes as iq4_lookup), else iq4_decode itself.
template <bool PIN>
__device__ __forceinline__ float iq4_decode_t(uint2 h, uint2 qa, uint2 qb, int sb, u32 (&lo)[4], u32 (&hi)[4], u32 t0,
                                              u32 t2) {
    if (!PIN) return iq4_decode(h, qa, qb, sb, lo, hi);
    iq4_lookup_lh(qa.x, lo[0], hi[0], t0, t2);
    iq4_lookup_lh(qa.y, lo[1], hi[1], t0, t2);
    iq4_lookup_lh(qb.x, lo[2], hi[2], t0, t2);
    iq4_lookup_lh(qb.y, lo[3], hi[3], t0, t2);
    return iq4_unit_scale(h, sb);
}
__device__ __forceinline__ int iq4_dot(const u32 (&lo)[4], const u32 (&hi)[4], int4 xa, int4 xb) {
    int s = __dp4a((int)lo[0], xa.x, 0);
    s = __dp4a((int)lo[1], xa.y, s);
    s = __dp4a((int)lo[2], xa.z, s);
    s = __dp4a((int)lo[3], xa.w, s);
    s = __dp4a((int)hi[0], xb.x, s);
    s = __dp4a((int)hi[1], xb.y, s);
    s = __dp4a((int)hi[2], xb.z, s);
    return __dp4a((int)hi[3], xb.w, s);
}

#define GG_MAXC 32  // pairs per expert (one per token of the step)

// Asks L2 for the bytes [p, p + n) (128-byte lines, the block's threads in turn): the grouped
// kernels' warps then find their later rows' weights in L2 instead of waiting for DRAM one
// row at a time (a block's weights are one contiguous range per matrix).
__device__ __forceinline__ void prefetch_l2_range(const u8* p, i64 n) {
    const u8* a = (const u8*)((u64)p & ~(u64)127);
    for (i64 o = (i64)threadIdx.x * 128; o < n + (p - a); o += (i64)blockDim.x * 128)
        asm volatile("prefetch.global.L2 [%0];" ::"l"(a + o));
}

// The grouped IQ4_XS kernels (gate/up and down), one template each; the variants (host:
// fast::GrpKind, MINIMAX_GRP_KIND) compute every output with the same integer dp4a sums and
// the same f32 operations in the same order, so they are bit-identical:
//   PIN  decode through iq4_lookup_lh over codebook words pinned in registers (iq4_pin), else
//        iq4_lookup (its constants re-materialized before every prmt);
//   PF   the block's weight rows are first prefetched into L2 (prefetch_l2_range); the down
//        then takes STEPS = 4 16-row steps a block.
// A lane keeps one pair's list entry in a register (a slot holds at most 32 pairs), so a (row,
// pair) takes a shuffle, not a list load and a division.
// Tried on one H200 at 32 tokens (served-like routing) and dropped, all bit-identical: a
// persistent grid with each slot's activations staged in shared memory (gate/up 555 vs 386 us a
// layer); register caps for 3-4 blocks an SM (spills, slower); activations in iq4_lookup_il's
// order with part of the decode's shifts as multiply-highs on the FMA pipe (ALU 58% -> 47%, same
// time); 64-row gate/up / 128-row down blocks; gate and up rows taken one after the other at 80
// registers (405 us). The gate/up stays at ~385 us whatever its instruction mix: latency-bound
// at 16 warps an SM (long-scoreboard and fixed-latency stalls lead).
// Grouped IQ4_XS gate/up: block (32 rows, slot): for each row of the slot's expert, the lane's
// units of gate and up are loaded and decoded once, then dotted with every routed token's q8
// input. Per-(row, pair) sums collect in shared memory across column rounds; then per pair
// act = silu(g) * u over the 32 rows -> q8 (aq [p][ld], ad [p][ld / 32]), as moe_gate_up.
// grid (ff / 32, max slots), block 256; slots >= grp[0] exit.
#define GG_ROWS 4  // rows per warp (8 warps: the block's 32 rows)
template <bool PIN, bool PF>
__device__ __forceinline__ void moe_gate_up_grp_impl(const u8* G, const u8* U, i64 rb, i64 es, const int* grp, int E,
                                                     int k, const i8* xq, const float* xd, int ncol, i8* aq, float* ad,
                                                     int ld) {
    pdl_enter();
    __shared__ float sg[32][GG_MAXC + 1], su[32][GG_MAXC + 1];
    int slot = blockIdx.y;
    if (slot >= grp[0]) return;
    int e = grp[1 + slot], c = min(grp[1 + 2 * E + slot], GG_MAXC);
    const int* pairs = grp + 1 + 3 * E + grp[1 + E + slot];
    int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    i64 eoff = (i64)e * es + (i64)blockIdx.x * 32 * rb;  // the block's first row
    if (PF) {
        prefetch_l2_range(G + eoff, 32 * rb);
        prefetch_l2_range(U + eoff, 32 * rb);
    }
    int pl = lane < c ? pairs[lane] : 0;
    i64 xl = (i64)(pl / k) * ncol;  // lane ci: the q8 row of pair ci's token
    int nu = ncol >> 5;
    u32 t0 = IQ4_T0, t2 = IQ4_T2;
    if (PIN) iq4_pin((u32)(rb >> 62) & threadIdx.x, t0, t2);
#pragma unroll
    for (int r = 0; r < GG_ROWS; r++)
        for (int ci = lane; ci < c; ci += 32) sg[warp * GG_ROWS + r][ci] = su[warp * GG_ROWS + r][ci] = 0.f;
    __syncwarp();
    for (int ub0 = 0; ub0 < nu; ub0 += 32 * GR_XU) {
        for (int r = 0; r < GG_ROWS; r++) {
            int rl = warp * GG_ROWS + r;
            i64 ro = eoff + (i64)rl * rb;
            GrRow w;
            gr_load(w, G + ro, U + ro, ub0, lane, nu);
            u32 glo[GR_XU][4], ghi[GR_XU][4], ulo[GR_XU][4], uhi[GR_XU][4];
            float gs[GR_XU], us[GR_XU];
#pragma unroll
            for (int i = 0; i < GR_XU; i++) {
                int un = ub0 + lane + 32 * i;
                if (un < nu) {
                    gs[i] = iq4_decode_t<PIN>(w.gh[i], w.ga[i], w.gb[i], un & 7, glo[i], ghi[i], t0, t2);
                    us[i] = iq4_decode_t<PIN>(w.uh[i], w.ua[i], w.ub[i], un & 7, ulo[i], uhi[i], t0, t2);
                }
            }
            for (int ci = 0; ci < c; ci++) {
                i64 xr = __shfl_sync(0xffffffffu, xl, ci);
                float ag = 0.f, au = 0.f;
#pragma unroll
                for (int i = 0; i < GR_XU; i++) {
                    int un = ub0 + lane + 32 * i;
                    if (un < nu) {
                        const int4* xp = (const int4*)(xq + xr + un * 32);
                        int4 xa = xp[0], xb = xp[1];
                        float xs = xd[xr / 32 + un];
                        ag += xs * (gs[i] * (float)iq4_dot(glo[i], ghi[i], xa, xb));
                        au += xs * (us[i] * (float)iq4_dot(ulo[i], uhi[i], xa, xb));
                    }
                }
                ag = warp_sum(ag);
                au = warp_sum(au);
                if (lane == 0) {
                    sg[rl][ci] += ag;
                    su[rl][ci] += au;
                }
            }
        }
    }
    __syncthreads();
    for (int ci = warp; ci < c; ci += 8) {
        int p = __shfl_sync(0xffffffffu, pl, ci);
        float v = silu_times(sg[lane][ci], su[lane][ci]);
        int q = q8_lane(v, ad + (i64)p * (ld / 32) + blockIdx.x);
        aq[(i64)p * ld + blockIdx.x * 32 + lane] = (i8)q;
    }
}
#define GG_KERNEL(name, PIN, PF)                                                                                    \
    extern "C" __global__ void __launch_bounds__(256, 2) name(const u8* G, const u8* U, i64 rb, i64 es,             \
                                                              const int* grp, int E, int k, const i8* xq,            \
                                                              const float* xd, int ncol, i8* aq, float* ad, int ld) { \
        moe_gate_up_grp_impl<PIN, PF>(G, U, rb, es, grp, E, k, xq, xd, ncol, aq, ad, ld);                           \
    }
// grp: plain; grpp: pinned; grpf: pinned + L2 prefetch (the default).
GG_KERNEL(moe_gate_up_grp_iq4_xs, false, false)
GG_KERNEL(moe_gate_up_grpp_iq4_xs, true, false)
GG_KERNEL(moe_gate_up_grpf_iq4_xs, true, true)

#define DG_U 3  // units per lane and round of the grouped down

// Grouped IQ4_XS down: block (16 STEPS rows, slot); in step s warp w takes rows r0 = 16 (STEPS
// bx + s) + 2 w and r0 + 1 (the units of both rows as one list, DG_U per lane and round),
// decodes them once and dots them with every routed pair's activations: dpart[p][r] = down[e]
// row r . act[p] (unweighted; combined per token by moe_combine_grp).
// grid (ceil(rows / (16 STEPS)), max slots), block 256.
template <bool PIN, int STEPS, bool PF>
__device__ __forceinline__ void moe_down_grp_impl(const u8* W, i64 rb, i64 es, int rows, const int* grp, int E,
                                                  const i8* aq, const float* ad, int ff, float* dpart) {
    pdl_enter();
    __shared__ float sacc[8][2][GG_MAXC];
    int slot = blockIdx.y;
    if (slot >= grp[0]) return;
    int e = grp[1 + slot], c = min(grp[1 + 2 * E + slot], GG_MAXC);
    const int* pairs = grp + 1 + 3 * E + grp[1 + E + slot];
    int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const u8* wb = W + (i64)e * es;
    if (PF) {
        int rb0 = blockIdx.x * 16 * STEPS;
        prefetch_l2_range(wb + (i64)rb0 * rb, (i64)(min(rows, rb0 + 16 * STEPS) - rb0) * rb);
    }
    int pl = lane < c ? pairs[lane] : 0;  // lane ci: pair ci
    int upe = ff >> 5, nu = 2 * upe;
    u32 t0 = IQ4_T0, t2 = IQ4_T2;
    if (PIN) iq4_pin((u32)(rb >> 62) & threadIdx.x, t0, t2);
    for (int st = 0; st < STEPS; st++) {
        int r0 = (blockIdx.x * STEPS + st) * 16 + warp * 2;
        if (r0 >= rows) break;  // warp-uniform
        for (int ci = lane; ci < c; ci += 32) sacc[warp][0][ci] = sacc[warp][1][ci] = 0.f;
        __syncwarp();
        for (int u0 = 0; u0 < nu; u0 += 32 * DG_U) {
            uint2 h[DG_U], qa[DG_U], qb[DG_U];
            int uu[DG_U], rr[DG_U];
            bool ok[DG_U];
#pragma unroll
            for (int i = 0; i < DG_U; i++) {
                int un = u0 + lane + 32 * i;
                rr[i] = un >= upe;
                uu[i] = un - rr[i] * upe;
                ok[i] = un < nu && r0 + rr[i] < rows;
                if (ok[i]) {
                    const u8* b = wb + (i64)(r0 + rr[i]) * rb + (uu[i] >> 3) * 136;
                    h[i] = ldg_u2(b);
                    qa[i] = ldg_u2(b + 8 + 16 * (uu[i] & 7));
                    qb[i] = ldg_u2(b + 16 + 16 * (uu[i] & 7));
                }
            }
            u32 lo[DG_U][4], hi[DG_U][4];
            float sc[DG_U];
#pragma unroll
            for (int i = 0; i < DG_U; i++)
                if (ok[i]) sc[i] = iq4_decode_t<PIN>(h[i], qa[i], qb[i], uu[i] & 7, lo[i], hi[i], t0, t2);
            for (int ci = 0; ci < c; ci++) {
                i64 p = __shfl_sync(0xffffffffu, pl, ci);
                float s0 = 0.f, s1 = 0.f;
#pragma unroll
                for (int i = 0; i < DG_U; i++) {
                    if (ok[i]) {
                        const int4* xp = (const int4*)(aq + p * ff + uu[i] * 32);
                        float v = ad[p * upe + uu[i]] * (sc[i] * (float)iq4_dot(lo[i], hi[i], xp[0], xp[1]));
                        if (rr[i]) s1 += v;
                        else s0 += v;
                    }
                }
                s0 = warp_sum(s0);
                s1 = warp_sum(s1);
                if (lane == 0) {
                    sacc[warp][0][ci] += s0;
                    sacc[warp][1][ci] += s1;
                }
            }
        }
        __syncwarp();
        if (lane < c) {  // lane ci holds pair ci
            i64 p = pl;
            if (r0 < rows) dpart[p * rows + r0] = sacc[warp][0][lane];
            if (r0 + 1 < rows) dpart[p * rows + r0 + 1] = sacc[warp][1][lane];
        }
        __syncwarp();
    }
}
#define DG_KERNEL(name, PIN, STEPS, PF)                                                                              \
    extern "C" __global__ void __launch_bounds__(256) name(const u8* W, i64 rb, i64 es, int rows, const int* grp,    \
                                                           int E, const i8* aq, const float* ad, int ff,             \
                                                           float* dpart) {                                           \
        moe_down_grp_impl<PIN, STEPS, PF>(W, rb, es, rows, grp, E, aq, ad, ff, dpart);                              \
    }
// grp / grpp: 16 rows a block; grpf (the default): 64 rows a block, prefetched.
DG_KERNEL(moe_down_grp_iq4_xs, false, 1, false)
DG_KERNEL(moe_down_grpp_iq4_xs, true, 1, false)
DG_KERNEL(moe_down_grpf_iq4_xs, true, 4, true)

// Grouped IQ4_XS down on tensor cores (opt-in, MINIMAX_GRP_MMA=1: measured only slightly faster
// at 32 tokens and slower at 4-16, where slots hold 1-2 pairs): the slot's pairs are the M side of
// mma.sync m16n8k32 (s8, exact per 32-column unit; up to 32 pairs = two m16 tiles), 8 weight
// rows a warp the N side. A lane loads one 4-byte word of its row's unit codes, whose low and
// high nibbles are exactly the B fragment's two registers after the codebook lookup; the unit's
// scale d (ls - 32) comes from the row's owner lane by shuffle. Sums are scaled in f32 (pair's
// q8 scale x unit scale) and added over the units in order. moe_down_grp_iq4_xs re-reads each
// pair's activations for every row and reduces every (row, pair) across the warp, which bounds
// it far below the weight bandwidth at 32 tokens. Same arguments and output as
// moe_down_grp_iq4_xs; grid (ceil(rows / 32), max slots), block 128.
#define DGM_UN 4  // units per round (their loads issued together)
extern "C" __global__ void __launch_bounds__(128) moe_down_grpm_iq4_xs(const u8* W, i64 rb, i64 es, int rows,
                                                                       const int* grp, int E, const i8* aq,
                                                                       const float* ad, int ff, float* dpart) {
    pdl_enter();
    int slot = blockIdx.y;
    if (slot >= grp[0]) return;
    int e = grp[1 + slot], c = min(grp[1 + 2 * E + slot], GG_MAXC);
    const int* pairs = grp + 1 + 3 * E + grp[1 + E + slot];
    int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    int g = lane >> 2, t = lane & 3;
    int r0 = blockIdx.x * 32 + warp * 8;
    if (r0 >= rows) return;
    int upe = ff >> 5;
    bool rv = r0 + g < rows;
    const u8* wrow = W + (i64)e * es + (i64)(rv ? r0 + g : r0) * rb;
    int pi[4];
    bool pv[4];
#pragma unroll
    for (int i = 0; i < 4; i++) {
        int ci = (i >> 1) * 16 + (i & 1) * 8 + g;
        pv[i] = ci < c;
        pi[i] = pv[i] ? pairs[ci] : 0;
    }
    const int nm = c > 16 ? 2 : 1;
    float acc[2][4];
#pragma unroll
    for (int m = 0; m < 2; m++)
#pragma unroll
        for (int i = 0; i < 4; i++) acc[m][i] = 0.f;
    for (int u0 = 0; u0 < upe; u0 += DGM_UN) {
        uint2 h[DGM_UN];
        u32 q[DGM_UN];
        u32 a[DGM_UN][2][4];
        float dx[DGM_UN][2][2];
#pragma unroll
        for (int j = 0; j < DGM_UN; j++) {
            int u = u0 + j;
            bool ok = u < upe;
            const u8* b = wrow + (u >> 3) * 136;
            h[j] = ok ? ldg_u2(b) : make_uint2(0, 0);
            q[j] = ok ? *(const u32*)(b + 8 + 16 * (u & 7) + 4 * t) : 0u;
#pragma unroll
            for (int m = 0; m < 2; m++)
#pragma unroll
                for (int hh = 0; hh < 2; hh++) {
                    int i = 2 * m + hh;
                    bool v = ok && pv[i] && m < nm;
                    const i8* xr = aq + (i64)pi[i] * ff + u * 32;
                    a[j][m][hh] = v ? *(const u32*)(xr + 4 * t) : 0u;
                    a[j][m][2 + hh] = v ? *(const u32*)(xr + 16 + 4 * t) : 0u;
                    dx[j][m][hh] = v ? ad[(i64)pi[i] * upe + u] : 0.f;
                }
        }
#pragma unroll
        for (int j = 0; j < DGM_UN; j++) {
            int u = u0 + j;
            if (u >= upe) break;
            int sb = u & 7;
            int ls = ((h[j].y >> (4 * sb)) & 15) | (((h[j].x >> (16 + 2 * sb)) & 3) << 4);
            float sw = f16_to_f32((u16)(h[j].x & 0xffffu)) * (float)(ls - 32);
            float s0 = __shfl_sync(0xffffffffu, sw, 8 * t), s1 = __shfl_sync(0xffffffffu, sw, 8 * t + 4);
            u32 lo, hi;
            iq4_lookup(q[j], lo, hi);
#pragma unroll
            for (int m = 0; m < 2; m++) {
                if (m < nm) {
                    int cr[4];
                    mma_s8_16832(cr, a[j][m], lo, hi);
                    acc[m][0] += dx[j][m][0] * s0 * (float)cr[0];
                    acc[m][1] += dx[j][m][0] * s1 * (float)cr[1];
                    acc[m][2] += dx[j][m][1] * s0 * (float)cr[2];
                    acc[m][3] += dx[j][m][1] * s1 * (float)cr[3];
                }
            }
        }
    }
#pragma unroll
    for (int m = 0; m < 2; m++)
#pragma unroll
        for (int i = 0; i < 4; i++) {
            int pj = 2 * m + (i >> 1);
            int r = r0 + 2 * t + (i & 1);
            if (m < nm && pv[pj] && r < rows) dpart[(i64)pi[pj] * rows + r] = acc[m][i];
        }
}

// hidden[t][r] += sum_j wts[t k + j] * dpart[t k + j][r] (j in order: deterministic).
// grid (ceil(rows / 256), nt), block 256.
extern "C" __global__ void __launch_bounds__(256) moe_combine_grp(const float* dpart, const float* wts, int k, int rows,
                                                                  float* hidden, i64 hs) {
    pdl_enter();
    int r = blockIdx.x * 256 + threadIdx.x, t = blockIdx.y;
    if (r >= rows) return;
    float s = 0.f;
    for (int j = 0; j < k; j++) s += wts[t * k + j] * dpart[((i64)t * k + j) * rows + r];
    hidden[(i64)t * hs + r] += s;
}

#define FAST_INST(name, T)                                                                                       \
    extern "C" __global__ void __launch_bounds__(32 * MVQ_WARPS) mvq_##name##_1(                                 \
        const u8* W0, i64 rb0, int rows0, float* y0, i64 ys0, const u8* W1, i64 rb1, int rows1, float* y1, i64 ys1, \
        const u8* W2, i64 rb2, int rows2, float* y2, i64 ys2, int nchunks, const i8* xq, const float* xd, int ncol,  \
        int nv, int acc) {                                                                                       \
        pdl_enter();                                                                                     \
        mvq_dense<T, 1>(W0, rb0, rows0, y0, ys0, W1, rb1, rows1, y1, ys1, W2, rb2, rows2, y2, ys2, nchunks, xq, xd,  \
                        ncol, nv, acc);                                                                          \
    }                                                                                                            \
    extern "C" __global__ void __launch_bounds__(32 * MVQ_WARPS) mvq_##name##_4(                                 \
        const u8* W0, i64 rb0, int rows0, float* y0, i64 ys0, const u8* W1, i64 rb1, int rows1, float* y1, i64 ys1, \
        const u8* W2, i64 rb2, int rows2, float* y2, i64 ys2, int nchunks, const i8* xq, const float* xd, int ncol,  \
        int nv, int acc) {                                                                                       \
        pdl_enter();                                                                                     \
        mvq_dense<T, 4>(W0, rb0, rows0, y0, ys0, W1, rb1, rows1, y1, ys1, W2, rb2, rows2, y2, ys2, nchunks, xq, xd,  \
                        ncol, nv, acc);                                                                          \
    }                                                                                                            \
    extern "C" __global__ void __launch_bounds__(32 * MVQ_WARPS) mvq_##name##_8(                                 \
        const u8* W0, i64 rb0, int rows0, float* y0, i64 ys0, const u8* W1, i64 rb1, int rows1, float* y1, i64 ys1, \
        const u8* W2, i64 rb2, int rows2, float* y2, i64 ys2, int nchunks, const i8* xq, const float* xd, int ncol,  \
        int nv, int acc) {                                                                                       \
        pdl_enter();                                                                                     \
        mvq_dense<T, 8>(W0, rb0, rows0, y0, ys0, W1, rb1, rows1, y1, ys1, W2, rb2, rows2, y2, ys2, nchunks, xq, xd,  \
                        ncol, nv, acc);                                                                          \
    }                                                                                                            \
    extern "C" __global__ void __launch_bounds__(256) moe_gate_up_##name(                                        \
        const u8* G, const u8* U, i64 rb, i64 es, int nchunks, const int* ids, int k, const i8* xq, const float* xd, \
        int ncol, i8* aq, float* ad, int ff) {                                                                   \
        pdl_enter();                                                                                     \
        moe_gate_up<T, 4, 6>(G, U, rb, es, nchunks, ids, k, xq, xd, ncol, aq, ad, ff);                                 \
    }                                                                                                            \
    extern "C" __global__ void __launch_bounds__(512) moe_gate_up2_##name(                                        \
        const u8* G, const u8* U, i64 rb, i64 es, int nchunks, const int* ids, int k, const i8* xq, const float* xd, \
        int ncol, i8* aq, float* ad, int ff) {                                                                   \
        pdl_enter();                                                                                     \
        moe_gate_up<T, 2, 3>(G, U, rb, es, nchunks, ids, k, xq, xd, ncol, aq, ad, ff);                                 \
    }                                                                                                            \
    extern "C" __global__ void __launch_bounds__(1024) moe_gate_up1_##name(                                        \
        const u8* G, const u8* U, i64 rb, i64 es, int nchunks, const int* ids, int k, const i8* xq, const float* xd, \
        int ncol, i8* aq, float* ad, int ff) {                                                                   \
        pdl_enter();                                                                                     \
        moe_gate_up<T, 1, 2>(G, U, rb, es, nchunks, ids, k, xq, xd, ncol, aq, ad, ff);                                 \
    }                                                                                                            \
    extern "C" __global__ void __launch_bounds__(256) moe_down_##name(                                           \
        const u8* W, i64 rb, i64 es, int rows, int nchunks, const int* ids, const float* wts, int k, const i8* aq,  \
        const float* ad, int ff, float* hidden, i64 hs) {                                                        \
        pdl_enter();                                                                                     \
        moe_down<T>(W, rb, es, rows, nchunks, ids, wts, k, aq, ad, ff, hidden, hs);                              \
    }

FAST_INST(q8_0, T_Q8_0)
FAST_INST(iq4_xs, T_IQ4_XS)

// ------------------------------------------- q/k norm, RoPE and KV store (fused) ---------
// Token t = blockIdx.x. blockIdx.y == 0: the query row (full-width RMSNorm over qw, then
// partial NeoX RoPE per head); 1: the key row likewise over kw, then K and V are stored at
// cache slot slots[t]. In place on q and k. block 256.
#define QK_MAXV 8   // values per thread (block 1024: widths up to 8192)
// PRE (qk_norm_rope_store_p_*): the norm weights and the RoPE angles (pos is step metadata)
// before pdl_wait, the q / k row after it; same arithmetic (bit-identical).
template <int KV, bool PRE = false>
__device__ __forceinline__ void qk_norm_rope_store_impl(float* q, i64 qs, float* k, const float* v, i64 kvs,
                                                        const float* qn, const float* kn, int qw, int kw, int vw,
                                                        int hd, int rot, const int* pos, float theta, float eps,
                                                        const int* slots, void* kc_, void* vc_,
                                                        const float* ssx = nullptr, int q_full = 0, int k_full = 0) {
    typedef typename KvT<KV>::T KT;
    __shared__ float part[32];
    __shared__ float cs[128], sn[128];
    __shared__ float xs[QK_MAXV * 1024];
    int t = blockIdx.x;
    bool is_k = blockIdx.y == 1;
    float* x = is_k ? k + t * kvs : q + t * qs;
    const float* w = is_k ? kn : qn;
    int n = is_k ? kw : qw;
    int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, nw = blockDim.x >> 5;
    // All loads first (registers), then the RoPE angles while they are in flight: the angle
    // depends on the pair index only (one f64 sincos per pair index, as the CPU twin).
    float xv[QK_MAXV], wv[QK_MAXV];
    if (PRE) {
#pragma unroll
        for (int i = 0; i < QK_MAXV; i++) {
            int idx = threadIdx.x + i * blockDim.x;
            wv[i] = idx < n ? w[idx] : 0.f;
        }
    } else {
#pragma unroll
        for (int i = 0; i < QK_MAXV; i++) {
            int idx = threadIdx.x + i * blockDim.x;
            xv[i] = idx < n ? x[idx] : 0.f;
            wv[i] = idx < n ? w[idx] : 0.f;
        }
    }
    int half = rot / 2;
    if (threadIdx.x < half) {
        double p = (double)pos[t];
        double inv_freq = 1.0 / pow((double)theta, 2.0 * (double)threadIdx.x / (double)rot);
        double a = p * inv_freq;
        cs[threadIdx.x] = (float)cos(a);
        sn[threadIdx.x] = (float)sin(a);
    }
    if (PRE) {
        pdl_wait();
        pdl_trigger();
#pragma unroll
        for (int i = 0; i < QK_MAXV; i++) {
            int idx = threadIdx.x + i * blockDim.x;
            xv[i] = idx < n ? x[idx] : 0.f;
        }
    }
    float ss = 0.f;
#pragma unroll
    for (int i = 0; i < QK_MAXV; i++) ss += xv[i] * xv[i];
    ss = warp_sum(ss);
    if (lane == 0) part[warp] = ss;
    __syncthreads();
    float tot = lane < nw ? part[lane] : 0.f;
    tot = warp_sum(tot);
    // Tensor parallelism (ssx != null): the world's sum of squares of the whole row (all
    // heads), from tp_qk_sumsq + all-reduce, over the whole row's width.
    float nn = (float)n;
    if (ssx) {
        tot = ssx[2 * t + (is_k ? 1 : 0)];
        nn = (float)(is_k ? k_full : q_full);
    }
    float inv = 1.0f / sqrtf(tot / nn + eps);
#pragma unroll
    for (int i = 0; i < QK_MAXV; i++) {
        int idx = threadIdx.x + i * blockDim.x;
        if (idx < n) xs[idx] = xv[i] * inv * wv[i];
    }
    __syncthreads();
    // Partial NeoX RoPE per head on dims [0, rot): (x0, x1) = (u[i], u[i + half]) ->
    // (x0 c - x1 s, x1 c + x0 s); dims >= rot unchanged. K (and V) also go to the cache.
    KT* kc = (KT*)kc_;
    KT* vc = (KT*)vc_;
    i64 sl = is_k ? (i64)slots[t] : 0;
#pragma unroll
    for (int i = 0; i < QK_MAXV; i++) {
        int idx = threadIdx.x + i * blockDim.x;
        if (idx < n) {
            int dd = idx % hd;
            float o = xs[idx];
            if (dd < half) o = o * cs[dd] - xs[idx + half] * sn[dd];
            else if (dd < rot) o = o * cs[dd - half] + xs[idx - half] * sn[dd - half];
            x[idx] = o;
            if (is_k) kc[sl * kw + idx] = kv_store<KV>(o);
        }
    }
    if (is_k)
        for (int i = threadIdx.x; i < vw; i += blockDim.x) vc[sl * vw + i] = kv_store<KV>(v[t * kvs + i]);
}

// ------------------------------------------------ split-K decode attention ---------------
// Head dim 128 (K and V), GQA group G query heads per KV head. Block (kv head, split, token):
// positions [split * chunk, ...) of the token's causal range, chunk = ceil(n_ctx / nsplit)
// rounded up to AD_GRAN. Each warp takes two positions per step (16 lanes x 8 dims each), online
// softmax per query head; the block's unnormalised partial (m, l, o) goes to part, merged by
// attn_merge. part layout per (t, kvh, split): m[G], l[G], o[G][128].
#define AD_WARPS 4
#define AD_HD 128
// A split's share of the positions is a multiple of AD_GRAN: one 16-position tile for each of
// the tensor-core kernel's 4 warps, so a short context fills few blocks, each with every warp
// busy (the rest are empty: see attn_dec6tn's exit_empty).
#define AD_GRAN 64

__device__ __forceinline__ void h16x8(int4 raw, float* f, int bf) {
    const u16* h = (const u16*)&raw;
#pragma unroll
    for (int i = 0; i < 8; i++) f[i] = bf ? bf16_to_f32(h[i]) : f16_to_f32(h[i]);
}

// out[t][h * 128 + d] = merged attention of query head h (f32), plus its q8 quantization
// (aq [t][heads * 128], ad [t][heads * 4]). grid (heads, nt), block 128.
// Positions a split of the token's n_ctx takes: the split kernels' and the merge's one
// chunking (an even share rounded up to AD_GRAN).
__device__ __forceinline__ int attn_split_chunk(int n_ctx, int nsplit) {
    const int chunk = (n_ctx + nsplit - 1) / nsplit;
    return (chunk + AD_GRAN - 1) / AD_GRAN * AD_GRAN;
}
// Splits past the token's context are empty.
__device__ __forceinline__ int attn_active_splits(int n_ctx, int nsplit) {
    const int chunk = attn_split_chunk(n_ctx, nsplit);
    return min(nsplit, (n_ctx + chunk - 1) / chunk);
}
template <int G>
__device__ __forceinline__ void attn_merge_impl(const float* part, int kv_heads, int nsplit, float* out, i64 os,
                                                i8* aq, float* ad, const int* pos) {
    int h = blockIdx.x, t = blockIdx.y, d = threadIdx.x;
    int active = attn_active_splits(pos[t] + 1, nsplit);
    int kvh = h / G, g = h % G;
    int heads = kv_heads * G;
    const float* base = part + ((i64)t * kv_heads + kvh) * nsplit * (G * (AD_HD + 2));
    float M = NEG_INF;
    for (int s = 0; s < active; s++) {
        const float* ps = base + s * (G * (AD_HD + 2));
        if (ps[G + g] > 0.f) M = fmaxf(M, ps[g]);
    }
    float L = 0.f, o = 0.f;
    for (int s = 0; s < active; s++) {
        const float* ps = base + s * (G * (AD_HD + 2));
        float l = ps[G + g];
        if (l > 0.f) {
            float f = __expf(ps[g] - M);
            L = __fmaf_rn(l, f, L);
            o = __fmaf_rn(ps[2 * G + g * AD_HD + d], f, o);
        }
    }
    float v = o / L;
    out[t * os + h * AD_HD + d] = v;
    int qv = q8_lane(v, ad + (i64)t * (heads * AD_HD / 32) + h * 4 + (d >> 5));
    aq[(i64)t * heads * AD_HD + h * AD_HD + d] = (i8)qv;
}

// The merge of attn_merge_impl for all G heads of KV head kvh of token t, by the last split
// block of (t, kvh) (attn_dec6m): the splits' m and l staged in shared memory, the factors
// exp(m - M) computed once per (split, head) (thread s for split s), then each thread (dim d)
// sums over the splits in order: the same operations on the same values as attn_merge6
// (bit-identical). nsplit <= AD_MAXSPLIT. block 128 (= AD_HD).
#define AD_MAXSPLIT 128
template <int G>
__device__ __forceinline__ void attn_merge_last(const float* base, int nsplit, int active, int kvh, int t, int heads,
                                                float* out, i64 os, i8* aq, float* ad) {
    __shared__ float s_m[AD_MAXSPLIT][G], s_l[AD_MAXSPLIT][G], s_M[4][G];
    const int PS = G * (AD_HD + 2);
    int d = threadIdx.x, warp = d >> 5, lane = d & 31;
    for (int i = d; i < active * 2 * G; i += blockDim.x) {
        int sp = i / (2 * G), j = i - sp * 2 * G;
        float v = __ldcg(base + (i64)sp * PS + j);
        if (j < G) s_m[sp][j] = v;
        else s_l[sp][j - G] = v;
    }
    __syncthreads();
    // M per head: max over the non-empty splits (exact in any order).
#pragma unroll
    for (int g = 0; g < G; g++) {
        float m = NEG_INF;
        for (int sp = d; sp < active; sp += blockDim.x)
            if (s_l[sp][g] > 0.f) m = fmaxf(m, s_m[sp][g]);
        m = warp_max(m);
        if (lane == 0) s_M[warp][g] = m;
    }
    __syncthreads();
    float Mg[G];
#pragma unroll
    for (int g = 0; g < G; g++) Mg[g] = fmaxf(fmaxf(s_M[0][g], s_M[1][g]), fmaxf(s_M[2][g], s_M[3][g]));
    __syncthreads();
    // s_m now holds the factors f = exp(m - M) (0 for empty splits; never read there).
    for (int sp = d; sp < active; sp += blockDim.x)
#pragma unroll
        for (int g = 0; g < G; g++) s_m[sp][g] = s_l[sp][g] > 0.f ? __expf(s_m[sp][g] - Mg[g]) : 0.f;
    __syncthreads();
    // Splits outer, heads inner: the G heads' loads of a split (and of the next splits,
    // unrolled) are in flight together, and no store comes before the last load. Per head the
    // sums still run over the splits in order.
    float L[G], o[G];
#pragma unroll
    for (int g = 0; g < G; g++) L[g] = o[g] = 0.f;
    const float* po = base + 2 * G + d;
#pragma unroll 4
    for (int sp = 0; sp < active; sp++) {
        float pv[G];
#pragma unroll
        for (int g = 0; g < G; g++) pv[g] = __ldcg(po + (i64)sp * PS + g * AD_HD);
#pragma unroll
        for (int g = 0; g < G; g++) {
            float l = s_l[sp][g];
            if (l > 0.f) {
                float f = s_m[sp][g];
                L[g] = __fmaf_rn(l, f, L[g]);
                o[g] = __fmaf_rn(pv[g], f, o[g]);
            }
        }
    }
#pragma unroll
    for (int g = 0; g < G; g++) {
        int h = kvh * G + g;
        float v = o[g] / L[g];
        out[t * os + h * AD_HD + d] = v;
        int qv = q8_lane(v, ad + (i64)t * (heads * AD_HD / 32) + h * 4 + (d >> 5));
        aq[(i64)t * heads * AD_HD + h * AD_HD + d] = (i8)qv;
    }
}

// MERGE (attn_dec6m, MINIMAX_ATTN_FUSE): the last split block of (t, kvh) to finish
// (arrive_last on cnt[t * kv_heads + kvh]) merges the G heads (attn_merge_last): attn_merge6
// folded in, bit-identical.
template <int G, bool MERGE = false>
__device__ __forceinline__ void attn_dec_impl(const float* q, i64 qs, const u16* kc, const u16* vc, const int* pos,
                                              const int* seq, const int* pt_off, const u32* pts, int page_size,
                                              int kv_heads, int nsplit, float scale, float* part, int bf,
                                              u32* cnt = nullptr, float* mout = nullptr, i64 mos = 0,
                                              i8* aq = nullptr, float* ad = nullptr) {
    __shared__ float sm_m[AD_WARPS][G], sm_l[AD_WARPS][G];
    __shared__ float sm_o[AD_WARPS][G][AD_HD];
    int kvh = blockIdx.x, sp = blockIdx.y, t = blockIdx.z;
    int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    int half = lane >> 4, d0 = (lane & 15) * 8;
    int n_ctx = pos[t] + 1;
    int chunk = attn_split_chunk(n_ctx, nsplit);
    int start = sp * chunk, end = min(n_ctx, start + chunk);
    const u32* pt = pts + pt_off[seq[t]];
    float qv[G][8], acc[G][8], m[G], l[G];
#pragma unroll
    for (int g = 0; g < G; g++) {
        const float* qh = q + t * qs + (kvh * G + g) * AD_HD + d0;
#pragma unroll
        for (int i = 0; i < 8; i++) {
            qv[g][i] = qh[i] * scale;
            acc[g][i] = 0.f;
        }
        m[g] = NEG_INF;
        l[g] = 0.f;
    }
    for (int pp = start + 2 * warp; pp < end; pp += 2 * AD_WARPS) {
        int p = pp + half;
        bool valid = p < end;
        float s[G];
        int4 vraw = make_int4(0, 0, 0, 0);
        if (valid) {
            i64 slot = (i64)pt[p / page_size] * page_size + p % page_size;
            i64 off = (slot * kv_heads + kvh) * AD_HD + d0;
            int4 kraw = *(const int4*)(kc + off);
            vraw = *(const int4*)(vc + off);
            float kf[8];
            h16x8(kraw, kf, bf);
#pragma unroll
            for (int g = 0; g < G; g++) {
                float a = 0.f;
#pragma unroll
                for (int i = 0; i < 8; i++) a += qv[g][i] * kf[i];
                s[g] = a;
            }
        } else {
#pragma unroll
            for (int g = 0; g < G; g++) s[g] = 0.f;
        }
#pragma unroll
        for (int g = 0; g < G; g++) {
#pragma unroll
            for (int o = 8; o > 0; o >>= 1) s[g] += __shfl_xor_sync(0xffffffffu, s[g], o);
        }
        if (valid) {
            float vf[8];
            h16x8(vraw, vf, bf);
#pragma unroll
            for (int g = 0; g < G; g++) {
                float mn = fmaxf(m[g], s[g]);
                float corr = __expf(m[g] - mn);
                float e = __expf(s[g] - mn);
                l[g] = l[g] * corr + e;
#pragma unroll
                for (int i = 0; i < 8; i++) acc[g][i] = acc[g][i] * corr + e * vf[i];
                m[g] = mn;
            }
        }
    }
    // Merge the two half-warps (same dims, different positions).
#pragma unroll
    for (int g = 0; g < G; g++) {
        float mo = __shfl_xor_sync(0xffffffffu, m[g], 16);
        float lo = __shfl_xor_sync(0xffffffffu, l[g], 16);
        float M = fmaxf(m[g], mo);
        float f = l[g] > 0.f ? __expf(m[g] - M) : 0.f;
        float fo = lo > 0.f ? __expf(mo - M) : 0.f;
        l[g] = l[g] * f + lo * fo;
#pragma unroll
        for (int i = 0; i < 8; i++) {
            float ao = __shfl_xor_sync(0xffffffffu, acc[g][i], 16);
            acc[g][i] = acc[g][i] * f + ao * fo;
        }
        m[g] = M;
        if (lane == 0) {
            sm_m[warp][g] = M;
            sm_l[warp][g] = l[g];
        }
        if (half == 0) {
#pragma unroll
            for (int i = 0; i < 8; i++) sm_o[warp][g][d0 + i] = acc[g][i];
        }
    }
    __syncthreads();
    float* out = part + (((i64)t * kv_heads + kvh) * nsplit + sp) * (G * (AD_HD + 2));
    for (int idx = threadIdx.x; idx < G * AD_HD; idx += blockDim.x) {
        int g = idx / AD_HD, d = idx % AD_HD;
        float M = NEG_INF;
#pragma unroll
        for (int w = 0; w < AD_WARPS; w++) M = fmaxf(M, sm_m[w][g]);
        float L = 0.f, o = 0.f;
#pragma unroll
        for (int w = 0; w < AD_WARPS; w++) {
            float f = sm_l[w][g] > 0.f ? __expf(sm_m[w][g] - M) : 0.f;
            L += sm_l[w][g] * f;
            o += sm_o[w][g][d] * f;
        }
        out[2 * G + g * AD_HD + d] = o;
        if (d == 0) {
            out[g] = M;
            out[G + g] = L;
        }
    }
    if (MERGE) {
        if (arrive_last(cnt + t * kv_heads + kvh, gridDim.y)) {
            const float* base = part + ((i64)t * kv_heads + kvh) * nsplit * (G * (AD_HD + 2));
            attn_merge_last<G>(base, nsplit, attn_active_splits(n_ctx, nsplit), kvh, t, kv_heads * G, mout, mos, aq, ad);
            if (threadIdx.x == 0) cnt[t * kv_heads + kvh] = 0;
        }
    }
}

#define ATTD_INST(name, KV, BF)                                                                                  \
    extern "C" __global__ void __launch_bounds__(1024) qk_norm_rope_store_##name(                                 \
        float* q, i64 qs, float* k, const float* v, i64 kvs, const float* qn, const float* kn, int qw, int kw,   \
        int vw, int hd, int rot, const int* pos, float theta, float eps, const int* slots, void* kc, void* vc) { \
        pdl_enter();                                                                                     \
        qk_norm_rope_store_impl<KV>(q, qs, k, v, kvs, qn, kn, qw, kw, vw, hd, rot, pos, theta, eps, slots, kc,  \
                                    vc);                                                                         \
    }                                                                                                            \
    extern "C" __global__ void __launch_bounds__(1024) qk_norm_rope_store_p_##name(                               \
        float* q, i64 qs, float* k, const float* v, i64 kvs, const float* qn, const float* kn, int qw, int kw,   \
        int vw, int hd, int rot, const int* pos, float theta, float eps, const int* slots, void* kc, void* vc) { \
        qk_norm_rope_store_impl<KV, true>(q, qs, k, v, kvs, qn, kn, qw, kw, vw, hd, rot, pos, theta, eps, slots, \
                                          kc, vc);                                                               \
    }                                                                                                            \
    extern "C" __global__ void __launch_bounds__(1024) qk_norm_rope_store_tp_##name(                              \
        float* q, i64 qs, float* k, const float* v, i64 kvs, const float* qn, const float* kn, int qw, int kw,   \
        int vw, int hd, int rot, const int* pos, float theta, float eps, const int* slots, void* kc, void* vc,   \
        const float* ssx, int q_full, int k_full) {                                                              \
        pdl_enter();                                                                                             \
        qk_norm_rope_store_impl<KV>(q, qs, k, v, kvs, qn, kn, qw, kw, vw, hd, rot, pos, theta, eps, slots, kc,  \
                                    vc, ssx, q_full, k_full);                                                    \
    }                                                                                                            \
    extern "C" __global__ void __launch_bounds__(32 * AD_WARPS) attn_dec6_##name(                                \
        const float* q, i64 qs, const u16* kc, const u16* vc, const int* pos, const int* seq, const int* pt_off, \
        const u32* pts, int page_size, int kv_heads, int nsplit, float scale, float* part) {                     \
        pdl_enter();                                                                                     \
        attn_dec_impl<6>(q, qs, kc, vc, pos, seq, pt_off, pts, page_size, kv_heads, nsplit, scale, part, BF);    \
    }                                                                                                            \
    extern "C" __global__ void __launch_bounds__(32 * AD_WARPS) attn_dec6m_##name(                               \
        const float* q, i64 qs, const u16* kc, const u16* vc, const int* pos, const int* seq, const int* pt_off, \
        const u32* pts, int page_size, int kv_heads, int nsplit, float scale, float* part, u32* cnt, float* out,  \
        i64 os, i8* aq, float* ad) {                                                                             \
        pdl_enter();                                                                                             \
        attn_dec_impl<6, true>(q, qs, kc, vc, pos, seq, pt_off, pts, page_size, kv_heads, nsplit, scale, part, BF, \
                               cnt, out, os, aq, ad);                                                           \
    }

ATTD_INST(f16, KV_F16, 0)
ATTD_INST(bf16, KV_BF16, 1)

extern "C" __global__ void __launch_bounds__(128)
    attn_merge6(const float* part, int kv_heads, int nsplit, float* out, i64 os, i8* aq, float* ad, const int* pos) {
    pdl_enter();
    attn_merge_impl<6>(part, kv_heads, nsplit, out, os, aq, ad, pos);
}
// attn_merge6 with the early trigger: the o-projection after it (mvqs_*p) starts its weight
// copies while attention and this merge run.
extern "C" __global__ void __launch_bounds__(128)
    attn_merge6e(const float* part, int kv_heads, int nsplit, float* out, i64 os, i8* aq, float* ad, const int* pos) {
    pdl_trigger();
    pdl_wait();
    attn_merge_impl<6>(part, kv_heads, nsplit, out, os, aq, ad, pos);
}

// ------------------------------------ split-K decode attention on tensor cores -----------
// attn_dec6t_*: the same blocks, chunking and partial layout as attn_dec6_* (merged by
// attn_merge6 or, in attn_dec6tm_*, by the last split block), but S = Q K^T and O += P V run
// as mma.sync m16n8k16 (f16 or bf16 inputs as the cache, f32 accumulation) and K/V reach
// shared memory through a cp.async ring, so each warp has AT_NST - 1 tiles in flight while it
// computes one.
// - Warp w of the block takes the 16-position tiles w, w + 4, ... of the block's positions.
//   Its ring holds AT_NST stages of (K tile, V tile), 16 rows of 256 bytes each, the 16-byte
//   pieces of row r stored at piece ^ (r & 7) (ldmatrix without bank conflicts); positions past
//   the end are zero-filled (cp.async with source size 0) and their scores masked to -inf.
// - MMA rows: rows 0..7 are the high parts of the G query heads (hi = rn16(q * scale), rows
//   >= G zero), rows 8..15 the low parts (lo = rn16(q * scale - hi)): the 8 rows a GQA group
//   of 6 leaves free carry the rounding error of the 16-bit Q, so S = rows g + (g + 8) is
//   within f32 rounding of the f32 product. P (f32 from exp) is split the same way for P V,
//   and O = rows g + (g + 8). K and V are exact in 16 bits; accuracy is that of the f32 kernel.
// - Online softmax per head on the mma fragments: a thread holds 4 scores of head
//   lane / 4 per tile (positions 2 (lane % 4) + {0, 1, 8, 9}), the tile max over the quad by 2
//   shuffles, l kept per thread and summed over the quad at the end.
// - The warp's (m, l, o) goes to shared memory (o over its own ring) and the block combines
//   its 4 warps exactly as attn_dec_impl does.
// Dynamic shared memory AT_SMEM (the host sets the attribute); sm_80 and newer.
#define AT_TILE 16
#define AT_NST 3
#define AT_STAGE (2 * AT_TILE * AD_HD * 2)      // bytes of one stage: K tile then V tile
#define AT_WBYTES (AT_NST * AT_STAGE)           // one warp's ring
#define AT_SMEM (AD_WARPS * AT_WBYTES)          // 98304
// Stages of the one-token kernels (attn_dec6tn_*, attn_dec6tnm_*): set by the host for the
// architecture (nvrtc.rs: 5 where a block may hold 166 KB of shared memory, e.g. sm_90; else 3,
// e.g. sm_120's 99 KB). Their grid is at most one block per SM (Gpu::attn_splits), so the
// larger ring costs no co-residency of their own blocks; with 3 stages two of them could share
// an SM (session 27: 5 stages, batch 1 3.99 -> 3.91 ms a step, 32k 6.48 -> 6.17 ms).
#ifndef AT_NST1
#define AT_NST1 AT_NST
#endif

// c += A B, m16n8k16, f32 accumulators; BF: bf16 inputs, else f16.
template <int BF> __device__ __forceinline__ void at_mma(float* c, const u32* a, u32 b0, u32 b1) {
    if (BF)
        asm("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
            "{%0,%1,%2,%3};"
            : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
            : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
    else
        asm("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
            "{%0,%1,%2,%3};"
            : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
            : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}
// (x0, x1) rounded to a 16-bit pair (x0 in the low half), and back to f32.
template <int BF> __device__ __forceinline__ u32 at_pack(float x0, float x1) {
    u32 r;
    if (BF) asm("cvt.rn.bf16x2.f32 %0, %1, %2;" : "=r"(r) : "f"(x1), "f"(x0));
    else asm("cvt.rn.f16x2.f32 %0, %1, %2;" : "=r"(r) : "f"(x1), "f"(x0));
    return r;
}
template <int BF> __device__ __forceinline__ void at_unpack(u32 v, float& x0, float& x1) {
    if (BF) {
        x0 = __uint_as_float(v << 16);
        x1 = __uint_as_float(v & 0xffff0000u);
    } else {
        x0 = f16_to_f32((u16)(v & 0xffffu));
        x1 = f16_to_f32((u16)(v >> 16));
    }
}
// x ~ hi + lo in two 16-bit pairs (x - hi is exact in f32).
template <int BF> __device__ __forceinline__ void at_split(float x0, float x1, u32& hi, u32& lo) {
    hi = at_pack<BF>(x0, x1);
    float h0, h1;
    at_unpack<BF>(hi, h0, h1);
    lo = at_pack<BF>(x0 - h0, x1 - h1);
}

// attn_dec6tn_*: the q / k norms, RoPE and the KV store of qk_norm_rope_store done by the
// attention's blocks themselves (one-token steps, no q/k norm launch). Every block sums the
// squares of the whole raw q and k rows (the product's output, every load in flight at once) in
// qk_norm_rope_store's order, so every block has its 1 / rms bit for bit; then its 128 threads
// normalize and rotate dim d of its G query heads into shared memory, from which each warp
// builds its Q fragments. The block whose split holds the new position normalizes and rotates
// its KV head's key, stores key and value at the step's slot (for later steps) and puts both
// 16-bit rows into its ring stage in place of what the copy read from that slot, so it need not
// wait for its own store. Before the PDL wait (nothing of this step is read): the norm weights
// and the first K/V tiles (positions of earlier steps, or the new slot, which is replaced).
// Same arithmetic as qk_norm_rope_store in the same order: bit-identical.
struct QkNorm {
    const float* q;    // raw q row (the product's output), qw = heads x 128
    const float* k;    // raw k row, kw = kv_heads x 128
    const float* v;    // raw v row
    const float* qn;   // q norm weight (whole row)
    const float* kn;   // k norm weight
    const float* rope; // the step's RoPE table (rope_table): cos, sin, 64 each a token
    int qw, kw;        // widths (at most QK_MAXV x 1024 each: the host checks)
    int rot;           // rotary dims a head (even, <= 128)
    float eps;
    const int* slots;  // cache slot of the step's token
    u16* kc;           // caches (written: the new key / value)
    u16* vc;
    int pre_tiles;     // the first K/V tiles issued before the PDL wait
    int exit_empty;    // blocks of empty splits leave at once (the separate merge reads none)
};

template <int G, int BF, bool MERGE = false, bool NORM = false, int NST = AT_NST>
__device__ __forceinline__ void attn_dect_impl(const float* q, i64 qs, const u16* kc, const u16* vc, const int* pos,
                                               const int* seq, const int* pt_off, const u32* pts, int page_size,
                                               int kv_heads, int nsplit, float scale, float* part, u32* cnt = nullptr,
                                               float* mout = nullptr, i64 mos = 0, i8* aq = nullptr,
                                               float* ad = nullptr, const QkNorm* qkn = nullptr) {
    extern __shared__ __align__(128) u8 at_sm[];
    __shared__ float sm_m[AD_WARPS][G], sm_l[AD_WARPS][G];
    int kvh = blockIdx.x, sp = blockIdx.y, t = blockIdx.z;
    int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    int gr = lane >> 2, tq = lane & 3;
    int n_ctx = pos[t] + 1;
    int chunk = attn_split_chunk(n_ctx, nsplit);
    int start = sp * chunk, end = min(n_ctx, start + chunk);
    int ntiles = end > start ? (end - start + AT_TILE - 1) / AT_TILE : 0;
    // A split past the context (short contexts leave most of them empty) has nothing to add:
    // attn_merge6 reads only the active splits, so its block leaves before its PDL wait and
    // its SM is free for the o-projection's blocks. (The last-block merge counts every block.)
    if (NORM && !MERGE && qkn->exit_empty && start >= end) return;
    int my_n = ntiles > warp ? (ntiles - warp + AD_WARPS - 1) / AD_WARPS : 0;
    const u32* pt = pts + pt_off[seq[t]];
    constexpr int WBYTES = NST * AT_STAGE;  // one warp's ring
    u8* ring = at_sm + warp * WBYTES;
    u32 ring_s = smem_addr(ring);
    const i64 sstride = (i64)kv_heads * AD_HD;  // elements from one slot to the next
    const u16* kb = kc + (i64)kvh * AD_HD + (lane & 15) * 8;
    const u16* vb = vc + (i64)kvh * AD_HD + (lane & 15) * 8;
    // Slot of position (lane & 15) of the warp's tile j (0 past the end: never read).
    auto slot_of = [&](int j) -> i64 {
        int p = start + AT_TILE * (warp + AD_WARPS * j) + (lane & 15);
        return p < end ? (i64)pt[p / page_size] * page_size + p % page_size : 0;
    };
    // Tile j into stage st: lane copies piece (lane & 15) of rows (lane >> 4) + 2 i of K and V.
    auto issue = [&](int j, int st, i64 slot) {
        int base = start + AT_TILE * (warp + AD_WARPS * j);
        u32 ks = ring_s + st * AT_STAGE, pc = lane & 15;
#pragma unroll
        for (int i = 0; i < 8; i++) {
            int r = (lane >> 4) + 2 * i;
            i64 sl = __shfl_sync(0xffffffffu, slot, r);
            int bytes = base + r < end ? 16 : 0;
            u32 so = r * 256 + ((pc ^ (r & 7)) << 4);
            cp_async16z(ks + so, kb + sl * sstride, bytes);
            cp_async16z(ks + AT_TILE * AD_HD * 2 + so, vb + sl * sstride, bytes);
        }
    };
    // NORM: the norm weights of this thread's dims (and RoPE partners) before the wait.
    float nw_q[G], nw_qp[G], nw_k = 0.f, nw_kp = 0.f;
    if (NORM) {
        const QkNorm& z = *qkn;
        int d = threadIdx.x, half = z.rot / 2;
        int dp = d < half ? d + half : (d < z.rot ? d - half : d);
#pragma unroll
        for (int g = 0; g < G; g++) {
            nw_q[g] = z.qn[(i64)(kvh * G + g) * AD_HD + d];
            nw_qp[g] = z.qn[(i64)(kvh * G + g) * AD_HD + dp];
        }
        nw_k = z.kn[(i64)kvh * AD_HD + d];
        nw_kp = z.kn[(i64)kvh * AD_HD + dp];
    }
    // (pre_tiles == 0: the tiles after the wait; A/B and diagnosis.)
    if (NORM && !qkn->pre_tiles) {
        pdl_wait();
        pdl_trigger();
    }
    if (my_n > 0) issue(0, 0, slot_of(0));
    cp_async_commit();
#pragma unroll
    for (int s = 1; s < NST - 1; s++) {
        if (s < my_n) issue(s, s, slot_of(s));
        cp_async_commit();
    }
    i64 nslot = NST - 1 < my_n ? slot_of(NST - 1) : 0;
    if (NORM && qkn->pre_tiles) {
        pdl_wait();
        pdl_trigger();
    }
    // Q fragments (A of S = Q K^T), k-step kk: reg 0 / 2 = hi of head gr, dims 16 kk + 2 tq
    // + {0, 1} / + {8, 9}; reg 1 / 3 = the lo parts (rows gr + 8).
    u32 qa[8][4];
    // NORM: the new position's split, its K and V rows (16-bit, as the cache stores them), the
    // normalized and rotated q of the block's G heads.
    // (Sized 1 in the other kernels, whose shared memory stays as it was: on a 99 KB sm_120
    // block attn_dec6t_* has ~0.5 KB beside its 96 KB ring.)
    __shared__ __align__(16) u16 sm_newkv[NORM ? 2 : 1][NORM ? AD_HD : 8];
    __shared__ float sm_red[2][NORM ? 32 : 1];
    __shared__ float sm_q[NORM ? G : 1][NORM ? AD_HD : 1];
    const int newp = n_ctx - 1;
    const bool holds_new = NORM && newp >= start && newp < end;
    if (NORM) {
        const QkNorm& z = *qkn;
        int d = threadIdx.x;  // block = AD_HD threads: dim d of each head
        int half = z.rot / 2;
        bool rd = d < z.rot;
        int dp = d < half ? d + half : (rd ? d - half : d);  // RoPE partner dim
        int ra = d < half ? d : d - half;                     // its angle (rd only)
        // After the wait, every load at once: the whole q and k rows (for the sums), this
        // thread's dims and partner dims, the RoPE angle, the new key / value.
        // The sums of squares in qk_norm_rope_store's order (its 1024 threads, QK_MAXV values
        // each, a butterfly per warp, then one over the 32 warp sums), so 1 / rms is the same
        // bits: thread d plays its threads d + 128 m (m < 8), which are lane d % 32 of its warps
        // d / 32 + 4 m, so this warp's butterflies are theirs.
        float sq[8], sk[8];
#pragma unroll
        for (int m = 0; m < 8; m++) {
            int vt = d + AD_HD * m;
            float a = 0.f, b = 0.f;
#pragma unroll
            for (int i = 0; i < QK_MAXV; i++) {
                int idx = vt + i * 1024;
                float x = idx < z.qw ? z.q[idx] : 0.f;
                a += x * x;
                float y = idx < z.kw ? z.k[idx] : 0.f;
                b += y * y;
            }
            sq[m] = a;
            sk[m] = b;
        }
        float xo[G], xp[G];
#pragma unroll
        for (int g = 0; g < G; g++) {
            xo[g] = z.q[(i64)(kvh * G + g) * AD_HD + d];
            xp[g] = z.q[(i64)(kvh * G + g) * AD_HD + dp];
        }
        float c = rd ? z.rope[t * 128 + ra] : 1.f, sn = rd ? z.rope[t * 128 + 64 + ra] : 0.f;
        float kx = 0.f, kx2 = 0.f, vx = 0.f;
        if (holds_new) {
            kx = z.k[(i64)kvh * AD_HD + d];
            kx2 = z.k[(i64)kvh * AD_HD + dp];
            vx = z.v[(i64)kvh * AD_HD + d];
        }
#pragma unroll
        for (int m = 0; m < 8; m++) {
            sq[m] = warp_sum(sq[m]);
            sk[m] = warp_sum(sk[m]);
        }
        if (lane == 0) {
#pragma unroll
            for (int m = 0; m < 8; m++) {
                sm_red[0][warp + 4 * m] = sq[m];
                sm_red[1][warp + 4 * m] = sk[m];
            }
        }
        __syncthreads();
        float tq_ = warp_sum(sm_red[0][lane]);
        float tk_ = warp_sum(sm_red[1][lane]);
        float inv_q = 1.0f / sqrtf(tq_ / (float)z.qw + z.eps);
        float inv_k = 1.0f / sqrtf(tk_ / (float)z.kw + z.eps);
        // x inv w, then RoPE on dims [0, rot): (u, u + half) -> (u c - v s, v c + u s).
#pragma unroll
        for (int g = 0; g < G; g++) {
            float xs = xo[g] * inv_q * nw_q[g], xs2 = xp[g] * inv_q * nw_qp[g];
            float o = xs;
            if (d < half) o = o * c - xs2 * sn;
            else if (rd) o = o * c + xs2 * sn;
            sm_q[g][d] = o;
        }
        if (holds_new) {
            float xs = kx * inv_k * nw_k, xs2 = kx2 * inv_k * nw_kp;
            float o = xs;
            if (d < half) o = o * c - xs2 * sn;
            else if (rd) o = o * c + xs2 * sn;
            u16 k16 = kv_store<BF ? KV_BF16 : KV_F16>(o), v16 = kv_store<BF ? KV_BF16 : KV_F16>(vx);
            sm_newkv[0][d] = k16;
            sm_newkv[1][d] = v16;
            i64 sl = (i64)z.slots[t];
            z.kc[sl * sstride + (i64)kvh * AD_HD + d] = k16;
            z.vc[sl * sstride + (i64)kvh * AD_HD + d] = v16;
        }
        __syncthreads();
    }
    {
        // q (NORM: as normalized above, in shared memory) of head gr, times the score scale.
        bool hv = gr < G;
        const float* qh = NORM ? &sm_q[hv ? gr : 0][2 * tq] : q + t * qs + (kvh * G + (hv ? gr : 0)) * AD_HD + 2 * tq;
#pragma unroll
        for (int kk = 0; kk < 8; kk++) {
            float x0 = hv ? qh[16 * kk] * scale : 0.f, x1 = hv ? qh[16 * kk + 1] * scale : 0.f;
            float x2 = hv ? qh[16 * kk + 8] * scale : 0.f, x3 = hv ? qh[16 * kk + 9] * scale : 0.f;
            at_split<BF>(x0, x1, qa[kk][0], qa[kk][1]);
            at_split<BF>(x2, x3, qa[kk][2], qa[kk][3]);
        }
    }
    float o[16][4];
#pragma unroll
    for (int n = 0; n < 16; n++) o[n][0] = o[n][1] = o[n][2] = o[n][3] = 0.f;
    float m = NEG_INF, l = 0.f;
    // ldmatrix row addresses (without the stage and piece): K (non-transposed, matrices
    // (rows 0-7 | 8-15) x (piece 2kk | 2kk+1)) and V (transposed, (rows 0-7 | 8-15) x (piece
    // 2jj | 2jj+1), rows fastest).
    int mi = lane >> 3;
    int kr = ((mi >> 1) << 3) + (lane & 7), vr = ((mi & 1) << 3) + (lane & 7);
    int kpc = mi & 1, vpc = mi >> 1;
    for (int j = 0; j < my_n; j++) {
        __syncwarp();  // every lane is done reading the stage refilled next
        {
            int jn = j + NST - 1;
            if (jn < my_n) {
                issue(jn, jn % NST, nslot);
                if (jn + 1 < my_n) nslot = slot_of(jn + 1);
            }
            cp_async_commit();
        }
        cp_async_wait<NST - 1>();
        __syncwarp();
        u32 ks = ring_s + (j % NST) * AT_STAGE, vs = ks + AT_TILE * AD_HD * 2;
        if (NORM && holds_new) {
            // The new position's row of this tile: the key / value computed above replace what
            // the copy read from the cache (lanes 0-15: K pieces, 16-31: V pieces).
            int r = newp - (start + AT_TILE * (warp + AD_WARPS * j));
            if (r >= 0 && r < AT_TILE) {
                int pc = lane & 15, kv = lane >> 4;
                int4 val = *(const int4*)&sm_newkv[kv][8 * pc];
                u32 dst = ks + kv * (AT_TILE * AD_HD * 2) + r * 256 + ((pc ^ (r & 7)) << 4);
                asm volatile("st.shared.v4.b32 [%0], {%1, %2, %3, %4};" ::"r"(dst), "r"(val.x), "r"(val.y), "r"(val.z),
                             "r"(val.w)
                             : "memory");
                __syncwarp();
            }
        }
        // S: two n-tiles (positions 0-7, 8-15), two accumulator chains each (even / odd kk).
        float s[2][2][4];
#pragma unroll
        for (int a = 0; a < 2; a++)
#pragma unroll
            for (int b = 0; b < 2; b++) s[a][b][0] = s[a][b][1] = s[a][b][2] = s[a][b][3] = 0.f;
#pragma unroll
        for (int kk = 0; kk < 8; kk++) {
            u32 b0, b1, b2, b3;
            ldsm_x4(ks + kr * 256 + (((2 * kk + kpc) ^ (kr & 7)) << 4), b0, b1, b2, b3);
            at_mma<BF>(s[0][kk & 1], qa[kk], b0, b1);
            at_mma<BF>(s[1][kk & 1], qa[kk], b2, b3);
        }
        int pb = start + AT_TILE * (warp + AD_WARPS * j) + 2 * tq;
        float sc[4];
        sc[0] = (s[0][0][0] + s[0][0][2]) + (s[0][1][0] + s[0][1][2]);
        sc[1] = (s[0][0][1] + s[0][0][3]) + (s[0][1][1] + s[0][1][3]);
        sc[2] = (s[1][0][0] + s[1][0][2]) + (s[1][1][0] + s[1][1][2]);
        sc[3] = (s[1][0][1] + s[1][0][3]) + (s[1][1][1] + s[1][1][3]);
        if (pb >= end) sc[0] = NEG_INF;
        if (pb + 1 >= end) sc[1] = NEG_INF;
        if (pb + 8 >= end) sc[2] = NEG_INF;
        if (pb + 9 >= end) sc[3] = NEG_INF;
        float mx = fmaxf(fmaxf(sc[0], sc[1]), fmaxf(sc[2], sc[3]));
        mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 1));
        mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 2));
        float mn = fmaxf(m, mx);  // finite: every tile has a position before end
        float corr = __expf(m - mn);
        m = mn;
        float p0 = __expf(sc[0] - mn), p1 = __expf(sc[1] - mn), p2 = __expf(sc[2] - mn), p3 = __expf(sc[3] - mn);
        l = l * corr + ((p0 + p1) + (p2 + p3));
#pragma unroll
        for (int n = 0; n < 16; n++) {
            o[n][0] *= corr;
            o[n][1] *= corr;
            o[n][2] *= corr;
            o[n][3] *= corr;
        }
        // P as the A operand (k = positions): reg 0 / 2 = hi of positions 2 tq + {0, 1} /
        // + {8, 9}, reg 1 / 3 = lo.
        u32 pa[4];
        at_split<BF>(p0, p1, pa[0], pa[1]);
        at_split<BF>(p2, p3, pa[2], pa[3]);
#pragma unroll
        for (int jj = 0; jj < 8; jj++) {
            u32 b0, b1, b2, b3;
            ldsm_x4_t(vs + vr * 256 + (((2 * jj + vpc) ^ (vr & 7)) << 4), b0, b1, b2, b3);
            at_mma<BF>(o[2 * jj], pa, b0, b1);
            at_mma<BF>(o[2 * jj + 1], pa, b2, b3);
        }
    }
    cp_async_wait<0>();
    l += __shfl_xor_sync(0xffffffffu, l, 1);
    l += __shfl_xor_sync(0xffffffffu, l, 2);
    __syncwarp();
    // The warp's o over its own ring: [G][AD_HD] f32.
    float* so = (float*)ring;
    if (gr < G) {
        if (tq == 0) {
            sm_m[warp][gr] = m;
            sm_l[warp][gr] = l;
        }
#pragma unroll
        for (int n = 0; n < 16; n++) {
            so[gr * AD_HD + 8 * n + 2 * tq] = o[n][0] + o[n][2];
            so[gr * AD_HD + 8 * n + 2 * tq + 1] = o[n][1] + o[n][3];
        }
    }
    __syncthreads();
    float* out = part + (((i64)t * kv_heads + kvh) * nsplit + sp) * (G * (AD_HD + 2));
    for (int idx = threadIdx.x; idx < G * AD_HD; idx += blockDim.x) {
        int g = idx / AD_HD, d = idx % AD_HD;
        float M = NEG_INF;
#pragma unroll
        for (int w = 0; w < AD_WARPS; w++) M = fmaxf(M, sm_m[w][g]);
        float L = 0.f, ov = 0.f;
#pragma unroll
        for (int w = 0; w < AD_WARPS; w++) {
            float f = sm_l[w][g] > 0.f ? __expf(sm_m[w][g] - M) : 0.f;
            L += sm_l[w][g] * f;
            ov += ((const float*)(at_sm + w * WBYTES))[g * AD_HD + d] * f;
        }
        out[2 * G + g * AD_HD + d] = ov;
        if (d == 0) {
            out[g] = M;
            out[G + g] = L;
        }
    }
    if (MERGE) {
        if (arrive_last(cnt + t * kv_heads + kvh, gridDim.y)) {
            const float* base = part + ((i64)t * kv_heads + kvh) * nsplit * (G * (AD_HD + 2));
            attn_merge_last<G>(base, nsplit, attn_active_splits(n_ctx, nsplit), kvh, t, kv_heads * G, mout, mos, aq, ad);
            if (threadIdx.x == 0) cnt[t * kv_heads + kvh] = 0;
        }
    }
}

#define ATTT_INST(name, BF)                                                                                      \
    extern "C" __global__ void __launch_bounds__(32 * AD_WARPS) attn_dec6t_##name(                               \
        const float* q, i64 qs, const u16* kc, const u16* vc, const int* pos, const int* seq, const int* pt_off, \
        const u32* pts, int page_size, int kv_heads, int nsplit, float scale, float* part) {                     \
        pdl_enter();                                                                                             \
        attn_dect_impl<6, BF>(q, qs, kc, vc, pos, seq, pt_off, pts, page_size, kv_heads, nsplit, scale, part);   \
    }                                                                                                            \
    extern "C" __global__ void __launch_bounds__(32 * AD_WARPS) attn_dec6tm_##name(                              \
        const float* q, i64 qs, const u16* kc, const u16* vc, const int* pos, const int* seq, const int* pt_off, \
        const u32* pts, int page_size, int kv_heads, int nsplit, float scale, float* part, u32* cnt, float* out,  \
        i64 os, i8* aq, float* ad) {                                                                             \
        pdl_enter();                                                                                             \
        attn_dect_impl<6, BF, true>(q, qs, kc, vc, pos, seq, pt_off, pts, page_size, kv_heads, nsplit, scale,    \
                                    part, cnt, out, os, aq, ad);                                                 \
    }

ATTT_INST(f16, 0)
ATTT_INST(bf16, 1)

// attn_dec6tn_* / attn_dec6tnm_* (QkNorm above): attn_dec6t_* / attn_dec6tm_* of one-token steps
// with the q / k norms, RoPE and KV store in the blocks; q, k, v are the product's raw rows.
// They wait inside (after the norm weights and the first tiles).
#define ATTTN_ARGS                                                                                               \
    const float *q, const float *k, const float *v, const float *qn, const float *kn, const float *rope, int qw,  \
        int kw, int rot, float eps, const int *slots, u16 *kc, u16 *vc, const int *pos, const int *seq,          \
        const int *pt_off, const u32 *pts, int page_size, int kv_heads, int nsplit, float scale, float *part,     \
        int pre_tiles, int exit_empty
// RoPE angles of the step's tokens, once a step for every layer (f64 as qk_norm_rope_store,
// whose per-layer f64 pow / cos / sin would otherwise sit in every attention block's path):
// rope[t][0][i] = cos(pos[t] theta^(-2i / rot)), rope[t][1][i] = sin(...), i < rot / 2 <= 64.
// The angles are computed before the PDL wait (pos is step metadata), stored after it.
// grid (tokens), block 64.
extern "C" __global__ void __launch_bounds__(64) rope_table(const int* pos, int rot, float theta, float* rope) {
    int t = blockIdx.x, i = threadIdx.x;
    float c = 0.f, sv = 0.f;
    if (i < rot / 2) {
        double p = (double)pos[t];
        double inv_freq = 1.0 / pow((double)theta, 2.0 * (double)i / (double)rot);
        double a = p * inv_freq;
        c = (float)cos(a);
        sv = (float)sin(a);
    }
    pdl_wait();
    pdl_trigger();
    rope[t * 128 + i] = c;
    rope[t * 128 + 64 + i] = sv;
}
#define ATTTN_INST(name, BF)                                                                                     \
    extern "C" __global__ void __launch_bounds__(32 * AD_WARPS) attn_dec6tn_##name(ATTTN_ARGS) {                 \
        QkNorm z{q, k, v, qn, kn, rope, qw, kw, rot, eps, slots, kc, vc, pre_tiles, exit_empty};                 \
        attn_dect_impl<6, BF, false, true, AT_NST1>(q, 0, kc, vc, pos, seq, pt_off, pts, page_size, kv_heads,    \
                                                    nsplit, scale, part, nullptr, nullptr, 0, nullptr, nullptr, &z); \
    }                                                                                                            \
    extern "C" __global__ void __launch_bounds__(32 * AD_WARPS) attn_dec6tnm_##name(                             \
        ATTTN_ARGS, u32 *cnt, float *out, i64 os, i8 *aq, float *ad) {                                           \
        QkNorm z{q, k, v, qn, kn, rope, qw, kw, rot, eps, slots, kc, vc, pre_tiles, exit_empty};                 \
        attn_dect_impl<6, BF, true, true, AT_NST1>(q, 0, kc, vc, pos, seq, pt_off, pts, page_size, kv_heads,     \
                                                   nsplit, scale, part, cnt, out, os, aq, ad, &z);              \
    }

ATTTN_INST(f16, 0)
ATTTN_INST(bf16, 1)
