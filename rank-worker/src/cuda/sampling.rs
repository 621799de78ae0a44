//! Sampling reductions on the device (`kernels/sampling.cu`): a logits row is reduced on the GPU
//! to what `minimax_shared::sampling::reduce_row` returns (penalties, logit bias, temperature,
//! top-k / top-p / min-p candidates, raw log-sum-exp, top logprobs, target logprob), so a step
//! brings a few KB per row to the host instead of the whole vocabulary.
//!
//! The kernels compute a partial reduction per [`partial::plan`] (at most
//! [`MAX_CANDIDATES`] leading candidates); [`partial::finish`] rebuilds the exact
//! `RowReduction` from it. Rows the partial data cannot decide (a candidate set larger than
//! the cap, a top_p cut within rounding of the total, NaN or overflowing logits, invalid specs)
//! are reduced on the host with `reduce_row` itself, so the result is always `reduce_row`'s:
//! candidates, order and logits bit-identical; the log-sum-exp (and `top_logprobs`,
//! `target_logprob` derived from it) within 1e-6 relative (f32 `exp`, f64 sums).
//!
//! This file is a child module of `model` (declared there) so [`CudaModel::reduce_rows`] can
//! read the fast path's logits buffer where the forward left it.

use std::collections::BTreeMap;
use std::sync::Mutex;

use cudarc::driver::CudaSlice;
use minimax_shared::forward::{ForwardBatch, ForwardOutput, LogitsRow};
use minimax_shared::sampling::partial::{self, RowPartial, RowPlan};
use minimax_shared::sampling::{self, RowReduction, SamplingError, SamplingSpec};

use super::CudaModel;
use crate::cuda::{Arg, CudaError, Gpu};

/// Most leading candidates the device returns per row (`SP_KMAX` in the kernels).
pub const MAX_CANDIDATES: usize = 1024;
const MAX_TOP: usize = 20;
const THREADS: u32 = 1024;
const CHUNK: usize = 8192;
const PW: usize = 16;
const HDR: usize = HEADER_WORDS;
/// Words of a row's output header (`SP_HDR` in the kernels).
pub const HEADER_WORDS: usize = 48;
const TW: usize = 4;
const BS: usize = 5;

// Parameter and header word indices (kernels/sampling.cu).
const P_KC: usize = 0;
const P_T: usize = 1;
const P_TEMP: usize = 2;
const P_REP: usize = 3;
const P_FREQ: usize = 4;
const P_PRES: usize = 5;
const P_TOFF: usize = 6;
const P_TLEN: usize = 7;
const P_TARGET: usize = 8;
const P_NEED_TOTAL: usize = 9;
const P_OUT_OFF: usize = 10;
const P_SRC_ROW: usize = 11;
const H_NAN: usize = 0;
const H_FLAGS: usize = 1;
const H_LSE: usize = 2;
const H_NFIN: usize = 3;
const H_TARGET: usize = 4;
const H_NCAND: usize = 6;
const H_NTOP: usize = 7;
const H_TOP_IDS: usize = 8;
const H_TOP_RAW: usize = 28;

/// One row's reduction, or why it cannot be sampled (as `reduce_row` says it).
pub type RowResult = Result<RowReduction, SamplingError>;

/// One logits row to reduce.
pub struct RowJob<'a> {
    /// Row index in the logits buffer (address `logits + src_row * stride` floats).
    pub src_row: usize,
    pub spec: &'a SamplingSpec,
    pub target: Option<u32>,
    /// The same row on the host, if there is one: used for host fallbacks instead of a
    /// download, and every value the device reports is checked against it.
    pub host_row: Option<&'a [f32]>,
}

/// How the rows of one call were reduced.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct ReduceStats {
    /// Rows finished from the device's partial reduction.
    pub device: usize,
    /// Rows reduced on the host (planned so, or declined by `partial::finish`).
    pub host: usize,
}

/// Workspaces of the sampling kernels for one vocabulary size, grown on demand.
pub struct DeviceSampler {
    vocab: usize,
    nb: usize,
    input: CudaSlice<u32>,
    tz: CudaSlice<f32>,
    bitmap: CudaSlice<u32>,
    bstat: CudaSlice<f64>,
    raw_keys: CudaSlice<u64>,
    cand_keys: CudaSlice<u64>,
    out: CudaSlice<u32>,
    host_out: Vec<u32>,
}

