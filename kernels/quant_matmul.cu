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

template <> __device__ __forceinline__ void mm_dq32<T_Q8_0>(const u8* row, int c, float* v) { dq32_q8_0_a2(row, c, v); }

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

// Split K (gridDim.z > 1): block z takes columns [z·kz, z·kz + kz) (kz a multiple of 64 and of
// the type's block) and writes its partial product to Y + z·ypart (no accumulation);
// mm_sum_parts adds the parts in order.
template <int T, int NT>
__device__ __forceinline__ void mm_dense(const u8* W, i64 rb, int rows, int cols, const float* X, i64 xs, float* Y, i64 ys,
                                         int n, int accumulate, int kz, i64 ypart) {
    extern __shared__ __align__(16) u16 mm_sm[];
    if (gridDim.z > 1) {
        int kb = blockIdx.z * kz;
        W += (i64)(kb / Q<T>::BE) * Q<T>::BB;
        X += kb;
        cols = min(kz, cols - kb);
        Y += blockIdx.z * ypart;
        accumulate = 0;
    }
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

#if MM_PASSES == 1
// Y[t][r] (+)= the sum over p < parts of P[p][t][r] in order (P parts ypart floats apart, rows
// `rows` apart): the split-K reduction. One thread per output.
extern "C" __global__ void mm_sum_parts(const float* P, i64 ypart, int parts, float* Y, i64 ys, int rows, int n, int accumulate) {
    i64 i = (i64)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= (i64)rows * n) return;
    int t = (int)(i / rows), r = (int)(i - (i64)t * rows);
    float s = 0.f;
    for (int p = 0; p < parts; p++) s += P[p * ypart + i];
    float* yp = Y + (i64)t * ys + r;
    *yp = accumulate ? *yp + s : s;
}
#endif

#define MM_CAT3(a, b, c) a##b##c
#define MM_NAME(kind, name, nt, p) MM_CAT3(kind##_##name##_##nt, _p, p)

