//! K-quant (Q4_K, Q6_K) kernels of the fast decode path (kernels/fast_kq.cu): the dense q8
//! products, the per-pair MoE gate/up and down kernels and their grouped-by-expert forms, with
//! the same contracts as [`Gpu::matvec_q8`], [`Gpu::moe_gate_up_q8_ld`], [`Gpu::moe_down_q8`],
//! [`Gpu::moe_gate_up_grp`] and [`Gpu::moe_down_grp`] in `fast.rs`, so a Q4_K_M model can take
//! the fast path. Any multiple of 256 columns, rows at any even address.

use minimax_shared::quant::GgmlType;

use super::error::CudaError;
use super::fast::{down_args, gate_up_args, mv_args};
use super::gpu::{Arg, DevMat, Gpu};

/// Rows per block of the dense kernels (one warp per row), as in kernels/fast_kq.cu.
const MV_WARPS: usize = 8;
/// Warps per block of the one-token rows form `kq_mvr2_*` (two rows a warp), and the most
/// super-blocks a row it takes (one phase, KQ_MV_PB in kernels/fast_kq.cu).
const MVR_WARPS: usize = 4;
const MVR_MAX_BLOCKS: usize = 12;
/// Fewest rows a launch needs for the rows form: below it, two rows a warp leave the GPU
/// with too few warps (H200, one token: the 1,024-row Q6_K v slice 5.9 µs with `kq_mv`,
/// 7.5 with `kq_mvr2`; q+k's 7,168 rows 13.5 → 12.6; the 200,064-row head 205.8 → 185.1).
const MVR_MIN_ROWS: usize = 4096;
/// Rows per block of the expert down kernel (one warp per output row).
const DN_WARPS: usize = 4;
/// The streamed one-token rows form `kq_mvs_*` (kernels/fast_kq.cu: KS_THREADS, KS_HDR,
/// KS_TAIL, KS_MAXST): 16 consumer warps and a producer warp, 256 bytes of barriers before the
/// ring and 32 after it (the unaligned 16-byte reads run up to 4 bytes past a unit), at most 8
/// stages, `MVS_STAGE_ROWS` rows a stage (one a consumer warp).
const MVS_THREADS: u32 = 32 * 17;
const MVS_FIXED: usize = 256 + 32; // KS_HDR + KS_TAIL
const MVS_MAX_STAGES: usize = 8;
const MVS_STAGE_ROWS: usize = 16;
/// Fewest rows a launch needs for the streamed form: one block per SM streams its share, so it
/// is meant for the output head (200,064 rows), not the per-layer products (whose blocks
/// launch beside the previous kernel's under PDL).
const MVS_MIN_ROWS: usize = 65_536;
/// Most tokens the streamed form takes (`kq_mvs4_*`: 2-4 tokens; 1 is `kq_mvs_*`).
const MVS_MAX_TOKENS: usize = 4;

/// Whether `w` can go through the K-quant fast kernels: Q4_K or Q6_K, whole 256-column
/// super-blocks per row (row bytes exactly those blocks), rows and experts at even addresses.
pub fn kq_fast_mat(w: &DevMat) -> bool {
    matches!(w.ty, GgmlType::Q4_K | GgmlType::Q6_K)
        && w.cols > 0
        && w.cols % 256 == 0
        && w.row_bytes == w.cols / 256 * w.ty.block_bytes()
        && w.ptr % 2 == 0
        && (w.n_experts == 0 || w.expert_stride % 2 == 0)
}

/// A kernel form's switch ([`EnvFlag`](super::env_flag::EnvFlag)) that applies above a size
/// floor, where a test's `set(Some(true))` also lifts the floor (small matrices in tests).
struct FormFlag {
    on: super::env_flag::EnvFlag,
    any_size: std::sync::atomic::AtomicBool,
}

impl FormFlag {
    const fn new(var: &'static str, default: bool) -> Self {
        Self { on: super::env_flag::EnvFlag::new(var, default), any_size: std::sync::atomic::AtomicBool::new(false) }
    }

