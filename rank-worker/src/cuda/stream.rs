//! Streamed IQ4_XS expert kernels (kernels/stream.cu) for steps whose MoE runs one pair per slot
//! (batch 1, and steps not grouped by expert): the weights come into a ring of shared-memory
//! stages by bulk asynchronous copies (a producer warp per block, 16 consumer warps, an epilogue
//! warp) instead of register loads. The gate/up gives the register kernel's bits; the down adds
//! a token's experts in a fixed order of its own. On by default where they fit (sm_90 and newer,
//! IQ4_XS experts, inputs of at most 3072 columns, down rows of at most 1536, top-k of at most
//! 8); `MINIMAX_STREAM=0` turns them off.

use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};

use minimax_shared::quant::GgmlType;

use super::env_flag::EnvFlag;
use super::error::CudaError;
use super::fast::{down_args, fast_mat, gate_up_args};
use super::gpu::{Arg, DevMat, Gpu};

static STREAM: EnvFlag = EnvFlag::new("MINIMAX_STREAM", true);

/// Whether steps with one pair per slot take the streamed IQ4_XS expert kernels where they fit
/// (`MINIMAX_STREAM`, default on).
pub fn stream_on() -> bool {
    STREAM.get()
}

/// Overrides [`stream_on`] (A/B runs and tests; `None` = back to the environment). Drop
/// captured graphs after a change (`CudaModel::clear_graphs`).
pub fn set_stream(on: Option<bool>) {
    STREAM.set(on);
}

static LOOKUP: EnvFlag = EnvFlag::new("MINIMAX_STREAM_LOOKUP", false);

/// Whether the streamed kernels' consumers decode IQ4_XS codes with psx's lookup-and-select
/// (`blkl` kernels, `MINIMAX_STREAM_LOOKUP=1`) instead of the sign-replicating `prmt` decode
/// (`blk`, the default: fewer integer-ALU instructions per unit, twice the dp4a). Both give the
/// same integer dot products, so the same bits; the switch exists for A/B runs.
pub fn stream_lookup() -> bool {
    LOOKUP.get()
}

/// Overrides [`stream_lookup`] (A/B runs and tests; `None` = back to the environment). Drop
/// captured graphs after a change.
pub fn set_stream_lookup(on: Option<bool>) {
    LOOKUP.set(on);
}

/// Kernel-name stem of the streamed kernels in force: probe, lookup or sign decode.
fn stem() -> &'static str {
    if probe() {
        "blkp"
    } else if stream_lookup() {
        "blkl"
    } else {
        "blk"
    }
}

static STAGE_CAP: AtomicUsize = AtomicUsize::new(0);

/// Caps the ring stages of the streamed kernels (tests: 2 makes every ring wrap; A/B runs;
/// `None` = back to `MINIMAX_STREAM_STAGES`, else as many as fit, at most 8). Drop captured
/// graphs after a change.
pub fn set_stream_stage_cap(cap: Option<usize>) {
    STAGE_CAP.store(cap.map(|c| c.max(2)).unwrap_or(0), Ordering::Relaxed);
}

/// The ring cap asked for: [`set_stream_stage_cap`], else `MINIMAX_STREAM_STAGES` (read once),
/// else none (`None`: as many stages as fit, except the down's default, [`DOWN_STAGES`]).
fn stage_cap_set() -> Option<usize> {
    match STAGE_CAP.load(Ordering::Relaxed) {
        0 => {
            static V: std::sync::OnceLock<Option<usize>> = std::sync::OnceLock::new();
            *V.get_or_init(|| std::env::var("MINIMAX_STREAM_STAGES").ok().and_then(|v| v.parse::<usize>().ok()).map(|c| c.clamp(2, MAX_STAGES)))
        }
        c => Some(c.min(MAX_STAGES)),
    }
}

fn stage_cap() -> usize {
    stage_cap_set().unwrap_or(MAX_STAGES)
}

