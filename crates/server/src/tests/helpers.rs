//! Builders for requests and commands, shared by the unit tests.

use crate::command::{
    command, CommandKind, LeaseExpireCommand, LeaseGrantCommand, LeaseRevokeCommand,
};
use crate::kv_state::{Applied, CommandResponse, KvLimits, KvState};
use crate::pb::etcdserverpb::compare::{CompareResult, CompareTarget, TargetUnion};
use crate::pb::etcdserverpb::request_op::Request;
use crate::pb::etcdserverpb::{
    CompactionRequest, Compare, DeleteRangeRequest, PutRequest, RangeRequest, RequestOp, TxnRequest,
};
use crate::pb::ferrypb::Command;
use crate::pb::mvccpb::KeyValue;

pub fn put(key: &str, value: &str) -> PutRequest {
    PutRequest {
        key: bytes::Bytes::copy_from_slice(key.as_bytes()),
        value: bytes::Bytes::copy_from_slice(value.as_bytes()),
        ..Default::default()
    }
}

pub fn put_cmd(key: &str, value: &str) -> Command {
    command(CommandKind::Put(put(key, value)))
}

pub fn put_lease_cmd(key: &str, value: &str, lease: i64) -> Command {
    command(CommandKind::Put(PutRequest {
        lease,
        ..put(key, value)
    }))
}

pub fn delete(key: &str, range_end: &str) -> DeleteRangeRequest {
    DeleteRangeRequest {
        key: key.as_bytes().to_vec(),
        range_end: range_end.as_bytes().to_vec(),
        prev_kv: true,
    }
}

pub fn delete_cmd(key: &str, range_end: &str) -> Command {
    command(CommandKind::DeleteRange(delete(key, range_end)))
}

pub fn compact_cmd(revision: i64) -> Command {
    command(CommandKind::Compact(CompactionRequest {
        revision,
        physical: false,
    }))
}

pub fn grant_cmd(id: i64, ttl_seconds: i64) -> Command {
    command(CommandKind::LeaseGrant(LeaseGrantCommand {
        id,
        ttl_seconds,
    }))
}

pub fn revoke_cmd(id: i64) -> Command {
    command(CommandKind::LeaseRevoke(LeaseRevokeCommand { id }))
}

pub fn expire_cmd(ids: Vec<i64>) -> Command {
    command(CommandKind::LeaseExpire(LeaseExpireCommand { ids }))
}

pub fn range(key: &str, range_end: &str) -> RangeRequest {
    RangeRequest {
        key: key.as_bytes().to_vec(),
        range_end: range_end.as_bytes().to_vec(),
        ..Default::default()
    }
}

pub fn op_put(key: &str, value: &str) -> RequestOp {
    RequestOp {
        request: Some(Request::RequestPut(put(key, value))),
    }
}

pub fn op_range(key: &str, range_end: &str) -> RequestOp {
    RequestOp {
        request: Some(Request::RequestRange(range(key, range_end))),
    }
}

pub fn op_delete(key: &str, range_end: &str) -> RequestOp {
    RequestOp {
        request: Some(Request::RequestDeleteRange(delete(key, range_end))),
    }
}

pub fn op_txn(txn: TxnRequest) -> RequestOp {
    RequestOp {
        request: Some(Request::RequestTxn(txn)),
    }
}

pub fn txn_cmd(txn: TxnRequest) -> Command {
    command(CommandKind::Txn(txn))
}

pub fn cmp(key: &str, result: CompareResult, target: TargetUnion) -> Compare {
    let target_kind = match &target {
        TargetUnion::Version(_) => CompareTarget::Version,
        TargetUnion::CreateRevision(_) => CompareTarget::Create,
        TargetUnion::ModRevision(_) => CompareTarget::Mod,
        TargetUnion::Value(_) => CompareTarget::Value,
        TargetUnion::Lease(_) => CompareTarget::Lease,
    };
    Compare {
        result: result as i32,
        target: target_kind as i32,
        key: key.as_bytes().to_vec(),
        target_union: Some(target),
        range_end: Vec::new(),
    }
}

/// A state machine with a counter for log indexes.
pub struct Machine {
    pub kv: KvState,
    pub index: u64,
}

impl Machine {
    pub fn new() -> Machine {
        Machine {
            kv: KvState::new(KvLimits::default()),
            index: 0,
        }
    }

    pub fn with_limits(limits: KvLimits) -> Machine {
        Machine {
            kv: KvState::new(limits),
            index: 0,
        }
    }

    /// Applies as a replica does a command this node admitted: under the
    /// bounds of its own limits, which the API writes into the command.
    pub fn apply(&mut self, mut command: Command) -> Applied {
        self.index += 1;
        if command.bounds.is_none() {
            command.bounds = Some(self.kv.limits().command_bounds());
        }
        self.kv.apply(self.index, &command)
    }

    pub fn ok(&mut self, command: Command) -> CommandResponse {
        let applied = self.apply(command);
        applied.response.expect("command should succeed")
    }

    pub fn get(&self, key: &str) -> Option<KeyValue> {
        self.kv
            .range(&range(key, ""))
            .expect("range")
            .kvs
            .into_iter()
            .next()
    }

    pub fn keys(&self, key: &str, range_end: &str) -> Vec<String> {
        self.kv
            .range(&range(key, range_end))
            .expect("range")
            .kvs
            .into_iter()
            .map(|kv| String::from_utf8(kv.key.to_vec()).expect("utf8"))
            .collect()
    }

    pub fn revision(&self) -> i64 {
        self.kv.store().revision()
    }
}

/// Runs every store job due, flushes and merges, to the end (a flush may
/// make a merge due, and the other way round).
pub fn run_store_jobs(state: &mut KvState) {
    use ferry_storage::versions::JobLane;
    for lane in [JobLane::Flush, JobLane::Merge, JobLane::Flush] {
        while let Some(job) = state.next_store_job(lane) {
            let done = job.run();
            let written = state.finish_store_job(lane, done).unwrap().commit();
            state.store_manifest_written(written.unwrap());
        }
    }
}
