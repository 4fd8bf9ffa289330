//! One node's key-value state: the replicated state machine, the watch hub
//! fed by it, the leader-clock lease deadlines and the simple auth tokens
//! the log handed out, behind one lock so that
//! an apply and the watcher notification it causes are one atomic step (a
//! watcher created between them could otherwise miss or repeat a revision).

use std::sync::{Mutex, MutexGuard};

use bytes::Bytes;
use ferry_runtime::metrics::disk_histogram;
use ferry_runtime::prometheus_client::metrics::histogram::Histogram;
use ferry_storage::versions::JobLane;

use crate::auth_token::SimpleTokenTable;
use crate::command::{decode_command, CommandKind};
use crate::error::{CodecError, KvError};
use crate::kv_state::{Applied, CommandResponse, KvLimits, KvState, Reads, SnapshotSource};
use crate::lease::LeaseClock;
use crate::mvcc::{RangeScan, ReadAt};
use crate::pb::etcdserverpb::{RangeRequest, RangeResponse, ResponseHeader, WatchCreateRequest};
use crate::pb::ferrypb::{Command, WatchResponseWire};
use crate::watch::{StreamId, WatchHub, WatchLimits};

/// The state machine with its watchers and lease clock.
#[derive(Debug)]
pub struct StateMachine {
    kv: KvState,
    /// Watchers on this node.
    pub watches: WatchHub,
    /// Lease deadlines; authoritative only on the leader.
    pub lease_clock: LeaseClock,
    /// The simple auth tokens this member holds (see [`SimpleTokenTable`]).
    pub tokens: SimpleTokenTable,
}

impl StateMachine {
    /// An empty state machine.
    pub fn new(kv_limits: KvLimits, watch_limits: WatchLimits) -> StateMachine {
        StateMachine {
            kv: KvState::new(kv_limits),
            watches: WatchHub::new(watch_limits),
            lease_clock: LeaseClock::new(),
            tokens: SimpleTokenTable::default(),
        }
    }

    /// A state machine around `kv` (one opened from disk, say).
    pub fn with_kv(kv: KvState, watch_limits: WatchLimits) -> StateMachine {
        StateMachine {
            kv,
            watches: WatchHub::new(watch_limits),
            lease_clock: LeaseClock::new(),
            tokens: SimpleTokenTable::default(),
        }
    }

    /// The replicated key-value state.
    pub fn kv(&self) -> &KvState {
        &self.kv
    }

    /// The snapshot of the state at its durable point (see
    /// [`KvState::durable_snapshot_source`]).
    pub fn durable_snapshot_source(&self) -> Result<SnapshotSource, KvError> {
        self.kv.durable_snapshot_source()
    }

    /// Marks the state for the next flush (see [`KvState::checkpoint`]).
    pub fn checkpoint(&mut self) {
        self.kv.checkpoint();
    }

    /// The next flush or merge of the store (see
    /// [`KvState::next_store_job`]).
    pub fn next_store_job(&mut self, lane: JobLane) -> Option<crate::kv_state::StoreJob> {
        self.kv.next_store_job(lane)
    }

    /// Asks for a merge of the whole store (see
    /// [`KvState::request_full_merge`]).
    pub fn request_full_merge(&mut self) -> u64 {
        self.kv.request_full_merge()
    }

    /// Installs what a store job did (see [`KvState::finish_store_job`]).
    pub fn finish_store_job(
        &mut self,
        lane: JobLane,
        done: crate::kv_state::StoreJobResult,
    ) -> Result<crate::kv_state::StoreManifestWrite, KvError> {
        self.kv.finish_store_job(lane, done)
    }

    /// Records a store manifest written (see
    /// [`KvState::store_manifest_written`]).
    pub fn store_manifest_written(
        &mut self,
        written: crate::kv_state::StoreManifestWritten,
    ) -> ferry_storage::versions::StoreView<ferry_storage::AnyDisk> {
        self.kv.store_manifest_written(written)
    }

