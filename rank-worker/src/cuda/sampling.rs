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

use cudarc::driver::{CudaEvent, CudaSlice, PinnedHostSlice};
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
const PW: usize = 17;
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
const P_TOPP: usize = 12;
const P_MINP_LN: usize = 13;
const P_U_LO: usize = 14;
const P_U_HI: usize = 15;
const P_MASK: usize = 16;
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
    /// The gateway's uniform number for this row's draw, when the merge should draw the token
    /// itself (a pick of an [`enqueue`](DeviceSampler::enqueue) with picks): taken only for
    /// rows whose plan is a [`whole_set`](RowPlan::whole_set). Without it the pick is the
    /// first candidate (the greedy draw).
    pub draw: Option<f64>,
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
    /// Page-locked buffers the output words come back into, used in turn: overlapped decode
    /// reads one call's words after the next call was enqueued. `busy`: enqueued, not collected.
    slots: [Option<Pinned>; 2],
    busy: [bool; 2],
    next_slot: usize,
}

/// A page-locked host buffer (a copy into pageable memory would wait for the whole stream).
struct Pinned {
    _buf: PinnedHostSlice<u32>,
    ptr: *mut u32,
    cap: usize,
}

// SAFETY: the buffer is owned here and only touched under the sampler's mutex.
unsafe impl Send for Pinned {}

/// One call's kernels and read-back, enqueued on the stream ([`DeviceSampler::enqueue`]); its
/// results come from [`DeviceSampler::collect`], which must be called (it frees the buffer).
pub struct Enqueued {
    slot: usize,
    done: Option<CudaEvent>,
    plans: Vec<RowPlan>,
    dev: Vec<usize>,
    params: Vec<u32>,
    out_words: usize,
    tot_off: usize,
    pick_off: Option<usize>,
    logits: u64,
    stride: usize,
}

impl Enqueued {
    /// Waits until the read-back is on the host (nothing to wait for when no row ran).
    fn wait(&self) -> Result<(), CudaError> {
        if let Some(ev) = &self.done {
            ev.synchronize()?;
        }
        Ok(())
    }
}

