// K-quant (Q4_K, Q6_K) kernels of the fast decode path: the same contracts as fast.cu's mvq_* /
// moe_gate_up_* / moe_down_* (q8 activations: per 32 values an f32 scale and int8 codes, as
// norm_q8 writes them; dp4a products scaled and accumulated in f32), for the weights of
// Q4_K_M files. Host side: rank-worker/src/cuda/fast_kq.rs.
//
// Layouts (ggml block_q4_K / block_q6_K, 256 values per super-block):
//   Q4_K (144 bytes): d f16 @0, dmin f16 @2, 12 bytes of packed 6-bit (scale, min) for the
//     eight 32-value sub-blocks @4, 128 bytes of nibbles @16: byte 32 g + l holds value
//     64 g + l (low nibble, sub-block 2 g) and 64 g + 32 + l (high nibble, sub-block 2 g + 1).
//     value = d * sc[j] * q - dmin * m[j].
//   Q6_K (210 bytes): ql[128] @0, qh[64] @128, 16 int8 scales @192, d f16 @208. Value
//     e = 128 g + 32 k + l: low 4 bits = ql[64 g + 32 (k & 1) + l] >> (4 (k >> 1)), high 2 bits
//     = qh[32 g + l] >> (2 k), q = that 6-bit value - 32, value = d * scales[e / 16] * q.
//
// A "unit" is 16 weight bytes' worth of work, 8 per super-block for both types:
//   Q4_K unit (g, h): nibble bytes 32 g + 16 h .. +16: 16 values of sub-block 2 g (columns
//     64 g + 16 h + i) and 16 of sub-block 2 g + 1 (columns + 32). Per token: two 4-dp4a code
//     sums and two 4-dp4a activation sums (the min term needs sum(x) over the 16 columns:
//     dp4a against 0x01010101).
//   Q6_K unit (g, kp, h): ql bytes 64 g + 32 kp + 16 h .. +16 and qh bytes 32 g + 16 h .. +16:
//     16 values of k = kp (columns 128 g + 32 kp + 16 h + i) and 16 of k = kp + 2 (+64); codes
//     rebuilt as signed int8 4 (6 bits - 32) (bit operations only), two 4-dp4a sums per token.
//
// Weight rows are staged per warp into shared memory with 16-byte cp.async copies (L1 bypassed,
// no registers held, a whole phase in flight) and double-buffered: phase n + 1 is in flight while
// phase n is dotted (cp.async groups). Q6_K rows (210-byte blocks) start at any even address, so
// each staged segment keeps its address modulo 16: the aligned 16-byte pieces inside the segment
// go by cp.async, the (at most two) partial pieces at its ends by 2-byte loads (never a byte
// outside the segment is read), and lanes read 16 bytes at any even shared-memory address as
// five aligned words realigned with funnel shifts. Segments must start at an even address and
// have an even length (the host checks); any multiple of 256 columns is accepted.

// Programmatic dependent launch, as fast.cu's pdl_enter (these kernels are launched with
// Gpu::launch_pdl): wait for the previous kernel, then let the next one be scheduled.
__device__ __forceinline__ void kq_pdl_enter() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    asm volatile("griddepcontrol.wait;" ::: "memory");
    asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
#endif
}

template <int T> struct KqT;
template <> struct KqT<T_Q4_K> { static const int BB = 144; };
template <> struct KqT<T_Q6_K> { static const int BB = 210; };

// Bytes of one staged slot for segments of up to PB super-blocks: the data lands at
// slot + (src & 15) and the word reads may run 4 bytes past its end.
#define KQ_SLOT(T, PB) ((((PB) * KqT<T>::BB + 15) / 16) * 16 + 32)

__device__ __forceinline__ void kq_cp16(void* smem, const void* gmem) {
    u32 s;
    asm volatile("{ .reg .u64 a; cvta.to.shared.u64 a, %1; cvt.u32.u64 %0, a; }" : "=r"(s) : "l"(smem));
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16;" ::"r"(s), "l"(gmem) : "memory");
}
__device__ __forceinline__ void kq_commit() { asm volatile("cp.async.commit_group;" ::: "memory"); }
template <int N> __device__ __forceinline__ void kq_wait() { asm volatile("cp.async.wait_group %0;" ::"n"(N) : "memory"); }

// Issues the copy of segment [src, src + n) (src and n even, n >= 32) into slot (16-byte
// aligned shared memory) by the warp; the data lands at slot + (src & 15). The caller commits
// the group. Returns the staged data's address.
__device__ __forceinline__ const u8* kq_issue(u8* slot, const u8* src, int n, int lane) {
    u64 s = (u64)src, e = s + (u64)n, g0 = s & ~15ull, g1 = (e + 15) & ~15ull;
    int np = (int)((g1 - g0) >> 4);
    int i0 = s == g0 ? 0 : 1;            // piece 0 is partial when src is not 16-byte aligned
    int i1 = (e & 15) == 0 ? np : np - 1;  // so is the last one when the end is not
    for (int i = i0 + lane; i < i1; i += 32) kq_cp16(slot + 16 * i, (const void*)(g0 + 16 * (u64)i));
    if (lane == 0 && i0 == 1) {
        u64 hi = e < g0 + 16 ? e : g0 + 16;
        for (u64 a = s; a < hi; a += 2) *(u16*)(slot + (a - g0)) = __ldg((const unsigned short*)a);
    }
    if (lane == 1 && i1 == np - 1) {
        u64 lo = s > g1 - 16 ? s : g1 - 16;
        for (u64 a = lo; a < e; a += 2) *(u16*)(slot + (a - g0)) = __ldg((const unsigned short*)a);
    }
    return slot + (s - g0);
}
// Where kq_issue put the data of segment src in slot.
__device__ __forceinline__ const u8* kq_data(const u8* slot, const u8* src) { return slot + ((u64)src & 15); }