#define MM_INST_DENSE(name, T, NT)                                                                                \
    extern "C" __global__ void __launch_bounds__(MM_THREADS) MM_NAME(mm, name, NT, MM_PASSES)(                   \
        const u8* W, i64 rb, int rows, int cols, const float* X, i64 xs, float* Y, i64 ys, int n, int acc, int kz,  \
        i64 ypart) {                                                                                               \
        mm_dense<T, NT>(W, rb, rows, cols, X, xs, Y, ys, n, acc, kz, ypart);                                       \
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

// ================================================================================================
// Fast path (mq): weights as exact small integers, staged raw with coalesced cp.async.
//
// For IQ4_XS, Q4_K, Q6_K and Q8_0 every weight is (f32 scale of its 16- or 32-column sub-block)
// x (small integer) (- f32 min x 1 for Q4_K). The integers are exact in bf16, so the tensor cores
// multiply them with X split into hi + lo bf16 parts (MQ_P = 2 planes: ~16 significant bits of X,
// the products exact, f32 accumulation) or X's hi part only (MQ_P = 1); each sub-block's partial
// sums are then scaled in f32: acc += scale * (Σ q·x) (- min * Σx, the X sums per 32 columns
// coming from the X conversion). Two MMAs per k-step instead of bf16x3's three, and no per-weight
// float multiply or hi/lo split of W.
//
// X is converted once per product (mq_x_pP): row r of Xc holds, per 4 columns, the hi parts then
// (MQ_P = 2) the lo parts, 8·MQ_P bytes; optional f32 sums per 32 columns. gate·SiLU·up can be
// fused into that conversion (the down projection's input).
//
// A block (256 threads, 8 warps) owns MQ_BR = 128 weight rows x BM tokens and walks K one stage
// (KS = 256 columns, 128 for Q8_0) at a time through a ring of ST stages: each stage holds the
// rows' raw quant blocks (16-byte-aligned spans copied with cp.async, consecutive threads take
// consecutive 16-byte pieces of a row) and the X tile (cp.async from Xc); the next stages' copies
// are in flight while this one is multiplied. Warps are WR along the rows (MI m16 tiles each) x
// 8/WR along the tokens (NI n8 tiles each); each warp dequantizes its own rows straight into A
// fragments (no bf16 weight tile in shared memory). K order inside a 16-column group: thread t
// holds columns 4t..4t+3 in MMA slots 2t, 2t+1, 2t+8, 2t+9, so its A pair registers come from 4
// consecutive quant bytes and its B fragment is 4 consecutive X columns (one 8·MQ_P-byte load).
// Row pitches are odd multiples of 16 bytes (raw) and 64/32 mod 128 (X): conflict-free loads.
// ================================================================================================

#define MQ_P (MM_PASSES == 1 ? 1 : 2)
#define MQ_BR 128
#define MQ_THREADS 256

template <int T> struct MQT;
// KS: columns per stage; NSC: scales per row per stage; SC16: scales per 16 columns; MIN: Q4_K's mins.
template <> struct MQT<T_IQ4_XS> { static const int KS = 256, NSC = 8, SC16 = 0, MIN = 0; };
template <> struct MQT<T_Q4_K> { static const int KS = 256, NSC = 8, SC16 = 0, MIN = 1; };
template <> struct MQT<T_Q6_K> { static const int KS = 256, NSC = 16, SC16 = 1, MIN = 0; };
template <> struct MQT<T_Q8_0> { static const int KS = 128, NSC = 4, SC16 = 0, MIN = 0; };

// Raw bytes of a row per stage and the row pitch in shared memory: an odd multiple of 16 that
// holds the 16-byte-aligned span around them.
template <int T> __host__ __device__ constexpr int mq_sb() { return MQT<T>::KS / Q<T>::BE * Q<T>::BB; }
template <int T> __host__ __device__ constexpr int mq_sp() { return 16 * ((((mq_sb<T>() + 15) / 16) + 1) | 1); }
// Compact pitch (CP = 1: no odd-multiple padding, 2-way conflicts on the A loads) so that a
// 32-token, 2-stage block fits twice in an SM's shared memory.
template <int T, int CP> __host__ __device__ constexpr int mq_spc() { return CP ? 16 * ((mq_sb<T>() + 15) / 16 + 1) : mq_sp<T>(); }
__host__ __device__ constexpr int mq_xp(int ks) { return ks * 2 * MQ_P + 32 * MQ_P; }
template <int T, int BM, int CP = 0> __host__ __device__ constexpr int mq_stage() {
    return MQ_BR * mq_spc<T, CP>() + BM * mq_xp(MQT<T>::KS) + (MQT<T>::MIN ? BM * (MQT<T>::KS / 32) * 4 : 0);
}
// Whole dynamic shared memory: ST stages, per-warp scales (and mins), X / Y row maps.
template <int T, int BM, int MI, int ST> __host__ __device__ constexpr int mq_smem() {
    return ST * mq_stage<T, BM>() + (MQT<T>::MIN ? 2 : 1) * 8 * MQT<T>::NSC * MI * 8 * 8 + 2 * BM * 4;
}

__device__ __forceinline__ u32 mq_saddr(const void* p) {
    u32 r;
    asm("{ .reg .u64 t; cvta.to.shared.u64 t, %1; cvt.u32.u64 %0, t; }" : "=r"(r) : "l"(p));
    return r;
}
__device__ __forceinline__ void mq_cp16(void* dst, const void* src) {
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16;" ::"r"(mq_saddr(dst)), "l"(src) : "memory");
}
// mq_cp16 to a shared-space address (converted once by the caller, offsets added in 32 bits).
__device__ __forceinline__ void mq_cp16s(u32 dst, const void* src) {
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16;" ::"r"(dst), "l"(src) : "memory");
}
__device__ __forceinline__ void mq_commit() { asm volatile("cp.async.commit_group;" ::: "memory"); }
template <int N> __device__ __forceinline__ void mq_wait() { asm volatile("cp.async.wait_group %0;" ::"n"(N) : "memory"); }

// a * 1 + c on two bf16 lanes (exact here: small integers).
__device__ __forceinline__ u32 mq_bf2_add(u32 a, u32 c) {
    u32 d;
    asm("fma.rn.bf16x2 %0, %1, %2, %3;" : "=r"(d) : "r"(a), "r"(0x3f803f80u), "r"(c));
    return d;
}
// Two bytes of a 2-byte-aligned address as one u32 of 4 bytes (p and p + 2).
__device__ __forceinline__ u32 mq_ld4a2(const u8* p) { return (u32) * (const u16*)p | ((u32) * (const u16*)(p + 2) << 16); }

// IQ4_XS: the bf16 bits of KV_IQ4 as low-byte (L) and high-byte (H) planes, 4 entries a register.
#define MQ_IQ4_L0 0x82a6d0feu
#define MQ_IQ4_L1 0x20b00c44u
#define MQ_IQ4_L2 0x18c85080u
#define MQ_IQ4_L3 0xe2b28a54u
#define MQ_IQ4_H0 0xc2c2c2c2u
#define MQ_IQ4_H1 0xc1c1c2c2u
#define MQ_IQ4_H2 0x4241413fu
#define MQ_IQ4_H3 0x42424242u

// x = 4 bytes b0..b3 of nibble pairs (low nibble n_i, high h_i): bf16 pairs of KV_IQ4 values
// (n0, n1), (n2, n3), (h0, h1), (h2, h3) from byte permutes over the table in registers.
__device__ __forceinline__ void mq_iq4(u32 x, u32* n01, u32* n23, u32* h01, u32* h23) {
    u32 s = x & 0x77777777u;                              // entry within a half table
    u32 hs = 0x32103210u | ((x >> 1) & 0x44444444u);      // nibble bit 3: take the upper half
    u32 s1 = s >> 16, hs1 = hs >> 16;
    u32 l0 = __byte_perm(__byte_perm(MQ_IQ4_L0, MQ_IQ4_L1, s), __byte_perm(MQ_IQ4_L2, MQ_IQ4_L3, s), hs);
    u32 g0 = __byte_perm(__byte_perm(MQ_IQ4_H0, MQ_IQ4_H1, s), __byte_perm(MQ_IQ4_H2, MQ_IQ4_H3, s), hs);
    u32 l1 = __byte_perm(__byte_perm(MQ_IQ4_L0, MQ_IQ4_L1, s1), __byte_perm(MQ_IQ4_L2, MQ_IQ4_L3, s1), hs1);
    u32 g1 = __byte_perm(__byte_perm(MQ_IQ4_H0, MQ_IQ4_H1, s1), __byte_perm(MQ_IQ4_H2, MQ_IQ4_H3, s1), hs1);
    // l0 = [L(n0), L(h0), L(n1), L(h1)], g0 the high bytes; l1 / g1 for bytes 2, 3.
    *n01 = __byte_perm(l0, g0, 0x6240);
    *h01 = __byte_perm(l0, g0, 0x7351);
    *n23 = __byte_perm(l1, g1, 0x6240);
    *h23 = __byte_perm(l1, g1, 0x7351);
}

// Bytes b0..b3 of x (each < 128) as bf16 pairs (b0 + c, b1 + c), (b2 + c, b3 + c): 0x4300 | b is
// bf16 128 + b, exact; c2 = the bf16x2 of (c - 128) twice.
__device__ __forceinline__ void mq_u7(u32 x, u32 c2, u32* p01, u32* p23) {
    *p01 = mq_bf2_add(__byte_perm(x, 0, 0x4140) | 0x43004300u, c2);
    *p23 = mq_bf2_add(__byte_perm(x, 0, 0x4342) | 0x43004300u, c2);
}

// Dequantization of 32 columns (chunk c of the stage) of rows g (p0) and g + 8 (p1) into the A
// fragments of the two 16-column groups: a[h][0] = row g, columns 16h + 4t, +1; a[h][1] the same
// for row g + 8; a[h][2] / a[h][3] columns 16h + 4t + 2, +3. Integers only; scales apart.
template <int T> __device__ __forceinline__ void mq_dq(const u8* p0, const u8* p1, int c, int t, u32 (*a)[4]);

template <> __device__ __forceinline__ void mq_dq<T_IQ4_XS>(const u8* p0, const u8* p1, int c, int t, u32 (*a)[4]) {
    u32 x0 = *(const u32*)(p0 + 8 + 16 * c + 4 * t);
    u32 x1 = *(const u32*)(p1 + 8 + 16 * c + 4 * t);
    mq_iq4(x0, &a[0][0], &a[0][2], &a[1][0], &a[1][2]);
    mq_iq4(x1, &a[0][1], &a[0][3], &a[1][1], &a[1][3]);
}
template <> __device__ __forceinline__ void mq_dq<T_Q4_K>(const u8* p0, const u8* p1, int c, int t, u32 (*a)[4]) {
    int off = 16 + 32 * (c >> 1) + 4 * t, sh = 4 * (c & 1);
    const u32 m128 = 0xc300c300u;  // -128, -128
#pragma unroll
    for (int h = 0; h < 2; h++) {
        u32 x0 = (*(const u32*)(p0 + off + 16 * h) >> sh) & 0x0f0f0f0fu;
        u32 x1 = (*(const u32*)(p1 + off + 16 * h) >> sh) & 0x0f0f0f0fu;
        mq_u7(x0, m128, &a[h][0], &a[h][2]);
        mq_u7(x1, m128, &a[h][1], &a[h][3]);
    }
}
template <> __device__ __forceinline__ void mq_dq<T_Q6_K>(const u8* p0, const u8* p1, int c, int t, u32 (*a)[4]) {
    int g = c >> 2, k = c & 3;
    int ql = 64 * g + 32 * (k & 1) + 4 * t, qh = 128 + 32 * g + 4 * t, sl = 4 * (k >> 1), sh = 2 * k;
    const u32 m160 = 0xc320c320u;  // -160, -160: (128 + q) - 160 = q - 32
#pragma unroll
    for (int h = 0; h < 2; h++) {
        u32 x0 = ((mq_ld4a2(p0 + ql + 16 * h) >> sl) & 0x0f0f0f0fu) | (((mq_ld4a2(p0 + qh + 16 * h) >> sh) & 0x03030303u) << 4);
        u32 x1 = ((mq_ld4a2(p1 + ql + 16 * h) >> sl) & 0x0f0f0f0fu) | (((mq_ld4a2(p1 + qh + 16 * h) >> sh) & 0x03030303u) << 4);
        mq_u7(x0, m160, &a[h][0], &a[h][2]);
        mq_u7(x1, m160, &a[h][1], &a[h][3]);
    }
}
// int8 q -> exact f32 -> bf16 (its upper half): 2^23 + (q + 128) - (2^23 + 128).
__device__ __forceinline__ float mq_i8f(u32 x, int sel) { return __uint_as_float(__byte_perm(x, 0x4b000000u, sel)) - 8388736.0f; }
__device__ __forceinline__ void mq_i8(u32 x, u32* p01, u32* p23) {
    x ^= 0x80808080u;
    float f0 = mq_i8f(x, 0x7540), f1 = mq_i8f(x, 0x7541), f2 = mq_i8f(x, 0x7542), f3 = mq_i8f(x, 0x7543);
    *p01 = __byte_perm(__float_as_uint(f0), __float_as_uint(f1), 0x7632);
    *p23 = __byte_perm(__float_as_uint(f2), __float_as_uint(f3), 0x7632);
}
template <> __device__ __forceinline__ void mq_dq<T_Q8_0>(const u8* p0, const u8* p1, int c, int t, u32 (*a)[4]) {
    int off = 34 * c + 2 + 4 * t;
#pragma unroll
    for (int h = 0; h < 2; h++) {
        mq_i8(mq_ld4a2(p0 + off + 16 * h), &a[h][0], &a[h][2]);
        mq_i8(mq_ld4a2(p1 + off + 16 * h), &a[h][1], &a[h][3]);
    }
}

// Scale i (and min) of one row's stage data: the same f32 operations as dq32.
template <int T> __device__ __forceinline__ void mq_scale(const u8* b, int i, float* sc, float* mn);
template <> __device__ __forceinline__ void mq_scale<T_IQ4_XS>(const u8* b, int i, float* sc, float* mn) {
    float d = ld_h(b);
    u32 scales_h = ld_u16(b + 2);
    int low = (b[4 + i / 2] >> (4 * (i & 1))) & 15;
    int high = (scales_h >> (2 * i)) & 3;
    *sc = __fmul_rn(d, (float)((low | (high << 4)) - 32));
    *mn = 0.f;
}
template <> __device__ __forceinline__ void mq_scale<T_Q4_K>(const u8* b, int i, float* sc, float* mn) {
    float d = ld_h(b), dmin = ld_h(b + 2);
    int s, m;
    scale_min_k4(b + 4, i, &s, &m);
    *sc = __fmul_rn(d, (float)s);
    *mn = __fmul_rn(dmin, (float)m);
}
template <> __device__ __forceinline__ void mq_scale<T_Q6_K>(const u8* b, int i, float* sc, float* mn) {
    *sc = __fmul_rn(ld_h(b + 208), (float)((const i8*)(b + 192))[i]);
    *mn = 0.f;
}
template <> __device__ __forceinline__ void mq_scale<T_Q8_0>(const u8* b, int i, float* sc, float* mn) {
    *sc = ld_h(b + 34 * i);
    *mn = 0.f;
}

// One output tile: rows r0.. of W (expert applied), token column j = X row xr[j] of Xc, Y row
// yr[j] (-1: none); columns from nvalid on are all -1. Xc rows xcp bytes apart; Xs (Q4_K) sums per 32 columns, xsp floats apart.
template <int T, int WR, int MI, int NI, int ST, int CP>
__device__ __forceinline__ void mq_tile(const u8* W, i64 rb, int rows, int cols, const u8* Xc, i64 xcp, const float* Xs,
                                        i64 xsp, float* Y, i64 ys, int r0, const int* xr, const int* yr, int nvalid,
                                        int accumulate, u8* sm) {
    constexpr int WC = 8 / WR, BM = 8 * NI * WC;
    constexpr int KS = MQT<T>::KS, BE = Q<T>::BE, BB = Q<T>::BB, NSC = MQT<T>::NSC;
    constexpr int SP = mq_spc<T, CP>(), XB = 2 * MQ_P, XP = mq_xp(KS);
    constexpr int WSZ = MQ_BR * SP, XSZ = BM * XP, STB = mq_stage<T, BM, CP>();
    constexpr int WCH = SP / 16, XCH = KS * XB / 16, NCH = KS / 32;
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5, g = lane >> 2, t = lane & 3;
    const int wm = warp % WR, wn = warp / WR;
    float2* scb = (float2*)(sm + ST * STB);
    float2* scw = scb + warp * (NSC * MI * 8);
    float2* mnw = scb + 8 * NSC * MI * 8 + warp * (NSC * MI * 8);
    const int nk = (cols + KS - 1) / KS;
    const int nvw = nvalid - wn * NI * 8;

    auto load = [&](int ks, int slot) {
        if (ks < nk) {
            int k0 = ks * KS;
            int nv = min(KS, cols - k0);
            int nbytes = nv / BE * BB;
            u8* ws = sm + slot * STB;
            const u8* wk = W + (i64)(k0 / BE) * BB;
            for (int i = tid; i < MQ_BR * WCH; i += MQ_THREADS) {
                int r = i / WCH, ch = i - r * WCH;
                if (r0 + r < rows) {
                    u64 s = (u64)(wk + (i64)(r0 + r) * rb);
                    u64 a = s & ~(u64)15;
                    int nch = (int)((s + nbytes - a + 15) >> 4);
                    if (ch < nch) mq_cp16(ws + r * SP + 16 * ch, (const void*)(a + 16 * ch));
                }
            }
            u8* xsm = ws + WSZ;
            int xch = nv * XB / 16;
            for (int i = tid; i < BM * XCH; i += MQ_THREADS) {
                int j = i / XCH, ch = i - j * XCH;
                int xrow = xr[j];
                if (xrow >= 0 && ch < xch) mq_cp16(xsm + j * XP + 16 * ch, Xc + (i64)xrow * xcp + (i64)k0 * XB + 16 * ch);
            }
            if (MQT<T>::MIN) {
                u8* ssm = xsm + XSZ;
                for (int i = tid; i < BM * (NCH / 4); i += MQ_THREADS) {
                    int j = i / (NCH / 4), ch = i - j * (NCH / 4);
                    int xrow = xr[j];
                    if (xrow >= 0 && 4 * ch < nv / 32) mq_cp16(ssm + j * NCH * 4 + 16 * ch, Xs + (i64)xrow * xsp + k0 / 32 + 4 * ch);
                }
            }
        }
        mq_commit();
    };

    float acc[MI][NI][4];
#pragma unroll
    for (int mi = 0; mi < MI; mi++)
#pragma unroll
        for (int ni = 0; ni < NI; ni++)
#pragma unroll
            for (int q = 0; q < 4; q++) acc[mi][ni][q] = 0.f;

#pragma unroll
    for (int s = 0; s < ST - 1; s++) load(s, s);

    for (int ks = 0; ks < nk; ks++) {
        mq_wait<ST - 2>();
        __syncthreads();
        load(ks + ST - 1, (ks + ST - 1) % ST);
        const int k0 = ks * KS;
        const u8* ws = sm + (ks % ST) * STB;
        const u8* xsm = ws + WSZ;
        const float* ssm = (const float*)(xsm + XSZ);
        const u8* wk = W + (i64)(k0 / BE) * BB;
        // This thread's rows g and g + 8 of each m tile (where their aligned spans start).
        const u8* rp[MI][2];
#pragma unroll
        for (int mi = 0; mi < MI; mi++)
#pragma unroll
            for (int h = 0; h < 2; h++) {
                int r = wm * 16 * MI + mi * 16 + 8 * h + g;
                rp[mi][h] = ws + r * SP + (int)((u64)(wk + (i64)(r0 + r) * rb) & 15);
            }
        // Scales (and mins) of the warp's rows for this stage: [i][mi][g] = {row g, row g + 8}.
        for (int e = lane; e < NSC * MI * 16; e += 32) {
            int i = e / (MI * 16), rem = e - i * (MI * 16), mi = rem >> 4, h = (rem >> 3) & 1, gg = rem & 7;
            int r = wm * 16 * MI + mi * 16 + 8 * h + gg;
            const u8* row = ws + r * SP + (int)((u64)(wk + (i64)(r0 + r) * rb) & 15);
            float sc, mn;
            mq_scale<T>(row, i, &sc, &mn);
            ((float*)scw)[((i * MI + mi) * 8 + gg) * 2 + h] = sc;
            if (MQT<T>::MIN) ((float*)mnw)[((i * MI + mi) * 8 + gg) * 2 + h] = mn;
        }
        __syncwarp();
        const int nc = min(KS, cols - k0) / 32;
        // Warps whose token columns all lie past the tile's valid ones skip the products.
        if (nvw > 0) {
#pragma unroll
            for (int c = 0; c < NCH; c++) {
                if (c < nc) {
                    u32 a[MI][2][4];
#pragma unroll
                    for (int mi = 0; mi < MI; mi++) mq_dq<T>(rp[mi][0], rp[mi][1], c, t, a[mi]);
                    u32 b[NI][2][2 * MQ_P];
#pragma unroll
                    for (int ni = 0; ni < NI; ni++)
#pragma unroll
                        for (int h = 0; h < 2; h++) {
                            const u8* xp = xsm + (wn * NI * 8 + ni * 8 + g) * XP + (c * 32 + h * 16 + 4 * t) * XB;
                            if (MQ_P == 2) {
                                uint4 v = *(const uint4*)xp;
                                b[ni][h][0] = v.x;
                                b[ni][h][1] = v.y;
                                b[ni][h][2 * MQ_P - 2] = v.z;
                                b[ni][h][2 * MQ_P - 1] = v.w;
                            } else {
                                uint2 v = *(const uint2*)xp;
                                b[ni][h][0] = v.x;
                                b[ni][h][1] = v.y;
                            }
                        }
#pragma unroll
                    for (int h0 = 0; h0 < 2; h0 += (MQT<T>::SC16 ? 1 : 2)) {
                        float tmp[MI][NI][4];
#pragma unroll
                        for (int mi = 0; mi < MI; mi++)
#pragma unroll
                            for (int ni = 0; ni < NI; ni++)
#pragma unroll
                                for (int q = 0; q < 4; q++) tmp[mi][ni][q] = 0.f;
#pragma unroll
                        for (int h = h0; h < (MQT<T>::SC16 ? h0 + 1 : 2); h++)
#pragma unroll
                            for (int mi = 0; mi < MI; mi++)
#pragma unroll
                                for (int ni = 0; ni < NI; ni++) {
                                    mm_mma(tmp[mi][ni], a[mi][h], &b[ni][h][0]);
                                    if (MQ_P == 2) mm_mma(tmp[mi][ni], a[mi][h], &b[ni][h][2 * MQ_P - 2]);
                                }
                        const int si = MQT<T>::SC16 ? 2 * c + h0 : c;
#pragma unroll
                        for (int mi = 0; mi < MI; mi++) {
                            float2 s2 = scw[(si * MI + mi) * 8 + g];
#pragma unroll
                            for (int ni = 0; ni < NI; ni++)
#pragma unroll
                                for (int q = 0; q < 4; q++) acc[mi][ni][q] = fmaf(q < 2 ? s2.x : s2.y, tmp[mi][ni][q], acc[mi][ni][q]);
                            if (MQT<T>::MIN) {
                                float2 m2 = mnw[(si * MI + mi) * 8 + g];
#pragma unroll
                                for (int ni = 0; ni < NI; ni++) {
                                    int j = wn * NI * 8 + ni * 8 + 2 * t;
                                    float x0 = ssm[j * NCH + c], x1 = ssm[(j + 1) * NCH + c];
#pragma unroll
                                    for (int q = 0; q < 4; q++) acc[mi][ni][q] = fmaf(-(q < 2 ? m2.x : m2.y), q & 1 ? x1 : x0, acc[mi][ni][q]);
                                }
                            }
                        }
                    }
                }
            }
        }
    }
    mq_wait<0>();
    // Epilogue: c0/c1 at (row g, tokens 2t, 2t+1), c2/c3 at row g + 8.
#pragma unroll
    for (int mi = 0; mi < MI; mi++)
#pragma unroll
        for (int ni = 0; ni < NI; ni++)
#pragma unroll
            for (int q = 0; q < 4; q++) {
                int r = r0 + wm * 16 * MI + mi * 16 + g + 8 * (q >> 1);
                int j = wn * NI * 8 + ni * 8 + 2 * t + (q & 1);
                int yrow = yr[j];
                if (r < rows && yrow >= 0) {
                    float* yp = Y + (i64)yrow * ys + r;
                    *yp = accumulate ? *yp + acc[mi][ni][q] : acc[mi][ni][q];
                }
            }
}

template <int T, int WR, int MI, int NI, int ST, int CP>
__device__ __forceinline__ void mq_dense(const u8* W, i64 rb, int rows, int cols, const u8* Xc, i64 xcp, const float* Xs, i64 xsp,
                                         float* Y, i64 ys, int n, int accumulate) {
    extern __shared__ __align__(16) u8 mq_sm[];
    constexpr int BM = 8 * NI * (8 / WR);
    int* cm = (int*)(mq_sm + ST * mq_stage<T, BM, CP>() + (MQT<T>::MIN ? 2 : 1) * 8 * MQT<T>::NSC * MI * 8 * 8);
    int n0 = blockIdx.y * BM;
    for (int j = threadIdx.x; j < BM; j += MQ_THREADS) cm[j] = n0 + j < n ? n0 + j : -1;
    __syncthreads();
    mq_tile<T, WR, MI, NI, ST, CP>(W, rb, rows, cols, Xc, xcp, Xs, xsp, Y, ys, blockIdx.x * MQ_BR, cm, cm, min(BM, n - n0), accumulate, mq_sm);
}

template <int T, int WR, int MI, int NI, int ST, int CP>
__device__ __forceinline__ void mq_grouped(const u8* W, i64 rb, i64 es, int rows, int cols, const u8* Xc, i64 xcp, const float* Xs,
                                           i64 xsp, int x_div, float* Y, i64 ys, const int* tiles, const int* ntiles, const int* list) {
    extern __shared__ __align__(16) u8 mq_sm[];
    constexpr int BM = 8 * NI * (8 / WR);
    int tile = blockIdx.y;
    if (tile >= *ntiles) return;
    int e = tiles[3 * tile], s = tiles[3 * tile + 1], c = tiles[3 * tile + 2];
    int* xr = (int*)(mq_sm + ST * mq_stage<T, BM, CP>() + (MQT<T>::MIN ? 2 : 1) * 8 * MQT<T>::NSC * MI * 8 * 8);
    int* yr = xr + BM;
    for (int j = threadIdx.x; j < BM; j += MQ_THREADS) {
        int p = j < c ? list[s + j] : -1;
        xr[j] = p >= 0 ? p / x_div : -1;
        yr[j] = p;
    }
    __syncthreads();
    mq_tile<T, WR, MI, NI, ST, CP>(W + (i64)e * es, rb, rows, cols, Xc, xcp, Xs, xsp, Y, ys, blockIdx.x * MQ_BR, xr, yr, c, 0, mq_sm);
}

// X conversion: Xc row r from X row r (x = silu(X) * U when U is given: the gated expert
// activation, same formula as silu_mul); S (optional) gets the sums of each 32 columns.
// grid (rows, ceil(cols / 128)), block 32: a thread converts 4 columns.
__device__ __forceinline__ void mq_x(const float* X, i64 xs, const float* U, int cols, u8* Xc, i64 xcp, float* S, i64 sp) {
    int r = blockIdx.x, c = (blockIdx.y * 32 + threadIdx.x) * 4;
    float4 x = make_float4(0.f, 0.f, 0.f, 0.f);
    if (c < cols) {
        x = *(const float4*)(X + (i64)r * xs + c);
        if (U) {
            float4 u = *(const float4*)(U + (i64)r * xs + c);
            x.x = x.x / (1.0f + expf(-x.x)) * u.x;
            x.y = x.y / (1.0f + expf(-x.y)) * u.y;
            x.z = x.z / (1.0f + expf(-x.z)) * u.z;
            x.w = x.w / (1.0f + expf(-x.w)) * u.w;
        }
        u16 h[4], l[4];
        mm_split(x.x, &h[0], &l[0]);
        mm_split(x.y, &h[1], &l[1]);
        mm_split(x.z, &h[2], &l[2]);
        mm_split(x.w, &h[3], &l[3]);
        u8* d = Xc + (i64)r * xcp + (i64)c * 2 * MQ_P;
        if (MQ_P == 2)
            *(uint4*)d = make_uint4(mm_pack(h[0], h[1]), mm_pack(h[2], h[3]), mm_pack(l[0], l[1]), mm_pack(l[2], l[3]));
        else
            *(uint2*)d = make_uint2(mm_pack(h[0], h[1]), mm_pack(h[2], h[3]));
    }
    if (S) {
        float s = (x.x + x.y) + (x.z + x.w);
        s += __shfl_xor_sync(0xffffffffu, s, 1);
        s += __shfl_xor_sync(0xffffffffu, s, 2);
        s += __shfl_xor_sync(0xffffffffu, s, 4);
        if ((threadIdx.x & 7) == 0 && c < cols) S[(i64)r * sp + c / 32] = s;
    }
}
#define MQ_NAME(base, p) MM_CAT3(base, _p, p)
// Two names for the benchmark's per-phase split: mm_x (dense products), mmg_x (experts).
extern "C" __global__ void MQ_NAME(mm_x, MM_PASSES)(const float* X, i64 xs, const float* U, int cols, u8* Xc, i64 xcp, float* S, i64 sp) {
    mq_x(X, xs, U, cols, Xc, xcp, S, sp);
}
extern "C" __global__ void MQ_NAME(mmg_x, MM_PASSES)(const float* X, i64 xs, const float* U, int cols, u8* Xc, i64 xcp, float* S, i64 sp) {
    mq_x(X, xs, U, cols, Xc, xcp, S, sp);
}

// Configurations (must match FAST_TILES in matmul.rs): C16 = 8 warps x 16 rows, 16 tokens, 2
// stages, two blocks an SM; C32 = 8 x 16 rows, 32 tokens, 3 stages; C64 = 4 x 32 rows by 2 x 32
// tokens, 2 stages.
#define MQ_INST_CFG(name, T, BM, WR, MI, NI, ST, MINB, CP, SUF)                                                       \
    extern "C" __global__ void __launch_bounds__(MQ_THREADS, MINB) MQ_NAME(mm_f_##name##_##BM##SUF, MM_PASSES)(    \
        const u8* W, i64 rb, int rows, int cols, const u8* Xc, i64 xcp, const float* Xs, i64 xsp, float* Y, i64 ys,    \
        int n, int acc) {                                                                                              \
        mq_dense<T, WR, MI, NI, ST, CP>(W, rb, rows, cols, Xc, xcp, Xs, xsp, Y, ys, n, acc);                               \
    }                                                                                                                  \
    extern "C" __global__ void __launch_bounds__(MQ_THREADS, MINB) MQ_NAME(mmg_f_##name##_##BM##SUF, MM_PASSES)(   \
        const u8* W, i64 rb, i64 es, int rows, int cols, const u8* Xc, i64 xcp, const float* Xs, i64 xsp, int x_div,   \
        float* Y, i64 ys, const int* tiles, const int* ntiles, const int* list) {                                      \
        mq_grouped<T, WR, MI, NI, ST, CP>(W, rb, es, rows, cols, Xc, xcp, Xs, xsp, x_div, Y, ys, tiles, ntiles, list);     \
    }
// 32c: the 32-token tile with 2 stages and compact pitches, two blocks an SM where it fits.
#define MQ_INST(name, T)                           \
    MQ_INST_CFG(name, T, 16, 8, 1, 2, 2, 2, 0, )   \
    MQ_INST_CFG(name, T, 32, 8, 1, 4, 3, 1, 0, )   \
    MQ_INST_CFG(name, T, 64, 4, 2, 4, 2, 1, 0, )   \
    MQ_INST_CFG(name, T, 32, 8, 1, 4, 2, 2, 1, c)

MQ_INST(iq4_xs, T_IQ4_XS)
MQ_INST(q4_k, T_Q4_K)
MQ_INST(q6_k, T_Q6_K)
MQ_INST(q8_0, T_Q8_0)

// ================================================================================================
// int8 path (mi): IQ4_XS and Q8_0 weights as int8 A fragments, X quantized per 32 columns to
// int8 with an f32 scale per (row, 32-column block), mma.sync m16n8k32 s8 x s8 -> s32, one MMA
// per 32-column sub-block (the scale granularity of both weight types), scales folded in f32.
//
// X conversion (mm_x_i8 / mmg_x_i8): per 32 columns d = absmax / 127 (as the decode path's
// q8_lane), its significand then rounded up to 22 bits, q = rint(x / d). Row r of Xq holds per
// 64 columns (two chunks c0, c1) the B fragments in MMA order: for t = 0..3, 16 bytes
// [c0 x(4t..4t+3), c0 x(16+4t..16+4t+3), c1 x(4t..), c1 x(16+4t..)], so one 16-byte load gives a
// thread its fragments of two chunks. S row r holds per chunk (d, -1.5·2^23·d).
//
// Fold: the MMA's accumulator input is the bit pattern of 1.5·2^23, so each s32 result is the
// f32 1.5·2^23 + c exactly (|c| ≤ 32·128·127 < 2^22); fma(F, d, -1.5·2^23·d) is then c·d
// rounded once (the 22-bit significand makes 1.5·2^23·d exact), and acc = fma(that, w_scale,
// acc): two FMAs per output and chunk, no int-to-float conversions.
//
// A block (256 threads, 8 warps of 16 weight rows each, all BM tokens per warp) owns 128 rows x
// BM tokens and walks K in stages (256 columns IQ4_XS, 128 Q8_0) through a ring of ST stages
// filled with cp.async: the rows' raw blocks (as the mq path), the X tile (rows KS bytes, the
// 64-column halves of odd rows swapped: conflict-free 16-byte loads) and the X scales
// ([chunk][token] float2); ST (2..4) is a kernel argument. Tiles whose valid tokens fit in half
// (a quarter) of the columns run half (a quarter of) the MMAs.
// ================================================================================================
#if MM_PASSES == 1

#define MI_MAGIC 0x4B400000u
#define MI_MAGIC_F 12582912.0f
// Row pitch (in float2) of the mt kernels' X-scale tile: 8 chunks + 2 (80 bytes: the tokens of a
// lane quad land on distinct banks).
#define MT_SP 10

// Stage bytes: raw rows, X tile, X scales.
template <int T, int BM> __host__ __device__ constexpr int mi_stage() {
    return MQ_BR * mq_sp<T>() + BM * MQT<T>::KS + BM * (MQT<T>::KS / 32) * 8;
}
// Whole dynamic shared memory: ST stages, per-warp weight scales (MI m16 tiles a warp), X / Y
// row maps.
template <int T, int BM, int MI> __host__ __device__ constexpr int mi_smem(int st) {
    return st * mi_stage<T, BM>() + 8 * MI * (MQT<T>::KS / 32) * 8 * 8 + 2 * BM * 4;
}

__device__ __forceinline__ void mi_cp8(u32 dst, const void* src) {
    asm volatile("cp.async.ca.shared.global [%0], [%1], 8;" ::"r"(dst), "l"(src) : "memory");
}

// The constants of the products: the IQ4_XS codebook words that prmt takes from registers and
// the accumulator input bits(1.5·2^23). Literals (mi_k_lit) in the mi kernels; the mt kernels
// pass them XORed with a zero the compiler cannot see (mi_k_pinned), so that ptxas keeps them in
// registers instead of re-materializing them before every prmt and MMA (~6 moves a chunk).
struct MiK {
    u32 t0, t2, mg;
};
__device__ __forceinline__ MiK mi_k_lit() { return MiK{IQ4_T0, IQ4_T2, MI_MAGIC}; }
__device__ __forceinline__ MiK mi_k_pinned(u32 z) { return MiK{IQ4_T0 ^ z, IQ4_T2 ^ z, MI_MAGIC ^ z}; }

// d = s32 A·B + bits(1.5·2^23) (k.mg) for A 16x32 s8 (row), B 32x8 s8 (col).
__device__ __forceinline__ void mi_mma(u32* d, const u32* a, u32 b0, u32 b1, MiK k) {
    asm("mma.sync.aligned.m16n8k32.row.col.s32.s8.s8.s32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%10,%11,%12,%13};"
        : "=r"(d[0]), "=r"(d[1]), "=r"(d[2]), "=r"(d[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1), "r"(k.mg), "r"(k.mg), "r"(k.mg), "r"(k.mg));
}


// int8 A fragments of chunk c (32 columns) of rows g (p0) and g + 8 (p1): a[0] = row g, columns
// 4t..4t+3; a[1] = row g + 8, same; a[2] / a[3] columns 16 + 4t.. of rows g / g + 8.
template <int T> __device__ __forceinline__ void mi_dq(const u8* p0, const u8* p1, int c, int t, u32* a, MiK k);
// IQ4_XS A fragments in iq4_lookup_il's order (common.cuh): a0 = values (4t, 16+4t, 4t+1,
// 16+4t+1), a2 = (4t+2, 16+4t+2, 4t+3, 16+4t+3) of one u32 of a sub-block's qs, 6 byte permutes
// and 4 integer operations for 8 codes instead of iq4_lookup's sorted order. The MMA's k order
// is then permuted inside each thread's 8 k slots, and X is converted with the same permutation
// (mi_x, perm), so the products are unchanged.
template <> __device__ __forceinline__ void mi_dq<T_IQ4_XS>(const u8* p0, const u8* p1, int c, int t, u32* a, MiK k) {
    // Fragments a0 / a2 (row g) and a1 / a3 (row g + 8) in the permuted k order.
    iq4_lookup_il(*(const u32*)(p0 + 8 + 16 * c + 4 * t), a[0], a[2], k.t0, k.t2);
    iq4_lookup_il(*(const u32*)(p1 + 8 + 16 * c + 4 * t), a[1], a[3], k.t0, k.t2);
}
template <> __device__ __forceinline__ void mi_dq<T_Q8_0>(const u8* p0, const u8* p1, int c, int t, u32* a, MiK) {
    int off = 34 * c + 2 + 4 * t;
    a[0] = mq_ld4a2(p0 + off);
    a[2] = mq_ld4a2(p0 + off + 16);
    a[1] = mq_ld4a2(p1 + off);
    a[3] = mq_ld4a2(p1 + off + 16);
}

// The products of chunk c for the first NX n8 tiles of the warp's MI m16 tiles:
// acc[mi][ni] += w_scale · x_scale · (A · B); the warp's tokens start at column j0.
// The IQ4_XS sub-block scales of a warp's 16 rows for one stage into scw ([chunk][g] = {row g,
// row g + 8}): lane l reads row l % 16's super-block header (d, scales_h | scales_l; rows
// 4-byte aligned) at `row` and decodes sub-blocks 4 (l / 16) .. + 3 with mq_scale's f32 operations.
__device__ __forceinline__ void mi_iq4_scales(const u8* row, int lane, float2* scw) {
    const int rr = lane & 15, i0 = (lane >> 4) * 4;
    const u32 hd = *(const u32*)row, sl = *(const u32*)(row + 4);
    const float d = f16_to_f32((u16)(hd & 0xffffu));
#pragma unroll
    for (int q = 0; q < 4; q++) {
        const int i = i0 + q;
        const int ls = (int)((sl >> (4 * i)) & 15u) | (int)(((hd >> (16 + 2 * i)) & 3u) << 4);
        ((float*)scw)[(i * 8 + (rr & 7)) * 2 + (rr >> 3)] = __fmul_rn(d, (float)(ls - 32));
    }
}

// XT: X scales token-major, rows of MT_SP chunks (the mt kernels), else chunk-major.
template <int T, int BM, int MI, int NI, int NX, int XT = 0>
__device__ __forceinline__ void mi_chunk(float (*acc)[NI][4], const u32 (*a)[4], const uint4* b, int h, const float2* scw,
                                         const u8* xss, int c, int j0, int g, int t, MiK k) {
    constexpr int NCH = MQT<T>::KS / 32;
    float2 w[MI];
#pragma unroll
    for (int mi = 0; mi < MI; mi++) w[mi] = scw[(mi * NCH + c) * 8 + g];
#pragma unroll
    for (int ni = 0; ni < NX; ni++) {
        float4 s;
        if (XT) {
            const float2 s0 = *(const float2*)(xss + ((j0 + ni * 8 + 2 * t) * MT_SP + c) * 8);
            const float2 s1 = *(const float2*)(xss + ((j0 + ni * 8 + 2 * t + 1) * MT_SP + c) * 8);
            s = make_float4(s0.x, s0.y, s1.x, s1.y);
        } else {
            s = *(const float4*)(xss + (c * BM + j0 + ni * 8 + 2 * t) * 8);
        }
        const u32 b0 = h ? b[ni].z : b[ni].x, b1 = h ? b[ni].w : b[ni].y;
#pragma unroll
        for (int mi = 0; mi < MI; mi++) {
            u32 d[4];
            mi_mma(d, a[mi], b0, b1, k);
            acc[mi][ni][0] = fmaf(fmaf(__uint_as_float(d[0]), s.x, s.y), w[mi].x, acc[mi][ni][0]);
            acc[mi][ni][1] = fmaf(fmaf(__uint_as_float(d[1]), s.z, s.w), w[mi].x, acc[mi][ni][1]);
            acc[mi][ni][2] = fmaf(fmaf(__uint_as_float(d[2]), s.x, s.y), w[mi].y, acc[mi][ni][2]);
            acc[mi][ni][3] = fmaf(fmaf(__uint_as_float(d[3]), s.z, s.w), w[mi].y, acc[mi][ni][3]);
        }
    }
}

// The products of one stage for the first NX n8 tiles. p[2·mi] / p[2·mi + 1]: the raw rows g and
// g + 8 of m16 tile mi; sw: whether this thread's X rows hold their 64-byte halves swapped.
template <int T, int BM, int MI, int NI, int NX, int XT = 0>
__device__ __forceinline__ void mi_stage_mma(float (*acc)[NI][4], const u8* const* p, const u8* xsm, const u8* xss,
                                             const float2* scw, int nc, int j0, int g, int t, int sw, MiK k) {
    constexpr int NCH = MQT<T>::KS / 32;
#pragma unroll
    for (int cp = 0; cp < NCH / 2; cp++) {
        if (2 * cp < nc) {
            uint4 b[NX];
#pragma unroll
            for (int ni = 0; ni < NX; ni++)
                b[ni] = *(const uint4*)(xsm + (j0 + ni * 8 + g) * MQT<T>::KS + ((cp ^ sw) << 6) + 16 * t);
            u32 a[2][MI][4];
#pragma unroll
            for (int mi = 0; mi < MI; mi++) {
                mi_dq<T>(p[2 * mi], p[2 * mi + 1], 2 * cp, t, a[0][mi], k);
                mi_dq<T>(p[2 * mi], p[2 * mi + 1], 2 * cp + 1, t, a[1][mi], k);
            }
            mi_chunk<T, BM, MI, NI, NX, XT>(acc, a[0], b, 0, scw, xss, 2 * cp, j0, g, t, k);
            if (2 * cp + 1 < nc) mi_chunk<T, BM, MI, NI, NX, XT>(acc, a[1], b, 1, scw, xss, 2 * cp + 1, j0, g, t, k);
        }
    }
}

// The weight tile of one stage when every row spans NPR 16-byte pieces from an aligned start:
// piece p of the tile (row p / NPR, piece p % NPR) by thread p % 256, rows from a (row 0's
// aligned start) rb bytes apart, into rows SP bytes apart from shared address ws; rows from
// nrows on are skipped. Offsets in 32 bits (the caller keeps MQ_BR rows below 2^32 bytes): a
// copy is a few integer instructions, not a 64-bit product and an address-space conversion.
template <int NPR, int SP>
__device__ __forceinline__ void mi_copy_rows(u32 ws, const u8* a, u32 rb, int nrows, int tid) {
#pragma unroll
    for (int m = 0; m < (MQ_BR * NPR + MQ_THREADS - 1) / MQ_THREADS; m++) {
        const int pc = tid + MQ_THREADS * m;
        const int r = pc / NPR, ch = pc - r * NPR;
        if (pc < MQ_BR * NPR && r < nrows) mq_cp16s(ws + (u32)(r * SP + 16 * ch), a + ((u32)r * rb + (u32)(16 * ch)));
    }
}

// One output tile: rows r0.. of W (expert applied), token column j = Xq row xr[j], Y row yr[j]
// (-1: none); columns from nvalid on are all -1. Warps: 8 / MI along the rows (16·MI rows each)
// x MI along the tokens (8·NI each): BM = 8·NI·MI.
template <int T, int NI, int MI>
__device__ __forceinline__ void mi_tile(const u8* W, i64 rb, int rows, int cols, const u8* Xq, i64 xqp, const float* Xs,
                                        i64 xsp, float* Y, i64 ys, int r0, const int* xr, const int* yr, int nvalid,
                                        int accumulate, int ST, u8* sm) {
    const bool wlin = ST & 16;  // bit 4 of the stage argument: linear weight copies
    ST &= 15;
    constexpr int WR = 8 / MI, BM = 8 * NI * MI, KS = MQT<T>::KS, BE = Q<T>::BE, BB = Q<T>::BB, NCH = KS / 32;
    constexpr int SP = mq_sp<T>(), WSZ = MQ_BR * SP, XSZ = BM * KS, STB = mi_stage<T, BM>();
    constexpr int WCH = SP / 16, XCH = KS / 16;
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5, g = lane >> 2, t = lane & 3;
    const int wr = warp % WR, j0 = (warp / WR) * (8 * NI), rw = wr * 16 * MI;
    const int nvw = nvalid - j0;  // valid token columns of this warp (may be <= 0)
    const int nxv = min(BM, nvalid);  // valid token columns of the tile
    float2* scw = (float2*)(sm + ST * STB) + warp * (MI * NCH * 8);
    const int nk = (cols + KS - 1) / KS;
    // Raw rows, unless linear (st bit 4): two threads a row (row tid / 2 takes the even or odd
    // 16-byte pieces of its aligned span), the row's start computed once: ~6 instructions a
    // copy, but 16 separate 32-byte segments a warp copy (MINIMAX_I8_WLOAD_LINEAR=0).
    static_assert(MQ_THREADS == 2 * MQ_BR, "two threads a weight row");
    const int lr = tid >> 1, lh = tid & 1;
    const bool lr_ok = r0 + lr < rows;
    const u8* lrow = W + (i64)(r0 + lr) * rb;
    const bool rb16 = (rb & 15) == 0;
    // Constant-piece copies take 32-bit row offsets (MQ_BR rows of rb bytes below 2^32).
    const bool rb32 = rb16 && rb < ((i64)1 << 24);
    // X copies: thread tid takes piece xc_ch of token columns xc_j0, xc_j0 + 256 / XCH, ...; the
    // columns' parity is the thread's own (256 / XCH is even), so its swizzled offset inside a
    // column is fixed. X scales likewise: chunk xs_c of columns xs_j0, xs_j0 + 256 / NCH, ...
    static_assert(MQ_THREADS % (2 * XCH) == 0 && MQ_THREADS % (2 * NCH) == 0, "X copy mapping");
    const int xc_ch = tid % XCH, xc_j0 = tid / XCH, xs_c = tid % NCH, xs_j0 = tid / NCH;
    const u32 xc_off = (u32)((((xc_ch >> 2) ^ (xc_j0 & 1)) << 6) + ((xc_ch & 3) << 4));
    const u32 sm_s = mq_saddr(sm);
    // Byte offset of row r's stage data inside its shared-memory row (the 16-byte-aligned span
    // starts there): the same for every row when rows are 16-byte multiples apart.
    auto row_mis = [&](const u8* wk, int r) -> int {
        return rb16 ? (int)((u64)(wk + (i64)r0 * rb) & 15) : (int)((u64)(wk + (i64)(r0 + r) * rb) & 15);
    };

    auto load = [&](int ks, int slot) {
        if (ks < nk) {
            int k0 = ks * KS;
            int nv = min(KS, cols - k0);
            int nbytes = nv / BE * BB;
            u8* ws = sm + slot * STB;
            // Rows 16-byte multiples apart share their misalignment, so every row of the stage
            // spans the same number of 16-byte pieces (9 or 10 for the 136-byte stages of both
            // types): pieces by a constant divisor, one base address a stage (~12 instructions
            // a copy instead of ~45; the same pieces, in the same order, as linear below).
            const u64 sbase = (u64)(W + (i64)r0 * rb + (i64)(k0 / BE) * BB);
            const int npr = rb32 ? (int)(((sbase & 15) + nbytes + 15) >> 4) : 0;
            const u32 ws_s = sm_s + (u32)(slot * STB);
            if (wlin && npr == 9) {
                mi_copy_rows<9, SP>(ws_s, (const u8*)(sbase & ~(u64)15), (u32)rb, min(MQ_BR, rows - r0), tid);
            } else if (wlin && npr == 10) {
                mi_copy_rows<10, SP>(ws_s, (const u8*)(sbase & ~(u64)15), (u32)rb, min(MQ_BR, rows - r0), tid);
            } else if (wlin) {
                // Linear (the default): consecutive threads take consecutive 16-byte pieces of
                // the whole tile, rows recomputed per piece (~45 instructions a copy, but each
                // warp copy covers ~3 contiguous rows: measured faster than the pairs below).
                const u8* wk = W + (i64)(k0 / BE) * BB;
                for (int i = tid; i < MQ_BR * WCH; i += MQ_THREADS) {
                    int r = i / WCH, ch = i - r * WCH;
                    if (r0 + r < rows) {
                        u64 s = (u64)(wk + (i64)(r0 + r) * rb);
                        u64 a = s & ~(u64)15;
                        int nch = (int)((s + nbytes - a + 15) >> 4);
                        if (ch < nch) mq_cp16(ws + r * SP + 16 * ch, (const void*)(a + 16 * ch));
                    }
                }
            } else if (lr_ok) {
                u64 s = (u64)(lrow + (i64)(k0 / BE) * BB);
                u64 a = s & ~(u64)15;
                int nch = (int)((s + nbytes - a + 15) >> 4);
                u8* d = ws + lr * SP;
#pragma unroll
                for (int ch = 0; ch < WCH; ch += 2)
                    if (ch + lh < nch) mq_cp16(d + 16 * (ch + lh), (const void*)(a + 16 * (ch + lh)));
            }
            const u32 xsm_s = ws_s + WSZ;
            const int xch = (nv + 63) / 64 * 4;
            // Only the tile's valid token columns (xr[j] >= 0 exactly for j < nxv); the same
            // pieces as one loop over (column, piece), each thread a fixed piece.
            if (xc_ch < xch) {
                const u8* xsrc = Xq + k0 + 16 * xc_ch;
                for (int j = xc_j0; j < nxv; j += MQ_THREADS / XCH) {
                    const int xrow = xr[j];
                    if (xrow >= 0) mq_cp16s(xsm_s + (u32)(j * KS) + xc_off, xsrc + (i64)xrow * xqp);
                }
            }
            const u32 xss_s = xsm_s + XSZ;
            if (32 * xs_c < nv) {
                const float* ssrc = Xs + 2 * (k0 / 32 + xs_c);
                for (int j = xs_j0; j < nxv; j += MQ_THREADS / NCH) {
                    const int xrow = xr[j];
                    if (xrow >= 0) mi_cp8(xss_s + (u32)((xs_c * BM + j) * 8), ssrc + (i64)xrow * xsp);
                }
            }
        }
        mq_commit();
    };

    float acc[MI][NI][4];
#pragma unroll
    for (int mi = 0; mi < MI; mi++)
#pragma unroll
        for (int ni = 0; ni < NI; ni++)
#pragma unroll
            for (int q = 0; q < 4; q++) acc[mi][ni][q] = 0.f;

    for (int s = 0; s < ST - 1; s++) load(s, s);

    int slot = 0;  // ks % ST
    for (int ks = 0; ks < nk; ks++) {
        if (ST >= 4)
            mq_wait<2>();
        else if (ST == 3)
            mq_wait<1>();
        else
            mq_wait<0>();
        __syncthreads();
        load(ks + ST - 1, slot == 0 ? ST - 1 : slot - 1);
        const int k0 = ks * KS;
        const u8* ws = sm + slot * STB;
        slot = slot + 1 == ST ? 0 : slot + 1;
        if (nvw <= 0) continue;  // no valid token in this warp's columns: nothing to multiply
        const u8* xsm = ws + WSZ;
        const u8* xss = xsm + XSZ;
        const u8* wk = W + (i64)(k0 / BE) * BB;
        const u8* p[2 * MI];
#pragma unroll
        for (int h = 0; h < 2 * MI; h++) {
            const int r = rw + 8 * h + g;
            p[h] = ws + r * SP + row_mis(wk, r);
        }
        // Scales of the warp's rows for this stage: [mi][chunk][g] = {row g, row g + 8} of tile mi.
        if constexpr (T == T_IQ4_XS && MI == 1) {
            const int rr = lane & 15;
            mi_iq4_scales(ws + (rw + rr) * SP + row_mis(wk, rw + rr), lane, scw);
        } else {
            for (int e = lane; e < MI * NCH * 16; e += 32) {
                int m = e / (NCH * 16), f = e - m * (NCH * 16);
                int i = f >> 4, h = (f >> 3) & 1, gg = f & 7;
                int r = rw + 16 * m + 8 * h + gg;
                const u8* row = ws + r * SP + row_mis(wk, r);
                float sc, mn;
                mq_scale<T>(row, i, &sc, &mn);
                ((float*)scw)[((m * NCH + i) * 8 + gg) * 2 + h] = sc;
            }
        }
        __syncwarp();
        const int nc = min(KS, cols - k0) / 32;
        if (NI >= 4 && nvw <= 2 * NI)
            mi_stage_mma<T, BM, MI, NI, (NI >= 4 ? NI / 4 : NI)>(acc, p, xsm, xss, scw, nc, j0, g, t, g & 1, mi_k_lit());
        else if (NI >= 2 && nvw <= 4 * NI)
            mi_stage_mma<T, BM, MI, NI, (NI >= 2 ? NI / 2 : NI)>(acc, p, xsm, xss, scw, nc, j0, g, t, g & 1, mi_k_lit());
        else
            mi_stage_mma<T, BM, MI, NI, NI>(acc, p, xsm, xss, scw, nc, j0, g, t, g & 1, mi_k_lit());
    }
    mq_wait<0>();
    // Epilogue: c0/c1 at (row g, tokens 2t, 2t+1), c2/c3 at row g + 8.
#pragma unroll
    for (int mi = 0; mi < MI; mi++)
#pragma unroll
        for (int ni = 0; ni < NI; ni++)
#pragma unroll
            for (int q = 0; q < 4; q++) {
                int r = r0 + rw + 16 * mi + g + 8 * (q >> 1);
                int j = j0 + ni * 8 + 2 * t + (q & 1);
                int yrow = yr[j];
                if (r < rows && yrow >= 0) {
                    float* yp = Y + (i64)yrow * ys + r;
                    *yp = accumulate ? *yp + acc[mi][ni][q] : acc[mi][ni][q];
                }
            }
}

// Split K as mm_dense (gridDim.z > 1: columns [z·kz, z·kz + kz), kz a multiple of the stage,
// partial product to Y + z·ypart, summed by mm_sum_parts).
template <int T, int NI, int MI>
__device__ __forceinline__ void mi_dense(const u8* W, i64 rb, int rows, int cols, const u8* Xq, i64 xqp, const float* Xs, i64 xsp,
                                         float* Y, i64 ys, int n, int accumulate, int st, int kz, i64 ypart) {
    extern __shared__ __align__(16) u8 mi_sm[];
    if (gridDim.z > 1) {
        int kb = blockIdx.z * kz;
        W += (i64)(kb / Q<T>::BE) * Q<T>::BB;
        Xq += kb;
        Xs += 2 * (kb / 32);
        cols = min(kz, cols - kb);
        Y += blockIdx.z * ypart;
        accumulate = 0;
    }
    constexpr int BM = 8 * NI * MI;
    int* cm = (int*)(mi_sm + mi_smem<T, BM, MI>(st & 15) - 2 * BM * 4);
    int n0 = blockIdx.y * BM;
    for (int j = threadIdx.x; j < BM; j += MQ_THREADS) cm[j] = n0 + j < n ? n0 + j : -1;
    __syncthreads();
    mi_tile<T, NI, MI>(W, rb, rows, cols, Xq, xqp, Xs, xsp, Y, ys, blockIdx.x * MQ_BR, cm, cm, min(BM, n - n0), accumulate, st, mi_sm);
}

template <int T, int NI, int MI>
__device__ __forceinline__ void mi_grouped(const u8* W, i64 rb, i64 es, int rows, int cols, const u8* Xq, i64 xqp, const float* Xs,
                                           i64 xsp, int x_div, float* Y, i64 ys, const int* tiles, const int* ntiles, const int* list,
                                           int st) {
    extern __shared__ __align__(16) u8 mi_sm[];
    constexpr int BM = 8 * NI * MI;
    int tile = blockIdx.y;
    if (tile >= *ntiles) return;
    int e = tiles[3 * tile], s = tiles[3 * tile + 1], c = tiles[3 * tile + 2];
    int* xr = (int*)(mi_sm + mi_smem<T, BM, MI>(st & 15) - 2 * BM * 4);
    int* yr = xr + BM;
    for (int j = threadIdx.x; j < BM; j += MQ_THREADS) {
        int p = j < c ? list[s + j] : -1;
        xr[j] = p >= 0 ? p / x_div : -1;
        yr[j] = p;
    }
    __syncthreads();
    mi_tile<T, NI, MI>(W + (i64)e * es, rb, rows, cols, Xq, xqp, Xs, xsp, Y, ys, blockIdx.x * MQ_BR, xr, yr, c, 0, st, mi_sm);
}

// X conversion to int8 (see above): grid (rows, ceil(cols / 128)), block 32; lane l quantizes
// columns 4l..4l+3 of its 128 (8 lanes = one 32-column chunk). x = silu(X) * U when U is given
// (the experts' gated activation, same formula as silu_mul). cols % 32 == 0.
// Source row `r` of X (and U) becomes row `o` of Xq; its scales go to S + o·srs + kc·scs (floats);
// `swap`: the row's 64-byte halves exchanged (the grouped layout of the mt kernels, odd rows).
// Columns cb·128 .. + 127 of the row, lane l taking 4 of them (a full warp).
__device__ __forceinline__ void mi_x_row(const float* X, i64 xs, const float* U, int cols, u8* Xq, i64 xqp, float* S, i64 srs,
                                         i64 scs, int perm, i64 r, i64 o, int swap, int cb, int l) {
    int c = cb * 128 + 4 * l;
    float4 x = make_float4(0.f, 0.f, 0.f, 0.f);
    if (c < cols) {
        x = *(const float4*)(X + r * xs + c);
        if (U) {
            float4 u = *(const float4*)(U + r * xs + c);
            x.x = silu_times(x.x, u.x);
            x.y = silu_times(x.y, u.y);
            x.z = silu_times(x.z, u.z);
            x.w = silu_times(x.w, u.w);
        }
    }
    float amax = fmaxf(fmaxf(fabsf(x.x), fabsf(x.y)), fmaxf(fabsf(x.z), fabsf(x.w)));
    amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, 1));
    amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, 2));
    amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, 4));
    // Significand rounded up to 22 bits: 1.5·2^23·d is then exact (the fold's correction).
    float d = __uint_as_float((__float_as_uint(amax / 127.0f) + 3u) & ~3u);
    int q0 = 0, q1 = 0, q2 = 0, q3 = 0;
    if (c < cols && amax != 0.0f) {
        q0 = __float2int_rn(x.x / d);
        q1 = __float2int_rn(x.y / d);
        q2 = __float2int_rn(x.z / d);
        q3 = __float2int_rn(x.w / d);
    }
    u32 packed = (u32)(q0 & 0xff) | ((u32)(q1 & 0xff) << 8) | ((u32)(q2 & 0xff) << 16) | ((u32)(q3 & 0xff) << 24);
    // perm (X for IQ4_XS weights): the k order of iq4_lookup_il. Lane u < 4 of a chunk holds
    // columns 4u..4u+3, lane u + 4 columns 16+4u..: the first word becomes (x[4u], x[16+4u],
    // x[4u+1], x[16+4u+1]), the second (x[4u+2], x[16+4u+2], x[4u+3], x[16+4u+3]).
    const u32 other = __shfl_xor_sync(0xffffffffu, packed, 4);
    if (perm) packed = (l & 4) ? __byte_perm(other, packed, 0x7362u) : __byte_perm(packed, other, 0x5140u);
    if (c < cols) {
        int kc = c >> 5, u = (c >> 2) & 7;
        int off = (((kc >> 1) ^ swap) * 64) + 16 * (u & 3) + 8 * (kc & 1) + 4 * (u >> 2);
        *(u32*)(Xq + o * xqp + off) = packed;
        if (u == 0) *(float2*)(S + o * srs + kc * scs) = make_float2(d, -MI_MAGIC_F * d);
    }
}
__device__ __forceinline__ void mi_x(const float* X, i64 xs, const float* U, int cols, u8* Xq, i64 xqp, float* S, i64 sp,
                                     int perm) {
    mi_x_row(X, xs, U, cols, Xq, xqp, S, sp, 2, perm, blockIdx.x, blockIdx.x, 0, blockIdx.y, threadIdx.x);
}
// Two names for the benchmark's per-phase split: mm_x_i8 (dense products), mmg_x_i8 (experts).
extern "C" __global__ void mm_x_i8(const float* X, i64 xs, const float* U, int cols, u8* Xq, i64 xqp, float* S, i64 sp,
                                   int perm) {
    mi_x(X, xs, U, cols, Xq, xqp, S, sp, perm);
}
extern "C" __global__ void mmg_x_i8(const float* X, i64 xs, const float* U, int cols, u8* Xq, i64 xqp, float* S, i64 sp,
                                    int perm) {
    mi_x(X, xs, U, cols, Xq, xqp, S, sp, perm);
}

