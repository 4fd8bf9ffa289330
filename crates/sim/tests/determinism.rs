//! The same seed gives the same run: identical trace bytes, history and
//! coverage, every time.

use ferry_sim::run_seed;

#[test]
fn same_seed_same_trace_bytes() {
    for seed in [0u64, 7, 42, 1_000_003] {
        let first = run_seed(seed, None, true);
        let second = run_seed(seed, None, true);
        let (Some(a), Some(b)) = (&first.trace, &second.trace) else {
            panic!("seed {seed}: no trace recorded");
        };
        assert!(
            a.len() > 1_000,
            "seed {seed}: the trace is suspiciously short ({} bytes)",
            a.len()
        );
        assert_eq!(a.as_bytes(), b.as_bytes(), "seed {seed}: traces differ");
        assert_eq!(
            first.histories, second.histories,
            "seed {seed}: histories differ"
        );
        assert_eq!(
            first.coverage, second.coverage,
            "seed {seed}: coverage differs"
        );
        assert_eq!(first.end_us, second.end_us);
    }
}

#[test]
fn tracing_does_not_change_the_run() {
    let traced = run_seed(11, None, true);
    let quiet = run_seed(11, None, false);
    assert_eq!(traced.histories, quiet.histories);
    assert_eq!(traced.coverage, quiet.coverage);
    assert!(quiet.trace.is_none());
}

#[test]
fn different_seeds_differ() {
    let a = run_seed(1, Some(3), true);
    let b = run_seed(2, Some(3), true);
    assert_ne!(a.trace, b.trace);
}

#[test]
fn trace_lines_carry_time_and_node() {
    let report = run_seed(5, None, true);
    let trace = report.trace.unwrap_or_default();
    let mut kinds = [false; 4];
    for line in trace.lines().filter(|l| !l.starts_with("FAILURE")) {
        let mut parts = line.split_whitespace();
        let time = parts.next().unwrap_or("");
        assert!(
            time.ends_with("us") && time.trim_end_matches("us").parse::<u64>().is_ok(),
            "{line}"
        );
        let who = parts.next().unwrap_or("");
        assert!(who == "--" || who.starts_with('n'), "{line}");
        kinds[0] |= line.contains(" recv ");
        kinds[1] |= line.contains(" role ");
        kinds[2] |= line.contains("client c");
        kinds[3] |= line.contains("crash")
            || line.contains("partition")
            || line.contains("pause")
            || line.contains("clog");
    }
    assert_eq!(
        kinds, [true; 4],
        "messages, role changes, client events and faults all appear"
    );
}
