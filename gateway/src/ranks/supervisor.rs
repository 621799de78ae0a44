//! The supervisor: brings a rank world up (spawning `minimax-rank serve` children, or attaching
//! to ranks systemd runs), sets up the collective, watches the ranks, and when one fails
//! tears the whole world down (one NCCL failure domain) and starts it again with backoff.
//!
//! Bring-up, every (re)start:
//! 1. spawn mode: start one child per rank (`minimax-rank serve --rank N ...`, unix socket in
//!    the run dir, killed with the gateway via `PR_SET_PDEATHSIG`);
//! 2. connect (retrying until the socket answers) and poll `Describe` until every rank is
//!    LOADED (health shows loading progress meanwhile); check protocol version, world size
//!    and rank numbers;
//! 3. collective: `CREATE` on rank 0 → unique id; `JOIN` on every rank concurrently with the
//!    unique id and, for CPU ranks, the test transport's peer addresses (configured, or free
//!    loopback ports picked here); every rank's self-test sum must be W(W+1)/2;
//! 4. `Describe` again: all READY, same page size; the world serves `min(n_pages)` pages.
//!
//! Watching: a child's exit (spawn mode), a step failure the engine reports, a rank reporting
//! FAILED or no longer READY (attach mode: systemd restarted it), or three health polls in a
//! row without an answer → the generation is broken: state `Restarting`, `Shutdown` to every
//! rank, children killed and reaped, backoff (doubling, capped), bring-up again.

use std::path::PathBuf;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, RwLock};
use std::time::{Duration, Instant};

use minimax_proto::v1::collective_request::Phase;
use minimax_proto::v1::rank_client::RankClient;
use minimax_proto::v1::{CollectiveRequest, DescribeRequest, DescribeResponse, RankState, ReleaseRequest, ShutdownRequest, StepRequest, StepResponse};
use tokio::sync::{mpsc, oneshot, watch};
use tokio::task::JoinHandle;
use tonic::transport::Channel;

use super::client::{RankAddr, connect};
use super::{BoxFuture, ModelSummary, RankWorld, WorldError, WorldInfo, WorldState};
use crate::engine::RankHealth;

/// How the gateway gets its ranks.
#[derive(Clone, Debug)]
pub enum WorldMode {
    /// Start `minimax-rank serve` children.
    Spawn(SpawnConfig),
    /// Ranks run elsewhere (systemd units); connect to them.
    Attach { addrs: Vec<RankAddr> },
}

/// Spawned local ranks.
#[derive(Clone, Debug)]
pub struct SpawnConfig {
    pub rank_binary: PathBuf,
    pub model: PathBuf,
    /// BENCHMARK ONLY: ranks serve this synthetic model (`--synthetic SPEC
    /// --allow-synthetic`) instead of `model`.
    pub synthetic: Option<String>,
    /// One device per rank: `cpu` or `cuda:K`.
    pub devices: Vec<String>,
    /// `tensor` or `pipeline`.
    pub parallelism: String,
    pub page_size: u32,
    /// KV pages per rank (None: the rank's default).
    pub kv_pages: Option<u32>,
    /// Where the unix sockets live (created 0700).
    pub run_dir: PathBuf,
    /// Extra arguments for every rank.
    pub extra_args: Vec<String>,
    /// Extra arguments for one rank (tests: fault hooks).
    pub rank_args: Vec<(u32, Vec<String>)>,
    /// Extra environment for every rank.
    pub env: Vec<(String, String)>,
}

/// Supervisor settings.
#[derive(Clone, Debug)]
pub struct WorldConfig {
    pub mode: WorldMode,
    /// Test-transport addresses by rank (CPU ranks); empty: free loopback ports are picked.
    pub peer_addrs: Vec<String>,
    /// Bound on the whole load (connect + LOADED) of a (re)start.
    pub load_timeout: Duration,
    /// Bound on collective setup.
    pub collective_timeout: Duration,
    /// Bound on one step on every rank.
    pub step_timeout: Duration,
    /// How often ranks are polled.
    pub health_interval: Duration,
    pub restart_backoff_initial: Duration,
    pub restart_backoff_max: Duration,
    /// Consecutive failed (re)starts before giving up (0: never give up).
    pub max_restart_attempts: u32,
}

