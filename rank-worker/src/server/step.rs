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
    /// The sequences of the agreed rows of `req` whose rule follows (late rules).
    pub(super) fn rows_waiting(&self, req: &pb::StepRequest) -> Vec<u64> {
        super::late_rules::rows_waiting(req, &self.batch_src)
    }

    /// Whether the agreement left anything to compute.
    pub(super) fn is_empty(&self) -> bool {
        self.batch.seqs.is_empty()
    }

    /// Tokens the step computes.
    pub(super) fn n_tokens(&self) -> usize {
        self.batch.n_tokens()
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

/// A `feed_drawn` sequence fed the draw the step before left on the device.
#[derive(Clone, Copy, Debug)]
pub(super) struct DeviceFed {
    /// Its index in the agreed batch.
    pub bi: usize,
    /// The sequence (its fed-check is looked up by it).
    pub seq_id: u64,
    /// The device pick it reads.
    #[cfg_attr(not(feature = "cuda"), allow(dead_code))]
    pub pick: usize,
    /// The compute ticket of the step whose pick it reads.
    pub from: u64,
}

/// Overlapped decode, before the forward of the step with compute ticket `ticket`: each `fed`
/// sequence feeds the token this rank drew for it, which also joins its penalties' history,
/// or (`device`: this step can read it there) the draw the step launched just before
/// left on the device. A sequence with no drawn token (its previous step failed, or it asked
/// for no draw) leaves the batch with an error and is forgotten here (pipelined steps advanced
/// its length at the agreement). `Err(n)`: a token is not known yet; nothing was changed:
/// wait until every step below ticket `n` was read back (`Pipe::wait_finished`) and call again.
pub(super) fn fill_fed(req: &mut pb::StepRequest, agreed: &mut Agreed, seqs: &mut SeqTable, fed: &[usize], ticket: u64, device: bool) -> Result<Vec<DeviceFed>, u64> {
    use crate::state::Feed;
    for &i in fed {
        if agreed.batch_src.contains(&i)
            && let Feed::Wait(t) = seqs.feed(req.seqs[i].seq_id, ticket, device)
        {
            return Err(t + 1);
        }
    }
    let mut dev = Vec::new();
    for &i in fed {
        let Some(bi) = agreed.batch_src.iter().position(|&j| j == i) else { continue };
        let s = &mut req.seqs[i];
        match seqs.feed(s.seq_id, ticket, device) {
            Feed::Token(token) => {
                seqs.drop_draw(s.seq_id);
                s.tokens = vec![token];
                agreed.batch.seqs[bi].tokens = vec![token];
                if let Some(sp) = s.sampling.as_mut() {
                    pb::count_in_history(sp, token);
                }
            }
            Feed::Device { ticket: from, pick } => {
                // The placeholder token stays on the host; the embedding reads the pick. The
                // row's sampling does not depend on the token (`feeds_on_device`).
                seqs.drop_draw(s.seq_id);
                dev.push(DeviceFed { bi, seq_id: s.seq_id, pick, from });
            }
            Feed::Wait(_) => unreachable!("checked above"),
            Feed::None => {
                agreed.batch.seqs.remove(bi);
                agreed.batch_src.remove(bi);
                dev.iter_mut().filter(|d| d.bi > bi).for_each(|d| d.bi -= 1);
                seqs.forget(s.seq_id);
                let r = &mut agreed.results[i];
                r.error = format!("sequence {} feeds a drawn token, but this rank drew none for it in the step before", s.seq_id);
                r.cache_len = 0;
            }
        }
    }
    Ok(dev)
}

/// Whether a row's drawn token can be fed to the next step on the device: the device draws
/// what the host draws (greedy, or a candidate set the device holds whole:
/// `RowPlan::whole_set`, e.g. top_k 40) and the row's sampling in the next step does not
/// depend on the token (no repetition, frequency or presence penalty: those count the token,
/// which the host learns only when the step is read back). A structured output's row may
/// feed: the gateway sends its next row's rule after it has seen the token (late rules).
/// `sampled`: sampled rows
/// (temperature > 0) too (`MINIMAX_DEVICE_DRAW`), else greedy rows only.
#[cfg(feature = "cuda")]
pub(super) fn feeds_on_device(spec: &sampling::SamplingSpec, target: Option<u32>, vocab: usize, sampled: bool) -> bool {
    let drawn_there = spec.temperature == 0.0 || sampled;
    drawn_there
        && spec.repetition_penalty == 1.0
        && spec.frequency_penalty == 0.0
        && spec.presence_penalty == 0.0
        && {
            let plan = sampling::partial::plan(spec, target, vocab, crate::cuda::sampling::MAX_CANDIDATES);
            !plan.full_row && plan.whole_set
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

/// After the step it followed was read back: a device-fed sequence whose pick was not the
/// token drawn (never expected: the device draws as the host does) fails here and is forgotten.
pub(super) fn check_device_fed(seqs: &mut SeqTable, resp: &mut pb::StepResponse, fed: &[DeviceFed]) {
    for f in fed {
        // A sequence released meanwhile (it ended in the step before) has no check left.
        if seqs.take_fed_check(f.seq_id, f.from) || !seqs.knows(f.seq_id) {
            continue;
        }
        tracing::error!(seq_id = f.seq_id, "the token fed on the device was not the token drawn");
        seqs.forget(f.seq_id);
        if let Some(r) = resp.seqs.iter_mut().find(|r| r.seq_id == f.seq_id) {
            r.rows.clear();
            r.cache_len = 0;
            r.error = format!("sequence {}: the token fed on the device was not the token drawn in the step before (its logits were not finite, or an internal error)", f.seq_id);
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
        if v == Verdict::Ok && s.sampling.as_ref().is_some_and(|sp| sp.rule_follows) && world.is_some_and(|w| w.world() > 1) {
            v = Verdict::Invalid(format!("sequence {}: rule_follows needs a world of one rank", s.seq_id));
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

    /// Whether a step of `nt` tokens can read device-fed tokens ([`fill_fed`]): this rank is
    /// the whole model on CUDA (a world of one), reduces on the device, and the step takes
    /// the fast path.
    pub(super) fn device_feed_ok(&self, nt: usize) -> bool {
        #[cfg(feature = "cuda")]
        if let crate::backend::Backend::Cuda(m) = &self.backend {
            return device_feed_on() && self.head && self.world.as_ref().is_none_or(|w| w.transport.world() == 1) && self.replay.is_none() && device_sampling_on() && m.fast_eligible(nt);
        }
        let _ = nt;
        false
    }

    /// Overlapped decode, one-rank worlds: starts an agreed step (lengths already advanced)
    /// with compute ticket `ticket`. With `device` ([`Engine::device_feed_ok`] for this step, as
    /// [`fill_fed`] was told) a CUDA fast step is only enqueued: its forward, its row
    /// reductions and their read-back, so the next step can be enqueued behind it before its
    /// answer is read ([`Engine::finish`]); `fed` are its device-fed tokens. Every other step
    /// is computed and answered here.
    pub(super) fn launch(&mut self, req: &pb::StepRequest, agreed: Agreed, ticket: u64, device: bool, fed: &[DeviceFed]) -> Launched {
        #[cfg(feature = "cuda")]
        if device {
            let mut agreed = agreed;
            agreed.t0 = Instant::now();
            let crate::backend::Backend::Cuda(m) = &mut self.backend else { unreachable!("device_feed_ok: CUDA only") };
            let vocab = m.config().vocab_size;
            if !fed.is_empty() {
                static FIRST: std::sync::Once = std::sync::Once::new();
                FIRST.call_once(|| tracing::info!(tokens = fed.len(), "overlapped decode: a step launched before the one it follows was read back (device-fed tokens)"));
                let sampled = |f: &DeviceFed| req.seqs[agreed.batch_src[f.bi]].sampling.as_ref().is_some_and(|sp| sp.temperature > 0.0);
                if fed.iter().any(sampled) {
                    static SAMPLED: std::sync::Once = std::sync::Once::new();
                    SAMPLED.call_once(|| tracing::info!("overlapped decode: a sampled token drawn on the device fed the next step (device-drawn tokens)"));
                }
            }
            m.set_device_feed(fed.iter().map(|f| (f.bi, f.pick)).collect());
            let out = match m.forward_stage_lazy(&agreed.batch) {
                Ok(o) => o,
                Err(e) => return Launched::Done(Err(StepError::Backend(e.to_string()))),
            };
            let Some(out) = out else { return Launched::Done(Err(StepError::Backend("the head rank's forward returned no logits".into()))) };
            // Rows whose rule follows: the forward runs meanwhile; the reduction waits.
            let waiting = agreed.rows_waiting(req);
            if !waiting.is_empty() {
                static FIRST: std::sync::Once = std::sync::Once::new();
                FIRST.call_once(|| tracing::info!(rows = waiting.len(), "late rules: a step's forward launched before its rows' rules arrived (forward first)"));
                return Launched::Rules(Box::new(AwaitRules { agreed, logits: Awaiting::Device(out.detach()), ticket, waiting }));
            }
            return enqueue_reduce(self.rank, self.head, &mut self.replay, req, agreed, out, ticket, vocab);
        }
        let _ = (ticket, device, fed);
        // Rows whose rule follows, on a host forward (the CPU backend): the forward now, the
        // answer once the rules are in ([`Engine::resume`]).
        let waiting = agreed.rows_waiting(req);
        if !waiting.is_empty() {
            static FIRST: std::sync::Once = std::sync::Once::new();
            FIRST.call_once(|| tracing::info!(rows = waiting.len(), "late rules: a step's forward ran before its rows' rules arrived (forward first, host)"));
            let mut agreed = agreed;
            agreed.t0 = Instant::now();
            let world = self.world.as_ref().map(|w| &*w.transport);
            return match forward_agreed(&mut self.backend, &self.part, self.parallelism, world, self.head, &agreed) {
                Ok(None) => Launched::Rules(Box::new(AwaitRules { agreed, logits: Awaiting::Nothing, ticket, waiting })),
                Ok(Some(StepOut::Host(o))) => Launched::Rules(Box::new(AwaitRules { agreed, logits: Awaiting::Host(o), ticket, waiting })),
                #[cfg(feature = "cuda")]
                Ok(Some(StepOut::Cuda(l))) => Launched::Rules(Box::new(AwaitRules { agreed, logits: Awaiting::Lazy(l.detach()), ticket, waiting })),
                #[cfg(not(feature = "cuda"))]
                Ok(Some(StepOut::Never(n, _))) => match n {},
                Err(e) => Launched::Done(Err(e)),
            };
        }
        Launched::Done(self.compute(req, agreed))
    }

    /// Whether this rank takes a step's late rules in before its forward: a CUDA rank with
    /// `MINIMAX_LATE_FORWARD=0`, which says so (`DescribeResponse.late_forward`) and so gets
    /// no such rows from the gateway; every other rank runs the forward first.
    pub(super) fn rules_before_forward(&self) -> bool {
        #[cfg(feature = "cuda")]
        let cuda = matches!(self.backend, crate::backend::Backend::Cuda(_));
        #[cfg(not(feature = "cuda"))]
        let cuda = false;
        !super::late_rules::late_forward(cuda)
    }

    /// Continues a step [`Engine::launch`] left waiting for rules, once they are in `req`.
    pub(super) fn resume(&mut self, req: &pb::StepRequest, w: AwaitRules) -> Launched {
        let AwaitRules { agreed, logits, ticket, .. } = w;
        let _ = ticket;
        let out = match logits {
            Awaiting::Nothing => None,
            Awaiting::Host(o) => Some(StepOut::Host(o)),
            #[cfg(feature = "cuda")]
            Awaiting::Lazy(l) => {
                let crate::backend::Backend::Cuda(m) = &self.backend else { unreachable!("device logits come from a CUDA model") };
                Some(StepOut::Cuda(l.attach(m)))
            }
            #[cfg(feature = "cuda")]
            Awaiting::Device(l) => {
                let crate::backend::Backend::Cuda(m) = &self.backend else { unreachable!("device logits come from a CUDA model") };
                let vocab = m.config().vocab_size;
                return enqueue_reduce(self.rank, self.head, &mut self.replay, req, agreed, l.attach(m), ticket, vocab);
            }
        };
        Launched::Done(answer(self.rank, self.head, &mut self.replay, req, agreed, out))
    }

    /// Reads back a step [`Engine::launch`] left pending and answers it; records its draws in
    /// `seqs` (and, for rows whose pick a later step may have fed, whether the pick was the
    /// draw). `seqs` None: the world broke since the launch; only the answer is built.
    #[cfg(feature = "cuda")]
    pub(super) fn finish(&mut self, req: &pb::StepRequest, p: PendingAnswer, seqs: Option<&std::sync::Mutex<SeqTable>>) -> Result<pb::StepResponse, StepError> {
        let PendingAnswer { agreed, rows, jobs, reduce, draws, ticket, launch_ms } = p;
        let Agreed { t0, batch, batch_src, mut results } = agreed;
        let crate::backend::Backend::Cuda(m) = &self.backend else { unreachable!("only CUDA steps are left pending") };
        let collected = m.collect_reduce(reduce, &jobs);
        let applied = collected.map_err(|e| StepError::Backend(format!("sampling read-back: {e}"))).and_then(|c| {
            apply_rows(req, &batch_src, &rows, &jobs, c.results, &mut results, &mut self.replay)?;
            Ok(c.picks)
        });
        if let Some(seqs) = seqs {
            let mut seqs = seqs.lock().unwrap();
            for &(seq_id, ri, pick) in &draws {
                let Ok(picks) = &applied else {
                    seqs.resolve_draw(seq_id, ticket, None);
                    continue;
                };
                let i = batch_src[rows[ri].seq];
                let token = results[i].rows.last().and_then(|r| r.drawn_token);
                let taken = seqs.resolve_draw(seq_id, ticket, token);
                if pick.is_some() && taken {
                    seqs.set_fed_check(seq_id, ticket, token.is_some() && picks[ri] == token);
                }
            }
        }
        applied?;
        let total_ms = t0.elapsed().as_secs_f64() * 1e3;
        tracing::debug!(target: "minimax::step", step = req.step_id, tokens = batch.n_tokens(), forward_ms = launch_ms, answer_ms = total_ms - launch_ms, "step (launched, then read back)");
        Ok(pb::StepResponse { rank: self.rank, step_id: req.step_id, seqs: results, compute_ms: total_ms as f32 })
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

/// The rest of a launched device step once every row's rule is in: the row reductions are
/// enqueued behind the forward (their read-back left pending) or, for rows the device does
/// not reduce, computed and answered here.
#[cfg(feature = "cuda")]
#[allow(clippy::too_many_arguments)]
fn enqueue_reduce(rank: u32, head: bool, replay: &mut Option<crate::replay::Replay>, req: &pb::StepRequest, agreed: Agreed, out: crate::cuda::sampling::StepLogits<'_>, ticket: u64, vocab: usize) -> Launched {
    let rows = out.rows().to_vec();
    let jobs = row_jobs(req, &agreed.batch_src, agreed.batch.seqs.len(), &rows);
    // The draws it leaves: the last row of each sampled sequence. Sampled rows a next
    // step may feed from the device carry the gateway's uniform number, so the merge
    // draws the host's token there (greedy rows: the first candidate, as without).
    let mut draws = Vec::new();
    let mut uniforms = vec![None; rows.len()];
    for (ri, row) in rows.iter().enumerate() {
        let s = &req.seqs[agreed.batch_src[row.seq]];
        let last = rows.get(ri + 1).is_none_or(|r| r.seq != row.seq);
        if last
            && s.logits == pb::LogitsMode::Last as i32
            && let Some(u) = s.sampling.as_ref().and_then(|sp| sp.draw)
        {
            // (A masked row's pick feeds the next step only with forward-first late rules
            // on, until both have run on a GPU; otherwise that step waits for the read-back.)
            let dev = feeds_on_device(&jobs[ri].0, jobs[ri].1, vocab, device_draw_on()) && (jobs[ri].0.allowed.is_none() || super::late_rules::forward_first());
            if dev && jobs[ri].0.temperature > 0.0 {
                uniforms[ri] = Some(u);
            }
            draws.push((s.seq_id, ri, dev));
        }
    }
    let pending = match out.enqueue_reduce(&jobs, &uniforms) {
        Ok(p) => p,
        Err(e) => {
            tracing::warn!("device sampling failed, reducing on the host: {e}");
            None
        }
    };
    let Some(reduce) = pending else {
        // Rows not on the device (or none): answered at once.
        return Launched::Done(answer(rank, head, replay, req, agreed, Some(StepOut::Cuda(out))));
    };
    let draws = draws.into_iter().map(|(seq_id, ri, dev)| (seq_id, ri, if dev { reduce.pick_index(ri) } else { None })).collect();
    let launch_ms = agreed.t0.elapsed().as_secs_f64() * 1e3;
    Launched::Pending(Box::new(PendingAnswer { agreed, rows, jobs, reduce, draws, ticket, launch_ms }))
}

/// A step [`Engine::launch`] started.
pub(super) enum Launched {
    /// Computed and answered.
    Done(Result<pb::StepResponse, StepError>),
    /// Enqueued on the GPU; [`Engine::finish`] reads it back.
    #[cfg(feature = "cuda")]
    Pending(Box<PendingAnswer>),
    /// The forward ran (or is enqueued); rows wait for their late rules ([`Engine::resume`]).
    Rules(Box<AwaitRules>),
}

/// A launched step whose forward ran (or, on CUDA, is enqueued) and some of whose rows wait for
/// their rules (late rules). The engine lock may be released meanwhile: no other forward runs
/// before it resumes (compute tickets), so its logits stay where the forward left them.
pub(super) struct AwaitRules {
    agreed: Agreed,
    logits: Awaiting,
    ticket: u64,
    /// The sequences whose rows wait.
    pub waiting: Vec<u64>,
}

/// Where a waiting step's logits are.
enum Awaiting {
    /// No forward (nothing agreed to compute).
    Nothing,
    /// On the host (the CPU backend, or a CUDA forward that downloaded them).
    Host(ForwardOutput),
    /// On the device, to be answered from there.
    #[cfg(feature = "cuda")]
    Lazy(crate::cuda::sampling::DetachedLogits),
    /// On the device, a fast step whose reductions are then enqueued and read back later.
    #[cfg(feature = "cuda")]
    Device(crate::cuda::sampling::DetachedLogits),
}

/// A CUDA step whose row reductions are enqueued and not read back.
#[cfg(feature = "cuda")]
pub(super) struct PendingAnswer {
    agreed: Agreed,
    rows: Vec<LogitsRow>,
    jobs: Vec<(sampling::SamplingSpec, Option<u32>)>,
    reduce: crate::cuda::sampling::PendingReduce,
    /// Each drawing sequence's (id, row, device pick a next step may feed).
    draws: Vec<(u64, usize, Option<usize>)>,
    ticket: u64,
    /// Host time of the launch (the step's `forward_ms` in the debug log).
    launch_ms: f64,
}

#[cfg(feature = "cuda")]
impl PendingAnswer {
    /// Waits until the step's words are on the host (call it without the engine lock, so the
    /// next step can be launched meanwhile).
    pub(super) fn wait(&self) {
        if let Err(e) = self.reduce.wait() {
            // `finish` reads the same error back from the driver.
            tracing::debug!("waiting for a launched step: {e}");
        }
    }

    /// Records in `seqs` the draws this step will make, so the next step can feed them (from
    /// the device where the row allows).
    pub(super) fn expect_draws(&self, seqs: &mut SeqTable) {
        for &(seq_id, _, pick) in &self.draws {
            seqs.expect_draw(seq_id, self.ticket, pick);
        }
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
        let jobs = row_jobs(req, &batch_src, batch.seqs.len(), out.rows());
        let reds = reduce_rows(&out, &jobs)?;
        apply_rows(req, &batch_src, out.rows(), &jobs, reds, &mut results, replay)?;
    }
    Ok(pb::StepResponse { rank, step_id: req.step_id, seqs: results, compute_ms: t0.elapsed().as_secs_f32() * 1e3 })
}

/// Every logits row's sampling spec and score target, in row order.
fn row_jobs(req: &pb::StepRequest, batch_src: &[usize], n_seqs: usize, rows: &[LogitsRow]) -> Vec<(sampling::SamplingSpec, Option<u32>)> {
    let mut row_in_seq = vec![0usize; n_seqs];
    rows.iter()
        .map(|row| {
            let s = &req.seqs[batch_src[row.seq]];
            let k = row_in_seq[row.seq];
            row_in_seq[row.seq] += 1;
            (pb::sampling_spec(s.sampling.as_ref()), s.score_targets.get(k).copied())
        })
        .collect()
}

/// The rows' reductions into the answers, and each sampled sequence's draw with the gateway's
/// uniform number.
fn apply_rows(
    req: &pb::StepRequest,
    batch_src: &[usize],
    rows: &[LogitsRow],
    jobs: &[(sampling::SamplingSpec, Option<u32>)],
    reds: Vec<Result<sampling::RowReduction, sampling::SamplingError>>,
    results: &mut [pb::SeqResult],
    replay: &mut Option<crate::replay::Replay>,
) -> Result<(), StepError> {
    let mut reds = reds.into_iter();
    for (ri, row) in rows.iter().enumerate() {
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
    Ok(())
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

/// Overlapped decode launches a CUDA decode step before the one it follows was read back
/// (device-fed tokens): on unless `MINIMAX_DEVICE_FEED=0` (A/B: steps computed one at a time,
/// still overlapped with the gateway), read once.
#[cfg(feature = "cuda")]
fn device_feed_on() -> bool {
    static ON: crate::cuda::env_flag::EnvFlag = crate::cuda::env_flag::EnvFlag::new("MINIMAX_DEVICE_FEED", true);
    ON.get()
}

/// Device-fed sampled tokens (the merge kernel draws with the gateway's uniform number): on
/// unless `MINIMAX_DEVICE_DRAW=0`, read once (its GPU tests and HTTP A/B passed in session
/// 33). Off, only greedy rows are fed on the device.
#[cfg(feature = "cuda")]
fn device_draw_on() -> bool {
    static ON: crate::cuda::env_flag::EnvFlag = crate::cuda::env_flag::EnvFlag::new("MINIMAX_DEVICE_DRAW", true);
    ON.get()
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

#[cfg(all(test, feature = "cuda"))]
mod tests {
    use super::feeds_on_device;
    use minimax_shared::sampling::SamplingSpec;

    /// The rows a next step may read from the device: those the merge draws as the host does
    /// and whose next sampling does not count the token.
    #[test]
    fn device_feeding_takes_greedy_rows_and_whole_candidate_sets_without_penalties() {
        let v = 200_064;
        let d = SamplingSpec::default;
        // MiniMax's recommended settings (the gateway's defaults), and greedy.
        assert!(feeds_on_device(&SamplingSpec { top_k: 40, top_p: 0.95, ..d() }, None, v, true));
        assert!(feeds_on_device(&SamplingSpec { temperature: 0.0, ..d() }, None, v, true));
        assert!(feeds_on_device(&SamplingSpec { top_k: 1024, min_p: 0.05, logit_bias: vec![(3, -1.0)], ..d() }, None, v, true));
        // A small vocabulary is a whole set without top_k.
        assert!(feeds_on_device(&SamplingSpec { top_p: 0.9, ..d() }, None, 1000, true));
        // Sets larger than the device holds: top_p alone, top_k above the cap.
        assert!(!feeds_on_device(&SamplingSpec { top_p: 0.9, ..d() }, None, v, true));
        assert!(!feeds_on_device(&SamplingSpec { top_k: 1025, ..d() }, None, v, true));
        // Penalties count the token; an invalid spec is reduced on the host.
        assert!(!feeds_on_device(&SamplingSpec { top_k: 40, presence_penalty: 0.5, ..d() }, None, v, true));
        assert!(!feeds_on_device(&SamplingSpec { temperature: 0.0, repetition_penalty: 1.1, ..d() }, None, v, true));
        assert!(!feeds_on_device(&SamplingSpec { temperature: -1.0, top_k: 40, ..d() }, None, v, true));
        // A structured output's row (its next rule follows the token: late rules), greedy or
        // sampled from a whole set.
        assert!(feeds_on_device(&SamplingSpec { temperature: 0.0, allowed: Some(vec![0xffu8; v / 8].into()), ..d() }, None, v, true));
        assert!(feeds_on_device(&SamplingSpec { top_k: 40, allowed: Some(vec![0x0fu8; v / 8].into()), ..d() }, None, v, true));
        // Sampled rows off (MINIMAX_DEVICE_DRAW=0): greedy rows only.
        assert!(!feeds_on_device(&SamplingSpec { top_k: 40, top_p: 0.95, ..d() }, None, v, false));
        assert!(feeds_on_device(&SamplingSpec { temperature: 0.0, ..d() }, None, v, false));
    }
}
