//! The replicated key-value state machine: MVCC data plus leases.
//!
//! `apply(index, command)` is deterministic: every replica that applies the
//! same commands in the same order holds the same state and gives the same
//! answers, errors included. A command either takes effect whole or not at
//! all: everything that could refuse it is checked before the first write.

use std::collections::{BTreeMap, BTreeSet};
use std::sync::Arc;

use prost::Message;

use crate::command::{decode_command, CommandKind};
use crate::error::{CodecError, KvError};
use crate::mvcc::{to_event, KeyRange, MvccStore, ReadAt, Version};
use crate::pb::etcdserverpb::compare::{CompareResult, CompareTarget, TargetUnion};
use crate::pb::etcdserverpb::request_op::Request;
use crate::pb::etcdserverpb::response_op::Response;
use crate::pb::etcdserverpb::{
    CompactionRequest, CompactionResponse, Compare, DeleteRangeRequest, DeleteRangeResponse,
    LeaseGrantResponse, LeaseRevokeResponse, PutRequest, PutResponse, RangeRequest, RangeResponse,
    RequestOp, ResponseHeader, ResponseOp, TxnRequest, TxnResponse,
};
use crate::pb::ferrypb::{self, LeaseExpireCommand, LeaseGrantCommand, LeaseRevokeCommand};
use crate::pb::mvccpb::{Event, KeyValue};

/// Largest TTL a lease may have, in seconds (etcd's MaxLeaseTTL).
pub const LEASE_TTL_SECONDS_MAX: i64 = 9_000_000_000;

/// Limits of the state machine. They must be the same on every replica,
/// because they decide whether a command is refused.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct KvLimits {
    /// Largest encoded request, in bytes (etcd default 1.5 MiB).
    pub request_size_bytes_max: usize,
    /// Most compares, success ops or failure ops in one txn level (etcd
    /// default 128).
    pub txn_ops_max: usize,
    /// Deepest nesting of txns inside txns.
    pub txn_depth_max: usize,
    /// Shortest lease TTL; shorter requests are raised to it (etcd derives
    /// it from the election timeout).
    pub lease_ttl_seconds_min: i64,
}

impl Default for KvLimits {
    fn default() -> Self {
        KvLimits {
            request_size_bytes_max: 1536 * 1024,
            txn_ops_max: 128,
            txn_depth_max: 16,
            lease_ttl_seconds_min: 2,
        }
    }
}

/// A lease as the replicated state knows it. Its deadline is not here: it
/// depends on the leader's clock (see `lease::LeaseClock`).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct LeaseRecord {
    /// TTL granted, after raising it to the minimum.
    pub granted_ttl_seconds: i64,
    /// Keys whose newest version is attached to this lease.
    pub keys: BTreeSet<Vec<u8>>,
}

/// The answer to an applied command (the header carries only the revision;
/// the API fills in cluster, member and term).
#[derive(Debug, Clone, PartialEq)]
pub enum CommandResponse {
    /// Answer to a put.
    Put(PutResponse),
    /// Answer to a delete.
    DeleteRange(DeleteRangeResponse),
    /// Answer to a txn.
    Txn(TxnResponse),
    /// Answer to a compaction.
    Compact(CompactionResponse),
    /// Answer to a lease grant.
    LeaseGrant(LeaseGrantResponse),
    /// Answer to a lease revoke.
    LeaseRevoke(LeaseRevokeResponse),
    /// A member's addresses were recorded.
    MemberRecorded,
    /// The leases an expiry command actually removed.
    LeaseExpire {
        /// Ids of removed leases.
        expired_ids: Vec<i64>,
        /// Store revision afterwards.
        revision: i64,
    },
}

/// What applying one command produced.
#[derive(Debug, Clone, PartialEq)]
pub struct Applied {
    /// The answer for the client, or the deterministic refusal.
    pub response: Result<CommandResponse, KvError>,
    /// Changes for watchers, in order, each with its previous version.
    pub events: Vec<Event>,
    /// The store revision after the command.
    pub revision: i64,
}

/// The key-value state machine.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct KvState {
    store: MvccStore,
    leases: BTreeMap<i64, LeaseRecord>,
    /// Next id to try when a grant leaves the choice to the server.
    lease_id_next: i64,
    applied_index: u64,
    limits: KvLimits,
    /// Where members added at run time can be reached, by id.
    members: BTreeMap<u64, ferrypb::MemberRecordCommand>,
}

/// A write transaction in progress: one revision, ops numbered in order.
struct WriteTxn {
    revision: i64,
    sub_revision: u32,
    events: Vec<Event>,
}

