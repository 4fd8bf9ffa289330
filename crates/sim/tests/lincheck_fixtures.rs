//! Runs the linearizability checker on every Jepsen etcd history in
//! `shared/fixtures/jepsen-etcd` and requires the verdicts in its `VERDICTS`
//! file, each decided quickly.

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::time::{Duration, Instant};

use ferry_sim::lincheck::{check, jepsen, Verdict};

/// A sanity bound, far above the goal of well under a second per file in
/// release mode, so that a slow debug build or a busy machine does not make
/// the test flaky while a search that blows up still fails it.
const PER_FILE_LIMIT: Duration = Duration::from_secs(5);

fn fixtures_dir() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../../shared/fixtures/jepsen-etcd")
}

#[test]
fn jepsen_etcd_fixtures_reproduce_verdicts() {
    let dir = fixtures_dir();
    let verdicts_path = dir.join("VERDICTS");
    let verdicts_text = std::fs::read_to_string(&verdicts_path).unwrap_or_else(|error| {
        panic!(
            "the Jepsen fixtures are missing: cannot read {}: {error}. \
             This test needs the shared/fixtures/jepsen-etcd folder next to the repository.",
            verdicts_path.display()
        )
    });
    let mut expected: BTreeMap<String, bool> = BTreeMap::new();
    for line in verdicts_text.lines().filter(|l| !l.trim().is_empty()) {
        let mut fields = line.split_whitespace();
        let (Some(file), Some(verdict), None) = (fields.next(), fields.next(), fields.next())
        else {
            panic!("malformed VERDICTS line: {line:?}");
        };
        let linearizable = match verdict {
            "linearizable" => true,
            "not-linearizable" => false,
            other => panic!("unknown verdict {other:?} in VERDICTS"),
        };
        expected.insert(file.to_string(), linearizable);
    }

    // Every log in the folder must have a verdict, and every verdict a log.
    let mut logs: Vec<String> = std::fs::read_dir(&dir)
        .unwrap()
        .map(|entry| entry.unwrap().file_name().to_string_lossy().into_owned())
        .filter(|name| name.ends_with(".log"))
        .collect();
    logs.sort();
    assert_eq!(
        logs,
        expected.keys().cloned().collect::<Vec<_>>(),
        "the .log files and VERDICTS disagree"
    );
    assert_eq!(logs.len(), 50, "expected the 50 etcd histories");

    let mut wrong = Vec::new();
    let mut total = Duration::ZERO;
    let mut slowest = (Duration::ZERO, String::new());
    for (file, &linearizable) in &expected {
        let text = std::fs::read_to_string(dir.join(file)).unwrap();
        let started = Instant::now();
        let history = jepsen::parse(&text).unwrap_or_else(|e| panic!("{file}: {e}"));
        let verdict = check(&history);
        let elapsed = started.elapsed();
        total += elapsed;
        if elapsed > slowest.0 {
            slowest = (elapsed, file.clone());
        }
        let got = match &verdict {
            Verdict::Linearizable => true,
            Verdict::NotLinearizable(_) => false,
            other => panic!("{file}: not decided: {other}"),
        };
        println!(
            "{file}: {} ops, {:?}, {}",
            history.operations.len(),
            elapsed,
            verdict
        );
        if got != linearizable {
            wrong.push(format!(
                "{file}: expected {}, got {verdict}",
                if linearizable {
                    "linearizable"
                } else {
                    "not linearizable"
                }
            ));
        }
        assert!(
            elapsed < PER_FILE_LIMIT,
            "{file} took {elapsed:?}, over the sanity bound of {PER_FILE_LIMIT:?}"
        );
    }
    println!(
        "checked {} files: total {:?}, slowest {} at {:?}",
        expected.len(),
        total,
        slowest.1,
        slowest.0
    );
    assert!(wrong.is_empty(), "wrong verdicts:\n{}", wrong.join("\n"));
}
