//! Set-up shared by the engine tests that run REAL rank processes (`minimax-rank serve`, CPU
//! backend, the m2-small fixture): the rank binary, a spawned world's configuration, greedy
//! requests, shutdown and the ranks' PIDs. Every wait is bounded.
#![allow(dead_code)]

use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU32, Ordering};
use std::time::Duration;

use minimax_gateway::engine::{Engine, EngineError, FinishReason, GenEvent, GenStream, GenerationRequest, SamplingParams, Usage};
use minimax_gateway::ranks::supervisor::{SpawnConfig, WorldConfig, WorldMode};

/// The KV page size of every spawned test world.
pub const PAGE: u32 = 16;

/// The repository root.
pub fn root() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("..")
}

/// The rank binary: `$MINIMAX_RANK_BINARY`, else `target/debug/minimax-rank` (built once per
/// test binary with `cargo build -p minimax-rank`).
pub fn rank_binary() -> PathBuf {
    if let Some(p) = std::env::var_os("MINIMAX_RANK_BINARY") {
        return PathBuf::from(p);
    }
    let target = std::env::var_os("CARGO_TARGET_DIR").map(PathBuf::from).unwrap_or_else(|| root().join("target"));
    let bin = target.join("debug/minimax-rank");
    static BUILD: std::sync::Once = std::sync::Once::new();
    BUILD.call_once(|| {
        let cargo = std::env::var("CARGO").unwrap_or_else(|_| "cargo".into());
        let st = std::process::Command::new(cargo).args(["build", "-q", "-p", "minimax-rank", "--bin", "minimax-rank"]).current_dir(root()).status().expect("running cargo build -p minimax-rank");
        if !st.success() {
            eprintln!("warning: cargo build -p minimax-rank failed; using the existing binary if any");
        }
    });
    assert!(bin.is_file(), "{} not found", bin.display());
    bin
}

static RUN: AtomicU32 = AtomicU32::new(0);

/// A fresh, empty run directory `TMP/PREFIX-PID-N` for one world's sockets.
pub fn run_dir(prefix: &str) -> PathBuf {
    let d = std::env::temp_dir().join(format!("{prefix}-{}-{}", std::process::id(), RUN.fetch_add(1, Ordering::SeqCst)));
    let _ = std::fs::remove_dir_all(&d);
    d
}

/// A spawned world of `world` CPU ranks on the m2-small q8_0 fixture with short timeouts, and
/// its run directory (`prefix` names it). Ranks log at `$MINIMAX_TEST_RANK_LOG` (else `warn`).
pub fn spawn_world(prefix: &str, world: usize, parallelism: &str, kv_pages: u32, rank_args: Vec<(u32, Vec<String>)>) -> (WorldConfig, PathBuf) {
    let dir = run_dir(prefix);
    let spawn = SpawnConfig {
        rank_binary: rank_binary(),
        model: root().join("fixtures/m2-small/q8_0.gguf"),
        synthetic: None,
        devices: vec!["cpu".into(); world],
        parallelism: parallelism.into(),
        page_size: PAGE,
        kv_pages: Some(kv_pages),
        run_dir: dir.clone(),
        extra_args: vec![],
        rank_args,
        env: vec![("RUST_LOG".into(), std::env::var("MINIMAX_TEST_RANK_LOG").unwrap_or_else(|_| "warn".into()))],
    };
    let mut w = WorldConfig::new(WorldMode::Spawn(spawn));
    w.load_timeout = Duration::from_secs(60);
    w.collective_timeout = Duration::from_secs(30);
    w.step_timeout = Duration::from_secs(30);
    w.health_interval = Duration::from_millis(200);
    w.restart_backoff_initial = Duration::from_millis(200);
    (w, dir)
}

/// Shuts the engine down (at most 30 s) and removes its run directory.
pub async fn stop(engine: Engine, dir: PathBuf) {
    tokio::time::timeout(Duration::from_secs(30), engine.shutdown()).await.expect("shutdown in time");
    let _ = std::fs::remove_dir_all(dir);
}

/// A deterministic prompt of `n` tokens; `salt` picks which.
pub fn prompt(n: usize, salt: u32) -> Vec<u32> {
    (0..n as u32).map(|i| (i * 37 + salt * 101 + 11) % 997 + 1).collect()
}

/// A greedy (temperature 0) request without stop tokens.
pub fn greedy_req(id: &str, prompt: Vec<u32>, max_tokens: u32) -> GenerationRequest {
    GenerationRequest { request_id: id.into(), prompt, max_tokens, sampling: SamplingParams { temperature: 0.0, ..Default::default() }, stop_token_ids: vec![] }
}

/// PIDs of the rank processes serving sockets under `dir`, by rank.
pub fn rank_pids(dir: &Path) -> Vec<(u32, i32)> {
    let mut out = vec![];
    let needle = dir.to_string_lossy().to_string();
    for e in std::fs::read_dir("/proc").unwrap().flatten() {
        let Ok(pid) = e.file_name().to_string_lossy().parse::<i32>() else { continue };
        let Ok(cmd) = std::fs::read(format!("/proc/{pid}/cmdline")) else { continue };
        let args: Vec<String> = cmd.split(|&b| b == 0).map(|a| String::from_utf8_lossy(a).to_string()).collect();
        if args.iter().any(|a| a.contains(&needle))
            && args.iter().any(|a| a == "serve")
            && let Some(i) = args.iter().position(|a| a == "--rank")
        {
            out.push((args[i + 1].parse().unwrap(), pid));
        }
    }
    out.sort();
    out
}

/// The first event of `stream` after its tokens (`None`: closed without one); failing the
/// test with `what` when none comes within `limit`.
pub async fn end_event(stream: &mut GenStream, limit: Duration, what: &str) -> Option<GenEvent> {
    tokio::time::timeout(limit, async {
        loop {
            match stream.recv().await {
                Some(GenEvent::Token { .. }) => continue,
                other => return other,
            }
        }
    })
    .await
    .expect(what)
}

/// A finished stream's events as its tokens and how it ended (finish reason and usage, or
/// the error; `Internal("no terminal event")` when neither came).
pub fn tokens_and_end(events: Vec<GenEvent>) -> (Vec<u32>, Result<(FinishReason, Usage), EngineError>) {
    let mut tokens = vec![];
    let mut finish = Err(EngineError::Internal("no terminal event".into()));
    for e in events {
        match e {
            GenEvent::Started { .. } => {}
            GenEvent::Token { id, .. } => tokens.push(id),
            GenEvent::Finished { reason, usage, .. } => finish = Ok((reason, usage)),
            GenEvent::Failed(e) => finish = Err(e),
        }
    }
    (tokens, finish)
}