impl WorldConfig {
    pub fn new(mode: WorldMode) -> Self {
        Self {
            mode,
            peer_addrs: Vec::new(),
            load_timeout: Duration::from_secs(900),
            collective_timeout: Duration::from_secs(120),
            step_timeout: Duration::from_secs(300),
            health_interval: Duration::from_secs(1),
            restart_backoff_initial: Duration::from_millis(500),
            restart_backoff_max: Duration::from_secs(30),
            max_restart_attempts: 0,
        }
    }

    fn world_size(&self) -> usize {
        match &self.mode {
            WorldMode::Spawn(s) => s.devices.len(),
            WorldMode::Attach { addrs } => addrs.len(),
        }
    }
}

/// The live generation's clients.
#[derive(Clone)]
struct Live {
    generation: u64,
    clients: Vec<RankClient<Channel>>,
}

struct Inner {
    cfg: WorldConfig,
    state: watch::Sender<WorldState>,
    live: RwLock<Option<Live>>,
    health: Mutex<Vec<RankHealth>>,
    restarts: AtomicU64,
    generation: AtomicU64,
    broken_tx: mpsc::UnboundedSender<(u64, String)>,
    stop_tx: watch::Sender<bool>,
    task: Mutex<Option<JoinHandle<()>>>,
    last_reason: Mutex<String>,
}

/// The real rank world. Cheap to clone.
#[derive(Clone)]
pub struct Supervisor {
    inner: Arc<Inner>,
}

/// A spawned child and the way to kill it.
struct ChildHandle {
    rank: u32,
    pid: u32,
    kill: Option<oneshot::Sender<()>>,
    exit: oneshot::Receiver<String>,
    done: JoinHandle<()>,
}

/// What one bring-up produced.
struct Up {
    children: Vec<ChildHandle>,
    clients: Vec<RankClient<Channel>>,
    info: WorldInfo,
}

impl Supervisor {
    /// Starts supervising (the first bring-up runs in the background; watch
    /// [`RankWorld::subscribe`] for `Ready`). Must be called inside a tokio runtime.
    pub fn start(cfg: WorldConfig) -> Self {
        let n = cfg.world_size();
        let (state, _) = watch::channel(WorldState::Starting);
        let (broken_tx, broken_rx) = mpsc::unbounded_channel();
        let (stop_tx, _) = watch::channel(false);
        let health = (0..n as u32).map(|rank| RankHealth { rank, state: "starting".into(), progress: 0.0, detail: String::new() }).collect();
        let inner = Arc::new(Inner {
            cfg,
            state,
            live: RwLock::new(None),
            health: Mutex::new(health),
            restarts: AtomicU64::new(0),
            generation: AtomicU64::new(0),
            broken_tx,
            stop_tx,
            task: Mutex::new(None),
            last_reason: Mutex::new(String::new()),
        });
        let task = tokio::spawn(supervise(inner.clone(), broken_rx));
        *inner.task.lock().unwrap() = Some(task);
        Self { inner }
    }

    fn live(&self, generation: u64) -> Result<Vec<RankClient<Channel>>, WorldError> {
        match &*self.inner.live.read().unwrap() {
            Some(l) if l.generation == generation => Ok(l.clients.clone()),
            _ => Err(WorldError::Broken(format!("rank world generation {generation} is gone ({})", self.inner.state.borrow().describe()))),
        }
    }
}

