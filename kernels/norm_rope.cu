// RMSNorm (also the full-width q/k norm: one RMS over all heads of a token), partial NeoX
// RoPE, and small row utilities.

// y[r] = x[r] * w / sqrt(mean(x[r]^2) + eps). grid (nrows), block 256. In place allowed.
// The sum of squares is accumulated in f64 like the CPU reference.
extern "C" __global__ void rms_norm(const float* x, i64 xs, const float* w, float* y, i64 ys, int n, float eps) {
    __shared__ double part[32];
    const float* xr = x + blockIdx.x * xs;
    float* yr = y + blockIdx.x * ys;
    double ss = 0.0;
    for (int i = threadIdx.x; i < n; i += blockDim.x) {
        double v = (double)xr[i];
        ss += v * v;
    }
    ss = warp_sum_d(ss);
    int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, nw = blockDim.x >> 5;
    if (lane == 0) part[warp] = ss;
    __syncthreads();
    if (warp == 0) {
        double t = lane < nw ? part[lane] : 0.0;
        t = warp_sum_d(t);
        if (lane == 0) part[0] = t;
    }
    __syncthreads();
    float inv = 1.0f / sqrtf((float)(part[0] / (double)n) + eps);
    for (int i = threadIdx.x; i < n; i += blockDim.x) yr[i] = __fmul_rn(__fmul_rn(xr[i], inv), w[i]);
}

// rms_norm with float4 loads held in registers (one read of x): n % 4 == 0, n <= 4 * RN_V * 256,
// rows and pointers 16-byte aligned (the wrapper checks; otherwise rms_norm runs). grid (nrows),
// block 256. Squares are exact in f64; only the order of the f64 sum differs from rms_norm.
#define RN_V 8
extern "C" __global__ void __launch_bounds__(256) rms_norm_v4(const float* x, i64 xs, const float* w, float* y, i64 ys, int n,
                                                              float eps) {
    __shared__ double part[8];
    const float4* xr = (const float4*)(x + blockIdx.x * xs);
    const float4* wr = (const float4*)w;
    float4* yr = (float4*)(y + blockIdx.x * ys);
    const int n4 = n >> 2;
    float4 v[RN_V];
    double ss = 0.0;
#pragma unroll
    for (int j = 0; j < RN_V; j++) {
        const int i = threadIdx.x + j * 256;
        if (i < n4) {
            v[j] = xr[i];
            ss += (double)v[j].x * v[j].x + (double)v[j].y * v[j].y + (double)v[j].z * v[j].z + (double)v[j].w * v[j].w;
        }
    }
    ss = warp_sum_d(ss);
    if ((threadIdx.x & 31) == 0) part[threadIdx.x >> 5] = ss;
    __syncthreads();
    double t = 0.0;
#pragma unroll
    for (int k = 0; k < 8; k++) t += part[k];
    const float inv = 1.0f / sqrtf((float)(t / (double)n) + eps);
#pragma unroll
    for (int j = 0; j < RN_V; j++) {
        const int i = threadIdx.x + j * 256;
        if (i < n4) {
            const float4 g = wr[i];
            yr[i] = make_float4(__fmul_rn(__fmul_rn(v[j].x, inv), g.x), __fmul_rn(__fmul_rn(v[j].y, inv), g.y),
                                __fmul_rn(__fmul_rn(v[j].z, inv), g.z), __fmul_rn(__fmul_rn(v[j].w, inv), g.w));
        }
    }
}

// NeoX (rotate-half) RoPE on the first `rot` dims of each of `heads` heads of width `hd` in
// row t of x, at position pos[t]; dims rot..hd pass through. grid (nrows), block 128.
// Angles in f64 like the CPU reference's table, computed once per row and frequency (shared by
// every head) into shared memory; rot <= 2 * RoPE_MAX_HALF (the wrapper checks).
#define ROPE_MAX_HALF 256
extern "C" __global__ void rope_neox(float* x, i64 xs, int heads, int hd, int rot, const int* pos, float theta) {
    __shared__ float cs[2 * ROPE_MAX_HALF];
    float* xr = x + blockIdx.x * xs;
    int half = rot / 2;
    double p = (double)pos[blockIdx.x];
    for (int i = threadIdx.x; i < half; i += blockDim.x) {
        double inv_freq = 1.0 / pow((double)theta, 2.0 * (double)i / (double)rot);
        double a = p * inv_freq;
        cs[2 * i] = (float)cos(a);
        cs[2 * i + 1] = (float)sin(a);
    }
    __syncthreads();
    for (int idx = threadIdx.x; idx < heads * half; idx += blockDim.x) {
        int h = idx / half, i = idx % half;
        float c = cs[2 * i], s = cs[2 * i + 1];
        float* u = xr + h * hd;
        float x0 = u[i], x1 = u[i + half];
        u[i] = __fsub_rn(__fmul_rn(x0, c), __fmul_rn(x1, s));
        u[i + half] = __fadd_rn(__fmul_rn(x1, c), __fmul_rn(x0, s));
    }
}

// dst[i] = src[idx[i]] (rows of n floats). grid (nrows), block 256.
extern "C" __global__ void gather_rows(const float* src, i64 ss, const int* idx, float* dst, i64 ds, int n) {
    const float* s = src + idx[blockIdx.x] * ss;
    float* d = dst + blockIdx.x * ds;
    for (int i = threadIdx.x; i < n; i += blockDim.x) d[i] = s[i];
}

// Fills n floats with the bit pattern `bits` (tests poison outputs with NaN).
extern "C" __global__ void fill_u32(u32* p, i64 n, u32 bits) {
    i64 i = blockIdx.x * (i64)blockDim.x + threadIdx.x;
    if (i < n) p[i] = bits;
}
