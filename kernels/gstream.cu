// Grouped streamed IQ4_XS expert kernels (host: cuda::gstream, MINIMAX_GSTREAM): the MoE of
// decode steps of several tokens, grouped by expert (moe_group's slots), as moe_gate_up_grpf /
// moe_down_grpf do. Appended after stream.cu in the "fast" module: its mbarrier and bulk-copy
// helpers, fast.cu's IQ4 decode and q8.
//
// Why: at 32 tokens a slot holds ~1.6 pairs, so the grouped kernels are the batch-1 problem
// again (each weight decoded for one or two dot products), and grpf's warps, which spread a row
// over the lanes, load their weights and every pair's activations from L2 and reduce every
// (row, pair) across the warp: ~2.1 TB/s (gate/up) and ~1.7 TB/s (down) of the H200's 4.3.
//
// Rows on lanes. A stage holds SR weight rows of one expert (32 gate rows, or the same 32 up
// rows, or 64 down rows), copied by bulk copies (one per row, rows padded to an odd number of
// 16-byte pieces: at most 2-way bank conflicts for the lanes' 8-byte loads), and the q8
// activations of up to GS_PC of the slot's pairs. Lane l of every consumer warp owns stage
// rows l (and l + 32); warp w owns the units [w upw, (w + 1) upw) of every row. A weight unit is
// decoded once, by one lane, and dotted with each pair's activation unit, which all lanes read
// by one shared-memory broadcast: no cross-lane reduction at all. The 16 warps' partial sums
// of each (row, pair) go through a hand-over slot to the epilogue warp, which adds them in warp
// order (deterministic; not grpf's order) and finishes the task: SiLU(g) u -> q8 of 32 rows
// (gate/up), dpart[p][r] (down; moe_combine_grp adds them as before).
//
// Work: task = (slot, SR-row group), walked in contiguous ranges per block (one block per SM,
// block BK_THREADS: 16 consumer warps, the producer, the epilogue warp); a slot of more than
// GS_PC pairs runs its tasks once per chunk of GS_PC pairs (the weights again, from L2 then).
// Gate/up: each chunk is two stages (gate, up) and two hand-over slots. Ring barriers as in
// stream.cu: full[i] (the producer's expect_tx + the copies' bytes), empty[i] (one arrival per
// consumer warp); hand-over hfull[h] (the consumer warps), hempty[h] (the epilogue warp).
//
// PDL: everything waits for the previous kernel before reading grp or activations, except the
// down's producer with `early`: it reads grp and issues its first stages' weight copies before
// the wait (grp was written by moe_group, which completed before the gate/up kernel between
// them started: every gate/up kernel waits before it triggers; moe_down_rx4's argument), then
// waits before the activation copies.
//
// Limits (host: gstream.rs checks them): rows multiples of SR, inputs of at most 96 units and
// a multiple of 128 columns, rows and activation rows 16-byte aligned, sm_90 and newer.

#define GS_PC 4     // pairs per chunk (activations in every stage)
#define GS_MAXU 6   // units per warp and row (96 units = 16 warps x 6)
#define GS_NH 2     // hand-over slots
#define GS_BAR 256  // barrier bytes; the hand-over slots follow, then the ring

__device__ __forceinline__ int4 gs_lds4(u32 a) {
    int4 v;
    asm volatile("ld.shared.v4.s32 {%0, %1, %2, %3}, [%4];" : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "r"(a));
    return v;
}
__device__ __forceinline__ float gs_ldsf(u32 a) {
    float v;
    asm volatile("ld.shared.f32 %0, [%1];" : "=f"(v) : "r"(a));
    return v;
}

