//! An in-process rank world for tests: a deterministic toy "model" over a real paged KV store,
//! so tests of the scheduler, the engine loop and the HTTP layer run without rank processes.
//!
//! The logits of position `p` are a pseudo-random function of the tokens the KV pages hold at
//! positions `0..=p` (read through the step's page table), so reusing a wrong page, skipping a
//! write or mixing up sequences changes the output, exactly as with a real model. Rows are
//! reduced with the same `minimax_shared::sampling::reduce_row` the ranks use, and drawn with
//! the same `draw` (overlapped decode feeds a sequence's drawn token with `feed_drawn`).
//!
//! Faults: a rank reporting a wrong cache length for sequences that contain a given token
//! ([`FakeWorld::set_wrong_len_token`]), and a crash of the whole world
//! ([`FakeWorld::crash`]) that restarts after a delay as a new generation.

use std::collections::HashMap;
use std::sync::Mutex;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use minimax_proto::v1::{LateRule, LogitsMode, SeqResult, StepRequest, StepResponse};
use minimax_shared::sampling::reduce_row;
use tokio::sync::watch;

use super::{BoxFuture, ModelSummary, RankWorld, WorldError, WorldInfo, WorldState};
use crate::engine::RankHealth;

/// Shape of the fake world.
#[derive(Clone, Debug)]
pub struct FakeConfig {
    pub vocab: u32,
    pub page_size: u32,
    pub n_pages: u32,
    pub context: u32,
    pub world_size: u32,
    /// Simulated compute time of one step.
    pub step_delay: Duration,
    /// Time a crashed world takes to come back.
    pub restart_delay: Duration,
    /// `tensor` or `pipeline` (a pipeline world of several ranks gets several steps in flight).
    pub parallelism: &'static str,
}

impl Default for FakeConfig {
    fn default() -> Self {
        Self { vocab: 97, page_size: 4, n_pages: 64, context: 256, world_size: 2, step_delay: Duration::ZERO, restart_delay: Duration::from_millis(50), parallelism: "tensor" }
    }
}

struct State {
    generation: u64,
    /// Token held by each KV slot (page * page_size + offset).
    slots: Vec<Option<u32>>,
    /// Cache length of each sequence, per rank.
    lens: Vec<HashMap<u64, u32>>,
    /// The head's last drawn token of each sequence.
    draws: HashMap<u64, u32>,
    steps: u64,
    /// Steps executed (or refused), for the steps chained after them.
    executed: std::collections::HashSet<u64>,
    /// Late rules not taken yet, by (step, sequence).
    rules: HashMap<(u64, u64), LateRule>,
}

/// The fake world. Wrap it in an `Arc` and hand it to `Engine::with_world`.
pub struct FakeWorld {
    cfg: FakeConfig,
    state_tx: watch::Sender<WorldState>,
    st: Mutex<State>,
    restarts: AtomicU64,
    wrong_len_token: Mutex<Option<(u32, u32)>>,
    refuse_token: Mutex<Option<u32>>,
    released: Mutex<Vec<u64>>,
}

impl FakeWorld {
    /// A ready world (generation 1).
    pub fn new(cfg: FakeConfig) -> Self {
        let n = (cfg.n_pages * cfg.page_size) as usize;
        let st = State { generation: 1, slots: vec![None; n], lens: vec![HashMap::new(); cfg.world_size as usize], draws: HashMap::new(), steps: 0, executed: Default::default(), rules: HashMap::new() };
        let (state_tx, _) = watch::channel(WorldState::Ready(Self::info(&cfg, 1)));
        Self { cfg, state_tx, st: Mutex::new(st), restarts: AtomicU64::new(0), wrong_len_token: Mutex::new(None), refuse_token: Mutex::new(None), released: Mutex::new(vec![]) }
    }

    fn info(cfg: &FakeConfig, generation: u64) -> WorldInfo {
        WorldInfo {
            generation,
            world_size: cfg.world_size,
            page_size: cfg.page_size,
            n_pages: cfg.n_pages,
            head_rank: 0,
            parallelism: cfg.parallelism.into(),
            device: "fake".into(),
            model: ModelSummary { name: "fake".into(), architecture: "fake".into(), n_layers: 1, vocab_size: cfg.vocab, context_length: cfg.context },
            late_forward: true,
        }
    }

    /// From now on, rank `rank` reports cache length + 1 for every sequence whose step feeds
    /// `token`.
    pub fn set_wrong_len_token(&self, rank: u32, token: u32) {
        *self.wrong_len_token.lock().unwrap() = Some((rank, token));
    }

    /// From now on, the ranks refuse every step that feeds `token` as a whole
    /// (`WorldError::Rejected`, as a rank's INVALID_ARGUMENT), changing nothing.
    pub fn set_refuse_token(&self, token: u32) {
        *self.refuse_token.lock().unwrap() = Some(token);
    }

