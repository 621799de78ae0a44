// Streamed IQ4_XS expert kernels for one pair per slot (host: cuda::stream,
// MINIMAX_STREAM): the batch-1 decode step's gate/up and down. Appended to fast.cu in the
// "fast" module: they reuse its IQ4 decode, q8 and PDL helpers.
//
// Why: the register-direct kernels (moe_gate_up_psx, moe_down_rx4) hold their weight loads in
// registers and reach ~1.9 / ~1.4 TB/s of the H200's 4.3. Here one producer warp per block
// streams the block's weight rows into a ring of shared-memory stages with bulk asynchronous
// copies (cp.async.bulk, completion counted on an mbarrier: one instruction per contiguous
// range, no registers held). Measured alone (the "probe" kernels, no arithmetic) the ring
// delivers 3.4 TB/s at the batch-1 gate/up's 40 MB and 4.1 TB/s at larger steps. 16 consumer
// warps decode from shared memory exactly as the register kernels do from registers (same units
// per lane, same integer sums, same f32 expressions in the same order: the gate/up is
// bit-identical to psx), several rows a warp per stage so that their reductions overlap; an
// epilogue warp does each task's last step (gate/up: SiLU and q8 of 32 rows; down: the k
// experts' weighted sum into the residual, in a fixed order, not rx4's) from sums the
// consumers hand over through a few buffers, so the consumers never wait for each other.
//
// Block: BK_CW consumer warps, the producer warp, the epilogue warp; grid = one block per SM
// (fewer with fewer tasks), each block a contiguous range of the step's tasks, walked in the
// same order by all three roles. Ring: full barriers (the producer's expect_tx + the copies'
// bytes; a stage's parts land on barriers of their own: the gate/up's 16-row parts, the
// down's experts, so a consumer warp starts when its part is in) and empty[i] (one arrival per
// consumer warp) mbarriers; hand-over buffers: afull[a] (one
// arrival per consumer warp) and aempty[a] (the epilogue warp); phase parity by round. Rows are
// whole 16-byte multiples (host: fast_mat) of at most 96 units per lane round (3 per lane):
// gate/up inputs of <= 3072 columns, down rows of <= 1536 columns, top-k <= 8.
//
// Tried and dropped (docs/CUDA.md): one row per consumer warp per stage with a consumer barrier
// per task and warp 0 doing the epilogue (24 us against psx's 21 per M2.7 gate/up); the grouped
// forms (several pairs per slot, activations read from global memory: 10x slower than grpf);
// the one-token dense Q8_0 products through the same ring (q/k/v 12.5 us against mvqs's 10.7);
// two gate/up blocks an SM (32 consumer warps, the input in shared memory: 22 us against 18).

#define BK_CW 16                    // consumer warps
#define BK_PW BK_CW                 // the producer warp
#define BK_EW (BK_CW + 1)           // the epilogue warp
#define BK_THREADS (32 * (BK_CW + 2))
#define BK_MAXST 8                  // most ring stages
#define BK_NAB 4                    // hand-over buffers (tasks between consumers and epilogue)
#define BK_HDR 2048                 // barriers (256 bytes), then the hand-over buffers
#define STREAM_MAXK 8               // most experts per token of the down (two consumer warps each)
#define BK_LOOKUP 0                 // consumers decode with psx's lookup-and-select (iq4_unit_il)
#define BK_SIGN 1                   // consumers decode with the sign-replicating prmt (iq4s_codes)
#define BK_PROBE 2                  // consumers skip the arithmetic (timing probes)

// The block's barriers, by thread 0 (the caller then needs a block barrier): ring full[i] (the
// producer's arrival + bytes) and empty[i] (the consumer warps), nab hand-over buffers afull[a]
// (the consumer warps) and aempty[a] (the epilogue warp).
__device__ __forceinline__ void bk_init_n(u64* full, u64* empty, u64* afull, u64* aempty, int nst, int nab) {
    if (threadIdx.x == 0) {
        for (int i = 0; i < nst; i++) {
            bk_mb_init(&full[i], 1);
            bk_mb_init(&empty[i], BK_CW);
        }
        for (int a = 0; a < nab; a++) {
            bk_mb_init(&afull[a], BK_CW);
            bk_mb_init(&aempty[a], 1);
        }
        bk_mb_fence_init();
    }
}
// n extra ring barriers (count 1: the producer's expect_tx + bytes), by thread 0, before
// bk_init's block barrier.
__device__ __forceinline__ void bk_init_extra(u64* b, int n) {
    if (threadIdx.x == 0)
        for (int i = 0; i < n; i++) bk_mb_init(&b[i], 1);
}
// bk_init_n with BK_NAB hand-over buffers, then the block barrier.
__device__ __forceinline__ void bk_init(u64* full, u64* empty, u64* afull, u64* aempty, int nst) {
    bk_init_n(full, empty, afull, aempty, nst, BK_NAB);
    __syncthreads();
}

// The block's task range [t0, t1) of `total`.
__device__ __forceinline__ void bk_range(int total, int& t0, int& t1) {
    t0 = (int)((i64)total * blockIdx.x / gridDim.x);
    t1 = (int)((i64)total * (blockIdx.x + 1) / gridDim.x);
}

