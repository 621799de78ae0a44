//! Engine flags of `minimax-gateway` (model, ranks, KV cache, batching, supervision). Every
//! flag also reads an environment variable, so systemd units can use an `EnvironmentFile`.
//!
//! The binary's parser (`main.rs`) is one clap struct that flattens [`EngineArgs`] and the HTTP
//! layer's `ApiArgs`; a new group of flags is one more `#[command(flatten)]`.

use std::path::{Path, PathBuf};
use std::time::Duration;

use anyhow::{Context, bail};
use clap::{Args, ValueEnum};

use minimax_shared::gguf::{GgufModel, Metadata};
use minimax_shared::model::synthetic::SyntheticSpec;

use crate::engine::EngineConfig;
use crate::ranks::client::RankAddr;
use crate::ranks::supervisor::{SpawnConfig, WorldConfig, WorldMode};
use crate::sched::SchedConfig;

/// How the model is split over the ranks.
#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub enum Parallelism {
    /// Attention heads and expert columns split across ranks (every rank every layer).
    Tensor,
    /// Contiguous layer ranges per rank.
    Pipeline,
}

impl Parallelism {
    pub fn as_str(self) -> &'static str {
        match self {
            Parallelism::Tensor => "tensor",
            Parallelism::Pipeline => "pipeline",
        }
    }
}

/// A switch flag (`--overlap on|off`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub enum OnOff {
    On,
    Off,
}

/// Flags of the engine: where the model and the ranks are, and how to batch.
#[derive(Debug, Clone, Args)]
#[command(next_help_heading = "Model and ranks")]
pub struct EngineArgs {
    /// GGUF model: a .gguf file, the first shard of a split model, or a directory. Default:
    /// the bundled demo model (see `--model` in the README).
    #[arg(long, env = "MINIMAX_MODEL")]
    pub model: Option<PathBuf>,

    /// BENCHMARK ONLY: serve a synthetic model with MiniMax-M2.7's shapes and random weights
    /// (`m2.7:MIX[:LAYERS]`, MIX = iq4xs | iq4xs-q8out | q4km | q8_0) instead of `--model`: one rank, the
    /// tokenizer from `--synthetic-vocab-from`. Needs `--allow-synthetic`.
    #[arg(long, env = "MINIMAX_SYNTHETIC", conflicts_with = "model")]
    pub synthetic: Option<String>,

    /// With `--synthetic`: the GGUF whose tokenizer and chat template are used, its vocabulary
    /// padded with unused tokens to the synthetic model's (default: the bundled demo model).
    #[arg(long, env = "MINIMAX_SYNTHETIC_VOCAB_FROM", requires = "synthetic")]
    pub synthetic_vocab_from: Option<PathBuf>,

    /// Confirms `--synthetic` (its answers are noise).
    #[arg(long, env = "MINIMAX_ALLOW_SYNTHETIC")]
    pub allow_synthetic: bool,

    /// GPUs to run one rank each on, e.g. `0,1` (sets the world size; device cuda).
    #[arg(long, env = "MINIMAX_GPUS", value_delimiter = ',', conflicts_with = "ranks")]
    pub gpus: Vec<u32>,

    /// Number of local ranks to start when no GPUs are given.
    #[arg(long, env = "MINIMAX_WORLD_SIZE", default_value_t = 1)]
    pub world_size: u32,

    /// Device of local ranks without `--gpus`: `cpu` (the reference backend) or `cuda`
    /// (ranks take cuda:0..world_size).
    #[arg(long, env = "MINIMAX_DEVICE", default_value = "cpu")]
    pub device: String,

    /// How the model is split over the ranks.
    #[arg(long, env = "MINIMAX_PARALLELISM", value_enum, default_value_t = Parallelism::Tensor)]
    pub parallelism: Parallelism,

    /// Attach to ranks run elsewhere (systemd units) instead of starting them, in rank order:
    /// `unix:///run/minimax/rank-0.sock,unix:///run/minimax/rank-1.sock` or `host:port,...`.
    #[arg(long, env = "MINIMAX_RANKS", value_delimiter = ',')]
    pub ranks: Vec<String>,

