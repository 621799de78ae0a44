//! `minimax-rank serve`: the rank's gRPC server (`minimax.rank.v1.Rank`, `grpc.health.v1`,
//! server reflection) and its lifecycle: LOADING (weights load in the background) → LOADED
//! (`sd_notify READY=1`) → READY after a collective JOIN (health SERVING) → back to LOADED if
//! the world breaks (a peer died: re-JOIN needed) or FAILED if loading failed.
//! See `docs/RANK.md`.

mod authority;
mod huffman_table;
mod late_rules;
mod step;

use std::collections::VecDeque;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Condvar, Mutex};
use std::time::{Duration, Instant};

use minimax_proto::v1 as pb;
use minimax_proto::v1::rank_server::{Rank, RankServer};
use minimax_shared::gguf::{GgufModel, MetaValue};
use minimax_shared::model::ModelConfig;
use tokio::sync::watch;
use tonic::{Request, Response, Status};
use tonic_health::ServingStatus;
use tonic_health::server::HealthReporter;

use crate::backend::{Backend, Device, Parallelism};
use crate::comm::{CommError, Collective};
use crate::cpu::KvSpec;
use crate::partition::{self, Partition};
use crate::state::{SeqTable, TestFault};
use crate::transport::TestTransport;


/// Everything `serve` needs, from the command line.
#[derive(Clone, Debug)]
pub struct ServeConfig {
    pub rank: usize,
    pub world_size: usize,
    /// `unix:///path.sock` or `host:port`.
    pub listen: String,
    pub model: PathBuf,
    /// BENCHMARK ONLY (`--synthetic`, `--allow-synthetic`): serve a synthetic model with
    /// random weights instead of `model`, whole on this one rank.
    pub synthetic: Option<minimax_shared::model::synthetic::SyntheticSpec>,
    pub device: Device,
    pub parallelism: Parallelism,
    pub kv: KvSpec,
    /// Bound on every transport receive/send during steps (a silent peer is an error).
    pub collective_timeout: Duration,
    /// Test-only fault hook (hidden flag).
    pub test_fault: Option<TestFault>,
    /// Test-only scripted replay file (hidden flag + MINIMAX_ALLOW_TEST_HOOKS=1).
    pub test_replay: Option<PathBuf>,
}

/// Why a serve run could not start or ended badly.
#[derive(Debug, thiserror::Error)]
pub enum ServeError {
    #[error("invalid configuration: {0}")]
    Config(String),
    #[error("listen on {addr}: {source}")]
    Listen { addr: String, source: std::io::Error },
    #[error("gRPC server: {0}")]
    Transport(#[from] tonic::transport::Error),
}

/// Why a step failed as a whole (per-sequence problems are reported in the response).
#[derive(Debug, thiserror::Error)]
pub enum StepError {
    #[error("invalid step: {0}")]
    Invalid(String),
    #[error("ranks disagree on the step: {0}")]
    Diverged(String),
    #[error("{0}; the world is broken, re-JOIN required")]
    Comm(CommError),
    #[error("backend: {0}")]
    Backend(String),
}

impl From<StepError> for Status {
    fn from(e: StepError) -> Status {
        match &e {
            StepError::Invalid(_) => Status::invalid_argument(e.to_string()),
            StepError::Diverged(_) => Status::failed_precondition(e.to_string()),
            StepError::Comm(_) => Status::unavailable(e.to_string()),
            StepError::Backend(_) => Status::internal(e.to_string()),
        }
    }
}

/// Aborts the world's NCCL communicator from outside the engine lock (CUDA worlds).
#[cfg(feature = "cuda")]
type CommAbort = crate::cuda::NcclAbort;

/// CPU-only builds have no NCCL communicator to abort.
#[cfg(not(feature = "cuda"))]
#[derive(Clone)]
struct CommAbort;

#[cfg(not(feature = "cuda"))]
impl CommAbort {
    fn abort(&self, _why: &str) -> bool {
        false
    }
    fn is_aborted(&self) -> bool {
        false
    }
}

/// A joined world: the transport (absent for world size 1).
pub(crate) struct World {
    transport: Arc<TestTransport>,
}

/// The loaded model plus everything a step mutates; locked for the duration of a step.
pub(crate) struct Engine {
    rank: u32,
    backend: Backend,
    part: Partition,
    parallelism: Parallelism,
    kv: KvSpec,
    head: bool,
    world: Option<World>,
    /// Test-only scripted replay (head rank).
    replay: Option<crate::replay::Replay>,
}

/// What Describe reports; cheap to read while a step runs.
#[derive(Clone, Debug, Default)]
struct Status_ {
    state: i32,
    progress: f32,
    error: String,
    model: Option<pb::ModelInfo>,
    layers: (u32, u32),
    head: bool,
    weight_bytes: u64,
}

struct Shared {
    cfg: ServeConfig,
    status: Mutex<Status_>,
    engine: Mutex<Option<Engine>>,
    /// What this rank believes each sequence's cache length is. Lock order: `engine` first.
    /// Pipelined steps agree (and advance lengths) under this lock alone, while another
    /// step computes under `engine`.
    seqs: Mutex<SeqTable>,
    /// The loaded model's vocabulary and context length (validation without the engine).
    limits: Mutex<Option<(usize, usize)>>,
    /// The order of pipelined steps (pipeline worlds).
    pipe: Pipe,
    /// Rules of rows sent with `rule_follows`, until their steps take them.
    late_rules: late_rules::LateRules,
    /// The current world's transport, watched for a dead peer without taking the engine lock.
    transport: Mutex<Option<Arc<TestTransport>>>,
    /// The current world's NCCL communicator, aborted by the watcher when a peer died while
    /// a step waits inside a collective (the step thread holds the engine lock).
    comm_abort: Mutex<Option<CommAbort>>,
    /// When the running step started (the watcher's step deadline for NCCL worlds).
    step_started: Mutex<Option<Instant>>,
    /// When the last pipelined compute ended (the idle gap before the next one, logged at
    /// debug level under `minimax::step`).
    last_compute_end: Mutex<Option<Instant>>,
    health: HealthReporter,
    shutdown: watch::Sender<bool>,
    /// Rank 0's last CREATEd world id.
    created_id: Mutex<Option<Vec<u8>>>,
}

impl Shared {
    fn set_state(&self, state: pb::RankState, error: Option<String>) {
        let mut s = self.status.lock().unwrap();
        s.state = state as i32;
        if let Some(e) = error {
            s.error = e;
        }
    }

    fn state(&self) -> pb::RankState {
        pb::RankState::try_from(self.status.lock().unwrap().state).unwrap_or(pb::RankState::Unspecified)
    }

    async fn set_health(&self, serving: bool) {
        let st = if serving { ServingStatus::Serving } else { ServingStatus::NotServing };
        self.health.set_service_status("", st).await;
        self.health.set_service_status("minimax.rank.v1.Rank", st).await;
    }