/// Largest gate/up stage rows and down stage rows (0 = no cap).
static ROWS_CAP: [AtomicUsize; 2] = [AtomicUsize::new(0), AtomicUsize::new(0)];

/// Caps the stage shapes (A/B runs: `gate_rows` of 32 / 16 / 8 gate rows per gate/up stage,
/// the largest of them at most the cap that gets 2 stages; `down_rows` of 8 / 4 output rows per
/// down stage; `None` = the default plans: 16 gate rows where 2 stages of them fit, else 32,
/// else 8, and 8 down rows).
/// Drop captured graphs after a change.
pub fn set_stream_rows_cap(caps: Option<(usize, usize)>) {
    let (g, d) = caps.unwrap_or((0, 0));
    ROWS_CAP[0].store(g, Ordering::Relaxed);
    ROWS_CAP[1].store(d, Ordering::Relaxed);
}

fn rows_ok(which: usize, rows: usize) -> bool {
    let c = ROWS_CAP[which].load(Ordering::Relaxed);
    c == 0 || rows <= c
}

/// Pacing of the rings (0 = off; `usize::MAX` = not set: the environment's): the streamed
/// gate/up and down (batch 1), then the grouped ones (kernels/gstream.cu, 2-32 tokens).
static PACE: [AtomicUsize; 4] = [const { AtomicUsize::new(usize::MAX) }; 4];

/// Caps the stages a streamed block has in flight (`(gate/up, down)`, 0 = no cap): a stage's
/// part is copied only once the same part of the stage `pace` before it has landed. `None` =
/// back to `MINIMAX_STREAM_PACE` (`G,D`, read once; default `1,1`: one stage in flight, which
/// measured fastest, docs/CUDA.md "Paced rings"). A cap at or above the ring's stages changes
/// nothing. The arithmetic is the same, so the same bits. Drop captured graphs after a change.
pub fn set_stream_pace(pace: Option<(usize, usize)>) {
    store_pace(0, pace);
}

/// [`set_stream_pace`] for the grouped streamed kernels (stage n is copied once stage n - pace
/// has landed); `None` = back to `MINIMAX_GSTREAM_PACE` (default `2,2`: two stages in flight,
/// which measured fastest at 4, 8 and 32 tokens; one was slower than none).
pub fn set_gstream_pace(pace: Option<(usize, usize)>) {
    store_pace(2, pace);
}

fn store_pace(at: usize, pace: Option<(usize, usize)>) {
    let (g, d) = pace.unwrap_or((usize::MAX, usize::MAX));
    PACE[at].store(g, Ordering::Relaxed);
    PACE[at + 1].store(d, Ordering::Relaxed);
}

/// `(gate/up, down)` pacing of an environment variable `G,D`, a missing or bad half `default`.
fn env_pace(var: &str, default: usize) -> (usize, usize) {
    let v = std::env::var(var).unwrap_or_default();
    let mut it = v.split(',').map(|x| x.trim().parse::<usize>().ok());
    (it.next().flatten().unwrap_or(default), it.next().flatten().unwrap_or(default))
}

/// The pacing in force for `which` (0 gate/up, 1 down, 2 / 3 the grouped ones): the setter's,
/// else the environment's.
fn pace(which: usize) -> usize {
    static ENV: [std::sync::OnceLock<(usize, usize)>; 2] = [std::sync::OnceLock::new(), std::sync::OnceLock::new()];
    match PACE[which].load(Ordering::Relaxed) {
        usize::MAX => {
            let (g, d) = if which < 2 {
                *ENV[0].get_or_init(|| env_pace("MINIMAX_STREAM_PACE", DEFAULT_PACE))
            } else {
                *ENV[1].get_or_init(|| env_pace("MINIMAX_GSTREAM_PACE", DEFAULT_GPACE))
            };
            if which % 2 == 0 { g } else { d }
        }
        p => p,
    }
}

