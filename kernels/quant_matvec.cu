// Quantized matrix-vector / small-batch matrix products and row dequantization for every
// GGUF type the CPU reference supports. Weights stay in their GGUF blocks and are
// dequantized on the fly, 32 elements at a time, into registers; products accumulate in f32.
//
// Kernels (TY = lower-case type name, e.g. q4_k):
//   mv_TY_NT   dense: y[v] (+)= W x[v] for NT vectors per warp (weights read once per NT)
//   mve_TY     per-vector weights: vector p uses expert ids[p]'s matrix (MoE)
//   dq_TY      dequantize selected rows to f32 (embedding lookup, tests)
//   dqb_TY     dequantize whole rows to packed bf16 (the cuBLAS prefill products)
//   x_bf16     f32 rows with a stride to packed bf16 (their inputs)

__constant__ float KV_IQ4[16] = {-127.f, -104.f, -83.f, -65.f, -49.f, -35.f, -22.f, -10.f,
                                 1.f,    13.f,   25.f,  38.f,  53.f,  69.f,  89.f,  113.f};
__constant__ float KV_MXFP4[16] = {0.f, 1.f,  2.f,  3.f,  4.f,  6.f,  8.f,  12.f,
                                   0.f, -1.f, -2.f, -3.f, -4.f, -6.f, -8.f, -12.f};

template <int T> struct Q;  // block geometry: BE elements, BB bytes
#define GEOM(t, be, bb) template <> struct Q<t> { static const int BE = be, BB = bb; };
GEOM(T_F32, 1, 4) GEOM(T_F16, 1, 2) GEOM(T_BF16, 1, 2)
GEOM(T_Q4_0, 32, 18) GEOM(T_Q4_1, 32, 20) GEOM(T_Q5_0, 32, 22) GEOM(T_Q5_1, 32, 24)
GEOM(T_Q8_0, 32, 34) GEOM(T_IQ4_NL, 32, 18) GEOM(T_MXFP4, 32, 17)
GEOM(T_Q2_K, 256, 84) GEOM(T_Q3_K, 256, 110) GEOM(T_Q4_K, 256, 144) GEOM(T_Q5_K, 256, 176)
GEOM(T_Q6_K, 256, 210) GEOM(T_IQ4_XS, 256, 136)

template <int T> __device__ __forceinline__ constexpr bool is_float_type() {
    return T == T_F32 || T == T_F16 || T == T_BF16;
}

// Element i of a row of a float type.
template <int T> __device__ __forceinline__ float ld_float(const u8* row, int i) {
    if (T == T_F32) return ((const float*)row)[i];
    if (T == T_F16) return f16_to_f32(((const u16*)row)[i]);
    return bf16_to_f32(((const u16*)row)[i]);
}

__device__ __forceinline__ float e8m0_half(u8 e) {
    u32 bits = e < 2 ? (0x00200000u << e) : ((u32)(e - 1) << 23);
    return __uint_as_float(bits);
}

// Dequantizes elements [32c, 32c + 32) of a quantized row into v.
template <int T> __device__ __forceinline__ void dq32(const u8* row, int c, float* v);

