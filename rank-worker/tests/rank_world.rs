//! Multi-process rank worlds on the CPU backend, driven over gRPC like the gateway does:
//! spawn `minimax-rank` processes, wait for LOADED, CREATE/JOIN, send the same Step to every
//! rank, and compare the head rank's logits with the single-process `CpuModel`. Also: the
//! KV-length handshake with the hidden fault hook, kill -9 of a rank mid-world, Unix socket
//! permissions, and grpcurl health + reflection.

mod common;

use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::Arc;
use std::time::{Duration, Instant};

use common::rank_procs::{Client, RankProc, StepAnswer, WorldSpec, connect, full_row, send_step, start_cpu_world, step_answers, to_pb, wait_state_within};
use common::{fixtures_dir, max_diff};
use minimax_proto::v1 as pb;
use minimax_rank::comm::Solo;
use minimax_rank::cpu::{CpuModel, KvSpec};
use minimax_rank::partition::Partition;
use minimax_shared::forward::{ForwardBatch, LogitsWanted, SeqStep};
use minimax_shared::gguf::GgufModel;
use minimax_shared::model::ModelConfig;

const PAGE: u32 = 16;
const N_PAGES: u32 = 64;
const TOL: f32 = 1e-4;

/// Starts a world and joins it; returns processes, clients and the Describe of each rank.
async fn start_world(dir: &Path, spec: &WorldSpec<'_>) -> (Vec<RankProc>, Vec<Client>, Vec<pb::DescribeResponse>) {
    let (procs, clients, descs, id) = start_cpu_world(dir, spec, Duration::from_secs(60)).await;
    assert_eq!(id.len(), 16);
    (procs, clients, descs)
}

/// Polls the rank until it reports `want` (at most 60 s).
async fn wait_state(c: &mut Client, want: pb::RankState) -> pb::DescribeResponse {
    wait_state_within(c, want, Duration::from_secs(60)).await
}

/// Sends the same step to every rank concurrently.
async fn step_all(clients: &[Client], req: &pb::StepRequest) -> Vec<StepAnswer> {
    step_answers(send_step(clients, req), Duration::from_secs(120)).await
}

fn seqs_of(model: &str) -> Vec<Vec<u32>> {
    let r: serde_json::Value = serde_json::from_slice(&std::fs::read(fixtures_dir().join(model).join("reference.json")).unwrap()).unwrap();
    r["sequences"].as_array().unwrap().iter().map(|s| s.as_array().unwrap().iter().map(|t| t.as_u64().unwrap() as u32).collect()).collect()
}

fn load_reference(path: &Path) -> CpuModel {
    let m = Arc::new(GgufModel::open(path).unwrap());
    let cfg = ModelConfig::from_gguf(&m).unwrap();
    CpuModel::load(m, Partition::whole(&cfg), KvSpec { page_size: PAGE as usize, n_pages: N_PAGES as usize }).unwrap()
}