    fn get(&self) -> bool {
        self.on.get()
    }

    fn set(&self, on: Option<bool>) {
        self.on.set(on);
        self.any_size.store(on == Some(true), std::sync::atomic::Ordering::Relaxed);
    }

    /// Whether the form applies below its size floor too (forced on by `set(Some(true))`).
    fn any_size(&self) -> bool {
        self.any_size.load(std::sync::atomic::Ordering::Relaxed)
    }
}

static KQ_ROWS: FormFlag = FormFlag::new("MINIMAX_KQ_ROWS", true);

/// Whether one-token K-quant products of rows up to 12 super-blocks (3,072 columns) and at
/// least 4,096 rows a launch take `kq_mvr2_*` (two rows a warp, every copy issued before the
/// PDL wait; the Q6_K output head) instead of `kq_mv_*_1` (default on; `MINIMAX_KQ_ROWS=0` =
/// kq_mv). Bit-identical.
pub fn kq_rows() -> bool {
    KQ_ROWS.get()
}

/// Overrides [`kq_rows`] (A/B runs, tests; `None` = back to the environment). `Some(true)`
/// also takes the rows form below 4,096 rows (tests of small matrices). Drop captured graphs
/// after a change.
pub fn set_kq_rows(on: Option<bool>) {
    KQ_ROWS.set(on);
}

static KQ_STREAM: FormFlag = FormFlag::new("MINIMAX_KQ_STREAM", true);

/// Whether products of 1-4 tokens by a single K-quant matrix of at least 65,536 rows (the output
/// head) stream its rows through a ring (`kq_mvs_*` / `kq_mvs4_*`, one block per SM, sm_90 and
/// newer) instead of `kq_mvr2_*` / `kq_mv_*` (default on; `MINIMAX_KQ_STREAM=0` = off).
/// Bit-identical.
pub fn kq_stream() -> bool {
    KQ_STREAM.get()
}

/// Overrides [`kq_stream`] (A/B runs, tests; `None` = back to the environment). `Some(true)` also
/// takes the streamed form below 65,536 rows (tests of small matrices). Drop captured graphs
/// after a change.
pub fn set_kq_stream(on: Option<bool>) {
    KQ_STREAM.set(on);
}

/// Whether the fast path may take K-quant matrices (on unless `MINIMAX_FAST_KQ=0`: without them
/// a Q4_K_M file runs the exact path only). Read once.
pub fn kq_enabled() -> bool {
    static V: super::env_flag::EnvFlag = super::env_flag::EnvFlag::new("MINIMAX_FAST_KQ", true);
    V.get()
}

/// Kernel name suffix of a K-quant type.
fn kq_name(ty: GgmlType) -> &'static str {
    if ty == GgmlType::Q4_K { "q4_k" } else { "q6_k" }
}

/// Tokens per block of the dense kernel for `nv` vectors (instances 1, 4, 8, 16).
fn mv_nt(nv: usize) -> usize {
    match nv {
        0 | 1 => 1,
        2..=4 => 4,
        5..=8 => 8,
        _ => 16,
    }
}

/// Shape checks shared by the K-quant gate/up launches (`name` for the error): `ld` a
/// multiple of 32 holding the rows, gate and up K-quant twins with rows a multiple of 32,
/// `k > 0`, the q8 input 16-byte aligned.
fn gate_up_check(name: &str, gate: &DevMat, up: &DevMat, k: usize, xq: u64, ld: usize) -> Result<(), CudaError> {
    if ld < gate.rows || ld % 32 != 0 {
        return Err(CudaError::Shape(format!("{name}: activation stride {ld} for {} rows", gate.rows)));
    }
    if !kq_fast_mat(gate) || !kq_fast_mat(up) || gate.ty != up.ty || gate.row_bytes != up.row_bytes || gate.rows != up.rows || gate.expert_stride != up.expert_stride || gate.rows % 32 != 0 || k == 0 {
        return Err(CudaError::Shape(format!("{name}: expert tensors {:?}/{:?} {}x{}, top-{k}", gate.ty, up.ty, gate.rows, gate.cols)));
    }
    if xq % 16 != 0 {
        return Err(CudaError::Shape(format!("{name}: q8 input not 16-byte aligned")));
    }
    Ok(())
}