fn grow<T: cudarc::driver::DeviceRepr + cudarc::driver::ValidAsZeroBits>(gpu: &Gpu, buf: &mut CudaSlice<T>, n: usize) -> Result<(), CudaError> {
    if buf.len() < n {
        *buf = gpu.zeros(n.next_power_of_two())?;
    }
    Ok(())
}

impl DeviceSampler {
    /// Empty workspaces for rows of `vocab` logits.
    pub fn new(gpu: &Gpu, vocab: usize) -> Result<Self, CudaError> {
        if vocab == 0 || vocab > i32::MAX as usize {
            return Err(CudaError::Shape(format!("sampling: vocabulary of {vocab}")));
        }
        Ok(Self {
            vocab,
            nb: vocab.div_ceil(CHUNK),
            input: gpu.zeros(1)?,
            tz: gpu.zeros(1)?,
            bitmap: gpu.zeros(1)?,
            bstat: gpu.zeros(1)?,
            raw_keys: gpu.zeros(1)?,
            cand_keys: gpu.zeros(1)?,
            out: gpu.zeros(1)?,
            host_out: Vec::new(),
        })
    }

    /// Fills every workspace with NaN bits (tests: a value a kernel failed to write shows).
    pub fn poison(&mut self, gpu: &Gpu) -> Result<(), CudaError> {
        const NAN: u32 = 0x7fc0_0000;
        gpu.fill_u32(gpu.ptr(&self.tz), self.tz.len(), NAN)?;
        gpu.fill_u32(gpu.ptr(&self.bstat), 2 * self.bstat.len(), NAN)?;
        gpu.fill_u32(gpu.ptr(&self.raw_keys), 2 * self.raw_keys.len(), NAN)?;
        gpu.fill_u32(gpu.ptr(&self.cand_keys), 2 * self.cand_keys.len(), NAN)?;
        gpu.fill_u32(gpu.ptr(&self.out), self.out.len(), NAN)?;
        gpu.sync()
    }

    /// The vocabulary size this sampler was made for.
    pub fn vocab(&self) -> usize {
        self.vocab
    }

    /// The last call's downloaded output words (row headers first, `HEADER_WORDS` each):
    /// tests print them when a call fails.
    pub fn last_output(&self) -> &[u32] {
        &self.host_out
    }

    /// Reduces `jobs` (rows of the f32 logits at device address `logits`, `stride` floats
    /// apart) to exactly what `reduce_row` returns for each.
    pub fn reduce(&mut self, gpu: &Gpu, logits: u64, stride: usize, jobs: &[RowJob]) -> Result<(Vec<RowResult>, ReduceStats), CudaError> {
        let v = self.vocab;
        if stride < v || !logits.is_multiple_of(4) {
            return Err(CudaError::Shape(format!("sampling: logits stride {stride} < vocab {v} or misaligned address")));
        }
        if let Some(j) = jobs.iter().find(|j| j.host_row.is_some_and(|h| h.len() != v)) {
            return Err(CudaError::Shape(format!("sampling: host row {} has {} values, vocab {v}", j.src_row, j.host_row.unwrap().len())));
        }
        let plans: Vec<RowPlan> = jobs.iter().map(|j| partial::plan(j.spec, j.target, v, MAX_CANDIDATES)).collect();
        let dev: Vec<usize> = (0..jobs.len()).filter(|&i| !plans[i].full_row).collect();
        let mut results: Vec<Option<RowResult>> = (0..jobs.len()).map(|_| None).collect();
        let mut stats = ReduceStats::default();
        if !dev.is_empty() {
            let partials = self.run(gpu, logits, stride, jobs, &plans, &dev)?;
            for (&i, p) in dev.iter().zip(partials) {
                let j = &jobs[i];
                let Some(p) = p else { continue };
                if let Some(h) = j.host_row {
                    check_against_host(&p, h, j)?;
                }
                if let Some(r) = partial::finish(&p, j.spec, j.target) {
                    results[i] = Some(r);
                    stats.device += 1;
                }
            }
        }
        let mut out = Vec::with_capacity(jobs.len());
        for (i, r) in results.into_iter().enumerate() {
            out.push(match r {
                Some(r) => r,
                None => {
                    stats.host += 1;
                    let j = &jobs[i];
                    match j.host_row {
                        Some(h) => sampling::reduce_row(h, j.spec, j.target),
                        None => sampling::reduce_row(&download_row(gpu, logits, stride, j.src_row, v)?, j.spec, j.target),
                    }
                }
            });
        }
        Ok((out, stats))
    }