/// Stages in flight per streamed block unless set otherwise ([`set_stream_pace`]).
const DEFAULT_PACE: usize = 1;
/// Stages in flight per grouped streamed block unless set otherwise ([`set_gstream_pace`]).
const DEFAULT_GPACE: usize = 2;

static GU_LATE: EnvFlag = EnvFlag::new("MINIMAX_STREAM_GU_LATE", false);

/// Whether the streamed gate/up lets the next kernel (the down) launch only once every block's
/// producer has issued its last copy (`MINIMAX_STREAM_GU_LATE`), instead of at its start. A
/// down block fits beside a gate/up block only where their rings are small (2 stages of 16
/// gate rows), and then starts its own ring while the gate/up computes. `None` = back to the
/// environment. Drop captured graphs after a change.
pub fn set_stream_gu_late(on: Option<bool>) {
    GU_LATE.set(on);
}

/// The kernels' `nst` argument: the ring's stages, the pacing of `which` ([`pace`]) above them
/// (bits 8..15), the gate/up's late trigger (bit 16).
pub(super) fn nst_arg(nst: usize, which: usize) -> i32 {
    let late = which == 0 && GU_LATE.get();
    (nst | pace(which).min(255) << 8 | (late as usize) << 16) as i32
}

static PROBE: AtomicBool = AtomicBool::new(false);

/// Timing probes only: the streamed launchers run the `blkp` kernels, whose consumers skip the
/// arithmetic (the outputs are garbage), so a benchmark sees what the ring alone delivers.
pub fn set_stream_probe(on: bool) {
    PROBE.store(on, Ordering::Relaxed);
}

pub(super) fn probe() -> bool {
    PROBE.load(Ordering::Relaxed)
}

/// The next layer's RMSNorm (or the output norm) run by the streamed down's last block on the
/// residual rows it just finished: `norm_q8` of them into `q` / `d`, bit for bit.
#[derive(Clone, Copy, Debug)]
pub struct NextNorm {
    /// The norm's weight (f32, the down's rows long).
    pub weight: u64,
    pub eps: f32,
    /// q8 output: `[nt][rows]` int8 and `[nt][rows / 32]` f32 scales.
    pub q: u64,
    pub d: u64,
    /// One u32 arrival counter, zero before the launch (left zero).
    pub cnt: u64,
    /// Let the next kernel launch after the loops instead of at the start.
    pub trig_late: bool,
    /// Non-zero: the x8 form (`dn_x8`; `rows / 8` f32 a token): each task of 8 rows writes
    /// its q8 codes, one scale of `weight`-scaled rows into `d` (`rows / 8` a token) and its
    /// sum of squares here, and no block waits for the others; the norm's 1 / rms is left to
    /// the reader ([`super::Gpu::matvec_q8_x8`]). `cnt` is then not touched.
    pub ss8: u64,
}

/// The x8 hand-over needs each task's rows to be one group of 8 (`dn_x8`).
fn x8_plan(rs: usize, rows: usize) -> bool {
    rs == 8 && rows % 8 == 0
}

/// What [`Gpu::moe_gate_up_stream_routed`] routes from: [`Gpu::router_f32n`]'s outputs.
#[derive(Clone, Copy, Debug)]
pub struct StreamRoute {
    /// Raw router logits (`e` f32, not yet scaled by the MoE norm's 1 / rms).
    pub logits: u64,
    /// The MoE norm's sums of squares, one per 32 input columns.
    pub ss: u64,
    /// Selection bias (`e` f32).
    pub bias: u64,
    pub e: usize,
    /// `route_topk_warp`'s gating code (2 sigmoid, 1 softmax).
    pub gating: i32,
    pub eps: f32,
    /// Where the top-k goes for the down (k ids, k weights), written by block 0.
    pub ids: u64,
    pub wts: u64,
}