impl Gpu {
    /// `y_s[v] (+)= W_s x_q[v]` for up to three Q4_K/Q6_K matrices `segs` = (W, y, y stride)
    /// of one type sharing a q8 input (`xq` [v][ncol] int8, 16-byte aligned; `xd` [v][ncol/32]),
    /// `nv` vectors: [`Gpu::matvec_q8`] for K-quants (`kq_mv_*`).
    #[allow(clippy::too_many_arguments)]
    pub fn kq_matvec_q8(&self, segs: &[(&DevMat, u64, usize)], xq: u64, xd: u64, ncol: usize, nv: usize, accumulate: bool) -> Result<(), CudaError> {
        if segs.is_empty() || segs.len() > 3 {
            return Err(CudaError::Shape(format!("kq_matvec_q8: {} matrices (1 to 3)", segs.len())));
        }
        let ty = segs[0].0.ty;
        for (w, _, _) in segs {
            if !kq_fast_mat(w) || w.ty != ty || w.cols != ncol {
                return Err(CudaError::Shape(format!("kq_matvec_q8: {:?} {}x{} (input {ncol})", w.ty, w.rows, w.cols)));
            }
        }
        if xq % 16 != 0 {
            return Err(CudaError::Shape("kq_matvec_q8: q8 input not 16-byte aligned".into()));
        }
        if (1..=MVS_MAX_TOKENS).contains(&nv) && segs.len() == 1 && kq_stream() && (segs[0].0.rows >= MVS_MIN_ROWS || KQ_STREAM.any_size()) {
            let (w, y, ys) = segs[0];
            if let Some((nst, sr)) = self.kq_stream_plan(w)? {
                let smem = MVS_FIXED + nst * sr * w.row_bytes;
                let grid = self.stream_grid(w.rows / 2)?;
                let args = [Arg::P(w.ptr), Arg::L(w.row_bytes as i64), Arg::I(w.rows as i32), Arg::P(y), Arg::L(ys as i64), Arg::I((ncol / 256) as i32), Arg::P(xq), Arg::P(xd), Arg::I(ncol as i32), Arg::I(nv as i32), Arg::I(accumulate as i32), Arg::I(nst as i32), Arg::I(sr as i32)];
                let stem = if nv == 1 { "kq_mvs" } else { "kq_mvs4" };
                return self.launch_pdl(&format!("{stem}_{}", kq_name(ty)), (grid, 1, 1), MVS_THREADS, smem as u32, &args);
            }
        }
        let nt = mv_nt(nv);
        let (args, rows) = mv_args(segs, ncol / 256, xq, xd, ncol, nv, accumulate);
        let many = rows >= MVR_MIN_ROWS || KQ_ROWS.any_size();
        if nv == 1 && ncol / 256 <= MVR_MAX_BLOCKS && many && kq_rows() {
            let grid = (rows.div_ceil(2 * MVR_WARPS) as u32, 1, 1);
            return self.launch_pdl(&format!("kq_mvr2_{}", kq_name(ty)), grid, 32 * MVR_WARPS as u32, 0, &args);
        }
        let grid = (rows.div_ceil(MV_WARPS) as u32, nv.div_ceil(nt) as u32, 1);
        self.launch_pdl(&format!("kq_mv_{}_{nt}", kq_name(ty)), grid, 32 * MV_WARPS as u32, 0, &args)
    }