    /// Stops the world's communication at once: the transport's sockets close (peers see
    /// EOF) and the NCCL communicator is aborted, so a collective blocked on a dead peer
    /// returns. Blocking (an NCCL abort can take a moment): not on the async runtime.
    fn abort_comms(&self, why: &str) {
        if let Some(t) = self.transport.lock().unwrap().take() {
            t.abort();
        }
        let comm = self.comm_abort.lock().unwrap().take();
        if let Some(c) = comm
            && c.abort(why)
        {
            tracing::error!("NCCL communicator aborted: {why}");
        }
    }

    /// The world broke (a peer died or a collective failed): forget it and every sequence.
    /// The caller must not hold `seqs`.
    fn world_broken(&self, engine: Option<&mut Engine>, why: &str) {
        self.abort_comms(why);
        self.pipe.reset();
        self.late_rules.clear();
        if let Some(e) = engine {
            e.world = None;
            self.seqs.lock().unwrap().clear();
        }
        if self.state() == pb::RankState::Ready {
            tracing::error!("world broken: {why}");
            self.set_state(pb::RankState::Loaded, Some(format!("world broken: {why}; re-JOIN required")));
        }
    }
}

/// The `minimax.rank.v1.Rank` service.
#[derive(Clone)]
struct RankService {
    shared: Arc<Shared>,
}

fn random_id() -> Vec<u8> {
    use std::io::Read;
    let mut b = vec![0u8; 16];
    if std::fs::File::open("/dev/urandom").and_then(|mut f| f.read_exact(&mut b)).is_err() {
        let t = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap_or_default().as_nanos();
        b = [t.to_le_bytes(), (std::process::id() as u128).to_le_bytes()].concat();
    }
    b
}

#[tonic::async_trait]
impl Rank for RankService {
    async fn describe(&self, _: Request<pb::DescribeRequest>) -> Result<Response<pb::DescribeResponse>, Status> {
        let cfg = &self.shared.cfg;
        let s = self.shared.status.lock().unwrap().clone();
        Ok(Response::new(pb::DescribeResponse {
            protocol_version: pb::PROTOCOL_VERSION,
            rank: cfg.rank as u32,
            world_size: cfg.world_size as u32,
            state: s.state,
            load_progress: s.progress,
            error: s.error,
            device: cfg.device.to_string(),
            parallelism: cfg.parallelism.as_str().into(),
            first_layer: s.layers.0,
            end_layer: s.layers.1,
            head: s.head,
            model: s.model,
            page_size: cfg.kv.page_size as u32,
            n_pages: cfg.kv.n_pages as u32,
            weight_bytes: s.weight_bytes,
            pid: std::process::id(),
            late_forward: late_rules::late_forward(cfg.device != crate::backend::Device::Cpu),
        }))
    }

    async fn collective(&self, req: Request<pb::CollectiveRequest>) -> Result<Response<pb::CollectiveResponse>, Status> {
        let req = req.into_inner();
        let cfg = &self.shared.cfg;
        match pb::collective_request::Phase::try_from(req.phase) {
            Ok(pb::collective_request::Phase::Create) => {
                if cfg.rank != 0 {
                    return Err(Status::failed_precondition(format!("CREATE goes to rank 0; this is rank {}", cfg.rank)));
                }
                #[allow(unused_mut)]
                let mut id = random_id();
                // CUDA worlds: the NCCL unique id rides at the end of the world id.
                #[cfg(feature = "cuda")]
                if cfg.world_size > 1 && matches!(cfg.device, crate::backend::Device::Cuda(_)) {
                    let nccl = tokio::task::spawn_blocking(crate::cuda::nccl::unique_id)
                        .await
                        .map_err(|e| Status::internal(e.to_string()))?
                        .map_err(|e| Status::unavailable(format!("NCCL unique id: {e}")))?;
                    id.extend_from_slice(&nccl);
                }
                *self.shared.created_id.lock().unwrap() = Some(id.clone());
                Ok(Response::new(pb::CollectiveResponse { unique_id: id, self_test_sum: 0.0 }))
            }
            Ok(pb::collective_request::Phase::Join) => {
                let shared = self.shared.clone();
                let resp = tokio::task::spawn_blocking(move || join(&shared, req)).await.map_err(|e| Status::internal(e.to_string()))??;
                self.shared.set_health(true).await;
                Ok(Response::new(resp))
            }
            _ => Err(Status::invalid_argument("phase must be CREATE or JOIN")),
        }
    }

    async fn step(&self, req: Request<pb::StepRequest>) -> Result<Response<pb::StepResponse>, Status> {
        if self.shared.state() != pb::RankState::Ready {
            let s = self.shared.status.lock().unwrap().clone();
            return Err(Status::failed_precondition(format!(
                "rank {} is not READY (state {:?}{}{})",
                self.shared.cfg.rank,
                pb::RankState::try_from(s.state).unwrap_or(pb::RankState::Unspecified),
                if s.error.is_empty() { "" } else { ": " },
                s.error
            )));
        }
        let shared = self.shared.clone();
        let req = req.into_inner();
        // Pipeline worlds and one-rank worlds (overlapped decode) may have several steps in
        // flight: they agree in the gateway's order as they arrive and compute one after
        // another (`Pipe`).
        let pipelined = shared.cfg.parallelism == Parallelism::Pipeline || shared.cfg.world_size == 1;
        // On this worker thread (block_in_place: the runtime moves its other tasks away), not
        // on the blocking pool: a step is on the decode loop's critical path, and the hand-over
        // to a pool thread and back cost two thread wake-ups per step.
        let res = tokio::task::block_in_place(move || {
            if pipelined {
                return pipelined_step(&shared, &req);
            }
            let mut guard = shared.engine.lock().unwrap();
            let engine = guard.as_mut().ok_or_else(|| Status::failed_precondition("no model loaded"))?;
            if engine.world.is_none() && shared.cfg.world_size > 1 {
                return Err(Status::failed_precondition("not joined to a world (re-JOIN required)"));
            }
            // The communicator this step runs on: if the watcher aborts it meanwhile (a peer
            // died), whatever the step computed is garbage.
            let comm = shared.comm_abort.lock().unwrap().clone();
            *shared.step_started.lock().unwrap() = Some(Instant::now());
            let res = engine.step(&mut shared.seqs.lock().unwrap(), &req);
            *shared.step_started.lock().unwrap() = None;
            let res = match (res, comm.filter(|c| c.is_aborted())) {
                (Ok(_) | Err(StepError::Backend(_)), Some(_)) => {
                    let why = shared.status.lock().unwrap().error.clone();
                    Err(StepError::Comm(crate::comm::CommError { op: "step", detail: format!("NCCL communicator aborted during the step ({why})") }))
                }
                (res, _) => res,
            };
            match res {
                Ok(r) => Ok(r),
                Err(StepError::Comm(e)) => {
                    shared.world_broken(Some(engine), &e.to_string());
                    Err(StepError::Comm(e).into())
                }
                Err(e) => Err(e.into()),
            }
        });
        if res.is_err() && self.shared.state() != pb::RankState::Ready {
            self.shared.set_health(false).await;
        }
        res.map(Response::new)
    }

