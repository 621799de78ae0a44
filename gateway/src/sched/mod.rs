//! Continuous batching: the synchronous heart of the engine. See `docs/SCHEDULER.md`.
//!
//! The [`Scheduler`] owns the queue, the running sequences and the [`KvCache`]; the engine's
//! async loop feeds it requests, asks it for the next step ([`Scheduler::plan`]), sends the
//! step to every rank and hands all answers back ([`Scheduler::complete`]). Being synchronous
//! and free of I/O, every policy here is unit-tested directly.
//!
//! One step:
//! 1. Admission (FIFO): the head of the queue is admitted when a running slot is free and its
//!    whole remaining prompt fits in the pages an allocation could obtain after its cached
//!    prefix is taken; otherwise admission waits (head-of-line, so big prompts don't starve).
//! 2. Decode first: every running sequence with exactly one token to feed gets it.
//! 3. Prefill: the remaining token budget goes to prefilling sequences in admission order, in
//!    chunks of at most `prefill_chunk` tokens.
//! 4. Pages are allocated on demand. When a sequence can't get one, the most recently
//!    admitted other sequence is preempted (its pages released, its published pages stay in
//!    the prefix cache; it is re-queued at the front and recomputes from its tokens so far);
//!    a lone sequence that still can't grow ends with `Length` (KV memory exhausted).
//!
//! Pipeline worlds keep several planned steps in flight ([`SchedConfig::pipeline_inflight`]):
//! a sequence belongs to at most one of them, so [`Scheduler::plan`] leaves out sequences in
//! flight (their pages too: they are neither preempted nor reaped until their step completes)
//! and every plan is completed, or failed, on its own.
//!
//! One-rank worlds overlap decode steps ([`SchedConfig::overlap`]): while step N computes, step
//! N+1 is already on its way, and each sequence of N that draws a token is in N+1 too, feeding
//! that token (`feed_drawn`), which the rank drew with the uniform number N carried. The
//! gateway learns the token from N's answer while N+1 computes. A sequence that N ends (a stop
//! token, `max_tokens`) wastes its N+1 entry: that answer is dropped, and the sequence's pages
//! and rank-side state are released only once no step in flight holds it (`draining`).
//!
//! A sequence's tokens are `prompt + generated`; its cache holds `kv_len` of them. A step feeds
//! `tokens[kv_len .. kv_len + n]` and asks for the last row's logits when that reaches the end,
//! so decode is a one-token prefill and a preempted sequence resumes like a new prompt.

#[cfg(test)]
mod tests;

use std::collections::{HashMap, VecDeque};
use std::sync::Arc;
use std::time::Instant;

use minimax_proto::v1::{LateRule, LogitsMode, SeqStep, StepRequest, StepResponse};
use tokio::sync::{mpsc, oneshot};

use crate::engine::metrics::Metrics;
use crate::engine::{EngineError, FinishReason, GenEvent, GenerationRequest, ScoreResult, Timings, Usage};
use crate::kv::{KvCache, PageId, ROOT};
use crate::sample::Sampler;

/// Batching limits.
#[derive(Clone, Debug, PartialEq)]
pub struct SchedConfig {
    /// Largest prefill chunk of one sequence in one step.
    pub prefill_chunk: usize,
    /// Most new tokens in one step (decode tokens + prefill chunks).
    pub max_step_tokens: usize,
    /// Most sequences running at once.
    pub max_running: usize,
    /// Most requests waiting for admission; more are refused (429).
    pub max_queue: usize,
    /// Steps of disjoint sequence groups kept in flight in a pipeline world of several stages
    /// (0: one per stage; 1: one step at a time). Other worlds always run one at a time.
    pub pipeline_inflight: usize,
    /// One-rank worlds: keep the next decode step in flight while one computes (see the module
    /// docs). Off: one step at a time.
    pub overlap: bool,
    /// Overlapped decode of constrained sequences (structured outputs, guided tool calls): the
    /// next step goes out with its rule to follow (`SamplingSpec.rule_follows`), and the rule
    /// rides on the step after (`StepRequest.late_rules`). Off: a constrained sequence waits
    /// for each token before its next step is planned.
    pub late_rules: bool,
}

impl Default for SchedConfig {
    fn default() -> Self {
        Self { prefill_chunk: 2048, max_step_tokens: 2048, max_running: 64, max_queue: 256, pipeline_inflight: 0, overlap: true, late_rules: true }
    }
}

impl SchedConfig {
    /// Whether a world of `world_size` ranks overlaps decode steps (the rank that draws the
    /// tokens must be the one that embeds them: one rank).
    pub fn overlaps(&self, world_size: usize) -> bool {
        self.overlap && world_size == 1
    }

    /// How many steps the engine keeps in flight in a world of `world_size` ranks.
    pub fn steps_in_flight(&self, parallelism: &str, world_size: usize) -> usize {
        if self.overlaps(world_size) {
            return 2;
        }
        if parallelism != "pipeline" || world_size < 2 {
            return 1;
        }
        if self.pipeline_inflight == 0 { world_size } else { self.pipeline_inflight }
    }
}