impl WriteTxn {
    fn changed(&self) -> bool {
        self.sub_revision > 0
    }
}

/// Magic at the start of every snapshot.
const SNAPSHOT_MAGIC: &[u8; 8] = b"FERRYKV1";

impl KvState {
    /// An empty state machine.
    pub fn new(limits: KvLimits) -> KvState {
        KvState {
            store: MvccStore::new(),
            leases: BTreeMap::new(),
            lease_id_next: 1,
            applied_index: 0,
            limits,
            members: BTreeMap::new(),
        }
    }

    /// The MVCC store, for reads and watch history.
    pub fn store(&self) -> &MvccStore {
        &self.store
    }

    /// The limits this state machine enforces.
    pub fn limits(&self) -> &KvLimits {
        &self.limits
    }

    /// Index of the last applied log entry.
    pub fn applied_index(&self) -> u64 {
        self.applied_index
    }

    /// Every lease, by id.
    pub fn leases(&self) -> &BTreeMap<i64, LeaseRecord> {
        &self.leases
    }

    /// Serves a Range outside a txn (linearizable or serializable reads).
    pub fn range(&self, request: &RangeRequest) -> Result<RangeResponse, KvError> {
        check_key(&request.key)?;
        self.store.check_read_revision(request.revision)?;
        let at = if request.revision > 0 {
            ReadAt::Revision(request.revision)
        } else {
            ReadAt::Latest
        };
        let mut response = self.store.range(request, at);
        response.header = Some(header(self.store.revision()));
        Ok(response)
    }

    /// Checks what can be checked without the state: empty keys, txn shape,
    /// duplicate keys, size. The API calls this before proposing; `apply`
    /// calls it again so that a replica never trusts the proposer.
    pub fn validate(&self, command: &ferrypb::Command) -> Result<(), KvError> {
        if crate::command::encoded_command_len(command) > self.limits.request_size_bytes_max {
            return Err(KvError::RequestTooLarge);
        }
        match &command.kind {
            None => Err(KvError::Decode(CodecError::MissingKind)),
            Some(CommandKind::Put(put)) => validate_put(put),
            Some(CommandKind::DeleteRange(delete)) => check_key(&delete.key),
            Some(CommandKind::Txn(txn)) => self.validate_txn(txn, 1).map(|_| ()),
            Some(CommandKind::Compact(_))
            | Some(CommandKind::LeaseGrant(_))
            | Some(CommandKind::LeaseRevoke(_))
            | Some(CommandKind::LeaseExpire(_))
            | Some(CommandKind::MemberRecord(_)) => Ok(()),
        }
    }

    /// Decodes and applies one log entry.
    pub fn apply_bytes(&mut self, index: u64, bytes: &[u8]) -> Applied {
        match decode_command(bytes) {
            Ok(command) => self.apply(index, &command),
            Err(error) => {
                // A malformed entry still consumes its index, so that every
                // replica stays at the same applied index.
                if index > self.applied_index {
                    self.applied_index = index;
                }
                Applied {
                    response: Err(KvError::Decode(error)),
                    events: Vec::new(),
                    revision: self.store.revision(),
                }
            }
        }
    }

    /// Applies one command at log index `index`.
    pub fn apply(&mut self, index: u64, command: &ferrypb::Command) -> Applied {
        if index <= self.applied_index {
            return Applied {
                response: Err(KvError::AlreadyApplied {
                    index,
                    applied_index: self.applied_index,
                }),
                events: Vec::new(),
                revision: self.store.revision(),
            };
        }
        self.applied_index = index;
        let mut txn = WriteTxn {
            revision: self.store.revision() + 1,
            sub_revision: 0,
            events: Vec::new(),
        };
        let response = match self.validate(command) {
            Err(error) => Err(error),
            Ok(()) => self.execute(command, &mut txn),
        };
        if txn.changed() {
            self.store.commit(txn.revision);
        }
        let revision = self.store.revision();
        let response = response.map(|r| with_revision(r, revision));
        Applied {
            response,
            events: txn.events,
            revision,
        }
    }