    /// The `minimax-rank` binary (default: next to this binary, then on PATH).
    #[arg(long, env = "MINIMAX_RANK_BINARY")]
    pub rank_binary: Option<PathBuf>,

    /// Extra argument passed to every started rank (repeatable).
    #[arg(long = "rank-arg", env = "MINIMAX_RANK_ARGS", value_delimiter = ' ', allow_hyphen_values = true)]
    pub rank_args: Vec<String>,

    /// Directory for the started ranks' unix sockets (default: $XDG_RUNTIME_DIR or /tmp, per
    /// gateway process).
    #[arg(long, env = "MINIMAX_RUN_DIR")]
    pub run_dir: Option<PathBuf>,

    /// CPU test transport: the address each rank listens on for activations, in rank order
    /// (default: free loopback ports, for ranks on this host).
    #[arg(long, env = "MINIMAX_PEER_ADDRS", value_delimiter = ',')]
    pub peer_addrs: Vec<String>,

    /// KV tokens per page (prefix-cache granularity).
    #[arg(long, env = "MINIMAX_PAGE_SIZE", default_value_t = 64)]
    pub page_size: u32,

    /// KV pages per started rank (default: the rank decides from its memory).
    #[arg(long, env = "MINIMAX_KV_PAGES")]
    pub kv_pages: Option<u32>,

    /// Largest prefill chunk of one request in one step (tokens).
    #[arg(long, env = "MINIMAX_PREFILL_CHUNK", default_value_t = 2048)]
    pub prefill_chunk: usize,

    /// Most new tokens in one step (decode tokens plus prefill chunks).
    #[arg(long, env = "MINIMAX_MAX_STEP_TOKENS", default_value_t = 2048)]
    pub max_step_tokens: usize,

    /// Most sequences running at once.
    #[arg(long, env = "MINIMAX_MAX_RUNNING", default_value_t = 64)]
    pub max_running: usize,

    /// Most requests waiting for a slot; more are answered 429.
    #[arg(long, env = "MINIMAX_MAX_QUEUE", default_value_t = 256)]
    pub max_queue: usize,

    /// Pipeline worlds: steps of disjoint sequence groups kept in flight, so the stages work
    /// at once (0: one per stage; 1: one step at a time).
    #[arg(long, env = "MINIMAX_PIPELINE_INFLIGHT", default_value_t = 0)]
    pub pipeline_inflight: usize,

    /// One-rank worlds: send the next decode step while one computes, feeding the tokens the
    /// rank draws (docs/SCHEDULER.md, "Overlapped decode"); `off`: one step at a time.
    #[arg(long, env = "MINIMAX_OVERLAP", value_enum, default_value_t = OnOff::On)]
    pub overlap: OnOff,

    /// Overlapped decode of structured outputs and guided tool calls: a constrained
    /// sequence's next step is sent before the token its rule depends on is known, and the
    /// rule follows with the step after (docs/SCHEDULER.md, "Late rules"); `off`: such a
    /// sequence waits for its token, one step at a time.
    #[arg(long, env = "MINIMAX_LATE_RULES", value_enum, default_value_t = OnOff::On)]
    pub late_rules: OnOff,

    /// Seconds one step may take on the ranks before the world is declared broken.
    #[arg(long, env = "MINIMAX_STEP_TIMEOUT", default_value_t = 300.0)]
    pub step_timeout: f64,

    /// Seconds the ranks may take to load the model (each start).
    #[arg(long, env = "MINIMAX_LOAD_TIMEOUT", default_value_t = 1800.0)]
    pub load_timeout: f64,

    /// Longest wait between restarts of a failed world (seconds; backoff doubles up to it).
    #[arg(long, env = "MINIMAX_RESTART_BACKOFF_MAX", default_value_t = 30.0)]
    pub restart_backoff_max: f64,