/// Threads of a block: 16 consumer warps, the producer and the epilogue warp (`BK_THREADS`).
const THREADS: u32 = 32 * 18;
/// Shared memory before the ring: barriers and the hand-over buffers (`BK_HDR`).
const HDR: usize = 2048;
/// Most ring stages (`BK_MAXST`).
const MAX_STAGES: usize = 8;
/// Units a lane round covers (3 per lane).
const ROUND_UNITS: usize = 96;
/// Ring stages of the streamed down unless a cap is set (see [`Gpu::down_stream_plan`]).
const DOWN_STAGES: usize = 2;
/// Most experts per token the down handles (two consumer warps each).
pub const STREAM_MAX_K: usize = 8;

impl Gpu {
    /// Ring stages of `stage` bytes a streamed kernel gets after `fixed` bytes of its own: as
    /// many as a block's opt-in shared memory holds, at most 8 (or the cap of
    /// [`set_stream_stage_cap`]); 0 when the kernels do not apply (before sm_90, where the bulk
    /// copies do not exist, or room for fewer than 2). Also the grouped kernels' (gstream.rs).
    pub(super) fn ring_stages(&self, fixed: usize, stage: usize) -> Result<usize, CudaError> {
        if self.arch < 90 || stage == 0 {
            return Ok(0);
        }
        let optin = self.smem_optin();
        let n = optin.saturating_sub(fixed) / stage;
        Ok(if n >= 2 { n.min(stage_cap()) } else { 0 })
    }

    /// (gate rows per stage, ring stages) of the streamed gate/up for these matrices: 16 gate
    /// rows (and as many up rows) where 2 stages of them fit, else 32, else 8 (with a rows cap
    /// set: the largest at most the cap that gets 2 stages); None when it does not fit (type,
    /// shape, arch, shared memory). 16-row stages, paced to one in flight, took the batch-1 step
    /// 1.5 % below 32-row ones (docs/CUDA.md "Paced rings").
    pub fn gate_up_stream_plan(&self, gate: &DevMat, up: &DevMat) -> Result<Option<(usize, usize)>, CudaError> {
        let shapes = gate.ty == GgmlType::IQ4_XS && up.ty == gate.ty && fast_mat(gate) && fast_mat(up) && gate.row_bytes == up.row_bytes && gate.rows % 32 == 0 && gate.cols / 32 <= ROUND_UNITS;
        if !shapes {
            return Ok(None);
        }
        let order = if ROWS_CAP[0].load(Ordering::Relaxed) == 0 { [16usize, 32, 8] } else { [32, 16, 8] };
        for sr in order.into_iter().filter(|&r| rows_ok(0, r) || r == 8) {
            let n = self.ring_stages(HDR, 2 * sr * gate.row_bytes)?;
            if n >= 2 {
                return Ok(Some((sr, n)));
            }
        }
        Ok(None)
    }

    /// (output rows per stage, ring stages) of the streamed down at top-`k`: 8 rows when 2
    /// stages of them fit; None otherwise (4-row stages, which a 99 KB sm_120 block would get,
    /// measured slower than `rx4` on an H200: they run only when [`set_stream_rows_cap`] asks).
    /// Two stages unless [`set_stream_stage_cap`] or `MINIMAX_STREAM_STAGES` sets the cap: with
    /// all of a block's ~3 tasks in flight at once (4 stages) its first stage lands later (H200,
    /// M2.7 batch 1: 11.9 vs 11.2 us a launch, 4.526 vs 4.476 ms a step).
    pub fn down_stream_plan(&self, down: &DevMat, k: usize) -> Result<Option<(usize, usize)>, CudaError> {
        let shapes = down.ty == GgmlType::IQ4_XS && fast_mat(down) && 2 * (down.cols / 32) <= ROUND_UNITS && (1..=STREAM_MAX_K).contains(&k);
        if !shapes {
            return Ok(None);
        }
        let cap = ROWS_CAP[1].load(Ordering::Relaxed);
        let capped = stage_cap_set().is_some();
        for rs in [8usize, 4].into_iter().filter(|&r| if cap == 0 { r == 8 } else { r <= cap.max(4) }) {
            let n = self.ring_stages(HDR, rs * k * down.row_bytes)?;
            if n >= 2 {
                return Ok(Some((rs, if capped { n } else { DOWN_STAGES.min(n) })));
            }
        }
        Ok(None)
    }

