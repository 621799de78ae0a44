//! The one-shot all-reduce over peer memory (kernels/tp.cu `tp_ar_oneshot`,
//! rank-worker/src/cuda/peer_allreduce.rs) on two GPUs, in both deployment shapes: ranks as
//! threads of one process (peer access to raw pointers) and ranks as processes (CUDA IPC; this
//! test binary re-runs itself as the two rank processes). Against the CPU sum in rank order,
//! bit for bit: random sizes (not multiples of the block's 1024 floats, unaligned starts),
//! outputs poisoned with NaN around the tensor, many launches back to back with no sync, a
//! captured CUDA graph replayed many times, one size above the limit (NCCL), and what happens
//! when a peer is gone (abort from another thread; a peer process that exited: the timeout).
//! Needs two GPUs (`--ignored`; kind nvidia-h200-x2).
#![cfg(feature = "cuda")]

mod common;

use std::process::{Command, Stdio};
use std::sync::{Arc, Barrier};
use std::time::{Duration, Instant};

use common::gpu::{NAN, Rng, bits, gpu_count};
use cudarc::driver::sys;
use minimax_rank::cuda::peer_allreduce::{OneshotKind, set_oneshot_kind};
use minimax_rank::cuda::{Gpu, NcclComm, nccl};

const WORLD: usize = 2;

/// Rank `r`'s partial of case `case` (every rank can compute every rank's).
fn partial(case: u64, r: usize, n: usize) -> Vec<f32> {
    let mut rng = Rng(0x9e37_79b9_7f4a_7c15 ^ (case * 131 + r as u64 + 1));
    let scale = [1.0f32, 1e3, 1e-3, 37.5][(case % 4) as usize];
    let mut v = rng.vec(n, scale);
    if n > 5 {
        // Values whose sum rounds (large + small), and exact cancellations.
        v[1] = if r == 0 { 1e8 } else { 3.0 };
        v[2] = if r == 0 { 0.1 } else { -0.1 };
    }
    if case % 7 == 3 && n > 5 && r == 1 {
        // The Lamport kernel's sentinel bits as an input: sent as a NaN, never waited on forever.
        v[3] = f32::from_bits(0xffff_ffff);
    }
    v
}

/// The CPU reference: the world's partials summed in rank order, f32.
fn cpu_sum(case: u64, n: usize) -> Vec<f32> {
    let mut acc = partial(case, 0, n);
    for r in 1..WORLD {
        for (a, b) in acc.iter_mut().zip(partial(case, r, n)) {
            *a += b;
        }
    }
    acc
}

/// Whether there are WORLD GPUs (else the test says it is skipped).
fn have_world() -> bool {
    let ok = gpu_count() >= WORLD;
    if !ok {
        eprintln!("skipped: fewer than {WORLD} GPUs");
    }
    ok
}

/// Asserts `got[off..off + n] == want` bit for bit and every other value still NaN.
fn check(what: &str, got: &[f32], off: usize, want: &[f32]) {
    let n = want.len();
    for (i, &x) in got.iter().enumerate() {
        if i < off || i >= off + n {
            assert_eq!(x.to_bits(), NAN, "{what}: value {i} outside the tensor [{off}, {}) was written", off + n);
        }
    }
    let g = bits(&got[off..off + n]);
    let w = bits(want);
    // A NaN input gives a NaN (its bits are the GPU's canonical NaN, not the CPU's payload).
    if let Some(i) = (0..n).find(|&i| if want[i].is_nan() { !got[off + i].is_nan() } else { g[i] != w[i] }) {
        panic!("{what}: value {i} of {n} is {} (bits {:#x}), expected {} ({:#x})", got[off + i], g[i], want[i], w[i]);
    }
}

fn upload_into(g: &Gpu, dst: u64, v: &[f32]) {
    let src = g.upload(v).unwrap();
    g.ctx.bind_to_thread().unwrap();
    unsafe { sys::cuMemcpyDtoDAsync_v2(dst, g.ptr(&src), 4 * v.len(), g.stream.cu_stream()) }.result().unwrap();
    g.sync().unwrap();
}

