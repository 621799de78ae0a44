//! Pipelined steps on a multi-process CPU pipeline world (two stages, m2-small f32): steps
//! chained with `after_step_id` run in the chained order whatever order they reach the
//! ranks in, several are outstanding at once, and each gives the single-process `CpuModel`'s
//! logits; a step chained to one that never comes is refused (`FAILED_PRECONDITION`) without
//! breaking the world.

mod common;

use std::path::Path;
use std::sync::Arc;
use std::time::{Duration, Instant};

use common::rank_procs::{Client, RankProc, StepAnswer, WorldSpec, full_row, send_step, start_cpu_world, step_answers, to_pb};
use common::{fixtures_dir, max_diff};
use minimax_proto::v1 as pb;
use minimax_rank::comm::Solo;
use minimax_rank::cpu::{CpuModel, KvSpec};
use minimax_rank::partition::Partition;
use minimax_shared::forward::{ForwardBatch, ForwardOutput, LogitsWanted, SeqStep};
use minimax_shared::gguf::GgufModel;
use minimax_shared::model::ModelConfig;

const PAGE: u32 = 16;
const N_PAGES: u32 = 64;
const WORLD: usize = 2;

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

async fn start(dir: &Path, gguf: &Path) -> (Vec<RankProc>, Vec<Client>) {
    let spec = WorldSpec { model: gguf, world: WORLD, parallelism: "pipeline", page_size: PAGE, kv_pages: N_PAGES, collective_timeout_ms: 3000, tcp: false, extra: vec![] };
    let (procs, clients, _, _) = start_cpu_world(dir, &spec, Duration::from_secs(120)).await;
    (procs, clients)
}

/// Sends `req` to every rank (without waiting): one task per rank.
fn send(clients: &[Client], req: pb::StepRequest) -> Vec<tokio::task::JoinHandle<StepAnswer>> {
    send_step(clients, &req)
}

async fn answers(hs: Vec<tokio::task::JoinHandle<StepAnswer>>) -> Vec<StepAnswer> {
    step_answers(hs, Duration::from_secs(60)).await
}

fn seq(seq_id: u64, first_page: u32, tokens: Vec<u32>, cached_len: usize) -> SeqStep {
    SeqStep { seq_id, page_table: (first_page..first_page + 4).collect(), cached_len, tokens, logits: LogitsWanted::Last }
}

fn req(step_id: u64, after_step_id: u64, batch: &ForwardBatch) -> pb::StepRequest {
    pb::StepRequest { step_id, after_step_id, seqs: batch.seqs.iter().map(to_pb).collect(), late_rules: vec![] }
}

/// The head rank's rows of a step vs the reference's, ≤ 1e-4.
fn check(resps: &[StepAnswer], batch: &ForwardBatch, want: &ForwardOutput, vocab: usize, what: &str) {
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
