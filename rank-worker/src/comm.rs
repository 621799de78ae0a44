//! The collectives a sharded forward pass needs, behind one trait so the CPU test transport
//! and NCCL are interchangeable.

/// A failed collective: the world is broken and must be torn down.
#[derive(Debug, thiserror::Error)]
#[error("collective {op} failed: {detail}")]
pub struct CommError {
    pub op: &'static str,
    pub detail: String,
}

/// Collective operations among the ranks of one tensor-parallel group. Every rank must call
/// the same operations in the same order with the same lengths, and every rank must receive
/// bit-identical results (the replicated residual stream and router depend on it).
pub trait Collective: Send + Sync {
    /// This rank's index in the group.
    fn rank(&self) -> usize;
    /// Number of ranks in the group.
    fn world(&self) -> usize;
    /// Element-wise sum of `buf` over all ranks, result in every rank's `buf`.
    fn all_reduce_sum(&self, buf: &mut [f32]) -> Result<(), CommError>;
}

/// The group of one: a single process holds every head and every expert column.
pub struct Solo;

impl Collective for Solo {
    fn rank(&self) -> usize {
        0
    }
    fn world(&self) -> usize {
        1
    }
    fn all_reduce_sum(&self, _buf: &mut [f32]) -> Result<(), CommError> {
        Ok(())
    }
}
