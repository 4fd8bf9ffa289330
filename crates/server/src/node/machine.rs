//! The key-value store as a ferry-runtime state machine.
//!
//! The state lives in [`SharedState`], behind one lock shared with the API:
//! the API reads it directly (after a read barrier for linearizable reads),
//! and watchers are fed by the apply under the same lock. The runtime owns
//! the write side: it calls [`KvMachine::apply`] for every committed
//! command, in order, on the group's worker.

use std::io;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, RwLock};
use std::time::Instant;

use ferry_runtime::{
    ApplyError, Command, Durability, GroupEvent, RestoreError,
    SnapshotSource as RuntimeSnapshotSource, StateMachine,
};
use ferry_storage::versions::JobLane;
use ferry_storage::{AnyDisk, Disk, DiskFile};
use tokio::sync::mpsc;

use crate::error::KvError;
use crate::kv_state::{CommandResponse, KvLimits, KvState, Reads, SnapshotSource};
use crate::state::SharedState;

/// The key-value store's replicated state machine.
pub(crate) struct KvMachine {
    state: Arc<SharedState>,
    limits: KvLimits,
    /// The clock lease deadlines are kept on (shared with the API).
    clock_origin: Instant,
    /// Where events go for the node's own task (config changes, removal).
    events: mpsc::UnboundedSender<GroupEvent>,
    /// Whether this node led the group at the last role change.
    leading: bool,
    /// Where the state lives on disk; `None` keeps it in memory only.
    home: Option<Arc<StoreHome>>,
}

/// Bytes of versions written since the last checkpoint past which the
/// state is checkpointed and flushed, however few entries that was: the
/// memtable's bound (a frozen one is held too until its flush is done).
pub const KV_FLUSH_BYTES: usize = 32 * 1024 * 1024;

/// The key-value state's directory: `CURRENT` names the store directory in
/// use (`store-<n>`), replaced atomically when a snapshot from the leader
/// brings a whole new state.
#[derive(Debug)]
pub(crate) struct StoreHome {
    disk: AnyDisk,
    root: PathBuf,
    /// The generation in use.
    generation: Mutex<u64>,
    /// Whether a thread runs the store's flushes, and one its merges (each
    /// cleared under the state lock when its lane has nothing left, so a
    /// checkpoint never misses a thread about to stop).
    flushing: AtomicBool,
    merging: AtomicBool,
    /// Shared by the jobs while they run, held alone while the whole store
    /// is swapped, so that a job never finishes on a store other than its
    /// own. Taken before the state lock, never while holding it.
    job_slot: RwLock<()>,
    /// The applied index of the last checkpoint.
    checkpointed: Mutex<u64>,
    /// Whether the last job of the store failed for want of disk space
    /// (the node raises NOSPACE on it, see the housekeeping).
    out_of_space: AtomicBool,
    /// Entries applied since the last checkpoint past which one is taken
    /// however little was written (`--snapshot-count`: the log behind it
    /// can then be compacted).
    checkpoint_entries: u64,
}

const CURRENT_FILE: &str = "CURRENT";

/// How often a defragment looks whether its merge has finished.
const DEFRAGMENT_POLL_INTERVAL: std::time::Duration = std::time::Duration::from_millis(20);

/// Polls of a defragment between two restarts of the store's job lanes.
const DEFRAGMENT_RETRY_POLLS: u64 = 50;

/// The key-value state's directory inside a data directory.
pub const KV_DIR: &str = "kv";

/// The store directory a new state under `root` (a data directory's
/// [`KV_DIR`]) starts in, before any snapshot from a leader replaced it:
/// where a backup is restored to.
pub(crate) fn first_store_dir(root: &Path) -> PathBuf {
    StoreHome::store_dir(root, 0)
}

impl StoreHome {
    fn store_dir(root: &Path, generation: u64) -> PathBuf {
        root.join(format!("store-{generation}"))
    }