    async fn release(&self, req: Request<pb::ReleaseRequest>) -> Result<Response<pb::ReleaseResponse>, Status> {
        let req = req.into_inner();
        let shared = self.shared.clone();
        tokio::task::spawn_blocking(move || {
            if let Some(e) = shared.engine.lock().unwrap().as_mut() {
                let mut seqs = shared.seqs.lock().unwrap();
                for &id in &req.seq_ids {
                    if req.truncate { seqs.truncate(id, req.keep_len) } else { seqs.forget(id) }
                }
                if let Some(r) = e.replay.as_mut().filter(|_| !req.truncate) {
                    r.release(&req.seq_ids);
                }
            }
        })
        .await
        .map_err(|e| Status::internal(e.to_string()))?;
        Ok(Response::new(pb::ReleaseResponse {}))
    }

    async fn shutdown(&self, _: Request<pb::ShutdownRequest>) -> Result<Response<pb::ShutdownResponse>, Status> {
        tracing::info!("shutdown requested over gRPC");
        // A step blocked in a collective must return, or the graceful stop waits for it.
        let shared = self.shared.clone();
        let _ = tokio::task::spawn_blocking(move || shared.abort_comms("shutdown requested")).await;
        let _ = self.shared.shutdown.send(true);
        Ok(Response::new(pb::ShutdownResponse {}))
    }
}

/// JOIN: (re)builds the world and runs the self-test all-reduce.
fn join(shared: &Shared, req: pb::CollectiveRequest) -> Result<pb::CollectiveResponse, Status> {
    let cfg = &shared.cfg;
    match shared.state() {
        pb::RankState::Loaded | pb::RankState::Ready => {}
        s => return Err(Status::failed_precondition(format!("cannot JOIN in state {s:?}"))),
    }
    let mut guard = shared.engine.lock().unwrap();
    let engine = guard.as_mut().ok_or_else(|| Status::failed_precondition("no model loaded"))?;
    // Leave any previous world first: its peers must see us go.
    shared.world_broken(Some(engine), "re-JOIN");
    shared.set_state(pb::RankState::Loaded, None);
    let timeout = Duration::from_millis(if req.timeout_ms == 0 { 30_000 } else { req.timeout_ms as u64 });
    let sum = if cfg.world_size == 1 {
        1.0
    } else {
        if req.peer_addrs.len() != cfg.world_size {
            return Err(Status::invalid_argument(format!(
                "JOIN needs {} peer_addrs (one per rank), got {}",
                cfg.world_size,
                req.peer_addrs.len()
            )));
        }
        if req.unique_id.is_empty() {
            return Err(Status::invalid_argument("JOIN needs the unique_id from CREATE"));
        }
        let t = TestTransport::join(cfg.rank, &req.unique_id, &req.peer_addrs, timeout, cfg.collective_timeout)
            .map_err(|e| Status::unavailable(e.to_string()))?;
        let mut buf = [cfg.rank as f32 + 1.0];
        t.all_reduce_sum(&mut buf).map_err(|e| Status::unavailable(format!("self-test: {e}")))?;
        #[cfg(feature = "cuda")]
        if let Backend::Cuda(m) = &mut engine.backend {
            let id = &req.unique_id;
            let n = crate::cuda::NCCL_ID_BYTES;
            if id.len() < n {
                return Err(Status::invalid_argument("CUDA worlds need the NCCL unique id from CREATE in unique_id"));
            }
            m.join_nccl(cfg.rank, cfg.world_size, &id[id.len() - n..]).map_err(|e| Status::unavailable(format!("NCCL join: {e}")))?;
            *shared.comm_abort.lock().unwrap() = m.nccl_abort_handle();
            tracing::info!(rank = cfg.rank, world = cfg.world_size, "NCCL communicator ready (self-test all-reduce passed)");
        }
        let t = Arc::new(t);
        *shared.transport.lock().unwrap() = Some(t.clone());
        engine.world = Some(World { transport: t });
        buf[0]
    };
    let want = (cfg.world_size * (cfg.world_size + 1) / 2) as f32;
    if sum != want {
        shared.world_broken(Some(engine), "self-test failed");
        return Err(Status::internal(format!("self-test all-reduce gave {sum}, expected {want}")));
    }
    tracing::info!(rank = cfg.rank, world = cfg.world_size, "joined the world; self-test sum {sum}");
    shared.set_state(pb::RankState::Ready, Some(String::new()));
    Ok(pb::CollectiveResponse { unique_id: req.unique_id, self_test_sum: sum })
}

/// The order of pipelined steps on this rank (pipeline worlds, and every step of a one-rank
/// world, where the gateway overlaps decode steps): agreements run in the order
/// the gateway chained them (`StepRequest.after_step_id`), ahead of the compute, which runs
/// one step at a time in the order the agreements ended (tickets). Every rank agrees in the
/// same order and so computes in the same order: the stages' sends and receives match.
#[derive(Default)]
struct Pipe {
    st: Mutex<PipeState>,
    cv: Condvar,
    /// `PipeState::computing`, readable without the lock (the spin of `wait_turn`).
    computing: AtomicU64,
    /// When the running compute started, and a running mean of compute durations (µs).
    started: Mutex<Option<Instant>>,
    mean_us: AtomicU64,
}

/// How long before the running compute's expected end the next step stops sleeping on the
/// condition variable and spins: a sleeping thread's wake-up (~50 µs measured on the H200
/// host) would otherwise sit between two steps with the GPU idle.
const SPIN_AHEAD: Duration = Duration::from_micros(300);
/// The longest spin before sleeping again (a compute that runs long).
const SPIN_MAX: Duration = Duration::from_millis(2);

/// `MINIMAX_PIPE_SPIN=0`: the next step sleeps until the turn passes (A/B of the spin).
fn pipe_spin() -> bool {
    static ON: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *ON.get_or_init(|| std::env::var("MINIMAX_PIPE_SPIN").map_or(true, |v| v != "0"))
}

#[derive(Default)]
struct PipeState {
    /// Bumped when the world breaks or is joined: waiters of an older world give up.
    epoch: u64,
    /// Steps agreed (or refused) in this world, most recent last (the last `PASSED_KEPT`).
    passed: VecDeque<u64>,
    /// The next compute ticket to hand out, and the ticket allowed to compute now.
    next_ticket: u64,
    computing: u64,
    /// Tickets below this one were answered (overlapped decode answers a step after the next
    /// one was launched; answers stay in ticket order, and a step launches only when every
    /// step but the one before it was answered).
    finished: u64,
    /// Agreed steps not yet answered, and the most seen at once in this world.
    in_flight: usize,
    max_in_flight: usize,
}

/// Agreed step ids remembered for `after_step_id` (far more than any gateway keeps in flight).
const PASSED_KEPT: usize = 4096;

/// A waiting pipelined step's world went away.
fn pipe_broken(why: &str) -> StepError {
    StepError::Comm(crate::comm::CommError { op: "step", detail: why.to_string() })
}

impl Pipe {
    fn epoch(&self) -> u64 {
        self.st.lock().unwrap().epoch
    }

