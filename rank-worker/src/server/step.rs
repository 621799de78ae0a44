//! Executing one `Step` on this rank: the handshake check, the cross-rank agreement on which
//! sequences run, the forward pass and (on the head rank) the row reductions for sampling.

use std::time::Instant;

use minimax_proto::v1 as pb;
use minimax_shared::forward::{ForwardBatch, ForwardOutput, LogitsRow, LogitsWanted, SeqStep};
use minimax_shared::sampling;

use super::{Engine, StepError};
use crate::comm::Collective;
use crate::state::{Agreement, SeqTable, StepRecord, Verdict, agree};
use crate::transport::TestTransport;

fn logits_wanted(mode: i32) -> LogitsWanted {
    match pb::LogitsMode::try_from(mode) {
        Ok(pb::LogitsMode::Last) => LogitsWanted::Last,
        Ok(pb::LogitsMode::All) => LogitsWanted::All,
        _ => LogitsWanted::None,
    }
}

/// A step after the agreement: the batch every rank computes and the answers so far.
pub(super) struct Agreed {
    t0: Instant,
    batch: ForwardBatch,
    /// Index in the request of each batch entry.
    batch_src: Vec<usize>,
    results: Vec<pb::SeqResult>,
}

impl Agreed {
    /// Whether the agreement left anything to compute.
    pub(super) fn is_empty(&self) -> bool {
        self.batch.seqs.is_empty()
    }
}

/// Overlapped decode, before the agreement: a `feed_drawn` sequence feeds one token, which
/// this rank may not have drawn yet (the step it follows may still be computing). It stands in
/// as a placeholder so the handshake and the validation see one token; [`fill_fed`] puts the
/// drawn token in before the forward. Returns the request indices of those sequences (pass
/// them to [`agree_step`]). A `feed_drawn` sequence that also lists tokens is left as is and
/// refused at the agreement.
pub(super) fn placeholder_fed(req: &mut pb::StepRequest) -> Vec<usize> {
    let mut fed = Vec::new();
    for (i, s) in req.seqs.iter_mut().enumerate() {
        if s.feed_drawn && s.tokens.is_empty() {
            s.tokens.push(0);
            fed.push(i);
        }
    }
    fed
}

/// Overlapped decode, after the step it follows computed here: each `fed` sequence feeds the
/// token this rank drew for it, which also joins its penalties' history. A sequence with no
/// drawn token (its previous step failed, or it asked for no draw) leaves the batch with an
/// error and is forgotten here (pipelined steps advanced its length at the agreement).
pub(super) fn fill_fed(req: &mut pb::StepRequest, agreed: &mut Agreed, seqs: &mut SeqTable, fed: &[usize]) {
    for &i in fed {
        let Some(bi) = agreed.batch_src.iter().position(|&j| j == i) else { continue };
        let s = &mut req.seqs[i];
        match seqs.take_draw(s.seq_id) {
            Some(token) => {
                s.tokens = vec![token];
                agreed.batch.seqs[bi].tokens = vec![token];
                if let Some(sp) = s.sampling.as_mut() {
                    pb::count_in_history(sp, token);
                }
            }
            None => {
                agreed.batch.seqs.remove(bi);
                agreed.batch_src.remove(bi);
                seqs.forget(s.seq_id);
                let r = &mut agreed.results[i];
                r.error = format!("sequence {} feeds a drawn token, but this rank drew none for it in the step before", s.seq_id);
                r.cache_len = 0;
            }
        }
    }
}

/// Remembers the tokens this step drew, for the `feed_drawn` steps that follow.
pub(super) fn record_draws(seqs: &mut SeqTable, resp: &pb::StepResponse) {
    for r in &resp.seqs {
        if let Some(t) = r.rows.last().and_then(|row| row.drawn_token) {
            seqs.set_draw(r.seq_id, t);
        }
    }
}