/// Where a sequence's results go.
pub enum Output {
    Gen(mpsc::UnboundedSender<GenEvent>),
    Score(Option<oneshot::Sender<Result<ScoreResult, EngineError>>>),
}

impl Output {
    fn closed(&self) -> bool {
        match self {
            Output::Gen(tx) => tx.is_closed(),
            Output::Score(Some(tx)) => tx.is_closed(),
            Output::Score(None) => true,
        }
    }
}

/// One request in the scheduler.
pub struct Seq {
    pub request_id: String,
    /// The id ranks know this sequence by; fresh at every admission.
    seq_id: u64,
    tokens: Vec<u32>,
    prompt_len: usize,
    max_tokens: u32,
    stop: Vec<u32>,
    sampler: Option<Sampler>,
    out: Output,
    pages: Vec<PageId>,
    kv_len: usize,
    /// Tokens of this sequence in steps in flight (their K/V not yet confirmed in `kv_len`).
    pending: usize,
    /// Its newest step in flight ends with a drawn token the gateway has not seen yet.
    draw_in_flight: bool,
    /// The step in flight whose row was sent with its rule to follow (late rules), until the
    /// rule is queued for the ranks.
    rule_owed: Option<u64>,
    adopt: bool,
    published: usize,
    parent_key: u64,
    cached_tokens: usize,
    admitted_once: bool,
    generated: u32,
    scores: Vec<f32>,
    admitted_order: u64,
    t_enqueued: Instant,
    t_admitted: Option<Instant>,
    t_first_token: Option<Instant>,
    t_last_token: Option<Instant>,
}

impl Seq {
    /// A generation request.
    pub fn generation(req: GenerationRequest, tx: mpsc::UnboundedSender<GenEvent>) -> Self {
        let prompt_len = req.prompt.len();
        Self::new(req.request_id, req.prompt, prompt_len, req.max_tokens, req.stop_token_ids, Some(Sampler::new(req.sampling)), Output::Gen(tx))
    }

    /// A teacher-forced scoring request.
    pub fn score(request_id: String, tokens: Vec<u32>, tx: oneshot::Sender<Result<ScoreResult, EngineError>>) -> Self {
        let n = tokens.len();
        Self::new(request_id, tokens, n, 0, vec![], None, Output::Score(Some(tx)))
    }

    fn new(request_id: String, tokens: Vec<u32>, prompt_len: usize, max_tokens: u32, stop: Vec<u32>, sampler: Option<Sampler>, out: Output) -> Self {
        Self {
            request_id,
            seq_id: 0,
            tokens,
            prompt_len,
            max_tokens,
            stop,
            sampler,
            out,
            pages: vec![],
            kv_len: 0,
            pending: 0,
            draw_in_flight: false,
            rule_owed: None,
            adopt: false,
            published: 0,
            parent_key: ROOT,
            cached_tokens: 0,
            admitted_once: false,
            generated: 0,
            scores: vec![],
            admitted_order: 0,
            t_enqueued: Instant::now(),
            t_admitted: None,
            t_first_token: None,
            t_last_token: None,
        }
    }

    /// A generation asking for no tokens at all.
    pub fn max_tokens_is_zero(&self) -> bool {
        !self.is_score() && self.max_tokens == 0
    }

    /// Fails a sequence that never ran.
    pub fn fail(mut self, err: EngineError) {
        match &mut self.out {
            Output::Gen(tx) => {
                let _ = tx.send(GenEvent::Failed(err));
            }
            Output::Score(tx) => {
                if let Some(tx) = tx.take() {
                    let _ = tx.send(Err(err));
                }
            }
        }
    }

    fn is_score(&self) -> bool {
        self.sampler.is_none()
    }

    /// Tokens whose K/V the sequence still has to write before its next output.
    fn remaining(&self) -> usize {
        let end = if self.is_score() { self.tokens.len().saturating_sub(1) } else { self.tokens.len() };
        end.saturating_sub(self.kv_len)
    }

    /// Releases pages and resets to "not admitted" (preemption / world reset).
    fn reset(&mut self, kv: Option<&mut KvCache>) {
        if let Some(kv) = kv {
            kv.release(&self.pages, !self.is_score());
        }
        self.pages.clear();
        self.kv_len = 0;
        self.pending = 0;
        self.draw_in_flight = false;
        self.rule_owed = None;
        self.adopt = false;
        self.published = 0;
        self.parent_key = ROOT;
        self.seq_id = 0;
        self.scores.clear();
    }
}

/// One planned step: the request to send and what each entry expects back.
#[derive(Debug, Clone)]
pub struct Plan {
    pub request: StepRequest,
    entries: Vec<Entry>,
}