    fn execute(
        &mut self,
        command: &ferrypb::Command,
        txn: &mut WriteTxn,
    ) -> Result<CommandResponse, KvError> {
        match &command.kind {
            None => Err(KvError::Decode(CodecError::MissingKind)),
            Some(CommandKind::Put(put)) => {
                self.check_put(put)?;
                Ok(CommandResponse::Put(self.do_put(put, txn)))
            }
            Some(CommandKind::DeleteRange(delete)) => {
                Ok(CommandResponse::DeleteRange(self.do_delete(delete, txn)))
            }
            Some(CommandKind::Txn(request)) => {
                let mut path = Vec::new();
                self.choose_path(request, &mut path);
                let mut cursor = 0;
                self.check_txn(request, &path, &mut cursor)?;
                let mut cursor = 0;
                Ok(CommandResponse::Txn(self.do_txn(
                    request,
                    &path,
                    &mut cursor,
                    txn,
                )))
            }
            Some(CommandKind::Compact(CompactionRequest { revision, .. })) => {
                self.store.compact(*revision)?;
                Ok(CommandResponse::Compact(CompactionResponse {
                    header: None,
                }))
            }
            Some(CommandKind::LeaseGrant(grant)) => self.grant(grant),
            Some(CommandKind::LeaseRevoke(LeaseRevokeCommand { id })) => {
                if !self.leases.contains_key(id) {
                    return Err(KvError::LeaseNotFound);
                }
                self.remove_lease(*id, txn);
                Ok(CommandResponse::LeaseRevoke(LeaseRevokeResponse {
                    header: None,
                }))
            }
            Some(CommandKind::MemberRecord(record)) => {
                if record.create && self.members.contains_key(&record.id) {
                    return Err(KvError::MemberIdTaken);
                }
                let entry =
                    self.members
                        .entry(record.id)
                        .or_insert_with(|| ferrypb::MemberRecordCommand {
                            id: record.id,
                            ..Default::default()
                        });
                for (field, new) in [
                    (&mut entry.name, &record.name),
                    (&mut entry.peer_addr, &record.peer_addr),
                    (&mut entry.client_url, &record.client_url),
                ] {
                    if !new.is_empty() {
                        field.clone_from(new);
                    }
                }
                Ok(CommandResponse::MemberRecorded)
            }
            Some(CommandKind::LeaseExpire(LeaseExpireCommand { ids })) => {
                let mut expired_ids = Vec::new();
                for id in ids {
                    // A client revoke may have won the race; skip it then.
                    if self.leases.contains_key(id) {
                        self.remove_lease(*id, txn);
                        expired_ids.push(*id);
                    }
                }
                Ok(CommandResponse::LeaseExpire {
                    expired_ids,
                    revision: 0,
                })
            }
        }
    }

    fn grant(&mut self, grant: &LeaseGrantCommand) -> Result<CommandResponse, KvError> {
        if grant.ttl_seconds > LEASE_TTL_SECONDS_MAX {
            return Err(KvError::LeaseTtlTooLarge);
        }
        let id = if grant.id == 0 {
            while self.leases.contains_key(&self.lease_id_next) || self.lease_id_next <= 0 {
                self.lease_id_next = self.lease_id_next.checked_add(1).unwrap_or(1);
            }
            let id = self.lease_id_next;
            self.lease_id_next = self.lease_id_next.checked_add(1).unwrap_or(1);
            id
        } else {
            if self.leases.contains_key(&grant.id) {
                return Err(KvError::LeaseExists);
            }
            grant.id
        };
        let ttl = grant.ttl_seconds.max(self.limits.lease_ttl_seconds_min);
        self.leases.insert(
            id,
            LeaseRecord {
                granted_ttl_seconds: ttl,
                keys: BTreeSet::new(),
            },
        );
        Ok(CommandResponse::LeaseGrant(LeaseGrantResponse {
            header: None,
            id,
            ttl,
            error: String::new(),
        }))
    }

    /// Deletes a lease's keys (in key order, in the current revision) and
    /// forgets the lease.
    fn remove_lease(&mut self, id: i64, txn: &mut WriteTxn) {
        let Some(record) = self.leases.remove(&id) else {
            return;
        };
        for key in record.keys {
            self.delete_key(&key, txn);
        }
    }

    fn check_put(&self, put: &PutRequest) -> Result<(), KvError> {
        if put.lease != 0 && !put.ignore_lease && !self.leases.contains_key(&put.lease) {
            return Err(KvError::LeaseNotFound);
        }
        if (put.ignore_value || put.ignore_lease)
            && self.store.get(&put.key, ReadAt::Latest).is_none()
        {
            return Err(KvError::KeyNotFound);
        }
        Ok(())
    }

