// Paged attention over an f16/bf16 (or f32) KV cache: one kernel for prefill chunks and decode.
//
// Cache layout per layer: [slot][kv_head][dim], slot = page * page_size + offset, K and V
// in separate arrays. Token t of the flat batch sits at position pos[t] of sequence seq[t];
// it attends causally to positions 0..=pos[t] of that sequence (its cached prefix and the new
// tokens before it, all already stored by kv_store), found through the sequence's page table
// page_tables[pt_off[seq] ..]. GQA: query head h reads KV head h / (heads / kv_heads).

#define ATT_WARPS 4
#define ATT_MAXD 8  // up to 8 * 32 = 256 dims per head

// Stores the new tokens' K and V (f32, [nt][kv_heads * dim]) at slots[t]. grid (nt), block 256.
template <int KV>
__device__ __forceinline__ void kv_store_impl(const float* k, const float* v, int kw, int vw, const int* slots,
                                              void* kc_, void* vc_) {
    typedef typename KvT<KV>::T KT;
    KT* kc = (KT*)kc_;
    KT* vc = (KT*)vc_;
    int t = blockIdx.x;
    i64 s = slots[t];
    for (int i = threadIdx.x; i < kw; i += blockDim.x) kc[s * kw + i] = kv_store<KV>(k[(i64)t * kw + i]);
    for (int i = threadIdx.x; i < vw; i += blockDim.x) vc[s * vw + i] = kv_store<KV>(v[(i64)t * vw + i]);
}

// out[t][h * vd ..] = softmax(q k^T * scale) v for query head h of token t.
// grid (heads, nt), block 32 * ATT_WARPS. Each warp runs an online softmax over every
// ATT_WARPS-th position; the warps' partial results are merged at the end.
template <int KV>
__device__ __forceinline__ void attn_impl(const float* q, i64 qs, const void* kc_, const void* vc_, const int* pos,
                                          const int* seq, const int* pt_off, const u32* page_tables, int page_size,
                                          int heads, int kv_heads, int hd, int vd, float scale, float* out,
                                          i64 os) {
    typedef typename KvT<KV>::T KT;
    const KT* kc = (const KT*)kc_;
    const KT* vc = (const KT*)vc_;
    __shared__ float sm_m[ATT_WARPS], sm_l[ATT_WARPS];
    __shared__ float sm_acc[ATT_WARPS][ATT_MAXD * WARP];
    int h = blockIdx.x, t = blockIdx.y;
    int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    int kvh = h / (heads / kv_heads);
    const float* qh = q + t * qs + h * hd;
    float qr[ATT_MAXD], acc[ATT_MAXD];
#pragma unroll
    for (int j = 0; j < ATT_MAXD; j++) {
        int i = lane + j * WARP;
        qr[j] = i < hd ? qh[i] : 0.f;
        acc[j] = 0.f;
    }
    int n_ctx = pos[t] + 1;
    const u32* pt = page_tables + pt_off[seq[t]];
    float m = NEG_INF, l = 0.f;
    for (int p = warp; p < n_ctx; p += ATT_WARPS) {
        i64 slot = (i64)pt[p / page_size] * page_size + p % page_size;
        const KT* kp = kc + (slot * kv_heads + kvh) * hd;
        float s = 0.f;
#pragma unroll
        for (int j = 0; j < ATT_MAXD; j++) {
            int i = lane + j * WARP;
            if (i < hd) s += qr[j] * kv_load<KV>(kp + i);
        }
        s = warp_sum(s) * scale;
        float m_new = fmaxf(m, s);
        float corr = __expf(m - m_new);
        float e = __expf(s - m_new);
        l = l * corr + e;
        const KT* vp = vc + (slot * kv_heads + kvh) * vd;
#pragma unroll
        for (int j = 0; j < ATT_MAXD; j++) {
            int i = lane + j * WARP;
            acc[j] = acc[j] * corr + (i < vd ? e * kv_load<KV>(vp + i) : 0.f);
        }
        m = m_new;
    }
    if (lane == 0) {
        sm_m[warp] = m;
        sm_l[warp] = l;
    }
#pragma unroll
    for (int j = 0; j < ATT_MAXD; j++) sm_acc[warp][lane + j * WARP] = acc[j];
    __syncthreads();
    float M = NEG_INF;
#pragma unroll
    for (int w = 0; w < ATT_WARPS; w++) M = fmaxf(M, sm_m[w]);
    float L = 0.f, f[ATT_WARPS];
#pragma unroll
    for (int w = 0; w < ATT_WARPS; w++) {
        f[w] = sm_l[w] > 0.f ? __expf(sm_m[w] - M) : 0.f;
        L += sm_l[w] * f[w];
    }
    float* o = out + t * os + h * vd;
    for (int i = threadIdx.x; i < vd; i += blockDim.x) {
        float a = 0.f;
#pragma unroll
        for (int w = 0; w < ATT_WARPS; w++) a += sm_acc[w][i] * f[w];
        o[i] = a / L;
    }
}