    /// Consecutive failed starts before giving up (0 = keep trying).
    #[arg(long, env = "MINIMAX_MAX_RESTART_ATTEMPTS", default_value_t = 0)]
    pub max_restart_attempts: u32,

    /// Parse the model, build the tokenizer, start the ranks, run the collective self-test,
    /// then exit (0 on success) without serving.
    #[arg(long, env = "MINIMAX_DRY_RUN")]
    pub dry_run: bool,
}

fn secs(s: f64, what: &str) -> anyhow::Result<Duration> {
    if !(s.is_finite() && s > 0.0) {
        bail!("--{what} must be a positive number of seconds");
    }
    Ok(Duration::from_secs_f64(s))
}

impl EngineArgs {
    /// The model path: `--model`, else the bundled demo model.
    pub fn model_path(&self) -> anyhow::Result<PathBuf> {
        if let Some(m) = &self.model {
            return Ok(m.clone());
        }
        demo_model().context("no --model given and the bundled demo model was not found (set --model or MINIMAX_MODEL)")
    }

    /// The parsed `--synthetic` spec (None without it); refused without `--allow-synthetic`.
    pub fn synthetic_spec(&self) -> anyhow::Result<Option<SyntheticSpec>> {
        let Some(spec) = self.synthetic.as_deref() else { return Ok(None) };
        if !self.allow_synthetic {
            bail!("--synthetic {spec} serves random weights (benchmarks only); add --allow-synthetic to confirm");
        }
        Ok(Some(SyntheticSpec::parse(spec)?))
    }

    /// The metadata the gateway builds its tokenizer, template and model card from: the
    /// model's GGUF, or for `--synthetic` the vocabulary GGUF's tokenizer padded to the
    /// synthetic model (see `crate::synthetic`).
    pub fn model_metadata(&self) -> anyhow::Result<Metadata> {
        if let Some(spec) = self.synthetic_spec()? {
            let vocab = match &self.synthetic_vocab_from {
                Some(p) => p.clone(),
                None => demo_model().context("--synthetic needs --synthetic-vocab-from (the bundled demo model was not found)")?,
            };
            return crate::synthetic::metadata_from_file(&spec, &vocab);
        }
        let path = self.model_path()?;
        let model = GgufModel::open(&path).map_err(|e| anyhow::anyhow!("{}: {e}", path.display()))?;
        Ok(model.metadata().clone())
    }

    /// Attach-mode addresses, if any.
    pub fn rank_addrs(&self) -> anyhow::Result<Vec<RankAddr>> {
        self.ranks.iter().filter(|s| !s.trim().is_empty()).map(|s| RankAddr::parse(s).map_err(anyhow::Error::msg)).collect()
    }

