// Streamed IQ4_XS expert kernels (host: fast::moe_stream, MINIMAX_MOE_STREAM). Appended to
// fast.cu in the "fast" module: they reuse its IQ4 decode, q8 and PDL helpers.
//
// Why: the register-direct expert kernels (moe_gate_up_psx, moe_down_rx4, the grouped
// moe_*_grpf) hold their weight loads in registers, so an SM has at most ~1-3 rows per warp in
// flight and waits on DRAM between them (~2 TB/s of the H200's 4.3). Here one producer warp per
// block streams the block's weight rows into a ring of shared-memory stages with bulk
// asynchronous copies (cp.async.bulk, completion counted by an mbarrier: one instruction per
// contiguous range, no registers held), up to BK_MAXST stages (~200 KB an SM on Hopper) ahead of
// the 16 consumer warps, which decode from shared memory exactly as the register kernels do
// from registers: same units per lane, same integer sums, same f32 expressions in the same
// order, so the outputs are bit-identical to psx / grpf (gate/up) and grpf (grouped down). The
// combine form of the down (one token's k experts summed in the block) is deterministic but
// sums in another order than rx4.
//
// Block: BK_CW consumer warps + 1 producer warp; grid = one block per SM (the host caps it by
// the task count), each block takes a contiguous range of the step's tasks (tasks ->
// stages in the same order on both sides). Stage ring: full[i] (producer's expect_tx + the
// copies' bytes) and empty[i] (one arrival per consumer warp) mbarriers, phase parity by round.
// Rows must be whole 16-byte multiples (host: fast_mat) and at most 96 units a lane round (3
// units per lane): gate/up inputs of <= 3072 columns, down rows of <= 1536.

#define BK_CW 16                    // consumer warps
#define BK_THREADS (32 * (BK_CW + 1))
#define BK_MAXST 8                  // most ring stages
#define BK_GU_SR 8                  // gate rows (and up rows) per gate/up stage: 4 stages a task
#define BK_DG_SR 32                 // rows per grouped-down stage (= task)
#define BK_DC_SR 4                  // output rows per combine-down stage (= task), x k experts
#define BK_HDR 17408                // barriers + the gate/up sums (2 x 2 x 32 x GG_MAXC floats), 128-aligned

// The PTX below exists from sm_90 on; below it the kernels compile to nothing useful and the
// host never launches them (fast::moe_stream_fits checks the arch).
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
// The consumer warps only (named barrier 1).
__device__ __forceinline__ void bk_consumers_sync() { asm volatile("bar.sync 1, %0;" ::"n"(32 * BK_CW) : "memory"); }

// The block's task range [t0, t1) of `total`.
__device__ __forceinline__ void bk_range(int total, int& t0, int& t1) {
    t0 = (int)((i64)total * blockIdx.x / gridDim.x);
    t1 = (int)((i64)total * (blockIdx.x + 1) / gridDim.x);
}

// Slot s of the step: grouped (grp, moe_group's layout: expert, pair count, pair list) or, with
// grp null, one pair per slot (slot s = pair s, expert ids[s]).
struct BkSlot {
    int e, c;
    const int* pairs;  // null: the slot's only pair is s
};
__device__ __forceinline__ BkSlot bk_slot(const int* grp, const int* ids, int E, int s, bool cg) {
    BkSlot r;
    if (grp) {
        r.e = cg ? __ldcg(grp + 1 + s) : grp[1 + s];
        r.c = min(cg ? __ldcg(grp + 1 + 2 * E + s) : grp[1 + 2 * E + s], GG_MAXC);
        r.pairs = grp + 1 + 3 * E + (cg ? __ldcg(grp + 1 + E + s) : grp[1 + E + s]);
    } else {
        r.e = cg ? __ldcg(ids + s) : ids[s];
        r.c = 1;
        r.pairs = nullptr;
    }
    return r;
}

// Shared-memory unit loads: header (d, scales) and the 16 code bytes of unit un of a row.
__device__ __forceinline__ void bk_unit(const u8* row, int un, uint2& h, uint2& qa, uint2& qb) {
    const u8* b = row + (un >> 3) * 136;
    h = *(const uint2*)b;
    qa = *(const uint2*)(b + 8 + 16 * (un & 7));
    qb = *(const uint2*)(b + 16 + 16 * (un & 7));
}

