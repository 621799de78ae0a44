//! Attach mode (systemd-managed ranks): the gateway connects to ranks it did not start, and when
//! one dies it shuts the others down and re-handshakes once the "systemd" of this test (a
//! thread that restarts every rank process that exits, like `Restart=always`) brings them
//! back. Real `minimax-rank serve` processes on the m2-small fixture; every wait is bounded.

mod common;

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use common::{rank_binary, root};
use minimax_gateway::engine::{Engine, EngineConfig, FinishReason, GenEvent, GenerationRequest, SamplingParams};
use minimax_gateway::ranks::client::RankAddr;
use minimax_gateway::ranks::supervisor::{WorldConfig, WorldMode};
use minimax_gateway::sched::SchedConfig;

/// A tiny systemd: keeps one process per rank running until dropped.
struct Units {
    stop: Arc<AtomicBool>,
    children: Arc<Mutex<Vec<Option<Child>>>>,
    starts: Arc<Mutex<Vec<u32>>>,
    thread: Option<std::thread::JoinHandle<()>>,
}

impl Units {
    fn start(bin: PathBuf, dir: &Path, world: usize) -> Self {
        let stop = Arc::new(AtomicBool::new(false));
        let children: Arc<Mutex<Vec<Option<Child>>>> = Arc::new(Mutex::new((0..world).map(|_| None).collect()));
        let starts = Arc::new(Mutex::new(vec![0u32; world]));
        let (s, c, n, dir) = (stop.clone(), children.clone(), starts.clone(), dir.to_path_buf());
        let thread = std::thread::spawn(move || {
            while !s.load(Ordering::SeqCst) {
                for r in 0..world {
                    let mut ch = c.lock().unwrap();
                    let running = match ch[r].as_mut() {
                        Some(child) => child.try_wait().ok().flatten().is_none(),
                        None => false,
                    };
                    if !running {
                        let child = Command::new(&bin)
                            .args(["serve", "--rank", &r.to_string(), "--world-size", &world.to_string()])
                            .arg("--listen")
                            .arg(format!("unix://{}/rank-{r}.sock", dir.display()))
                            .arg("--model")
                            .arg(root().join("fixtures/m2-small/q8_0.gguf"))
                            .args(["--device", "cpu", "--parallelism", "tensor", "--page-size", "16", "--kv-pages", "64"])
                            .env("RUST_LOG", "warn")
                            .stdin(Stdio::null())
                            .spawn()
                            .expect("spawn rank");
                        ch[r] = Some(child);
                        n.lock().unwrap()[r] += 1;
                    }
                }
                std::thread::sleep(Duration::from_millis(150));
            }
            for ch in c.lock().unwrap().iter_mut().flatten() {
                let _ = ch.kill();
                let _ = ch.wait();
            }
        });
        Units { stop, children, starts, thread: Some(thread) }
    }

    fn pid(&self, rank: usize) -> i32 {
        self.children.lock().unwrap()[rank].as_ref().unwrap().id() as i32
    }

    fn starts(&self) -> Vec<u32> {
        self.starts.lock().unwrap().clone()
    }
}

impl Drop for Units {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::SeqCst);
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

fn greedy(id: &str, n: u32, max_tokens: u32) -> GenerationRequest {
    GenerationRequest { request_id: id.into(), prompt: (1..=n).map(|i| i * 13 % 990 + 2).collect(), max_tokens, sampling: SamplingParams { temperature: 0.0, ..Default::default() }, stop_token_ids: vec![] }
}

async fn tokens(engine: &Engine, req: GenerationRequest) -> Vec<u32> {
    let ev = tokio::time::timeout(Duration::from_secs(60), engine.generate(req).expect("accepted").collect_all()).await.expect("in time");
    assert!(matches!(ev.last(), Some(GenEvent::Finished { reason: FinishReason::Length, .. })), "{ev:?}");
    ev.iter().filter_map(|e| if let GenEvent::Token { id, .. } = e { Some(*id) } else { None }).collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn attached_ranks_are_rehandshaken_after_a_restart() {
    let dir = std::env::temp_dir().join(format!("mmx-attach-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    let units = Units::start(rank_binary(), &dir, 2);
    let addrs = (0..2).map(|r| RankAddr::parse(&format!("unix://{}/rank-{r}.sock", dir.display())).unwrap()).collect();
    let mut w = WorldConfig::new(WorldMode::Attach { addrs });
    w.load_timeout = Duration::from_secs(60);
    w.health_interval = Duration::from_millis(200);
    w.restart_backoff_initial = Duration::from_millis(200);
    let engine = Engine::start(EngineConfig { sched: SchedConfig::default(), world: w });
    let info = engine.wait_ready(Duration::from_secs(60)).await.expect("attached");
    assert_eq!(info.page_size, 16, "page size comes from the ranks");
    assert_eq!(info.n_pages, 64);
    let before = tokens(&engine, greedy("before", 20, 6)).await;

    // "systemd" restarts rank 0 after a kill -9; the gateway must shut rank 1 down too and
    // re-create the collective.
    unsafe {
        libc::kill(units.pid(0), libc::SIGKILL);
    }
    let deadline = Instant::now() + Duration::from_secs(60);
    while engine.metrics().rank_restarts == 0 {
        assert!(Instant::now() < deadline, "the gateway never noticed the dead rank");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    engine.wait_ready(Duration::from_secs(60)).await.expect("re-handshaken");
    let after = tokens(&engine, greedy("after", 20, 6)).await;
    assert_eq!(before, after, "same greedy output from the re-formed world");
    let starts = units.starts();
    assert!(starts.iter().all(|&n| n >= 2), "every rank restarted (one failure domain): {starts:?}");
    engine.shutdown().await;
    // Attached ranks keep running after the gateway stops.
    assert!(Path::new(&dir.join("rank-0.sock")).exists());
    drop(units);
    let _ = std::fs::remove_dir_all(&dir);
}
