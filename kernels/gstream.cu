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
// 16-byte pieces: at most 2-way bank conflicts for the lanes' 8-byte loads). Lane l of every
// consumer warp owns stage rows l (and l + 32); warp w owns the units [w UPW, (w + 1) UPW) of
// every row. A weight unit is decoded once, by one lane, and dotted with each pair's activation
// unit, which all lanes read from the block's activation buffer by one shared-memory broadcast:
// no cross-lane reduction at all. The 16 warps' partial sums of each (row, pair) go through a
// hand-over slot to the epilogue warp, which adds them in warp order (deterministic; not grpf's
// order) and finishes the task: SiLU(g) u -> q8 of 32 rows (gate/up), dpart[p][r] (down;
// moe_combine_grp adds them as before).
//
// Work: task = (slot, chunk of <= GS_PC of its pairs, SR-row group), chunk-major within a slot
// (GsSeq), walked in contiguous ranges per block (one block per SM, block BK_THREADS: 16
// consumer warps, the producer, the epilogue warp), so a slot of many pairs spreads over blocks.
// When the chunk changes the consumers load its pairs' q8 rows into the activation buffer
// (interleaved for iq4_lookup_il). Gate/up: each task is two stages (gate, up) and two hand-over
// slots. Ring barriers as in stream.cu: full[i] (the producer's expect_tx + the copies' bytes),
// empty[i] (one arrival per consumer warp); hand-over hfull[h] (the consumer warps), hempty[h]
// (the epilogue warp). Waits sleep (bk_mb_sleep).
//
// PDL: everything waits for the previous kernel before reading grp or activations, except the
// down's producer with `early`: it reads grp and streams its weights without waiting (grp was
// written by moe_group, which completed before the gate/up kernel between them started: every
// gate/up kernel waits before it triggers; moe_down_rx4's argument); the consumers wait before
// they load activations.
//
// Limits (host: gstream.rs checks them): rows multiples of SR, inputs of 512 x UPW columns
// (UPW <= 6), rows and activation rows 16-byte aligned, at most GS_MAXE experts, sm_90 and newer.

#define GS_PC 4     // pairs per chunk (the activation buffer's rows)
#define GS_MAXU 6   // units per warp and row (96 units = 16 warps x 6): kernels for 1..6
#define GS_NH 2     // hand-over slots
#define GS_BAR0 256  // barrier bytes; then the slots' chunk prefix (GS_MAXE + 1 ints)
#define GS_MAXE 1024
#define GS_BAR 4608  // the hand-over slots follow, then the ring

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
// A block's stages in order, the same walk for all three roles. The step's work is a list of
// tasks (slot, chunk ch of cc <= GS_PC of its pairs, SR-row group rg), chunk-major within a slot,
// so that a slot of many pairs is spread over blocks like the rest (cpre[s] = chunks of the
// slots before s, in shared memory); a task is nsc stages s; n counts stages. The slot's entries
// are read from grp (L2) only when the slot changes, the chunk's pair ids (lane p < cc: pair p,
// for the roles that want them) only when the chunk changes.
struct GsSeq {
    const int* grp;
    const int* cpre;
    int E, nrg, nsc, t1;
    bool want_pairs;
    int task, slot, rg, ch, cc, s, n, pl, pslot, pch;
    GsSlot sl;
};
__device__ __forceinline__ void gs_load(GsSeq& q) {
    if (q.task >= q.t1) return;
    const int u = q.task / q.nrg;
    q.rg = q.task - u * q.nrg;
    while (q.cpre[q.slot + 1] <= u) q.slot++;
    if (q.slot != q.pslot) q.sl = gs_slot(q.grp, q.E, q.slot);
    q.ch = u - q.cpre[q.slot];
    q.cc = min(GS_PC, q.sl.c - q.ch * GS_PC);
    if (q.want_pairs && (q.slot != q.pslot || q.ch != q.pch)) {
        const int lane = threadIdx.x & 31;
        q.pl = lane < q.cc ? __ldcg(q.sl.pairs + q.ch * GS_PC + lane) : 0;
    }
    q.pslot = q.slot;
    q.pch = q.ch;
}
__device__ __forceinline__ GsSeq gs_seq(const int* grp, const int* cpre, int nslot, int E, int nrg, int nsc, int t0,
                                        int t1, bool want_pairs) {
    GsSeq q;
    q.grp = grp;
    q.cpre = cpre;
    q.E = E;
    q.nrg = nrg;
    q.nsc = nsc;
    q.t1 = t1;
    q.want_pairs = want_pairs;
    q.task = t0;
    q.s = q.n = 0;
    q.pl = 0;
    q.pslot = q.pch = -1;
    // The first task's slot: the last s with cpre[s] <= t0 / nrg (binary search).
    int lo = 0, hi = nslot;
    const int u = t0 / max(nrg, 1);
    while (hi - lo > 1) {
        const int mid = (lo + hi) >> 1;
        if (cpre[mid] <= u) lo = mid;
        else hi = mid;
    }
    q.slot = lo;
    gs_load(q);
    return q;
}
__device__ __forceinline__ bool gs_more(const GsSeq& q) { return q.task < q.t1; }
__device__ __forceinline__ void gs_step(GsSeq& q) {
    q.n++;
    if (++q.s < q.nsc) return;
    q.s = 0;
    q.task++;
    gs_load(q);
}

