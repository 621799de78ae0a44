// Sampling reductions of logits rows on the device, so a step sends a few KB per row to the
// host instead of the whole vocabulary. The host finishes with
// minimax_shared::sampling::partial::finish, which gives exactly reduce_row's RowReduction
// (or declines, and the host reduces the full row).
//
// Per row r (logits + params[r].src_row * stride):
//   samp_penalty  one block per row: the penalised logit z of every touched token (history with
//                 repetition / frequency / presence, then logit_bias), into a compact list in
//                 the host's (sorted) order, and the token's bit in a per-row bitmap.
//   samp_chunk    grid (NB, rows), one block per SP_CHUNK tokens: raw max and sum of exp
//                 (f32 exp with max subtraction, f64 accumulation), NaN / overflow flags, the
//                 count of z > -inf, and the chunk's exact top-T raw keys and top-K candidate
//                 keys (radix select on unique 64-bit keys).
//   samp_merge    one block per row: log-sum-exp, exact global top-T and top-K from the chunks'
//                 keys, sorted (value descending, id ascending), target's raw logit; with
//                 `picks`, the row's drawn token (-1 if none) at picks[row] and, for the
//                 host's check, out[pick_off + row]: the first candidate, or, for a row given
//                 the host's uniform number (P_U_*), the token the host's finish + draw take
//                 (sp_draw_leading; CPU twin minimax_shared::sampling::draw::draw_leading).
//   samp_total    grid (NB, rows), rows that ask for it: per chunk f64 sum of
//                 sp_det_exp((double)(zt - zmax)) (the top_p total; the host adds the chunks
//                 in order).
//
// Keys: (order-preserving bits of the value) << 32 | (0xffffffff - id): larger key = earlier in
// candidate order (value descending, ties to the lower id), all keys distinct, 0 = no key. -0.0
// is keyed as +0.0 (they compare equal on the CPU, so the id decides). Values written out are
// re-read or recomputed from the row, never decoded from keys.
//
// Every f32 operation on z repeats the CPU's (no FMA contraction: __fmul_rn/__fadd_rn/...).

#define SP_THREADS 1024
#define SP_NPT 8
#define SP_CHUNK (SP_THREADS * SP_NPT)
#define SP_MAX_TOP 20
#define SP_KMAX 1024
#define SP_PW 17
#define SP_HDR 48
#define SP_TW 4

// Row parameter words.
#define P_KC 0
#define P_T 1
#define P_TEMP 2
#define P_REP 3
#define P_FREQ 4
#define P_PRES 5
#define P_TOFF 6
#define P_TLEN 7
#define P_TARGET 8
#define P_NEED_TOTAL 9
#define P_OUT_OFF 10
#define P_SRC_ROW 11
// The device draw: top_p (f32), ln(min_p) as the host computed it (all ones: min_p off), the
// uniform number's f64 bits, low word first (all ones: no draw, the pick is the first
// candidate). The host gives a uniform only to rows whose candidates are the whole set P_KC
// bounds (RowPlan::whole_set).
#define P_TOPP 12
#define P_MINP_LN 13
#define P_U_LO 14
#define P_U_HI 15
// Structured outputs: the word offset in `params` of the row's allowed-token mask (bit t % 32 of
// word t / 32 set: token t may be drawn; vocab / 32 words, rounded up), all ones: no mask. A
// banned token's penalised logit is -inf, as reduce_row's `penalised` bans it after the bias.
#define P_MASK 16

// Header words of a row's output.
#define H_NAN 0
#define H_FLAGS 1
#define H_LSE 2
#define H_NFIN 3
#define H_TARGET 4
#define H_ZMAX 5
#define H_NCAND 6
#define H_NTOP 7
#define H_TOP_IDS 8
#define H_TOP_RAW 28

// Flags: bit 0 raw +inf, bit 1 a final logit that is not finite although z is.
#define F_RAW_INF 1u
#define F_ZT_INF 2u

#define POS_INF __int_as_float(0x7f800000)
#define SP_DNEG_INF __longlong_as_double(0xfff0000000000000ll)

