//! Turns an input AFL++ saved (a mode byte, then the rest; see
//! `ferry_fuzz::fuzz_one`) into the bytes its target decoded, for the
//! corpus in `crates/fuzz/corpus/<target>/`:
//! `target/release/seal TARGET < FILE > OUT`.

use std::io::{Read, Write};

fn main() {
    let target = std::env::args()
        .nth(1)
        .expect("usage: seal TARGET < INPUT > OUTPUT");
    let mut input = Vec::new();
    std::io::stdin()
        .read_to_end(&mut input)
        .expect("stdin reads");
    let bytes = ferry_fuzz::target_input(&target, &input).expect("a known target");
    std::io::stdout().write_all(&bytes).expect("stdout writes");
}