/// What one sequence of a planned step expects back.
#[derive(Debug, Clone, Copy)]
struct Entry {
    id: u64,
    /// The cache length before the step.
    expected: usize,
    /// New tokens.
    n: usize,
    /// The uniform number the rank draws this entry's token with (sampled rows only).
    draw: Option<f64>,
}

impl Plan {
    pub fn n_tokens(&self) -> usize {
        self.entries.iter().map(|e| e.n).sum()
    }
    pub fn n_seqs(&self) -> usize {
        self.entries.len()
    }
}

/// Checks a request against the world's limits before it is queued.
pub fn validate(prompt_len: usize, context: usize, kv_tokens: usize, scoring: bool) -> Result<(), EngineError> {
    if prompt_len == 0 {
        return Err(EngineError::InvalidRequest("the prompt is empty".into()));
    }
    // A generation needs room for at least one new token.
    let limit = if scoring { context } else { context.saturating_sub(1) };
    if prompt_len > limit {
        return Err(EngineError::PromptTooLong { prompt: prompt_len, context });
    }
    if prompt_len > kv_tokens {
        return Err(EngineError::PromptTooLong { prompt: prompt_len, context: kv_tokens });
    }
    Ok(())
}

/// The scheduler state of one rank world.
pub struct Scheduler {
    cfg: SchedConfig,
    kv: KvCache,
    context: usize,
    waiting: VecDeque<Seq>,
    running: Vec<Seq>,
    next_seq: u64,
    seq_epoch: u64,
    next_step: u64,
    admit_counter: u64,
    metrics: Arc<Metrics>,
    /// Rank-side sequence ids to release.
    to_release: Vec<u64>,
    /// Sequences in planned steps that have not completed yet, with how many such steps.
    in_flight: HashMap<u64, u32>,
    /// Sequences that ended while a step in flight still held them: their pages and rank-side
    /// state are released when the last such step completes.
    draining: HashMap<u64, Seq>,
    /// Steps the engine keeps in flight: a step takes at most `1/groups` of the running
    /// sequences, so they split into that many groups that take turns through the stages.
    groups: usize,
    /// Overlapped decode (one-rank worlds): plan a sequence whose step in flight draws a token
    /// again, feeding that token.
    overlap: bool,
    /// Late rules in use: configured on and the ranks run a step's forward before its rules
    /// arrive.
    late: bool,
    /// Rules owed to rows sent with `rule_follows`, for the next step sent.
    rules_out: Vec<LateRule>,
}

impl Scheduler {
    pub fn new(cfg: SchedConfig, page_size: usize, n_pages: usize, context: usize, metrics: Arc<Metrics>) -> Self {
        // Rank-side ids: a random epoch in the high bits, so a restarted gateway attached to
        // still-running ranks never reuses an id they remember.
        let seq_epoch = (rand::random::<u32>() as u64) << 32;
        Self {
            cfg,
            kv: KvCache::new(page_size, n_pages),
            context,
            waiting: VecDeque::new(),
            running: Vec::new(),
            next_seq: 1,
            seq_epoch,
            next_step: 1,
            admit_counter: 0,
            metrics,
            to_release: Vec::new(),
            in_flight: HashMap::new(),
            draining: HashMap::new(),
            groups: 1,
            overlap: false,
            late: false,
            rules_out: Vec::new(),
        }
    }

    pub fn config(&self) -> &SchedConfig {
        &self.cfg
    }

    pub fn kv(&self) -> &KvCache {
        &self.kv
    }

    pub fn context(&self) -> usize {
        self.context
    }

    pub fn waiting(&self) -> usize {
        self.waiting.len()
    }

    pub fn running(&self) -> usize {
        self.running.len()
    }

    pub fn is_idle(&self) -> bool {
        self.waiting.is_empty() && self.running.is_empty()
    }

    /// Sequences in planned steps not completed yet.
    pub fn in_flight(&self) -> usize {
        self.in_flight.len()
    }

    /// How many steps of disjoint sequence groups the engine keeps in flight (1: one step
    /// runs every running sequence).
    pub fn set_steps_in_flight(&mut self, n: usize) {
        self.groups = n.max(1);
    }

    /// Overlapped decode on or off (the engine keeps two steps in flight when on).
    pub fn set_overlap(&mut self, on: bool) {
        self.overlap = on;
    }

    /// Late rules (overlapped decode of constrained sequences): only where the ranks run a
    /// step's forward before its rules arrive; elsewhere a step would wait for the rule before
    /// it computes and hold back every other sequence in it.
    pub fn set_late_rules(&mut self, on: bool) {
        self.late = on;
    }

    fn is_in_flight(&self, id: u64) -> bool {
        self.in_flight.contains_key(&id)
    }

    /// A step holding `id` completed or failed: one fewer in flight; a sequence that ended
    /// meanwhile is released when none holds it any more.
    fn landed(&mut self, id: u64) {
        if let Some(c) = self.in_flight.get_mut(&id) {
            *c -= 1;
            if *c == 0 {
                self.in_flight.remove(&id);
                if let Some(mut s) = self.draining.remove(&id) {
                    self.drop_seq(&mut s);
                }
            }
        }
    }