// 16 bytes at an even shared-memory address as 4 little-endian words.
__device__ __forceinline__ void kq_ld16(const u8* p, u32 (&w)[4]) {
    int sh = (int)((u64)p & 3);
    const u32* q = (const u32*)(p - sh);
    u32 v[5];
#pragma unroll
    for (int i = 0; i < 5; i++) v[i] = q[i];
#pragma unroll
    for (int i = 0; i < 4; i++) w[i] = __funnelshift_r(v[i], v[i + 1], 8 * sh);
}

// (scale, min) of Q4_K sub-block j from the 12 packed bytes s (get_scale_min_k4).
__device__ __forceinline__ void kq_scmin(const u8* s, int j, int& sc, int& m) {
    if (j < 4) {
        sc = s[j] & 63;
        m = s[j + 4] & 63;
    } else {
        sc = (s[j + 4] & 15) | ((s[j - 4] >> 6) << 4);
        m = (s[j + 4] >> 4) | ((s[j] >> 6) << 4);
    }
}

// The first columns ca / cb of unit u's two 16-column halves (colb = its super-block's first), as
// kq_unit_codes sets them (which computes them from its own unit fields).
template <int T>
__device__ __forceinline__ void kq_unit_cols(int u, int colb, int& ca, int& cb) {
    if (T == T_Q4_K) {
        ca = colb + 64 * (u >> 1) + 16 * (u & 1);
        cb = ca + 32;
    } else {
        ca = colb + 128 * (u >> 2) + 32 * ((u >> 1) & 1) + 16 * (u & 1);
        cb = ca + 64;
    }
}
// Unit u (0..7) of the staged super-block blk, decoded: codes qa / qb (int8) of its two 16-column
// halves, their scales fa / fb (and Q4_K mins ma / mb; the caller zeroes them for Q6_K), their
// first columns ca / cb (colb = the super-block's first column).
template <int T>
__device__ __forceinline__ void kq_unit_codes(const u8* blk, int u, int colb, int (&qa)[4], int (&qb)[4], float& fa,
                                              float& fb, float& ma, float& mb, int& ca, int& cb) {
    if (T == T_Q4_K) {
        int g = u >> 1, h = u & 1;
        float d = f16_to_f32(*(const u16*)blk), dm = f16_to_f32(*(const u16*)(blk + 2));
        int s0, m0, s1, m1;
        kq_scmin(blk + 4, 2 * g, s0, m0);
        kq_scmin(blk + 4, 2 * g + 1, s1, m1);
        fa = d * (float)s0;
        ma = dm * (float)m0;
        fb = d * (float)s1;
        mb = dm * (float)m1;
        u32 w[4];
        kq_ld16(blk + 16 + 32 * g + 16 * h, w);
#pragma unroll
        for (int i = 0; i < 4; i++) {
            qa[i] = (int)(w[i] & 0x0F0F0F0Fu);
            qb[i] = (int)((w[i] >> 4) & 0x0F0F0F0Fu);
        }
        ca = colb + 64 * g + 16 * h;
        cb = ca + 32;
    } else {
        int g = u >> 2, kp = (u >> 1) & 1, h = u & 1;
        float d = f16_to_f32(*(const u16*)(blk + 208));
        const i8* sc = (const i8*)(blk + 192);
        // The codes as 4 (v - 32) (v = the 6-bit value): the 4 low bits at bits 5:2 and the 2 high
        // bits at 7:6 of each byte give 4 v, and 4 v - 128 is that byte with bit 7 flipped (no
        // per-byte subtraction: __vsub4 is several ALU instructions on sm_90). The dots come out
        // 4x and the scales take the 1/4: fa / 4 and 4 sa are exact, so fa * sa is the same f32.
        fa = d * (float)sc[8 * g + 2 * kp + h] * 0.25f;
        fb = d * (float)sc[8 * g + 2 * kp + 4 + h] * 0.25f;
        u32 wl[4], wh[4];
        kq_ld16(blk + 64 * g + 32 * kp + 16 * h, wl);
        kq_ld16(blk + 128 + 32 * g + 16 * h, wh);
        const int sha = 6 - 2 * kp, shb = 2 - 2 * kp;  // qh bits 2 kp + {0, 1} / + {4, 5} -> 7:6
#pragma unroll
        for (int i = 0; i < 4; i++) {
            const u32 la = (wl[i] << 2) & 0x3C3C3C3Cu, lb = (wl[i] >> 2) & 0x3C3C3C3Cu;
            const u32 ha = (wh[i] << sha) & 0xC0C0C0C0u, hb = (wh[i] << shb) & 0xC0C0C0C0u;
            qa[i] = (int)((la | ha) ^ 0x80808080u);
            qb[i] = (int)((lb | hb) ^ 0x80808080u);
        }
        ca = colb + 128 * g + 32 * kp + 16 * h;
        cb = ca + 64;
    }
}

// acc += a decoded unit (kq_unit_codes) . one token's activations at its columns (xa / xb: the
// int8 codes of columns ca / cb, da / db: their q8 scales).
template <int T>
__device__ __forceinline__ void kq_unit_dot(const int (&qa)[4], const int (&qb)[4], float fa, float fb, float ma,
                                            float mb, int4 xa, int4 xb, float da, float db, float& acc) {
    int sa = __dp4a(qa[0], xa.x, 0);
    sa = __dp4a(qa[1], xa.y, sa);
    sa = __dp4a(qa[2], xa.z, sa);
    sa = __dp4a(qa[3], xa.w, sa);
    int sb = __dp4a(qb[0], xb.x, 0);
    sb = __dp4a(qb[1], xb.y, sb);
    sb = __dp4a(qb[2], xb.z, sb);
    sb = __dp4a(qb[3], xb.w, sb);
    if (T == T_Q4_K) {
        const int one = 0x01010101;
        int za = __dp4a(one, xa.x, 0);
        za = __dp4a(one, xa.y, za);
        za = __dp4a(one, xa.z, za);
        za = __dp4a(one, xa.w, za);
        int zb = __dp4a(one, xb.x, 0);
        zb = __dp4a(one, xb.y, zb);
        zb = __dp4a(one, xb.z, zb);
        zb = __dp4a(one, xb.w, zb);
        acc += da * (fa * (float)sa - ma * (float)za) + db * (fb * (float)sb - mb * (float)zb);
    } else {
        acc += da * (fa * (float)sa) + db * (fb * (float)sb);
    }
}