// ------------------------------------------------------------------ gate/up ------------
// Task = (slot, 32-row group rg) of the gate and up matrices of the slot's expert: 4 stages of
// BK_GU_SR gate rows then BK_GU_SR up rows. Consumer warp w takes stage row w (w < 8: gate row
// w, else up row w - 8): its 3 units per lane dotted with each pair's q8 input, one sum per
// (row, pair) into sg / su; after the task's 4 stages (consumer barrier) act = silu(g) * u -> q8
// as moe_gate_up_psx / grpf. Sums of a pair: one pair (c = 1) decodes and dots in one pass with
// the token's activations interleaved once in registers (psx's arithmetic); several pairs decode
// the units once, then dot per pair (grpf's). Both give the same bits.
// grid (min(SMs, tasks)), block BK_THREADS, dynamic shared memory BK_HDR + nst x 2 BK_GU_SR rb.
extern "C" __global__ void __launch_bounds__(BK_THREADS, 1)
    moe_gate_up_blk_iq4_xs(const u8* G, const u8* U, i64 rb, i64 es, const int* grp, const int* ids, int E, int k,
                           int npairs, int grows, int nst, const i8* xq, const float* xd, int ncol, i8* aq, float* ad,
                           int ld) {
    extern __shared__ __align__(128) u8 bk_sm[];
    u64* full = (u64*)bk_sm;
    u64* empty = full + BK_MAXST;
    float* sg = (float*)(bk_sm + 256);                 // [2][32][GG_MAXC]
    float* su = sg + 2 * 32 * GG_MAXC;                 // [2][32][GG_MAXC]
    u8* ring = bk_sm + BK_HDR;
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const u32 sb_bytes = (u32)(2 * BK_GU_SR * rb);
    if (threadIdx.x == 0) {
        for (int i = 0; i < nst; i++) {
            bk_mb_init(&full[i], 1);
            bk_mb_init(&empty[i], BK_CW);
        }
        bk_mb_fence_init();
    }
    __syncthreads();
    pdl_wait();  // the slots (router / moe_group) and the input (norm_q8) come from this step
    const int nrg = grows >> 5;
    const int nslots = grp ? grp[0] : npairs;
    int t0, t1;
    bk_range(nslots * nrg, t0, t1);
    if (warp == BK_CW) {
        // Producer: lane 0 walks the same stages as the consumers.
        if (lane == 0) {
            int n = 0;
            for (int task = t0; task < t1; task++) {
                BkSlot sl = bk_slot(grp, ids, E, task / nrg, false);
                i64 off = (i64)sl.e * es + (i64)((task % nrg) * 32) * rb;
                for (int s = 0; s < 32 / BK_GU_SR; s++, n++) {
                    int b = n % nst;
                    bk_mb_wait(&empty[b], ((n / nst) & 1) ^ 1);
                    u8* dst = ring + (i64)b * sb_bytes;
                    i64 o = off + (i64)(s * BK_GU_SR) * rb;
                    bk_mb_expect(&full[b], sb_bytes);
                    bk_copy(dst, G + o, sb_bytes / 2, &full[b]);
                    bk_copy(dst + sb_bytes / 2, U + o, sb_bytes / 2, &full[b]);
                }
            }
        }
        return;
    }
    pdl_trigger();
    const int nu = ncol >> 5;
    u32 tb0, tb2;
    iq4_pin((u32)(rb >> 62) & threadIdx.x, tb0, tb2);
    int4 xa[GR_XU], xb[GR_XU];
    float xs[GR_XU];
    int t_x = -1, cur = -1, pl = 0, c = 0;
    int n = 0, buf = 0;
    const bool is_up = warp >= BK_GU_SR;
    for (int task = t0; task < t1; task++) {
        const int slot = task / nrg, rg = task % nrg;
        if (slot != cur) {
            BkSlot sl = bk_slot(grp, ids, E, slot, false);
            c = sl.c;
            pl = sl.pairs ? (lane < c ? sl.pairs[lane] : 0) : slot;
            cur = slot;
        }
        float* acc = (is_up ? su : sg) + buf * 32 * GG_MAXC;
        for (int s = 0; s < 32 / BK_GU_SR; s++, n++) {
            const int b = n % nst;
            bk_mb_wait(&full[b], (n / nst) & 1);
            const u8* row = ring + (i64)b * sb_bytes + (i64)warp * rb;
            const int rl = s * BK_GU_SR + (warp & (BK_GU_SR - 1));
            if (c == 1) {
                const int tok = __shfl_sync(0xffffffffu, pl, 0) / k;
                if (tok != t_x) {
                    gr_x_load(xq, xd, tok, ncol, lane, nu, xa, xb, xs);
#pragma unroll
                    for (int j = 0; j < GR_XU; j++) iq4_x_il(xa[j], xb[j]);
                    t_x = tok;
                }
                float a = 0.f;
#pragma unroll
                for (int j = 0; j < GR_XU; j++) {
                    int un = lane + 32 * j;
                    if (un < nu) {
                        uint2 h, qa, qb;
                        bk_unit(row, un, h, qa, qb);
                        a += xs[j] * iq4_unit_il(h, qa, qb, un & 7, xa[j], xb[j]);
                    }
                }
                a = warp_sum(a);
                if (lane == 0) acc[rl * GG_MAXC] = a;
            } else {
                u32 lo[GR_XU][4], hi[GR_XU][4];
                float sc[GR_XU];
#pragma unroll
                for (int j = 0; j < GR_XU; j++) {
                    int un = lane + 32 * j;
                    if (un < nu) {
                        uint2 h, qa, qb;
                        bk_unit(row, un, h, qa, qb);
                        sc[j] = iq4_decode_t<true>(h, qa, qb, un & 7, lo[j], hi[j], tb0, tb2);
                    }
                }
                for (int ci = 0; ci < c; ci++) {
                    const i64 xr = (i64)(__shfl_sync(0xffffffffu, pl, ci) / k) * ncol;
                    float a = 0.f;
#pragma unroll
                    for (int j = 0; j < GR_XU; j++) {
                        int un = lane + 32 * j;
                        if (un < nu) {
                            const int4* xp = (const int4*)(xq + xr + un * 32);
                            int4 va = xp[0], vb = xp[1];
                            a += xd[xr / 32 + un] * (sc[j] * (float)iq4_dot(lo[j], hi[j], va, vb));
                        }
                    }
                    a = warp_sum(a);
                    if (lane == 0) acc[rl * GG_MAXC + ci] = a;
                }
            }
            __syncwarp();
            if (lane == 0) bk_mb_arrive(&empty[b]);
        }
        bk_consumers_sync();
        const float* g = sg + buf * 32 * GG_MAXC;
        const float* u = su + buf * 32 * GG_MAXC;
        for (int ci = warp; ci < c; ci += BK_CW) {
            const int p = __shfl_sync(0xffffffffu, pl, ci);
            float v = silu_times(g[lane * GG_MAXC + ci], u[lane * GG_MAXC + ci]);
            int q = q8_lane(v, ad + (i64)p * (ld / 32) + rg);
            aq[(i64)p * ld + rg * 32 + lane] = (i8)q;
        }
        buf ^= 1;
    }
}