__device__ __forceinline__ u32 sp_ord(float v) {
    u32 b = __float_as_uint(v);
    if ((b << 1) == 0) b = 0;
    return (b & 0x80000000u) ? ~b : (b | 0x80000000u);
}
__device__ __forceinline__ u64 sp_key(float v, u32 id) { return ((u64)sp_ord(v) << 32) | (u64)(0xffffffffu - id); }
__device__ __forceinline__ u32 sp_key_id(u64 k) { return 0xffffffffu - (u32)k; }

// The row's allowed-token mask (P_MASK), or null.
__device__ __forceinline__ const u32* sp_mask(const u32* params, const u32* P) {
    return P[P_MASK] == 0xffffffffu ? nullptr : params + P[P_MASK];
}

// The penalised logit of token i of a row: the raw value unless the token is touched; -inf
// when the row's mask bans it.
__device__ __forceinline__ float sp_z(const float* row, int i, const u32* bits, const u32* touch, const float* tz, int tlen, const u32* mask) {
    if (mask != nullptr && !((mask[i >> 5] >> (i & 31)) & 1u)) return NEG_INF;
    float x = row[i];
    if ((bits[i >> 5] >> (i & 31)) & 1u) {
        int lo = 0, hi = tlen - 1;
        while (lo < hi) {
            int mid = (lo + hi) >> 1;
            if ((int)touch[mid * SP_TW] < i) lo = mid + 1; else hi = mid;
        }
        x = tz[lo];
    }
    return x;
}

__device__ __forceinline__ float sp_final(float z, float temp) { return temp > 0.0f ? __fdiv_rn(z, temp) : z; }

// ---- the sampling exponential: bit-identical to minimax_shared::sampling::exp::det_exp ----
// e^x from IEEE +, -, * in a fixed order (no contraction into FMA: the _rn intrinsics), so a
// draw or a top_p cut decided here is the host's to the bit. Cody-Waite reduction by ln 2,
// Taylor to r^13/13! in Horner form, times 2^k.

__constant__ unsigned long long SP_INV_FACT[14] = {
    0x3ff0000000000000ull, 0x3ff0000000000000ull, 0x3fe0000000000000ull, 0x3fc5555555555555ull,
    0x3fa5555555555555ull, 0x3f81111111111111ull, 0x3f56c16c16c16c17ull, 0x3f2a01a01a01a01aull,
    0x3efa01a01a01a01aull, 0x3ec71de3a556c734ull, 0x3e927e4fb7789f5cull, 0x3e5ae64567f544e4ull,
    0x3e21eed8eff8d898ull, 0x3de6124613a86d09ull};

__device__ __forceinline__ double sp_det_exp(double x) {
    if (x != x) return x;
    if (x <= -708.0) return 0.0;
    if (x >= 709.0) return __longlong_as_double(0x7ff0000000000000ll);
    const double k = round(__dmul_rn(x, __longlong_as_double(0x3ff71547652b82fell)));
    const double hi = __dsub_rn(x, __dmul_rn(k, __longlong_as_double(0x3fe62e42fee00000ll)));
    const double r = __dsub_rn(hi, __dmul_rn(k, __longlong_as_double(0x3dea39ef35793c76ll)));
    double p = __longlong_as_double((long long)SP_INV_FACT[13]);
#pragma unroll
    for (int n = 12; n >= 0; n--) p = __dadd_rn(__dmul_rn(p, r), __longlong_as_double((long long)SP_INV_FACT[n]));
    return __dmul_rn(p, __longlong_as_double(((long long)k + 1023ll) << 52));
}

// ---- block reductions (blockDim.x == SP_THREADS) ----

