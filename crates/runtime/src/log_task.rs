//! The task that owns the node's storage: one write-ahead log for every
//! group, with group commit, and the groups' snapshot files.
//!
//! Workers send it what their engines asked for ([`LogRequest`]); it
//! appends as they come and keeps one sync in flight: while a sync runs on
//! a blocking thread, appends from every group go on, and the next sync
//! covers them all. When a sync completes, each group whose writes it
//! covered is told how far it is durable ([`Completion::Persisted`]).
//!
//! Workers wait when its queue is full (the log is the node's bottleneck
//! and that is the right place for back pressure); it never waits on a
//! worker: completions go on unbounded queues, whose length is bounded by
//! what was asked (one `Persisted` per group per sync, one answer per
//! request).

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use bytes::Bytes;
use tokio::sync::mpsc;

use ferry_raft::{Entry, GroupId, Index, NodeId, PersistRequest, SnapshotMeta, Term};
use ferry_storage::{FsDisk, GroupRecovery, PendingSync, SnapshotWriter, Storage, StorageError};

use crate::machine::SnapshotSource;
use crate::metrics::HostMetrics;
use crate::worker::{Completion, Workers};

/// What a worker asks of the storage.
pub(crate) enum LogRequest {
    /// Append an engine's persist request (hard state and entries).
    Append {
        group: GroupId,
        request: PersistRequest,
    },
    /// Compact a group's log through an index (its snapshot covers it).
    Compact { group: GroupId, through: Index },
    /// Read a chunk of a group's snapshot for a follower.
    ReadChunk {
        group: GroupId,
        to: NodeId,
        snapshot_index: Index,
        offset: u64,
        max_bytes: u64,
    },
    /// Read log entries of a group for a follower (evicted from the
    /// engine's memory), answered with [`Completion::EntriesLoaded`].
    ReadEntries {
        group: GroupId,
        to: NodeId,
        term: Term,
        from: Index,
        through: Index,
        max_bytes: u64,
    },
    /// Read a group's whole snapshot (to restore its machine at start).
    ReadSnapshot {
        group: GroupId,
        index: Index,
        reply: tokio::sync::oneshot::Sender<Result<Option<Vec<u8>>, StorageError>>,
    },
    /// Write a local snapshot of a group's machine from a consistent view.
    TakeSnapshot {
        group: GroupId,
        meta: SnapshotMeta,
        source: Box<dyn SnapshotSource>,
    },
    /// Write a chunk of a snapshot arriving from the leader.
    SaveChunk {
        group: GroupId,
        meta: SnapshotMeta,
        offset: u64,
        data: Bytes,
        done: bool,
    },
    /// Install the received snapshot (its machine restored from it): the
    /// group's log is reset to it, durably with the next sync.
    InstallReceived { group: GroupId, offset: u64 },
    /// Forget a received snapshot (it did not restore).
    AbandonReceived { group: GroupId },
    /// What a stopped group's storage holds, to start it again from; answered
    /// once everything written for it is synced.
    Recover {
        group: GroupId,
        reply: tokio::sync::oneshot::Sender<Result<Option<GroupRecovery>, StorageError>>,
    },
    /// Delete a group's log and snapshots.
    RemoveGroup {
        group: GroupId,
        reply: tokio::sync::oneshot::Sender<Result<(), StorageError>>,
    },
}

/// What the log task hands back to itself from blocking threads.
enum Finished {
    /// A sync ran, taking this long.
    Synced(PendingSync<FsDisk>, std::io::Result<()>, Duration),
    /// A local snapshot's data was written and sealed (or not), taking
    /// this long.
    SnapshotWritten {
        writer: SnapshotWriter<FsDisk>,
        outcome: Result<u64, StorageError>,
        took: Duration,
    },
    /// A received snapshot's file was sealed (or not).
    ReceivedSealed {
        writer: SnapshotWriter<FsDisk>,
        outcome: Result<(), StorageError>,
        offset: u64,
    },
}

/// What is answered once the writes before it are synced.
enum AfterSync {
    /// A received snapshot was installed: its log reset is durable.
    Installed {
        group: GroupId,
        index: Index,
        offset: u64,
    },
    /// A stopped group's state is asked for.
    Recover {
        group: GroupId,
        reply: tokio::sync::oneshot::Sender<Result<Option<GroupRecovery>, StorageError>>,
    },
}

