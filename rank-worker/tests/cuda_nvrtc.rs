//! Compiles every CUDA kernel module with NVRTC for Hopper (sm_90) and Blackwell (sm_120).
//! Needs libnvrtc only (no GPU, no driver): CI runs it through `tools/nvrtc_check/run.sh`,
//! which installs NVRTC from PyPI. Ignored by default because plain CI machines lack NVRTC.
#![cfg(feature = "cuda")]

use minimax_rank::cuda::nvrtc;

#[test]
#[ignore = "needs libnvrtc: run tools/nvrtc_check/run.sh"]
fn every_kernel_compiles_for_sm90_and_sm120() {
    let ver = nvrtc::version().expect("libnvrtc must be loadable");
    eprintln!("NVRTC {}.{}", ver.0, ver.1);
    let mut failures = Vec::new();
    for arch in [90u32, 120] {
        for &(name, src) in nvrtc::MODULES {
            let t0 = std::time::Instant::now();
            match nvrtc::compile(name, src, arch) {
                Ok(bin) => eprintln!("sm_{arch} {name:<14} ok  {:>8} bytes  {:.1} s", bin.len(), t0.elapsed().as_secs_f64()),
                Err(e) => {
                    eprintln!("sm_{arch} {name:<14} FAILED\n{e}");
                    failures.push(format!("sm_{arch} {name}"));
                }
            }
        }
    }
    assert!(failures.is_empty(), "kernels that do not compile: {failures:?}");
}