// -------------------------------------------------------------------- down -------------
// Two forms, one kernel:
// * grouped (grp given): task = (slot, BK_DG_SR-row group) of the slot's expert, one stage;
//   consumer warp w takes stage rows 2w and 2w + 1 as one list of 2 x ff / 32 units (3 per lane,
//   grpf's layout), decodes them once and writes dpart[p][r] = row r . act[p] for every pair p of
//   the slot (unweighted; moe_combine_grp adds them), bit-identical to moe_down_grpf.
// * combine (grp null): task = (token t, BK_DC_SR output rows), one stage holding those rows of
//   each of the token's k experts (k copies); warp w takes expert j = w / 2, rows 2 (w % 2) and
//   2 (w % 2) + 1 (k <= 8); then hidden[t][r] += sum_j wts[t k + j] * (row r of expert j .
//   act[t k + j]) in j order.
// The producer reads the slots / ids before the PDL wait and starts the ring at once: they were
// written by kernels that completed before the previous kernel (a gate/up kernel, which waits
// before it triggers) let this one start (moe_down_rx4's argument); it reads them through L2.
// The consumers wait before reading the activations.
// grid (min(SMs, tasks)), block BK_THREADS, dynamic shared memory BK_HDR + nst x stage bytes
// (grouped: BK_DG_SR rb; combine: BK_DC_SR k rb).
extern "C" __global__ void __launch_bounds__(BK_THREADS, 1)
    moe_down_blk_iq4_xs(const u8* W, i64 rb, i64 es, int rows, const int* grp, const int* ids, const float* wts, int E,
                        int k, int nt, int nst, const i8* aq, const float* ad, int ff, float* dpart, float* hidden,
                        i64 hs) {
    extern __shared__ __align__(128) u8 bk_sm[];
    u64* full = (u64*)bk_sm;
    u64* empty = full + BK_MAXST;
    float* sd = (float*)(bk_sm + 256);  // combine: [2][BK_DC_SR][8]
    u8* ring = bk_sm + BK_HDR;
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const bool grouped = grp != nullptr;
    const int sr = grouped ? BK_DG_SR : BK_DC_SR;
    const i64 sb_bytes = grouped ? (i64)BK_DG_SR * rb : (i64)BK_DC_SR * k * rb;
    if (threadIdx.x == 0) {
        for (int i = 0; i < nst; i++) {
            bk_mb_init(&full[i], 1);
            bk_mb_init(&empty[i], BK_CW);
        }
        bk_mb_fence_init();
    }
    __syncthreads();
    const int nrg = (rows + sr - 1) / sr;
    const int nslots = grouped ? __ldcg(grp) : nt;
    int t0, t1;
    bk_range(nslots * nrg, t0, t1);
    if (warp == BK_CW) {
        if (lane == 0) {
            int n = 0;
            for (int task = t0; task < t1; task++, n++) {
                const int r0 = (task % nrg) * sr, nr = min(sr, rows - r0);
                const int b = n % nst;
                bk_mb_wait(&empty[b], ((n / nst) & 1) ^ 1);
                u8* dst = ring + (i64)b * sb_bytes;
                if (grouped) {
                    BkSlot sl = bk_slot(grp, ids, E, task / nrg, true);
                    bk_mb_expect(&full[b], (u32)(nr * rb));
                    bk_copy(dst, W + (i64)sl.e * es + (i64)r0 * rb, (u32)(nr * rb), &full[b]);
                } else {
                    const int t = task / nrg;
                    bk_mb_expect(&full[b], (u32)(k * nr * rb));
                    for (int j = 0; j < k; j++) {
                        int e = __ldcg(ids + t * k + j);
                        bk_copy(dst + (i64)j * BK_DC_SR * rb, W + (i64)e * es + (i64)r0 * rb, (u32)(nr * rb), &full[b]);
                    }
                }
            }
        }
        return;
    }
    pdl_wait();
    pdl_trigger();
    const int upe = ff >> 5, nu = 2 * upe;
    u32 tb0, tb2;
    iq4_pin((u32)(rb >> 62) & threadIdx.x, tb0, tb2);
    int cur = -1, pl = 0, c = 0;
    int n = 0, buf = 0;
    // The warp's two rows inside a stage: grouped 2w, 2w + 1; combine 2 (w % 2) (+1) of expert w / 2.
    const int j_ex = warp >> 1;
    const int wr0 = grouped ? 2 * warp : 2 * (warp & 1);
    for (int task = t0; task < t1; task++, n++) {
        const int r0 = (task % nrg) * sr, nr = min(sr, rows - r0);
        const int b = n % nst;
        if (grouped) {
            const int slot = task / nrg;
            if (slot != cur) {
                BkSlot sl = bk_slot(grp, ids, E, slot, false);
                c = sl.c;
                pl = lane < c ? sl.pairs[lane] : 0;
                cur = slot;
            }
        } else {
            c = j_ex < k ? 1 : 0;
            pl = (task / nrg) * k + j_ex;
        }
        bk_mb_wait(&full[b], (n / nst) & 1);
        const u8* st = ring + (i64)b * sb_bytes + (grouped ? 0 : (i64)j_ex * BK_DC_SR * rb);
        float r_s0 = 0.f, r_s1 = 0.f;  // combine: this warp's two row sums
        if (c > 0 && wr0 < nr) {
            u32 lo[DG_U][4], hi[DG_U][4];
            float sc[DG_U];
            int uu[DG_U], rr[DG_U];
            bool ok[DG_U];
#pragma unroll
            for (int i = 0; i < DG_U; i++) {
                int un = lane + 32 * i;
                rr[i] = un >= upe;
                uu[i] = un - rr[i] * upe;
                ok[i] = un < nu && wr0 + rr[i] < nr;
                if (ok[i]) {
                    uint2 h, qa, qb;
                    bk_unit(st + (i64)(wr0 + rr[i]) * rb, uu[i], h, qa, qb);
                    sc[i] = iq4_decode_t<true>(h, qa, qb, uu[i] & 7, lo[i], hi[i], tb0, tb2);
                }
            }
            for (int ci = 0; ci < c; ci++) {
                const i64 p = __shfl_sync(0xffffffffu, pl, ci);
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
                if (grouped) {
                    if (lane == 0) {
                        dpart[p * rows + r0 + wr0] = s0;
                        if (wr0 + 1 < nr) dpart[p * rows + r0 + wr0 + 1] = s1;
                    }
                } else {
                    r_s0 = s0;
                    r_s1 = s1;
                }
            }
        }
        __syncwarp();
        if (lane == 0) bk_mb_arrive(&empty[b]);
        if (!grouped) {
            float* d = sd + buf * BK_DC_SR * 8;
            if (lane == 0 && j_ex < k) {
                d[wr0 * 8 + j_ex] = r_s0;
                d[(wr0 + 1) * 8 + j_ex] = r_s1;
            }
            bk_consumers_sync();
            if (warp == 0 && lane < nr) {
                const int t = task / nrg;
                float sum = 0.f;
                for (int j = 0; j < k; j++) sum += wts[t * k + j] * d[lane * 8 + j];
                hidden[(i64)t * hs + r0 + lane] += sum;
            }
            buf ^= 1;
        }
    }
}