    /// Runs the kernels for the rows `dev` and returns their partial reductions (None: the
    /// device saw NaN or overflow; the host decides).
    fn run(&mut self, gpu: &Gpu, logits: u64, stride: usize, jobs: &[RowJob], plans: &[RowPlan], dev: &[usize]) -> Result<Vec<Option<RowPartial>>, CudaError> {
        let (v, nb, n) = (self.vocab, self.nb, dev.len());
        let words = v.div_ceil(32);
        let mut params = vec![0u32; n * PW];
        let mut touch: Vec<u32> = Vec::new();
        let mut out_off = n * HDR;
        let kcap = dev.iter().map(|&i| plans[i].candidates).max().unwrap_or(1).max(1);
        for (d, &i) in dev.iter().enumerate() {
            let (j, pl) = (&jobs[i], &plans[i]);
            let s = j.spec;
            let mut ents: BTreeMap<u32, (u32, Option<f32>)> = BTreeMap::new();
            for &(t, c) in &s.history {
                ents.entry(t).or_default().0 = c;
            }
            for &(t, b) in &s.logit_bias {
                ents.entry(t).or_default().1 = Some(b);
            }
            let p = &mut params[d * PW..(d + 1) * PW];
            p[P_KC] = pl.candidates as u32;
            p[P_T] = s.top_logprobs.min(MAX_TOP as u32);
            p[P_TEMP] = s.temperature.to_bits();
            p[P_REP] = s.repetition_penalty.to_bits();
            p[P_FREQ] = s.frequency_penalty.to_bits();
            p[P_PRES] = s.presence_penalty.to_bits();
            p[P_TOFF] = (touch.len() / TW) as u32;
            p[P_TLEN] = ents.len() as u32;
            p[P_TARGET] = j.target.unwrap_or(u32::MAX);
            p[P_NEED_TOTAL] = pl.need_total as u32;
            p[P_OUT_OFF] = out_off as u32;
            p[P_SRC_ROW] = u32::try_from(j.src_row).map_err(|_| CudaError::Shape("sampling: row index".into()))?;
            out_off += 3 * pl.candidates;
            for (t, (c, b)) in ents {
                touch.extend([t, c, b.unwrap_or(0.0).to_bits(), b.is_some() as u32]);
            }
        }
        let n_touch = touch.len() / TW;
        let tot_off = out_off.next_multiple_of(2);
        let out_words = tot_off + 2 * n * nb;
        let in_words = n * PW + touch.len();
        grow(gpu, &mut self.input, in_words)?;
        grow(gpu, &mut self.tz, n_touch.max(1))?;
        grow(gpu, &mut self.bitmap, n * words)?;
        grow(gpu, &mut self.bstat, n * nb * BS)?;
        grow(gpu, &mut self.raw_keys, n * nb * MAX_TOP)?;
        grow(gpu, &mut self.cand_keys, n * nb * kcap)?;
        grow(gpu, &mut self.out, out_words)?;
        params.extend_from_slice(&touch);
        gpu.stream.memcpy_htod(&params, &mut self.input.slice_mut(0..in_words))?;
        gpu.stream.memset_zeros(&mut self.bitmap.slice_mut(0..n * words))?;
        let pin = gpu.ptr(&self.input);
        let (touch_p, tz, bits) = (pin + (n * PW * 4) as u64, gpu.ptr(&self.tz), gpu.ptr(&self.bitmap));
        let (bstat, rk, ck, outp) = (gpu.ptr(&self.bstat), gpu.ptr(&self.raw_keys), gpu.ptr(&self.cand_keys), gpu.ptr(&self.out));
        let (st, vi) = (Arg::L(stride as i64), Arg::I(v as i32));
        if n_touch > 0 {
            gpu.launch("samp_penalty", (n as u32, 1, 1), 256, 0, &[Arg::P(logits), st, vi, Arg::P(pin), Arg::P(touch_p), Arg::P(tz), Arg::P(bits)])?;
        }
        gpu.launch(
            "samp_chunk",
            (nb as u32, n as u32, 1),
            THREADS,
            0,
            &[Arg::P(logits), st, vi, Arg::P(pin), Arg::P(touch_p), Arg::P(tz), Arg::P(bits), Arg::P(bstat), Arg::P(rk), Arg::P(ck), Arg::I(kcap as i32)],
        )?;
        gpu.launch(
            "samp_merge",
            (n as u32, 1, 1),
            THREADS,
            0,
            &[Arg::P(logits), st, vi, Arg::I(nb as i32), Arg::P(pin), Arg::P(touch_p), Arg::P(tz), Arg::P(bits), Arg::P(bstat), Arg::P(rk), Arg::P(ck), Arg::I(kcap as i32), Arg::P(outp)],
        )?;
        if dev.iter().any(|&i| plans[i].need_total) {
            gpu.launch(
                "samp_total",
                (nb as u32, n as u32, 1),
                THREADS,
                0,
                &[Arg::P(logits), st, vi, Arg::P(pin), Arg::P(touch_p), Arg::P(tz), Arg::P(bits), Arg::P(outp), Arg::P(outp + (tot_off * 4) as u64)],
            )?;
        }
        self.host_out.resize(out_words, 0);
        gpu.stream.memcpy_dtoh(&self.out.slice(0..out_words), &mut self.host_out[..])?;
        gpu.sync()?;

        let o = &self.host_out;
        let f = |w: u32| f32::from_bits(w);
        let mut partials = Vec::with_capacity(n);
        for (d, &i) in dev.iter().enumerate() {
            let (j, pl) = (&jobs[i], &plans[i]);
            let h = &o[d * HDR..(d + 1) * HDR];
            if h[H_NAN] != u32::MAX || h[H_FLAGS] != 0 {
                partials.push(None);
                continue;
            }
            let n_finite = h[H_NFIN] as usize;
            let (nc, nt) = (h[H_NCAND] as usize, h[H_NTOP] as usize);
            let t_want = (j.spec.top_logprobs as usize).min(v);
            if nt != t_want || nc != pl.candidates.min(n_finite) {
                return Err(CudaError::Shape(format!("sampling kernels returned {nc} candidates / {nt} top logprobs for row {} (expected {} / {t_want})", j.src_row, pl.candidates.min(n_finite))));
            }
            let off = params[d * PW + P_OUT_OFF] as usize;
            let k = pl.candidates;
            let total = pl.need_total.then(|| {
                (0..nb).map(|b| {
                    let w = tot_off + 2 * (d * nb + b);
                    f64::from_bits(o[w] as u64 | (o[w + 1] as u64) << 32)
                })
                .sum()
            });
            partials.push(Some(RowPartial {
                raw_logsumexp: f(h[H_LSE]),
                top_ids: h[H_TOP_IDS..H_TOP_IDS + nt].to_vec(),
                top_raw: h[H_TOP_RAW..H_TOP_RAW + nt].iter().map(|&w| f(w)).collect(),
                target_raw: j.target.map(|_| f(h[H_TARGET])),
                n_finite,
                cand_ids: o[off..off + nc].to_vec(),
                cand_logits: o[off + k..off + k + nc].iter().map(|&w| f(w)).collect(),
                cand_raw: o[off + 2 * k..off + 2 * k + nc].iter().map(|&w| f(w)).collect(),
                total,
            }));
        }
        Ok(partials)
    }
}