impl RankWorld for Supervisor {
    fn step(&self, generation: u64, req: StepRequest) -> BoxFuture<'_, Result<Vec<StepResponse>, WorldError>> {
        Box::pin(async move {
            let clients = self.live(generation)?;
            let timeout = self.inner.cfg.step_timeout;
            // Every rank's call polled in this task (not a spawned task per rank): a step is on
            // the decode loop's critical path, and each task hand-over costs a thread wake-up.
            let n = clients.len();
            let mut calls: futures_util::stream::FuturesUnordered<_> = clients
                .into_iter()
                .enumerate()
                .map(|(r, mut c)| {
                    let req = req.clone();
                    async move { (r, tokio::time::timeout(timeout, c.step(req)).await) }
                })
                .collect();
            let mut out: Vec<Option<StepResponse>> = vec![None; n];
            let mut state = self.inner.state.subscribe();
            let gathered = async {
                use futures_util::StreamExt;
                while let Some((r, res)) = calls.next().await {
                    match res {
                        Err(_) => return Err(WorldError::Broken(format!("rank {r} did not answer step within {timeout:?}"))),
                        Ok(Err(status)) if status.code() == tonic::Code::InvalidArgument => return Err(WorldError::Rejected(format!("rank {r} refused the step: {}", status.message()))),
                        Ok(Err(status)) => return Err(WorldError::Broken(format!("rank {r} step failed: {}", status.message()))),
                        Ok(Ok(resp)) => out[r] = Some(resp.into_inner()),
                    }
                }
                Ok(())
            };
            // Abort as soon as the supervisor declares this generation gone (a rank died).
            let gone = async {
                loop {
                    if !matches!(&*state.borrow_and_update(), WorldState::Ready(i) if i.generation == generation) {
                        return state.borrow().describe();
                    }
                    if state.changed().await.is_err() {
                        return "supervisor stopped".to_string();
                    }
                }
            };
            tokio::select! {
                r = gathered => r?,
                why = gone => return Err(WorldError::Broken(why)),
            }
            Ok(out.into_iter().map(|o| o.expect("every rank answered")).collect())
        })
    }

    fn release(&self, generation: u64, seq_ids: Vec<u64>) -> BoxFuture<'_, Result<(), WorldError>> {
        Box::pin(async move {
            let clients = self.live(generation)?;
            let mut set = tokio::task::JoinSet::new();
            for (r, mut c) in clients.into_iter().enumerate() {
                let req = ReleaseRequest { seq_ids: seq_ids.clone(), keep_len: 0, truncate: false };
                set.spawn(async move { (r, tokio::time::timeout(Duration::from_secs(10), c.release(req)).await) });
            }
            let mut err = None;
            while let Some(j) = set.join_next().await {
                if let Ok((r, res)) = j {
                    match res {
                        Err(_) => err = Some(format!("rank {r}: release timed out")),
                        Ok(Err(s)) => err = Some(format!("rank {r}: release failed: {}", s.message())),
                        Ok(Ok(_)) => {}
                    }
                }
            }
            match err {
                Some(e) => Err(WorldError::Broken(e)),
                None => Ok(()),
            }
        })
    }

    fn subscribe(&self) -> watch::Receiver<WorldState> {
        self.inner.state.subscribe()
    }

    fn report_broken(&self, generation: u64, reason: String) {
        let _ = self.inner.broken_tx.send((generation, reason));
    }

    fn health(&self) -> Vec<RankHealth> {
        self.inner.health.lock().unwrap().clone()
    }

    fn restarts(&self) -> u64 {
        self.inner.restarts.load(Ordering::Relaxed)
    }

    fn shutdown(&self) -> BoxFuture<'_, ()> {
        Box::pin(async move {
            let _ = self.inner.stop_tx.send(true);
            let task = self.inner.task.lock().unwrap().take();
            if let Some(t) = task {
                let _ = tokio::time::timeout(Duration::from_secs(20), t).await;
            }
        })
    }
}

fn set_health(inner: &Inner, rank: usize, state: &str, progress: f32, detail: impl Into<String>) {
    let mut h = inner.health.lock().unwrap();
    if let Some(e) = h.get_mut(rank) {
        e.state = state.to_string();
        e.progress = progress;
        e.detail = detail.into();
    }
}

fn set_all_health(inner: &Inner, state: &str, detail: &str) {
    let n = inner.health.lock().unwrap().len();
    for r in 0..n {
        set_health(inner, r, state, 0.0, detail);
    }
}