#define ATT_INST(name, KV)                                                                                      \
    extern "C" __global__ void kv_store_##name(const float* k, const float* v, int kw, int vw, const int* slots, \
                                               void* kc, void* vc) {                                            \
        kv_store_impl<KV>(k, v, kw, vw, slots, kc, vc);                                                         \
    }                                                                                                           \
    extern "C" __global__ void __launch_bounds__(32 * ATT_WARPS)                                                \
        attn_##name(const float* q, i64 qs, const void* kc, const void* vc, const int* pos, const int* seq,     \
                    const int* pt_off, const u32* page_tables, int page_size, int heads, int kv_heads, int hd,  \
                    int vd, float scale, float* out, i64 os) {                                                  \
        attn_impl<KV>(q, qs, kc, vc, pos, seq, pt_off, page_tables, page_size, heads, kv_heads, hd, vd, scale, \
                      out, os);                                                                                 \
    }

ATT_INST(f16, KV_F16)
ATT_INST(bf16, KV_BF16)
ATT_INST(f32, KV_F32)

// ---------------------------------------------------------------------------------------------
// Flash-style prefill attention (FlashAttention-2 scheme) over the same paged cache, 16-bit KV.
//
// Work split: a block takes one sequence s, one KV head, and a tile of FA_BM query rows, where
// the rows of a sequence are its (token, head-in-group) pairs flattened token-major: row r is
// token seq_start[s] + r / group, query head kvh * group + r % group. All heads of a GQA group
// thus share every K/V tile a block loads. Each of the FA_WARPS warps owns 16 rows (one m16
// tile). The block walks the K/V tiles of FA_BN positions up to its causal limit (the largest
// position among its rows, + 1); positions at or past that limit are never read (zero-filled in
// shared memory), so nothing past a sequence's length is touched.
//
// Per tile: S = Q K^T and O += P V on tensor cores (mma.sync m16n8k16, f16 or bf16 inputs as the
// cache, f32 accumulation); Q is rounded once to the cache's 16-bit type and held in registers as
// A fragments, K comes in with ldmatrix, V with ldmatrix.trans, P is rounded from the S
// accumulators straight into A fragments. Softmax is online in f32 in the log2 domain
// (scale * log2(e) folded into the scores). K(t+1) is fetched with cp.async while P V(t) runs and
// V(t) while Q K(t)^T runs (one K and one V buffer).
//
// grid (n_tiles, kv_heads, n_seqs), block 32 * FA_WARPS; tiles are taken heaviest-first
// (blockIdx.x 0 is the last tile, whose rows see the most keys).

#define FA_WARPS 4
#define FA_BM (16 * FA_WARPS)
#define FA_BN 64

