//! The gateway-to-rank gRPC contract. One versioned service (`minimax.rank.v1.Rank`) with a few
//! batch-shaped RPCs; see `minimax/rank/v1/rank.proto` for the semantics of every field.

/// Version 1 of the rank service.
pub mod v1 {
    tonic::include_proto!("minimax.rank.v1");

    /// Encoded file descriptor set, for gRPC server reflection (grpcurl).
    pub const FILE_DESCRIPTOR_SET: &[u8] = include_bytes!(concat!(env!("OUT_DIR"), "/rank_descriptor.bin"));

    /// The protocol version ranks report in `DescribeResponse.protocol_version`.
    /// 2: drawn tokens (`SamplingSpec.draw`, `RowOutput.drawn_token`, `SeqStep.feed_drawn`) and
    /// chained steps in one-rank worlds; a version-1 rank would run overlapped steps unordered.
    /// 3: allowed-token masks (`SamplingSpec.allowed_tokens`), which a version-2 rank would
    /// ignore (structured outputs would silently not hold).
    /// 4: late rules (`SamplingSpec.rule_follows`, `StepRequest.late_rules`), which a
    /// version-3 rank would take as unconstrained rows.
    pub const PROTOCOL_VERSION: u32 = 4;

    mod convert;
    pub use convert::{apply_late_rule, count_in_history, draw_row, row_output, sampling_spec};
}
