//! Compiles `minimax/rank/v1/rank.proto` with protox (pure Rust; no system protoc needed) and
//! keeps the encoded descriptor set for gRPC server reflection.

use prost::Message;

fn main() {
    let proto = "minimax/rank/v1/rank.proto";
    println!("cargo:rerun-if-changed={proto}");
    let fds = protox::compile([proto], ["."]).expect("rank.proto compiles");
    let out = std::path::PathBuf::from(std::env::var("OUT_DIR").unwrap());
    std::fs::write(out.join("rank_descriptor.bin"), fds.encode_to_vec()).unwrap();
    tonic_prost_build::configure()
        .build_server(true)
        .build_client(true)
        .compile_fds(fds)
        .expect("tonic codegen");
}