__device__ __forceinline__ float fa_exp2(float x) {
    float y;
    asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
    return y;
}
// Two floats rounded to the cache's 16-bit type, packed (lo in the low half).
template <int KV> __device__ __forceinline__ u32 fa_pack(float lo, float hi);
template <> __device__ __forceinline__ u32 fa_pack<KV_F16>(float lo, float hi) {
    u32 r;
    asm("cvt.rn.f16x2.f32 %0, %1, %2;" : "=r"(r) : "f"(hi), "f"(lo));
    return r;
}
template <> __device__ __forceinline__ u32 fa_pack<KV_BF16>(float lo, float hi) {
    u32 r;
    asm("cvt.rn.bf16x2.f32 %0, %1, %2;" : "=r"(r) : "f"(hi), "f"(lo));
    return r;
}
// c += A B for one m16n8k16 tile (A row-major 16x16, B "col" 16x8, f32 accumulators).
template <int KV> __device__ __forceinline__ void fa_mma(float* c, const u32* a, u32 b0, u32 b1);
template <> __device__ __forceinline__ void fa_mma<KV_F16>(float* c, const u32* a, u32 b0, u32 b1) {
    asm("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}
template <> __device__ __forceinline__ void fa_mma<KV_BF16>(float* c, const u32* a, u32 b0, u32 b1) {
    asm("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

// Starts the async copy of BN cached rows (positions k0..) of one KV head into `dst` (rows
// LD halves apart) by a block of NT threads; rows at positions >= kv_len are zero-filled and
// not read.
template <int D, int LD, int BN = FA_BN, int NT = 32 * FA_WARPS>
__device__ __forceinline__ void fa_load_tile(u16* dst, const u16* src, int k0, int kv_len, const u32* pt,
                                             int page_size, int kv_heads, int kvh) {
    constexpr int CPR = D / 8;    // 16-byte chunks per row
    constexpr int RPP = NT / CPR;  // rows per pass of the block
    const int ch = threadIdx.x % CPR;
#pragma unroll
    for (int r = threadIdx.x / CPR; r < BN; r += RPP) {
        const int p = k0 + r;
        const u16* g = src;
        int bytes = 0;
        if (p < kv_len) {
            i64 slot = (i64)pt[p / page_size] * page_size + p % page_size;
            g = src + (slot * kv_heads + kvh) * D + ch * 8;
            bytes = 16;
        }
        cp_async16z(smem_addr(dst + r * LD + ch * 8), g, bytes);
    }
}

template <int KV, int D>
__device__ __forceinline__ void flash_impl(const float* q, i64 qs, const u16* kc, const u16* vc, const int* pos,
                                           const int* seq_start, const int* pt_off, const u32* page_tables,
                                           int page_size, int kv_heads, int group, float sl2, float* out, i64 os,
                                           int n_tiles) {
    constexpr int LD = D + 8;  // padded row: 8 ldmatrix rows hit 8 distinct 16-byte bank groups
    constexpr int KC = D / 16;
    constexpr int ND = D / 8;
    constexpr int NB = FA_BN / 8;
    __shared__ __align__(16) u16 sk[FA_BN * LD];
    __shared__ __align__(16) u16 sv[FA_BN * LD];
    __shared__ int s_lim[FA_WARPS];
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, c = lane & 3;
    const int tile = n_tiles - 1 - (int)blockIdx.x;
    const int kvh = blockIdx.y, s = blockIdx.z;
    const int t0 = seq_start[s];
    const int nrows = (seq_start[s + 1] - t0) * group;
    const int r0 = tile * FA_BM;
    if (r0 >= nrows) return;  // uniform over the block
    const u32* pt = page_tables + pt_off[s];

    // This thread's two rows (g and g + 8 of its warp's m16 tile): position (-1: no row), offsets.
    int qp[2];
    i64 qo[2], oo[2];
#pragma unroll
    for (int i = 0; i < 2; i++) {
        int r = r0 + warp * 16 + g + 8 * i;
        qp[i] = -1;
        qo[i] = 0;
        oo[i] = 0;
        if (r < nrows) {
            int tk = t0 + r / group, h = kvh * group + r % group;
            qp[i] = pos[tk];
            qo[i] = (i64)tk * qs + (i64)h * D;
            oo[i] = (i64)tk * os + (i64)h * D;
        }
    }
    int wl = max(qp[0], qp[1]);
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) wl = max(wl, __shfl_xor_sync(0xffffffffu, wl, o));
    if (lane == 0) s_lim[warp] = wl + 1;
    __syncthreads();
    int kv_len = 0;
#pragma unroll
    for (int w = 0; w < FA_WARPS; w++) kv_len = max(kv_len, s_lim[w]);

    // Q as A fragments (rounded to the cache type once).
    u32 qf[KC][4];
#pragma unroll
    for (int kk = 0; kk < KC; kk++) {
#pragma unroll
        for (int j = 0; j < 4; j++) {
            int i = j & 1, col = kk * 16 + 2 * c + (j >> 1) * 8;
            float2 v;
            v.x = 0.f;
            v.y = 0.f;
            if (qp[i] >= 0) v = *(const float2*)(q + qo[i] + col);
            qf[kk][j] = fa_pack<KV>(v.x, v.y);
        }
    }
    float o[ND][4];
#pragma unroll
    for (int n = 0; n < ND; n++) o[n][0] = o[n][1] = o[n][2] = o[n][3] = 0.f;
    float m[2] = {NEG_INF, NEG_INF}, l[2] = {0.f, 0.f};

    // ldmatrix row addresses (per lane) within a tile.
    const u32 sk0 = smem_addr(sk), sv0 = smem_addr(sv);
    // K (non-transposed x4): matrices (keys n..n+7 | n+8..n+15) x (dims d..d+7 | d+8..d+15).
    const u32 k_lane = sk0 + (((lane & 7) + ((lane >> 4) << 3)) * LD + ((lane >> 3) & 1) * 8) * 2;
    // V (transposed x4): matrices (keys j..j+7 | j+8..j+15) x (dims n..n+7 | n+8..n+15).
    const u32 v_lane = sv0 + ((lane & 15) * LD + (lane >> 4) * 8) * 2;

    const int n_kt = (kv_len + FA_BN - 1) / FA_BN;
    fa_load_tile<D, LD>(sk, kc, 0, kv_len, pt, page_size, kv_heads, kvh);
    cp_async_commit();
    for (int kt = 0; kt < n_kt; kt++) {
        const int k0 = kt * FA_BN;
        cp_async_wait<0>();
        __syncthreads();  // K(kt) landed for everyone; every warp is done with V(kt-1)
        fa_load_tile<D, LD>(sv, vc, k0, kv_len, pt, page_size, kv_heads, kvh);
        cp_async_commit();
        const bool active = k0 <= wl;  // some row of this warp sees a key of this tile
        float sc[NB][4];
        if (active) {
#pragma unroll
            for (int n = 0; n < NB; n++) sc[n][0] = sc[n][1] = sc[n][2] = sc[n][3] = 0.f;
#pragma unroll
            for (int kk = 0; kk < KC; kk++) {
#pragma unroll
                for (int n2 = 0; n2 < NB / 2; n2++) {
                    u32 b0, b1, b2, b3;
                    ldsm_x4(k_lane + (n2 * 16 * LD + kk * 16) * 2, b0, b1, b2, b3);
                    fa_mma<KV>(sc[2 * n2], qf[kk], b0, b1);
                    fa_mma<KV>(sc[2 * n2 + 1], qf[kk], b2, b3);
                }
            }
            // Scale, causal mask, online softmax (rows g and g + 8; a row's 4 threads are a quad).
#pragma unroll
            for (int i = 0; i < 2; i++) {
                float mx = NEG_INF;
#pragma unroll
                for (int n = 0; n < NB; n++) {
#pragma unroll
                    for (int e = 0; e < 2; e++) {
                        int key = k0 + n * 8 + 2 * c + e;
                        float v = key <= qp[i] ? sc[n][2 * i + e] * sl2 : NEG_INF;
                        sc[n][2 * i + e] = v;
                        mx = fmaxf(mx, v);
                    }
                }
                mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 1));
                mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 2));
                float mn = fmaxf(m[i], mx);
                float base = mn == NEG_INF ? 0.f : mn;
                float corr = fa_exp2(m[i] - base);
                m[i] = mn;
                float sum = 0.f;
#pragma unroll
                for (int n = 0; n < NB; n++) {
#pragma unroll
                    for (int e = 0; e < 2; e++) {
                        float p = fa_exp2(sc[n][2 * i + e] - base);
                        sc[n][2 * i + e] = p;
                        sum += p;
                    }
                }
                l[i] = l[i] * corr + sum;
#pragma unroll
                for (int n = 0; n < ND; n++) {
                    o[n][2 * i] *= corr;
                    o[n][2 * i + 1] *= corr;
                }
            }
        }
        __syncthreads();  // every warp is done reading K(kt)
        if (kt + 1 < n_kt) fa_load_tile<D, LD>(sk, kc, k0 + FA_BN, kv_len, pt, page_size, kv_heads, kvh);
        cp_async_commit();
        cp_async_wait<1>();
        __syncthreads();  // V(kt) landed for everyone
        if (active) {
#pragma unroll
            for (int j = 0; j < FA_BN / 16; j++) {
                u32 a[4];
                a[0] = fa_pack<KV>(sc[2 * j][0], sc[2 * j][1]);
                a[1] = fa_pack<KV>(sc[2 * j][2], sc[2 * j][3]);
                a[2] = fa_pack<KV>(sc[2 * j + 1][0], sc[2 * j + 1][1]);
                a[3] = fa_pack<KV>(sc[2 * j + 1][2], sc[2 * j + 1][3]);
#pragma unroll
                for (int n2 = 0; n2 < ND / 2; n2++) {
                    u32 b0, b1, b2, b3;
                    ldsm_x4_t(v_lane + (j * 16 * LD + n2 * 16) * 2, b0, b1, b2, b3);
                    fa_mma<KV>(o[2 * n2], a, b0, b1);
                    fa_mma<KV>(o[2 * n2 + 1], a, b2, b3);
                }
            }
        }
    }
