//! `minimax-rank`: one process per device. `minimax-rank inspect MODEL` prints a model summary;
//! `minimax-rank serve ...` (or the same flags without `serve`) runs a rank. See `docs/RANK.md`.

use std::process::ExitCode;
use std::time::Duration;

use clap::{Args, Parser, Subcommand};
use minimax_rank::backend::{Device, Parallelism};
use minimax_rank::cpu::KvSpec;
use minimax_rank::server::{ServeConfig, serve};
use minimax_rank::state::TestFault;
use minimax_shared::gguf::GgufModel;

#[derive(Parser)]
#[command(name = "minimax-rank", version, about = "MiniMax Serve rank-worker", args_conflicts_with_subcommands = true, subcommand_negates_reqs = true)]
struct Cli {
    #[command(subcommand)]
    cmd: Option<Cmd>,
    /// Serving flags may also be given without the `serve` subcommand.
    #[command(flatten)]
    serve: ServeArgs,
}

#[derive(Subcommand)]
enum Cmd {
    /// Print a model's summary: architecture, hyper-parameters, shards, tensor types.
    Inspect {
        /// A .gguf file, the first shard of a split model, or a directory.
        model: std::path::PathBuf,
    },
    /// Load this rank's shard and serve the rank gRPC API (plus health and reflection).
    Serve(ServeArgs),
}

#[derive(Args, Clone, Debug)]
struct ServeArgs {
    /// This rank's index in the world.
    #[arg(long, env = "MINIMAX_RANK", required = true)]
    rank: Option<usize>,
    /// Number of ranks in the world.
    #[arg(long, env = "MINIMAX_WORLD_SIZE", default_value_t = 1)]
    world_size: usize,
    /// `unix:///run/minimax/rank-0.sock` (mode 0600) or `host:port`.
    #[arg(long, env = "MINIMAX_LISTEN", required = true)]
    listen: Option<String>,
    /// A .gguf file, the first shard of a split model, or a directory.
    #[arg(long, env = "MINIMAX_MODEL", required = true)]
    model: Option<std::path::PathBuf>,
    /// `cpu` or `cuda:K`.
    #[arg(long, env = "MINIMAX_DEVICE", default_value = "cpu")]
    device: Device,
    /// How the world splits the model.
    #[arg(long, value_enum, env = "MINIMAX_PARALLELISM", default_value = "pipeline")]
    parallelism: Parallelism,
    /// KV tokens per page (must match the gateway's).
    #[arg(long, default_value_t = 64)]
    page_size: usize,
    /// KV pages this rank allocates.
    #[arg(long, default_value_t = 256)]
    kv_pages: usize,
    /// Bound on each collective/transport wait during a step (a silent peer is an error).
    #[arg(long, default_value_t = 120_000)]
    collective_timeout_ms: u64,
    /// TEST ONLY: make this rank mis-track KV cache lengths (hidden).
    #[arg(long, hide = true)]
    test_fault: Option<TestFault>,
    /// TEST ONLY: replay scripted answers (see rank-worker/src/replay.rs); needs
    /// MINIMAX_ALLOW_TEST_HOOKS=1 (hidden).
    #[arg(long, env = "MINIMAX_TEST_REPLAY", hide = true, hide_env = true)]
    test_replay: Option<std::path::PathBuf>,
}

fn run_serve(a: ServeArgs) -> ExitCode {
    let (Some(rank), Some(listen), Some(model)) = (a.rank, a.listen, a.model) else {
        eprintln!("error: serving needs --rank, --listen and --model");
        return ExitCode::from(2);
    };
    let cfg = ServeConfig {
        rank,
        world_size: a.world_size,
        listen,
        model,
        device: a.device,
        parallelism: a.parallelism,
        kv: KvSpec { page_size: a.page_size, n_pages: a.kv_pages },
        collective_timeout: Duration::from_millis(a.collective_timeout_ms),
        test_fault: a.test_fault,
        test_replay: a.test_replay,
    };
    let rt = match tokio::runtime::Builder::new_multi_thread().enable_all().worker_threads(2).build() {
        Ok(rt) => rt,
        Err(e) => {
            eprintln!("error: tokio runtime: {e}");
            return ExitCode::FAILURE;
        }
    };
    match rt.block_on(serve(cfg)) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            tracing::error!("{e}");
            eprintln!("error: {e}");
            ExitCode::FAILURE
        }
    }
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    match cli.cmd {
        Some(Cmd::Inspect { model }) => match GgufModel::open(&model) {
            Ok(m) => {
                print!("{}", minimax_rank::inspect::summary(&m));
                ExitCode::SUCCESS
            }
            Err(e) => {
                eprintln!("error: {e}");
                ExitCode::FAILURE
            }
        },
        Some(Cmd::Serve(a)) => {
            init_tracing();
            run_serve(a)
        }
        None => {
            init_tracing();
            run_serve(cli.serve)
        }
    }
}

fn init_tracing() {
    let filter = tracing_subscriber::EnvFilter::try_from_default_env().unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info"));
    tracing_subscriber::fmt().with_env_filter(filter).with_writer(std::io::stderr).init();
}