// IQ4_XS codes by the sign-replicating prmt, no select step. A table prmt takes a nibble's low
// 3 bits as the byte index and its bit 3 as "replicate the byte's sign". With TL = codebook
// entries 0..7 (all negative) and TH = entries 8..15 plus 1 (all positive):
//   a = prmt(TL, nibbles)       = kv[n] for n < 8, 0xff (-1) for n >= 8;
//   c = prmt(TH, nibbles ^ 8)   = 0 for n < 8, kv[n] + 1 for n >= 8;
// so a + c = kv[n] for every n, and dp4a(a, x) + dp4a(c, x) is the codebook dot product, the
// same integer as the lookup-and-select decode (iq4_lookup_il: 6 prmt + 5 masks and shifts
// per 8 nibbles; here 4 prmt + 3 xor/shift, and twice the dp4a, on the other pipe). The bytes
// come in iq4_lookup_il's order, so the activations are interleaved likewise (iq4_x_il).
// TL is the codebook's first half as it stands (IQ4_T0, IQ4_T1); TH its second half with every
// byte plus one (no carries: the bytes are at most 113).
#define IQ4S_TH0 (IQ4_T2 + 0x01010101u)
#define IQ4S_TH1 (IQ4_T3 + 0x01010101u)
// The table words in registers ptxas cannot see through (z = 0 at run time, unknown to the
// compiler and per thread; as iq4_pin): TL / TH for iq4s_codes, and IQ4_T2 (t2), which
// iq4_lookup_il takes with tl0 (= IQ4_T0).
__device__ __forceinline__ void iq4s_pin(u32 z, u32& tl0, u32& tl1, u32& th0, u32& th1, u32& t2) {
    tl0 = IQ4_T0 ^ z;
    tl1 = IQ4_T1 ^ z;
    th0 = IQ4S_TH0 ^ z;
    th1 = IQ4S_TH1 ^ z;
    t2 = IQ4_T2 ^ z;
}
// A unit's 16 code bytes (qa, qb) -> a[j], c[j] (j = 2 i + half of code word i). (The high
// half-word as __umulhi(w, 0x10000), IMAD.HI on the FMA pipe instead of a shift on the ALU
// pipe: batch 16 / 32 +1 % in the grouped kernels, but batch 4 -1.5 % and batch 1 -1 %; not
// kept, session 27.)
__device__ __forceinline__ void iq4s_codes(uint2 qa, uint2 qb, u32 (&a)[8], u32 (&c)[8], u32 tl0, u32 tl1, u32 th0,
                                         u32 th1) {
    const u32 w[4] = {qa.x, qa.y, qb.x, qb.y};
#pragma unroll
    for (int i = 0; i < 4; i++) {
        const u32 wx = w[i] ^ 0x88888888u;
        a[2 * i] = iq4_prmt(tl0, tl1, w[i]);
        c[2 * i] = iq4_prmt(th0, th1, wx);
        a[2 * i + 1] = iq4_prmt(tl0, tl1, w[i] >> 16);
        c[2 * i + 1] = iq4_prmt(th0, th1, wx >> 16);
    }
}
// sum_j (a[j] + c[j]) . x[j] over the unit's interleaved activations (xa = words 0..3, xb = 4..7):
// one dp4a chain, no adds after it (integer sums, so any order gives the same bits; four chains
// and three adds measured the same at batch 1, 0.3 % slower at 32); the callers' several rows
// and units a thread are the chains' parallelism.
__device__ __forceinline__ int iq4s_dot8(const u32 (&a)[8], const u32 (&c)[8], int4 xa, int4 xb) {
    const int x[8] = {xa.x, xa.y, xa.z, xa.w, xb.x, xb.y, xb.z, xb.w};
    int s = 0;
#pragma unroll
    for (int j = 0; j < 8; j++) {
        s = __dp4a((int)a[j], x[j], s);
        s = __dp4a((int)c[j], x[j], s);
    }
    return s;
}

// Shared-memory unit loads through 32-bit shared addresses: a row's unit un has its header
// (d, scales) at row + oh and its 16 code bytes at row + oq (bk_unit_offsets: fixed per lane
// and unit round, computed once), so a unit costs two adds and three loads.
__device__ __forceinline__ void bk_unit_offsets(int un, u32& oh, u32& oq) {
    oh = (u32)((un >> 3) * 136);
    oq = oh + 8 + 16 * (un & 7);
}
__device__ __forceinline__ uint2 bk_lds2(u32 a) {
    uint2 v;
    asm volatile("ld.shared.v2.u32 {%0, %1}, [%2];" : "=r"(v.x), "=r"(v.y) : "r"(a));
    return v;
}
__device__ __forceinline__ void bk_unit(u32 row, u32 oh, u32 oq, uint2& h, uint2& qa, uint2& qb) {
    h = bk_lds2(row + oh);
    qa = bk_lds2(row + oq);
    qb = bk_lds2(row + oq + 8);
}