    /// Takes an ended sequence out of service: released now, or once the steps in flight that
    /// hold it have completed (their pages are still being written).
    fn retire(&mut self, mut s: Seq) {
        settle_rule(&mut self.rules_out, &mut s, false);
        if s.seq_id != 0 && self.is_in_flight(s.seq_id) {
            self.draining.insert(s.seq_id, s);
        } else {
            self.drop_seq(&mut s);
        }
    }

    /// A new world (restart, or a different page count): everything is forgotten. Callers fail
    /// the sequences first ([`Scheduler::fail_all`]).
    pub fn reset_world(&mut self, page_size: usize, n_pages: usize, context: usize) {
        debug_assert!(self.is_idle());
        self.kv.reset(page_size, n_pages);
        self.context = context;
        self.to_release.clear();
        self.in_flight.clear();
        self.draining.clear();
        self.rules_out.clear();
        self.publish_gauges();
    }

    /// Queues a sequence (already validated).
    pub fn submit(&mut self, seq: Seq) {
        self.waiting.push_back(seq);
        self.publish_gauges();
    }

    /// Sequence ids the ranks should forget; drained by the caller.
    pub fn take_releases(&mut self) -> Vec<u64> {
        std::mem::take(&mut self.to_release)
    }

    /// Drops sequences whose receiver is gone (client disconnected), freeing their pages. A
    /// sequence in flight is dropped once its step completed (its pages are being written).
    pub fn reap_cancelled(&mut self) -> usize {
        let mut n = 0;
        let before = self.waiting.len();
        self.waiting.retain(|s| !s.out.closed());
        n += before - self.waiting.len();
        let mut i = 0;
        while i < self.running.len() {
            if self.running[i].out.closed() && !self.is_in_flight(self.running[i].seq_id) {
                let mut s = self.running.remove(i);
                tracing::info!(request_id = %s.request_id, generated = s.generated, "request cancelled: client went away");
                self.drop_seq(&mut s);
                n += 1;
            } else {
                i += 1;
            }
        }
        if n > 0 {
            self.metrics.cancelled.fetch_add(n as u64, std::sync::atomic::Ordering::Relaxed);
            self.publish_gauges();
        }
        n
    }

    /// Frees a removed sequence's pages and queues its rank-side release.
    fn drop_seq(&mut self, s: &mut Seq) {
        if s.seq_id != 0 {
            self.to_release.push(s.seq_id);
        }
        s.reset(Some(&mut self.kv));
    }

    /// Fails every waiting and running sequence (the world broke).
    pub fn fail_all(&mut self, err: EngineError) {
        let mut all: Vec<Seq> = self.running.drain(..).collect();
        all.extend(self.waiting.drain(..));
        for mut s in all {
            s.reset(Some(&mut self.kv));
            finish_with_error(&mut s, err.clone(), &self.metrics);
        }
        for (_, mut s) in std::mem::take(&mut self.draining) {
            s.reset(Some(&mut self.kv));
        }
        self.to_release.clear();
        self.in_flight.clear();
        self.rules_out.clear();
        self.publish_gauges();
    }

    /// A planned step failed as a whole on the ranks without breaking the world (every rank
    /// refused it before changing any state): only its sequences fail.
    pub fn fail_plan(&mut self, plan: Plan, err: EngineError) {
        for e in plan.entries {
            if let Some(idx) = self.running.iter().position(|s| s.seq_id == e.id) {
                let mut s = self.running.remove(idx);
                finish_with_error(&mut s, err.clone(), &self.metrics);
                self.retire(s);
            }
            self.landed(e.id);
        }
        self.publish_gauges();
    }

    fn admit(&mut self) {
        let ps = self.kv.page_size();
        while self.running.len() < self.cfg.max_running {
            let Some(front) = self.waiting.front() else { break };
            if front.out.closed() {
                self.waiting.pop_front();
                continue;
            }
            let scoring = front.is_score();
            // Scoring needs logits at every position: a cached prefix is of no use to it.
            let hits = if scoring { vec![] } else { self.kv.lookup(&front.tokens, front.tokens.len().saturating_sub(1) / ps) };
            let newly_held = hits.iter().filter(|h| self.kv.refs(h.page) == 0).count();
            let total_pages = front.tokens.len().div_ceil(ps);
            let need = total_pages - hits.len();
            // Headroom: one page of growth per running sequence.
            if self.kv.available().saturating_sub(newly_held) < need + self.running.len() {
                break;
            }
            let mut s = self.waiting.pop_front().unwrap();
            let hits = if scoring { vec![] } else { self.kv.acquire_prefix(&s.tokens, true) };
            debug_assert_eq!(hits.len(), total_pages - need);
            s.seq_id = self.seq_epoch | self.next_seq;
            self.next_seq += 1;
            s.pages = hits.iter().map(|h| h.page).collect();
            s.kv_len = hits.len() * ps;
            s.adopt = s.kv_len > 0;
            s.published = hits.len();
            s.parent_key = hits.last().map_or(ROOT, |h| h.key);
            if !s.admitted_once {
                s.cached_tokens = s.kv_len;
                s.admitted_once = true;
                s.t_admitted = Some(Instant::now());
                if let Output::Gen(tx) = &s.out {
                    let _ = tx.send(GenEvent::Started { cached_tokens: s.cached_tokens as u32 });
                }
            }
            self.admit_counter += 1;
            s.admitted_order = self.admit_counter;
            self.running.push(s);
        }
    }