    fn do_put(&mut self, put: &PutRequest, txn: &mut WriteTxn) -> PutResponse {
        let existing = self.store.get(&put.key, ReadAt::Latest).cloned();
        let value = match (&existing, put.ignore_value) {
            (Some(kv), true) => kv.value.clone(),
            _ => put.value.clone(),
        };
        let lease = match (&existing, put.ignore_lease) {
            (Some(kv), true) => kv.lease,
            _ => put.lease,
        };
        let (previous, new) =
            self.store
                .put(txn.revision, txn.sub_revision, &put.key, value, lease);
        txn.sub_revision += 1;
        if let Some(prev) = &previous {
            if prev.lease != 0 && prev.lease != lease {
                if let Some(record) = self.leases.get_mut(&prev.lease) {
                    record.keys.remove(&put.key);
                }
            }
        }
        if lease != 0 {
            if let Some(record) = self.leases.get_mut(&lease) {
                record.keys.insert(put.key.clone());
            }
        }
        txn.events.push(to_event(
            &Version {
                kv: Arc::new(new),
                sub_revision: txn.sub_revision - 1,
                tombstone: false,
            },
            previous.clone(),
        ));
        PutResponse {
            header: None,
            prev_kv: if put.prev_kv { previous } else { None },
        }
    }

    fn delete_key(&mut self, key: &[u8], txn: &mut WriteTxn) -> Option<KeyValue> {
        let previous = self.store.delete(txn.revision, txn.sub_revision, key)?;
        txn.sub_revision += 1;
        if previous.lease != 0 {
            if let Some(record) = self.leases.get_mut(&previous.lease) {
                record.keys.remove(key);
            }
        }
        txn.events.push(to_event(
            &Version {
                kv: Arc::new(KeyValue {
                    key: key.to_vec(),
                    mod_revision: txn.revision,
                    ..KeyValue::default()
                }),
                sub_revision: txn.sub_revision - 1,
                tombstone: true,
            },
            Some(previous.clone()),
        ));
        Some(previous)
    }

    fn do_delete(
        &mut self,
        delete: &DeleteRangeRequest,
        txn: &mut WriteTxn,
    ) -> DeleteRangeResponse {
        let range = KeyRange::new(&delete.key, &delete.range_end);
        let keys: Vec<Vec<u8>> = self
            .store
            .scan(&range, ReadAt::Latest)
            .map(|kv| kv.key.clone())
            .collect();
        let mut prev_kvs = Vec::new();
        let mut deleted = 0;
        for key in keys {
            if let Some(previous) = self.delete_key(&key, txn) {
                deleted += 1;
                if delete.prev_kv {
                    prev_kvs.push(previous);
                }
            }
        }
        DeleteRangeResponse {
            header: None,
            deleted,
            prev_kvs,
        }
    }

    /// Evaluates every txn's compares, nested ones included, against the
    /// state before the txn runs (as etcd does), in depth-first order.
    fn choose_path(&self, request: &TxnRequest, path: &mut Vec<bool>) {
        let succeeded = request.compare.iter().all(|c| self.compare(c));
        path.push(succeeded);
        let branch = if succeeded {
            &request.success
        } else {
            &request.failure
        };
        for op in branch {
            if let Some(Request::RequestTxn(nested)) = &op.request {
                self.choose_path(nested, path);
            }
        }
    }

    fn check_txn(
        &self,
        request: &TxnRequest,
        path: &[bool],
        cursor: &mut usize,
    ) -> Result<(), KvError> {
        let succeeded = path.get(*cursor).copied().unwrap_or(false);
        *cursor += 1;
        let branch = if succeeded {
            &request.success
        } else {
            &request.failure
        };
        for op in branch {
            match &op.request {
                None => {}
                Some(Request::RequestRange(range)) => {
                    self.store.check_read_revision(range.revision)?;
                }
                Some(Request::RequestPut(put)) => self.check_put(put)?,
                Some(Request::RequestDeleteRange(_)) => {}
                Some(Request::RequestTxn(nested)) => self.check_txn(nested, path, cursor)?,
            }
        }
        Ok(())
    }

    fn do_txn(
        &mut self,
        request: &TxnRequest,
        path: &[bool],
        cursor: &mut usize,
        txn: &mut WriteTxn,
    ) -> TxnResponse {
        let succeeded = path.get(*cursor).copied().unwrap_or(false);
        *cursor += 1;
        let branch = if succeeded {
            &request.success
        } else {
            &request.failure
        };
        let mut responses = Vec::with_capacity(branch.len());
        for op in branch {
            let response = match &op.request {
                None => None,
                Some(Request::RequestRange(range)) => {
                    let at = if range.revision > 0 {
                        ReadAt::Revision(range.revision)
                    } else {
                        ReadAt::Latest
                    };
                    Some(Response::ResponseRange(self.store.range(range, at)))
                }
                Some(Request::RequestPut(put)) => {
                    Some(Response::ResponsePut(self.do_put(put, txn)))
                }
                Some(Request::RequestDeleteRange(delete)) => {
                    Some(Response::ResponseDeleteRange(self.do_delete(delete, txn)))
                }
                Some(Request::RequestTxn(nested)) => Some(Response::ResponseTxn(
                    self.do_txn(nested, path, cursor, txn),
                )),
            };
            responses.push(ResponseOp { response });
        }
        TxnResponse {
            header: None,
            succeeded,
            responses,
        }
    }