// acc[t] += unit u (0..7) of the staged super-block blk (first column colb of the row) . x[t]
// for t < nv; x[t] = xq + tk[t] * xqs (int8, 16-byte aligned), scales xd + tk[t] * xds.
template <int T, int NT>
__device__ __forceinline__ void kq_unit_tk(const u8* blk, int u, int colb, const i8* xq, i64 xqs, const float* xd,
                                           i64 xds, const int (&tk)[NT], int nv, float* acc) {
    int qa[4], qb[4];
    float fa, fb, ma = 0.f, mb = 0.f;
    int ca, cb;
    kq_unit_codes<T>(blk, u, colb, qa, qb, fa, fb, ma, mb, ca, cb);
#pragma unroll
    for (int t = 0; t < NT; t++) {
        if (t < nv) {
            const i8* x = xq + tk[t] * xqs;
            const float* xs = xd + tk[t] * xds;
            int4 xa = __ldg((const int4*)(x + ca)), xb = __ldg((const int4*)(x + cb));
            float da = __ldg(xs + (ca >> 5)), db = __ldg(xs + (cb >> 5));
            kq_unit_dot<T>(qa, qb, fa, fb, ma, mb, xa, xb, da, db, acc[t]);
        }
    }
}

// kq_unit_tk with x[t] = xq + t * xqs (tokens back to back).
template <int T, int NT>
__device__ __forceinline__ void kq_unit(const u8* blk, int u, int colb, const i8* xq, i64 xqs, const float* xd, i64 xds,
                                        int nv, float* acc) {
    int tk[NT];
#pragma unroll
    for (int t = 0; t < NT; t++) tk[t] = t;
    kq_unit_tk<T, NT>(blk, u, colb, xq, xqs, xd, xds, tk, nv, acc);
}

// This lane's units of nb staged super-blocks at data (first super-block = column colb).
template <int T, int NT>
__device__ __forceinline__ void kq_dot_staged_tk(const u8* data, int nb, int colb, const i8* xq, i64 xqs, const float* xd,
                                                 i64 xds, const int (&tk)[NT], int nv, float* acc, int lane) {
    const int BB = KqT<T>::BB;
    for (int u = lane; u < nb * 8; u += 32) {
        int b = u >> 3;
        kq_unit_tk<T, NT>(data + b * BB, u & 7, colb + 256 * b, xq, xqs, xd, xds, tk, nv, acc);
    }
}
template <int T, int NT>
__device__ __forceinline__ void kq_dot_staged(const u8* data, int nb, int colb, const i8* xq, i64 xqs, const float* xd,
                                              i64 xds, int nv, float* acc, int lane) {
    int tk[NT];
#pragma unroll
    for (int t = 0; t < NT; t++) tk[t] = t;
    kq_dot_staged_tk<T, NT>(data, nb, colb, xq, xqs, xd, xds, tk, nv, acc, lane);
}

// ------------------------------------------------------------ dense products ------------
// Up to three matrices sharing one q8 input (q, k, v), as fast.cu's mvq_*: row r of the launch
// is row r of segment 0, then 1, then 2; y[t][row] (+)= W row . x[t] for tokens
// t = blockIdx.y * NT + (0..NT) below nv. One warp per row, the row in phases of KQ_MV_PB
// super-blocks (double-buffered). nblk = super-blocks per row (ncol / 256); x rows ncol apart.
// grid (ceil(total_rows / KQ_MV_WARPS), ceil(nv / NT)), block 32 * KQ_MV_WARPS.
#define KQ_MV_WARPS 8
#define KQ_MV_PB 12
// One warp's pass over a row of nblk super-blocks in double-buffered phases of KQ_MV_PB
// (sm: the warp's two slots; phase n + 1 in flight while n is dotted): dot(data, nb, colb)
// per phase (its nb staged super-blocks at data, the first one column colb).
template <int T, class Dot>
__device__ __forceinline__ void kq_row_pass(u8 (*sm)[KQ_SLOT(T, KQ_MV_PB)], const u8* row, int nblk, int lane, Dot dot) {
    const int BB = KqT<T>::BB;
    int nph = (nblk + KQ_MV_PB - 1) / KQ_MV_PB;
    kq_issue(sm[0], row, min(KQ_MV_PB, nblk) * BB, lane);
    kq_commit();
    for (int ph = 0; ph < nph; ph++) {
        if (ph + 1 < nph) {
            int c1 = (ph + 1) * KQ_MV_PB;
            kq_issue(sm[(ph + 1) & 1], row + (i64)c1 * BB, min(KQ_MV_PB, nblk - c1) * BB, lane);
            kq_commit();
            kq_wait<1>();
        } else {
            kq_wait<0>();
        }
        __syncwarp();
        int c0 = ph * KQ_MV_PB;
        const u8* data = kq_data(sm[ph & 1], row + (i64)c0 * BB);
        dot(data, min(KQ_MV_PB, nblk - c0), 256 * c0);
        __syncwarp();  // every lane is done with this buffer before it is refilled
    }
}