    /// Applies a command and hands its events to the watchers.
    pub fn apply(&mut self, index: u64, command: &Command) -> Applied {
        self.apply_with(index, command, Reads::Build)
    }

    /// Applies a command, building its read results or not (see
    /// [`KvState::apply_with`]), and hands its events to the watchers.
    pub fn apply_with(&mut self, index: u64, command: &Command, reads: Reads) -> Applied {
        let applied = self.kv.apply_with(index, command, reads);
        if !applied.events.is_empty() {
            self.watches.notify(applied.revision, &applied.events);
        }
        if applied.response.is_ok() {
            self.follow_tokens(command, &applied.response);
        }
        applied
    }

    /// Keeps the token table in step with an applied command: a token
    /// handed out is held; a deleted user's or a changed password's tokens
    /// end, and disabling auth ends them all (as etcd does), on every
    /// member alike.
    fn follow_tokens(&mut self, command: &Command, response: &Result<CommandResponse, KvError>) {
        match (&command.kind, response) {
            (_, Ok(CommandResponse::TokenAssigned(token))) => self.tokens.insert(token),
            (Some(CommandKind::UserDelete(user)), _) => self.tokens.forget_user(&user.name),
            (Some(CommandKind::UserChangePassword(user)), _) => self.tokens.forget_user(&user.name),
            (Some(CommandKind::AuthDisable(_)), _) => self.tokens.clear(),
            _ => {}
        }
    }

    /// Decodes and applies a log entry (see [`KvState::apply_bytes`]).
    pub fn apply_bytes(&mut self, index: u64, bytes: &[u8]) -> Applied {
        self.apply_bytes_with(index, &Bytes::copy_from_slice(bytes), Reads::Build)
    }

    /// Decodes and applies a log entry, building its read results or not.
    pub fn apply_bytes_with(&mut self, index: u64, bytes: &Bytes, reads: Reads) -> Applied {
        match decode_command(bytes) {
            Ok(command) => self.apply_with(index, &command, reads),
            Err(error) => {
                let applied = self.kv.apply_bytes_with(index, bytes, reads);
                debug_assert_eq!(applied.response, Err(KvError::Decode(error)));
                applied
            }
        }
    }

    /// Replaces the state with a snapshot (see [`StateMachine::install`]).
    pub fn restore(&mut self, bytes: &[u8]) -> Result<(), CodecError> {
        let kv = KvState::restore(bytes, self.kv.limits().clone())?;
        self.install(kv);
        Ok(())
    }

    /// Replaces the state with one already restored from a snapshot (the
    /// driver decodes a received snapshot off its task and swaps it in
    /// here). Lease deadlines start over and every watch stream is woken to
    /// catch up from the new history. Returns the state it replaced, for
    /// the caller to free where that does not hold anyone up.
    pub fn install(&mut self, kv: KvState) -> KvState {
        debug_assert_eq!(kv.limits(), self.kv.limits());
        let replaced = std::mem::replace(&mut self.kv, kv);
        self.lease_clock.reset();
        self.watches.wake_all();
        replaced
    }

    /// The snapshot of the replicated state (see [`KvState::snapshot`]).
    pub fn snapshot(&self) -> Result<Vec<u8>, KvError> {
        self.kv.snapshot()
    }

    /// What a snapshot taken now holds, to encode elsewhere (see
    /// [`KvState::snapshot_source`]).
    pub fn snapshot_source(&self) -> SnapshotSource {
        self.kv.snapshot_source()
    }

    /// Creates a watcher on a stream (see [`WatchHub::create`]).
    pub fn watch_create(&mut self, stream_id: StreamId, request: &WatchCreateRequest) {
        self.watches.create(stream_id, request, self.kv.store());
    }