    /// (ring stages, rows a stage) of the streamed one-token form `kq_mvs_*` for `w`, None where
    /// it does not apply: before sm_90 (no bulk copies), an odd row count, or rows whose pairs
    /// are not whole 16-byte pieces at 16-byte aligned addresses (the bulk copies' rule), or
    /// room for fewer than 2 stages.
    pub fn kq_stream_plan(&self, w: &DevMat) -> Result<Option<(usize, usize)>, CudaError> {
        if !kq_fast_mat(w) || w.rows % 2 != 0 || w.ptr % 16 != 0 || (2 * w.row_bytes) % 16 != 0 || w.n_experts != 0 {
            return Ok(None);
        }
        let n = self.ring_stages(MVS_FIXED, MVS_STAGE_ROWS * w.row_bytes)?.min(MVS_MAX_STAGES);
        Ok((n >= 2).then_some((n, MVS_STAGE_ROWS)))
    }

    /// Fused expert gate/up for Q4_K/Q6_K experts: for each of `npairs` (token p / k, expert
    /// ids[p]) pairs, `silu(gate x) * (up x)` quantized to q8 into `aq` [p][ld] / `ad`
    /// [p][ld/32] (`ld >= gate.rows`, multiple of 32; `gate.rows % 32 == 0`):
    /// [`Gpu::moe_gate_up_q8_ld`] for K-quants (`kq_moe_gate_up_*`).
    #[allow(clippy::too_many_arguments)]
    pub fn kq_moe_gate_up_q8_ld(&self, gate: &DevMat, up: &DevMat, ids: u64, k: usize, xq: u64, xd: u64, aq: u64, ad: u64, npairs: usize, ld: usize) -> Result<(), CudaError> {
        gate_up_check("kq_moe_gate_up_q8", gate, up, k, xq, ld)?;
        let args = gate_up_args(gate, up, &[Arg::I((gate.cols / 256) as i32), Arg::P(ids), Arg::I(k as i32)], xq, xd, aq, ad, ld);
        self.launch_pdl(&format!("kq_moe_gate_up_{}", kq_name(gate.ty)), ((gate.rows / 32) as u32, npairs as u32, 1), 256, 0, &args)
    }

    /// Fused expert down + weighted combine for Q4_K/Q6_K experts: `hidden[t] += sum_j
    /// w[t,j] down[ids[t,j]] act[t,j]` (activations `down.cols` apart per pair, fixed summation
    /// order, no atomics): [`Gpu::moe_down_q8`] for K-quants (`kq_moe_down_*`).
    #[allow(clippy::too_many_arguments)]
    pub fn kq_moe_down_q8(&self, down: &DevMat, ids: u64, wts: u64, k: usize, aq: u64, ad: u64, hidden: u64, hs: usize, nt: usize) -> Result<(), CudaError> {
        if !kq_fast_mat(down) || k == 0 {
            return Err(CudaError::Shape(format!("kq_moe_down_q8: expert tensor {:?} {}x{}, top-{k}", down.ty, down.rows, down.cols)));
        }
        if aq % 16 != 0 {
            return Err(CudaError::Shape("kq_moe_down_q8: q8 activations not 16-byte aligned".into()));
        }
        let args = down_args(down, &[Arg::I((down.cols / 256) as i32), Arg::P(ids), Arg::P(wts), Arg::I(k as i32)], aq, ad, &[Arg::P(hidden), Arg::L(hs as i64)]);
        self.launch_pdl(&format!("kq_moe_down_{}", kq_name(down.ty)), (down.rows.div_ceil(DN_WARPS) as u32, nt as u32, 1), 32 * DN_WARPS as u32, 0, &args)
    }
}

/// Grouped MoE (steps of several tokens; `grp` from [`Gpu::moe_group`]).
impl Gpu {
    /// Grouped gate/up/SiLU → q8 for Q4_K/Q6_K experts over the slots of `grp`: the outputs
    /// of [`Gpu::kq_moe_gate_up_q8_ld`], each chosen expert's rows read once per 8 of its
    /// pairs; [`Gpu::moe_gate_up_grp`] for K-quants. `nslots` = the grid's slots
    /// (`min(npairs, e)`; unused slots exit).
    #[allow(clippy::too_many_arguments)]
    pub fn kq_moe_gate_up_grp(&self, gate: &DevMat, up: &DevMat, grp: u64, e: usize, nslots: usize, k: usize, xq: u64, xd: u64, aq: u64, ad: u64, ld: usize) -> Result<(), CudaError> {
        gate_up_check("kq_moe_gate_up_grp", gate, up, k, xq, ld)?;
        let args = gate_up_args(gate, up, &[Arg::I((gate.cols / 256) as i32), Arg::P(grp), Arg::I(e as i32), Arg::I(k as i32)], xq, xd, aq, ad, ld);
        self.launch_pdl(&format!("kq_moe_gate_up_grp_{}", kq_name(gate.ty)), ((gate.rows / 32) as u32, nslots as u32, 1), 256, 0, &args)
    }

