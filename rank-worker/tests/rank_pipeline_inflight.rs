//! Pipelined steps on a multi-process CPU pipeline world (two stages, m2-small f32): steps
//! chained with `after_step_id` run in the chained order whatever order they reach the
//! ranks in, several are outstanding at once, and each gives the single-process `CpuModel`'s
//! logits; a step chained to one that never comes is refused (`FAILED_PRECONDITION`) without
//! breaking the world.

mod common;

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::Arc;
use std::time::{Duration, Instant};

use common::{fixtures_dir, max_diff};
use hyper_util::rt::TokioIo;
use minimax_proto::v1 as pb;
use minimax_proto::v1::rank_client::RankClient;
use tonic::transport::{Channel, Endpoint};
use minimax_rank::comm::Solo;
use minimax_rank::cpu::{CpuModel, KvSpec};
use minimax_rank::partition::Partition;
use minimax_shared::forward::{ForwardBatch, ForwardOutput, LogitsWanted, SeqStep};
use minimax_shared::gguf::GgufModel;
use minimax_shared::model::ModelConfig;

const PAGE: u32 = 16;
const N_PAGES: u32 = 64;
const WORLD: usize = 2;

type Client = RankClient<Channel>;

/// A rank process, killed when dropped.
struct RankProc {
    child: Child,
    listen: String,
}

impl Drop for RankProc {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

async fn connect(listen: &str) -> Client {
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
            Err(e) => {
                assert!(Instant::now() < deadline, "cannot connect to {listen}: {e}");
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
        }
    }
}

