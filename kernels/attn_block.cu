// ---------------------------------------------- one-token attention block, persistent ------
// ablk_*: everything of a decoder layer between the attention norm and the experts, for a
// step of one token, in one launch of one block per SM (grid = SM count, all resident):
//   1. q/k/v products (Q8_0, mvqs_dot per row): every block's rows are copied to shared memory
//      before the wait for the previous kernel, so the weights stream while it drains;
//   2. full-width q/k RMSNorm, partial NeoX RoPE, the new K/V into the cache, split-K decode
//      attention (attn_dec_part, 4 groups of 4 warps a block) and the merge by the last split
//      of each KV head (attn_merge_core);
//   3. o-projection added into the residual: its rows were copied into shared memory (bulk
//      copies) while step 2 ran;
//   4. the MoE RMSNorm (q8 for the experts) and the router with its top-k in the last block
//      (its f32 rows were asked of L2 while step 2 ran).
// Steps meet at grid barriers (a counter in global memory; ab_grid_sync). The launch replaces
// the chain q/k/v -> q/k norm -> attention -> merge -> o -> norm -> router of the fast path, whose
// kernels start and drain one after the other; every value is computed by the same device
// functions in the same order as there (with the SIMT attention, attn_dec6_*), so the results
// are bit-identical to that chain.
// Dynamic shared memory AB_SMEM. Layout: step 1 stages AB_RPW rows per warp from 0 and the
// q8 input at AB_STAGE; from step 2 on, the o-projection rows sit at 0 and the region from
// AB_ORG holds the attention groups (step 2), the q8 attention output (step 3), then the
// normalized row (step 4).
#define AB_WARPS 16
#define AB_RPW 4                                   // q/k/v rows per warp and round
#define AB_ROWB (12 * CH)                          // q/k/v row bytes at most (hidden <= 3072)
#define AB_STAGE (AB_WARPS * AB_RPW * AB_ROWB)     // 208896
#define AB_XQ (3072 + 3072 / 32 * 4)               // staged q8 input
#define AB_ORG 156672                              // o-projection rows (24 rows of 6528 bytes)
#define AB_GRP (2 * 4 * 6 + 4 * 6 * AD_HD + 6 * AD_HD)  // floats of a group: m, l, o (4 warps), q
#define AB_SMEM (AB_ORG + 4 * AB_GRP * 4)          // 218880 (>= AB_STAGE + AB_XQ = 212352)
#define AB_QMAXI 8                                 // q / k widths up to 8192
#define AB_NMAXI 4                                 // hidden up to 4096 (step 4's norm)

// Grid barrier: every block arrives once per call; `target` counts arrivals since the
// counter was last zero (the last block of step 4 zeroes it for the next launch). All blocks
// must be resident (the host launches one per SM with shared memory for one). A counter that
// never gets there (a block that could not be scheduled) traps instead of hanging.
__device__ __forceinline__ void ab_grid_sync(u32* ctr, u32 target) {
    __syncthreads();
    if (threadIdx.x == 0) {
        __threadfence();
        atomicAdd(ctr, 1u);
        u32 v;
        u32 spins = 0;
        do {
            asm volatile("ld.acquire.gpu.global.u32 %0, [%1];" : "=r"(v) : "l"(ctr) : "memory");
        } while (v < target && ++spins < (1u << 26));
        if (v < target) __trap();
        __threadfence();
    }
    __syncthreads();
}

// Sum of squares of x[0, n) in the order of qk_norm_rope_store_impl's 1024 threads (value i of
// virtual thread v is element v + 1024 i, summed in i order; a butterfly per virtual warp,
// then over the 32 warp sums), by AB_WARPS real warps (real warp w plays virtual warps
// w + 16 m). x is read through L2 (written by other blocks of this launch). part: 32 floats.
__device__ __forceinline__ float ab_sumsq(const float* x, int n, float* part, int warp, int lane) {
#pragma unroll
    for (int m = 0; m < 32 / AB_WARPS; m++) {
        float xv[AB_QMAXI];
#pragma unroll
        for (int i = 0; i < AB_QMAXI; i++) {
            int idx = ((warp + AB_WARPS * m) << 5) + lane + 1024 * i;
            xv[i] = idx < n ? __ldcg(x + idx) : 0.f;
        }
        float ss = 0.f;
#pragma unroll
        for (int i = 0; i < AB_QMAXI; i++) ss += xv[i] * xv[i];
        ss = warp_sum(ss);
        if (lane == 0) part[warp + AB_WARPS * m] = ss;
    }
    __syncthreads();
    return warp_sum(part[lane]);
}