async fn supervise(inner: Arc<Inner>, mut broken_rx: mpsc::UnboundedReceiver<(u64, String)>) {
    let mut stop = inner.stop_tx.subscribe();
    let mut backoff = inner.cfg.restart_backoff_initial;
    let mut failed_attempts = 0u32;
    let mut first = true;
    // When the serving world last broke (recovery time: broken → ready again).
    let mut broken_at: Option<Instant> = None;
    loop {
        if *stop.borrow() {
            break;
        }
        let attempt = failed_attempts + 1;
        if !first {
            inner.state.send_replace(WorldState::Restarting { reason: last_reason_or(&inner), attempt });
        }
        let up = tokio::select! {
            r = bring_up(&inner) => r,
            _ = stop.changed() => break,
        };
        let reason = match up {
            Ok(mut up) => {
                let generation = inner.generation.fetch_add(1, Ordering::SeqCst) + 1;
                up.info.generation = generation;
                *inner.live.write().unwrap() = Some(Live { generation, clients: up.clients.clone() });
                tracing::info!(generation, world_size = up.info.world_size, n_pages = up.info.n_pages, page_size = up.info.page_size, "rank world ready");
                if let Some(t) = broken_at.take() {
                    tracing::warn!(generation, "rank world recovered {:.2} s after it broke", t.elapsed().as_secs_f64());
                }
                inner.state.send_replace(WorldState::Ready(up.info.clone()));
                let since = Instant::now();
                let (reason, stopping) = watch_world(&inner, &mut up, generation, &mut broken_rx, &mut stop).await;
                *inner.live.write().unwrap() = None;
                if stopping {
                    inner.state.send_replace(WorldState::Failed("shut down".into()));
                    teardown(&inner, up.children, &up.clients, true).await;
                    set_all_health(&inner, "stopped", "the gateway is shutting down");
                    remove_run_dir(&inner.cfg);
                    return;
                }
                tracing::error!(generation, %reason, "rank world broken; restarting every rank");
                let t_broken = Instant::now();
                broken_at = Some(t_broken);
                inner.restarts.fetch_add(1, Ordering::Relaxed);
                inner.state.send_replace(WorldState::Restarting { reason: reason.clone(), attempt: 1 });
                set_all_health(&inner, "restarting", &reason);
                teardown(&inner, up.children, &up.clients, false).await;
                tracing::info!(generation, "old world torn down in {:.2} s", t_broken.elapsed().as_secs_f64());
                if since.elapsed() > Duration::from_secs(60) {
                    backoff = inner.cfg.restart_backoff_initial;
                }
                failed_attempts = 0;
                reason
            }
            Err((reason, children, clients)) => {
                tracing::error!(%reason, "rank world failed to start");
                teardown(&inner, children, &clients, false).await;
                failed_attempts += 1;
                reason
            }
        };
        first = false;
        *inner.last_reason.lock().unwrap() = reason.clone();
        let max = inner.cfg.max_restart_attempts;
        if max > 0 && failed_attempts >= max {
            let msg = format!("gave up after {failed_attempts} failed starts; last error: {reason}");
            tracing::error!("{msg}");
            set_all_health(&inner, "failed", &msg);
            inner.state.send_replace(WorldState::Failed(msg));
            remove_run_dir(&inner.cfg);
            return;
        }
        inner.state.send_replace(WorldState::Restarting { reason: reason.clone(), attempt: failed_attempts + 1 });
        tokio::select! {
            _ = tokio::time::sleep(backoff) => {}
            _ = stop.changed() => break,
        }
        backoff = (backoff * 2).min(inner.cfg.restart_backoff_max);
    }
    inner.state.send_replace(WorldState::Failed("shut down".into()));
    remove_run_dir(&inner.cfg);
}

/// Removes the sockets (and the directory, when empty) of spawned ranks.
fn remove_run_dir(cfg: &WorldConfig) {
    if let WorldMode::Spawn(s) = &cfg.mode {
        let _ = prepare_run_dir_cleanup(&s.run_dir);
    }
}

fn prepare_run_dir_cleanup(dir: &std::path::Path) -> std::io::Result<()> {
    for e in std::fs::read_dir(dir)?.flatten() {
        if e.path().extension().is_some_and(|x| x == "sock") {
            let _ = std::fs::remove_file(e.path());
        }
    }
    std::fs::remove_dir(dir)
}

fn last_reason_or(inner: &Inner) -> String {
    let r = inner.last_reason.lock().unwrap().clone();
    if r.is_empty() { "restart".into() } else { r }
}

type BringUpError = (String, Vec<ChildHandle>, Vec<RankClient<Channel>>);

