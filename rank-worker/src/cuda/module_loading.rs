//! When CUDA loads library kernels. Since CUDA 12.2 the default is lazy: a kernel is loaded the
//! first time it is launched. cuBLAS picks its GEMM kernel per shape, so the first prefill
//! whose token count makes it pick a variant not used before loads that variant inside the
//! request: measured on an H200 (`minimax-bench --first-calls`), a prompt length the process had
//! not seen cost 8-13 ms more on its first call (513 tokens 68.4 ms, then 57.6), all of it in the
//! cuBLAS launches. With prefix caching nearly every request's uncached part has a new length,
//! so a serving rank loads every kernel when the context is created instead.

/// Environment variable the CUDA driver reads at initialization.
pub const VAR: &str = "CUDA_MODULE_LOADING";

/// Asks the driver to load every module's kernels at load time (`CUDA_MODULE_LOADING=EAGER`)
/// unless the user chose a mode. Returns the mode in force. Call at the start of `main`, before
/// any CUDA call and before the process starts other threads.
pub fn prefer_eager() -> String {
    match std::env::var(VAR) {
        Ok(v) if !v.is_empty() => v,
        _ => {
            // SAFETY: called first thing in `main`, while the process has a single thread, so
            // no other thread reads the environment concurrently.
            unsafe { std::env::set_var(VAR, "EAGER") };
            "EAGER".into()
        }
    }
}