template <int T, int NT>
__device__ __forceinline__ void kq_mv(const u8* W0, i64 rb0, int rows0, float* y0, i64 ys0, const u8* W1, i64 rb1,
                                      int rows1, float* y1, i64 ys1, const u8* W2, i64 rb2, int rows2, float* y2, i64 ys2,
                                      int nblk, const i8* xq, const float* xd, int ncol, int nv, int accumulate) {
    const int SLOT = KQ_SLOT(T, KQ_MV_PB);
    __shared__ __align__(16) u8 sm_all[KQ_MV_WARPS][2][SLOT];
    int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    int r = blockIdx.x * KQ_MV_WARPS + warp;
    int v0 = blockIdx.y * NT;
    MV_SEGMENT_OR_RETURN();  // no block-wide barrier below
    int nv_here = min(NT, nv - v0);
    const u8* row = W + (i64)r * rb;
    const i8* xqv = xq + (i64)v0 * ncol;
    const float* xdv = xd + (i64)v0 * (ncol / 32);
    float acc[NT];
#pragma unroll
    for (int t = 0; t < NT; t++) acc[t] = 0.f;
    kq_row_pass<T>(sm_all[warp], row, nblk, lane, [&](const u8* data, int nb, int colb) {
        kq_dot_staged<T, NT>(data, nb, colb, xqv, ncol, xdv, ncol / 32, nv_here, acc, lane);
    });
    mv_store<NT>(acc, y, ys, r, v0, nv_here, lane, accumulate);
}

// kq_mv for one token with RPW rows a warp, rows of at most KQ_MV_PB super-blocks (one
// phase; the host checks): every copy of the warp's rows is issued before the PDL wait (weights
// only, as fast.cu's mvqs_q8_rows), one slot a row instead of kq_mv's two a warp, so an SM holds
// twice the bytes in flight at the same shared memory (the Q6_K output head: 200,064 rows of
// 2,520 bytes). Per row the same call of kq_dot_staged as kq_mv: bit-identical.
// grid (ceil(total_rows / (KQ_MVR_WARPS RPW)), 1), block 32 KQ_MVR_WARPS.
#define KQ_MVR_WARPS 4
template <int T, int RPW>
__device__ __forceinline__ void kq_mv_rows(const u8* W0, i64 rb0, int rows0, float* y0, i64 ys0, const u8* W1, i64 rb1,
                                           int rows1, float* y1, i64 ys1, const u8* W2, i64 rb2, int rows2, float* y2,
                                           i64 ys2, int nblk, const i8* xq, const float* xd, int ncol, int accumulate) {
    const int SLOT = KQ_SLOT(T, KQ_MV_PB);
    __shared__ __align__(16) u8 sm_all[KQ_MVR_WARPS][RPW][SLOT];
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const int r0 = (blockIdx.x * KQ_MVR_WARPS + warp) * RPW;
    const u8* wr[RPW];
    const u8* data[RPW];
    float* yr[RPW];
    i64 ysr[RPW];
    int rr[RPW];
    bool ok[RPW];
#pragma unroll
    for (int j = 0; j < RPW; j++) {
        ok[j] = mv_seg_row(r0 + j, W0, rb0, rows0, y0, ys0, W1, rb1, rows1, y1, ys1, W2, rb2, rows2, y2, ys2, wr[j], rr[j],
                           yr[j], ysr[j]);
        data[j] = ok[j] ? kq_issue(sm_all[warp][j], wr[j], nblk * KqT<T>::BB, lane) : nullptr;
    }
    kq_commit();
    kq_pdl_enter();
    kq_wait<0>();
    __syncwarp();
#pragma unroll
    for (int j = 0; j < RPW; j++) {
        if (!ok[j]) continue;
        float acc[1] = {0.f};
        kq_dot_staged<T, 1>(data[j], nblk, 0, xq, ncol, xd, ncol / 32, 1, acc, lane);
        mv_store<1>(acc, yr[j], ysr[j], rr[j], 0, 1, lane, accumulate);
    }
}
#define KQ_MVR_INST(name, T)                                                                                      \
    extern "C" __global__ void __launch_bounds__(32 * KQ_MVR_WARPS) kq_mvr2_##name(                               \
        const u8* W0, i64 rb0, int rows0, float* y0, i64 ys0, const u8* W1, i64 rb1, int rows1, float* y1, i64 ys1,   \
        const u8* W2, i64 rb2, int rows2, float* y2, i64 ys2, int nblk, const i8* xq, const float* xd, int ncol,     \
        int nv, int acc) {                                                                                         \
        kq_mv_rows<T, 2>(W0, rb0, rows0, y0, ys0, W1, rb1, rows1, y1, ys1, W2, rb2, rows2, y2, ys2, nblk, xq, xd, ncol, \
                         acc);                                                                                     \
    }

#define KQ_MV_INST(name, T, nt)                                                                                    \
    extern "C" __global__ void __launch_bounds__(32 * KQ_MV_WARPS) kq_mv_##name##_##nt(                              \
        const u8* W0, i64 rb0, int rows0, float* y0, i64 ys0, const u8* W1, i64 rb1, int rows1, float* y1, i64 ys1,   \
        const u8* W2, i64 rb2, int rows2, float* y2, i64 ys2, int nblk, const i8* xq, const float* xd, int ncol,     \
        int nv, int acc) {                                                                                         \
        kq_pdl_enter();                                                                                            \
        kq_mv<T, nt>(W0, rb0, rows0, y0, ys0, W1, rb1, rows1, y1, ys1, W2, rb2, rows2, y2, ys2, nblk, xq, xd, ncol, nv, \
                     acc);                                                                                         \
    }

