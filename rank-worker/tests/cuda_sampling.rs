//! Sampling reductions on the GPU (kernels/sampling.cu + `partial::finish`) against the CPU
//! reference `reduce_row`, on random rows (odd sizes up to the real vocabulary, ties, -inf,
//! huge values, NaN) and random specs; on a fixture model's own logits (fast path and exact
//! path); and a timing line: device reduction vs download + host reduction.
//! Needs a GPU: run with `--ignored` (tools/gpu/run_tests.sh does).
#![cfg(feature = "cuda")]

mod common;

use std::sync::Arc;
use std::time::Instant;

use minimax_rank::cpu::KvSpec;
use minimax_rank::cuda::sampling::{DeviceSampler, MAX_CANDIDATES, RowJob, RowResult};
use minimax_rank::cuda::{CudaModel, CudaOptions, Gpu};
use minimax_shared::forward::{ForwardBatch, LogitsWanted, SeqStep};
use minimax_shared::gguf::GgufModel;
use minimax_shared::sampling::partial::{finish, partial_from_row, plan};
use minimax_shared::sampling::{RowReduction, SamplingSpec, reduce_row};

/// Log-sum-exp tolerance, relative to max(1, |value|): the device sums f32 `exp` (<= 2 ulp)
/// in f64, the host sums f64 `exp`; both end in one f32 rounding (6e-8).
const LSE_TOL: f32 = 2e-6;

struct Rng(u64);
impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0
    }
    fn unit(&mut self) -> f64 {
        (self.next() >> 11) as f64 / (1u64 << 53) as f64
    }
    fn below(&mut self, n: u64) -> u64 {
        self.next() % n.max(1)
    }
    fn pick<T: Copy>(&mut self, xs: &[T]) -> T {
        xs[self.below(xs.len() as u64) as usize]
    }
}

/// A random logits row of one of several shapes.
fn random_row(rng: &mut Rng, v: usize, kind: u64) -> Vec<f32> {
    let mut row: Vec<f32> = match kind {
        // Gaussian-ish logits of a language model.
        0 => (0..v).map(|_| ((rng.unit() + rng.unit() + rng.unit() - 1.5) * 6.0) as f32).collect(),
        // Many exact ties.
        1 => (0..v).map(|_| (rng.below(24) as f32) * 0.5 - 6.0).collect(),
        // Concentrated: one or two dominant tokens.
        2 => {
            let mut r: Vec<f32> = (0..v).map(|_| (rng.unit() * 4.0 - 10.0) as f32).collect();
            for _ in 0..2 {
                let i = rng.below(v as u64) as usize;
                r[i] = 8.0 + rng.unit() as f32;
            }
            r
        }
        // Huge finite values (and their negatives).
        3 => (0..v).map(|_| ((rng.unit() * 2.0 - 1.0) * 3.0e38) as f32).collect(),
        // Zeros of both signs.
        _ => (0..v).map(|_| if rng.below(2) == 0 { 0.0 } else { -0.0 }).collect(),
    };
    // -inf entries (sometimes most of the row).
    if rng.below(3) == 0 {
        let frac = rng.pick(&[0.001, 0.3, 0.99]);
        for x in row.iter_mut() {
            if rng.unit() < frac {
                *x = f32::NEG_INFINITY;
            }
        }
    }
    // Rarely: NaN, +inf, or every entry -inf.
    match rng.below(40) {
        0 => {
            let i = rng.below(v as u64) as usize;
            row[i] = f32::NAN;
            let j = rng.below(v as u64) as usize;
            row[j] = f32::NAN;
        }
        1 => row[rng.below(v as u64) as usize] = f32::INFINITY,
        2 => row.iter_mut().for_each(|x| *x = f32::NEG_INFINITY),
        _ => {}
    }
    row
}

fn unique_tokens(rng: &mut Rng, v: usize, n: usize) -> Vec<u32> {
    let mut t: Vec<u32> = (0..n).map(|_| rng.below(v as u64) as u32).collect();
    t.sort_unstable();
    t.dedup();
    // Not sorted on the wire in general.
    for i in (1..t.len()).rev() {
        t.swap(i, rng.below(i as u64 + 1) as usize);
    }
    t
}