__device__ double sp_sum_d(double v, double* red) {
    v = warp_sum_d(v);
    __syncthreads();
    if ((threadIdx.x & 31) == 0) red[threadIdx.x >> 5] = v;
    __syncthreads();
    double t = 0.0;
    for (int w = 0; w < SP_THREADS / 32; w++) t += red[w];
    return t;
}
__device__ float sp_max_f(float v, float* red) {
    v = warp_max(v);
    __syncthreads();
    if ((threadIdx.x & 31) == 0) red[threadIdx.x >> 5] = v;
    __syncthreads();
    float t = NEG_INF;
    for (int w = 0; w < SP_THREADS / 32; w++) t = fmaxf(t, red[w]);
    return t;
}
__device__ u32 sp_sum_u(u32 v, u32* red) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    __syncthreads();
    if ((threadIdx.x & 31) == 0) red[threadIdx.x >> 5] = v;
    __syncthreads();
    u32 t = 0;
    for (int w = 0; w < SP_THREADS / 32; w++) t += red[w];
    return t;
}
__device__ u32 sp_min_u(u32 v, u32* red) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v = min(v, __shfl_xor_sync(0xffffffffu, v, o));
    __syncthreads();
    if ((threadIdx.x & 31) == 0) red[threadIdx.x >> 5] = v;
    __syncthreads();
    u32 t = 0xffffffffu;
    for (int w = 0; w < SP_THREADS / 32; w++) t = min(t, red[w]);
    return t;
}
__device__ u32 sp_or_u(u32 v, u32* red) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v |= __shfl_xor_sync(0xffffffffu, v, o);
    __syncthreads();
    if ((threadIdx.x & 31) == 0) red[threadIdx.x >> 5] = v;
    __syncthreads();
    u32 t = 0;
    for (int w = 0; w < SP_THREADS / 32; w++) t |= red[w];
    return t;
}

// ---- exact radix select of the k largest nonzero keys ----

struct SpSel {
    u32 hist[256];
    u32 digit, krem, done, cnt;
};

// Adds `key`'s digit at `shift` to the histogram when it matches the prefix. Every lane of the
// warp must call this together (warp-aggregated atomics).
__device__ __forceinline__ void sp_count(SpSel& s, u64 key, u64 prefix, u64 mask, int shift) {
    bool m = key != 0 && (key & mask) == prefix;
    u32 d = m ? ((u32)(key >> shift) & 255u) : 256u;
    u32 peers = __match_any_sync(0xffffffffu, d);
    if (m && (int)(threadIdx.x & 31) == __ffs(peers) - 1) atomicAdd(&s.hist[d], (u32)__popc(peers));
}

// Warp 0: the digit holding the krem-th largest matching key.
__device__ void sp_pick(SpSel& s) {
    const int lane = threadIdx.x & 31;
    u32 c[8];
    u32 sum = 0;
#pragma unroll
    for (int j = 0; j < 8; j++) {
        c[j] = s.hist[lane * 8 + j];
        sum += c[j];
    }
    u32 incl = sum;
#pragma unroll
    for (int o = 1; o < 32; o <<= 1) {
        u32 t = __shfl_down_sync(0xffffffffu, incl, o);
        if (lane + o < 32) incl += t;
    }
    const u32 above = incl - sum;
    const u32 k = s.krem;
    __syncwarp();
    if (above < k && k <= incl) {
        u32 acc = above;
        for (int j = 7; j >= 0; j--) {
            if (acc + c[j] >= k) {
                s.digit = lane * 8 + j;
                s.krem = k - acc;
                s.done = (c[j] == k - acc) ? 1u : 0u;
                break;
            }
            acc += c[j];
        }
    }
}

// Finds (prefix, mask) such that the selected keys are exactly the nonzero keys with
// (key & mask) >= prefix, k of them (1 <= k <= number of nonzero keys). `count(shift, prefix,
// mask)` must call sp_count for every key the thread holds.
template <class F>
__device__ void sp_select(SpSel& s, u32 k, F count, u64& prefix, u64& mask) {
    prefix = 0;
    mask = 0;
    for (int shift = 56; shift >= 0; shift -= 8) {
        for (int i = threadIdx.x; i < 256; i += SP_THREADS) s.hist[i] = 0;
        if (threadIdx.x == 0 && shift == 56) s.krem = k;
        __syncthreads();
        // Every thread has read the previous pass's digit by now.
        if (threadIdx.x == 0) s.digit = 0xffffffffu;
        count(shift, prefix, mask);
        __syncthreads();
        if (threadIdx.x < 32) sp_pick(s);
        __syncthreads();
        if (s.digit > 255u) {
            // Fewer matching keys than asked (cannot happen for valid input): select none;
            // the callers' counts then disagree and the host reduces the row.
            prefix = ~0ull;
            mask = ~0ull;
            break;
        }
        prefix |= (u64)s.digit << shift;
        mask |= (u64)0xff << shift;
        if (s.done) break;
    }
    __syncthreads();
}