#pragma unroll
    for (int i = 0; i < 2; i++) {
        float li = l[i];
        li += __shfl_xor_sync(0xffffffffu, li, 1);
        li += __shfl_xor_sync(0xffffffffu, li, 2);
        if (qp[i] < 0) continue;
        float inv = 1.f / li;
#pragma unroll
        for (int n = 0; n < ND; n++) {
            float2 v;
            v.x = o[n][2 * i] * inv;
            v.y = o[n][2 * i + 1] * inv;
            *(float2*)(out + oo[i] + n * 8 + 2 * c) = v;
        }
    }
}

#define FA_INST(name, KV, D)                                                                                    \
    extern "C" __global__ void __launch_bounds__(32 * FA_WARPS)                                                 \
        flash64_##name##_##D(const float* q, i64 qs, const u16* kc, const u16* vc, const int* pos,              \
                           const int* seq_start, const int* pt_off, const u32* page_tables, int page_size,      \
                           int kv_heads, int group, float sl2, float* out, i64 os, int n_tiles) {               \
        flash_impl<KV, D>(q, qs, kc, vc, pos, seq_start, pt_off, page_tables, page_size, kv_heads, group, sl2, \
                          out, os, n_tiles);                                                                    \
    }

FA_INST(f16, KV_F16, 32)
FA_INST(f16, KV_F16, 64)
FA_INST(f16, KV_F16, 128)
FA_INST(bf16, KV_BF16, 32)
FA_INST(bf16, KV_BF16, 64)
FA_INST(bf16, KV_BF16, 128)

// ---------------------------------------------------------------------------------------------
// The same attention with two m16 tiles per warp: FB_BM = 128 query rows a block (flash_KV_D; the
// 64-row kernel above is flash64_KV_D, kept for launches with few blocks).
//
// Each K/V fragment read from shared memory feeds both m16 tiles of a warp, so a block reads half
// the shared memory per FLOP of the 64-row kernel. The 32 rows' Q fragments do not fit in
// registers beside the 2 x D/8 x 4 output and 2 x FB_BN/8 x 4 score accumulators, so Q (rounded
// once to the cache type) lives in shared memory and is re-read with ldmatrix for every K tile
// (FlashAttention-2's layout). Dynamic shared memory: Q (FB_BM rows) + one K and one V tile of
// FB_BN rows, all D + 8 halves apart: (128 + 2 * 64) * (D + 8) * 2 bytes (68 KB at D = 128, so
// two blocks fit an sm_90 SM and one an sm_120 SM). Pipelining as above: V(t) is fetched while
// S(t) = Q K(t)^T and the softmax run, K(t+1) while P V(t) runs.
//
// Masking: a warp masks a K tile only if its last key is past the smallest position among the
// warp's rows (the diagonal tiles); it skips tiles past its largest position. Scores stay in raw
// units; the softmax scale * log2(e) is folded into one FMA per score before ex2.

