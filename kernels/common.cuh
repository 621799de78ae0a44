// Shared prelude of every kernel module (prepended by the Rust loader; NVRTC gets no
// include path, so this file must stay self-contained: no system or CUDA headers).
//
// Conventions:
// - Activations are f32, row-major, with explicit row strides in elements.
// - Quantized weights are raw GGUF blocks (ggml-common.h layouts), rows back to back.
// - Dequantization repeats the CPU reference's f32 operations in the same order, with
//   __fmul_rn/__fadd_rn/__fsub_rn where a fused multiply-add would change the rounding, so
//   dequantized values are bit-identical to shared/src/quant.

typedef unsigned char u8;
typedef signed char i8;
typedef unsigned short u16;
typedef unsigned int u32;
typedef int i32;
typedef long long i64;
typedef unsigned long long u64;

#define WARP 32
#define NEG_INF __int_as_float(0xff800000)

// ggml type ids (enum ggml_type), used as template arguments.
#define T_F32 0
#define T_F16 1
#define T_Q4_0 2
#define T_Q4_1 3
#define T_Q5_0 6
#define T_Q5_1 7
#define T_Q8_0 8
#define T_Q2_K 10
#define T_Q3_K 11
#define T_Q4_K 12
#define T_Q5_K 13
#define T_Q6_K 14
#define T_IQ4_NL 20
#define T_IQ4_XS 23
#define T_BF16 30
#define T_MXFP4 39

__device__ __forceinline__ float f16_to_f32(u16 h) {
    float f;
    asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(h));
    return f;
}
__device__ __forceinline__ u16 f32_to_f16(float f) {
    u16 h;
    asm("cvt.rn.f16.f32 %0, %1;" : "=h"(h) : "f"(f));
    return h;
}
__device__ __forceinline__ float bf16_to_f32(u16 b) { return __uint_as_float(((u32)b) << 16); }
__device__ __forceinline__ u16 f32_to_bf16(float f) {
    u16 h;
    asm("cvt.rn.bf16.f32 %0, %1;" : "=h"(h) : "f"(f));
    return h;
}

// Little-endian loads at any byte alignment (quant blocks pack fp16 fields at odd offsets).
__device__ __forceinline__ u16 ld_u16(const u8* p) { return (u16)p[0] | ((u16)p[1] << 8); }
__device__ __forceinline__ u32 ld_u32(const u8* p) {
    return (u32)p[0] | ((u32)p[1] << 8) | ((u32)p[2] << 16) | ((u32)p[3] << 24);
}
__device__ __forceinline__ float ld_h(const u8* p) { return f16_to_f32(ld_u16(p)); }

__device__ __forceinline__ float warp_sum(float v) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    return v;
}
__device__ __forceinline__ float warp_max(float v) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
    return v;
}
__device__ __forceinline__ double warp_sum_d(double v) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    return v;
}

// ---- Shared by the decode kernels of fast.cu and fast_kq.cu ----
// Quantizes one 32-element group held one value per lane; returns q, writes d from lane 0.
__device__ __forceinline__ int q8_lane(float v, float* d_out) {
    float amax = warp_max(fabsf(v));
    float d = amax / 127.0f;
    int q = amax == 0.0f ? 0 : __float2int_rn(v / d);
    if ((threadIdx.x & 31) == 0) *d_out = d;
    return q;
}
// The end of a gate/up block (after a block barrier): its 32 activations act[0 .. 32) (row
// blockIdx.x * 32 + lane of pair p) as q8 into aq / ad (row stride ff), by warp 0.
__device__ __forceinline__ void gu_act_q8(const float* act, int warp, int lane, int p, i8* aq, float* ad, int ff) {
    __syncthreads();
    if (warp == 0) {
        float v = act[lane];
        int q = q8_lane(v, ad + (i64)p * (ff / 32) + blockIdx.x);
        aq[(i64)p * ff + blockIdx.x * 32 + lane] = (i8)q;
    }
}
// The experts' gate/up activation silu(g) * u.
__device__ __forceinline__ float silu_times(float g, float u) { return g / (1.0f + expf(-g)) * u; }
// Row r of a three-segment dense launch (q, k, v: row r is row r of segment 0, then 1, then 2):
// declares W, rb, y, ys (its segment's matrix, row bytes, output and output stride) and makes r
// segment-local; returns past the last segment. Uses the kernel's argument names (W0, rb0,
// rows0, y0, ys0, ..., ys2). A macro: as a function it changes the kernels' code.
#define MV_SEGMENT_OR_RETURN()                 \
    const u8* W;                               \
    i64 rb, ys;                                \
    float* y;                                  \
    if (r < rows0) {                           \
        W = W0, rb = rb0, y = y0, ys = ys0;    \
    } else if (r < rows0 + rows1) {            \
        r -= rows0;                            \
        W = W1, rb = rb1, y = y1, ys = ys1;    \
    } else if (r < rows0 + rows1 + rows2) {    \
        r -= rows0 + rows1;                    \
        W = W2, rb = rb2, y = y2, ys = ys2;    \
    } else {                                   \
        return;                                \
    }
