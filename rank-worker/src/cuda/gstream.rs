//! Grouped streamed IQ4_XS expert kernels (kernels/gstream.cu) for decode steps of several
//! tokens, whose MoE is grouped by expert (`moe_group`): weight rows stream into a ring of
//! shared-memory stages by bulk copies, each row owned by one lane (decoded once, dotted with
//! every pair of the slot, no cross-lane reductions), the 16 consumer warps' partial sums added
//! in a fixed order by an epilogue warp. Same outputs as `moe_gate_up_grpf` / `moe_down_grpf`
//! (q8 activations; `dpart` for `moe_combine_grp`), summed in another order. On by default
//! where they fit (sm_90 and newer, IQ4_XS, inputs of 512 x U columns with U <= 6,
//! rows in whole stages, room for 2 stages); `MINIMAX_GSTREAM=0` keeps the grouped register
//! kernels.

use minimax_shared::quant::GgmlType;

use super::env_flag::EnvFlag;
use super::error::CudaError;
use super::fast::{down_args, fast_mat, gate_up_args};
use super::gpu::{Arg, DevMat, Gpu};
use super::stream::probe;

static GSTREAM: EnvFlag = EnvFlag::new("MINIMAX_GSTREAM", true);

/// Whether grouped steps take the streamed kernels where they fit (`MINIMAX_GSTREAM`,
/// default on).
pub fn gstream_on() -> bool {
    GSTREAM.get()
}

/// Overrides [`gstream_on`] (A/B runs and tests; `None` = back to the environment). Drop
/// captured graphs after a change (`CudaModel::clear_graphs`).
pub fn set_gstream(on: Option<bool>) {
    GSTREAM.set(on);
}

/// Block: 16 consumer warps, the producer and the epilogue warp (`BK_THREADS`).
const THREADS: u32 = 32 * 18;
/// Consumer warps (`BK_CW`), pairs a stage carries (`GS_PC`), hand-over slots (`GS_NH`),
/// bytes before the hand-over slots (`GS_BAR`: barriers and the slots' chunk prefix), most
/// experts (`GS_MAXE`), most units a row (`16 x GS_MAXU`).
const CW: usize = 16;
const PC: usize = 4;
const NH: usize = 2;
const BAR: usize = 4608;
const MAX_E: usize = 1024;
const MAX_UNITS: usize = 96;
/// Rows a stage holds: gate/up 32 (one lane each), down 64 (two a lane).
const GU_ROWS: usize = 32;
const DN_ROWS: usize = 64;

/// The shared-memory pitch of a stage row: an odd number of 16-byte pieces, so that the
/// lanes' 8-byte loads at the same offset of 32 rows meet at most 2-way bank conflicts.
fn pitch(rb: usize) -> usize {
    if (rb / 16) % 2 == 1 { rb } else { rb + 16 }
}

/// A stacked expert matrix the kernels can read: IQ4_XS, whole 16-byte rows, experts and the
/// base 16-byte aligned (bulk copies), rows in whole stages, inputs of at most 96 units and a
/// multiple of 512 columns (16 units: the same number for each consumer warp; kernels for 1-6).
fn fits(m: &DevMat, stage_rows: usize) -> bool {
    m.ty == GgmlType::IQ4_XS && fast_mat(m) && m.row_bytes % 16 == 0 && m.expert_stride % 16 == 0 && m.ptr % 16 == 0 && m.rows % stage_rows == 0 && m.cols % 512 == 0 && m.cols / 32 <= MAX_UNITS
}

impl Gpu {
    /// (ring stages, shared-memory bytes) of the grouped streamed gate/up for these matrices,
    /// or None where it does not fit.
    pub fn gate_up_gstream_plan(&self, gate: &DevMat, up: &DevMat) -> Result<Option<(usize, usize)>, CudaError> {
        if !(fits(gate, GU_ROWS) && fits(up, GU_ROWS) && gate.row_bytes == up.row_bytes && gate.rows == up.rows && gate.expert_stride == up.expert_stride) {
            return Ok(None);
        }
        self.gstream_smem(gate, GU_ROWS)
    }

    /// (ring stages, shared-memory bytes) of the grouped streamed down, or None.
    pub fn down_gstream_plan(&self, down: &DevMat) -> Result<Option<(usize, usize)>, CudaError> {
        if !fits(down, DN_ROWS) {
            return Ok(None);
        }
        self.gstream_smem(down, DN_ROWS)
    }

    fn gstream_smem(&self, m: &DevMat, rows: usize) -> Result<Option<(usize, usize)>, CudaError> {
        // Barriers and chunk prefix, the hand-over slots, the chunk's activations; the ring.
        let fixed = BAR + NH * CW * PC * rows * 4 + PC * (m.cols + m.cols / 8);
        let stage = rows * pitch(m.row_bytes);
        let n = self.ring_stages(fixed, stage)?;
        Ok((n >= 2).then_some((n, fixed + n * stage)))
    }

    /// Grouped streamed gate/up/SiLU → q8 over the slots of `grp` ([`Gpu::moe_group`]): the
    /// outputs of [`Gpu::moe_gate_up_grp`] (within f32 rounding: another summation order).
    /// Errors when it does not fit ([`Gpu::gate_up_gstream_plan`]).
    #[allow(clippy::too_many_arguments)]
    pub fn moe_gate_up_gstream(&self, gate: &DevMat, up: &DevMat, grp: u64, e: usize, k: usize, xq: u64, xd: u64, aq: u64, ad: u64, ld: usize) -> Result<(), CudaError> {
        if self.try_gate_up_gstream(gate, up, grp, e, k, xq, xd, aq, ad, ld)? {
            return Ok(());
        }
        Err(CudaError::Shape(format!("moe_gate_up_gstream: {:?} {}x{} (ld {ld}, sm_{})", gate.ty, gate.rows, gate.cols, self.arch)))
    }

