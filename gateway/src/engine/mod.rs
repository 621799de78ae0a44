//! The engine: scheduler, KV pages and prefix cache, sampling and the ranks behind them.
//!
//! # API for the HTTP layer
//!
//! ```ignore
//! // Start: supervises the ranks (spawned or attached) and runs the batching loop.
//! let engine = Engine::start(EngineConfig { sched, world });   // cheap-clone handle
//! engine.wait_ready(Duration::from_secs(600)).await?;          // optional
//!
//! // Generate: errors known at once come back here (QueueFull → 429, NotReady → 503,
//! // PromptTooLong / InvalidRequest → 400); later ones arrive as GenEvent::Failed.
//! let mut stream: GenStream = engine.generate(request)?;
//! while let Some(ev) = stream.recv().await { ... }  // also a futures Stream<Item = GenEvent>
//! // Events: zero or more Token, then exactly one Finished or Failed, then the stream ends.
//! // Dropping the stream cancels the sequence and frees its pages (within one step).
//!
//! let scored: ScoreResult = engine.score(request_id, tokens).await?;  // /v1/perplexity
//! engine.health() -> Vec<RankHealth>;   engine.ready() -> bool;
//! engine.metrics() -> MetricsSnapshot;  engine.model_info() -> Option<ModelSummary>;
//! engine.shutdown().await;
//! ```
//!
//! Semantics the HTTP layer can rely on:
//! - A sampled stop token (`stop_token_ids`) ends the generation with `FinishReason::Stop`;
//!   it is NOT sent as a `Token` event but counts in `usage.completion_tokens`.
//! - `max_tokens` and the context length end it with `Length`; prompt + output never exceed
//!   the context (a prompt must leave room for one token, else `PromptTooLong`).
//!   `max_tokens == 0` finishes at once with `Length` and no tokens.
//! - `usage.cached_tokens` are the prompt tokens served from the prefix cache (full pages).
//! - Same `seed`, same tokens, whatever else runs in the same steps.
//! - `score` never reads nor fills the prefix cache and never marks cached pages as recently
//!   used; it returns `tokens.len() - 1` logprobs (the first token is unscored).
//! - A step the ranks refuse as a whole (INVALID_ARGUMENT, e.g. a sampling parameter the head
//!   rank rejects) fails its sequences with `Internal`; the others go on.
//! - When a rank dies every running and queued request fails with `RankFailure`; new
//!   requests get `NotReady` until the supervisor has the world back.
//!
//! For tests, [`Engine::with_world`] runs the same loop against any [`RankWorld`], e.g. the
//! in-process [`crate::ranks::fake::FakeWorld`].

pub mod metrics;
pub mod types;

use std::pin::Pin;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::task::{Context, Poll};
use std::time::{Duration, Instant};

use tokio::sync::{mpsc, oneshot, watch};

pub use metrics::MetricsSnapshot;
pub use types::*;

use crate::ranks::supervisor::{Supervisor, WorldConfig};
use crate::ranks::{BoxFuture, ModelSummary, RankWorld, WorldError, WorldInfo, WorldState};
use crate::sched::{Plan, SchedConfig, Scheduler, Seq};
use futures_util::StreamExt;
use futures_util::stream::FuturesOrdered;
use metrics::Metrics;

/// One step in flight: its plan and, once every rank answered, the answers.
type StepFuture = BoxFuture<'static, (Plan, Result<Vec<minimax_proto::v1::StepResponse>, WorldError>, Duration)>;

/// Everything the engine needs to start.
#[derive(Clone, Debug)]
pub struct EngineConfig {
    pub sched: SchedConfig,
    pub world: WorldConfig,
}

enum Cmd {
    Submit(Seq),
}

struct Inner {
    world: Arc<dyn RankWorld>,
    cmd_tx: mpsc::UnboundedSender<Cmd>,
    state: watch::Receiver<WorldState>,
    metrics: Arc<Metrics>,
    sched: SchedConfig,
    /// Requests submitted and not yet admitted nor finished (for the queue limit).
    queued: Arc<AtomicUsize>,
    /// The last world generation the engine saw break (its `Ready` state may linger until the
    /// supervisor notices); it is not served again.
    dead_generation: Arc<AtomicU64>,
    last_model: std::sync::Mutex<Option<ModelSummary>>,
}

/// The engine handle; clones share one engine.
#[derive(Clone)]
pub struct Engine {
    inner: Arc<Inner>,
}