/// Steps 1-3 of a step: local verdicts, the agreement over `world` (an all-gather of one small
/// record; absent or of size 1: this rank alone decides) and the drops. `validate` checks a
/// batch against this rank's cache geometry (`(page_size, n_pages)`). Mismatched sequences are
/// forgotten in `seqs`; nothing else changes.
pub(super) fn agree_step(
    seqs: &mut SeqTable,
    validate: &dyn Fn(&ForwardBatch) -> Result<(), String>,
    world: Option<&TestTransport>,
    rank: u32,
    (page_size, n_pages): (u32, u32),
    req: &pb::StepRequest,
    fed: &[usize],
) -> Result<Agreed, StepError> {
    let t0 = Instant::now();
    // 1. Local verdicts.
    let mut verdicts = Vec::with_capacity(req.seqs.len());
    for (i, s) in req.seqs.iter().enumerate() {
        let mut v = seqs.check(s.seq_id, s.expected_cache_len, s.adopt_prefix);
        // Only the head draws: in a world of several ranks the others could not feed the token
        // (every rank sees the same request, so all refuse it alike).
        if v == Verdict::Ok && s.feed_drawn && world.is_some_and(|w| w.world() > 1) {
            v = Verdict::Invalid(format!("sequence {}: feed_drawn needs a world of one rank", s.seq_id));
        }
        if v == Verdict::Ok && s.feed_drawn && !fed.contains(&i) {
            v = Verdict::Invalid(format!("sequence {}: feed_drawn feeds one drawn token; tokens must be empty", s.seq_id));
        }
        if v == Verdict::Ok {
            let one = ForwardBatch { seqs: vec![to_seq_step(s)] };
            if let Err(e) = validate(&one) {
                v = Verdict::Invalid(e);
            }
        }
        verdicts.push(v);
    }
    let mut ids = std::collections::HashSet::new();
    if let Some(dup) = req.seqs.iter().find(|s| !ids.insert(s.seq_id)) {
        return Err(StepError::Invalid(format!("sequence {} appears twice in step {}", dup.seq_id, req.step_id)));
    }
    // 2. Agreement: every rank shares its verdicts; all derive the same decision.
    let own_lens: Vec<u32> = req.seqs.iter().map(|s| seqs.len(s.seq_id)).collect();
    let rec_in: Vec<(u64, &Verdict, u32)> = req.seqs.iter().zip(&verdicts).zip(&own_lens).map(|((s, v), &l)| (s.seq_id, v, l)).collect();
    let mine = StepRecord::new(req.step_id, page_size, n_pages, &rec_in);
    let records = match world {
        Some(w) if w.world() > 1 => {
            let all = w.all_gather(&mine.encode()).map_err(StepError::Comm)?;
            all.iter()
                .enumerate()
                .map(|(r, b)| StepRecord::decode(b).ok_or_else(|| StepError::Diverged(format!("rank {r} sent a corrupt step record"))))
                .collect::<Result<Vec<_>, _>>()?
        }
        _ => vec![mine],
    };
    let expected: Vec<u32> = req.seqs.iter().map(|s| s.expected_cache_len).collect();
    let local_invalid: Vec<Option<String>> = verdicts.iter().map(|v| if let Verdict::Invalid(e) = v { Some(e.clone()) } else { None }).collect();
    let decision = match agree(&records, &expected, &local_invalid) {
        Agreement::Diverged(why) => return Err(StepError::Diverged(why)),
        Agreement::Seqs(d) => d,
    };
    // 3. Drop what was not agreed; mismatched sequences are forgotten on every rank.
    let mut results: Vec<pb::SeqResult> = Vec::with_capacity(req.seqs.len());
    let mut batch = ForwardBatch::default();
    let mut batch_src = Vec::new();
    for (i, (s, d)) in req.seqs.iter().zip(&decision).enumerate() {
        let mut r = pb::SeqResult { seq_id: s.seq_id, cache_len: own_lens[i], ..Default::default() };
        match d {
            Some(dropped) => {
                r.error = dropped.message.clone();
                if dropped.length_mismatch {
                    tracing::warn!(seq_id = s.seq_id, rank, "{}", dropped.message);
                    seqs.forget(s.seq_id);
                }
            }
            None => {
                batch.seqs.push(to_seq_step(s));
                batch_src.push(i);
            }
        }
        results.push(r);
    }
    // Deterministic on every rank (same batch, same cache geometry): all fail together.
    if !batch.seqs.is_empty()
        && let Err(e) = validate(&batch)
    {
        return Err(StepError::Invalid(e));
    }
    Ok(Agreed { t0, batch, batch_src, results })
}