#define FB_WARPS 4
#define FB_BM (32 * FB_WARPS)
#define FB_BN 64

extern __shared__ __align__(16) u16 fb_dyn[];

// fa_load_tile for the 128-row kernel: the BN rows' cache rows are looked up once per warp
// (lane L < 16 resolves the L-th row this warp copies: one page-table read and one division)
// and handed to the copying lanes by shuffle, instead of every thread dividing for each row.
template <int D, int LD, int BN, int NT>
__device__ __forceinline__ void fb_load_tile(u16* dst, const u16* src, int k0, int kv_len, const u32* pt,
                                             int page_size, int kv_heads, int kvh) {
    constexpr int CPR = D / 8;     // 16-byte chunks per row
    constexpr int RW = 32 / CPR;   // rows per warp per pass
    constexpr int RPP = NT / CPR;  // rows per pass of the block
    constexpr int NP = BN / RPP;   // passes
    static_assert(NP * RW <= 32, "one lane per row of a warp");
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    // Lane L resolves pass L / RW, row L % RW of this warp: cache row slot * kv_heads + kvh (32
    // bits: up to 2^32 - 2 (slot, head) rows), or ~0 for a position at or past kv_len.
    u32 mine = ~0u;
    if (lane < NP * RW) {
        const int p = k0 + warp * RW + lane % RW + (lane / RW) * RPP;
        if (p < kv_len) {
            const int pg = p / page_size;
            mine = (pt[pg] * (u32)page_size + (u32)(p - pg * page_size)) * (u32)kv_heads + (u32)kvh;
        }
    }
    const int ch = lane % CPR;
#pragma unroll
    for (int i = 0; i < NP; i++) {
        const u32 idx = __shfl_sync(0xffffffffu, mine, i * RW + lane / CPR);
        const int r = warp * RW + lane / CPR + i * RPP;
        const bool ok = idx != ~0u;
        const u16* g = ok ? src + (i64)idx * D + ch * 8 : src;
        cp_async16z(smem_addr(dst + r * LD + ch * 8), g, ok ? 16 : 0);
    }
}

// SPLIT (flashs_ / flashsdb_): blockIdx.x = tile * nsplit + split; the block takes its split's
// share of the tile's key tiles and writes unnormalized partials (o[D], m, l per row) to part
// (split-major, then token, then head); flash_merge combines them into out.
template <int KV, int D, bool DB, bool SPLIT = false>
__device__ __forceinline__ void flash2_impl(const float* q, i64 qs, const u16* kc, const u16* vc, const int* pos,
                                            const int* seq_start, const int* pt_off, const u32* page_tables,
                                            int page_size, int kv_heads, int group, float sl2, float* out, i64 os,
                                            int n_tiles, int nsplit = 1, float* part = nullptr) {
    constexpr int LD = D + 8;
    constexpr int KC = D / 16;
    constexpr int ND = D / 8;
    constexpr int NB = FB_BN / 8;
    constexpr int NT = 32 * FB_WARPS;
    // DB: two K and two V buffers (K(t+1) and V(t+1) fetched a whole tile ahead).
    constexpr int NBUF = DB ? 2 : 1;
    u16* sq = fb_dyn;
    u16* sk = sq + FB_BM * LD;
    u16* sv = sk + NBUF * FB_BN * LD;
    __shared__ int s_lim[FB_WARPS];
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, c = lane & 3;
    const int tile = n_tiles - 1 - (int)blockIdx.x / (SPLIT ? nsplit : 1);
    const int split = SPLIT ? (int)blockIdx.x % nsplit : 0;
    const int kvh = blockIdx.y, s = blockIdx.z;
    const int t0 = seq_start[s];
    const int nrows = (seq_start[s + 1] - t0) * group;
    const int r0 = tile * FB_BM;
    if (r0 >= nrows) return;  // uniform over the block
    const u32* pt = page_tables + pt_off[s];

    // This thread's four rows: j = 2 * mt + i is row g + 8 i of the warp's m16 tile mt.
    int qp[4];
    int wl = -1, wm = 0x7fffffff;
#pragma unroll
    for (int j = 0; j < 4; j++) {
        const int r = r0 + warp * 32 + (j >> 1) * 16 + g + 8 * (j & 1);
        qp[j] = r < nrows ? pos[t0 + r / group] : -1;
        if (qp[j] >= 0) {
            wl = max(wl, qp[j]);
            wm = min(wm, qp[j]);
        }
    }
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) {
        wl = max(wl, __shfl_xor_sync(0xffffffffu, wl, o));
        wm = min(wm, __shfl_xor_sync(0xffffffffu, wm, o));
    }
    if (lane == 0) s_lim[warp] = wl + 1;
    __syncthreads();
    int kv_len = 0;