// Shared-memory pitch of a stage row of 512 UPW columns (272 UPW bytes): an odd number of
// 16-byte pieces (gstream.rs: pitch()).
#define GS_PITCH(upw) (((upw) & 1) ? 272 * (upw) : 272 * (upw) + 16)

// One stage of a consumer warp with CC pairs: acc[r][p] = sum over the warp's UPW units of row
// lane + 32 r of (scale x q8 scale x codebook dot). Everything but the warp's unit offsets is a
// compile-time constant here (no per-pair predicates or address arithmetic).
template <int RPL, int UPW, int CC>
__device__ __forceinline__ void gs_stage(const u8* wrow, const i8* xw, const float* xdw, const u32 (&oh)[UPW],
                                         const u32 (&oq)[UPW], int un0, u32 tl0, u32 tl1, u32 th0, u32 th1,
                                         u32 tl2, float (&acc)[RPL][GS_PC]) {
    constexpr int NU = 16 * UPW, NCOL = 512 * UPW, PITCH = GS_PITCH(UPW);
#pragma unroll
    for (int r = 0; r < RPL; r++)
#pragma unroll
        for (int p = 0; p < GS_PC; p++) acc[r][p] = 0.f;
#pragma unroll
    for (int r = 0; r < RPL; r++) {  // a row's loads first, then its units
        uint2 h[UPW], qa[UPW], qb[UPW];
#pragma unroll
        for (int u = 0; u < UPW; u++) {
            h[u] = *(const uint2*)(wrow + r * 32 * PITCH + oh[u]);
            qa[u] = *(const uint2*)(wrow + r * 32 * PITCH + oq[u]);
            qb[u] = *(const uint2*)(wrow + r * 32 * PITCH + oq[u] + 8);
        }
#pragma unroll
        for (int u = 0; u < UPW; u++) {
            const float sc = iq4_unit_scale(h[u], (un0 + u) & 7);
            if (CC == 1) {  // the sign-replicating decode: fewer ALU instructions, 2x the dp4a
                u32 a[8], c[8];
                iq4s_codes(qa[u], qb[u], a, c, tl0, tl1, th0, th1);
                const int4* xp = (const int4*)(xw + u * 32);
                acc[r][0] += xdw[u] * (sc * (float)iq4s_dot8(a, c, xp[0], xp[1]));
            } else {  // lookup and select (psx's iq4_lookup_il), one dp4a per 4 codes and pair
                u32 w[8];
                iq4_lookup_il(qa[u].x, w[0], w[1], tl0, tl2);
                iq4_lookup_il(qa[u].y, w[2], w[3], tl0, tl2);
                iq4_lookup_il(qb[u].x, w[4], w[5], tl0, tl2);
                iq4_lookup_il(qb[u].y, w[6], w[7], tl0, tl2);
#pragma unroll
                for (int p = 0; p < CC; p++) {
                    const int4* xp = (const int4*)(xw + p * NCOL + u * 32);
                    acc[r][p] += xdw[p * NU + u] * (sc * (float)iq4_dot2(w, xp[0], xp[1]));
                }
            }
        }
    }
}