/// Every raw value the device reports must be the host row's (catches a wrong row mapping).
fn check_against_host(p: &RowPartial, host: &[f32], j: &RowJob) -> Result<(), CudaError> {
    let same = |id: u32, v: f32| host.get(id as usize).is_some_and(|h| h.to_bits() == v.to_bits());
    let ok = p.cand_ids.iter().zip(&p.cand_raw).all(|(&i, &v)| same(i, v))
        && p.top_ids.iter().zip(&p.top_raw).all(|(&i, &v)| same(i, v))
        && j.target.zip(p.target_raw).is_none_or(|(t, v)| same(t, v));
    if ok { Ok(()) } else { Err(CudaError::Shape(format!("sampling: device logits row {} differs from the host copy", j.src_row))) }
}

/// Copies one logits row to the host (fallback when no host copy exists).
fn download_row(gpu: &Gpu, logits: u64, stride: usize, row: usize, v: usize) -> Result<Vec<f32>, CudaError> {
    let mut h = vec![0f32; v];
    gpu.ctx.bind_to_thread()?;
    unsafe { cudarc::driver::result::memcpy_dtoh_async(&mut h, logits + (row * stride * 4) as u64, gpu.stream.cu_stream()) }?;
    gpu.sync()?;
    Ok(h)
}