async fn bring_up(inner: &Arc<Inner>) -> Result<Up, BringUpError> {
    let cfg = &inner.cfg;
    let n = cfg.world_size();
    let mut children = Vec::new();
    let addrs: Vec<RankAddr> = match &cfg.mode {
        WorldMode::Spawn(s) => {
            if let Err(e) = prepare_run_dir(&s.run_dir) {
                return Err((e, children, vec![]));
            }
            let addrs: Vec<RankAddr> = (0..n).map(|r| RankAddr::Unix(s.run_dir.join(format!("rank-{r}.sock")))).collect();
            for (r, addr) in addrs.iter().enumerate() {
                match spawn_rank(s, r as u32, n as u32, addr) {
                    Ok(c) => children.push(c),
                    Err(e) => return Err((e, children, vec![])),
                }
            }
            addrs
        }
        WorldMode::Attach { addrs } => addrs.clone(),
    };
    for (r, addr) in addrs.iter().enumerate() {
        set_health(inner, r, "loading", 0.0, format!("connecting to {addr}"));
    }
    let deadline = Instant::now() + cfg.load_timeout;

    // Connect (the socket appears once the rank listens).
    let mut clients = Vec::with_capacity(n);
    for (r, addr) in addrs.iter().enumerate() {
        loop {
            if let Some(e) = child_exited(&mut children) {
                return Err((e, children, clients));
            }
            match connect(addr, Duration::from_secs(2)).await {
                Ok(c) => {
                    clients.push(c);
                    break;
                }
                Err(e) if Instant::now() >= deadline => return Err((format!("rank {r}: {e}"), children, clients)),
                Err(_) => tokio::time::sleep(Duration::from_millis(100)).await,
            }
        }
    }

    // Wait for every rank to be LOADED (or already READY: attached ranks of an earlier gateway).
    let descs = loop {
        if let Some(e) = child_exited(&mut children) {
            return Err((e, children, clients));
        }
        let mut descs = Vec::with_capacity(n);
        let mut all_loaded = true;
        for (r, c) in clients.iter_mut().enumerate() {
            match describe(c).await {
                Ok(d) => {
                    let st = RankState::try_from(d.state).unwrap_or(RankState::Unspecified);
                    match st {
                        RankState::Failed => return Err((format!("rank {r} failed to load: {}", d.error), children, clients)),
                        RankState::Loaded | RankState::Ready => set_health(inner, r, "loaded", 1.0, ""),
                        _ => {
                            all_loaded = false;
                            set_health(inner, r, "loading", d.load_progress, format!("loading {:.0}%", d.load_progress * 100.0));
                        }
                    }
                    descs.push(Some(d));
                }
                Err(e) => {
                    all_loaded = false;
                    set_health(inner, r, "loading", 0.0, e);
                    descs.push(None);
                }
            }
        }
        if all_loaded {
            break descs.into_iter().map(|d| d.unwrap()).collect::<Vec<_>>();
        }
        if Instant::now() >= deadline {
            return Err((format!("ranks did not load within {:?}", cfg.load_timeout), children, clients));
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    };
    if let Err(e) = check_world(&descs, n) {
        return Err((e, children, clients));
    }

    // Collective (ranks already READY, e.g. attached ones of an earlier gateway, re-JOIN).
    if let Err(e) = collective(inner, &mut clients, &descs).await {
        return Err((e, children, clients));
    }

    // Final state.
    let mut finals = Vec::with_capacity(n);
    for (r, c) in clients.iter_mut().enumerate() {
        match describe(c).await {
            Ok(d) if d.state == RankState::Ready as i32 => finals.push(d),
            Ok(d) => return Err((format!("rank {r} is not READY after the collective (state {}, {})", d.state, d.error), children, clients)),
            Err(e) => return Err((format!("rank {r}: {e}"), children, clients)),
        }
    }
    let info = match world_info(&finals) {
        Ok(i) => i,
        Err(e) => return Err((e, children, clients)),
    };
    for (r, d) in finals.iter().enumerate() {
        set_health(inner, r, "ready", 1.0, format!("{} {}", d.device, layer_range(d)));
    }
    Ok(Up { children, clients, info })
}

fn layer_range(d: &DescribeResponse) -> String {
    format!("layers {}..{}", d.first_layer, d.end_layer)
}

async fn describe(c: &mut RankClient<Channel>) -> Result<DescribeResponse, String> {
    match tokio::time::timeout(Duration::from_secs(5), c.describe(DescribeRequest {})).await {
        Err(_) => Err("describe timed out".into()),
        Ok(Err(s)) => Err(format!("describe failed: {}", s.message())),
        Ok(Ok(r)) => Ok(r.into_inner()),
    }
}

fn check_world(descs: &[DescribeResponse], n: usize) -> Result<(), String> {
    for (r, d) in descs.iter().enumerate() {
        if d.protocol_version != minimax_proto::v1::PROTOCOL_VERSION {
            return Err(format!("rank {r} speaks protocol {}, the gateway {}", d.protocol_version, minimax_proto::v1::PROTOCOL_VERSION));
        }
        if d.world_size as usize != n || d.rank as usize != r {
            return Err(format!("address #{r} is rank {} of a world of {}, expected rank {r} of {n}", d.rank, d.world_size));
        }
    }
    Ok(())
}

fn world_info(descs: &[DescribeResponse]) -> Result<WorldInfo, String> {
    let d0 = &descs[0];
    if descs.iter().any(|d| d.page_size != d0.page_size) {
        return Err(format!("ranks disagree on the KV page size: {:?}", descs.iter().map(|d| d.page_size).collect::<Vec<_>>()));
    }
    if d0.page_size == 0 {
        return Err("ranks report a KV page size of 0".into());
    }
    let n_pages = descs.iter().map(|d| d.n_pages).min().unwrap_or(0);
    if n_pages == 0 {
        return Err("ranks report no KV pages".into());
    }
    let head_rank = descs.iter().position(|d| d.head).ok_or("no rank reports the head (row outputs)")? as u32;
    let m = descs[head_rank as usize].model.clone().unwrap_or_default();
    Ok(WorldInfo {
        generation: 0,
        world_size: descs.len() as u32,
        page_size: d0.page_size,
        n_pages,
        head_rank,
        parallelism: d0.parallelism.clone(),
        device: descs.iter().map(|d| d.device.clone()).collect::<Vec<_>>().join(", "),
        model: ModelSummary { name: m.name, architecture: m.architecture, n_layers: m.n_layers, vocab_size: m.vocab_size, context_length: m.context_length },
        late_forward: descs.iter().all(|d| d.late_forward),
    })
}

async fn collective(inner: &Arc<Inner>, clients: &mut [RankClient<Channel>], _descs: &[DescribeResponse]) -> Result<(), String> {
    let cfg = &inner.cfg;
    let n = clients.len();
    let timeout = cfg.collective_timeout;
    let timeout_ms = timeout.as_millis().min(u32::MAX as u128) as u32;
    let peer_addrs = if !cfg.peer_addrs.is_empty() {
        if cfg.peer_addrs.len() != n {
            return Err(format!("{} peer addresses for {n} ranks", cfg.peer_addrs.len()));
        }
        cfg.peer_addrs.clone()
    } else if n > 1 {
        // Ranks on this host (spawned, unix sockets, or loopback TCP): free loopback ports.
        // Ranks on several hosts need --peer-addrs.
        free_loopback_addrs(n)?
    } else {
        Vec::new()
    };
    let create = CollectiveRequest { phase: Phase::Create as i32, unique_id: vec![], peer_addrs: peer_addrs.clone(), timeout_ms };
    let unique_id = match tokio::time::timeout(timeout, clients[0].collective(create)).await {
        Err(_) => return Err("collective CREATE on rank 0 timed out".into()),
        Ok(Err(s)) => return Err(format!("collective CREATE on rank 0 failed: {}", s.message())),
        Ok(Ok(r)) => r.into_inner().unique_id,
    };
    let mut set = tokio::task::JoinSet::new();
    for (r, c) in clients.iter().enumerate() {
        let mut c = c.clone();
        let req = CollectiveRequest { phase: Phase::Join as i32, unique_id: unique_id.clone(), peer_addrs: peer_addrs.clone(), timeout_ms };
        set.spawn(async move { (r, tokio::time::timeout(timeout + Duration::from_secs(5), c.collective(req)).await) });
    }
    let expected = (n * (n + 1) / 2) as f32;
    let mut first_err = None;
    while let Some(j) = set.join_next().await {
        let (r, res) = j.map_err(|e| e.to_string())?;
        let msg = match res {
            Err(_) => Some(format!("rank {r}: collective JOIN timed out")),
            Ok(Err(s)) => Some(format!("rank {r}: collective JOIN failed: {}", s.message())),
            Ok(Ok(resp)) => {
                let sum = resp.into_inner().self_test_sum;
                if (sum - expected).abs() > 1e-3 {
                    Some(format!("rank {r}: collective self-test sum {sum}, expected {expected}"))
                } else {
                    set_health(inner, r, "loaded", 1.0, "collective joined");
                    None
                }
            }
        };
        if let Some(m) = msg
            && first_err.is_none()
        {
            first_err = Some(m);
        }
    }
    match first_err {
        Some(e) => Err(e),
        None => Ok(()),
    }
}

/// Picks `n` free loopback TCP addresses for the CPU test transport.
fn free_loopback_addrs(n: usize) -> Result<Vec<String>, String> {
    let listeners: Vec<std::net::TcpListener> = (0..n).map(|_| std::net::TcpListener::bind("127.0.0.1:0")).collect::<Result<_, _>>().map_err(|e| format!("picking loopback ports: {e}"))?;
    listeners.iter().map(|l| l.local_addr().map(|a| a.to_string()).map_err(|e| e.to_string())).collect()
}

fn prepare_run_dir(dir: &std::path::Path) -> Result<(), String> {
    use std::os::unix::fs::PermissionsExt;
    std::fs::create_dir_all(dir).map_err(|e| format!("creating run dir {}: {e}", dir.display()))?;
    let _ = std::fs::set_permissions(dir, std::fs::Permissions::from_mode(0o700));
    if let Ok(rd) = std::fs::read_dir(dir) {
        for e in rd.flatten() {
            let p = e.path();
            if p.extension().is_some_and(|x| x == "sock") {
                let _ = std::fs::remove_file(p);
            }
        }
    }
    Ok(())
}

fn spawn_rank(s: &SpawnConfig, rank: u32, world: u32, addr: &RankAddr) -> Result<ChildHandle, String> {
    let mut cmd = tokio::process::Command::new(&s.rank_binary);
    cmd.arg("serve")
        .arg("--rank")
        .arg(rank.to_string())
        .arg("--world-size")
        .arg(world.to_string())
        .arg("--listen")
        .arg(addr.to_listen())
        .arg("--device")
        .arg(&s.devices[rank as usize])
        .arg("--parallelism")
        .arg(&s.parallelism)
        .arg("--page-size")
        .arg(s.page_size.to_string());
    if let Some(p) = s.kv_pages {
        cmd.arg("--kv-pages").arg(p.to_string());
    }
    match &s.synthetic {
        Some(spec) => cmd.arg("--synthetic").arg(spec).arg("--allow-synthetic"),
        None => cmd.arg("--model").arg(&s.model),
    };
    cmd.args(&s.extra_args);
    for (r, args) in &s.rank_args {
        if *r == rank {
            cmd.args(args);
        }
    }
    // The gateway's environment is inherited (NCCL_SOCKET_IFNAME, NCCL_P2P_DISABLE,
    // NCCL_DEBUG, CUDA_VISIBLE_DEVICES, RUST_LOG, ...); `env` adds to it.
    for (k, v) in &s.env {
        cmd.env(k, v);
    }
    cmd.stdin(std::process::Stdio::null()).kill_on_drop(true);
    // Ranks die with the gateway, whatever kills it.
    unsafe {
        cmd.pre_exec(|| {
            libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGKILL);
            Ok(())
        });
    }
    let mut child = cmd.spawn().map_err(|e| format!("starting {} for rank {rank}: {e}", s.rank_binary.display()))?;
    let pid = child.id().unwrap_or(0);
    tracing::info!(rank, pid, binary = %s.rank_binary.display(), "started rank");
    let (kill_tx, kill_rx) = oneshot::channel::<()>();
    let (exit_tx, exit_rx) = oneshot::channel::<String>();
    let done = tokio::spawn(async move {
        tokio::select! {
            st = child.wait() => {
                let msg = match st {
                    Ok(st) => describe_exit(st),
                    Err(e) => format!("wait failed: {e}"),
                };
                let _ = exit_tx.send(msg);
            }
            _ = kill_rx => {
                // Ask nicely first (the rank may be mid-Shutdown), then insist.
                unsafe { libc::kill(pid as i32, libc::SIGTERM); }
                if tokio::time::timeout(Duration::from_secs(3), child.wait()).await.is_err() {
                    let _ = child.start_kill();
                    let _ = child.wait().await;
                }
            }
        }
    });
    Ok(ChildHandle { rank, pid, kill: Some(kill_tx), exit: exit_rx, done })
}

