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
use std::process::{Child, Command, Stdio};
use std::sync::Arc;
use std::time::{Duration, Instant};

use common::{max_diff, variants};
use hyper_util::rt::TokioIo;
use minimax_proto::v1 as pb;
use minimax_proto::v1::rank_client::RankClient;
use minimax_rank::cpu::KvSpec;
use minimax_rank::cuda::{CudaModel, CudaOptions, KvDtype};
use minimax_shared::forward::{ForwardBatch, LogitsWanted, SeqStep};
use minimax_shared::gguf::GgufModel;
use tonic::transport::{Channel, Endpoint};

const PAGE: u32 = 16;
const N_PAGES: u32 = 64;
/// Tensor parallel vs one GPU: same kernels and f32 KV cache, only the summation order of
/// the reduced projections and of the q/k sums of squares differ.
const TOL_1GPU: f32 = 2e-3;
/// Against the transformers reference (as tests/cuda_model.rs with an f32 cache).
const TOL_REF: f32 = 2e-2;
const GREEDY: usize = 64;

type Client = RankClient<Channel>;

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

fn rank_bin() -> PathBuf {
    std::env::var_os("MINIMAX_RANK_BIN").map(PathBuf::from).unwrap_or_else(|| PathBuf::from(env!("CARGO_BIN_EXE_minimax-rank")))
}

fn gpu_count() -> usize {
    Command::new("nvidia-smi").arg("-L").output().map(|o| String::from_utf8_lossy(&o.stdout).lines().filter(|l| l.starts_with("GPU ")).count()).unwrap_or(0)
}

/// Rank logs go to $OUT when set (the device tool brings them back), else next to the sockets.
fn log_dir(dir: &Path) -> PathBuf {
    std::env::var_os("OUT").map(PathBuf::from).unwrap_or_else(|| dir.to_path_buf())
}

fn spawn_world(dir: &Path, model: &Path, world: usize) -> Vec<RankProc> {
    (0..world)
        .map(|r| {
            let listen = format!("unix://{}/rank-{r}.sock", dir.display());
            let mut cmd = Command::new(rank_bin());
            cmd.args(["serve", "--rank", &r.to_string(), "--world-size", &world.to_string(), "--listen", &listen])
                .arg("--model")
                .arg(model)
                .args(["--device", &format!("cuda:{r}"), "--parallelism", "tensor"])
                .args(["--page-size", &PAGE.to_string(), "--kv-pages", &N_PAGES.to_string(), "--collective-timeout-ms", "60000"])
                .env("RUST_LOG", "info")
                .env("MINIMAX_CUDA_KV_DTYPE", "f32")
                .env("NCCL_NVLS_ENABLE", "0")
                .stdout(Stdio::null())
                .stderr(std::fs::File::create(log_dir(dir).join(format!("rank-{r}-{}.log", model.file_stem().unwrap().to_string_lossy()))).unwrap());
            RankProc { child: cmd.spawn().expect("spawn minimax-rank"), listen }
        })
        .collect()
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
            Err(e) if Instant::now() < deadline => {
                let _ = e;
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
            Err(e) => panic!("cannot connect to {listen}: {e}"),
        }
    }
}

async fn wait_state(c: &mut Client, want: pb::RankState) -> pb::DescribeResponse {
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

async fn start_world(dir: &Path, model: &Path, world: usize) -> (Vec<RankProc>, Vec<Client>, Vec<pb::DescribeResponse>) {
    let procs = spawn_world(dir, model, world);
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
    (procs, clients, descs)
}

fn to_pb(s: &SeqStep) -> pb::SeqStep {
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

/// One step on every rank; the head rank's (rank 0) full logits rows.
async fn world_step(clients: &[Client], step_id: u64, batch: &ForwardBatch, vocab: usize) -> Vec<Vec<f32>> {
    let req = pb::StepRequest { step_id, seqs: batch.seqs.iter().map(to_pb).collect() };
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
    let mut rows = Vec::new();
    for res in &resps[0].seqs {
        assert_eq!(res.error, "", "seq {}", res.seq_id);
        for row in &res.rows {
            assert_eq!(row.candidate_ids.len(), vocab, "whole vocabulary expected");
            let mut out = vec![f32::NAN; vocab];
            for (&i, &v) in row.candidate_ids.iter().zip(&row.candidate_raw_logits) {
                out[i as usize] = v;
            }
            rows.push(out);
        }
    }
    rows
}

fn argmax(x: &[f32]) -> (u32, f32) {
    let mut best = 0;
    for i in 1..x.len() {
        if x[i] > x[best] {
            best = i;
        }
    }
    let second = x.iter().enumerate().filter(|&(i, _)| i != best).map(|(_, &v)| v).fold(f32::NEG_INFINITY, f32::max);
    (best as u32, x[best] - second)
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
