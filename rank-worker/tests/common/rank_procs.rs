//! `minimax-rank` processes on CUDA devices driven over gRPC like the gateway does: spawning
//! helpers, connecting clients over Unix sockets, CREATE + JOIN of a world, and steps.
#![allow(dead_code)]

use std::path::{Path, PathBuf};
use std::process::Child;
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

pub async fn connect(listen: &str) -> Client {
    let deadline = Instant::now() + Duration::from_secs(30);
    let path = PathBuf::from(listen.strip_prefix("unix://").unwrap());
    loop {
        let p = path.clone();
        let res = Endpoint::from_static("http://rank.invalid")
            .connect_with_connector(tower::service_fn(move |_| {
                let p = p.clone();
                async move { Ok::<_, std::io::Error>(TokioIo::new(tokio::net::UnixStream::connect(p).await?)) }
            }))
            .await;
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

pub async fn wait_state(c: &mut Client, want: pb::RankState) -> pb::DescribeResponse {
    let deadline = Instant::now() + Duration::from_secs(120);
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
    let mut clients = Vec::new();
    for p in procs {
        let mut c = connect(&p.listen).await;
        wait_state(&mut c, pb::RankState::Loaded).await;
        clients.push(c);
    }
    clients
}

/// CREATE on rank 0 and JOIN on every rank; returns the clients, their READY descriptions and
/// the unique id (world id + NCCL unique id).
pub async fn join_world(dir: &Path, mut clients: Vec<Client>) -> (Vec<Client>, Vec<pb::DescribeResponse>, Vec<u8>) {
    let world = clients.len();
    let id = clients[0]
        .collective(pb::CollectiveRequest { phase: pb::collective_request::Phase::Create as i32, ..Default::default() })
        .await
        .unwrap()
        .into_inner()
        .unique_id;
    assert_eq!(id.len(), 16 + minimax_rank::cuda::NCCL_ID_BYTES, "world id + NCCL unique id");
    let peers: Vec<String> = (0..world).map(|r| format!("unix://{}/coll-{r}.sock", dir.display())).collect();
    let joins: Vec<_> = clients
        .iter()
        .map(|c| {
            let mut c = c.clone();
            let req = pb::CollectiveRequest {
                phase: pb::collective_request::Phase::Join as i32,
                unique_id: id.clone(),
                peer_addrs: peers.clone(),
                timeout_ms: 60_000,
            };
            tokio::spawn(async move { c.collective(req).await })
        })
        .collect();
    for (r, j) in joins.into_iter().enumerate() {
        let r = j.await.unwrap().unwrap_or_else(|e| panic!("JOIN rank {r}: {e}")).into_inner();
        assert_eq!(r.self_test_sum, (world * (world + 1) / 2) as f32);
    }
    let mut descs = Vec::new();
    for c in &mut clients {
        descs.push(wait_state(c, pb::RankState::Ready).await);
    }
    (clients, descs, id)
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
    }
}

/// Sends `batch` as step `step_id` to every rank at once; each rank's response (a rank that
/// errors or takes more than 120 s fails the test).
pub async fn step_responses(clients: &[Client], step_id: u64, batch: &ForwardBatch) -> Vec<pb::StepResponse> {
    let req = pb::StepRequest { after_step_id: 0, step_id, seqs: batch.seqs.iter().map(to_pb).collect() };
    let hs: Vec<_> = clients
        .iter()
        .map(|c| {
            let mut c = c.clone();
            let req = req.clone();
            tokio::spawn(async move { c.step(req).await.map(|r| r.into_inner()) })
        })
        .collect();
    let mut resps = Vec::new();
    for (r, h) in hs.into_iter().enumerate() {
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
