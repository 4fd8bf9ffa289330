//! The replicated key-value state machine: MVCC data plus leases.
//!
//! `apply(index, command)` is deterministic: every replica that applies the
//! same commands in the same order holds the same state and gives the same
//! answers, errors included. A command either takes effect whole or not at
//! all: everything that could refuse it is checked before the first write.

use std::collections::{BTreeMap, BTreeSet};
use std::io::Read;
use std::sync::Arc;

use bytes::Bytes;
use ferry_storage::versions::{BulkLoad, JobLane};
use prost::Message;

use crate::auth::{Access, AuthError, AuthStore};
use crate::command::{decode_command, CommandKind};
use crate::error::{CodecError, KvError};
use crate::mvcc::{
    event_of, kv_response_bytes, to_event, KeyRange, MvccStore, RangeScan, ReadAt,
    SnapshotVersionCheck, Version,
};
use crate::pb::etcdserverpb::alarm_request::AlarmAction;
use crate::pb::etcdserverpb::compare::{CompareResult, CompareTarget, TargetUnion};
use crate::pb::etcdserverpb::request_op::Request;
use crate::pb::etcdserverpb::response_op::Response;
use crate::pb::etcdserverpb::{
    AlarmMember, AlarmRequest, AlarmType, CompactionRequest, CompactionResponse, Compare,
    DeleteRangeRequest, DeleteRangeResponse, LeaseGrantResponse, LeaseRevokeResponse, PutRequest,
    PutResponse, RangeRequest, RangeResponse, RequestOp, ResponseHeader, ResponseOp, TxnRequest,
    TxnResponse,
};
use crate::pb::ferrypb::{
    self, CommandBounds, LeaseExpireCommand, LeaseGrantCommand, LeaseRevokeCommand,
};
use crate::pb::mvccpb::{Event, KeyValue};
use crate::snapshot_reader::{SnapshotReader, SNAPSHOT_MAGIC};
use ferry_storage::versions::StoreView;
use std::path::Path;

use ferry_storage::Disk;

/// A flush or merge of the key-value store, to run on a blocking thread.
pub type StoreJob = ferry_storage::versions::Job<AnyDisk>;
/// What a [`StoreJob`] did.
pub type StoreJobResult = ferry_storage::Result<ferry_storage::versions::JobDone<AnyDisk>>;
/// The manifest write that makes a finished [`StoreJob`] durable.
pub type StoreManifestWrite = ferry_storage::versions::ManifestWrite<AnyDisk>;
/// A [`StoreManifestWrite`] done.
pub type StoreManifestWritten = ferry_storage::versions::ManifestWritten<AnyDisk>;
use ferry_storage::AnyDisk;

/// Largest TTL a lease may have, in seconds (etcd's MaxLeaseTTL).
pub const LEASE_TTL_SECONDS_MAX: i64 = 9_000_000_000;

/// Limits of the state machine on this node.
///
/// The request and txn limits are admission limits: the API refuses a
/// request beyond them before proposing it, and writes them into the
/// command ([`CommandBounds`]), so that every replica applies the entry
/// under the limits it was admitted under. A node's own limits therefore
/// never decide the fate of an entry another node proposed, and nodes may
/// be configured differently without their states diverging.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct KvLimits {
    /// Largest encoded request, in bytes (etcd's --max-request-bytes,
    /// default 1.5 MiB).
    pub request_size_bytes_max: usize,
    /// Most operations in one txn, nested txns included (etcd's
    /// --max-txn-ops, default 128); see [`txn_ops`] for how they count.
    pub txn_ops_max: usize,
    /// Deepest nesting of txns inside txns.
    pub txn_depth_max: usize,
    /// Largest response a txn may produce, in bytes as
    /// [`kv_response_bytes`] counts them: the key-values of its ranges and
    /// the previous values its puts and deletes return. A txn beyond it is
    /// refused whole, with the same error on every replica.
    pub txn_response_bytes_max: usize,
    /// Shortest lease TTL; shorter requests are raised to it (etcd derives
    /// it from the election timeout).
    pub lease_ttl_seconds_min: i64,
}

/// Default of [`KvLimits::request_size_bytes_max`] (etcd's).
pub const REQUEST_BYTES_MAX_DEFAULT: usize = 1536 * 1024;
/// Default of [`KvLimits::txn_ops_max`] (etcd's).
pub const TXN_OPS_MAX_DEFAULT: usize = 128;
/// Default of [`KvLimits::txn_depth_max`].
pub const TXN_DEPTH_MAX_DEFAULT: usize = 16;
/// Default of [`KvLimits::txn_response_bytes_max`]: 64 MiB, enough for any
/// txn a client sends on purpose, small enough that a node survives it.
pub const TXN_RESPONSE_BYTES_MAX_DEFAULT: usize = 64 << 20;

impl Default for KvLimits {
    fn default() -> Self {
        KvLimits {
            request_size_bytes_max: REQUEST_BYTES_MAX_DEFAULT,
            txn_ops_max: TXN_OPS_MAX_DEFAULT,
            txn_depth_max: TXN_DEPTH_MAX_DEFAULT,
            txn_response_bytes_max: TXN_RESPONSE_BYTES_MAX_DEFAULT,
            lease_ttl_seconds_min: 2,
        }
    }
}

impl KvLimits {
    /// The bounds a command admitted under these limits carries.
    pub fn command_bounds(&self) -> CommandBounds {
        CommandBounds {
            request_bytes_max: self.request_size_bytes_max as u64,
            txn_ops_max: u32::try_from(self.txn_ops_max).unwrap_or(u32::MAX),
            txn_depth_max: u32::try_from(self.txn_depth_max).unwrap_or(u32::MAX),
            txn_response_bytes_max: self.txn_response_bytes_max as u64,
        }
    }

    /// The limits written into `command` by the node that proposed it (its
    /// [`KvLimits::command_bounds`]), or the defaults for what it leaves
    /// unset. What every replica applies the command under.
    pub fn of_command(command: &ferrypb::Command) -> KvLimits {
        let defaults = KvLimits::default();
        let Some(bounds) = &command.bounds else {
            return defaults;
        };
        let pick = |value: u64, default: usize| {
            if value == 0 {
                default
            } else {
                usize::try_from(value).unwrap_or(usize::MAX)
            }
        };
        KvLimits {
            request_size_bytes_max: pick(bounds.request_bytes_max, defaults.request_size_bytes_max),
            txn_ops_max: pick(u64::from(bounds.txn_ops_max), defaults.txn_ops_max),
            txn_depth_max: pick(u64::from(bounds.txn_depth_max), defaults.txn_depth_max),
            txn_response_bytes_max: pick(
                bounds.txn_response_bytes_max,
                defaults.txn_response_bytes_max,
            ),
            // Not a bound of the command: a grant is raised to the
            // replica's own minimum (see `KvState::grant`).
            lease_ttl_seconds_min: defaults.lease_ttl_seconds_min,
        }
    }
}

/// The operations a txn counts against [`KvLimits::txn_ops_max`]: on each
/// level the largest of its compares, success ops and failure ops (as etcd
/// counts one level), plus the operations of every txn nested in either
/// branch. For a txn without nested txns this is etcd's count; with nested
/// ones it counts them all, so that a txn of 128 txns of 128 ranges costs
/// 16,512, not 128: the work of applying a txn is bounded by a small
/// multiple of this number.
pub fn txn_ops(txn: &TxnRequest) -> usize {
    let level = txn
        .compare
        .len()
        .max(txn.success.len())
        .max(txn.failure.len());
    txn.success
        .iter()
        .chain(&txn.failure)
        .filter_map(|op| match &op.request {
            Some(Request::RequestTxn(nested)) => Some(txn_ops(nested)),
            _ => None,
        })
        .fold(level, usize::saturating_add)
}