/// The process's sampler (one model per rank process), keyed by the CUDA context it lives in.
static SAMPLER: Mutex<Option<(usize, DeviceSampler)>> = Mutex::new(None);

/// Runs `f` with the process's sampler for `g`'s context and vocabulary `v`.
fn with_sampler<R>(g: &Gpu, v: usize, f: impl FnOnce(&mut DeviceSampler) -> Result<R, CudaError>) -> Result<R, CudaError> {
    let key = std::sync::Arc::as_ptr(&g.ctx) as usize;
    let mut guard = SAMPLER.lock().unwrap_or_else(|e| e.into_inner());
    if !matches!(&*guard, Some((k, s)) if *k == key && s.vocab() == v) {
        *guard = Some((key, DeviceSampler::new(g, v)?));
    }
    f(&mut guard.as_mut().expect("just set").1)
}

/// A step's logits rows, downloaded (exact path) or left on the device where the fast path
/// wrote them (`CudaModel::forward_stage_lazy`), so only rows the host must reduce itself
/// cross the bus. Borrows the model: no later forward can overwrite the rows while it lives.
pub struct StepLogits<'m> {
    model: &'m CudaModel,
    rows: Vec<LogitsRow>,
    data: RowData,
}

enum RowData {
    /// `rows.len() * vocab` values, row-major.
    Host(Vec<f32>),
    /// Each row's index in the fast workspace's logits buffer (its flat token index).
    Device(Vec<usize>),
}

impl<'m> StepLogits<'m> {
    pub(super) fn host(model: &'m CudaModel, out: ForwardOutput) -> Self {
        Self { model, rows: out.rows, data: RowData::Host(out.logits) }
    }

    pub(super) fn device(model: &'m CudaModel, rows: Vec<LogitsRow>, src: Vec<usize>) -> Self {
        Self { model, rows, data: RowData::Device(src) }
    }

    /// The rows, in batch order.
    pub fn rows(&self) -> &[LogitsRow] {
        &self.rows
    }

    /// Whether the rows are still on the device (nothing downloaded yet).
    pub fn on_device(&self) -> bool {
        matches!(self.data, RowData::Device(_))
    }

    /// The rows on the host (a device row is downloaded: the same bytes the forward wrote).
    pub fn into_host(self) -> Result<ForwardOutput, CudaError> {
        match self.data {
            RowData::Host(logits) => Ok(ForwardOutput { rows: self.rows, logits, vocab_size: self.model.cfg.vocab_size }),
            RowData::Device(ref src) => {
                let logits = self.download(src)?;
                Ok(ForwardOutput { rows: self.rows, logits, vocab_size: self.model.cfg.vocab_size })
            }
        }
    }

    /// A host copy of the rows (fallback when the device reduction fails).
    pub fn to_host(&self) -> Result<ForwardOutput, CudaError> {
        let v = self.model.cfg.vocab_size;
        let logits = match &self.data {
            RowData::Host(l) => l.clone(),
            RowData::Device(src) => self.download(src)?,
        };
        Ok(ForwardOutput { rows: self.rows.clone(), logits, vocab_size: v })
    }

    fn download(&self, src: &[usize]) -> Result<Vec<f32>, CudaError> {
        let (g, v) = (&self.model.gpu, self.model.cfg.vocab_size);
        let ws = self.model.fast.as_ref().ok_or_else(|| CudaError::Shape("device logits rows without a fast workspace".into()))?;
        let mut logits = vec![0f32; src.len() * v];
        for (r, &i) in src.iter().enumerate() {
            let row = ws.logits.slice(i * v..(i + 1) * v);
            g.stream.memcpy_dtoh(&row, &mut logits[r * v..(r + 1) * v])?;
        }
        g.sync()?;
        Ok(logits)
    }