__device__ __forceinline__ bool sp_selected(u64 key, u64 prefix, u64 mask) { return key != 0 && (key & mask) >= prefix; }

// The index among the row's `got` leading candidates (final logits `zs`, candidate order) that
// the host's partial::finish + draw take with the row's uniform number; 0 without a uniform
// (the greedy pick) or for greedy rows; -1: no pick (the set is not all held, the uniform is
// out of range). Step for step draw_leading (minimax_shared::sampling::draw): the weights in
// parallel, every sum and walk in order by thread 0. Every thread of the block calls it with
// the same arguments; `wp`, `wd`: SP_KMAX doubles of shared scratch; `res`: one shared int.
__device__ int sp_draw_leading(const float* zs, u32 got, u32 nfin, const u32* P, double* wp, double* wd, int* res) {
    const u64 ub = ((u64)P[P_U_HI] << 32) | (u64)P[P_U_LO];
    const float temp = __uint_as_float(P[P_TEMP]);
    if (got == 0) return -1;
    if (ub == ~0ull) return 0;
    const double u = __longlong_as_double((long long)ub);
    if (!(u >= 0.0 && u < 1.0) || temp != temp) return -1;
    if (temp <= 0.0f) return 0;
    const u32 k = min(P[P_KC], nfin);
    if (k == 0 || k > got) return -1;
    const float zmax = zs[0];
    const double dmax = (double)zmax;
    const float top_p = __uint_as_float(P[P_TOPP]);
    const bool cut_p = top_p > 0.0f && top_p < 1.0f;
    for (u32 t = threadIdx.x; t < k; t += SP_THREADS) {
        if (cut_p) wp[t] = sp_det_exp((double)__fsub_rn(zs[t], zmax));
        wd[t] = sp_det_exp(__dsub_rn((double)zs[t], dmax));
    }
    __syncthreads();
    if (threadIdx.x == 0) {
        u32 keep = k;
        if (cut_p) {
            double total = 0.0;
            for (u32 i = 0; i < k; i++) total = __dadd_rn(total, wp[i]);
            const double target = __dmul_rn((double)top_p, total);
            double acc = 0.0;
            for (u32 i = 0; i < k; i++) {
                acc = __dadd_rn(acc, wp[i]);
                if (acc >= target) {
                    keep = i + 1;
                    break;
                }
            }
        }
        if (P[P_MINP_LN] != 0xffffffffu) {
            const float floor_ln = __uint_as_float(P[P_MINP_LN]);
            u32 n = 0;
            while (n < keep && __fsub_rn(zs[n], zmax) >= floor_ln) n++;
            keep = max(n, 1u);
        }
        int at = 0;
        if (keep > 1) {
            if (!isfinite(dmax)) {
                at = -1;
            } else {
                double total = 0.0;
                for (u32 i = 0; i < keep; i++) total = __dadd_rn(total, wd[i]);
                const double target = __dmul_rn(u, total);
                double acc = 0.0;
                at = (int)keep - 1;
                for (u32 i = 0; i < keep; i++) {
                    acc = __dadd_rn(acc, wd[i]);
                    if (target < acc) {
                        at = (int)i;
                        break;
                    }
                }
            }
        }
        *res = at;
    }
    __syncthreads();
    return *res;
}

// ---- kernels ----