// kq_mvs_* (one token) / kq_mvs4_* (2-4 tokens, y rows ys apart): kq_mvr2 / kq_mv for one matrix
// of many rows (the Q6_K output head: 200,064 rows of 2,520 bytes) with the rows streamed
// through a ring. kq_mvr2's block holds its rows' shared memory
// from its launch until its dots are done, so the bytes an SM has in flight fall while blocks
// decode, and 25,008 blocks launch and leave (H200: 2.8 TB/s, against the Q8_0 head's 4.1).
// Here one block per SM: a producer thread streams the block's contiguous range of rows into
// a ring of stages (one cp.async.bulk a stage, issued before the PDL wait: weights only), and
// KS_CW consumer warps take a stage's rows (row j: warp j % KS_CW), each with kq_mv's per-row
// arithmetic (kq_dot_staged, then mv_store; for one token and 12 super-blocks its units one by
// one with the activations held in registers): bit-identical to kq_mvr2 and kq_mv.
// Host (fast_kq.rs, kq_stream_plan): sm_90 or newer; rows even, W and two rows' bytes 16-byte
// aligned, so every stage of an even number of rows is a whole 16-byte multiple; srows even.
// Dynamic shared memory KS_HDR + nst * srows * rb + KS_TAIL (kq_ld16 reads up to 4 bytes past a
// unit's 16: past the ring's end for a Q4_K row's last unit); grid <= one block per SM; block
// KS_THREADS.
#define KS_CW 16
#define KS_THREADS (32 * (KS_CW + 1))
#define KS_MAXST 8
#define KS_HDR 256  // full[KS_MAXST], empty[KS_MAXST]; the ring starts 16-byte aligned after them
#define KS_TAIL 32
template <int T, int NT>
__device__ __forceinline__ void kq_mv_stream(const u8* W, i64 rb, int rows, float* y, i64 ys, int nblk, const i8* xq,
                                             const float* xd, int ncol, int nv, int accumulate, int nst, int srows) {
#if BK_PTX
    extern __shared__ __align__(128) u8 ks_sm[];
    u64* full = (u64*)ks_sm;
    u64* empty = full + KS_MAXST;
    u8* ring = ks_sm + KS_HDR;
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    // The block's rows [r0, r1): an even count, so each stage's bytes are a 16-byte multiple.
    const int per = ((rows + (int)gridDim.x - 1) / (int)gridDim.x + 1) & ~1;
    const int r0 = min(rows, (int)blockIdx.x * per), r1 = min(rows, r0 + per);
    const int nstg = (r1 - r0 + srows - 1) / srows;
    const i64 sbytes = (i64)srows * rb;
    if (threadIdx.x == 0) {
        for (int i = 0; i < nst; i++) {
            bk_mb_init(&full[i], 1);
            bk_mb_init(&empty[i], KS_CW);
        }
        bk_mb_fence_init();
    }
    __syncthreads();
    if (warp == KS_CW) {
        // Producer: stage s into slot s % nst once the consumers released its previous round.
        if (lane == 0) {
            for (int s = 0; s < nstg; s++) {
                const int i = s % nst, rd = s / nst;
                if (rd > 0) bk_mb_sleep(&empty[i], (rd - 1) & 1);
                const int n = min(srows, r1 - r0 - s * srows);
                const u32 bytes = (u32)(n * rb);
                bk_mb_expect(&full[i], bytes);
                bk_copy(ring + i * sbytes, W + (i64)(r0 + s * srows) * rb, bytes, &full[i]);
            }
        }
        return;
    }
    kq_pdl_enter();  // the activations are the previous kernel's output
    // Rows of 12 super-blocks (the head's 3,072 columns): a lane's 3 units (lane + 32 i) sit at the
    // same columns in every row, so their activations are loaded once, here, not per row.
    const int BB = KqT<T>::BB;
    int4 pxa[3], pxb[3];
    float pda[3], pdb[3];
    if (NT == 1 && nblk == 12) {
#pragma unroll
        for (int i = 0; i < 3; i++) {
            const int u = lane + 32 * i;
            int ca, cb;
            kq_unit_cols<T>(u & 7, 256 * (u >> 3), ca, cb);
            pxa[i] = __ldg((const int4*)(xq + ca));
            pxb[i] = __ldg((const int4*)(xq + cb));
            pda[i] = __ldg(xd + (ca >> 5));
            pdb[i] = __ldg(xd + (cb >> 5));
        }
    }
    for (int s = 0; s < nstg; s++) {
        const int i = s % nst, n = min(srows, r1 - r0 - s * srows);
        bk_mb_wait(&full[i], (s / nst) & 1);
        const u8* stage = ring + i * sbytes;
        for (int j = warp; j < n; j += KS_CW) {
            float acc[NT];
#pragma unroll
            for (int t = 0; t < NT; t++) acc[t] = 0.f;
            if (NT == 1 && nblk == 12) {
                // kq_dot_staged's units in its order, with the activations above.
#pragma unroll
                for (int v = 0; v < 3; v++) {
                    const int u = lane + 32 * v;
                    int qa[4], qb[4];
                    float fa, fb, ma = 0.f, mb = 0.f;
                    int ca, cb;
                    kq_unit_codes<T>(stage + j * rb + (u >> 3) * BB, u & 7, 256 * (u >> 3), qa, qb, fa, fb, ma, mb, ca,
                                     cb);
                    kq_unit_dot<T>(qa, qb, fa, fb, ma, mb, pxa[v], pxb[v], pda[v], pdb[v], acc[0]);
                }
            } else {
                kq_dot_staged<T, NT>(stage + j * rb, nblk, 0, xq, ncol, xd, ncol / 32, nv, acc, lane);
            }
            mv_store<NT>(acc, y, ys, r0 + s * srows + j, 0, nv, lane, accumulate);
        }
        __syncwarp();  // every lane is done reading the stage
        if (lane == 0) bk_mb_arrive(&empty[i]);
    }
#endif
}
#define KQ_MVS_ONE(kname, T, NT)                                                                                  \
    extern "C" __global__ void __launch_bounds__(KS_THREADS) kname(const u8* W, i64 rb, int rows, float* y, i64 ys,  \
                                                                   int nblk, const i8* xq, const float* xd, int ncol, \
                                                                   int nv, int acc, int nst, int srows) {             \
        kq_mv_stream<T, NT>(W, rb, rows, y, ys, nblk, xq, xd, ncol, nv, acc, nst, srows);                           \
    }
#define KQ_MVS_INST(name, T) KQ_MVS_ONE(kq_mvs_##name, T, 1) KQ_MVS_ONE(kq_mvs4_##name, T, 4)

