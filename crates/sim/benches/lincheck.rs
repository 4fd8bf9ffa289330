//! Benchmarks of the linearizability checker on the Jepsen etcd histories
//! in `shared/fixtures/jepsen-etcd` (parsing included, as `ferry lincheck`
//! does it).

use std::hint::black_box;
use std::path::PathBuf;

use criterion::{criterion_group, criterion_main, Criterion};
use ferry_sim::lincheck::{check, jepsen};

fn fixture_texts() -> Vec<(String, String)> {
    let dir =
        PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../../shared/fixtures/jepsen-etcd");
    let mut files: Vec<PathBuf> = std::fs::read_dir(&dir)
        .unwrap_or_else(|e| panic!("cannot read {}: {e}", dir.display()))
        .map(|entry| entry.unwrap().path())
        .filter(|path| path.extension().is_some_and(|ext| ext == "log"))
        .collect();
    files.sort();
    files
        .into_iter()
        .map(|path| {
            let name = path.file_name().unwrap().to_string_lossy().into_owned();
            (name, std::fs::read_to_string(&path).unwrap())
        })
        .collect()
}

fn jepsen_etcd(c: &mut Criterion) {
    let texts = fixture_texts();
    assert_eq!(texts.len(), 50, "expected the 50 Jepsen etcd histories");
    c.bench_function("lincheck/jepsen_etcd_all_50_files", |b| {
        b.iter(|| {
            for (_, text) in &texts {
                let history = jepsen::parse(black_box(text)).unwrap();
                black_box(check(&history));
            }
        })
    });
    // One file alone, for comparison with the "under a second per file"
    // goal (it was the slowest before the relaxed pass existed).
    let (_, slow) = texts
        .iter()
        .find(|(name, _)| name == "etcd_002.log")
        .unwrap();
    c.bench_function("lincheck/jepsen_etcd_002", |b| {
        b.iter(|| black_box(check(&jepsen::parse(black_box(slow)).unwrap())))
    });
}

criterion_group!(benches, jepsen_etcd);
criterion_main!(benches);