    /// One block per SM, fewer when there are fewer tasks.
    pub(super) fn stream_grid(&self, tasks: usize) -> Result<u32, CudaError> {
        let sms = self.sm_count();
        Ok(sms.min(tasks.max(1)) as u32)
    }

    /// Streamed gate/up/SiLU → q8 of the `npairs` pairs of `ids` (token = pair / k): the
    /// outputs of [`Gpu::moe_gate_up_q8_ld`], bit for bit. Errors when it does not fit
    /// ([`Gpu::gate_up_stream_plan`]).
    #[allow(clippy::too_many_arguments)]
    pub fn moe_gate_up_stream(&self, gate: &DevMat, up: &DevMat, ids: u64, k: usize, npairs: usize, xq: u64, xd: u64, aq: u64, ad: u64, ld: usize) -> Result<(), CudaError> {
        if self.try_gate_up_stream(gate, up, ids, k, npairs, xq, xd, aq, ad, ld)? {
            return Ok(());
        }
        Err(CudaError::Shape(format!("moe_gate_up_stream: {:?} {}x{} (ld {ld}, sm_{})", gate.ty, gate.rows, gate.cols, self.arch)))
    }

    /// [`Gpu::moe_gate_up_stream`] if it fits (true: launched), else nothing (false): the
    /// dispatcher's form, one plan per launch.
    #[allow(clippy::too_many_arguments)]
    pub(super) fn try_gate_up_stream(&self, gate: &DevMat, up: &DevMat, ids: u64, k: usize, npairs: usize, xq: u64, xd: u64, aq: u64, ad: u64, ld: usize) -> Result<bool, CudaError> {
        let plan = self.gate_up_stream_plan(gate, up)?;
        let Some(plan) = plan.filter(|_| ld >= gate.rows && ld % 32 == 0 && k > 0) else {
            return Ok(false);
        };
        self.launch_gate_up_stream(stem(), plan, gate, up, ids, k, npairs, xq, xd, aq, ad, ld, &[])?;
        Ok(true)
    }

    /// Launches `moe_gate_up_{stem}{sr}_iq4_xs` with plan `(sr, nst)` on `npairs` pairs; `extra`:
    /// the kernel's own arguments after the common ones (the routed kernel's).
    #[allow(clippy::too_many_arguments)]
    fn launch_gate_up_stream(&self, stem: &str, (sr, nst): (usize, usize), gate: &DevMat, up: &DevMat, ids: u64, k: usize, npairs: usize, xq: u64, xd: u64, aq: u64, ad: u64, ld: usize, extra: &[Arg]) -> Result<(), CudaError> {
        let smem = HDR + nst * 2 * sr * gate.row_bytes;
        let mid = [Arg::P(ids), Arg::I(k as i32), Arg::I(npairs as i32), Arg::I(gate.rows as i32), Arg::I(nst_arg(nst, 0))];
        let grid = self.stream_grid(npairs * (gate.rows / 32))?;
        let mut args = gate_up_args(gate, up, &mid, xq, xd, aq, ad, ld);
        args.extend_from_slice(extra);
        self.launch_pdl(&format!("moe_gate_up_{stem}{sr}_iq4_xs"), (grid, 1, 1), THREADS, smem as u32, &args)
    }

    /// Whether [`Gpu::moe_gate_up_stream_routed`] takes these matrices at top-`k` of `e` experts
    /// with activations `ld` apart: the streamed gate/up fits, sign decode (not the lookup or
    /// probe kernels), k <= 32, e <= 256 (`route_topk_warp`).
    pub fn gate_up_routes(&self, gate: &DevMat, up: &DevMat, k: usize, e: usize, ld: usize) -> Result<bool, CudaError> {
        Ok(self.routed_plan(gate, up, k, e, ld)?.is_some())
    }