    /// Simulates a rank death: the world goes `Restarting`, in-flight steps fail, and after
    /// `restart_delay` a new generation with an empty cache is ready.
    pub fn crash(self: &std::sync::Arc<Self>, reason: &str) {
        self.state_tx.send_replace(WorldState::Restarting { reason: reason.into(), attempt: 1 });
        self.restarts.fetch_add(1, Ordering::Relaxed);
        let me = self.clone();
        tokio::spawn(async move {
            tokio::time::sleep(me.cfg.restart_delay).await;
            let generation = {
                let mut st = me.st.lock().unwrap();
                st.generation += 1;
                st.slots.iter_mut().for_each(|s| *s = None);
                st.lens.iter_mut().for_each(|l| l.clear());
                st.draws.clear();
                st.rules.clear();
                st.generation
            };
            me.state_tx.send_replace(WorldState::Ready(Self::info(&me.cfg, generation)));
        });
    }

    /// Steps executed so far.
    pub fn steps(&self) -> u64 {
        self.st.lock().unwrap().steps
    }

    /// Sequence ids released so far.
    pub fn released(&self) -> Vec<u64> {
        self.released.lock().unwrap().clone()
    }

    /// Sequences the ranks still remember.
    pub fn live_sequences(&self) -> usize {
        self.st.lock().unwrap().lens[0].len()
    }

    /// The toy model: raw logits of the next token after `prefix`.
    pub fn logits(&self, prefix: &[u32]) -> Vec<f32> {
        let mut h: u64 = 0x1234_5678_9abc_def1;
        for &t in prefix {
            h = splitmix(h ^ t as u64);
        }
        (0..self.cfg.vocab).map(|i| (splitmix(h ^ (i as u64) << 32) % 10_000) as f32 / 1000.0).collect()
    }

    /// Polls until `ready` holds (a world that never gets there is broken after 10 s).
    async fn wait_until(&self, ready: impl Fn(&State) -> bool, what: &str) -> Result<(), WorldError> {
        let deadline = std::time::Instant::now() + Duration::from_secs(10);
        while !ready(&self.st.lock().unwrap()) {
            if std::time::Instant::now() > deadline {
                return Err(WorldError::Broken(format!("fake world: {what} never came")));
            }
            tokio::time::sleep(Duration::from_millis(1)).await;
        }
        Ok(())
    }

    fn execute(&self, generation: u64, req: &StepRequest) -> Result<Vec<StepResponse>, WorldError> {
        let ps = self.cfg.page_size as usize;
        let mut st = self.st.lock().unwrap();
        st.executed.insert(req.step_id);
        if st.generation != generation || self.state_tx.borrow().ready().is_none() {
            return Err(WorldError::Broken(self.state_tx.borrow().describe()));
        }
        if let Some(t) = *self.refuse_token.lock().unwrap()
            && req.seqs.iter().any(|s| s.tokens.contains(&t))
        {
            return Err(WorldError::Rejected(format!("rank 0 refused the step: token {t}")));
        }
        st.steps += 1;
        let fault = *self.wrong_len_token.lock().unwrap();
        let w = self.cfg.world_size as usize;
        let mut out: Vec<StepResponse> = (0..w).map(|r| StepResponse { rank: r as u32, step_id: req.step_id, seqs: vec![], compute_ms: 0.0 }).collect();
        for s in &req.seqs {
            // Overlapped decode: the token drawn for this sequence in the step before.
            let mut s = s.clone();
            if s.feed_drawn {
                match st.draws.remove(&s.seq_id) {
                    Some(t) if s.tokens.is_empty() => {
                        s.tokens = vec![t];
                        if let Some(sp) = s.sampling.as_mut() {
                            minimax_proto::v1::count_in_history(sp, t);
                        }
                    }
                    _ => {
                        for resp in out.iter_mut() {
                            resp.seqs.push(SeqResult { seq_id: s.seq_id, cache_len: 0, error: "no drawn token to feed".into(), rows: vec![] });
                        }
                        continue;
                    }
                }
            }
            let s = &s;
            let known = st.lens[0].get(&s.seq_id).copied();
            let have = match known {
                Some(l) => l,
                None if s.adopt_prefix => s.expected_cache_len,
                None => 0,
            };
            let mut err = String::new();
            if have != s.expected_cache_len {
                err = format!("cache length mismatch: have {have}, expected {}", s.expected_cache_len);
            }
            let need = s.expected_cache_len as usize + s.tokens.len();
            if err.is_empty() && s.page_table.len() < need.div_ceil(ps) {
                err = format!("page table too short for {need} positions");
            }
            let mut rows = Vec::new();
            if err.is_empty() {
                for (i, &t) in s.tokens.iter().enumerate() {
                    let pos = s.expected_cache_len as usize + i;
                    let slot = s.page_table[pos / ps] as usize * ps + pos % ps;
                    st.slots[slot] = Some(t);
                }
                let mode = LogitsMode::try_from(s.logits).unwrap_or(LogitsMode::None);
                let wanted: Vec<usize> = match mode {
                    LogitsMode::None => vec![],
                    LogitsMode::Last => vec![s.tokens.len() - 1],
                    LogitsMode::All => (0..s.tokens.len()).collect(),
                };
                for i in wanted {
                    let pos = s.expected_cache_len as usize + i;
                    let prefix: Vec<u32> = (0..=pos).map(|p| st.slots[s.page_table[p / ps] as usize * ps + p % ps].unwrap_or(u32::MAX)).collect();
                    let raw = self.logits(&prefix);
                    let spec = minimax_proto::v1::sampling_spec(s.sampling.as_ref());
                    let target = (mode == LogitsMode::All).then(|| s.score_targets[i]);
                    let red = reduce_row(&raw, &spec, target).map_err(|e| WorldError::Broken(format!("fake reduce: {e}")))?;
                    let mut row = minimax_proto::v1::row_output(pos as u32, red);
                    if let Some(u) = s.sampling.as_ref().and_then(|sp| sp.draw)
                        && mode == LogitsMode::Last
                    {
                        let t = minimax_proto::v1::draw_row(&mut row, spec.temperature, u).map_err(|e| WorldError::Broken(format!("fake draw: {e}")))?;
                        st.draws.insert(s.seq_id, t);
                    }
                    rows.push(row);
                }
            }
            for (r, resp) in out.iter_mut().enumerate() {
                let mut len = if err.is_empty() { need as u32 } else { have };
                if let Some((fr, ft)) = fault
                    && fr as usize == r
                    && s.tokens.contains(&ft)
                {
                    len += 1;
                }
                if err.is_empty() {
                    st.lens[r].insert(s.seq_id, len);
                }
                resp.seqs.push(SeqResult { seq_id: s.seq_id, cache_len: len, error: err.clone(), rows: if r == 0 { rows.clone() } else { vec![] } });
            }
        }
        Ok(out)
    }
}

