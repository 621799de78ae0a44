//! `minimax-gateway`: starts (or attaches to) the rank-workers, runs the engine and serves.

use std::process::ExitCode;
use std::time::Duration;

use clap::Parser;
use minimax_gateway::cli::EngineArgs;
use minimax_gateway::engine::Engine;

/// MiniMax Serve gateway. Every flag also reads the environment variable shown.
#[derive(Parser, Debug)]
#[command(name = "minimax-gateway", version, about = "MiniMax Serve gateway: OpenAI-compatible API in front of the rank-workers")]
struct Cli {
    #[command(flatten)]
    engine: EngineArgs,
    #[command(flatten)]
    api: minimax_gateway::api::config::ApiArgs,
}

fn main() -> ExitCode {
    tracing_subscriber::fmt().with_env_filter(tracing_subscriber::EnvFilter::try_from_default_env().unwrap_or_else(|_| "info".into())).with_writer(std::io::stderr).init();
    let cli = Cli::parse();
    let rt = match tokio::runtime::Builder::new_multi_thread().enable_all().build() {
        Ok(rt) => rt,
        Err(e) => {
            eprintln!("error: tokio runtime: {e}");
            return ExitCode::FAILURE;
        }
    };
    match rt.block_on(run(cli)) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("error: {e:#}");
            ExitCode::FAILURE
        }
    }
}

async fn run(cli: Cli) -> anyhow::Result<()> {
    let cfg = cli.engine.engine_config()?;
    if cli.engine.dry_run {
        return dry_run(&cli.engine, cfg).await;
    }
    let engine = Engine::start(cfg);
    // Log when the ranks are up (the HTTP layer answers 503 until then).
    let waiter = engine.clone();
    tokio::spawn(async move {
        match waiter.wait_ready(Duration::from_secs(24 * 3600)).await {
            Ok(info) => tracing::info!(model = %info.model.name, world_size = info.world_size, "ranks ready"),
            Err(e) => tracing::error!(error = %e, "ranks did not become ready"),
        }
    });
    // HTTP layer (issue 5): serves until SIGINT/SIGTERM; answers 503 until the ranks are ready.
    // The GGUF's metadata (tokenizer, template, model card), or the synthetic model's.
    let meta = cli.engine.model_metadata()?;
    let state = minimax_gateway::api::engine_backend::app_state(engine.clone(), &meta, cli.api)?;
    drop(meta);
    let served = minimax_gateway::api::serve(state, shutdown_signal()).await;
    tracing::info!("shutting down");
    engine.shutdown().await;
    served
}

/// Parse shards, build the tokenizer, start the ranks, run the collective self-test, exit.
async fn dry_run(args: &EngineArgs, mut cfg: minimax_gateway::engine::EngineConfig) -> anyhow::Result<()> {
    // One attempt: a dry run reports the first failure instead of retrying.
    cfg.world.max_restart_attempts = 1;
    use minimax_gateway::ranks::supervisor::WorldMode;
    if let Some(spec) = args.synthetic_spec()? {
        let meta = args.model_metadata()?;
        let format = minimax_gateway::text::format::ModelFormat::minimax_m2();
        let tok = minimax_gateway::text::tokenizer::Tokenizer::from_gguf_metadata(&meta, &format).map_err(|e| anyhow::anyhow!("tokenizer: {e}"))?;
        println!("model: SYNTHETIC {:?} ({} layers, random weights; benchmarks only)", spec.mix, spec.layers);
        println!("tokenizer: {} tokens", tok.vocab_size());
    } else if let WorldMode::Spawn(s) = &cfg.world.mode {
        let model = minimax_shared::gguf::GgufModel::open(&s.model).map_err(|e| anyhow::anyhow!("{}: {e}", s.model.display()))?;
        println!("model: {} ({} shard(s), {} tensors)", s.model.display(), model.shards().len(), model.tensors().count());
        let format = minimax_gateway::text::format::ModelFormat::minimax_m2();
        let tok = minimax_gateway::text::tokenizer::Tokenizer::from_gguf_metadata(model.metadata(), &format).map_err(|e| anyhow::anyhow!("tokenizer: {e}"))?;
        println!("tokenizer: {} tokens", tok.vocab_size());
    } else if let Some(m) = &args.model {
        let model = minimax_shared::gguf::GgufModel::open(m).map_err(|e| anyhow::anyhow!("{}: {e}", m.display()))?;
        println!("model: {} ({} shard(s))", m.display(), model.shards().len());
    }
    let timeout = cfg.world.load_timeout + cfg.world.collective_timeout;
    let engine = Engine::start(cfg);
    let res = engine.wait_ready(timeout).await;
    match &res {
        Ok(info) => {
            println!(
                "ranks: {} ready ({}, {}), collective self-test passed; KV {} pages x {} tokens; model {:?}, context {}, vocab {}",
                info.world_size, info.parallelism, info.device, info.n_pages, info.page_size, info.model.name, info.model.context_length, info.model.vocab_size
            );
        }
        Err(e) => eprintln!("dry run failed: {e}"),
    }
    engine.shutdown().await;
    res.map(|_| ()).map_err(|e| anyhow::anyhow!("{e}"))
}

async fn shutdown_signal() {
    let ctrl_c = tokio::signal::ctrl_c();
    let mut term = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()).expect("SIGTERM handler");
    tokio::select! {
        _ = ctrl_c => {}
        _ = term.recv() => {}
    }
}