    /// Preempts the most recently admitted running sequence other than `keep` (and not in
    /// flight). Returns false when there is none.
    fn preempt_newest_except(&mut self, keep: u64) -> bool {
        let Some(i) = self.running.iter().enumerate().filter(|(_, s)| s.seq_id != keep && !self.is_in_flight(s.seq_id)).max_by_key(|(_, s)| s.admitted_order).map(|(i, _)| i) else {
            return false;
        };
        let mut s = self.running.remove(i);
        tracing::info!(request_id = %s.request_id, kv_len = s.kv_len, "preempting a sequence: KV memory is full");
        self.metrics.preemptions.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        self.drop_seq(&mut s);
        self.waiting.push_front(s);
        true
    }

    /// Admits what fits and builds the next step, or `None` when there is nothing to run. The
    /// step leaves out sequences in flight; they are in flight until [`Scheduler::complete`]
    /// (or [`Scheduler::fail_plan`]) takes the returned plan back.
    pub fn plan(&mut self) -> Option<Plan> {
        let mut allow_admit = true;
        loop {
            if allow_admit {
                self.admit();
            }
            if let Some(plan) = self.build() {
                for e in &plan.entries {
                    *self.in_flight.entry(e.id).or_insert(0) += 1;
                }
                self.publish_gauges();
                return Some(plan);
            }
            // Steps in flight will move their sequences on (or free pages): wait for them
            // rather than preempt or end anything.
            if !self.in_flight.is_empty() {
                self.publish_gauges();
                return None;
            }
            if self.running.is_empty() {
                self.publish_gauges();
                if allow_admit || self.waiting.is_empty() {
                    return None;
                }
                allow_admit = true;
                continue;
            }
            // Nothing can progress: KV memory is exhausted. Preempt the newest sequence while
            // there are several (and admit nothing until a step ran); a lone sequence that
            // can't grow ends here.
            if self.running.len() > 1 {
                let oldest = self.running.iter().min_by_key(|s| s.admitted_order).unwrap().seq_id;
                self.preempt_newest_except(oldest);
                allow_admit = false;
                continue;
            }
            let mut s = self.running.pop().unwrap();
            tracing::warn!(request_id = %s.request_id, kv_len = s.kv_len, "KV memory exhausted by a single sequence");
            if s.is_score() {
                self.drop_seq(&mut s);
                finish_with_error(&mut s, EngineError::InvalidRequest("the input needs more KV memory than the ranks have".into()), &self.metrics);
            } else {
                self.finish(s, FinishReason::Length);
            }
        }
    }

    /// Whether overlapped decode can plan `s` again while its step in flight draws its next
    /// token: that token must be fed next (one unseen draw at most, so the penalties' history
    /// misses only the token the rank adds), must not end the sequence by length, and must not
    /// decide the next step's allowed tokens (structured outputs) unless that rule may follow
    /// (late rules).
    fn can_feed_drawn(&self, s: &Seq) -> bool {
        self.overlap
            && s.draw_in_flight
            && self.in_flight.get(&s.seq_id) == Some(&1)
            && !s.is_score()
            && !s.out.closed()
            && s.generated + 1 < s.max_tokens
            && s.tokens.len() + 1 < self.context
            && (self.late || !s.sampler.as_ref().is_some_and(Sampler::needs_drawn_token))
    }

