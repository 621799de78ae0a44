// Quantized matrix-matrix products on tensor cores for prefill: Y[n x rows] (+)= X[n x cols] W^T,
// W in any GGUF type of quant_matvec.cu (this file is compiled with quant_matvec.cu in front of
// it, QMV_NO_KERNELS defined, for the bit-exact dq32 dequantizers), X and Y f32 row-major.
//
// A block computes a tile of MM_BN = 128 weight rows x BM = 16 * NT tokens, stepping through K
// MM_BK = 64 columns at a time: each of its 256 threads dequantizes one 32-element chunk of one
// weight row into shared memory as bf16, the X tile is converted to bf16 likewise, then 8 warps
// (4 along the rows x 2 along the tokens, 32 rows x 8 NT tokens each) run mma.sync m16n8k16
// (bf16 in, f32 accumulation). The weight tile is the MMA's row-major A, the X tile its
// column-major B (both stored [row][k], k contiguous; rows padded to 72 elements so the 32-bit
// fragment loads are free of bank conflicts).
//
// Precision: MM_PASSES 1 rounds W and X to bf16 (8 significant bits: about 2e-3 relative per
// product). MM_PASSES 3 splits both into hi + lo bf16 parts and accumulates hi*hi + hi*lo +
// lo*hi: about 16 significant bits, close to the f32 matvec (the module is built once per
// value, kernel names end in _p1 / _p3).
//
// Kernels (TY = lower-case type name, NT = token tiles of 16):
//   mm_TY_NT_pP    dense: grid (ceil(rows / 128), ceil(n / BM)); token j of the tile is X row
//                  and Y row n0 + j.
//   mmg_TY_NT_pP   grouped experts: grid (ceil(rows / 128), max tiles); tile i = (expert,
//                  start, count) from moe_group_scan; column j is pair p = list[start + j],
//                  X row p / x_div, Y row p; W = W + expert * expert_stride. Blocks past the
//                  device-side tile count return at once.

#ifndef MM_PASSES
#define MM_PASSES 1
#endif

#define MM_BN 128
#define MM_BK 64
#define MM_PITCH 72
#define MM_THREADS 256
#define MM_PLANES (MM_PASSES == 1 ? 1 : 2)

// Fast dequantizers for the types real checkpoints use most, with aligned multi-byte loads
// (the wrapper checks the alignment); values identical to dq32. Everything else uses dq32.
template <int T> __device__ __forceinline__ void mm_dq32(const u8* row, int c, float* v) { dq32<T>(row, c, v); }

// KV_IQ4[n] from registers (byte permute over the table packed as int8) instead of divergent
// constant-memory reads.
__device__ __forceinline__ float mm_iq4(u32 n) {
    u32 lo = __byte_perm(0xbfad9881u, 0xf6eaddcfu, n & 7);
    u32 hi = __byte_perm(0x26190d01u, 0x71594535u, n & 7);
    return (float)(int)(i8)((n & 8 ? hi : lo) & 0xff);
}

template <> __device__ __forceinline__ void mm_dq32<T_IQ4_XS>(const u8* row, int c, float* v) {
    const u8* b = row + (c >> 3) * 136;
    int ib = c & 7;
    u32 h0 = *(const u32*)b;
    float d = f16_to_f32((u16)(h0 & 0xffff));
    u32 scales_h = h0 >> 16;
    int low = (b[4 + ib / 2] >> (4 * (ib & 1))) & 15;
    int high = (scales_h >> (2 * ib)) & 3;
    float dl = __fmul_rn(d, (float)((low | (high << 4)) - 32));
    const u32* q = (const u32*)(b + 8 + 16 * ib);
#pragma unroll
    for (int w = 0; w < 4; w++) {
        u32 x = q[w];
#pragma unroll
        for (int j = 0; j < 4; j++) {
            u32 byte = (x >> (8 * j)) & 0xff;
            v[4 * w + j] = __fmul_rn(dl, mm_iq4(byte & 15));
            v[4 * w + j + 16] = __fmul_rn(dl, mm_iq4(byte >> 4));
        }
    }
}