    pub fn engine_config(&self) -> anyhow::Result<EngineConfig> {
        if self.page_size == 0 {
            bail!("--page-size must be positive");
        }
        if self.prefill_chunk == 0 || self.max_step_tokens == 0 || self.max_running == 0 {
            bail!("--prefill-chunk, --max-step-tokens and --max-running must be positive");
        }
        let addrs = self.rank_addrs()?;
        let synthetic = self.synthetic_spec()?;
        if synthetic.is_some() && !addrs.is_empty() {
            bail!("--synthetic starts its own ranks (each fills its share of the weights); it cannot attach to --ranks");
        }
        let mode = if !addrs.is_empty() {
            WorldMode::Attach { addrs }
        } else {
            let devices: Vec<String> = if !self.gpus.is_empty() {
                self.gpus.iter().map(|g| format!("cuda:{g}")).collect()
            } else {
                if self.world_size == 0 {
                    bail!("--world-size must be at least 1");
                }
                match self.device.as_str() {
                    "cpu" => vec!["cpu".to_string(); self.world_size as usize],
                    "cuda" | "gpu" => (0..self.world_size).map(|g| format!("cuda:{g}")).collect(),
                    d => bail!("--device must be cpu or cuda, not {d:?}"),
                }
            };
            WorldMode::Spawn(SpawnConfig {
                rank_binary: self.rank_binary.clone().map_or_else(find_rank_binary, Ok)?,
                model: if synthetic.is_some() { PathBuf::new() } else { self.model_path()? },
                synthetic: synthetic.is_some().then(|| self.synthetic.clone()).flatten(),
                devices,
                parallelism: self.parallelism.as_str().to_string(),
                page_size: self.page_size,
                kv_pages: self.kv_pages,
                run_dir: self.run_dir.clone().unwrap_or_else(default_run_dir),
                extra_args: self.rank_args.iter().filter(|a| !a.is_empty()).cloned().collect(),
                rank_args: vec![],
                env: vec![],
            })
        };
        let mut world = WorldConfig::new(mode);
        world.peer_addrs = self.peer_addrs.iter().filter(|s| !s.is_empty()).cloned().collect();
        world.step_timeout = secs(self.step_timeout, "step-timeout")?;
        world.load_timeout = secs(self.load_timeout, "load-timeout")?;
        world.restart_backoff_max = secs(self.restart_backoff_max, "restart-backoff-max")?;
        world.max_restart_attempts = self.max_restart_attempts;
        let sched = SchedConfig {
            prefill_chunk: self.prefill_chunk,
            max_step_tokens: self.max_step_tokens,
            max_running: self.max_running,
            max_queue: self.max_queue,
            pipeline_inflight: self.pipeline_inflight,
            overlap: self.overlap == OnOff::On,
            late_rules: self.late_rules == OnOff::On,
        };
        Ok(EngineConfig { sched, world })
    }
}

/// `minimax-rank` next to the running binary, else on PATH.
pub fn find_rank_binary() -> anyhow::Result<PathBuf> {
    if let Ok(exe) = std::env::current_exe()
        && let Some(dir) = exe.parent()
    {
        for cand in [dir.join("minimax-rank"), dir.join("../minimax-rank")] {
            if cand.is_file() {
                return Ok(cand);
            }
        }
    }
    if let Some(path) = std::env::var_os("PATH") {
        for dir in std::env::split_paths(&path) {
            let cand = dir.join("minimax-rank");
            if cand.is_file() {
                return Ok(cand);
            }
        }
    }
    bail!("minimax-rank not found next to the gateway binary nor on PATH; pass --rank-binary")
}

/// A per-process socket directory.
pub fn default_run_dir() -> PathBuf {
    let base = std::env::var_os("XDG_RUNTIME_DIR").map(PathBuf::from).filter(|p| p.is_dir()).unwrap_or_else(std::env::temp_dir);
    base.join(format!("minimax-gateway-{}", std::process::id()))
}