// The slot of a task: expert, pair count, its pair list.
struct GsSlot {
    int e, c;
    const int* pairs;
};
__device__ __forceinline__ GsSlot gs_slot(const int* grp, int E, int slot) {
    GsSlot s;
    s.e = __ldcg(grp + 1 + slot);
    s.c = __ldcg(grp + 1 + 2 * E + slot);
    s.pairs = grp + 1 + 3 * E + __ldcg(grp + 1 + E + slot);
    return s;
}
// A block's stages in order, the same walk for all three roles: task (slot, row group rg),
// chunk ch of cc <= GS_PC pairs, stage s < nsc of the chunk; n counts stages.
struct GsSeq {
    const int* grp;
    int E, nrg, nsc, t1;
    int task, rg, ch, cc, s, n;
    GsSlot sl;
};
__device__ __forceinline__ void gs_load(GsSeq& q) {
    if (q.task < q.t1) {
        q.sl = gs_slot(q.grp, q.E, q.task / q.nrg);
        q.rg = q.task % q.nrg;
        q.cc = min(GS_PC, q.sl.c);
    }
}
__device__ __forceinline__ GsSeq gs_seq(const int* grp, int E, int nrg, int nsc, int t0, int t1) {
    GsSeq q;
    q.grp = grp;
    q.E = E;
    q.nrg = nrg;
    q.nsc = nsc;
    q.t1 = t1;
    q.task = t0;
    q.ch = q.s = q.n = 0;
    gs_load(q);
    return q;
}
__device__ __forceinline__ bool gs_more(const GsSeq& q) { return q.task < q.t1; }
__device__ __forceinline__ void gs_step(GsSeq& q) {
    q.n++;
    if (++q.s < q.nsc) return;
    q.s = 0;
    if (++q.ch * GS_PC < q.sl.c) {
        q.cc = min(GS_PC, q.sl.c - q.ch * GS_PC);
        return;
    }
    q.ch = 0;
    q.task++;
    gs_load(q);
}

