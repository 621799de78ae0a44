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
