// Q8_0 dense products of 4-32-token steps with the step's activations in shared memory
// (host: Gpu::mvx_plan in cuda/fast.rs). Appended after fast.cu, stream.cu and gstream.cu in the
// "fast" module (fast.cu's mv_seg_row / mma_s8_16832 / cp.async helpers).
//
// mvx_q8_0_T_NB_KW (T = m16 token tiles: 1 for <= 16 tokens, 2 for <= 32), the tensor-core
// product of 4-32-token steps where the card has the shared memory (host: Gpu::mvx_plan).
// mvmma_q8_0 has every block re-read its tokens' activations from L2 for each of its 16 rows (512
// blocks x 96 KB for M2.7's q/k/v at 32 tokens) and is latency-bound there: ~42 us for 27 MB of
// weights (Nsight: 20% of issue slots, stalls on global and shared loads). Here one block per SM
// stages the activations of its K part once (cp.async by every thread, 16-byte pieces; bulk copies
// of each token's 256-byte chunk rows onto one mbarrier per chunk, so that warps could start
// before the whole part had landed, were slower: batch 32 37.2 against 35.1 ms a step; rows of
// kcols + 16 bytes, so the ldmatrix rows of an A fragment hit distinct banks) and its 8 KW warps stream 8-row tasks (one n8 tile;
// warp group wg = warp / 8 takes the wg-th of KW column ranges of the block's part) one after
// another through a ring of NB 272-byte chunk buffers (the first NB - 1 issued before the PDL
// wait), without draining it between tasks. Per 32 columns: an ldmatrix.x4 per token tile, one
// mma.m16n8k32 s8 per tile, sums scaled by (token's q8 scale x block's f16 scale) in f32 and
// added over the range in order. Activations too wide for the shared memory are split in KS
// parts (grid y; the o-projection's 6144 columns: 2). With KS x KW > 1 parts each part writes its
// partial sums to part[p][token][row] (p = blockIdx.y KW + wg), and the last part to finish a
// task (cnt[task], reset to 0 by it) adds them in part order and stores: deterministic. Same
// arguments as mvmma_q8_0 plus (ks, part, cnt); grid (blocks, ks), block 256 KW, dynamic shared
// memory mvx_smem (host). ncol % 128 == 0, xq / xd 16-byte aligned, nv <= 16 T, nchunks % (ks
// kw) == 0.
#define MVX_RB (8 * CH)  // one ring buffer: 8 rows x one 272-byte chunk
#define MVX_PIECES (8 * CH16)  // 16-byte pieces of a buffer (136)
__device__ __forceinline__ void ldsm_x4(u32 (&r)[4], const void* p) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(smem_addr(p)));
}
template <int MT, int NB, int KW>
__device__ __forceinline__ void mvx_q8_0_impl(const u8* W0, i64 rb0, int rows0, float* y0, i64 ys0, const u8* W1,
                                              i64 rb1, int rows1, float* y1, i64 ys1, const u8* W2, i64 rb2,
                                              int rows2, float* y2, i64 ys2, int nchunks, const i8* xq,
                                              const float* xd, int ncol, int nv, int accumulate, int ks,
                                              float* part, u32* cnt) {
    extern __shared__ __align__(16) u8 dyn_smem[];
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
    const int wg = warp >> 3, w8 = warp & 7;
    const int pch = nchunks / ks, c0 = blockIdx.y * pch;  // the block's K part (chunks)
    const int kcols = pch * 256, xpitch = kcols + 16, nsc = kcols / 32, spitch = nsc + 4;
    const int wch = pch / KW, wc0 = wg * wch;  // this warp's chunks within the part
    const int nparts = ks * KW, pidx = blockIdx.y * KW + wg;
    u8* xs = dyn_smem;
    float* xds = (float*)(dyn_smem + 16 * MT * xpitch);
    u8* ring = (u8*)(xds + 16 * MT * spitch) + warp * (NB * MVX_RB);
    const int rows = rows0 + rows1 + rows2, ntask = (rows + 7) >> 3;
    const int wstride = gridDim.x * 8, first = blockIdx.x * 8 + w8;
    const int total = (first < ntask ? (ntask - 1 - first) / wstride + 1 : 0) * wch;
    // The issuing side: chunk ic of task itask; piece p (16 bytes) of a buffer is row p / 17's
    // piece p % 17, its source pointer per task (chunk 0 of this warp's range).
    const u8* src[5];
    int itask = first - wstride, ic = wch - 1, issued = 0;
    auto issue = [&]() {
        if (issued < total) {
            if (++ic == wch) {
                ic = 0;
                itask += wstride;
#pragma unroll
                for (int k = 0; k < 5; k++) {
                    const int p = lane + 32 * k;
                    const u8* w = nullptr;
                    int rr;
                    float* y;
                    i64 ys;
                    if (p < MVX_PIECES && mv_seg_row(itask * 8 + p / CH16, W0, rb0, rows0, y0, ys0, W1, rb1, rows1, y1,
                                                     ys1, W2, rb2, rows2, y2, ys2, w, rr, y, ys))
                        w += (p % CH16) * 16 + (i64)(c0 + wc0) * CH;
                    else
                        w = nullptr;
                    src[k] = w;
                }
            }
            u8* b = ring + (issued % NB) * MVX_RB;
#pragma unroll
            for (int k = 0; k < 5; k++)
                if (src[k]) cp_async16(b + (lane + 32 * k) * 16, src[k] + ic * CH);
            issued++;
        }
        cp_async_commit();
    };
#pragma unroll
    for (int i = 0; i < NB - 1; i++) issue();
    pdl_wait();
    pdl_trigger();
    // The K part's activations of the step's tokens (tokens past nv stay unset: their outputs
    // are never stored).
    {
        const int nvh = min(nv, 16 * MT), xp = kcols / 16, sp = kcols / 128;
        for (int p = threadIdx.x; p < nvh * xp; p += blockDim.x) {
            const int tok = p / xp, q = p - tok * xp;
            cp_async16(xs + tok * xpitch + q * 16, xq + (i64)tok * ncol + c0 * 256 + q * 16);
        }
        for (int p = threadIdx.x; p < nvh * sp; p += blockDim.x) {
            const int tok = p / sp, q = p - tok * sp;
            cp_async16(xds + tok * spitch + q * 4, xd + (i64)tok * (ncol / 32) + c0 * 8 + q * 4);
        }
        cp_async_commit();
        cp_async_wait<0>();
        __syncthreads();
    }
    // ldmatrix row of this lane: token (lane & 7) + 8 ((lane >> 3) & 1), bytes 16 (lane >> 4);
    // this lane's q8 scales: tokens g and g + 8 of each tile.
    const u8* xl = xs + ((lane & 7) + 8 * ((lane >> 3) & 1)) * xpitch + 16 * (lane >> 4) + wc0 * 256;
    const float* dxl = xds + g * spitch + wc0 * 8;
    float acc[MT][4];
#pragma unroll
    for (int m = 0; m < MT; m++)
#pragma unroll
        for (int q = 0; q < 4; q++) acc[m][q] = 0.f;
    int task = first, c = 0;
    for (int i = 0; i < total; i++) {
        issue();
        cp_async_wait<NB - 1>();
        __syncwarp();
        const u8* b = ring + (i % NB) * MVX_RB;
#pragma unroll
        for (int j = 0; j < 8; j++) {
            const int kb = c * 8 + j;
            u32 a[MT][4];
            float dx[MT][2];
#pragma unroll
            for (int m = 0; m < MT; m++) {
                ldsm_x4(a[m], xl + m * 16 * xpitch + kb * 32);
                dx[m][0] = dxl[16 * m * spitch + kb];
                dx[m][1] = dxl[(16 * m + 8) * spitch + kb];
            }
            const u8* blk = b + g * CH + j * 34;
            u32 b0, b1;
            q8_0_bfrag(blk, j, t, b0, b1);
            // This lane's output columns: rows 2t and 2t + 1 of the task.
            const float dw0 = f16_to_f32(*(const u16*)(b + (2 * t) * CH + j * 34));
            const float dw1 = f16_to_f32(*(const u16*)(b + (2 * t + 1) * CH + j * 34));
#pragma unroll
            for (int m = 0; m < MT; m++) {
                int cr[4];
                mma_s8_16832(cr, a[m], b0, b1);
                acc[m][0] += dx[m][0] * dw0 * (float)cr[0];
                acc[m][1] += dx[m][0] * dw1 * (float)cr[1];
                acc[m][2] += dx[m][1] * dw0 * (float)cr[2];
                acc[m][3] += dx[m][1] * dw1 * (float)cr[3];
            }
        }
        __syncwarp();  // every lane is done with this buffer before it is refilled
        if (++c < wch) continue;
        c = 0;
        // Task done: this lane's outputs are tokens 16 m + g (+ 8) x rows task * 8 + 2 t (+ 1).
        const int r0 = task * 8 + 2 * t;
        bool store = nparts == 1;
        if (!store) {
            float* pp = part + (i64)pidx * nv * rows;
#pragma unroll
            for (int m = 0; m < MT; m++)
#pragma unroll
                for (int q = 0; q < 4; q++) {
                    const int tok = 16 * m + g + 8 * (q >> 1), r = r0 + (q & 1);
                    if (tok < nv && r < rows) pp[(i64)tok * rows + r] = acc[m][q];
                }
            __threadfence();
            __syncwarp();
            u32 prev = 0;
            if (lane == 0) prev = atomicAdd(cnt + task, 1u);
            prev = __shfl_sync(0xffffffffu, prev, 0);
            __syncwarp();
            store = prev == (u32)nparts - 1;
            if (store) {
                __threadfence();
#pragma unroll
                for (int m = 0; m < MT; m++)
#pragma unroll
                    for (int q = 0; q < 4; q++) {
                        const int tok = 16 * m + g + 8 * (q >> 1), r = r0 + (q & 1);
                        if (tok < nv && r < rows) {
                            float v = __ldcg(part + (i64)tok * rows + r);
                            for (int o = 1; o < nparts; o++) v += __ldcg(part + ((i64)o * nv + tok) * rows + r);
                            acc[m][q] = v;
                        }
                    }
                if (lane == 0) cnt[task] = 0;
            }
        }
        if (store) {
#pragma unroll
            for (int h = 0; h < 2; h++) {  // row r0 + h
                const u8* wr;
                int rr;
                float* y;
                i64 ys;
                if (!mv_seg_row(r0 + h, W0, rb0, rows0, y0, ys0, W1, rb1, rows1, y1, ys1, W2, rb2, rows2, y2, ys2, wr, rr,
                                y, ys))
                    continue;
                float* yr = y + rr;
#pragma unroll
                for (int m = 0; m < MT; m++)
#pragma unroll
                    for (int e = 0; e < 2; e++) {
                        const int tok = 16 * m + g + 8 * e;
                        if (tok < nv) {
                            float* yp = yr + (i64)tok * ys;
                            *yp = accumulate ? *yp + acc[m][2 * e + h] : acc[m][2 * e + h];
                        }
                    }
            }
        }
#pragma unroll
        for (int m = 0; m < MT; m++)
#pragma unroll
            for (int q = 0; q < 4; q++) acc[m][q] = 0.f;
        task += wstride;
    }
    cp_async_wait<0>();
}
#define MVX_INST(mt, nb, kw)                                                                                        \
    extern "C" __global__ void __launch_bounds__(256 * kw, 1) mvx_q8_0_##mt##_##nb##_##kw(                         \
        const u8* W0, i64 rb0, int rows0, float* y0, i64 ys0, const u8* W1, i64 rb1, int rows1, float* y1, i64 ys1, \
        const u8* W2, i64 rb2, int rows2, float* y2, i64 ys2, int nchunks, const i8* xq, const float* xd, int ncol,  \
        int nv, int accumulate, int ks, float* part, u32* cnt) {                                                   \
        mvx_q8_0_impl<mt, nb, kw>(W0, rb0, rows0, y0, ys0, W1, rb1, rows1, y1, ys1, W2, rb2, rows2, y2, ys2,       \
                                  nchunks, xq, xd, ncol, nv, accumulate, ks, part, cnt);                           \
    }
MVX_INST(1, 4, 1)
MVX_INST(1, 6, 1)
MVX_INST(2, 4, 1)
MVX_INST(2, 6, 1)
MVX_INST(1, 3, 2)
MVX_INST(2, 3, 2)