    /// Opens the state under `root` (a new one if there is none).
    pub(crate) fn open(
        disk: AnyDisk,
        root: &Path,
        limits: KvLimits,
        checkpoint_entries: u64,
    ) -> Result<(StoreHome, KvState), String> {
        ferry_storage::disk::create_dir_durably(&disk, root).map_err(|e| e.to_string())?;
        let current = root.join(CURRENT_FILE);
        let generation = match disk.read_all(&current) {
            Ok(bytes) => String::from_utf8_lossy(&bytes)
                .trim()
                .parse::<u64>()
                .map_err(|_| format!("{}: not a store generation", current.display()))?,
            Err(e) if e.kind() == io::ErrorKind::NotFound => 0,
            Err(e) => return Err(format!("{}: {e}", current.display())),
        };
        let dir = StoreHome::store_dir(root, generation);
        let kv = KvState::open(disk.clone(), &dir, limits)
            .map_err(|e| format!("the key-value state in {}: {e}", dir.display()))?;
        let applied = kv.applied_index();
        Ok((
            StoreHome {
                disk,
                root: root.to_path_buf(),
                generation: Mutex::new(generation),
                flushing: AtomicBool::new(false),
                merging: AtomicBool::new(false),
                job_slot: RwLock::new(()),
                checkpointed: Mutex::new(applied),
                out_of_space: AtomicBool::new(false),
                checkpoint_entries: checkpoint_entries.max(1),
            },
            kv,
        ))
    }

    fn generation(&self) -> u64 {
        *self
            .generation
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
    }

    /// Makes `generation` the one in use, durably.
    fn switch_to(&self, generation: u64) -> io::Result<()> {
        let tmp = self.root.join("CURRENT.tmp");
        let file = self.disk.create(&tmp)?;
        file.append(generation.to_string().as_bytes())?;
        file.sync_data()?;
        self.disk.rename(&tmp, &self.root.join(CURRENT_FILE))?;
        self.disk.sync_dir(&self.root)?;
        *self
            .generation
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner()) = generation;
        Ok(())
    }

    /// Merges the whole store into one run (Defragment): every version
    /// compaction removed is dropped from disk and the space given back.
    /// Resolves once that merge has finished; a merge running already
    /// finishes first.
    pub(crate) async fn defragment(self: &Arc<Self>, state: Arc<SharedState>) {
        let ticket = {
            let mut locked = state.lock();
            let mut checkpointed = self.checkpointed.lock().unwrap_or_else(|p| p.into_inner());
            *checkpointed = locked.kv().applied_index();
            locked.request_full_merge()
        };
        self.run_jobs(state.clone());
        let mut poll = tokio::time::interval(DEFRAGMENT_POLL_INTERVAL);
        for polls in 1u64.. {
            poll.tick().await;
            if state.lock().kv().store().full_merge_done(ticket) {
                return;
            }
            // Lanes that stopped after a failed job are started again now
            // and then (they try the job again).
            if polls % DEFRAGMENT_RETRY_POLLS == 0 {
                self.run_jobs(state.clone());
            }
        }
    }

    /// Whether the store's last job failed for want of disk space.
    pub(crate) fn out_of_space(&self) -> bool {
        self.out_of_space.load(Ordering::Acquire)
    }

    fn lane_running(&self, lane: JobLane) -> &AtomicBool {
        match lane {
            JobLane::Flush => &self.flushing,
            JobLane::Merge => &self.merging,
        }
    }

    /// Runs the store's jobs, flushes and merges each on a thread of their
    /// own, until none is left, unless such threads run already. Called
    /// with the state locked (`state` is that lock's owner, for the
    /// threads).
    fn run_jobs(self: &Arc<Self>, state: Arc<SharedState>) {
        self.run_lane(JobLane::Flush, state.clone());
        self.run_lane(JobLane::Merge, state);
    }

    /// The thread of one lane: a long merge never holds up the flushes
    /// that bound the memory the store's frozen layers take.
    fn run_lane(self: &Arc<Self>, lane: JobLane, state: Arc<SharedState>) {
        if self.lane_running(lane).swap(true, Ordering::AcqRel) {
            return;
        }
        let home = self.clone();
        let name = match lane {
            JobLane::Flush => "kv-store-flush",
            JobLane::Merge => "kv-store-merge",
        };
        let spawned = std::thread::Builder::new()
            .name(name.to_string())
            .spawn(move || {
                if lane == JobLane::Merge {
                    // A merge may wait; a flush may not (the frozen
                    // layers it writes out are held in memory until then).
                    if let Err(error) = ferry_runtime::background::lower_current_thread_priority() {
                        tracing::debug!(%error, "the store's merges run at the request path's priority");
                    }
                }
                loop {
                let slot = home.job_slot.read().unwrap_or_else(|p| p.into_inner());
                let job = {
                    let mut locked = state.lock();
                    let job = locked.next_store_job(lane);
                    if job.is_none() {
                        home.lane_running(lane).store(false, Ordering::Release);
                    }
                    job
                };
                let Some(job) = job else {
                    return;
                };
                let started = Instant::now();
                let done = job.run();
                home.out_of_space.store(
                    done.as_ref().err().is_some_and(|e| e.is_out_of_space()),
                    Ordering::Release,
                );
                let write = state.lock().finish_store_job(lane, done);
                // The manifest is written without the state's lock: applies
                // go on meanwhile.
                match write.and_then(|write| {
                    write
                        .commit()
                        .map_err(|e| KvError::Storage(e.to_string()))
                }) {
                    Ok(written) => {
                        // What the store let go of is freed here, after
                        // the lock: the last handle of a run merged away
                        // closes a deleted file, slow when it is large.
                        let released = state.lock().store_manifest_written(written);
                        drop(released);
                        let seconds = started.elapsed().as_secs_f64();
                        let jobs = state.store_jobs();
                        match lane {
                            JobLane::Flush => jobs.flush_seconds.observe(seconds),
                            JobLane::Merge => jobs.merge_seconds.observe(seconds),
                        }
                    }
                    Err(error) => {
                        tracing::error!(
                            %error,
                            ?lane,
                            "a job of the key-value store failed; it is tried again at the next checkpoint"
                        );
                        home.lane_running(lane).store(false, Ordering::Release);
                        return;
                    }
                }
                drop(slot);
                if lane == JobLane::Flush {
                    // A new run may make a merge due. (Without the state's
                    // lock: the run is installed, so a merge thread either
                    // sees it or has already said it stops.)
                    home.run_lane(JobLane::Merge, state.clone());
                }
                }
            });
        if let Err(error) = spawned {
            tracing::error!(%error, ?lane, "cannot start a thread for the key-value store's jobs");
            self.lane_running(lane).store(false, Ordering::Release);
        }
    }
}

