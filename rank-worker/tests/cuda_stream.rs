//! The streamed IQ4_XS expert kernels (kernels/stream.cu, rank-worker/src/cuda/stream.rs)
//! against the register kernels they stand in for and against f64 products of the dequantized
//! weights: the gate/up bit for bit against `moe_gate_up_psx`, the down (with the weighted
//! combine) against f64 and deterministic. Every comparison runs with the default ring, with as
//! many ring stages as fit and with 2 (every ring wraps many times), twice. Outputs are
//! poisoned first. Needs a GPU: run with `--ignored`.
#![cfg(feature = "cuda")]

mod common;

use std::sync::Mutex;

use common::gpu::{Rng, bits, dot, gpu, launch_us, poisoned, q8_deq, q8_host, random_experts, random_rows, routed, upload_mat};
use minimax_rank::cuda::fast::{self, GateUpKind};
use minimax_rank::cuda::stream::{NextNorm, set_gstream_pace, set_stream_gu_late, set_stream_lookup, set_stream_pace, set_stream_rows_cap, set_stream_stage_cap};
use minimax_rank::cuda::{DevMat, Gpu};
use minimax_shared::quant::{self, GgmlType};

/// The switches are process-wide: tests run one at a time.
static SERIAL: Mutex<()> = Mutex::new(());
const TY: GgmlType = GgmlType::IQ4_XS;

/// Row r of expert ex of a stacked matrix (experts of `rows` rows of `cols`), dequantized.
fn deq_row(m: &[u8], ex: usize, rows: usize, r: usize, cols: usize) -> Vec<f32> {
    let rb = quant::row_bytes(TY, cols).unwrap();
    let o = (ex * rows + r) * rb;
    quant::dequantize_to_vec(TY, &m[o..o + rb], cols).unwrap()
}

/// Gate/up with one pair per slot, bit for bit against `moe_gate_up_psx` (itself checked against
/// the CPU in cuda_kernels), plus sampled rows against f64: 2 tokens x top-3 of 6 experts over
/// 2560 columns (80 units: a partial lane round) with activations 64 apart beyond the rows (the
/// tensor-parallel pad, never written), and M2.7's batch-1 shape (1 token x top-8 of 16, 3072 ->
/// 1536).
#[test]
#[ignore = "needs a CUDA GPU"]
fn streamed_gate_up_matches_psx() {
    let _s = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let g = gpu();
    let mut rng = Rng(0x5eed_0fa5_7000_0101);
    for &(e, k, nt, h, ff, pad) in &[(6usize, 3usize, 2usize, 2560usize, 1536usize, 64usize), (16, 8, 1, 3072, 1536, 0)] {
        let ld = ff + pad;
        let gate = random_rows(&mut rng, TY, e * ff, h);
        let upw = random_rows(&mut rng, TY, e * ff, h);
        let (_g1, gm) = upload_mat(&g, TY, &gate, ff, h, e);
        let (_g2, um) = upload_mat(&g, TY, &upw, ff, h, e);
        assert!(g.gate_up_stream_plan(&gm, &um).unwrap().is_some(), "{h} -> {ff}: the streamed gate/up must fit");
        let ids = routed(&mut rng, nt, k, e);
        let x = rng.vec(nt * h, 2.0);
        let (hq, hd) = q8_host(&x);
        let xv = q8_deq(&hq, &hd);
        let (qb, db, ib) = (g.upload(&hq).unwrap(), g.upload(&hd).unwrap(), g.upload(&ids).unwrap());
        let np = nt * k;
        let run = |stream: bool| {
            let aq = g.zeros::<i8>(np * ld).unwrap();
            g.fill_u32(g.ptr(&aq), np * ld / 4, 0x7f7f_7f7f).unwrap();
            let ad = poisoned(&g, np * ld / 32);
            if stream {
                g.moe_gate_up_stream(&gm, &um, g.ptr(&ib), k, np, g.ptr(&qb), g.ptr(&db), g.ptr(&aq), g.ptr(&ad), ld).unwrap();
            } else {
                g.moe_gate_up_q8_with(GateUpKind::PersistIl, &gm, &um, g.ptr(&ib), k, g.ptr(&qb), g.ptr(&db), g.ptr(&aq), g.ptr(&ad), np, ld).unwrap();
            }
            g.sync().unwrap();
            (g.download(&aq).unwrap(), g.download(&ad).unwrap())
        };
        let want = run(false);
        for lookup in [false, true] {
            set_stream_lookup(Some(lookup));
            let dec = if lookup { "lookup decode" } else { "sign decode" };
            for rows in [32usize, 16, 8] {
                set_stream_rows_cap(Some((rows, 8)));
                for cap in [None, Some(2)] {
                    set_stream_stage_cap(cap);
                    // Paced rings (the default 1, and 2 stages in flight) and the unpaced one:
                    // the same arithmetic.
                    for (pace, late) in [(None, false), (Some((0, 0)), false), (Some((2, 2)), false), (None, true)] {
                        set_stream_pace(pace);
                        set_stream_gu_late(Some(late));
                        for rep in 0..2 {
                            let got = run(true);
                            assert_eq!(got.0, want.0, "{h} -> {ff}, {dec}, {rows}-row stages, stage cap {cap:?}, pace {pace:?}, late trigger {late}: q8 codes differ from psx (rep {rep})");
                            assert_eq!(bits(&got.1), bits(&want.1), "{h} -> {ff}, {dec}, {rows}-row stages, stage cap {cap:?}, pace {pace:?}, late trigger {late}: q8 scales differ from psx (rep {rep})");
                        }
                    }
                    set_stream_pace(None);
                    set_stream_gu_late(None);
                }
            }
        }
        set_stream_lookup(None);
        set_stream_stage_cap(None);
        set_stream_rows_cap(None);
        let (c, s) = &want;
        for p in 0..np {
            assert!(c[p * ld + ff..(p + 1) * ld].iter().all(|&q| q == 0x7f), "pair {p}: the pad was written");
            let (ex, t) = (ids[p] as usize, p / k);
            for r in [0, 1, 31, 32, ff / 2 + 3, ff - 1, rng.below(ff)] {
                let xt = &xv[t * h..(t + 1) * h];
                let (gg, uu) = (dot(&deq_row(&gate, ex, ff, r, h), xt).0, dot(&deq_row(&upw, ex, ff, r, h), xt).0);
                let want_v = (gg / (1.0 + (-gg).exp()) * uu) as f32;
                let sc = s[p * ld / 32 + r / 32];
                let got_v = c[p * ld + r] as f32 * sc;
                let tol = sc * 0.51 + 1e-4 * want_v.abs() + 1e-6;
                assert!(got_v.is_finite() && (got_v - want_v).abs() <= tol, "pair {p} row {r}: got {got_v} want {want_v} tol {tol}");
            }
        }
        eprintln!("streamed gate/up {np} pairs, {h} -> {ff}: bit-identical to psx (all stages and 2), sampled rows within q8 rounding of f64");
    }
}