    /// One compare; over a range every key must satisfy it. A missing key
    /// compares as zeros, except that a value compare on it fails (etcd).
    fn compare(&self, compare: &Compare) -> bool {
        let range = KeyRange::new(&compare.key, &compare.range_end);
        let mut any = false;
        for kv in self.store.scan(&range, ReadAt::Latest) {
            any = true;
            if !compare_kv(compare, kv) {
                return false;
            }
        }
        if any {
            return true;
        }
        if compare.target == CompareTarget::Value as i32 {
            return false;
        }
        compare_kv(compare, &KeyValue::default())
    }

    /// Checks a txn's shape; returns the keys its branches may put and the
    /// ranges they may delete, so that an enclosing txn can check them.
    fn validate_txn(&self, txn: &TxnRequest, depth: usize) -> Result<TxnKeys, KvError> {
        if depth > self.limits.txn_depth_max {
            return Err(KvError::TxnTooDeep {
                depth_max: self.limits.txn_depth_max,
            });
        }
        let ops_max = self.limits.txn_ops_max;
        if txn.compare.len() > ops_max || txn.success.len() > ops_max || txn.failure.len() > ops_max
        {
            return Err(KvError::TooManyTxnOps);
        }
        for compare in &txn.compare {
            check_key(&compare.key)?;
        }
        let mut union = TxnKeys::default();
        for branch in [&txn.success, &txn.failure] {
            let keys = self.validate_branch(branch, depth)?;
            union.puts.extend(keys.puts);
            union.deletes.extend(keys.deletes);
        }
        Ok(union)
    }

    fn validate_branch(&self, branch: &[RequestOp], depth: usize) -> Result<TxnKeys, KvError> {
        let mut seen = TxnKeys::default();
        for op in branch {
            match &op.request {
                None => {}
                Some(Request::RequestRange(range)) => check_key(&range.key)?,
                Some(Request::RequestPut(put)) => {
                    validate_put(put)?;
                    if seen.conflicts_with_put(&put.key) {
                        return Err(KvError::DuplicateKey);
                    }
                    seen.puts.insert(put.key.clone());
                }
                Some(Request::RequestDeleteRange(delete)) => {
                    check_key(&delete.key)?;
                    let range = KeyRange::new(&delete.key, &delete.range_end);
                    if seen.puts.iter().any(|key| range.contains(key)) {
                        return Err(KvError::DuplicateKey);
                    }
                    seen.deletes.push(range);
                }
                Some(Request::RequestTxn(nested)) => {
                    let nested_keys = self.validate_txn(nested, depth + 1)?;
                    for key in &nested_keys.puts {
                        if seen.conflicts_with_put(key) {
                            return Err(KvError::DuplicateKey);
                        }
                    }
                    for range in &nested_keys.deletes {
                        if seen.puts.iter().any(|key| range.contains(key)) {
                            return Err(KvError::DuplicateKey);
                        }
                    }
                    seen.puts.extend(nested_keys.puts);
                    seen.deletes.extend(nested_keys.deletes);
                }
            }
        }
        Ok(seen)
    }

    /// Encodes the whole state: magic, protobuf body, CRC32C of both.
    pub fn snapshot(&self) -> Vec<u8> {
        self.snapshot_source().encode()
    }

    /// What a snapshot of the state at this moment holds, taken without
    /// copying any key or value (see [`SnapshotSource`]).
    pub fn snapshot_source(&self) -> SnapshotSource {
        SnapshotSource {
            head: ferrypb::Snapshot {
                applied_index: self.applied_index,
                revision: self.store.revision(),
                compacted_revision: self.store.compacted_revision(),
                lease_id_next: self.lease_id_next,
                ..ferrypb::Snapshot::default()
            },
            versions: self.store.versions().cloned().collect(),
            tail: ferrypb::Snapshot {
                leases: self
                    .leases
                    .iter()
                    .map(|(id, record)| ferrypb::SnapshotLease {
                        id: *id,
                        granted_ttl_seconds: record.granted_ttl_seconds,
                    })
                    .collect(),
                members: self.members.values().cloned().collect(),
                ..ferrypb::Snapshot::default()
            },
        }
    }