template <> __device__ __forceinline__ void dq32<T_Q4_0>(const u8* row, int c, float* v) {
    const u8* b = row + c * 18;
    float d = ld_h(b);
    const u8* qs = b + 2;
#pragma unroll
    for (int j = 0; j < 16; j++) {
        v[j] = __fmul_rn(d, (float)((int)(qs[j] & 15) - 8));
        v[j + 16] = __fmul_rn(d, (float)((int)(qs[j] >> 4) - 8));
    }
}
template <> __device__ __forceinline__ void dq32<T_Q4_1>(const u8* row, int c, float* v) {
    const u8* b = row + c * 20;
    float d = ld_h(b), m = ld_h(b + 2);
    const u8* qs = b + 4;
#pragma unroll
    for (int j = 0; j < 16; j++) {
        v[j] = __fadd_rn(__fmul_rn(d, (float)(qs[j] & 15)), m);
        v[j + 16] = __fadd_rn(__fmul_rn(d, (float)(qs[j] >> 4)), m);
    }
}
template <> __device__ __forceinline__ void dq32<T_Q5_0>(const u8* row, int c, float* v) {
    const u8* b = row + c * 22;
    float d = ld_h(b);
    u32 h = ld_u32(b + 2);
    const u8* qs = b + 6;
#pragma unroll
    for (int j = 0; j < 16; j++) {
        u32 lo = (qs[j] & 15) | (((h >> j) & 1) << 4);
        u32 hi = (qs[j] >> 4) | (((h >> (j + 16)) & 1) << 4);
        v[j] = __fmul_rn(d, (float)((int)lo - 16));
        v[j + 16] = __fmul_rn(d, (float)((int)hi - 16));
    }
}
template <> __device__ __forceinline__ void dq32<T_Q5_1>(const u8* row, int c, float* v) {
    const u8* b = row + c * 24;
    float d = ld_h(b), m = ld_h(b + 2);
    u32 h = ld_u32(b + 4);
    const u8* qs = b + 8;
#pragma unroll
    for (int j = 0; j < 16; j++) {
        u32 lo = (qs[j] & 15) | (((h >> j) & 1) << 4);
        u32 hi = (qs[j] >> 4) | (((h >> (j + 16)) & 1) << 4);
        v[j] = __fadd_rn(__fmul_rn(d, (float)lo), m);
        v[j + 16] = __fadd_rn(__fmul_rn(d, (float)hi), m);
    }
}
template <> __device__ __forceinline__ void dq32<T_Q8_0>(const u8* row, int c, float* v) {
    const u8* b = row + c * 34;
    float d = ld_h(b);
    const i8* qs = (const i8*)(b + 2);
#pragma unroll
    for (int j = 0; j < 32; j++) v[j] = __fmul_rn(d, (float)qs[j]);
}
// dq32<T_Q8_0> for a 2-byte-aligned row: 16 two-byte loads instead of 34 byte loads, the same
// f32 operations (also quant_matmul.cu's fast dequantizer).
__device__ __forceinline__ void dq32_q8_0_a2(const u8* row, int c, float* v) {
    const u16* b = (const u16*)(row + c * 34);
    float d = f16_to_f32(b[0]);
#pragma unroll
    for (int j = 0; j < 16; j++) {
        u16 x = b[1 + j];
        v[2 * j] = __fmul_rn(d, (float)(i8)(x & 0xff));
        v[2 * j + 1] = __fmul_rn(d, (float)(i8)(x >> 8));
    }
}
template <> __device__ __forceinline__ void dq32<T_IQ4_NL>(const u8* row, int c, float* v) {
    const u8* b = row + c * 18;
    float d = ld_h(b);
    const u8* qs = b + 2;
#pragma unroll
    for (int j = 0; j < 16; j++) {
        v[j] = __fmul_rn(d, KV_IQ4[qs[j] & 15]);
        v[j + 16] = __fmul_rn(d, KV_IQ4[qs[j] >> 4]);
    }
}
template <> __device__ __forceinline__ void dq32<T_MXFP4>(const u8* row, int c, float* v) {
    const u8* b = row + c * 17;
    float d = e8m0_half(b[0]);
    const u8* qs = b + 1;
#pragma unroll
    for (int j = 0; j < 16; j++) {
        v[j] = __fmul_rn(d, KV_MXFP4[qs[j] & 15]);
        v[j + 16] = __fmul_rn(d, KV_MXFP4[qs[j] >> 4]);
    }
}
// K-quants: chunk c is sub-chunk s = c % 8 of super-block c / 8.
template <> __device__ __forceinline__ void dq32<T_Q2_K>(const u8* row, int c, float* v) {
    const u8* b = row + (c >> 3) * 84;
    int s = c & 7, g = s >> 2, k = s & 3;
    const u8* scales = b;
    const u8* qs = b + 16 + 32 * g;
    float d = ld_h(b + 80), dmin = ld_h(b + 82);
    int i0 = 8 * g + 2 * k;
    float dl0 = __fmul_rn(d, (float)(scales[i0] & 15)), ml0 = __fmul_rn(dmin, (float)(scales[i0] >> 4));
    float dl1 = __fmul_rn(d, (float)(scales[i0 + 1] & 15)), ml1 = __fmul_rn(dmin, (float)(scales[i0 + 1] >> 4));
#pragma unroll
    for (int l = 0; l < 16; l++) {
        v[l] = __fsub_rn(__fmul_rn(dl0, (float)((qs[l] >> (2 * k)) & 3)), ml0);
        v[l + 16] = __fsub_rn(__fmul_rn(dl1, (float)((qs[l + 16] >> (2 * k)) & 3)), ml1);
    }
}
__device__ __forceinline__ float q3k_scale(const u8* sc, int i, float d) {
    int low = i < 8 ? (sc[i] & 15) : (sc[i - 8] >> 4);
    int high = (sc[8 + (i & 3)] >> (2 * (i >> 2))) & 3;
    return __fmul_rn(d, (float)((low | (high << 4)) - 32));
}
template <> __device__ __forceinline__ void dq32<T_Q3_K>(const u8* row, int c, float* v) {
    const u8* b = row + (c >> 3) * 110;
    int s = c & 7, g = s >> 2, k = s & 3;
    const u8* hmask = b;
    const u8* qs = b + 32 + 32 * g;
    float d = ld_h(b + 108);
    int i0 = 8 * g + 2 * k, bit = 4 * g + k;
    float d0 = q3k_scale(b + 96, i0, d), d1 = q3k_scale(b + 96, i0 + 1, d);
#pragma unroll
    for (int l = 0; l < 16; l++) {
        int q0 = (int)((qs[l] >> (2 * k)) & 3) - ((((~hmask[l]) >> bit) & 1) << 2);
        int q1 = (int)((qs[l + 16] >> (2 * k)) & 3) - ((((~hmask[l + 16]) >> bit) & 1) << 2);
        v[l] = __fmul_rn(d0, (float)q0);
        v[l + 16] = __fmul_rn(d1, (float)q1);
    }
}
__device__ __forceinline__ void scale_min_k4(const u8* s, int j, int* sc, int* m) {
    if (j < 4) {
        *sc = s[j] & 63;
        *m = s[j + 4] & 63;
    } else {
        *sc = (s[j + 4] & 15) | ((s[j - 4] >> 6) << 4);
        *m = (s[j + 4] >> 4) | ((s[j] >> 6) << 4);
    }
}
template <> __device__ __forceinline__ void dq32<T_Q4_K>(const u8* row, int c, float* v) {
    const u8* b = row + (c >> 3) * 144;
    int s = c & 7, g = s >> 1, h = s & 1;
    float d = ld_h(b), dmin = ld_h(b + 2);
    int sc, m;
    scale_min_k4(b + 4, s, &sc, &m);
    float d1 = __fmul_rn(d, (float)sc), m1 = __fmul_rn(dmin, (float)m);
    const u8* q = b + 16 + 32 * g;
#pragma unroll
    for (int l = 0; l < 32; l++) v[l] = __fsub_rn(__fmul_rn(d1, (float)((q[l] >> (4 * h)) & 15)), m1);
}
template <> __device__ __forceinline__ void dq32<T_Q5_K>(const u8* row, int c, float* v) {
    const u8* b = row + (c >> 3) * 176;
    int s = c & 7, g = s >> 1, h = s & 1;
    float d = ld_h(b), dmin = ld_h(b + 2);
    int sc, m;
    scale_min_k4(b + 4, s, &sc, &m);
    float d1 = __fmul_rn(d, (float)sc), m1 = __fmul_rn(dmin, (float)m);
    const u8* qh = b + 16;
    const u8* q = b + 48 + 32 * g;
#pragma unroll
    for (int l = 0; l < 32; l++) {
        int qq = ((q[l] >> (4 * h)) & 15) | (((qh[l] >> s) & 1) << 4);
        v[l] = __fsub_rn(__fmul_rn(d1, (float)qq), m1);
    }
}
template <> __device__ __forceinline__ void dq32<T_Q6_K>(const u8* row, int c, float* v) {
    const u8* b = row + (c >> 3) * 210;
    int s = c & 7, g = s >> 2, k = s & 3;
    const u8* ql = b + 64 * g + 32 * (k & 1);
    const u8* qh = b + 128 + 32 * g;
    const i8* scales = (const i8*)(b + 192);
    float d = ld_h(b + 208);
    int i0 = 8 * g + 2 * k;
    float dl0 = __fmul_rn(d, (float)scales[i0]), dl1 = __fmul_rn(d, (float)scales[i0 + 1]);
    int lshift = 4 * (k >> 1);
#pragma unroll
    for (int l = 0; l < 32; l++) {
        int low = (ql[l] >> lshift) & 15;
        int high = (qh[l] >> (2 * k)) & 3;
        v[l] = __fmul_rn(l < 16 ? dl0 : dl1, (float)((low | (high << 4)) - 32));
    }
}
template <> __device__ __forceinline__ void dq32<T_IQ4_XS>(const u8* row, int c, float* v) {
    const u8* b = row + (c >> 3) * 136;
    int ib = c & 7;
    float d = ld_h(b);
    u32 scales_h = ld_u16(b + 2);
    int low = (b[4 + ib / 2] >> (4 * (ib & 1))) & 15;
    int high = (scales_h >> (2 * ib)) & 3;
    float dl = __fmul_rn(d, (float)((low | (high << 4)) - 32));
    const u8* q = b + 8 + 16 * ib;
#pragma unroll
    for (int j = 0; j < 16; j++) {
        v[j] = __fmul_rn(dl, KV_IQ4[q[j] & 15]);
        v[j + 16] = __fmul_rn(dl, KV_IQ4[q[j] >> 4]);
    }
}
// Float types never use dq32 (they take the element-wise path), but the template must exist.
template <> __device__ __forceinline__ void dq32<T_F32>(const u8*, int, float*) {}
template <> __device__ __forceinline__ void dq32<T_F16>(const u8*, int, float*) {}
template <> __device__ __forceinline__ void dq32<T_BF16>(const u8*, int, float*) {}