/// What [`DeviceSampler::collect`] returns: per job, its reduction, and the draw the merge
/// left on the device for it (when picks were asked for and the row had one).
pub struct Collected {
    /// Per job, `reduce_row`'s result.
    pub results: Vec<RowResult>,
    /// How many rows the device finished and how many the host reduced.
    pub stats: ReduceStats,
    /// Per job, the merge's draw (None: not asked for, or none).
    pub picks: Vec<Option<u32>>,
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
            slots: [None, None],
            busy: [false, false],
            next_slot: 0,
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
        let e = self.enqueue(gpu, logits, stride, jobs, None)?;
        let c = self.collect(gpu, e, jobs)?;
        Ok((c.results, c.stats))
    }

    /// Enqueues the kernels of [`DeviceSampler::reduce`] and the read-back of their words,
    /// without waiting. `picks`: (device address, capacity) of an i32 array where the merge
    /// writes each device row's drawn token (overlapped decode's device-fed tokens): with the
    /// job's [`draw`](RowJob::draw) the token `partial::finish` + `draw::draw` take, otherwise
    /// the first candidate. At most two calls may be enqueued and not collected.
    pub fn enqueue(&mut self, gpu: &Gpu, logits: u64, stride: usize, jobs: &[RowJob], picks: Option<(u64, usize)>) -> Result<Enqueued, CudaError> {
        let v = self.vocab;
        if stride < v || !logits.is_multiple_of(4) {
            return Err(CudaError::Shape(format!("sampling: logits stride {stride} < vocab {v} or misaligned address")));
        }
        if let Some(j) = jobs.iter().find(|j| j.host_row.is_some_and(|h| h.len() != v)) {
            return Err(CudaError::Shape(format!("sampling: host row {} has {} values, vocab {v}", j.src_row, j.host_row.unwrap().len())));
        }
        let slot = self.next_slot;
        if self.busy[slot] {
            return Err(CudaError::Shape("sampling: two reductions already enqueued and not collected".into()));
        }
        let plans: Vec<RowPlan> = jobs.iter().map(|j| partial::plan(j.spec, j.target, v, MAX_CANDIDATES)).collect();
        let dev: Vec<usize> = (0..jobs.len()).filter(|&i| !plans[i].full_row).collect();
        let mut e = Enqueued { slot, done: None, plans, dev, params: Vec::new(), out_words: 0, tot_off: 0, pick_off: None, logits, stride };
        if !e.dev.is_empty() {
            self.run(gpu, jobs, &mut e, picks)?;
            self.busy[slot] = true;
            self.next_slot = 1 - slot;
        }
        Ok(e)
    }

    /// Waits for an enqueued call's words and finishes every row to `reduce_row`'s result
    /// (rows the device could not decide are reduced on the host, from a download of the row).
    /// `jobs` must be the ones given to [`DeviceSampler::enqueue`].
    pub fn collect(&mut self, gpu: &Gpu, e: Enqueued, jobs: &[RowJob]) -> Result<Collected, CudaError> {
        let v = self.vocab;
        let mut results: Vec<Option<RowResult>> = (0..jobs.len()).map(|_| None).collect();
        let mut picks = vec![None; jobs.len()];
        let mut stats = ReduceStats::default();
        if !e.dev.is_empty() {
            self.busy[e.slot] = false;
            let partials = self.decode(jobs, &e)?;
            for ((&i, p), pick) in e.dev.iter().zip(partials).zip(self.picks_of(&e)) {
                picks[i] = pick;
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
                        None => sampling::reduce_row(&download_row(gpu, e.logits, e.stride, j.src_row, v)?, j.spec, j.target),
                    }
                }
            });
        }
        Ok(Collected { results: out, stats, picks })
    }

    /// The draws an enqueued call read back, per device row.
    fn picks_of(&self, e: &Enqueued) -> Vec<Option<u32>> {
        match e.pick_off {
            Some(off) => self.host_out[off..off + e.dev.len()].iter().map(|&w| (w != u32::MAX).then_some(w)).collect(),
            None => vec![None; e.dev.len()],
        }
    }

    /// Enqueues the kernels for the rows `e.dev` and the read-back of their words into a
    /// page-locked slot, then an event ([`DeviceSampler::decode`] waits for it).
    fn run(&mut self, gpu: &Gpu, jobs: &[RowJob], e: &mut Enqueued, picks: Option<(u64, usize)>) -> Result<(), CudaError> {
        let (logits, stride, plans, dev) = (e.logits, e.stride, &e.plans, &e.dev);
        let (v, nb, n) = (self.vocab, self.nb, dev.len());
        let words = v.div_ceil(32);
        let mut params = vec![0u32; n * PW];
        let mut touch: Vec<u32> = Vec::new();
        // Allowed-token masks (structured outputs), `words` a row, after the touch entries.
        let mut masks: Vec<u32> = Vec::new();
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
            p[P_TOPP] = s.top_p.to_bits();
            // The host's own ln, so the min_p floor is the one partial::finish compares with.
            p[P_MINP_LN] = if s.min_p > 0.0 { s.min_p.ln().to_bits() } else { u32::MAX };
            let u = j.draw.filter(|_| pl.whole_set).map_or(u64::MAX, f64::to_bits);
            p[P_U_LO] = u as u32;
            p[P_U_HI] = (u >> 32) as u32;
            // An offset within `masks` here; made an offset within the input words below.
            p[P_MASK] = match &s.allowed {
                Some(m) => {
                    let at = masks.len() as u32;
                    push_mask(&mut masks, m, words);
                    at
                }
                None => u32::MAX,
            };
            out_off += 3 * pl.candidates;
            for (t, (c, b)) in ents {
                touch.extend([t, c, b.unwrap_or(0.0).to_bits(), b.is_some() as u32]);
            }
        }
        let n_touch = touch.len() / TW;
        let mask_base = u32::try_from(n * PW + touch.len()).map_err(|_| CudaError::Shape("sampling: parameter words".into()))?;
        for d in 0..n {
            let w = &mut params[d * PW + P_MASK];
            if *w != u32::MAX {
                *w += mask_base;
            }
        }
        let tot_off = out_off.next_multiple_of(2);
        // Then one word a row for the draws (when asked for).
        let pick_off = tot_off + 2 * n * nb;
        let out_words = pick_off + if picks.is_some() { n } else { 0 };
        let in_words = n * PW + touch.len() + masks.len();
        grow(gpu, &mut self.input, in_words)?;
        grow(gpu, &mut self.tz, n_touch.max(1))?;
        grow(gpu, &mut self.bitmap, n * words)?;
        grow(gpu, &mut self.bstat, n * nb * BS)?;
        grow(gpu, &mut self.raw_keys, n * nb * MAX_TOP)?;
        grow(gpu, &mut self.cand_keys, n * nb * kcap)?;
        grow(gpu, &mut self.out, out_words)?;
        params.extend_from_slice(&touch);
        params.extend_from_slice(&masks);
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
            &[
                Arg::P(logits),
                st,
                vi,
                Arg::I(nb as i32),
                Arg::P(pin),
                Arg::P(touch_p),
                Arg::P(tz),
                Arg::P(bits),
                Arg::P(bstat),
                Arg::P(rk),
                Arg::P(ck),
                Arg::I(kcap as i32),
                Arg::P(outp),
                Arg::P(picks.map_or(0, |p| p.0)),
                Arg::I(picks.map_or(0, |p| p.1.min(i32::MAX as usize)) as i32),
                Arg::I(pick_off as i32),
            ],
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
        let slot = match &mut self.slots[e.slot] {
            Some(p) if p.cap >= out_words => p,
            s => {
                let cap = out_words.next_power_of_two();
                // SAFETY: plain page-locked memory; every word read back is written first.
                let mut buf = unsafe { gpu.ctx.alloc_pinned_with_flags::<u32>(cap, 0) }?;
                let ptr = buf.as_mut_ptr()?;
                s.insert(Pinned { _buf: buf, ptr, cap })
            }
        };
        gpu.ctx.bind_to_thread()?;
        // SAFETY: the slot holds `cap >= out_words` words and is not read until the event.
        let dst = unsafe { std::slice::from_raw_parts_mut(slot.ptr, out_words) };
        unsafe { cudarc::driver::result::memcpy_dtoh_async(dst, gpu.ptr(&self.out), gpu.stream.cu_stream()) }?;
        e.done = Some(gpu.stream.record_event(Some(cudarc::driver::sys::CUevent_flags::CU_EVENT_DISABLE_TIMING))?);
        e.params = params;
        e.out_words = out_words;
        e.tot_off = tot_off;
        e.pick_off = picks.map(|_| pick_off);
        Ok(())
    }

    /// Waits for an enqueued call's words (copied to `host_out`) and returns each device row's
    /// partial reduction (None: the device saw NaN or overflow; the host decides).
    fn decode(&mut self, jobs: &[RowJob], e: &Enqueued) -> Result<Vec<Option<RowPartial>>, CudaError> {
        let (v, nb, n) = (self.vocab, self.nb, e.dev.len());
        let (dev, plans, params, tot_off) = (&e.dev, &e.plans, &e.params, e.tot_off);
        e.wait()?;
        let slot = self.slots[e.slot].as_ref().ok_or_else(|| CudaError::Shape("sampling: read-back slot missing".into()))?;
        // SAFETY: the event above follows the copy of `out_words` words into the slot.
        self.host_out.clear();
        self.host_out.extend_from_slice(unsafe { std::slice::from_raw_parts(slot.ptr, e.out_words) });

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

/// Appends an allowed-token mask (`SamplingSpec::allowed`: bit `t % 8` of byte `t / 8`) as
/// `words` little-endian u32 words (bit `t % 32` of word `t / 32`, the kernels' `P_MASK`
/// layout); bytes past the mask are zeros (tokens past it are banned, as on the host).
fn push_mask(out: &mut Vec<u32>, mask: &[u8], words: usize) {
    out.extend((0..words).map(|w| {
        let b = |i: usize| mask.get(4 * w + i).copied().unwrap_or(0);
        u32::from_le_bytes([b(0), b(1), b(2), b(3)])
    }));
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

/// [`StepLogits`] between [`StepLogits::detach`] and [`DetachedLogits::attach`].
pub struct DetachedLogits {
    rows: Vec<LogitsRow>,
    data: RowData,
}

impl DetachedLogits {
    /// The rows again, read from `model`, the one whose forward left them.
    pub fn attach(self, model: &CudaModel) -> StepLogits<'_> {
        StepLogits { model, rows: self.rows, data: self.data }
    }
}

enum RowData {
    /// `rows.len() * vocab` values, row-major.
    Host(Vec<f32>),
    /// Each row's index in the fast workspace's logits buffer `par` (its flat token index).
    Device(Vec<usize>, usize),
}

impl<'m> StepLogits<'m> {
    pub(super) fn host(model: &'m CudaModel, out: ForwardOutput) -> Self {
        Self { model, rows: out.rows, data: RowData::Host(out.logits) }
    }

    pub(super) fn device(model: &'m CudaModel, rows: Vec<LogitsRow>, src: Vec<usize>, par: usize) -> Self {
        Self { model, rows, data: RowData::Device(src, par) }
    }

    /// The rows without the borrow of the model, so the engine lock can be released while
    /// they wait for late rules; no forward may run before [`DetachedLogits::attach`].
    pub fn detach(self) -> DetachedLogits {
        DetachedLogits { rows: self.rows, data: self.data }
    }

    /// The rows, in batch order.
    pub fn rows(&self) -> &[LogitsRow] {
        &self.rows
    }

    /// Whether the rows are still on the device (nothing downloaded yet).
    pub fn on_device(&self) -> bool {
        matches!(self.data, RowData::Device(..))
    }

    /// The rows on the host (a device row is downloaded: the same bytes the forward wrote).
    pub fn into_host(self) -> Result<ForwardOutput, CudaError> {
        match self.data {
            RowData::Host(logits) => Ok(ForwardOutput { rows: self.rows, logits, vocab_size: self.model.cfg.vocab_size }),
            RowData::Device(ref src, par) => {
                let logits = self.download(src, par)?;
                Ok(ForwardOutput { rows: self.rows, logits, vocab_size: self.model.cfg.vocab_size })
            }
        }
    }

    /// A host copy of the rows (fallback when the device reduction fails).
    pub fn to_host(&self) -> Result<ForwardOutput, CudaError> {
        let v = self.model.cfg.vocab_size;
        let logits = match &self.data {
            RowData::Host(l) => l.clone(),
            RowData::Device(src, par) => self.download(src, *par)?,
        };
        Ok(ForwardOutput { rows: self.rows.clone(), logits, vocab_size: v })
    }

    fn download(&self, src: &[usize], par: usize) -> Result<Vec<f32>, CudaError> {
        let (g, v) = (&self.model.gpu, self.model.cfg.vocab_size);
        let ws = self.model.fast.as_ref().ok_or_else(|| CudaError::Shape("device logits rows without a fast workspace".into()))?;
        let mut logits = vec![0f32; src.len() * v];
        for (r, &i) in src.iter().enumerate() {
            let row = ws.logits[par].slice(i * v..(i + 1) * v);
            g.stream.memcpy_dtoh(&row, &mut logits[r * v..(r + 1) * v])?;
        }
        g.sync()?;
        Ok(logits)
    }

    /// Overlapped decode: enqueues [`StepLogits::reduce`]'s kernels and read-back for rows left
    /// on the device, each row's draw also written where the next step's embedding reads
    /// device-fed tokens ([`CudaModel::set_device_feed`]; a row's pick index is
    /// [`PendingReduce::pick_index`]): drawn with `draws[row]`, the gateway's uniform number,
    /// where given (see [`RowJob::draw`]), else the first candidate. Nothing is waited for;
    /// [`CudaModel::collect_reduce`] finishes it, with the same jobs. None: the rows are not
    /// on the device, or there are none.
    pub fn enqueue_reduce(&self, jobs: &[(SamplingSpec, Option<u32>)], draws: &[Option<f64>]) -> Result<Option<PendingReduce>, CudaError> {
        let (g, v) = (&self.model.gpu, self.model.cfg.vocab_size);
        let RowData::Device(src, par) = &self.data else { return Ok(None) };
        if jobs.len() != self.rows.len() || draws.len() != jobs.len() {
            return Err(CudaError::Shape(format!("sampling: {} rows, {} specs, {} draws", self.rows.len(), jobs.len(), draws.len())));
        }
        let Some(ws) = self.model.fast.as_ref().filter(|_| !jobs.is_empty() && jobs.len() <= super::MAX_FAST_TOKENS) else { return Ok(None) };
        let picks = Some((g.ptr(&ws.picks), super::MAX_FAST_TOKENS));
        let e = with_sampler(g, v, |s| s.enqueue(g, g.ptr(&ws.logits[*par]), v, &device_jobs(jobs, src, draws), picks))?;
        Ok(Some(PendingReduce { e, src: src.clone() }))
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
            RowData::Device(src, par) => {
                let ws = self.model.fast.as_ref().ok_or_else(|| CudaError::Shape("device logits rows without a fast workspace".into()))?;
                with_sampler(g, v, |s| s.reduce(g, g.ptr(&ws.logits[*par]), v, &device_jobs(jobs, src, &[])))
            }
            RowData::Host(logits) => {
                if logits.len() != jobs.len() * v {
                    return Err(CudaError::Shape(format!("sampling: {} logits for {} rows", logits.len(), jobs.len())));
                }
                let up = g.upload(logits)?;
                let rj: Vec<RowJob> = jobs
                    .iter()
                    .enumerate()
                    .map(|(ri, (spec, target))| RowJob { src_row: ri, spec, target: *target, host_row: Some(&logits[ri * v..(ri + 1) * v]), draw: None })
                    .collect();
                with_sampler(g, v, |s| s.reduce(g, g.ptr(&up), v, &rj))
            }
        }
    }
}

