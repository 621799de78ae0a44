//! GPU test helpers: the device, deterministic random data (random quantized rows of every
//! type) and NaN-poisoned outputs.
#![allow(dead_code)]

use std::process::Command;

use cudarc::driver::CudaSlice;
use minimax_rank::cuda::{DevMat, Gpu};
use minimax_shared::quant::{self, GgmlType};

/// A quiet-NaN f32 bit pattern: outputs are filled with it before a launch.
pub const NAN: u32 = 0x7fc0_0000;

/// xorshift64*: deterministic, dependency-free randomness.
pub struct Rng(pub u64);
impl Rng {
    pub fn u64(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_f491_4f6c_dd1d)
    }
    /// Uniform in [-1, 1).
    pub fn f(&mut self) -> f32 {
        (self.u64() >> 40) as f32 / (1u64 << 24) as f32 * 2.0 - 1.0
    }
    pub fn below(&mut self, n: usize) -> usize {
        (self.u64() % n as u64) as usize
    }
    pub fn vec(&mut self, n: usize, scale: f32) -> Vec<f32> {
        (0..n).map(|_| self.f() * scale).collect()
    }
}

/// The number of GPUs `nvidia-smi -L` lists (0 without it).
pub fn gpu_count() -> usize {
    Command::new("nvidia-smi").arg("-L").output().map(|o| String::from_utf8_lossy(&o.stdout).lines().filter(|l| l.starts_with("GPU ")).count()).unwrap_or(0)
}

/// GPU 0, with the prefill GEMMs pinned to the exact `bf16x3` precision: kernel tests that
/// want another precision (int8, plain bf16) set it themselves after this.
pub fn gpu() -> Gpu {
    minimax_rank::cuda::set_gemm_precision(minimax_rank::cuda::GemmPrecision::Bf16x3);
    Gpu::new(0).expect("CUDA device 0 with NVRTC")
}

pub const TYPES: [GgmlType; 16] = [
    GgmlType::F32,
    GgmlType::F16,
    GgmlType::BF16,
    GgmlType::Q4_0,
    GgmlType::Q4_1,
    GgmlType::Q5_0,
    GgmlType::Q5_1,
    GgmlType::Q8_0,
    GgmlType::Q2_K,
    GgmlType::Q3_K,
    GgmlType::Q4_K,
    GgmlType::Q5_K,
    GgmlType::Q6_K,
    GgmlType::IQ4_NL,
    GgmlType::IQ4_XS,
    GgmlType::MXFP4,
];

/// Byte offsets of the fp16 scale fields in one block of `ty` (random bytes there could be
/// inf/NaN).
pub fn f16_fields(ty: GgmlType) -> &'static [usize] {
    match ty {
        GgmlType::Q4_0 | GgmlType::Q5_0 | GgmlType::Q8_0 | GgmlType::IQ4_NL | GgmlType::IQ4_XS => &[0],
        GgmlType::Q4_1 | GgmlType::Q5_1 | GgmlType::Q4_K | GgmlType::Q5_K => &[0, 2],
        GgmlType::Q2_K => &[80, 82],
        GgmlType::Q3_K => &[108],
        GgmlType::Q6_K => &[208],
        _ => &[],
    }
}

/// `rows` random valid rows of `cols` elements of `ty` (random quants, finite small scales).
pub fn random_rows(rng: &mut Rng, ty: GgmlType, rows: usize, cols: usize) -> Vec<u8> {
    let rb = quant::row_bytes(ty, cols).unwrap();
    let mut b = vec![0u8; rows * rb];
    match ty {
        GgmlType::F32 => {
            for c in b.chunks_exact_mut(4) {
                c.copy_from_slice(&rng.f().to_le_bytes());
            }
        }
        GgmlType::F16 => {
            for c in b.chunks_exact_mut(2) {
                c.copy_from_slice(&half::f16::from_f32(rng.f()).to_bits().to_le_bytes());
            }
        }
        GgmlType::BF16 => {
            for c in b.chunks_exact_mut(2) {
                c.copy_from_slice(&half::bf16::from_f32(rng.f()).to_bits().to_le_bytes());
            }
        }
        _ => {
            for x in b.iter_mut() {
                *x = rng.u64() as u8;
            }
            let bb = ty.block_bytes();
            for blk in b.chunks_exact_mut(bb) {
                for &o in f16_fields(ty) {
                    let d = half::f16::from_f32(rng.f() * 0.05);
                    blk[o..o + 2].copy_from_slice(&d.to_bits().to_le_bytes());
                }
                if ty == GgmlType::MXFP4 {
                    blk[0] = 118 + rng.below(12) as u8;
                }
            }
        }
    }
    b
}

/// `bytes` (`rows` x `cols` of `ty`, `n_experts` stacked matrices) uploaded, with its `DevMat`.
pub fn upload_mat(g: &Gpu, ty: GgmlType, bytes: &[u8], rows: usize, cols: usize, n_experts: usize) -> (CudaSlice<u8>, DevMat) {
    let buf = g.upload(bytes).unwrap();
    let rb = quant::row_bytes(ty, cols).unwrap();
    let m = DevMat { ptr: g.ptr(&buf), ty, rows, cols, row_bytes: rb, n_experts, expert_stride: rows * rb };
    (buf, m)
}