    /// Grouped down products for Q4_K/Q6_K experts: `dpart[p][r] = down[expert of p] row r .
    /// act[p]` (f32 `[npairs][down.rows]`, activations `down.cols` apart) for every pair of
    /// `grp`; `moe_combine_grp` adds them to the residual. [`Gpu::moe_down_grp`] for K-quants.
    #[allow(clippy::too_many_arguments)]
    pub fn kq_moe_down_grp(&self, down: &DevMat, grp: u64, e: usize, nslots: usize, aq: u64, ad: u64, dpart: u64) -> Result<(), CudaError> {
        if !kq_fast_mat(down) {
            return Err(CudaError::Shape(format!("kq_moe_down_grp: expert tensor {:?} {}x{}", down.ty, down.rows, down.cols)));
        }
        if aq % 16 != 0 {
            return Err(CudaError::Shape("kq_moe_down_grp: q8 activations not 16-byte aligned".into()));
        }
        let args = down_args(down, &[Arg::I((down.cols / 256) as i32), Arg::P(grp), Arg::I(e as i32)], aq, ad, &[Arg::P(dpart)]);
        self.launch_pdl(&format!("kq_moe_down_grp_{}", kq_name(down.ty)), (down.rows.div_ceil(DN_WARPS) as u32, nslots as u32, 1), 32 * DN_WARPS as u32, 0, &args)
    }
}

/// Type dispatch for `enqueue_fast`: each call goes to the K-quant kernel when its matrix is
/// one ([`kq_fast_mat`]), else to `fast.rs`'s kernel with the same contract.
impl Gpu {
    /// [`Gpu::matvec_q8`] for segments of mixed types (Q4_K_M: q/k Q4_K, v Q6_K): the
    /// K-quant segments in one launch per type, the others in one `matvec_q8` launch.
    #[allow(clippy::too_many_arguments)]
    pub fn matvec_q8_any(&self, segs: &[(&DevMat, u64, usize)], xq: u64, xd: u64, ncol: usize, nv: usize, accumulate: bool) -> Result<(), CudaError> {
        let rest: Vec<_> = segs.iter().filter(|s| !kq_fast_mat(s.0)).copied().collect();
        if !rest.is_empty() {
            self.matvec_q8(&rest, xq, xd, ncol, nv, accumulate)?;
        }
        for ty in [GgmlType::Q4_K, GgmlType::Q6_K] {
            let kq: Vec<_> = segs.iter().filter(|s| kq_fast_mat(s.0) && s.0.ty == ty).copied().collect();
            if !kq.is_empty() {
                self.kq_matvec_q8(&kq, xq, xd, ncol, nv, accumulate)?;
            }
        }
        Ok(())
    }

    /// [`Gpu::moe_gate_up_q8_ld`] or [`Gpu::kq_moe_gate_up_q8_ld`] by the experts' type.
    #[allow(clippy::too_many_arguments)]
    pub fn moe_gate_up_q8_any(&self, gate: &DevMat, up: &DevMat, ids: u64, k: usize, xq: u64, xd: u64, aq: u64, ad: u64, npairs: usize, ld: usize) -> Result<(), CudaError> {
        if kq_fast_mat(gate) {
            self.kq_moe_gate_up_q8_ld(gate, up, ids, k, xq, xd, aq, ad, npairs, ld)
        } else {
            self.moe_gate_up_q8_ld(gate, up, ids, k, xq, xd, aq, ad, npairs, ld)
        }
    }