impl AfterSync {
    fn answer(self, storage: &Storage<FsDisk>, workers: &Workers) {
        match self {
            AfterSync::Installed {
                group,
                index,
                offset,
            } => workers.complete(group, Completion::Installed { index, offset }),
            AfterSync::Recover { group, reply } => {
                let _ = reply.send(recovery(storage, group));
            }
        }
    }
}

/// A group's durable state as the storage holds it now (all synced).
fn recovery(
    storage: &Storage<FsDisk>,
    group: GroupId,
) -> Result<Option<GroupRecovery>, StorageError> {
    let snapshot = storage.snapshots.latest(group).cloned();
    let Some(hard_state) = storage.wal.hard_state(group) else {
        return Ok(snapshot.map(|snapshot| GroupRecovery {
            snapshot: Some(snapshot),
            ..GroupRecovery::default()
        }));
    };
    let entries = match (
        storage.wal.first_index(group),
        storage.wal.last_index(group),
    ) {
        (Some(first), Some(last)) if first <= last => {
            storage
                .wal
                .entries(group, first, last.saturating_add(1), u64::MAX)?
        }
        _ => Vec::new(),
    };
    Ok(Some(GroupRecovery {
        hard_state,
        snapshot,
        entries,
    }))
}

/// Entries `from..=through` of `group`'s log (at most about `max_bytes`,
/// at least one), from the log's cache or its segments; `None` if the log
/// no longer holds `from` (compacted since the engine asked).
fn read_entries(
    storage: &Storage<FsDisk>,
    group: GroupId,
    from: Index,
    through: Index,
    max_bytes: u64,
) -> Result<Option<Vec<Entry>>, StorageError> {
    let wal = &storage.wal;
    let (Some(first), Some(last)) = (wal.first_index(group), wal.last_index(group)) else {
        return Ok(None);
    };
    if from < first || from > last || through < from {
        return Ok(None);
    }
    let hi = through.min(last).saturating_add(1);
    wal.entries(group, from, hi, max_bytes).map(Some)
}

/// The file of the snapshot each group is receiving from its leader.
type Receiving = BTreeMap<GroupId, SnapshotWriter<FsDisk>>;

