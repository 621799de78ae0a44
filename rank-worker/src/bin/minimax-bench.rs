//! Benchmark of the rank forward on one GPU with synthetic MiniMax-M2.7 weights (no GGUF):
//! correctness of the fast decode path against the exact path at real dimensions, then decode
//! and prefill speed, batch scaling, long-context decode, a per-kernel split of one decode step
//! and the bandwidth bound. Results: docs/BENCHMARKS.md.
//!
//! minimax-bench [--synthetic m2.7:iq4xs[:LAYERS]] [--check-layers N] [--no-8k] [--no-prefill] [--prefill-only]
//!               [--decode-steps N] [--ab] [--greedy-streams] [--similar-prompts] [--batches 1,4,16,32] [--no-32k] [--pdl-ab] [--moe-ab] [--stream-ab] [--norm-ab] [--skip-ab] [--gstream-ab] [--mvmma-ab] [--router-ab] [--normless-ab] [--inline-ab] [--qkfuse-ab] [--attn-exit-ab] [--x8-ab] [--router-warps-ab] [--pace-ab] [--trig-ab] [--short-ab] [--pool-ab] [--tma-ab] [--first-calls] [--prompts N,P]
//! (several GPUs: `--tp N` / `--pp N`, see bench/world.rs)

use std::time::Instant;

use minimax_rank::cpu::KvSpec;
use minimax_rank::cuda::{CudaModel, CudaOptions, GemmPrecision, gemm_precision, set_dense_tile, set_gemm_precision, set_group_tile};
use minimax_shared::forward::{ForwardBatch, ForwardOutput, LogitsWanted, SeqStep};
use minimax_shared::model::synthetic::SyntheticSpec;

#[path = "bench/world.rs"]
mod world;

const PAGE: usize = 16;

fn arg(name: &str) -> Option<String> {
    let a: Vec<String> = std::env::args().collect();
    a.iter().position(|x| x == name).and_then(|i| a.get(i + 1).cloned())
}
fn flag(name: &str) -> bool {
    std::env::args().any(|x| x == name)
}

/// Hands out fresh KV pages (next, pool size); starts over at page 0 when the pool runs out
/// (runs that take fresh pages write every position they read, so reuse is harmless).
struct Pages(u32, u32);
impl Pages {
    fn take(&mut self, n: usize) -> Vec<u32> {
        if self.0 + n as u32 > self.1 {
            self.0 = 0;
        }
        let v = (self.0..self.0 + n as u32).collect();
        self.0 += n as u32;
        v
    }
}

fn step(seq: u64, pt: &[u32], cached: usize, tokens: Vec<u32>, logits: LogitsWanted) -> SeqStep {
    SeqStep { seq_id: seq, page_table: pt.to_vec(), cached_len: cached, tokens, logits }
}

/// The token stream `i` is fed after decode step `s` of the batched runs. By default distinct
/// pseudo-random ids: with random weights, greedy streams of near-identical prompts tend to
/// repeat each other's tokens, so how many experts a step touches (and the tok/s) would depend
/// on the numerics of the run. `--greedy-streams` feeds each stream's argmax instead.
fn stream_token(i: usize, s: usize, greedy: u32) -> u32 {
    static GREEDY: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    if *GREEDY.get_or_init(|| flag("--greedy-streams")) {
        return greedy;
    }
    pseudo_token(i, s)
}