    /// Cancels a watcher (see [`WatchHub::cancel`]).
    pub fn watch_cancel(&mut self, stream_id: StreamId, watch_id: i64) {
        self.watches.cancel(stream_id, watch_id, self.kv.store());
    }

    /// Cancels the stream's watchers that `user` may no longer read, by
    /// the auth state now (see [`WatchHub::retain`]).
    pub fn watch_retain_permitted(&mut self, stream_id: StreamId, user: &str, reason: &str) {
        let auth = self.kv.auth();
        self.watches.retain(
            stream_id,
            |key, range_end| {
                auth.check_range(user, key, range_end, crate::auth::Access::Read)
                    .is_ok()
            },
            reason,
            self.kv.store(),
        );
    }

    /// Periodic progress (see [`WatchHub::progress_tick`]).
    pub fn watch_progress_tick(&mut self, stream_id: StreamId) {
        self.watches.progress_tick(stream_id, self.kv.store());
    }

    /// What a watch stream should send now (see [`WatchHub::drain`]).
    pub fn watch_drain(&mut self, stream_id: StreamId) -> (Vec<WatchResponseWire>, bool) {
        self.watches.drain(stream_id, self.kv.store())
    }

    /// Starts deadlines of leases granted since the last call.
    pub fn sync_lease_clock(&mut self, now_ms: u64) {
        self.lease_clock.sync(self.kv.leases(), now_ms);
    }

    /// Leader only: an expiry command for leases past their deadline.
    pub fn expired_leases(&mut self, now_ms: u64, ids_max: usize) -> Option<Command> {
        self.lease_clock.expired(self.kv.leases(), now_ms, ids_max)
    }

    /// Leader only: renews a lease; its TTL, or `None` if unknown.
    pub fn lease_keep_alive(&mut self, id: i64, now_ms: u64) -> Option<i64> {
        self.lease_clock.keep_alive(self.kv.leases(), id, now_ms)
    }

    /// Leader only: seconds left on a lease, or `None` if unknown.
    pub fn lease_remaining_seconds(&mut self, id: i64, now_ms: u64) -> Option<i64> {
        self.lease_clock
            .remaining_seconds(self.kv.leases(), id, now_ms)
    }
}

/// A [`StateMachine`] shared between the applier, the API and watch streams.
#[derive(Debug)]
pub struct SharedState {
    inner: Mutex<StateMachine>,
    store_jobs: StoreJobMetrics,
}

/// How long the jobs of a key-value store kept on disk took, each from
/// the start of its run file to its manifest on disk, in seconds.
#[derive(Debug)]
pub struct StoreJobMetrics {
    /// Flushes of frozen memtables (the store's commits: each moves its
    /// durable point).
    pub flush_seconds: Histogram,
    /// Merges of runs.
    pub merge_seconds: Histogram,
}

impl Default for StoreJobMetrics {
    fn default() -> Self {
        StoreJobMetrics {
            flush_seconds: disk_histogram(),
            merge_seconds: disk_histogram(),
        }
    }
}

impl SharedState {
    /// Wraps a state machine.
    pub fn new(machine: StateMachine) -> SharedState {
        SharedState {
            inner: Mutex::new(machine),
            store_jobs: StoreJobMetrics::default(),
        }
    }

    /// How long the store's jobs took.
    pub fn store_jobs(&self) -> &StoreJobMetrics {
        &self.store_jobs
    }