    /// A new world (or none): forget every step and wake every waiter.
    fn reset(&self) {
        let mut st = self.st.lock().unwrap();
        let epoch = st.epoch + 1;
        *st = PipeState { epoch, ..Default::default() };
        self.computing.store(0, Ordering::SeqCst);
        *self.started.lock().unwrap() = None;
        self.cv.notify_all();
    }

    /// The compute holding the turn starts now (the next step's waiter re-plans its wait).
    fn compute_started(&self) {
        *self.started.lock().unwrap() = Some(Instant::now());
        self.cv.notify_all();
    }

    /// Waits until step `after` has been agreed here (bounded by `timeout`: a step the gateway
    /// chained to one this rank never got cannot run).
    fn wait_passed(&self, after: u64, epoch: u64, timeout: Duration, ready: &dyn Fn() -> bool) -> Result<(), StepError> {
        let deadline = Instant::now() + timeout;
        let mut st = self.st.lock().unwrap();
        loop {
            if st.epoch != epoch || !ready() {
                return Err(pipe_broken("the world broke while this step waited for its turn"));
            }
            if st.passed.contains(&after) {
                return Ok(());
            }
            let left = deadline.saturating_duration_since(Instant::now());
            if left.is_zero() {
                return Err(StepError::Diverged(format!("step {after}, which this step follows, never reached this rank within {timeout:?}")));
            }
            st = self.cv.wait_timeout(st, left.min(Duration::from_millis(100))).unwrap().0;
        }
    }

    /// Records that `step_id` was agreed (or refused); with `compute`, hands out its compute
    /// ticket.
    fn pass(&self, step_id: u64, epoch: u64, compute: bool) -> Option<u64> {
        let mut st = self.st.lock().unwrap();
        if st.epoch != epoch {
            return None;
        }
        if st.passed.len() == PASSED_KEPT {
            st.passed.pop_front();
        }
        st.passed.push_back(step_id);
        let ticket = compute.then(|| {
            let t = st.next_ticket;
            st.next_ticket += 1;
            st.in_flight += 1;
            if st.in_flight > st.max_in_flight {
                st.max_in_flight = st.in_flight;
                tracing::info!(steps = st.in_flight, "pipeline: most steps agreed and in flight so far");
            }
            t
        });
        self.cv.notify_all();
        ticket
    }

    /// Waits until `ticket` may compute (every earlier agreed step computed here). While the
    /// step just before it computes, it sleeps until shortly before that compute's expected
    /// end (the running mean), then spins, so it starts as soon as the turn passes.
    fn wait_turn(&self, ticket: u64, epoch: u64, ready: &dyn Fn() -> bool) -> Result<(), StepError> {
        let mut st = self.st.lock().unwrap();
        loop {
            if st.epoch != epoch || !ready() {
                return Err(pipe_broken("the world broke while this step waited to compute"));
            }
            if st.computing == ticket && st.finished + 1 >= ticket {
                return Ok(());
            }
            if st.computing == ticket {
                // Launched behind a step still being read back: wait for the one before it.
                st = self.cv.wait_timeout(st, Duration::from_millis(100)).unwrap().0;
                continue;
            }
            let started = if st.computing + 1 == ticket && pipe_spin() { *self.started.lock().unwrap() } else { None };
            let mean = Duration::from_micros(self.mean_us.load(Ordering::Relaxed));
            let Some(start) = started.filter(|_| !mean.is_zero()) else {
                st = self.cv.wait_timeout(st, Duration::from_millis(100)).unwrap().0;
                continue;
            };
            let sleep = (start + mean).saturating_duration_since(Instant::now()).saturating_sub(SPIN_AHEAD);
            if !sleep.is_zero() {
                st = self.cv.wait_timeout(st, sleep.min(Duration::from_millis(100))).unwrap().0;
                continue;
            }
            drop(st);
            let until = Instant::now() + SPIN_MAX;
            while self.computing.load(Ordering::Acquire) + 1 == ticket && Instant::now() < until {
                std::hint::spin_loop();
            }
            st = self.st.lock().unwrap();
            if st.computing + 1 == ticket && st.epoch == epoch {
                // Still running past its expected end: sleep until it is done.
                st = self.cv.wait_timeout(st, Duration::from_millis(100)).unwrap().0;
            }
        }
    }

    /// `ticket`'s compute ended (well or not): the next one may start.
    fn done(&self, ticket: u64, epoch: u64) {
        let mut st = self.st.lock().unwrap();
        // (Taken whatever the epoch: a compute that ended after a reset leaves no start behind.)
        let started = self.started.lock().unwrap().take();
        if st.epoch == epoch && st.computing == ticket {
            if let Some(t) = started {
                // Running mean over ~8 computes.
                let us = t.elapsed().as_micros() as u64;
                let m = self.mean_us.load(Ordering::Relaxed);
                self.mean_us.store(if m == 0 { us } else { (7 * m + us) / 8 }, Ordering::Relaxed);
            }
            st.computing += 1;
            self.computing.store(st.computing, Ordering::Release);
        }
        self.cv.notify_all();
    }

    /// Waits until every ticket below `ticket` was answered (overlapped decode: answers in
    /// order; a step that needs a token only the answer of `ticket - 1` gives waits for it too).
    fn wait_finished(&self, ticket: u64, epoch: u64, ready: &dyn Fn() -> bool) -> Result<(), StepError> {
        let mut st = self.st.lock().unwrap();
        loop {
            if st.epoch != epoch || !ready() {
                return Err(pipe_broken("the world broke while this step waited for the answer before it"));
            }
            if st.finished >= ticket {
                return Ok(());
            }
            st = self.cv.wait_timeout(st, Duration::from_millis(100)).unwrap().0;
        }
    }