impl KvMachine {
    pub(crate) fn new(
        state: Arc<SharedState>,
        limits: KvLimits,
        clock_origin: Instant,
        events: mpsc::UnboundedSender<GroupEvent>,
    ) -> KvMachine {
        KvMachine {
            state,
            limits,
            clock_origin,
            events,
            leading: false,
            home: None,
        }
    }

    /// The machine over a state kept on disk in `home`.
    pub(crate) fn on_disk(mut self, home: Arc<StoreHome>) -> KvMachine {
        self.home = Some(home);
        self
    }

    /// Checkpoints the state for a flush when enough was written since the
    /// last one, and has the flush run off the apply path.
    fn maybe_checkpoint(&self, state: &mut crate::state::StateMachine) {
        let Some(home) = &self.home else {
            return;
        };
        let applied = state.kv().applied_index();
        let mut checkpointed = home.checkpointed.lock().unwrap_or_else(|p| p.into_inner());
        let due = state.kv().unflushed_bytes() >= KV_FLUSH_BYTES
            || applied.saturating_sub(*checkpointed) >= home.checkpoint_entries;
        if !due {
            return;
        }
        state.checkpoint();
        *checkpointed = applied;
        drop(checkpointed);
        home.run_jobs(self.state.clone());
    }

    fn now_ms(&self) -> u64 {
        u64::try_from(self.clock_origin.elapsed().as_millis()).unwrap_or(u64::MAX)
    }
}

/// A consistent view of the key-value state: shared pointers to its
/// versions, encoded on the runtime's blocking thread; or why none could
/// be taken.
enum KvSnapshot {
    Ready(Box<SnapshotSource>),
    Failed(String),
}

impl RuntimeSnapshotSource for KvSnapshot {
    fn write_to(&mut self, out: &mut dyn io::Write) -> io::Result<u64> {
        match self {
            KvSnapshot::Ready(source) => source.write_to(|piece| out.write_all(piece)),
            KvSnapshot::Failed(reason) => Err(io::Error::other(reason.clone())),
        }
    }
}

impl StateMachine for KvMachine {
    type Response = Result<CommandResponse, KvError>;
    type Query = ();
    type QueryResponse = ();

