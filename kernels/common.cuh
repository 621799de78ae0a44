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