    /// [`Gpu::moe_gate_up_gstream`] if it fits (true: launched), else nothing (false).
    #[allow(clippy::too_many_arguments)]
    pub(super) fn try_gate_up_gstream(&self, gate: &DevMat, up: &DevMat, grp: u64, e: usize, k: usize, xq: u64, xd: u64, aq: u64, ad: u64, ld: usize) -> Result<bool, CudaError> {
        let Some((nst, smem)) = self.gate_up_gstream_plan(gate, up)?.filter(|_| ld >= gate.rows && ld % 32 == 0 && k > 0 && e <= MAX_E && xq % 16 == 0 && xd % 16 == 0) else {
            return Ok(false);
        };
        let mid = [Arg::P(grp), Arg::I(e as i32), Arg::I(k as i32), Arg::I(gate.rows as i32), Arg::I(super::stream::nst_arg(nst, 2)), Arg::I(pitch(gate.row_bytes) as i32)];
        // One block per SM: the task count is known on the device only (blocks without tasks exit).
        let name = format!("moe_gate_up_{}{}_iq4_xs", if probe() { "gstp" } else { "gst" }, gate.cols / 512);
        self.launch_pdl(&name, (self.stream_grid(usize::MAX)?, 1, 1), THREADS, smem as u32, &gate_up_args(gate, up, &mid, xq, xd, aq, ad, ld))?;
        Ok(true)
    }

    /// Grouped streamed down: `dpart[p][r] = down[expert of p] row r . act[p]` for every pair
    /// of `grp`, as [`Gpu::moe_down_grp`]. `early`: the producer reads `grp` and starts the
    /// weight stream before the PDL wait; only when the kernel launched right before this one
    /// is a gate/up kernel of the same step (they all wait before they trigger, so `grp` is
    /// complete), as in the forward. Errors when it does not fit.
    #[allow(clippy::too_many_arguments)]
    pub fn moe_down_gstream(&self, down: &DevMat, grp: u64, e: usize, aq: u64, ad: u64, dpart: u64, early: bool) -> Result<(), CudaError> {
        if self.try_down_gstream(down, grp, e, aq, ad, dpart, early)? {
            return Ok(());
        }
        Err(CudaError::Shape(format!("moe_down_gstream: {:?} {}x{} (sm_{})", down.ty, down.rows, down.cols, self.arch)))
    }

    /// [`Gpu::moe_down_gstream`] if it fits (true: launched), else nothing (false).
    #[allow(clippy::too_many_arguments)]
    pub(super) fn try_down_gstream(&self, down: &DevMat, grp: u64, e: usize, aq: u64, ad: u64, dpart: u64, early: bool) -> Result<bool, CudaError> {
        let Some((nst, smem)) = self.down_gstream_plan(down)?.filter(|_| e <= MAX_E && aq % 16 == 0 && ad % 16 == 0) else {
            return Ok(false);
        };
        let mid = [Arg::P(grp), Arg::I(e as i32), Arg::I(super::stream::nst_arg(nst, 3)), Arg::I(pitch(down.row_bytes) as i32), Arg::I(early as i32)];
        let name = format!("moe_down_{}{}_iq4_xs", if probe() { "gstp" } else { "gst" }, down.cols / 512);
        self.launch_pdl(&name, (self.stream_grid(usize::MAX)?, 1, 1), THREADS, smem as u32, &down_args(down, &mid, aq, ad, &[Arg::P(dpart)]))?;
        Ok(true)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn mat(rows: usize, cols: usize) -> DevMat {
        let rb = cols / 256 * 136;
        DevMat { ptr: 1 << 20, ty: GgmlType::IQ4_XS, rows, cols, row_bytes: rb, n_experts: 4, expert_stride: rows * rb }
    }

    #[test]
    fn stage_rows_are_an_odd_number_of_16_byte_pieces_and_match_the_kernel_rule() {
        for upw in 1..=6usize {
            let rb = 272 * upw;
            let p = pitch(rb);
            assert_eq!(p % 16, 0);
            assert_eq!((p / 16) % 2, 1, "rows of {rb} bytes");
            assert!(p == rb || p == rb + 16);
            // kernels/gstream.cu's GS_PITCH(upw)
            assert_eq!(p, if upw % 2 == 1 { 272 * upw } else { 272 * upw + 16 });
        }
    }

    #[test]
    fn m27_expert_shapes_fit_and_others_are_refused() {
        assert!(fits(&mat(1536, 3072), GU_ROWS), "M2.7 gate/up");
        assert!(fits(&mat(3072, 1536), DN_ROWS), "M2.7 down");
        assert!(fits(&mat(768, 3072), GU_ROWS), "a tensor-parallel gate/up slice");
        assert!(fits(&mat(3072, 1024), DN_ROWS), "a tensor-parallel down slice, padded to whole chunks");
        assert!(!fits(&mat(43, 1536), DN_ROWS), "rows not in whole stages");
        assert!(!fits(&mat(1536, 3584), GU_ROWS), "more than 96 units a row");
        assert!(!fits(&mat(1536, 2560 + 256), GU_ROWS), "not whole 512-column groups");
        let mut q8 = mat(1536, 3072);
        q8.ty = GgmlType::Q8_0;
        assert!(!fits(&q8, GU_ROWS), "IQ4_XS only");
        let mut odd = mat(1536, 3072);
        odd.ptr += 8;
        assert!(!fits(&odd, GU_ROWS), "bulk copies need 16-byte aligned rows");
    }
}