/// The events of one generation. Dropping it cancels the generation.
pub struct GenStream {
    rx: mpsc::UnboundedReceiver<GenEvent>,
}

impl GenStream {
    /// The next event; `None` after `Finished` / `Failed`.
    pub async fn recv(&mut self) -> Option<GenEvent> {
        self.rx.recv().await
    }

    /// Collects the whole generation (tests, non-streamed requests).
    pub async fn collect_all(mut self) -> Vec<GenEvent> {
        let mut out = Vec::new();
        while let Some(e) = self.rx.recv().await {
            let end = matches!(e, GenEvent::Finished { .. } | GenEvent::Failed(_));
            out.push(e);
            if end {
                break;
            }
        }
        out
    }
}

impl futures_util::Stream for GenStream {
    type Item = GenEvent;
    fn poll_next(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<GenEvent>> {
        self.rx.poll_recv(cx)
    }
}

impl Engine {
    /// Starts the supervisor (spawning or attaching ranks) and the batching loop. Must be
    /// called inside a tokio runtime.
    pub fn start(cfg: EngineConfig) -> Engine {
        let world: Arc<dyn RankWorld> = Arc::new(Supervisor::start(cfg.world));
        Self::with_world(world, cfg.sched)
    }

    /// Runs the engine against any rank world (tests: an in-process fake).
    pub fn with_world(world: Arc<dyn RankWorld>, sched: SchedConfig) -> Engine {
        let (cmd_tx, cmd_rx) = mpsc::unbounded_channel();
        let metrics = Arc::new(Metrics::default());
        let queued = Arc::new(AtomicUsize::new(0));
        let state = world.subscribe();
        let dead_generation = Arc::new(AtomicU64::new(0));
        tokio::spawn(run(world.clone(), sched.clone(), cmd_rx, metrics.clone(), queued.clone(), dead_generation.clone()));
        Engine { inner: Arc::new(Inner { world, cmd_tx, state, metrics, sched, queued, dead_generation, last_model: Default::default() }) }
    }

    fn ready_info(&self) -> Result<WorldInfo, EngineError> {
        let st = self.inner.state.borrow();
        let dead = self.inner.dead_generation.load(Ordering::SeqCst);
        st.ready().filter(|i| i.generation > dead).cloned().ok_or_else(|| EngineError::NotReady(describe(&st, dead)))
    }

    fn reserve_queue_slot(&self) -> Result<(), EngineError> {
        let q = &self.inner.queued;
        let n = q.fetch_add(1, Ordering::SeqCst);
        if n >= self.inner.sched.max_queue {
            q.fetch_sub(1, Ordering::SeqCst);
            self.inner.metrics.rejected_queue_full.fetch_add(1, Ordering::Relaxed);
            return Err(EngineError::QueueFull(n));
        }
        Ok(())
    }

    /// Queues a generation; see the module docs for the event protocol.
    pub fn generate(&self, req: GenerationRequest) -> Result<GenStream, EngineError> {
        let info = self.ready_info()?;
        crate::sched::validate(req.prompt.len(), info.model.context_length as usize, (info.page_size * info.n_pages) as usize, false)?;
        if let Some(&t) = req.prompt.iter().find(|&&t| info.model.vocab_size > 0 && t >= info.model.vocab_size) {
            return Err(EngineError::InvalidRequest(format!("token id {t} is outside the vocabulary ({})", info.model.vocab_size)));
        }
        if req.sampling.top_logprobs > 20 {
            return Err(EngineError::InvalidRequest("top_logprobs must be at most 20".into()));
        }
        self.reserve_queue_slot()?;
        let (tx, rx) = mpsc::unbounded_channel();
        self.inner.cmd_tx.send(Cmd::Submit(Seq::generation(req, tx))).map_err(|_| EngineError::NotReady("the engine has stopped".into()))?;
        Ok(GenStream { rx })
    }

    /// Teacher-forced scoring: ln p(token[i] | token[..i]) for i >= 1.
    pub async fn score(&self, request_id: String, tokens: Vec<u32>) -> Result<ScoreResult, EngineError> {
        let info = self.ready_info()?;
        crate::sched::validate(tokens.len(), info.model.context_length as usize, (info.page_size * info.n_pages) as usize, true)?;
        if tokens.len() == 1 {
            return Ok(ScoreResult { logprobs: vec![], cached_tokens: 0 });
        }
        if let Some(&t) = tokens.iter().find(|&&t| info.model.vocab_size > 0 && t >= info.model.vocab_size) {
            return Err(EngineError::InvalidRequest(format!("token id {t} is outside the vocabulary ({})", info.model.vocab_size)));
        }
        self.reserve_queue_slot()?;
        let (tx, rx) = oneshot::channel();
        self.inner.cmd_tx.send(Cmd::Submit(Seq::score(request_id, tokens, tx))).map_err(|_| EngineError::NotReady("the engine has stopped".into()))?;
        rx.await.unwrap_or_else(|_| Err(EngineError::Internal("the engine dropped a score request".into())))
    }

