//! Multi-GPU mode of minimax-bench (`--tp N` or `--pp N`): one thread per GPU in this process,
//! each with its own `CudaModel::synthetic_part` and NCCL communicator (fine for a kernel
//! benchmark; serving runs one process per GPU). Every thread runs the same step sequence;
//! rank 0 reports. Table: decode tok/s at batch 1 (5-token prompt + N steps), the step's time
//! split into kernels and collectives (graph replay with and without the all-reduces),
//! aggregate tok/s at 32 streams, 512/513-token prefill, 8k prefill (optional).
//!
//! In tensor mode the decode figures are taken three times: all-reduces on NCCL, then on the
//! one-shot peer-memory kernels, flag and Lamport (`--allreduce nccl|flag|lamport` for one).
//!
//! minimax-bench --tp 2 [--synthetic m2.7:iq4xs[:LAYERS]] [--decode-steps N] [--streams N]
//!               [--no-prefill] [--8k] [--decode-only] [--allreduce nccl|flag|lamport]

use std::sync::{Arc, Barrier};
use std::time::Instant;

use minimax_rank::cpu::KvSpec;
use minimax_rank::cuda::peer_allreduce::OneshotKind;
use minimax_rank::cuda::{CudaModel, CudaOptions, nccl, peer_allreduce};
use minimax_rank::partition::Partition;
use minimax_shared::forward::{ForwardBatch, LogitsWanted};
use minimax_shared::model::synthetic::SyntheticSpec;

use super::{PAGE, Pages, arg, argmax, flag, step, stream_token};

/// Whether this invocation asks for the multi-GPU mode.
pub fn requested() -> bool {
    arg("--tp").is_some() || arg("--pp").is_some() || arg("--build-kernel-cache").is_some()
}

/// One rank's view of a step: the batch, and whether this rank gets logits back.
fn fwd(m: &mut CudaModel, b: &ForwardBatch) -> anyhow::Result<Option<minimax_shared::forward::ForwardOutput>> {
    Ok(m.forward_stage(b)?)
}

/// Tokens every rank agrees on: the last stage's argmax is what rank 0 of a TP world (or the
/// last pipeline stage) sees; every rank draws from its own logits when it has them, else
/// feeds a fixed token (pipeline stages before the last: the benchmark's speed does not depend
/// on which token it is, and all stages must feed the same one: token 7).
fn next_tok(o: &Option<minimax_shared::forward::ForwardOutput>, row: usize, pp: bool) -> u32 {
    match o {
        Some(o) if !pp => argmax(o.row(row)),
        _ => 7,
    }
}