    /// `ticket` was answered (well or not).
    fn finished(&self, ticket: u64, epoch: u64) {
        let mut st = self.st.lock().unwrap();
        if st.epoch == epoch && st.finished == ticket {
            st.finished += 1;
            st.in_flight -= 1;
        }
        self.cv.notify_all();
    }
}

/// A step of a pipeline world: waits for the step it follows, agrees (lengths advanced at
/// once, under `seqs` only), then computes in the agreed order under the engine lock. While
/// one step computes, the next ones agree, so stage 0 starts step N+1 while stage 1 still
/// computes step N. A one-rank world runs every step here: the gateway's next decode step
/// (feeding the tokens this one draws) arrives while this one computes.
fn pipelined_step(shared: &Shared, req: &pb::StepRequest) -> Result<pb::StepResponse, Status> {
    let cfg = &shared.cfg;
    // Rules for rows of earlier steps first: those steps may be waiting for them.
    shared.late_rules.deposit(&req.late_rules);
    let epoch = shared.pipe.epoch();
    let ready = || shared.state() == pb::RankState::Ready;
    let alone = cfg.world_size == 1;
    let transport = shared.transport.lock().unwrap().clone();
    if transport.is_none() && !alone {
        return Err(Status::failed_precondition("not joined to a world (re-JOIN required)"));
    }
    // Overlapped decode: drawn tokens stand in as placeholders until the step before computed.
    let mut req = req.clone();
    let fed = step::placeholder_fed(&mut req);
    let req = &mut req;
    let (vocab, context) = shared.limits.lock().unwrap().ok_or_else(|| Status::failed_precondition("no model loaded"))?;
    // A collective of this world failed: it is broken (unless it was already left meanwhile).
    let broke = |e: StepError| -> Status {
        if let StepError::Comm(c) = &e
            && shared.pipe.epoch() == epoch
        {
            shared.world_broken(None, &c.to_string());
            shared.seqs.lock().unwrap().clear();
        }
        e.into()
    };
    if req.after_step_id != 0 {
        shared.pipe.wait_passed(req.after_step_id, epoch, cfg.collective_timeout, &ready)?;
    }
    // The agreement, ahead of the compute.
    let agreed = {
        let mut seqs = shared.seqs.lock().unwrap();
        let (ps, np) = (cfg.kv.page_size, cfg.kv.n_pages);
        let validate = |b: &minimax_shared::forward::ForwardBatch| b.validate(ps, np, vocab, context).map_err(|e| e.to_string());
        let mut agreed = step::agree_step(&mut seqs, &validate, transport.as_deref(), cfg.rank as u32, (ps as u32, np as u32), req, &fed);
        if let Ok(a) = &mut agreed {
            step::advance(&mut seqs, req, a);
        }
        agreed
    };
    let ticket = shared.pipe.pass(req.step_id, epoch, matches!(&agreed, Ok(a) if !a.is_empty()));
    let agreed = agreed.map_err(broke)?;
    let Some(ticket) = ticket else {
        if !agreed.is_empty() {
            return Err(pipe_broken("the world broke during the agreement").into());
        }
        return Ok(step::unanswered(cfg.rank as u32, req, agreed));
    };
    // The compute, in the agreed order. A world of one launches a CUDA decode step before the
    // one it follows was read back (device-fed tokens), so answers are read in order after the
    // turn passed (`Pipe::wait_finished`).
    let mut fed_dev: Vec<step::DeviceFed> = Vec::new();
    let launched = shared.pipe.wait_turn(ticket, epoch, &ready).and_then(|()| {
        let mut agreed = Some(agreed);
        let mut waited = false;
        let mut rules_in = false;
        loop {
            let mut guard = shared.engine.lock().unwrap();
            let Some(engine) = guard.as_mut().filter(|e| e.world.is_some() || alone) else {
                return Err(pipe_broken("not joined to a world (re-JOIN required)"));
            };
            let a = agreed.as_mut().expect("taken only below");
            let device = alone && engine.device_feed_ok(a.n_tokens());
            // Rows whose rule follows (late rules): the step runs its forward first and its
            // reductions wait for the rules (below), except on a CUDA rank with
            // `MINIMAX_LATE_FORWARD=0` (which the gateway sends no such rows), which takes the
            // rules in before it launches.
            let waiting = a.rows_waiting(req);
            if engine.rules_before_forward() && !rules_in && !waiting.is_empty() {
                drop(guard);
                let same_world = || ready() && shared.pipe.epoch() == epoch;
                let rules = shared.late_rules.wait(req.step_id, &waiting, cfg.collective_timeout, &same_world)?;
                late_rules::apply(req, rules);
                rules_in = true;
                continue;
            }
            let filled = if alone && !device && !waited {
                // Computed here and now (e.g. a prefill chunk): let the step before be read
                // back first, or its answer would wait for this whole compute.
                Err(ticket)
            } else {
                // (The sequence table's guard must not live into the wait below.)
                step::fill_fed(req, a, &mut shared.seqs.lock().unwrap(), &fed, ticket, device)
            };
            match filled {
                Ok(d) => fed_dev = d,
                Err(answered) => {
                    drop(guard);
                    waited = true;
                    shared.pipe.wait_finished(answered, epoch, &ready)?;
                    continue;
                }
            }
            let comm = shared.comm_abort.lock().unwrap().clone();
            let start = Instant::now();
            shared.pipe.compute_started();
            *shared.step_started.lock().unwrap() = Some(start);
            let idle = shared.last_compute_end.lock().unwrap().map(|e| start.saturating_duration_since(e));
            let agreed = agreed.take().expect("set above");
            let launched = if alone { engine.launch(req, agreed, ticket, device, &fed_dev) } else { step::Launched::Done(engine.compute(req, agreed)) };
            // The forward ran (or runs); its rows wait for their rules without the engine lock
            // (the step before is read back meanwhile, and its answer lets the gateway send
            // them). A wait that fails (no rule in time, or the world changed) fails this step
            // alone: it breaks no world (a new one may have been joined meanwhile).
            let (launched, mut guard) = match launched {
                step::Launched::Rules(w) => {
                    drop(guard);
                    let same_world = || ready() && shared.pipe.epoch() == epoch;
                    let rules = shared.late_rules.wait(req.step_id, &w.waiting, cfg.collective_timeout, &same_world);
                    let ended = |e: StepError| {
                        *shared.step_started.lock().unwrap() = None;
                        *shared.last_compute_end.lock().unwrap() = Some(Instant::now());
                        Ok(step::Launched::Done(Err(e)))
                    };
                    let rules = match rules {
                        Ok(r) => r,
                        Err(e) => return ended(e),
                    };
                    let mut guard = shared.engine.lock().unwrap();
                    // (A world joined while this step waited: its answer and draws are not
                    // this world's.)
                    if shared.pipe.epoch() != epoch {
                        return ended(pipe_broken("the world changed while a step waited for its rules"));
                    }
                    let Some(engine) = guard.as_mut() else {
                        return Err(pipe_broken("the engine went away while a step waited for its rules"));
                    };
                    late_rules::apply(req, rules);
                    let launched = engine.resume(req, *w);
                    (launched, guard)
                }
                other => (other, guard),
            };
            let Some(engine) = guard.as_mut() else {
                return Err(pipe_broken("the engine went away while a step waited for its rules"));
            };
            *shared.step_started.lock().unwrap() = None;
            *shared.last_compute_end.lock().unwrap() = Some(Instant::now());
            tracing::debug!(target: "minimax::step", step = req.step_id, idle_ms = idle.map_or(-1.0, |d| d.as_secs_f64() * 1e3), "since the previous compute ended");
            let launched = match launched {
                step::Launched::Done(res) => {
                    if let Ok(r) = &res {
                        step::record_draws(&mut shared.seqs.lock().unwrap(), r);
                    }
                    let res = match (res, comm.filter(|c| c.is_aborted())) {
                        (Ok(_) | Err(StepError::Backend(_)), Some(_)) => {
                            let why = shared.status.lock().unwrap().error.clone();
                            Err(pipe_broken(&format!("NCCL communicator aborted during the step ({why})")))
                        }
                        (res, _) => res,
                    };
                    if let Err(StepError::Comm(e)) = &res {
                        shared.world_broken(Some(engine), &e.to_string());
                    }
                    step::Launched::Done(res)
                }
                #[cfg(feature = "cuda")]
                step::Launched::Pending(p) => {
                    p.expect_draws(&mut shared.seqs.lock().unwrap());
                    step::Launched::Pending(p)
                }
                // (`resume` never waits again.)
                step::Launched::Rules(_) => step::Launched::Done(Err(StepError::Invalid("a step still waited for rules after they arrived".into()))),
            };
            return Ok(launched);
        }
    });
    shared.pipe.done(ticket, epoch);
    // The answer, in ticket order.
    let ordered = shared.pipe.wait_finished(ticket, epoch, &ready);
    let res = match launched {
        Err(e) => Err(e),
        Ok(step::Launched::Done(res)) => res,
        Ok(step::Launched::Rules(_)) => unreachable!("turned into an answer above"),
        #[cfg(feature = "cuda")]
        Ok(step::Launched::Pending(p)) => {
            // Read back even if the world broke meanwhile (it frees the read-back buffer). The
            // GPU wait holds no lock: the next step launches meanwhile.
            p.wait();
            let mut guard = shared.engine.lock().unwrap();
            match guard.as_mut() {
                // A world that broke meanwhile restarted its tickets: its draws are not recorded.
                Some(engine) => engine.finish(req, *p, ordered.is_ok().then_some(&shared.seqs)),
                None => Err(pipe_broken("the engine went away before the step was read back")),
            }
        }
    };
    let res = res.and_then(|mut r| {
        ordered?;
        step::check_device_fed(&mut shared.seqs.lock().unwrap(), &mut r, &fed_dev);
        Ok(r)
    });
    shared.pipe.finished(ticket, epoch);
    res.map_err(Status::from)
}

fn meta_str(m: &GgufModel, k: &str) -> String {
    m.meta(k).and_then(MetaValue::as_str).unwrap_or("").to_string()
}

/// Loads this rank's shard (blocking), updating the shared status as it goes.
fn load(shared: &Shared) -> Result<Engine, String> {
    let cfg = &shared.cfg;
    if let Some(spec) = &cfg.synthetic {
        return load_synthetic(shared, spec);
    }
    let model = Arc::new(GgufModel::open(&cfg.model).map_err(|e| format!("open {}: {e}", cfg.model.display()))?);
    let mc = ModelConfig::from_gguf(&model).map_err(|e| e.to_string())?;
    let (part, head) = rank_partition(cfg, &mc, || partition::gguf_stage_bytes(&model, &mc))?;
    announce(shared, meta_str(&model, "general.name"), meta_str(&model, "general.architecture"), &mc, &part, head);
    tracing::info!(rank = cfg.rank, layers = ?part.layers, tp = part.tp_rank, "loading shard");
    let replay = match &cfg.test_replay {
        Some(p) if head => Some(crate::replay::Replay::load(p, model.metadata(), cfg.kv.page_size).map_err(|e| e.to_string())?),
        Some(_) => {
            crate::replay::Replay::load(std::path::Path::new("/dev/null"), model.metadata(), cfg.kv.page_size)
                .err()
                .filter(|e| matches!(e, crate::replay::ReplayError::NotAllowed))
                .map_or(Ok(()), |e| Err(e.to_string()))?;
            None
        }
        None => None,
    };
    let backend = Backend::load(model, part.clone(), cfg.kv, cfg.device, &mut |p| {
        shared.status.lock().unwrap().progress = p;
    })
    .map_err(|e| e.to_string())?;
    Ok(engine(shared, backend, part, head, replay, &mc))
}

/// This rank's share of the model and whether it is the head (the rank that answers with
/// logits): tensor parallel, every rank a slice of every layer, rank 0 the head; pipeline,
/// contiguous layer ranges balanced by `bytes`, the last stage the head.
fn rank_partition(cfg: &ServeConfig, mc: &ModelConfig, bytes: impl FnOnce() -> partition::StageBytes) -> Result<(Partition, bool), String> {
    let part = match cfg.parallelism {
        _ if cfg.world_size == 1 => Partition::whole(mc),
        Parallelism::Tensor => Partition::tensor(mc, cfg.rank, cfg.world_size).map_err(|e| e.to_string())?,
        Parallelism::Pipeline => Partition::pipeline_by_bytes(mc, cfg.rank, cfg.world_size, &bytes()).map_err(|e| e.to_string())?,
    };
    let head = match cfg.parallelism {
        Parallelism::Pipeline => part.last_stage,
        Parallelism::Tensor => cfg.rank == 0,
    };
    Ok((part, head))
}

/// What Describe reports while the shard loads: the model (`name`, `architecture` and `mc`'s
/// sizes), this rank's layers and whether it is the head.
fn announce(shared: &Shared, name: String, architecture: String, mc: &ModelConfig, part: &Partition, head: bool) {
    let mut s = shared.status.lock().unwrap();
    s.model = Some(pb::ModelInfo {
        name,
        architecture,
        n_layers: mc.n_layers as u32,
        vocab_size: mc.vocab_size as u32,
        context_length: mc.context_length as u32,
        hidden: mc.hidden as u32,
    });
    s.layers = (part.layers.start as u32, part.layers.end as u32);
    s.head = head;
}

/// [`load`] for a synthetic model: this rank's share of it (the same seed on every rank gives
/// the same whole model); Describe reports its config.
fn load_synthetic(shared: &Shared, spec: &minimax_shared::model::synthetic::SyntheticSpec) -> Result<Engine, String> {
    let cfg = &shared.cfg;
    if cfg.test_replay.is_some() {
        return Err("a synthetic model runs without test hooks".into());
    }
    let mc = spec.config();
    let (part, head) = rank_partition(cfg, &mc, || partition::synthetic_stage_bytes(spec))?;
    announce(shared, mc.name.clone().unwrap_or_default(), mc.arch.clone(), &mc, &part, head);
    tracing::warn!(rank = cfg.rank, layers = ?part.layers, tp = part.tp_rank, "serving a SYNTHETIC model ({:?}, {} layers): random weights, benchmarks only", spec.mix, spec.layers);
    let backend = Backend::synthetic(spec, part.clone(), cfg.kv, cfg.device, &mut |p| {
        shared.status.lock().unwrap().progress = p;
    })
    .map_err(|e| e.to_string())?;
    Ok(engine(shared, backend, part, head, None, &mc))
}

/// The engine around a loaded backend (GGUF or synthetic); Describe reports its weight bytes.
fn engine(shared: &Shared, backend: Backend, part: Partition, head: bool, replay: Option<crate::replay::Replay>, mc: &ModelConfig) -> Engine {
    let cfg = &shared.cfg;
    shared.status.lock().unwrap().weight_bytes = backend.weight_bytes();
    *shared.limits.lock().unwrap() = Some((mc.vocab_size, mc.context_length));
    Engine {
        rank: cfg.rank as u32,
        backend,
        part,
        parallelism: cfg.parallelism,
        kv: cfg.kv,
        head,
        world: None,
        replay,
    }
}

fn notify(states: &[sd_notify::NotifyState]) {
    if let Err(e) = sd_notify::notify(states) {
        tracing::warn!("sd_notify: {e}");
    }
}

/// Binds a Unix socket: creates the parent directory, removes a stale socket (refusing if a
/// live server answers on it) and makes the socket mode 0600.
fn bind_unix(path: &Path) -> Result<tokio::net::UnixListener, ServeError> {
    use std::os::unix::fs::{FileTypeExt, PermissionsExt};
    let err = |source| ServeError::Listen { addr: path.display().to_string(), source };
    if let Some(dir) = path.parent().filter(|d| !d.as_os_str().is_empty()) {
        std::fs::create_dir_all(dir).map_err(err)?;
    }
    if let Ok(meta) = std::fs::symlink_metadata(path) {
        if !meta.file_type().is_socket() {
            return Err(err(std::io::Error::other("exists and is not a socket")));
        }
        if std::os::unix::net::UnixStream::connect(path).is_ok() {
            return Err(err(std::io::Error::new(std::io::ErrorKind::AddrInUse, "another server is listening on it")));
        }
        tracing::info!("removing stale socket {}", path.display());
        std::fs::remove_file(path).map_err(err)?;
    }
    // Created 0600 from the start (umask), then made sure of it.
    // SAFETY: umask only swaps the process file-mode mask; no memory is involved.
    let old = unsafe { libc::umask(0o177) };
    let l = tokio::net::UnixListener::bind(path);
    unsafe { libc::umask(old) };
    let l = l.map_err(err)?;
    std::fs::set_permissions(path, std::fs::Permissions::from_mode(0o600)).map_err(err)?;
    Ok(l)
}

/// Serves until Shutdown, SIGTERM or SIGINT.
pub async fn serve(cfg: ServeConfig) -> Result<(), ServeError> {
    if cfg.rank >= cfg.world_size {
        return Err(ServeError::Config(format!("rank {} outside world size {}", cfg.rank, cfg.world_size)));
    }
    if cfg.kv.page_size == 0 || cfg.kv.n_pages == 0 {
        return Err(ServeError::Config("--page-size and --kv-pages must be > 0".into()));
    }
    if let Some(p) = &cfg.test_replay {
        let msg = format!("!!! TEST REPLAY HOOK ENABLED ({}): scripted answers replace sampling. Never use in production. !!!", p.display());
        tracing::warn!("{msg}");
        eprintln!("{msg}");
    }
    if let Some(f) = &cfg.test_fault {
        let msg = format!("!!! TEST FAULT HOOK ENABLED ({f:?}): this rank will mis-track KV cache lengths. Never use in production. !!!");
        tracing::warn!("{msg}");
        eprintln!("{msg}");
    }
    let (health, health_svc) = tonic_health::server::health_reporter();
    let (shutdown_tx, mut shutdown_rx) = watch::channel(false);
    let shared = Arc::new(Shared {
        cfg: cfg.clone(),
        status: Mutex::new(Status_ { state: pb::RankState::Loading as i32, ..Default::default() }),
        engine: Mutex::new(None),
        seqs: Mutex::new(SeqTable::new(cfg.test_fault.clone())),
        limits: Mutex::new(None),
        pipe: Pipe::default(),
        late_rules: late_rules::LateRules::default(),
        transport: Mutex::new(None),
        comm_abort: Mutex::new(None),
        step_started: Mutex::new(None),
        last_compute_end: Mutex::new(None),
        health,
        shutdown: shutdown_tx,
        created_id: Mutex::new(None),
    });
    shared.set_health(false).await;

    // Background load, with systemd start-timeout extensions while it runs.
    {
        let shared = shared.clone();
        tokio::spawn(async move {
            let loader = {
                let shared = shared.clone();
                tokio::task::spawn_blocking(move || load(&shared))
            };
            let ticker = tokio::spawn(async {
                loop {
                    notify(&[sd_notify::NotifyState::ExtendTimeoutUsec(60_000_000), sd_notify::NotifyState::Status("loading weights")]);
                    tokio::time::sleep(Duration::from_secs(20)).await;
                }
            });
            let res = loader.await.unwrap_or_else(|e| Err(format!("loader panicked: {e}")));
            ticker.abort();
            match res {
                Ok(engine) => {
                    *shared.engine.lock().unwrap() = Some(engine);
                    shared.status.lock().unwrap().progress = 1.0;
                    shared.set_state(pb::RankState::Loaded, None);
                    tracing::info!(rank = shared.cfg.rank, "weights loaded; waiting for the collective JOIN");
                    notify(&[sd_notify::NotifyState::Ready, sd_notify::NotifyState::Status("loaded, waiting for JOIN")]);
                }
                Err(e) => {
                    tracing::error!("loading failed: {e}");
                    shared.set_state(pb::RankState::Failed, Some(format!("loading failed: {e}")));
                    let status = format!("FAILED: {e}");
                    notify(&[sd_notify::NotifyState::Ready, sd_notify::NotifyState::Status(&status)]);
                }
            }
        });
    }
    // Dead-peer watcher: Describe and health reflect a broken world without waiting for a
    // step, and a step blocked inside an NCCL collective on a dead peer is released by
    // aborting the communicator. Two signs, both outside NCCL: the test transport's sockets
    // to a peer closed (a killed process), or a step of an NCCL world ran past the
    // collective timeout (a peer host that vanished without closing its sockets).
    {
        let shared = shared.clone();
        tokio::spawn(async move {
            loop {
                tokio::time::sleep(Duration::from_millis(200)).await;
                let mut broken = shared.transport.lock().unwrap().as_ref().and_then(|t| t.broken());
                let nccl = shared.comm_abort.lock().unwrap().is_some();
                let started = *shared.step_started.lock().unwrap();
                if broken.is_none()
                    && nccl
                    && let Some(t) = started
                    && t.elapsed() > shared.cfg.collective_timeout
                {
                    broken = Some(format!("a step has run {:.1} s, over the collective timeout ({:?}): a peer is gone", t.elapsed().as_secs_f32(), shared.cfg.collective_timeout));
                }
                if let Some(why) = broken {
                    let sh = shared.clone();
                    let _ = tokio::task::spawn_blocking(move || {
                        if let Ok(mut e) = sh.engine.try_lock() {
                            sh.world_broken(e.as_mut(), &why);
                        } else {
                            // A step holds the engine: the aborts make it fail; it cleans up.
                            sh.world_broken(None, &why);
                        }
                    })
                    .await;
                    shared.set_health(false).await;
                }
            }
        });
    }

    let reflection_v1 = tonic_reflection::server::Builder::configure()
        .register_encoded_file_descriptor_set(pb::FILE_DESCRIPTOR_SET)
        .register_encoded_file_descriptor_set(tonic_health::pb::FILE_DESCRIPTOR_SET)
        .build_v1()
        .map_err(|e| ServeError::Config(format!("reflection: {e}")))?;
    let reflection_v1alpha = tonic_reflection::server::Builder::configure()
        .register_encoded_file_descriptor_set(pb::FILE_DESCRIPTOR_SET)
        .register_encoded_file_descriptor_set(tonic_health::pb::FILE_DESCRIPTOR_SET)
        .build_v1alpha()
        .map_err(|e| ServeError::Config(format!("reflection: {e}")))?;
    let router = tonic::transport::Server::builder()
        .add_service(RankServer::new(RankService { shared: shared.clone() }).max_decoding_message_size(256 << 20).max_encoding_message_size(256 << 20))
        .add_service(health_svc)
        .add_service(reflection_v1)
        .add_service(reflection_v1alpha);

    let stop_shared = shared.clone();
    let stop = async move {
        let mut term = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()).ok();
        tokio::select! {
            _ = shutdown_rx.wait_for(|v| *v) => {}
            _ = tokio::signal::ctrl_c() => tracing::info!("SIGINT"),
            _ = async { match term.as_mut() { Some(t) => { t.recv().await; } None => std::future::pending().await } } => tracing::info!("SIGTERM"),
        }
        notify(&[sd_notify::NotifyState::Stopping]);
        // The graceful stop waits for running RPCs: release a step blocked in a collective.
        let _ = tokio::task::spawn_blocking(move || stop_shared.abort_comms("shutting down")).await;
    };
    let res = if let Some(path) = cfg.listen.strip_prefix("unix://") {
        let path = PathBuf::from(path);
        let l = bind_unix(&path)?;
        tracing::info!(rank = cfg.rank, "serving on unix://{}", path.display());
        // Old Go clients (grpcurl 1.8.6) send the socket path as :authority; see `authority`.
        let incoming = tokio_stream::StreamExt::map(tokio_stream::wrappers::UnixListenerStream::new(l), |c| c.map(authority::AuthorityFix::new));
        let r = router.serve_with_incoming_shutdown(incoming, stop).await;
        let _ = std::fs::remove_file(&path);
        r
    } else {
        let l = tokio::net::TcpListener::bind(&cfg.listen).await.map_err(|source| ServeError::Listen { addr: cfg.listen.clone(), source })?;
        tracing::info!(rank = cfg.rank, "serving on {}", l.local_addr().map(|a| a.to_string()).unwrap_or_default());
        router.serve_with_incoming_shutdown(tcp_incoming(l), stop).await
    };
    shared.abort_comms("stopped");
    res?;
    Ok(())
}