    /// Each rank's state (for `/health`).
    pub fn health(&self) -> Vec<RankHealth> {
        self.inner.world.health()
    }

    /// Whether the world is up and serving.
    pub fn ready(&self) -> bool {
        self.ready_info().is_ok()
    }

    /// The world's state in words (for 503 bodies and logs).
    pub fn state(&self) -> WorldState {
        self.inner.state.borrow().clone()
    }

    /// Waits until the world is ready, or fails with `NotReady` after `timeout` / when the
    /// supervisor gave up.
    pub async fn wait_ready(&self, timeout: Duration) -> Result<WorldInfo, EngineError> {
        let mut rx = self.inner.world.subscribe();
        let fut = async {
            loop {
                {
                    let st = rx.borrow_and_update();
                    let dead = self.inner.dead_generation.load(Ordering::SeqCst);
                    match &*st {
                        WorldState::Ready(i) if i.generation > dead => return Ok(i.clone()),
                        WorldState::Failed(r) => return Err(EngineError::NotReady(format!("ranks failed: {r}"))),
                        _ => {}
                    }
                }
                if rx.changed().await.is_err() {
                    return Err(EngineError::NotReady("the supervisor stopped".into()));
                }
            }
        };
        tokio::time::timeout(timeout, fut).await.unwrap_or_else(|_| Err(EngineError::NotReady(format!("ranks not ready after {timeout:?}: {}", describe(&self.inner.state.borrow(), self.inner.dead_generation.load(Ordering::SeqCst))))))
    }

    /// The model the ranks serve (None until the first world is up).
    pub fn model_info(&self) -> Option<ModelSummary> {
        // The model does not change across restarts: report the last one seen.
        let mut rx = self.inner.world.subscribe();
        let st = rx.borrow_and_update();
        st.ready().map(|i| i.model.clone()).or_else(|| self.inner.last_model.lock().unwrap().clone()).inspect(|m| *self.inner.last_model.lock().unwrap() = Some(m.clone()))
    }

    /// The live world's layout (page size, pages, head rank...).
    pub fn world_info(&self) -> Option<WorldInfo> {
        self.ready_info().ok()
    }

    pub fn metrics(&self) -> MetricsSnapshot {
        let mut s = MetricsSnapshot::from(&self.inner.metrics);
        s.rank_restarts = self.inner.world.restarts();
        let h = self.inner.world.health();
        s.world_size = h.len() as u64;
        s.ranks_ready = h.iter().filter(|r| r.state == "ready").count() as u64;
        s
    }

