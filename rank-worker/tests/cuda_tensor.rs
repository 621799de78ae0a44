//! Tensor parallelism on CUDA over NCCL: two `minimax-rank` processes, one per GPU
//! (`--device cuda:0`, `--device cuda:1`, `--parallelism tensor`), driven over gRPC like the
//! gateway does (CREATE carries the NCCL unique id, JOIN builds the communicators). Logits
//! of whole sequences are compared with the transformers reference and with one GPU (exact
//! path, same f32 KV cache), and 64 greedy tokens must equal one GPU's.
//! Needs two GPUs: run with `--ignored` (tools/gpu/run_tests.sh does); the rank binary is
//! `$MINIMAX_RANK_BIN` (tools/gpu/collect.sh copies it to .devbin/) or the cargo-built one.
#![cfg(feature = "cuda")]

mod common;

use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::Arc;
use std::time::{Duration, Instant};

use common::rank_procs::{self, connect, connect_loaded, full_row, log_dir, rank_bin, step_responses, to_pb, wait_state, Client, RankProc};
use common::gpu::gpu_count;
use common::{argmax, max_diff, variants};
use minimax_proto::v1 as pb;
use minimax_rank::cpu::KvSpec;
use minimax_rank::cuda::{CudaModel, CudaOptions, KvDtype};
use minimax_shared::forward::{ForwardBatch, LogitsWanted, SeqStep};
use minimax_shared::gguf::GgufModel;

const PAGE: u32 = 16;
const N_PAGES: u32 = 64;
/// Tensor parallel vs one GPU: same kernels and f32 KV cache, only the summation order of
/// the reduced projections and of the q/k sums of squares differ.
const TOL_1GPU: f32 = 2e-3;
/// Against the transformers reference (as tests/cuda_model.rs with an f32 cache).
const TOL_REF: f32 = 2e-2;
const GREEDY: usize = 64;

fn rank_log(dir: &Path, r: usize, model: &Path, tag: &str) -> PathBuf {
    log_dir(dir).join(format!("rank-{r}-{}{tag}.log", model.file_stem().unwrap().to_string_lossy()))
}

/// With `NCCL_P2P_DISABLE=1 NCCL_SHM_DISABLE=1 NCCL_DEBUG=INFO` (the forced-socket run) the
/// ranks' logs must show NCCL's socket transport; otherwise nothing is checked.
fn check_forced_socket(dir: &Path, model: &Path, tag: &str) {
    let on = |k: &str, v: &str| std::env::var(k).is_ok_and(|x| x.eq_ignore_ascii_case(v));
    if !(on("NCCL_P2P_DISABLE", "1") && on("NCCL_SHM_DISABLE", "1") && on("NCCL_DEBUG", "INFO")) {
        return;
    }
    for r in 0..2 {
        let log = std::fs::read_to_string(rank_log(dir, r, model, tag)).unwrap_or_default();
        let via: Vec<&str> = log.lines().filter(|l| l.contains(" via ")).collect();
        eprintln!("rank {r} NCCL connections: {}", via.len());
        assert!(!via.is_empty(), "rank {r}: NCCL_DEBUG=INFO logged no connection (\" via \") lines");
        assert!(via.iter().all(|l| l.contains("via NET/Socket")), "rank {r}: P2P/SHM disabled, but not every connection is NET/Socket: {via:?}");
    }
    eprintln!("forced socket: every NCCL connection is NET/Socket");
}

fn spawn_world(dir: &Path, model: &Path, world: usize) -> Vec<RankProc> {
    (0..world).map(|r| spawn_rank(dir, model, world, r, &[], "")).collect()
}