    /// Rebuilds a state machine from [`KvState::snapshot`] bytes, checking
    /// the magic, the checksum and the consistency of the contents.
    pub fn restore(bytes: &[u8], limits: KvLimits) -> Result<KvState, CodecError> {
        let trailer = 4;
        if bytes.len() < SNAPSHOT_MAGIC.len() + trailer {
            return Err(CodecError::Truncated {
                size_bytes: bytes.len(),
            });
        }
        let (body, stored) = bytes.split_at(bytes.len() - trailer);
        let mut stored_bytes = [0u8; 4];
        stored_bytes.copy_from_slice(stored);
        let stored = u32::from_le_bytes(stored_bytes);
        let computed = crc32c::crc32c(body);
        if !body.starts_with(SNAPSHOT_MAGIC) {
            return Err(CodecError::BadMagic);
        }
        if stored != computed {
            return Err(CodecError::ChecksumMismatch { stored, computed });
        }
        let snapshot = ferrypb::Snapshot::decode(&body[SNAPSHOT_MAGIC.len()..])
            .map_err(|e| CodecError::Malformed(e.to_string()))?;
        let mut versions = Vec::with_capacity(snapshot.versions.len());
        for version in snapshot.versions {
            let kv = version
                .kv
                .ok_or_else(|| CodecError::Inconsistent("a version without a key-value".into()))?;
            versions.push(Version {
                kv: Arc::new(kv),
                sub_revision: version.sub_revision,
                tombstone: version.tombstone,
            });
        }
        let store = MvccStore::from_parts(snapshot.revision, snapshot.compacted_revision, versions)
            .map_err(CodecError::Inconsistent)?;
        let mut leases: BTreeMap<i64, LeaseRecord> = BTreeMap::new();
        for lease in snapshot.leases {
            leases.insert(
                lease.id,
                LeaseRecord {
                    granted_ttl_seconds: lease.granted_ttl_seconds,
                    keys: BTreeSet::new(),
                },
            );
        }
        let everything = KeyRange::new(&[0], &[0]);
        for kv in store.scan(&everything, ReadAt::Latest) {
            if kv.lease != 0 {
                let record = leases.get_mut(&kv.lease).ok_or_else(|| {
                    CodecError::Inconsistent(format!(
                        "key {:?} is attached to lease {} which the snapshot lacks",
                        String::from_utf8_lossy(&kv.key),
                        kv.lease
                    ))
                })?;
                record.keys.insert(kv.key.clone());
            }
        }
        Ok(KvState {
            store,
            leases,
            lease_id_next: snapshot.lease_id_next,
            applied_index: snapshot.applied_index,
            limits,
            members: snapshot.members.into_iter().map(|m| (m.id, m)).collect(),
        })
    }

    /// Where members added at run time can be reached, by id.
    pub fn member_records(&self) -> &BTreeMap<u64, ferrypb::MemberRecordCommand> {
        &self.members
    }
}

/// Bytes [`SnapshotSource::write_to`] gathers before handing them on.
const SNAPSHOT_WRITE_BUFFER_BYTES: usize = 1 << 20;
/// Protobuf key of `Snapshot.versions` (field 5, length-delimited).
const KEY_SNAPSHOT_VERSIONS: u8 = (5 << 3) | 2;
/// Protobuf key of `SnapshotVersion.kv` (field 1, length-delimited).
const KEY_VERSION_KV: u8 = (1 << 3) | 2;
/// Protobuf key of `SnapshotVersion.sub_revision` (field 2, varint).
const KEY_VERSION_SUB_REVISION: u8 = 2 << 3;
/// Protobuf key of `SnapshotVersion.tombstone` (field 3, varint).
const KEY_VERSION_TOMBSTONE: u8 = 3 << 3;

/// The contents of a snapshot at one applied index, detached from the live
/// state: encoding it later gives exactly the bytes [`KvState::snapshot`]
/// gave when it was taken, however the state changed since.
///
/// Why this shape: taking it costs one pointer copy per stored version (the
/// key-values are shared, see [`Version`]) plus the small lease and member
/// tables, so the driver can take it between two applies and leave the
/// encoding, the checksum and the write of hundreds of MB to a blocking
/// thread. A copy-on-write store was the alternative; sharing the
/// immutable key-values needs no new data structure and keeps reads as
/// they are.
///
/// The encoding is the protobuf encoding of `ferrypb::Snapshot`, written
/// in three parts so that no key-value is cloned into a message: fields
/// 1-4 (`head`), each version as field 5, then fields 6-7 (`tail`). Field
/// order is what prost's derived encoder uses, so the bytes are the same;
/// a test checks that against the derived encoder.
#[derive(Debug, Clone)]
pub struct SnapshotSource {
    /// Only the scalar fields 1-4 are set.
    head: ferrypb::Snapshot,
    /// Every stored version, in key order, oldest first per key.
    versions: Vec<Version>,
    /// Only the leases and members (fields 6-7) are set.
    tail: ferrypb::Snapshot,
}

