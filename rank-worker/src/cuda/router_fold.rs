//! The folded router of one-token decode steps (kernels/fast.cu, "folded router"). The MoE
//! router's logits are linear in the MoE input up to the norm's scalar, so with h the layer's
//! input residual, o = Wo att the o-projection, g the MoE norm weight and inv its 1 / rms:
//!
//! `logits = Wr (g (h + o) inv) = inv (Wrg h + M att)`, `Wrg = Wr diag(g)`, `M = Wrg Wo`.
//!
//! `Wrg h` runs beside the q/k/v product and `M att` beside the o-projection (extra blocks of
//! their launches), so after the o-projection only the norm and the top-k remain
//! (`norm_q8_route`): the router's own product, a DRAM round trip and a grid-wide arrival leave
//! the batch-1 chain. Costs 9.4 MB of f32 weights a layer at M2.7 size (585 MB for 62 layers).
//! The logits differ from the unfolded router's by f32 rounding only.

use cudarc::driver::CudaSlice;
use minimax_shared::quant::GgmlType;

use super::error::CudaError;
use super::fast::{MvqKind, PDL_MVQS, PDL_MVQS2, fast_mat, fast_router, mv_args, pdl_part};
use super::gpu::{Arg, DevMat, Gpu};

/// Columns of one partial sum (`RF_COLS` in kernels/fast.cu).
pub const RF_COLS: usize = 1536;
/// Q8_0 chunk bytes of the dense kernels (8 blocks of 34).
const CH: usize = 272;

static ROUTER_FOLD: super::env_flag::EnvFlag = super::env_flag::EnvFlag::new("MINIMAX_ROUTER_FOLD", false);

/// Whether one-token fast steps route through the folded router (`MINIMAX_ROUTER_FOLD=1`;
/// the matrices are built at load whenever the model allows, so this can change at run time).
pub fn router_fold() -> bool {
    ROUTER_FOLD.get()
}

/// Overrides [`router_fold`] (A/B runs and tests; `None` = back to the environment). Drop
/// captured graphs after a change (`CudaModel::clear_graphs`).
pub fn set_router_fold(on: Option<bool>) {
    ROUTER_FOLD.set(on);
}

/// Partial sums a row of `cols` columns is split into.
pub fn pieces(cols: usize) -> usize {
    cols.div_ceil(RF_COLS)
}

/// One f32 product split into [`RF_COLS`]-column partial sums: `part[r * pieces + p]` = piece
/// p of row r of `w` (rows x cols, rows 16-byte aligned) times `x`.
#[derive(Clone, Copy, Debug)]
pub struct RouterPieces {
    pub w: u64,
    pub rows: usize,
    pub cols: usize,
    pub x: u64,
    pub part: u64,
}

impl RouterPieces {
    fn check(&self) -> Result<(), CudaError> {
        if self.cols % 4 != 0 || self.w % 16 != 0 || self.x % 16 != 0 || self.rows == 0 {
            return Err(CudaError::Shape(format!("router pieces: {} x {} (columns % 4, 16-byte aligned rows and input)", self.rows, self.cols)));
        }
        Ok(())
    }

    /// Blocks of 4 warps, one piece a warp.
    fn blocks(&self) -> usize {
        (self.rows * pieces(self.cols)).div_ceil(4)
    }

    fn args(&self) -> [Arg; 5] {
        [Arg::P(self.w), Arg::I(self.rows as i32), Arg::I(self.cols as i32), Arg::P(self.x), Arg::P(self.part)]
    }
}

/// One layer's folded router matrices.
pub struct LayerFold {
    /// `Wr diag(g)`: experts x hidden.
    pub wrg: CudaSlice<f32>,
    /// `Wrg Wo`: experts x o-projection input width.
    pub m: CudaSlice<f32>,
}

/// The folded router of every layer plus its partial-sum buffer (one token).
pub struct RouterFold {
    pub layers: Vec<LayerFold>,
    /// Pieces of `Wrg h` ([`RouterFold::pa`]) then of `M att` ([`RouterFold::pb`]).
    pub parts: CudaSlice<f32>,
    pub experts: usize,
    pub hidden: usize,
    pub o_in: usize,
}

impl RouterFold {
    /// Builds the matrices on the device from each layer's (router, MoE norm weight, o-proj),
    /// or None where the model does not qualify: f32 routers of at most 256 experts, Q8_0
    /// o-projections, widths multiples of 32.
    pub fn build(g: &Gpu, layers: &[(DevMat, u64, DevMat)]) -> Result<Option<Self>, CudaError> {
        let Some((r0, _, o0)) = layers.first() else { return Ok(None) };
        let (e, h, oi) = (r0.rows, r0.cols, o0.cols);
        let ok = |(r, _, o): &(DevMat, u64, DevMat)| {
            fast_router(r) && r.rows == e && r.cols == h && e <= 256 && o.ty == GgmlType::Q8_0 && fast_mat(o) && o.rows == h && o.cols == oi && oi % 32 == 0 && h % 32 == 0
        };
        if !layers.iter().all(ok) {
            return Ok(None);
        }
        let mut out = Vec::with_capacity(layers.len());
        for (r, nw, o) in layers {
            let wrg = g.zeros::<f32>(e * h)?;
            let m = g.zeros::<f32>(e * oi)?;
            let (pw, pm) = (g.ptr(&wrg), g.ptr(&m));
            g.launch("rfold_scale", ((e * h).div_ceil(256) as u32, 1, 1), 256, 0, &[Arg::P(r.ptr), Arg::P(*nw), Arg::I(e as i32), Arg::I(h as i32), Arg::P(pw)])?;
            g.launch(
                "rfold_m",
                (oi.div_ceil(64) as u32, e.div_ceil(16) as u32, 1),
                256,
                0,
                &[Arg::P(pw), Arg::I(e as i32), Arg::I(h as i32), Arg::P(o.ptr), Arg::L(o.row_bytes as i64), Arg::I(oi as i32), Arg::P(pm)],
            )?;
            out.push(LayerFold { wrg, m });
        }
        let parts = g.zeros::<f32>(e * (pieces(h) + pieces(oi)))?;
        g.sync()?;
        Ok(Some(Self { layers: out, parts, experts: e, hidden: h, o_in: oi }))
    }