// ------------------------------------------------------------------ gate/up ------------
// Task = (pair p, 32-row group rg) of the gate and up matrices of expert ids[p]; a stage holds
// SR gate rows then SR up rows (32 / SR stages a task); consumer warp w takes stage rows w + 16 j
// (j < SR / 8; rows below SR are gate rows), each row its 3 units per lane dotted with the
// pair's token's q8 input (interleaved once in registers, iq4_unit_il: psx's arithmetic), the
// SR / 8 warp sums reduced together, one sum per row into the task's hand-over buffer; the
// epilogue warp computes act = silu(g) * u of the 32 rows -> q8 (aq [p][ld], ad [p][ld / 32]).
// DEC: how the consumers decode a unit: BK_SIGN (the "blk" kernels, the default) the
// sign-replicating iq4s_codes, BK_LOOKUP ("blkl", A/B runs) psx's iq4_unit_il; both give the same
// integer dot products, so the same bits. BK_PROBE (the "blkp" kernels, timing only): the
// consumers skip the arithmetic.
// grid (min(SMs, tasks)), block BK_THREADS, dynamic shared memory BK_HDR + nst x 2 SR rb.
// The gate/up's shared-memory header (BK_HDR bytes at h): ring empty[i] barriers, hand-over
// barriers afull / aempty, the hand-over sums sg / su ([BK_NAB][32] each), and fullq: stage
// rows [16 p, 16 p + 16) land on fullq[i][p], so that a consumer warp, whose rows are warp + 16
// j, starts on its row j as soon as those 16 rows are in (8-row stages: the one part is the
// whole stage).
// Both headers start with the ring's and the hand-over's barriers (256 bytes).
struct BkBars {
    u64 *full, *empty, *afull, *aempty;
};
__device__ __forceinline__ BkBars bk_bars(u8* h) {
    BkBars b;
    b.full = (u64*)h;
    b.empty = b.full + BK_MAXST;
    b.afull = b.empty + BK_MAXST;
    b.aempty = b.afull + BK_NAB;
    return b;
}
__device__ __forceinline__ void bk_bars_init(const BkBars& b, int nst) {
    bk_init_n(b.full, b.empty, b.afull, b.aempty, nst, BK_NAB);
}
struct BkGu : BkBars {
    u64* fullq;
    float *sg, *su;
    int* rids;  // moe_gate_up_blkr: the token's top-k (32 ids at most), then their weights
    float* rw;
};
__device__ __forceinline__ BkGu bk_gu_hdr(u8* h) {
    BkGu g;
    static_cast<BkBars&>(g) = bk_bars(h);
    g.sg = (float*)(h + 256);
    g.su = g.sg + BK_NAB * 32;
    g.fullq = (u64*)(g.su + BK_NAB * 32);  // [BK_MAXST][4], ends at 1536 bytes
    g.rids = (int*)(h + 1536);
    g.rw = (float*)(h + 1664);
    return g;
}
// The gate/up's barriers, by thread 0 (the caller then needs a block barrier).
__device__ __forceinline__ void bk_gu_init(const BkGu& g, int nst) {
    bk_init_extra(g.fullq, nst * 4);
    bk_bars_init(g, nst);
}
// Pacing (pace > 0, below nst): part p of stage n is issued only once part p of stage n - pace
// has landed (its barrier full[slot * stride + part]), so at most `pace` stages of a block are
// in flight. With every stage of every block in flight at once (pace 0) a block's first stage
// lands only when most of the second has: the memory system serves all of them together, so
// the consumers start late (docs/CUDA.md "Paced rings"). Also the grouped kernels' (gstream.cu).
__device__ __forceinline__ void bk_pace_wait(u64* full, int stride, int part, int n, int pace, int nst) {
    if (pace > 0 && pace < nst && n >= pace) {
        const int m = n - pace;
        bk_mb_wait(&full[(m % nst) * stride + part], (m / nst) & 1);
    }
}
// The gate/up's producer (lane 0 of the producer warp): the copies of tasks [t0, t1).
template <int SR>
__device__ __forceinline__ void gu_produce(const BkGu& g, u8* ring, const u8* G, const u8* U, i64 rb, i64 es,
                                          const int* ids, int nrg, int t0, int t1, int nst, int pace) {
    constexpr int NP = SR >= 16 ? SR / 8 : 1;  // parts a stage
    const i64 sb_bytes = 2 * SR * rb;
    int n = 0;
    // The next task's expert is read before this task's copies issue (their memory clobber
    // would otherwise hold the read, and its L2 round trip, behind them).
    int e_next = t0 < t1 ? ids[t0 / nrg] : 0;
    for (int task = t0; task < t1; task++) {
        const int e = e_next;
        if (task + 1 < t1) e_next = ids[(task + 1) / nrg];
        i64 off = (i64)e * es + (i64)((task % nrg) * 32) * rb;
        for (int s = 0; s < 32 / SR; s++, n++) {
            int b = n % nst;
            bk_mb_wait(&g.empty[b], ((n / nst) & 1) ^ 1);
            u8* dst = ring + b * sb_bytes;
            i64 o = off + (i64)(s * SR) * rb;
            if (SR >= 16) {
#pragma unroll
                for (int p = 0; p < NP; p++) {
                    u64* fb = &g.fullq[b * 4 + p];
                    const bool up = 16 * p >= SR;
                    bk_pace_wait(g.fullq, 4, p, n, pace, nst);
                    bk_mb_expect(fb, (u32)(16 * rb));
                    bk_copy(dst + 16 * p * rb, (up ? U : G) + o + (i64)(16 * p - (up ? SR : 0)) * rb, (u32)(16 * rb), fb);
                }
            } else {
                bk_pace_wait(g.fullq, 4, 0, n, pace, nst);
                bk_mb_expect(&g.fullq[b * 4], (u32)sb_bytes);
                bk_copy(dst, G + o, (u32)(SR * rb), &g.fullq[b * 4]);
                bk_copy(dst + SR * rb, U + o, (u32)(SR * rb), &g.fullq[b * 4]);
            }
        }
    }
}
// The gate/up's epilogue warp: SiLU x up of each task's 32 rows -> q8.
__device__ __forceinline__ void gu_epilogue(const BkGu& g, int nrg, int t0, int t1, i8* aq, float* ad, int ld, int lane) {
    for (int task = t0, it = 0; task < t1; task++, it++) {
        const int a = it % BK_NAB;
        bk_mb_wait(&g.afull[a], (it / BK_NAB) & 1);
        const int p = task / nrg, rg = task % nrg;
        float v = silu_times(g.sg[a * 32 + lane], g.su[a * 32 + lane]);
        int q = q8_lane(v, ad + (i64)p * (ld / 32) + rg);
        aq[(i64)p * ld + rg * 32 + lane] = (i8)q;
        __syncwarp();
        if (lane == 0) bk_mb_arrive(&g.aempty[a]);
    }
}
// A gate/up consumer warp: its rows of every stage of tasks [t0, t1). ROUTE: the input's q8
// scales are stored unscaled (router_f32n) and take the MoE norm's inv here, as
// router_topk_f32n's last block would have stored them (same product, same bits).
template <int SR, int DEC, bool ROUTE>
__device__ __forceinline__ void gu_consume(const BkGu& g, const u8* ring, i64 rb, int k, int nrg, int t0, int t1,
                                           int nst, const i8* xq, const float* xd, int ncol, float inv, int warp,
                                           int lane) {
    constexpr int RPW = SR / 8;  // rows per consumer warp and stage
    const i64 sb_bytes = 2 * SR * rb;
    const int nu = ncol >> 5;
    u32 tl0, tl1, th0, th1, tb2;  // codebook words in registers (same bits)
    iq4s_pin((u32)(rb >> 62) & threadIdx.x, tl0, tl1, th0, th1, tb2);
    int4 xa[GR_XU], xb[GR_XU];
    float xs[GR_XU];
    const int sb = lane & 7;  // the lane's sub-block in every unit round (32 u + lane)
    u32 oh[GR_XU], oq[GR_XU];
#pragma unroll
    for (int u = 0; u < GR_XU; u++) bk_unit_offsets(lane + 32 * u, oh[u], oq[u]);
    const u32 ring_s = smem_addr(ring);
    int t_x = -1, n = 0;
    for (int task = t0, it = 0; task < t1; task++, it++) {
        const int tok = (task / nrg) / k;
        if (tok != t_x) {
            gr_x_load(xq, xd, tok, ncol, lane, nu, xa, xb, xs);
#pragma unroll
            for (int j = 0; j < GR_XU; j++) {
                iq4_x_il(xa[j], xb[j]);
                if (ROUTE) xs[j] = __fmul_rn(xs[j], inv);
            }
            t_x = tok;
        }
        const int a = it % BK_NAB;
        bk_mb_wait(&g.aempty[a], ((it / BK_NAB) & 1) ^ 1);  // the epilogue is done with buffer a
        for (int s = 0; s < 32 / SR; s++, n++) {
            const int b = n % nst;
            const u32 st = ring_s + (u32)(b * sb_bytes);
            float acc[RPW];
            // Row j of the warp (stage row warp + 16 j: gate rows below SR) is in part j.
#pragma unroll
            for (int j = 0; j < RPW; j++) {
                const int q = warp + 16 * j;
                bk_mb_wait(&g.fullq[b * 4 + j], (n / nst) & 1);
                const u32 row = st + (u32)(q * rb);
                acc[j] = 0.f;
                if (DEC == BK_PROBE) {
                    acc[j] = (float)bk_lds2(row + 8 * lane).x;
                } else {
#pragma unroll
                    for (int u = 0; u < GR_XU; u++) {
                        if (lane + 32 * u < nu) {
                            uint2 h, qa, qb;
                            bk_unit(row, oh[u], oq[u], h, qa, qb);
                            if (DEC == BK_SIGN) {
                                u32 a[8], c[8];
                                iq4s_codes(qa, qb, a, c, tl0, tl1, th0, th1);
                                acc[j] += xs[u] * (iq4_unit_scale(h, sb) * (float)iq4s_dot8(a, c, xa[u], xb[u]));
                            } else {
                                acc[j] += xs[u] * iq4_unit_il(h, qa, qb, sb, xa[u], xb[u], tl0, tb2);
                            }
                        }
                    }
                }
            }
#pragma unroll
            for (int j = 0; j < RPW; j++) acc[j] = warp_sum(acc[j]);
            __syncwarp();
            if (lane == 0) {
                bk_mb_arrive(&g.empty[b]);
#pragma unroll
                for (int j = 0; j < RPW; j++) {
                    const int q = warp + 16 * j;  // stage row: gate rows [0, SR), up rows [SR, 2 SR)
                    (q < SR ? g.sg : g.su)[a * 32 + s * SR + (q % SR)] = acc[j];
                }
            }
        }
        __syncwarp();
        if (lane == 0) bk_mb_arrive(&g.afull[a]);
    }
}
// Inline routing of moe_gate_up_blkr (one token, after router_f32n): the raw logits lg (E of
// them), the MoE norm's group sums ss (ncol / 32), the selection bias, gating (2 sigmoid, 1
// softmax), eps; the top-k also goes to ids / w for the down (block 0 writes them).
struct GuRoute {
    const float *lg, *ss, *bias;
    int E, gating;
    float eps;
    int* ids;
    float* w;
};
// ROUTE (moe_gate_up_blkr, one token): after the wait every warp takes the MoE norm's inv from
// the router's group sums (router_norm_inv: the order of router_topk_f32n's last block) and the
// producer warp runs route_topk_warp on the raw logits times inv into the header: the ids,
// weights and q8 scales the router's last block would have made, bit for bit, without its
// arrival, scale stores and top-k in the chain. Block 0 also stores ids / w for the down, and
// no block lets the down launch before that: the down reads ids before its own wait.
template <int SR, int DEC, bool ROUTE>
__device__ __forceinline__ void gate_up_blk(const u8* G, const u8* U, i64 rb, i64 es, const int* ids, int k, int npairs,
                                            int grows, int nst, const i8* xq, const float* xd, int ncol, i8* aq,
                                            float* ad, int ld, GuRoute rt) {
    static_assert(SR == 8 || SR == 16 || SR == 32, "stage rows");
    extern __shared__ __align__(128) u8 bk_sm[];
    // The host packs the pacing (bk_pace_wait, bits 8..15) and the late trigger (bit 16: the
    // next kernel may launch once every block's producer has issued its last copy, not at the
    // start, so that a down block beside this one starts its ring while this one computes).
    const int pace = (nst >> 8) & 0xff, late = (nst >> 16) & 1;
    nst &= 0xff;
    const BkGu g = bk_gu_hdr(bk_sm);
    u8* ring = bk_sm + BK_HDR;
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    bk_gu_init(g, nst);
    __syncthreads();
    pdl_wait();  // ids come from the router, the input from norm_q8 of this step
    float inv = 1.f;
    if (ROUTE) {
        if (warp == BK_PW) {
            // The logits' loads first: their L2 round trip overlaps the norm sums'.
            float sc[RK_MAXE], ch[RK_MAXE];
            route_topk_load(rt.lg, rt.bias, rt.E, lane, sc, ch);
            inv = router_norm_inv(rt.ss, ncol >> 5, ncol, rt.eps, lane);
            route_topk_select(sc, ch, rt.E, k, rt.gating, g.rids, g.rw, lane, inv);
            __syncwarp();
            if (blockIdx.x == 0) {
                if (lane < k) {
                    rt.ids[lane] = g.rids[lane];
                    rt.w[lane] = g.rw[lane];
                }
                __threadfence();
            }
        } else {
            inv = router_norm_inv(rt.ss, ncol >> 5, ncol, rt.eps, lane);
        }
        __syncthreads();
        ids = g.rids;
    }
    if (!late) pdl_trigger();
    const int nrg = grows >> 5;
    int t0, t1;
    bk_range(npairs * nrg, t0, t1);
    if (warp == BK_PW) {
        if (lane == 0) {
            gu_produce<SR>(g, ring, G, U, rb, es, ids, nrg, t0, t1, nst, pace);
            if (late) pdl_trigger();  // one thread's trigger is the block's
        }
    } else if (warp == BK_EW) {
        gu_epilogue(g, nrg, t0, t1, aq, ad, ld, lane);
    } else {
        gu_consume<SR, DEC, ROUTE>(g, ring, rb, k, nrg, t0, t1, nst, xq, xd, ncol, inv, warp, lane);
    }
}
#define BK_GU_ARGS                                                                                               \
    const u8 *G, const u8 *U, i64 rb, i64 es, const int *ids, int k, int npairs, int grows, int nst, const i8 *xq, \
        const float *xd, int ncol, i8 *aq, float *ad, int ld