/// Every check one rank runs; returns a digest of its results for the cross-rank comparison.
fn rank_checks(r: usize, g: &Gpu, comm: &NcclComm, expect_via: &str) -> Vec<u32> {
    let p = comm.oneshot().expect("the one-shot path must be on (MINIMAX_TP_ALLREDUCE unset or oneshot)");
    assert_eq!(p.via(), expect_via, "rank {r}: mapping of the peer's memory");
    let max = p.max_floats();
    let calls0 = p.launches();
    let mut digest = Vec::new();

    // 1. Random sizes and offsets, NaN around each tensor, all enqueued back to back.
    let mut rng = Rng(77);
    let mut cases: Vec<(usize, usize)> = vec![(1, 0), (2, 0), (3, 1), (4, 0), (5, 3), (1023, 0), (1024, 0), (1025, 2), (3072, 0), (3073, 1), (12345, 7), (96 * 1024, 0), (max, 0), (max + 1, 0), (2 * max + 5, 3)];
    for _ in 0..20 {
        cases.push((1 + rng.below(max), rng.below(8)));
    }
    let mut bufs = Vec::new();
    for (ci, &(n, off)) in cases.iter().enumerate() {
        let len = off + n + 40;
        let b = common::gpu::poisoned(g, len);
        upload_into(g, g.ptr(&b) + 4 * off as u64, &partial(ci as u64, r, n));
        bufs.push(b);
    }
    for (ci, &(n, off)) in cases.iter().enumerate() {
        comm.all_reduce_sum_dev(g, g.ptr(&bufs[ci]) + 4 * off as u64, n).unwrap();
    }
    g.sync().unwrap();
    for (ci, &(n, off)) in cases.iter().enumerate() {
        let got = g.download(&bufs[ci]).unwrap();
        check(&format!("rank {r} case {ci} (n {n}, offset {off})"), &got, off, &cpu_sum(ci as u64, n));
        digest.extend(bits(&got[off..off + n.min(64)]));
    }
    let over = cases.iter().filter(|c| c.0 > max).count() as u64;
    assert_eq!(p.launches() - calls0, cases.len() as u64 - over, "rank {r}: tensors up to {max} floats go one-shot, larger ones NCCL");

    // 2. Many launches back to back, no sync: every call doubles the (integer) sums.
    let sizes = [3072usize, 2, 40_001];
    let init = |n: usize, r: usize| -> Vec<f32> { (0..n).map(|i| ((i * 7 + r * 3) % 11) as f32 - 5.0).collect() };
    let dbl: Vec<_> = sizes.iter().map(|&n| {
        let b = common::gpu::poisoned(g, n + 16);
        upload_into(g, g.ptr(&b) + 16, &init(n, r));
        b
    }).collect();
    let rounds = 60;
    for _ in 0..rounds {
        for (b, &n) in dbl.iter().zip(&sizes) {
            comm.all_reduce_sum_dev(g, g.ptr(b) + 16, n).unwrap();
        }
    }
    g.sync().unwrap();
    for (b, &n) in dbl.iter().zip(&sizes) {
        let mut want: Vec<f32> = init(n, 0);
        for q in 1..WORLD {
            for (a, x) in want.iter_mut().zip(init(n, q)) {
                *a += x;
            }
        }
        let f = (WORLD as f32).powi(rounds - 1);
        let want: Vec<f32> = want.iter().map(|x| x * f).collect();
        check(&format!("rank {r} back-to-back n {n}"), &g.download(b).unwrap(), 4, &want);
    }

    // 3. A captured graph (copy partial in, all-reduce; three tensors) replayed many times.
    let gsz = [(3 * 3072usize, 100u64), (6, 101), (32 * 3072, 102), (777, 103)];
    let srcs: Vec<_> = gsz.iter().map(|&(n, c)| g.upload(&partial(c, r, n)).unwrap()).collect();
    let dsts: Vec<_> = gsz.iter().map(|&(n, _)| common::gpu::poisoned(g, n + 8)).collect();
    g.sync().unwrap();
    use cudarc::driver::sys::{CUgraphInstantiate_flags, CUstreamCaptureMode};
    g.stream.begin_capture(CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_RELAXED).unwrap();
    for ((s, d), &(n, _)) in srcs.iter().zip(&dsts).zip(&gsz) {
        unsafe { sys::cuMemcpyDtoDAsync_v2(g.ptr(d) + 16, g.ptr(s), 4 * n, g.stream.cu_stream()) }.result().unwrap();
        comm.all_reduce_sum_dev(g, g.ptr(d) + 16, n).unwrap();
    }
    let graph = g.stream.end_capture(CUgraphInstantiate_flags(0)).unwrap().expect("a captured graph");
    for rep in 1..=300 {
        graph.launch().unwrap();
        if rep == 1 || rep == 150 || rep == 300 {
            g.sync().unwrap();
            for (d, &(n, c)) in dsts.iter().zip(&gsz) {
                let got = g.download(d).unwrap();
                check(&format!("rank {r} graph replay {rep} n {n}"), &got, 4, &cpu_sum(c, n));
                digest.extend(bits(&got[4..4 + n.min(64)]));
            }
        }
    }
    assert_eq!(p.failed(), 0, "rank {r}: no launch gave up");
    eprintln!("rank {r}: {} cases, {rounds} x {} back-to-back launches, 300 graph replays: bit-exact ({} one-shot launches)", cases.len(), sizes.len(), p.launches() - calls0);
    digest
}

