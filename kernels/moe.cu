// Mixture-of-experts glue: routing (sigmoid or softmax scores, top-k chosen on score + bias,
// weights = chosen unbiased scores renormalised), SiLU-gating, and the weighted combine.
// The expert products themselves are the mve_* kernels of quant_matvec.

// For token t (= blockIdx.x): ids[t*k + j], w[t*k + j] for j < k, highest biased score first,
// ties to the lower expert index (as torch.topk and the CPU reference). block 32, dynamic
// shared memory 2 * E floats. gating: 2 = sigmoid, 1 = softmax.
extern "C" __global__ void moe_route(const float* logits, const float* bias, int E, int k, int gating, int* ids,
                                     float* w) {
    extern __shared__ float sm[];
    float* score = sm;
    float* choice = sm + E;
    int t = blockIdx.x, lane = threadIdx.x;
    const float* lg = logits + (i64)t * E;
    if (gating == 2) {
        for (int e = lane; e < E; e += WARP) score[e] = 1.0f / (1.0f + expf(-lg[e]));
    } else {
        float mx = NEG_INF;
        for (int e = lane; e < E; e += WARP) mx = fmaxf(mx, lg[e]);
        mx = warp_max(mx);
        float s = 0.f;
        for (int e = lane; e < E; e += WARP) {
            score[e] = expf(lg[e] - mx);
            s += score[e];
        }
        s = warp_sum(s);
        for (int e = lane; e < E; e += WARP) score[e] = score[e] / s;
    }
    for (int e = lane; e < E; e += WARP) choice[e] = score[e] + bias[e];
    __syncwarp();
    float total = 0.f;
    for (int j = 0; j < k; j++) {
        float best = NEG_INF;
        int bi = 0x7fffffff;
        for (int e = lane; e < E; e += WARP) {
            float c = choice[e];
            if (c > best || (c == best && e < bi)) {
                best = c;
                bi = e;
            }
        }
#pragma unroll
        for (int o = 16; o > 0; o >>= 1) {
            float ob = __shfl_xor_sync(0xffffffffu, best, o);
            int oi = __shfl_xor_sync(0xffffffffu, bi, o);
            if (ob > best || (ob == best && oi < bi)) {
                best = ob;
                bi = oi;
            }
        }
        // NaN logits win nowhere: expert j keeps the experts' kernels in bounds (NaN weights follow).
        if (bi >= E) bi = j;
        if (lane == 0) {
            ids[t * k + j] = bi;
            choice[bi] = NEG_INF;
        }
        total += score[bi];
        __syncwarp();
    }
    for (int j = lane; j < k; j += WARP) w[t * k + j] = score[ids[t * k + j]] / total;
}

// out[i] = silu(g[i]) * u[i] over n elements.
extern "C" __global__ void silu_mul(const float* g, const float* u, float* out, i64 n) {
    i64 i = blockIdx.x * (i64)blockDim.x + threadIdx.x;
    if (i < n) {
        float x = g[i];
        out[i] = x / (1.0f + expf(-x)) * u[i];
    }
}

// hidden[t][i] += sum_j w[t*k + j] * d[(t*k + j)][i]. grid (nt), block 256.
extern "C" __global__ void moe_combine(float* hidden, const float* d, const float* w, int k, int H) {
    int t = blockIdx.x;
    for (int i = threadIdx.x; i < H; i += blockDim.x) {
        float o = 0.f;
        for (int j = 0; j < k; j++) o += w[t * k + j] * d[((i64)t * k + j) * H + i];
        hidden[(i64)t * H + i] += o;
    }
}

// Token→expert grouping for the grouped expert GEMM (mmg_* in quant_matmul.cu), one per MoE
// layer: count pairs per expert, scan the counts into list offsets and GEMM tiles of up to bm
// pairs (experts without pairs get none), then list the pairs expert by expert. The order of
// pairs inside an expert depends on atomics, but every output row is computed on its own, so
// results do not.

// counts[ids[p]] += 1 for p < npairs (counts zeroed before). grid ceil(npairs / 256), block 256.
extern "C" __global__ void moe_group_count(const int* ids, int npairs, int E, int* counts) {
    int p = blockIdx.x * blockDim.x + threadIdx.x;
    if (p < npairs) {
        int e = ids[p];
        if (e >= 0 && e < E) atomicAdd(&counts[e], 1);
    }
}

// In place: counts[e] becomes the offset of expert e's pairs in the list; tiles gets one
// (expert, start, count) triple per tile, *ntiles their number. One block of 1024 threads.
extern "C" __global__ void moe_group_scan(int* counts, int E, int bm, int* tiles, int* ntiles) {
    __shared__ int sc[1024], st[1024];
    __shared__ int carry_c, carry_t;
    int i = threadIdx.x;
    if (i == 0) {
        carry_c = 0;
        carry_t = 0;
    }
    __syncthreads();
    for (int base = 0; base < E; base += 1024) {
        int e = base + i;
        int c = e < E ? counts[e] : 0;
        int nt = (c + bm - 1) / bm;
        sc[i] = c;
        st[i] = nt;
        __syncthreads();
        for (int o = 1; o < 1024; o <<= 1) {
            int a = i >= o ? sc[i - o] : 0;
            int b = i >= o ? st[i - o] : 0;
            __syncthreads();
            sc[i] += a;
            st[i] += b;
            __syncthreads();
        }
        int off = carry_c + sc[i] - c, toff = carry_t + st[i] - nt;
        if (e < E) {
            counts[e] = off;
            for (int j = 0; j < nt; j++) {
                tiles[3 * (toff + j)] = e;
                tiles[3 * (toff + j) + 1] = off + j * bm;
                tiles[3 * (toff + j) + 2] = min(bm, c - j * bm);
            }
        }
        __syncthreads();
        if (i == 1023) {
            carry_c += sc[1023];
            carry_t += st[1023];
        }
        __syncthreads();
    }
    if (i == 0) *ntiles = carry_t;
}

// list[cursor[ids[p]]++] = p. grid ceil(npairs / 256), block 256.
extern "C" __global__ void moe_group_fill(const int* ids, int npairs, int E, int* cursor, int* list) {
    int p = blockIdx.x * blockDim.x + threadIdx.x;
    if (p < npairs) {
        int e = ids[p];
        if (e >= 0 && e < E) list[atomicAdd(&cursor[e], 1)] = p;
    }
}
