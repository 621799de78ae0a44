//! Flash prefill attention (`flash_*` in kernels/attention.cu, `Gpu::flash_attention`) and the
//! dispatch of `Gpu::attention`, against an f64 host reference over the rounded cache.
//!
//! Every case: several sequences with different cached prefixes and chunk lengths that are not
//! multiples of the 64- or 128-row tiles (and one case whose sequences end exactly on, one row
//! past and just short of 128-row tiles), page tables scrambled over the cache, every KV dtype,
//! both flash kernels (`flash_*` 128 rows a block, `flash64_*` 64 rows) as well as the one
//! `Gpu::attention` picks, outputs
//! poisoned with NaN (and row padding that must stay NaN), q rows padded with NaN (read past a
//! head: NaN out). Nothing may read past a sequence's length: every cache slot that holds no
//! position of a sequence is NaN (a V read there makes the output NaN), and every page table is
//! followed by an out-of-range page id (a table read past its end faults).
//!
//! Tolerance (16-bit caches, flash kernel): the reference rounds q to the cache type exactly as
//! the kernel does, so the remaining difference is the rounding of the probabilities P to the
//! cache type before P V (relative error <= u: 2^-11 f16, 2^-8 bf16) plus f32 accumulation:
//! |o - ref| <= (2u + 2e-4) * sum_j p_j |v_j| / l + 1e-6 per element, and, across all elements,
//! the RMS of the difference over its typical size u * sqrt(sum p_j^2 v_j^2) / l (+ 1e-5 * the
//! bound above for accumulation) must stay <= 1.5 (random rounding gives ~0.6): a missing or
//! extra key moves an output by ~p_j |v_j|, 8x (bf16) to 60x (f16) that at 1000 keys. f32
//! caches take the exact per-token kernel: 1e-4 * sum p|v|/l + 1e-6.
//! Needs a GPU: run with `--ignored` (tools/gpu/run_tests.sh does).
#![cfg(feature = "cuda")]

mod common;

use common::gpu::{NAN, Rng, gpu, poisoned};
use cudarc::driver::CudaSlice;
use minimax_rank::cuda::flash::{FLASH_DB, FLASH_MIN_TOKENS, FLASH_ROWS, FLASH_WIDE, FLASH64_ROWS, FlashKernel, flash_unsupported};
use minimax_rank::cuda::{AttnArgs, Gpu, KvDtype};
use minimax_shared::quant::GgmlType;

fn round(dt: KvDtype, x: f32) -> f32 {
    match dt {
        KvDtype::F16 => half::f16::from_f32(x).to_f32(),
        KvDtype::BF16 => half::bf16::from_f32(x).to_f32(),
        KvDtype::F32 => x,
    }
}

/// NaN bit pattern of one 32-bit word of the cache.
fn nan_word(dt: KvDtype) -> u32 {
    match dt {
        KvDtype::F16 => 0x7e00_7e00,
        KvDtype::BF16 => 0x7fc0_7fc0,
        KvDtype::F32 => NAN,
    }
}

/// Unit roundoff of the flash kernel's 16-bit inputs.
fn unit(dt: KvDtype) -> f64 {
    match dt {
        KvDtype::F16 => 2f64.powi(-11),
        KvDtype::BF16 => 2f64.powi(-8),
        KvDtype::F32 => 0.0,
    }
}

/// Head layout, page size and the (cached prefix, new tokens) of each sequence.
struct Case {
    name: &'static str,
    heads: usize,
    kv_heads: usize,
    hd: usize,
    ps: usize,
    seqs: Vec<(usize, usize)>,
}

/// One batch on the device plus everything the reference needs.
struct Batch {
    kc: CudaSlice<u8>,
    vc: CudaSlice<u8>,
    q: CudaSlice<f32>,
    pos_d: CudaSlice<i32>,
    seq_d: CudaSlice<i32>,
    pt_off_d: CudaSlice<i32>,
    pts_d: CudaSlice<u32>,
    start_d: CudaSlice<i32>,
    /// Host copies: q (unpadded, `nt * heads * hd`), per sequence K/V of every position
    /// (rounded like the cache), per token position and sequence.
    qh: Vec<f32>,
    kall: Vec<Vec<f32>>,
    vall: Vec<Vec<f32>>,
    pos: Vec<usize>,
    seqi: Vec<usize>,
    nt: usize,
    qs: usize,
    os: usize,
    max_tokens: usize,
}

