//! Streamed IQ4_XS expert kernels (kernels/moe_stream.cu): the decode-step gate/up and down
//! with the weights brought into a ring of shared-memory stages by bulk asynchronous copies
//! (one producer warp per block, 16 consumer warps), instead of register loads. Same outputs as
//! the register kernels they stand in for (bit-identical gate/up and grouped down; the
//! combining down sums its experts in another, fixed order). `MINIMAX_MOE_STREAM=1` turns them
//! on for every step they fit (sm_90 and newer, IQ4_XS experts, inputs of at most 3072
//! columns, down rows of at most 1536, top-k of at most 8 for the combining down).

use std::sync::atomic::{AtomicUsize, Ordering};

use cudarc::driver::sys::CUdevice_attribute;
use minimax_shared::quant::GgmlType;

use super::env_flag::EnvFlag;
use super::error::CudaError;
use super::fast::{down_args, fast_mat, gate_up_args};
use super::gpu::{Arg, DevMat, Gpu};

static MOE_STREAM: EnvFlag = EnvFlag::new("MINIMAX_MOE_STREAM", false);

/// Whether the decode steps' IQ4_XS expert products take the streamed kernels where they fit
/// (`MINIMAX_MOE_STREAM`).
pub fn moe_stream() -> bool {
    MOE_STREAM.get()
}

/// Overrides [`moe_stream`] (A/B runs and tests; `None` = back to the environment). Drop
/// captured graphs after a change (`CudaModel::clear_graphs`).
pub fn set_moe_stream(on: Option<bool>) {
    MOE_STREAM.set(on);
}

static STAGE_CAP: AtomicUsize = AtomicUsize::new(0);

/// Caps the ring stages of the streamed kernels (tests: 2 makes every ring wrap; A/B runs;
/// `None` = back to `MINIMAX_MOE_STREAM_STAGES`, else as many as fit, at most 8). Drop captured
/// graphs after a change.
pub fn set_stream_stage_cap(cap: Option<usize>) {
    STAGE_CAP.store(cap.map(|c| c.max(2)).unwrap_or(0), Ordering::Relaxed);
}

fn stage_cap() -> usize {
    match STAGE_CAP.load(Ordering::Relaxed) {
        0 => {
            static V: std::sync::OnceLock<usize> = std::sync::OnceLock::new();
            *V.get_or_init(|| std::env::var("MINIMAX_MOE_STREAM_STAGES").ok().and_then(|v| v.parse().ok()).unwrap_or(MAX_STAGES).clamp(2, MAX_STAGES))
        }
        c => c.min(MAX_STAGES),
    }
}

/// Threads of a block: 16 consumer warps and the producer warp (`BK_THREADS`).
const THREADS: u32 = 32 * 17;
/// Shared memory before the ring: barriers and the gate/up sums (`BK_HDR`).
const HDR: usize = 17408;
/// Most ring stages (`BK_MAXST`).
const MAX_STAGES: usize = 8;
/// Units a lane round covers (3 per lane).
const ROUND_UNITS: usize = 96;
/// Gate (and up) rows per gate/up stage; rows per grouped-down stage; output rows per
/// combining-down stage (`BK_GU_SR`, `BK_DG_SR`, `BK_DC_SR`).
const GU_ROWS: usize = 8;
const DG_ROWS: usize = 32;
const DC_ROWS: usize = 4;
/// Most experts per token the combining down handles (two warps each).
pub const STREAM_MAX_K: usize = 8;

/// Which form of the streamed down runs.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum DownForm {
    /// Unweighted per-pair rows into `dpart` (steps grouped by expert).
    Grouped,
    /// The token's k experts weighted and added to the residual in the block.
    Combine,
}

impl Gpu {
    /// Ring stages of `stage` bytes a streamed kernel gets: as many as a block's opt-in shared
    /// memory holds, at most 8 (or the cap of [`set_stream_stage_cap`]); 0 when the kernels do not apply (before sm_90, where the bulk
    /// copies do not exist, or room for fewer than 2 stages).
    fn stream_stages(&self, stage: usize) -> Result<usize, CudaError> {
        if self.arch < 90 || stage == 0 {
            return Ok(0);
        }
        let optin = self.ctx.attribute(CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_BLOCK_OPTIN)?.max(0) as usize;
        let n = optin.saturating_sub(HDR) / stage;
        Ok(if n >= 2 { n.min(stage_cap()) } else { 0 })
    }

    /// Ring stages the streamed gate/up would run with for these matrices (0 = it does not fit).
    pub fn gate_up_stream_stages(&self, gate: &DevMat, up: &DevMat) -> Result<usize, CudaError> {
        let shapes = gate.ty == GgmlType::IQ4_XS && up.ty == gate.ty && fast_mat(gate) && fast_mat(up) && gate.row_bytes == up.row_bytes && gate.rows % 32 == 0 && gate.cols / 32 <= ROUND_UNITS && gate.cols % 32 == 0;
        if !shapes {
            return Ok(0);
        }
        self.stream_stages(2 * GU_ROWS * gate.row_bytes)
    }