    /// Picks the step's entries among the running sequences; `None` if none can run.
    fn build(&mut self) -> Option<Plan> {
        let ps = self.kv.page_size();
        // Decode-class (one token to feed, or a drawn token to feed next) first, then prefills,
        // each in admission order.
        let mut order: Vec<(bool, u64, u64)> = self
            .running
            .iter()
            .filter(|s| if self.is_in_flight(s.seq_id) { self.can_feed_drawn(s) } else { true })
            .map(|s| (!self.is_in_flight(s.seq_id) && s.remaining() != 1, s.admitted_order, s.seq_id))
            .collect();
        order.sort();
        let mut budget = self.cfg.max_step_tokens;
        // Several steps in flight: each takes its share of the running sequences.
        let max_seqs = self.running.len().div_ceil(self.groups).max(1);
        let mut entries: Vec<Entry> = Vec::new();
        let mut seqs = Vec::new();
        for (_, _, id) in order {
            if budget == 0 || entries.len() == max_seqs {
                break;
            }
            // (A sequence may have been preempted meanwhile.)
            let Some(idx) = self.running.iter().position(|s| s.seq_id == id) else { continue };
            if self.is_in_flight(id) {
                // Overlapped decode: one position after the tokens in flight, fed by the rank;
                // a page for it if one is free (never preempting for it).
                let s = &self.running[idx];
                let at = s.kv_len + s.pending;
                let need = (at + 1).div_ceil(ps).saturating_sub(s.pages.len());
                if need > 0 {
                    let Some(p) = self.kv.alloc(need) else { continue };
                    self.running[idx].pages.extend(p);
                }
                let s = &mut self.running[idx];
                let sampler = s.sampler.as_mut().expect("a generation");
                // A constrained sequence's rule depends on the token in flight: it follows.
                let late = self.late && sampler.is_constrained();
                let (spec, u) = if late { sampler.next_spec_late() } else { sampler.next_spec() };
                if late {
                    debug_assert!(s.rule_owed.is_none(), "the step in flight had its rule already");
                    s.rule_owed = Some(self.next_step);
                }
                seqs.push(SeqStep {
                    seq_id: s.seq_id,
                    page_table: s.pages.clone(),
                    expected_cache_len: at as u32,
                    tokens: vec![],
                    logits: LogitsMode::Last as i32,
                    sampling: Some(spec),
                    score_targets: vec![],
                    adopt_prefix: false,
                    feed_drawn: true,
                });
                s.pending += 1;
                entries.push(Entry { id, expected: at, n: 1, draw: Some(u) });
                budget -= 1;
                continue;
            }
            let (kv_len, remaining, me) = (self.running[idx].kv_len, self.running[idx].remaining(), self.running[idx].admitted_order);
            if remaining == 0 {
                continue;
            }
            let n = remaining.min(self.cfg.prefill_chunk).min(budget);
            let n_ok = loop {
                let idx = self.running.iter().position(|s| s.seq_id == id).unwrap();
                let have = self.running[idx].pages.len();
                let need = (kv_len + n).div_ceil(ps).saturating_sub(have);
                if need == 0 {
                    break n;
                }
                if let Some(p) = self.kv.alloc(need) {
                    self.running[idx].pages.extend(p);
                    break n;
                }
                // Preempt a sequence admitted after this one (and not in this step yet, nor in
                // flight).
                let newer = self
                    .running
                    .iter()
                    .filter(|s| s.admitted_order > me && !entries.iter().any(|e| e.id == s.seq_id) && !self.is_in_flight(s.seq_id))
                    .max_by_key(|s| s.admitted_order)
                    .map(|s| s.seq_id);
                if let Some(victim) = newer {
                    let vi = self.running.iter().position(|s| s.seq_id == victim).unwrap();
                    let mut v = self.running.remove(vi);
                    tracing::info!(request_id = %v.request_id, kv_len = v.kv_len, "preempting a sequence: KV memory is full");
                    self.metrics.preemptions.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                    self.drop_seq(&mut v);
                    self.waiting.push_front(v);
                    continue;
                }
                // Otherwise use what the pages already held allow (maybe nothing).
                break (have * ps).saturating_sub(kv_len).min(n);
            };
            if n_ok == 0 {
                continue;
            }
            let s = self.running.iter_mut().find(|s| s.seq_id == id).unwrap();
            let (step, draw) = build_seq_step(s, n_ok);
            seqs.push(step);
            s.pending += n_ok;
            s.draw_in_flight = draw.is_some();
            entries.push(Entry { id, expected: kv_len, n: n_ok, draw });
            budget -= n_ok;
        }
        if entries.is_empty() && self.rules_out.is_empty() {
            return None;
        }
        // (With no entries: a step that only carries rules, so rows waiting for them finish.)
        let step_id = self.next_step;
        self.next_step += 1;
        let late_rules = std::mem::take(&mut self.rules_out);
        Some(Plan { request: StepRequest { step_id, seqs, after_step_id: 0, late_rules }, entries })
    }