// Configurations: BM = 8·NI·MI tokens, warps 8/MI along the rows (16·MI rows each) x MI along the
// tokens; the stage count st (2..4; + 16: linear weight copies) and the matching dynamic shared
// memory (mi_smem, int8_smem in matmul.rs) come from the host. Names: mm_i8_TY_BM (MI 1: every warp all tokens),
// mm_i8m2_TY_BM (MI 2), mm_i8m4_TY_BM (MI 4); mmg_ likewise.
#define MI_INST_CFG(name, T, BM, NI, MI, tag)                                                                         \
    extern "C" __global__ void __launch_bounds__(MQ_THREADS, 2) mm_i8##tag##_##name##_##BM(                          \
        const u8* W, i64 rb, int rows, int cols, const u8* Xq, i64 xqp, const float* Xs, i64 xsp, float* Y, i64 ys,   \
        int n, int acc, int st, int kz, i64 ypart) {                                                                  \
        mi_dense<T, NI, MI>(W, rb, rows, cols, Xq, xqp, Xs, xsp, Y, ys, n, acc, st, kz, ypart);                       \
    }                                                                                                                 \
    extern "C" __global__ void __launch_bounds__(MQ_THREADS, 2) mmg_i8##tag##_##name##_##BM(                         \
        const u8* W, i64 rb, i64 es, int rows, int cols, const u8* Xq, i64 xqp, const float* Xs, i64 xsp, int x_div,  \
        float* Y, i64 ys, const int* tiles, const int* ntiles, const int* list, int st) {                             \
        mi_grouped<T, NI, MI>(W, rb, es, rows, cols, Xq, xqp, Xs, xsp, x_div, Y, ys, tiles, ntiles, list, st);        \
    }