fn build(g: &Gpu, c: &Case, dt: KvDtype, rng: &mut Rng) -> Batch {
    let (kw, vw) = (c.kv_heads * c.hd, c.kv_heads * c.hd);
    let need: Vec<usize> = c.seqs.iter().map(|&(a, n)| (a + n).div_ceil(c.ps)).collect();
    // Spare pages stay NaN; pages are handed out scrambled.
    let n_pages = need.iter().sum::<usize>() + 5;
    let mut free: Vec<u32> = (0..n_pages as u32).map(|i| (i * 37 + 11) % n_pages as u32).collect();
    let tables: Vec<Vec<u32>> = need.iter().map(|&n| (0..n).map(|_| free.pop().unwrap()).collect()).collect();
    let kc = g.zeros::<u8>(n_pages * c.ps * kw * dt.bytes()).unwrap();
    let vc = g.zeros::<u8>(n_pages * c.ps * vw * dt.bytes()).unwrap();
    g.fill_u32(g.ptr(&kc), n_pages * c.ps * kw * dt.bytes() / 4, nan_word(dt)).unwrap();
    g.fill_u32(g.ptr(&vc), n_pages * c.ps * vw * dt.bytes() / 4, nan_word(dt)).unwrap();
    let (mut kall, mut vall) = (Vec::new(), Vec::new());
    let (mut pos, mut seqi, mut slots, mut kin, mut vin) = (Vec::new(), Vec::new(), Vec::new(), Vec::new(), Vec::new());
    let mut start = Vec::new();
    for (s, &(a, n)) in c.seqs.iter().enumerate() {
        let kk = rng.vec((a + n) * kw, 1.0);
        let vv = rng.vec((a + n) * vw, 1.0);
        for p in 0..a + n {
            slots.push((tables[s][p / c.ps] as usize * c.ps + p % c.ps) as i32);
        }
        kin.extend_from_slice(&kk);
        vin.extend_from_slice(&vv);
        start.push(pos.len() as i32);
        for i in 0..n {
            pos.push(a + i);
            seqi.push(s);
        }
        kall.push(kk.into_iter().map(|x| round(dt, x)).collect::<Vec<_>>());
        vall.push(vv.into_iter().map(|x| round(dt, x)).collect::<Vec<_>>());
    }
    let nt = pos.len();
    start.push(nt as i32);
    // Every position of every sequence through kv_store, as the model does.
    let (sb, kb, vb) = (g.upload(&slots).unwrap(), g.upload(&kin).unwrap(), g.upload(&vin).unwrap());
    g.kv_store(dt, g.ptr(&kb), g.ptr(&vb), kw, vw, g.ptr(&sb), g.ptr(&kc), g.ptr(&vc), slots.len()).unwrap();
    // Page tables back to back, each followed by a page id far outside the cache.
    let (mut pt_off, mut pts) = (Vec::new(), Vec::new());
    for t in &tables {
        pt_off.push(pts.len() as i32);
        pts.extend_from_slice(t);
        pts.push(0x7fff_0000);
    }
    // q rows padded with NaN; q values larger than K/V so the softmax is not flat.
    let qw = c.heads * c.hd;
    let qs = qw + 6;
    let qh = rng.vec(nt * qw, 3.0);
    let mut qp = vec![f32::NAN; nt * qs];
    for t in 0..nt {
        qp[t * qs..t * qs + qw].copy_from_slice(&qh[t * qw..(t + 1) * qw]);
    }
    let pos_i: Vec<i32> = pos.iter().map(|&p| p as i32).collect();
    let seq_i: Vec<i32> = seqi.iter().map(|&s| s as i32).collect();
    let b = Batch {
        kc,
        vc,
        q: g.upload(&qp).unwrap(),
        pos_d: g.upload(&pos_i).unwrap(),
        seq_d: g.upload(&seq_i).unwrap(),
        pt_off_d: g.upload(&pt_off).unwrap(),
        pts_d: g.upload(&pts).unwrap(),
        start_d: g.upload(&start).unwrap(),
        qh,
        kall,
        vall,
        pos,
        seqi,
        nt,
        qs,
        os: qw + 10,
        max_tokens: c.seqs.iter().map(|s| s.1).max().unwrap(),
    };
    g.sync().unwrap();
    b
}