fn describe_exit(st: std::process::ExitStatus) -> String {
    use std::os::unix::process::ExitStatusExt;
    match (st.code(), st.signal()) {
        (Some(c), _) => format!("exited with status {c}"),
        (None, Some(s)) => format!("was killed by signal {s}{}", if s == 9 { " (SIGKILL)" } else { "" }),
        _ => "exited".into(),
    }
}

/// Whether one of `children` has exited.
fn child_exited(children: &mut [ChildHandle]) -> Option<String> {
    for c in children.iter_mut() {
        if let Ok(msg) = c.exit.try_recv() {
            return Some(format!("rank {} (pid {}) {msg}", c.rank, c.pid));
        }
    }
    None
}

/// Runs while the world serves; returns why it stopped and whether it is a shutdown.
async fn watch_world(inner: &Arc<Inner>, up: &mut Up, generation: u64, broken_rx: &mut mpsc::UnboundedReceiver<(u64, String)>, stop: &mut watch::Receiver<bool>) -> (String, bool) {
    let mut tick = tokio::time::interval(inner.cfg.health_interval);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    let mut misses = vec![0u32; up.clients.len()];
    let mut exit_poll = tokio::time::interval(Duration::from_millis(50));
    loop {
        tokio::select! {
            _ = stop.changed() => return (String::new(), true),
            Some((g, reason)) = broken_rx.recv() => {
                if g == generation {
                    // Prefer the precise cause when a child died.
                    tokio::time::sleep(Duration::from_millis(100)).await;
                    if let Some(e) = child_exited(&mut up.children) {
                        return (e, false);
                    }
                    return (reason, false);
                }
            }
            _ = exit_poll.tick() => {
                if let Some(e) = child_exited(&mut up.children) {
                    return (e, false);
                }
            }
            _ = tick.tick() => {
                for (r, c) in up.clients.iter_mut().enumerate() {
                    match describe(c).await {
                        Ok(d) if d.state == RankState::Ready as i32 => misses[r] = 0,
                        Ok(d) if d.state == RankState::Failed as i32 => return (format!("rank {r} failed: {}", d.error), false),
                        Ok(d) => return (format!("rank {r} is no longer ready (state {}; restarted?)", d.state), false),
                        Err(e) => {
                            misses[r] += 1;
                            if misses[r] >= 3 {
                                return (format!("rank {r} stopped answering: {e}"), false);
                            }
                        }
                    }
                }
            }
        }
    }
}

