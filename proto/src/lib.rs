//! gRPC contract between gateway and ranks (filled in by the distributed-core work).