// ------------------------------------------------------------- MoE (decode) -------------
// Pair p = blockIdx.y (token p / k, expert ids[p]): act[p][r] = silu(gate_r . x) * (up_r . x)
// for the block's 32 rows r = blockIdx.x * 32 + (0..32), quantized to q8 (aq [p][ff] int8,
// ad [p][ff / 32]; ff = the activations' row stride, a multiple of 32). Warp w takes rows
// 4 w .. 4 w + 3; a step stages one row's gate and up segments of up to KQ_GU_PB super-blocks,
// and the next step's copies are in flight while this one is dotted.
// grid (rows / 32, npairs), block 256.
#define KQ_GU_PB 6
#define KQ_GU_ROWS 4
// Step s of a double-buffered walk of nsteps steps (issue(s) stages step s and commits):
// issues step s + 1, then waits until step s's copies have landed, for the whole warp.
template <class Issue>
__device__ __forceinline__ void kq_step_ready(int s, int nsteps, Issue& issue) {
    if (s + 1 < nsteps) {
        issue(s + 1);
        kq_wait<1>();
    } else {
        kq_wait<0>();
    }
    __syncwarp();
}

// Gate/up walks (kq_moe_gate_up*): the warp's KQ_GU_ROWS rows in steps s of one row's
// segment of up to KQ_GU_PB super-blocks (row s / nph, phase s % nph).
// Byte offset of step s's segments in the expert tensors (eoff: the expert's).
template <int T>
__device__ __forceinline__ i64 kq_gu_seg(int s, int nph, i64 eoff, i64 rb, int warp) {
    int i = s / nph, c0 = (s - i * nph) * KQ_GU_PB;
    return eoff + (i64)(blockIdx.x * 32 + warp * KQ_GU_ROWS + i) * rb + (i64)c0 * KqT<T>::BB;
}
// Issues (and commits) the copies of step s's gate and up segments (at byte ro) into the
// buffer pair sm.
template <int T>
__device__ __forceinline__ void kq_gu_issue(u8 (*sm)[KQ_SLOT(T, KQ_GU_PB)], const u8* G, const u8* U, i64 ro, int s,
                                            int nph, int nblk, int lane) {
    int i = s / nph, c0 = (s - i * nph) * KQ_GU_PB;
    int n = min(KQ_GU_PB, nblk - c0) * KqT<T>::BB;
    kq_issue(sm[0], G + ro, n, lane);
    kq_issue(sm[1], U + ro, n, lane);
    kq_commit();
}

template <int T>
__device__ __forceinline__ void kq_moe_gate_up(const u8* G, const u8* U, i64 rb, i64 es, int nblk, const int* ids, int k,
                                               const i8* xq, const float* xd, int ncol, i8* aq, float* ad, int ff) {
    const int BB = KqT<T>::BB, SLOT = KQ_SLOT(T, KQ_GU_PB);
    __shared__ __align__(16) u8 sm_all[32 / KQ_GU_ROWS][2][2][SLOT];
    __shared__ float act[32];
    int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    int p = blockIdx.y;
    int t = p / k;
    i64 eoff = (i64)ids[p] * es;
    const i8* xqt = xq + (i64)t * ncol;
    const float* xdt = xd + (i64)t * (ncol / 32);
    int nph = (nblk + KQ_GU_PB - 1) / KQ_GU_PB;
    int nsteps = KQ_GU_ROWS * nph;
    auto seg = [&](int s) { return kq_gu_seg<T>(s, nph, eoff, rb, warp); };
    auto issue = [&](int s) { kq_gu_issue<T>(sm_all[warp][s & 1], G, U, seg(s), s, nph, nblk, lane); };
    issue(0);
    float ag[1] = {0.f}, au[1] = {0.f};
    for (int s = 0; s < nsteps; s++) {
        kq_step_ready(s, nsteps, issue);
        int i = s / nph, c0 = (s - i * nph) * KQ_GU_PB;
        int nb = min(KQ_GU_PB, nblk - c0);
        i64 ro = seg(s);
        kq_dot_staged<T, 1>(kq_data(sm_all[warp][s & 1][0], G + ro), nb, 256 * c0, xqt, 0, xdt, 0, 1, ag, lane);
        kq_dot_staged<T, 1>(kq_data(sm_all[warp][s & 1][1], U + ro), nb, 256 * c0, xqt, 0, xdt, 0, 1, au, lane);
        __syncwarp();
        if (c0 + nb == nblk) {
            float g = warp_sum(ag[0]), u = warp_sum(au[0]);
            if (lane == 0) act[warp * KQ_GU_ROWS + i] = silu_times(g, u);
            ag[0] = 0.f;
            au[0] = 0.f;
        }
    }
    gu_act_q8(act, warp, lane, p, aq, ad, ff);
}