#define MI_INST(name, T)                 \
    MI_INST_CFG(name, T, 16, 2, 1, )     \
    MI_INST_CFG(name, T, 32, 4, 1, )     \
    MI_INST_CFG(name, T, 64, 8, 1, )     \
    MI_INST_CFG(name, T, 16, 1, 2, m2)   \
    MI_INST_CFG(name, T, 32, 2, 2, m2)   \
    MI_INST_CFG(name, T, 64, 4, 2, m2)   \
    MI_INST_CFG(name, T, 32, 1, 4, m4)   \
    MI_INST_CFG(name, T, 64, 2, 4, m4)
MI_INST(iq4_xs, T_IQ4_XS)
MI_INST(q8_0, T_Q8_0)


// ================================================================================================
// int8 grouped IQ4_XS products through tensor-memory copies (mt, sm_90 and newer): the mi products
// (same fragments, MMAs and fold) with each stage's operands brought by three TMA copies that
// one thread issues onto the stage's mbarrier, instead of ~20 address computations and copies
// per thread and stage (at 16 tokens an expert the mi kernels spend as many instructions on a
// stage's copies and setup as on its products):
//   - the weight tile: 128 rows x 144 bytes (the stage's super-block, 136 bytes, and 8 of the
//     next: TMA boxes are 16-byte multiples; past the row's end they are zero-filled), rows
//     MT_WP = 144 bytes apart in shared memory (36 words: conflict-free fragment loads);
//   - the X tile: BM rows of 256 bytes. X is converted in grouped order (mmg_xg_i8: row i holds
//     pair list[i]), so a tile's tokens are consecutive rows from its start s; odd rows hold
//     their 64-byte halves swapped (the conflict-free B loads: a thread's swap is (s + g) & 1);
//   - the X scales (float2 per row and chunk, rows of cols / 32): a box of BM rows x MT_SP chunks
//     (the stage's 8 and 2 of the next: 80-byte rows, conflict-free reads of a lane quad's tokens).
// A copy's innermost start must be 16-byte aligned: the weight box of an odd super-block starts
// 8 bytes early (its rows then begin at byte 8 of their pitch). Rows past the tensor (the last
// row block, the last tiles' tokens, chunks past the row) are zero-filled by the copies and
// never stored. Weights need rows of whole 512-column multiples (16-byte row strides).
// ================================================================================================
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
#define MT_PTX 1
#else
#define MT_PTX 0
#endif