/// Jobs for rows in the fast workspace's logits buffer: `jobs[r]` reads row `src[r]`.
/// `draws`: per job, the uniform number of a draw the merge makes itself (empty: none).
fn device_jobs<'a>(jobs: &'a [(SamplingSpec, Option<u32>)], src: &[usize], draws: &[Option<f64>]) -> Vec<RowJob<'a>> {
    jobs.iter()
        .zip(src)
        .enumerate()
        .map(|(i, ((spec, target), &src_row))| RowJob { src_row, spec, target: *target, host_row: None, draw: draws.get(i).copied().flatten() })
        .collect()
}

/// A step's reduction enqueued by [`StepLogits::enqueue_reduce`] (holds no borrow of the model:
/// the next step may be launched before it is collected).
pub struct PendingReduce {
    e: Enqueued,
    src: Vec<usize>,
}

impl PendingReduce {
    /// Waits (spinning, without any lock) until the read-back is on the host.
    pub fn wait(&self) -> Result<(), CudaError> {
        self.e.wait()
    }

    /// Where the merge writes row `job`'s draw (the index a device-fed token of the next step
    /// names), if the row is reduced on the device and the index fits.
    pub fn pick_index(&self, job: usize) -> Option<usize> {
        self.e.pick_off?;
        self.e.dev.iter().position(|&i| i == job).filter(|&d| d < super::MAX_FAST_TOKENS)
    }
}

