//! The rank world behind the engine: gRPC clients, the collective handshake, and the
//! supervisor that starts (or attaches to) the ranks, watches them and restarts the whole
//! world when one fails.
//!
//! The engine talks to a [`RankWorld`]: send one step to every rank and get every rank's
//! answer, release sequences, and watch the world's [`WorldState`]. The real implementation
//! is [`supervisor::Supervisor`] (child processes or attached systemd units over gRPC);
//! tests can plug in an in-process world.

pub mod client;
pub mod fake;
pub mod supervisor;

use std::future::Future;
use std::pin::Pin;

use minimax_proto::v1::{StepRequest, StepResponse};
use tokio::sync::watch;

use crate::engine::RankHealth;

/// A boxed future (the trait is object safe).
pub type BoxFuture<'a, T> = Pin<Box<dyn Future<Output = T> + Send + 'a>>;

/// The model as the ranks describe it.
#[derive(Clone, Debug, PartialEq, Default)]
pub struct ModelSummary {
    pub name: String,
    pub architecture: String,
    pub n_layers: u32,
    pub vocab_size: u32,
    pub context_length: u32,
}

/// A world that is up: every rank joined the collective and passed the self-test.
#[derive(Clone, Debug, PartialEq)]
pub struct WorldInfo {
    /// Increases with every (re)start; a step sent to an older generation fails.
    pub generation: u64,
    pub world_size: u32,
    /// KV tokens per page (all ranks agree).
    pub page_size: u32,
    /// KV pages the world can hold (the smallest over the ranks).
    pub n_pages: u32,
    /// The rank whose step answers carry the row outputs.
    pub head_rank: u32,
    pub parallelism: String,
    pub device: String,
    pub model: ModelSummary,
    /// Every rank runs a step's forward before the rules of its late rows arrive
    /// (`DescribeResponse.late_forward`), so the scheduler may plan structured outputs ahead.
    pub late_forward: bool,
}

/// Where the world stands.
#[derive(Clone, Debug, PartialEq)]
pub enum WorldState {
    /// First start: ranks loading / joining.
    Starting,
    /// Serving.
    Ready(WorldInfo),
    /// A rank failed; the world is being torn down and started again.
    Restarting { reason: String, attempt: u32 },
    /// Gave up (or shut down): nothing will be served.
    Failed(String),
}

impl WorldState {
    pub fn ready(&self) -> Option<&WorldInfo> {
        match self {
            WorldState::Ready(i) => Some(i),
            _ => None,
        }
    }

    /// A short description for errors.
    pub fn describe(&self) -> String {
        match self {
            WorldState::Starting => "ranks are starting (loading weights / joining the collective)".into(),
            WorldState::Ready(_) => "ready".into(),
            WorldState::Restarting { reason, attempt } => format!("ranks are restarting (attempt {attempt}) after: {reason}"),
            WorldState::Failed(r) => format!("ranks failed: {r}"),
        }
    }
}

/// The world broke (a rank died, a transport failed, a step timed out) or is not up.
#[derive(Clone, Debug, PartialEq, thiserror::Error)]
pub enum WorldError {
    #[error("{0}")]
    Broken(String),
    /// A rank refused the step as a whole before changing any state (INVALID_ARGUMENT: the
    /// batch is invalid, the same on every rank): only that step's sequences fail.
    #[error("{0}")]
    Rejected(String),
    #[error("{0}")]
    NotReady(String),
}

/// What the engine needs from the ranks.
pub trait RankWorld: Send + Sync + 'static {
    /// Sends the same step to every rank of generation `generation` and returns every rank's
    /// answer, indexed by rank. Any transport failure or timeout is `Broken`.
    fn step(&self, generation: u64, req: StepRequest) -> BoxFuture<'_, Result<Vec<StepResponse>, WorldError>>;
    /// Forgets sequences on every rank (best effort; errors surface on the next step).
    fn release(&self, generation: u64, seq_ids: Vec<u64>) -> BoxFuture<'_, Result<(), WorldError>>;
    /// The world's state, as it changes.
    fn subscribe(&self) -> watch::Receiver<WorldState>;
    /// The engine saw generation `generation` break (step failure): tear it down and restart.
    fn report_broken(&self, generation: u64, reason: String);
    /// Each rank's state for `/health`.
    fn health(&self) -> Vec<RankHealth>;
    /// How many times the world was restarted after a failure.
    fn restarts(&self) -> u64;
    /// Stops the ranks this world started (attached ranks are left running).
    fn shutdown(&self) -> BoxFuture<'_, ()>;
}
