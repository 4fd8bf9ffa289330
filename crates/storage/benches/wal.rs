//! Group commit against the raw floor, and recovery time of a large log.
//!
//! `cargo bench -p ferry-storage -- --warm-up-time 1 --measurement-time 3`
//!
//! - `append_sync/groups=N`: every one of N groups appends one entry
//!   (256-byte command), then one sync covers them all. Throughput is in
//!   appends per second.
//! - `raw_floor/write+fdatasync`: a loop of write + fdatasync of one record of
//!   the same size, in the same directory: what each append would cost if it
//!   were synced on its own. The ratio of the two is what group commit buys.
//! - `append_sync_pipelined/groups=N` (10, 1000): the same, with the fdatasync on a
//!   worker thread while the next batch is appended.
//! - `recovery/MiB=S`: opening a log of S MiB (default 1024; set
//!   `FERRY_BENCH_RECOVERY_MIB`) written by 100 groups with 1 KiB entries.
//!   The file is in the page cache (the machine has the memory), so this
//!   measures replay, not the disk's read speed.
//!
//! Figures from one run (2026-11-29; 2 vCPU AMD EPYC VM, 23 GiB RAM, ext4 on
//! a virtio disk shared with other builds, so expect ±20% between runs):
//!
//! | benchmark | time per iteration | appends/s | vs. floor |
//! | --- | --- | --- | --- |
//! | raw_floor (write + fdatasync) | 3.59 ms | 278 | 1x |
//! | append_sync, 1 group | 4.07 ms | 246 | 0.9x |
//! | append_sync, 10 groups | 4.90 ms | 2,041 | 7.3x |
//! | append_sync, 1000 groups | 5.81 ms | 172,230 | 619x |
//! | append_sync_pipelined, 10 groups | 3.80 ms | 2,632 | 9.5x |
//! | append_sync_pipelined, 1000 groups | 2.86 ms | 349,150 | 1,254x |
//!
//! Recovery of a 1015 MiB log (100 groups, about a million 1 KiB entries): 1.55 s
//! (655 MiB/s).

use std::collections::BTreeMap;
use std::hint::black_box;
use std::io::Write;

use bytes::Bytes;
use criterion::{criterion_group, criterion_main, BenchmarkId, Criterion, Throughput};
use ferry_raft::{Entry, EntryPayload, HardState, PersistRequest};
use ferry_storage::{unique_temp_dir, FsDisk, PendingSync, Wal, WalOptions};

const PAYLOAD_BYTES: usize = 256;

fn entry(index: u64, payload: &Bytes) -> Entry {
    Entry {
        term: 1,
        index,
        payload: EntryPayload::Command(payload.clone()),
    }
}