#define BK_GU_ONE(name, sr, dec)                                                                                 \
    extern "C" __global__ void __launch_bounds__(BK_THREADS, 1) moe_gate_up_##name##sr##_iq4_xs(BK_GU_ARGS) {     \
        gate_up_blk<sr, dec, false>(G, U, rb, es, ids, k, npairs, grows, nst, xq, xd, ncol, aq, ad, ld, GuRoute{});  \
    }
// moe_gate_up_blkr: the sign decode, routing inline (ids: where the top-k goes, with w).
#define BK_GU_ROUTED(sr)                                                                                         \
    extern "C" __global__ void __launch_bounds__(BK_THREADS, 1) moe_gate_up_blkr##sr##_iq4_xs(                    \
        BK_GU_ARGS, const float* lg, const float* ss, const float* bias, int E, int gating, float eps, float* w) {   \
        gate_up_blk<sr, BK_SIGN, true>(G, U, rb, es, ids, k, npairs, grows, nst, xq, xd, ncol, aq, ad, ld,          \
                                       GuRoute{lg, ss, bias, E, gating, eps, (int*)ids, w});                     \
    }
#define BK_GU_INST(sr) \
    BK_GU_ONE(blk, sr, BK_SIGN) BK_GU_ONE(blkl, sr, BK_LOOKUP) BK_GU_ONE(blkp, sr, BK_PROBE) BK_GU_ROUTED(sr)