    /// Applies every rank's answer to a planned step: the KV-length handshake, then sampling or
    /// scoring on the head rank's rows.
    pub fn complete(&mut self, plan: Plan, responses: &[StepResponse], head: usize) {
        let by_rank: Vec<HashMap<u64, &minimax_proto::v1::SeqResult>> = responses.iter().map(|r| r.seqs.iter().map(|s| (s.seq_id, s)).collect()).collect();
        let ps = self.kv.page_size();
        for (entry, e) in plan.entries.into_iter().enumerate() {
            let Entry { id, expected, n, draw } = e;
            self.landed(id);
            // (Ended meanwhile: an overlapped entry after its last token, or failed.)
            let Some(idx) = self.running.iter().position(|s| s.seq_id == id) else { continue };
            {
                let s = &mut self.running[idx];
                s.pending -= n;
                if !self.in_flight.contains_key(&id) {
                    s.draw_in_flight = false;
                }
                debug_assert_eq!(s.kv_len, expected, "steps complete in the order they were sent");
            }
            // The handshake: every rank executed it and agrees on the new length.
            let want = (expected + n) as u32;
            let mut problems = Vec::new();
            for (r, m) in by_rank.iter().enumerate() {
                match m.get(&id) {
                    None => problems.push(format!("rank {r} returned no result")),
                    Some(res) if !res.error.is_empty() => problems.push(format!("rank {r}: {}", res.error)),
                    Some(res) if res.cache_len != want => problems.push(format!("rank {r} reports cache length {} (expected {want})", res.cache_len)),
                    Some(_) => {}
                }
            }
            if !problems.is_empty() {
                let mut s = self.running.remove(idx);
                let msg = format!("sequence of request {} dropped at step {}: {}", s.request_id, plan.request.step_id, problems.join("; "));
                tracing::error!("{msg}");
                self.metrics.cache_mismatches.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                finish_with_error(&mut s, EngineError::CacheMismatch(msg), &self.metrics);
                self.retire(s);
                continue;
            }
            let rows = by_rank.get(head).and_then(|m| m.get(&id)).map(|r| r.rows.as_slice()).unwrap_or(&[]);
            let s = &mut self.running[idx];
            s.kv_len += n;
            s.adopt = false;
            self.metrics.prompt_tokens_computed.fetch_add(n as u64, std::sync::atomic::Ordering::Relaxed);
            if s.is_score() {
                let mut rows: Vec<_> = rows.iter().collect();
                rows.sort_by_key(|r| r.position);
                if rows.len() != n {
                    let mut s = self.running.remove(idx);
                    let msg = format!("head rank returned {} score rows for {n} tokens", rows.len());
                    finish_with_error(&mut s, EngineError::Internal(msg), &self.metrics);
                    self.retire(s);
                    continue;
                }
                s.scores.extend(rows.iter().map(|r| r.target_logprob));
                if s.remaining() == 0 {
                    let mut s = self.running.remove(idx);
                    let result = ScoreResult { logprobs: std::mem::take(&mut s.scores), cached_tokens: 0 };
                    tracing::info!(request_id = %s.request_id, tokens = s.tokens.len(), ms = s.t_enqueued.elapsed().as_secs_f64() * 1e3, "score request finished");
                    if let Output::Score(tx) = &mut s.out
                        && let Some(tx) = tx.take()
                    {
                        let _ = tx.send(Ok(result));
                    }
                    self.retire(s);
                }
                continue;
            }
            // Publish the pages this step filled (prompt and generated tokens alike).
            while (s.published + 1) * ps <= s.kv_len {
                let i = s.published;
                s.parent_key = self.kv.publish(s.pages[i], s.parent_key, &s.tokens[i * ps..(i + 1) * ps]);
                s.published += 1;
            }
            if s.remaining() > 0 {
                continue; // an intermediate prefill chunk
            }
            let (Some(row), Some(u)) = (rows.last(), draw) else {
                let mut s = self.running.remove(idx);
                finish_with_error(&mut s, EngineError::Internal(format!("head rank returned no logits row (entry {entry})")), &self.metrics);
                self.retire(s);
                continue;
            };
            let sampled = match s.sampler.as_mut().unwrap().sample(row, u) {
                Ok(x) => x,
                Err(e) => {
                    let mut s = self.running.remove(idx);
                    finish_with_error(&mut s, EngineError::Internal(format!("sampling: {e}")), &self.metrics);
                    self.retire(s);
                    continue;
                }
            };
            let now = Instant::now();
            if s.t_first_token.is_none() {
                s.t_first_token = Some(now);
            }
            s.t_last_token = Some(now);
            s.generated += 1;
            self.metrics.generated_tokens.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
            if s.stop.contains(&sampled.token) {
                let s = self.running.remove(idx);
                self.finish(s, FinishReason::Stop);
                continue;
            }
            s.tokens.push(sampled.token);
            if let Output::Gen(tx) = &s.out {
                let _ = tx.send(GenEvent::Token { id: sampled.token, logprob: sampled.logprob });
            }
            if s.generated >= s.max_tokens || s.tokens.len() >= self.context {
                let s = self.running.remove(idx);
                self.finish(s, FinishReason::Length);
                continue;
            }
            // The row in flight sent with its rule to follow gets it now that its token is in.
            settle_rule(&mut self.rules_out, &mut self.running[idx], true);
        }
        self.publish_gauges();
    }