/// The gate/up that routes itself (`router_f32n` + `moe_gate_up_blkr`, one token) against the
/// router's last block (`router_topk_f32n` + `moe_gate_up_blk`): ids, weights, q8 codes and
/// scales of the activations bit for bit, on the same residual row: M2.7's shape (top-8 of 256
/// by sigmoid, 3072 -> 1536) and a softmax router (top-5 of 37, 2560 columns: a partial lane
/// round, activations 64 apart), router blocks of 4, 2, 1 and 8 warps, every stage shape, the
/// default ring and 2 stages, twice. The routed kernel writes ids / w for the down from block 0
/// only, so they are poisoned first. Shapes it cannot take are refused.
#[test]
#[ignore = "needs a CUDA GPU"]
fn streamed_gate_up_routes_like_the_router() {
    use minimax_rank::cuda::stream::StreamRoute;
    use minimax_shared::model::GatingFunc;
    let _s = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let g = gpu();
    let mut rng = Rng(0x5eed_0fa5_7000_0107);
    let eps = 1e-6f32;
    for &(e, k, h, ff, pad, gating) in &[(256usize, 8usize, 3072usize, 1536usize, 0usize, GatingFunc::Sigmoid), (37, 5, 2560, 1536, 64, GatingFunc::Softmax)] {
        let ld = ff + pad;
        let gate = random_rows(&mut rng, TY, e * ff, h);
        let upw = random_rows(&mut rng, TY, e * ff, h);
        let (_g1, gm) = upload_mat(&g, TY, &gate, ff, h, e);
        let (_g2, um) = upload_mat(&g, TY, &upw, ff, h, e);
        let wr = rng.vec(e * h, 0.05);
        let bytes: Vec<u8> = wr.iter().flat_map(|v| v.to_le_bytes()).collect();
        let (_r, rm) = upload_mat(&g, GgmlType::F32, &bytes, e, h, 0);
        let (x, nw, bias) = (rng.vec(h, 2.0), rng.vec(h, 1.0), rng.vec(e, 0.3));
        let (xb, nwb, bb) = (g.upload(&x).unwrap(), g.upload(&nw).unwrap(), g.upload(&bias).unwrap());
        assert!(g.gate_up_routes(&gm, &um, k, e, ld).unwrap(), "top-{k} of {e}, {h} -> {ff}: the routed gate/up must fit");
        let cnt = g.zeros::<u32>(1).unwrap();
        // One token through the router's last block (0) or the routed gate/up (1): (ids,
        // weights, q8 codes, q8 scales, the input's q8 codes, its scales, logits, group sums).
        type Out = (Vec<i32>, Vec<f32>, Vec<i8>, Vec<f32>, Vec<i8>, Vec<f32>, Vec<f32>, Vec<f32>);
        let run = |mode: usize| -> Out {
            let (y, ss) = (poisoned(&g, e), poisoned(&g, h / 32));
            let (xq, xd) = (g.upload(&vec![0x55i8; h]).unwrap(), poisoned(&g, h / 32));
            let ids = g.zeros::<i32>(k).unwrap();
            g.fill_u32(g.ptr(&ids), k, u32::MAX).unwrap();
            let wts = poisoned(&g, k);
            let aq = g.zeros::<i8>(k * ld).unwrap();
            g.fill_u32(g.ptr(&aq), k * ld / 4, 0x7f7f_7f7f).unwrap();
            let ad = poisoned(&g, k * ld / 32);
            let (px, pq, pd, pa, pad_) = (g.ptr(&xb), g.ptr(&xq), g.ptr(&xd), g.ptr(&aq), g.ptr(&ad));
            let r = StreamRoute { logits: g.ptr(&y), ss: g.ptr(&ss), bias: g.ptr(&bb), e, gating: if gating == GatingFunc::Sigmoid { 2 } else { 1 }, eps, ids: g.ptr(&ids), wts: g.ptr(&wts) };
            match mode {
                0 => {
                    g.router_topk_f32n(&rm, px, h, g.ptr(&nwb), eps, g.ptr(&y), e, g.ptr(&bb), k, gating, g.ptr(&ids), g.ptr(&wts), g.ptr(&cnt), pq, pd, g.ptr(&ss), 1).unwrap();
                    g.moe_gate_up_stream(&gm, &um, g.ptr(&ids), k, k, pq, pd, pa, pad_, ld).unwrap();
                }
                _ => {
                    g.router_f32n(&rm, px, g.ptr(&nwb), eps, g.ptr(&y), g.ptr(&bb), k, gating, pq, pd, g.ptr(&ss)).unwrap();
                    g.moe_gate_up_stream_routed(&gm, &um, &r, k, pq, pd, pa, pad_, ld).unwrap();
                }
            }
            g.sync().unwrap();
            assert_eq!(g.download(&cnt).unwrap(), vec![0], "mode {mode}: counter left at zero");
            (g.download(&ids).unwrap(), g.download(&wts).unwrap(), g.download(&aq).unwrap(), g.download(&ad).unwrap(), g.download(&xq).unwrap(), g.download(&xd).unwrap(), g.download(&y).unwrap(), g.download(&ss).unwrap())
        };
        let want = run(0);
        let mut seen = want.0.clone();
        seen.sort();
        seen.dedup();
        assert!(seen.len() == k && seen.iter().all(|&i| (0..e as i32).contains(&i)), "top-{k} of {e}: the router's ids {:?}", want.0);
        assert!((0..k).all(|p| want.3[p * ld / 32..p * ld / 32 + ff / 32].iter().all(|v| v.is_finite())), "top-{k} of {e}: the router's path left non-finite scales");
        let mut routed_in: Option<Out> = None;
        for (rows, warps) in [(32usize, 4u32), (32, 2), (32, 1), (32, 8), (16, 4), (8, 2)] {
            set_stream_rows_cap(Some((rows, 8)));
            fast::set_router_f32n_warps(Some(warps));
            for cap in [None, Some(2)] {
                set_stream_stage_cap(cap);
                for rep in 0..2 {
                    for mode in [1usize] {
                        let what = format!("top-{k} of {e} ({gating:?}), {h} -> {ff}, router blocks of {warps} warps, {rows}-row stages, stage cap {cap:?}, rep {rep}");
                        let got = run(mode);
                        assert_eq!(got.0, want.0, "{what}: ids");
                        assert_eq!(bits(&got.1), bits(&want.1), "{what}: routing weights");
                        assert_eq!(got.2, want.2, "{what}: q8 codes of the activations");
                        assert_eq!(bits(&got.3), bits(&want.3), "{what}: q8 scales of the activations");
                        assert_eq!(got.4, want.4, "{what}: q8 codes of the input");
                        // router_f32n's raw logits, unscaled input scales and group sums, the
                        // same whatever the router's blocks.
                        match &routed_in {
                            None => routed_in = Some(got),
                            Some(r) => {
                                assert_eq!(bits(&got.5), bits(&r.5), "{what}: unscaled input scales");
                                assert_eq!(bits(&got.6), bits(&r.6), "{what}: raw logits");
                                assert_eq!(bits(&got.7), bits(&r.7), "{what}: group sums");
                            }
                        }
                    }
                }
            }
        }
        set_stream_stage_cap(None);
        set_stream_rows_cap(None);
        fast::set_router_f32n_warps(None);
        // What they cannot take: more than 32 experts a token, more experts than the top-k reads,
        // the lookup decode (the A/B kernels route in the router).
        assert!(!g.gate_up_routes(&gm, &um, 33, 64, ld).unwrap() && !g.gate_up_routes(&gm, &um, k, 300, ld).unwrap(), "top-33 / 300 experts must be refused");
        set_stream_lookup(Some(true));
        assert!(!g.gate_up_routes(&gm, &um, k, e, ld).unwrap(), "the lookup decode routes in the router");
        set_stream_lookup(None);
        eprintln!("routed gate/up, top-{k} of {e} ({gating:?}), {h} -> {ff}: ids, weights, q8 codes and scales bit-identical to router_topk_f32n + the streamed gate/up");
    }
}