// acc[t] += row . x[t] over the whole row, this lane's share (t < n); caller reduces the warp.
template <int T, int NT>
__device__ __forceinline__ void row_dot(const u8* row, int cols, const float* x, i64 xs, int n, int lane, float* acc) {
    if (is_float_type<T>()) {
        for (int i = lane; i < cols; i += WARP) {
            float w = ld_float<T>(row, i);
#pragma unroll
            for (int t = 0; t < NT; t++)
                if (t < n) acc[t] += w * x[t * xs + i];
        }
    } else {
        int nch = cols >> 5;
        for (int c = lane; c < nch; c += WARP) {
            float v[32];
            dq32<T>(row, c, v);
#pragma unroll
            for (int t = 0; t < NT; t++) {
                if (t < n) {
                    const float4* xp = (const float4*)(x + t * xs + c * 32);
                    float s = 0.f;
#pragma unroll
                    for (int j = 0; j < 8; j++) {
                        float4 xv = xp[j];
                        s += v[4 * j] * xv.x + v[4 * j + 1] * xv.y + v[4 * j + 2] * xv.z + v[4 * j + 3] * xv.w;
                    }
                    acc[t] += s;
                }
            }
        }
    }
}

#define MV_WARPS 4

// Dense: grid (ceil(rows / MV_WARPS), ceil(nvec / NT)), block 32 * MV_WARPS. One warp per row.
template <int T, int NT>
__device__ __forceinline__ void mv_dense(const u8* W, i64 row_bytes, int rows, int cols, const float* x, i64 xs,
                                         float* y, i64 ys, int nvec, int accumulate) {
    int lane = threadIdx.x & 31;
    int r = blockIdx.x * MV_WARPS + (threadIdx.x >> 5);
    int v0 = blockIdx.y * NT;
    if (r >= rows || v0 >= nvec) return;
    int n = min(NT, nvec - v0);
    float acc[NT];
#pragma unroll
    for (int t = 0; t < NT; t++) acc[t] = 0.f;
    row_dot<T, NT>(W + r * row_bytes, cols, x + v0 * xs, xs, n, lane, acc);
#pragma unroll
    for (int t = 0; t < NT; t++) {
        float s = warp_sum(acc[t]);
        if (lane == 0 && t < n) {
            float* yp = y + (v0 + t) * ys + r;
            *yp = accumulate ? *yp + s : s;
        }
    }
}