#[test]
#[ignore = "needs two GPUs"]
fn oneshot_threads_match_cpu_sum_and_abort_releases_a_waiting_rank() {
    if !have_world() {
        return;
    }
    let id = nccl::unique_id().unwrap();
    let bar = Arc::new(Barrier::new(WORLD));
    let digests: Vec<Vec<u32>> = std::thread::scope(|s| {
        let hs: Vec<_> = (0..WORLD)
            .map(|r| {
                let (id, bar) = (&id, bar.clone());
                s.spawn(move || {
                    let g = Gpu::new(r).unwrap();
                    let comm = NcclComm::join(&g.ctx, &g.stream, r, WORLD, id, true).unwrap();
                    // Both kernels (the default, Lamport, last: the abort below uses it).
                    let mut d = Vec::new();
                    for kind in [OneshotKind::Flag, OneshotKind::Lamport] {
                        bar.wait();
                        set_oneshot_kind(kind);
                        bar.wait();
                        eprintln!("rank {r}: kernel {kind:?}");
                        d.extend(rank_checks(r, &g, &comm, "peer"));
                    }
                    // A peer that never arrives: rank 0 waits in a launch until another thread
                    // aborts the communicator (what the rank's watcher does).
                    bar.wait();
                    if r == 0 {
                        let h = comm.abort_handle();
                        let buf = common::gpu::poisoned(&g, 3072);
                        comm.all_reduce_sum_dev(&g, g.ptr(&buf), 3072).unwrap();
                        let t = Instant::now();
                        let h2 = h.clone();
                        let killer = std::thread::spawn(move || {
                            std::thread::sleep(Duration::from_millis(300));
                            h2.abort("test: peer never arrives")
                        });
                        g.sync().unwrap();
                        let waited = t.elapsed();
                        assert!(killer.join().unwrap(), "the abort ran");
                        assert!(waited >= Duration::from_millis(250) && waited < Duration::from_secs(20), "released after {waited:?}");
                        assert_eq!(comm.oneshot().unwrap().failed(), 1, "the launch reports that it gave up");
                        assert!(h.is_aborted());
                        assert!(comm.all_reduce_sum_dev(&g, g.ptr(&buf), 3072).is_err(), "an aborted communicator refuses new work");
                        eprintln!("rank 0: a launch waiting on a missing peer returned {waited:?} after the wait began (abort at 300 ms)");
                    }
                    // Rank 1 keeps its memory mapped until rank 0 is done pushing into it.
                    bar.wait();
                    d
                })
            })
            .collect();
        hs.into_iter().map(|h| h.join().expect("rank thread panicked")).collect()
    });
    assert_eq!(digests[0], digests[1], "ranks computed different bits");
}