/// Records the agreed batch's new cache lengths in `seqs` (after the forward, or at the
/// agreement for pipelined steps) and in the answers.
pub(super) fn advance(seqs: &mut SeqTable, req: &pb::StepRequest, agreed: &mut Agreed) {
    for (bi, &i) in agreed.batch_src.iter().enumerate() {
        let s = &req.seqs[i];
        seqs.advance(s.seq_id, s.expected_cache_len, s.tokens.len() as u32, bi == 0);
        agreed.results[i].cache_len = seqs.len(s.seq_id);
    }
    if !agreed.batch.seqs.is_empty() {
        seqs.step_done();
    }
}

impl Engine {
    /// Runs one step (blocking; the caller holds the engine and the sequence table). Tensor
    /// worlds of several ranks (every other world runs `pipelined_step`), which refuse
    /// `feed_drawn`, so no drawn token is fed or kept here.
    pub fn step(&mut self, seqs: &mut SeqTable, req: &pb::StepRequest) -> Result<pb::StepResponse, StepError> {
        let geometry = (self.kv.page_size as u32, self.kv.n_pages as u32);
        let backend = &self.backend;
        let world = self.world.as_ref().map(|w| &*w.transport);
        let mut agreed = agree_step(seqs, &|b| backend.validate(b), world, self.rank, geometry, req, &[])?;
        let t_agreed = agreed.t0.elapsed();
        let tokens = agreed.batch.n_tokens();
        let out = forward_agreed(&mut self.backend, &self.part, self.parallelism, world, self.head, &agreed)?;
        let t_forward = agreed.t0.elapsed();
        advance(seqs, req, &mut agreed);
        let r = answer(self.rank, self.head, &mut self.replay, req, agreed, out);
        if let Ok(a) = &r {
            let ms = |d: std::time::Duration| d.as_secs_f64() * 1e3;
            tracing::debug!(target: "minimax::step", step = req.step_id, tokens, agree_ms = ms(t_agreed), forward_ms = ms(t_forward - t_agreed), answer_ms = a.compute_ms as f64 - ms(t_forward), "step");
        }
        r
    }

    /// Computes an agreed step whose cache lengths were already advanced (pipelined steps).
    /// Its `compute_ms` counts from here: the wait for the steps before it is not compute.
    pub(super) fn compute(&mut self, req: &pb::StepRequest, mut agreed: Agreed) -> Result<pb::StepResponse, StepError> {
        agreed.t0 = Instant::now();
        let world = self.world.as_ref().map(|w| &*w.transport);
        let tokens = agreed.batch.n_tokens();
        let out = forward_agreed(&mut self.backend, &self.part, self.parallelism, world, self.head, &agreed)?;
        let t_forward = agreed.t0.elapsed();
        let r = answer(self.rank, self.head, &mut self.replay, req, agreed, out);
        if let Ok(a) = &r {
            let ms = |d: std::time::Duration| d.as_secs_f64() * 1e3;
            tracing::debug!(target: "minimax::step", step = req.step_id, tokens, forward_ms = ms(t_forward), answer_ms = a.compute_ms as f64 - ms(t_forward), "step");
        }
        r
    }
}

/// The answer to a step whose agreement left nothing to compute.
pub(super) fn unanswered(rank: u32, req: &pb::StepRequest, agreed: Agreed) -> pb::StepResponse {
    pb::StepResponse { rank, step_id: req.step_id, seqs: agreed.results, compute_ms: agreed.t0.elapsed().as_secs_f32() * 1e3 }
}

/// Step 4: the forward of the agreed batch (nothing when it is empty).
fn forward_agreed<'m>(
    backend: &'m mut crate::backend::Backend,
    part: &crate::partition::Partition,
    par: crate::backend::Parallelism,
    world: Option<&TestTransport>,
    head: bool,
    agreed: &Agreed,
) -> Result<Option<StepOut<'m>>, StepError> {
    if agreed.batch.seqs.is_empty() {
        return Ok(None);
    }
    die_if_asked();
    forward(backend, &agreed.batch, part, par, world, head).map_err(|e| {
        if e.is_comm() { StepError::Comm(crate::comm::CommError { op: "step", detail: e.to_string() }) } else { StepError::Backend(e.to_string()) }
    })
}