// Per-vector weights: vector p multiplies expert ids[p]'s matrix (W + ids[p] * expert_stride)
// with x row p / x_div. grid (ceil(rows / MV_WARPS), npairs).
template <int T>
__device__ __forceinline__ void mv_expert(const u8* W, i64 row_bytes, i64 expert_stride, int rows, int cols,
                                          const int* ids, const float* x, i64 xs, int x_div, float* y, i64 ys) {
    int lane = threadIdx.x & 31;
    int r = blockIdx.x * MV_WARPS + (threadIdx.x >> 5);
    int p = blockIdx.y;
    if (r >= rows) return;
    const u8* Wp = W + ids[p] * expert_stride;
    float acc[1] = {0.f};
    row_dot<T, 1>(Wp + r * row_bytes, cols, x + (p / x_div) * xs, xs, 1, lane, acc);
    float s = warp_sum(acc[0]);
    if (lane == 0) y[p * ys + r] = s;
}

// Dequantizes rows ids[i] of W into out row i. grid (nrows), block 256. A negative id -1 - j
// (overlapped decode: a token the previous step drew on the device) reads row feed[j]; a
// missing one (no feed, or a -1 there) reads row 0, and the rank fails that sequence.
template <int T>
__device__ __forceinline__ void dq_rows(const u8* W, i64 row_bytes, const int* ids, int cols, float* out, i64 os, const int* feed) {
    int id = ids[blockIdx.x];
    if (id < 0) id = feed != nullptr ? feed[-1 - id] : 0;
    if (id < 0) id = 0;
    const u8* row = W + (i64)id * row_bytes;
    float* o = out + blockIdx.x * os;
    if (is_float_type<T>()) {
        for (int i = threadIdx.x; i < cols; i += blockDim.x) o[i] = ld_float<T>(row, i);
    } else {
        for (int c = threadIdx.x; c < (cols >> 5); c += blockDim.x) {
            float v[32];
            dq32<T>(row, c, v);
#pragma unroll
            for (int j = 0; j < 32; j++) o[c * 32 + j] = v[j];
        }
    }
}