extern "C" __global__ void samp_penalty(const float* __restrict__ logits, i64 stride, int vocab, const u32* __restrict__ params,
                                        const u32* __restrict__ touch, float* __restrict__ tz, u32* __restrict__ bitmap) {
    const int r = blockIdx.x;
    const u32* P = params + r * SP_PW;
    const float* row = logits + (i64)P[P_SRC_ROW] * stride;
    const int off = P[P_TOFF], len = P[P_TLEN];
    const float rep = __uint_as_float(P[P_REP]), freq = __uint_as_float(P[P_FREQ]), pres = __uint_as_float(P[P_PRES]);
    u32* bits = bitmap + (i64)r * ((vocab + 31) / 32);
    for (int e = threadIdx.x; e < len; e += blockDim.x) {
        const u32* t = touch + (i64)(off + e) * SP_TW;
        const u32 tok = t[0], cnt = t[1];
        float z = row[tok];
        if (cnt > 0) {
            if (rep != 1.0f) z = z > 0.0f ? __fdiv_rn(z, rep) : __fmul_rn(z, rep);
            z = __fsub_rn(z, __fadd_rn(__fmul_rn(freq, __uint2float_rn(cnt)), pres));
        }
        if (t[3]) z = __fadd_rn(z, __uint_as_float(t[2]));
        tz[off + e] = z;
        atomicOr(&bits[tok >> 5], 1u << (tok & 31));
    }
}

// bstat per (row, chunk): raw max, raw sum of exp(raw - max), n_finite, nan min index, flags.
#define SP_BS 5