template <> __device__ __forceinline__ void mm_dq32<T_Q8_0>(const u8* row, int c, float* v) {
    const u16* b = (const u16*)(row + c * 34);
    float d = f16_to_f32(b[0]);
#pragma unroll
    for (int j = 0; j < 16; j++) {
        u16 x = b[1 + j];
        v[2 * j] = __fmul_rn(d, (float)(i8)(x & 0xff));
        v[2 * j + 1] = __fmul_rn(d, (float)(i8)(x >> 8));
    }
}

__device__ __forceinline__ u32 mm_pack(u16 a, u16 b) { return (u32)a | ((u32)b << 16); }

// bf16 hi part of f and the bf16 rounding of the remainder.
__device__ __forceinline__ void mm_split(float f, u16* hi, u16* lo) {
    u16 h = f32_to_bf16(f);
    *hi = h;
    *lo = f32_to_bf16(f - bf16_to_f32(h));
}

__device__ __forceinline__ void mm_mma(float* c, const u32* a, const u32* b) {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
        "{%0,%1,%2,%3};"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
}

// Dynamic shared memory of one block, in bytes.
template <int NT> __host__ __device__ constexpr int mm_smem() {
    return MM_PLANES * (MM_BN + 16 * NT) * MM_PITCH * 2 + 2 * 16 * NT * 4;
}