/// Ranks as processes (CUDA IPC): this binary runs `oneshot_rank_process` twice, as rank 0
/// and rank 1. Rank 1 exits after the checks; rank 0's next launch must give up after the
/// timeout (MINIMAX_TP_ONESHOT_TIMEOUT_MS=3000) instead of hanging.
#[test]
#[ignore = "needs two GPUs"]
fn oneshot_rank_processes_over_ipc() {
    if !have_world() {
        return;
    }
    let dir = std::env::temp_dir().join(format!("minimax-ar-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    let exe = std::env::current_exe().unwrap();
    let kids: Vec<_> = (0..WORLD)
        .map(|r| {
            Command::new(&exe)
                .args(["oneshot_rank_process", "--exact", "--ignored", "--nocapture", "--test-threads=1"])
                .env("MINIMAX_AR_RANK", r.to_string())
                .env("MINIMAX_AR_DIR", &dir)
                .env("MINIMAX_TP_ONESHOT_TIMEOUT_MS", "3000")
                .stdout(Stdio::piped())
                .stderr(Stdio::piped())
                .spawn()
                .unwrap()
        })
        .collect();
    let t = Instant::now();
    let mut outs = Vec::new();
    for (r, mut k) in kids.into_iter().enumerate() {
        loop {
            if k.try_wait().unwrap().is_some() || t.elapsed() > Duration::from_secs(240) {
                break;
            }
            std::thread::sleep(Duration::from_millis(100));
        }
        if k.try_wait().unwrap().is_none() {
            let _ = k.kill();
        }
        let o = k.wait_with_output().unwrap();
        let text = format!("{}{}", String::from_utf8_lossy(&o.stdout), String::from_utf8_lossy(&o.stderr));
        eprintln!("---- rank process {r} ({}) ----\n{text}", o.status);
        outs.push((o.status.success(), text));
    }
    let _ = std::fs::remove_dir_all(&dir);
    for (r, (ok, text)) in outs.iter().enumerate() {
        assert!(*ok && text.contains(&format!("RANK {r} PASSED")), "rank process {r} failed (output above)");
    }
}

/// One rank process of [`oneshot_rank_processes_over_ipc`]; does nothing unless started by it.
#[test]
#[ignore = "started by oneshot_rank_processes_over_ipc"]
fn oneshot_rank_process() {
    let Some(r) = std::env::var("MINIMAX_AR_RANK").ok().and_then(|v| v.parse::<usize>().ok()) else {
        return;
    };
    let dir = std::path::PathBuf::from(std::env::var("MINIMAX_AR_DIR").unwrap());
    let idf = dir.join("id");
    let id = if r == 0 {
        let id = nccl::unique_id().unwrap();
        std::fs::write(dir.join("id.tmp"), &id).unwrap();
        std::fs::rename(dir.join("id.tmp"), &idf).unwrap();
        id
    } else {
        let t = Instant::now();
        loop {
            if let Ok(b) = std::fs::read(&idf) {
                break b;
            }
            assert!(t.elapsed() < Duration::from_secs(60), "rank 0 wrote no NCCL id");
            std::thread::sleep(Duration::from_millis(20));
        }
    };
    let g = Gpu::new(r).unwrap();
    let comm = NcclComm::join(&g.ctx, &g.stream, r, WORLD, &id, true).unwrap();
    let d = rank_checks(r, &g, &comm, "ipc");
    // Compare digests through NCCL: the element-wise difference of rank 0's and rank 1's.
    let dv: Vec<f32> = d.iter().map(|&b| (b & 0xffff) as f32 * if r == 0 { 1.0 } else { -1.0 }).collect();
    let mut db = g.upload(&dv).unwrap();
    comm.all_reduce_sum(&mut db).unwrap();
    assert!(g.download(&db).unwrap().iter().all(|&x| x == 0.0), "rank {r}: ranks computed different bits");
    // Rank 1 dies (exits without a word); rank 0's next launch waits for it, then times out.
    if r == 1 {
        println!("RANK 1 PASSED (exiting now, as a dead peer)");
        std::process::exit(0);
    }
    std::thread::sleep(Duration::from_millis(1000));
    let buf = common::gpu::poisoned(&g, 3072);
    let t = Instant::now();
    comm.all_reduce_sum_dev(&g, g.ptr(&buf), 3072).unwrap();
    let res = g.sync();
    let waited = t.elapsed();
    let failed = comm.oneshot().unwrap().failed();
    eprintln!("rank 0: launch after the peer exited returned {res:?} after {waited:?}, failure word {failed}, aborted {}", comm.abort_handle().is_aborted());
    assert!(waited < Duration::from_secs(30), "a launch waiting on a dead peer must give up (timeout 3 s)");
    match res {
        Ok(()) => {
            assert_eq!(failed, 2, "a launch that timed out must say so");
            assert!(comm.abort_handle().is_aborted(), "a timed-out launch marks the communicator aborted");
        }
        // Writing into the dead process's memory may fault instead; the rank is then restarted.
        Err(e) => eprintln!("rank 0: the dead peer's memory faulted: {e}"),
    }
    println!("RANK 0 PASSED");
}

/// Fills `$MINIMAX_KERNEL_CACHE` with this binary's kernels for sm_`$MINIMAX_AR_BUILD_CACHE`
/// (no GPU needed: NVRTC only), so a fresh GPU machine skips NVRTC. Does nothing otherwise.
#[test]
#[ignore = "kernel-cache helper"]
fn build_kernel_cache() {
    if let Some(arch) = std::env::var("MINIMAX_AR_BUILD_CACHE").ok().and_then(|v| v.parse().ok()) {
        let built = minimax_rank::cuda::nvrtc::build_all(arch).unwrap();
        eprintln!("{} modules for sm_{arch}", built.len());
    }
}