/// A schedule mixing prefill chunks and decode steps of four sequences over scrambled pages,
/// plus a sequence adopting a cached page of another (prefix-cache hit).
fn schedule(seqs: &[Vec<u32>]) -> Vec<ForwardBatch> {
    let mut free: Vec<u32> = (0..N_PAGES).map(|i| (i * 37 + 11) % N_PAGES).collect();
    let mut tables: Vec<Vec<u32>> = vec![Vec::new(); seqs.len()];
    let mut done = vec![0usize; seqs.len()];
    let plan: Vec<Vec<(usize, usize, LogitsWanted)>> = vec![
        vec![(3, 100, LogitsWanted::None), (1, 3, LogitsWanted::All)],
        vec![(2, 40, LogitsWanted::Last), (1, 1, LogitsWanted::Last), (0, 1, LogitsWanted::All), (3, 57, LogitsWanted::Last)],
        vec![(1, 3, LogitsWanted::All), (2, 1, LogitsWanted::Last), (3, 1, LogitsWanted::Last)],
        vec![(3, 30, LogitsWanted::Last), (2, 23, LogitsWanted::All)],
    ];
    let mut out = Vec::new();
    for (si, step) in plan.into_iter().enumerate() {
        let mut b = ForwardBatch::default();
        for (s, n, want) in step {
            let start = done[s];
            while tables[s].len() * (PAGE as usize) < start + n {
                tables[s].push(free.pop().unwrap());
            }
            b.seqs.push(SeqStep { seq_id: s as u64, page_table: tables[s].clone(), cached_len: start, tokens: seqs[s][start..start + n].to_vec(), logits: want });
            done[s] += n;
        }
        if si == 2 {
            // Sequence 10 adopts sequence 3's first full page (16 cached tokens) and continues
            // with different tokens.
            let mut table = vec![tables[3][0]];
            table.push(free.pop().unwrap());
            b.seqs.push(SeqStep { seq_id: 10, page_table: table, cached_len: 16, tokens: seqs[2][..5].to_vec(), logits: LogitsWanted::All });
        }
        out.push(b);
    }
    out
}