/// One rank process; `env` is added to the inherited environment (NCCL_* pass through), `tag`
/// names its log.
fn spawn_rank(dir: &Path, model: &Path, world: usize, r: usize, env: &[(&str, &str)], tag: &str) -> RankProc {
    let listen = format!("unix://{}/rank-{r}.sock", dir.display());
    let mut cmd = Command::new(rank_bin());
    cmd.env("MINIMAX_GEMM", common::fixture_gemm());
    cmd.envs(env.iter().copied());
    cmd.args(["serve", "--rank", &r.to_string(), "--world-size", &world.to_string(), "--listen", &listen])
        .arg("--model")
        .arg(model)
        .args(["--device", &format!("cuda:{r}"), "--parallelism", "tensor"])
        .args(["--page-size", &PAGE.to_string(), "--kv-pages", &N_PAGES.to_string(), "--collective-timeout-ms", "60000"])
        .env("RUST_LOG", "info")
        .env("MINIMAX_CUDA_KV_DTYPE", "f32")
        .env("NCCL_NVLS_ENABLE", "0")
        .stdin(Stdio::null());
    // stdout too: NCCL_DEBUG writes there.
    let log = std::fs::File::create(rank_log(dir, r, model, tag)).unwrap();
    cmd.stdout(log.try_clone().unwrap()).stderr(log);
    RankProc { child: cmd.spawn().expect("spawn minimax-rank"), listen }
}

async fn start_world(dir: &Path, model: &Path, world: usize) -> (Vec<RankProc>, Vec<Client>, Vec<pb::DescribeResponse>) {
    start_procs(dir, spawn_world(dir, model, world)).await
}

/// Connects to `procs`, waits until they are LOADED, then CREATE + JOIN (a new world id and
/// NCCL unique id).
async fn start_procs(dir: &Path, procs: Vec<RankProc>) -> (Vec<RankProc>, Vec<Client>, Vec<pb::DescribeResponse>) {
    let clients = connect_loaded(&procs).await;
    let (clients, descs) = join_world(dir, clients).await;
    (procs, clients, descs)
}

/// CREATE on rank 0 and JOIN on every rank; returns the clients and READY descriptions.
async fn join_world(dir: &Path, clients: Vec<Client>) -> (Vec<Client>, Vec<pb::DescribeResponse>) {
    let (clients, descs, id) = rank_procs::join_world(dir, clients).await;
    eprintln!("world joined (id {:02x?}...)", &id[..4]);
    (clients, descs)
}