// A CUtensorMap, passed by value (__grid_constant__): the copies take its parameter address,
// which must be 128-byte aligned (CUDA 13 aligns CUtensorMap to 128; at 64 the copy faults).
struct __align__(128) MtMap {
    unsigned long long v[16];
};

#define MT_WP 144
template <int BM> __host__ __device__ constexpr int mt_stage() { return MQ_BR * MT_WP + BM * 256 + BM * MT_SP * 8; }
// ST stages, per-warp weight scales (8 warps x 8 chunks x 8 rows, float2), Y row map, mbarriers.
template <int BM> __host__ __device__ constexpr int mt_smem(int st) { return st * mt_stage<BM>() + 8 * 8 * 8 * 8 + BM * 4 + st * 8; }

__device__ __forceinline__ void mt_bar_init(u32 b) {
#if MT_PTX
    asm volatile("mbarrier.init.shared::cta.b64 [%0], 1;" ::"r"(b) : "memory");
#endif
}
__device__ __forceinline__ void mt_bar_fence() {
#if MT_PTX
    asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
    asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
#endif
}
__device__ __forceinline__ void mt_bar_expect(u32 b, u32 bytes) {
#if MT_PTX
    asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(b), "r"(bytes) : "memory");
#endif
}
__device__ __forceinline__ void mt_bar_wait(u32 b, u32 parity) {
#if MT_PTX
    u32 ok;
    do {
        asm volatile(
            "{\n .reg .pred p;\n mbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2;\n selp.u32 %0, 1, 0, p;\n}"
            : "=r"(ok)
            : "r"(b), "r"(parity)
            : "memory");
    } while (!ok);
#endif
}
__device__ __forceinline__ void mt_copy2(u32 dst, const MtMap* m, int c0, int c1, u32 b) {
#if MT_PTX
    asm volatile("cp.async.bulk.tensor.2d.shared::cluster.global.tile.mbarrier::complete_tx::bytes [%0], [%1, {%2, %3}], [%4];" ::"r"(dst),
                 "l"(m), "r"(c0), "r"(c1), "r"(b)
                 : "memory");
#endif
}
__device__ __forceinline__ void mt_copy3(u32 dst, const MtMap* m, int c0, int c1, int c2, u32 b) {
#if MT_PTX
    asm volatile("cp.async.bulk.tensor.3d.shared::cluster.global.tile.mbarrier::complete_tx::bytes [%0], [%1, {%2, %3, %4}], [%5];" ::"r"(dst),
                 "l"(m), "r"(c0), "r"(c1), "r"(c2), "r"(b)
                 : "memory");
#endif
}