#pragma unroll
    for (int w = 0; w < FB_WARPS; w++) kv_len = max(kv_len, s_lim[w]);

    const int n_kt = (kv_len + FB_BN - 1) / FB_BN;
    // This block's key tiles: all, or its split's share (an empty share writes m = -inf, l = 0).
    int kt_begin = 0, kt_end = n_kt;
    if (SPLIT) {
        const int per = (n_kt + nsplit - 1) / nsplit;
        kt_begin = min(n_kt, split * per);
        kt_end = min(n_kt, kt_begin + per);
    }
    fb_load_tile<D, LD, FB_BN, NT>(sk, kc, kt_begin * FB_BN, kv_len, pt, page_size, kv_heads, kvh);
    cp_async_commit();
    if (DB) {
        fb_load_tile<D, LD, FB_BN, NT>(sv, vc, kt_begin * FB_BN, kv_len, pt, page_size, kv_heads, kvh);
        cp_async_commit();
    }

    // Q rows of the block -> shared, rounded to the cache type (rows past the sequence: zeros).
    {
        constexpr int QCH = D / 4;  // 4-float chunks per row
#pragma unroll 4
        for (int it = 0; it < FB_BM * QCH / NT; it++) {
            const int i = threadIdx.x + it * NT;
            const int rr = i / QCH, ch = i % QCH, r = r0 + rr;
            float2 a = make_float2(0.f, 0.f), b = make_float2(0.f, 0.f);
            if (r < nrows) {
                const float* src = q + (i64)(t0 + r / group) * qs + (i64)(kvh * group + r % group) * D + ch * 4;
                a = *(const float2*)src;
                b = *(const float2*)(src + 2);
            }
            uint2 w;
            w.x = fa_pack<KV>(a.x, a.y);
            w.y = fa_pack<KV>(b.x, b.y);
            *(uint2*)(sq + rr * LD + ch * 4) = w;
        }
    }

    float o[2][ND][4];
#pragma unroll
    for (int mt = 0; mt < 2; mt++)
#pragma unroll
        for (int n = 0; n < ND; n++) o[mt][n][0] = o[mt][n][1] = o[mt][n][2] = o[mt][n][3] = 0.f;
    float m[4], l[4];
#pragma unroll
    for (int j = 0; j < 4; j++) {
        m[j] = NEG_INF;
        l[j] = 0.f;
    }

    // ldmatrix lane addresses. Q (x4, A fragment of m16 tile 0; tile 1 is 16 rows on):
    // matrices (rows 0-7 | 8-15) x (dims 0-7 | 8-15).
    const u32 q_lane = smem_addr(sq) + ((warp * 32 + (lane & 15)) * LD + (lane >> 4) * 8) * 2;
    const u32 k_lane0 = smem_addr(sk) + (((lane & 7) + ((lane >> 4) << 3)) * LD + ((lane >> 3) & 1) * 8) * 2;
    const u32 v_lane0 = smem_addr(sv) + ((lane & 15) * LD + (lane >> 4) * 8) * 2;

    for (int kt = kt_begin; kt < kt_end; kt++) {
        const int k0 = kt * FB_BN;
        const u32 buf = DB ? (u32)((kt - kt_begin) & 1) * (FB_BN * LD * 2) : 0u;
        const u32 k_lane = k_lane0 + buf, v_lane = v_lane0 + buf;
        if (DB) {
            cp_async_wait<1>();  // K(kt) landed (V(kt) may still be in flight)
            __syncthreads();     // ... for everyone (and Q); every warp is done with K(kt-1)
            if (kt + 1 < kt_end) fb_load_tile<D, LD, FB_BN, NT>(sk + (buf ^ (FB_BN * LD * 2)) / 2, kc, k0 + FB_BN, kv_len, pt, page_size, kv_heads, kvh);
            cp_async_commit();
        } else {
            cp_async_wait<0>();
            __syncthreads();  // K(kt) (and Q) landed for everyone; every warp is done with V(kt-1)
            fb_load_tile<D, LD, FB_BN, NT>(sv, vc, k0, kv_len, pt, page_size, kv_heads, kvh);
            cp_async_commit();
        }
        const bool active = k0 <= wl;  // some row of this warp sees a key of this tile
        u32 pa[2][FB_BN / 16][4];  // P as A fragments (rounded to the cache type)
        if (active) {
            float sc[2][NB][4];
#pragma unroll
            for (int mt = 0; mt < 2; mt++)
#pragma unroll
                for (int n = 0; n < NB; n++) sc[mt][n][0] = sc[mt][n][1] = sc[mt][n][2] = sc[mt][n][3] = 0.f;
#pragma unroll
            for (int kk = 0; kk < KC; kk++) {
                u32 a0[4], a1[4];
                ldsm_x4(q_lane + kk * 32, a0[0], a0[1], a0[2], a0[3]);
                ldsm_x4(q_lane + (16 * LD + kk * 16) * 2, a1[0], a1[1], a1[2], a1[3]);
#pragma unroll
                for (int n2 = 0; n2 < NB / 2; n2++) {
                    u32 b0, b1, b2, b3;
                    ldsm_x4(k_lane + (n2 * 16 * LD + kk * 16) * 2, b0, b1, b2, b3);
                    fa_mma<KV>(sc[0][2 * n2], a0, b0, b1);
                    fa_mma<KV>(sc[0][2 * n2 + 1], a0, b2, b3);
                    fa_mma<KV>(sc[1][2 * n2], a1, b0, b1);
                    fa_mma<KV>(sc[1][2 * n2 + 1], a1, b2, b3);
                }
            }
            if (k0 + FB_BN - 1 > wm) {  // diagonal tile: keys past a row's position -> -inf
#pragma unroll
                for (int j = 0; j < 4; j++)
#pragma unroll
                    for (int n = 0; n < NB; n++)
#pragma unroll
                        for (int e = 0; e < 2; e++)
                            if (k0 + n * 8 + 2 * c + e > qp[j]) sc[j >> 1][n][2 * (j & 1) + e] = NEG_INF;
            }
            // Online softmax per row (a row's 4 threads are a quad).
#pragma unroll
            for (int j = 0; j < 4; j++) {
                const int mt = j >> 1, i = j & 1;
                float mx = NEG_INF;
#pragma unroll
                for (int n = 0; n < NB; n++) mx = fmaxf(mx, fmaxf(sc[mt][n][2 * i], sc[mt][n][2 * i + 1]));
                mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 1));
                mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 2));
                const float mn = fmaxf(m[j], mx);
                const float base = mn == NEG_INF ? 0.f : mn * sl2;
                const float corr = fa_exp2(fmaf(m[j], sl2, -base));
                m[j] = mn;
                float sum = 0.f;