/// Whether a command may grow the store: a put, a txn that may put, a
/// lease grant (what the quota counts and a NOSPACE alarm refuses).
pub fn grows_store(command: &ferrypb::Command) -> bool {
    match &command.kind {
        Some(CommandKind::Put(_)) | Some(CommandKind::LeaseGrant(_)) => true,
        Some(CommandKind::Txn(txn)) => txn_may_put(txn),
        _ => false,
    }
}

/// Whether a txn may put a key, in either branch, at any depth (the
/// writes a NOSPACE alarm refuses). Its depth is bounded by the decoder
/// and by [`KvLimits::txn_depth_max`].
pub fn txn_may_put(txn: &TxnRequest) -> bool {
    txn.success
        .iter()
        .chain(&txn.failure)
        .any(|op| match &op.request {
            Some(Request::RequestPut(_)) => true,
            Some(Request::RequestTxn(nested)) => txn_may_put(nested),
            Some(Request::RequestRange(_)) | Some(Request::RequestDeleteRange(_)) | None => false,
        })
}

/// Whether applying a command builds the results of its reads: the
/// key-values of a txn's ranges and the previous values returned by puts
/// and deletes. Only the member a client waits on needs them; on the others
/// they would be thrown away. The state and the outcome (success or the
/// error) are the same either way: the bound on a txn's response is checked
/// from sizes, which cost no copy.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Reads {
    /// Build the whole response.
    Build,
    /// Count what the response would hold, build none of it.
    SizeOnly,
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
    /// An auth change was applied (or was a no-op, as etcd allows).
    AuthChanged {
        /// The auth revision afterwards.
        auth_revision: u64,
    },
    /// The alarms an alarm command raised or cleared.
    Alarm(Vec<AlarmMember>),
    /// A simple token was handed out: every member holds it from now on
    /// (the caller puts it into the node's token table).
    TokenAssigned(crate::auth_token::AssignedToken),
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
    /// Users, roles and permissions.
    auth: AuthStore,
    /// The raised alarms: (member id, [`AlarmType`] number).
    alarms: BTreeSet<(u64, i32)>,
}

/// Alarms the state holds at most: a member raises at most one of each
/// type, and the API raises them only for members of the cluster, so the
/// bound is never met in a healthy cluster; past it a raise is ignored
/// (the same on every replica) rather than grow the state without end.
pub const ALARMS_MAX: usize = 1024;

/// A write transaction in progress: one revision, ops numbered in order.
struct WriteTxn {
    revision: i64,
    sub_revision: u32,
    events: Vec<Event>,
    /// Every key written, in order, to undo the writes of a txn that turns
    /// out to exceed its bounds half-way.
    touched: Vec<Touched>,
    /// Whether read results are built (see [`Reads`]).
    reads: Reads,
    /// Response bytes a txn produced so far, and its limit.
    response_bytes: usize,
    response_bytes_max: usize,
}

/// One key a write transaction wrote, with the lease its live version had
/// before and has after (0 for none).
struct Touched {
    /// The key (sharing the store's bytes: no copy per write).
    key: Bytes,
    lease_before: i64,
    lease_after: i64,
}

impl WriteTxn {
    fn changed(&self) -> bool {
        self.sub_revision > 0
    }

    /// Counts `bytes` more of response against the txn's limit.
    fn charge(&mut self, bytes: usize) -> Result<(), KvError> {
        self.response_bytes = self.response_bytes.saturating_add(bytes);
        if self.response_bytes > self.response_bytes_max {
            return Err(KvError::TxnResponseTooLarge {
                bytes_max: self.response_bytes_max,
            });
        }
        Ok(())
    }

    /// Whether `bytes` more would still fit.
    fn fits(&self, bytes: usize) -> bool {
        self.response_bytes.saturating_add(bytes) <= self.response_bytes_max
    }
}