    /// Locks the state. A panic while holding the lock cannot leave the
    /// state half-changed (apply validates before writing), so a poisoned
    /// lock is taken over rather than propagated.
    pub fn lock(&self) -> MutexGuard<'_, StateMachine> {
        self.inner
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
    }

    /// Serves a Range outside a txn without holding the lock the applier
    /// needs for longer than [`RANGE_KEYS_PER_LOCK`] keys at a time (see
    /// [`SharedState::range_in_steps`]).
    pub fn range(&self, request: &RangeRequest) -> Result<RangeResponse, KvError> {
        self.range_in_steps(request, RANGE_KEYS_PER_LOCK, || {})
    }

    /// A Range read from one consistent view, in steps of `keys_per_step`
    /// keys: each step takes a view of its part of the store under the
    /// lock ([`RangeScan::next_view`]) and reads it without the lock
    /// (`between` runs between steps); the response is built after the
    /// last step, without the lock.
    ///
    /// Why: a Range over a large keyspace takes a while to scan, longer
    /// when its versions come off the disk, and much longer to copy into a
    /// response; done under the lock it held up every apply, and so every
    /// write, for as long. The result stays consistent because the scan
    /// reads at the revision that was newest when it started (see
    /// [`RangeScan`]); each step checks that no compaction removed it
    /// before taking its view.
    pub fn range_in_steps(
        &self,
        request: &RangeRequest,
        keys_per_step: usize,
        between: impl FnMut(),
    ) -> Result<RangeResponse, KvError> {
        self.range_begin(request, keys_per_step)?
            .finish(self, keys_per_step, between)
    }

    /// Checks a Range and runs its first step (see
    /// [`SharedState::range_in_steps`]); [`RangeRead::finish`] does the rest.
    pub fn range_begin(
        &self,
        request: &RangeRequest,
        keys_per_step: usize,
    ) -> Result<RangeRead, KvError> {
        if request.key.is_empty() {
            return Err(KvError::EmptyKey);
        }
        let machine = self.lock();
        let store = machine.kv().store();
        store.check_read_revision(request.revision)?;
        let revision = store.revision();
        let read_revision = if request.revision > 0 {
            request.revision
        } else {
            revision
        };
        let mut scan = RangeScan::new(request, ReadAt::Revision(read_revision));
        if request.range_end.is_empty() {
            // One key: its versions are few and read in place.
            scan.step(store, keys_per_step)?;
        } else {
            let view = scan.next_view(store, keys_per_step);
            drop(machine);
            if let Some(view) = view {
                scan.scan_view(&view, keys_per_step)?;
            }
        }
        Ok(RangeRead {
            scan,
            read_revision,
            revision,
        })
    }
}

/// A Range in progress over a [`SharedState`] (see
/// [`SharedState::range_in_steps`]).
#[derive(Debug)]
pub struct RangeRead {
    scan: RangeScan,
    /// The revision the scan reads at.
    read_revision: i64,
    /// The store's revision when the read began, for the header.
    revision: i64,
}

impl RangeRead {
    /// Whether the scan is complete and only the response remains to build.
    pub fn is_scanned(&self) -> bool {
        self.scan.is_done()
    }

    /// Response bytes collected so far (see [`RangeScan::collected_bytes`]).
    pub fn collected_bytes(&self) -> usize {
        self.scan.collected_bytes()
    }

    /// Scans the rest, `keys_per_step` keys per hold of the lock, and
    /// builds the response without the lock.
    pub fn finish(
        mut self,
        state: &SharedState,
        keys_per_step: usize,
        mut between: impl FnMut(),
    ) -> Result<RangeResponse, KvError> {
        while !self.scan.is_done() {
            between();
            // Only taking the view needs the lock; reading it does not.
            let view = {
                let machine = state.lock();
                let store = machine.kv().store();
                store.check_read_revision(self.read_revision)?;
                self.scan.next_view(store, keys_per_step)
            };
            if let Some(view) = view {
                self.scan.scan_view(&view, keys_per_step)?;
            }
        }
        let mut response = self.scan.into_response();
        response.header = Some(ResponseHeader {
            revision: self.revision,
            ..ResponseHeader::default()
        });
        Ok(response)
    }
}

/// Keys a Range step takes from the memtable per hold of the state lock:
/// a few hundred microseconds of pointer copies at most, so an apply waits
/// at most that long behind a read however large it is (the step reads the
/// store's runs after releasing the lock).
pub const RANGE_KEYS_PER_LOCK: usize = 1024;