extern "C" __global__ void __launch_bounds__(SP_THREADS) samp_chunk(
    const float* __restrict__ logits, i64 stride, int vocab, const u32* __restrict__ params, const u32* __restrict__ touch,
    const float* __restrict__ tz, const u32* __restrict__ bitmap, double* __restrict__ bstat, u64* __restrict__ raw_keys,
    u64* __restrict__ cand_keys, int kcap) {
    __shared__ SpSel s;
    __shared__ double red_d[32];
    __shared__ float red_f[32];
    __shared__ u32 red_u[32];
    const int blk = blockIdx.x, nb = gridDim.x, r = blockIdx.y, tid = threadIdx.x;
    const u32* P = params + r * SP_PW;
    const float* row = logits + (i64)P[P_SRC_ROW] * stride;
    const u32* bits = bitmap + (i64)r * ((vocab + 31) / 32);
    const u32* tt = touch + (i64)P[P_TOFF] * SP_TW;
    const float* tzr = tz + P[P_TOFF];
    const int tlen = P[P_TLEN];
    const float temp = __uint_as_float(P[P_TEMP]);
    const int base = blk * SP_CHUNK;
    const u32* amask = sp_mask(params, P);

    float rv[SP_NPT], zv[SP_NPT];
    u32 zok = 0, nfin = 0, nan_min = 0xffffffffu, flags = 0;
    float m = NEG_INF;
#pragma unroll
    for (int j = 0; j < SP_NPT; j++) {
        const int i = base + j * SP_THREADS + tid;
        rv[j] = __int_as_float(0x7fffffff);
        zv[j] = 0.0f;
        if (i < vocab) {
            const float x = row[i];
            rv[j] = x;
            if (x != x) {
                nan_min = min(nan_min, (u32)i);
            } else {
                m = fmaxf(m, x);
                if (x == POS_INF) flags |= F_RAW_INF;
            }
            const float z = sp_z(row, i, bits, tt, tzr, tlen, amask);
            if (z > NEG_INF) {
                const float zt = sp_final(z, temp);
                if (!(zt > NEG_INF && zt < POS_INF)) flags |= F_ZT_INF;
                zv[j] = zt;
                zok |= 1u << j;
                nfin++;
            }
        }
    }
    m = sp_max_f(m, red_f);
    double sum = 0.0;
    if (m > NEG_INF) {
#pragma unroll
        for (int j = 0; j < SP_NPT; j++)
            if (rv[j] == rv[j]) sum += (double)expf(__fsub_rn(rv[j], m));
    }
    sum = sp_sum_d(sum, red_d);
    const u32 nfin_b = sp_sum_u(nfin, red_u);
    nan_min = sp_min_u(nan_min, red_u);
    flags = sp_or_u(flags, red_u);
    if (tid == 0) {
        double* b = bstat + ((i64)r * nb + blk) * SP_BS;
        b[0] = (double)m;
        b[1] = sum;
        b[2] = (double)nfin_b;
        b[3] = (double)nan_min;
        b[4] = (double)flags;
    }
    if (nan_min != 0xffffffffu || flags != 0) return;  // the host reduces this row

    // Raw top-T.
    const u32 T = P[P_T];
    if (T > 0) {
        u64* out = raw_keys + ((i64)r * nb + blk) * SP_MAX_TOP;
        const int nvalid = min(SP_CHUNK, vocab - base);
        const u32 kk = min(T, (u32)nvalid);
        for (int q = tid; q < (int)T; q += SP_THREADS) out[q] = 0;
        u64 prefix, mask;
        auto count = [&](int shift, u64 pf, u64 mk) {
#pragma unroll
            for (int j = 0; j < SP_NPT; j++) {
                const int i = base + j * SP_THREADS + tid;
                sp_count(s, i < vocab ? sp_key(rv[j], i) : 0ull, pf, mk, shift);
            }
        };
        sp_select(s, kk, count, prefix, mask);
        if (tid == 0) s.cnt = 0;
        __syncthreads();
#pragma unroll
        for (int j = 0; j < SP_NPT; j++) {
            const int i = base + j * SP_THREADS + tid;
            const u64 key = i < vocab ? sp_key(rv[j], i) : 0ull;
            if (sp_selected(key, prefix, mask)) {
                const u32 slot = atomicAdd(&s.cnt, 1u);
                if (slot < kk) out[slot] = key;
            }
        }
        __syncthreads();
    }
    // Candidate top-K.
    const u32 K = P[P_KC];
    if (K > 0) {
        u64* out = cand_keys + ((i64)r * nb + blk) * kcap;
        const u32 kk = min(K, nfin_b);
        for (int q = tid; q < (int)K; q += SP_THREADS) out[q] = 0;
        if (kk == 0) return;
        u64 prefix, mask;
        auto count = [&](int shift, u64 pf, u64 mk) {
#pragma unroll
            for (int j = 0; j < SP_NPT; j++) {
                const int i = base + j * SP_THREADS + tid;
                sp_count(s, ((zok >> j) & 1u) ? sp_key(zv[j], i) : 0ull, pf, mk, shift);
            }
        };
        sp_select(s, kk, count, prefix, mask);
        if (tid == 0) s.cnt = 0;
        __syncthreads();
#pragma unroll
        for (int j = 0; j < SP_NPT; j++) {
            const int i = base + j * SP_THREADS + tid;
            const u64 key = ((zok >> j) & 1u) ? sp_key(zv[j], i) : 0ull;
            if (sp_selected(key, prefix, mask)) {
                const u32 slot = atomicAdd(&s.cnt, 1u);
                if (slot < kk) out[slot] = key;
            }
        }
    }
}

// Merges `n` keys laid out as `per` keys per chunk (stride `cstride`) into the k largest,
// sorted descending into sel[0..k). Returns k (<= kmax).
template <int KMAXT>
__device__ u32 sp_merge_keys(SpSel& s, const u64* keys, int nb, int per, int cstride, u32 kmax, u64* sel, u32* red_u) {
    const int n = nb * per;
    const int iters = (n + SP_THREADS - 1) / SP_THREADS;
    auto load = [&](int q) -> u64 { return q < n ? keys[(i64)(q / per) * cstride + (q % per)] : 0ull; };
    u32 nz = 0;
    for (int it = 0; it < iters; it++) nz += load(it * SP_THREADS + threadIdx.x) != 0 ? 1u : 0u;
    nz = sp_sum_u(nz, red_u);
    u32 k = min(kmax, nz);
    if (k == 0) return 0;
    u64 prefix, mask;
    auto count = [&](int shift, u64 pf, u64 mk) {
        for (int it = 0; it < iters; it++) sp_count(s, load(it * SP_THREADS + threadIdx.x), pf, mk, shift);
    };
    sp_select(s, k, count, prefix, mask);
    if (threadIdx.x == 0) s.cnt = 0;
    __syncthreads();
    for (int it = 0; it < iters; it++) {
        const u64 key = load(it * SP_THREADS + threadIdx.x);
        if (sp_selected(key, prefix, mask)) {
            const u32 slot = atomicAdd(&s.cnt, 1u);
            if (slot < k) sel[KMAXT + slot] = key;
        }
    }
    __syncthreads();
    // Fewer than k only if the select failed (the host then sees the count and declines).
    const u32 got = min(k, s.cnt);
    __syncthreads();
    k = got;
    // Rank sort (keys are distinct): position = number of larger keys.
    for (u32 t = threadIdx.x; t < k; t += SP_THREADS) {
        const u64 key = sel[KMAXT + t];
        u32 rank = 0;
        for (u32 j = 0; j < k; j++) rank += sel[KMAXT + j] > key ? 1u : 0u;
        sel[rank] = key;
    }
    __syncthreads();
    return k;
}