fn splitmix(mut z: u64) -> u64 {
    z = z.wrapping_add(0x9e37_79b9_7f4a_7c15);
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^ (z >> 31)
}

impl RankWorld for FakeWorld {
    fn step(&self, generation: u64, req: StepRequest) -> BoxFuture<'_, Result<Vec<StepResponse>, WorldError>> {
        Box::pin(async move {
            let mut req = req;
            // As a rank does: rules for earlier steps' rows first; a chained step runs after
            // the one it follows; rows whose rule follows wait for it.
            self.st.lock().unwrap().rules.extend(req.late_rules.iter().map(|r| ((r.step_id, r.seq_id), r.clone())));
            let after = req.after_step_id;
            self.wait_until(|st| after == 0 || st.executed.contains(&after), "the step it follows").await?;
            if !self.cfg.step_delay.is_zero() {
                tokio::time::sleep(self.cfg.step_delay).await;
            }
            let waiting: Vec<u64> = req.seqs.iter().filter(|s| s.sampling.as_ref().is_some_and(|sp| sp.rule_follows)).map(|s| s.seq_id).collect();
            let step_id = req.step_id;
            self.wait_until(|st| waiting.iter().all(|&q| st.rules.contains_key(&(step_id, q))), "a late rule").await?;
            {
                let mut st = self.st.lock().unwrap();
                for s in req.seqs.iter_mut() {
                    if let Some(sp) = s.sampling.as_mut().filter(|sp| sp.rule_follows) {
                        let r = st.rules.remove(&(step_id, s.seq_id)).expect("waited for above");
                        minimax_proto::v1::apply_late_rule(sp, r);
                    }
                }
            }
            self.execute(generation, &req)
        })
    }

    fn release(&self, _generation: u64, seq_ids: Vec<u64>) -> BoxFuture<'_, Result<(), WorldError>> {
        Box::pin(async move {
            let mut st = self.st.lock().unwrap();
            for id in &seq_ids {
                for l in st.lens.iter_mut() {
                    l.remove(id);
                }
                st.draws.remove(id);
            }
            self.released.lock().unwrap().extend(seq_ids);
            Ok(())
        })
    }

    fn subscribe(&self) -> watch::Receiver<WorldState> {
        self.state_tx.subscribe()
    }

    fn report_broken(&self, _generation: u64, _reason: String) {}

    fn health(&self) -> Vec<RankHealth> {
        let state = match &*self.state_tx.borrow() {
            WorldState::Ready(_) => "ready",
            WorldState::Restarting { .. } => "restarting",
            WorldState::Starting => "loading",
            WorldState::Failed(_) => "failed",
        };
        (0..self.cfg.world_size).map(|rank| RankHealth { rank, state: state.into(), progress: 1.0, detail: String::new() }).collect()
    }

    fn restarts(&self) -> u64 {
        self.restarts.load(Ordering::Relaxed)
    }

    fn shutdown(&self) -> BoxFuture<'_, ()> {
        Box::pin(async move {
            self.state_tx.send_replace(WorldState::Failed("shut down".into()));
        })
    }
}
