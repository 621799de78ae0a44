fn main() {
    eprintln!("minimax-gateway: serving is not implemented yet");
    std::process::exit(2);
}