fn args(g: &Gpu, c: &Case, b: &Batch, out: &CudaSlice<f32>) -> AttnArgs {
    AttnArgs {
        q: g.ptr(&b.q),
        qs: b.qs,
        kc: g.ptr(&b.kc),
        vc: g.ptr(&b.vc),
        pos: g.ptr(&b.pos_d),
        seq: g.ptr(&b.seq_d),
        pt_off: g.ptr(&b.pt_off_d),
        page_tables: g.ptr(&b.pts_d),
        page_size: c.ps,
        heads: c.heads,
        kv_heads: c.kv_heads,
        hd: c.hd,
        vd: c.hd,
        scale: 1.0 / (c.hd as f32).sqrt(),
        out: g.ptr(out),
        os: b.os,
        nt: b.nt,
        seq_start: g.ptr(&b.start_d),
        n_seqs: c.seqs.len(),
        max_seq_tokens: b.max_tokens,
    }
}

/// Per output element: reference value, sum p|v|/l (the rounding bound's scale) and
/// sqrt(sum p^2 v^2)/l (the typical size of random rounding), in f64, over `threads` threads.
fn reference(c: &Case, b: &Batch, dt: KvDtype) -> (Vec<f64>, Vec<f64>, Vec<f64>) {
    let (qw, kw, hd) = (c.heads * c.hd, c.kv_heads * c.hd, c.hd);
    let group = c.heads / c.kv_heads;
    let scale = 1.0 / (hd as f64).sqrt();
    let threads = std::thread::available_parallelism().map(|n| n.get()).unwrap_or(4).min(32);
    let per = b.nt.div_ceil(threads);
    let mut parts: Vec<(Vec<f64>, Vec<f64>, Vec<f64>)> = Vec::new();
    std::thread::scope(|sc| {
        let hs: Vec<_> = (0..threads)
            .map(|ti| {
                sc.spawn(move || {
                    let (t0, t1) = (ti * per, ((ti + 1) * per).min(b.nt));
                    let n = t1.saturating_sub(t0) * qw;
                    let (mut o, mut a, mut r) = (vec![0f64; n], vec![0f64; n], vec![0f64; n]);
                    for t in t0..t1 {
                        let (s, p) = (b.seqi[t], b.pos[t]);
                        for h in 0..c.heads {
                            let kvh = h / group;
                            let qv: Vec<f64> = b.qh[t * qw + h * hd..t * qw + (h + 1) * hd].iter().map(|&x| round(dt, x) as f64).collect();
                            let sc: Vec<f64> = (0..=p)
                                .map(|j| qv.iter().zip(&b.kall[s][j * kw + kvh * hd..j * kw + (kvh + 1) * hd]).map(|(x, y)| x * *y as f64).sum::<f64>() * scale)
                                .collect();
                            let m = sc.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
                            let pr: Vec<f64> = sc.iter().map(|x| (x - m).exp()).collect();
                            let l: f64 = pr.iter().sum();
                            for i in 0..hd {
                                let (mut ov, mut av, mut rv) = (0f64, 0f64, 0f64);
                                for j in 0..=p {
                                    let v = b.vall[s][j * kw + kvh * hd + i] as f64;
                                    ov += pr[j] * v;
                                    av += pr[j] * v.abs();
                                    rv += (pr[j] * v) * (pr[j] * v);
                                }
                                let e = (t - t0) * qw + h * hd + i;
                                o[e] = ov / l;
                                a[e] = av / l;
                                r[e] = rv.sqrt() / l;
                            }
                        }
                    }
                    (o, a, r)
                })
            })
            .collect();
        for h in hs {
            parts.push(h.join().unwrap());
        }
    });
    let (mut o, mut a, mut r) = (Vec::new(), Vec::new(), Vec::new());
    for (x, y, z) in parts {
        o.extend(x);
        a.extend(y);
        r.extend(z);
    }
    (o, a, r)
}