// hidden[t][r] += sum_j wts[t k + j] * (down[ids[t k + j]] row r . act[t k + j]) for the block's
// rows r = blockIdx.x * KQ_DN_WARPS + warp and token t = blockIdx.y: the k experts' down rows
// and their weighted sum added to the residual by one warp per row, in a fixed order (no
// atomics, deterministic). Activations aq/ad as kq_moe_gate_up writes them, ff = down's columns
// = their row stride. A step stages whole expert rows (as many as fit KQ_DN_PB super-blocks) or,
// for rows longer than that, KQ_DN_PB-block pieces of one; double-buffered.
// grid (ceil(rows / KQ_DN_WARPS), nt), block 32 * KQ_DN_WARPS.
#define KQ_DN_WARPS 4
#define KQ_DN_PB 12
template <int T>
__device__ __forceinline__ void kq_moe_down(const u8* W, i64 rb, i64 es, int rows, int nblk, const int* ids,
                                            const float* wts, int k, const i8* aq, const float* ad, int ff, float* hidden,
                                            i64 hs) {
    const int BB = KqT<T>::BB, BUF = ((KQ_DN_PB * (BB + 48) + 15) / 16) * 16;
    __shared__ __align__(16) u8 sm_all[KQ_DN_WARPS][2][BUF];
    int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    int r = blockIdx.x * KQ_DN_WARPS + warp;
    if (r >= rows) return;  // no block-wide barrier below
    int t = blockIdx.y;
    // Steps: whole rows of eg experts (nblk <= KQ_DN_PB), else one expert's row in nph pieces.
    bool whole = nblk <= KQ_DN_PB;
    int eg = whole ? KQ_DN_PB / nblk : 1;
    int nph = whole ? 1 : (nblk + KQ_DN_PB - 1) / KQ_DN_PB;
    int nb_max = whole ? nblk : KQ_DN_PB;
    int slot = ((nb_max * BB + 15) / 16) * 16 + 32;  // ne * slot <= BUF (see KQ_SLOT)
    int nsteps = whole ? (k + eg - 1) / eg : k * nph;
    auto step = [&](int s, int& j0, int& ne, int& c0, int& nb) {
        if (whole) {
            j0 = s * eg, ne = min(eg, k - j0), c0 = 0, nb = nblk;
        } else {
            j0 = s / nph, ne = 1, c0 = (s - j0 * nph) * KQ_DN_PB, nb = min(KQ_DN_PB, nblk - c0);
        }
    };
    // Expert slot j's row r from super-block c0.
    auto src = [&](int j, int c0) { return W + (i64)__ldg(ids + t * k + j) * es + (i64)r * rb + (i64)c0 * BB; };
    auto issue = [&](int s) {
        int j0, ne, c0, nb;
        step(s, j0, ne, c0, nb);
        for (int e = 0; e < ne; e++) kq_issue(sm_all[warp][s & 1] + e * slot, src(j0 + e, c0), nb * BB, lane);
        kq_commit();
    };
    issue(0);
    float total = 0.f;
    for (int s = 0; s < nsteps; s++) {
        kq_step_ready(s, nsteps, issue);
        int j0, ne, c0, nb;
        step(s, j0, ne, c0, nb);
        int upe = nb * 8;
        for (int u = lane; u < ne * upe; u += 32) {
            int e = u / upe, uu = u - e * upe;
            int b = uu >> 3;
            i64 p = (i64)t * k + j0 + e;
            float a[1] = {0.f};
            const u8* data = kq_data(sm_all[warp][s & 1] + e * slot, src(j0 + e, c0));
            kq_unit<T, 1>(data + b * BB, uu & 7, 256 * (c0 + b), aq + p * ff, 0, ad + p * (ff / 32), 0, 1, a);
            total += __ldg(wts + p) * a[0];
        }
        __syncwarp();
    }
    total = warp_sum(total);
    if (lane == 0) hidden[(i64)t * hs + r] += total;
}

// ------------------------------------------ MoE grouped by expert (steps of several tokens) --
// The pairs of a step grouped by expert by fast.cu's moe_group (grp: [0] = slots n; [1, 1+E)
// expert of slot s; [1+E, 1+2E) offset of its pairs in the list; [1+2E, 1+3E) their count;
// [1+3E, ..) the pair list), so each chosen expert's rows are read once for up to KQ_GNT of its
// pairs (more pairs: another pass). Every output element comes from one pair alone, with the
// same per-lane unit order as the per-pair kernels, so the order of the pairs does not matter.
#define KQ_GNT 8

// kq_moe_gate_up for slot blockIdx.y's pairs (same outputs aq/ad). grid (rows / 32, slots),
// block 256; blocks of unused slots exit.
template <int T>
__device__ __forceinline__ void kq_moe_gate_up_grp(const u8* G, const u8* U, i64 rb, i64 es, int nblk, const int* grp,
                                                   int E, int k, const i8* xq, const float* xd, int ncol, i8* aq,
                                                   float* ad, int ff) {
    const int BB = KqT<T>::BB, SLOT = KQ_SLOT(T, KQ_GU_PB);
    __shared__ __align__(16) u8 sm_all[32 / KQ_GU_ROWS][2][2][SLOT];
    __shared__ float act[KQ_GNT][32];
    int slot = blockIdx.y;
    if (slot >= grp[0]) return;  // the whole block
    int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    i64 eoff = (i64)grp[1 + slot] * es;
    int off = grp[1 + E + slot], cnt = grp[1 + 2 * E + slot];
    const int* pl = grp + 1 + 3 * E + off;
    int nph = (nblk + KQ_GU_PB - 1) / KQ_GU_PB;
    int nsteps = KQ_GU_ROWS * nph;
    auto seg = [&](int s) { return kq_gu_seg<T>(s, nph, eoff, rb, warp); };
    auto issue = [&](int s) { kq_gu_issue<T>(sm_all[warp][s & 1], G, U, seg(s), s, nph, nblk, lane); };
    for (int p0 = 0; p0 < cnt; p0 += KQ_GNT) {
        int nc = min(KQ_GNT, cnt - p0);
        int tk[KQ_GNT];
#pragma unroll
        for (int j = 0; j < KQ_GNT; j++) tk[j] = j < nc ? pl[p0 + j] / k : 0;
        float ag[KQ_GNT], au[KQ_GNT];
#pragma unroll
        for (int j = 0; j < KQ_GNT; j++) ag[j] = au[j] = 0.f;
        issue(0);
        for (int s = 0; s < nsteps; s++) {
            kq_step_ready(s, nsteps, issue);
            int i = s / nph, c0 = (s - i * nph) * KQ_GU_PB;
            int nb = min(KQ_GU_PB, nblk - c0);
            i64 ro = seg(s);
            kq_dot_staged_tk<T, KQ_GNT>(kq_data(sm_all[warp][s & 1][0], G + ro), nb, 256 * c0, xq, ncol, xd, ncol / 32, tk, nc, ag, lane);
            kq_dot_staged_tk<T, KQ_GNT>(kq_data(sm_all[warp][s & 1][1], U + ro), nb, 256 * c0, xq, ncol, xd, ncol / 32, tk, nc, au, lane);
            __syncwarp();
            if (c0 + nb == nblk) {
#pragma unroll
                for (int j = 0; j < KQ_GNT; j++) {
                    float g = warp_sum(ag[j]), u = warp_sum(au[j]);
                    if (lane == 0 && j < nc) act[j][warp * KQ_GU_ROWS + i] = silu_times(g, u);
                    ag[j] = 0.f;
                    au[j] = 0.f;
                }
            }
        }
        __syncthreads();
        if (warp < nc) {
            int p = pl[p0 + warp];
            float v = act[warp][lane];
            int q = q8_lane(v, ad + (i64)p * (ff / 32) + blockIdx.x);
            aq[(i64)p * ff + blockIdx.x * 32 + lane] = (i8)q;
        }
        __syncthreads();  // act is rewritten by the next pass
    }
}