// One grouped tile (blockIdx.y: tile, blockIdx.x: 128-row block) of W[e] (map tw: bytes x rows x
// experts) times the grouped X (tx: bytes x pairs; ts: pair scales x chunks), ST stages of 256
// columns; Y row list[s + j] for the tile's token j < c. 8 / MI warps of 16·MI rows (MI m16 tiles
// each), each all BM tokens.
template <int NI, int MI>
__device__ __forceinline__ void mt_grouped(const MtMap* tw, const MtMap* tx, const MtMap* ts, int rows, int cols, float* Y, i64 ys,
                                           const int* tiles, const int* ntiles, const int* list, int ST) {
    extern __shared__ __align__(128) u8 mt_sm[];
    constexpr int BM = 8 * NI, KS = 256, NCH = 8, STB = mt_stage<BM>(), WSZ = MQ_BR * MT_WP, XSZ = BM * KS;
    const int tile = blockIdx.y;
    if (tile >= *ntiles) return;
    const int e = tiles[3 * tile], s = tiles[3 * tile + 1], c = tiles[3 * tile + 2];
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5, g = lane >> 2, t = lane & 3;
    const int r0 = blockIdx.x * MQ_BR, rw = warp * 16 * MI;
    u8* sm = mt_sm;
    float2* scw = (float2*)(sm + ST * STB) + warp * (MI * NCH * 8);
    int* yr = (int*)(sm + ST * STB + 8 * 8 * 8 * 8);
    const u32 sm_s = mq_saddr(sm), bar_s = mq_saddr(yr + BM);
    for (int j = tid; j < BM; j += blockDim.x) yr[j] = j < c ? list[s + j] : -1;
    if (tid == 0) {
        for (int i = 0; i < ST; i++) mt_bar_init(bar_s + 8 * i);
        mt_bar_fence();
    }
    __syncthreads();
    const int nk = cols / KS;
    auto issue = [&](int ks) {
        if (tid == 0 && ks < nk) {
            const int slot = ks % ST;
            const u32 ws = sm_s + (u32)(slot * STB), b = bar_s + 8 * slot;
            mt_bar_expect(b, (u32)STB);
            mt_copy3(ws, tw, ks * 136 - 8 * (ks & 1), r0, e, b);
            mt_copy2(ws + WSZ, tx, ks * KS, s, b);
            mt_copy2(ws + WSZ + XSZ, ts, ks * NCH, s, b);
        }
    };
    for (int i = 0; i < ST - 1; i++) issue(i);
    // The codebook words and the MMA's accumulator input, pinned in registers.
    const MiK k = mi_k_pinned((u32)cols >> 31);
    const int sw = (s + g) & 1;
    float acc[MI][NI][4];
#pragma unroll
    for (int mi = 0; mi < MI; mi++)
#pragma unroll
        for (int ni = 0; ni < NI; ni++)
#pragma unroll
            for (int q = 0; q < 4; q++) acc[mi][ni][q] = 0.f;
    for (int ks = 0; ks < nk; ks++) {
        // Every warp is done with stage ks - 1: its slot takes stage ks + ST - 1.
        __syncthreads();
        issue(ks + ST - 1);
        const int slot = ks % ST;
        mt_bar_wait(bar_s + 8 * slot, (u32)((ks / ST) & 1));
        const u8* ws = sm + slot * STB;
        const u8* xsm = ws + WSZ;
        const u8* xss = xsm + XSZ;
        // Odd super-blocks begin 8 bytes into their rows (the copy's aligned start).
        const int mis = 8 * (ks & 1);
        const u8* p[2 * MI];
#pragma unroll
        for (int h = 0; h < 2 * MI; h++) p[h] = ws + (rw + 8 * h + g) * MT_WP + mis;
#pragma unroll
        for (int mi = 0; mi < MI; mi++) mi_iq4_scales(ws + (rw + 16 * mi + (lane & 15)) * MT_WP + mis, lane, scw + mi * NCH * 8);
        __syncwarp();
        if (NI >= 4 && c <= 2 * NI)
            mi_stage_mma<T_IQ4_XS, BM, MI, NI, (NI >= 4 ? NI / 4 : NI), 1>(acc, p, xsm, xss, scw, NCH, 0, g, t, sw, k);
        else if (NI >= 2 && c <= 4 * NI)
            mi_stage_mma<T_IQ4_XS, BM, MI, NI, (NI >= 2 ? NI / 2 : NI), 1>(acc, p, xsm, xss, scw, NCH, 0, g, t, sw, k);
        else
            mi_stage_mma<T_IQ4_XS, BM, MI, NI, NI, 1>(acc, p, xsm, xss, scw, NCH, 0, g, t, sw, k);
    }
    // Epilogue: c0/c1 at (row g, tokens 2t, 2t+1), c2/c3 at row g + 8 of each m16 tile.
#pragma unroll
    for (int mi = 0; mi < MI; mi++)
#pragma unroll
        for (int ni = 0; ni < NI; ni++)
#pragma unroll
            for (int q = 0; q < 4; q++) {
                const int r = r0 + rw + 16 * mi + g + 8 * (q >> 1);
                const int yrow = yr[ni * 8 + 2 * t + (q & 1)];
                if (r < rows && yrow >= 0) Y[(i64)yrow * ys + r] = acc[mi][ni][q];
            }
}