/// Why the log task stopped: the storage failed in a way that loses
/// durability (a failed write or sync), and every group on the node must
/// stop.
#[derive(Debug, thiserror::Error)]
#[error("storage failed: {0}; the node cannot go on without losing durability")]
pub struct LogFailed(#[from] pub StorageError);

/// Counters of what the log did, for figures and status.
#[derive(Debug, Default)]
pub struct LogCounters {
    /// Syncs completed.
    pub syncs: AtomicU64,
    /// Persist requests appended (one per group step that wrote).
    pub appends: AtomicU64,
    /// Entries appended.
    pub entries: AtomicU64,
    /// Entries read back from the log for leaders that no longer held them
    /// in memory (`Options::log_memory_bytes_max`).
    pub entries_loaded: AtomicU64,
}

/// Storage shortages the log waits out, in words, for the host's status.
#[derive(Debug, Default)]
pub(crate) struct Troubles {
    /// The log cannot start a new segment and writes on in the current one.
    rotation: std::sync::Mutex<Option<String>>,
    /// Groups whose last local snapshot could not be written, and why.
    snapshots: std::sync::Mutex<BTreeMap<GroupId, String>>,
    /// The log cannot write what it holds (its disk is full), and why.
    writes: std::sync::Mutex<Option<String>>,
}

/// How long the log waits before it tries again to write what a full disk
/// refused.
const LOG_WRITE_RETRY: Duration = Duration::from_millis(500);

impl Troubles {
    pub(crate) fn list(&self) -> Vec<String> {
        let mut list: Vec<String> = lock(&self.writes).iter().cloned().collect();
        list.extend(lock(&self.rotation).iter().cloned());
        list.extend(lock(&self.snapshots).iter().map(|(group, error)| {
            format!("storage: group {group}: cannot take a snapshot: {error}")
        }));
        list
    }

    fn watch_rotation(&self, storage: &Storage<FsDisk>) {
        let now = storage.wal.rotation_deferred().map(|error| {
            format!(
                "storage: cannot start a new log segment, writing on in the current one: {error}"
            )
        });
        let mut rotation = lock(&self.rotation);
        if *rotation != now {
            match &now {
                Some(text) => tracing::warn!("{text}; retrying as the segment grows"),
                None => tracing::info!("the log starts new segments again"),
            }
            *rotation = now;
        }
    }

    pub(crate) fn disk_full(&self) -> bool {
        lock(&self.writes).is_some()
    }

    fn writes(&self, error: Option<&StorageError>) {
        let now = error.map(|error| {
            format!("storage: the log cannot write (it waits, taking no new work, and tries again): {error}")
        });
        let mut writes = lock(&self.writes);
        if *writes != now {
            match &now {
                Some(text) => tracing::error!("{text}"),
                None => tracing::info!("the log writes again"),
            }
            *writes = now;
        }
    }

    fn snapshot(&self, group: GroupId, error: Option<String>) {
        let mut snapshots = lock(&self.snapshots);
        match error {
            Some(error) => snapshots.insert(group, error),
            None => snapshots.remove(&group),
        };
    }
}

fn lock<T>(mutex: &std::sync::Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    mutex
        .lock()
        .unwrap_or_else(|poisoned| poisoned.into_inner())
}

/// Runs the log until every sender is gone, or the storage fails.
pub(crate) async fn run(
    mut storage: Storage<FsDisk>,
    mut requests: mpsc::Receiver<LogRequest>,
    workers: Workers,
    counters: Arc<LogCounters>,
    troubles: Arc<Troubles>,
    metrics: Arc<HostMetrics>,
    mut shutdown: tokio::sync::watch::Receiver<bool>,
) -> Result<(), LogFailed> {
    let (finished_tx, mut finished) = mpsc::unbounded_channel::<Finished>();
    let mut sync_in_flight = false;
    let mut receiving = Receiving::new();
    // What waits for the sync in flight to complete.
    let mut after_sync: Vec<AfterSync> = Vec::new();
    // What waits for a sync that starts after it was asked.
    let mut waiting: Vec<AfterSync> = Vec::new();
    let mut requests_open = true;
    // Set while the disk is full: the log holds what it could not write
    // (nothing it acknowledged), takes no new requests (their senders
    // wait: back pressure), and tries again at this time.
    let mut write_retry_at: Option<tokio::time::Instant> = None;
    loop {
        if !sync_in_flight && write_retry_at.is_none() {
            match storage.wal.prepare_sync() {
                Err(error) if error.is_transient() => {
                    troubles.writes(Some(&error));
                    write_retry_at = Some(tokio::time::Instant::now() + LOG_WRITE_RETRY);
                }
                Err(error) => return Err(error.into()),
                Ok(Some(pending)) => {
                    troubles.writes(None);
                    sync_in_flight = true;
                    after_sync.append(&mut waiting);
                    let done = finished_tx.clone();
                    let workers = workers.clone();
                    tokio::task::spawn_blocking(move || {
                        let started = Instant::now();
                        let outcome = pending.execute();
                        let took = started.elapsed();
                        // The groups hear that their writes are durable
                        // from here, not after a hop through this task: a
                        // write waits for it (a follower's acknowledgment,
                        // a leader's commit), and a wake-up of an idle
                        // thread costs tens of microseconds. The task's
                        // own bookkeeping follows; what it answers after
                        // a sync still comes after these.
                        if outcome.is_ok() {
                            for (&group, &seq) in pending.seqs() {
                                workers.complete(group, Completion::Persisted { seq });
                            }
                        }
                        let _ = done.send(Finished::Synced(pending, outcome, took));
                    });
                }
                Ok(None) => {
                    troubles.writes(None);
                    // Nothing unsynced: what waits is durable already.
                    for done in waiting.drain(..) {
                        done.answer(&storage, &workers);
                    }
                }
            }
        }
        if !requests_open && !sync_in_flight {
            break;
        }
        tokio::select! {
            biased;
            Some(done) = finished.recv() => match done {
                Finished::Synced(pending, outcome, took) => {
                    sync_in_flight = false;
                    // The groups were told on the blocking thread.
                    storage.wal.complete_sync(pending, outcome)?;
                    counters.syncs.fetch_add(1, Ordering::Relaxed);
                    metrics.log_sync_seconds.observe(took.as_secs_f64());
                    troubles.watch_rotation(&storage);
                    for done in after_sync.drain(..) {
                        done.answer(&storage, &workers);
                    }
                }
                Finished::SnapshotWritten { writer, outcome, took } => {
                    let group = writer.group();
                    let index = writer.meta().index;
                    let outcome = outcome.and_then(|bytes| {
                        storage.save_snapshot(writer).map(|_| bytes)
                    });
                    match outcome {
                        Ok(bytes) => {
                            metrics.snapshot_write_seconds.observe(took.as_secs_f64());
                            troubles.snapshot(group, None);
                            workers.complete(group, Completion::SnapshotTaken { index, bytes })
                        }
                        Err(error) if error.is_transient() => {
                            troubles.snapshot(group, Some(error.to_string()));
                            workers.complete(group, Completion::SnapshotFailed { index, error: error.to_string() })
                        }
                        Err(error) => return Err(error.into()),
                    }
                }
                Finished::ReceivedSealed { writer, outcome, offset } => {
                    let group = writer.group();
                    let index = writer.meta().index;
                    // Sealed: the machine restores from the file itself.
                    let received = outcome.and_then(|()| writer.data_reader());
                    let received = match received {
                        Ok(reader) => {
                            receiving.insert(group, writer);
                            Some(Box::new(reader))
                        }
                        Err(error) if error.is_transient() => {
                            storage.abandon_snapshot(writer);
                            None
                        }
                        Err(error) => return Err(error.into()),
                    };
                    let ok = received.is_some();
                    workers.complete(group, Completion::ChunkSaved { index, offset, ok, last: true, received });
                }
            },
            () = sleep_until_some(write_retry_at) => write_retry_at = None,
            _ = shutdown.wait_for(|stop| *stop), if requests_open => requests_open = false,
            request = requests.recv(), if requests_open && write_retry_at.is_none() => match request {
                None => requests_open = false,
                Some(request) => {
                    if let LogRequest::Append { request, .. } = &request {
                        counters.appends.fetch_add(1, Ordering::Relaxed);
                        counters.entries.fetch_add(request.entries.len() as u64, Ordering::Relaxed);
                    }
                    handle(
                    &mut storage,
                    request,
                    &workers,
                    &finished_tx,
                    &mut receiving,
                    &mut waiting,
                    &counters,
                    )?
                }
            },
        }
    }
    storage.wal.sync()?;
    Ok(())
}

/// Resolves at `at`, or never when there is none.
async fn sleep_until_some(at: Option<tokio::time::Instant>) {
    match at {
        Some(at) => tokio::time::sleep_until(at).await,
        None => std::future::pending().await,
    }
}

fn handle(
    storage: &mut Storage<FsDisk>,
    request: LogRequest,
    workers: &Workers,
    finished: &mpsc::UnboundedSender<Finished>,
    receiving: &mut Receiving,
    waiting: &mut Vec<AfterSync>,
    counters: &LogCounters,
) -> Result<(), LogFailed> {
    match request {
        LogRequest::Append { group, request } => storage.wal.append(group, &request)?,
        LogRequest::Compact { group, through } => storage.wal.compact(group, through)?,
        LogRequest::ReadChunk {
            group,
            to,
            snapshot_index,
            offset,
            max_bytes,
        } => {
            match storage
                .snapshots
                .read_chunk(group, snapshot_index, offset, max_bytes)
            {
                Ok(chunk) => workers.complete(
                    group,
                    Completion::ChunkLoaded {
                        to,
                        snapshot_index,
                        offset,
                        chunk,
                    },
                ),
                // Not answered: the engine asks again after its chunk
                // timeout.
                Err(error) if error.is_transient() => {
                    tracing::warn!(group, %error, "cannot read a snapshot chunk for now");
                }
                Err(error) => return Err(error.into()),
            }
        }
        LogRequest::ReadEntries {
            group,
            to,
            term,
            from,
            through,
            max_bytes,
        } => match read_entries(storage, group, from, through, max_bytes) {
            Ok(entries) => {
                let count = entries.as_ref().map_or(0, Vec::len) as u64;
                counters.entries_loaded.fetch_add(count, Ordering::Relaxed);
                workers.complete(
                    group,
                    Completion::EntriesLoaded {
                        to,
                        term,
                        from,
                        entries,
                    },
                )
            }
            // Not answered: the engine asks again with its next probe.
            Err(error) if error.is_transient() => {
                tracing::warn!(group, %error, "cannot read log entries for now");
            }
            Err(error) => return Err(error.into()),
        },
        LogRequest::ReadSnapshot {
            group,
            index,
            reply,
        } => {
            let _ = reply.send(storage.snapshots.read_all(group, index));
        }
        LogRequest::TakeSnapshot {
            group,
            meta,
            mut source,
        } => {
            let index = meta.index;
            let mut writer = match storage.begin_snapshot(group, meta) {
                Ok(writer) => writer,
                Err(error) if error.is_transient() => {
                    workers.complete(
                        group,
                        Completion::SnapshotFailed {
                            index,
                            error: error.to_string(),
                        },
                    );
                    return Ok(());
                }
                Err(error) => return Err(error.into()),
            };
            let done = finished.clone();
            tokio::task::spawn_blocking(move || {
                let started = Instant::now();
                let outcome = write_source(&mut *source, &mut writer).and_then(|bytes| {
                    writer.seal()?;
                    Ok(bytes)
                });
                let took = started.elapsed();
                tracing::debug!(
                    group,
                    index,
                    ms = took.as_millis() as u64,
                    "wrote a snapshot"
                );
                let _ = done.send(Finished::SnapshotWritten {
                    writer,
                    outcome,
                    took,
                });
            });
        }
        LogRequest::SaveChunk {
            group,
            meta,
            offset,
            data,
            done,
        } => {
            let index = meta.index;
            // Answers every chunk but a last one written (that one is
            // answered once its file is sealed).
            let answer = |ok: bool| {
                workers.complete(
                    group,
                    Completion::ChunkSaved {
                        index,
                        offset,
                        ok,
                        last: done,
                        received: None,
                    },
                )
            };
            if offset == 0 {
                if let Some(old) = receiving.remove(&group) {
                    storage.abandon_snapshot(old);
                }
                match storage.begin_snapshot(group, meta) {
                    Ok(writer) => {
                        receiving.insert(group, writer);
                    }
                    Err(error) if error.is_transient() => {
                        answer(false);
                        return Ok(());
                    }
                    Err(error) => return Err(error.into()),
                }
            }
            // A chunk of a transfer other than the one being written (its
            // start was lost) is refused: the leader starts over.
            let Some(mut writer) = receiving.remove(&group) else {
                answer(false);
                return Ok(());
            };
            if writer.meta().index != index {
                receiving.insert(group, writer);
                answer(false);
                return Ok(());
            }
            // Any error here concerns only the file being received, which
            // is not part of the store yet: the transfer is refused and the
            // leader starts over.
            match writer.write(offset, &data) {
                // The last chunk: sealed (a sync of the whole file) on a
                // blocking thread, answered when that is done.
                Ok(()) if done => {
                    let finished = finished.clone();
                    tokio::task::spawn_blocking(move || {
                        let outcome = writer.seal();
                        let _ = finished.send(Finished::ReceivedSealed {
                            writer,
                            outcome,
                            offset,
                        });
                    });
                }
                Ok(()) => {
                    receiving.insert(group, writer);
                    answer(true);
                }
                Err(error) => {
                    tracing::warn!(group, index, offset, %error, "could not save a snapshot chunk; the leader will start over");
                    storage.abandon_snapshot(writer);
                    answer(false);
                }
            }
        }
        LogRequest::InstallReceived { group, offset } => {
            let Some(writer) = receiving.remove(&group) else {
                return Ok(());
            };
            let index = writer.meta().index;
            storage.install_snapshot(writer)?;
            waiting.push(AfterSync::Installed {
                group,
                index,
                offset,
            });
        }
        LogRequest::AbandonReceived { group } => {
            if let Some(writer) = receiving.remove(&group) {
                storage.abandon_snapshot(writer);
            }
        }
        LogRequest::Recover { group, reply } => waiting.push(AfterSync::Recover { group, reply }),
        LogRequest::RemoveGroup { group, reply } => {
            if let Some(writer) = receiving.remove(&group) {
                storage.abandon_snapshot(writer);
            }
            let outcome = storage.remove_group(group).map(|_| ());
            let _ = reply.send(outcome);
        }
    }
    Ok(())
}

/// Writes a machine's snapshot into a snapshot file, in the pieces the
/// machine writes.
fn write_source(
    source: &mut dyn SnapshotSource,
    writer: &mut SnapshotWriter<FsDisk>,
) -> Result<u64, StorageError> {
    struct Adapter<'a> {
        writer: &'a mut SnapshotWriter<FsDisk>,
        error: Option<StorageError>,
    }
    impl std::io::Write for Adapter<'_> {
        fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
            let offset = self.writer.data_bytes();
            match self.writer.write(offset, buf) {
                Ok(()) => Ok(buf.len()),
                Err(error) => {
                    let text = error.to_string();
                    self.error = Some(error);
                    Err(std::io::Error::other(text))
                }
            }
        }
        fn flush(&mut self) -> std::io::Result<()> {
            Ok(())
        }
    }
    let writer_group = writer.group();
    let mut adapter = Adapter {
        writer,
        error: None,
    };
    match source.write_to(&mut adapter) {
        Ok(bytes) => Ok(bytes),
        Err(error) => Err(adapter.error.take().unwrap_or_else(|| StorageError::Io {
            op: "write the snapshot of",
            path: std::path::PathBuf::from(format!("group {}", writer_group)),
            source: error,
        })),
    }
}