/// The rank's accepted TCP connections with Nagle's algorithm off: a step's answer (HTTP/2
/// headers, data and trailers) must not wait for the gateway's delayed ACK when ranks serve
/// another host (the gateway's side sets `tcp_nodelay` on its endpoint).
fn tcp_incoming(l: tokio::net::TcpListener) -> impl tokio_stream::Stream<Item = std::io::Result<tokio::net::TcpStream>> {
    tokio_stream::StreamExt::map(tokio_stream::wrappers::TcpListenerStream::new(l), |c| {
        c.and_then(|s| {
            s.set_nodelay(true)?;
            Ok(s)
        })
    })
}

#[cfg(test)]
mod tcp_tests {
    /// Every connection the rank accepts over TCP has TCP_NODELAY set.
    #[tokio::test]
    async fn accepted_tcp_connections_have_nodelay() {
        let l = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = l.local_addr().unwrap();
        let mut incoming = Box::pin(super::tcp_incoming(l));
        for _ in 0..2 {
            let client = tokio::net::TcpStream::connect(addr).await.unwrap();
            let s = tokio_stream::StreamExt::next(&mut incoming).await.unwrap().unwrap();
            assert!(s.nodelay().unwrap(), "accepted connection without TCP_NODELAY");
            drop(client);
        }
    }
}