    /// The routed gate/up's plan ([`Gpu::gate_up_stream_plan`]), None where it does not apply.
    fn routed_plan(&self, gate: &DevMat, up: &DevMat, k: usize, e: usize, ld: usize) -> Result<Option<(usize, usize)>, CudaError> {
        let decode = !probe() && !stream_lookup();
        let fits = (1..=32).contains(&k) && k <= e && e <= super::fast::ROUTE_FAST_MAX_E && ld >= gate.rows && ld % 32 == 0;
        if !(decode && fits && stream_on()) {
            return Ok(None);
        }
        self.gate_up_stream_plan(gate, up)
    }

    /// The streamed gate/up of one token that routes itself (`moe_gate_up_blkr`) after
    /// [`Gpu::router_f32n`]: each block takes the MoE norm's scale from the group sums `r.ss`
    /// and the top-k of the raw logits `r.logits`, so `aq` / `ad` and `r.ids` / `r.wts` are
    /// those of [`Gpu::router_topk_f32n`] + [`Gpu::moe_gate_up_stream`], bit for bit. Errors
    /// when [`Gpu::gate_up_routes`] says no.
    #[allow(clippy::too_many_arguments)]
    pub fn moe_gate_up_stream_routed(&self, gate: &DevMat, up: &DevMat, r: &StreamRoute, k: usize, xq: u64, xd: u64, aq: u64, ad: u64, ld: usize) -> Result<(), CudaError> {
        let Some(plan) = self.routed_plan(gate, up, k, r.e, ld)? else {
            return Err(CudaError::Shape(format!("moe_gate_up_stream_routed: {:?} {}x{} top-{k} of {} (ld {ld}, sm_{})", gate.ty, gate.rows, gate.cols, r.e, self.arch)));
        };
        let extra = [Arg::P(r.logits), Arg::P(r.ss), Arg::P(r.bias), Arg::I(r.e as i32), Arg::I(r.gating), Arg::F(r.eps), Arg::P(r.wts)];
        self.launch_gate_up_stream("blkr", plan, gate, up, r.ids, k, k, xq, xd, aq, ad, ld, &extra)
    }

    /// Streamed down + weighted combine: `hidden[t] += sum_j w[t,j] down[ids[t,j]] act[t,j]`
    /// for `nt` tokens, as [`Gpu::moe_down_q8`] (the experts added in order j; not rx4's
    /// order). Errors when it does not fit ([`Gpu::down_stream_plan`]).
    #[allow(clippy::too_many_arguments)]
    pub fn moe_down_stream(&self, down: &DevMat, ids: u64, wts: u64, k: usize, nt: usize, aq: u64, ad: u64, hidden: u64, hs: usize) -> Result<(), CudaError> {
        if self.try_down_stream(down, ids, wts, k, nt, aq, ad, hidden, hs)? {
            return Ok(());
        }
        Err(CudaError::Shape(format!("moe_down_stream: {:?} {}x{} top-{k} (sm_{})", down.ty, down.rows, down.cols, self.arch)))
    }

    /// [`Gpu::moe_down_stream`] if it fits (true: launched), else nothing (false).
    #[allow(clippy::too_many_arguments)]
    pub(super) fn try_down_stream(&self, down: &DevMat, ids: u64, wts: u64, k: usize, nt: usize, aq: u64, ad: u64, hidden: u64, hs: usize) -> Result<bool, CudaError> {
        self.try_down_stream_norm(down, ids, wts, k, nt, aq, ad, hidden, hs, None)
    }

    /// Whether [`Gpu::try_down_stream_norm`] takes the x8 hand-over ([`NextNorm::ss8`]) for
    /// these experts at top-`k`, so a caller asks for it only where the streamed down runs.
    pub fn down_takes_x8(&self, down: &DevMat, k: usize) -> Result<bool, CudaError> {
        Ok(self.down_stream_plan(down, k)?.is_some_and(|(rs, _)| x8_plan(rs, down.rows)))
    }