/// The combining down (one token's k experts weighted and added to the residual in the block)
/// against f64 for every output row, deterministic from run to run, nothing written past the
/// rows: 3 tokens x top-5 of 7 (43 rows: a partial stage; 3040 rows) and M2.7's batch-1 shape
/// (top-8 of 16, 1536 -> 3072).
#[test]
#[ignore = "needs a CUDA GPU"]
fn streamed_combine_down_matches_f64() {
    let _s = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let g = gpu();
    let mut rng = Rng(0x5eed_0fa5_7000_0103);
    let ff = 1536usize;
    for &(e, k, nt, rows) in &[(7usize, 5usize, 3usize, 43usize), (7, 5, 3, 3040), (16, 8, 1, 3072)] {
        let ids = routed(&mut rng, nt, k, e);
        let wts = rng.vec(nt * k, 0.5);
        let act = rng.vec(nt * k * ff, 2.0);
        let (aqh, adh) = q8_host(&act);
        let av = q8_deq(&aqh, &adh);
        let (ib, wb, aq, ad) = (g.upload(&ids).unwrap(), g.upload(&wts).unwrap(), g.upload(&aqh).unwrap(), g.upload(&adh).unwrap());
        let down = random_rows(&mut rng, TY, e * rows, ff);
        let (_db, dm) = upload_mat(&g, TY, &down, rows, ff, e);
        assert!(g.down_stream_plan(&dm, k).unwrap().is_some(), "top-{k}, {ff} -> {rows}: the streamed down must fit");
        let hid0 = rng.vec(nt * (rows + 1), 1.0);
        let run = |dm: &DevMat| {
            let hb = g.upload(&hid0).unwrap();
            g.moe_down_stream(dm, g.ptr(&ib), g.ptr(&wb), k, nt, g.ptr(&aq), g.ptr(&ad), g.ptr(&hb), rows + 1).unwrap();
            g.sync().unwrap();
            g.download(&hb).unwrap()
        };
        let got = run(&dm);
        let mut worst = 0f64;
        for t in 0..nt {
            assert_eq!(got[t * (rows + 1) + rows].to_bits(), hid0[t * (rows + 1) + rows].to_bits(), "token {t}: wrote past the rows");
            for r in 0..rows {
                let (mut want, mut scale) = (hid0[t * (rows + 1) + r] as f64, 1e-6f64);
                for j in 0..k {
                    let p = t * k + j;
                    let a = &av[p * ff..(p + 1) * ff];
                    let (d, abs) = dot(&deq_row(&down, ids[p] as usize, rows, r, ff), a);
                    want += wts[p] as f64 * d;
                    scale += (wts[p] as f64).abs() * abs;
                }
                let gv = got[t * (rows + 1) + r] as f64;
                assert!(gv.is_finite() && (gv - want).abs() <= 1e-5 * scale + 1e-6, "top-{k} token {t} row {r}: got {gv} want {want}");
                worst = worst.max((gv - want).abs() / scale);
            }
        }
        // The default ring (2 stages), 2 and as many as fit (up to 8: rings that do not wrap).
        for cap in [None, Some(2), Some(8)] {
            set_stream_stage_cap(cap);
            for rep in 0..2 {
                assert_eq!(bits(&run(&dm)), bits(&got), "top-{k} {rows} rows, stage cap {cap:?}: not deterministic (rep {rep})");
            }
            // Unpaced and other paced rings (the default is 1 in flight): the same sums in the
            // same order.
            for pace in [(0, 0), (2, 2), (3, 3)] {
                set_stream_pace(Some(pace));
                assert_eq!(bits(&run(&dm)), bits(&got), "top-{k} {rows} rows, stage cap {cap:?}, pace {pace:?}: differs from the default ring");
            }
            set_stream_pace(None);
        }
        // 4-row stages: the same sums in the same order, so the same bits.
        set_stream_rows_cap(Some((32, 4)));
        assert_eq!(bits(&run(&dm)), bits(&got), "top-{k} {rows} rows: 4-row stages differ from 8-row ones");
        set_stream_rows_cap(None);
        // The lookup decode: the same integer dot products, so the same bits.
        set_stream_lookup(Some(true));
        for cap in [None, Some(2)] {
            set_stream_stage_cap(cap);
            assert_eq!(bits(&run(&dm)), bits(&got), "top-{k} {rows} rows, stage cap {cap:?}: the lookup decode differs from the sign decode");
        }
        set_stream_lookup(None);
        set_stream_stage_cap(None);
        // The next RMSNorm in the last block: the same residual bits, and q8 bit-identical to
        // norm_q8 on them; the arrival counter back at zero; both trigger points; twice each.
        if rows % 32 == 0 {
            let nw = rng.vec(rows, 1.0);
            let nwb = g.upload(&nw).unwrap();
            let eps = 1e-6f32;
            let hr = g.upload(&got).unwrap();
            let rq = g.upload(&vec![0x55i8; nt * rows]).unwrap();
            let rd = poisoned(&g, nt * rows / 32);
            g.norm_q8(g.ptr(&hr), rows + 1, g.ptr(&nwb), rows, eps, 0, 0, g.ptr(&rq), g.ptr(&rd), nt).unwrap();
            let (want_q, want_d) = (g.download(&rq).unwrap(), g.download(&rd).unwrap());
            assert!(want_d.iter().all(|d| d.is_finite() && *d > 0.0), "norm_q8 reference scales");
            let cnt = g.zeros::<u32>(1).unwrap();
            for trig_late in [true, false] {
                for rep in 0..2 {
                    let hb = g.upload(&hid0).unwrap();
                    let q = g.upload(&vec![0x55i8; nt * rows]).unwrap();
                    let d = poisoned(&g, nt * rows / 32);
                    let n = NextNorm { weight: g.ptr(&nwb), eps, q: g.ptr(&q), d: g.ptr(&d), cnt: g.ptr(&cnt), trig_late, ss8: 0 };
                    assert!(g.try_down_stream_norm(&dm, g.ptr(&ib), g.ptr(&wb), k, nt, g.ptr(&aq), g.ptr(&ad), g.ptr(&hb), rows + 1, Some(&n)).unwrap(), "the fused-norm down must launch");
                    g.sync().unwrap();
                    let what = format!("top-{k} {rows} rows, fused norm (late trigger {trig_late}, rep {rep})");
                    assert_eq!(bits(&g.download(&hb).unwrap()), bits(&got), "{what}: residual differs");
                    assert_eq!(g.download(&q).unwrap(), want_q, "{what}: q8 values differ from norm_q8");
                    assert_eq!(bits(&g.download(&d).unwrap()), bits(&want_d), "{what}: q8 scales differ from norm_q8");
                    assert_eq!(g.download(&cnt).unwrap(), vec![0u32], "{what}: arrival counter not reset");
                }
            }
            eprintln!("streamed down {nt} tokens x top-{k}, {rows} rows + next RMSNorm in the last block: residual and q8 bit-identical to the down + norm_q8");
        }
        // The x8 hand-over (no meeting of the blocks): the same residual bits; per 8-row group
        // the q8 of u = h * nw with scale max|u| / 127 and the sum of h^2 in the kernel's
        // butterfly order, recomputed here in f32 from the residual, bit for bit. Counter untouched.
        if rows % 8 == 0 {
            let nw = rng.vec(rows, 1.0);
            let nwb = g.upload(&nw).unwrap();
            let ng = rows / 8;
            let (mut want_q, mut want_d, mut want_s) = (vec![0i8; nt * rows], vec![0f32; nt * ng], vec![0f32; nt * ng]);
            for t in 0..nt {
                for gi in 0..ng {
                    let h: Vec<f32> = (0..8).map(|l| got[t * (rows + 1) + 8 * gi + l]).collect();
                    let u: Vec<f32> = (0..8).map(|l| h[l] * nw[8 * gi + l]).collect();
                    let am = u.iter().fold(0f32, |m, v| m.max(v.abs()));
                    let dq = am / 127.0;
                    for l in 0..8 {
                        want_q[t * rows + 8 * gi + l] = if am == 0.0 { 0 } else { (u[l] / dq).round_ties_even() as i32 as i8 };
                    }
                    let sq: Vec<f32> = h.iter().map(|v| v * v).collect();
                    let a: Vec<f32> = (0..8).map(|l| sq[l] + sq[l ^ 4]).collect();
                    let b: Vec<f32> = (0..8).map(|l| a[l] + a[l ^ 2]).collect();
                    want_d[t * ng + gi] = dq;
                    want_s[t * ng + gi] = b[0] + b[1];
                }
            }
            let cnt = g.upload(&[7u32]).unwrap();
            for rep in 0..2 {
                let hb = g.upload(&hid0).unwrap();
                let q = g.upload(&vec![0x55i8; nt * rows]).unwrap();
                let (d, ss) = (poisoned(&g, nt * ng), poisoned(&g, nt * ng));
                let n = NextNorm { weight: g.ptr(&nwb), eps: 1e-6, q: g.ptr(&q), d: g.ptr(&d), cnt: g.ptr(&cnt), trig_late: false, ss8: g.ptr(&ss) };
                assert!(g.try_down_stream_norm(&dm, g.ptr(&ib), g.ptr(&wb), k, nt, g.ptr(&aq), g.ptr(&ad), g.ptr(&hb), rows + 1, Some(&n)).unwrap(), "the x8 down must launch");
                g.sync().unwrap();
                let what = format!("top-{k} {rows} rows, x8 hand-over (rep {rep})");
                assert_eq!(bits(&g.download(&hb).unwrap()), bits(&got), "{what}: residual differs");
                assert_eq!(g.download(&q).unwrap(), want_q, "{what}: q8 codes");
                assert_eq!(bits(&g.download(&d).unwrap()), bits(&want_d), "{what}: group scales");
                assert_eq!(bits(&g.download(&ss).unwrap()), bits(&want_s), "{what}: group sums of squares");
                assert_eq!(g.download(&cnt).unwrap(), vec![7u32], "{what}: the arrival counter was touched");
            }
            eprintln!("streamed down {nt} tokens x top-{k}, {rows} rows, x8 hand-over: residual bit-identical, q8 codes / scales / sums of squares equal to their f32 recomputation");
        }
        eprintln!("streamed combining down {nt} tokens x top-{k} of {e}, {ff} -> {rows}: every row within {worst:.2e} of f64 (relative to the sum of |terms|), deterministic");
    }
}

