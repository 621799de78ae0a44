//! Pipeline parallelism inside one process: one worker thread per GPU, each owning the
//! [`CudaModel`] of one stage and its NCCL communicator (benchmarks and tests; a served
//! world runs one `minimax-rank` process per stage instead). A step hands the same batch to
//! every stage; stage r receives stage r-1's hidden states on the device and sends its own to
//! r+1 (`CudaModel::forward_stage`). Several micro-batches given to [`LocalPipeline::steps`]
//! are in flight at once: stage r computes micro-batch i while stage r+1 computes i-1.

use std::sync::{Arc, mpsc};
use std::thread::JoinHandle;

use minimax_shared::forward::{ForwardBatch, ForwardOutput};
use minimax_shared::gguf::GgufModel;
use minimax_shared::model::ModelConfig;

use super::error::CudaError;
use super::model::{CudaModel, CudaOptions};
use super::nccl::{self, NcclAbort};
use crate::cpu::KvSpec;
use crate::partition::{self, Partition};

type Job = Box<dyn FnOnce(&mut CudaModel) + Send>;

struct Worker {
    jobs: Option<mpsc::Sender<Job>>,
    thread: Option<JoinHandle<()>>,
}

/// The stages of one model on several GPUs of this process, joined into one NCCL world.
pub struct LocalPipeline {
    workers: Vec<Worker>,
    aborts: Vec<NcclAbort>,
    parts: Vec<Partition>,
}

/// Builds stage `r` of `n` on its GPU (called on that stage's worker thread).
pub type StageBuilder = dyn Fn(usize, usize) -> Result<CudaModel, CudaError> + Send + Sync;

impl LocalPipeline {
    /// Starts `n` worker threads; worker r builds its stage with `build(r, n)` (on that
    /// thread, so the stages load in parallel), then all join one NCCL world (rank = stage).
    /// Each stage's partition must be `Partition::pipeline*(.., r, n, ..)`.
    pub fn spawn(n: usize, build: Arc<StageBuilder>) -> Result<Self, CudaError> {
        if n == 0 {
            return Err(CudaError::Shape("a pipeline needs at least one stage".into()));
        }
        let id = if n > 1 { nccl::unique_id()? } else { Vec::new() };
        let (ready_tx, ready_rx) = mpsc::channel::<(usize, Result<(Option<NcclAbort>, Partition), CudaError>)>();
        let mut workers = Vec::with_capacity(n);
        for r in 0..n {
            let (jobs_tx, jobs_rx) = mpsc::channel::<Job>();
            let (build, id, ready) = (build.clone(), id.clone(), ready_tx.clone());
            let thread = std::thread::Builder::new()
                .name(format!("pp-stage-{r}"))
                .spawn(move || {
                    let setup = build(r, n).and_then(|mut m| {
                        let p = m.partition().clone();
                        if p.pp_rank != r || p.pp_world != n || p.tp_world != 1 {
                            return Err(CudaError::Shape(format!("stage {r} of {n} built with partition {p:?}")));
                        }
                        if n > 1 {
                            m.join_nccl(r, n, &id)?;
                        }
                        Ok(m)
                    });
                    let mut model = match setup {
                        Ok(m) => {
                            let _ = ready.send((r, Ok((m.nccl_abort_handle(), m.partition().clone()))));
                            m
                        }
                        Err(e) => {
                            let _ = ready.send((r, Err(e)));
                            return;
                        }
                    };
                    drop(ready);
                    for job in jobs_rx {
                        job(&mut model);
                    }
                })
                .map_err(|e| CudaError::Shape(format!("spawn stage thread: {e}")))?;
            workers.push(Worker { jobs: Some(jobs_tx), thread: Some(thread) });
        }
        drop(ready_tx);
        let mut aborts: Vec<Option<NcclAbort>> = (0..n).map(|_| None).collect();
        let mut parts: Vec<Option<Partition>> = vec![None; n];
        let mut first_err = None;
        for _ in 0..n {
            match ready_rx.recv() {
                Ok((r, Ok((a, p)))) => {
                    aborts[r] = a;
                    parts[r] = Some(p);
                }
                Ok((r, Err(e))) => {
                    // The others may be blocked in ncclCommInitRank waiting for this stage.
                    for a in aborts.iter().flatten() {
                        a.abort(&format!("stage {r} failed to start"));
                    }
                    first_err.get_or_insert(CudaError::Shape(format!("pipeline stage {r}: {e}")));
                    break;
                }
                Err(_) => {
                    first_err.get_or_insert(CudaError::Shape("a pipeline stage thread ended while starting".into()));
                    break;
                }
            }
        }
        let mut me = Self { workers, aborts: aborts.into_iter().flatten().collect(), parts: parts.iter().flatten().cloned().collect() };
        if let Some(e) = first_err {
            // Stages blocked in the NCCL join cannot be woken without a communicator: detach.
            me.detach();
            return Err(e);
        }
        Ok(me)
    }

