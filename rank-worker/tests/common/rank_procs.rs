//! `minimax-rank` processes driven over gRPC like the gateway does: spawning helpers (CPU
//! worlds here, CUDA ones in the tests), connecting clients over Unix sockets or TCP, CREATE +
//! JOIN of a world, and steps.
#![allow(dead_code)]

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use hyper_util::rt::TokioIo;
use minimax_proto::v1 as pb;
use minimax_proto::v1::rank_client::RankClient;
use minimax_shared::forward::{ForwardBatch, LogitsWanted, SeqStep};
use tonic::transport::{Channel, Endpoint};

pub type Client = RankClient<Channel>;

/// A rank process, killed when dropped.
pub struct RankProc {
    pub child: Child,
    pub listen: String,
}

impl Drop for RankProc {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

pub fn rank_bin() -> PathBuf {
    std::env::var_os("MINIMAX_RANK_BIN").map(PathBuf::from).unwrap_or_else(|| PathBuf::from(env!("CARGO_BIN_EXE_minimax-rank")))
}

/// Rank logs go to $OUT when set (the device tool brings them back), else next to the sockets.
pub fn log_dir(dir: &Path) -> PathBuf {
    std::env::var_os("OUT").map(PathBuf::from).unwrap_or_else(|| dir.to_path_buf())
}

/// A client of the rank at `listen` (`unix://PATH` or `HOST:PORT`), retried for up to 30 s.
pub async fn connect(listen: &str) -> Client {
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        let res = if let Some(path) = listen.strip_prefix("unix://") {
            let path = PathBuf::from(path);
            Endpoint::from_static("http://rank.invalid")
                .connect_with_connector(tower::service_fn(move |_| {
                    let p = path.clone();
                    async move { Ok::<_, std::io::Error>(TokioIo::new(tokio::net::UnixStream::connect(p).await?)) }
                }))
                .await
        } else {
            Endpoint::from_shared(format!("http://{listen}")).unwrap().connect().await
        };
        match res {
            Ok(ch) => return RankClient::new(ch).max_decoding_message_size(256 << 20),
            Err(e) if Instant::now() < deadline => {
                let _ = e;
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
            Err(e) => panic!("cannot connect to {listen}: {e}"),
        }
    }
}

/// Polls the rank until it reports `want` (at most 120 s); its description then.
pub async fn wait_state(c: &mut Client, want: pb::RankState) -> pb::DescribeResponse {
    wait_state_within(c, want, Duration::from_secs(120)).await
}

/// Polls the rank until it reports `want`, failing the test after `limit` or on FAILED.
pub async fn wait_state_within(c: &mut Client, want: pb::RankState, limit: Duration) -> pb::DescribeResponse {
    let deadline = Instant::now() + limit;
    loop {
        let d = c.describe(pb::DescribeRequest {}).await.unwrap().into_inner();
        if d.state == want as i32 {
            return d;
        }
        assert_ne!(d.state, pb::RankState::Failed as i32, "rank failed: {}", d.error);
        assert!(Instant::now() < deadline, "rank {} stuck in state {} ({})", d.rank, d.state, d.error);
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// Connects to each of `procs` in turn and waits until it is LOADED.
pub async fn connect_loaded(procs: &[RankProc]) -> Vec<Client> {
    connect_loaded_within(procs, Duration::from_secs(120)).await
}

/// `connect_loaded`, waiting at most `limit` per rank for LOADED.
pub async fn connect_loaded_within(procs: &[RankProc], limit: Duration) -> Vec<Client> {
    let mut clients = Vec::new();
    for p in procs {
        let mut c = connect(&p.listen).await;
        wait_state_within(&mut c, pb::RankState::Loaded, limit).await;
        clients.push(c);
    }
    clients
}

/// CREATE on rank 0 and JOIN on every rank; returns the clients, their READY descriptions and
/// the unique id (world id + NCCL unique id).
#[cfg(feature = "cuda")]
pub async fn join_world(dir: &Path, mut clients: Vec<Client>) -> (Vec<Client>, Vec<pb::DescribeResponse>, Vec<u8>) {
    let world = clients.len();
    let id = create_world(&mut clients).await;
    assert_eq!(id.len(), 16 + minimax_rank::cuda::NCCL_ID_BYTES, "world id + NCCL unique id");
    let peers: Vec<String> = (0..world).map(|r| format!("unix://{}/coll-{r}.sock", dir.display())).collect();
    for r in join_all(&clients, &id, &peers, 60_000).await {
        assert_eq!(r.self_test_sum, (world * (world + 1) / 2) as f32);
    }
    let descs = ready_all(&mut clients, Duration::from_secs(120)).await;
    (clients, descs, id)
}

/// CREATE on rank 0: the new world's unique id.
pub async fn create_world(clients: &mut [Client]) -> Vec<u8> {
    clients[0]
        .collective(pb::CollectiveRequest { phase: pb::collective_request::Phase::Create as i32, ..Default::default() })
        .await
        .unwrap()
        .into_inner()
        .unique_id
}

/// JOIN of world `id` on every rank at once (collective peers `peers`); each rank's answer in
/// rank order (a refused JOIN fails the test).
pub async fn join_all(clients: &[Client], id: &[u8], peers: &[String], timeout_ms: u32) -> Vec<pb::CollectiveResponse> {
    let joins: Vec<_> = clients
        .iter()
        .map(|c| {
            let mut c = c.clone();
            let req = pb::CollectiveRequest { phase: pb::collective_request::Phase::Join as i32, unique_id: id.to_vec(), peer_addrs: peers.to_vec(), timeout_ms };
            tokio::spawn(async move { c.collective(req).await })
        })
        .collect();
    let mut out = Vec::new();
    for (r, j) in joins.into_iter().enumerate() {
        out.push(j.await.unwrap().unwrap_or_else(|e| panic!("JOIN rank {r}: {e}")).into_inner());
    }
    out
}

/// Each rank's description once it is READY (at most `limit` per rank).
pub async fn ready_all(clients: &mut [Client], limit: Duration) -> Vec<pb::DescribeResponse> {
    let mut descs = Vec::new();
    for c in clients {
        descs.push(wait_state_within(c, pb::RankState::Ready, limit).await);
    }
    descs
}

pub fn to_pb(s: &SeqStep) -> pb::SeqStep {
    pb::SeqStep {
        seq_id: s.seq_id,
        page_table: s.page_table.clone(),
        expected_cache_len: s.cached_len as u32,
        tokens: s.tokens.clone(),
        logits: match s.logits {
            LogitsWanted::None => pb::LogitsMode::None,
            LogitsWanted::Last => pb::LogitsMode::Last,
            LogitsWanted::All => pb::LogitsMode::All,
        } as i32,
        sampling: Some(pb::SamplingSpec { temperature: 1.0, top_p: 1.0, ..Default::default() }),
        score_targets: vec![],
        adopt_prefix: false,
        feed_drawn: false,
    }
}

/// A step's answer from one rank.
pub type StepAnswer = Result<pb::StepResponse, tonic::Status>;

/// Sends `req` to every rank (without waiting): one task per rank.
pub fn send_step(clients: &[Client], req: &pb::StepRequest) -> Vec<tokio::task::JoinHandle<StepAnswer>> {
    clients
        .iter()
        .map(|c| {
            let mut c = c.clone();
            let req = req.clone();
            tokio::spawn(async move { c.step(req).await.map(|r| r.into_inner()) })
        })
        .collect()
}

/// Each rank's answer to a step sent by `send_step`, in rank order; one that takes longer
/// than `limit` fails the test ("step hung").
pub async fn step_answers(hs: Vec<tokio::task::JoinHandle<StepAnswer>>, limit: Duration) -> Vec<StepAnswer> {
    let mut out = Vec::new();
    for h in hs {
        out.push(tokio::time::timeout(limit, h).await.expect("step hung").unwrap());
    }
    out
}

/// Sends `batch` as step `step_id` to every rank at once; each rank's response (a rank that
/// errors or takes more than 120 s fails the test).
pub async fn step_responses(clients: &[Client], step_id: u64, batch: &ForwardBatch) -> Vec<pb::StepResponse> {
    let req = pb::StepRequest { after_step_id: 0, step_id, seqs: batch.seqs.iter().map(to_pb).collect(), late_rules: vec![] };
    let mut resps = Vec::new();
    for (r, h) in send_step(clients, &req).into_iter().enumerate() {
        let resp = tokio::time::timeout(Duration::from_secs(120), h).await.expect("step hung").unwrap();
        resps.push(resp.unwrap_or_else(|e| panic!("rank {r} step {step_id}: {e}")));
    }
    resps
}

/// A row of the whole vocabulary as a dense logits vector.
pub fn full_row(row: &pb::RowOutput, vocab: usize) -> Vec<f32> {
    assert_eq!(row.candidate_ids.len(), vocab, "whole vocabulary expected");
    let mut out = vec![f32::NAN; vocab];
    for (&i, &v) in row.candidate_ids.iter().zip(&row.candidate_raw_logits) {
        out[i as usize] = v;
    }
    out
}

/// A world of CPU ranks to spawn on the m2 fixtures.
pub struct WorldSpec<'a> {
    pub model: &'a Path,
    pub world: usize,
    pub parallelism: &'a str,
    pub page_size: u32,
    pub kv_pages: u32,
    /// The ranks' `--collective-timeout-ms`.
    pub collective_timeout_ms: u32,
    /// gRPC and transport over TCP instead of Unix sockets.
    pub tcp: bool,
    /// Extra flags per rank.
    pub extra: Vec<Vec<String>>,
}

/// A free TCP address on the loopback interface.
pub fn free_port() -> String {
    let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    l.local_addr().unwrap().to_string()
}

/// Spawns the CPU ranks of `spec`, logging (`info`) to `dir/rank-R.log`.
pub fn spawn_cpu_world(dir: &Path, spec: &WorldSpec) -> Vec<RankProc> {
    (0..spec.world)
        .map(|r| {
            let listen = if spec.tcp { free_port() } else { format!("unix://{}/rank-{r}.sock", dir.display()) };
            let mut cmd = Command::new(env!("CARGO_BIN_EXE_minimax-rank"));
            cmd.args(["serve", "--rank", &r.to_string(), "--world-size", &spec.world.to_string(), "--listen", &listen])
                .arg("--model")
                .arg(spec.model)
                .args(["--device", "cpu", "--parallelism", spec.parallelism])
                .args(["--page-size", &spec.page_size.to_string(), "--kv-pages", &spec.kv_pages.to_string()])
                .args(["--collective-timeout-ms", &spec.collective_timeout_ms.to_string()])
                .args(spec.extra.get(r).cloned().unwrap_or_default())
                .env("RUST_LOG", "info")
                .stdout(Stdio::null())
                .stderr(std::fs::File::create(dir.join(format!("rank-{r}.log"))).unwrap());
            RankProc { child: cmd.spawn().expect("spawn minimax-rank"), listen }
        })
        .collect()
}

/// Spawns a CPU world, waits for LOADED (`wait` at most per rank), CREATEs it on rank 0 and
/// JOINs every rank (collective peers over TCP or Unix sockets, none for a world of one);
/// returns processes, clients, each rank's READY description and the CREATE's unique id.
pub async fn start_cpu_world(dir: &Path, spec: &WorldSpec<'_>, wait: Duration) -> (Vec<RankProc>, Vec<Client>, Vec<pb::DescribeResponse>, Vec<u8>) {
    let procs = spawn_cpu_world(dir, spec);
    let mut clients = connect_loaded_within(&procs, wait).await;
    let id = create_world(&mut clients).await;
    let peers: Vec<String> = if spec.world > 1 {
        (0..spec.world).map(|r| if spec.tcp { free_port() } else { format!("unix://{}/coll-{r}.sock", dir.display()) }).collect()
    } else {
        vec![]
    };
    let want = (spec.world * (spec.world + 1) / 2) as f32;
    for r in join_all(&clients, &id, &peers, 20_000).await {
        assert_eq!(r.self_test_sum, want);
    }
    let descs = ready_all(&mut clients, wait).await;
    (procs, clients, descs, id)
}