    /// Reduces the rows on the device, one `(spec, target)` per row in order, to exactly
    /// `reduce_row`'s results. Device rows are read in place and a row the host must reduce is
    /// downloaded alone; host rows are uploaded (and host fallbacks use the host copy).
    pub fn reduce(&self, jobs: &[(SamplingSpec, Option<u32>)]) -> Result<(Vec<RowResult>, ReduceStats), CudaError> {
        let (g, v) = (&self.model.gpu, self.model.cfg.vocab_size);
        if jobs.len() != self.rows.len() {
            return Err(CudaError::Shape(format!("sampling: {} rows, {} specs", self.rows.len(), jobs.len())));
        }
        if jobs.is_empty() {
            return Ok((Vec::new(), ReduceStats::default()));
        }
        match &self.data {
            RowData::Device(src) => {
                let ws = self.model.fast.as_ref().ok_or_else(|| CudaError::Shape("device logits rows without a fast workspace".into()))?;
                let rj: Vec<RowJob> = jobs.iter().zip(src).map(|((spec, target), &src_row)| RowJob { src_row, spec, target: *target, host_row: None }).collect();
                with_sampler(g, v, |s| s.reduce(g, g.ptr(&ws.logits), v, &rj))
            }
            RowData::Host(logits) => {
                if logits.len() != jobs.len() * v {
                    return Err(CudaError::Shape(format!("sampling: {} logits for {} rows", logits.len(), jobs.len())));
                }
                let up = g.upload(logits)?;
                let rj: Vec<RowJob> = jobs
                    .iter()
                    .enumerate()
                    .map(|(ri, (spec, target))| RowJob { src_row: ri, spec, target: *target, host_row: Some(&logits[ri * v..(ri + 1) * v]) })
                    .collect();
                with_sampler(g, v, |s| s.reduce(g, g.ptr(&up), v, &rj))
            }
        }
    }
}

impl CudaModel {
    /// Reduces the logits rows of the last `forward(batch)`, which returned `out`, one per
    /// `(spec, target)` in row order, to exactly `reduce_row`'s results. Reads the fast path's
    /// logits where the forward left them on the device (other steps: from `out`, uploaded).
    pub fn reduce_rows(&self, batch: &ForwardBatch, out: &ForwardOutput, jobs: &[(SamplingSpec, Option<u32>)]) -> Result<(Vec<RowResult>, ReduceStats), CudaError> {
        let v = self.cfg.vocab_size;
        if out.rows.len() != jobs.len() || out.vocab_size != v || out.logits.len() != out.rows.len() * v {
            return Err(CudaError::Shape(format!("sampling: {} rows, {} specs, {} logits", out.rows.len(), jobs.len(), out.logits.len())));
        }
        if jobs.is_empty() {
            return Ok((Vec::new(), ReduceStats::default()));
        }
        let g = &self.gpu;
        // Where each row is: the fast path keeps a row per token of the step.
        let on_device = self.fast_eligible(batch.n_tokens()) && self.fast.is_some();
        let mut starts = Vec::with_capacity(batch.seqs.len());
        let mut t0 = 0;
        for s in &batch.seqs {
            starts.push(t0);
            t0 += s.tokens.len();
        }
        let mk = |src: &dyn Fn(usize) -> usize| -> Vec<RowJob> {
            jobs.iter()
                .enumerate()
                .map(|(ri, (spec, target))| RowJob { src_row: src(ri), spec, target: *target, host_row: Some(out.row(ri)) })
                .collect()
        };
        if on_device {
            let ws = self.fast.as_ref().expect("fast path on");
            let src = |ri: usize| {
                let r = &out.rows[ri];
                starts[r.seq] + (r.position - batch.seqs[r.seq].cached_len)
            };
            with_sampler(g, v, |s| s.reduce(g, g.ptr(&ws.logits), v, &mk(&src)))
        } else {
            let up = g.upload(&out.logits)?;
            with_sampler(g, v, |s| s.reduce(g, g.ptr(&up), v, &mk(&|ri| ri)))
        }
    }
}
