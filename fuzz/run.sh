#!/usr/bin/env bash
# Coverage-guided fuzzing of one ferry target with AFL++ (stable toolchain).
#
#   fuzz/run.sh TARGET [SECONDS]      # default 300 s; TARGET as in crates/fuzz/src/lib.rs
#   fuzz/run.sh all [SECONDS]         # every target in turn
#
# Needs cargo-afl once: `cargo install cargo-afl && cargo afl config --build`.
# Seeds come from crates/fuzz/corpus/TARGET (each behind a mode byte of 0,
# see ferry_fuzz::target_input); findings land in fuzz/out/TARGET/default/
# {crashes,hangs}. Reproduce one with `fuzz/target/release/TARGET < FILE`,
# and turn it into a corpus file with
# `fuzz/target/release/seal TARGET < FILE > crates/fuzz/corpus/TARGET/crash-NAME`.
set -euo pipefail
cd "$(dirname "$0")"
target=${1:?usage: fuzz/run.sh TARGET|all [SECONDS]}
seconds=${2:-300}
targets=(peer_frame peer_handshake peer_message wal_record wal_segment log_state
    snapshot_file kv_snapshot backup_file command_apply authority)
if [[ $target == all ]]; then
    for t in "${targets[@]}"; do "$0" "$t" "$seconds"; done
    exit 0
fi
cargo afl build --release --bin "$target" --bin seal
input=out/$target/in
rm -rf "$input"
mkdir -p "$input"
for seed in ../crates/fuzz/corpus/"$target"/*; do
    { printf '\0'; cat "$seed"; } > "$input/$(basename "$seed")"
done
# No CPU frequency or core dump checks (a shared machine, a container);
# plain log lines instead of the screen; inputs up to 64 KiB.
export AFL_SKIP_CPUFREQ=1 AFL_NO_UI=1 AFL_I_DONT_CARE_ABOUT_MISSING_CRASHES=1
export AFL_SUPPRESS_FUZZ_DEBUG_LOG=1
cargo afl fuzz -i "$input" -o "out/$target" -t 5000 -V "$seconds" -G 65536 \
    "target/release/$target" > "out/$target.log" 2>&1 || true
stats=out/$target/default/fuzzer_stats
echo "$target: $(grep -E '^(execs_done|execs_per_sec|corpus_count|saved_crashes|saved_hangs|bitmap_cvg|run_time) ' "$stats" | awk '{print $1"="$3}' | tr '\n' ' ')"