impl CudaModel {
    /// Waits for a reduction [`StepLogits::enqueue_reduce`] enqueued and finishes its rows (the
    /// same `jobs`); also returns each row's draw as the device computed it (what a device-fed
    /// token of the next step was).
    pub fn collect_reduce(&self, p: PendingReduce, jobs: &[(SamplingSpec, Option<u32>)]) -> Result<Collected, CudaError> {
        let (g, v) = (&self.gpu, self.cfg.vocab_size);
        with_sampler(g, v, |s| s.collect(g, p.e, &device_jobs(jobs, &p.src, &[])))
    }

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
                .map(|(ri, (spec, target))| RowJob { src_row: src(ri), spec, target: *target, host_row: Some(out.row(ri)), draw: None })
                .collect()
        };
        if on_device {
            let ws = self.fast.as_ref().expect("fast path on");
            let src = |ri: usize| {
                let r = &out.rows[ri];
                starts[r.seq] + (r.position - batch.seqs[r.seq].cached_len)
            };
            with_sampler(g, v, |s| s.reduce(g, g.ptr(&ws.logits[ws.par]), v, &mk(&src)))
        } else {
            let up = g.upload(&out.logits)?;
            with_sampler(g, v, |s| s.reduce(g, g.ptr(&up), v, &mk(&|ri| ri)))
        }
    }
}