impl SnapshotSource {
    /// The applied index the snapshot covers.
    pub fn applied_index(&self) -> u64 {
        self.head.applied_index
    }

    /// Encodes the snapshot into one buffer (see [`KvState::snapshot`]).
    pub fn encode(&self) -> Vec<u8> {
        let mut bytes = Vec::with_capacity(self.encoded_len());
        let written = self.write_to(|piece| {
            bytes.extend_from_slice(piece);
            Ok::<(), std::convert::Infallible>(())
        });
        debug_assert_eq!(written.ok(), Some(bytes.len() as u64));
        bytes
    }

    /// Size of the encoded snapshot, magic and checksum included.
    pub fn encoded_len(&self) -> usize {
        let versions: usize = self
            .versions
            .iter()
            .map(|version| {
                let body = version_body_len(version);
                1 + prost::length_delimiter_len(body) + body
            })
            .sum();
        SNAPSHOT_MAGIC.len() + self.head.encoded_len() + versions + self.tail.encoded_len() + 4
    }

    /// Streams the encoded snapshot to `sink` in pieces of about 1 MiB, so
    /// that the whole encoding never has to be in memory at once. Returns
    /// the number of bytes written.
    pub fn write_to<E>(&self, mut sink: impl FnMut(&[u8]) -> Result<(), E>) -> Result<u64, E> {
        let mut buffer: Vec<u8> = Vec::with_capacity(SNAPSHOT_WRITE_BUFFER_BYTES);
        let mut checksum: u32 = 0;
        let mut written: u64 = 0;
        let mut flush = |buffer: &mut Vec<u8>, checksum: &mut u32| -> Result<(), E> {
            *checksum = crc32c::crc32c_append(*checksum, buffer);
            written += buffer.len() as u64;
            sink(buffer)?;
            buffer.clear();
            Ok(())
        };
        buffer.extend_from_slice(SNAPSHOT_MAGIC);
        append_message(&self.head, &mut buffer);
        for version in &self.versions {
            buffer.push(KEY_SNAPSHOT_VERSIONS);
            encode_varint(version_body_len(version) as u64, &mut buffer);
            buffer.push(KEY_VERSION_KV);
            encode_varint(version.kv.encoded_len() as u64, &mut buffer);
            append_message(&*version.kv, &mut buffer);
            if version.sub_revision != 0 {
                buffer.push(KEY_VERSION_SUB_REVISION);
                encode_varint(u64::from(version.sub_revision), &mut buffer);
            }
            if version.tombstone {
                buffer.push(KEY_VERSION_TOMBSTONE);
                buffer.push(1);
            }
            if buffer.len() >= SNAPSHOT_WRITE_BUFFER_BYTES {
                flush(&mut buffer, &mut checksum)?;
            }
        }
        append_message(&self.tail, &mut buffer);
        flush(&mut buffer, &mut checksum)?;
        buffer.extend_from_slice(&checksum.to_le_bytes());
        flush(&mut buffer, &mut checksum)?;
        Ok(written)
    }
}

/// Length of one `SnapshotVersion` message's body.
fn version_body_len(version: &Version) -> usize {
    let kv = version.kv.encoded_len();
    let mut len = 1 + prost::length_delimiter_len(kv) + kv;
    if version.sub_revision != 0 {
        len += 1 + varint_len(u64::from(version.sub_revision));
    }
    if version.tombstone {
        len += 2;
    }
    len
}

/// Appends a message's encoding (without a length) to a buffer.
fn append_message(message: &impl Message, buffer: &mut Vec<u8>) {
    // prost refuses only a buffer without room; a Vec grows.
    let outcome = message.encode(buffer);
    debug_assert!(outcome.is_ok(), "encoding into a Vec cannot fail");
}

/// Appends `value` as a protobuf varint.
fn encode_varint(mut value: u64, buffer: &mut Vec<u8>) {
    while value >= 0x80 {
        buffer.push((value as u8 & 0x7f) | 0x80);
        value >>= 7;
    }
    buffer.push(value as u8);
}

/// Bytes `value` takes as a protobuf varint.
fn varint_len(value: u64) -> usize {
    let bits = 64 - (value | 1).leading_zeros() as usize;
    bits.div_ceil(7)
}

/// Keys a txn branch may put and ranges it may delete.
#[derive(Default)]
struct TxnKeys {
    puts: BTreeSet<Vec<u8>>,
    deletes: Vec<KeyRange>,
}

