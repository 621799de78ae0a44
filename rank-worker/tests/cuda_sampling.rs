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
use minimax_rank::cuda::sampling::{DeviceSampler, HEADER_WORDS, MAX_CANDIDATES, RowJob, RowResult};
use minimax_rank::cuda::{CudaModel, CudaOptions, Gpu};
use minimax_shared::forward::{ForwardBatch, LogitsWanted, SeqStep};
use minimax_shared::gguf::GgufModel;
use minimax_shared::sampling::draw::draw;
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
    if rng.below(4) == 0 {
        // Structured outputs: an allowed-token mask, dense to sparse, some shorter than the row
        // (the tokens past it banned).
        let len = if rng.below(4) == 0 { v / 2 + 1 } else { v };
        let one_in = rng.pick(&[2u64, 50, 5000]);
        let mut m = vec![0u8; len.div_ceil(8)];
        for t in 0..len {
            if rng.below(one_in) == 0 {
                m[t / 8] |= 1 << (t % 8);
            }
        }
        s.allowed = Some(m.into());
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
    // Every failure is collected (one GPU run shows them all); MINIMAX_SAMP_VOCABS=1,97 limits
    // the sizes (e.g. under compute-sanitizer).
    let mut failures: Vec<String> = Vec::new();
    let only: Option<Vec<usize>> = std::env::var("MINIMAX_SAMP_VOCABS").ok().map(|s| s.split(',').filter_map(|x| x.trim().parse().ok()).collect());
    for &v in &[1usize, 7, 97, 1000, 1025, 8191, 8192, 8193, 50_000, 200_064] {
        if only.as_ref().is_some_and(|o| !o.contains(&v)) {
            continue;
        }
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
                .map(|r| RowJob { src_row: rows_per_batch - 1 - r, spec: &specs[r].0, target: specs[r].1, host_row: None, draw: None })
                .collect();
            let rows_of = |r: usize| &rows[rows_per_batch - 1 - r];
            // Once to size the workspaces, then poisoned, then the checked run.
            let first = sampler.reduce(&gpu, gpu.ptr(&buf), stride, &jobs);
            sampler.poison(&gpu).unwrap();
            let second = first.and_then(|_| sampler.reduce(&gpu, gpu.ptr(&buf), stride, &jobs));
            let (got, stats) = match second {
                Ok(x) => x,
                Err(e) => {
                    let o = sampler.last_output();
                    let hdr = |d: usize| o.get(d * HEADER_WORDS..d * HEADER_WORDS + 8).map(|h| format!("{h:08x?}")).unwrap_or_default();
                    failures.push(format!("vocab {v} batch {batch}: {e}; headers row0 {} row1 {}", hdr(0), hdr(1)));
                    continue;
                }
            };
            let mut want_dev = 0;
            for (r, g) in got.iter().enumerate() {
                let (s, t) = &specs[r];
                let want = reduce_row(rows_of(r), s, *t);
                let what = format!("vocab {v} batch {batch} row {r} spec {s:?} target {t:?}");
                if let Err(e) = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| compare(g, &want, &what))) {
                    failures.push(e.downcast_ref::<String>().cloned().unwrap_or_else(|| what.clone()));
                }
                want_dev += expect_device(rows_of(r), s, *t) as usize;
            }
            if stats.device != want_dev {
                failures.push(format!("vocab {v} batch {batch}: {} rows decided on the device, expected {want_dev}", stats.device));
            }
            n_dev += stats.device;
            n_host += stats.host;
            n_rows += got.len();
        }
    }
    eprintln!("random rows: {n_rows} rows, {n_dev} finished from the device reduction, {n_host} on the host");
    for f in failures.iter().take(30) {
        eprintln!("FAIL {f}");
    }
    assert!(failures.is_empty(), "{} failures", failures.len());
    assert!(n_dev * 2 > n_rows, "most rows must be decided on the device");
}

/// Whether the device sees a non-finite value in the row's own logits or final logits (it then
/// reports no candidates and leaves no pick; the host reduces such rows itself).
fn device_sees_non_finite(raw: &[f32], s: &SamplingSpec) -> bool {
    let t = s.temperature;
    raw.iter().any(|x| x.is_nan() || *x == f32::INFINITY)
        || s.penalised(raw).is_ok_and(|z| z.iter().any(|&x| x > f32::NEG_INFINITY && !(if t > 0.0 { x / t } else { x }).is_finite()))
}