/// A random spec (mostly valid; a few invalid ones to compare errors) and target.
fn random_spec(rng: &mut Rng, v: usize) -> (SamplingSpec, Option<u32>) {
    let mut s = SamplingSpec {
        temperature: rng.pick(&[0.0, 0.0, 0.3, 0.7, 1.0, 1.0, 1.5]),
        top_k: rng.pick(&[0, 0, 1, 5, 40, 40, 1000, 1024, 1025, 5000]),
        top_p: rng.pick(&[1.0, 1.0, 0.5, 0.9, 0.95, 0.999]),
        min_p: rng.pick(&[0.0, 0.0, 0.05, 0.3]),
        top_logprobs: rng.pick(&[0, 0, 1, 5, 20]),
        ..Default::default()
    };
    if rng.below(2) == 0 {
        s.repetition_penalty = rng.pick(&[1.0, 1.1, 1.3, 0.8]);
        s.presence_penalty = rng.pick(&[0.0, 0.5, -0.5]);
        s.frequency_penalty = rng.pick(&[0.0, 0.3, 1.7]);
        let n = rng.pick(&[1usize, 10, 200]);
        s.history = unique_tokens(rng, v, n).into_iter().map(|t| (t, rng.below(6) as u32)).collect();
    }
    if rng.below(3) == 0 {
        let n = rng.pick(&[1usize, 5, 50]);
        s.logit_bias = unique_tokens(rng, v, n)
            .into_iter()
            .map(|t| (t, rng.pick(&[5.0, -5.0, 0.25, f32::NEG_INFINITY, 100.0])))
            .collect();
    }
    let mut target = if rng.below(2) == 0 { Some(rng.below(v as u64) as u32) } else { None };
    match rng.below(30) {
        0 => s.temperature = -1.0,
        1 => target = Some(v as u32),
        2 => s.history.push((v as u32 + 3, 1)),
        3 if !s.history.is_empty() => s.history.push((s.history[0].0, 2)),
        _ => {}
    }
    (s, target)
}

/// Whether the device is expected to decide this row itself (not hand it to the host).
fn expect_device(raw: &[f32], s: &SamplingSpec, target: Option<u32>) -> bool {
    let pl = plan(s, target, raw.len(), MAX_CANDIDATES);
    if pl.full_row || raw.iter().any(|x| x.is_nan() || *x == f32::INFINITY) {
        return false;
    }
    let t = s.temperature;
    let z = s.penalised(raw).unwrap();
    if z.iter().any(|&x| x > f32::NEG_INFINITY && !(if t > 0.0 { x / t } else { x }).is_finite()) {
        return false;
    }
    finish(&partial_from_row(raw, s, target, &pl), s, target).is_some()
}

fn close(a: f32, b: f32, scale: f32) -> bool {
    a.to_bits() == b.to_bits() || (a - b).abs() <= LSE_TOL * scale.abs().max(1.0)
}