// mmg_t8: 8 warps of 16 rows; mmg_t8w: 4 warps of 32 rows (two m16 tiles against each B fragment
// load: half the shared-memory reads of X a block, at half the warps).
#define MT_INST(BM, NI)                                                                                              \
    extern "C" __global__ void __launch_bounds__(MQ_THREADS, 2) mmg_t8_iq4_xs_##BM(                                  \
        const __grid_constant__ MtMap tw, const __grid_constant__ MtMap tx, const __grid_constant__ MtMap ts, int rows, \
        int cols, float* Y, i64 ys, const int* tiles, const int* ntiles, const int* list, int st) {                  \
        mt_grouped<NI, 1>(&tw, &tx, &ts, rows, cols, Y, ys, tiles, ntiles, list, st);                                 \
    }                                                                                                                \
    extern "C" __global__ void __launch_bounds__(MQ_THREADS / 2, 2) mmg_t8w_iq4_xs_##BM(                             \
        const __grid_constant__ MtMap tw, const __grid_constant__ MtMap tx, const __grid_constant__ MtMap ts, int rows, \
        int cols, float* Y, i64 ys, const int* tiles, const int* ntiles, const int* list, int st) {                  \
        mt_grouped<NI, 2>(&tw, &tx, &ts, rows, cols, Y, ys, tiles, ntiles, list, st);                                 \
    }