#[cfg(test)]
mod pipe_tests {
    use std::sync::{Arc, Mutex};
    use std::time::{Duration, Instant};

    use super::Pipe;

    /// Overlapped decode's order on one rank: steps launch in ticket order, each only after
    /// every step but the one before it was answered; answers come in ticket order; a step
    /// that needs the answer of the step before (a host-fed token) waits for it while holding
    /// its turn, and nothing deadlocks.
    #[test]
    fn launches_and_answers_keep_ticket_order() {
        let pipe = Arc::new(Pipe::default());
        pipe.reset();
        let epoch = pipe.epoch();
        let n = 24u64;
        let tickets: Vec<u64> = (0..n).map(|i| pipe.pass(1000 + i, epoch, true).expect("a ticket")).collect();
        assert_eq!(tickets, (0..n).collect::<Vec<_>>());
        // (event, ticket), in the order they happened.
        let log = Arc::new(Mutex::new(Vec::<(&str, u64)>::new()));
        let ready = || true;
        let threads: Vec<_> = tickets
            .iter()
            .rev() // started out of order on purpose
            .map(|&t| {
                let (pipe, log) = (pipe.clone(), log.clone());
                std::thread::spawn(move || {
                    pipe.wait_turn(t, epoch, &ready).unwrap();
                    if t % 5 == 3 {
                        // Needs the token only the previous step's answer gives.
                        pipe.wait_finished(t, epoch, &ready).unwrap();
                        log.lock().unwrap().push(("waited", t));
                    }
                    pipe.compute_started();
                    log.lock().unwrap().push(("launch", t));
                    pipe.done(t, epoch);
                    pipe.wait_finished(t, epoch, &ready).unwrap();
                    // The read-back takes a while (the GPU).
                    std::thread::sleep(Duration::from_micros(300 * (t % 3)));
                    log.lock().unwrap().push(("answer", t));
                    pipe.finished(t, epoch);
                })
            })
            .collect();
        let deadline = Instant::now() + Duration::from_secs(20);
        for th in threads {
            while !th.is_finished() {
                assert!(Instant::now() < deadline, "the pipe deadlocked");
                std::thread::sleep(Duration::from_millis(5));
            }
            th.join().unwrap();
        }
        let log = log.lock().unwrap();
        let pos = |ev: &str, t: u64| log.iter().position(|&(e, x)| e == ev && x == t).unwrap_or_else(|| panic!("no {ev} {t}"));
        for t in 0..n {
            if t > 0 {
                assert!(pos("launch", t - 1) < pos("launch", t), "launch {t} before launch {}", t - 1);
                assert!(pos("answer", t - 1) < pos("answer", t), "answer {t} before answer {}", t - 1);
            }
            if t > 1 {
                assert!(pos("answer", t - 2) < pos("launch", t), "launch {t} before answer {}", t - 2);
            }
            if t % 5 == 3 && t > 0 {
                assert!(pos("answer", t - 1) < pos("waited", t), "step {t} fed before the answer it needs");
            }
        }
        // A new world: waiters of the old one give up instead of hanging.
        let t = pipe.pass(5000, epoch, true).unwrap();
        let p2 = pipe.clone();
        let waiter = std::thread::spawn(move || p2.wait_finished(t + 1, epoch, &|| true));
        std::thread::sleep(Duration::from_millis(20));
        pipe.reset();
        assert!(waiter.join().unwrap().is_err(), "a waiter of a reset world must give up");
    }
}