// Row r of the launch (segment 0, then 1, then 2) as (row pointer, output column, y, ys);
// false past the last row.
__device__ __forceinline__ bool mv_seg_row(int r, const u8* W0, i64 rb0, int rows0, float* y0, i64 ys0, const u8* W1,
                                           i64 rb1, int rows1, float* y1, i64 ys1, const u8* W2, i64 rb2, int rows2,
                                           float* y2, i64 ys2, const u8*& w, int& rr, float*& y, i64& ys) {
    if (r < rows0) {
        w = W0 + r * rb0, rr = r, y = y0, ys = ys0;
    } else if (r < rows0 + rows1) {
        rr = r - rows0, w = W1 + rr * rb1, y = y1, ys = ys1;
    } else if (r < rows0 + rows1 + rows2) {
        rr = r - rows0 - rows1, w = W2 + rr * rb2, y = y2, ys = ys2;
    } else {
        return false;
    }
    return true;
}
// A dense warp's results: y[(v0 + t) ys + r] (+)= the warp sum of acc[t] for t < nv_here.
template <int NT>
__device__ __forceinline__ void mv_store(const float* acc, float* y, i64 ys, int r, int v0, int nv_here, int lane,
                                         int accumulate) {
#pragma unroll
    for (int t = 0; t < NT; t++) {
        float s = warp_sum(acc[t]);
        if (lane == 0 && t < nv_here) {
            float* yp = y + (i64)(v0 + t) * ys + r;
            *yp = accumulate ? *yp + s : s;
        }
    }
}

// KV cache element types (template argument of the attention kernels): 16-bit f16/bf16, or
// f32 (exact, for checks against f32 references).
#define KV_F16 0
#define KV_BF16 1
#define KV_F32 2
template <int KV> struct KvT { typedef u16 T; };
template <> struct KvT<KV_F32> { typedef float T; };
template <int KV> __device__ __forceinline__ float kv_load(const typename KvT<KV>::T* p);
template <> __device__ __forceinline__ float kv_load<KV_F16>(const u16* p) { return f16_to_f32(*p); }
template <> __device__ __forceinline__ float kv_load<KV_BF16>(const u16* p) { return bf16_to_f32(*p); }
template <> __device__ __forceinline__ float kv_load<KV_F32>(const float* p) { return *p; }
template <int KV> __device__ __forceinline__ typename KvT<KV>::T kv_store(float f);
template <> __device__ __forceinline__ u16 kv_store<KV_F16>(float f) { return f32_to_f16(f); }
template <> __device__ __forceinline__ u16 kv_store<KV_BF16>(float f) { return f32_to_bf16(f); }
template <> __device__ __forceinline__ float kv_store<KV_F32>(float f) { return f; }

// ---------------------------------------------------------------------------------------------
// Tensor-core plumbing shared by attention.cu, fast.cu and quant_matmul.cu (sm_80 and newer).

// Shared-memory address of a generic pointer (the operand cp.async and ldmatrix take).
__device__ __forceinline__ u32 smem_addr(const void* p) {
    u32 s;
    asm("{ .reg .u64 a; cvta.to.shared.u64 a, %1; cvt.u32.u64 %0, a; }" : "=r"(s) : "l"(p));
    return s;
}
// 16 bytes global -> shared, asynchronously; bytes = 0 writes zeros and reads nothing.
__device__ __forceinline__ void cp_async16z(u32 dst, const void* src, int bytes) {
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;" ::"r"(dst), "l"(src), "r"(bytes) : "memory");
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;" ::: "memory"); }
// Waits until at most N of this thread's committed groups are still in flight.
template <int N> __device__ __forceinline__ void cp_async_wait() { asm volatile("cp.async.wait_group %0;" ::"n"(N) : "memory"); }
// Four 8x8 b16 tiles from shared memory (lane l gives the address of row l % 8 of tile l / 8).
__device__ __forceinline__ void ldsm_x4(u32 a, u32& r0, u32& r1, u32& r2, u32& r3) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];"
                 : "=r"(r0), "=r"(r1), "=r"(r2), "=r"(r3)
                 : "r"(a)
                 : "memory");
}
// The same, each tile transposed.
__device__ __forceinline__ void ldsm_x4_t(u32 a, u32& r0, u32& r1, u32& r2, u32& r3) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];"
                 : "=r"(r0), "=r"(r1), "=r"(r2), "=r"(r3)
                 : "r"(a)
                 : "memory");
}