    /// Stops the ranks this engine started (attached ranks keep running).
    pub async fn shutdown(&self) {
        self.inner.world.shutdown().await;
    }
}

/// The batching loop: waits for a ready world, then plans steps, sends them to every rank and
/// applies the answers, until the world breaks (then fails everything and waits again). A
/// pipeline world keeps several steps of disjoint sequence groups in flight, applied in the
/// order they complete; a step the ranks refuse as a whole fails only its sequences.
async fn run(world: Arc<dyn RankWorld>, cfg: SchedConfig, mut cmd_rx: mpsc::UnboundedReceiver<Cmd>, metrics: Arc<Metrics>, queued: Arc<AtomicUsize>, dead: Arc<AtomicU64>) {
    let mut state = world.subscribe();
    let mut sched: Option<Scheduler> = None;
    let mut dead_generation = 0u64;
    // Submitted while the loop was still waiting for a world that is, in fact, ready.
    let mut early: Vec<Seq> = Vec::new();
    // Admission bookkeeping for the queue limit: `queued` counts submitted sequences that are
    // not yet running/finished; the loop recomputes it from the scheduler after every change.
    let sync_queue = |sched: &Scheduler, pending: usize| queued.store(sched.waiting() + pending, Ordering::SeqCst);
    'outer: loop {
        // Wait for a ready world newer than the one that broke.
        let info = loop {
            let ready = state.borrow_and_update().ready().filter(|i| i.generation > dead_generation).cloned();
            if let Some(i) = ready {
                break i;
            }
            tokio::select! {
                ch = state.changed() => if ch.is_err() { break 'outer; },
                cmd = cmd_rx.recv() => match cmd {
                    None => break 'outer,
                    Some(Cmd::Submit(seq)) => {
                        // (select! may see the command before the state change it raced with.)
                        let st = state.borrow().clone();
                        if st.ready().is_some_and(|i| i.generation > dead_generation) {
                            early.push(seq);
                        } else {
                            queued.fetch_sub(1, Ordering::SeqCst);
                            reject(seq, EngineError::NotReady(describe(&st, dead_generation)), &metrics);
                        }
                    }
                },
            }
        };
        let generation = info.generation;
        let head = info.head_rank as usize;
        let context = info.model.context_length as usize;
        let s = sched.get_or_insert_with(|| Scheduler::new(cfg.clone(), info.page_size as usize, info.n_pages as usize, context, metrics.clone()));
        s.reset_world(info.page_size as usize, info.n_pages as usize, context);
        tracing::info!(generation, pages = info.n_pages, page_size = info.page_size, context, "engine serving");
        for seq in early.drain(..) {
            submit(s, seq);
        }
        let depth = cfg.steps_in_flight(&info.parallelism, info.world_size as usize);
        let overlap = cfg.overlaps(info.world_size as usize);
        s.set_steps_in_flight(if overlap { 1 } else { depth });
        s.set_overlap(overlap);
        let late_rules = overlap && cfg.late_rules;
        s.set_late_rules(late_rules && info.late_forward);
        if late_rules && !info.late_forward {
            tracing::info!(generation, "late rules off: the rank waits for a structured output's rule before its forward (MINIMAX_LATE_FORWARD=0 on a CUDA rank)");
        }
        if overlap {
            tracing::info!(generation, "one-rank world: overlapped decode (the next step is sent while one computes)");
        } else if depth > 1 {
            tracing::info!(generation, steps = depth, "pipeline world: keeping several steps of disjoint sequence groups in flight");
        }
        // The steps sent and not answered yet, with their plans, answered in the order sent
        // (every rank computes them in that order; overlapped steps need their predecessor's
        // answer applied first).
        let mut inflight: FuturesOrdered<StepFuture> = FuturesOrdered::new();
        let mut last_sent = 0u64;
        // When the last answer arrived, while no other step was in flight (for `step_gap_us`).
        let mut idle_since: Option<Instant> = None;
        loop {
            // New requests.
            while let Ok(Cmd::Submit(seq)) = cmd_rx.try_recv() {
                submit(s, seq);
            }
            // A world change (restart, shutdown) ends this generation.
            {
                let st = state.borrow_and_update().clone();
                if !matches!(&st, WorldState::Ready(i) if i.generation == generation) {
                    dead_generation = generation;
                    dead.store(generation, Ordering::SeqCst);
                    inflight.clear();
                    metrics.steps_in_flight.store(0, Ordering::Relaxed);
                    s.fail_all(EngineError::RankFailure(st.describe()));
                    sync_queue(s, 0);
                    continue 'outer;
                }
            }
            s.reap_cancelled();
            release(&world, generation, s.take_releases());
            // Keep up to `depth` steps of disjoint sequence groups in flight (pipeline worlds;
            // one otherwise). A step sent while others are in flight follows the last one sent
            // (`after_step_id`), so every rank agrees on them in the order they were sent.
            while inflight.len() < depth {
                let Some(mut plan) = s.plan() else { break };
                plan.request.after_step_id = if inflight.is_empty() { 0 } else { last_sent };
                last_sent = plan.request.step_id;
                metrics.steps.fetch_add(1, Ordering::Relaxed);
                metrics.late_rules.fetch_add(plan.request.late_rules.len() as u64, Ordering::Relaxed);
                // (Overlapped entries feed one token the rank drew: not in `tokens`.)
                let tokens = plan.n_tokens();
                metrics.step_tokens.fetch_add(tokens as u64, Ordering::Relaxed);
                if let Some(t) = idle_since.take() {
                    metrics.step_gap_us.fetch_add(t.elapsed().as_micros() as u64, Ordering::Relaxed);
                }
                let w = world.clone();
                let req = plan.request.clone();
                inflight.push_back(Box::pin(async move {
                    let t = Instant::now();
                    let r = w.step(generation, req).await;
                    (plan, r, t.elapsed())
                }));
                metrics.steps_in_flight.store(inflight.len() as u64, Ordering::Relaxed);
                metrics.steps_in_flight_max.fetch_max(inflight.len() as u64, Ordering::Relaxed);
            }
            sync_queue(s, 0);
            release(&world, generation, s.take_releases());
            if inflight.is_empty() {
                idle_since = None;
                // Idle: wait for work or a world change. Waiting requests whose client left are
                // reaped on the next pass.
                tokio::select! {
                    cmd = cmd_rx.recv() => match cmd {
                        None => break 'outer,
                        Some(Cmd::Submit(seq)) => submit(s, seq),
                    },
                    _ = state.changed() => {}
                    _ = tokio::time::sleep(Duration::from_millis(100)), if !s.is_idle() => {}
                }
                continue;
            }
            // Wait for the first step to complete; with a free slot, new work may fill it
            // meanwhile (and clients that left are reaped every 100 ms).
            let (plan, result, wall) = tokio::select! {
                done = inflight.next() => done.expect("steps in flight"),
                cmd = cmd_rx.recv(), if inflight.len() < depth => {
                    match cmd {
                        None => break 'outer,
                        Some(Cmd::Submit(seq)) => submit(s, seq),
                    }
                    continue;
                }
                _ = tokio::time::sleep(Duration::from_millis(100)), if inflight.len() < depth => continue,
            };
            metrics.steps_in_flight.store(inflight.len() as u64, Ordering::Relaxed);
            metrics.step_wall_us.fetch_add(wall.as_micros() as u64, Ordering::Relaxed);
            if inflight.is_empty() {
                idle_since = Some(Instant::now());
            }
            match result {
                Ok(responses) => {
                    if let Some(r) = responses.iter().find(|r| r.rank as usize == head).or(responses.first()) {
                        metrics.step_rank_us.fetch_add((r.compute_ms.max(0.0) * 1e3) as u64, Ordering::Relaxed);
                    }
                    s.complete(plan, &responses, head);
                    sync_queue(s, 0);
                    release(&world, generation, s.take_releases());
                }
                Err(WorldError::Rejected(why)) => {
                    tracing::error!(generation, step = plan.request.step_id, error = %why, "step refused by the ranks; failing its sequences");
                    s.fail_plan(plan, EngineError::Internal(why));
                    sync_queue(s, 0);
                    release(&world, generation, s.take_releases());
                }
                Err(e) => {
                    let why = e.to_string();
                    tracing::error!(generation, error = %why, "step failed; failing in-flight requests");
                    dead_generation = generation;
                    dead.store(generation, Ordering::SeqCst);
                    world.report_broken(generation, why.clone());
                    inflight.clear();
                    metrics.steps_in_flight.store(0, Ordering::Relaxed);
                    s.fail_all(EngineError::RankFailure(format!("{why}; the ranks are being restarted, retry shortly")));
                    sync_queue(s, 0);
                    continue 'outer;
                }
            }
        }
    }
    // The engine stopped: fail whatever is left.
    if let Some(s) = sched.as_mut() {
        s.fail_all(EngineError::NotReady("the engine stopped".into()));
    }
    while let Ok(Cmd::Submit(seq)) = cmd_rx.try_recv() {
        reject(seq, EngineError::NotReady("the engine stopped".into()), &metrics);
    }
}

/// The world's state in words, knowing that generation `dead` broke.
fn describe(st: &WorldState, dead: u64) -> String {
    match st {
        WorldState::Ready(i) if i.generation <= dead => "the ranks are restarting after a failure".into(),
        other => other.describe(),
    }
}

fn submit(s: &mut Scheduler, seq: Seq) {
    if seq.max_tokens_is_zero() {
        s.finish_empty(seq);
    } else {
        s.submit(seq);
    }
}

fn reject(seq: Seq, err: EngineError, metrics: &Metrics) {
    metrics.failed.fetch_add(1, Ordering::Relaxed);
    seq.fail(err);
}

fn release(world: &Arc<dyn RankWorld>, generation: u64, ids: Vec<u64>) {
    if ids.is_empty() {
        return;
    }
    let world = world.clone();
    tokio::spawn(async move {
        if let Err(e) = world.release(generation, ids).await {
            tracing::debug!(error = %e, "release failed (the world is probably restarting)");
        }
    });
}

#[cfg(test)]
mod tests;