    fn apply(&mut self, command: Command<'_>) -> Result<Self::Response, ApplyError> {
        let now_ms = self.now_ms();
        // Read results are built only where a client waits for them; on
        // every other member (and on a replay after a restart) they would
        // be thrown away, and a txn of large ranges would cost every member
        // its memory for nothing.
        let reads = if command.answered {
            Reads::Build
        } else {
            Reads::SizeOnly
        };
        let mut state = self.state.lock();
        let applied = state.apply_bytes_with(command.index, command.data, reads);
        if let Err(KvError::Storage(reason)) = &applied.response {
            // The store could not be read or written here: the command is
            // not applied on this member, which stops the group until a
            // restart applies it again (answering the error instead would
            // leave this member without a write the others have).
            return Err(ApplyError::new(format!("the key-value store: {reason}")));
        }
        state.sync_lease_clock(now_ms);
        self.maybe_checkpoint(&mut state);
        Ok(applied.response)
    }

    fn durability(&self) -> Durability {
        if self.home.is_some() {
            Durability::Durable
        } else {
            Durability::InMemory
        }
    }

    fn durable_index(&self) -> u64 {
        self.state.lock().kv().durable_index()
    }

    fn applied_index(&self) -> u64 {
        self.state.lock().kv().applied_index()
    }

    fn query(&self, (): ()) {}

    fn snapshot(&self) -> Box<dyn RuntimeSnapshotSource> {
        let state = self.state.lock();
        if self.home.is_none() {
            return Box::new(KvSnapshot::Ready(Box::new(state.snapshot_source())));
        }
        // On disk, a follower is sent the state at the durable point: it
        // skips the entries that state holds, and those it skips are only
        // what every reopen of the leader would find applied too.
        match state.durable_snapshot_source() {
            Ok(source) => Box::new(KvSnapshot::Ready(Box::new(source))),
            Err(error) => Box::new(KvSnapshot::Failed(error.to_string())),
        }
    }

    fn restore(&mut self, snapshot: &mut dyn io::Read) -> Result<(), RestoreError> {
        let Some(home) = &self.home else {
            // Decoded without the lock (this runs on a blocking thread);
            // only the swap holds it. The replaced state is freed here too.
            let kv = KvState::restore_from(snapshot, self.limits.clone())
                .map_err(|error| RestoreError::new(error.to_string()))?;
            let replaced = self.state.lock().install(kv);
            drop(replaced);
            return Ok(());
        };
        // On disk: the snapshot is written as it is read into a new store
        // directory, made durable there, then named in CURRENT; no job of
        // the old store runs meanwhile.
        let _slot = home.job_slot.write().unwrap_or_else(|p| p.into_inner());
        let old = home.generation();
        let next = old + 1;
        let dir = StoreHome::store_dir(&home.root, next);
        let kv = KvState::restore_into(snapshot, home.disk.clone(), &dir, self.limits.clone())
            .map_err(|error| RestoreError::new(error.to_string()))?;
        home.switch_to(next).map_err(|error| {
            RestoreError::new(format!("switching to {}: {error}", dir.display()))
        })?;
        *home.checkpointed.lock().unwrap_or_else(|p| p.into_inner()) = kv.applied_index();
        let replaced = self.state.lock().install(kv);
        drop(replaced);
        // The old store's files are no longer read by anyone.
        let old_dir = StoreHome::store_dir(&home.root, old);
        if let Ok(files) = home.disk.list_files(&old_dir) {
            for name in files {
                let _ = home.disk.remove_file(&old_dir.join(name));
            }
        }
        Ok(())
    }

    fn on_event(&mut self, event: &GroupEvent) {
        match event {
            GroupEvent::RoleChanged { role, .. } => {
                let leading = *role == ferry_raft::Role::Leader;
                if self.leading && !leading {
                    // Lease deadlines are the leader's; a new leader starts
                    // them afresh.
                    self.state.lock().lease_clock.reset();
                }
                self.leading = leading;
            }
            GroupEvent::Removed | GroupEvent::Halted(_) => {
                // The view says so already: watch streams that wake now end.
                self.state.lock().watches.wake_all();
            }
            GroupEvent::ConfigChanged(_) => {}
        }
        let _ = self.events.send(event.clone());
    }
}