BK_GU_INST(8)
BK_GU_INST(16)
BK_GU_INST(32)

// -------------------------------------------------------------------- down -------------
// Combining down: task = (token t, RS output rows); its one stage holds those rows of each of
// the token's k experts (k copies). Consumer warp w takes expert j = w / 2 (k <= 8) and rows
// (w % 2) RS / 2 .. + RS / 2 of it, as RS / 4 row pairs, each pair one list of 2 ff / 32 units
// (3 per lane, grpf's layout) dotted with act[t k + j] (the lane's activation units are the same
// for every pair: loaded once per task); sums into the hand-over buffer d[row][j]; the epilogue
// warp adds hidden[t][r] += sum_j wts[t k + j] d[r][j] (j in order). The producer reads ids
// before the PDL wait and starts the ring at once: they were written by the router, which
// completed before the previous kernel (a gate/up kernel: it waits before it triggers) let this
// one start (moe_down_rx4's argument), or by block 0 of moe_gate_up_blkr, whose blocks trigger
// only after it stored and fenced them; it reads them through L2. The consumers and the epilogue
// wait before reading the activations and routing weights. DEC as in gate_up_blk (BK_LOOKUP:
// iq4_decode_t + iq4_dot on the activations as stored; BK_SIGN: iq4s_codes on them interleaved
// by iq4_x_il; the same integers).
// With nw (the next RMSNorm's weight; null: none) the block that finishes last also runs
// norm_q8 on the new residual rows (n = rows, eps) into nq / nd, bit for bit (norm_virtual, 16
// consumer warps), so the next layer's q/k/v product follows the down directly: every block's
// epilogue warp fences its rows and counts the block in *ncnt (zero before, left zero); the
// consumers join it on named barrier 1. trig_late: the blocks let the next kernel launch after
// their loops instead of at the start (the q/k/v's weight copies then overlap the norm, not the
// down's own stream).
// grid (min(SMs, tasks)), block BK_THREADS, dynamic shared memory BK_HDR + nst x RS k rb.
#define DN_NORM_MAXI 4              // the fused norm's rows: <= 4096
// The down's shared-memory header (BK_HDR bytes at h): ring empty[i], hand-over afull / aempty,
// the hand-over sums dsum ([BK_NAB][RS][8]), fullx (expert j's rows of stage i land on
// fullx[i * STREAM_MAXK + j], so each consumer warp waits for its own expert's rows only, the
// first of them a stage's first copy), the fused norm's 32 warp sums and the last-block flag.
struct BkDn : BkBars {
    u64* fullx;
    float *dsum, *npart;
    int* nlast;
};
template <int RS>
__device__ __forceinline__ BkDn bk_dn_hdr(u8* h) {
    BkDn d;
    static_cast<BkBars&>(d) = bk_bars(h);
    d.dsum = (float*)(h + 256);
    d.fullx = (u64*)(d.dsum + BK_NAB * RS * 8);  // [BK_MAXST][STREAM_MAXK], ends at 1792 bytes
    d.npart = (float*)(h + 1856);
    d.nlast = (int*)(h + 1984);
    return d;
}
template <int RS>
__device__ __forceinline__ void bk_dn_init(const BkDn& d, int nst) {
    bk_init_extra(d.fullx, nst * STREAM_MAXK);
    bk_bars_init(d, nst);
}
// The down's producer (lane 0 of the producer warp): the copies of tasks [t0, t1).
template <int RS>
__device__ __forceinline__ void dn_produce(const BkDn& d, u8* ring, const u8* W, i64 rb, i64 es, int rows,
                                           const int* ids, int k, int nrg, int t0, int t1, int nst, int pace) {
    const i64 sb_bytes = (i64)RS * k * rb;
    // The token's expert offsets, read once per token and all at once: read inside the copy
    // loop, each id waited for an L2 round trip before its copy could issue (the copies' memory
    // clobber keeps later loads behind them), 8 in a row per task.
    i64 eo[STREAM_MAXK];
    int t_ids = -1;
    for (int task = t0, n = 0; task < t1; task++, n++) {
        const int t = task / nrg, r0 = (task % nrg) * RS, nr = min(RS, rows - r0);
        if (t != t_ids) {
#pragma unroll
            for (int j = 0; j < STREAM_MAXK; j++) eo[j] = j < k ? (i64)__ldcg(ids + t * k + j) * es : 0;
            t_ids = t;
        }
        const int b = n % nst;
        bk_mb_wait(&d.empty[b], ((n / nst) & 1) ^ 1);
        u8* dst = ring + b * sb_bytes;
#pragma unroll
        for (int j = 0; j < STREAM_MAXK; j++)
            if (j < k) {
                u64* fb = &d.fullx[b * STREAM_MAXK + j];
                bk_pace_wait(d.fullx, STREAM_MAXK, j, n, pace, nst);
                bk_mb_expect(fb, (u32)(nr * rb));
                bk_copy(dst + (i64)j * RS * rb, W + eo[j] + (i64)r0 * rb, (u32)(nr * rb), fb);
            }
    }
}
// The next RMSNorm's input in groups of 8 rows, with no meeting of the blocks (the down's x8
// mode, RS == 8: a task's rows are one group): lanes 0..7 hold the task's new residual values
// hn (the other lanes 0); u = hn nw as q8 with one scale a group (nd[g] = max |u| / 127) and
// the group's sum of squares nss[g] = sum hn^2 (the lanes' squares added by xor 4, 2, 1). The
// norm's 1 / rms is left to the reader (mvqs_q8_0_1s2p8 sums the nss in its own fixed order),
// so no block waits for another. Called by the whole epilogue warp.
__device__ __forceinline__ void dn_x8(float hn, const float* nw, int t, int r0, int rows, i8* nq, float* nd,
                                      float* nss, int lane) {
    const float u = lane < 8 ? __fmul_rn(hn, nw[r0 + lane]) : 0.f;
    float am = fabsf(u), sq = __fmul_rn(hn, hn);
#pragma unroll
    for (int o = 4; o > 0; o >>= 1) {
        am = fmaxf(am, __shfl_xor_sync(0xffffffffu, am, o));
        sq = __fadd_rn(sq, __shfl_xor_sync(0xffffffffu, sq, o));
    }
    const float dq = am / 127.0f;
    const int q = am == 0.0f ? 0 : __float2int_rn(u / dq);
    if (lane < 8) nq[(i64)t * rows + r0 + lane] = (i8)q;
    if (lane == 0) {
        nd[(i64)t * (rows >> 3) + (r0 >> 3)] = dq;
        nss[(i64)t * (rows >> 3) + (r0 >> 3)] = sq;
    }
}
// The down's epilogue warp: hidden[t][r] += sum_j wts[t k + j] d[r][j] (j in order); with the
// fused norm (nw), the block's arrival on ncnt and the meeting with the consumers (named barrier 1);
// with nss (x8 mode) each task's group by dn_x8 instead.
template <int RS>
__device__ __forceinline__ void dn_epilogue(const BkDn& d, int rows, const float* wts, int k, int nrg, int t0, int t1,
                                            float* hidden, i64 hs, const float* nw, u32* ncnt, i8* nq, float* nd,
                                            float* nss, int lane) {
    for (int task = t0, it = 0; task < t1; task++, it++) {
        const int a = it % BK_NAB;
        bk_mb_wait(&d.afull[a], (it / BK_NAB) & 1);
        const int t = task / nrg, r0 = (task % nrg) * RS, nr = min(RS, rows - r0);
        float hn = 0.f;
        if (lane < nr) {
            float sum = 0.f;
            for (int j = 0; j < k; j++) sum += wts[t * k + j] * d.dsum[(a * RS + lane) * 8 + j];
            hn = hidden[(i64)t * hs + r0 + lane] + sum;
            hidden[(i64)t * hs + r0 + lane] = hn;
        }
        __syncwarp();
        if (lane == 0) bk_mb_arrive(&d.aempty[a]);
        if (RS == 8 && nss) dn_x8(hn, nw, t, r0, rows, nq, nd, nss, lane);
    }
    pdl_trigger();
    if (nw && !nss) {
        __threadfence();
        __syncwarp();
        if (lane == 0) *d.nlast = atomicAdd(ncnt, 1u) == gridDim.x - 1;
        asm volatile("bar.sync 1, %0;" ::"r"(32 * (BK_CW + 1)) : "memory");
    }
}
// A down consumer warp: expert j = warp / 2 of every task's stage, its rows half.
template <int RS, int DEC>
__device__ __forceinline__ void dn_consume(const BkDn& d, const u8* ring, i64 rb, int rows, int k, int nrg, int t0,
                                           int t1, int nst, const i8* aq, const float* ad, int ff, int warp, int lane) {
    constexpr int NPR = RS / 4;  // row pairs per consumer warp
    const i64 sb_bytes = (i64)RS * k * rb;
    const int upe = ff >> 5, nu = 2 * upe;
    u32 tl0, tl1, th0, th1, tb2;
    iq4s_pin((u32)(rb >> 62) & threadIdx.x, tl0, tl1, th0, th1, tb2);
    const int j_ex = warp >> 1, half = warp & 1;
    // The lane's units of a row pair (the same for every pair): row rr[i] of the pair, unit uu[i].
    int uu[DG_U], rr[DG_U];
    u32 oh[DG_U], oq[DG_U];
#pragma unroll
    for (int i = 0; i < DG_U; i++) {
        int un = lane + 32 * i;
        rr[i] = un >= upe;
        uu[i] = un - rr[i] * upe;
        bk_unit_offsets(uu[i], oh[i], oq[i]);
        oh[i] += (u32)(rr[i] * rb);  // the pair's second row
        oq[i] += (u32)(rr[i] * rb);
    }
    const u32 ring_s = smem_addr(ring);
    int4 xa[DG_U], xb[DG_U];
    float xs[DG_U];
    int p_x = -1;
    for (int task = t0, it = 0; task < t1; task++, it++) {
        const int t = task / nrg, r0 = (task % nrg) * RS, nr = min(RS, rows - r0);
        const int b = it % nst, a = it % BK_NAB;
        const bool active = j_ex < k;
        const int p = t * k + j_ex;
        if (active && p != p_x) {
#pragma unroll
            for (int i = 0; i < DG_U; i++) {
                xs[i] = 0.f;
                if (lane + 32 * i < nu) {
                    const int4* xp = (const int4*)(aq + (i64)p * ff + uu[i] * 32);
                    xa[i] = xp[0];
                    xb[i] = xp[1];
                    if (DEC == BK_SIGN) iq4_x_il(xa[i], xb[i]);
                    xs[i] = ad[(i64)p * upe + uu[i]];
                }
            }
            p_x = p;
        }
        bk_mb_wait(&d.aempty[a], ((it / BK_NAB) & 1) ^ 1);
        // Warps without an expert (k < 8) wait for expert 0's rows: every warp must see the
        // stage's round before it arrives on empty[b], or an idle warp could arrive twice in one
        // phase.
        bk_mb_wait(&d.fullx[b * STREAM_MAXK + (active ? j_ex : 0)], (it / nst) & 1);
        float s[NPR][2];
#pragma unroll
        for (int q = 0; q < NPR; q++) {
            const int w0 = half * (RS / 2) + 2 * q;  // the pair's first row in the stage
            s[q][0] = s[q][1] = 0.f;
            if (DEC == BK_PROBE) {
                s[q][0] = (float)bk_lds2(ring_s + (u32)(b * sb_bytes) + 8 * lane).x;
            } else if (active && w0 < nr) {
                const u32 st = ring_s + (u32)(b * sb_bytes + ((i64)j_ex * RS + w0) * rb);
#pragma unroll
                for (int i = 0; i < DG_U; i++) {
                    if (lane + 32 * i < nu && w0 + rr[i] < nr) {
                        uint2 h, qa, qb;
                        bk_unit(st, oh[i], oq[i], h, qa, qb);
                        float v;
                        if (DEC == BK_SIGN) {
                            u32 a[8], c[8];
                            iq4s_codes(qa, qb, a, c, tl0, tl1, th0, th1);
                            v = xs[i] * (iq4_unit_scale(h, uu[i] & 7) * (float)iq4s_dot8(a, c, xa[i], xb[i]));
                        } else {
                            u32 lo[4], hi[4];
                            float sc = iq4_decode_t<true>(h, qa, qb, uu[i] & 7, lo, hi, tl0, tb2);
                            v = xs[i] * (sc * (float)iq4_dot(lo, hi, xa[i], xb[i]));
                        }
                        if (rr[i]) s[q][1] += v;
                        else s[q][0] += v;
                    }
                }
            }
        }
#pragma unroll
        for (int q = 0; q < NPR; q++) {
            s[q][0] = warp_sum(s[q][0]);
            s[q][1] = warp_sum(s[q][1]);
        }
        __syncwarp();
        if (lane == 0) {
            bk_mb_arrive(&d.empty[b]);
            if (active) {
#pragma unroll
                for (int q = 0; q < NPR; q++) {
                    const int w0 = half * (RS / 2) + 2 * q;
                    d.dsum[(a * RS + w0) * 8 + j_ex] = s[q][0];
                    d.dsum[(a * RS + w0 + 1) * 8 + j_ex] = s[q][1];
                }
            }
            bk_mb_arrive(&d.afull[a]);
        }
    }
}
// The consumers' tail with the fused norm: meet the epilogue on named barrier 1; in the block
// that counted last, norm_q8 of each token's new residual row by the 16 consumer warps.
__device__ __forceinline__ void dn_norm_tail(const BkDn& d, int rows, int nt, float* hidden, i64 hs, const float* nw,
                                             float eps, i8* nq, float* nd, u32* ncnt, int warp, int lane) {
    asm volatile("bar.sync 1, %0;" ::"r"(32 * (BK_CW + 1)) : "memory");
    if (!*d.nlast) return;
    __threadfence();
    for (int t = 0; t < nt; t++) {
        float xv[2][DN_NORM_MAXI], wv[2][DN_NORM_MAXI];
        const float inv =
            norm_virtual<BK_CW, DN_NORM_MAXI, 2>(hidden + (i64)t * hs, nw, rows, eps, xv, wv, d.npart, warp, lane);
#pragma unroll
        for (int m = 0; m < 2; m++)
#pragma unroll
            for (int i = 0; i < DN_NORM_MAXI; i++) {
                const int idx = ((warp + BK_CW * m) << 5) + lane + 1024 * i;
                if (idx < rows) {  // warp-uniform: rows % 32 == 0
                    const float v = __fmul_rn(__fmul_rn(xv[m][i], inv), wv[m][i]);
                    nq[(i64)t * rows + idx] = (i8)q8_lane(v, nd + (i64)t * (rows >> 5) + (idx >> 5));
                }
            }
        nv_bar<2, BK_CW>();  // npart is read by every warp before the next token writes it
    }
    if (threadIdx.x == 0) *ncnt = 0;
}
template <int RS, int DEC>
__device__ __forceinline__ void down_blk(const u8* W, i64 rb, i64 es, int rows, const int* ids, const float* wts, int k,
                                         int nt, int nst, const i8* aq, const float* ad, int ff, float* hidden, i64 hs,
                                         const float* nw, float eps, i8* nq, float* nd, u32* ncnt, int trig_late,
                                         float* nss) {
    static_assert(RS == 4 || RS == 8, "stage rows");
    extern __shared__ __align__(128) u8 bk_sm[];
    const int pace = (nst >> 8) & 0xff;  // as gate_up_blk's (the down has no late trigger)
    nst &= 0xff;
    const BkDn d = bk_dn_hdr<RS>(bk_sm);
    u8* ring = bk_sm + BK_HDR;
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    bk_dn_init<RS>(d, nst);
    __syncthreads();
    const int nrg = (rows + RS - 1) / RS;
    int t0, t1;
    bk_range(nt * nrg, t0, t1);
    if (warp == BK_PW) {
        if (lane == 0) dn_produce<RS>(d, ring, W, rb, es, rows, ids, k, nrg, t0, t1, nst, pace);
        return;
    }
    pdl_wait();
    if (!trig_late) pdl_trigger();
    if (warp == BK_EW) {
        dn_epilogue<RS>(d, rows, wts, k, nrg, t0, t1, hidden, hs, nw, ncnt, nq, nd, nss, lane);
        return;
    }
    dn_consume<RS, DEC>(d, ring, rb, rows, k, nrg, t0, t1, nst, aq, ad, ff, warp, lane);
    pdl_trigger();
    if (nw && !nss) dn_norm_tail(d, rows, nt, hidden, hs, nw, eps, nq, nd, ncnt, warp, lane);
}
// nss non-null (with nw, RS 8): the x8 mode (dn_x8) instead of the last block's norm_q8; nd
// then holds rows / 8 scales a token and ncnt is not touched.
#define BK_DN_ARGS                                                                                                \
    const u8 *W, i64 rb, i64 es, int rows, const int *ids, const float *wts, int k, int nt, int nst, const i8 *aq, \
        const float *ad, int ff, float *hidden, i64 hs, const float *nw, float eps, i8 *nq, float *nd, u32 *ncnt,  \
        int trig_late, float *nss
#define BK_DN_ONE(name, rs, dec)                                                                                 \
    extern "C" __global__ void __launch_bounds__(BK_THREADS, 1) moe_down_##name##rs##_iq4_xs(BK_DN_ARGS) {         \
        down_blk<rs, dec>(W, rb, es, rows, ids, wts, k, nt, nst, aq, ad, ff, hidden, hs, nw, eps, nq, nd, ncnt,     \
                          trig_late, nss);                                                                       \
    }
#define BK_DN_INST(rs) BK_DN_ONE(blk, rs, BK_SIGN) BK_DN_ONE(blkl, rs, BK_LOOKUP) BK_DN_ONE(blkp, rs, BK_PROBE)
BK_DN_INST(4)
BK_DN_INST(8)