/// Step 5: the answer, with the head rank's row reductions.
fn answer(rank: u32, head: bool, replay: &mut Option<crate::replay::Replay>, req: &pb::StepRequest, agreed: Agreed, out: Option<StepOut<'_>>) -> Result<pb::StepResponse, StepError> {
    let Agreed { t0, batch, batch_src, mut results } = agreed;
    if let Some(r) = replay.as_mut() {
        for &i in &batch_src {
            let s = &req.seqs[i];
            r.observe(s.seq_id, &s.page_table, s.expected_cache_len, &s.tokens);
        }
    }
    // 5. Row reductions, head rank only.
    if head
        && let Some(out) = out
    {
        // Every row's spec and target, then one reduction call (on the GPU for CUDA).
        let mut row_in_seq = vec![0usize; batch.seqs.len()];
        let jobs: Vec<(sampling::SamplingSpec, Option<u32>)> = out
            .rows()
            .iter()
            .map(|row| {
                let s = &req.seqs[batch_src[row.seq]];
                let k = row_in_seq[row.seq];
                row_in_seq[row.seq] += 1;
                (pb::sampling_spec(s.sampling.as_ref()), s.score_targets.get(k).copied())
            })
            .collect();
        let mut reds = reduce_rows(&out, &jobs)?.into_iter();
        for (ri, row) in out.rows().iter().enumerate() {
            let i = batch_src[row.seq];
            let s = &req.seqs[i];
            let spec = &jobs[ri].0;
            let red = reds
                .next()
                .expect("one reduction per row")
                .map_err(|e| StepError::Invalid(format!("sequence {}: sampling: {e}", s.seq_id)))?;
            results[i].rows.push(pb::row_output(row.position as u32, red));
            // TEST ONLY (--test-replay): one candidate, the scripted token.
            if s.logits == pb::LogitsMode::Last as i32
                && let Some(f) = replay.as_mut().and_then(|r| r.forced(s.seq_id, &s.page_table, row.position as u32))
            {
                let ro = results[i].rows.last_mut().expect("just pushed");
                ro.candidate_ids = vec![f.token];
                ro.candidate_logits = vec![0.0];
                ro.candidate_raw_logits = vec![0.0];
                ro.raw_logsumexp = 0.0;
                ro.top_ids = vec![f.token];
                ro.top_logprobs = vec![0.0];
                ro.top_ids.truncate(spec.top_logprobs as usize);
                ro.top_logprobs.truncate(spec.top_logprobs as usize);
            }
            // The draw with the gateway's uniform number (the last row: the one it samples).
            if s.logits == pb::LogitsMode::Last as i32
                && let Some(u) = s.sampling.as_ref().and_then(|sp| sp.draw)
            {
                // A row that cannot be drawn (e.g. infinite logits from a tiny temperature) gets
                // no token: the gateway's own draw fails that request alone, and a step feeding
                // it finds none ("drew none").
                if let Err(e) = pb::draw_row(results[i].rows.last_mut().expect("just pushed"), spec.temperature, u) {
                    tracing::warn!(seq_id = s.seq_id, "no token drawn: {e}");
                }
            }
        }
    }
    Ok(pb::StepResponse { rank, step_id: req.step_id, seqs: results, compute_ms: t0.elapsed().as_secs_f32() * 1e3 })
}

/// TEST ONLY: `MINIMAX_TEST_DIE_IN_STEP=N` (with `MINIMAX_ALLOW_TEST_HOOKS=1`) makes this rank
/// SIGKILL itself in its N-th computing step, after the agreement and before the forward,
/// so its peers are certain to be waiting inside a collective when it dies (the recovery
/// tests of NCCL worlds).
fn die_if_asked() {
    use std::sync::OnceLock;
    use std::sync::atomic::{AtomicU64, Ordering};
    static AT: OnceLock<Option<u64>> = OnceLock::new();
    static SEEN: AtomicU64 = AtomicU64::new(0);
    let at = AT.get_or_init(|| {
        let n = std::env::var("MINIMAX_TEST_DIE_IN_STEP").ok()?.parse().ok()?;
        if std::env::var("MINIMAX_ALLOW_TEST_HOOKS").as_deref() != Ok("1") {
            tracing::warn!("MINIMAX_TEST_DIE_IN_STEP ignored without MINIMAX_ALLOW_TEST_HOOKS=1");
            return None;
        }
        let msg = format!("!!! TEST HOOK: this rank kills itself in computing step {n}. Never use in production. !!!");
        tracing::warn!("{msg}");
        eprintln!("{msg}");
        Some(n)
    });
    if let Some(n) = *at
        && SEEN.fetch_add(1, Ordering::Relaxed) + 1 == n
    {
        eprintln!("TEST HOOK: SIGKILL in step {n}");
        // SAFETY: plain signal to this process.
        unsafe { libc::kill(libc::getpid(), libc::SIGKILL) };
    }
}