/// The merge's own draw (overlapped decode feeds it to the next step on the device): given the
/// gateway's uniform number, the pick is bit for bit the token the host's `finish` + `draw`
/// take, on random rows (ties, signed zeros, -inf, huge values, NaN), random whole-set specs
/// (top_k within the cap, or a vocabulary within it; top_p, min_p, penalties, bias) and
/// uniforms on exact boundaries; without one, the pick is the first candidate.
#[test]
#[ignore = "needs a CUDA GPU"]
fn device_draws_are_the_host_draws() {
    let gpu = Gpu::new(0).unwrap();
    let mut rng = Rng(0xd4a3_0001_5eed_0002);
    let mut failures: Vec<String> = Vec::new();
    let (mut drawn, mut among_several, mut first_only, mut none, mut not_whole) = (0, 0, 0, 0, 0);
    for &v in &[7usize, 97, 1000, 8193, 200_064] {
        let mut sampler = DeviceSampler::new(&gpu, v).unwrap();
        let n = if v > 60_000 { 16 } else { 32 };
        let picks_buf = gpu.zeros::<i32>(n).unwrap();
        for round in 0..6 {
            let rows: Vec<Vec<f32>> = (0..n).map(|_| {
                let kind = rng.below(5);
                random_row(&mut rng, v, kind)
            }).collect();
            let specs: Vec<SamplingSpec> = (0..n)
                .map(|_| {
                    let (mut s, _) = random_spec(&mut rng, v);
                    s.temperature = rng.pick(&[1.0, 1.0, 0.7, 1.3, 0.2, 0.0]);
                    // top_k 0 makes a whole set of a small vocabulary; of the large ones a set
                    // the device does not hold (a uniform given there must be ignored: the
                    // pick is the first candidate).
                    s.top_k = if rng.below(5) == 0 { 0 } else { rng.pick(&[1, 2, 20, 40, 40, 64, 1024]) };
                    if rng.below(4) == 0 {
                        s.history.clear(); // the served case: no penalties
                        s.repetition_penalty = 1.0;
                    }
                    s
                })
                .collect();
            let uniforms: Vec<Option<f64>> = (0..n).map(|_| match rng.below(8) {
                0 => None,
                1 => Some(0.0),
                2 => Some(0.5),
                3 => Some(0.25),
                _ => Some(rng.unit()),
            }).collect();
            let flat: Vec<f32> = rows.concat();
            let buf = gpu.upload(&flat).unwrap();
            let jobs: Vec<RowJob> = (0..n).map(|r| RowJob { src_row: r, spec: &specs[r], target: None, host_row: None, draw: uniforms[r] }).collect();
            if round == 0 {
                // Sizes the workspaces; then poisoned.
                let e = sampler.enqueue(&gpu, gpu.ptr(&buf), v, &jobs, Some((gpu.ptr(&picks_buf), n))).unwrap();
                sampler.collect(&gpu, e, &jobs).unwrap();
                sampler.poison(&gpu).unwrap();
            }
            let e = sampler.enqueue(&gpu, gpu.ptr(&buf), v, &jobs, Some((gpu.ptr(&picks_buf), n))).unwrap();
            let c = sampler.collect(&gpu, e, &jobs).unwrap();
            // The picks array is indexed by device row (the rows not planned as full rows, in
            // order), the read-back picks by job.
            let on_device = gpu.download(&picks_buf).unwrap();
            let dev_rows: Vec<usize> = (0..n).filter(|&r| !plan(&specs[r], None, v, MAX_CANDIDATES).full_row).collect();
            for (d, &r) in dev_rows.iter().enumerate() {
                if on_device[d] != c.picks[r].map_or(-1, |t| t as i32) {
                    failures.push(format!("vocab {v} round {round} row {r}: picks array {} vs read-back {:?}", on_device[d], c.picks[r]));
                }
            }
            for r in 0..n {
                let (s, u) = (&specs[r], uniforms[r]);
                let what = format!("vocab {v} round {round} row {r} spec {s:?} u {u:?}");
                let pl = plan(s, None, v, MAX_CANDIDATES);
                let read_back = c.picks[r];
                if pl.full_row {
                    if read_back.is_some() {
                        failures.push(format!("{what}: a pick for a row reduced on the host"));
                    }
                    continue;
                }
                let want_result = reduce_row(&rows[r], s, None);
                let want: Option<u32> = match (&want_result, u) {
                    (Ok(red), Some(u)) if pl.whole_set => draw(&red.candidate_ids, &red.candidate_logits, s.temperature, u).ok().map(|k| red.candidate_ids[k]),
                    (Ok(red), _) => red.candidate_ids.first().copied(),
                    (Err(_), _) => None,
                };
                match (read_back, want) {
                    (Some(g), Some(w)) if g == w => {
                        let several = want_result.as_ref().is_ok_and(|x| x.candidate_ids.len() > 1);
                        if u.is_some() && pl.whole_set && s.temperature > 0.0 {
                            drawn += 1;
                            among_several += several as usize;
                        } else {
                            first_only += 1;
                            not_whole += (u.is_some() && !pl.whole_set && s.temperature > 0.0) as usize;
                        }
                    }
                    (None, _) if device_sees_non_finite(&rows[r], s) || want.is_none() => none += 1,
                    (g, w) => failures.push(format!("{what}: device pick {g:?}, host draw {w:?}")),
                }
            }
        }
    }
    eprintln!("device draws: {drawn} sampled ({among_several} among several candidates), {first_only} first-candidate picks, {none} rows without a pick");
    for f in failures.iter().take(30) {
        eprintln!("FAIL {f}");
    }
    assert!(failures.is_empty(), "{} failures", failures.len());
    assert!(among_several > 100 && first_only > 20 && none > 0 && not_whole > 5, "every kind of row must have run ({not_whole} rows with a uniform and no whole set)");
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn fixture_model_rows_reduce_on_device() {
    let v = common::variants().into_iter().find(|v| v.model == "m2-small" && v.name == "q8_0").expect("m2-small q8_0 fixture");
    let m = Arc::new(GgufModel::open(&v.gguf).unwrap());
    let mut model = CudaModel::load(m, KvSpec { page_size: 16, n_pages: 64 }, CudaOptions::default()).unwrap();
    eprintln!("fast path: {:?}", model.fast_path_off().unwrap_or("on"));
    let fast_on = model.fast_path_off().is_none();
    let vocab = v.vocab;
    let mut rng = Rng(77);
    let seqs: Vec<Vec<u32>> = v.sequences.iter().filter(|s| s.len() >= 8).take(3).map(|s| s[..s.len().min(40)].to_vec()).collect();
    assert!(!seqs.is_empty(), "fixture sequences of 8+ tokens");
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
        // Steps 0-1: `forward` (logits downloaded) + `reduce_rows`; steps 2-3: the server's
        // way, `forward_stage_lazy` (fast path: rows left on the device) + `StepLogits::reduce`.
        let (out, got, stats, lazy) = if step < 2 {
            let out = model.forward(&batch).unwrap();
            let jobs: Vec<(SamplingSpec, Option<u32>)> = out.rows.iter().map(|_| random_spec(&mut rng, vocab)).collect();
            let (got, stats) = model.reduce_rows(&batch, &out, &jobs).unwrap();
            (out, (got, jobs), stats, false)
        } else {
            let l = model.forward_stage_lazy(&batch).unwrap().expect("whole model returns logits");
            assert!(l.on_device() || !fast_on, "step {step}: the fast path left its rows on the device");
            let jobs: Vec<(SamplingSpec, Option<u32>)> = l.rows().iter().map(|_| random_spec(&mut rng, vocab)).collect();
            let (got, stats) = l.reduce(&jobs).unwrap();
            (l.into_host().unwrap(), (got, jobs), stats, true)
        };
        let (got, jobs) = got;
        for (i, s) in batch.seqs.iter().enumerate() {
            cached[i] += s.tokens.len();
        }
        for (ri, g) in got.iter().enumerate() {
            let want = reduce_row(out.row(ri), &jobs[ri].0, jobs[ri].1);
            compare(g, &want, &format!("step {step} row {ri} {:?}", jobs[ri]));
        }
        eprintln!("step {step}{}: {} rows, {stats:?}", if lazy { " (lazy)" } else { "" }, out.rows.len());
        assert!(stats.device > 0, "step {step}: no row decided on the device");
    }
}