/// Keys a range scan inside a txn walks between two checks of the txn's
/// response limit, so that a scan of a large range stops soon after the
/// limit is passed.
const TXN_SCAN_STEP_KEYS: usize = 4096;

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
            auth: AuthStore::new(),
            alarms: BTreeSet::new(),
        }
    }

    /// The raised alarms, in member id then type order.
    pub fn alarms(&self) -> Vec<AlarmMember> {
        self.alarms
            .iter()
            .map(|&(member_id, alarm)| AlarmMember { member_id, alarm })
            .collect()
    }

    /// Whether member `member_id` has raised a NOSPACE alarm.
    pub fn no_space_raised_by(&self, member_id: u64) -> bool {
        self.alarms
            .contains(&(member_id, AlarmType::Nospace as i32))
    }

    /// Whether a NOSPACE alarm is raised (by any member): writes that grow
    /// the store are refused on every replica then.
    pub fn out_of_space(&self) -> bool {
        self.alarms
            .iter()
            .any(|&(_, alarm)| alarm == AlarmType::Nospace as i32)
    }

    /// Refuses a command that would grow the store while NOSPACE is
    /// raised: a put, a txn that may put (in either branch, at any depth),
    /// a lease grant. As etcd's capped applier does, deletes, compactions,
    /// revokes and everything else still apply, so that space can be won
    /// back.
    fn check_capped(&self, command: &ferrypb::Command) -> Result<(), KvError> {
        if self.out_of_space() && grows_store(command) {
            Err(KvError::NoSpace)
        } else {
            Ok(())
        }
    }

    /// Refuses a command that may write a version once the store stands at
    /// [`crate::mvcc::REVISION_MAX`] (only a snapshot restored there gets a
    /// store this far; snapshots past it are refused), so that the next
    /// revision never wraps and the state's own snapshot always restores.
    fn check_revision_room(&self, command: &ferrypb::Command) -> Result<(), KvError> {
        let may_write = match &command.kind {
            Some(CommandKind::Put(_))
            | Some(CommandKind::DeleteRange(_))
            | Some(CommandKind::Txn(_))
            | Some(CommandKind::LeaseRevoke(_))
            | Some(CommandKind::LeaseExpire(_)) => true,
            Some(CommandKind::Compact(_))
            | Some(CommandKind::LeaseGrant(_))
            | Some(CommandKind::MemberRecord(_))
            | Some(CommandKind::AuthEnable(_))
            | Some(CommandKind::AuthDisable(_))
            | Some(CommandKind::UserAdd(_))
            | Some(CommandKind::UserDelete(_))
            | Some(CommandKind::UserChangePassword(_))
            | Some(CommandKind::UserGrantRole(_))
            | Some(CommandKind::UserRevokeRole(_))
            | Some(CommandKind::RoleAdd(_))
            | Some(CommandKind::RoleDelete(_))
            | Some(CommandKind::RoleGrantPermission(_))
            | Some(CommandKind::RoleRevokePermission(_))
            | Some(CommandKind::AuthToken(_))
            | Some(CommandKind::Alarm(_))
            | None => false,
        };
        if may_write && self.store.revision() >= crate::mvcc::REVISION_MAX {
            Err(KvError::RevisionsExhausted)
        } else {
            Ok(())
        }
    }

    /// Raises or clears one alarm; answers the alarms it changed (none
    /// when there was nothing to change, as etcd answers).
    fn alarm(&mut self, request: &AlarmRequest) -> CommandResponse {
        let known = matches!(
            AlarmType::try_from(request.alarm),
            Ok(AlarmType::Nospace) | Ok(AlarmType::Corrupt)
        );
        let entry = (request.member_id, request.alarm);
        let changed = match AlarmAction::try_from(request.action) {
            Ok(AlarmAction::Activate) if known && self.alarms.len() < ALARMS_MAX => {
                self.alarms.insert(entry)
            }
            Ok(AlarmAction::Deactivate) => self.alarms.remove(&entry),
            Ok(AlarmAction::Activate) | Ok(AlarmAction::Get) | Err(_) => false,
        };
        CommandResponse::Alarm(if changed {
            vec![AlarmMember {
                member_id: request.member_id,
                alarm: request.alarm,
            }]
        } else {
            Vec::new()
        })
    }

    /// The replicated auth state.
    pub fn auth(&self) -> &AuthStore {
        &self.auth
    }

    /// Whether `user` may have `command` applied, by the auth state now
    /// (always, while auth is off). The API calls it before proposing, and
    /// every replica again at apply if the auth state changed in between.
    /// Call it after [`KvState::validate`], which bounds a txn's nesting.
    pub fn authorize(&self, user: &str, command: &ferrypb::Command) -> Result<(), KvError> {
        let auth = &self.auth;
        if !auth.enabled() {
            return Ok(());
        }
        let result = match &command.kind {
            None => Ok(()),
            Some(CommandKind::Put(put)) => self.authorize_put(user, put),
            Some(CommandKind::DeleteRange(delete)) => self.authorize_delete(user, delete),
            Some(CommandKind::Txn(txn)) => {
                // An explicit stack over the nested txns: every branch is
                // checked, whichever one the compares will pick, as etcd
                // does (the choice is not known until apply).
                let mut pending = vec![txn];
                let mut result = Ok(());
                while let Some(txn) = pending.pop() {
                    for compare in &txn.compare {
                        result = result.and_then(|()| {
                            auth.check_range(user, &compare.key, &compare.range_end, Access::Read)
                                .map_err(KvError::from)
                        });
                    }
                    for op in txn.success.iter().chain(&txn.failure) {
                        result = result.and_then(|()| match &op.request {
                            None => Ok(()),
                            Some(Request::RequestRange(range)) => auth
                                .check_range(user, &range.key, &range.range_end, Access::Read)
                                .map_err(KvError::from),
                            Some(Request::RequestPut(put)) => self.authorize_put(user, put),
                            Some(Request::RequestDeleteRange(delete)) => {
                                self.authorize_delete(user, delete)
                            }
                            Some(Request::RequestTxn(nested)) => {
                                pending.push(nested);
                                Ok(())
                            }
                        });
                    }
                    if result.is_err() {
                        break;
                    }
                }
                result
            }
            Some(CommandKind::Compact(_)) | Some(CommandKind::Alarm(_)) => {
                auth.check_admin(user).map_err(KvError::from)
            }
            Some(CommandKind::LeaseGrant(_)) => auth.check_user(user).map_err(KvError::from),
            Some(CommandKind::LeaseRevoke(LeaseRevokeCommand { id })) => {
                self.authorize_lease_keys(user, *id)
            }
            // Proposed by the nodes themselves, never for a client.
            Some(CommandKind::LeaseExpire(_)) | Some(CommandKind::MemberRecord(_)) => Ok(()),
            // Anyone may authenticate: the proposing member checked the
            // password, and the apply checks it was against this state.
            Some(CommandKind::AuthToken(_)) => Ok(()),
            Some(CommandKind::UserChangePassword(change)) if change.name == user => {
                // A user may change its own password.
                auth.check_user(user).map_err(KvError::from)
            }
            Some(CommandKind::AuthEnable(_))
            | Some(CommandKind::AuthDisable(_))
            | Some(CommandKind::UserAdd(_))
            | Some(CommandKind::UserDelete(_))
            | Some(CommandKind::UserChangePassword(_))
            | Some(CommandKind::UserGrantRole(_))
            | Some(CommandKind::UserRevokeRole(_))
            | Some(CommandKind::RoleAdd(_))
            | Some(CommandKind::RoleDelete(_))
            | Some(CommandKind::RoleGrantPermission(_))
            | Some(CommandKind::RoleRevokePermission(_)) => {
                auth.check_admin(user).map_err(KvError::from)
            }
        };
        result
    }

    fn authorize_put(&self, user: &str, put: &PutRequest) -> Result<(), KvError> {
        self.auth.check_range(user, &put.key, &[], Access::Write)?;
        if put.prev_kv {
            self.auth.check_range(user, &put.key, &[], Access::Read)?;
        }
        if put.lease != 0 {
            // A key attached to a lease goes when the lease is revoked; a
            // user who could not revoke the lease (it holds keys the user
            // may not write) may not attach more to it (etcd's rule).
            self.authorize_lease_keys(user, put.lease)?;
        }
        Ok(())
    }

    fn authorize_delete(&self, user: &str, delete: &DeleteRangeRequest) -> Result<(), KvError> {
        self.auth
            .check_range(user, &delete.key, &delete.range_end, Access::Write)?;
        if delete.prev_kv {
            self.auth
                .check_range(user, &delete.key, &delete.range_end, Access::Read)?;
        }
        Ok(())
    }

    /// Revoking a lease deletes its keys: the user must be able to write
    /// every one of them.
    pub fn authorize_lease_keys(&self, user: &str, lease: i64) -> Result<(), KvError> {
        self.auth.check_user(user)?;
        if let Some(record) = self.leases.get(&lease) {
            for key in &record.keys {
                self.auth.check_range(user, key, &[], Access::Write)?;
            }
        }
        Ok(())
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
        let mut response = self.store.range(request, at)?;
        response.header = Some(header(self.store.revision()));
        Ok(response)
    }

    /// Checks what can be checked without the state: empty keys, txn shape
    /// and size, duplicate keys, request size, against this node's limits.
    /// The API calls this before proposing (with the command's bounds set
    /// from the same limits); `apply` checks again, against the bounds the
    /// command carries, so that a replica never trusts the proposer.
    pub fn validate(&self, command: &ferrypb::Command) -> Result<(), KvError> {
        validate_under(command, &self.limits)
    }

    /// Admission check of what a txn would answer: the response bytes of
    /// its ranges and of the previous values it returns, read from the
    /// state now, against this node's [`KvLimits::txn_response_bytes_max`].
    /// Writes of the txn itself are not simulated, so this is an estimate:
    /// `apply` checks the exact amount, on every replica alike.
    pub fn admit_txn_response(&self, txn: &TxnRequest) -> Result<(), KvError> {
        let mut path = Vec::new();
        self.choose_path(txn, &mut path)?;
        let mut budget = WriteTxn {
            revision: self.store.revision() + 1,
            sub_revision: 0,
            events: Vec::new(),
            touched: Vec::new(),
            reads: Reads::SizeOnly,
            response_bytes: 0,
            response_bytes_max: self.limits.txn_response_bytes_max,
        };
        let mut cursor = 0;
        self.estimate_txn(txn, &path, &mut cursor, &mut budget)
    }

    fn estimate_txn(
        &self,
        request: &TxnRequest,
        path: &[bool],
        cursor: &mut usize,
        budget: &mut WriteTxn,
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
                Some(Request::RequestRange(range))
                    if !range.count_only
                        // The revision is checked by apply; here it only
                        // picks what to read.
                        && self.store.check_read_revision(range.revision).is_ok() =>
                {
                    let at = if range.revision > 0 {
                        ReadAt::Revision(range.revision)
                    } else {
                        ReadAt::Latest
                    };
                    self.scan_within(range, at, budget)?;
                }
                Some(Request::RequestPut(put)) if put.prev_kv => {
                    if let Some(kv) = self.store.get(&put.key, ReadAt::Latest)? {
                        budget.charge(kv_response_bytes(&kv, false))?;
                    }
                }
                Some(Request::RequestDeleteRange(delete)) if delete.prev_kv => {
                    let request = RangeRequest {
                        key: delete.key.clone(),
                        range_end: delete.range_end.clone(),
                        ..RangeRequest::default()
                    };
                    self.scan_within(&request, ReadAt::Latest, budget)?;
                }
                // Nothing to answer beyond a header.
                None
                | Some(Request::RequestRange(_))
                | Some(Request::RequestPut(_))
                | Some(Request::RequestDeleteRange(_)) => {}
                Some(Request::RequestTxn(nested)) => {
                    self.estimate_txn(nested, path, cursor, budget)?
                }
            }
        }
        Ok(())
    }

    /// Runs a range scan inside a txn and charges its response bytes,
    /// giving up as soon as they cannot fit any more.
    fn scan_within(
        &self,
        request: &RangeRequest,
        at: ReadAt,
        txn: &mut WriteTxn,
    ) -> Result<RangeScan, KvError> {
        let mut scan = RangeScan::new(request, at);
        // Without a limit, nothing collected is cut later: stop early.
        let cut_later = request.limit > 0;
        while !scan.step(&self.store, TXN_SCAN_STEP_KEYS)? {
            if !cut_later && !txn.fits(scan.collected_bytes()) {
                return Err(KvError::TxnResponseTooLarge {
                    bytes_max: txn.response_bytes_max,
                });
            }
        }
        txn.charge(scan.response_bytes())?;
        Ok(scan)
    }

    /// Decodes and applies one log entry.
    pub fn apply_bytes(&mut self, index: u64, bytes: &[u8]) -> Applied {
        self.apply_bytes_with(index, &Bytes::copy_from_slice(bytes), Reads::Build)
    }

    /// Decodes and applies one log entry, building its read results or not.
    pub fn apply_bytes_with(&mut self, index: u64, bytes: &Bytes, reads: Reads) -> Applied {
        match decode_command(bytes) {
            Ok(command) => self.apply_with(index, &command, reads),
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

    /// Applies one command at log index `index`, building its whole response.
    pub fn apply(&mut self, index: u64, command: &ferrypb::Command) -> Applied {
        self.apply_with(index, command, Reads::Build)
    }

    /// Applies one command at log index `index` under the bounds it carries
    /// (see [`KvLimits::of_command`]). Every replica gets the same state
    /// and the same outcome, whatever `reads` is; a command beyond its
    /// bounds changes nothing and answers an error.
    pub fn apply_with(&mut self, index: u64, command: &ferrypb::Command, reads: Reads) -> Applied {
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
        let applied_before = self.applied_index;
        self.applied_index = index;
        let bounds = KvLimits::of_command(command);
        let mut txn = WriteTxn {
            revision: self.store.revision() + 1,
            sub_revision: 0,
            events: Vec::new(),
            touched: Vec::new(),
            reads,
            response_bytes: 0,
            response_bytes_max: bounds.txn_response_bytes_max,
        };
        let response = match validate_under(command, &bounds) {
            Err(error) => Err(error),
            Ok(()) => match self
                .recheck(command)
                .and_then(|()| self.check_capped(command))
                .and_then(|()| self.check_revision_room(command))
            {
                Err(error) => Err(error),
                Ok(()) => self.execute(command, &mut txn),
            },
        };
        debug_assert!(
            !txn.changed() || txn.revision <= crate::mvcc::REVISION_MAX,
            "a write past the last revision (see check_revision_room)"
        );
        if response.is_err() && txn.changed() {
            // Only a txn past its response limit, or one that met a
            // storage failure, fails after writing.
            self.undo(&mut txn);
        }
        if let Err(KvError::Storage(_)) = &response {
            // This member's own failure, not the command's: the command is
            // not applied here (the caller stops applying, and it is
            // applied again after a restart).
            self.applied_index = applied_before;
        }
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

    /// A command authorized at an older auth revision than the state's is
    /// checked again against the state it applies on (the same on every
    /// replica), so that a permission revoked after the check but before
    /// the apply is not outrun. Commands without a stamp were proposed by
    /// the nodes themselves.
    fn recheck(&self, command: &ferrypb::Command) -> Result<(), KvError> {
        match &command.auth {
            Some(stamp) if self.auth.enabled() && stamp.revision != self.auth.revision() => {
                self.authorize(&stamp.user, command)
            }
            _ => Ok(()),
        }
    }

    fn auth_change(
        &mut self,
        change: impl FnOnce(&mut AuthStore) -> Result<(), AuthError>,
    ) -> Result<CommandResponse, KvError> {
        change(&mut self.auth)?;
        Ok(CommandResponse::AuthChanged {
            auth_revision: self.auth.revision(),
        })
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
                Ok(CommandResponse::Put(self.do_put(put, txn)?))
            }
            Some(CommandKind::DeleteRange(delete)) => {
                Ok(CommandResponse::DeleteRange(self.do_delete(delete, txn)?))
            }
            Some(CommandKind::Txn(request)) => {
                let mut path = Vec::new();
                self.choose_path(request, &mut path)?;
                let mut cursor = 0;
                self.check_txn(request, &path, &mut cursor)?;
                let mut cursor = 0;
                Ok(CommandResponse::Txn(self.do_txn(
                    request,
                    &path,
                    &mut cursor,
                    txn,
                )?))
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
                self.remove_lease(*id, txn)?;
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
            Some(CommandKind::AuthEnable(_)) => self.auth_change(AuthStore::enable),
            Some(CommandKind::AuthDisable(_)) => self.auth_change(|auth| {
                auth.disable();
                Ok(())
            }),
            Some(CommandKind::UserAdd(r)) => self.auth_change(|auth| auth.user_add(r)),
            Some(CommandKind::UserDelete(r)) => self.auth_change(|auth| auth.user_delete(&r.name)),
            Some(CommandKind::UserChangePassword(r)) => {
                self.auth_change(|auth| auth.user_change_password(r))
            }
            Some(CommandKind::UserGrantRole(r)) => self.auth_change(|auth| auth.user_grant_role(r)),
            Some(CommandKind::UserRevokeRole(r)) => {
                self.auth_change(|auth| auth.user_revoke_role(r))
            }
            Some(CommandKind::RoleAdd(r)) => self.auth_change(|auth| auth.role_add(&r.name)),
            Some(CommandKind::RoleDelete(r)) => self.auth_change(|auth| auth.role_delete(&r.role)),
            Some(CommandKind::RoleGrantPermission(r)) => {
                self.auth_change(|auth| auth.role_grant_permission(r))
            }
            Some(CommandKind::RoleRevokePermission(r)) => {
                self.auth_change(|auth| auth.role_revoke_permission(r))
            }
            Some(CommandKind::AuthToken(assign)) => self.assign_token(assign),
            Some(CommandKind::Alarm(request)) => Ok(self.alarm(request)),
            Some(CommandKind::LeaseExpire(LeaseExpireCommand { ids })) => {
                let mut expired_ids = Vec::new();
                for id in ids {
                    // A client revoke may have won the race; skip it then.
                    if self.leases.contains_key(id) {
                        self.remove_lease(*id, txn)?;
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

    /// A simple token, if the password it was issued on is still the
    /// user's: the auth state must not have moved since the proposing
    /// member checked it (etcd's rule; that member checks again).
    fn assign_token(&self, assign: &ferrypb::AuthTokenCommand) -> Result<CommandResponse, KvError> {
        if !self.auth.enabled() {
            return Err(AuthError::AuthNotEnabled.into());
        }
        if self.auth.revision() != assign.auth_revision {
            return Err(AuthError::AuthOldRevision.into());
        }
        let Some(user) = self.auth.users().get(&assign.user) else {
            return Err(AuthError::AuthFailed.into());
        };
        Ok(CommandResponse::TokenAssigned(
            crate::auth_token::AssignedToken {
                user: assign.user.clone(),
                token: assign.token.clone(),
                hash: user.password.clone(),
                expires_unix_ms: assign.expires_unix_ms,
                ttl_ms: assign.ttl_ms,
            },
        ))
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
    fn remove_lease(&mut self, id: i64, txn: &mut WriteTxn) -> Result<(), KvError> {
        let Some(record) = self.leases.remove(&id) else {
            return Ok(());
        };
        for key in record.keys {
            self.delete_key(&key, txn)?;
        }
        Ok(())
    }

    fn check_put(&self, put: &PutRequest) -> Result<(), KvError> {
        if put.lease != 0 && !put.ignore_lease && !self.leases.contains_key(&put.lease) {
            return Err(KvError::LeaseNotFound);
        }
        if (put.ignore_value || put.ignore_lease)
            && self.store.get(&put.key, ReadAt::Latest)?.is_none()
        {
            return Err(KvError::KeyNotFound);
        }
        Ok(())
    }

    fn do_put(&mut self, put: &PutRequest, txn: &mut WriteTxn) -> Result<PutResponse, KvError> {
        // The key's current version matters here only to keep its value or
        // lease (`store.put` looks it up anyway, for the new version's
        // numbers): a plain put does not read it twice.
        let existing = if put.ignore_value || put.ignore_lease {
            self.store.get(&put.key, ReadAt::Latest)?
        } else {
            None
        };
        let value = match (&existing, put.ignore_value) {
            (Some(kv), true) => &kv.value[..],
            _ => &put.value[..],
        };
        let lease = match (&existing, put.ignore_lease) {
            (Some(kv), true) => kv.lease,
            _ => put.lease,
        };
        let (previous, new) =
            self.store
                .put(txn.revision, txn.sub_revision, &put.key, value, lease)?;
        txn.sub_revision += 1;
        txn.touched.push(Touched {
            key: new.key.clone(),
            lease_before: previous.as_ref().map_or(0, |prev| prev.lease),
            lease_after: lease,
        });
        if let Some(prev) = &previous {
            if prev.lease != 0 && prev.lease != lease {
                if let Some(record) = self.leases.get_mut(&prev.lease) {
                    record.keys.remove(&put.key[..]);
                }
            }
        }
        if lease != 0 {
            if let Some(record) = self.leases.get_mut(&lease) {
                record.keys.insert(put.key.to_vec());
            }
        }
        txn.events.push(event_of(new, false, previous.clone()));
        Ok(PutResponse {
            header: None,
            prev_kv: if put.prev_kv && txn.reads == Reads::Build {
                previous
            } else {
                None
            },
        })
    }

    fn delete_key(&mut self, key: &[u8], txn: &mut WriteTxn) -> Result<Option<KeyValue>, KvError> {
        let Some(previous) = self.store.delete(txn.revision, txn.sub_revision, key)? else {
            return Ok(None);
        };
        txn.sub_revision += 1;
        txn.touched.push(Touched {
            key: previous.key.clone(),
            lease_before: previous.lease,
            lease_after: 0,
        });
        if previous.lease != 0 {
            if let Some(record) = self.leases.get_mut(&previous.lease) {
                record.keys.remove(key);
            }
        }
        txn.events.push(to_event(
            &Version {
                kv: Arc::new(KeyValue {
                    key: Bytes::copy_from_slice(key),
                    mod_revision: txn.revision,
                    ..KeyValue::default()
                }),
                sub_revision: txn.sub_revision - 1,
                tombstone: true,
            },
            Some(previous.clone()),
        ));
        Ok(Some(previous))
    }

    fn do_delete(
        &mut self,
        delete: &DeleteRangeRequest,
        txn: &mut WriteTxn,
    ) -> Result<DeleteRangeResponse, KvError> {
        let range = KeyRange::new(&delete.key, &delete.range_end);
        let keys: Vec<Vec<u8>> = self
            .store
            .scan(&range, ReadAt::Latest)
            .map(|kv| kv.map(|kv| kv.key.to_vec()))
            .collect::<Result<_, _>>()?;
        let mut prev_kvs = Vec::new();
        let mut deleted = 0;
        for key in keys {
            if let Some(previous) = self.delete_key(&key, txn)? {
                deleted += 1;
                if delete.prev_kv && txn.reads == Reads::Build {
                    prev_kvs.push(previous);
                }
            }
        }
        Ok(DeleteRangeResponse {
            header: None,
            deleted,
            prev_kvs,
        })
    }

    /// Evaluates every txn's compares, nested ones included, against the
    /// state before the txn runs (as etcd does), in depth-first order.
    fn choose_path(&self, request: &TxnRequest, path: &mut Vec<bool>) -> Result<(), KvError> {
        let mut succeeded = true;
        for compare in &request.compare {
            if !self.compare(compare)? {
                succeeded = false;
                break;
            }
        }
        path.push(succeeded);
        let branch = if succeeded {
            &request.success
        } else {
            &request.failure
        };
        for op in branch {
            if let Some(Request::RequestTxn(nested)) = &op.request {
                self.choose_path(nested, path)?;
            }
        }
        Ok(())
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
    ) -> Result<TxnResponse, KvError> {
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
                    Some(Response::ResponseRange(self.txn_range(range, txn)?))
                }
                Some(Request::RequestPut(put)) => {
                    let response = self.do_put(put, txn)?;
                    if put.prev_kv {
                        // What the put returns, whether built or not.
                        let previous = txn.events.last().and_then(|e| e.prev_kv.as_ref());
                        txn.charge(previous.map_or(0, |kv| kv_response_bytes(kv, false)))?;
                    }
                    Some(Response::ResponsePut(response))
                }
                Some(Request::RequestDeleteRange(delete)) => {
                    let events_before = txn.events.len();
                    let response = self.do_delete(delete, txn)?;
                    if delete.prev_kv {
                        let bytes = txn.events[events_before..]
                            .iter()
                            .filter_map(|e| e.prev_kv.as_ref())
                            .map(|kv| kv_response_bytes(kv, false))
                            .fold(0usize, usize::saturating_add);
                        txn.charge(bytes)?;
                    }
                    Some(Response::ResponseDeleteRange(response))
                }
                Some(Request::RequestTxn(nested)) => Some(Response::ResponseTxn(
                    self.do_txn(nested, path, cursor, txn)?,
                )),
            };
            responses.push(ResponseOp { response });
        }
        Ok(TxnResponse {
            header: None,
            succeeded,
            responses,
        })
    }

    /// A range inside a txn: sees the txn's earlier writes, counts against
    /// the txn's response limit, and is built only if someone reads it.
    fn txn_range(
        &self,
        range: &RangeRequest,
        txn: &mut WriteTxn,
    ) -> Result<RangeResponse, KvError> {
        if txn.reads == Reads::SizeOnly && range.count_only {
            // Nothing to count against the limit and nobody to tell.
            return Ok(RangeResponse::default());
        }
        let at = if range.revision > 0 {
            ReadAt::Revision(range.revision)
        } else {
            ReadAt::Latest
        };
        let scan = self.scan_within(range, at, txn)?;
        Ok(match txn.reads {
            Reads::Build => scan.into_response(),
            Reads::SizeOnly => RangeResponse::default(),
        })
    }

    /// Undoes every write of a write transaction that failed half-way:
    /// the store forgets the versions of the uncommitted revision and each
    /// key is attached again to the lease it had.
    fn undo(&mut self, txn: &mut WriteTxn) {
        for touched in txn.touched.drain(..).rev() {
            self.store.discard(txn.revision, &touched.key);
            if touched.lease_after != touched.lease_before {
                if let Some(record) = self.leases.get_mut(&touched.lease_after) {
                    record.keys.remove(&touched.key[..]);
                }
                if let Some(record) = self.leases.get_mut(&touched.lease_before) {
                    record.keys.insert(touched.key.to_vec());
                }
            }
        }
        txn.events.clear();
        txn.sub_revision = 0;
    }

    /// One compare; over a range every key must satisfy it. A missing key
    /// compares as zeros, except that a value compare on it fails (etcd).
    fn compare(&self, compare: &Compare) -> Result<bool, KvError> {
        let range = KeyRange::new(&compare.key, &compare.range_end);
        let mut any = false;
        for kv in self.store.scan(&range, ReadAt::Latest) {
            any = true;
            let kv = kv?;
            if !compare_kv(compare, &kv) {
                return Ok(false);
            }
        }
        if any {
            return Ok(true);
        }
        if compare.target == CompareTarget::Value as i32 {
            return Ok(false);
        }
        Ok(compare_kv(compare, &KeyValue::default()))
    }

    /// Encodes the whole state: magic, protobuf body, CRC32C of both.
    pub fn snapshot(&self) -> Result<Vec<u8>, KvError> {
        self.snapshot_source().encode()
    }

    /// What a snapshot of the state at this moment holds, taken without
    /// copying any key or value (see [`SnapshotSource`]).
    pub fn snapshot_source(&self) -> SnapshotSource {
        let (head, tail) = self.snapshot_parts();
        SnapshotSource {
            head,
            view: self.store.view(),
            compacted_revision: self.store.compacted_revision(),
            tail,
        }
    }

    /// Everything a snapshot holds but the versions: the scalar fields
    /// (1-4) and the leases, members and auth state (fields 6-8).
    fn snapshot_parts(&self) -> (ferrypb::Snapshot, ferrypb::Snapshot) {
        let head = ferrypb::Snapshot {
            applied_index: self.applied_index,
            revision: self.store.revision(),
            compacted_revision: self.store.compacted_revision(),
            lease_id_next: self.lease_id_next,
            ..ferrypb::Snapshot::default()
        };
        let tail = ferrypb::Snapshot {
            leases: self
                .leases
                .iter()
                .map(|(id, record)| ferrypb::SnapshotLease {
                    id: *id,
                    granted_ttl_seconds: record.granted_ttl_seconds,
                    keys: record.keys.iter().cloned().collect(),
                })
                .collect(),
            members: self.members.values().cloned().collect(),
            // Left out while untouched, so that the snapshots of a
            // cluster that never used auth keep their earlier bytes
            // (restoring without it gives the same untouched state).
            auth: (self.auth != AuthStore::new()).then(|| self.auth.to_snapshot()),
            alarms: self.alarms(),
            ..ferrypb::Snapshot::default()
        };
        (head, tail)
    }

    /// Rebuilds a state machine from [`KvState::snapshot`] bytes, checking
    /// the magic, the checksum and the consistency of the contents.
    pub fn restore(bytes: &[u8], limits: KvLimits) -> Result<KvState, CodecError> {
        let mut source = bytes;
        KvState::restore_from(&mut source, limits)
    }

    /// The same, read from `source` as a stream, into memory.
    pub fn restore_from(source: &mut dyn Read, limits: KvLimits) -> Result<KvState, CodecError> {
        let mut reader = SnapshotReader::new(source)?;
        let mut versions = Vec::new();
        while let Some(version) = reader.next_version()? {
            versions.push(snapshot_version(version)?);
        }
        let snapshot = reader.finish()?;
        let store = MvccStore::from_parts(snapshot.revision, snapshot.compacted_revision, versions)
            .map_err(CodecError::Inconsistent)?;
        let state = KvState::assemble(snapshot, store, limits)?;
        state.check_lease_keys()?;
        Ok(state)
    }

    /// The same, read from `source` as a stream and written as it comes
    /// into a new store in `dir` on `disk` (whose files are removed
    /// first), durable when this returns. It takes the memory of one
    /// version and a block, never of the whole state; on an error the
    /// directory holds no store.
    pub fn restore_into(
        source: &mut dyn Read,
        disk: AnyDisk,
        dir: &Path,
        limits: KvLimits,
    ) -> Result<KvState, CodecError> {
        KvState::restore_into_as(source, disk, dir, limits, |_| {})
    }

    /// [`KvState::restore_into`], with `rewrite` changing the small parts
    /// of the snapshot (everything but the versions) before they are
    /// written: a backup restored for a new cluster leaves its old
    /// members and applied index behind.
    pub(crate) fn restore_into_as(
        source: &mut dyn Read,
        disk: AnyDisk,
        dir: &Path,
        limits: KvLimits,
        rewrite: impl FnOnce(&mut ferrypb::Snapshot),
    ) -> Result<KvState, CodecError> {
        let storage = |e: ferry_storage::StorageError| CodecError::Read(e.to_string());
        ferry_storage::disk::create_dir_durably(&disk, dir).map_err(storage)?;
        let clear = || -> Result<(), CodecError> {
            let leftovers = disk
                .list_files(dir)
                .map_err(|e| CodecError::Read(format!("list {}: {e}", dir.display())))?;
            for name in leftovers {
                let path = dir.join(name);
                disk.remove_file(&path)
                    .map_err(|e| CodecError::Read(format!("remove {}: {e}", path.display())))?;
            }
            Ok(())
        };
        clear()?;
        let loaded = (|| -> Result<KvState, CodecError> {
            let mut reader = SnapshotReader::new(source)?;
            let mut load = BulkLoad::create(disk.clone(), dir).map_err(storage)?;
            let mut check = SnapshotVersionCheck::default();
            while let Some(version) = reader.next_version()? {
                let record = check
                    .check(&snapshot_version(version)?)
                    .map_err(CodecError::Inconsistent)?;
                load.push(&record).map_err(storage)?;
            }
            let mut snapshot = reader.finish()?;
            rewrite(&mut snapshot);
            crate::mvcc::check_positions(snapshot.revision, snapshot.compacted_revision)
                .map_err(CodecError::Inconsistent)?;
            check
                .finish(snapshot.revision)
                .map_err(CodecError::Inconsistent)?;
            let floor = crate::mvcc::versions_floor_of(snapshot.compacted_revision);
            let meta = bytes::Bytes::from(snapshot.encode_to_vec());
            load.finish(snapshot.applied_index, meta, floor)
                .map_err(storage)?;
            let state = KvState::open(disk.clone(), dir, limits)?;
            state.check_lease_keys()?;
            Ok(state)
        })();
        if loaded.is_err() {
            let _ = clear();
        }
        loaded
    }

    /// Checks that the keys each lease records are exactly the keys whose
    /// newest version names it (a scan of every key: for a snapshot that
    /// carries every version anyway).
    fn check_lease_keys(&self) -> Result<(), CodecError> {
        let mut attached = 0usize;
        let everything = KeyRange::new(&[0], &[0]);
        for kv in self.store.scan(&everything, ReadAt::Latest) {
            let kv = kv.map_err(|e| CodecError::Inconsistent(e.to_string()))?;
            if kv.lease == 0 {
                continue;
            }
            let recorded = self
                .leases
                .get(&kv.lease)
                .is_some_and(|record| record.keys.contains(kv.key.as_ref()));
            if !recorded {
                return Err(CodecError::Inconsistent(format!(
                    "key {:?} is attached to lease {}, which does not record it",
                    String::from_utf8_lossy(&kv.key),
                    kv.lease
                )));
            }
            attached += 1;
        }
        let recorded: usize = self.leases.values().map(|record| record.keys.len()).sum();
        if recorded != attached {
            return Err(CodecError::Inconsistent(format!(
                "the leases record {recorded} attached keys, the versions attach {attached}"
            )));
        }
        Ok(())
    }

    /// A state from the small parts of a snapshot (everything but the
    /// versions) and a store holding the versions. The keys attached to
    /// each lease come from the snapshot's leases, so that a store opened
    /// from disk is never read whole; [`KvState::restore`] checks them
    /// against the versions it decoded.
    fn assemble(
        snapshot: ferrypb::Snapshot,
        store: MvccStore,
        limits: KvLimits,
    ) -> Result<KvState, CodecError> {
        let mut leases: BTreeMap<i64, LeaseRecord> = BTreeMap::new();
        for lease in snapshot.leases {
            let record = LeaseRecord {
                granted_ttl_seconds: lease.granted_ttl_seconds,
                keys: lease.keys.into_iter().collect(),
            };
            if leases.insert(lease.id, record).is_some() {
                return Err(CodecError::Inconsistent(format!(
                    "lease {} appears twice",
                    lease.id
                )));
            }
        }
        Ok(KvState {
            store,
            leases,
            lease_id_next: snapshot.lease_id_next,
            applied_index: snapshot.applied_index,
            limits,
            members: snapshot.members.into_iter().map(|m| (m.id, m)).collect(),
            auth: AuthStore::from_snapshot(snapshot.auth).map_err(CodecError::Inconsistent)?,
            alarms: snapshot
                .alarms
                .into_iter()
                .take(ALARMS_MAX)
                .map(|a| (a.member_id, a.alarm))
                .collect(),
        })
    }

    /// The state kept on `disk` in `dir` (a new, empty one if there is
    /// none): the versions from the store's runs, the rest from what the
    /// last flush recorded beside them. It stands at the applied index of
    /// that flush; the log after it is applied again.
    pub fn open(disk: AnyDisk, dir: &Path, limits: KvLimits) -> Result<KvState, CodecError> {
        let (mut store, meta) =
            MvccStore::open(disk, dir).map_err(|e| CodecError::Inconsistent(e.to_string()))?;
        if meta.is_empty() {
            return Ok(KvState {
                store,
                ..KvState::new(limits)
            });
        }
        let snapshot = ferrypb::Snapshot::decode(meta.as_ref())
            .map_err(|e| CodecError::Malformed(e.to_string()))?;
        store
            .set_positions(snapshot.revision, snapshot.compacted_revision)
            .map_err(CodecError::Inconsistent)?;
        KvState::assemble(snapshot, store, limits)
    }

    /// Everything but the versions, as the store records it beside them.
    fn meta(&self) -> bytes::Bytes {
        let (mut head, tail) = self.snapshot_parts();
        head.leases = tail.leases;
        head.members = tail.members;
        head.auth = tail.auth;
        head.alarms = tail.alarms;
        bytes::Bytes::from(head.encode_to_vec())
    }

    /// What a snapshot of the state at its durable point holds: exactly
    /// what a reopen of the store would find (the state a follower is sent
    /// when the state lives on disk, so that it skips no entry beyond what
    /// the leader made durable).
    pub fn durable_snapshot_source(&self) -> Result<SnapshotSource, KvError> {
        let view = self.store.durable_view();
        let mut head = if view.meta().is_empty() {
            // Nothing flushed yet: the empty state.
            ferrypb::Snapshot {
                revision: 1,
                lease_id_next: 1,
                ..ferrypb::Snapshot::default()
            }
        } else {
            ferrypb::Snapshot::decode(view.meta().as_ref())
                .map_err(|e| KvError::Storage(format!("the state beside the store: {e}")))?
        };
        let tail = ferrypb::Snapshot {
            leases: std::mem::take(&mut head.leases),
            members: std::mem::take(&mut head.members),
            auth: head.auth.take(),
            alarms: std::mem::take(&mut head.alarms),
            ..ferrypb::Snapshot::default()
        };
        head.versions.clear();
        Ok(SnapshotSource {
            compacted_revision: head.compacted_revision,
            head,
            view,
            tail,
        })
    }

    /// Bytes of versions written since the last checkpoint.
    pub fn unflushed_bytes(&self) -> usize {
        self.store.unflushed_bytes()
    }

    /// Marks the state at the current applied index for the next flush to
    /// make durable (see [`KvState::next_store_job`]).
    pub fn checkpoint(&mut self) {
        let meta = self.meta();
        self.store.checkpoint(self.applied_index, meta);
    }

    /// Checkpoints the state and asks the store to merge all its runs,
    /// with what the checkpoint flushes, into one (a defragment); the
    /// ticket tells when it is done (`self.store().full_merge_done`).
    pub fn request_full_merge(&mut self) -> u64 {
        self.checkpoint();
        self.store.request_full_merge(self.applied_index)
    }

    /// The next flush or merge of the store to run (off the apply path),
    /// if one of `lane` is due and none of that lane runs.
    pub fn next_store_job(&mut self, lane: JobLane) -> Option<StoreJob> {
        self.store.next_job(lane)
    }

    /// Installs what a store job did; the write returned (to commit
    /// without the state's lock) makes it durable.
    pub fn finish_store_job(
        &mut self,
        lane: JobLane,
        done: StoreJobResult,
    ) -> Result<StoreManifestWrite, KvError> {
        self.store.finish_job(lane, done)
    }

    /// Records a store manifest written: the durable index moves. Returns
    /// what the store let go of, to drop off the state's lock (see
    /// [`ferry_storage::versions::VersionStore::manifest_written`]).
    pub fn store_manifest_written(&mut self, written: StoreManifestWritten) -> StoreView<AnyDisk> {
        self.store.manifest_written(written)
    }

    /// The applied index the state on disk is complete up to.
    pub fn durable_index(&self) -> u64 {
        self.store.durable_marker()
    }

    /// Where members added at run time can be reached, by id.
    pub fn member_records(&self) -> &BTreeMap<u64, ferrypb::MemberRecordCommand> {
        &self.members
    }
}

/// A version as a snapshot carries it, as the store holds it.
fn snapshot_version(version: ferrypb::SnapshotVersion) -> Result<Version, CodecError> {
    let kv = version
        .kv
        .ok_or_else(|| CodecError::Inconsistent("a version without a key-value".into()))?;
    Ok(Version {
        kv: Arc::new(kv),
        sub_revision: version.sub_revision,
        tombstone: version.tombstone,
    })
}

/// Checks a snapshot as it streams by, without building the state: what
/// restoring it ([`KvState::restore_into`]) would refuse, for a reader that
/// only inspects it (`ferry snapshot status`), so that a file it calls
/// whole is one a restore takes. Holds the keys attached to leases (as
/// many as the snapshot's lease table lists), nothing else of the state.
#[derive(Debug, Default)]
pub(crate) struct SnapshotCheck {
    versions: SnapshotVersionCheck,
    /// The key whose versions are being read, and the lease its newest
    /// version so far is attached to (0 for none, or a tombstone).
    current: Option<(Vec<u8>, i64)>,
    /// Per lease, the keys whose newest version is live and attached to it.
    attached: BTreeMap<i64, BTreeSet<Vec<u8>>>,
}

impl SnapshotCheck {
    /// Checks the next version (in store order).
    pub(crate) fn version(&mut self, version: ferrypb::SnapshotVersion) -> Result<(), CodecError> {
        let version = snapshot_version(version)?;
        self.versions
            .check(&version)
            .map_err(CodecError::Inconsistent)?;
        let lease = if version.tombstone {
            0
        } else {
            version.kv.lease
        };
        match &mut self.current {
            Some((key, newest)) if *key == version.kv.key => *newest = lease,
            _ => {
                self.close_key();
                self.current = Some((version.kv.key.to_vec(), lease));
            }
        }
        Ok(())
    }

    fn close_key(&mut self) {
        if let Some((key, lease)) = self.current.take() {
            if lease != 0 {
                self.attached.entry(lease).or_default().insert(key);
            }
        }
    }

    /// Checks the rest of the snapshot against the versions seen: the
    /// revisions, each lease's keys (exactly the keys attached to it), the
    /// auth state.
    pub(crate) fn finish(mut self, snapshot: &ferrypb::Snapshot) -> Result<(), CodecError> {
        self.close_key();
        crate::mvcc::check_positions(snapshot.revision, snapshot.compacted_revision)
            .map_err(CodecError::Inconsistent)?;
        self.versions
            .finish(snapshot.revision)
            .map_err(CodecError::Inconsistent)?;
        let mut recorded: BTreeMap<i64, BTreeSet<Vec<u8>>> = BTreeMap::new();
        for lease in &snapshot.leases {
            let keys = lease.keys.iter().cloned().collect();
            if recorded.insert(lease.id, keys).is_some() {
                return Err(CodecError::Inconsistent(format!(
                    "lease {} appears twice",
                    lease.id
                )));
            }
        }
        for (lease, keys) in &self.attached {
            if recorded.get(lease) != Some(keys) {
                return Err(CodecError::Inconsistent(format!(
                    "lease {lease} does not record the keys attached to it"
                )));
            }
        }
        if let Some((lease, _)) = recorded
            .iter()
            .find(|(lease, keys)| !keys.is_empty() && !self.attached.contains_key(lease))
        {
            return Err(CodecError::Inconsistent(format!(
                "lease {lease} records keys that are not attached to it"
            )));
        }
        AuthStore::from_snapshot(snapshot.auth.clone()).map_err(CodecError::Inconsistent)?;
        Ok(())
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
/// 1-4 (`head`), each version as field 5, then fields 6-8 (`tail`). Field
/// order is what prost's derived encoder uses, so the bytes are the same;
/// a test checks that against the derived encoder.
#[derive(Debug, Clone)]
pub struct SnapshotSource {
    /// Only the scalar fields 1-4 are set.
    head: ferrypb::Snapshot,
    /// Every stored version, in key order, oldest first per key, as the
    /// store held it (read through the compaction, see
    /// [`crate::mvcc::compacted_versions`]).
    view: StoreView<AnyDisk>,
    compacted_revision: i64,
    /// Only the leases, members and auth state (fields 6-8) are set.
    tail: ferrypb::Snapshot,
}

impl SnapshotSource {
    /// The applied index the snapshot covers.
    pub fn applied_index(&self) -> u64 {
        self.head.applied_index
    }

    /// The store's revision the snapshot holds.
    pub fn revision(&self) -> i64 {
        self.head.revision
    }

    /// A checksum of the whole state the snapshot holds (every version,
    /// the leases, the members, the auth state): etcd's `Hash`. The
    /// applied index is left out, so members that applied the same
    /// commands agree whatever entries without effect (a lease renewal, a
    /// no-op) they applied besides. Computed over the encoding in pieces,
    /// with no copy of the state.
    pub fn content_hash(mut self) -> Result<u32, KvError> {
        self.head.applied_index = 0;
        // The encoding ends with the crc32c of all that precedes it, written
        // as the last piece: that checksum is the hash. (A checksum over the
        // whole encoding would not do: a CRC over data followed by its own
        // CRC is the same constant for any data.)
        let mut checksum = [0u8; 4];
        self.write_to(|piece| {
            if let Ok(bytes) = <[u8; 4]>::try_from(piece) {
                checksum = bytes;
            }
            Ok::<(), KvError>(())
        })?;
        Ok(u32::from_le_bytes(checksum))
    }

    /// Encodes the snapshot into one buffer (see [`KvState::snapshot`]).
    pub fn encode(&self) -> Result<Vec<u8>, KvError> {
        let mut bytes = Vec::new();
        self.write_to(|piece| {
            bytes.extend_from_slice(piece);
            Ok::<(), KvError>(())
        })?;
        Ok(bytes)
    }

    /// Size of the encoded snapshot, magic and checksum included.
    pub fn encoded_len(&self) -> Result<usize, KvError> {
        let mut versions = 0usize;
        self.for_each_version(|version| {
            let body = version_body_len(&version);
            versions += 1 + prost::length_delimiter_len(body) + body;
            Ok::<(), KvError>(())
        })?;
        Ok(SNAPSHOT_MAGIC.len() + self.head.encoded_len() + versions + self.tail.encoded_len() + 4)
    }

    /// Calls `visit` with every version the snapshot holds, in order.
    fn for_each_version<E: From<KvError>>(
        &self,
        mut visit: impl FnMut(Version) -> Result<(), E>,
    ) -> Result<(), E> {
        for group in crate::mvcc::groups(self.view.iter(&[], std::ops::Bound::Unbounded)) {
            let group = group?;
            for record in crate::mvcc::compacted_versions(&group, self.compacted_revision) {
                visit(crate::mvcc::decode_version(record)?)?;
            }
        }
        Ok(())
    }

    /// Streams the encoded snapshot to `sink` in pieces of about 1 MiB, so
    /// that the whole encoding never has to be in memory at once. Returns
    /// the number of bytes written; a failed read of the store stops it.
    pub fn write_to<E: From<KvError>>(
        &self,
        mut sink: impl FnMut(&[u8]) -> Result<(), E>,
    ) -> Result<u64, E> {
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
        self.for_each_version::<E>(|version| {
            buffer.push(KEY_SNAPSHOT_VERSIONS);
            encode_varint(version_body_len(&version) as u64, &mut buffer);
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
            Ok(())
        })?;
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

/// [`KvState::validate`] under the given limits.
fn validate_under(command: &ferrypb::Command, limits: &KvLimits) -> Result<(), KvError> {
    if crate::command::encoded_command_len(command) > limits.request_size_bytes_max {
        return Err(KvError::RequestTooLarge);
    }
    match &command.kind {
        None => Err(KvError::Decode(CodecError::MissingKind)),
        Some(CommandKind::Put(put)) => validate_put(put),
        Some(CommandKind::DeleteRange(delete)) => check_key(&delete.key),
        Some(CommandKind::Txn(txn)) => {
            validate_txn(txn, 1, limits)?;
            // After the shape check, which bounds the depth of this walk.
            if txn_ops(txn) > limits.txn_ops_max {
                return Err(KvError::TooManyTxnOps);
            }
            Ok(())
        }
        Some(CommandKind::Compact(_))
        | Some(CommandKind::Alarm(_))
        | Some(CommandKind::LeaseGrant(_))
        | Some(CommandKind::LeaseRevoke(_))
        | Some(CommandKind::LeaseExpire(_))
        | Some(CommandKind::MemberRecord(_))
        | Some(CommandKind::AuthEnable(_))
        | Some(CommandKind::AuthDisable(_))
        | Some(CommandKind::UserAdd(_))
        | Some(CommandKind::UserDelete(_))
        | Some(CommandKind::UserChangePassword(_))
        | Some(CommandKind::UserGrantRole(_))
        | Some(CommandKind::UserRevokeRole(_))
        | Some(CommandKind::RoleAdd(_))
        | Some(CommandKind::RoleDelete(_))
        | Some(CommandKind::RoleGrantPermission(_))
        | Some(CommandKind::RoleRevokePermission(_)) => Ok(()),
        Some(CommandKind::AuthToken(assign)) => {
            if assign.user.is_empty()
                || assign.token.is_empty()
                || assign.token.len() > crate::auth_token::TOKEN_BYTES_MAX
            {
                return Err(AuthError::AuthFailed.into());
            }
            Ok(())
        }
    }
}

/// Checks a txn's shape; returns the keys its branches may put and the
/// ranges they may delete, so that an enclosing txn can check them.
fn validate_txn(txn: &TxnRequest, depth: usize, limits: &KvLimits) -> Result<TxnKeys, KvError> {
    if depth > limits.txn_depth_max {
        return Err(KvError::TxnTooDeep {
            depth_max: limits.txn_depth_max,
        });
    }
    let ops_max = limits.txn_ops_max;
    if txn.compare.len() > ops_max || txn.success.len() > ops_max || txn.failure.len() > ops_max {
        return Err(KvError::TooManyTxnOps);
    }
    for compare in &txn.compare {
        check_key(&compare.key)?;
    }
    let mut union = TxnKeys::default();
    for branch in [&txn.success, &txn.failure] {
        let keys = validate_branch(branch, depth, limits)?;
        union.puts.extend(keys.puts);
        union.deletes.extend(keys.deletes);
    }
    Ok(union)
}

fn validate_branch(
    branch: &[RequestOp],
    depth: usize,
    limits: &KvLimits,
) -> Result<TxnKeys, KvError> {
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
                seen.puts.insert(put.key.to_vec());
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
                let nested_keys = validate_txn(nested, depth + 1, limits)?;
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
        (Ok(CompareTarget::Value), Some(TargetUnion::Value(v))) => {
            kv.value.as_ref().cmp(v.as_slice())
        }
        (Ok(CompareTarget::Lease), Some(TargetUnion::Lease(v))) => kv.lease.cmp(v),
        // proto3 drops zero-valued oneof members from some encoders; etcd
        // reads them as zero, and so do we.
        (Ok(CompareTarget::Version), None) => kv.version.cmp(&0),
        (Ok(CompareTarget::Create), None) => kv.create_revision.cmp(&0),
        (Ok(CompareTarget::Mod), None) => kv.mod_revision.cmp(&0),
        (Ok(CompareTarget::Value), None) => kv.value.as_ref().cmp(&[]),
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
        CommandResponse::Alarm(alarms) => CommandResponse::Alarm(alarms),
        CommandResponse::TokenAssigned(token) => CommandResponse::TokenAssigned(token),
        CommandResponse::AuthChanged { auth_revision } => {
            CommandResponse::AuthChanged { auth_revision }
        }
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