    /// Ring stages the streamed down would run with in `form` at top-`k` (0 = it does not fit).
    pub fn down_stream_stages(&self, down: &DevMat, form: DownForm, k: usize) -> Result<usize, CudaError> {
        let shapes = down.ty == GgmlType::IQ4_XS && fast_mat(down) && 2 * (down.cols / 32) <= ROUND_UNITS && down.cols % 32 == 0;
        let stage = match form {
            DownForm::Grouped => DG_ROWS * down.row_bytes,
            DownForm::Combine if (1..=STREAM_MAX_K).contains(&k) => DC_ROWS * k * down.row_bytes,
            DownForm::Combine => 0,
        };
        if !shapes {
            return Ok(0);
        }
        self.stream_stages(stage)
    }

    /// One block per SM, fewer when there are fewer tasks.
    fn stream_grid(&self, tasks: usize) -> Result<u32, CudaError> {
        let sms = self.ctx.attribute(CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT)?.max(1) as usize;
        Ok(sms.min(tasks.max(1)) as u32)
    }

    /// Streamed gate/up/SiLU → q8: the outputs of [`Gpu::moe_gate_up_q8_ld`] (`grp` = None:
    /// `npairs` pairs of `ids`) or of [`Gpu::moe_gate_up_grp`] (`grp` = Some: the slots of
    /// `moe_group`, at most `npairs` of them, over `e` experts). Errors when it does not fit
    /// ([`Gpu::gate_up_stream_stages`]).
    #[allow(clippy::too_many_arguments)]
    pub fn moe_gate_up_stream(&self, gate: &DevMat, up: &DevMat, grp: Option<u64>, ids: u64, e: usize, k: usize, npairs: usize, xq: u64, xd: u64, aq: u64, ad: u64, ld: usize) -> Result<(), CudaError> {
        let nst = self.gate_up_stream_stages(gate, up)?;
        if nst == 0 || ld < gate.rows || ld % 32 != 0 || k == 0 {
            return Err(CudaError::Shape(format!("moe_gate_up_stream: {:?} {}x{} (ld {ld}, sm_{})", gate.ty, gate.rows, gate.cols, self.arch)));
        }
        let smem = HDR + nst * 2 * GU_ROWS * gate.row_bytes;
        let mid = [Arg::P(grp.unwrap_or(0)), Arg::P(ids), Arg::I(e as i32), Arg::I(k as i32), Arg::I(npairs as i32), Arg::I(gate.rows as i32), Arg::I(nst as i32)];
        let grid = self.stream_grid(npairs * (gate.rows / 32))?;
        self.launch_pdl("moe_gate_up_blk_iq4_xs", (grid, 1, 1), THREADS, smem as u32, &gate_up_args(gate, up, &mid, xq, xd, aq, ad, ld))
    }

    /// Streamed down. [`DownForm::Grouped`]: `dpart[p][r]` for the slots of `grp` (at most
    /// `nslots`), as [`Gpu::moe_down_grp`]. [`DownForm::Combine`]: `hidden[t] += sum_j w[t,j]
    /// down[ids[t,j]] act[t,j]` for `nt` tokens, as [`Gpu::moe_down_q8`]. Errors when it does
    /// not fit ([`Gpu::down_stream_stages`]).
    #[allow(clippy::too_many_arguments)]
    pub fn moe_down_stream(&self, down: &DevMat, form: DownForm, grp: u64, ids: u64, wts: u64, e: usize, k: usize, nslots_or_nt: usize, aq: u64, ad: u64, dpart: u64, hidden: u64, hs: usize) -> Result<(), CudaError> {
        let nst = self.down_stream_stages(down, form, k)?;
        if nst == 0 || (form == DownForm::Grouped && grp == 0) {
            return Err(CudaError::Shape(format!("moe_down_stream: {:?} {}x{} top-{k} {form:?} (sm_{})", down.ty, down.rows, down.cols, self.arch)));
        }
        let (stage, rows_per_task, grp_arg) = match form {
            DownForm::Grouped => (DG_ROWS * down.row_bytes, DG_ROWS, grp),
            DownForm::Combine => (DC_ROWS * k * down.row_bytes, DC_ROWS, 0),
        };
        let smem = HDR + nst * stage;
        let grid = self.stream_grid(nslots_or_nt * down.rows.div_ceil(rows_per_task))?;
        let mid = [Arg::P(grp_arg), Arg::P(ids), Arg::P(wts), Arg::I(e as i32), Arg::I(k as i32), Arg::I(nslots_or_nt as i32), Arg::I(nst as i32)];
        let tail = [Arg::P(dpart), Arg::P(hidden), Arg::L(hs as i64)];
        self.launch_pdl("moe_down_blk_iq4_xs", (grid, 1, 1), THREADS, smem as u32, &down_args(down, &mid, aq, ad, &tail))
    }
}
