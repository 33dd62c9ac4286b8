fn main() {
    std::process::exit(rocket_cli::run(std::env::args_os()));
}