/// Checks one output against the reference; returns (max |diff|, rms of diff / typical size).
fn check(what: &str, dt: KvDtype, exact: bool, c: &Case, b: &Batch, got: &[f32], reference: &(Vec<f64>, Vec<f64>, Vec<f64>)) -> (f64, f64) {
    let qw = c.heads * c.hd;
    let (want, abound, typ) = reference;
    let u = if exact { 0.0 } else { unit(dt) };
    let (mut worst, mut ss, mut bad) = (0f64, 0f64, Vec::new());
    for t in 0..b.nt {
        for e in 0..qw {
            let (x, i) = (got[t * b.os + e], t * qw + e);
            let d = (x as f64 - want[i]).abs();
            let tol = if exact { 1e-4 * abound[i] + 1e-6 } else { (2.0 * u + 2e-4) * abound[i] + 1e-6 };
            if !x.is_finite() || d.is_nan() || d > tol {
                bad.push(format!("token {t} (seq {} pos {}) elem {e}: got {x} want {:.6} tol {tol:.2e}", b.seqi[t], b.pos[t], want[i]));
            }
            worst = worst.max(d);
            let sigma = u * typ[i] + 1e-5 * abound[i] + 1e-7;
            ss += (d / sigma) * (d / sigma);
        }
        for e in qw..b.os {
            assert_eq!(got[t * b.os + e].to_bits(), NAN, "{what}: token {t} wrote padding column {e}");
        }
    }
    assert!(bad.is_empty(), "{what}: {} of {} elements off, first: {:?}", bad.len(), b.nt * qw, &bad[..bad.len().min(5)]);
    let rms = (ss / (b.nt * qw) as f64).sqrt();
    if !exact {
        assert!(rms <= 1.5, "{what}: rms of diff / typical rounding {rms:.2} (systematic error)");
    }
    (worst, rms)
}

/// Kernel names launched by `f` (through the profiler's per-launch events).
fn launched(g: &Gpu, f: impl FnOnce()) -> Vec<String> {
    g.profile_begin();
    f();
    g.profile_end().unwrap().into_iter().map(|(n, _)| n).collect()
}

fn cases() -> Vec<Case> {
    let big = vec![(0, 150), (1000, 70), (33, 1), (200, 45), (17, 9)];
    let small = vec![(0, 300), (37, 21), (300, 1), (64, 64), (5, 130), (0, 3)];
    vec![
        Case { name: "M2.7 48/8x128", heads: 48, kv_heads: 8, hd: 128, ps: 16, seqs: big.clone() },
        Case { name: "M2.7 TP2 24/4x128 page 7", heads: 24, kv_heads: 4, hd: 128, ps: 7, seqs: vec![(0, 97), (129, 40)] },
        Case { name: "m2-small 4/2x64", heads: 4, kv_heads: 2, hd: 64, ps: 16, seqs: small.clone() },
        Case { name: "m2-odd 6/2x32 page 7", heads: 6, kv_heads: 2, hd: 32, ps: 7, seqs: small },
        Case { name: "MHA 2/2x64 page 5", heads: 2, kv_heads: 2, hd: 64, ps: 5, seqs: vec![(0, 200), (77, 33)] },
        // Rows per sequence (group 6): 384 = 3 x 128, 258 = 2 x 128 + 2, 132, 126, 6, 768.
        Case { name: "M2.7 128-row edges page 3", heads: 48, kv_heads: 8, hd: 128, ps: 3, seqs: vec![(0, 64), (10, 43), (500, 22), (3, 21), (129, 1), (61, 128)] },
    ]
}