    /// Device bytes of the matrices.
    pub fn bytes(&self) -> usize {
        self.layers.len() * 4 * self.experts * (self.hidden + self.o_in)
    }

    /// The pieces of `Wrg h` (layer `li`, input residual at `hid`).
    pub fn pa(&self, g: &Gpu, li: usize, hid: u64) -> RouterPieces {
        RouterPieces { w: g.ptr(&self.layers[li].wrg), rows: self.experts, cols: self.hidden, x: hid, part: g.ptr(&self.parts) }
    }

    /// The pieces of `M att` (layer `li`, f32 attention output at `att`).
    pub fn pb(&self, g: &Gpu, li: usize, att: u64) -> RouterPieces {
        let off = 4 * (self.experts * pieces(self.hidden)) as u64;
        RouterPieces { w: g.ptr(&self.layers[li].m), rows: self.experts, cols: self.o_in, x: att, part: g.ptr(&self.parts) + off }
    }
}

impl Gpu {
    /// [`RouterPieces`] alone (`rfold_part`).
    pub fn rfold_part(&self, rp: &RouterPieces) -> Result<(), CudaError> {
        rp.check()?;
        self.launch_pdl("rfold_part", (rp.blocks() as u32, 1, 1), 128, 0, &rp.args())
    }

    /// [`Gpu::matvec_q8`] of one vector with `rp`'s pieces as extra blocks of the same launch
    /// where the product takes `mvqs_q8_0_1s2p` / `mvqs_q8_0_1lp` (`..r`); otherwise the two
    /// launches one after the other. The product's outputs are the same bits either way.
    #[allow(clippy::too_many_arguments)]
    pub fn matvec_q8_rfold(&self, segs: &[(&DevMat, u64, usize)], xq: u64, xd: u64, ncol: usize, accumulate: bool, rp: &RouterPieces) -> Result<(), CudaError> {
        rp.check()?;
        let all_q8 = !segs.is_empty() && segs.len() <= 3 && segs.iter().all(|(w, _, _)| w.ty == GgmlType::Q8_0 && fast_mat(w) && w.cols == ncol);
        let whole = matches!(MvqKind::from_env(), MvqKind::Whole | MvqKind::Auto);
        if all_q8 && whole {
            let nchunks = segs[0].0.row_bytes / CH;
            let (args, rows) = mv_args(segs, nchunks, xq, xd, ncol, 1, accumulate);
            let fused = if nchunks <= 12 && pdl_part(PDL_MVQS2) {
                Some(("mvqs_q8_0_1s2pr", rows.div_ceil(8)))
            } else if nchunks > 12 && pdl_part(PDL_MVQS) {
                Some(("mvqs_q8_0_1lpr", rows.div_ceil(4)))
            } else {
                None
            };
            if let Some((name, nmain)) = fused {
                let mut args = args;
                args.push(Arg::I(nmain as i32));
                args.extend(rp.args());
                return self.launch_pdl(name, ((nmain + rp.blocks()) as u32, 1, 1), 128, 0, &args);
            }
        }
        self.matvec_q8_any(segs, xq, xd, ncol, 1, accumulate)?;
        self.rfold_part(rp)
    }

    /// `norm_q8` of the MoE input `x` (`nt` rows `xs` apart; weight `nw`) into `xq` / `xd` and
    /// the folded router's top-k: logits `inv (sum pa + sum pb)` into `lg` (`e` a token), ids
    /// and weights like [`Gpu::router_topk_f32`]'s.
    #[allow(clippy::too_many_arguments)]
    pub fn norm_q8_route(&self, x: u64, xs: usize, nw: u64, n: usize, eps: f32, xq: u64, xd: u64, pa: &RouterPieces, pb: &RouterPieces, bias: u64, k: usize, gating: minimax_shared::model::GatingFunc, lg: u64, ids: u64, wts: u64, nt: usize) -> Result<(), CudaError> {
        let e = pa.rows;
        if nt != 1 || n % 32 != 0 || n > 12 * 1024 || e > 256 || pb.rows != e || k == 0 || k > 32 || k > e {
            return Err(CudaError::Shape(format!("norm_q8_route: {nt} tokens (one), width {n}, {e} experts, top-{k}")));
        }
        let g = match gating {
            minimax_shared::model::GatingFunc::Sigmoid => 2,
            minimax_shared::model::GatingFunc::Softmax => 1,
        };
        self.launch_pdl(
            "norm_q8_route",
            (nt as u32, 1, 1),
            1024,
            0,
            &[
                Arg::P(x),
                Arg::L(xs as i64),
                Arg::P(nw),
                Arg::I(n as i32),
                Arg::F(eps),
                Arg::P(xq),
                Arg::P(xd),
                Arg::P(pa.part),
                Arg::I(pieces(pa.cols) as i32),
                Arg::P(pb.part),
                Arg::I(pieces(pb.cols) as i32),
                Arg::I(e as i32),
                Arg::P(bias),
                Arg::I(k as i32),
                Arg::I(g),
                Arg::P(lg),
                Arg::P(ids),
                Arg::P(wts),
            ],
        )
    }
}