/// Stops a world: `Shutdown` to every rank (spawned ones, or attached ones when the world
/// broke, so that systemd restarts them all together), then kills and reaps children.
async fn teardown(inner: &Arc<Inner>, children: Vec<ChildHandle>, clients: &[RankClient<Channel>], gateway_exit: bool) {
    let spawned = matches!(inner.cfg.mode, WorldMode::Spawn(_));
    if spawned || !gateway_exit {
        let mut set = tokio::task::JoinSet::new();
        for c in clients {
            let mut c = c.clone();
            set.spawn(async move {
                let _ = tokio::time::timeout(Duration::from_secs(2), c.shutdown(ShutdownRequest {})).await;
            });
        }
        while set.join_next().await.is_some() {}
    }
    for mut ch in children {
        if let Some(k) = ch.kill.take() {
            let _ = k.send(());
        }
        let _ = tokio::time::timeout(Duration::from_secs(10), &mut ch.done).await;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Started ranks inherit the gateway's environment (NCCL_*, CUDA_VISIBLE_DEVICES, ...)
    /// plus `SpawnConfig::env`: a stand-in rank binary dumps what it got.
    #[tokio::test]
    async fn started_ranks_inherit_the_environment() {
        use std::os::unix::fs::PermissionsExt;
        let dir = std::env::temp_dir().join(format!("minimax-spawn-env-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let script = dir.join("fake-rank");
        std::fs::write(&script, "#!/bin/sh\nenv > \"$0.env\"\n").unwrap();
        std::fs::set_permissions(&script, std::fs::Permissions::from_mode(0o755)).unwrap();
        let s = SpawnConfig {
            rank_binary: script.clone(),
            model: PathBuf::from("/nonexistent.gguf"),
            synthetic: None,
            devices: vec!["cpu".into()],
            parallelism: "tensor".into(),
            page_size: 16,
            kv_pages: None,
            run_dir: dir.clone(),
            extra_args: vec![],
            rank_args: vec![],
            env: vec![("NCCL_SOCKET_IFNAME".into(), "=test0".into())],
        };
        let mut h = spawn_rank(&s, 0, 1, &RankAddr::Unix(dir.join("rank-0.sock"))).unwrap();
        let exit = tokio::time::timeout(Duration::from_secs(10), &mut h.exit).await.expect("fake rank exited").unwrap();
        assert!(exit.contains("status 0"), "{exit}");
        let env = std::fs::read_to_string(dir.join("fake-rank.env")).unwrap();
        let _ = std::fs::remove_dir_all(&dir);
        assert!(env.lines().any(|l| l == "NCCL_SOCKET_IFNAME==test0"), "SpawnConfig::env missing:\n{env}");
        let path = std::env::var("PATH").expect("tests run with a PATH");
        assert!(env.lines().any(|l| l == format!("PATH={path}")), "the gateway's environment (PATH) was not inherited:\n{env}");
    }
}