// One output tile. W: this block's matrix (expert already applied); r0: first weight row;
// xr / yr (shared): per token column, the X and Y row (-1: none).
template <int T, int NT>
__device__ __forceinline__ void mm_tile(const u8* W, i64 rb, int rows, int cols, const float* X, i64 xs, float* Y, i64 ys,
                                        int r0, const int* xr, const int* yr, int accumulate, u16* sm) {
    const int BM = 16 * NT;
    u16* A = sm;                                   // [plane][MM_BN][MM_PITCH]
    u16* B = sm + MM_PLANES * MM_BN * MM_PITCH;    // [plane][BM][MM_PITCH]
    int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    int g = lane >> 2, t4 = lane & 3;
    int wm = warp & 3, wn = warp >> 2;
    float acc[2][NT][4];
#pragma unroll
    for (int i = 0; i < 2; i++)
#pragma unroll
        for (int j = 0; j < NT; j++)
#pragma unroll
            for (int q = 0; q < 4; q++) acc[i][j][q] = 0.f;

    // This thread's dequantization task: row dr of the tile, chunk dc (of 2) of the K step.
    int dr = tid >> 1, dc = tid & 1;
    bool row_ok = r0 + dr < rows;
    const u8* wrow = W + (i64)(r0 + dr) * rb;

    for (int k0 = 0; k0 < cols; k0 += MM_BK) {
        // Weight tile: 32 values -> bf16 (hi, and lo for 3 passes) -> 4 x 16-byte stores.
        {
            float v[32];
            int kc = k0 + 32 * dc;
            if (is_float_type<T>()) {
#pragma unroll
                for (int j = 0; j < 32; j++) v[j] = (row_ok && kc + j < cols) ? ld_float<T>(wrow, kc + j) : 0.f;
            } else if (row_ok && kc < cols) {
                mm_dq32<T>(wrow, kc >> 5, v);
            } else {
#pragma unroll
                for (int j = 0; j < 32; j++) v[j] = 0.f;
            }
            u16* dst = A + dr * MM_PITCH + 32 * dc;
#pragma unroll
            for (int j = 0; j < 32; j += 8) {
                u16 h[8], l[8];
#pragma unroll
                for (int q = 0; q < 8; q++) mm_split(v[j + q], &h[q], &l[q]);
                *(uint4*)(dst + j) = make_uint4(mm_pack(h[0], h[1]), mm_pack(h[2], h[3]), mm_pack(h[4], h[5]), mm_pack(h[6], h[7]));
                if (MM_PASSES == 3)
                    *(uint4*)(dst + MM_BN * MM_PITCH + j) =
                        make_uint4(mm_pack(l[0], l[1]), mm_pack(l[2], l[3]), mm_pack(l[4], l[5]), mm_pack(l[6], l[7]));
            }
        }
        // X tile: BM rows x 64 columns as float4s -> bf16.
        for (int i = tid; i < BM * 16; i += MM_THREADS) {
            int j = i >> 4, q = i & 15, col = k0 + 4 * q;
            int xrow = xr[j];
            float4 x = make_float4(0.f, 0.f, 0.f, 0.f);
            if (xrow >= 0 && col < cols) x = *(const float4*)(X + (i64)xrow * xs + col);
            u16 h[4], l[4];
            mm_split(x.x, &h[0], &l[0]);
            mm_split(x.y, &h[1], &l[1]);
            mm_split(x.z, &h[2], &l[2]);
            mm_split(x.w, &h[3], &l[3]);
            u16* dst = B + j * MM_PITCH + 4 * q;
            *(uint2*)dst = make_uint2(mm_pack(h[0], h[1]), mm_pack(h[2], h[3]));
            if (MM_PASSES == 3) *(uint2*)(dst + BM * MM_PITCH) = make_uint2(mm_pack(l[0], l[1]), mm_pack(l[2], l[3]));
        }
        __syncthreads();
#pragma unroll
        for (int ks = 0; ks < MM_BK; ks += 16) {
            u32 a[2][MM_PLANES][4], b[NT][MM_PLANES][2];
#pragma unroll
            for (int mi = 0; mi < 2; mi++)
#pragma unroll
                for (int pl = 0; pl < MM_PLANES; pl++) {
                    const u16* base = A + pl * MM_BN * MM_PITCH + (wm * 32 + mi * 16 + g) * MM_PITCH + ks + 2 * t4;
                    a[mi][pl][0] = *(const u32*)base;
                    a[mi][pl][1] = *(const u32*)(base + 8 * MM_PITCH);
                    a[mi][pl][2] = *(const u32*)(base + 8);
                    a[mi][pl][3] = *(const u32*)(base + 8 * MM_PITCH + 8);
                }
#pragma unroll
            for (int ni = 0; ni < NT; ni++)
#pragma unroll
                for (int pl = 0; pl < MM_PLANES; pl++) {
                    const u16* base = B + pl * BM * MM_PITCH + (wn * 8 * NT + ni * 8 + g) * MM_PITCH + ks + 2 * t4;
                    b[ni][pl][0] = *(const u32*)base;
                    b[ni][pl][1] = *(const u32*)(base + 8);
                }
#pragma unroll
            for (int mi = 0; mi < 2; mi++)
#pragma unroll
                for (int ni = 0; ni < NT; ni++) {
                    if (MM_PASSES == 3) {
                        mm_mma(acc[mi][ni], a[mi][MM_PLANES - 1], b[ni][0]);
                        mm_mma(acc[mi][ni], a[mi][0], b[ni][MM_PLANES - 1]);
                    }
                    mm_mma(acc[mi][ni], a[mi][0], b[ni][0]);
                }
        }
        __syncthreads();
    }
    // Epilogue: c0/c1 at (row g, tokens 2t, 2t+1), c2/c3 at row g + 8.
#pragma unroll
    for (int mi = 0; mi < 2; mi++)
#pragma unroll
        for (int ni = 0; ni < NT; ni++)
#pragma unroll
            for (int q = 0; q < 4; q++) {
                int r = r0 + wm * 32 + mi * 16 + g + 8 * (q >> 1);
                int j = wn * 8 * NT + ni * 8 + 2 * t4 + (q & 1);
                int yrow = yr[j];
                if (r < rows && yrow >= 0) {
                    float* yp = Y + (i64)yrow * ys + r;
                    *yp = accumulate ? *yp + acc[mi][ni][q] : acc[mi][ni][q];
                }
            }
}

template <int T, int NT>
__device__ __forceinline__ void mm_dense(const u8* W, i64 rb, int rows, int cols, const float* X, i64 xs, float* Y, i64 ys,
                                         int n, int accumulate) {
    extern __shared__ __align__(16) u16 mm_sm[];
    const int BM = 16 * NT;
    int* cm = (int*)(mm_sm + MM_PLANES * (MM_BN + BM) * MM_PITCH);
    int n0 = blockIdx.y * BM;
    for (int j = threadIdx.x; j < BM; j += MM_THREADS) cm[j] = n0 + j < n ? n0 + j : -1;
    __syncthreads();
    mm_tile<T, NT>(W, rb, rows, cols, X, xs, Y, ys, blockIdx.x * MM_BN, cm, cm, accumulate, mm_sm);
}