/// What the streamed kernels do not take is refused with an error naming the kernel (never a
/// wrong result): inputs of more than 96 units a lane round, top-k above 8, down rows of more
/// than 48 units.
#[test]
#[ignore = "needs a CUDA GPU"]
fn streamed_kernels_refuse_shapes_they_do_not_fit() {
    let _s = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let g: Gpu = gpu();
    let mut rng = Rng(0x5eed_0fa5_7000_0104);
    let wide = random_rows(&mut rng, TY, 2 * 64, 3584);
    let (_w, wm) = upload_mat(&g, TY, &wide, 64, 3584, 2);
    assert!(g.gate_up_stream_plan(&wm, &wm).unwrap().is_none());
    let e = g.moe_gate_up_stream(&wm, &wm, 0, 1, 1, 0, 0, 0, 0, 64).unwrap_err();
    assert!(e.to_string().contains("moe_gate_up_stream"), "{e}");
    let dn = random_rows(&mut rng, TY, 2 * 64, 1536);
    let (_d, dm) = upload_mat(&g, TY, &dn, 64, 1536, 2);
    assert!(g.down_stream_plan(&dm, 8).unwrap().is_some());
    assert!(g.down_stream_plan(&dm, 9).unwrap().is_none());
    let e = g.moe_down_stream(&dm, 0, 0, 9, 1, 0, 0, 0, 64).unwrap_err();
    assert!(e.to_string().contains("moe_down_stream"), "{e}");
    let wide_dn = random_rows(&mut rng, TY, 2 * 64, 2048);
    let (_x, xm) = upload_mat(&g, TY, &wide_dn, 64, 2048, 2);
    assert!(g.down_stream_plan(&xm, 1).unwrap().is_none(), "rows of 64 units: two rows exceed one lane round");
}