// dpart[p][r] = down[expert of slot] row r . act[p] for slot blockIdx.y's pairs p (no routing
// weight: fast.cu's moe_combine_grp adds the weighted sum to the residual in a fixed order).
// One warp per row, the row in double-buffered phases of KQ_MV_PB super-blocks, read once per
// KQ_GNT pairs. grid (ceil(rows / KQ_DN_WARPS), slots), block 32 * KQ_DN_WARPS.
template <int T>
__device__ __forceinline__ void kq_moe_down_grp(const u8* W, i64 rb, i64 es, int rows, int nblk, const int* grp, int E,
                                                const i8* aq, const float* ad, int ff, float* dpart) {
    const int SLOT = KQ_SLOT(T, KQ_MV_PB);
    __shared__ __align__(16) u8 sm_all[KQ_DN_WARPS][2][SLOT];
    int slot = blockIdx.y;
    if (slot >= grp[0]) return;
    int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    int r = blockIdx.x * KQ_DN_WARPS + warp;
    if (r >= rows) return;  // no block-wide barrier below
    const u8* row = W + (i64)grp[1 + slot] * es + (i64)r * rb;
    int off = grp[1 + E + slot], cnt = grp[1 + 2 * E + slot];
    const int* pl = grp + 1 + 3 * E + off;
    for (int p0 = 0; p0 < cnt; p0 += KQ_GNT) {
        int nc = min(KQ_GNT, cnt - p0);
        int tk[KQ_GNT];
#pragma unroll
        for (int j = 0; j < KQ_GNT; j++) tk[j] = j < nc ? pl[p0 + j] : 0;
        float acc[KQ_GNT];
#pragma unroll
        for (int j = 0; j < KQ_GNT; j++) acc[j] = 0.f;
        kq_row_pass<T>(sm_all[warp], row, nblk, lane, [&](const u8* data, int nb, int colb) {
            kq_dot_staged_tk<T, KQ_GNT>(data, nb, colb, aq, ff, ad, ff / 32, tk, nc, acc, lane);
        });
#pragma unroll
        for (int j = 0; j < KQ_GNT; j++) {
            float s = warp_sum(acc[j]);
            if (lane == 0 && j < nc) dpart[(i64)tk[j] * rows + r] = s;
        }
    }
}

#define KQ_INST(name, T)                                                                                           \
    KQ_MV_INST(name, T, 1)                                                                                         \
    KQ_MV_INST(name, T, 4)                                                                                         \
    KQ_MV_INST(name, T, 8)                                                                                         \
    KQ_MV_INST(name, T, 16)                                                                                        \
    KQ_MVR_INST(name, T)                                                                                           \
    KQ_MVS_INST(name, T)                                                                                           \
    extern "C" __global__ void __launch_bounds__(32 * 32 / KQ_GU_ROWS) kq_moe_gate_up_##name(                      \
        const u8* G, const u8* U, i64 rb, i64 es, int nblk, const int* ids, int k, const i8* xq, const float* xd,  \
        int ncol, i8* aq, float* ad, int ff) {                                                                     \
        kq_pdl_enter();                                                                                            \
        kq_moe_gate_up<T>(G, U, rb, es, nblk, ids, k, xq, xd, ncol, aq, ad, ff);                                   \
    }                                                                                                              \
    extern "C" __global__ void __launch_bounds__(32 * KQ_DN_WARPS) kq_moe_down_##name(                             \
        const u8* W, i64 rb, i64 es, int rows, int nblk, const int* ids, const float* wts, int k, const i8* aq,    \
        const float* ad, int ff, float* hidden, i64 hs) {                                                          \
        kq_pdl_enter();                                                                                            \
        kq_moe_down<T>(W, rb, es, rows, nblk, ids, wts, k, aq, ad, ff, hidden, hs);                                \
    }                                                                                                              \
    extern "C" __global__ void __launch_bounds__(256) kq_moe_gate_up_grp_##name(                                   \
        const u8* G, const u8* U, i64 rb, i64 es, int nblk, const int* grp, int E, int k, const i8* xq,            \
        const float* xd, int ncol, i8* aq, float* ad, int ff) {                                                    \
        kq_pdl_enter();                                                                                            \
        kq_moe_gate_up_grp<T>(G, U, rb, es, nblk, grp, E, k, xq, xd, ncol, aq, ad, ff);                            \
    }                                                                                                              \
    extern "C" __global__ void __launch_bounds__(32 * KQ_DN_WARPS) kq_moe_down_grp_##name(                         \
        const u8* W, i64 rb, i64 es, int rows, int nblk, const int* grp, int E, const i8* aq, const float* ad,      \
        int ff, float* dpart) {                                                                                    \
        kq_pdl_enter();                                                                                            \
        kq_moe_down_grp<T>(W, rb, es, rows, nblk, grp, E, aq, ad, ff, dpart);                                      \
    }

KQ_INST(q4_k, T_Q4_K)
KQ_INST(q6_k, T_Q6_K)
