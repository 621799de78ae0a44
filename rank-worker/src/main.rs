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
use minimax_shared::model::synthetic::SyntheticSpec;

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
    /// BENCHMARK ONLY: write a synthetic model (MiniMax-M2.7 shapes, random valid weights) as
    /// a GGUF file, e.g. to measure weight loading on a file of tens of GB.
    WriteSynthetic {
        /// `m2.7:MIX[:LAYERS]`, MIX = iq4xs | iq4xs-q8out | q4km | q8_0.
        spec: String,
        /// The .gguf file to write.
        out: std::path::PathBuf,
        #[arg(long, default_value_t = 42)]
        seed: u64,
        /// Copy the tokenizer (`tokenizer.*` metadata) of this GGUF into the file, so the
        /// gateway can serve it with `--model` (synthetic weights served by `--synthetic` are
        /// filled on the device instead, with no file).
        #[arg(long)]
        tokenizer_from: Option<std::path::PathBuf>,
    },
    /// Compile every CUDA kernel with NVRTC into the kernel cache (`$MINIMAX_KERNEL_CACHE`,
    /// see docs/CUDA.md) for the given architectures, so ranks start without compiling.
    /// Needs libnvrtc, no GPU.
    BuildKernels {
        /// Compute capabilities, e.g. `90` (H100/H200) or `120` (RTX Blackwell).
        #[arg(long, value_delimiter = ',', default_value = "90")]
        arch: Vec<u32>,
    },
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
    #[arg(long, env = "MINIMAX_MODEL", required_unless_present = "synthetic")]
    model: Option<std::path::PathBuf>,
    /// BENCHMARK ONLY: serve a synthetic model with MiniMax-M2.7's shapes and random weights
    /// instead of `--model`: `m2.7:MIX[:LAYERS]`, MIX = iq4xs | iq4xs-q8out | q4km | q8_0. Needs
    /// `--allow-synthetic`. Several ranks each hold their share of the same model (seed 42),
    /// tensor or pipeline parallel like a GGUF.
    #[arg(long, conflicts_with = "model")]
    synthetic: Option<String>,
    /// Confirms `--synthetic` (its answers are noise).
    #[arg(long)]
    allow_synthetic: bool,
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
    let (Some(rank), Some(listen)) = (a.rank, a.listen) else {
        eprintln!("error: serving needs --rank, --listen and --model");
        return ExitCode::from(2);
    };
    let synthetic = match synthetic_spec(a.synthetic.as_deref(), a.allow_synthetic) {
        Ok(s) => s,
        Err(e) => {
            eprintln!("error: {e}");
            return ExitCode::from(2);
        }
    };
    let model = match (a.model, &synthetic) {
        (Some(m), None) => m,
        (None, Some(_)) => std::path::PathBuf::new(),
        _ => {
            eprintln!("error: serving needs --model (or --synthetic with --allow-synthetic)");
            return ExitCode::from(2);
        }
    };
    let cfg = ServeConfig {
        rank,
        world_size: a.world_size,
        listen,
        model,
        synthetic,
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

/// Parses `--synthetic`; refused without `--allow-synthetic`.
fn synthetic_spec(spec: Option<&str>, allowed: bool) -> Result<Option<SyntheticSpec>, String> {
    let Some(spec) = spec else { return Ok(None) };
    if !allowed {
        return Err(format!("--synthetic {spec} serves random weights (benchmarks only); add --allow-synthetic to confirm"));
    }
    SyntheticSpec::parse(spec).map(Some).map_err(|e| e.to_string())
}

fn write_synthetic(spec: &str, out: &std::path::Path, seed: u64, tokenizer_from: Option<&std::path::Path>) -> Result<String, String> {
    use minimax_shared::model::synthetic_gguf::{tokenizer_meta, write_gguf};
    let spec = SyntheticSpec::parse(spec).map_err(|e| e.to_string())?;
    let extra = match tokenizer_from {
        Some(p) => {
            let m = GgufModel::open(p).map_err(|e| e.to_string())?;
            let t = tokenizer_meta(m.metadata());
            if t.is_empty() {
                return Err(format!("{}: no tokenizer.* metadata", p.display()));
            }
            t
        }
        None => Vec::new(),
    };
    let t0 = std::time::Instant::now();
    let io = |e: std::io::Error| format!("{}: {e}", out.display());
    let mut w = std::io::BufWriter::with_capacity(8 << 20, std::fs::File::create(out).map_err(io)?);
    let n = write_gguf(&spec, seed, &extra, &mut w).map_err(io)?;
    let f = w.into_inner().map_err(|e| io(e.into_error()))?;
    f.sync_all().map_err(io)?;
    let s = t0.elapsed().as_secs_f64();
    Ok(format!("wrote {} ({} layers): {:.2} GB in {s:.1} s ({:.2} GB/s, synced)", out.display(), spec.layers, n as f64 / 1e9, n as f64 / 1e9 / s))
}

#[cfg(feature = "cuda")]
fn build_kernels(archs: &[u32]) -> Result<String, String> {
    use minimax_rank::cuda::nvrtc;
    nvrtc::ensure_nvrtc().map_err(|e| e.to_string())?;
    let dir = nvrtc::cache_dir().ok_or("no kernel cache directory (set MINIMAX_KERNEL_CACHE)")?;
    let mut lines = Vec::new();
    for &arch in archs {
        let t0 = std::time::Instant::now();
        let built = nvrtc::build_all(arch).map_err(|e| e.to_string())?;
        let compiled = built.iter().filter(|b| b.2 == nvrtc::Origin::Compiled).count();
        lines.push(format!("sm_{arch}: {} modules ({compiled} compiled, the rest cached) in {:.1} s", built.len(), t0.elapsed().as_secs_f64()));
    }
    lines.push(format!("cache: {}", dir.display()));
    Ok(lines.join("\n"))
}

#[cfg(not(feature = "cuda"))]
fn build_kernels(_: &[u32]) -> Result<String, String> {
    Err("this build has no CUDA backend (feature `cuda` off)".into())
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
        Some(Cmd::WriteSynthetic { spec, out, seed, tokenizer_from }) => report(write_synthetic(&spec, &out, seed, tokenizer_from.as_deref())),
        Some(Cmd::BuildKernels { arch }) => report(build_kernels(&arch)),
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

/// Prints a subcommand's result (stdout) or error (stderr, exit 1).
fn report(r: Result<String, String>) -> ExitCode {
    match r {
        Ok(msg) => {
            println!("{msg}");
            ExitCode::SUCCESS
        }
        Err(e) => {
            eprintln!("error: {e}");
            ExitCode::FAILURE
        }
    }
}

fn init_tracing() {
    let filter = tracing_subscriber::EnvFilter::try_from_default_env().unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info"));
    tracing_subscriber::fmt().with_env_filter(filter).with_writer(std::io::stderr).init();
}