fn append_sync(c: &mut Criterion) {
    // The floor: one write + fdatasync per record of the same framed size.
    let mut group = c.benchmark_group("raw_floor");
    let dir = unique_temp_dir("bench-floor");
    std::fs::create_dir_all(&dir).unwrap();
    let mut file = std::fs::File::create(dir.join("floor")).unwrap();
    let record = vec![7u8; PAYLOAD_BYTES + 8 + 34];
    group.throughput(Throughput::Elements(1));
    group.bench_function("write+fdatasync", |b| {
        b.iter(|| {
            file.write_all(&record).unwrap();
            file.sync_data().unwrap();
        })
    });
    drop(file);
    let _ = std::fs::remove_dir_all(&dir);
    group.finish();

    let payload = Bytes::from(vec![7u8; PAYLOAD_BYTES]);
    let mut group = c.benchmark_group("append_sync");
    for groups in [1u64, 10, 1000] {
        let dir = unique_temp_dir("bench-append");
        let (mut wal, _) =
            Wal::open(FsDisk, &dir, WalOptions::default(), &BTreeMap::new()).unwrap();
        let mut next = vec![1u64; groups as usize + 1];
        group.throughput(Throughput::Elements(groups));
        group.bench_function(
            BenchmarkId::from_parameter(format!("groups={groups}")),
            |b| {
                b.iter(|| {
                    for g in 1..=groups {
                        let index = next[g as usize];
                        next[g as usize] += 1;
                        let req = PersistRequest {
                            seq: index,
                            hard_state: None,
                            entries: vec![entry(index, &payload)],
                        };
                        wal.append(g, &req).unwrap();
                    }
                    black_box(wal.sync().unwrap());
                })
            },
        );
        drop(wal);
        let _ = std::fs::remove_dir_all(&dir);
    }
    group.finish();

    // The same with the sync on a worker thread: batch k+1 is appended while
    // the fdatasync of batch k is in flight.
    let mut group = c.benchmark_group("append_sync_pipelined");
    for groups in [10u64, 1000] {
        let dir = unique_temp_dir("bench-pipelined");
        let (mut wal, _) =
            Wal::open(FsDisk, &dir, WalOptions::default(), &BTreeMap::new()).unwrap();
        let (to_worker, worker_rx) = std::sync::mpsc::sync_channel::<PendingSync<FsDisk>>(1);
        let (worker_tx, from_worker) = std::sync::mpsc::sync_channel(1);
        let worker = std::thread::spawn(move || {
            for pending in worker_rx {
                let outcome = pending.execute();
                if worker_tx.send((pending, outcome)).is_err() {
                    break;
                }
            }
        });
        let mut in_flight = false;
        let mut next = vec![1u64; groups as usize + 1];
        group.throughput(Throughput::Elements(groups));
        group.bench_function(
            BenchmarkId::from_parameter(format!("groups={groups}")),
            |b| {
                b.iter(|| {
                    for g in 1..=groups {
                        let index = next[g as usize];
                        next[g as usize] += 1;
                        let req = PersistRequest {
                            seq: index,
                            hard_state: None,
                            entries: vec![entry(index, &payload)],
                        };
                        wal.append(g, &req).unwrap();
                    }
                    if in_flight {
                        let (pending, outcome) = from_worker.recv().unwrap();
                        black_box(wal.complete_sync(pending, outcome).unwrap());
                    }
                    let pending = wal.prepare_sync().unwrap().unwrap();
                    to_worker.send(pending).unwrap();
                    in_flight = true;
                })
            },
        );
        if in_flight {
            let (pending, outcome) = from_worker.recv().unwrap();
            wal.complete_sync(pending, outcome).unwrap();
        }
        drop(to_worker);
        worker.join().unwrap();
        drop(wal);
        let _ = std::fs::remove_dir_all(&dir);
    }
    group.finish();
}

fn recovery(c: &mut Criterion) {
    let mib: u64 = std::env::var("FERRY_BENCH_RECOVERY_MIB")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(1024);
    let dir = unique_temp_dir("bench-recovery");
    let payload = Bytes::from(vec![3u8; 1024]);
    let groups = 100u64;
    let per_append = 64u64;
    {
        let (mut wal, _) =
            Wal::open(FsDisk, &dir, WalOptions::default(), &BTreeMap::new()).unwrap();
        let mut written = 0u64;
        let mut next = vec![1u64; groups as usize + 1];
        let target = mib * 1024 * 1024;
        while written < target {
            for g in 1..=groups {
                let first = next[g as usize];
                next[g as usize] += per_append;
                let req = PersistRequest {
                    seq: first,
                    hard_state: Some(HardState {
                        term: 1,
                        vote: Some(1),
                        commit: first.saturating_sub(1),
                    }),
                    entries: (first..first + per_append)
                        .map(|i| entry(i, &payload))
                        .collect(),
                };
                wal.append(g, &req).unwrap();
                written += per_append * (1024 + 34);
            }
            wal.sync().unwrap();
        }
    }
    let bytes: u64 = std::fs::read_dir(&dir)
        .unwrap()
        .map(|e| e.unwrap().metadata().unwrap().len())
        .sum();
    let mut group = c.benchmark_group("recovery");
    group.sample_size(10);
    group.throughput(Throughput::Bytes(bytes));
    group.bench_function(
        BenchmarkId::from_parameter(format!("MiB={}", bytes / (1024 * 1024))),
        |b| {
            b.iter(|| {
                let (wal, report) =
                    Wal::open(FsDisk, &dir, WalOptions::default(), &BTreeMap::new()).unwrap();
                assert_eq!(report.groups.len(), groups as usize);
                black_box((wal, report))
            })
        },
    );
    group.finish();
    let _ = std::fs::remove_dir_all(&dir);
}

criterion_group!(benches, append_sync, recovery);
criterion_main!(benches);