// PROBE (the "gstp" kernels, timing only): the consumers skip the arithmetic (garbage outputs).
template <bool DOWN, bool PROBE, int UPW>
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
    const int nu = ncol >> 5;  // units a row
    i8* xbuf = (i8*)(bk_sm + GS_BAR + GS_NH * HB * 4);  // [GS_PC][ncol] q8, in iq4_x_il order
    float* xdbuf = (float*)(xbuf + GS_PC * ncol);        // [GS_PC][nu] their scales
    u8* ring = (u8*)(xdbuf + GS_PC * nu);
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const int pace = (nst >> 8) & 0xff;  // bk_pace_wait's, packed above the stages by the host
    nst &= 0xff;
    const i64 sbytes = (i64)SR * pitch;
    bk_init_n(full, empty, hfull, hempty, nst, GS_NH);  // the block barrier comes after the prefix
    // The chunk prefix of the slots, by warp 0 (after the PDL wait unless `early`).
    const bool early_k = DOWN && early;
    const bool pre = early_k && warp == BK_PW;  // the producer that starts before the wait
    if (!early_k) pdl_wait();
    int* cpre = (int*)(bk_sm + GS_BAR0);
    const int nslot = min(__ldcg(grp), E);
    if (warp == 0) {
        int run = 0;
        if (lane == 0) cpre[0] = 0;
        for (int b = 0; b < nslot; b += 32) {
            const int sl = b + lane;
            int v = sl < nslot ? (__ldcg(grp + 1 + 2 * E + sl) + GS_PC - 1) / GS_PC : 0;
#pragma unroll
            for (int o = 1; o < 32; o <<= 1) {
                const int t = __shfl_up_sync(0xffffffffu, v, o);
                if (lane >= o) v += t;
            }
            if (sl < nslot) cpre[sl + 1] = run + v;
            run += __shfl_sync(0xffffffffu, v, 31);
        }
    }
    __syncthreads();
    if (early_k && !pre) pdl_wait();
    if (!pre) pdl_trigger();
    const int nrg = wrows / SR;
    int t0, t1;
    bk_range(cpre[nslot] * nrg, t0, t1);
    if (warp == BK_PW) {
        // Stage n: lane 0 waits for it to be free and announces its bytes; the weights (a row a
        // lane, or lane 0 the whole range when unpadded). With `early`, before the PDL wait.
        for (GsSeq q = gs_seq(grp, cpre, nslot, E, nrg, NSC, t0, t1, false); gs_more(q); gs_step(q)) {
            const int b = q.n % nst;
            u8* dst = ring + b * sbytes;
            if (lane == 0) {
                bk_pace_wait(full, 1, 0, q.n, pace, nst);
                bk_mb_sleep(&empty[b], ((q.n / nst) & 1) ^ 1);
                bk_mb_expect(&full[b], (u32)(SR * rb));
            }
            __syncwarp();
            const u8* src = (q.s == 0 ? W0 : W1) + (i64)q.sl.e * es + (i64)q.rg * SR * rb;
            if (pitch == rb) {
                if (lane == 0) bk_copy(dst, src, (u32)(SR * rb), &full[b]);
            } else {
                for (int r = lane; r < SR; r += 32) bk_copy(dst + r * pitch, src + r * rb, (u32)rb, &full[b]);
            }
        }
        if (pre) pdl_trigger();
        return;
    }
    if (warp == BK_EW) {
        int m = 0;  // hand-over slots consumed
        for (GsSeq q = gs_seq(grp, cpre, nslot, E, nrg, NSC, t0, t1, true); gs_more(q); gs_step(q)) {
            if (q.s != NSC - 1) continue;  // a chunk ends with its last stage
            const int h0 = m % GS_NH, h1 = (m + NSC - 1) % GS_NH;
            bk_mb_sleep(&hfull[h0], (m / GS_NH) & 1);
            if (NSC == 2) bk_mb_sleep(&hfull[h1], ((m + 1) / GS_NH) & 1);
            const float* b0 = hbuf + h0 * HB;
            const float* b1 = hbuf + h1 * HB;
            for (int p = 0; p < q.cc; p++) {
                const i64 pr = __shfl_sync(0xffffffffu, q.pl, p);
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
    // Consumers: warp w takes units [w UPW, (w + 1) UPW) of every stage row (nu = 16 UPW). When
    // the chunk changes, the 16 warps (named barrier 1) load its pairs' q8 rows from global
    // memory into xbuf, interleaved as gs_unit's products want them (iq4_x_il). Per stage the
    // weight loads are issued first (plain loads from shared memory, so the compiler may
    // schedule them freely after the barrier wait), then each unit is decoded and dotted with
    // the chunk's pairs.
    u32 tl0, tl1, th0, th1, t2;
    iq4s_pin((u32)(rb >> 62) & threadIdx.x, tl0, tl1, th0, th1, t2);
    // The warp's units: un0 + u, header at oh[u] and codes at oq[u] of a row.
    const int un0 = warp * UPW;
    u32 oh[UPW], oq[UPW];
#pragma unroll
    for (int u = 0; u < UPW; u++) bk_unit_offsets(un0 + u, oh[u], oq[u]);
    int m = 0, x_slot = -1, x_ch = -1;
    for (GsSeq q = gs_seq(grp, cpre, nslot, E, nrg, NSC, t0, t1, false); gs_more(q); gs_step(q)) {
        const int b = q.n % nst, cc = q.cc;
        if (q.slot != x_slot || q.ch != x_ch) {
            asm volatile("bar.sync 1, %0;" ::"n"(32 * BK_CW) : "memory");  // done with the last chunk's x
            for (int i = threadIdx.x; i < cc * nu; i += 32 * BK_CW) {
                const int p = i / nu, un = i - p * nu;
                const int pr = __ldcg(q.sl.pairs + q.ch * GS_PC + p);
                const i64 row = DOWN ? pr : pr / k;
                const int4* src = (const int4*)(xq + row * ncol + un * 32);
                int4 xa = src[0], xb = src[1];
                iq4_x_il(xa, xb);
                int4* dst = (int4*)(xbuf + p * ncol + un * 32);
                dst[0] = xa;
                dst[1] = xb;
                xdbuf[p * nu + un] = xd[row * nu + un];
            }
            asm volatile("bar.sync 1, %0;" ::"n"(32 * BK_CW) : "memory");
            x_slot = q.slot;
            x_ch = q.ch;
        }
        bk_mb_sleep(&full[b], (q.n / nst) & 1);
        const u8* wrow = ring + b * sbytes + lane * GS_PITCH(UPW);
        float acc[RPL][GS_PC];
        if (PROBE) {
#pragma unroll
            for (int r = 0; r < RPL; r++)
#pragma unroll
                for (int p = 0; p < GS_PC; p++) acc[r][p] = 0.f;
            acc[0][0] = (float)((const int*)wrow)[warp];
        } else {
            const i8* xw = xbuf + warp * UPW * 32;
            const float* xdw = xdbuf + warp * UPW;
            switch (cc) {
                case 1: gs_stage<RPL, UPW, 1>(wrow, xw, xdw, oh, oq, un0, tl0, tl1, th0, th1, t2, acc); break;
                case 2: gs_stage<RPL, UPW, 2>(wrow, xw, xdw, oh, oq, un0, tl0, tl1, th0, th1, t2, acc); break;
                case 3: gs_stage<RPL, UPW, 3>(wrow, xw, xdw, oh, oq, un0, tl0, tl1, th0, th1, t2, acc); break;
                default: gs_stage<RPL, UPW, GS_PC>(wrow, xw, xdw, oh, oq, un0, tl0, tl1, th0, th1, t2, acc); break;
            }
        }
        __syncwarp();
        if (lane == 0) bk_mb_arrive(&empty[b]);
        const int hs = m % GS_NH;
        bk_mb_sleep(&hempty[hs], ((m / GS_NH) & 1) ^ 1);
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

#define GS_GU_ARGS                                                                                                \
    const u8 *G, const u8 *U, i64 rb, i64 es, const int *grp, int E, int k, int rows, int nst, int pitch, const i8 *xq, \
        const float *xd, int ncol, i8 *aq, float *ad, int ld
#define GS_DN_ARGS                                                                                                  \
    const u8 *W, i64 rb, i64 es, int rows, const int *grp, int E, int nst, int pitch, int early, const i8 *aq,     \
        const float *ad, int ncol, float *dpart
// Kernels per units a consumer warp takes of a row (UPW = columns / 512: 1536 -> 3, 3072 -> 6).
#define GS_INST(u)                                                                                                  \
    extern "C" __global__ void __launch_bounds__(BK_THREADS, 1) moe_gate_up_gst##u##_iq4_xs(GS_GU_ARGS) {           \
        gs_impl<false, false, u>(G, U, rb, es, rows, grp, E, k, nst, pitch, 0, xq, xd, ncol, aq, ad, ld, nullptr);   \
    }                                                                                                               \
    extern "C" __global__ void __launch_bounds__(BK_THREADS, 1) moe_gate_up_gstp##u##_iq4_xs(GS_GU_ARGS) {          \
        gs_impl<false, true, u>(G, U, rb, es, rows, grp, E, k, nst, pitch, 0, xq, xd, ncol, aq, ad, ld, nullptr);    \
    }                                                                                                               \
    extern "C" __global__ void __maxnreg__(104) moe_down_gst##u##_iq4_xs(GS_DN_ARGS) {              \
        gs_impl<true, false, u>(W, W, rb, es, rows, grp, E, 1, nst, pitch, early, aq, ad, ncol, nullptr, nullptr, 0, \
                                dpart);                                                                             \
    }                                                                                                               \
    extern "C" __global__ void __launch_bounds__(BK_THREADS, 1) moe_down_gstp##u##_iq4_xs(GS_DN_ARGS) {             \
        gs_impl<true, true, u>(W, W, rb, es, rows, grp, E, 1, nst, pitch, early, aq, ad, ncol, nullptr, nullptr, 0,  \
                               dpart);                                                                              \
    }
GS_INST(1)
GS_INST(2)
GS_INST(3)
GS_INST(4)
GS_INST(5)
GS_INST(6)