/// One step on every rank; the head rank's (rank 0) full logits rows.
async fn world_step(clients: &[Client], step_id: u64, batch: &ForwardBatch, vocab: usize) -> Vec<Vec<f32>> {
    let resps = step_responses(clients, step_id, batch).await;
    let mut rows = Vec::new();
    for res in &resps[0].seqs {
        assert_eq!(res.error, "", "seq {}", res.seq_id);
        for row in &res.rows {
            rows.push(full_row(row, vocab));
        }
    }
    rows
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
#[ignore = "needs two CUDA GPUs"]
async fn tensor_2_on_two_gpus_matches_one_gpu() {
    let n_gpus = gpu_count();
    if n_gpus < 2 {
        eprintln!("SKIPPED: {n_gpus} GPU(s); tensor parallelism over NCCL needs 2");
        return;
    }
    for v in variants().into_iter().filter(|v| v.model == "m2-small" && (v.name == "q8_0" || v.name == "kmix")) {
        let t0 = Instant::now();
        let dir = tempfile::tempdir().unwrap();
        let (procs, clients, descs) = start_world(dir.path(), &v.gguf, 2).await;
        assert!(descs[0].head && !descs[1].head, "rank 0 is the head rank");
        let t_up = t0.elapsed().as_secs_f32();
        // One GPU, exact path, same f32 cache: the reference for bit-near equality.
        let gguf = Arc::new(GgufModel::open(&v.gguf).unwrap());
        let kv = KvSpec { page_size: PAGE as usize, n_pages: N_PAGES as usize };
        let mut one = CudaModel::load(gguf, kv, CudaOptions { device: 0, kv_dtype: KvDtype::F32, fast_decode: false, graphs: false }).unwrap();
        eprintln!(
            "{}/{}: weights rank0 {:.1} MB, rank1 {:.1} MB, one GPU {:.1} MB; world up in {t_up:.1} s",
            v.model,
            v.name,
            descs[0].weight_bytes as f64 / 1e6,
            descs[1].weight_bytes as f64 / 1e6,
            one.weight_bytes() as f64 / 1e6
        );

        // Whole sequences, every position's logits.
        let (mut worst_1, mut worst_ref, mut over_ref) = (0f32, 0f32, 0usize);
        let mut step_id = 0u64;
        let mut next_page = 0u32;
        for (si, seq) in v.sequences.iter().enumerate() {
            let n_p = seq.len().div_ceil(PAGE as usize) as u32;
            let pages: Vec<u32> = (next_page..next_page + n_p).collect();
            next_page += n_p;
            let batch = ForwardBatch {
                seqs: vec![SeqStep { seq_id: si as u64 + 1, page_table: pages, cached_len: 0, tokens: seq.clone(), logits: LogitsWanted::All }],
            };
            step_id += 1;
            let got = world_step(&clients, step_id, &batch, v.vocab).await;
            let want = one.forward(&batch).unwrap();
            assert_eq!(got.len(), seq.len());
            for p in 0..seq.len() {
                let d1 = max_diff(&got[p], want.row(p));
                worst_1 = worst_1.max(d1);
                assert!(d1 <= TOL_1GPU, "{}/{} seq {si} pos {p}: tensor 2 vs one GPU max |diff| {d1}", v.model, v.name);
                let dr = max_diff(&got[p], &v.logits[si][p * v.vocab..(p + 1) * v.vocab]);
                worst_ref = worst_ref.max(dr);
                over_ref += usize::from(dr > TOL_REF);
            }
        }
        eprintln!(
            "{}/{}: tensor 2 logits vs one GPU max |diff| {worst_1:.2e}; vs transformers reference max |diff| {worst_ref:.2e} ({over_ref} positions over {TOL_REF:.0e})",
            v.model, v.name
        );
        assert_eq!(over_ref, 0, "{}/{}: positions over {TOL_REF} vs the reference", v.model, v.name);
        check_forced_socket(dir.path(), &v.gguf, "");

        // Greedy decoding, all sequences batched, through the servers and on one GPU.
        let prompts: Vec<Vec<u32>> = v.sequences.iter().map(|s| s[..s.len().min(7)].to_vec()).collect();
        let per_seq = (7 + GREEDY as u32).div_ceil(PAGE);
        let tables: Vec<Vec<u32>> = (0..prompts.len() as u32).map(|s| (0..per_seq).map(|p| next_page + s * per_seq + p).collect()).collect();
        assert!(next_page + prompts.len() as u32 * per_seq <= N_PAGES, "pages");
        let mut toks_w: Vec<Vec<u32>> = vec![Vec::new(); prompts.len()];
        let mut toks_1: Vec<Vec<u32>> = vec![Vec::new(); prompts.len()];
        let mut min_gap = f32::INFINITY;
        let t_gen = Instant::now();
        for step in 0..GREEDY {
            let mk = |toks: &Vec<Vec<u32>>| ForwardBatch {
                seqs: (0..prompts.len())
                    .map(|s| {
                        let (cached, tokens) = if step == 0 { (0, prompts[s].clone()) } else { (prompts[s].len() + step - 1, vec![*toks[s].last().unwrap()]) };
                        SeqStep { seq_id: 100 + s as u64, page_table: tables[s].clone(), cached_len: cached, tokens, logits: LogitsWanted::Last }
                    })
                    .collect(),
            };
            step_id += 1;
            let rows = world_step(&clients, step_id, &mk(&toks_w), v.vocab).await;
            let out = one.forward(&mk(&toks_1)).unwrap();
            for s in 0..prompts.len() {
                let (tw, gap) = argmax(&rows[s]);
                let (t1, _) = argmax(out.row(s));
                min_gap = min_gap.min(gap);
                toks_w[s].push(tw);
                toks_1[s].push(t1);
            }
        }
        let same = (0..prompts.len()).filter(|&s| toks_w[s] == toks_1[s]).count();
        eprintln!(
            "{}/{}: greedy {GREEDY} tokens x {} sequences: {same} identical to one GPU (min top-2 gap {min_gap:.1e}; {:.2} s)",
            v.model,
            v.name,
            prompts.len(),
            t_gen.elapsed().as_secs_f32()
        );
        for s in 0..prompts.len() {
            assert_eq!(toks_w[s], toks_1[s], "{}/{} seq {s}: tensor 2 vs one GPU greedy tokens", v.model, v.name);
        }
        drop(clients);
        drop(procs);
    }
}

/// Greedy decoding of `prompt` for `n` steps from `from` (0 = prefill) on a world, one
/// sequence; returns the tokens (or the first step's error with the step index).
async fn world_greedy(clients: &[Client], step_id: &mut u64, seq_id: u64, prompt: &[u32], toks: &mut Vec<u32>, n: usize, vocab: usize) {
    let pages: Vec<u32> = (0..(prompt.len() + 64).div_ceil(PAGE as usize) as u32).collect();
    for _ in 0..n {
        let (cached, tokens) = if toks.is_empty() { (0, prompt.to_vec()) } else { (prompt.len() + toks.len() - 1, vec![*toks.last().unwrap()]) };
        let batch = ForwardBatch { seqs: vec![SeqStep { seq_id, page_table: pages.clone(), cached_len: cached, tokens, logits: LogitsWanted::Last }] };
        *step_id += 1;
        let rows = world_step(clients, *step_id, &batch, vocab).await;
        toks.push(argmax(&rows[0]).0);
    }
}

/// kill -9 of a rank while its peer waits inside an NCCL all-reduce: the survivor's watcher
/// sees the test transport close, aborts the communicator (`ncclCommAbort`), and the blocked
/// step returns UNAVAILABLE instead of hanging; the survivor drops to LOADED. A new rank 1 and
/// a new CREATE (fresh NCCL unique id) + JOIN bring the same survivor process back, and
/// greedy decoding gives the same tokens as before the failure and as one GPU.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
#[ignore = "needs two CUDA GPUs"]
async fn rank_death_mid_collective_aborts_nccl_and_the_world_rejoins() {
    let n_gpus = gpu_count();
    if n_gpus < 2 {
        eprintln!("SKIPPED: {n_gpus} GPU(s); tensor parallelism over NCCL needs 2");
        return;
    }
    let v = variants().into_iter().find(|v| v.model == "m2-small" && v.name == "q8_0").expect("fixture");
    let dir = tempfile::tempdir().unwrap();
    // Rank 1 kills itself in its 4th computing step, after the agreement: rank 0 is then
    // certain to be inside the step's first all-reduce, waiting for it.
    const DIE_AT: usize = 4;
    let die_at = DIE_AT.to_string();
    let procs = vec![
        spawn_rank(dir.path(), &v.gguf, 2, 0, &[], "-death"),
        spawn_rank(dir.path(), &v.gguf, 2, 1, &[("MINIMAX_TEST_DIE_IN_STEP", &die_at), ("MINIMAX_ALLOW_TEST_HOOKS", "1")], "-death"),
    ];
    let (mut procs, mut clients, _) = start_procs(dir.path(), procs).await;
    let prompt: Vec<u32> = v.sequences[0][..v.sequences[0].len().min(7)].to_vec();
    let mut step_id = 0u64;
    let mut before = Vec::new();
    world_greedy(&clients, &mut step_id, 1, &prompt, &mut before, DIE_AT - 1, v.vocab).await;

    // The fatal step: rank 1 dies; rank 0 must answer (an error) soon, not hang in NCCL.
    let batch = pb::StepRequest {
        after_step_id: 0,
        step_id: step_id + 1,
        seqs: vec![to_pb(&SeqStep {
            seq_id: 1,
            page_table: (0..(prompt.len() + 64).div_ceil(PAGE as usize) as u32).collect(),
            cached_len: prompt.len() + before.len() - 1,
            tokens: vec![*before.last().unwrap()],
            logits: LogitsWanted::Last,
        })],
        late_rules: vec![],
    };
    let t_kill = Instant::now();
    let (mut c0, mut c1) = (clients[0].clone(), clients[1].clone());
    let (b0, b1) = (batch.clone(), batch);
    let h1 = tokio::spawn(async move { c1.step(b1).await });
    let r0 = tokio::time::timeout(Duration::from_secs(30), c0.step(b0)).await.expect("rank 0's step hung in NCCL after its peer died");
    let t_err = t_kill.elapsed().as_secs_f32();
    let st = r0.expect_err("rank 0's step must fail when its peer dies mid-collective");
    eprintln!("rank 0 step failed {t_err:.2} s after rank 1 was told to die: {:?} {}", st.code(), st.message());
    assert_eq!(st.code(), tonic::Code::Unavailable, "{}", st.message());
    assert!(h1.await.unwrap().is_err(), "rank 1 answered a step it died in");
    assert!(procs[1].child.wait().is_ok());
    let d0 = clients[0].describe(pb::DescribeRequest {}).await.unwrap().into_inner();
    assert_eq!(d0.state, pb::RankState::Loaded as i32, "survivor state: {}", d0.error);
    assert!(d0.error.contains("world broken"), "{}", d0.error);
    let log0 = std::fs::read_to_string(log_dir(dir.path()).join("rank-0-q8_0-death.log")).unwrap_or_default();
    assert!(log0.contains("NCCL communicator aborted"), "the survivor's log does not show the NCCL abort");

    // A new rank 1 joins the same survivor with a fresh NCCL unique id.
    let t_rejoin = Instant::now();
    procs[1] = spawn_rank(dir.path(), &v.gguf, 2, 1, &[], "-rejoin");
    let mut c1 = connect(&procs[1].listen).await;
    wait_state(&mut c1, pb::RankState::Loaded).await;
    clients[1] = c1;
    let (clients, _) = join_world(dir.path(), clients).await;
    eprintln!("survivor + new rank 1 READY {:.2} s after the failure ({:.2} s re-join incl. rank load)", t_kill.elapsed().as_secs_f32(), t_rejoin.elapsed().as_secs_f32());
    let mut after = Vec::new();
    world_greedy(&clients, &mut step_id, 2, &prompt, &mut after, 16, v.vocab).await;
    assert_eq!(&after[..before.len()], &before[..], "greedy tokens after the re-join differ from before the failure");

    // And one GPU agrees.
    let gguf = Arc::new(GgufModel::open(&v.gguf).unwrap());
    let kv = KvSpec { page_size: PAGE as usize, n_pages: N_PAGES as usize };
    let mut one = CudaModel::load(gguf, kv, CudaOptions { device: 0, kv_dtype: KvDtype::F32, fast_decode: false, graphs: false }).unwrap();
    let pages: Vec<u32> = (0..(prompt.len() + 64).div_ceil(PAGE as usize) as u32).collect();
    let mut solo: Vec<u32> = Vec::new();
    for _ in 0..after.len() {
        let (cached, tokens) = if solo.is_empty() { (0, prompt.clone()) } else { (prompt.len() + solo.len() - 1, vec![*solo.last().unwrap()]) };
        let out = one.forward(&ForwardBatch { seqs: vec![SeqStep { seq_id: 9, page_table: pages.clone(), cached_len: cached, tokens, logits: LogitsWanted::Last }] }).unwrap();
        solo.push(argmax(out.row(0)).0);
    }
    assert_eq!(after, solo, "re-joined world vs one GPU greedy tokens");
    eprintln!("rank death: error after {t_err:.2} s; {} greedy tokens after the re-join equal the pre-failure ones and one GPU's", after.len());
    drop(clients);
    drop(procs);
}