extern "C" __global__ void __launch_bounds__(SP_THREADS) samp_merge(
    const float* __restrict__ logits, i64 stride, int vocab, int nb, const u32* __restrict__ params, const u32* __restrict__ touch,
    const float* __restrict__ tz, const u32* __restrict__ bitmap, const double* __restrict__ bstat, const u64* __restrict__ raw_keys,
    const u64* __restrict__ cand_keys, int kcap, u32* out, int* __restrict__ picks, int npicks, int pick_off) {
    __shared__ SpSel s;
    __shared__ u64 sel[2 * SP_KMAX];
    __shared__ u32 red_u[32];
    __shared__ u32 row_ok, row_nfin;
    __shared__ float zs[SP_KMAX];
    __shared__ double wp[SP_KMAX], wd[SP_KMAX];
    __shared__ int drawn_at;
    const int r = blockIdx.x, tid = threadIdx.x;
    const u32* P = params + r * SP_PW;
    const float* row = logits + (i64)P[P_SRC_ROW] * stride;
    u32* H = out + (i64)r * SP_HDR;
    const double* bs = bstat + (i64)r * nb * SP_BS;
    if (tid == 0) {
        double M = SP_DNEG_INF, S = 0.0, nfin = 0.0, nan_min = 4294967295.0;
        u32 flags = 0;
        for (int b = 0; b < nb; b++) M = fmax(M, bs[b * SP_BS]);
        for (int b = 0; b < nb; b++) {
            const double* x = bs + b * SP_BS;
            if (x[0] > SP_DNEG_INF) S += x[1] * exp(x[0] - M);
            nfin += x[2];
            nan_min = fmin(nan_min, x[3]);
            flags |= (u32)x[4];
        }
        const float lse = M > SP_DNEG_INF ? (float)(M + log(S)) : NEG_INF;
        H[H_NAN] = (u32)nan_min;
        H[H_FLAGS] = flags;
        H[H_LSE] = __float_as_uint(lse);
        H[H_NFIN] = (u32)nfin;
        const int tg = (int)P[P_TARGET];
        H[H_TARGET] = tg >= 0 ? __float_as_uint(row[tg]) : 0u;
        H[H_ZMAX] = 0u;
        H[H_NCAND] = 0u;
        H[H_NTOP] = 0u;
        row_ok = (u32)nan_min == 0xffffffffu && flags == 0;
        row_nfin = (u32)nfin;
    }
    // Broadcast through shared memory: a global value written by thread 0 and read back by the
    // others after the barrier is not safe here (nvcc hoisted that load above the barrier, so
    // the other threads read the stale header and left thread 0 to run the selects alone).
    __syncthreads();
    // The draw for overlapped decode's device-fed tokens (every row; the host decides which
    // rows feed one): none until the candidates below are known.
    if (tid == 0 && picks != nullptr && r < npicks) {
        picks[r] = -1;
        out[pick_off + r] = 0xffffffffu;
    }
    if (!row_ok) return;
    const u32 T = P[P_T];
    if (T > 0) {
        const u32 k = sp_merge_keys<SP_KMAX>(s, raw_keys + (i64)r * nb * SP_MAX_TOP, nb, T, SP_MAX_TOP, T, sel, red_u);
        for (u32 t = tid; t < k; t += SP_THREADS) {
            const u32 id = min(sp_key_id(sel[t]), (u32)vocab - 1);
            H[H_TOP_IDS + t] = id;
            H[H_TOP_RAW + t] = __float_as_uint(row[id]);
        }
        if (tid == 0) H[H_NTOP] = k;
        __syncthreads();
    }
    const u32 K = P[P_KC];
    if (K > 0) {
        const u32 k = sp_merge_keys<SP_KMAX>(s, cand_keys + (i64)r * nb * kcap, nb, K, kcap, K, sel, red_u);
        const u32* bits = bitmap + (i64)r * ((vocab + 31) / 32);
        const u32* tt = touch + (i64)P[P_TOFF] * SP_TW;
        const float* tzr = tz + P[P_TOFF];
        const float temp = __uint_as_float(P[P_TEMP]);
        const u32* amask = sp_mask(params, P);
        u32* ids = out + P[P_OUT_OFF];
        u32* vals = ids + K;
        u32* raws = vals + K;
        for (u32 t = tid; t < k; t += SP_THREADS) {
            const u32 id = min(sp_key_id(sel[t]), (u32)vocab - 1);
            const float zt = sp_final(sp_z(row, id, bits, tt, tzr, P[P_TLEN], amask), temp);
            ids[t] = id;
            vals[t] = __float_as_uint(zt);
            raws[t] = __float_as_uint(row[id]);
            zs[t] = zt;
            if (t == 0) H[H_ZMAX] = __float_as_uint(zt);
        }
        if (tid == 0) H[H_NCAND] = k;
        if (picks != nullptr && r < npicks) {
            __syncthreads();
            const int at = sp_draw_leading(zs, k, row_nfin, P, wp, wd, &drawn_at);
            if (tid == 0 && at >= 0) {
                const u32 id = min(sp_key_id(sel[at]), (u32)vocab - 1);
                picks[r] = (int)id;
                out[pick_off + r] = id;
            }
        }
    }
}

