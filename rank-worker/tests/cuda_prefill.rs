//! Prefill on tensor cores against CPU twins: the quantized GEMM (every type, every token tile,
//! both precisions, accumulate on and off, strided, sizes off the tiles), the device-side
//! expert grouping and the grouped expert GEMMs (random routing with empty experts), and a
//! fixture model's long prompt against the CPU backend. Outputs are poisoned with NaN before
//! every launch; NaN never passes. Needs a GPU: run with `--ignored`.
#![cfg(feature = "cuda")]

mod common;

use std::sync::{Arc, Mutex};

use common::gpu::{NAN, Rng, TYPES, dot, gpu, random_rows, upload_mat, upload_mat_shifted};
use minimax_rank::comm::Solo;
use minimax_rank::cpu::{CpuModel, KvSpec};
use cudarc::driver::CudaSlice;
use minimax_rank::cuda::blas::set_blas;
use minimax_rank::cuda::matmul::{INT8_PASSES, set_int8_linear_copies, set_int8_mi, set_int8_stages};
use minimax_rank::cuda::{CudaModel, CudaOptions, DevMat, GemmPrecision, Gpu, KvDtype, set_gemm_compact, set_gemm_fast, set_gemm_precision};
use minimax_rank::partition::Partition;
use minimax_shared::forward::{ForwardBatch, LogitsWanted, SeqStep};
use minimax_shared::gguf::GgufModel;
use minimax_shared::model::ModelConfig;
use minimax_shared::quant::{self, GgmlType};

/// The GEMM precision is process-wide: tests that depend on it run one at a time.
static SERIAL: Mutex<()> = Mutex::new(());

/// Columns off the 64-column K step where the type allows it.
fn cols_for(ty: GgmlType) -> usize {
    match ty.block_elems() {
        1 => 1004,
        32 => 32 * 37,
        _ => 256 * 3,
    }
}

/// The CPU twin: dequantized f32 rows (bit-exact to the GPU's dequantization).
fn dequant(ty: GgmlType, bytes: &[u8], rows: usize, cols: usize) -> Vec<f32> {
    quant::dequantize_to_vec(ty, bytes, rows * cols).unwrap()
}

/// Allowed |error| of one output as a fraction of Σ|w·x|: every product of 1 pass has W and X
/// rounded to bf16 (≤ 2^-9 relative each: 3.9e-3 together, plus f32 accumulation); 3 passes
/// leave the lo·lo term and the lo parts' roundings (≤ 3·2^-17) plus f32 accumulation
/// (≤ K·2^-24 in the worst case, far less in practice): 4e-5.
fn rel_bound(passes: usize) -> f64 {
    if passes == 1 { 4e-3 } else { 4e-5 }
}

struct Check {
    worst: f64,
    sum_sq_err: f64,
    sum_sq: f64,
}
impl Check {
    fn new() -> Self {
        Check { worst: 0.0, sum_sq_err: 0.0, sum_sq: 0.0 }
    }
    /// One GPU output against its reference; panics with `what` when out of bounds or NaN.
    fn one(&mut self, got: f32, want: f64, abs_sum: f64, passes: usize, what: &dyn Fn() -> String) {
        let err = (got as f64 - want).abs();
        let tol = rel_bound(passes) * abs_sum + 1e-6;
        assert!(err <= tol, "{}: got {got}, want {want}, |err| {err:.3e} > {tol:.3e}", what());
        self.worst = self.worst.max(err / abs_sum.max(1e-30));
        self.sum_sq_err += err * err;
        self.sum_sq += want * want;
    }
    /// RMS error relative to the RMS output: 1 pass ~1.6e-3 expected (random rounding errors of
    /// two bf16 per product), a wrong or missing 32-column chunk gives ~16%; 3 passes ~1e-5.
    fn finish(&self, passes: usize, what: &str) -> f64 {
        let rel = (self.sum_sq_err / self.sum_sq.max(1e-30)).sqrt();
        let lim = if passes == 1 { 1e-2 } else { 1e-4 };
        assert!(rel <= lim, "{what}: rms error {rel:.2e} relative (limit {lim:.0e})");
        rel
    }
}