async fn wait_state(c: &mut Client, want: pb::RankState) {
    let deadline = Instant::now() + Duration::from_secs(120);
    loop {
        let d = c.describe(pb::DescribeRequest {}).await.unwrap().into_inner();
        if d.state == want as i32 {
            return;
        }
        assert_ne!(d.state, pb::RankState::Failed as i32, "rank failed: {}", d.error);
        assert!(Instant::now() < deadline, "rank {} stuck in state {} ({})", d.rank, d.state, d.error);
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// A step entry asking for the whole vocabulary's raw logits (temperature 1, no cuts).
fn to_pb(s: &SeqStep) -> pb::SeqStep {
    pb::SeqStep {
        seq_id: s.seq_id,
        page_table: s.page_table.clone(),
        expected_cache_len: s.cached_len as u32,
        tokens: s.tokens.clone(),
        logits: pb::LogitsMode::Last as i32,
        sampling: Some(pb::SamplingSpec { temperature: 1.0, top_p: 1.0, ..Default::default() }),
        score_targets: vec![],
        adopt_prefix: false,
    }
}

/// The text of a log without its terminal colour codes (`ESC [ ... m`).
fn strip_ansi(s: &str) -> String {
    let mut out = String::with_capacity(s.len());
    let mut it = s.chars();
    while let Some(c) = it.next() {
        if c == '\u{1b}' {
            for d in it.by_ref() {
                if d == 'm' {
                    break;
                }
            }
        } else {
            out.push(c);
        }
    }
    out
}

fn full_row(row: &pb::RowOutput, vocab: usize) -> Vec<f32> {
    assert_eq!(row.candidate_ids.len(), vocab, "whole vocabulary expected");
    let mut out = vec![f32::NAN; vocab];
    for (&i, &v) in row.candidate_ids.iter().zip(&row.candidate_raw_logits) {
        out[i as usize] = v;
    }
    out
}

async fn start(dir: &Path, gguf: &Path) -> (Vec<RankProc>, Vec<Client>) {
    let procs: Vec<RankProc> = (0..WORLD)
        .map(|r| {
            let listen = format!("unix://{}/rank-{r}.sock", dir.display());
            let mut cmd = Command::new(env!("CARGO_BIN_EXE_minimax-rank"));
            cmd.args(["serve", "--rank", &r.to_string(), "--world-size", &WORLD.to_string(), "--listen", &listen])
                .arg("--model")
                .arg(gguf)
                .args(["--device", "cpu", "--parallelism", "pipeline"])
                .args(["--page-size", &PAGE.to_string(), "--kv-pages", &N_PAGES.to_string(), "--collective-timeout-ms", "3000"])
                .env("RUST_LOG", "info")
                .stdout(Stdio::null())
                .stderr(std::fs::File::create(dir.join(format!("rank-{r}.log"))).unwrap());
            RankProc { child: cmd.spawn().expect("spawn minimax-rank"), listen }
        })
        .collect();
    let mut clients = Vec::new();
    for p in &procs {
        let mut c = connect(&p.listen).await;
        wait_state(&mut c, pb::RankState::Loaded).await;
        clients.push(c);
    }
    let id = clients[0]
        .collective(pb::CollectiveRequest { phase: pb::collective_request::Phase::Create as i32, ..Default::default() })
        .await
        .unwrap()
        .into_inner()
        .unique_id;
    let peers: Vec<String> = (0..WORLD).map(|r| format!("unix://{}/coll-{r}.sock", dir.display())).collect();
    let joins: Vec<_> = clients
        .iter()
        .map(|c| {
            let mut c = c.clone();
            let req = pb::CollectiveRequest { phase: pb::collective_request::Phase::Join as i32, unique_id: id.clone(), peer_addrs: peers.clone(), timeout_ms: 20_000 };
            tokio::spawn(async move { c.collective(req).await })
        })
        .collect();
    for j in joins {
        assert_eq!(j.await.unwrap().unwrap().into_inner().self_test_sum, 3.0);
    }
    for c in &mut clients {
        wait_state(c, pb::RankState::Ready).await;
    }
    (procs, clients)
}

/// Sends `req` to every rank (without waiting): one task per rank.
fn send(clients: &[Client], req: pb::StepRequest) -> Vec<tokio::task::JoinHandle<Result<pb::StepResponse, tonic::Status>>> {
    clients
        .iter()
        .map(|c| {
            let mut c = c.clone();
            let req = req.clone();
            tokio::spawn(async move { c.step(req).await.map(|r| r.into_inner()) })
        })
        .collect()
}

async fn answers(hs: Vec<tokio::task::JoinHandle<Result<pb::StepResponse, tonic::Status>>>) -> Vec<Result<pb::StepResponse, tonic::Status>> {
    let mut out = vec![];
    for h in hs {
        out.push(tokio::time::timeout(Duration::from_secs(60), h).await.expect("step hung").unwrap());
    }
    out
}

fn seq(seq_id: u64, first_page: u32, tokens: Vec<u32>, cached_len: usize) -> SeqStep {
    SeqStep { seq_id, page_table: (first_page..first_page + 4).collect(), cached_len, tokens, logits: LogitsWanted::Last }
}

fn req(step_id: u64, after_step_id: u64, batch: &ForwardBatch) -> pb::StepRequest {
    pb::StepRequest { step_id, after_step_id, seqs: batch.seqs.iter().map(to_pb).collect() }
}

/// The head rank's rows of a step vs the reference's, ≤ 1e-4.
fn check(resps: &[Result<pb::StepResponse, tonic::Status>], batch: &ForwardBatch, want: &ForwardOutput, vocab: usize, what: &str) {
    for (r, resp) in resps.iter().enumerate() {
        let resp = resp.as_ref().unwrap_or_else(|e| panic!("{what}: rank {r}: {e}"));
        for (s, res) in batch.seqs.iter().zip(&resp.seqs) {
            assert_eq!(res.error, "", "{what}: rank {r}");
            assert_eq!(res.cache_len as usize, s.cached_len + s.tokens.len(), "{what}: rank {r}");
        }
    }
    let head = resps[WORLD - 1].as_ref().unwrap();
    let rows: Vec<&pb::RowOutput> = head.seqs.iter().flat_map(|s| &s.rows).collect();
    assert_eq!(rows.len(), want.rows.len(), "{what}");
    for (k, row) in rows.iter().enumerate() {
        let d = max_diff(&full_row(row, vocab), want.row(k));
        assert!(d <= 1e-4, "{what}: row {k}: max |diff| {d}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn chained_steps_run_in_order_and_overlap() {
    let dir = tempfile::tempdir().unwrap();
    let gguf = fixtures_dir().join("m2-small").join("f32.gguf");
    let m = Arc::new(GgufModel::open(&gguf).unwrap());
    let cfg = ModelConfig::from_gguf(&m).unwrap();
    let vocab = cfg.vocab_size;
    let mut reference = CpuModel::load(m, Partition::whole(&cfg), KvSpec { page_size: PAGE as usize, n_pages: N_PAGES as usize }).unwrap();
    let (_procs, clients) = start(dir.path(), &gguf).await;

    // Two groups (sequences 1 and 2, disjoint pages), each a prefill then two decode steps.
    let a: Vec<u32> = (0..21).map(|i| (i * 7 + 3) % 500 + 1).collect();
    let b: Vec<u32> = (0..13).map(|i| (i * 11 + 5) % 500 + 1).collect();
    let steps = [
        ForwardBatch { seqs: vec![seq(1, 0, a.clone(), 0)] },
        ForwardBatch { seqs: vec![seq(2, 8, b.clone(), 0)] },
        ForwardBatch { seqs: vec![seq(1, 0, vec![42], a.len())] },
        ForwardBatch { seqs: vec![seq(2, 8, vec![43], b.len())] },
        ForwardBatch { seqs: vec![seq(1, 0, vec![44], a.len() + 1)] },
        ForwardBatch { seqs: vec![seq(2, 8, vec![45], b.len() + 1)] },
    ];
    let wants: Vec<ForwardOutput> = steps.iter().map(|s| reference.forward(s, &Solo).unwrap()).collect();

    // Steps 1 and 2 reach the ranks in the wrong order: 2 (chained to 1) first; it must wait.
    let h2 = send(&clients, req(2, 1, &steps[1]));
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert!(h2.iter().all(|h| !h.is_finished()), "a step ran before the step it follows");
    let h1 = send(&clients, req(1, 0, &steps[0]));
    check(&answers(h1).await, &steps[0], &wants[0], vocab, "step 1");
    check(&answers(h2).await, &steps[1], &wants[1], vocab, "step 2");

    // Then the gateway's pattern: each step sent while the previous one is in flight.
    let mut pending = vec![];
    for (i, s) in steps.iter().enumerate().skip(2) {
        let id = i as u64 + 1;
        pending.push((i, send(&clients, req(id, id - 1, s))));
    }
    for (i, h) in pending {
        check(&answers(h).await, &steps[i], &wants[i], vocab, &format!("step {}", i + 1));
    }

    // A step chained to one that never comes is refused after the collective timeout, on
    // every rank, and the world goes on.
    let t0 = Instant::now();
    let lost = answers(send(&clients, req(100, 99, &ForwardBatch { seqs: vec![seq(1, 0, vec![46], a.len() + 2)] }))).await;
    for r in &lost {
        let e = r.as_ref().unwrap_err();
        assert_eq!(e.code(), tonic::Code::FailedPrecondition, "{e}");
        assert!(e.message().contains("never reached"), "{e}");
    }
    assert!(t0.elapsed() < Duration::from_secs(20));
    let next = ForwardBatch { seqs: vec![seq(2, 8, vec![47], b.len() + 2)] };
    let want = reference.forward(&next, &Solo).unwrap();
    check(&answers(send(&clients, req(101, 0, &next))).await, &next, &want, vocab, "after the refusal");

    // Both stages had two steps agreed and in flight at once (rank logs).
    let logs: Vec<String> = (0..WORLD).map(|r| strip_ansi(&std::fs::read_to_string(dir.path().join(format!("rank-{r}.log"))).unwrap())).collect();
    let most = |log: &str| log.lines().filter(|l| l.contains("most steps agreed and in flight")).filter_map(|l| l.rsplit('=').next()?.trim().parse::<u32>().ok()).max().unwrap_or(0);
    assert!(logs.iter().any(|l| most(l) >= 2), "no rank ever had two steps in flight:\n{}", logs.join("\n"));
}