template <int T, int NT>
__device__ __forceinline__ void mm_grouped(const u8* W, i64 rb, i64 es, int rows, int cols, const float* X, i64 xs, int x_div,
                                           float* Y, i64 ys, const int* tiles, const int* ntiles, const int* list) {
    extern __shared__ __align__(16) u16 mm_sm[];
    const int BM = 16 * NT;
    int tile = blockIdx.y;
    if (tile >= *ntiles) return;
    int e = tiles[3 * tile], s = tiles[3 * tile + 1], c = tiles[3 * tile + 2];
    int* xr = (int*)(mm_sm + MM_PLANES * (MM_BN + BM) * MM_PITCH);
    int* yr = xr + BM;
    for (int j = threadIdx.x; j < BM; j += MM_THREADS) {
        int p = j < c ? list[s + j] : -1;
        xr[j] = p >= 0 ? p / x_div : -1;
        yr[j] = p;
    }
    __syncthreads();
    mm_tile<T, NT>(W + (i64)e * es, rb, rows, cols, X, xs, Y, ys, blockIdx.x * MM_BN, xr, yr, 0, mm_sm);
}

#define MM_CAT3(a, b, c) a##b##c
#define MM_NAME(kind, name, nt, p) MM_CAT3(kind##_##name##_##nt, _p, p)

#define MM_INST_DENSE(name, T, NT)                                                                                \
    extern "C" __global__ void __launch_bounds__(MM_THREADS) MM_NAME(mm, name, NT, MM_PASSES)(                   \
        const u8* W, i64 rb, int rows, int cols, const float* X, i64 xs, float* Y, i64 ys, int n, int acc) {       \
        mm_dense<T, NT>(W, rb, rows, cols, X, xs, Y, ys, n, acc);                                                  \
    }
#define MM_INST_GROUPED(name, T, NT)                                                                              \
    extern "C" __global__ void __launch_bounds__(MM_THREADS) MM_NAME(mmg, name, NT, MM_PASSES)(                  \
        const u8* W, i64 rb, i64 es, int rows, int cols, const float* X, i64 xs, int x_div, float* Y, i64 ys,      \
        const int* tiles, const int* ntiles, const int* list) {                                                    \
        mm_grouped<T, NT>(W, rb, es, rows, cols, X, xs, x_div, Y, ys, tiles, ntiles, list);                       \
    }

// Token tiles: dense 32 and 128 (fill the GPU at 512 tokens; reuse weights 4x more at 4k),
// grouped experts 16 and 64 (few tokens per expert at a 512-token prefill, many in 4k chunks).
// Kept to four kernels per type: NVRTC time and CUBIN size grow with every instance.
#define MM_INST(name, T)          \
    MM_INST_DENSE(name, T, 2)     \
    MM_INST_DENSE(name, T, 8)     \
    MM_INST_GROUPED(name, T, 1)   \
    MM_INST_GROUPED(name, T, 4)

MM_INST(f32, T_F32)
MM_INST(f16, T_F16)
MM_INST(bf16, T_BF16)
MM_INST(q4_0, T_Q4_0)
MM_INST(q4_1, T_Q4_1)
MM_INST(q5_0, T_Q5_0)
MM_INST(q5_1, T_Q5_1)
MM_INST(q8_0, T_Q8_0)
MM_INST(q2_k, T_Q2_K)
MM_INST(q3_k, T_Q3_K)
MM_INST(q4_k, T_Q4_K)
MM_INST(q5_k, T_Q5_K)
MM_INST(q6_k, T_Q6_K)
MM_INST(iq4_nl, T_IQ4_NL)
MM_INST(iq4_xs, T_IQ4_XS)
MM_INST(mxfp4, T_MXFP4)