// DOWN = false: gate/up. W0 / W1 = gate / up, wrows = their rows (ff); x = the tokens' q8
// input xq [t][ncol], xd [t][ncol / 32]; out aq [p][ld], ad [p][ld / 32].
// DOWN = true: W0 = down (wrows output rows), x = the pairs' activations aq_in [p][ncol],
// ad_in [p][ncol / 32] (passed as xq / xd); out dpart [p][wrows].
// grid (SMs), block BK_THREADS, dynamic shared memory GS_BAR + GS_NH x 4 BK_CW GS_PC SR +
// nst x (GS_PC (ncol + ncol / 8) + SR pitch).
template <bool DOWN>
__device__ __forceinline__ void gs_impl(const u8* W0, const u8* W1, i64 rb, i64 es, int wrows, const int* grp, int E,
                                        int k, int nst, int pitch, int early, const i8* xq, const float* xd, int ncol,
                                        i8* aq, float* ad, int ld, float* dpart) {
    constexpr int RPL = DOWN ? 2 : 1;       // rows per lane
    constexpr int SR = 32 * RPL;            // rows per stage
    constexpr int NSC = DOWN ? 1 : 2;       // stages per chunk
    constexpr int HB = BK_CW * GS_PC * SR;  // floats per hand-over slot
    extern __shared__ __align__(128) u8 bk_sm[];
    u64* full = (u64*)bk_sm;
    u64* empty = full + BK_MAXST;
    u64* hfull = empty + BK_MAXST;
    u64* hempty = hfull + GS_NH;
    float* hbuf = (float*)(bk_sm + GS_BAR);
    u8* ring = bk_sm + GS_BAR + GS_NH * HB * 4;
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const int nu = ncol >> 5, xrow = ncol / 8;  // units a row; bytes of a row's q8 scales
    const int xbytes = GS_PC * (ncol + xrow);
    const i64 sbytes = xbytes + (i64)SR * pitch;
    if (threadIdx.x == 0) {
        for (int i = 0; i < nst; i++) {
            bk_mb_init(&full[i], 1);
            bk_mb_init(&empty[i], BK_CW);
        }
        for (int h = 0; h < GS_NH; h++) {
            bk_mb_init(&hfull[h], BK_CW);
            bk_mb_init(&hempty[h], 1);
        }
        bk_mb_fence_init();
    }
    __syncthreads();
    const bool pre = DOWN && early && warp == BK_PW;  // the producer that starts before the wait
    if (!pre) {
        pdl_wait();
        pdl_trigger();
    }
    const int nrg = wrows / SR;
    int t0, t1;
    bk_range(__ldcg(grp) * nrg, t0, t1);
    if (warp == BK_PW) {
        // Stage n: lane 0 waits for it to be free and announces its bytes; the weights (a row a
        // lane, or lane 0 the whole range when unpadded); the chunk's activation rows (lane
        // p < cc: pair p's q8 row and its scales).
        int npre = 0;
        for (int pass = pre ? 0 : 1; pass < 2; pass++) {
            for (GsSeq q = gs_seq(grp, E, nrg, NSC, t0, t1); gs_more(q) && (pass == 1 || q.n < nst); gs_step(q)) {
                const int b = q.n % nst;
                u8* dst = ring + b * sbytes;
                if (q.n >= npre || pass == 0) {
                    if (lane == 0) {
                        bk_mb_wait(&empty[b], ((q.n / nst) & 1) ^ 1);
                        bk_mb_expect(&full[b], (u32)(q.cc * (ncol + xrow) + SR * rb));
                    }
                    __syncwarp();
                    const u8* src = (q.s == 0 ? W0 : W1) + (i64)q.sl.e * es + (i64)q.rg * SR * rb;
                    if (pitch == rb) {
                        if (lane == 0) bk_copy(dst + xbytes, src, (u32)(SR * rb), &full[b]);
                    } else {
                        for (int r = lane; r < SR; r += 32) bk_copy(dst + xbytes + r * pitch, src + r * rb, (u32)rb, &full[b]);
                    }
                    if (pass == 0) npre = q.n + 1;
                }
                if (pass == 1 && lane < q.cc) {
                    const int p = __ldcg(q.sl.pairs + q.ch * GS_PC + lane);
                    const i64 row = DOWN ? p : p / k;
                    bk_copy(dst + lane * ncol, xq + row * ncol, (u32)ncol, &full[b]);
                    bk_copy(dst + GS_PC * ncol + lane * xrow, (const u8*)xd + row * xrow, (u32)xrow, &full[b]);
                }
            }
            if (pass == 0) {  // the first stages' weights are on their way: now the activations
                pdl_wait();
                pdl_trigger();
            }
        }
        return;
    }
    if (warp == BK_EW) {
        int m = 0;  // hand-over slots consumed
        for (GsSeq q = gs_seq(grp, E, nrg, NSC, t0, t1); gs_more(q); gs_step(q)) {
            if (q.s != NSC - 1) continue;  // a chunk ends with its last stage
            const int h0 = m % GS_NH, h1 = (m + NSC - 1) % GS_NH;
            bk_mb_wait(&hfull[h0], (m / GS_NH) & 1);
            if (NSC == 2) bk_mb_wait(&hfull[h1], ((m + 1) / GS_NH) & 1);
            const float* b0 = hbuf + h0 * HB;
            const float* b1 = hbuf + h1 * HB;
            const int pl = lane < q.cc ? __ldcg(q.sl.pairs + q.ch * GS_PC + lane) : 0;
            for (int p = 0; p < q.cc; p++) {
                const i64 pr = __shfl_sync(0xffffffffu, pl, p);
#pragma unroll
                for (int r = 0; r < RPL; r++) {
                    float g = 0.f, u = 0.f;
#pragma unroll
                    for (int w = 0; w < BK_CW; w++) {
                        g += b0[(w * GS_PC + p) * SR + r * 32 + lane];
                        if (!DOWN) u += b1[(w * GS_PC + p) * SR + r * 32 + lane];
                    }
                    if (DOWN) {
                        dpart[pr * wrows + q.rg * SR + r * 32 + lane] = g;
                    } else {
                        const int qv = q8_lane(silu_times(g, u), ad + pr * (ld / 32) + q.rg);
                        aq[pr * ld + q.rg * 32 + lane] = (i8)qv;
                    }
                }
            }
            __syncwarp();
            if (lane == 0) {
                bk_mb_arrive(&hempty[h0]);
                if (NSC == 2) bk_mb_arrive(&hempty[h1]);
            }
            m += NSC;
        }
        return;
    }
    // Consumers.
    const int upw = (nu + BK_CW - 1) / BK_CW;
    u32 tb0, tb2;
    iq4_pin((u32)(rb >> 62) & threadIdx.x, tb0, tb2);
    const u32 ring_s = smem_addr(ring);
    int m = 0;
    for (GsSeq q = gs_seq(grp, E, nrg, NSC, t0, t1); gs_more(q); gs_step(q)) {
        const int b = q.n % nst, cc = q.cc;
        bk_mb_wait(&full[b], (q.n / nst) & 1);
        const u32 st = ring_s + (u32)(b * sbytes);
        const u32 xs = st, xds = st + (u32)(GS_PC * ncol), ws = st + (u32)xbytes;
        float acc[RPL][GS_PC];
#pragma unroll
        for (int r = 0; r < RPL; r++) {
#pragma unroll
            for (int p = 0; p < GS_PC; p++) acc[r][p] = 0.f;
            const u32 row = ws + (u32)((lane + 32 * r) * pitch);
#pragma unroll
            for (int u = 0; u < GS_MAXU; u++) {
                const int un = warp * upw + u;
                if (u < upw && un < nu) {
                    const u32 oh = (u32)((un >> 3) * 136), oq = oh + 8 + 16 * (un & 7);
                    uint2 h, qa, qb;
                    bk_unit(row, oh, oq, h, qa, qb);
                    u32 lo[4], hi[4];
                    const float sc = iq4_decode_t<true>(h, qa, qb, un & 7, lo, hi, tb0, tb2);
#pragma unroll
                    for (int p = 0; p < GS_PC; p++) {
                        if (p < cc) {
                            const u32 xa_ = xs + (u32)(p * ncol + un * 32);
                            const int4 xa = gs_lds4(xa_), xb = gs_lds4(xa_ + 16);
                            const float xsc = gs_ldsf(xds + (u32)((p * nu + un) * 4));
                            acc[r][p] += xsc * (sc * (float)iq4_dot(lo, hi, xa, xb));
                        }
                    }
                }
            }
        }
        __syncwarp();
        if (lane == 0) bk_mb_arrive(&empty[b]);
        const int hs = m % GS_NH;
        bk_mb_wait(&hempty[hs], ((m / GS_NH) & 1) ^ 1);
        float* hb = hbuf + hs * HB;
#pragma unroll
        for (int r = 0; r < RPL; r++) {
#pragma unroll
            for (int p = 0; p < GS_PC; p++)
                if (p < cc) hb[(warp * GS_PC + p) * SR + r * 32 + lane] = acc[r][p];
        }
        __syncwarp();
        if (lane == 0) bk_mb_arrive(&hfull[hs]);
        m++;
    }
}

extern "C" __global__ void __launch_bounds__(BK_THREADS, 1)
    moe_gate_up_gst_iq4_xs(const u8* G, const u8* U, i64 rb, i64 es, const int* grp, int E, int k, int rows, int nst,
                           int pitch, const i8* xq, const float* xd, int ncol, i8* aq, float* ad, int ld) {
    gs_impl<false>(G, U, rb, es, rows, grp, E, k, nst, pitch, 0, xq, xd, ncol, aq, ad, ld, nullptr);
}
extern "C" __global__ void __launch_bounds__(BK_THREADS, 1)
    moe_down_gst_iq4_xs(const u8* W, i64 rb, i64 es, int rows, const int* grp, int E, int nst, int pitch, int early,
                        const i8* aq, const float* ad, int ncol, float* dpart) {
    gs_impl<true>(W, W, rb, es, rows, grp, E, 1, nst, pitch, early, aq, ad, ncol, nullptr, nullptr, 0, dpart);
}