/// One matrix whose rows start 4 bytes past a 16-byte boundary (guard bytes around it), for
/// the kernels that stage the aligned 16-byte spans around each row.
pub fn upload_mat_shifted(g: &Gpu, ty: GgmlType, bytes: &[u8], rows: usize, cols: usize) -> (CudaSlice<u8>, DevMat) {
    let mut shifted = vec![0xa5u8; 4];
    shifted.extend_from_slice(bytes);
    shifted.extend_from_slice(&[0x5a; 4]);
    let buf = g.upload(&shifted).unwrap();
    let m = DevMat { ptr: g.ptr(&buf) + 4, ty, rows, cols, row_bytes: quant::row_bytes(ty, cols).unwrap(), n_experts: 0, expert_stride: 0 };
    (buf, m)
}

/// f64 reference of one output of a product: (W_r · x, Σ|w x|), the scale its error bounds use.
pub fn dot(w: &[f32], x: &[f32]) -> (f64, f64) {
    w.iter().zip(x).fold((0.0, 0.0), |(s, a), (&w, &x)| (s + w as f64 * x as f64, a + (w as f64 * x as f64).abs()))
}

/// `n` f32 on the device, every one NaN.
pub fn poisoned(g: &Gpu, n: usize) -> CudaSlice<f32> {
    let b = g.zeros::<f32>(n).unwrap();
    g.fill_u32(g.ptr(&b), n, NAN).unwrap();
    b
}

/// Host twin of the fast path's q8 activation quantization: per 32 values d = max|x| / 127,
/// q = round-half-even(x / d).
pub fn q8_host(x: &[f32]) -> (Vec<i8>, Vec<f32>) {
    let mut q = vec![0i8; x.len()];
    let mut d = vec![0f32; x.len() / 32];
    for (b, c) in x.chunks_exact(32).enumerate() {
        let amax = c.iter().fold(0f32, |m, v| m.max(v.abs()));
        let dd = amax / 127.0;
        d[b] = dd;
        for (i, v) in c.iter().enumerate() {
            q[b * 32 + i] = if amax == 0.0 { 0 } else { (v / dd).round_ties_even() as i8 };
        }
    }
    (q, d)
}

/// Dequantized q8 activations.
pub fn q8_deq(q: &[i8], d: &[f32]) -> Vec<f32> {
    q.iter().enumerate().map(|(i, &v)| v as f32 * d[i / 32]).collect()
}

/// The bit patterns of `v` (bit-identity checks).
pub fn bits(v: &[f32]) -> Vec<u32> {
    v.iter().map(|x| x.to_bits()).collect()
}

/// Random IQ4-class experts for the MoE kernel tests: `e` experts of gate and up (`ff` x `h`)
/// and down (`hrows` x `ff`) of `ty`, as host bytes and uploaded (buffers kept alive).
pub struct RandomExperts {
    pub gate: Vec<u8>,
    pub up: Vec<u8>,
    pub down: Vec<u8>,
    pub gm: DevMat,
    pub um: DevMat,
    pub dm: DevMat,
    _bufs: [CudaSlice<u8>; 3],
}

/// [`RandomExperts`] drawn from `rng` and uploaded to `g`.
pub fn random_experts(g: &Gpu, rng: &mut Rng, ty: GgmlType, e: usize, ff: usize, h: usize, hrows: usize) -> RandomExperts {
    let gate = random_rows(rng, ty, e * ff, h);
    let up = random_rows(rng, ty, e * ff, h);
    let down = random_rows(rng, ty, e * hrows, ff);
    let (b1, gm) = upload_mat(g, ty, &gate, ff, h, e);
    let (b2, um) = upload_mat(g, ty, &up, ff, h, e);
    let (b3, dm) = upload_mat(g, ty, &down, hrows, ff, e);
    RandomExperts { gate, up, down, gm, um, dm, _bufs: [b1, b2, b3] }
}

/// `nt` tokens' top-`k` expert ids over `e` experts, distinct per token, expert 0 in every
/// token's list (one expert shared by all tokens: the fullest slot a grouped step can have).
pub fn routed(rng: &mut Rng, nt: usize, k: usize, e: usize) -> Vec<i32> {
    let mut ids = Vec::new();
    for _ in 0..nt {
        let mut row = vec![0i32];
        while row.len() < k {
            let x = 1 + rng.below(e - 1) as i32;
            if !row.contains(&x) {
                row.push(x);
            }
        }
        ids.extend(row);
    }
    ids
}

/// Mean µs per launch of `f(i)` over `reps` calls (i = 0, 1, ..: the caller rotates its inputs
/// with it) after `warm` untimed ones, the device synchronized around the timed calls.
pub fn launch_us(g: &Gpu, warm: usize, reps: usize, f: &dyn Fn(usize)) -> f64 {
    for i in 0..warm {
        f(i);
    }
    g.sync().unwrap();
    let t = std::time::Instant::now();
    for i in 0..reps {
        f(i);
    }
    g.sync().unwrap();
    t.elapsed().as_secs_f64() * 1e6 / reps as f64
}