#pragma unroll
                for (int n = 0; n < NB; n++) {
#pragma unroll
                    for (int e = 0; e < 2; e++) {
                        const float p = fa_exp2(fmaf(sc[mt][n][2 * i + e], sl2, -base));
                        sc[mt][n][2 * i + e] = p;
                        sum += p;
                    }
                }
                l[j] = l[j] * corr + sum;
#pragma unroll
                for (int n = 0; n < ND; n++) {
                    o[mt][n][2 * i] *= corr;
                    o[mt][n][2 * i + 1] *= corr;
                }
            }
#pragma unroll
            for (int mt = 0; mt < 2; mt++)
#pragma unroll
                for (int jk = 0; jk < FB_BN / 16; jk++) {
                    pa[mt][jk][0] = fa_pack<KV>(sc[mt][2 * jk][0], sc[mt][2 * jk][1]);
                    pa[mt][jk][1] = fa_pack<KV>(sc[mt][2 * jk][2], sc[mt][2 * jk][3]);
                    pa[mt][jk][2] = fa_pack<KV>(sc[mt][2 * jk + 1][0], sc[mt][2 * jk + 1][1]);
                    pa[mt][jk][3] = fa_pack<KV>(sc[mt][2 * jk + 1][2], sc[mt][2 * jk + 1][3]);
                }
        }
        if (DB) {
            cp_async_wait<1>();  // V(kt) landed (K(kt+1) may still be in flight)
            __syncthreads();     // ... for everyone; every warp is done with V(kt-1)
            if (kt + 1 < kt_end) fb_load_tile<D, LD, FB_BN, NT>(sv + (buf ^ (FB_BN * LD * 2)) / 2, vc, k0 + FB_BN, kv_len, pt, page_size, kv_heads, kvh);
            cp_async_commit();
        } else {
            __syncthreads();  // every warp is done reading K(kt)
            if (kt + 1 < kt_end) fb_load_tile<D, LD, FB_BN, NT>(sk, kc, k0 + FB_BN, kv_len, pt, page_size, kv_heads, kvh);
            cp_async_commit();
            cp_async_wait<1>();
            __syncthreads();  // V(kt) landed for everyone
        }
        if (active) {
#pragma unroll
            for (int jk = 0; jk < FB_BN / 16; jk++) {
#pragma unroll
                for (int n2 = 0; n2 < ND / 2; n2++) {
                    u32 b0, b1, b2, b3;
                    ldsm_x4_t(v_lane + (jk * 16 * LD + n2 * 16) * 2, b0, b1, b2, b3);
                    fa_mma<KV>(o[0][2 * n2], pa[0][jk], b0, b1);
                    fa_mma<KV>(o[0][2 * n2 + 1], pa[0][jk], b2, b3);
                    fa_mma<KV>(o[1][2 * n2], pa[1][jk], b0, b1);
                    fa_mma<KV>(o[1][2 * n2 + 1], pa[1][jk], b2, b3);
                }
            }
        }
    }
    // An empty split never waited for its prologue's (zero-filling) copies: none may be in
    // flight when the block exits.
    if (SPLIT) cp_async_wait<0>();