MT_INST(16, 2)
MT_INST(32, 4)
MT_INST(64, 8)

// X in the mt kernels' grouped order: grid (ceil(rows / 8)), block 256, a warp a row walking its
// 128-column blocks; row i of Xq from row list[i] / x_div of X (and U), halves swapped on odd
// rows, scales at S[i·cols/32 + kc].
extern "C" __global__ void mmg_xg_i8(const float* X, i64 xs, const float* U, int cols, const int* list, int x_div, u8* Xq, i64 xqp,
                                     float* S, int rows) {
    const i64 i = (i64)blockIdx.x * 8 + (threadIdx.x >> 5);
    if (i >= rows) return;
    const i64 r = list[i] / x_div;
    for (int cb = 0; cb < (cols + 127) / 128; cb++)
        mi_x_row(X, xs, U, cols, Xq, xqp, S, 2 * (cols / 32), 2, 1, r, i, (int)(i & 1), cb, threadIdx.x & 31);
}

// The grouped X of a product whose pairs share token rows (gate/up: x_div = top-k) from rows
// converted once per token (mmg_x_i8 with the IQ4_XS order, no swap): row i of Xq is row
// list[i] / x_div of Xt with the 64-byte halves of each 128-byte block swapped on odd rows (16-byte
// chunk j goes to j ^ 4), its scales copied. A warp a row; cols a multiple of 64. Bytes and scales
// are those mmg_xg_i8 writes (the same conversion per token, then copies).
extern "C" __global__ void mmg_xg_gather(const u8* Xt, const float* St, int cols, const int* list, int x_div, u8* Xq,
                                         float* S, int rows) {
    const i64 i = (i64)blockIdx.x * 8 + (threadIdx.x >> 5);
    if (i >= rows) return;
    const int lane = threadIdx.x & 31;
    const i64 r = list[i] / x_div;
    const uint4* src = (const uint4*)(Xt + r * cols);
    uint4* dst = (uint4*)(Xq + i * cols);
    const int sw = (int)(i & 1) * 4;
    for (int j = lane; j < cols / 16; j += 32) dst[j ^ sw] = src[j];
    // Scales: cols / 32 float2 a row = cols / 64 chunks of 16 bytes.
    const uint4* ss = (const uint4*)(St + r * (cols / 16));
    uint4* sd = (uint4*)(S + i * (cols / 16));
    for (int j = lane; j < cols / 64; j += 32) sd[j] = ss[j];
}

#endif  // MM_PASSES == 1