    /// Ends a generation normally.
    fn finish(&mut self, s: Seq, reason: FinishReason) {
        let usage = Usage { prompt_tokens: s.prompt_len as u32, cached_tokens: s.cached_tokens as u32, completion_tokens: s.generated };
        let timings = timings(&s);
        let decode_tokens = s.generated.saturating_sub(1);
        let tok_s = if timings.decode_ms > 0.0 { decode_tokens as f64 / (timings.decode_ms / 1e3) } else { 0.0 };
        tracing::info!(
            target: "minimax::request",
            request_id = %s.request_id,
            prompt_tokens = usage.prompt_tokens,
            cached_tokens = usage.cached_tokens,
            prefill_ms = format_args!("{:.1}", timings.prefill_ms),
            decode_tokens = usage.completion_tokens,
            tok_s = format_args!("{:.1}", tok_s),
            ttft_ms = format_args!("{:.1}", timings.ttft_ms),
            queue_ms = format_args!("{:.1}", timings.queue_ms),
            finish = ?reason,
            "request finished"
        );
        self.metrics.finished(reason);
        if let Output::Gen(tx) = &s.out {
            let _ = tx.send(GenEvent::Finished { reason, usage, timings });
        }
        self.retire(s);
    }

    /// Ends a generation with `max_tokens == 0` without running it.
    pub fn finish_empty(&mut self, s: Seq) {
        self.finish(s, FinishReason::Length);
    }

    fn publish_gauges(&self) {
        use std::sync::atomic::Ordering::Relaxed;
        let m = &self.metrics;
        m.queue_depth.store(self.waiting.len() as u64, Relaxed);
        m.running.store(self.running.len() as u64, Relaxed);
        m.kv_pages_total.store(self.kv.n_pages() as u64, Relaxed);
        m.kv_pages_used.store(self.kv.used_pages() as u64, Relaxed);
        m.kv_pages_free.store(self.kv.available() as u64, Relaxed);
        m.kv_pages_cached.store(self.kv.cached_pages() as u64, Relaxed);
        let st = self.kv.stats();
        m.prefix_lookup_tokens.store(st.lookup_tokens, Relaxed);
        m.prefix_hit_tokens.store(st.hit_tokens, Relaxed);
        m.kv_evictions.store(st.evictions, Relaxed);
    }
}

fn timings(s: &Seq) -> Timings {
    let ms = |a: Instant, b: Instant| b.saturating_duration_since(a).as_secs_f64() * 1e3;
    let admitted = s.t_admitted.unwrap_or(s.t_enqueued);
    let first = s.t_first_token.unwrap_or_else(Instant::now);
    let last = s.t_last_token.unwrap_or(first);
    Timings { queue_ms: ms(s.t_enqueued, admitted), prefill_ms: ms(admitted, first), ttft_ms: ms(s.t_enqueued, first), decode_ms: ms(first, last) }
}

fn finish_with_error(s: &mut Seq, err: EngineError, metrics: &Metrics) {
    metrics.failed.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    tracing::info!(target: "minimax::request", request_id = %s.request_id, prompt_tokens = s.prompt_len, decode_tokens = s.generated, error = %err, "request failed");
    match &mut s.out {
        Output::Gen(tx) => {
            let _ = tx.send(GenEvent::Failed(err));
        }
        Output::Score(tx) => {
            if let Some(tx) = tx.take() {
                let _ = tx.send(Err(err));
            }
        }
    }
}

/// Queues in `out` the rule a row of `s` sent with `rule_follows` still waits for: the
/// constraint's next rule (`live`: every token before that row was sampled), or none (the
/// sequence ended; the rank reduces the row unconstrained and its answer is dropped).
fn settle_rule(out: &mut Vec<LateRule>, s: &mut Seq, live: bool) {
    let Some(step_id) = s.rule_owed.take() else { return };
    let (logit_bias, allowed_tokens) = match s.sampler.as_mut() {
        Some(sm) if live => sm.late_rule(),
        _ => (vec![], None),
    };
    out.push(LateRule { step_id, seq_id: s.seq_id, logit_bias, allowed_tokens });
}

/// The step entry feeding `n` of `s`'s tokens, and the uniform number its draw takes when the
/// entry reaches the end of the tokens (a sampled row).
fn build_seq_step(s: &mut Seq, n: usize) -> (SeqStep, Option<f64>) {
    let start = s.kv_len;
    let tokens = s.tokens[start..start + n].to_vec();
    let (logits, score_targets, sampling, draw) = if s.is_score() {
        (LogitsMode::All, s.tokens[start + 1..start + n + 1].to_vec(), None, None)
    } else if start + n == s.tokens.len() {
        let (spec, u) = s.sampler.as_mut().unwrap().next_spec();
        (LogitsMode::Last, vec![], Some(spec), Some(u))
    } else {
        (LogitsMode::None, vec![], None, None)
    };
    let step = SeqStep {
        seq_id: s.seq_id,
        page_table: s.pages.clone(),
        expected_cache_len: start as u32,
        tokens,
        logits: logits as i32,
        sampling,
        score_targets,
        adopt_prefix: s.adopt,
        feed_drawn: false,
    };
    (step, draw)
}