/// The server's way on the fast path (synthetic MiniMax-M2.7 shapes, 2 layers, vocab 200,064):
/// `forward_stage_lazy` leaves the rows on the device, `StepLogits::reduce` reduces them there
/// (host fallbacks download single rows). Checks the rows are the bytes `forward` downloads,
/// the reductions are `reduce_row`'s, and times a decode step both ways at 1 and 32 sequences.
#[test]
#[ignore = "needs a CUDA GPU"]
fn lazy_rows_on_the_fast_path_synthetic_m27() {
    use minimax_shared::model::synthetic::SyntheticSpec;
    let spec = SyntheticSpec::parse("m2.7:iq4xs:2").unwrap();
    let mut m = CudaModel::synthetic(&spec, KvSpec { page_size: 16, n_pages: 256 }, CudaOptions::default(), 7).unwrap();
    assert!(m.fast_path_off().is_none(), "fast path off: {:?}", m.fast_path_off());
    let v = m.config().vocab_size;
    let mut rng = Rng(4242);
    for &n in &[1usize, 32] {
        let base = n as u64 * 1000;
        let batch = |cached: usize, toks: &dyn Fn(usize) -> Vec<u32>| ForwardBatch {
            seqs: (0..n)
                .map(|i| SeqStep {
                    seq_id: base + i as u64,
                    page_table: (0..4).map(|p| (i * 4 + p) as u32).collect(),
                    cached_len: cached,
                    tokens: toks(i),
                    logits: LogitsWanted::Last,
                })
                .collect(),
        };
        let prompt: Vec<Vec<u32>> = (0..n).map(|_| (0..5).map(|_| rng.below(v as u64) as u32).collect()).collect();
        m.forward(&batch(0, &|i| prompt[i].clone())).unwrap();
        for step in 0..3 {
            let cached = 5 + step;
            let toks: Vec<u32> = (0..n).map(|_| rng.below(v as u64) as u32).collect();
            let b = batch(cached, &|i| vec![toks[i]]);
            // The same step twice (same positions: the cache writes repeat): downloaded, then lazy.
            let want = m.forward(&b).unwrap();
            let l = m.forward_stage_lazy(&b).unwrap().expect("logits");
            assert!(l.on_device(), "fast path rows on the device");
            assert_eq!(l.rows(), &want.rows[..]);
            let jobs: Vec<(SamplingSpec, Option<u32>)> = (0..n).map(|_| random_spec(&mut rng, v)).collect();
            let (got, stats) = l.reduce(&jobs).unwrap();
            let host = l.into_host().unwrap();
            assert!(host.logits.iter().zip(&want.logits).all(|(a, b)| a.to_bits() == b.to_bits()), "lazy rows differ from the downloaded ones");
            for (ri, g) in got.iter().enumerate() {
                compare(g, &reduce_row(want.row(ri), &jobs[ri].0, jobs[ri].1), &format!("seqs {n} step {step} row {ri} {:?}", jobs[ri]));
            }
            eprintln!("lazy: seqs {n} step {step}: {stats:?}");
            if step == 2 {
                for (name, spec) in [
                    ("t=1 top_k=40 top_p=0.95", SamplingSpec { top_k: 40, top_p: 0.95, ..Default::default() }),
                    ("greedy", SamplingSpec { temperature: 0.0, ..Default::default() }),
                ] {
                    let jobs: Vec<(SamplingSpec, Option<u32>)> = (0..n).map(|_| (spec.clone(), None)).collect();
                    let t_host = time_it(10, || {
                        let o = m.forward(&b).unwrap();
                        for (ri, (s, t)) in jobs.iter().enumerate() {
                            let _ = reduce_row(o.row(ri), s, *t);
                        }
                    });
                    let t_dev = time_it(10, || {
                        let l = m.forward_stage_lazy(&b).unwrap().unwrap();
                        l.reduce(&jobs).unwrap();
                    });
                    let t_fwd = time_it(10, || {
                        m.forward_stage_lazy(&b).unwrap().unwrap();
                    });
                    eprintln!(
                        "STEP vocab {v} seqs {n:>2} [{name}] (2-layer model): forward + download + host reduce_row {:.3} ms | forward + device reduction {:.3} ms | forward alone {:.3} ms",
                        t_host * 1e3,
                        t_dev * 1e3,
                        t_fwd * 1e3
                    );
                }
            }
        }
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
        // No NaN / +inf rows here (the host reduction must succeed).
        let clean = |x: f32| if x.is_nan() || x == f32::INFINITY { 0.0 } else { x };
        let flat: Vec<f32> = (0..n).flat_map(|_| random_row(&mut rng, v, 0)).map(clean).collect();
        let conc: Vec<f32> = (0..n).flat_map(|_| random_row(&mut rng, v, 2)).map(clean).collect();
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
            let jobs: Vec<RowJob> = (0..n).map(|r| RowJob { src_row: r, spec: &spec, target: Some(7), host_row: None, draw: None }).collect();
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
        // Overlapped decode's merge with picks: the first candidate, or the row's own draw
        // with the gateway's uniform (MiniMax's defaults; no penalties, as served).
        let spec = SamplingSpec { top_k: 40, top_p: 0.95, ..Default::default() };
        let picks_buf = gpu.zeros::<i32>(n).unwrap();
        for (name, u) in [("picks, first candidate", None), ("picks, drawn on the device", Some(0.37))] {
            let jobs: Vec<RowJob> = (0..n).map(|r| RowJob { src_row: r, spec: &spec, target: None, host_row: None, draw: u }).collect();
            let mut call = || {
                let e = sampler.enqueue(&gpu, gpu.ptr(&buf_g), v, &jobs, Some((gpu.ptr(&picks_buf), n))).unwrap();
                sampler.collect(&gpu, e, &jobs).unwrap();
            };
            let dev = time_it(20, &mut call);
            gpu.profile_begin();
            call();
            let kernels = gpu.profile_end().unwrap();
            let merge: f32 = kernels.iter().filter(|k| k.0.contains("merge")).map(|k| k.1).sum();
            let all: f32 = kernels.iter().map(|k| k.1).sum();
            eprintln!("TIMING vocab {v} rows {n:>2} [t=1 top_k=40 top_p=0.95, {name}]: {:.1} us/call; kernels {:.1} us, samp_merge {:.1} us", dev * 1e6, all * 1e3, merge * 1e3);
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