    /// [`Gpu::moe_gate_up_grp`] or [`Gpu::kq_moe_gate_up_grp`] by the experts' type.
    #[allow(clippy::too_many_arguments)]
    pub fn moe_gate_up_grp_any(&self, gate: &DevMat, up: &DevMat, grp: u64, e: usize, nslots: usize, k: usize, xq: u64, xd: u64, aq: u64, ad: u64, ld: usize) -> Result<(), CudaError> {
        if kq_fast_mat(gate) {
            self.kq_moe_gate_up_grp(gate, up, grp, e, nslots, k, xq, xd, aq, ad, ld)
        } else {
            self.moe_gate_up_grp(gate, up, grp, e, nslots, k, xq, xd, aq, ad, ld)
        }
    }

    /// [`Gpu::moe_down_grp`] or [`Gpu::kq_moe_down_grp`] by the experts' type.
    /// `after_gate_up`: launched right after the step's grouped gate/up (the forward's order;
    /// see [`Gpu::moe_down_gstream`]).
    #[allow(clippy::too_many_arguments)]
    pub fn moe_down_grp_any(&self, down: &DevMat, grp: u64, e: usize, nslots: usize, aq: u64, ad: u64, dpart: u64, after_gate_up: bool) -> Result<(), CudaError> {
        if kq_fast_mat(down) {
            self.kq_moe_down_grp(down, grp, e, nslots, aq, ad, dpart)
        } else {
            self.moe_down_grp_at(super::fast::grp_mma(), after_gate_up, down, grp, e, nslots, aq, ad, dpart)
        }
    }

    /// [`Gpu::moe_down_q8`] or [`Gpu::kq_moe_down_q8`] by the experts' type.
    #[allow(clippy::too_many_arguments)]
    pub fn moe_down_q8_any(&self, down: &DevMat, ids: u64, wts: u64, k: usize, aq: u64, ad: u64, hidden: u64, hs: usize, nt: usize) -> Result<(), CudaError> {
        if kq_fast_mat(down) {
            self.kq_moe_down_q8(down, ids, wts, k, aq, ad, hidden, hs, nt)
        } else {
            self.moe_down_q8(down, ids, wts, k, aq, ad, hidden, hs, nt)
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn mat(ty: GgmlType, cols: usize, ptr: u64) -> DevMat {
        let rb = cols / 256 * ty.block_bytes();
        DevMat { ptr, ty, rows: 8, cols, row_bytes: rb, n_experts: 4, expert_stride: 8 * rb }
    }

    #[test]
    fn kq_fast_mat_takes_whole_super_blocks_at_even_addresses() {
        assert!(kq_fast_mat(&mat(GgmlType::Q4_K, 3072, 0x1000)));
        assert!(kq_fast_mat(&mat(GgmlType::Q6_K, 768, 0x1002)));
        assert!(kq_fast_mat(&mat(GgmlType::Q6_K, 256 * 13, 0x1000)));
        assert!(!kq_fast_mat(&mat(GgmlType::Q6_K, 768, 0x1001)), "odd address");
        assert!(!kq_fast_mat(&mat(GgmlType::Q8_0, 3072, 0x1000)), "not a K-quant");
        assert!(!kq_fast_mat(&mat(GgmlType::Q5_K, 3072, 0x1000)), "Q5_K has no kernel");
        let mut m = mat(GgmlType::Q4_K, 3072, 0x1000);
        m.row_bytes += 16;
        assert!(!kq_fast_mat(&m), "padded rows");
        let mut m = mat(GgmlType::Q4_K, 3072, 0x1000);
        m.cols = 3000;
        assert!(!kq_fast_mat(&m), "partial super-block");
    }

    #[test]
    fn mv_instances_cover_every_step_size() {
        for nv in 1..=32 {
            let nt = mv_nt(nv);
            assert!([1, 4, 8, 16].contains(&nt) && (nv <= nt || nt == 16));
        }
    }
}