/// The bundled demo model: `$MINIMAX_DEMO_MODEL`, `<exe>/../share/minimax/demo.gguf`, or the
/// repository's `fixtures/m2-small/q8_0.gguf` (from the working directory or the source tree).
pub fn demo_model() -> Option<PathBuf> {
    if let Some(p) = std::env::var_os("MINIMAX_DEMO_MODEL") {
        return Some(PathBuf::from(p));
    }
    let mut cands = Vec::new();
    if let Ok(exe) = std::env::current_exe()
        && let Some(dir) = exe.parent()
    {
        cands.push(dir.join("../share/minimax/demo.gguf"));
        cands.push(dir.join("../../fixtures/m2-small/q8_0.gguf"));
    }
    cands.push(PathBuf::from("fixtures/m2-small/q8_0.gguf"));
    cands.push(Path::new(env!("CARGO_MANIFEST_DIR")).join("../fixtures/m2-small/q8_0.gguf"));
    cands.into_iter().find(|p| p.is_file())
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::Parser;

    #[derive(Parser)]
    struct T {
        #[command(flatten)]
        e: EngineArgs,
    }

    #[test]
    fn attach_mode_from_flags() {
        let t = T::try_parse_from(["x", "--ranks", "unix:///run/minimax/rank-0.sock,unix:///run/minimax/rank-1.sock", "--page-size", "32"]).unwrap();
        let cfg = t.e.engine_config().unwrap();
        match cfg.world.mode {
            WorldMode::Attach { addrs } => assert_eq!(addrs.len(), 2),
            _ => panic!("expected attach mode"),
        }
    }

    #[test]
    fn spawn_mode_devices() {
        let t = T::try_parse_from(["x", "--gpus", "0,1", "--rank-binary", "/bin/true", "--model", "/m.gguf", "--parallelism", "pipeline"]).unwrap();
        let cfg = t.e.engine_config().unwrap();
        match cfg.world.mode {
            WorldMode::Spawn(s) => {
                assert_eq!(s.devices, vec!["cuda:0", "cuda:1"]);
                assert_eq!(s.parallelism, "pipeline");
            }
            _ => panic!("expected spawn mode"),
        }
        let t = T::try_parse_from(["x", "--world-size", "2", "--rank-binary", "/bin/true", "--model", "/m.gguf"]).unwrap();
        match t.e.engine_config().unwrap().world.mode {
            WorldMode::Spawn(s) => assert_eq!(s.devices, vec!["cpu", "cpu"]),
            _ => panic!(),
        }
        assert!(T::try_parse_from(["x", "--gpus", "0", "--ranks", "a:1"]).is_err());
    }

    #[test]
    fn synthetic_needs_allow_and_spawned_ranks() {
        let base = ["x", "--rank-binary", "/bin/true", "--synthetic", "m2.7:iq4xs:2"];
        let t = T::try_parse_from(base).unwrap();
        let e = t.e.engine_config().unwrap_err().to_string();
        assert!(e.contains("--allow-synthetic"), "{e}");
        assert!(t.e.model_metadata().unwrap_err().to_string().contains("--allow-synthetic"));
        let t = T::try_parse_from([&base[..], &["--allow-synthetic", "--device", "cuda"]].concat()).unwrap();
        match t.e.engine_config().unwrap().world.mode {
            WorldMode::Spawn(s) => {
                assert_eq!(s.synthetic.as_deref(), Some("m2.7:iq4xs:2"));
                assert_eq!(s.devices, vec!["cuda:0"]);
            }
            _ => panic!("expected spawn mode"),
        }
        let meta = t.e.model_metadata().unwrap();
        assert_eq!(meta.get("tokenizer.ggml.tokens").and_then(|v| v.as_array()).map(|a| a.len()), Some(200_064));
        // Several GPUs: every spawned rank gets the spec (and builds its share of it).
        let t = T::try_parse_from([&base[..], &["--allow-synthetic", "--gpus", "0,1", "--parallelism", "pipeline"]].concat()).unwrap();
        match t.e.engine_config().unwrap().world.mode {
            WorldMode::Spawn(s) => {
                assert_eq!(s.synthetic.as_deref(), Some("m2.7:iq4xs:2"));
                assert_eq!(s.devices, vec!["cuda:0", "cuda:1"]);
                assert_eq!(s.parallelism, "pipeline");
            }
            _ => panic!("expected spawn mode"),
        }
        let t = T::try_parse_from([&base[..], &["--allow-synthetic", "--ranks", "127.0.0.1:7000,127.0.0.1:7001"]].concat()).unwrap();
        assert!(t.e.engine_config().unwrap_err().to_string().contains("cannot attach"));
        let t = T::try_parse_from([&base[..], &["--allow-synthetic", "--synthetic-vocab-from", "/nonexistent.gguf"]].concat()).unwrap();
        assert!(t.e.model_metadata().unwrap_err().to_string().contains("/nonexistent.gguf"));
        assert!(T::try_parse_from([&base[..], &["--model", "/m.gguf"]].concat()).is_err());
        assert!(T::try_parse_from(["x", "--synthetic-vocab-from", "/v.gguf"]).is_err());
        let t = T::try_parse_from([&base[..1], &["--allow-synthetic", "--synthetic", "m2.7:nope"]].concat()).unwrap();
        assert!(t.e.engine_config().unwrap_err().to_string().contains("unknown quant mix"));
    }
}