/// Launch times at M2.7's expert shapes (not a pass/fail benchmark: it prints a table; the
/// figures that count come from minimax-bench): the register kernels, the streamed ones at
/// every stage shape with ring caps 8 and 2, and the probes (the ring without the arithmetic).
/// 64 experts, the ids rotating over 8 disjoint sets of 8 so that no launch finds its weights in
/// L2 (7.5 MB an expert). One token, top-8.
#[test]
#[ignore = "needs a CUDA GPU"]
fn streamed_kernels_speed() {
    use minimax_rank::cuda::stream::set_stream_probe;
        let _s = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let g = gpu();
    let mut rng = Rng(0x5eed_0fa5_7000_0105);
    let (e, k, h, ff) = (64usize, 8usize, 3072usize, 1536usize);
    let ex = random_experts(&g, &mut rng, TY, e, ff, h, h);
    let (gm, um, dm) = (ex.gm, ex.um, ex.dm);
    let sets: Vec<_> = (0..8).map(|s| g.upload(&(0..8).map(|j| s * 8 + j).collect::<Vec<_>>()).unwrap()).collect();
    let (hq, hd) = q8_host(&rng.vec(h, 2.0));
    let (xq, xd) = (g.upload(&hq).unwrap(), g.upload(&hd).unwrap());
    let (aqh, adh) = q8_host(&rng.vec(k * ff, 2.0));
    let (aq, ad) = (g.upload(&aqh).unwrap(), g.upload(&adh).unwrap());
    let oq = g.zeros::<i8>(k * ff).unwrap();
    let od = g.zeros::<f32>(k * ff / 32).unwrap();
    let wb = g.upload(&rng.vec(k, 0.5)).unwrap();
    let hid = g.zeros::<f32>(h).unwrap();
    let time = |f: &dyn Fn(usize)| launch_us(&g, 8, 64, f);
    // The rows below are unpaced unless they say "in flight".
    set_stream_pace(Some((0, 0)));
    let gu_bytes = (k * 2 * ff * gm.row_bytes) as f64;
    let dn_bytes = (k * h * dm.row_bytes) as f64;
    let mut lines = Vec::new();
    let mut row = |name: &str, us: f64, bytes: f64| lines.push(format!("{name:<48} {us:>8.1} us {:>7.2} TB/s", bytes / us / 1e6));
    let gu_reg = |i: usize| g.moe_gate_up_q8_with(GateUpKind::PersistIl, &gm, &um, g.ptr(&sets[i % 8]), k, g.ptr(&xq), g.ptr(&xd), g.ptr(&oq), g.ptr(&od), k, ff).unwrap();
    let gu_st = |i: usize| g.moe_gate_up_stream(&gm, &um, g.ptr(&sets[i % 8]), k, k, g.ptr(&xq), g.ptr(&xd), g.ptr(&oq), g.ptr(&od), ff).unwrap();
    let dn_reg = |i: usize| g.moe_down_q8_with(fast::DownKind::Reg4Pre, &dm, g.ptr(&sets[i % 8]), g.ptr(&wb), k, g.ptr(&aq), g.ptr(&ad), g.ptr(&hid), h, 1).unwrap();
    let dn_st = |i: usize| g.moe_down_stream(&dm, g.ptr(&sets[i % 8]), g.ptr(&wb), k, 1, g.ptr(&aq), g.ptr(&ad), g.ptr(&hid), h).unwrap();
    row("gate/up psx", time(&gu_reg), gu_bytes);
    for rows in [32usize, 16, 8] {
        set_stream_rows_cap(Some((rows, 8)));
        set_stream_stage_cap(None);
        let (sr, nmax) = g.gate_up_stream_plan(&gm, &um).unwrap().unwrap();
        for cap in [8usize, 2] {
            set_stream_stage_cap(Some(cap));
            row(&format!("gate/up streamed, {sr}+{sr} rows x {} stages", cap.min(nmax)), time(&gu_st), gu_bytes);
            set_stream_lookup(Some(true));
            row(&format!("gate/up streamed, lookup decode, {} stages", cap.min(nmax)), time(&gu_st), gu_bytes);
            set_stream_lookup(None);
            set_stream_probe(true);
            row(&format!("gate/up probe (no arithmetic), {} stages", cap.min(nmax)), time(&gu_st), gu_bytes);
            set_stream_probe(false);
            for pace in 1..cap.min(nmax) {
                set_stream_pace(Some((pace, 0)));
                row(&format!("gate/up streamed, {} stages, <= {pace} in flight", cap.min(nmax)), time(&gu_st), gu_bytes);
                set_stream_pace(Some((0, 0)));
            }
        }
    }
    row("down rx4", time(&dn_reg), dn_bytes);
    for rows in [8usize, 4] {
        set_stream_rows_cap(Some((32, rows)));
        set_stream_stage_cap(None);
        for cap in [8usize, 2] {
            set_stream_stage_cap(Some(cap));
            let (rs, nmax) = g.down_stream_plan(&dm, k).unwrap().unwrap();
            row(&format!("down streamed, {rs} rows x {k} experts x {} stages", cap.min(nmax)), time(&dn_st), dn_bytes);
            set_stream_lookup(Some(true));
            row(&format!("down streamed, lookup decode, {} stages", cap.min(nmax)), time(&dn_st), dn_bytes);
            set_stream_lookup(None);
            set_stream_probe(true);
            row(&format!("down probe, {} stages", cap.min(nmax)), time(&dn_st), dn_bytes);
            set_stream_probe(false);
            for pace in 1..cap.min(nmax) {
                set_stream_pace(Some((0, pace)));
                row(&format!("down streamed, {} stages, <= {pace} in flight", cap.min(nmax)), time(&dn_st), dn_bytes);
                set_stream_pace(Some((0, 0)));
            }
        }
    }
    set_stream_stage_cap(None);
    set_stream_rows_cap(None);
    set_stream_pace(None);
    eprintln!("streamed expert kernels, M2.7 shapes, 1 token x top-8 (per launch, weight bytes / time):\n{}", lines.join("\n"));
}