    /// [`Gpu::try_down_stream`], and with `next` the next RMSNorm of the new residual rows in
    /// the down's last block (see [`NextNorm`]); false (nothing launched) when the down does
    /// not fit or `next` cannot be fused (rows above [`super::fast::FUSED_NORM_MAX`]).
    #[allow(clippy::too_many_arguments)]
    pub fn try_down_stream_norm(&self, down: &DevMat, ids: u64, wts: u64, k: usize, nt: usize, aq: u64, ad: u64, hidden: u64, hs: usize, next: Option<&NextNorm>) -> Result<bool, CudaError> {
        if next.is_some() && (down.rows > super::fast::FUSED_NORM_MAX || down.rows % 32 != 0) {
            return Ok(false);
        }
        let Some((rs, nst)) = self.down_stream_plan(down, k)? else {
            return Ok(false);
        };
        if next.is_some_and(|n| n.ss8 != 0) && !x8_plan(rs, down.rows) {
            return Ok(false);
        }
        let smem = HDR + nst * rs * k * down.row_bytes;
        let grid = self.stream_grid(nt * down.rows.div_ceil(rs))?;
        let mid = [Arg::P(ids), Arg::P(wts), Arg::I(k as i32), Arg::I(nt as i32), Arg::I(nst_arg(nst, 1))];
        let name = format!("moe_down_{}{rs}_iq4_xs", stem());
        let (nw, eps, nq, nd, cnt, late, ss8) = match next {
            Some(n) => (n.weight, n.eps, n.q, n.d, n.cnt, n.trig_late, n.ss8),
            None => (0, 0.0, 0, 0, 0, false, 0),
        };
        let tail = [Arg::P(hidden), Arg::L(hs as i64), Arg::P(nw), Arg::F(eps), Arg::P(nq), Arg::P(nd), Arg::P(cnt), Arg::I(late as i32), Arg::P(ss8)];
        self.launch_pdl(&name, (grid, 1, 1), THREADS, smem as u32, &down_args(down, &mid, aq, ad, &tail))?;
        Ok(true)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn pacing_env_halves_fall_back_to_the_default() {
        // Variables of this test only (the real ones are read once per process).
        let cases = [("MINIMAX_TEST_PACE_A", Some("2,3"), (2, 3)), ("MINIMAX_TEST_PACE_B", Some(" 0 , 5 "), (0, 5)), ("MINIMAX_TEST_PACE_C", Some("4"), (4, 7)), ("MINIMAX_TEST_PACE_D", Some("x,1"), (7, 1)), ("MINIMAX_TEST_PACE_E", None, (7, 7))];
        for (var, val, want) in cases {
            match val {
                // SAFETY: each case has its own variable, which nothing else reads.
                Some(v) => unsafe { std::env::set_var(var, v) },
                None => unsafe { std::env::remove_var(var) },
            }
            assert_eq!(env_pace(var, 7), want, "{var}={val:?}");
        }
    }

    #[test]
    fn nst_argument_packs_the_pace_above_the_stages() {
        set_stream_pace(Some((3, 0)));
        set_gstream_pace(Some((0, 300)));
        set_stream_gu_late(Some(false));
        assert_eq!(nst_arg(4, 0), 4 | 3 << 8);
        assert_eq!(nst_arg(2, 1), 2);
        assert_eq!(nst_arg(8, 3), 8 | 255 << 8, "a pace above 255 is capped, not carried into the late bit");
        set_stream_gu_late(Some(true));
        assert_eq!(nst_arg(4, 0), 4 | 3 << 8 | 1 << 16);
        assert_eq!(nst_arg(4, 2), 4, "the late trigger is the batch-1 gate/up's only");
        set_stream_gu_late(None);
        set_stream_pace(None);
        set_gstream_pace(None);
    }
}