/// One product `launch(y)` of `n` tokens (X at stride `xs`) into Y at device address `y`
/// (stride `ys`), checked against the CPU for every output: Y is NaN-poisoned first (padding
/// rows past `rows` must stay NaN), or, with `accumulate`, holds random values to add to.
/// Returns (worst |err| / Σ|w·x|, rms relative error).
#[allow(clippy::too_many_arguments)]
fn check_product(
    g: &Gpu,
    rng: &mut Rng,
    (wf, rows, cols): (&[f32], usize, usize),
    (x, xs): (&[f32], usize),
    (yd, ys): (&mut CudaSlice<f32>, usize),
    n: usize,
    passes: usize,
    accumulate: bool,
    label: &str,
    launch: impl FnOnce(u64),
) -> (f64, f64) {
    let base: Vec<f32> = if accumulate { rng.vec(n * ys, 2.0) } else { Vec::new() };
    if accumulate {
        g.stream.memcpy_htod(&base, yd).unwrap();
    } else {
        g.fill_u32(g.ptr(yd), n * ys, NAN).unwrap();
    }
    launch(g.ptr(yd));
    let y = g.download(yd).unwrap();
    let mut chk = Check::new();
    for t in 0..n {
        for r in 0..rows {
            let (want, abs) = dot(&wf[r * cols..(r + 1) * cols], &x[t * xs..t * xs + cols]);
            let want = want + if accumulate { base[t * ys + r] as f64 } else { 0.0 };
            chk.one(y[t * ys + r], want, abs, passes, &|| format!("{label} token {t} row {r}"));
        }
        if !accumulate {
            for r in rows..ys {
                assert!(y[t * ys + r].is_nan(), "{label}: wrote outside the rows (token {t}, column {r})");
            }
        }
    }
    let rel = chk.finish(passes, label);
    (chk.worst, rel)
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn gemm_matches_cpu_for_every_type_tile_and_precision() {
    let _s = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let g = gpu();
    let mut rng = Rng(0x5eed_0001);
    for ty in TYPES {
        let cols = cols_for(ty);
        let rows = 133; // two row tiles, the second nearly empty
        let w = random_rows(&mut rng, ty, rows, cols);
        let wf = dequant(ty, &w, rows, cols);
        let (_wb, m) = upload_mat(&g, ty, &w, rows, cols, 0);
        for (n, nt) in [(7usize, 2usize), (45, 2), (77, 8), (150, 8), (33, 8)] {
            let (xs, ys) = (cols + 4, rows + 3);
            let x = rng.vec(n * xs, 1.0);
            let xd = g.upload(&x).unwrap();
            let mut yd = g.zeros::<f32>(n * ys).unwrap();
            for passes in [1usize, 3] {
                for accumulate in [false, true] {
                    let label = format!("{ty:?} n {n} tile {nt} passes {passes} acc {accumulate}");
                    let (worst, rel) = check_product(&g, &mut rng, (&wf, rows, cols), (&x, xs), (&mut yd, ys), n, passes, accumulate, &label, |y| {
                        g.matmul_with(&m, g.ptr(&xd), xs, y, ys, n, accumulate, nt, passes).unwrap()
                    });
                    if !accumulate && nt == 2 {
                        eprintln!("{ty:?} {rows}x{cols} n {n} passes {passes}: worst |err|/Σ|wx| {worst:.2e}, rms rel {rel:.2e}");
                    }
                }
            }
        }
    }
}

/// The types with the integer fast path (`mm_f_*` / `mmg_f_*`).
const FAST_TYPES: [GgmlType; 4] = [GgmlType::IQ4_XS, GgmlType::Q4_K, GgmlType::Q6_K, GgmlType::Q8_0];

/// The fast path's dense product for its four types, every token tile (16, 32, 64), both
/// precisions, accumulate on and off, strided X and Y, rows and tokens off the tiles, K off the
/// 128-column stage (Q8_0), and weights whose rows start off 16-byte boundaries (the staging
/// copies aligned spans around them). Outputs NaN-poisoned first; padding must stay NaN.
#[test]
#[ignore = "needs a CUDA GPU"]
fn fast_gemm_matches_cpu_for_every_tile_precision_and_offset() {
    let _s = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    set_gemm_fast(true);
    let g = gpu();
    let mut rng = Rng(0x5eed_0011);
    for ty in FAST_TYPES {
        let cols = cols_for(ty);
        let rows = 261; // three row tiles of 128, the last nearly empty
        let w = random_rows(&mut rng, ty, rows, cols);
        let wf = dequant(ty, &w, rows, cols);
        // Rows start 4 bytes past a 16-byte boundary (and IQ4_XS / Q6_K / Q8_0 rows are not
        // multiples of 16 bytes): the staging copies the aligned 16-byte spans around them.
        let (_wb, m) = upload_mat_shifted(&g, ty, &w, rows, cols);
        {
            for (n, bm, compact) in [(7usize, 16usize, false), (45, 16, false), (33, 32, false), (77, 32, false), (77, 32, true), (40, 32, true), (150, 64, false), (64, 64, false), (130, 64, false)] {
                set_gemm_compact(compact);
                let (xs, ys) = (cols + 4, rows + 3);
                let x = rng.vec(n * xs, 1.0);
                let xd = g.upload(&x).unwrap();
                let mut yd = g.zeros::<f32>(n * ys).unwrap();
                for passes in [1usize, 3] {
                    for accumulate in [false, true] {
                        let label = format!("fast {ty:?} n {n} tile {bm} compact {compact} passes {passes} acc {accumulate}");
                        let (worst, rel) = check_product(&g, &mut rng, (&wf, rows, cols), (&x, xs), (&mut yd, ys), n, passes, accumulate, &label, |y| {
                            g.matmul_fast_with(&m, g.ptr(&xd), xs, y, ys, n, accumulate, bm, passes).unwrap()
                        });
                        if !accumulate && n == 77 && !compact {
                            eprintln!("fast {ty:?} {rows}x{cols} n {n} passes {passes}: worst |err|/Σ|wx| {worst:.2e}, rms rel {rel:.2e}");
                        }
                    }
                }
            }
        }
    }
    set_gemm_compact(true);
    // Bad arguments are errors, never launches.
    let ty = GgmlType::IQ4_XS;
    let w = random_rows(&mut rng, ty, 130, 512);
    let (_wb, m) = upload_mat(&g, ty, &w, 130, 512, 0);
    let xd = g.upload(&rng.vec(40 * 512, 1.0)).unwrap();
    let yd = g.zeros::<f32>(40 * 130).unwrap();
    assert!(g.matmul_fast_with(&m, g.ptr(&xd), 512, g.ptr(&yd), 130, 40, false, 48, 3).is_err(), "tile 48");
    assert!(g.matmul_fast_with(&m, g.ptr(&xd), 512, g.ptr(&yd), 130, 40, false, 32, 2).is_err(), "2 passes");
    assert!(g.matmul_fast_with(&m, g.ptr(&xd) + 4, 512, g.ptr(&yd), 130, 40, false, 32, 3).is_err(), "misaligned x");
    let odd = DevMat { ptr: m.ptr + 2, ..m };
    assert!(g.matmul_fast_with(&odd, g.ptr(&xd), 512, g.ptr(&yd), 130, 40, false, 32, 3).is_err(), "IQ4_XS at 2 bytes");
    let f16 = DevMat { ty: GgmlType::F16, ..m };
    assert!(g.matmul_fast_with(&f16, g.ptr(&xd), 512, g.ptr(&yd), 130, 40, false, 32, 3).is_err(), "F16 has no fast path");
}

/// CPU twin of `mm_x_i8`: per 32 columns d = absmax / 127 in f32, its significand rounded up
/// to 22 bits, q = round-half-even(x / d) (all in f32, as the kernel); returns q·d in f64
/// (exact). `cols` columns per row, rows `xs` apart.
fn q8_twin(x: &[f32], rows: usize, xs: usize, cols: usize) -> Vec<f64> {
    let mut out = vec![0f64; rows * cols];
    for r in 0..rows {
        for (ci, c) in x[r * xs..r * xs + cols].chunks(32).enumerate() {
            let amax = c.iter().fold(0f32, |m, v| m.max(v.abs()));
            let d = f32::from_bits(((amax / 127.0).to_bits() + 3) & !3);
            for (j, &v) in c.iter().enumerate() {
                let q = if amax == 0.0 { 0.0 } else { (v / d).round_ties_even() };
                assert!(q.abs() <= 127.0);
                out[r * cols + ci * 32 + j] = q as f64 * d as f64;
            }
        }
    }
    out
}

/// Checks of int8 products: every output against the twin on q8 X (bound 4e-6·Σ|w·x_q|: f32
/// rounding of each chunk's c·d_x, its product with the weight scale and the f32 sum over
/// chunks), and statistics against the exact product on f32 X (reported for the docs).
struct Int8Check {
    worst_twin: f64,
    worst_exact: f64,
    se_exact: f64,
    se_twin: f64,
    ss: f64,
}
impl Int8Check {
    fn new() -> Self {
        Int8Check { worst_twin: 0.0, worst_exact: 0.0, se_exact: 0.0, se_twin: 0.0, ss: 0.0 }
    }
    /// One output: `w` the dequantized weight row, `xq` the twin's q8 X row, `x` the f32 row,
    /// `base` what the product adds to.
    fn one(&mut self, got: f32, w: &[f32], xq: &[f64], x: &[f32], base: f64, what: &dyn Fn() -> String) {
        let (mut want, mut abs) = (base, 0f64);
        for (&w, &q) in w.iter().zip(xq) {
            want += w as f64 * q;
            abs += (w as f64 * q).abs();
        }
        let (exact, eabs) = dot(w, x);
        let exact = exact + base;
        let err = (got as f64 - want).abs();
        let tol = 4e-6 * abs + 1e-6 * base.abs() + 1e-7;
        assert!(err <= tol, "{}: got {got}, twin {want}, |err| {err:.3e} > {tol:.3e}", what());
        self.worst_twin = self.worst_twin.max(err / abs.max(1e-30));
        let ee = (got as f64 - exact).abs();
        self.worst_exact = self.worst_exact.max(ee / eabs.max(1e-30));
        self.se_exact += ee * ee;
        self.se_twin += err * err;
        self.ss += (exact - base) * (exact - base);
    }
    /// RMS errors relative to the RMS product: (vs twin, vs exact). Against the exact product
    /// q8 rounding gives ~4e-3; a wrong or missing chunk ~16%: both bounded here.
    fn finish(&self, what: &str) -> (f64, f64) {
        let twin = (self.se_twin / self.ss.max(1e-30)).sqrt();
        let exact = (self.se_exact / self.ss.max(1e-30)).sqrt();
        assert!(twin <= 1e-5, "{what}: rms error vs twin {twin:.2e}");
        assert!(exact <= 2e-2, "{what}: rms error vs exact {exact:.2e}");
        (twin, exact)
    }
}

/// One grouped int8 case on the device: `ne` experts of `rows × cols` random `ty` weights (and
/// their dequantized values), X of `tokens` rows `cols + 8` floats apart (and its q8 twin).
struct GroupedCase {
    _wb: CudaSlice<u8>,
    m: DevMat,
    wf: Vec<f32>,
    x: Vec<f32>,
    xq: Vec<f64>,
    xd: CudaSlice<f32>,
    xs: usize,
}

fn grouped_case(g: &Gpu, rng: &mut Rng, ty: GgmlType, (ne, rows, cols): (usize, usize, usize), tokens: usize) -> GroupedCase {
    let w = random_rows(rng, ty, ne * rows, cols);
    let wf = dequant(ty, &w, ne * rows, cols);
    let (_wb, m) = upload_mat(g, ty, &w, rows, cols, ne);
    let xs = cols + 8;
    let x = rng.vec(tokens * xs, 1.0);
    let xq = q8_twin(&x, tokens, xs, cols);
    let xd = g.upload(&x).unwrap();
    GroupedCase { _wb, m, wf, x, xq, xd, xs }
}

/// Every output of a grouped int8 product (`y`: pair p's row at `p * ys`, then one NaN-poisoned
/// padding column that must stay NaN) against the q8 twin: weights `wf` (`rows × cols` per
/// expert), X rows `xs` apart with their twin `xq`, pair p = token p / k.
fn check_grouped(y: &[f32], ys: usize, (rows, cols): (usize, usize), ids: &[i32], k: usize, wf: &[f32], (x, xq, xs): (&[f32], &[f64], usize), what: &str) -> Int8Check {
    let mut chk = Int8Check::new();
    for p in 0..ids.len() {
        let (e, t) = (ids[p] as usize, p / k);
        for r in 0..rows {
            let wr = &wf[(e * rows + r) * cols..(e * rows + r + 1) * cols];
            chk.one(y[p * ys + r], wr, &xq[t * cols..(t + 1) * cols], &x[t * xs..t * xs + cols], 0.0, &|| format!("{what} pair {p} (expert {e}) row {r}"));
        }
        assert!(y[p * ys + rows].is_nan(), "{what}: wrote past the rows of pair {p}");
    }
    chk
}

/// Routing of `tokens` tokens to `k` (≥ 2) of 9 experts: expert 0 takes every token (two
/// 64-pair tiles at 100 tokens), expert 2 token 5 only, experts 1, 4 and 6 none, the rest random
/// among 3, 5, 7 and 8.
fn skewed_routing(rng: &mut Rng, tokens: usize, k: usize) -> Vec<i32> {
    let mut ids = Vec::new();
    for t in 0..tokens {
        let mut chosen = vec![0usize, if t == 5 { 2 } else { [3, 5, 7, 8][rng.below(4)] }];
        while chosen.len() < k {
            let e = [3usize, 5, 7, 8][rng.below(4)];
            if !chosen.contains(&e) {
                chosen.push(e);
            }
        }
        ids.extend(chosen.iter().map(|&e| e as i32));
    }
    ids
}

/// The int8 kernels (IQ4_XS, Q8_0): dense products at every token tile (16, 32, 64; tiles with
/// at most half or a quarter of their tokens valid run the half- or quarter-width code), 2, 3
/// (default) and 4 pipeline stages, accumulate on and off, strided X
/// and Y, rows starting 4 bytes past 16-byte boundaries, rows and tokens off the tiles, K off
/// the 128-column stage with an odd number of 32-column chunks (Q8_0), NaN-poisoned outputs
/// whose padding must stay NaN, for each warp layout (1, 2, 4 m16 tiles a warp: `set_int8_mi`);
/// then bad arguments as errors.
#[test]
#[ignore = "needs a CUDA GPU"]
fn int8_gemm_matches_q8_twin_for_every_tile() {
    let _s = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    set_gemm_fast(true);
    let g = gpu();
    let mut rng = Rng(0x5eed_0018);
    for (ty, mi) in [GgmlType::IQ4_XS, GgmlType::Q8_0].into_iter().flat_map(|ty| [1usize, 2, 4, 0].map(|mi| (ty, mi))) {
        // mi 1, 2, 4: weight rows copied two threads a row (MINIMAX_I8_WLOAD_LINEAR=0); mi 0:
        // the default layout (1) with the default linear copies.
        set_int8_mi(Some(mi.max(1)));
        set_int8_linear_copies(Some(mi == 0));
        // With the default layout also rows 16-byte multiples apart (512 columns: 272 bytes for
        // both types), where the linear copies take a constant number of pieces a row (9, or 10
        // with the rows 4 bytes off 16-byte boundaries, as here) and the stage's rows share
        // their misalignment.
        let widths = if mi == 0 { vec![cols_for(ty), 512] } else { vec![cols_for(ty)] };
        for cols in widths {
            let rows = 261;
            let w = random_rows(&mut rng, ty, rows, cols);
            let wf = dequant(ty, &w, rows, cols);
            let (_wb, m) = upload_mat_shifted(&g, ty, &w, rows, cols);
            for (n, bm, st, splits) in [
                (7usize, 16usize, None, 1usize),
                (45, 16, Some(2), 1),
                (5, 16, None, 1),
                (33, 32, None, 1),
                (77, 32, Some(4), 1),
                (12, 32, None, 2),
                (5, 32, Some(2), 1),
                (150, 64, None, 1),
                (64, 64, Some(3), 3),
                (130, 64, Some(4), 1),
                (20, 64, None, 2),
                (13, 64, Some(2), 1),
                (97, 64, None, 3),
            ] {
                set_int8_stages(st);
                let (xs, ys) = (cols + 4, rows + 3);
                let mut x = rng.vec(n * xs, 1.0);
                // One all-zero chunk (scale 0) and one with an outlier.
                x[..32].iter_mut().for_each(|v| *v = 0.0);
                x[xs + 40] = 300.0;
                let xq = q8_twin(&x, n, xs, cols);
                let xd = g.upload(&x).unwrap();
                let mut yd = g.zeros::<f32>(n * ys).unwrap();
                for accumulate in [false, true] {
                    let base: Vec<f32> = if accumulate { rng.vec(n * ys, 2.0) } else { Vec::new() };
                    if accumulate {
                        g.stream.memcpy_htod(&base, &mut yd).unwrap();
                    } else {
                        g.fill_u32(g.ptr(&yd), n * ys, NAN).unwrap();
                    }
                    g.matmul_fast_split_with(&m, g.ptr(&xd), xs, g.ptr(&yd), ys, n, accumulate, bm, INT8_PASSES, splits).unwrap();
                    let y = g.download(&yd).unwrap();
                    let mut chk = Int8Check::new();
                    for t in 0..n {
                        for r in 0..rows {
                            let b = if accumulate { base[t * ys + r] as f64 } else { 0.0 };
                            chk.one(y[t * ys + r], &wf[r * cols..(r + 1) * cols], &xq[t * cols..(t + 1) * cols], &x[t * xs..t * xs + cols], b, &|| {
                                format!("int8 {ty:?} n {n} tile {bm} acc {accumulate} token {t} row {r}")
                            });
                        }
                        if !accumulate {
                            for r in rows..ys {
                                assert!(y[t * ys + r].is_nan(), "int8 {ty:?} n {n}: wrote outside the rows (token {t}, column {r})");
                            }
                        }
                    }
                    let (twin, exact) = chk.finish(&format!("int8 {ty:?} {cols} columns n {n} tile {bm} warp m16 tiles {mi} stages {st:?} K parts {splits} acc {accumulate}"));
                    if !accumulate {
                        eprintln!(
                            "int8 {ty:?} {rows}x{cols} n {n} tile {bm} mi {mi} stages {st:?} K parts {splits}: vs twin worst {:.2e} rms {twin:.2e} (of Σ|w·x_q|); vs exact f32 product worst {:.2e} rms {exact:.2e}",
                            chk.worst_twin, chk.worst_exact
                        );
                    }
                }
            }
        }
    }
    set_int8_stages(None);
    set_int8_mi(None);
    set_int8_linear_copies(None);
    // The dispatcher under MINIMAX_GEMM=int8: Q8_0, 261 rows, 77 tokens (6 tiles: K split); the
    // built-in kernels, not cuBLAS (tests/cuda_blas.rs covers that path).
    set_blas(Some(false));
    set_gemm_precision(GemmPrecision::Int8);
    let (ty, rows, cols, n) = (GgmlType::Q8_0, 261usize, 1184usize, 77usize);
    let w = random_rows(&mut rng, ty, rows, cols);
    let wf = dequant(ty, &w, rows, cols);
    let (_wb, m) = upload_mat(&g, ty, &w, rows, cols, 0);
    let x = rng.vec(n * cols, 1.0);
    let xq = q8_twin(&x, n, cols, cols);
    let xd = g.upload(&x).unwrap();
    let yd = g.zeros::<f32>(n * rows).unwrap();
    g.fill_u32(g.ptr(&yd), n * rows, NAN).unwrap();
    g.matmul(&m, g.ptr(&xd), cols, g.ptr(&yd), rows, n, false).unwrap();
    let y = g.download(&yd).unwrap();
    let mut chk = Int8Check::new();
    for t in 0..n {
        for r in 0..rows {
            chk.one(y[t * rows + r], &wf[r * cols..(r + 1) * cols], &xq[t * cols..(t + 1) * cols], &x[t * cols..(t + 1) * cols], 0.0, &|| format!("int8 matmul token {t} row {r}"));
        }
    }
    chk.finish("int8 matmul dispatch");
    set_blas(None);
    set_gemm_precision(GemmPrecision::Bf16x3);
    // Bad arguments are errors, never launches.
    let ty = GgmlType::Q4_K;
    let w = random_rows(&mut rng, ty, 130, 512);
    let (_wb, m) = upload_mat(&g, ty, &w, 130, 512, 0);
    let xd = g.upload(&rng.vec(40 * 512, 1.0)).unwrap();
    let yd = g.zeros::<f32>(40 * 130).unwrap();
    assert!(g.matmul_fast_with(&m, g.ptr(&xd), 512, g.ptr(&yd), 130, 40, false, 32, INT8_PASSES).is_err(), "Q4_K has no int8 kernels");
    let iq = DevMat { ty: GgmlType::IQ4_XS, row_bytes: quant::row_bytes(GgmlType::IQ4_XS, 512).unwrap(), ..m };
    assert!(g.matmul_fast_with(&iq, g.ptr(&xd), 512, g.ptr(&yd), 130, 40, false, 48, INT8_PASSES).is_err(), "tile 48");
    assert!(g.matmul_fast_with(&iq, g.ptr(&xd) + 4, 512, g.ptr(&yd), 130, 40, false, 32, INT8_PASSES).is_err(), "misaligned x");
    assert!(g.matmul_fast_split_with(&iq, g.ptr(&xd), 512, g.ptr(&yd), 130, 40, false, 32, 3, 2).is_err(), "split K on the bf16 kernels");
}

/// Grouped int8 products (IQ4_XS, Q8_0) at tiles of 16, 32 and 64 pairs, with experts that get
/// no pair, exactly one, and every token (several tiles, the last partly filled), against the
/// q8 twin; pair rows past the outputs stay NaN.
#[test]
#[ignore = "needs a CUDA GPU"]
fn int8_grouped_gemm_matches_q8_twin() {
    let _s = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    set_gemm_fast(true);
    let g = gpu();
    let mut rng = Rng(0x5eed_0019);
    let (tokens, k, ne) = (100usize, 3usize, 9usize);
    let ids = skewed_routing(&mut rng, tokens, k);
    let np = ids.len();
    assert_eq!(ids.iter().filter(|&&e| e == 2).count(), 1);
    let idd = g.upload(&ids).unwrap();
    // Also 512 columns (rows 272 bytes apart: the copies' constant-pieces path, 9 a row).
    for (ty, cols) in [GgmlType::IQ4_XS, GgmlType::Q8_0].into_iter().flat_map(|ty| [(ty, cols_for(ty)), (ty, 512)]) {
        let rows = 150;
        let GroupedCase { _wb, m, wf, x, xq, xd, xs } = grouped_case(&g, &mut rng, ty, (ne, rows, cols), tokens);
        let ys = rows + 1;
        let yd = g.zeros::<f32>(np * ys).unwrap();
        for (nt, mi) in [1usize, 2, 4].into_iter().flat_map(|nt| [1usize, 2, 4].map(|mi| (nt, mi))) {
            set_int8_mi(Some(mi));
            // Layout 1 with the default linear weight copies, 2 and 4 with two threads a row.
            set_int8_linear_copies(Some(mi == 1));
            let grp = g.group_experts_with(g.ptr(&idd), np, ne, nt).unwrap();
            g.fill_u32(g.ptr(&yd), np * ys, NAN).unwrap();
            g.matmul_experts_with(&m, &grp, g.ptr(&xd), xs, k, g.ptr(&yd), ys, INT8_PASSES).unwrap();
            let y = g.download(&yd).unwrap();
            let chk = check_grouped(&y, ys, (rows, cols), &ids, k, &wf, (&x, &xq, xs), &format!("int8 grouped {ty:?} tile {}", 16 * nt));
            let (twin, exact) = chk.finish(&format!("int8 grouped {ty:?} {cols} columns tile {} warp m16 tiles {mi}", 16 * nt));
            eprintln!("int8 grouped {ty:?} {cols} columns tile {} mi {mi}: vs twin worst {:.2e} rms {twin:.2e}; vs exact worst {:.2e} rms {exact:.2e}", 16 * nt, chk.worst_twin, chk.worst_exact);
        }
    }
    set_int8_mi(None);
    set_int8_linear_copies(None);
}

/// The TMA form of the int8 grouped IQ4_XS products (`mmg_t8_*`, X converted in grouped order
/// by `mmg_xg_i8`): rows off the 128-row block (zero-filled by the copies, never stored), 512 and
/// 1536 columns (one and three 512-column multiples: 2 and 6 stages), every token tile (16, 32,
/// 64; tiles of an expert with one pair, tiles of 65+ pairs), NaN-poisoned outputs whose
/// padding column must stay NaN: every output against the q8 twin, and bit for bit against the
/// `mmg_i8` kernels (same fragments, MMAs and fold order); then the unfit shapes it refuses.
#[test]
#[ignore = "needs a CUDA GPU"]
fn tma_grouped_gemm_matches_q8_twin_and_int8_kernels() {
    use minimax_rank::cuda::tma_experts::set_tma_experts;
    let _s = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    set_gemm_fast(true);
    set_tma_experts(Some(true));
    let g = gpu();
    let mut rng = Rng(0x5eed_0031);
    let (tokens, k, ne) = (100usize, 3usize, 9usize);
    let ids = skewed_routing(&mut rng, tokens, k);
    let np = ids.len();
    let idd = g.upload(&ids).unwrap();
    let ty = GgmlType::IQ4_XS;
    for (rows, cols) in [(150usize, 512usize), (200, 1536)] {
        let GroupedCase { _wb, m, wf, x, xq, xd, xs } = grouped_case(&g, &mut rng, ty, (ne, rows, cols), tokens);
        assert!(g.tma_expert_fits(&m) || g.arch < 90, "{rows} x {cols} IQ4_XS experts should fit the TMA kernels");
        if g.arch < 90 {
            eprintln!("sm_{} has no TMA: skipped", g.arch);
            return;
        }
        let ys = rows + 1;
        let yd = g.zeros::<f32>(np * ys).unwrap();
        let ref_d = g.zeros::<f32>(np * ys).unwrap();
        for (nt, wide) in [1usize, 2, 4].into_iter().flat_map(|nt| [(nt, false), (nt, true)]) {
            minimax_rank::cuda::tma_experts::set_tma_wide(Some(wide));
            let grp = g.group_experts_with(g.ptr(&idd), np, ne, nt).unwrap();
            // The mmg_i8 kernels (default layout) as the bit-exact reference.
            set_int8_mi(Some(1));
            g.fill_u32(g.ptr(&ref_d), np * ys, NAN).unwrap();
            g.matmul_experts_with(&m, &grp, g.ptr(&xd), xs, k, g.ptr(&ref_d), ys, INT8_PASSES).unwrap();
            // Grouped X converted once per token and gathered (the default) is byte for byte the
            // per-pair conversion.
            use minimax_rank::cuda::tma_experts::set_xg_gather;
            set_xg_gather(Some(true));
            g.profile_begin();
            let gx = g.grouped_x(&grp, g.ptr(&xd), xs, None, k, cols).unwrap();
            let prof = g.profile_end().unwrap();
            assert!(prof.iter().map(|(n, _)| n.as_str()).eq(["mmg_x_i8", "mmg_xg_gather"]), "gathered X launched {prof:?}");
            set_xg_gather(Some(false));
            let gx_direct = g.grouped_x(&grp, g.ptr(&xd), xs, None, k, cols).unwrap();
            set_xg_gather(None);
            let (b1, s1) = gx.buffers();
            let (b2, s2) = gx_direct.buffers();
            assert!(g.download(b1).unwrap() == g.download(b2).unwrap(), "gathered X bytes differ from mmg_xg_i8's");
            let bits = |v: Vec<f32>| v.into_iter().map(f32::to_bits).collect::<Vec<_>>();
            assert!(bits(g.download(s1).unwrap()) == bits(g.download(s2).unwrap()), "gathered X scales differ from mmg_xg_i8's");
            g.fill_u32(g.ptr(&yd), np * ys, NAN).unwrap();
            g.profile_begin();
            g.matmul_experts_tma(&m, &grp, &gx, g.ptr(&yd), ys).unwrap();
            let prof = g.profile_end().unwrap();
            assert!(prof.iter().any(|(n, _)| n == &format!("mmg_t8{}_iq4_xs_{}", if wide { "w" } else { "" }, 16 * nt)), "launched {prof:?}");
            let (y, yref) = (g.download(&yd).unwrap(), g.download(&ref_d).unwrap());
            let chk = check_grouped(&y, ys, (rows, cols), &ids, k, &wf, (&x, &xq, xs), &format!("TMA grouped {rows} x {cols} tile {} wide {wide}", 16 * nt));
            for (i, (a, b)) in y.iter().zip(&yref).enumerate() {
                assert_eq!(a.to_bits(), b.to_bits(), "TMA vs mmg_i8, tile {} pair {} row {}", 16 * nt, i / ys, i % ys);
            }
            let (twin, exact) = chk.finish(&format!("TMA grouped {rows} x {cols} tile {} wide {wide}", 16 * nt));
            eprintln!("TMA grouped IQ4_XS {rows} x {cols} tile {} wide {wide}: vs twin worst {:.2e} rms {twin:.2e}; vs exact rms {exact:.2e}; identical to mmg_i8", 16 * nt, chk.worst_twin);
        }
        minimax_rank::cuda::tma_experts::set_tma_wide(None);
    }
    set_int8_mi(None);
    // Unfit shapes: 256 columns (rows of 136 bytes), Q8_0, the switch off.
    let w = random_rows(&mut rng, ty, 2 * 64, 256);
    let (_wb, m) = upload_mat(&g, ty, &w, 64, 256, 2);
    assert!(!g.tma_expert_fits(&m), "256-column IQ4_XS rows are not 16-byte strides");
    let w8 = random_rows(&mut rng, GgmlType::Q8_0, 2 * 64, 512);
    let (_wb8, m8) = upload_mat(&g, GgmlType::Q8_0, &w8, 64, 512, 2);
    assert!(!g.tma_expert_fits(&m8), "Q8_0 has no TMA kernel");
    let w4 = random_rows(&mut rng, ty, 2 * 64, 512);
    let (_wb4, m4) = upload_mat(&g, ty, &w4, 64, 512, 2);
    set_tma_experts(Some(false));
    assert!(!g.tma_expert_fits(&m4), "switched off");
    set_tma_experts(Some(true));
    assert!(g.tma_expert_fits(&m4));
    set_tma_experts(None);
}

/// Throughput of the int8 GEMMs at M2.7 shapes (IQ4_XS experts 1536 x 3072 with 16 and 128
/// pairs per expert, as a 512-token prefill and a 4096-token chunk route them uniformly; a
/// Q8_0 6144 x 3072 dense product of 4096 tokens) for every warp layout and stage count: the
/// A/B and profiling harness of the int8 kernels (`ncu -k regex:mmg_i8`). Checks finiteness
/// only (correctness: the tests above).
#[test]
#[ignore = "needs a CUDA GPU; timing"]
fn int8_gemm_speed() {
    let _s = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    set_gemm_fast(true);
    let g = gpu();
    let mut rng = Rng(0x5eed_0030);
    let (ne, rows, cols, k) = (64usize, 1536usize, 3072usize, 8usize);
    let w = random_rows(&mut rng, GgmlType::IQ4_XS, ne * rows, cols);
    let (_wb, m) = upload_mat(&g, GgmlType::IQ4_XS, &w, rows, cols, ne);
    let time = |f: &mut dyn FnMut()| -> f64 {
        for _ in 0..3 {
            f();
        }
        g.sync().unwrap();
        let t = std::time::Instant::now();
        for _ in 0..10 {
            f();
        }
        g.sync().unwrap();
        t.elapsed().as_secs_f64() / 10.0
    };
    for tokens in [128usize, 1024] {
        let ids = random_routing(&mut rng, tokens, k, ne, &[]);
        let np = ids.len();
        let idd = g.upload(&ids).unwrap();
        let x = rng.vec(tokens * cols, 1.0);
        let xd = g.upload(&x).unwrap();
        let yd = g.zeros::<f32>(np * rows).unwrap();
        let grp = g.group_experts_fast_for(g.ptr(&idd), np, ne, true).unwrap();
        for (mi, st, lin) in [(1usize, None, false), (1, None, true), (1, Some(3), false), (2, None, false), (2, None, true), (4, None, false)] {
            {
                set_int8_mi(Some(mi));
                set_int8_stages(st);
                set_int8_linear_copies(Some(lin));
                let mut run = || g.matmul_experts_with(&m, &grp, g.ptr(&xd), cols, k, g.ptr(&yd), rows, INT8_PASSES).unwrap();
                let t = time(&mut run);
                let y = g.download(&yd).unwrap();
                assert!(y.iter().all(|v| v.is_finite()), "non-finite output");
                eprintln!(
                    "int8 speed grouped IQ4_XS {rows}x{cols}, {} pairs an expert (tile {}), mi {mi} stages {st:?} linear copies {lin}: {:.1} us = {:.0} TOPS",
                    np / ne,
                    16 * grp.nt,
                    t * 1e6,
                    2.0 * (np * rows * cols) as f64 / t / 1e12
                );
            }
        }
        // The TMA kernels (sm_90+) at 32- and 64-pair tiles, against mmg_i8 at the same tile;
        // the grouped X conversion timed on its own.
        minimax_rank::cuda::tma_experts::set_tma_experts(Some(true));
        if g.tma_expert_fits(&m) {
            set_int8_mi(None);
            set_int8_stages(None);
            set_int8_linear_copies(None);
            for nt in [2usize, 4] {
                let grp = g.group_experts_with(g.ptr(&idd), np, ne, nt).unwrap();
                let mut old = || g.matmul_experts_with(&m, &grp, g.ptr(&xd), cols, k, g.ptr(&yd), rows, INT8_PASSES).unwrap();
                let t_old = time(&mut old);
                let gx = g.grouped_x(&grp, g.ptr(&xd), cols, None, k, cols).unwrap();
                let mut conv = || drop(g.grouped_x(&grp, g.ptr(&xd), cols, None, k, cols).unwrap());
                let t_conv = time(&mut conv);
                minimax_rank::cuda::tma_experts::set_xg_gather(Some(false));
                let t_conv_direct = time(&mut conv);
                minimax_rank::cuda::tma_experts::set_xg_gather(None);
                eprintln!("int8 speed grouped X of {np} pairs ({k} a token) x {cols}: converted once a token and gathered {:.1} us, every pair converted {:.1} us", t_conv * 1e6, t_conv_direct * 1e6);
                minimax_rank::cuda::tma_experts::set_tma_wide(Some(false));
                let mut run = || g.matmul_experts_tma(&m, &grp, &gx, g.ptr(&yd), rows).unwrap();
                let t = time(&mut run);
                minimax_rank::cuda::tma_experts::set_tma_wide(Some(true));
                let mut run_w = || g.matmul_experts_tma(&m, &grp, &gx, g.ptr(&yd), rows).unwrap();
                let t_w = time(&mut run_w);
                minimax_rank::cuda::tma_experts::set_tma_wide(None);
                eprintln!("int8 speed grouped IQ4_XS {rows}x{cols}, {} pairs an expert, tile {}: TMA wide warps (mmg_t8w) {:.1} us against mmg_t8 {:.1}", np / ne, 16 * nt, t_w * 1e6, t * 1e6);
                let y = g.download(&yd).unwrap();
                assert!(y.iter().all(|v| v.is_finite()), "non-finite output");
                eprintln!(
                    "int8 speed grouped IQ4_XS {rows}x{cols}, {} pairs an expert, tile {}: mmg_i8 {:.1} us ({:.0} TOPS, {:.2} TB/s of weights), TMA {:.1} us ({:.0} TOPS, {:.2} TB/s) + grouped X conversion {:.1} us",
                    np / ne,
                    16 * nt,
                    t_old * 1e6,
                    2.0 * (np * rows * cols) as f64 / t_old / 1e12,
                    m.n_bytes() as f64 / t_old / 1e12,
                    t * 1e6,
                    2.0 * (np * rows * cols) as f64 / t / 1e12,
                    m.n_bytes() as f64 / t / 1e12,
                    t_conv * 1e6
                );
            }
        }
    }
    let (rows, n) = (6144usize, 4096usize);
    let w = random_rows(&mut rng, GgmlType::Q8_0, rows, cols);
    let (_wb, m) = upload_mat(&g, GgmlType::Q8_0, &w, rows, cols, 0);
    let xd = g.upload(&rng.vec(n * cols, 1.0)).unwrap();
    let yd = g.zeros::<f32>(n * rows).unwrap();
    for (mi, lin) in [(1usize, false), (1, true), (2, false), (2, true), (4, false)] {
        set_int8_mi(Some(mi));
        set_int8_linear_copies(Some(lin));
        let mut run = || g.matmul_fast_with(&m, g.ptr(&xd), cols, g.ptr(&yd), rows, n, false, 64, INT8_PASSES).unwrap();
        let t = time(&mut run);
        eprintln!("int8 speed dense Q8_0 {rows}x{cols}, {n} tokens, tile 64, mi {mi} linear copies {lin}: {:.1} us = {:.0} TOPS", t * 1e6, 2.0 * (n * rows * cols) as f64 / t / 1e12);
    }
    set_int8_mi(None);
    set_int8_stages(None);
    minimax_rank::cuda::tma_experts::set_tma_experts(None);
    set_int8_linear_copies(None);
}

/// Split K (`matmul_split_with`: grid z parts into scratch, `mm_sum_parts` adds them in order)
/// for a float type, a 32-block type and a 256-block type, parts whose last one is short (K off
/// 64 and off the part size), both precisions, accumulate on and off; and `matmul` choosing the
/// split itself for a product of few tiles (F32, as M2.7's router).
#[test]
#[ignore = "needs a CUDA GPU"]
fn split_k_gemm_matches_cpu() {
    let _s = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let g = gpu();
    let mut rng = Rng(0x5eed_001a);
    for ty in [GgmlType::F32, GgmlType::F16, GgmlType::Q8_0, GgmlType::Q4_K] {
        let cols = cols_for(ty);
        let rows = 133;
        let w = random_rows(&mut rng, ty, rows, cols);
        let wf = dequant(ty, &w, rows, cols);
        let (_wb, m) = upload_mat(&g, ty, &w, rows, cols, 0);
        for (n, splits) in [(45usize, 3usize), (77, 5), (33, 16)] {
            let (xs, ys) = (cols + 4, rows + 3);
            let x = rng.vec(n * xs, 1.0);
            let xd = g.upload(&x).unwrap();
            let mut yd = g.zeros::<f32>(n * ys).unwrap();
            for passes in [1usize, 3] {
                for accumulate in [false, true] {
                    let label = format!("split-K {ty:?} n {n} parts {splits} passes {passes} acc {accumulate}");
                    check_product(&g, &mut rng, (&wf, rows, cols), (&x, xs), (&mut yd, ys), n, passes, accumulate, &label, |y| {
                        g.matmul_split_with(&m, g.ptr(&xd), xs, y, ys, n, accumulate, 2, passes, splits).unwrap()
                    });
                }
            }
        }
    }
    // The dispatcher: F32 weights of 100 rows and 300 tokens run 10 tiles, so K is split (the
    // built-in kernels: with cuBLAS on, F32 takes SGEMM).
    set_blas(Some(false));
    set_gemm_precision(GemmPrecision::Bf16x3);
    let (ty, rows, cols, n) = (GgmlType::F32, 100usize, 3072usize, 300usize);
    let w = random_rows(&mut rng, ty, rows, cols);
    let wf = dequant(ty, &w, rows, cols);
    let (_wb, m) = upload_mat(&g, ty, &w, rows, cols, 0);
    let x = rng.vec(n * cols, 1.0);
    let xd = g.upload(&x).unwrap();
    let mut yd = g.zeros::<f32>(n * rows).unwrap();
    for accumulate in [false, true] {
        check_product(&g, &mut rng, (&wf, rows, cols), (&x, cols), (&mut yd, rows), n, 3, accumulate, &format!("matmul F32 split acc {accumulate}"), |y| {
            g.matmul(&m, g.ptr(&xd), cols, y, rows, n, accumulate).unwrap()
        });
    }
    assert!(g.matmul_split_with(&m, g.ptr(&xd), cols, g.ptr(&yd), rows, n, false, 2, 3, 0).is_err(), "0 parts");
    set_blas(None);
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn matvec_dispatches_to_gemm_above_crossover_and_rejects_misalignment() {
    let _s = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let g = gpu();
    let mut rng = Rng(0x5eed_0002);
    let (ty, rows, cols, n) = (GgmlType::IQ4_XS, 300, 512, 70);
    let w = random_rows(&mut rng, ty, rows, cols);
    let wf = dequant(ty, &w, rows, cols);
    let (_wb, m) = upload_mat(&g, ty, &w, rows, cols, 0);
    let x = rng.vec(n * cols, 1.0);
    let xd = g.upload(&x).unwrap();
    let yd = g.zeros::<f32>(n * rows).unwrap();
    // The built-in GEMMs (tests/cuda_blas.rs covers the cuBLAS dispatch).
    set_blas(Some(false));
    for prec in [GemmPrecision::Bf16, GemmPrecision::Bf16x3] {
        set_gemm_precision(prec);
        let passes = if prec == GemmPrecision::Bf16 { 1 } else { 3 };
        g.fill_u32(g.ptr(&yd), n * rows, NAN).unwrap();
        g.matvec(&m, g.ptr(&xd), cols, g.ptr(&yd), rows, n, false).unwrap();
        let y = g.download(&yd).unwrap();
        let mut chk = Check::new();
        for t in 0..n {
            for r in 0..rows {
                let (want, abs) = dot(&wf[r * cols..(r + 1) * cols], &x[t * cols..(t + 1) * cols]);
                chk.one(y[t * rows + r], want, abs, passes, &|| format!("matvec {prec:?} token {t} row {r}"));
            }
        }
        chk.finish(passes, &format!("matvec dispatch {prec:?}"));
    }
    set_gemm_precision(GemmPrecision::Bf16x3);
    set_blas(None);
    // A misaligned input is an error of the GEMM, never a launch.
    assert!(g.matmul(&m, g.ptr(&xd) + 4, cols, g.ptr(&yd), rows, n, false).is_err());
    assert!(g.matmul_with(&m, g.ptr(&xd), cols, g.ptr(&yd), rows, n, false, 4, 1).is_err());
    assert!(g.matmul_with(&m, g.ptr(&xd), cols, g.ptr(&yd), rows, n, false, 2, 2).is_err());
}

/// Random routing of `tokens` tokens to `k` distinct experts each, never choosing `empty`.
fn random_routing(rng: &mut Rng, tokens: usize, k: usize, n_experts: usize, empty: &[usize]) -> Vec<i32> {
    let mut ids = Vec::with_capacity(tokens * k);
    for _ in 0..tokens {
        let mut chosen: Vec<usize> = Vec::new();
        while chosen.len() < k {
            let e = rng.below(n_experts);
            if !empty.contains(&e) && !chosen.contains(&e) {
                chosen.push(e);
            }
        }
        ids.extend(chosen.iter().map(|&e| e as i32));
    }
    ids
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn expert_grouping_lists_every_pair_once_and_skips_empty_experts() {
    let g = gpu();
    let mut rng = Rng(0x5eed_0003);
    for (tokens, k, ne, nt) in [(50usize, 3usize, 10usize, 1usize), (300, 8, 40, 4), (1, 2, 5, 4), (700, 4, 1100, 1)] {
        let empty: Vec<usize> = (0..ne).filter(|e| e % 4 == 1).collect();
        let ids = random_routing(&mut rng, tokens, k, ne, &empty);
        let idd = g.upload(&ids).unwrap();
        let grp = g.group_experts_with(g.ptr(&idd), ids.len(), ne, nt).unwrap();
        let list = g.download(&grp.list).unwrap();
        let tiles = g.download(&grp.tiles).unwrap();
        let ntiles = g.download(&grp.ntiles).unwrap()[0] as usize;
        assert!(ntiles <= grp.max_tiles);
        let mut seen = vec![0u32; ids.len()];
        let mut per_expert = vec![0usize; ne];
        let mut next_start = 0usize;
        for i in 0..ntiles {
            let (e, s, c) = (tiles[3 * i] as usize, tiles[3 * i + 1] as usize, tiles[3 * i + 2] as usize);
            assert!(c >= 1 && c <= 16 * nt, "tile {i}: count {c}");
            assert_eq!(s, next_start, "tiles are contiguous in the list");
            next_start = s + c;
            assert!(!empty.contains(&e), "tile for empty expert {e}");
            for &p in &list[s..s + c] {
                assert_eq!(ids[p as usize] as usize, e, "pair {p} listed under expert {e}");
                seen[p as usize] += 1;
            }
            per_expert[e] += c;
        }
        assert_eq!(next_start, ids.len());
        assert!(seen.iter().all(|&s| s == 1), "every pair exactly once");
        for e in 0..ne {
            assert_eq!(per_expert[e], ids.iter().filter(|&&x| x as usize == e).count(), "expert {e}");
        }
    }
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn grouped_expert_gemm_matches_cpu_for_every_type() {
    let _s = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let g = gpu();
    let mut rng = Rng(0x5eed_0004);
    let (tokens, k, ne) = (61usize, 3usize, 9usize);
    let empty = [1usize, 4, 6];
    for ty in TYPES {
        let cols = cols_for(ty);
        let rows = 150;
        let w = random_rows(&mut rng, ty, ne * rows, cols);
        let wf = dequant(ty, &w, ne * rows, cols);
        let (_wb, m) = upload_mat(&g, ty, &w, rows, cols, ne);
        let ids = random_routing(&mut rng, tokens, k, ne, &empty);
        let idd = g.upload(&ids).unwrap();
        let np = ids.len();
        let xs = cols + 8;
        let x = rng.vec(tokens * xs, 1.0);
        let xd = g.upload(&x).unwrap();
        let ys = rows + 1;
        let yd = g.zeros::<f32>(np * ys).unwrap();
        let fast_type = FAST_TYPES.contains(&ty);
        for (fast, nt, compact) in [(true, 1usize, false), (true, 2, false), (true, 2, true), (true, 4, false), (false, 1, false), (false, 4, false)] {
            if (nt == 2 || !fast) && !fast_type {
                continue; // tiles of 32 exist on the fast path only; other types have one path
            }
            set_gemm_fast(fast);
            set_gemm_compact(compact);
            let grp = g.group_experts_with(g.ptr(&idd), np, ne, nt).unwrap();
            for passes in [1usize, 3] {
                g.fill_u32(g.ptr(&yd), np * ys, NAN).unwrap();
                g.matmul_experts_with(&m, &grp, g.ptr(&xd), xs, k, g.ptr(&yd), ys, passes).unwrap();
                let y = g.download(&yd).unwrap();
                let mut chk = Check::new();
                for p in 0..np {
                    let e = ids[p] as usize;
                    let t = p / k;
                    for r in 0..rows {
                        let wr = &wf[(e * rows + r) * cols..(e * rows + r + 1) * cols];
                        let (want, abs) = dot(wr, &x[t * xs..t * xs + cols]);
                        chk.one(y[p * ys + r], want, abs, passes, &|| format!("{ty:?} fast {fast} tile {nt} passes {passes} pair {p} (expert {e}) row {r}"));
                    }
                    assert!(y[p * ys + rows].is_nan(), "{ty:?}: wrote past the rows of pair {p}");
                }
                chk.finish(passes, &format!("{ty:?} grouped fast {fast} tile {nt} compact {compact} passes {passes}"));
            }
        }
        set_gemm_fast(true);
        set_gemm_compact(true);
    }
}

fn silu(x: f64) -> f64 {
    x / (1.0 + (-x).exp())
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn moe_experts_gate_up_down_match_cpu() {
    let _s = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let g = gpu();
    let mut rng = Rng(0x5eed_0005);
    let (ne, k) = (12usize, 4usize);
    minimax_rank::cuda::tma_experts::set_tma_experts(Some(true));
    for (fast, ty, tokens, prec, (h, ff)) in [
        (true, GgmlType::IQ4_XS, 45usize, GemmPrecision::Bf16x3, (256usize, 96usize)),
        (true, GgmlType::Q8_0, 200, GemmPrecision::Bf16x3, (256, 96)),
        (true, GgmlType::Q4_K, 40, GemmPrecision::Bf16x3, (256, 96)),
        (true, GgmlType::IQ4_XS, 20, GemmPrecision::Bf16x3, (256, 96)),
        (true, GgmlType::Q6_K, 300, GemmPrecision::Bf16x3, (256, 96)),
        (false, GgmlType::IQ4_XS, 45, GemmPrecision::Bf16x3, (256, 96)),
        (false, GgmlType::Q4_K, 40, GemmPrecision::Bf16x3, (256, 96)),
        // int8: x and SiLU(gate)·up quantized to q8 (down's input in the fused conversion);
        // Q4_K gate/up with Q8_0 down mixes the 3-pass and int8 kernels.
        (true, GgmlType::IQ4_XS, 45, GemmPrecision::Int8, (256, 96)),
        (true, GgmlType::Q8_0, 200, GemmPrecision::Int8, (256, 96)),
        (true, GgmlType::Q4_K, 40, GemmPrecision::Int8, (256, 96)),
        // 512 x 512 IQ4_XS gate, up and down: the TMA kernels on sm_90+ (checked below); 512 x
        // 96: gate and up through them, a 96-wide Q8_0 down through mmg_i8.
        (true, GgmlType::IQ4_XS, 45, GemmPrecision::Int8, (512, 512)),
        (true, GgmlType::IQ4_XS, 300, GemmPrecision::Int8, (512, 512)),
        (true, GgmlType::IQ4_XS, 45, GemmPrecision::Int8, (512, 96)),
    ] {
        set_gemm_fast(fast);
        set_gemm_precision(prec);
        // down's input is ff = 96 wide: K-quants need 256-wide rows, so down is Q8_0 then.
        let dty = if ff % ty.block_elems() != 0 { GgmlType::Q8_0 } else { ty };
        let gw = random_rows(&mut rng, ty, ne * ff, h);
        let uw = random_rows(&mut rng, ty, ne * ff, h);
        let dw = random_rows(&mut rng, dty, ne * h, ff);
        let (gf, uf, df) = (dequant(ty, &gw, ne * ff, h), dequant(ty, &uw, ne * ff, h), dequant(dty, &dw, ne * h, ff));
        let (_a, gm) = upload_mat(&g, ty, &gw, ff, h, ne);
        let (_b, um) = upload_mat(&g, ty, &uw, ff, h, ne);
        let (_c, dm) = upload_mat(&g, dty, &dw, h, ff, ne);
        let ids = random_routing(&mut rng, tokens, k, ne, &[3, 7]);
        let np = ids.len();
        let x = rng.vec(tokens * h, 1.0);
        let (idd, xd) = (g.upload(&ids).unwrap(), g.upload(&x).unwrap());
        let (act, ub, out) = (g.zeros::<f32>(np * ff).unwrap(), g.zeros::<f32>(np * ff).unwrap(), g.zeros::<f32>(np * h).unwrap());
        g.fill_u32(g.ptr(&out), np * h, NAN).unwrap();
        g.fill_u32(g.ptr(&act), np * ff, NAN).unwrap();
        g.profile_begin();
        g.moe_experts((&gm, &um, &dm), g.ptr(&idd), np, k, g.ptr(&xd), h, (g.ptr(&act), g.ptr(&ub), ff), (g.ptr(&out), h)).unwrap();
        let prof = g.profile_end().unwrap();
        // mmg_t8w_* by default, mmg_t8_* with MINIMAX_T8_WIDE=0.
        let tma = prof.iter().filter(|(n, _)| n.starts_with("mmg_t8_iq4_xs") || n.starts_with("mmg_t8w_iq4_xs")).count();
        // TMA launches where the products are int8 IQ4_XS with 512-column multiples.
        let tma_fits = |t: GgmlType, cols: usize| g.arch >= 90 && fast && tokens > 32 && prec == GemmPrecision::Int8 && t == GgmlType::IQ4_XS && cols % 512 == 0;
        let want = 2 * tma_fits(ty, h) as usize + tma_fits(dty, ff) as usize;
        assert_eq!(tma, want, "TMA expert launches ({ty:?}/{dty:?}, {h} x {ff}): {prof:?}");
        let y = g.download(&out).unwrap();
        // The CPU twin in f64; the intermediate activation's own error feeds down, so the
        // bound is relative to the output RMS (3 passes: ~1e-5 of each; 1e-3 allowed; int8:
        // q8 rounding of both inputs, ~5e-3 expected, 2e-2 allowed; a lost chunk gives ~0.1).
        let (mut se, mut ss) = (0f64, 0f64);
        for p in 0..np {
            let (e, t) = (ids[p] as usize, p / k);
            let xr = &x[t * h..(t + 1) * h];
            let a: Vec<f32> = (0..ff)
                .map(|j| {
                    let gv = dot(&gf[(e * ff + j) * h..(e * ff + j + 1) * h], xr).0;
                    let uv = dot(&uf[(e * ff + j) * h..(e * ff + j + 1) * h], xr).0;
                    (silu(gv) * uv) as f32
                })
                .collect();
            for r in 0..h {
                let want = dot(&df[(e * h + r) * ff..(e * h + r + 1) * ff], &a).0;
                let got = y[p * h + r] as f64;
                assert!(got.is_finite(), "{ty:?} pair {p} row {r}: {got}");
                se += (got - want) * (got - want);
                ss += want * want;
            }
        }
        let rel = (se / ss).sqrt();
        eprintln!("moe_experts {ty:?}/{dty:?} {h} x {ff}, {tokens} tokens x {k}, fast {fast}, {prec:?}: rms rel error {rel:.2e} (grouped: {}, TMA: {})", tokens > 32, tma > 0);
        let lim = if prec == GemmPrecision::Int8 { 2e-2 } else { 1e-3 };
        assert!(rel < lim, "{ty:?} fast {fast} {prec:?}: rms rel error {rel:.2e}");
    }
    set_gemm_fast(true);
    set_gemm_precision(GemmPrecision::Bf16x3);
    minimax_rank::cuda::tma_experts::set_tma_experts(None);
}

const PAGE: usize = 16;

/// The bf16 copies of the attention weights (kept at load where memory allows) give a prefill
/// the same logits, bit for bit, as the per-call conversion they replace, and no `dqb_` launch
/// runs with them: the Q8_0 fixture's longest sequence, int8 and bf16 precisions (those whose
/// Q8_0 products take cuBLAS).
#[test]
#[ignore = "needs a CUDA GPU"]
fn dense_bf16_copies_give_identical_prefill() {
    use minimax_rank::cuda::model::DENSE_COPIES;
    let _s = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let mut checked = 0;
    for v in common::variants().into_iter().filter(|v| v.name == "q8_0") {
        let seq = v.sequences.iter().max_by_key(|s| s.len()).unwrap();
        let n_pages = seq.len().div_ceil(PAGE) + 1;
        let batch = ForwardBatch {
            seqs: vec![SeqStep { seq_id: 1, page_table: (0..n_pages as u32).collect(), cached_len: 0, tokens: seq.clone(), logits: LogitsWanted::All }],
        };
        let m = Arc::new(GgufModel::open(&v.gguf).unwrap());
        for prec in [GemmPrecision::Int8, GemmPrecision::Bf16] {
            set_gemm_precision(prec);
            let mut gm = CudaModel::load(m.clone(), KvSpec { page_size: PAGE, n_pages }, CudaOptions { device: 0, kv_dtype: KvDtype::F32, ..Default::default() }).unwrap();
            assert!(gm.dense_bf16_kept(), "{}: bf16 copies not kept", v.model);
            let mut run = |on: bool| {
                DENSE_COPIES.set(Some(on));
                gm.gpu().profile_begin();
                let out = gm.forward(&batch).unwrap();
                let dqb = gm.gpu().profile_end().unwrap().iter().filter(|(n, _)| n.starts_with("dqb_")).count();
                (out, dqb)
            };
            let (per_call, dqb_off) = run(false);
            let (copies, dqb_on) = run(true);
            // Per call: one conversion a weight of every layer (and the output head's, which
            // has no copy: 300 logits rows take the GEMM).
            let layers = gm.config().n_layers;
            assert_eq!(dqb_off - dqb_on, 4 * layers, "{} {prec:?}: dqb launches {dqb_off} per call, {dqb_on} with copies", v.model);
            assert!(per_call.logits.iter().all(|x| x.is_finite()));
            let same = per_call.logits.iter().zip(&copies.logits).all(|(a, b)| a.to_bits() == b.to_bits());
            assert!(same, "{} {prec:?}: logits differ with the bf16 copies (max |diff| {:.2e})", v.model, common::max_diff(&per_call.logits, &copies.logits));
            eprintln!("{}/{} {} tokens, {prec:?}: identical logits with the bf16 copies ({dqb_off} dqb launches saved)", v.model, v.name, seq.len());
            checked += 1;
        }
    }
    DENSE_COPIES.set(None);
    set_gemm_precision(GemmPrecision::Bf16x3);
    assert!(checked >= 2, "no q8_0 fixture variant");
}

/// A fixture model's longest sequence (> 100 tokens) in one prefill step: CUDA logits (f32 KV,
/// so only the products differ) against the CPU backend at every position. 3 bf16 passes (the
/// default): max |diff| ≤ 2e-2 (the bound; measured ~1e-5 like the f32 matvec). 1 pass
/// (plain bf16 activations and weights, ~2e-3 relative per product): reported; random tiny
/// models re-route near-tie tokens under it (as with a bf16 KV cache), so not asserted beyond
/// finiteness. int8 (IQ4_XS / Q8_0 weights only; q8 activations, ~4e-3 relative per product):
/// reported likewise.
#[test]
#[ignore = "needs a CUDA GPU"]
fn long_prompt_logits_match_cpu_backend() {
    let _s = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    for v in common::variants().into_iter().filter(|v| !v.name.ends_with("-split")) {
        let seq = v.sequences.iter().max_by_key(|s| s.len()).unwrap();
        assert!(seq.len() > 100, "{}: longest fixture sequence has {} tokens", v.model, seq.len());
        let n_pages = seq.len().div_ceil(PAGE) + 1;
        let batch = ForwardBatch {
            seqs: vec![SeqStep { seq_id: 1, page_table: (0..n_pages as u32).collect(), cached_len: 0, tokens: seq.clone(), logits: LogitsWanted::All }],
        };
        let m = Arc::new(GgufModel::open(&v.gguf).unwrap());
        let cfg = ModelConfig::from_gguf(&m).unwrap();
        let mut cpu = CpuModel::load(m.clone(), Partition::whole(&cfg), KvSpec { page_size: PAGE, n_pages }).unwrap();
        let want = cpu.forward(&batch, &Solo).unwrap();
        for prec in [GemmPrecision::Bf16x3, GemmPrecision::Bf16, GemmPrecision::Int8] {
            set_gemm_precision(prec);
            let mut gm = CudaModel::load(m.clone(), KvSpec { page_size: PAGE, n_pages }, CudaOptions { device: 0, kv_dtype: KvDtype::F32, ..Default::default() }).unwrap();
            let got = gm.forward(&batch).unwrap();
            assert_eq!(got.rows.len(), seq.len());
            assert!(got.logits.iter().all(|x| x.is_finite()), "{}/{} {prec:?}: non-finite logits", v.model, v.name);
            let d = common::max_diff(&got.logits, &want.logits);
            let over = (0..seq.len()).filter(|&p| common::max_diff(got.row(p), want.row(p)) > 2e-2).count();
            eprintln!("{}/{:<6} {} tokens, GEMM {prec:?}: max |logit diff| vs CPU {d:.2e}, {over} positions over 2e-2", v.model, v.name, seq.len());
            if prec == GemmPrecision::Bf16x3 {
                assert!(d <= 2e-2, "{}/{} {prec:?}: max |diff| {d}", v.model, v.name);
            }
        }
        set_gemm_precision(GemmPrecision::Bf16x3);
    }
}