/// `moe_group`'s slots of `ids` (`np` pairs over `e` experts) on the device.
fn group(g: &Gpu, ids: &cudarc::driver::CudaSlice<i32>, np: usize, e: usize) -> cudarc::driver::CudaSlice<i32> {
    let grp = g.zeros::<i32>(1 + 3 * e + np).unwrap();
    g.fill_u32(g.ptr(&grp), 1 + 3 * e + np, u32::MAX).unwrap();
    g.moe_group(g.ptr(ids), np, e, g.ptr(&grp)).unwrap();
    grp
}

/// The grouped streamed kernels (kernels/gstream.cu) against f64 products of the dequantized
/// weights and against the grouped register kernels (`grpf`): gate/up q8 outputs of every pair
/// at sampled rows within q8 rounding of f64 and within one code of grpf, the pad past the
/// rows untouched; every down output (every pair, every row) within 1e-5 of the sum of |terms|;
/// bit-identical from run to run, with 2 ring stages, and with the down's early start. Shapes:
/// 32 tokens x top-8 of 12 experts, expert 0 in every token (a slot of 32 pairs: 8 chunks of 4),
/// M2.7's widths (3072 -> 1536 -> 1024 rows); 4 tokens x top-8 of 64 (slots of 1-4 pairs, M2.7's
/// down of 3072 rows); a tensor-parallel slice (768 gate/up rows, activations 1024 apart: the
/// down's input padded to whole 272-byte chunks: 32 units, 2 a consumer warp).
#[test]
#[ignore = "needs a CUDA GPU"]
fn grouped_streamed_moe_matches_f64() {
    use minimax_rank::cuda::gstream::set_gstream;
    let _s = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let g = gpu();
    let mut rng = Rng(0x5eed_0fa5_7000_0106);
    for &(e, k, nt, h, ff, hrows, pad) in &[(12usize, 8usize, 32usize, 3072usize, 1536usize, 1024usize, 0usize), (64, 8, 4, 3072, 1536, 3072, 0), (8, 2, 3, 3072, 768, 3072, 256)] {
        let ld = ff + pad;
        let np = nt * k;
        let gate = random_rows(&mut rng, TY, e * ff, h);
        let upw = random_rows(&mut rng, TY, e * ff, h);
        let (_g1, gm) = upload_mat(&g, TY, &gate, ff, h, e);
        let (_g2, um) = upload_mat(&g, TY, &upw, ff, h, e);
        assert!(g.gate_up_gstream_plan(&gm, &um).unwrap().is_some(), "{h} -> {ff}: the grouped streamed gate/up must fit");
        let ids = routed(&mut rng, nt, k, e);
        let ib = g.upload(&ids).unwrap();
        let grp = group(&g, &ib, np, e);
        let nslots = np.min(e);
        let (hq, hd) = q8_host(&rng.vec(nt * h, 2.0));
        let xv = q8_deq(&hq, &hd);
        let (qb, db) = (g.upload(&hq).unwrap(), g.upload(&hd).unwrap());
        let gate_up = |streamed: bool| {
            let aq = g.zeros::<i8>(np * ld).unwrap();
            g.fill_u32(g.ptr(&aq), np * ld / 4, 0x7f7f_7f7f).unwrap();
            let ad = poisoned(&g, np * ld / 32);
            if streamed {
                g.moe_gate_up_gstream(&gm, &um, g.ptr(&grp), e, k, g.ptr(&qb), g.ptr(&db), g.ptr(&aq), g.ptr(&ad), ld).unwrap();
            } else {
                set_gstream(Some(false));
                g.moe_gate_up_grp(&gm, &um, g.ptr(&grp), e, nslots, k, g.ptr(&qb), g.ptr(&db), g.ptr(&aq), g.ptr(&ad), ld).unwrap();
                set_gstream(None);
            }
            g.sync().unwrap();
            (g.download(&aq).unwrap(), g.download(&ad).unwrap())
        };
        let (c, s) = gate_up(true);
        let (rc, rs) = gate_up(false);
        let mut worst_code = 0i32;
        for p in 0..np {
            assert!(c[p * ld + ff..(p + 1) * ld].iter().all(|&q| q == 0x7f), "pair {p}: the pad was written");
            for r in 0..ff {
                let (a, b) = (c[p * ld + r] as f32 * s[p * ld / 32 + r / 32], rc[p * ld + r] as f32 * rs[p * ld / 32 + r / 32]);
                let sc = s[p * ld / 32 + r / 32];
                assert!(a.is_finite() && (a - b).abs() <= 1.01 * sc + 1e-6, "pair {p} row {r}: streamed {a} vs grpf {b} (q8 step {sc})");
                worst_code = worst_code.max((c[p * ld + r] as i32 - rc[p * ld + r] as i32).abs());
            }
            let (exp, t) = (ids[p] as usize, p / k);
            let xt = &xv[t * h..(t + 1) * h];
            for r in [0, 1, 31, 32, ff / 2 + 3, ff - 1, rng.below(ff)] {
                let (gg, uu) = (dot(&deq_row(&gate, exp, ff, r, h), xt).0, dot(&deq_row(&upw, exp, ff, r, h), xt).0);
                let want = (gg / (1.0 + (-gg).exp()) * uu) as f32;
                let sc = s[p * ld / 32 + r / 32];
                let got = c[p * ld + r] as f32 * sc;
                let tol = sc * 0.51 + 1e-4 * want.abs() + 1e-6;
                assert!((got - want).abs() <= tol, "pair {p} row {r}: got {got} want {want} tol {tol}");
            }
        }
        for cap in [None, Some(2)] {
            set_stream_stage_cap(cap);
            for pace in [None, Some((0, 0)), Some((1, 1)), Some((3, 3))] {
                set_gstream_pace(pace);
                let again = gate_up(true);
                assert!(again.0 == c && bits(&again.1) == bits(&s), "{h} -> {ff}, stage cap {cap:?}, pace {pace:?}: gate/up not deterministic");
            }
            set_gstream_pace(None);
        }
        set_stream_stage_cap(None);
        // The down over `ld` columns (the forward's dn.cols: a tensor-parallel slice padded to
        // whole 272-byte chunks), on q8 activations of its own.
        let dn = random_rows(&mut rng, TY, e * hrows, ld);
        let (_dnb, dm) = upload_mat(&g, TY, &dn, hrows, ld, e);
        assert!(g.down_gstream_plan(&dm).unwrap().is_some(), "{ld} -> {hrows}: the grouped streamed down must fit");
        let (aqh, adh) = q8_host(&rng.vec(np * ld, 2.0));
        let av = q8_deq(&aqh, &adh);
        let (aq, ad) = (g.upload(&aqh).unwrap(), g.upload(&adh).unwrap());
        let down = |early: bool| {
            let dpart = poisoned(&g, np * hrows);
            g.moe_down_gstream(&dm, g.ptr(&grp), e, g.ptr(&aq), g.ptr(&ad), g.ptr(&dpart), early).unwrap();
            g.sync().unwrap();
            g.download(&dpart).unwrap()
        };
        let got = down(false);
        let mut worst = 0f64;
        for p in 0..np {
            let a = &av[p * ld..(p + 1) * ld];
            for r in 0..hrows {
                let (want, abs) = dot(&deq_row(&dn, ids[p] as usize, hrows, r, ld), a);
                let gv = got[p * hrows + r] as f64;
                assert!(gv.is_finite() && (gv - want).abs() <= 1e-5 * abs + 1e-6, "down pair {p} row {r}: got {gv} want {want}");
                worst = worst.max((gv - want).abs() / (abs + 1e-6));
            }
        }
        for cap in [None, Some(2)] {
            set_stream_stage_cap(cap);
            assert_eq!(bits(&down(false)), bits(&got), "{ff} -> {hrows}, stage cap {cap:?}: down not deterministic");
            assert_eq!(bits(&down(true)), bits(&got), "{ff} -> {hrows}, stage cap {cap:?}: the early start changed the down");
            for pace in [(0, 0), (1, 1), (3, 3)] {
                set_gstream_pace(Some(pace));
                assert_eq!(bits(&down(false)), bits(&got), "{ff} -> {hrows}, stage cap {cap:?}, pace {pace:?}: the paced down differs");
                assert_eq!(bits(&down(true)), bits(&got), "{ff} -> {hrows}, stage cap {cap:?}, pace {pace:?}: the paced early down differs");
            }
            set_gstream_pace(None);
        }
        set_stream_stage_cap(None);
        eprintln!("grouped streamed {nt} tokens x top-{k} of {e} ({h} -> {ff} -> {hrows}): gate/up within q8 rounding of f64, at most {worst_code} code from grpf; down within {worst:.2e} of f64; deterministic");
    }
}