// IQ4_NL/XS codebook as packed int8: {-127,-104,-83,-65 | -49,-35,-22,-10 | 1,13,25,38 | 53,69,89,113}
#define IQ4_T0 0xBFAD9881u
#define IQ4_T1 0xF6EADDCFu
#define IQ4_T2 0x26190D01u
#define IQ4_T3 0x71594535u

// The 8 nibbles of w through the codebook: lo = values of the low nibbles of bytes 0..3, hi =
// values of their high nibbles (as 4 packed int8 each).
__device__ __forceinline__ void iq4_lookup(u32 w, u32& lo, u32& hi) {
    u32 r[2];
#pragma unroll
    for (int i = 0; i < 2; i++) {
        u32 s = w >> (16 * i);
        u32 a = __byte_perm(IQ4_T0, IQ4_T1, s & 0x7777u);
        u32 b = __byte_perm(IQ4_T2, IQ4_T3, s & 0x7777u);
        r[i] = __byte_perm(a, b, 0x3210u | ((s & 0x8888u) >> 1));
    }
    lo = __byte_perm(r[0], r[1], 0x6420u);
    hi = __byte_perm(r[0], r[1], 0x7531u);
}

// Cheaper IQ4 decode (session 5: fast.cu's expert kernels; the int8 GEMMs since session 11).
// iq4_lookup spends ~15 instructions on 8 nibbles: per 16-bit half a mask, two table prmts, the
// select word and the select prmt, then two prmts to regroup the bytes into low / high
// nibbles. Here the mask and
// the select word are computed once per 32-bit word (sel nibble j = j, + 4 when nibble j has
// bit 3 set: byte j of the upper table), the upper half's by one shift each, and the
// regrouping is left out: r0 = values of nibbles (b0 lo, b0 hi, b1 lo, b1 hi), r1 = (b2 lo,
// b2 hi, b3 lo, b3 hi), i.e. elements (4i, 4i+16, 4i+1, 4i+17) / (4i+2, 4i+18, 4i+3, 4i+19) of
// word i of a unit. fast.cu interleaves the activations to match (iq4_x_il: x0, x16, x1, x17,
// ..), once per token in registers, so the dp4a sums are the same integers; the int8 GEMMs
// convert X in that order (the MMA's k slots permuted alike). prmt's selector uses bits 15:0
// only. iq4_lookup_il's selector nibbles have bit 3 clear (plain byte picks); stream.cu's
// iq4s_codes sets bit 3 on purpose (sign replication of the picked byte).
__device__ __forceinline__ u32 iq4_prmt(u32 a, u32 b, u32 s) {
    u32 r;
    asm("prmt.b32 %0, %1, %2, %3;" : "=r"(r) : "r"(a), "r"(b), "r"(s));
    return r;
}
// t0 / t2 = IQ4_T0 / IQ4_T2 (a table prmt needs one table word in a register; passed in so a
// kernel can pin them in registers with iq4_pin: given as literals, ptxas re-materializes them
// before every prmt, 4 extra instructions per word).
__device__ __forceinline__ void iq4_lookup_il(u32 w, u32& r0, u32& r1, u32 t0 = IQ4_T0, u32 t2 = IQ4_T2) {
    u32 m = w & 0x77777777u;
    u32 sel = ((w & 0x88888888u) >> 1) + 0x32103210u;  // bits do not overlap: + is |
    u32 mh = m >> 16, sh = sel >> 16;
    r0 = iq4_prmt(iq4_prmt(t0, IQ4_T1, m), iq4_prmt(t2, IQ4_T3, m), sel);
    r1 = iq4_prmt(iq4_prmt(t0, IQ4_T1, mh), iq4_prmt(t2, IQ4_T3, mh), sh);
}