/// A pseudo-random token id below 200,000 for (stream, index) (splitmix64).
fn pseudo_token(i: usize, s: usize) -> u32 {
    let mut x = ((i as u64) << 32 | s as u64).wrapping_add(0x9E37_79B9_7F4A_7C15);
    x = (x ^ (x >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    x = (x ^ (x >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    ((x ^ (x >> 31)) % 200_000) as u32
}

/// Mean ms of one replay of the captured `nt`-token step graph, over `reps` replays after one
/// warm-up replay.
fn replay_ms(m: &mut CudaModel, nt: usize, reps: usize) -> anyhow::Result<f64> {
    m.replay_fast_step(nt)?;
    m.gpu().sync()?;
    let t = Instant::now();
    for _ in 0..reps {
        m.replay_fast_step(nt)?;
    }
    m.gpu().sync()?;
    Ok(ms(t) / reps as f64)
}

/// (kernel, ms) of each launch of one `nt`-token step launched directly (no graph), with CUDA
/// events around every launch; graphs are back on afterwards.
fn profile_step(m: &mut CudaModel, nt: usize) -> anyhow::Result<Vec<(String, f32)>> {
    m.set_fast(true, false);
    m.gpu().profile_begin();
    m.replay_fast_step(nt)?;
    let prof = m.gpu().profile_end()?;
    m.set_fast(true, true);
    Ok(prof)
}

/// `--nsys-replay NT`: `nt` sequences with a 5-token prompt, three steps (the graph is captured),
/// then 20 graph replays of the `nt`-token step inside a profiler range, so
/// `nsys profile -c cudaProfilerApi --cuda-graph-trace=node` records exactly the replayed
/// kernels (their real durations and the gaps between them, which CUDA events cannot show).
fn nsys_replay(m: &mut CudaModel, pages: &mut Pages, nt: usize) -> anyhow::Result<()> {
    anyhow::ensure!((1..=32).contains(&nt), "--nsys-replay: 1..=32 tokens, got {nt}");
    let pts: Vec<Vec<u32>> = (0..nt).map(|_| pages.take(2)).collect();
    let mut toks = start_streams(m, &pts)?;
    for s in 0..3 {
        stream_step(m, &pts, &mut toks, s)?;
    }
    m.gpu().sync()?;
    let t = Instant::now();
    {
        let _range = cudarc::driver::Profiler::new()?;
        for _ in 0..20 {
            m.replay_fast_step(nt)?;
        }
        m.gpu().sync()?;
    }
    println!("nsys replay: 20 replays of the {nt}-token step, {:.3} ms each (incl. profiler overhead)", ms(t) / 20.0);
    Ok(())
}

/// Stream `i` (sequence 100 + i over pages `pts[i]`) gets its 5-token prompt; returns each
/// stream's first token. The prompts are pseudo-random ids, like the HTTP benchmark's: with
/// near-identical prompts (session 4 used `[1, 2 + i, 3, 4, 5]`) the random model's attention
/// output is nearly the same in every stream and a 32-token step routes to only ~45 experts a
/// layer, against ~160 for distinct contexts (and for served traffic), which made the batched
/// figures optimistic (839 against 590 tok/s served at 32 streams). `--similar-prompts` brings
/// the old prompts back.
fn start_streams(m: &mut CudaModel, pts: &[Vec<u32>]) -> anyhow::Result<Vec<u32>> {
    let mut toks = Vec::with_capacity(pts.len());
    let similar = flag("--similar-prompts");
    for (i, p) in pts.iter().enumerate() {
        let prompt: Vec<u32> = if similar { vec![1, 2 + i as u32, 3, 4, 5] } else { (0..5).map(|j| pseudo_token(i, 1_000_000 + j)).collect() };
        let o = m.forward(&ForwardBatch { seqs: vec![step(100 + i as u64, p, 0, prompt, LogitsWanted::Last)] })?;
        toks.push(argmax(o.row(0)));
    }
    Ok(toks)
}

/// Decode step `s` of every stream of [`start_streams`] in one batch: feeds `toks`, leaves the
/// next tokens there (`stream_token`); returns whether every greedy pick was a real token.
/// Like a served step, the logits stay on the device and the greedy reduction runs there
/// (`forward_stage_lazy` + `StepLogits::reduce`): nothing but the picks comes back.
fn stream_step(m: &mut CudaModel, pts: &[Vec<u32>], toks: &mut [u32], s: usize) -> anyhow::Result<bool> {
    let seqs = (0..pts.len()).map(|i| step(100 + i as u64, &pts[i], 5 + s, vec![toks[i]], LogitsWanted::Last)).collect();
    let vocab = m.config().vocab_size as u32;
    let out = m.forward_stage_lazy(&ForwardBatch { seqs })?.ok_or_else(|| anyhow::anyhow!("no logits from a one-stage model"))?;
    let greedy = minimax_shared::sampling::SamplingSpec { temperature: 0.0, ..Default::default() };
    let jobs = vec![(greedy, None); toks.len()];
    let (reds, _) = out.reduce(&jobs)?;
    let mut ok = true;
    for (i, (t, r)) in toks.iter_mut().zip(reds).enumerate() {
        let pick = r.map_err(|e| anyhow::anyhow!("greedy reduction of stream {i}: {e}"))?.candidate_ids.first().copied();
        ok &= pick.is_some_and(|p| p < vocab);
        *t = stream_token(i, s, pick.unwrap_or(0));
    }
    Ok(ok)
}

/// A profile's kernel time by kernel family (dtype suffixes merged): (family, ms, launches), in
/// order of first launch.
fn kernel_families(prof: &[(String, f32)]) -> Vec<(String, f32, usize)> {
    let mut fam: Vec<(String, f32, usize)> = Vec::new();
    for (n, t) in prof {
        let key = n.trim_end_matches("_f16").trim_end_matches("_bf16").to_string();
        match fam.iter_mut().find(|f| f.0 == key) {
            Some(f) => {
                f.1 += t;
                f.2 += 1
            }
            None => fam.push((key, *t, 1)),
        }
    }
    fam
}

/// Prints a profiled step's kernel time by kernel family (dtype suffixes merged), largest first,
/// so the next thing to speed up is the first line.
fn print_split(prof: &[(String, f32)], what: &str) {
    let mut fam = kernel_families(prof);
    fam.sort_by(|a, b| b.1.partial_cmp(&a.1).unwrap());
    let tot: f32 = fam.iter().map(|f| f.1).sum();
    println!("\nper-kernel split of one {what} (events around each launch, no graph): total {tot:.3} ms, {} launches", prof.len());
    println!("{:<28} {:>8} {:>7} {:>9}", "kernel", "ms", "share", "launches");
    for (n, t, k) in &fam {
        println!("{:<28} {:>8.3} {:>6.1}% {:>9}", n, t, 100.0 * t / tot, k);
    }
    println!();
}

fn argmax(r: &[f32]) -> u32 {
    let mut b = 0;
    for (i, &x) in r.iter().enumerate() {
        if x > r[b] {
            b = i;
        }
    }
    b as u32
}

fn finite(o: &ForwardOutput) -> bool {
    o.logits.iter().all(|x| x.is_finite())
}

fn ms(t: Instant) -> f64 {
    t.elapsed().as_secs_f64() * 1e3
}

/// Device-to-device copy bandwidth (bytes read + written per second), 4 GiB buffers.
fn copy_bandwidth(m: &CudaModel) -> anyhow::Result<f64> {
    let g = m.gpu();
    // 1 GiB buffers: far past the 50 MB L2, and they fit beside the weights, a 32k KV cache
    // and the attention weights' bf16 copies on one H200.
    let n = 1usize << 30;
    let a = g.zeros::<u8>(n)?;
    let mut b = g.zeros::<u8>(n)?;
    g.stream.memcpy_dtod(&a, &mut b)?;
    g.sync()?;
    let reps = 5;
    let t = Instant::now();
    for _ in 0..reps {
        g.stream.memcpy_dtod(&a, &mut b)?;
    }
    g.sync()?;
    Ok(2.0 * n as f64 * reps as f64 / t.elapsed().as_secs_f64())
}

fn check_fast_vs_exact(spec_s: &str, layers: usize) -> anyhow::Result<()> {
    let spec = SyntheticSpec::parse(&format!("{spec_s}:{layers}"))?;
    let kv = KvSpec { page_size: PAGE, n_pages: 64 };
    let mut m = CudaModel::synthetic(&spec, kv, CudaOptions::default(), 7)?;
    if let Some(why) = m.fast_path_off() {
        println!("fast path off for {spec_s}: {why}");
        return Ok(());
    }
    let prompt: Vec<u32> = vec![1, 17, 4242, 99_999, 200_000];
    let mut outs = Vec::new();
    // Every run is fed the exact run's greedy tokens: a single top-k near-tie flipped by q8
    // rounding would otherwise change the next token and every step after it.
    let mut fed: Vec<u32> = Vec::new();
    // Run 3: every fast step's MoE grouped by expert (moe_group + the grouped streamed kernels,
    // MINIMAX_GSTREAM); run 4: the streamed expert kernels (MINIMAX_STREAM); run 5: grouped
    // by expert on the grouped register kernels (grpf); 1-2 the per-pair register kernels.
    let runs = [(false, false, 0u32, None, false, true), (true, false, 8, None, false, true), (true, true, 16, None, false, true), (true, true, 24, Some(1), false, true), (true, true, 48, None, true, true), (true, true, 32, Some(1), false, false)];
    for (fast, graphs, base, grp, stream, gstream) in runs {
        minimax_rank::cuda::fast::set_group_min(grp);
        minimax_rank::cuda::stream::set_stream(Some(stream));
        minimax_rank::cuda::gstream::set_gstream(Some(gstream));
        m.clear_graphs();
        m.set_fast(fast, graphs);
        let pt: Vec<u32> = (base..base + 8).collect();
        let mut o = vec![m.forward(&ForwardBatch { seqs: vec![step(0, &pt, 0, prompt.clone(), LogitsWanted::All)] })?];
        let mut tok = argmax(o[0].row(4));
        for i in 0..6 {
            if fast {
                tok = fed[i];
            } else {
                fed.push(tok);
            }
            let r = m.forward(&ForwardBatch { seqs: vec![step(0, &pt, 5 + i, vec![tok], LogitsWanted::Last)] })?;
            tok = argmax(r.row(0));
            o.push(r);
        }
        outs.push(o);
    }
    let scale = outs[0].iter().flat_map(|o| o.logits.iter()).fold(0f32, |a, x| a.max(x.abs()));
    minimax_rank::cuda::fast::set_group_min(None);
    minimax_rank::cuda::stream::set_stream(None);
    minimax_rank::cuda::gstream::set_gstream(None);
    m.clear_graphs();
    for (name, i) in [("fast", 1), ("fast+graphs", 2), ("fast+graphs, MoE grouped (streamed)", 3), ("fast+graphs, streamed MoE", 4), ("fast+graphs, MoE grouped (grpf)", 5)] {
        let mut md = 0f32;
        let mut same = 0;
        let mut per_step = Vec::new();
        for (a, b) in outs[0].iter().zip(&outs[i]) {
            let d = a.logits.iter().zip(&b.logits).fold(0f32, |m, (x, y)| m.max((x - y).abs()));
            md = md.max(d);
            per_step.push(format!("{:.1e}", d / scale.max(1e-9)));
            same += (argmax(a.row(a.rows.len() - 1)) == argmax(b.row(b.rows.len() - 1))) as usize;
        }
        let fin = outs[i].iter().all(finite);
        println!(
            "check {spec_s}:{layers} {name} vs exact (exact tokens fed): max |diff| {md:.4} (max |logit| {scale:.3}, rel {:.2e}; per step {}), argmax same {same}/7, finite {fin}",
            md / scale.max(1e-9),
            per_step.join(" ")
        );
    }
    // Streamed against register expert kernels on the same fed tokens (the gate/up is
    // bit-identical; the down adds a token's experts in another order).
    let d = outs[2].iter().zip(&outs[4]).flat_map(|(x, y)| x.logits.iter().zip(&y.logits)).fold(0f32, |m, (x, y)| m.max((x - y).abs()));
    println!("check {spec_s}:{layers} streamed vs register MoE kernels: max |diff| {d:.3e} (rel {:.2e})", d / scale.max(1e-9));
    let d = outs[3].iter().zip(&outs[5]).flat_map(|(x, y)| x.logits.iter().zip(&y.logits)).fold(0f32, |m, (x, y)| m.max((x - y).abs()));
    println!("check {spec_s}:{layers} grouped streamed vs grpf MoE kernels: max |diff| {d:.3e} (rel {:.2e})", d / scale.max(1e-9));
    println!("check exact path finite: {}", outs[0].iter().all(finite));
    // Prefill precision at real size: a 100-token prompt (tensor-core GEMMs), every position's
    // logits under the int8 GEMMs (the default) against bf16x3 (~f32 activations).
    let n = 100usize;
    let toks: Vec<u32> = (0..n as u32).map(|i| (i * 7919 + 13) % 200_000).collect();
    let mut by_prec = Vec::new();
    let prec = gemm_precision();
    for (p, base) in [(GemmPrecision::Bf16x3, 32u32), (GemmPrecision::Int8, 40)] {
        set_gemm_precision(p);
        let pt: Vec<u32> = (base..base + 8).collect();
        by_prec.push(m.forward(&ForwardBatch { seqs: vec![step(1, &pt, 0, toks.clone(), LogitsWanted::All)] })?);
    }
    set_gemm_precision(prec);
    let (a, b) = (&by_prec[0], &by_prec[1]);
    let scale = a.logits.iter().fold(0f32, |m, x| m.max(x.abs())).max(1e-9);
    let mut rel: Vec<f32> = (0..n).map(|i| a.row(i).iter().zip(b.row(i)).fold(0f32, |m, (x, y)| m.max((x - y).abs())) / scale).collect();
    let same = (0..n).filter(|&i| argmax(a.row(i)) == argmax(b.row(i))).count();
    rel.sort_by(f32::total_cmp);
    println!(
        "check {spec_s}:{layers} prefill {n} tokens, int8 vs bf16x3 GEMMs, per position relative to max |logit| {scale:.3}: median {:.2e}, 90th percentile {:.2e}, worst {:.2e}; argmax same {same}/{n}, finite {}",
        rel[n / 2],
        rel[n * 9 / 10],
        rel[n - 1],
        finite(b)
    );
    Ok(())
}

/// Kernel-choice A/B inside one process (`--ab`): for each combination of the Q8_0 dense
/// kernel, the IQ4_XS down kernel and the routing (exact / PDL / fused), the batch-1 and batch-32 graph
/// replay times and the batch-1 event split of the kernels that differ.
fn ab_runs(m: &mut CudaModel, pages: &mut Pages) -> anyhow::Result<()> {
    use minimax_rank::cuda::fast::{DownKind, MvqKind, set_kernel_overrides};
    use minimax_rank::cuda::fast::{RouteMode, set_route_mode};
    let combos = [
        ("run-4 kernels", MvqKind::Staged, DownKind::Staged, RouteMode::Exact),
        ("mvqs + down reg4 + router_topk", MvqKind::Whole, DownKind::Reg4, RouteMode::Fused),
        ("mvqs + down reg4 + route_fast", MvqKind::Whole, DownKind::Reg4, RouteMode::Fast),
        ("mvqs + down reg4 + moe_route", MvqKind::Whole, DownKind::Reg4, RouteMode::Exact),
        ("mvqs + down reg2 + router_topk", MvqKind::Whole, DownKind::Reg2, RouteMode::Fused),
        ("mvqs(12 only) + reg4 + router_topk", MvqKind::WholeShort, DownKind::Reg4, RouteMode::Fused),
    ];
    let b = 32usize;
    let pts: Vec<Vec<u32>> = (0..b).map(|_| pages.take(2)).collect();
    for (i, p) in pts.iter().enumerate() {
        m.forward(&ForwardBatch { seqs: vec![step(700 + i as u64, p, 0, vec![1, 3 + i as u32, 5, 7, 9], LogitsWanted::Last)] })?;
    }
    println!("\nA/B of fast-path kernels (same process; graph replay; events for the split):");
    println!("{:<36} {:>9} {:>9} {:>9} {:>9} {:>9} {:>9} {:>9}", "kernels", "b1 ms", "b1 tok/s", "b32 tok/s", "mvq ms", "down ms", "router ms", "sum ms");
    for (ci, (name, mvq, dn, rf)) in combos.iter().enumerate() {
        set_kernel_overrides(Some(*mvq), Some(*dn), None);
        set_route_mode(Some(*rf));
        m.clear_graphs();
        let pos = 5 + ci;
        let o = m.forward(&ForwardBatch { seqs: vec![step(700, &pts[0], pos, vec![11], LogitsWanted::Last)] })?;
        anyhow::ensure!(finite(&o), "{name}: non-finite logits");
        let b1 = replay_ms(m, 1, 50)?;
        let prof = profile_step(m, 1)?;
        let fam = |pre: &[&str]| -> f32 { prof.iter().filter(|(n, _)| pre.iter().any(|p| n.starts_with(p))).map(|(_, t)| *t).sum() };
        let (tm, td, tr) = (fam(&["mvq"]), fam(&["moe_down"]), fam(&["moe_route", "router"]));
        let tot: f32 = prof.iter().map(|(_, t)| *t).sum();
        let seqs = (0..b).map(|i| step(700 + i as u64, &pts[i], pos + 1, vec![13], LogitsWanted::Last)).collect();
        let o = m.forward(&ForwardBatch { seqs })?;
        anyhow::ensure!(finite(&o), "{name}: non-finite logits at batch {b}");
        let b32 = replay_ms(m, b, 10)?;
        println!("{:<36} {:>9.3} {:>9.1} {:>9.0} {:>9.3} {:>9.3} {:>9.3} {:>9.3}", name, b1, 1e3 / b1, b as f64 * 1e3 / b32, tm, td, tr, tot);
    }
    set_kernel_overrides(None, None, None);
    set_route_mode(None);
    decode_fusion_ab(m, &pts, 5 + combos.len())?;
    // MoE grouped by expert (moe_group + *_grp kernels) vs per-pair kernels, per step size.
    println!("\nMoE grouped by expert vs per (token, expert) pair (graph replay, default kernels otherwise):");
    println!("{:>6} {:>14} {:>14} {:>9}", "batch", "per-pair tok/s", "grouped tok/s", "speed-up");
    let pos = 5 + combos.len() + 1;
    for nb in [1usize, 4, 8, 16, 32] {
        let mut r = [0f64; 2];
        for (gi, grp_min) in [0usize, 1].into_iter().enumerate() {
            minimax_rank::cuda::fast::set_group_min(Some(grp_min));
            m.clear_graphs();
            let seqs = (0..nb).map(|i| step(700 + i as u64, &pts[i], pos, vec![17], LogitsWanted::Last)).collect();
            let o = m.forward(&ForwardBatch { seqs })?;
            anyhow::ensure!(finite(&o), "grouped {grp_min}: non-finite logits at batch {nb}");
            r[gi] = nb as f64 * 1e3 / replay_ms(m, nb, if nb >= 16 { 10 } else { 30 })?;
        }
        println!("{:>6} {:>14.1} {:>14.1} {:>8.2}x", nb, r[0], r[1], r[1] / r[0]);
    }
    minimax_rank::cuda::fast::set_group_min(None);
    m.clear_graphs();
    println!();
    Ok(())
}

/// A/B of the decode kernels changed in session 3 (graph replay; batch-1 event totals): the
/// per-task expert kernels of session 2, the persistent gate/up (the default) and down
/// (`MINIMAX_DN=p`), and the attention merge folded into the split kernel
/// (`MINIMAX_ATTN_FUSE=1`). Batch 32 (`pts.len()`
/// sequences) sees only the attention change (its MoE is grouped).
fn decode_fusion_ab(m: &mut CudaModel, pts: &[Vec<u32>], pos: usize) -> anyhow::Result<()> {
    use minimax_rank::cuda::fast::{DownKind, GateUpKind, set_attn_fusion, set_gate_up_kind, set_kernel_overrides};
    let rows = [
        ("session 2: reg2 gate/up, reg4 down", false, DownKind::Reg4, GateUpKind::Reg(2, true)),
        ("persistent gate/up, reg4 down (session 4)", false, DownKind::Reg4, GateUpKind::Persist),
        ("persistent gate/up + down", false, DownKind::Persist, GateUpKind::Persist),
        ("default + attention merge folded", true, DownKind::Reg4, GateUpKind::Persist),
    ];
    println!("\nbatch-1 decode kernels A/B (graph replay; events for the total and launch count):");
    println!("{:<48} {:>9} {:>9} {:>9} {:>9} {:>9} {:>9} {:>9}", "kernels", "b1 ms", "b1 tok/s", "event ms", "launches", "g/u ms", "down ms", "b32 tok/s");
    for (i, (name, attn, dn, gu)) in rows.iter().enumerate() {
        set_attn_fusion(Some(*attn));
        set_kernel_overrides(None, Some(*dn), None);
        set_gate_up_kind(Some(*gu));
        m.clear_graphs();
        let p = pos + 2 * i;
        let o = m.forward(&ForwardBatch { seqs: vec![step(700, &pts[0], p, vec![11], LogitsWanted::Last)] })?;
        anyhow::ensure!(finite(&o), "{name}: non-finite logits");
        let b1 = replay_ms(m, 1, 50)?;
        let prof = profile_step(m, 1)?;
        let fam = |pre: &str| -> f32 { prof.iter().filter(|(n, _)| n.starts_with(pre)).map(|(_, t)| *t).sum() };
        let tot: f32 = prof.iter().map(|(_, t)| *t).sum();
        let b = pts.len();
        let seqs = (0..b).map(|j| step(700 + j as u64, &pts[j], p + 1, vec![13], LogitsWanted::Last)).collect();
        anyhow::ensure!(finite(&m.forward(&ForwardBatch { seqs })?), "{name}: non-finite logits at batch {b}");
        let bb = replay_ms(m, b, 10)?;
        println!("{:<48} {:>9.3} {:>9.1} {:>9.3} {:>9} {:>9.3} {:>9.3} {:>9.0}", name, b1, 1e3 / b1, tot, prof.len(), fam("moe_gate_up"), fam("moe_down"), b as f64 * 1e3 / bb);
    }
    set_attn_fusion(None);
    set_kernel_overrides(None, None, None);
    set_gate_up_kind(None);
    m.clear_graphs();
    Ok(())
}

/// `--pdl-ab`: graph replay at batch 1 / 4 / 16 / 32 for sets of the PDL pre-wait parts
/// (`fast::set_pdl_parts`: weight loads before the wait, early triggers of the small kernels),
/// in one process, three passes (bit-identical kernels; the tests check that). Then exits.
fn pdl_ab(m: &mut CudaModel, pages: &mut Pages) -> anyhow::Result<()> {
    use minimax_rank::cuda::fast::*;
    for (name, threads) in [("mvqs_q8_0_1sp", 256), ("mvqs_q8_0_1s2p", 128), ("mvqs_q8_0_1lp", 128), ("router_topk_f32p", 128), ("qk_norm_rope_store_p_f16", 1024)] {
        println!("resident blocks on the device, {name} ({threads} threads): {}", m.gpu().resident_blocks(name, threads)?);
    }
    let bs = [1usize, 4, 16, 32];
    let pts: Vec<Vec<u32>> = (0..32).map(|_| pages.take(8)).collect();
    let mut toks = start_streams(m, &pts)?;
    // The default parts (PDL_PREFETCH_PARTS) against the plain kernels and every part.
    let rows = [
        ("plain", 0),
        ("default", PDL_PREFETCH_PARTS),
        ("default + router", PDL_PREFETCH_PARTS | PDL_ROUTER),
        ("default + norm early", PDL_PREFETCH_PARTS | PDL_NORM_EARLY),
        ("default + merge early", PDL_PREFETCH_PARTS | PDL_MERGE_EARLY),
        ("all parts", PDL_ALL_PARTS),
    ];
    println!("\nPDL A/B (graph replay, ms per step; tok/s in brackets):");
    println!("{:<26} {:>18} {:>18} {:>18} {:>18}", "parts", "b1", "b4", "b16", "b32");
    // Each stream's next position (5-token prompts; a stream advances only when stepped).
    let mut pos = vec![5usize; pts.len()];
    for pass in 0..3 {
        for (name, parts) in rows {
            set_pdl_parts(Some(parts));
            m.clear_graphs();
            let mut line = format!("{:<26}", format!("{pass} {name}"));
            for &b in &bs {
                let seqs = (0..b).map(|i| step(100 + i as u64, &pts[i], pos[i], vec![toks[i]], LogitsWanted::Last)).collect();
                let o = m.forward(&ForwardBatch { seqs })?;
                anyhow::ensure!(finite(&o), "{name}: non-finite logits at batch {b}");
                for i in 0..b {
                    toks[i] = stream_token(i, pos[i], argmax(o.row(i)));
                    pos[i] += 1;
                }
                let r = replay_ms(m, b, if b == 1 { 200 } else { 20 })?;
                line += &format!(" {:>9.3} ({:>6.0})", r, b as f64 * 1e3 / r);
            }
            println!("{line}");
        }
    }
    set_pdl_parts(None);
    m.clear_graphs();
    Ok(())
}

/// `--moe-ab`: batch-1 (and batch-32) graph replay with the per-pair expert kernels of
/// session 4 (`moe_gate_up_pst`, `moe_down_reg4`) and session 5 (`psx` gate/up: interleaved
/// activations and the cheaper IQ4 decode; `psy`: the same at two blocks per SM, slower;
/// `rx4` down: weights loaded before the PDL wait), in
/// one process, alternating so drift shows; the kernels are bit-identical (tests check that).
/// Batch 32 runs the grouped MoE, so it sees neither. Then exits.
fn moe_ab(m: &mut CudaModel, pages: &mut Pages) -> anyhow::Result<()> {
    use minimax_rank::cuda::fast::{DownKind, GateUpKind, set_gate_up_kind, set_kernel_overrides};
    let pts: Vec<Vec<u32>> = (0..32).map(|_| pages.take(4)).collect();
    let mut toks = start_streams(m, &pts)?;
    let rows = [
        ("pst + reg4 (session 4)", GateUpKind::Persist, DownKind::Reg4),
        ("psx + reg4", GateUpKind::PersistIl, DownKind::Reg4),
        ("pst + rx4", GateUpKind::Persist, DownKind::Reg4Pre),
        ("psx + rx4 (default)", GateUpKind::PersistIl, DownKind::Reg4Pre),
        ("psy + rx4", GateUpKind::PersistSm, DownKind::Reg4Pre),
        ("pst + reg4 (again)", GateUpKind::Persist, DownKind::Reg4),
        ("psx + rx4 (again)", GateUpKind::PersistIl, DownKind::Reg4Pre),
    ];
    println!("\nexpert kernels A/B (graph replay, ms per step; tok/s in brackets):");
    println!("{:<26} {:>18} {:>18}", "kernels", "b1", "b32");
    let mut s = 0;
    for (name, gu, dn) in rows {
        set_gate_up_kind(Some(gu));
        set_kernel_overrides(None, Some(dn), None);
        m.clear_graphs();
        let mut line = format!("{name:<26}");
        for b in [1usize, 32] {
            anyhow::ensure!(stream_step(m, &pts[..b], &mut toks[..b], s)?, "{name}: bad logits at batch {b}");
            s += 1;
            let r = replay_ms(m, b, if b == 1 { 100 } else { 20 })?;
            line += &format!(" {:>9.3} ({:>6.0})", r, b as f64 * 1e3 / r);
        }
        println!("{line}");
    }
    set_gate_up_kind(None);
    set_kernel_overrides(None, None, None);
    m.clear_graphs();
    Ok(())
}

/// `--stream-ab`: the streamed expert kernels (kernels/stream.cu, with the lookup and with the
/// sign decode) against the register ones at batch 1 (steps of several tokens group their MoE
/// by expert, which does not stream), graph replay, alternating, three rounds; then stage
/// shapes and ring caps; then the per-kernel split of a batch-1 step with the streamed kernels.
fn stream_ab(m: &mut CudaModel, pages: &mut Pages) -> anyhow::Result<()> {
    use minimax_rank::cuda::stream::{set_stream, set_stream_lookup, set_stream_rows_cap, set_stream_stage_cap};
    let mut fin = true;
    let b = 1usize;
    let steps: usize = 40;
    let pts: Vec<Vec<u32>> = (0..b).map(|_| pages.take((5 + steps + 2).div_ceil(PAGE))).collect();
    let mut toks = start_streams(m, &pts)?;
    let mut s = 0;
    // (name, streamed, lookup decode)
    let cfgs = [("register kernels", false, false), ("streamed lookup decode", true, true), ("streamed sign decode", true, false)];
    let mut r = [0f64; 3];
    for _round in 0..3 {
        for (i, &(_, on, lookup)) in cfgs.iter().enumerate() {
            set_stream(Some(on));
            set_stream_lookup(Some(lookup));
            m.clear_graphs();
            fin &= stream_step(m, &pts, &mut toks, s)?;
            s += 1;
            r[i] += replay_ms(m, b, 30)? / 3.0;
        }
    }
    set_stream_lookup(None);
    let cells: Vec<String> = cfgs.iter().zip(&r).map(|(c, t)| format!("{} {t:.3} ms ({:.1} tok/s)", c.0, 1e3 / t)).collect();
    println!("stream A/B batch 1: {} (graph replay, mean of 3 alternating rounds)", cells.join(", "));
    set_stream(Some(true));
    for (gr, dr) in [(32usize, 8usize), (16, 8), (8, 4)] {
        set_stream_rows_cap(Some((gr, dr)));
        for cap in [2usize, 8] {
            set_stream_stage_cap(Some(cap));
            m.clear_graphs();
            fin &= stream_step(m, &pts, &mut toks, s)?;
            s += 1;
            let t = replay_ms(m, b, 20)?;
            println!("stream stages <= {gr} gate rows / {dr} down rows, <= {cap} stages, batch 1: {t:.3} ms ({:.1} tok/s)", 1e3 / t);
        }
    }
    set_stream_rows_cap(None);
    set_stream_stage_cap(None);
    m.clear_graphs();
    fin &= stream_step(m, &pts, &mut toks, s)?;
    print_split(&profile_step(m, b)?, "batch-1 decode step, streamed expert kernels");
    set_stream(None);
    m.clear_graphs();
    anyhow::ensure!(fin, "non-finite or out-of-vocabulary picks in the stream A/B");
    Ok(())
}

/// A batch-1 A/B over named settings (`set(i)` switches to setting i): graph replay of a
/// batch-1 step, the settings alternating, three rounds, mean ms a step.
fn b1_ab(m: &mut CudaModel, pages: &mut Pages, what: &str, names: &[&str], set: &dyn Fn(usize)) -> anyhow::Result<()> {
    bn_ab(m, pages, 1, what, names, set)
}

/// [`b1_ab`] with `b` streams (one token each a step).
fn bn_ab(m: &mut CudaModel, pages: &mut Pages, b: usize, what: &str, names: &[&str], set: &dyn Fn(usize)) -> anyhow::Result<()> {
    let steps: usize = 20 * names.len() + 4;
    let pts: Vec<Vec<u32>> = (0..b).map(|_| pages.take((5 + steps + 2).div_ceil(PAGE))).collect();
    let mut toks = start_streams(m, &pts)?;
    let mut r = vec![0f64; names.len()];
    let mut s = 0;
    for _round in 0..3 {
        for (i, t) in r.iter_mut().enumerate() {
            set(i);
            m.clear_graphs();
            anyhow::ensure!(stream_step(m, &pts, &mut toks, s)?, "non-finite or out-of-vocabulary picks ({what}, {})", names[i]);
            s += 1;
            *t += replay_ms(m, b, 30)? / 3.0;
        }
    }
    let cells: Vec<String> = names.iter().zip(&r).map(|(n, t)| format!("{n} {t:.3} ms ({:.1} tok/s)", 1e3 * b as f64 / t)).collect();
    println!("{what} A/B, batch {b} (graph replay, mean of 3 alternating rounds): {}", cells.join(", "));
    Ok(())
}

/// `--norm-ab`: the RMSNorms folded into their neighbours (fast::set_norm_fusion) against
/// separate `norm_q8` launches, graph replay, alternating, three rounds: at batch 1 the router
/// and the streamed down's fusions alone and together, the down's two trigger points, and
/// `norm_q8e`; at batch 4 and 32 (no streamed down there) the router's. Then the batch-1
/// per-kernel split with the defaults.
fn norm_ab(m: &mut CudaModel, pages: &mut Pages) -> anyhow::Result<()> {
    use minimax_rank::cuda::fast::{PDL_NORM_EARLY, PDL_PREFETCH_PARTS, set_norm_fusion, set_pdl_parts};
    let mut fin = true;
    let early = Some(PDL_PREFETCH_PARTS | PDL_NORM_EARLY);
    let steps: usize = 40;
    for b in [1usize, 4, 32] {
        let pts: Vec<Vec<u32>> = (0..b).map(|_| pages.take((5 + steps + 2).div_ceil(PAGE))).collect();
        let mut toks = start_streams(m, &pts)?;
        // (name, router fused, down fused, late trigger, PDL parts: None = default, early =
        // norm_q8e, whose early trigger lets the q/k/v start its weight copies during the down,
        // as the fused down's early trigger does)
        let cfgs: Vec<(&str, bool, bool, bool, Option<u32>)> = if b == 1 {
            vec![
                ("separate", false, false, false, None),
                ("router", true, false, false, None),
                ("down early", false, true, false, None),
                ("down late", false, true, true, None),
                ("router+down early", true, true, false, None),
                ("separate, norm_q8e", false, false, false, early),
            ]
        } else {
            vec![("separate", false, false, false, None), ("router", true, false, false, None), ("separate, norm_q8e", false, false, false, early)]
        };
        let mut r = vec![0f64; cfgs.len()];
        let mut s = 0;
        for _round in 0..3 {
            for (i, &(_, router, down, late, parts)) in cfgs.iter().enumerate() {
                set_norm_fusion(Some(router), Some(down), Some(late));
                set_pdl_parts(parts);
                m.clear_graphs();
                fin &= stream_step(m, &pts, &mut toks, s)?;
                s += 1;
                r[i] += replay_ms(m, b, 30)? / 3.0;
            }
        }
        let cells: Vec<String> = cfgs.iter().zip(&r).map(|(c, t)| format!("{} {t:.3} ms ({:.1} tok/s)", c.0, 1e3 * b as f64 / t)).collect();
        println!("norm fusion A/B batch {b}: {} (graph replay, mean of 3 alternating rounds)", cells.join(", "));
    }
    set_norm_fusion(None, None, None);
    set_pdl_parts(None);
    let pts: Vec<Vec<u32>> = vec![pages.take(9usize.div_ceil(PAGE))];
    let mut toks = start_streams(m, &pts)?;
    m.clear_graphs();
    fin &= stream_step(m, &pts, &mut toks, 0)?;
    print_split(&profile_step(m, 1)?, "batch-1 decode step, norms fused (defaults)");
    m.clear_graphs();
    anyhow::ensure!(fin, "non-finite or out-of-vocabulary picks in the norm A/B");
    Ok(())
}

/// `--skip-ab`: what each part of a decode step costs inside the replayed graph: the step with
/// everything, then without each part in turn (fast::set_skip_mask; garbage outputs), graph
/// replay, alternating, three rounds; the difference per layer is the part's share of the
/// critical path (overlap with its neighbours included), at batch 1 and 32.
fn skip_ab(m: &mut CudaModel, pages: &mut Pages) -> anyhow::Result<()> {
    use minimax_rank::cuda::fast::{set_skip_mask, skip};
    let layers = m.config().n_layers as f64;
    let parts = [
        ("everything", 0u32),
        ("attention norm", skip::ATTN_NORM),
        ("q/k/v", skip::QKV),
        ("q/k norm + RoPE + store", skip::QK),
        ("attention + merge", skip::ATTN),
        ("o-projection", skip::O),
        ("MoE norm + router", skip::ROUTE),
        ("expert gate/up", skip::GATE_UP),
        ("expert down", skip::DOWN),
        ("all but the experts", skip::ATTN_NORM | skip::QKV | skip::QK | skip::ATTN | skip::O | skip::ROUTE),
        ("all but attention's products", skip::ATTN_NORM | skip::QK | skip::ATTN | skip::ROUTE | skip::GATE_UP | skip::DOWN),
    ];
    for b in [1usize, 32] {
        let pts: Vec<Vec<u32>> = (0..b).map(|_| pages.take(8usize.div_ceil(PAGE))).collect();
        let toks = start_streams(m, &pts)?;
        let mut r = vec![0f64; parts.len()];
        for _round in 0..3 {
            for (i, &(_, mask)) in parts.iter().enumerate() {
                set_skip_mask(mask);
                m.clear_graphs();
                // One direct step at the streams' next position captures the graph.
                let seqs = (0..b).map(|j| step(100 + j as u64, &pts[j], 5, vec![toks[j]], LogitsWanted::Last)).collect();
                m.forward_stage_lazy(&ForwardBatch { seqs }).map_err(|e| anyhow::anyhow!("skip A/B batch {b}, capture with {} left out: {e}", parts[i].0))?;
                let t = replay_ms(m, b, 30).map_err(|e| anyhow::anyhow!("skip A/B batch {b}, {} left out: {e}", parts[i].0))?;
                r[i] += t / 3.0;
            }
        }
        set_skip_mask(0);
        m.clear_graphs();
        println!("skip A/B batch {b} (graph replay, mean of 3 alternating rounds; outputs garbage when a part is left out):");
        println!("  {:<32} {:>10} {:>14}", "left out", "step ms", "saved us/layer");
        for (i, (name, _)) in parts.iter().enumerate() {
            println!("  {:<32} {:>10.3} {:>14.2}", name, r[i], (r[0] - r[i]) * 1e3 / layers);
        }
    }
    Ok(())
}

/// `seqs` fresh sequences (ids and prompts from `first` on) of `len` pseudo-random tokens, one
/// step of prompts wanting their last logits.
fn fresh_prompts(pages: &mut Pages, seqs: usize, len: usize, first: usize) -> ForwardBatch {
    ForwardBatch {
        seqs: (0..seqs).map(|i| step(9000 + (first + i) as u64, &pages.take(len.div_ceil(PAGE)), 0, (0..len).map(|j| pseudo_token(j, first + i)).collect(), LogitsWanted::Last)).collect(),
    }
}

/// ms of one step's forward plus the greedy reduction of its wanted rows (as served).
fn timed_step(m: &mut CudaModel, batch: &ForwardBatch) -> anyhow::Result<f64> {
    let greedy = minimax_shared::sampling::SamplingSpec { temperature: 0.0, ..Default::default() };
    m.gpu().sync()?;
    let t = Instant::now();
    let out = m.forward_stage_lazy(batch)?.ok_or_else(|| anyhow::anyhow!("no logits"))?;
    let (reds, _) = out.reduce(&vec![(greedy, None); batch.seqs.len()])?;
    anyhow::ensure!(reds.iter().all(|r| r.is_ok()), "a greedy reduction failed");
    Ok(ms(t))
}

/// `--prompts N,P`: the first step of an N-stream round (N sequences with P-token prompts in one
/// step, on the prefill path, as the HTTP benchmark's rounds start), against one sequence of
/// N x P tokens: forward plus the greedy reduction of the wanted rows, three runs each on fresh
/// pages; then the per-kernel split of the N-sequence step.
fn prompts_step(m: &mut CudaModel, pages: &mut Pages, n: usize, p: usize) -> anyhow::Result<()> {
    let mut run = |m: &mut CudaModel, seqs: usize, len: usize, round: usize| -> anyhow::Result<f64> { timed_step(m, &fresh_prompts(pages, seqs, len, round * 64)) };
    // Distinct short prompts route their tokens over nearly every expert; one long synthetic
    // prompt concentrates them (its hidden states converge as attention averages), so the
    // single-sequence figures are optimistic. Expert tiles: automatic, then 16 / 32 / 64 tokens.
    let mut round = 0;
    for (seqs, len) in [(n, p), (1, n * p), (32, 16), (1, 512), (16, 256), (1, 4096)] {
        for gt in [0usize, 1, 2, 4] {
            minimax_rank::cuda::set_group_tile(Some(gt));
            let mut best = f64::MAX;
            for r in 0..3 {
                let t = run(m, seqs, len, round)?;
                round += 1;
                if r > 0 {
                    best = best.min(t);
                }
            }
            let tile = if gt == 0 { "automatic".to_string() } else { format!("{}", 16 * gt) };
            println!("prompts: {seqs} sequence(s) x {len} tokens in one step, expert tiles {tile}: {best:.1} ms (best of 2 after a warm-up, forward + greedy reduction)");
        }
    }
    minimax_rank::cuda::set_group_tile(None);
    let batch = fresh_prompts(pages, n, p, round * 64);
    m.gpu().profile_begin();
    m.forward(&batch)?;
    let prof = m.gpu().profile_end()?;
    print_split(&prof, &format!("{n} x {p}-token prompt step"));
    Ok(())
}

/// ms of one step of `seqs` fresh `len`-token prompts (forward + greedy reduction), or
/// (`chunk` > 0) of one `len`-token prompt in `chunk`-token steps; `round` makes the tokens fresh.
fn prefill_case(m: &mut CudaModel, pages: &mut Pages, seqs: usize, len: usize, chunk: usize, round: usize) -> anyhow::Result<f64> {
    if chunk > 0 {
        let pt = pages.take(len.div_ceil(PAGE));
        m.gpu().sync()?;
        let t = Instant::now();
        for c0 in (0..len).step_by(chunk) {
            let toks: Vec<u32> = (c0..(c0 + chunk).min(len)).map(|j| pseudo_token(j, 7000 + round)).collect();
            m.forward(&ForwardBatch { seqs: vec![step(7000 + round as u64, &pt, c0, toks, LogitsWanted::Last)] })?;
        }
        return Ok(ms(t));
    }
    timed_step(m, &fresh_prompts(pages, seqs, len, round * 64))
}

/// `--first-calls`: whether a prompt length the process has not seen yet costs more than the
/// next prompt of that length (session 17 saw 513 tokens take 65-67 ms on the first call against
/// 57.5 ms warm): three fresh prompts of each length in a row, lengths in a fixed order, after
/// two 512-token warm-ups; then, at a length not seen yet, the first and second call's
/// per-kernel time by family (events around each launch) and the families whose time differs
/// most, with each call's wall time against its kernels' sum (what is host-side).
fn first_calls(m: &mut CudaModel, pages: &mut Pages) -> anyhow::Result<()> {
    let mut round = 60_000usize;
    for _ in 0..2 {
        round += 1;
        prefill_case(m, pages, 1, 512, 0, round)?;
    }
    println!("
prefill of one fresh prompt, three calls in a row per length (ms):");
    println!("| prompt tokens | first call | second | third |\n| --- | --- | --- | --- |");
    for len in [513usize, 514, 520, 600, 777, 1000, 1500, 2047, 513] {
        let mut t = [0f64; 3];
        for v in t.iter_mut() {
            round += 1;
            *v = prefill_case(m, pages, 1, len, 0, round)?;
        }
        println!("| {len} | {:.1} | {:.1} | {:.1} |", t[0], t[1], t[2]);
    }
    let (free, total) = cudarc::driver::result::mem_get_info()?;
    println!("device memory free {:.2} of {:.2} GB", free as f64 / 1e9, total as f64 / 1e9);
    let mut fams: Vec<Vec<(String, f32, usize)>> = Vec::new();
    for call in ["first", "second"] {
        round += 1;
        m.gpu().sync()?;
        m.gpu().profile_begin();
        let t = Instant::now();
        prefill_case(m, pages, 1, 901, 0, round)?;
        let wall = ms(t);
        let prof = m.gpu().profile_end()?;
        let sum: f32 = prof.iter().map(|p| p.1).sum();
        println!("901 tokens, {call} call (profiled): wall {wall:.1} ms, kernels {sum:.1} ms in {} launches", prof.len());
        fams.push(kernel_families(&prof));
    }
    let mut delta: Vec<(String, f32, f32)> = fams[0].iter().map(|(n, t, _)| (n.clone(), *t, fams[1].iter().find(|f| &f.0 == n).map_or(0.0, |f| f.1))).collect();
    delta.sort_by(|a, b| (b.1 - b.2).abs().partial_cmp(&(a.1 - a.2).abs()).unwrap());
    println!("| kernel | first call ms | second ms |\n| --- | --- | --- |");
    for (n, a, b) in delta.iter().take(12) {
        println!("| {n} | {a:.3} | {b:.3} |");
    }
    Ok(())
}

/// `--pool-ab`: prefill steps with the default memory pool handing its free memory back at every
/// synchronization (CUDA's default) and keeping it (`MINIMAX_POOL_KEEP`, src/cuda/mem_pool.rs),
/// alternating, best of 3 after a warm-up; then the pool's reserved bytes.
fn pool_ab(m: &mut CudaModel, pages: &mut Pages) -> anyhow::Result<()> {
    println!("\nmemory pool: free memory handed back at each sync / kept, best of 3 after a warm-up, alternating (ms):");
    println!("| prefill | handed back | kept | change |\n| --- | --- | --- | --- |");
    let mut round = 50_000usize;
    for (seqs, len, chunk) in [(1usize, 512usize, 0usize), (32, 16, 0), (1, 4096, 0), (1, 8192, 4096)] {
        let mut best = [f64::MAX; 2];
        for r in 0..4 {
            for (i, keep) in [false, true].into_iter().enumerate() {
                m.gpu().set_pool_keep(keep)?;
                round += 1;
                let t = prefill_case(m, pages, seqs, len, chunk, round)?;
                if r > 0 {
                    best[i] = best[i].min(t);
                }
            }
        }
        let label = if chunk > 0 { format!("{seqs} x {len} in {chunk}-token chunks") } else { format!("{seqs} x {len}") };
        println!("| {label} | {:.1} | {:.1} | {:+.1}% |", best[0], best[1], 100.0 * (best[1] / best[0] - 1.0));
    }
    let (now, high) = m.gpu().pool_reserved()?;
    println!("pool reserved now {:.2} GB, high-water mark {:.2} GB", now as f64 / 1e9, high as f64 / 1e9);
    m.gpu().set_pool_keep(minimax_rank::cuda::mem_pool::POOL_KEEP.get())?;
    Ok(())
}

/// `--tma-ab`: prefill steps with the int8 expert products through per-thread copies
/// (`mmg_i8`) and through TMA copies (`mmg_t8`, kernels/quant_matmul.cu), alternating in one
/// process, best of three after a warm-up: distinct short prompts (routing over nearly every
/// expert), one 512-token prompt, a 4,096-token chunk, an 8,192-token prefill in two chunks;
/// then the per-kernel split of a 32 x 16-token step with each.
fn tma_ab(m: &mut CudaModel, pages: &mut Pages) -> anyhow::Result<()> {
    use minimax_rank::cuda::tma_experts::set_tma_experts;
    let mut round = 0usize;
    let mut rows = Vec::new();
    let mut run = |m: &mut CudaModel, pages: &mut Pages, seqs: usize, len: usize, chunk: usize| -> anyhow::Result<f64> {
        round += 1;
        prefill_case(m, pages, seqs, len, chunk, round)
    };
    println!("\nint8 expert products: mmg_i8 / mmg_t8 (automatic expert tiles) / mmg_t8w (wide warps) automatic / 32-pair / 64-pair tiles, best of 3 after a warm-up, alternating:");
    use minimax_rank::cuda::set_group_tile;
    use minimax_rank::cuda::tma_experts::set_tma_wide;
    let variants: [(bool, Option<usize>, bool); 5] = [(false, None, false), (true, None, false), (true, None, true), (true, Some(2), true), (true, Some(4), true)];
    for (seqs, len, chunk) in [(32usize, 16usize, 0usize), (32, 5, 0), (1, 512, 0), (1, 513, 0), (16, 256, 0), (1, 4096, 0), (1, 8192, 4096), (1, 8192, 8192)] {
        let mut best = [f64::MAX; 5];
        for r in 0..4 {
            for (i, &(on, tile, wide)) in variants.iter().enumerate() {
                set_tma_experts(Some(on));
                set_group_tile(tile);
                set_tma_wide(Some(wide));
                let t = run(m, pages, seqs, len, chunk)?;
                if r > 0 {
                    best[i] = best[i].min(t);
                }
            }
        }
        set_group_tile(None);
        set_tma_wide(None);
        let label = if chunk > 0 { format!("{seqs} x {len} in {chunk}-token chunks") } else { format!("{seqs} x {len}") };
        println!("  {label} tokens: {:.1} / {:.1} / {:.1} / {:.1} / {:.1} ms (t8 {:+.1}%, t8w {:+.1}%)", best[0], best[1], best[2], best[3], best[4], 100.0 * (best[1] / best[0] - 1.0), 100.0 * (best[2] / best[1] - 1.0));
        rows.push(format!("| {label} | {:.1} | {:.1} | {:.1} | {:.1} | {:.1} |", best[0], best[1], best[2], best[3], best[4]));
    }
    for len in [512usize, 513] {
        let batch = fresh_prompts(pages, 1, len, 900 + len);
        m.gpu().profile_begin();
        m.forward(&batch)?;
        let prof = m.gpu().profile_end()?;
        print_split(&prof, &format!("one {len}-token prompt, default kernels"));
    }
    {
        // The second 4096-token chunk of an 8k prompt (4096 cached positions).
        let pt = pages.take(8192 / PAGE);
        let chunk = |c0: usize| ForwardBatch { seqs: vec![step(7999, &pt, c0, (c0..c0 + 4096).map(|j| pseudo_token(j, 7999)).collect(), LogitsWanted::Last)] };
        m.forward(&chunk(0))?;
        m.gpu().profile_begin();
        m.forward(&chunk(4096))?;
        let prof = m.gpu().profile_end()?;
        print_split(&prof, "second 4096-token chunk of an 8k prompt, default kernels");
    }
    for (on, wide) in [(false, false), (true, false), (true, true)] {
        set_tma_experts(Some(on));
        set_tma_wide(Some(wide));
        let batch = ForwardBatch {
            seqs: (0..32).map(|i| step(8000 + i as u64, &pages.take(1), 0, (0..16).map(|j| pseudo_token(j, 5000 + i)).collect(), LogitsWanted::Last)).collect(),
        };
        m.gpu().profile_begin();
        m.forward(&batch)?;
        let prof = m.gpu().profile_end()?;
        print_split(&prof, &format!("32 x 16-token prompt step, TMA experts {on}, wide {wide}"));
    }
    set_tma_experts(None);
    set_tma_wide(None);
    println!("| prompts in one step | mmg_i8 ms | mmg_t8 ms | mmg_t8w ms | mmg_t8w, 32-pair tiles | mmg_t8w, 64-pair tiles |\n| --- | --- | --- | --- | --- | --- |");
    for r in rows {
        println!("{r}");
    }
    Ok(())
}

/// `--gstream-ab`: the grouped streamed expert kernels (kernels/gstream.cu) against the grouped
/// register kernels (`grpf`) at batch 4 / 16 / 32 (served-like prompts), graph replay,
/// alternating, three rounds; then the per-kernel split of a batch-32 step with them.
fn gstream_ab(m: &mut CudaModel, pages: &mut Pages) -> anyhow::Result<()> {
    use minimax_rank::cuda::gstream::set_gstream;
    let (pts, mut toks, s) = switch_ab(m, pages, "grouped MoE", ["grpf (register)", "grouped streamed"], set_gstream)?;
    set_gstream(Some(true));
    m.clear_graphs();
    anyhow::ensure!(stream_step(m, &pts, &mut toks, s)?, "bad logits at batch 32");
    print_split(&profile_step(m, 32)?, "batch-32 decode step, grouped streamed expert kernels");
    set_gstream(None);
    m.clear_graphs();
    Ok(())
}

/// `--mvmma-ab`: the tensor-core Q8_0 products of 4-32-token steps, `mvmma_q8_0` (4 warps, 4-chunk
/// rings) for every product against the automatic choice (`mvmma3_q8_0` for q/k/v, `mvmma8_q8_0`
/// for the o-projection), batch 4 / 16 / 32.
fn mvmma_ab(m: &mut CudaModel, pages: &mut Pages) -> anyhow::Result<()> {
    use minimax_rank::cuda::fast::{Mvmma, set_mvmma};
    fn set(auto: Option<bool>) {
        set_mvmma(auto.map(|a| if a { None } else { Some(Mvmma::W4R4) }));
    }
    minimax_rank::cuda::fast::set_mvx(Some(false));
    switch_ab(m, pages, "dense Q8_0 products on tensor cores (mvx off)", ["mvmma everywhere", "automatic choice"], set)?;
    set_mvmma(None);
    minimax_rank::cuda::fast::set_mvx(None);
    m.clear_graphs();
    // mvx_q8_0 (activations staged in shared memory) against the automatic mvmma choice.
    switch_ab(m, pages, "dense Q8_0 products: mvx_q8_0", ["mvmma (automatic)", "mvx_q8_0"], |on| minimax_rank::cuda::fast::set_mvx(on))?;
    minimax_rank::cuda::fast::set_mvx(None);
    m.clear_graphs();
    // Its warp groups: one (every warp a whole K part) against two (column halves) everywhere.
    switch_ab(m, pages, "mvx_q8_0 warp groups", ["one group", "two groups"], |on| minimax_rank::cuda::fast::set_mvx_kw(on.map(|b| if b { 2 } else { 1 })))?;
    minimax_rank::cuda::fast::set_mvx_kw(None);
    m.clear_graphs();
    Ok(())
}

/// A/B of a kernel switch (`set(Some(false))` then `set(Some(true))`) at batch 4 / 8 / 16 / 32
/// (served-like prompts), graph replay, alternating, three rounds; prints ms per step and tok/s
/// and returns the 32 streams (pages, next tokens, next step index).
fn switch_ab(m: &mut CudaModel, pages: &mut Pages, what: &str, names: [&str; 2], set: fn(Option<bool>)) -> anyhow::Result<(Vec<Vec<u32>>, Vec<u32>, usize)> {
    let bs = [4usize, 8, 16, 32];
    let pts: Vec<Vec<u32>> = (0..32).map(|_| pages.take(8)).collect();
    let mut toks = start_streams(m, &pts)?;
    let mut s = 0;
    let mut r = [[0f64; 4]; 2];
    for _round in 0..3 {
        for (i, on) in [false, true].into_iter().enumerate() {
            set(Some(on));
            m.clear_graphs();
            for (j, &b) in bs.iter().enumerate() {
                anyhow::ensure!(stream_step(m, &pts[..b], &mut toks[..b], s)?, "non-finite or out-of-vocabulary picks at batch {b}");
                s += 1;
                r[i][j] += replay_ms(m, b, 20)? / 3.0;
            }
        }
    }
    println!("\n{what} A/B (graph replay, ms per step; tok/s in brackets):");
    for (i, name) in names.into_iter().enumerate() {
        let mut line = format!("{name:<24}");
        for (j, &b) in bs.iter().enumerate() {
            line += &format!(" b{b}: {:>8.3} ({:>5.0})", r[i][j], b as f64 * 1e3 / r[i][j]);
        }
        println!("{line}");
    }
    Ok((pts, toks, s))
}

/// Dense products of M2.7's shapes (q: 6144 x 3072 and o: 3072 x 6144 Q8_0, the F32 router
/// 256 x 3072) at several token counts: the built-in GEMM (default precision) against cuBLAS,
/// median of 5 runs each, so the cuBLAS token threshold (`MINIMAX_BLAS_MIN_TOKENS`) can be set
/// from measurements.
fn dense_sweep(m: &CudaModel) -> anyhow::Result<()> {
    use minimax_rank::cuda::DevMat;
    use minimax_shared::quant::GgmlType;
    use minimax_shared::model::synthetic::{SplitMix64, fill_random_blocks};
    let g = m.gpu();
    let mut rng = SplitMix64(0x9e37_79b9_7f4a_7c15);
    // Random valid weights of `ty`, as the synthetic models are filled.
    let mut mat = |ty: GgmlType, rows: usize, cols: usize| -> anyhow::Result<(cudarc::driver::CudaSlice<u8>, DevMat)> {
        let rb = minimax_shared::quant::row_bytes(ty, cols)?;
        let mut b = vec![0u8; rows * rb];
        fill_random_blocks(ty, &mut rng, &mut b);
        let buf = g.upload(&b)?;
        let m = DevMat { ptr: g.ptr(&buf), ty, rows, cols, row_bytes: rb, n_experts: 0, expert_stride: 0 };
        Ok((buf, m))
    };
    let (_b1, wq) = mat(GgmlType::Q8_0, 6144, 3072)?;
    let (_b2, wo) = mat(GgmlType::Q8_0, 3072, 6144)?;
    let (_b3, wr) = mat(GgmlType::F32, 256, 3072)?;
    let nmax = 4096usize;
    let xs: Vec<f32> = (0..nmax * 6144).map(|i| (i * 104_729 % 2001) as f32 / 1000.0 - 1.0).collect();
    let x = g.upload(&xs)?;
    let y = g.zeros::<f32>(nmax * 6144)?;
    println!("dense products, median of 5 (us): shape, tokens, built-in GEMM ({:?}), cuBLAS", gemm_precision());
    for (name, w) in [("q 6144x3072 Q8_0", &wq), ("o 3072x6144 Q8_0", &wo), ("router 256x3072 F32", &wr)] {
        for n in [48usize, 64, 96, 128, 256, 512, 2048, 4096] {
            let mut t = [0f64; 2];
            for (i, on) in [false, true].into_iter().enumerate() {
                minimax_rank::cuda::blas::set_blas(Some(on));
                minimax_rank::cuda::blas::set_blas_min_tokens(Some(0));
                let mut v = Vec::new();
                for _ in 0..6 {
                    g.sync()?;
                    let t0 = Instant::now();
                    g.matmul(w, g.ptr(&x), w.cols, g.ptr(&y), w.rows, n, false)?;
                    g.sync()?;
                    v.push(t0.elapsed().as_secs_f64() * 1e6);
                }
                v.remove(0);
                v.sort_by(f64::total_cmp);
                t[i] = v[2];
            }
            let tops = 2.0 * (w.rows * w.cols * n) as f64 / 1e12;
            println!("  {name:<22} {n:>5} {:>9.1} {:>9.1}   ({:.0} / {:.0} TOPS)", t[0], t[1], tops / (t[0] * 1e-6), tops / (t[1] * 1e-6));
        }
    }
    minimax_rank::cuda::blas::set_blas(None);
    minimax_rank::cuda::blas::set_blas_min_tokens(None);
    Ok(())
}

fn main() -> anyhow::Result<()> {
    tracing_subscriber::fmt().with_max_level(tracing::Level::INFO).init();
    if world::requested() {
        // Several GPUs (--tp N / --pp N): rank-worker/src/bin/bench/world.rs.
        return world::main_world();
    }
    let spec_s = arg("--synthetic").unwrap_or_else(|| "m2.7:iq4xs".into());
    let check_layers: usize = arg("--check-layers").and_then(|s| s.parse().ok()).unwrap_or(2);
    let dsteps: usize = arg("--decode-steps").and_then(|s| s.parse().ok()).unwrap_or(100);
    let base = spec_s.split(':').take(2).collect::<Vec<_>>().join(":");
    if check_layers > 0 {
        check_fast_vs_exact(&base, check_layers)?;
    }
    let spec = SyntheticSpec::parse(&spec_s)?;
    let long_ctx = 32768usize;
    // + 520: the prefill section's warm-ups, precision/tile runs and profiled run.
    let n_pages = long_ctx / PAGE + 64 + 32 * 8 + 8 + 2 * 8192 / PAGE + 16 + 520;
    let kv = KvSpec { page_size: PAGE, n_pages };
    let t = Instant::now();
    let mut m = CudaModel::synthetic(&spec, kv, CudaOptions::default(), 42)?;
    let c = m.config().clone();
    let fill_s = t.elapsed().as_secs_f64();
    println!("model {spec_s}: {:.2} GiB of weights, {} layers, created+filled in {fill_s:.2} s; fast path: {}", m.weight_bytes() as f64 / (1u64 << 30) as f64, c.n_layers, m.fast_path_off().unwrap_or("on"));
    let bw = copy_bandwidth(&m)?;
    println!("device copy bandwidth {:.0} GB/s (read + write)", bw / 1e9);
    let mut pages = Pages(0, n_pages as u32);
    if let Some(nt) = arg("--nsys-replay").and_then(|s| s.parse::<usize>().ok()) {
        return nsys_replay(&mut m, &mut pages, nt);
    }
    if flag("--moe-ab") {
        return moe_ab(&mut m, &mut pages);
    }
    if flag("--pdl-ab") {
        return pdl_ab(&mut m, &mut pages);
    }
    if flag("--stream-ab") {
        return stream_ab(&mut m, &mut pages);
    }
    if flag("--skip-ab") {
        return skip_ab(&mut m, &mut pages);
    }
    if flag("--norm-ab") {
        return norm_ab(&mut m, &mut pages);
    }
    if flag("--gstream-ab") {
        return gstream_ab(&mut m, &mut pages);
    }
    if flag("--mvmma-ab") {
        return mvmma_ab(&mut m, &mut pages);
    }
    if flag("--tma-ab") {
        return tma_ab(&mut m, &mut pages);
    }
    if flag("--short-ab") {
        use minimax_rank::cuda::fast::set_attn_short;
        b1_ab(&mut m, &mut pages, "decode attention at short context", &["split + merge", "unsplit (attn_short)"], &|i| set_attn_short(Some(i == 1)))?;
        set_attn_short(None);
        return Ok(());
    }
    if flag("--normless-ab") {
        use minimax_rank::cuda::fast::set_router_normless;
        use minimax_rank::cuda::fast::set_router_prefetch;
        for b in [1usize, 1, 4, 8] {
            bn_ab(&mut m, &mut pages, b, "MoE norm", &["norm_q8 + router_topk_f32x", "in the router (router_topk_f32n)", "f32n, rows to L2 before the wait"], &|i| {
                set_router_normless(Some(i >= 1));
                set_router_prefetch(Some(i == 2));
            })?;
        }
        set_router_normless(None);
        set_router_prefetch(None);
        return Ok(());
    }
    if flag("--inline-ab") {
        use minimax_rank::cuda::fast::{set_route_inline, set_router_f32n_warps};
        let names = ["router's last block (router_topk_f32n16), 16 warps", "in the gate/up (router_f32n + moe_gate_up_blkr), 8 warps", "in the gate/up, 4 warps"];
        for _ in 0..3 {
            b1_ab(&mut m, &mut pages, "MoE routing", &names, &|i| {
                set_route_inline(Some(i >= 1));
                set_router_f32n_warps(Some([16, 8, 4][i]));
            })?;
        }
        set_route_inline(None);
        set_router_f32n_warps(None);
        return Ok(());
    }
    if flag("--qkfuse-ab") {
        use minimax_rank::cuda::fast::{set_attn_fusion, set_qk_fuse, set_qk_merge_early};
        let names = ["q/k norm launch (qk_norm_rope_store)", "q/k norms in the attention (rope_table + attn_dec6tn), attn_merge6", "in the attention, attn_merge6e (early trigger)", "in the attention, merge in the last block (attn_dec6tnm)"];
        for _ in 0..3 {
            b1_ab(&mut m, &mut pages, "q/k norms", &names, &|i| {
                set_qk_fuse(Some(i >= 1));
                set_qk_merge_early(Some(i == 2));
                set_attn_fusion(Some(i == 3));
            })?;
        }
        set_qk_fuse(None);
        set_qk_merge_early(None);
        set_attn_fusion(None);
        return Ok(());
    }
    if flag("--x8-ab") {
        // The next layer's attention norm: the down's last block against the x8 hand-over
        // (no meeting of the down's blocks; the q/k/v takes the 1 / rms).
        use minimax_rank::cuda::fast::set_norm_x8;
        let names = ["norm in the down's last block", "x8 hand-over (mvqs_q8_0_1s2p8)"];
        for _ in 0..3 {
            b1_ab(&mut m, &mut pages, "attention norm hand-over", &names, &|i| set_norm_x8(Some(i == 1)))?;
        }
        set_norm_x8(None);
        return Ok(());
    }
    if flag("--attn-exit-ab") {
        // Blocks of empty splits of the one-token attention: through their wait (and writing
        // empty partials) against leaving at once; batch 1 at short context, then at 32k.
        use minimax_rank::cuda::fast::set_attn_exit_empty;
        let names = ["every split block runs", "empty splits leave at once"];
        let set = |i: usize| set_attn_exit_empty(Some(i == 1));
        for _ in 0..3 {
            b1_ab(&mut m, &mut pages, "decode attention's empty splits", &names, &set)?;
        }
        if !flag("--no-32k") {
            m.fill_kv_random(5)?;
            let pt = pages.take((long_ctx + 8).div_ceil(PAGE));
            let mut at = long_ctx;
            for _round in 0..2 {
                for (i, name) in names.iter().enumerate() {
                    set(i);
                    m.clear_graphs();
                    let o = m.forward(&ForwardBatch { seqs: vec![step(9, &pt, at, vec![7], LogitsWanted::Last)] })?;
                    anyhow::ensure!(finite(&o), "non-finite logits at 32k ({name})");
                    at += 1;
                    println!("decode at 32k context, graph replay, {name}: {:.3} ms/token", replay_ms(&mut m, 1, 10)?);
                }
            }
        }
        set_attn_exit_empty(None);
        m.clear_graphs();
        return Ok(());
    }
    if flag("--router-warps-ab") {
        use minimax_rank::cuda::fast::set_router_f32n_warps;
        for b in [1usize, 1, 4, 8] {
            bn_ab(&mut m, &mut pages, b, "router_topk_f32n blocks", &["4 warps", "8 warps", "16 warps"], &|i| set_router_f32n_warps(Some([4, 8, 16][i])))?;
        }
        set_router_f32n_warps(None);
        return Ok(());
    }
    if flag("--pace-ab") {
        use minimax_rank::cuda::stream::{set_stream_gu_late, set_stream_pace, set_stream_rows_cap, set_stream_stage_cap};
        // (gate rows cap, stage cap, pacing (gate/up, down), gate/up's late trigger); None = the default.
        let cfgs: [(Option<(usize, usize)>, Option<usize>, Option<(usize, usize)>, bool); 7] = [
            (Some((32, 8)), None, Some((0, 0)), false),
            (None, None, None, false),
            (None, Some(2), Some((1, 1)), false),
            (None, Some(2), Some((1, 1)), true),
            (None, Some(3), Some((1, 1)), false),
            (None, None, Some((2, 2)), false),
            (None, None, Some((1, 0)), false),
        ];
        let names = ["32-row x2, unpaced (session 35)", "default (16-row x4, pace 1/1)", "16-row x2, pace 1/1", "16-row x2, pace 1/1, late trigger", "16-row x3, pace 1/1", "16-row x4, pace 2/2", "16-row x4, pace 1/0"];
        for _ in 0..2 {
            b1_ab(&mut m, &mut pages, "streamed rings' pacing", &names, &|i| {
                let (rows, cap, pace, late) = cfgs[i];
                set_stream_rows_cap(rows);
                set_stream_stage_cap(cap);
                set_stream_pace(pace);
                set_stream_gu_late(Some(late));
            })?;
        }
        set_stream_rows_cap(None);
        set_stream_stage_cap(None);
        set_stream_pace(None);
        set_stream_gu_late(None);
        // The grouped kernels (2-32 tokens a step).
        use minimax_rank::cuda::stream::set_gstream_pace;
        for b in [4usize, 8, 32] {
            bn_ab(&mut m, &mut pages, b, "grouped rings' pacing", &["unpaced", "pace 1/1", "pace 2/2 (default)", "pace 3/3"], &|i| set_gstream_pace(Some([(0, 0), (1, 1), (2, 2), (3, 3)][i])))?;
        }
        set_gstream_pace(None);
        m.clear_graphs();
        return Ok(());
    }
    if flag("--trig-ab") {
        // The down's trigger point under paced rings: at its start (the default: the next q/k/v's
        // blocks copy their rows beside the down's stream) or after its loops.
        use minimax_rank::cuda::fast::set_norm_fusion;
        use minimax_rank::cuda::stream::set_stream_pace;
        let cfgs = [(false, None), (true, None), (false, Some((1, 2))), (true, Some((1, 2)))];
        for _ in 0..2 {
            b1_ab(&mut m, &mut pages, "down trigger under paced rings", &["default", "down late trigger", "down pace 2", "down late trigger, pace 2"], &|i| {
                set_norm_fusion(None, None, Some(cfgs[i].0));
                set_stream_pace(cfgs[i].1);
            })?;
        }
        set_norm_fusion(None, None, None);
        set_stream_pace(None);
        m.clear_graphs();
        return Ok(());
    }
    if flag("--first-calls") {
        return first_calls(&mut m, &mut pages);
    }
    if flag("--pool-ab") {
        return pool_ab(&mut m, &mut pages);
    }
    if flag("--router-ab") {
        use minimax_rank::cuda::fast::{set_router_t4_min, set_router_x};
        b1_ab(&mut m, &mut pages, "router", &["router_topk_f32", "router_topk_f32x"], &|i| set_router_x(Some(i == 1)))?;
        set_router_x(None);
        switch_ab(&mut m, &mut pages, "router of several tokens", ["router_topk_f32", "router_topk_f32t4"], |on| set_router_t4_min(on.map(|b| if b { 2 } else { 99 })))?;
        set_router_t4_min(None);
        return Ok(());
    }
    if let Some(v) = arg("--prompts") {
        let (n, p) = v.split_once(',').and_then(|(a, b)| Some((a.parse().ok()?, b.parse().ok()?))).ok_or_else(|| anyhow::anyhow!("--prompts N,P"))?;
        return prompts_step(&mut m, &mut pages, n, p);
    }
    let mut table: Vec<(String, String)> = Vec::new();

    // --prefill-only: skip every decode measurement (the prefill section below stands alone).
    if !flag("--prefill-only") {
    // Decode, batch 1: 5-token prompt then `dsteps` greedy steps through forward().
    let pt = pages.take((5 + dsteps + 1).div_ceil(PAGE));
    let prompt = vec![1u32, 17, 4242, 99_999, 200_000];
    let t = Instant::now();
    let o = m.forward(&ForwardBatch { seqs: vec![step(1, &pt, 0, prompt, LogitsWanted::Last)] })?;
    let p5 = ms(t);
    anyhow::ensure!(finite(&o), "non-finite prompt logits");
    let mut tok = argmax(o.row(0));
    // Two warm-up steps (the first one also captures the graph).
    for i in 0..2 {
        tok = argmax(m.forward(&ForwardBatch { seqs: vec![step(1, &pt, 5 + i, vec![tok], LogitsWanted::Last)] })?.row(0));
    }
    let t = Instant::now();
    let mut all_finite = true;
    for i in 2..dsteps {
        let r = m.forward(&ForwardBatch { seqs: vec![step(1, &pt, 5 + i, vec![tok], LogitsWanted::Last)] })?;
        all_finite &= finite(&r);
        tok = argmax(r.row(0));
    }
    let dec_ms = ms(t) / (dsteps - 2) as f64;
    println!("decode b1: prompt(5) {p5:.1} ms, {:.2} ms/token incl. logits download = {:.1} tok/s, finite {all_finite}", dec_ms, 1e3 / dec_ms);
    table.push(("decode tok/s, batch 1, 5-token prompt + 100 steps (forward incl. logits D2H)".into(), format!("{:.1}", 1e3 / dec_ms)));
    // Kernel time per step: replay the step graph.
    let step_ms = replay_ms(&mut m, 1, 50)?;
    println!("decode b1 graph replay: {step_ms:.3} ms/step = {:.1} tok/s", 1e3 / step_ms);
    table.push(("decode tok/s, batch 1, graph replay only (kernel time)".into(), format!("{:.1}", 1e3 / step_ms)));

    // Per-kernel split of one decode step (no graph, events around every launch).
    print_split(&profile_step(&mut m, 1)?, "batch-1 decode step");

    if flag("--ab") {
        ab_runs(&mut m, &mut pages)?;
    }

    // Bandwidth bound at short context.
    let wb = m.decode_weight_bytes() as f64;
    let kv_tok = |ctx: usize| (ctx * c.n_layers * c.n_kv_heads * (c.head_dim + c.v_head_dim) * 2) as f64;
    let bound = |ctx: usize| bw / (wb + kv_tok(ctx));
    println!("bytes per decoded token: weights {:.3} GB + KV(105) {:.4} GB; bound {:.0} tok/s; ours {:.1}% (graph replay)", wb / 1e9, kv_tok(105) / 1e9, bound(105), 100.0 * (1e3 / step_ms) / bound(105));
    table.push(("bandwidth bound tok/s (ctx ~100) / our fraction".into(), format!("{:.0} / {:.0}%", bound(105), 100.0 * (1e3 / step_ms) / bound(105))));

    // Aggregate decode at batch 1, 4, 16, 32 (greedy picks on the device, as served): each
    // sequence gets a 5-token prompt, then 20 steps
    // (tokens: `stream_token`).
    let batches: Vec<usize> = arg("--batches").map(|v| v.split(',').filter_map(|x| x.parse().ok()).filter(|&b| (1..=32).contains(&b)).collect()).unwrap_or_else(|| vec![1, 4, 16, 32]);
    for b in batches {
        let steps: usize = 20;
        let pts: Vec<Vec<u32>> = (0..b).map(|_| pages.take((5 + steps + 2 * minimax_rank::cuda::fast::GrpKind::ALL.len() + 3).div_ceil(PAGE))).collect();
        let mut toks = start_streams(&mut m, &pts)?;
        let mut fin = true;
        fin &= stream_step(&mut m, &pts, &mut toks, 0)?;
        fin &= stream_step(&mut m, &pts, &mut toks, 1)?;
        let t = Instant::now();
        for s in 2..steps {
            fin &= stream_step(&mut m, &pts, &mut toks, s)?;
        }
        let per = ms(t) / (steps - 2) as f64;
        let t = Instant::now();
        for _ in 0..10 {
            m.replay_fast_step(b)?;
        }
        m.gpu().sync()?;
        let rep = ms(t) / 10.0;
        println!("decode batch {b}: {per:.2} ms/step = {:.0} tok/s aggregate ({:.0} tok/s graph replay), finite {fin}", b as f64 * 1e3 / per, b as f64 * 1e3 / rep);
        if b == 32 {
            print_split(&profile_step(&mut m, b)?, "batch-32 decode step");
        }
        table.push((format!("aggregate decode tok/s, batch {b} (forward / graph replay)"), format!("{:.0} / {:.0}", b as f64 * 1e3 / per, b as f64 * 1e3 / rep)));
        if b >= 4 {
            // Every grouped-kernel kind (graph replay, twice each, alternating); then back to
            // the environment's choice.
            use minimax_rank::cuda::fast::{GrpKind, set_grp_kind};
            let variants = GrpKind::ALL;
            let mut r = [0f64; GrpKind::ALL.len()];
            for round in 0..2 {
                for (v, &kd) in variants.iter().enumerate() {
                    set_grp_kind(Some(kd));
                    m.clear_graphs();
                    fin &= stream_step(&mut m, &pts, &mut toks, steps + variants.len() * round + v)?;
                    r[v] += replay_ms(&mut m, b, 10)? / 2.0;
                }
            }
            set_grp_kind(None);
            m.clear_graphs();
            let tps = |ms: f64| format!("{:.0}", b as f64 * 1e3 / ms);
            let names = variants.map(|k| format!("{k:?}")).join(" / ");
            let cells = r.map(tps).join(" / ");
            println!("decode batch {b}, grouped MoE {names}: {cells} tok/s graph replay, finite {fin}");
            table.push((format!("batch {b} graph replay, grouped MoE {names} (tok/s)"), cells));
        }
    }

    // Decode at 32k context: K/V of 32768 cached positions filled randomly (no prefill).
    if !flag("--no-32k") {
        m.fill_kv_random(5)?;
        let steps = 12;
        let pt = pages.take((long_ctx + steps + 2).div_ceil(PAGE));
        let mut tok = 7u32;
        for i in 0..2 {
            tok = argmax(m.forward(&ForwardBatch { seqs: vec![step(9, &pt, long_ctx + i, vec![tok], LogitsWanted::Last)] })?.row(0));
        }
        let t = Instant::now();
        let mut fin = true;
        for i in 2..steps {
            let o = m.forward(&ForwardBatch { seqs: vec![step(9, &pt, long_ctx + i, vec![tok], LogitsWanted::Last)] })?;
            fin &= finite(&o);
            tok = argmax(o.row(0));
        }
        let per = ms(t) / (steps - 2) as f64;
        println!("decode at 32k context, batch 1: {per:.2} ms/token = {:.1} tok/s (bound {:.0}), finite {fin}", 1e3 / per, bound(long_ctx));
        // The same step with the attention merge folded in / separate, on the SIMT and the
        // tensor-core attention kernel (MINIMAX_ATTN_MMA).
        for (mma, fuse) in [(false, false), (false, true), (true, true), (true, false)] {
            minimax_rank::cuda::fast::set_attn_mma(Some(mma));
            minimax_rank::cuda::fast::set_attn_fusion(Some(fuse));
            m.clear_graphs();
            m.forward(&ForwardBatch { seqs: vec![step(9, &pt, long_ctx + steps, vec![tok], LogitsWanted::Last)] })?;
            println!("decode at 32k context, graph replay, tensor-core attention {mma}, merge folded {fuse}: {:.3} ms/token", replay_ms(&mut m, 1, 10)?);
        }
        minimax_rank::cuda::fast::set_attn_mma(None);
        minimax_rank::cuda::fast::set_attn_fusion(None);
        m.clear_graphs();
        table.push(("decode tok/s at 32k context, batch 1 / bound".into(), format!("{:.1} / {:.0}", 1e3 / per, bound(long_ctx))));
    }

    }

    // Prefill (exact path: steps over 32 tokens): 512, 513, then 8192 if it looks affordable.
    // Tensor-core GEMMs in the default precision (MINIMAX_GEMM, int8 unless set); a 40-token
    // warm-up first loads the prefill kernels, and 512 is also timed with plain bf16.
    let mut t512 = 0.0;
    let prefill_sizes: &[usize] = if flag("--no-prefill") { &[] } else { &[512, 513] };
    if !prefill_sizes.is_empty() {
        let prec = gemm_precision();
        let other = if prec == GemmPrecision::Bf16x3 { GemmPrecision::Bf16 } else { GemmPrecision::Bf16x3 };
        // The default, bf16x3 (bf16 when bf16x3 is the default) and int8 are timed.
        let mut precs = vec![prec, other];
        if !precs.contains(&GemmPrecision::Int8) {
            precs.push(GemmPrecision::Int8);
        }
        for &p in precs.iter().rev() {
            set_gemm_precision(p);
            let pt = pages.take(40usize.div_ceil(PAGE));
            m.forward(&ForwardBatch { seqs: vec![step(40, &pt, 0, (0..40).collect(), LogitsWanted::Last)] })?;
        }
        m.gpu().sync()?;
        // Each precision x the grouped-expert tiles (16 / 32 / 64 pairs), one 512-token prefill each,
        // all over the same pages (each run writes every position it reads).
        let pt512 = pages.take(512 / PAGE);
        for &p in &precs {
            for gt in [1usize, 2, 4] {
                set_gemm_precision(p);
                set_group_tile(Some(gt));
                let pt = &pt512;
                let t = Instant::now();
                let o = m.forward(&ForwardBatch { seqs: vec![step(41 + gt as u64, &pt, 0, (0..512u32).map(|i| (i * 7919) % 200_000).collect(), LogitsWanted::Last)] })?;
                let e = ms(t);
                println!("prefill 512, GEMM {p:?}, expert tiles of {}: {e:.1} ms = {:.0} tok/s, finite {}", 16 * gt, 512e3 / e, finite(&o));
                table.push((format!("prefill ms at 512 tokens, GEMM {p:?}, expert tile {} (tok/s)", 16 * gt), format!("{e:.1} ({:.0})", 512e3 / e)));
            }
        }
        set_group_tile(None);
        // The int8 kernels' warp layouts (m16 tiles a warp: MINIMAX_I8_MI), automatic tiles.
        set_gemm_precision(GemmPrecision::Int8);
        for (mi, lin) in [(1usize, false), (1, true), (2, false), (4, false)] {
            minimax_rank::cuda::matmul::set_int8_mi(Some(mi));
            minimax_rank::cuda::matmul::set_int8_linear_copies(Some(lin));
            let t = Instant::now();
            let o = m.forward(&ForwardBatch { seqs: vec![step(70 + mi as u64, &pt512, 0, (0..512u32).map(|i| (i * 7919) % 200_000).collect(), LogitsWanted::Last)] })?;
            let e = ms(t);
            println!("prefill 512, GEMM Int8, warp m16 tiles {mi}, linear weight copies {lin}: {e:.1} ms = {:.0} tok/s, finite {}", 512e3 / e, finite(&o));
            table.push((format!("prefill ms at 512 tokens, GEMM Int8, warp m16 tiles {mi}, linear copies {lin}"), format!("{e:.1}")));
        }
        minimax_rank::cuda::matmul::set_int8_mi(None);
        minimax_rank::cuda::matmul::set_int8_linear_copies(None);
        set_gemm_precision(prec);
        // The integer fast path (mm_f_* / mmg_f_*) against the previous kernels (MINIMAX_GEMM_FAST=0).
        // Compact: the 32-token tiles' 2-stage variant that fits two blocks an SM (the default;
        // MINIMAX_GEMM_COMPACT=0 turns it off).
        for (fast, compact) in [(false, false), (true, true), (true, false)] {
            minimax_rank::cuda::set_gemm_fast(fast);
            minimax_rank::cuda::set_gemm_compact(compact);
            let pt = pages.take(512 / PAGE);
            let t = Instant::now();
            let o = m.forward(&ForwardBatch { seqs: vec![step(60 + fast as u64, &pt, 0, (0..512u32).map(|i| (i * 7919) % 200_000).collect(), LogitsWanted::Last)] })?;
            let e = ms(t);
            println!("prefill 512, GEMM {prec:?}, fast path {fast}, compact 32-token tiles {compact}: {e:.1} ms = {:.0} tok/s, finite {}", 512e3 / e, finite(&o));
            table.push((format!("prefill ms at 512 tokens, GEMM {prec:?}, fast path {fast}, compact {compact}"), format!("{e:.1}")));
        }
        minimax_rank::cuda::set_gemm_compact(std::env::var("MINIMAX_GEMM_COMPACT").as_deref() != Ok("0"));
        // Dense GEMM tiles forced to 32 and 128 tokens (default precision, automatic expert tile).
        for dt in [2usize, 8] {
            set_dense_tile(Some(dt));
            let pt = pages.take(512 / PAGE);
            let t = Instant::now();
            let o = m.forward(&ForwardBatch { seqs: vec![step(50 + dt as u64, &pt, 0, (0..512u32).map(|i| (i * 7919) % 200_000).collect(), LogitsWanted::Last)] })?;
            let e = ms(t);
            println!("prefill 512, GEMM {prec:?}, dense tiles of {} tokens: {e:.1} ms, finite {}", 16 * dt, finite(&o));
            table.push((format!("prefill ms at 512 tokens, GEMM {prec:?}, dense tile {}", 16 * dt), format!("{e:.1}")));
        }
        set_dense_tile(None);
        // Dense products through cuBLAS (the default) against the built-in GEMMs, same pages.
        for on in [false, true] {
            minimax_rank::cuda::blas::set_blas(Some(on));
            let t = Instant::now();
            let o = m.forward(&ForwardBatch { seqs: vec![step(80 + on as u64, &pt512, 0, (0..512u32).map(|i| (i * 7919) % 200_000).collect(), LogitsWanted::Last)] })?;
            let e = ms(t);
            println!("prefill 512, GEMM {prec:?}, dense products through cuBLAS {on}: {e:.1} ms = {:.0} tok/s, finite {}", 512e3 / e, finite(&o));
            table.push((format!("prefill ms at 512 tokens, GEMM {prec:?}, cuBLAS dense {on}"), format!("{e:.1}")));
        }
        minimax_rank::cuda::blas::set_blas(None);
        dense_sweep(&m)?;
        // Per-phase split of one 512-token prefill (events around every launch).
        let pt = pages.take(512 / PAGE);
        m.gpu().profile_begin();
        m.forward(&ForwardBatch { seqs: vec![step(46, &pt, 0, (0..512u32).map(|i| (i * 104_729) % 200_000).collect(), LogitsWanted::Last)] })?;
        let prof = m.gpu().profile_end()?;
        let mut phase = [("dense GEMM (q/k/v/o, router, lm_head)", 0f32, 0usize), ("grouped MoE (grouping, gate/up/down, SiLU, combine, route)", 0.0, 0), ("attention (incl. KV store)", 0.0, 0), ("other (norms, RoPE, embedding, gather)", 0.0, 0)];
        for (name, t) in &prof {
            let i = if name.starts_with("mm_") || name.starts_with("mv_") || name.starts_with("blas_") || name.starts_with("dqb_") || name == "x_bf16" {
                0
            } else if name.starts_with("mmg_") || name.starts_with("mve_") || name.starts_with("moe_") || name == "silu_mul" {
                1
            } else if name.starts_with("attn") || name.starts_with("kv_store") || name.starts_with("flash") {
                2
            } else {
                3
            };
            phase[i].1 += t;
            phase[i].2 += 1;
        }
        let tot: f32 = phase.iter().map(|p| p.1).sum();
        println!("per-phase split of a 512-token prefill, GEMM {prec:?} (events around each launch): total {tot:.1} ms, {} launches", prof.len());
        for (n, t, k) in &phase {
            println!("  {n:<62} {t:>8.2} ms {:>5.1}% {k:>6} launches", 100.0 * t / tot.max(1e-9));
            table.push((format!("prefill 512 split: {n} ms"), format!("{t:.2}")));
        }
        // The kernels that took longest in that prefill (name, ms, launches).
        let mut per: Vec<(&str, f32, usize)> = Vec::new();
        for (name, t) in &prof {
            if let Some(p) = per.iter_mut().find(|p| p.0 == name.as_str()) {
                p.1 += t;
                p.2 += 1;
            } else {
                per.push((name.as_str(), *t, 1));
            }
        }
        per.sort_by(|a, b| b.1.total_cmp(&a.1));
        for (n, t, k) in per.iter().take(14) {
            println!("    {n:<40} {t:>8.2} ms {k:>5} launches");
        }
    }
    for &n in prefill_sizes {
        let pt = pages.take(n.div_ceil(PAGE));
        let toks: Vec<u32> = (0..n as u32).map(|i| (i * 7919) % 200_000).collect();
        let t = Instant::now();
        let o = m.forward(&ForwardBatch { seqs: vec![step(20 + n as u64, &pt, 0, toks, LogitsWanted::Last)] })?;
        let e = ms(t);
        if n == 512 {
            t512 = e;
        }
        println!("prefill {n}: {e:.1} ms = {:.0} tok/s, finite {}", n as f64 * 1e3 / e, finite(&o));
        table.push((format!("prefill ms at {n} tokens (tok/s)"), format!("{e:.1} ({:.0})", n as f64 * 1e3 / e)));
    }
    if !flag("--no-8k") && t512 > 0.0 && t512 * 16.0 < 40_000.0 {
        let n = 8192;
        let pt = pages.take(n / PAGE);
        // One 8k prefill in chunks of 4096 over `pt` (ms, finite): the default precision, then
        // the int8 GEMMs over the same pages unless they are the default already.
        let run_8k = |m: &mut CudaModel, seq: u64| -> anyhow::Result<(f64, bool)> {
            let t = Instant::now();
            let mut fin = true;
            for c0 in (0..n).step_by(4096) {
                let toks: Vec<u32> = (c0 as u32..c0 as u32 + 4096).map(|i| (i * 7919) % 200_000).collect();
                fin = finite(&m.forward(&ForwardBatch { seqs: vec![step(seq, &pt, c0, toks, LogitsWanted::Last)] })?);
            }
            Ok((ms(t), fin))
        };
        let (e, fin) = run_8k(&mut m, 30)?;
        println!("prefill {n} (2 chunks of 4096): {e:.1} ms = {:.0} tok/s, finite {fin}", n as f64 * 1e3 / e);
        table.push((format!("prefill ms at {n} tokens (tok/s)"), format!("{e:.1} ({:.0})", n as f64 * 1e3 / e)));
        let prec = gemm_precision();
        if prec != GemmPrecision::Int8 {
            set_gemm_precision(GemmPrecision::Int8);
            let r = run_8k(&mut m, 31);
            set_gemm_precision(prec);
            let (e, fin) = r?;
            println!("prefill {n}, GEMM Int8 (2 chunks of 4096): {e:.1} ms = {:.0} tok/s, finite {fin}", n as f64 * 1e3 / e);
            table.push((format!("prefill ms at {n} tokens, GEMM Int8 (tok/s)"), format!("{e:.1} ({:.0})", n as f64 * 1e3 / e)));
        }
        // int8 warp layouts (m16 tiles a warp), then the kernels of one int8 4096-token chunk
        // (the second: 4096 cached positions) with events around each launch.
        set_gemm_precision(GemmPrecision::Int8);
        for (mi, lin) in [(1usize, false), (1, true), (2, false), (4, false)] {
            minimax_rank::cuda::matmul::set_int8_mi(Some(mi));
            minimax_rank::cuda::matmul::set_int8_linear_copies(Some(lin));
            let r = run_8k(&mut m, 32 + mi as u64);
            let (e, fin) = r?;
            println!("prefill {n}, GEMM Int8, warp m16 tiles {mi}, linear weight copies {lin}: {e:.1} ms = {:.0} tok/s, finite {fin}", n as f64 * 1e3 / e);
            table.push((format!("prefill ms at {n} tokens, GEMM Int8, warp m16 tiles {mi}, linear copies {lin} (tok/s)"), format!("{e:.1} ({:.0})", n as f64 * 1e3 / e)));
        }
        minimax_rank::cuda::matmul::set_int8_mi(None);
        minimax_rank::cuda::matmul::set_int8_linear_copies(None);
        minimax_rank::cuda::blas::set_blas(Some(false));
        let r = run_8k(&mut m, 37);
        minimax_rank::cuda::blas::set_blas(None);
        let (e, fin) = r?;
        println!("prefill {n}, GEMM Int8, dense products on the built-in GEMMs (no cuBLAS): {e:.1} ms = {:.0} tok/s, finite {fin}", n as f64 * 1e3 / e);
        table.push((format!("prefill ms at {n} tokens, GEMM Int8, no cuBLAS (tok/s)"), format!("{e:.1} ({:.0})", n as f64 * 1e3 / e)));
        run_8k(&mut m, 36)?;
        m.gpu().sync()?;
        m.gpu().profile_begin();
        let toks: Vec<u32> = (4096u32..8192).map(|i| (i * 7919) % 200_000).collect();
        m.forward(&ForwardBatch { seqs: vec![step(36, &pt, 4096, toks, LogitsWanted::Last)] })?;
        let prof = m.gpu().profile_end()?;
        print_split(&prof, "int8 prefill chunk 4096..8192");
        set_gemm_precision(prec);
    } else {
        table.push(("prefill ms at 8192 tokens".into(), format!("skipped (512 took {t512:.0} ms)")));
    }

    println!("\n== {} on {} ==", spec_s, m.gpu().name);
    for (k, v) in &table {
        println!("| {k} | {v} |");
    }
    Ok(())
}