/// Shapes the grouped streamed kernels do not take are refused with an error naming the kernel:
/// rows not a multiple of the stage (43 down rows), inputs of more than 96 units (3584 columns).
#[test]
#[ignore = "needs a CUDA GPU"]
fn grouped_streamed_kernels_refuse_shapes_they_do_not_fit() {
    let _s = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let g: Gpu = gpu();
    let mut rng = Rng(0x5eed_0fa5_7000_0107);
    let wide = random_rows(&mut rng, TY, 2 * 64, 3584);
    let (_w, wm) = upload_mat(&g, TY, &wide, 64, 3584, 2);
    assert!(g.gate_up_gstream_plan(&wm, &wm).unwrap().is_none());
    let e = g.moe_gate_up_gstream(&wm, &wm, 0, 2, 1, 0, 0, 0, 0, 64).unwrap_err();
    assert!(e.to_string().contains("moe_gate_up_gstream"), "{e}");
    let odd = random_rows(&mut rng, TY, 2 * 43, 1536);
    let (_o, om) = upload_mat(&g, TY, &odd, 43, 1536, 2);
    assert!(g.down_gstream_plan(&om).unwrap().is_none());
    let e = g.moe_down_gstream(&om, 0, 2, 0, 0, 0, false).unwrap_err();
    assert!(e.to_string().contains("moe_down_gstream"), "{e}");
    let ok = random_rows(&mut rng, TY, 2 * 64, 1536);
    let (_k, km) = upload_mat(&g, TY, &ok, 64, 1536, 2);
    assert!(g.down_gstream_plan(&km).unwrap().is_some(), "64 rows of 1536 columns fit");
}