#pragma unroll
    for (int j = 0; j < 4; j++) {
        const int mt = j >> 1, i = j & 1;
        float li = l[j];
        li += __shfl_xor_sync(0xffffffffu, li, 1);
        li += __shfl_xor_sync(0xffffffffu, li, 2);
        if (qp[j] < 0) continue;
        const int r = r0 + warp * 32 + mt * 16 + g + 8 * i;
        if (SPLIT) {
            // Unnormalized: o, the row's running max m (raw score units) and l.
            const int heads = kv_heads * group;
            float* dst = part + ((i64)split * seq_start[gridDim.z] + t0 + r / group) * heads * (D + 2) + (i64)(kvh * group + r % group) * (D + 2);
#pragma unroll
            for (int n = 0; n < ND; n++) *(float2*)(dst + n * 8 + 2 * c) = make_float2(o[mt][n][2 * i], o[mt][n][2 * i + 1]);
            if (c == 0) *(float2*)(dst + D) = make_float2(m[j], li);
            continue;
        }
        float* dst = out + (i64)(t0 + r / group) * os + (i64)(kvh * group + r % group) * D + 2 * c;
        const float inv = 1.f / li;
#pragma unroll
        for (int n = 0; n < ND; n++) *(float2*)(dst + n * 8) = make_float2(o[mt][n][2 * i] * inv, o[mt][n][2 * i + 1] * inv);
    }
}

// out[t][h] of a split flash launch: sum over the splits with l > 0 of w o / sum of w l, w =
// 2^((m - M) sl2), M the largest such m. grid (tokens, heads), block D.
extern "C" __global__ void flash_merge(const float* part, int nsplit, int ntok, int heads, int D, float sl2, float* out, i64 os) {
    const int t = blockIdx.x, h = blockIdx.y, d = threadIdx.x;
    const i64 stride = (i64)ntok * heads * (D + 2);
    const float* p = part + ((i64)t * heads + h) * (D + 2);
    float M = NEG_INF;
    for (int sp = 0; sp < nsplit; sp++)
        if (p[sp * stride + D + 1] > 0.f) M = fmaxf(M, p[sp * stride + D]);
    float L = 0.f, O = 0.f;
    for (int sp = 0; sp < nsplit; sp++) {
        const float l = p[sp * stride + D + 1];
        if (l > 0.f) {
            const float w = fa_exp2((p[sp * stride + D] - M) * sl2);
            L = fmaf(l, w, L);
            O = fmaf(p[sp * stride + d], w, O);
        }
    }
    out[(i64)t * os + (i64)h * D + d] = O / L;
}

#define FB_INST(name, KV, D)                                                                                     \
    extern "C" __global__ void __launch_bounds__(32 * FB_WARPS)                                                  \
        flash_##name##_##D(const float* q, i64 qs, const u16* kc, const u16* vc, const int* pos,                 \
                           const int* seq_start, const int* pt_off, const u32* page_tables, int page_size,       \
                           int kv_heads, int group, float sl2, float* out, i64 os, int n_tiles) {                \
        flash2_impl<KV, D, false>(q, qs, kc, vc, pos, seq_start, pt_off, page_tables, page_size, kv_heads, group, \
                                  sl2, out, os, n_tiles);                                                        \
    }                                                                                                            \
    extern "C" __global__ void __launch_bounds__(32 * FB_WARPS)                                                  \
        flashdb_##name##_##D(const float* q, i64 qs, const u16* kc, const u16* vc, const int* pos,               \
                             const int* seq_start, const int* pt_off, const u32* page_tables, int page_size,     \
                             int kv_heads, int group, float sl2, float* out, i64 os, int n_tiles) {              \
        flash2_impl<KV, D, true>(q, qs, kc, vc, pos, seq_start, pt_off, page_tables, page_size, kv_heads, group, \
                                 sl2, out, os, n_tiles);                                                         \
    }                                                                                                            \
    extern "C" __global__ void __launch_bounds__(32 * FB_WARPS)                                                  \
        flashs_##name##_##D(const float* q, i64 qs, const u16* kc, const u16* vc, const int* pos,                \
                            const int* seq_start, const int* pt_off, const u32* page_tables, int page_size,      \
                            int kv_heads, int group, float sl2, float* out, i64 os, int n_tiles, int nsplit,     \
                            float* part) {                                                                       \
        flash2_impl<KV, D, false, true>(q, qs, kc, vc, pos, seq_start, pt_off, page_tables, page_size, kv_heads, \
                                        group, sl2, out, os, n_tiles, nsplit, part);                             \
    }                                                                                                            \
    extern "C" __global__ void __launch_bounds__(32 * FB_WARPS)                                                  \
        flashsdb_##name##_##D(const float* q, i64 qs, const u16* kc, const u16* vc, const int* pos,              \
                              const int* seq_start, const int* pt_off, const u32* page_tables, int page_size,    \
                              int kv_heads, int group, float sl2, float* out, i64 os, int n_tiles, int nsplit,   \
                              float* part) {                                                                     \
        flash2_impl<KV, D, true, true>(q, qs, kc, vc, pos, seq_start, pt_off, page_tables, page_size, kv_heads,  \
                                       group, sl2, out, os, n_tiles, nsplit, part);                              \
    }

FB_INST(f16, KV_F16, 32)
FB_INST(f16, KV_F16, 64)
FB_INST(f16, KV_F16, 128)
FB_INST(bf16, KV_BF16, 32)
FB_INST(bf16, KV_BF16, 64)
FB_INST(bf16, KV_BF16, 128)