// Rows [0, rows) of W (rows of `cols` elements, `rb` bytes apart) as packed bf16 rows of `cols`
// elements, rounded to nearest even from dq32's exact f32 values. One thread per 32-element
// chunk (float types: per element); grid (ceil(rows * chunks / 256)), block 256; the wrapper
// keeps rows * chunks below 2^31.
template <int T>
__device__ __forceinline__ void dq_bf16(const u8* W, i64 rb, int rows, int cols, u16* out) {
    u32 i = blockIdx.x * blockDim.x + threadIdx.x;
    if (is_float_type<T>()) {
        if (i >= (u32)rows * (u32)cols) return;
        u32 r = i / (u32)cols, c = i % (u32)cols;
        out[i] = f32_to_bf16(ld_float<T>(W + r * rb, c));
    } else {
        u32 chunks = (u32)cols >> 5;
        if (i >= (u32)rows * chunks) return;
        u32 r = i / chunks, c = i % chunks;
        float v[32];
        // Q8_0 with 2-byte loads (the wrapper checks the alignment): the same values.
        if (T == T_Q8_0)
            dq32_q8_0_a2(W + r * rb, c, v);
        else
            dq32<T>(W + r * rb, c, v);
        // 64 contiguous bytes per thread, as four 16-byte stores (cols is a multiple of 32).
        uint4* o = (uint4*)(out + (i64)r * cols + c * 32u);
#pragma unroll
        for (int q = 0; q < 4; q++) {
            u32 w[4];
#pragma unroll
            for (int j = 0; j < 4; j++) w[j] = (u32)f32_to_bf16(v[q * 8 + 2 * j]) | ((u32)f32_to_bf16(v[q * 8 + 2 * j + 1]) << 16);
            o[q] = make_uint4(w[0], w[1], w[2], w[3]);
        }
    }
}