extern "C" __global__ void __launch_bounds__(SP_THREADS) samp_total(
    const float* __restrict__ logits, i64 stride, int vocab, const u32* __restrict__ params, const u32* __restrict__ touch,
    const float* __restrict__ tz, const u32* __restrict__ bitmap, const u32* __restrict__ hdr, double* __restrict__ totals) {
    __shared__ double red_d[32];
    const int blk = blockIdx.x, nb = gridDim.x, r = blockIdx.y, tid = threadIdx.x;
    const u32* P = params + r * SP_PW;
    if (!P[P_NEED_TOTAL]) return;
    const u32* H = hdr + (i64)r * SP_HDR;
    double acc = 0.0;
    if (H[H_NAN] == 0xffffffffu && H[H_FLAGS] == 0 && H[H_NCAND] > 0) {
        const float* row = logits + (i64)P[P_SRC_ROW] * stride;
        const u32* bits = bitmap + (i64)r * ((vocab + 31) / 32);
        const u32* tt = touch + (i64)P[P_TOFF] * SP_TW;
        const float* tzr = tz + P[P_TOFF];
        const int tlen = P[P_TLEN];
        const float temp = __uint_as_float(P[P_TEMP]);
        const float zmax = __uint_as_float(H[H_ZMAX]);
        const int base = blk * SP_CHUNK;
        const u32* amask = sp_mask(params, P);
#pragma unroll
        for (int j = 0; j < SP_NPT; j++) {
            const int i = base + j * SP_THREADS + tid;
            if (i < vocab) {
                const float z = sp_z(row, i, bits, tt, tzr, tlen, amask);
                if (z > NEG_INF) acc += sp_det_exp((double)__fsub_rn(sp_final(z, temp), zmax));
            }
        }
    }
    acc = sp_sum_d(acc, red_d);
    if (tid == 0) totals[(i64)r * nb + blk] = acc;
}
