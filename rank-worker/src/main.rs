//! `minimax-rank`: one process per device.

use std::process::ExitCode;

use clap::{Parser, Subcommand};
use minimax_shared::gguf::GgufModel;

#[derive(Parser)]
#[command(name = "minimax-rank", version, about = "MiniMax Serve rank-worker")]
struct Cli {
    #[command(subcommand)]
    cmd: Cmd,
}

#[derive(Subcommand)]
enum Cmd {
    /// Print a model's summary: architecture, hyper-parameters, shards, tensor types.
    Inspect {
        /// A .gguf file, the first shard of a split model, or a directory.
        model: std::path::PathBuf,
    },
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    match cli.cmd {
        Cmd::Inspect { model } => match GgufModel::open(&model) {
            Ok(m) => {
                print!("{}", minimax_rank::inspect::summary(&m));
                ExitCode::SUCCESS
            }
            Err(e) => {
                eprintln!("error: {e}");
                ExitCode::FAILURE
            }
        },
    }
}