#define MV_INST(name, T)                                                                                     \
    extern "C" __global__ void __launch_bounds__(32 * MV_WARPS) mv_##name##_1(                               \
        const u8* W, i64 rb, int rows, int cols, const float* x, i64 xs, float* y, i64 ys, int nvec, int acc) { \
        mv_dense<T, 1>(W, rb, rows, cols, x, xs, y, ys, nvec, acc);                                          \
    }                                                                                                        \
    extern "C" __global__ void __launch_bounds__(32 * MV_WARPS) mv_##name##_8(                               \
        const u8* W, i64 rb, int rows, int cols, const float* x, i64 xs, float* y, i64 ys, int nvec, int acc) { \
        mv_dense<T, 8>(W, rb, rows, cols, x, xs, y, ys, nvec, acc);                                          \
    }                                                                                                        \
    extern "C" __global__ void __launch_bounds__(32 * MV_WARPS) mve_##name(                                  \
        const u8* W, i64 rb, i64 es, int rows, int cols, const int* ids, const float* x, i64 xs, int x_div,  \
        float* y, i64 ys) {                                                                                  \
        mv_expert<T>(W, rb, es, rows, cols, ids, x, xs, x_div, y, ys);                                       \
    }                                                                                                        \
    extern "C" __global__ void dq_##name(const u8* W, i64 rb, const int* ids, int cols, float* out, i64 os, const int* feed) { \
        dq_rows<T>(W, rb, ids, cols, out, os, feed);                                                               \
    }                                                                                                        \
    extern "C" __global__ void __launch_bounds__(256) dqb_##name(const u8* W, i64 rb, int rows, int cols, u16* out) { \
        dq_bf16<T>(W, rb, rows, cols, out);                                                                  \
    }

// quant_matmul.cu is compiled with this file in front of it for dq32 and defines
// QMV_NO_KERNELS so the matvec kernels are not built twice.
#ifndef QMV_NO_KERNELS
MV_INST(f32, T_F32)
MV_INST(f16, T_F16)
MV_INST(bf16, T_BF16)
MV_INST(q4_0, T_Q4_0)
MV_INST(q4_1, T_Q4_1)
MV_INST(q5_0, T_Q5_0)
MV_INST(q5_1, T_Q5_1)
MV_INST(q8_0, T_Q8_0)
MV_INST(q2_k, T_Q2_K)
MV_INST(q3_k, T_Q3_K)
MV_INST(q4_k, T_Q4_K)
MV_INST(q5_k, T_Q5_K)
MV_INST(q6_k, T_Q6_K)
MV_INST(iq4_nl, T_IQ4_NL)
MV_INST(iq4_xs, T_IQ4_XS)
MV_INST(mxfp4, T_MXFP4)

// X[n x cols] f32, rows xs apart, to packed bf16 [n x cols] (round to nearest even); four
// elements per thread (16-byte loads, 8-byte stores: x 16-byte aligned, xs and cols multiples
// of 4, which the GEMM's callers guarantee); grid (ceil(cols / 1024), n), block 256.
extern "C" __global__ void __launch_bounds__(256) x_bf16(const float* x, i64 xs, int n, int cols, u16* out) {
    int c = (blockIdx.x * blockDim.x + threadIdx.x) * 4;
    int t = blockIdx.y;
    if (c >= cols) return;
    float4 v = *(const float4*)(x + t * xs + c);
    uint2 o;
    o.x = (u32)f32_to_bf16(v.x) | ((u32)f32_to_bf16(v.y) << 16);
    o.y = (u32)f32_to_bf16(v.z) | ((u32)f32_to_bf16(v.w) << 16);
    *(uint2*)(out + (i64)t * cols + c) = o;
}
#endif