    /// Loads `model` as `devices.len()` stages balanced by bytes (`partition::gguf_stage_bytes`),
    /// stage r on `devices[r]`; `opts.device` is ignored.
    pub fn load(model: Arc<GgufModel>, devices: &[usize], kv: KvSpec, opts: CudaOptions) -> Result<Self, CudaError> {
        if devices.is_empty() {
            return Err(CudaError::Shape("a pipeline needs at least one device".into()));
        }
        let cfg = ModelConfig::from_gguf(&model)?;
        let bytes = partition::gguf_stage_bytes(&model, &cfg);
        let n = devices.len();
        let devices = devices.to_vec();
        let build = move |r: usize, n: usize| {
            let part = Partition::pipeline_by_bytes(&cfg, r, n, &bytes).map_err(|e| CudaError::Shape(e.to_string()))?;
            CudaModel::load_part(model.clone(), part, kv, CudaOptions { device: devices[r], ..opts })
        };
        Self::spawn(n, Arc::new(build))
    }

    /// Number of stages.
    pub fn n_stages(&self) -> usize {
        self.workers.len()
    }

    /// Every stage's share (layer ranges).
    pub fn partitions(&self) -> &[Partition] {
        &self.parts
    }

    /// Runs `f` on stage `r`'s model, on its thread (e.g. `set_fast`, `fill_kv_random`).
    pub fn with_stage<R: Send + 'static>(&self, r: usize, f: impl FnOnce(&mut CudaModel) -> R + Send + 'static) -> Result<R, CudaError> {
        let (tx, rx) = mpsc::channel();
        self.send(r, Box::new(move |m| {
            let _ = tx.send(f(m));
        }))?;
        rx.recv().map_err(|_| CudaError::Shape(format!("pipeline stage {r} thread ended")))
    }

    /// One step through every stage: the last stage's output.
    pub fn step(&self, batch: &ForwardBatch) -> Result<ForwardOutput, CudaError> {
        let mut out = self.steps(vec![batch.clone()])?;
        Ok(out.pop().expect("one micro-batch, one output"))
    }

    /// Several micro-batches (disjoint sequences) in flight at once: every stage runs them in
    /// order, so stage r works on micro-batch i while stage r+1 works on i-1. Returns the last
    /// stage's outputs in order. On an error every communicator is aborted so no stage stays
    /// blocked in a send/receive; the pipeline is then unusable.
    pub fn steps(&self, batches: Vec<ForwardBatch>) -> Result<Vec<ForwardOutput>, CudaError> {
        let batches = Arc::new(batches);
        let n = self.workers.len();
        let (tx, rx) = mpsc::channel::<(usize, Result<Vec<ForwardOutput>, CudaError>)>();
        for r in 0..n {
            let (b, tx) = (batches.clone(), tx.clone());
            let aborts = self.aborts.clone();
            self.send(r, Box::new(move |m| {
                let mut outs = Vec::new();
                let mut res = Ok(());
                for (i, batch) in b.iter().enumerate() {
                    match m.forward_stage(batch) {
                        Ok(Some(o)) => outs.push(o),
                        Ok(None) => {}
                        Err(e) => {
                            for a in &aborts {
                                a.abort(&format!("stage {r} failed on micro-batch {i}: {e}"));
                            }
                            res = Err(e);
                            break;
                        }
                    }
                }
                let _ = tx.send((r, res.map(|()| outs)));
            }))?;
        }
        drop(tx);
        let mut last = None;
        let mut first_err = None;
        for _ in 0..n {
            match rx.recv() {
                Ok((r, Ok(outs))) if r + 1 == n => last = Some(outs),
                Ok((_, Ok(_))) => {}
                Ok((r, Err(e))) => {
                    first_err.get_or_insert(CudaError::Shape(format!("pipeline stage {r}: {e}")));
                }
                Err(_) => {
                    first_err.get_or_insert(CudaError::Shape("a pipeline stage thread ended".into()));
                    break;
                }
            }
        }
        if let Some(e) = first_err {
            return Err(e);
        }
        let outs = last.ok_or_else(|| CudaError::Shape("the last stage returned nothing".into()))?;
        if outs.len() != batches.len() {
            return Err(CudaError::Shape(format!("{} outputs for {} micro-batches", outs.len(), batches.len())));
        }
        Ok(outs)
    }

    fn send(&self, r: usize, job: Job) -> Result<(), CudaError> {
        let w = self.workers.get(r).ok_or_else(|| CudaError::Shape(format!("no pipeline stage {r}")))?;
        w.jobs.as_ref().and_then(|j| j.send(job).ok()).ok_or_else(|| CudaError::Shape(format!("pipeline stage {r} thread ended")))
    }

    /// Lets the threads go without waiting for them (they may be stuck in NCCL).
    fn detach(&mut self) {
        for w in &mut self.workers {
            w.jobs = None;
            w.thread = None;
        }
    }
}

impl Drop for LocalPipeline {
    fn drop(&mut self) {
        for w in &mut self.workers {
            w.jobs = None;
        }
        for w in &mut self.workers {
            if let Some(t) = w.thread.take() {
                let _ = t.join();
            }
        }
    }
}