__device__ __forceinline__ void ab_prefetch_l2(const void* p, u32 bytes) {
#if BK_PTX
    asm volatile("cp.async.bulk.prefetch.L2.global [%0], %1;" ::"l"(p), "r"(bytes) : "memory");
#endif
}

template <int KV, int BF>
__device__ __forceinline__ void ablk_impl(
    // step 1: q/k/v (Q8_0 rows of nch chunks, row strides rbq/rbk/rbv) from the q8 input xq/xd
    const u8* Wq, i64 rbq, const u8* Wk, i64 rbk, const u8* Wv, i64 rbv, int nch, i8* xq, float* xd, float* q,
    float* k, float* v, int qw, int kw, int vw,
    // step 2: norms, RoPE, cache, attention (nsplit splits), merge into att and mq / md
    const float* qn, const float* kn, int rot, const int* pos, float theta, float eps, const int* slots, void* kc_,
    void* vc_, const int* seq, const int* pt_off, const u32* pts, int page_size, int kv_heads, int nsplit,
    float scale, float* part, u32* acnt, float* att, i8* mq, float* md,
    // step 3: o-projection (rows of ncho chunks, stride rbo) added into hid (hidden h)
    const u8* Wo, i64 rbo, int ncho, float* hid, int h,
    // step 4: MoE norm into xq / xd (the experts' input), router (E f32 rows) and top-k
    const float* fn, const float* Wr, int E, const float* bias, int topk, int gating, float* rl, int* ids,
    float* wts, u32* rcnt, u32* ctr) {
    typedef typename KvT<KV>::T KT;
    extern __shared__ __align__(128) u8 ab_sm[];
    __shared__ float part_s[32];
    __shared__ float cs[64], sn[64];
    __shared__ __align__(8) u64 ob_bar;
    __shared__ int g_last[4];
    const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;
    const int G = gridDim.x, b = blockIdx.x;
    const int hd = AD_HD, half = rot / 2;
    const int p0 = pos[0];  // step metadata: uploaded before the step
    // o-projection rows of this block: [o0, o0 + on)
    const int ro = (h + G - 1) / G, o0 = min(h, b * ro), on = min(h, o0 + ro) - o0;
    if (tid == 0) {
        bk_mb_init(&ob_bar, 1);
        bk_mb_fence_init();
    }
    if (tid < half) {
        double inv_freq = 1.0 / pow((double)theta, 2.0 * (double)tid / (double)rot);
        double a = (double)p0 * inv_freq;
        cs[tid] = (float)cos(a);
        sn[tid] = (float)sin(a);
    }

    // ---- 1. q/k/v ------------------------------------------------------------------------
    {
        const int total = qw + kw + vw, GW = G * AB_WARPS, gw = b * AB_WARPS + warp;
        const int n16 = nch * CH16, rbs = nch * CH;
        u8* st = ab_sm + warp * AB_RPW * rbs;
        i8* xq_s = (i8*)(ab_sm + AB_STAGE);
        float* xd_s = (float*)(ab_sm + AB_STAGE + h);
        const int rounds = (total + AB_RPW * GW - 1) / (AB_RPW * GW);
        for (int rd = 0; rd < rounds; rd++) {
            if (rd > 0) __syncwarp();  // every lane is done with the previous round's rows
#pragma unroll
            for (int j = 0; j < AB_RPW; j++) {
                int r = gw + (rd * AB_RPW + j) * GW;
                if (r >= total) break;
                const u8* w = r < qw ? Wq + r * rbq : r < qw + kw ? Wk + (r - qw) * rbk : Wv + (r - qw - kw) * rbv;
                for (int i = lane; i < n16; i += 32) cp_async16(st + j * rbs + 16 * i, (const int4*)w + i);
            }
            if (rd == 0) {
                pdl_wait();
                for (int i = tid; i < h / 16; i += blockDim.x) cp_async16(xq_s + 16 * i, (const int4*)xq + i);
                for (int i = tid; i < h / 128; i += blockDim.x) cp_async16(xd_s + 4 * i, (const int4*)xd + i);
            }
            cp_async_wait_all();
            __syncthreads();
#pragma unroll 1
            for (int j = 0; j < AB_RPW; j++) {
                int r = gw + (rd * AB_RPW + j) * GW;
                if (r >= total) break;
                float acc[1] = {0.f};
                mvqs_dot<1>(st + j * rbs, nch, 0, xq_s, xd_s, h, 1, acc, lane);
                float* y = r < qw ? q : r < qw + kw ? k : v;
                int rr = r < qw ? r : r < qw + kw ? r - qw : r - qw - kw;
                mv_store<1>(acc, y, 0, rr, 0, 1, lane, 0);
            }
        }
    }
    // The o-projection's rows into shared memory (over step 1's staging) and the router's rows
    // into L2, while step 2 runs.
#if BK_PTX
    asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
#endif
    __syncthreads();
    if (tid == 0) {
        if (on > 0) {
            bk_mb_expect(&ob_bar, (u32)(on * rbo));
            for (int j = 0; j < on; j++) bk_copy(ab_sm + j * rbo, Wo + (i64)(o0 + j) * rbo, (u32)rbo, &ob_bar);
        }
        for (int r = b; r < E; r += G) ab_prefetch_l2(Wr + (i64)r * h, (u32)(h * 4));
    }
    ab_grid_sync(ctr, G);

    // ---- 2. q/k norm, RoPE, K/V store, attention, merge -----------------------------------
    const float inv_q = 1.0f / sqrtf(ab_sumsq(q, qw, part_s, warp, lane) / (float)qw + eps);
    __syncthreads();  // part_s reused
    const float inv_k = 1.0f / sqrtf(ab_sumsq(k, kw, part_s, warp, lane) / (float)kw + eps);
    {
        const int gi = warp >> 2, gt = tid & 127, bar = 1 + gi;
        float* gsm = (float*)(ab_sm + AB_ORG) + gi * AB_GRP;
        float(*gm)[6] = (float(*)[6])gsm;
        float(*gl)[6] = (float(*)[6])(gsm + 24);
        float(*go)[6][AD_HD] = (float(*)[6][AD_HD])(gsm + 48);
        float* gq = gsm + 48 + 4 * 6 * AD_HD;
        const int n_ctx = p0 + 1;
        const int active = attn_active_splits(n_ctx, nsplit);
        int chunk = (n_ctx + nsplit - 1) / nsplit;
        chunk = (chunk + 15) & ~15;
        const int npairs = kv_heads * active;
        KT* kc = (KT*)kc_;
        KT* vc = (KT*)vc_;
        for (int pr = b + G * gi; pr < npairs; pr += 4 * G) {
            const int kvh = pr / active, sp = pr - kvh * active;
            // The group's 6 query heads: normalized (qk_norm_rope_store_impl's arithmetic), then
            // rotated.
            float ov[6];
#pragma unroll
            for (int j = 0; j < 6; j++) {
                int i = gt + AD_HD * j, idx = kvh * 6 * AD_HD + i;
                gq[i] = __ldcg(q + idx) * inv_q * qn[idx];
            }
            ad_bar(bar);
#pragma unroll
            for (int j = 0; j < 6; j++) {
                int i = gt + AD_HD * j, dd = i % hd;
                float o = gq[i];
                if (dd < half) o = o * cs[dd] - gq[i + half] * sn[dd];
                else if (dd < rot) o = o * cs[dd - half] + gq[i - half] * sn[dd - half];
                ov[j] = o;
            }
            ad_bar(bar);
#pragma unroll
            for (int j = 0; j < 6; j++) gq[gt + AD_HD * j] = ov[j];
            // The split that holds the new position writes its K / V first (and reads them back
            // from the cache like every other position).
            const int start = sp * chunk;
            if (p0 >= start && p0 < start + chunk) {
                float* kx = &go[0][0][0];  // scratch until the split runs
                int idx = kvh * hd + gt;
                kx[gt] = __ldcg(k + idx) * inv_k * kn[idx];
                ad_bar(bar);
                float o = kx[gt];
                int dd = gt;
                if (dd < half) o = o * cs[dd] - kx[gt + half] * sn[dd];
                else if (dd < rot) o = o * cs[dd - half] + kx[gt - half] * sn[dd - half];
                i64 sl = (i64)slots[0];
                kc[sl * kw + idx] = kv_store<KV>(o);
                vc[sl * vw + kvh * hd + gt] = kv_store<KV>(__ldcg(v + kvh * hd + gt));
                __threadfence_block();
            }
            ad_bar(bar);
            attn_dec_part<6>(gq, (const u16*)kc_, (const u16*)vc_, pos, seq, pt_off, pts, page_size, kv_heads, nsplit,
                             scale, part, BF, kvh, sp, 0, gt, bar, gm, gl, go);
            // The last split of this KV head to finish merges its 6 heads.
            __threadfence();
            ad_bar(bar);
            if (gt == 0) g_last[gi] = atomicAdd(acnt + kvh, 1u) == (u32)active - 1;
            ad_bar(bar);
            if (g_last[gi]) {
                __threadfence();
                const float* base = part + (i64)kvh * nsplit * (6 * (AD_HD + 2));
                float(*s_m)[6] = (float(*)[6])(gsm + 48);  // over the split's o (stored by now)
                float(*s_l)[6] = (float(*)[6])(gsm + 48 + AD_MAXSPLIT * 6);
                float(*s_M)[6] = (float(*)[6])(gsm + 48 + 2 * AD_MAXSPLIT * 6);
                attn_merge_core<6>(base, nsplit, active, kvh, 0, kv_heads * 6, att, 0, mq, md, s_m, s_l, s_M, gt, bar);
                if (gt == 0) acnt[kvh] = 0;
            }
            ad_bar(bar);
        }
    }
    ab_grid_sync(ctr, 2 * G);

    // ---- 3. o-projection into the residual --------------------------------------------------
    {
        const int ow = kv_heads * 6 * AD_HD;
        i8* mq_s = (i8*)(ab_sm + AB_ORG);
        float* md_s = (float*)(ab_sm + AB_ORG + ow);
        for (int i = tid; i < ow / 16; i += blockDim.x) cp_async16(mq_s + 16 * i, (const int4*)mq + i);
        for (int i = tid; i < ow / 128; i += blockDim.x) cp_async16(md_s + 4 * i, (const int4*)md + i);
        cp_async_wait_all();
        if (on > 0) bk_mb_wait(&ob_bar, 0);
        __syncthreads();
        for (int j = warp; j < on; j += AB_WARPS) {
            float acc[1] = {0.f};
            mvqs_dot<1>(ab_sm + j * rbo, ncho, 0, mq_s, md_s, ow, 1, acc, lane);
            mv_store<1>(acc, hid, 0, o0 + j, 0, 1, lane, 1);
        }
    }
    ab_grid_sync(ctr, 3 * G);
    pdl_trigger();

    // ---- 4. MoE norm, router, top-k ---------------------------------------------------------
    {
        float* xn = (float*)(ab_sm + AB_ORG);
        float xv[32 / AB_WARPS][AB_NMAXI], wv[32 / AB_WARPS][AB_NMAXI];
        const float inv = norm_virtual<AB_WARPS, AB_NMAXI, 0>(hid, fn, h, eps, xv, wv, part_s, warp, lane);
#pragma unroll
        for (int m = 0; m < 32 / AB_WARPS; m++)
#pragma unroll
            for (int i = 0; i < AB_NMAXI; i++) {
                int idx = ((warp + AB_WARPS * m) << 5) + lane + 1024 * i;
                if (idx < h) xn[idx] = __fmul_rn(__fmul_rn(xv[m][i], inv), wv[m][i]);
            }
        __syncthreads();
        for (int g = b * AB_WARPS + warp; g < (h >> 5); g += AB_WARPS * G)
            xq[(g << 5) + lane] = (i8)q8_lane(xn[(g << 5) + lane], xd + g);
        router_row(Wr, E, h, xn, 0, rl, 0, b + G * warp, 0, lane, true);
        __syncthreads();
        if (tid == 0) g_last[0] = atomicAdd(rcnt, 1u) == (u32)G - 1;
        __syncthreads();
        if (g_last[0] && warp == 0) {
            __threadfence();
            route_topk_warp(rl, bias, E, topk, gating, ids, wts, lane);
            if (lane == 0) {
                *rcnt = 0;
                *ctr = 0;
            }
        }
    }
}