impl TxnKeys {
    fn conflicts_with_put(&self, key: &[u8]) -> bool {
        self.puts.contains(key) || self.deletes.iter().any(|range| range.contains(key))
    }
}

fn check_key(key: &[u8]) -> Result<(), KvError> {
    if key.is_empty() {
        Err(KvError::EmptyKey)
    } else {
        Ok(())
    }
}

fn validate_put(put: &PutRequest) -> Result<(), KvError> {
    check_key(&put.key)?;
    if put.ignore_value && !put.value.is_empty() {
        return Err(KvError::ValueProvided);
    }
    if put.ignore_lease && put.lease != 0 {
        return Err(KvError::LeaseProvided);
    }
    Ok(())
}

fn compare_kv(compare: &Compare, kv: &KeyValue) -> bool {
    use std::cmp::Ordering;
    let ordering = match (
        CompareTarget::try_from(compare.target),
        &compare.target_union,
    ) {
        (Ok(CompareTarget::Version), Some(TargetUnion::Version(v))) => kv.version.cmp(v),
        (Ok(CompareTarget::Create), Some(TargetUnion::CreateRevision(v))) => {
            kv.create_revision.cmp(v)
        }
        (Ok(CompareTarget::Mod), Some(TargetUnion::ModRevision(v))) => kv.mod_revision.cmp(v),
        (Ok(CompareTarget::Value), Some(TargetUnion::Value(v))) => kv.value.as_slice().cmp(v),
        (Ok(CompareTarget::Lease), Some(TargetUnion::Lease(v))) => kv.lease.cmp(v),
        // proto3 drops zero-valued oneof members from some encoders; etcd
        // reads them as zero, and so do we.
        (Ok(CompareTarget::Version), None) => kv.version.cmp(&0),
        (Ok(CompareTarget::Create), None) => kv.create_revision.cmp(&0),
        (Ok(CompareTarget::Mod), None) => kv.mod_revision.cmp(&0),
        (Ok(CompareTarget::Value), None) => kv.value.as_slice().cmp(&[]),
        (Ok(CompareTarget::Lease), None) => kv.lease.cmp(&0),
        // A target that disagrees with the value given, or is unknown: the
        // compare cannot hold.
        _ => return false,
    };
    match CompareResult::try_from(compare.result) {
        Ok(CompareResult::Equal) => ordering == Ordering::Equal,
        Ok(CompareResult::Greater) => ordering == Ordering::Greater,
        Ok(CompareResult::Less) => ordering == Ordering::Less,
        Ok(CompareResult::NotEqual) => ordering != Ordering::Equal,
        Err(_) => false,
    }
}

fn header(revision: i64) -> ResponseHeader {
    ResponseHeader {
        revision,
        ..ResponseHeader::default()
    }
}

fn with_revision(response: CommandResponse, revision: i64) -> CommandResponse {
    let h = Some(header(revision));
    match response {
        CommandResponse::Put(r) => CommandResponse::Put(PutResponse { header: h, ..r }),
        CommandResponse::DeleteRange(r) => {
            CommandResponse::DeleteRange(DeleteRangeResponse { header: h, ..r })
        }
        CommandResponse::Txn(r) => CommandResponse::Txn(set_txn_headers(r, revision)),
        CommandResponse::Compact(_) => CommandResponse::Compact(CompactionResponse { header: h }),
        CommandResponse::LeaseGrant(r) => {
            CommandResponse::LeaseGrant(LeaseGrantResponse { header: h, ..r })
        }
        CommandResponse::LeaseRevoke(_) => {
            CommandResponse::LeaseRevoke(LeaseRevokeResponse { header: h })
        }
        CommandResponse::LeaseExpire { expired_ids, .. } => CommandResponse::LeaseExpire {
            expired_ids,
            revision,
        },
        CommandResponse::MemberRecorded => CommandResponse::MemberRecorded,
    }
}

/// etcd gives every response inside a txn the txn's header.
fn set_txn_headers(mut response: TxnResponse, revision: i64) -> TxnResponse {
    response.header = Some(header(revision));
    // An explicit stack instead of recursion over client-shaped nesting.
    let mut stack: Vec<&mut ResponseOp> = response.responses.iter_mut().collect();
    while let Some(op) = stack.pop() {
        match &mut op.response {
            None => {}
            Some(Response::ResponseRange(r)) => r.header = Some(header(revision)),
            Some(Response::ResponsePut(r)) => r.header = Some(header(revision)),
            Some(Response::ResponseDeleteRange(r)) => r.header = Some(header(revision)),
            Some(Response::ResponseTxn(r)) => {
                r.header = Some(header(revision));
                stack.extend(r.responses.iter_mut());
            }
        }
    }
    response
}