/// Device result vs `reduce_row`: candidates bit-identical, log-sum-exp values within LSE_TOL.
fn compare(got: &RowResult, want: &RowResult, what: &str) {
    let (g, w): (&RowReduction, &RowReduction) = match (got, want) {
        (Ok(g), Ok(w)) => (g, w),
        (Err(a), Err(b)) => {
            assert_eq!(a, b, "{what}: different errors");
            return;
        }
        _ => panic!("{what}: device {got:?} vs host {want:?}"),
    };
    assert_eq!(g.candidate_ids, w.candidate_ids, "{what}: candidate ids");
    let bits = |x: &[f32]| x.iter().map(|v| v.to_bits()).collect::<Vec<_>>();
    assert_eq!(bits(&g.candidate_logits), bits(&w.candidate_logits), "{what}: candidate logits");
    assert_eq!(bits(&g.candidate_raw_logits), bits(&w.candidate_raw_logits), "{what}: candidate raw logits");
    assert_eq!(g.top_ids, w.top_ids, "{what}: top ids");
    let lse = w.raw_logsumexp;
    assert!(close(g.raw_logsumexp, lse, lse), "{what}: lse {} vs {}", g.raw_logsumexp, lse);
    assert_eq!(g.top_logprobs.len(), w.top_logprobs.len(), "{what}");
    for (a, b) in g.top_logprobs.iter().zip(&w.top_logprobs) {
        assert!(close(*a, *b, lse.abs().max(b.abs())), "{what}: top logprob {a} vs {b}");
    }
    match (g.target_logprob, w.target_logprob) {
        (Some(a), Some(b)) => assert!(close(a, b, lse.abs().max(b.abs())) || (a.is_nan() && b.is_nan()), "{what}: target {a} vs {b}"),
        (a, b) => assert_eq!(a.is_some(), b.is_some(), "{what}: target"),
    }
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn device_reduction_equals_reduce_row_on_random_rows() {
    let gpu = Gpu::new(0).unwrap();
    let mut rng = Rng(0x5eed_1234_abcd_0001);
    let (mut n_dev, mut n_host, mut n_rows) = (0, 0, 0);
    for &v in &[1usize, 7, 97, 1000, 1025, 8191, 8192, 8193, 50_000, 200_064] {
        let mut sampler = DeviceSampler::new(&gpu, v).unwrap();
        let rows_per_batch = if v > 60_000 { 12 } else { 24 };
        for batch in 0..3 {
            let stride = v + (batch % 2) * 5;
            let rows: Vec<Vec<f32>> = (0..rows_per_batch).map(|_| {
                let kind = rng.below(5);
                random_row(&mut rng, v, kind)
            }).collect();
            let specs: Vec<(SamplingSpec, Option<u32>)> = (0..rows_per_batch).map(|_| random_spec(&mut rng, v)).collect();
            let mut flat = vec![f32::NAN; rows_per_batch * stride];
            for (r, row) in rows.iter().enumerate() {
                flat[r * stride..r * stride + v].copy_from_slice(row);
            }
            let buf = gpu.upload(&flat).unwrap();
            // Rows in reverse order of the buffer: src_row is honoured.
            let jobs: Vec<RowJob> = (0..rows_per_batch)
                .map(|r| RowJob { src_row: rows_per_batch - 1 - r, spec: &specs[r].0, target: specs[r].1, host_row: None })
                .collect();
            let rows_of = |r: usize| &rows[rows_per_batch - 1 - r];
            // Once to size the workspaces, then poisoned, then the checked run.
            sampler.reduce(&gpu, gpu.ptr(&buf), stride, &jobs).unwrap();
            sampler.poison(&gpu).unwrap();
            let (got, stats) = sampler.reduce(&gpu, gpu.ptr(&buf), stride, &jobs).unwrap();
            let mut want_dev = 0;
            for (r, g) in got.iter().enumerate() {
                let (s, t) = &specs[r];
                let want = reduce_row(rows_of(r), s, *t);
                compare(g, &want, &format!("vocab {v} batch {batch} row {r} spec {s:?} target {t:?}"));
                want_dev += expect_device(rows_of(r), s, *t) as usize;
            }
            assert_eq!(stats.device, want_dev, "vocab {v} batch {batch}: rows decided on the device");
            n_dev += stats.device;
            n_host += stats.host;
            n_rows += got.len();
        }
    }
    eprintln!("random rows: {n_rows} rows, {n_dev} finished from the device reduction, {n_host} on the host");
    assert!(n_dev * 2 > n_rows, "most rows must be decided on the device");
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn fixture_model_rows_reduce_on_device() {
    let v = common::variants().into_iter().find(|v| v.model == "m2-small" && v.name == "q8_0").expect("m2-small q8_0 fixture");
    let m = Arc::new(GgufModel::open(&v.gguf).unwrap());
    let mut model = CudaModel::load(m, KvSpec { page_size: 16, n_pages: 64 }, CudaOptions::default()).unwrap();
    eprintln!("fast path: {:?}", model.fast_path_off().unwrap_or("on"));
    let vocab = v.vocab;
    let mut rng = Rng(77);
    let seqs: Vec<Vec<u32>> = v.sequences.iter().take(3).map(|s| s[..s.len().min(40)].to_vec()).collect();
    // Prefill (exact path: logits uploaded from the host copy), then decode steps (fast path:
    // logits read where the forward left them).
    let mut cached = vec![0usize; seqs.len()];
    for step in 0..4 {
        let batch = ForwardBatch {
            seqs: seqs
                .iter()
                .enumerate()
                .map(|(i, s)| {
                    let toks = if step == 0 { s[..s.len() - 3].to_vec() } else { vec![s[s.len() - 4 + step]] };
                    SeqStep {
                        seq_id: i as u64 + 1,
                        page_table: (0..4).map(|p| (i * 4 + p) as u32).collect(),
                        cached_len: cached[i],
                        tokens: toks,
                        logits: if step == 0 { LogitsWanted::All } else { LogitsWanted::Last },
                    }
                })
                .collect(),
        };
        let out = model.forward(&batch).unwrap();
        for (i, s) in batch.seqs.iter().enumerate() {
            cached[i] += s.tokens.len();
        }
        let jobs: Vec<(SamplingSpec, Option<u32>)> = out.rows.iter().map(|_| random_spec(&mut rng, vocab)).collect();
        let (got, stats) = model.reduce_rows(&batch, &out, &jobs).unwrap();
        for (ri, g) in got.iter().enumerate() {
            let want = reduce_row(out.row(ri), &jobs[ri].0, jobs[ri].1);
            compare(g, &want, &format!("step {step} row {ri} {:?}", jobs[ri]));
        }
        eprintln!("step {step}: {} rows, {stats:?}", out.rows.len());
        assert!(stats.device > 0, "step {step}: no row decided on the device");
    }
}

fn time_it(iters: usize, mut f: impl FnMut()) -> f64 {
    f();
    let t0 = Instant::now();
    for _ in 0..iters {
        f();
    }
    t0.elapsed().as_secs_f64() / iters as f64
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn timing_device_vs_host_reduction() {
    let gpu = Gpu::new(0).unwrap();
    let v = 200_064;
    let mut rng = Rng(99);
    let mut sampler = DeviceSampler::new(&gpu, v).unwrap();
    for &n in &[1usize, 32] {
        // Gaussian-like rows, and concentrated ones (where a top_p-only cut fits in 1024).
        let flat: Vec<f32> = (0..n).flat_map(|_| random_row(&mut rng, v, 0)).collect();
        let conc: Vec<f32> = (0..n).flat_map(|_| random_row(&mut rng, v, 2)).collect();
        let (buf_g, buf_c) = (gpu.upload(&flat).unwrap(), gpu.upload(&conc).unwrap());
        let history: Vec<(u32, u32)> = unique_tokens(&mut rng, v, 100).into_iter().map(|t| (t, 1 + rng.below(3) as u32)).collect();
        for (name, spec, buf) in [
            ("defaults t=1 top_k=40 top_p=0.95 +penalties +5 logprobs", SamplingSpec {
                top_k: 40,
                top_p: 0.95,
                repetition_penalty: 1.1,
                presence_penalty: 0.2,
                history: history.clone(),
                top_logprobs: 5,
                ..Default::default()
            }, &buf_g),
            ("greedy", SamplingSpec { temperature: 0.0, ..Default::default() }, &buf_g),
            ("top_p=0.9 only, concentrated rows (1024 candidates + total)", SamplingSpec { top_p: 0.9, ..Default::default() }, &buf_c),
        ] {
            let jobs: Vec<RowJob> = (0..n).map(|r| RowJob { src_row: r, spec: &spec, target: Some(7), host_row: None }).collect();
            let mut stats = Default::default();
            let dev = time_it(20, || stats = sampler.reduce(&gpu, gpu.ptr(buf), v, &jobs).unwrap().1);
            gpu.profile_begin();
            sampler.reduce(&gpu, gpu.ptr(buf), v, &jobs).unwrap();
            let kern: f32 = gpu.profile_end().unwrap().iter().map(|k| k.1).sum();
            let mut host = vec![0f32; n * v];
            let d2h = time_it(5, || gpu.stream.memcpy_dtoh(buf, &mut host[..]).unwrap());
            let red = time_it(3, || {
                for r in 0..n {
                    reduce_row(&host[r * v..(r + 1) * v], &spec, Some(7)).unwrap();
                }
            });
            eprintln!(
                "TIMING vocab {v} rows {n:>2} [{name}]: device {:.1} us/call ({:.1} us/row; kernels {:.1} us; {stats:?}) | D2H {:.3} ms + host reduce_row {:.3} ms ({:.3} ms/row)",
                dev * 1e6,
                dev * 1e6 / n as f64,
                kern * 1e3,
                d2h * 1e3,
                red * 1e3,
                red * 1e3 / n as f64
            );
        }
    }
}

/// Not a check: with `MINIMAX_PREBUILD_ARCH=90` (and `MINIMAX_KERNEL_CACHE`) it fills the
/// kernel cache on a machine without a GPU (needs only libnvrtc), so a GPU run spends no device
/// time compiling. Does nothing otherwise.
#[test]
#[ignore = "tool: needs libnvrtc"]
fn prebuild_kernel_cache() {
    let Some(arch) = std::env::var("MINIMAX_PREBUILD_ARCH").ok().and_then(|a| a.parse::<u32>().ok()) else {
        return;
    };
    let t0 = Instant::now();
    let built = minimax_rank::cuda::nvrtc::build_all(arch).expect("every module compiles");
    eprintln!("{} modules for sm_{arch} in {:.1} s", built.len(), t0.elapsed().as_secs_f64());
}