/// Runs the schedule on a world and on the reference; compares every row.
async fn world_matches_reference(model: &str, world: usize, parallelism: &str, tcp: bool) {
    let t0 = Instant::now();
    let dir = tempfile::tempdir().unwrap();
    let gguf = fixtures_dir().join(model).join("f32.gguf");
    let spec = WorldSpec { model: &gguf, world, parallelism, page_size: PAGE, kv_pages: N_PAGES, collective_timeout_ms: 20_000, tcp, extra: vec![] };
    let (_procs, clients, descs) = start_world(dir.path(), &spec).await;
    let heads: Vec<usize> = descs.iter().enumerate().filter(|(_, d)| d.head).map(|(r, _)| r).collect();
    assert_eq!(heads.len(), 1, "exactly one head rank");
    let head = heads[0];
    let n_layers = descs[0].model.as_ref().unwrap().n_layers;
    if parallelism == "pipeline" {
        // Contiguous, covering layer ranges.
        assert_eq!(descs[0].first_layer, 0);
        assert_eq!(descs[world - 1].end_layer, n_layers);
        for w in descs.windows(2) {
            assert_eq!(w[0].end_layer, w[1].first_layer);
        }
        assert_eq!(head, world - 1);
    } else {
        assert_eq!(head, 0);
    }
    let mut reference = load_reference(&gguf);
    let vocab = reference.config().vocab_size;
    let mut rows_checked = 0;
    let mut worst = 0f32;
    for (i, batch) in schedule(&seqs_of(model)).iter().enumerate() {
        let want = reference.forward(batch, &Solo).unwrap();
        let mut req = pb::StepRequest { after_step_id: 0, step_id: i as u64 + 1, seqs: batch.seqs.iter().map(to_pb).collect(), late_rules: vec![] };
        for s in &mut req.seqs {
            s.adopt_prefix = s.seq_id == 10;
        }
        let resps = step_all(&clients, &req).await;
        for (r, resp) in resps.iter().enumerate() {
            let resp = resp.as_ref().unwrap_or_else(|e| panic!("rank {r} step {i}: {e}"));
            assert_eq!(resp.rank as usize, r);
            for (s, res) in batch.seqs.iter().zip(&resp.seqs) {
                assert_eq!(res.error, "", "rank {r} seq {}", s.seq_id);
                assert_eq!(res.cache_len as usize, s.cached_len + s.tokens.len(), "rank {r} handshake answer");
                if r != head {
                    assert!(res.rows.is_empty(), "only the head rank returns rows");
                }
            }
        }
        let got = resps[head].as_ref().unwrap();
        let mut k = 0;
        for (si, res) in got.seqs.iter().enumerate() {
            for row in &res.rows {
                let wr = want.rows[k];
                assert_eq!(wr.seq, si);
                assert_eq!(row.position as usize, wr.position);
                let d = max_diff(&full_row(row, vocab), want.row(k));
                worst = worst.max(d);
                assert!(d <= TOL, "{model} {parallelism}x{world} step {i} seq {} pos {}: max |diff| {d}", res.seq_id, row.position);
                k += 1;
            }
        }
        assert_eq!(k, want.rows.len());
        rows_checked += k;
    }
    assert!(rows_checked >= 40, "{rows_checked}");
    eprintln!("{model} {parallelism}x{world}: {rows_checked} rows, max |diff| {worst:.2e}, {:.1}s", t0.elapsed().as_secs_f32());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn world_of_one_matches_reference() {
    world_matches_reference("m2-small", 1, "pipeline", false).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn pipeline_2_matches_reference() {
    world_matches_reference("m2-small", 2, "pipeline", false).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn pipeline_3_matches_reference_over_tcp() {
    world_matches_reference("m2-small", 3, "pipeline", true).await;
}

/// Four rank processes, one layer each (the 4-GPU pipeline layout, on CPU ranks).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn pipeline_4_matches_reference() {
    world_matches_reference("m2-small", 4, "pipeline", false).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tensor_2_matches_reference() {
    world_matches_reference("m2-small", 2, "tensor", false).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tensor_2_odd_matches_reference_over_tcp() {
    world_matches_reference("m2-odd", 2, "tensor", true).await;
}

fn decode(seq_id: u64, table: &[u32], cached: u32, tok: u32) -> pb::SeqStep {
    pb::SeqStep {
        seq_id,
        page_table: table.to_vec(),
        expected_cache_len: cached,
        tokens: vec![tok],
        logits: pb::LogitsMode::Last as i32,
        sampling: Some(pb::SamplingSpec { temperature: 0.7, top_k: 5, top_logprobs: 3, ..Default::default() }),
        ..Default::default()
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn wrong_cache_length_is_detected_and_the_sequence_dropped_on_all_ranks() {
    let dir = tempfile::tempdir().unwrap();
    let gguf = fixtures_dir().join("m2-small").join("f32.gguf");
    let extra = vec![vec![], vec!["--test-fault".to_string(), "wrong-cache-len:5".to_string()]];
    let spec = WorldSpec { model: &gguf, world: 2, parallelism: "tensor", page_size: PAGE, kv_pages: N_PAGES, collective_timeout_ms: 20_000, tcp: false, extra };
    let (_procs, clients, _) = start_world(dir.path(), &spec).await;
    let log = std::fs::read_to_string(dir.path().join("rank-1.log")).unwrap();
    assert!(log.contains("TEST FAULT HOOK ENABLED"), "loud warning missing: {log}");
    let toks = &seqs_of("m2-small")[2];
    let (t5, t6) = (vec![0u32, 1], vec![2u32, 3]);
    // Step 1: prefill both. Rank 1 mis-tracks sequence 5 and says so in its answer already.
    let mut p5 = decode(5, &t5, 0, 0);
    p5.tokens = toks[..20].to_vec();
    let mut p6 = decode(6, &t6, 0, 0);
    p6.tokens = toks[..20].to_vec();
    let r = step_all(&clients, &pb::StepRequest { after_step_id: 0, step_id: 1, seqs: vec![p5, p6], late_rules: vec![] }).await;
    let (r0, r1) = (r[0].as_ref().unwrap(), r[1].as_ref().unwrap());
    assert_eq!((r0.seqs[0].cache_len, r1.seqs[0].cache_len), (20, 21), "the gateway sees the disagreement on this step");
    assert_eq!((r0.seqs[1].cache_len, r1.seqs[1].cache_len), (20, 20));
    assert_eq!(r0.seqs[0].rows[0].candidate_ids.len(), 5);
    assert_eq!(r0.seqs[0].rows[0].top_ids.len(), 3);
    // Step 2: decode both; the ranks agree to drop 5 and run 6.
    let r = step_all(&clients, &pb::StepRequest { after_step_id: 0, step_id: 2, seqs: vec![decode(5, &t5, 20, toks[20]), decode(6, &t6, 20, toks[20])], late_rules: vec![] }).await;
    for (rank, resp) in r.iter().enumerate() {
        let resp = resp.as_ref().unwrap();
        let s5 = &resp.seqs[0];
        assert!(s5.error.contains("mismatch") && s5.error.contains("rank 1: 21"), "rank {rank}: {}", s5.error);
        assert!(s5.rows.is_empty());
        assert_eq!(resp.seqs[1].error, "");
        assert_eq!(resp.seqs[1].cache_len, 21);
    }
    assert_eq!(r[0].as_ref().unwrap().seqs[0].cache_len, 20);
    assert_eq!(r[1].as_ref().unwrap().seqs[0].cache_len, 21);
    assert_eq!(r[0].as_ref().unwrap().seqs[1].rows.len(), 1);
    // Sequence 5 was forgotten everywhere: continuing it fails on both (unknown = 0) ...
    let r = step_all(&clients, &pb::StepRequest { after_step_id: 0, step_id: 3, seqs: vec![decode(5, &t5, 21, toks[21])], late_rules: vec![] }).await;
    for resp in &r {
        let s = &resp.as_ref().unwrap().seqs[0];
        assert!(s.error.contains("mismatch"), "{}", s.error);
        assert_eq!(s.cache_len, 0);
    }
    // ... and restarting it from scratch works; sequence 6 continues.
    let mut p5 = decode(5, &t5, 0, 0);
    p5.tokens = toks[..4].to_vec();
    let r = step_all(&clients, &pb::StepRequest { after_step_id: 0, step_id: 4, seqs: vec![p5, decode(6, &t6, 21, toks[21])], late_rules: vec![] }).await;
    assert!(r.iter().all(|x| x.as_ref().unwrap().seqs.iter().all(|s| s.error.is_empty())));
    // Release forgets; truncate keeps a prefix.
    for c in &clients {
        c.clone().release(pb::ReleaseRequest { seq_ids: vec![6], keep_len: 10, truncate: true }).await.unwrap();
    }
    let r = step_all(&clients, &pb::StepRequest { after_step_id: 0, step_id: 5, seqs: vec![decode(6, &t6, 10, toks[10])], late_rules: vec![] }).await;
    assert!(r.iter().all(|x| x.as_ref().unwrap().seqs[0].error.is_empty() && x.as_ref().unwrap().seqs[0].cache_len == 11));
    // Ranks given different steps refuse as a whole, nobody computes.
    let hs = [
        pb::StepRequest { after_step_id: 0, step_id: 6, seqs: vec![decode(6, &t6, 11, 1)], late_rules: vec![] },
        pb::StepRequest { after_step_id: 0, step_id: 7, seqs: vec![decode(6, &t6, 11, 1)], late_rules: vec![] },
    ];
    let mut joins = Vec::new();
    for (c, req) in clients.iter().zip(hs) {
        let mut c = c.clone();
        joins.push(tokio::spawn(async move { c.step(req).await }));
    }
    for j in joins {
        let e = j.await.unwrap().unwrap_err();
        assert_eq!(e.code(), tonic::Code::FailedPrecondition, "{e}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn kill_9_of_a_rank_fails_the_survivors_step_quickly() {
    let dir = tempfile::tempdir().unwrap();
    let gguf = fixtures_dir().join("m2-small").join("f32.gguf");
    let spec = WorldSpec { model: &gguf, world: 3, parallelism: "pipeline", page_size: PAGE, kv_pages: N_PAGES, collective_timeout_ms: 20_000, tcp: false, extra: vec![] };
    let (mut procs, clients, _) = start_world(dir.path(), &spec).await;
    let toks = &seqs_of("m2-small")[2];
    let mut s = decode(1, &[0, 1], 0, 0);
    s.tokens = toks[..8].to_vec();
    let r = step_all(&clients, &pb::StepRequest { after_step_id: 0, step_id: 1, seqs: vec![s], late_rules: vec![] }).await;
    assert!(r.iter().all(|x| x.is_ok()));
    // Ranks 0 and 2 get the next step; rank 1 dies before it arrives there.
    let pending: Vec<_> = [0usize, 2]
        .iter()
        .map(|&r| {
            let mut c = clients[r].clone();
            let req = pb::StepRequest { after_step_id: 0, step_id: 2, seqs: vec![decode(1, &[0, 1], 8, toks[8])], late_rules: vec![] };
            tokio::spawn(async move { c.step(req).await })
        })
        .collect();
    tokio::time::sleep(Duration::from_millis(300)).await;
    let t = Instant::now();
    unsafe { libc::kill(procs[1].child.id() as i32, libc::SIGKILL) };
    let _ = procs[1].child.wait();
    for (p, h) in pending.into_iter().enumerate() {
        let res = tokio::time::timeout(Duration::from_secs(10), h).await.expect("survivor hung").unwrap();
        let e = res.unwrap_err();
        assert_eq!(e.code(), tonic::Code::Unavailable, "{e}");
        eprintln!("survivor {p}: {} after {:?}", e.message(), t.elapsed());
    }
    assert!(t.elapsed() < Duration::from_secs(5));
    // Survivors report the broken world and refuse steps until re-joined.
    for r in [0, 2] {
        let mut c = clients[r].clone();
        let d = wait_state(&mut c, pb::RankState::Loaded).await;
        assert!(d.error.contains("world broken"), "{}", d.error);
        let e = c.step(pb::StepRequest { after_step_id: 0, step_id: 3, seqs: vec![], late_rules: vec![] }).await.unwrap_err();
        assert_eq!(e.code(), tonic::Code::FailedPrecondition);
    }
    drop(procs);
}

fn grpcurl() -> Option<PathBuf> {
    if let Some(p) = std::env::var_os("MINIMAX_GRPCURL") {
        return Some(PathBuf::from(p));
    }
    let venv = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../tools/grpcurl/.venv/bin/grpcurl");
    if venv.exists() {
        return Some(venv);
    }
    if std::env::var_os("CI").is_some_and(|v| !v.is_empty() && v != "false" && v != "0") {
        panic!("CI is set but grpcurl is missing: run tools/grpcurl/install.sh and set MINIMAX_GRPCURL");
    }
    eprintln!("\n!!!!!!!! SKIPPING grpcurl test: MINIMAX_GRPCURL unset (run tools/grpcurl/install.sh) !!!!!!!!\n");
    None
}

fn run_grpcurl(bin: &Path, sock: &Path, args: &[&str]) -> String {
    let out = Command::new(bin).args(["-plaintext", "-unix"]).arg(sock).args(args).output().expect("run grpcurl");
    assert!(out.status.success(), "grpcurl {args:?}: {}", String::from_utf8_lossy(&out.stderr));
    String::from_utf8_lossy(&out.stdout).into_owned()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn unix_socket_is_0600_and_grpcurl_sees_health_and_reflection() {
    use std::os::unix::fs::PermissionsExt;
    let dir = tempfile::tempdir().unwrap();
    let gguf = fixtures_dir().join("m2-small").join("f32.gguf");
    // A stale socket file from a previous run is replaced.
    let sock = dir.path().join("run/minimax/rank-0.sock");
    std::fs::create_dir_all(sock.parent().unwrap()).unwrap();
    drop(std::os::unix::net::UnixListener::bind(&sock).unwrap());
    let procs = {
        let mut cmd = Command::new(env!("CARGO_BIN_EXE_minimax-rank"));
        // Top-level flags (no `serve` subcommand) work too.
        cmd.args(["--rank", "0", "--world-size", "1", "--listen"])
            .arg(format!("unix://{}", sock.display()))
            .arg("--model")
            .arg(&gguf)
            .args(["--page-size", "16", "--kv-pages", "8"])
            .stderr(std::fs::File::create(dir.path().join("rank-0.log")).unwrap());
        vec![RankProc { listen: format!("unix://{}", sock.display()), child: cmd.spawn().unwrap() }]
    };
    let mut c = connect(&procs[0].listen).await;
    let d = wait_state(&mut c, pb::RankState::Loaded).await;
    assert_eq!(d.protocol_version, 4);
    assert_eq!(d.pid, procs[0].child.id());
    assert_eq!((d.page_size, d.n_pages), (16, 8));
    assert_eq!(d.model.as_ref().unwrap().vocab_size, 1000);
    let mode = std::fs::metadata(&sock).unwrap().permissions().mode() & 0o777;
    assert_eq!(mode, 0o600, "socket mode {mode:o}");
    let Some(bin) = grpcurl() else { return };
    let h = run_grpcurl(&bin, &sock, &["grpc.health.v1.Health/Check"]);
    assert!(h.contains("NOT_SERVING"), "{h}");
    c.collective(pb::CollectiveRequest { phase: pb::collective_request::Phase::Join as i32, ..Default::default() }).await.unwrap();
    let h = run_grpcurl(&bin, &sock, &["grpc.health.v1.Health/Check"]);
    assert!(h.contains("\"SERVING\""), "{h}");
    let list = run_grpcurl(&bin, &sock, &["list"]);
    // grpcurl 1.8.6 asks the v1alpha reflection service (v1 is served too, for newer clients).
    for svc in ["minimax.rank.v1.Rank", "grpc.health.v1.Health", "grpc.reflection.v1alpha.ServerReflection"] {
        assert!(list.contains(svc), "{svc} missing from {list}");
    }
    let desc = run_grpcurl(&bin, &sock, &["describe", "minimax.rank.v1.Rank"]);
    assert!(desc.contains("rpc Step"), "{desc}");
    let d = run_grpcurl(&bin, &sock, &["minimax.rank.v1.Rank/Describe"]);
    assert!(d.contains("RANK_STATE_READY"), "{d}");
    // Shutdown over gRPC: the process exits and removes its socket.
    c.shutdown(pb::ShutdownRequest {}).await.unwrap();
    let mut procs = procs;
    let deadline = Instant::now() + Duration::from_secs(10);
    while procs[0].child.try_wait().unwrap().is_none() {
        assert!(Instant::now() < deadline, "rank did not exit after Shutdown");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert!(!sock.exists());
}

/// A tensor world of `world` CPU ranks on the m2-small f32 fixture, joined and READY.
async fn tensor_world(dir: &Path, world: usize) -> (Vec<RankProc>, Vec<Client>, Vec<pb::DescribeResponse>) {
    let gguf = fixtures_dir().join("m2-small").join("f32.gguf");
    let spec = WorldSpec { model: &gguf, world, parallelism: "tensor", page_size: PAGE, kv_pages: N_PAGES, collective_timeout_ms: 20_000, tcp: false, extra: vec![] };
    start_world(dir, &spec).await
}

/// The whole vocabulary's final (sampling) logits of a row.
fn final_logits(row: &pb::RowOutput, vocab: usize) -> Vec<f32> {
    assert_eq!(row.candidate_ids.len(), vocab, "whole vocabulary expected");
    let mut out = vec![f32::NAN; vocab];
    for (&i, &v) in row.candidate_ids.iter().zip(&row.candidate_logits) {
        out[i as usize] = v;
    }
    out
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn world_of_one_feeds_its_drawn_tokens_to_chained_steps() {
    // Overlapped decode as the gateway runs it: step 2 is sent while step 1 computes and feeds
    // the token the rank draws in step 1 (with step 1's uniform number); that token joins the
    // penalties' history of step 2. Reference: the same prefix with the token given
    // explicitly and in the history.
    let dir = tempfile::tempdir().unwrap();
    let (_procs, clients, descs) = tensor_world(dir.path(), 1).await;
    let vocab = descs[0].model.as_ref().unwrap().vocab_size as usize;
    let prompt: Vec<u32> = (0..20u32).map(|i| (i * 37 + 11) % vocab as u32).collect();
    let sampling = |u: f64, history: Vec<(u32, u32)>| pb::SamplingSpec {
        temperature: 0.9,
        top_p: 1.0,
        frequency_penalty: 1.5,
        presence_penalty: 1.0,
        history: history.into_iter().map(|(token, count)| pb::TokenCount { token, count }).collect(),
        draw: Some(u),
        ..Default::default()
    };
    let seq = |id: u64, pages: Vec<u32>, at: u32, tokens: Vec<u32>, sp: pb::SamplingSpec, fed: bool| pb::SeqStep {
        seq_id: id,
        page_table: pages,
        expected_cache_len: at,
        tokens,
        logits: pb::LogitsMode::Last as i32,
        sampling: Some(sp),
        score_targets: vec![],
        adopt_prefix: false,
        feed_drawn: fed,
    };
    let s1 = pb::StepRequest { step_id: 1, after_step_id: 0, seqs: vec![seq(1, vec![3, 4], 0, prompt.clone(), sampling(0.37, vec![(5, 2)]), false)], late_rules: vec![] };
    let s2 = pb::StepRequest { step_id: 2, after_step_id: 1, seqs: vec![seq(1, vec![3, 4], 20, vec![], sampling(0.61, vec![(5, 2)]), true)], late_rules: vec![] };
    // A sequence that never drew feeds nothing: a clear error, the step itself runs.
    let s3 = pb::StepRequest { step_id: 3, after_step_id: 2, seqs: vec![seq(2, vec![9], 0, vec![], sampling(0.5, vec![]), true)], late_rules: vec![] };
    let (h1, h2, h3) = (send_step(&clients, &s1), send_step(&clients, &s2), send_step(&clients, &s3));
    let r1 = step_answers(h1, Duration::from_secs(120)).await.remove(0).expect("step 1");
    let r2 = step_answers(h2, Duration::from_secs(120)).await.remove(0).expect("step 2");
    let r3 = step_answers(h3, Duration::from_secs(120)).await.remove(0).expect("step 3");
    let row1 = &r1.seqs[0].rows[0];
    let k = minimax_shared::sampling::draw::draw(&row1.candidate_ids, &row1.candidate_logits, 0.9, 0.37).unwrap();
    let d1 = row1.candidate_ids[k];
    assert_eq!(row1.drawn_token, Some(d1));
    assert_eq!(r2.seqs[0].error, "");
    assert_eq!(r2.seqs[0].cache_len, 21);
    let row2 = &r2.seqs[0].rows[0];
    assert_eq!(row2.position, 20);
    let k2 = minimax_shared::sampling::draw::draw(&row2.candidate_ids, &row2.candidate_logits, 0.9, 0.61).unwrap();
    assert_eq!(row2.drawn_token, Some(row2.candidate_ids[k2]));
    assert!(r3.seqs[0].error.contains("drew none"), "{:?}", r3.seqs[0].error);
    assert!(r3.seqs[0].rows.is_empty());
    // The reference: prompt + d1 as one prefill, d1 counted in the history.
    let mut hist = vec![(5u32, 2u32)];
    match hist.iter_mut().find(|h| h.0 == d1) {
        Some(h) => h.1 += 1,
        None => hist.push((d1, 1)),
    }
    let with_d1: Vec<u32> = prompt.iter().copied().chain([d1]).collect();
    let s4 = pb::StepRequest { step_id: 4, after_step_id: 3, seqs: vec![seq(3, vec![10, 11], 0, with_d1, sampling(0.61, hist), false)], late_rules: vec![] };
    let r4 = step_answers(send_step(&clients, &s4), Duration::from_secs(120)).await.remove(0).expect("step 4");
    let row4 = &r4.seqs[0].rows[0];
    let (fed, want) = (final_logits(row2, vocab), final_logits(row4, vocab));
    let d = max_diff(&fed, &want);
    assert!(d <= 1e-3, "fed step vs explicit prefix: max |diff| {d}");
    // The penalty moved d1's logit (frequency 1.5 + presence 1.0, over the temperature).
    let raw_d1 = row2.candidate_raw_logits[row2.candidate_ids.iter().position(|&t| t == d1).unwrap()];
    assert!((raw_d1 / 0.9 - fed[d1 as usize]) > 2.0, "d1 {d1}: raw {raw_d1}, final {}", fed[d1 as usize]);
    assert_eq!(row4.drawn_token, row2.drawn_token);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_world_of_two_refuses_fed_tokens_alike() {
    // Only the head draws, so a tensor world cannot feed drawn tokens: every rank refuses the
    // sequence with the same error (no rank computes it alone), and the step's other sequence
    // runs.
    let dir = tempfile::tempdir().unwrap();
    let (_procs, clients, _descs) = tensor_world(dir.path(), 2).await;
    let mut fed = to_pb(&SeqStep { seq_id: 1, page_table: vec![1], cached_len: 0, tokens: vec![], logits: LogitsWanted::Last });
    fed.feed_drawn = true;
    let plain = to_pb(&SeqStep { seq_id: 2, page_table: vec![2], cached_len: 0, tokens: vec![5, 6, 7], logits: LogitsWanted::Last });
    let req = pb::StepRequest { step_id: 1, after_step_id: 0, seqs: vec![fed, plain], late_rules: vec![] };
    for (r, a) in step_all(&clients, &req).await.into_iter().enumerate() {
        let a = a.unwrap_or_else(|e| panic!("rank {r}: {e}"));
        assert!(a.seqs[0].error.contains("world of one rank"), "rank {r}: {:?}", a.seqs[0].error);
        assert_eq!(a.seqs[1].error, "", "rank {r}");
        assert_eq!(a.seqs[1].cache_len, 3, "rank {r}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_row_that_cannot_be_drawn_fails_only_its_draw() {
    // A tiny temperature makes the final logits infinite: that row gets no drawn token (the
    // gateway's own draw then fails that request alone), the step and its other row go on.
    let dir = tempfile::tempdir().unwrap();
    let (_procs, clients, _descs) = tensor_world(dir.path(), 1).await;
    let mut bad = to_pb(&SeqStep { seq_id: 1, page_table: vec![1], cached_len: 0, tokens: vec![5, 6, 7], logits: LogitsWanted::Last });
    bad.sampling = Some(pb::SamplingSpec { temperature: 1e-40, top_k: 5, draw: Some(0.5), ..Default::default() });
    let mut good = to_pb(&SeqStep { seq_id: 2, page_table: vec![2], cached_len: 0, tokens: vec![5, 6, 7], logits: LogitsWanted::Last });
    good.sampling = Some(pb::SamplingSpec { temperature: 0.7, top_k: 5, draw: Some(0.5), ..Default::default() });
    let req = pb::StepRequest { step_id: 1, after_step_id: 0, seqs: vec![bad, good], late_rules: vec![] };
    let a = step_all(&clients, &req).await.remove(0).expect("the step runs");
    assert_eq!(a.seqs[0].error, "");
    assert_eq!(a.seqs[0].rows[0].drawn_token, None);
    assert!(a.seqs[0].rows[0].candidate_logits.iter().any(|l| !l.is_finite()));
    assert!(a.seqs[1].rows[0].drawn_token.is_some());
}
