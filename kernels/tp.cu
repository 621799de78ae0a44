// Tensor parallelism: the full-width q/k RMSNorm when each rank holds a slice of the heads.
// Each rank sums the squares of its slice per token (tp_qk_sumsq), the world adds the sums
// (an all-reduce of 2 floats per token), then every rank scales its slice with the total
// (tp_qk_scale on the exact path; the fast path's qk_norm_rope_store_tp reads the sums itself).

// ss[2 t] = sum of squares of q row t (qw values), ss[2 t + 1] = of k row t (kw values), each
// accumulated in f64 and rounded to f32 once (the CPU backend's arithmetic). grid (nt, 2),
// block 256.
extern "C" __global__ void __launch_bounds__(256) tp_qk_sumsq(const float* q, i64 qs, const float* k, i64 ks, int qw,
                                                              int kw, float* ss) {
    __shared__ double part[8];
    int t = blockIdx.x;
    bool is_k = blockIdx.y == 1;
    const float* x = is_k ? k + t * ks : q + t * qs;
    int n = is_k ? kw : qw;
    double s = 0.0;
    for (int i = threadIdx.x; i < n; i += blockDim.x) {
        double v = (double)x[i];
        s += v * v;
    }
    s = warp_sum_d(s);
    int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    if (lane == 0) part[warp] = s;
    __syncthreads();
    if (threadIdx.x == 0) {
        double tot = 0.0;
        for (int w = 0; w < (int)(blockDim.x >> 5); w++) tot += part[w];
        ss[2 * t + (is_k ? 1 : 0)] = (float)tot;
    }
}

// In place: x[i] = x[i] * inv * w[i], inv = 1 / sqrt((float)(ss / n_full) + eps) with ss the
// world's sum of squares of the row (2 floats per token as tp_qk_sumsq writes them) and
// n_full the whole row's width (all heads). grid (nt, 2), block 256.
extern "C" __global__ void __launch_bounds__(256) tp_qk_scale(float* q, i64 qs, const float* qn, float* k, i64 ks,
                                                              const float* kn, int qw, int kw, const float* ss,
                                                              int q_full, int k_full, float eps) {
    int t = blockIdx.x;
    bool is_k = blockIdx.y == 1;
    float* x = is_k ? k + t * ks : q + t * qs;
    const float* w = is_k ? kn : qn;
    int n = is_k ? kw : qw;
    double full = (double)(is_k ? k_full : q_full);
    float mean = (float)((double)ss[2 * t + (is_k ? 1 : 0)] / full);
    float inv = 1.0f / sqrtf(__fadd_rn(mean, eps));
    for (int i = threadIdx.x; i < n; i += blockDim.x) x[i] = __fmul_rn(__fmul_rn(x[i], inv), w[i]);
}