/// Runs the whole multi-GPU benchmark; prints the table from rank 0.
pub fn main_world() -> anyhow::Result<()> {
    // `--build-kernel-cache ARCH`: compile every module for sm_ARCH into the kernel cache
    // ($MINIMAX_KERNEL_CACHE) without a GPU, so a fresh GPU machine skips NVRTC.
    if let Some(a) = arg("--build-kernel-cache") {
        let arch: u32 = a.parse()?;
        let t = Instant::now();
        let built = minimax_rank::cuda::nvrtc::build_all(arch)?;
        println!("{} modules for sm_{arch} in {:.1} s", built.len(), t.elapsed().as_secs_f64());
        return Ok(());
    }
    let tp: usize = arg("--tp").and_then(|s| s.parse().ok()).unwrap_or(1);
    let pp: usize = arg("--pp").and_then(|s| s.parse().ok()).unwrap_or(1);
    anyhow::ensure!(tp >= 1 && pp >= 1 && (tp == 1 || pp == 1), "--tp N or --pp N (not both)");
    let world = tp * pp;
    let spec_s = arg("--synthetic").unwrap_or_else(|| "m2.7:iq4xs".into());
    let spec = SyntheticSpec::parse(&spec_s)?;
    let cfg = spec.config();
    let dsteps: usize = arg("--decode-steps").and_then(|s| s.parse().ok()).unwrap_or(100);
    let streams: usize = arg("--streams").and_then(|s| s.parse().ok()).unwrap_or(32);
    let decode_only = flag("--decode-only");
    let prefill = !flag("--no-prefill") && !decode_only;
    let do8k = flag("--8k") && !decode_only;
    let ar_modes: Vec<&'static str> = match arg("--allreduce").as_deref() {
        _ if pp > 1 => vec!["nccl"],
        Some("nccl") => vec!["nccl"],
        Some("flag") => vec!["flag"],
        Some("lamport") => vec!["lamport"],
        None => vec!["nccl", "flag", "lamport"],
        Some(o) => anyhow::bail!("--allreduce {o}: expected nccl, flag or lamport"),
    };
    let n_pages = ar_modes.len() * ((5 + dsteps + 8).div_ceil(PAGE) + streams * 4) + 2 * 80 + 8192 / PAGE + 64;
    let kv = KvSpec { page_size: PAGE, n_pages };
    let id = nccl::unique_id()?;
    let bar = Arc::new(Barrier::new(world));
    // Pipeline mode: the last stage publishes each step's next tokens here and every stage
    // waits for them, so a decode step is timed through all stages (batch-1 latency), as
    // when serving, not one stage running ahead of the other.
    let board = Arc::new(std::sync::Mutex::new(Vec::<u32>::new()));
    let ispp = pp > 1;
    println!(
        "multi-GPU bench: {spec_s}, {} {world}, NCCL_P2P_DISABLE={} NCCL_SHM_DISABLE={}",
        if ispp { "pipeline" } else { "tensor" },
        std::env::var("NCCL_P2P_DISABLE").unwrap_or_default(),
        std::env::var("NCCL_SHM_DISABLE").unwrap_or_default()
    );
    let tables: Vec<anyhow::Result<Vec<(String, String)>>> = std::thread::scope(|s| {
        let hs: Vec<_> = (0..world)
            .map(|r| {
                let (spec, cfg, id, bar, board, ar_modes) = (&spec, &cfg, &id, bar.clone(), board.clone(), &ar_modes);
                s.spawn(move || -> anyhow::Result<Vec<(String, String)>> {
                    let part = if ispp { Partition::pipeline(cfg, r, world, None)? } else { Partition::tensor(cfg, r, world)? };
                    let t0 = Instant::now();
                    let mut m = CudaModel::synthetic_part(spec, part, kv, CudaOptions { device: r, ..CudaOptions::default() }, 42)?;
                    let fill = t0.elapsed().as_secs_f64();
                    m.join_nccl(r, world, id)?;
                    let mut tab: Vec<(String, String)> = Vec::new();
                    let say = r == 0;
                    if say {
                        println!(
                            "rank 0: {:.2} GiB of weights, created+filled in {fill:.2} s; fast path: {}",
                            m.weight_bytes() as f64 / (1u64 << 30) as f64,
                            m.fast_path_off().unwrap_or("on")
                        );
                    }
                    let mut pages = Pages(0, n_pages as u32);
                    let mut take = |n: usize| pages.take(n);
                    let ms = |t: Instant| t.elapsed().as_secs_f64() * 1e3;
                    // The next tokens of every row after a step: local argmax in tensor mode; in
                    // pipeline mode the last stage's argmax, shared through `board`.
                    let sync_toks = |o: &Option<minimax_shared::forward::ForwardOutput>, n: usize| -> Vec<u32> {
                        if !ispp {
                            return (0..n).map(|i| next_tok(o, i, false)).collect();
                        }
                        if let Some(o) = o {
                            *board.lock().unwrap() = (0..n).map(|i| argmax(o.row(i))).collect();
                        }
                        bar.wait();
                        let v = board.lock().unwrap().clone();
                        bar.wait();
                        v
                    };

                    // Tensor mode: everything below runs once with every all-reduce on NCCL and
                    // once per one-shot peer-memory kernel for the small ones (flag, Lamport;
                    // `--allreduce MODE` runs only that one). Both ranks switch between barriers
                    // and recapture their graphs.
                    let kind0 = peer_allreduce::oneshot_kind();
                    for &mode in ar_modes {
                        bar.wait();
                        peer_allreduce::set_force_nccl(mode == "nccl");
                        if mode != "nccl" {
                            peer_allreduce::set_oneshot_kind(if mode == "flag" { OneshotKind::Flag } else { OneshotKind::Lamport });
                        }
                        m.clear_graphs();
                        bar.wait();
                        let calls0 = peer_allreduce::oneshot_calls();
                        let sfx = if ispp { String::new() } else { format!(" [{mode}]") };
                        // Decode batch 1: 5-token prompt, 2 warm-up steps, then timed steps.
                        let pt = take((5 + dsteps + 1).div_ceil(PAGE));
                        let o = fwd(&mut m, &ForwardBatch { seqs: vec![step(1, &pt, 0, vec![1, 17, 4242, 99_999, 200_000], LogitsWanted::Last)] })?;
                        let mut tok = sync_toks(&o, 1)[0];
                        for i in 0..2 {
                            tok = sync_toks(&fwd(&mut m, &ForwardBatch { seqs: vec![step(1, &pt, 5 + i, vec![tok], LogitsWanted::Last)] })?, 1)[0];
                        }
                        bar.wait();
                        let t = Instant::now();
                        let mut fin = true;
                        for i in 2..dsteps {
                            let o = fwd(&mut m, &ForwardBatch { seqs: vec![step(1, &pt, 5 + i, vec![tok], LogitsWanted::Last)] })?;
                            fin &= o.as_ref().is_none_or(|o| o.logits.iter().all(|x| x.is_finite()));
                            tok = sync_toks(&o, 1)[0];
                        }
                        bar.wait();
                        let dec = ms(t) / (dsteps - 2) as f64;
                        if say {
                            println!("decode b1{sfx}: {dec:.3} ms/token = {:.1} tok/s (forward incl. logits D2H), finite {fin}", 1e3 / dec);
                        }
                        tab.push((format!("decode tok/s, batch 1, 5-token prompt + {dsteps} steps (forward){sfx}"), format!("{:.1}", 1e3 / dec)));

                        // Kernel vs collective time per step (tensor mode): graph replay with and
                        // without the all-reduces (same kernels; results of the latter are garbage).
                        if !ispp && m.fast_path_off().is_none() {
                            let reps = 50;
                            let replay = |m: &mut CudaModel| -> anyhow::Result<f64> {
                                m.replay_fast_step(1)?;
                                m.gpu().sync()?;
                                bar.wait();
                                let t = Instant::now();
                                for _ in 0..reps {
                                    m.replay_fast_step(1)?;
                                }
                                m.gpu().sync()?;
                                let e = ms(t) / reps as f64;
                                bar.wait();
                                Ok(e)
                            };
                            let with = replay(&mut m)?;
                            m.set_tp_collectives(false);
                            // Recapture without collectives: one forward at the current position.
                            fwd(&mut m, &ForwardBatch { seqs: vec![step(1, &pt, 5 + dsteps, vec![tok], LogitsWanted::Last)] })?;
                            let without = replay(&mut m)?;
                            m.set_tp_collectives(true);
                            let n = m.tp_collectives_per_step();
                            let coll = with - without;
                            if say {
                                println!(
                                    "decode b1 graph replay{sfx}: {with:.3} ms/step ({:.1} tok/s); without collectives {without:.3} ms; \
                                     collectives {n}/token take {coll:.3} ms = {:.1} us each ({:.0}% of the step)",
                                    1e3 / with,
                                    if n > 0 { coll * 1e3 / n as f64 } else { 0.0 },
                                    100.0 * coll / with
                                );
                            }
                            tab.push((format!("decode tok/s, batch 1, graph replay (kernels + collectives){sfx}"), format!("{:.1}", 1e3 / with)));
                            tab.push((
                                format!("per-token split: kernels ms / collectives ms (count, us each){sfx}"),
                                format!("{without:.3} / {coll:.3} ({n}, {:.1})", if n > 0 { coll * 1e3 / n as f64 } else { 0.0 }),
                            ));
                            // Restore the graphs with collectives before anything else runs.
                            fwd(&mut m, &ForwardBatch { seqs: vec![step(1, &pt, 5 + dsteps, vec![tok], LogitsWanted::Last)] })?;
                        }
                        // Aggregate decode at `streams` streams: each gets a 5-token prompt (batched
                        // in one step), then 2 warm-up steps and 20 timed steps (tokens:
                        // `stream_token`, the same on every rank).
                        if !decode_only {
                            let b = streams;
                            let steps: usize = 22;
                            let pts: Vec<Vec<u32>> = (0..b).map(|_| take((5 + steps + 3).div_ceil(PAGE))).collect();
                            let mut toks = vec![0u32; b];
                            for (i, p) in pts.iter().enumerate() {
                                let o = fwd(&mut m, &ForwardBatch { seqs: vec![step(100 + i as u64, p, 0, vec![1, 2 + i as u32, 3, 4, 5], LogitsWanted::Last)] })?;
                                toks[i] = sync_toks(&o, 1)[0];
                            }
                            let run = |m: &mut CudaModel, toks: &mut Vec<u32>, s: usize| -> anyhow::Result<()> {
                                let seqs = (0..b).map(|i| step(100 + i as u64, &pts[i], 5 + s, vec![toks[i]], LogitsWanted::Last)).collect();
                                let o = fwd(m, &ForwardBatch { seqs })?;
                                *toks = sync_toks(&o, b).into_iter().enumerate().map(|(i, t)| stream_token(i, s, t)).collect();
                                Ok(())
                            };
                            run(&mut m, &mut toks, 0)?;
                            run(&mut m, &mut toks, 1)?;
                            bar.wait();
                            let t = Instant::now();
                            for s in 2..steps {
                                run(&mut m, &mut toks, s)?;
                            }
                            bar.wait();
                            let per = ms(t) / (steps - 2) as f64;
                            if say {
                                println!("decode {b} streams{sfx}: {per:.2} ms/step = {:.0} tok/s aggregate", b as f64 * 1e3 / per);
                            }
                            tab.push((format!("aggregate decode tok/s, {b} streams (forward){sfx}"), format!("{:.0}", b as f64 * 1e3 / per)));
                        }
                        if say && !ispp {
                            let used = peer_allreduce::oneshot_calls() > calls0;
                            println!("all-reduce mode {mode}: one-shot kernel {}", if used { "used" } else { "not used (NCCL only)" });
                        }
                    }
                    bar.wait();
                    peer_allreduce::set_force_nccl(false);
                    peer_allreduce::set_oneshot_kind(kind0);
                    m.clear_graphs();
                    bar.wait();
                    if decode_only {
                        return Ok(tab);
                    }

                    // Prefill (steps over 32 tokens take the exact path).
                    if prefill {
                        for n in [512usize, 513] {
                            let pt = take(n.div_ceil(PAGE));
                            let toks: Vec<u32> = (0..n as u32).map(|i| (i * 7919) % 200_000).collect();
                            bar.wait();
                            let t = Instant::now();
                            fwd(&mut m, &ForwardBatch { seqs: vec![step(20 + n as u64, &pt, 0, toks, LogitsWanted::Last)] })?;
                            bar.wait();
                            let e = ms(t);
                            if say {
                                println!("prefill {n}: {e:.1} ms = {:.0} tok/s", n as f64 * 1e3 / e);
                            }
                            tab.push((format!("prefill ms at {n} tokens (tok/s)"), format!("{e:.1} ({:.0})", n as f64 * 1e3 / e)));
                        }
                    }
                    if do8k {
                        let n = 8192;
                        let pt = take(n / PAGE);
                        bar.wait();
                        let t = Instant::now();
                        for c0 in (0..n).step_by(4096) {
                            let toks: Vec<u32> = (c0 as u32..c0 as u32 + 4096).map(|i| (i * 7919) % 200_000).collect();
                            fwd(&mut m, &ForwardBatch { seqs: vec![step(30, &pt, c0, toks, LogitsWanted::Last)] })?;
                        }
                        bar.wait();
                        let e = ms(t);
                        tab.push((format!("prefill tok/s at {n} tokens (2 chunks of 4096)"), format!("{:.0} ({e:.0} ms)", n as f64 * 1e3 / e)));
                    }
                    Ok(tab)
                })
            })
            .collect();
        hs.into_iter().map(|h| h.join().unwrap_or_else(|_| Err(anyhow::anyhow!("rank thread panicked")))).collect()
    });
    let mut first = None;
    for (r, t) in tables.into_iter().enumerate() {
        match t {
            Ok(t) if first.is_none() => first = Some(t),
            Ok(_) => {}
            Err(e) => anyhow::bail!("rank {r}: {e:#}"),
        }
    }
    println!("\n== {spec_s}, {} {world} ==", if ispp { "pipeline" } else { "tensor" });
    for (k, v) in first.unwrap_or_default() {
        println!("| {k} | {v} |");
    }
    Ok(())
}