#define ABLK_INST(name, KV, BF)                                                                                   \
    extern "C" __global__ void __launch_bounds__(32 * AB_WARPS, 1) ablk_##name(                                  \
        const u8* Wq, i64 rbq, const u8* Wk, i64 rbk, const u8* Wv, i64 rbv, int nch, i8* xq, float* xd,         \
        float* q, float* k, float* v, int qw, int kw, int vw, const float* qn, const float* kn, int rot,          \
        const int* pos, float theta, float eps, const int* slots, void* kc, void* vc, const int* seq,            \
        const int* pt_off, const u32* pts, int page_size, int kv_heads, int nsplit, float scale, float* part,    \
        u32* acnt, float* att, i8* mq, float* md, const u8* Wo, i64 rbo, int ncho, float* hid, int h,            \
        const float* fn, const float* Wr, int E, const float* bias, int topk, int gating, float* rl, int* ids,   \
        float* wts, u32* rcnt, u32* ctr) {                                                                       \
        ablk_impl<KV, BF>(Wq, rbq, Wk, rbk, Wv, rbv, nch, xq, xd, q, k, v, qw, kw, vw, qn, kn, rot, pos, theta,  \
                          eps, slots, kc, vc, seq, pt_off, pts, page_size, kv_heads, nsplit, scale, part, acnt,  \
                          att, mq, md, Wo, rbo, ncho, hid, h, fn, Wr, E, bias, topk, gating, rl, ids, wts, rcnt, \
                          ctr);                                                                                  \
    }
ABLK_INST(f16, KV_F16, 0)
ABLK_INST(bf16, KV_BF16, 1)
