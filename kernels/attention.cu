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