/// Launch times of the grouped expert kernels at M2.7's shapes for 32 tokens x top-8 over 160
/// experts (~130 of them chosen, 1-2 pairs a slot as in served decoding; not a pass/fail
/// benchmark: it prints a table, the figures that count come from minimax-bench): grpf against
/// the grouped streamed kernels and their probes (the ring, the hand-over and the epilogue
/// without the consumers' arithmetic), 4 routings in turn.
#[test]
#[ignore = "needs a CUDA GPU"]
fn grouped_streamed_speed() {
    use minimax_rank::cuda::gstream::set_gstream;
        let _s = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let g = gpu();
    let mut rng = Rng(0x5eed_0fa5_7000_0108);
    let (e, k, nt, h, ff) = (160usize, 8usize, 32usize, 3072usize, 1536usize);
    let np = nt * k;
    let ex = random_experts(&g, &mut rng, TY, e, ff, h, h);
    let (gm, um, dm) = (ex.gm, ex.um, ex.dm);
    let mut grps = Vec::new();
    let mut used = 0usize;
    for _ in 0..4 {
        let mut ids = Vec::new();
        for _ in 0..nt {
            let mut row: Vec<i32> = Vec::new();
            while row.len() < k {
                let x = rng.below(e) as i32;
                if !row.contains(&x) {
                    row.push(x);
                }
            }
            ids.extend(row);
        }
        let mut s = ids.clone();
        s.sort();
        s.dedup();
        used += s.len();
        let ib = g.upload(&ids).unwrap();
        grps.push((group(&g, &ib, np, e), ib));
    }
    let used = used as f64 / 4.0;
    let (hq, hd) = q8_host(&rng.vec(nt * h, 2.0));
    let (xq, xd) = (g.upload(&hq).unwrap(), g.upload(&hd).unwrap());
    let (aqh, adh) = q8_host(&rng.vec(np * ff, 2.0));
    let (aq, ad) = (g.upload(&aqh).unwrap(), g.upload(&adh).unwrap());
    let oq = g.zeros::<i8>(np * ff).unwrap();
    let od = g.zeros::<f32>(np * ff / 32).unwrap();
    let dpart = g.zeros::<f32>(np * h).unwrap();
    let time = |f: &dyn Fn(usize)| launch_us(&g, 4, 32, f);
    let gu_bytes = used * (2 * ff * gm.row_bytes) as f64;
    let dn_bytes = used * (h * dm.row_bytes) as f64;
    let mut lines = Vec::new();
    for (on, pr) in [(false, false), (true, false), (true, true), (false, false), (true, false)] {
        set_gstream(Some(on));
        minimax_rank::cuda::stream::set_stream_probe(pr);
        let name = match (on, pr) {
            (false, _) => "grpf",
            (true, false) => "grouped streamed",
            (true, true) => "probe (no arithmetic)",
        };
        let gu = time(&|i| g.moe_gate_up_grp(&gm, &um, g.ptr(&grps[i % 4].0), e, np.min(e), k, g.ptr(&xq), g.ptr(&xd), g.ptr(&oq), g.ptr(&od), ff).unwrap());
        let dn = time(&|i| g.moe_down_grp(&dm, g.ptr(&grps[i % 4].0), e, np.min(e), g.ptr(&aq), g.ptr(&ad), g.ptr(&dpart)).unwrap());
        lines.push(format!("{name:<18} gate/up {gu:>7.1} us {:>5.2} TB/s   down {dn:>7.1} us {:>5.2} TB/s", gu_bytes / gu / 1e6, dn_bytes / dn / 1e6));
    }
    set_gstream(None);
    minimax_rank::cuda::stream::set_stream_probe(false);
    eprintln!("grouped expert kernels, M2.7 shapes, {nt} tokens x top-{k} over {e} experts ({used:.0} chosen on average), per launch:\n{}", lines.join("\n"));
}
