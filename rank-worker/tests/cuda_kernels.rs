//! Every CUDA kernel against its CPU twin on random inputs: outputs are poisoned with NaN
//! before each launch (an unwritten element fails), NaN never passes, and sizes are chosen
//! not to be multiples of the kernels' tiles. Needs a GPU: run with `--ignored`
//! (tools/gpu/run_tests.sh does).
#![cfg(feature = "cuda")]

mod common;

use common::gpu::{Rng, TYPES, bits, gpu, launch_us, poisoned, q8_deq, q8_host, random_experts, random_rows, routed, upload_mat};
use minimax_rank::cuda::fast::{self, DownKind, GateUpKind, MvqKind, Mvmma};
use cudarc::driver::CudaSlice;
use minimax_rank::cuda::{AttnArgs, DevMat, Gpu, KvDtype};
use minimax_shared::model::GatingFunc;
use minimax_shared::quant::{self, GgmlType};

fn cols_for(ty: GgmlType) -> usize {
    match ty.block_elems() {
        1 => 1000,
        32 => 32 * 37,
        _ => 256 * 3,
    }
}

/// |got - want| <= tol[i] for every element, and nothing is NaN.
fn check(what: &str, got: &[f32], want: &[f32], tol: impl Fn(usize) -> f32) -> f32 {
    assert_eq!(got.len(), want.len(), "{what}: length");
    let mut worst = 0f32;
    for i in 0..got.len() {
        let d = (got[i] - want[i]).abs();
        assert!(got[i].is_finite() && d <= tol(i), "{what}[{i}]: got {} want {} (tol {})", got[i], want[i], tol(i));
        worst = worst.max(d);
    }
    worst
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn dequant_rows_is_bit_exact_for_every_type() {
    let g = gpu();
    let mut rng = Rng(0x1234_5678_9abc_def1);
    for ty in TYPES {
        let (rows, cols) = (37, cols_for(ty));
        let bytes = random_rows(&mut rng, ty, rows, cols);
        let (_b, m) = upload_mat(&g, ty, &bytes, rows, cols, 0);
        let ids: Vec<i32> = (0..rows as i32).rev().collect();
        let idb = g.upload(&ids).unwrap();
        let out = poisoned(&g, rows * cols);
        g.dequant_rows(&m, g.ptr(&idb), rows, g.ptr(&out), cols).unwrap();
        let got = g.download(&out).unwrap();
        g.sync().unwrap();
        let rb = m.row_bytes;
        for (i, &r) in ids.iter().enumerate() {
            let r = r as usize;
            let want = quant::dequantize_to_vec(ty, &bytes[r * rb..(r + 1) * rb], cols).unwrap();
            for j in 0..cols {
                let gv = got[i * cols + j];
                assert!(gv.to_bits() == want[j].to_bits(), "{ty} row {r} col {j}: gpu {gv} cpu {}", want[j]);
            }
        }
        eprintln!("dequant {ty:<7} {rows}x{cols}: bit-exact");
    }
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn matvec_matches_cpu_for_every_type_and_batch() {
    let g = gpu();
    let mut rng = Rng(0xfeed_beef_0bad_cafe);
    for ty in TYPES {
        let (rows, cols) = (37, cols_for(ty));
        let bytes = random_rows(&mut rng, ty, rows, cols);
        let (_b, m) = upload_mat(&g, ty, &bytes, rows, cols, 0);
        let deq = quant::dequantize_to_vec(ty, &bytes, rows * cols).unwrap();
        for nvec in [1usize, 3, 8, 13] {
            for acc in [false, true] {
                let xs = cols + 4; // a row stride that is not the width
                let x = rng.vec(nvec * xs, 1.0);
                let ys = rows + 3;
                let y0 = rng.vec(nvec * ys, 1.0);
                let xb = g.upload(&x).unwrap();
                let yb = if acc { g.upload(&y0).unwrap() } else { poisoned(&g, nvec * ys) };
                g.matvec(&m, g.ptr(&xb), xs, g.ptr(&yb), ys, nvec, acc).unwrap();
                let got = g.download(&yb).unwrap();
                let mut want = vec![0f32; nvec * ys];
                let mut scale = vec![0f32; nvec * ys];
                for v in 0..nvec {
                    let xv = &x[v * xs..v * xs + cols];
                    let mut yv = vec![0f32; rows];
                    quant::matvec(ty, &bytes, rows, cols, xv, &mut yv).unwrap();
                    for r in 0..rows {
                        let i = v * ys + r;
                        want[i] = if acc { y0[i] + yv[r] } else { yv[r] };
                        scale[i] = deq[r * cols..(r + 1) * cols].iter().zip(xv).map(|(a, b)| (a * b).abs()).sum::<f32>() + y0[i].abs();
                    }
                    // Padding between rows is untouched: poisoned stays NaN, accumulated stays y0.
                    for r in rows..ys {
                        let i = v * ys + r;
                        if acc {
                            assert_eq!(got[i], y0[i], "{ty}: wrote past the rows");
                        } else {
                            assert!(got[i].is_nan(), "{ty}: wrote past the rows");
                        }
                        want[i] = got[i];
                    }
                }
                let gw: Vec<f32> = (0..nvec).flat_map(|v| got[v * ys..v * ys + rows].to_vec()).collect();
                let ww: Vec<f32> = (0..nvec).flat_map(|v| want[v * ys..v * ys + rows].to_vec()).collect();
                let sw: Vec<f32> = (0..nvec).flat_map(|v| scale[v * ys..v * ys + rows].to_vec()).collect();
                let worst = check(&format!("matvec {ty} nvec {nvec} acc {acc}"), &gw, &ww, |i| 2e-6 * sw[i] + 1e-30);
                if nvec == 13 && acc {
                    eprintln!("matvec  {ty:<7} {rows}x{cols} nvec<=13: max |diff| {worst:.2e}");
                }
            }
        }
    }
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn expert_matvec_matches_cpu_for_every_type() {
    let g = gpu();
    let mut rng = Rng(0x0dd_ba11_5eed);
    for ty in TYPES {
        let (n_exp, rows, cols, k, nt) = (5usize, 21usize, cols_for(ty), 3usize, 7usize);
        let bytes = random_rows(&mut rng, ty, n_exp * rows, cols);
        let (_b, m) = upload_mat(&g, ty, &bytes, rows, cols, n_exp);
        let ids: Vec<i32> = (0..nt * k).map(|_| rng.below(n_exp) as i32).collect();
        let x = rng.vec(nt * cols, 1.0);
        let (idb, xb) = (g.upload(&ids).unwrap(), g.upload(&x).unwrap());
        let yb = poisoned(&g, nt * k * rows);
        g.matvec_experts(&m, g.ptr(&idb), g.ptr(&xb), cols, k, g.ptr(&yb), rows, nt * k).unwrap();
        let got = g.download(&yb).unwrap();
        let mut want = vec![0f32; nt * k * rows];
        let eb = rows * m.row_bytes;
        for p in 0..nt * k {
            let e = ids[p] as usize;
            let t = p / k;
            quant::matvec(ty, &bytes[e * eb..(e + 1) * eb], rows, cols, &x[t * cols..(t + 1) * cols], &mut want[p * rows..(p + 1) * rows]).unwrap();
        }
        let worst = check(&format!("expert matvec {ty}"), &got, &want, |i| 1e-4 * (1.0 + want[i].abs()));
        eprintln!("experts {ty:<7} {n_exp}x{rows}x{cols}, {} pairs: max |diff| {worst:.2e}", nt * k);
    }
}

fn rms_norm_ref(x: &[f32], w: &[f32], eps: f32) -> Vec<f32> {
    let ss: f64 = x.iter().map(|&v| v as f64 * v as f64).sum();
    let inv = 1.0 / ((ss / x.len() as f64) as f32 + eps).sqrt();
    x.iter().zip(w).map(|(&v, &wi)| v * inv * wi).collect()
}

fn rope_ref(x: &mut [f32], hd: usize, rot: usize, pos: usize, theta: f32) {
    let half = rot / 2;
    for head in x.chunks_exact_mut(hd) {
        for i in 0..half {
            let inv = 1.0 / (theta as f64).powf(2.0 * i as f64 / rot as f64);
            let a = pos as f64 * inv;
            let (c, s) = (a.cos() as f32, a.sin() as f32);
            let (p, q) = (head[i], head[i + half]);
            head[i] = p * c - q * s;
            head[i + half] = q * c + p * s;
        }
    }
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn rms_norm_and_partial_rope_match_cpu() {
    let g = gpu();
    let mut rng = Rng(42);
    // Full-width q norm (6 heads of 32 = 192 wide), a 3072-wide hidden norm, M2.7's q norm
    // (6144) and the largest float4 width (8192) on `rms_norm_v4`; widths that are not a
    // multiple of 4 or past 8192 on the scalar kernel.
    for (n, nrows) in [(192usize, 5usize), (3072, 3), (1000, 2), (6144, 3), (8192, 2), (1002, 2), (8196, 2)] {
        let x = rng.vec(nrows * n, 3.0);
        let w = rng.vec(n, 1.0);
        let (xb, wb) = (g.upload(&x).unwrap(), g.upload(&w).unwrap());
        let yb = poisoned(&g, nrows * n);
        g.profile_begin();
        g.rms_norm(g.ptr(&xb), n, g.ptr(&wb), g.ptr(&yb), n, nrows, n, 1e-5).unwrap();
        let prof = g.profile_end().unwrap();
        let want_kernel = if n % 4 == 0 && n <= 8192 { "rms_norm_v4" } else { "rms_norm" };
        assert!(prof.iter().map(|(k, _)| k.as_str()).eq([want_kernel]), "rms_norm {n}: launched {prof:?}");
        let got = g.download(&yb).unwrap();
        let want: Vec<f32> = x.chunks(n).flat_map(|r| rms_norm_ref(r, &w, 1e-5)).collect();
        let worst = check(&format!("rms_norm {n}"), &got, &want, |i| 2e-6 * (1.0 + want[i].abs()));
        eprintln!("rms_norm width {n} ({want_kernel}): max |diff| {worst:.2e}");
    }
    for (heads, hd, rot, theta) in [(6usize, 32usize, 24usize, 12345.0f32), (4, 64, 32, 50000.0), (48, 128, 64, 5e6)] {
        let nrows = 5;
        let w = heads * hd;
        let x = rng.vec(nrows * w, 2.0);
        let pos: Vec<i32> = vec![0, 1, 17, 300, 40_000];
        let (xb, pb) = (g.upload(&x).unwrap(), g.upload(&pos).unwrap());
        g.rope(g.ptr(&xb), w, nrows, heads, hd, rot, g.ptr(&pb), theta).unwrap();
        let got = g.download(&xb).unwrap();
        let mut want = x.clone();
        for r in 0..nrows {
            rope_ref(&mut want[r * w..(r + 1) * w], hd, rot, pos[r] as usize, theta);
        }
        let worst = check(&format!("rope {heads}x{hd}/{rot}"), &got, &want, |i| 1e-5 * (1.0 + want[i].abs()));
        eprintln!("rope {heads}x{hd} rot {rot}: max |diff| {worst:.2e}");
    }
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn router_matches_cpu() {
    let g = gpu();
    let mut rng = Rng(7);
    // One top-k launch on host logits and bias into poisoned outputs: (ids, weights).
    let route = |fast: bool, logits: &[f32], bias: &[f32], e: usize, k: usize, nt: usize| -> (Vec<i32>, Vec<f32>) {
        let (lb, bb) = (g.upload(logits).unwrap(), g.upload(bias).unwrap());
        let ids = g.zeros::<i32>(nt * k).unwrap();
        g.fill_u32(g.ptr(&ids), nt * k, u32::MAX).unwrap();
        let wb = poisoned(&g, nt * k);
        if fast {
            g.route_fast(g.ptr(&lb), g.ptr(&bb), e, k, GatingFunc::Sigmoid, g.ptr(&ids), g.ptr(&wb), nt).unwrap();
        } else {
            g.route(g.ptr(&lb), g.ptr(&bb), e, k, GatingFunc::Sigmoid, g.ptr(&ids), g.ptr(&wb), nt).unwrap();
        }
        (g.download(&ids).unwrap(), g.download(&wb).unwrap())
    };
    // Both top-k kernels (moe_route; the fast path's route_topk_select, redux.sync on sm_80+),
    // on random logits and on logits of a few values with no bias (many ties: the lower expert
    // wins).
    for (e, k, nt, ties) in [(20usize, 3usize, 9usize, false), (256, 8, 5, false), (16, 4, 33, false), (256, 8, 7, true), (64, 6, 5, true)] {
        let logits: Vec<f32> = rng.vec(nt * e, 4.0).into_iter().map(|v| if ties { (v * 0.75).round() } else { v }).collect();
        let bias = if ties { vec![0f32; e] } else { rng.vec(e, 0.5) };
        for fast in [false, true] {
            let (gi, gw) = route(fast, &logits, &bias, e, k, nt);
            for t in 0..nt {
                let want = minimax_rank::cpu::route(&logits[t * e..(t + 1) * e], &bias, k, GatingFunc::Sigmoid);
                for j in 0..k {
                    assert_eq!(gi[t * k + j] as usize, want[j].0, "fast {fast} ties {ties}: token {t} slot {j}");
                    let d = (gw[t * k + j] - want[j].1).abs();
                    assert!(gw[t * k + j].is_finite() && d < 1e-6, "fast {fast} ties {ties}: token {t} weight {j}: {} vs {}", gw[t * k + j], want[j].1);
                }
            }
        }
        eprintln!("router top-{k} of {e}, {nt} tokens (ties {ties}): both kernels pick the same experts as the CPU, weights within 1e-6");
    }
    // NaN logits (an overflowed residual) win nowhere: both top-k kernels still store expert
    // ids in range (the expert kernels read by them) and NaN weights, never an id past E.
    let (e, k, nt) = (256usize, 8usize, 3usize);
    let mut logits = rng.vec(nt * e, 4.0);
    for v in &mut logits[e..] {
        *v = f32::NAN;
    }
    let bias = rng.vec(e, 0.5);
    for exact in [true, false] {
        let (gi, gw) = route(!exact, &logits, &bias, e, k, nt);
        let want = minimax_rank::cpu::route(&logits[..e], &bias, k, GatingFunc::Sigmoid);
        for j in 0..k {
            assert_eq!(gi[j] as usize, want[j].0, "exact {exact}: finite token, slot {j}");
        }
        for t in 1..nt {
            for j in 0..k {
                let id = gi[t * k + j];
                assert!((0..e as i32).contains(&id), "exact {exact}: NaN token {t} slot {j}: expert id {id} out of range");
                assert!(gw[t * k + j].is_nan(), "exact {exact}: NaN token {t} slot {j}: weight {} (want NaN)", gw[t * k + j]);
            }
        }
    }
    eprintln!("router top-{k} of {e} on NaN logits: expert ids in range, NaN weights (both kernels)");
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn silu_mul_and_moe_combine_match_cpu() {
    let g = gpu();
    let mut rng = Rng(99);
    let n = 3 * 1537;
    let (a, b) = (rng.vec(n, 6.0), rng.vec(n, 2.0));
    let (ab, bb) = (g.upload(&a).unwrap(), g.upload(&b).unwrap());
    let ob = poisoned(&g, n);
    g.silu_mul(g.ptr(&ab), g.ptr(&bb), g.ptr(&ob), n).unwrap();
    let got = g.download(&ob).unwrap();
    let want: Vec<f32> = a.iter().zip(&b).map(|(&x, &u)| x / (1.0 + (-x).exp()) * u).collect();
    check("silu_mul", &got, &want, |i| 1e-6 * (1.0 + want[i].abs()));
    let (nt, k, h) = (5usize, 3usize, 777usize);
    let hidden = rng.vec(nt * h, 1.0);
    let d = rng.vec(nt * k * h, 1.0);
    let w = rng.vec(nt * k, 1.0);
    let (hb, db, wb) = (g.upload(&hidden).unwrap(), g.upload(&d).unwrap(), g.upload(&w).unwrap());
    g.moe_combine(g.ptr(&hb), g.ptr(&db), g.ptr(&wb), k, h, nt).unwrap();
    let got = g.download(&hb).unwrap();
    let mut want = hidden.clone();
    for t in 0..nt {
        for i in 0..h {
            let mut o = 0f32;
            for j in 0..k {
                o += w[t * k + j] * d[(t * k + j) * h + i];
            }
            want[t * h + i] += o;
        }
    }
    check("moe_combine", &got, &want, |i| 1e-5 * (1.0 + want[i].abs()));
    eprintln!("silu_mul {n}, moe_combine {nt}x{k}x{h}: ok");
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn paged_attention_matches_cpu_for_prefill_and_decode() {
    let g = gpu();
    let mut rng = Rng(2024);
    for dt in [KvDtype::F16, KvDtype::BF16, KvDtype::F32] {
        for (heads, kv_heads, hd, ps) in [(6usize, 2usize, 32usize, 16usize), (4, 2, 64, 16), (48, 8, 128, 7)] {
            let n_pages = 64usize;
            let (kw, vw) = (kv_heads * hd, kv_heads * hd);
            // Sequences: (cached, new): a decode over a long prefix, a prefill chunk over a
            // prefix, a fresh prefill, a single-token sequence.
            let shape = [(300usize, 1usize), (37, 21), (0, 45), (0, 1)];
            let mut free: Vec<u32> = (0..n_pages as u32).map(|i| (i * 37 + 11) % n_pages as u32).collect();
            let mut tables = Vec::new();
            for &(c, n) in &shape {
                let t: Vec<u32> = (0..(c + n).div_ceil(ps)).map(|_| free.pop().unwrap()).collect();
                tables.push(t);
            }
            // Reference cache contents (rounded like the device cache) for every position.
            let round = |x: f32| match dt {
                KvDtype::F16 => half::f16::from_f32(x).to_f32(),
                KvDtype::BF16 => half::bf16::from_f32(x).to_f32(),
                KvDtype::F32 => x,
            };
            let kc = g.zeros::<u8>(n_pages * ps * kw * dt.bytes()).unwrap();
            let vc = g.zeros::<u8>(n_pages * ps * vw * dt.bytes()).unwrap();
            let mut kall: Vec<Vec<f32>> = Vec::new();
            let mut vall: Vec<Vec<f32>> = Vec::new();
            // Store every position's K/V through kv_store (the cached prefix in one call, the
            // new tokens in another), as the model does across steps.
            let (mut pos, mut seqi, mut slots_new) = (Vec::new(), Vec::new(), Vec::new());
            let mut slots_old = Vec::new();
            let (mut k_old, mut v_old, mut k_new, mut v_new) = (Vec::new(), Vec::new(), Vec::new(), Vec::new());
            for (s, &(c, n)) in shape.iter().enumerate() {
                let kk = rng.vec((c + n) * kw, 2.0);
                let vv = rng.vec((c + n) * vw, 2.0);
                for p in 0..c + n {
                    let slot = (tables[s][p / ps] as usize * ps + p % ps) as i32;
                    if p < c {
                        slots_old.push(slot);
                        k_old.extend_from_slice(&kk[p * kw..(p + 1) * kw]);
                        v_old.extend_from_slice(&vv[p * vw..(p + 1) * vw]);
                    } else {
                        slots_new.push(slot);
                        k_new.extend_from_slice(&kk[p * kw..(p + 1) * kw]);
                        v_new.extend_from_slice(&vv[p * vw..(p + 1) * vw]);
                        pos.push(p as i32);
                        seqi.push(s as i32);
                    }
                }
                kall.push(kk.into_iter().map(round).collect());
                vall.push(vv.into_iter().map(round).collect());
            }
            for (sl, kk, vv) in [(&slots_old, &k_old, &v_old), (&slots_new, &k_new, &v_new)] {
                let (sb, kb, vb) = (g.upload(sl).unwrap(), g.upload(kk).unwrap(), g.upload(vv).unwrap());
                g.kv_store(dt, g.ptr(&kb), g.ptr(&vb), kw, vw, g.ptr(&sb), g.ptr(&kc), g.ptr(&vc), sl.len()).unwrap();
                g.sync().unwrap();
            }
            let nt = pos.len();
            let qw = heads * hd;
            let q = rng.vec(nt * qw, 2.0);
            let mut pt_off = Vec::new();
            let mut pts = Vec::new();
            for t in &tables {
                pt_off.push(pts.len() as i32);
                pts.extend_from_slice(t);
            }
            let (qb, pb, sb, ob, tb) = (g.upload(&q).unwrap(), g.upload(&pos).unwrap(), g.upload(&seqi).unwrap(), g.upload(&pt_off).unwrap(), g.upload(&pts).unwrap());
            let out = poisoned(&g, nt * qw);
            let scale = 1.0 / (hd as f32).sqrt();
            g.attention(
                dt,
                &AttnArgs {
                    q: g.ptr(&qb),
                    qs: qw,
                    kc: g.ptr(&kc),
                    vc: g.ptr(&vc),
                    pos: g.ptr(&pb),
                    seq: g.ptr(&sb),
                    pt_off: g.ptr(&ob),
                    page_tables: g.ptr(&tb),
                    page_size: ps,
                    heads,
                    kv_heads,
                    hd,
                    vd: hd,
                    scale,
                    out: g.ptr(&out),
                    os: qw,
                    nt,
                    ..Default::default()
                },
            )
            .unwrap();
            let got = g.download(&out).unwrap();
            // f64 reference over the rounded cache.
            let mut want = vec![0f32; nt * qw];
            let group = heads / kv_heads;
            for t in 0..nt {
                let (s, p) = (seqi[t] as usize, pos[t] as usize);
                for h in 0..heads {
                    let kvh = h / group;
                    let qh = &q[t * qw + h * hd..t * qw + (h + 1) * hd];
                    let sc: Vec<f64> = (0..=p)
                        .map(|j| qh.iter().zip(&kall[s][j * kw + kvh * hd..]).map(|(a, b)| *a as f64 * *b as f64).sum::<f64>() * scale as f64)
                        .collect();
                    let m = sc.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
                    let den: f64 = sc.iter().map(|x| (x - m).exp()).sum();
                    for i in 0..hd {
                        let o: f64 = (0..=p).map(|j| (sc[j] - m).exp() / den * vall[s][j * vw + kvh * hd + i] as f64).sum();
                        want[t * qw + h * hd + i] = o as f32;
                    }
                }
            }
            let worst = check(&format!("attention {dt:?} {heads}/{kv_heads}x{hd} page {ps}"), &got, &want, |_| 2e-4);
            eprintln!("attention {dt:?} {heads}/{kv_heads} heads x{hd}, page {ps}, {nt} queries: max |diff| {worst:.2e}");
        }
    }
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn kernel_build_is_cached_and_reports_the_arch() {
    // A fresh cache directory, so the first start compiles everything (cold start time).
    let dir = std::env::temp_dir().join(format!("minimax-kcache-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    let old = std::env::var_os("MINIMAX_KERNEL_CACHE");
    unsafe { std::env::set_var("MINIMAX_KERNEL_CACHE", &dir) };
    let g1 = gpu();
    assert_eq!(g1.build.cached, 0, "fresh cache");
    let g2 = gpu();
    eprintln!(
        "{}: sm_{}, NVRTC {}.{}; first build {:.2} s ({} compiled, {} cached), second {:.2} s ({} cached)",
        g1.name, g1.arch, g1.build.nvrtc.0, g1.build.nvrtc.1, g1.build.seconds, g1.build.compiled, g1.build.cached, g2.build.seconds, g2.build.cached
    );
    match old {
        Some(o) => unsafe { std::env::set_var("MINIMAX_KERNEL_CACHE", o) },
        None => unsafe { std::env::remove_var("MINIMAX_KERNEL_CACHE") },
    }
    let _ = std::fs::remove_dir_all(&dir);
    assert_eq!(g2.build.compiled, 0, "second start must hit the cache");
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn fast_q8_products_and_fused_moe_match_cpu() {
    let g = gpu();
    let mut rng = Rng(0x5eed_0fa5_7000_0001);
    // q8 quantization: bit-exact against the host twin.
    let (n, nr) = (1024usize, 3usize);
    let x = rng.vec(n * nr, 3.0);
    let xb = g.upload(&x).unwrap();
    let qb = g.zeros::<i8>(n * nr).unwrap();
    let db = poisoned(&g, n * nr / 32);
    g.norm_q8(g.ptr(&xb), n, 0, n, 1e-6, 0, 0, g.ptr(&qb), g.ptr(&db), nr).unwrap();
    let (hq, hd) = q8_host(&x);
    assert_eq!(g.download(&qb).unwrap(), hq, "q8 quantization");
    assert_eq!(g.download(&db).unwrap(), hd, "q8 scales");
    eprintln!("q8 quantize {nr}x{n}: bit-exact");
    // Dense products (three segments of 37 + 8 + 21 rows, 1..37 vectors, accumulate) for Q8_0
    // and IQ4_XS, every kernel kind: Q8_0 at 13 chunks per row (staged: 2 phases of 8;
    // whole-row: one 24-chunk phase, or 12 + 1 for WholeShort; MMA: K halves of 7 + 6 chunks in
    // phases of 2, 66 rows = 4 full 16-row tiles + 2, 37 tokens = a full and a partial
    // 32-token tile) and at 25 chunks (whole-row: 24 + 1), IQ4_XS at 9.
    for (ty, cols) in [(GgmlType::Q8_0, 256 * 13), (GgmlType::Q8_0, 256 * 25), (GgmlType::Q8_0, 256 * 24), (GgmlType::IQ4_XS, 512 * 9)] {
        let rows = [37usize, 8, 21];
        let mats: Vec<Vec<u8>> = rows.iter().map(|&r| random_rows(&mut rng, ty, r, cols)).collect();
        let up: Vec<_> = mats.iter().zip(rows).map(|(b, r)| upload_mat(&g, ty, b, r, cols, 0)).collect();
        for nv in [1usize, 3, 8, 13, 32, 37] {
            let x = rng.vec(nv * cols, 2.0);
            let (hq, hd) = q8_host(&x);
            let xdq = q8_deq(&hq, &hd);
            let (qb, db) = (g.upload(&hq).unwrap(), g.upload(&hd).unwrap());
            for acc in [false, true] {
                let ys: Vec<usize> = rows.iter().map(|r| r + 2).collect();
                let y0: Vec<Vec<f32>> = ys.iter().map(|s| rng.vec(nv * s, 1.0)).collect();
                // The tensor-core kind in its three forms: mvmma3 bit-identical to mvmma, mvmma8
                // (8 K ranges) within the bound like every kind.
                let mut mma_bits: Option<Vec<Vec<u32>>> = None;
                // mvx_q8_0 (activations in shared memory; `mk` None with Mma, `kw` its warp
                // groups a block): 13 and 25 chunks in one K part (25 in 5 parts at 32 tokens:
                // partial sums + arrival counters), 24 in one or two parts of two warp groups,
                // 1 or 2 token tiles; 37 tokens fall back to mvmma.
                for (kind, mk, kw) in [(MvqKind::Staged, None, 0u8), (MvqKind::Whole, None, 0), (MvqKind::WholeShort, None, 0), (MvqKind::Mma, Some(Mvmma::W4R4), 0), (MvqKind::Mma, Some(Mvmma::W4R3), 0), (MvqKind::Mma, Some(Mvmma::W8R3), 0), (MvqKind::Mma, None, 1), (MvqKind::Mma, None, 2)] {
                    fast::set_mvmma(mk.map(Some));
                    fast::set_mvx(Some(mk.is_none()));
                    fast::set_mvx_kw(Some(kw));
                    if kind == MvqKind::Mma && mk.is_none() && (nv == 13 || nv == 32) && !acc && ty == GgmlType::Q8_0 {
                        let p = g.mvx_plan(cols / 256, cols, nv, 66, g.ptr(&qb), g.ptr(&db)).expect("mvx_q8_0 must take a 13- or 32-token Q8_0 product on this card");
                        eprintln!("mvx plan, {cols} columns, {nv} tokens: {p:?}");
                        assert!(p.kw == kw as usize || (p.kw == 1 && (cols / 256 / p.ks) % 2 == 1), "warp groups of {p:?}");
                        if nv == 32 && cols >= 256 * 24 {
                            assert!(p.ks > 1, "{cols} columns x 32 tokens must be split in K parts: {p:?}");
                        }
                    }
                    let yb: Vec<_> = (0..3).map(|i| if acc { g.upload(&y0[i]).unwrap() } else { poisoned(&g, nv * ys[i]) }).collect();
                    let segs: Vec<_> = (0..3).map(|i| (&up[i].1, g.ptr(&yb[i]), ys[i])).collect();
                    g.matvec_q8_with(kind, &segs, g.ptr(&qb), g.ptr(&db), cols, nv, acc).unwrap();
                    fast::set_mvmma(None);
                    fast::set_mvx(None);
                    fast::set_mvx_kw(None);
                    if matches!(mk, Some(Mvmma::W4R4 | Mvmma::W4R3)) && ty == GgmlType::Q8_0 {
                        let outs: Vec<Vec<u32>> = yb.iter().map(|b| bits(&g.download(b).unwrap())).collect();
                        match &mma_bits {
                            None => mma_bits = Some(outs),
                            Some(prev) => assert!(prev == &outs, "mvmma3 vs mvmma: outputs differ (cols {cols} nv {nv} acc {acc})"),
                        }
                    }
                    let mut worst = 0f32;
                    for i in 0..3 {
                        let got = g.download(&yb[i]).unwrap();
                        let deq = quant::dequantize_to_vec(ty, &mats[i], rows[i] * cols).unwrap();
                        for v in 0..nv {
                            for r in 0..rows[i] {
                                let w = &deq[r * cols..(r + 1) * cols];
                                let xv = &xdq[v * cols..(v + 1) * cols];
                                let want: f64 = w.iter().zip(xv).map(|(a, b)| *a as f64 * *b as f64).sum::<f64>() + if acc { y0[i][v * ys[i] + r] as f64 } else { 0.0 };
                                let scale: f64 = w.iter().zip(xv).map(|(a, b)| (*a as f64 * *b as f64).abs()).sum::<f64>() + 1e-6;
                                let gv = got[v * ys[i] + r];
                                let d = (gv as f64 - want).abs();
                                assert!(gv.is_finite() && d <= 1e-5 * scale + 1e-6, "mvq {ty} {kind:?} cols {cols} seg {i} nv {nv} acc {acc} [{v},{r}]: got {gv} want {want}");
                                worst = worst.max((d / scale) as f32);
                            }
                            for r in rows[i]..ys[i] {
                                let gv = got[v * ys[i] + r];
                                assert!(if acc { gv == y0[i][v * ys[i] + r] } else { gv.is_nan() }, "mvq {ty} {kind:?}: wrote past the rows");
                            }
                        }
                    }
                    if nv == 37 && acc {
                        eprintln!("mvq     {ty:<7} {kind:?} {mk:?} kw {kw} 3 segs x {cols} nv<=37: max |diff| / sum|w x| {worst:.2e}");
                    }
                }
            }
        }
        if cols == 256 * 25 || cols == 256 * 24 {
            continue;
        }
        // Fused MoE: gate/up/SiLU -> q8, then down + weighted combine into the residual.
        let (e, k, nt, ff, h) = (6usize, 3usize, 2usize, 64usize, cols);
        let down_cols = if ty == GgmlType::Q8_0 { 256 } else { 512 };
        // Down rows of 5 chunks (Q8_0: staged kernel in two phases, 2 + 1 experts) or 9
        // (IQ4_XS: staged in 3 phases; register-direct: 3 x 144 units = 432 per row, two
        // rounds of 384 with a partial second one).
        let ff = ff.max(if ty == GgmlType::Q8_0 { 5 } else { 9 } * down_cols);
        let gate = random_rows(&mut rng, ty, e * ff, h);
        let upw = random_rows(&mut rng, ty, e * ff, h);
        let hrows = 43usize; // not a multiple of the 2 / 4 / 8 rows per block
        let down = random_rows(&mut rng, ty, e * hrows, ff);
        let (_g1, gm) = upload_mat(&g, ty, &gate, ff, h, e);
        let (_g2, um) = upload_mat(&g, ty, &upw, ff, h, e);
        let (_g3, dm) = upload_mat(&g, ty, &down, hrows, ff, e);
        let ids: Vec<i32> = vec![4, 0, 5, 2, 4, 1];
        let wts: Vec<f32> = vec![0.5, 0.3, 0.2, 0.6, 0.25, 0.15];
        let x = rng.vec(nt * h, 2.0);
        let (hq, hd) = q8_host(&x);
        let xdq = q8_deq(&hq, &hd);
        let (qb, db, ib, wb) = (g.upload(&hq).unwrap(), g.upload(&hd).unwrap(), g.upload(&ids).unwrap(), g.upload(&wts).unwrap());
        let aq = g.zeros::<i8>(nt * k * ff).unwrap();
        let ad = poisoned(&g, nt * k * ff / 32);
        g.moe_gate_up_q8(&gm, &um, g.ptr(&ib), k, g.ptr(&qb), g.ptr(&db), g.ptr(&aq), g.ptr(&ad), nt * k).unwrap();
        let (gaq, gad) = (g.download(&aq).unwrap(), g.download(&ad).unwrap());
        let gdeq = quant::dequantize_to_vec(ty, &gate, e * ff * h).unwrap();
        let udeq = quant::dequantize_to_vec(ty, &upw, e * ff * h).unwrap();
        let mut worst = 0f32;
        for p in 0..nt * k {
            let (ex, t) = (ids[p] as usize, p / k);
            let xv = &xdq[t * h..(t + 1) * h];
            for r in 0..ff {
                let row = |m: &[f32]| m[(ex * ff + r) * h..(ex * ff + r + 1) * h].iter().zip(xv).map(|(a, b)| *a as f64 * *b as f64).sum::<f64>();
                let (gg, uu) = (row(&gdeq), row(&udeq));
                let want = (gg / (1.0 + (-gg).exp()) * uu) as f32;
                let got = gaq[p * ff + r] as f32 * gad[p * ff / 32 + r / 32];
                // One q8 step of the 32-value group is the resolution.
                let tol = gad[p * ff / 32 + r / 32] * 0.51 + 1e-4 * want.abs() + 1e-6;
                assert!(got.is_finite() && (got - want).abs() <= tol, "gate_up {ty} pair {p} row {r}: got {got} want {want} tol {tol}");
                worst = worst.max((got - want).abs());
            }
        }
        let hid0 = rng.vec(nt * (hrows + 1), 1.0);
        for kind in [DownKind::Staged, DownKind::Reg4, DownKind::Reg2, DownKind::Reg4Pre] {
            let hb = g.upload(&hid0).unwrap();
            g.moe_down_q8_with(kind, &dm, g.ptr(&ib), g.ptr(&wb), k, g.ptr(&aq), g.ptr(&ad), g.ptr(&hb), hrows + 1, nt).unwrap();
            let got = g.download(&hb).unwrap();
            let ddeq = quant::dequantize_to_vec(ty, &down, e * hrows * ff).unwrap();
            let mut worst_d = 0f64;
            for t in 0..nt {
                for r in 0..hrows {
                    let mut want = hid0[t * (hrows + 1) + r] as f64;
                    let mut scale = want.abs();
                    for j in 0..k {
                        let p = t * k + j;
                        let ex = ids[p] as usize;
                        let w = &ddeq[(ex * hrows + r) * ff..(ex * hrows + r + 1) * ff];
                        let s: f64 = (0..ff).map(|i| w[i] as f64 * gaq[p * ff + i] as f64 * gad[p * ff / 32 + i / 32] as f64).sum();
                        scale += (0..ff).map(|i| (w[i] as f64 * gaq[p * ff + i] as f64 * gad[p * ff / 32 + i / 32] as f64).abs()).sum::<f64>() * wts[p] as f64;
                        want += wts[p] as f64 * s;
                    }
                    let gv = got[t * (hrows + 1) + r] as f64;
                    assert!(gv.is_finite() && (gv - want).abs() <= 1e-5 * scale + 1e-6, "down {ty} {kind:?} t {t} r {r}: got {gv} want {want}");
                    worst_d = worst_d.max((gv - want).abs() / scale);
                }
                assert_eq!(got[t * (hrows + 1) + hrows], hid0[t * (hrows + 1) + hrows], "down {kind:?} wrote past the rows");
            }
            eprintln!("moe     {ty:<7} gate/up max |diff| {worst:.2e} (q8 output), down+combine ({kind:?}) max rel {worst_d:.2e}");
        }
    }
}

/// One router case of the fused-norm router tests: f32 router weights (`rows` x `cols`), `nt`
/// residual rows strided by `xs = cols + 64`, the norm weight and the bias, on the host and
/// uploaded (drawn in that order from `rng`).
struct NormRouterCase {
    xs: usize,
    wm: Vec<f32>,
    x: Vec<f32>,
    nw: Vec<f32>,
    _w: CudaSlice<u8>,
    dm: DevMat,
    xb: CudaSlice<f32>,
    nwb: CudaSlice<f32>,
    bb: CudaSlice<f32>,
}

impl NormRouterCase {
    fn new(g: &Gpu, rng: &mut Rng, rows: usize, cols: usize, nt: usize) -> Self {
        let xs = cols + 64;
        let wm = rng.vec(rows * cols, 0.05);
        let x = rng.vec(nt * xs, 2.0);
        let nw = rng.vec(cols, 1.0);
        let bias = rng.vec(rows, 0.3);
        let bytes: Vec<u8> = wm.iter().flat_map(|v| v.to_le_bytes()).collect();
        let (_w, dm) = upload_mat(g, GgmlType::F32, &bytes, rows, cols, 0);
        let (xb, nwb, bb) = (g.upload(&x).unwrap(), g.upload(&nw).unwrap(), g.upload(&bias).unwrap());
        Self { xs, wm, x, nw, _w, dm, xb, nwb, bb }
    }
}

/// The fast path's register-resident kernels: RMSNorm + q8 (`norm_q8` with a weight and an f32
/// copy), the F32 router product (`router_f32`), its fused forms (with the top-k, with the MoE
/// norm: `router_topk_norm_f32`, `router_topk_f32n`), and the fused q/k norm + partial RoPE + KV
/// store (`qk_norm_rope_store_bf16`), each against its CPU twin.
#[test]
#[ignore = "needs a CUDA GPU"]
fn fast_norm_router_and_qk_rope_match_cpu() {
    let g = gpu();
    let mut rng = Rng(0x5eed_0fa5_7000_0002);
    // norm_q8 with RMSNorm weights: the f32 copy within f32 rounding of the host norm; the q8
    // output is the host quantization of the GPU's own f32 copy (bit-exact).
    for (n, nr) in [(3072usize, 3usize), (96, 2), (12288, 1)] {
        let x = rng.vec(n * nr, 3.0);
        let w = rng.vec(n, 1.0);
        let (xb, wb) = (g.upload(&x).unwrap(), g.upload(&w).unwrap());
        let yb = poisoned(&g, n * nr);
        let qb = g.zeros::<i8>(n * nr).unwrap();
        let db = poisoned(&g, n * nr / 32);
        g.norm_q8(g.ptr(&xb), n, g.ptr(&wb), n, 1e-6, g.ptr(&yb), n, g.ptr(&qb), g.ptr(&db), nr).unwrap();
        let got = g.download(&yb).unwrap();
        let want: Vec<f32> = x.chunks(n).flat_map(|r| rms_norm_ref(r, &w, 1e-6)).collect();
        let worst = check(&format!("norm_q8 {n}"), &got, &want, |i| 2e-6 * (1.0 + want[i].abs()));
        let (hq, hd) = q8_host(&got);
        assert_eq!(g.download(&qb).unwrap(), hq, "norm_q8 {n}: q8 of the normed values");
        assert_eq!(g.download(&db).unwrap(), hd, "norm_q8 {n}: q8 scales");
        eprintln!("norm_q8 width {n} x {nr}: norm max |diff| {worst:.2e}, q8 bit-exact");
    }
    // router_f32: rows not a multiple of the block's 4 warps, widths with a partial round.
    for (rows, cols, nt) in [(256usize, 3072usize, 1usize), (37, 1000, 3), (5, 12, 2)] {
        let wm = rng.vec(rows * cols, 0.05);
        let x = rng.vec(nt * (cols + 4), 2.0);
        let bytes: Vec<u8> = wm.iter().flat_map(|v| v.to_le_bytes()).collect();
        let (_wb, dm) = upload_mat(&g, GgmlType::F32, &bytes, rows, cols, 0);
        let xb = g.upload(&x).unwrap();
        let ys = rows + 3;
        let yb = poisoned(&g, nt * ys);
        g.router_f32(&dm, g.ptr(&xb), cols + 4, g.ptr(&yb), ys, nt).unwrap();
        let got = g.download(&yb).unwrap();
        for t in 0..nt {
            for r in 0..rows {
                let (mut want, mut scale) = (0f64, 0f64);
                for c in 0..cols {
                    let p = wm[r * cols + c] as f64 * x[t * (cols + 4) + c] as f64;
                    want += p;
                    scale += p.abs();
                }
                let gv = got[t * ys + r] as f64;
                assert!(gv.is_finite() && (gv - want).abs() <= 1e-6 * scale + 1e-7, "router_f32 {rows}x{cols} t {t} r {r}: {gv} vs {want}");
            }
            for r in rows..ys {
                assert!(got[t * ys + r].is_nan(), "router_f32 wrote past the rows");
            }
        }
        eprintln!("router_f32 {rows}x{cols}, {nt} tokens: within 1e-6 of sum |w x|");
    }
    // moe_route_fast: bit-identical to the exact path's moe_route (tested against the CPU in
    // router_matches_cpu), both gatings, expert counts not a multiple of 32, ties in the
    // biased scores (repeated logits and zero bias).
    for (e, k, nt, gating, ties) in [
        (256usize, 8usize, 3usize, GatingFunc::Sigmoid, false),
        (200, 8, 2, GatingFunc::Softmax, false),
        (37, 5, 4, GatingFunc::Sigmoid, true),
        (8, 8, 1, GatingFunc::Softmax, false),
    ] {
        let mut logits = rng.vec(nt * e, 4.0);
        let bias = if ties { vec![0f32; e] } else { rng.vec(e, 0.5) };
        if ties {
            for t in 0..nt {
                for i in (1..e).step_by(3) {
                    logits[t * e + i] = logits[t * e + i - 1];
                }
            }
        }
        let (lb, bb) = (g.upload(&logits).unwrap(), g.upload(&bias).unwrap());
        let mut out = Vec::new();
        for fast in [false, true] {
            let ids = g.zeros::<i32>(nt * k).unwrap();
            g.fill_u32(g.ptr(&ids), nt * k, u32::MAX).unwrap();
            let wb = poisoned(&g, nt * k);
            if fast {
                g.route_fast(g.ptr(&lb), g.ptr(&bb), e, k, gating, g.ptr(&ids), g.ptr(&wb), nt).unwrap();
            } else {
                g.route(g.ptr(&lb), g.ptr(&bb), e, k, gating, g.ptr(&ids), g.ptr(&wb), nt).unwrap();
            }
            out.push((g.download(&ids).unwrap(), g.download(&wb).unwrap()));
        }
        assert!(out[0].1.iter().all(|w| w.is_finite()) && out[0].0.iter().all(|&i| i >= 0 && (i as usize) < e), "moe_route {e}");
        assert_eq!(out[1].0, out[0].0, "moe_route_fast ids, top-{k} of {e}");
        let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
        assert_eq!(bits(&out[1].1), bits(&out[0].1), "moe_route_fast weights, top-{k} of {e}");
        eprintln!("moe_route_fast top-{k} of {e} ({gating:?}, ties {ties}), {nt} tokens: bit-identical to moe_route");
    }
    assert!(g.route_fast(0, 0, 257, 8, GatingFunc::Sigmoid, 0, 0, 1).is_err(), "more than 256 experts must be refused");
    // router_topk_f32 (router product + top-k in the last block): logits bit-identical to
    // router_f32, ids / weights to moe_route on them; launched twice (the arrival counters must
    // be back at zero), rows not a multiple of the 4-row block.
    // Also router_topk_f32t4 (4 tokens a warp): 3 tokens (one partial group), 9 (two groups
    // and one token), 4 (one full group).
    // And router_topk_f32x (a row's loads at once, x in shared memory): M2.7's one token, 37
    // rows of 1000 (a partial round, an odd last block), 4000 columns (two rounds), 2 tokens.
    for (rows, cols, k, nt, gating, t4, rx) in [
        (256usize, 3072usize, 8usize, 3usize, GatingFunc::Sigmoid, false, false),
        (256, 3072, 8, 3, GatingFunc::Sigmoid, true, false),
        (256, 3072, 8, 9, GatingFunc::Sigmoid, true, false),
        (37, 1000, 5, 4, GatingFunc::Softmax, false, false),
        (37, 1000, 5, 4, GatingFunc::Softmax, true, false),
        (256, 3072, 8, 1, GatingFunc::Sigmoid, false, true),
        (37, 1000, 5, 1, GatingFunc::Softmax, false, true),
        (64, 4000, 4, 2, GatingFunc::Sigmoid, false, true),
    ] {
        fast::set_router_t4_min(Some(if t4 { 2 } else { 99 }));
        fast::set_router_x(Some(rx));
        let wm = rng.vec(rows * cols, 0.05);
        let x = rng.vec(nt * cols, 2.0);
        let bias = rng.vec(rows, 0.3);
        let bytes: Vec<u8> = wm.iter().flat_map(|v| v.to_le_bytes()).collect();
        let (_wb, dm) = upload_mat(&g, GgmlType::F32, &bytes, rows, cols, 0);
        let (xb, bb) = (g.upload(&x).unwrap(), g.upload(&bias).unwrap());
        let cnt = g.zeros::<u32>(nt).unwrap();
        let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
        let yr = poisoned(&g, nt * rows);
        g.router_f32(&dm, g.ptr(&xb), cols, g.ptr(&yr), rows, nt).unwrap();
        let ir = g.zeros::<i32>(nt * k).unwrap();
        let wr = poisoned(&g, nt * k);
        g.route(g.ptr(&yr), g.ptr(&bb), rows, k, gating, g.ptr(&ir), g.ptr(&wr), nt).unwrap();
        let (want_y, want_i, want_w) = (g.download(&yr).unwrap(), g.download(&ir).unwrap(), g.download(&wr).unwrap());
        for rep in 0..2 {
            let y = poisoned(&g, nt * rows);
            let ids = g.zeros::<i32>(nt * k).unwrap();
            g.fill_u32(g.ptr(&ids), nt * k, u32::MAX).unwrap();
            let wb = poisoned(&g, nt * k);
            g.router_topk_f32(&dm, g.ptr(&xb), cols, g.ptr(&y), rows, g.ptr(&bb), k, gating, g.ptr(&ids), g.ptr(&wb), g.ptr(&cnt), nt).unwrap();
            assert_eq!(bits(&g.download(&y).unwrap()), bits(&want_y), "router_topk_f32 logits {rows}x{cols} rep {rep}");
            assert_eq!(g.download(&ids).unwrap(), want_i, "router_topk_f32 ids {rows} rep {rep}");
            assert_eq!(bits(&g.download(&wb).unwrap()), bits(&want_w), "router_topk_f32 weights {rows} rep {rep}");
            assert!(g.download(&cnt).unwrap().iter().all(|&c| c == 0), "router_topk_f32 left its counters non-zero");
        }
        fast::set_router_t4_min(None);
        fast::set_router_x(None);
        eprintln!("router_topk_f32 {rows}x{cols} top-{k} ({gating:?}), {nt} tokens, t4 {t4}, x staged {rx}, 2 launches: bit-identical to router_f32 + moe_route");
    }
    // router_topk_norm_f32 (norm_q8 folded into router_topk_f32): q8, logits, ids and weights
    // bit-identical to norm_q8 + router_topk_f32; residual rows strided; twice (counters back
    // at zero); widths 128 (one partial virtual warp set), 3072 (M2.7) and 4096 (the widest).
    for (rows, cols, k, nt, gating) in [(256usize, 3072usize, 8usize, 2usize, GatingFunc::Sigmoid), (37, 128, 5, 3, GatingFunc::Softmax), (64, 4096, 4, 1, GatingFunc::Sigmoid)] {
        // (`_w` holds the device weights `dm` points into.)
        let NormRouterCase { xs, _w, dm, xb, nwb, bb, .. } = NormRouterCase::new(&g, &mut rng, rows, cols, nt);
        let cnt = g.zeros::<u32>(nt).unwrap();
        let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
        let eps = 1e-6f32;
        let (yn, rq, rd) = (poisoned(&g, nt * cols), g.upload(&vec![0x55i8; nt * cols]).unwrap(), poisoned(&g, nt * cols / 32));
        g.norm_q8(g.ptr(&xb), xs, g.ptr(&nwb), cols, eps, g.ptr(&yn), cols, g.ptr(&rq), g.ptr(&rd), nt).unwrap();
        let yr = poisoned(&g, nt * rows);
        let ir = g.zeros::<i32>(nt * k).unwrap();
        let wr = poisoned(&g, nt * k);
        g.router_topk_f32(&dm, g.ptr(&yn), cols, g.ptr(&yr), rows, g.ptr(&bb), k, gating, g.ptr(&ir), g.ptr(&wr), g.ptr(&cnt), nt).unwrap();
        let (want_q, want_d) = (g.download(&rq).unwrap(), g.download(&rd).unwrap());
        let (want_y, want_i, want_w) = (g.download(&yr).unwrap(), g.download(&ir).unwrap(), g.download(&wr).unwrap());
        assert!(want_d.iter().all(|d| d.is_finite()) && want_w.iter().all(|w| w.is_finite()), "reference outputs");
        for rep in 0..2 {
            let y = poisoned(&g, nt * rows);
            let ids = g.zeros::<i32>(nt * k).unwrap();
            g.fill_u32(g.ptr(&ids), nt * k, u32::MAX).unwrap();
            let wb = poisoned(&g, nt * k);
            let (q, d) = (g.upload(&vec![0x55i8; nt * cols]).unwrap(), poisoned(&g, nt * cols / 32));
            g.router_topk_norm_f32(&dm, g.ptr(&xb), xs, g.ptr(&nwb), eps, g.ptr(&y), rows, g.ptr(&bb), k, gating, g.ptr(&ids), g.ptr(&wb), g.ptr(&cnt), g.ptr(&q), g.ptr(&d), nt).unwrap();
            let what = format!("router_topk_norm_f32 {rows}x{cols} top-{k}, {nt} tokens, rep {rep}");
            assert_eq!(g.download(&q).unwrap(), want_q, "{what}: q8 values");
            assert_eq!(bits(&g.download(&d).unwrap()), bits(&want_d), "{what}: q8 scales");
            assert_eq!(bits(&g.download(&y).unwrap()), bits(&want_y), "{what}: logits");
            assert_eq!(g.download(&ids).unwrap(), want_i, "{what}: ids");
            assert_eq!(bits(&g.download(&wb).unwrap()), bits(&want_w), "{what}: weights");
            assert!(g.download(&cnt).unwrap().iter().all(|&c| c == 0), "{what}: counters not reset");
        }
        eprintln!("router_topk_norm_f32 {rows}x{cols} top-{k} ({gating:?}), {nt} tokens, 2 launches: bit-identical to norm_q8 + router_topk_f32");
    }
    assert!(g.router_topk_norm_f32(&upload_mat(&g, GgmlType::F32, &vec![0u8; 4 * 8 * 4224], 8, 4224, 0).1, 0, 4224, 0, 1e-6, 0, 8, 0, 2, GatingFunc::Sigmoid, 0, 0, 0, 0, 0, 1).is_err(), "rows wider than 4096 must be refused");
    // router_topk_f32n (the MoE norm inside the router, session 20) against its CPU twin: logits
    // = Wr (rms_norm(h) g) within f32 rounding of the host's; ids and weights bit-identical to
    // moe_route on the kernel's own logits (so near-ties cannot flake); the q8 copy within half
    // a step of the host's normalized values, its scales the group's max / 127; twice (counters
    // back at zero), with and without the L2 prefetch; residual rows strided.
    // Blocks of 4, 8, 16, 2 and 1 warps (MINIMAX_ROUTER_WARPS).
    for (rows, cols, k, nt, gating, pf, warps) in [
        (256usize, 3072usize, 8usize, 1usize, GatingFunc::Sigmoid, true, 4u32),
        (256, 3072, 8, 1, GatingFunc::Sigmoid, true, 8),
        (256, 3072, 8, 3, GatingFunc::Sigmoid, true, 16),
        (256, 3072, 8, 2, GatingFunc::Sigmoid, false, 2),
        (37, 96, 5, 3, GatingFunc::Softmax, true, 8),
        (64, 4096, 4, 1, GatingFunc::Sigmoid, true, 1),
    ] {
        fast::set_router_prefetch(Some(pf));
        fast::set_router_f32n_warps(Some(warps));
        let eps = 1e-6f32;
        let NormRouterCase { xs, wm, x, nw, _w, dm, xb, nwb, bb } = NormRouterCase::new(&g, &mut rng, rows, cols, nt);
        let (cnt, ss) = (g.zeros::<u32>(nt).unwrap(), poisoned(&g, nt * cols / 32));
        let normed: Vec<Vec<f32>> = (0..nt).map(|t| rms_norm_ref(&x[t * xs..t * xs + cols], &nw, eps)).collect();
        let want_y: Vec<f32> = (0..nt).flat_map(|t| (0..rows).map(|r| wm[r * cols..(r + 1) * cols].iter().zip(&normed[t]).map(|(&a, &b)| a as f64 * b as f64).sum::<f64>() as f32).collect::<Vec<_>>()).collect();
        for rep in 0..2 {
            let what = format!("router_topk_f32n {rows}x{cols} top-{k}, {nt} tokens, prefetch {pf}, {warps} warps a block, rep {rep}");
            let y = poisoned(&g, nt * rows);
            let ids = g.zeros::<i32>(nt * k).unwrap();
            g.fill_u32(g.ptr(&ids), nt * k, u32::MAX).unwrap();
            let wb = poisoned(&g, nt * k);
            let (q, d) = (g.upload(&vec![0x55i8; nt * cols]).unwrap(), poisoned(&g, nt * cols / 32));
            g.router_topk_f32n(&dm, g.ptr(&xb), xs, g.ptr(&nwb), eps, g.ptr(&y), rows, g.ptr(&bb), k, gating, g.ptr(&ids), g.ptr(&wb), g.ptr(&cnt), g.ptr(&q), g.ptr(&d), g.ptr(&ss), nt).unwrap();
            let got_y = g.download(&y).unwrap();
            let worst = check(&format!("{what}: logits"), &got_y, &want_y, |i| 2e-5 * (1.0 + want_y[i].abs()));
            // The top-k of the kernel's own logits by moe_route.
            let (ir, wr) = (g.zeros::<i32>(nt * k).unwrap(), poisoned(&g, nt * k));
            g.route(g.ptr(&y), g.ptr(&bb), rows, k, gating, g.ptr(&ir), g.ptr(&wr), nt).unwrap();
            let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
            assert_eq!(g.download(&ids).unwrap(), g.download(&ir).unwrap(), "{what}: ids");
            assert_eq!(bits(&g.download(&wb).unwrap()), bits(&g.download(&wr).unwrap()), "{what}: weights");
            let (gq, gd) = (g.download(&q).unwrap(), g.download(&d).unwrap());
            for t in 0..nt {
                for (gi, grp) in normed[t].chunks(32).enumerate() {
                    let dd = gd[t * cols / 32 + gi];
                    let amax = grp.iter().fold(0f32, |m, v| m.max(v.abs()));
                    assert!((dd - amax / 127.0).abs() <= 1e-5 * amax / 127.0 + 1e-30, "{what}: token {t} group {gi} scale {dd} against {}", amax / 127.0);
                    for (j, &v) in grp.iter().enumerate() {
                        let qv = gq[t * cols + gi * 32 + j] as f32 * dd;
                        assert!((qv - v).abs() <= 0.5 * dd * (1.0 + 1e-4) + 1e-6 * v.abs(), "{what}: token {t} element {}: q8 {qv} against {v}", gi * 32 + j);
                    }
                }
            }
            assert!(g.download(&cnt).unwrap().iter().all(|&c| c == 0), "{what}: counters not reset");
            eprintln!("{what}: logits within {worst:.2e} of the host's, ids / weights = moe_route on them, q8 within half a step");
        }
        fast::set_router_prefetch(None);
        fast::set_router_f32n_warps(None);
    }
    assert!(g.router_topk_f32n(&upload_mat(&g, GgmlType::F32, &vec![0u8; 4 * 8 * 4128], 8, 4128, 0).1, 0, 4128, 0, 1e-6, 0, 8, 0, 2, GatingFunc::Sigmoid, 0, 0, 0, 0, 0, 0, 1).is_err(), "rows wider than 4096 must be refused");
    // qk_norm_rope_store (bf16 cache): q and k full-width norm, partial RoPE per head, K and V
    // stored at their slots.
    for (qh, kh, hd, rot, theta) in [(48usize, 8usize, 128usize, 64usize, 5e6f32), (6, 1, 128, 128, 10000.0)] {
        let nt = 3;
        let (qw, kw) = (qh * hd, kh * hd);
        let vw = kw;
        let q = rng.vec(nt * qw, 2.0);
        let k = rng.vec(nt * kw, 2.0);
        let v = rng.vec(nt * kw, 2.0);
        let (qn, kn) = (rng.vec(qw, 1.0), rng.vec(kw, 1.0));
        let pos: Vec<i32> = vec![0, 17, 40_000];
        let slots: Vec<i32> = vec![5, 0, 2];
        let (qb, kb, vb) = (g.upload(&q).unwrap(), g.upload(&k).unwrap(), g.upload(&v).unwrap());
        let (qnb, knb, pb, sb) = (g.upload(&qn).unwrap(), g.upload(&kn).unwrap(), g.upload(&pos).unwrap(), g.upload(&slots).unwrap());
        let nslots = 6;
        let kc = g.zeros::<u16>(nslots * kw).unwrap();
        let vc = g.zeros::<u16>(nslots * vw).unwrap();
        let rows = fast::QkRows { q: g.ptr(&qb), k: g.ptr(&kb), v: g.ptr(&vb), qw, kw, vw, hd, rot };
        let args = fast::qk_norm_rope_args(&rows, g.ptr(&qnb), g.ptr(&knb), g.ptr(&pb), theta, 1e-6, g.ptr(&sb), g.ptr(&kc), g.ptr(&vc));
        g.launch("qk_norm_rope_store_bf16", (nt as u32, 2, 1), 1024, 0, &args).unwrap();
        let (gq, gk, gkc, gvc) = (g.download(&qb).unwrap(), g.download(&kb).unwrap(), g.download(&kc).unwrap(), g.download(&vc).unwrap());
        let bf = |b: u16| f32::from_bits((b as u32) << 16);
        let mut worst = 0f32;
        for t in 0..nt {
            let mut wq = rms_norm_ref(&q[t * qw..(t + 1) * qw], &qn, 1e-6);
            rope_ref(&mut wq, hd, rot, pos[t] as usize, theta);
            let mut wk = rms_norm_ref(&k[t * kw..(t + 1) * kw], &kn, 1e-6);
            rope_ref(&mut wk, hd, rot, pos[t] as usize, theta);
            worst = worst.max(check("qk q", &gq[t * qw..(t + 1) * qw], &wq, |i| 1e-5 * (1.0 + wq[i].abs())));
            worst = worst.max(check("qk k", &gk[t * kw..(t + 1) * kw], &wk, |i| 1e-5 * (1.0 + wk[i].abs())));
            let s = slots[t] as usize;
            for i in 0..kw {
                let (a, b) = (bf(gkc[s * kw + i]), gk[t * kw + i]);
                assert!((a - b).abs() <= b.abs() / 128.0 + 1e-6, "k cache t {t} [{i}]: {a} vs {b}");
                let (a, b) = (bf(gvc[s * vw + i]), v[t * kw + i]);
                assert!((a - b).abs() <= b.abs() / 128.0 + 1e-6, "v cache t {t} [{i}]: {a} vs {b}");
            }
        }
        eprintln!("qk_norm_rope_store {qh}/{kh} heads x {hd}, rot {rot}: max |diff| {worst:.2e}, cache within bf16");
    }
}

/// The grouped MoE of steps of several tokens (`moe_group`, the default `GrpKind`'s gate/up and
/// down, `moe_combine_grp`; the plain kind bit for bit) against the CPU: experts shared by several tokens
/// (one by every token), column rounds with a partial last one (gate/up: 112 units = 96 + 16;
/// down: 2 x 80 units = 96 + 64), output rows not a multiple of the 16-row block.
#[test]
#[ignore = "needs a CUDA GPU"]
fn fast_grouped_moe_matches_cpu() {
    let g = gpu();
    let mut rng = Rng(0x5eed_0fa5_7000_0003);
    let ty = GgmlType::IQ4_XS;
    let (e, k, nt, h, ff, hrows) = (7usize, 3usize, 5usize, 512 * 7, 512 * 5, 43usize);
    let ex = random_experts(&g, &mut rng, ty, e, ff, h, hrows);
    let (gate, upw, down, gm, um, dm) = (&ex.gate, &ex.up, &ex.down, ex.gm, ex.um, ex.dm);
    // Expert 2 for every token, expert 6 for two, the rest once or twice; expert 3 never.
    let ids: Vec<i32> = vec![2, 6, 0, 1, 2, 6, 2, 4, 5, 0, 1, 2, 5, 2, 4];
    let wts: Vec<f32> = (0..nt * k).map(|i| 0.1 + 0.05 * i as f32).collect();
    let x = rng.vec(nt * h, 2.0);
    let (hq, hd) = q8_host(&x);
    let xdq = q8_deq(&hq, &hd);
    let (qb, db, ib, wb) = (g.upload(&hq).unwrap(), g.upload(&hd).unwrap(), g.upload(&ids).unwrap(), g.upload(&wts).unwrap());
    let grp = g.zeros::<i32>(1 + 3 * e + nt * k).unwrap();
    g.fill_u32(g.ptr(&grp), 1 + 3 * e + nt * k, u32::MAX).unwrap();
    g.moe_group(g.ptr(&ib), nt * k, e, g.ptr(&grp)).unwrap();
    let gr = g.download(&grp).unwrap();
    assert_eq!(gr[0], 6, "six distinct experts");
    let mut seen = vec![false; nt * k];
    for s in 0..gr[0] as usize {
        let (ex, off, cnt) = (gr[1 + s], gr[1 + e + s] as usize, gr[1 + 2 * e + s] as usize);
        for &p in &gr[1 + 3 * e + off..1 + 3 * e + off + cnt] {
            assert_eq!(ids[p as usize], ex, "pair {p} listed under expert {ex}");
            assert!(!seen[p as usize], "pair {p} listed twice");
            seen[p as usize] = true;
        }
    }
    assert!(seen.iter().all(|&s| s), "every pair listed");
    let nslots = (nt * k).min(e);
    let aq = g.zeros::<i8>(nt * k * ff).unwrap();
    g.fill_u32(g.ptr(&aq), nt * k * ff / 4, 0x7f7f_7f7f).unwrap();
    let ad = poisoned(&g, nt * k * ff / 32);
    // The default kind (pinned codebook words, L2 prefetch) must give the plain kernels' bits.
    minimax_rank::cuda::fast::set_grp_kind(Some(fast::GrpKind::Plain));
    g.moe_gate_up_grp(&gm, &um, g.ptr(&grp), e, nslots, k, g.ptr(&qb), g.ptr(&db), g.ptr(&aq), g.ptr(&ad), ff).unwrap();
    let (gaq, gad) = (g.download(&aq).unwrap(), g.download(&ad).unwrap());
    minimax_rank::cuda::fast::set_grp_kind(None);
    {
        let aq2 = g.zeros::<i8>(nt * k * ff).unwrap();
        g.fill_u32(g.ptr(&aq2), nt * k * ff / 4, 0x7f7f_7f7f).unwrap();
        let ad2 = poisoned(&g, nt * k * ff / 32);
        g.moe_gate_up_grp(&gm, &um, g.ptr(&grp), e, nslots, k, g.ptr(&qb), g.ptr(&db), g.ptr(&aq2), g.ptr(&ad2), ff).unwrap();
        let (paq, pad) = (g.download(&aq2).unwrap(), g.download(&ad2).unwrap());
        assert!(gaq == paq, "grouped gate/up of the default kind: q8 codes differ from the plain kernel");
        assert!(gad.iter().zip(&pad).all(|(a, b)| a.to_bits() == b.to_bits()), "grouped gate/up of the default kind: q8 scales differ from the plain kernel");
    }
    let gdeq = quant::dequantize_to_vec(ty, &gate, e * ff * h).unwrap();
    let udeq = quant::dequantize_to_vec(ty, &upw, e * ff * h).unwrap();
    let mut worst = 0f32;
    for p in 0..nt * k {
        let (ex, t) = (ids[p] as usize, p / k);
        let xv = &xdq[t * h..(t + 1) * h];
        for r in 0..ff {
            let row = |m: &[f32]| m[(ex * ff + r) * h..(ex * ff + r + 1) * h].iter().zip(xv).map(|(a, b)| *a as f64 * *b as f64).sum::<f64>();
            let (gg, uu) = (row(&gdeq), row(&udeq));
            let want = (gg / (1.0 + (-gg).exp()) * uu) as f32;
            let got = gaq[p * ff + r] as f32 * gad[p * ff / 32 + r / 32];
            let tol = gad[p * ff / 32 + r / 32] * 0.51 + 1e-4 * want.abs() + 1e-6;
            assert!(got.is_finite() && (got - want).abs() <= tol, "gate_up_grp pair {p} row {r}: got {got} want {want} tol {tol}");
            worst = worst.max((got - want).abs());
        }
    }
    let dpart = poisoned(&g, nt * k * hrows);
    g.moe_down_grp_with(false, &dm, g.ptr(&grp), e, nslots, g.ptr(&aq), g.ptr(&ad), g.ptr(&dpart)).unwrap();
    {
        minimax_rank::cuda::fast::set_grp_kind(Some(fast::GrpKind::Plain));
        let plain = poisoned(&g, nt * k * hrows);
        g.moe_down_grp_with(false, &dm, g.ptr(&grp), e, nslots, g.ptr(&aq), g.ptr(&ad), g.ptr(&plain)).unwrap();
        let (a, b) = (g.download(&dpart).unwrap(), g.download(&plain).unwrap());
        assert!(a.iter().zip(&b).all(|(x, y)| x.to_bits() == y.to_bits()), "grouped down of the default kind differs from the plain kernel");
        minimax_rank::cuda::fast::set_grp_kind(None);
    }
    let hid0 = rng.vec(nt * (hrows + 1), 1.0);
    let hb = g.upload(&hid0).unwrap();
    g.moe_combine_grp(g.ptr(&dpart), g.ptr(&wb), k, hrows, g.ptr(&hb), hrows + 1, nt).unwrap();
    let got = g.download(&hb).unwrap();
    let ddeq = quant::dequantize_to_vec(ty, &down, e * hrows * ff).unwrap();
    let mut worst_d = 0f64;
    for t in 0..nt {
        for r in 0..hrows {
            let mut want = hid0[t * (hrows + 1) + r] as f64;
            let mut scale = want.abs();
            for j in 0..k {
                let p = t * k + j;
                let ex = ids[p] as usize;
                let w = &ddeq[(ex * hrows + r) * ff..(ex * hrows + r + 1) * ff];
                let a = |i: usize| w[i] as f64 * gaq[p * ff + i] as f64 * gad[p * ff / 32 + i / 32] as f64;
                want += wts[p] as f64 * (0..ff).map(a).sum::<f64>();
                scale += wts[p] as f64 * (0..ff).map(|i| a(i).abs()).sum::<f64>();
            }
            let gv = got[t * (hrows + 1) + r] as f64;
            assert!(gv.is_finite() && (gv - want).abs() <= 1e-5 * scale + 1e-6, "down_grp t {t} r {r}: got {gv} want {want}");
            worst_d = worst_d.max((gv - want).abs() / scale);
        }
        assert_eq!(got[t * (hrows + 1) + hrows], hid0[t * (hrows + 1) + hrows], "combine wrote past the rows");
    }
    eprintln!("moe grouped IQ4_XS {nt} tokens x top-{k} of {e}: gate/up max |diff| {worst:.2e} (q8 output), down+combine max rel {worst_d:.2e}");
}

/// Every grouped IQ4_XS kind (`fast::GrpKind`: plain, pinned, L2-prefetching with 64-row down
/// blocks) against the pinned kernels, bit for bit, and sampled rows against the f64 product of
/// the dequantized weights. Shapes: M2.7's widths at 32 tokens x top-3 over 9 experts (expert 0
/// takes all 32 tokens, the most a slot holds); inputs wider than one round of units (3584 ->
/// 2560 -> 43: partial row blocks); 80-unit rows. The FFN input comes from `norm_q8`; outputs
/// poisoned first.
#[test]
#[ignore = "needs a CUDA GPU"]
fn fast_grouped_kinds_are_bit_identical() {
    use fast::GrpKind;
    let g = gpu();
    // The register kinds themselves (the grouped streamed kernels: cuda_stream).
    minimax_rank::cuda::gstream::set_gstream(Some(false));
    let mut rng = Rng(0x5eed_0fa5_7000_0013);
    let ty = GgmlType::IQ4_XS;
    for &(nt, k, e, h, ff, hrows) in &[(32usize, 3usize, 9usize, 3072usize, 1536usize, 3072usize), (5, 3, 7, 3584, 2560, 43), (5, 2, 4, 2560, 1024, 43)] {
        let ex = random_experts(&g, &mut rng, ty, e, ff, h, hrows);
        let (gate, upw, down, gm, um, dm) = (&ex.gate, &ex.up, &ex.down, ex.gm, ex.um, ex.dm);
        let ids = routed(&mut rng, nt, k, e);
        let np = nt * k;
        let ib = g.upload(&ids).unwrap();
        let grp = g.zeros::<i32>(1 + 3 * e + np).unwrap();
        g.moe_group(g.ptr(&ib), np, e, g.ptr(&grp)).unwrap();
        let nslots = np.min(e);
        // The FFN input: RMSNorm + q8 of random hidden rows.
        let hid = rng.vec(nt * h, 3.0);
        let nw = rng.vec(h, 1.0);
        let (hb, nwb) = (g.upload(&hid).unwrap(), g.upload(&nw).unwrap());
        let xq = g.zeros::<i8>(nt * h).unwrap();
        let xd = poisoned(&g, nt * h / 32);
        g.norm_q8(g.ptr(&hb), h, g.ptr(&nwb), h, 1e-6, 0, 0, g.ptr(&xq), g.ptr(&xd), nt).unwrap();
        let xdq = q8_deq(&g.download(&xq).unwrap(), &g.download(&xd).unwrap());
        let run_gu = |kd: GrpKind| {
            let aq = g.zeros::<i8>(np * ff).unwrap();
            g.fill_u32(g.ptr(&aq), np * ff / 4, 0x7f7f_7f7f).unwrap();
            let ad = poisoned(&g, np * ff / 32);
            fast::set_grp_kind(Some(kd));
            g.moe_gate_up_grp(&gm, &um, g.ptr(&grp), e, nslots, k, g.ptr(&xq), g.ptr(&xd), g.ptr(&aq), g.ptr(&ad), ff).unwrap();
            fast::set_grp_kind(None);
            (aq, ad)
        };
        let (aq0, ad0) = run_gu(GrpKind::Pinned);
        let (c0, s0) = (g.download(&aq0).unwrap(), g.download(&ad0).unwrap());
        for kd in [GrpKind::Plain, GrpKind::Prefetch] {
            let (aq2, ad2) = run_gu(kd);
            assert!(c0 == g.download(&aq2).unwrap() && bits(&s0) == bits(&g.download(&ad2).unwrap()), "nt {nt} h {h}: grouped gate/up {kd:?} differs from Pinned");
        }
        let rb = quant::row_bytes(ty, h).unwrap();
        let mut worst = 0f32;
        for p in 0..np {
            let (ex, t) = (ids[p] as usize, p / k);
            let xv = &xdq[t * h..(t + 1) * h];
            for r in [0, 1, 31, 32, ff / 2 + 3, ff - 1, rng.below(ff)] {
                let row = |m: &[u8]| {
                    let o = (ex * ff + r) * rb;
                    let w = quant::dequantize_to_vec(ty, &m[o..o + rb], h).unwrap();
                    w.iter().zip(xv).map(|(a, b)| *a as f64 * *b as f64).sum::<f64>()
                };
                let (gg, uu) = (row(&gate), row(&upw));
                let want = (gg / (1.0 + (-gg).exp()) * uu) as f32;
                let got = c0[p * ff + r] as f32 * s0[p * ff / 32 + r / 32];
                let tol = s0[p * ff / 32 + r / 32] * 0.51 + 1e-4 * want.abs() + 1e-6;
                assert!(got.is_finite() && (got - want).abs() <= tol, "grouped gate/up nt {nt} pair {p} row {r}: got {got} want {want} tol {tol}");
                worst = worst.max((got - want).abs() / (want.abs() + 1e-3));
            }
        }
        let run_dn = |kd: GrpKind| {
            let dpart = poisoned(&g, np * hrows);
            fast::set_grp_kind(Some(kd));
            g.moe_down_grp_with(false, &dm, g.ptr(&grp), e, nslots, g.ptr(&aq0), g.ptr(&ad0), g.ptr(&dpart)).unwrap();
            fast::set_grp_kind(None);
            g.download(&dpart).unwrap()
        };
        let d0 = run_dn(GrpKind::Pinned);
        for kd in [GrpKind::Plain, GrpKind::Prefetch] {
            assert!(bits(&d0) == bits(&run_dn(kd)), "nt {nt} h {h}: grouped down {kd:?} differs from Pinned");
        }
        let drb = quant::row_bytes(ty, ff).unwrap();
        let mut worst_d = 0f64;
        for p in 0..np {
            let ex = ids[p] as usize;
            for r in [0, 1, 15, 16, 17, 63, 64, hrows - 1, rng.below(hrows)] {
                if r >= hrows {
                    continue;
                }
                let o = (ex * hrows + r) * drb;
                let w = quant::dequantize_to_vec(ty, &down[o..o + drb], ff).unwrap();
                let a = |i: usize| w[i] as f64 * c0[p * ff + i] as f64 * s0[p * ff / 32 + i / 32] as f64;
                let want: f64 = (0..ff).map(a).sum();
                let scale: f64 = (0..ff).map(|i| a(i).abs()).sum::<f64>() + 1e-6;
                let gv = d0[p * hrows + r] as f64;
                assert!(gv.is_finite() && (gv - want).abs() <= 1e-5 * scale, "grouped down nt {nt} pair {p} row {r}: got {gv} want {want}");
                worst_d = worst_d.max((gv - want).abs() / scale);
            }
        }
        eprintln!("grouped IQ4_XS kinds, {nt} tokens x top-{k} of {e} ({h} -> {ff} -> {hrows}): bit-identical; sampled rows: gate/up max rel {worst:.2e}, down max rel {worst_d:.2e}");
    }
    minimax_rank::cuda::gstream::set_gstream(None);
}

/// Grouped IQ4_XS down, both kernels (tensor-core `moe_down_grpm_iq4_xs` and dp4a
/// `moe_down_grp_iq4_xs`) against the f64 product of the dequantized weights and q8
/// activations: 24 tokens x top-2 over 5 experts, expert 1 taking all 24 (two m16 tiles of
/// pairs, the second partial), the others 6 each; 43 rows (a partial 32-row tile); every
/// written element checked, the output poisoned first.
#[test]
#[ignore = "needs a CUDA GPU"]
fn fast_grouped_down_kernels_match_cpu() {
    let g = gpu();
    let mut rng = Rng(0x5eed_0fa5_7000_0007);
    let ty = GgmlType::IQ4_XS;
    let (e, k, nt, ff, hrows) = (5usize, 2usize, 24usize, 512 * 3, 43usize);
    let down = random_rows(&mut rng, ty, e * hrows, ff);
    let (_d, dm) = upload_mat(&g, ty, &down, hrows, ff, e);
    let ids: Vec<i32> = (0..nt).flat_map(|t| [1, [0, 2, 3, 4][t % 4]]).collect();
    let act = rng.vec(nt * k * ff, 2.0);
    let (aq, ad) = q8_host(&act);
    let adq = q8_deq(&aq, &ad);
    let (aqb, adb, ib) = (g.upload(&aq).unwrap(), g.upload(&ad).unwrap(), g.upload(&ids).unwrap());
    let grp = g.zeros::<i32>(1 + 3 * e + nt * k).unwrap();
    g.moe_group(g.ptr(&ib), nt * k, e, g.ptr(&grp)).unwrap();
    let ddeq = quant::dequantize_to_vec(ty, &down, e * hrows * ff).unwrap();
    for mma in [true, false] {
        let dpart = poisoned(&g, nt * k * hrows);
        g.moe_down_grp_with(mma, &dm, g.ptr(&grp), e, e, g.ptr(&aqb), g.ptr(&adb), g.ptr(&dpart)).unwrap();
        let got = g.download(&dpart).unwrap();
        let mut worst = 0f64;
        for p in 0..nt * k {
            let ex = ids[p] as usize;
            for r in 0..hrows {
                let w = &ddeq[(ex * hrows + r) * ff..(ex * hrows + r + 1) * ff];
                let a = &adq[p * ff..(p + 1) * ff];
                let want: f64 = w.iter().zip(a).map(|(x, y)| *x as f64 * *y as f64).sum();
                let scale: f64 = w.iter().zip(a).map(|(x, y)| (*x as f64 * *y as f64).abs()).sum::<f64>() + 1e-6;
                let gv = got[p * hrows + r] as f64;
                assert!(gv.is_finite() && (gv - want).abs() <= 1e-5 * scale, "down_grp mma {mma} pair {p} (expert {ex}) row {r}: got {gv} want {want}");
                worst = worst.max((gv - want).abs() / scale);
            }
        }
        eprintln!("grouped down IQ4_XS (mma {mma}) {nt} tokens x top-{k}, 24 pairs on one expert: max |diff| / sum|w a| {worst:.2e}");
    }
}

/// Decode attention with the split merge in the last split block (`attn_dec6m_f16`) against
/// `attn_dec6_f16` + `attn_merge6`: merged f32 output and its q8 bit-identical, for contexts of
/// one page to several thousand positions (empty and full splits), 3 tokens of 3 sequences over
/// scrambled pages, 16 / 43 / 128 splits; launched twice (counters back at zero).
#[test]
#[ignore = "needs a CUDA GPU"]
fn fast_attention_merge_in_last_block_is_bit_identical() {
    let g = gpu();
    let mut rng = Rng(0x5eed_0fa5_7000_0005);
    let (kvh, hd, ps) = (2usize, 128usize, 16usize);
    let heads = 6 * kvh;
    let (qw, kw) = (heads * hd, kvh * hd);
    let pos: Vec<i32> = vec![4, 300, 2500];
    let nt = pos.len();
    // Each sequence's pages, scrambled over a pool.
    let n_pages = pos.iter().map(|&p| (p as usize + 1).div_ceil(ps)).sum::<usize>() + 5;
    let mut pool: Vec<u32> = (0..n_pages as u32).collect();
    for i in (1..pool.len()).rev() {
        pool.swap(i, rng.below(i + 1));
    }
    let (mut pts, mut pt_off) = (Vec::new(), Vec::new());
    for &p in &pos {
        pt_off.push(pts.len() as i32);
        let np = (p as usize + 1).div_ceil(ps);
        pts.extend(pool.drain(..np));
    }
    let seq: Vec<i32> = (0..nt as i32).collect();
    let (kc, vc) = (g.zeros::<u16>(n_pages * ps * kw).unwrap(), g.zeros::<u16>(n_pages * ps * kw).unwrap());
    g.fill_synthetic(g.ptr(&kc), GgmlType::F16, n_pages * ps * kw, 21, -2.0, 2.0).unwrap();
    g.fill_synthetic(g.ptr(&vc), GgmlType::F16, n_pages * ps * kw, 22, -2.0, 2.0).unwrap();
    let q = g.upload(&rng.vec(nt * qw, 1.0)).unwrap();
    let (pb, sb, ob, tb) = (g.upload(&pos).unwrap(), g.upload(&seq).unwrap(), g.upload(&pt_off).unwrap(), g.upload(&pts).unwrap());
    let meta = (g.ptr(&pb), g.ptr(&sb), g.ptr(&ob), g.ptr(&tb));
    let cnt = g.zeros::<u32>(nt * kvh).unwrap();
    for nsplit in [16usize, 43, 128] {
        let part = poisoned(&g, nt * kvh * nsplit * 6 * (hd + 2));
        let run = |fused: bool| {
            let out = poisoned(&g, nt * (qw + 3));
            let (aq, ad) = (g.zeros::<i8>(nt * qw).unwrap(), poisoned(&g, nt * qw / 32));
            g.fill_u32(g.ptr(&aq), nt * qw / 4, 0x7f7f_7f7f).unwrap();
            let c = if fused { Some(g.ptr(&cnt)) } else { None };
            g.attn_decode("f16", g.ptr(&q), qw, g.ptr(&kc), g.ptr(&vc), meta, ps, kvh, nsplit, 1.0 / (hd as f32).sqrt(), g.ptr(&part), g.ptr(&out), qw + 3, g.ptr(&aq), g.ptr(&ad), c, nt).unwrap();
            (g.download(&out).unwrap(), g.download(&aq).unwrap(), g.download(&ad).unwrap())
        };
        let want = run(false);
        for t in 0..nt {
            assert!(want.0[t * (qw + 3)..t * (qw + 3) + qw].iter().all(|v| v.is_finite()), "attn_merge6 output not finite (t {t})");
        }
        assert!(want.2.iter().all(|v| v.is_finite() && *v > 0.0), "attn_merge6 q8 scales");
        for rep in 0..2 {
            let got = run(true);
            assert_eq!(bits(&got.0), bits(&want.0), "attn_dec6m {nsplit} splits rep {rep}: output");
            assert_eq!(got.1, want.1, "attn_dec6m {nsplit} splits rep {rep}: q8");
            assert_eq!(bits(&got.2), bits(&want.2), "attn_dec6m {nsplit} splits rep {rep}: q8 scales");
            assert_eq!(g.download(&cnt).unwrap(), vec![0; nt * kvh], "attn_dec6m: counters left non-zero");
        }
        eprintln!("attn_dec6m_f16, {nsplit} splits, contexts {pos:?}: bit-identical to attn_dec6 + attn_merge6");
    }
}

/// Pages of each token's own sequence, scrambled over a pool: (pages, offsets, pool size).
fn scrambled_pages(rng: &mut Rng, ctx: &[usize], ps: usize) -> (Vec<u32>, Vec<i32>, usize) {
    let n_pages = ctx.iter().map(|&n| n.div_ceil(ps)).sum::<usize>() + 5;
    let mut pool: Vec<u32> = (0..n_pages as u32).collect();
    for i in (1..pool.len()).rev() {
        pool.swap(i, rng.below(i + 1));
    }
    let (mut pts, mut pt_off) = (Vec::new(), Vec::new());
    for &n in ctx {
        pt_off.push(pts.len() as i32);
        pts.extend(pool.drain(..n.div_ceil(ps)));
    }
    (pts, pt_off, n_pages)
}

/// Split-K decode attention, both kernels (tensor-core `attn_dec6t_*` and SIMT `attn_dec6_*`),
/// merged by `attn_merge6` and in the last split block, against an f64 softmax over the
/// cache's exact values: contexts of 1, 17, 4,097 and 32,768 positions in one launch, 32
/// tokens of different lengths, 4 KV heads (a tensor-2 rank) with a bf16 cache and pages of 7
/// positions (tiles straddle pages), soft and peaked attention (query scales 1 and 6); split
/// counts 1, 7, the default choice and 128. |err| <= 5e-5 (sum p |v| / sum p) + 1e-6; the
/// q8 copy is the host quantization of the f32 output; outputs NaN-poisoned (the stride's pad
/// must stay NaN); merged in the last block is bit-identical to `attn_merge6`.
#[test]
#[ignore = "needs a CUDA GPU"]
fn fast_decode_attention_matches_f64() {
    let g = gpu();
    let mut rng = Rng(0x5eed_0fa5_7000_0007);
    let hd = 128usize;
    let many: Vec<usize> = (0..32).map(|i| 1 + (i * 977 + i * i * 31) % 2100).collect();
    // (cache type, KV heads, page size, context lengths)
    let cases: [(&str, usize, usize, Vec<usize>); 3] = [("f16", 2, 16, vec![1, 17, 4097, 32768]), ("bf16", 4, 7, vec![300, 1, 2049, 16, 33]), ("f16", 1, 16, many)];
    for (kv, kvh, ps, ctx) in cases {
        let nt = ctx.len();
        let heads = 6 * kvh;
        let (qw, kw) = (heads * hd, kvh * hd);
        let (pts, pt_off, n_pages) = scrambled_pages(&mut rng, &ctx, ps);
        let seq: Vec<i32> = (0..nt as i32).collect();
        let pos: Vec<i32> = ctx.iter().map(|&n| n as i32 - 1).collect();
        let ty = if kv == "bf16" { GgmlType::BF16 } else { GgmlType::F16 };
        let (kc, vc) = (g.zeros::<u16>(n_pages * ps * kw).unwrap(), g.zeros::<u16>(n_pages * ps * kw).unwrap());
        g.fill_synthetic(g.ptr(&kc), ty, n_pages * ps * kw, 31, -2.0, 2.0).unwrap();
        g.fill_synthetic(g.ptr(&vc), ty, n_pages * ps * kw, 32, -2.0, 2.0).unwrap();
        let h2f = |b: u16| if kv == "bf16" { f32::from_bits((b as u32) << 16) } else { quant::f16_to_f32(b) };
        let kh: Vec<f32> = g.download(&kc).unwrap().into_iter().map(h2f).collect();
        let vh: Vec<f32> = g.download(&vc).unwrap().into_iter().map(h2f).collect();
        let mut q = Vec::with_capacity(nt * qw);
        for t in 0..nt {
            q.extend(rng.vec(qw, if t % 2 == 0 { 1.0 } else { 6.0 }));
        }
        let scale = 1.0 / (hd as f32).sqrt();
        // f64 reference (from q * scale rounded to f32, as the kernels scale it) and the
        // scale of each output, sum p |v| / sum p.
        let (mut want, mut mag) = (vec![0f64; nt * qw], vec![0f64; nt * qw]);
        for t in 0..nt {
            let slot = |p: usize| pts[pt_off[t] as usize + p / ps] as usize * ps + p % ps;
            for h in 0..heads {
                let kv_h = h / 6;
                let qh: Vec<f64> = (0..hd).map(|d| (q[t * qw + h * hd + d] * scale) as f64).collect();
                let s: Vec<f64> = (0..ctx[t])
                    .map(|p| {
                        let kr = &kh[(slot(p) * kvh + kv_h) * hd..][..hd];
                        (0..hd).map(|d| qh[d] * kr[d] as f64).sum::<f64>()
                    })
                    .collect();
                let mx = s.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
                let e: Vec<f64> = s.iter().map(|x| (x - mx).exp()).collect();
                let sum: f64 = e.iter().sum();
                let (o, a) = (&mut want[t * qw + h * hd..][..hd], &mut mag[t * qw + h * hd..][..hd]);
                for (p, ep) in e.iter().enumerate() {
                    let vr = &vh[(slot(p) * kvh + kv_h) * hd..][..hd];
                    for d in 0..hd {
                        o[d] += ep * vr[d] as f64;
                        a[d] += ep * (vr[d] as f64).abs();
                    }
                }
                for d in 0..hd {
                    o[d] /= sum;
                    a[d] /= sum;
                }
            }
        }
        let qb = g.upload(&q).unwrap();
        let (pb, sb, ob, tb) = (g.upload(&pos).unwrap(), g.upload(&seq).unwrap(), g.upload(&pt_off).unwrap(), g.upload(&pts).unwrap());
        let meta = (g.ptr(&pb), g.ptr(&sb), g.ptr(&ob), g.ptr(&tb));
        let cnt = g.zeros::<u32>(nt * kvh).unwrap();
        let os = qw + 3;
        let part = poisoned(&g, nt * kvh * 128 * 6 * (hd + 2));
        for mma in [true, false] {
            let auto = g.attn_splits(mma, kvh, fast::nsplit_for(nt), nt).unwrap();
            for ns in [1usize, 7, auto, 128] {
                let run = |fused: bool| {
                    let out = poisoned(&g, nt * os);
                    let (aq, ad) = (g.zeros::<i8>(nt * qw).unwrap(), poisoned(&g, nt * qw / 32));
                    g.fill_u32(g.ptr(&aq), nt * qw / 4, 0x7f7f_7f7f).unwrap();
                    let c = if fused { Some(g.ptr(&cnt)) } else { None };
                    g.attn_decode_with(mma, kv, g.ptr(&qb), qw, g.ptr(&kc), g.ptr(&vc), meta, ps, kvh, ns, scale, g.ptr(&part), g.ptr(&out), os, g.ptr(&aq), g.ptr(&ad), c, nt).unwrap();
                    (g.download(&out).unwrap(), g.download(&aq).unwrap(), g.download(&ad).unwrap())
                };
                let what = format!("{} {kv}, {kvh} KV heads, pages of {ps}, {ns} splits", if mma { "attn_dec6t" } else { "attn_dec6" });
                let (out, aq, ad) = run(false);
                let mut rows = Vec::with_capacity(nt * qw);
                let mut worst = 0f64;
                for t in 0..nt {
                    let r = &out[t * os..][..os];
                    assert!(r[qw..].iter().all(|v| v.is_nan()), "{what}: wrote past the heads (t {t})");
                    for i in 0..qw {
                        let (gv, wv, a) = (r[i] as f64, want[t * qw + i], mag[t * qw + i]);
                        let err = (gv - wv).abs();
                        assert!(gv.is_finite() && err <= 5e-5 * a + 1e-6, "{what}: token {t} (context {}) [{i}]: {gv} vs {wv} (scale {a})", ctx[t]);
                        worst = worst.max(err / (a + 1e-6));
                    }
                    rows.extend_from_slice(&r[..qw]);
                }
                let (hq, hdq) = q8_host(&rows);
                assert_eq!(aq, hq, "{what}: q8");
                assert_eq!(bits(&ad), bits(&hdq), "{what}: q8 scales");
                if ns <= fast::ATTN_FUSE_MAX_SPLIT {
                    let f = run(true);
                    assert_eq!(bits(&f.0), bits(&out), "{what}: merged in the last block, output");
                    assert_eq!((f.1, bits(&f.2)), (aq, bits(&ad)), "{what}: merged in the last block, q8");
                    assert_eq!(g.download(&cnt).unwrap(), vec![0; nt * kvh], "{what}: counters left non-zero");
                }
                eprintln!("{what}, contexts {}..{} ({nt} tokens): max |err| / scale {worst:.2e}", ctx.iter().min().unwrap(), ctx.iter().max().unwrap());
            }
        }
    }
    // Bad arguments: typed errors.
    let z = (0, 0, 0, 0);
    assert!(g.attn_decode_with(true, "f32", 0, 0, 0, 0, z, 16, 1, 1, 1.0, 0, 0, 0, 0, 0, None, 1).is_err(), "f32 cache");
    assert!(g.attn_decode_with(true, "f16", 0, 0, 0, 0, z, 0, 1, 1, 1.0, 0, 0, 0, 0, 0, None, 1).is_err(), "page size 0");
    assert!(g.attn_decode_with(true, "f16", 0, 0, 0, 0, z, 16, 1, 0, 1.0, 0, 0, 0, 0, 0, None, 1).is_err(), "0 splits");
    assert!(g.attn_decode_with(true, "f16", 0, 0, 0, 0, z, 16, 1, 129, 1.0, 0, 0, 0, 0, 0, Some(0), 1).is_err(), "129 splits merged in the last block");
    assert!(g.attn_splits(true, 0, 16, 1).is_err(), "0 KV heads");
}

/// Decode attention speed at 32k context (no assertion on speed; prints): 62 launches over 8
/// distinct layer caches of 8 KV heads (1 GiB, past L2), one token, each kernel and split
/// count; and one token at context 105 (launch-bound here: graphs decide, see minimax-bench).
#[test]
#[ignore = "needs a CUDA GPU"]
fn fast_decode_attention_speed() {
    let g = gpu();
    let (kvh, hd, ps, layers) = (8usize, 128usize, 16usize, 8usize);
    let (qw, kw) = (6 * kvh * hd, kvh * hd);
    let slots = 32768 + 256;
    let caches: Vec<_> = (0..2 * layers)
        .map(|i| {
            let c = g.zeros::<u16>(slots * kw).unwrap();
            g.fill_synthetic(g.ptr(&c), GgmlType::F16, slots * kw, 40 + i as u64, -2.0, 2.0).unwrap();
            c
        })
        .collect();
    let mut rng = Rng(0x5eed_0fa5_7000_0008);
    let qb = g.upload(&rng.vec(qw, 2.0)).unwrap();
    let pts: Vec<u32> = (0..(slots / ps) as u32).collect();
    let (sb, ob, tb) = (g.upload(&[0i32]).unwrap(), g.upload(&[0i32]).unwrap(), g.upload(&pts).unwrap());
    let part = g.zeros::<f32>(kvh * 128 * 6 * (hd + 2)).unwrap();
    let out = g.zeros::<f32>(qw).unwrap();
    let (aq, ad) = (g.zeros::<i8>(qw).unwrap(), g.zeros::<f32>(qw / 32).unwrap());
    let cnt = g.zeros::<u32>(kvh).unwrap();
    let auto = g.attn_splits(true, kvh, fast::nsplit_for(1), 1).unwrap();
    for ctx in [32769usize, 8193, 105] {
        let pb = g.upload(&[ctx as i32 - 1]).unwrap();
        let meta = (g.ptr(&pb), g.ptr(&sb), g.ptr(&ob), g.ptr(&tb));
        let mut variants = vec![(false, 128, false), (false, 128, true), (true, auto, false), (true, auto, true)];
        variants.extend([8usize, 12, 16, 17, 24, 33, 48, 128].into_iter().filter(|&n| n != auto).map(|n| (true, n, false)));
        for (mma, ns, fused) in variants {
            let launch = |l: usize| {
                let c = if fused { Some(g.ptr(&cnt)) } else { None };
                let (k, v) = (&caches[2 * (l % layers)], &caches[2 * (l % layers) + 1]);
                g.attn_decode_with(mma, "f16", g.ptr(&qb), qw, g.ptr(k), g.ptr(v), meta, ps, kvh, ns, 0.088, g.ptr(&part), g.ptr(&out), qw, g.ptr(&aq), g.ptr(&ad), c, 1).unwrap();
            };
            for l in 0..16 {
                launch(l);
            }
            g.sync().unwrap();
            let reps = 5;
            let t0 = std::time::Instant::now();
            for l in 0..62 * reps {
                launch(l);
            }
            g.sync().unwrap();
            let per_tok = t0.elapsed().as_secs_f64() * 1e3 / reps as f64;
            let gbs = (ctx * kvh * hd * 2 * 2 * 62) as f64 / (per_tok * 1e-3) / 1e9;
            eprintln!("attention speed: context {ctx}, {} {ns} splits, merge {}: {per_tok:.3} ms per token (62 layers) = {:.1} us per layer, K/V at {gbs:.0} GB/s", if mma { "attn_dec6t" } else { "attn_dec6 " }, if fused { "in last block" } else { "attn_merge6  " }, per_tok * 1e3 / 62.0);
        }
    }
}

/// The persistent expert kernels (`moe_gate_up_pst_iq4_xs`, `moe_down_pst_iq4_xs`: one wave of
/// blocks walking the tasks, several tasks per block, token changes between tasks) against the
/// register-direct kernels they replace (`Reg(2)` / `Reg4`, checked against the CPU in
/// `fast_q8_products_and_fused_moe_match_cpu`): bit-identical. Gate/up with inputs of 80 units
/// (a partial lane round) and activations written 64 apart beyond the rows (the tensor-parallel
/// pad, never written); down rows 43 (odd: a half-empty row pair) and 3040.
#[test]
#[ignore = "needs a CUDA GPU"]
fn fast_persistent_moe_kernels_match_register_kernels() {
    let g = gpu();
    let mut rng = Rng(0x5eed_0fa5_7000_0006);
    let ty = GgmlType::IQ4_XS;
    let (e, k, nt, h, ff) = (6usize, 3usize, 2usize, 2560usize, 1536usize);
    let ld = ff + 64;
    let gate = random_rows(&mut rng, ty, e * ff, h);
    let upw = random_rows(&mut rng, ty, e * ff, h);
    let (_g1, gm) = upload_mat(&g, ty, &gate, ff, h, e);
    let (_g2, um) = upload_mat(&g, ty, &upw, ff, h, e);
    let ids: Vec<i32> = vec![4, 0, 5, 2, 4, 1];
    let x = rng.vec(nt * h, 2.0);
    let (hq, hd) = q8_host(&x);
    let (qb, db, ib) = (g.upload(&hq).unwrap(), g.upload(&hd).unwrap(), g.upload(&ids).unwrap());
    let run = |kind: GateUpKind| {
        let aq = g.zeros::<i8>(nt * k * ld).unwrap();
        g.fill_u32(g.ptr(&aq), nt * k * ld / 4, 0x7f7f_7f7f).unwrap();
        let ad = poisoned(&g, nt * k * ld / 32);
        g.moe_gate_up_q8_with(kind, &gm, &um, g.ptr(&ib), k, g.ptr(&qb), g.ptr(&db), g.ptr(&aq), g.ptr(&ad), nt * k, ld).unwrap();
        (g.download(&aq).unwrap(), g.download(&ad).unwrap())
    };
    let want = run(GateUpKind::Reg(2, true));
    for p in 0..nt * k {
        assert!(want.1[p * ld / 32..p * ld / 32 + ff / 32].iter().all(|v| v.is_finite()), "reg2 gate/up scales of pair {p}");
        assert!(want.0[p * ld + ff..(p + 1) * ld].iter().all(|&q| q == 0x7f), "reg2 wrote the pad of pair {p}");
    }
    for rep in 0..2 {
        for kind in [GateUpKind::Persist, GateUpKind::PersistIl, GateUpKind::PersistSm] {
            let got = run(kind);
            assert_eq!(got.0, want.0, "gate/up {kind:?} q8 (rep {rep})");
            assert_eq!(bits(&got.1), bits(&want.1), "gate/up {kind:?} scales (rep {rep})");
        }
    }
    eprintln!("moe_gate_up_pst_iq4_xs {} pairs x {ff} rows x {h}: bit-identical to reg2", nt * k);
    // Down: 3 tokens x top-5 of 7 experts, rows of 1536 (5 x 48 = 240 units per output row).
    let (e, k, nt) = (7usize, 5usize, 3usize);
    let ids: Vec<i32> = vec![0, 3, 6, 2, 5, 1, 3, 4, 6, 0, 2, 5, 6, 1, 4];
    let wts = rng.vec(nt * k, 0.5);
    let act = rng.vec(nt * k * ff, 2.0);
    let (aqh, adh) = q8_host(&act);
    let (ib, wb, aq, ad) = (g.upload(&ids).unwrap(), g.upload(&wts).unwrap(), g.upload(&aqh).unwrap(), g.upload(&adh).unwrap());
    for rows in [43usize, 3040] {
        let down = random_rows(&mut rng, ty, e * rows, ff);
        let (_db, dm) = upload_mat(&g, ty, &down, rows, ff, e);
        let hid0 = rng.vec(nt * (rows + 1), 1.0);
        let run = |kind: DownKind| {
            let hb = g.upload(&hid0).unwrap();
            g.moe_down_q8_with(kind, &dm, g.ptr(&ib), g.ptr(&wb), k, g.ptr(&aq), g.ptr(&ad), g.ptr(&hb), rows + 1, nt).unwrap();
            g.download(&hb).unwrap()
        };
        let want = run(DownKind::Reg4);
        assert!(want.iter().all(|v| v.is_finite()), "reg4 down not finite");
        for t in 0..nt {
            assert_eq!(want[t * (rows + 1) + rows], hid0[t * (rows + 1) + rows], "reg4 wrote past the rows");
        }
        assert_ne!(bits(&want), bits(&hid0), "reg4 down changed nothing");
        for rep in 0..2 {
            assert_eq!(bits(&run(DownKind::Persist)), bits(&want), "down persistent, {rows} rows (rep {rep})");
            assert_eq!(bits(&run(DownKind::Reg4Pre)), bits(&want), "down rx4 (pre-wait loads), {rows} rows (rep {rep})");
        }
        eprintln!("moe_down_pst_iq4_xs {nt} tokens x top-{k}, {rows} rows: bit-identical to reg4");
    }
}

/// MiniMax-M2.7-sized expert kernels of a batch-1 step (64 IQ4_XS experts of 1536 x 3072 per
/// matrix, top-8, ids rotating over all 64 so nothing stays in L2): the new kernels
/// (`PersistIl` gate/up, `Reg4Pre` down) bit-identical to the ones they replace at this shape,
/// then the time per layer of gate/up alone, down alone and the gate/up + down pair, launched
/// back to back with PDL as in a step (62 layers x 5).
#[test]
#[ignore = "needs a CUDA GPU"]
fn fast_moe_expert_kernels_speed() {
    use minimax_rank::cuda::DevMat;
    let g = gpu();
    let (e, k, h, ff) = (64usize, 8usize, 3072usize, 1536usize);
    let ty = GgmlType::IQ4_XS;
    let mk = |rows: usize, cols: usize, seed: u64| {
        let rb = cols / 256 * ty.block_bytes();
        let buf = g.zeros::<u8>(e * rows * rb).unwrap();
        g.fill_synthetic(g.ptr(&buf), ty, e * rows * cols, seed, -1.0, 1.0).unwrap();
        let m = DevMat { ptr: g.ptr(&buf), ty, rows, cols, row_bytes: rb, n_experts: e, expert_stride: rows * rb };
        (buf, m)
    };
    let ((_gb, gm), (_ub, um), (_db, dm)) = (mk(ff, h, 11), mk(ff, h, 12), mk(h, ff, 13));
    let mut rng = Rng(0x5eed_0fa5_7000_0009);
    let x = rng.vec(h, 2.0);
    let (hq, hd) = q8_host(&x);
    let (qb, db) = (g.upload(&hq).unwrap(), g.upload(&hd).unwrap());
    let idsets: Vec<_> = (0..8).map(|l| g.upload(&(0..k).map(|j| ((l * k + j * 5) % e) as i32).collect::<Vec<_>>()).unwrap()).collect();
    let wb = g.upload(&rng.vec(k, 0.5)).unwrap();
    let aq = g.zeros::<i8>(k * ff).unwrap();
    let ad = poisoned(&g, k * ff / 32);
    let hid0 = rng.vec(h, 1.0);
    let hb = g.upload(&hid0).unwrap();
    let gu = |kind: GateUpKind, l: usize| g.moe_gate_up_q8_with(kind, &gm, &um, g.ptr(&idsets[l % 8]), k, g.ptr(&qb), g.ptr(&db), g.ptr(&aq), g.ptr(&ad), k, ff).unwrap();
    let dn = |kind: DownKind, l: usize| g.moe_down_q8_with(kind, &dm, g.ptr(&idsets[l % 8]), g.ptr(&wb), k, g.ptr(&aq), g.ptr(&ad), g.ptr(&hb), h, 1).unwrap();
    // Bit-identity at the real shape.
    gu(GateUpKind::Persist, 3);
    let want = (g.download(&aq).unwrap(), g.download(&ad).unwrap());
    assert!(want.1.iter().all(|v| v.is_finite()), "gate/up scales");
    for kind in [GateUpKind::PersistIl, GateUpKind::PersistSm] {
        g.fill_u32(g.ptr(&ad), k * ff / 32, 0x7fc0_0000).unwrap();
        g.fill_u32(g.ptr(&aq), k * ff / 4, 0x7f7f_7f7f).unwrap();
        gu(kind, 3);
        assert_eq!(g.download(&aq).unwrap(), want.0, "{kind:?} q8 at M2.7 shape");
        assert_eq!(bits(&g.download(&ad).unwrap()), bits(&want.1), "{kind:?} scales at M2.7 shape");
    }
    let mut outs = Vec::new();
    for kind in [DownKind::Reg4, DownKind::Reg4Pre] {
        let hb2 = g.upload(&hid0).unwrap();
        g.moe_down_q8_with(kind, &dm, g.ptr(&idsets[3]), g.ptr(&wb), k, g.ptr(&aq), g.ptr(&ad), g.ptr(&hb2), h, 1).unwrap();
        outs.push(bits(&g.download(&hb2).unwrap()));
    }
    assert_eq!(outs[0], outs[1], "rx4 down at M2.7 shape");
    assert_ne!(outs[0], bits(&hid0), "down changed nothing");
    eprintln!("M2.7 expert shapes: psx / psy gate/up and rx4 down bit-identical to pst / reg4");
    let reps = 62 * 5;
    let time = |f: &dyn Fn(usize)| launch_us(&g, 16, reps, f);
    let wbytes = (2 * k * ff * gm.row_bytes) as f64;
    for gk in [GateUpKind::Persist, GateUpKind::PersistIl, GateUpKind::PersistSm] {
        let us = time(&|l| gu(gk, l));
        eprintln!("expert speed: gate/up {gk:?} alone {us:.2} us per layer ({:.0} GB/s)", wbytes / us / 1e3);
    }
    for dk in [DownKind::Reg4, DownKind::Reg4Pre] {
        let us = time(&|l| dn(dk, l));
        eprintln!("expert speed: down {dk:?} alone {us:.2} us per layer ({:.0} GB/s)", wbytes / 2.0 / us / 1e3);
    }
    for (gk, dk) in [(GateUpKind::Persist, DownKind::Reg4), (GateUpKind::PersistIl, DownKind::Reg4), (GateUpKind::PersistSm, DownKind::Reg4), (GateUpKind::PersistIl, DownKind::Reg4Pre), (GateUpKind::PersistSm, DownKind::Reg4Pre)] {
        let us = time(&|l| {
            gu(gk, l);
            dn(dk, l);
        });
        eprintln!("expert speed: gate/up {gk:?} + down {dk:?}: {us:.2} us per layer");
    }
}

/// The PDL pre-wait dense products (`mvqs_*p`, the 2-rows-per-warp `mvqs_*s2p`) against the
/// CPU twin and bit for bit against the plain `mvqs_*`: rows of 5 and 12 chunks (one phase,
/// where s2p applies) and 24 (`mvqs_*lp`), three segments of 37 + 8 + 21 rows (a warp's row
/// pair straddles segments 0 and 1), 1 to 3 vectors, NaN-poisoned outputs or accumulation.
#[test]
#[ignore = "needs a CUDA GPU"]
fn fast_pdl_prewait_products_match_plain_and_cpu() {
    use minimax_rank::cuda::fast::{PDL_MVQS, PDL_MVQS2, set_pdl_parts};
    let g = gpu();
    let mut rng = Rng(0x5eed_0fa5_7000_00d1);
    let ty = GgmlType::Q8_0;
    for cols in [256 * 5, 256 * 12, 256 * 24] {
        let rows = [37usize, 8, 21];
        let mats: Vec<Vec<u8>> = rows.iter().map(|&r| random_rows(&mut rng, ty, r, cols)).collect();
        let up: Vec<_> = mats.iter().zip(rows).map(|(b, r)| upload_mat(&g, ty, b, r, cols, 0)).collect();
        let deq: Vec<Vec<f32>> = (0..3).map(|i| quant::dequantize_to_vec(ty, &mats[i], rows[i] * cols).unwrap()).collect();
        for nv in [1usize, 2, 3] {
            let x = rng.vec(nv * cols, 2.0);
            let (hq, hd) = q8_host(&x);
            let xdq = q8_deq(&hq, &hd);
            let (qb, db) = (g.upload(&hq).unwrap(), g.upload(&hd).unwrap());
            for acc in [false, true] {
                let ys: Vec<usize> = rows.iter().map(|r| r + 2).collect();
                let y0: Vec<Vec<f32>> = ys.iter().map(|s| rng.vec(nv * s, 1.0)).collect();
                let mut outs: Vec<Vec<Vec<f32>>> = Vec::new();
                for parts in [0, PDL_MVQS, PDL_MVQS | PDL_MVQS2] {
                    set_pdl_parts(Some(parts));
                    let yb: Vec<_> = (0..3).map(|i| if acc { g.upload(&y0[i]).unwrap() } else { poisoned(&g, nv * ys[i]) }).collect();
                    let segs: Vec<_> = (0..3).map(|i| (&up[i].1, g.ptr(&yb[i]), ys[i])).collect();
                    let r = g.matvec_q8_with(MvqKind::Whole, &segs, g.ptr(&qb), g.ptr(&db), cols, nv, acc);
                    set_pdl_parts(None);
                    r.unwrap();
                    let got: Vec<Vec<f32>> = yb.iter().map(|b| g.download(b).unwrap()).collect();
                    for i in 0..3 {
                        for v in 0..nv {
                            for r in 0..rows[i] {
                                let w = &deq[i][r * cols..(r + 1) * cols];
                                let xv = &xdq[v * cols..(v + 1) * cols];
                                let want: f64 = w.iter().zip(xv).map(|(a, b)| *a as f64 * *b as f64).sum::<f64>() + if acc { y0[i][v * ys[i] + r] as f64 } else { 0.0 };
                                let scale: f64 = w.iter().zip(xv).map(|(a, b)| (*a as f64 * *b as f64).abs()).sum::<f64>() + 1e-6;
                                let gv = got[i][v * ys[i] + r];
                                assert!(gv.is_finite() && (gv as f64 - want).abs() <= 1e-5 * scale + 1e-6, "parts {parts} cols {cols} seg {i} nv {nv} acc {acc} [{v},{r}]: got {gv} want {want}");
                            }
                            for r in rows[i]..ys[i] {
                                let gv = got[i][v * ys[i] + r];
                                assert!(if acc { gv == y0[i][v * ys[i] + r] } else { gv.is_nan() }, "parts {parts} cols {cols}: wrote past the rows");
                            }
                        }
                    }
                    outs.push(got);
                }
                for (p, o) in outs.iter().enumerate().skip(1) {
                    for i in 0..3 {
                        assert_eq!(bits(&o[i]), bits(&outs[0][i]), "variant {p} cols {cols} seg {i} nv {nv} acc {acc}: not bit-identical to mvqs_*");
                    }
                }
            }
        }
    }
    eprintln!("mvqs_*p / mvqs_*s2p: within 1e-5 of sum |w x| and bit-identical to mvqs_* (5 / 12 / 24 chunks, 1-3 vectors)");
}

/// The q/k/v product on the streamed down's x8 hand-over (`mvqs_q8_0_1s2p8`): q8 codes with a
/// scale per 8 columns of u = h * nw and the groups' sums of h^2, the RMSNorm's 1 / rms taken by
/// the kernel. Against the f64 product of the dequantized rows with the dequantized codes times
/// the f64 1 / rms: rows of 5 and 12 chunks, three segments of 37 + 8 + 21 rows, NaN-poisoned
/// outputs (nothing written past the rows); deterministic; 24-chunk rows refused by name.
#[test]
#[ignore = "needs a CUDA GPU"]
fn fast_x8_product_matches_f64() {
    let g = gpu();
    let mut rng = Rng(0x5eed_0fa5_7000_00d9);
    let ty = GgmlType::Q8_0;
    let eps = 1e-6f32;
    for cols in [256 * 5, 256 * 12] {
        let rows = [37usize, 8, 21];
        let mats: Vec<Vec<u8>> = rows.iter().map(|&r| random_rows(&mut rng, ty, r, cols)).collect();
        let up: Vec<_> = mats.iter().zip(rows).map(|(b, r)| upload_mat(&g, ty, b, r, cols, 0)).collect();
        let deq: Vec<Vec<f32>> = (0..3).map(|i| quant::dequantize_to_vec(ty, &mats[i], rows[i] * cols).unwrap()).collect();
        let h = rng.vec(cols, 3.0);
        let nw = rng.vec(cols, 1.0);
        let ng = cols / 8;
        let (mut xq, mut xd, mut ss) = (vec![0i8; cols], vec![0f32; ng], vec![0f32; ng]);
        for gi in 0..ng {
            let u: Vec<f32> = (0..8).map(|l| h[8 * gi + l] * nw[8 * gi + l]).collect();
            let am = u.iter().fold(0f32, |m, v| m.max(v.abs()));
            xd[gi] = am / 127.0;
            for l in 0..8 {
                xq[8 * gi + l] = if am == 0.0 { 0 } else { (u[l] / xd[gi]).round_ties_even() as i8 };
            }
            ss[gi] = (0..8).map(|l| h[8 * gi + l] * h[8 * gi + l]).sum();
        }
        let inv = 1.0 / ((h.iter().map(|v| *v as f64 * *v as f64).sum::<f64>() / cols as f64) + eps as f64).sqrt();
        let xv: Vec<f64> = (0..cols).map(|c| xq[c] as f64 * xd[c / 8] as f64 * inv).collect();
        let (qb, db, sb) = (g.upload(&xq).unwrap(), g.upload(&xd).unwrap(), g.upload(&ss).unwrap());
        let ys: Vec<usize> = rows.iter().map(|r| r + 2).collect();
        let mut first: Option<Vec<Vec<u32>>> = None;
        for rep in 0..2 {
            let yb: Vec<_> = (0..3).map(|i| poisoned(&g, ys[i])).collect();
            let segs: Vec<_> = (0..3).map(|i| (&up[i].1, g.ptr(&yb[i]), ys[i])).collect();
            assert!(Gpu::x8_fits(&segs, cols));
            g.matvec_q8_x8(&segs, g.ptr(&qb), g.ptr(&db), g.ptr(&sb), eps, cols).unwrap();
            let got: Vec<Vec<f32>> = yb.iter().map(|b| g.download(b).unwrap()).collect();
            for i in 0..3 {
                for r in 0..rows[i] {
                    let w = &deq[i][r * cols..(r + 1) * cols];
                    let want: f64 = w.iter().zip(&xv).map(|(a, b)| *a as f64 * b).sum();
                    let scale: f64 = w.iter().zip(&xv).map(|(a, b)| (*a as f64 * b).abs()).sum::<f64>() + 1e-6;
                    let gv = got[i][r];
                    assert!(gv.is_finite() && (gv as f64 - want).abs() <= 1e-5 * scale + 1e-6, "cols {cols} seg {i} row {r}: got {gv} want {want}");
                }
                for r in rows[i]..ys[i] {
                    assert!(got[i][r].is_nan(), "cols {cols} seg {i}: wrote past the rows");
                }
            }
            let b: Vec<Vec<u32>> = got.iter().map(|v| bits(v)).collect();
            match &first {
                None => first = Some(b),
                Some(f) => assert_eq!(&b, f, "cols {cols}: not deterministic (rep {rep})"),
            }
        }
    }
    let wide = random_rows(&mut rng, ty, 4, 256 * 24);
    let (_wb, wm) = upload_mat(&g, ty, &wide, 4, 256 * 24, 0);
    let segs = [(&wm, 0u64, 4usize)];
    assert!(!Gpu::x8_fits(&segs, 256 * 24));
    let e = g.matvec_q8_x8(&segs, 0, 0, 0, eps, 256 * 24).unwrap_err();
    assert!(e.to_string().contains("matvec_q8_x8"), "{e}");
    eprintln!("mvqs_q8_0_1s2p8 (x8 activations, 1 / rms in the kernel): within 1e-5 of sum |w x| of f64, deterministic (5 / 12 chunks); 24 chunks refused");
}

/// The default memory pool keeps freed memory across synchronizations when asked
/// (`set_pool_keep(true)`, `MINIMAX_POOL_KEEP`) and hands it back otherwise (trimmed at once).
#[test]
#[ignore = "needs a CUDA GPU"]
fn memory_pool_keeps_or_returns_freed_memory() {
    let g = gpu();
    const BYTES: usize = 256 << 20;
    for keep in [true, false, true] {
        g.set_pool_keep(keep).unwrap();
        let b = g.zeros::<u8>(BYTES).unwrap();
        drop(b);
        g.sync().unwrap();
        let (now, high) = g.pool_reserved().unwrap();
        eprintln!("pool keep {keep}: reserved {now} bytes after a freed {BYTES}-byte buffer and a sync (high-water mark {high})");
        assert!(high >= BYTES as u64, "the pool never held the buffer: high-water mark {high}");
        if keep {
            assert!(now >= BYTES as u64, "keep: the pool handed back the freed buffer ({now} bytes left)");
        } else {
            assert!(now < BYTES as u64, "release threshold 0: the pool still holds {now} bytes after the sync");
        }
    }
    g.set_pool_keep(false).unwrap();
    assert!(g.pool_reserved().unwrap().0 < BYTES as u64, "trim after turning keep off");
}

fn launched_names(g: &Gpu, f: impl FnOnce()) -> Vec<String> {
    g.profile_begin();
    f();
    g.profile_end().unwrap().into_iter().map(|(n, _)| n).collect()
}

/// `attn_dec6tn_*` / `attn_dec6tnm_*` (decode attention of one token that does the q / k norms,
/// RoPE and the KV store itself, from the raw q/k/v rows and the step's `rope_table`) against `qk_norm_rope_store_*` + `attn_dec6t_*` (+ `attn_merge6` or the last-block
/// merge), and against an f64 reference over the host's norm and RoPE: contexts of 1, 17, 600
/// 1, 10, 17, 26, 600, 2,100 and 2,110 positions (the new position in splits 0, 0, 1, 1, 12,
/// 14 and 14 of the default 16, tiles 0, 0, 0, 0, 1, 5 and 5, rows 0, 9, 0, 9, 7, 3 and 13),
/// the first K/V tiles before and after the PDL wait, f16 and bf16 caches, pages of 16 and 7 positions
/// scrambled over a pool, 8 KV heads, RoPE on 64 of 128 dims. Output, its q8 copy and both caches
/// bit-identical to the two-launch path (the sums of squares are added in its order), no other
/// cache slot touched; the two-launch path within 5e-4 of the largest |output| of the f64
/// reference; outputs NaN-poisoned.
#[test]
#[ignore = "needs a CUDA GPU"]
fn fast_normed_attention_matches_qk_norm_and_attention() {
    let g = gpu();
    let mut rng = Rng(0x5eed_0fa5_7000_0124);
    let (kvh, hd, rot, theta, eps) = (8usize, 128usize, 64usize, 5e6f32, 1e-6f32);
    let heads = 6 * kvh;
    let (qw, kw) = (heads * hd, kvh * hd);
    let scale = 1.0 / (hd as f32).sqrt();
    let mut worst_path = 0f64;
    let mut worst_ref = 0f64;
    for (kv, ps) in [("f16", 16usize), ("bf16", 7)] {
        for ctx in [1usize, 10, 17, 26, 600, 2100, 2110] {
            let ty = if kv == "bf16" { GgmlType::BF16 } else { GgmlType::F16 };
            let h2f = |b: u16| if kv == "bf16" { f32::from_bits((b as u32) << 16) } else { quant::f16_to_f32(b) };
            let (pts, pt_off, n_pages) = scrambled_pages(&mut rng, &[ctx], ps);
            let pos = vec![ctx as i32 - 1];
            let slot_of = |p: usize| pts[p / ps] as usize * ps + p % ps;
            let slots = vec![slot_of(ctx - 1) as i32];
            let nslots = n_pages * ps;
            let q = rng.vec(qw, 2.0);
            let k = rng.vec(kw, 2.0);
            let v = rng.vec(kw, 2.0);
            let qn: Vec<f32> = rng.vec(qw, 0.5).into_iter().map(|x| 1.0 + x).collect();
            let kn: Vec<f32> = rng.vec(kw, 0.5).into_iter().map(|x| 1.0 + x).collect();
            let (pb, sb, ob, tb, slb) = (g.upload(&pos).unwrap(), g.upload(&[0i32]).unwrap(), g.upload(&pt_off).unwrap(), g.upload(&pts).unwrap(), g.upload(&slots).unwrap());
            let meta = (g.ptr(&pb), g.ptr(&sb), g.ptr(&ob), g.ptr(&tb));
            let (qnb, knb) = (g.upload(&qn).unwrap(), g.upload(&kn).unwrap());
            let rope = poisoned(&g, 128);
            g.rope_table(g.ptr(&pb), 1, rot, theta, g.ptr(&rope)).unwrap();
            let fresh_cache = |seed: u64| {
                let c = g.zeros::<u16>(nslots * kw).unwrap();
                g.fill_synthetic(g.ptr(&c), ty, nslots * kw, seed, -2.0, 2.0).unwrap();
                c
            };
            let kc0 = g.download(&fresh_cache(51)).unwrap();
            let vc0 = g.download(&fresh_cache(52)).unwrap();
            let part = poisoned(&g, kvh * 128 * 6 * (hd + 2));
            let cnt = g.zeros::<u32>(kvh).unwrap();
            let ns = g.attn_splits(true, kvh, fast::nsplit_for(1), 1).unwrap();
            // (output, q8, q8 scales, k cache, v cache) of one path at `ns` splits.
            let run = |normed: bool, merged: bool, ns: usize| {
                let (kc, vc) = (g.upload(&kc0).unwrap(), g.upload(&vc0).unwrap());
                let (qb, kb, vb) = (g.upload(&q).unwrap(), g.upload(&k).unwrap(), g.upload(&v).unwrap());
                let out = poisoned(&g, qw);
                let (aq, ad) = (g.zeros::<i8>(qw).unwrap(), poisoned(&g, qw / 32));
                let c = if merged { Some(g.ptr(&cnt)) } else { None };
                if normed {
                    let z = fast::QkNormIn { q: g.ptr(&qb), k: g.ptr(&kb), v: g.ptr(&vb), q_norm: g.ptr(&qnb), k_norm: g.ptr(&knb), qw, kw, rot, rope: g.ptr(&rope), eps, slots: g.ptr(&slb) };
                    let names = launched_names(&g, || g.attn_decode_normed(kv, &z, g.ptr(&kc), g.ptr(&vc), meta, ps, kvh, ns, scale, g.ptr(&part), g.ptr(&out), qw, g.ptr(&aq), g.ptr(&ad), c).unwrap());
                    let want = if merged {
                        vec![format!("attn_dec6tnm_{kv}")]
                    } else {
                        vec![format!("attn_dec6tn_{kv}"), (if fast::qk_merge_early() { "attn_merge6e" } else { "attn_merge6" }).to_string()]
                    };
                    assert_eq!(names, want, "kernels launched");
                } else {
                    let rows = fast::QkRows { q: g.ptr(&qb), k: g.ptr(&kb), v: g.ptr(&vb), qw, kw, vw: kw, hd, rot };
                    let args = fast::qk_norm_rope_args(&rows, g.ptr(&qnb), g.ptr(&knb), g.ptr(&pb), theta, eps, g.ptr(&slb), g.ptr(&kc), g.ptr(&vc));
                    g.launch(&format!("qk_norm_rope_store_{kv}"), (1, 2, 1), 1024, 0, &args).unwrap();
                    g.attn_decode_with(true, kv, g.ptr(&qb), qw, g.ptr(&kc), g.ptr(&vc), meta, ps, kvh, ns, scale, g.ptr(&part), g.ptr(&out), qw, g.ptr(&aq), g.ptr(&ad), c, 1).unwrap();
                }
                (g.download(&out).unwrap(), g.download(&aq).unwrap(), g.download(&ad).unwrap(), g.download(&kc).unwrap(), g.download(&vc).unwrap())
            };
            let want = run(false, false, ns);
            // f64 reference from the host's norm + RoPE and the two-launch path's cache.
            let mut qr = rms_norm_ref(&q, &qn, eps);
            rope_ref(&mut qr, hd, rot, ctx - 1, theta);
            let (kh, vh): (Vec<f32>, Vec<f32>) = (want.3.iter().map(|&b| h2f(b)).collect(), want.4.iter().map(|&b| h2f(b)).collect());
            let big = want.0.iter().fold(0f32, |m, x| m.max(x.abs())) as f64;
            for h in 0..heads {
                let qh: Vec<f64> = (0..hd).map(|d| (qr[h * hd + d] * scale) as f64).collect();
                let s: Vec<f64> = (0..ctx).map(|p| (0..hd).map(|d| qh[d] * kh[(slot_of(p) * kvh + h / 6) * hd + d] as f64).sum()).collect();
                let mx = s.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
                let e: Vec<f64> = s.iter().map(|x| (x - mx).exp()).collect();
                let sum: f64 = e.iter().sum();
                for d in 0..hd {
                    let o: f64 = e.iter().enumerate().map(|(p, ep)| ep * vh[(slot_of(p) * kvh + h / 6) * hd + d] as f64).sum::<f64>() / sum;
                    worst_ref = worst_ref.max((want.0[h * hd + d] as f64 - o).abs() / big);
                }
            }
            // (merge in the last block, first tiles before the wait, blocks of empty splits
            // leaving at once), at the default split count and at 8 and 4.
            let mut forms = vec![(false, true, false, ns), (true, true, false, ns), (false, false, false, ns), (false, true, true, ns), (false, false, true, ns), (false, true, true, 8), (false, true, true, 4)];
            forms.dedup();
            for (merged, pre, exit, fns) in forms {
                let want = if fns == ns { want.clone() } else { run(false, false, fns) };
                fast::set_qk_pre_tiles(Some(pre));
                fast::set_attn_exit_empty(Some(exit));
                let got = run(true, merged, fns);
                fast::set_attn_exit_empty(None);
                fast::set_qk_pre_tiles(None);
                let what = format!(
                    "{kv} cache, pages of {ps}, context {ctx}, {fns} splits, empty splits exit {exit}, merge {}, first tiles {} the wait",
                    if merged { "in the last block" } else { "attn_merge6" },
                    if pre { "before" } else { "after" }
                );
                assert!(got.0.iter().all(|x| x.is_finite()), "{what}: non-finite output");
                worst_path = worst_path.max(got.0.iter().zip(&want.0).map(|(a, b)| (*a as f64 - *b as f64).abs() / big).fold(0.0, f64::max));
                assert_eq!(bits(&got.0), bits(&want.0), "{what}: output differs from the two-launch path");
                assert_eq!((got.1.clone(), bits(&got.2)), (want.1.clone(), bits(&want.2)), "{what}: q8 copy differs");
                let s = slots[0] as usize;
                assert_eq!(got.3, want.3, "{what}: K cache differs (the new key at slot {s})");
                assert_eq!(got.4, want.4, "{what}: V cache differs");
                for i in 0..nslots * kw {
                    if i / kw != s {
                        assert!(got.3[i] == kc0[i] && got.4[i] == vc0[i], "{what}: cache slot {} touched", i / kw);
                    }
                }
                if merged {
                    assert_eq!(g.download(&cnt).unwrap(), vec![0; kvh], "{what}: counters left non-zero");
                }
            }
        }
    }
    assert!(worst_ref <= 5e-4, "two-launch path vs f64 reference: {worst_ref:.2e} of the largest output");
    assert_eq!(worst_path, 0.0);
    eprintln!("attn_dec6tn / attn_dec6tnm: output, q8 copy and caches bit-identical to qk_norm_rope_store + attn_dec6t, that path within {worst_ref:.1e} of the f64 reference (relative to the largest output), other slots untouched");
    // Bad arguments: typed errors.
    let z = fast::QkNormIn { q: 0, k: 0, v: 0, q_norm: 0, k_norm: 0, qw, kw, rot: 130, rope: 0, eps, slots: 0 };
    assert!(g.rope_table(0, 1, 130, theta, 0).is_err(), "rope_table: 130 rotary dims");
    assert!(g.attn_decode_normed("f16", &z, 0, 0, (0, 0, 0, 0), 16, 8, 16, 1.0, 0, 0, 0, 0, 0, None).is_err(), "rot 130");
    let z = fast::QkNormIn { rot: 64, ..z };
    assert!(g.attn_decode_normed("f16", &z, 0, 0, (0, 0, 0, 0), 16, 4, 16, 1.0, 0, 0, 0, 0, 0, None).is_err(), "q / k widths of 8 KV heads, 4 given");
    assert!(g.attn_decode_normed("f32", &z, 0, 0, (0, 0, 0, 0), 16, 8, 16, 1.0, 0, 0, 0, 0, 0, None).is_err(), "f32 cache");
    assert!(g.attn_decode_normed("f16", &z, 0, 0, (0, 0, 0, 0), 0, 8, 16, 1.0, 0, 0, 0, 0, 0, None).is_err(), "page size 0");
    let big = fast::QkNormIn { qw: 96 * 128, kw: 16 * 128, ..z };
    assert!(fast::QK_FUSE_MAX_Q < 96 * 128);
    assert!(g.attn_decode_normed("f16", &big, 0, 0, (0, 0, 0, 0), 16, 16, 16, 1.0, 0, 0, 0, 0, 0, None).is_err(), "q rows past QK_FUSE_MAX_Q");
}