/// A step's logits rows: on the host, or (CUDA) possibly still on the device.
enum StepOut<'m> {
    Host(ForwardOutput),
    #[cfg(feature = "cuda")]
    Cuda(crate::cuda::sampling::StepLogits<'m>),
    #[cfg(not(feature = "cuda"))]
    #[allow(dead_code)]
    Never(std::convert::Infallible, std::marker::PhantomData<&'m ()>),
}

impl StepOut<'_> {
    fn rows(&self) -> &[LogitsRow] {
        match self {
            StepOut::Host(o) => &o.rows,
            #[cfg(feature = "cuda")]
            StepOut::Cuda(l) => l.rows(),
            #[cfg(not(feature = "cuda"))]
            StepOut::Never(n, _) => match *n {},
        }
    }
}

/// The forward of one step. On CUDA the fast path leaves the logits on the device when this
/// rank reduces them there (head rank, device sampling on) or never reads them (other ranks).
fn forward<'m>(
    backend: &'m mut crate::backend::Backend,
    batch: &ForwardBatch,
    part: &crate::partition::Partition,
    par: crate::backend::Parallelism,
    world: Option<&crate::transport::TestTransport>,
    head: bool,
) -> Result<Option<StepOut<'m>>, crate::backend::BackendError> {
    #[cfg(feature = "cuda")]
    let lazy = !head || device_sampling_on();
    #[cfg(not(feature = "cuda"))]
    let lazy = {
        let _ = head;
        false
    };
    match (backend, lazy) {
        #[cfg(feature = "cuda")]
        (crate::backend::Backend::Cuda(m), true) => Ok(m.forward_stage_lazy(batch)?.map(StepOut::Cuda)),
        (b, _) => Ok(b.step(batch, part, par, world)?.map(StepOut::Host)),
    }
}

/// The sampling reductions of a step's logits rows, in row order: on the GPU for the CUDA
/// backend (`StepLogits::reduce`, the same results as `reduce_row`; rows it cannot decide are
/// reduced on the host, downloaded one by one) unless `MINIMAX_DEVICE_SAMPLING=0`, else on
/// the host (also if the device reduction fails: the rows are then downloaded).
fn reduce_rows(out: &StepOut, jobs: &[(sampling::SamplingSpec, Option<u32>)]) -> Result<Vec<Result<sampling::RowReduction, sampling::SamplingError>>, StepError> {
    let host = |o: &ForwardOutput| jobs.iter().enumerate().map(|(ri, (spec, target))| sampling::reduce_row(o.row(ri), spec, *target)).collect();
    match out {
        StepOut::Host(o) => Ok(host(o)),
        #[cfg(feature = "cuda")]
        StepOut::Cuda(l) => {
            if device_sampling_on() {
                match l.reduce(jobs) {
                    Ok((reds, _)) => return Ok(reds),
                    Err(e) => tracing::warn!("device sampling failed, reducing on the host: {e}"),
                }
            }
            let o = l.to_host().map_err(|e| StepError::Backend(format!("logits download: {e}")))?;
            Ok(host(&o))
        }
        #[cfg(not(feature = "cuda"))]
        StepOut::Never(n, _) => match *n {},
    }
}

/// Device sampling for the CUDA backend: on unless `MINIMAX_DEVICE_SAMPLING=0`, read once.
#[cfg(feature = "cuda")]
fn device_sampling_on() -> bool {
    static ON: crate::cuda::env_flag::EnvFlag = crate::cuda::env_flag::EnvFlag::new("MINIMAX_DEVICE_SAMPLING", true);
    ON.get()
}

fn to_seq_step(s: &pb::SeqStep) -> SeqStep {
    SeqStep {
        seq_id: s.seq_id,
        page_table: s.page_table.clone(),
        cached_len: s.expected_cache_len as usize,
        tokens: s.tokens.clone(),
        logits: logits_wanted(s.logits),
    }
}