/// The flash kernels this card's shared memory takes at head width `hd`.
fn kernels(g: &Gpu, hd: usize) -> Vec<FlashKernel> {
    [FlashKernel::Rows128, FlashKernel::Rows64, FlashKernel::Rows128Db].into_iter().filter(|k| k.smem(hd) <= g.smem_optin()).collect()
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn flash_attention_matches_f64_reference() {
    let g = gpu();
    let mut rng = Rng(0x5eed_f1a5);
    for c in cases() {
        for dt in [KvDtype::F16, KvDtype::BF16, KvDtype::F32] {
            let b = build(&g, &c, dt, &mut rng);
            let reference = reference(&c, &b, dt);
            let out = poisoned(&g, b.nt * b.os);
            let a = args(&g, &c, &b, &out);
            // Gpu::attention dispatches: flash for 16-bit caches (max tokens >= the minimum).
            let names = launched(&g, || g.attention(dt, &a).unwrap());
            let want_kernel = match dt {
                KvDtype::F32 => "attn_f32".to_string(),
                _ => {
                    let kv = if dt == KvDtype::F16 { "f16" } else { "bf16" };
                    match g.flash_kernel(&a) {
                        FlashKernel::Rows128 => format!("flash_{kv}_{}", c.hd),
                        FlashKernel::Rows64 => format!("flash64_{kv}_{}", c.hd),
                        FlashKernel::Rows128Db => format!("flashdb_{kv}_{}", c.hd),
                    }
                }
            };
            assert_eq!(names, vec![want_kernel.clone()], "{} {dt:?}: kernel chosen", c.name);
            let got = g.download(&out).unwrap();
            let (worst, rms) = check(&format!("{} {dt:?} {want_kernel}", c.name), dt, dt == KvDtype::F32, &c, &b, &got, &reference);
            eprintln!(
                "attention {:<26} kv {dt:?}: {want_kernel:<15} {} queries, {} seqs: max |diff| {worst:.2e}, rms diff/typical {rms:.2}",
                c.name,
                b.nt,
                c.seqs.len()
            );
            if dt != KvDtype::F32 {
                // Every flash kernel the card fits explicitly, whichever the dispatch picked.
                for k in kernels(&g, c.hd) {
                    let outk = poisoned(&g, b.nt * b.os);
                    g.flash_attention_with(dt, &args(&g, &c, &b, &outk), k).unwrap();
                    let gotk = g.download(&outk).unwrap();
                    let (worst, rms) = check(&format!("{} {dt:?} {k:?}", c.name), dt, false, &c, &b, &gotk, &reference);
                    eprintln!("attention {:<26} kv {dt:?}: {:<15} max |diff| {worst:.2e}, rms diff/typical {rms:.2}", c.name, format!("{k:?}"));
                }
                // Keys split over 2, 3 and 5 blocks per row tile, merged by flash_merge (empty
                // splits included: short tiles have fewer key tiles than splits).
                for k in kernels(&g, c.hd).into_iter().filter(|&k| k != FlashKernel::Rows64) {
                    for ns in [2usize, 3, 5] {
                        let outk = poisoned(&g, b.nt * b.os);
                        let names = launched(&g, || g.flash_attention_split(dt, &args(&g, &c, &b, &outk), k, ns).unwrap());
                        assert_eq!(names.last().map(|s| s.as_str()), Some("flash_merge"), "{} {k:?} split {ns}: launched {names:?}", c.name);
                        let gotk = g.download(&outk).unwrap();
                        let (worst, rms) = check(&format!("{} {dt:?} {k:?} split {ns}", c.name), dt, false, &c, &b, &gotk, &reference);
                        eprintln!("attention {:<26} kv {dt:?}: {:<15} split {ns}: max |diff| {worst:.2e}, rms diff/typical {rms:.2}", c.name, format!("{k:?}"));
                    }
                }
            }
            if dt != KvDtype::F32 {
                // The per-token kernel on the same 16-bit cache, exact up to f32 (q unrounded
                // there, so against the reference with q rounded: only check it is close).
                let out2 = poisoned(&g, b.nt * b.os);
                g.attention_per_token(dt, &args(&g, &c, &b, &out2)).unwrap();
                let old = g.download(&out2).unwrap();
                let (mut d, mut vmax) = (0f32, 0f32);
                for t in 0..b.nt {
                    for e in 0..c.heads * c.hd {
                        d = d.max((old[t * b.os + e] - got[t * b.os + e]).abs());
                        vmax = vmax.max(old[t * b.os + e].abs());
                    }
                }
                assert!(d.is_finite() && (d as f64) <= 4.0 * unit(dt) * 3.0 * c.hd as f64 / (c.hd as f64).sqrt() + 1e-3, "{} {dt:?}: flash vs per-token kernel {d}", c.name);
                eprintln!("attention {:<26} kv {dt:?}: flash vs per-token kernel max |diff| {d:.2e} (|out| <= {vmax:.2})", c.name);
            }
        }
    }
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn attention_dispatch_keeps_decode_steps_on_the_per_token_kernel() {
    let g = gpu();
    let mut rng = Rng(77);
    let c = Case { name: "decode", heads: 48, kv_heads: 8, hd: 128, ps: 16, seqs: vec![(500, 1), (37, FLASH_MIN_TOKENS - 1), (0, 2)] };
    let b = build(&g, &c, KvDtype::F16, &mut rng);
    let out = poisoned(&g, b.nt * b.os);
    let a = args(&g, &c, &b, &out);
    assert_eq!(launched(&g, || g.attention(KvDtype::F16, &a).unwrap()), vec!["attn_f16".to_string()]);
    // Without per-sequence ranges, always the per-token kernel.
    let a0 = AttnArgs { seq_start: 0, n_seqs: 0, max_seq_tokens: 4096, ..a };
    assert_eq!(launched(&g, || g.attention(KvDtype::F16, &a0).unwrap()), vec!["attn_f16".to_string()]);
    // The flash kernel on the same decode batch is still right (a decode token is a tile of
    // `group` rows).
    let reference = reference(&c, &b, KvDtype::F16);
    for k in kernels(&g, c.hd) {
        let out = poisoned(&g, b.nt * b.os);
        let a = args(&g, &c, &b, &out);
        g.flash_attention_with(KvDtype::F16, &a, k).unwrap();
        let got = g.download(&out).unwrap();
        let (worst, rms) = check(&format!("flash {k:?} on decode tokens"), KvDtype::F16, false, &c, &b, &got, &reference);
        eprintln!("attention decode batch via flash {k:?}: max |diff| {worst:.2e}, rms diff/typical {rms:.2}");
    }
    let out = poisoned(&g, b.nt * b.os);
    let a = args(&g, &c, &b, &out);
    // The 128-row kernel at any size (unless MINIMAX_FLASH_WIDE=0; here: its override).
    let big = AttnArgs { max_seq_tokens: 4096, n_seqs: 8, ..a };
    FLASH_WIDE.set(Some(true));
    // Double-buffered where the card's shared memory takes it (MINIMAX_FLASH_DB), else single.
    let wide = if FlashKernel::Rows128Db.smem(128) <= g.smem_optin() { FlashKernel::Rows128Db } else { FlashKernel::Rows128 };
    assert_eq!(g.flash_kernel(&a), wide);
    assert_eq!(g.flash_kernel(&big), wide);
    FLASH_DB.set(Some(false));
    assert_eq!(g.flash_kernel(&big), FlashKernel::Rows128);
    FLASH_DB.set(None);
    FLASH_WIDE.set(Some(false));
    assert_eq!(g.flash_kernel(&a), FlashKernel::Rows64);
    assert_eq!(g.flash_kernel(&big), FlashKernel::Rows64);
    FLASH_WIDE.set(None);
    // Bad arguments are errors, not launches.
    assert!(g.flash_attention(KvDtype::F32, &a).is_err());
    assert!(g.flash_attention(KvDtype::F16, &AttnArgs { hd: 256, vd: 256, ..a }).is_err());
    assert!(g.flash_attention(KvDtype::F16, &AttnArgs { q: a.q + 4, ..a }).is_err());
}

#[test]
fn flash_is_only_offered_for_supported_shapes() {
    let a = AttnArgs { hd: 128, vd: 128, heads: 48, kv_heads: 8, seq_start: 256, n_seqs: 1, max_seq_tokens: 512, ..Default::default() };
    assert!(flash_unsupported(KvDtype::F16, &a).is_none());
    assert!(flash_unsupported(KvDtype::BF16, &a).is_none());
    assert!(flash_unsupported(KvDtype::F32, &a).is_some());
    assert!(flash_unsupported(KvDtype::F16, &AttnArgs { vd: 64, ..a }).is_some());
    assert!(flash_unsupported(KvDtype::F16, &AttnArgs { hd: 96, vd: 96, ..a }).is_some());
    assert!(flash_unsupported(KvDtype::F16, &AttnArgs { seq_start: 0, ..a }).is_some());
    assert!(Gpu::flash_chosen(KvDtype::F16, &a));
    assert!(!Gpu::flash_chosen(KvDtype::F16, &AttnArgs { max_seq_tokens: FLASH_MIN_TOKENS - 1, ..a }));
    assert_eq!(FLASH_ROWS % 32, 0);
    assert_eq!(FLASH64_ROWS % 16, 0);
    assert_eq!(FlashKernel::Rows128.rows(), FLASH_ROWS);
    // The 128-row kernel's shared memory fits one sm_120 block (99 KB) at every head width.
    assert!(FlashKernel::Rows128.smem(128) <= 99 * 1024);
}

/// Kernel time of `f` in ms: the minimum over `reps` runs (after `warm` unprofiled runs).
fn time_ms(g: &Gpu, warm: usize, reps: usize, f: &dyn Fn()) -> f64 {
    for _ in 0..warm {
        f();
    }
    g.sync().unwrap();
    let mut best = f64::INFINITY;
    for _ in 0..reps {
        g.profile_begin();
        f();
        let t: f32 = g.profile_end().unwrap().iter().map(|x| x.1).sum();
        best = best.min(t as f64);
    }
    best
}

#[test]
#[ignore = "needs a CUDA GPU (timing)"]
fn flash_attention_speed_at_m27_shapes() {
    let g = gpu();
    let (heads, kv_heads, hd, ps) = (48usize, 8usize, 128usize, 16usize);
    let max_ctx = 32768usize;
    let n_pages = max_ctx / ps + 8;
    let kw = kv_heads * hd;
    let dt = KvDtype::F16;
    let kc = g.zeros::<u8>(n_pages * ps * kw * 2).unwrap();
    let vc = g.zeros::<u8>(n_pages * ps * kw * 2).unwrap();
    g.fill_synthetic(g.ptr(&kc), GgmlType::F16, n_pages * ps * kw, 11, -1.0, 1.0).unwrap();
    g.fill_synthetic(g.ptr(&vc), GgmlType::F16, n_pages * ps * kw, 12, -1.0, 1.0).unwrap();
    let table: Vec<u32> = (0..n_pages as u32).map(|i| (i * 37 + 11) % n_pages as u32).collect();
    let qw = heads * hd;
    let max_nt = 4096usize;
    let q = g.zeros::<f32>(max_nt * qw).unwrap();
    g.fill_synthetic(g.ptr(&q), GgmlType::F32, max_nt * qw, 13, -3.0, 3.0).unwrap();
    let out = g.zeros::<f32>(max_nt * qw).unwrap();
    let out2 = g.zeros::<f32>(max_nt * qw).unwrap();
    // Sequences (prefix, chunk): all share one page table (the cache is only read).
    let setup = |seqs: &[(usize, usize)]| {
        let (mut pos, mut seq, mut start, mut pt_off, mut pts) = (Vec::new(), Vec::new(), Vec::new(), Vec::new(), Vec::new());
        for (s, &(a, n)) in seqs.iter().enumerate() {
            start.push(pos.len() as i32);
            pt_off.push(pts.len() as i32);
            pts.extend_from_slice(&table[..(a + n).div_ceil(ps)]);
            for i in 0..n {
                pos.push((a + i) as i32);
                seq.push(s as i32);
            }
        }
        start.push(pos.len() as i32);
        let bufs = (g.upload(&pos).unwrap(), g.upload(&seq).unwrap(), g.upload(&start).unwrap(), g.upload(&pt_off).unwrap(), g.upload(&pts).unwrap());
        let flops: f64 = seqs.iter().map(|&(a, n)| (0..n).map(|i| (a + i + 1) as f64).sum::<f64>()).sum::<f64>() * heads as f64 * 4.0 * hd as f64;
        (bufs, pos.len(), flops, seqs.iter().map(|s| s.1).max().unwrap())
    };
    let mk = |b: &(CudaSlice<i32>, CudaSlice<i32>, CudaSlice<i32>, CudaSlice<i32>, CudaSlice<u32>), nt: usize, mx: usize, o: &CudaSlice<f32>| AttnArgs {
        q: g.ptr(&q),
        qs: qw,
        kc: g.ptr(&kc),
        vc: g.ptr(&vc),
        pos: g.ptr(&b.0),
        seq: g.ptr(&b.1),
        pt_off: g.ptr(&b.3),
        page_tables: g.ptr(&b.4),
        page_size: ps,
        heads,
        kv_heads,
        hd,
        vd: hd,
        scale: 1.0 / (hd as f32).sqrt(),
        out: g.ptr(o),
        os: qw,
        nt,
        seq_start: g.ptr(&b.2),
        n_seqs: 1,
        max_seq_tokens: mx,
    };
    let k128 = FlashKernel::Rows128;
    let k64 = FlashKernel::Rows64;
    // The double-buffered kernel where it fits (else its column repeats the 128-row kernel).
    let kdb = if FlashKernel::Rows128Db.smem(128) <= g.smem_optin() { FlashKernel::Rows128Db } else { k128 };
    eprintln!("flash timing on {} (sm_{}), M2.7 heads 48/8 x 128, f16 KV, page 16, one sequence; kernel time (CUDA events), causal FLOPs", g.name, g.arch);
    eprintln!("| chunk | prefix | per-token kernel ms | TFLOP/s | flash64 ms | TFLOP/s | flash (128 rows) ms | TFLOP/s | flashdb ms | TFLOP/s | vs flash64 | auto | max |flash - per-token| |");
    eprintln!("| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |");
    for (chunk, prefix) in [(512usize, 0usize), (4096, 4096), (4096, 28672)] {
        let (b, nt, flops, mx) = setup(&[(prefix, chunk)]);
        let a = mk(&b, nt, mx, &out);
        let a2 = mk(&b, nt, mx, &out2);
        let t64 = time_ms(&g, 1, 5, &|| g.flash_attention_with(dt, &a, k64).unwrap());
        let tf = time_ms(&g, 1, 5, &|| g.flash_attention_with(dt, &a, k128).unwrap());
        let tdb = time_ms(&g, 1, 5, &|| g.flash_attention_with(dt, &a, kdb).unwrap());
        let (w, r) = if chunk <= 512 { (1, 3) } else { (0, 1) };
        let to = time_ms(&g, w, r, &|| g.attention_per_token(dt, &a2).unwrap());
        let (x, y) = (g.download(&out).unwrap(), g.download(&out2).unwrap());
        let n = nt * qw;
        let d = x[..n].iter().zip(&y[..n]).map(|(a, b)| (a - b).abs()).fold(0f32, |m, v| if v.is_nan() { f32::NAN } else { m.max(v) });
        eprintln!(
            "| {chunk} | {prefix} | {to:.3} | {:.1} | {t64:.3} | {:.1} | {tf:.3} | {:.1} | {tdb:.3} | {:.1} | {:.2}x | {:?} | {d:.1e} |",
            flops / to / 1e9,
            flops / t64 / 1e9,
            flops / tf / 1e9,
            flops / tdb / 1e9,
            t64 / tf,
            g.flash_kernel(&a)
        );
        assert!(d.is_finite() && d <= 4e-3, "flash vs per-token at chunk {chunk} prefix {prefix}: {d}");
    }
    // bf16 cache, one shape (same kernel body, other mma type).
    {
        let (b, nt, flops, mx) = setup(&[(4096, 4096)]);
        let a = mk(&b, nt, mx, &out);
        for k in [k64, k128, kdb] {
            let tf = time_ms(&g, 1, 3, &|| g.flash_attention_with(KvDtype::BF16, &a, k).unwrap());
            eprintln!("flash {k:?} bf16 (same bits read as bf16) chunk 4096 prefix 4096: {tf:.3} ms, {:.1} TFLOP/s", flops / tf / 1e9);
        }
    }
    // Small launches: 1..4 sequences x chunks of 512-2048 at prefix 0 / 4096 (fewer 128-row
    // blocks than SMs for some; the 64-row kernel's twice as many blocks did not win any).
    eprintln!("small launches (f16), ms:");
    eprintln!("| seqs x chunk @ prefix | flash64 | flash (128 rows) | flashdb | flashdb, keys split 2 / 3 / 4 | auto |");
    eprintln!("| --- | --- | --- | --- | --- | --- |");
    for (ns, chunk, prefix) in [(1usize, 512usize, 0usize), (1, 512, 4096), (2, 512, 4096), (1, 1024, 0), (1, 1024, 4096), (4, 512, 4096), (1, 2048, 0)] {
        let seqs = vec![(prefix, chunk); ns];
        let (b, nt, _, mx) = setup(&seqs);
        let a = AttnArgs { n_seqs: ns, ..mk(&b, nt, mx, &out) };
        let t64 = time_ms(&g, 1, 5, &|| g.flash_attention_with(dt, &a, k64).unwrap());
        let tf = time_ms(&g, 1, 5, &|| g.flash_attention_with(dt, &a, k128).unwrap());
        let tdb = time_ms(&g, 1, 5, &|| g.flash_attention_with(dt, &a, kdb).unwrap());
        let tsp: Vec<String> = [2usize, 3, 4].iter().map(|&n| format!("{:.4}", time_ms(&g, 1, 5, &|| g.flash_attention_split(dt, &a, kdb, n).unwrap()))).collect();
        eprintln!("| {ns} x {chunk} @ {prefix} | {t64:.4} | {tf:.4} | {tdb:.4} | {} | {:?} |", tsp.join(" / "), g.flash_kernel(&a));
    }
    // Crossover: 8 sequences at prefix 4096 with n new tokens each.
    eprintln!("crossover, 8 sequences x n new tokens at prefix 4096:");
    eprintln!("| n | per-token ms | flash64 ms | flash (128 rows) ms |");
    eprintln!("| --- | --- | --- | --- |");
    for n in [1usize, 2, 4, 8, 16, 32, 64] {
        let seqs = vec![(4096usize, n); 8];
        let (b, nt, _, mx) = setup(&seqs);
        let a = AttnArgs { n_seqs: 8, ..mk(&b, nt, mx, &out) };
        let t64 = time_ms(&g, 1, 3, &|| g.flash_attention_with(dt, &a, k64).unwrap());
        let tf = time_ms(&g, 1, 3, &|| g.flash_attention_with(dt, &a, k128).unwrap());
        let to = time_ms(&g, 1, 3, &|| g.attention_per_token(dt, &a).unwrap());
        eprintln!("| {n} | {to:.3} | {t64:.3} | {tf:.3} |");
    }
}
